"""``deepinfer compile``: model config -> graph -> pass pipeline -> plan.

A plan carries the optimised graph. For ``cpu`` its kernels are the ops' torch references. For ``sm90`` the
pipeline quantises activations explicitly (the FP8 kernels take FP8 operands), converts FP4 experts to FP8
(Hopper has no FP4 MMA) and binds every node to a kernel family and tile config (select_kernels); the kernels
themselves also compile lazily, on the GPU, at the first run (runtime/cuda_executor.py).

With ``kernels="bound"`` (the CLI default; the API defaults to "none") or ``"all"``, compile for sm90/sm100
also builds the kernels the bindings need (TileLang -> CUDA -> cubin with the local nvcc; configs from the
tuning database when it has them, never tuning) and the plan carries them in ``kernels/`` with a manifest
(codegen/plan_kernels.py); for ascend950 the AscendC sources (no bisheng here). sm100 and ascend950 plans
have no runtime yet: compile only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from deepinfer.errors import NotBuiltError
from deepinfer.runtime.plan import Plan

SUPPORTED_TARGETS = ("cpu", "sm90", "sm100", "ascend950")


def default_pipeline(target: str):
    """The default pipeline; for a GPU target with its quantisation and kernel binding switched on."""
    from deepinfer.passes.pipeline import Pipeline

    pipe = Pipeline.default()
    if target == "cpu":
        return pipe
    quantize = [("quantize_activations", {"enabled": True}), ("convert_fp4_to_fp8", {"target": target})]
    # after the fusions (which match the Q/DQ form): the pairs left fold into their readers (passes/fold_qdq.py)
    fuse = [*pipe.phases["fuse"], ("fold_qdq", {})]
    select = [("select_kernels", {"target": target}), "check_batch_invariance"]
    return pipe.with_phase("quantize", quantize).with_phase("fuse", fuse).with_phase("select_kernels", select)


@dataclass
class CompileResult:
    plan: Plan
    build_s: float
    passes_s: float
    nodes_before: int
    kernels_s: float = 0.0
    kernels_summary: str = ""


def compile_model(
    model: str | None,
    target: str = "cpu",
    *,
    seed: int = 0,
    dump_ir: str | os.PathLike | None = None,
    pipeline: dict | None = None,
    kernels: str = "none",
    jobs: int | None = None,
    kernels_dir: str | os.PathLike | None = None,
) -> CompileResult:
    """Build the model's graph, run the pass pipeline over it and (GPU/NPU targets) build its kernels.

    kernels: none | bound | all (codegen/plan_kernels.py); jobs: build processes (default: all cores);
    kernels_dir: where to stage the artifacts (default: a fresh temporary directory; write_plan copies it)."""
    from deepinfer.models import get_model
    from deepinfer.models.checkpoint import resolve_model
    from deepinfer.passes.pipeline import Pipeline, run_pipeline

    if target not in SUPPORTED_TARGETS:
        supported = ", ".join(SUPPORTED_TARGETS)
        raise NotBuiltError(f"compiling for target {target!r} is not built yet; supported: {supported}")
    t0 = time.perf_counter()
    name, config, ckpt = resolve_model(model)
    mod = get_model(name)
    graph = mod.build_graph(mod.parse_config(config))
    build_s = time.perf_counter() - t0
    pipe = Pipeline.from_config(pipeline) if pipeline else default_pipeline(target)
    t1 = time.perf_counter()
    optimised, report = run_pipeline(graph, pipe, dump_ir=dump_ir)
    passes_s = time.perf_counter() - t1
    weights = {"checkpoint": str(ckpt)} if ckpt is not None else {"random_seed": seed}
    plan = Plan(name, config, target, optimised, weights, pipe.to_config(), report.format())
    res = CompileResult(plan, build_s, passes_s, len(graph.nodes))
    if target != "cpu" and kernels != "none":
        _build_kernels(res, kernels, jobs, kernels_dir)
    return res


def _build_kernels(res: CompileResult, mode: str, jobs: int | None, kernels_dir) -> None:
    import tempfile

    from deepinfer.codegen.plan_kernels import build_kernels, format_manifest, kernel_specs

    t0 = time.perf_counter()
    plan = res.plan
    specs, skipped = kernel_specs(plan.graph, plan.target, mode)
    out = kernels_dir if kernels_dir is not None else tempfile.mkdtemp(prefix="deepinfer-kernels-")
    plan.kernels = build_kernels(specs, plan.target, out, jobs=jobs, mode=mode, skipped=skipped)
    plan.kernels_dir = str(out)
    res.kernels_s = time.perf_counter() - t0
    res.kernels_summary = format_manifest(plan.kernels)
