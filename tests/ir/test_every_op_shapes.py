"""Symbolic shape inference through every registered op, checked by execution.

Every op is run by the interpreter with ``check=True`` at two token counts, so each tensor it produces must
have the shape and dtype that symbolic inference predicted. Core and quant ops are covered one by one in
test_ops_shapes.py; model-level and fused ops are covered here by running whole graphs that use them: the
tiny V4 and V4.1 backbones (checkpoint and float weights, QAT and compact modes), the V4 MTP block, the V4.1
DSpark draft graph, and the graphs after the default pass pipeline. The last test fails if a registered op is
covered by neither file, so a new op cannot arrive without a shape check.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from deepinfer.ir import interpreter
from deepinfer.ir.registry import all_ops
from deepinfer.models import deepseek_v4, deepseek_v41
from deepinfer.models.checkpoint import random_weights
from deepinfer.passes.pipeline import run_pipeline
from deepinfer.runtime.session import allocate_caches

_here = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("test_ops_shapes", _here / "test_ops_shapes.py")
_core_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_core_cases)

def _v41_tiny():
    spec = importlib.util.spec_from_file_location("v41_ref", _here.parent / "oracles" / "deepseek_v41_ref.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    return ref.tiny_config()


def _run_backbone(g, T: int, vocab: int):
    params = random_weights(g.params, seed=1)
    feeds = {"tokens": torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(T)),
             "positions": torch.arange(T), **allocate_caches(g, max_len=32)}
    interpreter.run(g, feeds, params, check=True)


def _graphs():
    v4 = deepseek_v4.parse_config(deepseek_v4.TINY_CONFIGS["tiny"])
    v41 = _v41_tiny()
    yield "v4 checkpoint", deepseek_v4.build_graph(v4), v4.vocab_size
    yield "v4 float", deepseek_v4.build_graph(v4, weights="float"), v4.vocab_size
    yield "v41 checkpoint", deepseek_v41.build_graph(v41), v41["vocab_size"]
    yield "v41 qat", deepseek_v41.build_graph(v41, weights="float", qat=True), v41["vocab_size"]
    compact = deepseek_v41.build_graph(v41, weights="float", mode="compact", keep_tokens=14)
    yield "v41 compact", compact, v41["vocab_size"]


GRAPHS = list(_graphs())


@pytest.mark.parametrize("T", [3, 11])
@pytest.mark.parametrize("case", range(len(GRAPHS)), ids=[name for name, _, _ in GRAPHS])
def test_backbone_shapes_match_execution(case, T):
    _, g, vocab = GRAPHS[case]
    _run_backbone(g, T, vocab)


@pytest.mark.parametrize("case", range(len(GRAPHS)), ids=[name for name, _, _ in GRAPHS])
def test_optimised_graph_shapes_match_execution(case):
    _, g, vocab = GRAPHS[case]
    optimised, _ = run_pipeline(g)
    _run_backbone(optimised, 5, vocab)


def _expert_and_context_parallel_world_one():
    """The V4 graph rewritten by the parallel passes at world size 1: same numbers, new ops."""
    from deepinfer.passes.context_parallel import context_parallel
    from deepinfer.passes.expert_parallel import expert_parallel
    from deepinfer.passes.pattern import clone_graph

    _, g, vocab = GRAPHS[0]
    opt = run_pipeline(g)[0]
    return expert_parallel(context_parallel(clone_graph(opt), world=1, rank=0), world=1, rank=0, tokens="distinct")


def test_parallel_rewrite_shapes_match_execution():
    _run_backbone(_expert_and_context_parallel_world_one(), 6, GRAPHS[0][2])


def test_mtp_block_shapes_match_execution():
    cfg = deepseek_v4.parse_config(deepseek_v4.TINY_CONFIGS["tiny"])
    g = deepseek_v4.build_mtp_graph(cfg)
    T = 4
    feeds = {"hidden": torch.randn(T, cfg.hc_mult, cfg.hidden_size), "tokens": torch.randint(0, cfg.vocab_size, (T,)),
             "positions": torch.arange(T), **allocate_caches(g, max_len=16)}
    interpreter.run(g, feeds, random_weights(g.params, seed=2), check=True)


def test_dspark_graph_shapes_match_execution():
    cfg = _v41_tiny()
    c = deepseek_v41.parse_config(cfg)
    g = deepseek_v41.build_dspark_graph(cfg, weights="float")
    tc = 6
    feeds = {f"hidden.{layer}": torch.randn(tc, c.hc_mult, c.hidden_size) for layer in c.dspark_targets}
    feeds |= {"ctx_positions": torch.arange(tc), "anchor": torch.tensor([7]),
              "positions": torch.arange(tc, tc + c.dspark_block_size)}
    interpreter.run(g, feeds, random_weights(g.params, seed=3), check=True)


def test_every_registered_op_is_shape_checked_somewhere():
    # the graphs the tests above execute with check=True, and the single-op cases of test_ops_shapes.py
    v4 = deepseek_v4.parse_config(deepseek_v4.TINY_CONFIGS["tiny"])
    executed = [g for _, g, _ in GRAPHS] + [run_pipeline(g)[0] for _, g, _ in GRAPHS]
    executed += [deepseek_v4.build_mtp_graph(v4), deepseek_v41.build_dspark_graph(_v41_tiny(), weights="float")]
    executed.append(_expert_and_context_parallel_world_one())
    covered = {op for g in executed for op in g.op_counts()} | set(_core_cases.CASES)
    # ops registered by other test files (custom ops of the serialization tests) are not deepinfer's
    ours = {name for name, d in all_ops().items() if d.reference_fn.__module__.startswith("deepinfer.")}
    missing = sorted(ours - covered - DEDICATED)
    assert missing == [], f"ops with no symbolic-shape execution check: {missing}"


# Ops whose shape inference is checked by execution in their own test files (named here).
DEDICATED = {
    "rmsnorm_quant_fp8",  # tests/passes/test_fusions.py (fires only with explicit activation quant)
    "constant",  # tests/passes/test_phase0.py (fold_constants)
    # tests/passes/test_batch_decode.py (the batch_decode pass's graphs, run with check=True)
    "batched_window_indices", "batched_ring_slots", "batched_rows", "batched_compressor",
    "batched_pair_compressor_keys", "batched_index_scores", "batched_indexer_topk", "batched_compressed_indices",
    "batched_engram_hash", "batched_engram_history", "batched_gather_rows",
}
