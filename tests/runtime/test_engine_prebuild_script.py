"""benchmarks/engine_prebuild.py's accounting on the CPU: the engine (emulated kernels and CUDA graphs, the tiny V4.1
sm90 plan) with a stubbed prebuild; a key left out of the prebuilt list is reported LAZY, the others as pre-built,
and every request is counted finished. The H200 run of the script is the real prebuild (BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from unittest import mock

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def script():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("engine_prebuild_for_tests", BENCH / "engine_prebuild.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH))


def test_engine_run_counts_prebuilt_and_lazy_kernels(script, monkeypatch):
    from deepinfer.codegen.plan_kernels import kernel_specs
    from deepinfer.compiler import compile_model
    from deepinfer.runtime import cuda_graphs as cg
    from deepinfer.runtime import engine
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.cuda_executor import CudaRunner, KernelCache

    from .test_batched_decode import _stand_in

    monkeypatch.setattr(ka, "EMULATE", True)
    plan = compile_model("deepseek-v4.1-flash:tiny", "sm90", kernels="none").plan
    specs, skipped = kernel_specs(plan.graph, "sm90", "bound", max_model_len=64)
    asked = []

    def runner(plan_, params_, config, max_model_len):
        return CudaRunner(plan_.graph, params_, device="cpu", kernels=KernelCache(builder=_stand_in), verify=False,
                          max_model_len=max_model_len, graph_backend=cg.EmulatedGraphBackend())  # fmt: skip

    args = script.parse(["--max-model-len", "64", "--tokens", "2", "--jobs", "2"])
    def stub_prebuild(keys, jobs, timeout_s, log=print):
        asked.append(keys)
        return {}

    with (mock.patch.object(engine, "_runner", runner), mock.patch.object(engine, "_resolve_plan", lambda *a: a[2]),
          mock.patch.object(ka, "prebuild", stub_prebuild)):  # fmt: skip
        full = script.engine_run(plan, args, "all keys", specs, skipped)
        assert asked == [[s.key for s in specs]]  # the engine's prebuild asked for exactly the derived keys
        missing = full["used"][0]
        short = script.engine_run(plan, args, "one used key left out", [s for s in specs if s.key != missing], skipped)
    assert full["lazy"] == {} and full["loaded"] == len(full["used"]) > 0 and not full["errors"]
    assert full["finished"] == full["requests"] == len(script.PROMPTS)
    assert set(short["lazy"]) == {missing} and short["loaded"] == full["loaded"] - 1
