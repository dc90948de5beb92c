"""Batched decode's V4.1 ratio-2 compressor with its index keys (batched_pair_compressor_keys, ir/ops/batched.py)
as ONE Triton launch: B sequences, one new token each, every sequence its own pending row and position.

Per sequence b (row b of every [B, ...] operand, p = positions[b]):

    closes = p odd                                   the token completes the pair (pending row, this token)
    pooled = closes ? sum_t softmax_t(score) * kv over {state row b, kv row b} : 0       per channel, fp32
    latent = RMSNorm_norm(pooled);  entry = RoPE(latent, closes ? p - 1 : 0)
    keys   = RoPE(RMSNorm_knorm(latent @ wk^T), same position)             wk bf16 [di, d], fp32 dot products
    entry_idx = closes ? p // 2 : -1;  state' = closes ? state : (kv row, score row)    the new pending row

The op's torch reference is ~25 small launches (stacks, a softmax, wheres, two norms, two RoPEs with their
casts and pads, the wk GEMM on an fp32 weight copy): 1.2 ms of executor time at B = 16 on the H200 (session 7),
for ~0.3 MB of data. Here one program per sequence does all of it with the row in registers; the wk product
(B x 512 x 128: ~8 MFLOP, not worth a GEMM kernel at decode B) reads wk through L2 in blocks of `out_block`
rows, and the keys row is written raw, read back after a barrier for its norm (a [di, d] tile would not fit
in registers). fp32 throughout with IEEE division and unfused products, as the reference computes.

RoPE reads a cos | sin table [P, rope_dim] (rope.cos_sin_table: the reference's fp32 angles p * f_i).

The per-row arithmetic and its order (block shapes, 4 warps, out_block 16) are the one-sequence kernel's
(compressor.triton_compressor_keys), so row b is bit-equal to what that kernel gives sequence b alone: the batched
graph keeps the one-sequence graph's numbers at B = 1 (the gpu test checks it).

H200 (session 7 call 3, kernels_h200 --only "batched pair_compressor_keys", CUDA graph): 15.2 / 15.8 / 16.1 us at
B 16 / 64 / 256 (10.7x / 7.5x / 7.8x the op's reference), error 2.7e-7. Flat in B: one program's serial chain
(row loads, two block reductions, 8 wk steps each with a cross-warp reduction, the barrier), not bytes (~1 MB at
B 64: 0.2 us of HBM). out_block 32 over 8 warps: 11.9 us at B 64, but a different reduction layout from the
one-sequence kernel's (B = 1 bit-equality unchecked); at ~0.1% of a 2.9 ms B-64 layer, not the default.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

FAMILY = "pair_compressor"


@dataclass(frozen=True)
class Config:
    out_block: int = 16  # wk rows per step of the keys product ([out_block, d] fp32 in registers)
    warps: int = 4


def default_config(b: int, d: int, di: int) -> Config:
    """One program per sequence whatever B is (so no field depends on B: a row's numbers do not either)."""
    return Config(out_block=min(16, di), warps=4)


def check_shapes(d: int, di: int, rope_dim: int, cfg: Config) -> None:
    """The kernel's register tiles need powers of two; RoPE needs its channels in both rows."""
    for name, v in (("d", d), ("di", di), ("out_block", cfg.out_block)):
        assert v > 0 and not v & (v - 1), f"{name}={v} must be a power of two"
    assert rope_dim % 2 == 0 and rope_dim <= min(d, di), f"rope_dim {rope_dim} must be even and <= d, di"
    assert di % cfg.out_block == 0, f"out_block {cfg.out_block} must divide di {di}"


# ---------------------------------------------------------------------------------------------- Triton


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """Built lazily, once per interpreter mode (triton fixes it at decoration time)."""
    import triton
    import triton.language as tl

    @triton.jit
    def batched_pair_keys_kernel(kv_ptr, sc_ptr, skv_ptr, ssc_ptr, pos_ptr, norm_ptr, wk_ptr, knorm_ptr, cs_ptr,
                                 entry_ptr, keys_ptr, eidx_ptr, nkv_ptr, nsc_ptr, eps,
                                 D: tl.constexpr, DI: tl.constexpr, R: tl.constexpr,
                                 OB: tl.constexpr):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, D)
        p = tl.load(pos_ptr + b).to(tl.int64)
        closes = p % 2 == 1
        new_kv = tl.load(kv_ptr + b * D + c).to(tl.float32)
        new_sc = tl.load(sc_ptr + b * D + c).to(tl.float32)
        old_kv = tl.load(skv_ptr + b * D + c).to(tl.float32)
        old_sc = tl.load(ssc_ptr + b * D + c).to(tl.float32)
        # the pair softmax as torch.softmax computes it: exp(z - max) / sum, the pending row first
        top = tl.maximum(old_sc, new_sc)
        e_old = tl.exp(old_sc - top)
        e_new = tl.exp(new_sc - top)
        tot = e_old + e_new
        pooled = old_kv * tl.math.div_rn(e_old, tot) + new_kv * tl.math.div_rn(e_new, tot)
        x = tl.where(closes, pooled, 0.0)
        rope_pos = tl.where(closes, p - 1, 0)
        tl.store(eidx_ptr + b, tl.where(closes, p // 2, -1))
        # an even position leaves this token pending for the next step
        tl.store(nkv_ptr + b * D + c, tl.where(closes, old_kv, new_kv))
        tl.store(nsc_ptr + b * D + c, tl.where(closes, old_sc, new_sc))

        ms = tl.sum(x * x, axis=0) / D
        latent = x * (1.0 / tl.sqrt_rn(ms + eps)) * tl.load(norm_ptr + c).to(tl.float32)
        # RoPE on the last R channels, interleaved pairs (2m, 2m+1); table row = cos f_0.. | sin f_0..
        tail = c >= D - R
        m = tl.where(tail, (c - (D - R)) // 2, 0)
        cos = tl.load(cs_ptr + rope_pos * R + m, mask=tail, other=1.0)
        sin = tl.load(cs_ptr + rope_pos * R + R // 2 + m, mask=tail, other=0.0)
        partner = tl.reshape(tl.flip(tl.reshape(latent, (D // 2, 2)), 1), (D,))  # channel 2m <-> 2m+1
        rot = tl.where(c % 2 == 1, partner * sin + latent * cos, latent * cos - partner * sin)
        tl.store(entry_ptr + b * D + c, tl.where(tail, rot, latent))

        # keys = latent @ wk^T, OB output channels at a time, the raw row parked in the output
        for o0 in tl.static_range(0, DI, OB):
            ob = o0 + tl.arange(0, OB)
            w = tl.load(wk_ptr + ob[:, None] * D + c[None, :]).to(tl.float32)
            tl.store(keys_ptr + b * DI + ob, tl.sum(w * latent[None, :], axis=1))
        tl.debug_barrier()  # every thread's dot products are in memory before any thread reads the row back
        o = tl.arange(0, DI)
        k = tl.load(keys_ptr + b * DI + o)
        kms = tl.sum(k * k, axis=0) / DI
        k = k * (1.0 / tl.sqrt_rn(kms + eps)) * tl.load(knorm_ptr + o).to(tl.float32)
        ktail = o >= DI - R
        km = tl.where(ktail, (o - (DI - R)) // 2, 0)
        kcos = tl.load(cs_ptr + rope_pos * R + km, mask=ktail, other=1.0)
        ksin = tl.load(cs_ptr + rope_pos * R + R // 2 + km, mask=ktail, other=0.0)
        kpartner = tl.reshape(tl.flip(tl.reshape(k, (DI // 2, 2)), 1), (DI,))
        krot = tl.where(o % 2 == 1, kpartner * ksin + k * kcos, k * kcos - kpartner * ksin)
        tl.debug_barrier()  # the raw row is read by all threads before it is overwritten
        tl.store(keys_ptr + b * DI + o, tl.where(ktail, krot, k))

    return batched_pair_keys_kernel


def triton_batched_pair_keys(kv, score, state_kv, state_score, positions, norm_w, wk, k_norm, cos_sin, *,
                             eps: float, rope_dim: int, cfg: Config | None = None):  # fmt: skip
    """-> (entry [B, d] f32, keys [B, di] f32, entry_idx [B] i64, state_kv' [B, d] f32, state_score' [B, d] f32).
    Any float input dtypes (computed in fp32); cos_sin [P, rope_dim] fp32 with P above every position."""
    bsz, d = kv.shape
    di = wk.shape[0]
    cfg = cfg or default_config(bsz, d, di)
    check_shapes(d, di, rope_dim, cfg)
    f32 = {"dtype": torch.float32, "device": kv.device}
    entry, keys = torch.empty(bsz, d, **f32), torch.empty(bsz, di, **f32)
    new_kv, new_sc = torch.empty(bsz, d, **f32), torch.empty(bsz, d, **f32)
    eidx = torch.empty(bsz, dtype=torch.int64, device=kv.device)
    if bsz:
        args = [t.contiguous() for t in (kv, score, state_kv, state_score, positions, norm_w, wk, k_norm, cos_sin)]
        _kernel(os.environ.get("TRITON_INTERPRET") == "1")[(bsz,)](
            *args, entry, keys, eidx, new_kv, new_sc, float(eps), D=d, DI=di, R=rope_dim, OB=cfg.out_block,
            num_warps=cfg.warps, enable_fp_fusion=False)  # fmt: skip
    return entry, keys, eidx, new_kv, new_sc


# ---------------------------------------------------------------------------------------------- references


def reference(kv, score, state_kv, state_score, positions, norm_w, wk, k_norm, cos_sin, *, eps: float,
              rope_dim: int):  # fmt: skip
    """Torch reference of the kernel's formula on its own inputs (the cos | sin table instead of the attrs), fp32,
    written from the per-sequence formula above (not from the op's reference)."""
    pos = positions.long()
    closes = (pos % 2 == 1).unsqueeze(-1)
    kv, score, skv, ssc = kv.float(), score.float(), state_kv.float(), state_score.float()
    top = torch.maximum(ssc, score)
    e_old, e_new = torch.exp(ssc - top), torch.exp(score - top)
    pooled = torch.where(closes, skv * (e_old / (e_old + e_new)) + kv * (e_new / (e_old + e_new)), 0.0)
    rope_pos = torch.where(closes.squeeze(-1), pos - 1, 0)
    cs = cos_sin[rope_pos]
    latent = _rms(pooled, norm_w, eps)
    keys = _rms(latent @ wk.float().T, k_norm, eps)
    eidx = torch.where(closes.squeeze(-1), pos // 2, -1)
    new_kv, new_sc = torch.where(closes, skv, kv), torch.where(closes, ssc, score)
    return _rope_tail(latent, cs, rope_dim), _rope_tail(keys, cs, rope_dim), eidx, new_kv, new_sc


def _rms(x, w, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.float()


def _rope_tail(x, cs, r):
    """Rotate x's last r channels as pairs (2m, 2m+1) by the row's cos | sin."""
    cos, sin = cs[:, : r // 2], cs[:, r // 2 : r]
    head, even, odd = x[:, :-r], x[:, -r::2], x[:, -r + 1 :: 2]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([head, rotated], dim=-1)


def roofline(b: int, d: int, di: int, rope_dim: int) -> tuple[float, float]:
    """(bytes, flops): kv, score and both states read (fp32), positions, the bf16 norm / wk / k_norm once, two
    cos | sin half-rows per sequence; entry, keys, both new states and entry_idx written. Flops: the wk product
    (2*B*d*di) and ~20 per channel for pooling, norms and RoPE."""
    read = 4 * 4 * b * d + 8 * b + 2 * (d + di * d + di) + 4 * b * rope_dim
    written = 4 * b * (d + di) + 2 * 4 * b * d + 8 * b
    return float(read + written), float(2 * b * d * di + 20 * b * (d + di))
