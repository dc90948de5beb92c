"""Per-token-group FP8 activation quantisation as one launch (the FP8 GEMMs' A operand), Triton.

    s[g, m] = 2^ceil(log2(max(amax_g(x[m]), 1e-4) / 448))        MN-major fp32 scales [K/group, rows]
    q[m, k] = e4m3(clamp(x[m, k] / s[k // group, m], -448, 448))  codes [rows, K]

exactly what runtime/kernel_adapters.quant_act computes (ir/ops/quant.py's quant_fp8 numbers): the exponent comes
from the float's bits, not from log2 (Triton's log2 is an approximation): with amax = 1.m * 2^p,
amax / 448 = (1.m / 1.75) * 2^(p - 8), and 1.m / 1.75 lies in (4/7, 8/7), so the ceiling is p - 8, plus one when
1.m > 1.75 (mantissa bits above 0x600000) -- moe_grouped_gemm.ue8m0_exponent, the fused SwiGLU epilogue's rule.
Dividing by a power of two is multiplying by its inverse (both exact or both one IEEE rounding), so the codes
match torch's bit for bit.

Why a kernel: the torch formulation is ~10 element-wise launches per quantisation (abs, amax, clamp, div, log2,
ceil, exp2, div, clamp, cast) plus the padding and the scales' transpose; at decode every FP8 GEMM pays them
(the MoE's routed and shared experts, linear_fp8, grouped_out_proj), where the GEMM itself is a few
microseconds. One program per row (rows past M are written as zero codes with the floor's scale: the GEMM's
padding rows), the row held as [groups, group] so each group's amax is one axis reduction.

Coarser groups: what the g128 prefill option changes (convert_fp4_to_fp8 prefill_act_group=128). V4.1 quantises
the experts' activations per 1x32; the option quantises the same values per 1x128 (x: a rebase of the 1x32 codes,
requantised from their dequantised values; the SwiGLU output h: from fp32) so the prefill GEMMs promote once per
128 K. Statement (``rebase_stats`` measures it, tests/codegen/test_moe_prefill_g128*.py check it):
  Let s32, s128 be the two ue8m0 scales of an element v (s128 = 2^j s32, j >= 0: the 128-group's amax bounds the
  32-group's, and the scale is monotone in it). Both codes are round-to-nearest-even of v/s onto E4M3, whose normal
  numbers (|c| >= 2^-6) all carry 3 mantissa bits: dividing by a power of two only moves the exponent, so wherever
  v/s128 is normal the two roundings commute and  q128 * s128 == q32 * s32  bit for bit. Hence every element with
  |v| >= 2^-6 * s128 is unchanged. Since amax/448 <= s128 < 2 amax/448, the threshold lies in
  [amax/28672, amax/14336) of the 128-group's largest magnitude. Below it v/s128 is subnormal (step 2^-9): the
  1x128 value is within 2^-10 s128 of v and the 1x32 one within 2^-10 s128 too (relative error <= 2^-4 of
  |v| < 2^-6 s128, or its own smaller subnormal step), so |q128 s128 - q32 s32| <= 2^-9 s128 < amax / 57344.
  (Groups under the floor share the floor's scale: identical. No clamp is ever active: |v|/s <= 448 by the scale.)
The GEMM on top: the 1x128 path also lets wgmma accumulate 4 x 32 K in the tensor core before each promotion
(the DeepGEMM trade-off V4's own format makes) instead of promoting every 32 K in fp32: the kernels_h200
'grouped_gemm v41g128' rows measure the whole deviation against the float64 product of the exact 1x32 operands.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # optional dependency (deepinfer[codegen])
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

FAMILY = "act_quant"
FP8_MAX = 448.0
SCALE_FLOOR = 1e-4  # dt.pow2_scale's floor: an all-zero group gets 2^ceil(log2(1e-4 / 448)) = 2^-22


def _triton_factory(build):
    """A kernel factory: build(interpret) once per interpreter mode (Triton fixes the mode when it decorates), and
    the missing-triton error before it."""

    @functools.lru_cache(maxsize=2)
    @functools.wraps(build)
    def factory(interpret: bool):
        if triton is None:
            raise ImportError("triton is not installed (pip install deepinfer[codegen])")
        return build(interpret)

    return factory


@_triton_factory
def _kernel(interpret: bool):
    """Built lazily, once per interpreter mode (triton fixes it at decoration time)."""

    @triton.jit
    def act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, ROWS, ROWS_PER, CHUNK_OFF, G: tl.constexpr,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        t = row % ROWS_PER  # output row `row` = token t of K chunk row // ROWS_PER (one chunk: row itself)
        g = tl.arange(0, BLOCK_G)[:, None]
        c = tl.arange(0, GROUP)[None, :]
        mask = (g < G) & (t < M)
        src = x_ptr + t * stride_x + (row // ROWS_PER) * CHUNK_OFF
        x = tl.load(src + g * GROUP + c, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)  # SCALE_FLOOR
        bits = amax.to(tl.uint32, bitcast=True)
        ex = ((bits >> 23) & 0xFF).to(tl.int32) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        scale = ((ex + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - ex).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        q = tl.clamp(x * inv[:, None], -448.0, 448.0)  # FP8_MAX
        tl.store(q_ptr + row * K + g * GROUP + c, q.to(q_ptr.dtype.element_ty), mask=g < G)
        gs = tl.arange(0, BLOCK_G)
        tl.store(s_ptr + gs * ROWS + row, scale, mask=gs < G)

    return act_quant_kernel


def triton_act_quant(x: torch.Tensor, group: int, rows: int | None = None, out_dtype=None, chunks: int = 1):
    """x [M, K] (any float dtype, unit stride along K) -> (q [rows, K], s [K/group, rows] fp32); rows >= M (default
    M). `out_dtype` defaults to float8_e4m3fn on CUDA and float32 under the CPU interpreter (no fp8 stores there:
    the values are the e4m3 codes' values, the cast to fp8 is exact).
    chunks > 1: K in `chunks` column chunks of whole groups, laid out chunk-major -- q [chunks * rows, K / chunks],
    s [K / chunks / group, chunks * rows], row j * rows + t = chunk j of token t (the masked layout of a GEMM whose
    'experts' are K chunks; the same codes and scales as one chunk, without a transposed copy of x first)."""
    m, k = x.shape
    kc = k // chunks
    assert kc * chunks == k and kc % group == 0 and x.stride(1) == 1, (x.shape, x.stride(), group, chunks)
    rows = m if rows is None else rows
    assert rows >= m
    if out_dtype is None:
        out_dtype = torch.float8_e4m3fn if x.is_cuda else torch.float32
    q = torch.empty(chunks * rows, kc, dtype=out_dtype, device=x.device)
    s = torch.empty(kc // group, chunks * rows, dtype=torch.float32, device=x.device)
    if rows:
        _kernel(os.environ.get("TRITON_INTERPRET") == "1")[(chunks * rows,)](
            x, q, s, m, kc, x.stride(0), chunks * rows, rows, kc, G=kc // group, GROUP=group,
            BLOCK_G=triton.next_power_of_2(kc // group))  # fmt: skip
    return q, s


def reference(x: torch.Tensor, group: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch: the same (q [rows, K] e4m3, s [K/group, rows]) from quant_fp8's formula (pow2_scale, division, clamp,
    cast), padding rows as zero codes with the floor's scale."""
    from deepinfer.ir import dtypes as dt

    m, k = x.shape
    rows = m if rows is None else rows
    xp = torch.zeros(rows, k, dtype=torch.float32, device=x.device)
    xp[:m] = x.float()
    g = xp.unflatten(-1, (-1, group))
    scale = dt.pow2_scale(g.abs().amax(-1, keepdim=True), dt.FP8_MAX)
    q = (g / scale).clamp(-dt.FP8_MAX, dt.FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale.squeeze(-1).T.contiguous()


# ---------------------------------------------------------------------------------------------- fake quantisation
# fake_quant_fp8 (a folded Q/DQ pair: the MoE's input at prefill) as one launch: y = e4m3(x / s) * s per group, fp32
# in and out. The runtime ran it as act_quant's kernel + two torch launches (codes -> fp32, times the scales): ~5
# passes over [T, D] fp32 instead of one read and one write (0.326 ms at T 8192, D 5120 on the H200, session 8).
# H200 (session 8 call 3): 86.9 us = 90% of the HBM roofline at [8192, 5120], 3.76x the path before; the layer's
# fake_quant_fp8 node 0.085 ms (was 0.326).
# The e4m3 rounding is done in fp32 arithmetic, not by a cast (Triton's interpreter rounds fp8 casts wrongly at binade
# boundaries, so a cast could not be checked on CPU): with v = x / s (|v| <= 448 after the clamp), the code grid's
# spacing in v's binade is ulp = 2^(e - 3) (3 mantissa bits), 2^-9 below the normals (e < -6); v / ulp is exact (a
# power of two) and rounds to the nearest integer, ties to even, by adding and subtracting 1.5 * 2^23 (|v / ulp| <=
# 16, so the sum's unit is 1); times ulp and s, both exact. Same numbers as torch's cast bit for bit (an exact -0 may
# come out +0: equal values).
RNE_MAGIC = 12582912.0  # 1.5 * 2^23: x + RNE_MAGIC - RNE_MAGIC rounds |x| < 2^22 to an integer, ties to even


@_triton_factory
def _fake_quant_kernel(interpret: bool):
    @triton.jit
    def fake_quant_kernel(x_ptr, y_ptr, K, stride_x, G: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, BLOCK_G)[:, None]
        c = tl.arange(0, GROUP)[None, :]
        x = tl.load(x_ptr + row * stride_x + g * GROUP + c, mask=g < G, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)  # act_quant_kernel's scale
        bits = amax.to(tl.uint32, bitcast=True)
        ex = ((bits >> 23) & 0xFF).to(tl.int32) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        scale = ((ex + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - ex).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        v = tl.clamp(x * inv[:, None], -448.0, 448.0)
        # the code grid's spacing at v: biased exponent of 2^(e - 3), at least 2^-9's (118)
        ue = tl.maximum((v.to(tl.uint32, bitcast=True) >> 23) & 0xFF, 121) - 3
        ulp = (ue << 23).to(tl.float32, bitcast=True)
        inv_ulp = ((254 - ue) << 23).to(tl.float32, bitcast=True)
        code = (v * inv_ulp + 12582912.0) - 12582912.0  # RNE_MAGIC
        tl.store(y_ptr + row * K + g * GROUP + c, code * ulp * scale[:, None], mask=g < G)

    return fake_quant_kernel


def triton_fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """fake_quant_fp8 of x [M, K] (any float dtype, unit stride along K) as fp32 [M, K], one launch."""
    m, k = x.shape
    assert k % group == 0 and x.stride(1) == 1, (x.shape, x.stride(), group)
    y = torch.empty(m, k, dtype=torch.float32, device=x.device)
    if m:
        _fake_quant_kernel(os.environ.get("TRITON_INTERPRET") == "1")[(m,)](
            x, y, k, x.stride(0), G=k // group, GROUP=group, BLOCK_G=triton.next_power_of_2(k // group))  # fmt: skip
    return y


def fake_quant_roofline(m: int, k: int, x_bytes: int = 4) -> float:
    """Bytes of one fake quantisation: x read once, fp32 y written once."""
    return float(m * k * (x_bytes + 4))


# ---------------------------------------------------------------------------------------------- dequantisation
# dequant_fp8 (the attention's FP8 output -> fp32 for grouped_out_proj) as one launch: y = q * 2^(s - 127), the
# e4m3 code widened and its group's ue8m0 scale decoded from the byte (both exact, and so is the product of a
# code and a power of two above fp32's subnormals) -- dequant_fp8_groups' numbers bit for bit, where torch takes
# ~5 launches (byte -> float, - 127, exp2, code -> float, product).


@_triton_factory
def _dequant_kernel(interpret: bool):
    @triton.jit
    def dequant_kernel(q_ptr, s_ptr, y_ptr, K, G: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
        row = tl.program_id(0)
        g = tl.arange(0, BLOCK_G)[:, None]
        c = tl.arange(0, GROUP)[None, :]
        q = tl.load(q_ptr + row * K + g * GROUP + c, mask=g < G, other=0.0).to(tl.float32)
        byte = tl.load(s_ptr + row * G + tl.arange(0, BLOCK_G), mask=tl.arange(0, BLOCK_G) < G, other=127)
        bits = tl.where(byte > 0, byte.to(tl.uint32) << 23, 0x400000)  # byte 0: 2^-127, a subnormal
        scale = bits.to(tl.float32, bitcast=True)
        tl.store(y_ptr + row * K + g * GROUP + c, q * scale[:, None], mask=g < G)

    return dequant_kernel


def triton_dequant(q: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """q [..., K] e4m3 codes (fp32 code values under the CPU interpreter), s [..., K/group] ue8m0 scales (or their
    uint8 bytes) -> fp32 [..., K]."""
    k = q.shape[-1]
    assert k % group == 0 and s.shape[-1] == k // group, (q.shape, s.shape, group)
    q2 = q.reshape(-1, k).contiguous()
    s2 = (s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s).reshape(-1, k // group).contiguous()
    y = torch.empty(q2.shape, dtype=torch.float32, device=q.device)
    if q2.shape[0]:
        _dequant_kernel(os.environ.get("TRITON_INTERPRET") == "1")[(q2.shape[0],)](
            q2, s2, y, k, G=k // group, GROUP=group, BLOCK_G=triton.next_power_of_2(k // group))  # fmt: skip
    return y.view(q.shape)


# FP8 codes already made (the attention's epilogue) moved into triton_act_quant(..., chunks=G)'s layout: the bytes
# of token t's chunk j to row j * rows + t, and its ue8m0 scale bytes decoded (exactly, as the dequant kernel does)
# into the MN-major fp32 scales -- one launch, where torch's transposed copies took ~0.6 ms at V4.1's prefill.


@functools.lru_cache(maxsize=2)
def _codes_kernel(interpret: bool):
    if triton is None:
        raise ImportError("triton is not installed (pip install deepinfer[codegen])")

    @triton.jit
    def codes_chunk_major_kernel(q_ptr, e_ptr, a_ptr, s_ptr, M, ROWS, ROWS_PER, CHUNKS, KC: tl.constexpr,
                                 G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        t, j = row % ROWS_PER, row // ROWS_PER  # output row = chunk j of token t
        real = t < M
        k = tl.arange(0, BLOCK_K)
        codes = tl.load(q_ptr + (t * CHUNKS + j) * KC + k, mask=(k < KC) & real, other=0)
        tl.store(a_ptr + row * KC + k, codes, mask=k < KC)
        g = tl.arange(0, BLOCK_G)
        byte = tl.load(e_ptr + (t * CHUNKS + j) * G + g, mask=(g < G) & real, other=127)
        bits = tl.where(byte > 0, byte.to(tl.uint32) << 23, 0x400000)  # byte 0: 2^-127, a subnormal
        tl.store(s_ptr + g * ROWS + row, bits.to(tl.float32, bitcast=True), mask=g < G)

    return codes_chunk_major_kernel


def triton_codes_chunk_major(q: torch.Tensor, e: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 x as codes q [M, C, KC] (e4m3, or their uint8 bytes) and ue8m0 scales e [M, C, KC/group] -> (codes
    [C * rows, KC] uint8 bytes, row j * rows + t = chunk j of token t, padding rows 0; fp32 scales
    [KC/group, C * rows], padding columns 1): triton_act_quant(dequant(q, e), group, rows, chunks=C)'s operand,
    value for value (its codes may be twice these at half the scale where rounding brought a group's maximum to
    448 x the smaller scale: the same products)."""
    m, chunks, kc = q.shape
    g = e.shape[-1]
    qb = (q if q.dtype == torch.uint8 else q.view(torch.uint8)).contiguous()
    eb = (e if e.dtype == torch.uint8 else e.view(torch.uint8)).contiguous()
    a = torch.empty(chunks * rows, kc, dtype=torch.uint8, device=q.device)
    s = torch.empty(g, chunks * rows, dtype=torch.float32, device=q.device)
    if rows:
        _codes_kernel(os.environ.get("TRITON_INTERPRET") == "1")[(chunks * rows,)](
            qb, eb, a, s, m, chunks * rows, rows, chunks, KC=kc, G=g, BLOCK_K=triton.next_power_of_2(kc),
            BLOCK_G=triton.next_power_of_2(g))  # fmt: skip
    return a, s


# ---------------------------------------------------------------------------------------------- coarser groups


def rebase_stats(x: torch.Tensor, fine: int = 32, coarse: int = 128) -> dict:
    """The module doc's statement on x [M, K]: per-`fine` vs per-`coarse` quantisation (reference()'s numbers),
    dequantised. Returns the share of elements whose values differ, the share below the threshold 2^-6 * s_coarse,
    whether every element at or above it is bit-identical, and the largest |difference| / s_coarse below it (the
    bound is 2^-9)."""
    qf, sf = reference(x, fine)
    qc, sc = reference(x, coarse)
    vf = qf.float() * sf.T.repeat_interleave(fine, 1)
    s_el = sc.T.repeat_interleave(coarse, 1)
    vc = qc.float() * s_el
    below = x.float().abs() < 2.0**-6 * s_el
    differ = vf != vc
    return {"differ": differ.float().mean().item(), "below": below.float().mean().item(),
            "above_identical": not bool((differ & ~below).any()),
            "max_below_over_scale": ((vf - vc).abs() / s_el)[below].max().item() if below.any() else 0.0}  # fmt: skip


# ---------------------------------------------------------------------------------------------- SwiGLU + quant
# The prefill w2 GEMM's A operand from the w1|w3 GEMM's output in one launch: h = silu(min(g, L)) * clamp(u, -L, L)
# (ir/ops/moe.py swiglu, fp32; L = 0: no clamp) quantised per `group` columns exactly as above -- where torch takes
# ~8 launches over [M, 2I] (slices, clamps, silu, product) before act_quant's. silu as g / (1 + exp(-g)): within
# an ulp or so of torch's, so a code can flip at a rounding boundary (the tests bound it to one E4M3 step).


@_triton_factory
def _swiglu_kernel(interpret: bool):
    @triton.jit
    def swiglu_quant_kernel(c_ptr, q_ptr, s_ptr, M, INTER, stride_c, ROWS, LIMIT, tiles_ptr, BLOCK_M,
                            G: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                            HALF_FLAG: tl.constexpr = 0):  # fmt: skip
        row = tl.program_id(0)
        g = tl.arange(0, BLOCK_G)[:, None]
        c = tl.arange(0, GROUP)[None, :]
        live = row < M
        if HALF_FLAG:  # a tile table: only rows the GEMM computed (not padding tiles, not a half tile's second half)
            e = tl.load(tiles_ptr + row // BLOCK_M)
            live = live & (e >= 0) & ((e < HALF_FLAG) | (2 * (row % BLOCK_M) < BLOCK_M))
        mask = (g < G) & live
        src = c_ptr + row * stride_c + g * GROUP + c
        gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + INTER, mask=mask, other=0.0).to(tl.float32)
        if LIMIT > 0:
            gate = tl.minimum(gate, LIMIT)
            up = tl.clamp(up, -LIMIT, LIMIT)
        h = gate / (1.0 + tl.exp(-gate)) * up
        amax = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-4)  # SCALE_FLOOR
        bits = amax.to(tl.uint32, bitcast=True)
        ex = ((bits >> 23) & 0xFF).to(tl.int32) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        scale = ((ex + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - ex).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        q = tl.clamp(h * inv[:, None], -448.0, 448.0)  # FP8_MAX
        tl.store(q_ptr + row * INTER + g * GROUP + c, q.to(q_ptr.dtype.element_ty), mask=mask)
        gs = tl.arange(0, BLOCK_G)
        tl.store(s_ptr + gs * ROWS + row, scale, mask=(gs < G) & live)

    return swiglu_quant_kernel


def triton_swiglu_quant(c: torch.Tensor, limit: float, group: int, out_dtype=None, rows: int | None = None,
                        tiles: torch.Tensor | None = None, block_m: int = 128):  # fmt: skip
    """c [M, 2I] (gate columns, then up; any float dtype, unit stride along columns) -> (q [rows, I] e4m3 codes,
    s [I/group, rows] fp32 MN-major scales) of the clamped SwiGLU (limit 0: none); rows >= M (default M), the rows
    past M left unwritten (a GEMM's padding tiles that it skips). out_dtype as triton_act_quant's.
    tiles: the grouped GEMMs' half-tile TileExpert of block_m-row tiles (moe_routing half_tiles): rows of padding
    tiles and of half tiles' second halves are neither read nor written (the GEMMs neither wrote nor read them)."""
    m, n = c.shape
    inter = n // 2
    rows = m if rows is None else rows
    assert inter * 2 == n and inter % group == 0 and c.stride(1) == 1 and rows >= m, (c.shape, c.stride(), group)
    if out_dtype is None:
        out_dtype = torch.float8_e4m3fn if c.is_cuda else torch.float32
    q = torch.empty(rows, inter, dtype=out_dtype, device=c.device)
    s = torch.empty(inter // group, rows, dtype=torch.float32, device=c.device)
    if m:
        from deepinfer.codegen.kernels.fp8_gemm import HALF_TILE_FLAG

        assert tiles is None or tiles.numel() * block_m >= m, (tiles.shape, block_m, m)
        _swiglu_kernel(os.environ.get("TRITON_INTERPRET") == "1")[(m,)](
            c, q, s, m, inter, c.stride(0), rows, float(limit), c if tiles is None else tiles, block_m,
            G=inter // group, GROUP=group, BLOCK_G=triton.next_power_of_2(inter // group),
            HALF_FLAG=0 if tiles is None else HALF_TILE_FLAG)  # fmt: skip
    return q, s


def swiglu_quant_reference(c: torch.Tensor, limit: float, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch: ir/ops/moe.py's swiglu in fp32, then reference()'s quantisation -- (q [M, I] e4m3, s [I/group, M])."""
    from deepinfer.ir.ops.moe import swiglu

    inter = c.shape[1] // 2
    return reference(swiglu(c[:, :inter], c[:, inter:], limit), group)
