"""Fusion: q-norm, RoPE, sparse attention with sink, inverse RoPE (and the output quant) -> fused_attention.

    q' = rope(rmsnorm(q))          (V4; V4.1 has no per-head q norm: q' = rope(q))
    o  = rope(sparse_attention(q', sink, win_kv, win_idx, cmp_kv?, cmp_idx?), inverse)
    [with quantisation on:  oq, os = quant_fp8(reshape(o, [T, G, H*d/G]))   -- what wo_a's FP8 GEMM reads]
    ->  o (or oq, os) = fused_attention(q, positions, sink, win_kv, win_idx, cmp_kv?, cmp_idx?)

This is the boundary of FlashMLA's fused V4.1 kernel: the query is normalised and rotated in the prologue,
the output de-rotated (and quantised) in the epilogue, so neither q' nor o reaches memory: every intermediate
must be single-use. The check: both rotations use the same positions and RoPE attributes (one table).
"""

from __future__ import annotations

from deepinfer.ir.graph import Graph
from deepinfer.ir.ops import fused  # noqa: F401  (registers the fused ops)
from deepinfer.ir.ops.attention import ROPE_ATTRS
from deepinfer.passes.pattern import Absent, Any, Op
from deepinfer.passes.pipeline import register_pass
from deepinfer.passes.rewrite_patterns import rewrite_patterns


def _core(q_norm: bool) -> Op:
    q = Op("rmsnorm", Any("q"), Absent(), capture="qnorm", single_use=True) if q_norm else Any("q")
    attn = Op(
        "sparse_attention",
        Op("rope", q, Any("pos"), attrs={"inverse": False}, capture="qrope", single_use=True),
        Any("sink"),
        Any("win_kv"),
        Any("win_idx"),
        Any("cmp_kv", optional=True),
        Any("cmp_idx", optional=True),
        capture="attn",
        single_use=True,
    )
    return Op("rope", attn, Any("pos"), attrs={"inverse": True}, capture="inv")


def _quantised(q_norm: bool) -> Op:
    core = _core(q_norm)
    core.single_use = True
    return Op("quant_fp8", Op("reshape", core, capture="reshape", single_use=True), capture="quant")


# Largest first: a V4 match must take its q norm, and a quantised output its reshape and quant.
PATTERNS = [_quantised(True), _quantised(False), _core(True), _core(False)]


def check(m) -> bool:
    qrope, inv = m.node("qrope").attrs, m.node("inv").attrs
    if any(qrope[k] != inv[k] for k in ROPE_ATTRS):
        return False
    if "reshape" in m.ops:  # the reshape must be the [T, H, d] -> [T, G, H*d/G] of the output projection
        o, r = m.node("inv").outputs[0], m.node("reshape").outputs[0]
        return len(r.shape) == 3 and r.shape[0] == o.shape[0] and isinstance(r.shape[1], int)
    return True


def rewrite(m):
    inv = m.node("inv")
    attrs = {k: inv.attrs[k] for k in ROPE_ATTRS}
    attrs["scale"] = m.node("attn").attrs["scale"]
    if "qnorm" in m.ops:
        attrs.update(q_norm=True, eps=m.node("qnorm").attrs["eps"])
    if "quant" in m.ops:
        attrs.update(out_groups=m.node("reshape").outputs[0].shape[1], quant_group=m.node("quant").attrs["group"])
    inputs = [m["q"], m["pos"], m["sink"], m["win_kv"], m["win_idx"], m["cmp_kv"], m["cmp_idx"]]
    return "fused_attention", inputs, attrs


@register_pass("fuse_attention")
def fuse_attention(g: Graph) -> Graph:
    """q-norm + rope + sparse_attention + inverse rope (+ reshape + quant_fp8) -> fused_attention."""
    rewrite_patterns(g, PATTERNS, rewrite, where=check)
    return g
