"""Phase 3 in one process: layouts and rank tables, collectives at world size 1, the CP/EP rewrites at world 1
(exact), and shapes of the per-rank graphs for DP=2/EP=2, EP=4 and CP=2."""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import ConfigError, IRError
from deepinfer.ir.interpreter import run
from deepinfer.ir.ops.collectives import zigzag_merge, zigzag_take
from deepinfer.ir.registry import get_op
from deepinfer.ir.verifier import verify
from deepinfer.models import deepseek_v4 as m4
from deepinfer.models.checkpoint import random_weights
from deepinfer.passes.context_parallel import context_parallel
from deepinfer.passes.expert_parallel import expert_parallel
from deepinfer.passes.parallel_layout import Layout, layout_pipeline, rank_table, shard_for_rank
from deepinfer.passes.pattern import clone_graph
from deepinfer.passes.pipeline import run_pipeline


@pytest.fixture(scope="module")
def tiny():
    cfg = m4.parse_config(m4.TINY_CONFIGS["tiny"])
    g = m4.build_graph(cfg)
    opt, _ = run_pipeline(g)
    return g, opt, random_weights(g.params, seed=1, block=cfg.fp8_block)


def _inputs(g, t, start=3):
    gen = torch.Generator().manual_seed(0)
    out = {"tokens": torch.randint(0, 500, (t,), generator=gen), "positions": torch.arange(start, start + t)}
    for e in g.meta["caches"]:
        out[e["name"]] = torch.randn([4 if s.startswith("C") else int(s) for s in e["shape"]], generator=gen) * 0.1
    return out


def test_rank_tables():
    assert [r["dp_slot"] for r in rank_table({"world": 2, "dp": 2, "ep": 2})] == [0, 1]
    assert [r["cp_chunks"] for r in rank_table({"world": 2, "cp": 2, "ep": 2})] == [[0, 3], [1, 2]]
    ep4 = rank_table({"world": 4, "ep": 4})
    assert [r["ep_rank"] for r in ep4] == [0, 1, 2, 3] and {r["dp_slot"] for r in ep4} == {0}
    assert Layout.parse({"world": 4, "ep": 4}).tokens == "replicated"
    assert Layout.parse({"world": 4, "dp": 4, "ep": 4}).tokens == "distinct"


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"world": 4, "ep": 2}, "ep must be 1 or"),
        ({"world": 4, "dp": 2, "ep": 4}, "dp\\*cp must be"),
        ({"world": 4, "dp": 2, "cp": 2, "ep": 4}, "CP sub-groups"),
        ({"world": 2, "tp": 2}, "unknown key 'tp'"),
        ({"world": 0}, "world must be a positive"),
    ],
)
def test_bad_layouts(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        Layout.parse(bad)


def test_collectives_single_process():
    x = torch.arange(12.0).reshape(6, 2)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "cp_gather"):
        opdef = get_op(op)
        assert torch.equal(opdef.run([x], opdef.bind_attrs({"world": 1}))[0], x), op
    with pytest.raises(IRError, match="needs torch.distributed"):
        get_op("all_reduce").run([x], {"world": 2, "reduce": "sum"})
    full = torch.arange(16)
    parts = [zigzag_take(full, r, 4) for r in range(4)]
    assert parts[0].tolist() == [0, 1, 14, 15] and torch.equal(zigzag_merge(parts), full)


def test_world_one_rewrites_are_exact(tiny):
    g, opt, params = tiny
    g1 = expert_parallel(context_parallel(clone_graph(opt), world=1, rank=0), world=1, rank=0, tokens="distinct")
    verify(g1)
    inputs = _inputs(g, 6)
    for a, b in zip(run(opt, inputs, params), run(g1, inputs, params, check=True)):
        assert torch.equal(a, b)


def test_per_rank_graphs(tiny):
    _, opt, _ = tiny
    dp = shard_for_rank(clone_graph(opt), 1, {"world": 2, "dp": 2, "ep": 2})
    ops = dp.op_counts()
    assert ops["all_gather"] == 3 * 4 and ops["reduce_scatter"] == 4 and "cp_gather" not in ops
    assert dp.meta["parallel"]["role"]["dp_slot"] == 1
    experts = {
        p.name.split(".experts.")[1].split(".")[0] for p in dp.params if p.name.startswith("layers.0.ffn.experts")
    }
    assert experts == {"4", "5", "6", "7"}
    ep = shard_for_rank(clone_graph(opt), 3, {"world": 4, "ep": 4})
    assert ep.op_counts()["all_reduce"] == 4 and "all_gather" not in ep.op_counts()
    cp = shard_for_rank(clone_graph(opt), 0, {"world": 2, "cp": 2, "ep": 2})
    assert cp.op_counts()["cp_gather"] >= 1 + 4  # positions and each layer's kv rows
    assert [v.name for v in cp.outputs] == [v.name for v in opt.outputs]
    assert cp.outputs[0].shape == opt.outputs[0].shape  # logits [T, vocab]: this rank's T rows


def test_layout_pipeline_runs_phase_3(tiny):
    g, _, _ = tiny
    out, report = run_pipeline(g, layout_pipeline({"world": 4, "ep": 4}, 2))
    assert report.by_name("parallel_layout")[0].added["moe_experts_local"] == 4
    assert out.meta["parallel"]["role"]["ep_rank"] == 2 and "memory" in out.meta
