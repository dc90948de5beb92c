"""The V4.1 graph's own ops against sglang 0.5.23's recorded per-op outputs (tests/data/sglang_v41, see its
README.md for the exact sglang functions and arguments).

tests/oracles/test_v41_reference.py checks the independent oracle against the same files; this module checks
the graph side: tiny graphs built with GraphBuilder from the registered ops (ir/ops/engram.py, ir/ops/v41.py,
ir/ops/quant.py) and run with the interpreter. Every parameter that the model chooses (Engram multipliers,
primes, pad id, vocabulary, gate eps / clamp, fp4 groups, candidate block size and ratio) is read off the
real V4.1-Flash graph that models/deepseek_v41.py builds, not taken from the oracle or the recorded files.

Integer outputs (hash ids, block ids, picks) must be exact. The fp4 fake quant is compared exactly too: its
outputs lie on a discrete grid, so any difference would be a rounding-rule mismatch, not float noise. The
float ops (gate, pair pooling) use rtol 1e-6 with an absolute floor of 1e-6 for values near zero.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.interpreter import run
from deepinfer.models import deepseek_v41 as v41
from deepinfer.models.presets import real_config

DATA = Path(__file__).resolve().parents[1] / "data" / "sglang_v41"
META = json.loads((DATA / "meta.json").read_text())
RTOL = ATOL = 1e-6
_DT = {torch.float32: "f32", torch.int64: "i64", torch.int32: "i32"}


def _load(name: str) -> dict[str, torch.Tensor]:
    return load_file(DATA / f"{name}.safetensors")


@pytest.fixture(scope="module")
def cfg() -> v41.V41Config:
    return v41.parse_config(real_config("deepseek-v4.1-flash"))


@pytest.fixture(scope="module")
def real_graph(cfg):
    """The real V4.1-Flash backbone graph with its QAT points, built only to read the ops' attributes."""
    return v41.build_graph(cfg, qat=True)


def _nodes(g, op: str) -> list:
    return [n for n in g.nodes if n.op == op]


def _engram_hash_attrs(g, layer: int) -> dict:
    """The attrs of the engram_hash node the real graph builds before `layer` (nodes are scoped ``l<layer>``)."""
    (node,) = [n for n in _nodes(g, "engram_hash") if n.outputs[0].name.split(".")[0] == f"l{layer}"]
    return dict(node.attrs)


def _inp(b: GraphBuilder, name: str, t: torch.Tensor):
    return b.input(name, _DT[t.dtype], list(t.shape))


# ---------------------------------------------------------------------------------------------------------------
# Engram: compressed token map, hash parameters, hash ids, gate
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def op_token_map(cfg) -> torch.Tensor:
    """The map the engram_hash op uses for the real vocabulary (built from the tokenizer, a few seconds)."""
    from deepinfer.ir.ops.engram import token_map

    return token_map(cfg.vocab_size, cfg.engram_compressed_vocab)


def _check_token_map(tmap: torch.Tensor, cfg) -> None:
    f = _load("engram_hash")
    assert tmap.shape == (cfg.vocab_size,) == (129280,)
    assert int(tmap.max()) + 1 == cfg.engram_compressed_vocab == META["engram"]["compressed_classes"]
    digest = hashlib.sha256(tmap.to(torch.int32).numpy().astype("<i4").tobytes()).hexdigest()
    assert digest == META["engram"]["token_map_int32_le_sha256"]
    assert torch.equal(tmap[:4096], f["token_map_first_4096"].long())
    assert torch.equal(tmap[::37], f["token_map_every_37th"].long())
    assert int(tmap[cfg.engram_pad_id]) == META["engram"]["pad_compressed"]


def test_engram_op_token_map_matches_sglang(cfg, op_token_map):
    _check_token_map(op_token_map, cfg)


def test_tokenizer_engram_token_map_matches_sglang(cfg, op_token_map):
    """models/tokenizer.py keeps a second implementation of the map (for tooling); it must agree too."""
    from deepinfer.models.tokenizer import engram_token_map

    tmap = torch.tensor(engram_token_map(), dtype=torch.int64)
    _check_token_map(tmap, cfg)
    assert torch.equal(tmap, op_token_map)


def test_engram_hash_parameters_match_sglang(cfg, real_graph):
    """Multipliers, primes and offsets the real graph hands to engram_hash equal sglang's EngramLayout."""
    f = _load("engram_hash")
    assert cfg.engram_layers == (1, 14)
    assert cfg.engram_pad_id == 2
    for li, layer in enumerate(cfg.engram_layers):
        a = _engram_hash_attrs(real_graph, layer)
        assert list(a["multipliers"]) == f["multipliers"][li].tolist()
        assert list(a["multipliers"]) == v41.engram_multipliers(cfg, layer)
        primes = list(a["primes"])
        assert primes == f["primes"][li].flatten().tolist()  # (n-gram size 2..4, head) order
        assert a["n_heads"] == f["primes"].shape[-1] == 8
        offsets = [sum(primes[:i]) for i in range(len(primes))]
        assert offsets == f["offsets"][li].tolist()
        assert sum(primes) == META["engram"]["prime_sums"][li] == cfg.engram_num_embeddings[li]
        assert (a["pad_id"], a["vocab"], a["compressed_vocab"]) == (2, 129280, 99092)


def _hash_graph(attrs: dict, n_hist: int):
    b = GraphBuilder("engram_hash_vs_sglang")
    tok, hist = b.input("tokens", "i64", ["T"]), b.input("history", "i64", [n_hist])
    b.output(b.engram_hash(tok, hist, **attrs), b.engram_history(hist, tok))
    return b.build()


def test_engram_history_convention_matches_sglang_tables(cfg):
    """sglang's predecessor table (`tokens`, clamped) and `blocked` (t < s) for one extend from an empty history
    are what the graph's history convention gives: concat(history = [-1]*(N-1), tokens), blocked where < 0."""
    f = _load("engram_hash")
    n = cfg.engram_max_ngram
    ids = f["input_ids"]
    toks = torch.cat([torch.full((n - 1,), -1), ids])
    t = ids.shape[0]
    for s in range(n):
        col = toks[n - 1 - s : n - 1 - s + t]
        assert torch.equal(col < 0, f["blocked"][:, s]), s
        assert torch.equal(col[col >= 0], f["tokens"][:, s][col >= 0]), s


def test_engram_hash_ids_match_sglang(cfg, real_graph, op_token_map):
    """compute_engram_hash_ids for the real config, one extend from an empty history; the graph also in pieces
    that carry the n-gram history across calls (pieces split inside the (2, 2, 100, 100) run at ids 10-13)."""
    f = _load("engram_hash")
    ids, want = f["input_ids"], f["hash_ids"]
    assert not bool((ids == cfg.image_token_id).any())  # the recording has no image token
    n_hist = cfg.engram_max_ngram - 1
    for li, layer in enumerate(cfg.engram_layers):
        g = _hash_graph(_engram_hash_attrs(real_graph, layer), n_hist)
        got, _ = run(g, {"tokens": ids, "history": torch.full((n_hist,), -1)})
        assert got.dtype == torch.int64 and got.shape == want[:, li].shape
        assert torch.equal(got, want[:, li]), layer
        history, parts = torch.full((n_hist,), -1), []
        for lo, hi in ((0, 2), (2, 11), (11, 12), (12, 13), (13, 48)):
            h, history = run(g, {"tokens": ids[lo:hi], "history": history})
            parts.append(h)
        assert torch.equal(torch.cat(parts), want[:, li]), layer


def _gate_graph(f: dict, **attrs):
    b = GraphBuilder("engram_gate_vs_sglang")
    x, kv, tok = _inp(b, "x", f["x"]), _inp(b, "kv", f["kv"]), _inp(b, "tokens", f["input_ids"])
    qw = b.param("q_weight", "f32", list(f["q_weight"].shape))
    kw = b.param("k_weight", "f32", list(f["k_weight"].shape))
    b.output(b.engram_gate(x, kv, qw, kw, tok, **attrs))
    return b.build()


def test_engram_gate_matches_sglang(cfg, real_graph):
    """engram_gate(x, kv, q_weight, k_weight, eps=1e-20, clamp_value=1e-6[, input_ids, image_token_id=257])."""
    f = _load("engram_gate")
    m = META["engram_gate"]
    for node in _nodes(real_graph, "engram_gate"):  # the real graph's gate uses sglang's eps and clamp
        assert node.attrs["eps"] == m["eps"] and node.attrs["clamp"] == m["clamp_value"]
        assert node.attrs["image_token_id"] == cfg.image_token_id == 129264
    inputs = {"x": f["x"], "kv": f["kv"], "tokens": f["input_ids"]}
    params = {"q_weight": f["q_weight"], "k_weight": f["k_weight"]}
    # without the image row: the real image id does not occur in input_ids
    assert not bool((f["input_ids"] == cfg.image_token_id).any())
    (out,) = run(
        _gate_graph(f, eps=m["eps"], clamp=m["clamp_value"], image_token_id=cfg.image_token_id), inputs, params
    )
    torch.testing.assert_close(out, f["out"], rtol=RTOL, atol=ATOL)
    # with the image row (id 257 at row 3): that row keeps x
    img = m["image_token_id"]
    assert (f["input_ids"] == img).nonzero().flatten().tolist() == [3]
    (out_img,) = run(_gate_graph(f, eps=m["eps"], clamp=m["clamp_value"], image_token_id=img), inputs, params)
    torch.testing.assert_close(out_img, f["out_image"], rtol=RTOL, atol=ATOL)
    assert torch.equal(out_img[3], f["x"][3])
    assert not torch.equal(out[3], f["x"][3])


# ---------------------------------------------------------------------------------------------------------------
# Ratio-2 pair compressor
# ---------------------------------------------------------------------------------------------------------------


def _pair_graph(d: int):
    b = GraphBuilder("pair_compressor_vs_sglang")
    kv, score = b.input("kv", "f32", ["T", d]), b.input("score", "f32", ["T", d])
    s_kv, s_score = b.input("state_kv", "f32", [1, d]), b.input("state_score", "f32", [1, d])
    pos = b.input("positions", "i64", ["T"])
    b.output(*b.pair_compressor(kv, score, s_kv, s_score, pos))
    return b.build()


def test_pair_compressor_pooling_matches_sglang(real_graph):
    """DeepseekV41Compressor.pool_pairs(kv2, score2). The graph's pair_compressor is exactly the pooling step:
    models/deepseek_v41.py `_compress` applies RMSNorm, RoPE and the fp4 QAT as separate nodes after it, so no
    inputs need to be chosen to make anything else the identity. The 20 recorded pairs are fed as one sequence
    of 40 tokens (pair j = positions 2j, 2j+1), once whole and once in pieces with odd boundaries, so the pending
    half-pair carried in state_kv / state_score is exercised too."""
    assert len(_nodes(real_graph, "pair_compressor")) == 3  # ratio-2 kv sources 2, 8, 14
    f = _load("pool_pairs")
    n_pairs, _, d = f["kv2"].shape
    kv, score = f["kv2"].reshape(2 * n_pairs, d), f["score2"].reshape(2 * n_pairs, d)
    g = _pair_graph(d)
    zero = torch.zeros(1, d)
    pooled, entry_pos, entry_idx, _, _ = run(
        g, {"kv": kv, "score": score, "state_kv": zero, "state_score": zero, "positions": torch.arange(2 * n_pairs)}
    )
    assert torch.equal(entry_idx, torch.arange(n_pairs)) and torch.equal(entry_pos, 2 * torch.arange(n_pairs))
    torch.testing.assert_close(pooled, f["pooled"], rtol=RTOL, atol=ATOL)

    s_kv, s_score, got = zero, zero, torch.full((n_pairs, d), float("nan"))
    for lo, hi in ((0, 7), (7, 8), (8, 9), (9, 22), (22, 23), (23, 40)):
        p, _, idx, s_kv, s_score = run(
            g,
            {"kv": kv[lo:hi], "score": score[lo:hi], "state_kv": s_kv, "state_score": s_score,
             "positions": torch.arange(lo, hi)},
        )  # fmt: skip
        ok = idx >= 0
        got[idx[ok]] = p[ok]
    torch.testing.assert_close(got, f["pooled"], rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------------------------
# Two-level indexer: candidate blocks, top-k among blocks
# ---------------------------------------------------------------------------------------------------------------


def _set(row: torch.Tensor) -> set[int]:
    vals = [int(v) for v in row.tolist() if v >= 0]
    assert len(vals) == len(set(vals)), row  # no id twice
    return set(vals)


def _indexer_attrs(cfg, real_graph) -> tuple[int, int]:
    """(ratio, block) of the real graph's candidate_blocks node, checked against the recording's block size."""
    (cb,) = _nodes(real_graph, "candidate_blocks")
    p = META["candidate_blocks"]
    assert cb.attrs["block"] == cfg.candidate_block_size == p["block_size"]
    two_level = [n for n in _nodes(real_graph, "topk_entries") if n.inputs[1] is not None]
    assert two_level and all(n.attrs["block"] == cb.attrs["block"] for n in two_level)
    return cb.attrs["ratio"], cb.attrs["block"]


def _indexer_graph(c: int, *, ratio: int, block: int, topk_blocks: int, k: int):
    b = GraphBuilder("candidate_blocks_vs_sglang")
    scores, pos = b.input("scores", "f32", ["T", c]), b.input("positions", "i64", ["T"])
    given = b.input("given_blocks", "i32", ["T", topk_blocks])
    blocks = b.candidate_blocks(scores, pos, ratio=ratio, topk_blocks=topk_blocks, block=block)
    picked = b.topk_entries(scores, blocks, topk=k, block=block)
    picked_given = b.topk_entries(scores, given, topk=k, block=block)  # level two alone, on sglang's blocks
    b.output(blocks, picked, picked_given)
    return b.build()


def test_candidate_blocks_and_topk_among_blocks_match_sglang(cfg, real_graph):
    """select_candidate_block_ids(scores, lens[:, None], 3, 8), then topk_among_blocks(scores, lens, blocks, 10, 8).
    sglang's row r has lens[r] visible entries; the graph expresses that as one decode query at position
    p = lens[r] - 1 of the ratio-1 candidate source (visible entries j < (p+1)//1, newest = lens[r] - 1), one
    graph run per row as the ops take one sequence per call. Compared as sets (sglang's outputs are unordered)."""
    ratio, block = _indexer_attrs(cfg, real_graph)
    assert ratio == 1
    f = _load("candidate_blocks")
    p = META["candidate_blocks"]
    g = _indexer_graph(f["scores"].shape[1], ratio=ratio, block=block, topk_blocks=p["topk_blocks"], k=p["k"])
    for r in range(f["scores"].shape[0]):
        n = int(f["lens"][r])
        blocks, picked, picked_given = run(
            g,
            {
                "scores": f["scores"][r : r + 1],
                "positions": torch.tensor([n - 1]),
                "given_blocks": f["blocks"][r : r + 1],
            },
        )
        assert blocks.shape == (1, p["topk_blocks"]) and picked.shape == (1, p["k"])
        assert _set(blocks[0]) == _set(f["blocks"][r]), (r, blocks[0].tolist(), f["blocks"][r].tolist())
        assert _set(picked[0]) == _set(f["picked"][r]), (r, picked[0].tolist(), f["picked"][r].tolist())
        assert _set(picked_given[0]) == _set(f["picked"][r]), r
        assert all(v < n for v in _set(picked[0]))  # nothing invisible is picked


# ---------------------------------------------------------------------------------------------------------------
# fp4 fake quant (both forms)
# ---------------------------------------------------------------------------------------------------------------


def test_fp4_fake_quant_matches_sglang(real_graph):
    """fake_quant_fp4(x, 32) (E2M1, ue8m0 per 32: index keys and queries) and fake_quant_compressed_kv(x) (E2M1,
    E4M3 per 16: the compressed KV entries), with the groups the real QAT graph uses. Compared exactly."""
    (g32,) = {n.attrs["group"] for n in _nodes(real_graph, "fake_quant_fp4")}
    (g16,) = {n.attrs["group"] for n in _nodes(real_graph, "fake_quant_fp4_e4m3")}
    assert (g32, g16) == (32, 16)
    f = _load("fp4_fake_quant")
    b = GraphBuilder("fp4_vs_sglang")
    x = _inp(b, "x", f["x"])
    b.output(b.fake_quant_fp4(x, group=g32), b.fake_quant_fp4_e4m3(x, group=g16))
    ue8m0, e4m3 = run(b.build(), {"x": f["x"]})
    for got, want in ((ue8m0, f["fake_quant_fp4_b32"]), (e4m3, f["fake_quant_compressed_kv"])):
        assert got.dtype == torch.float32 and got.shape == want.shape
        bad = (got != want).nonzero()
        assert bad.numel() == 0, f"{len(bad)} mismatches, first at {bad[:5].tolist()}"
