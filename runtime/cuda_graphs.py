"""Decode steps as CUDA graphs, and the sync-free decode path that capturing them needs.

A decode step (every sequence runs one token, T=1) launches the same kernels with the same shapes every time;
only the token, the position and the caches' contents change. ``DecodeGraphs`` keeps static input buffers
(token, position, and the sequence's dense caches sized to max_model_len), captures the per-sequence step
once per decode batch-size bucket and replays it:

    bucket B (1, 2, 4, 8, 16):  B static slots, the B single-token steps chained in one graph; the logits row
                                of every slot lands in one static [B, vocab] buffer (one device -> host copy)
    a batch of n sequences:     the smallest bucket >= n; slots n..B-1 are padding (token 0 at position 0
                                over initial caches: a valid first step whose outputs are ignored); a batch
                                larger than the largest bucket is split by the executor

First use of a bucket: the step runs eagerly (the warm-up: kernels built, first-call kernel checks, weight
re-layouts, rope tables -- everything that reads values or allocates long-lived tensors happens here), then
the graph is captured and replayed once on the same inputs; the replay must reproduce the eager logits, else
the bucket is not used. A capture that fails (an op that still synchronises with the host) leaves that bucket
eager, with the reason in the report -- never silently. Before the first capture one step runs under
``HostSyncGuard`` in "record" mode, which names the op and the source line of every host read, so a failure
is reported precisely rather than as a CUDA capture error.

Warm-up (``warm_up()``; the engine calls it at start unless GRAPH_WARMUP_ENV=0 or graph_warmup=False): the same
first use for every bucket at once, on padding slots only, so no request waits mid-serving for a bucket's kernels
(TileLang loads, Triton JIT compiles) and its capture. The slots are scratch (the engine's ``fill`` rewrites a
sequence's slot before every step), so warming up between steps touches no live sequence's cache; afterwards
every slot holds its initial value again, as before any use. The kernels' first-call checks (the executor's
``verify``: a kernel that disagrees with its reference is disabled) stay for real data: the warm-up runs without
them, and a warmed bucket's first real step runs eagerly with them (kernels built: milliseconds), its outputs the
step's; later steps replay the warmed graph.

Stale graphs: a graph keeps the kernels it captured. When a kernel is disabled after a capture (a first-call check
on real data, a kernel that raised, in this bucket's step or any other call on the same kernel cache -- kernel sets
are shared across buckets: row-symbolic programs, one check per Triton family and op), every captured graph is
dropped, the report saying why, and each bucket is captured again at its next use, with the fallback.

Sync-free references (``sync_free_references``, entered by GraphExecutor for T=1 steps): a reference that
reads device values on the host cannot be captured. The ops' own references were made sync-free where this
package owns them (the compressors); for the others the decode path uses equivalents with identical numbers:

    scatter_rows, candidate_blocks   boolean-mask indexing (a nonzero) -> index_put / scatter with a spare row
    moe_experts (and the fused MoE   unique + nonzero over the routed experts -> every expert over the token,
      op's routed part), T=1 only    kept where routed (torch.where): the same M=1 products, added in the
                                     same expert order, so the same bits; used only where the grouped kernel
                                     declines (tiny/small presets), it costs E instead of k expert GEMVs
    dtypes.float_to_e8m0             its positivity check (a host read) is skipped; its inputs are the
                                     pow2_scale outputs, >= 2^-17 by construction

The last two are module attributes patched for the duration of a T=1 step (process-wide, reference counted);
other threads running references meanwhile get the same numbers (the MoE patch falls back to the original for
T > 1). Host -> device copies of constant host tensors inside references (rope frequencies, the Engram token
map) are legal eagerly but not under capture: ``HostSyncGuard(memo=...)`` serves them from copies made once,
before capture, keyed by content.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.errors import DeepInferError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.ops.moe import EXPERT_FORMATS, MoEExperts, _expert_weight, swiglu
from deepinfer.passes.select_logit_rows import ROWS_INPUT, has_logit_rows

BUCKETS = (1, 2, 4, 8, 16)
REPLAY_TOL = 1e-3  # relative max-abs tolerance of the capture-time replay check (bitwise equality is expected)
# "0": each decode bucket is captured at its first use (the request that first fills it waits for its kernels'
# loads / JIT compiles and the capture) instead of at engine start (warm_up_buckets; EngineConfig.graph_warmup)
GRAPH_WARMUP_ENV = "DEEPINFER_GRAPH_WARMUP"


# ---------------------------------------------------------------------------------------------------
# Sync-free references with identical numbers
# ---------------------------------------------------------------------------------------------------


def scatter_rows(cache: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """ScatterRows.reference without the boolean mask: skipped rows (index < 0) go to a spare row."""
    n = cache.shape[0]
    out = torch.cat([cache, cache.new_empty((1, *cache.shape[1:]))])
    dest = torch.where(index >= 0, index.long(), n)
    out.index_put_((dest,), rows)
    return out[:n]


def candidate_blocks(scores, positions, *, ratio, topk_blocks, block):
    """CandidateBlocks.reference without the boolean mask: the newest visible entry's block is forced to +inf
    through a scattered mask (one column per row); the columns past the visible ones -inf, as there."""
    from deepinfer.ir.ops.v41 import _masked_topk, _visible_columns

    t, c = scores.shape
    nb = (c + block - 1) // block
    padded = torch.full((t, nb * block), float("-inf"), device=scores.device)
    padded[:, :c] = scores.float().masked_fill(~_visible_columns(scores, positions, ratio), float("-inf"))
    bscore = padded.view(t, nb, block).amax(-1)
    newest = (positions.long() + 1) // ratio - 1
    has = newest >= 0
    col = torch.where(has, newest // block, 0)
    force = torch.zeros_like(bscore, dtype=torch.bool).scatter_(1, col.unsqueeze(1), has.unsqueeze(1))
    return _masked_topk(bscore.masked_fill(force, float("inf")), topk_blocks)


def moe_experts(x, weights, idx, *experts, n_experts, fmt, swiglu_limit, block):
    """MoEExperts.reference for one token without unique/nonzero (the original for T > 1)."""
    if x.shape[0] != 1:
        return _ORIGINAL["moe"](x, weights, idx, *experts, n_experts=n_experts, fmt=fmt, swiglu_limit=swiglu_limit,
                                block=block)  # fmt: skip
    per = EXPERT_FORMATS[fmt]
    step = per // 3
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf, wf = x.float(), weights.float()
    for e in range(n_experts):
        hit = idx == e  # [1, K]
        routed = hit.any(-1, keepdim=True)  # [1, 1]
        w = torch.where(hit, wf, 0.0).sum(-1, keepdim=True)  # the routed slot's weight (one hit at most)
        ws = experts[per * e : per * (e + 1)]
        scales = ws[1::2] if step == 2 else (None, None, None)
        w1, w2, w3 = (_expert_weight(fmt, m, s, block) for m, s in zip(ws[::step], scales))
        h = swiglu(xf @ w1.T, xf @ w3.T, swiglu_limit)
        out = torch.where(routed, out + (h @ w2.T) * w, out)
    return out.to(x.dtype)


def float_to_e8m0(x: torch.Tensor) -> torch.Tensor:
    """dtypes.float_to_e8m0 without the positivity check (a host read)."""
    exp = torch.ceil(torch.log2(x.float())).clamp(-127, 127)
    return (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


SYNC_FREE_OPS: dict[str, Callable] = {
    "scatter_rows": scatter_rows,
    "candidate_blocks": candidate_blocks,
    "moe_experts": moe_experts,
}

_ORIGINAL: dict[str, Callable] = {"moe": MoEExperts.__dict__["reference"], "e8m0": dt.float_to_e8m0}
_LOCK = threading.RLock()
_DEPTH = 0


def _install() -> None:
    MoEExperts.reference = staticmethod(moe_experts)
    dt.float_to_e8m0 = float_to_e8m0


def _uninstall() -> None:
    MoEExperts.reference = _ORIGINAL["moe"]
    dt.float_to_e8m0 = _ORIGINAL["e8m0"]


@contextlib.contextmanager
def sync_free_references():
    """Patch the module-level references that read device values on the host (see the module doc)."""
    global _DEPTH
    with _LOCK:
        if _DEPTH == 0:
            _install()
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                _uninstall()


# ---------------------------------------------------------------------------------------------------
# Host synchronisation guard
# ---------------------------------------------------------------------------------------------------

_HOST_READS = {
    "aten._local_scalar_dense": "host read of a device value (.item() / int() / float() / bool())",
    "aten.is_nonzero": "host read of a device value (bool())",
    "aten.item": "host read of a device value (.item())",
    "aten.nonzero": "nonzero (data-dependent size: a host read)",
    "aten.masked_select": "masked_select (data-dependent size: a host read)",
    "aten.bincount": "bincount (reads the maximum on the host)",
    "aten.histc": "histc (reads the range on the host)",
}
_INDEX_OPS = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}
_COPY_OPS = {"aten._to_copy", "aten.copy_"}


class HostSyncError(RuntimeError):
    """An op in a region that must not read device values on the host (or copy host memory to the device)."""


class HostSyncGuard(TorchDispatchMode):
    """Rejects (``record=False``) or records (``record=True``) every op that makes the host wait for device values
    or copies host memory to the device -- what a CUDA graph cannot capture:

    - ``.item()`` / ``int(t)`` / ``bool(t)`` (aten._local_scalar_dense, is_nonzero), ``nonzero``, ``unique``,
      ``masked_select``, boolean-mask indexing, ``bincount`` / ``histc``, ``repeat_interleave`` with tensor
      repeats and no output size, ``tolist()`` / ``numpy()`` (patched while the guard is active, counted on the
      guard's thread only);
    - copies between devices (device -> host; host -> device unless ``memo`` serves them, see below), host
      index or value tensors used on device tensors.

    ``memo`` (a dict): a host -> device ``.to(device)`` copy of a host tensor is made once and then served from
    the dict, keyed by the tensor's content (constant tables built on the host inside references; they must
    not be written in place). On CPU tensors (tests) nothing crosses devices and only the first group applies.
    """

    def __init__(self, record: bool = False, memo: dict | None = None):
        super().__init__()
        self.record, self.memo = record, memo
        self.hits: Counter = Counter()
        self._saved: dict = {}
        self._thread = threading.get_ident()

    # -- python-level reads the dispatcher does not see on CPU tensors ---------------------------------
    _active: list = []  # guards entered and not exited (unguarded() pauses them all)

    def __enter__(self):
        guard = self
        self._thread = threading.get_ident()
        HostSyncGuard._active.append(self)
        for name in ("tolist", "numpy"):
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def patched(t, *a, _orig=orig, _name=name, **k):
                if threading.get_ident() == guard._thread:
                    guard._hit(f"Tensor.{_name}() (a host read)")
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, patched)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, orig in self._saved.items():
                setattr(torch.Tensor, name, orig)
            self._saved = {}
            with contextlib.suppress(ValueError):
                HostSyncGuard._active.remove(self)

    @contextlib.contextmanager
    def paused(self):
        """The guard off inside (tests: the CPU stand-ins of the kernels read values on the host; the compiled
        kernels they stand for do not)."""
        from torch.utils._python_dispatch import _disable_current_modes

        thread, self._thread = self._thread, None  # the tolist/numpy patches check the guard's thread
        try:
            with _disable_current_modes():
                yield
        finally:
            self._thread = thread

    def _hit(self, what: str) -> None:
        where = _user_frame()
        msg = f"{what} at {where}" if where else what
        if not self.record:
            raise HostSyncError(msg)
        self.hits[msg] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        why = _HOST_READS.get(name)
        if "unique" in name:
            why = f"{name} (data-dependent size: a host read)"
        elif name in _INDEX_OPS:
            why = _index_problem(name, args, kwargs)
        elif name == "aten.repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
            if kwargs.get("output_size") is None:
                why = "repeat_interleave with tensor repeats (data-dependent size: a host read)"
        elif name in _COPY_OPS:
            src, dst = _copy_devices(name, args, kwargs)
            if src is not None and dst is not None and src != dst:
                if src.type == "cpu" and name == "aten._to_copy" and self.memo is not None:
                    return self._memo_copy(func, args, kwargs)
                why = f"{'host -> device' if src.type == 'cpu' else 'device -> host'} copy ({src} -> {dst})"
        if why:
            self._hit(why)
        return func(*args, **kwargs)

    def _memo_copy(self, func, args, kwargs):
        src = args[0].detach().contiguous()
        data = src.reshape(-1).view(torch.uint8)
        numpy = self._saved.get("numpy", torch.Tensor.numpy)
        digest = hashlib.blake2b(numpy(data).tobytes(), digest_size=16).digest()
        key = (src.dtype, tuple(src.shape), str(kwargs.get("device")), kwargs.get("dtype"), digest)
        if key not in self.memo:
            self.memo[key] = func(*args, **kwargs)
        return self.memo[key]


@contextlib.contextmanager
def unguarded():
    """Every active HostSyncGuard paused inside (the CPU stand-ins of compiled kernels in tests and in the
    benchmarks' CPU smoke mode: they are torch references that read values on the host; the kernels are not)."""
    with contextlib.ExitStack() as stack:
        for guard in list(HostSyncGuard._active):
            stack.enter_context(guard.paused())
        yield


def _index_problem(name: str, args, kwargs) -> str | None:
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    base = args[0] if args else None
    for i in indices or ():
        if not isinstance(i, torch.Tensor):
            continue
        if i.dtype in (torch.bool, torch.uint8):
            return f"boolean-mask indexing ({name}: a nonzero, a host read)"
        if base is not None and i.device != base.device and i.dim() > 0:
            return f"{i.device} index tensor on a {base.device} tensor ({name}: a host -> device copy)"
    value = args[2] if len(args) > 2 else kwargs.get("values")
    if isinstance(value, torch.Tensor) and base is not None and value.device != base.device and value.dim() > 0:
        return f"{value.device} values written into a {base.device} tensor ({name}: a host -> device copy)"
    return None


def _copy_devices(name: str, args, kwargs):
    if name == "aten.copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
        return args[1].device, args[0].device
    if args and isinstance(args[0], torch.Tensor):
        dev = kwargs.get("device")
        return args[0].device, (torch.device(dev) if dev is not None else None)
    return None, None


def _user_frame() -> str:
    """The innermost deepinfer frame outside this module (where the offending op was called)."""
    for f in reversed(traceback.extract_stack()):
        fn = f.filename.replace("\\", "/")
        if fn.endswith("runtime/cuda_graphs.py") or "/torch/" in fn:
            continue
        parts = fn.split("/")
        short = "/".join(parts[-3:])
        return f"{short}:{f.lineno} ({(f.line or '').strip()[:80]})"
    return ""


# ---------------------------------------------------------------------------------------------------
# Graph backends
# ---------------------------------------------------------------------------------------------------


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture (thread-local error mode: the scheduler thread keeps running) into one
    memory pool shared by every bucket (they never replay concurrently, and each replay's outputs are copied
    out before the next). TileLang's tvm-ffi kernels launch on the FFI env stream: tvm_ffi.use_torch_stream
    points it at the capture stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable):
        g = torch.cuda.CUDAGraph()
        ctx = torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local")
        try:
            import tvm_ffi

            ctx = tvm_ffi.use_torch_stream(ctx)
        except (ImportError, AttributeError):
            pass
        with ctx:
            outs = fn()
        return g, outs

    def replay(self, handle, outs):
        handle.replay()
        return outs

    def discard(self) -> None:
        torch.cuda.synchronize(self.device)


class EmulatedGraphBackend:
    """CPU stand-in (tests): "capture" runs the steps once under a strict HostSyncGuard (so an op that would
    break a CUDA capture fails it here too) and keeps the callable; "replay" runs them again and writes the
    results into the captured outputs, as a graph replay does."""

    def __init__(self):
        self.captures = 0

    def capture(self, fn: Callable):
        with HostSyncGuard():
            outs = fn()
        self.captures += 1
        return fn, outs

    def replay(self, handle, outs):
        new = handle()
        for a, b in zip(_flat(outs), _flat(new)):
            a.copy_(b)
        return outs

    def discard(self) -> None:
        pass


def _flat(outs) -> list[torch.Tensor]:
    return [t for d in outs for t in d.values()]


# ---------------------------------------------------------------------------------------------------
# Warm-up: every bucket captured at engine start
# ---------------------------------------------------------------------------------------------------


def graph_warmup_from_env() -> bool:
    """GRAPH_WARMUP_ENV: unset or "1" captures every decode bucket at engine start (the default), "0" each at its
    first use."""
    value = os.environ.get(GRAPH_WARMUP_ENV, "1").strip()
    if value not in ("0", "1", ""):
        raise DeepInferError(f"{GRAPH_WARMUP_ENV}={value!r}: expected 0 (capture at first use) or 1 (at start)")
    return value != "0"


class DisabledSince:
    """Kernels disabled in an executor's KernelCache since the last ``new()`` (KernelCache.failed only grows; a new
    cache, from use_kernels, starts a new count). A kernel that failed to build is not one: no graph ran it."""

    def __init__(self, ex):
        self.ex = ex
        self.failed, self.seen = ex.kernels.failed, len(ex.kernels.failed)

    def new(self) -> list:
        failed = self.ex.kernels.failed
        if failed is not self.failed:
            self.failed, self.seen = failed, len(failed)
            return []
        if len(failed) == self.seen:  # (every decode step asks: nothing new is the common case, no key list built)
            return []
        keys = [k for k in list(failed)[self.seen :] if not str(failed[k]).startswith("build failed")]
        self.seen = len(failed)
        return keys


def drop_stale_graphs(graphs, watch: DisabledSince) -> None:
    """Every captured graph of ``graphs`` dropped when a kernel was disabled since the last look (see the module doc:
    the graphs would go on running it); each bucket is captured again at its next use."""
    keys = watch.new()
    if not keys or not graphs.graphs:
        return
    first = keys[0]
    what = f"{first.describe()}: {watch.failed[first]}" if hasattr(first, "describe") else str(first)
    graphs.dropped.append(f"buckets {', '.join(map(str, sorted(graphs.graphs)))} dropped, {len(keys)} kernel set(s) "
                          f"disabled after capture ({what[:200]})")  # fmt: skip
    for b in graphs.graphs:  # the report's "warmed up at start" no longer holds for them
        graphs.warm_s.pop(b, None)
    graphs.graphs.clear()
    graphs.unchecked.clear()


@contextlib.contextmanager
def checks_off(ex):
    """The executor's first-call checks off inside (the warm-up's padding rows are no real data); restored after.
    Nothing is recorded as checked meanwhile (stats.verified), so each kernel is checked at its first real call."""
    saved, ex.verify = ex.verify, False
    try:
        yield saved
    finally:
        ex.verify = saved


def warm_up_buckets(graphs, warm_one: Callable[[int], None]) -> str:
    """``warm_one(b)`` (the bucket's first use, on padding slots) for every bucket of ``graphs`` (DecodeGraphs or
    BatchedDecodeGraphs) not yet captured nor failed, its seconds into graphs.warm_s. A bucket whose capture fails
    stays eager with its reason (graphs.failed), as at first use; one whose warm-up raises (its padding step: a
    kernel that cannot run) is left to its first use, where a raising step falls back as before (the executor runs
    the items one by one), the error in graphs.warm_errors. Returns the one-line summary the engine logs."""
    t0, done = time.perf_counter(), []
    for b in graphs.buckets:
        if b in graphs.graphs or b in graphs.failed or graphs.blocked:
            continue
        t = time.perf_counter()
        try:
            warm_one(b)
        except Exception as e:
            graphs.warm_errors[b] = _one_line(e)
        graphs.warm_s[b] = time.perf_counter() - t
        done.append(b)
    return _warm_up_line(graphs, done, time.perf_counter() - t0)


def _warm_up_line(graphs, done: list[int], total_s: float) -> str:
    if not done:
        return f"decode graphs: nothing to warm up ({graphs.blocked or 'every bucket captured or eager already'})"
    per = ", ".join(f"{b}: {graphs.warm_s[b]:.2f}" for b in done)
    captured = ", ".join(str(b) for b in done if b in graphs.graphs) or "none"
    line = f"decode graphs warmed up in {total_s:.1f} s: buckets {captured} captured (seconds per bucket {per})"
    eager = [f"{b} ({graphs.failed[b][:120]})" for b in done if b in graphs.failed]
    if eager:
        line += f"; eager: {'; '.join(eager)}"
    if graphs.blocked:
        line += f"; every bucket eager: {graphs.blocked[:120]}"
    left = [f"{b} ({graphs.warm_errors[b]})" for b in done if b in graphs.warm_errors]
    if left:
        line += f"; warm-up raised, left to first use: {'; '.join(left)}"
    return line


# ---------------------------------------------------------------------------------------------------
# Decode graphs
# ---------------------------------------------------------------------------------------------------


class DecodeGraphs:
    """Static decode slots of one GraphExecutor, captured per batch-size bucket (see the module doc).

    ``run(tokens, positions, fill)`` runs len(tokens) single-token steps; ``fill(j, caches)`` writes sequence
    j's dense caches into the static tensors of slot j. Returns (logits [n, vocab] float32 on the host, the
    new caches of every step: device tensors, valid until the next call)."""

    def __init__(self, ex, graph, max_len: int, device, *, enabled: bool = True, buckets=BUCKETS, backend=None):
        from deepinfer.runtime.session import allocate_caches

        self.ex, self.graph, self.max_len = ex, graph, max_len
        self.device = torch.device(device)
        self.buckets = sorted(set(buckets))
        self.max_bucket = self.buckets[-1]
        self.cache_names = [e["name"] for e in graph.meta.get("caches", [])]
        self._init = {e["name"]: e.get("init", 0) for e in graph.meta.get("caches", [])}
        self._allocate = lambda: allocate_caches(graph, max_len, device=self.device)
        self.vocab = int(graph.outputs[0].shape[-1])
        self.off_reason = None
        if not enabled:
            self.off_reason = "off (cuda_graphs=False)"
        elif backend is None and self.device.type != "cuda":
            self.off_reason = f"off (no CUDA graphs on {self.device})"
        elif backend is None:
            backend = CudaGraphBackend(self.device)
        self.backend = backend if self.off_reason is None else None
        self.slots: list[dict] = []
        self.padded: list[bool] = []  # slot j holds the padding step's inputs
        self.tok = torch.zeros(self.max_bucket, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(self.max_bucket, dtype=torch.long, device=self.device)
        self.logits = torch.zeros(self.max_bucket, self.vocab, dtype=torch.float32, device=self.device)
        # a graph with logit_rows (passes/select_logit_rows.py): every slot's one row, a static [0]
        self.rows = {ROWS_INPUT: torch.zeros(1, dtype=torch.long, device=self.device)} if has_logit_rows(graph) else {}
        self.graphs: dict[int, tuple] = {}
        self.failed: dict[int, str] = {}
        self.blocked: str | None = None  # the host-read check found ops that cannot be captured
        self.checked = False
        self.memo: dict = {}
        self.replays: Counter = Counter()
        self.capture_s: dict[int, float] = {}
        self.replay_err: dict[int, float] = {}
        self.warm_s: dict[int, float] = {}  # buckets captured (or tried) by warm_up: its seconds
        self.warm_errors: dict[int, str] = {}
        self.unchecked: set[int] = set()  # warmed up without the kernels' checks: the first real step runs eagerly
        self.dropped: list[str] = []  # graphs dropped: a kernel disabled after their capture
        self._disabled = DisabledSince(ex)
        self.eager_steps = 0
        self.batches = 0

    # -- slots -------------------------------------------------------------------------------------------
    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _ensure(self, n: int) -> None:
        while len(self.slots) < n:
            j = len(self.slots)
            self.slots.append({"tokens": self.tok[j : j + 1], "positions": self.pos[j : j + 1], **self.rows,
                               **self._allocate()})  # fmt: skip
            self.padded.append(True)  # allocated as a first step: token 0 at position 0 over initial caches

    def _write(self, tokens: list[int], positions: list[int], fill: Callable) -> None:
        n = len(tokens)
        host = torch.tensor([tokens, positions], dtype=torch.long)
        self.tok[:n].copy_(host[0], non_blocking=True)
        self.pos[:n].copy_(host[1], non_blocking=True)
        for j in range(n):
            fill(j, {k: self.slots[j][k] for k in self.cache_names})
            self.padded[j] = False

    def _pad(self, n: int, b: int) -> None:
        for j in range(n, b):
            if not self.padded[j]:
                self.tok[j] = 0
                self.pos[j] = 0
                for k in self.cache_names:
                    self.slots[j][k].fill_(self._init[k])
                self.padded[j] = True

    def _steps(self, n: int) -> list[dict]:
        out = []
        for j in range(n):
            res = self.ex.run(self.slots[j])
            self.logits[j].copy_(res[0][-1])
            out.append(dict(zip(self.cache_names, res[1 : 1 + len(self.cache_names)])))
        return out

    # -- running -----------------------------------------------------------------------------------------
    def run(self, tokens: list[int], positions: list[int], fill: Callable):
        n = len(tokens)
        if not 1 <= n <= self.max_bucket:
            raise ValueError(f"a decode batch of {n} (1..{self.max_bucket})")
        self.batches += 1
        b = self.bucket(n)
        use_graph = self.backend is not None and b not in self.failed and self.blocked is None
        self._ensure(b if use_graph else n)
        self._write(tokens, positions, fill)
        drop_stale_graphs(self, self._disabled)
        if use_graph and b in self.graphs and b not in self.unchecked:
            self._pad(n, b)
            handle, outs = self.graphs[b]
            self.backend.replay(handle, outs)
            self.replays[b] += 1
            return self.logits[:n].cpu(), outs[:n]
        self.eager_steps += 1
        caches = self._steps(n)  # with the kernels' first-call checks where a kernel has not had its own yet
        logits = self.logits[:n].cpu()
        drop_stale_graphs(self, self._disabled)  # a kernel those checks disabled: no graph may keep running it
        if use_graph and b in self.unchecked:  # a warmed bucket's first real step: checked, its graph kept
            self.unchecked.discard(b)
        elif use_graph:  # first use (or its graph dropped just now): captured with the kernels left
            self._capture(b, n, logits)
        return logits, caches

    def _capture(self, b: int, n: int, eager_logits: torch.Tensor) -> None:
        if not self.checked:
            self.checked = True
            self.blocked = self._check_host_reads()
            if self.blocked:
                return
        self._pad(n, b)
        saved = copy.deepcopy(self.ex.stats)  # captured node runs are not executions
        t0 = time.perf_counter()
        try:
            handle, outs = self.backend.capture(lambda: self._guarded_steps(b))
        except Exception as e:  # an op that still synchronises: this bucket stays eager, with the reason
            self.failed[b] = f"capture failed: {_one_line(e)}"
            with contextlib.suppress(Exception):
                self.backend.discard()
            return
        finally:
            self.ex.stats = saved
        self.capture_s[b] = time.perf_counter() - t0
        self.backend.replay(handle, outs)
        got = self.logits[:n].cpu()
        err = float((got - eager_logits).abs().max()) if got.numel() else 0.0
        scale = float(eager_logits.abs().max()) if got.numel() else 0.0
        self.replay_err[b] = err
        if not err <= REPLAY_TOL * max(scale, 1.0):  # NaN fails too
            self.failed[b] = f"replay differs from the eager step (max abs {err:.3g}, logits max {scale:.3g})"
            return
        self.graphs[b] = (handle, outs)

    def _guarded_steps(self, b: int) -> list[dict]:
        with HostSyncGuard(memo=self.memo):
            return self._steps(b)

    def warm_up(self) -> str:
        """Every bucket's first use now, on padding slots (warm_up_buckets), without the kernels' first-call checks
        (each warmed bucket's first real step runs them, eagerly); the one-line summary. The steps are functional
        (the slots' caches are inputs, not written), so the padding slots keep their initial values."""
        if self.backend is None:
            return f"decode graphs: nothing to warm up ({self.off_reason})"
        with checks_off(self.ex) as verify:
            line = warm_up_buckets(self, self._warm_one)
        if verify:
            self.unchecked |= {b for b in self.warm_s if b in self.graphs}
        return line

    def _warm_one(self, b: int) -> None:
        self._ensure(b)
        self._pad(0, b)
        self._steps(b)
        self._capture(b, b, self.logits[:b].cpu())

    def _check_host_reads(self) -> str | None:
        """One eager step of slot 0 recording every host read (and making the memoised host -> device copies
        before any capture); the reason capture cannot work, or None."""
        saved = copy.deepcopy(self.ex.stats)
        guard = HostSyncGuard(record=True, memo=self.memo)
        try:
            with guard:
                self.ex.run(self.slots[0])
        except Exception as e:
            return f"host-read check failed: {_one_line(e)}"
        finally:
            self.ex.stats = saved
        if not guard.hits:
            return None
        listed = "; ".join(f"{what} (x{k})" for what, k in guard.hits.most_common(4))
        more = f"; and {len(guard.hits) - 4} more" if len(guard.hits) > 4 else ""
        return f"decode step reads device values on the host: {listed}{more}"

    # -- report ------------------------------------------------------------------------------------------
    def report(self) -> str:
        head = f"decode graphs: {self.off_reason or 'on'}; buckets {', '.join(map(str, self.buckets))}; "
        head += f"static caches for max_model_len {self.max_len}"
        lines = [head]
        if self.blocked:
            lines.append(f"  not captured (every bucket eager): {self.blocked}")
        for b in self.buckets:
            if b in self.graphs:
                lines.append(f"  bucket {b:>2}: captured in {self.capture_s[b]:.2f} s{warm_note(self, b)}, "
                             f"{self.replays[b]} replays (capture check: max |replay - eager| "
                             f"{self.replay_err[b]:.2g})")  # fmt: skip
            elif b in self.failed:
                lines.append(f"  bucket {b:>2}: eager -- {self.failed[b]}")
            elif b in self.warm_errors:
                lines.append(f"  bucket {b:>2}: warm-up raised ({self.warm_errors[b]}); left to its first use")
        lines += [f"  graphs dropped: {why}" for why in self.dropped]
        lines.append(f"  decode batches: {self.batches}, {sum(self.replays.values())} replayed, "
                     f"{self.eager_steps} eager")  # fmt: skip
        return "\n".join(lines)


def warm_note(graphs, b: int) -> str:
    """A report's note on bucket b of DecodeGraphs / BatchedDecodeGraphs: captured at start, or at first use."""
    if b in graphs.warm_s and b not in graphs.warm_errors:
        return f" (warmed up at start: {graphs.warm_s[b]:.2f} s in all)"
    return " (at first use)"


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200] if msg else ''}"
