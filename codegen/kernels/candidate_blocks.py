"""candidate_blocks (the first level of V4.1's two-level indexer, MODEL_SPEC §2.13) in 1-4 Triton launches.

    lim_t     = min((p_t + 1) // ratio, C)                       visible columns of row t (follows the sequence)
    bmax[t,b] = max(S[t, j] for j in block b, j < lim_t)       (-inf: no visible entry)
    bmax[t, (lim_t - 1) // block] = +inf                        the newest visible entry's block (when lim_t > 0)
    out[t]    = the topk_blocks block ids of largest bmax, score descending, ties to the lower id;
                -1 for blocks scoring -inf and for padding (fewer visible blocks than topk_blocks)

The columns past lim_t never count (the op's reference masks them too, since session 10: whatever they hold, so
layer 20's index scores need not write them -- select_kernels binds them fill False); the kernels never read them,
so a decode step's cost follows the sequence's length, not max_model_len. NaN scores are not supported in the
visible columns (index scores are never NaN).

1. `block_max_kernel`, grid (rows, blocks / bnb): a program reduces `bnb` blocks of one row -- a [bnb, block] tile
   of the row's visible columns (masked loads: nothing past lim_t is read; a program wholly past it exits at once)
   -- and writes their maxima (-0.0 folded to +0.0, the forced block +inf) to an f32 scratch [rows, NB].
2. `select_kernel`, one program a row: each visible block's 64-bit key -- the score's order-preserving bits,
   inverted (larger first), above its id (ties: the lower id first) -- sorted in registers (tl.sort, bitonic): an
   ascending key order IS the op's order, and the ids are read back from the keys' low half. The sort's size is
   the level of a ladder (`smallest`, 2 x smallest, ..., `chunk`) that holds the row's visible blocks, chosen at run
   time (a 2k context sorts 256 keys, not 512). A row of up to `chunk` (512) blocks is one sort.
3. Longer rows (`long`; a context above 4k tokens at block 8): tl.sort costs ~5 us for 512 keys but ~90 us for 4096
   (H200), so they are not sorted whole. "merge" (the default): the selection's program writes the row's
   min(visible, topk_blocks) winners' keys to a scratch row in id order, without sorting -- past topk_blocks blocks
   the topk_blocks-th best score key is found by a radix select (4 passes over the row's maxima, 8-bit digits, a
   256-bin histogram each) and the keys below it are kept with the first of its ties by id --; `_chunk_sort_kernel`
   (grid rows x KP / 512) sorts them 512 at a time; `_merge_kernel` (grid rows x KP / 128) places each winner at the
   number of keys below it, summed over the sorted chunks by binary searches (keys are unique), and writes its id
   there. "radix": the same winners, then one sort of KP keys by the row's program. "passes": the running best KP
   keys, kept sorted in a scratch row, sorted again together with the next chunk - KP blocks (chunk > KP).
   Every mode follows the row's visible blocks (runtime loop bounds), not the cache.

`fused` (opt-in, for a cache that is one tile of <= FUSE_MAX scores: max_model_len 4096 at block 8 is 512 x 8): the
selection's program computes its row's maxima itself (`_maxima`, the block-max kernel's code): one launch, no scratch
-- but one program reads the row, and on the H200 it lost (B64 ctx4096: 14.8 us vs 11.1 for the two launches).

-inf blocks (and masked lanes) keep the key of -inf and come out as -1, which is where the reference puts them
(after every finite score). The sort's keys hold ids < 2^31.
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
# The sort (tl.sort, bitonic through shared memory) is what costs. H200, session 10 call 2 (B64): a row of 512 keys
# ~5 us, 4096 keys ~90 us (a 64k context in 3 passes: 284 us), 8192 at 16 warps 221 us -- the torch form 212 us.
CHUNK = 512  # the largest sort of the default ladder; longer rows: LONG_MODES["merge"]
CHUNK_MAX = 4096  # (the "passes" mode) blocks one selection pass sorts at most
FUSE_MAX = 8192  # scores a fused selection program loads as one tile at most (the default mml 4096: 512 x 8)
LONG_MODES = {"passes": 0, "radix": 1, "merge": 2}  # rows of more than `chunk` visible blocks (see the docstring)
MERGE_TILE = 128  # winners one merge program places


@dataclass(frozen=True)
class Config:
    bnb: int = 256  # blocks a block-max program reduces (its tile: bnb x block scores)
    max_warps: int = 4
    chunk: int = 0  # keys one selection pass sorts (a power of two); 0: default_config's rule
    sort_warps: int = 8
    smallest: int = 256  # the smallest sort of the selection's ladder (= chunk: one size, whatever the row holds)
    fused: bool = False  # (one-pass rows) the sort's program computes the maxima itself: one launch, no scratch
    long: str = "merge"  # rows of more than `chunk` visible blocks: "merge", "radix" or "passes" (LONG_MODES)
    merge_chunk: int = 512  # ("merge") winners one program sorts; each winner's rank by binary searches in the rest

    @property
    def tag(self) -> str:
        long = {"merge": f"m{self.merge_chunk}", "radix": "r", "passes": "p"}[self.long]
        return f"b{self.bnb}w{self.max_warps}c{self.chunk}s{self.sort_warps}l{self.smallest}{'f' * self.fused}{long}"


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def n_blocks(C: int, block: int) -> int:
    return -(-C // block)


def sort_chunk(nb: int, k: int, chunk: int = 0, long: str = "merge") -> int:
    """The largest sort of a row: the whole row (rounded up to a power of two) when it fits in `chunk` (default
    CHUNK, or for "passes" CHUNK_MAX and at least KP), else `chunk` ("passes": at least 2 KP, so a pass adds blocks)."""
    kp, nbp = _pow2(k), _pow2(nb)
    if long != "passes":
        return min(nbp, chunk or CHUNK)
    cap = max(chunk or CHUNK_MAX, kp)
    return nbp if nbp <= cap else max(cap, 2 * kp)


def default_config(T_: int, C: int, block: int, k: int) -> Config:
    """One rule (H200 call 2, B64 ctx4096: two launches 11.1 us vs fused 14.8, 4 warps): bnb 256 blocks a block-max
    program (2048 scores at block 8), rows of up to CHUNK blocks sorted by their program, longer ones merged."""
    return Config(bnb=256, max_warps=4, chunk=sort_chunk(n_blocks(C, block), k), sort_warps=4)


def config_space(T_: int, C: int, block: int, k: int) -> list[Config]:
    """The default first; fused, block-max tiles of 128 / 512 blocks, the sort on 8 / 16 warps, no ladder (one sort
    size), and for long rows the radix select + one sort, merges of 256-key chunks, or passes of sorts."""
    d = default_config(T_, C, block, k)
    nbp = _pow2(n_blocks(C, block))
    out = [d, replace(d, bnb=128), replace(d, bnb=512), replace(d, smallest=d.chunk)]
    out += [replace(d, sort_warps=w) for w in (8, 16)]
    if nbp <= d.chunk and d.chunk * _pow2(block) <= FUSE_MAX:  # (fused: a cache of one tile)
        out += [replace(d, fused=True), replace(d, fused=True, sort_warps=16)]
    if nbp > d.chunk:
        out += [replace(d, long="radix"), replace(d, merge_chunk=256)]
        out.append(replace(d, long="passes", chunk=4096, sort_warps=8))
    return list(dict.fromkeys(out))


def check_config(C: int, block: int, k: int, cfg: Config) -> None:
    """Raises ValueError naming what a config cannot take."""
    ch = cfg.chunk or sort_chunk(n_blocks(C, block), k, long=cfg.long)
    if cfg.long not in LONG_MODES:
        raise ValueError(f"candidate_blocks: long must be one of {sorted(LONG_MODES)}, not {cfg.long!r}")
    if ch & (ch - 1) or cfg.bnb & (cfg.bnb - 1) or cfg.merge_chunk & (cfg.merge_chunk - 1):
        raise ValueError(f"candidate_blocks: chunk {ch}, bnb {cfg.bnb} and merge_chunk must be powers of two")
    if cfg.long == "passes" and _pow2(n_blocks(C, block)) > ch and ch <= _pow2(k):
        raise ValueError(f"candidate_blocks: a multi-pass chunk ({ch}) must exceed topk_blocks rounded up ({_pow2(k)})")
    if cfg.fused and ch * _pow2(block) > FUSE_MAX:
        raise ValueError(f"candidate_blocks: a fused tile of {ch} x {_pow2(block)} scores exceeds {FUSE_MAX}")
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
    def _select_row(s_ptr, s_stride, bmax_ptr, best_ptr, out_ptr, row, NB, lim, nvis, BLOCK: tl.constexpr,
                    BLKP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, N: tl.constexpr, MULTI: tl.constexpr,
                    FUSED: tl.constexpr):  # fmt: skip
        """The row's first N blocks sorted (then, MULTI, the best KP re-sorted with each next N - KP blocks) and its
        first K keys written as ids; -1 for -inf keys and for the padding past N. FUSED: the maxima from the scores
        here (a [N, block] tile), not from the block-max kernel's scratch."""
        i = tl.arange(0, N)
        if FUSED:
            v = _maxima(s_ptr, s_stride, row, i, lim, BLOCK, BLKP)
        else:
            v = tl.load(bmax_ptr + row * NB + i, mask=i < nvis, other=float("-inf"))
        s = tl.sort(_keys(v, i))
        if MULTI:  # the best KP so far (sorted, in best_ptr's row) re-sorted with the next N - KP blocks
            for start in range(N, nvis, N - KP):
                tl.debug_barrier()  # (every thread's loads of the last pass are done before best is rewritten)
                tl.store(best_ptr + row * KP + i, s, mask=i < KP)
                tl.debug_barrier()  # (the CTA's stores are visible to its loads)
                old = tl.load(best_ptr + row * KP + i, mask=i < KP, other=0)
                new_ids = start + i - KP
                nv = tl.load(bmax_ptr + row * NB + new_ids, mask=(i >= KP) & (new_ids < nvis), other=float("-inf"))
                s = tl.sort(tl.where(i < KP, old, _keys(nv, new_ids)))
        none = (s >> 32) >= 0x7F800000  # the key of -inf (a block with no visible entry, or no block)
        tl.store(out_ptr + row * K + i, tl.where(none, -1, s & 0xFFFFFFFF), mask=i < K)
        if N < K:  # fewer blocks than topk_blocks: padding
            f = tl.arange(0, KP)
            tl.store(out_ptr + row * K + f, tl.full([KP], -1, tl.int64), mask=(f >= N) & (f < K))

    @triton.jit
    def _winners(bmax_ptr, best_ptr, row, NB, nvis, K: tl.constexpr, KP: tl.constexpr, CH: tl.constexpr):
        """The row's min(nvis, K) best blocks' 64-bit keys written to its scratch row in id order, no sort: with more
        than K visible blocks, the K-th best 32-bit score key by a radix select (4 passes over the row's maxima,
        8-bit digits, a 256-bin histogram each), then the keys better than it and the first of its ties by id."""
        prefix = tl.full((), 2**32, tl.int64)  # (<= K blocks: every key is below it)
        rank = tl.full((), 0, tl.int32)
        if nvis > K:
            bins = tl.arange(0, 256)
            prefix = tl.full((), 0, tl.int64)  # the K-th key's digits found so far
            rank = tl.full((), K, tl.int32)  # its rank among the keys that share them
            for p in tl.static_range(4):
                hist = tl.zeros([256], tl.int32)
                for start in range(0, nvis, CH):
                    i = start + tl.arange(0, CH)
                    u = _unsigned(tl.load(bmax_ptr + row * NB + i, mask=i < nvis, other=float("-inf")))
                    match = (i < nvis) & ((u >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
                    hist += tl.histogram(((u >> (24 - 8 * p)) & 255).to(tl.int32), 256, mask=match)
                digit = tl.sum((tl.cumsum(hist, 0) < rank).to(tl.int32), 0)  # the bin holding the rank-th key
                rank -= tl.sum(tl.where(bins < digit, hist, 0), 0)
                prefix = prefix | (digit.to(tl.int64) << (24 - 8 * p))
        taken = tl.full((), 0, tl.int32)
        ties = tl.full((), 0, tl.int32)
        for start in range(0, nvis, CH):
            i = start + tl.arange(0, CH)
            v = tl.load(bmax_ptr + row * NB + i, mask=i < nvis, other=float("-inf"))
            u = _unsigned(v)
            eq = (i < nvis) & (u == prefix)
            sel = ((i < nvis) & (u < prefix)) | (eq & (ties + tl.cumsum(eq.to(tl.int32), 0) <= rank))
            tl.store(best_ptr + row * KP + taken + tl.cumsum(sel.to(tl.int32), 0) - 1, _keys(v, i), mask=sel)
            taken += tl.sum(sel.to(tl.int32), 0)
            ties += tl.sum(eq.to(tl.int32), 0)

    @triton.jit
    def _sort_winners(best_ptr, out_ptr, row, nvis, K: tl.constexpr, KP: tl.constexpr):
        """("radix") the winners sorted by one program: KP keys."""
        tl.debug_barrier()  # (the CTA's stores are visible to its loads)
        j = tl.arange(0, KP)
        s = tl.sort(tl.load(best_ptr + row * KP + j, mask=j < tl.minimum(nvis, K), other=0x7FFFFFFFFFFFFFFF))
        tl.store(out_ptr + row * K + j, tl.where((s >> 32) >= 0x7F800000, -1, s & 0xFFFFFFFF), mask=j < K)

    @triton.jit
    def _select_kernel(s_ptr, s_stride, bmax_ptr, pos_ptr, best_ptr, out_ptr, C, NB, ratio, BLOCK: tl.constexpr,
                       BLKP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, CH: tl.constexpr, LADDER: tl.constexpr,
                       MULTI: tl.constexpr, FUSED: tl.constexpr, LONG: tl.constexpr):  # fmt: skip
        """One program a row: the sort's size is the level of the ladder CH >> (LADDER - 1), ..., CH / 2, CH that
        holds the row's visible blocks (a runtime branch: a 4k context in a 64k cache sorts 512 keys, not 8192).
        Longer rows (MULTI: the cache has them): LONG 0, passes of CH-key sorts; 1, the winners (radix select) and
        one KP-key sort; 2, the winners only (the chunk-sort and merge kernels order them). FUSED (a cache of few
        blocks): one launch, the maxima computed by the sort's program from the scores."""
        row = tl.program_id(0).to(tl.int64)
        lim = _visible(pos_ptr, row, C, ratio)
        nvis = (lim + BLOCK - 1) // BLOCK
        for lvl in tl.static_range(LADDER):  # (level lvl sorts CH >> (LADDER - 1 - lvl) keys)
            lo_ok = nvis >= 0  # (the lowest level: every row up to its size)
            if lvl > 0:
                lo_ok = nvis > (CH >> (LADDER - lvl))
            hi_ok = nvis >= 0  # (the top level: every longer row too)
            if lvl < LADDER - 1:
                hi_ok = nvis <= (CH >> (LADDER - 1 - lvl))
            if lo_ok & hi_ok:
                if MULTI and LONG > 0 and lvl == LADDER - 1:
                    if nvis <= CH:
                        _select_row(s_ptr, s_stride, bmax_ptr, best_ptr, out_ptr, row, NB, lim, nvis, BLOCK, BLKP, K,
                                    KP, CH, False, FUSED)  # fmt: skip
                    else:
                        _winners(bmax_ptr, best_ptr, row, NB, nvis, K, KP, CH)
                        if LONG == 1:
                            _sort_winners(best_ptr, out_ptr, row, nvis, K, KP)
                else:
                    _select_row(s_ptr, s_stride, bmax_ptr, best_ptr, out_ptr, row, NB, lim, nvis, BLOCK, BLKP, K, KP,
                                CH >> (LADDER - 1 - lvl), MULTI and lvl == LADDER - 1, FUSED)  # fmt: skip

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
    positions [T]. One launch (fused) or two, no host read of device data (CUDA-graph capturable)."""
    if scores.dim() != 2 or positions.shape != scores.shape[:1]:
        raise ValueError(f"candidate_blocks: needs scores [T, C] and positions [T], got {tuple(scores.shape)} and "
                         f"{tuple(positions.shape)}")  # fmt: skip
    t, c = scores.shape
    k = int(topk_blocks)
    cfg = cfg or default_config(t, c, block, k)
    check_config(c, block, k, cfg)
    nb, kp = n_blocks(c, block), _pow2(k)
    ch = cfg.chunk or sort_chunk(nb, k, long=cfg.long)
    out = torch.empty(t, k, dtype=torch.int64, device=scores.device)
    if t == 0 or k == 0:
        return out
    s = scores if scores.dtype == torch.float32 else scores.float()
    s = s if s.stride(1) == 1 else s.contiguous()
    pos = positions.contiguous()
    multi = _pow2(nb) > ch
    fused = cfg.fused and not multi
    long = LONG_MODES[cfg.long] if multi else 0
    bmax = torch.empty(t, 1 if fused else nb, dtype=torch.float32, device=s.device)
    best = torch.empty(t, kp if multi else 1, dtype=torch.int64, device=s.device)
    if c and not fused:
        _block_max_kernel[(t, -(-nb // cfg.bnb))](s, s.stride(0), pos, bmax, c, nb, ratio, BLOCK=block,
                                                  BLKP=_pow2(block), BNB=cfg.bnb, num_warps=cfg.max_warps)  # fmt: skip
    ladder = max(1, (ch // min(cfg.smallest, ch)).bit_length())
    _select_kernel[(t,)](s, s.stride(0), bmax, pos, best, out, c, nb, ratio, BLOCK=block, BLKP=_pow2(block), K=k,
                         KP=kp, CH=ch, LADDER=ladder, MULTI=multi, FUSED=fused, LONG=long,
                         num_warps=cfg.sort_warps)  # fmt: skip
    if long == LONG_MODES["merge"]:
        mc, rt = min(cfg.merge_chunk, kp), min(MERGE_TILE, kp)
        ordered = torch.empty(t, kp, dtype=torch.int64, device=s.device)
        _chunk_sort_kernel[(t, kp // mc)](pos, best, ordered, c, ratio, BLOCK=block, K=k, KP=kp, CH=ch, MC=mc,
                                          num_warps=max(1, min(8, mc // 128)))  # fmt: skip
        _merge_kernel[(t, kp // rt)](pos, ordered, out, c, ratio, BLOCK=block, K=k, KP=kp, CH=ch, MC=mc, RT=rt,
                                     STEPS=mc.bit_length(), num_warps=4)  # fmt: skip
    return out
