"""Session 9's options of the warp-specialised sparse-attention decode (sparse_attn_decode._program_ws):

- Config.o_smem: the O epilogue through the PV warpgroup's free KV stage 0 and 16-B stores. The CPU mirror stages O
  in the same place and stores it with the same per-thread pieces (`_WsGeom.q_row / q_col`); out starts as NaN, so
  a piece the mapping missed fails the oracle check. The sm90 build: 16 STG.128 a PV thread instead of 64 STG.32;
- Config.skip "ostore" / "ovals" (diagnostics: no O stores / zeros from a rolled loop) and the trace's tail stamps
  (fin waited, WG2's stores issued).
On the H200: o_smem's output equals the default's bit for bit (the same values stored another way).
"""

import dataclasses
import re

import pytest
import torch

from deepinfer.codegen.kernels import sparse_attn_decode as sad
from tests.codegen._ws_build import build_ws

WS64 = sad.Config(64, sad.WS_THREADS, 1, 2, True)


def _sass_ops(art) -> list[str]:
    return re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\d\s+)?([A-Z][A-Z0-9_.]*)", art.sass)


def test_o_smem_config_names_and_validates():
    assert dataclasses.replace(WS64, o_smem=True).tag == "wsn64s2o"
    assert dataclasses.replace(WS64, skip="ostore").tag == "wsn64s2-noostore"
    assert dataclasses.replace(WS64, o_smem=True, persist=132).tag == "wsn64s2p132o"
    for bad in (dict(num_split=2), dict(block_n=32, stages=4), dict(ws=False, threads=256)):  # fp32 partials
        with pytest.raises(AssertionError):
            dataclasses.replace(WS64, o_smem=True, **bad)
    # on from session 9's call 3 on the one-pass configs (B64 unsplit too), never on a split one
    assert all(sad.sm90_config(b, 640).o_smem for b in (64, 128, 256)) and not sad.sm90_config(16, 640).o_smem


def test_o_smem_pieces_cover_the_half_tile_once():
    """The store pieces (Q's copy mapping): 128 threads x QC pieces of 8 columns cover H x D2 once."""
    g = sad._WsGeom(64, 512, 640, dataclasses.replace(WS64, o_smem=True), False)
    seen = torch.zeros(64, g.D2, dtype=torch.int32)
    for t in range(128):
        for k in range(g.QC):
            seen[g.q_row(k, t), g.q_col(k, t) : g.q_col(k, t) + 8] += 1
    assert bool((seen == 1).all())
    # one warp's piece k: 32 threads x 16 B = one head's 512 contiguous bytes of the half
    assert {g.q_row(0, t) for t in range(32)} == {0} and sorted(g.q_col(0, t) for t in range(32)) == list(
        range(0, g.D2, 8)
    )


@pytest.mark.parametrize("n_win", [0, 64])
def test_o_smem_cpu_mirror_matches_the_oracle_and_the_default(tilelang_required, n_win):
    """64-row blocks, 3 of them (a ring round + a tail block), one pool and two; o_smem equals the default mirror
    exactly (the same values through stage 0) and the float64 oracle to 1e-5."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    B, H, D, S, K = 2, 64, 128, 500, 192
    torch.manual_seed(31)
    q, kv, sink = torch.randn(B, H, D), torch.randn(S, D), torch.randn(H) * 2
    idx = torch.randint(0, S, (B, K), dtype=torch.int32)
    idx[:, -5:] = -1
    f64 = sad.reference_f64_loops(q, kv, idx, sink)
    args = (kv, kv, idx[:, :n_win].contiguous(), idx[:, n_win:].contiguous()) if n_win else (kv, idx)
    outs = {}
    for o_smem in (False, True):
        cfg = dataclasses.replace(WS64, o_smem=o_smem)
        kernel = compile_cpu(sad.program(B, H, D, S, K, target="cpu", cfg=cfg, n_win=n_win, S_cmp=S))
        outs[o_smem] = torch.full((B, H, D), float("nan"))
        kernel(q, *args, sink, outs[o_smem])
    assert (outs[True] - f64).abs().max() < 1e-5
    assert torch.equal(outs[True], outs[False])


def test_o_smem_split_cpu_mirror_and_build(tilelang_required, codegen_cache, nvcc_required):
    """The split pass with bf16 partials through the stage (tag "ho"): the mirror's split + combine equals the split
    mirror's without o_smem exactly; the sm90 build stores the partial in 16-B pieces only (no 4-B ones), no spills."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    B, H, D, S, K = 2, 64, 128, 500, 256
    torch.manual_seed(33)
    q, kv, sink = torch.randn(B, H, D), torch.randn(S, D), torch.randn(H) * 2
    idx = torch.randint(0, S, (B, K), dtype=torch.int32)
    idx[1, K // 2 :] = -1
    outs = []
    for o_smem in (False, True):
        cfg = sad.Config(64, 384, 2, 2, True, partial_bf16=True, o_smem=o_smem)
        progs = sad.split_programs(B, H, D, S, K, target="cpu", cfg=cfg)
        outs.append(torch.full((B, H, D), float("nan")))
        sad.run_split(tuple(compile_cpu(f) for f in progs), q, kv, idx, sink, outs[-1], 2)
    assert torch.equal(outs[0], outs[1]) and (outs[1] - sad.reference_f64_loops(q, kv, idx, sink)).abs().max() < 1e-5
    cfg = sad.Config(64, 384, 2, 2, True, partial_bf16=True, o_smem=True)
    assert cfg.tag == "wsn64s2x2ho"
    art = build_ws(64, cfg, n_win=128)
    stores = [o for o in _sass_ops(art) if o.startswith("STG")]
    assert art.opcodes["LDL"] + art.opcodes["STL"] == 0 and sum(o.endswith(".128") for o in stores) == 32
    assert "*(uint4*)(Op +" in art.source


def test_o_smem_sm90_build(codegen_cache, nvcc_required):
    """Two pools, the B128 blocking: no spills; O leaves in 16-B stores (16 a PV thread, 32 in the code) and no
    4-B ones; the tile's writes are ordered by the warpgroups' own named barriers (ids 1, 2) only."""
    cfg = dataclasses.replace(WS64, o_smem=True)
    art = build_ws(128, cfg, n_win=128)
    ops = _sass_ops(art)
    assert art.opcodes["LDL"] + art.opcodes["STL"] == 0 and art.opcodes["HGMMA"] > 0
    stores = [o for o in ops if o.startswith("STG")]
    assert len(stores) == 2 * 16 and all(o.endswith(".128") for o in stores), stores
    assert set(re.findall(r"__sync_thread_partial\((\d+), (\d+)\)", art.source)) == {("1", "128"), ("2", "128")}


def test_o_smem_persistent_sm90_build(codegen_cache, nvcc_required):
    """The persistent grid with o_smem: only STG.128 stores; the next request's gather into the last stage
    follows the stores (after a named barrier), its other gathers stay in the last round."""
    cfg = dataclasses.replace(WS64, o_smem=True, persist=132)
    art = build_ws(256, cfg, n_win=128)  # (test_sparse_attn_s10's plain persistent build: one build)
    stores = [o for o in _sass_ops(art) if o.startswith("STG")]
    # 16 a warpgroup; ptxas may share one copy of the two warpgroups' identical store tails
    assert len(stores) in (16, 2 * 16) and all(o.endswith(".128") for o in stores), stores
    assert art.opcodes["LDL"] + art.opcodes["STL"] <= 6  # the persistent default's own 3 + 3
    # each PV warpgroup: its last 16-B store of O, then its named barrier, before the refill's copies
    after = re.findall(r"\*\(uint4\*\)\(O \+[^;]*;\s*tl::__sync_thread_partial\((\d), 128\);\s*if[^{]*\{\s*"
                       r"(?:int row_\d+ = rid\[\d\];\s*)?tl::cp_async_gs", art.source)  # fmt: skip
    assert sorted(after) == ["1", "2"], after


def _o_stores(source: str) -> list[str]:
    """The O stores of a ws build's CUDA source, each with the code between the previous one (or the fin wait)."""
    return re.findall(r"(?s)fin\[0\]\.wait\(0\);(.*?)\*\(uint1\*\)\(O \+", source)


def test_ostore_ovals_skips_and_tail_stamps_build(codegen_cache, nvcc_required):
    """Config.trace writes the session-9 tail stamps (WG1 after fin, WG2 after its stores). skip "ostore": the O
    stores only under a branch never taken (fin_s > 0), which keeps every PV wgmma (the default's HGMMA count);
    "ovals": zeros stored from a rolled loop first (#pragma unroll 1), the same guard after."""
    counts = {}
    for skip in ("", "ostore", "ovals"):
        cfg = dataclasses.replace(WS64, trace=True, skip=skip)
        art = build_ws(128, cfg, n_win=128)  # (skip "": test_sparse_attn_ws's trace build at one split)
        counts[skip] = art.opcodes["HGMMA"]
        assert art.opcodes["LDL"] + art.opcodes["STL"] == 0
        stamped = {int(m) for m in re.findall(r"\+ \(int64_t\)(\d+)\)\] = di_clock\(\)", art.source)}
        assert {sad.TRACE_FIN_WAITED, sad.TRACE_END2} <= stamped
        first = _o_stores(art.source)
        assert len(first) == 2, "one O store sequence a PV warpgroup"
        guarded = ["((float*)fin_s)[0] < 0" in gap for gap in first]
        rolled = ["#pragma unroll 1" in gap for gap in first]
        assert guarded == [bool(skip) and skip == "ostore"] * 2 and rolled == [skip == "ovals"] * 2, (skip, first)
    assert counts["ostore"] == counts["ovals"] == counts[""]
    with pytest.raises(AssertionError):
        dataclasses.replace(WS64, num_split=2, skip="ostore")


@pytest.mark.gpu
@pytest.mark.parametrize("B,persist", [(128, 0), (64, 0), (256, 132)])
def test_o_smem_on_the_h200(kb, B, persist):
    """The runtime's 4k operands (two pools): o_smem's output equals the program's without it bit for bit, and the
    reference to 2e-2 (B64: the unsplit single pass; B256: the persistent grid, where the next request's block waits
    for the stores)."""
    q, kv, idx, sink, kv_cat, idx_cat = kb.s7_operands(B)
    outs = []
    base = dataclasses.replace(WS64, persist=persist)
    for cfg in (base, dataclasses.replace(base, o_smem=True)):
        outs.append(torch.full_like(q, float("nan")))
        kb._attn_kernel(B, 640, cfg, False, False, n_win=kb.S7_WIN)(q, kv, idx, sink, outs[-1])
    for out in outs[1:]:
        assert torch.equal(outs[0], out)
    assert kb.rel_err(outs[0], sad.reference(q, kv_cat, idx_cat, sink)) < 2e-2
