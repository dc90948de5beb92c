"""The pattern language: op names, attribute predicates, wildcards, captures, single-use, rewrite."""

from __future__ import annotations

from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.verifier import verify
from deepinfer.passes.pattern import Absent, Any, Op, find_matches, replace


def _graph(extra_user: bool = False):
    b = GraphBuilder("g")
    x = b.input("x", "f32", ["T", 64])
    w = b.param("w", "f32", [64])
    n = b.rmsnorm(x, w, eps=1e-5, name="n")
    q, s = b.quant_fp8(n, group=32, name="q")
    outs = [q, s]
    if extra_user:
        outs.append(b.silu(n, name="other"))
    b.output(*outs)
    return b.build()


NORM_QUANT = Op("quant_fp8", Op("rmsnorm", Any("x"), Any("w"), capture="norm", single_use=True), capture="quant")


def test_match_binds_captures():
    g = _graph()
    (m,) = find_matches(g, NORM_QUANT)
    assert m["x"].name == "x" and m["w"].name == "w"
    assert m.node("norm").op == "rmsnorm" and m.root is m.node("quant")
    assert [n.op for n in m.nodes] == ["quant_fp8", "rmsnorm"]


def test_single_use_constraint_is_respected():
    assert find_matches(_graph(extra_user=True), NORM_QUANT) == []
    free = Op("quant_fp8", Op("rmsnorm", Any("x"), Any("w")))
    assert len(find_matches(_graph(extra_user=True), free)) == 1


def test_single_use_fails_when_the_value_is_a_graph_output():
    g = _graph()
    g.outputs.append(g.nodes[0].outputs[0])
    assert find_matches(g, NORM_QUANT) == []


def test_attribute_values_and_predicates():
    g = _graph()
    assert len(find_matches(g, Op("quant_fp8", attrs={"group": 32}))) == 1
    assert find_matches(g, Op("quant_fp8", attrs={"group": 128})) == []
    assert len(find_matches(g, Op("rmsnorm", attrs={"eps": lambda e: e < 1e-4}))) == 1
    assert find_matches(g, Op("rmsnorm", attrs={"eps": lambda e: e > 1e-4})) == []
    assert find_matches(g, Op("rmsnorm", attrs={"nope": 1})) == []


def test_same_capture_must_bind_the_same_value():
    b = GraphBuilder("g")
    x, y = b.input("x", "f32", [4]), b.input("y", "f32", [4])
    b.output(b.add(x, x, name="xx"), b.add(x, y, name="xy"))
    g = b.build()
    ms = find_matches(g, Op("add", Any("a"), Any("a")))
    assert [m.root.outputs[0].name for m in ms] == ["xx"]
    assert len(find_matches(g, Op(("add", "mul"), Any("a"), Any("b")))) == 2


def test_absent_optional_wildcard_and_ellipsis():
    b = GraphBuilder("g")
    x, w = b.input("x", "f32", [2, 8]), b.param("w", "f32", [4, 8])
    bias = b.param("bias", "f32", [4])
    b.output(b.linear(x, w, name="nb"), b.linear(x, w, bias, name="wb"))
    g = b.build()
    names = lambda p: [m.root.outputs[0].name for m in find_matches(g, p)]  # noqa: E731
    assert names(Op("linear", Any(), Any(), Absent())) == ["nb"]
    assert names(Op("linear", Any(), Any(), Any())) == ["wb"]
    assert names(Op("linear", Any(), Any(), Any(optional=True))) == ["nb", "wb"]
    assert names(Op("linear", Any("x"), ...)) == ["nb", "wb"]
    assert names(Op("linear", Any(where=lambda v: v.name == "w"), ...)) == []


def test_matches_do_not_overlap():
    b = GraphBuilder("g")
    x = b.input("x", "f32", [4])
    b.output(b.silu(b.silu(b.silu(x))))
    g = b.build()
    assert len(find_matches(g, Op("silu", Op("silu", Any())))) == 1


def test_replace_keeps_names_and_ssa():
    g = _graph()
    (m,) = find_matches(g, NORM_QUANT)
    new = replace(g, m, "rmsnorm_quant_fp8", [m["x"], m["w"]], {"eps": 1e-5, "group": 32})
    assert [o.name for o in new.outputs] == ["q.0", "q.1"] and all(o.producer is new for o in new.outputs)
    assert [n.op for n in g.nodes] == ["rmsnorm_quant_fp8"] and [v.name for v in g.outputs] == ["q.0", "q.1"]
    verify(g)


def test_replace_keeps_interior_nodes_that_are_still_used():
    g = _graph(extra_user=True)
    (m,) = find_matches(g, Op("quant_fp8", Op("rmsnorm", Any("x"), Any("w"), capture="norm"), capture="quant"))
    replace(g, m, "rmsnorm_quant_fp8", [m["x"], m["w"]], {"eps": 1e-5, "group": 32})
    assert sorted(n.op for n in g.nodes) == ["rmsnorm", "rmsnorm_quant_fp8", "silu"]
    verify(g)
