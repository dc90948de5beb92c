"""The verifier catches broken graphs and names the node and the problem."""

import copy

import pytest

from deepinfer.errors import ShapeError, VerificationError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.graph import TensorType, Value
from deepinfer.ir.verifier import check, verify


def good_graph():
    b = GraphBuilder("g")
    x = b.input("x", "f32", ["T", 16])
    cache = b.input("cache", "f32", [32, 16])
    slots = b.input("slots", "i64", ["T"])
    w = b.param("layers.0.w.weight", "f32", [8, 16])
    h = b.linear(x, w, name="h")
    a = b.silu(h, name="a")
    s = b.reduce_sum(a, axes=[-1], name="s")
    new_cache = b.scatter_rows(cache, slots, x, name="new_cache")
    b.output(s, new_cache)
    return b.build()


def test_good_graph_passes():
    g = good_graph()
    verify(g)
    assert check(g) == []


def _node(g, out_name):
    return next(n for n in g.nodes if n.outputs[0].name == out_name)


def broken(kind):
    g = copy.deepcopy(good_graph())
    if kind == "use before def":
        g.nodes[0], g.nodes[1] = g.nodes[1], g.nodes[0]
    elif kind == "unknown op":
        _node(g, "a").op = "frobnicate"
    elif kind == "wrong declared shape":
        _node(g, "h").outputs[0].type = TensorType(dt.f32, ("T", 9))
    elif kind == "wrong input count":
        _node(g, "a").inputs.append(g.inputs[0])
    elif kind == "missing attribute":
        del _node(g, "s").attrs["axes"]
    elif kind == "bad attribute type":
        _node(g, "s").attrs["axes"] = "last"
    elif kind == "unknown attribute":
        _node(g, "a").attrs["alpha"] = 1.0
    elif kind == "duplicate name":
        _node(g, "a").outputs[0].name = "h"
    elif kind == "undefined output":
        g.outputs.append(Value("ghost", TensorType(dt.f32, (4,))))
    elif kind == "state read after write":
        n = _node(g, "new_cache")
        reader = copy.copy(_node(g, "a"))
        reader.inputs = [g.inputs[1]]
        reader.outputs = [Value("late", g.inputs[1].type, "node", reader)]
        g.nodes.insert(g.nodes.index(n) + 1, reader)
    elif kind == "dtype mismatch":
        _node(g, "h").inputs[0] = g.inputs[2]
    return g


CASES = {
    "use before def": r"node 0 \(%a = silu\): uses %h before it is defined",
    "unknown op": r"node 1 \(%a = frobnicate\): unknown op 'frobnicate'",
    "wrong declared shape": r"node 0 \(%h = linear\): output 0 %h is declared f32\[T, 9\] but linear gives f32\[T, 8\]",
    "wrong input count": r"node 1 \(%a = silu\): silu takes 1 inputs",
    "missing attribute": r"node 2 \(%s = reduce_sum\): reduce_sum: attribute 'axes' is required",
    "bad attribute type": r"node 2 \(%s = reduce_sum\): reduce_sum: attribute 'axes' must be ints",
    "unknown attribute": r"node 1 \(%a = silu\): silu: unknown attribute 'alpha'",
    "duplicate name": r"node 1 \(%h = silu\): redefines %h",
    "undefined output": r"output %ghost is not defined",
    "state read after write": r"node 4 \(%late = silu\): reads state %cache after node 3 \(%new_cache = scatter_rows\)",
    "dtype mismatch": r"node 0 \(%h = linear\): linear: needs x",
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_broken_graph_is_caught_with_node_named(kind):
    g = broken(kind)
    with pytest.raises(VerificationError, match=CASES[kind]):
        verify(g)
    assert len(check(g)) >= 1


def test_check_reports_every_problem():
    g = broken("unknown op")
    g.outputs.append(Value("ghost", TensorType(dt.f32, (4,))))
    assert len(check(g)) == 2


def test_builder_fails_at_build_time_with_both_shapes():
    b = GraphBuilder("g")
    x = b.input("x", "f32", ["T", 16])
    w = b.param("w", "f32", [8, 12])
    with pytest.raises(ShapeError, match=r"linear.*f32\[T, 16\], f32\[8, 12\]"):
        b.linear(x, w)
    y = b.input("y", "f32", ["S", 16])
    with pytest.raises(ShapeError, match=r"add: shapes do not broadcast \(got f32\[T, 16\], f32\[S, 16\]\)"):
        b.add(x, y)
