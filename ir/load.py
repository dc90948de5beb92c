"""Load a graph from any of its stored forms, chosen by the path.

- ``.dil`` / ``.txt``: the text form (``ir.parser``);
- ``.json``: a graph, or a plan whose field ``graph`` holds one (``ir.serialize``);
- ``.onnx``: an exported model (``ir.onnx_io``);
- a directory holding ``plan.json``: that plan's graph.

Every failure is a DeepInferError whose one-line message names the path (and the line, field or node).
"""

from __future__ import annotations

import os

from deepinfer.errors import DeepInferError
from deepinfer.ir.graph import Graph

TEXT_EXTS = (".dil", ".txt")


def load_any(path: str | os.PathLike) -> Graph:
    p = os.fspath(path)
    if os.path.isdir(p):
        plan = os.path.join(p, "plan.json")
        if not os.path.isfile(plan):
            raise DeepInferError(f"{p}: directory has no plan.json")
        return _load_plan(plan)
    if not os.path.exists(p):
        raise DeepInferError(f"{p}: no such file or directory")
    ext = os.path.splitext(p)[1].lower()
    if ext in TEXT_EXTS:
        from deepinfer.ir.parser import parse_graph

        return parse_graph(_read_text(p), source=p)
    if ext == ".json":
        from deepinfer.ir.serialize import load_json

        return load_json(p)
    if ext == ".onnx":
        from deepinfer.ir.onnx_io import import_onnx

        return import_onnx(p)
    raise DeepInferError(f"{p}: unknown file type {ext or '(no extension)'!r} (expected .dil, .txt, .json, .onnx)")


def _load_plan(plan: str) -> Graph:
    import json

    from deepinfer.errors import SerializationError
    from deepinfer.ir.serialize import graph_from_dict

    text = _read_text(plan)
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise SerializationError(f"{plan}:{e.lineno}:{e.colno}: bad JSON: {e.msg}") from None
    if not isinstance(d, dict):
        raise SerializationError(f"{plan}: expected a JSON object")
    if "graph" not in d:
        raise SerializationError(f"{plan}: graph: missing field")
    try:
        return graph_from_dict(d["graph"], "graph")
    except SerializationError as e:
        raise SerializationError(f"{plan}: {e}") from None


def _read_text(p: str) -> str:
    try:
        with open(p, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DeepInferError(f"{p}: cannot read: {getattr(e, 'strerror', None) or e}") from None
