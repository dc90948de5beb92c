"""fused_attention's inverse RoPE of the output on the rope kernel (when the runner gives the position bound): the
same node outputs as the torch rotation within the FP8 epilogue's one-step flips, the rope key is requested, and
without the bound the torch rotation runs (no host read of the positions)."""

from __future__ import annotations

import pytest

from deepinfer.ir.registry import get_op
from deepinfer.runtime import kernel_adapters as ka

from .test_attention_adapter import ROPE, as_float, attn_args, fused_call, rel, run


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)


@pytest.mark.parametrize("quant_group", [32, 0])
def test_output_rotation_on_the_rope_kernel(quant_group):
    args = attn_args(3, 8, 128, 40, 70, 32, 96, seed=4)
    call = fused_call(args, out_groups=2, quant_group=quant_group)
    call.attrs.update({**ROPE, "rope_dim": 64})
    call.cache[ka.MAX_POSITIONS] = 1024
    keys = ka.SparseAttnAdapter().keys(call)
    assert keys[-1].family == "rope" and dict(keys[-1].kwargs)["inverse"] is True
    got, ref = run(call), get_op("fused_attention").run(call.args, call.attrs)
    assert rel(as_float(got), as_float(ref)) < (0.1 if quant_group else 1e-2)
    call.cache.pop(ka.MAX_POSITIONS)
    assert all(k.family != "rope" for k in ka.SparseAttnAdapter().keys(call))
    assert rel(as_float(run(call)), as_float(ref)) < (0.1 if quant_group else 1e-2)
