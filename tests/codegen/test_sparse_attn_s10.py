"""Session 10's options of the warp-specialised sparse-attention decode (sparse_attn_decode._program_ws):

- Config.evict_first: the 16-B cp.async copies (KV rows, row ids, Q) under an L2 evict_first cache policy. Only the
  copies' policy changes, so the CPU mirror has nothing to mirror; the sm90 build routes every copy through the
  prelude's di_cp_async_ef (no plain tl::cp_async_gs left), keeps the plain build's copy count, and spills nothing.
- Config.q_regs: Q's left half in WG0's registers, that half of QK^T an RS wgmma (the same products: the mirror is
  unchanged); the sm90 build has the RS wgmma and the ldmatrix, and spills no more.
On the H200: both outputs equal the config's without the option bit for bit (kernels_h200 'attn s10*' rows).
"""

import dataclasses
import re

import pytest
import torch

from deepinfer.codegen.kernels import sparse_attn_decode as sad
from tests.codegen._ws_build import build_ws

WS64 = sad.Config(64, sad.WS_THREADS, 1, 2, True)


def test_evict_first_config_names_and_validates():
    assert dataclasses.replace(WS64, evict_first=True).tag == "wsn64s2f"
    assert dataclasses.replace(WS64, o_smem=True, persist=132, evict_first=True).tag == "wsn64s2p132of"
    for bad in (dict(ws=False, threads=256), dict(copy="bulk", skip="qk,pv")):
        with pytest.raises(AssertionError):
            dataclasses.replace(WS64, evict_first=True, **bad)
    # on from 128 requests (H200 session 10 call 2: B128 40.1 -> 36.9 us, B256 persistent 67.6 -> 65.9; B64 neutral)
    assert [sad.sm90_config(b, 640).evict_first for b in (1, 16, 64, 128, 256)] == [False] * 3 + [True] * 2


def test_evict_first_rejects_fp8_kv(tilelang_required):
    """FP8 KV copies 4-B exponent words too; the policy's copy is 16 B only."""
    cfg = sad.Config(32, sad.WS_THREADS, 2, 2, True, evict_first=True)
    with pytest.raises(AssertionError, match="evict_first"):
        sad.program(64, 64, 512, 1 << 18, 640, target="sm90", cfg=cfg, kv_fp8=True, n_win=128)


def _copies(source: str) -> tuple[int, int, int, int]:
    """A ws build's cp.async calls in its CUDA source: (TileLang's plain copies, its bounded ones (pool rows), the
    prelude's plain policy copies, its bounded ones) -- calls, not the prelude's definitions."""
    return tuple(len(re.findall(pat, source)) for pat in (r"tl::cp_async_gs<", r"tl::cp_async_gs_conditional<",
                                                          r"(?<!void )\bdi_cp_async_ef\(",
                                                          r"(?<!void )\bdi_cp_async_ef_if\("))  # fmt: skip


@pytest.mark.parametrize("persist,spills", [(0, 0), (132, 20)])
def test_evict_first_sm90_build(codegen_cache, nvcc_required, persist, spills):
    """Two pools, o_smem on (the defaults' one-pass configs: the single pass and the persistent grid): every copy of
    the plain build becomes one policy copy, the SASS has the same LDGSTS count; the single pass spills nothing, the
    persistent grid (3 + 3 local loads / stores without the policy: its PV warpgroups sit at the 168-register cap)
    at most `spills` (12 + 7 at sm_90a with nvcc 13: the policy's 64-bit register a copy)."""
    base = dataclasses.replace(WS64, o_smem=True, persist=persist)
    arts = {}
    for cfg in (base, dataclasses.replace(base, evict_first=True)):
        arts[cfg.evict_first] = build_ws(256, cfg, n_win=128)
    plain, ef = arts[False], arts[True]
    n_plain, n_bounded, _, _ = _copies(plain.source)
    assert n_plain > 0 and n_bounded > 0 and "di_cp_async_ef" not in plain.source
    assert _copies(ef.source) == (0, 0, n_plain, n_bounded)  # Q / ids plain, rows bounded (an empty pool reads nothing)
    assert "L2::cache_hint" in ef.source and "createpolicy.fractional.L2::evict_first" in ef.source
    assert ef.opcodes["LDGSTS"] == plain.opcodes["LDGSTS"] > 0
    assert plain.opcodes["LDL"] + plain.opcodes["STL"] <= max(spills, 6)
    assert ef.opcodes["LDL"] + ef.opcodes["STL"] <= spills


@pytest.mark.gpu
@pytest.mark.parametrize("B", [64, 128, 256])
def test_evict_first_on_the_h200(kb, B):
    """The runtime's 4k operands (two pools), the batch's default with and without evict_first: bit-equal outputs,
    the reference to 2e-2."""
    q, kv, idx, sink, kv_cat, idx_cat = kb.s7_operands(B)
    outs = []
    base = sad.sm90_config(B, 640)
    for cfg in (base, dataclasses.replace(base, evict_first=True)):
        outs.append(torch.full_like(q, float("nan")))
        kb._attn_kernel(B, 640, cfg, False, False, n_win=kb.S7_WIN)(q, kv, idx, sink, outs[-1])
    assert torch.equal(outs[0], outs[1])
    assert kb.rel_err(outs[0], sad.reference(q, kv_cat, idx_cat, sink)) < 2e-2


# ---------------------------------------------------------------------------------------------- Config.q_regs


def test_q_regs_config_names_and_validates():
    assert dataclasses.replace(WS64, o_smem=True, evict_first=True, q_regs=True).tag == "wsn64s2ofr"
    for bad in (dict(lookahead=True), dict(ws=False, threads=256)):
        with pytest.raises(AssertionError):
            dataclasses.replace(WS64, q_regs=True, **bad)


@pytest.mark.parametrize("persist", [0, 132])
def test_q_regs_sm90_build(codegen_cache, nvcc_required, persist):
    """The defaults' one-pass configs (o_smem, evict_first) with q_regs: Q's left half goes to WG0's registers once per
    request (ldmatrix) and its QK^T half is an RS wgmma (the right half and PV stay SS); spills no more than without."""
    base = dataclasses.replace(WS64, o_smem=True, evict_first=True, persist=persist)
    arts = {}
    for cfg in (base, dataclasses.replace(base, q_regs=True)):
        arts[cfg.q_regs] = build_ws(256, cfg, n_win=128)  # (the plain one: test_evict_first_sm90_build's)
    plain, rs = arts[False], arts[True]
    assert "tl::wgmma_rs<" not in plain.source and "tl::wgmma_rs<" in rs.source and "ptx_ldmatrix" in rs.source
    assert rs.opcodes["LDL"] + rs.opcodes["STL"] <= plain.opcodes["LDL"] + plain.opcodes["STL"]
