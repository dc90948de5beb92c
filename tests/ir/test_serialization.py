"""Text, JSON and ONNX forms of a graph: exact round trips, the ONNX checker and ReferenceEvaluator, bad input."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import onnx
import pytest
import torch

from deepinfer.cli import main
from deepinfer.errors import DeepInferError, ParseError, SerializationError
from deepinfer.ir import dtypes as dt
from deepinfer.ir import interpreter
from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.graph import TensorType
from deepinfer.ir.load import load_any
from deepinfer.ir.onnx_io import export_onnx, import_onnx, reference_evaluator, to_numpy
from deepinfer.ir.parser import parse_graph
from deepinfer.ir.printer import print_graph
from deepinfer.ir.registry import Attr, has_op, register_op
from deepinfer.ir.serialize import dumps, graph_from_dict, graph_to_dict, load_json, loads, save_json

CUSTOM = "test_custom_gelu"

if not has_op(CUSTOM):

    @register_op(CUSTOM, "x, bias?", {"approximate": Attr("str", "none"), "alpha": Attr("float", 1.0)})
    class _TestCustomGelu:
        """Test-only op: gelu(alpha * x + bias)."""

        def infer(x, bias, *, approximate, alpha):
            return x

        def reference(x, bias, *, approximate, alpha):
            y = x * alpha if bias is None else x * alpha + bias
            return torch.nn.functional.gelu(y, approximate=approximate)


def big_graph():
    """27 nodes: symbolic dims, multi-output ops, absent optional inputs, fp8/e8m0/fp4, a cache write, a custom op."""
    b = GraphBuilder("serialization_test", meta={"model": "tiny", "layers": 2, "rope_theta": 1e4})
    x = b.input("x", "f32", ["T", 64])
    ids = b.input("ids", "i64", ["T"])
    pos = b.input("pos", "i64", ["T"])
    cache = b.input("layers.0.attn.kv_cache", "f32", ["S", 64])
    slots = b.input("slots", "i64", ["T"])
    emb = b.param("embed.weight", "f32", [100, 64])
    norm_w = b.param("layers.0.attn_norm.weight", "f32", [64])
    w1 = b.param("layers.0.attn.wq_a.weight", "f32", [128, 64])
    w8 = b.param("layers.0.ffn.w1.weight", "f8e4m3", [64, 64])
    s8 = b.param("layers.0.ffn.w1.scale", "e8m0", [2, 2])
    w4 = b.param("layers.0.ffn.experts.0.w2.weight", "f4e2m1x2", [32, 32])
    s4 = b.param("layers.0.ffn.experts.0.w2.scale", "e8m0", [32, 2])
    T = x.shape[0]

    e = b.embedding(emb, ids)
    h = b.add(x, e)
    n = b.rmsnorm(h, norm_w, eps=1e-20)
    q, qs = b.quant_fp8(n, group=32)
    dq = b.dequant_fp8(q, qs, group=32, dtype=dt.f32)
    l1 = b.linear(dq, w1)  # no bias
    a = b.op(CUSTOM, l1, approximate="tanh", alpha=0.1 + 0.2)
    p0, p1 = b.split(a, axis=1, sizes=[64, 64])
    m = b.mul(p0, p1)
    l8 = b.linear_fp8(m, w8, s8, block=32, act_group=32)
    l4 = b.linear_fp4(l8, w4, s4, group=32)
    fq = b.fake_quant_fp4(l4, group=32)
    r = b.reshape(fq, shape=[T, 4, -1])
    tr = b.transpose(r, perm=[1, 0, 2])
    sm = b.softmax(tr, axis=-1)
    tv, ti = b.topk(sm, k=2, axis=-1, largest=True)
    mx = b.reduce_max(sm, axes=[-1], keepdim=True)
    sl = b.slice(h, axis=0, start=0, end=T // 2)
    cat = b.concat(sl, sl, axis=0)
    new_cache = b.scatter_rows(cache, slots, h, name="layers.0.attn.kv_cache.new")
    ar = b.arange(end=T)
    same = b.eq(ar, pos)
    cs = b.cumsum(pos, axis=0)
    cl = b.clamp(m, min=-3.5)  # max stays None
    sc = b.scale(cl, factor=1e-20, bias=math.inf)
    nan = b.full(shape=[T, 2], value=math.nan)
    g2 = b.op(CUSTOM, cl, None)
    b.output(tv, ti, mx, cat, new_cache, same, cs, sc, nan, g2)
    return b.build()


def make_inputs(T=6, S=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    inputs = {
        "x": torch.randn(T, 64, generator=gen),
        "ids": torch.randint(0, 100, (T,), generator=gen),
        "pos": torch.tensor([0, 1, 5, 3, 4, 2][:T]),
        "layers.0.attn.kv_cache": torch.randn(S, 64, generator=gen),
        "slots": torch.tensor([3, -1, 0, 7, 9, 1][:T]),
    }
    params = {
        "embed.weight": torch.randn(100, 64, generator=gen),
        "layers.0.attn_norm.weight": torch.randn(64, generator=gen),
        "layers.0.attn.wq_a.weight": torch.randn(128, 64, generator=gen) / 8,
        "layers.0.ffn.w1.weight": dt.float_to_fp8(torch.randn(64, 64, generator=gen) * 100),
        "layers.0.ffn.w1.scale": dt.float_to_e8m0(torch.tensor([[2.0**-8, 2.0**-7], [2.0**-9, 2.0**-6]])),
        "layers.0.ffn.experts.0.w2.weight": dt.float_to_fp4(torch.randn(32, 64, generator=gen) * 3),
        "layers.0.ffn.experts.0.w2.scale": dt.float_to_e8m0(2.0 ** torch.randint(-6, -2, (32, 2), generator=gen)),
    }
    return inputs, params


@pytest.fixture(scope="module")
def graph():
    return big_graph()


def test_graph_has_what_the_round_trips_must_cover(graph):
    ops = {n.op for n in graph.nodes}
    assert len(graph.nodes) >= 20
    assert {CUSTOM, "scatter_rows", "quant_fp8", "linear_fp8", "linear_fp4", "topk", "split"} <= ops
    assert any(n.op == "linear" and n.inputs[2] is None for n in graph.nodes)
    dtypes = {v.dtype.name for v in graph.values().values()}
    assert {"f8e4m3", "e8m0", "f4e2m1x2", "bool", "i64"} <= dtypes
    assert "T//2" in print_graph(graph) and "2*(T//2)" in print_graph(graph)


# ---------------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------------


def test_text_round_trip(graph):
    text = print_graph(graph)
    g2 = parse_graph(text)
    assert g2 == graph
    assert print_graph(g2) == text
    # node outputs know their producer, and the values are shared objects
    for n in g2.nodes:
        assert all(o.producer is n for o in n.outputs)
    assert g2.nodes[1].inputs[0] is g2.inputs[0]


def test_text_attrs_are_parsed_by_kind(graph):
    g2 = parse_graph(print_graph(graph))
    by_op = {n.op: n for n in g2.nodes}
    assert by_op["dequant_fp8"].attrs["dtype"] is dt.f32
    assert by_op["reshape"].attrs["shape"] == [graph.inputs[0].shape[0], 4, -1]
    assert by_op["slice"].attrs["end"] == graph.inputs[0].shape[0] // 2
    assert by_op["rmsnorm"].attrs["eps"] == 1e-20
    assert by_op["scale"].attrs["bias"] == math.inf
    assert math.isnan(by_op["full"].attrs["value"])
    assert by_op["clamp"].attrs["max"] is None
    custom = next(n for n in g2.nodes if n.op == CUSTOM)
    assert custom.attrs["alpha"] == 0.1 + 0.2  # 0.30000000000000004, exact


def test_text_accepts_hand_written_forms():
    text = """
    # a comment
    graph g {
      input %a.b_0: bf16[T, 8]

      %y: bf16[T, 8] = rmsnorm(%a.b_0) {eps=1}
      %z: bf16[min(T, 4), 8] = slice(%y) {axis=0, start=0, end=min(T, 4)}
      output %z
    }
    """
    g = parse_graph(text)
    assert g.nodes[0].inputs == [g.inputs[0]]  # trailing optional input omitted
    assert g.nodes[0].attrs == {"eps": 1.0}
    assert g.nodes[1].outputs[0].type == TensorType(dt.bf16, ("min(T, 4)", 8))
    assert parse_graph(print_graph(g)) == g


def test_json_round_trip(graph, tmp_path):
    text = dumps(graph)
    json.loads(text)  # plain JSON (no NaN/Infinity literals)
    assert "NaN" not in text and "Infinity" not in text
    g2 = loads(text)
    assert g2 == graph
    assert dumps(g2) == text
    d = graph_to_dict(graph)
    assert d["format"] == "deepinfer.graph" and d["version"] == 1
    assert graph_from_dict(json.loads(json.dumps(d))) == graph
    path = tmp_path / "g.json"
    save_json(graph, path)
    assert load_json(path) == graph
    assert load_any(path) == graph


def test_plan_directory(graph, tmp_path):
    (tmp_path / "plan.json").write_text(
        json.dumps({"format": "deepinfer.plan", "target": "cpu", "graph": graph_to_dict(graph)})
    )
    assert load_any(tmp_path) == graph
    assert load_json(tmp_path / "plan.json") == graph


def test_onnx_round_trip_and_checker(graph, tmp_path):
    model = export_onnx(graph)
    onnx.checker.check_model(model, full_check=False)
    domains = {o.domain: o.version for o in model.opset_import}
    assert "deepinfer" in domains and "" in domains
    assert all(n.domain == "deepinfer" for n in model.graph.node)
    assert any(d.dim_param == "T" for d in model.graph.input[0].type.tensor_type.shape.dim)
    elem = {vi.name: vi.type.tensor_type.elem_type for vi in list(model.graph.input) + list(model.graph.value_info)}
    assert elem["layers.0.ffn.w1.weight"] == onnx.TensorProto.FLOAT8E4M3FN
    assert elem["layers.0.ffn.w1.scale"] == onnx.TensorProto.FLOAT8E8M0
    assert elem["layers.0.ffn.experts.0.w2.weight"] == onnx.TensorProto.UINT8
    props = {p.key: p.value for p in model.metadata_props}
    assert json.loads(props["deepinfer.meta"]) == graph.meta
    # exact floats: a float64 tensor attribute, not a float32 FLOAT
    rms = next(n for n in model.graph.node if n.op_type == "rmsnorm")
    assert rms.attribute[0].type == onnx.AttributeProto.TENSOR

    assert import_onnx(model) == graph
    path = tmp_path / "g.onnx"
    export_onnx(graph, path=path)
    assert import_onnx(path) == graph
    assert load_any(path) == graph
    assert import_onnx(model.SerializeToString()) == graph


def test_onnx_with_initializers(graph):
    _, params = make_inputs()
    model = export_onnx(graph, params)
    onnx.checker.check_model(model, full_check=False)
    assert {t.name for t in model.graph.initializer} == set(params)
    assert not {vi.name for vi in model.graph.input} & set(params)
    assert import_onnx(model) == graph


def test_reference_evaluator_matches_interpreter(graph):
    inputs, params = make_inputs()
    want = interpreter.run(graph, inputs, params, check=True)
    ev = reference_evaluator(graph, params)
    got = ev.run(None, {k: v.numpy() for k, v in inputs.items()})
    assert len(got) == len(want)
    for v, a, w in zip(graph.outputs, got, want):
        assert torch.equal(torch.from_numpy(np.asarray(a)), w) or torch.allclose(
            torch.from_numpy(np.asarray(a)), w, rtol=0, atol=0, equal_nan=True
        ), v.name
    # The cache write happened, and the evaluator also works with parameters fed as inputs.
    ev2 = reference_evaluator(graph)
    feeds = {k: v.numpy() for k, v in inputs.items()} | {k: to_numpy(v) for k, v in params.items()}
    got2 = ev2.run(None, feeds)
    for a, w in zip(got2, want):
        assert torch.allclose(torch.from_numpy(np.asarray(a)), w, rtol=0, atol=0, equal_nan=True)
    # A different T rebinds the symbols (slice end T//2, arange T, full [T, 2]).
    inputs4, _ = make_inputs(T=4)
    got4 = ev.run(None, {k: v.numpy() for k, v in inputs4.items()})
    want4 = interpreter.run(graph, inputs4, params)
    for a, w in zip(got4, want4):
        assert torch.allclose(torch.from_numpy(np.asarray(a)), w, rtol=0, atol=0, equal_nan=True)


KINDS_OP = "test_custom_all_attr_kinds"

if not has_op(KINDS_OP):

    @register_op(
        KINDS_OP,
        "x",
        {
            "i": Attr("int"),
            "f": Attr("float"),
            "b": Attr("bool"),
            "s": Attr("str"),
            "ii": Attr("ints"),
            "ff": Attr("floats"),
            "ss": Attr("strs"),
            "d": Attr("dtype"),
            "n": Attr("dim"),
            "shape": Attr("shape"),
            "opt": Attr("float", None),
        },
    )
    class _TestAllKinds:
        """Test-only op carrying one attribute of every kind; returns x."""

        def infer(x, **attrs):
            return x

        def reference(x, **attrs):
            return x


EDGE_ATTRS = [
    dict(
        i=-(2**62),
        f=5e-324,
        b=False,
        s='a "quoted", {braced} } é\n',
        ii=[],
        ff=[],
        ss=[],
        d=dt.f4e2m1x2,
        n=-1,
        shape=[],
    ),
    dict(
        i=0,
        f=-0.0,
        b=True,
        s="",
        ii=[-1, 2**40],
        ff=[math.nan, -math.inf, 1e-300, 0.1, 1 / 3],
        ss=["", "x,y"],
        d=dt.e8m0,
        n="min(T, 512)",
        shape=["2*(T//4)+1", "max(S, T)", "S%8", -1, 0],
        opt=1.5,
    ),
]


@pytest.mark.parametrize("attrs", EDGE_ATTRS)
def test_every_attr_kind_round_trips_exactly(attrs):
    b = GraphBuilder("kinds")
    x = b.input("x", "f32", ["T", "S"])
    b.output(b.op(KINDS_OP, x, **attrs))
    g = b.build()
    text = print_graph(g)
    assert parse_graph(text) == g and print_graph(parse_graph(text)) == text
    assert loads(dumps(g)) == g
    model = export_onnx(g)
    onnx.checker.check_model(model, full_check=False)
    g2 = import_onnx(model.SerializeToString())
    assert g2 == g and print_graph(g2) == text
    f2 = g2.nodes[0].attrs["f"]
    assert math.copysign(1.0, f2) == math.copysign(1.0, attrs["f"]) and f2 == attrs["f"]


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------

GOOD = """graph "g" {
  input %x: f32[T, 8]
  param %w: f32[4, 8]
  %0: f32[T, 4] = linear(%x, %w, _)
  %1: f32[T, 2], %2: i64[T, 2] = topk(%0) {k=2, axis=-1, largest=true}
  output %1, %2
}
"""


def _broken(line: int, old: str, new: str) -> str:
    lines = GOOD.splitlines(keepends=True)
    assert old in lines[line - 1]
    lines[line - 1] = lines[line - 1].replace(old, new, 1)
    return "".join(lines)


BAD_TEXT = [
    # (text, line, the text the column points at, words in the message)
    (_broken(4, "linear", "linaer"), 4, "linaer", "unknown op 'linaer'"),
    (_broken(4, "%w, _", "%v, _"), 4, "%v", "undefined value %v"),
    (_broken(2, "f32[T, 8]", "f33[T, 8]"), 2, "f33", "unknown dtype 'f33'"),
    (_broken(2, "f32[T, 8]", "f32[T, 8"), 2, "\n", "expected ',' or ']'"),
    (_broken(3, "[4, 8]", "[4+, 8]"), 3, "4+", "bad dimension"),
    (_broken(5, "k=2", "k=2+"), 5, "2+", "bad dimension"),
    (_broken(5, "axis=-1", "axis=1.5"), 5, "1.5", "expected an integer"),
    (_broken(5, "largest=true", "largest=yes"), 5, "yes", "expected true or false"),
    (_broken(5, "largest=true", "biggest=true"), 5, "biggest", "topk has no attribute 'biggest'"),
    (_broken(5, "{k=2, ", "{"), 5, "{", "attribute 'k' is required"),
    (_broken(4, "%x, %w, _", "%x"), 4, "linear", "linear takes"),
    (_broken(6, "%1, %2", "%1, %9"), 6, "%9", "undefined value %9"),
    (_broken(4, "%0: f32", "%x: f32"), 4, "%x", "%x is already defined (line 2)"),
    (_broken(2, "input", "inptu"), 2, "inptu", "unknown statement 'inptu'"),
    (_broken(5, "largest=true}", "largest=true"), 5, "\n", "expected ',' or '}'"),
    (GOOD[: GOOD.rindex("}")], 6, "\n", "missing closing '}'"),
    (GOOD + "extra\n", 8, "extra", "after the closing"),
    (_broken(1, 'graph "g" {', 'graph "g"'), 1, "\n", "expected '{'"),
    (_broken(4, "f32[T, 4]", "f32[T, 4]]"), 4, "] =", "expected '=' after the node's outputs"),
    (_broken(5, "{k=2", '{k="2"'), 5, '"2"', "unexpected string"),
]


@pytest.mark.parametrize("text, line, anchor, words", BAD_TEXT)
def test_malformed_text(text, line, anchor, words):
    with pytest.raises(ParseError) as e:
        parse_graph(text, source="bad.dil")
    msg = str(e.value)
    src_line = text.splitlines(keepends=True)[line - 1] if anchor != "\n" or line <= len(text.splitlines()) else ""
    col = (src_line + "\n").index(anchor) + 1
    assert "\n" not in msg
    assert msg.startswith(f"bad.dil:{line}:{col}: "), msg
    assert words in msg, msg


def test_good_text_parses():
    g = parse_graph(GOOD)
    assert print_graph(g) == GOOD


def test_json_missing_and_bad_fields(graph):
    d = graph_to_dict(graph)
    del d["nodes"][3]["op"]
    with pytest.raises(SerializationError, match=r"^plan\.json: graph\.nodes\[3\]\.op: missing field$"):
        loads(json.dumps({"graph": d}), "plan.json")

    d = graph_to_dict(graph)
    i = next(i for i, n in enumerate(d["nodes"]) if n["op"] == CUSTOM)
    d["nodes"][i]["attrs"]["alpha"]["value"] = "lots"
    with pytest.raises(SerializationError, match=rf"^nodes\[{i}\]\.attrs\.alpha\.value: expected a number"):
        graph_from_dict(d)

    d = graph_to_dict(graph)
    d["inputs"][0]["shape"][0] = "T+"
    with pytest.raises(SerializationError, match=r"^inputs\[0\]\.shape\[0\]: bad dimension"):
        graph_from_dict(d)

    d = graph_to_dict(graph)
    d["nodes"][2]["op"] = "no_such_op"
    with pytest.raises(SerializationError, match=r"^nodes\[2\]\.op: unknown op 'no_such_op'"):
        graph_from_dict(d)

    d = graph_to_dict(graph)
    del d["version"]
    with pytest.raises(SerializationError, match=r"^version: missing field"):
        graph_from_dict(d)

    with pytest.raises(SerializationError, match=r"^x\.json:1:2: bad JSON"):
        loads("{,}", "x.json")


def _unknown_op_model(graph):
    model = export_onnx(graph)
    model.graph.node[3].op_type = "no_such_op"
    return model


def test_onnx_unknown_op(graph):
    with pytest.raises(SerializationError) as e:
        import_onnx(_unknown_op_model(graph))
    msg = str(e.value)
    assert "node 3 (%3 = no_such_op)" in msg and "unknown op 'deepinfer.no_such_op'" in msg and "\n" not in msg

    model = export_onnx(graph)
    model.graph.node[0].domain = "com.other"
    with pytest.raises(SerializationError, match="node 0 .*unknown op 'com.other.embedding'"):
        import_onnx(model)


def test_onnx_standard_ops_map():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["T", 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["T", 4])
    nodes = [onnx.helper.make_node("Relu", ["x"], ["r"]), onnx.helper.make_node("Add", ["r", "x"], ["y"])]
    model = onnx.helper.make_model(onnx.helper.make_graph(nodes, "std", [x], [y]))
    g = import_onnx(model)
    assert [n.op for n in g.nodes] == ["relu", "add"]
    assert g.nodes[0].outputs[0].type == TensorType(dt.f32, ("T", 4))  # inferred (no value_info)


def test_load_any_errors(tmp_path):
    with pytest.raises(DeepInferError, match="nothere.dil: no such file"):
        load_any(tmp_path / "nothere.dil")
    (tmp_path / "g.xyz").write_text("")
    with pytest.raises(DeepInferError, match=r"g\.xyz: unknown file type '\.xyz'"):
        load_any(tmp_path / "g.xyz")
    with pytest.raises(DeepInferError, match="has no plan.json"):
        load_any(tmp_path)


# ---------------------------------------------------------------------------------------------------
# Through the CLI
# ---------------------------------------------------------------------------------------------------


def _cli_error(capsys, path) -> str:
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_cli_inspect_good(graph, tmp_path, capsys):
    for name, write in (
        ("g.dil", lambda p: p.write_text(print_graph(graph))),
        ("g.json", lambda p: save_json(graph, p)),
        ("g.onnx", lambda p: export_onnx(graph, path=p)),
    ):
        path = tmp_path / name
        write(path)
        assert main(["inspect", str(path)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(print_graph(graph)), name
        assert f"{len(graph.nodes)} nodes" in out


def test_cli_malformed_text(tmp_path, capsys):
    path = tmp_path / "bad.dil"
    path.write_text(_broken(4, "linear", "linaer"))
    err = _cli_error(capsys, path)
    assert re.search(rf"{re.escape(str(path))}:4:19: unknown op 'linaer'", err), err


def test_cli_plan_missing_field(graph, tmp_path, capsys):
    d = graph_to_dict(graph)
    del d["nodes"][3]["op"]
    (tmp_path / "plan.json").write_text(json.dumps({"graph": d}))
    err = _cli_error(capsys, tmp_path)
    assert f"{tmp_path / 'plan.json'}: graph.nodes[3].op: missing field" in err, err


def test_cli_onnx_unknown_op(graph, tmp_path, capsys):
    path = tmp_path / "bad.onnx"
    onnx.save(_unknown_op_model(graph), str(path))
    err = _cli_error(capsys, path)
    assert str(path) in err and "node 3" in err and "unknown op 'deepinfer.no_such_op'" in err, err
