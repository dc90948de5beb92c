"""A helper for fusion passes with several alternative patterns (largest first): one sweep of the graph.

``rewrite_patterns(g, [P1, P2, ...], rewrite, where)`` does what ``rewrite_matches`` does for each pattern in
turn, but builds the graph's use lists once: all matches of P1 are found, then those of P2 among the nodes P1
did not take, and so on, and every match is rewritten at the end. That is the same result as running
``rewrite_matches`` per pattern (a fused node is never part of a later pattern), for one use-list build instead
of one per pattern, and one that skips parameters: on real V4 graphs (MoE nodes with 1,500 expert inputs each)
building use lists is most of a pass's time.
Not a pass: no ``@register_pass`` here.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.passes.pattern import Match, Op, apply_rewrites, match_at


def node_users(g: Graph) -> dict[str, list[Node]]:
    """The users of every node output and graph input (what single-use checks ask about), skipping the
    parameters: a real graph has hundreds of thousands of expert-weight uses and no pattern asks about them."""
    out: dict[str, list[Node]] = {}
    for n in g.nodes:
        for v in n.inputs:
            if v is not None and v.kind != "param":
                out.setdefault(v.name, []).append(n)
    return out


def find_pattern_matches(
    g: Graph, patterns: list[Op], where: Callable[[Match], bool] | None = None, users=None
) -> list[Match]:
    """Non-overlapping matches of the patterns, earlier patterns first, each in graph order."""
    users = node_users(g) if users is None else users
    outputs = {v.name for v in g.outputs}
    taken: set[int] = set()
    found = []
    for pattern in patterns:
        for node in g.nodes:
            if node.op not in pattern.names or id(node) in taken:
                continue
            m = match_at(g, pattern, node, users, outputs)
            if m is None or any(id(n) in taken for n in m.nodes) or (where is not None and not where(m)):
                continue
            taken.update(id(n) for n in m.nodes)
            found.append(m)
    return found


def rewrite_patterns(
    g: Graph,
    patterns: list[Op],
    rewrite: Callable[[Match], tuple[str, list[Value | None], dict]],
    where: Callable[[Match], bool] | None = None,
) -> int:
    """Every match becomes the node ``rewrite(m)`` = (op, inputs, attrs) at its root, owning the root's outputs."""
    return apply_rewrites(g, find_pattern_matches(g, patterns, where), rewrite)
