"""Fusion: the grouped output projection (MODEL_SPEC §2.11), wo_a's grouped GEMM and wo_b's GEMM -> grouped_out_proj.

    u = reshape(grouped_linear(x [T, G, K], wo_a, s_a?), [T, G*R])
    [with quantisation on:  u = dequant_fp8(quant_fp8(u))]
    y = linear_fp8(u, wo_b, s_b)        (or linear(u, wo_b) with float weights)
    ->  y = grouped_out_proj(x, wo_a, wo_b, s_a?, s_b?) {block_a, block_b, mid_group}

The [T, G*R] intermediate (G*R = 1024 on V4-Flash) stays on chip between the two GEMMs, so every value
between them must be single-use. The check: wo_b's GEMM quantises nothing implicitly (act_group 0; phase 1
makes activation quantisation explicit), and the reshape merges exactly the group axis.

When x itself is dequant_fp8(codes, scales) per block_a (the attention's FP8 epilogue, single-use), the codes
and scales go in instead (grouped_out_proj's optional xs): wo_a's GEMM quantises x per block_a anyway, which
gives back those values exactly (power-of-two scales), so the fp32 copy (4 bytes a value: 1 GB a V4.1 layer at
8192 tokens) and the second quantisation are left out.
"""

from __future__ import annotations

import os

from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import Graph
from deepinfer.ir.ops import fused  # noqa: F401  (registers the fused ops)
from deepinfer.passes.pattern import Absent, Any, Op
from deepinfer.passes.pipeline import register_pass
from deepinfer.passes.rewrite_patterns import rewrite_patterns


def _u(quantised: bool, fp8_in: bool) -> Op:
    u = Op(
        "reshape",
        Op("grouped_linear", _x(fp8_in), Any("wa"), Any("sa", optional=True), capture="ga", single_use=True),
        capture="reshape",
        single_use=True,
    )
    if not quantised:
        return u
    codes, scales = (Op("quant_fp8", u, output=i, capture="quant", single_use=True) for i in (0, 1))
    return Op("dequant_fp8", codes, scales, capture="dequant", single_use=True)


def _x(fp8_in: bool):
    if not fp8_in:
        return Any("x")
    return Op("dequant_fp8", Any("xc"), Any("xs"), capture="xdq", single_use=True)


def _patterns(fp8_in: bool) -> list[Op]:
    return [
        Op(op, _u(quantised, fp8_in), Any("wb"), tail, capture="gb")
        for quantised in (True, False)
        for op, tail in (("linear_fp8", Any("sb")), ("linear", Absent()))
    ]


PLAIN = _patterns(False)
PATTERNS = _patterns(True) + PLAIN  # the codes-in form first: where its check fails, the plain form still matches


def check(m) -> bool:
    if m.node("gb").attrs.get("act_group", 0):
        return False
    x = m["xc"] if "xdq" in m.ops else m["x"]
    if "xdq" in m.ops and not _codes_fit(m):
        return False
    u = m.node("reshape").outputs[0]
    return len(u.shape) == 2 and u.shape[0] == x.shape[0]


def _codes_fit(m) -> bool:
    """The dequantised x is wo_a's operand as its own quantisation would make it: per block_a groups, fp32."""
    dq, block = m.node("xdq"), m.node("ga").attrs["block"]
    return (m.node("ga").inputs[2] is not None and dq.attrs["group"] == block and dq.attrs["dtype"] == dt.f32
            and len(m["xc"].shape) == 3)  # fmt: skip


def rewrite(m):
    attrs = {"block_a": m.node("ga").attrs["block"]}
    if m.node("gb").op == "linear_fp8":
        attrs["block_b"] = m.node("gb").attrs["block"]
    if "quant" in m.ops:
        attrs["mid_group"] = m.node("quant").attrs["group"]
    fp8_in = "xdq" in m.ops
    x, xs = (m["xc"], m["xs"]) if fp8_in else (m["x"], None)
    return "grouped_out_proj", [x, m["wa"], m["wb"], m["sa"], m.values.get("sb"), xs], attrs


CODES_ENV = "DEEPINFER_OUT_PROJ_CODES"  # "0": keep x dequantised (the A/B of the codes-in form)


@register_pass("fuse_out_proj")
def fuse_out_proj(g: Graph) -> Graph:
    """(dequant_fp8 +) grouped_linear (wo_a) + reshape (+ quant/dequant) + linear (wo_b) -> grouped_out_proj."""
    codes_in = os.environ.get(CODES_ENV) != "0"
    rewrite_patterns(g, PATTERNS if codes_in else PLAIN, rewrite, where=check)
    return g
