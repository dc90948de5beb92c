"""Shared fixtures for the pass tests: the tiny V4 / V4.1 graphs with weights, inputs and unoptimised outputs,
built once per session (the interpreter run of the tiny V4.1 graph is the expensive part)."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from deepinfer.ir.interpreter import run
from deepinfer.models import deepseek_v4, deepseek_v41
from deepinfer.models.checkpoint import random_weights
from deepinfer.models.presets import preset_config
from deepinfer.passes.pipeline import run_pass

# The tiny graphs' tensors are a few KB: intra-op threads only add overhead (and stall on a loaded 2-core box).
torch.set_num_threads(1)

MODELS = {
    "v4": (deepseek_v4, lambda: deepseek_v4.TINY_CONFIGS["tiny"]),
    "v41": (deepseek_v41, lambda: preset_config("deepseek-v4.1-flash", "tiny")),
}


def model_inputs(g, t: int = 5, start: int = 3, seed: int = 0) -> dict:
    """tokens, positions and random cache states (compressed caches with 16 rows, Engram history at init)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = {"tokens": torch.randint(0, 500, (t,), generator=gen), "positions": torch.arange(start, start + t)}
    for e in g.meta["caches"]:
        shape = [16 if s.startswith("C") else int(s) for s in e["shape"]]
        if e["dtype"] == "f32":
            inputs[e["name"]] = torch.randn(shape, generator=gen) * 0.1
        else:
            inputs[e["name"]] = torch.full(shape, e.get("init", 0), dtype=torch.int64)
    return inputs


@cache
def _tiny(model: str, quantised: bool):
    mod, config = MODELS[model]
    cfg = mod.parse_config(config())
    g = run_pass(mod.build_graph(cfg), "quantize_activations", {"enabled": quantised})
    params = random_weights(g.params, seed=1, block=cfg.fp8_block)
    inputs = model_inputs(g)
    return g, params, inputs, run(g, inputs, params, check=True)


@pytest.fixture(scope="session")
def tiny_model():
    """``tiny_model(model, quantised) -> (graph, params, inputs, outputs)`` for model "v4" or "v41": the
    unoptimised graph (activation quantisation explicit when ``quantised``) and its interpreter outputs.
    Treat the results as read-only (copy the graph before running passes)."""
    return _tiny
