"""mHC hyper-connection ops (MODEL_SPEC §2.2, §2.3, §2.4).

The residual stream of a V4 block is ``n_hc`` parallel streams ``X [T, n, D]``. Each sublayer computes
coefficients from its own input streams (``hc_pre``), runs on their collapse, and mixes its output back in
(``hc_post``). The final ``hc_head`` collapses the streams before the output norm.
"""

from __future__ import annotations

import torch

from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import TensorType
from deepinfer.ir.registry import Attr, register_op, shape_fail


def _check_streams(op: str, x: TensorType, fn: TensorType, rows: int) -> tuple:
    if x.rank != 3:
        raise shape_fail(op, "streams must be [T, n_hc, D]", x)
    t, n, d = x.shape
    if fn.shape != (rows, n * d):
        raise shape_fail(op, f"fn must be [{rows}, n_hc*D]", x, fn)
    return t, n, d


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """(flatten(X) @ fn^T) * rsqrt(mean(flatten(X)^2) + eps): the RMS is over the whole n*D vector."""
    flat = x.flatten(-2).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return flat @ fn.float().T


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Softmax over k, then alternate column/row normalisation: columns first (sum over j = dim -2)."""
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_coefficients(x, fn, base, scale, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """(pre [.., n], post [.., n], comb [.., n, n]) in fp32 with comb[j, k] = mix element 8 + n*j + k."""
    n = x.shape[-2]
    mixes = hc_mixes(x, fn, norm_eps)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = (mixes[..., 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n))
    return pre, post, sinkhorn(comb, sinkhorn_iters, hc_eps)


def collapse(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i * X_i, accumulated in fp32, cast back to X's dtype."""
    return (weights.unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)


@register_op(
    "hc_pre",
    "x, fn, base, scale",
    {"sinkhorn_iters": Attr("int", 20), "hc_eps": Attr("float", 1e-6), "norm_eps": Attr("float", 1e-6)},
    level="model",
)
class HCPre:
    """mHC coefficients and collapse for one sublayer (MODEL_SPEC §2.2).

    x [T, n, D] streams; fn [(2+n)*n, n*D], base [(2+n)*n], scale [3] (fp32). Returns the collapsed sublayer
    input [T, D] (x's dtype), post [T, n] and the Sinkhorn-projected comb [T, n, n] (both fp32), where
    comb[t, j, k] weighs input stream j into output stream k.
    """

    def infer(x, fn, base, scale, *, sinkhorn_iters, hc_eps, norm_eps):
        t, n, d = _check_streams("hc_pre", x, fn, (2 + x.shape[1]) * x.shape[1] if x.rank == 3 else 0)
        if base.shape != (fn.shape[0],) or scale.shape != (3,):
            raise shape_fail("hc_pre", "base must be [(2+n)*n] and scale [3]", fn, base, scale)
        return TensorType(x.dtype, (t, d)), TensorType(dt.f32, (t, n)), TensorType(dt.f32, (t, n, n))

    def reference(x, fn, base, scale, *, sinkhorn_iters, hc_eps, norm_eps):
        pre, post, comb = hc_coefficients(
            x, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps
        )
        return collapse(x, pre), post, comb


@register_op("hc_post", "y, x, post, comb", level="model")
class HCPost:
    """Expand a sublayer output back into the streams: X'_k = post_k * y + sum_j comb[j, k] * X_j.

    MODEL_SPEC §2.2 orientation trap: the residual mix sums over the FIRST index of comb (X' = post*y + comb^T X).
    y [T, D], x [T, n, D], post [T, n], comb [T, n, n] -> [T, n, D] in x's dtype (mixed in fp32).
    """

    def infer(y, x, post, comb):
        if x.rank != 3 or y.shape != (x.shape[0], x.shape[2]):
            raise shape_fail("hc_post", "needs y [T, D] and x [T, n, D]", y, x)
        t, n, _ = x.shape
        if post.shape != (t, n) or comb.shape != (t, n, n):
            raise shape_fail("hc_post", "needs post [T, n] and comb [T, n, n]", x, post, comb)
        return x

    def reference(y, x, post, comb):
        mixed = torch.einsum("tjk,tjd->tkd", comb.float(), x.float())
        return (post.float().unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(x.dtype)


@register_op(
    "hc_head", "x, fn, base, scale", {"hc_eps": Attr("float", 1e-6), "norm_eps": Attr("float", 1e-6)}, level="model"
)
class HCHead:
    """Final V4 stream collapse (MODEL_SPEC §2.4): p = sigmoid(mixes * scale + base) + hc_eps, h = sum_i p_i X_i.

    x [T, n, D]; fn [n, n*D], base [n], scale [1] (fp32) -> [T, D] in x's dtype.
    """

    def infer(x, fn, base, scale, *, hc_eps, norm_eps):
        t, n, d = _check_streams("hc_head", x, fn, x.shape[1] if x.rank == 3 else 0)
        if base.shape != (n,) or scale.shape != (1,):
            raise shape_fail("hc_head", "base must be [n] and scale [1]", fn, base, scale)
        return TensorType(x.dtype, (t, d))

    def reference(x, fn, base, scale, *, hc_eps, norm_eps):
        mixes = hc_mixes(x, fn, norm_eps)
        pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
        return collapse(x, pre)
