"""Kernel benchmark for an H200 (sm_90a): every codegen family at real DeepSeek-V4.1-Flash shapes.

For each kernel: build it with `tilelang.compile`, check it against the torch reference on fresh random
inputs, time it (triton.testing.do_bench, median), and compare with the limits MEASURED IN THE SAME RUN:
HBM copy bandwidth (a large device-to-device copy) and the matrix peaks (torch._scaled_mm FP8 and bf16
matmul at 8192³). "% limit" is the roofline time max(bytes / copy BW, flops / peak) over the measured
time, so 100% means at the roofline. A failing kernel prints its error in its row; the run goes on.

    python3 benchmarks/kernels_h200.py --quick          # a few shapes, ~2-3 minutes incl. compiles
    python3 benchmarks/kernels_h200.py                  # all shapes, plus a small FP8 GEMM config sweep
    python3 benchmarks/kernels_h200.py --dry-run        # no GPU: only build (lower + nvcc) every kernel
    python3 benchmarks/kernels_h200.py --gemm-sweep     # FP8 GEMM formulations at V4/V4.1 prefill shapes
    ... -j 12                                           # pre-build every kernel in 12 processes first
"""

import argparse
import dataclasses
import functools
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _checkout  # noqa: E402,F401  (kernel cache dirs; `deepinfer` importable from a plain checkout)
import torch  # noqa: E402

from deepinfer.codegen.kernels import (  # noqa: E402
    fp8_gemm,
    hyper_connection,
    moe_grouped_gemm,
    moe_routing,
    rmsnorm_quant,
    rope,
    sparse_attn_decode,
)
from deepinfer.codegen.kernels._common import quant_fp8_blocks, quant_fp8_groups  # noqa: E402

TARGET = {"kind": "cuda", "arch": "sm_90a"}
HIDDEN, Q_LORA, HEADS, HEAD_DIM, EXPERTS, TOPK, MOE_INTER = 5120, 1280, 64, 512, 384, 6, 2304
EPS, HC_EPS, SINKHORN = 1e-20, 1e-6, 20


@dataclass
class Limits:
    hbm: float  # bytes/s, device-to-device copy
    fp8: float  # flop/s, torch._scaled_mm
    bf16: float  # flop/s, torch.matmul


@dataclass
class Row:
    kernel: str
    shape: str
    ms: float = float("nan")
    bytes_: float = 0.0
    flops: float = 0.0
    peak: str = "fp8"  # which matrix peak bounds the compute term
    eager_ms: float = float("nan")
    error: str = ""
    check: str = ""


# ---------------------------------------------------------------------------------------------- timing


CHECK_ONLY = False  # tests/codegen/test_gpu_kernels.py sets this: build and check, no timing


def bench(fn, quick: bool) -> float:
    """Median milliseconds; triton's do_bench flushes L2 between runs."""
    if CHECK_ONLY:
        return float("nan")
    try:
        from triton.testing import do_bench

        return do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median")
    except ImportError:
        return _bench_events(fn, 10 if quick else 50)


def bench_device(fn, quick: bool) -> float:
    """Median ms of ONE call of fn replayed as a CUDA graph (L2 flushed between replays, as bench): the device time
    a decode step's graph sees, without the Python launch cost of the call (~10-30 us per Triton / TileLang launch
    from Python, more than many decode kernels take). Falls back to bench() when fn cannot be captured."""
    if CHECK_ONLY:
        return float("nan")
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream (CUDA graph capture rules)
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # an op that synchronises with the host: time it eagerly, and say so
        print(f"  (not capturable, timed eagerly: {type(e).__name__}: {str(e).splitlines()[0][:80]})")
        return bench(fn, quick)
    return bench(graph.replay, quick)


def _bench_events(fn, n: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _copy_bandwidth(quick: bool) -> float:
    """Bytes/s of a large device-to-device copy (read + write); buffers are freed on return."""
    n = (1 << 30) if quick else (4 << 30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * n / (bench(lambda: dst.copy_(src), quick) * 1e-3)


PEAK_SIZE = 8192


@functools.cache
def _peak_operands():
    s = PEAK_SIZE
    a = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    return a, b, torch.ones((), device="cuda")


def fp8_peak_now(quick: bool) -> float:
    """flop/s of torch._scaled_mm (FP8 e4m3 -> bf16) at 8192^3, timed now (same protocol as the rows)."""
    a, b, one = _peak_operands()
    return 2 * PEAK_SIZE**3 / (bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), quick) * 1e-3)


def _matmul_peaks(quick: bool) -> tuple[float, float]:
    """flop/s of torch._scaled_mm (FP8 e4m3 -> bf16) and bf16 matmul at 8192^3."""
    s = PEAK_SIZE
    a, b, one = _peak_operands()
    _sustain(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), 0.3 if quick else 2.0)
    fp8 = fp8_peak_now(quick)
    x = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    bf16 = 2 * s**3 / (bench(lambda: x @ x, quick) * 1e-3)
    return fp8, bf16


def _sustain(fn, seconds: float) -> None:
    """Run fn back to back for `seconds` first: the H200's clocks settle under sustained matrix load (a peak
    measured from idle read 1248-1475 TFLOPS within one call), so the peak is taken in the state the rows run in."""
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()


def measure_limits(quick: bool) -> Limits:
    hbm = _copy_bandwidth(quick)
    torch.cuda.empty_cache()
    return Limits(hbm, *_matmul_peaks(quick))


def build(prim_func):
    import tilelang

    return tilelang.compile(prim_func, target=TARGET, execution_backend="tvm_ffi")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def expect(err: float, tol: float) -> str:
    if err > tol:
        raise AssertionError(f"mismatch: rel err {err:.2e} > {tol:.0e}")
    return f"{err:.1e}"


# ---------------------------------------------------------------------------------------------- cases
# Each case builds, checks and times one kernel at one shape and fills a Row.


def case_fp8_gemm(row: Row, M: int, N: int, K: int, g: int, cfg, quick: bool, dry: bool, with_eager: bool = True):
    func = fp8_gemm.program(M, N, K, act_group=g, weight_block=g, target="sm90", cfg=cfg)
    kernel = build(func)
    row.bytes_, row.flops = fp8_gemm.roofline(M, N, K, g, g)
    if dry:
        return
    x, w = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda") * 0.05
    a, sa = quant_fp8_groups(x, g)
    b, sb = quant_fp8_blocks(w, g)
    sa_t = sa.T.contiguous()  # the kernel wants MN-major activation scales
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    kernel(a, sa_t, b, sb, c)
    row.check = expect(rel_err(c, fp8_gemm.reference_dequant_f64(a, sa, b, sb, g, g).float()), 2e-2)
    row.ms = bench(lambda: kernel(a, sa_t, b, sb, c), quick)
    if not with_eager:  # the sweep skips it (time)
        return

    # eager baseline: what a plain torch implementation does -- dequantise to bf16, then one matmul
    def eager():
        a16 = (a.float() * sa.repeat_interleave(g, 1)).bfloat16()
        w16 = (b.float() * sb.repeat_interleave(g, 0).repeat_interleave(g, 1)).bfloat16()
        return a16 @ w16.T

    row.eager_ms = bench(eager, quick)


SWIGLU_LIMIT = 10.0  # V4.1 swiglu_limit


def _grouped_fp4_weights(E: int, N: int, K: int):
    """Random FP4 experts in the checkpoint format: packed e2m1 bytes [E, N, K/2] and ue8m0 bytes [E, N, K/32]
    (2^-9 .. 2^-4: weights of magnitude ~0.01-0.1)."""
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda")
    scale = torch.randint(118, 124, (E, N, K // 32), dtype=torch.uint8, device="cuda")
    return packed, scale


def _grouped_check_swiglu(hq, hs, h_ref, real) -> str:
    """Fused SwiGLU + quant output vs the clamped SwiGLU of the fp32 reference GEMM: every dequantised value within
    1/12 of its group's full scale (448 * s: one e4m3 step at the top binade is 1/14; a value on a rounding
    boundary may round the other way after the kernel's different summation order), scales equal almost everywhere."""
    rq, rs = moe_grouped_gemm.swiglu_quant_reference(h_ref[real].float(), SWIGLU_LIMIT)
    from deepinfer.ir.ops.moe import swiglu

    inter = hq.shape[1]
    want = swiglu(h_ref[real][:, :inter], h_ref[real][:, inter:], SWIGLU_LIMIT)
    s = hs.T[real]
    got = hq[real].float() * s.repeat_interleave(32, 1)
    err = ((got - want).abs() / (448.0 * rs.repeat_interleave(32, 1))).max().item()
    same = (s == rs).float().mean().item()
    if err > 1 / 12 or same < 0.99:
        raise AssertionError(f"swiglu mismatch: {err:.2e} of the group scale, {100 * same:.2f}% scales equal")
    return f"{err:.1e}g"


def case_grouped_gemm(row: Row, tokens: int, E: int, quick: bool, dry: bool, cfg=None, fmt="fp8", swiglu=False,
                      g: int = 32, dims: tuple[int, int] = (2 * MOE_INTER, HIDDEN)):  # fmt: skip
    """EP8 slice of V4.1 prefill: `tokens` x top-6 rows spread over E local experts, w1|w3 fused (N = 2x2304).
    fmt "fp8": cfg None = moe_grouped_gemm.sm90_config (fp8_gemm's improved main loop); "fp4" (W4A8): the swap-AB
    program on the contiguous layout (swab_config(contiguous=True)). swiglu: the clamped SwiGLU + FP8 quant epilogue
    (outputs Hq [M, 2304] e4m3 + Hs; weights tile-interleaved gate/up). g / dims (N, K): the scale granularity and
    the expert GEMM (V4-Flash: g 128, (2 x 2048, 4096))."""
    N, K = dims
    fp4 = fmt == "fp4"
    cfg = cfg or (moe_grouped_gemm.swab_config(0, "fp4", contiguous=True) if fp4 else
                  moe_grouped_gemm.sm90_config(tokens * TOPK, N))  # fmt: skip
    block = cfg.block_t if fp4 else cfg.block_m
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, E, (tokens * TOPK,), generator=gen)
    rows, tiles = moe_grouped_gemm.contiguous_layout(ids, E, block)
    M = rows.numel()
    R = tokens * TOPK  # real rows: the roofline counts only them (padding rows to whole tiles are overhead)
    row.shape = f"{R}r/{M}x{N}x{K} E{E}"
    lim = SWIGLU_LIMIT if swiglu else None
    if fp4:
        func = moe_grouped_gemm.swab_program(M, N, K, E, fmt="fp4", cfg=cfg, swiglu_limit=lim)
        row.bytes_, row.flops = (moe_grouped_gemm.roofline_swiglu(R, N, K, E, "fp4") if swiglu else
                                 moe_grouped_gemm.roofline_w4a8(R, N, K, E))  # fmt: skip
    else:
        func = moe_grouped_gemm.program(M, N, K, E, act_group=g, weight_block=g, target="sm90", cfg=cfg,
                                        swiglu_limit=lim)  # fmt: skip
        row.bytes_, row.flops = (moe_grouped_gemm.roofline_swiglu(R, N, K, E) if swiglu else
                                 moe_grouped_gemm.roofline(R, N, K, E, g, g))  # fmt: skip
    kernel = build(func)
    if dry:
        return
    rows, tiles = rows.cuda(), tiles.cuda()
    x = torch.randn(tokens * TOPK, K, device="cuda")
    a, sa = quant_fp8_groups(torch.where(rows[:, None] >= 0, x[rows.clamp_min(0)], 0.0), g)
    sa_t = sa.T.contiguous()
    real = rows >= 0
    half = (cfg.block_n // 2)
    if fp4:
        packed, scale = _grouped_fp4_weights(E, N, K)
        pk, sc = packed, scale
        if swiglu:
            pk, sc = moe_grouped_gemm.gate_up_tiles(packed, half), moe_grouped_gemm.gate_up_tiles(scale, half)
        b, sb = moe_grouped_gemm.w4a8_weights(pk, sc)
        ref = moe_grouped_gemm.reference_w4a8(a, sa, packed, scale, moe_grouped_gemm.row_experts(tiles, block, False))
    else:
        quant = [quant_fp8_blocks(torch.randn(N, K, device="cuda") * 0.05, g) for _ in range(E)]
        b, sb = torch.stack([q for q, _ in quant]), torch.stack([s for _, s in quant])
        del quant
        ref = moe_grouped_gemm.reference(a, sa, b, sb, tiles.cpu(), cfg.block_m, g, g)
        if swiglu:
            b, sb = moe_grouped_gemm.gate_up_tiles(b, half), moe_grouped_gemm.gate_up_tiles(sb, half // g)
    if swiglu:
        hq = torch.empty(M, N // 2, device="cuda", dtype=torch.float8_e4m3fn)
        hs = torch.empty(N // 64, M, device="cuda", dtype=torch.float32)
        outs = (hq, hs)
        kernel(a, sa_t, b, sb, tiles, *outs)
        row.check = _grouped_check_swiglu(hq, hs, ref, real)
    else:
        outs = (torch.empty(M, N, device="cuda", dtype=torch.bfloat16),)
        kernel(a, sa_t, b, sb, tiles, *outs)
        row.check = expect(rel_err(outs[0][real], ref[real]), 2e-2)
    del ref
    row.ms = bench(lambda: kernel(a, sa_t, b, sb, tiles, *outs), quick)

    def eager():  # per expert: dequantise its rows and weights to bf16, one matmul each
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        a16 = (a.float() * sa.repeat_interleave(g, 1)).bfloat16()
        for e in range(E):
            sel = (tiles == e).repeat_interleave(block)
            if fp4:
                w16 = moe_grouped_gemm.dequant_fp4_experts(packed[e : e + 1], scale[e : e + 1])[0].bfloat16()
            else:
                w16 = (b[e].float() * sb[e].repeat_interleave(g, 0).repeat_interleave(g, 1)).bfloat16()
            out[sel] = a16[sel] @ w16.T
        return out

    row.eager_ms = bench(eager, quick)


def case_grouped_gemm_masked(row: Row, tokens: int, E: int, max_rows: int, quick: bool, dry: bool, cfg=None,
                             fmt="fp8", swiglu=False, old=False):  # fmt: skip
    """Decode, EP8 slice: `tokens` x top-6 over 384 experts, the pairs of the E local ones in the masked layout
    (max_rows rows per expert, Counts[e] real), w1|w3 fused. HBM-bound: only active experts' weights count (FP4
    bytes for W4A8). Default: the swap-AB program (moe_grouped_gemm.swab_program); old=True: the previous masked
    program (64-row tiles on the 1-warpgroup overlapped loop), for the same-run comparison."""
    N, K, g = 2 * MOE_INTER, HIDDEN, 32
    fp4 = fmt == "fp4"
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(tokens)]).flatten()
    ids = ids[ids < E]  # the local experts' pairs
    dest, counts = moe_grouped_gemm.masked_layout(ids, E, max_rows)
    M, active, real_rows = E * max_rows, int((counts > 0).sum()), int(counts.sum())
    row.shape = f"{real_rows}r/{active}e x{N}x{K}"
    lim = SWIGLU_LIMIT if swiglu else None
    if old:
        cfg = cfg or moe_grouped_gemm.sm90_config(tokens * TOPK, N, masked=True)
        func = moe_grouped_gemm.program(M, N, K, E, act_group=g, weight_block=g, target="sm90", cfg=cfg,
                                        max_rows=max_rows)  # fmt: skip
    else:
        cfg = cfg or moe_grouped_gemm.swab_config(int(counts.max()), fmt, active_experts=active, N=N)
        func = moe_grouped_gemm.swab_program(M, N, K, E, fmt=fmt, cfg=cfg, max_rows=max_rows, swiglu_limit=lim)
        row.shape += f" {cfg.tag}"
    if swiglu:
        row.bytes_, row.flops = moe_grouped_gemm.roofline_swiglu(real_rows, N, K, active, fmt)
    elif fp4:
        row.bytes_, row.flops = moe_grouped_gemm.roofline_w4a8(real_rows, N, K, active)
    else:
        row.bytes_, row.flops = moe_grouped_gemm.roofline(real_rows, N, K, active, g, g)
    kernel = build(func)
    if dry:
        return
    x = torch.zeros(M, K, device="cuda")
    x[dest.cuda()] = torch.randn(ids.numel(), K, device="cuda")
    a, sa = quant_fp8_groups(x, g)
    counts_d, sa_t = counts.cuda(), sa.T.contiguous()
    real = dest.cuda()
    re_ = moe_grouped_gemm.row_experts(counts, max_rows, masked=True)
    half = getattr(cfg, "block_n", 128) // 2
    if fp4:
        packed, scale = _grouped_fp4_weights(E, N, K)
        pk, sc = packed, scale
        if swiglu:
            pk, sc = moe_grouped_gemm.gate_up_tiles(packed, half), moe_grouped_gemm.gate_up_tiles(scale, half)
        b, sb = moe_grouped_gemm.w4a8_weights(pk, sc)
        ref = moe_grouped_gemm.reference_w4a8(a, sa, packed, scale, re_)
    else:
        quant = [quant_fp8_blocks(torch.randn(N, K, device="cuda") * 0.05, g) for _ in range(E)]
        b, sb = torch.stack([q for q, _ in quant]), torch.stack([s for _, s in quant])
        del quant
        tiles = moe_grouped_gemm.masked_tile_expert(counts, max_rows, max_rows)  # one tile per expert
        ref = moe_grouped_gemm.reference(a, sa, b, sb, tiles, max_rows, g, g)
        if swiglu:
            b, sb = moe_grouped_gemm.gate_up_tiles(b, half), moe_grouped_gemm.gate_up_tiles(sb, half // g)
    if swiglu:
        hq = torch.empty(M, N // 2, device="cuda", dtype=torch.float8_e4m3fn)
        hs = torch.empty(N // 64, M, device="cuda", dtype=torch.float32)
        outs = (hq, hs)
        kernel(a, sa_t, b, sb, counts_d, *outs)
        row.check = _grouped_check_swiglu(hq, hs, ref, real)
    else:
        outs = (torch.empty(M, N, device="cuda", dtype=torch.bfloat16),)
        kernel(a, sa_t, b, sb, counts_d, *outs)
        row.check = expect(rel_err(outs[0][real], ref[real]), 2e-2)
    row.ms = bench(lambda: kernel(a, sa_t, b, sb, counts_d, *outs), quick)
    act_e = [e for e in range(E) if counts[e] > 0]

    def eager():  # per active expert: dequantise its weights to bf16, one matmul over its real rows
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        a16 = (a.float() * sa.repeat_interleave(g, 1)).bfloat16()
        for e in act_e:
            if fp4:
                w16 = moe_grouped_gemm.dequant_fp4_experts(packed[e : e + 1], scale[e : e + 1])[0].bfloat16()
            else:
                w16 = (b[e].float() * sb[e].repeat_interleave(g, 0).repeat_interleave(g, 1)).bfloat16()
            c[e * max_rows : e * max_rows + int(counts[e])] = a16[e * max_rows : e * max_rows + int(counts[e])] @ w16.T
        return c

    row.eager_ms = bench(eager, quick)


# ---- MoE decode at the real V4.1 routing distribution (issue 8): T tokens x top-6 uniformly over all 384 experts
# (~243 distinct at T = 64), D 5120, I 2304, FP8 experts with 32x32 ue8m0 blocks (fp32 powers of two, as the runtime
# passes them), the two kernels the runtime launches: the fused-SwiGLU w1|w3 kernel on the plain stack (glu_split)
# and the w2 (down) kernel. Operands and the check's reference are made once per (T, kernel) and shared by rows.
_REAL = {}


def _real_experts(N: int, K: int):
    """EXPERTS random FP8 experts [E, N, K] with fp32 32x32 block scales [E, N/32, K/32], made once per run."""
    if ("w", N, K) not in _REAL:
        gen = torch.Generator(device="cuda").manual_seed(N * 7 + K)
        b = torch.empty(EXPERTS, N, K, device="cuda", dtype=torch.float8_e4m3fn)
        sb = torch.empty(EXPERTS, N // 32, K // 32, device="cuda")
        for e in range(EXPERTS):
            b[e], sb[e] = quant_fp8_blocks(torch.randn(N, K, device="cuda", generator=gen) * 0.05, 32)
        _REAL[("w", N, K)] = b, sb
    return _REAL[("w", N, K)]


def _real_routing(tokens: int, block_t: int):
    """(ids [T*6], max_rows, dest [T*6] row of every pair, counts [E]): uniform top-6 of 384, max_rows as the adapter
    sizes it (T rounded up to the token tile)."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(tokens)]).flatten()
    max_rows = -(-tokens // block_t) * block_t
    dest, counts = moe_grouped_gemm.masked_layout(ids, EXPERTS, max_rows)
    return ids, max_rows, dest, counts


def _real_decode_cfg(tokens: int, kernel: str):
    """The runtime's decode config (MoEGroupedAdapter: _swab_decode_cfg; glu_split halves min_blocks)."""
    import dataclasses
    import types

    from deepinfer.runtime import kernel_adapters as ka

    cfg = ka._swab_decode_cfg(types.SimpleNamespace(config={}), tokens, TOPK, EXPERTS, "fp8", (HIDDEN, MOE_INTER))
    return dataclasses.replace(cfg, min_blocks=max(1, cfg.min_blocks // 2)) if kernel == "swiglu" else cfg


def _real_operands(tokens: int, kernel: str, max_rows: int, dest: torch.Tensor, counts: torch.Tensor):
    """(a, sa_t, b, sb, rows, ref): activations in the masked layout (random in the real rows; for the down kernel
    they stand for the SwiGLU's per-32 quantised output), the experts, the real rows sorted by expert, and the
    dequantised fp32 reference GEMM on those rows (fp32 order differs from the kernel's: ~1e-6 relative)."""
    key = ("ops", tokens, kernel, max_rows)
    if key in _REAL:
        return _REAL[key]
    N, K = (2 * MOE_INTER, HIDDEN) if kernel == "swiglu" else (HIDDEN, MOE_INTER)
    b, sb = _real_experts(N, K)
    M = EXPERTS * max_rows
    rows = torch.sort(dest).values.cuda()
    x = torch.zeros(M, K, device="cuda")
    x[rows] = torch.randn(rows.numel(), K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(tokens))
    a, sa = quant_fp8_groups(x, 32)
    del x
    ref = torch.empty(rows.numel(), N, device="cuda")
    a_real = a[rows].float() * sa[rows].repeat_interleave(32, 1)
    at = 0
    for e in torch.nonzero(counts).flatten().tolist():
        n = int(counts[e])
        w = b[e].float() * sb[e].repeat_interleave(32, 0).repeat_interleave(32, 1)
        ref[at : at + n] = a_real[at : at + n] @ w.T
        at += n
    _REAL[key] = a, sa.T.contiguous(), b, sb, rows, ref
    return _REAL[key]


def _real_tiled(half: int):
    """The w1|w3 stack and its scales tile-interleaved for the fused SwiGLU without glu_split (the runtime's "tiles"
    path, taken while the copy fits in memory), made once per run."""
    if ("tiles", half) not in _REAL:
        b, sb = _real_experts(2 * MOE_INTER, HIDDEN)
        tiled = moe_grouped_gemm.gate_up_tiles(b, half), moe_grouped_gemm.gate_up_tiles(sb, half // 32)
        _REAL[("tiles", half)] = tiled
    return _REAL[("tiles", half)]


def case_moe_decode_real(row: Row, tokens: int, kernel: str, quick: bool, dry: bool, cfg=None, slot_map: bool = True,
                         slots: int | None = None, with_eager: bool = False, tiles: bool = False):  # fmt: skip
    """One of the runtime's two routed-expert decode kernels at the real distribution (see above). kernel "swiglu":
    w1|w3 [E, 4608, 5120] -> Hq e4m3 + Hs (fused clamped SwiGLU, glu_split; tiles: on the tile-interleaved copy
    instead); "down": w2 [E, 5120, 2304] -> bf16. cfg None: the runtime's; slot_map: Meta = Counts ++ SlotExpert
    (False: the per-CTA scan of Counts); slots: the grid's expert slots (None: the runtime's, T*6 when below 384; 0:
    all 384). HBM bytes: the distinct experts' weights + scales, the real rows' activations + scales, the outputs."""
    cfg = cfg or _real_decode_cfg(tokens, kernel)
    ids, max_rows, dest, counts = _real_routing(tokens, cfg.block_t)
    if slots is None:  # the runtime's trim with the map; the scan program ran on all 384 slots
        slots = tokens * TOPK if slot_map and tokens * TOPK < EXPERTS else 0
    M, active, real_rows = EXPERTS * max_rows, int((counts > 0).sum()), int(counts.sum())
    glu = kernel == "swiglu"
    N, K = (2 * MOE_INTER, HIDDEN) if glu else (HIDDEN, MOE_INTER)
    row.shape = f"T{tokens} {active}e {cfg.tag}"
    func = moe_grouped_gemm.swab_program(M, N, K, EXPERTS, fmt="fp8", cfg=cfg, max_rows=max_rows,
                                         swiglu_limit=SWIGLU_LIMIT if glu else None, glu_split=glu and not tiles,
                                         slot_map=slot_map, slots=slots)  # fmt: skip
    row.bytes_, row.flops = (moe_grouped_gemm.roofline_swiglu(real_rows, N, K, active) if glu else
                             moe_grouped_gemm.roofline(real_rows, N, K, active, 32, 32))  # fmt: skip
    kernel_fn = build(func)
    if dry:
        return
    a, sa_t, b, sb, rows, ref = _real_operands(tokens, kernel, max_rows, dest, counts)
    if tiles:
        b, sb = _real_tiled(cfg.block_n // 2)
    meta = (moe_grouped_gemm.slot_expert_meta(counts) if slot_map else counts.int()).cuda()
    if glu:
        outs = (torch.empty(M, N // 2, device="cuda", dtype=torch.float8_e4m3fn),
                torch.empty(N // 64, M, device="cuda"))  # fmt: skip
        kernel_fn(a, sa_t, b, sb, meta, *outs)
        every = torch.ones(rows.numel(), dtype=torch.bool, device="cuda")
        row.check = _grouped_check_swiglu(outs[0][rows], outs[1][:, rows], ref, every)
    else:
        outs = (torch.empty(M, N, device="cuda", dtype=torch.bfloat16),)
        kernel_fn(a, sa_t, b, sb, meta, *outs)
        row.check = expect(rel_err(outs[0][rows], ref), 2e-2)
    row.ms = bench(lambda: kernel_fn(a, sa_t, b, sb, meta, *outs), quick)
    if not with_eager:
        return
    act_e = torch.nonzero(counts).flatten().tolist()
    sa = sa_t.T
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def eager():  # per active expert: dequantise its weights to bf16, one matmul over its real rows
        for e in act_e:
            r = slice(e * max_rows, e * max_rows + int(counts[e]))
            w16 = (b[e].float() * sb[e].repeat_interleave(32, 0).repeat_interleave(32, 1)).bfloat16()
            c[r] = (a[r].float() * sa[r].repeat_interleave(32, 1)).bfloat16() @ w16.T

    row.eager_ms = bench(eager, quick)


REAL_TOKENS = (64, 1, 16, 256)  # the issue's batch first


def moe_decode_real_cases():
    """Rows "moe decode real ...": per T, the runtime's two kernels (slot map, trimmed grid, wide TMA tiles: the
    defaults since round 1 of session 5), then "narrow" (the 32-byte TMA boxes of before) and "scan (before)" (the
    per-CTA scan and narrow boxes: the program before this work); at T = 16 the map on the full 384-slot grid;
    a config sweep at T = 64 (all wide); then the persistent grid (132 x CTAs per SM walking the active items,
    T <= 64) last. Rows "moe decode staged ...": stage_scales (the weight scales by TMA per K stage; faulted in
    round 1 with 32-byte stage slots, now 128-byte) -- a separate filter, so a fault there hides no other row."""
    import dataclasses

    out = []

    def add(name, tokens, kernel, group="real", **kw):
        run = functools.partial(case_moe_decode_real, tokens=tokens, kernel=kernel, **kw)
        out.append((f"moe decode {group} {kernel} {name}", f"T{tokens}",
                    lambda r, q, d, run=run: run(r, quick=q, dry=d)))  # fmt: skip

    def runtime_cfg(tokens, kernel, **changes):
        return dataclasses.replace(_real_decode_cfg(tokens, kernel), **changes)

    for T_ in REAL_TOKENS:
        for kernel in ("swiglu", "down"):
            add("map", T_, kernel, with_eager=True)
            if T_ in (64, 16):  # same-run before/after (T 1 and 256: round 1)
                add("map narrow", T_, kernel, cfg=runtime_cfg(T_, kernel, wide_tma=False))
                add("scan (before)", T_, kernel, slot_map=False, cfg=runtime_cfg(T_, kernel, wide_tma=False))
    for kernel in ("swiglu", "down"):
        add("map full grid", 16, kernel, slots=0)
    add("map tiles", 64, "swiglu", tiles=True, cfg=_real_decode_cfg(64, "down"))  # the adapter's "tiles" config
    swab = functools.partial(moe_grouped_gemm.SwabConfig, wide_tma=True)
    sweep = {  # (block_n, block_t, block_k, stages, min_blocks), wide; the runtime's defaults are the "map" rows
        "swiglu": (swab(64, 16, 128, 5, 2), swab(64, 16, 128, 3, 3), swab(64, 16, 256, 2, 2), swab(128, 16, 128, 4, 1),
                   swab(128, 16, 128, 2, 2), swab(192, 16, 128, 3, 1), swab(192, 16, 128, 2, 1)),
        "down": (swab(64, 16, 128, 6, 3), swab(64, 16, 128, 8, 2), swab(64, 16, 256, 4, 2), swab(64, 16, 128, 4, 5),
                 swab(128, 16, 128, 4, 2), swab(128, 16, 128, 6, 1), swab(256, 16, 128, 4, 1)),
    }  # fmt: skip
    for kernel, cfgs in sweep.items():
        for cfg in cfgs:
            add("map (sweep)", 64, kernel, cfg=cfg)
    for T_ in (64, 16, 1):  # last: the newest program (a device fault poisons the CUDA context for every later row)
        for kernel in ("swiglu", "down"):
            mb = _real_decode_cfg(T_, kernel).min_blocks
            add("map persistent", T_, kernel, cfg=runtime_cfg(T_, kernel, persistent=132 * mb))
    for T_ in (64, 16):
        for kernel in ("swiglu", "down"):
            add("map staged", T_, kernel, group="staged", cfg=runtime_cfg(T_, kernel, stage_scales=True))
    # "moe decode short": one short call -- the T64 defaults next to the persistent grid, and the layout launch
    for kernel in ("swiglu", "down"):
        mb = _real_decode_cfg(64, kernel).min_blocks
        add("map", 64, kernel, group="short")
        add("map persistent", 64, kernel, group="short", cfg=runtime_cfg(64, kernel, persistent=132 * mb))
    out.append(("moe decode short layout (triton)", "T64", lambda r, q, d: case_moe_decode_layout(r, 64, q, d)))
    out.append(("moe decode short layout (triton spread)", "T64",
                lambda r, q, d: case_moe_decode_layout(r, 64, q, d, spread=True)))  # fmt: skip
    return out


def case_moe_decode_layout(row: Row, tokens: int, quick: bool, dry: bool, spread: bool = False):
    """The adapter's masked layout of a decode step (duplicate merge, rows, counts, slot map): the one Triton launch
    (moe_grouped_gemm.masked_rows) timed, its torch formulation (masked_rows_reference) as the eager column; the two
    must agree bit for bit. Eager-launch times (the graph replays them without the Python cost)."""
    from deepinfer.runtime import kernel_adapters as ka

    row.shape = f"T{tokens} k{TOPK} E{EXPERTS}"
    row.bytes_ = float(tokens * TOPK * 8 * 3 + 4 * (2 * EXPERTS + 1))
    if dry:
        return
    gen = torch.Generator().manual_seed(tokens)
    idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(tokens)]).cuda()
    w = torch.rand(tokens, TOPK, device="cuda")
    max_rows = -(-tokens // 16) * 16
    consts = ka.layout_consts(tokens, TOPK, EXPERTS, idx.device)
    os.environ[moe_grouped_gemm.MASKED_ROWS_SPREAD_ENV] = "1" if spread else "0"  # the adapter's opt-in (one launch)
    got = ka.masked_layout(idx, w, EXPERTS, max_rows, consts, with_meta=True)
    e_kept = idx.reshape(-1).long()
    rows, meta = moe_grouped_gemm.masked_rows_reference(e_kept, EXPERTS, max_rows)
    if not (torch.equal(got[0], rows) and torch.equal(got[1], meta)):
        raise AssertionError("masked_rows differs from its torch formulation")
    row.check = "exact"
    row.ms = bench(lambda: ka.masked_layout(idx, w, EXPERTS, max_rows, consts, with_meta=True), quick)
    row.eager_ms = bench(lambda: moe_grouped_gemm.masked_rows_reference(e_kept, EXPERTS, max_rows), quick)
    os.environ.pop(moe_grouped_gemm.MASKED_ROWS_SPREAD_ENV)


# `--only "masked_rows s12 B"` (session 12, helper B): moe_grouped_gemm.masked_rows at the decode buckets T 64 / 128 /
# 256 (top-6: P = 384 / 768 / 1536 pairs, 32 / 64 / 128 rank chunks), every walk a runtime loop (call 2, T 64: the
# 32-chunk unroll 73.5 us vs the loop 40.7 us, so the unroll is gone). Two forms: "loop" (one program walks every
# chunk: BLOCK_P^2 compares on one SM -- call 2: 40.7 / 126.3 / 370.8 us, int64 ids) and "spread" (a program a chunk).
# Each row: the kernel's device time (one call replayed as a CUDA graph, as the decode graph runs it) vs its torch
# formulation (masked_rows_reference, same replay) as the eager column, checked bit for bit; the check column also
# holds the first launch's seconds with an empty Triton cache (compile + load: the stall an engine's first step at
# that bucket sees) and a relaunch served from Triton's disk cache (a restarted process).


def _first_launch_s(fn) -> tuple[float, float]:
    """(seconds of fn's first call with an empty Triton disk cache and a fresh masked_rows JIT object, seconds of the
    call after dropping only the JIT object: served from the disk cache)."""
    import tempfile

    old = os.environ.get("TRITON_CACHE_DIR")
    times = []
    with tempfile.TemporaryDirectory() as d:
        os.environ["TRITON_CACHE_DIR"] = d
        try:
            for _ in range(2):
                moe_grouped_gemm._masked_rows_kernel.cache_clear()  # (its compiled kernels live on the JIT object)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        finally:
            os.environ.pop("TRITON_CACHE_DIR") if old is None else os.environ.update(TRITON_CACHE_DIR=old)
    return times[0], times[1]


def case_masked_rows_s12b(row: Row, tokens: int, spread: bool, quick: bool, dry: bool):
    mg = moe_grouped_gemm
    row.bytes_ = float(tokens * TOPK * 8 * 3 + 4 * (2 * EXPERTS + 1))
    if dry:  # (nothing to prebuild: the row times the cold compile itself)
        return
    gen = torch.Generator().manual_seed(tokens)
    e_kept = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(tokens)]).reshape(-1).cuda()
    e_kept[1::7] = EXPERTS  # merged duplicates (the spare expert E), as the adapter passes them
    max_rows = -(-tokens // 16) * 16
    cold, disk = _first_launch_s(lambda: mg.masked_rows(e_kept, EXPERTS, max_rows, spread=spread))
    got, want = mg.masked_rows(e_kept, EXPERTS, max_rows, spread=spread), mg.masked_rows_reference(e_kept, EXPERTS,
                                                                                                   max_rows)
    if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
        raise AssertionError("masked_rows differs from its torch formulation")
    row.check = f"exact; 1st launch {cold:.2f} s cold, {disk:.2f} s disk-cached"
    row.ms = bench_device(lambda: mg.masked_rows(e_kept, EXPERTS, max_rows, spread=spread), quick)
    row.eager_ms = bench_device(lambda: mg.masked_rows_reference(e_kept, EXPERTS, max_rows), quick)


def masked_rows_s12b_cases():
    return [(f"masked_rows s12 B T{t} {'spread' if sp else 'loop'}", f"T{t} k{TOPK} E{EXPERTS}",
             lambda r, q, d, t=t, sp=sp: case_masked_rows_s12b(r, t, sp, q, d))
            for t in (64, 128, 256) for sp in (False, True)]  # fmt: skip


def case_rmsnorm(row: Row, M: int, D: int, quant: bool, quick: bool, dry: bool, cfg=None):
    cfg = cfg or rmsnorm_quant.Config()
    kernel = build(rmsnorm_quant.program(M, D, group=32, quant=quant, eps=EPS, target="sm90", cfg=cfg))
    row.bytes_, row.flops = rmsnorm_quant.roofline(M, D, 32 if quant else None)
    if dry:
        return
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(D, device="cuda") + 0.5
    if quant:
        q = torch.empty(M, D, device="cuda", dtype=torch.float8_e4m3fn)
        s = torch.empty(D // 32, M, device="cuda")
        args = (x, w, q, s)
        kernel(*args)
        rq, rs = rmsnorm_quant.reference(x, w, EPS, group=32)
        mismatch = (s.T != rs).float().mean().item()  # rare power-of-two boundary flips are fine
        deq = q.float() * s.T.repeat_interleave(32, 1)
        row.check = expect(max(rel_err(deq, rq.float() * rs.repeat_interleave(32, 1)), mismatch), 7e-2)
    else:
        y = torch.empty_like(x)
        args = (x, w, y)
        kernel(*args)
        row.check = expect(rel_err(y, rmsnorm_quant.reference(x, w, EPS)), 1e-2)
    row.ms = bench(lambda: kernel(*args), quick)
    row.eager_ms = bench(lambda: rmsnorm_quant.reference(x, w, EPS, group=32 if quant else None), quick)


def case_rmsnorm_triton(row: Row, M: int, D: int, quick: bool, dry: bool):
    row.bytes_, row.flops = rmsnorm_quant.roofline(M, D, 32)
    if dry:
        return
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(D, device="cuda") + 0.5
    q, s = rmsnorm_quant.triton_rmsnorm_quant(x, w, EPS, 32)
    rq, rs = rmsnorm_quant.reference(x, w, EPS, group=32)
    deq = q.float() * s.T.repeat_interleave(32, 1)
    row.check = expect(rel_err(deq, rq.float() * rs.repeat_interleave(32, 1)), 7e-2)
    row.ms = bench(lambda: rmsnorm_quant.triton_rmsnorm_quant(x, w, EPS, 32), quick)
    row.eager_ms = bench(lambda: rmsnorm_quant.reference(x, w, EPS, group=32), quick)


def _routing_inputs(T_: int):
    return torch.randn(T_, EXPERTS, device="cuda") * 2, torch.randn(EXPERTS, device="cuda") * 0.1


def _check_routing(idx, w, logits, bias) -> str:
    ridx, rw = moe_routing.reference(logits, bias, TOPK, 1.5)
    if not torch.equal(idx.long(), ridx.long()):
        raise AssertionError(f"expert ids differ in {(idx != ridx).any(-1).sum().item()} tokens")
    return expect(rel_err(w, rw), 1e-4)


def case_routing(row: Row, T_: int, quick: bool, dry: bool, triton_variant: bool = False):
    row.bytes_, row.flops = moe_routing.roofline(T_, EXPERTS, TOPK)
    if triton_variant:
        if dry:
            return
        logits, bias = _routing_inputs(T_)
        idx, w = moe_routing.triton_moe_routing(logits, bias, TOPK, 1.5)
        row.check = _check_routing(idx, w, logits, bias)
        row.ms = bench(lambda: moe_routing.triton_moe_routing(logits, bias, TOPK, 1.5), quick)
    else:
        kernel = build(moe_routing.program(T_, EXPERTS, topk=TOPK, route_scale=1.5, target="sm90"))
        if dry:
            return
        logits, bias = _routing_inputs(T_)
        idx = torch.empty(T_, TOPK, device="cuda", dtype=torch.int32)
        w = torch.empty(T_, TOPK, device="cuda")
        kernel(logits, bias, idx, w)
        row.check = _check_routing(idx, w, logits, bias)
        row.ms = bench(lambda: kernel(logits, bias, idx, w), quick)
    row.eager_ms = bench(lambda: moe_routing.reference(logits, bias, TOPK, 1.5), quick)


def _hc_pre_split_kernel(T_: int, D: int, splits: int):
    """pre_split_programs as one callable with pre_program's arguments (partials in scratch made once)."""
    partial, finish = (build(f) for f in hyper_connection.pre_split_programs(
        T_, D, eps=EPS, hc_eps=HC_EPS, iters=SINKHORN, target="sm90", splits=splits))  # fmt: skip

    def run(x, fn_p, base, scale, p_prev, y, pre, post, comb):
        if run.scratch is None:
            run.scratch = (torch.empty(splits, T_, hyper_connection.MIX_PAD, device="cuda"),
                           torch.empty(splits, T_, device="cuda"))  # fmt: skip
        partial(x, fn_p, p_prev, y, *run.scratch)
        finish(*run.scratch, base, scale, pre, post, comb)

    run.scratch = None
    return run


def case_hc_pre(row: Row, T_: int, quick: bool, dry: bool, splits: int = 0):
    """splits > 0: the few-token form (D split over `splits` CTAs per 16 tokens + a finish kernel)."""
    D = HIDDEN
    if splits:
        kernel = _hc_pre_split_kernel(T_, D, splits)
    else:
        kernel = build(hyper_connection.pre_program(T_, D, eps=EPS, hc_eps=HC_EPS, iters=SINKHORN, target="sm90"))
    row.bytes_, row.flops = hyper_connection.pre_roofline(T_, D)
    row.peak = "bf16"  # tf32 MMA: bounded by the 16-bit-class peak at best
    if dry:
        return
    x = torch.randn(T_, 4, D, device="cuda", dtype=torch.bfloat16)
    fn, base = torch.randn(24, 4 * D, device="cuda") * 0.01, torch.randn(24, device="cuda") * 0.3
    scale, p_prev = torch.rand(3, device="cuda") + 0.5, torch.rand(T_, 4, device="cuda")
    fn_p = hyper_connection.pad_fn(fn)
    outs = (
        torch.empty(T_, D, device="cuda", dtype=torch.bfloat16),
        *(torch.empty(T_, n, device="cuda") for n in (4, 4, 16)),
    )
    args = (x.view(T_, -1), fn_p, base, scale, p_prev, *outs)
    kernel(*args)
    ry, rpre, rpost, rc = hyper_connection.pre_reference(x, fn, base, scale, p_prev, EPS, HC_EPS, SINKHORN)
    errs = [rel_err(outs[0], ry), rel_err(outs[1], rpre), rel_err(outs[2], rpost), rel_err(outs[3], rc.view(T_, 16))]
    row.check = expect(max(errs), 2e-2)  # tf32 mixes
    row.ms = bench(lambda: kernel(*args), quick)
    row.eager_ms = bench(
        lambda: hyper_connection.pre_reference(x, fn, base, scale, p_prev, EPS, HC_EPS, SINKHORN), quick
    )


def case_hc_post(row: Row, T_: int, quick: bool, dry: bool):
    D = HIDDEN
    kernel = build(hyper_connection.post_program(T_, D, target="sm90"))
    row.bytes_, row.flops = hyper_connection.post_roofline(T_, D)
    if dry:
        return
    x = torch.randn(T_, 4, D, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(T_, D, device="cuda", dtype=torch.bfloat16)
    post, comb = torch.rand(T_, 4, device="cuda") * 2, torch.rand(T_, 16, device="cuda")
    out = torch.empty_like(x)
    kernel(x, y, post, comb, out)
    c = comb.view(T_, 4, 4)
    row.check = expect(rel_err(out, hyper_connection.post_reference(x, y, post, c)), 1e-2)
    row.ms = bench(lambda: kernel(x, y, post, comb, out), quick)
    row.eager_ms = bench(lambda: hyper_connection.post_reference(x, y, post, c), quick)


# ---------------------------------------------------------------------------------------------- decode small ops
# The non-MoE, non-attention ops of a decode-64 step at V4.1's real dims (issue 8: what is left of a layer beyond
# the MoE). Each row next to the op's torch reference (the eager column), with its check. --only "decode small".
# Times (both columns) are device times of one call replayed as a CUDA graph (bench_device), as a decode step's
# graph runs them: no Python launch cost.

DECODE_T = 64


def case_index_scores_f32(row: Row, T_: int, C: int, ratio: int, quick: bool, dry: bool, precision: str = "tf32x3",
                          tile: dict | None = None):  # fmt: skip
    """index_scores at decode on indexer_topk.triton_scores (f32 q/keys, one launch); check vs the op's reference
    (the causal mask exactly, the finite scores to 1e-5 of the row maximum for 3xTF32, 5e-3 for one TF32).
    tile: F32ScoresConfig fields other than the default's (block_c / block_t / warps variants)."""
    from deepinfer.codegen.kernels import indexer_topk as it
    from deepinfer.ir.ops.attention import indexer_scores

    row.bytes_, row.flops = it.f32_scores_roofline(T_, C)
    row.peak = "bf16"  # TF32 tensor cores: at best the 16-bit-class peak (3 products per dot: a third of it)
    if dry:
        return
    q = torch.randn(T_, IDX_HEADS, IDX_DIM, device="cuda")
    w = torch.randn(T_, IDX_HEADS, device="cuda") * IDX_HEADS**-0.5
    keys = torch.randn(C, IDX_DIM, device="cuda")
    pos = torch.arange(C * ratio - T_, C * ratio, device="cuda")  # the last T_ positions: every entry in sight
    cfg = dataclasses.replace(it.f32_scores_config(T_, C), precision=precision, **(tile or {}))
    s = it.triton_scores(q, w, keys, pos, ratio=ratio, scale=IDX_DIM**-0.5, cfg=cfg)
    ref = indexer_scores(q, w, keys, pos, ratio=ratio, scale=IDX_DIM**-0.5)[0]
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(s)):
        raise AssertionError("the causal mask differs from the reference's")
    row.check = expect(rel_err(s[fin], ref[fin]), 1e-5 if precision == "tf32x3" else 5e-3)
    row.ms = bench_device(lambda: it.triton_scores(q, w, keys, pos, ratio=ratio, scale=IDX_DIM**-0.5, cfg=cfg), quick)
    row.eager_ms = bench_device(lambda: indexer_scores(q, w, keys, pos, ratio=ratio, scale=IDX_DIM**-0.5), quick)


def case_batched_index_scores(row: Row, B: int, C: int, ratio: int, context: int, quick: bool, dry: bool,
                              tile: dict | None = None):  # fmt: skip
    """batched_index_scores (the batched decode graph: B sequences, each query against its own C keys) on
    indexer_topk.triton_batched_scores vs the op's reference (a bmm per group of sequences, [B, 32, C] fp32
    temporaries: the executor's 0.955 ms at B16 4k in session 7). Positions context-1 / context alternating, as
    bench_batched_decode's. Check: the mask exactly, the finite scores to 1e-5 of the maximum (3xTF32)."""
    from deepinfer.codegen.kernels import indexer_topk as it
    from deepinfer.ir.ops.batched import batched_indexer_scores

    row.bytes_, row.flops = it.f32_batched_scores_roofline(B, C)
    row.peak = "bf16"  # TF32 tensor cores (three products per dot); the keys' bytes bound it first
    if dry:
        return
    q = torch.randn(B, IDX_HEADS, IDX_DIM, device="cuda")
    w = torch.randn(B, IDX_HEADS, device="cuda") * IDX_HEADS**-0.5
    keys = torch.randn(B * C, IDX_DIM, device="cuda")
    pos = torch.tensor([context - 1 + (i % 2) for i in range(B)], device="cuda")
    cfg = dataclasses.replace(it.f32_batched_scores_config(B, C), **(tile or {}))
    scale = IDX_DIM**-0.5
    s = it.triton_batched_scores(q, w, keys, pos, ratio=ratio, scale=scale, cfg=cfg)
    ref = batched_indexer_scores(q, w, keys, pos, ratio=ratio, scale=scale)[0]
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(s)):
        raise AssertionError("the causal mask differs from the reference's")
    row.check = expect(rel_err(s[fin], ref[fin]), 1e-5)
    row.ms = bench_device(lambda: it.triton_batched_scores(q, w, keys, pos, ratio=ratio, scale=scale, cfg=cfg), quick)
    row.eager_ms = bench_device(lambda: batched_indexer_scores(q, w, keys, pos, ratio=ratio, scale=scale), quick)


def batched_index_scores_cases():
    """Rows "batched index_scores ...": bench_batched_decode's shapes (context 4096, max_model_len 4097: ratio 2 ->
    C 2048, ratio 1 -> C 4097 pool rows a sequence) at B 16 / 64 / 256; the decode tile (64 keys, 4 warps) and
    128 keys x 8 warps (q's split amortised over twice the keys; the tile a B > 64 batch inherits from the
    one-sequence binding); r128: the decode tile capped at 128 registers (4 CTAs an SM instead of 3; 152 bytes of
    spills)."""
    out = []
    for B in (16, 64, 256):
        for C, ratio in ((2048, 2), (4097, 1)):
            for tag, tile in (("", None), (" c128w8", {"block_c": 128, "warps": 8}), (" r128", {"maxnreg": 128})):
                out.append((f"batched index_scores f32{tag}", f"B{B} C{C} r{ratio}",
                            lambda r, q, d, B=B, C=C, ratio=ratio, tile=tile: case_batched_index_scores(
                                r, B, C, ratio, 4096, q, d, tile)))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- indexer length
# `--only "indexer length"` (helper D, session 8): decode caches are sized for max_model_len, so a step's index
# scores are [B, max_model_len / ratio] whatever a sequence's length. Rows at a 4k context (positions 4095 / 4096)
# with caches for max_model_len 4096 and 65536: the scores kernel in its first form (one CTA per key tile of the
# cache: "old"), the work-list form ("bal<n>": n CTAs an SM share one list of the step's live tiles) and the per-row
# form ("row<n>": about n x SMs CTAs split over the rows, each walking its row's live tiles in strides); "nofill":
# the columns past the live tiles left unwritten. Then the step's scores + top-k ("step"): old scores +
# topk_select without positions (the runtime's topk_entries today: every column read), row32 + the same top-k, and
# row32 nofill + topk_select WITH positions (columns past (p+1)//ratio never read: what an IR topk_entries with
# positions would run). Flat in max_model_len = the step's work follows the context. %limit: the visible
# entries' bytes (the 4k context's).
# H200, session 8 call 2 (work-list form before its 168-register cap, 2 CTAs an SM; us, mml 4096 -> 65536 r2 /
# 65536 r1): B64 scores old 50.0 -> 101.2 / 156.1, bal8 82.3 -> 84.6 / 144.7, bal8 nofill 75.8 -> 76.2 / 126.6
# (flat, but 1.6x the first form's live work at 4k: one CTA walking several tiles keeps fewer loads in flight);
# B64 step (r1 only; r2 did not build then) old 214.5, bal8 202.8, bal8 nofill+pos 174.4; B1 scores ~10-11 us in
# every form (flat already); B1 step old 16.9 -> 28.7 / 34.4, bal8 nofill+pos 18.5 -> 30.1 / 34.6 (topk_select's
# dead segments still cost with positions). The per-row form (one tile a CTA at a 4k context, the first form's
# grid at mml 4096) is unmeasured.

IDXLEN_CONTEXT = 4096


def _idxlen_inputs(B: int, C: int, batched: bool):
    """q, w, keys ([B*C, di] per-sequence pools, or one sequence's [C, di]) and positions at the 4k context."""
    q = torch.randn(B, IDX_HEADS, IDX_DIM, device="cuda")
    w = torch.randn(B, IDX_HEADS, device="cuda") * IDX_HEADS**-0.5
    keys = torch.randn(B * C if batched else C, IDX_DIM, device="cuda")
    pos = torch.tensor([IDXLEN_CONTEXT - 1 + (i % 2) for i in range(B)], device="cuda")
    return q, w, keys, pos


def _idxlen_scores_fn(B: int, C: int, ratio: int, form: str):
    """(scores callable, fill) of one form: B 1 is the one-sequence index_scores kernel, B > 1 the batched one.
    form "bal<n>|row<n>[ s<stages>][ r<maxnreg>][ nofill]": a balanced form (indexer_topk.decode_form: one query a
    CTA, k_split 32, 168 registers; bal: one work list, row: per-row strides) with n CTAs an SM."""
    from deepinfer.codegen.kernels import indexer_topk as it

    batched = B > 1
    cfg = it.F32ScoresConfig(block_t=1 if batched else 4)  # the first form, whatever DECODE_CTAS_PER_SM says
    words = form.split()
    if words[0] != "old":  # "bal<n>": the work-list form, "row<n>": the per-row form
        cfg = it.decode_form(cfg, int(words[0][3:]), per_row=words[0].startswith("row"))
        for w in words[1:]:  # "s<stages>", "r<register cap>" (r0: none)
            if w[0] in "sr" and w[1:].isdigit():
                cfg = dataclasses.replace(cfg, **{"stages" if w[0] == "s" else "maxnreg": int(w[1:])})
    fill = "nofill" not in form
    kernel = it.triton_batched_scores if batched else it.triton_scores

    def scores(q, w, keys, pos):
        return kernel(q, w, keys, pos, ratio=ratio, scale=IDX_DIM**-0.5, cfg=cfg, fill=fill)

    return scores, fill


def _idxlen_check_scores(s, ref, pos, ratio: int, fill: bool) -> str:
    """The visible columns within 1e-5 of the reference's maximum, -inf past them (up to the live tiles without
    fill: past those the columns are not written)."""
    lim = ((pos.long() + 1) // ratio).clamp(max=s.shape[1])
    cols = torch.arange(s.shape[1], device=s.device)
    vis = cols[None, :] < lim[:, None]
    upto = vis if fill else cols[None, :] < ((lim + 63) // 64 * 64)[:, None]
    if not (torch.isfinite(s[vis]).all() and (s[upto & ~vis] == float("-inf")).all()):
        raise AssertionError("the causal mask differs from the reference's")
    return expect(rel_err(s[vis], ref[vis]), 1e-5)


def case_idxlen_scores(row: Row, B: int, mml: int, ratio: int, form: str, quick: bool, dry: bool):
    """Index scores alone in one form at a 4k context, caches for max_model_len `mml`."""
    from deepinfer.codegen.kernels import indexer_topk as it
    from deepinfer.ir.ops.attention import indexer_scores
    from deepinfer.ir.ops.batched import batched_indexer_scores

    C, vis = mml // ratio, IDXLEN_CONTEXT // ratio
    row.bytes_, row.flops = it.f32_batched_scores_roofline(B, vis) if B > 1 else it.f32_scores_roofline(B, vis)
    row.peak = "bf16"
    if dry:
        return
    q, w, keys, pos = _idxlen_inputs(B, C, B > 1)
    scores, fill = _idxlen_scores_fn(B, C, ratio, form)
    ref_op = batched_indexer_scores if B > 1 else indexer_scores
    ref = ref_op(q, w, keys, pos, ratio=ratio, scale=IDX_DIM**-0.5)[0]
    row.check = _idxlen_check_scores(scores(q, w, keys, pos), ref, pos, ratio, fill)
    row.ms = bench_device(lambda: scores(q, w, keys, pos), quick)


def _idxlen_topk(B: int, C: int, ratio: int, with_pos: bool, dry: bool):
    """topk_select as the runtime's topk_entries adapter builds it (has_pos False: -inf marks the invisible
    columns), or with positions (the columns past (p+1)//ratio never read). -> (kernel, scratch maker)."""
    from deepinfer.codegen.kernels import topk_select as ts

    cfg = ts.default_config(B, C, IDX_TOPK)
    kern = build(ts.program(B, C, k=IDX_TOPK, ratio=ratio if with_pos else 1, cfg=cfg, target="sm90",
                            has_pos=with_pos))  # fmt: skip
    return kern, (lambda: ts.make_scratch(B, C, IDX_TOPK, cfg, "cuda")), cfg


def case_idxlen_step(row: Row, B: int, mml: int, ratio: int, form: str, quick: bool, dry: bool):
    """Scores + top-512 of a decode step (form: "old", "row32", "row32 nofill+pos"), checked against
    topk_select.reference of the same form's scores with every column written (exactly the same set)."""
    from deepinfer.codegen.kernels import indexer_topk as it
    from deepinfer.codegen.kernels import topk_select as ts

    C, vis = mml // ratio, IDXLEN_CONTEXT // ratio
    with_pos = "pos" in form
    fb, ff = it.f32_batched_scores_roofline(B, vis) if B > 1 else it.f32_scores_roofline(B, vis)
    tb, tf = ts.roofline(B, vis, IDX_TOPK, visible=B * vis)
    row.bytes_, row.flops, row.peak = fb + tb, ff + tf, "bf16"
    kern, make_scratch, cfg = _idxlen_topk(B, C, ratio, with_pos, dry)
    row.kernel += f" {cfg.tag}"
    if dry:
        return
    q, w, keys, pos = _idxlen_inputs(B, C, B > 1)
    scores, _ = _idxlen_scores_fn(B, C, ratio, form.replace("+pos", ""))
    filled, _ = _idxlen_scores_fn(B, C, ratio, form.replace(" nofill+pos", ""))  # the same bits, every column
    pos32, scratch = pos.int(), make_scratch()
    zeros = torch.zeros(B, dtype=torch.int32, device="cuda")
    out = torch.empty(B, IDX_TOPK, dtype=torch.int32, device="cuda")

    def step():
        kern(scores(q, w, keys, pos), pos32 if with_pos else zeros, out, *scratch)

    step()
    want = ts.reference(filled(q, w, keys, pos), IDX_TOPK)
    if not torch.equal(out.long(), want.to(out.device)):
        raise AssertionError("top-k set differs from the reference's on the form's (filled) scores")
    row.check = "top-k set exact"
    row.ms = bench_device(step, quick)


def indexer_length_cases():
    """Rows "indexer length scores ..." and "indexer length step ..." (see the section's comment; the candidate
    level's rows are in "indexer pos s9")."""
    out = []
    for B in (1, 64):
        for mml, ratio in ((4096, 2), (65536, 2), (65536, 1)):
            shape = f"B{B} mml{mml} r{ratio}"
            for form in ("old", "bal8", "row16", "row32", "row32 r0", "row32 nofill"):
                run = functools.partial(_idxlen_row, case_idxlen_scores, B, mml, ratio, form)
                out.append((f"indexer length scores {form}", shape, run))
            for form in ("old", "row32", "row32 nofill+pos"):
                run = functools.partial(_idxlen_row, case_idxlen_step, B, mml, ratio, form)
                out.append((f"indexer length step {form}", shape, run))
    return out


def _idxlen_row(case, B: int, mml: int, ratio: int, form: str, row: Row, quick: bool, dry: bool):
    case(row, B, mml, ratio, form, quick, dry)


# ---------------------------------------------------------------------------------------------- indexer pos s9
# `--only "indexer pos s9"` (helper D, session 9): topk_entries takes the queries' positions, so the runtime's top-k
# (TopKEntriesAdapter) builds topk_select with has_pos -- a row's columns past (p+1)//ratio are never read -- and the
# index scores read only by such top-ks are bound with fill False. The decode step's scores + top-512 through the
# runtime's own adapters (index_scores / batched_index_scores, then topk_entries) at a 4k context with caches for
# max_model_len (mml) 4096 and 65536, ratio 1: "old" (the top-k without positions -- every column read -- and its set
# put in the op's order by ~10 torch launches: the runtime before this session), "order" (the same with the order in
# one Triton launch, indexer_topk.triton_set_order), "pos" (+ the top-k with positions; the scores still in the
# first form, every tile written), "now" (the runtime's defaults: + the scores' per-row form without fill for caches
# of >= DECODE_LONG_C columns, the first form below). Every row's order and set
# equal the op's reference on the same (filled) scores. "part" rows (B64): the step's pieces alone -- the scores
# (first / per-row form), the bare top-k kernel (without / with positions), the order (torch / Triton). %limit: the
# visible entries' bytes. Then the candidate level: the two-level top-k as its torch reference (the runtime before)
# and through the adapter's topk_select on the gathered candidate columns (now), and candidate_blocks (torch).
# H200, call 2 (016a159; the adapters' torch order in every row), us, old -> pos: B64 mml4096 r1 135.9 -> 138.2,
# r2 105.2 -> 108.7; mml65536 r2 177.4 -> 178.3, r1 242.9 -> 241.8 (pos row16: 130.9 / 170.6); B1 58.9-78.4 ->
# 61.3-82.2 -- no gain from the positions alone: the top-k with positions still visits dead segments (B's change)
# and the steps sat ~40-45 us above the bare kernels (session 8: B64 mml4096 r2 58.7 us; the order? see "part").
# Call 3 (53158db), r1, us, old / order / pos / pos row16: B1 mml4096 59.9 / 37.5 / 39.2 / 39.5, mml65536 78.9 /
# 56.9 / 54.1 / 54.0; B64 mml4096 135.7 / 107.2 / 109.1 / 115.3, mml65536 242.5 / 214.1 / 202.8 / 132.6. Parts B64
# mml4096 / 65536: scores 79.6 / 157.5 (row16 85.2 / 87.1), top-k 13.2 / 41.1 (with positions 13.5 / 27.7), order
# torch 50.1 vs the rank-compare kernel 19.4 (now a key sort). Two-level torch (eager: Python launches included)
# -> kernel (CUDA graph): B64 649.4 -> 60.6 (4096), 719.5 -> 153.1 (65536); B1 330.8 -> 55.3, 785.0 -> 122.0.
# candidate_blocks (the op's reference, eager, with its host sync) B64 764.9 / 724.8. Both torch rows are CUDA-graph
# replays since (the batched step's way: candidate_blocks in its sync-free form).

IPOS_FORMS = ("old", "order", "pos", "now")  # (see the section's comment)


def _ipos_torch_order(on: bool, fn):
    """fn() with the top-k set put in the op's order by torch ops (the runtime before 27b9ed0) when `on`."""
    from deepinfer.runtime import kernel_adapters as ka

    saved = os.environ.get(ka.TOPK_ORDER_ENV)
    if on:
        os.environ[ka.TOPK_ORDER_ENV] = "torch"
    try:
        return fn()
    finally:
        os.environ.pop(ka.TOPK_ORDER_ENV, None)
        if saved is not None:
            os.environ[ka.TOPK_ORDER_ENV] = saved


def _ipos_call(op: str, attrs: dict, args: list, config: dict, cache: dict):
    from deepinfer.runtime import kernel_adapters as ka

    names = [f"a{i}" for i in range(len(args))]
    return ka.Call(op, attrs, args, names, [False] * len(args), config, cache)


def _ipos_scores_fn(B: int, ratio: int, form: str, fill: bool, cache: dict):
    """The step's index scores through the runtime's adapter, the form's DECODE_CTAS_PER_SM set around the call."""
    from deepinfer.codegen.kernels import indexer_topk as it
    from deepinfer.runtime import kernel_adapters as ka

    op = "batched_index_scores" if B > 1 else "index_scores"
    adapter = ka.adapter_for("indexer_topk", op)
    ctas = int(form.split("row")[1]) if "row" in form else 0
    forms = {} if form == "now" else {"DECODE_CTAS_PER_SM": ctas, "DECODE_PER_ROW": True, "DECODE_LONG_C": 0}

    def scores(q, w, keys, pos):
        saved = {name: getattr(it, name) for name in forms}
        for name, value in forms.items():
            setattr(it, name, value)
        try:
            call = _ipos_call(op, {"ratio": ratio, "scale": IDX_DIM**-0.5}, [q, w, keys, pos], {"fill": fill}, cache)
            return adapter.run(call, [])[0]
        finally:
            for name, value in saved.items():
                setattr(it, name, value)

    return scores


def _ipos_topk_call(s, pos, ratio: int, with_pos: bool, cache: dict):
    attrs = {"topk": IDX_TOPK, "block": 1, "ratio": ratio}
    return _ipos_call("topk_entries", attrs, [s, None, pos] if with_pos else [s, None], {}, cache)


def _ipos_topk_kernel(B: int, C: int, ratio: int, with_pos: bool):
    """The top-k kernel the runtime's adapter asks for (its key from meta tensors), built for the H200."""
    from deepinfer.runtime import kernel_adapters as ka

    s, pos = torch.empty(B, C, device="meta"), torch.empty(B, dtype=torch.long, device="meta")
    saved, ka.EMULATE = ka.EMULATE, True  # (keys on meta tensors, as the compiler's engine_kernel_keys)
    try:
        key = ka.adapter_for("topk_select", "topk_entries").keys(_ipos_topk_call(s, pos, ratio, with_pos, {}))[0]
    finally:
        ka.EMULATE = saved
    return key, ka.build_kernel(key)


def case_ipos_step(row: Row, B: int, mml: int, ratio: int, form: str, quick: bool, dry: bool):
    """Scores + top-512 of a decode step through the runtime's adapters (see the section's comment)."""
    from deepinfer.codegen.kernels import indexer_topk as it
    from deepinfer.codegen.kernels import topk_select as ts
    from deepinfer.ir.ops.v41 import TopKEntries
    from deepinfer.runtime import kernel_adapters as ka

    C, vis = mml // ratio, IDXLEN_CONTEXT // ratio
    with_pos = form in ("pos", "now")
    fb, ff = it.f32_batched_scores_roofline(B, vis) if B > 1 else it.f32_scores_roofline(B, vis)
    tb, tf = ts.roofline(B, vis, IDX_TOPK, visible=B * vis)
    row.bytes_, row.flops, row.peak = fb + tb, ff + tf, "bf16"
    key, kern = _ipos_topk_kernel(B, C, ratio, with_pos)
    row.kernel += f" {'h' if key.program == 'hist_program' else 'p'}{key.args[1]}"
    if dry:
        return
    q, w, keys, pos = _idxlen_inputs(B, C, B > 1)
    cache: dict = {}
    scores = _ipos_scores_fn(B, ratio, form, not with_pos, cache)
    topk = ka.adapter_for("topk_select", "topk_entries")

    def step():
        call = _ipos_topk_call(scores(q, w, keys, pos), pos, ratio, with_pos, cache)
        return _ipos_torch_order(form == "old", lambda: topk.run(call, [kern])[0])

    got = step()
    filled = _ipos_scores_fn(B, ratio, form, True, {})(q, w, keys, pos)  # the same bits on the visible columns
    want = TopKEntries.reference(filled, None, pos if with_pos else None, topk=IDX_TOPK, block=1, ratio=ratio)
    if not torch.equal(got, want):
        raise AssertionError("top-k differs from topk_entries' reference on the form's (filled) scores")
    row.check = "top-k exact"
    if with_pos:  # the columns past the limit are not read: the largest values there change nothing
        dead = torch.arange(C, device="cuda")[None, :] >= ((pos + 1) // ratio)[:, None]
        poisoned = topk.run(_ipos_topk_call(filled.masked_fill(dead, 1e30), pos, ratio, True, {}), [kern])[0]
        if not torch.equal(poisoned, want):
            raise AssertionError("a column past the visible limit was read")
        row.check += ", dead cols unread"
    row.ms = bench_device(step, quick)


IPOS_PARTS = ("scores old", "scores row16", "topk nopos", "topk pos", "order torch", "order kernel")


def case_ipos_part(row: Row, B: int, mml: int, ratio: int, part: str, quick: bool, dry: bool):
    """One part of the step alone (its split): the scores adapter (first form / per-row form without fill), the
    bare top-k kernel (without / with positions), or the set's order (torch ops / the Triton launch)."""
    from deepinfer.codegen.kernels import indexer_topk as it
    from deepinfer.codegen.kernels import topk_select as ts
    from deepinfer.ir.ops.v41 import TopKEntries
    from deepinfer.runtime import kernel_adapters as ka

    C, vis = mml // ratio, IDXLEN_CONTEXT // ratio
    kind, form = part.split()
    row.peak = "bf16"
    row.bytes_ = (it.f32_batched_scores_roofline(B, vis) if B > 1 else it.f32_scores_roofline(B, vis))[0] if (
        kind == "scores") else ts.roofline(B, vis, IDX_TOPK, visible=B * vis)[0]  # fmt: skip
    with_pos = form != "nopos"
    if kind == "topk":
        key, kern = _ipos_topk_kernel(B, C, ratio, with_pos)
        row.kernel += f" {'h' if key.program == 'hist_program' else 'p'}{key.args[1]}"
    if dry:
        return
    q, w, keys, pos = _idxlen_inputs(B, C, B > 1)
    s = _ipos_scores_fn(B, ratio, "pos row16" if form == "row16" else "old", True, {})(q, w, keys, pos)
    want = TopKEntries.reference(s, None, pos, topk=IDX_TOPK, block=1, ratio=ratio)
    if kind == "scores":  # the visible columns against the op's reference (1e-5 of the row maxima)
        from deepinfer.ir.ops.attention import indexer_scores
        from deepinfer.ir.ops.batched import batched_indexer_scores

        fill = form != "row16"
        fn = _ipos_scores_fn(B, ratio, "pos row16" if form == "row16" else "old", fill, {})
        ref = (batched_indexer_scores if B > 1 else indexer_scores)(q, w, keys, pos, ratio=ratio, scale=IDX_DIM**-0.5)
        row.check = _idxlen_check_scores(fn(q, w, keys, pos), ref[0], pos, ratio, fill)
        row.ms = bench_device(lambda: fn(q, w, keys, pos), quick)
        return
    if kind == "topk":
        scratch = ts.make_scratch(B, key.args[1], IDX_TOPK, ts.default_config(B, key.args[1], IDX_TOPK), "cuda")
        p32 = pos.int() if with_pos else torch.zeros(B, dtype=torch.int32, device="cuda")
        idx = torch.empty(B, IDX_TOPK, dtype=torch.int32, device="cuda")
        kern(s, p32, idx, *scratch)
        if not torch.equal(idx.long(), ts.reference(s, IDX_TOPK)):
            raise AssertionError("the kernel's set differs from topk_select.reference")
        row.check = "set exact"
        row.ms = bench_device(lambda: kern(s, p32, idx, *scratch), quick)
        return
    idx = ts.reference(s, IDX_TOPK).int()  # the set, ascending
    if form == "kernel":
        fn = functools.partial(it.triton_set_order, s, idx, B)
    else:
        fn = functools.partial(ka._score_order, s, idx.long())
    if not torch.equal(fn(), want):
        raise AssertionError("the order differs from topk_entries'")
    row.check = "= reference"
    row.ms = bench_device(fn, quick)


def _ipos_two_level_inputs(B: int, C: int, ratio: int):
    """positions at the 4k context, scores (past the limit: anything, as a scores kernel without fill leaves them)
    and layer 20's candidate blocks (2048 of 8) of them."""
    from deepinfer.ir.ops.v41 import CandidateBlocks

    pos = torch.tensor([IDXLEN_CONTEXT - 1 - (i % 2) for i in range(B)], device="cuda")  # (< max_model_len)
    assert int(pos.max()) < C * ratio, "a position past the cache (candidate_blocks would index past its blocks)"
    s = torch.randn(B, C, device="cuda")
    return s, CandidateBlocks.reference(s, pos, ratio=ratio, topk_blocks=2048, block=8), pos


def case_ipos_two_level(row: Row, B: int, mml: int, ratio: int, form: str, quick: bool, dry: bool):
    """The two-level topk_entries (V4.1's layers after the candidate source), form "torch": its reference with the
    positions (a [B, C] visibility mask and block mask, a sort of all C columns) -- the runtime before
    -- or "kernel": the runtime's adapter now (topk_select on the 16384 gathered candidate columns, or on the row
    with positions when C <= 16384), the same indices exactly."""
    from deepinfer.ir.ops.v41 import TopKEntries
    from deepinfer.runtime import kernel_adapters as ka

    C, vis = mml // ratio, IDXLEN_CONTEXT // ratio
    row.bytes_, row.peak = 4.0 * B * vis, "bf16"
    attrs = {"topk": IDX_TOPK, "block": 8, "ratio": ratio}
    if form == "kernel":
        meta = [torch.empty(B, C, device="meta"), torch.empty(B, 2048, dtype=torch.long, device="meta"),
                torch.empty(B, dtype=torch.long, device="meta")]  # fmt: skip
        saved, ka.EMULATE = ka.EMULATE, True
        try:
            key = ka.adapter_for("topk_select", "topk_entries").keys(_ipos_call("topk_entries", attrs, meta, {}, {}))[0]
        finally:
            ka.EMULATE = saved
        row.kernel += f" {'h' if key.program == 'hist_program' else 'p'}{key.args[1]}"
        kern = ka.build_kernel(key)
    if dry:
        return
    s, blocks, pos = _ipos_two_level_inputs(B, C, ratio)

    def reference():
        return TopKEntries.reference(s, blocks, pos, topk=IDX_TOPK, block=8, ratio=ratio)

    want = reference()
    if form == "torch":  # (device ops only: replayed as a CUDA graph, as the batched decode step runs it)
        row.check = "torch reference"
        row.ms = bench_device(reference, quick)
        return
    adapter, cache = ka.adapter_for("topk_select", "topk_entries"), {}

    def run():
        return adapter.run(_ipos_call("topk_entries", attrs, [s, blocks, pos], {}, cache), [kern])[0]

    if not torch.equal(run(), want):
        raise AssertionError("the two-level top-k differs from topk_entries' reference")
    row.check = "= reference"
    row.ms = bench_device(run, quick)


def indexer_pos_s9_cases():
    """Rows "indexer pos s9 step <form>" (B1 / B64, mml 4096 / 65536, ratio 1), "... part <part>" (B64: the step's
    split), the two-level top-k (torch / kernel) and candidate_blocks (torch)."""
    out = []
    for B in (1, 64):
        for mml in (4096, 65536):
            for form in IPOS_FORMS:
                run = functools.partial(_idxlen_row, case_ipos_step, B, mml, 1, form)
                out.append((f"indexer pos s9 step {form}", f"B{B} mml{mml} r1", run))
    for mml in (4096, 65536):
        for part in IPOS_PARTS:
            run = functools.partial(_idxlen_row, case_ipos_part, 64, mml, 1, part)
            out.append((f"indexer pos s9 part {part}", f"B64 mml{mml} r1", run))
    for mml in (4096, 65536):
        for B in (1, 64):
            for form in ("torch", "kernel"):
                run = functools.partial(_idxlen_row, case_ipos_two_level, B, mml, 1, form)
                out.append((f"indexer pos s9 two-level {form}", f"B{B} mml{mml} r1", run))
        run = functools.partial(_idxlen_row, case_ipos_candidates, 64, mml, 1, "")
        out.append(("indexer pos s9 candidate_blocks (torch)", f"B64 mml{mml} r1", run))
    return out


def case_ipos_candidates(row: Row, B: int, mml: int, ratio: int, form: str, quick: bool, dry: bool):
    """candidate_blocks (layer 20; no kernel) as the batched decode step runs it: the sync-free torch form
    (runtime/cuda_graphs.candidate_blocks) replayed as a CUDA graph, checked equal to the op's reference."""
    from deepinfer.ir.ops.v41 import CandidateBlocks
    from deepinfer.runtime.cuda_graphs import candidate_blocks

    C, vis = mml // ratio, IDXLEN_CONTEXT // ratio
    row.bytes_, row.peak = 4.0 * B * vis, "bf16"
    if dry:
        return
    s, _, pos = _ipos_two_level_inputs(B, C, ratio)
    kw = dict(ratio=ratio, topk_blocks=2048, block=8)
    if not torch.equal(candidate_blocks(s, pos, **kw), CandidateBlocks.reference(s, pos, **kw)):
        raise AssertionError("the sync-free candidate_blocks differs from the op's reference")
    row.check = "= reference"
    row.ms = bench_device(lambda: candidate_blocks(s, pos, **kw), quick)


# ---------------------------------------------------------------------------------------------- candidate_blocks
# `--only "candidate_blocks"` (helper D, session 10): layer 20's candidate level (V4.1, MODEL_SPEC §2.13: 2048 blocks
# of 8 entries, ratio 1) on codegen/kernels/candidate_blocks.py (Triton: the visible blocks' maxima, one sort a row of
# up to 512 visible blocks, longer rows merged -- the module docstring) at B1 / B64 / B256, a context of 4096, 16384
# or 65536 tokens in a cache of C entries. Rows: "kernel" (CUDA-graph replay; vs eager: the op's reference, eager,
# with its host sync), "sync-free" (the torch form the batched step ran before, runtime/cuda_graphs.candidate_blocks,
# CUDA-graph replay), "cfg <tag>" (B64, the config space). Every row's ids equal the op's reference (scores -inf past
# the visible columns). %limit: the visible scores read once + the i64 ids written.
# H200 call 2 (7f89b74; the first form: fused at C4096, sorts of up to 4096 keys in passes), us, kernel / sync-free:
# ctx4096 C4096 B1 14.0 / 72.0, B64 14.8 / 78.4 (unfused 11.1), B256 21.7 / 93.2; ctx4096 C65536 9.9 / 97.2, 11.1 /
# 199.6, 16.4 / 497.2; ctx65536 291.2 / 100.2, 284.0 / 212.2, 428.0 / 512.5 (a 4096-key tl.sort ~90 us: the merge).
# Call 3 (baa58ce; the merge, scans of 512 blocks), kernel: ctx4096 C4096 9.4 / 10.5 / 13.6; ctx4096 C65536 12.9 /
# 14.8 / 22.3; ctx16384 22.8 / 27.4 / 56.0; ctx65536 76.3 / 85.4 / 141.3. cfg B64 ctx65536: 8 sort warps 81.1, bnb 128
# 83.5, the winners in one sort 135.7, passes of 4096-key sorts 282.7 (both removed). Scans of 2048 blocks since.

CAND_TOPK, CAND_BLOCK = 2048, 8
CAND_SHAPES = ((4096, 4096), (4096, 65536), (16384, 65536), (65536, 65536))  # (context, cache columns C)
CAND_CFG_SHAPES = ((4096, 4096), (65536, 65536))  # the config space's rows (B64)


def _cand_inputs(B: int, ctx: int, C: int):
    """Scores [B, C] (-inf past each row's visible columns) and positions at the context's last tokens."""
    pos = torch.tensor([ctx - 1 - (i % 2) for i in range(B)], device="cuda")
    s = torch.randn(B, C, device="cuda")
    return s.masked_fill(torch.arange(C, device="cuda")[None, :] > pos[:, None], float("-inf")), pos


def case_candidate_blocks(row: Row, B: int, ctx: int, C: int, form: str, quick: bool, dry: bool, cfg=None):
    from deepinfer.codegen.kernels import candidate_blocks as cb
    from deepinfer.ir.ops.v41 import CandidateBlocks
    from deepinfer.runtime.cuda_graphs import candidate_blocks as sync_free

    kw = dict(ratio=1, topk_blocks=CAND_TOPK, block=CAND_BLOCK)
    cfg = cfg or cb.default_config(B, C, CAND_BLOCK, CAND_TOPK)
    cb.check_config(C, CAND_BLOCK, CAND_TOPK, cfg)
    row.bytes_, row.peak = cb.roofline(B * min(ctx, C), B, CAND_TOPK), "bf16"
    if form != "sync-free":
        row.kernel += f" [{cfg.tag}]"
    if dry and not (torch.cuda.is_available() and form != "sync-free"):
        return
    s, pos = _cand_inputs(B, ctx, C)
    if dry:  # (-j on the GPU host: the prebuild workers JIT-compile the Triton kernels into its disk cache)
        cb.triton_candidate_blocks(s, pos, cfg=cfg, ratio=1, topk_blocks=CAND_TOPK, block=CAND_BLOCK)
        return
    want = CandidateBlocks.reference(s, pos, **kw)
    fn = functools.partial(sync_free, s, pos, **kw)
    if form != "sync-free":
        fn = functools.partial(cb.triton_candidate_blocks, s, pos, cfg=cfg, **kw)
    if not torch.equal(fn(), want):
        raise AssertionError(f"candidate_blocks ({form}) differs from the op's reference")
    row.check = "= reference"
    row.ms = bench_device(fn, quick)
    if form == "kernel":
        row.eager_ms = bench(lambda: CandidateBlocks.reference(s, pos, **kw), quick)


def candidate_blocks_cases():
    """Rows "candidate_blocks kernel|sync-free" (B1/B64/B256 x CAND_SHAPES) and "candidate_blocks cfg" (B64)."""
    from deepinfer.codegen.kernels import candidate_blocks as cb

    out = []
    for ctx, C in CAND_SHAPES:
        for B in (1, 64, 256):
            for form in ("kernel", "sync-free"):
                run = functools.partial(case_candidate_blocks, B=B, ctx=ctx, C=C, form=form)
                out.append((f"candidate_blocks {form}", f"B{B} ctx{ctx} C{C}",
                            lambda r, q, d, run=run: run(r, quick=q, dry=d)))  # fmt: skip
    for ctx, C in CAND_CFG_SHAPES:
        for cfg in cb.config_space(64, C, CAND_BLOCK, CAND_TOPK)[1:]:
            run = functools.partial(case_candidate_blocks, B=64, ctx=ctx, C=C, form="cfg", cfg=cfg)
            out.append(("candidate_blocks cfg", f"B64 ctx{ctx} C{C}", lambda r, q, d, run=run: run(r, quick=q, dry=d)))
    return out


# ---------------------------------------------------------------------------------------------- engram_hash
# `--only "engram_hash s11"` (helper C, session 11): V4.1's Engram row ids (layer 1's attributes: 3 n-gram orders x 8
# heads, the tokenizer's compressed map) on codegen/kernels/engram_hash.py (one Triton launch) at a decode step of
# one sequence (T 1 / 64), B sequences of one token (batched_engram_hash, B 64 / 256) and a 4096-token prefill.
# Rows: "kernel" (CUDA-graph replay; vs eager: the op's reference, eager, its token map copied to the device each
# call as the reference does), "torch graph" (the reference replayed as a CUDA graph, the token map served once:
# what a decode layer's graph ran before, 0.140 ms of layer 1 at T 64 in session 11's bench_slice). Every row's ids
# equal the reference's. %limit: the ids and histories read, N map entries a row gathered, the ids written (a few
# KB: launch-bound, the time is the figure).

ENGRAM_HASH_SHAPES = ((1, False), (64, False), (4096, False), (64, True), (256, True))  # (rows, batched)


def _engram_hash_operands(t: int, batched: bool):
    from deepinfer.models import deepseek_v41 as m41
    from deepinfer.models.presets import engram_primes, preset_config

    cfg = m41.parse_config(preset_config("deepseek-v4.1-flash", "real"))
    primes = engram_primes(cfg.engram_vocab_size, len(cfg.engram_layers), cfg.engram_max_ngram, cfg.engram_n_heads)
    attrs = dict(multipliers=m41.engram_multipliers(cfg, 1), primes=[p for n in primes[0] for p in n],
                 n_heads=cfg.engram_n_heads, pad_id=cfg.engram_pad_id, vocab=cfg.vocab_size,
                 compressed_vocab=cfg.engram_compressed_vocab, image_token_id=cfg.image_token_id)  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(t)
    toks = torch.randint(0, cfg.vocab_size, (t,), device="cuda", generator=g)
    hist = torch.randint(0, cfg.vocab_size, ((cfg.engram_max_ngram - 1) * (t if batched else 1),), device="cuda",
                         generator=g)  # fmt: skip
    hist[: cfg.engram_max_ngram - 1] = -1  # (a new sequence's first token)
    return toks, hist, attrs


def case_engram_hash(row: Row, t: int, batched: bool, form: str, quick: bool, dry: bool):
    from deepinfer.codegen.kernels import engram_hash as eh
    from deepinfer.runtime import cuda_graphs as cg

    row.bytes_, row.peak = eh.roofline(t, 4, 24, batched), "bf16"
    if dry and not (torch.cuda.is_available() and form == "kernel"):
        return
    toks, hist, attrs = _engram_hash_operands(t, batched)
    cmap, consts, pad = eh.device_tables(attrs, "cuda")
    kw = dict(n_heads=attrs["n_heads"], pad_class=pad, image_token_id=attrs["image_token_id"], batched=batched)
    fn = functools.partial(eh.triton_engram_hash, toks, hist, cmap, consts, **kw)
    if dry:  # (-j on the GPU host: the prebuild workers JIT-compile the kernel into Triton's disk cache)
        fn()
        return
    want = eh.reference(toks, hist, batched=batched, **attrs)
    if form == "torch graph":
        memo: dict = {}

        def fn():
            with cg.HostSyncGuard(memo=memo):  # the token map's host -> device copy made once, then served
                return eh.reference(toks, hist, batched=batched, **attrs)

    if not torch.equal(fn(), want):
        raise AssertionError(f"engram_hash ({form}) differs from the op's reference")
    row.check = "= reference"
    row.ms = bench_device(fn, quick)
    if form == "kernel":
        row.eager_ms = bench(lambda: eh.reference(toks, hist, batched=batched, **attrs), quick)


def engram_hash_s11_cases():
    out = []
    for t, batched in ENGRAM_HASH_SHAPES:
        for form in ("kernel", "torch graph"):
            run = functools.partial(case_engram_hash, t=t, batched=batched, form=form)
            out.append((f"engram_hash s11 {form}", f"{'B' if batched else 'T'}{t}",
                        lambda r, q, d, run=run: run(r, quick=q, dry=d)))  # fmt: skip
    return out


def case_linear_bf16(row: Row, T_: int, N: int, K: int, quick: bool, dry: bool):
    """linear (f32 x, bf16 weight) on linear_bf16's kernel; check vs the op's reference (fp32 copy of the weight,
    the eager column) to 1e-5 of the output's maximum: both are fp32 sums of K exact products in different orders,
    each rounding <= 2^-24 of the running sum, so ~sqrt(K) * 2^-24 * (sum |x w|) / max |y| ~ 1e-6 at K = 5120
    (H200: 1.1e-6); a lost term or a wrong split is >= 1e-3."""
    from deepinfer.codegen.kernels import linear_bf16
    from deepinfer.ir.ops.core import Linear

    cfg = linear_bf16.default_config(T_, N, K)
    row.bytes_, row.flops = linear_bf16.roofline(T_, N, K)
    row.peak = "bf16"
    if dry:
        return
    x = torch.randn(T_, K, device="cuda")
    w = (torch.randn(N, K, device="cuda") * 0.02).bfloat16()
    y = linear_bf16.triton_linear(x, w, cfg)
    row.check = expect(rel_err(y, Linear.reference(x, w, None)), 1e-5)
    row.ms = bench_device(lambda: linear_bf16.triton_linear(x, w, cfg), quick)
    row.eager_ms = bench_device(lambda: Linear.reference(x, w, None), quick)


def case_compressor_keys_triton(row: Row, T_: int, pair: bool, quick: bool, dry: bool):
    """(pair_)compressor_keys on compressor.triton_compressor_keys (one launch); check vs the op's reference (fp32
    both: 1e-5; entry_idx and the pending state exactly), eager = the reference."""
    from deepinfer.codegen.kernels import compressor, rope
    from deepinfer.ir.ops.attention import rope_inv_freq
    from deepinfer.ir.registry import get_op

    d, di = 512, IDX_DIM
    g = (T_ + 1) // 2 if pair else T_
    row.bytes_ = float(4 * T_ * d * (2 if pair else 1) + 2 * di * d + 4 * g * (d + di))
    row.flops = float(2 * g * d * di)
    if dry:
        return
    ra = {"rope_dim": 64, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 65536, "beta_fast": 32.0,
          "beta_slow": 1.0}  # fmt: skip
    table = rope.cos_sin_table(8192, rope_inv_freq(*ra.values())).cuda()
    kv, score = torch.randn(T_, d, device="cuda"), torch.randn(T_, d, device="cuda")
    norm, k_norm = torch.rand(d, device="cuda").bfloat16() + 0.5, torch.rand(di, device="cuda").bfloat16() + 0.5
    wk = (torch.randn(di, d, device="cuda") / d**0.5).bfloat16()
    pos = torch.arange(4096, 4096 + T_, device="cuda")
    skv, ssc = torch.randn(1, d, device="cuda"), torch.randn(1, d, device="cuda")
    if pair:
        op, args = "pair_compressor_keys", [kv, score, skv, ssc, pos, norm, wk, k_norm]
        extra = {"score": score, "state_kv": skv, "state_score": ssc}
    else:
        op, args, extra = "compressor_keys", [kv, pos, norm, wk, k_norm], {}

    def run():
        return compressor.triton_compressor_keys(kv, pos, norm, wk, k_norm, table, eps=1e-6, rope_dim=64, **extra)

    got, ref = run(), get_op(op).run(args, {"eps": 1e-6, **ra})
    if any(not torch.equal(a, b) for a, b in zip(got[2:], ref[2:])):
        raise AssertionError("entry_idx / the pending state differ from the reference")
    row.check = expect(max(rel_err(a, b) for a, b in zip(got[:2], ref[:2])), 1e-5)
    row.ms = bench_device(run, quick)
    row.eager_ms = bench_device(lambda: get_op(op).run(args, {"eps": 1e-6, **ra}), quick)


def case_f32_io(row: Row, kind: str, T_: int, quick: bool, dry: bool):
    """rmsnorm (attn_norm width) / rope (the indexer q: 32 x 128) on their io="float32" programs -- the graph's fp32
    activations in and out, no cast launches -- checked bit for bit against the bf16 program on the bf16-rounded
    input; the "eager" column times that previous path (cast, bf16 kernel, cast back: 3 launches)."""
    if kind == "rmsnorm":
        cfg = rmsnorm_quant.Config(1, 256)
        mk = functools.partial(rmsnorm_quant.program, T_, HIDDEN, group=32, quant=False, eps=EPS, target="sm90",
                               cfg=cfg)  # fmt: skip
        row.bytes_, row.flops = 2 * rmsnorm_quant.roofline(T_, HIDDEN, None)[0], 0.0  # fp32 in and out
    else:
        mk = functools.partial(rope.program, T_, IDX_HEADS, IDX_DIM, 8192, rope_dim=64, inverse=False,
                               target="sm90")  # fmt: skip
        row.bytes_, row.flops = float(8 * T_ * IDX_HEADS * IDX_DIM), 0.0
    k32, k16 = build(mk(io="float32")), build(mk())
    if dry:
        return
    if kind == "rmsnorm":
        x, extra = torch.randn(T_, HIDDEN, device="cuda") * 3, (torch.rand(HIDDEN, device="cuda") + 0.5,)
    else:
        from deepinfer.ir.ops.attention import rope_inv_freq

        x = torch.randn(T_, IDX_HEADS, IDX_DIM, device="cuda")
        table = rope.cos_sin_table(8192, rope_inv_freq(64, 160000.0, 16.0, 65536, 32.0, 1.0)).cuda()
        extra = (torch.arange(4096, 4096 + T_, device="cuda", dtype=torch.int32), table)
    y, yb = torch.empty_like(x), torch.empty_like(x, dtype=torch.bfloat16)

    def before():
        k16(x.to(torch.bfloat16), *extra, yb)
        return yb.float()

    k32(x, *extra, y)
    if not torch.equal(y, before()):
        raise AssertionError("io=float32 differs from the bf16 program on the bf16-rounded input")
    row.check = "exact"
    row.ms = bench_device(lambda: k32(x, *extra, y), quick)
    row.eager_ms = bench_device(before, quick)


def case_hc_post_pre_chain(row: Row, T_: int, quick: bool, dry: bool):
    """hc_post_pre_collapse as the runtime runs it at decode now: post_program + the split pre pair (S=40), all with
    io="float32" (the graph's fp32 streams, no cast launches: 3 launches); checked against post_reference +
    pre_reference on the bf16-rounded streams (tf32 mixes: 2e-2). "eager" = the previous runtime path: casts to
    bf16, post_program, pre_program (16 rows per CTA), casts back (6 launches)."""
    D, S = HIDDEN, 40
    kw = {"eps": EPS, "hc_eps": HC_EPS, "iters": SINKHORN, "target": "sm90"}
    post32 = build(hyper_connection.post_program(T_, D, target="sm90", io="float32"))
    part, fin = (build(f) for f in hyper_connection.pre_split_programs(T_, D, splits=S, io="float32", **kw))
    post16 = build(hyper_connection.post_program(T_, D, target="sm90"))
    pre16 = build(hyper_connection.pre_program(T_, D, cfg=hyper_connection.Config(16, 128, 128), **kw))
    row.bytes_ = float(4 * T_ * D * (4 + 1 + 4 + 4 + 1))  # X, y in; X' out; X' in; collapse out (fp32)
    row.flops = hyper_connection.pre_roofline(T_, D)[1] + hyper_connection.post_roofline(T_, D)[1]
    row.peak = "bf16"
    if dry:
        return
    x, y = torch.randn(T_, 4, D, device="cuda"), torch.randn(T_, D, device="cuda")
    post, comb = torch.rand(T_, 4, device="cuda") * 2, torch.rand(T_, 16, device="cuda") / 4
    fn, base = torch.randn(24, 4 * D, device="cuda") * 0.01, torch.randn(24, device="cuda") * 0.3
    scale, prev = torch.rand(3, device="cuda") + 0.5, torch.rand(T_, 4, device="cuda")
    fn_p = hyper_connection.pad_fn(fn)
    xn, yc = torch.empty_like(x), torch.empty_like(y)
    pm, psq = torch.empty(S, T_, 32, device="cuda"), torch.empty(S, T_, device="cuda")
    coef = tuple(torch.empty(T_, n, device="cuda") for n in (4, 4, 16))

    def now():
        post32(x, y, post, comb, xn)
        part(xn.view(T_, -1), fn_p, prev, yc, pm, psq)
        fin(pm, psq, base, scale, *coef)

    def before():
        xb = torch.empty(T_, 4, D, device="cuda", dtype=torch.bfloat16)
        post16(x.to(torch.bfloat16), y.to(torch.bfloat16), post, comb, xb)
        yb = torch.empty(T_, D, device="cuda", dtype=torch.bfloat16)
        pre16(xb.view(T_, -1), fn_p, base, scale, prev, yb, *(torch.empty_like(c) for c in coef))
        return xb.float(), yb.float()

    now()
    rx = hyper_connection.post_reference(x.bfloat16(), y.bfloat16(), post, comb.view(T_, 4, 4))
    ry, rpre, rpost, rc = hyper_connection.pre_reference(rx, fn, base, scale, prev, EPS, HC_EPS, SINKHORN)
    errs = [rel_err(xn, rx.float()), rel_err(yc, ry.float()), rel_err(coef[0], rpre), rel_err(coef[1], rpost),
            rel_err(coef[2], rc.view(T_, 16))]  # fmt: skip
    row.check = expect(max(errs), 2e-2)
    row.ms = bench_device(now, quick)
    row.eager_ms = bench_device(before, quick)


DECODE_DENSE = {"wq_a": (Q_LORA, HIDDEN), "wq_b": (HEADS * HEAD_DIM, Q_LORA), "wkv": (512, HIDDEN),
                "idx wq_b": (32 * 128, Q_LORA), "wo_b": (HIDDEN, 8192)}  # (N, K) at V4.1 dims


def case_dense_swab(row: Row, T_: int, N: int, K: int, quick: bool, dry: bool):
    """A decode linear_fp8 node (g32 activations, 32x32 weight blocks) as the runtime adapter runs it now: the
    swap-AB program with K split over 'experts' (kernel_adapters.dense_swab_splits) + the activation quantiser +
    the partial sum; checked against the op's reference; "eager" = the same node on the fp8_gemm program used
    before (DEEPINFER_DENSE_SWAB=0: quantiser + GEMM + crop)."""
    from deepinfer.ir.dtypes import float_to_e8m0
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import kernel_adapters as ka

    adapter = ka.adapter_for("fp8_gemm", "linear_fp8")
    attrs = {"block": 32, "act_group": 32}

    def node(x, w, s):
        return ka.Call("linear_fp8", attrs, [x, w, s], ["x", "w", "s"], [False, True, True], {}, {})

    stub = node(torch.empty(T_, K), torch.empty(N, K, dtype=torch.float8_e4m3fn), None)
    old = os.environ.get(ka.DENSE_SWAB_ENV)
    keys = {}
    for mode in ("1", "0"):
        os.environ[ka.DENSE_SWAB_ENV] = mode
        with _emulate_plan():
            keys[mode] = adapter.keys(stub)
    if old is None:
        os.environ.pop(ka.DENSE_SWAB_ENV, None)
    else:
        os.environ[ka.DENSE_SWAB_ENV] = old
    kern = {m: [build(ka._factory(k)) for k in ks] for m, ks in keys.items()}
    row.bytes_, row.flops = fp8_gemm.roofline(T_, N, K, 32, 32)
    if dry:
        return
    x = torch.randn(T_, K, device="cuda")
    w = (torch.randn(N, K, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    s = float_to_e8m0(2.0 ** torch.randint(-8, -4, (N // 32, K // 32), device="cuda").float())
    now, before = node(x, w, s), node(x, w, s)
    y = adapter.run(now, kern["1"])[0]
    row.check = expect(rel_err(y, get_op("linear_fp8").run([x, w, s], attrs)[0]), 2e-2)
    os.environ[ka.DENSE_SWAB_ENV] = "0"
    try:
        adapter.run(before, kern["0"])
        row.eager_ms = bench_device(lambda: adapter.run(before, kern["0"]), quick)
    finally:
        os.environ.pop(ka.DENSE_SWAB_ENV, None)
    row.ms = bench_device(lambda: adapter.run(now, kern["1"]), quick)


class _emulate_plan:
    """The adapters' planning on CPU stand-in tensors (keys only: no kernel runs)."""

    def __enter__(self):
        from deepinfer.runtime import kernel_adapters as ka

        self.saved, ka.EMULATE = ka.EMULATE, True

    def __exit__(self, *exc):
        from deepinfer.runtime import kernel_adapters as ka

        ka.EMULATE = self.saved


def case_dequant(row: Row, T_: int, quick: bool, dry: bool):
    """dequant_fp8 of the attention output [T, 8, 4096] (128-groups) on act_quant.triton_dequant, bit for bit the
    op's reference (the eager column)."""
    from deepinfer.codegen.kernels import act_quant
    from deepinfer.ir import dtypes as dt
    from deepinfer.ir.ops.quant import dequant_fp8_groups

    shape = (T_, 8, 4096)
    row.bytes_, row.flops = float(T_ * 8 * 4096 * 5 + T_ * 8 * 32), 0.0
    if dry:
        return
    q = (torch.randn(*shape, device="cuda") * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = dt.float_to_e8m0(2.0 ** torch.randint(-20, 5, (T_, 8, 32), device="cuda").float())
    if not torch.equal(act_quant.triton_dequant(q, s, 128), dequant_fp8_groups(q, s, 128)):
        raise AssertionError("dequant differs from dequant_fp8_groups")
    row.check = "exact"
    row.ms = bench_device(lambda: act_quant.triton_dequant(q, s, 128), quick)
    row.eager_ms = bench_device(lambda: dequant_fp8_groups(q, s, 128), quick)


def case_scatter_rows(row: Row, N: int, D: int, M: int, quick: bool, dry: bool):
    """scatter_rows on cache_rows (copy + one Triton launch), equal to the op's reference; "eager" = the sync-free
    torch form the decode graphs used before (runtime/cuda_graphs.scatter_rows)."""
    from deepinfer.codegen.kernels import cache_rows
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import cuda_graphs as cg

    row.bytes_, row.flops = float(8 * N * D + 4 * M * D), 0.0  # the copy (read + write) and the rows
    if dry:
        return
    cache, rows = torch.randn(N, D, device="cuda"), torch.randn(M, D, device="cuda")
    idx = torch.arange(N - M, N, device="cuda")
    want = get_op("scatter_rows").run([cache, idx, rows], {})[0]
    if not torch.equal(cache_rows.triton_scatter_rows(cache, idx, rows), want):
        raise AssertionError("scatter differs from the reference")
    row.check = "exact"
    row.ms = bench_device(lambda: cache_rows.triton_scatter_rows(cache, idx, rows), quick)
    row.eager_ms = bench_device(lambda: cg.scatter_rows(cache, idx, rows), quick)


def decode_small_cases():
    """Rows named "decode small ..." at T = DECODE_T (layer 2: ratio 2, 2080 index keys at 4096 cached tokens;
    layer 20: ratio 1, 4160)."""
    out = []
    for N, what in ((512, "wkv"), (32, "wproj")):  # the compressor's wkv / wgate; the indexer's weights_proj
        out.append((f"decode small linear_bf16 {what}", f"{DECODE_T}x{N}x{HIDDEN}",
                    lambda r, q, d, N=N: case_linear_bf16(r, DECODE_T, N, HIDDEN, q, d)))  # fmt: skip
    for name, (N, K) in DECODE_DENSE.items():
        out.append((f"decode small linear_fp8 swab {name}", f"{DECODE_T}x{N}x{K}",
                    lambda r, q, d, N=N, K=K: case_dense_swab(r, DECODE_T, N, K, q, d)))  # fmt: skip
    for N, D in ((4160, 512), (4160, 128), (128, 512)):  # layer 20's compressed KV / index keys; the SWA ring
        out.append(("decode small scatter_rows", f"{N}x{D} +{DECODE_T}",
                    lambda r, q, d, N=N, D=D: case_scatter_rows(r, N, D, DECODE_T, q, d)))  # fmt: skip
    out.append(("decode small dequant_fp8", f"{DECODE_T}x8x4096 g128", lambda r, q, d: case_dequant(r, DECODE_T, q,
                                                                                                      d)))  # fmt: skip
    out.append(("decode small hc_post_pre (post+split, f32 io)", f"{DECODE_T}x4x{HIDDEN}",
                lambda r, q, d: case_hc_post_pre_chain(r, DECODE_T, q, d)))  # fmt: skip
    for kind in ("rmsnorm", "rope"):
        run = functools.partial(case_f32_io, kind=kind, T_=DECODE_T)
        out.append((f"decode small {kind} f32 io", f"T{DECODE_T}", lambda r, q, d, run=run: run(r, quick=q, dry=d)))
    for pair in (True, False):
        out.append((f"decode small {'pair_' if pair else ''}compressor_keys", f"T{DECODE_T} d512 di128",
                    lambda r, q, d, pair=pair: case_compressor_keys_triton(r, DECODE_T, pair, q, d)))  # fmt: skip
    for C, ratio in ((2080, 2), (4160, 1)):
        for prec in ("tf32x3", "tf32"):
            out.append((f"decode small index_scores f32 {prec}", f"T{DECODE_T} C{C} r{ratio}",
                        lambda r, q, d, C=C, ratio=ratio, prec=prec: case_index_scores_f32(r, DECODE_T, C, ratio, q,
                                                                                            d, prec)))  # fmt: skip
        # 128 keys per CTA over 8 warps: the query tile's 3xTF32 split amortised over twice the keys (no spill)
        run = functools.partial(case_index_scores_f32, T_=DECODE_T, C=C, ratio=ratio, tile={"block_c": 128, "warps": 8})
        out.append(("decode small index_scores f32 tf32x3 c128w8", f"T{DECODE_T} C{C} r{ratio}",
                    lambda r, q, d, run=run: run(r, quick=q, dry=d)))  # fmt: skip
    # the same kernel at an 8192-token prefill chunk (layer 2: ratio 2, layer 20: ratio 1), against the op's
    # reference, which the prefill bucket runs today (26 ms a layer in bench_slice): --only "prefill index_scores"
    for C, ratio in ((4096, 2), (8192, 1)):
        for tile in ({}, {"block_c": 128, "warps": 8}):
            run = functools.partial(case_index_scores_f32, T_=8192, C=C, ratio=ratio, tile=tile)
            out.append((f"prefill index_scores f32 tf32x3{' c128w8' if tile else ''}", f"T8192 C{C} r{ratio}",
                        lambda r, q, d, run=run: run(r, quick=q, dry=d)))  # fmt: skip
    return out


def case_moe_layout(row: Row, T_: int, E: int, group: int, gather: bool, quick: bool, dry: bool, warps: int = 0):
    """The prefill MoE's contiguous layout at an EP8 rank (E=48 local experts) or one GPU (E=384), 128-row tiles:
    moe_routing's Triton launches (layout: counts + slots/tile_expert; gather: + x quantised per `group` into its K
    rows) against their torch references (the eager column; both timed as CUDA-graph replays, device time) -- equal
    bit for bit (the rows of the tiles that hold pairs). Bytes: idx + slots, and with the gather x (bf16) + the
    codes + their fp32 scales. The check column adds the kernels' time when issued eagerly from Python. warps: the
    gather's warps (0: moe_routing.GATHER_WARPS)."""
    from deepinfer.codegen.kernels import moe_routing as mr
    from deepinfer.runtime import kernel_adapters as ka

    k, d, bm = TOPK, HIDDEN, 128
    pairs = T_ * k
    row.bytes_ = float(pairs * 8 + (T_ * d * 2 + pairs * (d + 4 * d // group) if gather else 0))
    if dry:
        return
    gen = torch.Generator().manual_seed(E)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T_)]).int().cuda()
    x = (torch.randn(T_, d, device="cuda") * torch.logspace(-8, 8, d, base=2.0, device="cuda")).bfloat16()
    n_tiles = ka._tile_bucket(mr.layout_tile_bound(pairs, E, bm))
    rows = n_tiles * bm

    def run(layout, gather_quant):
        slot, tiles, counts, total = layout(idx, E, bm, n_tiles)
        return (slot, tiles, counts, total) + (gather_quant(x, slot, counts, group, rows, bm)[:2] if gather else ())

    gather_quant = functools.partial(mr.triton_gather_quant, num_warps=warps)
    got = run(mr.triton_contiguous_layout, gather_quant)
    want = run(mr.contiguous_layout_reference, mr.gather_quant_reference)
    real = int(want[3]) * bm
    same = all(torch.equal(g, w) for g, w in zip(got[:4], want[:4]))
    if gather:
        same = same and torch.equal(got[4][:real].view(torch.uint8), want[4][:real].view(torch.uint8))
        same = same and torch.equal(got[5][:, :real], want[5][:, :real])
    if not same:
        raise AssertionError("the Triton layout differs from its torch reference")
    fast = lambda: run(mr.triton_contiguous_layout, gather_quant)  # noqa: E731
    row.ms = bench_device(fast, quick)
    row.eager_ms = bench_device(lambda: run(mr.contiguous_layout_reference, mr.gather_quant_reference), quick)
    row.check = f"exact; issued eagerly {bench(fast, quick) * 1e3:.1f} us"


def moe_layout_cases():
    """Rows "moe_layout ...": the prefill MoE layout (+ x quant/gather) at T=8192, K=6, D=5120."""
    out = []
    # the gather's warps: 4 (~123 registers: 4 programs an SM), 8 (the default, ~115: 2), 16 (~60: 2) -- how many
    # tokens' loads an SM keeps in flight
    for E, group, gather, warps in ((48, 128, False, 0), (48, 128, True, 0), (48, 128, True, 4), (48, 128, True, 16),
                                    (48, 32, True, 0), (384, 128, False, 0), (384, 128, True, 0)):  # fmt: skip
        what = (f"layout + x quant/gather g{group}" if gather else "layout") + (f" w{warps}" if warps else "")
        out.append((f"moe_layout {what}", f"T8192 k{TOPK} E{E} D{HIDDEN}",
                    lambda r, q, d, E=E, g=group, ga=gather, w=warps: case_moe_layout(r, 8192, E, g, ga, q, d, w)))
    return out


# ---------------------------------------------------------------------------------------------- shared expert, prefill
# The MoE node's shared expert at an EP8 rank's prefill chunk (issue 8; session 6 call 4: 1.66 ms, its GEMMs 0.975):
# --only "shared_expert prefill". V4.1: D 5120, I 2304, FP8 32x32 blocks, x per 32, the SwiGLU output per 32.
SHARED_PREFILL_T = 8192


def _shared_expert_call(T_: int, meta: bool = False):
    """A moe_grouped_experts call carrying what the shared expert reads (x bf16, w1 / w3 [I, D], w2 [D, I] as e4m3
    codes with ue8m0 32x32 block scales; routed inputs None): random data on CUDA, or meta stand-ins (plans only)."""
    from deepinfer.ir.dtypes import float_to_e8m0
    from deepinfer.runtime import kernel_adapters as ka

    def weight(n, k):
        if meta:
            return torch.empty(n, k, device="meta", dtype=torch.float8_e4m3fn), torch.empty(n // 32, k // 32,
                                                                                              device="meta")
        q = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
        return q, float_to_e8m0(2.0 ** torch.randint(-9, -6, (n // 32, k // 32), device="cuda").float())

    (w1, s1), (w3, s3), (w2, s2) = weight(MOE_INTER, HIDDEN), weight(MOE_INTER, HIDDEN), weight(HIDDEN, MOE_INTER)
    x = torch.empty(T_, HIDDEN, device="meta") if meta else torch.randn(T_, HIDDEN, device="cuda").bfloat16()
    attrs = {"shared_limit": SWIGLU_LIMIT, "shared_block": 32, "shared_mid_group": 32}
    names = ["x", "w", "idx", "sw1", "sw3", "sw2", "ss1", "ss3", "ss2"]
    return ka.Call("moe_grouped_experts", attrs, [x, None, None, w1, w3, w2, s1, s3, s2], names,
                   [False] * 3 + [True] * 6, {}, {})  # fmt: skip


def _shared_previous_plans(call):
    """The session-6 formulation's sub-calls and plans: (w1, w3, w2 linear_fp8 calls, gate/up plan, down plan)."""
    from deepinfer.runtime import kernel_adapters as ka

    x = call.args[0]

    def sub(wi, si):
        return ka.Call("linear_fp8", {"block": 32, "act_group": 0}, [x, call.args[wi], call.args[si]],
                       ["x", call.names[wi], call.names[si]], [False, True, True], {}, call.cache)  # fmt: skip

    c1, c3, c2 = sub(3, 6), sub(4, 7), sub(5, 8)
    h = torch.empty(x.shape[0], MOE_INTER, device="meta")
    return c1, c3, c2, ka._gemm_plan(c1, x, MOE_INTER, 32, 32, True), ka._gemm_plan(c2, h, HIDDEN, 32, 32, True)


def _shared_previous(call, kernels):
    """The shared expert as _shared_dense ran it before: x as fp32, the w1 and w3 GEMMs each quantising it, the
    torch SwiGLU in fp32, the w2 GEMM quantising h (session 6's 1.66 ms at T 8192)."""
    from deepinfer.ir.ops.moe import swiglu
    from deepinfer.runtime import kernel_adapters as ka

    c1, c3, c2, up, down = _shared_previous_plans(call)
    x = call.args[0].float()
    gate = ka.fp8_linear(c1, kernels[0], x, 1, 2, 32, 32, up)
    h = swiglu(gate, ka.fp8_linear(c3, kernels[0], x, 1, 2, 32, 32, up), SWIGLU_LIMIT)
    return ka.fp8_linear(c2, kernels[1], h, 1, 2, 32, 32, down)


def _shared_reference(call, act_group: int):
    """The node's shared-expert reference (ir/ops/fused.py: the SwiGLU Q/DQ'd per 32, then w2) with x unquantised
    (act_group 0: the node as built) or per act_group (the graph with activation quantisation on: the kernels'
    numbers up to rounding order)."""
    from deepinfer.ir.ops.fused import SwiGLUGateUp, _gemm_ref, _mid_quant_ref

    x, w1, w3, w2, s1, s3, s2 = call.args[0].float(), *call.args[3:9]
    h = SwiGLUGateUp.reference(x, w1, w3, s1, s3, limit=SWIGLU_LIMIT, block=32, act_group=act_group)
    return _gemm_ref(_mid_quant_ref(h, 32), w2, s2, 32, 0).float()


def case_shared_prefill(row: Row, T_: int, quick: bool, dry: bool):
    """The shared expert as MoEGroupedAdapter._shared_dense runs it at prefill (x quantised once, ONE fp8_gemm over
    [w1; w3], the fused SwiGLU + quant, the w2 fp8_gemm on its codes): device time of one call (a CUDA graph);
    "eager" = the session-6 formulation (_shared_previous), same run. Checked against the node's reference with x
    quantised per 32 (the graph with activation quantisation on) and against the previous formulation (the same
    codes; the stacked GEMM's tiles may round a bf16 output the other way, then an h code one e4m3 step); the
    reference on unquantised x (the format's own error, ~5% norm-wise on these random operands) is printed."""
    from deepinfer.runtime import kernel_adapters as ka

    adapter = ka.MoEGroupedAdapter()
    stub = _shared_expert_call(T_, meta=True)
    new_keys = adapter._shared_keys(stub)
    old_plans = _shared_previous_plans(stub)
    old_keys = [old_plans[3][0], old_plans[4][0]]
    kernels = {k: build(ka._factory(k)) for k in {*new_keys, *old_keys}}
    row.bytes_ = T_ * HIDDEN * 2 * 2 + 3 * MOE_INTER * HIDDEN  # x in, bf16 out, the three FP8 weights
    row.flops = 6 * T_ * HIDDEN * MOE_INTER
    if dry:
        return
    call = _shared_expert_call(T_)

    def new():  # a fresh Call per node execution, as the executor makes them: its memo (x's codes) starts empty
        fresh = ka.Call(call.op, call.attrs, call.args, call.names, call.is_param, call.config, call.cache)
        return adapter._shared(fresh, [kernels[k] for k in new_keys])

    old = lambda: _shared_previous(call, [kernels[k] for k in old_keys])  # noqa: E731
    got_new, got_old = new().float(), old().float()
    err_q, err_old = rel_err(got_new, _shared_reference(call, 32)), rel_err(got_new, got_old)
    ref_x = _shared_reference(call, 0)
    err_x = ((got_new - ref_x).norm() / ref_x.norm()).item()
    row.ms = bench_device(new, quick)
    row.eager_ms = bench_device(old, quick)
    # vs the reference on x per 32: bf16 gate/up outputs flip h codes by an e4m3 step (~2-3e-2 max on random data);
    # a wrong row, column or scale is O(1). vs x unquantised: the format's own error
    row.check = f"{expect(err_q, 6e-2)} (x unquantised: {err_x:.1e} norm), vs previous {expect(err_old, 2e-2)}"


def shared_prefill_cases():
    """`--only "shared_expert prefill"`: the new path (eager column: the previous one) at T 8192, and its GEMMs alone
    at the adapter's configs (fp8_gemm.sm90_config): [w1; w3] N 4608, w1 alone N 2304 (the previous), w2."""
    T_ = SHARED_PREFILL_T
    out = [("shared_expert prefill (x quant, [w1;w3], SwiGLU+quant, w2)", f"T{T_} D{HIDDEN} I{MOE_INTER} g32",
            lambda r, q, d: case_shared_prefill(r, T_, q, d))]  # fmt: skip
    # alt: sm90_config's g32 choice at N 1280 / 2304 (persistent 128x128, async wgmma overlap, CTA pairs), untried
    # at these N (4608, 5120: sm90_config takes 128x256 in 2 slices there)
    alt = fp8_gemm.Config(128, 128, 128, 5, 256, True, True, 1, persistent=True, cluster=2)
    gemms = [("[w1;w3]", 2 * MOE_INTER, HIDDEN), ("w1 (previous)", MOE_INTER, HIDDEN), ("w2", HIDDEN, MOE_INTER)]
    for what, n, k in gemms + [("[w1;w3] alt", 2 * MOE_INTER, HIDDEN), ("w2 alt", HIDDEN, MOE_INTER)]:
        cfg = alt if what.endswith("alt") else fp8_gemm.sm90_config(T_, n, 32)
        out.append((f"shared_expert prefill fp8_gemm {what} {cfg.tag}", f"{T_}x{n}x{k}",
                    lambda r, q, d, n=n, k=k, cfg=cfg: case_fp8_gemm(r, T_, n, k, 32, cfg, q, d, False)))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- batched compressor
# `--only "batched pair_compressor_keys"`: batched decode's ratio-2 compressor + index keys (B sequences, one token
# each, each its own pending row and position) on pair_compressor.triton_batched_pair_keys (one launch) against the
# op's torch reference (eager column: ~25 launches; 1.206 ms of executor time at B 16 in session 7). V4.1: d 512,
# di 128, RoPE 64; positions around 4k, half of them closing a pair. Device time, CUDA graph.


def case_batched_pair_keys(row: Row, B: int, quick: bool, dry: bool, cfg=None):
    """Check: entry / keys within 1e-5 of the reference (fp32 both), entry_idx and the new states exactly."""
    from deepinfer.codegen.kernels import pair_compressor, rope
    from deepinfer.ir.ops.attention import rope_inv_freq
    from deepinfer.ir.registry import get_op

    d, di, r = 512, IDX_DIM, 64
    row.bytes_, row.flops = pair_compressor.roofline(B, d, di, r)
    if dry:
        return
    ra = {"rope_dim": r, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 65536, "beta_fast": 32.0,
          "beta_slow": 1.0}  # fmt: skip
    table = rope.cos_sin_table(8192, rope_inv_freq(*ra.values())).cuda()
    kv, score, skv, ssc = (torch.randn(B, d, device="cuda") for _ in range(4))
    norm, k_norm = torch.rand(d, device="cuda").bfloat16() + 0.5, torch.rand(di, device="cuda").bfloat16() + 0.5
    wk = (torch.randn(di, d, device="cuda") / d**0.5).bfloat16()
    pos = 4095 + torch.arange(B, device="cuda") % 7
    args = [kv, score, skv, ssc, pos, norm, wk, k_norm]

    def run():
        return pair_compressor.triton_batched_pair_keys(*args, table, eps=1e-6, rope_dim=r, cfg=cfg)

    got, ref = run(), get_op("batched_pair_compressor_keys").run(args, {"eps": 1e-6, **ra})
    if any(not torch.equal(a, b) for a, b in zip(got[2:], ref[2:])):
        raise AssertionError("entry_idx / the new states differ from the reference")
    row.check = expect(max(rel_err(a, b) for a, b in zip(got[:2], ref[:2])), 1e-5)
    row.ms = bench_device(run, quick)
    row.eager_ms = bench_device(lambda: get_op("batched_pair_compressor_keys").run(args, {"eps": 1e-6, **ra}), quick)


def batched_pair_keys_cases():
    from deepinfer.codegen.kernels import pair_compressor

    out = []
    for B in (16, 64, 256):
        out.append(("batched pair_compressor_keys", f"B{B} d512 di128",
                    lambda r, q, d, B=B: case_batched_pair_keys(r, B, q, d)))  # fmt: skip
    wide = pair_compressor.Config(out_block=32, warps=8)  # half the keys-product steps, twice the threads
    out.append(("batched pair_compressor_keys ob32w8", "B64 d512 di128",
                lambda r, q, d: case_batched_pair_keys(r, 64, q, d, wide)))  # fmt: skip
    return out


ATTN_POOL = 1 << 18  # KV pool rows the decode attention cases gather from (256K)
ATTN_BATCHES = (128, 64, 256, 16, 1)  # the issue's shapes first: a failure further down costs less
_ATTN_PREBUILT = [False]


def _attn_prebuild(quick: bool) -> None:
    """Build every sparse-attention case of the table in parallel processes (once; not in the GPU tests):
    `--only sparse_attn` skips main()'s -j prebuild, and the sweep has ~20 kernels. Workers: the CPU count
    (at most 16), DEEPINFER_BENCH_ATTN_JOBS to override (0: off)."""
    import multiprocessing as mp

    _ATTN_PREBUILT[0] = True
    jobs = int(os.environ.get("DEEPINFER_BENCH_ATTN_JOBS", min(16, os.cpu_count() or 1)))
    todo = [(False, quick, i) for i, (name, _, _) in enumerate(cases(quick)) if name.startswith("sparse_attn")]
    if CHECK_ONLY or jobs <= 1 or len(todo) <= 1:
        return
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(jobs, len(todo))) as pool:
        errs = [e for e in pool.map(_prebuild, todo) if e]
    print(f"pre-built {len(todo)} sparse-attention cases in {time.time() - t0:.0f} s; {len(errs)} failed", flush=True)


def _attn_kernel(B: int, topk: int, cfg, fp8: bool, dry: bool, n_win: int = 0, wide_combine: bool = False):
    """Build one sparse-attention variant: launch(q, kv, idx, sink, out), kv the KV arguments in signature order
    (the bf16 pool, (codes, exps), two pools: (KVw, KVc) / (KVw, KVsw, KVc, KVsc)), idx Idx or (IdxW, IdxC)."""
    sad = sparse_attn_decode
    pools = dict(n_win=n_win, S_cmp=ATTN_POOL - ATTN_WIN_POOL) if n_win else {}
    S = ATTN_WIN_POOL if n_win else ATTN_POOL
    if cfg.num_split > 1:
        progs = sad.split_programs(B, HEADS, HEAD_DIM, S, topk, target="sm90", cfg=cfg, kv_fp8=fp8, **pools)
        if wide_combine:  # the candidate combine (same signature)
            progs = (progs[0], sad.combine_program_wide(B, HEADS, HEAD_DIM, cfg.num_split, target="sm90",
                                                        **sad.combine_kwargs(cfg, HEADS, HEAD_DIM)))  # fmt: skip
        part, comb = (build(f) for f in progs)
        ns = cfg.num_split
        scratch = None if dry else (
            torch.empty(B, ns, HEADS, HEAD_DIM, device="cuda", dtype=sad.partial_dtype(cfg, HEADS, HEAD_DIM)),
            torch.empty(B, ns, HEADS, device="cuda"),
            torch.empty(B, ns, HEADS, device="cuda"),
        )  # fmt: skip

        def launch(q, kv, idx, sink, out):
            sad.run_split((part, comb), q, kv, idx, sink, out, ns, scratch)

        def launch_part(q, kv, idx, sink, out):  # diagnostics: the first kernel alone
            part(q, *(kv if isinstance(kv, tuple) else (kv,)), *(idx if isinstance(idx, tuple) else (idx,)), *scratch)

        def launch_combine(q, kv, idx, sink, out):  # diagnostics: the combine alone
            comb(*scratch, sink, out)

        launch.pieces = {"part": launch_part, "combine": launch_combine}
        return launch
    k = build(sad.program(B, HEADS, HEAD_DIM, S, topk, target="sm90", cfg=cfg, kv_fp8=fp8, **pools))

    def launch(q, kv, idx, sink, out):
        k(q, *(kv if isinstance(kv, tuple) else (kv,)), *(idx if isinstance(idx, tuple) else (idx,)), sink, out)

    return launch


ATTN_WIN_POOL = 1 << 15  # two-pool rows: the first 32K rows of the pool are the window pool, the rest compressed


def _attn_two_pool_args(kv_in, idx, n_win: int):
    """The two-pool arguments over the same memory: the pool split at ATTN_WIN_POOL (views), IdxW = idx's first
    n_win columns (drawn below ATTN_WIN_POOL), IdxC = the rest, rebased to the compressed pool (drawn above)."""
    W = ATTN_WIN_POOL
    kvs = kv_in if isinstance(kv_in, tuple) else (kv_in,)
    kv2 = tuple(t[:W] for t in kvs) + tuple(t[W:] for t in kvs)
    idx_c = idx[:, n_win:]
    return kv2, (idx[:, :n_win].contiguous(), torch.where(idx_c < 0, -1, idx_c - W).contiguous())


def case_attn_decode(row: Row, B: int, topk: int, quick: bool, dry: bool, cfg=None, fp8: bool = False,
                     n_win: int = 0, hot_rows: int = 0, piece: str = "", contiguous: bool = False,
                     wide_combine: bool = False, flush: str = "zero"):  # fmt: skip
    """Decode: B requests, 64 heads x 512, `topk` entries each (128 window + selected) from a 256K-row pool.
    cfg None: sparse_attn_decode.sm90_config (the warp-specialised program, split-K when B is small).
    fp8: the FP8 KV cache (e4m3 + ue8m0 exponents per 32, MODEL_SPEC section 3): the roofline counts its
    528 bytes a row, the check is against the dequantised rows (exact in bf16).
    n_win: the two-pool form (the first n_win entries from a 32K-row window pool, the rest from the other
    224K rows), checked against the single-pool reference over the concatenated pools.
    hot_rows (diagnostic): entries drawn from the first hot_rows rows only (4096: 4 MB, L2-resident), so the
    time is the program's own bound without HBM latency; %limit is still against the HBM roofline.
    piece (diagnostic, split configs): after the check of the pair, time only "part" (the first kernel) or
    "combine"; %limit is still against the whole operation's roofline.
    contiguous (diagnostic): each request's entries are consecutive pool rows from a random start (HBM pages
    streamed in order) instead of random rows: the gather's DRAM-locality bound.
    wide_combine (split configs): the pair runs with combine_program_wide instead of combine_program.
    flush "read" (timing method): L2 emptied by reading 256 MB before each run instead of do_bench's zeroing,
    so the kernel does not also write back ~50 MB of dirty L2 lines (`_bench_read_flush`)."""
    sad = sparse_attn_decode
    if not dry and not _ATTN_PREBUILT[0]:  # (the prebuild workers run dry: no nesting)
        _attn_prebuild(quick)
    cfg = cfg or sad.sm90_config(B, topk, fp8=fp8)
    kernel = _attn_kernel(B, topk, cfg, fp8, dry, n_win, wide_combine)
    row.bytes_, row.flops = sad.roofline(B, HEADS, HEAD_DIM, topk, kv_fp8=fp8)
    row.peak = "bf16"
    if dry:
        return
    q = torch.randn(B, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(ATTN_POOL, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, hot_rows or ATTN_POOL, (B, topk), device="cuda", dtype=torch.int32)
    if contiguous:
        start = torch.randint(0, ATTN_POOL - topk, (B, 1), device="cuda", dtype=torch.int32)
        idx = start + torch.arange(topk, device="cuda", dtype=torch.int32)
    if n_win:  # window entries in the window pool, the others above it
        idx[:, :n_win] %= ATTN_WIN_POOL
        idx[:, n_win:] = ATTN_WIN_POOL + idx[:, n_win:] % (ATTN_POOL - ATTN_WIN_POOL)
        idx[0, n_win - 3 : n_win] = -1  # request 0: a partly filled window
    idx[:, -7:] = -1  # a few invalid slots, as a partly filled selection has
    if B > 1:
        idx[0, topk // 2 :] = -1  # request 0: half its selection unfilled (whole split chunks of -1)
    sink = torch.randn(HEADS, device="cuda")
    out = torch.empty_like(q)
    if fp8:
        codes, exps = sad.quant_kv_fp8(kv)
        del kv
        kv_in = (codes, exps)

        def eager():  # gather the rows, dequantise them, attend
            sel = idx.clamp_min(0).long().flatten()
            rows = sad.dequant_kv_fp8(codes[sel], exps[sel])
            local = torch.arange(B * topk, device="cuda", dtype=torch.int32).view(B, topk)
            return sad.reference(q, rows, torch.where(idx < 0, -1, local), sink)
    else:
        kv_in = kv

        def eager():
            return sad.reference(q, kv, idx, sink)

    idx_in = idx
    if n_win:
        kv_in, idx_in = _attn_two_pool_args(kv_in, idx, n_win)
    kernel(q, kv_in, idx_in, sink, out)
    timer = _bench_read_flush if flush == "read" else bench
    if cfg.skipped:  # a diagnostic build (Config.skip): its output is wrong by design
        row.check = f"none (diagnostic: {'+'.join(cfg.skipped)} left out)"
        row.ms = timer(lambda: kernel(q, kv_in, idx_in, sink, out), quick)
        return
    row.check = expect(rel_err(out, eager()), 2e-2)
    if flush == "read":
        row.ms = timer(lambda: kernel(q, kv_in, idx_in, sink, out), quick)
        return
    if piece:
        row.ms = bench(lambda: kernel.pieces[piece](q, kv_in, idx_in, sink, out), quick)
        return
    row.ms = bench(lambda: kernel(q, kv_in, idx_in, sink, out), quick)
    row.eager_ms = bench(eager, quick)


def _bench_read_flush(fn, quick: bool) -> float:
    """Median ms of fn after an L2 flush that only reads (a 256 MB sum): do_bench's flush zeroes 256 MB, which
    leaves the L2 full of dirty lines that the timed kernel then writes back as it misses."""
    if CHECK_ONLY:
        return float("nan")
    buf = torch.zeros(64 << 20, device="cuda")
    n = 30 if quick else 100
    for _ in range(5):
        buf.sum()
        fn()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in marks:
        buf.sum()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in marks)[n // 2]


def attn_cases(quick: bool):
    """Sparse-attention rows: at each batch the default (sm90_config: the ws program), its FP8-KV twin and
    the previous default (portable program, split-K); not quick: the ws alternatives at B 64 and 128 and
    `attn_sweep_cases`."""
    sad = sparse_attn_decode
    out = []

    def add(name, B, cfg=None, fp8=False):
        shape = f"B{B} H64 k640"
        out.append((name, shape, lambda r, q, d, B=B, cfg=cfg, fp8=fp8: case_attn_decode(r, B, 640, q, d, cfg, fp8)))

    for B in ATTN_BATCHES if not quick else (128, 64):
        add(f"sparse_attn_decode {sad.sm90_config(B, 640).tag}", B)
        add(f"sparse_attn_decode fp8 {sad.sm90_config(B, 640, fp8=True).tag}", B, fp8=True)
        if not quick:
            old = sad.portable_split_config(B, 640)
            add(f"sparse_attn_decode {old.tag} (old)", B, old)
    if not quick:
        for B in (64, 128):
            base, fbase = sad.sm90_config(B, 640), sad.sm90_config(B, 640, fp8=True)
            alts = [(c, False) for c in sad.ws_configs(640, base.num_split)]
            alts += [(c, True) for c in sad.ws_configs(640, fbase.num_split, fp8=True)]
            alts.append((sad.Config(32, 384, fbase.num_split, 2, True), False))  # the FP8 blocking on bf16 KV
            alts.append((sad.ws_configs(640, 2 if base.num_split == 1 else 1)[0], False))  # the split trade-off
            for cfg, fp8 in alts:
                if (cfg, fp8) in ((base, False), (fbase, True)) or (cfg.lookahead and cfg.stages == 4):
                    continue  # (the 32-row 4-stage lookahead spills 1.1 KB and takes a minute to lower)
                add(f"sparse_attn_decode {'fp8 ' if fp8 else ''}{cfg.tag} (sweep)", B, cfg, fp8)
    return out + ([] if quick else attn_sweep_cases() + attn_diag_cases() + attn_r2_cases() + attn_final_cases()
                                     + attn_realnode_cases() + attn_prefill_cases() + attn_persist_cases()
                                     + attn_fixedcost_cases() + attn_prefill_compiled_cases() + attn_partial16_cases()
                                     + [("sparse_attn qoperand (triton)", f"T{t} H64 D512", lambda r, q, d, t=t:
                                         case_attn_q_operand(r, t, q, d)) for t in (64, 8192)]
                                     + [("sparse_attn oepilogue (triton)", f"T{t} H64 D512 g32", lambda r, q, d, t=t:
                                         case_attn_o_epilogue(r, t, q, d)) for t in (64, 8192)])  # fmt: skip


def attn_sweep_cases():
    """`--only "sparse_attn sweep"`: the default next to its two-pool form (window + compressed pools,
    n_win = 128) and the L2-hot diagnostic (entries from 4096 rows: the program's bound without HBM latency).
    The variants measured slower than the default everywhere on the H200 (split-D, in-kernel merge, row ids
    in shared memory, FP8 with 3-4 staging slots) were removed; their numbers are in BENCHMARKS.md."""
    sad = sparse_attn_decode
    out = []

    def add(what, B, cfg, **kw):
        name = f"sparse_attn sweep {cfg.tag}{' ' + what if what else ''}"
        out.append((name, f"B{B} H64 k640", lambda r, q, d, B=B, cfg=cfg, kw=kw: case_attn_decode(
            r, B, 640, q, d, cfg, **kw)))  # fmt: skip

    for B in (128, 64):
        base = sad.sm90_config(B, 640)
        add("", B, base)
        add("two-pool", B, base, n_win=128)
        add("fp8 two-pool", B, sad.sm90_config(B, 640, fp8=True), fp8=True, n_win=128)
        if B == 128:
            add("L2-hot", B, base, hot_rows=4096)
    return out


ATTN_DIAG_SKIPS = ("gather", "qk", "pv", "softmax", "qk,pv", "gather,qk,pv", "gather,qk,softmax,pv",
                   "gather,ids", "gather,ids,qk,pv", "gather,ids,qk,softmax,pv")  # ids: no global load arms the ring


def attn_diag_cases():
    """`--only "sparse_attn diag"`: the default ws program with parts left out of the build (Config.skip: the
    KV gather, the row-id copies, the QK^T or PV wgmmas, the softmax math), unchecked, next to the full
    program, at B128 (no split) and B64 (split 2, its two kernels also timed apart); the gather-only build
    (no QK^T / PV) with random, contiguous and L2-hot rows: which part bounds the CTA's time."""
    import dataclasses

    sad = sparse_attn_decode
    out = []

    def add(what, B, cfg, **kw):
        out.append((f"sparse_attn diag {cfg.tag}{' ' + what if what else ''}", f"B{B} H64 k640",
                    lambda r, q, d, B=B, cfg=cfg, kw=kw: case_attn_decode(r, B, 640, q, d, cfg, **kw)))  # fmt: skip

    for B in (128, 64):
        base = sad.sm90_config(B, 640)
        add("", B, base)
        if B == 128:
            add("L2-hot", B, base, hot_rows=4096)
            add("contiguous rows", B, base, contiguous=True)
        for parts in ATTN_DIAG_SKIPS if B == 128 else ("gather",):
            add("", B, dataclasses.replace(base, skip=parts))
        if B == 128:
            gather_only = dataclasses.replace(base, skip="qk,pv")
            add("contiguous rows", B, gather_only, contiguous=True)
            add("L2-hot", B, gather_only, hot_rows=4096)
        if base.num_split > 1:
            add("first kernel only", B, base, piece="part")
            add("combine only", B, base, piece="combine")
    return out


def attn_r2_cases():
    """`--only "sparse_attn r2"` (session 5, round 2, <= 2.5 min). Round 1 showed the gather alone streaming at 87%
    of HBM after a read-only L2 flush while the full program sits 11 us above it: the 2-stage ring issues block j
    only when PV(j - 2) is done, so each block waits out its loaded HBM latency. Config.l2_prefetch=d ("pf<d>")
    has each refill of block j also bulk-prefetch block j + d into L2. Rows: the default and pf1/pf2/pf3 at B128
    (also after a read-only flush), the 32-row 4-stage ring with pf1/pf2, two pools, B64 (split 2, now with the
    wide combine) and B256; every full program checked against the reference. Also the CTA's own pipeline with
    no global load after a read-only flush -- whole, without the MMAs, PV only, QK^T only: the floor the overlap
    can reach and which side of it bounds the pipeline. And B16 / B8, where sm90_config's split count launches
    160 CTAs (two waves), next to one-wave split counts (80 CTAs)."""
    import dataclasses

    sad = sparse_attn_decode
    out = []

    def add(what, B, cfg, **kw):
        out.append((f"sparse_attn r2 {cfg.tag}{' ' + what if what else ''}", f"B{B} H64 k640",
                    lambda r, q, d, B=B, cfg=cfg, kw=kw: case_attn_decode(r, B, 640, q, d, cfg, **kw)))  # fmt: skip

    pf = functools.partial(dataclasses.replace, sad.sm90_config(128, 640))
    n32 = functools.partial(dataclasses.replace, sad.Config(32, sad.WS_THREADS, 1, 4, True))
    read = dict(flush="read")
    for what, B, cfg, kw in [
        ("", 128, pf(), {}), ("read-flush", 128, pf(), read),
        ("L2-hot read-flush", 128, pf(), dict(hot_rows=4096, **read)),  # what an L2 prefetch could reach at best
        ("", 128, pf(l2_prefetch=1), {}), ("read-flush", 128, pf(l2_prefetch=1), read),
        ("", 128, pf(l2_prefetch=2), {}), ("read-flush", 128, pf(l2_prefetch=2), read),
        ("", 128, pf(l2_prefetch=3), {}), ("", 128, n32(l2_prefetch=1), {}), ("", 128, n32(l2_prefetch=2), {}),
        ("two-pool", 128, pf(l2_prefetch=1), dict(n_win=128)),
        ("read-flush", 128, pf(skip="qk,pv", l2_prefetch=1), read),
        ("read-flush", 128, pf(skip="gather,ids"), read), ("read-flush", 128, pf(skip="gather,ids,qk,pv"), read),
        ("read-flush", 128, pf(skip="gather,ids,qk"), read), ("read-flush", 128, pf(skip="gather,ids,pv"), read),
    ] + [(w, B, dataclasses.replace(sad.sm90_config(B, 640), l2_prefetch=d, persist=0), {}) for B in (64, 256)
         for w, d in (("", 0), ("", 1), ("", 2))] + [
        # small batches: the default's split count gives 160 CTAs (two waves at one CTA an SM) at B8 / B16
        ("", 16, sad.sm90_config(16, 640), {}), ("one wave", 16, sad.Config(64, sad.WS_THREADS, 5, 2, True), {}),
        ("", 8, sad.sm90_config(8, 640), {}), ("one wave", 8, sad.Config(64, sad.WS_THREADS, 10, 2, True), {}),
    ]:  # fmt: skip
        add(what, B, cfg, **kw)
    return out


def attn_final_cases():
    """`--only "sparse_attn final"` (session 5, the last call: one line of <= 60 s): the subset of 'sparse_attn r2'
    that decides a default -- l2_prefetch 1 / 2 at B128 (also after a read-only flush) and pf1 at B256 / B64 next
    to the default, B64's new default pair (wide combine), and B16's two-wave default next to a one-wave split
    count. Baselines first, every row checked against the reference."""
    import dataclasses

    sad = sparse_attn_decode
    out = []

    def add(what, B, cfg, **kw):
        out.append((f"sparse_attn final {cfg.tag}{' ' + what if what else ''}", f"B{B} H64 k640",
                    lambda r, q, d, B=B, cfg=cfg, kw=kw: case_attn_decode(r, B, 640, q, d, cfg, **kw)))  # fmt: skip

    def cfg(B, d=0):  # (the single pass these rows measured: B256 now defaults to the persistent grid)
        return dataclasses.replace(sad.sm90_config(B, 640), l2_prefetch=d, persist=0)

    read = dict(flush="read")
    for what, B, c, kw in [
        ("", 128, cfg(128), {}), ("", 128, cfg(128, 1), {}), ("", 128, cfg(128, 2), {}),
        ("read-flush", 128, cfg(128), read), ("read-flush", 128, cfg(128, 1), read),
        ("", 256, cfg(256), {}), ("", 256, cfg(256, 1), {}), ("", 64, cfg(64), {}), ("", 64, cfg(64, 1), {}),
        ("", 16, cfg(16), {}), ("one wave", 16, sad.Config(64, sad.WS_THREADS, 5, 2, True), {}),
    ]:  # fmt: skip
        add(what, B, c, **kw)
    return out


def case_attn_realnode(row: Row, B: int, logit_std: float, quick: bool, dry: bool):
    """Precision probe (session 5; the slice's real attention node reads max rel err 9.1e-2 vs ~3e-3 here on unit
    logits): f32 q / KV / sink with q and the sink scaled so the logits' std is `logit_std`, the kernel run on their
    bf16 roundings (what the runtime adapter passes), its output compared with the f32-operand reference AND with
    the reference on the same bf16-rounded operands. The first growing with the logit scale while the second stays
    ~1e-3 means the error is the bf16 operands' (softmax amplifies a logit's rounding by its size), not the kernel.
    Timed quickly only so that the table prints the check."""
    sad = sparse_attn_decode
    cfg = sad.sm90_config(B, 640)
    kernel = _attn_kernel(B, 640, cfg, False, dry)
    row.bytes_, row.flops = sad.roofline(B, HEADS, HEAD_DIM, 640)
    row.peak = "bf16"
    if dry:
        return
    gen = torch.Generator(device="cuda").manual_seed(5)
    q32 = torch.randn(B, HEADS, HEAD_DIM, device="cuda", generator=gen) * logit_std  # q.k / sqrt(D) ~ N(0, std^2)
    kv32 = torch.randn(ATTN_POOL, HEAD_DIM, device="cuda", generator=gen)
    idx = torch.randint(0, ATTN_POOL, (B, 640), device="cuda", dtype=torch.int32, generator=gen)
    idx[:, -7:] = -1
    sink = torch.randn(HEADS, device="cuda", generator=gen) * logit_std
    qb, kvb = q32.to(torch.bfloat16), kv32.to(torch.bfloat16)
    out = torch.empty_like(qb)
    kernel(qb, kvb, idx, sink, out)
    e32 = rel_err(out, sad.reference(q32, kv32, idx, sink))
    e16 = rel_err(out, sad.reference(qb.float(), kvb.float(), idx, sink))
    row.check = f"vs f32 operands {e32:.2e} | vs its bf16 operands {e16:.2e} ({cfg.tag}, logit std {logit_std:g})"
    row.ms = bench(lambda: kernel(qb, kvb, idx, sink, out), True)  # (the table prints the check with a time)


def attn_realnode_cases():
    """`--only "sparse_attn realnode"`: case_attn_realnode at the decode-64 config, logit std 1 / 8 / 32."""
    return [(f"sparse_attn realnode std{s:g}", "B64 H64 k640",
             lambda r, q, d, s=s: case_attn_realnode(r, 64, s, q, d)) for s in (1.0, 8.0, 32.0)]  # fmt: skip


def _prefill_attn_inputs(T_: int, topk: int, n_win: int, start: int, ratio: int):
    """A T-token prefill chunk's attention operands at positions start .. start + T - 1, built as the V4.1 graph
    builds them: the window pool = [SWA ring (n_win rows); this chunk's own KV rows] (concat: the chunk's rows
    exist before the attention reads them), win_idx = window_indices (causal inside the chunk, -1 before position
    0); the compressed pool = the (start + T) // ratio entries emitted so far, cmp_idx = each token's top-(topk -
    n_win) of random scores among the entries it may see (w < (p + 1) // ratio), -1 where fewer are visible."""
    from deepinfer.ir.ops.attention import WindowIndices

    pos = torch.arange(start, start + T_, device="cuda")
    win_idx = WindowIndices.reference(pos, window=n_win).to(torch.int32).contiguous()
    C = (start + T_) // ratio
    visible = torch.arange(C, device="cuda") < ((pos + 1) // ratio).unsqueeze(-1)
    scores = torch.rand(T_, C, device="cuda").masked_fill(~visible, -1.0)
    top = scores.topk(min(topk - n_win, C), dim=-1)
    cmp_idx = torch.full((T_, topk - n_win), -1, device="cuda", dtype=torch.int32)
    cmp_idx[:, : top.indices.shape[1]] = torch.where(top.values >= 0, top.indices, -1).to(torch.int32)
    q = torch.randn(T_, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    win_kv = torch.randn(n_win + T_, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cmp_kv = torch.randn(C, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return q, win_kv, win_idx, cmp_kv, cmp_idx, torch.randn(HEADS, device="cuda")


def case_attn_prefill_compiled(row: Row, T_: int, topk: int, quick: bool, dry: bool):
    """The second baseline of a prefill row: torch.compile (inductor, dynamic=False) of the op's reference on the same
    inputs, checked against eager; the row's time is the compiled reference (no kernel: %limit against the same
    matrix bound)."""
    from deepinfer.ir.ops.attention import SparseAttention

    n_win, C = 128, T_ // 2
    bounds = sparse_attn_decode.prefill_roofline(T_, HEADS, HEAD_DIM, topk, n_win + T_ + C)
    row.bytes_, row.flops, row.peak = bounds["hbm"], bounds["flops"], "bf16"
    if dry:
        return
    args = _prefill_attn_inputs(T_, topk, n_win, 0, 2)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = args

    def ref(q, sink, win_kv, win_idx, cmp_kv, cmp_idx):
        return SparseAttention.reference(q, sink, win_kv, win_idx, cmp_kv, cmp_idx, scale=HEAD_DIM**-0.5)

    compiled = torch.compile(ref, dynamic=False)
    t0 = time.time()
    got = compiled(q, sink, win_kv, win_idx, cmp_kv, cmp_idx)
    row.check = f"{expect(rel_err(got, ref(q, sink, win_kv, win_idx, cmp_kv, cmp_idx)), 2e-2)} vs eager " \
                f"(compiled in {time.time() - t0:.0f} s)"  # fmt: skip
    row.ms = bench(lambda: compiled(q, sink, win_kv, win_idx, cmp_kv, cmp_idx), True)


def case_attn_prefill(row: Row, T_: int, topk: int, quick: bool, dry: bool, cfg=None, start: int = 0,
                      ratio: int = 2, eager: bool = True):  # fmt: skip
    """Prefill: one chunk of T tokens, 64 heads x 512, each token's own 128 window entries + topk - 128 selected
    compressed entries (_prefill_attn_inputs), through sparse_attn_decode's program at B = T with the two pools
    (cfg None: prefill_config), checked against the graph op's torch reference (SparseAttention.reference, f32)
    and timed next to it (eager). Roofline: the matrix term (4 T H topk D flops at the BF16 peak) is the bound that
    applies; the row's check column also prints the HBM bytes (q, o, indices, every pool row once) and the bytes
    the queries gather (mostly from L2)."""
    from deepinfer.ir.ops.attention import SparseAttention

    sad = sparse_attn_decode
    n_win = 128
    cfg = cfg or sad.prefill_config(T_, topk)
    C = (start + T_) // ratio
    kernel = build(sad.program(T_, HEADS, HEAD_DIM, n_win + T_, topk, target="sm90", cfg=cfg, n_win=n_win, S_cmp=C))
    bounds = sad.prefill_roofline(T_, HEADS, HEAD_DIM, topk, n_win + T_ + C)
    row.bytes_, row.flops, row.peak = bounds["hbm"], bounds["flops"], "bf16"
    if dry:
        return
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _prefill_attn_inputs(T_, topk, n_win, start, ratio)
    out = torch.empty_like(q)

    def run():
        if cfg.persist:
            kernel(q, win_kv, cmp_kv, win_idx, cmp_idx, sink, out)
            return
        for lo in range(0, T_, sad.MAX_LAUNCH_ROWS):  # gridDim.y <= 65535
            hi = min(T_, lo + sad.MAX_LAUNCH_ROWS)
            kernel(q[lo:hi], win_kv, cmp_kv, win_idx[lo:hi], cmp_idx[lo:hi], sink, out[lo:hi])

    def ref():
        return SparseAttention.reference(q, sink, win_kv, win_idx, cmp_kv, cmp_idx, scale=HEAD_DIM**-0.5)

    run()
    err = rel_err(out, ref())
    row.check = (f"{expect(err, 2e-2)} ({cfg.tag}; HBM {bounds['hbm'] / 1e9:.2f} GB, gathers "
                 f"{bounds['gathers'] / 1e9:.1f} GB, {bounds['flops'] / 1e12:.2f} TFLOP)")  # fmt: skip
    torch.cuda.empty_cache()
    row.ms = bench(run, quick)
    if eager:
        row.eager_ms = bench(ref, True)


def attn_prefill_cases():
    """`--only "sparse_attn prefill"`: prefill chunks of 4096 / 8192 tokens (fresh prompt, V4.1 ratio-2 layer,
    top-k 512 -> 640 entries; 8192 also with top-k 1024 -> 1152 entries, and a second chunk at position 8192 on a
    ratio-1 layer), the one-CTA-per-token program (prefill_config) next to the persistent grid (Config.persist,
    132 CTAs) and the torch reference. `--only "sparse_attn prefill wsn"`: the one-CTA-per-token rows only,
    `--only "sparse_attn prefill persist"`: the persistent ones only."""
    sad = sparse_attn_decode
    out = []
    for T_, topk, start, ratio in ((4096, 640, 0, 2), (8192, 640, 0, 2), (8192, 1152, 0, 2), (4096, 640, 8192, 1)):
        shape = f"T{T_} H64 k{topk}" + (f" @{start} r{ratio}" if start else "")
        base, persist = sad.prefill_config(T_, topk, persist=False), sad.prefill_config(T_, topk, persist=True)
        lookahead = dataclasses.replace(persist, lookahead=True)  # compute-bound: QK^T(i + 1) under softmax(i)
        for cfg in (base, persist, lookahead):
            out.append((f"sparse_attn prefill {'persist ' if cfg.persist else ''}{cfg.tag}", shape,
                        lambda r, q, d, T_=T_, k=topk, c=cfg, s=start, rt=ratio, e=cfg is base: case_attn_prefill(
                            r, T_, k, q, d, c, s, rt, e)))  # fmt: skip
    return out


def attn_prefill_compiled_cases():
    """`--only "sparse_attn torchcompile"`: torch.compile of the op's reference at the prefill rows' main shapes."""
    return [("sparse_attn torchcompile prefill ref", f"T{T_} H64 k640",
             lambda r, q, d, T_=T_: case_attn_prefill_compiled(r, T_, 640, q, d)) for T_ in (4096, 8192)]  # fmt: skip


def _rope_off(got, q, pos, ra) -> int:
    """How many of got's rotated (last 64) channels miss the float64 rotation of q's fp32 values at the op's fp32
    angles by more than one bf16 step of the value plus 2e-6 (|e| + |o|): the bf16 rounding of the result plus the
    fp32 cos / sin / product errors, which near a cancellation (e cos ~ o sin) exceed a step of the small result."""
    from deepinfer.ir.ops.attention import rope_inv_freq

    freq = rope_inv_freq(*ra.values()).to(q.device)
    angle = (pos.float().unsqueeze(-1) * freq).double().unsqueeze(1)  # [T, 1, 32]: the op's fp32 angle
    x = q[..., -64:].double()
    e, o = x[..., 0::2], x[..., 1::2]
    exact = torch.stack([e * angle.cos() - o * angle.sin(), e * angle.sin() + o * angle.cos()], -1).flatten(-2)
    scale = (e.abs() + o.abs()).repeat_interleave(2, dim=-1)
    return int(((got[..., -64:].double() - exact).abs() > exact.abs() * 2.0**-8 + 2e-6 * scale).sum())


def case_attn_q_operand(row: Row, T_: int, quick: bool, dry: bool):
    """fused_attention's q prologue at V4.1 shapes (T x 64 heads x 512, RoPE on the last 64, YaRN): the adapter's one
    Triton launch (sparse_attn_decode.triton_q_operand) vs its torch formulation (the op's apply_rope on the rotated
    channels + copies into the bf16 operand), both timed as CUDA graphs; checked within one bf16 step."""
    from deepinfer.codegen.kernels import rope as rope_k
    from deepinfer.ir.ops.attention import apply_rope, rope_inv_freq

    sad = sparse_attn_decode
    ra = {"rope_dim": 64, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 65536, "beta_fast": 32.0,
          "beta_slow": 1.0}  # fmt: skip
    row.bytes_, row.flops = float(T_ * HEADS * HEAD_DIM * (4 + 2)), 0.0
    if dry:
        return
    q = torch.randn(T_, HEADS, HEAD_DIM, device="cuda")
    pos = torch.arange(4096, 4096 + T_, device="cuda")
    table = rope_k.cos_sin_table(16384, rope_inv_freq(*ra.values())).cuda()

    def fast():
        return sad.triton_q_operand(q, pos, table, 1.0, 64, T_)

    def slow():
        out = torch.empty(T_, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        out[..., :-64] = q[..., :-64]
        out[..., -64:] = apply_rope(q[..., -64:], pos, **ra)
        return out

    a, b = fast(), slow()
    bad_a, bad_b = _rope_off(a, q, pos, ra), _rope_off(b, q, pos, ra)
    if bad_a or not torch.equal(a[..., :-64], q[..., :-64].to(torch.bfloat16)):
        raise AssertionError(f"triton: {bad_a} rotated values off the float64 rotation by more than its bound "
                             f"(the torch formulation: {bad_b})")  # fmt: skip
    row.check = f"within the f64 bound (torch path: {bad_b} off); {int((a != b).sum())} of {a.numel()} differ by 1 step"
    row.ms = bench_device(fast, quick)
    row.eager_ms = bench_device(slow, quick)


def case_attn_o_epilogue(row: Row, T_: int, quick: bool, dry: bool):
    """fused_attention's output epilogue at V4.1 shapes (T x 64 x 512 bf16 o, inverse RoPE of the last 64 channels,
    8 out groups, FP8 per 32): the opt-in one Triton launch (sparse_attn_decode.triton_o_epilogue) vs the runtime's
    path (the rope kernel, then act_quant and the e8m0 bytes), both as CUDA graphs ('vs eager' = vs that path).
    Check: the dequantised outputs agree within one e4m3 step (the runtime path rounds the rotated values to bf16
    before quantising; the fused one quantises the fp32 rotation)."""
    from deepinfer.ir.ops.quant import dequant_fp8_groups
    from deepinfer.runtime import kernel_adapters as ka

    sad = sparse_attn_decode
    ra = {"rope_dim": 64, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 65536, "beta_fast": 32.0,
          "beta_slow": 1.0}  # fmt: skip
    row.bytes_, row.flops = float(T_ * HEADS * HEAD_DIM * (2 + 1) + T_ * HEADS * HEAD_DIM // 32), 0.0
    if dry:
        return
    attrs = {"q_norm": False, "eps": 1e-6, **ra, "scale": HEAD_DIM**-0.5, "out_groups": 8, "quant_group": 32}
    o = torch.randn(T_, HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    pos = torch.arange(4096, 4096 + T_, device="cuda")
    call = ka.Call("fused_attention", attrs, [torch.empty(T_, HEADS, HEAD_DIM, device="cuda"), pos], ["q", "p"],
                   [False] * 2, {}, {ka.MAX_POSITIONS: 16384})  # fmt: skip
    adapter = ka.SparseAttnAdapter()
    rc = adapter._o_rope(call, o)  # (the env switch is off here: the runtime's path)
    rope_kernel = ka.build_kernel(ka.ADAPTERS["rope"].keys(rc)[0])

    def current():
        return adapter._epilogue(call, ka.ADAPTERS["rope"].run(rc, [rope_kernel])[0], rotated=True)

    def fused():
        return adapter._o_epilogue_fused(call, o, sad)

    a, b = (dequant_fp8_groups(x[0], x[1], 32).float() for x in (fused(), current()))
    rel = ((a - b).abs() / b.abs().clamp_min(1e-30))[b.abs() > 1e-3 * b.abs().max()]
    if rel.numel() and rel.max().item() > 0.126:  # one e4m3 step is 2^-3 of the value at most
        raise AssertionError(f"fused epilogue off the runtime's by {rel.max().item():.3f} of a value")
    row.check = f"<= 1 e4m3 step ({int((a != b).sum())} of {a.numel()} codes differ)"
    row.ms = bench_device(fused, quick)
    row.eager_ms = bench_device(current, quick)


def attn_partial16_cases():
    """`--only "sparse_attn partial16"`: the split configs (B1 / B16 / B64, two pools as the runtime passes them) with
    the chunks' partial outputs in bf16 (Config.partial_bf16) next to fp32 partials (the default)."""
    sad = sparse_attn_decode
    out = []
    for B in (64, 16, 1):
        base = sad.sm90_config(B, 640)
        if base.num_split == 1:  # B64 runs unsplit since session 9: its former split 2
            base = sad.Config(64, sad.WS_THREADS, 2, 2, True)
        for cfg in (base, dataclasses.replace(base, partial_bf16=True)):
            out.append((f"sparse_attn partial16 {cfg.tag}", f"B{B} H64 k640",
                        lambda r, q, d, B=B, cfg=cfg: case_attn_decode(r, B, 640, q, d, cfg, n_win=128)))  # fmt: skip
    return out


def attn_fixedcost_cases():
    """`--only "sparse_attn fixedcost"` (diagnostic): the single-pass ws program at B128 (one CTA an SM, one wave) and
    the persistent grid at B256 (two requests a CTA) over top-k 128 / 256 .. 1152 (2 .. 18 blocks of 64): time = fixed +
    blocks x per-block, so a line through the rows splits a CTA's fixed cost (launch, Q, ring start-up, epilogue)
    from the block pipeline's -- what persistence amortises and what a faster block loop would buy."""
    sad = sparse_attn_decode
    out = []
    for B, cfg in ((128, sad.Config(64, 384, 1, 2, True)), (256, sad.Config(64, 384, 1, 2, True, persist=132))):
        for k in (128, 256, 384, 640, 1152)[1 if cfg.persist else 0 :]:  # persist: >= 2 whole ring rounds
            out.append((f"sparse_attn fixedcost {cfg.tag}", f"B{B} H64 k{k}",
                        lambda r, q, d, B=B, k=k, cfg=cfg: case_attn_decode(r, B, k, q, d, cfg)))  # fmt: skip
    return out


def attn_persist_cases():
    """`--only "sparse_attn persist"`: decode at B 128 / 256 (two pools, n_win 128), the default next to the
    persistent grid (132 CTAs; B256: two requests a CTA, the ring running on between them), without and with
    lookahead."""
    sad = sparse_attn_decode
    out = []
    for B in (256, 128):
        single = dataclasses.replace(sad.sm90_config(B, 640), persist=0)  # B256's default is now the persistent grid
        for cfg in (single, sad.Config(64, 384, 1, 2, True, persist=132),
                    sad.Config(64, 384, 1, 2, True, True, persist=132)):  # fmt: skip
            out.append((f"sparse_attn persist {cfg.tag}", f"B{B} H64 k640",
                        lambda r, q, d, B=B, cfg=cfg: case_attn_decode(r, B, 640, q, d, cfg, n_win=128)))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- sparse_attn s7
# `--only "sparse_attn s7"` (session 7, one device call): every decode variant at V4.1 decode shapes in one run,
# sorted per batch at the end. Rows append to S7_RESULTS; the summary row prints the table from it.

S7_BATCHES = (64, 128, 256)
S7_WIN = 128  # window entries (the SWA ring's 127 rows + this step's row); the other 512 are compressed rows
S7_RESULTS: list[dict] = []


def s7_operands(B: int, topk: int = 640):
    """The operands the runtime's adapter passes at a batched decode step with 4k cached tokens: the window pool is
    concat(B rings of 128 rows, B new rows) and request b reads 127 rows of its own ring (in ring order from a
    random slot) plus its new row; the compressed pool is the selected rows copied in entry order (the adapter's
    _selected_rows: 4k context holds 2048 / 4096 compressed rows a sequence, more than the 512 selected), so
    request b reads rows b * 512 .. b * 512 + 511. Returns (q, (win, cmp), (idx_w, idx_c), sink) and the
    single-pool form (kv, idx) the reference takes."""
    n_cmp = topk - S7_WIN
    q = torch.randn(B, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    win = torch.randn(B * S7_WIN + B, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cmp = torch.randn(B * n_cmp, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    b = torch.arange(B, device="cuda", dtype=torch.int32).view(B, 1)
    start = torch.randint(0, S7_WIN, (B, 1), device="cuda", dtype=torch.int32)
    ring = b * S7_WIN + (start + torch.arange(S7_WIN - 1, device="cuda", dtype=torch.int32)) % S7_WIN
    idx_w = torch.cat([ring, B * S7_WIN + b], dim=1).contiguous()
    idx_c = (b * n_cmp + torch.arange(n_cmp, device="cuda", dtype=torch.int32)).contiguous()
    sink = torch.randn(HEADS, device="cuda")
    kv_cat, idx_cat = torch.cat([win, cmp]), torch.cat([idx_w, idx_c + win.shape[0]], dim=1)
    return q, (win, cmp), (idx_w, idx_c), sink, kv_cat, idx_cat


def _s7_record(row: Row, B: int, what: str, read_ms: float = float("nan")) -> None:
    S7_RESULTS.append({"B": B, "row": row.kernel, "what": what, "ms": row.ms, "read_ms": read_ms,
                       "bytes": row.bytes_, "check": row.check})  # fmt: skip


def case_attn_s7(row: Row, B: int, cfg, quick: bool, dry: bool, make_kernel=None):
    """One decode variant on the runtime's operands (s7_operands), checked against the op's reference, timed with
    do_bench's flush (the protocol of every earlier attention row) and after a read-only flush (_bench_read_flush:
    no dirty L2 lines for the kernel's misses to write back). make_kernel(B, cfg, dry): another launcher (same
    call) than _attn_kernel's."""
    sad = sparse_attn_decode
    _ATTN_PREBUILT[0] = True  # main's -j prebuilds these rows; never the whole attention table
    kernel = (make_kernel or _s7_kernel)(B, cfg, dry)
    row.bytes_, row.flops = sad.roofline(B, HEADS, HEAD_DIM, 640)
    row.peak = "bf16"
    if dry:
        return
    q, kv, idx, sink, kv_cat, idx_cat = s7_operands(B)
    out = torch.empty_like(q)
    kernel(q, kv, idx, sink, out)
    row.check = expect(rel_err(out, sad.reference(q, kv_cat, idx_cat, sink)), 2e-2)
    row.ms = bench(lambda: kernel(q, kv, idx, sink, out), quick)
    _s7_record(row, B, "4k", _bench_read_flush(lambda: kernel(q, kv, idx, sink, out), quick))


def _attn_row_adder(out: list, group: str, case):
    """add(B, cfg, what=""): appends to out the row "{group} B{B} {cfg.tag}[ what]" on the runtime's 4k operands,
    run by case(row, B, cfg, quick, dry)."""

    def add(B, cfg, what=""):
        out.append((f"{group} B{B} {cfg.tag}{' ' + what if what else ''}", f"B{B} H64 k640 4k",
                    lambda r, q, d, B=B, cfg=cfg: case(r, B, cfg, q, d)))  # fmt: skip

    return add


def _s7_kernel(B: int, cfg, dry: bool):
    return _attn_kernel(B, 640, cfg, False, dry, n_win=S7_WIN)


def case_attn_s7_random(row: Row, B: int, topk: int, cfg, quick: bool, dry: bool, n_win: int, hot_rows: int = 0):
    """case_attn_decode's protocol (random rows of a 256K-row pool, a few -1 entries): the anchor to the earlier
    figures and the fixed-cost probe's rows; hot_rows: the entries drawn from that many rows (L2-resident)."""
    _ATTN_PREBUILT[0] = True
    case_attn_decode(row, B, topk, quick, dry, cfg, n_win=n_win, hot_rows=hot_rows)
    if not dry:
        _s7_record(row, B, f"{'L2-hot' if hot_rows else 'random'} k{topk}")


def _s7_pct(bytes_: float, ms: float, hbm: float) -> str:
    return f"{100 * bytes_ / hbm / (ms * 1e-3):5.1f}%" if ms == ms else "    -"


def _summary_bandwidth(quick: bool, title: str, columns: str) -> float:
    """The HBM copy bandwidth measured now (the summaries' % column), printed in the summary's title line."""
    hbm = _copy_bandwidth(quick)
    torch.cuda.empty_cache()
    print(f"--- {title} (HBM copy now {hbm / 1e12:.2f} TB/s; {columns})")
    return hbm


def _print_block_fit(label: str, pts: list) -> None:
    """time = fixed + slope x blocks through (blocks, us) points by least squares, printed with the points."""
    x = torch.tensor([p[0] for p in pts], dtype=torch.float64)
    y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    print(f"  {label}: fixed {y.mean() - slope * x.mean():.1f} us + {slope:.2f} us per 64-entry block ({len(pts)} "
          "points: " + ", ".join(f"{int(a * 64)}: {b:.1f}" for a, b in pts) + ")")  # fmt: skip


def case_attn_s7_summary(row: Row, quick: bool, dry: bool):
    """The 4k-layout rows per batch, fastest first (% of the HBM copy bandwidth measured now; BEST marks the
    first), with the random-layout anchor under them."""
    if dry:
        return
    hbm = _summary_bandwidth(quick, "sparse_attn s7 summary", "time, % roofline, after a read flush")
    for B in S7_BATCHES:
        rows = [r for r in S7_RESULTS if r["B"] == B and r["what"] == "4k"]
        for i, r in enumerate(sorted(rows, key=lambda r: r["ms"] if r["ms"] == r["ms"] else 1e9)):
            print(f"  B{B:<4} {'BEST ' if i == 0 else '     '}{r['row']:<44} {r['ms'] * 1e3:7.1f} us "
                  f"{_s7_pct(r['bytes'], r['ms'], hbm)}  read-flush {r['read_ms'] * 1e3:6.1f} us "
                  f"{_s7_pct(r['bytes'], r['read_ms'], hbm)}  err {r['check']}")  # fmt: skip
        for r in (r for r in S7_RESULTS if r["B"] == B and r["what"] in ("random k640", "L2-hot k640")
                  and "fixedcost" not in r["row"]):  # fmt: skip
            kind = "anchor" if r["what"].startswith("random") else "L2-hot"
            print(f"  B{B:<4} {kind} {r['row']:<43} {r['ms'] * 1e3:7.1f} us {_s7_pct(r['bytes'], r['ms'], hbm)}")
    row.check = "summary printed above"


def case_attn_s7_fit(row: Row, quick: bool, dry: bool):
    """The fixed-cost rows: time = fixed + slope x blocks (a request's 64-entry blocks) by least squares, for the
    single pass at B128 (one request a CTA: slope = a block's cost) and the persistent grid at B256 (two requests a
    CTA: slope = two blocks' cost, fixed = what a CTA pays once)."""
    if dry:
        return
    for tag in sorted({r["row"].split(" k")[0] for r in S7_RESULTS if "fixedcost" in r["row"]}):
        pts = [(int(r["what"].split("k")[1]) / 64, r["ms"] * 1e3) for r in S7_RESULTS
               if r["row"].split(" k")[0] == tag and r["ms"] == r["ms"]]  # fmt: skip
        if len(pts) >= 2:
            _print_block_fit(tag, pts)
    row.check = "summary printed above"


def attn_s7_cases():
    """`--only "sparse_attn s7"`: at B 64 / 128 / 256 (V4.1: H64 D512, 128 window + 512 compressed entries, the
    runtime's two pools at 4k context), the default (sm90_config) and the variants: bf16 split partials
    (Config.partial_bf16: half the bytes the split pass writes and the combine reads), no split at B64 (64 CTAs,
    no combine), L2 prefetch of the next block, split 2 with bf16 partials at B128 (256 CTAs: two waves of
    5-block CTAs), the single pass vs the persistent grid at B256; each default also on the random-row layout of
    the earlier rows (anchor), and at B128 / B256 with the entries drawn from 4096 rows (L2-hot: the program's own
    bound without HBM latency). Then the summary (sorted per B), the fixed-cost probe (top-k 128 .. 1152 at B128
    single pass / B256 persistent) and the one-launch output epilogue (fused_attention's inverse RoPE + FP8) at
    T 64 / 128 / 256. Defaults first, unmeasured programs later (a device fault poisons the rest of the run)."""
    sad = sparse_attn_decode
    rep = dataclasses.replace
    ws64 = sad.Config(64, sad.WS_THREADS, 1, 2, True)
    out = []

    add = _attn_row_adder(out, "sparse_attn s7", case_attn_s7)

    def add_random(B, cfg, topk, what, n_win, hot=0):
        out.append((f"sparse_attn s7 B{B} {cfg.tag} {what} k{topk}", f"B{B} H64 k{topk} {'hot' if hot else 'rnd'}",
                    lambda r, q, d, B=B, cfg=cfg, k=topk, n=n_win, h=hot: case_attn_s7_random(
                        r, B, k, cfg, q, d, n, h)))  # fmt: skip

    for B in S7_BATCHES:  # the defaults: measured programs
        add(B, sad.sm90_config(B, 640), "default")
        add_random(B, sad.sm90_config(B, 640), 640, "default", S7_WIN)
    add(256, ws64, "single pass")
    add(128, rep(ws64, l2_prefetch=1))
    add(64, ws64, "no split")
    add(64, rep(sad.Config(64, sad.WS_THREADS, 2, 2, True), partial_bf16=True))  # (session 7's B64 default: split 2)
    add(128, rep(ws64, num_split=2, partial_bf16=True))
    for B in (128, 256):  # the default's own bound without HBM latency (entries from 4096 rows: 4 MB, in L2)
        add_random(B, sad.sm90_config(B, 640), 640, "L2-hot", S7_WIN, hot=4096)
    out.append(("sparse_attn s7 summary", "-", case_attn_s7_summary))
    for B, cfg in ((128, ws64), (256, rep(ws64, persist=132))):
        for k in (128, 256, 384, 640, 1152)[1 if cfg.persist else 0 :]:  # persist: >= 2 whole ring rounds
            add_random(B, cfg, k, "fixedcost", 0)
    out.append(("sparse_attn s7 fixedcost fit", "-", case_attn_s7_fit))
    out += [(f"sparse_attn s7 oepilogue (triton) T{t}", f"T{t} H64 D512 g32",
             lambda r, q, d, t=t: case_attn_o_epilogue(r, t, q, d)) for t in S7_BATCHES]  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- sparse_attn s8
# `--only "sparse_attn s8"` (session 8, helper A): the defaults on the runtime's operands (s7_operands; session 8's
# early_p / lazy_rescale rows went with the options in session 10), then the per-block split of the CTA's time: the
# fixed-cost probe after a read-only flush (no dirty L2 lines to write back, which do_bench's zeroing flush adds to the
# intercept) and the same probe with no global loads of KV rows or ids (skip "gather,ids": the QK^T -> softmax -> PV
# chain alone). Rows append to S7_RESULTS (their names start "sparse_attn s8"); the summary and the fits read them.


def case_attn_s8_readflush(row: Row, B: int, topk: int, cfg, quick: bool, dry: bool):
    """case_attn_decode's random-row protocol (one pool, a few -1 entries) timed after a read-only flush only; a
    skip diagnostic (Config.skip) is timed unchecked, as in case_attn_decode."""
    _ATTN_PREBUILT[0] = True
    case_attn_decode(row, B, topk, quick, dry, cfg, flush="read")
    if not dry:
        _s7_record(row, B, f"readflush k{topk}")


def _s8_rows(B: int | None = None, what: str | None = None, prefix: str = "sparse_attn s8") -> list[dict]:
    return [r for r in S7_RESULTS if r["row"].startswith(prefix) and (B is None or r["B"] == B)
            and (what is None or r["what"] == what)]  # fmt: skip


def case_attn_s8_summary(row: Row, quick: bool, dry: bool, prefix: str = "sparse_attn s8", batches=S7_BATCHES):
    """Per batch: the 4k-operand rows fastest first (% of the HBM copy bandwidth measured now, do_bench and after a
    read flush) and each variant against the batch's default; then the per-block fits (time = fixed + slope x
    64-entry blocks by least squares) of the read-flush and compute-only probes. prefix: the rows' group."""
    if dry:
        return
    hbm = _summary_bandwidth(quick, f"{prefix} summary", "do_bench, then after a read flush")
    for B in batches:
        rows = _s8_rows(B, "4k", prefix)
        base = next((r for r in rows if r["row"].endswith(" default")), None)
        for i, r in enumerate(sorted(rows, key=lambda r: r["ms"] if r["ms"] == r["ms"] else 1e9)):
            vs = f"{base['ms'] / r['ms']:5.3f}x" if base and r["ms"] == r["ms"] else "    -"
            print(f"  B{B:<4} {'BEST ' if i == 0 else '     '}{r['row']:<40} {r['ms'] * 1e3:7.1f} us "
                  f"{_s7_pct(r['bytes'], r['ms'], hbm)} {vs} vs default  read-flush {r['read_ms'] * 1e3:6.1f} us "
                  f"{_s7_pct(r['bytes'], r['read_ms'], hbm)}  err {r['check']}")  # fmt: skip
        for r in _s8_rows(B, "L2-hot k640", prefix):
            print(f"  B{B:<4} L2-hot {r['row']:<40} {r['ms'] * 1e3:7.1f} us {_s7_pct(r['bytes'], r['ms'], hbm)}")
    probes = [r for r in _s8_rows(prefix=prefix) if r["what"].startswith("readflush")]
    for tag in sorted({r["row"].rsplit(" k", 1)[0] for r in probes}):
        pts = [(int(r["what"].split("k")[1]) / 64, r["ms"] * 1e3) for r in probes
               if r["row"].rsplit(" k", 1)[0] == tag and r["ms"] == r["ms"]]  # fmt: skip
        if len(pts) >= 2:
            _print_block_fit(f"fit {tag}", pts)
    row.check = "summary printed above"


def _trace_kernel(B: int, cfg, dry: bool, topk: int = 640):
    """Config.trace's build on the runtime's two pools: launch(q, kv, idx, sink, out) -> Trace [B * ns, slots] int64
    (split configs: the partial pass traced, then the combine)."""
    sad = sparse_attn_decode
    pools = dict(n_win=S7_WIN, S_cmp=ATTN_POOL - ATTN_WIN_POOL)
    prog = sad.program(B, HEADS, HEAD_DIM, ATTN_WIN_POOL, topk, target="sm90", cfg=cfg, **pools)
    k = build(prog)
    ns = cfg.num_split
    comb = build(sad.combine_program_wide(B, HEADS, HEAD_DIM, ns, target="sm90")) if ns > 1 else None
    if dry:
        return None
    slots = sad.trace_slots(topk // ns // cfg.block_n)

    op = torch.empty(B, ns, HEADS, HEAD_DIM, device="cuda")  # the single pass leaves these alone
    mp, lp = (torch.empty(B, ns, HEADS, device="cuda") for _ in range(2))

    def launch(q, kv, idx, sink, out):
        trace = torch.zeros(B * ns, slots, device="cuda", dtype=torch.int64)
        k(q, *kv, *idx, sink, out, op, mp, lp, trace)
        if ns > 1:
            comb(op, mp, lp, sink, out)
        return trace

    return launch


def _trace_report(trace: torch.Tensor, nb: int) -> None:
    """Medians over the CTAs of Config.trace's stamps, in us (clock64 ticks over globaltimer ns per CTA)."""
    sad = sparse_attn_decode
    t = trace.double().cpu()
    ghz = ((t[:, sad.TRACE_END] - t[:, sad.TRACE_CLK0]) / (t[:, sad.TRACE_GT_END] - t[:, sad.TRACE_GT0])).median()

    def us(x):
        return x / ghz / 1e3

    def med(x):
        return float(x.median())

    gt0 = t[:, sad.TRACE_GT0]
    span = (t[:, sad.TRACE_GT_END].max() - gt0.min()) / 1e3
    print(f"  {t.shape[0]} CTAs, SM clock {ghz:.2f} GHz; span {span:.1f} us; "
          f"CTA start skew median {med(gt0 - gt0.min()) / 1e3:.1f} / max {(gt0.max() - gt0.min()) / 1e3:.1f} us; "
          f"CTA span median {med(t[:, sad.TRACE_GT_END] - gt0) / 1e3:.1f} us; Q landed "
          f"{med(us(t[:, sad.TRACE_Q] - t[:, sad.TRACE_CLK0])):.2f} us after the start")  # fmt: skip
    print("  block: WG0 data wait | QK^T | softmax+P | P->PV warpgroups | rescale+PV | WG0 period (median us)")
    for j in range(nb):
        e = [t[:, sad.TRACE_BLOCK0 + sad.TRACE_PER_BLOCK * j + i] for i in range(sad.TRACE_PER_BLOCK)]
        nxt = t[:, sad.TRACE_BLOCK0 + sad.TRACE_PER_BLOCK * (j + 1)] if j + 1 < nb else t[:, sad.TRACE_FIN]
        print(f"  {j:5d}: {med(us(e[1] - e[0])):6.2f} | {med(us(e[2] - e[1])):5.2f} | {med(us(e[3] - e[2])):5.2f} | "
              f"{med(us(e[4] - e[3])):5.2f} | {med(us(e[5] - e[4])):5.2f} | {med(us(nxt - e[0])):5.2f}")  # fmt: skip
    last_pv = t[:, sad.TRACE_BLOCK0 + sad.TRACE_PER_BLOCK * (nb - 1) + 5]
    print(f"  first block ready {med(us(t[:, sad.TRACE_BLOCK0] - t[:, sad.TRACE_CLK0])):.2f} us after the start; "
          f"last PV -> O stored {med(us(t[:, sad.TRACE_END] - last_pv)):.2f} us")  # fmt: skip
    if bool((t[:, sad.TRACE_END2] != 0).all()):  # session 9's tail stamps (WG1 after fin, WG2 after its stores)
        print(f"  tail (from WG1's last PV): fin waited {med(us(t[:, sad.TRACE_FIN_WAITED] - last_pv)):.2f} | "
              f"WG1 stores issued {med(us(t[:, sad.TRACE_END] - last_pv)):.2f} | WG2 stores issued "
              f"{med(us(t[:, sad.TRACE_END2] - last_pv)):.2f} us; WG0 fin arrived "
              f"{med(us(t[:, sad.TRACE_FIN] - last_pv)):.2f} us; CTA end -> kernel end (globaltimer) "
              f"{float((t[:, sad.TRACE_GT_END].max() - t[:, sad.TRACE_GT_END]).median()) / 1e3:.2f} us")  # fmt: skip


def case_attn_s8_trace(row: Row, B: int, cfg, quick: bool, dry: bool, topk: int = 640):
    """Config.trace on the runtime's 4k operands (128 window + topk - 128 compressed entries): checked against the
    untraced config (bit for bit: the same program plus the stamps) and the reference (a Config.skip diagnostic:
    unchecked); prints _trace_report of the last of a few launches (after a read flush) and times the traced build
    (do_bench and read flush) next to the untraced one; the kernel's time past the CTAs' span is launch / event cost."""
    sad = sparse_attn_decode
    _ATTN_PREBUILT[0] = True
    traced = _trace_kernel(B, cfg, dry, topk)
    plain = _attn_kernel(B, topk, dataclasses.replace(cfg, trace=False), False, dry, n_win=S7_WIN)
    row.bytes_, row.flops = sad.roofline(B, HEADS, HEAD_DIM, topk)
    row.peak = "bf16"
    if dry:
        return
    q, kv, idx, sink, kv_cat, idx_cat = s7_operands(B, topk)
    out, ref_out = torch.empty_like(q), torch.empty_like(q)
    plain(q, kv, idx, sink, ref_out)
    flush = torch.zeros(64 << 20, device="cuda")
    for _ in range(3):
        flush.sum()
        trace = traced(q, kv, idx, sink, out)
    torch.cuda.synchronize()
    same = "n/a (diagnostic)" if cfg.skipped else torch.equal(out, ref_out)
    if cfg.skipped:
        row.check = f"none (diagnostic: {'+'.join(cfg.skipped)} left out)"
    else:
        err = expect(rel_err(out, sad.reference(q, kv_cat, idx_cat, sink)), 2e-2)
        row.check = err + ("" if same else " NOT-EQUAL")
    row.ms = bench(lambda: traced(q, kv, idx, sink, out), quick)
    row.eager_ms = bench(lambda: plain(q, kv, idx, sink, ref_out), quick)  # (the eager column: untraced)
    rf_t = _bench_read_flush(lambda: traced(q, kv, idx, sink, out), quick)
    rf_p = _bench_read_flush(lambda: plain(q, kv, idx, sink, ref_out), quick)
    print(f"--- {row.kernel}: traced {row.ms * 1e3:.1f} us (read flush {rf_t * 1e3:.1f}), untraced "
          f"{row.eager_ms * 1e3:.1f} us (read flush {rf_p * 1e3:.1f}), bit-equal {same}")  # fmt: skip
    _trace_report(trace, topk // cfg.num_split // cfg.block_n)


S8_FIT_TOPK = (128, 384, 640, 1152)


def attn_s8_cases():
    """`--only "sparse_attn s8"`: at B 64 / 128 / 256 on the runtime's 4k operands, the default (sm90_config); at B64
    also the unsplit program (64 CTAs, no combine). Then, at B128 (one CTA a request, one wave), the fixed-cost probe
    after a read flush (top-k 128 .. 1152) and the compute-only probe (no KV / id loads). Defaults first. (Session 8's
    early_p / lazy_rescale / ids_first rows went with the options in session 10: within 1% of the defaults.)"""
    sad = sparse_attn_decode
    rep = dataclasses.replace
    out = []

    add = _attn_row_adder(out, "sparse_attn s8", case_attn_s7)

    def add_probe(B, cfg, topk, what):
        out.append((f"sparse_attn s8 B{B} {cfg.tag} {what} k{topk}", f"B{B} H64 k{topk} rnd",
                    lambda r, q, d, B=B, cfg=cfg, k=topk: case_attn_s8_readflush(r, B, k, cfg, q, d)))  # fmt: skip

    for B in S7_BATCHES:
        add(B, sad.sm90_config(B, 640), "default")
    ws64 = sad.Config(64, sad.WS_THREADS, 1, 2, True)
    add(64, ws64, "no split")
    for cfg in (ws64, rep(ws64, skip="gather,ids")):
        for k in S8_FIT_TOPK:
            add_probe(128, cfg, k, "readflush")
    out.append(("sparse_attn s8 summary", "-", case_attn_s8_summary))
    out += attn_s8_trace_cases()
    return out


def attn_s8_trace_cases():
    """`--only "sparse_attn s8 trace"`: Config.trace (per-block stamps of the ws program) on the runtime's 4k
    operands, to split the fixed cost (B128: 19 us of 39 at k640, read flush): B128 single pass at k640 and k256, the
    same with no KV / id loads ("gather,ids": the compute chain alone) and with nothing but the skeleton (Q load,
    hand-offs, O store: "gather,ids,qk,softmax,pv"); B64 split 2 (+ combine); B256 single pass (two waves of CTAs);
    then, untraced, the B256 persistent grid."""
    sad = sparse_attn_decode
    rep = dataclasses.replace
    ws = sad.sm90_config(128, 640)  # wsn64s2
    cfgs = [(128, ws, 640), (128, ws, 256), (128, rep(ws, skip="gather,ids"), 640),
            (128, rep(ws, skip="gather,ids,qk,softmax,pv"), 640), (64, sad.sm90_config(64, 640), 640),
            (256, ws, 640)]  # fmt: skip
    cfgs = [(B, rep(cfg, trace=True), k) for B, cfg, k in cfgs]
    out = [(f"sparse_attn s8 trace B{B} {cfg.tag} k{k}", f"B{B} H64 k{k} 4k",
            lambda r, q, d, B=B, cfg=cfg, k=k: case_attn_s8_trace(r, B, cfg, q, d, k)) for B, cfg, k in cfgs]
    for cfg in (sad.sm90_config(256, 640),):  # untraced (persist)
        out.append((f"sparse_attn s8 trace-free B256 {cfg.tag} readflush k640", "B256 H64 k640 rnd",
                    lambda r, q, d, cfg=cfg: case_attn_s8_readflush(r, 256, 640, cfg, q, d)))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- sparse_attn s9
# `--only "sparse_attn s9"` (session 9, helper A): the O epilogue through shared memory (Config.o_smem, tag "o": 16-B
# stores of whole head rows) next to the defaults on the runtime's operands, then `sparse_attn s9 trace`: the tail
# from the last PV to the CTA's end split by the new stamps (fin waited, WG1 / WG2 stores issued), with and without
# o_smem and with no O stores at all (skip "ostore"). Rows append to S7_RESULTS (names start "sparse_attn s9").


def case_attn_s9(row: Row, B: int, cfg, quick: bool, dry: bool):
    """case_attn_s7 (checked against the reference, do_bench and read flush); an o_smem config's output is also
    compared bit for bit with the same config without it on the same operands (the same values stored another way:
    anything else is a bug). (Config.fuse_combine, the in-kernel fold of split 2, measured 37.8 us at
    B64 vs 33.5 with the combine kernel in session 9's call 3, is gone.)"""
    case_attn_s7(row, B, cfg, quick, dry)
    if cfg.o_smem:
        _check_vs_plain(row, B, cfg, "o_smem", dry, must_equal=True)


def _check_vs_plain(row: Row, B: int, cfg, field: str, dry: bool, must_equal: bool):
    """Runs `cfg` and the same config with `field` off on the same operands (runtime's 4k) and compares the outputs
    bit for bit: raises on a difference when `must_equal` (the option stores the same values another way), else
    reports it in row.check. Dry: builds both kernels only."""
    plain = dataclasses.replace(cfg, **{field: False})
    kernels = [_s7_kernel(B, plain, dry), _s7_kernel(B, cfg, dry)]
    if dry:
        return
    q, kv, idx, sink, _, _ = s7_operands(B)
    outs = [torch.full_like(q, float("nan")) for _ in kernels]
    for kernel, out in zip(kernels, outs):
        kernel(q, kv, idx, sink, out)
    same = torch.equal(*outs)
    if must_equal and not same:
        raise AssertionError(f"{cfg.tag}'s output differs from {plain.tag}'s")
    row.check += f" {'bit-equal' if same else 'differs from'} {plain.tag}"


def attn_s9_cases():
    """`--only "sparse_attn s9"` (session 9 call 3): at B 64 / 128 / 256 (runtime's 4k operands, checked, do_bench and
    read flush) the default next to o_smem (each also bit-equal to its config without it): B128 single pass; B256
    persistent with o_smem; the B128 trace rows; B64 unsplit with and without o_smem; B256 single pass (two waves)
    with and without it; the summary. (The removed warm_tail / fuse_combine rows: see sparse_attn_decode's
    docstring.)"""
    sad = sparse_attn_decode
    rep = dataclasses.replace
    ws64 = sad.Config(64, sad.WS_THREADS, 1, 2, True)
    out = []

    add = _attn_row_adder(out, "sparse_attn s9", case_attn_s9)

    for B in S7_BATCHES:
        add(B, sad.sm90_config(B, 640), "default")
    add(128, rep(ws64, o_smem=True))
    add(256, rep(sad.sm90_config(256, 640), o_smem=True))
    traces = attn_s9_trace_cases()
    out += traces[:-1]
    add(64, ws64, "no split")
    add(64, rep(ws64, o_smem=True), "no split")
    add(256, ws64, "single pass")
    add(256, rep(ws64, o_smem=True), "single pass")
    out += traces[-1:]
    out.append(("sparse_attn s9 summary", "-", lambda r, q, d: case_attn_s8_summary(r, q, d, "sparse_attn s9")))
    return out


def _gputest_s10_cfgs() -> list:
    """test_sparse_attn_s10.py's gpu test kernels: the B64 / 128 / 256 defaults with and without evict_first."""
    sad = sparse_attn_decode
    return [(B, dataclasses.replace(sad.sm90_config(B, 640), evict_first=f)) for B in (64, 128, 256)
            for f in (False, True)]  # fmt: skip


def _gputest_s9_cfgs() -> list:
    """test_sparse_attn_s9.py's gpu test kernels: o_smem next to its plain configs (single pass, persistent grid)."""
    sad = sparse_attn_decode
    rep = dataclasses.replace
    ws64 = sad.Config(64, sad.WS_THREADS, 1, 2, True)
    out = []
    for B, base in ((128, ws64), (256, rep(ws64, persist=132))):
        out += [(B, base), (B, rep(base, o_smem=True))]
    return out


def _build_only_rows(prefix: str, cfgs: list) -> list:
    """Build-only rows (one a kernel), prebuilt by main's -j workers into TileLang's cache."""

    def only_build(row, B, cfg):
        _ATTN_PREBUILT[0] = True
        _s7_kernel(B, cfg, True)
        row.check = "built (for the gpu tests)"

    return [(f"{prefix} B{B} {cfg.tag}", f"B{B} H64 k640", lambda r, q, d, B=B, cfg=cfg: only_build(r, B, cfg))
            for B, cfg in cfgs]  # fmt: skip


def attn_gputest_cases():
    """`--only "sparse_attn gputest"` (build only, every row): the kernels of the sparse-attention gpu tests
    (test_sparse_attn_s9.py's and test_sparse_attn_s10.py's), built by main's -j workers into TileLang's cache, so
    that pytest run right after with the same TILELANG_CACHE_DIR loads them instead of compiling ~20 kernels one at
    a time (they outran its timeout)."""
    return _build_only_rows("sparse_attn gputest", _gputest_s9_cfgs() + _gputest_s10_cfgs())


def attn_s9r2_cases():
    """`--only "sparse_attn s9r2"` (session 9, the last kernel round), on the runtime's 4k operands: B64 split 2 with
    bf16 partials through shared memory (o_smem + partial_bf16, bit-equal to partial_bf16 alone) next to split 2 and
    the default (unsplit o_smem since call 3); B128 and B256 (persistent) o_smem again. (Its early_p + lazy_rescale
    rows and their gpu test's build rows went with the options in session 10.)"""
    sad = sparse_attn_decode
    rep = dataclasses.replace
    ws64 = sad.Config(64, sad.WS_THREADS, 1, 2, True)
    out = []

    add = _attn_row_adder(out, "sparse_attn s9r2", case_attn_s9)

    split = sad.Config(64, sad.WS_THREADS, 2, 2, True)  # B64's default before session 9's call 3
    add(64, sad.sm90_config(64, 640), "default")
    add(64, split, "split 2")
    add(64, rep(split, partial_bf16=True, o_smem=True))
    for cfg in (rep(ws64, o_smem=True), sad.sm90_config(256, 640)):
        add(256 if cfg.persist else 128, rep(cfg, o_smem=True))
    out.append(("sparse_attn s9r2 summary", "-", lambda r, q, d: case_attn_s8_summary(r, q, d, "sparse_attn s9r2")))
    return out


def attn_s9_trace_cases():
    """`--only "sparse_attn s9 trace"`: Config.trace at B128 k640 (runtime's operands): the default, o_smem, the
    default without its O stores (skip "ostore": the tail without them) and with zeros stored at the same addresses
    from a rolled loop (skip "ovals": the stores' traffic without their unrolled code)."""
    sad = sparse_attn_decode
    rep = dataclasses.replace
    ws = rep(sad.Config(64, sad.WS_THREADS, 1, 2, True), trace=True)
    cfgs = [(128, ws), (128, rep(ws, o_smem=True)), (128, rep(ws, skip="ostore")), (128, rep(ws, skip="ovals"))]
    return [(f"sparse_attn s9 trace B{B} {cfg.tag} k640", f"B{B} H64 k640 4k",
             lambda r, q, d, B=B, cfg=cfg: case_attn_s8_trace(r, B, cfg, q, d, 640)) for B, cfg in cfgs]  # fmt: skip



# ---------------------------------------------------------------------------------------------- sparse_attn s10
# `--only "attn s10"` (session 10, helper B): the decode variants of session 10 next to the defaults on the runtime's
# 4k operands, every row checked against the reference and, where the variant stores the same values another way,
# bit for bit against its config without it; do_bench and read-flush times, % of the HBM copy bandwidth measured in
# the same run (the summary). Rows append to S7_RESULTS (names start "sparse_attn s10").


def case_attn_s10(row: Row, B: int, cfg, quick: bool, dry: bool):
    """case_attn_s7 (checked, do_bench and read flush); an evict_first config's output is also compared bit for bit
    with the same config without it (only the copies' L2 policy differs: anything else is a bug); a q_regs config's
    with the same config without it, reported (RS and SS wgmma should agree bit for bit; the check is the reference)."""
    case_attn_s7(row, B, cfg, quick, dry)
    for field, must in (("evict_first", True), ("q_regs", False)):
        if getattr(cfg, field):
            _check_vs_plain(row, B, cfg, field, dry, must_equal=must)


def attn_s10_cases():
    """`--only "attn s10"`: at B 64 / 128 / 256 the default (sm90_config) next to evict_first ("f": the copies under
    an L2 evict_first policy, so that the gather's misses evict its own lines, not dirty ones); at B256 also the single
    pass (two waves of CTAs; 74% after a read flush in session 9, 68% under do_bench) with and without it; at B64
    split 2 with bf16 partials through shared memory (session 9: 31.2 us under do_bench, 36.3 after a read flush) with
    and without it; then the summary (per batch, fastest first, x vs the default, do_bench and read flush)."""
    sad = sparse_attn_decode
    rep = dataclasses.replace
    out = []
    add = _attn_row_adder(out, "sparse_attn s10", case_attn_s10)
    for B in S7_BATCHES:
        add(B, sad.sm90_config(B, 640), "default")
    for B in S7_BATCHES:
        add(B, rep(sad.sm90_config(B, 640), evict_first=True))
    single = sad.sm90_config(128, 640)  # the single pass with the defaults' options (o_smem)
    add(256, single, "single pass")
    add(256, rep(single, evict_first=True), "single pass")
    split = sad.Config(64, sad.WS_THREADS, 2, 2, True, partial_bf16=True, o_smem=True)  # session 9: 31.2 / 36.3 us
    add(64, split, "split 2")
    add(64, rep(split, evict_first=True), "split 2")
    out.append(("sparse_attn s10 summary", "-", lambda r, q, d: case_attn_s8_summary(r, q, d, "sparse_attn s10")))
    return out


def attn_s10r2_cases():
    """`--only "attn s10r2"` (session 10, round 2): evict_first where call 2 did not measure it -- the small batches'
    split passes (B1 x20, B16 x5, B32 x4 + the combine kernel) with and without it (bit-equal), and a prefill chunk
    (T4096 k640 on the persistent grid: its tokens re-read the chunk's pools from L2, so evict_first may cost there);
    the B128 / B256 defaults (evict_first on since call 2) next to the same configs without it; Config.q_regs on the
    B64 / 128 / 256 defaults (reported bit-equal or not to the default: RS and SS wgmma); then the summary."""
    sad = sparse_attn_decode
    rep = dataclasses.replace
    out = []
    add = _attn_row_adder(out, "sparse_attn s10r2", case_attn_s10)
    for B in (1, 16, 32, 128, 256):
        add(B, sad.sm90_config(B, 640), "default")
    for B in (1, 16, 32):
        add(B, rep(sad.sm90_config(B, 640), evict_first=True))
    for B in (128, 256):
        add(B, rep(sad.sm90_config(B, 640), evict_first=False))
    pre = sad.prefill_config(4096, 640)
    for cfg in (pre, rep(pre, evict_first=True)):
        out.append((f"sparse_attn s10r2 prefill {cfg.tag}", "T4096 H64 k640",
                    lambda r, q, d, c=cfg: case_attn_prefill(r, 4096, 640, q, d, c, 0, 2, False)))
    for B in (64, 128, 256):  # Config.q_regs (new): Q's left half in WG0's registers, its QK^T half an RS wgmma
        add(B, rep(sad.sm90_config(B, 640), q_regs=True))
    add(256, rep(sad.sm90_config(128, 640), q_regs=True), "single pass")  # (B128's config: two waves at B256)
    add(64, sad.sm90_config(64, 640), "default")
    out.append(("sparse_attn s10r2 summary", "-",
                lambda r, q, d: case_attn_s8_summary(r, q, d, "sparse_attn s10r2", (1, 16, 32, 64, 128, 256))))
    return out


def attn_s10_final_cases():
    """`--only "attn s10 final"` (session 10, the last call): the defaults at B64 / 128 / 256 (B64: q_regs, B128 /
    B256: evict_first since calls 2-3) next to B64's previous default (wsn64s2o) and, for a margin at B256, the
    persistent grid of 128 CTAs (two requests each, none with one) with evict_first; then the summary."""
    sad = sparse_attn_decode
    rep = dataclasses.replace
    out = []
    add = _attn_row_adder(out, "sparse_attn s10 final", case_attn_s10)
    for B in S7_BATCHES:
        add(B, sad.sm90_config(B, 640), "default")
    add(64, rep(sad.sm90_config(64, 640), q_regs=False))
    add(256, rep(sad.sm90_config(256, 640), persist=128))
    out.append(("sparse_attn s10 final summary", "-",
                lambda r, q, d: case_attn_s8_summary(r, q, d, "sparse_attn s10 final")))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- sparse_attn s12 B
# `--only "sparse_attn s12 B"` (session 12, helper B): the portable program's output store folded into one guarded
# path (d2ee335; its lowered 64-head sm90 CUDA is unchanged up to the AllReduce workspaces' names). The 64-head decode
# defaults (the ws program: untouched by the fold) at B64 / B256 on the runtime's 4k operands as the anchor to session
# 11 (31.7 / 65.8 us), and the portable program at 64 heads -- the code the fold changed -- at B64 (split 2: the
# split store) and B128 / B256 (one pass: the single store) under attn_cases' protocol (random rows of a 256K pool;
# earlier n32t256s2x2 B64 45.7 us, n32t256s2 B128 71.6 us); every row checked; the summary gives each row's share of
# the HBM copy bandwidth measured in the same run.


def case_attn_s12b(row: Row, B: int, cfg, quick: bool, dry: bool):
    """The ws default: case_attn_s7 (4k operands, do_bench and read flush); the portable program: case_attn_decode's
    random pool (its pool sizes are fixed at build time, so it cannot take s7's per-batch pools), recorded too."""
    if cfg.ws:
        case_attn_s7(row, B, cfg, quick, dry)
    else:
        case_attn_s7_random(row, B, 640, cfg, quick, dry, n_win=0)


def case_attn_s12b_summary(row: Row, quick: bool, dry: bool):
    if dry:
        return
    hbm = _summary_bandwidth(quick, "sparse_attn s12 B summary", "do_bench; 4k: also after a read flush")
    for r in _s8_rows(prefix="sparse_attn s12 B"):
        pct, read_pct = _s7_pct(r["bytes"], r["ms"], hbm), _s7_pct(r["bytes"], r["read_ms"], hbm)
        read = f"read-flush {r['read_ms'] * 1e3:6.1f} us {read_pct}" if r["what"] == "4k" else ""
        print(f"  B{r['B']:<4} {r['row']:<44} {r['what']:<12} {r['ms'] * 1e3:7.1f} us {pct}  {read}  err {r['check']}")
    row.check = "summary printed above"


def attn_s12b_cases():
    sad = sparse_attn_decode
    out = []
    for B, cfg, what, shape in [(B, sad.sm90_config(B, 640), "default", "4k") for B in (64, 256)] + [
            (B, sad.portable_split_config(B, 640), "portable", "rnd") for B in (64, 128, 256)]:  # fmt: skip
        out.append((f"sparse_attn s12 B B{B} {cfg.tag} {what}", f"B{B} H64 k640 {shape}",
                    lambda r, q, d, B=B, cfg=cfg: case_attn_s12b(r, B, cfg, q, d)))  # fmt: skip
    out.append(("sparse_attn s12 B summary", "-", case_attn_s12b_summary))
    return out


def case_rope(row: Row, T_: int, inverse: bool, quick: bool, dry: bool):
    """V4.1 query RoPE: T tokens x 64 heads x 512, the last 64 channels rotated, YaRN table of 1M positions."""
    from deepinfer.ir.ops.attention import rope_inv_freq

    P, r = 1 << 20, 64
    kernel = build(rope.program(T_, HEADS, HEAD_DIM, P, rope_dim=r, inverse=inverse, target="sm90"))
    row.bytes_, row.flops = rope.roofline(T_, HEADS, HEAD_DIM, r)
    if dry:
        return
    table = rope.cos_sin_table(P, rope_inv_freq(r, 10000.0, 16.0, 65536)).cuda()
    x = torch.randn(T_, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, P, (T_,), device="cuda", dtype=torch.int32)
    y = torch.full_like(x, float("nan"))
    kernel(x, pos, table, y)
    row.check = expect(rel_err(y, rope.reference(x, pos, table, r, inverse)), 1e-2)
    row.ms = bench(lambda: kernel(x, pos, table, y), quick)
    row.eager_ms = bench(lambda: rope.reference(x, pos, table, r, inverse), quick)


# --- new families: indexer_topk, compressor, engram (cases appended; imports are local to keep them separate)

IDX_HEADS, IDX_DIM, IDX_TOPK = 32, 128, 512


def _topk_check(idx, key, scores, k: int, tol: float = 1e-3) -> str:
    """The kernel's set against fp32 reference scores: right count, no repeats, its own scores agree (when the
    kernel returns them: `key`, else None), and nothing it left out beats what it took by more than `tol` of the
    largest |score| (the kernel's score error; exact ties may go either way)."""
    from deepinfer.codegen.kernels import indexer_topk

    worst = 0.0
    span = scores[scores > float("-inf")].abs().max().clamp_min(1e-30)
    got_s = indexer_topk.keys_to_scores(key.cpu()).to(scores.device) if key is not None else None
    for t in range(scores.shape[0]):
        nvis = int((scores[t] > float("-inf")).sum())
        sel = idx[t][idx[t] >= 0].long()
        if sel.numel() != min(k, nvis) or sel.unique().numel() != sel.numel():
            raise AssertionError(f"row {t}: {sel.numel()} distinct picks, want {min(k, nvis)}")
        if sel.numel() == 0:
            continue
        kth = torch.topk(scores[t], sel.numel()).values[-1]
        worst = max(worst, ((kth - scores[t, sel].min()) / span).item())
        if got_s is not None:
            worst = max(worst, ((got_s[t, : sel.numel()] - scores[t, sel]).abs().max() / span).item())
    return expect(worst, tol)


def case_indexer_topk(row: Row, T_: int, C: int, prefill: bool, fp8: bool, quick: bool, dry: bool):
    """V4.1 indexer: T queries x 32 heads x 128 against C index keys, top-512; prefill is causal (ratio 2)."""
    from deepinfer.codegen.kernels import indexer_topk as it

    cfg = it.default_config(T_, C, IDX_TOPK)
    dt = "float8_e4m3" if fp8 else "bfloat16"
    score = build(it.score_program(T_, C, topk=IDX_TOPK, ratio=2, scale=1.0, dtype=dt, target="sm90", cfg=cfg))
    n_chunks = C // cfg.chunk
    levels, n = [], n_chunks  # (kernel, candidate sets it leaves) per merge level
    for group in it.merge_plan(n_chunks, IDX_TOPK):
        levels.append((build(it.merge_program(T_, n, topk=IDX_TOPK, group=group, target="sm90")), n // group))
        n //= group
    row.bytes_, row.flops = it.roofline(T_, C, topk=IDX_TOPK, elem_bytes=1 if fp8 else 2, causal=prefill)
    if dry:
        return
    tdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    q = (torch.randn(T_ * IDX_HEADS, IDX_DIM, device="cuda") * 2).to(tdt)
    k = (torch.randn(C, IDX_DIM, device="cuda") * 2).to(tdt)
    w = torch.randn(T_, IDX_HEADS, device="cuda") * IDX_HEADS**-0.5
    ks = torch.rand(C, device="cuda") + 0.5
    # decode: every entry visible; prefill: T tokens over their own C = T/2 ratio-2 entries
    pos = torch.arange(T_, device="cuda", dtype=torch.int32) if prefill else torch.full(
        (T_,), 2 * C - 1, device="cuda", dtype=torch.int32)  # fmt: skip
    bufs = [(torch.empty(T_, m * IDX_TOPK, device="cuda", dtype=torch.int32),
             torch.empty(T_, m * IDX_TOPK, device="cuda", dtype=torch.int32))
            for m in [n_chunks] + [n_out for _, n_out in levels]]  # fmt: skip

    def run():
        score(q, w, k, ks, pos, *bufs[0])
        for i, (merge, _) in enumerate(levels):
            merge(*bufs[i], *bufs[i + 1])

    run()
    out_i, out_k = bufs[-1]
    qf = q.float().view(T_, IDX_HEADS, IDX_DIM)
    scores = torch.cat([it.reference_scores(qf[i : i + 256], w[i : i + 256], k.float(), ks, pos[i : i + 256],
                                            ratio=2, scale=1.0) for i in range(0, T_, 256)])  # fmt: skip
    row.check = _topk_check(out_i, out_k, scores, IDX_TOPK)
    row.ms = bench(run, quick)

    def eager():  # torch: full scores, then topk
        s = torch.relu(torch.einsum("thd,cd->thc", qf, k.float()))
        s = (s * w.unsqueeze(-1)).sum(1) * ks
        vis = torch.arange(C, device="cuda") < ((pos.long() + 1) // 2).unsqueeze(-1)
        return torch.topk(s.masked_fill(~vis, float("-inf")), IDX_TOPK, dim=-1).indices

    row.eager_ms = bench(eager, quick) if T_ * C <= (1 << 24) else float("nan")


def _idx_positions(T_: int, C: int):
    """Decode (T <= 64): every entry visible. Prefill (T = 4096): the last T tokens of a 2C-token context at
    ratio 2 -- pure causal when C = T / 2 (each query sees (p + 1) // 2 entries)."""
    if T_ <= 64:
        return torch.full((T_,), 2 * C - 1, dtype=torch.int32)
    return (2 * C - T_ + torch.arange(T_)).clamp(min=0).to(torch.int32)


def _idx_inputs(T_: int, C: int):
    """FP8 q [T*32, 128], keys [C, 128] (+ fp32 per-key scale), head weights (q scale folded in), positions."""
    q = (torch.randn(T_ * IDX_HEADS, IDX_DIM, device="cuda") * 2).to(torch.float8_e4m3fn)
    k = (torch.randn(C, IDX_DIM, device="cuda") * 2).to(torch.float8_e4m3fn)
    w = torch.randn(T_, IDX_HEADS, device="cuda") * IDX_HEADS**-0.5
    ks = torch.rand(C, device="cuda") + 0.5
    return q, w, k, ks, _idx_positions(T_, C).cuda()


def _idx_ref_scores(q, w, k, ks, pos, scale: float):
    from deepinfer.codegen.kernels import indexer_topk as it

    T_ = w.shape[0]
    qf = q.float().view(T_, IDX_HEADS, IDX_DIM)
    return torch.cat([it.reference_scores(qf[i : i + 128], w[i : i + 128], k.float(), ks, pos[i : i + 128],
                                          ratio=2, scale=scale) for i in range(0, T_, 128)])  # fmt: skip


def _idx_topk_exact(got, scores, pos) -> str:
    """The top-k kernel against `topk_entries` on the SAME scores: the identical set (ties included)."""
    from deepinfer.codegen.kernels import topk_select as ts

    want = torch.cat([ts.reference(scores[i : i + 256], IDX_TOPK, pos[i : i + 256], 2)
                      for i in range(0, scores.shape[0], 256)])  # fmt: skip
    bad = (got.long() != want).any(1)
    if bad.any():
        first = int(bad.nonzero()[0])
        raise AssertionError(f"top-k differs from topk_entries in {int(bad.sum())} rows (first: row {first})")
    return "exact"


def _idx_mma_model(s, q, w, k, ks, pos, rows: int = 2, cols: int = 2048) -> str:
    """Where the fp8 scores' error comes from, on the last `rows` queries x the first `cols` keys: the fp32
    reference's error against the FP8 MMA model (13-bit aligned accumulation, indexer_topk.reference_scores_mma)
    and the kernel's distance from that model (much smaller than its fp32 error when the model is the cause)."""
    from deepinfer.codegen.kernels import indexer_topk as it

    T_, c = w.shape[0], min(cols, k.shape[0])
    qf = q.float().view(T_, IDX_HEADS, IDX_DIM)[-rows:]
    args = (qf, w[-rows:], k[:c].float(), ks[:c], pos[-rows:])
    model = it.reference_scores_mma(*args, ratio=2, scale=IDX_DIM**-0.5)
    ref = it.reference_scores(*args, ratio=2, scale=IDX_DIM**-0.5)
    got = s[-rows:, :c]
    vis = ref > float("-inf")
    e_ref, e_got = rel_err(model[vis], ref[vis]), rel_err(got[vis], model[vis])
    return f" (fp32 vs 13-bit MMA model {e_ref:.1e}, kernel vs model {e_got:.1e})"


def case_indexer_scores(row: Row, T_: int, C: int, quick: bool, dry: bool, cfg=None):
    """Split indexer, part 1: FP8 wgmma scores [T, C] fp32 (ReLU, head weights, head sum in the epilogue)."""
    from deepinfer.codegen.kernels import indexer_topk as it

    cfg = cfg or it.scores_config(T_, C, IDX_HEADS)
    row.kernel += f" {cfg.tag}"
    kern = build(it.scores_program(T_, C, ratio=2, scale=IDX_DIM**-0.5, target="sm90", cfg=cfg))
    pos = _idx_positions(T_, C)
    row.bytes_, row.flops = it.scores_roofline(T_, C, visible=it.visible_entries(pos, 2, C))
    if dry:
        return
    q, w, k, ks, pos = _idx_inputs(T_, C)
    s = torch.empty(T_, C, device="cuda")
    kern(q, w, k, ks, pos, s)
    ref = _idx_ref_scores(q, w, k, ks, pos, IDX_DIM**-0.5)
    vis = ref > float("-inf")
    if not torch.equal(vis, s > float("-inf")):
        raise AssertionError("visibility (-inf) pattern differs")
    # FP8 wgmma accumulates with ~13 bits below the largest addend of a k-step: 1e-4..3e-4 here, not fp32's 1e-7
    # (derivation and the structural-error margin: indexer_topk's docstring and FP8_SCORES_TOL)
    row.check = expect(rel_err(s[vis], ref[vis]), it.FP8_SCORES_TOL) + _idx_mma_model(s, q, w, k, ks, pos)
    row.ms = bench(lambda: kern(q, w, k, ks, pos, s), quick)
    if T_ * C <= (1 << 24):
        row.eager_ms = bench(lambda: _idx_ref_scores(q, w, k, ks, pos, IDX_DIM**-0.5), quick)


def case_indexer_topk_select(row: Row, T_: int, C: int, quick: bool, dry: bool, variant: str = "tilelang", cfg=None):
    """Split indexer, part 2: exact top-512 of fp32 scores [T, C] (visible columns only), every score read once.
    Scores are the fp32 reference of real-shaped FP8 inputs (the scores kernel's output distribution)."""
    from deepinfer.codegen.kernels import indexer_topk as it
    from deepinfer.codegen.kernels import topk_select as ts

    pos = _idx_positions(T_, C)
    row.bytes_, row.flops = ts.roofline(T_, C, IDX_TOPK, visible=it.visible_entries(pos, 2, C))
    row.peak = "fp8"
    diag = variant == "amax" or bool(getattr(cfg, "diag", ""))  # stage-cost rows: no top-k to check
    if variant == "amax":  # the streaming reference: torch reads every score once (the whole rows)
        row.kernel += " torch.amax(dim=1)"
        row.bytes_ = 4.0 * T_ * C
    elif variant == "tilelang":
        cfg = cfg or ts.default_config(T_, C, IDX_TOPK)
        row.kernel += f" {cfg.tag}"
        kern = build(ts.program(T_, C, k=IDX_TOPK, ratio=2, cfg=cfg, target="sm90"))
    else:
        cfg = cfg or ts.triton_default_config(T_, C, IDX_TOPK)
        row.kernel += f" {cfg.tag}"
    if dry:
        return
    q, w, k, ks, pos = _idx_inputs(T_, C)
    s = _idx_ref_scores(q, w, k, ks, pos, IDX_DIM**-0.5)
    out = torch.empty(T_, IDX_TOPK, device="cuda", dtype=torch.int32)
    if variant == "amax":

        def run():
            torch.amax(s, dim=1)
    elif variant == "tilelang":
        scratch = ts.make_scratch(T_, C, IDX_TOPK, cfg, "cuda")

        def run():
            kern(s, pos, out, *scratch)
    else:
        ws = ts.TritonWorkspace(T_, C, IDX_TOPK, cfg, "cuda")

        def run():
            ts.triton_topk(s, IDX_TOPK, pos, 2, cfg=cfg, out=out, ws=ws)

    if diag:
        run()
        row.check = "stage only (no top-k)"
        row.ms = bench(run, quick)
        return
    if variant == "tilelang":  # heavy exact ties first (few values, -0.0 next to +0.0): the cuts, the tie passes
        ties = torch.randint(-3, 4, s.shape, device="cuda").float()
        ties[:, ::5] = torch.where(ties[:, ::5] == 0, -0.0, ties[:, ::5])
        kern(ties, pos, out, *scratch)
        _idx_topk_exact(out, ties, pos)
        del ties
    run()
    row.check = _idx_topk_exact(out, s, pos)
    run()  # again: the multi-CTA rows' arrival counters must have been left at zero
    row.check = _idx_topk_exact(out, s, pos)
    row.ms = bench(run, quick)

    def eager():
        vis = torch.arange(C, device="cuda") < ((pos.long() + 1) // 2).unsqueeze(-1)
        return torch.topk(s.masked_fill(~vis, float("-inf")), IDX_TOPK, dim=-1).indices

    row.eager_ms = bench(eager, quick) if T_ * C <= (1 << 26) else float("nan")


def case_indexer_split(row: Row, T_: int, C: int, quick: bool, dry: bool):
    """Split indexer end to end: scores kernel then top-k kernel (the scores make one HBM round trip). The
    limit is max(bytes of both / BW, flops / FP8 peak); the kernels run back to back, so where the scores are
    compute-bound (prefill) the top-k's memory time comes on top and the % reads low by that much."""
    from deepinfer.codegen.kernels import indexer_topk as it
    from deepinfer.codegen.kernels import topk_select as ts

    scfg, tcfg = it.scores_config(T_, C, IDX_HEADS), ts.default_config(T_, C, IDX_TOPK)
    row.kernel += f" {scfg.tag}+{tcfg.tag}"
    score = build(it.scores_program(T_, C, ratio=2, scale=IDX_DIM**-0.5, target="sm90", cfg=scfg))
    topk = build(ts.program(T_, C, k=IDX_TOPK, ratio=2, cfg=tcfg, target="sm90"))
    pos = _idx_positions(T_, C)
    vis = it.visible_entries(pos, 2, C)
    (b1, f1), (b2, f2) = it.scores_roofline(T_, C, visible=vis), ts.roofline(T_, C, IDX_TOPK, visible=vis)
    row.bytes_, row.flops = b1 + b2, f1 + f2
    if dry:
        return
    q, w, k, ks, pos = _idx_inputs(T_, C)
    s = torch.empty(T_, C, device="cuda")
    out = torch.empty(T_, IDX_TOPK, device="cuda", dtype=torch.int32)
    scratch = ts.make_scratch(T_, C, IDX_TOPK, tcfg, "cuda")

    def run():
        score(q, w, k, ks, pos, s)
        topk(s, pos, out, *scratch)

    run()
    _idx_topk_exact(out, s, pos)  # exact on the kernel's own scores
    ref = _idx_ref_scores(q, w, k, ks, pos, IDX_DIM**-0.5)
    # and right against fp32 reference scores up to near-ties: both the k-th score and the smallest picked one
    # may be off by the fp8 scores' error
    row.check = _topk_check(out, None, ref, IDX_TOPK, 2 * it.FP8_SCORES_TOL)
    row.ms = bench(run, quick)


def case_compressor(row: Row, T_: int, ratio: int, quick: bool, dry: bool):
    """V4.1 compressor epilogue on 512-dim rows: ratio-2 pair softmax pooling + RMSNorm, or ratio-1 RMSNorm."""
    from deepinfer.codegen.kernels import compressor as cp

    d = 512
    kernel = build(cp.program(T_, d, ratio=ratio, eps=EPS, target="sm90"))
    row.bytes_, row.flops = cp.roofline(T_, d, ratio)
    if dry:
        return
    a, z = torch.randn(T_, d, device="cuda"), torch.randn(T_, d, device="cuda") * 3
    sa, sz = torch.zeros(1, d, device="cuda"), torch.zeros(1, d, device="cuda")
    w = torch.rand(d, device="cuda") + 0.5
    y = torch.empty(cp.n_groups(T_, ratio), d, device="cuda", dtype=torch.bfloat16)
    args = (a, z, sa, sz, w, y) if ratio == 2 else (a, w, y)
    kernel(*args)
    ref = cp.reference(a, z, w, ratio=ratio, eps=EPS)
    row.check = expect(rel_err(y, ref), 2e-2)
    row.ms = bench(lambda: kernel(*args), quick)
    row.eager_ms = bench(lambda: cp.reference(a, z, w, ratio=ratio, eps=EPS), quick)


def case_engram_embed(row: Row, T_: int, quick: bool, dry: bool):
    """Engram gather: 24 FP8 rows of 256 (ue8m0 per 32) per token from a 4M-row slice of the table."""
    from deepinfer.codegen.kernels import engram as eg

    R, K = 1 << 22, 24
    kernel = build(eg.embed_program(T_, K, R, target="sm90"))
    row.bytes_, row.flops = eg.embed_roofline(T_, K)
    if dry:
        return
    table = (torch.randn(R, eg.HEAD_DIM, device="cuda") * 4).to(torch.float8_e4m3fn)
    scale = torch.randint(110, 140, (R, eg.HEAD_DIM // 32), device="cuda", dtype=torch.uint8)
    ids = torch.randint(0, R, (T_, K), device="cuda", dtype=torch.int32)
    m = torch.empty(T_, K * eg.HEAD_DIM, device="cuda")
    kernel(table, scale, ids, m)
    row.check = expect(rel_err(m, eg.embed_reference(table, scale, ids)), 1e-6)
    row.ms = bench(lambda: kernel(table, scale, ids, m), quick)
    row.eager_ms = bench(lambda: eg.embed_reference(table, scale, ids), quick)


def case_engram_gate(row: Row, T_: int, quick: bool, dry: bool):
    """Engram gate into 4 residual streams of 5120 (bf16), kv = 4 keys + value (fp32)."""
    from deepinfer.codegen.kernels import engram as eg

    n, D, img = 4, HIDDEN, 129264
    kernel = build(eg.gate_program(T_, n, D, eps=EPS, clamp=1e-6, image_token_id=img, target="sm90"))
    row.bytes_, row.flops = eg.gate_roofline(T_, n, D)
    if dry:
        return
    x = torch.randn(T_, n, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(T_, (n + 1) * D, device="cuda")
    qk = torch.rand(n, D, device="cuda") + 0.5
    tok = torch.randint(0, 129280, (T_,), device="cuda", dtype=torch.int32)
    tok[::7] = img
    y = torch.empty_like(x)
    kernel(x, kv, qk, tok, y)
    ref = eg.gate_reference(x, kv, qk, tok, eps=EPS, clamp=1e-6, image_token_id=img)
    row.check = expect(rel_err(y, ref), 1e-2)
    row.ms = bench(lambda: kernel(x, kv, qk, tok, y), quick)
    row.eager_ms = bench(lambda: eg.gate_reference(x, kv, qk, tok, eps=EPS, clamp=1e-6, image_token_id=img), quick)


def _topk_hist_sweep():
    """topk_select.HistConfig (histogram bound) rows, (T, C, cfg, first): `first` rows (row name "indexer_topk_select
    hist": the decisive 5 kernels, one -j 15 prebuild wave) next to the previous default (same run), the others
    ("indexer_topk_select hsweep") the rest of the sweep: threads x scores a thread per chunk, chunks prefetched
    into L2 at prefill (one CTA streams a row); segments per row at decode (the last CTA merges segments x k)."""
    from deepinfer.codegen.kernels import topk_select as ts

    H = ts.HistConfig
    return [
        (4096, 65536, ts.Config(256, 16, 65536, True, 4, 2048), True),
        (4096, 65536, H(256, 16, 65536, l2_ahead=2), True),
        (4096, 65536, H(128, 16, 65536, l2_ahead=2), False),
        (4096, 16384, H(256, 16, 16384, l2_ahead=2), True),
        (4096, 16384, H(128, 16, 16384, l2_ahead=2), False),
        (64, 65536, H(128, 16, 16384, l2_ahead=2), True),
        (1, 65536, H(256, 16, 8192), True),
        *[(4096, 65536, H(nt, e, 65536, l2_ahead=p), False) for nt, e, p in ((256, 16, 0), (128, 32, 2), (128, 16, 4))],
        (4096, 16384, H(128, 32, 16384, l2_ahead=2), False),
        (4096, 2048, H(128, 16, 2048), False),
        (64, 65536, ts.Config(512, 8, 8192, True, 4, 2048, merge_all=True), False),
        (64, 65536, H(128, 16, 8192, l2_ahead=2), False),
        (1, 65536, H(128, 16, 4096), False),
    ]  # fmt: skip


def _topk_diag_rows():
    """(T, C, cfg, variant) rows "indexer_topk_select diag" (helper C, issue 6): where a 64k row's time goes. At
    T4096 C65536 the measured default (h256e16s65536p2, 761.6 us) with its per-chunk work cut down stage by stage
    (diag read / count / push: the scores streamed, + the histogram bound, + the candidate buffer; the full
    program adds the final selection), the streaming ceiling of the grid (diag read; also 32 scores a thread,
    and no L2 prefetch) and torch.amax (the whole rows read once); the decode shapes (T64 / T1) and their
    streaming floors. Last (a hang there loses nothing else): the fused chunk loop (one barrier a chunk) at
    3 CTAs/SM (min_blocks=3: 80 registers) and 2 (85), its push stage, 128 threads, 4 chunks prefetched into L2,
    8 scores a thread at 4 CTAs/SM (64 registers), C16384 and the decode shapes (T64 also at 8 segments)."""
    from deepinfer.codegen.kernels import topk_select as ts

    H, tl = ts.HistConfig, "tilelang"
    return [
        (4096, 65536, H(256, 16, 65536, l2_ahead=2), tl),
        *[(4096, 65536, H(256, 16, 65536, l2_ahead=2, diag=d), tl) for d in ts.HIST_DIAGS],
        (4096, 65536, H(256, 16, 65536, diag="read"), tl),
        (4096, 65536, H(256, 32, 65536, l2_ahead=2, diag="read"), tl),
        (4096, 65536, None, "amax"),
        (64, 65536, H(128, 16, 16384, l2_ahead=2), tl), (64, 65536, H(128, 16, 16384, l2_ahead=2, diag="read"), tl),
        (1, 65536, H(256, 16, 8192), tl), (1, 65536, H(256, 16, 8192, diag="read"), tl),
        (4096, 65536, H(256, 16, 65536, l2_ahead=2, fused=True, min_blocks=3), tl),
        (4096, 65536, H(256, 16, 65536, l2_ahead=2, fused=True, min_blocks=3, ffs=True), tl),
        (4096, 65536, H(256, 16, 65536, l2_ahead=2, fused=True), tl),
        (4096, 65536, H(256, 16, 65536, l2_ahead=2, fused=True, min_blocks=3, diag="push"), tl),
        (4096, 65536, H(128, 16, 65536, l2_ahead=2, fused=True), tl),
        (4096, 65536, H(256, 16, 65536, l2_ahead=4, fused=True, min_blocks=3), tl),
        (4096, 65536, H(256, 8, 65536, l2_ahead=4, fused=True, min_blocks=4), tl),
        (4096, 16384, H(128, 16, 16384, l2_ahead=2, fused=True), tl),
        (64, 65536, H(128, 16, 16384, l2_ahead=2, fused=True), tl),
        (64, 65536, H(128, 16, 8192, l2_ahead=2, fused=True), tl),
        (1, 65536, H(256, 16, 8192, fused=True), tl),
        # issue 8's decode-64 rows (layers 2 / 20 at 4096 cached tokens): the defaults, the 4160-column row in one
        # 512-thread chunk (registers, one select) and as 3 fused segments of 2048 (one chunk each, a merge)
        (64, 2080, None, tl), (64, 4160, None, tl), (64, 4160, ts.Config(512, 16, 8192), tl),
        (64, 4160, H(128, 16, 2048, fused=True), tl),
    ]  # fmt: skip


def _topk_final_rows():
    """(T, C, cfg) rows "indexer_topk_select final" (one <= 60 s call): at T4096 C65536 the default (761.6 us
    before), the streaming ceiling of its grid (diag read: no top-k) and the fused chunk loop (fused=2, 3 CTAs/SM,
    the __ffs output; exact-checked on heavy ties -- buffer overflows mid-chunk -- and real scores)."""
    from deepinfer.codegen.kernels import topk_select as ts

    H = ts.HistConfig
    return [(4096, 65536, H(256, 16, 65536, l2_ahead=2)), (4096, 65536, H(256, 16, 65536, l2_ahead=2, diag="read")),
            (4096, 65536, H(256, 16, 65536, l2_ahead=2, fused=2, min_blocks=3, ffs=True))]  # fmt: skip


def _topk_r2_rows():
    """(T, C, cfg) rows "indexer_topk_select r2" (session 6's one <= 100 s call; H200, HBM 4.30 TB/s, every row
    exact): T4096 C65536 the fused default 559.3 us = 44.3% / fast 541.0 us = 45.8% / fast with 4 chunks
    prefetched 548.1 us (measured with the first chunk's coarse bins summed, since removed) / fast at 8 scores a
    thread and 4 CTAs/SM 689.6 us (ditto); C16384 default (128 threads) 257.7 us / fast 217.2 us; T64 C4160 the
    hist default 20.3 us / the row in registers 16.0 us. (Also measured and removed: the coarse-sum first chunk
    alone 544.0 us, the next row's start prefetched into L2 at the final selection 548.2 us.)"""
    from deepinfer.codegen.kernels import topk_select as ts

    H = ts.HistConfig
    fast = dict(fused=2, ffs=True, fast=True)
    return [
        (4096, 65536, H(256, 16, 65536, l2_ahead=2, min_blocks=3, ffs=True, fused=2)),
        (4096, 65536, H(256, 16, 65536, l2_ahead=2, min_blocks=3, **fast)),
        (4096, 65536, H(256, 16, 65536, l2_ahead=4, min_blocks=3, **fast)),
        (4096, 65536, H(256, 8, 65536, l2_ahead=4, min_blocks=4, **fast)),
        (4096, 16384, H(128, 16, 16384, l2_ahead=2)), (4096, 16384, H(128, 16, 16384, l2_ahead=2, **fast)),
        (64, 4160, H(128, 16, 6144, l2_ahead=2)), (64, 4160, ts.Config(512, 16, 8192)),
    ]  # fmt: skip


def _topk_r3_rows():
    """(T, C, cfg, variant) rows "indexer_topk_select r3" (for the next H200 call; unmeasured): where the new prefill
    default's time goes -- T4096 C65536 the default (fused + fast: 541.0 us, the read ceiling of the previous
    grid 306.8 us) next to its chunk loop without the final selection (diag push), its streaming alone (diag
    read) and with trim (selections over the buffer's entries only; 24 B of stack at 80 registers); the decode
    shapes fast has not been timed at: T64 C65536 default / fast 4 and 8 segments, T1 C65536 default / fast 8
    segments, and T64 C2080's default."""
    from deepinfer.codegen.kernels import topk_select as ts

    H, tl = ts.HistConfig, "tilelang"
    fast = dict(fused=2, ffs=True, fast=True)
    pre = H(256, 16, 65536, l2_ahead=2, min_blocks=3, **fast)
    return [
        (4096, 65536, None, tl), (4096, 65536, dataclasses.replace(pre, diag="push"), tl),
        (4096, 65536, dataclasses.replace(pre, diag="read"), tl),
        (4096, 65536, dataclasses.replace(pre, trim=True), tl),
        (64, 65536, None, tl), (64, 65536, H(128, 16, 16384, l2_ahead=2, **fast), tl),
        (64, 65536, H(128, 16, 8192, l2_ahead=2, **fast), tl),
        (1, 65536, None, tl), (1, 65536, H(256, 16, 8192, **fast), tl), (64, 2080, None, tl),
    ]  # fmt: skip


def _topk_s8_rows():
    """(T, C, cfg, variant) rows "indexer_topk_select s8" (helper B, session 8, issue 6: top-k >= 60% of HBM;
    unmeasured). T4096 C65536 k512, the default (fused + fast, 2 chunks prefetched into L2: 541.6 us = 45.8%)
    next to: no L2 prefetch (p0: the read stage alone was 260.9 us without it, 306.7 us with it, session 5);
    `lean` (no per-score column checks, no max pre-pass: fewer instructions a fused chunk); `compact` (the final
    selection on the members staged in the free fine histogram, out of the chunk loop, instead of all 18 buffer
    slots a thread); both, with and without the prefetch. Stage probes of the same run: diag first (the first
    chunk's bound and push, later chunks read only), push (everything but the final selection) for the default
    and lean, read without the prefetch. Then C16384 (128 threads) default vs lean + compact, and the decode shape
    T64 C16384 (2 segments a row) default vs no prefetch vs fused + fast + lean."""
    from deepinfer.codegen.kernels import topk_select as ts

    tl, rep = "tilelang", dataclasses.replace
    pre = ts.default_config(4096, 65536, IDX_TOPK)
    c16 = ts.default_config(4096, 16384, IDX_TOPK)
    dec = ts.default_config(64, 16384, IDX_TOPK)
    return [
        (4096, 65536, None, tl), (4096, 65536, rep(pre, l2_ahead=0), tl), (4096, 65536, rep(pre, lean=True), tl),
        (4096, 65536, rep(pre, compact=2048), tl), (4096, 65536, rep(pre, lean=True, compact=2048), tl),
        (4096, 65536, rep(pre, lean=True, compact=2048, l2_ahead=0), tl),
        (4096, 65536, rep(pre, diag="first"), tl), (4096, 65536, rep(pre, diag="push"), tl),
        (4096, 65536, rep(pre, lean=True, diag="push"), tl), (4096, 65536, rep(pre, l2_ahead=0, diag="read"), tl),
        (4096, 16384, None, tl), (4096, 16384, rep(c16, lean=True, compact=2048), tl),
        (64, 16384, None, tl), (64, 16384, rep(dec, l2_ahead=0), tl),
        (64, 16384, rep(dec, fused=2, ffs=True, fast=True, lean=True), tl),
    ]  # fmt: skip


def _topk_s8b_rows():
    """(T, C, cfg, variant) rows "indexer_topk_select s8b" (helper B, session 8, round 3; unmeasured). Call 2 (H200,
    same run): T4096 C65536 default 541.8 us = 45.8%, lean 495.8, lean + compact without the L2 prefetch 478.6 us =
    51.8% (best); stages: read 259.7, lean push 391.3. Now, all without the L2 prefetch: lean + compact (since then
    the next chunk's loads unpredicated when wholly visible), lean alone (is compact worth it), + wscan (the output
    offsets by warp scans, not one warp's T.cumsum), fused=1 (the bound without a chunk's lag), and the stage probes
    diag select (the final selection without the output) / lean push; rsel (the staged members selected in
    registers, 3 barriers a radix round) with wscan, and its diag select. Then lean + compact + wscan at C16384 and
    the fused + fast + lean decode forms at T64 C65536 (4 segments) and T64 C16384 next to the defaults."""
    from deepinfer.codegen.kernels import topk_select as ts

    tl, rep = "tilelang", dataclasses.replace
    best = rep(ts.default_config(4096, 65536, IDX_TOPK), l2_ahead=0, lean=True, compact=2048)
    c16 = rep(ts.default_config(4096, 16384, IDX_TOPK), l2_ahead=0, lean=True, compact=2048, wscan=True)
    fastdec = dict(l2_ahead=0, fused=2, ffs=True, fast=True, lean=True, wscan=True)
    return [
        (4096, 65536, None, tl), (4096, 65536, best, tl), (4096, 65536, rep(best, compact=0), tl),
        (4096, 65536, rep(best, wscan=True), tl), (4096, 65536, rep(best, fused=1), tl),
        (4096, 65536, rep(best, diag="select"), tl), (4096, 65536, rep(best, compact=0, diag="push"), tl),
        (4096, 65536, rep(best, wscan=True, rsel=True), tl), (4096, 65536, rep(best, rsel=True, diag="select"), tl),
        (4096, 16384, None, tl), (4096, 16384, c16, tl),
        (64, 65536, None, tl), (64, 65536, rep(ts.default_config(64, 65536, IDX_TOPK), **fastdec), tl),
        (64, 16384, None, tl), (64, 16384, rep(ts.default_config(64, 16384, IDX_TOPK), **fastdec), tl),
    ]  # fmt: skip


def _topk_split_rows():
    """(T, C, cfg) rows "indexer_topk_select split" (helper B, session 8; unmeasured): T4096 C65536 in 3960 one-CTA
    rows + 136 rows of 2 segments (topk_select.tail_split) for call 2's best (lean + compact without the L2
    prefetch) and with wscan + rsel; compare with the same configs' one-launch rows of "indexer_topk_select s8b"."""
    from deepinfer.codegen.kernels import topk_select as ts

    best = dataclasses.replace(ts.default_config(4096, 65536, IDX_TOPK), l2_ahead=0, lean=True, compact=2048)
    return [(4096, 65536, best), (4096, 65536, dataclasses.replace(best, wscan=True, rsel=True))]


def case_topk_tail_split(row: Row, T_: int, C: int, cfg, quick: bool, dry: bool):
    """topk_select.tail_split: the whole waves of one-CTA rows in one launch, the last wave's rows split into
    segments in a second (no idle slots in the last wave); checked exact (heavy ties, then real scores, twice) and
    timed as `case_topk_s9` does."""
    case_topk_s9(row, T_, C, cfg, None, True, quick, dry)


def _topk_s9_rows():
    """(T, C, cfg, visible, split) rows "indexer topk s9" (helper B, session 9, issue 6: top-k >= 60% of HBM).
    T4096 C65536 k512: session 8's default (460.8 us = 53.8% in its run, do_bench's flush) next to `persist` (3 x 132
    persistent CTAs; the next row's first chunk fetched before this row's output, or with next_early before its final
    selection; the sm90 build spills 42 loads with rsel, 9 without), tail_split (the last wave's rows as 2-segment
    rows in a second launch) and `eager` (the first chunk's loads issued before the row's limit and the workspace's
    zeroing). T4096 C16384: the default (128 threads, no rsel), with rsel, with eager. T64 C65536 / C16384: the
    defaults. Decode with positions (dead segments idle, the live ones merge only the live slots): T1 and T64 at
    C65536 with 2048 visible columns next to the same rows fully visible.
    H200 call 3 (same run, read-only L2 flush, every row exact): C65536 459.5 us = 54.3%, persist 611.8 / next_early
    611.9 / without rsel 553.5, tail_split 487.7, eager 455.0 = 54.8%; C16384 207.9, rsel 278.6 (141 registers),
    eager 206.7; T64 C65536 65.0, C16384 39.8; T1 C65536 2048 visible 24.4 vs full 36.4, T64 28.7 vs 65.0. The
    persistent grid was removed in session 10 (helper A), its rows with it."""
    from deepinfer.codegen.kernels import topk_select as ts

    rep = dataclasses.replace
    d64, d16 = (rep(ts.default_config(4096, C, IDX_TOPK), eager=False) for C in (65536, 16384))  # (session 8's)
    return [
        (4096, 65536, d64, None, False), (4096, 65536, d64, None, True),
        (4096, 65536, rep(d64, eager=True), None, False),
        (4096, 16384, d16, None, False), (4096, 16384, rep(d16, rsel=True), None, False),
        (4096, 16384, rep(d16, eager=True), None, False),
        (64, 65536, None, None, False), (64, 16384, None, None, False),
        (1, 65536, None, 2048, False), (1, 65536, None, None, False),
        (64, 65536, None, 2048, False),
    ]  # fmt: skip


def _topk_prefill_operands(T_, C, pos):
    """(positions on the GPU, the indexer's reference scores [T_, C], an int32 output [T_, IDX_TOPK]) for a prefill
    top-k row."""
    q, w, k, ks, _ = _idx_inputs(T_, C)
    pos = pos.cuda()
    out = torch.empty(T_, IDX_TOPK, device="cuda", dtype=torch.int32)
    return pos, _idx_ref_scores(q, w, k, ks, pos, IDX_DIM**-0.5), out


def case_topk_s9(row: Row, T_: int, C: int, cfg, visible, split: bool, quick: bool, dry: bool):
    """One "indexer topk s9" row: topk_select (cfg or the default; split: topk_select.tail_split's launches) on the
    fp32 reference scores of real-shaped FP8 inputs, every row checked exact against topk_entries (heavy ties, then
    the real scores twice: the arrival counters reset); `visible` columns a row (positions) or _idx_positions'.
    Timed after a read-only L2 flush (the % of HBM); do_bench's zeroing flush in the check column."""
    from deepinfer.codegen.kernels import indexer_topk as it
    from deepinfer.codegen.kernels import topk_select as ts

    cfg = cfg or ts.default_config(T_, C, IDX_TOPK)
    launches = ts.tail_split(T_, C, cfg) if split else [(0, T_, cfg)]
    row.kernel += " " + "+".join(f"{n}x{c.tag}" if split else c.tag for _, n, c in launches)
    kerns = [build(ts.program(n, C, k=IDX_TOPK, ratio=2, cfg=c, target="sm90")) for _, n, c in launches]
    pos = _idx_positions(T_, C) if visible is None else torch.full((T_,), 2 * visible - 1, dtype=torch.int32)
    row.bytes_, row.flops = ts.roofline(T_, C, IDX_TOPK, visible=it.visible_entries(pos, 2, C))
    row.peak = "fp8"
    if dry:
        return
    pos, s, out = _topk_prefill_operands(T_, C, pos)
    scratch = [ts.make_scratch(n, C, IDX_TOPK, c, "cuda") for _, n, c in launches]

    def run_on(x):
        for kern, (r0, n, _), scr in zip(kerns, launches, scratch):
            kern(x[r0 : r0 + n], pos[r0 : r0 + n], out[r0 : r0 + n], *scr)

    ties = torch.randint(-3, 4, s.shape, device="cuda").float()
    ties[:, ::5] = torch.where(ties[:, ::5] == 0, -0.0, ties[:, ::5])
    run_on(ties)
    _idx_topk_exact(out, ties, pos)
    del ties
    for _ in range(2):
        run_on(s)
        check = _idx_topk_exact(out, s, pos)
    row.ms = _bench_read_flush(lambda: run_on(s), quick)
    row.check = f"{check}; do_bench {bench(lambda: run_on(s), quick) * 1e3:.1f} us"


def _topk_s10_r1_rows():
    """(T, C, cfg) rows "topk_select s10 r1" (helper A, session 10, issue 6: top-k >= 60% of HBM, <= ~415 us at T4096
    C65536 k512; session 9: 455.0 us = 54.8%). The defaults after the staging fix (TileLang's sync planner had put a
    barrier in every iteration of the final selection's staging loop, inside a per-thread branch: ~8 barriers a row,
    divergent on heavy ties) and, at C65536, the same program's stage probes (HistConfig.diag, not a top-k: the
    chunk loop alone `push`, up to the final selection `select`, the streaming ceiling `read`).
    H200 call 2 (HBM copy 4.27 TB/s, read-only flush, exact): 442.8 us = 56.3%; push 363.9, select 407.3, read 237.7;
    C16384 194.6 us. So the chunk loop costs 126 us over the read, the final selection 43, the output 36."""
    from deepinfer.codegen.kernels import topk_select as ts

    d64 = ts.default_config(4096, 65536, IDX_TOPK)
    probes = [(4096, 65536, dataclasses.replace(d64, diag=x)) for x in ("push", "select", "read")]
    return [(4096, 65536, d64), *probes, (4096, 16384, ts.default_config(4096, 16384, IDX_TOPK))]


def _topk_s10_r3_rows():
    """(T, C, cfg) rows "topk_select s10 r3" (the final call): the default at T4096 C65536 since session 10 (the bound
    searched on every 4th chunk; call 3, same run: 424.3 us = 58.8% vs 443.8 searching every chunk) next to sparser
    searches -- each search removed was worth ~2 us in call 3 -- on every 6th / 8th / 16th chunk; the lagging bound
    pushes more: ~3.5k / ~4.8k / ~8k entries a row against the 4608-entry buffer (a full buffer is cut to its top-k:
    exact, slower; a 5632-entry buffer would hold search 8's, +8 KB shared). Every row checked exact (heavy ties, real
    scores twice). The default's kernel is test_gpu_prefill_default_exact's (s10build builds
    it), search 8's the one that test runs with DEEPINFER_TOPK_SEARCH=8. Last, the default with `emit_regs` (the
    output's 8 bitmap words a thread read once into registers, not twice word by word from shared memory)."""
    from deepinfer.codegen.kernels import topk_select as ts

    rep = dataclasses.replace
    d64 = ts.default_config(4096, 65536, IDX_TOPK)
    return [(4096, 65536, c) for c in (d64, rep(d64, search=6), rep(d64, search=8), rep(d64, search=16),
                                       rep(d64, emit_regs=True))]  # fmt: skip


# (helper A, session 11) the bound's search schedules of "topk_select s11 r1" (`search_at`: chunk indices, T4096
# C65536 = 16 chunks); a CPU model (the real scores' keys, fine bins, search at chunk a applying from chunk a + 1)
# gives the pushes a row: default {3,7,11,15} ~3520, g2 ~3370, g1 ~3200, g3 ~3130 (every chunk ~2990)
TOPK_S11_SCHEDULES = {"g2": (2, 4, 8, 15), "g1": (2, 3, 5, 9, 15), "g3": (2, 3, 4, 6, 9, 15)}


def _topk_s11_r1_rows():
    """(T, C, cfg) rows "topk_select s11 r1" (helper A, session 11, issue 6: >= 60% of HBM, <= ~415 us at T4096
    C65536; session 10: 424.6 us = 58.4%). Session 10's search counts (every chunk / 2nd / 4th / 6th: 443.8 / 430.7 /
    424.3 / 430.7 us) say both a search (~4-6 us) and the pushes of a lagging bound cost; the default's chunks 1-3 push
    ~1640 keys against the first chunk's bound alone. So schedules dense early, sparse late (`search_at`,
    TOPK_S11_SCHEDULES: a search at chunk 2 halves chunk 3's pushes): g2 (4 searches, as many as the default), g1 (5),
    g3 (6); then the default and g1 with `emit_regs` (session 10: -2.0 us once). g1's kernel is the one
    test_gpu_prefill_default_exact runs with DEEPINFER_TOPK_SEARCH_AT=2,3,5,9,15. Every row checked exact (heavy
    ties, real scores twice). Last, two clock probes (`case_topk_clock`: not a top-k): the default's and g1's stage
    cycles a row -- the pushes' and the searches' cost chunk by chunk, the final selection's and the output's.
    H200 call 4 (b1e4b52, HBM copy 4.27 TB/s, every row exact): default 423.2 us = 58.9% | g2 430.7 | g1 430.4 | g3
    432.6 | + emit_regs 422.8 | g1 + emit_regs 429.1; clock (cycles a row) default: ws 779 c0 8076 c1 4200 c2 4133 c3
    4582 c4 3618 ... c12 2792 ... c15 3270 stage 2942 select 5721 mark 827 emit 4545, total 75385; g1 76531. Call 5
    (round 2, rows removed with their options): default 423.8 | skewed bitmap + emit_regs 427.9 | warp-aggregated
    first-chunk coarse counts 434.9 | both 439.0 | default + 3 barriers a fused chunk (`xbar`) 429.5."""
    from deepinfer.codegen.kernels import topk_select as ts

    rep = dataclasses.replace
    d64 = ts.default_config(4096, 65536, IDX_TOPK)
    sched = [rep(d64, search_at=TOPK_S11_SCHEDULES[g]) for g in ("g2", "g1", "g3")]
    clock = [rep(d64, clock=True), rep(sched[1], clock=True)]  # (probes: each stage's cycles a row)
    return [(4096, 65536, c) for c in (d64, *sched, rep(d64, emit_regs=True), rep(sched[1], emit_regs=True), *clock)]


def _topk_s11_default():
    """Session 11's T4096 C65536 top-k default (what the session-12 rounds were measured against): today's default
    with the session-12 options off (`peel`, `warp_first`, `bin_sel`; emit_wc and l2_ahead were never on), so that
    the rounds' rows keep the base they were measured on after the flips (ac1743e, b29880d)."""
    from deepinfer.codegen.kernels import topk_select as ts

    return dataclasses.replace(ts.default_config(4096, 65536, IDX_TOPK), peel=0, warp_first=False, emit_wc=False,
                               bin_sel=False, l2_ahead=0)  # fmt: skip


def _topk_s12_r1_rows():
    """(T, C, cfg) rows "topk_select s12 r1" (helper A, session 12, issue 6: >= 60% of HBM, <= ~415 us at T4096
    C65536; session 11: 423.2 / 423.8 us = 58.9 / 58.5%). TileLang's sync planner ran 5 barriers a fused chunk, 1
    needed (probe xbar 3: +5.7 us): `peel` takes the first chunk out of the chunk loop (2 a fused chunk in the lowered
    CUDA); `warp_first` finds the peeled first chunk's bound by one warp's bin search instead of the CTA threshold's
    ~8 barriers. Every row exact (heavy ties, real scores twice); then the clock probes (`case_topk_clock`, not a
    top-k) of the default and of peel + warp_first.
    H200 call 2 (the lead, at 89efc51 -- peel's first form, now `peel` 1 with minor changes; HBM copy 4.27 TB/s, every
    row exact): default 423.7 us = 58.8% | peel 421.0 | peel + warp_first 419.6 = 59.4%; clock (cycles a row) default
    c0 8061 ... stage 2941 select 5700 mark 823 emit 4563, total 75354; peel + warp_first c0 5960, the fused chunks
    ~0.4-0.5k more each in the probe (77948 in all; the probe kernel 444.4 us vs 431.4: the probe distorts)."""

    rep = dataclasses.replace
    d64 = _topk_s11_default()  # (the default when call 2 ran)
    pw = rep(d64, peel=1, warp_first=True)
    return [(4096, 65536, c) for c in (d64, rep(d64, peel=1), pw, rep(d64, clock=True), rep(pw, clock=True))]


def _topk_s12_r2_rows():
    """(T, C, cfg) rows "topk_select s12 r2" (helper A, session 12; call 2: peel + warp_first 419.6 us = 59.4%, ~4.5 us
    short of 60%). `peel` 2: the fused chunks' (and the first chunk's push's) shared accesses through pointer handles
    bound before the loop -- ONE barrier a fused chunk in the lowered CUDA (peel 1: 2; sm90: 2 words spilled, ~1
    local load + 1 store a chunk); `emit_wc`: the output from bitmap words owned warp-contiguously (conflict-free reads
    kept in registers, a warp scan a round; the output was 4.5k cycles a row); `l2_ahead` 1 / 2 on top (the lead's
    idea: while a CTA runs its ~14k-cycle tail the SM's other two stream alone, latency-bound -- bytes in flight beyond
    the register chunk); `bin_sel`: the final selection from the rank-k fine bin of the final counts (rows without an
    overflow cut: the staged members from that bin up, the register selection starting in its 2^20-key range, no
    count / min / max reduction; the selection was 5.7k cycles a row). The default, call 2's best (peel 1 +
    warp_first), peel 2 + warp_first, + emit_wc, + bin_sel, + l2_ahead 1, + l2_ahead 2, + emit_wc + bin_sel; every row
    exact (heavy ties, real scores twice); last the clock probe of peel 2 + warp_first + emit_wc + bin_sel.
    test_gpu_prefill_default_exact with DEEPINFER_TOPK_PEEL=2 DEEPINFER_TOPK_WARP_FIRST=1 DEEPINFER_TOPK_EMIT_WC=1
    DEEPINFER_TOPK_BIN_SEL=1 runs the 8th row's kernel."""

    rep = dataclasses.replace
    d64 = _topk_s11_default()  # (the default when call 3 ran)
    p2 = rep(d64, peel=2, warp_first=True)
    wc, bs = rep(p2, emit_wc=True), rep(p2, emit_wc=True, bin_sel=True)
    rows = (d64, rep(d64, peel=1, warp_first=True), p2, wc, rep(p2, bin_sel=True), rep(p2, l2_ahead=1),
            rep(p2, l2_ahead=2), bs, rep(bs, clock=True))  # fmt: skip
    return [(4096, 65536, c) for c in rows]


def _topk_s12_r3_rows():
    """(T, C, cfg) rows "topk_select s12 r3" (helper A, session 12): the T4096 C65536 default after the flip (peel 1 +
    warp_first: call 3 398.1 us vs 423.0) next to session 11's (peel and warp_first off) -- the flip's before / after,
    both exact (heavy ties, real scores twice) --, then on the new default: bin_sel, l2_ahead 1, both (each ~-5 us on
    peel 2 in call 3), one more barrier a fused chunk (`xbar` 1: a control -- an extra barrier should cost ~2 us, not
    undo the gain), 3 KB more shared a CTA (`smem_pad` 768: the size the pointer-handle builds had -- 64.7 KB vs 61.6
    -- on the same code: is the size what cost them ~20 us?), and the new default's clock probe."""

    rep = dataclasses.replace
    old = _topk_s11_default()
    d64 = rep(old, peel=1, warp_first=True)  # (the default when call 4 ran: the first flip, before bin_sel)
    rows = (d64, old, rep(d64, bin_sel=True), rep(d64, l2_ahead=1), rep(d64, bin_sel=True, l2_ahead=1),
            rep(d64, xbar=1), rep(d64, smem_pad=768), rep(d64, clock=True))  # fmt: skip
    return [(4096, 65536, c) for c in rows]


def _topk_s12_r4_rows():
    """(T, C, cfg) rows "topk_select s12 r4" (helper A, session 12, the final call): the T4096 C65536 default after both
    flips (peel 1 + warp_first + bin_sel: call 4 394.4 us) next to session 11's default (423.6), both exact, then the
    smem_pad 768 probe on the new default (the pointer-handle builds' 64.7 KB of shared on the same code: was the size
    what cost them ~20 us?)."""
    from deepinfer.codegen.kernels import topk_select as ts

    d64 = ts.default_config(4096, 65536, IDX_TOPK)
    return [(4096, 65536, c) for c in (d64, _topk_s11_default(), dataclasses.replace(d64, smem_pad=768))]


def case_topk_clock(row: Row, T_: int, C: int, cfg, quick: bool, dry: bool):
    """A "topk_select s11" clock row (HistConfig.clock: the real program, then each row's checkpoint clocks in its
    first output entries -- not a top-k): the kernel timed as `case_topk_s10` times a probe, then one run on the same
    real scores and every stage's mean cycles a row (the CTA's critical path: thread 0 after the stage's barrier),
    printed as one line: ws (zeroing; eager: the first chunk's loads issued), c0 (the first chunk: its loads, count,
    bound, push), c1..c15 (the fused chunks), stage / select (the final selection), mark / emit (the output)."""
    from deepinfer.codegen.kernels import topk_select as ts

    probe = _topk_probe(row, T_, C, cfg, quick, dry)
    if probe is None:
        return
    run, out = probe
    names = ts.hist_clock_points(cfg)
    run()
    torch.cuda.synchronize()
    cyc = out[:, : len(names)].long().diff(dim=1).double().mean(0).tolist()  # (int32 clocks: differences wrap right)
    stages = " ".join(f"{n} {c:.0f}" for n, c in zip(names[1:], cyc))
    print(f"clock {cfg.tag}: cycles a row, mean of {T_}: {stages} | total {sum(cyc):.0f}")
    row.check = f"clock probe (no top-k): {sum(cyc):.0f} cycles a row; do_bench {bench(run, quick) * 1e3:.1f} us"


def _topk_s10_r2_rows():
    """(T, C, cfg) rows "topk_select s10 r2" (round 2; unmeasured): per CTA a 64k row is ~43 us (16 chunks of ~2.2 us,
    then ~8 us of final selection and output) at 3 CTAs an SM, and the loop runs far below the SM's issue rate: each
    CTA waits on its own latency chain. So (1) the bound's bin search (one warp's extra work on each chunk's critical
    path, the others wait for it at the barrier) every 2nd / 4th chunk only (`search`), with the chunk loop alone
    (probe `push`) for the loop's share, and the first chunk alone (probe `first`: the later chunks only read); (2)
    more rows in flight an SM: 8 scores a thread (half the registers for the chunk in flight) at 4 CTAs x 256 threads
    (64 registers) or 2 x 512 (the same 4096-score chunk); 128-thread CTAs (2048-score chunks) at 4 an SM without
    rsel, or 5 with rsel on a 1024-member stage (8 a thread in registers, not 16). C16384 (128 threads, 8 chunks) with
    search 2. Every top-k row checked exact (heavy ties, real scores twice); the probes are not a top-k."""
    from deepinfer.codegen.kernels import topk_select as ts

    rep = dataclasses.replace
    d64, d16 = ts.default_config(4096, 65536, IDX_TOPK), ts.default_config(4096, 16384, IDX_TOPK)
    h128 = rep(d64, threads=128, rsel=False, min_blocks=4)
    return [(4096, 65536, c) for c in (
        d64, rep(d64, search=2), rep(d64, search=4), rep(d64, search=4, diag="push"), rep(d64, diag="first"),
        rep(d64, per_thread=8, min_blocks=4), rep(d64, threads=512, per_thread=8, min_blocks=2),
        h128, rep(h128, min_blocks=5, rsel=True, compact=1024),
    )] + [(4096, 16384, d16), (4096, 16384, rep(d16, search=2))]  # fmt: skip


def case_topk_s10(row: Row, T_: int, C: int, cfg, quick: bool, dry: bool):
    """A "topk_select s10" row: `case_topk_s9` (every row exact on heavy ties and real scores, read-flush time, % of
    the HBM copy measured in this run) for a top-k config; a stage probe (cfg.diag: not a top-k) timed the same way
    on the same real scores, unchecked."""
    if not cfg.diag:
        return case_topk_s9(row, T_, C, cfg, None, False, quick, dry)
    probe = _topk_probe(row, T_, C, cfg, quick, dry)
    if probe is not None:
        row.check = f"stage probe (no top-k); do_bench {bench(probe[0], quick) * 1e3:.1f} us"


def _topk_probe(row: Row, T_: int, C: int, cfg, quick: bool, dry: bool):
    """A top-k probe's kernel (cfg.diag or cfg.clock: not a top-k, unchecked) built and timed as `case_topk_s9` times
    a row (read-only flush) on the indexer's real scores: None when dry, else (a call of it, its output)."""
    from deepinfer.codegen.kernels import indexer_topk as it
    from deepinfer.codegen.kernels import topk_select as ts

    row.kernel += " " + cfg.tag
    kern = build(ts.program(T_, C, k=IDX_TOPK, ratio=2, cfg=cfg, target="sm90"))
    pos = _idx_positions(T_, C)
    row.bytes_, row.flops = ts.roofline(T_, C, IDX_TOPK, visible=it.visible_entries(pos, 2, C))
    row.peak = "fp8"
    if dry:
        return None
    pos, s, out = _topk_prefill_operands(T_, C, pos)
    scratch = ts.make_scratch(T_, C, IDX_TOPK, cfg, "cuda")

    def run():
        kern(s, pos, out, *scratch)

    row.ms = _bench_read_flush(run, quick)
    return run, out


# the GPU tie tests' -k (tests/codegen/test_topk_select.py and test_gpu_new_families.py)
TOPK_S10_TEST = "gpu_lean or gpu_prefill_default or (topk_select_ties and default)"


def topk_s10_test_configs() -> list[tuple[int, int, str]]:
    """(T, C, which) of every kernel the GPU tie tests TOPK_S10_TEST select build: test_gpu_lean_compact_exact's
    (`topk_s8_test_config`), the families' default tie test's (`topk_tie_config(..., "default")`) and
    test_gpu_prefill_default_exact's (the default at T4096 C65536: also the "topk_select s10 r3" row's kernel)."""
    return ([(T_, C, "lean") for T_, C in TOPK_S8_TEST_SHAPES] + [(T_, C, "default") for T_, C in TOPK_TIE_SHAPES]
            + [(4096, 65536, "default")])  # fmt: skip


def case_topk_s10_testbuild(row: Row, T_: int, C: int, which: str, quick: bool, dry: bool):
    """Builds (only) one kernel of the GPU tie tests (`topk_s10_test_configs`), with the tests' own call
    (`build(ts.program(T, C, k=512, ratio=2, cfg=..., target="sm90"))`): `--dry-run --only "topk_select s10build"
    -j 7` with the tests' TILELANG_CACHE_DIR ($PWD/.cache/tilelang, tests/conftest.py) fills the cache they read.
    The row's time is the build's: a second run of the same command reads them back (about a second each)."""
    from deepinfer.codegen.kernels import topk_select as ts

    cfg = topk_s8_test_config(T_, C) if which == "lean" else topk_tie_config(T_, C, which)
    row.kernel += f" {cfg.tag}"
    build(ts.program(T_, C, k=512, ratio=2, cfg=cfg, target="sm90"))
    row.check = "built only"


TOPK_S8_TEST_SHAPES = [(264, 16384), (64, 65536), (1, 65536)]  # tests/codegen/test_topk_select.py's gpu lean test


def topk_s8_test_config(T_: int, C: int):
    """The config of tests/codegen/test_topk_select.py's test_gpu_lean_compact_exact at one shape: the tie test's
    "fast" program with lean + compact + wscan + rsel, and eager where a row is one segment (session 9)."""
    from deepinfer.codegen.kernels import topk_select as ts

    cfg = dataclasses.replace(topk_tie_config(T_, C, "fast"), lean=True, compact=2048, wscan=True, rsel=True)
    return dataclasses.replace(cfg, eager=ts.n_segments(C, cfg) == 1 and C >= cfg.chunk)


def case_topk_s8_build(row: Row, T_: int, C: int, quick: bool, dry: bool):
    """Builds (only) the kernel of test_gpu_lean_compact_exact at one shape (`topk_s8_test_config`):
    `TILELANG_CACHE_DIR=$PWD/.cache/tilelang python3 benchmarks/kernels_h200.py --dry-run --only "topk_select
    s8build" -j 3` fills the cache the test reads (tests/conftest.py points TileLang there; without the variable the
    script fills ~/.tilelang and the test builds all again: the H200 calls of sessions 8 and 9 timed out so)."""
    from deepinfer.codegen.kernels import topk_select as ts

    cfg = topk_s8_test_config(T_, C)
    row.kernel += f" {cfg.tag}"
    build(ts.program(T_, C, k=IDX_TOPK, ratio=2, cfg=cfg, target="sm90"))
    row.check = "built only"


TOPK_TIE_SHAPES = [(512, 2048), (264, 16384), (64, 65536), (1, 65536)]
TOPK_TIE_PROGRAMS = ["default", "hist", "fused", "fast"]


def topk_tie_config(T_: int, C: int, program: str):
    """The top-k tie test's config (tests/codegen/test_gpu_new_families.py): the shape's default, or the histogram
    program forced (one CTA streaming a row; at T <= 64, 8192-column segments), fused (one barrier a chunk, __ffs
    output, 3 CTAs/SM at 256 threads) or fast (fused on raw float bits, idle warps skipping)."""
    from deepinfer.codegen.kernels import topk_select as ts

    cfg = ts.default_config(T_, C, IDX_TOPK)
    if program != "default":
        seg = 8192 if T_ <= 64 and C > 8192 else C
        cfg = ts.HistConfig(256, 16, seg, l2_ahead=2) if C >= 4096 else ts.HistConfig(128, 16, C)
        if program in ("fused", "fast"):
            cfg = dataclasses.replace(cfg, fused=2, ffs=True, min_blocks=3 if cfg.threads == 256 else 0,
                                      fast=program == "fast")  # fmt: skip
    return cfg


def case_topk_tie_build(row: Row, T_: int, C: int, program: str, quick: bool, dry: bool):
    """Builds (only) the tie test's kernel: `--dry-run --only "topk_select tiebuild" -j N` fills TileLang's cache
    in parallel, so that the test (which builds one kernel at a time) finds them built."""
    from deepinfer.codegen.kernels import topk_select as ts

    cfg = topk_tie_config(T_, C, program)
    row.kernel += f" {cfg.tag}"
    build(ts.program(T_, C, k=IDX_TOPK, ratio=2, cfg=cfg, target="sm90"))
    row.check = "built only"


def _indexer_cases(quick: bool):
    """Split indexer rows (scores, top-k, end to end) over T in {1, 64, 4096} x C in {2048, 16384, 65536}
    (scores of at most 1 GiB), the Triton top-k for comparison, and the fused kernel as before."""
    shapes = [(64, 65536), (4096, 2048)] if quick else [(t, c) for t in (1, 64, 4096) for c in (2048, 16384, 65536)]
    out = []
    for T_, C in shapes:
        if T_ * C * 4 > (1 << 32):
            continue
        shape = f"T{T_} C{C} k{IDX_TOPK}"
        out += [
            ("indexer_scores fp8", shape, lambda r, q, d, T_=T_, C=C: case_indexer_scores(r, T_, C, q, d)),
            ("indexer_topk_select", shape, lambda r, q, d, T_=T_, C=C: case_indexer_topk_select(r, T_, C, q, d)),
            ("indexer_split e2e", shape, lambda r, q, d, T_=T_, C=C: case_indexer_split(r, T_, C, q, d)),
        ]
        if not quick:
            out.append(("indexer_triton_topk", shape,  # (not under --only indexer_topk_select: JIT time)
                        lambda r, q, d, T_=T_, C=C: case_indexer_topk_select(r, T_, C, q, d, "triton")))  # fmt: skip
    if not quick:  # a few other configs at the decode / prefill shapes that matter, for the same-run comparison
        from deepinfer.codegen.kernels import indexer_topk as it
        from deepinfer.codegen.kernels import topk_select as ts

        # the decisive alternatives only (`--only indexer_topk_select -j 15` must stay under two minutes): at
        # decode the previous default (4 segments merged in cuts) and 16 merge_all segments next to the default
        # (8 merge_all segments); at prefill two CTAs per row next to one
        topk_sweep = [
            (64, 65536, ts.Config(256, 16, 16384, True, 4, 2048)),
            (64, 65536, ts.Config(512, 8, 4096, True, 4, 2048, merge_all=True)),
            (1, 65536, ts.Config(256, 16, 16384, True, 4, 2048)),
            (1, 65536, ts.Config(512, 8, 4096, True, 4, 2048, merge_all=True)),
            (4096, 65536, ts.Config(256, 16, 32768, True, 4, 2048)),
        ]
        for T_, C, cfg in topk_sweep:
            out.append(("indexer_topk_select sweep", f"T{T_} C{C} k{IDX_TOPK}",
                        lambda r, q, d, T_=T_, C=C, cfg=cfg: case_indexer_topk_select(r, T_, C, q, d, cfg=cfg)))
        for T_, C, cfg, first in _topk_hist_sweep():
            out.append((f"indexer_topk_select {'hist' if first else 'hsweep'}", f"T{T_} C{C} k{IDX_TOPK}",
                        lambda r, q, d, T_=T_, C=C, cfg=cfg: case_indexer_topk_select(r, T_, C, q, d, cfg=cfg)))
        for T_, C, cfg in _topk_final_rows():
            out.append(("indexer_topk_select final", f"T{T_} C{C} k{IDX_TOPK}",
                        lambda r, q, d, T_=T_, C=C, cfg=cfg: case_indexer_topk_select(r, T_, C, q, d, cfg=cfg)))
        for T_, C in TOPK_TIE_SHAPES:
            for prog in TOPK_TIE_PROGRAMS:
                out.append(("topk_select tiebuild", f"T{T_} C{C} {prog}",
                            lambda r, q, d, T_=T_, C=C, p=prog: case_topk_tie_build(r, T_, C, p, q, d)))
        for T_, C, cfg, var in _topk_r3_rows():
            out.append(("indexer_topk_select r3", f"T{T_} C{C} k{IDX_TOPK}",
                        lambda r, q, d, T_=T_, C=C, c=cfg, v=var: case_indexer_topk_select(r, T_, C, q, d, v, c)))
        for T_, C, cfg, var in _topk_s8_rows():
            out.append(("indexer_topk_select s8", f"T{T_} C{C} k{IDX_TOPK}",
                        lambda r, q, d, T_=T_, C=C, c=cfg, v=var: case_indexer_topk_select(r, T_, C, q, d, v, c)))
        for T_, C, cfg, var in _topk_s8b_rows():
            out.append(("indexer_topk_select s8b", f"T{T_} C{C} k{IDX_TOPK}",
                        lambda r, q, d, T_=T_, C=C, c=cfg, v=var: case_indexer_topk_select(r, T_, C, q, d, v, c)))
        for T_, C, cfg in _topk_split_rows():
            out.append(("indexer_topk_select split", f"T{T_} C{C} k{IDX_TOPK}",
                        lambda r, q, d, T_=T_, C=C, c=cfg: case_topk_tail_split(r, T_, C, c, q, d)))
        for T_, C, cfg, vis, split in _topk_s9_rows():
            run = lambda r, q, d, T_=T_, C=C, c=cfg, v=vis, sp=split: case_topk_s9(r, T_, C, c, v, sp, q, d)  # noqa: E731
            out.append(("indexer topk s9", f"T{T_} C{C} k{IDX_TOPK}" + (f" vis{vis}" if vis else ""), run))
        for eager in (False, True):  # call 4: the default (eager since 9418cc4) next to call 3's, once more
            cfg = dataclasses.replace(ts.default_config(4096, 65536, IDX_TOPK), eager=eager)
            out.append(("indexer topk default s9", f"T4096 C65536 k{IDX_TOPK}",
                        lambda r, q, d, c=cfg: case_topk_s9(r, 4096, 65536, c, None, False, q, d)))
        for group, rows in (("r1", _topk_s10_r1_rows()), ("r2", _topk_s10_r2_rows()), ("r3", _topk_s10_r3_rows())):
            for T_, C, cfg in rows:
                out.append((f"topk_select s10 {group}", f"T{T_} C{C} k{IDX_TOPK}",
                            lambda r, q, d, T_=T_, C=C, c=cfg: case_topk_s10(r, T_, C, c, q, d)))  # fmt: skip
        for T_, C, cfg in _topk_s11_r1_rows():
            case = case_topk_clock if cfg.clock else case_topk_s10
            out.append(("topk_select s11 r1", f"T{T_} C{C} k{IDX_TOPK}",
                        lambda r, q, d, T_=T_, C=C, c=cfg, f=case: f(r, T_, C, c, q, d)))  # fmt: skip
        groups = (("r1", _topk_s12_r1_rows()), ("r2", _topk_s12_r2_rows()), ("r3", _topk_s12_r3_rows()),
                  ("r4", _topk_s12_r4_rows()))  # fmt: skip
        for group, rows in groups:
            for T_, C, cfg in rows:
                case = case_topk_clock if cfg.clock else case_topk_s10
                out.append((f"topk_select s12 {group}", f"T{T_} C{C} k{IDX_TOPK}",
                            lambda r, q, d, T_=T_, C=C, c=cfg, f=case: f(r, T_, C, c, q, d)))  # fmt: skip
        for T_, C, which in topk_s10_test_configs():
            out.append(("topk_select s10build", f"T{T_} C{C} {which}",
                        lambda r, q, d, T_=T_, C=C, w=which: case_topk_s10_testbuild(r, T_, C, w, q, d)))  # fmt: skip
        for T_, C in TOPK_S8_TEST_SHAPES:
            out.append(("topk_select s8build", f"T{T_} C{C} lean+compact",
                        lambda r, q, d, T_=T_, C=C: case_topk_s8_build(r, T_, C, q, d)))
        for T_, C, cfg in _topk_r2_rows():
            out.append(("indexer_topk_select r2", f"T{T_} C{C} k{IDX_TOPK}",
                        lambda r, q, d, T_=T_, C=C, cfg=cfg: case_indexer_topk_select(r, T_, C, q, d, cfg=cfg)))
        for T_, C, cfg, var in _topk_diag_rows():
            out.append(("indexer_topk_select diag", f"T{T_} C{C} k{IDX_TOPK}",
                        lambda r, q, d, T_=T_, C=C, c=cfg, v=var: case_indexer_topk_select(r, T_, C, q, d, v, c)))
        scores_sweep = [  # longer key walks per CTA: the q tile load and the CTA start amortised over more tiles
            (4096, 65536, it.ScoresConfig(128, 8, 16, 256, 2)),
            (4096, 65536, it.ScoresConfig(128, 8, 32, 256, 2)),
            (4096, 65536, it.ScoresConfig(128, 8, 32, 256, 3)),
            (4096, 16384, it.ScoresConfig(128, 8, 32, 256, 2)),
            (64, 65536, it.ScoresConfig(128, 8, 16, 256, 2)),
            (64, 65536, it.ScoresConfig(128, 2, 8, 256, 2)),
        ]
        for T_, C, cfg in scores_sweep:
            out.append(("indexer_scores fp8 sweep", f"T{T_} C{C} k{IDX_TOPK}",
                        lambda r, q, d, T_=T_, C=C, cfg=cfg: case_indexer_scores(r, T_, C, q, d, cfg=cfg)))
    out += [
        ("indexer_topk fp8 (fused)", "T64 C65536 k512",
         lambda r, q, d: case_indexer_topk(r, 64, 65536, False, True, q, d)),
        ("indexer_topk fp8 prefill (fused)", "T4096 C2048 k512",
         lambda r, q, d: case_indexer_topk(r, 4096, 2048, True, True, q, d)),
    ]  # fmt: skip
    if not quick:
        out += [
            ("indexer_topk fp8 (fused)", "T1 C65536 k512",
             lambda r, q, d: case_indexer_topk(r, 1, 65536, False, True, q, d)),
            ("indexer_topk bf16 (fused)", "T64 C65536 k512",
             lambda r, q, d: case_indexer_topk(r, 64, 65536, False, False, q, d)),
        ]  # fmt: skip
    return out


def new_family_cases(quick: bool):
    """Rows for indexer_topk, compressor and engram (appended to `cases`)."""
    out = _indexer_cases(quick)
    for T_ in (4096,) if quick else (4096, 64):
        out += [
            ("compressor r2", f"{T_}x512", lambda r, q, d, T_=T_: case_compressor(r, T_, 2, q, d)),
            ("engram_embed", f"{T_}x24x256 fp8", lambda r, q, d, T_=T_: case_engram_embed(r, T_, q, d)),
            ("engram_gate", f"{T_}x4x{HIDDEN}", lambda r, q, d, T_=T_: case_engram_gate(r, T_, q, d)),
        ]  # fmt: skip
    if not quick:
        out.append(("compressor r1", "4096x512", lambda r, q, d: case_compressor(r, 4096, 1, q, d)))
    return out


def grouped_cases(quick: bool):
    """MoE grouped GEMM rows (issue 6): contiguous prefill at 4096/8192 tokens with and without the SwiGLU
    epilogue (fp8) plus W4A8; masked decode at 16/64/256 tokens, fp8 and W4A8 on the swap-AB program, the fused
    SwiGLU at 64 tokens, and the previous masked program as the same-run "before"."""
    mcfg = moe_grouped_gemm.sm90_config(4096 * TOPK, 2 * MOE_INTER)  # the loop: the fused SwiGLU runs on it
    pcfg = moe_grouped_gemm.sm90_config(4096 * TOPK, 2 * MOE_INTER, k_group=32)  # persistent (plain output)
    scfg = moe_grouped_gemm.swab_config(0, "fp4", contiguous=True)
    out = []
    for T_ in (4096, 8192) if not quick else (4096,):
        out += [
            (f"moe_grouped_gemm g32 {pcfg.tag}", f"EP8 {T_} tok",
             lambda r, q, d, T_=T_: case_grouped_gemm(r, T_, 48, q, d, pcfg)),
            (f"moe_grouped_gemm +swiglu g32 {mcfg.tag}", f"EP8 {T_} tok",
             lambda r, q, d, T_=T_: case_grouped_gemm(r, T_, 48, q, d, swiglu=True)),
        ]  # fmt: skip
    out += [
        (f"moe_grouped_gemm w4a8 {scfg.tag}", "EP8 4096 tok",
         lambda r, q, d: case_grouped_gemm(r, 4096, 48, q, d, fmt="fp4")),
        (f"moe_grouped_gemm w4a8 +swiglu {scfg.tag}", "EP8 4096 tok",
         lambda r, q, d: case_grouped_gemm(r, 4096, 48, q, d, fmt="fp4", swiglu=True)),
    ]  # fmt: skip
    if not quick:
        old = fp8_gemm.default_config(32)  # the plain single-warpgroup loop, for the same-run comparison
        out.append((f"moe_grouped_gemm g32 {old.tag} (old loop)", "EP8 4096 tok",
                    lambda r, q, d: case_grouped_gemm(r, 4096, 48, q, d, old)))  # fmt: skip
    for T_ in (16, 64, 256):
        for fmt in ("fp8", "fp4"):
            name = "w4a8" if fmt == "fp4" else "g32"
            run = functools.partial(case_grouped_gemm_masked, tokens=T_, E=48, max_rows=64, fmt=fmt)
            out.append((f"moe_grouped_gemm masked {name} swab", f"EP8 decode {T_} tok",
                        lambda r, q, d, run=run: run(r, quick=q, dry=d)))  # fmt: skip
    for fmt in ("fp8", "fp4"):
        name = "w4a8" if fmt == "fp4" else "g32"
        run = functools.partial(case_grouped_gemm_masked, tokens=64, E=48, max_rows=64, fmt=fmt, swiglu=True)
        out.append((f"moe_grouped_gemm masked {name} swab +swiglu", "EP8 decode 64 tok",
                    lambda r, q, d, run=run: run(r, quick=q, dry=d)))  # fmt: skip
    if not quick:  # a few swap-AB configs at the smallest batch (what the tuner would search)
        # 16 tokens: 16 active experts x 72 N tiles = 1152 CTAs on 528 slots (4/SM) = 2.2 waves; 5-6 CTAs per SM
        # (fewer stages: 40 registers at 6, ptxas cannot go to 7) make it 1.5-1.75 waves
        for fmt, cfg in (("fp8", moe_grouped_gemm.swab_config(1)),  # the default, for the same-run comparison
                         ("fp8", moe_grouped_gemm.SwabConfig(64, 16, 128, 6, 4)),
                         ("fp8", moe_grouped_gemm.SwabConfig(64, 16, 256, 4, 3)),
                         ("fp8", moe_grouped_gemm.SwabConfig(64, 16, 128, 4, 5)),
                         ("fp8", moe_grouped_gemm.SwabConfig(64, 16, 128, 3, 6)),
                         ("fp8", moe_grouped_gemm.SwabConfig(64, 16, 256, 2, 5)),
                         # one wave: 192 weight rows (3 consumer warpgroups) -> 16 x 24 = 384 CTAs on 396 slots
                         ("fp8", moe_grouped_gemm.SwabConfig(192, 16, 128, 2, 3)),
                         ("fp8", moe_grouped_gemm.SwabConfig(192, 16, 64, 4, 3)),
                         ("fp4", moe_grouped_gemm.SwabConfig(64, 16, 128, 6, 4)),
                         ("fp4", moe_grouped_gemm.SwabConfig(64, 16, 256, 5, 3))):  # fmt: skip
            run = functools.partial(case_grouped_gemm_masked, tokens=16, E=48, max_rows=64, fmt=fmt, cfg=cfg)
            name = "w4a8" if fmt == "fp4" else "g32"
            out.append((f"moe_grouped_gemm masked {name} swab (sweep)", "EP8 decode 16 tok",
                        lambda r, q, d, run=run: run(r, quick=q, dry=d)))  # fmt: skip
    dcfg = moe_grouped_gemm.sm90_config(64 * TOPK, 2 * MOE_INTER, masked=True)
    for T_ in (64, 16):
        out.append((f"moe_grouped_gemm masked g32 {dcfg.tag} (old)", f"EP8 decode {T_} tok",
                    lambda r, q, d, T_=T_: case_grouped_gemm_masked(r, T_, 48, 64, q, d, old=True)))  # fmt: skip
    if not quick:
        out += moe_decode_real_cases()
    return out


V4_FLASH_EXPERT = (2 * 2048, 4096)  # V4-Flash routed expert w1|w3: N = 2 x moe_intermediate 2048, K = hidden 4096


def grouped_ws_configs(g: int) -> dict:
    """Persistent warp-specialised grouped configs (fp8_gemm._program_sm90_ws with experts), safest first: the
    128x256 formulations that ran on the H200 as dense GEMMs, then the 128x128 ones (their g32 TMA alignment
    fault was fixed in 7b57992)."""
    ws = functools.partial(fp8_gemm.Config, persistent=True)
    return {
        "ws 128x256 pp": ws(128, 256, 128, 3, 256, False, True, 2, pingpong=True),
        "ws 128x256": ws(128, 256, 128, 3, 256, False, True, 2),
        # 4 stages: the epilogue stores from registers, so the 64 KiB smem output tile becomes a 4th stage
        "ws 128x256 pp s4d": ws(128, 256, 128, 4, 256, False, True, 2, pingpong=True, direct_store=True),
        "ws 128x256 s4d": ws(128, 256, 128, 4, 256, False, True, 2, direct_store=True),
        # CTA pairs on N-adjacent tiles of one M tile (so one expert), sharing the A tile by TMA multicast
        "ws 128x256 pp c2n": ws(128, 256, 128, 3, 256, False, True, 2, pingpong=True, cluster=2, pair_n=True),
        "ws 128x256 c2n": ws(128, 256, 128, 3, 256, False, True, 2, cluster=2, pair_n=True),
        "ws 128x128 ovl": ws(128, 128, 128, 5, 256, True, True, 1),  # (plain 128x128: 1-4 points below it)
    }


def grouped_ws_cases(quick: bool):
    """Contiguous-layout MoE prefill on the persistent warp-specialised program (issue 6: >= 65% of the FP8 peak),
    for V4-Flash's format (FP8 experts, 128-groups: 32 local experts of 4096 -> 2x2048) and V4.1's on SM90 (FP4
    experts converted to FP8 32x32 blocks by convert_fp4_to_fp8, 32-group activations: 48 experts of 5120 ->
    2x2304), each next to the non-persistent loop (sm90_config) measured in the same run. Rows are named
    "moe_grouped_gemm ws ..." (select them with --only "grouped_gemm ws")."""
    out = []
    for g, E, dims in ((128, 32, V4_FLASH_EXPERT), (32, 48, (2 * MOE_INTER, HIDDEN))):
        for T_ in (4096,) if quick else (4096, 8192):
            loop = moe_grouped_gemm.sm90_config(T_ * TOPK, dims[0])
            named = [("loop (before)", loop)] + list(grouped_ws_configs(g).items())
            for name, cfg in named:
                run = functools.partial(case_grouped_gemm, tokens=T_, E=E, cfg=cfg, g=g, dims=dims)
                out.append((f"moe_grouped_gemm ws g{g} {name} {cfg.tag}", f"EP8 {T_} tok",
                            lambda r, q, d, run=run: run(r, quick=q, dry=d)))  # fmt: skip
    # V4.1's FP4 experts dequantised inside the kernel (W4A8 swap-AB, contiguous layout), same run
    scfg = moe_grouped_gemm.swab_config(0, "fp4", contiguous=True)
    out.append((f"moe_grouped_gemm ws g32 w4a8 in-kernel FP4 {scfg.tag}", "EP8 4096 tok",
                lambda r, q, d: case_grouped_gemm(r, 4096, 48, q, d, fmt="fp4")))  # fmt: skip
    # the newest variants last: registers -> global epilogue, then the N-adjacent CTA pairs (cluster barriers)
    return sorted(out, key=lambda c: (" c2n" in c[0], " s4d" in c[0]))


# V4.1 MoE prefill in the V4 format (issue 8): FP4 experts converted to FP8 128x128 blocks (convert_fp4_to_fp8
# block=128, exactness checked), activations per 1x32 (exact: the model's groups) or per 1x128 (the labelled
# prefill_act_group=128 option), next to today's 32x32 blocks with 1x32 activations. --only "grouped_gemm v41g128".
V41_EXPERT_GEMMS = {"w13": (2 * MOE_INTER, HIDDEN), "w2": (HIDDEN, MOE_INTER)}


@functools.lru_cache(maxsize=2)
def _v41_converted_experts(E: int, N: int, K: int, wb: int):
    """Random FP4 experts in the checkpoint format (_grouped_fp4_weights) through the convert pass's checked
    conversion at weight block wb: (B [E, N, K] e4m3, SB [E, N/wb, K/wb] fp32). Raises if a value is not exact."""
    from deepinfer.ir import dtypes as dt
    from deepinfer.passes.convert_fp4_to_fp8 import fp4_to_fp8_checked

    packed, scale = _grouped_fp4_weights(E, N, K)
    conv = [fp4_to_fp8_checked(packed[e], scale[e].view(torch.float8_e8m0fnu), wb, f"expert {e}") for e in range(E)]
    return torch.stack([c for c, _ in conv]), torch.stack([dt.e8m0_to_float(s) for _, s in conv])


def _grouped_f64(a, sa, ag: int, b, sb, wb: int, row_expert: torch.Tensor) -> torch.Tensor:
    """Float64 oracle on the GPU: each row's operands dequantised exactly, one matmul per expert (rows of
    expert -1 stay zero)."""
    from deepinfer.codegen.kernels._common import expand_scales

    a64 = a.double() * expand_scales(sa.double(), 1, ag, a.shape)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    for e in torch.unique(row_expert[row_expert >= 0]).tolist():
        sel = row_expert == e
        out[sel] = a64[sel] @ (b[e].double() * expand_scales(sb[e].double(), wb, wb, b[e].shape)).T
    return out


def _norm_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


def case_grouped_v41(row: Row, tokens: int, E: int, which: str, wb: int, ag: int, quick: bool, dry: bool):
    """EP8 slice of V4.1 prefill (tokens x top-6 over E local experts) on the persistent program the adapter takes
    (moe_grouped_gemm.sm90_config with k_group = ag): expert GEMM `which` (w13: N 2x2304, K 5120; w2: N 5120, K
    2304) with FP4 experts converted to FP8 wb x wb blocks, activations quantised per 1 x ag. Check: the kernel vs
    the float64 oracle on its own operands (max rel 2e-2). For ag > 32 the check column adds the format's
    deviation: |C - C_exact| / |C_exact| (norm-wise) where C_exact is the float64 product with the same x
    quantised per 1x32 (the model's numbers), next to the 1x32 format's own error vs the unquantised x."""
    N, K = V41_EXPERT_GEMMS[which]
    cfg = moe_grouped_gemm.sm90_config(tokens * TOPK, N, k_group=ag)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, E, (tokens * TOPK,), generator=gen)
    rows, tiles = moe_grouped_gemm.contiguous_layout(ids, E, cfg.block_m)
    M, R = rows.numel(), tokens * TOPK
    row.shape = f"{R}r/{M}x{N}x{K} E{E}"
    func = moe_grouped_gemm.program(M, N, K, E, act_group=ag, weight_block=wb, target="sm90", cfg=cfg)
    row.bytes_, row.flops = moe_grouped_gemm.roofline(R, N, K, E, ag, wb)
    kernel = build(func)
    if dry:
        return
    b, sb = _v41_converted_experts(E, N, K, wb)
    rows, tiles = rows.cuda(), tiles.cuda()
    real = rows >= 0
    x = torch.where(real[:, None], torch.randn(R, K, device="cuda")[rows.clamp_min(0)], 0.0)
    a, sa = quant_fp8_groups(x, ag)
    sa_t = sa.T.contiguous()
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    kernel(a, sa_t, b, sb, tiles, c)
    row_expert = torch.where(real, tiles.repeat_interleave(cfg.block_m), -1)
    want = _grouped_f64(a, sa, ag, b, sb, wb, row_expert)
    row.check = expect(rel_err(c[real], want[real]), 2e-2)
    if ag > 32:
        a32, sa32 = quant_fp8_groups(x, 32)
        exact = _grouped_f64(a32, sa32, 32, b, sb, wb, row_expert)[real]
        full = _grouped_f64(x, torch.ones(M, 1, device="cuda"), K, b, sb, wb, row_expert)[real]
        row.check += f" dev {_norm_rel(c[real], exact):.1e} (g32 vs fp32 {_norm_rel(exact, full):.1e})"
        del exact, full
    del want
    row.ms = bench(lambda: kernel(a, sa_t, b, sb, tiles, c), quick)


def grouped_v41g128_cases(quick: bool):
    """V4.1 prefill expert GEMMs: 32x32 weights + 1x32 activations (today), 128x128 weights + 1x32 (exact, the
    default of the converted experts), 128x128 + 1x128 (the prefill_act_group=128 option)."""
    out = []
    for T_ in (4096,) if quick else (4096, 8192):
        for which in V41_EXPERT_GEMMS:
            for wb, ag in ((32, 32), (128, 32), (128, 128)):
                run = functools.partial(case_grouped_v41, tokens=T_, E=48, which=which, wb=wb, ag=ag)
                out.append((f"moe_grouped_gemm v41g128 {which} w{wb}a{ag}", f"EP8 {T_} tok",
                            lambda r, q, d, run=run: run(r, quick=q, dry=d)))  # fmt: skip
    return out


# Half tiles (issue 8, session 8): V4.1's prefill MoE on ONE GPU (384 experts, 8192 tokens x top-6: ~128 pairs an
# expert, so ~a third of the 128-row tiles' rows are padding). The layout flags an expert's last tile with <= 64 pairs
# and the persistent grouped program runs it as 64 rows (fp8_gemm._program_sm90_ws half_tiles; the runtime's switch
# DEEPINFER_MOE_HALF_TILES=1). --only "moe halftiles": the layout, the MoE input's fake_quant_fp8 (one launch vs the
# path before), then each expert GEMM in the g128 option's format (w128a128) and the exact one (w128a32), half tiles
# and 64-row tiles throughout ("bm64") each against the default program in the same row (time = the variant, "vs
# eager" = the default's time over it, % of the FP8 peak counting the real rows only).
HALF_TILES_T = 8192


@functools.lru_cache(maxsize=1)
def _halftiles_layout():
    """(idx [T, 6] on the GPU: 6 distinct experts a token, uniform -- the spread of a trained router's balanced
    load; bucketed tile count as the adapter's persistent path uses it: the bound, no host read)."""
    gen = torch.Generator().manual_seed(8)
    idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(HALF_TILES_T)]).int().cuda()
    from deepinfer.runtime import kernel_adapters as ka

    n_tiles = ka._tile_bucket(moe_routing.layout_tile_bound(idx.numel(), EXPERTS, 128))
    return idx, n_tiles


@functools.lru_cache(maxsize=2)  # both expert stacks: 13.6 GB
def _halftiles_weights(which: str):
    """Random e4m3 experts [384, N, K] (codes with bit 6 clear: no NaN) and power-of-two 128x128 block scales."""
    N, K = V41_EXPERT_GEMMS[which]
    b = torch.randint(0, 256, (EXPERTS, N, K), dtype=torch.uint8, device="cuda").bitwise_and_(0xBF)
    b = b.view(torch.float8_e4m3fn)
    sb = torch.exp2(torch.randint(-9, -5, (EXPERTS, N // 128, K // 128), device="cuda").float())
    return b, sb


def case_moe_halftiles_layout(row: Row, quick: bool, dry: bool):
    """triton_contiguous_layout with half_tiles vs without (time = with; "vs eager" = without over with): the tables
    equal up to the flags; the check column gives how many tiles are half tiles and the real share of the rows the
    GEMMs compute (128 a full tile, 64 a half tile) before and after."""
    row.bytes_ = float(HALF_TILES_T * TOPK * 8)
    if dry:
        return
    idx, n_tiles = _halftiles_layout()
    plain = moe_routing.triton_contiguous_layout(idx, EXPERTS, 128, n_tiles)
    half = moe_routing.triton_contiguous_layout(idx, EXPERTS, 128, n_tiles, half_tiles=True)
    if not torch.equal(moe_grouped_gemm.tile_experts(half[1]), plain[1]) or not torch.equal(half[0], plain[0]):
        raise AssertionError("the half-tile layout differs from the plain one beyond the flags")
    tiles = int(plain[3])
    n_half = int((half[1] >= fp8_gemm.HALF_TILE_FLAG).sum())
    pairs = idx.numel()
    row.check = (f"{n_half}/{tiles} half tiles; real rows {100 * pairs / (128 * tiles):.1f}% -> "
                 f"{100 * pairs / (128 * tiles - 64 * n_half):.1f}%")  # fmt: skip
    row.ms = bench_device(lambda: moe_routing.triton_contiguous_layout(idx, EXPERTS, 128, n_tiles, half_tiles=True),
                          quick)  # fmt: skip
    row.eager_ms = bench_device(lambda: moe_routing.triton_contiguous_layout(idx, EXPERTS, 128, n_tiles), quick)


HALF_TILES_BM64 = fp8_gemm.Config(64, 256, 128, 4, 128, False, True, 2, persistent=True)  # one consumer warpgroup


def _halftiles_spec(ag: int, n: int, variant: str):
    """(block_m, config, half_tiles, M) of one variant: "default" (the adapter's program, 128-row tiles), "half" (the
    same with half tiles), "bm64" (64-row tiles throughout: one consumer warpgroup, no ping-pong)."""
    from deepinfer.runtime import kernel_adapters as ka

    bm = 64 if variant == "bm64" else 128
    cfg = HALF_TILES_BM64 if variant == "bm64" else moe_grouped_gemm.sm90_config(0, n, k_group=ag)
    m = ka._tile_bucket(moe_routing.layout_tile_bound(HALF_TILES_T * TOPK, EXPERTS, bm)) * bm
    return bm, cfg, variant == "half", m


def _halftiles_operands(xq, xs, idx, bm: int, m: int, half: bool):
    """The layout (Triton, as the adapter makes it) and A / its MN-major scales with every pair's codes at its row
    (other rows: zero codes, the floor's scale)."""
    slot, tiles, _, _ = moe_routing.triton_contiguous_layout(idx, EXPERTS, bm, m // bm, half_tiles=half)
    a = torch.zeros(m, xq.shape[1], dtype=torch.uint8, device="cuda")
    a[slot.long()] = xq.view(torch.uint8)
    sa = torch.full((m, xs.shape[1]), 2.0**-22, device="cuda")
    sa[slot.long()] = xs
    return slot.long(), tiles, a.view(torch.float8_e4m3fn), sa.T.contiguous()


def case_moe_halftiles_gemm(row: Row, which: str, ag: int, variant: str, quick: bool, dry: bool):
    """One expert GEMM of the one-GPU prefill (128x128 weight blocks, activations per 1 x ag): `variant` ("half":
    half tiles; "bm64": 64-row tiles throughout) against the adapter's default program (time = the variant, "vs
    eager" = the default's time over it, % limit counts the real rows). The same pairs' codes in each layout. Check:
    every pair's output row equal bit for bit to the default's, and experts 0-3 against the float64 oracle."""
    N, K = V41_EXPERT_GEMMS[which]
    R = HALF_TILES_T * TOPK
    specs = {v: _halftiles_spec(ag, N, v) for v in (variant, "default")}
    row.shape = f"{R}r/{specs[variant][3]}x{N}x{K} E{EXPERTS}"
    row.bytes_, row.flops = moe_grouped_gemm.roofline(R, N, K, EXPERTS, ag, 128)
    kernels = {v: build(moe_grouped_gemm.program(m, N, K, EXPERTS, act_group=ag, weight_block=128, target="sm90",
                                                  cfg=cfg, half_tiles=half)) for v, (_, cfg, half, m) in specs.items()}
    if dry:
        return
    idx, _ = _halftiles_layout()
    b, sb = _halftiles_weights(which)
    xq, xs = quant_fp8_groups(torch.randn(R, K, device="cuda"), ag)  # pair p's codes (row p of the flat ids)
    runs, by_pair = {}, {}
    for v, (bm, _, half, m) in specs.items():
        slot, tiles, a, sa_t = _halftiles_operands(xq, xs, idx, bm, m, half)
        c = torch.full((m, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        kernels[v](a, sa_t, b, sb, tiles, c)
        torch.cuda.synchronize()
        by_pair[v] = c[slot]
        runs[v] = functools.partial(kernels[v], a, sa_t, b, sb, tiles, c)
    if not torch.equal(by_pair[variant], by_pair["default"]):
        raise AssertionError(f"{variant}: the pairs' rows differ from the default program's")
    flat = idx.reshape(-1).long()
    keep = flat < 4  # the pairs of experts 0-3 against the float64 oracle
    want = _grouped_f64(xq[keep], xs[keep], ag, b, sb, 128, flat[keep])
    err = expect(rel_err(by_pair[variant][keep], want), 2e-2)
    del want, by_pair
    row.ms = bench(runs[variant], quick)
    row.eager_ms = bench(runs["default"], quick)
    tflops = [row.flops / (ms * 1e-3) / 1e12 for ms in (row.ms, row.eager_ms)]  # real rows' flops (the weights'
    #                               bytes, 384 experts', make the roofline HBM-bound here: % limit is of that)
    row.check = (f"{err}; every pair's row = the default's; {tflops[0]:.0f} TFLOPS; default {row.eager_ms * 1e3:.1f} us"
                 f" {tflops[1]:.0f} TFLOPS")  # fmt: skip


def case_fake_quant(row: Row, group: int, quick: bool, dry: bool):
    """fake_quant_fp8 of the prefill MoE's fp32 input [8192, 5120] per `group`: act_quant.triton_fake_quant (one
    launch; FakeQuantAdapter's CUDA path since session 8) vs the path before it (quant_rows' kernel + codes -> fp32
    times the scales in torch), both timed as CUDA-graph replays; bit for bit against the op's torch formula."""
    from deepinfer.codegen.kernels import act_quant
    from deepinfer.ir.ops.quant import fake_quant_fp8
    from deepinfer.runtime import kernel_adapters as ka

    t, d = HALF_TILES_T, HIDDEN
    row.bytes_ = act_quant.fake_quant_roofline(t, d)
    if dry:
        return
    x = torch.randn(t, d, device="cuda") * torch.logspace(-8, 8, d, base=2.0, device="cuda")

    def before():
        q, s_t = ka.quant_rows(x, group, t)
        return (q.float().unflatten(-1, (-1, group)) * s_t.T.unsqueeze(-1)).flatten(-2)

    y = act_quant.triton_fake_quant(x, group)
    if not torch.equal(y, fake_quant_fp8(x, group)) or not torch.equal(before(), y):
        raise AssertionError("fake quant: differs from the op's formula")
    row.check = "exact"
    row.ms = bench_device(lambda: act_quant.triton_fake_quant(x, group), quick)
    row.eager_ms = bench_device(before, quick)


def moe_halftiles_cases():
    out = [("moe halftiles layout", f"T{HALF_TILES_T} k{TOPK} E{EXPERTS}", case_moe_halftiles_layout)]
    out += [(f"moe halftiles fake_quant g{g}", f"{HALF_TILES_T}x{HIDDEN} f32",
             lambda r, q, d, g=g: case_fake_quant(r, g, q, d)) for g in (32, 128)]  # fmt: skip
    for variant in ("half", "bm64"):  # bm64 last: its program is new on the GPU (a fault poisons the later rows)
        for which in V41_EXPERT_GEMMS:
            for ag in (128, 32):
                out.append((f"moe halftiles {which} w128a{ag}{' bm64' if variant == 'bm64' else ''}",
                            f"one GPU {HALF_TILES_T} tok",
                            lambda r, q, d, w=which, ag=ag, v=variant: case_moe_halftiles_gemm(r, w, ag, v, q, d)))
    return out


# grouped_out_proj at V4.1 prefill (session 7): wo_a (8 groups of [T, 4096] x [1024, 4096]^T, FP8 32x32 blocks, 1x32
# activations) then wo_b [5120, 8192]. The node as runtime/kernel_adapters.GroupedOutProjAdapter runs it now (wo_a on
# the contiguous persistent grouped program) vs the swap-AB program it ran at every T before ("vs eager" column =
# the speed-up over it), and wo_a alone on each candidate. --only "grouped_out_proj prefill".
OUT_PROJ_DIMS = {"g": 8, "k": 4096, "r": 1024, "n": HIDDEN}


def _out_proj_adapter(contiguous: bool):
    from deepinfer.runtime import kernel_adapters as ka

    a = ka.GroupedOutProjAdapter()
    a.contiguous_min_t = 0 if contiguous else 1 << 30
    return a


def _out_proj_call(T_: int, device: str):
    """A grouped_out_proj call at V4.1 dims: x as the graph hands it over (the attention's FP8 output dequantised per
    32), random FP8 32x32-block weights with e8m0 scales. device "stub": expanded scalars (plans and keys only)."""
    from deepinfer.ir import dtypes as dt
    from deepinfer.runtime import kernel_adapters as ka

    g, k, r, n = OUT_PROJ_DIMS.values()
    attrs = {"block_a": 32, "block_b": 32, "mid_group": 32}
    names, params = ["x", "wa", "wb", "sa", "sb"], [False, True, True, True, True]
    if device == "stub":
        f8, e8 = torch.float8_e4m3fn, torch.float8_e8m0fnu
        args = [torch.zeros(()).expand(T_, g, k), torch.zeros((), dtype=f8).expand(g * r, k),
                torch.zeros((), dtype=f8).expand(n, g * r), torch.zeros((), dtype=e8).expand(g * r // 32, k // 32),
                torch.zeros((), dtype=e8).expand(n // 32, g * r // 32)]  # fmt: skip
        return ka.Call("grouped_out_proj", attrs, args, names, params, {}, {})
    q, s = quant_fp8_groups(torch.randn(T_, g * k, device=device) * 3, 32)
    x = (q.float().view(T_, -1, 32) * s.unsqueeze(-1)).view(T_, g, k)  # exact: power-of-two scales
    wa, sa = quant_fp8_blocks(torch.randn(g * r, k, device=device) / k**0.5, 32)
    wb, sb = quant_fp8_blocks(torch.randn(n, g * r, device=device) / (g * r) ** 0.5, 32)
    args = [x, wa, wb, dt.float_to_e8m0(sa), dt.float_to_e8m0(sb)]
    return ka.Call("grouped_out_proj", attrs, args, names, params, {}, {})


def _out_proj_keys(T_: int, contiguous: bool) -> list:
    with _emulate_plan():
        return _out_proj_adapter(contiguous).keys(_out_proj_call(T_, "stub"))


def case_out_proj_node(row: Row, T_: int, quick: bool, dry: bool):
    """The whole node (x quantisation, wo_a, the intermediate's quantisation, wo_b) through the adapter; checked
    against the op's reference (max rel 5e-2, the CPU tests' bound: the bf16 intermediate re-quantised) and against
    the swap-AB path (the same numbers up to wo_a's fp32 summation order: printed)."""
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import kernel_adapters as ka

    g, k, r, n = OUT_PROJ_DIMS.values()
    kern = {c: [build(ka._factory(key)) for key in _out_proj_keys(T_, c)] for c in (True, False)}
    row.flops = 2.0 * T_ * (g * r * k + n * g * r)
    row.bytes_ = 4.0 * T_ * g * k + g * r * k + n * g * r + 4.0 * T_ * n
    if dry:
        return
    call = _out_proj_call(T_, "cuda")
    # one Call per path: a call memoises its plan (and the runner's weight preparations)
    call_old = ka.Call(call.op, call.attrs, call.args, call.names, call.is_param, {}, {})
    new, old = _out_proj_adapter(True), _out_proj_adapter(False)
    y, y_old = new.run(call, kern[True])[0], old.run(call_old, kern[False])[0]
    ref = get_op("grouped_out_proj").run(call.args, call.attrs)[0]
    row.check = f"{expect(rel_err(y, ref), 5e-2)} (swab {rel_err(y_old, ref):.1e}, new vs swab {rel_err(y, y_old):.1e})"
    del ref
    row.eager_ms = bench(lambda: old.run(call_old, kern[False]), quick)
    row.ms = bench(lambda: new.run(call, kern[True]), quick)


def _out_proj_wo_a_operands(T_: int, rows: int):
    """wo_a's operands as the adapter lays them out: x's groups chunk-major (rows per group), the [G, R, K] stack
    with fp32 block scales; and the float64 oracle of the G products (real rows)."""
    from deepinfer.runtime import kernel_adapters as ka

    g, k, r, _ = OUT_PROJ_DIMS.values()
    call = _out_proj_call(T_, "cuda")
    x, wa, _, sa, _ = call.args
    a, sa_t = ka.quant_rows(x.reshape(T_, g * k), 32, rows, chunks=g)
    w, s = wa.view(g, r, k), ka.scales_f32(sa).view(g, r // 32, -1)
    real = (torch.arange(g * rows, device="cuda") % rows) < T_
    row_group = torch.where(real, torch.arange(g * rows, device="cuda") // rows, -1)
    want = _grouped_f64(a, sa_t.T, 32, w, s, 32, row_group)
    return a, sa_t, w, s, real, want


def case_out_proj_wo_a(row: Row, T_: int, program: str, quick: bool, dry: bool):
    """wo_a alone at V4.1 prefill: "grouped" (the adapter's contiguous persistent program), "grouped 128x128o" (the
    persistent 128x128 tile with async wgmma overlap, no CTA pairs), "dense x8" (G launches of fp8_gemm's sm90
    program on each group's rows), "swab" (the swap-AB program of before). Check: the float64 oracle, max rel 2e-2."""
    from deepinfer.runtime import kernel_adapters as ka

    g, k, r, _ = OUT_PROJ_DIMS.values()
    row.bytes_, row.flops = moe_grouped_gemm.roofline(g * T_, r, k, g, 32, 32)
    if program == "dense x8":
        cfg = fp8_gemm.sm90_config(T_, r, 32)
        dense = build(fp8_gemm.program(T_, r, k, act_group=32, weight_block=32, target="sm90", cfg=cfg))
        rows = T_
    else:
        keys = _out_proj_keys(T_, program != "swab")
        key = keys[0]
        if program == "grouped 128x128o":
            alt = fp8_gemm.Config(128, 128, 128, 5, 256, True, True, 1, persistent=True)
            key = dataclasses.replace(key, kwargs=tuple((n, tuple(sorted(vars(alt).items())) if n == "cfg" else v)
                                                        for n, v in key.kwargs))  # fmt: skip
        kernel = build(ka._factory(key))
        rows = key.args[0] // g
    row.shape += f" ({rows} rows/group)"
    if dry:
        return
    a, sa_t, w, s, real, want = _out_proj_wo_a_operands(T_, rows)
    c = torch.empty(g * rows, r, dtype=torch.bfloat16, device="cuda")
    if program == "dense x8":
        parts = [(a[j * rows : (j + 1) * rows], sa_t[:, j * rows : (j + 1) * rows].contiguous(), w[j],
                  s[j].contiguous(), c[j * rows : (j + 1) * rows]) for j in range(g)]  # fmt: skip

        def fn():
            for p in parts:
                dense(*p)
    else:
        meta = torch.full((g,), T_, dtype=torch.int32, device="cuda")  # swab: Counts
        if program != "swab":
            meta = ka._group_tiles(ka.Call("x", {}, [], [], [], {}, {}), g, T_, rows, 128, "cuda")

        def fn():
            kernel(a, sa_t, w, s, meta, c)

    fn()
    row.check = expect(rel_err(c[real], want[real]), 2e-2)
    del want
    row.ms = bench(fn, quick)


def grouped_out_proj_prefill_cases(quick: bool):
    """The node at T 256 / 512 / 1024 (around contiguous_min_t, where the contiguous path starts) and 4096 / 8192
    (prefill buckets); wo_a alone on each candidate at 4096 / 8192."""
    out = []
    shape = "T{} G8 K4096 R1024"
    for T_ in (8192,) if quick else (256, 512, 1024, 4096, 8192):
        out.append(("grouped_out_proj prefill node", shape.format(T_) + " N5120",
                    lambda r, q, d, T_=T_: case_out_proj_node(r, T_, q, d)))  # fmt: skip
    for T_ in (8192,) if quick else (4096, 8192):
        for program in ("grouped", "grouped 128x128o", "dense x8", "swab"):
            out.append((f"grouped_out_proj prefill wo_a {program}", shape.format(T_),
                        lambda r, q, d, T_=T_, p=program: case_out_proj_wo_a(r, T_, p, q, d)))  # fmt: skip
    return out


# linear_fp8 at a prefill chunk just above a power of two (session 7): the adapter's SkipTiles form (the grouped
# persistent program as one expert, the bucket's tiles past M skipped) vs fp8_gemm over the whole bucket
# (DEEPINFER_DENSE_SKIP_TILES=0: the "vs eager" column = the speed-up over it). --only "dense skip tiles".
def _skip_tiles_call(M: int, N: int, K: int, device: str):
    from deepinfer.ir import dtypes as dt
    from deepinfer.runtime import kernel_adapters as ka

    attrs, names, params = {"block": 32, "act_group": 32}, ["x", "w", "s"], [False, True, True]
    if device == "stub":
        args = [torch.zeros(()).expand(M, K), torch.zeros((), dtype=torch.float8_e4m3fn).expand(N, K),
                torch.zeros((), dtype=torch.float8_e8m0fnu).expand(N // 32, K // 32)]  # fmt: skip
    else:
        w, sw = quant_fp8_blocks(torch.randn(N, K, device=device) / K**0.5, 32)
        args = [torch.randn(M, K, device=device), w, dt.float_to_e8m0(sw)]
    return ka.Call("linear_fp8", attrs, args, names, params, {}, {})


class _skip_tiles_env:
    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        from deepinfer.runtime import kernel_adapters as ka

        self.saved = os.environ.get(ka.SKIP_TILES_ENV)
        os.environ[ka.SKIP_TILES_ENV] = "1" if self.on else "0"

    def __exit__(self, *exc):
        from deepinfer.runtime import kernel_adapters as ka

        os.environ.pop(ka.SKIP_TILES_ENV)
        if self.saved is not None:
            os.environ[ka.SKIP_TILES_ENV] = self.saved


def case_skip_tiles(row: Row, M: int, N: int, K: int, quick: bool, dry: bool):
    """One linear_fp8 through LinearFP8Adapter with and without SkipTiles; checked against the op's reference (max
    rel 2e-2) and each other. Flops and bytes count the M real rows."""
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import kernel_adapters as ka

    adapter = ka.adapter_for("fp8_gemm", "linear_fp8")
    kern = {}
    for on in (True, False):
        with _skip_tiles_env(on), _emulate_plan():
            keys = adapter.keys(_skip_tiles_call(M, N, K, "stub"))
        assert (keys[0].family == "moe_grouped_gemm") == on, keys[0]
        kern[on] = [build(ka._factory(k)) for k in keys]
    row.flops, row.bytes_ = 2.0 * M * N * K, M * K * 4.0 + N * K + M * N * 2.0
    if dry:
        return
    call = _skip_tiles_call(M, N, K, "cuda")
    calls = {on: ka.Call(call.op, call.attrs, call.args, call.names, call.is_param, {}, {}) for on in (True, False)}
    ys = {}
    for on in (True, False):
        with _skip_tiles_env(on):
            ys[on] = adapter.run(calls[on], kern[on])[0]
    ref = get_op("linear_fp8").run(call.args, call.attrs)[0]
    row.check = f"{expect(rel_err(ys[True], ref), 2e-2)} (whole bucket {rel_err(ys[False], ref):.1e})"
    with _skip_tiles_env(False):
        row.eager_ms = bench(lambda: adapter.run(calls[False], kern[False]), quick)
    with _skip_tiles_env(True):
        row.ms = bench(lambda: adapter.run(calls[True], kern[True]), quick)


def skip_tiles_cases(quick: bool):
    """wq_b (N 32768, K 1280) and wo_b (N 5120, K 8192) at M 5000 (bucket 8192) and 2200 (bucket 4096)."""
    out = []
    for M in (5000,) if quick else (5000, 2200):
        for N, K in ((HEADS * HEAD_DIM, Q_LORA), (HIDDEN, 8192)):
            out.append(("dense skip tiles linear_fp8 g32", f"{M}x{N}x{K}",
                        lambda r, q, d, M=M, N=N, K=K: case_skip_tiles(r, M, N, K, q, d)))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- cache bf16 s9
# `--only "cache bf16 s9"` (session 9, E): one layer's decode attention as the batched decode step runs it -- this
# step's ring write, the window pool concat(rings, new rows), the compact gather of the selected compressed rows
# (batch_decode's default), the fused_attention adapter (its bf16 pool conversions, the kernel, the FP8 epilogue) --
# with the caches in f32 (before passes/cache_storage.py) and in bf16 (after: no conversion). "flat": the kernel reads
# the flat compressed pool in place (no gather); "ring": also the window from the ring as written (runtime/
# passes/read_rings_after_write.py: no concat) -- the runtime's default now. V4.1 layer 2 (ratio 2) at 4k
# context: rings of 128 rows, 2049 compressed rows a sequence, 512 selected. %limit is against the kernel's own
# roofline (what the node costs beyond the kernel shows); the eager column is the f32 row's time / this row's; every
# bf16 row must give the f32 row's output bit for bit.

CACHE_S9_CTX, CACHE_S9_WIN, CACHE_S9_TOPK = 4096, 128, 512
CACHE_S9_ROWS = (CACHE_S9_CTX + 1 + 1) // 2  # C2 of max_model_len 4097
CACHE_S9_MODES = ("f32", "bf16", "bf16 flat", "bf16 ring")
CACHE_S9_BASE: dict = {}  # B -> (f32 row's ms, its output codes, its scales)


def _cache_s9_call(args: list, cache: dict):
    """A V4.1 fused_attention call (layer 2's attributes) on args = (q, positions, sink, win, win_idx, cmp, cmp_idx);
    ``cache``: the runner's per-run dict (the executor's prep_cache: MAX_POSITIONS and the rope tables made in it
    once -- a fresh dict per call would rebuild the tables on the host every call)."""
    from deepinfer.runtime import kernel_adapters as ka

    return ka.Call("fused_attention", _cache_s9_attrs(), list(args), [f"a{i}" for i in range(7)], [False] * 7, {},
                   cache)  # fmt: skip


@functools.cache
def _cache_s9_attrs() -> dict:
    from deepinfer.models import deepseek_v41 as m41
    from deepinfer.models.presets import real_config

    cfg = m41.parse_config(real_config("deepseek-v4.1-flash"))
    return {"q_norm": False, "eps": 1e-6, **cfg.rope_attrs(2), "scale": HEAD_DIM**-0.5, "out_groups": cfg.o_groups,
            "quant_group": 32}  # fmt: skip


def _cache_s9_operands(B: int, device: str):
    """(q, positions, sink, rings [B*W, D], new rows [B, D], win_idx, ring slots [B], flat compressed pool [B*N, D],
    flat ids [B, K]) in f32, seeded (every row of one B sees the same values); the ids as the batched graph's ops
    make them."""
    from deepinfer.ir.registry import get_op

    g = torch.Generator(device=device).manual_seed(B)
    pos = torch.full((B,), CACHE_S9_CTX, device=device)
    q = torch.randn(B, HEADS, HEAD_DIM, device=device, generator=g)
    sink = torch.randn(HEADS, device=device, generator=g)
    rings = torch.randn(B * CACHE_S9_WIN, HEAD_DIM, device=device, generator=g)
    new = torch.randn(B, HEAD_DIM, device=device, generator=g)
    pool = torch.randn(B * CACHE_S9_ROWS, HEAD_DIM, device=device, generator=g)
    visible = (CACHE_S9_CTX + 1) // 2
    ids = torch.argsort(torch.rand(B, visible, device=device, generator=g), dim=1)[:, :CACHE_S9_TOPK]
    win_idx = get_op("batched_window_indices").run([pos], {"window": CACHE_S9_WIN})[0]
    slots = get_op("batched_ring_slots").run([pos], {"size": CACHE_S9_WIN})[0]
    flat_ids = get_op("batched_rows").run([ids, pool], {})[0]
    return q, pos, sink, rings, new, win_idx, slots, pool, flat_ids


def _cache_s9_node(mode: str, ops: tuple):
    """The step's work for one mode, as a callable of the kernels: (cast) + ring write + (concat) + (gather) + the
    adapter's run."""
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.batched_decode import scatter_rows_in_place

    q, pos, sink, rings, new, win_idx, slots, pool, flat_ids = ops
    if mode != "f32":
        rings, pool = rings.to(torch.bfloat16), pool.to(torch.bfloat16)
    ring_ids = torch.cat([win_idx[:, :-1], slots.view(-1, 1)], dim=1)  # read_rings_after_write's window ids
    gather = get_op("batched_gather_rows")
    adapter = ka.adapter_for("sparse_attn_decode", "fused_attention")
    cache = {ka.MAX_POSITIONS: CACHE_S9_CTX + 1}  # the runner's prep_cache: kept across calls

    def step(kernels):
        rows = new if mode == "f32" else new.to(torch.bfloat16)  # the cache_storage cast of the new rows
        scatter_rows_in_place(rings, slots, rows)  # the ring write (in place, as the batched executor does it)
        win, w_idx = (rings, ring_ids) if mode == "bf16 ring" else (torch.cat([rings, rows]), win_idx)
        cmp, cmp_idx = (pool, flat_ids) if mode in ("bf16 flat", "bf16 ring") else gather.run([pool, flat_ids], {})
        return adapter.run(_cache_s9_call([q, pos, sink, win, w_idx, cmp, cmp_idx], cache), kernels)

    return step


def _cache_s9_keys(B: int, mode: str):
    """The adapter's kernel keys for the node at B (shapes only: meta tensors); "ring" has B fewer window rows."""
    from deepinfer.runtime import kernel_adapters as ka

    def meta(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    win_rows = B * CACHE_S9_WIN + (0 if mode == "bf16 ring" else B)
    args = [meta(B, HEADS, HEAD_DIM), meta(B, dtype=torch.long), meta(HEADS), meta(win_rows, HEAD_DIM),
            meta(B, CACHE_S9_WIN, dtype=torch.long), meta(B * CACHE_S9_TOPK, HEAD_DIM),
            meta(B, CACHE_S9_TOPK, dtype=torch.long)]  # fmt: skip
    with _emulate_plan():
        return ka.adapter_for("sparse_attn_decode", "fused_attention").keys(
            _cache_s9_call(args, {ka.MAX_POSITIONS: CACHE_S9_CTX + 1}))


def case_cache_bf16(row: Row, B: int, mode: str, quick: bool, dry: bool):
    """One of CACHE_S9_MODES (see the section's comment). Timed as a CUDA graph of the whole node (bench_device)."""
    from deepinfer.runtime import kernel_adapters as ka

    kernels = [build(ka._factory(k)) for k in _cache_s9_keys(B, mode)]
    row.bytes_, row.flops = sparse_attn_decode.roofline(B, HEADS, HEAD_DIM, CACHE_S9_WIN + CACHE_S9_TOPK)
    row.peak = "bf16"
    if dry:
        return
    step = _cache_s9_node(mode, _cache_s9_operands(B, "cuda"))
    codes, scales = (t.view(torch.uint8).clone() for t in step(kernels))
    row.ms = bench_device(lambda: step(kernels), quick)
    if mode == "f32":
        CACHE_S9_BASE[B] = (row.ms, codes, scales)
        row.check = "f32 caches (before)"
        return
    base = CACHE_S9_BASE.get(B)
    if base is None:
        row.check = "no f32 row this run"
        return
    row.eager_ms = base[0]
    diff = int((codes != base[1]).sum()) + int((scales != base[2]).sum())
    row.check = "identical to f32" if diff == 0 else f"DIFFERS from f32 in {diff} bytes"
    if diff:
        raise AssertionError(row.check)


def cache_bf16_cases():
    """Rows "cache bf16 s9 ...": at B 64 and 256 (4k), the f32-cache node first, then the bf16 modes."""
    return [(f"cache bf16 s9 attn node {mode}", f"B{B} 4k k640",
             lambda r, q, d, B=B, m=mode: case_cache_bf16(r, B, m, q, d))
            for B in (64, 256) for mode in CACHE_S9_MODES]  # fmt: skip


def rmsnorm_s12_cases() -> list:
    """`--only "rmsnorm s12"`: every config of the space at V4.1's hidden size, 4096 rows, with and without the
    quantisation (session 12: the quantising program's rows padded to 256 groups ran 161.6 us = 9.4% at the
    default (1, 128); rmsnorm_quant.row_width keeps one-row CTAs unpadded), the binding's pick marked."""
    from deepinfer.passes.select_kernels import bind_rmsnorm_config

    out = []
    for quant in (True, False):
        pick = bind_rmsnorm_config(4096, HIDDEN, quant, 132)
        for cfg in rmsnorm_quant.config_space(4096, HIDDEN, quant=quant):
            name = f"rmsnorm s12 {'quant ' if quant else ''}{cfg.block_m}x{cfg.threads}"
            name += " (bound)" if cfg == pick else ""
            out.append((name, f"4096x{HIDDEN}",
                        lambda r, q, d, c=cfg, qu=quant: case_rmsnorm(r, 4096, HIDDEN, qu, q, d, c)))  # fmt: skip
    return out


def cases(quick: bool):
    """(kernel, shape text, callable(row, quick, dry)) in table order."""
    gemms = [(4096, Q_LORA, HIDDEN), (4096, HEADS * HEAD_DIM, Q_LORA), (64, HEADS * HEAD_DIM, Q_LORA)]
    if not quick:
        gemms += [(4096, HIDDEN, 8192), (4096, MOE_INTER, HIDDEN), (8192, 8192, 8192)]
    out = []
    for M, N, K in gemms:
        cfg = fp8_gemm.sm90_config(M, N, 32)
        out.append(
            (
                f"fp8_gemm g32 {cfg.tag}",
                f"{M}x{N}x{K}",
                lambda r, q, d, M=M, N=N, K=K, cfg=cfg: case_fp8_gemm(r, M, N, K, 32, cfg, q, d),
            )
        )
    g128 = fp8_gemm.sm90_config(4096, HEADS * HEAD_DIM, 128)
    out.append(
        (
            f"fp8_gemm g128 {g128.tag}",
            "4096x32768x1280",
            lambda r, q, d: case_fp8_gemm(r, 4096, HEADS * HEAD_DIM, Q_LORA, 128, g128, q, d),
        )
    )
    out += grouped_cases(quick)
    out += rmsnorm_s12_cases()
    out += shared_prefill_cases()
    out += batched_pair_keys_cases()
    if not quick:  # a small sweep: what the autotuner would search
        for cfg in fp8_gemm.config_space(4096, 32768, 1280, 32)[::6][:8]:
            out.append(
                (
                    f"fp8_gemm g32 {cfg.block_m}x{cfg.block_n}x{cfg.block_k}s{cfg.stages}",
                    "4096x32768x1280",
                    lambda r, q, d, cfg=cfg: case_fp8_gemm(r, 4096, HEADS * HEAD_DIM, Q_LORA, 32, cfg, q, d),
                )
            )
    for T_ in (4096, 64) if not quick else (4096,):
        out += [
            ("rmsnorm", f"{T_}x{HIDDEN}", lambda r, q, d, T_=T_: case_rmsnorm(r, T_, HIDDEN, False, q, d)),
            ("rmsnorm+fp8 quant g32", f"{T_}x{HIDDEN}", lambda r, q, d, T_=T_: case_rmsnorm(r, T_, HIDDEN, True, q, d)),
            (
                "rmsnorm+quant (triton)",
                f"{T_}x{HIDDEN}",
                lambda r, q, d, T_=T_: case_rmsnorm_triton(r, T_, HIDDEN, q, d),
            ),
            ("moe_routing", f"{T_}x{EXPERTS} k{TOPK}", lambda r, q, d, T_=T_: case_routing(r, T_, q, d)),
            ("moe_routing (triton)", f"{T_}x{EXPERTS} k{TOPK}", lambda r, q, d, T_=T_: case_routing(r, T_, q, d, True)),
            ("hc_pre", f"{T_}x4x{HIDDEN}", lambda r, q, d, T_=T_: case_hc_pre(r, T_, q, d)),
            *[(f"hc_pre split{sp}", f"{T_}x4x{HIDDEN}", lambda r, q, d, T_=T_, sp=sp: case_hc_pre(r, T_, q, d, sp))
              for sp in ((20, 40, 80) if T_ <= 256 else ())],  # fmt: skip
            ("hc_post", f"{T_}x4x{HIDDEN}", lambda r, q, d, T_=T_: case_hc_post(r, T_, q, d)),
        ]
    for T_ in (4096, 64) if not quick else (4096,):
        out.append(("rope", f"{T_}x{HEADS}x{HEAD_DIM} r64", lambda r, q, d, T_=T_: case_rope(r, T_, False, q, d)))
    out += decode_small_cases()
    out += batched_index_scores_cases()
    out += indexer_length_cases()
    out += indexer_pos_s9_cases()
    out += candidate_blocks_cases()
    out += engram_hash_s11_cases()
    out += moe_layout_cases()
    out += attn_cases(quick)
    out += [] if quick else attn_s7_cases()
    out += [] if quick else attn_s8_cases()
    out += [] if quick else attn_s9_cases()
    out += [] if quick else attn_gputest_cases()
    out += [] if quick else attn_s9r2_cases()
    out += [] if quick else attn_s10_cases()
    out += [] if quick else attn_s10r2_cases()
    out += [] if quick else attn_s10_final_cases()
    out += [] if quick else attn_s12b_cases()
    out += [] if quick else masked_rows_s12b_cases()
    out += new_family_cases(quick)
    out += grouped_ws_cases(quick)  # last: the newest programs (a fault poisons the CUDA context for later rows)
    out += grouped_v41g128_cases(quick)
    out += moe_halftiles_cases()
    out += grouped_out_proj_prefill_cases(quick)
    out += skip_tiles_cases(quick)
    out += [] if quick else cache_bf16_cases()
    return out


# FP8 GEMM formulations at prefill shapes (fp8_gemm.py's docstring explains them). Tag: MxNxK tile, s stages,
# t consumer threads (256 = 2 warpgroups), o = async wgmma overlapped with the promotion, r = warpgroups split
# by rows, n2 = N tile MMA'd in 2 column slices, pG = persistent warp-specialised kernel (132 CTAs, a TMA
# producer warpgroup, tiles visited in panels of G M tiles), c2 = CTA pairs sharing B by TMA multicast,
# pp = the two consumer warpgroups issue their wgmmas in strict turns (one promotes while the other's MMAs
# run). Each shape also gets cuBLAS rows measured in the same run: `_scaled_mm` with per-tensor scales (the
# MMA-only ceiling at that shape) and, for g128, cuBLAS's own block-scaled FP8 (1x128 activations x 128x128
# weights, torch.nn.functional.scaled_mm, CUDA >= 12.9).
SWEEP_SHAPES = {
    128: [  # V4-Flash (hidden 4096): wq_b, wo_b, wq_a, shared expert w1|w3; V4.1's wq_b dims; the peak's shape
        (4096, 32768, 1024),
        (4096, 4096, 8192),
        (4096, 1024, 4096),
        (4096, 4096, 4096),
        (4096, HEADS * HEAD_DIM, Q_LORA),
        (8192, 8192, 8192),
    ],
    32: [  # V4.1-Flash (hidden 5120): wq_b, wo_b, wq_a, shared expert; the peak's shape
        (4096, HEADS * HEAD_DIM, Q_LORA),
        (4096, HIDDEN, 8192),
        (4096, Q_LORA, HIDDEN),
        (4096, MOE_INTER, HIDDEN),
        (8192, 8192, 8192),
    ],
}


def sweep_configs(g: int, M: int, N: int, cluster: int = 1) -> dict:
    """sm90_config (the current default) next to the persistent warp-specialised variants; cluster=2: the
    variants whose CTA pairs share B through TMA multicast (no sm90_config row)."""
    ws = functools.partial(fp8_gemm.Config, persistent=True, cluster=cluster)
    out = {} if cluster > 1 else {"sm90_config": fp8_gemm.sm90_config(M, N, g)}
    out["ws 128x256"] = ws(128, 256, 128, 3, 256, False, True, 2)
    out["ws 128x256 pp"] = ws(128, 256, 128, 3, 256, False, True, 2, pingpong=True)
    # 4 stages in the room of the smem output tile (epilogue straight from registers)
    out["ws 128x256 s4d"] = ws(128, 256, 128, 4, 256, False, True, 2, direct_store=True)
    out["ws 128x256 pp s4d"] = ws(128, 256, 128, 4, 256, False, True, 2, pingpong=True, direct_store=True)
    if cluster == 1:
        out["ws 128x128"] = ws(128, 128, 128, 5, 256, False, True, 1)
    out["ws 128x128 ovl"] = ws(128, 128, 128, 5, 256, True, True, 1)
    if g == 128 and cluster == 1:  # L2 panel width (rows of tiles sharing B): 8 and 32 (= all M tiles at M=4096)
        out["ws 128x256 r8"] = ws(128, 256, 128, 3, 256, False, True, 2, raster=8)
        out["ws 128x256 r32"] = ws(128, 256, 128, 3, 256, False, True, 2, raster=32)
    return {name: c for name, c in out.items() if N % c.block_n == 0 and M % (c.block_m * c.cluster) == 0}


def case_cublas_fp8(row: Row, M: int, N: int, K: int, g: int, quick: bool, dry: bool):
    """cuBLAS at this shape: per-tensor `_scaled_mm` (g=0), or block-scaled 1x128 x 128x128 (g=128). A
    missing block-scaled path is reported in the row (not counted as a failure)."""
    row.bytes_, row.flops = fp8_gemm.roofline(M, N, K, max(g, 128), max(g, 128))
    if dry:
        return
    x, w = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda") * 0.05
    if g == 0:
        a, b, one = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), torch.ones((), device="cuda")
        out = torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)
        ref = a.float() @ b.float().T
        row.check = expect(rel_err(out, ref), 2e-2)
        row.ms = bench(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16), quick)
        return
    import torch.nn.functional as F

    a, sa = quant_fp8_groups(x, g)
    b, sb = quant_fp8_blocks(w, g)
    l4 = -(-(K // g) // 4) * 4  # cuBLAS wants the weight scales' K extent padded to a multiple of 4
    sbp = torch.zeros(N // g, l4, device="cuda")
    sbp[:, : K // g] = sb
    sa_mn, sb_t = sa.T.contiguous().T, sbp.T  # activation scales M-major, weight scales K-major

    def run():
        return F.scaled_mm(a, b.t(), sa_mn, F.ScalingType.BlockWise1x128, sb_t, F.ScalingType.BlockWise128x128)

    try:
        out = run()
    except Exception as e:  # older torch / cuBLAS: no block-scaled FP8 on sm90
        row.error = f"n/a here: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        return
    row.check = expect(rel_err(out, fp8_gemm.reference_dequant_f64(a, sa, b, sb, g, g).float()), 2e-2)
    row.ms = bench(run, quick)


def _sweep_risk(name: str) -> int:
    """Run order of the sweep: the references and the configs that already ran clean on the H200 first, the
    newest / fault-prone variants last (a device fault poisons the CUDA context, so every later row fails too:
    /work/.device/1/g32.txt lost 39 rows to one misaligned address)."""
    if "cublas" in name:
        return 0
    if "sm90_config" in name:
        return 1
    if " c2" in name:  # CTA pairs: multicast TMA and cluster barriers
        return 5 if " s4d" in name else 4
    return 3 if "128x128" in name or " s4d" in name else 2


def sweep_cases():
    out = []
    for cluster in (1, 2):
        for g, shapes in SWEEP_SHAPES.items():
            for M, N, K in shapes:
                shape = f"{M}x{N}x{K}"
                refs = ((0, "cublas per-tensor"), (128, "cublas block-scaled"))[: 2 if g == 128 else 1]
                for ref_g, ref_name in refs if cluster == 1 else ():
                    out.append(
                        (
                            f"g{g} {ref_name}",
                            shape,
                            lambda r, q, d, M=M, N=N, K=K, ref_g=ref_g: case_cublas_fp8(r, M, N, K, ref_g, q, d),
                        )
                    )
                for name, cfg in sweep_configs(g, M, N, cluster).items():
                    out.append(
                        (
                            f"g{g} {name}{' c2' if cluster > 1 else ''} {cfg.tag}",
                            shape,
                            lambda r, q, d, M=M, N=N, K=K, g=g, cfg=cfg: case_fp8_gemm(r, M, N, K, g, cfg, q, d, False),
                        )
                    )
    return sorted(out, key=lambda c: _sweep_risk(c[0]))  # stable: table order inside each risk class


# `--families`: issue 6's table -- one row per kernel family and form at the current defaults (real V4.1-Flash shapes;
# V4's 128x128 format where the family has it), every row checked against its reference on fresh random inputs and
# timed against the limits measured at the start of the same run. (family, kernel name, shape): a name ending in
# "*" is a prefix (the row's config tag follows it), else the row's whole name; the first row of the full table that
# matches is taken (the table lists each family's default first).
FAMILY_ROWS = [
    ("1 FP8 GEMM, V4 128x128 blocks", "fp8_gemm g128 *", "4096x32768x1280"),
    ("1 FP8 GEMM, V4.1 32x32 blocks (SM90: per-32 promotion)", "fp8_gemm g32 *", "4096x32768x1280"),
    ("1 FP8 GEMM, V4.1, decode", "fp8_gemm g32 *", "64x32768x1280"),
    ("2 MoE grouped prefill, V4 128x128", "moe_grouped_gemm ws g128 ws 128x256 pp *", "EP8 8192 tok"),
    ("2 MoE grouped prefill, V4.1 32x32 (SM90: per-32 promotion)", "moe_grouped_gemm g32 *", "EP8 8192 tok"),
    ("2 MoE grouped prefill, W4A8 + SwiGLU", "moe_grouped_gemm w4a8 +swiglu *", "EP8 4096 tok"),
    ("2 MoE masked decode, SwiGLU (real routing)", "moe decode real swiglu map", "T64"),
    ("2 MoE masked decode, down (real routing)", "moe decode real down map", "T64"),
    ("2 MoE masked decode, W4A8", "moe_grouped_gemm masked w4a8 swab", "EP8 decode 64 tok"),
    ("3 MoE routing", "moe_routing", "4096x384 k6"),
    ("3 MoE routing, decode", "moe_routing", "64x384 k6"),
    ("3 MoE permute (layout)", "moe_layout layout", "T8192 k6 E384 D5120"),
    ("4 sparse attention decode B64", "sparse_attn s10 final B64 *", "B64 H64 k640 4k"),
    ("4 sparse attention decode B256", "sparse_attn s10 final B256 *", "B256 H64 k640 4k"),
    ("4 sparse attention prefill", "sparse_attn s10r2 prefill wsn64s2p132", "T4096 H64 k640"),
    ("5 indexer scores, prefill", "prefill index_scores f32 tf32x3 c128w8", "T8192 C8192 r1"),
    ("5 indexer scores, decode", "decode small index_scores f32 tf32x3 c128w8", "T64 C4160 r1"),
    ("5 top-k select, prefill", "topk_select s11 r1", "T4096 C65536 k512"),
    ("5 top-k select, decode", "indexer_topk_select", "T64 C65536 k512"),
    ("6 compressor ratio 2", "compressor r2", "4096x512"),
    ("6 compressor ratio 1", "compressor r1", "4096x512"),
    ("6 pair compressor keys, decode", "batched pair_compressor_keys", "B64 d512 di128"),
    ("7 hyper-connection pre", "hc_pre", "4096x4x5120"),
    ("7 hyper-connection post", "hc_post", "4096x4x5120"),
    ("7 hyper-connection post + pre, decode", "decode small hc_post_pre (post+split, f32 io)", "64x4x5120"),
    ("8 RMSNorm", "rmsnorm", "4096x5120"),
    ("8 RMSNorm + FP8 quant", "rmsnorm+fp8 quant g32", "4096x5120"),
    ("8 RoPE", "rope", "4096x64x512 r64"),
    ("8 Engram gather", "engram_embed", "4096x24x256 fp8"),
    ("8 Engram gate", "engram_gate", "4096x4x5120"),
    ("8 Engram hash", "engram_hash s11 kernel", "T4096"),
]


def _family_match(pattern: str, name: str) -> bool:
    return name.startswith(pattern[:-1]) if pattern.endswith("*") else name == pattern


def family_cases() -> list:
    """`FAMILY_ROWS`' rows of the full table, in that order, each renamed "<family>: <row's kernel>"; a pattern that
    matches no row is an error (the table changed under it)."""
    table = cases(False)
    out = []
    for family, pattern, shape in FAMILY_ROWS:
        row = next((c for c in table if c[1] == shape and _family_match(pattern, c[0])), None)
        if row is None:
            raise SystemExit(f"--families: no row {pattern!r} at shape {shape!r} for {family!r}")
        out.append((f"{family}: {row[0]}", row[1], row[2]))
    return out


def selected(sweep: bool, quick: bool, only: str, shape: str, families: bool = False) -> list:
    """The rows --only (kernel name) and --shape (shape column) select, in table order (--families: in
    FAMILY_ROWS' order)."""
    rows = family_cases() if families else (sweep_cases() if sweep else cases(quick))
    return [c for c in rows if only in c[0] and shape in c[1]]


def _prebuild(job):
    """Worker: build selected row `index` only (dry run) so the main process finds it in TileLang's cache."""
    sweep, quick, only, shape, families, index = job
    name, _, run = selected(sweep, quick, only, shape, families)[index]
    try:
        run(Row(name, ""), True, True)
        return ""
    except Exception as e:
        return f"{name}: {type(e).__name__}: {str(e)[:200]}"


def prebuild(sweep: bool, quick: bool, only: str, shape: str, jobs: int, families: bool = False) -> None:
    import multiprocessing as mp

    t0 = time.time()
    n = len(selected(sweep, quick, only, shape, families))
    with mp.get_context("spawn").Pool(jobs) as pool:
        jobs_ = [(sweep, quick, only, shape, families, i) for i in range(n)]
        errs = [e for e in pool.map(_prebuild, jobs_) if e]
    print(f"pre-built {n} kernels in {time.time() - t0:.0f} s with {jobs} processes; {len(errs)} failed")
    for e in errs:
        print("  build error:", e)


def _adjacent_peak(row: Row, lim: Limits | None, quick: bool) -> str:
    """For an FP8 compute-bound row: the `_scaled_mm` peak timed right after it, and the row's share of it (the
    peak drifts by up to ~18% within one call with the card's clocks, so a neighbouring measurement is the
    steadier ratio)."""
    if lim is None or row.error or row.ms != row.ms or row.peak != "fp8" or row.flops / lim.fp8 <= row.bytes_ / lim.hbm:
        return ""
    now = fp8_peak_now(quick)
    return f"  (peak now {now / 1e12:.0f} TFLOPS: {100 * row.flops / (row.ms * 1e-3) / now:.1f}%)"


def fmt_row(row: Row, lim: Limits | None) -> str:
    head = f"{row.kernel:<40} {row.shape:<18}"
    if row.error:
        return f"{head} ERROR {row.error}"
    if lim is None or row.ms != row.ms:  # dry run or not timed
        return f"{head} built"
    sec = row.ms * 1e-3
    peak = lim.fp8 if row.peak == "fp8" else lim.bf16
    bound = max(row.bytes_ / lim.hbm, row.flops / peak)
    compute_bound = row.flops / peak > row.bytes_ / lim.hbm
    rate = f"{row.flops / sec / 1e12:8.1f} TFLOPS" if compute_bound else f"{row.bytes_ / sec / 1e12:8.2f} TB/s  "
    speed = f"{row.eager_ms / row.ms:6.2f}x" if row.eager_ms == row.eager_ms else "     -"
    return f"{head} {row.ms * 1e3:9.1f} us {rate} {100 * bound / sec:6.1f}% {speed}  err {row.check}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--dry-run", action="store_true", help="only build every kernel (works without a GPU)")
    ap.add_argument("--only", default="", help="substring filter on kernel names")
    ap.add_argument("--shape", default="", help="substring filter on the shape column (e.g. 4096x32768x)")
    ap.add_argument("--gemm-sweep", action="store_true", help="FP8 GEMM formulations at V4/V4.1 prefill shapes")
    ap.add_argument("-j", "--jobs", type=int, default=0, help="pre-build all kernels in this many processes")
    ap.add_argument("--families", action="store_true",
                    help="issue 6's table: one row per kernel family at its defaults (FAMILY_ROWS)")
    args = ap.parse_args(argv)
    todo = selected(args.gemm_sweep, args.quick, args.only, args.shape, args.families)
    if args.jobs > 0:  # only the rows --only selects
        prebuild(args.gemm_sweep, args.quick, args.only, args.shape, args.jobs, args.families)
    dry = args.dry_run or not torch.cuda.is_available()
    if dry and not args.dry_run:
        print("no CUDA device: building only (--dry-run)")
    lim = None
    if not dry:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
        lim = measure_limits(args.quick)
        print(
            f"measured limits: HBM copy {lim.hbm / 1e12:.2f} TB/s, FP8 _scaled_mm {lim.fp8 / 1e12:.0f} TFLOPS, "
            f"BF16 matmul {lim.bf16 / 1e12:.0f} TFLOPS"
        )
    print(f"{'kernel':<40} {'shape':<18} {'time':>12} {'achieved':>14} {'%limit':>7} {'vs eager':>7}")
    failures = 0
    for name, shape, run in todo:
        row = Row(name, shape)
        t0 = time.time()
        try:
            run(row, args.quick, dry)
        except Exception as e:  # a failing kernel must not stop the table
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
            failures += 1
            if os.environ.get("DEEPINFER_BENCH_TRACEBACK"):
                traceback.print_exc()
        print(fmt_row(row, lim), f"[{time.time() - t0:.0f}s]{_adjacent_peak(row, lim, args.quick)}", flush=True)
    if lim is not None:  # the spread of the limit within this run (the rows' %limit use the first value)
        again = measure_limits(args.quick)
        print(f"limits again at the end: HBM copy {again.hbm / 1e12:.2f} TB/s, FP8 _scaled_mm "
              f"{again.fp8 / 1e12:.0f} TFLOPS, BF16 matmul {again.bf16 / 1e12:.0f} TFLOPS")  # fmt: skip
    done = "were built" if dry else "passed their checks"
    print(f"{failures} kernel(s) failed" if failures else f"all kernels {done}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
