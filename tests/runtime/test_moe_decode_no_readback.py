"""The contiguous MoE path at decode sizes reads nothing back to the host (H200 session 7 call 1: the batched
decode step of a model whose experts the swap-AB program declines could not be captured in a CUDA graph because
the layout read its tile count back)."""

from __future__ import annotations

import pytest

from deepinfer.runtime import kernel_adapters as ka
from tests.runtime.test_moe_adapter import moe_call


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)


@pytest.mark.parametrize("t,tuned,read_back", [(8, False, False), (64, False, False), (80, False, True),
                                               (80, True, False)])  # fmt: skip
def test_layout_read_back_only_at_prefill_on_the_non_persistent_program(monkeypatch, t, tuned, read_back):
    seen = []
    real = ka._moe_layout_rows

    def spy(idx, n_experts, block_m, read_back=True, **kw):
        seen.append(read_back)
        return real(idx, n_experts, block_m, read_back=read_back, **kw)

    monkeypatch.setattr(ka, "_moe_layout_rows", spy)
    adapter = ka.MoEGroupedAdapter()
    adapter.tuned = tuned  # False: the portable (non-persistent) loop, which reads the exact count back at prefill
    call = moe_call(t, 256, 128, 8, 2, layout="contiguous")
    assert adapter.path(call) == "contiguous"
    assert seen == [read_back]
