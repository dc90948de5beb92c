"""Phase 0 passes on small hand-built graphs: dce, cse, fold_constants, specialize_shapes."""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.interpreter import run
from deepinfer.ir.verifier import verify
from deepinfer.passes.pipeline import run_pass


def _ops(g):
    return [n.op for n in g.nodes]


def test_dce_removes_dead_nodes_and_keeps_live_stateful_ones():
    b = GraphBuilder("g")
    cache = b.input("cache", "f32", [8, 4])
    idx, rows = b.input("idx", "i64", ["T"]), b.input("rows", "f32", ["T", 4])
    b.exp(b.neg(rows))  # dead chain
    new_cache = b.scatter_rows(cache, idx, rows)  # live: its new state is an output
    b.output(b.silu(rows), new_cache)
    g = run_pass(b.build(), "dce")
    assert _ops(g) == ["scatter_rows", "silu"]


def test_dce_removes_a_write_whose_state_is_never_output():
    b = GraphBuilder("g")
    cache, idx = b.input("cache", "f32", [8, 4]), b.input("idx", "i64", [2])
    rows = b.input("rows", "f32", [2, 4])
    b.scatter_rows(cache, idx, rows)
    b.output(b.silu(rows))
    assert _ops(run_pass(b.build(), "dce")) == ["silu"]


def test_cse_merges_duplicates_and_chains():
    b = GraphBuilder("g")
    x = b.input("x", "f32", ["T", 4])
    a1, a2 = b.silu(x), b.silu(x)
    c1, c2 = b.scale(a1, factor=2.0), b.scale(a2, factor=2.0)  # equal once a1/a2 merge
    d = b.scale(a2, factor=3.0)  # different attribute: kept
    b.output(b.add(c1, c2), d, c2)
    g0 = b.build()
    g = run_pass(copy.deepcopy(g0), "cse")
    assert _ops(g) == ["silu", "scale", "scale", "add"]
    assert g.outputs[2].name == g.nodes[1].outputs[0].name
    x_t = torch.randn(3, 4)
    for a, e in zip(run(g, {"x": x_t}), run(g0, {"x": x_t})):
        assert torch.equal(a, e)


def test_cse_never_merges_stateful_ops():
    b = GraphBuilder("g")
    c1, c2 = b.input("c1", "f32", [8, 4]), b.input("c2", "f32", [8, 4])
    idx, rows = b.input("idx", "i64", [2]), b.input("rows", "f32", [2, 4])
    w1 = b.scatter_rows(c1, idx, rows)
    # same op, inputs and attributes as w1, but a write (the verifier would also reject the graph)
    w2 = b.scatter_rows(c1, idx, rows)
    b.output(w1, w2, c2)
    g = b.build(verify=False)
    assert _ops(run_pass(g, "cse", verify=False)) == ["scatter_rows", "scatter_rows"]


def test_fold_constants_full_and_arange_chains():
    b = GraphBuilder("g")
    x = b.input("x", "f32", [4])
    ones = b.full(shape=[4], value=1.0)
    twos = b.scale(b.add(ones, ones), factor=1.0)  # all 2.0: one `full`
    ramp = b.cast(b.arange(end=4), dtype="f32")  # 0, 1, 2, 3: a small `constant`
    y = b.input("y", "f32", ["T"])
    sym = b.add(y, b.full(shape=["T"], value=0.5))  # symbolic: not folded
    b.output(b.add(b.mul(x, twos), ramp), sym)
    g0 = b.build()
    g = run_pass(run_pass(copy.deepcopy(g0), "fold_constants"), "dce")
    assert sorted(_ops(g)) == ["add", "add", "constant", "full", "full", "mul"]
    folded = {n.op: n for n in g.nodes if n.op in ("constant",)}
    assert folded["constant"].attrs["values"] == [0.0, 1.0, 2.0, 3.0]
    assert any(n.op == "full" and n.attrs["value"] == 2.0 for n in g.nodes)
    inputs = {"x": torch.randn(4), "y": torch.randn(3)}
    for a, e in zip(run(g, inputs, check=True), run(g0, inputs, check=True)):
        assert torch.equal(a, e)


def test_fold_constants_keeps_integer_dtypes_exact():
    b = GraphBuilder("g")
    big = b.scale(b.cast(b.arange(end=3, start=0), dtype="f32"), factor=1.0, bias=16777216.0)
    b.output(b.cast(big, dtype="i64"))
    g0 = b.build()
    g = run_pass(run_pass(copy.deepcopy(g0), "fold_constants"), "dce")
    assert _ops(g) == ["constant"]
    assert torch.equal(run(g, {})[0], run(g0, {})[0])


def _sym_graph():
    b = GraphBuilder("g")
    x = b.input("x", "f32", ["T", 8])
    h = b.reshape(x, shape=["T", 2, 4])
    h = b.slice(h, axis=0, start=0, end="(T+1)//2")
    b.output(b.rmsnorm(h, eps=1e-6))
    return b.build()


def test_specialize_shapes_gives_concrete_shapes_and_the_same_numbers():
    g0 = _sym_graph()
    g = run_pass(copy.deepcopy(g0), "specialize_shapes", {"T": 5})
    verify(g)
    assert g.inputs[0].shape == (5, 8) and g.outputs[0].shape == (3, 2, 4)
    assert g.nodes[0].attrs["shape"] == [5, 2, 4] and g.nodes[1].attrs["end"] == 3
    assert g.meta["bucket"] == {"T": 5} and not g.symbols()
    x = torch.randn(5, 8)
    assert torch.equal(run(g, {"x": x}, check=True)[0], run(g0, {"x": x}, check=True)[0])


def test_specialize_shapes_rejects_bad_values():
    with pytest.raises(ConfigError, match="T must be a positive integer"):
        run_pass(_sym_graph(), "specialize_shapes", {"T": 0})
