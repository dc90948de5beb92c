"""Ops that passes create: fused kernels-to-be, and the constant op constant folding needs.

A fused op's reference is the composition of the references of the ops it replaces, called in the same
order with the same intermediate dtypes, so a fused graph gives bit-identical results in the interpreter;
kernels (codegen) then have one op to implement and a reference to be checked against.
"""

from __future__ import annotations

import torch

from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import TensorType
from deepinfer.ir.ops.core import Linear, RMSNorm
from deepinfer.ir.ops.moe import MoERoute, SwiGLU
from deepinfer.ir.ops.quant import LinearFP8, QuantFP8
from deepinfer.ir.registry import Attr, register_op, shape_fail


@register_op("rmsnorm_quant_fp8", "x, weight?", {"eps": Attr("float", 1e-6), "group": Attr("int")}, level="kernel")
class RMSNormQuantFP8:
    """rmsnorm then per-token-group FP8 quantisation: (codes f8e4m3 [..., K], ue8m0 scales [..., K/group])."""

    def infer(x, weight, *, eps, group):
        return QuantFP8.infer(RMSNorm.infer(x, weight, eps=eps), group=group)

    def reference(x, weight, *, eps, group):
        return QuantFP8.reference(RMSNorm.reference(x, weight, eps=eps), group=group)


def _gemm_infer(x, w, s, block, act_group):
    if s is None:
        return Linear.infer(x, w, None)
    return LinearFP8.infer(x, w, s, block=block, act_group=act_group)


def _gemm_ref(x, w, s, block, act_group):
    if s is None:
        return Linear.reference(x, w, None)
    return LinearFP8.reference(x, w, s, block=block, act_group=act_group)


@register_op(
    "swiglu_gate_up",
    "x, w1, w3, s1?, s3?",
    {"limit": Attr("float", 0.0), "block": Attr("int", 128), "act_group": Attr("int", 0)},
    level="kernel",
)
class SwiGLUGateUp:
    """swiglu(x @ w1^T, x @ w3^T) clamped at limit: the gate/up GEMM pair and the activation as one op.

    With scales s1/s3 the weights are block-scaled FP8 (linear_fp8 with ``block``/``act_group``); without,
    plain weights (linear). The intermediate gate/up tensors never reach memory in the fused kernel.
    """

    def infer(x, w1, w3, s1, s3, *, limit, block, act_group):
        if (s1 is None) != (s3 is None):
            raise shape_fail("swiglu_gate_up", "w1 and w3 must both be FP8 (with scales) or both plain", w1, w3)
        gate = _gemm_infer(x, w1, s1, block, act_group)
        up = _gemm_infer(x, w3, s3, block, act_group)
        return SwiGLU.infer(gate, up, limit=limit)

    def reference(x, w1, w3, s1, s3, *, limit, block, act_group):
        gate = _gemm_ref(x, w1, s1, block, act_group)
        up = _gemm_ref(x, w3, s3, block, act_group)
        return SwiGLU.reference(gate, up, limit=limit)


@register_op(
    "moe_gate_route",
    "x, gate_weight, bias?, tid2eid?, tokens?",
    {
        "topk": Attr("int"),
        "scoring": Attr("str", "sqrtsoftplus"),
        "route_scale": Attr("float", 1.0),
        "normalize": Attr("bool", True),
    },
    level="kernel",
)
class MoEGateRoute:
    """The gate GEMM (x @ W_gate^T) and moe_route (score, bias, top-k or hash, normalise, scale) as one op."""

    def infer(x, gate_weight, bias, tid2eid, tokens, *, topk, scoring, route_scale, normalize):
        logits = Linear.infer(x, gate_weight, None)
        return MoERoute.infer(
            logits, bias, tid2eid, tokens, topk=topk, scoring=scoring, route_scale=route_scale, normalize=normalize
        )

    def reference(x, gate_weight, bias, tid2eid, tokens, *, topk, scoring, route_scale, normalize):
        logits = Linear.reference(x, gate_weight, None)
        return MoERoute.reference(
            logits, bias, tid2eid, tokens, topk=topk, scoring=scoring, route_scale=route_scale, normalize=normalize
        )


@register_op("constant", "", {"shape": Attr("shape"), "values": Attr("floats"), "dtype": Attr("dtype", dt.f32)})
class Constant:
    """A small tensor given by its values (row-major; ints stored exactly up to 2^53). Made by fold_constants."""

    def infer(*, shape, values, dtype):
        n = 1
        for d in shape:
            if not isinstance(d, int):
                raise shape_fail("constant", "shape must be concrete", TensorType(dtype, tuple(shape)))
            n *= d
        if len(values) != n:
            raise shape_fail("constant", f"{len(values)} values for {n} elements", TensorType(dtype, tuple(shape)))
        return TensorType(dtype, tuple(shape))

    def reference(*, shape, values, dtype):
        # float64 holds every f32 and every integer up to 2^53 exactly, so the cast below is exact.
        return torch.tensor(values, dtype=torch.float64).reshape(tuple(shape)).to(dtype.torch_dtype)
