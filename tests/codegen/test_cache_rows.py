"""cache_rows.triton_scatter_rows (scatter_rows as a cache copy + one Triton launch) against the op's reference:
exactly equal, skipped (-1) rows, trailing dims, the input cache untouched. CPU: the interpreter; gpu: V4.1's
decode writes (4160 x 512 compressed KV, 128-row SWA ring)."""

import pytest
import torch

from deepinfer.codegen.kernels import cache_rows
from deepinfer.ir.registry import get_op


def _case(shape, m, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    cache, rows = torch.randn(*shape, generator=g), torch.randn(m, *shape[1:], generator=g)
    idx = torch.randperm(shape[0], generator=g)[:m]
    idx[0] = -1
    return cache.to(device), idx.to(device), rows.to(device)


@pytest.mark.parametrize("shape,m", [((40, 512), 7), ((9, 2, 3), 4), ((128, 512), 64)])
def test_interpreter_equals_the_reference(interpret, shape, m):
    cache, idx, rows = _case(shape, m, seed=m)
    before = cache.clone()
    out = cache_rows.triton_scatter_rows(cache, idx, rows)
    assert torch.equal(out, get_op("scatter_rows").run([cache, idx, rows], {})[0])
    assert torch.equal(cache, before)  # functional: the old cache is still the old one


@pytest.mark.gpu
@pytest.mark.parametrize("shape,m", [((4160, 512), 64), ((2080, 128), 32), ((128, 512), 64)])
def test_cuda_equals_the_reference(shape, m):
    cache, idx, rows = _case(shape, m, seed=m, device="cuda")
    out = cache_rows.triton_scatter_rows(cache, idx, rows)
    assert torch.equal(out.cpu(), get_op("scatter_rows").run([cache.cpu(), idx.cpu(), rows.cpu()], {})[0])
