"""DeepSeek-V4-Flash graph vs transformers 5.23 ``DeepseekV4ForCausalLM`` (MODEL_SPEC §6.1) and op-level checks.

The oracle gets the same random weights: the checkpoint-format graph's FP8/FP4/bf16 tensors are dequantised and
renamed to transformers' names (the facts of transformers' ``conversion_mapping["deepseek_v4"]``). Errors are
relative to the largest reference logit: max|ours - ref| / max|ref|.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.interpreter import run
from deepinfer.ir.ops.attention import apply_rope, rope_inv_freq
from deepinfer.models import deepseek_v4 as v4
from deepinfer.models.deepseek_v4 import TINY_CONFIGS, build_graph, build_mtp_graph, parse_config

REAL_CONFIG = "/work/shared/configs/deepseek-v4-flash.config.json"
TOL = 1e-5

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------------------------------------------
# Random weights in checkpoint format, and their float values
# ---------------------------------------------------------------------------------------------------


def _float_value(name: str, shape, gen: torch.Generator, cfg) -> torch.Tensor:
    """A float tensor for a checkpoint name, scaled so activations stay O(1) through the tiny model."""

    def randn(std=1.0, mean=0.0):
        return torch.randn(*shape, generator=gen) * std + mean

    if name.endswith("tid2eid"):
        rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: shape[1]] for _ in range(shape[0])]
        return torch.stack(rows).to(torch.int32)
    if name.endswith("norm.weight"):
        return randn(0.1, 1.0)
    if name.endswith("_fn"):
        return randn(0.05)
    if name.endswith("_base"):
        return randn(0.5)
    if name.endswith("_scale"):
        return randn(0.2, 1.0)
    if name.endswith(("attn_sink", "ape")):
        return randn(1.0)
    if name.endswith("gate.bias"):
        return randn(0.1)
    if name == "embed.weight":
        return randn(1.0)
    return randn(1.0 / math.sqrt(shape[1]))  # [out, in] weights


def _quant_fp8_block(w: torch.Tensor, block: int):
    n, k = w.shape
    blocks = w.new_zeros(-(-n // block) * block, -(-k // block) * block)
    blocks[:n, :k] = w
    amax = blocks.unflatten(0, (-1, block)).unflatten(-1, (-1, block)).abs().amax(dim=(1, 3))
    scale = dt.pow2_scale(amax, dt.FP8_MAX)
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w / full).clamp(-dt.FP8_MAX, dt.FP8_MAX).to(torch.float8_e4m3fn), dt.float_to_e8m0(scale)


def _quant_fp4_rows(w: torch.Tensor):
    g = w.unflatten(-1, (-1, 32))
    scale = dt.pow2_scale(g.abs().amax(-1, keepdim=True), dt.FP4_MAX, floor=dt.FP4_MAX * 2.0**-126)
    codes = dt.fp4_encode((g / scale).clamp(-dt.FP4_MAX, dt.FP4_MAX)).flatten(-2)
    return dt.pack_fp4(codes), dt.float_to_e8m0(scale.squeeze(-1))


def random_params(graph, cfg, seed: int) -> tuple[dict, dict]:
    """(params for this graph in its dtypes, the same weights as float32 for the oracle, keyed by name)."""
    gen = torch.Generator().manual_seed(seed)
    params, floats = {}, {}
    by_name = {p.name: p for p in graph.params}
    for p in graph.params:
        if p.dtype == dt.e8m0:
            continue  # made with its weight
        val = _float_value(p.name, p.shape, gen, cfg)
        if p.dtype == dt.f8e4m3:
            base = p.name[: -len(".weight")]
            q, s = _quant_fp8_block(val, cfg.fp8_block)
            assert by_name[f"{base}.scale"].shape == tuple(s.shape)
            params[p.name], params[f"{base}.scale"] = q, s
            floats[p.name] = v4_dequant_fp8(q, s, cfg.fp8_block)
        elif p.dtype == dt.f4e2m1x2:
            base = p.name[: -len(".weight")]
            val = torch.randn(p.shape[0], p.shape[1] * 2, generator=gen) / math.sqrt(p.shape[1] * 2)
            q, s = _quant_fp4_rows(val)
            params[p.name], params[f"{base}.scale"] = q, s
            floats[p.name] = (dt.fp4_to_float(q).unflatten(-1, (-1, 32)) * dt.e8m0_to_float(s).unsqueeze(-1)).flatten(
                -2
            )
        elif p.dtype == dt.bf16:
            params[p.name] = val.to(torch.bfloat16)
            floats[p.name] = params[p.name].float()
        else:
            params[p.name] = val.to(p.dtype.torch_dtype)
            floats[p.name] = params[p.name]
    return params, floats


def v4_dequant_fp8(q, s, block):
    scale = dt.e8m0_to_float(s).repeat_interleave(block, 0)[: q.shape[0]].repeat_interleave(block, 1)
    return q.float() * scale[:, : q.shape[1]]


# ---------------------------------------------------------------------------------------------------
# The transformers oracle
# ---------------------------------------------------------------------------------------------------

_RENAMES = [  # checkpoint name -> transformers name, applied in order (facts of conversion_mapping)
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.", "model.layers."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.ape$", ".position_bias"),
    (r"\.(compressor|indexer)\.norm\.weight$", r".\1.kv_norm.weight"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]


def tf_state_dict(floats: dict, cfg) -> dict:
    sd, experts = {}, {}
    for name, t in floats.items():
        m = re.match(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$", name)
        if m:
            experts[(int(m[1]), int(m[2]), m[3])] = t
            continue
        for pat, rep in _RENAMES:
            name = re.sub(pat, rep, name)
        sd[name] = t.long() if t.dtype == torch.int32 else t.float()
    for layer in range(cfg.num_layers):
        e = range(cfg.n_routed_experts)
        gate_up = [torch.cat([experts[(layer, i, "w1")], experts[(layer, i, "w3")]]) for i in e]
        sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        sd[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([experts[(layer, i, "w2")] for i in e])
    return sd


def tf_config(d: dict):
    """transformers' config from our config.json dict (its layer_types / compress_rates / rope_parameters forms)."""
    cfg = parse_config(d)
    hca = {r for t, r in zip(cfg.layer_types, cfg.compress_ratios) if t == v4.HCA}
    rope = {"rope_type": "default"}
    if cfg.yarn:
        rope = {"rope_type": "yarn", **cfg.yarn}
    keys = (
        "vocab_size hidden_size moe_intermediate_size num_attention_heads num_key_value_heads head_dim q_lora_rank "
        "n_routed_experts num_experts_per_tok n_shared_experts o_groups o_lora_rank index_n_heads index_head_dim "
        "index_topk sliding_window hc_mult hc_sinkhorn_iters hc_eps rms_norm_eps routed_scaling_factor scoring_func "
        "swiglu_limit rope_theta compress_rope_theta max_position_embeddings norm_topk_prob"
    ).split()
    return transformers.DeepseekV4Config(
        **{k: d[k] for k in keys},
        num_hidden_layers=cfg.num_layers,
        layer_types=list(cfg.layer_types),
        compress_rates={v4.CSA: 4, v4.HCA: hca.pop() if hca else 128},
        mlp_layer_types=["hash_moe" if h else "moe" for h in cfg.hash_layers],
        partial_rotary_factor=cfg.rope_dim / cfg.head_dim,
        rope_parameters=rope,
    )


def tf_model(d: dict, floats: dict):
    cfg = parse_config(d)
    model = transformers.DeepseekV4ForCausalLM(tf_config(d)).eval()
    model.load_state_dict(tf_state_dict(floats, cfg), strict=True)
    return model


class IndexerTieProbe:
    """Records, per indexer call of the oracle, whether some query really selects (more visible entries than
    top-k) and whether an exact score tie straddles its top-k boundary (the §2.9 trap, which must not occur)."""

    def __init__(self, model, d: dict):
        self.ratio, self.topk = 4, d["index_topk"]
        self.selects = self.ties = 0
        for mod in model.modules():
            if type(mod).__name__ == "DeepseekV4Indexer":
                mod.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, mod, args, kwargs, out):
        scores = mod.scorer._last  # set by the scorer hook below
        pos = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
        visible = torch.arange(scores.shape[-1]) < (pos.unsqueeze(-1) + 1) // self.ratio
        for s, vis in zip(scores.reshape(-1, scores.shape[-1]), visible.reshape(-1, scores.shape[-1])):
            vals = torch.sort(s[vis], descending=True).values
            if vals.numel() > self.topk:
                self.selects += 1
                self.ties += int(vals[self.topk - 1] == vals[self.topk])

    @staticmethod
    def attach_scorers(model):
        for mod in model.modules():
            if type(mod).__name__ == "DeepseekV4IndexerScorer":
                mod.register_forward_hook(lambda m, a, o: setattr(m, "_last", o.detach()))


# ---------------------------------------------------------------------------------------------------
# Running our graph with explicit caches
# ---------------------------------------------------------------------------------------------------


class Session:
    """Holds one sequence's caches between calls of the graph (what a runtime would do)."""

    def __init__(self, graph, params, max_len: int):
        self.graph, self.params, self.pos = graph, params, 0
        self.caches = {}
        for e in graph.meta["caches"]:
            shape = [(-(-max_len // int(s[1:]))) if s.startswith("C") else int(s) for s in e["shape"]]
            self.caches[e["name"]] = torch.zeros(shape)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        inputs = {"tokens": tokens, "positions": torch.arange(self.pos, self.pos + n), **self.caches}
        outs = run(self.graph, inputs, self.params, check=True)
        for e, new in zip(self.graph.meta["caches"], outs[1:]):
            self.caches[e["name"]] = new
        self.pos += n
        return outs[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


CASES = [  # (config, seed, prompt length, weights) — together: all layer types, hash+score MoE, YaRN on/off
    ("tiny", 0, 40, "checkpoint"),
    ("tiny_b", 1, 84, "checkpoint"),
    ("tiny_c", 2, 290, "float"),
]


@pytest.mark.parametrize("name,seed,n,weights", CASES)
def test_logits_match_transformers_and_decode_matches_prefill(name, seed, n, weights):
    d = TINY_CONFIGS[name]
    cfg = parse_config(d)
    graph = build_graph(d, weights=weights)
    params, floats = random_params(graph, cfg, seed)
    model = tf_model(d, floats)
    IndexerTieProbe.attach_scorers(model)
    probe = IndexerTieProbe(model, d)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed + 100))
    with torch.no_grad():
        ref = model(ids[None], use_cache=False).logits[0]

    full = Session(graph, params, n).step(ids)
    err_full = rel_err(full, ref)
    assert err_full < TOL, f"{name}: full forward vs transformers rel err {err_full:.2e}"
    if v4.CSA in cfg.layer_types:
        assert probe.selects > 0, "the indexer never had more visible entries than top-k"
        assert probe.ties == 0, "an exact top-k tie straddles the boundary: pick another seed (§2.9)"

    # uneven prefill chunks (windows straddle calls), then >= 16 single-token decode steps
    steps = 17
    prefill = n - steps
    chunks = [prefill // 3, 1, prefill - prefill // 3 - 1]
    sess, outs = Session(graph, params, n), []
    at = 0
    for size in chunks + [1] * steps:
        outs.append(sess.step(ids[at : at + size]))
        at += size
    inc = torch.cat(outs)
    err_inc, err_inc_tf = rel_err(inc, full), rel_err(inc, ref)
    assert err_inc < TOL and err_inc_tf < TOL, (
        f"{name}: incremental vs full {err_inc:.2e}, vs transformers {err_inc_tf:.2e}"
    )


def test_float_and_checkpoint_graphs_agree():
    """weights="float" carrying the dequantised values equals the FP8/FP4 checkpoint-format graph."""
    d = TINY_CONFIGS["tiny"]
    cfg = parse_config(d)
    ckpt = build_graph(d, weights="checkpoint")
    params, floats = random_params(ckpt, cfg, 5)
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(5))
    a = Session(ckpt, params, 24).step(ids)
    b = Session(build_graph(d, weights="float"), floats, 24).step(ids)
    assert rel_err(a, b) < 1e-6


# ---------------------------------------------------------------------------------------------------
# Real config: parameter names, dtypes, counts (§1.1, §4)
# ---------------------------------------------------------------------------------------------------


def _real_config() -> dict:
    import json

    with open(REAL_CONFIG) as f:
        return json.load(f)


def test_real_config_counts_and_shapes():
    d = _real_config()
    g, mtp = build_graph(d), build_mtp_graph(d)
    main = {p.name: p for p in g.params}
    mtp_only = [p for p in mtp.params if p.name.startswith("mtp.")]
    assert len(main) + len(mtp_only) == 69187  # the base checkpoint's tensor count (§1.1)
    backbone = v4.param_count(g)
    mtp_params = sum(math.prod(p.shape) * p.dtype.packed for p in mtp_only if p.dtype != dt.e8m0)
    assert abs(backbone / 284.3e9 - 1) < 1e-3 and abs(mtp_params / 6.6e9 - 1) < 1e-2, (backbone, mtp_params)
    want = {
        "layers.2.attn.wq_a.weight": ("f8e4m3", (1024, 4096)),
        "layers.2.attn.wq_a.scale": ("e8m0", (8, 32)),
        "layers.2.attn.wo_a.weight": ("f8e4m3", (8192, 4096)),
        "layers.2.attn.wo_b.weight": ("f8e4m3", (4096, 8192)),
        "layers.2.attn.compressor.wkv.weight": ("bf16", (1024, 4096)),
        "layers.2.attn.compressor.ape": ("f32", (4, 1024)),
        "layers.3.attn.compressor.ape": ("f32", (128, 512)),
        "layers.2.attn.indexer.wq_b.weight": ("f8e4m3", (8192, 1024)),
        "layers.2.attn.indexer.weights_proj.weight": ("bf16", (64, 4096)),
        "layers.2.attn.indexer.compressor.wkv.weight": ("bf16", (256, 4096)),
        "layers.0.ffn.gate.tid2eid": ("i32", (129280, 6)),
        "layers.3.ffn.gate.bias": ("f32", (256,)),
        "layers.3.ffn.experts.7.w1.weight": ("f4e2m1x2", (2048, 2048)),
        "layers.3.ffn.experts.7.w1.scale": ("e8m0", (2048, 128)),
        "layers.3.ffn.experts.7.w2.weight": ("f4e2m1x2", (4096, 1024)),
        "layers.3.ffn.shared_experts.w2.scale": ("e8m0", (32, 16)),
        "layers.5.hc_attn_fn": ("f32", (24, 16384)),
        "hc_head_fn": ("f32", (4, 16384)),
        "embed.weight": ("bf16", (129280, 4096)),
    }
    for name, (dtype, shape) in want.items():
        assert (main[name].dtype.name, main[name].shape) == (dtype, shape), name
    assert "layers.0.attn.compressor.ape" not in main and "layers.3.attn.indexer.wq_b.weight" not in main
    assert {p.name for p in mtp_only} >= {"mtp.0.e_proj.weight", "mtp.0.h_proj.scale", "mtp.0.hc_head_fn"}


def test_mtp_graph_runs_on_backbone_streams():
    d = TINY_CONFIGS["tiny"]
    cfg = parse_config(d)
    backbone = build_graph(d, weights="float", hidden=True)
    g = build_mtp_graph(d, weights="float")
    params, _ = random_params(backbone, cfg, 3)
    mtp_params, _ = random_params(g, cfg, 4)
    mtp_params.update({k: params[k] for k in ("embed.weight", "head.weight")})  # shared with the backbone
    ids = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(3))
    sess = Session(backbone, params, 7)
    inputs = {"tokens": ids[:6], "positions": torch.arange(6), **sess.caches}
    outs = run(backbone, inputs, params, check=True)
    hidden = outs[-1]
    assert hidden.shape == (6, cfg.hc_mult, cfg.hidden_size)
    inputs = {"hidden": hidden, "tokens": ids[1:], "positions": torch.arange(6)}
    inputs["cache.mtp.0.swa"] = torch.zeros(cfg.window, cfg.head_dim)
    logits, swa = run(g, inputs, mtp_params, check=True)
    assert logits.shape == (6, cfg.vocab_size) and torch.isfinite(logits).all() and swa.abs().sum() > 0
    with pytest.raises(ConfigError, match="weights"):
        build_graph(d, weights="fp16")


# ---------------------------------------------------------------------------------------------------
# Config parsing
# ---------------------------------------------------------------------------------------------------


def test_parse_config_checkpoint_and_transformers_forms_agree():
    d = _real_config()
    cfg = parse_config(d)
    assert cfg.layer_types[:4] == (v4.SWA, v4.SWA, v4.CSA, v4.HCA) and cfg.compress_ratios[42] == 4
    assert cfg.hash_layers[:4] == (True, True, True, False) and cfg.rope_dim == 64 and cfg.fp8_block == 128
    tf = tf_config(TINY_CONFIGS["tiny"]).to_dict()
    tf.pop("compress_ratios", None)
    assert parse_config(tf).layer_types == parse_config(TINY_CONFIGS["tiny"]).layer_types
    ours, theirs = parse_config(TINY_CONFIGS["tiny"]), parse_config(tf)
    for f in ("compress_ratios", "hash_layers", "rope_dim", "yarn", "rope_theta", "compress_rope_theta"):
        assert getattr(ours, f) == getattr(theirs, f), f


@pytest.mark.parametrize(
    "edit,key",
    [
        (lambda d: d.pop("hidden_size"), "hidden_size"),
        (lambda d: d.update(num_attention_heads="64"), "num_attention_heads"),
        (lambda d: d.update(compress_ratios=[0, 4]), "compress_ratios"),
        (lambda d: d.pop("num_hash_layers"), "num_hash_layers"),
        (lambda d: d.update(rope_scaling={"type": "linear", "factor": 2}), "rope_scaling"),
        (lambda d: d.update(num_key_value_heads=2), "num_key_value_heads"),
        (lambda d: d.update(quantization_config={"weight_block_size": [128, 64]}), "weight_block_size"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(edit, key):
    d = copy.deepcopy(_real_config())
    edit(d)
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    assert key in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------
# Op-level checks
# ---------------------------------------------------------------------------------------------------


def _one_op_graph(op: str, inputs: dict, **attrs):
    b = GraphBuilder(op)
    vals = [None if v is None else b.input(k, dtype, shape) for k, (dtype, shape, v) in inputs.items()]
    outs = b.op(op, *vals, **attrs)
    b.output(*(outs if isinstance(outs, tuple) else (outs,)))
    return b.build()


def _run_op(op: str, tensors: dict, shapes: dict, **attrs):
    """Build a one-op graph with symbolic shapes and run it with check=True (symbolic inference checked)."""
    spec = {k: (dt.from_torch(t.dtype).name, shapes.get(k, list(t.shape)), t) for k, t in tensors.items()}
    g = _one_op_graph(op, spec, **attrs)
    return run(g, {k: t for k, t in tensors.items()}, check=True)


def test_hc_post_orientation_with_non_symmetric_comb():
    t, n, d = 3, 4, 8
    y, x, post = torch.randn(t, d), torch.randn(t, n, d), torch.rand(t, n)
    comb = torch.rand(t, n, n)
    assert not torch.allclose(comb, comb.transpose(1, 2))
    (out,) = _run_op("hc_post", {"y": y, "x": x, "post": post, "comb": comb}, {"y": ["T", d], "x": ["T", n, d],
                     "post": ["T", n], "comb": ["T", n, n]})  # fmt: skip
    want = torch.zeros(t, n, d)
    for s in range(t):
        for k in range(n):
            want[s, k] = post[s, k] * y[s] + sum(comb[s, j, k] * x[s, j] for j in range(n))
    torch.testing.assert_close(out, want)
    transposed = post.unsqueeze(-1) * y.unsqueeze(1) + torch.einsum("tkj,tjd->tkd", comb, x)
    assert (out - transposed).abs().max() > 1e-2  # the Megatron bug would be caught


def test_hc_pre_matches_spec_formula():
    t, n, d = 2, 4, 16
    x = torch.randn(t, n, d)
    fn, base, scale = torch.randn(24, n * d) * 0.1, torch.randn(24), torch.rand(3) + 0.5
    collapsed, post, comb = _run_op(
        "hc_pre", {"x": x, "fn": fn, "base": base, "scale": scale}, {"x": ["T", n, d]}, sinkhorn_iters=20
    )
    for s in range(t):  # MODEL_SPEC §2.2 written out for one token
        flat = x[s].flatten()
        mixes = (fn @ flat) / torch.sqrt(flat.square().mean() + 1e-6)
        pre = torch.sigmoid(mixes[:4] * scale[0] + base[:4]) + 1e-6
        c = (mixes[8:] * scale[2] + base[8:]).view(4, 4)
        c = torch.softmax(c, -1) + 1e-6
        c = c / (c.sum(0, keepdim=True) + 1e-6)
        for _ in range(19):
            c = c / (c.sum(1, keepdim=True) + 1e-6)
            c = c / (c.sum(0, keepdim=True) + 1e-6)
        torch.testing.assert_close(comb[s], c)
        torch.testing.assert_close(post[s], 2 * torch.sigmoid(mixes[4:8] * scale[1] + base[4:8]))
        torch.testing.assert_close(collapsed[s], (pre[:, None] * x[s]).sum(0))
    assert torch.allclose(comb.sum(1), torch.ones(t, n), atol=1e-4)  # doubly stochastic
    assert not torch.allclose(comb, comb.transpose(1, 2), atol=1e-3)


def test_rope_inverse_and_yarn_frequencies():
    x, pos = torch.randn(5, 3, 32), torch.arange(7, 12)
    attrs = {"rope_dim": 8, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 64}
    (rot,) = _run_op("rope", {"x": x, "positions": pos}, {"x": ["T", 3, 32], "positions": ["T"]}, **attrs)
    (back,) = _run_op(
        "rope", {"x": rot, "positions": pos}, {"x": ["T", 3, 32], "positions": ["T"]}, inverse=True, **attrs
    )
    torch.testing.assert_close(back, x)
    assert torch.equal(rot[..., :24], x[..., :24]) and not torch.allclose(rot[..., 24:], x[..., 24:])
    # interleaved pairs: pair 0 of the rope slice rotates by pos * f_0
    f = rope_inv_freq(**{k: v for k, v in attrs.items()})
    a = pos.float() * f[0]
    z = torch.complex(x[:, 0, 24], x[:, 0, 25]) * torch.exp(1j * a)
    torch.testing.assert_close(rot[:, 0, 24], z.real) and torch.testing.assert_close(rot[:, 0, 25], z.imag)
    # the frequencies transformers computes for the compress rope (YaRN) and the main rope (plain)
    d = TINY_CONFIGS["tiny"]
    emb = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding(tf_config(d))
    cfg = parse_config(d)
    torch.testing.assert_close(rope_inv_freq(**cfg.rope_attrs(True)), emb.compress_inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(rope_inv_freq(**cfg.rope_attrs(False)), emb.main_inv_freq, rtol=0, atol=0)
    # the real config's YaRN ramp (§2.7: low 15, high 25)
    real = parse_config(_real_config()).rope_attrs(True)
    f, plain = rope_inv_freq(**real), rope_inv_freq(64, 160000.0)
    assert (
        torch.equal(f[:16], plain[:16])
        and torch.allclose(f[25:], plain[25:] / 16)
        and not torch.equal(f[20], plain[20])
    )
    assert apply_rope is not None


def _naive_compress(kv, score, ape, norm, *, m, overlap, rope):
    """MODEL_SPEC §2.8 written directly: every complete window of a whole sequence, no state."""
    d = norm.shape[0]
    n = kv.shape[0] // m
    z = score + ape.repeat(n + 1, 1)[: kv.shape[0]]
    out = []
    for w in range(n):
        cur = slice(m * w, m * w + m)
        if overlap:
            a = [kv[cur, d:], z[cur, d:]]
            if w > 0:
                prev = slice(m * (w - 1), m * w)
                a = [torch.cat([kv[prev, :d], a[0]]), torch.cat([z[prev, :d], a[1]])]
        else:
            a = [kv[cur], z[cur]]
        c = (torch.softmax(a[1], 0) * a[0]).sum(0)
        c = c * torch.rsqrt(c.square().mean() + 1e-6) * norm
        out.append(apply_rope(c[None], torch.tensor([m * w]), **rope)[0])
    return torch.stack(out)


@pytest.mark.parametrize("m,overlap", [(4, True), (8, False)])
def test_compressor_decode_state_equals_prefill(m, overlap):
    c, d, n = (2 if overlap else 1), 16, 6 * m + 3
    g = torch.Generator().manual_seed(m)
    kv, score = torch.randn(n, c * d, generator=g), torch.randn(n, c * d, generator=g)
    ape, norm = torch.randn(m, c * d, generator=g), torch.rand(d, generator=g) + 0.5
    rope = {
        "rope_dim": 8,
        "theta": 160000.0,
        "yarn_factor": 16.0,
        "yarn_orig_len": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    rows = m * c
    shapes = {"kv": ["T", c * d], "score": ["T", c * d], "positions": ["T"]}

    def feed(chunks):
        state = [torch.zeros(rows, c * d), torch.zeros(rows, c * d)]
        got, at = {}, 0
        for size in chunks:
            sl = slice(at, at + size)
            ins = {"kv": kv[sl], "score": score[sl], "ape": ape, "norm": norm, "state_kv": state[0],
                   "state_score": state[1], "positions": torch.arange(at, at + size)}  # fmt: skip
            ent, idx, *state = _run_op("compressor", ins, shapes, ratio=m, overlap=overlap, **rope)
            got.update({int(i): e for i, e in zip(idx, ent) if i >= 0})
            at += size
        return torch.stack([got[w] for w in sorted(got)]), state

    whole, state_whole = feed([n])
    assert whole.shape[0] == n // m
    torch.testing.assert_close(whole, _naive_compress(kv, score, ape, norm, m=m, overlap=overlap, rope=rope))
    for chunks in ([1] * n, [m - 1, 2, 1, 2 * m + 1, n - 3 * m - 3]):
        inc, state_inc = feed(chunks)
        torch.testing.assert_close(inc, whole)
        torch.testing.assert_close(state_inc, state_whole)


def test_indexer_topk_ties_go_to_the_lower_index():
    q = torch.tensor([[[1.0, 0.0]]]).expand(2, 1, 2).contiguous()  # T=2, Hi=1, di=2
    keys = torch.tensor([[-1.0, 0.0], [2.0, 0.0], [-3.0, 0.0], [2.0, 1.0], [0.5, 0.0], [-1.0, 1.0]])
    ins = {"q": q, "weights": torch.ones(2, 1), "keys": keys, "positions": torch.tensor([22, 23])}
    shapes = {"q": ["T", 1, 2], "weights": ["T", 1], "keys": ["C", 2], "positions": ["T"]}
    (idx,) = _run_op("indexer_topk", ins, shapes, ratio=4, topk=4, scale=1.0)
    # scores 0, 2, 0, 2, .5, 0 (all visible at p=23: 6 < 24//4); p=22 sees entries 0..4
    assert idx.tolist() == [[1, 3, 4, 0], [1, 3, 4, 0]]
    ins["positions"] = torch.tensor([6, 7])  # p=6 sees entry 0 only, p=7 entries 0 and 1
    (idx,) = _run_op("indexer_topk", ins, shapes, ratio=4, topk=4, scale=1.0)
    assert idx.tolist() == [[0, -1, -1, -1], [1, 0, -1, -1]]


def test_sparse_attention_matches_dense_softmax_with_sink():
    t, h, d, n = 3, 2, 8, 5
    q, kv, sink = torch.randn(t, h, d), torch.randn(n, d), torch.randn(h)
    idx = torch.tensor([[0, 2, -1], [4, -1, -1], [-1, -1, -1]])
    (o,) = _run_op("sparse_attention", {"q": q, "sink": sink, "win_kv": kv, "win_idx": idx},
                   {"q": ["T", h, d], "win_kv": ["N", d], "win_idx": ["T", 3]}, scale=0.5)  # fmt: skip
    for s in range(t):
        rows = kv[[i for i in idx[s].tolist() if i >= 0]]
        for head in range(h):
            logits = torch.cat([rows @ q[s, head] * 0.5, sink[head : head + 1]])
            p = torch.softmax(logits, 0)[:-1]
            torch.testing.assert_close(o[s, head], p @ rows if rows.numel() else torch.zeros(d))


def test_window_indices_and_ring_slots():
    (idx,) = _run_op("window_indices", {"positions": torch.arange(10, 13)}, {"positions": ["T"]}, window=4)
    # pool = ring (4 rows, slot p % 4) then the 3 new rows; positions 7, 8, 9 come from the ring
    assert idx.tolist() == [[3, 0, 1, 4], [0, 1, 4, 5], [1, 4, 5, 6]]
    (idx,) = _run_op("window_indices", {"positions": torch.arange(0, 2)}, {"positions": ["T"]}, window=4)
    assert idx.tolist() == [[-1, -1, -1, 4], [-1, -1, 4, 5]]
    (slots,) = _run_op("ring_slots", {"positions": torch.arange(3, 9)}, {"positions": ["T"]}, size=4)
    assert slots.tolist() == [-1, -1, 1, 2, 3, 0]


def test_moe_route_score_and_hash():
    logits, bias = torch.randn(5, 8), torch.randn(8)
    w, idx = _run_op("moe_route", {"logits": logits, "bias": bias}, {"logits": ["T", 8]}, topk=2, route_scale=1.5)
    score = torch.nn.functional.softplus(logits).sqrt()
    want = torch.topk(score + bias, 2).indices
    assert torch.equal(idx.sort(-1).values, want.sort(-1).values)
    sel = torch.gather(score, 1, idx)
    torch.testing.assert_close(w, sel / sel.sum(-1, keepdim=True) * 1.5)
    tid2eid, tokens = torch.randint(0, 8, (20, 2), dtype=torch.int32), torch.tensor([3, 7, 3, 0, 19])
    b = GraphBuilder("hash")
    ins = [
        b.input("logits", "f32", ["T", 8]),
        None,
        b.input("tid2eid", "i32", [20, 2]),
        b.input("tokens", "i64", ["T"]),
    ]
    b.output(*b.moe_route(*ins, topk=2))
    w, idx = run(b.build(), {"logits": logits, "tid2eid": tid2eid, "tokens": tokens}, check=True)
    assert torch.equal(idx, tid2eid[tokens].long())


def test_hc_head_grouped_linear_and_swiglu_shapes_are_symbolic():
    b = GraphBuilder("shapes")
    x = b.input("x", "f32", ["T", 4, 16])
    y = b.hc_head(x, b.input("fn", "f32", [4, 64]), b.input("base", "f32", [4]), b.input("scale", "f32", [1]))
    u = b.grouped_linear(b.reshape(y, shape=["T", 2, 8]), b.input("w", "f32", [6, 8]))
    s = b.swiglu(u, u, limit=10.0)
    b.output(s)
    g = b.build()
    assert str(s.type) == "f32[T, 2, 3]"
    for t in (1, 5):
        (out,) = run(g, {"x": torch.randn(t, 4, 16), "fn": torch.randn(4, 64), "base": torch.randn(4),
                         "scale": torch.ones(1), "w": torch.randn(6, 8)}, check=True)  # fmt: skip
        assert out.shape == (t, 2, 3)


def test_graph_is_symbolic_in_tokens():
    g = build_graph(TINY_CONFIGS["tiny"], weights="float")
    assert g.symbols() == {"T", "C4", "C8"}
    assert str(g.outputs[0].type) == "f32[T, 512]"
    assert [e["name"] for e in g.meta["caches"]][:6] == [
        "cache.0.swa", "cache.1.swa", "cache.1.ckv", "cache.1.cmp_kv", "cache.1.cmp_score", "cache.1.idx_k",
    ]  # fmt: skip
