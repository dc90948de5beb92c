"""Context parallel (phase 3): one long prompt split over R ranks, zig-zag, balanced for the causal mask.

The prompt's N = 2*R*c tokens are cut into 2R chunks; rank r holds chunks r and 2R-1-r (its graph's T is
N/R), so every rank has as many early (cheap) as late (expensive) queries. The rank's graph is the
one-sequence graph with each value in one of three placements:

- local: token-major (leading dim T), this rank's rows only;
- full: token-major over the whole prompt (leading dim R*T), in sequence order;
- global: not token-major (caches, compressed entries, the window pool), the same on every rank.

An op on the ROW_LOCAL list computes row t of its outputs from row t of its token-major inputs alone
(projections, norms, RoPE at per-row positions, the MoE, the hyper-connections, and the attention core given
the KV pools and index lists), so it runs on local rows. Every other op (window indices, ring slots, the
compressor, cache writes, concat of the window pool, and every op not listed: the safe default) runs on
full inputs, exactly as the single-device graph does, on every rank. Converting placements: cp_gather
(local -> full, a collective), cp_take (full -> local, a slice). Both are placed on demand, once per value.

So on V4 the query path (q projections, q norm/RoPE, indexer queries and top-k, the sparse attention core,
inverse RoPE, output projections) and everything outside attention run on the rank's rows; the KV side is
all-gathered: kv rows (post-RoPE) and the compressor's kv/score projections, and the window pool, the
compressor pooling and the cache writes are computed identically on every rank (replicated, not split; the
caches are not sharded over the CP ranks). V4.1's pair compressor, index scores and Engram ops are not on the
list: they run on full inputs (correct, not split).
"""

from __future__ import annotations

from deepinfer.errors import ConfigError
from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.ir.ops.core import _BINARY, _UNARY
from deepinfer.ir.registry import get_op
from deepinfer.ir.shapes import Sym, substitute
from deepinfer.passes.emit import Emitter
from deepinfer.passes.pipeline import register_pass

_ANY = None  # every input may be token-major

# op -> the input positions that may be token-major (the other inputs must be global).
ROW_LOCAL: dict[str, tuple[int, ...] | None] = {
    **{op: (0,) for op in _UNARY},
    **{op: _ANY for op in _BINARY},
    **{op: (0,) for op in ("cast", "reshape", "expand", "scale", "clamp", "rmsnorm", "quant_fp8", "fake_quant_fp8")},
    **{op: (0,) for op in ("linear", "linear_fp8", "linear_fp4", "grouped_linear", "swiglu_gate_up")},
    "rmsnorm_quant_fp8": (0,),
    "dequant_fp8": (0, 1),
    "embedding": (1,),
    "rope": (0, 1),
    "swiglu": (0, 1),
    "hc_pre": (0,),
    "hc_post": (0, 1, 2, 3),
    "hc_head": (0,),
    "hc_stats": (0,),
    "hc_collapse": (0, 1),
    "moe_route": (0, 3),
    "moe_gate_route": (0, 4),
    "moe_experts": (0, 1, 2),
    "sparse_attention": (0, 3, 5),  # q and index lists by row; the pools are global
    "indexer_topk": (0, 1, 3),  # per query: scores against the (global) index keys, visibility from its position
    "compressed_indices": (0,),  # per query position
    # fused ops (phase 2): the same rows as the ops they replace
    "fused_attention": (0, 1, 4, 6),  # q, positions, win_idx, cmp_idx
    "grouped_out_proj": (0, 5),  # x (or its FP8 codes) and their scales
    "moe_grouped_experts": (0, 1, 2),
    "hc_pre_collapse": (0, 4),
    "hc_post_pre": (0, 1, 2, 3),
    "hc_post_pre_collapse": (0, 1, 2, 3, 7),
}


class _CP:
    """The rewrite state: each original value's local/full/global versions."""

    def __init__(self, g: Graph, world: int, rank: int):
        self.g, self.world, self.rank = g, world, rank
        self.em = Emitter(g)
        self.T = g.inputs[0].shape[0]
        self.local: dict[str, Value] = {}
        self.full: dict[str, Value] = {}
        self.glob: dict[str, Value] = {}
        self.nodes: list[Node] = []

    def token_major(self, v: Value) -> bool:
        return bool(v.shape) and v.shape[0] == self.T

    def get_local(self, v: Value) -> Value:
        if v.name not in self.local:  # only a full version exists: take this rank's rows under v's own name
            node = self.em.node("cp_take", [self.full[v.name]], {"world": self.world, "rank": self.rank}, v.name, [v])
            self.nodes.append(node)
            self.local[v.name] = v
        return self.local[v.name]

    def get_full(self, v: Value) -> Value:
        if v.name not in self.full:
            node = self.em.node("cp_gather", [self.local[v.name]], {"world": self.world}, f"{v.name}.cp_full")
            self.nodes.append(node)
            self.full[v.name] = node.outputs[0]
        return self.full[v.name]

    def get_global(self, v: Value) -> Value:
        return self.glob.get(v.name, v)

    # -- nodes -------------------------------------------------------------------------------------
    def row_local(self, node: Node) -> bool:
        if node.op not in ROW_LOCAL or not all(self.token_major(o) for o in node.outputs):
            return False
        allowed = ROW_LOCAL[node.op]
        tm = [i for i, v in enumerate(node.inputs) if v is not None and self.token_major(v)]
        return allowed is _ANY or all(i in allowed for i in tm)

    def add_local(self, node: Node) -> None:
        inputs = [None if v is None else self.get_local(v) if self.token_major(v) else self.get_global(v)
                  for v in node.inputs]  # fmt: skip
        if any(a is not b for a, b in zip(inputs, node.inputs)):
            node = self.em.node(node.op, inputs, node.attrs, node.outputs[0].name, node.outputs)
        self.nodes.append(node)
        for o in node.outputs:
            self.local[o.name] = o

    def add_full(self, node: Node) -> None:
        inputs = [None if v is None else self.get_full(v) if self.token_major(v) else self.get_global(v)
                  for v in node.inputs]  # fmt: skip
        attrs = self._full_attrs(node)
        opdef = get_op(node.op)
        types = opdef.infer([None if a is None else a.type for a in inputs], opdef.bind_attrs(attrs))
        # Global outputs whose type did not change keep their Value (graph outputs keep their names).
        reuse = [o if not self.token_major(o) and t == o.type else None for o, t in zip(node.outputs, types)]
        new = self.em.node(node.op, inputs, attrs, f"{node.outputs[0].name}.cp", reuse)
        self.nodes.append(new)
        for o, n in zip(node.outputs, new.outputs):
            (self.full if self.token_major(o) else self.glob)[o.name] = n

    def _full_attrs(self, node: Node) -> dict:
        """T in dim/shape attributes means the token count: on full inputs it is R*T."""
        spec, env = get_op(node.op).attrs, {self.T.args[0]: self.T * self.world}
        out = dict(node.attrs)
        for k, v in node.attrs.items():
            kind = spec[k].kind if k in spec else None
            if kind == "dim" and v is not None:
                out[k] = substitute(v, env)
            elif kind == "shape" and v is not None:
                out[k] = [substitute(d, env) for d in v]
        return out


@register_pass("context_parallel")
def context_parallel(g: Graph, *, world: int, rank: int) -> Graph:
    """Rewrite the one-sequence graph into rank ``rank``'s part of a zig-zag context-parallel prefill."""
    if not 0 <= rank < world:
        raise ConfigError(f"context_parallel: rank {rank} not in 0..{world - 1}")
    if not g.inputs or not isinstance(g.inputs[0].shape[0], Sym) or g.inputs[0].shape[0].op != "sym":
        raise ConfigError(
            "context_parallel: needs the symbolic graph (first input [T]); run it before specialize_shapes"
        )
    cp = _CP(g, world, rank)
    for v in g.inputs:
        if cp.token_major(v):
            cp.local[v.name] = v
    for node in g.nodes:
        (cp.add_local if cp.row_local(node) else cp.add_full)(node)
    g.outputs = [cp.get_local(v) if cp.token_major(v) else cp.get_global(v) for v in g.outputs]
    g.nodes = cp.nodes
    g.meta.setdefault("parallel", {})["context"] = {
        "world": world,
        "rank": rank,
        "chunks": [rank, 2 * world - 1 - rank],
    }
    return g
