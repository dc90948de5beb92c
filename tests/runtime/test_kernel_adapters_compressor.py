"""CompressorKeysAdapter (issue 8). The default path: ONE Triton kernel (compressor.triton_compressor_keys, under the
interpreter in a fresh process) against the op's reference (fp32 both: 1e-5; the integer and state outputs
exactly). DEEPINFER_COMPRESSOR_KEYS=kernels: RMSNorms and RoPEs on the rmsnorm and rope kernels (CPU stand-ins from
the kernels' references), pooling and the wk GEMM in torch; the kernels read bf16 activations (~4e-3 of the
range), the integer and state outputs are the reference's exactly."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ir.registry import get_op
from deepinfer.runtime import kernel_adapters as ka

ROPE = {"rope_dim": 64, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 65536, "beta_fast": 32.0,
        "beta_slow": 1.0}  # fmt: skip
TOL = 1e-2


def compressor_call(op: str, t: int, start: int, d: int = 512, di: int = 128, seed: int = 0) -> ka.Call:
    g = torch.Generator().manual_seed(seed)
    kv, score = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    norm, wk = (torch.rand(d, generator=g) + 0.5).bfloat16(), (torch.randn(di, d, generator=g) / d**0.5).bfloat16()
    k_norm = (torch.rand(di, generator=g) + 0.5).bfloat16()
    pos = torch.arange(start, start + t)
    if op == "pair_compressor_keys":
        args = [kv, score, torch.randn(1, d, generator=g), torch.randn(1, d, generator=g), pos, norm, wk, k_norm]
        names = ["kv", "score", "skv", "ssc", "pos", "norm", "wk", "k_norm"]
    else:
        args, names = [kv, pos, norm, wk, k_norm], ["kv", "pos", "norm", "wk", "k_norm"]
    is_param = [n in ("norm", "wk", "k_norm") for n in names]
    return ka.Call(op, {"eps": 1e-20, **ROPE}, args, names, is_param, {}, {ka.MAX_POSITIONS: 8192})


def run(call: ka.Call) -> list[torch.Tensor]:
    adapter = ka.adapter_for("compressor", call.op)
    return adapter.run(call, [ka.emulated_kernel(k) for k in adapter.keys(call)])


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)
    monkeypatch.setenv(ka.COMPRESSOR_KEYS_ENV, "kernels")  # the TileLang kernels' path (the Triton one: below)


_TRITON = r"""
import torch
from deepinfer.ir.registry import get_op
from deepinfer.runtime import kernel_adapters as ka
from deepinfer.codegen.kernels import compressor
from test_kernel_adapters_compressor import compressor_call

ka.EMULATE = True
calls = []
_kernel = compressor.triton_compressor_keys
compressor.triton_compressor_keys = lambda *a, **k: calls.append(1) or _kernel(*a, **k)
cases = [("pair_compressor_keys", 1, 101), ("pair_compressor_keys", 1, 100), ("pair_compressor_keys", 6, 4096),
         ("pair_compressor_keys", 5, 7), ("pair_compressor_keys", 4, 0), ("compressor_keys", 6, 4096)]
for op, t, start in cases:
    call = compressor_call(op, t, start, seed=t + start)
    adapter = ka.adapter_for("compressor", op)
    assert adapter.keys(call) == [], "the Triton path builds no TileLang kernel"
    n = len(calls)
    got, ref = adapter.run(call, []), get_op(op).run(call.args, call.attrs)
    assert len(calls) == n + 1 and len(got) == len(ref), op
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.shape == b.shape and a.dtype == b.dtype, (op, t, start, i)
        if i < 2:
            err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))  # (no complete pair: zeros)
            assert err < 1e-5, (op, t, start, i, err)
        else:
            assert torch.equal(a, b), (op, t, start, i)
print("ok")
"""


def test_triton_path_matches_the_reference_under_the_interpreter():
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "DEEPINFER_ADAPTER_INTERPRET": "1",
           "PYTHONPATH": os.path.dirname(__file__)}
    env.pop(ka.COMPRESSOR_KEYS_ENV, None)
    proc = subprocess.run([sys.executable, "-c", _TRITON], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("op,t,start", [("pair_compressor_keys", 1, 101), ("pair_compressor_keys", 64, 4096),
                                         ("pair_compressor_keys", 5, 7), ("compressor_keys", 64, 4096)])  # fmt: skip
def test_outputs_match_the_reference(op, t, start):
    call = compressor_call(op, t, start, seed=t)
    got, ref = run(call), get_op(op).run(call.args, call.attrs)
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        if i < 2:  # entry, keys: through the bf16 kernels
            assert (a - b).abs().max() <= TOL * b.abs().max(), (i, float((a - b).abs().max() / b.abs().max()))
        else:  # entry_idx and the pending state: the reference's own code
            assert torch.equal(a, b), i


def test_rotated_outputs_are_not_the_unrotated_ones():
    """The RoPE step is applied (a missing rotation would differ by O(1) on the rotated channels)."""
    call = compressor_call("compressor_keys", 8, 1000)
    got = run(call)
    ref = get_op("compressor_keys").run(call.args, call.attrs)
    unrotated = get_op("rmsnorm").run([call.args[0], call.args[2]], {"eps": 1e-20})[0]
    assert (got[0] - ref[0]).abs().max() < (unrotated - ref[0]).abs().max() / 10


def test_declines_without_the_position_bound():
    call = compressor_call("compressor_keys", 4, 0)
    call.cache.pop(ka.MAX_POSITIONS)
    with pytest.raises(ka.Decline, match="position bound"):
        ka.adapter_for("compressor", "compressor_keys").keys(call)
