"""Constant folding: a node whose inputs are all constants is computed now, with its torch reference.

Constants are `full`, `arange` and `constant` nodes with concrete shapes. A folded result becomes a `full`
when all its elements are equal (any size: it stays a one-number description) and a `constant` when it is
small (at most MAX_ELEMENTS). Larger varied results are left alone: the graph text would grow, and a
kernel computes them as fast as it could load them. The producers left without users are removed by the
`dce` that follows in the pipeline.
"""

from __future__ import annotations

import torch

from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.ir.registry import get_op
from deepinfer.ir.shapes import is_static
from deepinfer.passes.pattern import make_node
from deepinfer.passes.pipeline import register_pass

CONSTANT_OPS = ("full", "arange", "constant")
MAX_ELEMENTS = 4096


def _foldable(n: Node, const: dict[str, torch.Tensor]) -> bool:
    if n.op in CONSTANT_OPS or get_op(n.op).stateful or not n.inputs:
        return False
    ins_const = all(v is None or v.name in const for v in n.inputs)
    return ins_const and all(is_static(o.shape) for o in n.outputs)


def _constant_node(g: Graph, out: Value, t: torch.Tensor) -> Node | None:
    """A `full` or `constant` node that produces ``t`` as ``out`` (same name and type), or None."""
    flat = t.reshape(-1)
    shape = list(out.shape)
    if flat.numel() > 0 and bool((flat == flat[0]).all()):
        return make_node(g, "full", [], {"shape": shape, "value": float(flat[0]), "dtype": out.dtype}, [out])
    if flat.numel() <= MAX_ELEMENTS and out.dtype.packed == 1:
        values = [float(x) for x in flat.double().tolist()]
        return make_node(g, "constant", [], {"shape": shape, "values": values, "dtype": out.dtype}, [out])
    return None


@register_pass("fold_constants")
def fold_constants(g: Graph) -> Graph:
    """Compute nodes whose inputs are all constants; replace them by `full` or `constant`."""
    const: dict[str, torch.Tensor] = {}
    for i, n in enumerate(g.nodes):
        if n.op in CONSTANT_OPS and all(is_static(o.shape) for o in n.outputs):
            const.update({o.name: t for o, t in zip(n.outputs, get_op(n.op).run([], get_op(n.op).bind_attrs(n.attrs)))})
            continue
        if not _foldable(n, const) or len(n.outputs) != 1:
            continue
        args = [None if v is None else const[v.name] for v in n.inputs]
        (t,) = get_op(n.op).run(args, get_op(n.op).bind_attrs(n.attrs))
        new = _constant_node(g, n.outputs[0], t)
        if new is not None:
            g.nodes[i] = new
            const[n.outputs[0].name] = t
    return g
