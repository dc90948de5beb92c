"""Per-rank plans run in 2 and 4 CPU processes (torch.distributed, gloo) give the single-process logits and caches.

Layouts: DP=2/EP=2, CP=2/EP=2 (zig-zag), EP=2, EP=4, EP=4 with EPLB redundant experts, CP=4/EP=4, and on the
fully fused graph (shared expert inside moe_grouped_experts) CP=2/EP=2 and DP=4/EP=4 with EPLB; tiny V4 config
(8 experts, every attention kind, hash and score routing).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))  # spawned children import the worker by this path (sys.path is passed)
import _mp_worker as worker  # noqa: E402

from deepinfer.ir.interpreter import run  # noqa: E402
from deepinfer.ir.ops.collectives import zigzag_take  # noqa: E402

TOL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item())


@pytest.fixture(scope="module")
def reference():
    g, params = worker.tiny()
    return g, params


@pytest.mark.parametrize("world", [2, 4])
def test_per_rank_plans_match_single_process(world, tmp_path, reference):
    g, params = reference
    mp.spawn(worker.main, args=(world, str(tmp_path)), nprocs=world, join=True)
    out_names = [v.name for v in g.outputs]
    for name, layout, split in worker.cases(world):
        results = [torch.load(tmp_path / f"{name}.{r}.pt") for r in range(world)]
        if split == "cp":
            full = worker.request(g, 4 * world, start=3, seed=0)
            ref = dict(zip(out_names, run(g, full, params)))
        for r, res in enumerate(results):
            outs = res["outputs"]
            assert list(outs) == out_names, name
            if split == "cp":
                want = {k: zigzag_take(v, r, world) if k == "logits" else v for k, v in ref.items()}
            else:
                want = dict(zip(out_names, run(g, worker.rank_inputs(g, split, r, world), params)))
            bad = [k for k in out_names if not _close(outs[k], want[k])]
            assert not bad, f"{name} rank {r}: outputs {bad[:3]} differ from the single-process graph"
        _check_sharding(name, layout, results, g)


def _check_sharding(name, layout, results, g):
    """Each rank loads only its experts; over the ranks every expert is held at least once."""
    experts = [
        {p.split(".experts.")[1].split(".")[0] for p in res["params"] if ".experts." in p and "layers.3." in p}
        for res in results
    ]
    n_slots = (8 + (layout["eplb"]["n_redundant"] if "eplb" in layout else 0)) // layout["world"]
    assert all(len(e) <= n_slots for e in experts), name
    assert set().union(*experts) == {str(i) for i in range(8)}, name
    ops = results[0]["ops"]
    assert "moe_experts" not in ops and "moe_grouped_experts" not in ops and ops["moe_experts_local"] == 4, name
    assert ("cp_gather" in ops) == (layout.get("cp", 1) > 1), name
