"""V4 attention ops: RoPE, the sliding-window KV ring, the compressor, the lightning indexer, sparse attention
with the learned sink, and the grouped output projection (MODEL_SPEC §2.5–2.11, §3).

Conventions shared by these ops (one sequence per call; the runtime owns the state):
- ``positions [T]`` are the absolute positions of the T new tokens, contiguous: start, start+1, ..., start+T-1.
  Prefill is T = prompt length with start = 0; decode is T = 1. The ops derive ``start = positions[0]``.
- The window KV cache is a ring of ``W`` rows: position p lives in slot p % W. Before a call it holds the
  last W positions before ``start`` (those >= 0); rows of negative positions are never read.
- Compressed caches hold one row per emitted window w (row index w); window w covers positions m*w .. m*w+m-1
  and is emitted when its last token arrives. Before a call they hold the windows w < start // m.
- Compressor state is a ring of R rows (slot p % R) holding each token's projected kv and score (+ape):
  R = m for the "block" compressor (HCA), R = 2m for the "overlap" compressor (CSA), which also needs the
  previous window's first half.
- Index lists use -1 for "no entry" (padding, or not visible to this query).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import TensorType
from deepinfer.ir.ops.quant import dequant_fp8_blocks
from deepinfer.ir.registry import Attr, register_op, shape_fail

ROPE_ATTRS = {
    "rope_dim": Attr("int"),
    "theta": Attr("float"),
    "yarn_factor": Attr("float", 1.0),
    "yarn_orig_len": Attr("int", 0),
    "beta_fast": Attr("float", 32.0),
    "beta_slow": Attr("float", 1.0),
}


# ---------------------------------------------------------------------------------------------------
# RoPE (§2.6, §2.7)
# ---------------------------------------------------------------------------------------------------


def rope_inv_freq(rope_dim, theta, yarn_factor=1.0, yarn_orig_len=0, beta_fast=32.0, beta_slow=1.0):
    """f_i = theta^(-2i/r), i < r/2, fp32; with YaRN (factor > 1) blended towards f_i/factor on a linear ramp.

    The ramp runs from floor(corr(beta_fast)) to ceil(corr(beta_slow)) with corr(b) = r*ln(L0/(2*pi*b))/(2*ln theta),
    clamped to [0, r-1]; no mscale (MODEL_SPEC §2.7: cos/sin are not scaled).
    """
    freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn_factor <= 1.0:
        return freq

    def corr(beta: float) -> float:
        return rope_dim * math.log(yarn_orig_len / (beta * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return freq / yarn_factor * ramp + freq * (1 - ramp)


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def _inv_freq_on(device, *freq_args) -> torch.Tensor:
    """rope_inv_freq(*freq_args) on `device`, made once per (device, args): the same values without a CPU
    computation and a host -> device copy on every call (a pageable copy a CUDA graph could not capture)."""
    key = (str(device), *freq_args)
    if key not in _INV_FREQ:
        _INV_FREQ[key] = rope_inv_freq(*freq_args).to(device)
    return _INV_FREQ[key]


def apply_rope(x, positions, *, rope_dim, theta, yarn_factor, yarn_orig_len, beta_fast, beta_slow, inverse=False):
    """Rotate the LAST rope_dim channels of x [T, ..., d] as interleaved pairs (x[2i] + i*x[2i+1]) * e^{i*p*f_i}.

    Computed in fp32 and cast back; inverse=True applies the conjugate rotation (RoPE^-1, §2.10).
    """
    freq = _inv_freq_on(x.device, rope_dim, theta, yarn_factor, yarn_orig_len, beta_fast, beta_slow)
    angle = positions.float().unsqueeze(-1) * freq  # [T, r/2]
    angle = angle.reshape(angle.shape[:1] + (1,) * (x.dim() - 2) + angle.shape[1:])
    cos, sin = angle.cos(), angle.sin()
    if inverse:
        sin = -sin
    nope, rot = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def _rope_kwargs(attrs: dict) -> dict:
    return {k: attrs[k] for k in ROPE_ATTRS}


def _check_positions(op: str, positions: TensorType, t, *others) -> None:
    if positions.dtype not in (dt.i32, dt.i64) or positions.shape != (t,):
        raise shape_fail(op, "positions must be an integer [T] matching the tokens", positions, *others)


@register_op("rope", "x, positions", {**ROPE_ATTRS, "inverse": Attr("bool", False)}, level="model")
class Rope:
    """Interleaved partial RoPE with optional YaRN on the last rope_dim channels (MODEL_SPEC §2.6–2.7).

    x [T, ..., d] (position axis first), positions [T]. Frequencies are computed from positions inside the op.
    inverse=True de-rotates (used on the attention output at the query position, §2.10).
    """

    def infer(x, positions, *, rope_dim, inverse, **_):
        _check_positions("rope", positions, x.shape[0], x)
        d = x.shape[-1]
        if rope_dim % 2 or (isinstance(d, int) and d < rope_dim):
            raise shape_fail("rope", f"rope_dim {rope_dim} must be even and <= the last dim", x)
        return x

    def reference(x, positions, *, inverse, **attrs):
        return apply_rope(x, positions, inverse=inverse, **attrs)


# ---------------------------------------------------------------------------------------------------
# Sliding-window KV (§2.6)
# ---------------------------------------------------------------------------------------------------


def last_rows_slots(positions: torch.Tensor, size: int) -> torch.Tensor:
    """Ring slot p % size for the last `size` positions of the batch, -1 for older ones (they would collide)."""
    keep = positions > positions[-1] - size
    return torch.where(keep, positions % size, torch.full_like(positions, -1)).long()


@register_op("ring_slots", "positions", {"size": Attr("int")}, level="model")
class RingSlots:
    """Slots of a ring cache of `size` rows for new tokens: p % size for the last `size` tokens, else -1.

    Feed it to scatter_rows to write the window KV ring (§3: SWA ring per request).
    """

    def infer(positions, *, size):
        _check_positions("ring_slots", positions, positions.shape[0] if positions.rank == 1 else None)
        return TensorType(dt.i64, positions.shape)

    def reference(positions, *, size):
        return last_rows_slots(positions, size)


@register_op("window_indices", "positions", {"window": Attr("int")}, level="model")
class WindowIndices:
    """For each query, the rows of pool = concat(ring [W], new kv [T]) holding positions p-W+1 .. p (§2.6).

    Returns i64 [T, W] in ascending position order; -1 for negative positions. A position q before the batch
    start lives in ring slot q % W; a position in the batch lives at row W + (q - start).
    """

    def infer(positions, *, window):
        t = positions.shape[0]
        _check_positions("window_indices", positions, t)
        return TensorType(dt.i64, (t, window))

    def reference(positions, *, window):
        start = positions[0]
        q = positions.long().unsqueeze(-1) - window + 1 + torch.arange(window, device=positions.device)
        idx = torch.where(q >= start, window + (q - start), q % window)
        return torch.where(q >= 0, idx, torch.full_like(idx, -1))


# ---------------------------------------------------------------------------------------------------
# Compressor (§2.8) and its decode state (§3)
# ---------------------------------------------------------------------------------------------------


def compressor_reference(kv, score, ape, norm_w, state_kv, state_score, positions, *, ratio, overlap, eps, **rope):
    """Emit the windows that complete in this batch; returns (entries, entry_idx, new state_kv, new state_score)."""
    m, rows = ratio, state_kv.shape[0]
    d = kv.shape[-1] // (2 if overlap else 1)
    pos = positions.long()
    # start stays a [1] tensor on the positions' device (no host read: a decode step can be a CUDA graph)
    start, t = pos[:1], pos.shape[0]
    # The history ring holds positions start-rows .. start-1; their score already includes ape.
    hist_pos = start - rows + torch.arange(rows, device=kv.device)
    hist_kv, hist_score = state_kv.float()[hist_pos % rows], state_score.float()[hist_pos % rows]
    hist_score = hist_score.masked_fill((hist_pos < 0).unsqueeze(-1), float("-inf"))
    new_score = score.float() + ape.float()[pos % m]
    seq_kv = torch.cat([hist_kv, kv.float()])  # row r holds position start - rows + r
    seq_score = torch.cat([hist_score, new_score])

    n_out = (t + m - 1) // m
    w = start // m + torch.arange(n_out, device=kv.device)
    valid = w < (start + t) // m
    slot = torch.arange(m, device=kv.device)
    cur = (m * w.unsqueeze(-1) + slot - (start - rows)).clamp(0, seq_kv.shape[0] - 1)  # [n_out, m]
    if overlap:
        prev = (cur - m).clamp(min=0)
        prev_score = seq_score[prev][..., :d].masked_fill((w == 0).view(-1, 1, 1), float("-inf"))
        slots_kv = torch.cat([seq_kv[prev][..., :d], seq_kv[cur][..., d:]], dim=1)  # [n_out, 2m, d]
        slots_score = torch.cat([prev_score, seq_score[cur][..., d:]], dim=1)
    else:
        slots_kv, slots_score = seq_kv[cur], seq_score[cur]
    pooled = (slots_kv * torch.softmax(slots_score, dim=1)).sum(dim=1)
    pooled = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + eps) * norm_w.float()
    pooled = apply_rope(pooled, w * m, **rope)  # at the window's FIRST position
    pooled = torch.where(valid.unsqueeze(-1), pooled, torch.zeros_like(pooled)).to(kv.dtype)
    entry_idx = torch.where(valid, w, torch.full_like(w, -1))

    # the last R tokens go to their ring slots; older ones (slot -1) to a spare row R that is dropped
    slots = last_rows_slots(pos, rows)
    dest = torch.where(slots >= 0, slots, rows)
    new_state_kv = torch.cat([state_kv, state_kv[:1]]).index_put_((dest,), kv.to(state_kv.dtype))
    new_state_score = torch.cat([state_score, state_score[:1]]).index_put_((dest,), new_score.to(state_score.dtype))
    return pooled, entry_idx, new_state_kv[:rows], new_state_score[:rows]


@register_op(
    "compressor",
    "kv, score, ape, norm, state_kv, state_score, positions",
    {"ratio": Attr("int"), "overlap": Attr("bool"), "eps": Attr("float", 1e-6), **ROPE_ATTRS},
    stateful=True,
    writes={2: 4, 3: 5},
    level="model",
)
class Compressor:
    """V4 KV compressor (MODEL_SPEC §2.8): gated softmax pooling of m-token windows, RMSNorm, RoPE at m*w.

    kv, score [T, c*d]: the token projections x@wkv^T and x@wgate^T (c = 2 when overlap, else 1); ape [m, c*d];
    norm [d]; state_kv, state_score [R, c*d] (R = 2m with overlap, else m); positions [T].
    Block (HCA): entry w pools the m slots of window w. Overlap (CSA, m = 4): entry w pools 2m slots, the first
    half channels [:d] of window w-1 and the second half [d:] of window w (window 0 has no first half).
    Softmax per channel over the slots, in fp32. Returns:
      entries [(T+m-1)//m, d]: row i is window start//m + i, zero when it does not complete in this batch;
      entry_idx i64 [(T+m-1)//m]: that window index, or -1 (so scatter_rows writes only emitted windows);
      state_kv, state_score: the rings updated with this batch's last R tokens (score stored with ape added).
    """

    def infer(kv, score, ape, norm, state_kv, state_score, positions, *, ratio, overlap, eps, rope_dim, **_):
        c = 2 if overlap else 1
        t, width = kv.shape if kv.rank == 2 else (None, None)
        d = norm.shape[0]
        if kv.rank != 2 or score.shape != kv.shape or width != c * d:
            raise shape_fail("compressor", f"kv/score must be [T, {c}*d] with d = norm's size", kv, score, norm)
        if ape.shape != (ratio, width):
            raise shape_fail("compressor", f"ape must be [{ratio}, {c}*d]", ape, kv)
        rows = ratio * c
        if state_kv.shape != (rows, width) or state_score.shape != (rows, width):
            raise shape_fail("compressor", f"state must be [{rows}, {c}*d]", state_kv, state_score)
        _check_positions("compressor", positions, t, kv)
        n_out = (t + (ratio - 1)) // ratio
        return (
            TensorType(kv.dtype, (n_out, d)),
            TensorType(dt.i64, (n_out,)),
            state_kv,
            state_score,
        )

    def reference(kv, score, ape, norm, state_kv, state_score, positions, *, ratio, overlap, eps, **rope):
        return compressor_reference(
            kv, score, ape, norm, state_kv, state_score, positions, ratio=ratio, overlap=overlap, eps=eps, **rope
        )


@register_op("compressed_indices", "positions, cache", {"ratio": Attr("int")}, level="model")
class CompressedIndices:
    """HCA visibility (MODEL_SPEC §2.10): query at p sees every compressed entry w < (p+1)//m.

    positions [T], cache [C, d] (only its row count is used) -> i64 [T, C]: w where visible, else -1.
    """

    def infer(positions, cache, *, ratio):
        t = positions.shape[0]
        _check_positions("compressed_indices", positions, t)
        return TensorType(dt.i64, (t, cache.shape[0]))

    def reference(positions, cache, *, ratio):
        w = torch.arange(cache.shape[0], device=positions.device)
        visible = w < (positions.long().unsqueeze(-1) + 1) // ratio
        return torch.where(visible, w, torch.full_like(w, -1))


# ---------------------------------------------------------------------------------------------------
# Lightning indexer (§2.9)
# ---------------------------------------------------------------------------------------------------


def indexer_scores(q, weights, keys, positions, *, ratio, scale):
    """S(t, w) = sum_h weights[t, h] * ReLU(q[t, h] . k_w) * scale, with invisible entries (w >= (p+1)//m) -inf."""
    s = torch.relu(torch.einsum("thd,cd->thc", q.float(), keys.float())) * scale
    s = (s * weights.float().unsqueeze(-1)).sum(dim=1)
    w = torch.arange(keys.shape[0], device=keys.device)
    visible = w < (positions.long().unsqueeze(-1) + 1) // ratio
    return s.masked_fill(~visible, float("-inf")), visible


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, ties to the LOWER index (stable descending sort)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


@register_op(
    "indexer_topk",
    "q, weights, keys, positions",
    {"ratio": Attr("int"), "topk": Attr("int"), "scale": Attr("float")},
    level="model",
)
class IndexerTopK:
    """Lightning-indexer scores and top-k selection of compressed entries (MODEL_SPEC §2.9).

    q [T, Hi, di] (RoPE'd), weights [T, Hi] (already scaled by Hi^-0.5), keys [C, di] (the index-key cache),
    positions [T] -> i64 [T, topk]. Entries a query cannot see (w >= (p+1)//m, or beyond the cache) are -1.
    Tie rule: among equal scores the LOWER entry index wins (stable sort). ReLU makes exact ties common
    (§2.9 tie trap), so a different implementation may pick a different but equally-scored set.
    """

    def infer(q, weights, keys, positions, *, ratio, topk, scale):
        if q.rank != 3 or weights.shape != q.shape[:2] or keys.rank != 2 or keys.shape[1] != q.shape[2]:
            raise shape_fail("indexer_topk", "needs q [T, Hi, di], weights [T, Hi], keys [C, di]", q, weights, keys)
        _check_positions("indexer_topk", positions, q.shape[0], q)
        return TensorType(dt.i64, (q.shape[0], topk))

    def reference(q, weights, keys, positions, *, ratio, topk, scale):
        scores, visible = indexer_scores(q, weights, keys, positions, ratio=ratio, scale=scale)
        k = min(topk, keys.shape[0])
        idx = stable_topk_indices(scores, k)
        idx = torch.where(torch.gather(visible, 1, idx), idx, torch.full_like(idx, -1))
        return F.pad(idx, (0, topk - k), value=-1)


# ---------------------------------------------------------------------------------------------------
# Sparse attention core (§2.10) and grouped output projection (§2.11)
# ---------------------------------------------------------------------------------------------------


def _gather_rows(kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return kv.float()[idx.long().clamp(min=0)]  # [T, K, d]


@register_op(
    "sparse_attention",
    "q, sink, win_kv, win_idx, cmp_kv?, cmp_idx?",
    {"scale": Attr("float")},
    level="model",
)
class SparseAttention:
    """Shared-KV MQA over gathered rows with a learned per-head sink (MODEL_SPEC §2.10).

    q [T, H, d]; sink [H] (fp32); win_kv [N, d] with win_idx [T, Kw]; optionally cmp_kv [C, d] with
    cmp_idx [T, Kc]. Index -1 = skip. For each query the KV set is the union of the indexed rows (K = V):
    p_j = exp(l_j - m) / (sum_j exp(l_j - m) + exp(sink_h - m)), l_j = q.k_j * scale; o = sum_j p_j k_j.
    The sink has no value; a query with no rows gets o = 0. Returns [T, H, d] in q's dtype.
    """

    def infer(q, sink, win_kv, win_idx, cmp_kv, cmp_idx, *, scale):
        if q.rank != 3 or sink.shape != (q.shape[1],):
            raise shape_fail("sparse_attention", "needs q [T, H, d] and sink [H]", q, sink)
        for kv, idx in ((win_kv, win_idx), (cmp_kv, cmp_idx)):
            if (kv is None) != (idx is None):
                raise shape_fail("sparse_attention", "cmp_kv and cmp_idx come together", kv, idx)
            if kv is None:
                continue
            if kv.rank != 2 or kv.shape[1] != q.shape[2] or idx.rank != 2 or idx.shape[0] != q.shape[0]:
                raise shape_fail("sparse_attention", "needs kv [N, d] and idx [T, K]", q, kv, idx)
            if idx.dtype not in (dt.i32, dt.i64):
                raise shape_fail("sparse_attention", "indices must be integers", idx)
        return q

    def reference(q, sink, win_kv, win_idx, cmp_kv, cmp_idx, *, scale):
        rows, valid = [_gather_rows(win_kv, win_idx)], [win_idx >= 0]
        if cmp_kv is not None:
            rows.append(_gather_rows(cmp_kv, cmp_idx))
            valid.append(cmp_idx >= 0)
        kv, valid = torch.cat(rows, dim=1), torch.cat(valid, dim=1)  # [T, K, d], [T, K]
        logits = torch.einsum("thd,tkd->thk", q.float(), kv) * scale
        logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
        sinks = sink.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
        combined = torch.cat([logits, sinks], dim=-1)
        probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        return torch.einsum("thk,tkd->thd", probs, kv).to(q.dtype)


@register_op("grouped_linear", "x, w, scale?", {"block": Attr("int", 128)}, level="model")
class GroupedLinear:
    """Block-diagonal projection (MODEL_SPEC §2.11): out[t, g] = w[g] @ x[t, g] with w [G*R, K] viewed [G, R, K].

    x [T, G, K] -> [T, G, R]. w may be f8e4m3 with block-scaled e8m0 scale (dequantised, fp32 accumulate).
    """

    def infer(x, w, scale, *, block):
        if x.rank != 3 or w.rank != 2 or w.shape[1] != x.shape[2]:
            raise shape_fail("grouped_linear", "needs x [T, G, K] and w [G*R, K]", x, w)
        if (w.dtype == dt.f8e4m3) != (scale is not None):
            raise shape_fail("grouped_linear", "an f8e4m3 weight needs its scale (and only it)", w, scale)
        g, rows = x.shape[1], w.shape[0]
        if isinstance(g, int) and isinstance(rows, int) and rows % g:
            raise shape_fail("grouped_linear", "weight rows must divide into the groups", x, w)
        return x.with_shape((x.shape[0], g, rows // g))

    def reference(x, w, scale, *, block):
        wf = dequant_fp8_blocks(w, scale, block) if scale is not None else w.float()
        g = x.shape[1]
        return torch.einsum("tgk,grk->tgr", x.float(), wf.view(g, -1, wf.shape[1])).to(x.dtype)
