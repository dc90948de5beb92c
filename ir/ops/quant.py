"""Quantisation ops: FP8 E4M3 / FP4 E2M1 with ue8m0 power-of-two scales (MODEL_SPEC §4.2–4.4).

- per-token-group activation quantisation (groups of 128 for V4, 32 for V4.1);
- block-scaled FP8 weights (128x128 for V4, 32x32 for V4.1) and FP4 experts (one scale per 32 inputs);
- linear ops that take those formats, whose references dequantise and multiply in fp32;
- fake-quant (quantise then dequantise) used for the models' QAT points.
"""

from __future__ import annotations

import torch

from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import TensorType
from deepinfer.ir.registry import Attr, register_op, shape_fail
from deepinfer.ir.shapes import floordiv


def _groups(op: str, x: TensorType, group: int):
    k = x.shape[-1]
    if isinstance(k, int) and k % group:
        raise shape_fail(op, f"last dim must be a multiple of group {group}", x)
    return x.shape[:-1] + (floordiv(k, group),)


def quant_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 codes and ue8m0 scales, one per `group` consecutive values of the last dim."""
    g = x.float().unflatten(-1, (-1, group))
    scale = dt.pow2_scale(g.abs().amax(-1, keepdim=True), dt.FP8_MAX)
    q = (g / scale).clamp(-dt.FP8_MAX, dt.FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), dt.float_to_e8m0(scale.squeeze(-1))


def dequant_fp8_groups(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    s = dt.e8m0_to_float(scale).unsqueeze(-1)
    return (q.float().unflatten(-1, (-1, group)) * s).flatten(-2)


def dequant_fp8_blocks(w: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] FP8 weight with [ceil(N/b), ceil(K/b)] ue8m0 scales -> float32."""
    s = dt.e8m0_to_float(scale)
    s = s.repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)[:, : w.shape[1]]
    return w.float() * s


def dequant_fp4_rows(w: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """[N, K/2] packed FP4 with [N, K/group] ue8m0 scales -> float32 [N, K]."""
    vals = dt.fp4_to_float(w)
    return (vals.unflatten(-1, (-1, group)) * dt.e8m0_to_float(scale).unsqueeze(-1)).flatten(-2)


def fake_quant_fp8(x: torch.Tensor, group: int) -> torch.Tensor:
    """dequant_fp8_groups(*quant_fp8_groups(x, group)) without the e8m0 round trip: the scale is already a power
    of two in e8m0's range (pow2_scale's floor keeps it >= 2^-22), so the numbers are the same, and there is no
    positivity check reading the device (a CUDA graph can capture it)."""
    g = x.float().unflatten(-1, (-1, group))
    scale = dt.pow2_scale(g.abs().amax(-1, keepdim=True), dt.FP8_MAX)
    q = (g / scale).clamp(-dt.FP8_MAX, dt.FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).flatten(-2).to(x.dtype)


def fake_quant_fp4(x: torch.Tensor, group: int) -> torch.Tensor:
    """E2M1 with a ue8m0 scale per group: s = 2^ceil(log2(max(amax, 6*2^-126)/6)) (MODEL_SPEC §4.4)."""
    g = x.float().unflatten(-1, (-1, group))
    s = dt.pow2_scale(g.abs().amax(-1, keepdim=True), dt.FP4_MAX, floor=dt.FP4_MAX * 2.0**-126)
    q = dt.fp4_decode(dt.fp4_encode((g / s).clamp(-dt.FP4_MAX, dt.FP4_MAX)))
    return (q * s).flatten(-2).to(x.dtype)


@register_op("quant_fp8", "x", {"group": Attr("int")})
class QuantFP8:
    """Per-token-group FP8 quantisation: codes (f8e4m3, x's shape) and ue8m0 scales [..., K/group]."""

    def infer(x, *, group):
        return x.with_dtype(dt.f8e4m3), TensorType(dt.e8m0, _groups("quant_fp8", x, group))

    def reference(x, *, group):
        return quant_fp8_groups(x, group)


@register_op("dequant_fp8", "q, scale", {"group": Attr("int"), "dtype": Attr("dtype", dt.f32)})
class DequantFP8:
    """Inverse of quant_fp8."""

    def infer(q, scale, *, group, dtype):
        if scale.shape != _groups("dequant_fp8", q, group):
            raise shape_fail("dequant_fp8", "scale must be [..., K/group]", q, scale)
        return q.with_dtype(dtype)

    def reference(q, scale, *, group, dtype):
        return dequant_fp8_groups(q, scale, group).to(dtype.torch_dtype)


@register_op("fake_quant_fp8", "x", {"group": Attr("int")})
class FakeQuantFP8:
    """Quantise to FP8 with ue8m0 scales per group, then dequantise (QAT simulation)."""

    def infer(x, *, group):
        _groups("fake_quant_fp8", x, group)
        return x

    def reference(x, *, group):
        return fake_quant_fp8(x, group)


@register_op("fake_quant_fp4", "x", {"group": Attr("int", 32)})
class FakeQuantFP4:
    """Quantise to E2M1 with ue8m0 scales per group, then dequantise (QAT simulation)."""

    def infer(x, *, group):
        _groups("fake_quant_fp4", x, group)
        return x

    def reference(x, *, group):
        return fake_quant_fp4(x, group)


def _check_block_scale(op: str, w: TensorType, scale: TensorType, block: int) -> None:
    n, k = w.shape
    want = ((n + block - 1) // block, (k + block - 1) // block) if isinstance(n, int) and isinstance(k, int) else None
    if scale.rank != 2 or (want is not None and scale.shape != want):
        raise shape_fail(op, f"scale must be [ceil(N/{block}), ceil(K/{block})]", w, scale)


@register_op("dequant_fp8_block", "w, scale", {"block": Attr("int"), "dtype": Attr("dtype", dt.f32)})
class DequantFP8Block:
    """Block-scaled FP8 weight -> float."""

    def infer(w, scale, *, block, dtype):
        _check_block_scale("dequant_fp8_block", w, scale, block)
        return w.with_dtype(dtype)

    def reference(w, scale, *, block, dtype):
        return dequant_fp8_blocks(w, scale, block).to(dtype.torch_dtype)


@register_op("dequant_fp4", "w, scale", {"group": Attr("int", 32), "dtype": Attr("dtype", dt.f32)})
class DequantFP4:
    """Packed FP4 weight [N, K/2] with per-group ue8m0 scales [N, K/group] -> float [N, K]."""

    def infer(w, scale, *, group, dtype):
        k = w.shape[1] * 2
        if scale.shape != (w.shape[0], floordiv(k, group)):
            raise shape_fail("dequant_fp4", f"scale must be [N, K/{group}]", w, scale)
        return TensorType(dtype, (w.shape[0], k))

    def reference(w, scale, *, group, dtype):
        return dequant_fp4_rows(w, scale, group).to(dtype.torch_dtype)


@register_op("linear_fp8", "x, w, scale", {"block": Attr("int"), "act_group": Attr("int", 0)})
class LinearFP8:
    """x @ W^T with W block-scaled FP8. act_group > 0 quantises x per token group first (as the GEMM does)."""

    def infer(x, w, scale, *, block, act_group):
        if w.rank != 2 or x.shape[-1] != w.shape[1] or w.dtype != dt.f8e4m3:
            raise shape_fail("linear_fp8", "needs x [..., K] and an f8e4m3 weight [N, K]", x, w)
        _check_block_scale("linear_fp8", w, scale, block)
        if act_group:
            _groups("linear_fp8", x, act_group)
        return x.with_shape(x.shape[:-1] + (w.shape[0],))

    def reference(x, w, scale, *, block, act_group):
        xf = fake_quant_fp8(x.float(), act_group) if act_group else x.float()
        return (xf @ dequant_fp8_blocks(w, scale, block).T).to(x.dtype)


@register_op("linear_fp4", "x, w, scale", {"group": Attr("int", 32), "act_group": Attr("int", 0)})
class LinearFP4:
    """x @ W^T with W packed FP4 (per-32 ue8m0 scales); optional FP8 per-group activation quantisation."""

    def infer(x, w, scale, *, group, act_group):
        if w.rank != 2 or x.shape[-1] != w.shape[1] * 2:
            raise shape_fail("linear_fp4", "needs x [..., K] and a packed weight [N, K/2]", x, w)
        return x.with_shape(x.shape[:-1] + (w.shape[0],))

    def reference(x, w, scale, *, group, act_group):
        xf = fake_quant_fp8(x.float(), act_group) if act_group else x.float()
        return (xf @ dequant_fp4_rows(w, scale, group).T).to(x.dtype)
