"""MoE ops: routing (score top-k or hash), the clamped SwiGLU, and the routed experts (MODEL_SPEC §2.12)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import TensorType
from deepinfer.ir.ops.attention import stable_topk_indices
from deepinfer.ir.ops.quant import dequant_fp4_rows, dequant_fp8_blocks
from deepinfer.ir.registry import Attr, register_op, shape_fail

SCORING = {
    "sqrtsoftplus": lambda s: F.softplus(s).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda s: torch.softmax(s, dim=-1),
}


@register_op(
    "moe_route",
    "logits, bias?, tid2eid?, tokens?",
    {
        "topk": Attr("int"),
        "scoring": Attr("str", "sqrtsoftplus"),
        "route_scale": Attr("float", 1.0),
        "normalize": Attr("bool", True),
    },
    level="model",
)
class MoERoute:
    """Expert choice and weights (MODEL_SPEC §2.12).

    logits [T, E] = x @ W_gate^T (fp32). score = sqrt(softplus(logits)) (``scoring``).
    Score routing: idx = topk(score + bias) (bias only selects; ties to the lower expert index).
    Hash routing (tid2eid [V, K] and tokens [T] given): idx = tid2eid[token].
    weights = score[idx] / sum(score[idx]) * route_scale (the division only when normalize).
    Returns (weights f32 [T, K], idx i64 [T, K]).
    """

    def infer(logits, bias, tid2eid, tokens, *, topk, scoring, route_scale, normalize):
        if logits.rank != 2:
            raise shape_fail("moe_route", "logits must be [T, E]", logits)
        t, e = logits.shape
        if scoring not in SCORING:
            raise shape_fail("moe_route", f"scoring {scoring!r} is not one of {sorted(SCORING)}", logits)
        if bias is not None and bias.shape != (e,):
            raise shape_fail("moe_route", "bias must be [E]", logits, bias)
        if (tid2eid is None) != (tokens is None):
            raise shape_fail("moe_route", "hash routing needs both tid2eid and tokens", tid2eid, tokens)
        if tid2eid is not None and (tid2eid.rank != 2 or tid2eid.shape[1] != topk or tokens.shape != (t,)):
            raise shape_fail("moe_route", f"needs tid2eid [V, {topk}] and tokens [T]", logits, tid2eid, tokens)
        return TensorType(dt.f32, (t, topk)), TensorType(dt.i64, (t, topk))

    def reference(logits, bias, tid2eid, tokens, *, topk, scoring, route_scale, normalize):
        score = SCORING[scoring](logits.float())
        if tid2eid is not None:
            idx = tid2eid[tokens.long()].long()
        else:
            idx = stable_topk_indices(score if bias is None else score + bias.float(), topk)
        w = torch.gather(score, 1, idx)
        if normalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w * route_scale, idx


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    g, u = g.float(), u.float()
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return F.silu(g) * u


@register_op("swiglu", "gate, up", {"limit": Attr("float", 0.0)}, level="model")
class SwiGLU:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32 (limit 0 = no clamp; V4 uses 10, §2.12)."""

    def infer(gate, up, *, limit):
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise shape_fail("swiglu", "gate and up must have one shape and dtype", gate, up)
        return gate

    def reference(gate, up, *, limit):
        return swiglu(gate, up, limit).to(gate.dtype)


EXPERT_FORMATS = {"float": 3, "fp8": 6, "fp4": 6}  # tensors per expert: (w1, w2, w3) or with their scales


def _expert_weight(fmt: str, w: torch.Tensor, s: torch.Tensor | None, block: int) -> torch.Tensor:
    if fmt == "fp4":
        return dequant_fp4_rows(w, s, 32)
    if fmt == "fp8":
        return dequant_fp8_blocks(w, s, block)
    return w.float()


def _logical_cols(fmt: str, w: TensorType):
    return w.shape[1] * 2 if fmt == "fp4" else w.shape[1]


@register_op(
    "moe_experts",
    "x, weights, idx, *experts",
    {
        "n_experts": Attr("int"),
        "fmt": Attr("str", "float"),
        "swiglu_limit": Attr("float", 0.0),
        "block": Attr("int", 128),
    },
    level="model",
)
class MoEExperts:
    """Routed experts: y_t = sum_k weights[t, k] * W2_e (swiglu(W1_e x_t, W3_e x_t)), e = idx[t, k] (§2.12).

    x [T, D], weights [T, K], idx [T, K]; experts: per expert e in order, (w1, w2, w3) for fmt "float"
    ([I, D], [D, I], [I, D]) or (w1, s1, w2, s2, w3, s3) for "fp4" (packed [out, in/2] with e8m0 [out, in/32])
    and "fp8" (block-scaled). The SwiGLU is clamped at swiglu_limit; computed in fp32. Returns [T, D].
    """

    def infer(x, weights, idx, *experts, n_experts, fmt, swiglu_limit, block):
        if fmt not in EXPERT_FORMATS:
            raise shape_fail("moe_experts", f"fmt {fmt!r} is not one of {sorted(EXPERT_FORMATS)}", x)
        per = EXPERT_FORMATS[fmt]
        if len(experts) != per * n_experts:
            raise shape_fail("moe_experts", f"needs {per} tensors for each of {n_experts} experts", x)
        if x.rank != 2 or weights.rank != 2 or idx.shape != weights.shape or idx.shape[0] != x.shape[0]:
            raise shape_fail("moe_experts", "needs x [T, D], weights [T, K], idx [T, K]", x, weights, idx)
        step = per // 3
        for e in range(n_experts):
            w1, w2, w3 = experts[per * e], experts[per * e + step], experts[per * e + 2 * step]
            d, inter = x.shape[1], w1.shape[0]
            if (
                _logical_cols(fmt, w1) != d
                or w3.shape != w1.shape
                or w2.shape[0] != d
                or _logical_cols(fmt, w2) != inter
            ):
                raise shape_fail("moe_experts", f"expert {e} weights must be w1/w3 [I, D] and w2 [D, I]", x, w1, w2, w3)
        return x

    def reference(x, weights, idx, *experts, n_experts, fmt, swiglu_limit, block):
        per = EXPERT_FORMATS[fmt]
        step = per // 3
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        xf = x.float()
        for e in torch.unique(idx).tolist():
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            ws = experts[per * e : per * (e + 1)]
            scales = ws[1::2] if step == 2 else (None, None, None)
            w1, w2, w3 = (_expert_weight(fmt, w, s, block) for w, s in zip(ws[::step], scales))
            h = swiglu(xf[tok] @ w1.T, xf[tok] @ w3.T, swiglu_limit)
            out.index_add_(0, tok, (h @ w2.T) * weights[tok, slot].float().unsqueeze(-1))
        return out.to(x.dtype)
