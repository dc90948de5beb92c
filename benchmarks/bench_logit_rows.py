"""The head of a prefill with every row's logits vs the sampled row only (passes/select_logit_rows.py).

The V4.1 head at real dims (hc_collapse of the final streams, the final RMSNorm, the bf16 LM head [129280, 4096])
as a graph, bound by select_kernels for sm90 as in a plan, run by the runtime's GraphExecutor:

    all rows      the plan's head over T rows (a [T, 129280] f32 logits tensor: 4.2 GB at T = 8192)
    last row      the same graph after select_logit_rows with logit_rows = [T-1] (what the engine asks now)
    no rows       logit_rows = [] (a prefill chunk that does not end its prompt: the head launches nothing)

Each case prints its time (CUDA events, median of --reps after a warm-up) next to its limit: the bytes it must move
(the head weight once, the streams rows it reads, the logits it writes) over the HBM bandwidth measured in the
same run (a device-to-device copy). The last row's logits are checked against row T-1 of every row's (max rel).

    python3 benchmarks/bench_logit_rows.py                  # T = 8192 on the GPU
    python3 benchmarks/bench_logit_rows.py --dry-run        # small dims on the CPU: builds, runs, checks
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from deepinfer.ir.builder import GraphBuilder
from deepinfer.models import deepseek_v41
from deepinfer.models.presets import preset_config
from deepinfer.passes.select_kernels import select_kernels
from deepinfer.passes.select_logit_rows import ROWS_INPUT, select_logit_rows
from deepinfer.runtime.cuda_executor import GraphExecutor, elapsed_ms, mark


def head_graph(n_hc: int, dim: int, vocab: int, eps: float):
    """The V4.1 head as models/deepseek_v41.py writes it, over streams [T, n_hc, D] and their mix weights [T, n_hc]."""
    b = GraphBuilder("v41_head")
    t = "T"
    streams = b.input("streams", "f32", [t, n_hc, dim])
    pre = b.input("pre", "f32", [t, n_hc])
    norm = b.param("norm.weight", "bf16", [dim])
    head = b.param("head.weight", "bf16", [vocab, dim])
    h = b.rmsnorm(b.hc_collapse(streams, pre), norm, eps=eps)
    b.output(b.linear(h, head, name="logits"))
    return b.build()


def hbm_gbs(device) -> float:
    """Device-to-device copy bandwidth (read + write), GB/s."""
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(6):
        a = mark()
        y.copy_(x)
        b = mark()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(elapsed_ms(a, b))
    return 2 * x.numel() / (statistics.median(times[1:]) * 1e-3) / 1e9


def time_ms(fn, reps: int, device) -> float:
    fn()  # warm-up: kernels built and checked on first use
    times = []
    for _ in range(reps):
        a = mark()
        fn()
        b = mark()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(elapsed_ms(a, b))
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="small dims on the CPU (checks the script)")
    ap.add_argument("--references", action="store_true", help="every node's torch reference (no kernels)")
    args = ap.parse_args(argv)

    cfg = deepseek_v41.parse_config(preset_config("deepseek-v4.1-flash", "tiny" if args.dry_run else "real"))
    n_hc, dim, vocab = cfg.hc_mult, cfg.hidden_size, cfg.vocab_size
    t = 64 if args.dry_run else args.tokens
    device = torch.device("cpu" if args.dry_run else "cuda")
    g = select_kernels(head_graph(n_hc, dim, vocab, cfg.rms_eps), target="sm90")
    sel = select_logit_rows(g)
    gen = torch.Generator().manual_seed(0)
    params = {"norm.weight": (1 + 0.1 * torch.randn(dim, generator=gen)).bfloat16().to(device),
              "head.weight": (torch.randn(vocab, dim, generator=gen) / dim**0.5).bfloat16().to(device)}  # fmt: skip
    feeds = {"streams": torch.randn(t, n_hc, dim, generator=gen).to(device),
             "pre": torch.rand(t, n_hc, generator=gen).to(device)}  # fmt: skip
    compiled = not (args.references or args.dry_run)
    full_ex = GraphExecutor(g, params, compiled=compiled)
    sel_ex = GraphExecutor(sel, params, compiled=compiled, kernels=full_ex.kernels)
    last = {**feeds, ROWS_INPUT: torch.tensor([t - 1], device=device)}
    none = {**feeds, ROWS_INPUT: torch.zeros(0, dtype=torch.long, device=device)}

    t0 = time.perf_counter()
    want = full_ex.run(feeds)[0][-1]
    got = sel_ex.run(last)[0][0]
    err = float((got - want).abs().max() / want.abs().max())
    argmax_same = int(got.argmax()) == int(want.argmax())
    kernels = "on" if compiled else "off (references)"
    print(f"V4.1 head at T={t}: n_hc {n_hc}, D {dim}, vocab {vocab}; device {device}; kernels {kernels}; "
          f"first calls {time.perf_counter() - t0:.1f} s")  # fmt: skip
    print(f"check: last row vs row T-1 of every row's logits: max rel {err:.2e}, argmax same: {argmax_same}")

    bw = hbm_gbs(device)
    weight = vocab * dim * 2
    cases = [("all rows", lambda: full_ex.run(feeds), t), ("last row", lambda: sel_ex.run(last), 1),
             ("no rows", lambda: sel_ex.run(none), 0)]  # fmt: skip
    print(f"limit: HBM copy {bw:.0f} GB/s (measured now)")
    print("| case | ms | vs all rows | logits MB | must-move MB | % of HBM limit |")
    print("|---|---|---|---|---|---|")
    base = None
    for name, fn, rows in cases:
        ms = time_ms(fn, args.reps, device)
        base = base or ms
        moved = (weight if rows else 0) + rows * (n_hc * (dim + 1) * 4 + vocab * 4)
        pct = f"{100 * moved / 1e6 / bw / ms:.1f}%" if moved else "-"
        print(f"| {name} | {ms:.3f} | {base / max(ms, 1e-9):.1f}x | {rows * vocab * 4 / 1e6:.1f} | "
              f"{moved / 1e6:.1f} | {pct} |")  # fmt: skip
    print("every row:\n" + full_ex.report())
    print("selected rows:\n" + sel_ex.report())
    ok = err <= 1e-3 and argmax_same
    print("PASS" if ok else "FAIL: the last row differs from every row's logits")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
