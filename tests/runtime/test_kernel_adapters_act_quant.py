"""The adapters with act_quant's kernel quantising their activations (the Triton interpreter on CPU tensors) give the
same outputs, bit for bit, as with the torch quantisation (the oracle): quant_rows itself, grouped_out_proj, the
MoE's routed + shared swap-AB paths (decode) and dense shared path (T > 64), the attention's FP8 epilogue.

The interpreter must be on before triton is first imported, so the comparison runs in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = r"""
import torch
from deepinfer.runtime import kernel_adapters as ka
from deepinfer.ir.ops.attention import Rope
from test_kernel_adapters_out_proj import out_proj_call, run_adapter as run_out_proj
from test_moe_adapter import moe_call, run_adapter as run_moe

ka.EMULATE = True
from deepinfer.codegen.kernels import act_quant

calls = []
_kernel_quant = act_quant.triton_act_quant
act_quant.triton_act_quant = lambda *a, **k: calls.append(1) or _kernel_quant(*a, **k)
_kernel_fake = act_quant.triton_fake_quant  # fake_quant_fp8's own one-launch kernel
act_quant.triton_fake_quant = lambda *a, **k: calls.append(1) or _kernel_fake(*a, **k)


def both(run):
    ka.ACT_QUANT_KERNEL_ON_CPU = False
    a = run()
    n = len(calls)
    ka.ACT_QUANT_KERNEL_ON_CPU = True
    b = run()
    assert len(calls) > n, "the kernel path did not run"
    return a, b


def same(a, b):
    bits = lambda x: x.view(torch.uint8) if x.dtype.itemsize == 1 else x
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


x = torch.randn(5, 160) * torch.logspace(-4, 4, 160)
(q0, s0), (q1, s1) = both(lambda: ka.quant_rows(x, 32, 8))
assert q1.dtype == torch.float8_e4m3fn and same([q0, s0[:, :5]], [q1, s1[:, :5]]), "quant_rows"
assert (q1[5:].view(torch.uint8) == 0).all() and (s1[:, 5:] == 2.0**-22).all(), "padding rows"

call = out_proj_call(5, g=4)
assert torch.equal(*both(lambda: run_out_proj(call, ka.emulated_kernel))), "grouped_out_proj"

for t in (3, 80):
    c = moe_call(t, 256, 128, 8, 2, shared=True)
    fresh = lambda: ka.Call(c.op, c.attrs, c.args, c.names, c.is_param, {}, {})
    assert torch.equal(*both(lambda: run_moe(fresh(), ka.emulated_kernel))), f"moe T={t}"

rope = {"rope_dim": 16, "theta": 10000.0, "yarn_factor": 1.0, "yarn_orig_len": 0, "beta_fast": 32.0, "beta_slow": 1.0}
o = torch.randn(3, 4, 64) * 3
att = ka.Call("fused_attention", {"quant_group": 32, "out_groups": 0, **rope}, [None, torch.arange(3)], [], [], {}, {})
a, b = both(lambda: ka.SparseAttnAdapter()._epilogue(att, o))
assert a[1].dtype == torch.float8_e8m0fnu and a[1].shape == (3, 4, 2) and same(a, b), "attention epilogue"
_, s = ka.quant_act(Rope.reference(o, torch.arange(3), inverse=True, **rope), 32)
assert torch.equal(a[1].view(torch.uint8), ka.to_e8m0(s).view(torch.uint8)), "e8m0 bytes"
c = ka.Call("fake_quant_fp8", {"group": 32}, [x.view(5, 5, 32)], ["x"], [False], {}, {})
fq = lambda: ka.FakeQuantAdapter().run(c, [])[0]
assert torch.equal(*both(fq)), "fake_quant"
print("OK")
"""


def test_kernel_quantisation_inside_the_adapters_is_bit_exact():
    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "DEEPINFER_ADAPTER_INTERPRET": "1",
           "PYTHONPATH": str(Path(__file__).parent)}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def test_fake_quant_adapter_is_the_reference_exactly(monkeypatch):
    import torch

    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setattr(ka, "EMULATE", True)
    x = torch.randn(5, 2, 96) * torch.logspace(-3, 3, 96)
    x[0, 0] = 0.0
    call = ka.Call("fake_quant_fp8", {"group": 32}, [x], ["x"], [False], {}, {})
    adapter = ka.adapter_for("act_quant", "fake_quant_fp8")
    assert adapter.keys(call) == []
    got, ref = adapter.run(call, [])[0], get_op("fake_quant_fp8").run([x], {"group": 32})[0]
    assert got.shape == ref.shape and torch.equal(got, ref)
