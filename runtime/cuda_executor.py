"""Run a plan's graph on a CUDA device: compiled kernels where the binding allows, torch references elsewhere.

    runner = CudaRunner(plan.graph, params)          # weights go to the GPU once
    logits, caches = runner.forward(tokens, positions, caches)
    print(runner.report())                           # which nodes ran compiled kernels, which ran references

Per node, in graph order: the binding select_kernels wrote (graph.meta["kernels"], the bucket nearest the
call's token count) names a family; when runtime/kernel_adapters.py has an adapter for that family and op, and
the adapter accepts the concrete shapes, its kernels are fetched from a cache keyed by (family, program, shapes,
config) -- compiled lazily, on first use -- and run. Anything else runs the op's torch reference on the GPU;
that is explicit and counted, with the reason. A kernel that fails to build, raises, or disagrees with the
reference on its first call (checked once per kernel set: a wrong kernel must not poison the results) is
disabled and its nodes fall back, also counted.

The graph is one sequence per call (as the interpreter). The engine's KV cache manager keeps its pools on the
runner's device, so ``forward`` copies nothing between host and device but the tokens, the positions and the
logits rows that are sampled. Decode steps (T=1) go through ``decode``: static slots replayed as CUDA graphs
per batch-size bucket, by default one batched step for all the bucket's sequences (runtime/batched_decode.py),
else a chain of one-sequence steps (runtime/cuda_graphs.py), eager where capture is off or failed (the report
says why).
T=1 steps run the sync-free references (GraphExecutor(sync_free=True)); the rope tables are sized by
max_model_len instead of the positions' maximum. Batched paged kernels replace the per-sequence graph later
without changing the seam (runtime/executor.py's ModelRunner).

``device="cpu"`` runs the same dispatch with references only (the adapters decline CPU tensors), which is
how the accounting is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from deepinfer.errors import DeepInferError, IRError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import Graph, Node
from deepinfer.ir.interpreter import bind_symbols, concrete_attrs
from deepinfer.ir.registry import get_op
from deepinfer.ir.shapes import evaluate
from deepinfer.passes.select_logit_rows import (
    ROWS_INPUT,
    ROWS_SYMBOL,
    has_logit_rows,
    row_indices,
    rows_feed,
    rows_graph,
)
from deepinfer.runtime import cuda_graphs as cg
from deepinfer.runtime import kernel_adapters as ka

# First-call check (catches wrong layouts and wrong operands, not ulps): max |kernel - reference| / max |reference|
# at most VERIFY_TOL, and the norm-wise error ||kernel - reference|| / ||reference|| at most VERIFY_L2. FP8 outputs
# (codes + scales, compared dequantised) may differ by one e4m3 step wherever the kernel's bf16-rounded input
# sits on a rounding boundary the f32 reference does not (up to 1/8 of the value: 0.07-0.11 of the max measured
# on random 64 x 5120 rows), so their max-error bound is VERIFY_TOL_FP8; a wrong layout is O(1) in both norms.
# The norm-wise bound leaves room for the grouped MoE, which rounds two activations to e4m3 (x and the SwiGLU
# output; ~3.6% rms relative each, so ~5% together: 5.6% measured on the tiny V4.1 plan's experts, D=64).
VERIFY_TOL = 0.1
VERIFY_TOL_FP8 = 0.25
VERIFY_L2 = 0.08

# CudaRunner's decode path when batched_decode is not given: unset or 1 -- one batched step for every decoding
# sequence (runtime/batched_decode.py, the default); 0 -- a chain of one-sequence steps (cuda_graphs.DecodeGraphs)
BATCHED_DECODE_ENV = "DEEPINFER_BATCHED_DECODE"


class CudaUnavailableError(DeepInferError):
    """A GPU plan was opened where there is no CUDA device."""


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise CudaUnavailableError(f"{what} needs a CUDA device (an H200 for sm90); this machine has none")


class KernelCache:
    """Compiled kernels by KernelKey; a key that failed once stays failed (its reason is kept)."""

    def __init__(self, builder: Callable = ka.build_kernel, budget_s: float | None = None):
        self.builder, self.budget_s = builder, budget_s
        self.kernels: dict = {}
        self.failed: dict = {}
        self.build_s: dict = {}

    def get(self, key):
        if key in self.kernels:
            return self.kernels[key]
        if key in self.failed:
            raise ka.Decline(self.failed[key])
        if self.budget_s is not None and sum(self.build_s.values()) > self.budget_s:
            raise ka.Decline(f"compile budget of {self.budget_s:.0f} s spent")
        t0 = time.perf_counter()
        try:
            self.kernels[key] = self.builder(key)
        except Exception as e:  # a kernel that cannot build falls back to the reference, with the reason
            self.failed[key] = f"build failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            raise ka.Decline(self.failed[key]) from None
        finally:
            self.build_s[key] = time.perf_counter() - t0
        return self.kernels[key]

    def disable(self, keys, reason: str) -> None:
        for k in keys:
            self.kernels.pop(k, None)
            self.failed[k] = reason


@dataclass
class Step:
    """One node, resolved once per graph: what to read, what to write, what to free after it."""

    node: Node
    layer: str
    inputs: list
    outputs: list
    free: list
    param_inputs: list
    rows: bool = False  # runs on the logit_rows-selected rows (the head after select_logit_rows)


def layer_of(node: Node) -> str:
    """The builder's scope ("l3.120" -> "l3"); nodes outside every layer are "embed" / "head"."""
    head = node.outputs[0].name.split(".", 1)[0]
    return head if head[:1] == "l" and head[1:].isdigit() else ""


def plan_steps(g: Graph) -> list[Step]:
    last: dict[str, int] = {}
    for i, n in enumerate(g.nodes):
        for v in n.inputs:
            if v is not None:
                last[v.name] = i
    keep = {v.name for v in g.outputs}
    selected = {ROWS_INPUT}  # values with one row per selected logit row
    steps, seen_layer = [], False
    for i, n in enumerate(g.nodes):
        layer = layer_of(n)
        seen_layer |= bool(layer)
        frees = [v.name for v in n.inputs if v is not None and v.kind == "node" and last.get(v.name) == i
                 and v.name not in keep]  # fmt: skip
        rows = any(v is not None and v.name in selected for v in n.inputs)
        if rows:
            selected.update(v.name for v in n.outputs)
        params = [v is not None and v.kind == "param" for v in n.inputs]
        steps.append(Step(n, layer or ("head" if seen_layer else "embed"),
                          [None if v is None else v.name for v in n.inputs], [v.name for v in n.outputs],
                          sorted(set(frees)), params, rows))  # fmt: skip
    return steps


@dataclass
class Stats:
    """Node executions by how they ran, and why the references ran."""

    compiled: Counter = field(default_factory=Counter)  # family -> node executions
    reference: Counter = field(default_factory=Counter)  # reason -> node executions
    per_node: dict = field(default_factory=dict)  # node name -> "compiled <family>" | "reference: <reason>"
    verified: dict = field(default_factory=dict)  # kernel set -> relative error at its first call

    def total(self) -> tuple[int, int]:
        return sum(self.compiled.values()), sum(self.reference.values())


class GraphExecutor:
    """Node-by-node execution with per-node dispatch; ``compiled=False`` runs every node's reference (the
    torch eager baseline of the same graph).

    ``sync_free``: single-token steps (T=1) run the references that read device values on the host through
    their sync-free equivalents (same numbers; runtime/cuda_graphs.py), so a decode step can be captured;
    "always": every call does (the multi-token decode steps that runtime/layer_graphs.py captures).
    ``max_positions``: every position stays below it (rope tables are sized by it, not by a host read)."""

    def __init__(self, g: Graph, params: Mapping[str, torch.Tensor], *, compiled: bool = True,
                 kernels: KernelCache | None = None, verify: bool = True, sync_free: bool | str = False,
                 max_positions: int | None = None):  # fmt: skip
        self.graph, self.params = g, params
        self.compiled, self.verify, self.sync_free = compiled, verify, sync_free
        self._sync_free_now = False
        self.kernels = kernels or KernelCache()
        self.steps = plan_steps(g)
        self.has_rows = has_logit_rows(g)
        meta = g.meta.get("kernels") or {}
        self.bindings = meta.get("nodes", {})
        self.buckets = sorted(((b.get("T", 0), name) for name, b in meta.get("buckets", {}).items()))
        self.stats = Stats()
        self.prep_cache: dict = {}
        if max_positions:
            self.prep_cache[ka.MAX_POSITIONS] = int(max_positions)
        # the MoE activation groups the plan was compiled for (convert_fp4_to_fp8's record; none: the weight block)
        self.prep_cache.update(ka.moe_act_cache_entries(g.meta))
        self.layer_times: dict[str, float] | None = None  # filled by run(timed=True), milliseconds
        self.op_times: dict[str, float] | None = None  # filled by run(profile=True), milliseconds
        self._attrs_cache: dict = {}

    # -- binding ---------------------------------------------------------------------------------------
    def _bucket(self, t: int) -> str | None:
        for bt, name in self.buckets:
            if t <= bt:
                return name
        return self.buckets[-1][1] if self.buckets else None

    def binding(self, node: Node, t: int) -> dict:
        rec = self.bindings.get(node.outputs[0].name)
        bucket = self._bucket(t)
        if rec is None and node.op == "index_select" and node.inputs[1].name == ROWS_INPUT:
            return {"family": "torch_ref", "reason": "logit_rows gather (added by the runtime, no kernel)"}
        if rec is None or bucket is None:
            return {"family": "torch_ref", "reason": "no binding (plan compiled without select_kernels)"}
        return rec["buckets"].get(bucket) or next(iter(rec["buckets"].values()))

    # -- running ---------------------------------------------------------------------------------------
    def run(self, inputs: Mapping[str, torch.Tensor], *, timed: bool = False,
            profile: bool = False) -> list[torch.Tensor]:  # fmt: skip
        """timed: per-layer times in ``layer_times``; profile: per-op times in ``op_times`` (both ms, events
        around every layer / node: the device time of each node including its launch gaps)."""
        t = int(inputs["tokens"].shape[0]) if "tokens" in inputs else 1
        inputs = self.with_default_rows(inputs)
        with self.sync_free_scope(t):
            return self._run(inputs, t, timed, profile)

    def with_default_rows(self, inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """A graph with logit_rows run without them computes every row, as before (callers that feed the plan's
        inputs by name: benchmarks, teacher-forced checks)."""
        if ROWS_INPUT in inputs or not self.has_rows or "tokens" not in inputs:
            return inputs
        tokens = inputs["tokens"]
        return {**inputs, ROWS_INPUT: row_indices(self.graph, int(tokens.shape[0])).to(tokens.device)}

    @contextlib.contextmanager
    def sync_free_scope(self, t: int):
        """The sync-free references for this call: at T=1 when ``sync_free`` is True, at every T when it is
        "always" (the per-layer graphs of runtime/layer_graphs.py capture multi-token decode steps too)."""
        if not (self.sync_free == "always" or (self.sync_free and t == 1)):
            yield
            return
        with cg.sync_free_references():
            saved, self._sync_free_now = self._sync_free_now, True
            try:
                yield
            finally:
                self._sync_free_now = saved

    def run_steps(self, steps: list[Step], vals: dict, env: dict, t: int, marks: list | None = None,
                  nodes: list | None = None) -> None:  # fmt: skip
        """Run ``steps`` in order on ``vals`` (value name -> tensor, updated in place), dropping each value after
        its last use; ``env`` binds the graph's symbols (bind_symbols), ``t`` is the call's token count.

        The head's steps after select_logit_rows run on L selected rows: their kernels are the bindings of L's
        bucket (a prefill's last row takes the decode head), and with L = 0 they launch nothing (empty outputs)."""
        n_rows = env.get(ROWS_SYMBOL)
        for step in steps:
            if marks is not None and (not marks or marks[-1][0] != step.layer):
                marks.append((step.layer, mark()))
            if nodes is not None:
                nodes.append((step, mark()))
            args = [None if n is None else vals[n] for n in step.inputs]
            if step.rows and n_rows == 0:
                outs = _empty_outputs(step.node, env, args)
            else:
                outs = self._run_node(step, args, self._attrs(step.node, env), n_rows if step.rows else t)
            if len(outs) != len(step.outputs):
                raise IRError(f"node {step.node.label}: produced {len(outs)} outputs, expected {len(step.outputs)}")
            vals.update(zip(step.outputs, outs))
            for name in step.free:
                vals.pop(name, None)

    def _run(self, inputs: Mapping[str, torch.Tensor], t: int, timed: bool, profile: bool) -> list[torch.Tensor]:
        env = bind_symbols(self.graph, inputs)  # shapes only
        vals: dict = dict(inputs)
        vals.update({p.name: self.params[p.name] for p in self.graph.params})
        marks = [] if timed else None
        nodes = [] if profile else None
        self.run_steps(self.steps, vals, env, t, marks, nodes)
        if marks is not None:
            self.layer_times = _layer_times(marks)
        if nodes is not None:
            self.op_times = self._op_times(nodes)
        return [vals[v.name] for v in self.graph.outputs]

    def _op_times(self, nodes: list) -> dict[str, float]:
        """ms per "op (compiled family | reference)" from the events before every node, slowest first."""
        end = mark()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out: dict[str, float] = defaultdict(float)
        for (step, a), (_, b) in zip(nodes, nodes[1:] + [(None, end)]):
            how = self.stats.per_node.get(step.outputs[0], "?")
            key = f"{step.node.op} ({how.split(':')[0] if how.startswith('reference') else how})"
            out[key] += elapsed_ms(a, b)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def _attrs(self, node: Node, env: dict) -> dict:
        key = (id(node), tuple(sorted(env.items())))
        if key not in self._attrs_cache:
            self._attrs_cache[key] = concrete_attrs(node, env)
        return self._attrs_cache[key]

    def _run_node(self, step: Step, args: list, attrs: dict, t: int) -> list:
        node, name = step.node, step.outputs[0]
        b = self.binding(node, t)
        family = b.get("family", "torch_ref")
        adapter = ka.adapter_for(family, node.op) if self.compiled else None
        if adapter is None:
            why = "baseline: references only" if not self.compiled else b.get("reason") or f"{family}: no adapter"
            return self._reference(node, args, attrs, name, why)
        call = ka.Call(node.op, attrs, args, step.inputs, step.param_inputs, b.get("config") or {}, self.prep_cache)
        keys: list = []
        try:
            keys = adapter.keys(call)
            kernels = [self.kernels.get(k) for k in keys]
            # adapters without a TileLang kernel (Triton launches: keys []) are checked, and disabled after a
            # mismatch, as one pseudo kernel per family and op
            vkey = tuple(keys) or (ka.KernelKey(family, "no_tilelang_kernel", (node.op,), ()),)
            if not keys and vkey[0] in self.kernels.failed:
                raise ka.Decline(self.kernels.failed[vkey[0]])
            outs = adapter.run(call, kernels)
            if self.verify and vkey not in self.stats.verified:
                view = getattr(adapter, "check_view", None)  # what the readers see (index scores bound fill False)
                self._check(node, args, attrs, view(call, outs) if view else outs, vkey)
        except ka.Decline as e:
            return self._reference(node, args, attrs, name, f"{family}: {e}")
        except Exception as e:  # a kernel that raises is disabled; the node's reference runs instead
            self.kernels.disable(keys or [ka.KernelKey(family, "no_tilelang_kernel", (node.op,), ())],
                                 f"raised {type(e).__name__}")  # fmt: skip
            return self._reference(node, args, attrs, name, f"{family}: {type(e).__name__}: {str(e)[:120]}")
        self.stats.compiled[family] += 1
        self.stats.per_node[name] = f"compiled {family}"
        return outs

    def _check(self, node: Node, args, attrs, outs, keys) -> None:
        ref = get_op(node.op).run(args, attrs)
        pairs = list(zip(_as_float(outs), _as_float(ref)))
        err = max((_rel_err(a, b) for a, b in pairs), default=0.0)
        l2 = max((_rel_l2(a, b) for a, b in pairs), default=0.0)
        self.stats.verified[tuple(keys)] = err
        tol = VERIFY_TOL_FP8 if _is_fp8(outs) else VERIFY_TOL
        ids_differ = _integers_differ(outs, ref)  # expert ids: any difference is a wrong selection
        if ids_differ or not (err <= tol and l2 <= VERIFY_L2):  # NaN counts as a mismatch
            why = f"mismatch vs reference at first call (rel err {err:.2e}, norm-wise {l2:.2e}{ids_differ})"
            self.kernels.disable(keys, why)
            raise ka.Decline(why)

    def _reference(self, node: Node, args, attrs, name: str, reason: str) -> list:
        self.stats.reference[reason] += 1
        self.stats.per_node[name] = f"reference: {reason}"
        try:
            if self._sync_free_now and node.op in cg.SYNC_FREE_OPS:
                out = cg.SYNC_FREE_OPS[node.op](*args, **attrs)
                return list(out) if isinstance(out, tuple | list) else [out]
            return get_op(node.op).run(args, attrs)
        except (RuntimeError, ValueError, IndexError) as e:
            raise IRError(f"node {node.label} failed: {e}") from e

    # -- report ----------------------------------------------------------------------------------------
    def report(self) -> str:
        c, r = self.stats.total()
        lines = [f"node executions: {c} compiled, {r} torch reference"]
        lines += [f"  compiled  {fam:<20} {n:>6}" for fam, n in self.stats.compiled.most_common()]
        lines += [f"  reference {n:>6}  {why}" for why, n in self.stats.reference.most_common()]
        built = len(self.kernels.kernels)
        lines.append(f"kernels: {built} built ({sum(self.kernels.build_s.values()):.1f} s), "
                     f"{len(self.kernels.failed)} disabled")  # fmt: skip
        lines += [f"  disabled {k.describe()}: {why}" for k, why in self.kernels.failed.items()]
        if self.stats.verified:
            worst = max(self.stats.verified.values())
            lines.append(f"first-call checks: {len(self.stats.verified)} kernel sets, worst rel err {worst:.2e}")
            by_family: dict = defaultdict(list)
            for keys, err in self.stats.verified.items():
                by_family[keys[0].family if keys else "-"].append(err)
            lines += [f"  {fam:<20} {len(errs):>3} sets, worst rel err {max(errs):.2e}"
                      for fam, errs in sorted(by_family.items())]  # fmt: skip
        return "\n".join(lines)

    def kernel_keys(self, inputs: Mapping[str, torch.Tensor]) -> list:
        """The kernels a call with these inputs would use (runs the graph with references to get the shapes)."""
        found: list = []
        saved, self.compiled = self.compiled, False
        try:
            inputs = self.with_default_rows(inputs)
            env = bind_symbols(self.graph, inputs)
            t = int(inputs["tokens"].shape[0])
            vals: dict = dict(inputs)
            vals.update({p.name: self.params[p.name] for p in self.graph.params})
            for step in self.steps:
                args = [None if n is None else vals[n] for n in step.inputs]
                attrs = self._attrs(step.node, env)
                b = self.binding(step.node, env[ROWS_SYMBOL] if step.rows else t)
                empty = step.rows and env[ROWS_SYMBOL] == 0  # run_steps launches nothing there
                adapter = ka.adapter_for(b.get("family", ""), step.node.op) if saved and not empty else None
                if adapter is not None:
                    call = ka.Call(step.node.op, attrs, args, step.inputs, step.param_inputs, b.get("config") or {},
                                   self.prep_cache)  # fmt: skip
                    try:
                        found += [k for k in adapter.keys(call) if k not in found]
                    except ka.Decline:
                        pass
                vals.update(zip(step.outputs, get_op(step.node.op).run(args, attrs)))
                for name in step.free:
                    vals.pop(name, None)
        finally:
            self.compiled = saved
        return found


def mark():
    """A point in time for elapsed_ms: a CUDA event recorded on the current stream where there is a GPU, the
    host clock elsewhere (the CPU tests)."""
    if torch.cuda.is_available():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


def elapsed_ms(a, b) -> float:
    """Milliseconds from mark a to mark b (CUDA events must have completed: synchronise first)."""
    return (b - a) * 1e3 if isinstance(a, float) else a.elapsed_time(b)


def _layer_times(marks: list) -> dict[str, float]:
    marks = marks + [("end", mark())]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for (layer, a), (_, b) in zip(marks, marks[1:]):
        out[layer] += elapsed_ms(a, b)
    return dict(out)


def _empty_outputs(node: Node, env: dict, args: list) -> list[torch.Tensor]:
    """A node's outputs over zero rows, from their types: nothing to launch."""
    dev = next(a.device for a in args if isinstance(a, torch.Tensor))
    return [torch.empty([evaluate(d, env) for d in v.shape], dtype=dt.dtype(v.dtype).torch_dtype, device=dev)
            for v in node.outputs]  # fmt: skip


def _as_float(outs) -> list[torch.Tensor]:
    """Outputs as floats to compare: an (fp8 codes, e8m0 scales) pair is dequantised first."""
    outs = list(outs)
    if len(outs) == 2 and outs[1].dtype == torch.float8_e8m0fnu and outs[0].dtype == torch.float8_e4m3fn:
        from deepinfer.ir.ops.quant import dequant_fp8_groups

        q, s = outs
        return [dequant_fp8_groups(q, s, q.shape[-1] // s.shape[-1])]
    return [o.float() for o in outs if o.is_floating_point()]


def _integers_differ(outs, ref) -> str:
    for a, b in zip(outs, ref):
        if not a.is_floating_point() and (a.shape != b.shape or not torch.equal(a.long(), b.long())):
            return ", integer outputs differ"
    return ""


def _is_fp8(outs) -> bool:
    return any(o.dtype == torch.float8_e4m3fn for o in outs)


def _same_inf_zeroed(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries where kernel and reference hold the same infinity (masked scores: -inf) leave the comparison; a NaN
    or an infinity on one side only still counts (as a mismatch)."""
    same = torch.isinf(b) & (a == b)
    return (a.masked_fill(same, 0.0), b.masked_fill(same, 0.0)) if bool(same.any()) else (a, b)


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    a, b = _same_inf_zeroed(a, b)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if b.numel() else 0.0


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    a, b = _same_inf_zeroed(a, b)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


# ---------------------------------------------------------------------------------------------------
# The engine's ModelRunner for sm90 plans
# ---------------------------------------------------------------------------------------------------


def to_device(params: Mapping[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in params.items()}


def restack_experts(g: Graph, params: dict[str, torch.Tensor]) -> int:
    """Lay each MoE layer's FP8 (or packed FP4) experts out as the grouped kernels read them ([E, 2I, D] w1|w3,
    [E, D, I] w2; FP4 rows are packed bytes) and rebind the per-expert parameters to views of the stacks: one
    copy per layer, no doubled memory. Returns the number of layers restacked."""
    done = 0
    for n in g.nodes:
        if n.op != "moe_grouped_experts" or n.attrs.get("fmt") not in ("fp8", "fp4"):
            continue
        names = [v.name for v in n.inputs[9:]]
        e = n.attrs["n_experts"]
        w1 = [params[names[6 * i]] for i in range(e)]
        w2 = [params[names[6 * i + 2]] for i in range(e)]
        w3 = [params[names[6 * i + 4]] for i in range(e)]
        if ka._stacked_view(w1, w3) is None:
            b13 = torch.stack([torch.cat([a, b]) for a, b in zip(w1, w3)])
            inter = w1[0].shape[0]
            for i in range(e):
                params[names[6 * i]], params[names[6 * i + 4]] = b13[i, :inter], b13[i, inter:]
        if ka._stacked_view(w2, None) is None:
            b2 = torch.stack(w2)
            for i in range(e):
                params[names[6 * i + 2]] = b2[i]
        done += 1
    return done


def batched_decode_from_env() -> bool:
    """BATCHED_DECODE_ENV: unset or "1" batches decode (the default), "0" chains one-sequence steps."""
    value = os.environ.get(BATCHED_DECODE_ENV, "1").strip()
    if value not in ("0", "1", ""):
        raise DeepInferError(f"{BATCHED_DECODE_ENV}={value!r}: expected 0 (one-sequence steps) or 1 (batched)")
    return value != "0"


class CudaRunner:
    """ModelRunner for ``sm90`` plans (runtime/executor.py's seam).

    ``max_model_len`` (the engine passes it): every sequence's dense caches are sized by it (prefill and decode
    alike, so a decode step has one shape and graphs on / off compute the same numbers), the rope tables too,
    and ``decode`` is available (static slots, CUDA graphs per bucket when ``cuda_graphs``).

    ``batched_decode`` (None: BATCHED_DECODE_ENV, on unless 0): ``decode`` runs the decoding sequences as ONE
    batched step (runtime/batched_decode.py: every weight read once per step, whatever the batch); False chains
    one-sequence steps (cuda_graphs.DecodeGraphs). The batched step's logits equal the one-sequence steps' to
    GEMM rounding at B > 1 (the GEMMs run at M = B), bit for bit at B = 1; see docs/batched-decode.md."""

    def __init__(self, g: Graph, params: Mapping[str, torch.Tensor], device: str = "cuda", *,
                 kernels: KernelCache | None = None, verify: bool = True, max_model_len: int | None = None,
                 cuda_graphs: bool = True, buckets=cg.BUCKETS, graph_backend=None,
                 batched_decode: bool | None = None):  # fmt: skip
        if str(device).startswith("cuda"):
            require_cuda("running an sm90 plan")
        self.device = torch.device(device)
        dev_params = to_device(params, self.device)
        restack_experts(g, dev_params)
        # the plan's graph with a logit_rows input (the head computes only the rows asked for); the batched decode
        # step below keeps the plan's graph (every sequence's row is sampled)
        self.graph, self.logit_rows_off = rows_graph(g)
        self.exec = GraphExecutor(self.graph, dev_params, kernels=kernels, verify=verify, sync_free=True,
                                  max_positions=max_model_len)  # fmt: skip
        self.cache_names = [e["name"] for e in g.meta.get("caches", [])]
        self.cache_len = max_model_len  # the executor sizes every dense cache by it
        self.graphs = None
        self.batched_off: str | None = None  # why decode chains one-sequence steps (None: it batches)
        if max_model_len:
            kw = {"enabled": cuda_graphs, "buckets": buckets, "backend": graph_backend}
            self.graphs = self._batched_graphs(g, dev_params, max_model_len, batched_decode, kw)
            if self.graphs is None:
                self.graphs = cg.DecodeGraphs(self.exec, self.graph, max_model_len, self.device, **kw)

    def _batched_graphs(self, g: Graph, dev_params, max_model_len: int, asked: bool | None, kw: dict):
        """The default decode path: one batched step per bucket (runtime/batched_decode.py), or None with
        ``batched_off`` saying why not. Asked for explicitly (batched_decode=True), a graph that batch_decode
        cannot rewrite raises; by default that graph falls back to the one-sequence steps."""
        from deepinfer.runtime.batched_decode import BatchedDecodeGraphs

        if asked is None:
            asked, explicit = batched_decode_from_env(), False
        else:
            explicit = True
        if not asked:
            self.batched_off = "off (batched_decode=False)" if explicit else f"off ({BATCHED_DECODE_ENV}=0)"
            return None
        try:
            return BatchedDecodeGraphs(self.exec, g, dev_params, max_model_len, self.device, **kw)
        except IRError as e:
            if explicit:
                raise
            self.batched_off = f"off (batch_decode cannot rewrite this graph: {cg._one_line(e)})"
            return None

    def use_kernels(self, kernels: KernelCache) -> None:
        """Run on ``kernels`` (one cache for several runners of one plan: each kernel built once), the batched
        decode step's executor too."""
        self.exec.kernels = kernels
        dec = getattr(self.graphs, "dec", None)  # BatchedDecodeGraphs' BatchedDecoder
        if dec is not None:
            dec.exec.kernels = kernels

    @property
    def selects_logit_rows(self) -> bool:
        """forward takes ``logit_rows`` (runtime/executor.py asks for the sampled row only)."""
        return self.logit_rows_off is None

    @property
    def decode_batch_max(self) -> int:
        """The most single-token steps one ``decode`` call takes (0: no decode path, use ``forward``)."""
        return self.graphs.max_bucket if self.graphs is not None else 0

    def forward_device(self, tokens, positions, caches, logit_rows=None):
        """(logits on the device, new caches on the device); caches already there are not copied. logit_rows:
        the rows of the [T', vocab] logits to compute (negative from the end; default all)."""
        dev = self.device
        feeds = {"tokens": tokens.to(dev), "positions": positions.to(dev)}
        feeds.update({k: v.to(dev) for k, v in caches.items()})
        feeds.update({k: v.to(dev) for k, v in rows_feed(self.graph, len(tokens), logit_rows,
                                                          self.logit_rows_off).items()})  # fmt: skip
        outs = self.exec.run(feeds)
        new = {n: t.to(caches[n].device) for n, t in zip(self.cache_names, outs[1 : 1 + len(self.cache_names)])}
        return outs[0], new

    def forward(self, tokens, positions, caches, logit_rows=None):
        logits, new = self.forward_device(tokens, positions, caches, logit_rows)
        return logits.float().cpu(), new

    def decode(self, tokens: list[int], positions: list[int], fill):
        """One token for each of len(tokens) sequences: one batched step (BatchedDecodeGraphs.run) or a chain
        of single-token steps (cuda_graphs.DecodeGraphs.run)."""
        return self.graphs.run(tokens, positions, fill)

    def warm_up(self, log: Callable[[str], None] = print) -> str | None:
        """Capture every decode bucket's CUDA graph now, on padding rows (the engine's start: no request then waits
        mid-serving for a bucket's kernel loads, JIT compiles and capture); logs and returns the one-line summary,
        or None where decode graphs are off (nothing to capture)."""
        if self.graphs is None or self.graphs.backend is None:
            return None
        line = self.graphs.warm_up()
        log(line)
        return line

    def report(self) -> str:
        text = self.exec.report()
        if self.logit_rows_off:
            text += f"\nlogits of every row (no row selection: {self.logit_rows_off})"
        if self.batched_off:
            text += f"\nbatched decode: {self.batched_off}; decode chains one-sequence steps"
        return text + ("\n" + self.graphs.report() if self.graphs is not None else "")
