"""Helpers shared by the kernel families: target-aware allocation and the FP8/ue8m0 quant references.

One TileLang program per family serves three targets. On CUDA, tiles live in shared memory and
register fragments and loops are `T.Parallel` (layout inference spreads them over threads). TileLang's
`c` target (our only CPU execution path, fp32 numerics checks) cannot infer fragment layouts and allows
one dynamic shared allocation, so there every tile is `alloc_local` and loops are serial (TOOLCHAIN.md §2).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


class Mem:
    """Allocation and loop constructors for one target (`cpu` means TileLang's `c` target)."""

    def __init__(self, target_name: str):
        self.cpu = target_name == "cpu"

    def shared(self, shape, dtype):
        import tilelang.language as T

        return T.alloc_local(shape, dtype) if self.cpu else T.alloc_shared(shape, dtype)

    def fragment(self, shape, dtype):
        import tilelang.language as T

        return T.alloc_local(shape, dtype) if self.cpu else T.alloc_fragment(shape, dtype)

    def par(self, *extents):
        """Element-wise loop nest: thread-parallel on CUDA, serial on CPU."""
        import tilelang.language as T

        return T.grid(*extents) if self.cpu else T.Parallel(*extents)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ue8m0_scale(amax: torch.Tensor, qmax: float = FP8_MAX) -> torch.Tensor:
    """Power-of-two scale 2^ceil(log2(amax/qmax)) (MODEL_SPEC §4.2); zero groups stay finite."""
    amax = amax.float().clamp_min(1e-30)
    return torch.exp2(torch.ceil(torch.log2(amax / qmax)))


def quant_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 quantisation: x [M, K] -> (fp8 e4m3 [M, K], fp32 ue8m0 scales [M, K/group])."""
    m, k = x.shape
    xg = x.float().view(m, k // group, group)
    scale = ue8m0_scale(xg.abs().amax(-1))
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, k), scale


def quant_fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8 weights: w [N, K] -> (fp8 [N, K], fp32 ue8m0 scales [N/block, K/block])."""
    n, k = w.shape
    wb = w.float().view(n // block, block, k // block, block)
    scale = ue8m0_scale(wb.abs().amax(dim=(1, 3)))
    q = (wb / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n, k), scale


def expand_scales(scale: torch.Tensor, rows: int, cols: int, shape: tuple[int, int]) -> torch.Tensor:
    """Broadcast a [R, C] per-block scale to a full [R*rows, C*cols] grid cropped to `shape`."""
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return full[: shape[0], : shape[1]]
