"""V4.1 lightning indexer: scores and an exact top-k (MODEL_SPEC §2.9, §2.13), split or fused.

    S(t, j) = scale * ks_j * sum_h w[t, h] * ReLU(q[t, h] . k_j)        32 heads x 128 dims
    visible j < min((pos_t + 1) // ratio, C)                             (ratio 1: j <= t)
    Idx[t]  = top-k of S(t, .) over the visible entries; ties: the LOWER entry index wins (as `topk_entries`)

FP8: q and k may be float8_e4m3 (wgmma into an fp32 accumulator). The per-(token, head) q scale is folded
into w by the caller (ReLU(s x) = s ReLU(x) for s > 0), the per-row k scale is `KS` and multiplies after the
head sum for the same reason; for bf16 inputs pass KS = 1.

FP8 numerics: Hopper's FP8 MMA does not accumulate at fp32 precision. The products (exact: 4 x 4 significand
bits) of one k32 step and the running accumulator are aligned to the largest exponent among them and keep
about FP8_MMA_FRAC_BITS = 13 bits below it (DeepSeek-V3 report §3.3.2: "around 14 bits"); the rest is cut.
`reference_scores_mma` emulates exactly that. On the scores' distribution (q, k ~ 2 N(0, 1) in e4m3, 128 dims,
32 heads) this gives a max error of ~2e-4 of the row maxima -- the 1.5e-4..3e-4 the H200 measured (the same
kernels with bf16 inputs: 3e-7) -- so the fp8 scores are checked against the fp32 reference with
FP8_SCORES_TOL = 1e-3: 3x above that, and >100x below a structural error (one of the 32 heads, one k32 step
or the key scale lost: 0.25..0.5). A top-k of fp8 scores is exact on the kernel's own scores; against fp32
scores the sets may differ only by near-ties (within 2 x FP8_SCORES_TOL of the k-th score).

Split (the default path): `scores_program` is a GEMM-shaped FP8 wgmma kernel that writes the fp32 scores [T, C]
(`index_scores` up to the FP8 MMA accumulation above; ReLU, head weights and head sum in the epilogue),
then `topk_select.program` selects the exact top-k reading every score once (`topk_entries`). Each part is
bound by its own roofline: the scores by max(bytes / HBM BW, flops / FP8 peak), the top-k by the bytes of the
visible scores + the indices.

Fused (kept as a config for comparison), two kernels, and the scores never go to HBM:
1. `score_program`, grid (chunks, T): a CTA scores one query against one chunk of `chunk` entries (K tiles of
   `block_c` rows x 128 through shared memory, one GEMM [block_c, 128] x [128, 32] per tile, ReLU, weighted
   head sum in registers), turns each score into an order-preserving int32 key (`-0.0` folded to `+0.0`;
   invisible entries get INT_MIN) in shared memory, and selects the chunk's exact top-k there.
   Tiles past the causal limit are skipped, so prefill does about half the work.
2. `merge_program`, grid (sets / group, T): `group` candidate sets (k keys each, ascending entry order) -> one
   top-k set; `merge_plan` stacks levels so that one CTA never holds more than MAX_MERGE candidates (decode
   with few queries uses small chunks to fill the GPU, e.g. 64 chunks -> 16 x 4). With one chunk the first
   kernel writes the final answer and there is no merge.
The global top-k is the top-k of the chunk-wise top-k sets because (score desc, index asc) is a strict total
order. Selection (both kernels) is a 32-round radix select on the keys held in shared memory: bit by bit,
the largest threshold u with #(key >= u) >= k is the k-th key; then everything above it plus the first
`need` ties in index order (two prefix sums). The output is the selected SET in ascending entry order
(Idx int32, -1 padding at the end) with its keys; `keys_to_scores` turns keys back into float scores.
"""

import dataclasses
import functools
from dataclasses import dataclass

import torch

from deepinfer.codegen.kernels._common import Mem

FAMILY = "indexer_topk"
FP8_MMA_FRAC_BITS = 13  # bits an FP8 wgmma k-step keeps below its largest addend (H200: see the docstring)
FP8_MMA_K_STEP = 32  # K of one FP8 wgmma instruction
FP8_SCORES_TOL = 1e-3  # max |fp8 scores - fp32 reference| / max |reference| (derivation in the docstring)
INT_MIN = -(2**31)
MAX_MERGE = 8192  # candidates one merge CTA selects from (4 int32 arrays in shared memory: 128 KiB)


@dataclass(frozen=True)
class Config:
    chunk: int = 4096  # entries per scoring CTA (the selection works on this many keys in shared memory)
    block_c: int = 64  # K rows per GEMM tile
    threads: int = 256


def config_space(T_: int, C: int, topk: int = 512) -> list[Config]:
    """Chunks small enough to fill the GPU at decode, large enough (>= 2k) to make the merge cheap."""
    return [
        Config(ch, bc, th)
        for ch in (1024, 2048, 4096, 8192)
        for bc in (64, 128)
        for th in (128, 256)
        if ch >= 2 * topk and C % ch == 0
    ] or [Config(C, 64, 256)]


def default_config(T_: int, C: int, topk: int = 512, target: str = "sm90", sms: int = 132) -> Config:
    """Decode (few queries): the smallest chunk that still gives >= 2k keys per chunk; prefill: big chunks.
    sm100 uses 128-row tiles (tcgen05)."""
    bc = 128 if target == "sm100" else 64
    ok = [ch for ch in (8192, 4096, 2048, 1024) if ch >= 2 * topk and C % ch == 0]
    for ch in ok:
        if T_ * (C // ch) >= sms:  # the biggest chunk that still gives every SM a CTA
            return Config(ch, bc, 256)
    return Config(ok[-1] if ok else C, bc, 256)


def _float_key(f):
    """Order-preserving int32 of an fp32 (+0 and -0 map to the same key)."""
    import tilelang.language as T

    b = T.reinterpret(T.if_then_else(f == 0.0, T.float32(0.0), f), "int32")
    return T.if_then_else(b >= 0, b, T.bitwise_xor(b, 0x7FFFFFFF))


def _make_select(mem: Mem, N: int, k: int):
    """A TileLang macro: exact top-k of keys[0:N] (index order = tie order) into OutIdx/OutKey[row, base:]."""
    import tilelang.language as T

    @T.macro
    def select(keys, ids, flag, rank, ind, cnt, OutIdx, OutKey, row, base):
        thr = T.alloc_var("int64", init=0)  # threshold in the unsigned space u = key + 2^31
        for z, j in mem.par(1, N):
            ind[z, j] = T.if_then_else(keys[j] >= INT_MIN + 1, 1, 0)
        T.reduce_sum(ind, cnt, dim=1)
        keff = T.alloc_var("int32", init=T.min(cnt[0], k))
        for bit in T.serial(32):
            cand = thr + T.shift_left(T.int64(1), T.cast(31 - bit, "int64"))
            for z, j in mem.par(1, N):
                ind[z, j] = T.if_then_else(T.cast(keys[j], "int64") + 2147483648 >= cand, 1, 0)
            T.reduce_sum(ind, cnt, dim=1)
            if cnt[0] >= keff:
                thr = cand
        # the k-th largest key (when keff == 0 it is the top of the range: nothing is taken)
        kth = T.alloc_var("int32", init=T.cast(thr - 2147483648, "int32"))
        for z, j in mem.par(1, N):
            ind[z, j] = T.if_then_else(keys[j] > kth, 1, 0)
        T.reduce_sum(ind, cnt, dim=1)
        need = T.alloc_var("int32", init=keff - cnt[0])  # ties at the threshold still to take, lowest index first
        for j in mem.par(N):
            flag[j] = T.if_then_else(keys[j] == kth, 1, 0)
        if mem.cpu:
            acc = T.alloc_var("int32", init=0)
            for j in T.serial(N):
                rank[j] = acc
                acc = acc + flag[j]
            for j in T.serial(N):
                tie_rank = flag[j] * rank[j] + (1 - flag[j]) * need  # non-ties rank as `need`: not taken
                flag[j] = T.if_then_else(keys[j] > kth, 1, T.if_then_else(tie_rank < need, 1, 0))
            acc = 0
            for j in T.serial(N):
                rank[j] = acc
                acc = acc + flag[j]
        else:
            T.cumsum(src=flag, dst=rank, dim=0)  # inclusive
            for j in mem.par(N):
                tie_rank = flag[j] * (rank[j] - 1) + (1 - flag[j]) * need
                flag[j] = T.if_then_else(keys[j] > kth, 1, T.if_then_else(tie_rank < need, 1, 0))
            T.cumsum(src=flag, dst=rank, dim=0)
            for j in mem.par(N):
                rank[j] = rank[j] - flag[j]
        for j in mem.par(N):
            if flag[j] == 1:
                if keys[j] >= INT_MIN + 1:  # invisible entries (INT_MIN) are never taken
                    OutIdx[row, base + rank[j]] = ids[j]
                    OutKey[row, base + rank[j]] = keys[j]
        for p in mem.par(k):
            if p >= keff:
                OutIdx[row, base + p] = -1
                OutKey[row, base + p] = INT_MIN

    return select


def score_program(T_: int, C: int, *, H: int = 32, di: int = 128, topk: int = 512, ratio: int, scale: float,
                  dtype: str = "bfloat16", target: str, cfg: Config = Config()):  # fmt: skip
    """prim_func(Q [T*H, di], W [T, H] f32, K [C, di], KS [C] f32, Pos [T] int32,
    OutIdx [T, chunks*k] int32, OutKey [T, chunks*k] int32). dtype: bfloat16 | float8_e4m3 (fp32 on `c`)."""
    import tilelang.cuda.language as TC
    import tilelang.language as T

    mem = Mem(target)
    in_dt = "float32" if mem.cpu else dtype
    use_tmem = target == "sm100"  # tcgen05 MMA into tensor memory (UTC*MMA), read back per tile
    ch, bc, k = min(cfg.chunk, C), cfg.block_c, topk
    assert not use_tmem or bc == 128, "tcgen05 tiles are 128 rows"
    assert C % ch == 0 and ch % bc == 0 and k <= ch
    n_chunks, n_sub = C // ch, ch // bc
    select = _make_select(mem, ch, k)

    @T.prim_func
    def indexer_score_topk(
        Q: T.Tensor((T_ * H, di), in_dt),
        W: T.Tensor((T_, H), "float32"),
        K: T.Tensor((C, di), in_dt),
        KS: T.Tensor((C,), "float32"),
        Pos: T.Tensor((T_,), "int32"),
        OutIdx: T.Tensor((T_, n_chunks * k), "int32"),
        OutKey: T.Tensor((T_, n_chunks * k), "int32"),
    ):
        with T.Kernel(n_chunks, T_, threads=cfg.threads) as (c, t):
            q_s = mem.shared((H, di), in_dt)
            k_s = mem.shared((bc, di), in_dt)
            w_s = mem.shared((H,), "float32")
            acc = mem.fragment((bc, H), "float32")
            if use_tmem:
                acc_tm = T.alloc_tmem([bc, H], "float32")
                mbar = T.alloc_barrier(1)
            srow = mem.fragment((bc,), "float32")
            keys = mem.shared((ch,), "int32")
            ids = mem.shared((ch,), "int32")
            flag = mem.shared((ch,), "int32")
            rank = mem.shared((ch,), "int32")
            ind = mem.fragment((1, ch), "int32")
            cnt = mem.fragment((1,), "int32")
            nvis = T.min((Pos[t] + 1) // ratio, C)
            T.copy(Q[t * H, 0], q_s)
            for h in mem.par(H):
                w_s[h] = W[t, h] * scale
            for s in T.serial(n_sub):
                e0 = c * ch + s * bc
                if e0 < nvis:
                    T.copy(K[e0, 0], k_s)
                    if use_tmem:
                        TC.gemm(k_s, q_s, acc_tm, transpose_B=True, clear_accum=True, mbar=mbar)
                        T.copy(acc_tm, acc)
                    else:
                        T.gemm(k_s, q_s, acc, transpose_B=True, clear_accum=True)
                    for j, h in mem.par(bc, H):
                        acc[j, h] = T.max(acc[j, h], 0.0) * w_s[h]
                    T.reduce_sum(acc, srow, dim=1)
                    for j in mem.par(bc):
                        keys[s * bc + j] = T.if_then_else(e0 + j < nvis, _float_key(srow[j] * KS[e0 + j]), INT_MIN)
                        ids[s * bc + j] = e0 + j
                else:
                    for j in mem.par(bc):
                        keys[s * bc + j] = INT_MIN
                        ids[s * bc + j] = e0 + j
            select(keys, ids, flag, rank, ind, cnt, OutIdx, OutKey, t, c * k)

    return indexer_score_topk


# ---------------------------------------------------------------------------------------------- split: scores


@dataclass(frozen=True)
class ScoresConfig:
    block_c: int = 128  # index keys per tile (GEMM M; two m64 wgmma rows)
    block_t: int = 4  # queries per tile: GEMM N = block_t * heads
    inner: int = 4  # key tiles one CTA walks (pipelined K loads; the q tile stays in shared memory)
    threads: int = 256
    stages: int = 2

    @property
    def tag(self) -> str:
        return f"c{self.block_c}t{self.block_t}i{self.inner}w{self.threads}s{self.stages}"


def scores_config(T_: int, C: int, H: int = 32, sms: int = 132) -> ScoresConfig:
    """block_t * H = 256 columns (the wgmma N limit) when there are queries for it; few queries keep narrower
    tiles. `inner` walks several key tiles per CTA while the grid still gives every SM two CTAs or more."""
    bt = 1
    while bt * 2 * H <= 256 and T_ % (bt * 2) == 0:
        bt *= 2
    inner = 8
    while inner > 1 and ((C % (128 * inner)) or (C // (128 * inner)) * (T_ // bt) < 2 * sms):
        inner //= 2
    return ScoresConfig(128, bt, inner, 256, 2)


def scores_program(T_: int, C: int, *, H: int = 32, di: int = 128, ratio: int, scale: float,
                   dtype: str = "float8_e4m3", target: str, cfg: ScoresConfig = ScoresConfig()):  # fmt: skip
    """prim_func(Q [T*H, di], W [T, H] f32, K [C, di], KS [C] f32, Pos [T] int32, S [T, C] f32):
    S(t, j) = scale * KS[j] * sum_h W[t, h] * ReLU(Q[t*H + h] . K[j]) for visible j, -inf past the limit --
    `index_scores` (with KS = 1 and unquantised q, k; FP8 inputs: up to the MMA's reduced-precision
    accumulation, see the module docstring). One GEMM-shaped kernel: a CTA holds block_t queries'
    q tile [block_t * H, di] and walks `inner` key tiles [block_c, di] (T.Pipelined), each one wgmma
    [block_c, di] x [di, block_t * H] into an fp32 accumulator, then ReLU, the per-head weights and the head sum in
    registers (thread-local adds + a 4-lane shuffle) and one fp32 row segment per query out through shared
    memory. Key tiles no query of the CTA can see skip the GEMM (causal prefill: about half the tiles)."""
    import tilelang.language as T

    mem = Mem(target)
    in_dt = "float32" if mem.cpu else dtype
    bc, bt, inner = cfg.block_c, cfg.block_t, cfg.inner
    N = bt * H
    assert T_ % bt == 0 and C % (bc * inner) == 0, (T_, C, cfg)
    NEG = -T.infinity("float32")

    @T.prim_func
    def indexer_scores(
        Q: T.Tensor((T_ * H, di), in_dt),
        W: T.Tensor((T_, H), "float32"),
        K: T.Tensor((C, di), in_dt),
        KS: T.Tensor((C,), "float32"),
        Pos: T.Tensor((T_,), "int32"),
        S: T.Tensor((T_, C), "float32"),
    ):
        with T.Kernel(C // (bc * inner), T_ // bt, threads=cfg.threads) as (cb, tb):
            q_s = mem.shared((N, di), in_dt)
            k_s = mem.shared((bc, di), in_dt)
            w_s = mem.shared((N,), "float32")
            nv = mem.shared((bt,), "int32")
            acc = mem.fragment((bc, N), "float32")
            acc3 = mem.fragment((bc, bt, H), "float32")
            sc = mem.fragment((bc, bt), "float32")
            o_s = mem.shared((bt, bc), "float32")
            T.copy(Q[tb * N, 0], q_s)
            for i in mem.par(N):
                w_s[i] = W[tb * bt + i // H, i % H] * scale
            for b in mem.par(bt):
                nv[b] = T.min((Pos[tb * bt + b] + 1) // ratio, C)
            vmax = T.alloc_var("int32", init=0)  # the CTA's furthest visible entry
            for b in T.serial(bt):
                vmax = T.max(vmax, T.min((Pos[tb * bt + b] + 1) // ratio, C))
            # key tiles some query of the CTA sees go through the GEMM; the rest are only -inf
            n_vis = T.alloc_var("int32", init=T.max(T.min(T.ceildiv(vmax - cb * inner * bc, bc), inner), 0))
            for it in T.Pipelined(n_vis, num_stages=cfg.stages):
                T.copy(K[(cb * inner + it) * bc, 0], k_s)
                T.gemm(k_s, q_s, acc, transpose_B=True, clear_accum=True)
                for j, b, h in mem.par(bc, bt, H):
                    acc3[j, b, h] = T.max(acc[j, b * H + h], 0.0) * w_s[b * H + h]
                T.reduce_sum(acc3, sc, dim=2)
                for j, b in mem.par(bc, bt):
                    e = (cb * inner + it) * bc + j
                    o_s[b, j] = T.if_then_else(e < nv[b], sc[j, b] * KS[e], NEG)
                T.copy(o_s, S[tb * bt, (cb * inner + it) * bc])
            for it in T.serial(inner):
                if it >= n_vis:
                    for b, j in mem.par(bt, bc):
                        S[tb * bt + b, (cb * inner + it) * bc + j] = NEG

    return indexer_scores


def scores_roofline(T_: int, C: int, *, H: int = 32, di: int = 128, elem_bytes: int = 1,
                    visible: float | None = None) -> tuple[float, float]:  # fmt: skip
    """(bytes, flops) of `scores_program`: keys (+ their scale) and q, w read once, the fp32 scores written
    once; 2*H*di flops (+ the ReLU/weight/head-sum epilogue) per visible (query, entry)."""
    vis = T_ * C if visible is None else visible
    bytes_ = C * (di * elem_bytes + 4) + T_ * (H * di * elem_bytes + 4 * H + 4) + 4 * T_ * C
    return float(bytes_), float(vis * (2 * H * di + 3 * H))


def visible_entries(positions, ratio: int, C: int) -> float:
    """Sum over the queries of the entries each one sees (the work a causal prefill really has)."""
    return float(sum(min((int(p) + 1) // ratio, C) for p in positions))


def merge_plan(n_chunks: int, topk: int = 512, max_merge: int = MAX_MERGE) -> list[int]:
    """Group sizes of the merge levels: level i merges groups of g_i candidate sets (g_i * k <= max_merge);
    the product of the groups is n_chunks. [] when there is one chunk (its top-k is final)."""
    cap = max(2, max_merge // topk)
    plan, n = [], n_chunks
    while n > 1:
        divisors = [d for d in range(2, min(cap, n) + 1) if n % d == 0]
        g = max(divisors) if divisors else n  # (a prime above the cap cannot be split: merge_program refuses it)
        plan.append(g)
        n //= g
    return plan


def merge_program(T_: int, n_chunks: int, *, topk: int = 512, group: int | None = None, target: str,
                  threads: int = 256):  # fmt: skip
    """prim_func(CandIdx [T, chunks*k] int32, CandKey [T, chunks*k] int32, Idx [T, chunks/group*k] int32,
    Key [T, chunks/group*k] int32), grid (chunks/group, T): each CTA merges `group` candidate sets (default:
    all of them, the last level) into one top-k set, still in ascending entry order."""
    import tilelang.language as T

    mem = Mem(target)
    k = topk
    group = group or n_chunks
    assert n_chunks % group == 0
    n_out, N = n_chunks // group, group * k
    assert N <= MAX_MERGE, f"{group} sets x top-{k}: more than {MAX_MERGE} candidates (use merge_plan)"
    select = _make_select(mem, N, k)

    @T.prim_func
    def indexer_topk_merge(
        CandIdx: T.Tensor((T_, n_chunks * k), "int32"),
        CandKey: T.Tensor((T_, n_chunks * k), "int32"),
        Idx: T.Tensor((T_, n_out * k), "int32"),
        Key: T.Tensor((T_, n_out * k), "int32"),
    ):
        with T.Kernel(n_out, T_, threads=threads) as (g, t):
            keys = mem.shared((N,), "int32")
            ids = mem.shared((N,), "int32")
            flag = mem.shared((N,), "int32")
            rank = mem.shared((N,), "int32")
            ind = mem.fragment((1, N), "int32")
            cnt = mem.fragment((1,), "int32")
            for j in mem.par(N):
                keys[j] = CandKey[t, g * N + j]
                ids[j] = CandIdx[t, g * N + j]
            select(keys, ids, flag, rank, ind, cnt, Idx, Key, t, g * k)

    return indexer_topk_merge


# ---------------------------------------------------------------------------------------------- host side


def keys_to_scores(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of the kernel's key map: int32 keys -> fp32 scores (INT_MIN padding -> -inf)."""
    k = keys.to(torch.int32)
    bits = torch.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return torch.where(k == INT_MIN, torch.tensor(float("-inf")), bits.view(torch.float32))


def reference_scores(q, w, keys, kscale, positions, *, ratio: int, scale: float) -> torch.Tensor:
    """fp32 [T, C]: scale * ks_j * sum_h w_h ReLU(q_h . k_j); -inf where not visible."""
    s = torch.relu(torch.einsum("thd,cd->thc", q.float(), keys.float()))
    s = (s * w.float().unsqueeze(-1)).sum(1) * kscale.float() * scale
    vis = torch.arange(keys.shape[0], device=keys.device) < ((positions.long() + 1) // ratio).unsqueeze(-1)
    return s.masked_fill(~vis, float("-inf"))


def _mma_dots(q: torch.Tensor, keys: torch.Tensor, frac_bits: int, k_step: int) -> torch.Tensor:
    """[T, H, C] dots q . k as the FP8 MMA forms them: per k-step, the exact products and the accumulator
    aligned to the largest of their exponents, each cut (toward zero) to `frac_bits` bits below it, then
    summed exactly (float64 holds every partial sum)."""
    qd, kd = q.double(), keys.double()
    acc = torch.zeros(q.shape[0], q.shape[1], keys.shape[0], dtype=torch.float64, device=q.device)
    for d0 in range(0, q.shape[-1], k_step):
        prod = qd[..., None, d0 : d0 + k_step] * kd[None, None, :, d0 : d0 + k_step]  # [T, H, C, step]
        top = torch.maximum(prod.abs().amax(-1), acc.abs()).clamp_min(1e-300)
        ulp = torch.exp2(torch.floor(torch.log2(top)) - frac_bits)
        acc = (torch.trunc(acc / ulp) + torch.trunc(prod / ulp[..., None]).sum(-1)) * ulp
    return acc


def reference_scores_mma(q, w, keys, kscale, positions, *, ratio: int, scale: float,
                         frac_bits: int = FP8_MMA_FRAC_BITS, k_step: int = FP8_MMA_K_STEP,
                         block: int = 512) -> torch.Tensor:  # fmt: skip
    """`reference_scores` with the dots accumulated as the FP8 MMA does (reduced-precision alignment; see the
    module docstring); the fp32 epilogue as the kernel's. Keys in blocks of `block` to bound the memory."""
    d = torch.cat([_mma_dots(q.float(), keys[c0 : c0 + block].float(), frac_bits, k_step).float()
                   for c0 in range(0, keys.shape[0], block)], dim=-1)  # fmt: skip
    s = (torch.relu(d) * w.float().unsqueeze(-1)).sum(1) * kscale.float() * scale
    vis = torch.arange(keys.shape[0], device=keys.device) < ((positions.long() + 1) // ratio).unsqueeze(-1)
    return s.masked_fill(~vis, float("-inf"))


def reference(q, w, keys, kscale, positions, *, ratio: int, scale: float, topk: int) -> torch.Tensor:
    """Torch reference in the kernel's output convention: the top-k SET (ties to the lower index, -inf never
    picked) in ascending entry order, int64 [T, k], -1 padding at the end."""
    s = reference_scores(q, w, keys, kscale, positions, ratio=ratio, scale=scale)
    kk = min(topk, s.shape[1])
    idx = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :kk]
    ok = torch.gather(s, 1, idx) > float("-inf")
    idx = torch.where(ok, idx, torch.full_like(idx, s.shape[1]))
    idx = idx.sort(-1).values
    idx = torch.where(idx == s.shape[1], -1, idx)
    return torch.nn.functional.pad(idx, (0, topk - kk), value=-1)


def reference_f64(q, w, keys, kscale, positions, *, ratio: int, scale: float, topk: int) -> torch.Tensor:
    """Independent float64 oracle: per query, Python sort on (-score, index) over the visible entries."""
    qd, kd = q.double(), keys.double()
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64)
    for t in range(q.shape[0]):
        nvis = min((int(positions[t]) + 1) // ratio, keys.shape[0])
        dots = (kd[:nvis] @ qd[t].T).clamp(min=0)  # [nvis, H]
        sc = (dots @ w[t].double()) * kscale[:nvis].double() * scale
        order = sorted(range(nvis), key=lambda j: (-float(sc[j]), j))[:topk]
        out[t, : len(order)] = torch.tensor(sorted(order), dtype=torch.int64)
    return out


def roofline(T_: int, C: int, *, H: int = 32, di: int = 128, topk: int = 512, ratio: int = 2, elem_bytes: int = 1,
             causal: bool = False) -> tuple[float, float]:  # fmt: skip
    """(bytes, flops). Keys (plus their fp32 scale) are read once per call -- concurrent queries share them
    through L2 -- q and w once per query, the top-k written once. Flops: 2*H*di per visible (query, entry),
    half the square for a causal prefill over its own entries (`causal`); decode queries see all C."""
    vis = T_ * C / 2 if causal else T_ * C
    bytes_ = C * (di * elem_bytes + 4) + T_ * (H * di * elem_bytes + 4 * H + 4) + 8 * T_ * topk
    return float(bytes_), float(vis * (2 * H * di + 3 * H))


# ---------------------------------------------------------------------------------------------- f32 decode scores
# The graph's index keys and queries are fp32 (the compressor writes them unquantised), and `index_scores` is an
# fp32 op: the FP8/bf16 kernels above would change its numbers by ~1e-3 of a row's maximum. At decode the op is
# small (T x C x 32 heads x 128: ~2 GFLOP at T 64, C 4096) but its torch reference writes [T, 32, C] fp32
# temporaries several times (~0.08-0.15 ms per layer on the H200). `triton_scores` is one launch with the torch
# reference's numbers up to the order of the sums: the dots of 64 keys with every head of 4 queries as ONE
# [64, 128] x [128, 128] product on the tensor cores (three TF32 products, input_precision "tf32x3": hi*hi +
# hi*lo + lo*hi, ~fp32 accuracy), ReLU, scale and the head weights, the head sum per query in registers, the
# causal mask, one fp32 write of S. (A first form looped over the 32 heads with one small dot each: 65 us at
# T64 C2080 on the H200, latency-bound.) The batched decode graph's `batched_index_scores` (B sequences, each query
# against its own C keys, rows b*C.. of a [B*C, di] pool) is the same tile with one query a CTA
# (`triton_batched_scores`): its reference bmm writes [B, 32, C] temporaries (0.955 ms at B16, 4k context).


# Decode caches are sized for max_model_len, so C (columns of S, keys a sequence may have) is max_model_len / ratio
# whatever a sequence's length; a CTA per key tile of C (`ctas_per_sm` 0, the first form) launches C / block_c
# CTAs per query block at every step, most of them past the visible limit (they read no key and compute nothing,
# but each is a CTA and writes its -inf tile). Two balanced forms (`ctas_per_sm` n > 0) launch about n x SMs CTAs
# (a grid fixed by the shapes: CUDA graphs replay it) that find the live key tiles (those below a query block's
# furthest visible entry) on the device from the positions:
# * the work-list form: one list of every query block's live tiles (a cumsum), shared by all the CTAs in strides;
# * the per-row form (`per_row`): grid (min(tiles, n x SMs / blocks), blocks), each CTA walking its query block's
#   live tiles in strides -- at a 4k context and 64 sequences that is the first form's grid (one tile a CTA) for a
#   4k cache, while a 64k cache adds fill-only CTAs instead of 16x the CTAs.
# Then -- `fill`, the op's definition: -inf wherever j >= (p+1)//ratio -- the columns past the live tiles in
# blocks of `fill_block`. Without `fill` they are not written at all: only for a consumer that reads S up to the
# positions' limit (topk_select with positions; the runtime's topk_entries has none yet, so adapters keep fill).
# H200, session 8 call 2, 4k context, us for max_model_len 4096 -> 65536 (ratio 2) / 65536 (ratio 1), the
# work-list form before its register cap (2 CTAs an SM): B64 first form 50.0 -> 101.2 / 156.1, work list (8 CTAs
# an SM) 82.3 -> 84.6 / 144.7, without fill 75.8 -> 76.2 / 126.6: flat in max_model_len, but its live work is
# 1.6x the first form's at a 4k cache (a CTA walking several tiles one after another keeps fewer key loads in
# flight than 3 CTAs an SM of one tile each), so it loses at max_model_len 4096 and wins at 65536. B1: ~10-11 us
# in every form (flat already: 512 idle CTAs cost ~0.5 us). The per-row form and the 168-register cap are
# unmeasured; DECODE_CTAS_PER_SM stays 0 (the first form) until a run shows a form matching the first at 4096.
# Registers (ptxas, sm_90a, 4 warps, one query a CTA): a 3xTF32 product of the whole [64, 128] key tile holds its
# hi and lo parts in registers; straight-line (first form) that fits (170), inside a balanced form's item loop it
# takes 255 and spills; `k_split` 32 (four accumulating products of 32 dims) brings the loop to 178-190, no spills.
# It changes the order of the sums (not the accuracy); tile and loop are the same code in all forms, so at equal
# k_split they give the same bits. decode_form caps the loop at 168 registers (still no spills): 3 CTAs an SM,
# not 2. 4 queries a CTA (the one-sequence tile) spill in the loop at any k_split: the balanced one-sequence
# decode (T = 1) takes one query a CTA. (The dims' offsets get a loop-variant zero added: hoisted out of the loop,
# their [64, DK] broadcast would stay in registers across it.)


@dataclass(frozen=True)
class F32ScoresConfig:
    block_c: int = 64  # index keys per CTA (the dot's M: one wgmma tile of rows)
    block_t: int = 4  # queries per CTA: the dot's N is block_t x heads (all heads of a query in ONE dot)
    warps: int = 4
    precision: str = "tf32x3"  # "tf32x3" (~fp32) | "tf32" (one TF32 product: ~1e-3 relative) | "ieee" (FMA)
    maxnreg: int = 0  # a register cap (0: none); 128 lets 4 CTAs of 4 warps share an SM, not 3 (batched first form)
    ctas_per_sm: int = 0  # 0: one CTA per key tile of C; n > 0: a balanced form, ~n x SMs CTAs (see above)
    fill_block: int = 1024  # balanced form: columns of -inf one fill work item writes (a power of two)
    k_split: int = 0  # dims per tensor-core product (0: all di in one); see below
    stages: int = 1  # balanced form: software-pipeline stages of the work-item loop (1: none)
    per_row: bool = False  # with ctas_per_sm: the per-row form (see above) instead of one work list for the step


DECODE_CTAS_PER_SM = 0  # > 0: decode (one query, or B sequences) takes a balanced form, this many CTAs an SM
DECODE_PER_ROW = True  # which: the per-row form (unmeasured) -- the work-list form lost to the first (call 2)


def decode_form(cfg: F32ScoresConfig, ctas_per_sm: int | None = None, per_row: bool | None = None) -> F32ScoresConfig:
    """cfg as a balanced form (one query a CTA, k_split 32, 168 registers: see above) when DECODE_CTAS_PER_SM (or
    ctas_per_sm) is set, else cfg. The one-sequence step (T 1) and every batch take the same tile, so a sequence's
    scores are the same bits alone and in a batch."""
    n = DECODE_CTAS_PER_SM if ctas_per_sm is None else ctas_per_sm
    row = DECODE_PER_ROW if per_row is None else per_row
    return dataclasses.replace(cfg, block_t=1, ctas_per_sm=n, k_split=32, maxnreg=168, per_row=row) if n else cfg


# A cache of at least DECODE_LONG_C columns (0: none) takes the per-row form with DECODE_LONG_CTAS CTAs an SM when
# DECODE_CTAS_PER_SM is 0 -- the first form's cost follows the cache, the per-row form's the sequence. H200, session
# 9 call 2, B64 4k context, scores + top-k through the adapters, first form -> row16 without fill: mml 4096 r1 135.9
# -> 144.5 us (slower), mml 65536 r2 177.4 -> 130.9, r1 242.9 -> 170.6 (call 3, r1: scores alone 157.5 -> 87.1 us,
# step 202.8 -> 132.6). On at 16384 columns (max_model_len 16384 at ratio 1, 32768 at ratio 2); the runtime's
# first-call check reads a fill False output through kernel_adapters.scores_check_view (9409e8c).
DECODE_LONG_C = 16384
DECODE_LONG_CTAS = 16


def decode_config(cfg: F32ScoresConfig, C: int) -> F32ScoresConfig:
    """A decode step's form for a cache of C columns: decode_form, or the long-cache per-row form (above)."""
    if DECODE_LONG_C and C >= DECODE_LONG_C and not DECODE_CTAS_PER_SM:
        return decode_form(cfg, DECODE_LONG_CTAS, per_row=True)
    return decode_form(cfg)


def f32_scores_config(T_: int, C: int, H: int = 32) -> F32ScoresConfig:
    """block_t x H = 128 columns per dot (4 queries at 32 heads); fewer heads: more queries per CTA. One query
    (the one-sequence decode step): decode_config."""
    cfg = F32ScoresConfig(block_t=max(1, 128 // H))
    return decode_config(cfg, C) if T_ == 1 else cfg


def f32_batched_scores_config(B: int, C: int, H: int = 32) -> F32ScoresConfig:
    """Every query reads its own keys (batched_index_scores), so a CTA takes one query (the dot's N = H): queries
    sharing a CTA would share no key tile. decode_config."""
    return decode_config(F32ScoresConfig(block_t=1), C)


@functools.lru_cache(maxsize=2)
def _f32_scores_kernel(interpret: bool):
    """Built lazily, once per interpreter mode (triton fixes it at decoration time). One kernel for both forms
    (BALANCED a constexpr): the key tile's code is shared, so both give the same bits on the visible columns."""
    import triton
    import triton.language as tl

    @triton.jit
    def f32_scores_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, s_ptr, T, C, scale, ratio, H: tl.constexpr,
                          DI: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                          OWN_KEYS: tl.constexpr, BALANCED: tl.constexpr = False, RBP: tl.constexpr = 1,
                          FILL: tl.constexpr = True, FB: tl.constexpr = 1024,
                          STAGES: tl.constexpr = 1, DK: tl.constexpr = 0,
                          PER_ROW: tl.constexpr = False):  # fmt: skip
        j = tl.arange(0, BT * H)  # the CTA's (query, head) columns, query-major as q [T, H, DI] is stored
        if BALANCED:  # work items: the live key tiles of every query block, in block order
            pid, nprog = tl.program_id(0), tl.num_programs(0)
            r = tl.arange(0, RBP)  # query blocks (RBP: their count rounded up to a power of two)
            rows = r[:, None] * BT + tl.arange(0, BT)[None, :]
            p = tl.load(pos_ptr + rows, mask=rows < T, other=-1).to(tl.int32)
            seen = tl.minimum(tl.max((p + 1) // ratio, axis=1), C)  # the furthest entry a query block sees
            live = (seen + BC - 1) // BC
            live_end = tl.cumsum(live, axis=0)
            lo, hi, step = pid, tl.sum(live, axis=0), nprog
        elif PER_ROW:  # query block program_id(1)'s live key tiles, strided over the CTAs of its grid row
            tq = tl.program_id(1) * BT + tl.arange(0, BT)
            pq = tl.load(pos_ptr + tq, mask=tq < T, other=-1).to(tl.int32)
            live_row = (tl.minimum(tl.max((pq + 1) // ratio, axis=0), C) + BC - 1) // BC
            lo, hi, step = tl.program_id(0), live_row, tl.num_programs(0)
        else:  # one CTA per (key tile, query block): this CTA's only item
            lo, hi, step = 0, 1, 1
        for wi in tl.range(lo, hi, step, num_stages=STAGES):
            if BALANCED:
                rb = tl.sum((live_end <= wi).to(tl.int32), axis=0)  # the item's query block
                cb = wi - tl.sum(tl.where(r == rb, live_end - live, 0), axis=0)  # its key tile in the block's row
            elif PER_ROW:
                rb, cb = tl.program_id(1), wi
            else:
                rb, cb = tl.program_id(1), tl.program_id(0)
            c = cb * BC + tl.arange(0, BC)
            t0 = rb * BT
            t = t0 + tl.arange(0, BT)
            cm, tm, jm = c < C, t < T, t0 + j // H < T
            nvis = (tl.load(pos_ptr + t, mask=tm, other=-1).to(tl.int32) + 1) // ratio  # entries query t sees
            acc = tl.zeros((BC, BT), dtype=tl.float32)
            if cb * BC < tl.max(nvis, axis=0):  # a key block no query sees is only -inf
                if OWN_KEYS:  # batched_index_scores (BT 1): query t0's keys are rows t0*C.. (64-bit: B*C*DI > 2^31)
                    krow = t0.to(tl.int64) * C + c
                else:  # index_scores: every query scores the same C keys
                    krow = c
                # [BC, BT*H]: every head of BT queries at once, DK of the DI dims a product (see k_split)
                dots = tl.zeros((BC, BT * H), dtype=tl.float32)
                for h0 in tl.static_range(0, DI, DK):
                    dk = h0 + tl.arange(0, DK) + (cb >> 31)  # (loop-variant zero: see k_split)
                    k = tl.load(k_ptr + krow[:, None] * DI + dk[None, :], mask=cm[:, None], other=0.0)  # [BC, DK]
                    q = tl.load(q_ptr + (t0 * H + j)[:, None] * DI + dk[None, :], mask=jm[:, None], other=0.0)
                    dots = tl.dot(k, tl.trans(q), dots, input_precision=PREC)
                w = tl.load(w_ptr + t0 * H + j, mask=jm, other=0.0)
                v = (tl.maximum(dots, 0.0) * scale) * w[None, :]
                acc = tl.sum(tl.reshape(v, (BC, BT, H)), axis=2)  # the head sum per query
            s = tl.where(c[:, None] < nvis[None, :], acc, float("-inf"))
            tl.store(s_ptr + t.to(tl.int64)[None, :] * C + c[:, None], s, mask=cm[:, None] & tm[None, :])
        if BALANCED:
            if FILL:  # then -inf past every query block's live tiles, FB columns an item
                dead0 = live * BC  # a block's first column past its live tiles
                nfill = tl.where(r * BT < T, (tl.maximum(C - dead0, 0) + FB - 1) // FB, 0)
                fill_end = tl.cumsum(nfill, axis=0)
                for wi in tl.range(pid, tl.sum(nfill, axis=0), nprog, num_stages=1):
                    rb = tl.sum((fill_end <= wi).to(tl.int32), axis=0)
                    c0 = tl.sum(tl.where(r == rb, dead0 + (wi - fill_end + nfill) * FB, 0), axis=0)
                    cols = c0 + tl.arange(0, FB)
                    t = rb * BT + tl.arange(0, BT)
                    tl.store(s_ptr + t.to(tl.int64)[:, None] * C + cols[None, :],
                             tl.full((BT, FB), float("-inf"), tl.float32),
                             mask=(t < T)[:, None] & (cols < C)[None, :])  # fmt: skip
        elif PER_ROW:
            if FILL:  # then -inf past the block's live tiles, FB columns a CTA in turn
                tq = tl.program_id(1) * BT + tl.arange(0, BT)
                for f in tl.range(live_row * BC + tl.program_id(0) * FB, C, tl.num_programs(0) * FB, num_stages=1):
                    cols = f + tl.arange(0, FB)
                    tl.store(s_ptr + tq.to(tl.int64)[:, None] * C + cols[None, :],
                             tl.full((BT, FB), float("-inf"), tl.float32),
                             mask=(tq < T)[:, None] & (cols < C)[None, :])  # fmt: skip

    return f32_scores_kernel


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    """The GPU's SM count (the balanced form's grid); 132 (an H200) for CPU tensors under the interpreter."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def f32_scores_grid(rows: int, C: int, block_t: int, cfg: F32ScoresConfig, sms: int = 132) -> tuple[int, ...]:
    """The launch grid: (key tiles, query blocks), or the balanced form's (ctas,) -- never more CTAs than the
    tiles of a step whose every column is visible."""
    blocks, tiles = -(-rows // block_t), -(-C // cfg.block_c)
    if cfg.ctas_per_sm and cfg.per_row:  # (CTAs a query block, query blocks)
        return (max(1, min(tiles, -(-cfg.ctas_per_sm * sms // blocks))), blocks)
    if cfg.ctas_per_sm:
        return (max(1, min(cfg.ctas_per_sm * sms, blocks * tiles)),)
    return (tiles, blocks)


def _launch_f32_scores(q, w, keys, positions, s, *, rows: int, C: int, block_t: int, own_keys: bool, ratio: int,
                       scale: float, cfg: F32ScoresConfig, fill: bool):  # fmt: skip
    """One launch of the f32 scores kernel (either form) writing S [rows, C]."""
    grid = f32_scores_grid(rows, C, block_t, cfg, _sm_count(q.device))
    form = {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}
    if cfg.ctas_per_sm:
        assert cfg.fill_block & (cfg.fill_block - 1) == 0, cfg
        blocks_p2 = 1 << max(0, -(-rows // block_t) - 1).bit_length()
        form |= dict(BALANCED=not cfg.per_row, PER_ROW=cfg.per_row, RBP=1 if cfg.per_row else blocks_p2,
                     FILL=bool(fill), FB=cfg.fill_block, STAGES=cfg.stages)  # fmt: skip
    _f32_scores_kernel(_interpreted())[grid](
        q.float().contiguous(), w.float().contiguous(), keys.float().contiguous(), positions.contiguous(), s,
        rows, C, float(scale), int(ratio), H=q.shape[1], DI=q.shape[2], BC=cfg.block_c, BT=block_t,
        PREC=cfg.precision, OWN_KEYS=own_keys, DK=cfg.k_split or q.shape[2], num_warps=cfg.warps, **form)  # fmt: skip


def _scores_out(out: torch.Tensor | None, rows: int, C: int, device) -> torch.Tensor:
    if out is None:
        return torch.empty(rows, C, dtype=torch.float32, device=device)
    assert out.shape == (rows, C) and out.dtype == torch.float32 and out.is_contiguous(), (out.shape, out.dtype)
    return out


def triton_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, *, ratio: int,
                  scale: float, cfg: F32ScoresConfig | None = None, fill: bool = True,
                  out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`index_scores` (q [T, H, di] f32, w [T, H], keys [C, di], positions [T]) -> S [T, C] f32 in one launch.
    Under the CPU interpreter (TRITON_INTERPRET=1) the dots are plain fp32 products. fill=False (balanced form
    only): the columns past a query block's live key tiles are left unwritten (see the section's comment).
    out: a contiguous f32 [T, C] to write S into (else a new one)."""
    t, h, di = q.shape
    c = keys.shape[0]
    cfg = cfg or f32_scores_config(t, c, h)
    s = _scores_out(out, t, c, q.device)
    if t and c:
        _launch_f32_scores(q, w, keys, positions, s, rows=t, C=c, block_t=cfg.block_t, own_keys=False,
                           ratio=ratio, scale=scale, cfg=cfg, fill=fill)  # fmt: skip
    return s


def triton_batched_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, *,
                          ratio: int, scale: float, cfg: F32ScoresConfig | None = None,
                          fill: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`batched_index_scores` (q [B, H, di] f32, w [B, H], keys [B*C, di]: sequence b's keys are rows b*C..,
    positions [B]) -> S [B, C] f32 in one launch; -inf where j >= (p_b+1)//ratio. cfg.block_t is ignored (one
    query a CTA: no two queries share keys). fill, out: as triton_scores'."""
    b, h, di = q.shape
    assert b == 0 or keys.shape[0] % b == 0, f"keys {tuple(keys.shape)} is not B*C rows (B={b})"
    c = keys.shape[0] // b if b else 0
    cfg = cfg or f32_batched_scores_config(b, c, h)
    s = _scores_out(out, b, c, q.device)
    if b and c:
        _launch_f32_scores(q, w, keys, positions, s, rows=b, C=c, block_t=1, own_keys=True, ratio=ratio,
                           scale=scale, cfg=cfg, fill=fill)  # fmt: skip
    return s


def f32_scores_roofline(T_: int, C: int, *, H: int = 32, di: int = 128) -> tuple[float, float]:
    """(bytes, flops) of `triton_scores`: keys, q and w read once (fp32), S written once; 2*H*di per pair."""
    return float(4 * C * di + 4 * T_ * (H * di + H + 1) + 4 * T_ * C), float(T_ * C * (2 * H * di + 3 * H))


def f32_batched_scores_roofline(B: int, C: int, *, H: int = 32, di: int = 128) -> tuple[float, float]:
    """(bytes, flops) of `triton_batched_scores`: every sequence's keys read once (no two queries share them), q and
    w once, S written once; 2*H*di per (sequence, entry)."""
    return float(4 * B * C * di + 4 * B * (H * di + H + 1) + 4 * B * C), float(B * C * (2 * H * di + 3 * H))


# ---------------------------------------------------------------------------------------------- top-k set -> op order
# topk_select returns the top-k SET in ascending column order; `topk_entries` lists it by score (descending, ties to
# the lower column). The runtime put it in that order with torch (the picked scores gathered, a stable sort of
# [T, k], a gather of the ids: ~10 small launches, 50 us at B64 on the H200). `triton_set_order` is one launch, a row
# per CTA: each member's 64-bit key -- the score's order-preserving int32 bits, inverted (descending), above its
# column (ties: the lower column first; -0.0 folded to +0.0 as torch compares them; no member: last) -- sorted in
# registers (tl.sort, bitonic), the columns read back from the sorted keys. Exactly the stable sort's order. `cols`
# (optional) maps the set's ids to score columns (the two-level top-k selects among gathered candidate columns).
# H200 call 3: a first form (each member's rank by k x k compares, 16 dependent gathers in a row) took 19.4 us at
# B64 k512.

@functools.lru_cache(maxsize=2)
def _set_order_kernel(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def set_order_kernel(s_ptr, s_stride, idx_ptr, idx_stride, cols_ptr, cols_stride, out_ptr, K: tl.constexpr,
                         KP: tl.constexpr, MAP: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, KP)
        ids = tl.load(idx_ptr + row * idx_stride + i, mask=i < K, other=-1)  # (-1 ids and i >= K: no member)
        col = ids.to(tl.int64)
        if MAP:
            col = tl.load(cols_ptr + row * cols_stride + col, mask=ids >= 0, other=-1)
        ok = (ids >= 0) & (col >= 0)
        v = tl.load(s_ptr + row * s_stride + col, mask=ok, other=float("-inf")) + 0.0  # (+0.0: -0.0 -> +0.0)
        v = tl.where(ok, v, float("-inf"))
        bits = v.to(tl.int32, bitcast=True)
        desc = ~(bits ^ ((bits >> 31) & 0x7FFFFFFF))  # larger score -> smaller key
        key = (desc.to(tl.int64) << 32) | tl.where(ok, col, 0x7FFFFFFF).to(tl.int64)  # (0x7FFFFFFF: no member)
        low = (tl.sort(key) & 0xFFFFFFFF).to(tl.int32)
        tl.store(out_ptr + row * K + i, tl.where(low == 0x7FFFFFFF, -1, low).to(tl.int64), mask=i < K)

    return set_order_kernel


def triton_set_order(scores: torch.Tensor, idx: torch.Tensor, rows: int, cols: torch.Tensor | None = None):
    """The first `rows` rows of a top-k set (idx [>= rows, k] int32, ascending, -1 padding; with `cols`, ids into
    cols [rows, G] (score columns, ascending)) as int64 [rows, k] score columns in `topk_entries`' order: score
    descending, ties to the lower column, -1 last -- scores [rows, C] f32 with unit column stride."""
    k = idx.shape[1]
    out = torch.empty(rows, k, dtype=torch.int64, device=idx.device)
    if rows and k:
        assert scores.stride(1) == 1 and idx.stride(1) == 1 and (cols is None or cols.stride(1) == 1)
        mapping = cols if cols is not None else idx  # (unused pointer when there is no map)
        kp = 1 << max(k - 1, 1).bit_length()
        _set_order_kernel(_interpreted())[(rows,)](
            scores, scores.stride(0), idx, idx.stride(0), mapping, mapping.stride(0), out, K=k, KP=kp,
            MAP=cols is not None, num_warps=4)  # fmt: skip
    return out
