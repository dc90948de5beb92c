"""Kernel artifacts of a plan: every distinct kernel the bound nodes need, built and written beside plan.json.

    specs = kernel_specs(graph, "sm90", mode="bound")       # distinct (family, program, args, config)
    manifest = build_kernels(specs, "sm90", out_dir / "kernels", jobs=2)

Which kernels, for sm90 (the target with a runtime): the keys the engine's kernel adapters will look up
(engine_kernel_keys: runtime/kernel_adapters' own keys() driven on meta tensors of each node's input types, so
`deepinfer compile` builds exactly the programs the runtime's KernelCache asks for): its one-sequence step at the
plan's bucket lengths (select_kernels' decode T=1, small T=64, prefill T=4096) with caches of the engine's
max_model_len and the head on the last row, and its batched decode step at the engine's decode buckets.
``mode="all"`` adds the lengths of ``ALL_BUCKETS`` (1/16/64/256/1024/4096), under the plan's own bindings as
the runtime reads them. Families with no TileLang program (Triton kernels, compiled by Triton's JIT) and keys
that depend on device data are listed as not built, with the reason. Other targets (no runtime yet): the
bindings select_kernels recorded, shapes normalised by rule (rows padded to a power of two, at least one tile;
GEMM N padded to block_n); ``mode="all"`` re-binds a copy at ``ALL_BUCKETS``. ``none`` builds nothing.

The config: sm90, the adapter's (``source: "adapter"``; the runtime reads no tuning database, so a tuned
config would build a kernel it never loads); other targets, a tuning-database record (codegen/tuner.py) for
this family, shape bucket, target and toolkit versions when there is one (``"tuned"``), else the binding's
rule-based config (``"rule"``). The database is only read here: compile never tunes.

Per kernel: ``<name>.cu`` (``.cpp`` AscendC for ascend950, no cubin: bisheng is not available) and, for
CUDA targets, ``<name>.cubin`` compiled with the local nvcc, plus ``manifest.json`` with family, program,
args, kwargs, config, its source, the files' sha256 and the SASS matrix-instruction counts. Builds run in
a process pool, in two phases: lower every spec not on disk (longest first), then compile the distinct
sources in batches, one cicc per #include prelude (tilelang_backend.compile_cubins: nvcc's time is mostly the
headers) and the SASS counts of a batch from one disassembler process. Lowering is cached on disk by a hash
of the spec, the target, tilelang's version and the family's source files, and nvcc by tilelang_backend's
content hash, so an unchanged second compile only copies files.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import math
import os
import re
import shutil
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.errors import ConfigError

KERNEL_MODES = ("none", "bound", "all")
ALL_BUCKETS = {
    "decode": {"T": 1},
    "decode16": {"T": 16},
    "small": {"T": 64},
    "mid256": {"T": 256},
    "mid1024": {"T": 1024},
    "prefill": {"T": 4096},
}
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "deepinfer.kernels"
MIN_GEMM_ROWS = 64
SKIP_FAMILIES = {"view", "collective", "torch_ref"}
GEMM_DTYPE = "e4m3/ue8m0"  # the dtype the tuner records fp8 GEMMs under (tuner.TUNABLE)


SYMBOLIC = "sym"  # a spec name's stand-in for a symbolic dim (None in the runtime key: one build for every size)


@dataclass
class KernelSpec:
    family: str
    program: str
    args: tuple
    kwargs: dict
    config: dict
    source: str  # "tuned" | "rule"
    nodes: list = field(default_factory=list)  # graph values (first few) that use it
    key: object = None  # sm90: the runtime adapter's KernelKey this spec was derived from (built through it)

    def ident(self) -> str:
        return json.dumps([self.family, self.program, list(self.args), self.kwargs, self.config], sort_keys=True)

    @property
    def name(self) -> str:
        h = hashlib.sha256(self.ident().encode()).hexdigest()[:10]
        return f"{self.family}.{self.program}-{'x'.join(SYMBOLIC if a is None else str(a) for a in self.args)}-{h}"


def _rows(m: int, multiple: int) -> int:
    p = max(multiple, 1 << max(0, m - 1).bit_length())
    return -(-p // multiple) * multiple


def _tuned(family: str, shape: dict, target: str, db, versions) -> dict | None:
    from deepinfer.codegen.tuner import make_key

    if db is None:
        return None
    rec = db.get(make_key(family, shape, dtype=GEMM_DTYPE, target=target, versions=versions))
    return dict(rec["config"]) if rec else None


def _gemm_fields(cfg: dict) -> dict:
    from deepinfer.codegen.kernels import fp8_gemm

    return {k: cfg[k] for k in vars(fp8_gemm.Config()) if k in cfg}


def _spec_for(b: dict, attrs: dict, target: str, db, versions) -> KernelSpec | None:
    """One bucket's binding -> the kernel it needs (shapes normalised as the runtime adapters do)."""
    fam, prog, shape, cfg = b["family"], b["program"], b["shape"], b["config"]
    if fam == "fp8_gemm" and prog == "program":
        group = attrs["act_group"] or attrs["block"]
        tshape = {"M": shape["M"], "N": shape["N"], "K": shape["K"], "g": min(group, attrs["block"])}
        tuned = _tuned(fam, tshape, target, db, versions)
        c = _gemm_fields(tuned or cfg)
        rows = _rows(shape["M"], max(MIN_GEMM_ROWS, c["block_m"]))
        n_pad = -(-shape["N"] // c["block_n"]) * c["block_n"]
        kw = {"act_group": group, "weight_block": attrs["block"]}
        return KernelSpec(fam, prog, (rows, n_pad, shape["K"]), kw, c, "tuned" if tuned else "rule")
    if fam == "moe_grouped_gemm" and prog == "program":  # (not the decode swab_program: its own config fields)
        tshape = {"M": shape["M"], "N": shape["N"], "K": shape["K"], "g": attrs["block"]}
        tuned = _tuned(fam, tshape, target, db, versions)
        c = _gemm_fields(tuned or cfg)
        rows = _rows(shape["M"], c["block_m"])
        kw = {"act_group": attrs["block"], "weight_block": attrs["block"]}
        args = (rows, shape["N"], shape["K"], attrs["n_experts"])
        return KernelSpec(fam, prog, args, kw, c, "tuned" if tuned else "rule")
    if fam == "rmsnorm_quant":
        quant = bool(shape["quant"])
        kw = {"group": attrs["group"] if quant else 32, "quant": quant, "eps": float(attrs["eps"])}
        rows = _rows(shape["M"], max(cfg["block_m"], 16))
        return KernelSpec(fam, prog, (rows, shape["D"]), kw, dict(cfg), "rule")
    if fam == "hyper_connection" and prog == "pre_program":
        kw = {"eps": float(attrs["norm_eps"]), "hc_eps": float(attrs["hc_eps"]), "iters": int(attrs["sinkhorn_iters"])}
        return KernelSpec(fam, prog, (_rows(shape["T"], cfg["block_m"]), shape["D"]), kw, dict(cfg), "rule")
    if fam == "hyper_connection" and prog == "post_program":
        d, bd = shape["D"], cfg.get("block_d", 512)
        c = {**cfg, "block_d": bd if d % bd == 0 else math.gcd(d, bd)}  # as the runtime adapter narrows it
        return KernelSpec(fam, prog, (_rows(shape["T"], 16), d), {}, c, "rule")
    return None  # a family whose program arguments are not derived here yet (see report)


# ---------------------------------------------------------------------------------------------- sm90: runtime keys

ENGINE_MAX_MODEL_LEN = 4096  # the engine's default max_model_len: min(the model's max positions, 4096) (engine.py)
ENGINE_BATCH_SIZES = None  # the batched decode step's buckets (None: the engine's, runtime/cuda_graphs.BUCKETS)
TRITON_REASON = "Triton kernel (no TileLang program): compiled by Triton's JIT at its first launch"
# seconds the last sm90 kernel_specs spent deriving keys: the compiler calls build_kernels right after, whose
# manifest and summary line report it next to the lowering and nvcc times (what a cold compile's time is made of)
LAST_DERIVE_S = [0.0, False]  # [seconds, read from the cache]


def _meta_tensor(v, env: dict):
    """A shape-only stand-in for value v (the meta device: no memory, no data)."""
    import torch

    from deepinfer.ir.shapes import evaluate

    return torch.empty([evaluate(d, env) for d in v.shape], dtype=v.type.dtype.torch_dtype, device="meta")


class _MetaParams(dict):
    """The graph's parameters as meta tensors, made on first use (a 40-layer model has ~94k, mostly experts that
    only the first layer of each kind is asked about). Not restacked as the CUDA runner does (restack_experts):
    a restack changes where the experts' bytes live, not their shapes, and the adapters' keys read shapes only."""

    def __init__(self, graph):
        super().__init__()
        self.values = {p.name: p for p in graph.params}

    def __missing__(self, name: str):
        t = self[name] = _meta_tensor(self.values[name], {})
        return t


@dataclass
class _KeyWalk:
    """What one derivation found: the keys (first seen first) and, per family.op without a key, why."""

    keys: list = field(default_factory=list)
    nodes: dict = field(default_factory=dict)  # key -> the first graph values (node outputs) that asked for it
    why: dict = field(default_factory=dict)  # "family.op" -> reason (reported where no call of it gave a key)
    keyed: set = field(default_factory=set)  # "family.op" that gave at least one key
    missed: dict = field(default_factory=dict)  # "family.op at T=t" -> why its keys were not derived (always shown)
    input_types: dict = field(default_factory=dict)  # id(node) -> an int naming its inputs' types (hashed once)
    _interned: dict = field(default_factory=dict)

    def types_of(self, node) -> int:
        """The node's input types as one small int (a 40-layer MoE node has ~2300 inputs: hashing their types in
        every walk was ~0.5 s of a warm compile)."""
        key = id(node)
        if key not in self.input_types:
            types = tuple(None if v is None else v.type for v in node.inputs)
            self.input_types[key] = self._interned.setdefault(types, len(self._interned))
        return self.input_types[key]

    def add(self, where: str, keys: list, node: str) -> None:
        self.keyed.add(where)
        for k in keys:
            users = self.nodes.setdefault(k, [])
            if not users:
                self.keys.append(k)
            if len(users) < 4 and node not in users:
                users.append(node)

    def note(self, where: str, reason: str) -> None:
        self.why.setdefault(where, reason)

    def unkeyed(self) -> dict:
        return {**{k: v for k, v in sorted(self.why.items()) if k not in self.keyed}, **self.missed}


def _walk(ex, feeds: dict, walk: _KeyWalk) -> None:
    """The kernels executor ``ex`` would look up for these feeds: GraphExecutor's own steps, bindings and
    attributes, each node's adapter asked for its keys on meta tensors of the node's input types (the adapters'
    keys are shape functions: the same keys the runtime asks its KernelCache for, on CUDA tensors). Nodes alike
    in op, binding, attributes and input types (the layers) ask once."""
    from deepinfer.ir.interpreter import bind_symbols
    from deepinfer.passes.select_logit_rows import ROWS_SYMBOL
    from deepinfer.runtime import kernel_adapters as ka

    env = bind_symbols(ex.graph, feeds)
    t = int(feeds["tokens"].shape[0])
    n_rows = env.get(ROWS_SYMBOL)
    seen: set = set()
    for step in ex.steps:
        if step.rows and n_rows == 0:
            continue  # run_steps launches nothing there
        b = ex.binding(step.node, n_rows if step.rows else t)
        adapter = ka.adapter_for(b.get("family", ""), step.node.op)
        if adapter is None:
            continue
        attrs = ex._attrs(step.node, env)
        alike = (step.node.op, b["family"], repr(b.get("config")), repr(sorted(attrs.items())),
                 walk.types_of(step.node), step.rows)  # fmt: skip
        if alike in seen:
            continue
        seen.add(alike)
        args = [_meta_arg(v, feeds, ex.params, env) for v in step.node.inputs]
        call = ka.Call(step.node.op, attrs, args, step.inputs, step.param_inputs, b.get("config") or {},
                       ex.prep_cache)  # fmt: skip
        _ask(adapter, call, f"{b['family']}.{step.node.op}", t, walk, step.outputs[0])


def _meta_arg(v, feeds: dict, params: _MetaParams, env: dict):
    if v is None:
        return None
    if v.kind == "param":
        return params[v.name]
    return feeds[v.name] if v.name in feeds else _meta_tensor(v, env)


def _ask(adapter, call, where: str, t: int, walk: _KeyWalk, node: str) -> None:
    from deepinfer.runtime import kernel_adapters as ka

    try:
        keys = adapter.keys(call)
    except ka.Decline as e:
        walk.note(where, f"the adapter declines (the reference runs): {e}")
        return
    except Exception as e:  # a key that needs the data (a host read of a device value): left to the runtime
        msg = str(e).splitlines()[0][:120] if str(e) else ""
        walk.missed.setdefault(f"{where} at T={t}", f"kernel arguments need device data: {type(e).__name__}: {msg}")
        return
    if keys:
        walk.add(where, keys, node)
    else:
        walk.note(where, TRITON_REASON)


def _one_sequence_feeds(graph, t: int, cache_len: int, rows: int) -> dict:
    import torch

    from deepinfer.passes.select_logit_rows import ROWS_INPUT, has_logit_rows
    from deepinfer.runtime.session import allocate_caches

    feeds = {"tokens": torch.empty(t, dtype=torch.long, device="meta"),
             "positions": torch.empty(t, dtype=torch.long, device="meta"),
             **allocate_caches(graph, cache_len, device="meta")}  # fmt: skip
    if has_logit_rows(graph):
        feeds[ROWS_INPUT] = torch.empty(rows, dtype=torch.long, device="meta")
    return feeds


def _batched_feeds(single, b: int, max_model_len: int) -> dict:
    """BatchedDecoder.feeds for b sequences: [b, *shape] caches sized by max_model_len (the plan graph has no
    logit_rows: the batched step samples every sequence's row)."""
    import torch

    from deepinfer.runtime.session import allocate_caches

    caches = {k: v.expand(b, *v.shape) for k, v in allocate_caches(single, max_model_len, device="meta").items()}
    return {"tokens": torch.empty(b, dtype=torch.long, device="meta"),
            "positions": torch.empty(b, dtype=torch.long, device="meta"), **caches}  # fmt: skip


def engine_kernel_keys(graph, lengths, *, max_model_len: int = ENGINE_MAX_MODEL_LEN, batch_sizes=(),
                       cache_len: int | None = None, all_rows: bool = False,
                       with_nodes: bool = False) -> tuple:  # fmt: skip
    """The KernelKeys the sm90 engine (runtime/cuda_executor.CudaRunner) looks up for a plan graph: its
    one-sequence executor (the graph with logit_rows) at every T in ``lengths`` with caches of ``cache_len``
    tokens (default max_model_len, as the engine sizes them) and the head on the last row (a prefill samples it;
    ``all_rows``: every row, as a teacher-forced run computes them), and its batched decode step
    (passes/batch_decode) at every B in ``batch_sizes``; MAX_POSITIONS = max_model_len, the MoE activation
    groups from the plan. Nothing is computed: each adapter's keys() runs on meta tensors.
    Returns (keys, {family.op: why no key}) -- Triton families, declines, keys that need device data -- and with
    ``with_nodes`` {key: the first graph values that ask for it}; the keys in first-asked order."""
    from deepinfer.passes.select_logit_rows import rows_graph
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.cuda_executor import GraphExecutor

    walk = _KeyWalk()
    graph = _without_bulk_meta(graph)
    params = _MetaParams(graph)
    saved, ka.EMULATE = ka.EMULATE, True  # the adapters' "CUDA tensors only" check: meta tensors stand in
    try:
        runner_graph, _ = rows_graph(graph)
        ex = GraphExecutor(runner_graph, params, kernels=None, sync_free=True, max_positions=max_model_len)
        for t in sorted(set(lengths)):
            _walk(ex, _one_sequence_feeds(runner_graph, t, cache_len or max_model_len, t if all_rows else 1), walk)
        if batch_sizes:
            _walk_batched(graph, params, sorted(set(batch_sizes)), max_model_len, walk)
    finally:
        ka.EMULATE = saved
    if with_nodes:
        return walk.keys, walk.unkeyed(), walk.nodes
    return walk.keys, walk.unkeyed()


BULK_META = ("param_conversions", "memory")  # graph.meta records no executor or adapter reads


def _without_bulk_meta(graph):
    """A shallow copy of graph without BULK_META: rows_graph and batch_decode deep-copy the graph, meta included,
    and a 40-layer model's param_conversions alone is ~3.6 MB of lists (~0.4 s a copy)."""
    light = copy.copy(graph)
    light.meta = {k: v for k, v in graph.meta.items() if k not in BULK_META}
    return light


def _walk_batched(graph, params: _MetaParams, batch_sizes: list, max_model_len: int, walk: _KeyWalk) -> None:
    from deepinfer.errors import IRError
    from deepinfer.runtime.batched_decode import BatchedExecutor, decode_graph

    try:  # the graph BatchedDecoder runs (compact or flat pools, windows read from the written rings)
        batched = decode_graph(graph)
    except IRError as e:  # the engine then chains one-sequence steps (CudaRunner's fallback)
        walk.note("batched_decode", f"no batched decode graph (one-sequence steps at decode): {e}")
        return
    ex = BatchedExecutor(batched, params, kernels=None, sync_free="always", max_positions=max_model_len)
    for b in batch_sizes:
        _walk(ex, _batched_feeds(graph, b, max_model_len), walk)


def spec_of_key(key) -> KernelSpec:
    """A runtime KernelKey as a plan KernelSpec: its cfg fields are the spec's config, the rest its kwargs."""
    kw = dict(key.kwargs)
    cfg = dict(kw.pop("cfg", ()))
    return KernelSpec(key.family, key.program, tuple(key.args), kw, cfg, "adapter", key=key)


def kernel_specs(graph, target: str, mode: str = "bound", *, db=None,
                 max_model_len: int = ENGINE_MAX_MODEL_LEN) -> tuple[list[KernelSpec], dict]:  # fmt: skip
    """The distinct kernels the graph's bindings need; returns (specs, {family: reason} for the unbuilt).

    sm90 (the target with a runtime): the keys the engine's adapters look up (engine_kernel_keys) at the plan's
    bucket lengths (``all``: ALL_BUCKETS' lengths, still under the plan's bindings, which the runtime reads) and
    the batched decode step at the engine's decode buckets, caches sized by ``max_model_len``. Configs are the
    adapters' (the runtime reads no tuning database). Other targets: each binding's rule or tuned config."""
    from deepinfer.codegen.tuner import TuningDB, toolkit_versions

    if mode not in KERNEL_MODES:
        raise ConfigError(f"--kernels must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    if mode == "none" or target == "cpu":
        return [], {}
    meta = graph.meta.get("kernels")
    if not meta:
        raise ConfigError(f"the graph has no kernel bindings for {target} (select_kernels did not run)")
    if target == "sm90":
        t0 = time.perf_counter()
        out = _engine_specs(graph, mode, max_model_len)
        LAST_DERIVE_S[0] = time.perf_counter() - t0
        return out
    if mode == "all":
        from deepinfer.passes.select_kernels import select_kernels

        graph = copy.deepcopy(graph)
        select_kernels(graph, target=target, buckets=ALL_BUCKETS)
        meta = graph.meta["kernels"]
    db = db if db is not None else TuningDB()
    versions = toolkit_versions()
    by_node = {n.outputs[0].name: n for n in graph.nodes}
    specs: dict[str, KernelSpec] = {}
    skipped: dict[str, str] = {}
    for vname, rec in meta["nodes"].items():
        for b in rec["buckets"].values():
            if b["family"] in SKIP_FAMILIES:
                continue
            spec = _spec_for(b, by_node[vname].attrs, target, db, versions)
            if spec is None:
                skipped.setdefault(f"{b['family']}.{b['program']}", "program arguments not derived at compile time yet")
                continue
            spec = specs.setdefault(spec.ident(), spec)
            if len(spec.nodes) < 4 and vname not in spec.nodes:
                spec.nodes.append(vname)
    return sorted(specs.values(), key=lambda s: s.name), skipped


def engine_lengths(graph, mode: str) -> list[int]:
    """The one-sequence step lengths kernel_specs derives at: the plan's buckets (select_kernels' T), or for
    ``all`` ALL_BUCKETS' (the runtime binds them to the plan's nearest bucket, as it will at run time)."""
    buckets = graph.meta["kernels"]["buckets"] if mode == "bound" else ALL_BUCKETS
    return sorted({b["T"] for b in buckets.values()})


def _engine_specs(graph, mode: str, max_model_len: int) -> tuple[list[KernelSpec], dict]:
    from deepinfer.runtime import cuda_graphs as cg

    batch = cg.BUCKETS if ENGINE_BATCH_SIZES is None else ENGINE_BATCH_SIZES
    lengths = engine_lengths(graph, mode)
    path = _derived_keys_path(graph, lengths, max_model_len, batch)
    found = _load_derived_keys(path)
    LAST_DERIVE_S[1] = found is not None
    if found is None:
        found = engine_kernel_keys(graph, lengths, max_model_len=max_model_len, batch_sizes=batch, with_nodes=True)
        _save_derived_keys(path, *found)
    keys, why, nodes = found
    specs = {}
    for key in keys:
        spec = spec_of_key(key)
        specs.setdefault(spec.ident(), spec).nodes = list(nodes[key])
    return sorted(specs.values(), key=lambda s: s.name), why


# Where the derived keys come from, for their cache: the sources whose code decides them (the adapters, the
# executors and passes they run through, the kernels' config functions) and the switches the adapters read.
KEY_SOURCES = ("runtime", "codegen", "passes", "ir")
KEY_ENV_PREFIXES = ("DEEPINFER_", "TRITON_INTERPRET")
KEY_ENV_IGNORED = ("DEEPINFER_CODEGEN_CACHE",)


def _derived_keys_path(graph, lengths, max_model_len: int, batch) -> Path:
    """The cache file of engine_kernel_keys' result for this graph and these engine knobs: a warm compile of the
    40-layer V4.1 spends ~2.5 s deriving its keys, ~0.2 s hashing the graph to find them here."""
    from importlib.metadata import version

    import torch

    from deepinfer.codegen import tilelang_backend as tb

    h = hashlib.sha256(_graph_digest(graph))
    h.update(_key_sources_digest())
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(KEY_ENV_PREFIXES) and k not in KEY_ENV_IGNORED)
    h.update(json.dumps([list(lengths), max_model_len, list(batch), env, torch.__version__,
                         _tilelang_version(), version("triton")]).encode())  # fmt: skip
    return tb.cache_dir() / "engine_keys" / f"{h.hexdigest()[:32]}.json"


def _graph_digest(graph) -> bytes:
    """sha256 of what the derived keys depend on: graph_to_dict without BULK_META (no adapter reads it) and with the
    ~94k parameters as name, dtype and shape lines instead of JSON objects (the full JSON of the 40-layer V4.1 is
    15.7 MB: ~0.6 s to make and dump, a third of a warm compile's key lookup on 2 cores)."""
    from deepinfer.ir.serialize import graph_to_dict
    from deepinfer.ir.shapes import dim_str

    light = _without_bulk_meta(graph)
    light.params = []
    h = hashlib.sha256(json.dumps(graph_to_dict(light), separators=(",", ":")).encode())
    params = (f"{p.name}|{p.dtype.name}|{','.join(dim_str(d) for d in p.shape)}" for p in graph.params)
    h.update("\n".join(params).encode())
    return h.digest()


def _key_sources_digest() -> bytes:
    """sha256 of the KEY_SOURCES' .py files (paths and contents): an edited adapter or pass derives again."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for d in KEY_SOURCES:
        for f in sorted((root / d).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.digest()


def _as_tuples(x):
    """JSON's lists back to the tuples a KernelKey holds (every field of a key is hashable: no lists in it)."""
    return tuple(_as_tuples(v) for v in x) if isinstance(x, list) else x


def _load_derived_keys(path: Path):
    from deepinfer.runtime.kernel_adapters import KernelKey

    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    keys = [KernelKey(f, p, _as_tuples(a), _as_tuples(kw)) for f, p, a, kw in doc["keys"]]
    return keys, doc["why"], dict(zip(keys, doc["nodes"]))


def _save_derived_keys(path: Path, keys: list, why: dict, nodes: dict) -> None:
    from deepinfer.codegen import tilelang_backend as tb

    doc = {"keys": [[k.family, k.program, k.args, k.kwargs] for k in keys], "why": why,
           "nodes": [nodes[k] for k in keys]}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    tb._atomic_write(path, json.dumps(doc).encode())


# ---------------------------------------------------------------------------------------------- building


def _family_hash(family: str) -> str:
    h = hashlib.sha256()
    base = Path(__file__).parent / "kernels"
    for f in (base / f"{family}.py", base / "_common.py"):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _ascend_program(spec: KernelSpec, mod):
    """The family's Ascend 950 formulation (its own factory: the CUDA programs use SIMT threads)."""
    kw, cfg = spec.kwargs, spec.config
    if spec.family == "fp8_gemm":
        return mod.ascend_program(*spec.args, act_group=kw["act_group"], weight_block=kw["weight_block"],
                                  cfg=mod.Config(**cfg))  # fmt: skip
    if spec.family == "rmsnorm_quant" and not kw["quant"]:
        return mod.ascend_program(*spec.args, eps=kw["eps"], block_m=cfg["block_m"])
    if spec.family == "hyper_connection" and spec.program == "post_program":
        return mod.ascend_post_program(*spec.args, block_d=cfg["block_d"])
    raise ConfigError(f"no Ascend 950 program for {spec.family}.{spec.program}{' (quant)' if kw.get('quant') else ''}")


def _make_program(spec: KernelSpec, target: str):
    if spec.key is not None:  # the runtime's key: its own factory (the program the adapter's KernelCache builds)
        from deepinfer.runtime.kernel_adapters import _factory

        return _factory(spec.key, target)
    mod = importlib.import_module(f"deepinfer.codegen.kernels.{spec.family}")
    if target == "ascend950":
        return _ascend_program(spec, mod)
    kw = dict(spec.kwargs)
    if spec.program == "post_program":  # takes its config as keywords
        kw.update(spec.config)
    elif spec.config:
        cfg_cls = getattr(mod, "Config", None)
        if spec.family == "moe_grouped_gemm" or cfg_cls is None:
            from deepinfer.codegen.kernels.fp8_gemm import Config as cfg_cls
        kw["cfg"] = cfg_cls(**spec.config)
    return getattr(mod, spec.program)(*spec.args, target=target, **kw)


def _mma_counts(opcodes: dict) -> dict:
    return {op: n for op, n in sorted(opcodes.items()) if "MMA" in op}


_MAY_MMA = re.compile(r"mma|gemm", re.IGNORECASE)


def _tilelang_version() -> str | None:
    """tilelang's installed version without importing it (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tilelang")
    except PackageNotFoundError:
        return None


def cached_build(spec: KernelSpec, target: str, tl_version: str | None = None) -> dict | None:
    """build_one's result when its lowering, cubin and SASS counts are all on disk, else None -- checked in the
    calling process without importing tilelang, so a warm compile starts no worker processes (each would spend
    seconds importing torch and tilelang only to find its files cached). tl_version: _tilelang_version(), looked
    up once by the caller (a metadata lookup scans site-packages: 6 ms, 0.9 s over the 40-layer V4.1's kernels)."""
    from deepinfer.codegen.targets import get_target

    t0 = time.perf_counter()
    tl_version = tl_version or _tilelang_version()
    if tl_version is None:
        return None
    tgt = get_target(target)
    src = _spec_source_path(spec, target, tl_version)
    if not src.exists():
        return None
    out = {"name": spec.name, "source": str(src), "lower_cached": True}
    if tgt.is_cuda:
        found = _cached_cubin_counts(src, tgt)
        if found is None:
            return None
        out.update(cubin=str(found[0]), mma=json.loads(found[1].read_text()))
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _spec_source_path(spec: KernelSpec, target: str, tl_version: str) -> Path:
    """Where the spec's lowered source is cached: keyed by the spec, the target, tilelang's version and the
    family's source files."""
    from deepinfer.codegen import tilelang_backend as tb

    key = tb.content_hash(spec.ident(), target, tl_version, _family_hash(spec.family))
    return tb.cache_dir() / target / f"{spec.name}-{key}{'.cpp' if target == 'ascend950' else '.cu'}"


def _shared_source(text: str, target: str) -> Path:
    """The lowered text under a name of its content alone: what nvcc compiles, so specs that lower to the same
    source (the row count only in shapes that lowering drops, a table's size no index reaches: 57 of the 40-layer
    V4.1's 139 kernels) share one cubin and one SASS count."""
    from deepinfer.codegen import tilelang_backend as tb

    path = tb.cache_dir() / target / "by_source" / f"src-{tb.content_hash(text)}.cu"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tb._atomic_write(path, text.encode())
    return path


def _cached_cubin_counts(src: Path, tgt) -> tuple[Path, Path] | None:
    """(cubin, its SASS counts file) of the lowered source src if both are on disk (nothing is compiled)."""
    from deepinfer.codegen import tilelang_backend as tb

    cubin = tb.cached_cubin(_shared_source(src.read_text(), tgt.name), tgt)
    counts = cubin.with_suffix(".mma.json") if cubin is not None else None
    return (cubin, counts) if counts is not None and counts.exists() else None


class _CpuClock:
    """CPU seconds of this process and of its finished children (nvcc, cuobjdump) since the last lap: on a
    loaded machine the wall clock says little about what a build costs."""

    def __init__(self):
        self.last = self._now()

    @staticmethod
    def _now() -> tuple[float, float]:
        import resource

        ch = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time(), ch.ru_utime + ch.ru_stime

    def lap(self) -> float:
        now = self._now()
        spent = (now[0] - self.last[0]) + (now[1] - self.last[1])
        self.last = now
        return round(spent, 3)


def _device_spec(spec: KernelSpec) -> KernelSpec:
    """The spec with the keyword arguments its family declares grid-only (a module's GRID_ONLY_KWARGS: they reach
    the launch grid, not the device code) at the family's value: the same CUDA source, one lowering for them all."""
    import dataclasses

    mod = importlib.import_module(f"deepinfer.codegen.kernels.{spec.family}")
    neutral = getattr(mod, "GRID_ONLY_KWARGS", {}).get(spec.program, {})
    if not any(k in spec.kwargs and spec.kwargs[k] != v for k, v in neutral.items()):
        return spec
    kwargs = {k: neutral.get(k, v) for k, v in spec.kwargs.items()}
    key = spec.key
    if key is not None:
        key = dataclasses.replace(key, kwargs=tuple((k, neutral.get(k, v)) for k, v in key.kwargs))
    return dataclasses.replace(spec, kwargs=kwargs, key=key)


def _lower_by_program(spec: KernelSpec, target: str, tgt, tl_version: str, defer: bool = False) -> str | None:
    """The spec's lowered source, cached by the program's TIR text (+ target, tilelang): keys that differ only in
    arguments the program does not read (a symbolic dim's bucket, sparse_attn_decode's batch and pools) lower
    once. While a process lowers a program its cache file has a ``.lowering`` mark beside it; ``defer``: another
    process holds that mark, so None (the caller comes back when the cache has the text) instead of a second
    lowering of the same program at the same time (0.1-8 CPU s)."""
    from deepinfer.codegen import tilelang_backend as tb

    prog = _make_program(_device_spec(spec), target)
    ext = ".cpp" if target == "ascend950" else ".cu"
    path = tb.cache_dir() / target / "by_program" / f"tir-{tb.content_hash(prog.script(), target, tl_version)}{ext}"
    if path.exists():
        return path.read_text()
    path.parent.mkdir(parents=True, exist_ok=True)
    mark = path.with_suffix(".lowering")
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        if defer:
            return None
    try:  # not deferring: lower even under another's mark (one left by an interrupted compile, say)
        text = tb.lower(prog, tgt)
        tb._atomic_write(path, text.encode())
    finally:
        mark.unlink(missing_ok=True)
    return text


def lower_one(spec: KernelSpec, target: str, defer: bool = False) -> dict:
    """Worker: the spec's lowered source (cached by spec hash, then by program text), written to the cache.
    Returns its path, wall and CPU seconds, or the error; with ``defer`` {"deferred": True} when another process
    is lowering the same program (_lower_by_program)."""
    import tilelang

    from deepinfer.codegen import tilelang_backend as tb
    from deepinfer.codegen.targets import get_target

    t0 = time.perf_counter()
    clock = _CpuClock()
    try:
        src = _spec_source_path(spec, target, str(tilelang.__version__))
        hit = src.exists()
        if not hit:
            text = _lower_by_program(spec, target, get_target(target), str(tilelang.__version__), defer)
            if text is None:
                return {"name": spec.name, "deferred": True}
            src.parent.mkdir(parents=True, exist_ok=True)
            tb._atomic_write(src, text.encode())
    except Exception as e:  # recorded in the manifest; the node then runs its fallback at run time
        return {"name": spec.name, "error": _one_line(e)}
    return {"name": spec.name, "source": str(src), "lower_cached": hit, "lower_s": round(time.perf_counter() - t0, 3),
            "cpu": {"lower": clock.lap()}}  # fmt: skip


def _one_line(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[-1][:300] if msg else ''}"


def compile_batch(sources: list[str], target: str) -> dict:
    """Worker: cubins and SASS matrix-instruction counts of lowered sources (content-named, _shared_source):
    tilelang_backend.compile_cubins (one cicc per #include prelude, ptxas per source), then the counts of the
    sources that name an MMA or GEMM from one disassembler process. Returns {"cubins": {source: cubin path or
    {"error": ...}}, "wall": seconds, "cpu": {"nvcc": .., "sass": ..}}."""
    from deepinfer.codegen import tilelang_backend as tb
    from deepinfer.codegen.targets import get_target

    t0 = time.perf_counter()
    clock, tgt = _CpuClock(), get_target(target)
    try:
        built = tb.compile_cubins([Path(s) for s in sources], tgt)
    except Exception as e:  # not one source's nvcc error (compile_cubins reports those): every source fails
        built = {Path(s): _one_line(e) for s in sources}
    cpu = {"nvcc": clock.lap()}
    cubins = {str(s): {"error": c} if isinstance(c, str) else {"cubin": str(c)} for s, c in built.items()}
    todo = [(s, Path(c["cubin"])) for s, c in cubins.items() if "cubin" in c]
    todo = [(s, c) for s, c in todo if not c.with_suffix(".mma.json").exists()]
    may = [(s, c) for s, c in todo if _MAY_MMA.search(Path(s).read_text())]
    counts = dict(zip([c for _, c in may], tb.count_opcodes_many([c for _, c in may], tgt), strict=True))
    for _, cubin in todo:  # a source that names no MMA or GEMM has none: {} without disassembling it
        tb._atomic_write(cubin.with_suffix(".mma.json"), json.dumps(_mma_counts(counts.get(cubin, {}))).encode())
    cpu["sass"] = clock.lap()
    return {"cubins": cubins, "wall": round(time.perf_counter() - t0, 3), "cpu": cpu}


# What one lowering costs (CPU s on a 2-core Xeon, session 10; tilelang 0.1.15), by family.program: the order in
# which the process pool takes the specs (longest first, so no long lowering starts last). Only an ordering:
# a family not listed counts DEFAULT_LOWER_S.
LOWER_COST_S = {
    "sparse_attn_decode.program": 6.0,
    "topk_select.program": 5.0,
    "moe_grouped_gemm.program": 2.0,
    "fp8_gemm.program": 1.7,
    "hyper_connection.pre_program": 1.8,
    "hyper_connection.pre_partial_program": 1.7,
    "rope.program": 0.9,
    "moe_grouped_gemm.swab_program": 0.8,
}
DEFAULT_LOWER_S = 0.3


def longest_first(items: list, key) -> list:
    """items by their family.program's LOWER_COST_S, largest first; within one family spread_families' order
    (two processes seldom lower the same program at once: the TIR-keyed cache then answers the second)."""
    spread = spread_families(items, key)
    rank = {id(it): n for n, it in enumerate(spread)}
    return sorted(spread, key=lambda it: (-LOWER_COST_S.get(key(it), DEFAULT_LOWER_S), rank[id(it)]))


def spread_families(items: list, key) -> list:
    """items reordered so each family (key(item)) spreads evenly over the list: two workers seldom lower or nvcc
    the same program at once (the caches above then answer the second), and a long family does not come last."""
    counts = Counter(key(it) for it in items)
    seen: Counter = Counter()
    ranked = []
    for n, it in enumerate(items):
        fam = key(it)
        ranked.append(((seen[fam] + 0.5) / counts[fam], fam, n, it))
        seen[fam] += 1
    return [r[-1] for r in sorted(ranked, key=lambda r: r[:3])]


NVCC_HEADER_CHARS = 100_000  # a batch's fixed nvcc cost (its #include prelude: ~1.5 CPU s) in source characters


def plan_batches(sources: list[Path], jobs: int) -> list[list[Path]]:
    """Lowered sources into compile_batch calls: one per #include prelude (compile_cubins' groups), a large
    group split so that the batches spread over ``jobs`` processes; largest first (nvcc's time goes with the
    source's length: ~10-15 us a character on top of the prelude's ~1.5 s)."""
    from deepinfer.codegen import tilelang_backend as tb

    groups: dict[str, list[tuple[int, Path]]] = {}
    for src in dict.fromkeys(sources):
        text = src.read_text()
        try:
            prelude = tb.split_source(text)[0]
        except tb.BatchError:
            prelude = f"\0{src}"  # compiled alone
        groups.setdefault(prelude, []).append((len(text), src))
    share = max(1.0, (sum(n for g in groups.values() for n, _ in g) + NVCC_HEADER_CHARS * len(groups)) / jobs)
    batches = []
    for group in groups.values():
        k = max(1, min(len(group), round(sum(n for n, _ in group) / share)))
        bins: list[list] = [[0, []] for _ in range(k)]
        for n, src in sorted(group, key=lambda x: -x[0]):  # largest source into the lightest bin
            light = min(bins, key=lambda b: b[0])
            light[0] += n
            light[1].append(src)
        batches += bins
    return [b[1] for b in sorted(batches, key=lambda b: -b[0])]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def usable_cores() -> int:
    """The cores this process may run on (taskset / cgroup affinity), not the machine's: the default number of
    build processes (os.cpu_count() is 32 on the H200 host even under `taskset -c 0,1`)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity API (macOS)
        return os.cpu_count() or 1


class _Workers:
    """map() in ``jobs`` spawned processes (one pool for the lowering and the nvcc phases: each process imports
    torch and tilelang once), or in this process when jobs is 1."""

    def __init__(self, jobs: int):
        self.jobs, self.pool = jobs, None

    def __enter__(self):
        if self.jobs > 1:
            import multiprocessing as mp

            self.pool = ProcessPoolExecutor(self.jobs, mp_context=mp.get_context("spawn"))
        return self

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.shutdown()

    def map(self, fn, items: list, *args) -> list:
        if self.pool is None or len(items) <= 1:
            return [fn(it, *args) for it in items]
        return list(self.pool.map(fn, items, *[[a] * len(items) for a in args]))


def build_kernels(specs: list[KernelSpec], target: str, out_dir: Path, *, jobs: int | None = None,
                  mode: str = "bound", skipped: dict | None = None,
                  max_model_len: int | None = None) -> dict:  # fmt: skip
    """Build every spec and copy its files into out_dir; returns the manifest (also written). Two phases in one
    process pool: lower the specs not on disk (longest first), then compile their distinct sources in batches
    (plan_batches / compile_batch). max_model_len: the engine's the sm90 specs were derived for (recorded)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    clock = _CpuClock()
    tl_version = _tilelang_version()
    results = [cached_build(s, target, tl_version) for s in specs]
    todo = longest_first([i for i, r in enumerate(results) if r is None], key=lambda i: _cost_key(specs[i]))
    jobs = max(1, min(jobs or usable_cores(), len(todo) or 1))
    batches: list = []
    with _Workers(jobs) as workers:
        for i, res in zip(todo, workers.map(lower_one, [specs[i] for i in todo], target, jobs > 1), strict=True):
            results[i] = res
        later = [i for i in todo if results[i].get("deferred")]  # their program was being lowered: cached now
        for i, res in zip(later, workers.map(lower_one, [specs[i] for i in later], target), strict=True):
            results[i] = res
        if todo and _is_cuda(target):
            batches = _compile_lowered([results[i] for i in todo], target, jobs, workers)
    entries = [_entry(spec, res, out_dir) for spec, res in zip(specs, results, strict=True)]
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": 1,
        "target": target,
        "mode": mode,
        "jobs": jobs,
        "build_s": round(time.perf_counter() - t0, 3),
        "phases_s": _phases(target, [results[i] for i in todo], batches, clock.lap()),
        "kernels": entries,
        "not_built": skipped or {},
        **({"max_model_len": max_model_len} if max_model_len else {}),
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _cost_key(spec: KernelSpec) -> str:
    return f"{spec.family}.{spec.program}"


def _is_cuda(target: str) -> bool:
    from deepinfer.codegen.targets import get_target

    return get_target(target).is_cuda


def _compile_lowered(lowered: list[dict], target: str, jobs: int, workers: _Workers) -> list[dict]:
    """The nvcc phase: each lowered result gets its cubin and SASS counts (or an error); returns the batches'
    reports. The sources go by content (_shared_source: specs that lower alike share one cubin); each batch's
    wall and CPU seconds are shared among its sources by length (what one source cost alone is not measured)."""
    ok = [r for r in lowered if "error" not in r]
    shared = {id(r): _shared_source(Path(r["source"]).read_text(), target) for r in ok}
    batches = plan_batches(list(shared.values()), jobs)
    reports = workers.map(compile_batch, [[str(s) for s in b] for b in batches], target)
    per_source: dict[str, dict] = {}
    for batch, rep in zip(batches, reports, strict=True):
        sizes = {str(s): len(s.read_text()) for s in batch}
        total = sum(sizes.values()) or 1
        for s, built in rep["cubins"].items():
            share = sizes[s] / total
            per_source[s] = {**built, "wall": rep["wall"] * share, "cpu": {k: v * share for k, v in rep["cpu"].items()}}
    charged: set = set()  # a source's cost is charged to the first spec that uses it
    for r in ok:
        s = str(shared[id(r)])
        built = per_source[s]
        if "error" in built:
            r["error"] = built["error"]
            continue
        cubin = Path(built["cubin"])
        r.update(cubin=str(cubin), mma=json.loads(cubin.with_suffix(".mma.json").read_text()))
        first = s not in charged
        charged.add(s)
        r["nvcc_s"] = round(built["wall"], 3) if first else 0.0
        r["cpu"].update({k: round(v, 3) if first else 0.0 for k, v in built["cpu"].items()})
    return reports


def _entry(spec: KernelSpec, res: dict, out_dir: Path) -> dict:
    """The manifest entry of one spec: its files copied into out_dir with their sha256."""
    ent = {"name": spec.name, "family": spec.family, "program": spec.program, "args": list(spec.args)}
    ent.update(kwargs=spec.kwargs, config=spec.config, config_source=spec.source, nodes=spec.nodes)
    if "error" in res:
        ent["error"] = res["error"]
        return ent
    files = {}
    src = Path(res["source"])
    for kind, path in (("source", src), ("cubin", Path(res["cubin"]) if "cubin" in res else None)):
        if path is None:
            continue
        dest = out_dir / f"{spec.name}{'.cubin' if kind == 'cubin' else src.suffix}"
        shutil.copyfile(path, dest)
        files[kind] = {"file": dest.name, "sha256": sha256_file(dest)}
    seconds = res.get("seconds", res.get("lower_s", 0.0) + res.get("nvcc_s", 0.0))
    ent.update(files=files, lower_cached=res["lower_cached"], build_s=round(seconds, 3))
    if "cpu" in res:
        ent["cpu_s"] = res["cpu"]
    if "mma" in res:
        ent["sass_mma"] = res["mma"]
    return ent


def _phases(target: str, built: list, batches: list, cpu_total: float) -> dict:
    """Seconds by phase: key derivation (sm90), and over the kernels built in this call lowering (summed over
    the processes) and nvcc + SASS counts (summed over the batches), wall and CPU (the CPU seconds of lowering,
    nvcc, SASS counts); cpu_total: every CPU second of build_kernels, this process's and its workers' (their
    start-up and imports included: what a loaded machine must find)."""
    ok = [r for r in built if "error" not in r]
    derive, LAST_DERIVE_S[0] = LAST_DERIVE_S[0], 0.0  # read once: a later build_kernels call derived nothing
    cpu = Counter()
    for r in ok:
        cpu.update(r.get("cpu", {}))
    return {"derive": round(derive, 3) if target == "sm90" else 0.0, "derive_cached": bool(LAST_DERIVE_S[1]),
            "lower": round(sum(r["lower_s"] for r in ok), 3), "nvcc": round(sum(b["wall"] for b in batches), 3),
            "built": len(built), "batches": len(batches), "cpu": {k: round(v, 3) for k, v in cpu.items()},
            "cpu_total": round(cpu_total, 3)}  # fmt: skip


TOP_BUILDS = 10  # the summary names the costliest builds of a compile


def _costliest(ents: list) -> list[str]:
    """The TOP_BUILDS builds of this compile with the most CPU seconds (lowering + nvcc + SASS counts): where a
    cold compile's time goes. Nothing for a warm compile."""
    built = sorted((e for e in ents if "cpu_s" in e and not e.get("lower_cached")),
                   key=lambda e: -sum(e["cpu_s"].values()))[:TOP_BUILDS]  # fmt: skip
    if not built:
        return []
    rows = [f"    {sum(e['cpu_s'].values()):6.1f} s  {e['name']} ("
            + ", ".join(f"{k} {v:.1f}" for k, v in e["cpu_s"].items()) + ")" for e in built]  # fmt: skip
    return [
        "  costliest builds (CPU seconds: lowering, then nvcc and SASS counts as this source's share of its batch;"
        " 0 where a cache answered):",
        *rows,
    ]


def format_manifest(manifest: dict) -> str:
    ents = manifest["kernels"]
    ok = [e for e in ents if "error" not in e]
    cached = sum(bool(e.get("lower_cached")) for e in ok)
    # tuned: a tuning-database record; rule: the binding's config; adapter: the sm90 runtime adapter's key
    sources = Counter(e["config_source"] for e in ents)
    lines = [
        f"kernels ({manifest['mode']}, {manifest['target']}): {len(ok)}/{len(ents)} built in "
        f"{manifest['build_s']:.1f} s on {manifest['jobs']} processes ({cached} lowerings cached; "
        f"configs: {', '.join(f'{n} {src}' for src, n in sorted(sources.items())) or 'none'})"
    ]
    ph = manifest.get("phases_s")
    if ph:
        how = "read from the cache" if ph.get("derive_cached") else "derived"
        cpu = ", ".join(f"{k} {v:.1f} s" for k, v in (ph.get("cpu") or {}).items())
        batches = f" in {ph['batches']} batches" if ph.get("batches") else ""
        total = f"; all CPU of the build (start-up included) {ph['cpu_total']:.1f} s" if "cpu_total" in ph else ""
        lines.append(f"  phases: keys {how} in {ph['derive']:.1f} s; {ph['built']} kernels not on disk: lowering "
                     f"{ph['lower']:.1f} s, nvcc + SASS {ph['nvcc']:.1f} s{batches} (summed over the processes)"
                     + (f"; CPU {cpu}" if cpu else "") + total)  # fmt: skip
    lines += _costliest(ents)
    lines += [f"  failed: {e['name']}: {e['error']}" for e in ents if "error" in e]
    lines += [f"  not built: {k}: {v}" for k, v in manifest.get("not_built", {}).items()]
    return "\n".join(lines)
