"""Shared setup for the codegen tests.

The toolchain caches are pointed away from $HOME before tilelang/triton are imported (TOOLCHAIN.md),
and our own cubin cache goes to a per-session temp dir so every run really invokes nvcc.
"""

import os
import shutil
import tempfile

import pytest

_TMP = tempfile.gettempdir()
os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(_TMP, "deepinfer-tilelang-cache"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_TMP, "deepinfer-triton-cache"))


def _enable_triton_interpreter():
    """Without a GPU, Triton kernels can only run in its interpreter, and the interpreter must be on
    before `triton` is first imported (triton.language's own jit helpers are decorated at import)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_enable_triton_interpreter()


@pytest.fixture(scope="session")
def tilelang_required():
    """Skip (with the reason printed) when tilelang is not installed."""
    return pytest.importorskip("tilelang", reason="tilelang is not installed (pip install deepinfer[codegen])")


@pytest.fixture(scope="session")
def nvcc_required(tilelang_required):
    """Skip unless nvcc and a cuobjdump (system or triton wheel) are available."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH; CUDA sources cannot be compiled to cubin")
    from deepinfer.codegen.tilelang_backend import cuobjdump_path

    if cuobjdump_path() is None:
        pytest.skip("no cuobjdump (system or triton wheel); SASS cannot be checked")


@pytest.fixture(scope="session")
def codegen_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("codegen-cache")
    old = os.environ.get("DEEPINFER_CODEGEN_CACHE")
    os.environ["DEEPINFER_CODEGEN_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("DEEPINFER_CODEGEN_CACHE", None)
    else:
        os.environ["DEEPINFER_CODEGEN_CACHE"] = old
