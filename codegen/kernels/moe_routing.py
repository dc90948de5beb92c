"""MoE routing: sqrtsoftplus scores, bias-corrected top-k selection, normalised and scaled weights.

    score = sqrt(softplus(logits))                       logits = x @ W_gateᵀ, fp32 [T, E]
    idx   = topk(score + bias, k)                        the bias only steers selection
    w     = score[idx] / Σ score[idx] · route_scale      (MODEL_SPEC §2.12; V4.1: E=384, k=6, scale 1.5)

The kernel does k rounds of (row max, lowest index attaining it, mask it out) over the E scores held
in registers: for k=6 and E=384 that beats a sort and gives a defined tie rule (lowest expert id),
which the reference reproduces so the comparison is exact.
"""

import functools
from dataclasses import dataclass

import torch

try:  # optional: the Triton variant; tl must be a module global so the interpreter can patch it
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

FAMILY = "moe_routing"


@dataclass(frozen=True)
class Config:
    block_m: int = 1
    threads: int = 128


def config_space(T_: int, E: int) -> list[Config]:
    return [Config(bm, t) for bm in (1, 2, 4, 8) for t in (32, 64, 128, 256) if bm * E >= t]


def program(T_: int | None, E: int, *, topk: int, route_scale: float, target: str, cfg: Config = Config()):
    """prim_func(L [T, E] fp32, B [E] fp32, Idx [T, k] int32, Wt [T, k] fp32).

    T_=None: the token count is symbolic (one build for every T; rows of the last block past T read as 0 and
    are not written)."""
    import tilelang.language as T

    from deepinfer.codegen.kernels._common import Mem

    T_ = T.dynamic("T") if T_ is None else T_
    bm = cfg.block_m
    mem = Mem(target)
    NEG = -3.0e38

    @T.prim_func
    def moe_routing(
        L: T.Tensor((T_, E), "float32"),
        Bias: T.Tensor((E,), "float32"),
        Idx: T.Tensor((T_, topk), "int32"),
        Wt: T.Tensor((T_, topk), "float32"),
    ):
        with T.Kernel(T.ceildiv(T_, bm), threads=cfg.threads) as bx:
            score = mem.fragment((bm, E), "float32")
            sel = mem.fragment((bm, E), "float32")
            cand = mem.fragment((bm, E), "float32")
            best = mem.fragment((bm,), "float32")
            pick = mem.fragment((bm,), "float32")
            wsel = mem.shared((bm, topk), "float32")
            isel = mem.shared((bm, topk), "int32")
            wsum = mem.fragment((bm,), "float32")
            T.clear(wsum)
            for i, e in mem.par(bm, E):
                v = T.if_then_else(bx * bm + i < T_, L[bx * bm + i, e], 0.0)
                # stable softplus: max(v, 0) + log(1 + exp(-|v|)); min(v, -v) = -|v| also on the C target,
                # whose codegen has no fabs/log1p (the absolute error of log(1+t) is ~1 ulp of 1)
                score[i, e] = T.sqrt(T.max(v, 0.0) + T.log(1.0 + T.exp(T.min(v, -v))))
                sel[i, e] = score[i, e] + Bias[e]
            for j in T.serial(topk):
                T.reduce_max(sel, best, dim=1)
                for i, e in mem.par(bm, E):
                    cand[i, e] = T.if_then_else(sel[i, e] == best[i], T.cast(e, "float32"), 1.0e9)
                T.reduce_min(cand, pick, dim=1)  # lowest expert id among ties
                for i, e in mem.par(bm, E):
                    cand[i, e] = T.if_then_else(T.cast(e, "float32") == pick[i], score[i, e], 0.0)
                    sel[i, e] = T.if_then_else(T.cast(e, "float32") == pick[i], NEG, sel[i, e])
                T.reduce_sum(cand, best, dim=1)  # the picked expert's unbiased score
                for i in mem.par(bm):
                    wsel[i, j] = best[i]
                    wsum[i] += best[i]
                    isel[i, j] = T.cast(pick[i], "int32")
            for i, j in mem.par(bm, topk):
                if bx * bm + i < T_:
                    Wt[bx * bm + i, j] = wsel[i, j] / wsum[i] * route_scale
                    Idx[bx * bm + i, j] = isel[i, j]

    return moe_routing


# ---------------------------------------------------------------------------------------------- triton


@functools.lru_cache(maxsize=2)
def _triton_kernel(interpret: bool):
    """Built lazily (and per interpreter mode, which triton fixes at decoration time)."""
    if triton is None:
        raise ImportError("triton is not installed (pip install deepinfer[codegen])")

    @triton.jit
    def moe_routing_kernel(
        l_ptr,
        b_ptr,
        idx_ptr,
        w_ptr,
        E,
        route_scale,
        TOPK: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # one program per token; same k rounds of (max, lowest id, mask) as the TileLang kernel
        row = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        valid = e < E
        v = tl.load(l_ptr + row * E + e, mask=valid, other=0.0)
        score = tl.sqrt(tl.maximum(v, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(v))))
        sel = tl.where(valid, score + tl.load(b_ptr + e, mask=valid, other=0.0), -float("inf"))
        kk = tl.arange(0, BLOCK_K)
        ws = tl.zeros([BLOCK_K], dtype=tl.float32)
        ids = tl.zeros([BLOCK_K], dtype=tl.int32)
        for j in tl.static_range(TOPK):
            best = tl.max(sel, axis=0)
            pick = tl.min(tl.where(sel == best, e, BLOCK_E), axis=0)
            wj = tl.sum(tl.where(e == pick, score, 0.0), axis=0)
            ws = tl.where(kk == j, wj, ws)
            ids = tl.where(kk == j, pick, ids)
            sel = tl.where(e == pick, -float("inf"), sel)
        ws = ws / tl.sum(ws, axis=0) * route_scale
        out = kk < TOPK
        tl.store(w_ptr + row * TOPK + kk, ws, mask=out)
        tl.store(idx_ptr + row * TOPK + kk, ids, mask=out)

    return moe_routing_kernel


def triton_moe_routing(logits: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float):
    """Triton routing: (idx int32 [T, k], weights fp32 [T, k]); logits fp32 [T, E]."""
    import os

    T_, E = logits.shape
    idx = torch.empty(T_, topk, dtype=torch.int32, device=logits.device)
    w = torch.empty(T_, topk, dtype=torch.float32, device=logits.device)
    kernel = _triton_kernel(os.environ.get("TRITON_INTERPRET") == "1")
    kernel[(T_,)](
        logits,
        bias,
        idx,
        w,
        E,
        route_scale,
        TOPK=topk,
        BLOCK_E=triton.next_power_of_2(E),
        BLOCK_K=triton.next_power_of_2(topk),
    )
    return idx, w


# ---------------------------------------------------------------------------------------------- reference


def reference(logits: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float):
    """Torch reference: (idx int32 [T, k], weights fp32 [T, k]); ties go to the lowest expert id."""
    score = torch.sqrt(torch.nn.functional.softplus(logits.float()))
    sel = score + bias.float()
    # a stable descending sort breaks ties by position, i.e. lowest id first, like the kernel
    idx = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :topk]
    w = score.gather(-1, idx)
    return idx.to(torch.int32), w / w.sum(-1, keepdim=True) * route_scale


def reference_f64(logits: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float):
    """Independent oracle: float64, softplus from its definition, selection by full argsort per row."""
    s = torch.sqrt(torch.log(1.0 + torch.exp(logits.double())))
    order = torch.argsort(-(s + bias.double()), dim=-1, stable=True)[:, :topk]
    w = torch.stack([s[t, order[t]] for t in range(s.shape[0])])
    return order, w / w.sum(-1, keepdim=True) * route_scale


def roofline(T_: int, E: int, topk: int) -> tuple[float, float]:
    """(bytes, flops): read logits and bias, write ids and weights; ~8 flops per score per round."""
    return float(4 * T_ * E + 4 * E + 8 * T_ * topk), float(T_ * E * (6 + 4 * topk))


# ---------------------------------------------------------------------------------------------- ascend


def ascend_program(T_: int, E: int, *, topk: int, route_scale: float, block_m: int = 32, num_cores: int = 32):
    """Ascend 950 routing (vector cores): SIMT scores over all (token, expert) lanes, then one SIMT
    thread per token runs the k selection rounds over its row in the Unified Buffer (strict `>` keeps
    the lowest expert id on ties, like the CUDA kernel)."""
    import tilelang.ascend.language as T

    bm, NEG = block_m, -3.0e38
    assert T_ % bm == 0 and bm % 32 == 0

    @T.prim_func
    def moe_routing_ascend(
        L: T.Tensor((T_, E), "float32"),
        Bias: T.Tensor((E,), "float32"),
        Idx: T.Tensor((T_, topk), "int32"),
        Wt: T.Tensor((T_, topk), "float32"),
    ):
        with T.Kernel(num_cores) as bx:
            score = T.alloc_shared((bm, E), "float32")
            sel = T.alloc_shared((bm, E), "float32")
            b_ub = T.alloc_shared((E,), "float32")
            w_ub = T.alloc_shared((bm, topk), "float32")
            i_ub = T.alloc_shared((bm, topk), "int32")
            T.copy(Bias, b_ub)
            for tile in T.Persistent([T_ // bm], num_cores, bx):
                T.copy(L[tile * bm, 0], score)
                with T.SimtVF(threads=128):
                    for i, e in T.Parallel(bm, E):
                        v = score[i, e]
                        score[i, e] = T.sqrt(T.max(v, 0.0) + T.log(1.0 + T.exp(T.min(v, -v))))
                        sel[i, e] = score[i, e] + b_ub[e]
                with T.SimtVF(threads=bm):  # exactly one thread per token row
                    for i in T.Parallel(bm):
                        tot = T.alloc_var("float32", init=0.0)
                        for j in T.serial(topk):
                            best = T.alloc_var("float32", init=NEG)
                            arg = T.alloc_var("int32", init=0)
                            for e in T.serial(E):
                                if sel[i, e] > best:
                                    best = sel[i, e]
                                    arg = e
                            sel[i, arg] = NEG
                            i_ub[i, j] = arg
                            w_ub[i, j] = score[i, arg]
                            tot = tot + score[i, arg]
                        for j in T.serial(topk):
                            w_ub[i, j] = w_ub[i, j] / tot * route_scale
                T.copy(w_ub, Wt[tile * bm, 0])
                T.copy(i_ub, Idx[tile * bm, 0])

    return moe_routing_ascend


# ---------------------------------------------------------------------------------------------- contiguous layout
# The prefill MoE's token permute (runtime/kernel_adapters._moe_layout_rows / _run_contiguous_fp8): every (token, k)
# pair gets a row of the contiguous layout -- expert e's pairs fill whole block_m-row tiles starting at tile
# first[e] = sum over e' < e of ceil(count[e'] / block_m), in flat pair order (what argsort(stable=True) gives) --
# and x, quantised per `group` columns, is written to each of its K rows. The torch formulation is ~15 launches
# (scatter_add counts, cumsums, a stable argsort, gathers, searchsorted) plus a quantisation, an index map and two
# gathers; here it is three launches and no device -> host read:
#   layout_counts   one program per (expert, segment of the flat ids): its pair count there (a masked sum;
#                   E x T*K compares in all, no atomics, so no zeroed buffer to launch first)
#   layout_slots    one program per (expert e, segment s): the experts' counts (the sums of the segment table)
#                   give e's first row, e's pairs in the segments before s the offset, then a scan of segment s in
#                   steps (a cumsum of the mask) gives each of e's pairs its rank in pair order; the programs after
#                   them write tile_expert (tile i: the number of experts whose tiles end at or before i, -1 past
#                   the last), the counts and the exact tile count
#   gather_quant    one program per token: its row quantised exactly as act_quant's kernel does (the scale from
#                   the float's exponent bits), the codes stored to its K rows and the scales to their columns of
#                   the MN-major [D/group, rows] scales; one program per expert (before the T tokens' programs, so
#                   the fills overlap them) writes the rows that pad its last tile as zero codes with the floor's
#                   scale (act_quant's padding rows)
# tile_expert is written for a caller-chosen number of tiles (the bound min(E, T*K) + T*K // block_m where the count
# is not read back); rows of tiles past the exact count are not written (the GEMMs skip tiles of expert -1).
# half_tiles (issue 8, the persistent grouped program's option): an expert's last tile whose real rows are at most
# block_m / 2 is written as e + fp8_gemm.HALF_TILE_FLAG; the rows stay where they are (block_m-row slots), only the
# GEMMs treat such a tile as 64 rows (fp8_gemm._program_sm90_ws, half_tiles).


def layout_tile_bound(pairs: int, n_experts: int, block_m: int) -> int:
    """An upper bound of sum over experts of ceil(count / block_m) that needs no count: each expert holding pairs
    adds at most one partial tile."""
    return min(n_experts, pairs) + pairs // block_m


@functools.lru_cache(maxsize=2)
def _layout_kernels(interpret: bool):
    """(layout_counts, layout_slots, gather_quant), built lazily per interpreter mode."""
    if triton is None:
        raise ImportError("triton is not installed (pip install deepinfer[codegen])")

    @triton.jit
    def layout_counts_kernel(idx_ptr, part_ptr, P, E, SEG, BLOCK: tl.constexpr):
        # program (e, s): pairs of expert e among the flat ids [s * SEG, (s + 1) * SEG) -> part[s, e]
        e, s = tl.program_id(0), tl.program_id(1)
        hits = tl.zeros([BLOCK], dtype=tl.int32)
        end = tl.minimum(s * SEG + SEG, P)
        for start in range(s * SEG, end, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            hits += (tl.load(idx_ptr + offs, mask=offs < end, other=-1) == e).to(tl.int32)
        tl.store(part_ptr + s * E + e, tl.sum(hits, axis=0))

    @triton.jit
    def layout_slots_kernel(idx_ptr, part_ptr, counts_ptr, slot_ptr, tile_expert_ptr, total_ptr, P, E, S, SEG,
                            N_TILES, BLOCK_M, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                            TILE_BLOCK: tl.constexpr, HALF_FLAG: tl.constexpr = 0):  # fmt: skip
        pid = tl.program_id(0)
        ee = tl.arange(0, BLOCK_E)
        ss = tl.arange(0, BLOCK_S)[:, None]
        part = tl.load(part_ptr + ss * E + ee[None, :], mask=(ss < S) & (ee[None, :] < E), other=0)
        counts = tl.sum(part, axis=0)
        tiles = (counts + BLOCK_M - 1) // BLOCK_M
        if pid < E * S:  # program (e, s): ranks of expert e's pairs in segment s
            e, s = pid % E, pid // E
            # the expert's first row, plus its pairs in the segments before s
            row = tl.sum(tl.where(ee < e, tiles, 0), axis=0) * BLOCK_M
            row += tl.sum(tl.sum(tl.where((ss < s) & (ee[None, :] == e), part, 0), axis=1), axis=0)
            end = tl.minimum(s * SEG + SEG, P)
            for start in range(s * SEG, end, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mine = (tl.load(idx_ptr + offs, mask=offs < end, other=-1) == e).to(tl.int32)
                rank = tl.cumsum(mine, axis=0) - 1  # inclusive scan: pairs of this expert keep pair order
                tl.store(slot_ptr + offs, (row + rank).to(slot_ptr.dtype.element_ty), mask=mine > 0)
                row += tl.sum(mine, axis=0)
        else:
            ends = tl.where(ee < E, tl.cumsum(tiles, axis=0), 2147483647)  # experts past E never own a tile
            t = (pid - E * S) * TILE_BLOCK + tl.arange(0, TILE_BLOCK)
            owner = tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), axis=1)
            meta = tl.where(owner < E, owner, -1)
            if HALF_FLAG:  # the owner's last tile, when it holds at most BLOCK_M / 2 of its pairs
                mine = ee[None, :] == owner[:, None]
                last = tl.sum(tl.where(mine, ends, 0), axis=1) - 1
                tail = tl.sum(tl.where(mine, counts - (tiles - 1) * BLOCK_M, 0), axis=1)
                meta += tl.where((owner < E) & (t == last) & (2 * tail <= BLOCK_M), HALF_FLAG, 0)
            tl.store(tile_expert_ptr + t, meta, mask=t < N_TILES)
            if pid == E * S:
                tl.store(counts_ptr + ee, counts, mask=ee < E)
                tl.store(total_ptr, tl.sum(tiles, axis=0).to(tl.int64))

    @triton.jit
    def gather_quant_kernel(x_ptr, slot_ptr, counts_ptr, q_ptr, s_ptr, xq_ptr, xs_ptr, T, E, D, stride_x, ROWS,
                            BLOCK_M, K: tl.constexpr, G: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_PAD: tl.constexpr, WRITE_X: tl.constexpr,
                            FILL: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0) - E  # the E padding programs first: their fills overlap the tokens' programs
        g = tl.arange(0, BLOCK_G)[:, None]
        c = tl.arange(0, GROUP)[None, :]
        gs = tl.arange(0, BLOCK_G)
        if pid >= 0:
            x = tl.load(x_ptr + pid.to(tl.int64) * stride_x + g * GROUP + c, mask=g < G, other=0.0).to(tl.float32)
            # act_quant_kernel's numbers: 2^(ceil(log2(max(amax, 1e-4) / 448))) from the exponent bits, x times
            # the exact inverse power of two, clamped to +-448
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
            bits = amax.to(tl.uint32, bitcast=True)
            ex = ((bits >> 23) & 0xFF).to(tl.int32) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
            scale = ((ex + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
            inv = ((127 - ex).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
            q = tl.clamp(x * inv[:, None], -448.0, 448.0).to(q_ptr.dtype.element_ty)
            for j in tl.static_range(K):
                r = tl.load(slot_ptr + pid * K + j).to(tl.int64)
                tl.store(q_ptr + r * D + g * GROUP + c, q, mask=g < G)
                tl.store(s_ptr + gs * ROWS + r, scale, mask=gs < G)
            if WRITE_X:  # the un-permuted codes too ([T, D], scales [G, T]): the shared expert reads them
                tl.store(xq_ptr + pid.to(tl.int64) * D + g * GROUP + c, q, mask=g < G)
                tl.store(xs_ptr + gs * T + pid, scale, mask=gs < G)
        else:
            e = pid + E
            ee = tl.arange(0, BLOCK_E)
            counts = tl.load(counts_ptr + ee, mask=ee < E, other=0)
            tiles = (counts + BLOCK_M - 1) // BLOCK_M
            n = tl.sum(tl.where(ee == e, counts, 0), axis=0)
            first_pad = tl.sum(tl.where(ee < e, tiles, 0), axis=0) * BLOCK_M + n
            # the expert's padding rows are one contiguous range of rows: zero-fill it as flat bytes
            pad_rows = tl.sum(tl.where(ee == e, tiles, 0), axis=0) * BLOCK_M - n
            base = q_ptr + first_pad.to(tl.int64) * D
            f = tl.arange(0, FILL)
            for start in range(0, pad_rows * D, FILL):
                zeros = tl.zeros([FILL], dtype=q_ptr.dtype.element_ty)
                tl.store(base + start + f, zeros, mask=start + f < pad_rows * D)
            p = tl.arange(0, BLOCK_PAD)
            floor = tl.full([BLOCK_PAD], 2.0**-22, dtype=tl.float32)  # the scale of an all-zero group
            for gi in range(0, G):
                tl.store(s_ptr + gi * ROWS + first_pad + p, floor, mask=p < pad_rows)

    return layout_counts_kernel, layout_slots_kernel, gather_quant_kernel


def _layout_counts_kernel(interpret: bool):  # one kernel per factory: what tests' sm90 builds take
    return _layout_kernels(interpret)[0]


def _layout_slots_kernel(interpret: bool):
    return _layout_kernels(interpret)[1]


def _gather_quant_kernel(interpret: bool):
    return _layout_kernels(interpret)[2]


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


LAYOUT_BLOCK = 2048  # flat ids a layout program reads per step
LAYOUT_WARPS = 8
LAYOUT_PROGRAMS = 1024  # (expert, segment) programs a layout launch aims at: E=48 -> 22 segments of 2235 ids at
#                         8192 tokens x 6, E=384 -> 3 of 16384
TILE_BLOCK = 64  # tile_expert entries a program writes
GATHER_WARPS = 8  # a token's [D/group, group] tile over 256 threads: 20 fp32 values of x a thread at D=5120
GATHER_FILL = 8192  # padding codes a program zeroes per step (an expert pads < block_m rows: <= 80 steps at D=5120)


def layout_segments(pairs: int, n_experts: int) -> int:
    """How many segments the flat ids split into: about LAYOUT_PROGRAMS (expert, segment) programs, at least one
    LAYOUT_BLOCK step each (an expert's program alone would scan all T*K ids in sequence)."""
    return max(1, min(triton.cdiv(pairs, LAYOUT_BLOCK), triton.cdiv(LAYOUT_PROGRAMS, n_experts)))


def triton_contiguous_layout(idx: torch.Tensor, n_experts: int, block_m: int, n_tiles: int, half_tiles: bool = False):
    """The contiguous layout of idx [T, K] (expert ids) on the device, two launches, no host read: (slot [T*K] of
    idx's dtype, tile_expert [n_tiles] int32 (-1 past the last expert's tiles), counts [E] int32, the exact tile
    count [1] int64). n_tiles: how many tile_expert entries to write (>= the exact count, e.g. layout_tile_bound).
    The flat ids split into S segments; program (e, s) of each launch handles expert e's pairs in segment s (the
    counts per segment first, then the ranks: the segments before s and the experts before e give the offset).
    half_tiles: last tiles with at most block_m / 2 pairs flagged (fp8_gemm.HALF_TILE_FLAG added to the expert)."""
    flat = idx.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    pairs, dev = flat.numel(), flat.device
    counts_k, slots_k, _ = _layout_kernels(_interpreting())
    segs = layout_segments(pairs, n_experts)
    seg = triton.cdiv(pairs, segs)
    part = torch.empty(segs, n_experts, dtype=torch.int32, device=dev)
    counts = torch.empty(n_experts, dtype=torch.int32, device=dev)
    slot = torch.empty_like(flat)
    tile_expert = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int64, device=dev)
    block = min(LAYOUT_BLOCK, triton.next_power_of_2(max(seg, 16)))
    counts_k[(n_experts, segs)](flat, part, pairs, n_experts, seg, BLOCK=block, num_warps=LAYOUT_WARPS)
    grid = n_experts * segs + max(1, triton.cdiv(n_tiles, TILE_BLOCK))
    slots_k[(grid,)](flat, part, counts, slot, tile_expert, total, pairs, n_experts, segs, seg, n_tiles, block_m,
                     BLOCK=block, BLOCK_E=triton.next_power_of_2(n_experts), BLOCK_S=triton.next_power_of_2(segs),
                     TILE_BLOCK=TILE_BLOCK, HALF_FLAG=_half_flag(half_tiles), num_warps=LAYOUT_WARPS)  # fmt: skip
    return slot, tile_expert, counts, total


def _half_flag(half_tiles: bool) -> int:
    from deepinfer.codegen.kernels.fp8_gemm import HALF_TILE_FLAG

    return HALF_TILE_FLAG if half_tiles else 0


def contiguous_layout_reference(idx: torch.Tensor, n_experts: int, block_m: int, n_tiles: int,
                                half_tiles: bool = False):  # fmt: skip
    """Torch: the same four tensors from counts by scatter_add, a stable argsort of the flat ids (pairs of one expert
    keep pair order) and searchsorted over the tile ends (no host read either); half_tiles: the last tile of an
    expert with at most block_m / 2 pairs there gets the flag, scattered to it (experts without one: to a dropped
    entry)."""
    flat = idx.reshape(-1)
    ones = torch.ones_like(flat, dtype=torch.long)
    # bincount's counts without its host read of the maximum (torch.bincount synchronises on CUDA)
    counts = torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat.long(), ones)
    tiles_per = (counts + block_m - 1) // block_m
    ends = torch.cumsum(tiles_per, 0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    start_of = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - start_of[sorted_e]
    slot = torch.empty_like(flat)
    slot[order] = ((ends - tiles_per)[sorted_e] * block_m + rank).to(flat.dtype)
    # tile i belongs to the first expert whose tiles end after i; tiles past the last one are padding (-1)
    e = torch.searchsorted(ends, torch.arange(n_tiles, device=flat.device), right=True)
    tile_expert = torch.where(e < n_experts, e, torch.full_like(e, -1))
    if half_tiles:
        half = (tiles_per > 0) & (2 * (counts - (tiles_per - 1) * block_m) <= block_m)
        at = torch.where(half, ends - 1, torch.full_like(ends, n_tiles))
        flags = torch.zeros(n_tiles + 1, dtype=torch.long, device=flat.device).scatter_(0, at, _half_flag(True))
        tile_expert = tile_expert + flags[:n_tiles]
    return slot, tile_expert.to(torch.int32), counts.to(torch.int32), ends[-1:]


def triton_gather_quant(x: torch.Tensor, slot: torch.Tensor, counts: torch.Tensor, group: int, rows: int,
                        block_m: int, with_x: bool = False, out_dtype=None, num_warps: int = 0):  # fmt: skip
    """x [T, D] quantised per `group` columns (act_quant's codes and scales bit for bit) straight into the layout:
    (codes [rows, D], MN-major fp32 scales [D/group, rows], and with_x the un-permuted (codes [T, D], scales
    [D/group, T]) else None). Pair t*K + j's row slot[t*K + j] holds token t; the rows that pad each expert's last
    tile hold zero codes with the floor's scale; other rows are not written. One launch, E + T programs.
    out_dtype: e4m3 on CUDA, float32 under the CPU interpreter (the codes' values; no fp8 stores there).
    num_warps: 0 = GATHER_WARPS (the benchmark rows try others)."""
    t, d = x.shape
    k = slot.numel() // max(t, 1)
    assert slot.numel() == t * k and d % group == 0 and x.stride(1) == 1, (x.shape, slot.shape, group)
    if out_dtype is None:
        out_dtype = torch.float8_e4m3fn if x.is_cuda else torch.float32
    a = torch.empty(rows, d, dtype=out_dtype, device=x.device)
    sa = torch.empty(d // group, rows, dtype=torch.float32, device=x.device)
    xq = torch.empty(t if with_x else 1, d, dtype=out_dtype, device=x.device)
    xs = torch.empty(d // group, t if with_x else 1, dtype=torch.float32, device=x.device)
    n_experts, g = counts.numel(), d // group
    _layout_kernels(_interpreting())[2][(t + n_experts,)](
        x, slot, counts, a, sa, xq, xs, t, n_experts, d, x.stride(0), rows, block_m, K=k, G=g, GROUP=group,
        BLOCK_G=triton.next_power_of_2(g), BLOCK_E=triton.next_power_of_2(n_experts),
        BLOCK_PAD=triton.next_power_of_2(block_m), WRITE_X=with_x, FILL=GATHER_FILL,
        num_warps=num_warps or GATHER_WARPS)  # fmt: skip
    return a, sa, ((xq, xs) if with_x else None)


def gather_quant_reference(x: torch.Tensor, slot: torch.Tensor, counts: torch.Tensor, group: int, rows: int,
                           block_m: int, with_x: bool = False):  # fmt: skip
    """Torch: act_quant.reference of x, its rows gathered to the layout rows by the inverse of slot, the padding
    rows of every expert's last tile as zero codes with the floor's scale; rows past the experts' tiles too (no
    host read: counts and block_m only fix which rows those are)."""
    from deepinfer.codegen.kernels import act_quant

    t, d = x.shape
    q, s = act_quant.reference(x, group, t + 1)  # row t: an all-zero row (zero codes, the floor's scale)
    src = torch.full((rows,), t, dtype=torch.long, device=x.device)  # rows >= the tiles' rows > every slot
    src[slot.long()] = torch.arange(slot.numel(), device=x.device) // (slot.numel() // max(t, 1))
    a = q.view(torch.uint8)[src].view(torch.float8_e4m3fn)
    return a, s[:, src].contiguous(), ((q[:t], s[:, :t].contiguous()) if with_x else None)


def gather_quant_roofline(t: int, d: int, k: int, group: int, x_bytes: int = 2) -> float:
    """Bytes of one gather_quant: read x and the slots, write K code rows and their fp32 scales per token."""
    return float(t * d * x_bytes + t * k * 8 + t * k * (d + 4 * d // group))
