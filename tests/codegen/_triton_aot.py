"""Ahead-of-time sm_90a builds of this package's Triton kernels for CPU tests: compile a lazily built @triton.jit
kernel (`module.factory(False)`) for Hopper in a separate process (the CPU test process runs Triton's interpreter,
which must be off for a real compile), and run the wheel's ptxas -v on its PTX (registers, spills).

The process is started once per test session and serves every build (one JSON line in, one out): a fresh Python
per build spent ~2 s importing torch and triton, ~40 builds a CI run."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile

import pytest

_SERVER = r"""
import importlib, json, os, subprocess, sys, tempfile, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def build(spec):
    fn = getattr(importlib.import_module(spec["module"]), spec["factory"])(False)
    k = triton.compile(ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"]),
                       target=GPUTarget("cuda", 90, 32), options=spec["options"])
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(k.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True).stderr
    return {"ptx": k.asm["ptx"], "ptxas": info}


out = sys.stdout
sys.stdout = sys.stderr  # anything the kernels' modules print stays off the reply channel
for line in sys.stdin:
    try:
        reply = build(json.loads(line))
    except Exception:
        reply = {"error": traceback.format_exc()}
    out.write(json.dumps(reply) + "\n")
    out.flush()
"""

_PROC: list[subprocess.Popen] = []
_LOG: list = []


def _server() -> subprocess.Popen:
    if _PROC and _PROC[0].poll() is None:
        return _PROC[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    _LOG[:] = [tempfile.TemporaryFile("w+")]  # the process's stderr: shown if it dies
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=_LOG[0], text=True, env=env)  # fmt: skip
    _PROC[:] = [proc]
    return proc


def _log_tail() -> str:
    _LOG[0].seek(0)
    return _LOG[0].read()[-2000:]


@atexit.register
def _stop_server() -> None:
    for proc in _PROC:
        proc.stdin.close()
        proc.wait(timeout=30)


def compile_sm90(module: str, factory: str, signature: dict, constexprs: dict, **options) -> tuple[str, str]:
    """(PTX, ptxas -v report) of `module.factory(False)` built for sm_90a with these constexprs and options."""
    pytest.importorskip("triton", reason="triton is not installed")
    for name in constexprs:
        signature = {**signature, name: "constexpr"}
    spec = json.dumps({"module": module, "factory": factory, "signature": signature, "constexprs": constexprs,
                       "options": options})  # fmt: skip
    proc = _server()
    proc.stdin.write(spec + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"the sm_90a compile process died (exit {proc.wait()}) building {module}.{factory}:\n{_log_tail()}"
    out = json.loads(line)
    assert "error" not in out, out.get("error", "")[-2000:]
    return out["ptx"], out["ptxas"]


def spill_free(ptxas_report: str) -> bool:
    """Every function in the report spills nothing."""
    lines = [ln for ln in ptxas_report.splitlines() if "spill stores" in ln]
    return bool(lines) and all(" 0 bytes spill stores" in ln for ln in lines)
