"""MoE grouped GEMM (FP8 and W4A8 experts), contiguous (prefill) and masked (decode) layouts, one launch.

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
experts with tokens are read.

Swap-AB programs (`swab_program`, issue 6). At decode an expert sees 0-16 rows, so the GEMM is a weight
stream: the weight rows are the wgmma M side (64 per consumer warpgroup) and the few tokens the N side
(block_t = 16/32, m64n16k32), so no MMA or promotion work is spent on padding rows. CTA (N tile, expert
slot): slot s takes the s-th expert with a non-zero count (a scan of Counts, or with slot_map one load from
a SlotExpert map built on the device per call), so the CTAs of idle experts sit at the end of the grid and
exit without reading anything (`slots` trims that end at T*top-k < E); a CTA loops over its expert's token tiles
(one pass per block_t rows). No setmaxnreg and a min-blocks-per-SM launch bound, so 3-4 CTAs share an SM
and keep 12-16 TMA stages of weights in flight. Weight formats:
  * fp8: B [E, N, K] e4m3 with [E, N/wb, K/wb] fp32 block scales (as `program`);
  * fp4 (W4A8, V4.1's routed experts, MODEL_SPEC §4.3): B [E, N, K/4] int16 = the checkpoint's packed
    e2m1 bytes (low nibble = even column) viewed two bytes at a time, SB [E, K/32, N] uint8 = the ue8m0
    bytes transposed (MN-major, see `w4a8_weights`). Each 32-K sub-block is dequantised in registers
    (4 codes per PRMT table lookup, `_FP4_SRC`) straight into the wgmma A fragment (RS wgmma, no shared
    memory round trip): code -> e4m3 bits ((c&7)<<2)|((c&8)<<4), which is the e2m1 value times 2^-6
    exactly; the 2^6 and the weight scale 2^(byte-127) are applied in the promotion as one power of two.
    Half the weight bytes of fp8: this is the decode win. (The fragment is filled by `deepinfer_fp4_frag`,
    one word = 4 codes per PRMT pair, ~1.5 integer ops a weight; TileLang's own element-wise lowering of
    the same fill costs ~4, which at full HBM rate would exceed the SM's integer issue rate.)
The same program runs the contiguous layout (Meta = TileExpert of block_t-row tiles); that is the W4A8
prefill path. There the promotion multiplies a per-row weight scale by a per-token activation scale for
every element (one FMUL + one FFMA per element per 32 K, against fp8's 32x32 blocks where the products are
hoisted), so W4A8 prefill is expected at roughly half the fp8 contiguous rate.

Fused clamped SwiGLU (`swiglu_limit` not None): B holds w1|w3 tile-interleaved by `gate_up_tiles` (per CTA
tile of block_n weight rows: h gate rows [c, c+h) then the matching up rows [I+c, I+c+h), h = block_n/2),
and the epilogue writes h = silu(min(g, L)) * clamp(u, -L, L) (L = swiglu_limit, 0 = no clamp; ir/ops/moe.py
`swiglu`) quantised to e4m3 with one ue8m0 scale per 32 columns -- what the w2 grouped GEMM reads (Hq [M, I]
e4m3, Hs [I/32, M] fp32 MN-major; scale = 2^ceil(log2(max(amax, 1e-4)/448)), the runtime's `quant_act`),
so the bf16 [M, 2I] intermediate and the separate SwiGLU and quant passes disappear. The scale is computed
with exponent-bit arithmetic (`ue8m0_exponent`), no log2/division. Available on the contiguous fp8 loop
(`program(..., swiglu_limit=)`) and on every swap-AB variant.

Persistent prefill (`cfg.persistent`, contiguous layout, no fused SwiGLU): fp8_gemm's warp-specialised
program itself (`fp8_gemm._program_sm90_ws(..., experts=E)`, not a copy of its loop): 132 CTAs walk the
(M tile, N tile) grid, M tile m multiplies expert TileExpert[m]'s weights (the layout pads every expert to
whole block_m tiles, so no tile straddles two experts), and tiles of expert -1 are skipped. CTA pairs
sharing B (cluster 2) are refused: two M-adjacent tiles may belong to different experts.

Half tiles (persistent prefill, `half_tiles=True`, issue 8; runtime switch DEEPINFER_MOE_HALF_TILES=1). On one GPU
with all 384 experts, 8192 tokens x top-6 give ~128 pairs an expert, so about half the experts end in a tile with
few real rows: 49152 pairs fill 71168 tile rows (69% real). The layout (moe_routing, half_tiles) then marks an
expert's last tile holding <= 64 pairs as TileExpert = e + fp8_gemm.HALF_TILE_FLAG, its rows staying where they are;
the persistent program loads that tile's 64 real rows into both 64-row halves of the A stage and lets consumer
warpgroup h compute N slice h only, so the tile costs half the MMA and promotion work with both warpgroups (and the
tensor cores) busy, and stores 64 rows a slice. Every real row gets the same products in the same order as without
the option (bit for bit). 64-row tiles throughout (one consumer warpgroup a CTA) are the alternative the kernels_h200
'moe halftiles ... bm64' rows time next to it.
Measured, and SLOWER (H200, session 8 call 3, kernels_h200 --only "moe halftiles": 185 of 569 tiles half, real share
of the computed rows 67.5% -> 80.6%; every pair's output row equal to the default's), default program vs half tiles
vs bm64, us: w1|w3 w128a128 3666 / 4725 (0.78x) / 4075 (0.90x); w1|w3 w128a32 5784 / 6445 (0.90x) / 6527 (0.89x); w2
w128a128 1956 / 2187 (0.89x) / 2095 (0.93x); w2 w128a32 3029 / 3261 (0.93x) / 3328 (0.91x). Layer 2's MoE part
(bench_slice, g128): 7.716 ms = 41.2% of the FP8 peak without, 9.169 ms = 35.2% with. Why: (1) in that program
(the option's first version, commit f7c3bbb) each warpgroup's wgmma sat in a branch on its thread index (and the
tile's flag), and ptxas then serialises EVERY wgmma of the kernel ("C7518: wgmma.mma_async instructions are
serialized due to program dependence on compiler-inserted WG.DP in divergent path"), so full tiles lost their MMA /
promotion overlap too; (2) at this shape the weights are the stream: all 384 experts' w1|w3 (9.06 GB) take
2.12 ms at 4.27 TB/s against the default's 3.67 ms (633 TFLOPS on the real rows, 51% of the peak), and a half tile
reads the same B tiles as a full one, so the MMA it saves is only partly time saved; 64-row tiles throughout keep
(2) and add a single consumer warpgroup per CTA, whose promotion no second warpgroup's MMA hides. The option stays
off (runtime DEEPINFER_MOE_HALF_TILES). The program now runs half tiles through a pipeline of their own without
(1) -- both warpgroups issue every wgmma, the N slice chosen by the descriptor offset from the warpgroup index, each
promoting into its first accumulator and storing it at a warpgroup-dependent row / column offset -- and ptxas keeps
its wgmmas pipelined (tests/codegen/test_moe_half_tiles.py builds it with ptxas -v); not timed on the H200 yet (the
'moe halftiles' rows), and (2) stays.

Limits (sm90, exact per-32 promotion). V4.1's scales are per 32 K (activations 1x32, weights 32x32 or per-row
1x32), and wgmma has no per-K-block scale, so every 32 K each accumulator element takes one FFMA: at 128 FP32
lanes vs 4096 FP8 MACs per SM-clock that is as many issue cycles as the MMA itself. fp8_gemm.py's docstring
counts it from the SASS: ~188 issue slots per 64x256x32 warpgroup step against 128 clk of MMA, so two consumer
warpgroups are issue-bound at 68% of the tensor rate even with perfect overlap (41% with none; the dense g32
kernel measures 44.7%), about 50-55% of the measured peak at best once the FP32 pipe's power cost is paid.
The 65% prefill target is therefore within reach for 128-groups (V4-Flash: one promotion per 128 K) and not
for V4.1's 32-groups on SM90 -- whether the FP4 experts are converted to FP8 32x32 blocks ahead of time
(convert_fp4_to_fp8, then this fp8 path) or dequantised in the kernel (W4A8 above, which adds the dequant
and a per-element scale product: one FMUL + one FFMA per element per 32 K). SM100's block-scaled MMA
(kind::mxf8f6f4, ue8m0 per 32 K in hardware) is the format's native fix.

V4.1 prefill in the V4 format (issue 8, SM90). convert_fp4_to_fp8 block=128 converts the FP4 experts to 128x128
FP8 blocks (exact where a block's FP4 group scales span <= 14 binades; checked at load, an error otherwise). The
programs take weight_block != act_group: at decode the adapter keeps the model's 1x32 activations and reads the
128x128 scales expanded to the 32-grid (the swap-AB kernels unchanged, the same products bit for bit); at prefill
the persistent program runs w128a32 (exact: 4 promotions per weight block, one weight scale per N slice) or, with
the plan's prefill_act_group=128 option, w128a128 -- V4's format, one promotion per 128 K (not exact:
act_quant.py states and benchmarks/moe_g128_numerics.py measures the deviation). kernels_h200
--only "grouped_gemm v41g128" times the three formats (w32a32 / w128a32 / w128a128) at V4.1's prefill dims.
H200 (session 6, EP8 rank: 48 experts, 8192 tokens x top-6, % of the FP8 peak): w1|w3 46.4% / 47.7% / 75.8%,
w2 45.2% / 47.6% / 74.1%; the g128 product deviates from the exact 1x32 one by 1.7e-3 norm-wise (the 1x32 format's
own error vs fp32: 2.7e-2). The whole MoE node at that rank (routed + shared, bench_slice --ep-only): 35.4% exact,
49.4% g128 (its shared expert stays 32x32 / 1x32, the checkpoint's format, at ~40%).
"""

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import torch

from deepinfer.codegen.kernels._common import Mem, ceil_div
from deepinfer.codegen.kernels.fp8_gemm import Config, default_config  # noqa: F401  (same tile config)

FAMILY = "moe_grouped_gemm"


def sm90_config(M: int, N: int, masked: bool = False, k_group: int | None = None) -> Config:
    """Contiguous layout with the scale granularity given (k_group): fp8_gemm's persistent warp-specialised
    program, 128x256 tiles (H200, same run, % of the FP8 peak over padded rows, /work/notes/device/2/
    grouped_ws.txt): g128 ping-pong 65.1% / 68.9% at 4096 / 8192 tokens vs 60.0% / 60.6% for the loop below;
    g32 40.0% / 39.7% vs 36.8% / 38.2%. k_group None (callers that do not say): the non-persistent loop
    (2 consumer warpgroups, 128-K stages, async wgmma overlapped with the per-32 promotion). At decode (masked
    layout, few rows per expert) a 64-row tile on one warpgroup, so an expert with a handful of tokens does not
    pay for 128 rows of MMA."""
    if masked:
        return Config(64, 128, 128, 4, 128, True, True)
    if k_group is not None and N % 256 == 0:
        return Config(128, 256, 128, 3, 256, False, True, 2, persistent=True, pingpong=k_group >= 128)
    return Config(128, 128, 128, 4, 256, True, True)


def _is_sm90_cfg(cfg: Config) -> bool:
    return cfg.overlap or cfg.row_split or cfg.n_split > 1 or cfg.threads > 128 or cfg.block_m == 64


def program(
    M: int,
    N: int,
    K: int,
    E: int,
    *,
    act_group: int,
    weight_block: int,
    target: str,
    cfg: Config,
    max_rows: int = 0,
    swiglu_limit: float | None = None,
    half_tiles: bool = False,
):
    """prim_func(A, SA, B, SB, TileExpert [M/block_m] int32, C [M, N]) for target cpu | sm90 | sm100.

    max_rows > 0 selects the masked (decode) layout, sm90 only: A [E*max_rows, K] (expert e's rows are
    e*max_rows ...), SA [K/ag, E*max_rows], C [E*max_rows, N], and Counts [E] int32 in place of TileExpert;
    rows past an expert's count are computed only inside a tile that has at least one real row (zeros or
    junk there, never read).

    swiglu_limit (sm90 loop only): N = 2I is w1|w3 laid out by `gate_up_tiles(w, cfg.block_n // 2)` (and its
    scales likewise), and the outputs are (Hq [M, I] e4m3, Hs [I/32, M] fp32), the clamped SwiGLU of the GEMM
    quantised per 32 columns (module docstring) instead of C.

    half_tiles (persistent program only): TileExpert entries e + fp8_gemm.HALF_TILE_FLAG mark tiles whose real rows
    are their first 64 (the layout's `half_tiles` option); those tiles cost half (module docstring: Half tiles)."""
    if cfg.persistent and target in ("sm90", "cpu") and not max_rows and swiglu_limit is None:
        # fp8_gemm's persistent warp-specialised program, each M tile on its expert's weights
        from deepinfer.codegen.kernels import fp8_gemm

        build = fp8_gemm._program_sm90_ws if target == "sm90" else fp8_gemm._program_ws_cpu
        extra = {"half_tiles": True} if half_tiles else {}
        return build(M, N, K, act_group=act_group, weight_block=weight_block, cfg=cfg, experts=E, **extra)
    assert not half_tiles, "half tiles: the persistent grouped program only"
    if cfg.persistent:  # masked layout / fused SwiGLU: the same tile on the non-persistent loop
        assert cfg.block_n == 128 and cfg.n_split == 1, (
            f"{cfg.tag}: the non-persistent loop (masked layout, fused SwiGLU) has no N slices; use sm90_config "
            "without k_group there"
        )
        cfg = dataclasses.replace(cfg, persistent=False, cluster=1, pingpong=False)
    if target == "sm90" and (max_rows or _is_sm90_cfg(cfg)):
        return _program_sm90(M, N, K, E, act_group=act_group, weight_block=weight_block, cfg=cfg, max_rows=max_rows,
                             swiglu_limit=swiglu_limit)  # fmt: skip
    assert not max_rows, "the masked layout is built for sm90 only"
    assert swiglu_limit is None, "the fused SwiGLU epilogue is built on the sm90 loop only"
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


def _program_sm90(M: int, N: int, K: int, E: int, *, act_group: int, weight_block: int, cfg: Config, max_rows: int,
                  swiglu_limit: float | None = None):  # fmt: skip
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
    glu = swiglu_limit is not None
    I, bNh = N // 2, bN // 2
    if glu:  # B and SB tile-interleaved by `gate_up_tiles(..., block_n // 2)`
        assert bNh % 32 == 0 and bNh % wb == 0, "SwiGLU: half tiles of whole 32-column groups and weight blocks"
    epilogue = _swiglu_epilogue(bM, bNh, swiglu_limit) if glu else None

    @T.macro
    def kernel(A, SA, B, SB, Meta, C, CS):
        """C: bf16 output, or the SwiGLU's e4m3 codes Hq with CS its scales Hs."""
        with T.Kernel(N // bN, M // bM, threads=cfg.threads) as (bx, by):
            A_s = T.alloc_shared((bM, bK), fp8)
            B_s = T.alloc_shared((bN, bK), fp8)
            SA_s = T.alloc_shared((sa_rows, bM), "float32")
            SB_s = T.alloc_shared((nbt, kb_w), "float32")
            p0 = T.alloc_fragment((bM, bN), "float32")
            p1 = T.alloc_fragment((bM, bN), "float32")
            acc = T.alloc_fragment((bM, bN), "float32")
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
            if glu:
                H_s = T.alloc_shared((bM, bN), "float32")
                T.copy(acc, H_s)
                epilogue(H_s, C, CS, by * bM, bx * bNh)
            else:
                C_s = T.alloc_shared((bM, bN), "bfloat16")
                T.copy(acc, C_s)
                T.copy(C_s, C[by * bM : (by + 1) * bM, bx * bN : (bx + 1) * bN])

    if glu:

        @T.prim_func
        def moe_grouped_gemm_sm90_swiglu(
            A: T.Tensor((M, K), fp8),
            SA: T.Tensor((kb_a, M), "float32"),
            B: T.Tensor((E, N, K), fp8),
            SB: T.Tensor((E, nb_w, kb_w), "float32"),
            Meta: T.Tensor((n_meta,), "int32"),
            Hq: T.Tensor((M, I), fp8),
            Hs: T.Tensor((I // 32, M), "float32"),
        ):
            kernel(A, SA, B, SB, Meta, Hq, Hs)

        return moe_grouped_gemm_sm90_swiglu

    @T.prim_func
    def moe_grouped_gemm_sm90(
        A: T.Tensor((M, K), fp8),
        SA: T.Tensor((kb_a, M), "float32"),
        B: T.Tensor((E, N, K), fp8),
        SB: T.Tensor((E, nb_w, kb_w), "float32"),
        Meta: T.Tensor((n_meta,), "int32"),  # TileExpert (contiguous) or Counts (masked)
        C: T.Tensor((M, N), "bfloat16"),
    ):
        kernel(A, SA, B, SB, Meta, C, None)

    return moe_grouped_gemm_sm90


# ---------------------------------------------------------------------------------------------- SwiGLU epilogue

ACT_SCALE_FLOOR = 1e-4  # dt.pow2_scale's floor, as the runtime's quant_act uses it


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """ceil(log2(max(amax, 1e-4) / 448)) from the float's bits, as the fused epilogue computes it: with
    amax = 1.m * 2^p, the ratio amax/448 = (1.m/1.75) * 2^(p-8) and 1.m/1.75 is in (4/7, 8/7), so the
    exponent is p-8, plus 1 when the mantissa is above 1.75 (bits > 0x600000). Exact: no log2, no division.
    (torch's float32 amax/448 then log2 rounds down for mantissas a few ulp above 1.75 -- about one group in a
    million -- where this scale is 2x quant_act's; both are valid ue8m0 scales for the group.)"""
    bits = amax.float().clamp(min=ACT_SCALE_FLOOR).contiguous().view(torch.int32)
    return (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)


def _swiglu_epilogue(rows: int, half: int, limit: float, target: str = "sm90"):
    """T.macro: H_s [rows, 2*half] fp32 (gate columns then the matching up columns) ->
    Hq[row0 + i, col0 + j] = e4m3(h / s), Hs[(col0 + j) // 32, row0 + i] = s, h = silu(min(g, L)) * clamp(u, ±L).
    target "cpu": TileLang's `c` target (local buffers, serial loops; Hq stays fp32, unrounded)."""
    import tilelang.language as T

    mem = Mem(target)
    ng = half // 32
    big = float(limit) if limit and limit > 0 else 3.0e38  # no clamp: min/max against the largest float
    qdt = "float32" if mem.cpu else "float8_e4m3fn"

    @T.macro
    def epilogue(H_s, Hq, Hs, row0, col0):
        G_f = mem.fragment((rows, ng, 32), "float32")
        AM = mem.fragment((rows, ng), "float32")
        Q_s = mem.shared((rows, half), qdt)
        S_s = mem.shared((ng, rows), "float32")
        for i, g, c in mem.par(rows, ng, 32):
            gv = T.min(H_s[i, g * 32 + c], big)
            uv = T.max(T.min(H_s[i, half + g * 32 + c], big), -big)
            G_f[i, g, c] = gv / (1.0 + T.exp(-gv)) * uv
        T.reduce_absmax(G_f, AM, dim=2)
        for i, g in mem.par(rows, ng):
            bits = T.reinterpret(T.max(AM[i, g], ACT_SCALE_FLOOR), "uint32")
            ex = T.Cast("int32", bits >> T.uint32(23)) - 135 + T.if_then_else(
                (bits & T.uint32(0x7FFFFF)) > T.uint32(0x600000), 1, 0
            )
            S_s[g, i] = T.reinterpret(T.shift_left(T.Cast("uint32", ex + 127), T.uint32(23)), "float32")
            AM[i, g] = T.reinterpret(T.shift_left(T.Cast("uint32", 127 - ex), T.uint32(23)), "float32")  # 1/s
        for i, g, c in mem.par(rows, ng, 32):
            Q_s[i, g * 32 + c] = T.Cast(qdt, T.max(T.min(G_f[i, g, c] * AM[i, g], 448.0), -448.0))
        T.copy(Q_s, Hq[row0 : row0 + rows, col0 : col0 + half])
        T.copy(S_s, Hs[col0 // 32 : col0 // 32 + ng, row0 : row0 + rows])

    return epilogue


def swiglu_quant_program(M: int, inter: int, limit: float, *, target: str, block_m: int = 16, block_i: int = 64):
    """The fused epilogue as a stand-alone program: H [M, 2I] fp32 (gate, up) -> Hq [M, I], Hs [I/32, M].
    Exists so the epilogue's numerics run on TileLang's `c` target (Hq fp32 there, before the e4m3 cast)."""
    import tilelang.language as T

    mem = Mem(target)
    qdt = "float32" if mem.cpu else "float8_e4m3fn"
    assert M % block_m == 0 and inter % block_i == 0 and block_i % 32 == 0
    epilogue = _swiglu_epilogue(block_m, block_i, limit, target)

    @T.prim_func
    def swiglu_quant(
        H: T.Tensor((M, 2 * inter), "float32"),
        Hq: T.Tensor((M, inter), qdt),
        Hs: T.Tensor((inter // 32, M), "float32"),
    ):
        with T.Kernel(inter // block_i, M // block_m, threads=128) as (bx, by):
            H_s = mem.shared((block_m, 2 * block_i), "float32")
            for i, j in mem.par(block_m, 2 * block_i):
                H_s[i, j] = H[by * block_m + i, T.if_then_else(j < block_i, 0, inter - block_i) + bx * block_i + j]
            epilogue(H_s, Hq, Hs, by * block_m, bx * block_i)

    return swiglu_quant


# ---------------------------------------------------------------------------------------------- swap-AB programs

# 4 e2m1 codes (16 bits, low nibble first) -> 4 e4m3 bytes worth code * 2^-6: magnitudes through a PRMT table
# (bytes 0x00, 0x04, ..., 0x1C), the 4 sign bits moved to bit 7 of each byte by a second PRMT.
# deepinfer_fp4_frag<NB> fills one thread's wgmma A fragment (NB m64 blocks x k32, 4 .b32 registers per block,
# PTX's m64nNk32 8-bit A layout: row = 16*warp + lane/4 (+8 for a1/a3), k = 4*(lane%4) (+16 for a2/a3)) from
# the packed tile p (int16 words, `stride` words a row) -- the fragment order TileLang gives a (bN x 32) fp8
# fragment feeding an RS wgmma (checked against TileLang's own element-wise lowering in the tests).
_FP4_SRC = r"""
__device__ __forceinline__ unsigned int deepinfer_fp4x4_to_e4m3(unsigned int x) {
  unsigned int mag = __byte_perm(0x0C080400u, 0x1C181410u, x & 0x7777u);
  unsigned int sgn = x & 0x8888u;
  return mag | (__byte_perm(sgn << 4, sgn, 0x5140u) & 0x80808080u);
}
template <int NB>
__device__ __forceinline__ void deepinfer_fp4_frag(void* frag, const void* packed, int stride) {
  const int t = threadIdx.x & 127;
  const int row = ((t >> 5) << 4) + ((t & 31) >> 2);
  const unsigned short* p = reinterpret_cast<const unsigned short*>(packed) + row * stride + (t & 3);
  unsigned int* r = reinterpret_cast<unsigned int*>(frag);
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    const unsigned short* q = p + b * 64 * stride;
    r[4 * b + 0] = deepinfer_fp4x4_to_e4m3(q[0]);
    r[4 * b + 1] = deepinfer_fp4x4_to_e4m3(q[8 * stride]);
    r[4 * b + 2] = deepinfer_fp4x4_to_e4m3(q[4]);
    r[4 * b + 3] = deepinfer_fp4x4_to_e4m3(q[8 * stride + 4]);
  }
}
"""


@dataclass(frozen=True)
class SwabConfig:
    """Swap-AB tile: block_n weight rows (wgmma M, 64 per consumer warpgroup) x block_t tokens (wgmma N)."""

    block_n: int = 64
    block_t: int = 16
    block_k: int = 128
    stages: int = 4
    min_blocks: int = 3  # __launch_bounds__ min blocks per SM (registers capped; no setmaxnreg)
    wide_tma: bool = False  # fp8: 128B-swizzled weight/activation tiles, one TMA box per 128 K bytes (swab_config's
    #                         fp8 decode default; see swab_program)
    stage_scales: bool = False  # fp8: each K stage's weight block scales by TMA with its weights (see swab_program)
    persistent: int = 0  # masked + slot_map: this many CTAs walk the (expert slot, N tile) items (0: one CTA an item)

    @property
    def threads(self) -> int:
        return 128 * max(1, self.block_n // 64)

    @property
    def tag(self) -> str:
        extra = ("w" if self.wide_tma else "") + ("t" if self.stage_scales else "")
        extra += f"p{self.persistent}" if self.persistent else ""
        return f"swab{self.block_n}x{self.block_t}x{self.block_k}s{self.stages}b{self.min_blocks}{extra}"


def swab_config(rows_per_expert: int, fmt: str = "fp8", contiguous: bool = False, active_experts: int | None = None,
                N: int | None = None) -> SwabConfig:  # fmt: skip
    """Decode (masked): 64 weight rows x 16 tokens (32 when experts see more than ~12 rows), 3-4 CTAs per SM;
    fp4 stages 256 K (8 KiB of packed weights, the same bytes per stage as fp8's 128 K). fp8 with few active
    experts (given active_experts and N): 192 weight rows (3 consumer warpgroups, 3 CTAs per SM) when that puts
    every CTA in one wave -- H200, 16 tokens (16 active experts x 4608): 71.6% of HBM vs 64.5% (2.2 waves of
    64-row tiles), /work/notes/device/5/swab.txt.
    Contiguous (W4A8 prefill): 128 weight rows (2 consumer warpgroups) x 128 tokens, one CTA per SM.
    fp8 decode tiles are wide_tma (one 128-byte-wide TMA box per K stage): H200, V4.1 at the real routing (T x top-6
    over 384 experts, kernels_h200 "moe decode real"): T64 w1|w3 (glu_split) 82.5% -> 96.6% of HBM, w2 73.5% ->
    93.1%; T16 79.3 -> 91.4% / 70.8 -> 89.5%; T256 83.3 -> 97.5% / 74.5 -> 94.8% (/work/notes/device/s5c2)."""
    if contiguous:
        return SwabConfig(128, 128, 128, 4, 1)
    wide = fmt == "fp8"
    if (fmt == "fp8" and rows_per_expert <= 16 and active_experts is not None and N is not None and N % 192 == 0
            and active_experts * (N // 192) <= 3 * 132):  # fmt: skip
        return SwabConfig(192, 16, 128, 2, 3, wide)
    bt = 16 if rows_per_expert <= 12 else 32
    return SwabConfig(64, bt, 256 if fmt == "fp4" else 128, 4, 4 if bt == 16 else 3, wide)


def swab_config_space(rows_per_expert: int, fmt: str = "fp8") -> list[SwabConfig]:
    """Masked decode configs worth timing (what the tuner would search)."""
    bks = (128, 256) if fmt == "fp4" else (128,)
    bts = (16, 32) if rows_per_expert <= 16 else (32, 64)
    out = []
    for bt, bk, st, mb in itertools.product(bts, bks, (3, 4, 6), (2, 3, 4)):
        smem = st * (64 * bk // (2 if fmt == "fp4" else 1) + bt * bk + 4 * bt * bk // 32) + 4 * 64 * bt
        if smem * mb <= 220 * 1024:
            out.append(SwabConfig(64, bt, bk, st, mb))
    return out


# the `c` target's stand-in for the dequant: the same bit trick (portable byte_perm), decoded to float
_FP4_SRC_CPU = r"""
static inline unsigned int deepinfer_byte_perm(unsigned int a, unsigned int b, unsigned int s) {
  unsigned long long src = (unsigned long long)a | ((unsigned long long)b << 32);
  unsigned int out = 0;
  for (int i = 0; i < 4; ++i) {
    unsigned int nib = (s >> (4 * i)) & 0xF;
    unsigned int byte = (unsigned int)(src >> (8 * (nib & 7))) & 0xFF;
    if (nib & 8) byte = (byte & 0x80) ? 0xFF : 0;
    out |= byte << (8 * i);
  }
  return out;
}
#ifdef __cplusplus
extern "C"
#endif
float deepinfer_fp4_value(int16_t packed, int32_t which) {
  unsigned int x = (unsigned int)(unsigned short)packed;
  unsigned int mag = deepinfer_byte_perm(0x0C080400u, 0x1C181410u, x & 0x7777u);
  unsigned int sgn = x & 0x8888u;
  unsigned int w = mag | (deepinfer_byte_perm(sgn << 4, sgn, 0x5140u) & 0x80808080u);
  unsigned int b = (w >> (8 * which)) & 0xFF;  /* e4m3 bits: exponent 0..3, so subnormal or small normal */
  unsigned int e = (b >> 3) & 0xF, m = b & 7;
  float v = e ? (1.0f + m / 8.0f) * (float)(1 << e) / 128.0f : m / 512.0f;
  return (b & 0x80) ? -v : v;
}
"""


_WIDE_SUFFIX = "_w128"


def _wide_swizzle_hook() -> None:
    """TileLang gives a wgmma operand the swizzle its K extent alone supports: a 32-K slice of a 128-byte row gets the
    32B swizzle, and the row's TMA load becomes four 32-byte-wide boxes. For shared buffers whose name ends in
    `_WIDE_SUFFIX` (swab_program's wide_tma tiles only) the layout is the 128B swizzle of the whole row instead; the
    wgmma emitter then addresses a slice by its byte offset inside the swizzle atom. Installed once per process,
    on the first wide program; every other buffer keeps TileLang's choice."""
    from tilelang.cuda.op.gemm.gemm_wgmma import GemmWGMMA
    from tilelang.layout import make_full_bank_swizzled_layout
    from tilelang.utils.language import is_shared

    if getattr(GemmWGMMA.infer_layout, "deepinfer_wide", False):
        return
    plain = GemmWGMMA.infer_layout

    def infer_layout(self, target, thread_nums):
        layouts = plain(self, target, thread_nums)
        for buf in (self.A, self.B):
            if is_shared(buf) and buf.name.endswith(_WIDE_SUFFIX):
                layouts[buf] = make_full_bank_swizzled_layout(buf)
        return layouts

    infer_layout.deepinfer_wide = True
    GemmWGMMA.infer_layout = infer_layout


# Keyword arguments of the factories that reach only the launch grid, never the device code, with a value to lower
# them at: plan_kernels lowers one program for all their values (the 40-layer V4.1's batched decode buckets ask for
# slots 6, 12, 24, 48, 96: five lowerings of one CUDA source before). test_moe_swab_slot_map checks the sources equal.
GRID_ONLY_KWARGS = {"swab_program": {"slots": 0}}


def swab_program(
    M: int,
    N: int,
    K: int,
    E: int,
    *,
    fmt: str = "fp8",
    act_group: int = 32,
    weight_block: int = 32,
    cfg: SwabConfig | None = None,
    max_rows: int = 0,
    swiglu_limit: float | None = None,
    fast_dequant: bool = True,
    glu_split: bool = False,
    slot_map: bool = False,
    slots: int = 0,
    target: str = "sm90",
):
    """Swap-AB grouped GEMM (module docstring), sm90 (target "cpu": the same program on TileLang's `c` target,
    fp32 activations/fp8 weights as float32 and Hq unrounded, for numerics checks).

    prim_func(A [M, K] e4m3, SA [K/ag, M] fp32, B, SB, Meta, *out):
      fmt "fp8": B [E, N, K] e4m3, SB [E, N/wb, K/wb] fp32;  fmt "fp4": B [E, N, K/4] int16, SB [E, K/32, N] uint8.
      max_rows > 0: masked layout, M = E*max_rows, Meta = Counts [E]; else contiguous, Meta = TileExpert [M/block_t].
      out: C [M, N] bf16, or with swiglu_limit: Hq [M, N/2] e4m3 and Hs [N/64, M] fp32 (B and its scales then
      tile-interleaved by `gate_up_tiles(..., block_n // 2)`).
    Rows past an expert's count (masked) or of padding tiles hold junk / are not written; never read them.
    fast_dequant: fp4 fragments filled by `deepinfer_fp4_frag` (else TileLang's element-wise lowering).
    glu_split (with swiglu_limit): B and SB are the plain w1|w3 stacks (gate rows [0, I), up rows [I, 2I)), not
    tile-interleaved, so no interleaved copy of the experts is needed (9 GB per V4.1 layer in fp8). A CTA then
    takes block_n gate rows and the matching block_n up rows as two weight tiles, each a whole TMA box and its
    own MMA + promotion (a wgmma needs 64 rows, and TileLang's TMA lowering refuses a box into half of a
    swizzled tile), and writes block_n SwiGLU columns: the grid has I / block_n column CTAs, each reading
    2 x block_n weight rows per K stage (the interleaved form: N / block_n CTAs of block_n rows).
    slot_map (masked): Meta is [2E+1] = Counts ++ SlotExpert ++ [experts with tokens] (`slot_expert_meta`;
    SlotExpert: the experts with tokens first, in expert order, then the idle ones), so a CTA finds its expert with
    one load instead of scanning all E counts (at E = 384 the scan is 384 dependent loads and branches in every CTA
    before its first TMA load); the slot -> expert assignment, hence every output bit, is the scan's. A CTA whose
    slot names an idle expert exits at once.
    cfg.wide_tma (fp8, sm90): the weight and activation tiles take the 128B swizzle of their whole 128-byte K rows, so
    each K stage is one TMA box of block_n x 128 bytes instead of four 32-byte-wide boxes (the swizzle TileLang derives
    from the 32-K MMA slices alone); the MMAs read the same slices at +32 B inside the swizzle atom, as TileLang's own
    K=128 gemm does. swab_config's fp8 decode default (H200: 93-97% of HBM vs 73-83%, see there).
    cfg.stage_scales (fp8): each K stage's weight block scales (block_n/32 x block_k/32 fp32) come by TMA with the
    stage's weights instead of all of K's being staged by plain loads before the pipeline starts: a CTA's first
    weight load then waits for nothing but its slot's expert id (opt-in until the H200 times it).
    slots (masked): the grid's expert slots, 0 = E. Any count >= the number of experts with tokens is exact (e.g.
    T * top-k at decode: T = 1 launches 6 slots instead of 384); the grid stays static (CUDA graphs).
    cfg.persistent = G (masked, slot_map): a static grid of G CTAs walks the items (slot, N tile) of the experts with
    tokens only (Meta[2E] = their number), item i = CTA + k*G in slot-major order: no CTA is launched for an idle
    expert and a CTA's launch and barrier setup are paid once, not per item (opt-in until the H200 times it)."""
    import tilelang.language as T

    cfg = cfg or swab_config(4, fmt, contiguous=not max_rows)
    bN, bT, bK, sub = cfg.block_n, cfg.block_t, cfg.block_k, 32
    ag, wb = act_group, weight_block
    fp4 = fmt == "fp4"
    mem = Mem(target)
    cpu = mem.cpu
    assert fmt in ("fp8", "fp4") and K % bK == 0 and bK % sub == 0 and bK % ag == 0
    assert cpu or bN % 64 == 0
    assert fp4 or (wb % sub == 0 and (bN % wb == 0 or wb % bN == 0))
    glu = swiglu_limit is not None
    split = glu and glu_split
    assert glu or not glu_split, "glu_split needs the fused SwiGLU (swiglu_limit)"
    I, bNh = N // 2, bN // 2
    assert N % bN == 0
    if split:  # bN gate rows + the bN matching up rows per CTA, read from the plain stack
        assert I % bN == 0 and bN % 32 == 0
    elif glu:  # B (and its scales) tile-interleaved by `gate_up_tiles(..., bN // 2)`
        assert bNh % 32 == 0 and (fp4 or bNh % wb == 0)
    halves = (0, 1) if split else (0,)
    n_halves = len(halves)
    out_cols = bN if split else bNh  # output columns per CTA with glu (Hq's; C's without glu: bN)
    n_cta_cols = I // bN if split else N // bN
    if max_rows:
        assert max_rows % bT == 0 and M == E * max_rows
    else:
        assert M % bT == 0
    nk, sa_rows, kb_a = K // bK, bK // ag, ceil_div(K, ag)
    units = list(range(bK // sub))
    fp8 = "float32" if cpu else "float8_e4m3fn"
    wide = cfg.wide_tma and not cpu
    staged = cfg.stage_scales and not fp4
    assert not staged or bK % weight_block == 0, "stage_scales: whole weight blocks per K stage"
    assert not cfg.wide_tma or (not fp4 and bK % 128 == 0), "wide_tma: fp8 tiles of whole 128-byte K rows"
    if wide:
        _wide_swizzle_hook()
    assert not slot_map or max_rows, "slot_map is a masked-layout map"
    assert 0 <= slots <= E and (not slots or max_rows), "slots: 1..E expert slots of the masked layout"
    assert not cfg.persistent or slot_map, "persistent: walks the slot map's active slots"
    n_meta = (2 * E + 1 if slot_map else E) if max_rows else M // bT
    n_grid = (slots or E) if max_rows else M // bT
    epilogue = _swiglu_epilogue(bT, out_cols, swiglu_limit, target) if glu else None
    # fp8 weight scales of this CTA's rows, staged once
    nsb = max(1, bN // wb) if not fp4 else 1
    kb_w = ceil_div(K, wb)
    sb_cols = bK // wb if staged else kb_w  # staged: one K stage's scale columns (multi-buffered by the pipeline)
    # staged: each stage's copy padded to 128 bytes (a TMA destination in shared memory must be 128-byte aligned;
    # 2 x 4 fp32 = 32-byte stages faulted with a misaligned address on the H200)
    sb_rows = max(nsb, 128 // (4 * sb_cols)) if staged else nsb
    if fp4:
        b_shape, sb_shape, sb_dt = (E, N, K // 4), (E, K // 32, N), "uint8"
    else:
        b_shape, sb_shape, sb_dt = (E, N, K), (E, ceil_div(N, wb), kb_w), "float32"
    b_dt = "int16" if fp4 else fp8
    out_dt = "float32" if cpu else "bfloat16"

    @T.macro
    def _mma_step(u, ko, A_s, SA_s, p0, acc, W, W_f, S):
        """One 32-K sub-block of one weight tile W (scales S): the MMA into p0, then the exact promotion into acc."""
        if cpu:  # plain loops: the dequantised value (e2m1 * 2^-6) and the partial product
            if fp4:
                for j, k in T.grid(bN, sub):
                    W_f[j, k] = T.call_extern("float32", "deepinfer_fp4_value",
                                              W[j, u * (sub // 4) + k // 4], k % 4)  # fmt: skip
            for j, t in T.grid(bN, bT):
                p0[j, t] = 0.0
                for k in T.serial(sub):
                    if fp4:
                        p0[j, t] += W_f[j, k] * A_s[t, u * sub + k]
                    else:
                        p0[j, t] += W[j, u * sub + k] * A_s[t, u * sub + k]
        elif fp4 and fast_dequant:
            T.evaluate(T.call_extern("handle", f"deepinfer_fp4_frag<{bN // 64}>",
                                     W_f.data, T.address_of(W[0, u * (sub // 4)]), bK // 4))  # fmt: skip
            T.gemm(W_f, A_s[:, u * sub : (u + 1) * sub], p0, transpose_B=True, clear_accum=True)
        elif fp4:  # element-wise (what TileLang lowers by itself; ~2x the integer work)
            for j, k in T.Parallel(bN, sub):
                w4 = T.call_extern("uint32", "deepinfer_fp4x4_to_e4m3",
                                   T.Cast("uint32", W[j, u * (sub // 4) + k // 4]))  # fmt: skip
                W_f[j, k] = T.reinterpret(T.Cast("uint8", (w4 >> T.Cast("uint32", (k % 4) * 8)) & T.uint32(255)), fp8)
            T.gemm(W_f, A_s[:, u * sub : (u + 1) * sub], p0, transpose_B=True, clear_accum=True)
        else:
            T.gemm(W[:, u * sub : (u + 1) * sub], A_s[:, u * sub : (u + 1) * sub], p0,
                   transpose_B=True, clear_accum=True)  # fmt: skip
        for j, t in mem.par(bN, bT):
            if fp4:
                # 2^(byte - 127) * 2^6 (the dequantised codes are the e2m1 values * 2^-6)
                sbyte = T.Cast("uint32", S[u, j])
                sb = T.reinterpret(T.shift_left(sbyte + T.uint32(6), T.uint32(23)), "float32")
            elif staged:  # this stage's scales only
                sb = S[j // wb if bN > wb else 0, (u * sub) // wb]
            else:
                sb = S[j // wb if bN > wb else 0, (ko * bK + u * sub) // wb]
            acc[j, t] += p0[j, t] * (sb * SA_s[(u * sub) // ag, t])

    @T.macro
    def expert_of_slot(Meta, slot):
        """(expert, token tiles) of this CTA's slot; 0 token tiles: nothing to do (the expert is then any valid id)."""
        info = T.alloc_var("int32")
        if slot_map:  # one load: SlotExpert[slot]; an idle expert's count is 0
            info = Meta[E + slot]
            return info, T.min(T.ceildiv(Meta[info], bT), max_rows // bT)
        cnt = T.alloc_var("int32")
        info = -1
        cnt = 0
        if max_rows:  # slot -> the slot-th expert with tokens, by a scan of the counts
            for i in T.serial(E):
                if Meta[i] > 0:
                    if cnt == slot:
                        info = i
                    cnt = cnt + 1
        else:
            info = Meta[slot]
        e = T.max(info, 0)
        if max_rows:
            return e, T.if_then_else(info >= 0, T.min(T.ceildiv(Meta[e], bT), max_rows // bT), 0)
        return e, T.if_then_else(info >= 0, 1, 0)

    @T.macro
    def stage_weight_scales(SB, St, e, row_g):
        """The fp8 block scales of this CTA's weight rows (all of K), once, with plain loads."""
        for h in halves:
            for i, k in mem.par(nsb, kb_w):
                St[h][i, k] = SB[e, row_g[h] // wb + i, k]

    @T.macro
    def work_item(A, SA, B, SB, Meta, C, CS, bx, slot, At, SA_s, Wt, St, P0, Acc, W_f):
        """Columns [bx*bN, (bx+1)*bN) of expert slot `slot`: every token tile of its expert."""
        e, n_tt = expert_of_slot(Meta, slot)
        # first weight row of each half's tile (with glu and not split: of the tile-interleaved stack)
        row_g = [h * I + bx * bN for h in halves]
        if not fp4 and not staged:
            if slot_map:  # an idle slot reads nothing
                if n_tt > 0:
                    stage_weight_scales(SB, St, e, row_g)
            else:
                stage_weight_scales(SB, St, e, row_g)
        for tt in T.serial(n_tt):
            if max_rows:
                row0 = e * max_rows + tt * bT
            else:
                row0 = slot * bT
            for h in halves:
                T.clear(Acc[h])
            for ko in T.Pipelined(nk, num_stages=cfg.stages):
                for h in halves:
                    r0 = row_g[h]
                    if fp4:
                        T.copy(B[e, r0 : r0 + bN, ko * (bK // 4) : (ko + 1) * (bK // 4)], Wt[h])
                        T.copy(SB[e, ko * (bK // 32) : (ko + 1) * (bK // 32), r0 : r0 + bN], St[h])
                    else:
                        T.copy(B[e, r0 : r0 + bN, ko * bK : (ko + 1) * bK], Wt[h])
                        if staged:
                            T.copy(SB[e, r0 // wb : r0 // wb + nsb, ko * (bK // wb) : (ko + 1) * (bK // wb)],
                                   St[h][0:nsb, 0:sb_cols])  # fmt: skip
                T.copy(A[row0 : row0 + bT, ko * bK : (ko + 1) * bK], At[0])
                T.copy(SA[ko * sa_rows : (ko + 1) * sa_rows, row0 : row0 + bT], SA_s)
                for u in units:
                    for h in halves:
                        _mma_step(u, ko, At[0], SA_s, P0[h], Acc[h], Wt[h], W_f, St[h])
            if glu:
                H_s = mem.shared((bT, n_halves * bN), "float32")
                for h in halves:
                    for j, t in mem.par(bN, bT):
                        H_s[t, h * bN + j] = Acc[h][j, t]
                epilogue(H_s, C, CS, row0, bx * out_cols)
            else:
                C_s = mem.shared((bT, bN), out_dt)
                for j, t in mem.par(bN, bT):
                    C_s[t, j] = Acc[0][j, t]
                T.copy(C_s, C[row0 : row0 + bT, bx * bN : (bx + 1) * bN])

    grid = (cfg.persistent,) if cfg.persistent else (n_cta_cols, n_grid)

    @T.macro
    def kernel(A, SA, B, SB, Meta, C, CS):
        with T.Kernel(*grid, threads=cfg.threads) as ids:
            if not cpu:
                T.annotate_min_blocks_per_sm(cfg.min_blocks)
                T.no_set_max_nreg()
            if fp4:
                T.import_source(_FP4_SRC_CPU if cpu else _FP4_SRC)
            # the tiles live in lists and are only ever used as list elements: binding one to a new name would
            # rename the buffer (wide: the `_w128` names select the 128B swizzle, `_wide_swizzle_hook`)
            if wide:
                A_s_w128 = mem.shared((bT, bK), fp8)
                At = [A_s_w128]
            else:
                A_s = mem.shared((bT, bK), fp8)
                At = [A_s]
            SA_s = mem.shared((sa_rows, bT), "float32")
            # one weight tile of bN rows per half (glu_split: the gate half and the up half, each its own MMA);
            # named allocations (a list comprehension would name every buffer `v` in the generated source)
            p0 = mem.fragment((bN, bT), "float32")
            acc = mem.fragment((bN, bT), "float32")
            if fp4:
                P_s = mem.shared((bN, bK // 4), "int16")
                W_f = mem.fragment((bN, sub), fp8)
                SG_s = mem.shared((bK // 32, bN), "uint8")
                Wt, St = [P_s], [SG_s]
            elif wide:
                W_s_w128 = mem.shared((bN, bK), fp8)
                SB_s = mem.shared((sb_rows, sb_cols), "float32")
                Wt, St = [W_s_w128], [SB_s]
            else:
                W_s = mem.shared((bN, bK), fp8)
                SB_s = mem.shared((sb_rows, sb_cols), "float32")
                Wt, St = [W_s], [SB_s]
            if split:
                p0_up = mem.fragment((bN, bT), "float32")
                acc_up = mem.fragment((bN, bT), "float32")
                if fp4:
                    P_up_s = mem.shared((bN, bK // 4), "int16")
                    SG_up_s = mem.shared((bK // 32, bN), "uint8")
                    Wt, St = Wt + [P_up_s], St + [SG_up_s]
                elif wide:
                    W_up_s_w128 = mem.shared((bN, bK), fp8)
                    SB_up_s = mem.shared((sb_rows, sb_cols), "float32")
                    Wt, St = Wt + [W_up_s_w128], St + [SB_up_s]
                else:
                    W_up_s = mem.shared((bN, bK), fp8)
                    SB_up_s = mem.shared((sb_rows, sb_cols), "float32")
                    Wt, St = Wt + [W_up_s], St + [SB_up_s]
                P0, Acc = [p0, p0_up], [acc, acc_up]
            else:
                P0, Acc = [p0], [acc]
            tiles = (At, SA_s, Wt, St, P0, Acc, W_f if fp4 else None)
            if cfg.persistent:  # item i = this CTA + k * G over the active slots' items, slot-major
                for k in T.serial(T.ceildiv(Meta[2 * E] * n_cta_cols - ids, cfg.persistent)):
                    item = ids + k * cfg.persistent
                    work_item(A, SA, B, SB, Meta, C, CS, item % n_cta_cols, item // n_cta_cols, *tiles)
            else:
                work_item(A, SA, B, SB, Meta, C, CS, ids[0], ids[1], *tiles)

    q_dt = "float32" if cpu else "float8_e4m3fn"
    if glu:

        @T.prim_func
        def moe_grouped_swab_swiglu(
            A: T.Tensor((M, K), fp8),
            SA: T.Tensor((kb_a, M), "float32"),
            B: T.Tensor(b_shape, b_dt),
            SB: T.Tensor(sb_shape, sb_dt),
            Meta: T.Tensor((n_meta,), "int32"),
            Hq: T.Tensor((M, I), q_dt),
            Hs: T.Tensor((I // 32, M), "float32"),
        ):
            kernel(A, SA, B, SB, Meta, Hq, Hs)

        return moe_grouped_swab_swiglu

    @T.prim_func
    def moe_grouped_swab(
        A: T.Tensor((M, K), fp8),
        SA: T.Tensor((kb_a, M), "float32"),
        B: T.Tensor(b_shape, b_dt),
        SB: T.Tensor(sb_shape, sb_dt),
        Meta: T.Tensor((n_meta,), "int32"),
        C: T.Tensor((M, N), out_dt),
    ):
        kernel(A, SA, B, SB, Meta, C, None)

    return moe_grouped_swab


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


def slot_expert_meta(counts: torch.Tensor) -> torch.Tensor:
    """swab_program(slot_map=True)'s Meta [2E+1] int32: Counts, then SlotExpert = the experts with a non-zero count
    in expert order, then the idle ones (slot s of the scan's order is SlotExpert[s]), then the number of experts
    with a non-zero count. A few small launches, no host read, no data-dependent shape (a stable sort of the 0/1
    idle flags), so a decode step can be captured."""
    counts = counts.to(torch.int32)
    idle = (counts == 0).to(torch.int8)
    order = torch.argsort(idle, stable=True)
    active = counts.numel() - idle.sum(dtype=torch.int32)
    return torch.cat([counts, order.to(torch.int32), active.reshape(1)])


# The decode step's masked layout in one launch (Triton, one program): for the expert of every (token, slot) pair
# (after the duplicate merge; E = a merged duplicate), its row e*max_rows + rank (rank: earlier pairs with the same
# expert, in flat pair order) and slot_expert_meta of the counts. In torch the ranks were a cumsum of a [T*K, E+1]
# one-hot along dim 0 (one serial scan per column: 75 us a layer on the H200 at T=64) and the map a radix sort
# (20 us); here the ranks are [CHUNK, P] equality tiles, the counts a histogram, the map a cumsum of E flags.


@functools.lru_cache(maxsize=2)
def _masked_rows_kernel(interpret: bool):
    """Built lazily, once per interpreter mode (triton fixes it at decoration time)."""
    import triton
    import triton.language as tl

    @triton.jit
    def masked_rows_kernel(e_ptr, dest_ptr, meta_ptr, P, E, max_rows, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                           CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr):  # fmt: skip
        """Program p ranks pairs [p * N_CHUNKS * CHUNK, +N_CHUNKS * CHUNK); program 0 also writes the meta. One
        program walking every chunk (N_CHUNKS = BLOCK_P / CHUNK) or one program a chunk (N_CHUNKS = 1, spread)."""
        pid = tl.program_id(0)
        j = tl.arange(0, BLOCK_P)
        # expert ids as int32 (0..E): the [CHUNK, BLOCK_P] compares below are the kernel's work, int64 ones take two
        ej = tl.load(e_ptr + j, mask=j < P, other=E).to(tl.int32)  # padding pairs: the spare expert E
        if pid == 0:  # counts of the real experts and the slot map (active experts first, in order, then idle ones)
            ex = tl.arange(0, BLOCK_E)
            counts = tl.where(ex < E, tl.histogram(ej, BLOCK_E), 0)
            active = (counts > 0).to(tl.int32)
            cs = tl.cumsum(active, axis=0)
            n_act = tl.sum(active, axis=0)
            pos = tl.where(active > 0, cs - 1, n_act + ex - cs)
            tl.store(meta_ptr + ex, counts, mask=ex < E)
            tl.store(meta_ptr + E + pos, ex, mask=ex < E)
            tl.store(meta_ptr + 2 * E, n_act)
        # The chunks are independent: a runtime loop, never an unroll. H200 (session 12 call 2, T=64, 32 chunks):
        # unrolled 73.5 us vs 40.7 us as the loop, first launch 4.0 vs 0.46 s; the unroll's sm_90a compile on a
        # 2-core CPU: 15.6 s vs 0.6 s at T=64, 43 s at T=128, ~170 s at T=256.
        for k in tl.range(N_CHUNKS):
            i = (pid * N_CHUNKS + k) * CHUNK + tl.arange(0, CHUNK)
            ei = tl.load(e_ptr + i, mask=i < P, other=E).to(tl.int32)
            rank = tl.sum(((ei[:, None] == ej[None, :]) & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
            tl.store(dest_ptr + i, ei.to(tl.int64) * max_rows + rank, mask=i < P)

    return masked_rows_kernel


MASKED_ROWS_SPREAD_ENV = "DEEPINFER_MOE_LAYOUT_SPREAD"  # "0": masked_rows as one program walking the chunks


def masked_rows(e_kept: torch.Tensor, n_experts: int, max_rows: int, spread: bool | None = None):
    """(row [P] int64 = e*max_rows + rank, slot_expert_meta [2E+1]) of the pairs' experts e_kept [P] (values 0..E, E: a
    merged duplicate, whose row is replaced by its first occurrence's): one Triton launch (CUDA, or the CPU
    interpreter with TRITON_INTERPRET=1); `masked_rows_reference` is the torch formulation it replaces.
    spread (the default; DEEPINFER_MOE_LAYOUT_SPREAD=0 turns it off) gives each of the P/16 rank chunks its own
    program; without it one program walks them all -- BLOCK_P^2 compares on one SM, each chunk a global-load latency
    and 3 barriers after the last: H200 session 12 call 2 (int64 ids) 40.7 / 126.3 / 370.8 us at T 64 / 128 / 256,
    call 3 (int32 ids, exact): the walk 37.9 / 91.4 / 290.1 us, spread 7.7 / 8.5 / 10.2 us (the torch formulation
    122 / 198 / 348 us)."""
    import os

    import triton

    if spread is None:
        spread = os.environ.get(MASKED_ROWS_SPREAD_ENV) != "0"
    p = e_kept.numel()
    e_kept = e_kept.reshape(-1).long().contiguous()
    dest = torch.empty(p, dtype=torch.int64, device=e_kept.device)
    meta = torch.empty(2 * n_experts + 1, dtype=torch.int32, device=e_kept.device)
    block_p, chunk = max(16, triton.next_power_of_2(p)), 16
    n_chunks = 1 if spread else block_p // chunk
    _masked_rows_kernel(os.environ.get("TRITON_INTERPRET") == "1")[(triton.cdiv(p, chunk * n_chunks),)](
        e_kept, dest, meta, p, n_experts, max_rows, BLOCK_P=block_p, BLOCK_E=triton.next_power_of_2(n_experts + 1),
        CHUNK=chunk, N_CHUNKS=n_chunks, num_warps=4 if spread else 8)  # fmt: skip
    return dest, meta


def masked_rows_reference(e_kept: torch.Tensor, n_experts: int, max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch: the ranks from a running count of a one-hot [P, E+1] table, the map by slot_expert_meta."""
    e_kept = e_kept.reshape(-1).long()
    seen = (e_kept.unsqueeze(1) == torch.arange(n_experts + 1, device=e_kept.device)).cumsum(0)
    rank = seen.gather(1, e_kept.unsqueeze(1)).squeeze(1) - 1
    return e_kept * max_rows + rank, slot_expert_meta(seen[-1, :n_experts])


# The prefill un-permute: y[t] = sum_j w[t, j] * C[slot[t * K + j]] in fp32, one program per (token, D block). In
# torch it is a gather of the T*K bf16 rows, a widening copy, a product and a sum over K (~5 GB of traffic a layer at
# 8192 tokens, D 5120, top-6); here each C row is read once and y written once.
@functools.lru_cache(maxsize=2)
def _combine_kernel(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def combine_rows_kernel(c_ptr, slot_ptr, w_ptr, y_ptr, base_ptr, D, stride_c, K: tl.constexpr,
                            BLOCK_D: tl.constexpr, HAS_BASE: tl.constexpr):  # fmt: skip
        t = tl.program_id(0)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        if HAS_BASE:  # the shared expert's output: added here instead of in one more pass over [T, D]
            acc = tl.load(base_ptr + t.to(tl.int64) * D + d, mask=d < D, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(slot_ptr + t * K + j).to(tl.int64)
            wj = tl.load(w_ptr + t * K + j).to(tl.float32)
            acc += wj * tl.load(c_ptr + row * stride_c + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(y_ptr + t.to(tl.int64) * D + d, acc, mask=d < D)

    return combine_rows_kernel


def combine_rows(c: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, base: torch.Tensor | None = None,
                 block_d: int = 1024) -> torch.Tensor:  # fmt: skip
    """y [T, D] fp32 = base[t] + sum over j of weights[t, j] * c[slot[t * K + j]] (c [rows, D], unit stride along D;
    slot [T*K] rows of the pairs in token-major order; weights [T, K]; base [T, D] or None): one Triton launch (CUDA,
    or the interpreter with TRITON_INTERPRET=1). `combine_rows_reference` is the torch formulation (the same
    products; fp32 sums in another order)."""
    import os

    import triton

    t, k = weights.shape
    d = c.shape[1]
    assert c.stride(1) == 1 and slot.numel() == t * k, (c.stride(), slot.shape, weights.shape)
    assert base is None or (base.shape == (t, d) and base.is_contiguous()), base.shape
    y = torch.empty(t, d, dtype=torch.float32, device=c.device)
    if t:
        _combine_kernel(os.environ.get("TRITON_INTERPRET") == "1")[(t, triton.cdiv(d, block_d))](
            c, slot.contiguous(), weights.float().contiguous(), y, y if base is None else base, d, c.stride(0), K=k,
            BLOCK_D=block_d, HAS_BASE=base is not None)  # fmt: skip
    return y


def combine_rows_reference(c: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor,
                           base: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    t, k = weights.shape
    y = (c[slot].float().view(t, k, -1) * weights.float().unsqueeze(-1)).sum(1)
    return y if base is None else base.float() + y


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
    for t, e in enumerate(tile_experts(tile_expert).tolist()):
        if e < 0:
            continue
        rows = slice(t * block_m, (t + 1) * block_m)
        out[rows] = fp8_gemm.reference(a[rows], sa[rows], b[e], sb[e], act_group, weight_block)
    return out


def reference_f64(a, sa, b, sb, tile_expert, block_m: int, act_group: int, weight_block: int) -> torch.Tensor:
    """Independent oracle: per-row expert, dequantised float64 matmul."""
    from deepinfer.codegen.kernels import fp8_gemm

    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    for t, e in enumerate(tile_experts(tile_expert).tolist()):
        if e >= 0:
            rows = slice(t * block_m, (t + 1) * block_m)
            out[rows] = fp8_gemm.reference_dequant_f64(a[rows], sa[rows], b[e], sb[e], act_group, weight_block)
    return out


def roofline(M: int, N: int, K: int, E_active: int, act_group: int, weight_block: int) -> tuple[float, float]:
    """(bytes, flops): activations once, each ACTIVE expert's weights once, output once. For the masked
    layout pass M = the real rows (sum of the counts), not E * max_rows."""
    w = E_active * (N * K + 4 * ceil_div(N, weight_block) * ceil_div(K, weight_block))
    return float(M * K + 4 * M * ceil_div(K, act_group) + w + 2 * M * N), 2.0 * M * N * K


def roofline_w4a8(M: int, N: int, K: int, E_active: int, act_group: int = 32) -> tuple[float, float]:
    """(bytes, flops) with FP4 expert weights: each active expert's packed codes (K/2 bytes a row) and its
    ue8m0 bytes (K/32 a row) once, activations and their scales once, bf16 output once."""
    w = E_active * (N * K // 2 + N * K // 32)
    return float(M * K + 4 * M * ceil_div(K, act_group) + w + 2 * M * N), 2.0 * M * N * K


def roofline_swiglu(M: int, N: int, K: int, E_active: int, fmt: str = "fp8", act_group: int = 32,
                    weight_block: int = 32) -> tuple[float, float]:  # fmt: skip
    """The w1|w3 GEMM with the fused SwiGLU: the output is Hq [M, N/2] e4m3 + Hs fp32 per 32, not C [M, N] bf16."""
    if fmt == "fp4":
        bytes_, flops = roofline_w4a8(M, N, K, E_active, act_group)
    else:
        bytes_, flops = roofline(M, N, K, E_active, act_group, weight_block)
    return bytes_ - 2 * M * N + M * N // 2 + 4 * M * (N // 64), flops


# ---------------------------------------------------------------------------------------------- W4A8 + SwiGLU host side


def w4a8_weights(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The swap-AB program's fp4 operands from the checkpoint format (MODEL_SPEC §4.3): packed e2m1 bytes
    [E, N, K/2] (uint8 / float4_e2m1fn_x2, low nibble = even column) -> int16 view [E, N, K/4] (no copy), and
    ue8m0 scales [E, N, K/32] (uint8 / float8_e8m0fnu) -> uint8 [E, K/32, N] (MN-major, one copy)."""
    b = packed.contiguous().view(torch.uint8).view(torch.int16)
    s = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale.to(torch.uint8)
    return b, s.transpose(1, 2).contiguous()


def gate_up_tiles(w: torch.Tensor, half: int, dim: int = 1) -> torch.Tensor:
    """w1|w3 stacked along `dim` ([.., 2I, ..]: gate rows then up rows) -> tiles of `half` gate rows followed by
    the matching `half` up rows, the order a fused-SwiGLU program reads (one contiguous weight tile per CTA).
    For block-scale tensors pass half // block (the scales of 32-row blocks move with their rows)."""
    n = w.shape[dim]
    assert n % (2 * half) == 0, f"{n} rows do not split into gate/up tiles of {half}"
    shape = list(w.shape)
    v = w.reshape(shape[:dim] + [2, n // (2 * half), half] + shape[dim + 1 :])
    return v.transpose(dim, dim + 1).reshape(shape).contiguous()


def row_experts(layout_meta: torch.Tensor, block: int, masked: bool) -> torch.Tensor:
    """Expert of every row (-1: a padding row / a row past its expert's count): masked layout from Counts
    with max_rows = block, contiguous layout from TileExpert with block = the tile rows (a half tile's rows past
    its first half: -1, layout padding)."""
    meta = layout_meta.cpu().long()
    if masked:
        e = torch.arange(meta.numel()).repeat_interleave(block)
        return torch.where(torch.arange(e.numel()) % block < meta[e], e, torch.full_like(e, -1))
    e = tile_experts(meta).repeat_interleave(block)
    past_half = (meta >= _half_flag()).repeat_interleave(block) & (torch.arange(e.numel()) % block >= block // 2)
    return torch.where(past_half, torch.full_like(e, -1), e)


def _half_flag() -> int:
    from deepinfer.codegen.kernels.fp8_gemm import HALF_TILE_FLAG

    return HALF_TILE_FLAG


def tile_experts(tile_expert: torch.Tensor) -> torch.Tensor:
    """TileExpert without the half-tile flags (moe_routing's half_tiles layout): each tile's expert, -1 padding."""
    return torch.where(tile_expert >= 0, tile_expert % _half_flag(), tile_expert)


def dequant_fp4_experts(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[E, N, K/2] packed e2m1 + [E, N, K/32] ue8m0 -> float32 [E, N, K] (ir/ops/quant.py's dequant_fp4_rows)."""
    from deepinfer.ir.ops.quant import dequant_fp4_rows

    return torch.stack([dequant_fp4_rows(packed[e].view(torch.uint8), scale[e], 32) for e in range(packed.shape[0])])


def reference_w4a8(a, sa, packed, scale, row_expert, act_group: int = 32) -> torch.Tensor:
    """The swap-AB fp4 program's math in its order: per 32-K group an fp32 partial product of the e4m3
    activations with the e2m1 values, then times sa[row, group] * 2^(scale byte - 127).
    a [M, K] e4m3, sa [M, K/ag] (token-major), packed [E, N, K/2], scale [E, N, K/32], row_expert [M] (-1 = skip).
    Rows with no expert are zero here (junk in the kernel)."""
    from deepinfer.ir import dtypes as dt

    M, K = a.shape
    N = packed.shape[1]
    out = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    re = row_expert.to(a.device)
    for e in torch.unique(re[re >= 0]).tolist():
        rows = torch.nonzero(re == e).flatten()
        w = dt.fp4_to_float(packed[e].view(torch.uint8)).to(a.device)  # [N, K] e2m1 values, exact
        s = dt.e8m0_to_float(scale[e]).to(a.device)  # [N, K/32]
        af = a[rows].float()
        acc = torch.zeros(rows.numel(), N, dtype=torch.float32, device=a.device)
        for g in range(K // 32):
            part = af[:, g * 32 : (g + 1) * 32] @ w[:, g * 32 : (g + 1) * 32].T
            acc += part * (sa[rows, (g * 32) // act_group].unsqueeze(1) * s[:, g].unsqueeze(0))
        out[rows] = acc
    return out


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def reference_w4a8_f64(a, sa, packed, scale, row_expert, act_group: int = 32) -> torch.Tensor:
    """Independent oracle: decodes the nibbles and the e8m0 bytes with its own table and bit operations, in
    float64, one row at a time (small shapes only)."""
    M, K = a.shape
    N = packed.shape[1]
    table = torch.tensor(_E2M1, dtype=torch.float64)
    out = torch.zeros(M, N, dtype=torch.float64)
    cache = {}
    for m in range(M):
        e = int(row_expert[m])
        if e < 0:
            continue
        if e not in cache:
            byte = packed[e].view(torch.uint8).cpu().long()  # [N, K/2]
            codes = torch.stack([byte & 0xF, byte >> 4], dim=-1).reshape(N, K)  # low nibble = even column
            val = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
            sc = torch.pow(2.0, scale[e].view(torch.uint8).cpu().double() - 127.0)  # [N, K/32]
            cache[e] = val * sc.repeat_interleave(32, dim=1)
        x = a[m].cpu().double() * sa[m].cpu().double().repeat_interleave(act_group)[:K]
        out[m] = cache[e] @ x
    return out


def swiglu_quant_reference(h: torch.Tensor, limit: float, group: int = 32):
    """What the fused epilogue writes, from the fp32 GEMM output h [M, 2I] (gate columns, then up): the clamped
    SwiGLU (ir/ops/moe.py `swiglu`) quantised per `group` columns as the runtime's quant_act does.
    Returns (q e4m3 [M, I], scales fp32 [M, I/group])."""
    from deepinfer.ir import dtypes as dt
    from deepinfer.ir.ops.moe import swiglu

    inter = h.shape[1] // 2
    y = swiglu(h[:, :inter], h[:, inter:], limit).unflatten(-1, (-1, group))
    s = dt.pow2_scale(y.abs().amax(-1, keepdim=True), dt.FP8_MAX, floor=ACT_SCALE_FLOOR)
    q = (y / s).clamp(-dt.FP8_MAX, dt.FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s.squeeze(-1)


def fp4x4_to_e4m3_bits(x: int) -> int:
    """Python mirror of the kernel's deepinfer_fp4x4_to_e4m3 (PRMT semantics spelled out): for the tests."""

    def byte_perm(a: int, b: int, sel: int) -> int:
        src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
        out = 0
        for i in range(4):
            nib = (sel >> (4 * i)) & 0xF
            byte = (src >> (8 * (nib & 7))) & 0xFF
            if nib & 8:  # sign-replicate mode
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << (8 * i)
        return out

    mag = byte_perm(0x0C080400, 0x1C181410, x & 0x7777)
    sgn = x & 0x8888
    return mag | (byte_perm((sgn << 4) & 0xFFFFFFFF, sgn, 0x5140) & 0x80808080)
