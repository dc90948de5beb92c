"""Batched decode of B sequences on an H200: one step of the batch_decode graph (B sequences, each with `context`
cached tokens), per real V4.1 layer, vs the HBM roofline counting every sequence's cache reads, vs torch eager
and torch.compile of the same batched graph.

    python3 benchmarks/bench_batched_decode.py [--layers 2,20] [--batches 16,64] [--context 4096] [--reps 5]
                                               [--compile-batches 64] [--no-torch-compile] [--budget-s 420]
                                               [--preset real|small|tiny] [-j 15] [--out DIR] [--dry-run]
                                               [--check-only]

The slice (real layers renumbered into one graph, random weights on the GPU in the checkpoint formats) is
bench_slice.py's, imported; the batched graph is passes/batch_decode.py's rewrite of it and runs on
runtime/batched_decode.py's executor (kernels at T = B for the row-wise nodes, the decode attention kernel over
the flat pools, batched_* ops as torch references, cache writes in place). Unlike bench_slice's "decode B"
(B new tokens of ONE sequence: a lower bound), each of the B sequences here has its own caches at `context`
(positions context-1 and context alternate, so ratio-2 layers close a pair in half of them).

Per layer (CUDA events between the layers' graphs, median of reps):
  graph ms     the step as one CUDA graph per layer (runtime/layer_graphs.py: warm-up, host reads named,
               capture, replay checked against the eager step)
  exec ms      the executor node by node from Python
  eager ms     every node's torch reference (the executor, and the same references as a straight-line function
               per layer: the faster of the two is "torch eager")
  compile ms   that straight-line function under torch.compile (bench_slice.layer_baselines)
  B x 1-seq    B times one sequence's single-token step (the one-sequence graph at T=1, its kernels, CUDA graphs
               per layer): what the engine's decode chains per step without the batched graph
Roofline per layer: the bytes that must be read over the HBM copy bandwidth measured in the run -- the weights
(dense + the expected distinct experts of B tokens, bench_slice.layer_roofline) plus, for EVERY sequence, the
cache rows the step must read: all index keys (the indexer scores each one), the attended compressed rows
(top-k per query), the window ring, the compressor states -- against the FP8 peak for the flops; "kv MB" is the
cache part. Each case also checks the step: the batched graph's references against the one-sequence graph's for
two sequences (pinned at their rounding flips too: reference_check), and the kernels against the batched references
(logits). --preset tiny is the CPU smoke mode (tiny dims, kernel stand-ins, emulated graphs, nominal limits);
--preset small the same at the small preset's dims, where the caches are stored in bf16 as at real dims.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_slice as bs  # noqa: E402  (the slice, weights, roofline, timing and baselines)
import torch  # noqa: E402

TINY_LAYERS = (2, 6)  # tiny / small V4.1: the ratio-2 kv source and the ratio-1 source (real layers 2 and 20)
log = bs.log


# ---------------------------------------------------------------------------------------------- setup


def setup(layers, preset: str, budget_s: float, max_len: int, donate: bool = True, compact: bool = True):
    """The slice, its weights, the batched decoder (compiled) and the eager executor of the same batched graph."""
    from deepinfer.runtime import cuda_graphs as cg
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.batched_decode import BatchedDecoder
    from deepinfer.runtime.cuda_executor import GraphExecutor, KernelCache, require_cuda

    if preset == "real":
        require_cuda("the batched decode benchmark")
        import kernels_h200

        lim, device, nominal = kernels_h200.measure_limits(quick=True), "cuda", False
        kernels = KernelCache(budget_s=max(30.0, budget_s * 0.4))
        backend_factory = lambda: cg.CudaGraphBackend(torch.device("cuda"))  # noqa: E731
    else:
        lim, device, nominal = SimpleNamespace(hbm=4.3e12, fp8=1.98e15, bf16=0.99e15), "cpu", True
        ka.EMULATE = True  # the adapters take CPU tensors; their kernels are torch stand-ins
        kernels = KernelCache(builder=bs._cpu_stand_in)
        backend_factory = cg.EmulatedGraphBackend
    log(f"limits{' (nominal, CPU smoke mode)' if nominal else ''}: HBM copy {lim.hbm / 1e12:.2f} TB/s, "
        f"FP8 {lim.fp8 / 1e12:.0f} TFLOPS")  # fmt: skip
    g = bs.slice_graph(layers=layers, experts="fp8", preset=preset)
    params = bs.gpu_weights(g, device=device)
    dec = BatchedDecoder(g, params, device, max_model_len=max_len, kernels=kernels, donate_caches=donate,
                         compact=compact)  # fmt: skip
    dec.exec.prep_cache[ka.GLU_POLICY] = "auto"
    dec.exec.prep_cache.update(ka.moe_act_cache_entries(g.meta))
    eager = GraphExecutor(dec.graph, params, compiled=False)
    log(f"batched graph: {len(dec.graph.nodes)} nodes ({len(g.nodes)} one-sequence), batched ops "
        f"{ {k: v for k, v in dec.graph.op_counts().items() if k.startswith('batched_')} }")  # fmt: skip
    return SimpleNamespace(g=g, dec=dec, params=params, eager=eager, lim=lim, device=device, nominal=nominal,
                           backend_factory=backend_factory, single=None, single_steps=True,
                           check_only=False)  # fmt: skip


def batched_feeds(dec, b: int, context: int, device: str, seed: int = 0) -> dict:
    """B sequences at positions context-1 / context (alternating), caches random (attention and top-k see
    realistic, tie-free scores), one [B, ...] tensor per cache."""
    gen = torch.Generator(device=device).manual_seed(seed)
    caches = dec.allocate(b)
    for v in caches.values():
        if v.is_floating_point():
            v.normal_(0.0, 0.5, generator=gen)
    positions = torch.tensor([context - 1 + (i % 2) for i in range(b)], device=device)
    tokens = torch.randint(3, 120000 if device == "cuda" else 500, (b,), device=device, generator=gen)
    return dec.feeds(tokens, positions, caches)


# ---------------------------------------------------------------------------------------------- roofline


def cache_read_bytes(graph, feeds: dict) -> dict[str, float]:
    """Per layer: the cache bytes one batched step must read for ALL its sequences (see the module doc)."""
    from deepinfer.ir.interpreter import bind_symbols
    from deepinfer.ir.shapes import evaluate
    from deepinfer.runtime.cuda_executor import plan_steps

    env = bind_symbols(graph, feeds)

    def nbytes(v, rows=None) -> float:  # a value's bytes, or `rows` of its rows
        shape = [evaluate(d, env) for d in v.shape]
        n = rows * math.prod(shape[1:]) if rows is not None else math.prod(shape)
        return n * v.dtype.torch_dtype.itemsize

    b = int(feeds["tokens"].shape[0])
    out: dict[str, float] = {}
    for step in plan_steps(graph):
        node, acc = step.node, 0.0
        if node.op in ("batched_index_scores", "batched_indexer_topk"):
            acc = nbytes(node.inputs[2])  # every index key of every sequence
        elif node.op == "batched_compressor":
            acc = nbytes(node.inputs[4]) + nbytes(node.inputs[5])  # the compressor rings
        elif node.op == "batched_pair_compressor_keys":
            acc = nbytes(node.inputs[2]) + nbytes(node.inputs[3])  # the pending rows
        elif node.op == "fused_attention":
            acc = nbytes(node.inputs[3], b * evaluate(node.inputs[4].shape[1], env))  # the window rows
            if node.inputs[6] is not None:  # the attended compressed rows (top-k per query)
                acc += nbytes(node.inputs[5], b * evaluate(node.inputs[6].shape[1], env))
        if acc:
            out[step.layer] = out.get(step.layer, 0.0) + acc
    return out


def layer_rows(st, b: int, feeds: dict, graph_ms: dict, exec_ms: dict, eager_ms: dict, base: dict) -> dict:
    roof = bs.layer_roofline(st.dec.graph, st.params, b)
    kv = cache_read_bytes(st.dec.graph, feeds)
    rows = {}
    for layer, ms in exec_ms.items():
        w_bytes, flops = roof.get(layer, (0.0, 0.0))
        total = w_bytes + kv.get(layer, 0.0)
        bound_ms = max(total / st.lim.hbm, flops / st.lim.fp8) * 1e3
        ours = graph_ms.get(layer, ms)
        r = {"graph_ms": graph_ms.get(layer, float("nan")), "exec_ms": ms,
             "eager_ms": eager_ms.get(layer, float("nan")), "weight_bytes": w_bytes, "kv_bytes": kv.get(layer, 0.0),
             "flops": flops, "bound_ms": bound_ms,
             "roofline_pct": 100 * bound_ms / ours if ours else 0.0,
             "weights_only_pct": 100 * max(w_bytes / st.lim.hbm, flops / st.lim.fp8) * 1e3 / ours if ours else 0.0,
             "tok_s": b / (ours * 1e-3) if ours else 0.0}  # fmt: skip
        r.update(base.get(layer, {}))
        r["torch_eager_ms"] = min(x for x in (r["eager_ms"], r.get("line_ms", float("inf"))) if x == x)
        rows[layer] = r
    return rows


# ---------------------------------------------------------------------------------------------- one case


def case(st, b: int, context: int, reps: int, jobs: int, end: float, compile_on: bool, mode: str) -> dict:
    """One batch size: the executor and eager times first, then the checks, the layer graphs and the baselines,
    the single-token step and the per-op profile -- a stage that fails is recorded and the next ones still run."""
    row: dict = {"case": f"batched decode {b} ctx {context}", "sequences": b, "context": context}
    try:
        feeds = batched_feeds(st.dec, b, context, st.device)
        ex = st.dec.exec
        if jobs and st.device == "cuda":
            from deepinfer.runtime.kernel_adapters import prebuild

            keys = [k for k in ex.kernel_keys(feeds) if k not in ex.kernels.kernels]
            prebuild(keys, jobs, max(10.0, (end - time.time()) * 0.5), log)
        t0 = time.time()
        ex.run(feeds)
        _sync(st)
        log(f"{row['case']}: first call {time.time() - t0:.1f} s")
        if not st.check_only:
            row["node_runs"] = bs._node_runs(ex, lambda: ex.run(feeds))
            exec_ms, row["exec_total_ms"] = bs.time_layers(ex, feeds, reps)
            eager_ms, row["eager_total_ms"] = bs.time_layers(st.eager, feeds, max(2, reps // 2))
    except Exception as e:
        return _failed(row, "setup", e)
    graph_ms, base = {}, {}
    try:
        chk = row["check"] = reference_check(st, feeds)
        log(f"{row['case']}: logits max rel err: {format_check(chk)}")
    except Exception as e:
        _failed(row, "check", e)
    if st.check_only:
        row["skipped"] = "timings (--check-only)"
        return row
    try:
        graph_ms, base = _graph_stage(st, row, feeds, reps, end, compile_on, mode)
    except Exception as e:
        _failed(row, "graphs", e)
    row["layers"] = layer_rows(st, b, feeds, graph_ms, exec_ms, eager_ms, base)
    if st.single_steps:
        try:
            for layer, ms in single_step_ms(st, feeds, reps).items():
                if layer in row["layers"]:
                    row["layers"][layer]["single_step_ms"] = ms  # x B: the chained single-token steps
        except Exception as e:
            _failed(row, "single step", e)
    try:
        ex.run(feeds, profile=True)
        row["op_times"] = ex.op_times
        log(f"{row['case']}: slowest ops (executor, ms): "
            + "; ".join(f"{k} {v:.3f}" for k, v in list(ex.op_times.items())[:10]))  # fmt: skip
    except Exception as e:
        _failed(row, "profile", e)
    return row


def _graph_stage(st, row: dict, feeds: dict, reps: int, end: float, compile_on: bool, mode: str):
    """The step as CUDA graphs per layer (median ms per layer) and the per-layer eager / torch.compile baselines."""
    from deepinfer.runtime.layer_graphs import LayerGraphs

    lg = LayerGraphs(st.dec.exec, feeds, st.backend_factory())
    lg.prepare()
    row["graphs_report"], row["fell_back"] = lg.report(), lg.fell_back()
    log(f"{row['case']}: {lg.report()}")
    graph_ms, row["graph_total_ms"] = bs.time_graph_layers(lg, reps)
    if st.profile:  # where the graph step's time goes: a CUDA graph per node (bench_slice.profile_step)
        try:
            row["profile"] = bs.profile_step(SimpleNamespace(comp=st.dec.exec, backend_factory=st.backend_factory),
                                             feeds, lg, reps)  # fmt: skip
            bs._print_profile(row)
        except Exception as e:  # a diagnostic: the step's figures stand without it
            _failed(row, "profile (graph per node)", e)
    return graph_ms, bs.layer_baselines(lg, st.eager, st.params, reps, compile_on, mode, end)


def _failed(row: dict, stage: str, e: Exception) -> dict:
    """Record a stage's failure in the row (the other stages' figures stand)."""
    row.setdefault("errors", {})[stage] = f"{type(e).__name__}: {str(e)[:300]}"
    log(f"{row['case']}: ERROR in {stage}: {row['errors'][stage]}")
    traceback.print_exc(limit=6)
    if stage == "setup":
        row["error"] = row["errors"][stage]
    return row


def single_step_ms(st, feeds: dict, reps: int) -> dict[str, float]:
    """Per layer: one sequence's single-token step (the one-sequence graph at T=1, its kernels, CUDA graphs per
    layer) on sequence 0's caches -- what the engine's decode runs B times per step without the batched graph."""
    from deepinfer.runtime.cuda_executor import GraphExecutor
    from deepinfer.runtime.layer_graphs import LayerGraphs

    if st.single is None:
        st.single = GraphExecutor(st.g, st.params, kernels=st.dec.exec.kernels, sync_free="always",
                                  max_positions=st.dec.max_len)  # fmt: skip
        st.single.prep_cache = st.dec.exec.prep_cache  # the same prepared weights
    names = [e["name"] for e in st.g.meta["caches"]]
    one = {"tokens": feeds["tokens"][:1], "positions": feeds["positions"][:1], **{k: feeds[k][0] for k in names}}
    if st.jobs and st.device == "cuda":  # the T=1 kernels in parallel too (a lazy build is ~30 s each)
        from deepinfer.runtime.kernel_adapters import prebuild

        keys = [k for k in st.single.kernel_keys(one) if k not in st.single.kernels.kernels]
        prebuild(keys, st.jobs, max(10.0, (st.end - time.time()) * 0.3), log)
    st.single.run(one)
    lg = LayerGraphs(st.single, one, st.backend_factory())
    lg.prepare()
    return bs.time_graph_layers(lg, reps)[0]


def reference_check(st, feeds: dict) -> dict:
    """The batched step against the one-sequence graph at these dims: the batched graph's references vs the
    one-sequence graph's references for sequences 0 and 1 (positions of both parities), and the compiled step
    vs the batched references (max |a - b| / max |b| of the logits rows). Both references run the same graph
    (batch_decode's rewrite of the slice) on the same cache storage: bf16 caches round their written rows in both.

    Where the GEMMs' rounding at M = B vs M = 1 (~1e-7) meets a rounding point -- an FP8 code (the attention's
    quantised output), a bf16 row (cache_storage's cast of the written KV rows) -- a value near a rounding
    boundary flips by one step, and that step (up to 2^-3 of the value) moves the logits by 1e-3..1e-2: a random
    draw's property, not a difference of the math. So the check also runs each one-sequence pass PINNED: every
    low-precision row that differs from the batched run's by one step of its dtype in a few elements
    (rounding_flips) takes the batched run's row, and so does a top-k choice whose differing members tie in the
    one-sequence run's own scores (topk_ties), and a row-wise node whose replay on the batched run's input rows
    (equal to its own to fp32 rounding) gives the batched run's output (_Replay: a flip inside the op, e.g. the
    activation codes of linear_fp8) or -- the same op in the batched graph -- differs from it by at most ROW_OP_REL
    (its own T = 1 vs T = B arithmetic crossing an internal rounding step: "T-dependent"); the rest must agree at
    fp32 rounding: what the rewrite changed (batched_* ops, the pools and their ids) is never pinned.
    ``batched_vs_single``: unpinned; ``pinned``: pinned (a real difference -- a wrong row read, another storage --
    stays here);
    ``flips``: per sequence, the rounding points and ties pinned (node, op, elements flipped / row size);
    ``first_divergence``: per sequence, the first node (graph order) whose row differs by more than DIVERGE_REL
    in the unpinned run, or whose choices (CHOICE_OPS: top-k members, experts) differ; ``left``: the same in the
    pinned run (what pinning did not explain)."""
    from deepinfer.runtime.cuda_executor import GraphExecutor

    stored = {v.name: v.dtype.torch_dtype for v in st.g.inputs if v.name in {e["name"] for e in st.g.meta["caches"]}}
    n = min(2, int(feeds["tokens"].shape[0]))
    batched = _row_values(st.eager, feeds, n)
    single = GraphExecutor(st.g, st.params, compiled=False)
    errs, pinned, first, flips, left = [], [], [], [], []
    for b in range(n):  # (the caches in the one-sequence graph's storage: the batched graph's, unless a test swaps it)
        one = {"tokens": feeds["tokens"][b : b + 1], "positions": feeds["positions"][b : b + 1],
               **{k: feeds[k][b].to(dtype) for k, dtype in stored.items()}}  # fmt: skip
        rows = _row_values(single, one, 1)
        errs.append(_rel(batched["logits"][b], rows["logits"][0]))
        first.append(_first_divergence(batched, b, rows))
        held = _row_values(single, one, 1, pin=(batched, b))
        pinned.append(_rel(batched["logits"][b], held["logits"][0]))
        flips.append(held["__flips__"])
        left.append(_first_divergence(batched, b, held))
        if left[-1] and (name := left[-1].split(" ")[0]) in held["__replayed__"]:
            e = held["__replayed__"][name]
            left[-1] += f"; on the batched rows it still differs: {e if isinstance(e, str) else f'{e:.2e}'}"
    compiled = st.dec.exec.run(feeds)[0]
    return {"batched_vs_single": max(errs), "pinned": max(pinned), "flips": flips, "left": left,
            "kernels_vs_eager": _rel(compiled, st.eager.run(feeds)[0]), "first_divergence": first}  # fmt: skip


def format_check(chk: dict) -> str:
    """The check's line: both comparisons, the pinned one, and per sequence its rounding flips."""
    flips = "; ".join(f"seq {b}: " + (", ".join(f"{name} ({op}) {k}/{size}" for name, op, k, size in fl) or "none")
                      for b, fl in enumerate(chk["flips"]))  # fmt: skip
    return (f"batched references vs one-sequence references {chk['batched_vs_single']:.2e} (first divergence "
            f"{chk['first_divergence']}), pinned at the rounding flips {chk['pinned']:.2e} (flips: {flips}; "
            f"first divergence left: {chk.get('left')}); "
            f"kernels vs references {chk['kernels_vs_eager']:.2e}")  # fmt: skip


DIVERGE_REL = 1e-4  # a node row this far from the one-sequence run's: more than fp32 rounding (a flipped choice)
FLIP_MAX_FRACTION = 0.01  # a rounding point's row differing in more of its elements is no flip (another rounding)
# low-precision dtypes -> (integer view, sign bit): codes ordered by value (sign-magnitude), one step = 1 apart
_CODES = {torch.float8_e4m3fn: (torch.uint8, 0x80), torch.float8_e5m2: (torch.uint8, 0x80),
          torch.bfloat16: (torch.int16, -0x8000), torch.float16: (torch.int16, -0x8000)}  # fmt: skip
if hasattr(torch, "float8_e8m0fnu"):
    _CODES[torch.float8_e8m0fnu] = (torch.uint8, 0)  # exponent codes, unsigned


def rounding_flips(got: torch.Tensor, want: torch.Tensor) -> int | None:
    """How many elements of a low-precision row differ from ``want`` (same dtype), when each differs by exactly one
    step of the dtype (adjacent codes) and they are at most FLIP_MAX_FRACTION of the row: a rounding flip; None
    when the row is not low precision or differs otherwise."""
    if got.dtype != want.dtype or got.shape != want.shape or got.dtype not in _CODES:
        return None
    ordered = [_ordered_codes(x) for x in (got, want)]
    diff = (ordered[0] - ordered[1]).abs()
    k = int((diff != 0).sum())
    if k and (int(diff.max()) != 1 or k > FLIP_MAX_FRACTION * got.numel()):
        return None
    return k


def _ordered_codes(x: torch.Tensor) -> torch.Tensor:
    """x's codes as integers in value order: magnitude bits, negated for a set sign bit (+0 and -0 both 0)."""
    view, sign = _CODES[x.dtype]
    codes = x.contiguous().view(view).to(torch.int32)
    if not sign:
        return codes
    mask = abs(sign)
    codes = codes & (2 * mask - 1)  # the integer view's bits (int16 views are signed)
    mag = codes & (mask - 1)
    return torch.where(codes & mask != 0, -mag, mag)


# discrete choices whose ids both graphs number alike (per sequence): compared as sets; op -> input of its scores
CHOICE_OPS = {"topk_entries": 0, "moe_gate_route": None}
TIE_REL = 1e-5  # top-k members whose scores differ by less than this (of the row's max): a tie that rounding breaks
REPLAY_INPUT_REL = 1e-5  # a replayed node's input rows this close to the pinned run's: fp32 rounding
ROW_OP_REL = 1e-2  # a row-wise op kept by the rewrite, at T = B vs T = 1 on the same rows: a rounding step, not more
ROW_FEEDS = ("tokens", "positions")  # the step's per-sequence feeds: row b of the batched run's, by construction


def topk_ties(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> int | None:
    """How many members of a top-k row (got, one run's choice on ``scores``) differ from ``want`` (the other run's),
    when every differing member -- in either choice -- scores within TIE_REL of the others in ``scores``: a tie
    the other run's rounding broke the other way. None when the choices differ otherwise."""
    extra = sorted(set(got.flatten().tolist()) ^ set(want.flatten().tolist()))
    if not extra:
        return 0
    if min(extra) < 0:  # a member against padding: a visibility difference, no tie
        return None
    s = scores.float().flatten()
    vals = s[torch.tensor(extra)]
    scale = float(s[torch.isfinite(s)].abs().max())
    return len(extra) // 2 if float(vals.max() - vals.min()) <= TIE_REL * scale else None


def _first_divergence(batched: dict, b: int, rows: dict) -> str | None:
    for name, op in batched["__order__"]:
        if name not in rows:
            continue
        a, w = batched[name][b], rows[name][0]
        if not a.is_floating_point():
            if (k := len(set(a.tolist()) ^ set(w.tolist()))) > 0:
                return f"{name} ({op}): {k // 2 or 1} of {a.numel()} choices differ"
        elif (e := _rel(a, w)) > DIVERGE_REL:
            return f"{name} ({op}): {e:.2e}"
    return None


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _row_values(ex, feeds: dict, n: int, pin: tuple | None = None) -> dict:
    """The first n rows of every row-valued float node output of one run of ex (name -> [n, ...], in its dtype),
    and the (name, op) order under "__order__" (and as a dict under "__ops__"). ``pin`` = (another run's rows, its
    row b), for a one-row run: an output that is that run's row b but for rounding flips, top-k ties or a flip
    inside a row-wise op (_pinned) takes that row; "__flips__" lists them (name, op, elements moved, row size),
    "__replayed__" the nodes whose replay on that run's rows still differs (how far)."""
    from deepinfer.ir.interpreter import bind_symbols

    env, t = bind_symbols(ex.graph, feeds), int(feeds["tokens"].shape[0])
    vals = {**feeds, **{p.name: ex.params[p.name] for p in ex.graph.params}}
    out: dict = {"__order__": [], "__flips__": [], "__replayed__": {}}
    final = {v.name for v in ex.graph.outputs}
    with ex.sync_free_scope(t):
        for step in ex.steps:
            args = [None if x is None else vals[x] for x in step.inputs]
            attrs = ex._attrs(step.node, env)
            outs = ex._run_node(step, args, attrs, t)
            if pin is not None:
                replay = _Replay(ex, step, args, attrs, t, pin, out["__replayed__"])
                outs = [o if name in final else _pinned(name, o, step.node.op, args, pin, out["__flips__"], replay)
                        for name, o in zip(step.outputs, outs)]  # fmt: skip (the graph's outputs: compared, not pinned)
            vals.update(zip(step.outputs, outs))
            choice = step.node.op in CHOICE_OPS
            for name, o in zip(step.outputs, outs):
                if (choice or o.is_floating_point()) and o.dim() and o.shape[0] == t:
                    out[name] = o[:n].clone()
                    out["__order__"].append((name, step.node.op))
            for name in step.free:
                vals.pop(name, None)
    out["__ops__"] = dict(out["__order__"])
    return out


def _pinned(name: str, o, op: str, args: list, pin: tuple, flips: list, replay: _Replay):
    """o, or -- a one-row output that is the pinned run's row but for rounding flips, a top-k choice but for
    ties, or a row-wise node's output that its replay on the pinned run's input rows reproduces (_Replay: a flip
    inside the op, e.g. linear_fp8's activation codes) -- that row."""
    rows, b = pin
    if not (isinstance(o, torch.Tensor) and name in rows and o.dim() and o.shape[0] == 1):
        return o
    want = rows[name][b : b + 1]
    k = None
    if o.is_floating_point():
        k = rounding_flips(o, want)
        if k is None and _rel(o, want) <= DIVERGE_REL:
            return o  # fp32 rounding: carried on
    elif CHOICE_OPS.get(op) is not None:
        k = topk_ties(o, want, args[CHOICE_OPS[op]])
    elif torch.equal(o, want):
        return o
    if k is None and replay.explains(name, want):
        off = (o.float() - want.float()).abs() > REPLAY_INPUT_REL * want.float().abs().max()
        k, op = int(off.sum()), f"{op}, replayed"  # the elements the op's own steps moved
    elif k is None and replay.t_dependent(name, op, want):
        off = (o.float() - want.float()).abs() > REPLAY_INPUT_REL * want.float().abs().max()
        k, op = int(off.sum()), f"{op}, T-dependent"
    if not k:
        return o
    flips.append((name, op, k, o.numel()))
    return want.clone()


class _Replay:
    """A node of the one-row run, replayed on the pinned run's rows: a row-wise node (its inputs rows of tracked
    values or parameters) whose actual input rows are the pinned run's to fp32 rounding (REPLAY_INPUT_REL) and whose
    replay reproduces the pinned run's output (low-precision or integer: exactly; f32: to REPLAY_INPUT_REL) differs
    by what its own discrete steps (activation FP8 codes, a top-k, a route) made of a rounding-level input
    difference. Run at most once per node, on demand."""

    def __init__(self, ex, step, args: list, attrs: dict, t: int, pin: tuple, unexplained: dict):
        self.ex, self.step, self.args, self.attrs, self.t, self.pin = ex, step, args, attrs, t, pin
        self.outs: dict | None = None
        self.unexplained = unexplained  # name -> how far the replay on the batched rows still is

    def explains(self, name: str, want) -> bool:
        if self.outs is None:
            self.outs = self._run() or {}
        got = self.outs.get(name)
        if got is None or got.shape != want.shape or got.dtype != want.dtype:
            return False
        ok = _rel(got, want) <= REPLAY_INPUT_REL if got.is_floating_point() and got.element_size() >= 4 \
            else torch.equal(got, want)  # fmt: skip
        if not ok:  # on the batched rows the op still differs: its own M = 1 vs M = B arithmetic, or a real bug
            self.unexplained[name] = _rel(got, want) if got.is_floating_point() else "choices differ"
        return ok

    def t_dependent(self, name: str, op: str, want) -> bool:
        """The replay ran (a row-wise node, inputs the batched run's to rounding) and differs from the batched
        output by at most ROW_OP_REL, the batched graph running the SAME op there at T = B: the op's own T = 1 vs
        T = B arithmetic crossing one of its internal rounding steps (grouped_out_proj's mid quantisation, the MoE
        reference's FP8 activations) -- a row-wise op the rewrite kept, not the rewrite. Mixing rows (a real bug
        of a row-wise op) moves a row by O(1), not by a rounding step."""
        got = (self.outs or {}).get(name)
        rows, _ = self.pin
        if got is None or rows.get("__ops__", {}).get(name) != op or not got.is_floating_point():
            return False
        if _rel(got, want) > ROW_OP_REL:
            return False
        self.unexplained.pop(name, None)
        return True

    def _run(self) -> dict | None:
        rows, b = self.pin
        args = []
        for x, actual in zip(self.step.inputs, self.args):
            if x is None or x in self.ex.params or x in ROW_FEEDS:  # the same in both runs
                args.append(actual)
                continue
            if x not in rows:
                return None  # a pool, an index or a graph input: not a row-wise node
            mine = rows[x][b : b + 1]
            if mine.shape != actual.shape or mine.dtype != actual.dtype:
                return None
            if not (_rel(actual, mine) <= REPLAY_INPUT_REL if mine.is_floating_point() else torch.equal(actual, mine)):
                return None  # its inputs already differ beyond rounding (or in a choice): nothing to explain here
            args.append(mine)
        outs = self.ex._run_node(self.step, args, self.attrs, self.t)
        return dict(zip(self.step.outputs, outs))


def _sync(st) -> None:
    if st.device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- report


def print_table(rows: list) -> None:
    head = (f"{'case':<28} {'layer':<6} {'graph ms':>9} {'% roof':>7} {'% w-only':>8} {'kv MB':>8} {'exec ms':>8} "
            f"{'eager ms':>9} {'compile ms':>10} {'vs eager':>8} {'vs comp':>8} {'B x 1-seq ms':>12} "
            f"{'vs B x 1':>8}")  # fmt: skip
    print(head)
    for r in rows:
        if "layers" not in r:
            print(f"{r['case']:<28} {r.get('error', r.get('skipped', ''))}")
            if "check" in r:
                print(f"{r['case']:<28} check: {format_check(r['check'])}")
            continue
        for layer, m in r["layers"].items():
            ours = m["graph_ms"] if m["graph_ms"] == m["graph_ms"] else m["exec_ms"]
            comp = m.get("compile_ms", float("nan"))
            chain = r["sequences"] * m.get("single_step_ms", float("nan"))
            print(f"{r['case']:<28} {layer:<6} {m['graph_ms']:>9.3f} {m['roofline_pct']:>6.1f}% "
                  f"{m['weights_only_pct']:>7.1f}% {m['kv_bytes'] / 1e6:>8.1f} {m['exec_ms']:>8.3f} "
                  f"{m['torch_eager_ms']:>9.3f} {comp:>10.3f} {m['torch_eager_ms'] / ours:>7.1f}x "
                  f"{comp / ours:>7.1f}x {chain:>12.3f} {chain / ours:>7.1f}x")  # fmt: skip
        print(f"{r['case']:<28} step   {r.get('graph_total_ms', float('nan')):>9.3f} ms in graphs, "
              f"{r['sequences'] / (r.get('graph_total_ms', float('nan')) * 1e-3):.0f} tok/s; executor "
              f"{r['exec_total_ms']:.3f} ms, eager {r['eager_total_ms']:.3f} ms")  # fmt: skip


def run(args) -> list[dict]:
    end = time.time() + args.budget_s
    layers = bs._ints(args.layers) or (TINY_LAYERS if args.preset != "real" else (2, 20))
    batches, context = bs._ints(args.batches), int(args.context)
    st = setup(layers, args.preset, args.budget_s, context + 1, donate=not args.no_donate, compact=not args.flat_pools)
    st.single_steps, st.jobs, st.end, st.profile = not args.no_single_steps, args.jobs, end, args.profile
    st.check_only = args.check_only
    compile_batches = set(bs._ints(args.compile_batches) or batches)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for b in batches:
        if end - time.time() < 25:
            rows.append({"case": f"batched decode {b} ctx {context}", "skipped": "time budget"})
            continue
        comp_on = not args.no_torch_compile and b in compile_batches
        rows.append(case(st, b, context, args.reps, args.jobs, end, comp_on, args.compile_mode))
        print_table(rows[-1:])
        (out / "bench_batched_decode.json").write_text(json.dumps(
            {"limits": vars(st.lim), "nominal_limits": st.nominal, "layers": list(layers), "preset": args.preset,
             "rows": rows}, indent=1, default=str))  # fmt: skip
        if st.device == "cuda":
            torch.cuda.empty_cache()
    print(st.dec.report(), flush=True)
    print("\nAll cases:")
    print_table(rows)
    return rows


def dry_run(args) -> int:
    """The slice, its batched graph and the kernel bindings its row-wise nodes keep, on the CPU."""
    from deepinfer.passes.batch_decode import batch_decode
    from deepinfer.passes.select_kernels import format_kernel_report

    layers = bs._ints(args.layers) or (TINY_LAYERS if args.preset != "real" else (2, 20))
    t0 = time.time()
    g = bs.slice_graph(layers=layers, experts="fp8", preset=args.preset)
    bg = batch_decode(g)
    log(f"slice {list(layers)}: {len(g.nodes)} nodes -> batched {len(bg.nodes)} nodes in {time.time() - t0:.1f} s")
    log(f"batched ops: { {k: v for k, v in bg.op_counts().items() if k.startswith('batched_')} }")
    print(format_kernel_report(bg))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="", help="real layer ids (default 2,20; tiny: 2,6)")
    ap.add_argument("--batches", default="16,64", help="sequences per step (comma list)")
    ap.add_argument("--context", default="4096", help="cached tokens of every sequence")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-torch-compile", action="store_true")
    ap.add_argument("--compile-batches", default="", help="batches that get the torch.compile baseline (default all)")
    ap.add_argument("--compile-mode", default="default", choices=("default", "max-autotune-no-cudagraphs"))
    ap.add_argument("--no-donate", action="store_true", help="functional cache writes (the whole pool copied)")
    ap.add_argument("--flat-pools", action="store_true", help="attention over the flat compressed pools (no gather)")
    ap.add_argument("--no-single-steps", action="store_true", help="skip the one-sequence T=1 step (B x 1-seq ms)")
    ap.add_argument("--profile", action="store_true", help="also a CUDA graph per node: each node's device time")
    ap.add_argument("--check-only", action="store_true", help="the first step and the reference check, no timings")
    ap.add_argument("--preset", choices=("real", "small", "tiny"), default="real",
                    help="tiny / small: the CPU smoke mode (small: bf16 caches)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--jobs", "-j", type=int, default=0, help="pre-build kernels in this many processes")
    ap.add_argument("--dry-run", action="store_true", help="build the batched slice graph on the CPU and exit")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_batched_decode_out")
    args = ap.parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    if args.preset == "real" and not torch.cuda.is_available():
        print("bench_batched_decode: error: needs a CUDA device (--preset tiny / small: the CPU smoke mode)",
              file=sys.stderr)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
