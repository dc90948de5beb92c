"""The per-rank side of the multi-process layout tests (a plain module so that spawned processes can import it).

Each case: (name, layout, how inputs split). A worker joins the gloo group, builds the tiny V4 graph, runs the
default pipeline, shards it for its rank, runs it through the interpreter and saves its outputs for the parent.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

T_REQ = 6  # tokens per request (DP and replicated cases); CP cases split 4*world tokens
SKEW = [40, 20, 10, 5, 3, 2, 1, 1]  # tokens per expert: a skewed histogram for the EPLB cases


def cases(world: int) -> list[tuple[str, dict, str]]:
    eplb = {"n_redundant": world, "load": {"*": SKEW}}
    if world == 2:
        return [
            ("dp2_ep2", {"world": 2, "dp": 2, "ep": 2}, "dp"),
            ("cp2_ep2", {"world": 2, "cp": 2, "ep": 2}, "cp"),
            ("ep2", {"world": 2, "ep": 2}, "same"),
            ("cp2_ep2_fused", {"world": 2, "cp": 2, "ep": 2}, "cp"),
        ]
    return [
        ("ep4", {"world": 4, "ep": 4}, "same"),
        ("ep4_eplb", {"world": 4, "ep": 4, "eplb": eplb}, "same"),
        ("cp4_ep4", {"world": 4, "cp": 4, "ep": 4}, "cp"),
        ("dp4_ep4_eplb_fused", {"world": 4, "dp": 4, "ep": 4, "eplb": eplb}, "dp"),
    ]


# Every fusion of phase 2 (with the shared expert inside moe_grouped_experts), for the "_fused" cases.
FUSED = [
    "fuse_rmsnorm_quant",
    "fuse_swiglu",
    "fuse_moe_gate",
    "fuse_moe_experts",
    "fuse_attention",
    "fuse_hyper_connection",
    "fuse_out_proj",
    "dce",
]


def tiny():
    from deepinfer.models import deepseek_v4 as m4
    from deepinfer.models.checkpoint import random_weights

    cfg = m4.parse_config(m4.TINY_CONFIGS["tiny"])
    g = m4.build_graph(cfg)
    return g, random_weights(g.params, seed=1, block=cfg.fp8_block)


def request(g, t: int, start: int, seed: int) -> dict[str, torch.Tensor]:
    """One request's inputs: tokens, positions start.., random (non-zero) cache states."""
    gen = torch.Generator().manual_seed(seed)
    out = {"tokens": torch.randint(0, 500, (t,), generator=gen), "positions": torch.arange(start, start + t)}
    for e in g.meta["caches"]:
        shape = [4 if s.startswith("C") else int(s) for s in e["shape"]]
        out[e["name"]] = torch.randn(shape, generator=gen) * 0.1
    return out


def rank_inputs(g, split: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    from deepinfer.ir.ops.collectives import zigzag_take

    if split == "dp":
        return request(g, T_REQ, start=2 + rank, seed=10 + rank)
    if split == "same":
        return request(g, T_REQ, start=3, seed=0)
    full = request(g, 4 * world, start=3, seed=0)
    for k in ("tokens", "positions"):
        full[k] = zigzag_take(full[k], rank, world)
    return full


def main(rank: int, world: int, out_dir: str) -> None:
    from deepinfer.ir.interpreter import run
    from deepinfer.passes.parallel_layout import shard_for_rank
    from deepinfer.passes.pattern import clone_graph
    from deepinfer.passes.pipeline import Pipeline, run_pipeline

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    torch.set_num_threads(1)
    g, params = tiny()
    opt, _ = run_pipeline(g)
    fused, _ = run_pipeline(g, Pipeline.default().with_phase("fuse", FUSED))
    for name, layout, split in cases(world):
        rg = shard_for_rank(clone_graph(fused if name.endswith("_fused") else opt), rank, layout)
        outs = run(rg, rank_inputs(g, split, rank, world), params, check=True)
        names = [v.name for v in rg.outputs]
        torch.save(
            {"outputs": dict(zip(names, outs)), "params": sorted(p.name for p in rg.params), "ops": rg.op_counts()},
            os.path.join(out_dir, f"{name}.{rank}.pt"),
        )
    dist.barrier()
    dist.destroy_process_group()
