"""DeepSeek-V4-Flash as a deepinfer graph (MODEL_SPEC §1.1, §2.1–2.12, §2.15, §3, §4).

``parse_config`` reads a checkpoint ``config.json`` (its own keys, or transformers' ``DeepseekV4Config`` forms)
into a :class:`V4Config`. ``build_graph`` writes the backbone as one graph over a symbolic token count ``T``, so
one graph serves prefill (T = prompt length) and decode (T = 1). ``build_mtp_graph`` writes the MTP block.

Graph interface (one sequence per call; ``graph.meta["caches"]`` lists the caches in order):

    inputs   tokens i64[T], positions i64[T] (contiguous: start .. start+T-1), then per layer i the caches
             cache.{i}.swa            f32[W, d]          window KV ring, position p in slot p % W
             cache.{i}.ckv            f32[C{m}, d]       compressed KV, row w = window w       (ratio m > 0)
             cache.{i}.cmp_kv/_score  f32[R, c*d]        compressor pending rows (R = 2m CSA, m HCA)
             cache.{i}.idx_k          f32[C{m}, di]      index keys                           (CSA only)
             cache.{i}.idx_cmp_kv/_score f32[2m, 2*di]   indexer compressor pending rows      (CSA only)
    outputs  logits f32[T, vocab], then the updated caches in input order
             (then the final residual streams f32[T, n_hc, D] when built with ``hidden=True``, for MTP)

``C{m}`` is a symbol per ratio (e.g. ``C4``, ``C128``): the caller allocates ``ceil(max_len / m)`` rows.
All caches start as zeros. Parameters are named like the checkpoint tensors (§4.1). ``weights="checkpoint"``
gives them the checkpoint dtypes (FP8 E4M3 + e8m0 block scales for dense GEMMs, packed FP4 + per-32 scales
for routed experts, bf16/f32 for the rest, §4.2–4.3); ``weights="float"`` makes every weight f32 with no scales.
Activations are f32. No QAT fake-quant (the transformers oracle has none either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from deepinfer.errors import ConfigError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.graph import Graph, Value
from deepinfer.ir.shapes import sym

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
MLP_TYPES = ("hash_moe", "moe")


@dataclass(frozen=True)
class V4Config:
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
    layer_types: tuple[str, ...]  # SWA / CSA / HCA per backbone layer
    compress_ratios: tuple[int, ...]  # 0 for SWA layers
    hash_layers: tuple[bool, ...]
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
    yarn: dict | None  # {factor, original_max_position_embeddings, beta_fast, beta_slow} or None
    num_mtp_layers: int
    fp8_block: int | None  # None: dense weights are bf16 in the checkpoint
    expert_dtype: str  # fp4 | fp8 | bf16
    max_position_embeddings: int
    extra: dict = field(default_factory=dict, compare=False)

    def rope_attrs(self, compressed: bool) -> dict:
        """Sliding layers: rope_theta, no YaRN; layers with a compressor: compress_rope_theta with YaRN (§2.7)."""
        attrs: dict[str, Any] = {"rope_dim": self.rope_dim, "theta": float(self.rope_theta)}
        if compressed:
            attrs["theta"] = float(self.compress_rope_theta)
            if self.yarn is not None:
                attrs.update(
                    yarn_factor=float(self.yarn["factor"]),
                    yarn_orig_len=int(self.yarn["original_max_position_embeddings"]),
                    beta_fast=float(self.yarn["beta_fast"]),
                    beta_slow=float(self.yarn["beta_slow"]),
                )
        return attrs


# ---------------------------------------------------------------------------------------------------
# Config parsing
# ---------------------------------------------------------------------------------------------------


def _get(d: dict, key: str, kind: type | tuple = int, default: Any = ..., positive: bool = True):
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(f"config: missing key {key!r}")
        return default
    v = d[key]
    ok = isinstance(v, kind) and not isinstance(v, bool) if kind is not bool else isinstance(v, bool)
    if kind is float:
        ok = isinstance(v, int | float) and not isinstance(v, bool)
    if not ok or (positive and kind in (int, float) and v <= 0):
        want = {int: "a positive integer", float: "a positive number"}.get(kind, getattr(kind, "__name__", kind))
        raise ConfigError(f"config: key {key!r} must be {want}, got {v!r}")
    return v


def _layer_kinds(d: dict, n: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Per-layer attention kind and ratio from compress_ratios, or from layer_types + compress_rates."""
    if d.get("compress_ratios") is not None:
        ratios = d["compress_ratios"]
        if not isinstance(ratios, list) or len(ratios) < n or not all(_is_ratio(r) for r in ratios[:n]):
            raise ConfigError(f"config: key 'compress_ratios' must list >= {n} non-negative ints, got {ratios!r}")
        ratios = tuple(int(r) for r in ratios[:n])
        # The official reference: ratio 4 uses the overlapping compressor and the indexer; other ratios do not.
        return tuple(SWA if r == 0 else CSA if r == 4 else HCA for r in ratios), ratios
    types = d.get("layer_types")
    if types is None:
        raise ConfigError("config: missing key 'compress_ratios' (or 'layer_types')")
    if not isinstance(types, list) or len(types) < n or any(t not in (SWA, CSA, HCA) for t in types[:n]):
        raise ConfigError(f"config: key 'layer_types' must list {n} of {SWA}/{CSA}/{HCA}, got {types!r}")
    rates = {CSA: 4, HCA: 128, **(d.get("compress_rates") or {})}
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if d.get(key) is not None:
            rates[kind] = d[key]
    for kind in (CSA, HCA):
        if not _is_ratio(rates[kind]) or rates[kind] == 0:
            raise ConfigError(f"config: key 'compress_rates' must give {kind} a positive int, got {rates[kind]!r}")
    types = tuple(types[:n])
    return types, tuple(0 if t == SWA else int(rates[t]) for t in types)


def _is_ratio(r: Any) -> bool:
    return isinstance(r, int) and not isinstance(r, bool) and r >= 0


def _hash_layers(d: dict, n: int) -> tuple[bool, ...]:
    if d.get("mlp_layer_types") is not None:
        types = d["mlp_layer_types"]
        if not isinstance(types, list) or len(types) < n or any(t not in MLP_TYPES for t in types[:n]):
            raise ConfigError(f"config: key 'mlp_layer_types' must list {n} of hash_moe/moe, got {types!r}")
        return tuple(t == "hash_moe" for t in types[:n])
    if "num_hash_layers" not in d:
        raise ConfigError("config: missing key 'num_hash_layers' (or 'mlp_layer_types')")
    k = _get(d, "num_hash_layers", int, positive=False)
    if k < 0:
        raise ConfigError(f"config: key 'num_hash_layers' must be >= 0, got {k}")
    return tuple(i < k for i in range(n))


def _rope_dim(d: dict, head_dim: int) -> int:
    if d.get("qk_rope_head_dim") is not None:
        r = _get(d, "qk_rope_head_dim", int)
    elif d.get("partial_rotary_factor") is not None:
        f = _get(d, "partial_rotary_factor", float)
        r = int(head_dim * f)
    else:
        raise ConfigError("config: missing key 'qk_rope_head_dim' (or 'partial_rotary_factor')")
    if r % 2 or r > head_dim:
        raise ConfigError(f"config: key 'qk_rope_head_dim' must be even and <= head_dim, got {r}")
    return r


def _rope(d: dict) -> tuple[float, float, dict | None]:
    """(rope_theta, compress_rope_theta, yarn) from rope_scaling (checkpoint) or rope_parameters (transformers)."""
    params = d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config: key 'rope_parameters' must be a dict, got {params!r}")
    nested = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
    main = params["main"] if nested else {}
    compress = params["compress"] if nested else params
    theta = main.get("rope_theta", d.get("rope_theta", 10000.0))
    ctheta = compress.get("rope_theta", d.get("compress_rope_theta", 160000.0)) if nested else None
    if ctheta is None:
        ctheta = d.get("compress_rope_theta", 160000.0)
    for key, v in (("rope_theta", theta), ("compress_rope_theta", ctheta)):
        if not isinstance(v, int | float) or isinstance(v, bool) or v <= 1:
            raise ConfigError(f"config: key {key!r} must be a number > 1, got {v!r}")
    scaling = d.get("rope_scaling") or compress
    if not isinstance(scaling, dict):
        raise ConfigError(f"config: key 'rope_scaling' must be a dict, got {scaling!r}")
    kind = scaling.get("type", scaling.get("rope_type", "default"))
    if kind in ("default", None):
        return float(theta), float(ctheta), None
    if kind != "yarn":
        raise ConfigError(f"config: key 'rope_scaling' type must be 'yarn' or 'default', got {kind!r}")
    yarn = {
        "factor": _get(scaling, "factor", float),
        "original_max_position_embeddings": _get(scaling, "original_max_position_embeddings", int),
        "beta_fast": _get(scaling, "beta_fast", float, 32),
        "beta_slow": _get(scaling, "beta_slow", float, 1),
    }
    return float(theta), float(ctheta), yarn


def _fp8_block(d: dict) -> int | None:
    q = d.get("quantization_config")
    if q is None:
        return None
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1] and _is_ratio(block[0]) and block[0]):
        raise ConfigError(f"config: key 'quantization_config.weight_block_size' must be [b, b], got {block!r}")
    return int(block[0])


def shared_fields(d: dict) -> dict:
    """The config fields V4 and V4.1 read the same way, checked (the model-specific ones are parsed by each)."""
    if _get(d, "hidden_act", str, "silu") != "silu":
        raise ConfigError(f"config: key 'hidden_act' must be 'silu', got {d['hidden_act']!r}")
    if _get(d, "n_shared_experts", int, 1) != 1:
        raise ConfigError(f"config: key 'n_shared_experts' must be 1, got {d['n_shared_experts']!r}")
    if _get(d, "tie_word_embeddings", bool, False):
        raise ConfigError("config: key 'tie_word_embeddings' must be false (the head is untied)")
    scoring = _get(d, "scoring_func", str, "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ConfigError(f"config: key 'scoring_func' must be sqrtsoftplus/sigmoid/softmax, got {scoring!r}")
    head_dim = _get(d, "head_dim")
    return dict(
        vocab_size=_get(d, "vocab_size"),
        hidden_size=_get(d, "hidden_size"),
        num_heads=_get(d, "num_attention_heads"),
        head_dim=head_dim,
        rope_dim=_rope_dim(d, head_dim),
        q_lora_rank=_get(d, "q_lora_rank"),
        o_groups=_get(d, "o_groups"),
        o_lora_rank=_get(d, "o_lora_rank"),
        window=_get(d, "sliding_window"),
        n_routed_experts=_get(d, "n_routed_experts"),
        experts_per_tok=_get(d, "num_experts_per_tok"),
        moe_inter=_get(d, "moe_intermediate_size"),
        route_scale=float(_get(d, "routed_scaling_factor", float)),
        scoring_func=scoring,
        norm_topk_prob=_get(d, "norm_topk_prob", bool, True),
        swiglu_limit=float(_get(d, "swiglu_limit", float, positive=False)),
        index_n_heads=_get(d, "index_n_heads"),
        index_head_dim=_get(d, "index_head_dim"),
        index_topk=_get(d, "index_topk"),
        hc_mult=_get(d, "hc_mult"),
        hc_sinkhorn_iters=_get(d, "hc_sinkhorn_iters"),
        hc_eps=float(_get(d, "hc_eps", float)),
        rms_eps=float(_get(d, "rms_norm_eps", float)),
        max_position_embeddings=_get(d, "max_position_embeddings", int, 1 << 20),
    )


def parse_config(d: dict) -> V4Config:
    """A V4Config from a config.json dict; a bad or missing key raises ConfigError naming it."""
    if not isinstance(d, dict):
        raise ConfigError(f"config: expected a JSON object, got {type(d).__name__}")
    n = _get(d, "num_hidden_layers")
    layer_types, ratios = _layer_kinds(d, n)
    theta, ctheta, yarn = _rope(d)
    if _get(d, "num_key_value_heads", int, 1) != 1:
        raise ConfigError("config: key 'num_key_value_heads' must be 1 (V4 is shared-KV MQA)")
    expert_dtype = _get(d, "expert_dtype", str, "fp4")
    if expert_dtype not in ("fp4", "fp8", "bf16"):
        raise ConfigError(f"config: key 'expert_dtype' must be fp4/fp8/bf16, got {expert_dtype!r}")
    cfg = V4Config(
        num_layers=n,
        layer_types=layer_types,
        compress_ratios=ratios,
        hash_layers=_hash_layers(d, n),
        rope_theta=theta,
        compress_rope_theta=ctheta,
        yarn=yarn,
        num_mtp_layers=_get(d, "num_nextn_predict_layers", int, 0, positive=False),
        fp8_block=_fp8_block(d),
        expert_dtype=expert_dtype,
        **shared_fields(d),
    )
    _check_dims(cfg)
    return cfg


def _check_dims(c: V4Config) -> None:
    if (c.num_heads * c.head_dim) % c.o_groups:
        raise ConfigError(f"config: key 'o_groups' ({c.o_groups}) must divide num_attention_heads*head_dim")
    if c.experts_per_tok > c.n_routed_experts:
        raise ConfigError("config: key 'num_experts_per_tok' must be <= n_routed_experts")
    if any(t == CSA for t in c.layer_types) and c.index_head_dim < c.rope_dim:
        raise ConfigError("config: key 'index_head_dim' must be >= the rope dim")
    if c.expert_dtype == "fp4" and (c.hidden_size % 32 or c.moe_inter % 32):
        raise ConfigError("config: key 'moe_intermediate_size' and hidden_size must be multiples of 32 for fp4 experts")


# ---------------------------------------------------------------------------------------------------
# Graph building
# ---------------------------------------------------------------------------------------------------


class _Weights:
    """Declares parameters with checkpoint names and dtypes, and emits the matching GEMM ops."""

    def __init__(self, b: GraphBuilder, cfg: V4Config, mode: str):
        if mode not in ("checkpoint", "float"):
            raise ConfigError(f"build_graph: weights must be 'checkpoint' or 'float', got {mode!r}")
        self.b, self.cfg, self.float = b, cfg, mode == "float"
        self.embed: Value | None = None  # shared by the backbone and MTP graphs (declared by _declare_shared)
        self.head: Value | None = None

    def plain(self, name: str, shape, ckpt_dtype: str = "bf16") -> Value:
        """A weight stored unquantised (bf16 or f32 in the checkpoint)."""
        return self.b.param(name, "f32" if self.float else ckpt_dtype, shape)

    def dense(self, prefix: str, out: int, inp: int) -> tuple[Value, Value | None]:
        """An FP8 block-scaled dense weight `{prefix}.weight` [out, in] with `{prefix}.scale` (§4.2)."""
        block = self.cfg.fp8_block
        if self.float or block is None:
            return self.plain(f"{prefix}.weight", [out, inp]), None
        w = self.b.param(f"{prefix}.weight", "f8e4m3", [out, inp])
        s = self.b.param(f"{prefix}.scale", "e8m0", [-(-out // block), -(-inp // block)])
        return w, s

    def linear(self, x: Value, prefix: str, out: int, inp: int) -> Value:
        w, s = self.dense(prefix, out, inp)
        if s is None:
            return self.b.linear(x, w)
        return self.b.linear_fp8(x, w, s, block=self.cfg.fp8_block)

    def plain_linear(self, x: Value, name: str, out: int, inp: int) -> Value:
        return self.b.linear(x, self.plain(name, [out, inp]))

    def expert_fmt(self) -> str:
        if self.float or self.cfg.expert_dtype == "bf16":
            return "float"
        return self.cfg.expert_dtype

    def expert(self, prefix: str, out: int, inp: int) -> list[Value]:
        """A routed-expert weight: packed FP4 [out, in/2] + e8m0 [out, in/32] (§4.3), FP8, or plain."""
        fmt = self.expert_fmt()
        if fmt == "fp4":
            w = self.b.param(f"{prefix}.weight", "f4e2m1x2", [out, inp // 2])
            return [w, self.b.param(f"{prefix}.scale", "e8m0", [out, inp // 32])]
        if fmt == "fp8":
            return list(self.dense(prefix, out, inp))
        return [self.plain(f"{prefix}.weight", [out, inp])]


@dataclass
class _Caches:
    """Cache inputs and their updated versions, matched by name (recorded in graph.meta["caches"])."""

    entries: list[dict] = field(default_factory=list)
    inputs: dict[str, Value] = field(default_factory=dict)
    new: dict[str, Value] = field(default_factory=dict)

    def add(self, b: GraphBuilder, name: str, kind: str, shape) -> Value:
        v = b.input(name, "f32", shape)
        self.entries.append({"name": name, "kind": kind, "shape": [str(s) for s in v.shape], "dtype": "f32"})
        self.inputs[name] = v
        return v

    def update(self, name: str, v: Value) -> None:
        self.new[name] = v

    def outputs(self) -> list[Value]:
        return [self.new[e["name"]] for e in self.entries]


def _hc_attrs(cfg: V4Config) -> dict:
    return {"sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps, "norm_eps": cfg.rms_eps}


def _compressor_branch(b, w, cfg, caches, x, pos, *, prefix, names, ratio, overlap, dim, rope):
    """Project, pool and write one compressor's entries; returns the updated entry cache.

    names = (entry cache, state kv, state score) cache input names.
    """
    c = 2 if overlap else 1
    rows = ratio * c
    cache = caches.add(b, names[0], "compressed", [sym(f"C{ratio}"), dim])
    state_kv = caches.add(b, names[1], "compressor_state", [rows, c * dim])
    state_score = caches.add(b, names[2], "compressor_state", [rows, c * dim])
    kv = w.plain_linear(x, f"{prefix}.wkv.weight", c * dim, cfg.hidden_size)
    score = w.plain_linear(x, f"{prefix}.wgate.weight", c * dim, cfg.hidden_size)
    ape = w.plain(f"{prefix}.ape", [ratio, c * dim], "f32")
    norm = w.plain(f"{prefix}.norm.weight", [dim])
    entries, entry_idx, new_kv, new_score = b.compressor(
        kv, score, ape, norm, state_kv, state_score, pos, ratio=ratio, overlap=overlap, eps=cfg.rms_eps, **rope
    )
    new_cache = b.scatter_rows(cache, entry_idx, entries)
    for name, v in zip(names, (new_cache, new_kv, new_score)):
        caches.update(name, v)
    return new_cache


def _attention(b, w, cfg: V4Config, caches: _Caches, x, pos, *, p: str, c: str, kind: str, ratio: int):
    """The V4 attention sublayer on x [T, D] (§2.5–2.11); p = parameter prefix, c = cache prefix."""
    t = x.shape[0]
    h, d = cfg.num_heads, cfg.head_dim
    rope = cfg.rope_attrs(compressed=kind != SWA)
    qr = b.rmsnorm(
        w.linear(x, f"{p}.wq_a", cfg.q_lora_rank, cfg.hidden_size),
        w.plain(f"{p}.q_norm.weight", [cfg.q_lora_rank]),
        eps=cfg.rms_eps,
    )
    q = b.reshape(w.linear(qr, f"{p}.wq_b", h * d, cfg.q_lora_rank), shape=[t, h, d])
    q = b.rope(b.rmsnorm(q, None, eps=cfg.rms_eps), pos, **rope)  # V4's per-head unweighted q norm (§2.5)
    kv = b.rmsnorm(w.linear(x, f"{p}.wkv", d, cfg.hidden_size), w.plain(f"{p}.kv_norm.weight", [d]), eps=cfg.rms_eps)
    kv = b.rope(kv, pos, **rope)

    ring = caches.add(b, f"{c}.swa", "window", [cfg.window, d])
    win_kv = b.concat(ring, kv, axis=0)
    win_idx = b.window_indices(pos, window=cfg.window)
    cmp_kv = cmp_idx = None
    if kind != SWA:
        cmp_kv = _compressor_branch(
            b, w, cfg, caches, x, pos, prefix=f"{p}.compressor", names=(f"{c}.ckv", f"{c}.cmp_kv", f"{c}.cmp_score"),
            ratio=ratio, overlap=kind == CSA, dim=d, rope=rope,
        )  # fmt: skip
        if kind == CSA:
            cmp_idx = _indexer(b, w, cfg, caches, x, qr, pos, p=p, c=c, ratio=ratio, rope=rope)
        else:
            cmp_idx = b.compressed_indices(pos, cmp_kv, ratio=ratio)
    sink = w.plain(f"{p}.attn_sink", [h], "f32")
    o = b.sparse_attention(q, sink, win_kv, win_idx, cmp_kv, cmp_idx, scale=d**-0.5)
    caches.update(ring.name, b.scatter_rows(ring, b.ring_slots(pos, size=cfg.window), kv))
    o = b.rope(o, pos, inverse=True, **rope)  # undo the value's rotation at the query position (§2.10)
    o = b.reshape(o, shape=[t, cfg.o_groups, h * d // cfg.o_groups])
    wo_a, wo_a_scale = w.dense(f"{p}.wo_a", cfg.o_groups * cfg.o_lora_rank, h * d // cfg.o_groups)
    u = b.grouped_linear(o, wo_a, wo_a_scale, block=cfg.fp8_block or 128)
    u = b.reshape(u, shape=[t, cfg.o_groups * cfg.o_lora_rank])
    return w.linear(u, f"{p}.wo_b", cfg.hidden_size, cfg.o_groups * cfg.o_lora_rank)


def _indexer(b, w, cfg: V4Config, caches: _Caches, x, qr, pos, *, p: str, c: str, ratio: int, rope: dict):
    """Lightning indexer (§2.9): its own overlap compressor for index keys, then scores and top-k."""
    t, hi, di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
    keys = _compressor_branch(
        b, w, cfg, caches, x, pos, prefix=f"{p}.indexer.compressor",
        names=(f"{c}.idx_k", f"{c}.idx_cmp_kv", f"{c}.idx_cmp_score"), ratio=ratio, overlap=True, dim=di, rope=rope,
    )  # fmt: skip
    q = b.reshape(w.linear(qr, f"{p}.indexer.wq_b", hi * di, cfg.q_lora_rank), shape=[t, hi, di])
    q = b.rope(q, pos, **rope)
    weights = b.scale(w.plain_linear(x, f"{p}.indexer.weights_proj.weight", hi, cfg.hidden_size), factor=hi**-0.5)
    return b.indexer_topk(q, weights, keys, pos, ratio=ratio, topk=cfg.index_topk, scale=di**-0.5)


def _swiglu_mlp(b, w, cfg: V4Config, x, p: str) -> Value:
    """The shared expert: clamped SwiGLU with FP8 weights (§2.12)."""
    d, inter = cfg.hidden_size, cfg.moe_inter
    gate = w.linear(x, f"{p}.w1", inter, d)
    up = w.linear(x, f"{p}.w3", inter, d)
    return w.linear(b.swiglu(gate, up, limit=cfg.swiglu_limit), f"{p}.w2", d, inter)


def _moe(b, w, cfg: V4Config, x, tokens, *, p: str, hashed: bool) -> Value:
    """Routed experts + shared expert on x [T, D] (§2.12)."""
    d, inter, e = cfg.hidden_size, cfg.moe_inter, cfg.n_routed_experts
    logits = w.plain_linear(x, f"{p}.gate.weight", e, d)
    if hashed:
        tid2eid = b.param(f"{p}.gate.tid2eid", "i32", [cfg.vocab_size, cfg.experts_per_tok])
        route_in = (logits, None, tid2eid, tokens)
    else:
        route_in = (logits, w.plain(f"{p}.gate.bias", [e], "f32"))
    weights, idx = b.moe_route(
        *route_in, topk=cfg.experts_per_tok, scoring=cfg.scoring_func, route_scale=cfg.route_scale,
        normalize=cfg.norm_topk_prob,
    )  # fmt: skip
    experts: list[Value] = []
    for i in range(e):
        for name, out, inp in (("w1", inter, d), ("w2", d, inter), ("w3", inter, d)):
            experts += w.expert(f"{p}.experts.{i}.{name}", out, inp)
    routed = b.moe_experts(
        x, weights, idx, *experts, n_experts=e, fmt=w.expert_fmt(), swiglu_limit=cfg.swiglu_limit,
        block=cfg.fp8_block or 128,
    )  # fmt: skip
    return b.add(routed, _swiglu_mlp(b, w, cfg, x, f"{p}.shared_experts"))


def _hc_params(w: _Weights, cfg: V4Config, p: str, rows: int, scales: int) -> tuple[Value, Value, Value]:
    width = cfg.hc_mult * cfg.hidden_size
    return (
        w.plain(f"{p}_fn", [rows, width], "f32"),
        w.plain(f"{p}_base", [rows], "f32"),
        w.plain(f"{p}_scale", [scales], "f32"),
    )


def _block(b, w, cfg: V4Config, caches: _Caches, streams, tokens, pos, *, p: str, c: str, layer: int) -> Value:
    """One V4 block on the residual streams [T, n, D] (§2.3): each sublayer uses its own hc_pre."""
    n = cfg.hc_mult
    kind, ratio = cfg.layer_types[layer], cfg.compress_ratios[layer]
    hashed = cfg.hash_layers[layer]
    d = cfg.hidden_size
    x, post, comb = b.hc_pre(streams, *_hc_params(w, cfg, f"{p}.hc_attn", (2 + n) * n, 3), **_hc_attrs(cfg))
    x = b.rmsnorm(x, w.plain(f"{p}.attn_norm.weight", [d]), eps=cfg.rms_eps)
    y = _attention(b, w, cfg, caches, x, pos, p=f"{p}.attn", c=c, kind=kind, ratio=ratio)
    streams = b.hc_post(y, streams, post, comb)
    x, post, comb = b.hc_pre(streams, *_hc_params(w, cfg, f"{p}.hc_ffn", (2 + n) * n, 3), **_hc_attrs(cfg))
    x = b.rmsnorm(x, w.plain(f"{p}.ffn_norm.weight", [d]), eps=cfg.rms_eps)
    y = _moe(b, w, cfg, x, tokens, p=f"{p}.ffn", hashed=hashed)
    return b.hc_post(y, streams, post, comb)


def _head(b, w, cfg: V4Config, streams, p: str) -> Value:
    """hc_head collapse, final RMSNorm, LM head (§2.4). p = "" for the backbone, "mtp.k." for MTP.

    Every node here is per row: the runtime computes only the sampled rows by gathering them in front of hc_head
    (passes/select_logit_rows.py finds the head from the "logits" output back to hc_head)."""
    n, d = cfg.hc_mult, cfg.hidden_size
    fn, base, scale = _hc_params(w, cfg, f"{p}hc_head", n, 1)
    h = b.hc_head(streams, fn, base, scale, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_eps)
    h = b.rmsnorm(h, w.plain(f"{p}norm.weight", [d]), eps=cfg.rms_eps)
    return b.linear(h, w.head, name="logits")


def _embed(b, w, cfg: V4Config, tokens) -> Value:
    return b.cast(b.embedding(w.embed, tokens), dtype="f32")


def _declare_shared(w: _Weights, cfg: V4Config) -> None:
    w.embed = w.plain("embed.weight", [cfg.vocab_size, cfg.hidden_size])
    w.head = w.plain("head.weight", [cfg.vocab_size, cfg.hidden_size])


def build_graph(
    cfg: V4Config | dict, *, weights: str = "checkpoint", hidden: bool = False, name: str = "deepseek_v4"
) -> Graph:
    """The backbone graph: (tokens, positions, caches) -> (logits, updated caches[, final streams])."""
    cfg = parse_config(cfg) if isinstance(cfg, dict) else cfg
    t = sym("T")
    b = GraphBuilder(name, meta={"model": "deepseek-v4-flash", "weights": weights})
    w = _Weights(b, cfg, weights)
    tokens = b.input("tokens", "i64", [t])
    pos = b.input("positions", "i64", [t])
    caches = _Caches()
    _declare_shared(w, cfg)
    e = _embed(b, w, cfg, tokens)
    streams = b.expand(b.reshape(e, shape=[t, 1, cfg.hidden_size]), shape=[t, cfg.hc_mult, cfg.hidden_size])
    for i in range(cfg.num_layers):
        with b.scope(f"l{i}"):
            streams = _block(b, w, cfg, caches, streams, tokens, pos, p=f"layers.{i}", c=f"cache.{i}", layer=i)
    b.output(_head(b, w, cfg, streams, ""), *caches.outputs())
    if hidden:
        b.output(streams)
    b.graph.meta["caches"] = caches.entries
    return b.build()


def build_mtp_graph(
    cfg: V4Config | dict, *, weights: str = "checkpoint", k: int = 0, name: str = "deepseek_v4_mtp"
) -> Graph:
    """The V4 MTP block ``mtp.{k}`` (§2.15): (hidden streams at t, token t+1, positions, cache) -> logits for t+2.

    inputs: hidden f32[T, n_hc, D] (the backbone's final streams, before hc_head), tokens i64[T] (the NEXT
    tokens), positions i64[T] (those of the hidden rows), cache.mtp.{k}.swa f32[W, d]. The block is a V4 block
    with sliding-window attention only and score routing; embed/head are shared with the backbone.
    """
    cfg = parse_config(cfg) if isinstance(cfg, dict) else cfg
    if not 0 <= k < max(cfg.num_mtp_layers, 1):
        raise ConfigError(f"build_mtp_graph: the config has {cfg.num_mtp_layers} MTP layers, asked for mtp.{k}")
    t, n, d = sym("T"), cfg.hc_mult, cfg.hidden_size
    b = GraphBuilder(name, meta={"model": "deepseek-v4-flash", "weights": weights, "mtp": k})
    w = _Weights(b, cfg, weights)
    hidden = b.input("hidden", "f32", [t, n, d])
    tokens = b.input("tokens", "i64", [t])
    pos = b.input("positions", "i64", [t])
    caches = _Caches()
    _declare_shared(w, cfg)
    p = f"mtp.{k}"
    e = b.rmsnorm(_embed(b, w, cfg, tokens), w.plain(f"{p}.enorm.weight", [d]), eps=cfg.rms_eps)
    h = b.rmsnorm(hidden, w.plain(f"{p}.hnorm.weight", [d]), eps=cfg.rms_eps)  # per stream
    e = b.reshape(w.linear(e, f"{p}.e_proj", d, d), shape=[t, 1, d])
    streams = b.add(w.linear(h, f"{p}.h_proj", d, d), e)  # broadcast over the streams
    mtp_cfg = _as_mtp_layer(cfg)
    with b.scope(p):
        streams = _block(b, w, mtp_cfg, caches, streams, tokens, pos, p=p, c=f"cache.mtp.{k}", layer=0)
    b.output(_head(b, w, cfg, streams, f"{p}."), *caches.outputs())
    b.graph.meta["caches"] = caches.entries
    return b.build()


def _as_mtp_layer(cfg: V4Config) -> V4Config:
    """A one-layer view of cfg for the MTP block: sliding attention, score routing (§2.15)."""
    from dataclasses import replace

    return replace(cfg, num_layers=1, layer_types=(SWA,), compress_ratios=(0,), hash_layers=(False,))


# ---------------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------------


def param_count(g: Graph, include_scales: bool = False) -> int:
    """Logical weight elements (a packed FP4 byte counts as two); block scales excluded unless asked."""
    total = 0
    for p in g.params:
        if p.name.endswith(".scale") and p.dtype == dt.e8m0 and not include_scales:
            continue
        total += math.prod(p.shape) * p.dtype.packed
    return total


# ---------------------------------------------------------------------------------------------------
# Tiny configs for tests (checkpoint keys, like config.json)
# ---------------------------------------------------------------------------------------------------

_TINY_BASE = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "max_position_embeddings": 1024,  # = YaRN factor * original length
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "expert_dtype": "fp4",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
}
_YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}

TINY_CONFIGS: dict[str, dict] = {
    # every layer type (HCA at ratio 8 so short prompts cover many windows), YaRN, hash + score MoE
    "tiny": {
        **_TINY_BASE,
        "num_hidden_layers": 4,
        "compress_ratios": [0, 4, 8, 4, 0],
        "num_hash_layers": 2,
        "rope_scaling": _YARN,
    },
    # no YaRN, HCA ratio 16, FP8 blocks of 32 (several blocks per weight), one hash layer, wider top-k
    "tiny_b": {
        **_TINY_BASE,
        "num_hidden_layers": 3,
        "compress_ratios": [4, 16, 0, 0],
        "num_hash_layers": 1,
        "index_topk": 6,
        "sliding_window": 16,
        "quantization_config": {**_TINY_BASE["quantization_config"], "weight_block_size": [32, 32]},
    },
    # the real HCA ratio (128) and a sliding-only first layer; score routing everywhere
    "tiny_c": {
        **_TINY_BASE,
        "num_hidden_layers": 3,
        "compress_ratios": [0, 128, 4, 0],
        "num_hash_layers": 0,
        "max_position_embeddings": 4096,
        "rope_scaling": {**_YARN, "original_max_position_embeddings": 256},
    },
}
