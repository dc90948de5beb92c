"""Issue 5's done-when for phases 0-2: for tiny V4 and V4.1 the fully optimised graph gives the unoptimised
graph's logits and cache states, within 1e-5 in fp32 with activation quantisation off, and equal to the
quantised reference with it on (the unoptimised graph with its activation quantisation made explicit vs the
optimised one). The sm90 FP4 -> FP8 conversion is exact on these weights, so it keeps the numbers too."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ir.interpreter import run
from deepinfer.passes.convert_fp4_to_fp8 import apply_param_conversions
from deepinfer.passes.pipeline import Pipeline, run_pipeline

TOL = 1e-5

# ops every instance of which a phase-2 fusion consumes on these models (the mHC ops stay where a sublayer
# boundary has no partner: the first pre reads the embedding, the last post feeds the head)
FUSED_AWAY = ("sparse_attention", "moe_experts", "moe_route", "swiglu", "swiglu_gate_up", "grouped_linear")


def _pipeline(quantised: bool, target: str | None = None) -> Pipeline:
    quantize = [("quantize_activations", {"enabled": quantised}), ("convert_fp4_to_fp8", {"target": target})]
    return Pipeline.default().with_phase("quantize", quantize)


def _close(got, want, exact: bool):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        if exact:
            assert torch.equal(a, b)
        else:
            assert (a.float() - b.float()).abs().max().item() <= TOL * max(1.0, b.float().abs().max().item())


@pytest.mark.parametrize("model", ["v4", "v41"])
@pytest.mark.parametrize("quantised", [False, True], ids=["exact", "quantised"])
def test_optimised_graph_gives_the_unoptimised_logits(tiny_model, model, quantised):
    g0, params, inputs, expected = tiny_model(model, quantised)
    opt, report = run_pipeline(g0, _pipeline(quantised))
    counts = opt.op_counts()
    assert not any(op in counts for op in FUSED_AWAY), counts
    assert counts["fused_attention"] > 0 and counts["moe_grouped_experts"] > 0
    assert counts.get("hc_pre", 0) + counts.get("hc_stats", 0) == 1  # layer 0's attention pre
    assert ("rmsnorm_quant_fp8" in counts) == quantised
    assert len(opt.nodes) < len(g0.nodes) * 0.75
    _close(run(opt, inputs, params, check=True), expected, exact=quantised)


def test_sm90_pipeline_converts_the_experts_and_keeps_the_logits(tiny_model):
    g0, params, inputs, expected = tiny_model("v4", True)
    opt, _ = run_pipeline(g0, _pipeline(True, target="sm90"))
    assert {n.attrs["fmt"] for n in opt.nodes if n.op == "moe_grouped_experts"} == {"fp8"}
    _close(run(opt, inputs, apply_param_conversions(opt.meta, params), check=True), expected, exact=True)


def _graph_inputs(g, seed: int = 0) -> dict:
    """Inputs for any of the models' graphs: 16 tokens/rows per symbolic length, 64 compressed-cache rows."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for v in g.inputs:
        shape = [d if isinstance(d, int) else 64 if str(d).startswith("C") else 16 for d in v.shape]
        if v.name in ("positions", "ctx_positions"):
            out[v.name] = torch.arange(3, 3 + shape[0])
        elif v.name in ("tokens", "anchor"):
            out[v.name] = torch.randint(0, 100, shape, generator=gen)
        elif not v.dtype.is_float:
            out[v.name] = torch.full(shape, -1, dtype=torch.int64)
        else:
            out[v.name] = torch.randn(shape, generator=gen) * 0.1
    return out


@pytest.mark.parametrize("which", ["v4-mtp", "v41-dspark", "v41-qat"])
def test_the_other_graphs_keep_their_numbers_too(which):
    from deepinfer.models import deepseek_v4, deepseek_v41
    from deepinfer.models.checkpoint import random_weights
    from deepinfer.models.presets import preset_config

    if which == "v4-mtp":
        cfg = deepseek_v4.parse_config(deepseek_v4.TINY_CONFIGS["tiny"])
        g = deepseek_v4.build_mtp_graph(cfg)
    else:
        cfg = deepseek_v41.parse_config(preset_config("deepseek-v4.1-flash", "tiny"))
        g = deepseek_v41.build_dspark_graph(cfg) if which == "v41-dspark" else deepseek_v41.build_graph(cfg, qat=True)
    params, inputs = random_weights(g.params, seed=1, block=cfg.fp8_block), _graph_inputs(g)
    opt, _ = run_pipeline(g, _pipeline(False))
    assert opt.op_counts()["fused_attention"] >= 1 and len(opt.nodes) < len(g.nodes)
    _close(run(opt, inputs, params, check=True), run(g, inputs, params, check=True), exact=False)


def test_the_fused_v41_graph_prints_and_parses_back(tiny_model):
    from deepinfer.ir.parser import parse_graph
    from deepinfer.ir.printer import print_graph
    from deepinfer.ir.verifier import verify

    opt, _ = run_pipeline(tiny_model("v41", True)[0], _pipeline(True, target="sm90"))
    text = print_graph(opt)
    parsed = parse_graph(text)
    verify(parsed)
    assert print_graph(parsed) == text and "param_conversions" in parsed.meta
