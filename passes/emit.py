"""Node construction for passes that add many nodes to large graphs (the parallel layout passes).

``pattern.make_node`` builds the set of every value name for each fresh name, which is fine for a few
rewrites but costs seconds on the real graph (about 100k parameters) when a pass adds hundreds of nodes.
An ``Emitter`` takes the names once and keeps them up to date.
"""

from __future__ import annotations

from deepinfer.errors import IRError
from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.ir.registry import get_op


class Emitter:
    def __init__(self, g: Graph):
        self.g = g
        self.taken = set(g.values())

    def fresh(self, hint: str) -> str:
        name, i = hint, 1
        while name in self.taken:
            name, i = f"{hint}_{i}", i + 1
        self.taken.add(name)
        return name

    def node(self, op: str, inputs: list, attrs: dict, hint: str, reuse: list | tuple = ()) -> Node:
        """A node (not inserted) with inferred types; outputs in ``reuse`` keep their Value (and users)."""
        opdef = get_op(op)
        args = opdef.bind_inputs(list(inputs))
        attrs = opdef.bind_attrs(attrs)
        types = opdef.infer([None if a is None else a.type for a in args], attrs)
        node = Node(op, args, attrs)
        reuse = list(reuse) + [None] * (len(types) - len(reuse))
        for k, (t, old) in enumerate(zip(types, reuse)):
            if old is not None:
                if old.type != t:
                    raise IRError(f"{op}: output would be {t}, but it replaces %{old.name}: {old.type}")
                old.producer = node
                node.outputs.append(old)
            else:
                suffix = f".{k}" if len(types) > 1 else ""
                node.outputs.append(Value(self.fresh(f"{hint}.{op}{suffix}"), t, "node", node))
        return node
