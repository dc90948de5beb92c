"""`deepinfer compile --max-model-len N` derives the sm90 kernels for an engine of max_model_len N and records it in
the kernels' manifest; the engine takes it as its default; an engine with `prebuild_jobs` builds exactly the keys
the compiler derives for its max_model_len before the first request. No GPU: the kernel builds are stubbed (the
builds themselves: tests/codegen/test_plan_kernels.py)."""

from __future__ import annotations

import pytest

from deepinfer.cli import main
from deepinfer.codegen import plan_kernels as pk
from deepinfer.runtime import engine
from deepinfer.runtime import kernel_adapters as ka


@pytest.fixture
def stub_builds(monkeypatch):
    """build_kernels records what it was given and builds nothing (the real one on no specs: its manifest);
    returns the list of its calls' keywords."""
    calls = []
    real = pk.build_kernels

    def fake_build(specs, target, out_dir, **kw):
        calls.append({"specs": specs, **kw})
        return real([], target, out_dir, **kw)

    monkeypatch.setattr(pk, "build_kernels", fake_build)
    return calls


@pytest.fixture(scope="module")
def tiny_sm90():
    from deepinfer.compiler import compile_model

    return compile_model("deepseek-v4.1-flash:tiny", "sm90").plan


def test_compile_flag_reaches_the_key_derivation_and_the_manifest(stub_builds, tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["compile", "--model", "deepseek-v4.1-flash:tiny", "--target", "sm90", "--max-model-len", "1024",
                 "-o", str(out)]) == 0  # fmt: skip
    (call,) = stub_builds
    assert call["max_model_len"] == 1024
    # the top-k columns follow the caches, which follow max_model_len: the specs are the 1024-token engine's
    from deepinfer.runtime.plan import load_plan

    plan = load_plan(out)
    assert plan.kernels["max_model_len"] == 1024 and engine.plan_max_model_len(plan) == 1024
    want, _ = pk.kernel_specs(plan.graph, "sm90", "bound", max_model_len=1024)
    assert [s.ident() for s in call["specs"]] == [s.ident() for s in want]
    other, _ = pk.kernel_specs(plan.graph, "sm90", "bound", max_model_len=4096)
    assert {s.ident() for s in other} != {s.ident() for s in want}, "max_model_len changes no key: a vacuous check"


def test_without_the_flag_the_engine_default_is_used(stub_builds, tiny_sm90):
    from deepinfer.compiler import compile_model

    compile_model("deepseek-v4.1-flash:tiny", "sm90", kernels="bound")
    assert stub_builds[0]["max_model_len"] == engine.default_max_model_len(tiny_sm90.config)
    assert engine.plan_max_model_len(tiny_sm90) == engine.default_max_model_len(tiny_sm90.config)  # no manifest


def test_engine_prebuild_builds_the_compilers_keys_for_its_max_model_len(tiny_sm90, monkeypatch):
    asked = []
    monkeypatch.setattr(ka, "prebuild", lambda keys, jobs, timeout_s, log=print: asked.append((keys, jobs)) or {})
    assert engine.prebuild_plan_kernels(tiny_sm90, 2048, 3, log=lambda *a: None) == {}
    ((keys, jobs),) = asked
    want, _ = pk.kernel_specs(tiny_sm90.graph, "sm90", "bound", max_model_len=2048)
    assert jobs == 3 and keys == [s.key for s in want] and all(k is not None for k in keys)
