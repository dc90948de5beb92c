"""Presets: the real configs carry the spec's numbers; tiny/small keep the real key set and cover every layer role."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.errors import ConfigError
from deepinfer.models.presets import (
    CONFIG_DIR,
    engram_num_embeddings,
    model_name_for,
    preset_config,
    text_config,
    weight_block_size,
)

V4, V41 = "deepseek-v4-flash", "deepseek-v4.1-flash"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "configs"


def test_real_v4_numbers():
    c = preset_config(V4, "real")
    assert c["model_type"] == "deepseek_v4" and model_name_for(c) == V4
    assert (c["hidden_size"], c["num_hidden_layers"], c["n_routed_experts"], c["vocab_size"]) == (4096, 43, 256, 129280)
    assert (c["num_hash_layers"], c["sliding_window"], c["index_topk"], c["head_dim"]) == (3, 128, 512, 512)
    assert weight_block_size(c) == (128, 128)
    ratios = c["compress_ratios"]
    assert len(ratios) == 46 and ratios[:2] == [0, 0] and ratios[43:] == [0, 0, 0]
    assert all(ratios[i] == 4 for i in range(2, 43, 2)) and all(ratios[i] == 128 for i in range(3, 43, 2))
    assert c["rope_scaling"]["factor"] == 16 and c["compress_rope_theta"] == 160000


def test_real_v41_numbers():
    c = preset_config(V41, "real")
    t = text_config(c)
    assert c["model_type"] == "deepseek_v41" and model_name_for(c) == V41
    assert (t["hidden_size"], t["n_routed_experts"], t["num_hidden_layers"], t["vocab_size"]) == (5120, 384, 40, 129280)
    assert t["rms_norm_eps"] == 1e-20 and t["q_lora_rank"] == 1280
    assert weight_block_size(c) == (32, 32)
    assert t["kv_source_layer_ids"] == [2, 8, 14, 20] and t["candidate_source_layer_id"] == 20
    assert t["engram_layer_ids"] == [1, 14] and t["engram_compressed_vocab_size"] == 99092


def test_engram_primes_reproduce_the_real_table_sizes():
    t = text_config(preset_config(V41, "real"))
    got = engram_num_embeddings(t["engram_vocab_size"], 2, t["engram_max_ngram_size"], t["engram_n_heads"])
    assert got == t["engram_num_embeddings"] == [384006168, 384016682]


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/configs not present")
def test_packaged_configs_equal_shared_ones():
    for name in ("deepseek-v4-flash.config.json", "deepseek-v4.1-flash.config.json"):
        assert json.loads((CONFIG_DIR / name).read_text()) == json.loads((SHARED / name).read_text())


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_scaled_presets_keep_the_real_keys(preset):
    for model in (V4, V41):
        real, c = preset_config(model, "real"), preset_config(model, preset)
        assert set(c) == set(real)
        assert set(text_config(c)) == set(text_config(real))
        assert text_config(c)["vocab_size"] == 129280
        assert model_name_for(c) == model


def test_v4_tiny_layer_map():
    c = preset_config(V4, "tiny")
    n = c["num_hidden_layers"]
    ratios = c["compress_ratios"][:n]
    assert c["hidden_size"] == 64
    assert {0, 4} <= set(ratios) and any(r > 4 for r in ratios)  # SWA, CSA and HCA layers
    assert c["num_hash_layers"] < n  # both hash-routed and score-routed layers
    assert c["rope_scaling"]["type"] == "yarn"
    assert all(0 <= t < n for t in c["dspark_target_layer_ids"])
    assert c["index_topk"] < 16  # the indexer selects on short prompts


def test_v41_tiny_layer_roles():
    t = text_config(preset_config(V41, "tiny"))
    n = t["num_hidden_layers"]
    r = t["compress_ratios"]
    assert t["hidden_size"] == 64 and len(r) == n + t["num_nextn_predict_layers"]
    assert set(r[:n]) == {0, 1, 2} and r[n:] == [0, 0, 0]
    kv, idx, cand = t["kv_source_layer_ids"], t["index_source_layer_ids"], t["candidate_source_layer_id"]
    assert set(kv) <= set(idx) and cand in kv and r[cand] == 1
    assert any(r[i] == 2 and i not in kv for i in range(n))  # ratio-2 sharers
    assert any(r[i] == 1 and i not in idx for i in range(n))  # ratio-1 layers reusing a selection
    assert any(i > cand and i in idx for i in range(n))  # re-selection inside the candidate blocks
    assert all(0 <= e < n for e in t["engram_layer_ids"]) and any(e in kv for e in t["engram_layer_ids"])
    assert t["engram_num_embeddings"] == engram_num_embeddings(
        t["engram_vocab_size"], len(t["engram_layer_ids"]), t["engram_max_ngram_size"], t["engram_n_heads"]
    )
    assert all(0 <= x < n for x in t["dspark_target_layer_ids"]) and t["dspark_noise_token_id"] == 128799


def test_presets_are_fresh_copies():
    a = preset_config(V41, "tiny")
    a["text_config"]["hidden_size"] = 1
    assert preset_config(V41, "tiny")["text_config"]["hidden_size"] == 64
    b = preset_config(V4, "real")
    b["hidden_size"] = 1
    assert preset_config(V4, "real")["hidden_size"] == 4096


def test_unknown_model_or_preset():
    with pytest.raises(ConfigError, match="llama"):
        preset_config("llama", "tiny")
    with pytest.raises(ConfigError, match="huge"):
        preset_config(V4, "huge")
    with pytest.raises(ConfigError, match="model_type"):
        model_name_for({"model_type": "llama"})
    with pytest.raises(ConfigError, match="weight_block_size"):
        weight_block_size({"quantization_config": {}})


ORACLE = Path(__file__).resolve().parents[1] / "oracles" / "deepseek_v41_ref.py"


@pytest.mark.skipif(not ORACLE.is_file(), reason="V4.1 oracle not present")
@pytest.mark.parametrize("preset", ["tiny", "small", "real"])
def test_v41_presets_satisfy_the_oracle_role_rules(preset):
    """The independent V4.1 reference (tests/oracles) accepts the presets' layer roles and Engram sizes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_v41_oracle_for_presets", ORACLE)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    t = dict(text_config(preset_config(V41, preset)))
    ref.validate_config(t)
    assert [sum(p for per_n in layer for p in per_n) for layer in ref.engram_primes(t)] == t["engram_num_embeddings"]


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_v4_presets_build(preset):
    from deepinfer.models import deepseek_v4
    from deepinfer.models.checkpoint import checkpoint_params, params_bytes

    cfg = preset_config(V4, preset)
    deepseek_v4.build_graph(deepseek_v4.parse_config(cfg))
    size = params_bytes(checkpoint_params(V4, cfg))
    assert size < (50e6 if preset == "tiny" else 300e6)
