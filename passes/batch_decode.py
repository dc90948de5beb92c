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

Ops that read the positions row by row (rope, fused_attention's RoPE, candidate_blocks, compressor_keys) and
topk_entries (per-row scores) stay as they are. Any other op that reads the positions or a cache has no batched
form yet: the pass raises, naming it (never a silently wrong graph).

The input is a graph at one token per sequence: the optimised plan graph (symbolic T) or one specialised to
T=1; the output is symbolic in T (specialise it per batch bucket). Node and value names are kept, so kernel
bindings (meta["kernels"]) still apply; meta["batch_decode"] records the layout.
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
            "scatter_rows", "concat", "reshape"}  # fmt: skip
# (op, input) pairs holding per-sequence row ids of a pool that must become flat pool rows: (index input, pool input)
FLAT_INDEX = {"scatter_rows": (1, 0), "fused_attention": (6, 5), "sparse_attention": (5, 4)}
# attention ops: (compressed pool input, its index input)
ATTENTION_POOLS = {"fused_attention": (5, 6), "sparse_attention": (4, 5)}
# ops whose outputs are already flat pool rows (no batched_rows offset needed)
FLAT_IDS = {"batched_ring_slots", "batched_window_indices"}


@register_pass("batch_decode")
def batch_decode(g: Graph, compact: bool = True) -> Graph:
    """The B-sequence decode graph of ``g`` (a new graph; ``g`` is untouched). See the module doc."""
    out = clone_graph(g)
    t = sym("T")
    caches = [e["name"] for e in out.meta.get("caches", [])]
    _check_one_token(out)
    reshapes, flat = _flatten_cache_inputs(out, caches, t)
    sequence_values = {"positions"} | {v.name for v in flat}
    new_nodes: list[Node] = []
    offsets: dict[tuple[str, str], Value] = {}
    for node in out.nodes:
        _check_supported(node, sequence_values)
        if node.op in BATCHED_FORMS:
            node.op = BATCHED_FORMS[node.op]
        if node.op in FLAT_INDEX:
            _flat_index(out, node, new_nodes, offsets)
            if compact and node.op in ATTENTION_POOLS:
                _compact_pool(out, node, new_nodes, offsets)
        _reinfer(node)
        new_nodes.append(node)
        sequence_values |= _pool_outputs(node, sequence_values)
    out.nodes = reshapes + new_nodes
    _unflatten_cache_outputs(out, caches, t)
    out.meta.pop("_batch_decode_names", None)
    out.meta["batch_decode"] = {"sequences": "T", "caches": "inputs and outputs [T, *per-sequence shape]"}
    verify(out)
    return out


def _check_one_token(g: Graph) -> None:
    bucket = g.meta.get("bucket", {})
    if bucket.get("T", 1) != 1:
        raise IRError(f"batch_decode: the graph is specialised to T={bucket['T']}; it needs one token per sequence")


def _flatten_cache_inputs(g: Graph, caches: list[str], t) -> tuple[list[Node], list[Value]]:
    """Cache inputs become [T, *shape]; each is read through a reshape to a [T*N, ...] pool (its uses rewired).
    Returns the reshape nodes and the flat pools."""
    by_name = {v.name: v for v in g.inputs}
    users = g.users()
    nodes: list[Node] = []
    flat: list[Value] = []
    for name in caches:
        v = by_name[name]
        per_seq = v.type.shape
        v.type = TensorType(v.dtype, (t, *per_seq))
        node = Node("reshape", [v], {"shape": [-1, *per_seq[1:]]})
        node.outputs = [_fresh_value(g, f"{name}.flat", node)]
        _reinfer(node)
        for user in users.get(name, []):
            user.inputs = [node.outputs[0] if i is v else i for i in user.inputs]
        nodes.append(node)
        flat.append(node.outputs[0])
    return nodes, flat


def _unflatten_cache_outputs(g: Graph, caches: list[str], t) -> None:
    """The graph returns each new cache as [T, *shape] (outputs 1..n follow meta["caches"], as the runtime reads)."""
    per_seq = {v.name: v.type.shape[1:] for v in g.inputs if v.name in caches}
    for k, name in enumerate(caches, start=1):
        v = g.outputs[k]
        node = Node("reshape", [v], {"shape": [t, *per_seq[name]]})
        node.outputs = [_fresh_value(g, f"{name}.next", node)]
        _reinfer(node)
        g.nodes.append(node)
        g.outputs[k] = node.outputs[0]


def _pool_outputs(node: Node, sequence_values: set[str]) -> set[str]:
    """The outputs that are (new versions of) flat pools: a stateful op's written states, a concat or reshape of
    a pool (the attention's window pool). Readers of these must be batched or row-wise forms."""
    opdef = get_op(node.op)
    if opdef.stateful:
        return {node.outputs[k].name for k in opdef.writes}
    if node.op in ("concat", "reshape") and any(i is not None and i.name in sequence_values for i in node.inputs):
        return {o.name for o in node.outputs}
    return set()


def _check_supported(node: Node, sequence_values: set[str]) -> None:
    if node.op in BATCHED_FORMS or node.op in ROW_WISE:
        return
    reads = [i.name for i in node.inputs if i is not None and i.name in sequence_values]
    if reads:
        raise IRError(f"batch_decode: {node.label} reads %{reads[0]} (per-sequence positions or cache rows) and "
                      f"has no batched form")  # fmt: skip


def _flat_index(g: Graph, node: Node, new_nodes: list[Node], offsets: dict) -> None:
    """Route the node's per-sequence row ids through batched_rows (one per (ids, pool) pair, shared by readers)."""
    i_idx, i_pool = FLAT_INDEX[node.op]
    if i_idx >= len(node.inputs) or node.inputs[i_idx] is None:
        return
    idx, pool = node.inputs[i_idx], node.inputs[i_pool]
    if idx.producer is not None and idx.producer.op in FLAT_IDS:
        return
    key = (idx.name, pool.name)
    if key not in offsets:
        off = Node("batched_rows", [idx, pool], {})
        off.outputs = [_fresh_value(g, f"{node.outputs[0].name}.rows", off)]  # named in the reader's layer
        _reinfer(off)
        new_nodes.append(off)
        offsets[key] = off.outputs[0]
    node.inputs[i_idx] = offsets[key]


def _fresh_value(g: Graph, hint: str, node: Node) -> Value:
    """A new output value for a node the pass adds (typed by _reinfer); names made so far are remembered in
    g.meta's scratch key, as the new nodes are not in g.nodes until the end."""
    taken = g.meta.setdefault("_batch_decode_names", set(g.values()))
    name = fresh_name(g, hint, taken)
    taken.add(name)
    return Value(name, TensorType(node.inputs[0].dtype, ()), "node", node)


def _compact_pool(g: Graph, node: Node, new_nodes: list[Node], gathers: dict) -> None:
    """Read the attention's compressed rows from a compact pool (one gather per (pool, ids), shared by readers)."""
    i_pool, i_idx = ATTENTION_POOLS[node.op]
    if i_idx >= len(node.inputs) or node.inputs[i_idx] is None:
        return
    pool, idx = node.inputs[i_pool], node.inputs[i_idx]
    key = ("gather", pool.name, idx.name)
    if key not in gathers:
        gather = Node("batched_gather_rows", [pool, idx], {})
        base = node.outputs[0].name
        gather.outputs = [_fresh_value(g, f"{base}.cmp_rows", gather), _fresh_value(g, f"{base}.cmp_ids", gather)]
        _reinfer(gather)
        new_nodes.append(gather)
        gathers[key] = gather.outputs
    node.inputs[i_pool], node.inputs[i_idx] = gathers[key]


def _reinfer(node: Node) -> None:
    """Output types from the (possibly new) op and input types; names are kept."""
    opdef = get_op(node.op)
    attrs = opdef.bind_attrs(node.attrs)
    types = opdef.infer([None if v is None else v.type for v in opdef.bind_inputs(list(node.inputs))], attrs)
    if len(types) != len(node.outputs):
        raise IRError(f"batch_decode: {node.label} as {node.op} gives {len(types)} outputs, not {len(node.outputs)}")
    for v, ty in zip(node.outputs, types):
        v.type = ty
