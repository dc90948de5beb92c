"""MoE grouped FP8 GEMM, contiguous (prefill) layout: one launch for all experts.

Tokens routed to the experts are sorted by expert and each expert's segment is padded to a multiple
of block_m, so every M tile belongs to exactly one expert (DeepGEMM's "contiguous" layout):

    C[m, :] = (A[m] ⊙ sa[:, m]) @ (B[e(m)] ⊙ sb[e(m)])ᵀ        e(m) = TileExpert[m // block_m]
    A  [M, K] fp8, sa [K/ag, M] fp32 (MN-major)   B [E, N, K] fp8, sb [E, N/wb, K/wb] fp32

The inner loop is fp8_gemm's (per-K-tile MMA, then exact promotion with the scales); the only
difference is that the tile's expert id offsets the weight and scale reads. Padding tiles
(expert -1) produce rows that the unpermute never reads.

On sm90 (`sm90_config`, `_program_sm90`) the main loop is fp8_gemm's improved one: 2 consumer
warpgroups, 128 K per TMA stage, one async wgmma per 32-K sub-block overlapped with the exact promotion
of the previous one, weight scales of the N tile staged once. A tile without real rows runs zero K
iterations (its expert's weights are not read).

Masked (decode) layout, sm90: every expert owns `max_rows` rows (e*max_rows ...) and Counts[e] says how
many are real (DeepGEMM's "masked" layout); tiles past the count are skipped, so only the weights of
experts with tokens are read. Not yet here: W4A8 experts and the fused clamped-SwiGLU epilogue.
"""

import torch

from deepinfer.codegen.kernels._common import Mem, ceil_div
from deepinfer.codegen.kernels.fp8_gemm import Config, default_config  # noqa: F401  (same tile config)

FAMILY = "moe_grouped_gemm"


def sm90_config(M: int, N: int, masked: bool = False) -> Config:
    """fp8_gemm's best measured sm90 main loop (2 consumer warpgroups, 128-K stages, async wgmma overlapped
    with the per-32 promotion); at decode (masked layout, few rows per expert) a 64-row tile on one
    warpgroup, so an expert with a handful of tokens does not pay for 128 rows of MMA."""
    if masked:
        return Config(64, 128, 128, 4, 128, True, True)
    return Config(128, 128, 128, 4, 256, True, True)


def _is_sm90_cfg(cfg: Config) -> bool:
    return cfg.overlap or cfg.row_split or cfg.n_split > 1 or cfg.threads > 128 or cfg.block_m == 64


def program(
    M: int, N: int, K: int, E: int, *, act_group: int, weight_block: int, target: str, cfg: Config, max_rows: int = 0
):
    """prim_func(A, SA, B, SB, TileExpert [M/block_m] int32, C [M, N]) for target cpu | sm90 | sm100.

    max_rows > 0 selects the masked (decode) layout, sm90 only: A [E*max_rows, K] (expert e's rows are
    e*max_rows ...), SA [K/ag, E*max_rows], C [E*max_rows, N], and Counts [E] int32 in place of TileExpert;
    rows past an expert's count are computed only inside a tile that has at least one real row (zeros or
    junk there, never read)."""
    if target == "sm90" and (max_rows or _is_sm90_cfg(cfg)):
        return _program_sm90(M, N, K, E, act_group=act_group, weight_block=weight_block, cfg=cfg, max_rows=max_rows)
    assert not max_rows, "the masked layout is built for sm90 only"
    import tilelang.cuda.language as TC
    import tilelang.language as T

    bM, bN, bK = cfg.block_m, cfg.block_n, cfg.block_k
    assert act_group % bK == 0 and weight_block % bK == 0 and M % bM == 0
    mem = Mem(target)
    in_dt = "float32" if mem.cpu else "float8_e4m3fn"
    out_dt = "float32" if mem.cpu else "bfloat16"
    nb_w, kb_w = ceil_div(N, weight_block), ceil_div(K, weight_block)
    use_tmem = target == "sm100"

    @T.prim_func
    def moe_grouped_gemm(
        A: T.Tensor((M, K), in_dt),
        SA: T.Tensor((ceil_div(K, act_group), M), "float32"),
        B: T.Tensor((E, N, K), in_dt),
        SB: T.Tensor((E, nb_w, kb_w), "float32"),
        TileExpert: T.Tensor((M // bM,), "int32"),
        C: T.Tensor((M, N), out_dt),
    ):
        with T.Kernel(T.ceildiv(N, bN), M // bM, threads=cfg.threads) as (bx, by):
            A_s = mem.shared((bM, bK), in_dt)
            B_s = mem.shared((bN, bK), in_dt)
            SA_s = mem.shared((bM,), "float32")
            part = mem.fragment((bM, bN), "float32")
            acc = mem.fragment((bM, bN), "float32")
            if use_tmem:
                part_tm = T.alloc_tmem([bM, bN], "float32")
                mbar = T.alloc_barrier(1)
            # expert of this M tile; padding tiles (-1) compute expert 0 into rows nobody reads
            # (a branch around the pipeline would break TileLang's warp-specialised producer split)
            T.clear(acc)
            for ko in T.Pipelined(T.ceildiv(K, bK), num_stages=cfg.stages):
                T.copy(A[by * bM, ko * bK], A_s)
                T.copy(B[T.max(TileExpert[by], 0), bx * bN : (bx + 1) * bN, ko * bK : (ko + 1) * bK], B_s)
                T.copy(SA[ko * bK // act_group, by * bM], SA_s)
                if use_tmem:
                    TC.gemm(A_s, B_s, part_tm, transpose_B=True, clear_accum=True, mbar=mbar)
                    T.copy(part_tm, part)
                else:
                    T.gemm(A_s, B_s, part, transpose_B=True, clear_accum=True)
                for i, j in mem.par(bM, bN):
                    sb = SB[T.max(TileExpert[by], 0), (bx * bN + j) // weight_block, ko * bK // weight_block]
                    acc[i, j] += part[i, j] * (SA_s[i] * sb)
            T.copy(acc, C[by * bM, bx * bN])

    return moe_grouped_gemm


def _program_sm90(M: int, N: int, K: int, E: int, *, act_group: int, weight_block: int, cfg: Config, max_rows: int):
    """fp8_gemm._program_sm90's main loop with the tile's expert offsetting B and its scales. A tile with
    no real row (contiguous padding tile, or past a masked expert's count) runs zero K iterations: its
    weights are never read, which is what makes the masked layout HBM-efficient at decode."""
    import tilelang.cuda.language as TC
    import tilelang.language as T

    bM, bN, bK = cfg.block_m, cfg.block_n, cfg.block_k
    ag, wb = act_group, weight_block
    sub = min(ag, wb)
    assert bK % sub == 0 and (ag % bK == 0 or bK % ag == 0) and M % bM == 0
    assert bN % wb == 0 and N % bN == 0 and K % bK == 0
    if max_rows:
        assert max_rows % bM == 0 and M == E * max_rows
    tpe = max(1, max_rows // bM)  # masked: M tiles per expert
    units = list(range(bK // sub))
    sa_rows = max(1, bK // ag)
    kb_a, nb_w, kb_w = ceil_div(K, ag), ceil_div(N, wb), ceil_div(K, wb)
    nbt = bN // wb
    nk = K // bK
    policy = T.GemmWarpPolicy.FullRow if cfg.row_split else T.GemmWarpPolicy.Square
    fp8 = "float8_e4m3fn"
    n_meta = E if max_rows else M // bM

    @T.prim_func
    def moe_grouped_gemm_sm90(
        A: T.Tensor((M, K), fp8),
        SA: T.Tensor((kb_a, M), "float32"),
        B: T.Tensor((E, N, K), fp8),
        SB: T.Tensor((E, nb_w, kb_w), "float32"),
        Meta: T.Tensor((n_meta,), "int32"),  # TileExpert (contiguous) or Counts (masked)
        C: T.Tensor((M, N), "bfloat16"),
    ):
        with T.Kernel(N // bN, M // bM, threads=cfg.threads) as (bx, by):
            A_s = T.alloc_shared((bM, bK), fp8)
            B_s = T.alloc_shared((bN, bK), fp8)
            SA_s = T.alloc_shared((sa_rows, bM), "float32")
            SB_s = T.alloc_shared((nbt, kb_w), "float32")
            p0 = T.alloc_fragment((bM, bN), "float32")
            p1 = T.alloc_fragment((bM, bN), "float32")
            acc = T.alloc_fragment((bM, bN), "float32")
            C_s = T.alloc_shared((bM, bN), "bfloat16")
            keep = T.alloc_local((1,), "float32")
            if max_rows:
                e = by // tpe
                n_iter = T.if_then_else(Meta[e] > (by % tpe) * bM, nk, 0)
            else:
                e = T.max(Meta[by], 0)
                n_iter = T.if_then_else(Meta[by] >= 0, nk, 0)
            # every weight scale of this N tile, once, with plain loads (a bulk copy would leave a TMA load in
            # flight when a tile without real rows exits after zero iterations)
            for i, k in T.Parallel(nbt, kb_w):
                SB_s[i, k] = SB[e, bx * nbt + i, k]
            T.clear(acc)
            for ko in T.Pipelined(n_iter, num_stages=cfg.stages):
                T.copy(A[by * bM : (by + 1) * bM, ko * bK : (ko + 1) * bK], A_s)
                T.copy(B[e, bx * bN : (bx + 1) * bN, ko * bK : (ko + 1) * bK], B_s)
                T.copy(SA[ko * sa_rows : (ko + 1) * sa_rows, by * bM : (by + 1) * bM], SA_s)
                if cfg.overlap:
                    parts = [p0, p1]
                    TC.wgmma_gemm(A_s[:, 0:sub], B_s[:, 0:sub], p0, transpose_B=True, clear_accum=True, policy=policy)
                    for u in units:
                        if u + 1 < len(units):
                            TC.wgmma_gemm(
                                A_s[:, (u + 1) * sub : (u + 2) * sub],
                                B_s[:, (u + 1) * sub : (u + 2) * sub],
                                parts[(u + 1) % 2],
                                transpose_B=True,
                                clear_accum=True,
                                policy=policy,
                            )
                            T.wait_wgmma(1)  # unit u is done, u+1 is in flight
                        else:
                            T.wait_wgmma(0)
                            # never taken: moves the "stage free" arrive behind the last wait (fp8_gemm.py)
                            if SA_s[0, 0] < 0.0:
                                keep[0] = T.cast(A_s[0, 0], "float32") + T.cast(B_s[0, 0], "float32")
                        for i, j in T.Parallel(bM, bN):
                            sb = SB_s[j // wb, (ko * bK + u * sub) // wb]
                            acc[i, j] += parts[u % 2][i, j] * (SA_s[(u * sub) // ag, i] * sb)
                else:
                    for u in units:
                        k0 = u * sub
                        T.gemm(A_s[:, k0 : k0 + sub], B_s[:, k0 : k0 + sub], p0, transpose_B=True, clear_accum=True,
                               policy=policy)  # fmt: skip
                        for i, j in T.Parallel(bM, bN):
                            sb = SB_s[j // wb, (ko * bK + k0) // wb]
                            acc[i, j] += p0[i, j] * (SA_s[k0 // ag, i] * sb)
            T.copy(acc, C_s)
            T.copy(C_s, C[by * bM : (by + 1) * bM, bx * bN : (bx + 1) * bN])

    return moe_grouped_gemm_sm90


# ---------------------------------------------------------------------------------------------- layout + reference


def contiguous_layout(expert_ids: torch.Tensor, E: int, block_m: int):
    """From per-row expert ids (top-k flattened), build the padded contiguous layout.

    Returns (row_of_slot [M_pad] int64 source row or -1, tile_expert [M_pad/block_m] int32 or -1).
    """
    rows, tiles = [], []
    for e in range(E):
        src = torch.nonzero(expert_ids == e).flatten()
        if src.numel() == 0:
            continue
        pad = ceil_div(src.numel(), block_m) * block_m - src.numel()
        rows.append(torch.cat([src, src.new_full((pad,), -1)]))
        tiles += [e] * (ceil_div(src.numel(), block_m))
    return torch.cat(rows), torch.tensor(tiles, dtype=torch.int32)


def masked_layout(expert_ids: torch.Tensor, E: int, max_rows: int):
    """Masked (decode) layout: expert e's pairs go to rows e*max_rows ... in order.

    Returns (row_of_pair [P] int64 destination row, counts [E] int32). Pairs beyond max_rows for one
    expert are not representable: raise (the caller sizes max_rows from the batch)."""
    ids = expert_ids.reshape(-1).long()
    counts = torch.bincount(ids, minlength=E)
    if int(counts.max()) > max_rows:
        raise ValueError(f"an expert got {int(counts.max())} rows > max_rows={max_rows}")
    order = torch.argsort(ids, stable=True)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(ids)
    rank[order] = torch.arange(ids.numel(), device=ids.device) - start[ids[order]]
    return ids * max_rows + rank, counts.to(torch.int32)


def masked_tile_expert(counts: torch.Tensor, max_rows: int, block_m: int) -> torch.Tensor:
    """The contiguous-layout tile map equivalent to a masked layout (-1 for tiles with no real row):
    lets `reference` check the masked kernel."""
    tpe = max_rows // block_m
    e = torch.arange(counts.numel()).repeat_interleave(tpe)
    first = (torch.arange(e.numel()) % tpe) * block_m
    return torch.where(counts.cpu()[e] > first, e, torch.full_like(e, -1)).to(torch.int32)


def reference(a, sa, b, sb, tile_expert, block_m: int, act_group: int, weight_block: int) -> torch.Tensor:
    """Per tile, fp8_gemm's reference with the tile's expert weights (padding tiles: zero here, junk
    in the kernel; compare rows of real tiles only)."""
    from deepinfer.codegen.kernels import fp8_gemm

    M, N = a.shape[0], b.shape[1]
    out = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    for t, e in enumerate(tile_expert.tolist()):
        if e < 0:
            continue
        rows = slice(t * block_m, (t + 1) * block_m)
        out[rows] = fp8_gemm.reference(a[rows], sa[rows], b[e], sb[e], act_group, weight_block)
    return out


def reference_f64(a, sa, b, sb, tile_expert, block_m: int, act_group: int, weight_block: int) -> torch.Tensor:
    """Independent oracle: per-row expert, dequantised float64 matmul."""
    from deepinfer.codegen.kernels import fp8_gemm

    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    for t, e in enumerate(tile_expert.tolist()):
        if e >= 0:
            rows = slice(t * block_m, (t + 1) * block_m)
            out[rows] = fp8_gemm.reference_dequant_f64(a[rows], sa[rows], b[e], sb[e], act_group, weight_block)
    return out


def roofline(M: int, N: int, K: int, E_active: int, act_group: int, weight_block: int) -> tuple[float, float]:
    """(bytes, flops): activations once, each ACTIVE expert's weights once, output once. For the masked
    layout pass M = the real rows (sum of the counts), not E * max_rows."""
    w = E_active * (N * K + 4 * ceil_div(N, weight_block) * ceil_div(K, weight_block))
    return float(M * K + 4 * M * ceil_div(K, act_group) + w + 2 * M * N), 2.0 * M * N * K
