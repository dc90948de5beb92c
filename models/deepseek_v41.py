"""DeepSeek-V4.1-Flash as a deepinfer graph (MODEL_SPEC §1.2, §2.2–2.3, §2.13–2.15, §3, §4).

``parse_config`` reads a checkpoint ``config.json`` (the nested ``text_config`` form, or the flat text config)
into a :class:`V41Config`. ``build_graph`` writes the backbone over a symbolic token count ``T`` (prefill and
decode share one graph); ``build_dspark_graph`` writes the DSpark draft block.

Graph interface (one sequence per call; ``graph.meta["caches"]`` lists the caches in order, each with its
``init`` value: 0, except the Engram history which starts at -1):

    inputs   tokens i64[T], positions i64[T] (contiguous: start .. start+T-1), then the caches
             cache.engram.history   i64[N-1]      the previous N-1 token ids (oldest first), -1 = none
             cache.{i}.swa          f32[W, d]     window KV ring of every layer, position p in slot p % W
             cache.{s}.ckv          f32[C{r}, d]  shared compressed KV of kv source s (ratio r), row j = group j
             cache.{s}.idx_k        f32[C{r}, di] shared index keys of kv source s
             cache.{s}.cmp_kv/_score f32[1, d]    pending first token of an unfinished pair (ratio-2 sources)
    outputs  logits f32[T, vocab] (compact mode: [min(T, keep_tokens), vocab], the last rows), then the
             updated caches in input order, then (``hidden=True``) the streams f32[T', n_hc, D] at entry to each
             DSpark target layer (after Engram), in dspark_target_layer_ids order.

``C1``/``C2`` are symbols: the caller allocates ceil(max_len / r) rows. Parameters are named like the checkpoint
tensors (§4.1); ``weights="checkpoint"`` gives checkpoint dtypes (FP8 E4M3 with ue8m0 32x32 block scales,
packed FP4 experts, FP8 Engram tables with a scale per 32 values), ``weights="float"`` f32 everywhere.

Modes (§2.13): ``mode="exact"`` runs every layer on every token. ``mode="compact"`` is DeepSeek's decoder SWA
bounded replay: layers >= max(kv_source_layer_ids) run on the last ``keep_tokens`` rows only (the first of them
still compresses every row) and, when rows were dropped, their windows are floored at the first kept row.
Set by the argument, else ``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE`` / ``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``,
else the config keys ``yoco_prefill_truncation_mode`` / ``yoco_prefill_keep_tokens`` (default exact, 140).
``qat=True`` adds the QAT fake-quant points (§2.6, §2.13, §4.4); default off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from deepinfer.errors import ConfigError
from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.graph import Graph, Value
from deepinfer.ir.shapes import dmax, sym
from deepinfer.models.deepseek_v4 import _fp8_block, _get, _moe, _rope, _Weights, param_count, shared_fields
from deepinfer.models.presets import engram_primes

MODE_ENV = "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"
KEEP_ENV = "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"
DEFAULT_KEEP = 140


@dataclass(frozen=True)
class V41Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress_ratios: tuple[int, ...]
    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    candidate_source: int  # -1: no candidate level
    candidate_topk_blocks: int
    candidate_block_size: int
    n_routed_experts: int
    experts_per_tok: int
    moe_inter: int
    route_scale: float
    scoring_func: str
    norm_topk_prob: bool
    swiglu_limit: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: dict | None
    fp8_block: int | None
    expert_dtype: str
    engram_layers: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_id: int
    engram_compressed_vocab: int
    image_token_id: int
    num_mtp_layers: int
    dspark_block_size: int
    dspark_noise_token: int
    dspark_targets: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_experts: int
    dspark_experts_per_tok: int
    truncation_mode: str
    keep_tokens: int
    max_position_embeddings: int
    hash_layers: tuple[bool, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)

    def rope_attrs(self, ratio: int) -> dict:
        """Ratio-0 layers: rope_theta without YaRN; ratio 1/2: compress_rope_theta with YaRN (§2.7)."""
        attrs: dict[str, Any] = {"rope_dim": self.rope_dim, "theta": float(self.rope_theta)}
        if ratio > 0:
            attrs["theta"] = float(self.compress_rope_theta)
            if self.yarn is not None:
                attrs.update(
                    yarn_factor=float(self.yarn["factor"]),
                    yarn_orig_len=int(self.yarn["original_max_position_embeddings"]),
                    beta_fast=float(self.yarn["beta_fast"]),
                    beta_slow=float(self.yarn["beta_slow"]),
                )
        return attrs

    def kv_source_of(self, layer: int) -> int:
        r = self.compress_ratios[layer]
        return max(s for s in self.kv_sources if s <= layer and self.compress_ratios[s] == r)


# ---------------------------------------------------------------------------------------------------
# Config parsing
# ---------------------------------------------------------------------------------------------------


def _int_list(d: dict, key: str, default: Any = ...) -> tuple[int, ...]:
    v = d.get(key, default)
    if v is ...:
        raise ConfigError(f"config: missing key {key!r}")
    if not isinstance(v, list | tuple) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ConfigError(f"config: key {key!r} must be a list of non-negative ints, got {v!r}")
    return tuple(int(x) for x in v)


def _mode_settings(d: dict, top: dict) -> tuple[str, int]:
    mode = os.environ.get(MODE_ENV) or d.get("yoco_prefill_truncation_mode") or top.get("yoco_prefill_truncation_mode")
    mode = mode or "exact"
    if mode not in ("exact", "compact"):
        raise ConfigError(f"config: {MODE_ENV} / yoco_prefill_truncation_mode must be exact or compact, got {mode!r}")
    keep: Any = os.environ.get(KEEP_ENV)
    if keep is not None:
        try:
            keep = int(keep)
        except ValueError:
            raise ConfigError(f"config: {KEEP_ENV} must be an integer, got {keep!r}") from None
    else:
        keep = d.get("yoco_prefill_keep_tokens", top.get("yoco_prefill_keep_tokens", DEFAULT_KEEP))
    if not isinstance(keep, int) or isinstance(keep, bool) or keep <= 0:
        raise ConfigError(f"config: key 'yoco_prefill_keep_tokens' must be a positive integer, got {keep!r}")
    return mode, keep


def parse_config(d: dict) -> V41Config:
    """A V41Config from a config.json dict (nested ``text_config`` or flat); a bad key raises ConfigError."""
    if not isinstance(d, dict):
        raise ConfigError(f"config: expected a JSON object, got {type(d).__name__}")
    top = d
    if "text_config" in d:
        if not isinstance(d["text_config"], dict):
            raise ConfigError("config: key 'text_config' must be an object")
        d = dict(d["text_config"])
    n = _get(d, "num_hidden_layers")
    ratios = _int_list(d, "compress_ratios")
    if len(ratios) < n or any(r not in (0, 1, 2) for r in ratios[:n]):
        raise ConfigError(f"config: key 'compress_ratios' must list >= {n} ratios from 0/1/2, got {list(ratios)!r}")
    ratios = ratios[:n]
    theta, ctheta, yarn = _rope(d)
    if _get(d, "num_key_value_heads", int, 1) != 1:
        raise ConfigError("config: key 'num_key_value_heads' must be 1 (V4.1 is shared-KV MQA)")
    q = top.get("quantization_config") or d.get("quantization_config")
    expert_dtype = (q or {}).get("expert_dtype") if isinstance(q, dict) else None
    expert_dtype = expert_dtype or d.get("expert_dtype") or ("fp4" if q else "bf16")
    if expert_dtype not in ("fp4", "fp8", "bf16"):
        raise ConfigError(f"config: key 'expert_dtype' must be fp4/fp8/bf16, got {expert_dtype!r}")
    mode, keep = _mode_settings(d, top)
    engram_layers = _int_list(d, "engram_layer_ids", [])
    engram_rows = _int_list(d, "engram_num_embeddings", [0] * len(engram_layers))
    image = d.get("image_token_id", top.get("image_token_id"))
    cfg = V41Config(
        num_layers=n,
        compress_ratios=ratios,
        kv_sources=_int_list(d, "kv_source_layer_ids"),
        index_sources=_int_list(d, "index_source_layer_ids"),
        candidate_source=int(_get(d, "candidate_source_layer_id", int, -1, positive=False)),
        candidate_topk_blocks=_get(d, "candidate_topk_blocks", int, 1),
        candidate_block_size=_get(d, "candidate_block_size", int, 1),
        rope_theta=theta,
        compress_rope_theta=ctheta,
        yarn=yarn,
        fp8_block=_fp8_block(top) if "quantization_config" in top else _fp8_block(d),
        expert_dtype=expert_dtype,
        engram_layers=engram_layers,
        engram_num_embeddings=engram_rows,
        engram_max_ngram=_get(d, "engram_max_ngram_size", int, 4) if engram_layers else 1,
        engram_vocab_size=_get(d, "engram_vocab_size", int, 1),
        engram_n_heads=_get(d, "engram_n_heads", int, 1),
        engram_head_dim=_get(d, "engram_head_dim", int, 1),
        engram_pad_id=_get(d, "engram_pad_token_id", int, 2, positive=False),
        engram_compressed_vocab=_get(d, "engram_compressed_vocab_size", int, 1),
        image_token_id=-2 if image is None else int(image),
        num_mtp_layers=_get(d, "num_nextn_predict_layers", int, 0, positive=False),
        dspark_block_size=_get(d, "dspark_block_size", int, 5),
        dspark_noise_token=_get(d, "dspark_noise_token_id", int, 0, positive=False),
        dspark_targets=_int_list(d, "dspark_target_layer_ids", []),
        dspark_markov_rank=_get(d, "dspark_markov_rank", int, 1),
        dspark_n_experts=_get(d, "dspark_n_routed_experts", int, 1),
        dspark_experts_per_tok=_get(d, "dspark_num_experts_per_tok", int, 1),
        truncation_mode=mode,
        keep_tokens=keep,
        hash_layers=(False,) * n,
        **shared_fields(d),
    )
    _check(cfg)
    return cfg


def _check(c: V41Config) -> None:
    n, r = c.num_layers, c.compress_ratios
    if (c.num_heads * c.head_dim) % c.o_groups:
        raise ConfigError(f"config: key 'o_groups' ({c.o_groups}) must divide num_attention_heads*head_dim")
    if c.experts_per_tok > c.n_routed_experts:
        raise ConfigError("config: key 'num_experts_per_tok' must be <= n_routed_experts")
    for s in c.kv_sources:
        if s >= n or r[s] == 0:
            raise ConfigError(f"config: key 'kv_source_layer_ids' has {s}, not a layer with ratio 1/2")
        if s not in c.index_sources:
            raise ConfigError(f"config: key 'index_source_layer_ids' must include kv source {s} (it owns the keys)")
    for s in c.index_sources:
        if s >= n or r[s] == 0:
            raise ConfigError(f"config: key 'index_source_layer_ids' has {s}, not a layer with ratio 1/2")
    for i in range(n):
        if r[i] and not any(s <= i and r[s] == r[i] for s in c.kv_sources):
            raise ConfigError(f"config: key 'kv_source_layer_ids' has no source at or before layer {i} (ratio {r[i]})")
    cs = c.candidate_source
    if cs >= 0:
        if cs not in c.kv_sources:
            raise ConfigError(f"config: key 'candidate_source_layer_id' ({cs}) must be a kv source")
        if any(s > cs and r[s] != r[cs] for s in c.index_sources):
            raise ConfigError("config: key 'candidate_source_layer_id': later index sources must share its ratio")
    if c.index_head_dim < c.rope_dim or c.head_dim < c.rope_dim:
        raise ConfigError("config: key 'index_head_dim' must be >= the rope dim")
    if any(e >= n for e in c.engram_layers):
        raise ConfigError(f"config: key 'engram_layer_ids' must be < num_hidden_layers, got {list(c.engram_layers)}")
    if len(c.engram_num_embeddings) != len(c.engram_layers):
        raise ConfigError("config: key 'engram_num_embeddings' needs one entry per Engram layer")
    if c.engram_layers:
        sums = [sum(layer) for layer in _engram_primes_flat(c)]
        if sums != list(c.engram_num_embeddings):
            raise ConfigError(f"config: key 'engram_num_embeddings' must be the prime sums {sums}")
    if any(t >= n for t in c.dspark_targets):
        raise ConfigError(f"config: key 'dspark_target_layer_ids' must be < num_hidden_layers, got {c.dspark_targets}")
    if c.truncation_mode == "compact":
        _check_keep(c, c.keep_tokens)


def _check_keep(c: V41Config, keep: int) -> None:
    need = c.window + c.dspark_block_size
    if keep < need:
        raise ConfigError(
            f"config: {KEEP_ENV} / yoco_prefill_keep_tokens = {keep} is smaller than the window plus the maximum"
            f" draft length ({c.window} + {c.dspark_block_size} = {need})"
        )


def _engram_primes_flat(c: V41Config) -> list[list[int]]:
    per = engram_primes(c.engram_vocab_size, len(c.engram_layers), c.engram_max_ngram, c.engram_n_heads)
    return [[p for n_primes in layer for p in n_primes] for layer in per]


def engram_multipliers(c: V41Config, layer: int) -> list[int]:
    """2v+1 with v = numpy default_rng(10007*layer).integers(0, (int64max // C) // 2, size=N) (§2.14)."""
    bound = max(1, (np.iinfo(np.int64).max // c.engram_compressed_vocab) // 2)
    v = np.random.default_rng(10007 * layer).integers(0, bound, size=c.engram_max_ngram, dtype=np.int64)
    return [2 * int(x) + 1 for x in v]


# ---------------------------------------------------------------------------------------------------
# Graph building
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Caches:
    entries: list[dict] = field(default_factory=list)
    new: dict[str, Value] = field(default_factory=dict)

    def add(self, b: GraphBuilder, name: str, kind: str, shape, dtype: str = "f32", init: int = 0) -> Value:
        v = b.input(name, dtype, shape)
        self.entries.append(
            {"name": name, "kind": kind, "shape": [str(s) for s in v.shape], "dtype": dtype, "init": init}
        )
        return v

    def update(self, name: str, v: Value) -> None:
        self.new[name] = v

    def outputs(self) -> list[Value]:
        return [self.new[e["name"]] for e in self.entries]


def _hc_attrs(cfg: V41Config) -> dict:
    return {"sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps, "norm_eps": cfg.rms_eps}


def _hc_stats(b, w, cfg: V41Config, streams, p: str):
    n = cfg.hc_mult
    fn = w.plain(f"{p}_fn", [(2 + n) * n, n * cfg.hidden_size], "f32")
    base = w.plain(f"{p}_base", [(2 + n) * n], "f32")
    scale = w.plain(f"{p}_scale", [3], "f32")
    return b.hc_stats(streams, fn, base, scale, **_hc_attrs(cfg))


def _collapse(b, cfg: V41Config, streams, pre):
    """Collapse with the previous sublayer's pre (§2.3); with none (layer 0, DSpark stage 0) take stream 0."""
    if pre is not None:
        return b.hc_collapse(streams, pre)
    first = b.slice(streams, axis=1, start=0, end=1)
    return b.reshape(first, shape=[streams.shape[0], cfg.hidden_size])


class _State:
    """Per-forward bookkeeping: the shared caches' current versions, selections and candidate blocks."""

    def __init__(self):
        self.ckv: dict[int, Value] = {}
        self.idx_k: dict[int, Value] = {}
        self.sel: dict[int, Value] = {}
        self.cand: Value | None = None


def _compress(b, w, cfg: V41Config, caches: _Caches, st: _State, x, pos, *, layer: int, qat: bool) -> None:
    """A kv source's compressor and index keys (§2.13): write its shared ckv and idx_k caches."""
    r, d, di = cfg.compress_ratios[layer], cfg.head_dim, cfg.index_head_dim
    p, c = f"layers.{layer}.attn", f"cache.{layer}"
    rope = cfg.rope_attrs(r)
    ckv = caches.add(b, f"{c}.ckv", "compressed", [sym(f"C{r}"), d])
    keys = caches.add(b, f"{c}.idx_k", "index_keys", [sym(f"C{r}"), di])
    a = w.plain_linear(x, f"{p}.compressor.wkv.weight", d, cfg.hidden_size)
    if r == 2:
        s_kv = caches.add(b, f"{c}.cmp_kv", "compressor_state", [1, d])
        s_score = caches.add(b, f"{c}.cmp_score", "compressor_state", [1, d])
        z = w.plain_linear(x, f"{p}.compressor.wgate.weight", d, cfg.hidden_size)
        pooled, entry_pos, entry_idx, new_kv, new_score = b.pair_compressor(a, z, s_kv, s_score, pos)
        caches.update(s_kv.name, new_kv)
        caches.update(s_score.name, new_score)
    else:
        pooled, entry_pos, entry_idx = a, pos, pos
    latent = b.rmsnorm(pooled, w.plain(f"{p}.compressor.norm.weight", [d]), eps=cfg.rms_eps)  # pre-RoPE
    entry = b.rope(latent, entry_pos, **rope)
    k = b.rmsnorm(
        w.plain_linear(latent, f"{p}.indexer.wk.weight", di, d),
        w.plain(f"{p}.indexer.k_norm.weight", [di]),
        eps=cfg.rms_eps,
    )
    k = b.rope(k, entry_pos, **rope)
    if qat:
        entry = b.fake_quant_fp4_e4m3(entry, group=16)
        k = b.fake_quant_fp4(k, group=32)
    st.ckv[r] = b.scatter_rows(ckv, entry_idx, entry)
    st.idx_k[r] = b.scatter_rows(keys, entry_idx, k)
    caches.update(ckv.name, st.ckv[r])
    caches.update(keys.name, st.idx_k[r])


def _select(b, w, cfg: V41Config, st: _State, x, qr, pos, *, layer: int, qat: bool) -> None:
    """An index source's selection (§2.13): scores against the ratio's shared index keys, then the plain top-k,
    or the top-k inside the candidate blocks for sources after the candidate source."""
    r, hi, di = cfg.compress_ratios[layer], cfg.index_n_heads, cfg.index_head_dim
    p = f"layers.{layer}.attn.indexer"
    t = x.shape[0]
    q = b.reshape(w.linear(qr, f"{p}.wq_b", hi * di, cfg.q_lora_rank), shape=[t, hi, di])
    q = b.rope(q, pos, **cfg.rope_attrs(r))
    if qat:
        q = b.fake_quant_fp4(q, group=32)
    weights = b.scale(w.plain_linear(x, f"{p}.weights_proj.weight", hi, cfg.hidden_size), factor=hi**-0.5)
    scores = b.index_scores(q, weights, st.idx_k[r], pos, ratio=r, scale=di**-0.5)
    cs = cfg.candidate_source
    # the positions bound the columns the top-k reads (scores past (p+1)//r are -inf): a decode step's top-k then
    # follows the sequence's length, not the cache's max_model_len / r columns
    if 0 <= cs < layer:
        st.sel[r] = b.topk_entries(scores, st.cand, pos, topk=cfg.index_topk, block=cfg.candidate_block_size,
                                   ratio=r)  # fmt: skip
    else:
        st.sel[r] = b.topk_entries(scores, None, pos, topk=cfg.index_topk, ratio=r)
        if layer == cs:
            st.cand = b.candidate_blocks(
                scores, pos, ratio=r, topk_blocks=cfg.candidate_topk_blocks, block=cfg.candidate_block_size
            )


def _attention(b, w, cfg: V41Config, caches, st: _State, x, pos, *, p: str, c: str, layer: int, ratio: int,
               qat: bool, win_idx, compress: bool) -> Value:  # fmt: skip
    """The V4.1 attention sublayer on x [T, D] (§2.5, §2.6, §2.10, §2.11, §2.13)."""
    t = x.shape[0]
    h, d = cfg.num_heads, cfg.head_dim
    rope = cfg.rope_attrs(ratio)
    qr = b.rmsnorm(
        w.linear(x, f"{p}.wq_a", cfg.q_lora_rank, cfg.hidden_size),
        w.plain(f"{p}.q_norm.weight", [cfg.q_lora_rank]),
        eps=cfg.rms_eps,
    )
    q = b.rope(b.reshape(w.linear(qr, f"{p}.wq_b", h * d, cfg.q_lora_rank), shape=[t, h, d]), pos, **rope)
    kv = b.rmsnorm(w.linear(x, f"{p}.wkv", d, cfg.hidden_size), w.plain(f"{p}.kv_norm.weight", [d]), eps=cfg.rms_eps)
    kv = b.rope(kv, pos, **rope)
    if qat:
        kv = b.fake_quant_fp8(kv, group=32)
    ring = caches.add(b, f"{c}.swa", "window", [cfg.window, d])
    win_kv = b.concat(ring, kv, axis=0)
    cmp_kv = cmp_idx = None
    if ratio > 0:
        if layer in cfg.kv_sources and compress:
            _compress(b, w, cfg, caches, st, x, pos, layer=layer, qat=qat)
        if layer in cfg.index_sources:
            _select(b, w, cfg, st, x, qr, pos, layer=layer, qat=qat)
        cmp_kv, cmp_idx = st.ckv[ratio], st.sel[ratio]
    sink = w.plain(f"{p}.attn_sink", [h], "f32")
    o = b.sparse_attention(q, sink, win_kv, win_idx, cmp_kv, cmp_idx, scale=d**-0.5)
    caches.update(ring.name, b.scatter_rows(ring, b.ring_slots(pos, size=cfg.window), kv))
    o = b.rope(o, pos, inverse=True, **rope)
    return _out_proj(b, w, cfg, o, p)


def _out_proj(b, w, cfg: V41Config, o, p: str) -> Value:
    t, h, d = o.shape[0], cfg.num_heads, cfg.head_dim
    o = b.reshape(o, shape=[t, cfg.o_groups, h * d // cfg.o_groups])
    wo_a, wo_a_scale = w.dense(f"{p}.wo_a", cfg.o_groups * cfg.o_lora_rank, h * d // cfg.o_groups)
    u = b.grouped_linear(o, wo_a, wo_a_scale, block=cfg.fp8_block or 128)
    u = b.reshape(u, shape=[t, cfg.o_groups * cfg.o_lora_rank])
    return w.linear(u, f"{p}.wo_b", cfg.hidden_size, cfg.o_groups * cfg.o_lora_rank)


def _engram(b, w, cfg: V41Config, streams, tokens, history, *, layer: int) -> Value:
    """Engram before layer `layer` (§2.14): hash ids, table rows, wkv projection, gated add to the streams."""
    li = cfg.engram_layers.index(layer)
    p = f"layers.{layer}.engram"
    n, dd, hd = cfg.hc_mult, cfg.hidden_size, cfg.engram_head_dim
    primes = _engram_primes_flat(cfg)[li]
    ids = b.engram_hash(
        tokens, history, multipliers=engram_multipliers(cfg, layer), primes=primes, n_heads=cfg.engram_n_heads,
        pad_id=cfg.engram_pad_id, vocab=cfg.vocab_size, compressed_vocab=cfg.engram_compressed_vocab,
        image_token_id=cfg.image_token_id,
    )  # fmt: skip
    rows = cfg.engram_num_embeddings[li]
    if w.float:
        table, tscale = w.plain(f"{p}.embed.weight", [rows, hd]), None
    else:
        table = b.param(f"{p}.embed.weight", "f8e4m3", [rows, hd])
        tscale = b.param(f"{p}.embed.scale", "e8m0", [rows, -(-hd // 32)])
    m = b.engram_embed(table, tscale, ids)
    kv = w.linear(m, f"{p}.wkv", (n + 1) * dd, len(primes) * hd)
    qw, kw = w.plain(f"{p}.q_weight", [n, dd]), w.plain(f"{p}.k_weight", [n, dd])
    return b.engram_gate(streams, kv, qw, kw, tokens, eps=cfg.rms_eps, image_token_id=cfg.image_token_id)


def _ffn(b, w, cfg: V41Config, streams, pre_a, tokens, p: str):
    stats_f = _hc_stats(b, w, cfg, streams, f"{p}.hc_ffn")
    x = b.rmsnorm(b.hc_collapse(streams, pre_a), w.plain(f"{p}.ffn_norm.weight", [cfg.hidden_size]), eps=cfg.rms_eps)
    w.plain(f"{p}.ffn.gate.bias_vl", [cfg.n_routed_experts], "f32")  # image-token routing bias (text graph: unused)
    y = _moe(b, w, cfg, x, tokens, p=f"{p}.ffn", hashed=False)
    return b.hc_post(y, streams, stats_f[1], stats_f[2]), stats_f[0]


def _resolve_mode(cfg: V41Config, mode: str | None, keep_tokens: int | None) -> tuple[str, int]:
    mode = cfg.truncation_mode if mode is None else mode
    if mode not in ("exact", "compact"):
        raise ConfigError(f"build_graph: mode must be 'exact' or 'compact', got {mode!r}")
    keep = cfg.keep_tokens if keep_tokens is None else keep_tokens
    if not isinstance(keep, int) or isinstance(keep, bool) or keep <= 0:
        raise ConfigError(f"build_graph: keep_tokens must be a positive integer, got {keep!r}")
    if mode == "compact":
        _check_keep(cfg, keep)
    return mode, keep


def build_graph(
    cfg: V41Config | dict,
    *,
    weights: str = "checkpoint",
    mode: str | None = None,
    keep_tokens: int | None = None,
    qat: bool = False,
    hidden: bool = False,
    name: str = "deepseek_v41",
) -> Graph:
    """The backbone graph: (tokens, positions, caches) -> (logits, updated caches[, DSpark target streams])."""
    cfg = parse_config(cfg) if isinstance(cfg, dict) else cfg
    mode, keep = _resolve_mode(cfg, mode, keep_tokens)
    t, n, dd = sym("T"), cfg.hc_mult, cfg.hidden_size
    b = GraphBuilder(
        name, meta={"model": "deepseek-v4.1-flash", "weights": weights, "mode": mode, "keep_tokens": keep, "qat": qat}
    )
    w = _Weights(b, cfg, weights)
    all_tokens = tokens = b.input("tokens", "i64", [t])
    all_pos = pos = b.input("positions", "i64", [t])
    caches = _Caches()
    w.embed = w.plain("embed.weight", [cfg.vocab_size, dd])
    w.head = w.plain("head.weight", [cfg.vocab_size, dd])
    history = None
    if cfg.engram_layers:
        history = caches.add(b, "cache.engram.history", "engram_history", [cfg.engram_max_ngram - 1], "i64", init=-1)
    e = b.cast(b.embedding(w.embed, tokens), dtype="f32")
    streams = b.expand(b.reshape(e, shape=[t, 1, dd]), shape=[t, n, dd])
    st = _State()
    late = max(cfg.kv_sources) if (mode == "compact" and cfg.kv_sources) else cfg.num_layers
    pre = None
    captured: list[Value] = []
    win_idx = b.window_indices(pos, window=cfg.window)
    for i in range(cfg.num_layers):
        p, ratio = f"layers.{i}", cfg.compress_ratios[i]
        with b.scope(f"l{i}"):
            if i in cfg.engram_layers:
                streams = _engram(b, w, cfg, streams, tokens, history, layer=i)
                if i == max(cfg.engram_layers):
                    caches.update(history.name, b.engram_history(history, all_tokens))
            compress = True
            x_all = None
            if i == late:
                # bounded replay: the first late layer compresses every row, then only the tail runs (§2.13)
                x_all = b.rmsnorm(_collapse(b, cfg, streams, pre), w.plain(f"{p}.attn_norm.weight", [dd]),
                                  eps=cfg.rms_eps)  # fmt: skip
                if i in cfg.kv_sources:
                    _compress(b, w, cfg, caches, st, x_all, pos, layer=i, qat=qat)
                    compress = False
                lo = dmax(t - keep, 0)
                tail = [streams, tokens, pos, x_all] + ([pre] if pre is not None else [])
                tail = [b.slice(v, axis=0, start=lo, end=t) for v in tail]
                streams, tokens, pos, x_all = tail[:4]
                pre = tail[4] if pre is not None else None
                win_idx = b.replay_window_indices(pos, all_pos, window=cfg.window, keep=keep)
            if hidden and i in cfg.dspark_targets:
                captured.append(streams)
            stats_a = _hc_stats(b, w, cfg, streams, f"{p}.hc_attn")
            if x_all is not None:
                x = x_all
            else:
                x = b.rmsnorm(_collapse(b, cfg, streams, pre), w.plain(f"{p}.attn_norm.weight", [dd]), eps=cfg.rms_eps)
            y = _attention(b, w, cfg, caches, st, x, pos, p=f"{p}.attn", c=f"cache.{i}", layer=i, ratio=ratio,
                           qat=qat, win_idx=win_idx, compress=compress)  # fmt: skip
            streams = b.hc_post(y, streams, stats_a[1], stats_a[2])
            streams, pre = _ffn(b, w, cfg, streams, stats_a[0], tokens, p)
    # the head is per row: the runtime gathers the sampled rows of (streams, pre) in front of this hc_collapse
    # (passes/select_logit_rows.py finds it from the "logits" output back)
    h = b.rmsnorm(b.hc_collapse(streams, pre), w.plain("norm.weight", [dd]), eps=cfg.rms_eps)
    b.output(b.linear(h, w.head, name="logits"), *caches.outputs())
    if hidden:
        b.output(*captured)
    b.graph.meta["caches"] = caches.entries
    return b.build()


# ---------------------------------------------------------------------------------------------------
# DSpark draft block (§2.15)
# ---------------------------------------------------------------------------------------------------


def build_dspark_graph(
    cfg: V41Config | dict, *, weights: str = "checkpoint", name: str = "deepseek_v41_dspark"
) -> Graph:
    """The DSpark draft block (§2.15), greedy.

    inputs  hidden.{L} f32[Tc, n_hc, D] for L in dspark_target_layer_ids (the backbone's streams at entry to
            those layers, ``build_graph(hidden=True)``), ctx_positions i64[Tc] (their positions),
            anchor i64[1] (the last accepted token), positions i64[B] (the block's positions, after the context).
    outputs hidden f32[B, D] (collapsed with the last stage's ffn pre, before the final norm),
            base_logits f32[B-1, V], step_logits f32[B-1, V] (base + Markov), draft_tokens i64[B-1],
            confidence f32[B-1] (sigmoid of confidence_raw), confidence_raw f32[B-1].
    The block is [anchor, noise x (B-1)]; each of the S stages is an SWA-only V4.1 block (rope_theta, no YaRN)
    with ``dspark_n_routed_experts`` experts, whose attention sees the context rows inside its window
    (KV = RoPE(kv_norm(main_x @ wkv^T)), main_x = main_norm(main_proj(concat_L mean_streams(hidden.L)))) plus
    every block row. Tensor names as the oracle's: ``mtp.0.main_proj/main_norm``, ``mtp.{S-1}.norm``,
    ``mtp.{S-1}.markov_head.{embed,head}.weight``, ``mtp.{S-1}.confidence_head.proj.{weight,bias}``.
    """
    cfg = parse_config(cfg) if isinstance(cfg, dict) else cfg
    stages = cfg.num_mtp_layers
    if stages < 1:
        raise ConfigError("build_dspark_graph: the config has no DSpark stages (num_nextn_predict_layers = 0)")
    if not cfg.dspark_targets:
        raise ConfigError("build_dspark_graph: missing key 'dspark_target_layer_ids'")
    bs, n, dd, tc = cfg.dspark_block_size, cfg.hc_mult, cfg.hidden_size, sym("Tc")
    h_, d = cfg.num_heads, cfg.head_dim
    b = GraphBuilder(name, meta={"model": "deepseek-v4.1-flash", "weights": weights, "dspark": True})
    w = _Weights(b, cfg, weights)
    hid = [b.input(f"hidden.{layer}", "f32", [tc, n, dd]) for layer in cfg.dspark_targets]
    cpos = b.input("ctx_positions", "i64", [tc])
    anchor = b.input("anchor", "i64", [1])
    pos = b.input("positions", "i64", [bs])
    w.embed = w.plain("embed.weight", [cfg.vocab_size, dd])
    w.head = w.plain("head.weight", [cfg.vocab_size, dd])
    dcfg = replace(cfg, n_routed_experts=cfg.dspark_n_experts, experts_per_tok=cfg.dspark_experts_per_tok)
    main = b.concat(*[b.reduce_mean(v, axes=[1]) for v in hid], axis=1)  # [Tc, 3D]
    main = b.rmsnorm(w.linear(main, "mtp.0.main_proj", dd, len(hid) * dd), w.plain("mtp.0.main_norm.weight", [dd]),
                     eps=cfg.rms_eps)  # fmt: skip
    noise = b.full(shape=[bs - 1], value=float(cfg.dspark_noise_token), dtype="i64")
    tokens = b.concat(anchor, noise, axis=0)
    e = b.cast(b.embedding(w.embed, tokens), dtype="f32")
    streams = b.expand(b.reshape(e, shape=[bs, 1, dd]), shape=[bs, n, dd])
    rope = cfg.rope_attrs(0)
    idx = b.dspark_attn_indices(cpos, pos, window=cfg.window)
    pre = None
    for k in range(stages):
        p = f"mtp.{k}"
        with b.scope(p):
            stats_a = _hc_stats(b, w, cfg, streams, f"{p}.hc_attn")
            x = b.rmsnorm(_collapse(b, cfg, streams, pre), w.plain(f"{p}.attn_norm.weight", [dd]), eps=cfg.rms_eps)
            a = f"{p}.attn"
            qr = b.rmsnorm(w.linear(x, f"{a}.wq_a", cfg.q_lora_rank, dd), w.plain(f"{a}.q_norm.weight",
                           [cfg.q_lora_rank]), eps=cfg.rms_eps)  # fmt: skip
            q = b.rope(b.reshape(w.linear(qr, f"{a}.wq_b", h_ * d, cfg.q_lora_rank), shape=[bs, h_, d]), pos, **rope)
            wkv, wkv_s = w.dense(f"{a}.wkv", d, dd)
            kv_norm = w.plain(f"{a}.kv_norm.weight", [d])

            def _kv(v, ps, wkv=wkv, wkv_s=wkv_s, kv_norm=kv_norm):
                y = b.linear(v, wkv) if wkv_s is None else b.linear_fp8(v, wkv, wkv_s, block=cfg.fp8_block)
                return b.rope(b.rmsnorm(y, kv_norm, eps=cfg.rms_eps), ps, **rope)

            pool = b.concat(_kv(main, cpos), _kv(x, pos), axis=0)
            sink = w.plain(f"{a}.attn_sink", [h_], "f32")
            o = b.sparse_attention(q, sink, pool, idx, scale=d**-0.5)
            o = b.rope(o, pos, inverse=True, **rope)
            streams = b.hc_post(_out_proj(b, w, cfg, o, a), streams, stats_a[1], stats_a[2])
            streams, pre = _ffn(b, w, dcfg, streams, stats_a[0], tokens, p)
    last = f"mtp.{stages - 1}"
    hidden = b.hc_collapse(streams, pre, name="hidden")
    rest = b.slice(hidden, axis=0, start=1, end=bs)
    base = b.linear(b.rmsnorm(rest, w.plain(f"{last}.norm.weight", [dd]), eps=cfg.rms_eps), w.head, name="base_logits")
    r = cfg.dspark_markov_rank
    m_embed = w.plain(f"{last}.markov_head.embed.weight", [cfg.vocab_size, r])
    m_head = w.plain(f"{last}.markov_head.head.weight", [cfg.vocab_size, r])
    prev, prevs, steps, drafts = anchor, [], [], []
    for i in range(bs - 1):
        prevs.append(prev)
        markov = b.linear(b.cast(b.embedding(m_embed, prev), dtype="f32"), m_head)
        step = b.add(b.slice(base, axis=0, start=i, end=i + 1), markov)
        steps.append(step)
        prev = b.argmax(step, axis=-1)
        drafts.append(prev)
    step_logits = b.concat(*steps, axis=0, name="step_logits")
    draft_tokens = b.concat(*drafts, axis=0, name="draft_tokens")
    feats = b.concat(rest, b.cast(b.embedding(m_embed, b.concat(*prevs, axis=0)), dtype="f32"), axis=1)
    proj = w.plain(f"{last}.confidence_head.proj.weight", [1, dd + r])
    proj_b = w.plain(f"{last}.confidence_head.proj.bias", [1])
    raw = b.reshape(b.linear(feats, proj, proj_b), shape=[bs - 1], name="confidence_raw")
    b.output(hidden, base, step_logits, draft_tokens, b.sigmoid(raw, name="confidence"), raw)
    return b.build()


# ---------------------------------------------------------------------------------------------------
# Checkpoint tensors and sizes
# ---------------------------------------------------------------------------------------------------


def checkpoint_params(cfg: V41Config) -> list[Value]:
    """Every checkpoint tensor: the backbone graph's params plus the DSpark graph's (shared ones once)."""
    graphs = [build_graph(cfg, mode="exact")]
    if cfg.num_mtp_layers and cfg.dspark_targets:
        graphs.append(build_dspark_graph(cfg))
    out: dict[str, Value] = {}
    for g in graphs:
        for v in g.params:
            out.setdefault(v.name, v)
    return list(out.values())


def param_counts(cfg: V41Config | dict) -> dict[str, int]:
    """{"backbone", "engram", "dspark", "total"} logical weight counts from the graphs' params (scales excluded;
    Engram = the hash tables, its projections count as backbone)."""
    cfg = parse_config(cfg) if isinstance(cfg, dict) else cfg
    g = build_graph(cfg, mode="exact")
    engram = Graph("engram")
    engram.params = [v for v in g.params if v.name.endswith("engram.embed.weight")]
    out = {"engram": param_count(engram)}
    out["backbone"] = param_count(g) - out["engram"]
    out["dspark"] = 0
    if cfg.num_mtp_layers and cfg.dspark_targets:
        dg = build_dspark_graph(cfg)
        own = Graph("dspark")
        own.params = [v for v in dg.params if v.name.startswith("mtp.")]
        out["dspark"] = param_count(own)
    out["total"] = out["backbone"] + out["engram"] + out["dspark"]
    return out


__all__ = [
    "V41Config",
    "build_dspark_graph",
    "build_graph",
    "checkpoint_params",
    "param_count",
    "param_counts",
    "parse_config",
]
