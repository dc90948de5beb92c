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
from dataclasses import dataclass, field

from deepinfer.errors import NotBuiltError
from deepinfer.runtime.plan import Plan

SUPPORTED_TARGETS = ("cpu", "sm90", "sm100", "ascend950")


def default_pipeline(target: str, moe_format: str = "g32"):
    """The default pipeline; for a GPU target with its quantisation and kernel binding switched on. moe_format: how
    sm90 turns the FP4 experts into FP8 (passes/convert_fp4_to_fp8.py MOE_FORMATS: g32 | w128 | g128)."""
    from deepinfer.passes.pipeline import Pipeline

    check_moe_format(target, moe_format)
    pipe = Pipeline.default()
    if target == "cpu":
        return pipe
    from deepinfer.passes.convert_fp4_to_fp8 import MOE_FORMATS

    convert = {"target": target, **MOE_FORMATS[moe_format]}
    quantize = [("quantize_activations", {"enabled": True}), ("convert_fp4_to_fp8", convert)]
    # after the fusions (which match the Q/DQ form): the pairs left fold into their readers (passes/fold_qdq.py)
    fuse = [*pipe.phases["fuse"], ("fold_qdq", {})]
    select = [("select_kernels", {"target": target}), "cache_storage", "check_batch_invariance"]
    return pipe.with_phase("quantize", quantize).with_phase("fuse", fuse).with_phase("select_kernels", select)


def check_moe_format(target: str, moe_format: str) -> None:
    """A --moe-format other than g32 changes the FP4 -> FP8 conversion, which only sm90 does (FP8 MMA, no FP4)."""
    from deepinfer.errors import ConfigError
    from deepinfer.passes.convert_fp4_to_fp8 import MOE_FORMATS

    if moe_format not in MOE_FORMATS:
        raise ConfigError(f"--moe-format {moe_format!r}: not one of {', '.join(MOE_FORMATS)}")
    if moe_format != "g32" and target != "sm90":
        raise ConfigError(f"--moe-format {moe_format} applies to sm90 (FP4 experts converted to FP8); target {target} "
                          "does not convert them")  # fmt: skip


@dataclass
class CompileResult:
    plan: Plan
    build_s: float
    passes_s: float
    nodes_before: int
    kernels_s: float = 0.0
    kernels_summary: str = ""
    slowest_passes: list = field(default_factory=list)  # [(pass, seconds)], the SLOWEST_PASSES costliest first
    n_passes: int = 0


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
    moe_format: str = "g32",
    max_model_len: int | None = None,
) -> CompileResult:
    """Build the model's graph, run the pass pipeline over it and (GPU/NPU targets) build its kernels.

    kernels: none | bound | all (codegen/plan_kernels.py); jobs: build processes (default: all cores);
    kernels_dir: where to stage the artifacts (default: a fresh temporary directory; write_plan copies it);
    moe_format: default_pipeline's (sm90 only; with an explicit pipeline, put the convert pass's options there);
    max_model_len: the engine's the sm90 kernels are derived for (its caches' sizes fix some kernels' shapes;
    default: the engine's default, runtime/engine.default_max_model_len), recorded in the kernels' manifest, which
    the engine then takes as its default."""
    from deepinfer.models import get_model
    from deepinfer.models.checkpoint import resolve_model
    from deepinfer.passes.pipeline import Pipeline, run_pipeline

    if target not in SUPPORTED_TARGETS:
        supported = ", ".join(SUPPORTED_TARGETS)
        raise NotBuiltError(f"compiling for target {target!r} is not built yet; supported: {supported}")
    check_moe_format(target, moe_format)
    if pipeline and moe_format != "g32":
        from deepinfer.errors import ConfigError

        raise ConfigError(f"--moe-format {moe_format} with an explicit pipeline config: set the convert_fp4_to_fp8 "
                          "options in the pipeline instead")  # fmt: skip
    t0 = time.perf_counter()
    name, config, ckpt = resolve_model(model)
    mod = get_model(name)
    graph = mod.build_graph(mod.parse_config(config))
    build_s = time.perf_counter() - t0
    pipe = Pipeline.from_config(pipeline) if pipeline else default_pipeline(target, moe_format)
    t1 = time.perf_counter()
    optimised, report = run_pipeline(graph, pipe, dump_ir=dump_ir)
    passes_s = time.perf_counter() - t1
    weights = {"checkpoint": str(ckpt)} if ckpt is not None else {"random_seed": seed}
    plan = Plan(name, config, target, optimised, weights, pipe.to_config(), _report_text(report, optimised))
    res = CompileResult(plan, build_s, passes_s, len(graph.nodes), slowest_passes=_slowest(report),
                        n_passes=len(report.records))  # fmt: skip
    if target != "cpu" and kernels != "none":
        _build_kernels(res, kernels, jobs, kernels_dir, max_model_len)
    return res


def _report_text(report, optimised) -> str:
    """The pass table, and where passes/cache_storage chose the caches' dtypes, its per-cache decisions."""
    text = report.format()
    if "cache_storage" in optimised.meta:
        from deepinfer.passes.cache_storage import format_cache_storage

        text += "\n" + format_cache_storage(optimised)
    return text


SLOWEST_PASSES = 3  # the compile summary names these many of the slowest passes (a warm compile is mostly passes)


def _slowest(report) -> list[tuple[str, float]]:
    return [(r.name, r.seconds) for r in sorted(report.records, key=lambda r: -r.seconds)[:SLOWEST_PASSES]]


def _build_kernels(res: CompileResult, mode: str, jobs: int | None, kernels_dir, max_model_len: int | None) -> None:
    import tempfile

    from deepinfer.codegen.plan_kernels import build_kernels, format_manifest, kernel_specs
    from deepinfer.runtime.engine import default_max_model_len

    t0 = time.perf_counter()
    plan = res.plan
    mml = max_model_len or default_max_model_len(plan.config)
    specs, skipped = kernel_specs(plan.graph, plan.target, mode, max_model_len=mml)
    out = kernels_dir if kernels_dir is not None else tempfile.mkdtemp(prefix="deepinfer-kernels-")
    plan.kernels = build_kernels(specs, plan.target, out, jobs=jobs, mode=mode, skipped=skipped,
                                 max_model_len=mml if plan.target == "sm90" else None)  # fmt: skip
    plan.kernels_dir = str(out)
    res.kernels_s = time.perf_counter() - t0
    res.kernels_summary = format_manifest(plan.kernels)
