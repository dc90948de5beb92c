"""Fusion: the grouped output projection (MODEL_SPEC §2.11), wo_a's grouped GEMM and wo_b's GEMM -> grouped_out_proj.

    u = reshape(grouped_linear(x [T, G, K], wo_a, s_a?), [T, G*R])
    [with quantisation on:  u = dequant_fp8(quant_fp8(u))]
    y = linear_fp8(u, wo_b, s_b)        (or linear(u, wo_b) with float weights)
    ->  y = grouped_out_proj(x, wo_a, wo_b, s_a?, s_b?) {block_a, block_b, mid_group}

The [T, G*R] intermediate (G*R = 1024 on V4-Flash) stays on chip between the two GEMMs, so every value
between them must be single-use. The check: wo_b's GEMM quantises nothing implicitly (act_group 0; phase 1
makes activation quantisation explicit), and the reshape merges exactly the group axis.
"""

from __future__ import annotations

from deepinfer.ir.graph import Graph
from deepinfer.ir.ops import fused  # noqa: F401  (registers the fused ops)
from deepinfer.passes.pattern import Absent, Any, Op
from deepinfer.passes.pipeline import register_pass
from deepinfer.passes.rewrite_patterns import rewrite_patterns


def _u(quantised: bool) -> Op:
    u = Op(
        "reshape",
        Op("grouped_linear", Any("x"), Any("wa"), Any("sa", optional=True), capture="ga", single_use=True),
        capture="reshape",
        single_use=True,
    )
    if not quantised:
        return u
    codes, scales = (Op("quant_fp8", u, output=i, capture="quant", single_use=True) for i in (0, 1))
    return Op("dequant_fp8", codes, scales, capture="dequant", single_use=True)


PATTERNS = [
    Op(op, _u(quantised), Any("wb"), tail, capture="gb")
    for quantised in (True, False)
    for op, tail in (("linear_fp8", Any("sb")), ("linear", Absent()))
]


def check(m) -> bool:
    if m.node("gb").attrs.get("act_group", 0):
        return False
    u, x = m.node("reshape").outputs[0], m["x"]
    return len(u.shape) == 2 and u.shape[0] == x.shape[0]


def rewrite(m):
    attrs = {"block_a": m.node("ga").attrs["block"]}
    if m.node("gb").op == "linear_fp8":
        attrs["block_b"] = m.node("gb").attrs["block"]
    if "quant" in m.ops:
        attrs["mid_group"] = m.node("quant").attrs["group"]
    return "grouped_out_proj", [m["x"], m["wa"], m["wb"], m["sa"], m.values.get("sb")], attrs


@register_pass("fuse_out_proj")
def fuse_out_proj(g: Graph) -> Graph:
    """grouped_linear (wo_a) + reshape (+ quant/dequant) + linear (wo_b) -> grouped_out_proj."""
    rewrite_patterns(g, PATTERNS, rewrite, where=check)
    return g
