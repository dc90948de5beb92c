"""topk_select.program with a symbolic row count (program(None, ...)): ONE c-target build selects exactly at several
row counts (the reference's set, ties to the lower column; the arrival counters left at zero), and the runtime
adapter asks for one kernel whatever the rows (its key has no row count where the program is `program`; the hist
program keeps its rows). So `deepinfer compile` builds 2 top-k kernels for the 40-layer V4.1, not 14."""

from __future__ import annotations

import pytest
import torch

from deepinfer.codegen.kernels import topk_select as ts
from deepinfer.runtime import kernel_adapters as ka

K = 16
CONFIGS = {  # (cfg, C, ratio): one CTA per row with the row in registers; 2 segments x 2 chunks with the filter
    "direct": (ts.Config(32, 8, 256, False), 256, 2),
    "multi": (ts.Config(32, 8, 512, True, 4, 32), 1024, 1),
}


@pytest.mark.parametrize("which", CONFIGS)
def test_one_c_target_build_selects_at_several_row_counts(tilelang_required, which):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    cfg, c, ratio = CONFIGS[which]
    kernel = compile_cpu(ts.program(None, c, k=K, ratio=ratio, cfg=cfg, target="cpu"))
    for t in (4, 3, 1):
        g = torch.Generator().manual_seed(t)
        s = torch.randint(-8, 8, (t, c), generator=g).float()  # many ties
        pos = torch.randint(0, 2 * c, (t,), generator=g)
        out = torch.full((t, K), 7, dtype=torch.int32)
        scratch = ts.make_scratch(t, c, K, cfg, "cpu")
        kernel(s, pos.int(), out, *scratch)
        assert torch.equal(out.long(), ts.reference(s, K, pos, ratio)), (which, t)
        assert int(scratch[-1].abs().sum()) == 0, "the arrival counters must be left at zero"


def _call(t: int, c: int) -> ka.Call:
    scores, pos = torch.randn(t, c), torch.arange(t) + c
    attrs = {"topk": 512, "block": 1, "ratio": 2}
    return ka.Call("topk_entries", attrs, [scores, None, pos], ["s", "b", "p"], [False] * 3, {}, {})


@pytest.mark.parametrize("c", [2048, 4096])  # the 40-layer V4.1's top-k columns at max_model_len 4096
def test_adapter_key_has_no_row_count(monkeypatch, c):
    monkeypatch.setattr(ka, "EMULATE", True)
    adapter = ka.adapter_for("topk_select", "topk_entries")
    keys = {t: adapter.keys(_call(t, c))[0] for t in (1, 2, 5, 16, 64, 4096)}
    assert {k.program for k in keys.values()} == {"program"}
    assert len(set(keys.values())) == 1 and keys[1].args == (None, c), {t: k.describe() for t, k in keys.items()}
