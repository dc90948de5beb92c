"""One decode step of B sequences through the batched graph (passes/batch_decode.py) on the sm90 executor.

    dec = BatchedDecoder(plan.graph, params, device="cuda", max_model_len=4096)
    caches = dec.stack([seq0_caches, seq1_caches, ...])     # [B, *shape] per cache (or allocate(B))
    logits, caches = dec.step(tokens, positions, caches)     # logits [B, vocab]; caches updated (in place)

The batched graph's row-wise nodes keep the plan's kernel bindings (select_kernels bound them per T bucket, and
T is now the number of sequences): the GEMMs, MoE, norms and mHC run their kernels at T = B, reading every
weight once for the B sequences. Attention runs the decode kernel unchanged over the flattened pools (each
query gathers its own rows: flat row ids). The batched_* ops (ir/ops/batched.py) run their vectorised torch
references, sync-free (no host reads), so the step can be captured as CUDA graphs (runtime/layer_graphs.py).

Cache writes in place (``donate_caches``, the default): the graph writes each cache with scatter_rows, whose
functional form -- and the cache_rows kernel adapter -- copies the whole pool first. At B sequences x 4k context
that copy is B times one sequence's cache per write (0.5 GB for a V4.1 ratio-1 layer at B = 64), so the decoder
writes the rows into the pool itself: the verifier guarantees the old version has no later reader, and the pool
is a view of the caller's [B, ...] cache tensor (the graph's output for that cache is a view of it too);
step() copies the small functional states (compressor rings, Engram history) back, so every tensor passed in
holds the new state afterwards, as the runtime's static decode slots want. Each sequence writes at most one
row per pool per step, into its own rows, so a skipped write (-1: a compressor that did not close a window)
rewrites a row of its own with its current value, a fixed-shape index_copy_ without a host read. A replay of
the executor's step writes the same rows with the same values (the compressor states are its functional
outputs), so per-layer CUDA-graph replays of one step (benchmarks) stay idempotent.

Operand copies around the attention (decode_graph): the window is read from the ring as the step writes it
(passes/read_rings_after_write.py), not from concat(rings, new rows) -- a copy of every sequence's ring each step;
where the caches are stored in bf16 (passes/cache_storage.py) and the ws program reads them, the compressed rows are
read from the flat pools in place (pools_read_in_place), not gathered into a compact pool first. Both give the same
rows.

BatchedDecodeGraphs is cuda_graphs.DecodeGraphs' counterpart and the engine's default decode path (CudaRunner;
batched_decode=False or DEEPINFER_BATCHED_DECODE=0 chains single-token steps instead): one captured batched
step per bucket instead of a chain of single-token steps. Its logits equal the single-token steps' bit for bit
at B = 1 and to fp32/kernel rounding at B > 1 (the GEMMs run at M = B): a sequence's logits depend, at rounding
level, on the bucket it was decoded in; the greedy tokens are the same (tests/runtime/test_batched_decode.py,
test_cuda_graphs.py; gpu_e2e.py on the tiny V4.1).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from deepinfer.ir.graph import Graph
from deepinfer.passes.batch_decode import batch_decode
from deepinfer.passes.read_rings_after_write import read_rings_after_write
from deepinfer.passes.select_logit_rows import ROWS_INPUT, has_logit_rows
from deepinfer.runtime import cuda_graphs as cg
from deepinfer.runtime.cuda_executor import GraphExecutor, KernelCache, Step
from deepinfer.runtime.kernel_adapters import MAX_POSITIONS
from deepinfer.runtime.session import allocate_caches


def scatter_rows_in_place(pool: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """pool[index[b]] = rows[b] in place for one row per sequence (index [B], flat rows of sequence b's part of
    pool, or -1 = skip); returns pool. See the module doc for why a skip rewrites row b*N."""
    b = index.shape[0]
    own = torch.arange(b, device=index.device) * (pool.shape[0] // b)
    keep = index >= 0
    dest = torch.where(keep, index.long(), own)
    vals = torch.where(keep.view(-1, *([1] * (rows.dim() - 1))), rows, pool[own])
    return pool.index_copy_(0, dest, vals)


class BatchedExecutor(GraphExecutor):
    """GraphExecutor for a batched decode graph: scatter_rows into the pools in place (donate=True)."""

    def __init__(self, g: Graph, params: Mapping[str, torch.Tensor], *, donate: bool = True, **kw):
        super().__init__(g, params, **kw)
        self.donate = donate

    def _run_node(self, step: Step, args: list, attrs: dict, t: int) -> list:
        if self.donate and step.node.op == "scatter_rows" and _one_row_per_sequence(args, t):
            self.stats.compiled["scatter_rows in place"] += 1
            self.stats.per_node[step.outputs[0]] = "compiled scatter_rows in place"
            return [scatter_rows_in_place(*args)]
        return super()._run_node(step, args, attrs, t)


def _one_row_per_sequence(args: list, t: int) -> bool:
    pool, index, _ = args
    return index.dim() == 1 and index.shape[0] == t and pool.shape[0] % t == 0


def pools_read_in_place(g: Graph) -> bool:
    """Whether the attention reads its compressed pools where they are: every attention node's compressed pool is a
    cache stored in bf16 (passes/cache_storage.py) and bound to the ws program in every bucket (its pool sizes are
    symbolic on sm90). Then batch_decode's compact gather would only copy the rows the kernel reads anyway."""
    from deepinfer.codegen.kernels import sparse_attn_decode as sad
    from deepinfer.ir import dtypes as dt

    bindings = (g.meta.get("kernels") or {}).get("nodes", {})
    pools = {"fused_attention": 5, "sparse_attention": 4}
    readers = [n for n in g.nodes if n.op in pools and len(n.inputs) > pools[n.op] and n.inputs[pools[n.op]]]
    for node in readers:
        rec = bindings.get(node.outputs[0].name)
        if node.inputs[pools[node.op]].dtype != dt.bf16 or rec is None:
            return False
        for b in rec["buckets"].values():
            shape = b.get("shape") or {}
            if not (b.get("config") or {}).get("ws") or not sad.ws_supported(shape.get("H"), shape.get("D"), "sm90"):
                return False
    return bool(readers)


RING_FIRST_ENV = "DEEPINFER_RING_FIRST"  # "0": the window pools stay concat(rings, new rows)


def decode_graph(g: Graph, *, compact: bool | None = None, ring_first: bool | None = None) -> Graph:
    """The batched decode graph the decoder runs: batch_decode's rewrite (compact: its option; None -- see
    pools_read_in_place), then the windows read from the written rings (read_rings_after_write; None: unless
    RING_FIRST_ENV is "0")."""
    bg = batch_decode(g, compact=not pools_read_in_place(g) if compact is None else compact)
    if ring_first if ring_first is not None else os.environ.get(RING_FIRST_ENV) != "0":
        read_rings_after_write(bg)
    return bg


class BatchedDecoder:
    """The batched decode step of a plan graph on ``device`` (see the module doc). ``compiled=False`` runs every
    node's torch reference (the eager baseline of the same batched graph); ``compact``: batch_decode's option --
    True gathers the attended compressed rows into a compact pool first, False keeps the attention on the flat
    pools; None (default): False where the kernel reads bf16 cache pools in place (pools_read_in_place), else True;
    ``ring_first``: the windows read from the written rings (read_rings_after_write; None: RING_FIRST_ENV)."""

    def __init__(self, g: Graph, params: Mapping[str, torch.Tensor], device: str | torch.device = "cuda", *,
                 max_model_len: int, compiled: bool = True, donate_caches: bool = True, compact: bool | None = None,
                 ring_first: bool | None = None, kernels: KernelCache | None = None, verify: bool = True):  # fmt: skip
        self.single = g
        self.graph = decode_graph(g, compact=compact, ring_first=ring_first)
        self.device = torch.device(device)
        self.max_len = max_model_len
        self.cache_names = [e["name"] for e in g.meta.get("caches", [])]
        self.exec = BatchedExecutor(self.graph, params, donate=donate_caches, compiled=compiled, kernels=kernels,
                                    verify=verify, sync_free="always", max_positions=max_model_len)  # fmt: skip
        self.exec.prep_cache[MAX_POSITIONS] = max_model_len
        self._rows: dict[int, torch.Tensor] = {}

    def allocate(self, n_seq: int) -> dict[str, torch.Tensor]:
        """Initial caches of n_seq empty sequences, [n_seq, *shape] each."""
        one = allocate_caches(self.single, self.max_len, device=self.device)
        return {k: v.unsqueeze(0).repeat(n_seq, *([1] * v.dim())) for k, v in one.items()}

    def stack(self, seqs: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One [B, *shape] tensor per cache from B sequences' dense caches (sized by max_model_len)."""
        return {k: torch.stack([s[k] for s in seqs]).to(self.device) for k in self.cache_names}

    def feeds(self, tokens, positions, caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dev = self.device
        out = {"tokens": torch.as_tensor(tokens, dtype=torch.long).to(dev),
               "positions": torch.as_tensor(positions, dtype=torch.long).to(dev), **caches}  # fmt: skip
        if has_logit_rows(self.graph):  # a plan compiled with select_logit_rows: every sequence's row
            out[ROWS_INPUT] = self._all_rows(len(out["tokens"]))
        return out

    def _all_rows(self, b: int) -> torch.Tensor:
        """arange(b) on the device, made once per b (before any capture: the first step of a bucket is eager)."""
        if b not in self._rows:
            self._rows[b] = torch.arange(b, device=self.device)
        return self._rows[b]

    def step(self, tokens, positions, caches: Mapping[str, torch.Tensor]):
        """One token for each of B sequences: (logits [B, vocab] on the device, new caches by name). With
        donate_caches the tensors passed in hold the new state afterwards (the pools written in place, the small
        states -- compressor rings, Engram history -- copied back) and are the ones returned."""
        outs = self.exec.run(self.feeds(tokens, positions, caches))
        new = dict(zip(self.cache_names, outs[1 : 1 + len(self.cache_names)]))
        if not self.exec.donate:
            return outs[0], new
        for k, v in new.items():
            if v.data_ptr() != caches[k].data_ptr():
                caches[k].copy_(v)
        return outs[0], {k: caches[k] for k in self.cache_names}

    def report(self) -> str:
        return self.exec.report()


class BatchedDecodeGraphs:
    """cuda_graphs.DecodeGraphs' interface -- ``run(tokens, positions, fill)``, ``report()``, ``max_bucket`` -- over
    ONE batched step per bucket instead of a chain of single-token steps: the weights are read once per step.

    Static slots: one [max_bucket, *shape] tensor per cache (slot j = row j, what ``fill(j, caches)`` writes),
    token and position rows, a logits buffer. Bucket b runs the batched graph over slots 0..b-1 (a contiguous
    prefix: the flat pools are views); slots n..b-1 are padding (token 0 at position 0 over initial caches, a
    valid step whose outputs are ignored). First use of a bucket: the step runs eagerly (kernels built, checks,
    re-layouts), then -- with the slots refilled by the engine's ``fill``, as the step updates them in place --
    it is captured and replayed once; the replay must reproduce the eager logits, else the bucket stays eager
    with the reason (a failed capture too). Before the first capture one step runs under HostSyncGuard in record
    mode, naming any host read (then that bucket stays eager). ``warm_up()`` does every bucket's first use at once,
    on padding rows (the engine calls it at start, so no request waits for a bucket's kernels and capture).
    ``ex``: the runner's one-sequence executor, whose kernel cache and prepared weights (re-layouts) the batched
    executor shares."""

    def __init__(self, ex: GraphExecutor, graph: Graph, params: Mapping[str, torch.Tensor], max_len: int, device,
                 *, enabled: bool = True, buckets=None, backend=None):  # fmt: skip
        self.dec = BatchedDecoder(graph, params, device, max_model_len=max_len, kernels=ex.kernels, verify=ex.verify)
        self.dec.exec.prep_cache = ex.prep_cache  # one copy of every re-laid-out weight
        self.device, self.max_len = torch.device(device), max_len
        self.buckets = sorted(set(buckets or cg.BUCKETS))
        self.max_bucket = self.buckets[-1]
        self.names = self.dec.cache_names
        self.init = {e["name"]: e.get("init", 0) for e in graph.meta.get("caches", [])}
        self.caches = self.dec.allocate(self.max_bucket)
        self.tok = torch.zeros(self.max_bucket, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(self.max_bucket, dtype=torch.long, device=self.device)
        self.logits = torch.zeros(self.max_bucket, int(graph.outputs[0].shape[-1]), device=self.device)
        self.padded = [True] * self.max_bucket
        self.off_reason = None if enabled else "off (cuda_graphs=False)"
        if enabled and backend is None:
            backend = cg.CudaGraphBackend(self.device) if self.device.type == "cuda" else None
            self.off_reason = None if backend else f"off (no CUDA graphs on {self.device})"
        self.backend = backend if self.off_reason is None else None
        self.graphs: dict[int, tuple] = {}
        self.failed: dict[int, str] = {}
        self.blocked: str | None = None  # DecodeGraphs' interface: here host reads are checked per bucket (failed)
        self.memo: dict = {}
        self.replays = {b: 0 for b in self.buckets}
        self.capture_s: dict[int, float] = {}
        self.warm_s: dict[int, float] = {}  # buckets captured (or tried) by warm_up: its seconds
        self.warm_errors: dict[int, str] = {}
        self.unchecked: set[int] = set()  # warmed up without the kernels' checks: the first real step runs eagerly
        self.dropped: list[str] = []  # graphs dropped: a kernel disabled after their capture
        self._disabled = cg.DisabledSince(self.dec.exec)
        self.eager_steps = self.batches = 0

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # -- running -----------------------------------------------------------------------------------------
    def run(self, tokens: list[int], positions: list[int], fill):
        n = len(tokens)
        if not 1 <= n <= self.max_bucket:
            raise ValueError(f"a decode batch of {n} (1..{self.max_bucket})")
        self.batches += 1
        b = self.bucket(n)
        self._write(tokens, positions, fill)
        self._pad(n, b)
        cg.drop_stale_graphs(self, self._disabled)  # a kernel disabled since (by a prefill's check, say)
        if self.backend is not None and b in self.graphs and b not in self.unchecked:
            self.backend.replay(*self.graphs[b])
            self.replays[b] += 1
        elif b in self.unchecked:  # a warmed bucket's first real step: eagerly, with the kernels' first-call checks
            self.eager_steps += 1
            self.unchecked.discard(b)
            self._step(b)
            cg.drop_stale_graphs(self, self._disabled)  # one they disabled: captured again at the next use
        else:
            self.eager_steps += 1
            if self.backend is not None and b not in self.failed:
                self._capture(n, b, lambda: (self._write(tokens, positions, fill), self._pad(n, b, again=True)))
            else:
                self._step(b)
        return self.logits[:n].cpu(), [{k: self.caches[k][j] for k in self.names} for j in range(n)]

    def _write(self, tokens, positions, fill) -> None:
        n = len(tokens)
        host = torch.tensor([tokens, positions], dtype=torch.long)
        self.tok[:n].copy_(host[0], non_blocking=True)
        self.pos[:n].copy_(host[1], non_blocking=True)
        for j in range(n):
            fill(j, {k: self.caches[k][j] for k in self.names})
            self.padded[j] = False

    def _pad(self, n: int, b: int, again: bool = False) -> None:
        """Slots n..b-1 as padding. A padding slot is not re-initialised between steps (a full-slot fill per step
        would cost more than the step): the step updates it in place, but its rows are ignored and no value
        crosses rows (every op is per token or per sequence), so only ``again`` (the capture's re-runs of one
        call, which must see identical inputs) resets it."""
        for j in range(n, b):
            if again or not self.padded[j]:
                self.tok[j], self.pos[j] = 0, 0
                for k in self.names:
                    self.caches[k][j].fill_(self.init[k])
                self.padded[j] = True

    def _step(self, b: int) -> list[dict]:
        """The batched step over slots 0..b-1, in place; returns its outputs as a graph backend wants them."""
        logits, _ = self.dec.step(self.tok[:b], self.pos[:b], {k: v[:b] for k, v in self.caches.items()})
        self.logits[:b].copy_(logits)
        return [{"logits": self.logits[:b]}]

    # -- capture -----------------------------------------------------------------------------------------
    def _capture(self, n: int, b: int, refill) -> None:
        """Warm-up, host-read check, capture, replay check for bucket b. The step updates the slots in place, so
        each run starts from ``refill()`` (the engine's fill again: no snapshot of the slots in memory)."""
        import copy
        import time

        self._step(b)  # the warm-up (kernels built and checked, weights re-laid out)
        cg.drop_stale_graphs(self, self._disabled)  # a kernel its checks disabled: the other buckets' graphs
        eager = self.logits[:n].clone()
        stats = copy.deepcopy(self.dec.exec.stats)  # the check's and the capture's node runs are not executions
        try:
            refill()
            reads = self._host_reads(b)  # per bucket: a reference may read the host at T > 1 only (tiny MoE)
            if reads:
                self.failed[b] = reads
                return
            refill()
            t0 = time.perf_counter()
            try:
                handle, outs = self.backend.capture(lambda: self._guarded_step(b))
            except Exception as e:  # an op that still synchronises: this bucket stays eager, with the reason
                self.failed[b] = f"capture failed: {cg._one_line(e)}"
                return
            self.capture_s[b] = time.perf_counter() - t0
            refill()
            self.backend.replay(handle, outs)
            err = float((self.logits[:n] - eager).abs().max())
            scale = max(float(eager.abs().max()), 1.0)
            if not err <= cg.REPLAY_TOL * scale:  # NaN fails too
                self.failed[b] = f"replay differs from the eager step (max abs {err:.3g}, logits max {scale:.3g})"
                return
            self.graphs[b] = (handle, outs)
        finally:
            self.dec.exec.stats = stats
            if b not in self.graphs:  # this call's result: the eager step again, from the call's inputs
                refill()
                self._step(b)

    # -- warm-up -----------------------------------------------------------------------------------------
    def warm_up(self) -> str:
        """Every bucket's first use now (cuda_graphs.warm_up_buckets), on padding rows only: the same eager step,
        host-read check, capture and replay check as at first use, over slots that all hold a first step (position
        0 over initial caches; tokens 1..b, see _warm_one). The slots are scratch -- the engine's ``fill`` rewrites a
        sequence's slot before every step -- so no live sequence's cache is touched; afterwards every slot holds
        its initial value again (the state of a bucket never used), so the first real step computes what it
        would have computed without the warm-up. The kernels' first-call checks are off meanwhile (padding is no
        real data): each warmed bucket's first real step runs eagerly with them (cuda_graphs' module doc: a kernel
        they disable drops the graphs). Returns the one-line summary the engine logs."""
        if self.backend is None:
            return f"decode graphs: nothing to warm up ({self.off_reason})"
        try:
            with cg.checks_off(self.dec.exec) as verify:
                line = cg.warm_up_buckets(self, self._warm_one)
        finally:
            self._reset_slots()
        if verify:  # the checks run on real data: each warmed bucket's first real step, eagerly
            self.unchecked |= {b for b in self.warm_s if b in self.graphs}
        return line

    def _warm_one(self, b: int) -> None:
        """Bucket b's first use over slots 0..b-1, each a first step (position 0 over initial caches) of a distinct
        token, 1..b: the kernels' first-call checks (verify) then compare b distinct rows -- b copies of one row
        (token 0 everywhere) would hide a kernel that mixes rows up -- and the MoE routes more than one top-k."""
        tokens = torch.arange(1, b + 1, device=self.device)

        def rows() -> None:
            self._pad(0, b, again=True)
            self.tok[:b].copy_(tokens)

        rows()
        self._capture(b, b, rows)

    def _reset_slots(self) -> None:
        """Every slot to its initial value: what allocate gave, token 0 at position 0 (padding)."""
        for k in self.names:
            self.caches[k].fill_(self.init[k])
        self.tok.zero_()
        self.pos.zero_()
        self.logits.zero_()
        self.padded = [True] * self.max_bucket

    def _guarded_step(self, b: int) -> list[dict]:
        with cg.HostSyncGuard(memo=self.memo):
            return self._step(b)

    def _host_reads(self, b: int) -> str | None:
        """One step recording every host read (and making the memoised host -> device copies); the reason the
        step cannot be captured, or None."""
        guard = cg.HostSyncGuard(record=True, memo=self.memo)
        try:
            with guard:
                self._step(b)
        except Exception as e:
            return f"host-read check failed: {cg._one_line(e)}"
        if not guard.hits:
            return None
        listed = "; ".join(f"{what} (x{k})" for what, k in guard.hits.most_common(4))
        return f"the step reads device values on the host: {listed}"

    # -- report ------------------------------------------------------------------------------------------
    def report(self) -> str:
        lines = [f"decode graphs: {self.off_reason or 'on'}; buckets {', '.join(map(str, self.buckets))}; static "
                 f"caches for max_model_len {self.max_len}; one batched step per bucket"]  # fmt: skip
        for b in self.buckets:
            if b in self.graphs:
                lines.append(f"  bucket {b:>2}: captured in {self.capture_s[b]:.2f} s{cg.warm_note(self, b)}, "
                             f"{self.replays[b]} replays")  # fmt: skip
            elif b in self.failed:
                lines.append(f"  bucket {b:>2}: eager -- {self.failed[b]}")
            elif b in self.warm_errors:
                lines.append(f"  bucket {b:>2}: warm-up raised ({self.warm_errors[b]}); left to its first use")
        lines += [f"  graphs dropped: {why}" for why in self.dropped]
        lines.append(f"  decode batches: {self.batches}, {sum(self.replays.values())} replayed, "
                     f"{self.eager_steps} eager")  # fmt: skip
        return "\n".join(lines)
