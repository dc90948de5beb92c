"""The H200 check of the GPU runtime (issue 7): device-resident KV caches and CUDA-graph decode.

    python3 benchmarks/gpu_runtime_check.py [--budget-s 230] [--jobs 14] [--presets tiny,small]

Per preset (tiny, then small V4.1 compiled for sm90, seeded random weights), with timestamps:
  1. pre-build the kernels the runs need (TileLang, in --jobs processes; the rest build lazily or fall back);
  2. generate greedily through the engine (LLM(target="sm90")) in four modes on one kernel cache:
       graphs  KV pools on the GPU, one batched decode step replayed as a CUDA graph per bucket (the default)
       eager   the same, decode steps run eagerly (cuda_graphs=False)
       single  KV pools on the GPU, chained one-sequence decode steps as CUDA graphs (batched_decode=False)
       host    KV pools on the host (kv_cache_device="cpu"): caches copied host -> device -> host every step
     each at two shapes: a batch of 8 requests (decode bucket 8) and a single request (bucket 1); every mode
     runs once to warm up (kernel builds, first-call checks, graph capture) and once timed;
  3. checks: graphs == eager and single == host give identical tokens and identical logits rows (bitwise) at
     every sampled step (SAME_BITS), the graphs mode replayed graphs and no bucket fell back to eager (the runner
     report is printed);
then a table: decode tokens/s and ms per decode step per mode and batch, the speed-ups, and PASS/FAIL.
Decode time is the executor's time on batches whose every item runs one token (the GPU is synchronised at
the end of each step: the sampled logits rows come back to the host). Results go to $OUT/gpu_runtime.json.

    python3 benchmarks/gpu_runtime_check.py --adapters [--experts fp8] [--adapter-tokens 1,16,64] --presets ''

checks the kernels the runtime binds at decode (issue 6/8: two-pool sparse attention, swap-AB masked MoE with the
fused SwiGLU epilogue or W4A8, routing, mHC post+pre, and the older families) at the REAL V4.1 dims: a slice of
real layers (--adapter-layers, bench_slice.py's construction, random weights in the checkpoint formats) runs
through the compiled executor at each token count with 4096 cached tokens; every kernel set meets its node's
torch reference on the same inputs at its first call (the executor's check; a mismatch disables it and counts
as FAIL here), each new family must take its nodes, and the call is timed against the all-reference executor;
then (--adapter-graphs on) the same step as one CUDA graph per layer (runtime/layer_graphs.py): every layer must
be captured and replay the eager step (else the check FAILs and names the layer and the reason), per-layer ms.
Results go to $OUT/gpu_adapters.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _checkout  # noqa: E402,F401  (kernel cache dirs; `deepinfer` importable from a plain checkout)
import torch  # noqa: E402

T0 = time.time()
MODES = (("graphs", {}), ("eager", {"cuda_graphs": False}), ("single", {"batched_decode": False}),
         ("host", {"kv_cache_device": "cpu"}))
# bit-equal pairs: the batched default's graphs vs its eager steps (same buckets); the one-sequence decode steps vs
# the host-KV forward (both one sequence per call). The batched step is not the one-sequence one's bits at B > 1
# (GEMMs at M = B; docs/batched-decode.md), so graphs vs single is timed, not compared.
SAME_BITS = (("graphs", "eager"), ("single", "host"))
MAX_MODEL_LEN = 128
DEVICE = "cuda"


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def prompts(n: int, seed: int) -> list[list[int]]:
    return [[0, *[(97 * seed + 31 * i + 7 * j + 5) % 120000 for j in range(1, 6 + (i % 8))]] for i in range(n)]


# ---------------------------------------------------------------------------------------------- kernels


def prebuild(keys: list, jobs: int, timeout_s: float) -> int:
    """Build kernels in `jobs` processes (TileLang's disk cache); returns the number that failed."""
    from deepinfer.runtime.kernel_adapters import prebuild as build_in_processes

    return len(build_in_processes(keys, jobs, timeout_s, log))


# ---------------------------------------------------------------------------------------------- runs


class StepTimer:
    """Wraps the executor: time of every batch (GPU synchronised), decode batches counted apart."""

    def __init__(self, llm):
        self.inner = llm.executor.execute
        llm.executor.execute = self
        self.reset()

    def reset(self) -> None:
        self.decode_s = self.other_s = 0.0
        self.decode_tokens = self.decode_steps = 0

    def __call__(self, batch):
        t0 = time.perf_counter()
        out = self.inner(batch)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        live = [i for i in batch.items if not i.stale]
        if live and all(i.end - i.start == 1 for i in live):
            self.decode_s += dt
            self.decode_steps += 1
            self.decode_tokens += len(live)
        else:
            self.other_s += dt
        return out


def generate(llm, reqs: list[list[int]], n_tokens: int, record: dict | None):
    import deepinfer.runtime.executor as ex_mod
    from deepinfer.runtime.sampler import SamplingParams

    orig = ex_mod.sample_row

    def spy(row, params, seed, position, prompt, output):
        record[(tuple(prompt), position)] = row.clone()
        return orig(row, params, seed, position, prompt, output)

    if record is not None:
        ex_mod.sample_row = spy
    try:
        outs = llm.generate(reqs, SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True))
    finally:
        ex_mod.sample_row = orig
    return [o.token_ids for o in outs], [o.error for o in outs if o.error]


def run_preset(preset: str, n_tokens: int, jobs: int, deadline: float) -> dict:
    from deepinfer.compiler import compile_model
    from deepinfer.runtime.engine import LLM
    from deepinfer.runtime.plan import bind_weights
    from deepinfer.runtime.session import allocate_caches

    t0 = time.time()
    plan = compile_model(f"deepseek-v4.1-flash:{preset}", "sm90").plan
    params, _ = bind_weights(plan)
    g = plan.graph
    log(f"{preset}: compiled for sm90 ({len(g.nodes)} nodes) in {time.time() - t0:.1f} s")
    llms = {}
    for name, kw in MODES:
        # graph_warmup=False: each mode runs once to warm up (below), on the one kernel cache set after this; a
        # warm-up at construction would build every decode kernel in each engine's own cache first
        llms[name] = LLM(plan=plan, target="sm90", params=params, tokenizer=None, max_model_len=MAX_MODEL_LEN,
                         max_num_seqs=8, overlap=False, graph_warmup=False, **kw)  # fmt: skip
    kernels = llms["graphs"].executor.runner.exec.kernels
    for llm in llms.values():
        llm.executor.runner.use_kernels(kernels)  # one kernel cache: same shapes, built once
    batches = {"B=8": prompts(8, 1), "B=1": prompts(1, 2)}
    lengths = {1} | {len(p) for ps in batches.values() for p in ps}
    runner = llms["graphs"].executor.runner
    keys: list = []
    for t in sorted(lengths):
        feeds = {"tokens": torch.arange(3, 3 + t, device=DEVICE), "positions": torch.arange(t, device=DEVICE),
                 **allocate_caches(g, MAX_MODEL_LEN, device=DEVICE)}  # fmt: skip
        keys += [k for k in runner.exec.kernel_keys(feeds) if k not in keys]
    pb_s = max(20.0, 0.45 * (deadline - time.time()))
    log(f"{preset}: {len(keys)} distinct kernels (token counts {sorted(lengths)}), pre-build budget {pb_s:.0f} s")
    prebuild(keys, jobs, pb_s)
    kernels.budget_s = max(10.0, deadline - time.time() - 30)

    timers = {name: StepTimer(llm) for name, llm in llms.items()}
    res: dict = {"preset": preset, "tokens": n_tokens, "rows": []}
    results: dict = {}
    for label, reqs in batches.items():
        for name, llm in llms.items():
            if time.time() > deadline:
                log(f"{preset} {label} {name}: skipped (time budget)")
                continue
            tw = time.time()
            generate(llm, reqs, n_tokens, None)  # warm-up: kernel builds, first-call checks, graph capture
            timers[name].reset()
            rec: dict = {}
            tt = time.time()
            toks, errors = generate(llm, reqs, n_tokens, rec)
            wall = time.time() - tt
            tm = timers[name]
            tok_s = tm.decode_tokens / tm.decode_s if tm.decode_s else 0.0
            ms = 1e3 * tm.decode_s / max(tm.decode_steps, 1)
            results[(label, name)] = (toks, rec)
            row = {"batch": label, "mode": name, "decode_tok_s": tok_s, "ms_per_step": ms, "steps": tm.decode_steps,
                   "decode_tokens": tm.decode_tokens, "other_s": tm.other_s, "wall_s": wall, "errors": errors,
                   "warmup_s": tt - tw}  # fmt: skip
            res["rows"].append(row)
            log(f"{preset} {label} {name:>6}: {tok_s:8.1f} decode tok/s, {ms:7.2f} ms/step over {tm.decode_steps} "
                f"decode steps ({tm.decode_tokens} tokens); prefill {tm.other_s:.2f} s; warm-up {tt - tw:.1f} s"
                + (f"; ERRORS {errors[:2]}" if errors else ""))  # fmt: skip
    # checks
    checks = []
    for label in batches:
        for ref, name in SAME_BITS:
            base, other = results.get((label, ref)), results.get((label, name))
            if base is None or other is None:
                checks.append((f"{label} {ref} == {name}", None, "not run"))
                continue
            same_tok = base[0] == other[0]
            ka, kb = base[1].keys(), other[1].keys()
            diffs = [float((base[1][k] - other[1][k]).abs().max()) for k in ka & kb]
            same_rows = ka == kb and all(torch.equal(base[1][k], other[1][k]) for k in ka)
            rows = ("identical" if same_rows else f"differ (max abs {max(diffs, default=0):.3g})" if ka == kb
                    else f"sampled at different steps ({len(ka)} vs {len(kb)})")  # fmt: skip
            detail = f"tokens {'equal' if same_tok else 'DIFFER'}, logits rows {rows} at {len(ka)} sampled steps"
            checks.append((f"{label} {ref} == {name}", same_tok and same_rows, detail))
    report = runner.report()
    print(report, flush=True)
    dg = runner.graphs
    replayed = sum(dg.replays.values())
    checks.append(("graphs replayed, no bucket eager", bool(replayed and not dg.failed and not dg.blocked),
                   f"{replayed} replays; captured buckets {sorted(dg.graphs)}; failed {dg.failed or '-'}; "
                   f"blocked {dg.blocked or '-'}"))  # fmt: skip
    checks.append(("kv pools on the GPU", all(t.is_cuda for t in llms["graphs"].kv.pools.values()),
                   f"graphs/eager pools on {llms['graphs'].kv.device}, host mode on {llms['host'].kv.device}"))
    c, r = runner.exec.stats.total()
    res.update(compiled=c, reference=r, disabled=len(kernels.failed), report=report,
               checks=[{"check": n, "pass": ok, "detail": d} for n, ok, d in checks])  # fmt: skip
    for n, ok, d in checks:
        log(f"{preset}: {'PASS' if ok else 'FAIL' if ok is False else 'SKIP'} {n}: {d}")
    for llm in llms.values():
        llm.close()
    return res


NEW_FAMILIES = ("sparse_attn_decode", "moe_grouped_gemm", "moe_routing", "hyper_connection")


def check_adapters(layers: tuple, experts: str, tokens: tuple, context: int, jobs: int, deadline: float,
                   graphs: bool = True) -> dict:  # fmt: skip
    """The runtime's kernels at the real dims against their node references (module doc)."""
    import bench_slice as bs  # a sibling: benchmarks/ is on sys.path (above)

    from deepinfer.runtime.cuda_executor import GraphExecutor, KernelCache
    from deepinfer.runtime.kernel_adapters import MAX_POSITIONS

    t0 = time.time()
    g = bs.slice_graph(layers, experts)
    params = bs.gpu_weights(g)
    torch.cuda.synchronize()
    log(f"adapters ({experts} experts, layers {list(layers)}): {len(g.nodes)} nodes, "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB of weights, {time.time() - t0:.0f} s")  # fmt: skip
    # sync-free references at every T and rope tables sized once: the per-layer graphs capture these steps
    comp = GraphExecutor(g, params, kernels=KernelCache(budget_s=max(30.0, deadline - time.time() - 60)),
                         sync_free="always", max_positions=context + max(tokens))  # fmt: skip
    comp.prep_cache[MAX_POSITIONS] = context + max(tokens)
    eager = GraphExecutor(g, params, compiled=False)
    feeds = {t: bs._inputs(g, t, context) for t in tokens}
    keys: list = []
    for f in feeds.values():
        keys += [k for k in comp.kernel_keys(f) if k not in keys]
    log(f"adapters: {len(keys)} distinct kernels for T in {list(tokens)}")
    prebuild(keys, jobs, max(20.0, 0.6 * (deadline - time.time())))
    res: dict = {"experts": experts, "layers": list(layers), "rows": [], "checks": []}
    for t, f in feeds.items():
        if time.time() > deadline - 15:
            res["checks"].append({"check": f"T={t}", "pass": None, "detail": "skipped (time budget)"})
            continue
        comp.run(f)  # first call: builds and checks every kernel set against its node's reference
        runs = bs._node_runs(comp, lambda f=f: comp.run(f))
        ms = bs.time_call(lambda f=f: comp.run(f), 5)
        eager_ms = bs.time_call(lambda f=f: eager.run(f), 3)
        comp.run(f, profile=True)
        row = {"tokens": t, "ms": ms, "eager_ms": eager_ms, **runs, "op_times": comp.op_times}
        res["rows"].append(row)
        log(f"adapters T={t}: slowest ops (ms, summed over nodes): "
            + "; ".join(f"{k} {v:.2f}" for k, v in list(comp.op_times.items())[:10]))  # fmt: skip
        if graphs and time.time() < deadline - 20:
            try:
                _graph_check(bs, comp, f, t, row, res)
            except Exception as e:  # the executor's rows above stand; the graph check FAILs with the error
                traceback.print_exc(limit=6)
                res["checks"].append({"check": f"T={t}: per-layer CUDA graphs", "pass": False,
                                      "detail": f"{type(e).__name__}: {str(e)[:200]}"})  # fmt: skip
        missing = [fam for fam in NEW_FAMILIES if not runs["compiled"].get(fam)]
        res["checks"].append({"check": f"T={t}: every new family takes its nodes", "pass": not missing,
                              "detail": f"compiled {runs['compiled']}" + (f"; MISSING {missing}" if missing else "")})
        log(f"adapters T={t}: compiled {ms:.2f} ms vs references {eager_ms:.2f} ms; {sum(runs['compiled'].values())} "
            f"compiled / {sum(runs['reference'].values())} reference node runs")  # fmt: skip
    worst = max(comp.stats.verified.values(), default=float("nan"))
    res["checks"].append({"check": "every kernel set passed its first-call check", "pass": not comp.kernels.failed,
                          "detail": f"{len(comp.stats.verified)} sets, worst rel err {worst:.2e}; disabled "
                                    f"{[(k.describe(), why) for k, why in comp.kernels.failed.items()] or '-'}"})
    res["report"] = comp.report()
    print(res["report"], flush=True)
    for c in res["checks"]:
        verdict = "PASS" if c["pass"] else "FAIL" if c["pass"] is False else "SKIP"
        log(f"adapters: {verdict} {c['check']}: {c['detail']}")
    return res  # the weights go with this frame; the caller empties the allocator's cache


def _graph_check(bs, comp, feeds: dict, t: int, row: dict, res: dict) -> None:
    """The same step as one CUDA graph per layer (runtime/layer_graphs.py): every layer must be captured and
    replay the eager step; per-layer replay ms next to the executor's."""
    from deepinfer.runtime.cuda_graphs import CudaGraphBackend
    from deepinfer.runtime.layer_graphs import LayerGraphs

    lg = LayerGraphs(comp, feeds, CudaGraphBackend(torch.device(DEVICE)))
    lg.prepare()
    per, total = bs.time_graph_layers(lg, 5)
    row.update(graph_ms=total, graph_layers=per, fell_back=lg.fell_back())
    log(f"adapters T={t}: {lg.report()}")
    log(f"adapters T={t}: per-layer graphs {total:.2f} ms vs executor {row['ms']:.2f} ms; per layer (ms) "
        + ", ".join(f"{k} {v:.3f}" for k, v in per.items()))  # fmt: skip
    res["checks"].append({"check": f"T={t}: every layer replays a CUDA graph of the eager step", "pass": not lg.eager,
                          "detail": "; ".join(f"{k}: {v}" for k, v in lg.fell_back().items()) or
                          f"{len(lg.segments)} segments, {total:.2f} ms"})  # fmt: skip


def summary(all_res: list[dict]) -> None:
    print("\n=== decode throughput (tokens/s; ms per decode step) ===")
    print(f"{'preset':>7} {'batch':>5} {'graphs':>16} {'eager':>16} {'single':>16} {'host KV':>16} "
          f"{'graphs/eager':>12} {'graphs/single':>13} {'graphs/host':>11}")  # fmt: skip
    for res in all_res:
        for label in ("B=8", "B=1"):
            by = {r["mode"]: r for r in res.get("rows", []) if r.get("batch") == label}
            if not by:
                continue
            cells = [f"{by[m]['decode_tok_s']:7.1f} ({by[m]['ms_per_step']:5.1f})" if m in by else f"{'-':>16}"
                     for m in ("graphs", "eager", "single", "host")]  # fmt: skip
            sp = [f"{by['graphs']['decode_tok_s'] / by[m]['decode_tok_s']:.2f}x"
                  if "graphs" in by and m in by and by[m]["decode_tok_s"] else "-" for m in ("eager", "single", "host")]
            print(f"{res['preset']:>7} {label:>5} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} {cells[3]:>16} "
                  f"{sp[0]:>12} {sp[1]:>13} {sp[2]:>11}")  # fmt: skip
    for res in all_res:
        for r in res.get("rows", []):
            if "tokens" in r and "mode" not in r:
                print(f"{res['preset']:>7}  T={r['tokens']:<3} compiled {r['ms']:8.2f} ms, references "
                      f"{r['eager_ms']:8.2f} ms ({r['eager_ms'] / r['ms']:.2f}x); node runs "
                      f"{sum(r['compiled'].values())} compiled / {sum(r['reference'].values())} reference")  # fmt: skip
    print("\n=== checks ===")
    for res in all_res:
        for c in res.get("checks", []):
            verdict = "PASS" if c["pass"] else "FAIL" if c["pass"] is False else "SKIP"
            print(f"{res['preset']:>7} {verdict:>4}  {c['check']}: {c['detail']}")
        if res.get("error"):
            print(f"{res['preset']:>7} FAIL  error: {res['error']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=230.0, help="wall-clock budget of the whole run")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 16) - 2), help="kernel build processes")
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per request (small uses 3/4)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_runtime_out")
    ap.add_argument("--adapters", action="store_true", help="check the runtime's kernels at the real V4.1 dims first")
    ap.add_argument("--adapter-layers", default="2,20", help="real layer ids of the adapters' slice")
    ap.add_argument("--adapter-tokens", default="1,16,64", help="token counts of the adapters' check")
    ap.add_argument("--experts", default="fp8", help="fp8 and/or fp4 (W4A8), comma separated")
    ap.add_argument("--adapter-graphs", choices=("on", "off"), default="on",
                    help="the adapters' steps also as per-layer CUDA graphs (runtime/layer_graphs.py)")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="build the adapters' slice graph(s) only (no GPU)")
    args = ap.parse_args(argv)
    if args.dry_run:
        import bench_slice as bs

        for experts in args.experts.split(","):
            g = bs.slice_graph(tuple(int(x) for x in args.adapter_layers.split(",")), experts)
            log(f"adapters' slice ({experts}): {len(g.nodes)} nodes, coverage {g.meta['kernels']['coverage']}")
        return 0
    if not torch.cuda.is_available():
        print("gpu_runtime_check: error: needs a CUDA device (an H200); this machine has none", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    end = T0 + args.budget_s
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, budget {args.budget_s:.0f} s")
    presets = [p for p in args.presets.split(",") if p]
    shares = {"tiny": 0.42, "small": 1.0} if len(presets) > 1 else {p: 1.0 for p in presets}
    all_res = []
    if args.adapters:
        kinds = [e for e in args.experts.split(",") if e]
        share = 1.0 if not presets else 0.5
        for i, experts in enumerate(kinds):
            deadline = T0 + share * args.budget_s * (i + 1) / len(kinds) - 5
            try:
                res = check_adapters(tuple(int(x) for x in args.adapter_layers.split(",")), experts,
                                     tuple(int(x) for x in args.adapter_tokens.split(",")), 4096, args.jobs,
                                     deadline, args.adapter_graphs == "on")  # fmt: skip
            except Exception as e:
                log(f"adapters ({experts}): ERROR {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=6)
                res = {"experts": experts, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            (out / f"gpu_adapters_{experts}.json").write_text(json.dumps(res, indent=1, default=str))
            all_res.append({"preset": f"real-{experts}", **res})
            torch.cuda.empty_cache()
        shares = {p: share + (1 - share) * s for p, s in shares.items()}
    for preset in presets:
        if end - time.time() < 45:
            log(f"{preset}: skipped (time budget)")
            continue
        n = args.tokens if preset == "tiny" else max(8, args.tokens * 3 // 4)
        deadline = min(end, T0 + shares.get(preset, 1.0) * args.budget_s) - 5
        try:
            all_res.append(run_preset(preset, n, args.jobs, deadline))
        except Exception as e:
            log(f"{preset}: ERROR {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=6)
            all_res.append({"preset": preset, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        torch.cuda.empty_cache()
    (out / "gpu_runtime.json").write_text(json.dumps(all_res, indent=1, default=str))
    summary(all_res)
    ok = all(c["pass"] for r in all_res for c in r.get("checks", [])) and not any(r.get("error") for r in all_res)
    log(f"done ({'all checks pass' if ok else 'some checks FAIL'}); {out / 'gpu_runtime.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
