"""read_rings_after_write: the batched decode graph's attentions read each window from the SWA ring as the step
writes it, instead of from concat(ring, this step's rows) -- a copy of every sequence's ring every step.

One token per sequence (the batched decode step of passes/batch_decode.py): query b at position p reads positions
p-W+1 .. p; the write puts p into ring slot p % W, which held p-W (outside the window), so the written ring holds
the window. The same rows with the same values: the same attention. runtime/batched_decode.decode_graph applies it
(DEEPINFER_RING_FIRST=0 keeps the concat).
"""

from __future__ import annotations

from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.passes.pattern import fresh_name, make_node, remove_dead

ATTENTION_WINDOW = {"fused_attention": (3, 4), "sparse_attention": (2, 3)}  # (window pool, window ids) inputs
RING_IDS_REASON = "the written rings' window ids (read_rings_after_write; [B, W] ids, no kernel)"


def read_rings_after_write(bg: Graph) -> int:
    """Each attention of the batched graph reads its window from the ring as this step writes it, instead of from
    concat(rings, new rows) -- a copy of every sequence's ring every step. One token per sequence: query b at
    position p reads positions p-W+1 .. p; the write puts p into ring slot p % W, which held p-W (outside the window),
    so the written ring holds the window, position q at row b*W + q % W: batched_window_indices' row for every q < p
    and batched_ring_slots' row for q = p (the window ids' last column). The same rows with the same values: the same
    attention. The write moves before the attention (nothing else reads the old ring). Returns the nodes rewritten."""
    users = bg.users()
    ids: dict[tuple, Value] = {}
    pools = []
    for node in list(bg.nodes):
        if node.op not in ATTENTION_WINDOW:
            continue
        i_pool, i_ids = ATTENTION_WINDOW[node.op]
        found = _ring_window(node.inputs[i_pool], node.inputs[i_ids], users)
        if found is None:
            continue
        write, slots = found
        pools.append(node.inputs[i_pool].producer)
        _place_before(bg.nodes, node, write)
        key = (node.inputs[i_ids].name, slots.name)
        if key not in ids:
            ids[key] = _ring_ids(bg, node, node.inputs[i_ids], slots)
        node.inputs[i_pool], node.inputs[i_ids] = write.outputs[0], ids[key]
    remove_dead(bg, pools)
    return len(pools)


def _ring_window(pool: Value, win_ids: Value, users: dict) -> tuple[Node, Value] | None:
    """(the ring's write, its slots) where pool = concat(ring, rows) along rows, win_ids = batched_window_indices of
    the ring's window W over W-row rings, and scatter_rows(ring, batched_ring_slots(same positions, W), rows) writes
    the same rows; else None."""
    cat, win = pool.producer, win_ids.producer
    if cat is None or win is None or cat.op != "concat" or cat.attrs.get("axis") != 0 or len(cat.inputs) != 2:
        return None
    ring, rows = cat.inputs
    w = win.attrs.get("window") if win.op == "batched_window_indices" else None
    cache = ring.producer.inputs[0] if ring.producer is not None and ring.producer.op == "reshape" else None
    if w is None or cache is None or cache.kind != "input" or len(cache.shape) != 3 or cache.shape[1] != w:
        return None
    for write in users.get(ring.name, []):
        slots = write.inputs[1] if write.op == "scatter_rows" else None
        if (slots is not None and write.inputs[0] is ring and write.inputs[2] is rows and slots.producer is not None
                and slots.producer.op == "batched_ring_slots" and slots.producer.attrs.get("size") == w
                and slots.producer.inputs[0] is win.inputs[0]):  # fmt: skip
            return write, slots
    return None


def _ring_ids(bg: Graph, before: Node, win_ids: Value, slots: Value) -> Value:
    """concat(win_ids[:, :W-1], slots as a column): the written ring's rows of every window position, made right
    before ``before`` (named in its layer: the executor's segments follow names)."""
    t, w = win_ids.shape
    head = make_node(bg, "slice", [win_ids], {"axis": 1, "start": 0, "end": w - 1})
    col = make_node(bg, "reshape", [slots], {"shape": [t, 1]})
    both = make_node(bg, "concat", [head.outputs[0], col.outputs[0]], {"axis": 1})
    base = before.outputs[0].name
    kernels = bg.meta.get("kernels") or {}
    for node, part in ((head, "older"), (col, "newest"), (both, "ring_ids")):
        node.outputs[0].name = fresh_name(bg, f"{base}.{part}")
        bg.nodes.insert(bg.nodes.index(before), node)
        bind = {"family": "view"} if node.op != "concat" else {"family": "torch_ref", "reason": RING_IDS_REASON}
        if "nodes" in kernels:  # the executor's report then says what these nodes are
            buckets = {b: dict(bind) for b in kernels["buckets"]}
            kernels["nodes"][node.outputs[0].name] = {"op": node.op, "buckets": buckets}
    return both.outputs[0]


def _place_before(nodes: list[Node], target: Node, node: Node) -> None:
    """Move ``node`` just before ``target`` if it comes after it, the producers of its inputs that also come after
    it first."""
    if nodes.index(node) < nodes.index(target):
        return
    for x in node.inputs:
        if x is not None and x.producer is not None:
            _place_before(nodes, target, x.producer)
    nodes.remove(node)
    nodes.insert(nodes.index(target), node)
