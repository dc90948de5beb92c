"""scatter_rows (the model's state write: KV rings, compressed-KV and index-key caches) as a copy + one Triton launch.

    out = cache;  out[index[i]] = rows[i]  for every i with 0 <= index[i] < N        (rows of any trailing shape)

The op is functional (it returns the new cache; the old one may still be read by the step that replays it), so
the cache is copied first (one device copy, what the reference's clone costs too); the rows are then written by
one program per row. The sync-free torch form a decode graph uses (runtime/cuda_graphs.scatter_rows) takes ~5
launches per write (a concatenation with a spare row, the index rewrite, index_put), 3 writes per layer.
Duplicate indices: one of the rows lands (as with the reference's index_put); the graph's writes have none (ring
slots of distinct positions, one compressed entry per completed group). An index past the cache is skipped (the
reference raises; a device kernel must not write out of bounds).
"""

from __future__ import annotations

import functools
import os

import torch

FAMILY = "cache_rows"


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def scatter_rows_kernel(idx_ptr, rows_ptr, out_ptr, N, D, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        dst = tl.load(idx_ptr + i)
        if (dst >= 0) & (dst < N):
            for c0 in range(0, D, BLOCK):
                c = c0 + tl.arange(0, BLOCK)
                v = tl.load(rows_ptr + i * D + c, mask=c < D)
                tl.store(out_ptr + dst * D + c, v, mask=c < D)

    return scatter_rows_kernel


def triton_scatter_rows(cache: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The new cache: a copy of `cache` [N, ...] with rows [M, ...] written at index [M] (negative: skipped)."""
    import triton

    out = cache.clone()
    m, n = index.shape[0], cache.shape[0]
    d = cache[0].numel() if n else 0
    if m and d:
        src = rows.to(cache.dtype).reshape(m, d).contiguous()
        _kernel(os.environ.get("TRITON_INTERPRET") == "1")[(m,)](
            index.contiguous(), src, out, n, d, BLOCK=min(1024, triton.next_power_of_2(d)))  # fmt: skip
    return out
