"""Ops that passes create: fused kernels-to-be, and the constant op constant folding needs.

A fused op's reference is the composition of the references of the ops it replaces, called in the same
order with the same intermediate dtypes, so a fused graph gives bit-identical results in the interpreter;
kernels (codegen) then have one op to implement and a reference to be checked against.
"""

from __future__ import annotations

import torch

from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import TensorType
from deepinfer.ir.ops.attention import ROPE_ATTRS, GroupedLinear, Rope, SparseAttention
from deepinfer.ir.ops.core import Linear, Reshape, RMSNorm
from deepinfer.ir.ops.hyper import HCPost, HCPre
from deepinfer.ir.ops.moe import MoEExperts, MoERoute, SwiGLU
from deepinfer.ir.ops.quant import DequantFP8, LinearFP8, QuantFP8
from deepinfer.ir.ops.v41 import HCCollapse, HCStats, PairCompressor
from deepinfer.ir.registry import Attr, register_op, shape_fail
from deepinfer.ir.shapes import floordiv


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


# ---------------------------------------------------------------------------------------------------
# Attention (issue 5 (e)): fuse_attention
# ---------------------------------------------------------------------------------------------------


def _rope_attrs(attrs: dict) -> dict:
    return {k: attrs[k] for k in ROPE_ATTRS}


@register_op(
    "fused_attention",
    "q, positions, sink, win_kv, win_idx, cmp_kv?, cmp_idx?",
    {
        "q_norm": Attr("bool", False),
        "eps": Attr("float", 1e-6),
        **ROPE_ATTRS,
        "scale": Attr("float"),
        "out_groups": Attr("int", 0),
        "quant_group": Attr("int", 0),
    },
    level="kernel",
)
class FusedAttention:
    """The attention core as one op, the boundary of FlashMLA's fused V4.1 sparse-attention kernel. Kernel
    family: codegen/kernels/sparse_attn_decode.py (decode; its listed next step is this q-norm/RoPE prologue and
    inverse-RoPE/quant epilogue; prefill has no family yet):

        q' = rope(rmsnorm(q) if q_norm else q, positions)          per-head unweighted q norm (V4 only)
        o  = sparse_attention(q', sink, win_kv, win_idx, cmp_kv, cmp_idx) {scale}
        o  = rope(o, positions, inverse)                            de-rotate at the query position
        o  = reshape(o, [T, out_groups, H*d/out_groups])            when out_groups (the wo_a layout)
        o  = quant_fp8(o) {quant_group}                             when quant_group: (codes, ue8m0 scales)

    The same RoPE attributes for both rotations. Returns o, or (codes, scales) with quant_group.
    """

    def infer(q, positions, sink, win_kv, win_idx, cmp_kv, cmp_idx, *, q_norm, eps, scale, out_groups,
              quant_group, **rope):  # fmt: skip
        o = Rope.infer(q, positions, inverse=False, **rope)
        o = SparseAttention.infer(o, sink, win_kv, win_idx, cmp_kv, cmp_idx, scale=scale)
        if out_groups:
            t, h, d = o.shape
            o = Reshape.infer(o, shape=[t, out_groups, floordiv(h * d, out_groups)])
        return QuantFP8.infer(o, group=quant_group) if quant_group else o

    def reference(q, positions, sink, win_kv, win_idx, cmp_kv, cmp_idx, *, q_norm, eps, scale, out_groups,
                  quant_group, **rope):  # fmt: skip
        if q_norm:
            q = RMSNorm.reference(q, None, eps=eps)
        q = Rope.reference(q, positions, inverse=False, **rope)
        o = SparseAttention.reference(q, sink, win_kv, win_idx, cmp_kv, cmp_idx, scale=scale)
        o = Rope.reference(o, positions, inverse=True, **rope)
        if out_groups:
            o = o.reshape(o.shape[0], out_groups, -1)
        return QuantFP8.reference(o, group=quant_group) if quant_group else o


# ---------------------------------------------------------------------------------------------------
# Hyper-connections (issue 5 (g)): fuse_hyper_connection
# ---------------------------------------------------------------------------------------------------

_HC_ATTRS = {"sinkhorn_iters": Attr("int", 20), "hc_eps": Attr("float", 1e-6), "norm_eps": Attr("float", 1e-6)}


@register_op("hc_pre_collapse", "x, fn, base, scale, prev_pre", _HC_ATTRS, level="kernel")
class HCPreCollapse:
    """V4.1's single-pass mHC pre (codegen/kernels/hyper_connection.py `pre_program`): from ONE read of the
    streams X, this sublayer's coefficients (hc_stats: mixes, RMS, Sinkhorn) and the collapse with the
    PREVIOUS sublayer's pre (hc_collapse). Returns (collapsed [T, D], pre, post, comb)."""

    def infer(x, fn, base, scale, prev_pre, **attrs):
        return (HCCollapse.infer(x, prev_pre), *HCStats.infer(x, fn, base, scale, **attrs))

    def reference(x, fn, base, scale, prev_pre, **attrs):
        pre, post, comb = HCStats.reference(x, fn, base, scale, **attrs)
        return HCCollapse.reference(x, prev_pre), pre, post, comb


@register_op("hc_post_pre", "y, x, post, comb, fn, base, scale", _HC_ATTRS, level="kernel")
class HCPostPre:
    """V4: a sublayer's mHC post and the next sublayer's pre in one pass over the streams
    (hyper_connection.py `post_program` whose epilogue feeds the `pre` reduction): X' = hc_post(y, X, post, comb)
    is written once and the next hc_pre (mixes, Sinkhorn, collapse with its own pre) reads it from registers.
    Returns (X', collapsed, post', comb')."""

    def infer(y, x, post, comb, fn, base, scale, **attrs):
        xn = HCPost.infer(y, x, post, comb)
        return (xn, *HCPre.infer(xn, fn, base, scale, **attrs))

    def reference(y, x, post, comb, fn, base, scale, **attrs):
        xn = HCPost.reference(y, x, post, comb)
        return (xn, *HCPre.reference(xn, fn, base, scale, **attrs))


@register_op("hc_post_pre_collapse", "y, x, post, comb, fn, base, scale, prev_pre", _HC_ATTRS, level="kernel")
class HCPostPreCollapse:
    """V4.1: a sublayer's mHC post and the next sublayer's single-pass pre (hc_pre_collapse) in one pass over
    the streams. Returns (X', collapsed, pre', post', comb')."""

    def infer(y, x, post, comb, fn, base, scale, prev_pre, **attrs):
        xn = HCPost.infer(y, x, post, comb)
        return (xn, *HCPreCollapse.infer(xn, fn, base, scale, prev_pre, **attrs))

    def reference(y, x, post, comb, fn, base, scale, prev_pre, **attrs):
        xn = HCPost.reference(y, x, post, comb)
        return (xn, *HCPreCollapse.reference(xn, fn, base, scale, prev_pre, **attrs))


# ---------------------------------------------------------------------------------------------------
# Grouped output projection (issue 5 (h)): fuse_out_proj
# ---------------------------------------------------------------------------------------------------


def _mid_quant_ref(u: torch.Tensor, group: int) -> torch.Tensor:
    q, s = QuantFP8.reference(u, group=group)
    return DequantFP8.reference(q, s, group=group, dtype=dt.from_torch(u.dtype))


@register_op(
    "grouped_out_proj",
    "x, wa, wb, sa?, sb?, xs?",
    {"block_a": Attr("int", 128), "block_b": Attr("int", 128), "mid_group": Attr("int", 0)},
    level="kernel",
)
class GroupedOutProj:
    """The attention output projection (MODEL_SPEC §2.11) as one op: u = grouped_linear(x [T, G, K], wa, sa)
    reshaped to [T, G*R], then y = u @ wb^T (linear_fp8 with sb, or linear), with u quantised per `mid_group`
    first when quantisation is on (Q/DQ). Two chained fp8_gemm.py GEMMs whose [T, G*R] intermediate (1024
    wide on V4) stays on chip. Returns [T, N].
    With ``xs``, x is already FP8: e4m3 codes [T, G, K] with their ue8m0 scales xs [T, G, K/block_a] (the
    attention's FP8 epilogue, folded in by fuse_out_proj), i.e. the operand dequant_fp8(x, xs) -- the GEMM takes
    the codes as they are instead of a widened fp32 copy it would quantise again to the same codes."""

    def infer(x, wa, wb, sa, sb, xs=None, *, block_a, block_b, mid_group):
        if xs is not None:
            x = DequantFP8.infer(x, xs, group=block_a, dtype=dt.f32)
        u = GroupedLinear.infer(x, wa, sa, block=block_a)
        u = Reshape.infer(u, shape=[u.shape[0], u.shape[1] * u.shape[2]])
        if mid_group:
            u = DequantFP8.infer(*QuantFP8.infer(u, group=mid_group), group=mid_group, dtype=u.dtype)
        return _gemm_infer(u, wb, sb, block_b, 0)

    def reference(x, wa, wb, sa, sb, xs=None, *, block_a, block_b, mid_group):
        if xs is not None:
            x = DequantFP8.reference(x, xs, group=block_a, dtype=dt.f32)
        u = GroupedLinear.reference(x, wa, sa, block=block_a)
        u = u.reshape(u.shape[0], -1)
        if mid_group:
            u = _mid_quant_ref(u, mid_group)
        return _gemm_ref(u, wb, sb, block_b, 0)


# ---------------------------------------------------------------------------------------------------
# MoE experts (issue 5 (d)): fuse_moe_experts
# ---------------------------------------------------------------------------------------------------

MOE_LAYOUTS = ("contiguous", "masked", "auto")


@register_op(
    "moe_grouped_experts",
    "x, weights, idx, sw1?, sw3?, sw2?, ss1?, ss3?, ss2?, *experts",
    {
        "n_experts": Attr("int"),
        "fmt": Attr("str", "float"),
        "swiglu_limit": Attr("float", 0.0),
        "block": Attr("int", 128),
        "layout": Attr("str", "contiguous"),
        "masked_max_t": Attr("int", 64),
        "shared_limit": Attr("float", 0.0),
        "shared_block": Attr("int", 128),
        "shared_mid_group": Attr("int", 0),
    },
    level="kernel",
)
class MoEGroupedExperts:
    """Routed experts as one grouped GEMM pair with token permutation (codegen/kernels/moe_grouped_gemm.py),
    plus the shared expert in the same op when sw1/sw3/sw2 are given:

        y = moe_experts(x, weights, idx, *experts) + w2_s(swiglu_gate_up(x, w1_s, w3_s))

    The kernel permutes the T*K (token, expert) pairs by expert, runs the gate/up grouped GEMM with the clamped
    SwiGLU epilogue and the down grouped GEMM, and un-permutes with the routing weights; the shared expert is one
    more "expert" every token visits, appended to the same grouped launch. ``layout``: "contiguous" (prefill:
    each expert's rows padded to the M tile, DeepGEMM's contiguous layout), "masked" (decode: a fixed
    [E, max rows] buffer with per-expert counts, CUDA-graph friendly), or "auto" (T symbolic: the runtime
    takes "masked" for T <= masked_max_t). ``shared_mid_group``: the shared SwiGLU output is quantised (Q/DQ)
    before its down GEMM. The reference is the composition (same order, so the same numbers).
    """

    def infer(x, weights, idx, sw1, sw3, sw2, ss1, ss3, ss2, *experts, n_experts, fmt, swiglu_limit, block, layout,
              masked_max_t, shared_limit, shared_block, shared_mid_group):  # fmt: skip
        if layout not in MOE_LAYOUTS:
            raise shape_fail("moe_grouped_experts", f"layout {layout!r} is not one of {MOE_LAYOUTS}", x)
        y = MoEExperts.infer(x, weights, idx, *experts, n_experts=n_experts, fmt=fmt, swiglu_limit=swiglu_limit,
                             block=block)  # fmt: skip
        if sw1 is not None:
            h = SwiGLUGateUp.infer(x, sw1, sw3, ss1, ss3, limit=shared_limit, block=shared_block, act_group=0)
            if shared_mid_group:
                h = DequantFP8.infer(*QuantFP8.infer(h, group=shared_mid_group), group=shared_mid_group,
                                     dtype=h.dtype)  # fmt: skip
            _broadcast_add_check(y, _gemm_infer(h, sw2, ss2, shared_block, 0))
        return y

    def reference(x, weights, idx, sw1, sw3, sw2, ss1, ss3, ss2, *experts, n_experts, fmt, swiglu_limit, block,
                  layout, masked_max_t, shared_limit, shared_block, shared_mid_group):  # fmt: skip
        y = MoEExperts.reference(x, weights, idx, *experts, n_experts=n_experts, fmt=fmt, swiglu_limit=swiglu_limit,
                                 block=block)  # fmt: skip
        if sw1 is None:
            return y
        h = SwiGLUGateUp.reference(x, sw1, sw3, ss1, ss3, limit=shared_limit, block=shared_block, act_group=0)
        if shared_mid_group:
            h = _mid_quant_ref(h, shared_mid_group)
        return torch.add(y, _gemm_ref(h, sw2, ss2, shared_block, 0))


def _broadcast_add_check(a: TensorType, b: TensorType) -> None:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise shape_fail("moe_grouped_experts", "the shared expert's output must match the routed output", a, b)


# ---------------------------------------------------------------------------------------------------
# V4.1 compressor with index keys (issue 5 (f)): fuse_compressor
# ---------------------------------------------------------------------------------------------------


@register_op(
    "pair_compressor_keys",
    "kv, score, state_kv, state_score, positions, norm, wk, k_norm",
    {"eps": Attr("float", 1e-6), **ROPE_ATTRS},
    stateful=True,
    writes={3: 2, 4: 3},
    level="kernel",
)
class PairCompressorKeys:
    """A V4.1 ratio-2 kv source's compressor with its index keys (MODEL_SPEC §2.13) as one op:

        pooled, entry_pos, entry_idx, state' = pair_compressor(kv, score, state_kv, state_score, positions)
        latent = rmsnorm(pooled, norm)                 the pre-RoPE latent
        entry  = rope(latent, entry_pos)               the compressed KV row
        keys   = rope(rmsnorm(latent @ wk^T, k_norm), entry_pos)      the index key row

    One kernel pools the pairs, normalises and rotates the latent and runs the small wk GEMM on it while it is
    on chip. No codegen/kernels/ family implements it yet (kernel selection runs the torch reference).
    Returns (entry [(T+1)//2, d], keys [(T+1)//2, di], entry_idx, state_kv', state_score'); the cache writes
    stay scatter_rows.
    """

    def infer(kv, score, state_kv, state_score, positions, norm, wk, k_norm, *, eps, **rope):
        pooled, entry_pos, entry_idx, new_kv, new_score = PairCompressor.infer(kv, score, state_kv, state_score,
                                                                               positions)  # fmt: skip
        latent, keys = CompressorKeys.infer(pooled, entry_pos, norm, wk, k_norm, eps=eps)
        return latent, keys, entry_idx, new_kv, new_score

    def reference(kv, score, state_kv, state_score, positions, norm, wk, k_norm, *, eps, **rope):
        pooled, entry_pos, entry_idx, new_kv, new_score = PairCompressor.reference(kv, score, state_kv, state_score,
                                                                                   positions)  # fmt: skip
        entry, keys = CompressorKeys.reference(pooled, entry_pos, norm, wk, k_norm, eps=eps, **rope)
        return entry, keys, entry_idx, new_kv, new_score


@register_op(
    "compressor_keys",
    "kv, positions, norm, wk, k_norm",
    {"eps": Attr("float", 1e-6), **ROPE_ATTRS},
    level="kernel",
)
class CompressorKeys:
    """A V4.1 ratio-1 kv source (no pooling: one entry per token, MODEL_SPEC §2.13) with its index keys:
    latent = rmsnorm(kv, norm); entry = rope(latent, positions); keys = rope(rmsnorm(latent @ wk^T, k_norm),
    positions). pair_compressor_keys without the pair pooling (no codegen family yet either). Returns
    (entry, keys)."""

    def infer(kv, positions, norm, wk, k_norm, *, eps, **rope):
        latent = RMSNorm.infer(kv, norm, eps=eps)
        return latent, RMSNorm.infer(Linear.infer(latent, wk, None), k_norm, eps=eps)

    def reference(kv, positions, norm, wk, k_norm, *, eps, **rope):
        latent = RMSNorm.reference(kv, norm, eps=eps)
        entry = Rope.reference(latent, positions, inverse=False, **rope)
        keys = RMSNorm.reference(Linear.reference(latent, wk, None), k_norm, eps=eps)
        return entry, Rope.reference(keys, positions, inverse=False, **rope)


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
