"""MoE grouped FP8 GEMM, contiguous (prefill) layout: one launch for all experts.

Tokens routed to the experts are sorted by expert and each expert's segment is padded to a multiple
of block_m, so every M tile belongs to exactly one expert (DeepGEMM's "contiguous" layout):

    C[m, :] = (A[m] ⊙ sa[:, m]) @ (B[e(m)] ⊙ sb[e(m)])ᵀ        e(m) = TileExpert[m // block_m]
    A  [M, K] fp8, sa [K/ag, M] fp32 (MN-major)   B [E, N, K] fp8, sb [E, N/wb, K/wb] fp32

The inner loop is fp8_gemm's (per-K-tile MMA, then exact promotion with the scales); the only
difference is that the tile's expert id offsets the weight and scale reads. Padding tiles
(expert -1) produce junk rows that the unpermute never reads. Not yet here: the masked (decode)
layout, W4A8 experts and the fused clamped-SwiGLU epilogue.
"""

import torch

from deepinfer.codegen.kernels._common import Mem, ceil_div
from deepinfer.codegen.kernels.fp8_gemm import Config, default_config  # noqa: F401  (same tile config)

FAMILY = "moe_grouped_gemm"


def program(M: int, N: int, K: int, E: int, *, act_group: int, weight_block: int, target: str, cfg: Config):
    """prim_func(A, SA, B, SB, TileExpert [M/block_m] int32, C [M, N]) for target cpu | sm90 | sm100."""
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
    """(bytes, flops): activations once, each ACTIVE expert's weights once, output once."""
    w = E_active * (N * K + 4 * ceil_div(N, weight_block) * ceil_div(K, weight_block))
    return float(M * K + 4 * M * ceil_div(K, act_group) + w + 2 * M * N), 2.0 * M * N * K
