"""JSON form of a graph (plans store their graph this way).

    {"format": "deepinfer.graph", "version": 1, "name": "...", "meta": {...},
     "inputs":  [{"name": "x", "dtype": "bf16", "shape": ["T", "4096"]}, ...],
     "params":  [...same...],
     "nodes":   [{"op": "topk", "inputs": ["x", null],
                  "outputs": [{"name": "1", "dtype": "f32", "shape": ["T", "4"]}, ...],
                  "attrs": {"k": {"kind": "dim", "value": "4"}, "eps": {"kind": "float", "value": 1e-06}}}],
     "outputs": ["1", ...]}

Dims are strings (``"T//4"``), dtypes names, absent optional inputs ``null``. Attributes are tagged by kind;
floats are JSON numbers (Python writes the shortest exact repr) except ``"inf"``, ``"-inf"``, ``"nan"``.
Reading checks every field and raises SerializationError naming the field path
(``plan.json: graph.nodes[3].op: missing field``).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from deepinfer.errors import DeepInferError, SerializationError
from deepinfer.ir.dtypes import ALL_DTYPES, DType
from deepinfer.ir.graph import Graph, Node, TensorType, Value
from deepinfer.ir.registry import ATTR_KINDS, get_op, has_op
from deepinfer.ir.shapes import Sym, dim_str, parse_dim

FORMAT = "deepinfer.graph"
VERSION = 1


# ---------------------------------------------------------------------------------------------------
# Attribute encoding (shared with onnx_io)
# ---------------------------------------------------------------------------------------------------


def attr_kind_of(op: str, name: str, v: Any) -> str:
    """The attribute's kind: the op schema's, or (for an unregistered op) guessed from the value."""
    if has_op(op) and name in get_op(op).attrs:
        return get_op(op).attrs[name].kind
    return _guess_kind(v)


def _guess_kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, DType):
        return "dtype"
    if isinstance(v, Sym):
        return "dim"
    if isinstance(v, list | tuple):
        kinds = {_guess_kind(x) for x in v}
        if kinds <= {"int"}:
            return "ints"
        if kinds <= {"int", "float"}:
            return "floats"
        if kinds <= {"str"}:
            return "strs"
        if kinds <= {"int", "dim"}:
            return "shape"
    raise SerializationError(f"cannot serialise attribute value {v!r}")


def float_to_json(x: float) -> float | str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return float(x)


def float_from_json(v: Any, path: str) -> float:
    if isinstance(v, str):
        if v == "nan":
            return math.nan
        if v in ("inf", "-inf"):
            return math.inf if v == "inf" else -math.inf
    elif isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    raise SerializationError(f"{path}: expected a number, got {v!r}")


def encode_attr(kind: str, v: Any) -> Any:
    """Attribute value -> plain JSON data, by kind."""
    if v is None:
        return None
    if kind == "float":
        return float_to_json(v)
    if kind == "floats":
        return [float_to_json(x) for x in v]
    if kind == "dtype":
        return v.name if isinstance(v, DType) else str(v)
    if kind == "dim":
        return dim_str(v)
    if kind == "shape":
        return [dim_str(d) for d in v]
    if kind in ("ints", "strs"):
        return list(v)
    return v


def decode_attr(kind: str, v: Any, path: str) -> Any:
    """Plain JSON data -> attribute value, checking it fits the kind (errors name ``path``)."""
    if v is None:
        return None

    def bad(what: str) -> SerializationError:
        return SerializationError(f"{path}: expected {what}, got {v!r}")

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if kind == "int":
        if not is_int(v):
            raise bad("an integer")
        return v
    if kind == "float":
        return float_from_json(v, path)
    if kind == "bool":
        if not isinstance(v, bool):
            raise bad("true or false")
        return v
    if kind == "str":
        if not isinstance(v, str):
            raise bad("a string")
        return v
    if kind == "dtype":
        if v not in ALL_DTYPES:
            raise bad(f"a dtype name ({', '.join(ALL_DTYPES)})")
        return ALL_DTYPES[v]
    if kind == "dim":
        return _decode_dim(v, path)
    if not isinstance(v, list):
        raise bad(f"a list ({kind})")
    if kind == "ints":
        if not all(is_int(x) for x in v):
            raise bad("a list of integers")
        return list(v)
    if kind == "floats":
        return [float_from_json(x, f"{path}[{i}]") for i, x in enumerate(v)]
    if kind == "strs":
        if not all(isinstance(x, str) for x in v):
            raise bad("a list of strings")
        return list(v)
    if kind == "shape":
        return [_decode_dim(x, f"{path}[{i}]") for i, x in enumerate(v)]
    raise SerializationError(f"{path}: unknown attribute kind {kind!r}")


def _decode_dim(v: Any, path: str):
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if not isinstance(v, str):
        raise SerializationError(f'{path}: expected a dimension string like "T//4", got {v!r}')
    try:
        return parse_dim(v)
    except DeepInferError as e:
        raise SerializationError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------------------------------
# Graph <-> dict
# ---------------------------------------------------------------------------------------------------


def _value_dict(v: Value) -> dict:
    return {"name": v.name, "dtype": v.dtype.name, "shape": [dim_str(d) for d in v.shape]}


def graph_to_dict(g: Graph) -> dict:
    nodes = []
    for n in g.nodes:
        attrs = {}
        for k, v in n.attrs.items():
            kind = attr_kind_of(n.op, k, v)
            attrs[k] = {"kind": kind, "value": encode_attr(kind, v)}
        nodes.append(
            {
                "op": n.op,
                "inputs": [None if i is None else i.name for i in n.inputs],
                "outputs": [_value_dict(o) for o in n.outputs],
                "attrs": attrs,
            }
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "name": g.name,
        "meta": dict(g.meta),
        "inputs": [_value_dict(v) for v in g.inputs],
        "params": [_value_dict(v) for v in g.params],
        "nodes": nodes,
        "outputs": [v.name for v in g.outputs],
    }


_MISSING = object()


def _field(d: Any, key: str, path: str, typ: type | tuple, what: str) -> Any:
    if not isinstance(d, dict):
        raise SerializationError(f"{path or 'top level'}: expected an object, got {type(d).__name__}")
    v = d.get(key, _MISSING)
    where = f"{path}.{key}" if path else key
    if v is _MISSING:
        raise SerializationError(f"{where}: missing field")
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise SerializationError(f"{where}: expected {what}, got {json.dumps(v)[:40]}")
    return v


def _value_from(d: Any, path: str, kind: str) -> Value:
    name = _field(d, "name", path, str, "a string")
    dt = _field(d, "dtype", path, str, "a dtype name")
    if dt not in ALL_DTYPES:
        raise SerializationError(f"{path}.dtype: unknown dtype {dt!r} (known: {', '.join(ALL_DTYPES)})")
    shape = _field(d, "shape", path, list, "a list of dimensions")
    dims = tuple(_decode_dim(x, f"{path}.shape[{i}]") for i, x in enumerate(shape))
    return Value(name, TensorType(ALL_DTYPES[dt], dims), kind)


def graph_from_dict(d: Any, path: str = "") -> Graph:
    """Rebuild a graph; ``path`` prefixes field paths in errors (``graph`` for a plan's graph)."""

    def p(sub: str) -> str:
        return f"{path}.{sub}" if path else sub

    fmt = _field(d, "format", path, str, "a string")
    if fmt != FORMAT:
        raise SerializationError(f"{p('format')}: expected {FORMAT!r}, got {fmt!r}")
    version = _field(d, "version", path, int, "an integer")
    if version != VERSION:
        raise SerializationError(f"{p('version')}: version {version} is not supported (this reads {VERSION})")
    g = Graph(_field(d, "name", path, str, "a string"), meta=dict(_field(d, "meta", path, dict, "an object")))
    values: dict[str, Value] = {}

    def define(v: Value, where: str) -> None:
        if v.name in values:
            raise SerializationError(f"{where}.name: value {v.name!r} is defined twice")
        values[v.name] = v

    for key, kind, dest in (("inputs", "input", g.inputs), ("params", "param", g.params)):
        for i, vd in enumerate(_field(d, key, path, list, "a list")):
            v = _value_from(vd, p(f"{key}[{i}]"), kind)
            define(v, p(f"{key}[{i}]"))
            dest.append(v)

    for i, nd in enumerate(_field(d, "nodes", path, list, "a list")):
        g.nodes.append(_node_from(nd, p(f"nodes[{i}]"), values, define))

    for i, name in enumerate(_field(d, "outputs", path, list, "a list")):
        if not isinstance(name, str):
            raise SerializationError(f"{p(f'outputs[{i}]')}: expected a value name, got {name!r}")
        if name not in values:
            raise SerializationError(f"{p(f'outputs[{i}]')}: undefined value {name!r}")
        g.outputs.append(values[name])
    return g


def _node_from(nd: Any, where: str, values: dict[str, Value], define) -> Node:
    op = _field(nd, "op", where, str, "a string")
    if not has_op(op):
        raise SerializationError(f"{where}.op: unknown op {op!r}")
    opdef = get_op(op)
    ins: list[Value | None] = []
    for j, name in enumerate(_field(nd, "inputs", where, list, "a list")):
        if name is None:
            ins.append(None)
        elif not isinstance(name, str):
            raise SerializationError(f"{where}.inputs[{j}]: expected a value name or null, got {name!r}")
        elif name not in values:
            raise SerializationError(f"{where}.inputs[{j}]: undefined value {name!r}")
        else:
            ins.append(values[name])
    attrs = {}
    for k, ad in _field(nd, "attrs", where, dict, "an object").items():
        apath = f"{where}.attrs.{k}"
        if k not in opdef.attrs:
            raise SerializationError(f"{apath}: {op} has no attribute {k!r}")
        kind = _field(ad, "kind", apath, str, "an attribute kind")
        if kind not in ATTR_KINDS:
            raise SerializationError(f"{apath}.kind: unknown attribute kind {kind!r}")
        if kind != opdef.attrs[k].kind:
            raise SerializationError(f"{apath}.kind: {op}.{k} is a {opdef.attrs[k].kind}, not {kind}")
        if "value" not in ad:
            raise SerializationError(f"{apath}.value: missing field")
        attrs[k] = decode_attr(kind, ad["value"], f"{apath}.value")
    node = Node(op, ins, attrs)
    for j, od in enumerate(_field(nd, "outputs", where, list, "a list")):
        v = _value_from(od, f"{where}.outputs[{j}]", "node")
        v.producer = node
        define(v, f"{where}.outputs[{j}]")
        node.outputs.append(v)
    return node


# ---------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------


def dumps(g: Graph) -> str:
    """JSON text with one value or node per line."""
    try:
        d = graph_to_dict(g)
        parts = []
        for k, v in d.items():
            if isinstance(v, list) and v and k != "outputs":
                items = ",\n".join("  " + json.dumps(x, allow_nan=False) for x in v)
                parts.append(f" {json.dumps(k)}: [\n{items}\n ]")
            else:
                parts.append(f" {json.dumps(k)}: {json.dumps(v, allow_nan=False)}")
        return "{\n" + ",\n".join(parts) + "\n}"
    except (TypeError, ValueError) as e:
        raise SerializationError(f"graph {g.name!r} cannot be written as JSON: {e}") from None


def loads(text: str, source: str = "<string>") -> Graph:
    """Parse JSON text holding a graph, or a plan whose field ``graph`` holds one."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise SerializationError(f"{source}:{e.lineno}:{e.colno}: bad JSON: {e.msg}") from None
    try:
        if isinstance(d, dict) and "graph" in d and d.get("format") != FORMAT:
            return graph_from_dict(_field(d, "graph", "", dict, "an object"), "graph")
        return graph_from_dict(d)
    except SerializationError as e:
        raise SerializationError(f"{source}: {e}") from None


def save_json(g: Graph, path: str | os.PathLike) -> None:
    text = dumps(g)
    with open(path, "w") as f:
        f.write(text + "\n")


def load_json(path: str | os.PathLike) -> Graph:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise SerializationError(f"{path}: cannot read: {e.strerror}") from None
    return loads(text, os.fspath(path))
