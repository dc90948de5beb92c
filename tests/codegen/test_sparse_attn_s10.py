"""Session 10's options of the warp-specialised sparse-attention decode (sparse_attn_decode._program_ws):

- Config.evict_first: the 16-B cp.async copies (KV rows, row ids, Q) under an L2 evict_first cache policy. Only the
  copies' policy changes, so the CPU mirror has nothing to mirror; the sm90 build routes every copy through the
  prelude's di_cp_async_ef (no plain tl::cp_async_gs left), keeps the plain build's copy count, and spills nothing.
On the H200: the output equals the config's without it bit for bit.
"""

import dataclasses
import re

import pytest
import torch

from deepinfer.codegen.kernels import sparse_attn_decode as sad

WS64 = sad.Config(64, sad.WS_THREADS, 1, 2, True)


def _build_ws(name, func):
    import tvm

    from deepinfer.codegen import tilelang_backend as tb

    with tvm.transform.PassContext(config=sad.WS_PASS_CONFIGS):
        return tb.build(name, func, "sm90")


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
        arts[cfg.evict_first] = _build_ws(f"sparse_attn_ws_{cfg.tag}_2p", sad.program(
            256, 64, 512, 1 << 18, 640, target="sm90", cfg=cfg, n_win=128))  # fmt: skip
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


# ---------------------------------------------------------------------------------------------- Config.pair

PAIR = sad.Config(64, sad.WS_THREADS, 2, 2, True, pair=True)


def test_pair_config_names_and_validates():
    assert PAIR.tag == "wsn64s2x2c" and dataclasses.replace(PAIR, evict_first=True).tag == "wsn64s2x2fc"
    for bad in (dict(num_split=1), dict(num_split=4), dict(block_n=32, stages=4), dict(persist=132),
                dict(o_smem=True), dict(partial_bf16=True), dict(lookahead=True), dict(ws=False, threads=256)):
        with pytest.raises(AssertionError):
            dataclasses.replace(PAIR, **bad)


def test_pair_pieces_cover_each_output_once():
    """Both CTAs' PV warpgroups: 2 ranks x 128 threads x pair_pieces pieces of 8 columns cover H x D2 (each half) once,
    rank r only heads r * H/2 .. ; a warp's piece is one head's 8 x 32 contiguous columns."""
    for D in (128, 512):
        g = sad._WsGeom(64, D, 640, PAIR, False)
        seen = torch.zeros(64, g.D2, dtype=torch.int32)
        for rank in (0, 1):
            for t in range(128):
                for k in range(g.pair_pieces(64)):
                    row, col = g.pair_row(64, k, t, rank), g.q_col(k, t)
                    assert rank * 32 <= row < rank * 32 + 32
                    seen[row, col : col + 8] += 1
        assert bool((seen == 1).all()), D
    g = sad._WsGeom(64, 512, 640, PAIR, False)
    assert {g.pair_row(64, 0, t, 1) for t in range(32)} == {32} and sorted(g.q_col(0, t) for t in range(32)) == list(
        range(0, 256, 8))


def test_pair_cpu_mirror_matches_the_oracle(tilelang_required):
    """The c-target mirror (both chunks, then the epilogue's pieces with the same weights, base-2 max / sum and sink):
    two pools, request 1's second chunk all -1 (weight exactly 0), against the float64 oracle."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    B, H, D, S, K, n_win = 2, 64, 128, 500, 256, 64
    torch.manual_seed(41)
    q, kv, sink = torch.randn(B, H, D), torch.randn(S, D), torch.randn(H) * 2
    idx = torch.randint(0, S, (B, K), dtype=torch.int32)
    idx[1, K // 2 :] = -1
    idx[0, 3] = -1
    kernel = compile_cpu(sad.program(B, H, D, S, K, target="cpu", cfg=PAIR, n_win=n_win, S_cmp=S))
    out = torch.full((B, H, D), float("nan"))
    kernel(q, kv, kv, idx[:, :n_win].contiguous(), idx[:, n_win:].contiguous(), sink, out)
    f64 = sad.reference_f64_loops(q, kv, idx, sink)
    assert (out - f64).abs().max() < 1e-5


def test_pair_sm90_build(codegen_cache, nvcc_required):
    """Two pools, B64: no spills; both cluster barriers in all three warpgroups (6 arrive / wait pairs); O leaves in
    16-B stores only, pair_pieces a PV thread; the partner's values read over DSMEM (mapa)."""
    art = _build_ws(f"sparse_attn_ws_{PAIR.tag}_2p", sad.program(64, 64, 512, 1 << 18, 640, target="sm90", cfg=PAIR,
                                                                 n_win=128))  # fmt: skip
    ops = art.opcodes
    assert ops["LDL"] + ops["STL"] == 0 and ops["HGMMA"] > 0
    assert ops["UCGABAR_ARV"] == ops["UCGABAR_WAIT"] == 6
    stores = re.findall(r"\bSTG\.E[.A-Z0-9]*", art.sass)
    g = sad._WsGeom(64, 512, 640, PAIR, False)
    assert stores and all(s.endswith(".128") for s in stores) and len(stores) == 2 * g.pair_pieces(64), stores
    assert len(re.findall(r"(?<!void )\bdi_pair_out8\(", art.source)) == 2 * g.pair_pieces(64)
    assert "mapa.shared::cluster" in art.source and not re.search(r"\b(Op|Mp|Lp)\b", art.source)  # no partials


def test_pair_switch_reaches_b64(monkeypatch):
    """DECODE_PAIR (off): B64 (unsplit by default) and B48 (split 2) become pair configs; B32 (split 4), B128 / B256,
    FP8 KV and prefill stay."""
    before = {b: sad.sm90_config(b, 640) for b in (32, 48, 64, 128, 256)}
    assert not any(c.pair for c in before.values())
    monkeypatch.setattr(sad, "DECODE_PAIR", 1)
    after = {b: sad.sm90_config(b, 640) for b in before}
    assert after[64].tag == "wsn64s2x2c" and after[48].tag == "wsn64s2x2c"
    assert all(after[b] == before[b] for b in (32, 128, 256))
    assert not sad.sm90_config(64, 640, fp8=True).pair and not sad.prefill_config(8192, 640).pair


@pytest.mark.gpu
@pytest.mark.parametrize("B", [64, 48])
def test_pair_on_the_h200(kb, B):
    """The runtime's 4k operands (two pools): the pair config against the reference (2e-2) and the default's output
    (another rounding: within 1e-2), with and without evict_first (bit-equal)."""
    q, kv, idx, sink, kv_cat, idx_cat = kb.s7_operands(B)
    outs = []
    for cfg in (sad.sm90_config(B, 640), PAIR, dataclasses.replace(PAIR, evict_first=True)):
        outs.append(torch.full_like(q, float("nan")))
        kb._attn_kernel(B, 640, cfg, False, False, n_win=kb.S7_WIN)(q, kv, idx, sink, outs[-1])
    assert kb.rel_err(outs[1], sad.reference(q, kv_cat, idx_cat, sink)) < 2e-2
    assert kb.rel_err(outs[1], outs[0]) < 1e-2 and torch.equal(outs[1], outs[2])


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
        arts[cfg.q_regs] = _build_ws(f"sparse_attn_ws_{cfg.tag}_2p", sad.program(
            256, 64, 512, 1 << 18, 640, target="sm90", cfg=cfg, n_win=128))  # fmt: skip
    plain, rs = arts[False], arts[True]
    assert "tl::wgmma_rs<" not in plain.source and "tl::wgmma_rs<" in rs.source and "ptx_ldmatrix" in rs.source
    assert rs.opcodes["LDL"] + rs.opcodes["STL"] <= plain.opcodes["LDL"] + plain.opcodes["STL"]


@pytest.mark.parametrize("builder", ["emulated_kernel", "c_target_kernel"])
def test_pair_binding_runs_as_one_kernel_behind_the_adapter(monkeypatch, builder):
    """A pair config bound to a sparse_attention node (as DECODE_PAIR would bind it): one kernel key (no combine), the
    single pass's call; the docstring stand-in and the c-target mirror against the node's reference (bf16 operands)."""
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import kernel_adapters as ka

    if builder == "c_target_kernel":
        pytest.importorskip("tilelang")
    monkeypatch.setattr(ka, "EMULATE", True)
    g = torch.Generator().manual_seed(5)
    t, h, d = 2, 64, 128  # (a power of two: the c-target mirror's batch is static, the sm90 one's symbolic)
    q, sink = torch.randn(t, h, d, generator=g), torch.randn(h, generator=g)
    win_kv, cmp_kv = torch.randn(50, d, generator=g), torch.randn(200, d, generator=g)
    win_idx, cmp_idx = torch.randint(0, 50, (t, 64), generator=g), torch.randint(0, 200, (t, 64), generator=g)
    cmp_idx[-1] = -1  # a query whose second chunk is all invalid
    args = [q, sink, win_kv, win_idx, cmp_kv, cmp_idx]
    config = dataclasses.asdict(PAIR)
    call = ka.Call("sparse_attention", {"scale": d**-0.5}, args, [f"a{i}" for i in range(6)], [False] * 6, config, {})
    adapter = ka.adapter_for("sparse_attn_decode", call.op)
    keys = adapter.keys(call)
    assert len(keys) == 1 and dict(dict(keys[0].kwargs)["cfg"])["pair"]
    got = adapter.run(call, [getattr(ka, builder)(k) for k in keys])[0]
    ref = get_op("sparse_attention").run(call.args, call.attrs)[0]
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
