"""candidate_blocks (the first level of V4.1's two-level indexer, MODEL_SPEC §2.13) in 2 or 4 Triton launches.

    lim_t     = min((p_t + 1) // ratio, C)                       visible columns of row t (follows the sequence)
    bmax[t,b] = max(S[t, j] for j in block b, j < lim_t)       (-inf: no visible entry)
    bmax[t, (lim_t - 1) // block] = +inf                        the newest visible entry's block (when lim_t > 0)
    out[t]    = the topk_blocks block ids of largest bmax, score descending, ties to the lower id;
                -1 for blocks scoring -inf and for padding (fewer visible blocks than topk_blocks)

The columns past lim_t never count (the op's reference masks them too, since session 10: whatever they hold, so
layer 20's index scores need not write them -- select_kernels binds them fill False); the kernels never read them,
so a decode step's cost follows the sequence's length, not max_model_len. NaN scores are not supported in the
visible columns (index scores are never NaN).

A block's 64-bit key is the score's order-preserving bits, inverted (larger first), above its id (ties: the lower id
first): the keys' ascending order IS the op's order, and the ids are read back from their low half. The cost is the
ordering: tl.sort (bitonic, through shared memory) takes ~5 us for 512 keys but ~90 us for 4096 on the H200.

1. `_block_max_kernel`, grid (rows, blocks / bnb): a program reduces `bnb` blocks of one row -- a [bnb, block] tile
   of the row's visible columns (masked loads: nothing past lim_t is read; a program wholly past it exits at once)
   -- and writes their maxima (-0.0 folded to +0.0, the forced block +inf) to an f32 scratch [rows, NB].
2. `_select_kernel`, one program a row. A row of up to `chunk` (512) visible blocks: its keys sorted at once, the
   sort's size the level of a ladder (`smallest`, ..., `chunk`) that holds them, chosen at run time (a 2k context
   sorts 256 keys). A longer row: its min(visible, topk_blocks) winners' keys written to a scratch row in id order,
   unsorted -- past topk_blocks blocks the topk_blocks-th best score key is found by a radix select (4 passes over
   the row's maxima, 8-bit digits, a 256-bin histogram each) and the keys below it are kept with the first of its
   ties by id; the loops go `scan` blocks at a time, up to the row's visible blocks (runtime bounds).
3. (a cache with rows longer than `chunk`) `_chunk_sort_kernel`, grid (rows, KP / merge_chunk): the winners sorted
   512 at a time; `_merge_kernel`, grid (rows, KP / 128): each winner's place is the number of keys below it, summed
   over the sorted chunks by binary searches (keys are unique); its id is written there, -1 past the winners.

H200 (session 10, B64, us; the sync-free torch form in a CUDA graph in brackets): ctx4096 C4096 10.5 (78.4),
ctx4096 C65536 14.8 (199.6), ctx16384 C65536 27.4, ctx65536 C65536 85.4 (212.2) -- call 3, scan 512. Measured and
removed: the maxima fused into the sort's program at C4096 (14.8 vs 11.1), long rows in passes of 4096-key sorts
(282.7 at ctx65536), the winners in one 2048-key sort (135.7).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

try:  # optional; the jit functions are module globals so the interpreter (TRITON_INTERPRET=1) can run them
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

FAMILY = "candidate_blocks"
CHUNK = 512  # the largest in-program sort (H200: 512 keys ~5 us, 4096 ~90 us); longer rows are merged
MERGE_TILE = 128  # winners one merge program places


@dataclass(frozen=True)
class Config:
    bnb: int = 256  # blocks a block-max program reduces (its tile: bnb x block scores)
    max_warps: int = 4
    chunk: int = 0  # the largest sort of a row (a power of two); 0: default_config's rule
    sort_warps: int = 4
    smallest: int = 256  # the smallest sort of the ladder (= chunk: one size, whatever the row holds)
    merge_chunk: int = 512  # (long rows) winners one program sorts; each winner's place by binary searches in the rest
    scan: int = 2048  # (long rows) blocks a pass of the radix select / the winners' compaction takes at once

    @property
    def tag(self) -> str:
        return (f"b{self.bnb}w{self.max_warps}c{self.chunk}s{self.sort_warps}l{self.smallest}m{self.merge_chunk}"
                f"n{self.scan}")  # fmt: skip


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def n_blocks(C: int, block: int) -> int:
    return -(-C // block)


def sort_chunk(nb: int, chunk: int = 0) -> int:
    """The largest sort of a row: the cache's blocks rounded up to a power of two, at most `chunk` (default CHUNK)."""
    return min(_pow2(nb), chunk or CHUNK)


def default_config(T_: int, C: int, block: int, k: int) -> Config:
    """One rule: bnb 256 blocks a block-max program (2048 scores at block 8), sorts of up to CHUNK keys on 4 warps
    (H200 call 2, B64 ctx4096: 11.1 us; 8 / 16 warps fused 12.6 / 11.1), longer rows merged from 512-key chunks
    (call 3, ctx65536: 85.4 us; 256-key chunks 87.0; 8 warps 81.1, 16: 96.5)."""
    return Config(chunk=sort_chunk(n_blocks(C, block)))


def config_space(T_: int, C: int, block: int, k: int) -> list[Config]:
    """The default first; block-max tiles of 128 / 512 blocks, the sort on 8 warps, no ladder (one sort size); for
    caches with long rows, 256-key merge chunks and scans of 512 / 4096 blocks."""
    d = default_config(T_, C, block, k)
    out = [d, replace(d, bnb=128), replace(d, bnb=512), replace(d, sort_warps=8), replace(d, smallest=d.chunk)]
    if _pow2(n_blocks(C, block)) > d.chunk:
        out += [replace(d, merge_chunk=256), replace(d, scan=512), replace(d, scan=4096, sort_warps=8)]
    return list(dict.fromkeys(out))


def check_config(C: int, block: int, k: int, cfg: Config) -> None:
    """Raises ValueError naming what a config cannot take."""
    ch = cfg.chunk or sort_chunk(n_blocks(C, block))
    if any(v & (v - 1) or v <= 0 for v in (ch, cfg.bnb, cfg.smallest, cfg.merge_chunk, cfg.scan)):
        raise ValueError(f"candidate_blocks: chunk {ch}, bnb, smallest, merge_chunk and scan must be powers of two "
                         f"({cfg})")  # fmt: skip
    if n_blocks(C, block) >= 2**31:
        raise ValueError(f"candidate_blocks: {n_blocks(C, block)} blocks do not fit the sort keys' 31-bit ids")


def roofline(visible: int, T_: int, k: int) -> float:
    """Bytes: the visible scores read once (f32; `visible` = the rows' visible columns summed) and the i64 ids."""
    return float(4 * visible + 8 * T_ * k)


def reference(scores, positions, *, ratio, topk_blocks, block):
    from deepinfer.ir.ops.v41 import CandidateBlocks

    return CandidateBlocks.reference(scores, positions, ratio=ratio, topk_blocks=topk_blocks, block=block)


if triton is not None:

    @triton.jit
    def _visible(pos_ptr, row, C, ratio):
        p = tl.load(pos_ptr + row).to(tl.int64)
        return tl.minimum(tl.maximum((p + 1) // ratio, 0), C)  # (p < -1: <= 0 however // rounds)

    @triton.jit
    def _maxima(s_ptr, s_stride, row, b, lim, BLOCK: tl.constexpr, BLKP: tl.constexpr):
        """Blocks b's maxima over the row's visible columns (-inf: none), the newest visible entry's block +inf."""
        j = tl.arange(0, BLKP)
        col = b[:, None] * BLOCK + j[None, :]
        v = tl.load(s_ptr + row * s_stride + col, mask=(j[None, :] < BLOCK) & (col < lim), other=float("-inf"))
        m = tl.max(v, axis=1) + 0.0  # (+0.0: -0.0 -> +0.0, equal to it as torch's sort compares)
        return tl.where((b == (lim - 1) // BLOCK) & (lim > 0), float("inf"), m)

    @triton.jit
    def _block_max_kernel(s_ptr, s_stride, pos_ptr, bmax_ptr, C, NB, ratio, BLOCK: tl.constexpr,
                          BLKP: tl.constexpr, BNB: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        b0 = tl.program_id(1) * BNB
        lim = _visible(pos_ptr, row, C, ratio)
        nvis = (lim + BLOCK - 1) // BLOCK
        if b0 < nvis:  # (a program past the row's visible blocks reads and writes nothing)
            b = b0 + tl.arange(0, BNB)
            tl.store(bmax_ptr + row * NB + b, _maxima(s_ptr, s_stride, row, b, lim, BLOCK, BLKP), mask=b < nvis)

    @triton.jit
    def _keys(v, ids):
        """Ascending order of the keys = score descending, then the lower id."""
        bits = v.to(tl.int32, bitcast=True)
        desc = ~(bits ^ ((bits >> 31) & 0x7FFFFFFF))
        return (desc.to(tl.int64) << 32) | ids.to(tl.int64)

    @triton.jit
    def _unsigned(v):
        """_keys' score half as an unsigned 32-bit order (in an int64): 0 is the best (+inf), -inf 0xFF800000."""
        bits = v.to(tl.int32, bitcast=True)
        return (~(bits ^ ((bits >> 31) & 0x7FFFFFFF))).to(tl.int64) + 0x80000000

    @triton.jit
    def _sort_row(bmax_ptr, out_ptr, row, NB, nvis, K: tl.constexpr, KP: tl.constexpr, N: tl.constexpr):
        """A row of up to N blocks: its keys sorted at once, the first K written as ids (-1: -inf, padding)."""
        i = tl.arange(0, N)
        s = tl.sort(_keys(tl.load(bmax_ptr + row * NB + i, mask=i < nvis, other=float("-inf")), i))
        tl.store(out_ptr + row * K + i, tl.where((s >> 32) >= 0x7F800000, -1, s & 0xFFFFFFFF), mask=i < K)
        if N < K:  # fewer blocks than topk_blocks: padding
            f = tl.arange(0, KP)
            tl.store(out_ptr + row * K + f, tl.full([KP], -1, tl.int64), mask=(f >= N) & (f < K))

    @triton.jit
    def _winners(bmax_ptr, best_ptr, row, NB, nvis, K: tl.constexpr, KP: tl.constexpr, SCAN: tl.constexpr):
        """The row's min(nvis, K) best blocks' keys written to its scratch row in id order, unsorted: with more than
        K visible blocks, the K-th best 32-bit score key by a radix select (4 passes, 8-bit digits, a 256-bin
        histogram each), then the keys below it and the first of its ties by id."""
        prefix = tl.full((), 2**32, tl.int64)  # (<= K blocks: every key is below it)
        rank = tl.full((), 0, tl.int32)
        if nvis > K:
            bins = tl.arange(0, 256)
            prefix = tl.full((), 0, tl.int64)  # the K-th key's digits found so far
            rank = tl.full((), K, tl.int32)  # its rank among the keys that share them
            for p in tl.static_range(4):
                hist = tl.zeros([256], tl.int32)
                for start in range(0, nvis, SCAN):
                    i = start + tl.arange(0, SCAN)
                    u = _unsigned(tl.load(bmax_ptr + row * NB + i, mask=i < nvis, other=float("-inf")))
                    match = (i < nvis) & ((u >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
                    hist += tl.histogram(((u >> (24 - 8 * p)) & 255).to(tl.int32), 256, mask=match)
                digit = tl.sum((tl.cumsum(hist, 0) < rank).to(tl.int32), 0)  # the bin holding the rank-th key
                rank -= tl.sum(tl.where(bins < digit, hist, 0), 0)
                prefix = prefix | (digit.to(tl.int64) << (24 - 8 * p))
        taken = tl.full((), 0, tl.int32)
        ties = tl.full((), 0, tl.int32)
        for start in range(0, nvis, SCAN):
            i = start + tl.arange(0, SCAN)
            v = tl.load(bmax_ptr + row * NB + i, mask=i < nvis, other=float("-inf"))
            u = _unsigned(v)
            eq = (i < nvis) & (u == prefix)
            sel = ((i < nvis) & (u < prefix)) | (eq & (ties + tl.cumsum(eq.to(tl.int32), 0) <= rank))
            tl.store(best_ptr + row * KP + taken + tl.cumsum(sel.to(tl.int32), 0) - 1, _keys(v, i), mask=sel)
            taken += tl.sum(sel.to(tl.int32), 0)
            ties += tl.sum(eq.to(tl.int32), 0)

    @triton.jit
    def _select_kernel(bmax_ptr, pos_ptr, best_ptr, out_ptr, C, NB, ratio, BLOCK: tl.constexpr, K: tl.constexpr,
                       KP: tl.constexpr, CH: tl.constexpr, LADDER: tl.constexpr, LONG: tl.constexpr,
                       SCAN: tl.constexpr):  # fmt: skip
        """One program a row: rows of up to CH visible blocks sorted, at the ladder's level CH >> (LADDER - 1), ...,
        CH that holds them; LONG (the cache has longer rows): a longer row's winners to the scratch row."""
        row = tl.program_id(0).to(tl.int64)
        nvis = (_visible(pos_ptr, row, C, ratio) + BLOCK - 1) // BLOCK
        for lvl in tl.static_range(LADDER):  # (level lvl sorts CH >> (LADDER - 1 - lvl) keys)
            lo_ok = nvis >= 0  # (the lowest level: every row up to its size)
            if lvl > 0:
                lo_ok = nvis > (CH >> (LADDER - lvl))
            if lo_ok & (nvis <= (CH >> (LADDER - 1 - lvl))):
                _sort_row(bmax_ptr, out_ptr, row, NB, nvis, K, KP, CH >> (LADDER - 1 - lvl))
        if LONG:
            if nvis > CH:
                _winners(bmax_ptr, best_ptr, row, NB, nvis, K, KP, SCAN)

    @triton.jit
    def _chunk_sort_kernel(pos_ptr, best_ptr, sorted_ptr, C, ratio, BLOCK: tl.constexpr, K: tl.constexpr,
                           KP: tl.constexpr, CH: tl.constexpr, MC: tl.constexpr):  # fmt: skip
        """("merge") grid (rows, KP / MC), rows of more than CH blocks: the winners MC at a time sorted (the largest
        key past them)."""
        row = tl.program_id(0).to(tl.int64)
        nvis = (_visible(pos_ptr, row, C, ratio) + BLOCK - 1) // BLOCK
        if nvis > CH:
            j = tl.program_id(1) * MC + tl.arange(0, MC)
            keys = tl.load(best_ptr + row * KP + j, mask=j < tl.minimum(nvis, K), other=0x7FFFFFFFFFFFFFFF)
            tl.store(sorted_ptr + row * KP + j, tl.sort(keys))

    @triton.jit
    def _merge_kernel(pos_ptr, sorted_ptr, out_ptr, C, ratio, BLOCK: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                      CH: tl.constexpr, MC: tl.constexpr, RT: tl.constexpr, STEPS: tl.constexpr):  # fmt: skip
        """("merge") grid (rows, KP / RT): a winner's place in the op's order is the number of keys below it, summed
        over the sorted chunks (a lower-bound binary search of STEPS loads in each; keys are unique); out[place] is
        its id (-1 for a -inf block), and the places past the winners are -1."""
        row = tl.program_id(0).to(tl.int64)
        nvis = (_visible(pos_ptr, row, C, ratio) + BLOCK - 1) // BLOCK
        if nvis > CH:
            e = tl.program_id(1) * RT + tl.arange(0, RT)
            key = tl.load(sorted_ptr + row * KP + e)
            place = tl.zeros([RT], tl.int32)
            for c in tl.static_range(KP // MC):
                lo = tl.zeros([RT], tl.int32)
                hi = tl.full([RT], MC, tl.int32)
                for _ in tl.static_range(STEPS):
                    go = lo < hi
                    mid = (lo + hi) // 2
                    below = tl.load(sorted_ptr + row * KP + c * MC + mid, mask=go, other=0x7FFFFFFFFFFFFFFF) < key
                    lo = tl.where(go & below, mid + 1, lo)
                    hi = tl.where(go & ~below, mid, hi)
                place += lo
            ids = tl.where((key >> 32) >= 0x7F800000, -1, key & 0xFFFFFFFF)
            tl.store(out_ptr + row * K + place, ids, mask=(key != 0x7FFFFFFFFFFFFFFF) & (place < K))
            tl.store(out_ptr + row * K + e, tl.full([RT], -1, tl.int64), mask=(e >= tl.minimum(nvis, K)) & (e < K))


def block_max_jit(interpret: bool = False):
    """The block-max @triton.jit kernel (tests/codegen/_triton_aot.py's factory form)."""
    return _block_max_kernel


def select_jit(interpret: bool = False):
    """The selection @triton.jit kernel (the AOT factory form)."""
    return _select_kernel


def chunk_sort_jit(interpret: bool = False):
    return _chunk_sort_kernel


def merge_jit(interpret: bool = False):
    return _merge_kernel


def triton_candidate_blocks(scores: torch.Tensor, positions: torch.Tensor, *, ratio: int, topk_blocks: int,
                            block: int, cfg: Config | None = None) -> torch.Tensor:  # fmt: skip
    """The op's output (i64 [T, topk_blocks]) from scores [T, C] (any float dtype; f32 is read as is) and
    positions [T]. 2 launches, 4 when the cache has rows longer than `chunk` blocks; no host read of device data
    (CUDA-graph capturable)."""
    if scores.dim() != 2 or positions.shape != scores.shape[:1]:
        raise ValueError(f"candidate_blocks: needs scores [T, C] and positions [T], got {tuple(scores.shape)} and "
                         f"{tuple(positions.shape)}")  # fmt: skip
    t, c = scores.shape
    k = int(topk_blocks)
    cfg = cfg or default_config(t, c, block, k)
    check_config(c, block, k, cfg)
    nb, kp = n_blocks(c, block), _pow2(k)
    ch = cfg.chunk or sort_chunk(nb)
    out = torch.empty(t, k, dtype=torch.int64, device=scores.device)
    if t == 0 or k == 0:
        return out
    s = scores if scores.dtype == torch.float32 else scores.float()
    s = s if s.stride(1) == 1 else s.contiguous()
    pos = positions.contiguous()
    long = _pow2(nb) > ch
    bmax = torch.empty(t, max(nb, 1), dtype=torch.float32, device=s.device)
    best = torch.empty(t, kp if long else 1, dtype=torch.int64, device=s.device)
    if c:
        _block_max_kernel[(t, -(-nb // cfg.bnb))](s, s.stride(0), pos, bmax, c, nb, ratio, BLOCK=block,
                                                  BLKP=_pow2(block), BNB=cfg.bnb, num_warps=cfg.max_warps)  # fmt: skip
    ladder = max(1, (ch // min(cfg.smallest, ch)).bit_length())
    _select_kernel[(t,)](bmax, pos, best, out, c, nb, ratio, BLOCK=block, K=k, KP=kp, CH=ch, LADDER=ladder,
                         LONG=long, SCAN=cfg.scan, num_warps=cfg.sort_warps)  # fmt: skip
    if long:
        mc, rt = min(cfg.merge_chunk, kp), min(MERGE_TILE, kp)
        ordered = torch.empty(t, kp, dtype=torch.int64, device=s.device)
        _chunk_sort_kernel[(t, kp // mc)](pos, best, ordered, c, ratio, BLOCK=block, K=k, KP=kp, CH=ch, MC=mc,
                                          num_warps=max(1, min(8, mc // 128)))  # fmt: skip
        _merge_kernel[(t, kp // rt)](pos, ordered, out, c, ratio, BLOCK=block, K=k, KP=kp, CH=ch, MC=mc, RT=rt,
                                     STEPS=mc.bit_length(), num_warps=4)  # fmt: skip
    return out
