"""Sparse attention at prefill (issue 6): a chunk of T query tokens through sparse_attn_decode's program at B = T.

Why that is the prefill program: the graph's sparse_attention op is per query -- each token carries its own
window list (window_indices over [SWA ring ; this chunk's own KV rows]: causal inside the chunk, -1 before
position 0) and its own compressed selection (-1 where it sees fewer entries than top-k), and the chunk's rows
are an input of the op (the concat), so nothing is read before it is written. These tests build the indices the
way the graph does and compare with the op's torch reference:

- the ws program's CPU mirror (TileLang's c target, fp32) on a chunk at position 0 and on a second chunk;
- the binding: prefill buckets bind sparse_attn_decode with prefill_config on sm90 (no split, 64-row blocks);
- the runtime adapter at prefill with emulated kernels: no padded query rows (the ws batch is symbolic), long
  chunks launched in pieces of MAX_LAUNCH_ROWS, the persistent config passed through.
The H200 checks of the same inputs at real sizes: tests/codegen/test_gpu_kernels.py -k prefill.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.codegen.kernels import sparse_attn_decode as sad
from deepinfer.ir.ops.attention import SparseAttention, WindowIndices


def chunk_operands(T, H, D, window, n_sel, start, ratio, seed):
    """q, sink and the two pools with the graph's index lists for the chunk at positions start .. start+T-1."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(start, start + T)
    win_idx = WindowIndices.reference(pos, window=window).to(torch.int32)
    C = (start + T) // ratio
    visible = torch.arange(C) < ((pos + 1) // ratio).unsqueeze(-1)
    scores = torch.rand(T, C, generator=g).masked_fill(~visible, -1.0)
    top = scores.topk(min(n_sel, C), dim=-1)
    cmp_idx = torch.full((T, n_sel), -1, dtype=torch.int32)
    cmp_idx[:, : top.indices.shape[1]] = torch.where(top.values >= 0, top.indices, -1).to(torch.int32)
    q = torch.randn(T, H, D, generator=g)
    win_kv, cmp_kv = torch.randn(window + T, D, generator=g), torch.randn(max(C, 1), D, generator=g)
    return q, torch.randn(H, generator=g) * 2, win_kv, win_idx, cmp_kv, cmp_idx


def test_chunk_operands_are_what_the_graph_builds():
    """The oracle's inputs have the structure the kernel must handle: early tokens with -1 window slots and no
    compressed entry, a token's own row in its window (causality), no entry past a token's position."""
    q, sink, win_kv, win_idx, cmp_kv, cmp_idx = chunk_operands(40, 4, 16, 8, 8, 0, 2, seed=1)
    assert (win_idx[0] >= 0).sum() == 1 and int(win_idx[0, -1]) == 8  # position 0: only its own row (ring + 0)
    assert bool((win_idx[20] == torch.arange(8 + 13, 8 + 21)).all())  # positions 13..20, rows W + p
    assert bool((cmp_idx[0] == -1).all()) and int((cmp_idx[9] >= 0).sum()) == 5  # p = 9 sees w < 5
    assert int(cmp_idx.max()) < 20 and bool(((cmp_idx < ((torch.arange(40) + 1) // 2).unsqueeze(-1))).all())


@pytest.mark.parametrize("start,ratio", [(0, 2), (96, 1)], ids=["first_chunk", "second_chunk_ratio1"])
def test_ws_mirror_on_a_prefill_chunk(tilelang_required, start, ratio):
    """The ws program at B = T (its CPU mirror: same geometry, ring, mask and softmax) on graph-built indices:
    window 32 (n_win 32, one 32-row block), 32 selected entries, 2 blocks in a 2-stage ring."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    T, H, D, W, n_sel = 24, 64, 128, 32, 32
    q, sink, win_kv, win_idx, cmp_kv, cmp_idx = chunk_operands(T, H, D, W, n_sel, start, ratio, seed=3)
    want = SparseAttention.reference(q, sink, win_kv, win_idx, cmp_kv, cmp_idx, scale=D**-0.5)
    cat = torch.cat([win_idx, torch.where(cmp_idx < 0, -1, cmp_idx + win_kv.shape[0])], dim=1)
    f64 = sad.reference_f64_loops(q, torch.cat([win_kv, cmp_kv]), cat, sink)
    assert (want.double() - f64).abs().max() < 1e-5  # the op's reference and the loop oracle agree
    cfg = sad.Config(32, 384, 1, 2, True)
    kernel = compile_cpu(sad.program(T, H, D, win_kv.shape[0], W + n_sel, target="cpu", cfg=cfg, n_win=W,
                                     S_cmp=cmp_kv.shape[0]))  # fmt: skip
    out = torch.empty(T, H, D)
    kernel(q, win_kv, cmp_kv, win_idx, cmp_idx, sink, out)
    assert (out - f64).abs().max() < 1e-5


def test_prefill_config_rules():
    for topk in (640, 1152):
        cfg = sad.prefill_config(8192, topk, persist=False)
        assert cfg.ws and cfg.num_split == 1 and cfg.block_n == 64 and cfg.stages == 2 and not cfg.persist
        p = sad.prefill_config(8192, topk, 132, persist=True)
        assert p.persist == 132 and p.tag == "wsn64s2p132" and (topk // p.block_n) % p.stages == 0
    assert sad.prefill_config(4096, 640) == sad.prefill_config(64000, 640)  # T is not part of the choice
    assert sad.prefill_config(8192, 640).persist == 132  # the default (PREFILL_PERSIST)
    assert not sad.prefill_config(4096, 96, persist=True).persist  # 3 blocks of 32: not whole rounds of 2 stages
    with pytest.raises(AssertionError):
        sad.Config(64, 384, 2, 2, True, persist=132)  # the persistent grid is a single pass
    b = sad.prefill_roofline(8192, 64, 512, 640, 128 + 8192 + 4096)
    assert b["flops"] == 4 * 8192 * 64 * 640 * 512 and b["gathers"] == 8192 * 640 * 1024
    # V4.1 at 8192 tokens: matrix time (at ~700 TFLOPS) well above the HBM bytes' (at ~4.3 TB/s)
    assert b["flops"] / 700e12 > 3 * b["hbm"] / 4.3e12


def _attention_graph(heads: int, dim: int, window: int, n_sel: int):
    from deepinfer.ir.builder import GraphBuilder

    b = GraphBuilder("attn")
    q = b.input("q", "f32", ["T", heads, dim])
    sink = b.input("sink", "f32", [heads])
    win_kv = b.input("win_kv", "f32", [window + 8192, dim])
    win_idx = b.input("win_idx", "i64", ["T", window])
    cmp_kv = b.input("cmp_kv", "f32", [4096, dim])
    cmp_idx = b.input("cmp_idx", "i64", ["T", n_sel])
    b.output(b.sparse_attention(q, sink, win_kv, win_idx, cmp_kv, cmp_idx, scale=dim**-0.5))
    return b.build()


def test_prefill_bucket_binds_the_attention_kernel():
    from deepinfer.passes.select_kernels import select_kernels

    buckets = {"decode": {"T": 1}, "prefill": {"T": 8192}}
    g = select_kernels(_attention_graph(64, 512, 128, 512), target="sm90", buckets=buckets)
    rec = next(iter(g.meta["kernels"]["nodes"].values()))["buckets"]
    assert rec["prefill"]["family"] == "sparse_attn_decode", rec["prefill"]
    assert rec["prefill"]["shape"]["prefill"] and rec["prefill"]["shape"]["B"] == 8192
    want = sad.prefill_config(8192, 640, 132)
    assert rec["prefill"]["config"]["num_split"] == 1 and rec["prefill"]["config"]["persist"] == want.persist
    assert rec["decode"]["config"]["num_split"] > 1  # decode keeps split-K
    cpu = select_kernels(_attention_graph(64, 512, 128, 512), target="cpu", buckets=buckets)
    rec = next(iter(cpu.meta["kernels"]["nodes"].values()))["buckets"]
    assert rec["prefill"]["family"] == "torch_ref" and "sm90" in rec["prefill"]["reason"]


@pytest.mark.parametrize("persist", [0, 132])
def test_adapter_at_prefill_runs_unpadded_rows_in_pieces(monkeypatch, persist):
    """300 queries (a prefill bucket) through the adapter with emulated kernels: the ws single pass sees exactly
    300 rows (no pad to 512), in pieces of MAX_LAUNCH_ROWS (here 128: 3 launches) unless persistent (1)."""
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setattr(ka, "EMULATE", True)
    monkeypatch.setattr(sad, "MAX_LAUNCH_ROWS", 128)
    T, H, D, W, n_sel = 300, 64, 128, 32, 96  # 4 blocks of 32: whole rounds of the 2-stage ring (persist)
    args = list(chunk_operands(T, H, D, W, n_sel, 40, 2, seed=5))
    cfg = {"block_n": 32, "num_split": 1, "stages": 2, "ws": True, "threads": 384, "persist": persist}
    call = ka.Call("sparse_attention", {"scale": D**-0.5}, args, [f"a{i}" for i in range(6)], [False] * 6, cfg, {})
    adapter = ka.adapter_for("sparse_attn_decode", "sparse_attention")
    keys = adapter.keys(call)
    assert len(keys) == 1 and keys[0].args[0] == 512 and dict(dict(keys[0].kwargs)["cfg"])["persist"] == persist
    rows = []
    emulated = ka.emulated_kernel(keys[0])

    def kernel(q, *rest):
        rows.append(q.shape[0])
        emulated(q, *rest)

    out = adapter.run(call, [kernel])[0]
    assert rows == ([300] if persist else [128, 128, 44])
    ref = get_op("sparse_attention").run(args, call.attrs)[0]
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-2  # bf16 q and pools


def test_persistent_program_sm90_build(codegen_cache, nvcc_required):
    """Config.persist (two pools, V4.1 shape): bf16 wgmma, cp.async gathers, mbarriers, at most a few spilled words,
    only the PV warpgroups' named barriers, and the request loop over the symbolic batch (132 CTAs: B + 131)."""
    import re

    import tvm

    from deepinfer.codegen import tilelang_backend as tb

    cfg = sad.prefill_config(8192, 640, 132, persist=True)
    func = sad.program(8192, 64, 512, 1 << 18, 640, target="sm90", cfg=cfg, n_win=128)
    with tvm.transform.PassContext(config=sad.WS_PASS_CONFIGS):
        art = tb.build(f"sparse_attn_{cfg.tag}_2p", func, "sm90")
    ops = art.opcodes
    assert ops["HGMMA"] > 0 and ops["LDGSTS"] > 0 and ops["SYNCS"] > 0
    assert ops["LDL"] + ops["STL"] <= 8, "register spills"
    assert set(re.findall(r"__sync_thread_partial\((\d+), (\d+)\)", art.source)) == {("1", "128"), ("2", "128")}
    assert "(B + 131)" in art.source and "__launch_bounds__(384, 1)" in art.source


@pytest.mark.parametrize("q_norm,scale_ratio,rows", [(True, 1.0, 6), (False, 0.5, 8)])
def test_adapter_q_operand_is_the_reference_prologue_bit_for_bit(q_norm, scale_ratio, rows):
    """fused_attention's q prologue written straight into the kernel's bf16 operand (no rotated f32 copy of q) equals
    the op's formulas -- RMSNorm, RoPE, the scale ratio, the bf16 cast -- bit for bit; padded rows are zero."""
    from deepinfer.ir.ops.attention import Rope
    from deepinfer.ir.ops.core import RMSNorm
    from deepinfer.runtime import kernel_adapters as ka

    rope = {"rope_dim": 16, "theta": 10000.0, "yarn_factor": 4.0, "yarn_orig_len": 64, "beta_fast": 32.0,
            "beta_slow": 1.0}  # fmt: skip
    t, h, d = 6, 4, 64
    g = torch.Generator().manual_seed(9)
    q, pos = torch.randn(t, h, d, generator=g), torch.arange(1000, 1000 + t)
    attrs = {"q_norm": q_norm, "eps": 1e-6, **rope, "scale": scale_ratio * d**-0.5, "out_groups": 0, "quant_group": 0}
    call = ka.Call("fused_attention", attrs, [q, pos], ["q", "p"], [False] * 2, {}, {})
    got = ka.SparseAttnAdapter()._q_operand(call, q, scale_ratio, rows)
    want = RMSNorm.reference(q, None, eps=1e-6) if q_norm else q
    want = Rope.reference(want, pos, inverse=False, **rope) * scale_ratio
    assert got.dtype == torch.bfloat16 and got.shape == (rows, h, d)
    assert torch.equal(got[:t], want.to(torch.bfloat16)) and not got[t:].any()


def test_adapter_bf16_partials_with_emulated_kernels(monkeypatch):
    """Config.partial_bf16 through the adapter: the combine key carries Op's dtype, the scratch Op is bf16, the
    result stays within the bf16 tolerance of the op's reference (H64 / D128: the ws shapes)."""
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setattr(ka, "EMULATE", True)
    args = list(chunk_operands(5, 64, 128, 32, 96, 200, 2, seed=7))
    cfg = {"block_n": 32, "num_split": 2, "stages": 2, "ws": True, "threads": 384, "partial_bf16": True}
    call = ka.Call("sparse_attention", {"scale": 128**-0.5}, args, [f"a{i}" for i in range(6)], [False] * 6, cfg, {})
    adapter = ka.adapter_for("sparse_attn_decode", "sparse_attention")
    keys = adapter.keys(call)
    assert dict(keys[1].kwargs) == {"op_dtype": "bfloat16"}
    dtypes = []
    part = ka.emulated_kernel(keys[0])

    def spy(q, *rest):
        dtypes.append(rest[-3].dtype)  # Op
        part(q, *rest)

    out = adapter.run(call, [spy, ka.emulated_kernel(keys[1])])[0]
    assert dtypes == [torch.bfloat16]
    ref = get_op("sparse_attention").run(args, call.attrs)[0]
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-2
    assert sad.Config(64, 384, 2, 2, True, partial_bf16=True).tag == "wsn64s2x2h"
    with pytest.raises(AssertionError):
        sad.Config(64, 384, 1, 2, True, partial_bf16=True)  # no split: no partials


def test_adapter_reads_only_the_selected_compressed_rows_of_a_large_pool(monkeypatch):
    """A compressed pool much larger than what the queries select (many requests' cache at decode): the ws kernel gets
    the T x K selected rows in entry order (indices 0 .. T*K-1, -1 kept) instead of the whole pool converted to
    bf16 -- the same rows in the same order; a pool smaller than the selection is converted whole."""
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setattr(ka, "EMULATE", True)
    q, sink, win_kv, win_idx, _, cmp_idx = chunk_operands(3, 64, 128, 32, 96, 600, 2, seed=8)
    cmp_kv = torch.randn(5000, 128)
    cmp_idx = torch.where(cmp_idx >= 0, cmp_idx * 16, -1)  # spread over the large pool
    args = [q, sink, win_kv, win_idx, cmp_kv, cmp_idx]
    cfg = {"block_n": 32, "num_split": 2, "stages": 2, "ws": True, "threads": 384}
    call = ka.Call("sparse_attention", {"scale": 128**-0.5}, args, [f"a{i}" for i in range(6)], [False] * 6, cfg, {})
    adapter = ka.adapter_for("sparse_attn_decode", "sparse_attention")
    keys = adapter.keys(call)
    assert dict(keys[0].kwargs)["S_cmp"] == 3 * 96
    seen = []
    part = ka.emulated_kernel(keys[0])

    def spy(q_, kvw, kvc, iw, ic, *rest):
        seen.append((kvc.shape[0], kvc.dtype))
        part(q_, kvw, kvc, iw, ic, *rest)

    out = adapter.run(call, [spy, ka.emulated_kernel(keys[1])])[0]
    assert seen == [(3 * 96, torch.bfloat16)]
    ref = get_op("sparse_attention").run(args, call.attrs)[0]
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-2
    rows, sel = ka._selected_rows(cmp_kv, cmp_idx)
    assert torch.equal(sel < 0, cmp_idx < 0)
    valid = cmp_idx >= 0
    assert torch.equal(rows[sel[valid].long()], cmp_kv[cmp_idx[valid].long()].to(torch.bfloat16))
    whole, same = ka._selected_rows(cmp_kv[:100], cmp_idx.clamp_max(99))
    assert whole.shape[0] == 100 and same is not None


@pytest.mark.parametrize("scale_ratio", [1.0, 0.75])
def test_triton_q_operand_matches_the_torch_prologue(monkeypatch, scale_ratio):
    """The adapter's one-launch q operand (sparse_attn_decode.triton_q_operand, Triton's interpreter here; taken where
    the runner gives the position bound) against its torch formulation: the same bf16 values up to one bf16 step
    (fp32 products contracted differently, a cos | sin table vs the op's on-the-fly angles), zero padded rows."""
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(ka.ADAPTER_INTERPRET_ENV, "1")
    rope = {"rope_dim": 16, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 65536, "beta_fast": 32.0,
            "beta_slow": 1.0}  # fmt: skip
    t, h, d, rows = 5, 8, 64, 8
    g = torch.Generator().manual_seed(10)
    q, pos = torch.randn(t, h, d, generator=g) * 3, torch.tensor([0, 1, 777, 1500, 2047])
    attrs = {"q_norm": False, "eps": 1e-6, **rope, "scale": scale_ratio * d**-0.5, "out_groups": 0, "quant_group": 0}
    call = ka.Call("fused_attention", attrs, [q, pos], ["q", "p"], [False] * 2, {}, {ka.MAX_POSITIONS: 2048})
    fast = ka.SparseAttnAdapter()._q_operand(call, q, scale_ratio, rows)
    call.cache.pop(ka.MAX_POSITIONS)
    slow = ka.SparseAttnAdapter()._q_operand(call, q, scale_ratio, rows)
    assert fast.dtype == torch.bfloat16 and fast.shape == (rows, h, d) and not fast[t:].any()
    step = slow[:t].float().abs().clamp_min(2.0**-100) * 2.0**-7  # one bf16 step (8 significant bits)
    assert bool(((fast[:t].float() - slow[:t].float()).abs() <= step).all())
    assert torch.equal(fast[:t, :, : d - 16], slow[:t, :, : d - 16])  # unrotated channels: exactly x * ratio


def test_decode_persist_rule(monkeypatch):
    """sm90_config takes the persistent grid from PERSIST_MIN_B requests (0: never): single pass, bf16 KV, whole
    ring rounds; below it and for FP8 KV the previous choice."""
    assert sad.sm90_config(256, 640).persist == 132 and sad.sm90_config(1024, 640).persist == 132
    assert all(not sad.sm90_config(b, 640).persist for b in (1, 64, 128, 255))
    monkeypatch.setattr(sad, "PERSIST_MIN_B", 0)
    assert all(not sad.sm90_config(b, 640).persist for b in (1, 64, 128, 256, 1024))
    monkeypatch.setattr(sad, "PERSIST_MIN_B", 200)
    assert sad.sm90_config(256, 640).persist == 132 and sad.sm90_config(256, 640, 148).persist == 148
    assert not sad.sm90_config(128, 640).persist and not sad.sm90_config(256, 640, fp8=True).persist
    assert not sad.sm90_config(256, 192).persist  # 3 blocks of 64: not whole rounds of 2 stages


def test_fused_attention_prefill_chunk_through_the_adapter(monkeypatch):
    """fused_attention on a 200-token chunk (graph-built indices) with the runner's position bound: the q operand,
    the single pass in pieces (MAX_LAUNCH_ROWS 64 here), the output's inverse RoPE on the rope kernel and the FP8
    epilogue (emulated kernels) against the op's reference, dequantised."""
    from deepinfer.ir.registry import get_op
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setattr(ka, "EMULATE", True)
    monkeypatch.setattr(sad, "MAX_LAUNCH_ROWS", 64)
    q, sink, win_kv, win_idx, cmp_kv, cmp_idx = chunk_operands(200, 64, 128, 32, 96, 1000, 2, seed=12)
    rope = {"rope_dim": 64, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 65536, "beta_fast": 32.0,
            "beta_slow": 1.0}  # fmt: skip
    attrs = {"q_norm": False, "eps": 1e-6, **rope, "scale": 128**-0.5, "out_groups": 2, "quant_group": 32}
    args = [q, torch.arange(1000, 1200), sink, win_kv, win_idx, cmp_kv, cmp_idx]
    cfg = {"block_n": 32, "num_split": 1, "stages": 2, "ws": True, "threads": 384}
    call = ka.Call("fused_attention", attrs, args, [f"a{i}" for i in range(7)], [False] * 7, cfg,
                   {ka.MAX_POSITIONS: 4096})  # fmt: skip
    adapter = ka.adapter_for("sparse_attn_decode", "fused_attention")
    keys = adapter.keys(call)
    assert keys[-1].family == "rope"
    got = adapter.run(call, [ka.emulated_kernel(k) for k in keys])
    ref = get_op("fused_attention").run(args, attrs)

    def dequant(outs):
        from deepinfer.ir.ops.quant import dequant_fp8_groups

        return dequant_fp8_groups(outs[0], outs[1], 32)

    g, r = dequant(got), dequant(ref)
    assert g.shape == r.shape == (200, 2, 64 * 64)
    assert ((g - r).abs().max() / r.abs().max()).item() < 0.1  # FP8 out: a code step where bf16 moved a value
    assert ((g - r).norm() / r.norm()).item() < 2e-2


@pytest.mark.parametrize("out_groups", [2, 0])
def test_triton_o_epilogue_matches_the_torch_epilogue(monkeypatch, out_groups):
    """The opt-in one-launch output epilogue (DEEPINFER_ATTN_O_EPILOGUE=triton: inverse RoPE in fp32 + FP8 per 32 with
    act_quant's scales) under Triton's interpreter gives the torch epilogue's codes and ue8m0 scales bit for bit (the
    same fp32 rotation of the kernel's bf16 o, the same power-of-two rule), in the op's output layout."""
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(ka.ADAPTER_INTERPRET_ENV, "1")
    monkeypatch.setenv(ka.ATTN_O_EPILOGUE_ENV, "triton")
    rope = {"rope_dim": 16, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 65536, "beta_fast": 32.0,
            "beta_slow": 1.0}  # fmt: skip
    t, h, d = 5, 4, 64
    g = torch.Generator().manual_seed(13)
    o = (torch.randn(t, h, d, generator=g) * torch.logspace(-3, 2, d)).to(torch.bfloat16)
    pos = torch.tensor([0, 3, 900, 1500, 2047])
    attrs = {"q_norm": False, "eps": 1e-6, **rope, "scale": d**-0.5, "out_groups": out_groups, "quant_group": 32}
    call = ka.Call("fused_attention", attrs, [torch.zeros(t, h, d), pos], ["q", "p"], [False] * 2, {},
                   {ka.MAX_POSITIONS: 2048})  # fmt: skip
    adapter = ka.SparseAttnAdapter()
    assert adapter._o_fused(call) and adapter._o_rope(call, o) is None  # no rope kernel key on this path
    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    fast = adapter._o_epilogue_fused(call, o, sad)
    slow = adapter._epilogue(call, o.float())  # the torch rotation of the same values, then quant_rows
    assert fast[0].shape == slow[0].shape and fast[1].shape == slow[1].shape
    assert torch.equal(fast[0].view(torch.uint8), slow[0].view(torch.uint8))
    assert torch.equal(fast[1].view(torch.uint8), slow[1].view(torch.uint8))
