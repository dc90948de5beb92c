"""The phase-0 + fusion pipeline on the tiny V4 graph: same logits and cache states as the unoptimised graph
through the interpreter (fp32 activations), the passes fire, every dump is written and parses back."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ir.interpreter import run
from deepinfer.ir.parser import parse_graph
from deepinfer.ir.verifier import verify
from deepinfer.models.checkpoint import random_weights
from deepinfer.models.deepseek_v4 import build_graph, parse_config
from deepinfer.models.presets import preset_config
from deepinfer.passes.pipeline import Pipeline, run_pipeline
from deepinfer.passes.specialize_shapes import bucket_graphs

TOL = 1e-5


def _tiny(weights: str):
    cfg = parse_config(preset_config("deepseek-v4-flash", "tiny"))
    g = build_graph(cfg, weights=weights)
    return cfg, g, random_weights(g.params, seed=1, block=cfg.fp8_block)


def _inputs(g, t: int, start: int = 0, seed: int = 0):
    """tokens, positions and random (non-zero, so reads matter) cache states for a batch of t tokens."""
    gen = torch.Generator().manual_seed(seed)
    inputs = {"tokens": torch.randint(0, 1000, (t,), generator=gen), "positions": torch.arange(start, start + t)}
    for e in g.meta["caches"]:
        shape = [4 if s.startswith("C") else int(s) for s in e["shape"]]
        inputs[e["name"]] = torch.randn(shape, generator=gen) * 0.1
    return inputs


def _assert_same(outs_a, outs_b):
    assert len(outs_a) == len(outs_b)
    for a, b in zip(outs_a, outs_b):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert (a.float() - b.float()).abs().max().item() <= TOL * max(1.0, a.float().abs().max().item())


@pytest.mark.parametrize("weights", ["checkpoint", "float"])
def test_pipeline_keeps_logits_and_fires(weights, tmp_path):
    cfg, g, params = _tiny(weights)
    before = len(g.nodes)
    opt, report = run_pipeline(g, dump_ir=tmp_path)
    assert len(g.nodes) == before  # the input graph is untouched
    counts = opt.op_counts()
    n_moe = counts["moe_gate_route"]
    assert n_moe == cfg.num_layers and "moe_route" not in counts
    # fuse_swiglu made one swiglu_gate_up per layer; fuse_moe_experts then took each into its MoE op
    assert report.by_name("fuse_swiglu")[0].added == {"swiglu_gate_up": cfg.num_layers} and "swiglu" not in counts
    assert counts["moe_grouped_experts"] == cfg.num_layers and "swiglu_gate_up" not in counts
    assert counts["window_indices"] == 1 and counts["ring_slots"] == 1  # cse: one per graph, not per layer
    assert report.by_name("fuse_swiglu")[0].nodes_after == report.by_name("fuse_swiglu")[0].nodes_before - 2 * n_moe
    inputs = _inputs(g, t=5, start=3)
    _assert_same(run(g, inputs, params, check=True), run(opt, inputs, params, check=True))


def test_dumps_are_numbered_readable_and_verify(tmp_path, monkeypatch):
    _, g, _ = _tiny("checkpoint")
    monkeypatch.setenv("DEEPINFER_DUMP_IR", str(tmp_path))
    _, report = run_pipeline(g)
    files = sorted(p.name for p in tmp_path.glob("*.dil"))
    assert files[0] == "00-input-graph.dil" and len(files) == len(report.records) + 1
    assert files[1] == "01-canonicalize-dce.dil"
    for r in report.records:
        path = tmp_path / f"{r.index:02d}-{r.phase}-{r.name}.dil"
        text = path.read_text()
        assert text.startswith(f"# pass {r.index} {r.phase}/{r.name}: ")
        parsed = parse_graph(text, str(path))
        verify(parsed)
        assert len(parsed.nodes) == r.nodes_after
    assert "fuse_swiglu" in (tmp_path / "report.txt").read_text()


def test_prefill_and_decode_buckets_give_the_same_numbers():
    _, g, params = _tiny("checkpoint")
    opt, _ = run_pipeline(g)
    buckets = bucket_graphs(opt, {"prefill": {"T": 6}, "decode": {"T": 1}})
    for name, t in (("prefill", 6), ("decode", 1)):
        b = buckets[name]
        assert all(isinstance(d, int) for n in b.nodes for o in n.outputs for d in o.shape if "C" not in str(d))
        assert "T" not in b.symbols()
        inputs = _inputs(g, t=t, start=2, seed=t)
        _assert_same(run(g, inputs, params, check=True), run(b, inputs, params, check=True))


def test_specialise_in_the_pipeline_as_data():
    _, g, _ = _tiny("checkpoint")
    pipe = Pipeline.default().with_phase(0, ["dce", "cse", ("specialize_shapes", {"T": 4}), "fold_constants", "dce"])
    opt, report = run_pipeline(g, pipe)
    assert opt.meta["bucket"] == {"T": 4} and report.by_name("specialize_shapes")
