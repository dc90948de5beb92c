"""Kernel selection (phase 4): bind every op to a codegen kernel family and a config, per shape bucket.

    g = select_kernels(g, target="sm90", buckets={"decode": {"T": 1}, "prefill": {"T": 2048}})
    g.meta["kernels"]["nodes"]["layers.0.attn.3"]   -> {"op", "family", "configs": {bucket: {...}}, "reduce"}

A binding names the family (a file in codegen/kernels/), the program in it, the shape it is built for at
each bucket and its tile config, chosen by a small cost rule (no tuning database yet: the autotuner will
replace the rule, not the binding format). ``reduce`` lists the config fields that fix a reduction's split
or order (split-K and block_k of a GEMM, the threads sharing an RMSNorm row, the KV chunk of the attention's
online softmax, a collective's algorithm); the batch-invariance check compares them across buckets.

Ops with no family fall back to ``torch_ref`` (the op's torch reference; cuBLAS/ATen on GPU) and are listed
in ``meta["kernels"]["fallback"]`` with the reason; shape-only ops are ``view`` (no launch) and collectives
are ``collective`` (torch.distributed: gloo on cpu, NCCL on GPU).

Batch-invariant mode (``batch_invariant=True`` or DEEPINFER_BATCH_INVARIANT=1): one family per node for
every bucket, and every reduce field pinned to the value the largest bucket chose.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict

from deepinfer.codegen.targets import Target, get_target
from deepinfer.errors import ConfigError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.ir.shapes import evaluate
from deepinfer.passes.pipeline import register_pass

DEFAULT_BUCKETS = {"decode": {"T": 1}, "small": {"T": 64}, "prefill": {"T": 4096}}
DEFAULT_SYMBOL = 8192  # cache lengths (C4, C128, ...) when a bucket does not bind them
ENV_INVARIANT = "DEEPINFER_BATCH_INVARIANT"
VIEW_OPS = {"reshape", "expand", "slice"}
COLLECTIVES = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "cp_gather"}
REDUCING_COLLECTIVES = {"all_reduce", "reduce_scatter"}
DECODE_ATTN_MAX_T = 64  # above this a bucket is prefill: the attention takes sparse_attn_decode.prefill_config


def batch_invariant_mode(option: bool | None = None) -> bool:
    return option if option is not None else os.environ.get(ENV_INVARIANT, "0") not in ("", "0", "false")


class Fallback(Exception):
    """No family applies; the message is the reason recorded in the report."""


class _Ctx:
    """What a binder sees: the node, its shapes evaluated at one bucket, the target."""

    def __init__(self, node: Node, env: dict, target: Target, x: Value | None = None):
        self.node, self.env, self.target = node, env, target
        self.x = x  # the streams input when a binder is reused for a composite op

    def shape(self, v: Value | None) -> tuple[int, ...]:
        return tuple(evaluate(d, self.env) for d in v.shape)

    def rows(self, v: Value) -> int:
        return math.prod(self.shape(v)[:-1])


# ---------------------------------------------------------------------------------------------------
# Binders: (ctx) -> (family, program, shape, config dict, reduce fields); raise Fallback when none applies
# ---------------------------------------------------------------------------------------------------


def _gemm_tiles(m: int, n: int, k_group: int, sms: int) -> dict:
    from deepinfer.codegen.kernels import fp8_gemm

    cfg = fp8_gemm.default_config(k_group)
    bm = 64 if m <= 64 else 128
    bn = 128 if math.ceil(m / bm) * math.ceil(n / 128) >= sms else 64  # small grids: narrower tiles, more CTAs
    return {**asdict(cfg), "block_m": bm, "block_n": bn, "split_k": 1}


def bind_linear_fp8(c: _Ctx):
    x, w = c.node.inputs[0], c.node.inputs[1]
    n, k = c.shape(w)
    k_group = c.node.attrs["act_group"] or c.node.attrs["block"]
    m = c.rows(x)
    return "fp8_gemm", "program", {"M": m, "N": n, "K": k}, _gemm_tiles(m, n, k_group, c.target.sm_count), GEMM_REDUCE


GEMM_REDUCE = ("block_k", "split_k")


def bind_grouped_out_proj(c: _Ctx):
    """wo_a's G group GEMMs as one swap-AB grouped launch (a group is an expert with all T rows), then wo_b
    through fp8_gemm (runtime/kernel_adapters.GroupedOutProjAdapter); block-scaled FP8 weights only."""
    from deepinfer.codegen.kernels import moe_grouped_gemm

    x, wa, wb, sa, sb = c.node.inputs[:5]
    if sa is None or sb is None:
        raise Fallback("the compiled grouped_out_proj takes block-scaled FP8 wo_a and wo_b")
    t, g, k = c.shape(x)
    rows_a, n = c.shape(wa)[0], c.shape(wb)[0]
    cfg = moe_grouped_gemm.swab_config(t, "fp8")
    programs = ["moe_grouped_gemm.swab_program (masked, one expert per group)", "fp8_gemm.program"]
    shape = {"T": t, "G": g, "K": k, "R": rows_a // g, "N": n, "programs": programs}
    return "fp8_gemm", "grouped_out_proj", shape, asdict(cfg), ("block_k",)


def bind_moe(c: _Ctx):
    a = c.node.attrs
    x, idx = c.node.inputs[0], c.node.inputs[2]
    t, d = c.shape(x)
    topk = c.shape(idx)[1]
    first = 9 if c.node.op == "moe_grouped_experts" else 3
    inter = c.shape(c.node.inputs[first])[0]
    if a["fmt"] == "fp4":
        return _bind_moe_w4a8(c, t, d, inter, topk)
    if a["fmt"] != "fp8":
        raise Fallback(f"{a['fmt']} experts: the grouped GEMMs take FP8 or FP4 experts")
    cfg = _gemm_tiles(t * topk, 2 * inter, a["block"], c.target.sm_count)
    return "moe_grouped_gemm", "program", {"M": t * topk, "N": 2 * inter, "K": d}, cfg, GEMM_REDUCE


def _bind_moe_w4a8(c: _Ctx, t: int, d: int, inter: int, topk: int):
    """FP4 experts (the convert pass off, or a target with FP4 loads but no FP4 MMA): the swap-AB W4A8 program
    (FP4 dequantised in registers), masked at decode buckets, contiguous at prefill (the runtime adapter picks
    per call with the node's layout rule; this config is the bucket's)."""
    from deepinfer.codegen.kernels import moe_grouped_gemm

    if c.node.op != "moe_grouped_experts" or c.target.name not in ("sm90", "sm100"):
        raise Fallback("fp4 experts run W4A8 through moe_grouped_experts on sm90 only")
    e = c.node.attrs["n_experts"]
    decode = t <= c.node.attrs.get("masked_max_t", 64)
    cfg = moe_grouped_gemm.swab_config(max(1, -(-t * topk // e)), "fp4", contiguous=not decode)
    shape = {"M": t * topk, "N": 2 * inter, "K": d, "fmt": "fp4", "layout": "masked" if decode else "contiguous"}
    return "moe_grouped_gemm", "swab_program", shape, asdict(cfg), ("block_k",)


def bind_rmsnorm_config(m: int, d: int, quant: bool, sm_count: int):
    """The rmsnorm(_quant) config for m rows of d: None when the space is empty."""
    from deepinfer.codegen.kernels import rmsnorm_quant

    space = rmsnorm_quant.config_space(m, d, quant=quant)
    if not space:
        return None
    # Few rows: many threads per row (parallelism inside the row); many rows: fewer threads, rows per block.
    want_threads = max(cf.threads for cf in space) if m < sm_count else min(cf.threads for cf in space)
    rows_per_block = (lambda cf: cf.block_m) if m >= 4096 else (lambda cf: -cf.block_m)
    return max((cf for cf in space if cf.threads == want_threads), key=rows_per_block)


def bind_rmsnorm(c: _Ctx):
    x = c.node.inputs[0]
    m, d = c.rows(x), c.shape(x)[-1]
    quant = c.node.op == "rmsnorm_quant_fp8"
    cfg = bind_rmsnorm_config(m, d, quant, c.target.sm_count)
    if cfg is None:
        raise Fallback(f"rmsnorm_quant has no config for D={d}")
    return "rmsnorm_quant", "program", {"M": m, "D": d, "quant": quant}, asdict(cfg), ("threads",)


def bind_route(c: _Ctx):
    from deepinfer.codegen.kernels import moe_routing

    a, inputs = c.node.attrs, c.node.inputs
    fused = c.node.op == "moe_gate_route"  # (x, gate_weight, bias, tid2eid, tokens): the gate GEMM comes first
    bias, tid2eid = (inputs[2], inputs[3]) if fused else (inputs[1], inputs[2])
    if tid2eid is not None or a["scoring"] != "sqrtsoftplus" or not a["normalize"] or bias is None:
        raise Fallback("moe_routing covers score routing (sqrtsoftplus, bias, normalised); hash routing is a lookup")
    t = c.rows(inputs[0])
    e = c.shape(inputs[1])[0] if fused else c.shape(inputs[0])[-1]
    # one row per CTA, and threads that split the E scores evenly (TileLang finds no fragment layout for 384 experts
    # over 256 threads: the H200 build failed there)
    space = [cf for cf in moe_routing.config_space(t, e) if cf.block_m == 1 and e % cf.threads == 0]
    space = space or [moe_routing.Config()]
    extra = {"torch_steps": ["gate GEMM x @ W_gate^T (fp32 logits)"]} if fused else {}
    return "moe_routing", "program", {"T": t, "E": e, "topk": a["topk"], **extra}, asdict(space[-1]), ()


def bind_attention(c: _Ctx):
    from deepinfer.codegen.kernels import sparse_attn_decode

    fused = c.node.op == "fused_attention"
    if fused:
        q, _, _, _, win_idx, _, cmp_idx = c.node.inputs
    else:
        q, _, _, win_idx, _, cmp_idx = c.node.inputs
    t, h, d = c.shape(q)
    topk = c.shape(win_idx)[1] + (c.shape(cmp_idx)[1] if cmp_idx is not None else 0)
    prefill = t > DECODE_ATTN_MAX_T
    if c.target.name in ("sm90", "sm100") and prefill:
        # the op is per query (its own window list, causal in the chunk; its own selection): the program at B = T
        cfg = sparse_attn_decode.prefill_config(t, topk, c.target.sm_count)
        if topk % cfg.block_n:
            raise Fallback(f"sparse_attn_decode needs top-k (here {topk}) to be a multiple of its KV chunk")
    elif c.target.name in ("sm90", "sm100"):
        cfg = sparse_attn_decode.sm90_config(t, topk, c.target.sm_count)  # split-K: fill the SMs at small B
        if topk % (cfg.num_split * cfg.block_n):
            raise Fallback(f"sparse_attn_decode needs top-k (here {topk}) to be a multiple of its KV chunk")
    elif prefill:
        raise Fallback(f"prefill bucket (T={t}): sparse_attn_decode serves prefill on sm90 / sm100 only")
    else:
        space = sparse_attn_decode.config_space(t, topk)
        if not space:
            raise Fallback(f"sparse_attn_decode needs top-k (here {topk}) to be a multiple of its KV chunk")
        cfg = space[0] if t * h < 2 * c.target.sm_count else space[-1]  # small batches: short KV chunks
    shape = {"B": t, "H": h, "D": d, "topk": topk, **({"prefill": True} if prefill else {})}
    if fused:  # the kernel is the attention core only; the op's other steps run in torch around it
        a = c.node.attrs
        steps = (("q rmsnorm", a["q_norm"]), ("rope(q)", True), ("inverse rope(o)", True),
                 ("reshape to out_groups", bool(a["out_groups"])),
                 ("quant_fp8 epilogue", bool(a["quant_group"])))  # fmt: skip
        shape["torch_steps"] = [s for s, on in steps if on]
    # block_n and num_split fix the online softmax's chunking and the split-K combine order
    return "sparse_attn_decode", "program", shape, asdict(cfg), ("block_n", "num_split")


def bind_rope(c: _Ctx):
    from deepinfer.codegen.kernels import rope

    x = c.node.inputs[0]
    s = c.shape(x)
    t, d = s[0], s[-1]
    h = math.prod(s[1:-1])
    space = rope.config_space(t, h) or [rope.Config(1, 128)]
    cfg = max(space, key=lambda cf: (cf.block_t if t >= 1024 else -cf.block_t, -cf.threads))
    shape = {"T": t, "H": h, "D": d, "rope_dim": c.node.attrs["rope_dim"], "inverse": c.node.attrs["inverse"]}
    return "rope", "program", shape, asdict(cfg), ()  # no reduction: per-element rotation


def bind_engram_embed(c: _Ctx):
    from deepinfer.codegen.kernels import engram

    table, scale, ids = c.node.inputs
    if scale is None:
        raise Fallback("engram embed kernel reads the FP8 table with ue8m0 scales; this table is unquantised")
    r, hd = c.shape(table)
    if hd % engram.SCALE_GROUP:
        raise Fallback(f"engram rows of {hd} values do not split into scale groups of {engram.SCALE_GROUP}")
    t, k = c.shape(ids)
    cfg = engram.EmbedConfig(block_t=1 if t < 64 else 4, threads=256 if hd >= 256 else 128)
    return "engram", "embed_program", {"T": t, "K": k, "R": r, "hd": hd}, asdict(cfg), ()


def bind_engram_gate(c: _Ctx):
    from deepinfer.codegen.kernels import engram

    t, n, d = c.shape(c.node.inputs[0])
    space = engram.gate_config_space(d)
    # block_d splits the row's sums over D (fixed order inside a CTA): pinned per D, not per bucket
    cfg = space[len(space) // 2] if space else engram.GateConfig(block_d=d, threads=min(256, max(32, d)))
    return "engram", "gate_program", {"T": t, "n": n, "D": d}, asdict(cfg), ("block_d", "threads")


def bind_engram_hash(c: _Ctx):
    """engram_hash / batched_engram_hash -> codegen/kernels/engram_hash: one Triton launch (the compressed-map
    lookups and every order's hashes; runtime/kernel_adapters.EngramHashAdapter), the reference's ids exactly; CUDA
    targets only."""
    from deepinfer.codegen.kernels import engram_hash

    if c.target.name not in ("sm90", "sm100"):
        raise Fallback("the Engram hash kernel is Triton on CUDA")
    (t,) = c.shape(c.node.inputs[0])
    cfg = engram_hash.default_config(t)
    return "engram_hash", "triton", {"T": t, "K": len(c.node.attrs["primes"])}, asdict(cfg), ()  # exact (integers)


def bind_compressor(c: _Ctx):
    a, inputs = c.node.attrs, c.node.inputs
    pair = c.node.op == "pair_compressor_keys"
    t, d = c.shape(inputs[0])
    ratio = 2 if pair else 1
    steps = ["rope(entry)", "wk GEMM", "rmsnorm(k_norm)", "rope(keys)"]
    shape = {"T": t, "d": d, "ratio": ratio, "eps": a["eps"], "torch_steps": steps}
    # pooling + RMSNorm of the latent; one CTA owns a row's reduction whatever block_g is
    return "compressor", "program", shape, {"block_g": 4 if t >= 64 else 1, "threads": 128}, ("threads",)


def bind_batched_pair_compressor(c: _Ctx):
    """batched_pair_compressor_keys (a graph bound after batch_decode; batch_decode itself keeps the one-sequence
    node's "compressor" binding, whose adapters run this kernel too) -> pair_compressor's Triton kernel: one program
    per sequence, so its config and every row's reductions are the same whatever B is."""
    from deepinfer.codegen.kernels import pair_compressor

    kv, wk = c.node.inputs[0], c.node.inputs[6]
    (b, d), di, r = c.shape(kv), c.shape(wk)[0], c.node.attrs["rope_dim"]
    cfg = pair_compressor.default_config(b, d, di)
    if c.target.name not in ("sm90", "sm100"):
        raise Fallback("the batched pair compressor kernel is Triton on CUDA")
    try:
        pair_compressor.check_shapes(d, di, r, cfg)
    except AssertionError as e:
        raise Fallback(f"batched pair compressor kernel: {e}") from None
    return "pair_compressor", "triton", {"B": b, "d": d, "di": di}, asdict(cfg), ("out_block", "warps")


SCORES_DECODE_MAX_T = 256  # up to this many queries the f32 scores kernel takes its decode tile
# above it (prefill chunks) 128 keys x 8 warps a CTA: q's 3xTF32 split amortised over twice the keys. H200,
# T8192 (session 6): 2.14 ms (C4096, ratio 2) / 4.00 ms (C8192, ratio 1) vs 3.07 / 5.74 ms at the decode tile and
# 14.9 / 29.7 ms for the op's torch reference (kernels_h200 --only "prefill index_scores")
SCORES_PREFILL_TILE = {"block_c": 128, "warps": 8}


def bind_index_scores(c: _Ctx):
    """index_scores -> indexer_topk's f32 Triton kernel (triton_scores: ~fp32, the graph's f32 q and keys as they
    are; the FP8/bf16 scores kernels would change the op's numbers by ~1e-3 of a row's maximum), at decode and at
    prefill with a wider key tile. The tile fixes the layout of the in-register head sum, so block_c and warps are
    reduce fields with the precision (pinned across buckets in batch-invariant mode)."""
    from deepinfer.codegen.kernels import indexer_topk as it

    q, _, keys, _ = c.node.inputs
    t, h, di = c.shape(q)
    if c.target.name not in ("sm90", "sm100") or di & (di - 1):
        raise Fallback(f"the f32 scores kernel is Triton on CUDA with di a power of two (di={di})")
    dflt = it.f32_scores_config(t, c.shape(keys)[0], h)
    tile = SCORES_PREFILL_TILE if t > SCORES_DECODE_MAX_T else {"block_c": dflt.block_c, "warps": dflt.warps}
    cfg = {"precision": "tf32x3", **tile}
    return "indexer_topk", "triton_scores", {"T": t, "C": c.shape(keys)[0], "di": di}, cfg, (
        "precision", "block_c", "warps")


def bind_batched_index_scores(c: _Ctx):
    """batched_index_scores (a graph bound after batch_decode; batch_decode itself keeps the one-sequence node's
    index_scores binding, whose family runs this op too) -> the same f32 Triton kernel with per-query keys
    (triton_batched_scores): one query a CTA and one tile for every B (the adapter's: 64 keys x 4 warps, the
    fastest on the H200 at B 64 and 256), so a sequence's scores do not depend on B."""
    from deepinfer.codegen.kernels import indexer_topk as it

    q, _, keys, _ = c.node.inputs
    b, h, di = c.shape(q)
    if c.target.name not in ("sm90", "sm100") or di & (di - 1):
        raise Fallback(f"the f32 scores kernel is Triton on CUDA with di a power of two (di={di})")
    n = c.shape(keys)[0] // max(1, b)
    dflt = it.f32_batched_scores_config(b, n, h)
    cfg = {"precision": "tf32x3", "block_c": dflt.block_c, "warps": dflt.warps}
    return "indexer_topk", "triton_batched_scores", {"B": b, "C": n, "di": di}, cfg, ("precision", "block_c", "warps")


LINEAR_BF16_MAX_T = 256  # decode `linear` (f32 x, bf16 weight) on linear_bf16's Triton kernel up to this many rows
LINEAR_BF16_MAX_WEIGHT = 1 << 24  # larger weights (the head) keep the reference's three-term cuBLAS split


def bind_linear(c: _Ctx):
    """linear with fp32 x and a bf16 weight at decode (the compressor's wkv / wgate, the indexer's weights_proj)
    -> linear_bf16: the weight read once as stored, x as three exact bf16 terms (the op's fp32 numbers up to the
    order of the sums), K split over CTAs; `splits` fixes that order (pinned in batch-invariant mode)."""
    from deepinfer.codegen.kernels import linear_bf16

    x, w, bias = c.node.inputs
    t, (n, k) = c.rows(x), c.shape(w)
    if c.target.name not in ("sm90", "sm100") or x.dtype.name != "f32" or w.dtype.name != "bf16" or bias is not None:
        raise Fallback("linear_bf16 takes f32 x and a bf16 weight without bias, on CUDA")
    if t > LINEAR_BF16_MAX_T or n * k >= LINEAR_BF16_MAX_WEIGHT or k % 64:
        raise Fallback(f"linear_bf16 is the decode form (T <= {LINEAR_BF16_MAX_T}, weight < 16M elements, K % 64 "
                       f"== 0; T={t}, weight {n}x{k}): cuBLAS (the reference) otherwise")  # fmt: skip
    cfg = linear_bf16.default_config(t, n, k)
    return "linear_bf16", "triton", {"T": t, "N": n, "K": k}, asdict(cfg), ("splits", "block_k")


def bind_topk_entries(c: _Ctx):
    """topk_entries -> topk_select's exact program (the runtime puts its set back in score order). With the op's
    positions the program reads each row's visible columns only (has_pos: the step's work follows the sequence's
    length, not the cache's columns); without them every column (-inf marks the invisible ones). Two-level
    (candidate blocks): the program selects from the blocks' gathered columns when they are fewer than the row's,
    else from the row with the other columns -inf (runtime/kernel_adapters.TopKEntriesAdapter)."""
    from deepinfer.codegen.kernels import topk_select

    scores, blocks, positions = _topk_inputs(c.node)
    t, cols = c.shape(scores)
    shape: dict = {"T": t, "C": cols, "k": c.node.attrs["topk"]}
    n_blocks = c.shape(blocks)[1] if blocks is not None else None
    if blocks is not None:
        shape["candidates"] = n_blocks * c.node.attrs["block"]
    elif c.node.attrs["block"] != 1:
        raise Fallback("topk_entries with a block size but no candidate blocks")
    cols, gathers = topk_select.selected_columns(cols, n_blocks, c.node.attrs["block"])
    if positions is not None and not gathers:
        shape |= {"has_pos": True, "ratio": int(c.node.attrs.get("ratio", 1))}
    k = shape["k"]
    cfg = topk_select.default_config(t, cols, k)
    try:
        assert cols >= k, f"C={cols} < k={k}"
        topk_select.check_config(cols, k, cfg)
    except AssertionError as e:
        raise Fallback(f"topk_select does not take C={cols}, k={k}: {e}") from None
    return "topk_select", "program", shape, asdict(cfg), ()  # exact: nothing to pin


def _topk_inputs(node: Node) -> tuple[Value, Value | None, Value | None]:
    """(scores, blocks, positions) of a topk_entries node (graphs written before positions have two inputs)."""
    ins = [*node.inputs, None, None]
    return ins[0], ins[1], ins[2]


SCORE_OPS = ("index_scores", "batched_index_scores")


def _positions_aware(reader: Node) -> bool:
    """A reader of index scores that never looks past a row's visible columns: a topk_entries with positions, or
    candidate_blocks (its block maxima count only the columns j < (p+1)//ratio)."""
    return reader.op == "candidate_blocks" or (reader.op == "topk_entries" and _topk_inputs(reader)[2] is not None)


def _scores_fill(g: Graph, nodes: dict) -> None:
    """Index scores whose every reader is positions-aware need no -inf past the visible columns: their kernel
    bindings get fill False (the scores kernel's balanced forms then leave those columns unwritten). Any other
    reader (a graph output, a top-k without positions) keeps the op's -inf."""
    users, outputs = g.users(), {v.name for v in g.outputs}
    for node in g.nodes:
        name = node.outputs[0].name
        if node.op not in SCORE_OPS or name in outputs:
            continue
        readers = users.get(name, [])
        if not readers or not all(_positions_aware(r) for r in readers):
            continue
        for b in nodes[name]["buckets"].values():
            if b["family"] == "indexer_topk":
                b["config"]["fill"] = False


def bind_hc_pre(c: _Ctx):
    from deepinfer.codegen.kernels import hyper_connection as hc

    x = c.x if c.x is not None else c.node.inputs[0]
    t, n, d = c.shape(x)
    if n != hc.N_HC:
        raise Fallback(f"hyper_connection is built for {hc.N_HC} streams, not {n}")
    cfg = hc.Config(block_m=16 if t < 1024 else 64, block_k=128 if d % 128 == 0 else 64, threads=128)
    return "hyper_connection", "pre_program", {"T": t, "D": d}, asdict(cfg), ("block_k", "threads")


def bind_hc_post_pre(c: _Ctx):
    """hc_post_pre_collapse: post_program then pre_program (two launches; the runtime adapter chains them);
    the config is the pre kernel's (the post kernel takes its fixed one)."""
    family, _, shape, cfg, reduce = bind_hc_pre(_Ctx(c.node, c.env, c.target, x=c.node.inputs[1]))
    return family, "post_pre", {**shape, "programs": ["post_program", "pre_program"]}, cfg, reduce


def bind_hc_post(c: _Ctx):
    from deepinfer.codegen.kernels import hyper_connection as hc

    t, n, d = c.shape(c.node.inputs[1])
    if n != hc.N_HC:
        raise Fallback(f"hyper_connection is built for {hc.N_HC} streams, not {n}")
    return "hyper_connection", "post_program", {"T": t, "D": d}, {"block_m": 1, "block_d": 512, "threads": 128}, ()


def bind_fake_quant(c: _Ctx):
    """fake_quant_fp8 (fold_qdq leaves one where a Q/DQ pair has a reader other than an FP8 GEMM): act_quant's
    Triton kernel + the exact dequantisation (runtime/kernel_adapters.FakeQuantAdapter)."""
    x = c.node.inputs[0]
    m, k = c.rows(x), c.shape(x)[-1]
    return "act_quant", "triton", {"M": m, "K": k, "group": c.node.attrs["group"]}, {}, ()


def bind_dequant(c: _Ctx):
    """dequant_fp8 (the attention's FP8 output -> fp32) -> act_quant's Triton dequantisation (one launch, the op's
    numbers bit for bit); CUDA targets only."""
    q = c.node.inputs[0]
    if c.target.name not in ("sm90", "sm100") or c.node.attrs.get("dtype", None) not in (None, dt.f32):
        raise Fallback("the dequant kernel is Triton on CUDA and writes fp32")
    return "act_quant", "triton_dequant", {"M": c.rows(q), "K": c.shape(q)[-1], "group": c.node.attrs["group"]}, {}, ()


def bind_scatter_rows(c: _Ctx):
    """scatter_rows -> cache_rows (a cache copy + one Triton launch for the rows); CUDA targets only."""
    cache, index, _ = c.node.inputs
    if c.target.name not in ("sm90", "sm100"):
        raise Fallback("the row scatter is Triton on CUDA")
    return "cache_rows", "triton_scatter", {"N": c.shape(cache)[0], "M": c.shape(index)[0]}, {}, ()


def bind_candidate_blocks(c: _Ctx):
    """candidate_blocks (V4.1 layer 20's candidate level) -> codegen/kernels/candidate_blocks: two Triton launches
    (the visible blocks' maxima, one sort a row; runtime/kernel_adapters.CandidateBlocksAdapter), the reference's
    ids exactly; CUDA targets only. The config recorded is the rule's at this bucket's shape (the adapter derives
    it again from the tensors it runs: the cache's columns decide the sort's size)."""
    from deepinfer.codegen.kernels import candidate_blocks as cb

    if c.target.name not in ("sm90", "sm100"):
        raise Fallback("candidate_blocks' kernel is Triton on CUDA")
    t, cols = c.shape(c.node.inputs[0])
    k, block = c.node.attrs["topk_blocks"], c.node.attrs["block"]
    cfg = cb.default_config(t, cols, block, k)
    try:
        cb.check_config(cols, block, k, cfg)
    except ValueError as e:
        raise Fallback(str(e)) from None
    return "candidate_blocks", "triton", {"T": t, "C": cols, "k": k, "block": block}, asdict(cfg), ()  # exact


BINDERS: dict[str, Callable] = {
    "linear": bind_linear,
    "linear_fp8": bind_linear_fp8,
    "grouped_out_proj": bind_grouped_out_proj,
    "moe_experts": bind_moe,
    "moe_experts_local": bind_moe,
    "moe_grouped_experts": bind_moe,
    "rmsnorm": bind_rmsnorm,
    "rmsnorm_quant_fp8": bind_rmsnorm,
    "moe_route": bind_route,
    "moe_gate_route": bind_route,  # the gate GEMM stays in torch (recorded in the shape's torch_steps)
    "sparse_attention": bind_attention,
    "fused_attention": bind_attention,  # decode buckets; q-norm / RoPE / inverse RoPE stay in torch
    "rope": bind_rope,
    "engram_embed": bind_engram_embed,
    "engram_gate": bind_engram_gate,
    "engram_hash": bind_engram_hash,
    "batched_engram_hash": bind_engram_hash,  # a batched graph bound by select_kernels itself
    "pair_compressor_keys": bind_compressor,  # pooling + norm in the kernel; RoPE, wk GEMM, k_norm in torch
    "compressor_keys": bind_compressor,
    "batched_pair_compressor_keys": bind_batched_pair_compressor,
    "index_scores": bind_index_scores,
    "topk_entries": bind_topk_entries,
    "candidate_blocks": bind_candidate_blocks,
    "hc_pre_collapse": bind_hc_pre,  # V4.1's single-pass pre is what pre_program computes
    "hc_stats": bind_hc_pre,
    "fake_quant_fp8": bind_fake_quant,
    "dequant_fp8": bind_dequant,
    "scatter_rows": bind_scatter_rows,  # pre_program's coefficients (its collapse output unused)
    "hc_post": bind_hc_post,
    "hc_post_pre_collapse": bind_hc_post_pre,  # V4.1: post_program then pre_program
    "batched_index_scores": bind_batched_index_scores,  # a batched graph bound by select_kernels itself
}


# ---------------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------------


def _bind_bucket(node: Node, env: dict, target: Target) -> dict:
    if node.op in VIEW_OPS:
        return {"family": "view"}
    if node.op in COLLECTIVES:
        return {"family": "collective", "backend": "gloo" if target.name == "cpu" else "nccl"}
    binder = BINDERS.get(node.op)
    if binder is None:
        return {"family": "torch_ref", "reason": "no kernel family for this op"}
    try:
        family, program, shape, cfg, reduce = binder(_Ctx(node, env, target))
    except Fallback as e:
        return {"family": "torch_ref", "reason": str(e)}
    return {"family": family, "program": program, "shape": shape, "config": cfg, "reduce": list(reduce)}


def _collective_algo(node: Node, per: dict, invariant: bool) -> None:
    # NCCL picks ring or tree by message size (so by T) unless pinned; a sum's order follows the algorithm.
    if node.op in REDUCING_COLLECTIVES:
        for b in per.values():
            b.update(config={"algo": "ring" if invariant else "auto"}, reduce=["algo"])


def _pin(per: dict, order: list[str]) -> None:
    """Batch-invariant: one family everywhere, and the largest bucket's reduce fields in every bucket."""
    ref = per[order[-1]]
    if any(b["family"] != ref["family"] for b in per.values()):
        reason = "batch-invariant mode: one implementation for every bucket"
        for name in per:
            per[name] = {"family": "torch_ref", "reason": reason}
        return
    for b in per.values():
        for f in ref.get("reduce", []):
            b["config"][f] = ref["config"][f]


def _env(g: Graph, bucket: dict) -> dict:
    syms = set(g.symbols())
    for v in g.params:
        for d in v.shape:
            if not isinstance(d, int):
                syms |= d.free_symbols
    return {**{s: DEFAULT_SYMBOL for s in syms}, **bucket}


@register_pass("select_kernels")
def select_kernels(
    g: Graph, *, target: str = "cpu", buckets: dict | None = None, batch_invariant: bool | None = None
) -> Graph:
    """Bind every node to a kernel family + config per bucket (graph.meta["kernels"])."""
    tgt = get_target(target)
    buckets = buckets or ({"bucket": g.meta["bucket"]} if g.meta.get("bucket") else DEFAULT_BUCKETS)
    if not isinstance(buckets, dict) or not all(isinstance(b, dict) for b in buckets.values()):
        raise ConfigError("select_kernels: buckets must map names to symbol bindings, e.g. {'decode': {'T': 1}}")
    invariant = batch_invariant_mode(batch_invariant)
    envs = {name: _env(g, b) for name, b in buckets.items()}
    order = sorted(envs, key=lambda n: envs[n].get("T", 0))
    nodes, fallback = {}, {}
    for node in g.nodes:
        per = {name: _bind_bucket(node, env, tgt) for name, env in envs.items()}
        _collective_algo(node, per, invariant)
        if invariant:
            _pin(per, order)
        nodes[node.outputs[0].name] = {"op": node.op, "buckets": per}
        for b in per.values():
            if b["family"] == "torch_ref":
                fallback.setdefault(node.op, b["reason"])
    _scores_fill(g, nodes)
    g.meta["kernels"] = {
        "target": target,
        "buckets": {n: dict(b) for n, b in buckets.items()},
        "batch_invariant": invariant,
        "nodes": nodes,
        "fallback": fallback,
        "coverage": coverage(nodes),
    }
    return g


def coverage(nodes: dict) -> dict[str, int]:
    """Nodes per family (a node counts under the family of its first bucket)."""
    out: dict[str, int] = {}
    for rec in nodes.values():
        fam = next(iter(rec["buckets"].values()))["family"]
        out[fam] = out.get(fam, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def format_kernel_report(g: Graph) -> str:
    k = g.meta["kernels"]
    lines = [f"kernels for {k['target']} (buckets {', '.join(k['buckets'])}; batch-invariant {k['batch_invariant']})"]
    lines += [f"  {fam:<20} {n:>5} nodes" for fam, n in k["coverage"].items()]
    lines += [f"  torch_ref: {op}: {why}" for op, why in sorted(k["fallback"].items())]
    return "\n".join(lines)
