"""cache_storage: which caches the sm90 pipeline stores in bf16 (every reader a bf16 kernel's KV pool), which it
keeps f32 (another reader, a torch-reference bucket, the switch off, the cpu target), and how the graph changes
(the cache input and entry retyped, one cast per written value, the derived values retyped, the verifier happy)."""

from __future__ import annotations

import os

import pytest

from deepinfer.compiler import compile_model
from deepinfer.ir import dtypes as dt
from deepinfer.ir.verifier import verify
from deepinfer.passes.cache_storage import CAST_REASON, ENV, cache_storage, format_cache_storage
from deepinfer.passes.pattern import clone_graph

BF16_KINDS = {"window", "compressed"}  # V4.1: the SWA rings and the compressed KV, read by the attention only


def compile_f32(model: str):
    """The sm90 plan graph with the pass switched off: select_kernels' bindings, every cache as the model declares."""
    saved = os.environ.get(ENV)
    os.environ[ENV] = "0"
    try:
        return compile_model(model, "sm90").plan.graph
    finally:
        os.environ.pop(ENV) if saved is None else os.environ.__setitem__(ENV, saved)


@pytest.fixture(scope="module")
def small_f32():
    return compile_f32("deepseek-v4.1-flash:small")


def dtypes(g) -> dict[str, str]:
    return {e["name"]: e["dtype"] for e in g.meta["caches"]}


def kinds(g) -> dict[str, str]:
    return {e["name"]: e["kind"] for e in g.meta["caches"]}


def test_rings_and_compressed_kv_are_stored_in_bf16(small_f32):
    g = cache_storage(clone_graph(small_f32), enabled=True)
    verify(g)
    stored, kind = dtypes(g), kinds(g)
    assert {n for n, d in stored.items() if d == "bf16"} == {n for n, k in kind.items() if k in BF16_KINDS}
    assert all(stored[n] == ("i64" if kind[n] == "engram_history" else "f32") for n in stored if kind[n] not in
               BF16_KINDS)  # fmt: skip
    inputs = {v.name: v for v in g.inputs}
    assert all(inputs[n].dtype.name == d for n, d in stored.items())  # the entry and the graph input agree
    assert all(g.outputs[1 + i].dtype.name == e["dtype"] for i, e in enumerate(g.meta["caches"]))  # new versions
    bf16 = {n for n, d in stored.items() if d == "bf16"}
    writes = [n for n in g.nodes if n.op == "scatter_rows" and n.inputs[0].dtype == dt.bf16]
    pools = [n for n in g.nodes if n.op == "concat" and n.inputs[0].name in bf16]
    assert writes and pools and all(n.inputs[-1].producer.op == "cast" for n in writes + pools)
    binds = g.meta["kernels"]["nodes"]
    old = {n.outputs[0].name for n in small_f32.nodes if n.op == "cast"}
    new = [n for n in g.nodes if n.op == "cast" and n.outputs[0].name not in old]
    # one cast per written value: a layer's new kv row feeds its ring write and its window pool through one cast
    assert {c.outputs[0].name for c in new} == {n.inputs[-1].name for n in writes + pools}
    assert len(new) < len(writes) + len(pools)
    assert all({b["reason"] for b in binds[c.outputs[0].name]["buckets"].values()} == {CAST_REASON} for c in new)
    why = g.meta["cache_storage"]
    assert "index_scores" in why["cache.2.idx_k"]["why"] and "pair_compressor_keys" in why["cache.2.cmp_kv"]["why"]
    assert "fused_attention" in why["cache.2.ckv"]["why"] and "cache.2.ckv" in format_cache_storage(g)


def test_plan_memory_counts_half_the_cache_bytes(small_f32):
    """The default sm90 compile (pass on) against the same pipeline with it off: the caches' bytes in the memory plan
    drop by half the rings' and compressed rows' share."""
    on = compile_model("deepseek-v4.1-flash:small", "sm90").plan.graph
    assert dtypes(on) != dtypes(small_f32)
    f32 = small_f32.meta["memory"]["caches"]
    assert on.meta["memory"]["caches"] < 0.75 * f32


def test_a_torch_reference_bucket_keeps_what_that_node_reads(small_f32):
    """One attention node whose prefill bucket falls back to the torch reference: its ring and the compressed cache
    it reads stay f32 (the reference would read the rounded values), with the node named; the others still go."""
    g = clone_graph(small_f32)
    node = next(n for n in g.nodes if n.op == "fused_attention" and n.inputs[5] is not None)
    binding = g.meta["kernels"]["nodes"][node.outputs[0].name]["buckets"]
    binding["prefill"] = {"family": "torch_ref", "reason": "test"}
    ring, ckv = node.inputs[3].producer.inputs[0].name, _cache_of(node.inputs[5])
    g = cache_storage(g, enabled=True)
    verify(g)
    stored, why = dtypes(g), g.meta["cache_storage"]
    assert stored[ring] == stored[ckv] == "f32"
    assert node.outputs[0].name in why[ring]["why"] and "torch_ref" in why[ckv]["why"]
    assert sum(d == "bf16" for d in stored.values()) == sum(k in BF16_KINDS for k in kinds(g).values()) - 2


def _cache_of(v):
    """The cache input a version of it comes from (through scatter_rows)."""
    while v.producer is not None:
        v = v.producer.inputs[0]
    return v.name


def test_off_switch_and_the_cpu_target(small_f32, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    g = cache_storage(clone_graph(small_f32))
    assert set(dtypes(g).values()) == {"f32", "i64"} and len(g.nodes) == len(small_f32.nodes)
    assert all(r["why"] == f"{ENV}=0" for r in g.meta["cache_storage"].values())
    cpu = compile_model("deepseek-v4.1-flash:tiny", "cpu").plan.graph  # no bindings: the references read the caches
    g = cache_storage(clone_graph(cpu), enabled=True)
    assert dtypes(g) == dtypes(cpu) and all("cpu" in r["why"] for r in g.meta["cache_storage"].values())


def test_tiny_attention_on_the_reference_keeps_every_cache():
    """tiny V4.1 (top-k 8 / 14: no sparse_attn_decode chunking): the attention runs its torch reference in every
    bucket, so the default sm90 compile keeps every cache f32."""
    g = compile_model("deepseek-v4.1-flash:tiny", "sm90").plan.graph
    assert "bf16" not in dtypes(g).values()
    assert all("torch_ref" in r["why"] for n, r in g.meta["cache_storage"].items() if n.endswith((".swa", ".ckv")))


def test_v4_hca_layers_keep_f32_the_others_go():
    """V4 (small): a ratio-128 (HCA) attention's top-k is its compressed rows' count at run time -- at a cache length
    that does not chunk its kernel declines and the reference reads the caches -- so the caches it reads (its ring,
    its compressed KV) stay f32, with that reason; the other layers' rings and compressed KV go bf16 (the HCA
    visibility reading a cache's row count alone has no say); the indexer's caches and compressor states stay f32."""
    g = compile_model("deepseek-v4-flash:small", "sm90").plan.graph
    verify(g)
    stored, why = dtypes(g), g.meta["cache_storage"]
    hca = [n for n in g.nodes if n.op == "fused_attention" and n.inputs[6] is not None
           and n.inputs[6].producer.op == "compressed_indices"]  # fmt: skip
    kept = {_cache_of(n.inputs[5]) for n in hca} | {n.inputs[3].producer.inputs[0].name for n in hca}
    assert hca and all(stored[c] == "f32" and "HCA" in why[c]["why"] for c in kept)
    assert {n for n, d in stored.items() if d == "bf16"} == {n for n in stored if n.endswith((".swa", ".ckv"))} - kept
    assert all(".idx_" not in n and "cmp_" not in n for n, d in stored.items() if d == "bf16")
