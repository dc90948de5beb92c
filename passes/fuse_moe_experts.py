"""Fusion: the routed experts as one grouped GEMM pair with token permutation, and the shared expert in the
same op -> moe_grouped_experts (issue 5 (d); codegen/kernels/moe_grouped_gemm.py).

    routed = moe_experts(x, weights, idx, *experts)
    shared = linear_fp8(swiglu_gate_up(x, w1, w3, s1, s3), w2, s2)      (after fuse_swiglu; or plain linears;
                                                                          with quantisation on, a Q/DQ pair
                                                                          between the SwiGLU and w2)
    y = add(routed, shared)
    ->  y = moe_grouped_experts(x, weights, idx, w1, w3, w2, s1, s3, s2, *experts) {layout, ...}

(a MoE without that shared-expert shape fuses alone: moe_experts -> moe_grouped_experts with no shared inputs).
The shared expert is one more expert every token visits, so it joins the grouped launch; its intermediate
values and the routed output are single-use. The layout is chosen by the T bucket: "masked" for decode
buckets (T <= masked_max_t, a fixed per-expert buffer that CUDA graphs can capture), "contiguous" for prefill
buckets, "auto" while T is symbolic (the runtime picks per batch with the same rule). Run it after
`specialize_shapes` for a bucket graph to fix the layout. The check: the shared GEMMs share one FP8 block and
quantise nothing implicitly.
"""

from __future__ import annotations

from deepinfer.ir.graph import Graph
from deepinfer.ir.ops import fused  # noqa: F401  (registers the fused ops)
from deepinfer.passes.pattern import Absent, Any, Op
from deepinfer.passes.pipeline import register_pass
from deepinfer.passes.rewrite_patterns import rewrite_patterns

ROUTED = Op("moe_experts", Any("x"), Any("weights"), Any("idx"), ..., capture="moe", single_use=True)


def _shared(fp8: bool, quantised: bool) -> Op:
    scales = (Any("s1"), Any("s3")) if fp8 else (Absent(), Absent())
    h = Op("swiglu_gate_up", Any("x"), Any("w1"), Any("w3"), *scales, capture="gu", single_use=True)
    if quantised:
        codes, qs = (Op("quant_fp8", h, output=i, capture="quant", single_use=True) for i in (0, 1))
        h = Op("dequant_fp8", codes, qs, single_use=True)
    if fp8:
        return Op("linear_fp8", h, Any("w2"), Any("s2"), capture="down", single_use=True)
    return Op("linear", h, Any("w2"), Absent(), capture="down", single_use=True)


PATTERNS = [
    Op("add", ROUTED, _shared(fp8, quantised), capture="add") for quantised in (True, False) for fp8 in (True, False)
] + [ROUTED]


def check(m) -> bool:
    if "gu" not in m.ops:
        return True
    gu, down = m.node("gu").attrs, m.node("down").attrs
    same_block = "block" not in down or gu["block"] == down["block"]
    return not gu["act_group"] and not down.get("act_group", 0) and same_block


def layout(t, masked_max_t: int) -> str:
    if not isinstance(t, int):
        return "auto"
    return "masked" if t <= masked_max_t else "contiguous"


def _rewrite(masked_max_t: int):
    def rewrite(m):
        moe = m.node("moe")
        attrs = {**moe.attrs, "layout": layout(m["x"].shape[0], masked_max_t), "masked_max_t": masked_max_t}
        shared = [None] * 6
        if "gu" in m.ops:
            gu = m.node("gu").attrs
            attrs.update(shared_limit=gu["limit"], shared_block=gu["block"])
            if "quant" in m.ops:
                attrs["shared_mid_group"] = m.node("quant").attrs["group"]
            shared = [m["w1"], m["w3"], m["w2"], m.values.get("s1"), m.values.get("s3"), m.values.get("s2")]
        return "moe_grouped_experts", [m["x"], m["weights"], m["idx"], *shared, *moe.inputs[3:]], attrs

    return rewrite


@register_pass("fuse_moe_experts")
def fuse_moe_experts(g: Graph, masked_max_t: int = 64) -> Graph:
    """moe_experts (+ the shared expert and the add) -> moe_grouped_experts with a T-bucket layout."""
    rewrite_patterns(g, PATTERNS, _rewrite(masked_max_t), where=check)
    return g
