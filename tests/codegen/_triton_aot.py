"""Ahead-of-time sm_90a builds of this package's Triton kernels for CPU tests: compile a lazily built @triton.jit
kernel (`module.factory(False)`) for Hopper in a fresh process (the CPU test process runs Triton's interpreter,
which must be off for a real compile), and run the wheel's ptxas -v on its PTX (registers, spills)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import importlib, json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(spec["module"]), spec["factory"])(False)
k = triton.compile(ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"]),
                   target=GPUTarget("cuda", 90, 32), options=spec["options"])
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
with tempfile.TemporaryDirectory() as d:
    src = os.path.join(d, "k.ptx")
    open(src, "w").write(k.asm["ptx"])
    info = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                          capture_output=True, text=True).stderr
print(json.dumps({"ptx": k.asm["ptx"], "ptxas": info}))
"""


def compile_sm90(module: str, factory: str, signature: dict, constexprs: dict, **options) -> tuple[str, str]:
    """(PTX, ptxas -v report) of `module.factory(False)` built for sm_90a with these constexprs and options."""
    pytest.importorskip("triton", reason="triton is not installed")
    for name in constexprs:
        signature = {**signature, name: "constexpr"}
    spec = json.dumps({"module": module, "factory": factory, "signature": signature, "constexprs": constexprs,
                       "options": options})  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, spec], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["ptx"], out["ptxas"]


def spill_free(ptxas_report: str) -> bool:
    """Every function in the report spills nothing."""
    lines = [ln for ln in ptxas_report.splitlines() if "spill stores" in ln]
    return bool(lines) and all(" 0 bytes spill stores" in ln for ln in lines)
