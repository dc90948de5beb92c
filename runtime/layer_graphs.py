"""One decode step of a GraphExecutor as CUDA graphs, ONE GRAPH PER LAYER (plus the pre-layer part and the head).

    lg = LayerGraphs(executor, feeds, backend)    # feeds: the static input buffers (tokens, positions, caches)
    lg.prepare()                                  # warm-up, host-read check, capture, replay check
    outs = lg.run(timed=True)                     # replay; lg.segment_ms: CUDA-event time of every segment
    print(lg.report())                            # which segments replay a graph, which run eagerly and why

Segments are the executor's steps grouped by layer in graph order (cuda_executor.plan_steps names them "embed",
"l0", "l1", ..., "head"; a layer whose nodes come back after another layer's is a second segment of the same
name, its time added to the first). A segment's inputs are the values it reads that an earlier segment (or the
feeds) produced; its outputs are the values it produces that a later segment reads or the graph returns.

prepare():
  1. warm-up: every segment runs eagerly once (kernel builds, first-call kernel checks, weight re-layouts, rope
     tables, the fused SwiGLU's interleaved copy -- everything that reads values or allocates long-lived tensors
     happens here); its outputs are the reference the replays are checked against;
  2. host-read check: every segment runs once more under HostSyncGuard in record mode, which NAMES each host read
     (op and source line) and makes the constant host -> device copies once (the memo served under capture); a
     segment with host reads is not captured -- it runs eagerly, the reads are its reason;
  3. capture, in graph order: a segment's static inputs are the feeds and the captured outputs of the segments
     before it, so replaying the graphs in order is one decode step. A capture that raises, or during which
     the executor disabled a kernel (its check or a host read failed inside an adapter), leaves that segment
     eager, with the reason;
  4. replay check: the segments replay in order and each one's outputs must reproduce the warm-up's (floats
     within REPLAY_TOL of the largest value, FP8 codes / scales / integers byte-equal but for a 1e-3 share of
     flips, e.g. an atomic's order), else that segment runs eagerly (with the error) from then on.

An eager segment runs its steps on the static inputs and copies its results into static output buffers, so the
graphs after it read the same addresses. Nothing falls back silently: report() lists every eager segment.
The backend is cuda_graphs.CudaGraphBackend on a GPU or cuda_graphs.EmulatedGraphBackend on CPU (tests: the
"capture" runs under a strict HostSyncGuard, the "replay" reruns the steps).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from deepinfer.ir.interpreter import bind_symbols
from deepinfer.runtime import cuda_graphs as cg
from deepinfer.runtime.cuda_executor import elapsed_ms, mark

REPLAY_TOL = cg.REPLAY_TOL  # floats: max |replay - warm-up| <= REPLAY_TOL * max(|warm-up|, 1), as DecodeGraphs
FLIP_SHARE = 1e-3  # FP8 / e8m0 / integer outputs: at most this share of bytes may differ


@dataclass
class Segment:
    """Consecutive steps of one layer (or of the pre-layer part / the head)."""

    name: str
    steps: list
    inputs: list[str]  # non-parameter values read here and produced before (or fed)
    outputs: list[str]  # values produced here and read later (or returned)
    params: list[str] = field(default_factory=list)  # parameters read here


def split_segments(steps: list, graph, per_node: bool = False) -> list[Segment]:
    """The executor's steps as segments (see the module doc); ``per_node``: one segment per node, named by its
    layer (the profile mode: a graph per node, events between them, no host gaps)."""
    runs: list[tuple[str, list]] = []
    for st in steps:
        if per_node or not runs or runs[-1][0] != st.layer:
            runs.append((st.layer, []))
        runs[-1][1].append(st)
    returned = {v.name for v in graph.outputs}
    read_after: list[set] = [set() for _ in runs]
    later: set = set(returned)
    for i in range(len(runs) - 1, -1, -1):
        read_after[i] = set(later)
        for st in runs[i][1]:
            later |= {n for n in st.inputs if n is not None}
    segs = []
    for (name, sts), after in zip(runs, read_after):
        made: list[str] = []
        inputs: list[str] = []
        params: list[str] = []
        for st in sts:
            for n, is_param in zip(st.inputs, st.param_inputs):
                if n is None or n in made:
                    continue
                bucket = params if is_param else inputs
                if n not in bucket:
                    bucket.append(n)
            made += st.outputs
        segs.append(Segment(name, sts, inputs, [n for n in made if n in after], params))
    return segs


def compare_outputs(got: dict, ref: dict) -> tuple[bool, str]:
    """(equal within the replay bounds, the worst difference in words) over the outputs of one segment."""
    worst = ""
    for name, r in ref.items():
        g = got[name]
        if g.shape != r.shape or g.dtype != r.dtype:
            return False, f"{name}: shape/dtype {tuple(g.shape)}/{g.dtype} vs {tuple(r.shape)}/{r.dtype}"
        if not r.numel():
            continue
        if r.is_floating_point() and r.element_size() > 1:
            err, scale = float_diff(g, r)
            if not err <= REPLAY_TOL * scale:  # NaN fails too
                return False, f"{name}: max |replay - eager| {err:.3g} (max |eager| {scale:.3g})"
            worst = worst or (f"{name}: {err:.2g}" if err else "")
            continue
        share = float((_bytes(g) != _bytes(r)).float().mean())
        if share > FLIP_SHARE:
            return False, f"{name}: {100 * share:.2f}% of bytes differ"
    return True, worst or "bit-identical"


def float_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b| over the elements that differ, max(max finite |b|, 1)); equal infinities (masked scores are
    -inf) and NaN in both count as equal, a non-finite value in one only as an infinite difference."""
    af, bf = a.float(), b.float()
    same = (af == bf) | (af.isnan() & bf.isnan())
    finite = bf[bf.isfinite()]
    scale = max(float(finite.abs().max()) if finite.numel() else 0.0, 1.0)
    if bool(same.all()):
        return 0.0, scale
    d = (af - bf).abs()[~same]
    return float(d.nan_to_num(nan=float("inf")).max()), scale


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).contiguous().view(torch.uint8)


class LayerGraphs:
    """Per-layer graphs of one executor call at fixed shapes; ``feeds`` are the static input buffers (write new
    tokens / positions / cache contents into them in place between runs)."""

    def __init__(self, ex, feeds: dict, backend, *, check_host_reads: bool = True, per_node: bool = False):
        self.ex, self.feeds, self.backend = ex, feeds, backend
        self.check_host_reads = check_host_reads
        self.segments = split_segments(ex.steps, ex.graph, per_node)
        self.env = bind_symbols(ex.graph, feeds)
        self.t = int(feeds["tokens"].shape[0]) if "tokens" in feeds else 1
        self.memo: dict = {}
        self.warm: list[dict] = []  # warm-up outputs per segment (the replay check's reference)
        self.static_out: list[dict] = []  # per segment: the buffers later segments read
        self.handles: dict[int, object] = {}  # segment index -> captured graph
        self.captured: dict[int, list] = {}  # segment index -> the capture's outputs (what a replay writes)
        self.eager: dict[int, str] = {}  # segment index -> why it runs eagerly
        self.host_reads: dict[int, list[str]] = {}
        self.capture_s: dict[int, float] = {}
        self.replay_check: dict[int, str] = {}
        self.segment_ms: list[float] | None = None
        self.prepared = False

    # -- values --------------------------------------------------------------------------------------------
    def _source(self, name: str, upto: int) -> torch.Tensor:
        """The static tensor holding ``name`` for segment ``upto``: a feed or an earlier segment's output."""
        for i in range(upto - 1, -1, -1):
            if name in self.static_out[i]:
                return self.static_out[i][name]
        return self.feeds[name]

    def _vals(self, i: int, source) -> dict:
        seg = self.segments[i]
        vals = {n: source(n) for n in seg.inputs}
        vals.update({p: self.ex.params[p] for p in seg.params})
        return vals

    def _run_segment(self, i: int, vals: dict) -> dict:
        seg = self.segments[i]
        with self.ex.sync_free_scope(self.t):
            self.ex.run_steps(seg.steps, vals, self.env, self.t)
        return {n: vals[n] for n in seg.outputs}

    # -- prepare -------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        self._warm_up()
        if self.backend is None:
            for i in range(len(self.segments)):
                self.eager.setdefault(i, "graphs off")
        else:
            for i in range(len(self.segments)):
                if self.check_host_reads and i not in self.eager:
                    self._record_host_reads(i)
                if i not in self.eager:
                    self._capture(i)
            self._check_replays()
        self.prepared = True

    def _warm_up(self) -> None:
        for i in range(len(self.segments)):
            warm_src = self._warm_source(i)
            out = self._run_segment(i, self._vals(i, warm_src))
            self.warm.append(out)
            # until captured, a segment's static buffers are copies of its warm-up outputs (what an eager
            # segment writes into at every run)
            self.static_out.append({n: t.clone() for n, t in out.items()})
        self._sync()

    def _warm_source(self, i: int):
        def source(name: str) -> torch.Tensor:
            for j in range(i - 1, -1, -1):
                if name in self.warm[j]:
                    return self.warm[j][name]
            return self.feeds[name]

        return source

    def _record_host_reads(self, i: int) -> None:
        saved = copy.deepcopy(self.ex.stats)
        guard = cg.HostSyncGuard(record=True, memo=self.memo)
        try:
            with guard:
                self._run_segment(i, self._vals(i, self._warm_source(i)))
        except Exception as e:
            self.eager[i] = f"host-read check failed: {cg._one_line(e)}"
            return
        finally:
            self.ex.stats = saved
        if guard.hits:
            self.host_reads[i] = [f"{what} (x{k})" for what, k in guard.hits.most_common()]
            self.eager[i] = (
                "reads device values on the host: "
                + "; ".join(self.host_reads[i][:4])
                + (f"; and {len(self.host_reads[i]) - 4} more" if len(self.host_reads[i]) > 4 else "")
            )

    def _capture(self, i: int) -> None:
        saved = copy.deepcopy(self.ex.stats)  # captured node runs are not executions
        failed_before = dict(self.ex.kernels.failed)
        vals = self._vals(i, lambda n: self._source(n, i))
        t0 = time.perf_counter()

        def body():
            with cg.HostSyncGuard(memo=self.memo):
                return [self._run_segment(i, dict(vals))]

        try:
            handle, outs = self.backend.capture(body)
        except Exception as e:  # an op that still synchronises: this segment stays eager, with the reason
            self.eager[i] = f"capture failed: {cg._one_line(e)}"
            self._discard()
            return
        finally:
            self.ex.stats = saved
        newly = {k.describe(): why for k, why in self.ex.kernels.failed.items() if k not in failed_before}
        if newly:
            # a kernel the executor disabled during capture (a host read inside its adapter): the graph would
            # hold its reference instead -- not the step that was warmed up; the warm-up figures stay honest
            first = next(iter(newly.items()))
            self.eager[i] = f"kernel disabled during capture: {first[0]}: {first[1]}"
            self._discard()
            return
        self.capture_s[i] = time.perf_counter() - t0
        self.handles[i] = handle
        self.static_out[i] = outs[0]
        self.captured[i] = outs

    def _discard(self) -> None:
        try:
            self.backend.discard()
        except Exception:  # noqa: BLE001 -- a failed discard leaves nothing more to undo
            pass

    def _check_replays(self) -> None:
        for i in range(len(self.segments)):
            self._run_one(i)
            self._sync()
            if i in self.eager:
                continue
            ok, what = compare_outputs(self.static_out[i], self.warm[i])
            self.replay_check[i] = what
            if not ok:
                self.eager[i] = f"replay differs from the eager run ({what})"
                self._run_one(i)  # the eager result, so the segments after it are checked on the right inputs

    # -- running -------------------------------------------------------------------------------------------
    def _run_one(self, i: int) -> None:
        if i in self.handles and i not in self.eager:
            self.backend.replay(self.handles[i], self.captured[i])
            return
        out = self._run_segment(i, self._vals(i, lambda n: self._source(n, i)))
        for n, t in out.items():
            self.static_out[i][n].copy_(t)

    def run(self, timed: bool = False) -> list[torch.Tensor]:
        """One step: every segment in order (graph replay or eager); the graph's outputs (static buffers, valid
        until the next run). timed: ``segment_ms`` gets each segment's time (CUDA events, or the host clock on
        CPU)."""
        if not self.prepared:
            self.prepare()
        marks = [mark()] if timed else None
        for i in range(len(self.segments)):
            self._run_one(i)
            if marks is not None:
                marks.append(mark())
        if marks is not None:
            self._sync()
            self.segment_ms = [elapsed_ms(a, b) for a, b in zip(marks, marks[1:])]
        last = len(self.segments)
        return [self._source(v.name, last) for v in self.ex.graph.outputs]

    def layer_ms(self) -> dict[str, float]:
        """The last timed run's milliseconds per layer name (segments of one name added)."""
        out: dict[str, float] = {}
        for seg, ms in zip(self.segments, self.segment_ms or []):
            out[seg.name] = out.get(seg.name, 0.0) + ms
        return out

    def node_ms(self) -> list[tuple[str, str, str, float]]:
        """Per-node mode: (layer, op, node name, ms) of the last timed run, slowest first."""
        rows = [(seg.name, seg.steps[0].node.op, seg.steps[0].outputs[0], ms)
                for seg, ms in zip(self.segments, self.segment_ms or [])]  # fmt: skip
        return sorted(rows, key=lambda r: -r[3])

    def fell_back(self) -> dict[str, str]:
        """Layer name -> why it runs eagerly (segments that replay a graph are absent)."""
        return {self.segments[i].name: why for i, why in sorted(self.eager.items())}

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    # -- report --------------------------------------------------------------------------------------------
    def report(self) -> str:
        n = len(self.segments)
        lines = [f"layer graphs (T={self.t}): {n - len(self.eager)} of {n} segments replay a graph"]
        for i, seg in enumerate(self.segments):
            if i in self.eager:
                lines.append(f"  {seg.name:<6} eager -- {self.eager[i]}")
            else:
                lines.append(f"  {seg.name:<6} graph ({len(seg.steps)} nodes, captured in {self.capture_s[i]:.2f} s; "
                             f"replay check: {self.replay_check.get(i, '-')})")  # fmt: skip
        return "\n".join(lines)

