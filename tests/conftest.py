"""Test-wide setup: GPU tests run only where CUDA is available, and say why they are skipped elsewhere."""

import os

import pytest

os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "tilelang"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "triton"))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device here (runs on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
