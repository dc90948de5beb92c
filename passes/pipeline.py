"""The pass manager: numbered phases of named passes, the verifier after each, timings, IR dumps, a report.

    g2, report = run_pipeline(g)                          # the default pipeline
    g2, report = run_pipeline(g, Pipeline.default().with_phase("fuse", ["fuse_swiglu"]), dump_ir="/tmp/ir")
    print(report.format())

A pass is a function ``Graph -> Graph`` (it may mutate and return its argument; the pipeline works on a copy)
or a class with ``__call__(self, graph)``, registered once with ``@register_pass("name")``. A pipeline is data:
for each phase, a list of entries, each a pass name or ``(name, {option: value})`` for passes that take
options (``("specialize_shapes", {"T": 1})``). A target config changes it with ``Pipeline.from_config``.

Phases follow MLC-LLM's ``compiler_pass/pipeline.py`` shape: canonicalise, quantise, fuse, lay out for
parallelism, select kernels, plan memory. Empty phases are places for passes still to come.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.errors import ConfigError, DeepInferError, VerificationError
from deepinfer.ir.graph import Graph
from deepinfer.ir.printer import print_graph
from deepinfer.ir.verifier import check
from deepinfer.passes.pattern import clone_graph

PHASES = ("canonicalize", "quantize", "fuse", "parallel", "select_kernels", "plan_memory")

# The default order. dce runs after the passes that leave dead producers behind (folding, fusion) so
# every pass sees a clean graph and the node counts in the report mean something.
DEFAULT_PHASES: dict[str, list] = {
    "canonicalize": ["dce", "cse", "fold_constants", "dce"],
    "quantize": ["quantize_activations", "convert_fp4_to_fp8"],  # both off by default: options turn them on
    "fuse": [
        "fuse_rmsnorm_quant",
        "fuse_swiglu",
        "fuse_moe_gate",
        "fuse_attention",
        "fuse_hyper_connection",
        "fuse_out_proj",
        "fuse_moe_experts",
        "fuse_compressor",
        "dce",
    ],
    "parallel": [],  # filled per rank by parallel_layout.layout_pipeline(layout, rank) when a layout is given
    "select_kernels": ["select_kernels", "check_batch_invariance"],  # the check is a no-op unless batch-invariant
    "plan_memory": ["plan_memory"],
}

DUMP_ENV = "DEEPINFER_DUMP_IR"


# ---------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------


@dataclass
class PassDef:
    name: str
    fn: Callable[..., Graph]
    doc: str = ""


_PASSES: dict[str, PassDef] = {}


def register_pass(name: str):
    """Decorator for a pass: a function ``(graph, **options) -> graph``, or a class run as ``cls(**opts)(graph)``."""

    def deco(obj):
        if name in _PASSES:
            raise ConfigError(f"pass {name!r} registered twice")
        fn = obj if not isinstance(obj, type) else (lambda g, _cls=obj, **kw: _cls(**kw)(g))
        _PASSES[name] = PassDef(name, fn, (obj.__doc__ or "").strip().split("\n")[0])
        return obj

    return deco


def get_pass(name: str) -> PassDef:
    _ensure_loaded()
    try:
        return _PASSES[name]
    except KeyError:
        known = ", ".join(sorted(_PASSES))
        raise ConfigError(f"unknown pass {name!r} (known: {known})") from None


def all_passes() -> dict[str, PassDef]:
    _ensure_loaded()
    return dict(_PASSES)


_LOADED = False


def _ensure_loaded() -> None:
    """Import the modules that register passes (once); a new pass file is added to this list."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        from deepinfer.passes import (  # noqa: F401
            cache_storage,
            check_batch_invariance,
            context_parallel,
            convert_fp4_to_fp8,
            cse,
            dce,
            expert_parallel,
            fold_constants,
            fold_qdq,
            fuse_attention,
            fuse_compressor,
            fuse_hyper_connection,
            fuse_moe_experts,
            fuse_moe_gate,
            fuse_out_proj,
            fuse_rmsnorm_quant,
            fuse_swiglu,
            parallel_layout,
            plan_memory,
            quantize_activations,
            select_kernels,
            specialize_shapes,
        )


# ---------------------------------------------------------------------------------------------------
# Pipelines as data
# ---------------------------------------------------------------------------------------------------


def _phase_key(key: str | int) -> str:
    if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
        i = int(key)
        if not 0 <= i < len(PHASES):
            raise ConfigError(f"pipeline: phase {i} does not exist (0..{len(PHASES) - 1})")
        return PHASES[i]
    if key not in PHASES:
        raise ConfigError(f"pipeline: unknown phase {key!r} (phases: {', '.join(PHASES)})")
    return key


def _entry(e: Any) -> tuple[str, dict]:
    """A pipeline entry: "name", ("name", {options}) or {"pass": "name", **options}."""
    if isinstance(e, str):
        return e, {}
    if isinstance(e, list | tuple) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], Mapping):
        return e[0], dict(e[1])
    if isinstance(e, Mapping) and isinstance(e.get("pass"), str):
        return e["pass"], {k: v for k, v in e.items() if k != "pass"}
    raise ConfigError(f"pipeline: entry {e!r} is not a pass name, (name, options) or {{'pass': name, ...}}")


@dataclass
class Pipeline:
    phases: dict[str, list[tuple[str, dict]]] = field(default_factory=dict)

    @classmethod
    def default(cls) -> Pipeline:
        return cls.from_config({"phases": DEFAULT_PHASES})

    @classmethod
    def from_config(cls, cfg: Mapping, base: Pipeline | None = None) -> Pipeline:
        """``{"phases": {phase name or number: [entries]}}``; phases not named keep ``base``'s (default: empty)."""
        phases = {p: list(base.phases.get(p, [])) if base else [] for p in PHASES}
        raw = cfg.get("phases", {}) if isinstance(cfg, Mapping) else None
        if not isinstance(raw, Mapping):
            raise ConfigError("pipeline: 'phases' must map phase names to lists of passes")
        for key, entries in raw.items():
            if not isinstance(entries, list | tuple):
                raise ConfigError(f"pipeline: phase {key!r} must be a list of passes")
            phases[_phase_key(key)] = [_entry(e) for e in entries]
        pipe = cls(phases)
        pipe.validate()
        return pipe

    def with_phase(self, phase: str | int, entries: Iterable) -> Pipeline:
        return Pipeline.from_config({"phases": {phase: list(entries)}}, base=self)

    def validate(self) -> None:
        for _phase, name, _opts in self.steps():
            get_pass(name)

    def steps(self) -> list[tuple[str, str, dict]]:
        return [(p, name, opts) for p in PHASES for name, opts in self.phases.get(p, [])]

    def to_config(self) -> dict:
        return {"phases": {p: [n if not o else [n, o] for n, o in e] for p, e in self.phases.items()}}


# ---------------------------------------------------------------------------------------------------
# Running and reporting
# ---------------------------------------------------------------------------------------------------


@dataclass
class PassRecord:
    index: int
    phase: str
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    added: dict[str, int]
    removed: dict[str, int]

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)


@dataclass
class PassReport:
    records: list[PassRecord] = field(default_factory=list)

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def by_name(self, name: str) -> list[PassRecord]:
        return [r for r in self.records if r.name == name]

    def format(self) -> str:
        """The table ``deepinfer compile --verbose`` prints."""
        lines = [f"{'#':>3} {'phase':<15} {'pass':<22} {'ms':>8} {'nodes':>11}  changes"]
        for r in self.records:
            changes = [f"-{n} {op}" for op, n in r.removed.items()] + [f"+{n} {op}" for op, n in r.added.items()]
            nodes = f"{r.nodes_before}->{r.nodes_after}"
            row = f"{r.index:>3} {r.phase:<15} {r.name:<22} {r.seconds * 1e3:>8.2f} {nodes:>11}"
            lines.append(f"{row}  {', '.join(changes) or '-'}")
        lines.append(f"total {self.total_seconds * 1e3:.2f} ms")
        return "\n".join(lines)


def _op_diff(before: dict[str, int], after: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    added = {op: after[op] - before.get(op, 0) for op in after if after[op] > before.get(op, 0)}
    removed = {op: before[op] - after.get(op, 0) for op in before if before[op] > after.get(op, 0)}
    return added, removed


def _dump(dump_dir: Path | None, index: int, phase: str, name: str, g: Graph, note: str) -> None:
    if dump_dir is None:
        return
    path = dump_dir / f"{index:02d}-{phase}-{name}.dil"
    # '#' lines are comments to the parser, so a dump still parses back with ir.parser.parse_graph.
    path.write_text(f"# {note}\n" + print_graph(g))


def run_pass(g: Graph, name: str, options: dict | None = None, *, verify: bool = True) -> Graph:
    """Run one pass by name; with ``verify`` the verifier checks the result and names the pass if it fails."""
    out = get_pass(name).fn(g, **(options or {}))
    if not isinstance(out, Graph):
        raise ConfigError(f"pass {name!r} returned {type(out).__name__}, not a Graph")
    if verify:
        errors = check(out, first_only=True)
        if errors:
            raise VerificationError(f"after pass {name!r}: graph {out.name!r}: {errors[0]}")
    return out


def run_pipeline(
    g: Graph,
    pipeline: Pipeline | Mapping | None = None,
    *,
    dump_ir: str | os.PathLike | None = None,
    verify: bool | str = True,
    copy_graph: bool = True,
) -> tuple[Graph, PassReport]:
    """Run every pass of every phase in order. The input graph is left as it was (passes work on a copy).

    ``verify``: the verifier checks the final graph; if it (or any pass) fails, the pipeline is replayed from
    the input with the verifier after every pass, so the error names the first pass that broke the graph.
    Passes are deterministic, so the replay meets the same failure; checking after every pass up front would
    cost ~2 s of a real 40-layer compile for an answer only a failure needs. ``verify="each"`` does the replay's
    per-pass checking from the start (``--verify-each`` style debugging)."""
    if verify and verify != "each" and copy_graph:  # without a copy the input is gone: no replay, check each
        try:
            out, report = _run_steps(g, pipeline, dump_ir, verify_each=False, copy_graph=True)
            if not check(out, first_only=True):
                return out, report
        except DeepInferError:
            pass
    return _run_steps(g, pipeline, dump_ir, verify_each=bool(verify), copy_graph=copy_graph)


def _run_steps(g: Graph, pipeline, dump_ir, *, verify_each: bool, copy_graph: bool) -> tuple[Graph, PassReport]:
    if pipeline is None:
        pipe = Pipeline.default()
    else:
        pipe = pipeline if isinstance(pipeline, Pipeline) else Pipeline.from_config(pipeline)
    pipe.validate()  # an unknown name fails before any work is done
    dump_dir = dump_ir if dump_ir is not None else os.environ.get(DUMP_ENV) or None
    if dump_dir is not None:
        dump_dir = Path(dump_dir)
        dump_dir.mkdir(parents=True, exist_ok=True)
    g = clone_graph(g) if copy_graph else g
    _dump(dump_dir, 0, "input", "graph", g, f"input graph: {len(g.nodes)} nodes")
    report = PassReport()
    for i, (phase, name, opts) in enumerate(pipe.steps(), start=1):
        before, n_before = g.op_counts(), len(g.nodes)
        t0 = time.perf_counter()
        try:
            g = run_pass(g, name, opts, verify=False)
        except DeepInferError as e:
            raise type(e)(f"pass {name!r} ({phase}): {e}") from e
        dt = time.perf_counter() - t0
        if verify_each:
            errors = check(g, first_only=True)
            if errors:
                raise VerificationError(f"after pass {name!r} ({phase}): graph {g.name!r}: {errors[0]}")
        added, removed = _op_diff(before, g.op_counts())
        report.records.append(PassRecord(i, phase, name, dt, n_before, len(g.nodes), added, removed))
        note = f"pass {i} {phase}/{name}: {dt * 1e3:.2f} ms, nodes {n_before} -> {len(g.nodes)}"
        _dump(dump_dir, i, phase, name, g, note)
    if dump_dir is not None:
        (dump_dir / "report.txt").write_text(report.format() + "\n")
    return g, report


__all__ = [
    "DEFAULT_PHASES",
    "PHASES",
    "PassDef",
    "PassRecord",
    "PassReport",
    "Pipeline",
    "all_passes",
    "get_pass",
    "register_pass",
    "run_pass",
    "run_pipeline",
]
