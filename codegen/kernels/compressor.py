"""V4.1 compressor epilogue: ratio-2 pair pooling + RMSNorm, and ratio-1 RMSNorm (MODEL_SPEC §2.13).

    ratio 2: c_j = sum_{t in {2j, 2j+1}} softmax_t(z_t) * a_t        per-channel softmax over the pair, fp32
    ratio 1: c_j = a_j                                                (no gate)
    latent_j = RMSNorm_w( bf16(c_j) )                                 fp32 statistics, bf16 out

A [T, d] = x @ wkv^T and Z [T, d] = x @ wgate^T come from the GEMM (fp32, d = 512). A batch whose first
position is odd completes the pair left pending by the previous batch: with `odd=True` the kernel takes the
pending row (state_a, state_z [1, d], the `pair_compressor` op's state) as the first member of pair 0, so
no host-side concatenation is needed. Group i of the output is group start//2 + i; only complete pairs
are produced (G = (T + odd) // 2); an unfinished last row stays the caller's new state, as in the op.

Memory-bound: A and Z read once, the latent written once (bf16). One CTA normalises `block_g` groups; the
pair softmax is computed as sigmoid(z0 - z1) (one exp per channel: softmax over two values).
"""

import functools
from dataclasses import dataclass

import torch

from deepinfer.codegen.kernels._common import Mem, ceil_div

FAMILY = "compressor"


@dataclass(frozen=True)
class Config:
    block_g: int = 4  # groups (output rows) per CTA
    threads: int = 128


def config_space(G: int, d: int) -> list[Config]:
    return [Config(bg, th) for bg in (1, 2, 4, 8) for th in (64, 128, 256) if bg * d >= th * 4]


def n_groups(T_: int, ratio: int, odd: bool = False) -> int:
    return (T_ + int(odd)) // 2 if ratio == 2 else T_


def program(T_: int, d: int, *, ratio: int, eps: float, odd: bool = False, target: str, cfg: Config = Config()):
    """ratio 2: prim_func(A [T, d] f32, Z [T, d] f32, SA [1, d] f32, SZ [1, d] f32, W [d] f32, Y [G, d]);
    ratio 1: prim_func(A [T, d] f32, W [d] f32, Y [T, d]). Y is bf16 on CUDA, fp32 on the `c` target."""
    import tilelang.language as T

    assert ratio in (1, 2) and not (odd and ratio == 1)
    mem = Mem(target)
    out_dt = "float32" if mem.cpu else "bfloat16"
    G, bg, off = n_groups(T_, ratio, odd), cfg.block_g, int(odd)
    inv_d = 1.0 / d

    if ratio == 1:

        @T.prim_func
        def compressor_r1(A: T.Tensor((T_, d), "float32"), W: T.Tensor((d,), "float32"), Y: T.Tensor((T_, d), out_dt)):
            with T.Kernel(ceil_div(G, bg), threads=cfg.threads) as bx:
                c = mem.fragment((bg, d), "float32")
                sq = mem.fragment((bg, d), "float32")
                ss = mem.fragment((bg,), "float32")
                for i, j in mem.par(bg, d):
                    g = T.min(bx * bg + i, G - 1)  # tail rows recompute the last group; stores are guarded
                    c[i, j] = T.cast(T.cast(A[g, j], out_dt), "float32")  # bf16(c) before the norm
                    sq[i, j] = c[i, j] * c[i, j]
                T.reduce_sum(sq, ss, dim=1)
                for i, j in mem.par(bg, d):
                    if bx * bg + i < G:
                        Y[bx * bg + i, j] = T.cast(c[i, j] * T.rsqrt(ss[i] * inv_d + eps) * W[j], out_dt)

        return compressor_r1

    @T.prim_func
    def compressor_r2(
        A: T.Tensor((T_, d), "float32"),
        Z: T.Tensor((T_, d), "float32"),
        SA: T.Tensor((1, d), "float32"),
        SZ: T.Tensor((1, d), "float32"),
        W: T.Tensor((d,), "float32"),
        Y: T.Tensor((G, d), out_dt),
    ):
        with T.Kernel(ceil_div(G, bg), threads=cfg.threads) as bx:
            c = mem.fragment((bg, d), "float32")
            sq = mem.fragment((bg, d), "float32")
            ss = mem.fragment((bg,), "float32")
            for i, j in mem.par(bg, d):
                g = T.min(bx * bg + i, G - 1)
                r1 = 2 * g + 1 - off  # the pair's second row in this batch (always present)
                a1, z1 = A[r1, j], Z[r1, j]
                a0 = T.if_then_else(r1 == 0, SA[0, j], A[T.max(r1 - 1, 0), j])
                z0 = T.if_then_else(r1 == 0, SZ[0, j], Z[T.max(r1 - 1, 0), j])
                p0 = 1.0 / (1.0 + T.exp(z1 - z0))  # softmax weight of the first member
                c[i, j] = T.cast(T.cast(a1 + p0 * (a0 - a1), out_dt), "float32")
                sq[i, j] = c[i, j] * c[i, j]
            T.reduce_sum(sq, ss, dim=1)
            for i, j in mem.par(bg, d):
                if bx * bg + i < G:
                    Y[bx * bg + i, j] = T.cast(c[i, j] * T.rsqrt(ss[i] * inv_d + eps) * W[j], out_dt)

    return compressor_r2


# ---------------------------------------------------------------------------------------------- references


def reference(a, z, w, *, ratio: int, eps: float, state_a=None, state_z=None, odd: bool = False, out_dtype=None):
    """Torch reference: the pooled rows of complete pairs, bf16-rounded (out_dtype), RMSNorm'd in fp32."""
    out_dtype = out_dtype or torch.bfloat16
    if ratio == 1:
        c = a.float()
    else:
        if odd:
            a = torch.cat([state_a, a])
            z = torch.cat([state_z, z])
        g = a.shape[0] // 2
        pa, pz = a[: 2 * g].float().view(g, 2, -1), z[: 2 * g].float().view(g, 2, -1)
        c = (pa * torch.softmax(pz, dim=1)).sum(1)
    c = c.to(out_dtype).float()
    y = c * torch.rsqrt(c.square().mean(-1, keepdim=True) + eps) * w.float()
    return y.to(out_dtype)


def reference_f64(a, z, w, *, ratio: int, eps: float, state_a=None, state_z=None, odd: bool = False):
    """Independent float64 oracle from the formula, no bf16 rounding: explicit exp/sum softmax, loop over pairs."""
    a, w = a.double(), w.double()
    if ratio == 1:
        c = a
    else:
        z = z.double()
        if odd:
            a, z = torch.cat([state_a.double(), a]), torch.cat([state_z.double(), z])
        rows = []
        for j in range(a.shape[0] // 2):
            e0, e1 = torch.exp(z[2 * j]), torch.exp(z[2 * j + 1])
            rows.append((e0 * a[2 * j] + e1 * a[2 * j + 1]) / (e0 + e1))
        c = torch.stack(rows)
    return c / torch.sqrt((c * c).mean(-1, keepdim=True) + eps) * w


def roofline(T_: int, d: int, ratio: int, out_bytes: int = 2) -> tuple[float, float]:
    """(bytes, flops): A (and Z) read once in fp32, latent written once; ~10 flops per pooled channel."""
    G = n_groups(T_, ratio)
    return float(4 * T_ * d * ratio + G * d * out_bytes + 4 * d), float(G * d * (10 if ratio == 2 else 4))


# ---------------------------------------------------------------------------------------------- ascend


def ascend_program(T_: int, d: int, *, eps: float, block_g: int = 4, num_cores: int = 32):
    """Ascend 950 ratio-2 compressor (vector cores only), batches that start on a pair boundary: the 2*bg rows
    of A and Z go to the Unified Buffer by DMA, SIMT pools each pair and squares it, a SIMD reduction makes
    the row sums, SIMT normalises; groups are spread persistently over `num_cores`."""
    import tilelang.ascend.language as T

    G, bg = T_ // 2, block_g
    assert T_ % 2 == 0 and G % bg == 0

    @T.prim_func
    def compressor_r2_ascend(
        A: T.Tensor((T_, d), "float32"),
        Z: T.Tensor((T_, d), "float32"),
        W: T.Tensor((d,), "float32"),
        Y: T.Tensor((G, d), "bfloat16"),
    ):
        with T.Kernel(num_cores) as bx:
            a_ub = T.alloc_shared((2 * bg, d), "float32")
            z_ub = T.alloc_shared((2 * bg, d), "float32")
            w_ub = T.alloc_shared((d,), "float32")
            c_ub = T.alloc_shared((bg, d), "float32")
            sq = T.alloc_shared((bg, d), "float32")
            ss = T.alloc_shared((bg,), "float32")
            y_ub = T.alloc_shared((bg, d), "bfloat16")
            T.copy(W, w_ub)
            for tile in T.Persistent([G // bg], num_cores, bx):
                T.copy(A[tile * 2 * bg, 0], a_ub)
                T.copy(Z[tile * 2 * bg, 0], z_ub)
                with T.SimtVF(threads=128):
                    for i, j in T.Parallel(bg, d):
                        p0 = 1.0 / (1.0 + T.exp(z_ub[2 * i + 1, j] - z_ub[2 * i, j]))
                        c = a_ub[2 * i + 1, j] + p0 * (a_ub[2 * i, j] - a_ub[2 * i + 1, j])
                        c_ub[i, j] = T.cast(T.cast(c, "bfloat16"), "float32")
                        sq[i, j] = c_ub[i, j] * c_ub[i, j]
                with T.SimdVF():
                    T.reduce_sum(sq, ss, dim=1)
                with T.SimtVF(threads=128):
                    for i, j in T.Parallel(bg, d):
                        y_ub[i, j] = T.cast(c_ub[i, j] * T.rsqrt(ss[i] / d + eps) * w_ub[j], "bfloat16")
                T.copy(y_ub, Y[tile * bg, 0])

    return compressor_r2_ascend


# ---------------------------------------------------------------------------------------------- decode keys, Triton
# `pair_compressor_keys` / `compressor_keys` at decode as ONE launch (fp32 throughout, as the ops' references):
#     pooled = the pair pooling of pair_compressor (ratio 2; the batch's start parity read on the device, the
#              pending row taken from the state) or the kv rows themselves (ratio 1)
#     latent = RMSNorm_norm(pooled);  entry = RoPE(latent, pos)
#     keys   = RoPE(RMSNorm_knorm(latent @ wk^T), pos)                  wk bf16 [di, d], FMA dot in fp32
# The torch formulation launches ~40 small kernels for the pooling alone (gathers, stacks, a softmax, wheres) and
# ~15 more around the norm / RoPE kernels (bf16 casts, pads, the wk GEMM's fp32 weight copy): ~0.1 ms per layer
# at T=64 on the H200, for 64 KB of data. One program per output row; the state rows (new_kv / new_score) are
# written by program 0. RoPE reads the RopeAdapter's cos/sin table (positions.float() * f_i, the reference's
# angles); the pair softmax is exp(z - max) / sum with IEEE division (div_rn), products kept unfused.


@functools.lru_cache(maxsize=2)
def _keys_kernel(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def compressor_keys_kernel(kv_ptr, sc_ptr, skv_ptr, ssc_ptr, pos_ptr, norm_ptr, wk_ptr, knorm_ptr, cs_ptr,
                               entry_ptr, keys_ptr, epos_ptr, eidx_ptr, nkv_ptr, nsc_ptr, T, eps,
                               D: tl.constexpr, DI: tl.constexpr, R: tl.constexpr, PAIR: tl.constexpr,
                               OB: tl.constexpr):  # fmt: skip
        i = tl.program_id(0)
        c = tl.arange(0, D)
        start = tl.load(pos_ptr).to(tl.int32)
        if PAIR:
            j = start // 2 + i
            valid = j < (start + T) // 2
            # seq row r = position start - 1 + r; row 0 is the pending state row
            first = tl.minimum(tl.maximum(2 * j - (start - 1), 0), T - 1)
            second = tl.minimum(first + 1, T)
            a_kv = tl.load(kv_ptr + (first - 1) * D + c, mask=first > 0, other=0.0).to(tl.float32)
            a_kv = tl.where(first > 0, a_kv, tl.load(skv_ptr + c).to(tl.float32))
            a_sc = tl.load(sc_ptr + (first - 1) * D + c, mask=first > 0, other=0.0).to(tl.float32)
            a_sc = tl.where(first > 0, a_sc, tl.load(ssc_ptr + c).to(tl.float32))
            b_kv = tl.load(kv_ptr + (second - 1) * D + c).to(tl.float32)
            b_sc = tl.load(sc_ptr + (second - 1) * D + c).to(tl.float32)
            m = tl.maximum(a_sc, b_sc)
            ea = tl.exp(a_sc - m)
            eb = tl.exp(b_sc - m)
            tot = ea + eb
            pa = a_kv * tl.math.div_rn(ea, tot)
            pb = b_kv * tl.math.div_rn(eb, tot)
            x = tl.where(valid, pa + pb, 0.0)
            pos = tl.where(valid, 2 * j, 0)
            tl.store(epos_ptr + i, pos.to(tl.int64))
            tl.store(eidx_ptr + i, tl.where(valid, j, -1).to(tl.int64))
            if i == 0:  # the pending row after this batch: the last token when the batch ends on a pair's first
                pending = (start + T - 1) % 2 == 0
                last_kv = tl.load(kv_ptr + (T - 1) * D + c).to(tl.float32)
                last_sc = tl.load(sc_ptr + (T - 1) * D + c).to(tl.float32)
                tl.store(nkv_ptr + c, tl.where(pending, last_kv, tl.load(skv_ptr + c).to(tl.float32)))
                tl.store(nsc_ptr + c, tl.where(pending, last_sc, tl.load(ssc_ptr + c).to(tl.float32)))
        else:
            x = tl.load(kv_ptr + i * D + c).to(tl.float32)
            pos = tl.load(pos_ptr + i).to(tl.int32)
        ms = tl.sum(x * x, axis=0) / D
        latent = x * (1.0 / tl.sqrt_rn(ms + eps)) * tl.load(norm_ptr + c).to(tl.float32)
        # RoPE on the last R channels as interleaved pairs (2m, 2m+1): the table row holds cos | sin of f_m
        m = tl.where(c >= D - R, (c - (D - R)) // 2, 0)
        cos = tl.load(cs_ptr + pos * R + m, mask=c >= D - R, other=1.0)
        sin = tl.load(cs_ptr + pos * R + R // 2 + m, mask=c >= D - R, other=0.0)
        partner = tl.reshape(tl.flip(tl.reshape(latent, (D // 2, 2)), 1), (D,))  # 2m <-> 2m+1
        rot = tl.where(c % 2 == 1, partner * sin + latent * cos, latent * cos - partner * sin)
        tl.store(entry_ptr + i * D + c, tl.where(c >= D - R, rot, latent))
        # wk's rows in blocks of OB (a [DI, D] tile would not fit in registers), through the keys row as scratch
        for o0 in tl.static_range(0, DI, OB):
            ob = o0 + tl.arange(0, OB)
            w = tl.load(wk_ptr + ob[:, None] * D + c[None, :]).to(tl.float32)  # [OB, D]
            tl.store(keys_ptr + i * DI + ob, tl.sum(w * latent[None, :], axis=1))
        tl.debug_barrier()  # the dot products written by all threads before any thread reads the row back
        o = tl.arange(0, DI)
        k = tl.load(keys_ptr + i * DI + o)
        kms = tl.sum(k * k, axis=0) / DI
        k = k * (1.0 / tl.sqrt_rn(kms + eps)) * tl.load(knorm_ptr + o).to(tl.float32)
        m = tl.where(o >= DI - R, (o - (DI - R)) // 2, 0)  # the same rotation on the keys
        cos = tl.load(cs_ptr + pos * R + m, mask=o >= DI - R, other=1.0)
        sin = tl.load(cs_ptr + pos * R + R // 2 + m, mask=o >= DI - R, other=0.0)
        partner = tl.reshape(tl.flip(tl.reshape(k, (DI // 2, 2)), 1), (DI,))
        rot = tl.where(o % 2 == 1, partner * sin + k * cos, k * cos - partner * sin)
        tl.store(keys_ptr + i * DI + o, tl.where(o >= DI - R, rot, k))

    return compressor_keys_kernel


def triton_compressor_keys(kv, positions, norm_w, wk, k_norm, cos_sin, *, eps: float, rope_dim: int,
                           score=None, state_kv=None, state_score=None):  # fmt: skip
    """compressor_keys (score None) -> (entry [T, d], keys [T, di]); pair_compressor_keys (score, state given) ->
    (entry [G, d], keys [G, di], entry_idx [G] i64, new state_kv [1, d], new state_score [1, d]), G = (T+1)//2.
    cos_sin: [P, rope_dim] fp32 (rope.cos_sin_table), P above every position."""
    import os

    t, d = kv.shape
    di = wk.shape[0]
    pair = score is not None
    g = (t + 1) // 2 if pair else t
    dev = kv.device
    entry = torch.empty(g, d, dtype=torch.float32, device=dev)
    keys = torch.empty(g, di, dtype=torch.float32, device=dev)
    epos = torch.empty(g, dtype=torch.int64, device=dev)
    eidx = torch.empty(g, dtype=torch.int64, device=dev)
    nkv = torch.empty(1, d, dtype=torch.float32, device=dev)
    nsc = torch.empty(1, d, dtype=torch.float32, device=dev)
    kv = kv.contiguous()
    arg = lambda v: v.contiguous() if v is not None else kv  # noqa: E731  (ratio 1: unused pointers)
    if g:  # (any float dtypes: the kernel computes in fp32)
        _keys_kernel(os.environ.get("TRITON_INTERPRET") == "1")[(g,)](
            kv, arg(score), arg(state_kv), arg(state_score), positions.contiguous(), arg(norm_w), wk.contiguous(),
            arg(k_norm), cos_sin.contiguous(), entry, keys, epos, eidx, nkv, nsc, t, float(eps),
            D=d, DI=di, R=rope_dim, PAIR=pair, OB=min(16, di), enable_fp_fusion=False)  # fmt: skip
    if not pair:
        return entry, keys
    return entry, keys, eidx, nkv, nsc
