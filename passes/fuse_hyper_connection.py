"""Fusion: the mHC hyper-connection pre (mixes, Sinkhorn, collapse) and post, so the streams are read once.

1. V4.1 pre: its sublayer coefficients and its collapse (with the PREVIOUS sublayer's pre) read the same
   streams X; one kernel does both from one read (codegen/kernels/hyper_connection.py `pre_program`):

       pre, post, comb = hc_stats(X, fn, base, scale)      y = hc_collapse(X, prev_pre)
       ->  y, pre, post, comb = hc_pre_collapse(X, fn, base, scale, prev_pre)

2. post + the next pre (V4 and V4.1): the post writes the new streams X' and the next sublayer's pre reads
   them right back; one op writes X' once and computes the pre from registers:

       X' = hc_post(y, X, post, comb)      (ŷ, post', comb') = hc_pre(X', ...)        (V4)
       ->  X', ŷ, post', comb' = hc_post_pre(y, X, post, comb, ...)
       (hc_pre_collapse after hc_post -> hc_post_pre_collapse on V4.1)

X' is still read later (the next post's residual), so the fused op produces it; the check is that nobody
reads X' before the fused op's position (the pre's), and for 1 that nobody reads the stats before the collapse.
"""

from __future__ import annotations

from deepinfer.ir.graph import Graph, Node
from deepinfer.ir.ops import fused  # noqa: F401  (registers the fused ops)
from deepinfer.passes.pattern import Any, Op, make_node
from deepinfer.passes.pipeline import register_pass
from deepinfer.passes.rewrite_patterns import find_pattern_matches, node_users

COLLAPSE = Op("hc_collapse", Any("x"), Any("prev_pre"), capture="collapse")

POST_PRE = {
    "hc_pre": "hc_post_pre",
    "hc_pre_collapse": "hc_post_pre_collapse",
}
POST = Op("hc_post", Any("y"), Any("x"), Any("post"), Any("comb"), capture="post")
PRE = Op(tuple(POST_PRE), POST, ..., capture="pre")


def _take_over(g: Graph, pairs: list[tuple[Node, list[Node], str, list, dict, list]]) -> None:
    """Put each new node (op, inputs, attrs) at its anchor's position, owning the outputs listed, and drop the
    matched nodes (their outputs now belong to the new node)."""
    drop = set()
    pos = {id(n): i for i, n in enumerate(g.nodes)}
    for anchor, matched, op, inputs, attrs, outputs in pairs:
        g.nodes[pos[id(anchor)]] = make_node(g, op, inputs, attrs, outputs)
        drop |= {id(n) for n in matched if n is not anchor}
    g.nodes = [n for n in g.nodes if id(n) not in drop]


def _read_before(g: Graph, values, at: int, pos: dict, users: dict, allowed: set) -> bool:
    """Does any node other than `allowed` read one of `values` at a position before `at`?"""
    return any(pos[id(u)] < at and id(u) not in allowed for v in values for u in users.get(v.name, []))


def _fuse_stats_collapse(g: Graph) -> None:
    users, pos = node_users(g), {id(n): i for i, n in enumerate(g.nodes)}
    stats_of: dict[int, Node] = {}

    def check(m) -> bool:
        stats = [u for u in users.get(m["x"].name, []) if u.op == "hc_stats" and u.inputs[0] is m["x"]]
        if len(stats) != 1 or pos[id(stats[0])] > pos[id(m.root)]:
            return False
        stats_of[id(m.root)] = stats[0]
        return not _read_before(g, stats[0].outputs, pos[id(m.root)], pos, users, set())

    rewrites = []
    for m in find_pattern_matches(g, [COLLAPSE], check, users):
        st = stats_of[id(m.root)]
        inputs = [m["x"], *st.inputs[1:4], m["prev_pre"]]
        rewrites.append((m.root, [m.root, st], "hc_pre_collapse", inputs, dict(st.attrs), m.root.outputs + st.outputs))
    _take_over(g, rewrites)


def _fuse_post_pre(g: Graph) -> None:
    users, pos = node_users(g), {id(n): i for i, n in enumerate(g.nodes)}

    def check(m) -> bool:
        xn = m.node("post").outputs[0]
        return not _read_before(g, [xn], pos[id(m.root)], pos, users, {id(m.root)})

    rewrites = []
    for m in find_pattern_matches(g, [PRE], check, users):
        post, pre = m.node("post"), m.root
        inputs = [m["y"], m["x"], m["post"], m["comb"], *pre.inputs[1:]]
        outputs = post.outputs + pre.outputs
        rewrites.append((pre, [pre, post], POST_PRE[pre.op], inputs, dict(pre.attrs), outputs))
    _take_over(g, rewrites)


@register_pass("fuse_hyper_connection")
def fuse_hyper_connection(g: Graph) -> Graph:
    """hc_stats + hc_collapse -> hc_pre_collapse (V4.1); hc_post + next pre -> hc_post_pre[_collapse]."""
    _fuse_stats_collapse(g)
    _fuse_post_pre(g)
    return g
