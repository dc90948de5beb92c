"""Decode graphs warmed up at engine start (runtime/cuda_graphs.warm_up_buckets) on an H200: what the warm-up costs at
start per bucket, and what each bucket's first decode step costs after it -- one eager step (the kernels' first-call
checks run there, on real data; the kernels are built, nothing compiles or captures), then replays -- against an
engine that captures each bucket at its first use (graph_warmup=False), whose first step of a bucket carries the
eager step, the host-read check, the capture and the replay check (and the JIT compiles where they are cold).

    python3 benchmarks/decode_warmup.py [--model deepseek-v4.1-flash:tiny] [--jobs 14] [--max-model-len 512]
                                        [--steps-per-size 3] [--first-use-first] [--budget-s 150] [--dry-run]

One process: compile the plan (no kernels), then two engines on it, each pre-building the TileLang kernels it looks
up (prebuild_jobs). By default the warm-up engine runs first, so its start pays the cold Triton JIT compiles (Triton
kernels are not pre-built); the first-use engine then finds every kernel compiled in this process, so its
first-step stall is what remains on warm caches (eager step, checks, capture) -- a lower bound of a cold one
(--first-use-first swaps the order: then the first-use engine's first steps carry the JIT compiles).
Workload: 16 greedy requests whose lengths are staggered so the decode batch shrinks 16 -> 1, each size held for
--steps-per-size steps: every bucket (16, 8, 4, 2, 1) is entered once, then replayed.
Printed: the warm-up line, a table per bucket (warm-up s at start and the capture alone; per engine the first
decode step's ms, the median of the later ones (replays) and their ratio; the first-use engine's first step over
the warm-up engine's: the stall the warm-up saves), and the check that both engines give the same tokens and sampled
logits rows bit for bit (same buckets, same kernels: a replay equals the eager step).
--dry-run (CPU): compile and print the workload's decode batch sizes per bucket; no engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _checkout  # noqa: E402,F401  (kernel cache dirs; `deepinfer` importable from a plain checkout)

T0 = time.time()
N_REQUESTS = 16  # the largest decode bucket (runtime/cuda_graphs.BUCKETS)


def log(msg: str) -> None:
    print(f"[decode_warmup {time.time() - T0:6.1f}s] {msg}", flush=True)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v4.1-flash:tiny", help="name:preset (random weights)")
    ap.add_argument("--jobs", "-j", type=int, default=max(1, (os.cpu_count() or 2) - 2), help="kernel build processes")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--steps-per-size", type=int, default=3, help="decode steps at each batch size 16, 15, ..., 1")
    ap.add_argument("--first-use-first", action="store_true", help="run the first-use engine first (cold JIT there)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="no second engine past this (wall s)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "decode_warmup_out")
    ap.add_argument("--dry-run", action="store_true", help="CPU: compile and print the workload only")
    return ap.parse_args(argv)


def workload(steps_per_size: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """16 prompts (3-14 tokens: each prefilled whole in the first step, under one 16-token block -- a longer one
    is split at the block boundary and would start decoding a step later) and their max_tokens: request i generates
    1 + k (i + 1) tokens (the first from its prefill), so decode step s (1-based) runs 16 - (s - 1) // k sequences:
    each batch size for k steps."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(3 + (7 * i) % 12)] for i in range(N_REQUESTS)]
    return prompts, [1 + steps_per_size * (i + 1) for i in range(N_REQUESTS)]


def decode_sizes(max_tokens: list[int]) -> list[int]:
    """The decode batch size of every engine step after the prefill (all prompts prefilled in the first step)."""
    return [sum(m - 1 >= s for m in max_tokens) for s in range(1, max(max_tokens))]


def bucket_of(n: int) -> int:
    from deepinfer.runtime import cuda_graphs as cg

    return next(b for b in cg.BUCKETS if b >= n)


def run_engine(plan, args, name: str, warm: bool, prompts, max_tokens) -> dict:
    """One engine: its start (prebuild, and the warm-up where ``warm``), then the workload with every decode call
    timed (runner.decode returns the logits on the host: the step is finished) and every sampled row kept."""
    import deepinfer.runtime.executor as ex_mod
    from deepinfer.runtime.engine import LLM
    from deepinfer.runtime.sampler import SamplingParams

    t = time.perf_counter()
    llm = LLM(plan=plan, target="sm90", tokenizer=None, max_model_len=args.max_model_len, max_num_seqs=N_REQUESTS,
              max_num_batched_tokens=1024, prebuild_jobs=args.jobs, overlap=False, graph_warmup=warm)  # fmt: skip
    start_s = time.perf_counter() - t
    runner = llm.executor.runner
    steps: list[tuple[int, float]] = []
    rows: dict = {}
    decode, sample_row = runner.decode, ex_mod.sample_row

    def timed_decode(tokens, positions, fill):
        t = time.perf_counter()
        out = decode(tokens, positions, fill)
        steps.append((len(tokens), time.perf_counter() - t))
        return out

    def spy(row, params, seed, position, prompt, output):
        rows[(tuple(prompt), position)] = row.clone()
        return sample_row(row, params, seed, position, prompt, output)

    runner.decode, ex_mod.sample_row = timed_decode, spy
    try:
        t = time.perf_counter()
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
        outs = llm.generate(prompts, params)
        generate_s = time.perf_counter() - t
    finally:
        ex_mod.sample_row = sample_row
    dg = runner.graphs
    log(f"{name}: engine start {start_s:.1f} s, {len(steps)} decode steps in {generate_s:.1f} s")
    print(dg.report(), flush=True)
    llm.close()
    return {"name": name, "start_s": start_s, "generate_s": generate_s, "warm_line": llm.graph_warmup,
            "warm_s": dict(dg.warm_s), "capture_s": dict(dg.capture_s), "failed": dict(dg.failed),
            "steps": steps, "tokens": [o.token_ids for o in outs], "rows": rows,
            "finished": sum(o.finish_reason == "length" for o in outs)}  # fmt: skip


def per_bucket(steps: list[tuple[int, float]]) -> dict[int, tuple[float, float | None, int]]:
    """bucket -> (first step s, median of its later steps s or None, number of steps)."""
    out: dict[int, list[float]] = {}
    for n, s in steps:
        out.setdefault(bucket_of(n), []).append(s)
    return {b: (v[0], statistics.median(v[1:]) if len(v) > 1 else None, len(v)) for b, v in out.items()}


def table(runs: list[dict]) -> None:
    from deepinfer.runtime import cuda_graphs as cg

    warm = next((r for r in runs if r["warm_s"]), None)
    stats = {r["name"]: per_bucket(r["steps"]) for r in runs}
    head = f"{'bucket':>6} {'warm-up s':>9} {'capture s':>9}"
    for r in runs:
        head += f" | {r['name'] + ' first ms':>18} {'later ms':>9} {'ratio':>6}"
    head += " | first use / warm-up first"
    print("\n" + head)
    for b in sorted(cg.BUCKETS, reverse=True):
        ws = f"{warm['warm_s'][b]:9.2f}" if warm and b in warm["warm_s"] else f"{'-':>9}"
        cs = f"{warm['capture_s'][b]:9.3f}" if warm and b in warm["capture_s"] else f"{'eager':>9}"
        line = f"{b:>6} {ws} {cs}"
        for r in runs:
            first, later, _ = stats[r["name"]].get(b, (None, None, 0))
            if first is None:
                line += f" | {'-':>18} {'-':>9} {'-':>6}"
                continue
            ratio = f"{first / later:6.2f}" if later else f"{'-':>6}"
            later_ms = f"{later * 1e3:9.2f}" if later else f"{'-':>9}"
            line += f" | {first * 1e3:18.2f} {later_ms} {ratio}"
        firsts = {r["name"]: stats[r["name"]].get(b, (None,))[0] for r in runs}
        if firsts.get("warm-up") and firsts.get("first use"):
            line += f" | {firsts['first use'] / firsts['warm-up']:6.1f}x"
        print(line)
    for r in runs:
        print(f"{r['name']}: engine start {r['start_s']:.1f} s, workload {r['generate_s']:.2f} s, "
              f"{r['finished']}/{N_REQUESTS} requests finished")  # fmt: skip


def same_results(a: dict, b: dict) -> tuple[bool, str]:
    import torch

    same_tokens = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
    keys = a["rows"].keys() & b["rows"].keys()
    equal = sum(torch.equal(a["rows"][k], b["rows"][k]) for k in keys)
    diff = max((float((a["rows"][k] - b["rows"][k]).abs().max()) for k in keys), default=0.0)
    ok = same_tokens == N_REQUESTS and equal == len(keys) == len(a["rows"]) == len(b["rows"])
    return ok, (f"tokens equal {same_tokens}/{N_REQUESTS} requests; sampled logits rows bit-equal {equal}/{len(keys)} "
                f"(max |diff| {diff:.3g})")  # fmt: skip


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from deepinfer.compiler import compile_model

    t = time.perf_counter()
    plan = compile_model(args.model, "sm90", kernels="none").plan
    vocab = int(plan.graph.outputs[0].shape[-1])
    prompts, max_tokens = workload(args.steps_per_size, min(vocab, 120000))
    sizes = decode_sizes(max_tokens)
    by_bucket: dict[int, list[int]] = {}
    for n in sizes:
        by_bucket.setdefault(bucket_of(n), []).append(n)
    log(f"{args.model}: compiled for sm90 in {time.perf_counter() - t:.1f} s; workload: {len(sizes)} decode steps, "
        + ", ".join(f"bucket {b}: {len(v)} steps (batch {max(v)}..{min(v)})" for b, v in by_bucket.items()))
    if args.dry_run:
        return 0
    if not torch.cuda.is_available():
        print("decode_warmup: error: needs a CUDA device (--dry-run runs on the CPU)", file=sys.stderr)
        return 2
    order = [("warm-up", True), ("first use", False)]
    if args.first_use_first:
        order.reverse()
    runs = []
    for name, warm in order:
        if runs and time.time() - T0 > args.budget_s:
            log(f"budget ({args.budget_s:.0f} s) spent: no {name} engine")
            break
        runs.append(run_engine(plan, args, name, warm, prompts, max_tokens))
    table(runs)
    ok, why = same_results(*runs) if len(runs) == 2 else (False, "one engine only: not compared")
    print(f"warm-up vs first use: {'SAME' if ok else 'DIFFERENT'} -- {why}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keep = ("name", "start_s", "generate_s", "warm_line", "warm_s", "capture_s", "failed", "steps", "finished")
    (out / "decode_warmup.json").write_text(json.dumps({"model": args.model, "same": ok, "check": why,
                                                        "runs": [{k: r[k] for k in keep} for r in runs]},
                                                       indent=1, default=str))  # fmt: skip
    return 0 if ok and all(r["finished"] == N_REQUESTS for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
