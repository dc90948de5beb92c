"""Phase 2 fusions on the real tiny V4 and V4.1 graphs: each pass fires where the model has its pattern (counts
below) and the fused graph gives bit-identical logits and cache states through the interpreter (fp32), with
activation quantisation off and on. Negative cases (an intermediate read elsewhere) on small hand-built graphs."""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.interpreter import run
from deepinfer.passes.pipeline import run_pass


def fuse(tiny, model: str, quantised: bool, passes: list[str]):
    """Run the passes on a copy of the tiny graph; when anything changed, check the outputs bit for bit."""
    g0, params, inputs, expected = tiny(model, quantised)
    g = copy.deepcopy(g0)
    for name in passes:
        g = run_pass(g, name)
    if g.op_counts() == g0.op_counts():
        return g0.op_counts(), g.op_counts()
    got = run(g, inputs, params, check=True)
    assert len(got) == len(expected)
    for a, e in zip(got, expected):
        assert a.dtype == e.dtype and torch.equal(a, e)
    return g0.op_counts(), g.op_counts()


# (model, passes run, {fused op: count}); V4 tiny has 4 layers, V4.1 tiny 10 (MODEL_SPEC §1.2 layout).
CASES = [
    # q-norm + RoPE + attention + inverse RoPE once per layer (with quantisation: + reshape + output quant)
    ("v4", ["fuse_attention"], {"fused_attention": 4}),
    ("v41", ["fuse_attention"], {"fused_attention": 10}),
    # V4: post + next pre at the 7 sublayer boundaries inside the stack (the last post feeds hc_head)
    ("v4", ["fuse_hyper_connection"], {"hc_post_pre": 7}),
    # V4.1: stats + collapse for 19 of 20 sublayers (layer 0's attention takes stream 0), then post + pre at
    # 17 boundaries (not before the two Engram layers, not at the head)
    ("v41", ["fuse_hyper_connection"], {"hc_pre_collapse": 2, "hc_post_pre_collapse": 17}),
    ("v4", ["fuse_out_proj"], {"grouped_out_proj": 4}),
    ("v41", ["fuse_out_proj"], {"grouped_out_proj": 10}),
    # the shared expert joins the routed experts once fuse_swiglu has made its gate/up op
    ("v4", ["fuse_swiglu", "fuse_moe_experts"], {"moe_grouped_experts": 4}),
    ("v41", ["fuse_swiglu", "fuse_moe_experts"], {"moe_grouped_experts": 10}),
    # the two ratio-2 kv sources (layers 2, 4) and the ratio-1 source (layer 6, no pooling)
    ("v41", ["fuse_compressor"], {"pair_compressor_keys": 2, "compressor_keys": 1}),
    ("v4", ["fuse_compressor"], {}),
]


# Quantisation changes what the attention, output-projection and MoE patterns see (Q/DQ pairs, the output quant)
QUANT_SENSITIVE = ("fuse_attention", "fuse_out_proj", "fuse_moe_experts")


# Every case exact; the quantisation-sensitive ones quantised too (the others see the same pattern either way).
RUNS = [(*c, False) for c in CASES] + [(*c, True) for c in CASES if c[1][-1] in QUANT_SENSITIVE]


@pytest.mark.parametrize(
    ("model", "passes", "fired", "quantised"),
    RUNS,
    ids=[f"{r[0]}-{r[1][-1]}-{'quantised' if r[3] else 'exact'}" for r in RUNS],
)
def test_fusion_fires_on_the_tiny_model_and_keeps_numbers(tiny_model, model, passes, fired, quantised):
    before, after = fuse(tiny_model, model, quantised, passes)
    for op, n in fired.items():
        assert after.get(op, 0) == n, (op, after)
    if not fired:
        assert before == after


def test_attention_fusion_takes_the_output_quant_when_quantisation_is_on(tiny_model):
    g = run_pass(copy.deepcopy(tiny_model("v41", True)[0]), "fuse_attention")
    fused = [n for n in g.nodes if n.op == "fused_attention"]
    assert len(fused) == 10 and all(n.attrs["quant_group"] == 32 and n.attrs["out_groups"] for n in fused)
    assert tiny_model("v41", True)[0].op_counts()["quant_fp8"] - g.op_counts()["quant_fp8"] == 10
    g = run_pass(copy.deepcopy(tiny_model("v4", False)[0]), "fuse_attention")
    assert all(n.attrs["q_norm"] and not n.attrs["quant_group"] for n in g.nodes if n.op == "fused_attention")


def test_moe_layout_follows_the_t_bucket(tiny_model):
    g0 = tiny_model("v4", False)[0]
    for binding, layout in (({}, "auto"), ({"T": 1}, "masked"), ({"T": 512}, "contiguous")):
        g = copy.deepcopy(g0)
        if binding:
            g = run_pass(g, "specialize_shapes", binding)
        g = run_pass(g, "fuse_moe_experts")
        assert {n.attrs["layout"] for n in g.nodes if n.op == "moe_grouped_experts"} == {layout}


# -- negative cases on hand-built graphs ------------------------------------------------------------------


def _attention(extra_user: bool):
    b = GraphBuilder("g")
    q, pos = b.input("q", "f32", ["T", 4, 32]), b.input("positions", "i64", ["T"])
    kv, idx = b.input("kv", "f32", ["N", 32]), b.input("idx", "i64", ["T", 8])
    rope = {"rope_dim": 8, "theta": 10000.0}
    qr = b.rope(b.rmsnorm(q, None, eps=1e-6), pos, **rope)
    o = b.sparse_attention(qr, b.param("sink", "f32", [4]), kv, idx, None, None, scale=32**-0.5)
    b.output(b.rope(o, pos, inverse=True, **rope), *([qr] if extra_user else []))
    return b.build()


def test_attention_fusion_on_a_small_graph_and_not_when_q_is_read_elsewhere():
    g0 = _attention(False)
    g = run_pass(copy.deepcopy(g0), "fuse_attention")
    assert [n.op for n in g.nodes] == ["fused_attention"]
    inputs = {"q": torch.randn(3, 4, 32), "positions": torch.arange(5, 8), "kv": torch.randn(10, 32)}
    inputs["idx"] = torch.randint(-1, 10, (3, 8))
    params = {"sink": torch.randn(4) * 0.1}
    assert torch.equal(run(g, inputs, params)[0], run(g0, inputs, params)[0])
    g = run_pass(_attention(True), "fuse_attention")
    assert "fused_attention" not in [n.op for n in g.nodes]


def test_out_proj_fusion_not_when_the_intermediate_is_read_elsewhere():
    b = GraphBuilder("g")
    x = b.input("x", "f32", ["T", 2, 64])
    u = b.reshape(b.grouped_linear(x, b.param("wa", "f32", [32, 64])), shape=["T", 32])
    b.output(b.linear(u, b.param("wb", "f32", [64, 32])), u)
    g = run_pass(b.build(), "fuse_out_proj")
    assert "grouped_out_proj" not in [n.op for n in g.nodes]


def test_hyper_connection_post_pre_not_when_the_new_streams_are_read_before_the_pre(tiny_model):
    g = copy.deepcopy(tiny_model("v4", False)[0])
    # a reader of layer 0's first new streams placed between its hc_post and the next hc_pre blocks the fusion
    post = next(n for n in g.nodes if n.op == "hc_post")
    at = g.nodes.index(post) + 1
    b = GraphBuilder("tmp")
    probe = b.input("p", "f32", post.outputs[0].shape)
    b.output(b.silu(probe))
    node = b.build().nodes[0]
    node.inputs = [post.outputs[0]]
    node.outputs[0].name = "probe"
    g.nodes.insert(at, node)
    g.outputs.append(node.outputs[0])
    g = run_pass(g, "fuse_hyper_connection")
    assert g.op_counts()["hc_post_pre"] == 6


def _out_proj_after_fp8_epilogue(code_group: int, codes_env: str | None = None):
    """x = dequant_fp8(quant_fp8(a)) per code_group feeding wo_a (block 32, FP8) and wo_b (FP8): the attention's
    FP8 epilogue in front of the output projection."""
    b = GraphBuilder("g")
    a = b.input("a", "f32", ["T", 2, 64])
    x = b.dequant_fp8(*b.quant_fp8(a, group=code_group), group=code_group)
    wa, sa = b.param("wa", "f8e4m3", [64, 64]), b.param("sa", "e8m0", [2, 2])
    wb, sb = b.param("wb", "f8e4m3", [32, 64]), b.param("sb", "e8m0", [1, 2])
    u = b.reshape(b.grouped_linear(x, wa, sa, block=32), shape=["T", 64])
    b.output(b.linear_fp8(u, wb, sb, block=32))
    if codes_env is None:
        return run_pass(b.build(), "fuse_out_proj")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_OUT_PROJ_CODES", codes_env)
        return run_pass(b.build(), "fuse_out_proj")


def test_out_proj_takes_the_epilogue_codes_when_their_groups_are_wo_as_blocks():
    g = _out_proj_after_fp8_epilogue(32)
    node = next(n for n in g.nodes if n.op == "grouped_out_proj")
    assert [n.op for n in g.nodes].count("dequant_fp8") == 0
    assert node.inputs[0].type.dtype.name == "f8e4m3" and node.inputs[5] is not None
    # 64-groups are not wo_a's 32-blocks, or the switch is off: x stays the dequantised fp32 operand
    for g in (_out_proj_after_fp8_epilogue(64), _out_proj_after_fp8_epilogue(32, codes_env="0")):
        node = next(n for n in g.nodes if n.op == "grouped_out_proj")
        assert [n.op for n in g.nodes].count("dequant_fp8") == 1
        assert node.inputs[0].type.dtype.name == "f32" and (len(node.inputs) < 6 or node.inputs[5] is None)
