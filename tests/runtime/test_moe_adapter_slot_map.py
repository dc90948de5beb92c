"""MoEGroupedAdapter passes the swap-AB decode kernels the slot -> expert map (moe_grouped_gemm.slot_expert_meta:
Meta = Counts ++ SlotExpert) and trims their grid to T*K slots when fewer pairs than experts exist; the map is
built without a host read (CUDA-graph capture). Oracles: the node's torch reference, and the real programs on
TileLang's `c` target."""

from __future__ import annotations

import pytest
import torch

from deepinfer.codegen.kernels import moe_grouped_gemm as mg
from deepinfer.runtime import cuda_graphs as cg
from deepinfer.runtime import kernel_adapters as ka
from tests.runtime.test_moe_adapter import TOL, moe_call, reference, rel_err


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)


@pytest.mark.parametrize("t,e,k,slots", [(3, 8, 2, 6), (5, 8, 2, 0), (1, 16, 6, 6)])
def test_decode_keys_ask_for_the_map_and_the_trimmed_grid(t, e, k, slots):
    """slots = T*K when that is below E (0 = all E), from T alone: the key does not depend on the routing."""
    call = moe_call(t, 256, 128, e, k)
    keys = ka.MoEGroupedAdapter().keys(call)
    for key in keys[:2]:
        kw = dict(key.kwargs)
        assert kw["slot_map"] is True and kw["slots"] == slots and kw["max_rows"] == 16
    assert keys == ka.MoEGroupedAdapter().keys(moe_call(t, 256, 128, e, k, seed=7))


def test_the_layout_meta_is_the_map_and_needs_no_host_read():
    call = moe_call(4, 256, 128, 12, 2, seed=3)
    with cg.HostSyncGuard():  # strict: .item() / nonzero / boolean masks raise
        plan = ka.MoEGroupedAdapter()._make_plan(call)
    dest, counts, _ = ka.masked_layout(call.args[2], call.args[1], 12, 16)
    assert torch.equal(plan.layout[1], mg.slot_expert_meta(counts))
    assert int((counts > 0).sum()) < 12  # idle experts: the map's order matters


def test_the_kernels_receive_the_map(monkeypatch):
    """Both routed kernels get the [2E+1] map (the shared expert's pair keeps its 1-expert Counts)."""
    call = moe_call(3, 256, 128, 8, 2, shared=True, seed=2)
    seen = []

    def recording(key):
        kernel = ka.emulated_kernel(key)

        def run(*args):
            seen.append((dict(key.kwargs).get("slot_map", False), args[4].clone()))
            return kernel(*args)

        return run

    out = ka.MoEGroupedAdapter().run(call, [recording(key) for key in ka.MoEGroupedAdapter().keys(call)])[0]
    _, counts, _ = ka.masked_layout(call.args[2], call.args[1], 8, 16)
    routed = [meta for slot_map, meta in seen if slot_map]
    assert len(routed) == 2 and all(torch.equal(m, mg.slot_expert_meta(counts)) for m in routed)
    assert rel_err(out, reference(call)) < TOL


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_trimmed_grid_on_the_c_target_programs(fmt):
    """T*K = 4 < E = 8: four expert slots, read from the map, by the real programs (glu_split for fp8, the
    interleaved stack for fp4), against the node's reference."""
    pytest.importorskip("tilelang")
    call = moe_call(2, 128, 64, 8, 2, fmt=fmt, seed=5)
    if fmt == "fp8":
        call.cache[ka.GLU_POLICY] = "split"
    keys = ka.MoEGroupedAdapter().keys(call)
    assert dict(keys[0].kwargs)["slots"] == 4
    adapter = ka.MoEGroupedAdapter()
    got = adapter.run(call, [ka.c_target_kernel(key) for key in keys])[0]
    assert rel_err(got, reference(call)) < TOL


def test_decode_options_from_the_environment(monkeypatch):
    """fp8 decode keys: wide TMA tiles by default; DEEPINFER_SWAB_DECODE=narrow,staged,persistent: the 32-byte boxes
    of before, staged scales, the persistent grid (132 SMs here x each kernel's CTAs per SM); fp4 keeps its
    programs; an unknown option is refused by name."""
    for key in ka.MoEGroupedAdapter().keys(moe_call(3, 256, 128, 8, 2))[:2]:
        cfg = dict(dict(key.kwargs)["cfg"])
        assert cfg["wide_tma"] and not cfg["stage_scales"] and not cfg["persistent"]
    monkeypatch.setenv(ka.SWAB_DECODE_ENV, "narrow,staged,persistent")
    k1, k2 = ka.MoEGroupedAdapter().keys(moe_call(3, 256, 128, 8, 2))[:2]
    for key in (k1, k2):
        cfg = dict(dict(key.kwargs)["cfg"])
        assert not cfg["wide_tma"] and cfg["stage_scales"] and cfg["persistent"] == 132 * cfg["min_blocks"]
    fp4 = dict(dict(ka.MoEGroupedAdapter().keys(moe_call(3, 256, 128, 8, 2, fmt="fp4"))[0].kwargs)["cfg"])
    assert not fp4["wide_tma"] and not fp4["stage_scales"] and not fp4["persistent"]
    monkeypatch.setenv(ka.SWAB_DECODE_ENV, "wide,fast")
    with pytest.raises(ValueError, match="fast"):
        ka.MoEGroupedAdapter().keys(moe_call(3, 256, 128, 8, 2))


def test_persistent_staged_programs_on_the_c_target(monkeypatch):
    """The persistent grid (132 CTAs per SM-count here, far more than the items) and the staged scales, by the real
    programs behind the adapter (glu_split and down), against the node's reference."""
    pytest.importorskip("tilelang")
    monkeypatch.setenv(ka.SWAB_DECODE_ENV, "staged,persistent")
    call = moe_call(3, 128, 64, 8, 2, seed=6)
    call.cache[ka.GLU_POLICY] = "split"
    keys = ka.MoEGroupedAdapter().keys(call)
    assert dict(dict(keys[0].kwargs)["cfg"])["persistent"] > 0
    got = ka.MoEGroupedAdapter().run(call, [ka.c_target_kernel(key) for key in keys])[0]
    assert rel_err(got, reference(call)) < TOL
