"""Shared setup for the codegen tests.

The toolchain caches are pointed away from $HOME before tilelang/triton are imported (TOOLCHAIN.md),
and our own cubin cache goes to a per-session temp dir so every run really invokes nvcc.
"""

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

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


@pytest.fixture
def interpret():
    """Triton kernels run in the interpreter (CPU CI); with a GPU present the interpreter is off, and the GPU
    tests cover the compiled kernels instead (the reason is printed)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer[codegen])")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not 1 (a GPU is present); interpreter tests are for CPU CI")


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


_KERNEL_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_h200.py"


@pytest.fixture(scope="session")
def kb(tilelang_required):
    """benchmarks/kernels_h200.py in check-only mode: the GPU tests run the benchmark's own cases, so the table
    and the tests check exactly the same thing."""
    spec = importlib.util.spec_from_file_location("kernels_h200", _KERNEL_BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.CHECK_ONLY = True
    return mod


@pytest.fixture(scope="session")
def run_case(kb):
    """Build, run and check one benchmark case (raises on a mismatch); returns its row."""

    def run(case, *args):
        row = kb.Row("test", "")
        case(row, *args, True, False)  # quick, not dry
        assert row.check, "the case ran no check"
        return row

    return run
