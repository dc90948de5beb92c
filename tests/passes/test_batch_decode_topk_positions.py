"""The V4.1 graph's topk_entries take the queries' positions (issues 6/8), and what that lets the passes do:
select_kernels binds topk_select with has_pos and the op's ratio, and the index scores whose only readers are such
top-ks get "fill": False (their dead columns need not be written) -- the candidate source's scores too, since
candidate_blocks counts only the visible columns (session 10); batch_decode keeps the positions on the batched graph's
top-k (row-wise)."""

from __future__ import annotations

import pytest

from deepinfer.compiler import compile_model
from deepinfer.models import deepseek_v41 as m41
from deepinfer.models.presets import preset_config
from deepinfer.passes.batch_decode import batch_decode
from deepinfer.passes.pattern import clone_graph
from deepinfer.passes.select_kernels import select_kernels


@pytest.fixture(scope="module")
def v41():
    return m41.build_graph(m41.parse_config(preset_config("deepseek-v4.1-flash", "tiny")))


def _by_op(g, op):
    return [n for n in g.nodes if n.op == op]


def test_every_topk_entries_reads_the_positions_with_its_scores_ratio(v41):
    tops = _by_op(v41, "topk_entries")
    assert tops
    for n in tops:
        scores = n.inputs[0].producer
        assert scores.op == "index_scores"
        assert n.inputs[2].name == "positions" and n.attrs["ratio"] == scores.attrs["ratio"]


def test_bindings_have_positions_and_fill_only_where_every_reader_is_positions_aware(v41):
    g = select_kernels(clone_graph(v41), target="sm90")
    bound = g.meta["kernels"]["nodes"]
    users = g.users()
    checked = {"off": 0, "on": 0}
    for n in _by_op(g, "index_scores"):
        name = n.outputs[0].name
        readers = {u.op for u in users[name]}
        fills = {b["config"].get("fill", True) for b in bound[name]["buckets"].values()}
        want = not readers <= {"topk_entries", "candidate_blocks"}  # (every reader positions-aware: no fill)
        assert fills == {want}, (name, readers, fills)
        checked["on" if want else "off"] += 1
        checked["candidate source"] = checked.get("candidate source", 0) + ("candidate_blocks" in readers)
    assert checked["off"] >= 2 and checked["candidate source"] == 1, checked  # ("on": the next test)
    for n in _by_op(g, "topk_entries"):
        b = bound[n.outputs[0].name]["buckets"]["decode"]
        assert b["family"] == "topk_select"
        if n.inputs[1] is None:  # one level: the kernel with positions
            assert b["shape"]["has_pos"] and b["shape"]["ratio"] == n.attrs["ratio"]
        else:  # two-level: the candidate blocks' columns (fewer than the row's here)
            assert b["shape"]["candidates"] < b["shape"]["C"] and "has_pos" not in b["shape"]


def test_a_topk_without_positions_keeps_the_fill(v41):
    """A graph whose top-k has no positions (e.g. built before them): the scores keep the op's -inf."""
    g = clone_graph(v41)
    for n in _by_op(g, "topk_entries"):
        n.inputs[2] = None
    g = select_kernels(g, target="sm90")
    bound = g.meta["kernels"]["nodes"]
    for n in _by_op(g, "index_scores"):
        assert all(b["config"].get("fill", True) for b in bound[n.outputs[0].name]["buckets"].values())
    for n in _by_op(g, "topk_entries"):
        assert "has_pos" not in (bound[n.outputs[0].name]["buckets"]["decode"].get("shape") or {})


def test_the_batched_graph_keeps_the_positions_on_its_top_k():
    g = batch_decode(compile_model("deepseek-v4.1-flash:tiny", "cpu").plan.graph)
    assert _by_op(g, "topk_entries")
    for n in _by_op(g, "topk_entries"):
        assert n.inputs[0].producer.op == "batched_index_scores"
        assert n.inputs[2].name == "positions"
