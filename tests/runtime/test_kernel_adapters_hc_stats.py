"""HCStatsAdapter (issue 8): the first sublayer's hc_stats through hyper_connection's pre_program (its collapse output
dropped). The oracle is the op's torch reference (mixes, RMS, 20 Sinkhorn iterations)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ir.registry import get_op
from deepinfer.runtime import kernel_adapters as ka

ATTRS = {"sinkhorn_iters": 20, "hc_eps": 1e-6, "norm_eps": 1e-20}


def stats_call(t: int, d: int = 256, n: int = 4, seed: int = 0) -> ka.Call:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, d, generator=g)
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.02
    base, scale = torch.randn((2 + n) * n, generator=g) * 0.1, torch.rand(3, generator=g) + 0.5
    return ka.Call("hc_stats", ATTRS, [x, fn, base, scale], ["x", "fn", "base", "scale"], [False, True, True, True],
                   {}, {})  # fmt: skip


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)


@pytest.mark.parametrize("t", [1, 5])
def test_stats_match_the_reference(t):
    call = stats_call(t, seed=t)
    adapter = ka.adapter_for("hyper_connection", "hc_stats")
    got = adapter.run(call, [ka.emulated_kernel(k) for k in adapter.keys(call)])
    ref = get_op("hc_stats").run(call.args, call.attrs)
    assert [g.shape for g in got] == [r.shape for r in ref]
    # the kernel reads X in bf16 (as hc_pre_collapse's adapter does): ~1e-3 of the coefficients' range
    assert all((g - r).abs().max() <= 5e-3 * r.abs().max() for g, r in zip(got, ref))
    # pre, post, comb are three different tensors: a swapped output would not pass
    assert not torch.allclose(got[0], ref[1], atol=1e-3)


def test_binds_to_pre_program():
    from deepinfer.passes.select_kernels import BINDERS, bind_hc_pre

    assert BINDERS["hc_stats"] is bind_hc_pre


@pytest.mark.parametrize("t", [1, 5])
def test_split_form_matches_the_reference_on_the_c_target(t, monkeypatch):
    """DEEPINFER_HC_PRE_SPLIT=4: hc_stats through the few-token pair (D split over 4 CTAs + the finish kernel),
    the real programs built for TileLang's c target, against the op's reference."""
    pytest.importorskip("tilelang")
    monkeypatch.setenv("DEEPINFER_HC_PRE_SPLIT", "4")
    call = stats_call(t, seed=10 + t)
    adapter = ka.adapter_for("hyper_connection", "hc_stats")
    keys = adapter.keys(call)
    assert [k.program for k in keys] == ["pre_partial_program", "pre_finish_program"]
    got = adapter.run(call, [ka.c_target_kernel(k) for k in keys])
    ref = get_op("hc_stats").run(call.args, call.attrs)
    assert all((g - r).abs().max() <= 5e-3 * r.abs().max() for g, r in zip(got, ref))
    monkeypatch.setenv("DEEPINFER_HC_PRE_SPLIT", "3")  # 256 channels do not split into 3 chunks of 64: one kernel
    assert [k.program for k in adapter.keys(call)] == ["pre_program"]


def test_split_is_the_default_at_few_tokens(monkeypatch):
    """<= 256 tokens take the split pair (the largest split <= 40 of whole 64-channel chunks), more tokens
    pre_program; DEEPINFER_HC_PRE_SPLIT=0 turns the split off."""
    monkeypatch.delenv("DEEPINFER_HC_PRE_SPLIT", raising=False)
    adapter = ka.adapter_for("hyper_connection", "hc_stats")

    def programs(t, d=256):
        return [(k.program, dict(k.kwargs).get("splits")) for k in adapter.keys(stats_call(t, d))]

    assert programs(5) == [("pre_partial_program", 4), ("pre_finish_program", 4)]
    assert programs(256) == [("pre_partial_program", 4), ("pre_finish_program", 4)]
    assert programs(257) == [("pre_program", None)]
    assert ka._hc_pre_splits(64, 5120) == 40 and ka._hc_pre_splits(64, 64) == 0
    monkeypatch.setenv("DEEPINFER_HC_PRE_SPLIT", "0")
    assert programs(5) == [("pre_program", None)]
    monkeypatch.setenv("DEEPINFER_HC_PRE_SPLIT", "2")
    assert programs(5) == [("pre_partial_program", 2), ("pre_finish_program", 2)]


def post_pre_call(t: int, d: int = 256, n: int = 4, seed: int = 0) -> ka.Call:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(t, n, d, generator=g), torch.randn(t, d, generator=g)
    post, comb = torch.rand(t, n, generator=g) * 2, torch.rand(t, n, n, generator=g) / n
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.02
    base, scale = torch.randn((2 + n) * n, generator=g) * 0.1, torch.rand(3, generator=g) + 0.5
    prev = torch.rand(t, n, generator=g)
    names = ["y", "x", "post", "comb", "fn", "base", "scale", "prev"]
    return ka.Call("hc_post_pre_collapse", ATTRS, [y, x, post, comb, fn, base, scale, prev], names,
                   [n in ("fn", "base", "scale") for n in names], {}, {})  # fmt: skip


@pytest.mark.parametrize("t,kernels", [(5, "emulated"), (16, "c_target")])
def test_post_pre_collapse_fp32_streams_match_the_reference(t, kernels, monkeypatch):
    """fp32 streams: post_program and the split pair with io="float32" (no cast launches); the c target builds the
    real programs. Outputs in the node's dtypes, within the bf16 streams' rounding of the reference."""
    if kernels == "c_target":
        pytest.importorskip("tilelang")
    monkeypatch.delenv("DEEPINFER_HC_PRE_SPLIT", raising=False)
    call = post_pre_call(t, seed=20 + t)
    adapter = ka.adapter_for("hyper_connection", "hc_post_pre_collapse")
    keys = adapter.keys(call)
    assert [k.program for k in keys] == ["post_program", "pre_partial_program", "pre_finish_program"]
    assert all(dict(k.kwargs).get("io") == "float32" for k in keys)
    make = ka.emulated_kernel if kernels == "emulated" else ka.c_target_kernel
    got = adapter.run(call, [make(k) for k in keys])
    ref = get_op("hc_post_pre_collapse").run(call.args, call.attrs)
    assert [g.dtype for g in got] == [r.dtype for r in ref] and [g.shape for g in got] == [r.shape for r in ref]
    assert all((g - r).abs().max() <= 1e-2 * r.abs().max() for g, r in zip(got, ref))
    if kernels == "emulated":  # (the c target computes in fp32: no bf16 there)
        assert torch.equal(got[0], got[0].bfloat16().float())  # the new streams hold bf16 values (as before)
