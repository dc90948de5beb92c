"""Fusion: the clamped SwiGLU MLP's gate/up GEMM pair and activation -> swiglu_gate_up.

    gate = linear_fp8(x, w1, s1)      up = linear_fp8(x, w3, s3)      h = swiglu(gate, up) {limit}
    ->  h = swiglu_gate_up(x, w1, w3, s1, s3) {limit, block, act_group}

(or the same with plain `linear` and no scales). One kernel reads x once for both GEMMs and applies the
clamp/silu/mul in the epilogue, so the two [T, I] intermediates never reach memory: they must be single-use.
On V4 this is the shared expert of every MoE layer.
"""

from __future__ import annotations

from deepinfer.ir.graph import Graph
from deepinfer.passes.pattern import Absent, Any, Op, rewrite_matches
from deepinfer.passes.pipeline import register_pass


def _gemm(op: str, w: str, s: str, capture: str) -> Op:
    # Both GEMMs read the same x (the capture "x" must bind one value) and have no bias.
    if op == "linear":
        return Op("linear", Any("x"), Any(w), Absent(), capture=capture, single_use=True)
    return Op("linear_fp8", Any("x"), Any(w), Any(s), capture=capture, single_use=True)


PATTERNS = [
    Op("swiglu", _gemm(op, "w1", "s1", "gate"), _gemm(op, "w3", "s3", "up"), capture="act")
    for op in ("linear_fp8", "linear")
]


def check(m) -> bool:
    # One kernel runs both GEMMs with one config: the FP8 block and activation group must agree.
    gate, up = m.node("gate"), m.node("up")
    return gate.op == up.op and gate.attrs == up.attrs


def rewrite(m):
    # The GEMMs' own attributes (block, act_group for FP8; none for plain linear) carry over unchanged.
    attrs = {"limit": m.node("act").attrs["limit"], **m.node("gate").attrs}
    inputs = [m["x"], m["w1"], m["w3"], m.values.get("s1"), m.values.get("s3")]
    return "swiglu_gate_up", inputs, attrs


@register_pass("fuse_swiglu")
def fuse_swiglu(g: Graph) -> Graph:
    """linear(x, w1), linear(x, w3), swiglu -> swiglu_gate_up (FP8 or plain weights)."""
    for pattern in PATTERNS:
        rewrite_matches(g, pattern, rewrite, where=check)
    return g
