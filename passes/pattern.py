"""A small pattern language for fusion passes: a fusion reads as pattern, check, rewrite.

    PAT = Op("quant_fp8",
             Op("rmsnorm", Any("x"), Any("w"), capture="norm", single_use=True),
             attrs={"group": lambda g: g % 32 == 0}, capture="quant")

    for m in find_matches(graph, PAT):
        if m["x"].dtype != f32: continue                          # the check
        replace(graph, m, "rmsnorm_quant_fp8", [m["x"], m["w"]],  # the rewrite
                {"eps": m.node("norm").attrs["eps"], "group": m.node("quant").attrs["group"]})

- ``Op(names, *inputs, attrs=..., capture=..., single_use=..., output=0)`` matches a Value produced by a node
  whose op is one of ``names`` (a string or a tuple), at output index ``output``. Input patterns match the
  node's inputs by position; with no input patterns the inputs are not constrained, and a trailing ``...``
  leaves the rest unconstrained. ``attrs`` maps an attribute to a value (equality) or a predicate.
  ``single_use`` asks that the value have exactly one user and not be a graph output: the fused op will
  not produce it, so nobody else may need it.
- ``Any(name=None, where=None, optional=False)`` matches any value (a wildcard; with ``optional`` also an
  absent optional input, bound as None); ``Absent()`` matches only an absent optional input.
- A capture name bound twice must bind the same value or node, so ``Any("x")`` in two places says "the same x".

Matches do not overlap: a node belongs to at most one match (the first in graph order wins).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any as TAny

from deepinfer.errors import IRError
from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.ir.registry import get_op


class Pattern:
    """Base class of pattern nodes."""


@dataclass
class Any(Pattern):
    name: str | None = None
    where: Callable[[Value], bool] | None = None
    optional: bool = False  # also match an absent optional input (binds None)


@dataclass
class Absent(Pattern):
    pass


class Op(Pattern):
    def __init__(self, names, *inputs, attrs=None, capture=None, single_use=False, output=0):
        self.names = (names,) if isinstance(names, str) else tuple(names)
        self.inputs, self.attrs = tuple(inputs), dict(attrs or {})
        self.capture, self.single_use, self.output = capture, single_use, output

    def __repr__(self) -> str:
        return f"Op({'|'.join(self.names)}, {len(self.inputs)} inputs, capture={self.capture!r})"


@dataclass
class Match:
    root: Node
    nodes: list[Node]  # matched nodes, root first
    values: dict[str, Value | None]
    ops: dict[str, Node]

    def __getitem__(self, name: str) -> Value | None:
        return self.values[name]

    def node(self, name: str) -> Node:
        return self.ops[name]


class _Ctx:
    """What a match attempt needs: the users of every value, graph outputs, and bindings so far."""

    def __init__(self, users: dict[str, list[Node]], outputs: set[str]):
        self.users, self.outputs = users, outputs
        self.values: dict[str, Value | None] = {}
        self.ops: dict[str, Node] = {}
        self.nodes: list[Node] = []


def _attr_ok(want: TAny, have: TAny) -> bool:
    return bool(want(have)) if callable(want) else want == have


def _bind(table: dict, name: str | None, obj) -> bool:
    if name is None:
        return True
    if name in table:
        return table[name] is obj
    table[name] = obj
    return True


def _single_use(v: Value, ctx: _Ctx, parent: Node | None) -> bool:
    us = ctx.users.get(v.name, [])
    return v.name not in ctx.outputs and len(us) == 1 and us[0] is parent


def _match(p: Pattern, v: Value | None, ctx: _Ctx, parent: Node | None) -> bool:
    if isinstance(p, Absent):
        return v is None
    if isinstance(p, Any):
        if v is None:
            return p.optional and _bind(ctx.values, p.name, None)
        if p.where is not None and not p.where(v):
            return False
        return _bind(ctx.values, p.name, v)
    if not isinstance(p, Op):
        raise IRError(f"not a pattern: {p!r}")
    n = None if v is None else v.producer
    if n is None or n.op not in p.names or p.output >= len(n.outputs) or n.outputs[p.output] is not v:
        return False
    if p.single_use and not _single_use(v, ctx, parent):
        return False
    if not all(k in n.attrs and _attr_ok(w, n.attrs[k]) for k, w in p.attrs.items()):
        return False
    if not _bind(ctx.ops, p.capture, n):
        return False
    ctx.nodes.append(n)
    return _match_inputs(p.inputs, n.inputs, ctx, n)


def _match_inputs(pats: tuple, vals: list, ctx: _Ctx, node: Node) -> bool:
    if not pats:
        return True
    open_tail = pats[-1] is Ellipsis
    pats = pats[:-1] if open_tail else pats
    if len(pats) > len(vals) or (not open_tail and len(pats) != len(vals)):
        return False
    return all(_match(p, v, ctx, node) for p, v in zip(pats, vals))


def match_at(g: Graph, pattern: Op, node: Node, users=None, outputs=None) -> Match | None:
    """Try the pattern with ``node`` as its root (the root's output ``pattern.output`` is the matched value)."""
    users = g.users() if users is None else users
    outputs = {v.name for v in g.outputs} if outputs is None else outputs
    if pattern.output >= len(node.outputs):
        return None
    ctx = _Ctx(users, outputs)
    root_pat = Op(pattern.names, *pattern.inputs, attrs=pattern.attrs, capture=pattern.capture, output=pattern.output)
    if not _match(root_pat, node.outputs[pattern.output], ctx, None):
        return None
    return Match(node, ctx.nodes, ctx.values, ctx.ops)


def find_matches(g: Graph, pattern: Op, where: Callable[[Match], bool] | None = None) -> list[Match]:
    """All non-overlapping matches in graph order; ``where`` is the fusion's check (False skips the match)."""
    users, outputs = g.users(), {v.name for v in g.outputs}
    taken: set[int] = set()
    out = []
    for node in g.nodes:
        if node.op not in pattern.names:
            continue
        m = match_at(g, pattern, node, users, outputs)
        if m is None or any(id(n) in taken for n in m.nodes) or (where is not None and not where(m)):
            continue
        taken.update(id(n) for n in m.nodes)
        out.append(m)
    return out


# ---------------------------------------------------------------------------------------------------
# Rewriting
# ---------------------------------------------------------------------------------------------------


def clone_graph(g: Graph) -> Graph:
    """A copy a pass may mutate freely: new Values and Nodes, shared (immutable) types and attribute atoms.

    Much faster than copy.deepcopy on real graphs (tens of thousands of expert parameters)."""
    vals: dict[str, Value] = {}

    def cv(v: Value, producer: Node | None = None) -> Value:
        vals[v.name] = Value(v.name, v.type, v.kind, producer)
        return vals[v.name]

    inputs, params = [cv(v) for v in g.inputs], [cv(v) for v in g.params]
    nodes = []
    for n in g.nodes:
        attrs = {k: list(a) if isinstance(a, list) else a for k, a in n.attrs.items()}
        new = Node(n.op, [None if v is None else vals[v.name] for v in n.inputs], attrs)
        new.outputs = [cv(o, new) for o in n.outputs]
        nodes.append(new)
    outputs = [vals[v.name] for v in g.outputs]
    return Graph(g.name, inputs, params, nodes, outputs, copy.deepcopy(g.meta))


def fresh_name(g: Graph, hint: str, taken: set[str] | None = None) -> str:
    taken = set(g.values()) if taken is None else taken
    name, i = hint, 1
    while name in taken:
        name, i = f"{hint}_{i}", i + 1
    return name


def make_node(g: Graph, op: str, inputs: list[Value | None], attrs: dict, reuse: Iterable[Value | None] = ()) -> Node:
    """A new node (not yet in the graph) with inferred output types.

    Outputs listed in ``reuse`` are the existing Values the node takes over, so every user and graph output
    that named them still does, under the same name (SSA and names kept without rewiring anything). Their
    types must equal the new op's; other outputs get fresh names.
    """
    opdef = get_op(op)
    args = opdef.bind_inputs(list(inputs))
    attrs = opdef.bind_attrs(attrs)
    types = opdef.infer([None if a is None else a.type for a in args], attrs)
    reuse = list(reuse)
    reuse += [None] * (len(types) - len(reuse))
    node = Node(op, args, attrs)
    taken = None  # the set of names is only built when a fresh name is needed (it is large on real graphs)
    for t, old in zip(types, reuse):
        if old is not None:
            if old.type != t:
                raise IRError(f"{op}: output would be {t}, but it replaces %{old.name}: {old.type}")
            old.producer = node
            node.outputs.append(old)
            continue
        taken = set(g.values()) if taken is None else taken
        base = node.outputs[0].name if node.outputs else op
        name = fresh_name(g, f"{base}.{op}", taken)
        taken.add(name)
        node.outputs.append(Value(name, t, "node", node))
    return node


def replace(g: Graph, m: Match, op: str, inputs: list[Value | None], attrs: dict, reuse=None) -> Node:
    """Replace a match by one node at the root's position; it takes over the root's outputs (or ``reuse``).

    Matched nodes whose outputs have no user left are removed; the rest stay (a value used outside the
    match is still computed, so the rewrite is always correct even without single-use constraints).
    """
    reuse = list(m.root.outputs) if reuse is None else list(reuse)
    new = make_node(g, op, inputs, attrs, reuse)
    at = next(i for i, n in enumerate(g.nodes) if n is m.root)
    g.nodes[at] = new
    remove_dead(g, [n for n in m.nodes if n is not m.root])
    return new


def rewrite_matches(
    g: Graph,
    pattern: Op,
    rewrite: Callable[[Match], tuple[str, list[Value | None], dict]],
    where: Callable[[Match], bool] | None = None,
) -> int:
    """Pattern, check, rewrite over the whole graph: every match passing ``where`` becomes the one node
    ``rewrite(m)`` describes as (op, inputs, attrs), taking over the root's outputs. Returns the match count.

    All matches are found first and dead matched nodes removed once at the end, so a pass costs a few sweeps
    of the graph however many matches it has.
    """
    return apply_rewrites(g, find_matches(g, pattern, where), rewrite)


def apply_rewrites(g: Graph, matches: list[Match], rewrite: Callable[[Match], tuple[str, list, dict]]) -> int:
    """Replace each match's root by the node ``rewrite(m)`` describes, then drop the dead interiors once."""
    pos = {id(n): i for i, n in enumerate(g.nodes)}
    interior: list[Node] = []
    for m in matches:
        op, inputs, attrs = rewrite(m)
        g.nodes[pos[id(m.root)]] = make_node(g, op, inputs, attrs, m.root.outputs)
        interior += [n for n in m.nodes if n is not m.root]
    remove_dead(g, interior)
    return len(matches)


def remove_dead(g: Graph, candidates: Iterable[Node]) -> int:
    """Remove those of ``candidates`` none of whose outputs is used (repeatedly, for chains)."""
    cands = {id(n) for n in candidates}
    removed = 0
    while cands:
        used = {v.name for n in g.nodes for v in n.inputs if v is not None} | {v.name for v in g.outputs}
        dead = {id(n) for n in g.nodes if id(n) in cands and not any(o.name in used for o in n.outputs)}
        if not dead:
            break
        g.nodes = [n for n in g.nodes if id(n) not in dead]
        cands -= dead
        removed += len(dead)
    return removed


def replace_uses(g: Graph, mapping: dict[str, Value]) -> None:
    """Make every use of a value named in ``mapping`` (node inputs, graph outputs) use the mapped value."""
    for n in g.nodes:
        n.inputs = [mapping.get(v.name, v) if v is not None else None for v in n.inputs]
    g.outputs = [mapping.get(v.name, v) for v in g.outputs]


__all__ = [
    "Absent",
    "Any",
    "Match",
    "Op",
    "Pattern",
    "clone_graph",
    "find_matches",
    "fresh_name",
    "make_node",
    "match_at",
    "remove_dead",
    "replace",
    "replace_uses",
    "rewrite_matches",
]
