"""DeepSeek-V4.1 ops: single-pass mHC pieces, the ratio-2 pair compressor (no ape), V4.1 indexer scoring with the
two-level candidate-block top-k, the decoder bounded-replay window, the fp4/e4m3-per-16 fake quant and the DSpark
draft-block attention indices (MODEL_SPEC §2.3, §2.13, §2.15, §4.4).

Conventions are those of ``attention.py`` (one sequence per call, contiguous positions, -1 = no entry).
Compressed caches of a ratio-r kv source hold one row per group j (positions r*j .. r*j+r-1), written when the
group's last token arrives; ratio 1 has one group per token.
"""

from __future__ import annotations

import math

import torch

from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import TensorType
from deepinfer.ir.ops.attention import _check_positions, indexer_scores, last_rows_slots, stable_topk_indices
from deepinfer.ir.ops.hyper import collapse, hc_coefficients
from deepinfer.ir.registry import Attr, register_op, shape_fail

# ---------------------------------------------------------------------------------------------------
# Single-pass mHC (§2.3): the coefficients and the collapse are separate, because V4.1 collapses a sublayer's
# input with the pre of the PREVIOUS sublayer.
# ---------------------------------------------------------------------------------------------------


@register_op(
    "hc_stats",
    "x, fn, base, scale",
    {"sinkhorn_iters": Attr("int", 20), "hc_eps": Attr("float", 1e-6), "norm_eps": Attr("float", 1e-6)},
    level="model",
)
class HCStats:
    """mHC coefficients of one sublayer without the collapse (MODEL_SPEC §2.2, V4.1 form of §2.3).

    x [T, n, D]; fn [(2+n)*n, n*D], base [(2+n)*n], scale [3]. Returns pre [T, n], post [T, n] and the
    Sinkhorn-projected comb [T, n, n] (fp32; comb[t, j, k] weighs input stream j into output stream k).
    """

    def infer(x, fn, base, scale, *, sinkhorn_iters, hc_eps, norm_eps):
        if x.rank != 3:
            raise shape_fail("hc_stats", "streams must be [T, n_hc, D]", x)
        t, n, d = x.shape
        if fn.shape != ((2 + n) * n, n * d) or base.shape != (fn.shape[0],) or scale.shape != (3,):
            raise shape_fail("hc_stats", "needs fn [(2+n)*n, n*D], base [(2+n)*n], scale [3]", x, fn, base, scale)
        return TensorType(dt.f32, (t, n)), TensorType(dt.f32, (t, n)), TensorType(dt.f32, (t, n, n))

    def reference(x, fn, base, scale, *, sinkhorn_iters, hc_eps, norm_eps):
        return hc_coefficients(x, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps)


@register_op("hc_collapse", "x, pre", level="model")
class HCCollapse:
    """sum_i pre[t, i] * X[t, i] (fp32 accumulate, x's dtype): the sublayer input of V4.1's single-pass mHC
    (MODEL_SPEC §2.3: collapse with the previous sublayer's pre) and its final head (§2.4, V4.1 form).

    x [T, n, D], pre [T, n] -> [T, D].
    """

    def infer(x, pre):
        if x.rank != 3 or pre.shape != x.shape[:2]:
            raise shape_fail("hc_collapse", "needs x [T, n, D] and pre [T, n]", x, pre)
        return x.with_shape((x.shape[0], x.shape[2]))

    def reference(x, pre):
        return collapse(x, pre.float())


# ---------------------------------------------------------------------------------------------------
# Ratio-2 compressor without ape (§2.13)
# ---------------------------------------------------------------------------------------------------


def pair_pool_reference(kv, score, state_kv, state_score, positions):
    pos = positions.long()
    start, t = pos[:1], pos.shape[0]  # a [1] tensor: no host read (a decode step can be a CUDA graph)
    d = kv.shape[-1]
    # seq row r holds position start - 1 + r (row 0 = the pending even token, only meaningful when start is odd)
    seq_kv = torch.cat([state_kv.float(), kv.float()])
    seq_score = torch.cat([state_score.float(), score.float()])
    n_out = (t + 1) // 2
    j = start // 2 + torch.arange(n_out, device=kv.device)
    valid = j < (start + t) // 2
    first = (2 * j - (start - 1)).clamp(0, t - 1)  # row of position 2j (row 0 = pending when start is odd)
    second = (first + 1).clamp(max=t)
    pair_kv = torch.stack([seq_kv[first], seq_kv[second]], dim=1)  # [n_out, 2, d]
    pair_score = torch.stack([seq_score[first], seq_score[second]], dim=1)
    pooled = (pair_kv * torch.softmax(pair_score, dim=1)).sum(dim=1)
    pooled = torch.where(valid.unsqueeze(-1), pooled, torch.zeros_like(pooled)).to(kv.dtype)
    idx = torch.where(valid, j, torch.full_like(j, -1))
    entry_pos = torch.where(valid, 2 * j, torch.zeros_like(j))
    # the batch ends on the first token of a pair (last position even): it becomes the pending row
    pending = (start + t - 1) % 2 == 0  # [1]
    new_kv = torch.where(pending, kv[-1:].to(state_kv.dtype), state_kv)
    new_score = torch.where(pending, score[-1:].to(state_score.dtype), state_score)
    del d
    return pooled, entry_pos, idx, new_kv, new_score


@register_op(
    "pair_compressor",
    "kv, score, state_kv, state_score, positions",
    stateful=True,
    writes={3: 2, 4: 3},
    level="model",
)
class PairCompressor:
    """V4.1 ratio-2 compressor pooling (MODEL_SPEC §2.13): group j = tokens (2j, 2j+1),
    c_j = sum_t softmax_t(z_t) * a_t (per-channel softmax over the pair, fp32). No ape, no overlap.

    kv, score [T, d] = x@wkv^T, x@wgate^T; state_kv, state_score [1, d]: the pending first token of an
    unfinished pair (valid when start is odd); positions [T]. Returns
      pooled [(T+1)//2, d]: row i = group start//2 + i, zero when it does not complete in this batch;
      entry_pos i64 [(T+1)//2]: the group's first position 2j (RoPE position of the entry; 0 when invalid);
      entry_idx i64 [(T+1)//2]: j, or -1 (so scatter_rows writes only completed groups);
      state_kv, state_score: the pending row after this batch.
    The caller applies RMSNorm (the pre-RoPE latent feeds the index keys), RoPE at entry_pos and the QAT.
    """

    def infer(kv, score, state_kv, state_score, positions):
        if kv.rank != 2 or score.shape != kv.shape:
            raise shape_fail("pair_compressor", "kv and score must be [T, d]", kv, score)
        t, d = kv.shape
        if state_kv.shape != (1, d) or state_score.shape != (1, d):
            raise shape_fail("pair_compressor", "state must be [1, d]", kv, state_kv, state_score)
        _check_positions("pair_compressor", positions, t, kv)
        n_out = (t + 1) // 2
        return (
            TensorType(kv.dtype, (n_out, d)),
            TensorType(dt.i64, (n_out,)),
            TensorType(dt.i64, (n_out,)),
            state_kv,
            state_score,
        )

    def reference(kv, score, state_kv, state_score, positions):
        return pair_pool_reference(kv, score, state_kv, state_score, positions)


# ---------------------------------------------------------------------------------------------------
# V4.1 indexer: scores, plain top-k, candidate blocks, top-k within blocks (§2.13)
# ---------------------------------------------------------------------------------------------------


@register_op(
    "index_scores", "q, weights, keys, positions", {"ratio": Attr("int"), "scale": Attr("float")}, level="model"
)
class IndexScores:
    """V4.1 indexer scores (MODEL_SPEC §2.13): S(t, j) = sum_h weights[t, h] * ReLU(q[t, h] . k_j) * scale.

    q [T, Hi, di], weights [T, Hi] (already times Hi^-0.5), keys [C, di] (the shared index keys of the ratio's
    kv source), positions [T] -> f32 [T, C], -inf where j >= (p+1)//ratio (not yet visible).
    """

    def infer(q, weights, keys, positions, *, ratio, scale):
        if q.rank != 3 or weights.shape != q.shape[:2] or keys.rank != 2 or keys.shape[1] != q.shape[2]:
            raise shape_fail("index_scores", "needs q [T, Hi, di], weights [T, Hi], keys [C, di]", q, weights, keys)
        _check_positions("index_scores", positions, q.shape[0], q)
        return TensorType(dt.f32, (q.shape[0], keys.shape[0]))

    def reference(q, weights, keys, positions, *, ratio, scale):
        # rows are independent: chunk the queries so the [rows, Hi, C] fp32 temporaries stay under ~1 GiB
        # (at T = C = 4096 with 32 heads one pass would be 2 GiB per temporary); small calls run in one piece
        rows = max(1, _TEMP_ELEMS // max(1, q.shape[1] * keys.shape[0]))
        if q.shape[0] <= rows:
            return indexer_scores(q, weights, keys, positions, ratio=ratio, scale=scale)[0]
        return torch.cat([indexer_scores(q[i : i + rows], weights[i : i + rows], keys, positions[i : i + rows],
                                         ratio=ratio, scale=scale)[0]
                          for i in range(0, q.shape[0], rows)])  # fmt: skip


_TEMP_ELEMS = 1 << 28  # fp32 elements a reference temporary may take before it is chunked over rows


def _masked_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k column ids per row, ties to the lower id; -inf picks and padding are -1."""
    kk = min(k, scores.shape[-1])
    idx = stable_topk_indices(scores, kk)
    ok = torch.gather(scores, -1, idx) > -math.inf
    idx = torch.where(ok, idx, torch.full_like(idx, -1))
    return torch.nn.functional.pad(idx, (0, k - kk), value=-1)


def block_mask(scores: torch.Tensor, blocks: torch.Tensor, block: int) -> torch.Tensor:
    """True at the columns lying in one of the row's blocks (block id -1 = none).

    Memory-lean: a [T, n_blocks] table of chosen blocks, gathered per column ([T, C] bools), instead of the
    [T, nb, C] comparison (32 GiB at T = C = 4096 with 2048 candidate blocks)."""
    n = -(-scores.shape[-1] // block)
    b = blocks.long()
    b = torch.where((b >= 0) & (b < n), b, torch.full_like(b, n))  # none / out of range -> a spare column
    chosen = torch.zeros(b.shape[0], n + 1, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, b, True)
    col_block = torch.arange(scores.shape[-1], device=scores.device) // block  # [C]
    return chosen[:, col_block]


@register_op(
    "topk_entries",
    "scores, blocks?, positions?",
    {"topk": Attr("int"), "block": Attr("int", 1), "ratio": Attr("int", 1)},
    level="model",
)
class TopKEntries:
    """Top-k compressed entries per query (MODEL_SPEC §2.13), ties to the lower entry index.

    scores [T, C] (-inf = not visible) -> i64 [T, topk], -1 for padding / invisible picks. With blocks
    [T, nb] (candidate block ids from ``candidate_blocks``, -1 = none) only entries inside those blocks of
    ``block`` consecutive entries can be chosen: the second level of the two-level indexer. With positions [T]
    (the queries' token positions) only the entries j < (p+1)//ratio are candidates: the same set as without
    them on ``index_scores``' output (-inf there already), but a kernel need not read -- and the scores kernel
    need not write -- the columns past that limit, so a decode step follows the sequence's length, not the
    cache's.
    """

    # (positions and ratio default: a call or a stored graph from before the positions input has two inputs)
    def infer(scores, blocks, positions=None, *, topk, block, ratio=1):
        if scores.rank != 2 or (blocks is not None and (blocks.rank != 2 or blocks.shape[0] != scores.shape[0])):
            raise shape_fail("topk_entries", "needs scores [T, C] and blocks [T, nb]", scores, blocks)
        if positions is not None:
            _check_positions("topk_entries", positions, scores.shape[0], scores)
        return TensorType(dt.i64, (scores.shape[0], topk))

    def reference(scores, blocks, positions=None, *, topk, block, ratio=1):
        s = scores.float()
        if positions is not None:  # per row: the columns past the row's visible count are never candidates
            s = s.masked_fill(~_visible_columns(s, positions, ratio), float("-inf"))
        if blocks is not None:
            s = s.masked_fill(~block_mask(s, blocks, block), float("-inf"))
        return _masked_topk(s, topk)


def _visible_columns(scores: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """[T, C] bools: column j is visible to row t when j < (p_t + 1) // ratio (no host read of the positions)."""
    lim = (positions.long() + 1) // ratio
    return torch.arange(scores.shape[-1], device=scores.device)[None, :] < lim.to(scores.device)[:, None]


@register_op(
    "candidate_blocks",
    "scores, positions",
    {"ratio": Attr("int"), "topk_blocks": Attr("int"), "block": Attr("int")},
    level="model",
)
class CandidateBlocks:
    """First level of the V4.1 two-level indexer (MODEL_SPEC §2.13), published by the candidate source.

    Blocks are runs of ``block`` consecutive compressed entries; a block's score is the max of S over its
    visible entries (j < (p+1)//ratio: the columns past them never count, whatever they hold -- a scores kernel
    need not write them, as for topk_entries with positions); the block holding the newest visible entry
    ((p+1)//ratio - 1) is forced to +inf; keep the top ``topk_blocks`` (ties to the lower block id).
    scores [T, C], positions [T] -> i64 [T, topk_blocks] block ids, -1 for padding (no visible entry, or fewer
    blocks than topk_blocks).
    """

    def infer(scores, positions, *, ratio, topk_blocks, block):
        if scores.rank != 2:
            raise shape_fail("candidate_blocks", "scores must be [T, C]", scores)
        _check_positions("candidate_blocks", positions, scores.shape[0], scores)
        return TensorType(dt.i64, (scores.shape[0], topk_blocks))

    def reference(scores, positions, *, ratio, topk_blocks, block):
        t, c = scores.shape
        nb = (c + block - 1) // block
        padded = torch.full((t, nb * block), float("-inf"), device=scores.device)
        padded[:, :c] = scores.float().masked_fill(~_visible_columns(scores, positions, ratio), float("-inf"))
        bscore = padded.view(t, nb, block).amax(-1)  # -inf for blocks with no visible entry
        newest = (positions.long() + 1) // ratio - 1  # [T]
        has = newest >= 0
        rows = torch.arange(t, device=scores.device)[has]
        bscore[rows, newest[has] // block] = float("inf")
        return _masked_topk(bscore, topk_blocks)


# ---------------------------------------------------------------------------------------------------
# Decoder bounded replay window (§2.13)
# ---------------------------------------------------------------------------------------------------


@register_op(
    "replay_window_indices", "positions, all_positions", {"window": Attr("int"), "keep": Attr("int")}, level="model"
)
class ReplayWindowIndices:
    """Window rows for the decoder layers under SWA bounded replay (MODEL_SPEC §2.13, "compact" mode).

    positions [T'] are the tail rows that run (the last min(keep, T) of all_positions [T]). Like
    ``window_indices`` over pool = concat(ring [W], tail kv [T']), but when the batch was truncated (T > keep)
    the window is floored at the tail's first position: no decoder-layer window KV below the tail exists.
    """

    def infer(positions, all_positions, *, window, keep):
        t = positions.shape[0]
        _check_positions("replay_window_indices", positions, t)
        return TensorType(dt.i64, (t, window))

    def reference(positions, all_positions, *, window, keep):
        start = positions[0].long()
        q = positions.long().unsqueeze(-1) - window + 1 + torch.arange(window, device=positions.device)
        idx = torch.where(q >= start, window + (q - start), q % window)
        floor = start if all_positions.shape[0] > keep else torch.zeros_like(start)
        return torch.where(q >= floor, idx, torch.full_like(idx, -1))


# ---------------------------------------------------------------------------------------------------
# fp4 with e4m3 scales per 16 (§4.4; the V4.1 compressed-KV QAT point)
# ---------------------------------------------------------------------------------------------------


def fake_quant_fp4_e4m3(x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """s = e4m3(clamp(amax/6, 2^-9, 448)); x^ = RNE_e2m1(clamp(x/s, +-6)) * s (MODEL_SPEC §4.4)."""
    g = x.float().unflatten(-1, (-1, group))
    amax = g.abs().amax(-1, keepdim=True)
    s = (amax / dt.FP4_MAX).clamp(2.0**-9, dt.FP8_MAX).to(torch.float8_e4m3fn).float()
    q = dt.fp4_decode(dt.fp4_encode((g / s).clamp(-dt.FP4_MAX, dt.FP4_MAX)))
    return (q * s).flatten(-2).to(x.dtype)


@register_op("fake_quant_fp4_e4m3", "x", {"group": Attr("int", 16)})
class FakeQuantFP4E4M3:
    """Quantise to E2M1 with one E4M3 scale per group, then dequantise (MODEL_SPEC §4.4, V4.1 compressed KV)."""

    def infer(x, *, group):
        k = x.shape[-1]
        if isinstance(k, int) and k % group:
            raise shape_fail("fake_quant_fp4_e4m3", f"last dim must be a multiple of group {group}", x)
        return x

    def reference(x, *, group):
        return fake_quant_fp4_e4m3(x, group)


# ---------------------------------------------------------------------------------------------------
# DSpark draft block (§2.15)
# ---------------------------------------------------------------------------------------------------


@register_op("dspark_attn_indices", "ctx_positions, positions", {"window": Attr("int")}, level="model")
class DSparkAttnIndices:
    """Rows of pool = concat(context kv [Tc], block kv [B]) a DSpark block query attends (MODEL_SPEC §2.15):
    context rows with position > p - window, then every block row (attention inside the block is
    bidirectional). ctx_positions [Tc], positions [B] -> i64 [B, Tc + B], -1 = skip.
    """

    def infer(ctx_positions, positions, *, window):
        b, tc = positions.shape[0], ctx_positions.shape[0]
        return TensorType(dt.i64, (b, tc + b))

    def reference(ctx_positions, positions, *, window):
        tc, b = ctx_positions.shape[0], positions.shape[0]
        ctx_ok = ctx_positions.long().unsqueeze(0) > positions.long().unsqueeze(-1) - window  # [B, Tc]
        ctx = torch.where(
            ctx_ok, torch.arange(tc, device=positions.device), torch.full_like(ctx_ok, -1, dtype=torch.long)
        )
        blk = (tc + torch.arange(b, device=positions.device)).expand(b, b)
        return torch.cat([ctx, blk], dim=1)


__all__ = ["fake_quant_fp4_e4m3", "last_rows_slots", "pair_pool_reference"]
