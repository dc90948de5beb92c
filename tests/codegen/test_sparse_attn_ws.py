"""The warp-specialised sm90 sparse-attention decode program (sparse_attn_decode._program_ws) on the CPU:

- its per-thread data mapping (`_WsGeom`) covers every KV element, Q element and exponent byte exactly once;
- its CPU mirror on TileLang's c target (same geometry and index arithmetic, same ring, mask, base-2 online
  softmax, split outputs and sink; warpgroups serialised, no barriers) matches the references, bf16 and
  FP8 KV, single pass and split-K with an all-invalid chunk;
- the sm90 programs lower (with their pass config), compile to sm_90a cubins with bf16 wgmma (HGMMA),
  cp.async gathers (LDGSTS), mbarrier synchronisation, no register spills and only its own named barriers.

The synchronisation itself (barrier parities, the producer/consumer ring) only runs on the H200
(tests/codegen/test_gpu_kernels.py, benchmarks/kernels_h200.py --only sparse_attn).
"""

import re

import pytest
import torch

from deepinfer.codegen.kernels import sparse_attn_decode as sad
from tests.codegen._ws_build import build_ws, ws_program


@pytest.mark.parametrize("fp8,bn", [(False, 64), (False, 32), (True, 32)])
def test_ws_loader_mapping_covers_each_element_once(fp8, bn):
    H, D = 64, 512
    cfg = sad.Config(bn, 384, 1, 2 if bn == 64 or fp8 else 4, True)
    g = sad._WsGeom(H, D, 640, cfg, fp8)
    for hf in (0, 1):
        seen = torch.zeros(bn, D, dtype=torch.int32)
        groups = torch.full((bn, g.D2), -1)
        for t in range(128):
            for r in range(g.R):
                row = g.row(r, t)
                if fp8:
                    c0 = hf * g.D2 + g.col8(t)
                    seen[row, c0 : c0 + 16] += 1
                    group = g.scale_word(hf, t) + g.scale_byte(hf, t)  # the exponent byte the thread applies
                    assert group == c0 // 32 and (c0 + 15) // 32 == group  # 16 values, one group
                    assert g.scale_word(hf, t) % 4 == 0 and g.scale_word(hf, t) + 4 <= D // 32
                    groups[row, g.col8(t) : g.col8(t) + 16] = group
                else:
                    for u in range(g.D2 // 64):
                        c0 = hf * g.D2 + g.col(u, t)
                        seen[row, c0 : c0 + 8] += 1
        half = seen[:, hf * g.D2 : (hf + 1) * g.D2]
        assert bool((half == 1).all()), "every element of the half copied exactly once"
        assert int(seen.sum()) == bn * g.D2
    qseen = torch.zeros(H, g.D2, dtype=torch.int32)
    for t in range(128):
        for k in range(g.QC):
            qseen[g.q_row(k, t), g.q_col(k, t) : g.q_col(k, t) + 8] += 1
    assert bool((qseen == 1).all())


def test_ws_smem_fits_and_configs_are_coherent():
    for B in (1, 16, 64, 128, 256):
        for fp8 in (False, True):
            cfg = sad.sm90_config(B, 640, fp8=fp8)
            assert cfg.ws and cfg.threads == sad.WS_THREADS and 640 % (cfg.block_n * cfg.num_split) == 0
            larger = [ns for ns in sad.SPLITS if ns > cfg.num_split and sad.ws_configs(640, ns, fp8=fp8)]
            # ~90% of the SMs covered, or the next split count would need a second wave of CTAs
            unsplit = sad.UNSPLIT_MIN_B and B >= sad.UNSPLIT_MIN_B and not fp8  # (session 9: B64 and up)
            assert B * cfg.num_split >= 0.9 * 132 or not larger or B * larger[0] > 132 or unsplit
            assert B * cfg.num_split <= 132 or cfg.num_split == 1
    assert sad.sm90_config(128, 640).num_split == 1 and sad.sm90_config(64, 640).num_split == 1
    assert sad.sm90_config(32, 640).num_split == 4 and sad.sm90_config(64, 640, fp8=True).num_split == 2
    assert sad.sm90_config(1, 640).num_split != sad.sm90_config(64, 640).num_split  # batch invariance test
    for c in sad.sm90_config_space(64, 640) + sad.sm90_config_space(64, 640, fp8=True):
        assert 640 % (c.block_n * c.num_split) == 0
    # ws program off its supported shapes: the same chunking on the portable program
    assert not sad.ws_supported(8, 64, "sm90") and not sad.ws_supported(64, 512, "sm100")


def _inputs(B, H, D, S, K, seed):
    torch.manual_seed(seed)
    q, kv = torch.randn(B, H, D), torch.randn(S, D)
    idx = torch.randint(0, S, (B, K), dtype=torch.int32)
    idx[:, -5:] = -1  # invalid slots, in the last block
    idx[0, K // 2 :] = -1  # request 0: the second half (a whole split chunk) invalid
    return q, kv, idx, torch.randn(H) * 2


@pytest.mark.parametrize("fp8", [False, True])
def test_ws_cpu_mirror_c_target(tilelang_required, fp8):
    """D = 256 gives two exponent words a row (FP8); 4 blocks of 32 in a 2-stage ring (rounds + no tail)
    single pass, and 2 chunks of 2 blocks with request 0's second chunk all -1 (split + combine)."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    B, H, D, S, K = 2, 64, 256, 300, 128
    q, kv, idx, sink = _inputs(B, H, D, S, K, seed=11)
    if fp8:
        codes, exps = sad.quant_kv_fp8(kv)
        kv_args, kv_ref = (codes.float(), exps), sad.dequant_kv_fp8(codes, exps)
    else:
        kv_args, kv_ref = (kv,), kv
    ref = sad.reference(q, kv_ref, idx, sink)
    f64 = sad.reference_f64_loops(q, kv_ref, idx, sink)
    assert (ref - f64).abs().max() < 1e-5
    one = compile_cpu(sad.program(B, H, D, S, K, target="cpu", cfg=sad.Config(32, 384, 1, 2, True), kv_fp8=fp8))
    out = torch.empty(B, H, D)
    one(q, *kv_args, idx, sink, out)
    assert (out - f64).abs().max() < 1e-5
    cfg = sad.Config(32, 384, 2, 2, True)
    part, comb = (compile_cpu(f) for f in sad.split_programs(B, H, D, S, K, target="cpu", cfg=cfg, kv_fp8=fp8))
    out2 = torch.empty(B, H, D)
    sad.run_split((part, comb), q, kv_args if fp8 else kv, idx, sink, out2, 2)
    assert (out2 - f64).abs().max() < 1e-5


def test_ws_cpu_mirror_odd_blocks_64_rows(tilelang_required):
    """64-row blocks, 3 of them in a 2-stage ring: one full round + a tail block."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    B, H, D, S, K = 2, 64, 128, 500, 192
    q, kv, idx, sink = _inputs(B, H, D, S, K, seed=12)
    kernel = compile_cpu(sad.program(B, H, D, S, K, target="cpu", cfg=sad.Config(64, 384, 1, 2, True)))
    out = torch.empty(B, H, D)
    kernel(q, kv, idx, sink, out)
    assert (out - sad.reference_f64_loops(q, kv, idx, sink)).abs().max() < 1e-5


@pytest.mark.parametrize(
    "cfg,fp8,n_win",
    [
        # B64 default: split 2, 5 blocks (a ring tail), 2 stages of 64 rows
        (sad.Config(64, 384, 2, 2, True), False, 0),
        # FP8 KV: staging + dequant, 20 blocks (the other configs: benchmarks/kernels_h200.py --dry-run)
        (sad.Config(32, 384, 1, 2, True), True, 0),
        # two pools (V4.1: 128 window + 512 compressed entries), the B128 default blocking
        (sad.Config(64, 384, 1, 2, True), False, 128),
    ],
    ids=["bf16_n64s2x2", "fp8_n32s2", "bf16_two_pools_n64s2"],
)
def test_ws_sm90_builds_without_spills(codegen_cache, nvcc_required, cfg, fp8, n_win):
    func = ws_program(64, cfg, n_win, fp8)
    assert dict(func.attrs["tilelang_pass_configs"]) == sad.WS_PASS_CONFIGS  # (build_ws applies them, as tilelang does)
    art = build_ws(64, cfg, n_win, fp8)
    if n_win:  # both pools gathered by cp.async, both index lists read
        assert re.search(r"cp_async_gs\w*<16>\([^;]*KVw\[", art.source)
        assert re.search(r"cp_async_gs\w*<16>\([^;]*KVc\[", art.source)
        assert "IdxW[" in art.source and "IdxC[" in art.source
    ops = art.opcodes
    assert ops["HGMMA"] > 0, "bf16 wgmma (HGMMA) for QK^T and PV"
    assert ops["LDGSTS"] > 0, "cp.async gathers"
    assert ops["SYNCS"] > 0, "mbarrier waits / arrives"
    # register cap 168 a thread at 384 threads; the split epilogue spills one word (4 bytes)
    assert ops["LDL"] + ops["STL"] <= 2, "register spills"
    # named barriers: only the PV warpgroups' own (ids 1, 2: all four warps' MMAs done before a refill);
    # none inserted automatically (they could share an id across warpgroups)
    assert set(re.findall(r"__sync_thread_partial\((\d+), (\d+)\)", art.source)) == {("1", "128"), ("2", "128")}
    assert "__launch_bounds__(384, 1)" in art.source and "setmaxnreg" not in art.source
    if fp8:
        assert "cp_async_wait<1>" in art.source and "fence_proxy_async" in art.source


def _two_pools(B, H, D, Sw, Sc, n_win, K, seed):
    """Window pool, compressed pool and their index lists; the oracle sees the two lists as the graph's
    sparse_attention op does (ir/ops/attention.py), and concatenated pools with offset indices."""
    torch.manual_seed(seed)
    q, kvw, kvc = torch.randn(B, H, D), torch.randn(Sw, D), torch.randn(Sc, D)
    idx_w = torch.randint(0, Sw, (B, n_win), dtype=torch.int32)
    idx_c = torch.randint(0, Sc, (B, K - n_win), dtype=torch.int32)
    idx_w[0, -3:] = -1  # a partly filled window
    idx_c[:, -5:] = -1
    idx_c[1, : (K - n_win) // 2] = -1
    return q, kvw, kvc, idx_w, idx_c, torch.randn(H) * 2


def _two_pool_oracle(q, kvw, kvc, idx_w, idx_c, sink, kv_of=lambda x: x):
    from deepinfer.ir.ops.attention import SparseAttention

    D = q.shape[-1]
    rw, rc = kv_of(kvw), kv_of(kvc)
    op = SparseAttention.reference(q, sink, rw, idx_w, rc, idx_c, scale=D**-0.5)
    cat = torch.cat([idx_w, torch.where(idx_c < 0, -1, idx_c + rw.shape[0])], dim=1)
    f64 = sad.reference_f64_loops(q, torch.cat([rw, rc]), cat, sink)
    assert (op - f64).abs().max() < 1e-5
    return f64


@pytest.mark.parametrize("fp8", [False, True])
def test_ws_cpu_mirror_two_pools(tilelang_required, fp8):
    """Two pools (window list + compressed list, program(n_win=...)): n_win = 36 makes block 0 straddle the
    pools (32-row blocks: rows 0-31 window, block 1 rows 32-35 window then compressed), single pass and split
    2 (a chunk boundary at 64), FP8 with separate exponent pools."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    B, H, D, Sw, Sc, nw, K = 2, 64, 128, 70, 300, 36, 128
    q, kvw, kvc, idx_w, idx_c, sink = _two_pools(B, H, D, Sw, Sc, nw, K, seed=21)
    if fp8:
        (cw, ew), (cc, ec) = sad.quant_kv_fp8(kvw), sad.quant_kv_fp8(kvc)
        kv_args = (cw.float(), ew, cc.float(), ec)
        f64 = _two_pool_oracle(q, (cw, ew), (cc, ec), idx_w, idx_c, sink, lambda p: sad.dequant_kv_fp8(*p))
    else:
        kv_args = (kvw, kvc)
        f64 = _two_pool_oracle(q, kvw, kvc, idx_w, idx_c, sink)
    one = compile_cpu(sad.program(B, H, D, Sw, K, target="cpu", cfg=sad.Config(32, 384, 1, 2, True), kv_fp8=fp8,
                                  n_win=nw, S_cmp=Sc))  # fmt: skip
    out = torch.empty(B, H, D)
    one(q, *kv_args, idx_w, idx_c, sink, out)
    assert (out - f64).abs().max() < 1e-5
    cfg = sad.Config(32, 384, 2, 2, True)
    progs = sad.split_programs(B, H, D, Sw, K, target="cpu", cfg=cfg, kv_fp8=fp8, n_win=nw, S_cmp=Sc)
    out2 = torch.empty(B, H, D)
    sad.run_split(tuple(compile_cpu(f) for f in progs), q, kv_args, (idx_w, idx_c), sink, out2, 2)
    assert (out2 - f64).abs().max() < 1e-5


def test_portable_two_pools_c_target(tilelang_required):
    """The portable program's two-pool form (non-ws shapes, e.g. the small presets): a straddling block."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    B, H, D, Sw, Sc, nw, K = 2, 8, 64, 40, 200, 20, 64
    q, kvw, kvc, idx_w, idx_c, sink = _two_pools(B, H, D, Sw, Sc, nw, K, seed=22)
    f64 = _two_pool_oracle(q, kvw, kvc, idx_w, idx_c, sink)
    kernel = compile_cpu(sad.program(B, H, D, Sw, K, target="cpu", cfg=sad.Config(32, 128), n_win=nw, S_cmp=Sc))
    out = torch.empty(B, H, D)
    kernel(q, kvw, kvc, idx_w, idx_c, sink, out)
    assert (out - f64).abs().max() < 1e-5


def test_diagnostic_configs_name_and_validate_their_parts():
    cfg = sad.Config(64, 384, 1, 2, True, skip="qk,pv")
    assert cfg.skipped == ("qk", "pv") and cfg.tag == "wsn64s2-noqk-nopv"
    assert sad.Config(64, 384, 1, 2, True).tag == "wsn64s2"  # the default names no part
    with pytest.raises(AssertionError):
        sad.Config(64, 384, 1, 2, True, skip="gemm")  # not a part of the program
    with pytest.raises(AssertionError):
        sad.Config(64, 256, 1, 2, skip="qk")  # the portable program has no diagnostic builds


def test_diagnostic_build_leaves_out_its_parts(codegen_cache, nvcc_required):
    """Every global load that arms the ring and every wgmma left out: only the Q copies remain (16 of 16 B a
    thread in each PV warpgroup's code) and no HGMMA -- the build a 'sparse_attn diag' row times."""
    cfg = sad.Config(64, 384, 1, 2, True, skip="gather,ids,qk,pv")
    art = build_ws(64, cfg)
    assert art.opcodes["HGMMA"] == 0 and art.opcodes["LDGSTS"] == 2 * 16
    assert art.opcodes["SYNCS"] > 0  # the ring's barriers stay: the skeleton's own cost is what is timed


@pytest.mark.parametrize("ns", [2, 5])
def test_combine_wide_matches_combine_and_oracle(tilelang_required, ns):
    """combine_program_wide (CTA per request x 8 heads; 2 chunks: Op preloaded to registers, 5: read after the
    weights) against combine_program and the formula in float64, with an all-invalid chunk (m = NEG, l = 0)."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    B, H, D = 3, 16, 64
    torch.manual_seed(31)
    op, mp, lp = torch.randn(B, ns, H, D), torch.randn(B, ns, H) * 3, torch.rand(B, ns, H) * 5
    mp[1, 1], lp[1, 1], op[1, 1] = -1.0e30 * D**-0.5, 0.0, 0.0  # what the first kernel writes for such a chunk
    sink = torch.randn(H)
    top = torch.maximum(mp.double().amax(1), sink.double().view(1, H))  # [B, H]
    w = torch.exp(mp.double() - top.unsqueeze(1))  # [B, ns, H]
    den = (lp.double() * w).sum(1) + torch.exp(sink.double().view(1, H) - top)
    want = (op.double() * w.unsqueeze(-1)).sum(1) / den.unsqueeze(-1)
    outs = []
    for prog in (sad.combine_program, sad.combine_program_wide):
        out = torch.empty(B, H, D)
        compile_cpu(prog(B, H, D, ns, target="cpu"))(op, mp, lp, sink, out)
        outs.append(out)
    assert (outs[1] - want).abs().max() < 1e-5 and (outs[1] - outs[0]).abs().max() < 1e-5


def test_bulk_config_names_and_validates():
    assert sad.Config(32, 384, 2, 4, True, skip="qk,pv", copy="bulk").tag == "wsn32s4x2B-noqk-nopv"
    with pytest.raises(AssertionError):
        sad.Config(64, 384, 1, 2, True, copy="bulk")  # its rows land unswizzled: the wgmmas must be left out


def test_bulk_copy_diagnostic_build(codegen_cache, nvcc_required):
    """copy="bulk" (diagnostic, no QK^T / PV): rows by 1-D bulk copies (UBLKCP) whose bytes the ring barrier
    expects, no wgmma, no proxy fence before the (absent) MMAs."""
    cfg = sad.Config(64, 384, 1, 2, True, skip="qk,pv", copy="bulk")
    art = build_ws(128, cfg)
    assert art.opcodes["UBLKCP"] > 0 and art.opcodes["HGMMA"] == 0
    assert "expect_transaction(32768)" in art.source  # 64 half-rows of 512 B per barrier phase



def test_l2_prefetch_config_names_and_validates():
    assert sad.Config(64, 384, 2, 2, True, l2_prefetch=2).tag == "wsn64s2x2pf2"
    with pytest.raises(AssertionError):
        sad.Config(64, 256, 1, 2, l2_prefetch=1)  # the ws program's refills issue it
    with pytest.raises(AssertionError):
        sad.Config(64, 384, 1, 2, True, skip="qk,pv", copy="bulk", l2_prefetch=1)
    with pytest.raises(AssertionError):  # FP8 KV stages its rows a ring ahead already
        sad.program(64, 64, 512, 1 << 18, 640, target="sm90", cfg=sad.Config(32, 384, 1, 2, True, l2_prefetch=1),
                    kv_fp8=True)  # fmt: skip


def test_l2_prefetch_sm90_build(codegen_cache, nvcc_required):
    """l2_prefetch=2 (B64 split 2, two pools: 5 blocks, so the prefetches past the chunk are guarded): bulk L2
    prefetches (UBLKPF) of half-rows, their row ids in one more id slot; no spills. The targets are blocks 2+ of
    a chunk, entries >= 128 = n_win: TileLang proves them all in the compressed pool."""
    cfg = sad.Config(64, 384, 2, 2, True, l2_prefetch=2)
    art = build_ws(64, cfg, n_win=128)
    assert "UBLKPF" in art.sass and art.opcodes["HGMMA"] > 0 and art.opcodes["LDGSTS"] > 0
    calls = re.findall(r"di_prefetch_l2\(\(&\((\w+)\[[^;]*\), (\d+)\);", art.source)
    assert calls and all(pool == "KVc" and size == "512" for pool, size in calls), "half-rows (512 B)"
    assert art.opcodes["LDL"] + art.opcodes["STL"] <= 2


def test_one_wave_split_rule():
    """sm90_config (one_wave, the default): where the ~90%-coverage split count would launch a second wave of CTAs
    (B16: x10 = 160, B8: x20 = 160 on 132 SMs), the largest split count that fits one wave; elsewhere as before."""
    assert sad.sm90_config(16, 640, one_wave=False).num_split == 10 and sad.sm90_config(16, 640).num_split == 5
    assert sad.sm90_config(8, 640, one_wave=False).num_split == 20 and sad.sm90_config(8, 640).num_split == 10
    for B in (1, 2, 32, 64, 128, 256):
        assert sad.sm90_config(B, 640, one_wave=False) == sad.sm90_config(B, 640)
    for B in (1, 8, 16, 32, 48, 64):
        cfg = sad.sm90_config(B, 640, one_wave=True)
        assert B * cfg.num_split <= 132 and 640 % (cfg.block_n * cfg.num_split) == 0


def test_trace_config_names_and_validates():
    assert sad.Config(64, 384, 1, 2, True, trace=True).tag == "wsn64s2T"
    assert sad.trace_slots(10) == sad.TRACE_BLOCK0 + 6 * 10 and len(sad.TRACE_EVENTS) == sad.TRACE_PER_BLOCK
    for bad in (dict(persist=132), dict(lookahead=True)):
        with pytest.raises(AssertionError):
            sad.Config(64, 384, 1, 2, True, trace=True, **bad)
    with pytest.raises(AssertionError):  # the one-pool entry has no Trace argument
        sad.program(128, 64, 512, 1 << 18, 640, target="sm90", cfg=sad.Config(64, 384, 1, 2, True, trace=True))


@pytest.mark.parametrize("ns", [1, 2])
def test_trace_sm90_build_stamps_every_block(codegen_cache, nvcc_required, ns):
    """Config.trace: a trailing int64 Trace argument; thread 0 of WG0 stamps 4 events a block and thread 0 of WG1
    2 (6 slots a block, TRACE_BLOCK0 on), plus the CTA's start / Q / fin / end stamps; no spills."""
    cfg = sad.Config(64, 384, ns, 2, True, trace=True)
    assert ws_program(128, cfg, n_win=128).params[-1].name.startswith("Trace")
    art = build_ws(128, cfg, n_win=128)  # (ns 1: also test_sparse_attn_s9's tail-stamp build)
    assert art.opcodes["LDL"] + art.opcodes["STL"] == 0
    slots = sad.trace_slots(640 // ns // 64)
    stamped = {int(m) for m in re.findall(r"\+ \(int64_t\)(\d+)\)\] = di_clock\(\)", art.source)}
    assert set(range(sad.TRACE_BLOCK0, sad.TRACE_BLOCK0 + 2 * sad.TRACE_PER_BLOCK)) <= stamped  # a ring round
    assert {sad.TRACE_CLK0, sad.TRACE_Q, sad.TRACE_END, sad.TRACE_FIN} <= stamped | {0, 1}
    assert art.source.count("di_gtimer()") >= 3 and f"* (int64_t){slots})" in art.source
