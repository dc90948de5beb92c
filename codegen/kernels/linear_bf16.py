"""Decode `linear` with a bf16 weight and fp32 activations (the compressor's wkv / wgate and the indexer's
weights_proj: [512 | 32, 5120] bf16), Triton.

    y[t, n] = sum_k x[t, k] * W[n, k]          fp32 x, bf16 W, fp32 accumulation (the `linear` op's numbers)

The op's reference copies W to fp32 on every call (10.5 MB written and read again for a 5.2 MB weight) and runs
an fp32 FFMA GEMM: ~30-60 us per projection at T=64 on the H200. Here W is read once, as it is stored: x is
split into three bf16 terms hi + mid + lo == x (ir/ops/core.split_f32_to_bf16, done in registers), whose
products with a bf16 weight are exact in fp32, so three bf16 MMAs into one fp32 accumulator give the fp32
reference's numbers up to the order of the sums (the head's linear_f32_bf16, as one kernel).

Few rows and few output columns leave most SMs idle, so K is split over CTAs: grid (N / block_n, splits,
T / block_t); each CTA writes its partial [block_t, block_n] to P[split], and the splits are summed in split
order afterwards (a fixed order: deterministic, independent of T).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

FAMILY = "linear_bf16"


@dataclass(frozen=True)
class Config:
    block_n: int = 64
    block_k: int = 64
    block_t: int = 64
    splits: int = 16  # K chunks summed afterwards (must divide K / block_k)
    warps: int = 8  # 4 warps spill at block_n 64 (x's three bf16 terms + the prefetched tiles in registers)
    stages: int = 3


def default_config(T_: int, N: int, K: int, sms: int = 132) -> Config:
    """block_n 64 (32 for narrow weights); the most K splits that keep about one CTA per SM (each split adds a
    [T, N] fp32 partial to write and sum)."""
    bn = 64 if N >= 64 else max(16, 1 << (N - 1).bit_length())
    bk = 64
    steps = K // bk
    ctas = -(-N // bn) * -(-T_ // 64)
    splits = max(d for d in range(1, steps + 1) if steps % d == 0 and d * ctas <= max(sms, ctas))
    return Config(block_n=bn, block_k=bk, splits=splits)


def check_config(N: int, K: int, cfg: Config) -> None:
    assert K % cfg.block_k == 0 and (K // cfg.block_k) % cfg.splits == 0, (N, K, cfg)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """Built lazily, once per interpreter mode (triton fixes it at decoration time)."""
    import triton
    import triton.language as tl

    @triton.jit
    def linear_bf16_kernel(x_ptr, w_ptr, p_ptr, T, N, K, stride_x, ROWS, BN: tl.constexpr, BK: tl.constexpr,
                           BT: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr,
                           F32_DOTS: tl.constexpr):  # fmt: skip
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        t = tl.program_id(2) * BT + tl.arange(0, BT)
        k0 = tl.program_id(1) * STEPS * BK
        kk = tl.arange(0, BK)
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        for i in tl.range(0, STEPS, num_stages=STAGES):
            k = k0 + i * BK + kk
            x = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=t[:, None] < T, other=0.0)  # [BT, BK]
            w = tl.load(w_ptr + n[None, :] * K + k[:, None], mask=n[None, :] < N, other=0.0)  # [BK, BN] bf16
            hi = x.to(tl.bfloat16)
            r = x - hi.to(tl.float32)
            mid = r.to(tl.bfloat16)
            lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
            if F32_DOTS:  # the interpreter multiplies bf16 operands as raw bits: the same exact products in fp32
                wf = w.to(tl.float32)
                acc = tl.dot(lo.to(tl.float32), wf, acc, input_precision="ieee")
                acc = tl.dot(mid.to(tl.float32), wf, acc, input_precision="ieee")
                acc = tl.dot(hi.to(tl.float32), wf, acc, input_precision="ieee")
            else:
                acc = tl.dot(lo, w, acc)  # the small terms first (as linear_f32_bf16 adds them)
                acc = tl.dot(mid, w, acc)
                acc = tl.dot(hi, w, acc)
        p = p_ptr + (tl.program_id(1) * ROWS + t[:, None]) * N + n[None, :]
        tl.store(p, acc, mask=(t[:, None] < ROWS) & (n[None, :] < N))

    return linear_bf16_kernel


def triton_linear(x: torch.Tensor, w: torch.Tensor, cfg: Config | None = None) -> torch.Tensor:
    """x [..., K] fp32 (unit stride along K), w [N, K] bf16 -> y [..., N] fp32: one kernel launch plus the sum of
    the K splits (none with one split)."""
    import triton

    k, n = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    t = x2.shape[0]
    cfg = cfg or default_config(t, n, k)
    check_config(n, k, cfg)
    p = torch.empty(cfg.splits, t, n, dtype=torch.float32, device=x.device)
    if t:
        grid = (triton.cdiv(n, cfg.block_n), cfg.splits, triton.cdiv(t, cfg.block_t))
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        _kernel(interpret)[grid](
            x2, w.contiguous(), p, t, n, k, x2.stride(0), t, BN=cfg.block_n, BK=cfg.block_k, BT=cfg.block_t,
            STEPS=k // cfg.block_k // cfg.splits, STAGES=cfg.stages, F32_DOTS=interpret,
            num_warps=cfg.warps)  # fmt: skip
    y = p[0] if cfg.splits == 1 else p.sum(0)
    return y.reshape(*x.shape[:-1], n)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The `linear` op's reference (fp32 GEMM on an fp32 copy of the weight)."""
    return torch.nn.functional.linear(x.float(), w.float())


def roofline(T_: int, N: int, K: int, splits: int = 1) -> tuple[float, float]:
    """(bytes, flops): the bf16 weight and fp32 x read once, y written once (the split partials not counted: they
    are the kernel's overhead); 2*T*N*K flops."""
    return float(2 * N * K + 4 * T_ * K + 4 * T_ * N), float(2 * T_ * N * K)
