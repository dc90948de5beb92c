"""fold_qdq: phase 1's explicit quant_fp8 -> dequant_fp8 pairs folded into their readers (linear_fp8's act_group,
else one fake_quant_fp8), with the reference numbers unchanged bit for bit (the oracle: the graph before the pass,
run by the interpreter)."""

import torch

from deepinfer.ir import interpreter
from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.ops.quant import dequant_fp8_groups, fake_quant_fp8, quant_fp8_groups
from deepinfer.passes.fold_qdq import fold_qdq
from deepinfer.passes.pipeline import Pipeline


def _graph():
    b = GraphBuilder("qdq")
    x = b.input("x", "f32", [6, 64])
    w, s = b.param("w", "f8e4m3", [32, 64]), b.param("s", "e8m0", [1, 2])
    wf = b.param("wf", "bf16", [16, 64])
    q, qs = b.op("quant_fp8", x, group=32)
    dq = b.op("dequant_fp8", q, qs, group=32)
    y1 = b.op("linear_fp8", dq, w, s, block=32)
    y2 = b.op("linear", dq, wf, None)  # another reader of the same pair: gets fake_quant_fp8
    b.output(y1, y2)
    return b.build()


def _params():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(32, 64, generator=g) * 8).to(torch.float8_e4m3fn)
    s = torch.tensor([[120, 121]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return {"w": w, "s": s, "wf": torch.randn(16, 64, generator=g).bfloat16()}


def test_pairs_fold_and_the_numbers_stay_the_same():
    x = torch.randn(6, 64) * torch.logspace(-3, 3, 64)
    x[2] = 0.0  # a zero group: the scale floor path
    before = interpreter.run(_graph(), {"x": x}, _params())
    g = fold_qdq(_graph())
    ops = [n.op for n in g.nodes]
    assert "quant_fp8" not in ops and "dequant_fp8" not in ops and ops.count("fake_quant_fp8") == 1
    lin = next(n for n in g.nodes if n.op == "linear_fp8")
    assert lin.inputs[0].name == "x" and lin.attrs["act_group"] == 32
    after = interpreter.run(g, {"x": x}, _params())
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_pair_whose_codes_are_read_elsewhere_stays():
    b = GraphBuilder("shared_codes")
    x = b.input("x", "f32", [4, 64])
    w, s = b.param("w", "f8e4m3", [32, 64]), b.param("s", "e8m0", [1, 2])
    q, qs = b.op("quant_fp8", x, group=32)
    y = b.op("linear_fp8", b.op("dequant_fp8", q, qs, group=32), w, s, block=32)
    b.output(y, qs)
    g = fold_qdq(b.build())
    assert [n.op for n in g.nodes] == ["quant_fp8", "dequant_fp8", "linear_fp8"]


def test_fake_quant_is_the_pair_without_the_e8m0_round_trip():
    x = torch.randn(5, 96) * torch.logspace(-6, 6, 96)
    x[1] = 0.0
    q, s = quant_fp8_groups(x, 32)
    assert torch.equal(fake_quant_fp8(x, 32), dequant_fp8_groups(q, s, 32))


def test_the_gpu_pipeline_runs_it_after_the_fusions():
    from deepinfer.compiler import default_pipeline

    fuse = [name for name, _ in default_pipeline("sm90").phases["fuse"]]
    assert fuse[-1] == "fold_qdq" and "fuse_moe_experts" in fuse
    assert "fold_qdq" not in [name for name, _ in Pipeline.default().phases["fuse"]]


def test_rmsnorm_quant_pairs_fold_to_rmsnorm():
    """dequant_fp8(rmsnorm_quant_fp8(v, w)) read by two FP8 GEMMs -> rmsnorm(v, w) read with act_group: the
    reference (quant_fp8(rmsnorm(v, w)) then dequant) is unchanged bit for bit."""
    b = GraphBuilder("rq")
    x = b.input("x", "f32", [6, 64])
    nw = b.param("nw", "bf16", [64])
    w, s = b.param("w", "f8e4m3", [32, 64]), b.param("s", "e8m0", [1, 2])
    q, qs = b.op("rmsnorm_quant_fp8", x, nw, eps=1e-6, group=32)
    dq = b.op("dequant_fp8", q, qs, group=32)
    b.output(b.op("linear_fp8", dq, w, s, block=32), b.op("linear_fp8", dq, w, s, block=32))
    g = b.build()
    params = {**_params(), "nw": (torch.rand(64) + 0.5).bfloat16()}
    xin = torch.randn(6, 64) * 3
    before = interpreter.run(g, {"x": xin}, params)
    g = fold_qdq(g)
    assert [n.op for n in g.nodes] == ["rmsnorm", "linear_fp8", "linear_fp8"]
    assert all(n.attrs["act_group"] == 32 and n.inputs[0] is g.nodes[0].outputs[0] for n in g.nodes[1:])
    after = interpreter.run(g, {"x": xin}, params)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
