"""indexer_topk.triton_set_order: a top-k SET (ascending columns, -1 padding) put in `topk_entries`' order (score
descending, ties to the lower column, -1 last) in one Triton launch -- run in the interpreter. The oracle is a
per-row Python sort of (-score, column); heavy ties (ReLU zeros, one-decimal values) make the tie rule matter."""

from __future__ import annotations

import pytest
import torch

from deepinfer.codegen.kernels import indexer_topk as it
from tests.codegen._triton_aot import compile_sm90, spill_free


def tied_scores(t: int, c: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randn(t, c, generator=g)).round(decimals=1)


def random_sets(t: int, c: int, k: int, seed: int) -> torch.Tensor:
    """int32 [t, k] sets in ascending column order; row 1 half full, the last row empty (all -1)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(c, generator=g)[:k].sort().values for _ in range(t)]).int()
    if t > 2:
        idx[1, k // 2 :] = -1
    idx[-1] = -1
    return idx


def oracle(scores: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Row by row: the members' columns sorted by (-score, column), -1 padding last."""
    out = torch.full(cols.shape, -1, dtype=torch.int64)
    for r in range(cols.shape[0]):
        members = [int(j) for j in cols[r] if j >= 0]
        best = sorted(members, key=lambda j: (-float(scores[r, j]), j))
        out[r, : len(best)] = torch.tensor(best, dtype=torch.int64)
    return out


@pytest.mark.parametrize("t, c, k", [(5, 300, 40), (3, 1000, 512), (2, 50, 6)])
def test_the_op_order_of_a_set(interpret, t, c, k):
    s, idx = tied_scores(t, c, seed=k), random_sets(t, c, k, seed=c)
    got = it.triton_set_order(s, idx, t)
    assert got.dtype == torch.int64 and torch.equal(got, oracle(s, idx.long()))


def test_only_the_asked_rows_and_a_mapped_set(interpret):
    """Rows past `rows` (the adapter's padding rows) are not written; with `cols` the ids index gathered columns."""
    t, c, g_cols, k = 3, 400, 64, 16
    s = tied_scores(t, c, seed=1)
    gen = torch.Generator().manual_seed(2)
    cols = torch.stack([torch.randperm(c, generator=gen)[:g_cols].sort().values for _ in range(t)])
    cols[:, -5:] = -1  # gathered columns that are no candidate
    idx = random_sets(t + 2, g_cols - 5, k, seed=3)
    got = it.triton_set_order(s, idx, t, cols)
    mapped = torch.where(idx[:t] >= 0, torch.gather(cols, 1, idx[:t].long().clamp(min=0)), -1)
    assert got.shape == (t, k) and torch.equal(got, oracle(s, mapped))


def test_signed_zeros_tie_and_negative_scores(interpret):
    """-0.0 and +0.0 are equal (torch's comparison: ties to the lower column), negative scores order below them."""
    s = torch.tensor([[0.0, -0.0, -1.5, 2.0, -0.0, 0.0, -3.0, 2.0]])
    idx = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, -1, -1]], dtype=torch.int32)
    got = it.triton_set_order(s, idx, 1)
    assert got.tolist() == [[3, 7, 0, 1, 4, 5, 2, 6, -1, -1]] and torch.equal(got, oracle(s, idx.long()))


def test_compiles_for_hopper_without_spills():
    sig = {"s_ptr": "*fp32", "s_stride": "i64", "idx_ptr": "*i32", "idx_stride": "i64", "cols_ptr": "*i64",
           "cols_stride": "i64", "out_ptr": "*i64"}  # fmt: skip
    for mapped in (False, True):
        ptx, report = compile_sm90("deepinfer.codegen.kernels.indexer_topk", "_set_order_kernel", sig,
                                   dict(K=512, KP=512, MAP=mapped), num_warps=4)  # fmt: skip
        assert ".target sm_90a" in ptx and spill_free(report), report
