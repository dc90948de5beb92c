"""batch_decode: the one-sequence graph -> a decode graph of B independent sequences, one token each.

The model graph is one sequence per call (tokens [T], contiguous positions, dense per-sequence caches). A serving
engine decodes many sequences per step, and must read every weight ONCE for all of them. In the batched graph
the symbol T counts sequences (B), so the row-wise ops -- GEMMs, norms, MoE, mHC, RoPE with per-row positions,
the head -- are unchanged: B sequences' tokens are T = B rows. What depends on the sequence is rewritten:

    inputs          every cache input gets a leading [T] dim (one row per sequence: the runtime's [B, N, ...] slots)
                    and is flattened right away to a [T*N, ...] pool (a view); the new caches are reshaped back
    window_indices  -> batched_window_indices (rows of concat(rings [T*W], new kv [T]))
    ring_slots      -> batched_ring_slots (flat ring rows)
    compressor, pair_compressor_keys, index_scores, indexer_topk, compressed_indices, engram_hash,
    engram_history  -> their batched_* forms (ir/ops/batched.py): each row over its own sequence's pool rows
    scatter_rows    unchanged, over the flat pool; an index that is per sequence (a compressor's entry ids, the
                    positions of a ratio-1 cache) goes through batched_rows (+ b*N) first
    fused_attention / sparse_attention
                    unchanged: each query already gathers its own rows, so a flat pool with flat row ids
                    (batched_rows on the top-k / visibility ids) is all the attention kernel needs; with
                    ``compact`` (default) the compressed rows a step reads are first gathered into a [T*K, d] pool
                    (batched_gather_rows): the attention kernel's adapter converts its pools to bf16 per call,
                    which over the flat caches would be every sequence's whole compressed cache (0.5 GB for a
                    V4.1 ratio-1 layer at 64 x 4k) instead of the T*K rows attended

Ops that read the positions row by row (rope, fused_attention's RoPE, candidate_blocks, compressor_keys,
topk_entries: per-row scores, each row's position bounding the columns its top-k reads) stay as they are. Any
other op that reads the positions or a cache has no batched form yet: the pass raises, naming it (never a
silently wrong graph).

The input is the plan graph, symbolic in T (its row dims are written for any T, which is what lets T count
sequences; a graph specialised to T=1 has lost that); the output is symbolic in T too (specialise it per batch).
Node and value names are kept, so kernel bindings (meta["kernels"]) still apply; meta["batch_decode"] records the
layout.
"""

from __future__ import annotations

from deepinfer.errors import IRError
from deepinfer.ir.graph import Graph, Node, TensorType, Value
from deepinfer.ir.registry import get_op
from deepinfer.ir.shapes import sym
from deepinfer.ir.verifier import verify
from deepinfer.passes.pattern import clone_graph, fresh_name
from deepinfer.passes.pipeline import register_pass

# one-sequence op -> its batched form (same inputs and attributes; see ir/ops/batched.py)
BATCHED_FORMS = {
    "window_indices": "batched_window_indices",
    "ring_slots": "batched_ring_slots",
    "compressor": "batched_compressor",
    "pair_compressor_keys": "batched_pair_compressor_keys",
    "index_scores": "batched_index_scores",
    "indexer_topk": "batched_indexer_topk",
    "compressed_indices": "batched_compressed_indices",
    "engram_hash": "batched_engram_hash",
    "engram_history": "batched_engram_history",
}
# ops that read positions / pools row by row, or only gather the rows their (flat) indices name
ROW_WISE = {"rope", "fused_attention", "sparse_attention", "candidate_blocks", "compressor_keys", "topk_entries",
            "scatter_rows"}  # fmt: skip
# op -> (index input, pool input): per-sequence row ids of a pool that must become flat pool rows
FLAT_INDEX = {"scatter_rows": (1, 0), "fused_attention": (6, 5), "sparse_attention": (5, 4)}
# attention ops: (compressed pool input, its index input)
ATTENTION_POOLS = {"fused_attention": (5, 6), "sparse_attention": (4, 5)}
# ops whose outputs are already flat pool rows (no batched_rows offset needed)
FLAT_IDS = {"batched_ring_slots", "batched_window_indices"}


@register_pass("batch_decode")
def batch_decode(g: Graph, compact: bool = True) -> Graph:
    """The B-sequence decode graph of ``g`` (a new graph; ``g`` is untouched). See the module doc."""
    _check_symbolic_tokens(g)
    rw = _Rewrite(clone_graph(g))
    t = sym("T")
    caches = [e["name"] for e in rw.g.meta.get("caches", [])]
    reshapes, flat = _flatten_cache_inputs(rw, caches, t)
    sequence_values = {"positions"} | {v.name for v in flat}
    for node in rw.g.nodes:
        _check_supported(node, sequence_values)
        if node.op in BATCHED_FORMS:
            node.op = BATCHED_FORMS[node.op]
        if node.op in FLAT_INDEX:
            _flat_index(rw, node)
            if compact and node.op in ATTENTION_POOLS:
                _compact_pool(rw, node)
        _reinfer(node)
        rw.nodes.append(node)
        sequence_values |= _pool_outputs(node, sequence_values)
    rw.g.nodes = reshapes + rw.nodes
    _unflatten_cache_outputs(rw, caches, t)
    rw.g.meta["batch_decode"] = {"sequences": "T", "caches": "inputs and outputs [T, *per-sequence shape]"}
    verify(rw.g)
    return rw.g


class _Rewrite:
    """The graph being rewritten, the nodes of the new order, names taken so far (new nodes are not in g.nodes
    until the end), and the nodes made once per operand pair (flat row ids, compact pools)."""

    def __init__(self, g: Graph):
        self.g = g
        self.nodes: list[Node] = []
        self.taken = set(g.values())
        self.made: dict[tuple, list[Value]] = {}

    def add(self, op: str, inputs: list[Value], hints: list[str], key: tuple) -> list[Value]:
        """The outputs of a new node placed before the node being rewritten; made once per ``key``."""
        if key not in self.made:
            node = Node(op, inputs, {})
            node.outputs = [self.value(h, node) for h in hints]
            _reinfer(node)
            self.nodes.append(node)
            self.made[key] = node.outputs
        return self.made[key]

    def value(self, hint: str, node: Node) -> Value:
        name = fresh_name(self.g, hint, self.taken)
        self.taken.add(name)
        return Value(name, TensorType(node.inputs[0].dtype, ()), "node", node)  # typed by _reinfer


def _check_symbolic_tokens(g: Graph) -> None:
    if "T" in g.meta.get("bucket", {}):
        raise IRError(f"batch_decode: the graph is specialised to T={g.meta['bucket']['T']}; it takes the graph "
                      f"symbolic in T (the plan's), and its result is specialised per batch")  # fmt: skip


def _flatten_cache_inputs(rw: _Rewrite, caches: list[str], t) -> tuple[list[Node], list[Value]]:
    """Cache inputs become [T, *shape]; each is read through a reshape to a [T*N, ...] pool (its uses rewired).
    Returns the reshape nodes and the flat pools."""
    by_name = {v.name: v for v in rw.g.inputs}
    users = rw.g.users()
    nodes: list[Node] = []
    for name in caches:
        v = by_name[name]
        per_seq = v.type.shape
        v.type = TensorType(v.dtype, (t, *per_seq))
        node = Node("reshape", [v], {"shape": [-1, *per_seq[1:]]})
        node.outputs = [rw.value(f"{name}.flat", node)]
        _reinfer(node)
        for user in users.get(name, []):
            user.inputs = [node.outputs[0] if i is v else i for i in user.inputs]
        nodes.append(node)
    return nodes, [n.outputs[0] for n in nodes]


def _unflatten_cache_outputs(rw: _Rewrite, caches: list[str], t) -> None:
    """The graph returns each new cache as [T, *shape] (outputs 1..n follow meta["caches"], as the runtime reads)."""
    per_seq = {v.name: v.type.shape[1:] for v in rw.g.inputs if v.name in caches}
    for k, name in enumerate(caches, start=1):
        v = rw.g.outputs[k]
        node = Node("reshape", [v], {"shape": [t, *per_seq[name]]})
        node.outputs = [rw.value(f"{name}.next", node)]
        _reinfer(node)
        rw.g.nodes.append(node)
        rw.g.outputs[k] = node.outputs[0]


def _pool_outputs(node: Node, sequence_values: set[str]) -> set[str]:
    """The outputs that are (new versions of) flat pools: a stateful op's written states, the attention's window
    pool. Readers of these must be batched or row-wise forms."""
    opdef = get_op(node.op)
    if opdef.stateful:
        return {node.outputs[k].name for k in opdef.writes}
    if _is_window_pool(node, sequence_values):
        return {o.name for o in node.outputs}
    return set()


def _check_supported(node: Node, sequence_values: set[str]) -> None:
    if node.op in BATCHED_FORMS or node.op in ROW_WISE or _is_window_pool(node, sequence_values):
        return
    reads = [i.name for i in node.inputs if i is not None and i.name in sequence_values]
    if reads:
        raise IRError(f"batch_decode: {node.label} reads %{reads[0]} (per-sequence positions or cache rows) and "
                      f"has no batched form")  # fmt: skip


def _is_window_pool(node: Node, sequence_values: set[str]) -> bool:
    """concat(ring pool, new rows) along rows: the attention's window pool, the layout batched_window_indices
    addresses (rings [T*W] first, then the T new rows)."""
    if node.op != "concat" or node.attrs.get("axis") != 0 or len(node.inputs) != 2:
        return False
    ring, new = node.inputs
    return ring.name in sequence_values and new.name not in sequence_values


def _flat_index(rw: _Rewrite, node: Node) -> None:
    """Route the node's per-sequence row ids through batched_rows (one per (ids, pool) pair, shared by readers)."""
    i_idx, i_pool = FLAT_INDEX[node.op]
    if i_idx >= len(node.inputs) or node.inputs[i_idx] is None:
        return
    idx, pool = node.inputs[i_idx], node.inputs[i_pool]
    if idx.producer is not None and idx.producer.op in FLAT_IDS:
        return
    hint = f"{node.outputs[0].name}.rows"  # named in the reader's layer (the executor's segments follow names)
    (node.inputs[i_idx],) = rw.add("batched_rows", [idx, pool], [hint], key=("rows", idx.name, pool.name))


def _compact_pool(rw: _Rewrite, node: Node) -> None:
    """Read the attention's compressed rows from a compact pool (one gather per (pool, ids), shared by readers)."""
    i_pool, i_idx = ATTENTION_POOLS[node.op]
    if i_idx >= len(node.inputs) or node.inputs[i_idx] is None:
        return
    pool, idx = node.inputs[i_pool], node.inputs[i_idx]
    base = node.outputs[0].name
    rows, ids = rw.add("batched_gather_rows", [pool, idx], [f"{base}.cmp_rows", f"{base}.cmp_ids"],
                       key=("gather", pool.name, idx.name))  # fmt: skip
    node.inputs[i_pool], node.inputs[i_idx] = rows, ids


def _reinfer(node: Node) -> None:
    """Output types from the (possibly new) op and input types; names are kept."""
    opdef = get_op(node.op)
    attrs = opdef.bind_attrs(node.attrs)
    types = opdef.infer([None if v is None else v.type for v in opdef.bind_inputs(list(node.inputs))], attrs)
    if len(types) != len(node.outputs):
        raise IRError(f"batch_decode: {node.label} as {node.op} gives {len(types)} outputs, not {len(node.outputs)}")
    for v, ty in zip(node.outputs, types):
        v.type = ty
