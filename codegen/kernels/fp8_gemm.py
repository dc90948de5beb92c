"""FP8 block-scaled GEMM with per-token-group quantised activations (the dense `linear` of V4/V4.1).

    C[M, N] (bf16) = (A ⊙ sa) @ (B ⊙ sb)ᵀ
    A  [M, K] fp8 e4m3, sa [K/ag, M] fp32   one ue8m0 scale per token per `ag` input channels (MN-major)
    B  [N, K] fp8 e4m3, sb [N/wb, K/wb] fp32 one ue8m0 scale per wb x wb weight block

V4 uses ag = wb = 128, V4.1 ag = wb = 32 (MODEL_SPEC §4.2).

Each K tile lies inside one activation group and one weight block (block_k divides both), so its
partial product can be scaled exactly after the MMA: the tensor cores produce an unscaled fp32 tile,
then every thread folds it into the running accumulator with sa[row] * sb[col block] ("promotion",
as DeepGEMM does on SM90). On sm90 the MMA accumulates in registers (wgmma → QGMMA for FP8 in SASS);
on sm100 it accumulates in tensor memory (tcgen05 → UTCQMMA) and the tile is read back per step.
The CPU variant is the same program with fp32 inputs and local buffers (numerics only).

Cost of exactness on Hopper (sm90). wgmma has no per-K-block scale, so every 32 K the fp32 partial tile
must be folded into the accumulator with one FFMA per element (acc = part * (sa*sb) + acc). Per SM and
clock the tensor cores do 4096 FP8 FMAs and the FP32 pipes 128 FFMAs, so one FFMA per 32 MMA FMAs costs
exactly as many cycles as the MMA itself: the promotion can only be hidden if it runs *concurrently*
with the next wgmma (and then it fills every issue slot). Folding the 32-wide scales into the FP8
operands is not exact (e4m3 loses low bits when shifted down by a scale ratio), and pre-multiplying the
4 sub-group scales of a 128-K window only works if they are equal. DeepGEMM's V3/V4 case (1x128
activations, 128x128 weights) promotes once per 128 K, which makes the promotion 4x cheaper than here.

The sm90 program therefore (BENCHMARKS.md has the measured variants):
  * stages `block_k` (32/64/128) K per TMA stage and issues one wgmma per 32-K sub-block into one of
    two partial fragments, asynchronously (`overlap`): the wgmma of sub-block s+1 runs while sub-block
    s is promoted, and the stage is released only after the last wgmma that reads it has completed;
  * uses two consumer warpgroups (`threads=256`) that each own 64 rows x block_n (FullRow split) so
    acc + 2 partials fit in registers without spills, and the two warpgroups overlap each other;
  * keeps the weight scales of the whole N tile in shared memory (one bulk copy), and the activation
    scales ride the TMA pipeline (MN-major rows).
That program is one CTA per output tile: every tile pays its pipeline fill and its epilogue with the tensor
cores idle (about a quarter of the time at K = 1024-1280, where a tile has only 8-10 K blocks).

`persistent=True` selects `_program_sm90_ws`, the DeepGEMM recipe written in TileLang: 132 persistent
CTAs, one TMA producer warpgroup (setmaxnreg 40) and two consumer warpgroups (setmaxnreg 232) with
explicit full/empty mbarrier rings. The producer walks the CTA's tiles in L2-friendly panels
(`tile_coords`) and runs ahead across tile boundaries, so the next tile's first stages are loaded while
the consumers run the epilogue (stmatrix + TMA store). Options: `n_split` (N tile MMA'd in column slices
through one partial: 128x256 tiles in 192 accumulator registers), `overlap` (two partials, one wgmma
always in flight, also across K blocks), `cluster=2` (M-adjacent CTA pairs share the B tile through TMA
multicast: a third less L2->SM traffic at 128x256). The scale math and the promotion order are the same
as above, so the result is the same to fp32 rounding. `WSPlan` holds the sizes and scale indexing that
the sm90 program and its CPU twin (`_program_ws_cpu`, c-target numerics) share. With `experts=E` the same
program is the MoE grouped GEMM on the contiguous layout (moe_grouped_gemm.py): each M tile reads its
expert's weights, padding tiles are skipped.

SM90 ceiling for V4.1's 32-groups (exact per-32 promotion), per K = 32 step of one consumer warpgroup that
owns a 64 x 256 slice of a 128 x 256 tile (H100/H200 per SM and clock: 4096 FP8 MACs on the tensor cores,
128 FP32 lanes, 4 schedulers each issuing 1 warp-instruction; the 4 warps of a warpgroup sit one per
scheduler, and one warpgroup's wgmma occupies all 4 tensor cores):
  * MMA: 64 * 256 * 32 = 524,288 MACs / 4096 = 128 clk of tensor-core time;
  * promotion: 64 * 256 = 16,384 products / 128 threads = 128 FFMA per thread = 128 clk of the FP32 pipe
    (16,384 / 128 lanes) and 128 issue slots on each scheduler -- as many as the MMA's clocks;
  * on top: the scale products, already hoisted to one FMUL per (row, 32-column block) by the compiler
    (2 rows x 8 blocks = 16), their shared-memory loads and the wgmma/descriptor/barrier bookkeeping. The
    SASS of the ws 128x256 g32 kernel (n_split 2) has 751 instructions per 128-K block per consumer warp:
    94 per 64x128x32 unit (64 FFMA, 8 FMUL, 6 LDS, ~16 other), i.e. ~188 issue slots per 64x256x32 step.
  The two consumer warpgroups need 2 x 128 = 256 clk of tensor time per K step and 2 x 188 = 376 issue
  slots on every scheduler. With one warpgroup's promotion perfectly hidden under the other's MMA the
  kernel is issue-bound at 256 / 376 = 68% of the tensor rate at the same clock; with no overlap it is
  256 / (256 + 376) = 41%. Measured (H200, 4096x32768x1280, % of the same run's _scaled_mm peak): ws
  128x256 44.7%, ping-pong 39.7%, sm90_config 38.3% -- barely above the no-overlap bound: the two
  warpgroups wait on the same stage barriers, so they MMA together and promote together, and the
  ping-pong's per-unit hand-over (64-clk wgmmas, each waited for before its promotion) exposes the wgmma
  latency instead. Only the `overlap` variant keeps a wgmma queued while promoting, and it needs two
  partials, so it fits 128 x 128 tiles only (64 + 2 x 64 registers), where the same count gives the same
  68% bound. The FP32 pipe at full rate also costs power, so the clock under this load is below the
  _scaled_mm peak run's. Realistic SM90 ceiling: ~50-55% of the measured FP8 peak for 32-groups; the issue-6
  targets (75% dense, 65% grouped) are reachable with 128-groups only (one promotion per 128 K: the same
  bound is 4 x looser). Not exact, so not used: folding the 32-group scales into the e4m3 operands, or a
  bf16 MMA on exactly dequantised operands (exact, but the bf16 peak is 48-55% of the FP8 one).

SM100 (B200) removes the promotion: `tcgen05.mma ... kind::mxf8f6f4.block_scale` multiplies by one ue8m0
scale per 32 K per row (A) and per column (B) inside the MMA. V4.1's format maps onto it exactly (1x32
activation scales as they are; each 32x32 weight-block scale repeated over its 32 rows). TileLang 0.1.15 has
it: `T.gemm_blockscaled(A_s, B_s, C_tmem, SFA_tmem, SFB_tmem, k_start=, sf_a_granularity_k=32,
sf_b_granularity_k=32, mbar=)` (tilelang/cuda/op/gemm/gemm_tcgen05_blockscaled.py), with the packed scales
copied shared -> tensor memory by `T.tcgen05_cp_warpx4`: a probe kernel lowers and compiles for sm_100a to
UTCQMMA with its two scale-factor TMEM operands (tests/codegen/test_cuda_build.py::
test_sm100_block_scaled_mma_is_available). The sm100 program here does not use it yet (it still promotes after
a plain tcgen05 MMA); its numerics (the packed scale-chunk layout tcgen05.cp expects) need an SM100 device.
"""

import itertools
import re
from dataclasses import dataclass

import torch

from deepinfer.codegen.kernels._common import Mem, ceil_div, expand_scales

FAMILY = "fp8_gemm"


@dataclass(frozen=True)
class Config:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    stages: int = 3
    threads: int = 128
    overlap: bool = False  # sm90: async wgmma per 32-K sub-block, promoted while the next one runs
    row_split: bool = False  # sm90: warpgroups split M (each 64 rows x block_n) instead of "square"
    n_split: int = 1  # sm90: MMA the N tile in n_split column slices through one partial (fewer registers)
    persistent: bool = False  # sm90: persistent warp-specialised kernel (_program_sm90_ws)
    raster: int = 16  # persistent: tiles are visited in panels of `raster` M tiles (L2 reuse)
    sms: int = 132  # persistent: CTAs launched, one per SM (H100/H200 SXM)
    cluster: int = 1  # persistent: CTAs per cluster along M; 2 = the pair shares its B tile (TMA multicast)
    pingpong: bool = False  # persistent, no overlap: the 2 consumer warpgroups issue their wgmmas in turn
    direct_store: bool = False  # persistent: epilogue stores registers -> global (no smem C tile: room for a stage)
    pair_n: bool = False  # cluster 2: the pair takes N-adjacent tiles of one M tile and shares A (not B) by multicast

    @property
    def tag(self) -> str:
        extra = ("o" if self.overlap else "") + ("r" if self.row_split else "")
        extra += f"n{self.n_split}" if self.n_split > 1 else ""
        extra += f"p{self.raster}" if self.persistent else ""
        extra += f"c{self.cluster}" if self.persistent and self.cluster > 1 else ""
        extra += "n" if self.persistent and self.cluster > 1 and self.pair_n else ""
        extra += "pp" if self.persistent and self.pingpong else ""
        extra += "d" if self.persistent and self.direct_store else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k}s{self.stages}t{self.threads}{extra}"


def default_config(k_group: int) -> Config:
    """Portable config (every target, including the CPU `c` target and sm100): one K group per stage."""
    return Config(block_k=min(128, k_group), stages=3 if k_group >= 128 else 6)


def sm90_config(M: int, N: int, k_group: int) -> Config:
    """Best measured sm90 formulation per shape class (H200 sweeps, BENCHMARKS.md). Persistent programs need
    whole 128-row tiles (M % 128; M % 256 for CTA pairs) and K % 128 (the caller checks K % block_k)."""
    if k_group >= 128 and M >= 1024 and M % 256 == 0 and N % 256 == 0:
        # persistent, warp-specialised, ping-pong consumers, CTA pairs sharing B by TMA multicast: 74-88% of the
        # same run's _scaled_mm peak at the V4 prefill shapes (H200, BENCHMARKS.md, 2026-11-29 session 2)
        return Config(128, 256, 128, 3, 256, False, True, 2, persistent=True, cluster=2, pingpong=True)
    if M >= 1024 and M % 128 == 0 and N % 256 == 0 and N >= 4096:
        # persistent 128x256 (2 N slices): g32 41.6-43.9% at N 5120-32768 vs 34.6-40.9% for the one-CTA-per-tile
        # program (same run, /work/notes/device/2/g32.txt); g128 73.6% at 4096x32768x1280 without CTA pairs
        return Config(128, 256, 128, 3, 256, False, True, 2, persistent=True)
    if k_group < 128 and M >= 1024 and M % 256 == 0 and N % 128 == 0:
        # g32 at N = 1280 / 2304: persistent 128x128 with async wgmma overlap and CTA pairs, 34.7% / 37.8% vs
        # 32.6% / 36.1% (same run)
        return Config(128, 128, 128, 5, 256, True, True, 1, persistent=True, cluster=2)
    if M >= 1024 and N % 256 == 0 and N >= 4096:
        return Config(128, 256, 128, 3, 256, False, True, 2)
    return Config(128, 128, 128, 4, 256, k_group < 128, True)


def config_space(M: int, N: int, K: int, k_group: int) -> list[Config]:
    """Configs worth timing. block_k must divide the scale granularity (exact promotion)."""
    bks = [b for b in (32, 64, 128) if k_group % b == 0]
    out = []
    for bm, bn, bk, st in itertools.product((64, 128), (64, 128, 256), bks, (3, 4, 6)):
        if bm * bk + bn * bk > 0 and (bm * bk + bn * bk) * st + bm * bn * 2 <= 200 * 1024:
            out.append(Config(bm, bn, bk, st, 128))
    return out


def sm90_tune_space(M: int, N: int, K: int, k_group: int) -> list[Config]:
    """The sm90 formulations worth timing (BENCHMARKS.md: the 2026-11-29 sweep), fastest family first."""
    out = [
        Config(128, 256, 64, 4, 256, False, True, 2),
        Config(128, 256, 128, 3, 256, False, True, 2),
        Config(128, 128, 128, 4, 256, True, True),
        Config(128, 128, 128, 3, 256, True, True),
        Config(128, 128, 64, 4, 256, True, True),
    ]
    return [c for c in out if N % c.block_n == 0 and K % c.block_k == 0 and c.block_k % min(k_group, 128) == 0]


def program(M: int, N: int, K: int, *, act_group: int, weight_block: int, target: str, cfg: Config):
    """TileLang prim_func for one shape and config on `target` (cpu | sm90 | sm100)."""
    import tilelang.cuda.language as TC
    import tilelang.language as T

    if cfg.persistent and target in ("sm90", "cpu"):  # sm100 keeps the portable program below
        build = _program_sm90_ws if target == "sm90" else _program_ws_cpu
        return build(M, N, K, act_group=act_group, weight_block=weight_block, cfg=cfg)
    if target == "sm90" and (
        cfg.overlap or cfg.row_split or cfg.n_split > 1 or cfg.block_k > min(act_group, weight_block)
    ):
        return _program_sm90(M, N, K, act_group=act_group, weight_block=weight_block, cfg=cfg)
    bM, bN, bK = cfg.block_m, cfg.block_n, cfg.block_k
    assert act_group % bK == 0 and weight_block % bK == 0, "block_k must divide both scale granularities"
    mem = Mem(target)
    in_dt = "float32" if mem.cpu else "float8_e4m3fn"  # torch.float8_e4m3fn, same DLPack code
    out_dt = "float32" if mem.cpu else "bfloat16"
    kb_a = ceil_div(K, act_group)
    nb_w, kb_w = ceil_div(N, weight_block), ceil_div(K, weight_block)
    use_tmem = target == "sm100"

    @T.prim_func
    def fp8_gemm(
        A: T.Tensor((M, K), in_dt),
        SA: T.Tensor((kb_a, M), "float32"),
        B: T.Tensor((N, K), in_dt),
        SB: T.Tensor((nb_w, kb_w), "float32"),
        C: T.Tensor((M, N), out_dt),
    ):
        with T.Kernel(T.ceildiv(N, bN), T.ceildiv(M, bM), threads=cfg.threads) as (bx, by):
            A_s = mem.shared((bM, bK), in_dt)
            B_s = mem.shared((bN, bK), in_dt)
            SA_s = mem.shared((bM,), "float32")
            part = mem.fragment((bM, bN), "float32")
            acc = mem.fragment((bM, bN), "float32")
            if use_tmem:
                part_tm = T.alloc_tmem([bM, bN], "float32")
                mbar = T.alloc_barrier(1)
            T.clear(acc)
            for ko in T.Pipelined(T.ceildiv(K, bK), num_stages=cfg.stages):
                T.copy(A[by * bM, ko * bK], A_s)
                T.copy(B[bx * bN, ko * bK], B_s)
                # scales are MN-major so this row slice is contiguous and rides the same pipeline
                T.copy(SA[ko * bK // act_group, by * bM], SA_s)
                if use_tmem:
                    # tcgen05 MMA into TMEM, cleared per tile (scales are applied outside)
                    TC.gemm(A_s, B_s, part_tm, transpose_B=True, clear_accum=True, mbar=mbar)
                    T.copy(part_tm, part)
                else:
                    T.gemm(A_s, B_s, part, transpose_B=True, clear_accum=True)
                for i, j in mem.par(bM, bN):
                    sb = SB[(bx * bN + j) // weight_block, ko * bK // weight_block]
                    acc[i, j] += part[i, j] * (SA_s[i] * sb)
            if mem.cpu:
                T.copy(acc, C[by * bM, bx * bN])
            else:
                C_s = T.alloc_shared((bM, bN), out_dt)
                T.copy(acc, C_s)  # through smem so the store is a TMA bulk copy
                T.copy(C_s, C[by * bM, bx * bN])

    return fp8_gemm


def _program_sm90(M: int, N: int, K: int, *, act_group: int, weight_block: int, cfg: Config):
    """sm90 program: several 32-K sub-blocks per TMA stage, async wgmma overlapped with the promotion."""
    import tilelang.cuda.language as TC
    import tilelang.language as T

    bM, bN, bK = cfg.block_m, cfg.block_n, cfg.block_k
    ag, wb = act_group, weight_block
    sub = min(ag, wb)  # promotion granularity: the finer of the two scale grids
    assert bK % sub == 0 and ag % bK in (0, ag) and bK <= max(ag, wb) * 4, "block_k: a multiple of the scale step"
    assert bN % wb == 0 or wb % bN == 0, "block_n and the weight block must nest"
    ns = cfg.n_split
    assert ns in (1, 2) and bN % ns == 0
    bNs = bN // ns
    # Python lists: the unit loops are unrolled at trace time
    units = [(s, h) for s in range(bK // sub) for h in range(ns)]
    unit_ids, slices = list(range(len(units))), list(range(ns))
    sa_rows = max(1, bK // ag)
    kb_a, nb_w, kb_w = ceil_div(K, ag), ceil_div(N, wb), ceil_div(K, wb)
    nbt = max(1, bN // wb)
    policy = T.GemmWarpPolicy.FullRow if cfg.row_split else T.GemmWarpPolicy.Square
    fp8 = "float8_e4m3fn"

    @T.prim_func
    def fp8_gemm_sm90(
        A: T.Tensor((M, K), fp8),
        SA: T.Tensor((kb_a, M), "float32"),
        B: T.Tensor((N, K), fp8),
        SB: T.Tensor((nb_w, kb_w), "float32"),
        C: T.Tensor((M, N), "bfloat16"),
    ):
        with T.Kernel(T.ceildiv(N, bN), T.ceildiv(M, bM), threads=cfg.threads) as (bx, by):
            A_s = T.alloc_shared((bM, bK), fp8)
            B_s = T.alloc_shared((bN, bK), fp8)
            SA_s = T.alloc_shared((sa_rows, bM), "float32")
            SB_s = T.alloc_shared((nbt, kb_w), "float32")
            p0 = T.alloc_fragment((bM, bNs), "float32")
            p1 = T.alloc_fragment((bM, bNs), "float32")
            acc = T.alloc_fragment((bM, bNs), "float32")
            acc1 = T.alloc_fragment((bM, bNs), "float32")  # second column slice (n_split == 2)
            C_s = T.alloc_shared((bM, bN), "bfloat16")
            keep = T.alloc_local((1,), "float32")
            accs = [acc, acc1][:ns]
            T.copy(SB[bx * bN // wb, 0], SB_s)  # every weight scale of this N tile, once
            for a in accs:
                T.clear(a)
            for ko in T.Pipelined(T.ceildiv(K, bK), num_stages=cfg.stages):
                T.copy(A[by * bM, ko * bK], A_s)
                T.copy(B[bx * bN, ko * bK], B_s)
                T.copy(SA[ko * bK // ag, by * bM], SA_s)
                if cfg.overlap:
                    # units (sub-block s, column slice h) in order; unit u+1 is issued before u is promoted
                    parts = [p0, p1]
                    s0, h0 = units[0]
                    TC.wgmma_gemm(
                        A_s[:, s0 * sub : (s0 + 1) * sub],
                        B_s[h0 * bNs : (h0 + 1) * bNs, s0 * sub : (s0 + 1) * sub],
                        p0,
                        transpose_B=True,
                        clear_accum=True,
                        policy=policy,
                    )
                    for u in unit_ids:
                        s, h = units[u]
                        if u + 1 < len(units):
                            s1, h1 = units[u + 1]
                            TC.wgmma_gemm(
                                A_s[:, s1 * sub : (s1 + 1) * sub],
                                B_s[h1 * bNs : (h1 + 1) * bNs, s1 * sub : (s1 + 1) * sub],
                                parts[(u + 1) % 2],
                                transpose_B=True,
                                clear_accum=True,
                                policy=policy,
                            )
                            T.wait_wgmma(1)  # unit u is done, u+1 is in flight
                        else:
                            T.wait_wgmma(0)
                            # A never-taken read of the stage after the last wait: it moves TileLang's
                            # "stage free" arrive behind the wait (else the producer may overwrite
                            # the stage while the async wgmma still reads it).
                            if SA_s[0, 0] < 0.0:
                                keep[0] = T.cast(A_s[0, 0], "float32") + T.cast(B_s[0, 0], "float32")
                        for i, j in T.Parallel(bM, bNs):
                            sb = SB_s[(h * bNs + j) // wb if bN >= wb else 0, (ko * bK + s * sub) // wb]
                            accs[h][i, j] += parts[u % 2][i, j] * (SA_s[(s * sub) // ag, i] * sb)
                else:
                    for u in unit_ids:
                        s, h = units[u]
                        k0 = s * sub
                        T.gemm(
                            A_s[:, k0 : k0 + sub],
                            B_s[h * bNs : (h + 1) * bNs, k0 : k0 + sub],
                            p0,
                            transpose_B=True,
                            clear_accum=True,
                            policy=policy,
                        )
                        for i, j in T.Parallel(bM, bNs):
                            sb = SB_s[(h * bNs + j) // wb if bN >= wb else 0, (ko * bK + k0) // wb]
                            accs[h][i, j] += p0[i, j] * (SA_s[k0 // ag, i] * sb)
            for h in slices:
                T.copy(accs[h], C_s[:, h * bNs : (h + 1) * bNs])
            T.copy(C_s, C[by * bM, bx * bN])

    return fp8_gemm_sm90


# ---------------------------------------------------------------------------------------------- persistent


TMA_SMEM_ALIGN = 128  # bytes: a cp.async.bulk.tensor shared-memory destination must be this aligned
SM90_SMEM = 227 * 1024  # bytes of shared memory a CTA may use on H100/H200


@dataclass(frozen=True)
class WSPlan:
    """Sizes and scale indexing of the persistent kernel, shared by its sm90 and cpu builds (so the CPU
    numerics test checks the tile order and every scale index the GPU kernel uses)."""

    M: int
    N: int
    K: int
    ag: int  # activation group along K
    wb: int  # weight block (N and K)
    cfg: Config
    experts: int = 0  # > 0: grouped GEMM (contiguous layout), B [experts, N, K]
    half_tiles: bool = False  # grouped: TileExpert entries >= HALF_TILE_FLAG are tiles of <= 64 real rows

    @property
    def sub(self) -> int:  # promotion step: the finer of the two K scale grids
        return min(self.ag, self.wb)

    @property
    def bns(self) -> int:  # columns per N slice
        return self.cfg.block_n // self.cfg.n_split

    @property
    def units(self) -> list[tuple[int, int]]:  # (K sub-block, N slice), MMA'd and promoted in this order
        return [(s, h) for s in range(self.cfg.block_k // self.sub) for h in range(self.cfg.n_split)]

    @property
    def sa_rows(self) -> int:  # activation-scale rows (K groups) per stage
        return max(1, self.cfg.block_k // self.ag)

    @property
    def sb_box(self) -> bool:  # weight scales change inside a stage: a [bN/wb, bK/wb] box per stage (TMA)
        return self.wb < self.cfg.block_k

    @property
    def sb_shape(self) -> tuple[int, int]:  # per-stage weight-scale slot: the box, or one per N slice
        c = self.cfg
        return (c.block_n // self.wb, c.block_k // self.wb) if self.sb_box else (c.n_split, 1)

    @property
    def sb_slot_rows(self) -> int:
        """Rows of a stage's weight-scale slot in shared memory: sb_shape's rows padded so that every slot
        starts 128-byte aligned, which a TMA destination must be (a 4x4 fp32 box at block_n 128 is 64
        bytes: unpadded, every odd stage's TMA faulted with "misaligned address" on the H200)."""
        rows, cols = self.sb_shape
        return ceil_div(rows * cols * 4, TMA_SMEM_ALIGN) * TMA_SMEM_ALIGN // (cols * 4) if self.sb_box else rows

    def tma_slot_bytes(self) -> dict[str, int]:
        """Bytes per stage of each shared-memory ring that TMA fills (the slots follow each other)."""
        c = self.cfg
        out = {"A": c.block_m * c.block_k, "B": c.block_n * c.block_k, "SA": 4 * self.sa_rows * c.block_m}
        if self.sb_box:
            out["SB"] = 4 * self.sb_slot_rows * self.sb_shape[1]
        return out

    def smem_bytes(self) -> int:
        """Dynamic shared memory of the sm90 program: the TMA rings, the bf16 output tile (not with
        direct_store) and the per-N-slice weight-scale slots (scalar scales)."""
        c = self.cfg
        ring = c.stages * sum(self.tma_slot_bytes().values())
        scalar_sb = 0 if self.sb_box else 4 * c.stages * c.n_split
        return ring + scalar_sb + (0 if c.direct_store else 2 * c.block_m * c.block_n)

    @property
    def m_tiles(self) -> int:
        return self.M // self.cfg.block_m

    @property
    def n_tiles(self) -> int:
        return self.N // self.cfg.block_n

    @property
    def k_blocks(self) -> int:
        return self.K // self.cfg.block_k

    @property
    def cluster_tiles(self) -> int:  # tile groups of `cluster` M- (pair_n: N-) adjacent tiles, one per cluster
        return self.m_tiles * self.n_tiles // self.cfg.cluster

    @property
    def waves(self) -> int:  # tiles per CTA, rounded up
        return ceil_div(self.cluster_tiles, self.cfg.sms // self.cfg.cluster)

    def tile_of(self, w, bid, tmin=min):
        """(valid, m tile, n tile) of CTA `bid` in wave w: clusters walk `tile_coords` over groups of
        `cluster` M-adjacent tiles, and the CTA of cluster rank r takes the group's r-th M tile (pair_n: groups
        of N-adjacent tiles of one M tile, rank r takes the r-th N tile)."""
        cl = self.cfg.cluster
        t = w * (self.cfg.sms // cl) + bid // cl
        if self.cfg.pair_n and cl > 1:
            mi, ng = tile_coords(t, self.m_tiles, self.n_tiles // cl, self.cfg.raster, tmin)
            return t < self.cluster_tiles, mi, ng * cl + bid % cl
        mg, ni = tile_coords(t, self.m_tiles // cl, self.n_tiles, max(1, self.cfg.raster // cl), tmin)
        return t < self.cluster_tiles, mg * cl + bid % cl, ni

    def sa_at(self, s: int) -> int:
        """Row of the stage's activation-scale slot for K sub-block s."""
        return s * self.sub // self.ag if self.ag < self.cfg.block_k else 0

    def sb_at(self, h: int, j, s: int):
        """(row, col) of the stage's weight-scale slot for column j of N slice h, K sub-block s."""
        return ((h * self.bns + j) // self.wb, s * self.sub // self.wb) if self.sb_box else (h, 0)

    def sb_src(self, ni, h: int, k):
        """Global weight-scale index of N slice h in K block k (one scale per slice: not sb_box)."""
        return (ni * self.cfg.block_n + h * self.bns) // self.wb, k * self.cfg.block_k // self.wb

    def check(self) -> None:
        c, bns = self.cfg, self.bns
        assert c.threads == 2 * c.block_m and c.block_m in (64, 128), "one consumer warpgroup per 64 rows"
        assert self.M % c.block_m == 0 and self.N % c.block_n == 0 and self.K % c.block_k == 0, (
            f"persistent kernel needs whole tiles: {self.M}x{self.N}x{self.K} by {c.tag}"
        )
        assert c.block_k % self.sub == 0 and (self.ag % c.block_k == 0 or c.block_k % self.ag == 0)
        assert c.n_split in (1, 2) and bns % 8 == 0 and bns <= 256 and c.stages >= 2
        if self.sb_box:  # TMA box of fp32 rows >= 16 bytes, global rows 16-byte aligned
            assert c.block_n % self.wb == 0 and c.block_k // self.wb >= 4 and (self.K // self.wb) % 4 == 0
        else:  # an N slice lies in one weight block, and a K block in one weight block
            assert self.wb % c.block_k == 0 and self.wb % bns == 0
        for ring, size in self.tma_slot_bytes().items():  # every stage's TMA destination 128-byte aligned
            assert size % TMA_SMEM_ALIGN == 0, f"{c.tag}: {ring} slot of {size} bytes misaligns the next stage"
        assert self.smem_bytes() <= SM90_SMEM, f"{c.tag}: {self.smem_bytes()} bytes of shared memory > {SM90_SMEM}"
        assert c.cluster in (1, 2) and c.sms % c.cluster == 0
        assert (self.n_tiles if c.pair_n else self.m_tiles) % c.cluster == 0, f"{c.tag}: tiles do not pair"
        assert not (self.experts and c.cluster > 1 and not c.pair_n), (
            "grouped: M-adjacent tiles may belong to different experts (pair along N: pair_n)"
        )
        regs = c.block_n // 2 + bns // 2 * (2 if c.overlap else 1)  # acc + partial(s) per consumer thread
        assert regs <= 208, f"{c.tag}: {regs} accumulator registers per thread would spill"
        assert not c.pingpong or (c.threads == 256 and not c.overlap), "pingpong: 2 warpgroups, sync units"
        if c.overlap and len(self.units) % 2:
            assert self.k_blocks % 2 == 0, "overlap with one unit per stage pairs K blocks: an even K block count"
        if self.half_tiles:  # each consumer warpgroup takes one N slice of the 64 real rows (_program_sm90_ws)
            assert self.experts and c.block_m == 128 and c.threads == 256 and c.n_split == 2, (
                f"{c.tag}: half tiles need the grouped program, 2 consumer warpgroups and 2 N slices"
            )
            assert not (c.overlap or c.direct_store or c.cluster > 1), f"{c.tag}: half tiles: sync units, smem C"


# audit of generated CUDA (tests): the TMA transfers' shared-memory addresses
_ELEM_BYTES = {"fp8_e4_t": 1, "uchar": 1, "signed char": 1, "half_t": 2, "bfloat16_t": 2, "float": 4, "int": 4}
_SMEM_BASE = re.compile(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);")
_TMA_CALL = re.compile(r"tl::tma_(?:load|store)\w*\((.*)\);")
_SMEM_ARG = re.compile(r"&\(\(\((\w+(?: \w+)?)\*\)(\w+)\)\[([^\]]*)\]\)")


def tma_smem_misalignments(source: str, align: int = TMA_SMEM_ALIGN, values=range(6)) -> list[str]:
    """Every TMA load/store of the generated CUDA whose shared-memory address is not `align`-byte aligned for
    some value of its loop variables (each in `values`): base offset of the dynamic-smem buffer + index x
    element size. The index expressions are C integer arithmetic on non-negative values, evaluated as Python."""
    bases = {name: int(off) for name, off in _SMEM_BASE.findall(source)}
    bad = []
    for call in _TMA_CALL.findall(source):
        for ctype, buf, index in _SMEM_ARG.findall(call):
            assert buf in bases, f"TMA on {buf}, not a dynamic shared-memory buffer"
            expr = index.replace("((int)blockIdx.x)", "bx").replace("((int)threadIdx.x)", "tx").replace("/", "//")
            names = sorted(set(re.findall(r"[A-Za-z_]\w*", expr)))
            for vals in itertools.product(values, repeat=len(names)):
                addr = bases[buf] + eval(expr, {}, dict(zip(names, vals))) * _ELEM_BYTES[ctype]  # noqa: S307
                if addr % align:
                    bad.append(f"{buf}[{index}] at {dict(zip(names, vals))}: byte {addr}")
                    break
    return bad


def tile_coords(t, m_tiles: int, n_tiles: int, raster: int, tmin=min):
    """Persistent tile order: panels of `raster` M tiles; inside a panel M runs fastest, then N.

    132 CTAs then work on about raster x (132 / raster) tiles at a time, so both operands stay in L2.
    `t` is an int (tests) or a TIR expression (pass T.min as `tmin`)."""
    g = max(1, min(raster, m_tiles))
    panel = t // (g * n_tiles)
    first = panel * g
    rows = g if m_tiles % g == 0 else tmin(m_tiles - first, g)  # the last panel may be narrower
    r = t - panel * (g * n_tiles)
    return first + r % rows, r // rows


PP_BAR = 12  # pingpong: named barriers 12 (warpgroup 0's turn) and 13 (warpgroup 1's); TileLang uses low ids
HALF_TILE_FLAG = 1 << 16  # grouped, half_tiles: TileExpert[m] = expert + this flag marks a tile of <= 64 real rows
HALF_ROWS = 64  # rows of a half tile: one consumer warpgroup's share of a 128-row tile


def _program_sm90_ws(M: int, N: int, K: int, *, act_group: int, weight_block: int, cfg: Config, experts: int = 0,
                     half_tiles: bool = False):  # fmt: skip
    """Persistent warp-specialised sm90 program (the DeepGEMM recipe, written in TileLang).

    `sms` CTAs of 128 + `threads` threads. The last warpgroup is the producer (setmaxnreg 40): it walks the
    CTA's tiles in `tile_coords` order and streams A, B and the scales of every K block through a
    `stages`-deep ring of shared-memory slots (TMA into full/empty mbarrier pairs). The consumer warpgroups
    (setmaxnreg 232) own 64 rows x block_n each: per K block they wait for the slot, MMA each (K sub-block,
    N slice) unit into an fp32 partial (wgmma), promote it into the accumulator with sa[row] * sb, and
    release the slot. The producer runs ahead across tile boundaries, so the next tile's first stages load
    while the consumers run the epilogue (bf16 into shared memory, TMA store). `overlap` keeps one wgmma in
    flight while the previous unit is promoted (two partials), also across K blocks.

    experts > 0: the MoE grouped GEMM on the contiguous layout (moe_grouped_gemm.py): B [E, N, K], SB [E, N/wb,
    K/wb] and TileExpert [M/block_m] (before C); M tile mi multiplies expert TileExpert[mi]'s weights, and a
    tile of expert -1 (padding) is skipped by producer and consumers alike. Slots are then counted per tile
    actually run (`done`), not per wave, so the ring's phases stay in step across skipped tiles.

    half_tiles (grouped, 128 x (2 N slices) tiles, issue 8): TileExpert[m] = e + HALF_TILE_FLAG marks a tile whose
    real rows are its first 64 (an expert's last tile with <= 64 pairs; its other rows are layout padding). For
    such a tile the producer loads those 64 rows of A (and their activation scales) into BOTH 64-row halves of the
    stage, and the consumers run such a tile through a pipeline of its own (a branch on the tile's flag around
    whole pipelines): warpgroup wg MMAs only N slice wg -- the slice chosen by the B descriptor's offset, never by a
    branch on the warpgroup: a wgmma under a thread-dependent branch makes ptxas serialise every wgmma of the kernel
    (C7518), which is how the first version of this option lost on the H200 (moe_grouped_gemm.py, "Half tiles") --
    promotes into its first accumulator, and stores it from registers at rows / columns shifted by the warpgroup
    (fragment rows [64 wg, 64 wg + 64) -> the tile's first 64 rows, slice wg). Half the MMA and promotion work of a
    full tile, both warpgroups busy; the tile's padding rows are left unwritten. Every real row goes through the
    same MMAs, scales and promotion order as without the option (same bits). Off: the generated program is the one
    without the option.
    """
    import tilelang.cuda.language as TC
    import tilelang.language as T

    plan = WSPlan(M, N, K, act_group, weight_block, cfg, experts, half_tiles)
    plan.check()
    bM, bN, bK, S = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    ag, wb, sub, ns, bNs = act_group, weight_block, plan.sub, cfg.n_split, plan.bns
    units, n_units = plan.units, len(plan.units)
    unit_ids, slices = list(range(n_units)), list(range(ns))  # Python lists: unrolled at trace time
    # overlap alternates two partials: with an odd unit count per stage, the loop body covers 2 K blocks
    reps = 2 if cfg.overlap and n_units % 2 else 1
    rep_ids = list(range(reps))
    kb, NS, waves, cl = plan.k_blocks, cfg.sms, plan.waves, cfg.cluster
    sa_rows, sb_box, (sb_rows, sb_cols) = plan.sa_rows, plan.sb_box, plan.sb_shape
    kb_a, nb_w, kb_w = ceil_div(K, ag), ceil_div(N, wb), ceil_div(K, wb)
    consumers = cfg.threads
    policy = T.GemmWarpPolicy.FullRow
    fp8 = "float8_e4m3fn"

    def kernel_frame():
        if cl == 1:
            return T.Kernel(NS, threads=consumers + 128)
        return T.ClusterKernel(NS, cluster_dims=cl, threads=consumers + 128)

    def runs(valid, mi, Meta):  # the tile exists and (grouped) has an expert
        return T.And(valid, Meta[T.min(mi, plan.m_tiles - 1)] >= 0) if experts else valid

    def expert(mi, Meta):
        if half_tiles:
            return T.bitwise_and(Meta[T.min(mi, plan.m_tiles - 1)], HALF_TILE_FLAG - 1)
        return Meta[T.min(mi, plan.m_tiles - 1)] if experts else 0

    def is_half(mi, Meta):  # (half_tiles) the tile's real rows are its first HALF_ROWS
        return Meta[T.min(mi, plan.m_tiles - 1)] >= HALF_TILE_FLAG

    HR = HALF_ROWS
    # a unit's MMA without overlap: issued async between the ping-pong turns, else T.gemm (issue and wait)
    unit_mma = TC.wgmma_gemm if cfg.pingpong else T.gemm

    @T.macro
    def wait_turn():  # ping-pong: until the other consumer warpgroup has issued its MMA
        if T.get_thread_binding() // 128 == 0:
            T.sync_threads(PP_BAR, 256)
        else:
            T.sync_threads(PP_BAR + 1, 256)

    @T.macro
    def pass_turn():  # ping-pong: my MMA is issued, the other warpgroup's turn
        if T.get_thread_binding() // 128 == 0:
            T.named_barrier_arrive(PP_BAR + 1, 256)
        else:
            T.named_barrier_arrive(PP_BAR, 256)

    @T.macro
    def body(A, SA, B, SB, Meta, C):
        with kernel_frame() as bid:
            A_s = T.alloc_shared((S, bM, bK), fp8)
            B_s = T.alloc_shared((S, bN, bK), fp8)
            SA_s = T.alloc_shared((S, sa_rows, bM), "float32")
            SB_s = T.alloc_shared((S, plan.sb_slot_rows, sb_cols), "float32")  # padded: aligned slots
            C_s0 = T.alloc_shared((bM, bNs), "bfloat16")  # one output buffer per N slice: stmatrix stores
            C_s1 = T.alloc_shared((bM, bNs), "bfloat16")  # (unused, so not allocated, with direct_store)
            p0 = T.alloc_fragment((bM, bNs), "float32")
            p1 = T.alloc_fragment((bM, bNs), "float32")
            acc0 = T.alloc_fragment((bM, bNs), "float32")
            acc1 = T.alloc_fragment((bM, bNs), "float32")
            sbr = T.alloc_local((1,), "float32")
            full = T.alloc_barrier([128] * S)
            if cl == 1:
                empty = T.alloc_barrier([consumers] * S)
            else:  # released by one lane per consumer warp of every CTA of the cluster
                empty = T.alloc_cluster_barrier([cl * consumers // 32] * S)
            parts, accs, outs = [p0, p1], [acc0, acc1], [C_s0, C_s1]
            done = T.alloc_var("int32")  # grouped: tiles run so far (the ring position is done * kb + k)
            done = 0
            tx = T.get_thread_binding()
            if tx >= consumers:  # producer warpgroup
                T.set_max_nreg(40, 0)
                for w in T.serial(waves):
                    valid, mi, ni = plan.tile_of(w, bid, T.min)
                    if runs(valid, mi, Meta):
                        e = expert(mi, Meta)
                        for k in T.serial(kb):
                            it = (done if experts else w) * kb + k
                            st = it % S
                            if not sb_box:  # one weight scale per N slice: loaded before the wait (latency)
                                for h in slices:
                                    if tx == consumers + h:
                                        if experts:
                                            sbr[0] = SB[(e,) + plan.sb_src(ni, h, k)]
                                        else:
                                            sbr[0] = SB[plan.sb_src(ni, h, k)]
                            T.mbarrier_wait_parity(empty[st], ((it // S) & 1) ^ 1)
                            kk = k * bK
                            if cl > 1 and cfg.pair_n:  # rank 0 multicasts the shared A tile to the pair
                                T.tma_copy(
                                    A[mi * bM : (mi + 1) * bM, kk : kk + bK],
                                    A_s[st, :, :],
                                    barrier=full[st],
                                    cluster_mask=(1 << cl) - 1,
                                )
                            elif half_tiles:  # a half tile's 64 real rows into both halves of the stage
                                if is_half(mi, Meta):  # in boxes of one K sub-block: A_s's layout chunks
                                    for r0, c0 in itertools.product((0, HR), range(0, bK, sub)):
                                        T.tma_copy(A[mi * bM : mi * bM + HR, kk + c0 : kk + c0 + sub],
                                                   A_s[st, r0 : r0 + HR, c0 : c0 + sub], barrier=full[st])  # fmt: skip
                                else:
                                    T.tma_copy(A[mi * bM : (mi + 1) * bM, kk : kk + bK], A_s[st, :, :],
                                               barrier=full[st])  # fmt: skip
                            else:
                                T.tma_copy(A[mi * bM : (mi + 1) * bM, kk : kk + bK], A_s[st, :, :], barrier=full[st])
                            if experts:
                                T.tma_copy(
                                    B[e, ni * bN : (ni + 1) * bN, kk : kk + bK], B_s[st, :, :], barrier=full[st]
                                )
                            elif cl == 1 or cfg.pair_n:
                                T.tma_copy(B[ni * bN : (ni + 1) * bN, kk : kk + bK], B_s[st, :, :], barrier=full[st])
                            else:  # rank 0 multicasts the shared B tile to the whole cluster
                                T.tma_copy(
                                    B[ni * bN : (ni + 1) * bN, kk : kk + bK],
                                    B_s[st, :, :],
                                    barrier=full[st],
                                    cluster_mask=(1 << cl) - 1,
                                )
                            ka = k * bK // ag
                            if half_tiles:  # a half tile: its rows' scales into both halves, one K group at a time
                                if is_half(mi, Meta):
                                    for r in range(sa_rows):
                                        for r0 in (0, HR):
                                            T.tma_copy(SA[ka + r : ka + r + 1, mi * bM : mi * bM + HR],
                                                       SA_s[st, r : r + 1, r0 : r0 + HR], barrier=full[st])  # fmt: skip
                                else:
                                    T.tma_copy(SA[ka : ka + sa_rows, mi * bM : (mi + 1) * bM], SA_s[st, :, :],
                                               barrier=full[st])  # fmt: skip
                            else:
                                T.tma_copy(SA[ka : ka + sa_rows, mi * bM : (mi + 1) * bM], SA_s[st, :, :],
                                           barrier=full[st])  # fmt: skip
                            if sb_box:
                                nw, kw = ni * sb_rows, k * sb_cols
                                if experts:
                                    T.tma_copy(
                                        SB[e, nw : nw + sb_rows, kw : kw + sb_cols],
                                        SB_s[st, 0:sb_rows, :],
                                        barrier=full[st],
                                    )
                                else:
                                    T.tma_copy(
                                        SB[nw : nw + sb_rows, kw : kw + sb_cols],
                                        SB_s[st, 0:sb_rows, :],
                                        barrier=full[st],
                                    )
                            else:  # published to the consumers by the arrive (release semantics)
                                for h in slices:
                                    if tx == consumers + h:
                                        SB_s[st, h, 0] = sbr[0]
                            T.mbarrier_arrive(full[st])
                        if experts:
                            done = done + 1
            else:  # consumer warpgroups
                T.set_max_nreg(232, 1)
                wg = tx // 128
                if cfg.pingpong and wg == 1:  # warpgroup 0 takes the first turn
                    T.named_barrier_arrive(PP_BAR, 256)
                for w in T.serial(waves):
                    valid, mi, ni = plan.tile_of(w, bid, T.min)
                    if T.And(runs(valid, mi, Meta), is_half(mi, Meta)) if half_tiles else False:
                        # a half tile: warpgroup wg MMAs N slice wg of the 64 rows (both halves of A hold them),
                        # chosen by the B descriptor's offset -- not by a branch: a wgmma under a thread-dependent
                        # branch makes ptxas serialise every wgmma of the kernel (C7518) -- into its acc0
                        T.clear(acc0)
                        for k in T.serial(kb):
                            it = done * kb + k
                            st = it % S
                            T.mbarrier_wait_parity(full[st], (it // S) & 1)
                            for s in range(bK // sub):
                                if cfg.pingpong:
                                    wait_turn()
                                unit_mma(A_s[st, :, s * sub : (s + 1) * sub],
                                         B_s[st, wg * bNs : wg * bNs + bNs, s * sub : (s + 1) * sub], p0,
                                         transpose_B=True, clear_accum=True, policy=policy)  # fmt: skip
                                if cfg.pingpong:
                                    pass_turn()
                                    T.wait_wgmma(0)
                                ra = plan.sa_at(s)
                                for i, j in T.Parallel(bM, bNs):
                                    rb, cb = plan.sb_at(wg, j, s)
                                    acc0[i, j] += p0[i, j] * (SA_s[st, ra, i] * SB_s[st, rb, cb])
                            T.mbarrier_arrive(empty[st])
                        # fragment rows [64 wg, 64 wg + 64) of warpgroup wg hold the 64 real rows' slice wg
                        T.copy(acc0, C[mi * bM - wg * HR, ni * bN + wg * bNs])
                        done = done + 1
                    elif runs(valid, mi, Meta):
                        for a in accs[:ns]:
                            T.clear(a)
                        if cfg.overlap:  # the tile's first unit, issued ahead of the K loop
                            it0 = (done if experts else w) * kb
                            T.mbarrier_wait_parity(full[it0 % S], (it0 // S) & 1)
                            TC.wgmma_gemm(
                                A_s[it0 % S, :, 0:sub],
                                B_s[it0 % S, 0:bNs, 0:sub],
                                p0,
                                transpose_B=True,
                                clear_accum=True,
                                policy=policy,
                            )
                        for k2 in T.serial(kb // reps):
                            for rep in rep_ids:
                                k = k2 * reps + rep
                                it = (done if experts else w) * kb + k
                                st = it % S
                                if not cfg.overlap:
                                    T.mbarrier_wait_parity(full[st], (it // S) & 1)
                                for u in unit_ids:
                                    s, h = units[u]
                                    g = rep * n_units + u  # unit count in the loop body: its partial is g % 2
                                    if cfg.overlap:
                                        if u + 1 < n_units:
                                            s1, h1 = units[u + 1]
                                            TC.wgmma_gemm(
                                                A_s[st, :, s1 * sub : (s1 + 1) * sub],
                                                B_s[st, h1 * bNs : (h1 + 1) * bNs, s1 * sub : (s1 + 1) * sub],
                                                parts[(g + 1) % 2],
                                                transpose_B=True,
                                                clear_accum=True,
                                                policy=policy,
                                            )
                                            T.wait_wgmma(1)
                                        elif rep + 1 < reps or k + 1 < kb:  # the next K block's first unit
                                            T.mbarrier_wait_parity(full[(it + 1) % S], ((it + 1) // S) & 1)
                                            TC.wgmma_gemm(
                                                A_s[(it + 1) % S, :, 0:sub],
                                                B_s[(it + 1) % S, 0:bNs, 0:sub],
                                                parts[(g + 1) % 2],
                                                transpose_B=True,
                                                clear_accum=True,
                                                policy=policy,
                                            )
                                            T.wait_wgmma(1)
                                        else:
                                            T.wait_wgmma(0)
                                        part = parts[g % 2]
                                    else:  # ping-pong: wait for my turn, issue, pass the turn, then wait
                                        if cfg.pingpong:
                                            wait_turn()
                                        unit_mma(
                                            A_s[st, :, s * sub : (s + 1) * sub],
                                            B_s[st, h * bNs : (h + 1) * bNs, s * sub : (s + 1) * sub],
                                            p0,
                                            transpose_B=True,
                                            clear_accum=True,
                                            policy=policy,
                                        )
                                        if cfg.pingpong:
                                            pass_turn()
                                            T.wait_wgmma(0)
                                        part = p0
                                    ra = plan.sa_at(s)
                                    for i, j in T.Parallel(bM, bNs):
                                        rb, cb = plan.sb_at(h, j, s)
                                        accs[h][i, j] += part[i, j] * (SA_s[st, ra, i] * SB_s[st, rb, cb])
                                if cl == 1:
                                    T.mbarrier_arrive(empty[st])
                                else:  # lane r of every warp releases the slot in cluster CTA r
                                    T.sync_warp()
                                    if tx % 32 < cl:
                                        T.mbarrier_arrive(empty[st], tx % 32)
                        if cfg.direct_store:  # bf16 pairs straight from the fragments
                            for h in slices:
                                T.copy(accs[h], C[mi * bM, ni * bN + h * bNs])
                        else:
                            for h in slices:
                                T.copy(accs[h], outs[h])
                            for h in slices:
                                T.copy(outs[h], C[mi * bM, ni * bN + h * bNs])
                        if experts:
                            done = done + 1
                if cfg.pingpong and wg == 0:  # takes warpgroup 1's last turn hand-over (balances the barrier)
                    T.sync_threads(PP_BAR, 256)
            if cl > 1:  # no CTA exits while its partner may still multicast to it or arrive on its barriers
                T.cluster_sync()

    if experts:

        @T.prim_func
        def moe_grouped_gemm_sm90_ws(
            A: T.Tensor((M, K), fp8),
            SA: T.Tensor((kb_a, M), "float32"),
            B: T.Tensor((experts, N, K), fp8),
            SB: T.Tensor((experts, nb_w, kb_w), "float32"),
            TileExpert: T.Tensor((M // bM,), "int32"),
            C: T.Tensor((M, N), "bfloat16"),
        ):
            body(A, SA, B, SB, TileExpert, C)

        return moe_grouped_gemm_sm90_ws

    @T.prim_func
    def fp8_gemm_sm90_ws(
        A: T.Tensor((M, K), fp8),
        SA: T.Tensor((kb_a, M), "float32"),
        B: T.Tensor((N, K), fp8),
        SB: T.Tensor((nb_w, kb_w), "float32"),
        C: T.Tensor((M, N), "bfloat16"),
    ):
        body(A, SA, B, SB, None, C)

    return fp8_gemm_sm90_ws


def _program_ws_cpu(M: int, N: int, K: int, *, act_group: int, weight_block: int, cfg: Config, experts: int = 0,
                    half_tiles: bool = False):  # fmt: skip
    """The persistent kernel's schedule on TileLang's `c` target (fp32, numerics only): the same CTA count,
    tile order, per-stage operand and scale slices, units and promotion indices as `_program_sm90_ws`,
    with the producer/consumer hand-off replaced by program order (experts > 0: the grouped variant, with
    the same tile -> expert lookup and skipped padding tiles; half_tiles: a half tile's 64 rows duplicated into both
    halves of the stage, row half r promoted for N slice r only, and stored from there, as on the GPU)."""
    import tilelang.language as T

    plan = WSPlan(M, N, K, act_group, weight_block, cfg, experts, half_tiles)
    plan.check()
    HR = HALF_ROWS
    bM, bN, bK = cfg.block_m, cfg.block_n, cfg.block_k
    ag, wb, sub, bNs = act_group, weight_block, plan.sub, plan.bns
    units, slices = plan.units, list(range(cfg.n_split))
    kb, NS, waves = plan.k_blocks, cfg.sms, plan.waves
    sa_rows, sb_box, (sb_rows, sb_cols) = plan.sa_rows, plan.sb_box, plan.sb_shape
    kb_a, nb_w, kb_w = ceil_div(K, ag), ceil_div(N, wb), ceil_div(K, wb)
    f32 = "float32"

    def runs(valid, mi, Meta):
        return T.And(valid, Meta[T.min(mi, plan.m_tiles - 1)] >= 0) if experts else valid

    def meta(mi, Meta):
        return Meta[T.min(mi, plan.m_tiles - 1)]

    def expert(mi, Meta):
        if not experts:
            return 0
        return T.bitwise_and(meta(mi, Meta), HALF_TILE_FLAG - 1) if half_tiles else meta(mi, Meta)

    def takes(i, h, mi, Meta):  # row i of the tile is promoted for N slice h (half tile: row half i // 64 == h)
        return T.Or(meta(mi, Meta) < HALF_TILE_FLAG, i // HR == h) if half_tiles else True

    @T.macro
    def body(A, SA, B, SB, Meta, C):
        with T.Kernel(NS) as bid:
            A_s = T.alloc_local((bM, bK), f32)
            B_s = T.alloc_local((bN, bK), f32)
            SA_s = T.alloc_local((sa_rows, bM), f32)
            SB_s = T.alloc_local((sb_rows, sb_cols), f32)
            part = T.alloc_local((bM, bNs), f32)
            acc = T.alloc_local((bM, bN), f32)
            for w in T.serial(waves):
                valid, mi, ni = plan.tile_of(w, bid, T.min)
                if runs(valid, mi, Meta):
                    e = expert(mi, Meta)
                    for i, j in T.grid(bM, bN):
                        acc[i, j] = 0.0
                    for k in T.serial(kb):
                        T.copy(A[mi * bM, k * bK], A_s)
                        if half_tiles:  # the GPU producer's two 64-row loads of the same rows
                            if meta(mi, Meta) >= HALF_TILE_FLAG:
                                for i, c in T.grid(HR, bK):
                                    A_s[HR + i, c] = A[mi * bM + i, k * bK + c]
                        if experts:
                            T.copy(B[e, ni * bN : (ni + 1) * bN, k * bK : (k + 1) * bK], B_s)
                        else:
                            T.copy(B[ni * bN, k * bK], B_s)
                        ka = k * bK // ag
                        for r, i in T.grid(sa_rows, bM):
                            SA_s[r, i] = SA[ka + r, mi * bM + i]
                        if half_tiles:
                            if meta(mi, Meta) >= HALF_TILE_FLAG:
                                for r, i in T.grid(sa_rows, HR):
                                    SA_s[r, HR + i] = SA[ka + r, mi * bM + i]
                        if sb_box:
                            for r, c in T.grid(sb_rows, sb_cols):
                                if experts:
                                    SB_s[r, c] = SB[e, ni * sb_rows + r, k * sb_cols + c]
                                else:
                                    SB_s[r, c] = SB[ni * sb_rows + r, k * sb_cols + c]
                        else:
                            for h in slices:
                                if experts:
                                    SB_s[h, 0] = SB[(e,) + plan.sb_src(ni, h, k)]
                                else:
                                    SB_s[h, 0] = SB[plan.sb_src(ni, h, k)]
                        for s, h in units:
                            T.gemm(
                                A_s[:, s * sub : (s + 1) * sub],
                                B_s[h * bNs : (h + 1) * bNs, s * sub : (s + 1) * sub],
                                part,
                                transpose_B=True,
                                clear_accum=True,
                            )
                            ra = plan.sa_at(s)
                            for i, j in T.grid(bM, bNs):
                                rb, cb = plan.sb_at(h, j, s)
                                if takes(i, h, mi, Meta):
                                    acc[i, h * bNs + j] += part[i, j] * (SA_s[ra, i] * SB_s[rb, cb])
                    if half_tiles:  # a half tile: row half h of slice h holds the 64 real rows' slice h
                        if meta(mi, Meta) >= HALF_TILE_FLAG:
                            for h, i, j in T.grid(cfg.n_split, HR, bNs):
                                C[mi * bM + i, ni * bN + h * bNs + j] = acc[h * HR + i, h * bNs + j]
                        else:
                            T.copy(acc, C[mi * bM, ni * bN])
                    else:
                        T.copy(acc, C[mi * bM, ni * bN])

    if experts:

        @T.prim_func
        def moe_grouped_gemm_ws_cpu(
            A: T.Tensor((M, K), f32),
            SA: T.Tensor((kb_a, M), f32),
            B: T.Tensor((experts, N, K), f32),
            SB: T.Tensor((experts, nb_w, kb_w), f32),
            TileExpert: T.Tensor((M // bM,), "int32"),
            C: T.Tensor((M, N), f32),
        ):
            body(A, SA, B, SB, TileExpert, C)

        return moe_grouped_gemm_ws_cpu

    @T.prim_func
    def fp8_gemm_ws_cpu(
        A: T.Tensor((M, K), f32),
        SA: T.Tensor((kb_a, M), f32),
        B: T.Tensor((N, K), f32),
        SB: T.Tensor((nb_w, kb_w), f32),
        C: T.Tensor((M, N), f32),
    ):
        body(A, SA, B, SB, None, C)

    return fp8_gemm_ws_cpu


# ---------------------------------------------------------------------------------------------- reference


def reference(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, act_group: int, weight_block: int
) -> torch.Tensor:
    """Torch reference in the kernel's exact order: per K group, fp32 partial product, then scaled.

    a [M, K] fp8, sa [M, K/ag] (token-major, the natural layout), b [N, K] fp8, sb [N/wb, K/wb].
    """
    M, K = a.shape
    N = b.shape[0]
    step = min(act_group, weight_block)
    out = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    for k0 in range(0, K, step):
        part = a[:, k0 : k0 + step].float() @ b[:, k0 : k0 + step].float().T
        s_a = sa[:, k0 // act_group].unsqueeze(1)
        s_b = sb[:, k0 // weight_block].repeat_interleave(weight_block)[:N].unsqueeze(0)
        out += part * (s_a * s_b)
    return out


def reference_dequant_f64(a, sa, b, sb, act_group: int, weight_block: int) -> torch.Tensor:
    """Independent oracle: dequantise both operands to float64, then one matmul."""
    a64 = a.double() * expand_scales(sa.double(), 1, act_group, a.shape)
    b64 = b.double() * expand_scales(sb.double(), weight_block, weight_block, b.shape)
    return a64 @ b64.T


def make_inputs(M: int, N: int, K: int, act_group: int, weight_block: int, device="cpu", seed=0):
    """Random bf16-ish activations/weights quantised the way the model does it."""
    from deepinfer.codegen.kernels._common import quant_fp8_blocks, quant_fp8_groups

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    a, sa = quant_fp8_groups(x, act_group)
    b, sb = quant_fp8_blocks(w, weight_block)
    return a.to(device), sa.to(device), b.to(device), sb.to(device)


def roofline(M: int, N: int, K: int, act_group: int, weight_block: int) -> tuple[float, float]:
    """(bytes moved, flops) for one call, counting each operand once (the ideal-reuse floor)."""
    bytes_ = (
        M * K
        + N * K
        + 4 * M * ceil_div(K, act_group)
        + 4 * ceil_div(N, weight_block) * ceil_div(K, weight_block)
        + 2 * M * N
    )
    return float(bytes_), 2.0 * M * N * K


# ---------------------------------------------------------------------------------------------- ascend


def ascend_program(M: int, N: int, K: int, *, act_group: int, weight_block: int, cfg: Config, num_cores: int = 32):
    """Ascend 950 variant (AscendC via tilelang.ascend): the same promotion scheme split over the cores.

    The Cube core (AIC) runs the per-tile MMA into L0C; `dual_copy` hands each half of the tile to one of
    the two Vector cores (AIV), which fold it into their accumulator with the scales. Operands are bf16
    here (every e4m3 value is exact in bf16); weight scales come K-major, SBt [K/wb, N/wb], so a tile's
    scales are one contiguous row. Tiles are distributed persistently over `num_cores` blocks.
    """
    import tilelang.ascend.language as T

    bM, bN, bK = cfg.block_m, cfg.block_n, cfg.block_k
    ag, wb = act_group, weight_block
    assert ag % bK == 0 and wb % bK == 0 and bN % wb == 0 and M % bM == 0 and N % bN == 0
    n_tiles = N // bN

    @T.prim_func
    def fp8_gemm_ascend(
        A: T.Tensor((M, K), "bfloat16"),
        SA: T.Tensor((K // ag, M), "float32"),
        B: T.Tensor((N, K), "bfloat16"),
        SBt: T.Tensor((K // wb, N // wb), "float32"),
        C: T.Tensor((M, N), "float32"),
    ):
        with T.Kernel(num_cores) as bx:
            A_l1 = T.alloc_l1((bM, bK), "bfloat16")
            B_l1 = T.alloc_l1((bN, bK), "bfloat16")
            part_l0c = T.alloc_l0c((bM, bN), "float32")
            part = T.alloc_shared((bM // 2, bN), "float32")  # UB: half a tile per vector core
            acc = T.alloc_shared((bM // 2, bN), "float32")
            sa = T.alloc_shared((1, bM // 2), "float32")
            sb = T.alloc_shared((bN // wb,), "float32")
            for tile in T.Persistent([M // bM * n_tiles], num_cores, bx):
                m, n = tile // n_tiles * bM, tile % n_tiles * bN
                with T.SimtVF(threads=128):
                    for i, j in T.Parallel(bM // 2, bN):
                        acc[i, j] = 0.0
                for k in T.Pipelined(K // bK, num_stages=2):
                    T.copy(A[m, k * bK], A_l1)
                    T.copy(B[n, k * bK], B_l1)
                    T.gemm(A_l1, B_l1, part_l0c, transpose_B=True, clear_accum=True)
                    T.dual_copy(part_l0c, part)
                    T.dual_copy(SA[k * bK // ag : k * bK // ag + 1, m : m + bM], sa)
                    T.copy(SBt[k * bK // wb, n // wb : n // wb + bN // wb], sb)
                    with T.SimtVF(threads=128):
                        for i, j in T.Parallel(bM // 2, bN):
                            acc[i, j] += part[i, j] * sa[0, i] * sb[j // wb]
                T.dual_copy(acc, C[m : m + bM, n : n + bN])

    return fp8_gemm_ascend
