"""Caches stored in bf16 (passes/cache_storage.py) through the runtime: the attention adapter on bf16 pools gives the
outputs of the same pools in f32 bit for bit (the kernel rounds its pools to bf16 either way; CPU stand-ins of the
kernels and the ws program on TileLang's `c` target), the small V4.1 sm90 plan runs a prefill and a decode step with
bf16 caches to the f32-cache plan's logits exactly (its caches: the f32 ones rounded), and the engine's KV cache
holds half the bytes for the rings and compressed rows."""

from __future__ import annotations

import pytest
import torch

from deepinfer.passes.cache_storage import ENV
from deepinfer.runtime import kernel_adapters as ka

from .test_attention_adapter import attn_args, fused_call, run, sparse_call


def as_bf16_pools(args):
    """The same operands with the two KV pools stored in bf16 (what the attention sees from bf16 caches)."""
    q, sink, win_kv, win_idx, cmp_kv, cmp_idx = args
    return q, sink, win_kv.to(torch.bfloat16), win_idx, cmp_kv.to(torch.bfloat16), cmp_idx


@pytest.fixture
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)


@pytest.mark.parametrize("num_split", [1, 4])
def test_bf16_pools_give_the_f32_pools_outputs_exactly(_emulate, num_split):
    args = attn_args(3, 4, 32, 40, 70, 32, 96, seed=4)
    cfg = {"block_n": 32, "num_split": num_split, "stages": 2}
    assert torch.equal(run(sparse_call(as_bf16_pools(args), cfg))[0], run(sparse_call(args, cfg))[0])
    codes, scales = run(fused_call(as_bf16_pools(args), cfg))  # the FP8 epilogue: every code the same
    want_codes, want_scales = run(fused_call(args, cfg))
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))


def test_ws_program_on_bf16_pools_on_the_c_target(_emulate):
    """The ws program's CPU mirror (H 64, D 128; a compressed pool larger than the selection: the CPU mirror is built
    for the selected rows, so the adapter still selects them) on bf16 pools == on f32 pools."""
    pytest.importorskip("tilelang")
    args = attn_args(2, 64, 128, 50, 200, 36, 92, seed=5)
    cfg = {"block_n": 32, "threads": 384, "num_split": 1, "stages": 2, "ws": True}
    got = run(sparse_call(as_bf16_pools(args), cfg), ka.c_target_kernel)[0]
    assert torch.equal(got, run(sparse_call(args, cfg), ka.c_target_kernel)[0])


def test_selected_rows_of_a_bf16_pool_on_the_cpu_are_the_rows_selected():
    """Off CUDA (the c-target mirror's pool size is the key's) a bf16 pool is still narrowed to the selected rows --
    the same rows the f32 pool gives, without a conversion."""
    g = torch.Generator().manual_seed(6)
    kv = torch.randn(50, 16, generator=g)
    idx = torch.tensor([[3, 7, -1], [49, 0, 3]])
    rows, sel = ka._selected_rows(kv.to(torch.bfloat16), idx)
    want_rows, want_sel = ka._selected_rows(kv, idx)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, want_rows) and torch.equal(sel, want_sel)


@pytest.mark.gpu
def test_gpu_selected_rows_reads_a_bf16_cache_in_place():
    """On the GPU (the ws program's pool size is symbolic) a bf16 pool goes to the kernel as it is: no copy."""
    kv = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, 4096, (4, 64), device="cuda")
    rows, sel = ka._selected_rows(kv, idx)
    assert rows.data_ptr() == kv.data_ptr() and sel is idx
    assert ka._bf16_pool(kv).data_ptr() == kv.data_ptr()


def _decode_operands(device: str, b: int = 4, w: int = 128, c: int = 1024, k: int = 512):
    """A batched decode step's attention operands at V4.1's dims (H 64, D 512): q, sink, the window pool
    concat(rings, new rows) with its ids, and the compressed rows both ways -- the flat pool with flat ids and the
    compact pool batch_decode gathers (f32, seeded)."""
    from deepinfer.ir.registry import get_op

    gen = torch.Generator().manual_seed(8)
    pos = torch.tensor([w + 3, 2 * w + 7, 40, 3 * w][:b])
    q, sink = torch.randn(b, 64, 512, generator=gen), torch.randn(64, generator=gen)
    win = torch.randn(b * w + b, 512, generator=gen)
    flat = torch.randn(b * c, 512, generator=gen)
    ids = torch.stack([torch.randperm(c, generator=gen)[:k] for _ in range(b)])
    ids[:, -37:] = -1
    rows = get_op("batched_rows").run([ids, flat], {})[0]
    win_idx = get_op("batched_window_indices").run([pos], {"window": w})[0]
    compact = get_op("batched_gather_rows").run([flat, rows], {})
    return [x.to(device) for x in (q, sink, win, win_idx, flat, rows, *compact)]


@pytest.mark.gpu
def test_gpu_kernel_on_bf16_flat_pools_equals_f32_compact_pools():
    """The H200 kernels (the ws program, split + combine at B 4) on the batched step's bf16 pools read in place (the
    flat compressed pool, no gather, no conversion) give the f32 compact pools' output bit for bit."""
    import functools

    q, sink, win, win_idx, flat, rows, cmp, cmp_ids = _decode_operands("cuda")
    before = sparse_call((q, sink, win, win_idx, cmp, cmp_ids))
    after = sparse_call((q, sink, win.to(torch.bfloat16), win_idx, flat.to(torch.bfloat16), rows))
    build = functools.cache(ka.build_kernel)
    assert torch.equal(run(after, build)[0], run(before, build)[0])


# ---------------------------------------------------------------------------------------------- the small plan


@pytest.fixture(scope="module")
def small_plans():
    """The small V4.1 sm90 plan with bf16 caches (the default) and with f32 caches (the pass off), one weight set."""
    import os

    from deepinfer.compiler import compile_model
    from deepinfer.runtime.cuda_executor import restack_experts
    from deepinfer.runtime.plan import bind_weights

    plans = {}
    for on in ("1", "0"):
        os.environ[ENV] = on
        try:
            plans[on] = compile_model("deepseek-v4.1-flash:small", "sm90").plan
        finally:
            os.environ.pop(ENV)
    params, _ = bind_weights(plans["1"])
    restack_experts(plans["1"].graph, params)
    return plans["1"].graph, plans["0"].graph, params


def _steps(g, params, prompt: list[int], max_len: int) -> tuple[list[torch.Tensor], dict]:
    """A prefill of the prompt then one decode step through the executor with the kernels' CPU stand-ins: (logits of
    both calls, the caches after them)."""
    from deepinfer.runtime.cuda_executor import GraphExecutor, KernelCache
    from deepinfer.runtime.session import allocate_caches

    names = [e["name"] for e in g.meta["caches"]]
    ex = GraphExecutor(g, params, kernels=KernelCache(builder=ka.emulated_kernel))
    caches = allocate_caches(g, max_len)
    logits = []
    for tokens, start in ((prompt, 0), ([11], len(prompt))):
        outs = ex.run({"tokens": torch.tensor(tokens), "positions": torch.arange(start, start + len(tokens)), **caches})
        logits.append(outs[0])
        caches = dict(zip(names, outs[1:]))
    assert ex.stats.compiled["sparse_attn_decode"] > 0 and not ex.kernels.failed, ex.report()
    return logits, caches


def test_small_plan_with_bf16_caches_computes_the_f32_cache_plans_logits(small_plans, _emulate):
    bf16_g, f32_g, params = small_plans
    torch.set_num_threads(1)
    got, got_caches = _steps(bf16_g, params, [3, 5, 7, 11, 13, 2, 9], 12)
    want, want_caches = _steps(f32_g, params, [3, 5, 7, 11, 13, 2, 9], 12)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    stored = {e["name"]: e["dtype"] for e in bf16_g.meta["caches"]}
    assert "bf16" in stored.values()
    for name, dtype in stored.items():  # a bf16 cache holds the f32 cache's values rounded, the others the same
        want_c = want_caches[name].to(torch.bfloat16) if dtype == "bf16" else want_caches[name]
        assert got_caches[name].dtype == want_c.dtype and torch.equal(got_caches[name], want_c), name


def test_engine_kv_cache_holds_half_the_ring_and_compressed_bytes(small_plans):
    from deepinfer.runtime.kv_cache import KVCacheManager

    bf16_g, f32_g, _ = small_plans
    usage = {k: KVCacheManager(g, num_blocks=8, max_seqs=2).usage() for k, g in (("bf16", bf16_g), ("f32", f32_g))}
    for kind in ("window", "compressed"):
        assert 2 * usage["bf16"][kind]["bytes_total"] == usage["f32"][kind]["bytes_total"] > 0
    for kind in ("index_keys", "compressor_state", "engram_history"):
        assert usage["bf16"][kind] == usage["f32"][kind]


# ---------------------------------------------------------------------------------------------- batched decode


def _batched_step(g, params, caches: dict, *, ring_first: bool) -> tuple[torch.Tensor, dict]:
    """One batched decode step (kernels' CPU stand-ins) from copies of ``caches``: (logits, new caches)."""
    from deepinfer.runtime.batched_decode import BatchedDecoder
    from deepinfer.runtime.cuda_executor import KernelCache

    dec = BatchedDecoder(g, params, "cpu", max_model_len=12, ring_first=ring_first,
                         kernels=KernelCache(builder=ka.emulated_kernel))  # fmt: skip
    logits, new = dec.step([3, 9, 4], [7, 4, 11], {k: v.clone() for k, v in caches.items()})
    assert dec.exec.stats.compiled["sparse_attn_decode"] > 0 and not dec.exec.kernels.failed, dec.report()
    return logits, new


def _random_caches(g, n: int) -> dict:
    """[n, *shape] caches of random values (f32; the engram history at its initial -1)."""
    from deepinfer.runtime.session import allocate_caches

    gen = torch.Generator().manual_seed(7)
    one = allocate_caches(g, 12)
    return {k: (torch.randn(n, *v.shape, generator=gen) if v.is_floating_point() else v.expand(n, *v.shape).clone())
            for k, v in one.items()}  # fmt: skip


def test_batched_step_on_bf16_caches_and_from_the_written_rings(small_plans, _emulate):
    """The batched decode step: bf16 caches give the f32 caches' logits bit for bit (caches holding the same values,
    rounded), and reading each window from the ring as the step writes it (read_rings_after_write: no concat of the
    rings) gives the concat's logits and caches bit for bit."""
    from deepinfer.runtime.batched_decode import decode_graph

    bf16_g, f32_g, params = small_plans
    torch.set_num_threads(1)
    f32 = _random_caches(f32_g, 3)
    stored = {e["name"]: e["dtype"] for e in bf16_g.meta["caches"]}
    bf16 = {k: v.to(torch.bfloat16) if stored[k] == "bf16" else v for k, v in f32.items()}
    want, want_caches = _batched_step(f32_g, params, f32, ring_first=False)
    got, got_caches = _batched_step(bf16_g, params, bf16, ring_first=True)
    assert torch.equal(got, want)
    for name, dtype in stored.items():
        rounded = want_caches[name].to(torch.bfloat16) if dtype == "bf16" else want_caches[name]
        assert torch.equal(got_caches[name], rounded), name
    ring_first = decode_graph(bf16_g, ring_first=True)
    concats = [n for n in ring_first.nodes if n.op == "concat"]
    assert len(concats) == 1 and concats[0].attrs["axis"] == 1  # the shared window ids; no window pool
    attn = [n for n in ring_first.nodes if n.op == "fused_attention"]
    assert attn and all(n.inputs[3].producer.op == "scatter_rows" for n in attn)


# ---------------------------------------------------------------------------------------------- the engine


def test_engine_on_bf16_caches_generates_the_f32_engines_rows(small_plans, _emulate):
    """The whole engine (paged KV cache, prefix reuse with state snapshots, the batched decode graphs with emulated
    CUDA graphs, kernels' CPU stand-ins) on the bf16-cache plan against the f32-cache plan: the same greedy tokens
    and every sampled logits row bit for bit; the second request reuses the first one's prefix blocks (bf16 pools
    and snapshots) and everything is released at the end. Also the one-sequence decode path (batched_decode=False:
    cuda_graphs.DecodeGraphs' static bf16 slots): one request at a time, the batched step's bits at B = 1."""
    from unittest import mock

    from deepinfer.runtime import cuda_graphs as cg
    from deepinfer.runtime import engine
    from deepinfer.runtime.cuda_executor import CudaRunner, KernelCache

    from .test_batched_decode import _greedy_rows, _stand_in

    bf16_g, f32_g, params = small_plans
    torch.set_num_threads(1)
    shared = [5, 17, 300, 42, 9000, 12, 77, 5, 6, 7, 1000, 2, 100, 101, 102, 103]  # one 16-token block
    prompts = [shared + [7, 8], shared + [9]]
    out = {}
    for name, g, batched in (("bf16", bf16_g, True), ("f32", f32_g, True), ("bf16 one-sequence", bf16_g, False)):

        def runner(plan_, params_, config, max_model_len, g=g, batched=batched):
            return CudaRunner(g, params, device="cpu", kernels=KernelCache(builder=_stand_in), buckets=(1, 2),
                              max_model_len=max_model_len, graph_backend=cg.EmulatedGraphBackend(),
                              batched_decode=batched)  # fmt: skip

        plan = mock.Mock(graph=g, config={}, target="sm90")
        with mock.patch.object(engine, "_runner", runner), mock.patch.object(engine, "_resolve_plan", lambda *a: a[2]):
            llm = engine.LLM(plan=plan, target="sm90", params=params, tokenizer=None, max_model_len=32,
                             max_num_seqs=4, overlap=False)  # fmt: skip
            first = _greedy_rows(llm, prompts[:1], 3)
            reused, admit = [], llm.kv.admit
            llm.kv.admit = lambda ids, admit=admit, reused=reused: reused.append(admit(ids)) or reused[-1]
            second = _greedy_rows(llm, prompts[1:], 3)
        pools = {k: v.dtype for k, v in llm.kv.pools.items()}
        out[name] = (first, second, pools, llm.kv.num_used_blocks, [a.num_reused_tokens for a in reused])
    want1, want2, want_pools, _, _ = out["f32"]
    for name in ("bf16", "bf16 one-sequence"):
        got1, got2, pools, used, hits = out[name]
        for got, want in ((got1, want1), (got2, want2)):
            assert got[0] == want[0] and got[1].keys() == want[1].keys(), name
            assert all(torch.equal(got[1][k], want[1][k]) for k in want[1]), name
        assert torch.bfloat16 in pools.values() and used == 0 and hits == [16], name
    assert torch.bfloat16 not in want_pools.values()


def test_flat_pools_where_the_ws_program_reads_bf16_caches(small_plans):
    """pools_read_in_place: at V4.1's real dims (a one-layer slice: H 64, D 512, the ws program) with bf16 caches the
    decoder keeps the flat compressed pools (no gather); with f32 caches (the pass off) or the small preset's H 8
    (the portable program: its pool size is the key's) it gathers them."""
    import importlib.util
    import os
    from pathlib import Path

    from deepinfer.runtime.batched_decode import decode_graph, pools_read_in_place

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_slice.py"
    spec = importlib.util.spec_from_file_location("bench_slice_for_cache_tests", path)
    bs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bs)
    real = bs.slice_graph((2,), "fp8", "real")
    os.environ[ENV] = "0"
    try:
        real_f32 = bs.slice_graph((2,), "fp8", "real")
    finally:
        os.environ.pop(ENV)
    bf16_small, f32_small, _ = small_plans
    assert pools_read_in_place(real) and not pools_read_in_place(real_f32)
    assert not pools_read_in_place(bf16_small) and not pools_read_in_place(f32_small)
    assert "batched_gather_rows" not in decode_graph(real).op_counts()
    assert "batched_gather_rows" in decode_graph(real_f32).op_counts()
