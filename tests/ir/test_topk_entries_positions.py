"""topk_entries with the queries' positions (issues 6/8): only the columns j < (p+1)//ratio are candidates.

On index_scores' output (-inf past that limit already) the set is the one without positions; with anything at all
written past the limit (what a scores kernel that skips those columns leaves there) the positions still give the
visible columns' top-k. The oracle is a per-row Python selection (score descending, ties to the lower column)."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.ir import dtypes as dt
from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.registry import get_op

K = 8


def oracle(scores: torch.Tensor, positions: torch.Tensor, ratio: int, k: int, allowed=None) -> torch.Tensor:
    """Row by row: the visible (and allowed) finite columns, best k by (score desc, column asc), -1 padded."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int64)
    for t in range(scores.shape[0]):
        lim = (int(positions[t]) + 1) // ratio
        cols = [j for j in range(min(lim, scores.shape[1])) if allowed is None or allowed(t, j)]
        cols = [j for j in cols if scores[t, j] > -math.inf]
        best = sorted(cols, key=lambda j: (-float(scores[t, j]), j))[:k]
        out[t, : len(best)] = torch.tensor(best, dtype=torch.int64)
    return out


def scores_with_ties(t: int, c: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randn(t, c, generator=g)).round(decimals=1)  # many exact ties (zeros, repeats)


def run(scores, blocks, positions, *, ratio, block=1, k=K):
    return get_op("topk_entries").run([scores, blocks, positions], {"topk": k, "block": block, "ratio": ratio})[0]


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_positions_restrict_the_columns(ratio):
    c = 40
    s = scores_with_ties(6, c, seed=ratio)
    pos = torch.tensor([0, ratio - 1, 5, 17, 3 * ratio + 1, c * ratio - 1])
    s[:, 0] = 9.0  # visible from the first entry on: a row with one visible column takes it
    got = run(s, None, pos, ratio=ratio)
    assert torch.equal(got, oracle(s, pos, ratio, K))


@pytest.mark.parametrize("ratio", [1, 4])
def test_the_same_set_as_without_positions_on_masked_scores(ratio):
    """index_scores' -inf past the limit: positions change nothing (the op's values before and after the change)."""
    c = 64
    s = scores_with_ties(5, c, seed=7)
    pos = torch.tensor([2, 9, 30, 100, 255]) * ratio // 4 + ratio - 1
    lim = (pos + 1) // ratio
    masked = s.masked_fill(torch.arange(c)[None, :] >= lim[:, None], float("-inf"))
    assert torch.equal(run(masked, None, pos, ratio=ratio), run(masked, None, None, ratio=ratio))


def test_columns_past_the_limit_are_never_taken_whatever_they_hold():
    """A scores kernel that does not write the dead columns leaves anything there (here: the largest values)."""
    c, ratio = 48, 2
    s = scores_with_ties(4, c, seed=3)
    pos = torch.tensor([1, 11, 40, 95])
    lim = (pos + 1) // ratio
    garbage = s.masked_fill(torch.arange(c)[None, :] >= lim[:, None], 1e30)
    got = run(garbage, None, pos, ratio=ratio)
    assert torch.equal(got, oracle(s, pos, ratio, K))
    assert not torch.equal(run(garbage, None, None, ratio=ratio), got)  # without positions the garbage wins


def test_two_level_with_positions():
    """Blocks and positions together: entries inside the chosen blocks AND visible."""
    c, ratio, block = 64, 1, 8
    s = scores_with_ties(3, c, seed=11)
    pos = torch.tensor([20, 45, 63])
    blocks = torch.tensor([[0, 2, -1], [5, 1, 3], [7, -1, -1]])
    garbage = s.masked_fill(torch.arange(c)[None, :] > pos[:, None], 1e30)
    got = run(garbage, blocks, pos, ratio=ratio, block=block)
    chosen = [set(b.tolist()) for b in blocks]
    assert torch.equal(got, oracle(s, pos, ratio, K, allowed=lambda t, j: j // block in chosen[t]))


def test_schema_checks_the_positions():
    b = GraphBuilder("topk")
    s = b.input("s", dt.f32, [4, 16])
    ok = b.topk_entries(s, None, b.input("p", dt.i64, [4]), topk=4, ratio=2)
    assert ok.shape == (4, 4)
    with pytest.raises(Exception, match="positions"):
        b.topk_entries(s, None, b.input("p3", dt.i64, [3]), topk=4, ratio=2)
    with pytest.raises(Exception, match="positions"):
        b.topk_entries(s, None, b.input("pf", dt.f32, [4]), topk=4)


def test_a_call_without_positions_keeps_the_old_signature():
    """Stored graphs / calls from before the positions input: two inputs, no ratio attribute."""
    s = scores_with_ties(2, 16, seed=1)
    got = get_op("topk_entries").run([s, None], {"topk": 4, "block": 1})[0]
    assert torch.equal(got, oracle(s, torch.tensor([15, 15]), 1, 4))
