"""Model presets: ``config.json`` dicts (the checkpoints' own keys) at three sizes.

    preset_config(model, preset) -> dict

- ``real``: the released config, read from ``models/configs/<model>.config.json`` (MODEL_SPEC §1).
- ``tiny``: hidden 64, a handful of layers that still cover every layer role of the model; for fast CPU tests.
- ``small``: hidden 256 with the real window/ratio/block constants; still CPU-runnable (about 150 MB of weights).

The scaled-down presets keep the real vocabulary (129,280 ids), so the real tokenizer, the special ids (DSpark
noise token 128799, image token 129264) and Engram's compressed vocabulary (99,092 classes) stay valid.

V4-Flash tiny layer map (MODEL_SPEC §1.1 scaled down): 0, 1 sliding window; 2, 4 CSA (ratio 4); 3, 5 HCA (ratio 8
instead of 128, so that "several compression windows" is a short prompt); layers 0-2 hash-routed; 3 trailing DSpark
entries. V4.1-Flash tiny roles (§1.2 scaled down): 0 SWA; 1 SWA + Engram; 2 ratio-2 kv/index source; 3 ratio-2
sharer; 4 ratio-2 kv/index source + Engram; 5 ratio-2 sharer; 6 ratio-1 kv/index/candidate source; 7 ratio-1
sharer (reuses 6's selection); 8 ratio-1 index source re-selecting inside 6's candidate blocks; 9 ratio-1 sharer;
then 3 DSpark stages on target layers 7-9.
"""

from __future__ import annotations

import copy
import json
import math
from functools import cache
from pathlib import Path

from deepinfer.errors import ConfigError

CONFIG_DIR = Path(__file__).parent / "configs"
PRESETS = ("tiny", "small", "real")
MODEL_TYPES = {"deepseek_v4": "deepseek-v4-flash", "deepseek_v41": "deepseek-v4.1-flash"}
_CONFIG_FILES = {
    "deepseek-v4-flash": "deepseek-v4-flash.config.json",
    "deepseek-v4.1-flash": "deepseek-v4.1-flash.config.json",
}


@cache
def _real_config_text(model: str) -> str:
    path = CONFIG_DIR / _CONFIG_FILES[model]
    try:
        return path.read_text()
    except OSError as e:
        raise ConfigError(f"real config for {model} is missing ({path}): {e.strerror}") from None


def real_config(model: str) -> dict:
    _check_model(model)
    return json.loads(_real_config_text(model))


def _check_model(model: str) -> None:
    if model not in _CONFIG_FILES:
        raise ConfigError(f"unknown model {model!r}; known: {', '.join(_CONFIG_FILES)}")


# ---------------------------------------------------------------------------------------------------
# Engram table sizes (MODEL_SPEC §2.14)
# ---------------------------------------------------------------------------------------------------


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % p for p in range(3, math.isqrt(n) + 1, 2))


def engram_primes(vocab_size: int, n_layers: int, max_ngram: int, n_heads: int) -> list[list[list[int]]]:
    """Primes [layer][ngram size 2..max][head]: one ascending run of distinct primes > vocab_size - 1, drawn in
    (layer, n, head) order; each (layer, n) search restarts at vocab_size - 1 and skips primes already used."""
    used: set[int] = set()
    out = []
    for _ in range(n_layers):
        per_layer = []
        for _n in range(2, max_ngram + 1):
            c, heads = vocab_size - 1, []
            for _h in range(n_heads):
                c += 1
                while c in used or not _is_prime(c):
                    c += 1
                used.add(c)
                heads.append(c)
            per_layer.append(heads)
        out.append(per_layer)
    return out


def engram_num_embeddings(vocab_size: int, n_layers: int, max_ngram: int, n_heads: int) -> list[int]:
    """Rows of each Engram layer's table: the sum of that layer's primes."""
    return [sum(sum(h) for h in layer) for layer in engram_primes(vocab_size, n_layers, max_ngram, n_heads)]


# ---------------------------------------------------------------------------------------------------
# Scaled-down presets
# ---------------------------------------------------------------------------------------------------


def _v4(preset: str) -> dict:
    cfg = real_config("deepseek-v4-flash")
    if preset == "tiny":
        dims = dict(
            hidden_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            head_dim=32,
            qk_rope_head_dim=8,
            q_lora_rank=32,
            o_lora_rank=16,
            o_groups=2,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=4,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            num_hash_layers=3,
            sliding_window=8,
            compress_ratios=[0, 0, 4, 8, 4, 8, 0, 0, 0],
            dspark_target_layer_ids=[3, 4, 5],
            dspark_markov_rank=8,
            max_position_embeddings=65536,
        )
        rope_l0 = 4096
    else:
        dims = dict(
            hidden_size=256,
            num_hidden_layers=6,
            num_attention_heads=8,
            head_dim=128,
            qk_rope_head_dim=64,
            q_lora_rank=256,
            o_lora_rank=128,
            o_groups=4,
            index_n_heads=4,
            index_head_dim=64,
            index_topk=64,
            moe_intermediate_size=128,
            n_routed_experts=16,
            num_experts_per_tok=4,
            num_hash_layers=3,
            sliding_window=128,
            compress_ratios=[0, 0, 4, 128, 4, 128, 0, 0, 0],
            dspark_target_layer_ids=[3, 4, 5],
            dspark_markov_rank=32,
        )
        rope_l0 = cfg["rope_scaling"]["original_max_position_embeddings"]
    cfg.update(dims)
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], original_max_position_embeddings=rope_l0)
    return cfg


def _v41(preset: str) -> dict:
    cfg = real_config("deepseek-v4.1-flash")
    text = cfg["text_config"]
    roles = dict(
        num_hidden_layers=10,
        compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
        kv_source_layer_ids=[2, 4, 6],
        index_source_layer_ids=[2, 4, 6, 8],
        candidate_source_layer_id=6,
        engram_layer_ids=[1, 4],
        engram_max_ngram_size=4,
        num_nextn_predict_layers=3,
        dspark_target_layer_ids=[7, 8, 9],
    )
    if preset == "tiny":
        dims = dict(
            hidden_size=64,
            num_attention_heads=4,
            head_dim=32,
            qk_rope_head_dim=8,
            q_lora_rank=32,
            o_lora_rank=16,
            o_groups=2,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            sliding_window=8,
            index_n_heads=2,
            index_head_dim=32,
            index_topk=6,
            candidate_topk_blocks=3,
            candidate_block_size=4,
            engram_vocab_size=64,
            engram_n_heads=2,
            engram_head_dim=32,
            dspark_markov_rank=8,
            dspark_n_routed_experts=4,
            dspark_num_experts_per_tok=2,
            max_position_embeddings=65536,
        )
        rope_l0 = 4096
        vision = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    else:
        dims = dict(
            hidden_size=256,
            num_attention_heads=8,
            head_dim=128,
            qk_rope_head_dim=64,
            q_lora_rank=256,
            o_lora_rank=128,
            o_groups=4,
            moe_intermediate_size=128,
            n_routed_experts=16,
            num_experts_per_tok=4,
            sliding_window=128,
            index_n_heads=4,
            index_head_dim=128,
            index_topk=64,
            candidate_topk_blocks=16,
            candidate_block_size=8,
            engram_vocab_size=4096,
            engram_n_heads=4,
            engram_head_dim=64,
            dspark_markov_rank=32,
            dspark_n_routed_experts=8,
            dspark_num_experts_per_tok=3,
        )
        rope_l0 = text["rope_scaling"]["original_max_position_embeddings"]
        vision = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=512)
    text.update(roles)
    text.update(dims)
    text["rope_scaling"] = dict(text["rope_scaling"], original_max_position_embeddings=rope_l0)
    text["engram_num_embeddings"] = engram_num_embeddings(
        text["engram_vocab_size"], len(text["engram_layer_ids"]), text["engram_max_ngram_size"], text["engram_n_heads"]
    )
    cfg["vision_config"].update(vision)
    return cfg


_BUILDERS = {"deepseek-v4-flash": _v4, "deepseek-v4.1-flash": _v41}


def preset_config(model: str, preset: str = "tiny") -> dict:
    """A config.json dict for ``model`` (``deepseek-v4-flash`` / ``deepseek-v4.1-flash``) at ``preset``
    (``tiny`` / ``small`` / ``real``). Always a fresh copy."""
    _check_model(model)
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r} for {model}; known: {', '.join(PRESETS)}")
    if preset == "real":
        return real_config(model)
    return copy.deepcopy(_BUILDERS[model](preset))


def text_config(config: dict) -> dict:
    """The language-model part of a config: V4.1 nests it under ``text_config``; V4 is flat."""
    return config.get("text_config", config)


def model_name_for(config: dict, where: str = "config") -> str:
    """The CLI model name for a config.json dict, from its ``model_type``."""
    mt = config.get("model_type")
    try:
        return MODEL_TYPES[mt]
    except KeyError:
        known = ", ".join(MODEL_TYPES)
        raise ConfigError(f"{where}: model_type {mt!r} is not a supported model (known: {known})") from None


def weight_block_size(config: dict) -> tuple[int, int]:
    """The FP8 weight block [rows, cols] of a config (``quantization_config.weight_block_size``)."""
    q = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
    b = q.get("weight_block_size")
    if not (isinstance(b, list | tuple) and len(b) == 2 and all(isinstance(x, int) and x > 0 for x in b)):
        raise ConfigError(f"quantization_config.weight_block_size must be two positive ints, got {b!r}")
    return int(b[0]), int(b[1])
