"""DeepSeek-V4.1-Flash graph (models/deepseek_v41.py) against the independent eager oracle
(tests/oracles/deepseek_v41_ref.py, written from MODEL_SPEC by another author).

Relative error below = max |graph - oracle| / max |oracle| over the compared tensor, fp32 on CPU.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.ir.interpreter import run
from deepinfer.ir.shapes import evaluate
from deepinfer.models import deepseek_v41 as v41
from deepinfer.models.presets import preset_config

ORACLE = Path(__file__).resolve().parents[1] / "oracles" / "deepseek_v41_ref.py"
REAL_CONFIG = Path("/work/shared/configs/deepseek-v4.1-flash.config.json")
TOL = 1e-5


def _load_oracle():
    spec = importlib.util.spec_from_file_location("deepseek_v41_ref_for_graph_tests", ORACLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ref = _load_oracle()


@pytest.fixture(scope="module")
def tiny():
    cfg = ref.tiny_config()
    return cfg, ref.random_weights(cfg, seed=0)


@pytest.fixture(scope="module")
def exact_graph(tiny):
    return v41.build_graph(tiny[0], weights="float")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def fresh_caches(g, max_len: int) -> dict[str, torch.Tensor]:
    env = {"C1": max_len, "C2": (max_len + 1) // 2}
    shapes = {v.name: v.shape for v in g.inputs}
    out = {}
    for e in g.meta["caches"]:
        dtype = torch.int64 if e["dtype"] == "i64" else torch.float32
        out[e["name"]] = torch.full([evaluate(d, env) for d in shapes[e["name"]]], e["init"], dtype=dtype)
    return out


def call(g, weights, caches, ids, start, check=False):
    """One graph call on ids at positions start..; returns (logits, updated caches, extra outputs)."""
    pos = torch.arange(start, start + len(ids))
    outs = run(g, {"tokens": ids, "positions": pos, **caches}, weights, check=check)
    names = [e["name"] for e in g.meta["caches"]]
    return outs[0], dict(zip(names, outs[1 : 1 + len(names)])), outs[1 + len(names) :]


def prompt(cfg, n, seed):
    return torch.randint(0, cfg["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------
# Full forward parity
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,seed", [(40, 1), (47, 2)])
def test_full_forward_matches_oracle(tiny, exact_graph, n, seed):
    cfg, w = tiny
    # long enough that both selection levels act: ratio-2 entries visible > index_topk, and ratio-1 positions
    # visible > candidate_topk_blocks * candidate_block_size (the candidate level prunes)
    assert n // 2 > cfg["index_topk"]
    assert n > cfg["candidate_topk_blocks"] * cfg["candidate_block_size"]
    ids = prompt(cfg, n, seed)
    logits, _, _ = call(exact_graph, w, fresh_caches(exact_graph, 64), ids, 0, check=True)
    assert logits.shape == (n, cfg["vocab_size"])
    assert rel(logits, ref.forward(cfg, w, ids)) < TOL


def test_incremental_decode_matches_full_forward(tiny, exact_graph):
    """Chunked prefill (odd split: a pending ratio-2 pair crosses the boundary) then one-token decode steps."""
    cfg, w = tiny
    n = 40
    ids = prompt(cfg, n, 3)
    full, _, _ = call(exact_graph, w, fresh_caches(exact_graph, 64), ids, 0)
    caches = fresh_caches(exact_graph, 64)
    pieces = []
    for lo, hi in [(0, 13), (13, 30)] + [(t, t + 1) for t in range(30, n)]:
        logits, caches, _ = call(exact_graph, w, caches, ids[lo:hi], lo)
        pieces.append(logits)
    inc = torch.cat(pieces)
    assert rel(inc, full) < TOL
    assert rel(inc, ref.forward(cfg, w, ids)) < TOL


def test_engram_history_cache(tiny, exact_graph):
    cfg, w = tiny
    ids = prompt(cfg, 5, 4)
    _, caches, _ = call(exact_graph, w, fresh_caches(exact_graph, 16), ids[:2], 0)
    n = cfg["engram_max_ngram_size"] - 1
    assert caches["cache.engram.history"].tolist() == ([-1] * n + ids[:2].tolist())[-n:]


# ---------------------------------------------------------------------------------------------------
# Bounded replay ("compact")
# ---------------------------------------------------------------------------------------------------


def test_compact_equals_exact_within_keep_tokens(tiny, exact_graph):
    cfg, w = tiny
    ids = prompt(cfg, 40, 5)
    g = v41.build_graph(cfg, weights="float", mode="compact", keep_tokens=140)
    compact, _, _ = call(g, w, fresh_caches(g, 64), ids, 0)
    exact, _, _ = call(exact_graph, w, fresh_caches(exact_graph, 64), ids, 0)
    assert compact.shape == exact.shape
    assert rel(compact, exact) < TOL


def test_compact_truncated_matches_oracle_replay(tiny, exact_graph):
    """Prompt longer than keep_tokens: the tail rows equal the oracle's bounded replay and differ from exact."""
    cfg, w = tiny
    keep = cfg["sliding_window"] + cfg["dspark_block_size"] + 3
    ids = prompt(cfg, 40, 6)
    g = v41.build_graph(cfg, weights="float", mode="compact", keep_tokens=keep)
    logits, _, _ = call(g, w, fresh_caches(g, 64), ids, 0, check=True)
    assert logits.shape == (keep, cfg["vocab_size"])
    oracle = ref.forward(cfg, w, ids, mode="compact", keep_tokens=keep)[-keep:]
    assert rel(logits, oracle) < TOL
    assert rel(logits, ref.forward(cfg, w, ids)[-keep:]) > 1e-3


def test_compact_mode_settings(tiny, monkeypatch):
    cfg = dict(tiny[0])
    monkeypatch.setenv(v41.MODE_ENV, "compact")
    monkeypatch.setenv(v41.KEEP_ENV, "20")
    c = v41.parse_config(cfg)
    assert (c.truncation_mode, c.keep_tokens) == ("compact", 20)
    assert v41.build_graph(c, weights="float").meta["mode"] == "compact"
    monkeypatch.setenv(v41.KEEP_ENV, "5")  # < window 8 + draft length 5
    with pytest.raises(ConfigError, match="KEEP_TOKENS"):
        v41.parse_config(cfg)
    monkeypatch.delenv(v41.MODE_ENV)
    monkeypatch.delenv(v41.KEEP_ENV)
    assert v41.parse_config(cfg).keep_tokens == v41.DEFAULT_KEEP
    c = v41.parse_config({**cfg, "yoco_prefill_truncation_mode": "compact", "yoco_prefill_keep_tokens": 30})
    assert (c.truncation_mode, c.keep_tokens) == ("compact", 30)
    with pytest.raises(ConfigError, match="keep_tokens"):
        v41.parse_config({**cfg, "yoco_prefill_truncation_mode": "compact", "yoco_prefill_keep_tokens": 12})
    with pytest.raises(ConfigError, match="window"):
        v41.build_graph(cfg, weights="float", mode="compact", keep_tokens=4)


# ---------------------------------------------------------------------------------------------------
# QAT fake-quant points (option, default off)
# ---------------------------------------------------------------------------------------------------


def test_qat_points_follow_oracle(tiny):
    """With qat=True the graph quantises where the oracle's quant=True does. Quantisation is not continuous: a
    1e-7 difference can move a value across an fp4 rounding boundary, so the bound here is looser."""
    cfg, w = tiny
    ids = prompt(cfg, 40, 1)
    g = v41.build_graph(cfg, weights="float", qat=True)
    assert g.meta["qat"] and any(n.op == "fake_quant_fp4_e4m3" for n in g.nodes)
    logits, _, _ = call(g, w, fresh_caches(g, 64), ids, 0)
    oracle_q = ref.forward(cfg, w, ids, quant=True)
    assert rel(logits, oracle_q) < 1e-2
    assert rel(logits, ref.forward(cfg, w, ids)) > 10 * rel(logits, oracle_q)


# ---------------------------------------------------------------------------------------------------
# DSpark
# ---------------------------------------------------------------------------------------------------


def test_dspark_draft_matches_oracle(tiny):
    cfg, w = tiny
    n = 20
    ids = prompt(cfg, n, 7)
    g = v41.build_graph(cfg, weights="float", hidden=True)
    _, _, hidden = call(g, w, fresh_caches(g, 32), ids, 0)
    _, _, cap = ref.forward_with_hidden(cfg, w, ids)
    targets = cfg["dspark_target_layer_ids"]
    for layer, h in zip(targets, hidden):
        assert rel(h, cap["entry"][layer]) < TOL
    anchor = int(ids[-1])
    bs = cfg["dspark_block_size"]
    dg = v41.build_dspark_graph(cfg, weights="float")
    inputs = {f"hidden.{layer}": h for layer, h in zip(targets, hidden)}
    inputs.update(ctx_positions=torch.arange(n), anchor=torch.tensor([anchor]), positions=torch.arange(n, n + bs))
    outs = dict(zip([v.name for v in dg.outputs], run(dg, inputs, w, check=True)))
    want = ref.dspark_draft(cfg, w, cap["entry"], anchor)
    for key in ("hidden", "base_logits", "step_logits", "confidence_raw", "confidence"):
        assert outs[key].shape == want[key].shape, key
        assert rel(outs[key], want[key]) < TOL, key
    assert outs["draft_tokens"].tolist() == want["draft_tokens"].tolist()


def test_dspark_graph_runs_on_tiny_preset():
    """§2.15 shapes on the built-in tiny preset, with checkpoint-format weights (random, from make-checkpoint)."""
    cfg = preset_config("deepseek-v4.1-flash", "tiny")
    c = v41.parse_config(cfg)
    dg = v41.build_dspark_graph(cfg, weights="float")
    bs, d, v, tc = c.dspark_block_size, c.hidden_size, c.vocab_size, 9
    assert bs == 5 and c.num_mtp_layers == 3 and c.dspark_noise_token == 128799
    g = torch.Generator().manual_seed(0)
    w = {p.name: torch.randn([int(s) for s in p.shape], generator=g) * 0.1 for p in dg.params}
    inputs = {f"hidden.{layer}": torch.randn(tc, c.hc_mult, d, generator=g) for layer in c.dspark_targets}
    inputs.update(ctx_positions=torch.arange(tc), anchor=torch.tensor([5]), positions=torch.arange(tc, tc + bs))
    outs = dict(zip([o.name for o in dg.outputs], run(dg, inputs, w, check=True)))
    assert outs["hidden"].shape == (bs, d)
    assert outs["base_logits"].shape == outs["step_logits"].shape == (bs - 1, v)
    assert outs["draft_tokens"].shape == outs["confidence"].shape == (bs - 1,)
    assert ((outs["confidence"] > 0) & (outs["confidence"] < 1)).all()
    names = {p.name for p in dg.params}
    assert {"mtp.0.main_proj.weight", "mtp.2.markov_head.embed.weight", "mtp.2.confidence_head.proj.weight"} <= names
    assert dg.params[[p.name for p in dg.params].index("mtp.0.main_proj.weight")].shape == (d, 3 * d)


# ---------------------------------------------------------------------------------------------------
# Real config: structure and parameter counts
# ---------------------------------------------------------------------------------------------------


def test_real_config_param_counts():
    raw = json.loads(REAL_CONFIG.read_text())
    counts = v41.param_counts(raw)
    assert abs(counts["backbone"] / 551.9e9 - 1) < 1e-3
    assert abs(counts["engram"] / 196.6e9 - 1) < 1e-3
    oracle = ref.param_counts(ref.load_config())
    assert counts == oracle


def test_real_graph_structure():
    c = v41.parse_config(json.loads(REAL_CONFIG.read_text()))
    assert c.rms_eps == 1e-20 and c.fp8_block == 32 and c.expert_dtype == "fp4"
    g = v41.build_graph(c)
    names = {p.name: p for p in g.params}
    assert "hc_head_fn" not in names and not any("q_b_norm" in n for n in names)
    assert str(names["layers.0.attn.wq_a.scale"].dtype) == "e8m0"
    assert tuple(names["layers.0.attn.wq_a.scale"].shape) == (1280 // 32, 5120 // 32)
    # kv sources own the compressor (no ape) and index keys; sharers do not
    for s in (2, 8, 14, 20):
        assert f"layers.{s}.attn.compressor.norm.weight" in names and f"layers.{s}.attn.indexer.wk.weight" in names
        assert not any(n.startswith(f"layers.{s}.attn.compressor.ape") for n in names)
    assert "layers.2.attn.compressor.wgate.weight" in names and "layers.20.attn.compressor.wgate.weight" not in names
    assert not any(n.startswith("layers.3.attn.compressor") for n in names)
    for s in (24, 28, 32, 36):
        assert f"layers.{s}.attn.indexer.wq_b.weight" in names and f"layers.{s}.attn.indexer.wk.weight" not in names
    assert "layers.25.attn.indexer.wq_b.weight" not in names
    assert tuple(names["layers.14.engram.embed.weight"].shape) == (384016682, 256)
    caches = [e["name"] for e in g.meta["caches"]]
    assert "cache.20.ckv" in caches and "cache.21.ckv" not in caches and "cache.2.cmp_kv" in caches
    assert sum(n.op == "candidate_blocks" for n in g.nodes) == 1
    assert sum(n.op == "engram_gate" for n in g.nodes) == 2


# ---------------------------------------------------------------------------------------------------
# Config errors
# ---------------------------------------------------------------------------------------------------


def test_nested_and_flat_configs_agree():
    raw = json.loads(REAL_CONFIG.read_text())
    nested = v41.parse_config(raw)
    flat = {**raw["text_config"], "quantization_config": raw["quantization_config"], "image_token_id": 129264}
    flat = v41.parse_config(flat)
    assert nested == flat


@pytest.mark.parametrize(
    "patch,key",
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"hidden_size": "big"}, "hidden_size"),
        ({"compress_ratios": [0, 4, 2]}, "compress_ratios"),
        ({"kv_source_layer_ids": [1]}, "kv_source_layer_ids"),
        ({"index_source_layer_ids": [2]}, "index_source_layer_ids"),
        ({"candidate_source_layer_id": 3}, "candidate_source_layer_id"),
        ({"engram_num_embeddings": [1, 2]}, "engram_num_embeddings"),
        ({"engram_layer_ids": [99]}, "engram_layer_ids"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"rms_norm_eps": -1}, "rms_norm_eps"),
        ({"yoco_prefill_truncation_mode": "fast"}, "yoco_prefill_truncation_mode"),
    ],
)
def test_bad_config_raises_config_error(tiny, patch, key):
    cfg = {**tiny[0], **patch}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ConfigError, match=key):
        v41.build_graph(cfg, weights="float")


def test_bad_build_arguments(tiny):
    with pytest.raises(ConfigError, match="weights"):
        v41.build_graph(tiny[0], weights="int4")
    with pytest.raises(ConfigError, match="mode"):
        v41.build_graph(tiny[0], weights="float", mode="fast")
    with pytest.raises(ConfigError, match="text_config"):
        v41.parse_config({"text_config": 3})


# ---------------------------------------------------------------------------------------------------
# Engram pieces and checkpoint-format weights
# ---------------------------------------------------------------------------------------------------


def test_engram_real_vocabulary_and_primes():
    from deepinfer.ir.ops.engram import token_map

    c = v41.parse_config(json.loads(REAL_CONFIG.read_text()))  # checks prime sums == engram_num_embeddings
    assert c.engram_num_embeddings == (384006168, 384016682)
    cmap = token_map(129280, c.engram_compressed_vocab)
    classes = int(cmap.max()) + 1
    assert len(cmap) == 129280 and classes == c.engram_compressed_vocab == 99092


def test_engram_hash_ids_match_oracle(tiny):
    """The graph's hash ids (through a history carried across calls) equal the oracle's, image token included."""
    from deepinfer.ir.builder import GraphBuilder
    from deepinfer.ir.interpreter import run as run_graph

    cfg = tiny[0]
    c = v41.parse_config(cfg)
    ids = prompt(cfg, 12, 8)
    ids[5] = cfg["image_token_id"]
    want = ref.engram_hash_ids(cfg, ids.tolist())
    primes = v41._engram_primes_flat(c)
    n = c.engram_max_ngram - 1
    for li, layer in enumerate(c.engram_layers):
        b = GraphBuilder("hash")
        tok, hist = b.input("tokens", "i64", ["T"]), b.input("history", "i64", [n])
        out = b.engram_hash(
            tok, hist, multipliers=v41.engram_multipliers(c, layer), primes=primes[li], n_heads=c.engram_n_heads,
            pad_id=c.engram_pad_id, vocab=c.vocab_size, compressed_vocab=c.engram_compressed_vocab,
            image_token_id=c.image_token_id,
        )  # fmt: skip
        b.output(out, b.engram_history(hist, tok))
        g = b.build()
        history, got = torch.full((n,), -1), []
        for lo, hi in ((0, 4), (4, 5), (5, 12)):
            h, history = run_graph(g, {"tokens": ids[lo:hi], "history": history})
            got.append(h)
        assert torch.equal(torch.cat(got), want[:, li])


def test_checkpoint_format_graph_runs_on_tiny_checkpoint(tmp_path):
    """make-checkpoint's tiny V4.1 checkpoint (FP8 32x32 blocks, FP4 experts, FP8 Engram rows) loads into the
    checkpoint-dtype graph, which runs with finite logits."""
    from deepinfer.models import checkpoint as ck

    cfg = preset_config("deepseek-v4.1-flash", "tiny")
    path = ck.make_checkpoint("deepseek-v4.1-flash", "tiny", tmp_path / "ckpt")
    g = v41.build_graph(cfg)
    w = ck.load_checkpoint(path, g.params)
    dtypes = {p.name: str(p.dtype) for p in g.params}
    assert dtypes["layers.1.engram.embed.weight"] == "f8e4m3" and dtypes["layers.0.attn.wq_a.scale"] == "e8m0"
    ids = prompt({"vocab_size": 1000}, 20, 9)
    logits, _, _ = call(g, w, fresh_caches(g, 32), ids, 0, check=True)
    assert logits.shape == (20, 129280) and logits.isfinite().all()


def test_decode_after_truncated_compact_prefill_matches_oracle(tiny):
    cfg, w = tiny
    keep = cfg["sliding_window"] + cfg["dspark_block_size"]
    ids = prompt(cfg, 36, 10)
    g = v41.build_graph(cfg, weights="float", mode="compact", keep_tokens=keep)
    _, caches, _ = call(g, w, fresh_caches(g, 64), ids[:30], 0)
    _, state = ref.prefill(cfg, w, ids[:30], mode="compact", keep_tokens=keep)
    for t in range(30, 36):
        logits, caches, _ = call(g, w, caches, ids[t : t + 1], t)
        assert rel(logits[0], ref.decode_step(cfg, w, state, int(ids[t]))) < TOL
