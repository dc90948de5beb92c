"""cache_storage: store a KV cache in the dtype its kernels read (bf16) instead of the graph's f32.

The model graph declares every cache f32. On sm90 the attention kernel (sparse_attn_decode) reads its two KV pools
-- the window pool concat(SWA ring, this step's rows) and the compressed rows -- in bf16, so an f32 cache costs twice
its memory and a conversion of the pools every step, and the kernel rounds every value to bf16 anyway. Rounding once
on the way in instead gives the kernel the same bf16 values (round to nearest, either way): the same outputs.

What it matches: a floating cache (graph.meta["caches"]) whose every reader -- of the cache input and of the values
derived from it: its new versions (scatter_rows into it) and the ring's window pool (concat(ring, rows) along rows) --
is a KV-pool operand (win_kv / cmp_kv) of sparse_attention / fused_attention bound to a bf16-reading kernel family in
every bucket (select_kernels' bindings; so this pass runs after it); readers of its row count alone (HCA visibility,
compressed_indices) have no say, but an attention whose top-k is that row count (HCA) keeps what it reads f32: its
kernel declines at run time wherever the engine's cache length does not chunk. The check: one foreign reader -- the
index scores reading index keys, a compressor reading its state, a bucket whose attention falls back to the torch
reference -- keeps the cache f32, with the reason. The rewrite: the cache input and its entry's "dtype" become bf16,
every write's rows and the ring's new rows go through one `cast` to bf16 (bound to the torch reference, reason
recorded; the rows of one step, not the pool), and the derived values take the cache's dtype. The runtime
allocates, copies and snapshots caches in the entry's dtype (runtime/kv_cache.py, session.allocate_caches).

graph.meta["cache_storage"] records, per cache, its dtype and why (format_cache_storage prints it). Nothing changes
for the cpu target (no bindings) or with DEEPINFER_CACHE_BF16=0. What the bindings cannot promise: an attention node
whose adapter declines at run time (a shape the binding did not foresee) runs its torch reference on the stored,
already rounded, values -- the kernel's numbers, not the f32 cache's.
"""

from __future__ import annotations

import os

from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.passes.pattern import fresh_name
from deepinfer.passes.pipeline import register_pass
from deepinfer.passes.rewrite_patterns import node_users

ENV = "DEEPINFER_CACHE_BF16"
# kernel family -> the dtype it reads its KV pools in
POOL_DTYPE = {"sparse_attn_decode": dt.bf16}
# attention op -> input positions of its KV pools (win_kv, cmp_kv)
POOL_INPUTS = {"sparse_attention": (2, 4), "fused_attention": (3, 5)}
# op -> inputs it reads the row count of only (HCA visibility: V4's ratio-128 layers): no say in the dtype
SHAPE_ONLY = {"compressed_indices": (1,), "batched_compressed_indices": (1,)}
CAST_REASON = "cache write: rows rounded to the cache's storage dtype (passes/cache_storage.py)"


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1") != "0"


@register_pass("cache_storage")
def cache_storage(g: Graph, *, enabled: bool | None = None) -> Graph:
    """Store each cache whose readers are all bf16 kernel pools in bf16 (see the module doc)."""
    on = enabled_by_env() if enabled is None else enabled
    kernels = g.meta.get("kernels")
    records = {}
    users = node_users(g)  # parameters skipped: no cache flows through the ~94k expert weights of a real graph
    inputs = {v.name: v for v in g.inputs}
    casts = _Casts(g)
    for entry in g.meta.get("caches", []):
        cache = inputs[entry["name"]]
        if not on:
            why, store = f"{ENV}=0", None
        elif kernels is None or kernels.get("target") == "cpu":
            why, store = "no kernel bindings (cpu target): the torch references read f32", None
        else:
            why, store = _storage(cache, users, kernels["nodes"])
        if store is not None and store != cache.dtype:
            _store_as(g, entry, cache, store, users, casts)
        records[entry["name"]] = {"dtype": entry.get("dtype", "f32"), "why": why}
    if casts.made:
        _bind_casts(kernels, casts.made)
    g.meta["cache_storage"] = records
    return g


def _storage(cache: Value, users: dict, bindings: dict) -> tuple[str, object]:
    """(why, the dtype to store the cache in, or None to keep it)."""
    if not cache.dtype.is_float or cache.dtype.bits <= 16:
        return f"{cache.dtype.name} cache: kept", None
    values, reads = _derived(cache, users)
    reads = [(node, k) for node, k in reads if k not in SHAPE_ONLY.get(node.op, ())]
    wants = set()
    for node, k in reads:
        if node.op in POOL_INPUTS and _topk_at_run_time(node):
            return (f"read by {node.label}, whose top-k is the compressed rows' count at run time (HCA): where it does "
                    f"not chunk the kernel declines and the reference reads the cache: kept {cache.dtype.name}"), None
        store = _pool_dtype(node, k, bindings)
        if store is None:
            how = ", ".join(sorted(_families(node, bindings))) or "unbound"
            return f"read by {node.label} (input {k}; {how}): kept {cache.dtype.name}", None
        wants.add(store)
    if len(wants) != 1:
        return "no kernel reads it as a KV pool: kept", None
    store = wants.pop()
    ops = "/".join(sorted({n.op for n, _ in reads}))
    return f"{len(reads)} reads, all KV pools of {ops} on {store.name} kernels ({len(values)} values)", store


def _topk_at_run_time(node: Node) -> bool:
    """The attention's compressed entries are every visible row (compressed_indices: V4's ratio-128 layers), so its
    top-k -- what the kernel's chunking must divide -- follows the cache length the engine runs with, not the one
    the binding saw."""
    i = POOL_INPUTS[node.op][1] + 1
    idx = node.inputs[i] if i < len(node.inputs) else None
    return idx is not None and idx.producer is not None and idx.producer.op in SHAPE_ONLY


def _pool_dtype(node: Node, k: int, bindings: dict):
    """The dtype the kernel bound to ``node`` reads its k-th input in, when that input is a KV pool and every bucket
    binds one such kernel; else None."""
    fams = _families(node, bindings)
    if k not in POOL_INPUTS.get(node.op, ()) or len(fams) != 1 or not fams <= POOL_DTYPE.keys():
        return None
    return POOL_DTYPE[next(iter(fams))]


def _derived(cache: Value, users: dict) -> tuple[list[Value], list[tuple[Node, int]]]:
    """The cache's versions and window pools (scatter_rows into it, concat(it, rows) along rows), and every other
    (node, input position) that reads one of them."""
    family, reads, todo = [], [], [cache]
    while todo:
        v = todo.pop()
        family.append(v)
        for node in users.get(v.name, []):
            for k, x in enumerate(node.inputs):
                if x is not v:
                    continue
                if _extends(node, k):
                    todo.append(node.outputs[0])
                else:
                    reads.append((node, k))
    return family, reads


def _extends(node: Node, k: int) -> bool:
    """The node makes a new version of its k-th input (a write into it, or the ring's window pool)."""
    if node.op == "scatter_rows":
        return k == 0
    return node.op == "concat" and k == 0 and node.attrs.get("axis") == 0 and len(node.inputs) == 2


def _families(node: Node, bindings: dict) -> set[str]:
    rec = bindings.get(node.outputs[0].name)
    return {b.get("family", "torch_ref") for b in rec["buckets"].values()} if rec else set()


def _store_as(g: Graph, entry: dict, cache: Value, store, users: dict, casts: _Casts) -> None:
    """Retype the cache and its versions to ``store``; the rows written into it (and the window's new rows) go
    through a cast."""
    cache.type = cache.type.with_dtype(store)
    entry["dtype"] = store.name
    family, _ = _derived(cache, users)
    for v in family[1:]:
        node = v.producer
        k = 2 if node.op == "scatter_rows" else 1
        node.inputs[k] = casts.of(node.inputs[k], store)
        v.type = v.type.with_dtype(store)  # a write returns its cache, the window pool its ring: the cache's dtype


class _Casts:
    """One cast node per written value, right after the value's definition (shared by every write and window pool
    that takes it, whatever their order), named from ONE set of the graph's names made at the first cast: a 40-layer
    graph holds ~94k parameter names, and scanning them per cast (make_node, fresh_name) cost ~25 ms a cast."""

    def __init__(self, g: Graph):
        self.g, self.made, self.taken = g, {}, None

    def of(self, x: Value, store) -> Value:
        if x.dtype == store:
            return x
        if x.name not in self.made:
            if self.taken is None:
                self.taken = {v.name for v in (*self.g.inputs, *self.g.params)}
                self.taken.update(o.name for n in self.g.nodes for o in n.outputs)
            name = fresh_name(self.g, f"{x.name}.{store.name}", self.taken)
            self.taken.add(name)
            node = Node("cast", [x], {"dtype": store})
            node.outputs = [Value(name, x.type.with_dtype(store), "node", node)]  # Cast.infer's type
            at = 0 if x.producer is None else next(i for i, n in enumerate(self.g.nodes) if n is x.producer) + 1
            self.g.nodes.insert(at, node)
            self.made[x.name] = node.outputs[0]
        return self.made[x.name]


def _bind_casts(kernels: dict, casts: dict) -> None:
    """The casts run the torch reference in every bucket (a few rows per step), with the reason on record."""
    for v in casts.values():
        kernels["nodes"][v.name] = {"op": "cast", "buckets": {b: {"family": "torch_ref", "reason": CAST_REASON}
                                                            for b in kernels["buckets"]}}  # fmt: skip
    kernels["fallback"].setdefault("cast", CAST_REASON)


def format_cache_storage(g: Graph) -> str:
    """One line per cache: its storage dtype and why."""
    rec = g.meta.get("cache_storage", {})
    return "\n".join(["cache storage:"] + [f"  {name:<24} {r['dtype']:<5} {r['why']}" for name, r in rec.items()])
