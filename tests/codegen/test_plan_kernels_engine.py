"""sm90 plan kernels are the engine's (codegen/plan_kernels.engine_kernel_keys): the keys `deepinfer compile`
derives from shapes alone (each adapter's keys() on meta tensors) equal the keys the runtime looks up when it
runs the graph on real tensors (GraphExecutor.kernel_keys on CPU with the emulated kernels), one-sequence and
batched; every family the compile does not build is listed with a reason that holds; a spec builds through the
runtime's own factory. No GPU, no nvcc: nothing is built here (tests/codegen/test_plan_kernels.py builds)."""

import pytest
import torch

from deepinfer.codegen import plan_kernels as pk
from deepinfer.runtime import kernel_adapters as ka
from deepinfer.runtime.cuda_executor import GraphExecutor, KernelCache
from deepinfer.runtime.session import allocate_caches

MAX_LEN = 96  # the engine's max_model_len in these tests: caches, rope tables and top-k columns follow it
MODELS = ["deepseek-v4.1-flash:tiny", "deepseek-v4-flash:tiny"]
# family.op the tiny presets' plans bind but the compile builds nothing for, and why (checked below to hold)
TRITON_OPS = {"act_quant.dequant_fp8", "act_quant.fake_quant_fp8", "cache_rows.scatter_rows", "linear_bf16.linear",
              "compressor.pair_compressor_keys", "compressor.compressor_keys",
              "compressor.batched_pair_compressor_keys", "indexer_topk.index_scores",
              "indexer_topk.batched_index_scores", "candidate_blocks.candidate_blocks", "engram_hash.engram_hash",
              "engram_hash.batched_engram_hash"}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """kernel_specs caches the derived keys in the codegen cache: this module's own, fresh."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DEEPINFER_CODEGEN_CACHE", str(tmp_path_factory.mktemp("codegen")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def plans():
    """(plan, params) per preset: compiled for sm90 (no kernels built), seeded weights, experts restacked as the
    CUDA runner lays them out."""
    from deepinfer.compiler import compile_model
    from deepinfer.runtime.cuda_executor import restack_experts
    from deepinfer.runtime.plan import bind_weights

    out = {}
    for name in MODELS:
        plan = compile_model(name, "sm90").plan
        params, _ = bind_weights(plan)
        restack_experts(plan.graph, params)
        out[name] = plan, params
    return out


@pytest.fixture(scope="module")
def specs(plans):
    """kernel_specs (bound) of each preset at MAX_LEN: (specs, {family.op: why not built})."""
    return {name: pk.kernel_specs(plan.graph, "sm90", max_model_len=MAX_LEN) for name, (plan, _) in plans.items()}


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)


def _runtime_keys_one_sequence(plan, params, t: int) -> set:
    """What the runtime asks for: CudaRunner's executor (the graph with logit_rows, the head on the last row as a
    prefill samples it) running t real tokens with caches of MAX_LEN."""
    from deepinfer.passes.select_logit_rows import ROWS_INPUT, rows_graph

    g, _ = rows_graph(plan.graph)
    ex = GraphExecutor(g, params, kernels=KernelCache(builder=ka.emulated_kernel), sync_free=True,
                       max_positions=MAX_LEN)  # fmt: skip
    feeds = {"tokens": torch.arange(3, 3 + t), "positions": torch.arange(t), ROWS_INPUT: torch.tensor([t - 1]),
             **allocate_caches(g, MAX_LEN)}  # fmt: skip
    return set(ex.kernel_keys(feeds))


def _runtime_keys_batched(plan, params, b: int) -> set:
    from deepinfer.runtime.batched_decode import BatchedDecoder

    dec = BatchedDecoder(plan.graph, params, "cpu", max_model_len=MAX_LEN, kernels=KernelCache(ka.emulated_kernel))
    feeds = dec.feeds(list(range(5, 5 + b)), [7 + 3 * i for i in range(b)], dec.allocate(b))
    return set(dec.exec.kernel_keys(feeds))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("t", [1, 5, 64])  # decode, a prompt, the small bucket
def test_compile_keys_equal_the_runtime_keys_one_sequence(plans, emulate, model, t):
    plan, params = plans[model]
    want = _runtime_keys_one_sequence(plan, params, t)
    got, why = pk.engine_kernel_keys(plan.graph, [t], max_model_len=MAX_LEN)
    assert want, "the runtime asks for no kernel: the comparison would be empty"
    assert set(got) == want, (sorted(k.describe() for k in set(got) ^ want), why)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("b", [1, 4])
def test_compile_keys_equal_the_runtime_keys_batched_decode(plans, emulate, model, b):
    plan, params = plans[model]
    want = _runtime_keys_batched(plan, params, b)
    got, why = pk.engine_kernel_keys(plan.graph, [], max_model_len=MAX_LEN, batch_sizes=[b])
    assert want and set(got) == want, (sorted(k.describe() for k in set(got) ^ want), why)


def test_the_families_session_7_left_to_the_runtime_are_derived(plans, specs):
    """topk_select, engram, rope, moe_routing and hc_post_pre_collapse were 'not derived at compile time yet'."""
    plan, _ = plans["deepseek-v4.1-flash:tiny"]
    specs, _ = specs["deepseek-v4.1-flash:tiny"]
    fams = {(s.family, s.program) for s in specs}
    for want in [("topk_select", "program"), ("engram", "embed_program"), ("engram", "gate_program"),
                 ("rope", "program"), ("moe_routing", "program"), ("hyper_connection", "pre_program")]:  # fmt: skip
        assert want in fams, (want, sorted(fams))
    assert all(s.source == "adapter" and s.key is not None for s in specs)
    # the one-level top-k's columns follow the engine's caches (max_model_len), not a step's length (a two-level
    # top-k adds its gathered candidate columns: blocks x block)
    cols = {s.args[1] for s in specs if s.family == "topk_select"}
    assert cols >= {ka.topk_cols(c) for c in _topk_columns(plan.graph, MAX_LEN)}, cols


def _topk_columns(g, max_len: int) -> set:
    """The top-k's score columns in the engine: one per row of an indexer's key cache, sized by max_len."""
    from deepinfer.runtime.session import cache_symbols

    env = cache_symbols(g, max_len)
    return {env[e["shape"][0]] for e in g.meta["caches"] if e["kind"] == "index_keys"}


@pytest.mark.parametrize("model", MODELS)
def test_every_family_not_built_has_a_reason_that_holds(plans, specs, emulate, model):
    """Not built: a Triton family (its adapter asks for no TileLang kernel on real tensors either), an adapter
    that declines the tiny dims (the runtime then declines too: the node runs its reference), or prefill keys
    that read device data (the tiny V4.1 MoE's tile count at T=4096, read back from the device)."""
    plan, params = plans[model]
    _, why = specs[model]
    assert why, "the tiny plans bind Triton families: they must be listed"
    for where, reason in why.items():
        fam_op = where.split(" at T=")[0]
        if reason == pk.TRITON_REASON:
            assert fam_op in TRITON_OPS, where
        elif reason.startswith("the adapter declines"):
            assert fam_op in {"fp8_gemm.grouped_out_proj", "moe_grouped_gemm.moe_grouped_experts"}, where
        else:
            assert where == "moe_grouped_gemm.moe_grouped_experts at T=4096" and "device data" in reason, where
    # the Triton ones ask for no key on real CPU tensors either (same adapters, same decision)
    seen = {k.family for k in _runtime_keys_one_sequence(plan, params, 1)}
    assert not seen & {"act_quant", "cache_rows", "linear_bf16", "indexer_topk", "compressor", "candidate_blocks",
                       "engram_hash"}, seen  # fmt: skip


def test_a_spec_is_the_runtime_key_and_builds_through_its_factory(specs, monkeypatch):
    """spec_of_key keeps everything the key says (config = its cfg fields), and _make_program hands the key to
    the runtime's _factory: the program `deepinfer compile` lowers is the one the adapter's KernelCache builds."""
    specs, _ = specs["deepseek-v4.1-flash:tiny"]
    for s in specs:
        kw = dict(s.kwargs, **({"cfg": tuple(sorted(s.config.items()))} if s.config else {}))
        assert ka.KernelKey(s.family, s.program, s.args, tuple(sorted(kw.items()))) == s.key, s.name
    built = []
    monkeypatch.setattr(ka, "_factory", lambda key, target="sm90": built.append((key, target)) or "program")
    assert pk._make_program(specs[0], "sm90") == "program" and built == [(specs[0].key, "sm90")]


def test_all_mode_adds_lengths_under_the_plan_bindings(plans, specs):
    plan, _ = plans["deepseek-v4.1-flash:tiny"]
    bound, _ = specs["deepseek-v4.1-flash:tiny"]
    every, _ = pk.kernel_specs(plan.graph, "sm90", "all", max_model_len=MAX_LEN)
    assert {s.ident() for s in bound} < {s.ident() for s in every}


def test_derived_keys_are_cached_and_a_changed_graph_or_switch_misses(plans, specs, monkeypatch):
    """A warm compile reads the derived keys back (same specs, nodes and reasons, keys equal to the runtime's
    KernelKeys after the JSON round trip); another graph, max_model_len or adapter switch derives them again."""
    import copy

    plan, _ = plans["deepseek-v4.1-flash:tiny"]
    # the sources are part of the cache key; other engineers edit this checkout while the test runs: frozen here
    monkeypatch.setattr(pk, "_key_sources_digest", lambda: b"frozen for the test")
    first, why = pk.kernel_specs(plan.graph, "sm90", max_model_len=MAX_LEN)
    derived = []
    real = pk.engine_kernel_keys
    monkeypatch.setattr(pk, "engine_kernel_keys", lambda *a, **k: derived.append(1) or real(*a, **k))
    again, why2 = pk.kernel_specs(plan.graph, "sm90", max_model_len=MAX_LEN)
    assert not derived, "the second derivation of the same graph must come from the cache"
    assert [(s.ident(), s.key, s.nodes) for s in again] == [(s.ident(), s.key, s.nodes) for s in first]
    assert why2 == why
    pk.kernel_specs(plan.graph, "sm90", max_model_len=2 * MAX_LEN)
    assert len(derived) == 1
    changed = copy.deepcopy(plan.graph)
    node = next(n for n in changed.nodes if n.op == "rmsnorm")
    node.attrs = {**node.attrs, "eps": node.attrs["eps"] * 2}
    pk.kernel_specs(changed, "sm90", max_model_len=MAX_LEN)
    assert len(derived) == 2
    monkeypatch.setenv(ka.DENSE_SWAB_ENV, "0")
    pk.kernel_specs(plan.graph, "sm90", max_model_len=MAX_LEN)
    assert len(derived) == 3
    monkeypatch.delenv(ka.DENSE_SWAB_ENV)
    monkeypatch.setattr(pk, "_key_sources_digest", lambda: b"an edited adapter")
    pk.kernel_specs(plan.graph, "sm90", max_model_len=MAX_LEN)
    assert len(derived) == 4, "a changed source must derive the keys again"


def test_compile_keys_equal_the_runtime_keys_batched_decode_with_attention_kernels(emulate):
    """The V4.1 small preset's batched step runs the sparse attention kernel (the tiny presets' dims decline it): its
    key's pool rows follow the graph BatchedDecoder runs (decode_graph: the windows read from the written rings, flat
    or compact pools), which is what the compile must derive from too."""
    from deepinfer.compiler import compile_model
    from deepinfer.runtime.cuda_executor import restack_experts
    from deepinfer.runtime.plan import bind_weights

    plan = compile_model("deepseek-v4.1-flash:small", "sm90").plan
    params, _ = bind_weights(plan)
    restack_experts(plan.graph, params)
    want = _runtime_keys_batched(plan, params, 2)
    assert any(k.family == "sparse_attn_decode" for k in want), sorted(k.describe() for k in want)
    got, why = pk.engine_kernel_keys(plan.graph, [], max_model_len=MAX_LEN, batch_sizes=[2])
    assert set(got) == want, (sorted(k.describe() for k in set(got) ^ want), why)


def test_graph_digest_sees_params_and_nodes_not_bulk_meta(plans):
    """The derived-key cache's graph digest: a parameter's shape or dtype, a node attribute change it; the bulk meta
    no adapter reads (param_conversions, memory) does not."""
    import copy

    from deepinfer.ir import dtypes as dt

    plan, _ = plans["deepseek-v4.1-flash:tiny"]
    base = pk._graph_digest(plan.graph)
    g = copy.deepcopy(plan.graph)
    g.meta["memory"] = {"changed": True}
    assert pk._graph_digest(g) == base
    p = g.params[-1]
    p.type = p.type.with_dtype(dt.bf16 if p.dtype != dt.bf16 else dt.f32)
    assert pk._graph_digest(g) != base
    g = copy.deepcopy(plan.graph)
    node = next(n for n in g.nodes if n.op == "rmsnorm")
    node.attrs = {**node.attrs, "eps": node.attrs["eps"] * 2}
    assert pk._graph_digest(g) != base
