"""Phase 2 fusions: each fires on its pattern (and not when an intermediate has another user), and the fused
graph gives the numbers of the unfused one through the interpreter."""

from __future__ import annotations

import copy

import torch

from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.interpreter import run
from deepinfer.models.checkpoint import random_weights
from deepinfer.passes.pipeline import run_pass


def _same(g0, g, inputs, params=None):
    for a, e in zip(run(g, inputs, params, check=True), run(g0, inputs, params, check=True)):
        assert a.dtype == e.dtype and torch.equal(a.float(), e.float())


def _fuse(g0, name):
    g = run_pass(copy.deepcopy(g0), name)
    return g, [n.op for n in g.nodes]


# -- rmsnorm + quant -----------------------------------------------------------------------------------


def _norm_quant(dtype="f32", weight=True, extra_user=False):
    b = GraphBuilder("g")
    x = b.input("x", dtype, ["T", 128])
    w = b.param("w", dtype, [128]) if weight else None
    n = b.rmsnorm(x, w, eps=1e-6)
    q, s = b.quant_fp8(n, group=32)
    b.output(b.dequant_fp8(q, s, group=32), *([b.silu(n)] if extra_user else []))
    return b.build()


def test_fuse_rmsnorm_quant_fires_and_keeps_numbers():
    for dtype, weight in (("f32", True), ("bf16", True), ("f32", False)):
        g0 = _norm_quant(dtype, weight)
        g, ops = _fuse(g0, "fuse_rmsnorm_quant")
        assert ops == ["rmsnorm_quant_fp8", "dequant_fp8"]
        x = (torch.randn(5, 128) * 3).to(g0.inputs[0].dtype.torch_dtype)
        params = {"w": (1 + 0.1 * torch.randn(128)).to(x.dtype)} if weight else {}
        _same(g0, g, {"x": x}, params)


def test_fuse_rmsnorm_quant_does_not_fire_when_the_norm_has_another_user():
    _, ops = _fuse(_norm_quant(extra_user=True), "fuse_rmsnorm_quant")
    assert "rmsnorm_quant_fp8" not in ops


# -- swiglu ------------------------------------------------------------------------------------------


def _shared_expert(fp8: bool, limit=10.0, extra_user=False, other_x=False):
    b = GraphBuilder("g")
    x = b.input("x", "f32", ["T", 64])
    x2 = b.input("x2", "f32", ["T", 64]) if other_x else x

    def gemm(v, name, out, inp):
        if not fp8:
            return b.linear(v, b.param(f"{name}.weight", "f32", [out, inp]))
        w, s = b.param(f"{name}.weight", "f8e4m3", [out, inp]), b.param(f"{name}.scale", "e8m0", [1, 1])
        return b.linear_fp8(v, w, s, block=128)

    gate, up = gemm(x, "w1", 32, 64), gemm(x2, "w3", 32, 64)
    h = b.swiglu(gate, up, limit=limit)
    b.output(gemm(h, "w2", 64, 32), *([gate] if extra_user else []))
    return b.build()


def test_fuse_swiglu_fires_for_fp8_and_plain_weights_and_keeps_numbers():
    for fp8 in (True, False):
        g0 = _shared_expert(fp8)
        g, ops = _fuse(g0, "fuse_swiglu")
        assert ops == ["swiglu_gate_up", "linear_fp8" if fp8 else "linear"]
        params = random_weights(g0.params, seed=0, block=128)
        _same(g0, g, {"x": torch.randn(7, 64) * 4}, params)  # * 4: some gates pass the clamp at 10


def test_fuse_swiglu_needs_one_x_and_single_use_intermediates():
    assert "swiglu_gate_up" not in _fuse(_shared_expert(True, extra_user=True), "fuse_swiglu")[1]
    assert "swiglu_gate_up" not in _fuse(_shared_expert(True, other_x=True), "fuse_swiglu")[1]


# -- moe gate + routing ---------------------------------------------------------------------------------


def _router(hashed: bool, extra_user: bool = False):
    b = GraphBuilder("g")
    x, tokens = b.input("x", "f32", ["T", 64]), b.input("tokens", "i64", ["T"])
    logits = b.linear(x, b.param("gate.weight", "f32", [8, 64]))
    if hashed:
        w, idx = b.moe_route(logits, None, b.param("gate.tid2eid", "i32", [100, 2]), tokens, topk=2)
    else:
        w, idx = b.moe_route(logits, b.param("gate.bias", "f32", [8]), topk=2, route_scale=1.5)
    b.output(w, idx, *([logits] if extra_user else []))
    return b.build()


def test_fuse_moe_gate_fires_for_score_and_hash_routing_and_keeps_numbers():
    for hashed in (False, True):
        g0 = _router(hashed)
        g, ops = _fuse(g0, "fuse_moe_gate")
        assert ops == ["moe_gate_route"]
        params = random_weights(g0.params, seed=2, n_experts=8)
        _same(g0, g, {"x": torch.randn(6, 64), "tokens": torch.randint(0, 100, (6,))}, params)


def test_fuse_moe_gate_does_not_fire_when_the_logits_are_read_elsewhere():
    assert "moe_gate_route" not in _fuse(_router(False, extra_user=True), "fuse_moe_gate")[1]
