"""What the g128 prefill option (convert_fp4_to_fp8 prefill_act_group=128) does to V4.1's routed-expert numbers, on CPU.

    python3 benchmarks/moe_g128_numerics.py [--tokens 128] [--seed 0] [--massive 300]

One routed expert at the real dims (D 5120, I 2304: w1|w3 [4608, 5120], w2 [5120, 2304]), FP4 weights in the
checkpoint format converted to 128x128 FP8 blocks (the checked conversion: exact), `--tokens` rows of post-norm-like
activations (per-channel scales over ~3 binades, Student-t(4) rows, D/128 massive channels x `--massive`, each row
normalised to RMS 1 as RMSNorm leaves it) fed as the graph feeds them (1x32-quantised: fake_quant_fp8). Both paths
mirror the prefill kernels' data flow -- x quantised per group, w1|w3 product rounded to bf16 (the GEMM's output),
SwiGLU (limit 10) in fp32, quantised per group, w2 product -- with exact float64 products, so only the formats
differ (the tensor core's 128-K accumulation before promotion is the GPU rows' part: kernels_h200 --only
"grouped_gemm v41g128"). The w1|w3 deviation is taken before the bf16 rounding (a rounding flip there is one bf16
step of that element, whatever caused it).

Printed: per operand, the share of elements whose dequantised value changes from 1x32 to 1x128 and the share below
the threshold 2^-6 s128 (act_quant.py: only those can change); per GEMM output, the g128 path's norm-wise and max
deviation from the exact (1x32) path, next to the 1x32 format's own error against unquantised fp32 operands (the
activations before the graph's 1x32 quantisation, no bf16 rounding) and the noise floor: the exact path with its
products summed in fp32 instead of float64. The w2 output deviates more than the w1|w3 product because any
perturbation of the product flips some bf16 roundings of it and then E4M3 roundings of h (one step: 1/8 at the top
binade); the noise floor shows the same mechanism at the size of a summation-order difference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _checkout  # noqa: E402,F401  (`deepinfer` importable from a plain checkout)
import torch  # noqa: E402

D, INTER, LIMIT = 5120, 2304, 10.0


def activations(m: int, k: int, massive: float, gen: torch.Generator) -> torch.Tensor:
    chan = torch.exp(torch.randn(k, generator=gen))
    chan[torch.randperm(k, generator=gen)[: k // 128]] *= massive
    z = torch.randn(m, k, generator=gen)
    chi2 = torch.randn(4, m, k, generator=gen).pow(2).sum(0)
    x = z / (chi2 / 4).sqrt() * chan
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()  # RMSNorm's output (unit weight): gate/up values O(1)


def expert_weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1|w3 [2I, D], w2 [D, I]) float64: FP4 codes with per-32 ue8m0 scales, through the checked 128x128
    conversion and back (exact, so these are the FP4 values)."""
    from deepinfer.ir.ops.quant import dequant_fp8_blocks
    from deepinfer.models.checkpoint import _quant_fp4_rows
    from deepinfer.passes.convert_fp4_to_fp8 import fp4_to_fp8_checked

    def one(n: int, k: int) -> torch.Tensor:
        packed, scale = _quant_fp4_rows(torch.randn(n, k, generator=gen) / k**0.5, 32)
        return dequant_fp8_blocks(*fp4_to_fp8_checked(packed, scale, 128, f"[{n}, {k}]"), 128).double()

    return one(2 * INTER, D), one(D, INTER)


def quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """x quantised per `group` columns (act_quant.reference's numbers), dequantised, float64."""
    from deepinfer.codegen.kernels import act_quant

    q, s = act_quant.reference(x.float(), group)
    return (q.float() * s.T.repeat_interleave(group, 1)).double()


def expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, group: int | None,
           dtype=torch.float64) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(x operand, w1|w3 product, SwiGLU output h (fp32, of the bf16-rounded product), h operand, w2 output) with
    activations per `group` (None: unquantised fp32 operands, no bf16 rounding); products summed in `dtype`."""
    from deepinfer.ir.ops.moe import swiglu

    a = quant(x, group) if group else x.double()
    c1 = (a.to(dtype) @ w13.to(dtype).T).double()
    c1r = c1.to(torch.bfloat16).double() if group else c1
    h = swiglu(c1r[:, :INTER].float(), c1r[:, INTER:].float(), LIMIT)
    hq = quant(h, group) if group else h.double()
    return a, c1, h, hq, (hq.to(dtype) @ w2.to(dtype).T).double()


def changed(v32: torch.Tensor, v128: torch.Tensor, raw: torch.Tensor) -> str:
    from deepinfer.codegen.kernels import act_quant

    st = act_quant.rebase_stats(raw.float(), 32, 128)
    assert st["above_identical"] and st["max_below_over_scale"] <= 2.0**-9, st  # the statement, at these dims
    pct, below = 100 * (v32 != v128).double().mean().item(), 100 * st["below"]
    worst = st["max_below_over_scale"]
    return f"{pct:.3f}% of values change ({below:.3f}% below 2^-6 s128; max change {worst:.1e} s128)"


def dev(got: torch.Tensor, want: torch.Tensor) -> str:
    norm = ((got - want).norm() / want.norm()).item()
    mx = ((got - want).abs().max() / want.abs().max()).item()
    return f"norm-wise {norm:.2e}, max {mx:.2e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--massive", type=float, default=100.0, help="scale of the D/128 massive channels")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # a shared CPU
    t0 = time.time()
    gen = torch.Generator().manual_seed(args.seed)
    w13, w2 = expert_weights(gen)
    raw = activations(args.tokens, D, args.massive, gen)
    x = quant(raw, 32).float()  # the experts' input as the graph feeds it: 1x32 values (fake_quant_fp8)
    exact, g128 = (expert(x, w13, w2, g) for g in (32, 128))
    full = expert(raw, w13, w2, None)  # fp32 operands before any activation quantisation
    order = expert(x, w13, w2, 32, torch.float32)  # the exact format, products summed in fp32 (another order)
    print(f"V4.1 routed expert, {args.tokens} tokens, D {D}, I {INTER}, FP4 -> FP8 128x128 (exact), massive "
          f"channels x{args.massive:g}, seed {args.seed} ({time.time() - t0:.0f} s)")  # fmt: skip
    print(f"  x  operand (1x32 values rebased to 1x128): {changed(exact[0], g128[0], x)}")
    print(f"  w1|w3 output: g128 vs exact {dev(g128[1], exact[1])}   | exact 1x32 vs fp32 {dev(exact[1], full[1])}")
    h = exact[2]  # the same SwiGLU output quantised both ways: only the grouping differs
    print(f"  h  operand (SwiGLU output): {changed(exact[3], quant(h, 128), h)}")
    print(f"  w2 output (the expert's): g128 vs exact {dev(g128[4], exact[4])}   | exact 1x32 vs fp32 "
          f"{dev(exact[4], full[4])}")  # fmt: skip
    print(
        f"  noise floor: the exact 1x32 path with fp32-summed products vs float64: w1|w3 {dev(order[1], exact[1])}, "
        f"w2 output {dev(order[4], exact[4])} (bf16 / E4M3 rounding flips of h: any kernel's summation order)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
