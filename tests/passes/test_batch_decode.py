"""batch_decode: one step of B sequences through the batched graph equals B one-sequence decode steps.

The oracle is the one-sequence plan graph itself, run through the interpreter: each sequence is prefilled with its
own prompt (different lengths), then takes one decode step alone; the batched graph takes the same B steps at
once over the stacked caches. Logits and every updated cache must agree. Positions are chosen so that in every
compressed layer some sequences close a compression window (ratio 1/2 on the tiny V4.1, 4/8 on the tiny V4:
an entry is emitted and written) and others do not, and some have wrapped their sliding-window ring.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.compiler import compile_model
from deepinfer.ir import interpreter
from deepinfer.ir.interpreter import bind_symbols, concrete_attrs
from deepinfer.ir.registry import get_op
from deepinfer.models.checkpoint import random_weights
from deepinfer.models.presets import weight_block_size
from deepinfer.passes.batch_decode import batch_decode
from deepinfer.runtime.session import allocate_caches

MAX_LEN = 24
# Three sequences: the row-wise ops run at T=3 instead of T=1 and CPU GEMM/matmul blocking depends on the row
# count, so fp32 sums round differently (the first differing value is layer 0's hc_stats mixes, ~6e-8); seen
# up to ~5e-6 on the logits. The batched ops themselves are exact (test_batched_ops_are_exact_per_sequence).
LOGITS_RTOL = 1e-4
# prompt lengths = the decode positions; per model: mixed window closings at every compress ratio, ring wraps (W 8)
LENGTHS = {"deepseek-v4-flash": (7, 11, 5), "deepseek-v4.1-flash": (5, 8, 11)}


@pytest.fixture(scope="module", params=["deepseek-v4-flash", "deepseek-v4.1-flash"])
def tiny(request):
    plan = compile_model(f"{request.param}:tiny", "cpu").plan
    params = random_weights(plan.graph.params, 3, block=weight_block_size(plan.config))
    return request.param, plan.graph, params


def _cache_names(g):
    return [e["name"] for e in g.meta["caches"]]


def _step(g, params, tokens, start, caches):
    feeds = {"tokens": torch.tensor(tokens), "positions": torch.arange(start, start + len(tokens)), **caches}
    outs = interpreter.run(g, feeds, params)
    return outs[0], dict(zip(_cache_names(g), outs[1:]))


def _prefilled(g, params, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    vocab = int(g.outputs[0].shape[-1])
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]
    return [_step(g, params, p, 0, allocate_caches(g, MAX_LEN))[1] if p else allocate_caches(g, MAX_LEN)
            for p in prompts]  # fmt: skip


def _ratios(g):
    ops = {"compressor", "pair_compressor_keys", "compressor_keys", "compressed_indices", "index_scores"}
    return sorted({n.attrs.get("ratio", 2 if n.op == "pair_compressor_keys" else 1) for n in g.nodes if n.op in ops})


def test_positions_mix_window_closings(tiny):
    """The premise of the equality test: at every ratio > 1, some decode positions close a window, some do not."""
    name, g, _ = tiny
    for m in [r for r in _ratios(g) if r > 1]:
        closes = {(p + 1) % m == 0 for p in LENGTHS[name]}
        assert closes == {True, False}, f"ratio {m}: positions {LENGTHS[name]} do not mix window closings"


def _assert_matches(logits, caches, want, exact: bool, step: int) -> None:
    for b, (w_logits, w_caches) in enumerate(want):
        where = f"step {step}, sequence {b}"
        if exact:
            assert torch.equal(logits[b : b + 1], w_logits), f"{where}: logits"
        else:
            diff = (logits[b] - w_logits[0]).abs().max().item()
            assert diff <= LOGITS_RTOL * max(1.0, w_logits.abs().max().item()), f"{where}: logits differ by {diff}"
        for k, w in w_caches.items():
            if exact or not w.is_floating_point():
                assert torch.equal(caches[k][b], w), f"{where}: cache {k}"
            else:
                torch.testing.assert_close(caches[k][b], w, rtol=1e-5, atol=1e-5, msg=f"{where}: cache {k}")


@pytest.mark.parametrize("n_seq", [1, 3])
def test_batched_steps_equal_single_sequence_steps(tiny, n_seq):
    """Two chained decode steps (the batched graph's new caches feed the next batched step). One sequence: the
    same bits as the one-sequence graph (every op sees the same shapes). Three: logits within LOGITS_RTOL."""
    name, g, params = tiny
    lengths = LENGTHS[name][:n_seq]
    seqs = _prefilled(g, params, lengths)
    bg = batch_decode(g)
    caches = {k: torch.stack([c[k] for c in seqs]) for k in _cache_names(g)}
    for step in range(2):
        tokens = [3 + 7 * b + step for b in range(n_seq)]
        positions = [n + step for n in lengths]
        want = [_step(g, params, [tok], p, c) for tok, p, c in zip(tokens, positions, seqs)]
        feeds = {**caches, "tokens": torch.tensor(tokens), "positions": torch.tensor(positions)}
        outs = interpreter.run(bg, feeds, params, check=True)
        caches = dict(zip(_cache_names(g), outs[1:]))
        _assert_matches(outs[0], caches, want, exact=n_seq == 1, step=step)
        seqs = [w for _, w in want]


def _values(g, feeds, params) -> dict:
    """Every value of one interpreter run (the test compares the batched ops node by node)."""
    env = bind_symbols(g, feeds)
    vals = {**feeds, **params}
    for n in g.nodes:
        outs = get_op(n.op).run([None if v is None else vals[v.name] for v in n.inputs], concrete_attrs(n, env))
        vals.update({o.name: x for o, x in zip(n.outputs, outs)})
    return vals


GEMM_OUTPUTS = {("batched_pair_compressor_keys", 1)}


def _expected_flat_ids(op: str, single: torch.Tensor, b: int, n_seq: int, attrs: dict) -> torch.Tensor:
    """What batched_ring_slots / batched_window_indices must return for sequence b, from the one-sequence ids."""
    if op == "batched_ring_slots":
        return single + b * attrs["size"]
    w = attrs["window"]
    return torch.where(single < 0, single, torch.where(single == w, n_seq * w + b, single + b * w))


def test_batched_ops_are_exact_per_sequence(tiny):
    """Each batched_* node, fed the B one-sequence runs' own inputs (concatenated: rows and pools alike), returns
    exactly (torch.equal) what the one-sequence op returned for each sequence -- so the batched step's only
    differences from B single steps come from the GEMMs at M=B instead of M=1 (the row-wise ops', and the index
    keys' wk product inside batched_pair_compressor_keys: GEMM_OUTPUTS, compared to fp32 rounding)."""
    name, g, params = tiny
    lengths = (*LENGTHS[name], 0)  # and a first token over empty caches (the engine's padding slots)
    seqs = _prefilled(g, params, lengths)
    tokens = [3 + 7 * b for b in range(len(lengths))]
    singles = [_values(g, {"tokens": torch.tensor([tok]), "positions": torch.tensor([n]), **c}, params)
               for tok, n, c in zip(tokens, lengths, seqs)]  # fmt: skip
    bg = batch_decode(g)
    checked = set()
    for node in bg.nodes:
        if not node.op.startswith("batched_") or node.op in ("batched_rows", "batched_gather_rows"):
            continue
        args = [None if v is None else params[v.name] if v.kind == "param" else
                torch.cat([s[v.name.removesuffix(".flat")] for s in singles]) for v in node.inputs]  # fmt: skip
        outs = get_op(node.op).run(args, node.attrs)
        for k, (o, got) in enumerate(zip(node.outputs, outs)):
            for b, s in enumerate(singles):
                want = s[o.name]
                rows = got.shape[0] // len(singles)
                part = got[b * rows : (b + 1) * rows]
                if node.op in ("batched_ring_slots", "batched_window_indices"):
                    want = _expected_flat_ids(node.op, want, b, len(singles), node.attrs)
                if (node.op, k) in GEMM_OUTPUTS:  # a [B, d] x [d, di] product: CPU GEMM blocking depends on B
                    torch.testing.assert_close(part, want, rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(part, want), f"{node.op} %{o.name} (output {k}), sequence {b}"
        checked.add(node.op)
    assert checked >= {"batched_ring_slots", "batched_window_indices"}


def test_compact_attention_pools_change_no_bit(tiny):
    """compact=True (the default) gathers the attended compressed rows before the attention: same outputs, bit
    for bit, as the attention over the flat pools."""
    name, g, params = tiny
    lengths = LENGTHS[name]
    seqs = _prefilled(g, params, lengths)
    feeds = {"tokens": torch.tensor([5, 6, 7]), "positions": torch.tensor(lengths)}
    feeds |= {k: torch.stack([c[k] for c in seqs]) for k in _cache_names(g)}
    compact, flat = batch_decode(g), batch_decode(g, compact=False)
    assert "batched_gather_rows" in compact.op_counts() and "batched_gather_rows" not in flat.op_counts()
    a = interpreter.run(compact, {k: v.clone() for k, v in feeds.items()}, params)
    b = interpreter.run(flat, feeds, params)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_an_op_without_a_batched_form_is_refused_by_name():
    """V4.1's bounded-replay ("compact") graph slices the positions for its decoder tail: no batched form, so the
    pass raises naming the node instead of returning a graph that would mix sequences."""
    from deepinfer.errors import IRError
    from deepinfer.models import deepseek_v41
    from deepinfer.models.presets import preset_config
    from deepinfer.passes.pipeline import run_pipeline

    cfg = deepseek_v41.parse_config(preset_config("deepseek-v4.1-flash", "tiny"))
    g, _ = run_pipeline(deepseek_v41.build_graph(cfg, mode="compact", keep_tokens=14))
    with pytest.raises(IRError, match=r"= slice reads %positions .* no batched form"):
        batch_decode(g)


def test_batched_ops_read_nothing_on_the_host(tiny):
    """Every batched_* node (and the runtime's in-place cache write) runs under a strict HostSyncGuard: no .item(),
    nonzero, boolean mask or tolist -- what a CUDA graph capture of the batched step needs."""
    from deepinfer.runtime.batched_decode import scatter_rows_in_place
    from deepinfer.runtime.cuda_graphs import HostSyncGuard

    name, g, params = tiny
    lengths = LENGTHS[name]
    seqs = _prefilled(g, params, lengths)
    bg = batch_decode(g)
    feeds = {"tokens": torch.tensor([5, 6, 7]), "positions": torch.tensor(lengths)}
    feeds |= {k: torch.stack([c[k] for c in seqs]) for k in _cache_names(g)}
    vals = _values(bg, feeds, params)
    env = bind_symbols(bg, feeds)
    ran = 0
    for node in bg.nodes:
        args = [None if v is None else vals[v.name] for v in node.inputs]
        if node.op.startswith("batched_"):
            with HostSyncGuard():
                get_op(node.op).run(args, concrete_attrs(node, env))
            ran += 1
        elif node.op == "scatter_rows":
            with HostSyncGuard():
                scatter_rows_in_place(args[0].clone(), args[1], args[2])
    assert ran >= 6


def test_index_scores_in_groups_of_sequences_are_the_same_bits(monkeypatch):
    """Large B x Hi x C: the batched index scores run in groups of sequences (bounded temporaries); the rows are
    independent, so the grouping changes no bit."""
    from deepinfer.ir.ops import batched

    gen = torch.Generator().manual_seed(0)
    b, h, di, c = 5, 4, 16, 12
    q, w, keys = torch.randn(b, h, di, generator=gen), torch.randn(b, h, generator=gen), torch.randn(b * c, di)
    args = [q, w, keys, torch.tensor([3, 11, 0, 7, 23])]
    whole = batched.batched_indexer_scores(*args, ratio=2, scale=0.5)[0]
    monkeypatch.setattr(batched, "TEMP_ELEMS", 2 * h * c)  # two sequences a group, the last alone
    assert torch.equal(batched.batched_indexer_scores(*args, ratio=2, scale=0.5)[0], whole)
