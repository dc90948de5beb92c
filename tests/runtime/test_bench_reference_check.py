"""benchmarks/bench_batched_decode.py's reference check (session 9's open 1.72e-2): the batched graph's references
against the one-sequence graph's, both on the same cache storage, with the one-sequence run PINNED at the rounding
flips (an FP8 code or a bf16 element one step off the batched run's) -- a flip's step moves the logits by 1e-3..1e-2,
a storage or row difference stays in the pinned figure. At the small preset's dims (bf16 caches, as at real dims)
on the CPU, references only."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepinfer.passes.cache_storage import ENV
from deepinfer.runtime import cuda_executor

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_for_check_tests", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bbd():
    import sys

    sys.path.insert(0, str(BENCH))  # the bench imports bench_slice by name
    try:
        yield _load("bench_batched_decode")
    finally:
        sys.path.remove(str(BENCH))


def _step_codes(x: torch.Tensor, i: int, k: int) -> torch.Tensor:
    """x (FP8 / bf16) with element i's code moved k steps away from zero."""
    view = torch.uint8 if x.element_size() == 1 else torch.int16
    out = x.clone()
    out.view(view).view(-1)[i] += k
    return out


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_rounding_flips_are_single_steps_in_few_elements(bbd, dtype):
    x = torch.linspace(-3.0, 3.0, 400).to(dtype)
    assert bbd.rounding_flips(x, x.clone()) == 0
    assert bbd.rounding_flips(_step_codes(x, 7, 1), x) == 1 and bbd.rounding_flips(_step_codes(x, 390, 1), x) == 1
    assert bbd.rounding_flips(_step_codes(x, 7, 2), x) is None  # two steps: no rounding flip
    many = x
    for i in range(0, 400, 50):  # 8 of 400 elements: over FLIP_MAX_FRACTION
        many = _step_codes(many, i, 1)
    assert bbd.rounding_flips(many, x) is None
    assert bbd.rounding_flips(x.float(), x.float()) is None  # f32: not a rounding point
    zeros, minus = torch.zeros(200, dtype=dtype), torch.full((200,), -0.0).to(dtype)
    assert bbd.rounding_flips(minus, zeros) == 0  # -0 == +0
    assert bbd.rounding_flips(_step_codes(minus, 3, 1), zeros) == 1  # the smallest negative value, one step off


def test_topk_ties_are_members_that_score_alike(bbd):
    scores = torch.tensor([[0.9, 0.5, 0.5 + 1e-7, 0.1, float("-inf")]])
    top = torch.tensor([[0, 1]])
    assert bbd.topk_ties(top, torch.tensor([[1, 0]]), scores) == 0  # the same members
    assert bbd.topk_ties(top, torch.tensor([[0, 2]]), scores) == 1  # 0.5 vs 0.5 + 1e-7: a tie
    assert bbd.topk_ties(top, torch.tensor([[0, 3]]), scores) is None  # 0.5 vs 0.1: another choice
    assert bbd.topk_ties(top, torch.tensor([[0, -1]]), scores) is None  # a member vs padding


class _RowOp:
    """A one-node stand-in for an executor: y = the FP8 grid value of x * 16 (an op with its own rounding point
    inside, as linear_fp8's activation codes), plus ``bug`` (a wrong op)."""

    def __init__(self, bug: float = 0.0):
        self.params, self.bug = {}, bug

    def _run_node(self, step, args, attrs, t):
        return [(args[0] * 16).to(torch.float8_e4m3fn).float() + self.bug]


def test_a_flip_inside_a_row_wise_op_is_pinned_by_its_replay(bbd):
    """x differs from the pinned run's by 1e-7 (fp32 rounding) and crosses an FP8 rounding boundary inside the op:
    the op's replay on the pinned run's row reproduces that run's output, so the row is pinned and the flip named;
    an op that computes otherwise on the same rows (a bug) is not, nor an input that differs beyond rounding."""
    step = SimpleNamespace(inputs=["x"], outputs=["y"])
    mid = (1.0 + 1.125) / 2 / 16  # x * 16 halfway between two E4M3 codes
    x_pinned = torch.tensor([[mid * (1 - 1e-7), 0.5, -0.25]])
    rows = {"x": x_pinned, "y": _RowOp()._run_node(step, [x_pinned], {}, 1)[0]}
    x_here = x_pinned * torch.tensor([[1 + 2e-7, 1.0, 1.0]])  # rounds the other way
    for ex, x, pinned in ((_RowOp(), x_here, True), (_RowOp(bug=1e-2), x_here, False),
                          (_RowOp(), x_pinned * 1.01, False)):  # fmt: skip
        (y,) = ex._run_node(step, [x], {}, 1)
        assert bbd._rel(y, rows["y"]) > 1e-4
        flips, unexplained = [], {}
        replay = bbd._Replay(ex, step, [x], {}, 1, (rows, 0), unexplained)
        got = bbd._pinned("y", y, "row_op", [x], (rows, 0), flips, replay)
        assert torch.equal(got, rows["y"]) == pinned and (flips == [("y", "row_op, replayed", 1, 3)]) == pinned
        assert ("y" in unexplained) == (ex.bug != 0)  # the bug: replayed, and still off on the batched rows
    # the same op in the batched graph, off on the same rows by a rounding step (its own T = B arithmetic): pinned as
    # T-dependent; off by more (rows mixed: a real bug), or another op there (the rewrite's): not
    for bug, batched_op, pinned in ((1e-3, "row_op", True), (0.5, "row_op", False), (1e-3, "other_op", False)):
        ex, flips = _RowOp(bug=bug), []
        (y,) = ex._run_node(step, [x_pinned], {}, 1)
        pin = ({**rows, "__ops__": {"y": batched_op}}, 0)
        got = bbd._pinned("y", y, "row_op", [x_pinned], pin, flips, bbd._Replay(ex, step, [x_pinned], {}, 1, pin, {}))
        assert torch.equal(got, rows["y"]) == pinned and bool(flips) == pinned, (bug, batched_op)


@pytest.fixture(scope="module")
def small_slice(bbd):
    """The small preset's slice (layers 2 and 6: ratio-2 and ratio-1 sources) with bf16 caches and, the pass off,
    with f32 caches; one weight set; the batched references on B 4 sequences at 300 cached tokens."""
    from deepinfer.runtime.batched_decode import BatchedDecoder

    bs = bbd.bs
    g = bs.slice_graph(layers=bbd.TINY_LAYERS, experts="fp8", preset="small")
    os.environ[ENV] = "0"
    try:
        g32 = bs.slice_graph(layers=bbd.TINY_LAYERS, experts="fp8", preset="small")
    finally:
        os.environ.pop(ENV)
    params = bs.gpu_weights(g, device="cpu")
    dec = BatchedDecoder(g, params, "cpu", max_model_len=301, compiled=False)
    feeds = bbd.batched_feeds(dec, 4, 300, "cpu", seed=1)
    return SimpleNamespace(g=g, g32=g32, params=params, dec=dec, eager=dec.exec, feeds=feeds)


def _check(bbd, st, g=None):
    torch.set_num_threads(1)
    return bbd.reference_check(SimpleNamespace(**{**vars(st), "g": g or st.g}), st.feeds)


def test_both_references_store_the_caches_alike(bbd, small_slice):
    """The batched graph is the one-sequence graph's rewrite: every cache in the same dtype (bf16 where the pass
    stores it), and cache_storage's casts of the written rows in both -- no reference rounds what the other keeps."""
    st = small_slice
    caches = {e["name"] for e in st.g.meta["caches"]}
    single = {v.name: v.dtype for v in st.g.inputs if v.name in caches}
    batched = {v.name: v.dtype for v in st.dec.graph.inputs if v.name in caches}
    assert single == batched and "bf16" in {d.name for d in single.values()}
    casts = [n for n in st.g.nodes if n.op == "cast"]
    assert casts and len(casts) == len([n for n in st.dec.graph.nodes if n.op == "cast"])
    chk = _check(bbd, st)
    assert chk["pinned"] <= 1e-5, bbd.format_check(chk)
    compared = {op for name, op in bbd._row_values(st.eager, st.feeds, 1)["__order__"]}
    assert {"topk_entries", "moe_gate_route", "cast", "fused_attention"} <= compared  # choices and rounding points


class _FlipsOneCode(cuda_executor.GraphExecutor):
    """A one-sequence executor whose first attention output (FP8 codes) has its largest code one step smaller: the
    rounding flip a ~1e-7 difference makes at a code boundary."""

    def _run_node(self, step, args, attrs, t):
        outs = super()._run_node(step, args, attrs, t)
        if step.node.op == "fused_attention" and step.outputs[0] == self.first_attention and t == 1:
            codes = outs[0]
            i = int(codes.float().abs().argmax())
            outs = [_step_codes(codes, i, -1), *outs[1:]]
        return outs

    @property
    def first_attention(self) -> str:
        return next(n for n in self.graph.nodes if n.op == "fused_attention").outputs[0].name


def test_check_pins_a_flipped_code_and_keeps_another_storage(bbd, small_slice, monkeypatch):
    """A flipped FP8 code of the one-sequence run's attention moves the logits beyond the check's 1e-4, and the pinned
    figure takes it out (the flip named); a one-sequence reference on f32 caches -- the batched one rounding its
    written KV rows to bf16, the other not (reading (a) of session 9) -- stays 1e-2 off, pinned or not."""
    st = small_slice
    monkeypatch.setattr(cuda_executor, "GraphExecutor", _FlipsOneCode)
    flipped = _check(bbd, st)
    monkeypatch.undo()
    name = _FlipsOneCode.first_attention.fget(SimpleNamespace(graph=st.g))
    assert flipped["batched_vs_single"] > 1e-4 and flipped["pinned"] <= 1e-5, bbd.format_check(flipped)
    assert flipped["left"] == [None, None], flipped["left"]
    assert all(fl[0][:3] == (name, "fused_attention", 1) for fl in flipped["flips"]), flipped["flips"]
    assert all(d and d.startswith(name) for d in flipped["first_divergence"]), flipped["first_divergence"]
    other = _check(bbd, st, g=st.g32)
    assert other["pinned"] > 1e-3 and any(other["left"]), bbd.format_check(other)
