"""runtime/batched_decode.py: the batched decode step on the executor (CPU: references, in-place cache writes;
GPU: the sm90 kernels at T = B against the one-sequence steps on the same device)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ir import interpreter
from deepinfer.ir.ops.core import ScatterRows
from deepinfer.runtime.batched_decode import BatchedDecoder, scatter_rows_in_place
from deepinfer.runtime.cuda_executor import GraphExecutor, to_device
from deepinfer.runtime.session import allocate_caches

MAX_LEN = 24
LENGTHS = (5, 8, 11)  # tiny V4.1 (window 8, ratios 1 and 2): mixed pair closings, a wrapped ring
KERNEL_TOL = 0.15  # batched kernels vs one-sequence kernels, relative to the logits' max (see the GPU test)


def test_in_place_scatter_writes_the_functional_rows():
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(4 * 6, 3, generator=gen)
    index = torch.tensor([2, -1, 6 * 2 + 5, -1])  # sequences 0 and 2 write, 1 and 3 skip
    rows = torch.randn(4, 3, generator=gen)
    want = ScatterRows.reference(pool, index, rows)
    got = scatter_rows_in_place(pool, index, rows)
    assert got.data_ptr() == pool.data_ptr() and torch.equal(got, want)


def _prefill(ex: GraphExecutor, g, lengths, device) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    names = [e["name"] for e in g.meta["caches"]]
    out = []
    for n in lengths:
        feeds = {"tokens": torch.randint(2, 500, (n,), generator=gen).to(device),
                 "positions": torch.arange(n, device=device), **allocate_caches(g, MAX_LEN, device=device)}  # fmt: skip
        out.append(dict(zip(names, ex.run(feeds)[1:])))
    return out


def _single_steps(ex: GraphExecutor, g, tokens, lengths, seqs, device):
    names = [e["name"] for e in g.meta["caches"]]
    res = []
    for tok, n, c in zip(tokens, lengths, seqs):
        outs = ex.run({"tokens": torch.tensor([tok], device=device), "positions": torch.tensor([n], device=device),
                       **{k: v.clone() for k, v in c.items()}})  # fmt: skip
        res.append((outs[0], dict(zip(names, outs[1:]))))
    return res


@pytest.mark.parametrize("model", ["v41", "v4"])
def test_decoder_on_cpu_is_the_batched_graph_with_caches_updated_in_place(model, sm90_tiny, sm90_tiny_v4):
    plan, params = sm90_tiny if model == "v41" else sm90_tiny_v4
    lengths = LENGTHS if model == "v41" else (7, 11, 5)  # V4: ratio 4 closes at 7 and 11, ratio 8 at 7 only
    g = plan.graph
    single = GraphExecutor(g, params, compiled=False)
    seqs = _prefill(single, g, lengths, "cpu")
    dec = BatchedDecoder(g, params, "cpu", max_model_len=MAX_LEN)
    caches = dec.stack(seqs)
    tokens = [3, 10, 17]
    want = interpreter.run(dec.graph, dec.feeds(tokens, lengths, {k: v.clone() for k, v in caches.items()}), params)
    logits, new = dec.step(tokens, lengths, caches)
    assert torch.equal(logits, want[0])
    for k, w in zip(dec.cache_names, want[1:]):
        assert torch.equal(new[k], w) and new[k] is caches[k], k  # donated: the input holds the new state
    assert dec.exec.stats.compiled["scatter_rows in place"] == sum(n.op == "scatter_rows" for n in dec.graph.nodes)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _stand_in(key):
    """A kernel's CPU stand-in (kernel_adapters.emulated_kernel) with the host-read guard paused."""
    from deepinfer.runtime import cuda_graphs as cg
    from deepinfer.runtime import kernel_adapters as ka

    kernel = ka.emulated_kernel(key)

    def run(*args):
        with cg.unguarded():
            return kernel(*args)

    return run


def _check_batched_step(plan, params, device: str, kernels, jobs: int = 0) -> None:
    """The batched step of B = 3 sequences (tiny V4.1 sm90 plan), three ways:
    1. its references against the one-sequence graph's references, step by step (1e-4 of the logits' max);
    2. with kernels, permutation-equivariant: the sequences (with their caches) in another order give each
       sequence the same logits and caches (a row reading another sequence's pool rows is O(1) off) -- the oracle
       that kernel formats do not blur: the one-sequence steps with kernels are NOT comparable at tiny dims, the
       MoE kernel declines tiny's experts at T=1 (reference) and takes them at T=3 (FP8), and tiny's peaked
       layers move the logits by up to ~40% on such a difference;
    3. with kernels: every kernel through its first-call check (each against its reference on the node's own
       inputs, runtime/cuda_executor.py's bounds) and the kernels tiny can use compiled. The logits against the
       batched references are printed, not bounded: tiny's formats move them by ~0.5 of their max (the
       one-sequence graph's own kernels vs references, emulated: 0.54 / 0.48 / 0.11 at T=1, 0.62 at T=3)."""
    g = plan.graph
    tokens = [3, 10, 17]
    ref_single = GraphExecutor(g, params, compiled=False)
    seqs = _prefill(ref_single, g, LENGTHS, device)
    want = _single_steps(ref_single, g, tokens, LENGTHS, seqs, device)
    ref = BatchedDecoder(g, params, device, max_model_len=MAX_LEN, compiled=False)
    ref_logits, ref_caches = ref.step(tokens, LENGTHS, ref.stack(seqs))
    for b, (w_logits, w_caches) in enumerate(want):
        assert _rel(ref_logits[b], w_logits[0]) <= 1e-4, b
        for k, w in w_caches.items():
            assert _rel(ref_caches[k][b], w) <= 1e-4 if w.is_floating_point() else torch.equal(ref_caches[k][b], w)

    dec = BatchedDecoder(g, params, device, max_model_len=MAX_LEN, kernels=kernels)
    if jobs:  # build the step's kernels in parallel first (each compiles in seconds to a minute)
        from deepinfer.runtime.kernel_adapters import prebuild

        prebuild(dec.exec.kernel_keys(dec.feeds(tokens, LENGTHS, dec.stack(seqs))), jobs, 150.0)
    logits, caches = dec.step(tokens, LENGTHS, dec.stack(seqs))
    perm = [2, 0, 1]
    p_tokens, p_lengths = [tokens[i] for i in perm], [LENGTHS[i] for i in perm]
    p_logits, p_caches = dec.step(p_tokens, p_lengths, dec.stack([seqs[i] for i in perm]))
    for j, i in enumerate(perm):
        assert _rel(p_logits[j], logits[i]) <= PERMUTE_TOL, (i, _rel(p_logits[j], logits[i]))
        for k in dec.cache_names:
            assert _rel(p_caches[k][j], caches[k][i]) <= PERMUTE_TOL if caches[k].is_floating_point() \
                else torch.equal(p_caches[k][j], caches[k][i]), (i, k)  # fmt: skip
    err = _rel(logits, ref_logits)
    print(f"batched step with kernels: vs references {err:.2e}\n{dec.report()}")
    assert torch.isfinite(logits).all() and not dec.exec.kernels.failed, dec.report()
    # (tiny's top-k of 8 + 6 is no multiple of the attention kernel's chunk: test_*attention_kernel_over_flat_pools*)
    assert {"fp8_gemm", "moe_grouped_gemm", "scatter_rows in place"} <= set(dec.exec.stats.compiled), dec.report()


PERMUTE_TOL = 1e-2  # per-row kernels are permutation-equivariant to the bit, split-K atomics to an ulp


def test_batched_step_with_emulated_kernels(sm90_tiny, monkeypatch):
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.cuda_executor import KernelCache

    monkeypatch.setattr(ka, "EMULATE", True)
    plan, params = sm90_tiny
    _check_batched_step(plan, params, "cpu", KernelCache(builder=_stand_in))


@pytest.mark.gpu
def test_gpu_batched_step(sm90_tiny):
    import os

    plan, params = sm90_tiny
    _check_batched_step(plan, to_device(params, "cuda"), "cuda", None, jobs=min(12, os.cpu_count() or 1))


def test_bench_batched_decode_tiny_smoke_mode(tmp_path, monkeypatch):
    """benchmarks/bench_batched_decode.py --preset tiny on the CPU: every layer row has times, the cache bytes of
    all sequences in its roofline, and the torch eager baseline."""
    import importlib.util
    import json
    from pathlib import Path

    from deepinfer.runtime import kernel_adapters as ka

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_batched_decode.py"
    spec = importlib.util.spec_from_file_location("bench_batched_decode_for_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(ka, "EMULATE", False)  # the smoke mode turns it on; restored after the test
    rc = mod.main(["--preset", "tiny", "--batches", "2", "--context", "12", "--reps", "1", "--no-torch-compile",
                   "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    (row,) = json.loads((tmp_path / "bench_batched_decode.json").read_text())["rows"]
    assert "error" not in row and not row.get("errors"), row.get("errors")
    assert row["sequences"] == 2 and set(row["layers"]) == {"embed", "l0", "l1", "head"}
    chk = row["check"]  # the kernels' formats move tiny's logits by up to ~30% (test_cuda_executor's bound: 0.5)
    assert chk["batched_vs_single"] <= 1e-4 and chk["pinned"] <= 1e-4 and chk["kernels_vs_eager"] <= 0.5, chk
    for layer in ("l0", "l1"):
        m = row["layers"][layer]
        assert m["kv_bytes"] > 0 and m["weight_bytes"] > 0 and m["roofline_pct"] > 0
        assert m["graph_ms"] >= 0 and m["torch_eager_ms"] > 0 and m["compile_note"].startswith("off")


# ---------------------------------------------------------------------------------------------- the engine


def _greedy_rows(llm, prompts, n: int):
    """Greedy tokens and every sampled logits row by (prompt, position)."""
    import deepinfer.runtime.executor as ex_mod
    from deepinfer.runtime.sampler import SamplingParams

    rows, orig = {}, ex_mod.sample_row

    def spy(row, params, seed, position, prompt, output):
        rows[(tuple(prompt), position)] = row.clone()
        return orig(row, params, seed, position, prompt, output)

    ex_mod.sample_row = spy
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    finally:
        ex_mod.sample_row = orig
    return [o.token_ids for o in outs], rows


def _llm(model, **runner_kw):
    from deepinfer.runtime.cuda_executor import CudaRunner
    from deepinfer.runtime.engine import LLM

    llm = LLM(plan=model.plan, params=model.params, tokenizer=None, max_model_len=16, overlap=False)
    llm.executor.runner = CudaRunner(model.plan.graph, model.params, device="cpu", max_model_len=16, **runner_kw)
    return llm


def test_engine_with_batched_decode_graphs_keeps_its_outputs(tiny_v41, monkeypatch):
    """The engine's default decode path, BatchedDecodeGraphs (emulated graph backend), against the chained
    single-token steps (batched_decode=False): the same greedy tokens; one sequence (bucket 1, captured and
    replayed) gives the same bits, two (bucket 2) logits within fp32 rounding -- that bucket stays eager, its
    reason named (the tiny MoE reference reads its routing on the host at T > 1)."""
    from deepinfer.runtime import cuda_graphs as cg
    from deepinfer.runtime.batched_decode import BatchedDecodeGraphs
    from deepinfer.runtime.cuda_executor import BATCHED_DECODE_ENV

    from .conftest import prompts_of_lengths

    monkeypatch.delenv(BATCHED_DECODE_ENV, raising=False)
    prompts = prompts_of_lengths([5, 3], seed=11)
    want_tokens, want = _greedy_rows(_llm(tiny_v41, cuda_graphs=False, batched_decode=False), prompts, 3)
    llm = _llm(tiny_v41, buckets=(1, 2), graph_backend=cg.EmulatedGraphBackend())  # the default path
    dg = llm.executor.runner.graphs
    assert isinstance(dg, BatchedDecodeGraphs)
    got_tokens, got = _greedy_rows(llm, prompts[:1], 3)  # two decode steps: capture, then a replay
    assert got_tokens == want_tokens[:1] and all(torch.equal(got[k], want[k]) for k in got)
    assert list(dg.graphs) == [1] and dg.replays[1] >= 1, dg.report()
    got_tokens, got = _greedy_rows(llm, prompts, 2)
    assert got_tokens == [t[:2] for t in want_tokens] and got.keys() <= want.keys()
    for k, row in got.items():
        torch.testing.assert_close(row, want[k], rtol=1e-4, atol=1e-4)
    assert 2 not in dg.graphs and "host" in dg.failed[2], dg.report()
    assert "bucket  2: eager" in llm.executor.runner.report()
    assert llm.kv.num_used_blocks == 0 and llm.kv.num_used_slots == 0


def test_decode_path_default_env_and_fallback(tiny_v41, monkeypatch):
    """Which decode path CudaRunner takes: batched by default and with DEEPINFER_BATCHED_DECODE=1; the chained
    one-sequence steps with =0 or batched_decode=False (the argument wins over the variable); any other value is
    an error naming it. A graph batch_decode cannot rewrite falls back to the one-sequence steps by default, the
    report saying why, and raises where batched_decode=True asked for it."""
    from deepinfer.errors import DeepInferError, IRError
    from deepinfer.runtime import batched_decode as bd
    from deepinfer.runtime import cuda_graphs as cg
    from deepinfer.runtime.cuda_executor import BATCHED_DECODE_ENV, CudaRunner, KernelCache

    def runner(**kw):
        return CudaRunner(tiny_v41.plan.graph, tiny_v41.params, device="cpu", max_model_len=16, **kw)

    def path(r) -> str:
        return {bd.BatchedDecodeGraphs: "batched", cg.DecodeGraphs: "single"}[type(r.graphs)]

    monkeypatch.delenv(BATCHED_DECODE_ENV, raising=False)
    default = runner()
    assert path(default) == "batched" and default.batched_off is None
    assert "one batched step per bucket" in default.report() and "batched decode: off" not in default.report()
    shared = KernelCache()
    default.use_kernels(shared)  # the GPU tests' one cache for several engines reaches the batched step too
    assert default.exec.kernels is shared and default.graphs.dec.exec.kernels is shared
    assert path(runner(batched_decode=False)) == "single"
    assert "batched decode: off (batched_decode=False)" in runner(batched_decode=False).report()
    monkeypatch.setenv(BATCHED_DECODE_ENV, "1")
    assert path(runner()) == "batched"
    monkeypatch.setenv(BATCHED_DECODE_ENV, "0")
    off = runner()
    assert path(off) == "single" and f"batched decode: off ({BATCHED_DECODE_ENV}=0)" in off.report()
    assert path(runner(batched_decode=True)) == "batched"
    monkeypatch.setenv(BATCHED_DECODE_ENV, "yes")
    with pytest.raises(DeepInferError, match=f"{BATCHED_DECODE_ENV}='yes'"):
        runner()
    monkeypatch.delenv(BATCHED_DECODE_ENV)

    def cannot(g, **kw):
        raise IRError("batch_decode: n7 reads %positions (stand-in)")

    monkeypatch.setattr(bd, "batch_decode", cannot)
    fallback = runner()
    assert path(fallback) == "single" and "stand-in" in fallback.batched_off and "stand-in" in fallback.report()
    with pytest.raises(IRError, match="stand-in"):
        runner(batched_decode=True)


# ---------------------------------------------------------------------------------------------- warm-up at start


def _graphs_llm(model, buckets=(1,)):
    """An engine on the tiny cpu plan whose runner is the default batched decode path with emulated CUDA graphs
    (no warm-up: the test calls it)."""
    from deepinfer.runtime import cuda_graphs as cg

    return _llm(model, buckets=buckets, graph_backend=cg.EmulatedGraphBackend())


def _state(graphs) -> dict[str, torch.Tensor]:
    return {**{k: v.clone() for k, v in graphs.caches.items()}, "tokens": graphs.tok.clone(), "pos": graphs.pos.clone()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_warm_up_captures_at_start_and_changes_no_result(tiny_v41, monkeypatch):
    """BatchedDecodeGraphs.warm_up does the bucket's first use on padding rows: captured, named in the line with its
    seconds. Afterwards every static slot holds its initial value (a stale padding row fails here). Then the first
    real step runs eagerly (the kernels' checks on real data: the next test), later ones replay, and every sampled
    logits row -- and the static slots after the steps -- equal, bit for
    bit, what the engine computes without warm-up: the same step run eagerly (graphs off; the first use's capture
    replays the eager step, test_engine_with_batched_decode_graphs_keeps_its_outputs). (An eager bucket: next test.)"""
    from deepinfer.runtime.cuda_executor import BATCHED_DECODE_ENV

    from .conftest import prompts_of_lengths

    monkeypatch.delenv(BATCHED_DECODE_ENV, raising=False)
    eager, warm = _llm(tiny_v41, cuda_graphs=False, buckets=(1,)), _graphs_llm(tiny_v41)
    eager_dg, dg = eager.executor.runner.graphs, warm.executor.runner.graphs
    initial = _state(dg)
    line = warm.executor.runner.warm_up(log=lambda _: None)
    assert line.startswith("decode graphs warmed up in ") and "buckets 1 captured (seconds per bucket 1: " in line
    assert list(dg.graphs) == list(dg.warm_s) == [1] and not dg.failed and not dg.warm_errors
    assert _equal(_state(dg), initial) and all(dg.padded) and not dg.logits.any()
    prompts = prompts_of_lengths([5], seed=11)
    assert dg.unchecked == {1} and dg.dec.exec.verify  # the checks: off at warm-up, at the first real step
    want_tokens, want = _greedy_rows(eager, prompts, 3)  # two decode steps, eager
    got_tokens, got = _greedy_rows(warm, prompts, 3)  # the first real step eager (checked), then a replay
    assert got_tokens == want_tokens and _equal(got, want) and _equal(_state(dg), _state(eager_dg))
    assert dg.eager_steps == 1 and dg.replays[1] == 1 and not dg.unchecked and eager_dg.eager_steps == 2, dg.report()
    assert "bucket  1: captured" in dg.report() and "warmed up at start" in dg.report(), dg.report()


def test_first_call_checks_run_on_the_first_real_step_after_warm_up(tiny_v41, monkeypatch):
    """The warm-up runs without the kernels' first-call checks. A stand-in kernel for rope, right at position 0 (all
    the warm-up feeds it) and wrong past it, goes into the warmed graph unchecked; the first real step runs eagerly,
    its check disables the kernel (its output is the reference's that step) and the graph is dropped, the report
    saying why; the next step captures the bucket again with the reference, later steps replay it -- every sampled
    row equal, bit for bit, to an engine without the stand-in."""
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.batched_decode import BatchedExecutor
    from deepinfer.runtime.cuda_executor import BATCHED_DECODE_ENV

    from .conftest import prompts_of_lengths

    monkeypatch.delenv(BATCHED_DECODE_ENV, raising=False)
    prompts = prompts_of_lengths([5], seed=11)
    want_tokens, want = _greedy_rows(_llm(tiny_v41, cuda_graphs=False), prompts, 5)

    class WrongPastPositionZero:  # a Triton-like adapter (no TileLang keys): checked as one pseudo kernel set
        def keys(self, call):
            return []

        def run(self, call, kernels):
            positions = call.args[1]
            out = get_op("rope").run(call.args, call.attrs)[0]
            past = (positions > 0).view(-1, *[1] * (out.dim() - 1))
            return [torch.where(past, 2 * out, out)]  # sync-free: capturable

    binding, adapter_for = BatchedExecutor.binding, ka.adapter_for
    monkeypatch.setattr(BatchedExecutor, "binding", lambda self, node, t: {"family": "fake_rope"} if node.op == "rope"
                        else binding(self, node, t))  # fmt: skip  (the batched step only: the prefill keeps its own)
    monkeypatch.setattr(ka, "adapter_for", lambda family, op: WrongPastPositionZero() if family == "fake_rope"
                        else adapter_for(family, op))  # fmt: skip
    llm = _graphs_llm(tiny_v41)
    dg = llm.executor.runner.graphs
    llm.executor.runner.warm_up(log=lambda _: None)
    assert list(dg.graphs) == [1] and dg.unchecked == {1} and not dg.dec.exec.kernels.failed
    got_tokens, got = _greedy_rows(llm, prompts, 5)  # four decode steps: checked, captured again, two replays
    assert got_tokens == want_tokens and _equal(got, want)
    (why,) = dg.dec.exec.kernels.failed.values()
    assert why.startswith("mismatch vs reference at first call"), why
    assert len(dg.dropped) == 1 and "buckets 1 dropped, 1 kernel set(s) disabled after capture (fake_rope." in \
        dg.dropped[0], dg.dropped  # fmt: skip
    assert list(dg.graphs) == [1] and dg.replays[1] == 2 and dg.eager_steps == 2, dg.report()
    assert "graphs dropped: buckets 1 dropped" in dg.report() and "bucket  1: captured in" in dg.report()
    assert "(at first use)" in dg.report() and not dg.warm_s, dg.report()  # captured again: no longer the warm-up's


def test_warm_up_between_steps_writes_no_live_sequence(tiny_v41, monkeypatch):
    """warm_up while a sequence is mid-generation (between engine steps, bucket 1 captured at its first use, bucket
    2 not yet used) writes nothing of the engine's KV state (block pools and state slots, bit for bit): it runs
    over the static slots, scratch the engine refills before every step. Bucket 2 stays eager, its reason in the
    line (the tiny MoE reference reads its routing on the host at T > 1). The sequence then goes on to the tokens
    and logits of an engine without graphs (the batched step at B = 1, eager: the replay's bits)."""
    import deepinfer.runtime.executor as ex_mod
    from deepinfer.runtime.cuda_executor import BATCHED_DECODE_ENV

    from .conftest import prompts_of_lengths

    monkeypatch.delenv(BATCHED_DECODE_ENV, raising=False)
    prompt = prompts_of_lengths([5], seed=11)[0]
    want_tokens, want = _greedy_rows(_llm(tiny_v41, cuda_graphs=False), [prompt], 4)
    llm = _graphs_llm(tiny_v41, buckets=(1, 2))
    rows, orig = {}, ex_mod.sample_row

    def spy(row, params, seed, position, prompt_ids, output):
        rows[(tuple(prompt_ids), position)] = row.clone()
        return orig(row, params, seed, position, prompt_ids, output)

    monkeypatch.setattr(ex_mod, "sample_row", spy)
    rid = llm.add_request(prompt, _greedy_params(4))
    llm.step(), llm.step()  # the prefill, then one decode step (bucket 1 captured)
    kv = {**{("pool", k): v.clone() for k, v in llm.kv.pools.items()},
          **{("slot", k): v.clone() for k, v in llm.kv.slots.items()}}  # fmt: skip
    dg = llm.executor.runner.graphs
    seen, step = [], dg.dec.step
    dg.dec.step = lambda tokens, positions, caches: seen.append((tokens.clone(), positions.clone())) or step(
        tokens, positions, caches)  # fmt: skip
    line = llm.executor.runner.warm_up(log=lambda _: None)
    del dg.dec.step
    # every warm-up step: first steps (position 0) of distinct tokens, so a kernel's first-call check sees distinct rows
    assert seen and all(t.tolist() == [1, 2] and p.tolist() == [0, 0] for t, p in seen), seen
    assert list(dg.warm_s) == [2] and "host" in dg.failed[2] and "buckets none captured" in line, line
    assert "eager: 2 (the step reads device values on the host" in line, line
    assert _equal({("pool", k): v for k, v in llm.kv.pools.items()} | {("slot", k): v for k, v in llm.kv.slots.items()},
                  kv)  # fmt: skip
    while llm.has_unfinished():
        llm.step()
    assert llm._seqs[rid].output_ids == want_tokens[0] and _equal(rows, want)


def test_a_warm_up_that_raises_leaves_the_bucket_to_its_first_use(tiny_v41, monkeypatch):
    """A bucket whose padding step raises at warm-up is neither captured nor marked eager: the line and the report
    name the error, the slots are reset, and the bucket is captured at its first use as without the warm-up."""
    from deepinfer.runtime.cuda_executor import BATCHED_DECODE_ENV

    from .conftest import prompts_of_lengths

    monkeypatch.delenv(BATCHED_DECODE_ENV, raising=False)
    llm = _graphs_llm(tiny_v41)
    dg = llm.executor.runner.graphs
    initial = _state(dg)

    def raising(*args):
        raise RuntimeError("stand-in kernel failure")

    dg.dec.step = raising
    line = llm.executor.runner.warm_up(log=lambda _: None)
    del dg.dec.step  # the class's step again
    assert "warm-up raised, left to first use: 1 (RuntimeError: stand-in kernel failure)" in line, line
    assert not dg.graphs and not dg.failed and _equal(_state(dg), initial)
    assert "bucket  1: warm-up raised (RuntimeError: stand-in kernel failure); left to its first use" in dg.report()
    tokens, _ = _greedy_rows(llm, prompts_of_lengths([5], seed=11), 3)
    assert len(tokens[0]) == 3 and list(dg.graphs) == [1] and "(at first use)" in dg.report(), dg.report()


@pytest.mark.gpu
def test_gpu_engine_with_batched_decode_graphs(sm90_tiny, monkeypatch):
    """The engine on the H200 with its default decode path, the batched step (tiny V4.1 sm90 plan): one sequence
    (bucket 1, captured, replayed; the capture's replay checked against its eager step) gives the one-sequence
    path's (batched_decode=False) greedy tokens; five sequences (one batched step of 5 per token, bucket 8) all
    finish with their 8 tokens. Their tokens are not compared with the one-sequence path's: at T > 1 the MoE
    kernel takes tiny's experts that it declines at T = 1, and tiny's logits move by ~0.5 of their max on such a
    format difference (test_batched_step_with_emulated_kernels); the batched step's numbers are checked there and
    in test_gpu_batched_step."""
    from deepinfer.runtime.batched_decode import BatchedDecodeGraphs
    from deepinfer.runtime.cuda_executor import BATCHED_DECODE_ENV
    from deepinfer.runtime.engine import LLM

    from .conftest import prompts_of_lengths

    monkeypatch.delenv(BATCHED_DECODE_ENV, raising=False)
    plan, params = sm90_tiny
    one = prompts_of_lengths([7], seed=1, vocab=120000)
    five = prompts_of_lengths([5, 9, 3, 12, 7], seed=2, vocab=120000)

    def llm(**kw):  # no warm-up at construction: it would build the decode kernels before use_kernels below
        return LLM(plan=plan, target="sm90", params=params, tokenizer=None, max_model_len=64, max_num_seqs=8,
                   overlap=False, graph_warmup=False, **kw)  # fmt: skip

    single = llm(batched_decode=False)
    want_tokens, want = _greedy_rows(single, one, 6)
    batched = llm()  # the default
    batched.executor.runner.use_kernels(single.executor.runner.exec.kernels)  # each kernel built once
    got_tokens, got = _greedy_rows(batched, one, 6)
    dg = batched.executor.runner.graphs
    print(batched.executor.runner.report())
    print("one sequence, rows vs the one-sequence path:", [f"{_rel(got[k], want[k]):.1e}" for k in sorted(want)])
    assert isinstance(dg, BatchedDecodeGraphs) and 1 in dg.graphs and dg.replays[1] >= 4, dg.report()
    assert got_tokens == want_tokens
    outs = batched.generate(five, _greedy_params(8))
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in outs), [o.finish_reason for o in outs]
    assert dg.batches > 5 and batched.kv.num_used_blocks == 0, dg.report()


def _greedy_params(n: int):
    from deepinfer.runtime.sampler import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------------------------------------- attention kernel


def _attention_case(device, b=4, h=64, d=512, w=128, c=1024, k=512, seed=0):
    """B sequences at V4.1's attention dims: per-sequence (window pool, its ids, compressed cache, top-k ids) and
    the batched graph's operands for the same rows (flat rings + new rows, flat ids, a compact compressed pool)."""
    from deepinfer.ir.registry import get_op

    gen = torch.Generator().manual_seed(seed)
    positions = torch.tensor([w + 3, 2 * w + 7, 40, 3 * w][:b])  # wrapped rings, a ring not yet full
    q, rings, new = torch.randn(b, h, d, generator=gen), torch.randn(b, w, d, generator=gen), torch.randn(b, d)
    ckv = torch.randn(b, c, d, generator=gen)
    ids = torch.stack([torch.randperm(c, generator=gen)[:k] for _ in range(b)])
    ids[:, -37:] = -1  # padding
    sink = torch.randn(h, generator=gen)
    single = []
    for i in range(b):
        win_idx = get_op("window_indices").run([positions[i : i + 1]], {"window": w})[0]
        single.append([q[i : i + 1], sink, torch.cat([rings[i], new[i : i + 1]]), win_idx, ckv[i], ids[i : i + 1]])
    flat = ckv.reshape(b * c, d)
    rows = get_op("batched_rows").run([ids, flat], {})[0]
    cmp_rows, cmp_ids = get_op("batched_gather_rows").run([flat, rows], {})
    win_idx = get_op("batched_window_indices").run([positions], {"window": w})[0]
    batched = [q, sink, torch.cat([rings.reshape(b * w, d), new]), win_idx, cmp_rows, cmp_ids]
    to = lambda xs: [x.to(device) for x in xs]  # noqa: E731
    return [to(s) for s in single], to(batched)


def _attention_call(args):
    from deepinfer.runtime import kernel_adapters as ka

    return ka.Call("sparse_attention", {"scale": args[0].shape[-1] ** -0.5}, list(args), [f"a{i}" for i in range(6)],
                   [False] * 6, {}, {})  # fmt: skip


def _attend(args, builder) -> torch.Tensor:
    from deepinfer.runtime import kernel_adapters as ka

    call = _attention_call(args)
    adapter = ka.adapter_for("sparse_attn_decode", "sparse_attention")
    return adapter.run(call, [builder(key) for key in adapter.keys(call)])[0].float()


def _check_attention_over_flat_pools(device, builder, tol: float) -> None:
    from deepinfer.ir.registry import get_op

    single, batched = _attention_case(device)
    got = _attend(batched, builder)
    want = torch.cat([_attend(s, builder) for s in single])
    ref = torch.cat([get_op("sparse_attention").run(s, {"scale": s[0].shape[-1] ** -0.5})[0] for s in single])
    assert _rel(got, want) <= tol and _rel(got, ref.float()) <= 2 * tol, (_rel(got, want), _rel(got, ref.float()))


def test_attention_kernel_over_flat_pools_emulated(monkeypatch):
    """The decode attention's adapter on the batched graph's operands (flat rings, flat window ids, the compact
    compressed pool) with the kernels' CPU stand-ins: each query's output equals its own sequence's call."""
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setattr(ka, "EMULATE", True)
    _check_attention_over_flat_pools("cpu", ka.emulated_kernel, 1e-2)


@pytest.mark.gpu
def test_gpu_attention_kernel_over_flat_pools():
    """The same on the H200 with the compiled sparse_attn_decode programs (V4.1 dims: H 64, D 512, 128 window +
    512 top-k): the batched call vs four one-sequence calls (bf16 pools both: ~1e-2) and vs the reference."""
    import functools
    import os

    from deepinfer.runtime import kernel_adapters as ka

    single, batched = _attention_case("cuda")
    adapter = ka.adapter_for("sparse_attn_decode", "sparse_attention")
    keys = {k for args in (single[0], batched) for k in adapter.keys(_attention_call(args))}
    ka.prebuild(sorted(keys, key=str), min(8, os.cpu_count() or 1), 150.0)  # in parallel, into the disk cache
    _check_attention_over_flat_pools("cuda", functools.cache(ka.build_kernel), 2e-2)  # each program loaded once


def test_sm90_engine_with_batched_decode_and_emulated_kernels(sm90_tiny, monkeypatch):
    """The GPU engine test's path on the CPU: the tiny V4.1 sm90 plan's engine with every kernel emulated at its
    formats and emulated CUDA graphs, the default decode path (batched) against the one-sequence path
    (batched_decode=False): one sequence (bucket 1: captured, replayed) gives the same tokens and the same logits
    bit for bit; five sequences all finish."""
    from unittest import mock

    from deepinfer.runtime import cuda_graphs as cg
    from deepinfer.runtime import engine
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.batched_decode import BatchedDecodeGraphs
    from deepinfer.runtime.cuda_executor import BATCHED_DECODE_ENV, CudaRunner, KernelCache

    from .conftest import prompts_of_lengths

    plan, params = sm90_tiny
    monkeypatch.setattr(ka, "EMULATE", True)
    monkeypatch.delenv(BATCHED_DECODE_ENV, raising=False)

    def runner(plan_, params_, config, max_model_len):
        return CudaRunner(plan.graph, params, device="cpu", kernels=KernelCache(builder=_stand_in),
                          max_model_len=max_model_len, batched_decode=config.batched_decode,
                          graph_backend=cg.EmulatedGraphBackend())  # fmt: skip

    one = prompts_of_lengths([7], seed=1, vocab=120000)
    with mock.patch.object(engine, "_runner", runner), mock.patch.object(engine, "_resolve_plan", lambda *a: a[2]):

        def llm(**kw):
            return engine.LLM(plan=plan, target="sm90", params=params, tokenizer=None, max_model_len=32,
                              max_num_seqs=8, overlap=False, **kw)  # fmt: skip

        single = llm(batched_decode=False)
        want_tokens, want = _greedy_rows(single, one, 4)
        batched = llm()
        got_tokens, got = _greedy_rows(batched, one, 4)
        dg = batched.executor.runner.graphs
        assert isinstance(dg, BatchedDecodeGraphs) and isinstance(single.executor.runner.graphs, cg.DecodeGraphs)
        assert got_tokens == want_tokens and all(torch.equal(got[k], want[k]) for k in want)
        assert 1 in dg.graphs and dg.replays[1] >= 2, dg.report()
        outs = batched.generate(prompts_of_lengths([5, 9, 3], seed=2, vocab=120000), _greedy_params(4))
        assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in outs)
        assert batched.kv.num_used_blocks == 0
