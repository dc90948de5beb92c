"""The CUDA executor without a GPU: adapter selection, fallback accounting with references (device="cpu"),
the adapters' layout work with torch stand-ins for the kernels, and the one-line errors; GPU tests run on the H200."""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import DeepInferError
from deepinfer.ir import interpreter
from deepinfer.runtime import kernel_adapters as ka
from deepinfer.runtime.cuda_executor import (
    VERIFY_TOL_FP8,
    CudaRunner,
    GraphExecutor,
    KernelCache,
)
from deepinfer.runtime.session import allocate_caches

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")


def _feeds(g, tokens):
    t = len(tokens)
    return {"tokens": torch.tensor(tokens), "positions": torch.arange(t), **allocate_caches(g, t + 1)}


def test_compile_for_sm90_binds_kernels_and_converts_experts(sm90_tiny):
    plan, _ = sm90_tiny
    k = plan.graph.meta["kernels"]
    assert plan.target == "sm90" and k["target"] == "sm90"
    for fam in ("fp8_gemm", "rmsnorm_quant", "moe_grouped_gemm", "hyper_connection"):
        assert k["coverage"].get(fam, 0) > 0, fam
    assert {n.attrs["fmt"] for n in plan.graph.nodes if n.op == "moe_grouped_experts"} == {"fp8"}


def test_adapter_selection():
    assert isinstance(ka.adapter_for("fp8_gemm", "linear_fp8"), ka.LinearFP8Adapter)
    assert isinstance(ka.adapter_for("rmsnorm_quant", "rmsnorm_quant_fp8"), ka.RMSNormAdapter)
    assert isinstance(ka.adapter_for("hyper_connection", "hc_post"), ka.HCPostAdapter)
    assert isinstance(ka.adapter_for("hyper_connection", "hc_pre_collapse"), ka.HCPreCollapseAdapter)
    assert isinstance(ka.adapter_for("moe_grouped_gemm", "moe_grouped_experts"), ka.MoEGroupedAdapter)
    assert ka.adapter_for("torch_ref", "embedding") is None
    assert ka.adapter_for("fp8_gemm", "rmsnorm") is None


def test_cpu_tensors_run_references_and_every_node_is_counted(sm90_tiny):
    plan, params = sm90_tiny
    g = plan.graph
    feeds = _feeds(g, [3, 5, 7])
    ex = GraphExecutor(g, params)
    out = ex.run(feeds)
    compiled, ref = ex.stats.total()
    assert compiled == 0 and ref == len(g.nodes) == len(ex.stats.per_node)
    assert any("CUDA tensors only" in why for why in ex.stats.reference)
    assert torch.equal(out[0], interpreter.run(g, feeds, params)[0])
    assert "0 compiled" in ex.report()


def test_adapters_with_emulated_kernels_match_the_references(sm90_tiny, monkeypatch):
    plan, params = sm90_tiny
    g = plan.graph
    monkeypatch.setattr(ka, "EMULATE", True)
    ex = GraphExecutor(g, params, kernels=KernelCache(builder=ka.emulated_kernel))
    out = ex.run(_feeds(g, [3, 5, 7, 11, 13]))
    for fam in ("fp8_gemm", "rmsnorm_quant", "moe_grouped_gemm", "hyper_connection"):
        assert ex.stats.compiled[fam] > 0, ex.report()
    assert not ex.kernels.failed and max(ex.stats.verified.values()) <= VERIFY_TOL_FP8
    assert torch.isfinite(out[0]).all()
    # kernels are cached per (family, program, shapes, config): a second call builds nothing new
    n = len(ex.kernels.kernels)
    ex.run(_feeds(g, [3, 5, 7, 11, 13]))
    assert len(ex.kernels.kernels) == n


def test_a_wrong_kernel_is_disabled_at_its_first_call_and_falls_back(sm90_tiny, monkeypatch):
    plan, params = sm90_tiny
    g = plan.graph
    monkeypatch.setattr(ka, "EMULATE", True)

    def broken(key):
        k = ka.emulated_kernel(key)
        if key.family != "hyper_connection":
            return k
        return lambda *args: (k(*args), args[-1].mul_(3.0))  # writes a wrong output

    feeds = _feeds(g, [3, 5, 7])
    ex = GraphExecutor(g, params, kernels=KernelCache(builder=broken))
    out = ex.run(feeds)
    assert ex.stats.compiled["hyper_connection"] == 0 and ex.kernels.failed
    assert any("mismatch" in why for why in ex.stats.reference)
    assert "disabled" in ex.report()
    assert torch.isfinite(out[0]).all()


def test_build_failures_and_budget_fall_back_with_the_reason():
    cache = KernelCache(builder=lambda key: (_ for _ in ()).throw(RuntimeError("nvcc exploded")))
    key = ka._key("fp8_gemm", "program", (64, 64, 64))
    with pytest.raises(ka.Decline, match="nvcc exploded"):
        cache.get(key)
    with pytest.raises(ka.Decline, match="nvcc exploded"):  # remembered, not rebuilt
        cache.get(key)
    spent = KernelCache(builder=lambda key: object(), budget_s=0.0)
    spent.build_s["x"] = 1.0
    with pytest.raises(ka.Decline, match="budget"):
        spent.get(key)


def test_moe_layout_matches_the_codegen_layout():
    from deepinfer.codegen.kernels import moe_grouped_gemm

    idx = torch.tensor([[3, 1], [1, 0], [3, 2], [1, 3]])
    slot, tiles, m_rows = ka._moe_layout(idx, 5, 4)
    rows, ref_tiles = moe_grouped_gemm.contiguous_layout(idx.reshape(-1), 5, 4)
    assert torch.equal(tiles[: len(ref_tiles)], ref_tiles) and (tiles[len(ref_tiles) :] == -1).all()
    assert m_rows >= rows.numel() and m_rows % 4 == 0
    for pair, s in enumerate(slot.tolist()):
        assert rows[s] == pair


def test_row_buckets():
    assert [ka.bucket_rows(m, 64) for m in (1, 64, 65, 200)] == [64, 64, 128, 256]
    assert [ka._tile_bucket(n) for n in (1, 2, 3, 5, 6, 7, 9)] == [1, 2, 3, 6, 6, 8, 12]


@no_cuda
def test_sm90_plan_without_cuda_is_a_one_line_error(sm90_tiny):
    from deepinfer.runtime.engine import LLM

    plan, params = sm90_tiny
    with pytest.raises(DeepInferError, match="needs a CUDA device") as e:
        LLM(plan=plan, target="sm90", params=params, tokenizer=None)
    assert "\n" not in str(e.value)
    with pytest.raises(DeepInferError, match="needs a CUDA device"):
        CudaRunner(plan.graph, params)


@no_cuda
def test_bench_without_cuda_is_a_one_line_error_exit_2(capsys):
    from deepinfer.cli import main

    assert main(["bench"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a CUDA device" in err and "\n" not in err


@pytest.mark.gpu
def test_gpu_runner_runs_compiled_kernels_within_the_format_tolerance(sm90_tiny):
    plan, params = sm90_tiny
    g = plan.graph
    feeds = _feeds(g, [3, 5, 7, 11])
    runner = CudaRunner(g, params)
    caches = {k: v for k, v in feeds.items() if k.startswith("cache.")}
    logits, _ = runner.forward(feeds["tokens"], feeds["positions"], caches)
    c, _ = runner.exec.stats.total()
    assert c > 0 and not runner.exec.kernels.failed, runner.report()
    ref = interpreter.run(g, feeds, params)[0]
    # the formats (bf16 activations, FP8 GEMM inputs) move tiny's logits by up to ~30% of their range
    assert (logits - ref).abs().max() <= 0.5 * ref.abs().max()


def _gpu_e2e():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_e2e.py"
    spec = importlib.util.spec_from_file_location("gpu_e2e_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_routing_stable_variant_fixes_selection_and_lengths():
    """gpu_e2e's routing-stable variant: distinct, widely spaced selection biases (so MoE top-k cannot flip)
    and a sequence limit under which every indexer / candidate selection keeps all visible entries."""
    from deepinfer.compiler import compile_model
    from deepinfer.runtime.plan import bind_weights

    g = _gpu_e2e()
    plan = compile_model("deepseek-v4.1-flash:tiny", "cpu").plan
    params, _ = bind_weights(plan)
    stable = g.routing_stable_params(params)
    biases = [n for n in params if n.endswith(".ffn.gate.bias")]
    assert biases
    for n in biases:
        v = stable[n].sort().values
        assert v.shape == params[n].shape and (v.diff() >= g.STABLE_BIAS_SPACING).all()
    assert all(stable[n] is params[n] for n in params if n not in biases)
    assert g.stable_max_len(plan.graph) == 6  # tiny V4.1: ratio-1 index sources with top-6
    prompts, n = g.stable_prompts(6)
    assert all(len(p) + n - 1 <= 6 for p in prompts) and n >= 4


def test_new_adapters_with_emulated_kernels_match_the_references(sm90_tiny, monkeypatch):
    """rope and Engram gather/gate run through their adapters (CPU stand-ins) within the format tolerance;
    nodes bound to a family with no adapter (sparse_attn_decode, compressor, moe_routing) are counted."""
    plan, params = sm90_tiny
    g = plan.graph
    monkeypatch.setattr(ka, "EMULATE", True)
    assert isinstance(ka.adapter_for("rope", "rope"), ka.RopeAdapter)
    assert isinstance(ka.adapter_for("engram", "engram_gate"), ka.EngramGateAdapter)
    ex = GraphExecutor(g, params, kernels=KernelCache(builder=ka.emulated_kernel))
    out = ex.run(_feeds(g, [3, 5, 7, 11, 13]))
    print(ex.report())
    for fam in ("rope", "engram"):
        assert ex.stats.compiled[fam] > 0, ex.report()
    assert not ex.kernels.failed and max(ex.stats.verified.values()) <= VERIFY_TOL_FP8
    assert any("no adapter" in why for why in ex.stats.reference), ex.report()
    assert torch.isfinite(out[0]).all()


def test_every_kernel_the_tiny_plan_binds_constructs_its_program(sm90_tiny, monkeypatch):
    """_factory turns each KernelKey back into its TileLang program with the program's own config class (engram
    has one per program; a wrong class failed every engram build on the H200)."""
    pytest.importorskip("tilelang")
    plan, params = sm90_tiny
    monkeypatch.setattr(ka, "EMULATE", True)
    ex = GraphExecutor(plan.graph, params, kernels=KernelCache(builder=ka.emulated_kernel))
    keys = ex.kernel_keys(_feeds(plan.graph, [3, 5, 7, 11, 13]))
    one_per_program = {(k.family, k.program): k for k in keys}
    assert {"engram", "fp8_gemm", "rmsnorm_quant", "rope", "hyper_connection"} <= {f for f, _ in one_per_program}
    for key in one_per_program.values():
        assert ka._factory(key) is not None, key.describe()


def test_profile_times_every_op_by_how_it_ran(sm90_tiny, monkeypatch):
    plan, params = sm90_tiny
    g = plan.graph
    monkeypatch.setattr(ka, "EMULATE", True)
    ex = GraphExecutor(g, params, kernels=KernelCache(builder=ka.emulated_kernel))
    ex.run(_feeds(g, [3, 5, 7]), profile=True)
    times = ex.op_times
    assert {k.split(" (")[0] for k in times} == {n.op for n in g.nodes}
    assert any("(compiled fp8_gemm)" in k for k in times) and any("(reference)" in k for k in times)
    assert all(v >= 0 for v in times.values()) and list(times.values()) == sorted(times.values(), reverse=True)
