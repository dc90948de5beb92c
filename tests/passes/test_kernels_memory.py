"""Phases 4 and 5 on tiny V4: kernel binding coverage, the batch-invariance check, memory planning."""

from __future__ import annotations

import pytest

from deepinfer.errors import VerificationError
from deepinfer.ir.builder import GraphBuilder
from deepinfer.models import deepseek_v4 as m4
from deepinfer.passes.check_batch_invariance import check_batch_invariance
from deepinfer.passes.pattern import clone_graph
from deepinfer.passes.pipeline import Pipeline, run_pipeline
from deepinfer.passes.plan_memory import lifetimes, nbytes, plan_memory
from deepinfer.passes.select_kernels import format_kernel_report, select_kernels

FAMILIES = {"fp8_gemm", "moe_grouped_gemm", "rmsnorm_quant", "moe_routing", "sparse_attn_decode", "hyper_connection",
            "rope", "engram", "compressor", "linear_bf16", "indexer_topk", "act_quant", "cache_rows"}  # fmt: skip


@pytest.fixture(scope="module")
def opt():
    g = m4.build_graph(m4.parse_config(m4.TINY_CONFIGS["tiny"]))
    pipe = Pipeline.default().with_phase("quantize", [("convert_fp4_to_fp8", {"target": "sm90"})])
    return run_pipeline(g, pipe.with_phase("select_kernels", []).with_phase("plan_memory", []))[0]


def test_every_node_is_bound(opt):
    g = select_kernels(clone_graph(opt), target="sm90")
    k = g.meta["kernels"]
    assert set(k["nodes"]) == {n.outputs[0].name for n in g.nodes}
    fams = {b["family"] for rec in k["nodes"].values() for b in rec["buckets"].values()}
    assert fams <= FAMILIES | {"torch_ref", "view", "collective"}
    assert {"fp8_gemm", "moe_grouped_gemm", "rmsnorm_quant"} <= fams
    assert all(isinstance(why, str) and why for why in k["fallback"].values())
    assert "linear" in k["fallback"]  # bf16 GEMMs: linear_bf16 at decode, the reference (cuBLAS) at prefill
    lin = next(r for r in k["nodes"].values() if r["op"] == "linear")["buckets"]
    assert lin["decode"]["family"] == "linear_bf16" and lin["prefill"]["family"] == "torch_ref"
    gemm = next(r for r in k["nodes"].values() if r["op"] == "linear_fp8")["buckets"]
    assert gemm["decode"]["config"]["block_m"] == 64 and gemm["prefill"]["config"]["block_m"] == 128
    assert "torch_ref" in format_kernel_report(g)


def test_batch_invariance_names_the_node(opt):
    free = select_kernels(clone_graph(opt), target="sm90", batch_invariant=False)
    with pytest.raises(VerificationError, match=r"batch invariance: node %\S+ = rmsnorm reduction field 'threads'"):
        check_batch_invariance(free, enabled=True)
    check_batch_invariance(free, enabled=False)  # off: no check
    pinned = select_kernels(clone_graph(opt), target="sm90", batch_invariant=True)
    check_batch_invariance(pinned, enabled=True)
    assert pinned.meta["batch_invariance"]["unchecked"] > 0  # torch_ref nodes are listed, not verified
    # a GEMM whose K split differs between buckets
    rec = next(r for r in pinned.meta["kernels"]["nodes"].values() if r["op"] == "linear_fp8")
    rec["buckets"]["decode"]["config"]["block_k"] = 32
    with pytest.raises(VerificationError, match="= linear_fp8 reduction field 'block_k' depends on the bucket"):
        check_batch_invariance(pinned, enabled=True)


def test_env_turns_the_check_on_in_the_pipeline(opt, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    pipe = Pipeline.from_config(
        {"phases": {"select_kernels": [("select_kernels", {"target": "sm90"}), "check_batch_invariance"]}}
    )
    out, _ = run_pipeline(opt, pipe)
    assert out.meta["kernels"]["batch_invariant"] is True


def _overlaps(a, b):
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def test_memory_plan_is_valid_and_reuses(opt):
    g = plan_memory(select_kernels(clone_graph(opt), target="sm90"), T=64, max_len=1024)
    m = g.meta["memory"]
    env = {"T": 64, **m["symbols"]}
    bufs = lifetimes(g, env)
    spans = {n: (m["offsets"][n], bufs.size[n], bufs.start[n], bufs.end[n]) for n in bufs.size}
    items = list(spans.values())
    for i, a in enumerate(items):  # buffers live at the same time never share bytes
        for b in items[i + 1 :]:
            if a[2] <= b[3] and b[2] <= a[3]:
                assert not _overlaps(a, b)
    assert m["live_max"] <= m["activations"] < m["no_reuse"]
    assert m["weights"] == sum(nbytes(p, env) for p in g.params) == sum(m["weights_by_kind"].values())
    assert m["caches"] == sum(nbytes(v, env) for v in g.inputs if v.name.startswith("cache."))
    assert m["peak"] == m["weights"] + m["caches"] + m["io"] + m["activations"]
    small = plan_memory(clone_graph(g), T=1, max_len=1024).meta["memory"]
    assert small["activations"] < m["activations"] and small["weights"] == m["weights"]


def test_greedy_reuse_on_a_chain():
    b = GraphBuilder("chain")
    x = b.input("x", "f32", ["T", 256])
    h = b.relu(b.exp(b.neg(x)))  # three [T, 256] buffers, each dead after the next is made
    y = b.add(h, b.reshape(h, shape=["T", 256]))  # a view of h keeps h alive
    b.output(y)
    g = plan_memory(b.build(), T=4)
    m = g.meta["memory"]
    assert m["buffers"] == 4 and m["no_reuse"] == 4 * 4096
    assert m["activations"] == 2 * 4096  # two buffers at a time suffice


OLD_BINDERS = {"linear_fp8", "moe_experts", "moe_experts_local", "moe_grouped_experts", "rmsnorm", "rmsnorm_quant_fp8",
               "moe_route", "sparse_attention", "hc_pre_collapse", "hc_post"}  # fmt: skip


def _v41(preset):
    from deepinfer.models import deepseek_v41 as m41
    from deepinfer.models.presets import preset_config

    g = m41.build_graph(m41.parse_config(preset_config("deepseek-v4.1-flash", preset)))
    pipe = Pipeline.default().with_phase("quantize", [("convert_fp4_to_fp8", {"target": "sm90"})])
    return run_pipeline(g, pipe.with_phase("select_kernels", []).with_phase("plan_memory", []))[0]


@pytest.mark.parametrize("preset", ["tiny", "real"])
def test_v41_binding_coverage_grows(preset, monkeypatch):
    from deepinfer.passes import select_kernels as sk

    g = _v41(preset)
    after = select_kernels(clone_graph(g), target="sm90")
    print(format_kernel_report(after))
    monkeypatch.setattr(sk, "BINDERS", {op: b for op, b in sk.BINDERS.items() if op in OLD_BINDERS})
    before = select_kernels(clone_graph(g), target="sm90")
    n_before, n_after = before.meta["kernels"]["coverage"]["torch_ref"], after.meta["kernels"]["coverage"]["torch_ref"]
    print(f"{preset}: torch_ref nodes {n_before} -> {n_after}")
    assert n_after < n_before
    cov = after.meta["kernels"]["coverage"]
    assert all(cov.get(f, 0) > 0 for f in ("rope", "engram", "compressor", "moe_routing")), cov
    nodes = after.meta["kernels"]["nodes"].values()
    attn = [r["buckets"] for r in nodes if r["op"] == "fused_attention"]
    if preset == "real":
        assert attn[0]["decode"]["family"] == "sparse_attn_decode"
        assert "rope(q)" in attn[0]["decode"]["shape"]["torch_steps"]
        assert attn[0]["prefill"]["family"] == "sparse_attn_decode" and attn[0]["prefill"]["config"]["num_split"] == 1
    scores = [r["buckets"] for r in nodes if r["op"] == "index_scores"]
    assert scores and scores[0]["decode"]["family"] == "indexer_topk"  # the f32 decode kernel (Triton)
    assert scores[0]["prefill"]["family"] == "indexer_topk" and scores[0]["prefill"]["config"]["block_c"] == 128
    assert cov.get("topk_select", 0) > 0  # one- and two-level top-k (candidate blocks) bind
    assert "topk_entries" not in after.meta["kernels"]["fallback"]


def test_batch_invariance_pins_attention_splits():
    from deepinfer.codegen.kernels import sparse_attn_decode

    g = _v41("real")
    buckets = {"decode": {"T": 1}, "batch": {"T": 64}}
    free = select_kernels(clone_graph(g), target="sm90", buckets=buckets, batch_invariant=False)
    rec = next(r for r in free.meta["kernels"]["nodes"].values() if r["op"] == "fused_attention")["buckets"]
    topk = rec["decode"]["shape"]["topk"]
    assert rec["decode"]["config"] == asdict_cfg(sparse_attn_decode.sm90_config(1, topk))
    assert rec["decode"]["config"]["num_split"] != rec["batch"]["config"]["num_split"]
    with pytest.raises(VerificationError, match="reduction field"):
        check_batch_invariance(free, enabled=True)
    pinned = select_kernels(clone_graph(g), target="sm90", buckets=buckets, batch_invariant=True)
    check_batch_invariance(pinned, enabled=True)
    rec = next(r for r in pinned.meta["kernels"]["nodes"].values() if r["op"] == "fused_attention")["buckets"]
    assert rec["decode"]["config"]["num_split"] == rec["batch"]["config"]["num_split"]
    gate = next(r for r in pinned.meta["kernels"]["nodes"].values() if r["op"] == "engram_gate")["buckets"]
    assert gate["decode"]["family"] == "engram" and gate["decode"]["config"] == gate["batch"]["config"]


def asdict_cfg(cfg):
    from dataclasses import asdict

    return asdict(cfg)
