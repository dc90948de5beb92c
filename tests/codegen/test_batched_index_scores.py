"""indexer_topk.triton_batched_scores: `batched_index_scores` (B sequences, query b against its own C keys, rows
b*C.. of a [B*C, di] pool) on the f32 scores kernel. Oracles: a float64 loop over the sequences and heads
(independent of the op's bmm), and the op's torch reference; the causal mask exactly (-inf where j >= (p_b+1)//ratio,
finite elsewhere). The one-sequence kernel (shared keys) is checked to give the same bits as before at the row
where both apply. CPU: the Triton interpreter and sm_90a builds; gpu: the compiled kernel at the bench's shape."""

import pytest
import torch

from deepinfer.codegen.kernels import indexer_topk as it
from deepinfer.ir.ops.batched import BatchedIndexScores
from tests.codegen._triton_aot import compile_sm90, spill_free
from tests.codegen.test_indexer_scores_f32 import _check
from tests.codegen.test_indexer_scores_f32 import _oracle_f64 as one_sequence_oracle

SCALE = 128**-0.5


def _inputs(b: int, c: int, positions: list[int], seed: int, h: int = 32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 128, generator=g)
    w = torch.randn(b, h, generator=g) * h**-0.5
    keys = torch.randn(b * c, 128, generator=g)
    pos = torch.tensor(positions, dtype=torch.long)
    return q.to(device), w.to(device), keys.to(device), pos.to(device)


def _oracle_f64(q, w, keys, pos, ratio: int, scale: float) -> torch.Tensor:
    """Per sequence: the one-sequence float64 oracle on that sequence's own key rows."""
    b = q.shape[0]
    c = keys.shape[0] // b
    rows = [one_sequence_oracle(q[s : s + 1], w[s : s + 1], keys[s * c : (s + 1) * c], pos[s : s + 1], ratio, scale)
            for s in range(b)]  # fmt: skip
    return torch.cat(rows)


def _op_reference(q, w, keys, pos, ratio, scale):
    return BatchedIndexScores.reference(q, w, keys, pos, ratio=ratio, scale=scale)


# per-sequence positions: some see none of their keys, some all, some a partial block; C not a multiple of block_c
@pytest.mark.parametrize("b,c,positions,ratio,block_c", [
    (3, 150, [0, 149, 93], 1, 64),
    (4, 70, [139, 2, 40, 1], 2, 64),
    (2, 300, [299, 128], 1, 128),  # the prefill tile select_kernels may hand over
])  # fmt: skip
def test_interpreter_matches_f64_and_the_op(interpret, b, c, positions, ratio, block_c):
    q, w, keys, pos = _inputs(b, c, positions, seed=b * c)
    cfg = it.F32ScoresConfig(block_c=block_c, warps=8 if block_c == 128 else 4)
    s = it.triton_batched_scores(q, w, keys, pos, ratio=ratio, scale=SCALE, cfg=cfg)
    assert s.shape == (b, c)
    _check(s, _oracle_f64(q, w, keys, pos, ratio, SCALE), 1e-6)
    _check(s, _op_reference(q, w, keys, pos, ratio, SCALE), 1e-6)


def test_each_sequence_reads_only_its_own_keys(interpret):
    """Sequence 1's keys replaced: only row 1 changes (an offset error -- shared or neighbouring keys -- fails)."""
    q, w, keys, pos = _inputs(3, 64, [63, 63, 63], seed=7)
    s = it.triton_batched_scores(q, w, keys, pos, ratio=1, scale=SCALE)
    keys2 = keys.clone()
    keys2[64:128] = torch.randn(64, 128, generator=torch.Generator().manual_seed(8))
    s2 = it.triton_batched_scores(q, w, keys2, pos, ratio=1, scale=SCALE)
    assert torch.equal(s[0], s2[0]) and torch.equal(s[2], s2[2]) and not torch.equal(s[1], s2[1])


def test_one_sequence_is_the_shared_keys_kernel_bit_for_bit(interpret):
    """B = 1: the batched kernel and the one-sequence kernel (index_scores' path, unchanged) give the same bits."""
    q, w, keys, pos = _inputs(1, 130, [97], seed=3)
    one = it.triton_scores(q, w, keys, pos, ratio=1, scale=SCALE, cfg=it.F32ScoresConfig(block_t=1))
    assert torch.equal(it.triton_batched_scores(q, w, keys, pos, ratio=1, scale=SCALE), one)


def test_register_cap_is_a_launch_option_only(interpret):
    """maxnreg (the r128 rows) changes registers, not numbers: the interpreter ignores it, the scores are equal."""
    q, w, keys, pos = _inputs(2, 64, [63, 20], seed=9)
    base = it.triton_batched_scores(q, w, keys, pos, ratio=1, scale=SCALE)
    capped = it.triton_batched_scores(q, w, keys, pos, ratio=1, scale=SCALE, cfg=it.F32ScoresConfig(maxnreg=128))
    assert torch.equal(base, capped)


def test_empty_batch():
    q, w, keys, pos = _inputs(0, 8, [], seed=1)
    assert it.triton_batched_scores(q, w, keys, pos, ratio=1, scale=SCALE).shape == (0, 0)


def test_adapter_runs_the_kernel_with_its_own_tile(interpret, monkeypatch):
    """The executor's path: adapter_for(the index_scores binding's family, the batched op) -> the kernel, with the
    batched tile (one query a CTA, 64 keys x 4 warps) whatever tile the inherited binding names (the prefill tile
    at B > 256), the binding's precision; the op's numbers."""
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setattr(ka, "EMULATE", True)
    monkeypatch.setenv(ka.ADAPTER_INTERPRET_ENV, "1")
    seen = []
    kernel = it.triton_batched_scores
    monkeypatch.setattr(it, "triton_batched_scores", lambda *a, **k: seen.append(k["cfg"]) or kernel(*a, **k))
    q, w, keys, pos = _inputs(3, 80, [79, 30, 159], seed=5)
    attrs = {"ratio": 2, "scale": SCALE}
    a = ka.adapter_for("indexer_topk", "batched_index_scores")
    assert isinstance(a, ka.BatchedIndexScoresAdapter)
    cfg = {"precision": "ieee", "block_c": 128, "warps": 8, "block_t": 4}
    call = ka.Call("batched_index_scores", attrs, [q, w, keys, pos], ["q", "w", "k", "p"], [False] * 4, cfg)
    assert a.keys(call) == []
    s = a.run(call, [])[0]
    assert seen and (seen[0].block_c, seen[0].warps, seen[0].block_t, seen[0].precision) == (64, 4, 1, "ieee")
    _check(s, _op_reference(q, w, keys, pos, 2, SCALE), 1e-6)
    bad = ka.Call("batched_index_scores", attrs, [q, w, keys[:-1], pos], ["q", "w", "k", "p"], [False] * 4, cfg)
    with pytest.raises(ka.Decline):
        a.keys(bad)


def test_batched_graph_nodes_reach_the_kernel():
    """batch_decode keeps the one-sequence index_scores bindings (node names kept): their family must have an
    adapter for batched_index_scores; select_kernels run on the batched graph binds the batched program."""
    from deepinfer.compiler import compile_model
    from deepinfer.passes.batch_decode import batch_decode
    from deepinfer.passes.select_kernels import select_kernels
    from deepinfer.runtime import kernel_adapters as ka

    bg = batch_decode(compile_model("deepseek-v4.1-flash:tiny", "sm90").plan.graph)
    names = [n.outputs[0].name for n in bg.nodes if n.op == "batched_index_scores"]
    assert names
    for name in names:
        for b in bg.meta["kernels"]["nodes"][name]["buckets"].values():
            assert isinstance(ka.adapter_for(b["family"], "batched_index_scores"), ka.BatchedIndexScoresAdapter)
    rebound = select_kernels(bg, target="sm90", buckets={"b16": {"T": 16}, "b64": {"T": 64}})
    for name in names:
        for b in rebound.meta["kernels"]["nodes"][name]["buckets"].values():
            assert (b["family"], b["program"]) == ("indexer_topk", "triton_batched_scores"), b
    assert "batched_index_scores" not in rebound.meta["kernels"]["fallback"]


_SIG = {"q_ptr": "*fp32", "w_ptr": "*fp32", "k_ptr": "*fp32", "pos_ptr": "*i64", "s_ptr": "*fp32", "T": "i32",
        "C": "i32", "scale": "fp32", "ratio": "i32"}  # fmt: skip


@pytest.mark.parametrize("bc,warps", [(64, 4), (128, 8)])
def test_compiles_for_hopper_with_tf32_wgmma(bc, warps):
    ptx, report = compile_sm90("deepinfer.codegen.kernels.indexer_topk", "_f32_scores_kernel", _SIG,
                               dict(H=32, DI=128, BC=bc, BT=1, PREC="tf32x3", OWN_KEYS=True, DK=128), num_warps=warps)
    assert spill_free(report), report
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx and ".f32.tf32.tf32" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("c,ratio,maxnreg", [(1024, 4, 0), (4096, 1, 0), (4096, 1, 128)])
def test_cuda_kernel_at_batched_decode_dims(c, ratio, maxnreg):
    """16 sequences at lengths spread over the cache (one at position 0: nothing visible yet); maxnreg: the
    register-capped variant (kernels_h200 'r128' rows)."""
    b = 16
    positions = [0] + [(c * ratio * (i + 1)) // b - 1 for i in range(b - 1)]
    q, w, keys, pos = _inputs(b, c, positions, seed=c, device="cuda")
    cfg = it.F32ScoresConfig(block_t=1, maxnreg=maxnreg)
    s = it.triton_batched_scores(q, w, keys, pos, ratio=ratio, scale=SCALE, cfg=cfg)
    _check(s.cpu(), _oracle_f64(q.cpu(), w.cpu(), keys.cpu(), pos.cpu(), ratio, SCALE), 1e-5)
    _check(s.cpu(), _op_reference(q, w, keys, pos, ratio, SCALE).cpu(), 1e-5)


# ---------------------------------------------------------------------------------------------- balanced form
# Decode caches hold max_model_len / ratio keys a sequence; the balanced form (ctas_per_sm > 0) walks only the key
# tiles some query sees (work items found from the positions on the device), then fills -inf past them (fill).

# lengths from nothing visible to the whole (clamped) cache in one batch; C not a multiple of the tile
_LENGTHS = dict(b=6, c=200, positions=[0, 1, 63, 130, 399, 1000], ratio=2)


def _balanced(monkeypatch, ctas: int, fill_block: int = 64, per_row: bool = False) -> it.F32ScoresConfig:
    """A balanced config whose grid is `ctas` CTAs (one SM assumed; per_row: `ctas` split over the rows, at least
    one each), so every CTA walks several work items; the k_split it takes on the GPU (the first form compared
    with it takes the same)."""
    monkeypatch.setattr(it, "_sm_count", lambda device: 1)
    return it.F32ScoresConfig(block_t=1, ctas_per_sm=ctas, fill_block=fill_block, k_split=32, per_row=per_row)


_FIRST = it.F32ScoresConfig(block_t=1, k_split=32)  # the first form (a CTA per key tile) at the same k_split


def _limits(pos: torch.Tensor, ratio: int, c: int) -> list[int]:
    return [min((int(p) + 1) // ratio, c) for p in pos]


@pytest.mark.parametrize("ctas,per_row", [(1, False), (3, False), (64, False), (6, True), (13, True), (64, True)])
def test_balanced_form_at_very_different_lengths(interpret, monkeypatch, ctas, per_row):
    """Equal to both oracles, and bit for bit to the first form (one CTA per key tile); 1 / 3 CTAs walk every
    item, 64 CTAs are more than the items (the rest have none); per row: 1 / 3 / 4 (all tiles) CTAs a row."""
    d = _LENGTHS
    q, w, keys, pos = _inputs(d["b"], d["c"], d["positions"], seed=11)
    first = it.triton_batched_scores(q, w, keys, pos, ratio=d["ratio"], scale=SCALE, cfg=_FIRST)
    cfg = _balanced(monkeypatch, ctas, per_row=per_row)
    s = it.triton_batched_scores(q, w, keys, pos, ratio=d["ratio"], scale=SCALE, cfg=cfg)
    want = (min(4, -(-ctas // d["b"])), d["b"]) if per_row else (min(ctas, d["b"] * 4),)
    assert it.f32_scores_grid(d["b"], d["c"], 1, cfg, 1) == want
    _check(s, _oracle_f64(q, w, keys, pos, d["ratio"], SCALE), 1e-6)
    _check(s, _op_reference(q, w, keys, pos, d["ratio"], SCALE), 1e-6)
    assert torch.equal(s, first)


@pytest.mark.parametrize("per_row", [False, True])
def test_balanced_form_reads_and_writes_no_dead_tile(interpret, monkeypatch, per_row):
    """Keys past every sequence's limit are NaN and S starts as a sentinel: without fill, the visible columns are
    the clean keys' bits, the rest of a live tile -inf, and every column past the live tiles keeps the sentinel
    (no work item there, so its keys were not loaded); with fill, all of S is the clean first form's bits."""
    d = _LENGTHS
    b, c, ratio = d["b"], d["c"], d["ratio"]
    q, w, keys, pos = _inputs(b, c, d["positions"], seed=12)
    clean = it.triton_batched_scores(q, w, keys, pos, ratio=ratio, scale=SCALE, cfg=_FIRST)
    poisoned = keys.clone().view(b, c, -1)
    lims = _limits(pos, ratio, c)
    for s_, lim in enumerate(lims):
        poisoned[s_, lim:] = float("nan")
    poisoned = poisoned.view(b * c, -1)
    cfg = _balanced(monkeypatch, 3 if not per_row else 12, per_row=per_row)
    out = torch.full((b, c), 7.0)
    it.triton_batched_scores(q, w, poisoned, pos, ratio=ratio, scale=SCALE, cfg=cfg, fill=False, out=out)
    for s_, lim in enumerate(lims):
        live_end = min(-(-lim // 64) * 64, c)
        assert torch.equal(out[s_, :lim], clean[s_, :lim])
        assert (out[s_, lim:live_end] == float("-inf")).all() and (out[s_, live_end:] == 7.0).all()
    filled = it.triton_batched_scores(q, w, poisoned, pos, ratio=ratio, scale=SCALE, cfg=cfg)
    assert torch.equal(filled, clean)


def test_unfilled_scores_give_the_reference_top_k_with_positions(interpret, monkeypatch, tilelang_required):
    """The no-fill scores (NaN past the live tiles) through topk_select WITH positions (c target): the top-k set
    of the fully written scores, which is the float64 oracle's (no near-ties at this seed)."""
    from deepinfer.codegen.kernels import topk_select as ts
    from deepinfer.codegen.tilelang_backend import compile_cpu

    b, c, ratio, k = 4, 256, 2, 16
    positions = [0, 40, 300, 600]  # 0, 20, 150 and 256 (all) entries visible
    q, w, keys, pos = _inputs(b, c, positions, seed=13)
    s = torch.full((b, c), float("nan"))
    it.triton_batched_scores(q, w, keys, pos, ratio=ratio, scale=SCALE, cfg=_balanced(monkeypatch, 2), fill=False,
                             out=s)  # fmt: skip
    cfg = ts.Config(32, 8, 256, False)
    kernel = compile_cpu(ts.program(b, c, k=k, ratio=ratio, cfg=cfg, target="cpu"))
    idx = torch.full((b, k), 7, dtype=torch.int32)
    kernel(s, pos.int(), idx, *ts.make_scratch(b, c, k, cfg, "cpu"))
    full = it.triton_batched_scores(q, w, keys, pos, ratio=ratio, scale=SCALE)
    assert torch.equal(idx.long(), ts.reference(full, k))
    assert torch.equal(idx.long(), ts.reference(_oracle_f64(q, w, keys, pos, ratio, SCALE).float(), k))


def test_balanced_grid_follows_the_shapes_only():
    """The grid (CUDA graphs replay it) depends on the shapes: ctas_per_sm x SMs, at most one CTA per tile of a
    fully visible step; the first form keeps a CTA per (key tile, query block)."""
    cfg = it.F32ScoresConfig(block_t=1, ctas_per_sm=8)
    assert it.f32_scores_grid(64, 32768, 1, cfg, 132) == (1056,)
    assert it.f32_scores_grid(2, 100, 1, cfg, 132) == (4,)
    assert it.f32_scores_grid(64, 32768, 1, it.F32ScoresConfig(block_t=1), 132) == (512, 64)
    per_row = it.F32ScoresConfig(block_t=1, ctas_per_sm=32, per_row=True)  # 4224 CTAs over 64 rows: 66 a row
    assert it.f32_scores_grid(64, 32768, 1, per_row, 132) == (66, 64)
    assert it.f32_scores_grid(64, 2048, 1, per_row, 132) == (32, 64)  # the first form's grid at a 4k cache


@pytest.mark.parametrize("fill,per_row", [(True, False), (True, True)])  # (fill=False: a subset of the code)
def test_balanced_form_compiles_for_hopper(fill, per_row):
    ptx, report = compile_sm90("deepinfer.codegen.kernels.indexer_topk", "_f32_scores_kernel", _SIG,
                               dict(H=32, DI=128, BC=64, BT=1, PREC="tf32x3", OWN_KEYS=True, BALANCED=not per_row,
                                    RBP=1 if per_row else 64, FILL=fill, FB=1024, STAGES=1, DK=32, PER_ROW=per_row),
                               num_warps=4, maxnreg=168)  # fmt: skip
    assert spill_free(report), report  # (decode_form's register cap: 3 CTAs an SM)
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("per_row", [False, True])
def test_cuda_balanced_form_at_decode_dims(per_row):
    """B64 at lengths spread over a 64k-context cache (ratio 2): the balanced forms (decode_form: 168 registers)
    equal the first form's bits."""
    b, c, ratio = 64, 32768, 2
    positions = [0] + [(c * ratio * (i + 1)) // b - 1 for i in range(b - 1)]
    q, w, keys, pos = _inputs(b, c, positions, seed=5, device="cuda")
    first = it.triton_batched_scores(q, w, keys, pos, ratio=ratio, scale=SCALE, cfg=_FIRST)
    cfg = it.decode_form(it.F32ScoresConfig(block_t=1), 8 if not per_row else 32, per_row=per_row)
    assert torch.equal(it.triton_batched_scores(q, w, keys, pos, ratio=ratio, scale=SCALE, cfg=cfg), first)


def test_decode_configs_take_the_balanced_form_when_switched_on(monkeypatch):
    """DECODE_CTAS_PER_SM > 0: the batched config and the one-query config are the balanced form with the same
    tile (a sequence's bits alone = in a batch); several queries of one sequence keep the first form."""
    monkeypatch.setattr(it, "DECODE_CTAS_PER_SM", 8)
    one, batched = it.f32_scores_config(1, 4096), it.f32_batched_scores_config(64, 4096)
    assert one == batched and (one.ctas_per_sm, one.block_t, one.k_split, one.per_row) == (8, 1, 32, True)
    assert it.f32_scores_config(64, 4096).ctas_per_sm == 0
    monkeypatch.setattr(it, "DECODE_CTAS_PER_SM", 0)
    assert it.f32_batched_scores_config(64, 4096) == it.F32ScoresConfig(block_t=1)


def _spied_adapter_call(monkeypatch, seed: int, config: dict, **forms):
    """(the batched scores adapter, a call of 3 sequences on CPU through the interpreter, the kernel calls' keyword
    arguments as they are made) with indexer_topk's module switches `forms` set (one SM)."""
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setattr(ka, "EMULATE", True)
    monkeypatch.setenv(ka.ADAPTER_INTERPRET_ENV, "1")
    for name, value in forms.items():
        monkeypatch.setattr(it, name, value)
    monkeypatch.setattr(it, "_sm_count", lambda device: 1)
    seen: list = []
    kernel = it.triton_batched_scores
    monkeypatch.setattr(it, "triton_batched_scores", lambda *a, **k: seen.append(k) or kernel(*a, **k))
    q, w, keys, pos = _inputs(3, 200, [0, 399, 90], seed=seed)
    call = ka.Call("batched_index_scores", {"ratio": 2, "scale": SCALE}, [q, w, keys, pos], ["q", "w", "k", "p"],
                   [False] * 4, config)  # fmt: skip
    return ka.adapter_for("indexer_topk", "batched_index_scores"), call, seen


def test_adapter_runs_the_balanced_form_when_switched_on(interpret, monkeypatch):
    """The executor's path with DECODE_CTAS_PER_SM on: the adapter's kernel call is the balanced form (every
    column written: other consumers of S read past the limits), the op's numbers."""
    adapter, call, seen = _spied_adapter_call(monkeypatch, 6, {"precision": "ieee"}, DECODE_CTAS_PER_SM=2)
    s = adapter.run(call, [])[0]
    assert seen[0]["cfg"].ctas_per_sm == 2 and seen[0]["fill"]
    _check(s, _op_reference(*call.args, 2, SCALE), 1e-6)
    call.config["fill"] = False  # a binding whose consumers read only up to the limits
    adapter.run(call, [])
    assert not seen[1]["fill"]


def test_long_cache_per_row_form_without_fill_passes_the_first_call_check(interpret, monkeypatch):
    """A cache of at least DECODE_LONG_C columns takes the per-row form; bound fill False (every reader a
    positions-aware top-k) its dead columns are not written, and what the executor's first-call check compares --
    the adapter's check_view -- is the op's reference (-inf put back past the visible columns)."""
    adapter, call, seen = _spied_adapter_call(monkeypatch, 7, {"precision": "ieee", "fill": False},
                                              DECODE_CTAS_PER_SM=0, DECODE_LONG_C=128)  # fmt: skip
    outs = adapter.run(call, [])
    assert seen[0]["cfg"].per_row and seen[0]["cfg"].ctas_per_sm == it.DECODE_LONG_CTAS and not seen[0]["fill"]
    _check(adapter.check_view(call, outs)[0], _op_reference(*call.args, 2, SCALE), 1e-6)
