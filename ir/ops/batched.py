"""Batched decode forms of the sequence-dependent ops: ONE call decodes B independent sequences, one token each
(passes/batch_decode.py makes such graphs from the one-sequence graph).

Conventions (they differ from attention.py's one-sequence-per-call ones):
- tokens [B], positions [B]: row b is sequence b's next token and its absolute position; positions are NOT
  contiguous across rows (each sequence has its own length).
- Caches are flattened pools: sequence b's rows of a per-sequence cache [N, ...] are rows b*N .. b*N+N-1 of a
  [B*N, ...] pool (the [B, N, ...] static tensor the runtime keeps, viewed flat). N is read off the shapes
  (pool rows // B), never from a host value, so every op here is sync-free (a decode step can be a CUDA graph).
- Index lists are either per sequence (0..N-1, as the one-sequence ops return them) or flat pool rows (what
  gather ops -- scatter_rows, sparse attention -- read); ``batched_rows`` turns the first into the second.
  -1 = no entry in both.

Each op's reference is a vectorised torch form with the same per-row arithmetic as the one-sequence reference
at T = 1 (same fp32 formulas, same reduction lengths), so it returns exactly what B one-sequence calls return --
but for a GEMM over the B rows (the index keys' wk product in batched_pair_compressor_keys), whose blocking, as
every row-wise GEMM's, depends on the row count (fp32 rounding). No loop over sequences: one launch per torch op
whatever B is. tests/passes/test_batch_decode.py checks all of it against the one-sequence graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import TensorType
from deepinfer.ir.ops.attention import ROPE_ATTRS, apply_rope, stable_topk_indices
from deepinfer.ir.ops.engram import HASH_ATTRS, hash_lookbacks
from deepinfer.ir.ops.fused import CompressorKeys
from deepinfer.ir.registry import Attr, register_op, shape_fail
from deepinfer.ir.shapes import exact_div


def _per_sequence_rows(op: str, pool: TensorType, b, *others):
    """N, the rows each sequence has in a [B*N, ...] pool (symbolic when the shapes are)."""
    n = exact_div(pool.shape[0], b) if pool.rank >= 1 else None
    if n is None:
        raise shape_fail(op, "a flattened pool must have B*N rows (B = the batch's sequences)", pool, *others)
    return n


def _check_batch_positions(op: str, positions: TensorType, b, *others) -> None:
    if positions.dtype not in (dt.i32, dt.i64) or positions.shape != (b,):
        raise shape_fail(op, "positions must be an integer [B], one per sequence", positions, *others)


def _seq_ids(n_rows: int, device, dims: int = 1) -> torch.Tensor:
    """0..B-1 shaped to broadcast against a [B, ...] tensor of ``dims`` dims."""
    return torch.arange(n_rows, device=device).view(-1, *([1] * (dims - 1)))


def _pool_view(pool: torch.Tensor, b: int) -> torch.Tensor:
    """[B*N, ...] -> [B, N, ...] (a view)."""
    return pool.view(b, pool.shape[0] // b, *pool.shape[1:])


def _take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, N, w], idx [B, k] -> x[b, idx[b, j]] as [B, k, w] (one gather, no host read)."""
    return torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


# ---------------------------------------------------------------------------------------------------
# Window ring and flat row ids
# ---------------------------------------------------------------------------------------------------


@register_op("batched_window_indices", "positions", {"window": Attr("int")}, level="model")
class BatchedWindowIndices:
    """window_indices for B sequences: query b at position p reads positions p-W+1 .. p from
    pool = concat(rings [B*W], new kv [B]): position q < p lives at ring row b*W + q % W, q = p at row B*W + b.
    positions [B] -> i64 [B, W] flat pool rows, ascending positions, -1 for negative positions."""

    def infer(positions, *, window):
        b = positions.shape[0]
        _check_batch_positions("batched_window_indices", positions, b)
        return TensorType(dt.i64, (b, window))

    def reference(positions, *, window):
        b = positions.shape[0]
        p = positions.long().unsqueeze(-1)
        q = p - window + 1 + torch.arange(window, device=positions.device)
        seq = _seq_ids(b, positions.device, 2)
        idx = torch.where(q >= p, b * window + seq, seq * window + q % window)
        return torch.where(q >= 0, idx, torch.full_like(idx, -1))


@register_op("batched_ring_slots", "positions", {"size": Attr("int")}, level="model")
class BatchedRingSlots:
    """ring_slots for B sequences of one token each: flat row b*size + p % size of the [B*size, ...] rings."""

    def infer(positions, *, size):
        _check_batch_positions("batched_ring_slots", positions, positions.shape[0])
        return TensorType(dt.i64, positions.shape)

    def reference(positions, *, size):
        seq = _seq_ids(positions.shape[0], positions.device)
        return seq * size + positions.long() % size


@register_op("batched_rows", "index, pool", level="model")
class BatchedRows:
    """Per-sequence row ids -> flat pool rows: index [B, ...] (row b belongs to sequence b, values 0..N-1 or -1)
    and pool [B*N, ...] (only its row count is read) -> index + b*N, -1 kept."""

    def infer(index, pool):
        if index.dtype not in (dt.i32, dt.i64) or index.rank < 1:
            raise shape_fail("batched_rows", "index must be an integer [B, ...]", index, pool)
        _per_sequence_rows("batched_rows", pool, index.shape[0], index)
        return TensorType(dt.i64, index.shape)

    def reference(index, pool):
        b = index.shape[0]
        seq = _seq_ids(b, index.device, index.dim())
        idx = index.long()
        return torch.where(idx >= 0, idx + seq * (pool.shape[0] // b), torch.full_like(idx, -1))


# ---------------------------------------------------------------------------------------------------
# Compressors: one token per sequence, each with its own state rows
# ---------------------------------------------------------------------------------------------------


def batched_compressor_reference(kv, score, ape, norm_w, state_kv, state_score, positions, *, ratio, overlap, eps,
                                 **rope):  # fmt: skip
    """attention.compressor_reference at T = 1 for every row b over its own ring (rows b*R .. b*R+R-1)."""
    m, b = ratio, kv.shape[0]
    rows, width = state_kv.shape[0] // b, kv.shape[-1]
    d = width // (2 if overlap else 1)
    pos = positions.long()
    dev = kv.device
    # the ring holds positions p-R .. p-1 (slot q % R); negative positions' scores are -inf
    hist_pos = pos.unsqueeze(-1) - rows + torch.arange(rows, device=dev)  # [B, R]
    ring_kv, ring_score = _pool_view(state_kv.float(), b), _pool_view(state_score.float(), b)
    hist_kv, hist_score = _take_rows(ring_kv, hist_pos % rows), _take_rows(ring_score, hist_pos % rows)
    hist_score = hist_score.masked_fill((hist_pos < 0).unsqueeze(-1), float("-inf"))
    new_score = score.float() + ape.float()[pos % m]
    seq_kv = torch.cat([hist_kv, kv.float().unsqueeze(1)], dim=1)  # [B, R+1, w]: row r holds position p - R + r
    seq_score = torch.cat([hist_score, new_score.unsqueeze(1)], dim=1)

    w = pos // m
    valid = w < (pos + 1) // m  # the token closes its window
    cur = (m * w.unsqueeze(-1) + torch.arange(m, device=dev) - (pos.unsqueeze(-1) - rows)).clamp(0, rows)
    if overlap:
        prev = (cur - m).clamp(min=0)
        prev_score = _take_rows(seq_score, prev)[..., :d].masked_fill((w == 0).view(-1, 1, 1), float("-inf"))
        slots_kv = torch.cat([_take_rows(seq_kv, prev)[..., :d], _take_rows(seq_kv, cur)[..., d:]], dim=1)
        slots_score = torch.cat([prev_score, _take_rows(seq_score, cur)[..., d:]], dim=1)
    else:
        slots_kv, slots_score = _take_rows(seq_kv, cur), _take_rows(seq_score, cur)
    pooled = (slots_kv * torch.softmax(slots_score, dim=1)).sum(dim=1)
    pooled = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + eps) * norm_w.float()
    pooled = apply_rope(pooled, w * m, **rope)  # at the window's FIRST position
    pooled = torch.where(valid.unsqueeze(-1), pooled, torch.zeros_like(pooled)).to(kv.dtype)
    entry_idx = torch.where(valid, w, torch.full_like(w, -1))

    dest = _seq_ids(b, dev) * rows + pos % rows  # each token to its ring slot
    new_kv = state_kv.index_put((dest,), kv.to(state_kv.dtype))
    new_score_ring = state_score.index_put((dest,), new_score.to(state_score.dtype))
    return pooled, entry_idx, new_kv, new_score_ring


@register_op(
    "batched_compressor",
    "kv, score, ape, norm, state_kv, state_score, positions",
    {"ratio": Attr("int"), "overlap": Attr("bool"), "eps": Attr("float", 1e-6), **ROPE_ATTRS},
    stateful=True,
    writes={2: 4, 3: 5},
    level="model",
)
class BatchedCompressor:
    """compressor (MODEL_SPEC §2.8) for B sequences of one token each: kv, score [B, c*d]; state_kv,
    state_score [B*R, c*d] (sequence b's ring at rows b*R..); positions [B]. Returns entries [B, d] (row b:
    sequence b's window p // m when its token closes it, else zeros), entry_idx i64 [B] (that window index per
    sequence, or -1), and the updated rings."""

    def infer(kv, score, ape, norm, state_kv, state_score, positions, *, ratio, overlap, eps, rope_dim, **_):
        c = 2 if overlap else 1
        if kv.rank != 2 or score.shape != kv.shape or kv.shape[1] != c * norm.shape[0]:
            raise shape_fail("batched_compressor", f"kv/score must be [B, {c}*d]", kv, score, norm)
        b, width = kv.shape
        if ape.shape != (ratio, width) or state_score.shape != state_kv.shape or state_kv.shape[1:] != (width,):
            raise shape_fail("batched_compressor", "needs ape [m, w] and states [B*R, w]", ape, state_kv, kv)
        if _per_sequence_rows("batched_compressor", state_kv, b, kv) != ratio * c:
            raise shape_fail("batched_compressor", f"each sequence's ring must have {ratio * c} rows", state_kv, kv)
        _check_batch_positions("batched_compressor", positions, b, kv)
        return TensorType(kv.dtype, (b, norm.shape[0])), TensorType(dt.i64, (b,)), state_kv, state_score

    def reference(kv, score, ape, norm, state_kv, state_score, positions, *, ratio, overlap, eps, **rope):
        return batched_compressor_reference(kv, score, ape, norm, state_kv, state_score, positions, ratio=ratio,
                                            overlap=overlap, eps=eps, **rope)  # fmt: skip


def batched_pair_pool(kv, score, state_kv, state_score, positions):
    """v41.pair_pool_reference at T = 1 per row: an odd position closes the pair (pending row, this token)."""
    pos = positions.long()
    pair_kv = torch.stack([state_kv.float(), kv.float()], dim=1)  # [B, 2, d]
    pair_score = torch.stack([state_score.float(), score.float()], dim=1)
    pooled = (pair_kv * torch.softmax(pair_score, dim=1)).sum(dim=1)
    j = pos // 2
    valid = pos % 2 == 1
    pooled = torch.where(valid.unsqueeze(-1), pooled, torch.zeros_like(pooled)).to(kv.dtype)
    idx = torch.where(valid, j, torch.full_like(j, -1))
    entry_pos = torch.where(valid, 2 * j, torch.zeros_like(j))
    pending = (~valid).unsqueeze(-1)  # an even position becomes the pending row
    new_kv = torch.where(pending, kv.to(state_kv.dtype), state_kv)
    new_score = torch.where(pending, score.to(state_score.dtype), state_score)
    return pooled, entry_pos, idx, new_kv, new_score


@register_op(
    "batched_pair_compressor_keys",
    "kv, score, state_kv, state_score, positions, norm, wk, k_norm",
    {"eps": Attr("float", 1e-6), **ROPE_ATTRS},
    stateful=True,
    writes={3: 2, 4: 3},
    level="kernel",
)
class BatchedPairCompressorKeys:
    """pair_compressor_keys (MODEL_SPEC §2.13) for B sequences of one token each: kv, score [B, d]; state_kv,
    state_score [B, d] (each sequence's pending row); positions [B]. Returns (entry [B, d], keys [B, di],
    entry_idx i64 [B]: the pair index per sequence or -1, state_kv', state_score'); the norm / RoPE / wk tail is
    the one-sequence op's, row by row."""

    def infer(kv, score, state_kv, state_score, positions, norm, wk, k_norm, *, eps, **rope):
        if kv.rank != 2 or score.shape != kv.shape or state_kv.shape != kv.shape or state_score.shape != kv.shape:
            raise shape_fail("batched_pair_compressor_keys", "kv, score and states must be [B, d]", kv, state_kv)
        b = kv.shape[0]
        _check_batch_positions("batched_pair_compressor_keys", positions, b, kv)
        latent, keys = CompressorKeys.infer(kv, positions, norm, wk, k_norm, eps=eps)
        return latent, keys, TensorType(dt.i64, (b,)), state_kv, state_score

    def reference(kv, score, state_kv, state_score, positions, norm, wk, k_norm, *, eps, **rope):
        pooled, entry_pos, entry_idx, new_kv, new_score = batched_pair_pool(kv, score, state_kv, state_score,
                                                                            positions)  # fmt: skip
        entry, keys = CompressorKeys.reference(pooled, entry_pos, norm, wk, k_norm, eps=eps, **rope)
        return entry, keys, entry_idx, new_kv, new_score


# ---------------------------------------------------------------------------------------------------
# Indexer: every query scores its own sequence's keys
# ---------------------------------------------------------------------------------------------------


def batched_indexer_scores(q, weights, keys, positions, *, ratio, scale):
    """attention.indexer_scores per sequence: q [B, Hi, di] against keys [B*C, di] viewed [B, C, di] (one bmm per
    group of sequences: the [B, Hi, C] fp32 temporaries stay under TEMP_ELEMS, 1 GiB, as index_scores' do)."""
    b = q.shape[0]
    k = _pool_view(keys.float(), b)
    group = max(1, TEMP_ELEMS // max(1, q.shape[1] * k.shape[1]))
    s = torch.cat([_head_sum(q[i : i + group], weights[i : i + group], k[i : i + group], scale)
                   for i in range(0, b, group)])  # fmt: skip
    w = torch.arange(k.shape[1], device=keys.device)
    visible = w < (positions.long().unsqueeze(-1) + 1) // ratio
    return s.masked_fill(~visible, float("-inf")), visible


TEMP_ELEMS = 1 << 28  # fp32 elements a temporary may take (v41._TEMP_ELEMS' bound)


def _head_sum(q, weights, k, scale):
    """sum_h weights[b, h] * ReLU(q[b, h] . k[b, c]) * scale for a group of sequences -> [b, C]."""
    s = torch.relu(torch.einsum("bhd,bcd->bhc", q.float(), k)) * scale
    return (s * weights.float().unsqueeze(-1)).sum(dim=1)


def _check_indexer(op: str, q, weights, keys, positions):
    if q.rank != 3 or weights.shape != q.shape[:2] or keys.rank != 2 or keys.shape[1] != q.shape[2]:
        raise shape_fail(op, "needs q [B, Hi, di], weights [B, Hi], keys [B*C, di]", q, weights, keys)
    _check_batch_positions(op, positions, q.shape[0], q)
    return _per_sequence_rows(op, keys, q.shape[0], q)


@register_op(
    "batched_index_scores", "q, weights, keys, positions", {"ratio": Attr("int"), "scale": Attr("float")},
    level="model",
)  # fmt: skip
class BatchedIndexScores:
    """index_scores (MODEL_SPEC §2.13) for B sequences: row b scores sequence b's C index keys (rows b*C.. of
    keys [B*C, di]) -> f32 [B, C], -inf where j >= (p_b+1)//ratio."""

    def infer(q, weights, keys, positions, *, ratio, scale):
        c = _check_indexer("batched_index_scores", q, weights, keys, positions)
        return TensorType(dt.f32, (q.shape[0], c))

    def reference(q, weights, keys, positions, *, ratio, scale):
        return batched_indexer_scores(q, weights, keys, positions, ratio=ratio, scale=scale)[0]


@register_op(
    "batched_indexer_topk",
    "q, weights, keys, positions",
    {"ratio": Attr("int"), "topk": Attr("int"), "scale": Attr("float")},
    level="model",
)
class BatchedIndexerTopK:
    """indexer_topk (MODEL_SPEC §2.9) for B sequences: per-sequence entry ids i64 [B, topk] (0..C-1, -1 =
    none), ties to the lower index, over keys [B*C, di] (sequence b's at rows b*C..)."""

    def infer(q, weights, keys, positions, *, ratio, topk, scale):
        _check_indexer("batched_indexer_topk", q, weights, keys, positions)
        return TensorType(dt.i64, (q.shape[0], topk))

    def reference(q, weights, keys, positions, *, ratio, topk, scale):
        scores, visible = batched_indexer_scores(q, weights, keys, positions, ratio=ratio, scale=scale)
        k = min(topk, scores.shape[1])
        idx = stable_topk_indices(scores, k)
        idx = torch.where(torch.gather(visible, 1, idx), idx, torch.full_like(idx, -1))
        return F.pad(idx, (0, topk - k), value=-1)


@register_op("batched_compressed_indices", "positions, cache", {"ratio": Attr("int")}, level="model")
class BatchedCompressedIndices:
    """compressed_indices (HCA visibility) for B sequences: row b sees its entries w < (p_b+1)//m.
    positions [B], cache [B*C, d] (only its row count is read) -> per-sequence ids i64 [B, C], -1 = invisible."""

    def infer(positions, cache, *, ratio):
        b = positions.shape[0]
        _check_batch_positions("batched_compressed_indices", positions, b, cache)
        return TensorType(dt.i64, (b, _per_sequence_rows("batched_compressed_indices", cache, b)))

    def reference(positions, cache, *, ratio):
        w = torch.arange(cache.shape[0] // positions.shape[0], device=positions.device)
        visible = w < (positions.long().unsqueeze(-1) + 1) // ratio
        return torch.where(visible, w, torch.full_like(w, -1))


# ---------------------------------------------------------------------------------------------------
# Engram: each sequence's n-gram history
# ---------------------------------------------------------------------------------------------------


@register_op("batched_engram_hash", "tokens, history", HASH_ATTRS, level="model")
class BatchedEngramHash:
    """engram_hash (MODEL_SPEC §2.14) for B sequences of one token each: tokens [B], history [B*(N-1)]
    (sequence b's last N-1 ids at b*(N-1).., oldest first, -1 = none) -> i64 [B, (N-1)*n_heads]."""

    def infer(tokens, history, *, multipliers, primes, n_heads, **_):
        n = len(multipliers)
        if tokens.rank != 1 or history.rank != 1 or len(primes) != (n - 1) * n_heads:
            raise shape_fail("batched_engram_hash", "needs tokens [B], history [B*(N-1)]", tokens, history)
        if _per_sequence_rows("batched_engram_hash", history, tokens.shape[0], tokens) != n - 1:
            raise shape_fail("batched_engram_hash", f"history must hold {n - 1} ids per sequence", history, tokens)
        return TensorType(dt.i64, (tokens.shape[0], len(primes)))

    def reference(tokens, history, **attrs):
        n, b = len(attrs["multipliers"]), tokens.shape[0]
        toks = torch.cat([history.long().view(b, n - 1), tokens.long().unsqueeze(-1)], dim=1)  # col r = p-(N-1)+r
        return hash_lookbacks(toks.flip(1), **attrs)  # column s = the token s back


@register_op("batched_engram_history", "history, tokens", stateful=True, writes={0: 0}, level="model")
class BatchedEngramHistory:
    """engram_history for B sequences of one token each: every sequence's N-1 ids shift by its new token."""

    def infer(history, tokens):
        if history.rank != 1 or tokens.rank != 1:
            raise shape_fail("batched_engram_history", "needs history [B*(N-1)] and tokens [B]", history, tokens)
        _per_sequence_rows("batched_engram_history", history, tokens.shape[0], tokens)
        return history

    def reference(history, tokens):
        b = tokens.shape[0]
        if history.shape[0] == 0:
            return history.clone()
        h = history.view(b, -1)
        return torch.cat([h[:, 1:], tokens.to(history.dtype).unsqueeze(-1)], dim=1).reshape(-1)


__all__ = ["batched_compressor_reference", "batched_indexer_scores", "batched_pair_pool"]


@register_op("batched_gather_rows", "pool, index", level="model")
class BatchedGatherRows:
    """The rows a batched attention query reads, gathered into a compact pool: pool [N, d], index [B, K] flat
    pool rows (-1 = none) -> (rows [B*K, d]: row b*K + j = pool[index[b, j]] (row 0 where -1), index' [B, K]:
    b*K + j, or -1). Attention over (rows, index') reads the same rows in the same order as over (pool, index);
    a kernel that stages its pool in another dtype then converts B*K rows, not the B sequences' whole caches."""

    def infer(pool, index):
        if pool.rank != 2 or index.rank != 2 or index.dtype not in (dt.i32, dt.i64):
            raise shape_fail("batched_gather_rows", "needs pool [N, d] and integer index [B, K]", pool, index)
        b, k = index.shape
        return TensorType(pool.dtype, (b * k, pool.shape[1])), TensorType(dt.i64, index.shape)

    def reference(pool, index):
        idx = index.long()
        rows = pool.index_select(0, idx.clamp(min=0).reshape(-1))
        compact = torch.arange(idx.numel(), device=idx.device).view(idx.shape)
        return rows, torch.where(idx >= 0, compact, torch.full_like(idx, -1))
