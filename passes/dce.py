"""Dead-code elimination: remove nodes none of whose outputs reaches a graph output.

A graph is a pure function of (tokens, positions, cache state), so liveness is exactly "reaches an output".
A stateful op (a cache write) returns the new state and that state is a graph output, so the write is live
and kept; a write whose new state nobody outputs could never be observed, and goes like any other dead node.
Inputs and parameters are the graph's signature and are never removed.
"""

from __future__ import annotations

from deepinfer.ir.graph import Graph
from deepinfer.passes.pipeline import register_pass


def live_nodes(g: Graph) -> set[int]:
    """ids of the nodes whose result reaches an output (one backward sweep over the topological order)."""
    needed = {v.name for v in g.outputs}
    live: set[int] = set()
    for n in reversed(g.nodes):
        if any(o.name in needed for o in n.outputs):
            live.add(id(n))
            needed.update(v.name for v in n.inputs if v is not None)
    return live


@register_pass("dce")
def dce(g: Graph) -> Graph:
    """Remove nodes whose outputs reach no graph output."""
    live = live_nodes(g)
    g.nodes = [n for n in g.nodes if id(n) in live]
    return g
