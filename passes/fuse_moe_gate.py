"""Fusion: the MoE gate GEMM and routing -> moe_gate_route (issue 5 (c): gate GEMM, score, bias, top-k,
normalise, scale as one op).

    logits = linear(x, W_gate)      weights, idx = moe_route(logits, bias?, tid2eid?, tokens?)
    ->  weights, idx = moe_gate_route(x, W_gate, bias?, tid2eid?, tokens?)

The gate has only E (tens to a few hundred) outputs per token, so the fused kernel keeps the logits in
registers and does the top-k in the same launch; the logits must therefore be single-use.
"""

from __future__ import annotations

from deepinfer.ir.graph import Graph
from deepinfer.passes.pattern import Absent, Any, Op, rewrite_matches
from deepinfer.passes.pipeline import register_pass

PATTERN = Op(
    "moe_route",
    Op("linear", Any("x"), Any("gate_weight"), Absent(), single_use=True),
    Any("bias", optional=True),
    Any("tid2eid", optional=True),
    Any("tokens", optional=True),
    capture="route",
)


def rewrite(m):
    inputs = [m["x"], m["gate_weight"], m["bias"], m["tid2eid"], m["tokens"]]
    return "moe_gate_route", inputs, dict(m.node("route").attrs)


@register_pass("fuse_moe_gate")
def fuse_moe_gate(g: Graph) -> Graph:
    """linear (gate) + moe_route -> moe_gate_route. No check: every gate GEMM + routing pair fuses."""
    rewrite_matches(g, PATTERN, rewrite)
    return g
