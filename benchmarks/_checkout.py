"""Imported first by the H200 scripts: per-user kernel caches under the temp dir, and `deepinfer` importable from a
checkout that was not `pip install -e`'d (the repository root is the package)."""

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(tempfile.gettempdir(), "deepinfer-tilelang-cache"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(tempfile.gettempdir(), "deepinfer-triton-cache"))

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("deepinfer") is None:
    _spec = importlib.util.spec_from_file_location("deepinfer", ROOT / "__init__.py",
                                                   submodule_search_locations=[str(ROOT)])  # fmt: skip
    sys.modules["deepinfer"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["deepinfer"])
