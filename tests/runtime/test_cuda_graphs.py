"""The sync-free decode path and CUDA-graph decode, without a GPU:

- the compressor references give the same bits as before they stopped reading the start position on the host;
- the runtime's sync-free equivalents (scatter_rows, candidate_blocks, MoE experts at T=1, e8m0) are identical;
- a decode step of the tiny plans runs under HostSyncGuard (no .item() / int(t) / nonzero / boolean masks /
  tolist) with the same outputs, and on meta tensors copies nothing from the host but memoised constants;
- device-resident KV pools (device= on the manager) keep everything on that device;
- the engine's decode path through static slots with an emulated graph backend (capture under the guard,
  replay = rerun), buckets with padding, and a capture that fails falls back to eager with the reason reported;
GPU tests (H200): greedy with graphs on / off / host caches give identical tokens and logits, graphs replayed.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ir.ops import attention, v41
from deepinfer.ir.ops.attention import apply_rope, last_rows_slots
from deepinfer.ir.registry import get_op
from deepinfer.runtime import cuda_graphs as cg
from deepinfer.runtime.cuda_executor import CudaRunner, GraphExecutor
from deepinfer.runtime.engine import LLM
from deepinfer.runtime.kv_cache import KVCacheManager
from deepinfer.runtime.sampler import SamplingParams
from deepinfer.runtime.session import allocate_caches

from .conftest import prompts_of_lengths

# ---------------------------------------------------------------------------------------------- compressors


def old_compressor_reference(kv, score, ape, norm_w, state_kv, state_score, positions, *, ratio, overlap, eps,
                             **rope):  # fmt: skip
    """ir/ops/attention.compressor_reference before it stopped reading pos[0] on the host (verbatim)."""
    m, rows = ratio, state_kv.shape[0]
    d = kv.shape[-1] // (2 if overlap else 1)
    pos = positions.long()
    start, t = int(pos[0]), pos.shape[0]
    hist_pos = torch.arange(start - rows, start, device=kv.device)
    hist_kv, hist_score = state_kv.float()[hist_pos % rows], state_score.float()[hist_pos % rows]
    hist_score = hist_score.masked_fill((hist_pos < 0).unsqueeze(-1), float("-inf"))
    new_score = score.float() + ape.float()[pos % m]
    seq_kv = torch.cat([hist_kv, kv.float()])
    seq_score = torch.cat([hist_score, new_score])
    n_out = (t + m - 1) // m
    w = start // m + torch.arange(n_out, device=kv.device)
    valid = w < (start + t) // m
    slot = torch.arange(m, device=kv.device)
    cur = (m * w.unsqueeze(-1) + slot - (start - rows)).clamp(0, seq_kv.shape[0] - 1)
    if overlap:
        prev = (cur - m).clamp(min=0)
        prev_score = seq_score[prev][..., :d].masked_fill((w == 0).view(-1, 1, 1), float("-inf"))
        slots_kv = torch.cat([seq_kv[prev][..., :d], seq_kv[cur][..., d:]], dim=1)
        slots_score = torch.cat([prev_score, seq_score[cur][..., d:]], dim=1)
    else:
        slots_kv, slots_score = seq_kv[cur], seq_score[cur]
    pooled = (slots_kv * torch.softmax(slots_score, dim=1)).sum(dim=1)
    pooled = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + eps) * norm_w.float()
    pooled = apply_rope(pooled, w * m, **rope)
    pooled = torch.where(valid.unsqueeze(-1), pooled, torch.zeros_like(pooled)).to(kv.dtype)
    entry_idx = torch.where(valid, w, torch.full_like(w, -1))
    slots = last_rows_slots(pos, rows)
    keep = slots >= 0
    new_state_kv, new_state_score = state_kv.clone(), state_score.clone()
    new_state_kv[slots[keep]] = kv[keep].to(state_kv.dtype)
    new_state_score[slots[keep]] = new_score[keep].to(state_score.dtype)
    return pooled, entry_idx, new_state_kv, new_state_score


def old_pair_pool_reference(kv, score, state_kv, state_score, positions):
    """ir/ops/v41.pair_pool_reference before it stopped reading pos[0] on the host (verbatim)."""
    pos = positions.long()
    start, t = int(pos[0]), pos.shape[0]
    seq_kv = torch.cat([state_kv.float(), kv.float()])
    seq_score = torch.cat([state_score.float(), score.float()])
    n_out = (t + 1) // 2
    j = start // 2 + torch.arange(n_out, device=kv.device)
    valid = j < (start + t) // 2
    first = (2 * j - (start - 1)).clamp(0, t - 1)
    second = (first + 1).clamp(max=t)
    pair_kv = torch.stack([seq_kv[first], seq_kv[second]], dim=1)
    pair_score = torch.stack([seq_score[first], seq_score[second]], dim=1)
    pooled = (pair_kv * torch.softmax(pair_score, dim=1)).sum(dim=1)
    pooled = torch.where(valid.unsqueeze(-1), pooled, torch.zeros_like(pooled)).to(kv.dtype)
    idx = torch.where(valid, j, torch.full_like(j, -1))
    entry_pos = torch.where(valid, 2 * j, torch.zeros_like(j))
    new_kv, new_score = state_kv.clone(), state_score.clone()
    last = start + t - 1
    if last % 2 == 0:
        new_kv[0] = kv[-1].to(state_kv.dtype)
        new_score[0] = score[-1].to(state_score.dtype)
    return pooled, entry_pos, idx, new_kv, new_score


ROPE = {"rope_dim": 8, "theta": 10000.0, "yarn_factor": 4.0, "yarn_orig_len": 64, "beta_fast": 32.0,
        "beta_slow": 1.0}  # fmt: skip
STARTS = (0, 1, 2, 3, 5, 7, 8, 11, 127, 1000)


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def test_compressor_reference_is_unchanged_at_every_start():
    g = torch.Generator().manual_seed(0)
    d = 8
    for ratio, overlap, dtype in ((4, True, torch.float32), (4, False, torch.bfloat16), (8, False, torch.float32)):
        c = 2 if overlap else 1
        rows = ratio * c
        for start in STARTS:
            for t in (1, 3, ratio + 1, 2 * ratio + 3):
                kv, score = (torch.randn(t, c * d, generator=g).to(dtype) for _ in range(2))
                ape = torch.randn(ratio, c * d, generator=g)
                norm = torch.rand(d, generator=g) + 0.5
                skv, ssc = torch.randn(rows, c * d, generator=g).to(dtype), torch.randn(rows, c * d, generator=g)
                pos = torch.arange(start, start + t)
                kw = dict(ratio=ratio, overlap=overlap, eps=1e-6, **ROPE)
                new = attention.compressor_reference(kv, score, ape, norm, skv, ssc, pos, **kw)
                old = old_compressor_reference(kv, score, ape, norm, skv, ssc, pos, **kw)
                assert _same(new, old), (ratio, overlap, start, t)


def test_pair_compressor_reference_is_unchanged_at_every_start():
    g = torch.Generator().manual_seed(0)
    d = 16
    for start in STARTS:
        for t in (1, 2, 3, 4, 7):
            kv, score = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
            skv, ssc = torch.randn(1, d, generator=g), torch.randn(1, d, generator=g)
            pos = torch.arange(start, start + t)
            new = v41.pair_pool_reference(kv, score, skv, ssc, pos)
            old = old_pair_pool_reference(kv, score, skv, ssc, pos)
            assert _same(new, old), (start, t)


# ---------------------------------------------------------------------------------------------- sync-free ops


def test_sync_free_scatter_rows_and_candidate_blocks_are_identical():
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(10, 3, 4, generator=g)
    for index in ([-1], [4], [-1, -1, 2, 7], [9, 0, -1]):
        idx = torch.tensor(index)
        rows = torch.randn(len(index), 3, 4, generator=g)
        assert torch.equal(cg.scatter_rows(cache, idx, rows), get_op("scatter_rows").run([cache, idx, rows], {})[0])
    for t, c in ((1, 13), (3, 13), (5, 32)):
        scores = torch.randn(t, c, generator=g).masked_fill(torch.rand(t, c, generator=g) < 0.3, float("-inf"))
        for start in (0, 1, 3, 17, 2 * c - t):  # the newest visible entry (p+1)//2 - 1 stays below c
            pos = torch.arange(start, start + t)
            a = dict(ratio=2, topk_blocks=3, block=4)
            ref = get_op("candidate_blocks").run([scores, pos], a)[0]
            assert torch.equal(cg.candidate_blocks(scores, pos, **a), ref), (t, c, start)


@pytest.mark.parametrize("fmt", ["float", "fp8"])
def test_sync_free_moe_experts_is_identical_at_one_token(fmt):
    g = torch.Generator().manual_seed(2)
    e, d, inter, k, block = 6, 32, 16, 2, 16
    experts = []
    for _ in range(e):
        for shape in ((inter, d), (d, inter), (inter, d)):
            w = torch.randn(*shape, generator=g) * 0.2
            if fmt == "fp8":
                scales = torch.randint(120, 130, (shape[0] // block, shape[1] // block), generator=g, dtype=torch.uint8)
                experts += [w.to(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)]
            else:
                experts.append(w)
    attrs = dict(n_experts=e, fmt=fmt, swiglu_limit=7.0, block=block)
    for trial in range(6):
        x = torch.randn(1, d, generator=g)
        idx = torch.randperm(e, generator=g)[:k].unsqueeze(0)
        weights = torch.rand(1, k, generator=g)
        ref = get_op("moe_experts").run([x, weights, idx, *experts], attrs)[0]
        assert torch.equal(cg.moe_experts(x, weights, idx, *experts, **attrs), ref), trial
    xs = torch.randn(3, d, generator=g)  # T > 1: the original reference
    idx3 = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(3)])
    w3 = torch.rand(3, k, generator=g)
    assert torch.equal(cg.moe_experts(xs, w3, idx3, *experts, **attrs),
                       get_op("moe_experts").run([xs, w3, idx3, *experts], attrs)[0])  # fmt: skip


def test_sync_free_e8m0_matches_and_patches_are_scoped():
    from deepinfer.ir import dtypes as dt
    from deepinfer.ir.ops.moe import MoEExperts

    s = torch.exp2(torch.arange(-20, 20).float())
    assert torch.equal(cg.float_to_e8m0(s).view(torch.uint8), dt.float_to_e8m0(s).view(torch.uint8))
    orig_e8m0, orig_moe = dt.float_to_e8m0, MoEExperts.__dict__["reference"]
    with cg.sync_free_references(), cg.sync_free_references():
        assert dt.float_to_e8m0 is cg.float_to_e8m0
    assert dt.float_to_e8m0 is orig_e8m0 and MoEExperts.__dict__["reference"] is orig_moe


# ---------------------------------------------------------------------------------------------- decode steps


def _decode_positions_check(g, params, prompt_len: int, steps: int, max_len: int = 40) -> None:
    """Prefill, then decode steps: each under a strict HostSyncGuard, identical to the plain references."""
    names = [e["name"] for e in g.meta["caches"]]
    plain = GraphExecutor(g, params, compiled=False)
    free = GraphExecutor(g, params, compiled=False, sync_free=True)
    outs = plain.run({"tokens": torch.arange(3, 3 + prompt_len), "positions": torch.arange(prompt_len),
                      **allocate_caches(g, max_len)})  # fmt: skip
    for pos in range(prompt_len, prompt_len + steps):
        feeds = {"tokens": torch.tensor([7 * pos % 97 + 2]), "positions": torch.tensor([pos]),
                 **dict(zip(names, outs[1 : 1 + len(names)]))}  # fmt: skip
        ref = plain.run(feeds)
        with cg.HostSyncGuard():
            outs = free.run(feeds)
        assert _same(outs, ref), pos


def test_v41_decode_step_is_sync_free_and_identical(tiny_v41):
    # positions across the ratio-2 pairs, the ratio-1 entries and the candidate blocks of 4 entries
    _decode_positions_check(tiny_v41.plan.graph, tiny_v41.params, prompt_len=3, steps=2, max_len=12)


def test_v4_decode_step_is_sync_free_and_identical(tiny_v4):
    # the V4 compressor (ratio 4 with overlap, ratio 128): windows completing and not
    _decode_positions_check(tiny_v4.plan.graph, tiny_v4.params, prompt_len=3, steps=2, max_len=12)


def test_the_guard_catches_host_reads():
    x = torch.arange(6.0)
    for bad in (lambda: x.sum().item(), lambda: int(x[0]), lambda: bool(x[1] > 0), lambda: x[x > 2],
                lambda: torch.nonzero(x), lambda: x.tolist(), lambda: torch.unique(x),
                lambda: torch.bincount(x.long())):  # fmt: skip
        with pytest.raises(cg.HostSyncError), cg.HostSyncGuard():
            bad()
    with cg.HostSyncGuard():
        torch.where(x > 2, x, 0.0).cumsum(0)  # fine
    guard = cg.HostSyncGuard(record=True)
    with guard:
        int(x[0])
    assert len(guard.hits) == 1 and "test_cuda_graphs.py" in next(iter(guard.hits))


def test_sm90_decode_step_on_meta_tensors_copies_only_memoised_constants(sm90_tiny):
    """Meta tensors have no values: a host read fails, and every host tensor that reaches them is a copy the
    guard sees. Only constant tables copied to the device (rope frequencies, the Engram token map) appear, and
    the memo serves those from one copy -- so nothing in the step would break a CUDA capture."""
    plan, params = sm90_tiny
    g = plan.graph
    ex = GraphExecutor(g, {k: v.to("meta") for k, v in params.items()}, compiled=False, sync_free=True)
    feeds = {k: v.to("meta") for k, v in allocate_caches(g, 40).items()}
    feeds.update(tokens=torch.tensor([19]).to("meta"), positions=torch.tensor([7]).to("meta"))
    seen = cg.HostSyncGuard(record=True)
    with seen:
        ex.run(feeds)
    assert seen.hits and all("host -> device copy" in what for what in seen.hits), seen.hits
    memo: dict = {}
    with cg.HostSyncGuard(memo=memo):  # strict: would raise on any other crossing
        out = ex.run(feeds)
    assert out[0].device.type == "meta" and 0 < len(memo) <= 4  # distinct rope tables + the token map


# ---------------------------------------------------------------------------------------------- KV on a device


def test_kv_pools_gather_scatter_and_snapshots_stay_on_the_device(tiny_v41):
    g = tiny_v41.plan.graph
    host = KVCacheManager(g, num_blocks=8, max_seqs=2, block_size=8)
    dev = KVCacheManager(g, num_blocks=8, max_seqs=2, block_size=8, device="meta")
    assert host.device.type == "cpu"
    assert all(t.device.type == "meta" for t in [*dev.pools.values(), *dev.slots.values()])
    alloc = dev.admit(list(range(20)))
    dev.allocate(alloc, 20)
    dense = dev.gather(alloc.block_ids, alloc.slot, 16, 24, None)
    assert all(t.device.type == "meta" for t in dense.values())
    dev.scatter(alloc.block_ids, alloc.slot, dense, 16, 17)
    dev.publish(alloc, list(range(20)), 16)
    assert dev.snapshots and all(t.device.type == "meta" for s in dev.snapshots.values() for t in s.values())
    ha = host.admit(list(range(20)))
    host.allocate(ha, 20)
    host.publish(ha, list(range(20)), 16)
    assert dev.usage() == host.usage()


# ---------------------------------------------------------------------------------------------- engine decode


def _engine(model, runner_kw: dict | None, **kw):
    """An LLM on the tiny cpu plan; runner_kw given: its runner replaced by a CudaRunner on the CPU (the decode
    path through static slots; graph_backend=EmulatedGraphBackend() stands in for CUDA graphs)."""
    llm = LLM(plan=model.plan, params=model.params, tokenizer=None, max_model_len=16, overlap=False, **kw)
    if runner_kw is not None:
        llm.executor.runner = CudaRunner(model.plan.graph, model.params, device="cpu", max_model_len=16,
                                         **runner_kw)  # fmt: skip
    return llm


def _greedy(llm, prompts, n: int, record: list):
    import deepinfer.runtime.executor as ex_mod

    orig = ex_mod.sample_row

    def spy(row, params, seed, position, prompt, output):
        record.append((tuple(prompt), position, row.clone()))
        return orig(row, params, seed, position, prompt, output)

    ex_mod.sample_row = spy
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    finally:
        ex_mod.sample_row = orig
    return [o.token_ids for o in outs]


def _rows(record):
    return {(p, pos): row for p, pos, row in record}


PROMPTS = prompts_of_lengths([5, 3], seed=11)


SINGLE = {"batched_decode": False}  # the chained one-sequence steps (cuda_graphs.DecodeGraphs), not the default


@pytest.fixture(scope="module")
def eager_baseline(tiny_v41):
    """Greedy through the one-sequence decode path run eagerly (cuda_graphs=False): tokens and every sampled
    logits row. Each sequence's step runs alone, so its rows do not depend on the batch it was decoded in."""
    rec: list = []
    llm = _engine(tiny_v41, {"cuda_graphs": False, **SINGLE})
    tokens = _greedy(llm, PROMPTS, 3, rec)
    assert "decode graphs: off (cuda_graphs=False)" in llm.executor.runner.report()
    return tokens, _rows(rec)


def _agrees(rec, baseline) -> bool:
    rows = _rows(rec)
    return all(torch.equal(row, baseline[1][k]) for k, row in rows.items())


def test_decode_graphs_emulated_equal_eager_with_a_padded_bucket(tiny_v41, eager_baseline):
    """The one-sequence path: bucket 3's replay gives the bits of bucket 2's eager steps (a chain of T=1 steps:
    the padding slot changes nothing). The batched default's counterpart: test_batched_decode.py."""
    backend = cg.EmulatedGraphBackend()
    llm = _engine(tiny_v41, {"buckets": (1, 3), "graph_backend": backend, **SINGLE})  # 2 sequences: bucket 3
    rec: list = []
    assert _greedy(llm, PROMPTS, 3, rec) == eager_baseline[0]
    assert _rows(rec).keys() == eager_baseline[1].keys() and _agrees(rec, eager_baseline)
    dg = llm.executor.runner.graphs
    assert list(dg.graphs) == [3] and not dg.failed and not dg.blocked and dg.replays[3] == 1
    assert backend.captures == 1 and dg.padded[2] and not any(dg.padded[:2])
    report = llm.executor.runner.report()
    assert "decode graphs: on" in report and "bucket  3: captured" in report and "1 replays" in report, report
    # the decode path keeps the engine's bookkeeping: nothing leaks
    assert llm.kv.num_used_blocks == 0 and llm.kv.num_used_slots == 0


def test_a_capture_that_syncs_falls_back_to_eager_and_says_why(tiny_v41, eager_baseline, monkeypatch):
    """The one-sequence path's host-read check (the batched step writes its caches in place, without the op)."""
    monkeypatch.delitem(cg.SYNC_FREE_OPS, "scatter_rows")  # the op reference's boolean mask comes back
    llm = _engine(tiny_v41, {"buckets": (1, 2), "graph_backend": cg.EmulatedGraphBackend(), **SINGLE})
    rec: list = []
    assert _greedy(llm, PROMPTS[:1], 2, rec) == [eager_baseline[0][0][:2]] and _agrees(rec, eager_baseline)
    dg = llm.executor.runner.graphs
    assert dg.blocked and not dg.graphs and "boolean-mask indexing" in dg.blocked and "core.py" in dg.blocked
    assert "not captured (every bucket eager)" in llm.executor.runner.report()


@pytest.mark.parametrize("path", ["batched", "single"])
def test_capture_failure_marks_only_that_bucket(tiny_v41, eager_baseline, path, monkeypatch):
    """Both decode paths: a failed capture leaves that bucket eager with the reason. One sequence: the batched
    step (the default) at B = 1 gives the one-sequence steps' bits too."""
    from deepinfer.runtime.batched_decode import BatchedDecodeGraphs
    from deepinfer.runtime.cuda_executor import BATCHED_DECODE_ENV

    monkeypatch.delenv(BATCHED_DECODE_ENV, raising=False)  # the default

    class Flaky(cg.EmulatedGraphBackend):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    llm = _engine(tiny_v41, {"buckets": (1, 2), "graph_backend": Flaky(), **(SINGLE if path == "single" else {})})
    assert isinstance(llm.executor.runner.graphs, BatchedDecodeGraphs) == (path == "batched")
    rec: list = []
    assert _greedy(llm, PROMPTS[:1], 2, rec) == [eager_baseline[0][0][:2]] and _agrees(rec, eager_baseline)
    dg = llm.executor.runner.graphs
    assert dg.failed == {1: "capture failed: RuntimeError: operation not permitted when stream is capturing"}
    assert "bucket  1: eager -- capture failed" in llm.executor.runner.report()


# ---------------------------------------------------------------------------------------------- warm-up at start


def test_one_sequence_path_warm_up_captures_every_bucket_and_changes_no_result(tiny_v41, eager_baseline):
    """DecodeGraphs.warm_up: the bucket captured on padding slots before any request (its seconds in the line),
    without the kernels' first-call checks; the first real step runs eagerly (with them), the next replays, and the
    tokens and logits are the eager path's, bit for bit."""
    llm = _engine(tiny_v41, {"buckets": (1,), "graph_backend": cg.EmulatedGraphBackend(), **SINGLE})
    logged: list[str] = []
    line = llm.executor.runner.warm_up(log=logged.append)
    dg = llm.executor.runner.graphs
    assert logged == [line] and "buckets 1 captured (seconds per bucket 1: " in line, line
    assert list(dg.graphs) == list(dg.warm_s) == [1] and all(dg.padded)
    rec: list = []
    assert _greedy(llm, PROMPTS[:1], 3, rec) == eager_baseline[0][:1] and _agrees(rec, eager_baseline)
    assert dg.eager_steps == 1 and dg.replays[1] == 1, dg.report()  # the first real step eager: checks on real data
    assert "warmed up at start" in llm.executor.runner.report()
    assert dg.warm_up() == "decode graphs: nothing to warm up (every bucket captured or eager already)"


def test_engine_warms_up_at_start_where_its_graphs_are_cuda_graphs(tiny_v41, monkeypatch, capsys):
    """When LLM(...) warms its runner's decode graphs up (engine._warm_up_decode_graphs): by default on a CUDA
    device, not with DEEPINFER_GRAPH_WARMUP=0, nor on another device (the CPU's emulated graphs: tests); always
    with graph_warmup=True, never with False, nor with the KV pools on another device than the runner (the decode
    path unused); another value of the variable is an error naming it. Then a real one: LLM(graph_warmup=True) with
    a CudaRunner on the CPU captures its bucket at start and logs the line."""
    from types import SimpleNamespace
    from unittest import mock

    from deepinfer.errors import DeepInferError
    from deepinfer.runtime import engine
    from deepinfer.runtime.engine import EngineConfig

    def warms(device: str, kv_device: str | None = None, **config) -> bool:
        runner = SimpleNamespace(device=torch.device(device), warm_up=lambda: "warmed")
        dev = torch.device(kv_device or device)
        return engine._warm_up_decode_graphs(runner, dev, EngineConfig(**config)) == "warmed"

    monkeypatch.delenv(cg.GRAPH_WARMUP_ENV, raising=False)
    assert warms("cuda") and warms("cpu", graph_warmup=True)
    assert not warms("cpu") and not warms("cuda", graph_warmup=False) and not warms("cuda", kv_device="cpu")
    monkeypatch.setenv(cg.GRAPH_WARMUP_ENV, "0")
    assert not warms("cuda") and warms("cuda", graph_warmup=True)
    monkeypatch.setenv(cg.GRAPH_WARMUP_ENV, "yes")
    with pytest.raises(DeepInferError, match=f"{cg.GRAPH_WARMUP_ENV}='yes'"):
        warms("cuda")
    monkeypatch.delenv(cg.GRAPH_WARMUP_ENV)

    def runner(plan_, params_, config, max_model_len):
        return CudaRunner(plan_.graph, params_, device="cpu", max_model_len=max_model_len, buckets=(1,),
                          cuda_graphs=config.cuda_graphs, graph_backend=cg.EmulatedGraphBackend())  # fmt: skip

    with mock.patch.object(engine, "_runner", runner):
        llm = LLM(plan=tiny_v41.plan, params=tiny_v41.params, tokenizer=None, max_model_len=16, overlap=False,
                  graph_warmup=True)  # fmt: skip
    assert llm.graph_warmup.startswith("decode graphs warmed up in ") and "buckets 1 captured" in llm.graph_warmup
    assert llm.graph_warmup in capsys.readouterr().out and list(llm.executor.runner.graphs.graphs) == [1]
    assert CudaRunner(tiny_v41.plan.graph, tiny_v41.params, device="cpu", max_model_len=16, cuda_graphs=False,
                      buckets=(1,)).warm_up() is None  # fmt: skip


def test_disabled_since_counts_disabled_kernels_not_build_failures():
    """cuda_graphs.DisabledSince (what makes captured decode graphs stale): kernels disabled since the last look --
    not a kernel that failed to build (no graph ran it) -- and a swapped cache starts a new count."""
    from types import SimpleNamespace

    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.cuda_executor import KernelCache

    def no_build(key):
        raise RuntimeError("nvcc: error")

    ex = SimpleNamespace(kernels=KernelCache(builder=no_build))
    watch = cg.DisabledSince(ex)
    with pytest.raises(ka.Decline, match="build failed"):
        ex.kernels.get("k1")
    assert watch.new() == []
    ex.kernels.disable(["k2", "k3"], "mismatch vs reference at first call")
    assert watch.new() == ["k2", "k3"] and watch.new() == []
    ex.kernels = KernelCache()  # use_kernels
    ex.kernels.disable(["k4"], "raised RuntimeError")
    assert watch.new() == [] and watch.failed is ex.kernels.failed


def test_decode_warmup_script_workload_enters_every_bucket(capsys):
    """benchmarks/decode_warmup.py (the H200 check of the warm-up): its workload's decode batch shrinks 16 -> 1, each
    size for --steps-per-size steps, so every bucket is entered once and then replayed; --dry-run compiles the tiny
    V4.1 for sm90 and prints that workload."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_warmup.py"
    spec = importlib.util.spec_from_file_location("decode_warmup_for_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prompts, max_tokens = mod.workload(3, vocab=500)
    assert len(prompts) == max(cg.BUCKETS) and all(3 <= len(p) < 16 for p in prompts)
    sizes = mod.decode_sizes(max_tokens)
    assert sizes == [n for n in range(16, 0, -1) for _ in range(3)]
    assert {mod.bucket_of(n) for n in sizes} == set(cg.BUCKETS)
    assert mod.main(["--dry-run"]) == 0
    assert "48 decode steps, bucket 16: 24 steps (batch 16..9)" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- GPU (H200)


@pytest.fixture(scope="module")
def gpu_kernels():
    from deepinfer.runtime.cuda_executor import KernelCache

    return KernelCache()  # one cache for every engine below: same shapes, each kernel built once


def _gpu_llm(plan, params, kernels, **kw):
    """An sm90 engine on the shared kernel cache, warmed up as at the engine's start (graph_warmup=None on a GPU)
    but after use_kernels -- at construction it would build every decode kernel in its own cache first."""
    llm = LLM(plan=plan, target="sm90", params=params, tokenizer=None, max_model_len=64, max_num_seqs=8,
              overlap=False, graph_warmup=False, **kw)  # fmt: skip
    llm.executor.runner.use_kernels(kernels)
    if kw.get("kv_cache_device") != "cpu":  # host pools: every item through forward, the decode graphs unused
        llm.executor.runner.warm_up()  # None (nothing) where graphs are off
    return llm


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["batched", "single"])
def test_gpu_decode_graphs_on_off_and_host_caches_agree(sm90_tiny, gpu_kernels, path):
    """Five sequences, 8 greedy tokens, KV pools on the GPU with decode graphs on and off, and on the host (no
    decode path: every item through forward, one sequence at a time). Graphs on == off bit for bit on both decode
    paths (same buckets, same kernels); == host bit for bit on the one-sequence path only: the batched step (the
    default) runs its GEMMs at M = B, and at T > 1 a kernel that T = 1 declines (tiny's MoE experts), so its
    numbers are the host's only to the kernels' formats (test_batched_decode.py checks them)."""
    plan, params = sm90_tiny
    prompts = prompts_of_lengths([5, 9, 3, 12, 7], seed=2, vocab=120000)
    path_kw = {"batched_decode": path == "batched"}
    runs = {}
    for name, kw in (("graphs", {}), ("eager", {"cuda_graphs": False}), ("host", {"kv_cache_device": "cpu"})):
        llm = _gpu_llm(plan, params, gpu_kernels, **kw, **path_kw)
        rec: list = []
        runs[name] = (_greedy(llm, prompts, 8, rec), _rows(rec), llm)
    tokens, rows, llm = runs["graphs"]
    assert all(len(t) == 8 for t in runs["host"][0])
    for other in ("eager", "host") if path == "single" else ("eager",):
        assert runs[other][0] == tokens, other
        assert rows.keys() == runs[other][1].keys()
        assert all(torch.equal(rows[k], runs[other][1][k]) for k in rows), other
    dg = llm.executor.runner.graphs
    report = llm.executor.runner.report()
    assert dg.graphs and not dg.failed and not dg.blocked, report
    assert sum(dg.replays.values()) > 0 and "replays" in report, report
    assert llm.kv.device.type == "cuda" and runs["host"][2].kv.device.type == "cpu"
    assert all(t.device.type == "cuda" for t in llm.kv.pools.values())


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["batched", "single"])
def test_gpu_decode_graph_replay_matches_eager_at_every_bucket(sm90_tiny, gpu_kernels, path):
    """Batches of 1, 2, 3 and 8 sequences (buckets 1, 2, 4 with a padding slot, 8), on both decode paths: every
    step's logits equal the eager ones bit for bit (the same bucket's step, replayed or not) -- the graphs here
    were all captured by the engine's warm-up, on padding rows, so the first real step is a replay too."""
    plan, params = sm90_tiny
    kw = {"batched_decode": path == "batched"}
    graphs = _gpu_llm(plan, params, gpu_kernels, **kw)
    eager = _gpu_llm(plan, params, gpu_kernels, cuda_graphs=False, **kw)
    for n in (1, 2, 3, 8):
        prompts = prompts_of_lengths([3 + i for i in range(n)], seed=n, vocab=120000)
        got, want = [], []
        _greedy(graphs, prompts, 4, got)
        _greedy(eager, prompts, 4, want)
        a, b = _rows(got), _rows(want)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), n
    dg = graphs.executor.runner.graphs  # every bucket captured at the engine's start (warm-up), before any request
    assert sorted(dg.graphs) == sorted(dg.warm_s) == list(cg.BUCKETS) and not dg.failed, graphs.executor.runner.report()


def test_buckets_and_padding_choice():
    assert [next(b for b in cg.BUCKETS if b >= n) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
