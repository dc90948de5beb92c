"""``deepinfer compile``: model config -> graph -> pass pipeline -> plan.

Today a plan carries the optimised graph for the ``cpu`` target, whose kernels are the ops' torch references.
GPU targets need the kernel binding of phase 4 (issue 6) and are refused with a one-line error until then.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from deepinfer.errors import NotBuiltError
from deepinfer.runtime.plan import Plan

SUPPORTED_TARGETS = ("cpu",)


@dataclass
class CompileResult:
    plan: Plan
    build_s: float
    passes_s: float
    nodes_before: int


def compile_model(
    model: str | None,
    target: str = "cpu",
    *,
    seed: int = 0,
    dump_ir: str | os.PathLike | None = None,
    pipeline: dict | None = None,
) -> CompileResult:
    """Build the model's graph and run the pass pipeline over it."""
    from deepinfer.models import get_model
    from deepinfer.models.checkpoint import resolve_model
    from deepinfer.passes.pipeline import Pipeline, run_pipeline

    if target not in SUPPORTED_TARGETS:
        raise NotBuiltError(f"compiling for target {target!r} needs kernel binding (issue 6); only 'cpu' works today")
    t0 = time.perf_counter()
    name, config, ckpt = resolve_model(model)
    mod = get_model(name)
    graph = mod.build_graph(mod.parse_config(config))
    build_s = time.perf_counter() - t0
    pipe = Pipeline.from_config(pipeline) if pipeline else Pipeline.default()
    t1 = time.perf_counter()
    optimised, report = run_pipeline(graph, pipe, dump_ir=dump_ir)
    passes_s = time.perf_counter() - t1
    weights = {"checkpoint": str(ckpt)} if ckpt is not None else {"random_seed": seed}
    plan = Plan(name, config, target, optimised, weights, pipe.to_config(), report.format())
    return CompileResult(plan, build_s, passes_s, len(graph.nodes))
