"""Tests of the independent V4.1-Flash reference (tests/oracles/deepseek_v41_ref.py).

The expected values are independent of the reference: numbers from MODEL_SPEC.md / the checkpoint config,
and outputs of sglang 0.5.23's torch functions recorded in tests/data/sglang_v41 (see its README).
"""

import hashlib
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "sglang_v41"


def _load_ref():
    spec = importlib.util.spec_from_file_location("deepseek_v41_ref", HERE / "deepseek_v41_ref.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


R = _load_ref()
META = json.loads((DATA / "meta.json").read_text())


@pytest.fixture(scope="module")
def real_cfg():
    return R.load_config()


@pytest.fixture(scope="module")
def tiny():
    cfg = R.tiny_config()
    return cfg, R.random_weights(cfg, seed=0)


def _prompt(T, seed=0, hi=250):
    return torch.randint(3, hi, (T,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# per-op parity with recorded sglang 0.5.23 outputs
# ---------------------------------------------------------------------------------------------------------------


def test_fp4_fake_quant_matches_sglang():
    f = load_file(DATA / "fp4_fake_quant.safetensors")
    assert torch.equal(R.fake_quant_fp4_ue8m0(f["x"], 32), f["fake_quant_fp4_b32"])
    assert torch.equal(R.fake_quant_fp4_e4m3(f["x"], 16), f["fake_quant_compressed_kv"])


def test_fake_quant_keeps_grid_values_at_power_of_two_scales():
    # amax exactly 6 * 2**k: the ue8m0 scale must be 2**k (not 2**(k+1)), so grid values survive unchanged
    for k in (-3, 0, 5):
        x = torch.tensor([6.0, 0.5, -1.5, 3.0] + [0.0] * 28) * 2.0**k
        assert torch.equal(R.fake_quant_fp4_ue8m0(x, 32), x)
    x = torch.tensor([448.0, 0.015625, -2.0, 1.125] + [0.0] * 28)
    assert torch.equal(R.fake_quant_fp8_ue8m0(x, 32), x)
    assert torch.equal(R.fake_quant_fp4_e4m3(torch.tensor([6.0, 0.5, -4.0, 1.5] + [0.0] * 12), 16),
                       torch.tensor([6.0, 0.5, -4.0, 1.5] + [0.0] * 12))


def test_pool_pairs_matches_sglang():
    f = load_file(DATA / "pool_pairs.safetensors")
    torch.testing.assert_close(R.pool_pairs(f["kv2"], f["score2"]), f["pooled"], rtol=1e-6, atol=1e-6)


def test_candidate_blocks_match_sglang():
    f = load_file(DATA / "candidate_blocks.safetensors")
    p = META["candidate_blocks"]
    for r in range(f["scores"].shape[0]):
        n = int(f["lens"][r])
        blocks = R.candidate_blocks(f["scores"][r], n, p["topk_blocks"], p["block_size"])
        assert blocks.tolist() == sorted(b for b in f["blocks"][r].tolist() if b >= 0), r
        picked = R.topk_in_blocks(f["scores"][r], n, blocks, p["k"], p["block_size"])
        assert sorted(picked.tolist()) == sorted(x for x in f["picked"][r].tolist() if x >= 0), r


def test_engram_gate_matches_sglang():
    f = load_file(DATA / "engram_gate.safetensors")
    g = META["engram_gate"]
    out = R.engram_gate(f["x"], f["kv"], f["q_weight"], f["k_weight"], g["eps"], g["clamp_value"])
    torch.testing.assert_close(out, f["out"], rtol=1e-6, atol=1e-6)
    img = f["input_ids"] == g["image_token_id"]
    assert img.any()
    torch.testing.assert_close(torch.where(img[:, None, None], f["x"], out), f["out_image"], rtol=1e-6, atol=1e-6)


def test_engram_token_map_multipliers_primes_hash_match_sglang(real_cfg):
    f = load_file(DATA / "engram_hash.safetensors")
    tmap = R.engram_token_map(real_cfg)
    assert int(tmap.max()) + 1 == 99092 == real_cfg["engram_compressed_vocab_size"]
    assert META["engram"]["compressed_classes"] == 99092
    digest = hashlib.sha256(tmap.to(torch.int32).numpy().astype("<i4").tobytes()).hexdigest()
    assert digest == META["engram"]["token_map_int32_le_sha256"]
    assert torch.equal(tmap[:4096], f["token_map_first_4096"].long())
    assert int(tmap[real_cfg["engram_pad_token_id"]]) == META["engram"]["pad_compressed"]
    assert torch.equal(R.engram_multipliers(real_cfg), f["multipliers"])
    assert R.engram_primes(real_cfg) == f["primes"].tolist()
    hash_ids = R.engram_hash_ids(real_cfg, f["input_ids"].tolist(), tmap)
    assert torch.equal(hash_ids, f["hash_ids"])


# ---------------------------------------------------------------------------------------------------------------
# Engram rules against spec numbers
# ---------------------------------------------------------------------------------------------------------------


def test_engram_primes_sum_to_config(real_cfg):
    primes = R.engram_primes(real_cfg)
    sums = [sum(p for per_n in layer for p in per_n) for layer in primes]
    assert sums == [384_006_168, 384_016_682] == real_cfg["engram_num_embeddings"]
    flat = [p for layer in primes for per_n in layer for p in per_n]
    assert len(set(flat)) == len(flat) == 2 * 3 * 8
    assert min(flat) > real_cfg["engram_vocab_size"] - 1
    for layer in primes:
        for per_n in layer:
            assert per_n == sorted(per_n)


def test_engram_multipliers_derivation(real_cfg):
    mult = R.engram_multipliers(real_cfg)
    assert mult.shape == (2, 4)
    assert bool((mult % 2 == 1).all())
    # the bound keeps c * mult inside int64 for every compressed id c < 99092
    assert int(mult.max()) * (99092 - 1) < 2**63
    # spec: default_rng(10007 * L) for L in engram_layer_ids -> the two layers get different multipliers
    assert mult[0].tolist() != mult[1].tolist()


def test_engram_hash_blocking_and_tiny_rules():
    cfg = R.tiny_config()
    ids = [5, 7, 9, 11, cfg["image_token_id"], 13, 17]
    h = R.engram_hash_ids(cfg, ids)
    assert h.shape == (7, 2, 4)
    primes = R.engram_primes(cfg)
    for li, layer in enumerate(primes):
        lo = 0
        for col, p in enumerate([p for per_n in layer for p in per_n]):
            assert bool(((h[:, li, col] >= lo) & (h[:, li, col] < lo + p)).all())
            lo += p
    # token 5 (right after the image) sees pad for its predecessors; so does token 0's look-back
    tmap = R.engram_token_map(cfg)
    mult = R.engram_multipliers(cfg)
    pad = int(tmap[2])
    c0, c1 = int(tmap[13]), pad
    assert int(h[5, 0, 0]) == ((c0 * int(mult[0, 0])) ^ (c1 * int(mult[0, 1]))) % primes[0][0][0]


# ---------------------------------------------------------------------------------------------------------------
# real config: roles and parameter counts
# ---------------------------------------------------------------------------------------------------------------


def test_real_config_roles(real_cfg):
    R.validate_config(real_cfg)
    src = {i: R.kv_source_of(real_cfg, i) for i in range(40)}
    assert [src[i] for i in (0, 1)] == [None, None]
    assert all(src[i] == 2 for i in range(2, 8))
    assert all(src[i] == 8 for i in range(8, 14))
    assert all(src[i] == 14 for i in range(14, 20))
    assert all(src[i] == 20 for i in range(20, 40))


def test_param_counts_real_config(real_cfg):
    pc = R.param_counts(real_cfg)
    assert abs(pc["backbone"] / 551.9e9 - 1) < 1e-3
    assert abs(pc["engram"] / 196.6e9 - 1) < 1e-3
    assert pc["engram"] == (384_006_168 + 384_016_682) * 256
    assert 13e9 < pc["dspark"] < 15e9  # spec: "about 14 B for 3 DSpark stages"


def test_validate_config_rejects_bad_roles():
    cfg = R.tiny_config()
    bad = dict(cfg, kv_source_layer_ids=[1, 4, 6])  # layer 1 has ratio 0
    with pytest.raises(ValueError):
        R.validate_config(bad)
    bad = dict(cfg, kv_source_layer_ids=[4, 6], index_source_layer_ids=[4, 6, 8])  # layer 2 has no source
    with pytest.raises(ValueError):
        R.validate_config(bad)


# ---------------------------------------------------------------------------------------------------------------
# mHC, RoPE, top-k ties
# ---------------------------------------------------------------------------------------------------------------


def test_mhc_post_orientation_non_symmetric():
    g = torch.Generator().manual_seed(3)
    X = torch.randn(4, 16, generator=g)
    y = torch.randn(16, generator=g)
    post = torch.rand(4, generator=g)
    C = torch.rand(4, 4, generator=g)
    assert not torch.allclose(C, C.t())
    out = R.hc_post(X, y, post, C)
    for k in range(4):
        expect = post[k] * y + sum(C[j, k] * X[j] for j in range(4))
        torch.testing.assert_close(out[k], expect)
    wrong = post[:, None] * y[None] + C @ X
    assert not torch.allclose(out, wrong)


def test_mhc_stats_layout_and_orientation():
    cfg = R.tiny_config()
    n, D = 4, 8
    fn = torch.zeros((2 + n) * n, n * D)
    base = torch.zeros((2 + n) * n)
    base[2 * n + n * 0 + 1] = 4.0  # C[0, 1] pre-softmax large: stream 0 should feed output stream 1
    scale = torch.ones(3)
    X = torch.randn(n, D, generator=torch.Generator().manual_seed(1))
    pre, post, C = R.hc_stats(X, fn, base, scale, cfg)
    torch.testing.assert_close(pre, torch.full((n,), 0.5 + cfg["hc_eps"]))
    torch.testing.assert_close(post, torch.ones(n))
    torch.testing.assert_close(C.sum(0), torch.ones(n), atol=1e-4, rtol=0)
    torch.testing.assert_close(C.sum(1), torch.ones(n), atol=2e-2, rtol=0)
    assert C[0, 1] > 0.7 and C[0, 1] > 2 * C[1, 0]  # the transpose would swap these
    out = R.hc_post(X, torch.zeros(D), torch.zeros(n), C)
    assert int(((out[1][None] - X) ** 2).sum(-1).argmin()) == 0


def test_rope_inverse_interleaved_and_relative():
    cfg = R.tiny_config()
    f = R.rope_freqs(cfg, 2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 32, generator=g)
    pos = torch.tensor([0.0, 1.0, 7.0, 100.0, 4095.0])
    y = R.apply_rope(x, pos, f)
    torch.testing.assert_close(y[..., :-8], x[..., :-8])
    torch.testing.assert_close(R.apply_rope(y, pos, f, inverse=True), x, atol=1e-5, rtol=1e-5)
    # interleaved pairs: (x[24], x[25]) rotates by pos * f_0
    a = 100.0 * float(f[0])
    torch.testing.assert_close(y[3, 0, 24], x[3, 0, 24] * math.cos(a) - x[3, 0, 25] * math.sin(a))
    # dot products depend only on the position difference
    q, k = torch.randn(1, 32, generator=g), torch.randn(1, 32, generator=g)

    def dot(m, n):
        return (R.apply_rope(q, torch.tensor([m]), f) * R.apply_rope(k, torch.tensor([n]), f)).sum()

    torch.testing.assert_close(dot(10.0, 3.0), dot(57.0, 50.0), atol=1e-4, rtol=1e-4)


def test_rope_yarn_real_config(real_cfg):
    f0 = R.rope_freqs(real_cfg, 0)
    i = torch.arange(32, dtype=torch.float64)
    torch.testing.assert_close(f0.double(), 10000.0 ** (-2 * i / 64), rtol=1e-6, atol=0)
    f = R.rope_freqs(real_cfg, 1).double()
    plain = 160000.0 ** (-2 * i / 64)
    # spec §2.7: low = 15, high = 25 for base 160000
    torch.testing.assert_close(f[:16], plain[:16], rtol=1e-6, atol=0)
    torch.testing.assert_close(f[25:], plain[25:] / 16, rtol=1e-6, atol=0)
    ramp = (20 - 15) / 10
    assert abs(float(f[20]) / float(plain[20] / 16 * ramp + plain[20] * (1 - ramp)) - 1) < 1e-6
    torch.testing.assert_close(R.rope_freqs(real_cfg, 2), R.rope_freqs(real_cfg, 1))


def test_topk_tie_rule():
    s = torch.tensor([1.0, 3.0, 0.0, 3.0, 0.0, -math.inf, 0.0])
    assert R.topk_lowest_index(s, 3).tolist() == [1, 3, 0]
    assert R.topk_lowest_index(s, 4).tolist() == [1, 3, 0, 2]
    assert R.topk_lowest_index(s, 10).tolist() == [1, 3, 0, 2, 4, 6]
    blocks = R.candidate_blocks(torch.tensor([0.0] * 12), 12, 2, 4)
    assert blocks.tolist() == [0, 2]  # newest block forced; tie between blocks 0 and 1 -> 0


# ---------------------------------------------------------------------------------------------------------------
# tiny model
# ---------------------------------------------------------------------------------------------------------------


def test_tiny_config_roles_and_pruning():
    cfg = R.tiny_config()
    R.validate_config(cfg)
    T = 40
    assert (T + 1) // 2 > cfg["index_topk"]  # the ratio-2 indexer selects
    assert T > cfg["candidate_topk_blocks"] * cfg["candidate_block_size"] > cfg["index_topk"]  # level one prunes
    W = R.random_weights(cfg, 0)
    assert all(bool((t != 0).any()) for t in W.values())
    assert "layers.1.engram.embed.weight" in W and "layers.6.attn.compressor.wkv.weight" in W
    assert "layers.6.attn.compressor.wgate.weight" not in W and "layers.2.attn.compressor.wgate.weight" in W
    assert "layers.3.attn.compressor.wkv.weight" not in W and "layers.8.attn.indexer.wq_b.weight" in W
    assert "layers.8.attn.indexer.wk.weight" not in W


def test_tiny_forward_finite_and_causal(tiny):
    cfg, W = tiny
    ids = _prompt(40)
    lg = R.forward(cfg, W, ids)
    assert lg.shape == (40, cfg["vocab_size"]) and bool(lg.isfinite().all())
    ids2 = ids.clone()
    ids2[30] = (ids2[30] + 1) % 250
    lg2 = R.forward(cfg, W, ids2)
    torch.testing.assert_close(lg2[:30], lg[:30], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(lg2[30:], lg[30:])


def test_tiny_quant_points_change_logits(tiny):
    cfg, W = tiny
    ids = _prompt(24, seed=1)
    a = R.forward(cfg, W, ids)
    b = R.forward(cfg, W, ids, quant=True)
    assert bool(b.isfinite().all())
    assert not torch.allclose(a, b)


def test_incremental_decode_equals_full(tiny):
    cfg, W = tiny
    ids = _prompt(40, seed=2)
    full = R.forward(cfg, W, ids)
    st = R.new_state(cfg)
    parts = [R.forward_chunk(cfg, W, st, ids[:23])]
    parts += [R.forward_chunk(cfg, W, st, ids[j:j + 1]) for j in range(23, 40)]
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-4, rtol=1e-5)
    assert st["ckv"][2].shape[0] == 20 and st["ckv"][6].shape[0] == 40


def test_compact_equals_exact_within_keep(tiny):
    cfg, W = tiny
    ids = _prompt(40, seed=3)
    exact = R.forward(cfg, W, ids)
    assert torch.equal(R.forward(cfg, W, ids, mode="compact", keep_tokens=40), exact)
    c = R.forward(cfg, W, ids, mode="compact", keep_tokens=16)
    assert bool(c[:24].isnan().all()) and bool(c[24:].isfinite().all())
    assert not torch.allclose(c[24:], exact[24:])
    with pytest.raises(ValueError):
        R.forward(cfg, W, ids, mode="compact", keep_tokens=12)  # < window 8 + block 5


def test_dspark_draft_shapes(tiny):
    cfg, W = tiny
    ids = _prompt(20, seed=4)
    lg, _, cap = R.forward_with_hidden(cfg, W, ids)
    assert sorted(cap["entry"]) == cfg["dspark_target_layer_ids"]
    assert W["mtp.0.main_proj.weight"].shape == (64, 3 * 64)
    out = R.dspark_draft(cfg, W, cap["entry"], anchor_token=int(lg[-1].argmax()))
    B, V = cfg["dspark_block_size"], cfg["vocab_size"]
    assert out["hidden"].shape == (B, 64)
    assert out["base_logits"].shape == out["step_logits"].shape == (B - 1, V)
    assert out["draft_tokens"].shape == out["confidence"].shape == (B - 1,)
    assert bool(((out["confidence"] > 0) & (out["confidence"] < 1)).all())
    assert bool(out["step_logits"].isfinite().all())
    assert out["draft_tokens"].tolist() == out["step_logits"].argmax(-1).tolist()


def test_sliding_window_receptive_field():
    # two SWA-only layers of window W: logits at t see tokens >= t - 2 (W - 1) and nothing earlier
    cfg = R.tiny_config()
    cfg.update(num_hidden_layers=2, compress_ratios=[0, 0, 0, 0, 0], kv_source_layer_ids=[],
               index_source_layer_ids=[], candidate_source_layer_id=-1, engram_layer_ids=[],
               engram_num_embeddings=[], dspark_target_layer_ids=[0, 1, 1])
    W = R.random_weights(cfg, seed=5)
    ids = _prompt(30, seed=5)
    ids2 = ids.clone()
    ids2[5] = (ids2[5] + 7) % 250
    a, b = R.forward(cfg, W, ids), R.forward(cfg, W, ids2)
    reach = 5 + 2 * (cfg["sliding_window"] - 1)
    assert not torch.allclose(a[reach], b[reach])
    torch.testing.assert_close(a[reach + 1:], b[reach + 1:], atol=1e-6, rtol=1e-6)


def test_indexer_and_candidate_level_are_active(tiny):
    cfg, W = tiny
    ids = _prompt(40, seed=6)
    base = R.forward(cfg, W, ids)
    no_topk = R.forward(dict(cfg, index_topk=10**6), W, ids)  # every visible entry kept
    assert not torch.allclose(base, no_topk)
    no_cand = R.forward(dict(cfg, candidate_topk_blocks=10**6), W, ids)  # level one keeps every block
    assert not torch.allclose(base[-8:], no_cand[-8:])
    # layers before the first candidate consumer do not see the candidate level
    early = dict(cfg, candidate_topk_blocks=10**6)
    torch.testing.assert_close(R.forward(early, W, ids[:12]), R.forward(cfg, W, ids[:12]))


def test_prefill_decode_step_and_bad_input(tiny):
    cfg, W = tiny
    ids = _prompt(12, seed=7)
    full = R.forward(cfg, W, ids)
    lg, st = R.prefill(cfg, W, ids[:11])
    torch.testing.assert_close(R.decode_step(cfg, W, st, int(ids[11])), full[11], atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError):
        R.forward(cfg, W, torch.tensor([0, cfg["vocab_size"]]))
    with pytest.raises(ValueError):
        R.forward(cfg, W, ids, mode="fast")


@pytest.mark.parametrize("ratio", [1, 2])
def test_compressed_entry_visibility(ratio):
    # one kv-source layer with window 1: token p reaches a later query only through compressed entry
    # j = p // ratio, which is visible from t = ratio * j + ratio - 1 on (j < floor((t+1)/ratio))
    cfg = R.tiny_config()
    cfg.update(num_hidden_layers=1, compress_ratios=[ratio, 0, 0, 0], kv_source_layer_ids=[0],
               index_source_layer_ids=[0], candidate_source_layer_id=-1, engram_layer_ids=[],
               engram_num_embeddings=[], dspark_target_layer_ids=[0, 0, 0], sliding_window=1, index_topk=64)
    W = R.random_weights(cfg, seed=8)
    ids = _prompt(16, seed=8)
    p = 6
    ids2 = ids.clone()
    ids2[p] = (ids2[p] + 11) % 250
    a, b = R.forward(cfg, W, ids), R.forward(cfg, W, ids2)
    first = ratio * (p // ratio) + ratio - 1
    torch.testing.assert_close(a[:p], b[:p])
    if first > p:
        torch.testing.assert_close(a[p + 1: first], b[p + 1: first])
    for t in range(max(first, p + 1), 16):
        assert not torch.allclose(a[t], b[t]), t
