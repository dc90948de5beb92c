"""engram_hash (V4.1's Engram row ids) on codegen/kernels/engram_hash.py: bit-exact against the op's references
(ir/ops/engram.py EngramHash, ir/ops/batched.py BatchedEngramHash) in Triton's interpreter -- the first tokens of a
sequence (history -1), image tokens in the tokens and in the history (the longer lookbacks blocked), the pad id,
every row of a block and a partial last block, a hash that wraps int64 (floor modulo) -- at V4.1's real attributes
(the tokenizer's compressed map, 3 orders x 8 heads) and the tiny preset's; the adapter and the binding; the sm_90a
build (no spills); and on an H200 the real dims in and out of a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from deepinfer.codegen.kernels import engram_hash as eh
from deepinfer.models import deepseek_v41 as m41
from deepinfer.models.presets import engram_primes, preset_config
from tests.codegen._triton_aot import compile_sm90, spill_free

IMAGE = 129264  # V4.1's image token id


def v41_attrs(layer: int = 1) -> dict:
    """engram_hash's attributes at V4.1's real dims for Engram layer `layer` (1 or 14)."""
    cfg = m41.parse_config(preset_config("deepseek-v4.1-flash", "real"))
    i = cfg.engram_layers.index(layer)
    primes = engram_primes(cfg.engram_vocab_size, len(cfg.engram_layers), cfg.engram_max_ngram, cfg.engram_n_heads)
    return dict(multipliers=m41.engram_multipliers(cfg, layer), primes=[p for n in primes[i] for p in n],
                n_heads=cfg.engram_n_heads, pad_id=cfg.engram_pad_id, vocab=cfg.vocab_size,
                compressed_vocab=cfg.engram_compressed_vocab, image_token_id=cfg.image_token_id)  # fmt: skip


def tokens(t: int, seed: int, vocab: int = 129280, device="cpu") -> torch.Tensor:
    """Random ids with the image token, the pad id (2), 0 and the last id sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (t,), generator=g)
    special = torch.tensor([IMAGE if vocab > IMAGE else 1, 2, 0, vocab - 1])
    pick = special[torch.randint(0, 4, (t,), generator=g)]
    return torch.where(torch.rand(t, generator=g) < 0.25, pick, x).to(device)


def check(toks, history, attrs, batched=False, cfg=None):
    want = eh.reference(toks, history, batched=batched, **attrs)
    got = eh.engram_hash(toks, history, batched=batched, cfg=cfg, **attrs)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("layer", [1, 14])
@pytest.mark.parametrize("history", [[-1, -1, -1], [-1, -1, 77], [IMAGE, 5, 9], [11, IMAGE, 3], [4, 2, 129279]])
def test_one_sequence_matches_the_reference(interpret, layer, history):
    """tokens [T] after history [3]: the first rows' lookbacks reach into the history (-1: before the sequence;
    an image token blocks the longer lookbacks); T = 37 over blocks of 16 (a partial last block)."""
    check(tokens(37, seed=layer), torch.tensor(history), v41_attrs(layer), cfg=eh.Config(16, 2))


@pytest.mark.parametrize("t", [1, 2, 64, 70])
def test_batched_matches_the_reference(interpret, t):
    """B sequences of one token each, every row its own history (-1 for a new sequence, image tokens, pads)."""
    g = torch.Generator().manual_seed(t)
    hist = tokens(3 * t, seed=100 + t).view(t, 3)
    hist = torch.where(torch.rand(t, 3, generator=g) < 0.2, -1, hist)
    hist[0] = torch.tensor([-1, -1, -1])
    check(tokens(t, seed=t), hist.reshape(-1), v41_attrs(1), batched=True)


def test_tiny_preset_and_every_config(interpret):
    """The tiny preset's hash (the map t % 99,092 of the real vocabulary; 3 orders x 2 heads: K = 6 of KP = 8) at
    every config of the space."""
    g = m41.build_graph(m41.parse_config(preset_config("deepseek-v4.1-flash", "tiny")))
    (attrs, *_) = [n.attrs for n in g.nodes if n.op == "engram_hash"]
    toks, hist = tokens(40, seed=3), torch.tensor([-1, 8, IMAGE])
    for cfg in eh.config_space(40):
        check(toks, hist, attrs, cfg=cfg)


def test_a_wrapped_hash_is_floor_modulo(interpret):
    """Multipliers near 2^63 (not the model's: there c * mult stays below it) wrap the products and the XOR goes
    negative; torch.remainder's floor modulo is the reference."""
    attrs = dict(v41_attrs(1), multipliers=[(1 << 62) + 1, (1 << 63) - 1, 3 << 61, (1 << 62) - 3])
    toks = tokens(50, seed=9)
    assert (eh.reference(toks, torch.tensor([-1, 5, 6]), **attrs) >= 0).all()
    check(toks, torch.tensor([-1, 5, 6]), attrs)


def test_constants_and_bad_input():
    consts = eh.hash_constants([3, 5, 7], [11, 13, 17, 19])
    assert consts.tolist() == [3, 5, 7, 11, 13, 17, 19, 0, 11, 24, 41]
    cmap, consts, pad = eh.device_tables(v41_attrs(1), "cpu")
    assert cmap.shape == (129280,) and consts.shape == (4 + 2 * 24,) and pad == 2
    with pytest.raises(ValueError, match=r"engram_hash: needs tokens \[T\], history \[\(N-1\)\]"):
        eh.triton_engram_hash(torch.zeros(4, dtype=torch.long), torch.zeros(2, dtype=torch.long), cmap, consts,
                              n_heads=8, pad_class=pad, image_token_id=IMAGE)  # fmt: skip
    with pytest.raises(ValueError, match=r"history \[T\*\(N-1\)\]"):
        eh.triton_engram_hash(torch.zeros(4, dtype=torch.long), torch.zeros(3, dtype=torch.long), cmap, consts,
                              n_heads=8, pad_class=pad, image_token_id=IMAGE, batched=True)  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        eh.check_config(eh.Config(block_rows=24))
    assert eh.roofline(64, 4, 24, batched=True) == 8 * (64 + 3 * 64 + 64 * 4 + 64 * 24)


def test_compiles_for_hopper_without_spills():
    """The real dims' program (N 4, K 24 of KP 32, 8 heads) at the default config, both row layouts."""
    sig = {"tok_ptr": "*i64", "hist_ptr": "*i64", "cmap_ptr": "*i64", "const_ptr": "*i64", "out_ptr": "*i64",
           "T": "i32", "V": "i32", "pad_class": "i32", "image_id": "i32"}  # fmt: skip
    for batched in (False, True):
        ptx, report = compile_sm90("deepinfer.codegen.kernels.engram_hash", "hash_jit", sig,
                                   dict(N=4, K=24, KP=32, HEADS=8, BR=32, BATCHED=batched), num_warps=2)  # fmt: skip
        assert ".target sm_90a" in ptx and spill_free(report), report


def test_the_adapter_runs_the_kernel_for_both_ops(interpret, monkeypatch):
    """runtime/kernel_adapters' EngramHashAdapter: no TileLang key; the kernel (under the interpreter when the adapters
    may use it: its tables made once into the call cache) else the op's reference -- the same ids both ways, for the
    one-sequence and the batched op."""
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setattr(ka, "EMULATE", True)
    launched = []
    real = eh.triton_engram_hash
    monkeypatch.setattr(eh, "triton_engram_hash", lambda *a, **k: launched.append(k["batched"]) or real(*a, **k))
    attrs, cache = v41_attrs(14), {}
    toks = tokens(5, seed=21)
    cases = [("engram_hash", torch.tensor([-1, 7, IMAGE]), False), ("batched_engram_hash", tokens(15, seed=22), True)]
    for op, hist, batched in cases:
        adapter = ka.adapter_for("engram_hash", op)
        call = ka.Call(op, attrs, [toks, hist], ["t", "h"], [False, False], {}, cache)
        assert adapter.keys(call) == []
        want = eh.reference(toks, hist, batched=batched, **attrs)
        assert torch.equal(adapter.run(call, [])[0], want) and not launched  # (the adapters' interpreter is off)
    monkeypatch.setenv(ka.ADAPTER_INTERPRET_ENV, "1")
    for op, hist, batched in cases:
        call = ka.Call(op, attrs, [toks, hist], ["t", "h"], [False, False], {}, cache)
        want = eh.reference(toks, hist, batched=batched, **attrs)
        assert torch.equal(ka.adapter_for("engram_hash", op).run(call, [])[0], want)
    assert launched == [False, True] and len([k for k in cache if k[0] == "engram_hash_tables"]) == 1


def test_the_v41_hash_is_bound_to_the_kernel():
    """select_kernels binds both Engram layers' engram_hash (tiny V4.1) to the family at every bucket on sm90 and the
    batched graph's batched_engram_hash too; the cpu target keeps the reference, with the reason."""
    from deepinfer.compiler import default_pipeline
    from deepinfer.passes.batch_decode import batch_decode
    from deepinfer.passes.pattern import clone_graph
    from deepinfer.passes.pipeline import run_pipeline
    from deepinfer.passes.select_kernels import select_kernels

    g = m41.build_graph(m41.parse_config(preset_config("deepseek-v4.1-flash", "tiny")))
    names = [n.outputs[0].name for n in g.nodes if n.op == "engram_hash"]
    assert len(names) == 2
    bound = select_kernels(clone_graph(g), target="sm90").meta["kernels"]["nodes"]
    for name in names:
        assert {b["family"] for b in bound[name]["buckets"].values()} == {"engram_hash"}, bound[name]
    cpu = select_kernels(clone_graph(g), target="cpu").meta["kernels"]
    assert {b["family"] for b in cpu["nodes"][names[0]]["buckets"].values()} == {"torch_ref"}
    assert "Triton on CUDA" in cpu["fallback"]["engram_hash"]
    plan, _ = run_pipeline(g, default_pipeline("sm90"))  # the plan graph, as the runtime batches it
    bg = batch_decode(plan)
    assert {n.op for n in bg.nodes if n.outputs[0].name in names} == {"batched_engram_hash"}
    batched = select_kernels(bg, target="sm90").meta["kernels"]["nodes"]
    assert {b["family"] for name in names for b in batched[name]["buckets"].values()} == {"engram_hash"}


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [1, 14])
def test_h200_real_dims_and_cuda_graph(layer):
    """V4.1's real attributes: T = 1 / 64 / 4096 of one sequence and B = 64 / 256 sequences equal the reference,
    eagerly and replayed from a CUDA graph on new tokens (no host read or host -> device copy: the capture would
    fail)."""
    attrs = v41_attrs(layer)
    cmap, consts, pad = eh.device_tables(attrs, "cuda")
    kw = dict(n_heads=8, pad_class=pad, image_token_id=IMAGE)
    for t, batched in ((1, False), (64, False), (4096, False), (64, True), (256, True)):
        toks = tokens(t, seed=t, device="cuda")
        hist = tokens(3 * t if batched else 3, seed=t + 1, device="cuda")
        hist[:3] = -1
        assert torch.equal(eh.triton_engram_hash(toks, hist, cmap, consts, batched=batched, **kw),
                           eh.reference(toks, hist, batched=batched, **attrs)), (t, batched)  # fmt: skip
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eh.triton_engram_hash(toks, hist, cmap, consts, batched=batched, **kw)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = eh.triton_engram_hash(toks, hist, cmap, consts, batched=batched, **kw)
        toks.copy_(tokens(t, seed=t + 7, device="cuda"))
        graph.replay()
        assert torch.equal(out, eh.reference(toks, hist, batched=batched, **attrs)), (t, batched, "graph")
