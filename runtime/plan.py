"""A compiled plan on disk: ``plan.json`` (+ ``report.txt``), written atomically, read back with checks.

plan.json holds: format/version, the model name and its config, the target, where the weights come from (a
checkpoint directory, or random weights from a seed), the pass pipeline that produced the graph, and the
optimised graph itself (JSON form of ir/serialize.py). The runtime reads only this file, never the pass
manager. Kernel artifacts (codegen/plan_kernels.py) sit beside it in ``kernels/``: sources, cubins and
``manifest.json``; load_plan checks every listed file against its sha256.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.errors import SerializationError
from deepinfer.ir.graph import Graph
from deepinfer.ir.serialize import graph_from_dict, graph_to_dict

PLAN_FORMAT = "deepinfer.plan"
PLAN_VERSION = 1
PLAN_FILE = "plan.json"
KERNELS_DIR = "kernels"
KERNELS_MANIFEST = "manifest.json"


@dataclass
class Plan:
    model: str
    config: dict
    target: str
    graph: Graph
    weights: dict = field(default_factory=dict)  # {"checkpoint": dir} or {"random_seed": int}
    pipeline: dict = field(default_factory=dict)
    report: str = ""
    kernels_dir: str | None = None  # a directory of kernel artifacts with manifest.json (copied into the plan)
    kernels: dict | None = None  # that manifest


def write_plan(plan: Plan, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the plan directory via a temp dir and a rename, so a failure leaves nothing half-written."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise SerializationError(f"plan directory {out} already exists (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        doc = {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "model": plan.model,
            "target": plan.target,
            "config": plan.config,
            "weights": plan.weights,
            "pipeline": plan.pipeline,
            "graph": graph_to_dict(plan.graph),
        }
        # compact separators keep json on its C encoder (indent= falls back to pure Python: ~2 s at 40 layers)
        (tmp / PLAN_FILE).write_text(json.dumps(doc, separators=(",", ":")) + "\n")
        (tmp / "report.txt").write_text(plan.report + "\n")
        if plan.kernels_dir is not None:
            shutil.copytree(plan.kernels_dir, tmp / KERNELS_DIR)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _field(doc: dict, key: str, typ: type, where: str):
    if key not in doc:
        raise SerializationError(f"{where}: {key}: missing field")
    if not isinstance(doc[key], typ):
        raise SerializationError(f"{where}: {key}: expected {typ.__name__}, got {type(doc[key]).__name__}")
    return doc[key]


def load_plan(path: str | os.PathLike) -> Plan:
    """Read a plan directory (or its plan.json); every problem is one line naming the file and field."""
    p = Path(path)
    f = p / PLAN_FILE if p.is_dir() else p
    if not f.is_file():
        raise SerializationError(f"{path}: no plan here (expected a directory with {PLAN_FILE})")
    try:
        doc = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise SerializationError(f"{f}:{e.lineno}:{e.colno}: bad JSON: {e.msg}") from None
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise SerializationError(f"{f}: format: expected {PLAN_FORMAT!r}")
    if doc.get("version") != PLAN_VERSION:
        raise SerializationError(f"{f}: version: expected {PLAN_VERSION}, got {doc.get('version')!r}")
    graph_doc = _field(doc, "graph", dict, str(f))
    try:
        graph = graph_from_dict(graph_doc, "graph")
    except SerializationError as e:
        raise SerializationError(f"{f}: {e}") from None
    report = (f.parent / "report.txt").read_text() if (f.parent / "report.txt").is_file() else ""
    kdir = f.parent / KERNELS_DIR
    manifest = check_kernels(kdir) if kdir.is_dir() else None
    return Plan(
        model=_field(doc, "model", str, str(f)),
        config=_field(doc, "config", dict, str(f)),
        target=_field(doc, "target", str, str(f)),
        graph=graph,
        weights=_field(doc, "weights", dict, str(f)),
        pipeline=_field(doc, "pipeline", dict, str(f)),
        report=report,
        kernels_dir=str(kdir) if manifest is not None else None,
        kernels=manifest,
    )


def check_kernels(kdir: str | os.PathLike) -> dict:
    """Read kernels/manifest.json and check every file it lists against its sha256; one line per problem."""
    import hashlib

    kdir = Path(kdir)
    mf = kdir / KERNELS_MANIFEST
    if not mf.is_file():
        raise SerializationError(f"{mf}: missing (the plan's kernels/ directory has no manifest)")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise SerializationError(f"{mf}:{e.lineno}:{e.colno}: bad JSON: {e.msg}") from None
    kernels = _field(manifest, "kernels", list, str(mf)) if isinstance(manifest, dict) else None
    if kernels is None:
        raise SerializationError(f"{mf}: expected a JSON object")
    for ent in kernels:
        files = ent.get("files") if isinstance(ent, dict) else None
        for info in (files or {}).values():
            if not isinstance(info, dict) or not isinstance(info.get("file"), str) or "sha256" not in info:
                raise SerializationError(f"{mf}: kernels: entry {ent.get('name')!r} has a malformed files record")
            path = kdir / info["file"]
            if not path.is_file():
                raise SerializationError(f"{path}: kernel artifact missing (listed in {mf})")
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest != info["sha256"]:
                want = info["sha256"][:12]
                raise SerializationError(f"{path}: kernel artifact altered (sha256 {digest[:12]}, manifest {want})")
    return manifest


def bind_weights(plan: Plan) -> tuple[dict, str]:
    """The plan's weights: its checkpoint's tensors, or the seeded random weights (checkpoint formats);
    returns (params by name, a description of where they came from)."""
    from deepinfer.models.checkpoint import load_checkpoint, random_weights
    from deepinfer.models.presets import weight_block_size

    if "checkpoint" in plan.weights:
        return load_checkpoint(plan.weights["checkpoint"], plan.graph.params), plan.weights["checkpoint"]
    seed = int(plan.weights.get("random_seed", 0))
    source = f"random weights (seed {seed}) in the checkpoint formats"
    return random_weights(plan.graph.params, seed, block=weight_block_size(plan.config)), source
