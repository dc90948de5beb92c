"""The engine-start prebuild (`deepinfer run --prebuild-jobs`, runtime/engine.prebuild_plan_kernels) on an H200: does
it build what the engine then uses, and how long does it take?

    python3 benchmarks/engine_prebuild.py [--model deepseek-v4.1-flash:tiny] [--jobs 14] [--max-model-len 512]
                                          [--tokens 16] [--cache-dir DIR] [--keep-cache] [--no-warm] [--dry-run]

Steps (one process; TILELANG_CACHE_DIR is --cache-dir, emptied first, so the first engine builds cold):
  1. compile the model for sm90 with no kernels (`deepinfer compile --kernels none`): the plan only;
  2. LLM(plan, prebuild_jobs=J): the keys (plan_kernels.kernel_specs at max_model_len) built in J processes --
     the time of the engine's start with the prebuild, and of its kernels' keys;
  3. greedy generation, 4 prompts x --tokens (prefill, batched decode steps and their CUDA graphs);
  4. what the engine's kernel cache holds afterwards: kernels it loaded that were pre-built (from TileLang's disk
     cache: fast) and LAZY ones (not pre-built: each a serial build inside a step), with their load / build time;
  5. a second engine on the warm cache: the prebuild's cost when nothing is left to build.
PASS: no prebuild error, no lazy build, every request finished. --dry-run (CPU): steps 1 and the keys of 2 only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v4.1-flash:tiny", help="name:preset (random weights)")
    ap.add_argument("--jobs", "-j", type=int, default=max(1, (os.cpu_count() or 2) - 2), help="build processes")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "deepinfer-prebuild-check"),
                    help="TILELANG_CACHE_DIR for this run (emptied first: a cold start)")  # fmt: skip
    ap.add_argument("--keep-cache", action="store_true", help="do not empty --cache-dir first (not a cold start)")
    ap.add_argument("--no-warm", action="store_true", help="the cold engine only (no second engine on the warm cache)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: compile and derive the keys, build nothing")
    return ap.parse_args(argv)


T0 = time.time()


def log(msg: str) -> None:
    print(f"[prebuild {time.time() - T0:6.1f}s] {msg}", flush=True)


PROMPTS = [[0, 5, 17, 300, 42], [0, 9000, 12, 77, 5, 6, 7, 1000, 2], [0, *range(100, 111)], [0, *range(2000, 2030, 2)]]


def main(argv=None) -> int:
    args = parse(argv)
    if not args.dry_run:
        if not args.keep_cache:
            shutil.rmtree(args.cache_dir, ignore_errors=True)
        os.environ["TILELANG_CACHE_DIR"] = args.cache_dir  # before TileLang is imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _checkout  # noqa: F401  (`deepinfer` importable from a checkout)
    import torch

    from deepinfer.codegen.plan_kernels import kernel_specs
    from deepinfer.compiler import compile_model

    t0 = time.perf_counter()
    plan = compile_model(args.model, "sm90", kernels="none").plan
    log(f"{args.model}: compiled for sm90 in {time.perf_counter() - t0:.1f} s (no kernels built)")
    t0 = time.perf_counter()
    specs, skipped = kernel_specs(plan.graph, "sm90", "bound", max_model_len=args.max_model_len)
    log(f"{len(specs)} kernel keys at max_model_len {args.max_model_len} in {time.perf_counter() - t0:.1f} s "
        f"(families: {_families(s.key for s in specs)}; not derived: {skipped or 'none'})")  # fmt: skip
    if args.dry_run:
        return 0
    if not torch.cuda.is_available():
        print("engine_prebuild: error: needs a CUDA device (--dry-run runs on the CPU)", file=sys.stderr)
        return 2
    runs = {"cold": engine_run(plan, args, "cold", specs, skipped)}
    if not args.no_warm:
        runs["warm"] = engine_run(plan, args, "warm", specs, skipped)
    print(f"\n{'start':<6} {'prebuild s':>10} {'engine start s':>14} {'generate s':>10} {'loaded':>7} {'lazy':>5} "
          f"{'lazy s':>7} {'errors':>6} {'finished':>8}")  # fmt: skip
    for name, r in runs.items():
        print(f"{name:<6} {r['prebuild_s']:>10.1f} {r['start_s']:>14.1f} {r['generate_s']:>10.1f} {r['loaded']:>7} "
              f"{len(r['lazy']):>5} {sum(r['lazy'].values()):>7.1f} {len(r['errors']):>6} "
              f"{r['finished']:>4}/{r['requests']}")  # fmt: skip
    # the verdict is the prebuild's: nothing failed to build, nothing built lazily; the requests are reported
    ok = all(not r["errors"] and not r["lazy"] for r in runs.values())
    done = all(r["finished"] == r["requests"] for r in runs.values())
    print(f"engine prebuild: {'PASS' if ok else 'FAIL'} ({len(specs)} keys; lazy builds "
          + ", ".join(f"{k} {len(r['lazy'])}" for k, r in runs.items())
          + f"); requests {'all finished' if done else 'FAILED (see the request lines)'}")  # fmt: skip
    return 0 if ok and done else 1


def engine_run(plan, args, name: str, specs, skipped: dict) -> dict:
    """One engine with the prebuild: its start (prebuild inside, timed), a greedy generation, then what its kernel
    cache built or loaded outside the prebuilt keys (``skipped``: kernel_specs' families it does not derive, by
    design -- Triton's JIT, keys that need device data -- are listed apart, not as lazy)."""
    from deepinfer.runtime import engine
    from deepinfer.runtime.sampler import SamplingParams

    times: dict = {}

    def timed_prebuild(*a, **kw):
        t = time.perf_counter()
        try:
            times["errors"] = original(*a, **kw)
            return times["errors"]
        finally:
            times["prebuild_s"] = time.perf_counter() - t

    original, engine.prebuild_plan_kernels = engine.prebuild_plan_kernels, timed_prebuild
    try:
        t = time.perf_counter()
        llm = engine.LLM(plan=plan, target="sm90", tokenizer=None, max_model_len=args.max_model_len,
                         max_num_seqs=len(PROMPTS), prebuild_jobs=args.jobs, overlap=False)  # fmt: skip
        start_s = time.perf_counter() - t
    finally:
        engine.prebuild_plan_kernels = original
    t = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
    generate_s = time.perf_counter() - t
    cache = llm.executor.runner.exec.kernels
    pre = {s.key for s in specs}
    other = {k: s for k, s in cache.build_s.items() if k not in pre}
    by_design = {k: s for k, s in other.items() if any(w.startswith(f"{k.family}.{k.program}") for w in skipped)}
    lazy = {k: s for k, s in other.items() if k not in by_design}
    loaded = {k: s for k, s in cache.build_s.items() if k in pre}
    log(f"{name}: engine start {start_s:.1f} s (prebuild {times.get('prebuild_s', float('nan')):.1f} s, "
        f"{len(times.get('errors') or {})} errors); generated {sum(len(o.token_ids) for o in outs)} of "
        f"{len(outs)} x {args.tokens} tokens in "
        f"{generate_s:.1f} s; "
        f"kernels used: {len(loaded)} pre-built (loaded in {sum(loaded.values()):.1f} s, slowest "
        f"{max(loaded.values(), default=0):.2f} s), {len(lazy)} LAZY ({sum(lazy.values()):.1f} s), "
        f"{len(by_design)} not derived by design ({sum(by_design.values()):.1f} s); {len(cache.failed)} declined")
    for k, s in sorted(lazy.items(), key=lambda kv: -kv[1])[:10]:
        log(f"  lazy: {k.describe()} ({s:.1f} s)")
    for k, why in list((times.get("errors") or {}).items())[:5]:
        log(f"  prebuild error: {k}: {why}")
    failed = [o for o in outs if o.finish_reason == "error"]
    for o in failed[:4]:
        log(f"  request {o.index} failed ({len(o.token_ids)} tokens): {str(o.error)[:400]}")
    llm.close()
    return {"prebuild_s": times.get("prebuild_s", float("nan")), "start_s": start_s, "generate_s": generate_s,
            "loaded": len(loaded), "lazy": lazy, "errors": times.get("errors") or {}, "used": list(cache.build_s),
            "finished": len(outs) - len(failed), "requests": len(outs)}  # fmt: skip


def _families(keys) -> str:
    from collections import Counter

    return ", ".join(f"{f} {n}" for f, n in Counter(k.family for k in keys).most_common())


if __name__ == "__main__":
    sys.exit(main())
