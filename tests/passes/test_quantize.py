"""Phase 1: explicit activation quantisation (quantize_activations) and the FP4 -> FP8 load-time conversion
(convert_fp4_to_fp8): what they change, that they are off by default, and their numerics."""

from __future__ import annotations

import copy

import torch

from deepinfer.ir import dtypes as dt
from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.interpreter import run
from deepinfer.ir.ops.quant import dequant_fp4_rows, dequant_fp8_blocks
from deepinfer.models.checkpoint import random_weights
from deepinfer.passes.convert_fp4_to_fp8 import FN, apply_param_conversions, fp4_to_fp8_block
from deepinfer.passes.pipeline import run_pass

# -- quantize_activations ----------------------------------------------------------------------------------


def _two_gemms(act_group: int = 0, k: int = 128):
    """Two FP8 GEMMs reading one x (like wq_a and wkv), block 32."""
    b = GraphBuilder("g")
    x = b.input("x", "f32", ["T", k])
    outs = []
    for name in ("wq", "wkv"):
        w, s = b.param(f"{name}.weight", "f8e4m3", [64, k]), b.param(f"{name}.scale", "e8m0", [2, k // 32])
        outs.append(b.linear_fp8(x, w, s, block=32, act_group=act_group))
    b.output(*outs)
    return b.build()


def test_off_by_default_leaves_the_graph_exact():
    g0 = _two_gemms()
    g = run_pass(copy.deepcopy(g0), "quantize_activations")
    assert [n.op for n in g.nodes] == ["linear_fp8", "linear_fp8"]


def test_on_is_the_quantised_reference_bit_for_bit_with_one_quant_per_value():
    g = run_pass(_two_gemms(), "quantize_activations", {"enabled": True})
    assert [n.op for n in g.nodes] == ["quant_fp8", "dequant_fp8", "linear_fp8", "linear_fp8"]
    assert g.nodes[0].attrs["group"] == 32 and all(n.attrs["act_group"] == 0 for n in g.nodes[2:])
    ref = _two_gemms(act_group=32)  # the GEMMs quantising x themselves, as the FP8 kernels do
    params = random_weights(ref.params, seed=3, block=32)
    x = torch.randn(7, 128) * 3
    got, want = run(g, {"x": x}, params, check=True), run(ref, {"x": x}, params, check=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    exact = run(_two_gemms(), {"x": x}, params)[0]
    assert not torch.equal(exact, got[0])  # and it does quantise


def test_implicit_quantisation_is_made_explicit_even_when_off():
    g = run_pass(_two_gemms(act_group=32), "quantize_activations")
    assert [n.op for n in g.nodes] == ["quant_fp8", "dequant_fp8", "linear_fp8", "linear_fp8"]


def test_on_the_tiny_models_and_rmsnorm_quant_fires(tiny_model):
    # V4 tiny: block 128 over rows of 32/64 -> one group per row; V4.1: groups of 32 (the weight block)
    for model, group, n_quant, n_fused in (("v4", None, 24, 5), ("v41", 32, 62, 16)):
        g = tiny_model(model, True)[0]
        quants = [n for n in g.nodes if n.op == "quant_fp8"]
        assert len(quants) == n_quant
        assert group is None or {n.attrs["group"] for n in quants} == {group}
        assert "quant_fp8" not in tiny_model(model, False)[0].op_counts()
        fused = run_pass(copy.deepcopy(g), "fuse_rmsnorm_quant").op_counts()
        assert fused["rmsnorm_quant_fp8"] == n_fused  # q_norm of every layer (+ attn_norm where only FP8 reads it)


# -- convert_fp4_to_fp8 --------------------------------------------------------------------------------------


def _fp4(exps: list[int], rows: int = 4, seed: int = 0):
    """Packed FP4 weight [rows, 32*len(exps)] with every E2M1 code present and group g scaled by 2^exps[g]."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, 32 * len(exps)), generator=gen, dtype=torch.uint8)
    codes[:, :16] = torch.arange(16, dtype=torch.uint8)
    scale = dt.float_to_e8m0(torch.exp2(torch.tensor(exps, dtype=torch.float32)).expand(rows, -1).contiguous())
    return dt.pack_fp4(codes), scale


def _exact(w, s, block) -> bool:
    q, qs = fp4_to_fp8_block(w, s, block)
    return torch.equal(dequant_fp4_rows(w, s), dequant_fp8_blocks(q, qs, block))


def test_fp4_to_fp8_is_exact_within_14_binades_of_the_block_maximum():
    assert _exact(*_fp4([0, -3, 5, -9]), 128)
    assert _exact(*_fp4([10, -4]), 128)  # spread 14: the smallest code 0.5 * 2^-4 lands on 2^-9 * block scale
    assert not _exact(*_fp4([10, -5]), 128)  # spread 15: 0.5 and 1.5 times 2^-5 fall off the E4M3 grid
    assert _exact(*_fp4([10, -5]), 32)  # in 32x32 blocks the two groups have their own scales
    w, s = _fp4([-20, 3])
    w[:, :16] = 0  # an all-zero group does not count towards the spread, whatever its scale
    assert _exact(w, s, 128)


def test_fp4_to_fp8_is_exact_on_random_expert_weights(tiny_model):
    g, params, _, _ = tiny_model("v41", False)
    names = [p.name for p in g.params if p.dtype == dt.f4e2m1x2][:12]
    for name in names:
        for block in (128, 32):
            assert _exact(params[name], params[name[: -len("weight")] + "scale"], block)


def test_convert_on_sm90_keeps_the_logits_and_records_the_conversion(tiny_model):
    g0, params, inputs, expected = tiny_model("v4", False)
    for target in (None, "cpu", "sm100"):  # no target, or a target with FP4 units / without FP8: no change
        opts = {} if target is None else {"target": target}
        g = run_pass(copy.deepcopy(g0), "convert_fp4_to_fp8", opts)
        assert "param_conversions" not in g.meta and {n.attrs["fmt"] for n in g.nodes if n.op == "moe_experts"} == {
            "fp4"
        }
    g = run_pass(copy.deepcopy(g0), "convert_fp4_to_fp8", {"target": "sm90"})
    assert not any(p.dtype == dt.f4e2m1x2 for p in g.params)
    assert {(n.attrs["fmt"], n.attrs["block"]) for n in g.nodes if n.op == "moe_experts"} == {("fp8", 128)}
    (conv,) = g.meta["param_conversions"]
    assert conv["fn"] == FN and conv["block"] == 128 and len(conv["params"]) == 4 * 8 * 3
    loaded = apply_param_conversions(g.meta, params)
    got = run(g, inputs, loaded, check=True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_quantize_activations_is_idempotent(tiny_model):
    g = tiny_model("v41", True)[0]
    again = run_pass(copy.deepcopy(g), "quantize_activations", {"enabled": True})
    assert again.op_counts() == g.op_counts()
