"""Common-subexpression elimination: two nodes with the same op, inputs and attributes compute the same
value, so the later one is dropped and its users read the earlier one's outputs.

Stateful ops are never merged: two writes of the same rows into the same cache version are two state
versions the runtime may perform in place, and merging them would let one write alias the other. On the V4
graph CSE merges the per-layer `window_indices`/`ring_slots` of the positions (one per layer -> one).
"""

from __future__ import annotations

from deepinfer.ir.graph import Graph, Node, _asig
from deepinfer.ir.registry import get_op
from deepinfer.passes.pattern import replace_uses
from deepinfer.passes.pipeline import register_pass


def node_key(n: Node) -> tuple:
    """Everything that determines a pure node's outputs: op, input values (by name) and attributes."""
    ins = tuple(None if v is None else v.name for v in n.inputs)
    attrs = tuple(sorted((k, _asig(v)) for k, v in n.attrs.items()))
    return (n.op, ins, attrs, len(n.outputs))


@register_pass("cse")
def cse(g: Graph) -> Graph:
    """Merge nodes with equal op, inputs and attributes (not stateful ones)."""
    seen: dict[tuple, Node] = {}
    mapping = {}
    kept = []
    for n in g.nodes:
        # Inputs renamed by an earlier merge must be renamed before the key is taken, so chains merge too.
        n.inputs = [mapping.get(v.name, v) if v is not None else None for v in n.inputs]
        if get_op(n.op).stateful:
            kept.append(n)
            continue
        key = node_key(n)
        first = seen.get(key)
        if first is None or any(a.type != b.type for a, b in zip(first.outputs, n.outputs)):
            seen.setdefault(key, n)
            kept.append(n)
            continue
        mapping.update({o.name: f for o, f in zip(n.outputs, first.outputs)})
    g.nodes = kept
    replace_uses(g, mapping)
    return g
