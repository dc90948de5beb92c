"""The readable text form of a graph (it parses back with ``ir.parser.parse_graph``).

    graph "tiny_mlp" {
      meta {"model": "demo"}
      input %x: f32[T, 64]
      param %layers.0.w1.weight: f32[128, 64]
      %0: f32[T, 128] = linear(%x, %layers.0.w1.weight, _)
      %1: f32[T, 4], %2: i64[T, 4] = topk(%0) {k=4, axis=-1, largest=true}
      output %1, %2
    }

Absent optional inputs print as ``_``. Attribute values: ints, floats (shortest exact repr), ``true`` /
``false``, ``none``, JSON strings, dtypes by name, dims as expressions (``T//4``), lists in ``[...]``.
Attributes print in the op schema's order.
"""

from __future__ import annotations

import json
import math
from typing import Any

from deepinfer.ir.dtypes import DType
from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.ir.registry import get_op, has_op
from deepinfer.ir.shapes import Sym, dim_str


def fmt_float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    r = repr(float(x))
    return r


def fmt_attr(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return fmt_float(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, DType):
        return v.name
    if isinstance(v, Sym):
        return dim_str(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(fmt_attr(x) for x in v) + "]"
    raise TypeError(f"cannot print attribute value {v!r}")


def fmt_value(v: Value) -> str:
    return f"%{v.name}: {v.type}"


def fmt_node(n: Node) -> str:
    outs = ", ".join(fmt_value(o) for o in n.outputs)
    ins = ", ".join("_" if i is None else f"%{i.name}" for i in n.inputs)
    order = list(get_op(n.op).attrs) if has_op(n.op) else sorted(n.attrs)
    attrs = ", ".join(f"{k}={fmt_attr(n.attrs[k])}" for k in order if k in n.attrs)
    text = f"{outs} = {n.op}({ins})"
    return f"{text} {{{attrs}}}" if attrs else text


def print_graph(g: Graph) -> str:
    lines = [f"graph {json.dumps(g.name)} {{"]
    if g.meta:
        lines.append(f"  meta {json.dumps(g.meta, sort_keys=True)}")
    lines += [f"  input {fmt_value(v)}" for v in g.inputs]
    lines += [f"  param {fmt_value(v)}" for v in g.params]
    lines += [f"  {fmt_node(n)}" for n in g.nodes]
    lines.append("  output " + ", ".join(f"%{v.name}" for v in g.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"


def summary(g: Graph) -> str:
    """A few lines: size, parameters, ops by count."""
    from deepinfer.ir.shapes import numel

    n_params = 0
    for p in g.params:
        size = numel(p.shape)
        if isinstance(size, int):
            n_params += size * p.dtype.packed
    ops = ", ".join(f"{k} {v}" for k, v in g.op_counts().items())
    return (
        f"graph {g.name!r}: {len(g.nodes)} nodes, {len(g.inputs)} inputs, {len(g.params)} params "
        f"({n_params:,} weights), {len(g.outputs)} outputs\nops: {ops}"
    )
