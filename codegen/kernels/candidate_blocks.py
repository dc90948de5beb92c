"""candidate_blocks (the first level of V4.1's two-level indexer, MODEL_SPEC §2.13) as one or two Triton launches.

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
   time (a 4k context in a 64k cache sorts 512 keys, not 4096). A row of up to `chunk` blocks is one sort.
   Longer rows (a long context with a large cache) go in passes: the running best KP (= topk_blocks rounded up
   to a power of two) keys, kept sorted in a scratch row, are sorted again together with the next chunk - KP
   blocks; the first KP keys of a pass are the best of everything seen (keys are unique).
   The passes follow the row's visible blocks (a runtime loop bound), not the cache.

`fused` (the default when the whole cache is one tile of <= FUSE_MAX scores: max_model_len 4096 at block 8 is 512
x 8): the selection's program computes its row's maxima itself (`_maxima`, the block-max kernel's code): one launch,
no scratch.

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
# blocks one selection pass sorts at most by default: 4096 int64 keys (8 warps: 128 registers, no spill). 8192 (16
# warps) sorts a 64k context at once instead of in 3 passes, but its Triton build took 142 s vs 76 s (2 CPU cores)
CHUNK_MAX = 4096
FUSE_MAX = 8192  # scores a fused selection program loads as one tile at most (the default mml 4096: 512 x 8)


@dataclass(frozen=True)
class Config:
    bnb: int = 256  # blocks a block-max program reduces (its tile: bnb x block scores)
    max_warps: int = 4
    chunk: int = 0  # keys one selection pass sorts (a power of two); 0: default_config's rule
    sort_warps: int = 8
    smallest: int = 256  # the smallest sort of the selection's ladder (= chunk: one size, whatever the row holds)
    fused: bool = False  # (one-pass rows) the sort's program computes the maxima itself: one launch, no scratch
    radix: bool = False  # rows of more than `chunk` blocks by a radix select + one KP sort, not passes of sorts

    @property
    def tag(self) -> str:
        flags = ("f" if self.fused else "") + ("r" if self.radix else "")
        return f"b{self.bnb}w{self.max_warps}c{self.chunk}s{self.sort_warps}l{self.smallest}{flags}"


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def n_blocks(C: int, block: int) -> int:
    return -(-C // block)


def sort_chunk(nb: int, k: int, chunk: int = 0) -> int:
    """Keys a selection pass sorts: the whole row (rounded up to a power of two) when it fits in `chunk`
    (default CHUNK_MAX, at least KP), else `chunk` (multi-pass: at least 2 KP, so a pass adds new blocks)."""
    kp, nbp = _pow2(k), _pow2(nb)
    cap = max(chunk or CHUNK_MAX, kp)
    return nbp if nbp <= cap else max(cap, 2 * kp)


def default_config(T_: int, C: int, block: int, k: int) -> Config:
    """One rule (no tuning yet): bnb 256 blocks a block-max program (2048 scores at block 8), the sort's warps
    by its size (~16 keys a thread, 4..16 warps), fused when the whole cache is one tile of <= FUSE_MAX scores."""
    nb = n_blocks(C, block)
    ch = sort_chunk(nb, k)
    fused = _pow2(nb) <= ch and ch * _pow2(block) <= FUSE_MAX
    return Config(bnb=256, max_warps=4, chunk=ch, sort_warps=min(16, max(4, ch // 512)), fused=fused)


def config_space(T_: int, C: int, block: int, k: int) -> list[Config]:
    """The default first; block-max tiles of 128 / 512 blocks, the sort on 4 / 8 / 16 warps, no ladder (one sort
    size), and for long rows the whole row in one sort of up to 8192 keys, passes of 2 KP, or the radix select."""
    d = default_config(T_, C, block, k)
    nbp, kp = _pow2(n_blocks(C, block)), _pow2(k)
    out = [d, replace(d, fused=False), replace(d, bnb=128), replace(d, bnb=512), replace(d, smallest=d.chunk)]
    out += [replace(d, sort_warps=w) for w in (4, 8, 16)]
    if nbp > d.chunk:
        out += [replace(d, chunk=min(nbp, 2 * CHUNK_MAX), sort_warps=16), replace(d, chunk=2 * kp)]
        out.append(replace(d, radix=True))
    return list(dict.fromkeys(out))


def check_config(C: int, block: int, k: int, cfg: Config) -> None:
    """Raises ValueError naming what a config cannot take."""
    ch = cfg.chunk or sort_chunk(n_blocks(C, block), k)
    if ch & (ch - 1) or cfg.bnb & (cfg.bnb - 1):
        raise ValueError(f"candidate_blocks: chunk {ch} and bnb {cfg.bnb} must be powers of two")
    if _pow2(n_blocks(C, block)) > ch and ch <= _pow2(k):
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
    def _select_radix(bmax_ptr, best_ptr, out_ptr, row, NB, nvis, K: tl.constexpr, KP: tl.constexpr,
                      CH: tl.constexpr):  # fmt: skip
        """A row of more than CH (> K) blocks: the K-th best 32-bit score key by a radix select (4 passes over the
        row's maxima, 8-bit digits, one 256-bin histogram each), then one pass that writes the K winners' 64-bit
        keys to the row's scratch (those better than the K-th, then the K-th's ties by id, the lowest first), and
        one sort of KP keys."""
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
            cum = tl.cumsum(hist, 0)
            digit = tl.sum((cum < rank).to(tl.int32), 0)  # the bin holding the rank-th key
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
            at = taken + tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(best_ptr + row * KP + at, _keys(v, i), mask=sel)
            taken += tl.sum(sel.to(tl.int32), 0)
            ties += tl.sum(eq.to(tl.int32), 0)
        tl.debug_barrier()  # (the CTA's stores are visible to its loads)
        j = tl.arange(0, KP)
        s = tl.sort(tl.load(best_ptr + row * KP + j, mask=j < K, other=0x7FFFFFFFFFFFFFFF))
        tl.store(out_ptr + row * K + j, tl.where((s >> 32) >= 0x7F800000, -1, s & 0xFFFFFFFF), mask=j < K)

    @triton.jit
    def _select_kernel(s_ptr, s_stride, bmax_ptr, pos_ptr, best_ptr, out_ptr, C, NB, ratio, BLOCK: tl.constexpr,
                       BLKP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, CH: tl.constexpr, LADDER: tl.constexpr,
                       MULTI: tl.constexpr, FUSED: tl.constexpr, RADIX: tl.constexpr):  # fmt: skip
        """One program a row: the sort's size is the level of the ladder CH >> (LADDER - 1), ..., CH / 2, CH that
        holds the row's visible blocks (a runtime branch: a 4k context in a 64k cache sorts 512 keys, not 8192);
        the top level takes every longer row in passes (MULTI). FUSED (a cache of few blocks): one launch, the
        maxima computed by the sort's program from the scores."""
        row = tl.program_id(0).to(tl.int64)
        lim = _visible(pos_ptr, row, C, ratio)
        nvis = (lim + BLOCK - 1) // BLOCK
        for lvl in tl.static_range(LADDER):  # (level lvl sorts CH >> (LADDER - 1 - lvl) keys)
            lo_ok = nvis >= 0  # (the lowest level: every row up to its size)
            if lvl > 0:
                lo_ok = nvis > (CH >> (LADDER - lvl))
            hi_ok = nvis >= 0  # (the top level: every longer row, in passes)
            if lvl < LADDER - 1:
                hi_ok = nvis <= (CH >> (LADDER - 1 - lvl))
            if lo_ok & hi_ok:
                if RADIX and MULTI and lvl == LADDER - 1:  # (rows of more than CH blocks: a radix select)
                    if nvis <= CH:
                        _select_row(s_ptr, s_stride, bmax_ptr, best_ptr, out_ptr, row, NB, lim, nvis, BLOCK, BLKP, K,
                                    KP, CH, False, FUSED)  # fmt: skip
                    else:
                        _select_radix(bmax_ptr, best_ptr, out_ptr, row, NB, nvis, K, KP, CH)
                else:
                    _select_row(s_ptr, s_stride, bmax_ptr, best_ptr, out_ptr, row, NB, lim, nvis, BLOCK, BLKP, K, KP,
                                CH >> (LADDER - 1 - lvl), MULTI and lvl == LADDER - 1, FUSED)  # fmt: skip


def block_max_jit(interpret: bool = False):
    """The block-max @triton.jit kernel (tests/codegen/_triton_aot.py's factory form)."""
    return _block_max_kernel


def select_jit(interpret: bool = False):
    """The selection @triton.jit kernel (the AOT factory form)."""
    return _select_kernel


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
    ch = cfg.chunk or sort_chunk(nb, k)
    out = torch.empty(t, k, dtype=torch.int64, device=scores.device)
    if t == 0 or k == 0:
        return out
    s = scores if scores.dtype == torch.float32 else scores.float()
    s = s if s.stride(1) == 1 else s.contiguous()
    pos = positions.contiguous()
    multi = _pow2(nb) > ch
    fused = cfg.fused and not multi
    bmax = torch.empty(t, 1 if fused else nb, dtype=torch.float32, device=s.device)
    best = torch.empty(t, kp if multi else 1, dtype=torch.int64, device=s.device)
    if c and not fused:
        _block_max_kernel[(t, -(-nb // cfg.bnb))](s, s.stride(0), pos, bmax, c, nb, ratio, BLOCK=block,
                                                  BLKP=_pow2(block), BNB=cfg.bnb, num_warps=cfg.max_warps)  # fmt: skip
    ladder = max(1, (ch // min(cfg.smallest, ch)).bit_length())
    _select_kernel[(t,)](s, s.stride(0), bmax, pos, best, out, c, nb, ratio, BLOCK=block, BLKP=_pow2(block), K=k,
                         KP=kp, CH=ch, LADDER=ladder, MULTI=multi, FUSED=fused, RADIX=cfg.radix,
                         num_warps=cfg.sort_warps)  # fmt: skip
    return out
