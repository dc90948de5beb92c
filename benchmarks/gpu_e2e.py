"""The H200 end-to-end check and benchmark, in one run with a hard time budget (the lead runs this once).

    python3 benchmarks/gpu_e2e.py [--budget-s 520] [--skip-slice] [--jobs 14]

In order, every stage printing its result or its error (then going on), with timestamps:
  (a) tiny and small V4.1 presets: compile for sm90, generate greedily through the engine (LLM(target="sm90"))
      on the GPU, and compare with the CPU fp32 interpreter under the tolerance below;
  (b) the real-dims slice benchmark (benchmarks/bench_slice.py), reduced to what the remaining time allows;
  then a summary table. Files go under $OUT (or --out).

Tolerance (issue 7: "bf16/fp8 tolerances written down and justified"). The GPU path rounds activations to
bf16 where kernels take bf16 and quantises GEMM inputs to FP8 per group; the CPU interpreter runs the same
graph in fp32. On random-weight models these roundings change discrete choices (MoE top-k, index top-k,
candidate blocks), so the logit difference is not small: on CPU, replacing the kernels by their exact-order
torch emulations (same bf16/FP8 formats, runtime/kernel_adapters.emulated_kernel) already moves tiny's logits
by ~25% of their range -- the formats, not the kernels, set the scale. So the checks are:
  1. every kernel agrees with its op's reference on its first real call (max abs err <= 0.1 of the
     reference's max; a kernel that fails is disabled and counted -- the pass needs zero disabled);
  2. teacher-forced along the GPU's greedy tokens, the GPU's max abs logit error against fp32 is at most
     2x (+0.05 of the logit range) the error the CPU emulation of the same formats has against fp32:
     the kernels are no worse than their number formats;
  3. the GPU's greedy token equals the fp32 argmax at every step where the fp32 top-2 margin exceeds
     2x that step's measured max abs logit error (where a flip is impossible unless the error bound is
     wrong); steps below the margin are reported, not failed, and the first divergence step is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(tempfile.gettempdir(), "deepinfer-tilelang-cache"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(tempfile.gettempdir(), "deepinfer-triton-cache"))

_ROOT = Path(__file__).resolve().parents[1]
try:
    import deepinfer  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`: the repo root is the package
    import importlib.util

    spec = importlib.util.spec_from_file_location("deepinfer", _ROOT / "__init__.py",
                                                  submodule_search_locations=[str(_ROOT)])  # fmt: skip
    sys.modules["deepinfer"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["deepinfer"])

import torch  # noqa: E402

T0 = time.time()
PROMPTS = [[0, 5, 17, 300, 42], [0, 9000, 12, 77, 5, 6, 7, 1000, 2], [0, *range(100, 111)], [0, *range(2000, 2030, 2)]]


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def left(deadline: float) -> float:
    return deadline - time.time()


def guarded(name: str, fn, *args, **kw):
    """Run one stage; print its error and go on (the run must reach the summary)."""
    try:
        return fn(*args, **kw)
    except Exception as e:
        log(f"{name}: ERROR {type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc(limit=4)
        return None


# ---------------------------------------------------------------------------------------------- kernels


def prebuild(keys: list, jobs: int, timeout_s: float) -> dict:
    """Build kernels in `jobs` processes so the main process finds them in TileLang's disk cache."""
    import multiprocessing as mp

    from deepinfer.runtime.kernel_adapters import prebuild_one

    if not keys or jobs <= 0:
        return {}
    t0 = time.time()
    errors: dict = {}
    with mp.get_context("spawn").Pool(min(jobs, len(keys))) as pool:
        res = pool.map_async(prebuild_one, keys)
        try:
            out = res.get(timeout=max(5.0, timeout_s))
        except mp.TimeoutError:
            log(f"prebuild: timed out after {timeout_s:.0f} s; the rest compile lazily or fall back")
            pool.terminate()
            return {"timeout": True}
    for k, e in zip(keys, out):
        if e:
            errors[k.describe()] = e
    log(f"prebuilt {len(keys)} kernels in {time.time() - t0:.0f} s with {min(jobs, len(keys))} processes, "
        f"{len(errors)} failed")  # fmt: skip
    for k, e in errors.items():
        log(f"  build error: {k}: {e}")
    return errors


# ---------------------------------------------------------------------------------------------- (a)


def _teacher_inputs(g, seq: list[int], device):
    from deepinfer.runtime.session import allocate_caches

    feeds = {"tokens": torch.tensor(seq, device=device), "positions": torch.arange(len(seq), device=device)}
    feeds.update(allocate_caches(g, len(seq) + 1, device=device))
    return feeds


def _cpu_logits(g, params, seq, emulate: bool):
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.cuda_executor import GraphExecutor, KernelCache

    ka.EMULATE = emulate
    try:
        ex = GraphExecutor(g, params, compiled=emulate, kernels=KernelCache(builder=ka.emulated_kernel), verify=False)
        return ex.run(_teacher_inputs(g, seq, "cpu"))[0].float()
    finally:
        ka.EMULATE = False


def e2e_preset(preset: str, n_tokens: int, jobs: int, deadline: float) -> dict:
    from deepinfer.compiler import compile_model
    from deepinfer.runtime.cuda_executor import restack_experts
    from deepinfer.runtime.engine import LLM
    from deepinfer.runtime.plan import bind_weights
    from deepinfer.runtime.sampler import SamplingParams

    row: dict = {"preset": preset}
    plan = compile_model(f"deepseek-v4.1-flash:{preset}", "sm90").plan
    params, _ = bind_weights(plan)
    log(f"{preset}: compiled for sm90 ({len(plan.graph.nodes)} nodes)")
    llm = LLM(plan=plan, target="sm90", params=params, tokenizer=None, max_model_len=128, max_num_seqs=4,
              overlap=False)  # fmt: skip
    runner = llm.executor.runner
    runner.exec.kernels.budget_s = max(10.0, left(deadline) - 60)
    keys: list = []
    for t in sorted({len(p) for p in PROMPTS} | {1, max(len(p) for p in PROMPTS) + n_tokens - 1}):
        feeds = _teacher_inputs(plan.graph, [(7 * i) % 1000 for i in range(t)], "cuda")
        keys += [k for k in runner.exec.kernel_keys(feeds) if k not in keys]
    log(f"{preset}: {len(keys)} distinct kernels to build")
    row["prebuild_errors"] = len(prebuild(keys, jobs, left(deadline) - 90))
    t0 = time.time()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True))
    row["generate_s"] = time.time() - t0
    log(f"{preset}: generated {n_tokens} tokens x {len(PROMPTS)} prompts on the GPU in {row['generate_s']:.1f} s")
    print(runner.report(), flush=True)
    c, r = runner.exec.stats.total()
    row.update(compiled=c, reference=r, disabled=len(runner.exec.kernels.failed))
    cpu_params = dict(params)
    restack_experts(plan.graph, cpu_params)
    row.update(compare(plan.graph, cpu_params, runner, outs, preset))
    return row


def compare(g, cpu_params, runner, outs, preset: str) -> dict:
    """Teacher-forced along the GPU's tokens: GPU, fp32 CPU and CPU-emulated logits at every generated step."""
    torch.set_num_threads(os.cpu_count() or 16)
    worst = {"err_gpu": 0.0, "err_emul": 0.0, "err_gpu_emul": 0.0, "range": 0.0}
    steps = decisive = decisive_bad = 0
    first_div = []
    for out in outs:
        prompt, gen = out.prompt_token_ids, out.token_ids
        if out.error or not gen:
            first_div.append(f"error: {out.error}")
            continue
        seq = prompt + gen[:-1]
        rows = slice(len(prompt) - 1, len(seq))
        ref = _cpu_logits(g, cpu_params, seq, emulate=False)[rows]
        emul = _cpu_logits(g, cpu_params, seq, emulate=True)[rows]
        gpu = runner.exec.run(_teacher_inputs(g, seq, "cuda"))[0].float().cpu()[rows]
        err = (gpu - ref).abs().amax(-1)
        top2 = ref.topk(2, -1).values
        margin = top2[:, 0] - top2[:, 1]
        cpu_tok = ref.argmax(-1)
        gen_t = torch.tensor(gen)
        dec = margin > 2 * err
        steps += len(gen)
        decisive += int(dec.sum())
        decisive_bad += int((dec & (cpu_tok != gen_t)).sum())
        diff = torch.nonzero(cpu_tok != gen_t).flatten()
        first_div.append(int(diff[0]) if diff.numel() else len(gen))
        worst["err_gpu"] = max(worst["err_gpu"], float(err.max()))
        worst["err_emul"] = max(worst["err_emul"], float((emul - ref).abs().max()))
        worst["err_gpu_emul"] = max(worst["err_gpu_emul"], float((gpu - emul).abs().max()))
        worst["range"] = max(worst["range"], float(ref.abs().max()))
    bound = 2 * worst["err_emul"] + 0.05 * worst["range"]
    res = {**worst, "steps": steps, "decisive": decisive, "decisive_mismatch": decisive_bad,
           "tokens_equal_first": first_div, "error_bound": bound}  # fmt: skip
    res["pass"] = bool(steps and decisive_bad == 0 and worst["err_gpu"] <= bound)
    log(f"{preset}: max|logit gpu-fp32| {worst['err_gpu']:.3f}, emulated formats vs fp32 {worst['err_emul']:.3f}, "
        f"gpu vs emulated {worst['err_gpu_emul']:.3f} (logit range {worst['range']:.2f}; bound {bound:.3f})")
    log(f"{preset}: {steps} steps, {decisive} decisive (fp32 top-2 margin > 2x error), {decisive_bad} decisive "
        f"mismatches; greedy tokens equal fp32 for the first {first_div} steps per prompt -> "
        f"{'PASS' if res['pass'] else 'FAIL'}")  # fmt: skip
    return res


# ---------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=520.0, help="hard wall-clock budget of the whole run")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 16) - 2), help="kernel build processes")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_e2e_out")
    ap.add_argument("--skip-slice", action="store_true")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt (tiny; small uses 2/3)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    end = T0 + args.budget_s
    if not torch.cuda.is_available():
        print("gpu_e2e: error: needs a CUDA device (an H200); this machine has none", file=sys.stderr)
        return 2
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, budget {args.budget_s:.0f} s")
    rows = []
    for preset, n, share in (("tiny", args.tokens, 0.22), ("small", max(4, args.tokens * 2 // 3), 0.25)):
        if left(end) < 120:
            log(f"{preset}: skipped (time budget)")
            continue
        r = guarded(f"e2e {preset}", e2e_preset, preset, n, args.jobs, time.time() + share * args.budget_s)
        rows.append(r or {"preset": preset, "pass": False, "error": True})
        torch.cuda.empty_cache()
    slice_rows = None
    if not args.skip_slice and left(end) > 90:
        slice_rows = guarded("bench slice", _slice, out, left(end) - 20, args.jobs)
    (out / "gpu_e2e.json").write_text(json.dumps({"e2e": rows, "slice": slice_rows}, indent=1, default=str))
    summary(rows, slice_rows)
    log(f"done; files under {out}")
    return 0


def _slice(out: Path, budget: float, jobs: int):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_slice

    # reduced for the time budget: decode 1/16/64 (256 via `deepinfer bench`), prefill 4096 (8192 there).
    # No torch.compile baseline here: dynamo traces the executor's per-node Python loop, breaks the graph at the
    # references' host reads (.item(), int(positions[0]), nonzero, unique().tolist()) and recompiles _run_node per
    # node until its recompile limit (the first H200 run: ~110 s of the budget, then eager for the rest), so the
    # figure would not be torch.compile's; the eager reference of the same graph is the baseline.
    return bench_slice.run(out_dir=out, budget_s=budget, jobs=jobs, batches=(1, 16, 64), prefill=4096, reps=3,
                           torch_compile=False)  # fmt: skip


def summary(rows: list, slice_rows) -> None:
    print("\n=== summary ===")
    print(f"{'preset':<7} {'pass':<5} {'compiled':>8} {'ref':>6} {'disabled':>8} {'err gpu':>8} {'err fmt':>8} "
          f"{'bound':>7} {'decisive':>9} {'bad':>4}")  # fmt: skip
    for r in rows:
        if r.get("error"):
            print(f"{r['preset']:<7} ERROR (see above)")
            continue
        print(f"{r['preset']:<7} {str(r.get('pass')):<5} {r.get('compiled', 0):>8} {r.get('reference', 0):>6} "
              f"{r.get('disabled', 0):>8} {r.get('err_gpu', 0):>8.3f} {r.get('err_emul', 0):>8.3f} "
              f"{r.get('error_bound', 0):>7.3f} {r.get('decisive', 0):>5}/{r.get('steps', 0):<3} "
              f"{r.get('decisive_mismatch', 0):>4}")  # fmt: skip
    if slice_rows:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_slice

        bench_slice.print_table(slice_rows)


if __name__ == "__main__":
    sys.exit(main())
