"""CompressorKeysAdapter (issue 8): pair_compressor_keys / compressor_keys with their RMSNorms and RoPEs on the
rmsnorm and rope kernels (CPU stand-ins from the kernels' references), pooling and the wk GEMM in torch. The oracle
is the op's reference; the kernels read bf16 activations (~4e-3 of the range), the integer and state outputs are
the reference's exactly."""

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
