"""MoE grouped GEMM, issue 6: swap-AB decode programs, W4A8 (FP4 experts dequantised in registers), the fused
clamped-SwiGLU + FP8 quant epilogue.

CPU only: torch references against an independent float64 loop, the dequant bit trick over every 16-bit input,
the epilogue's exponent arithmetic, numerics of the programs on TileLang's `c` target, sm_90a builds with
their SASS, and the W4A8 fragment fill checked against TileLang's own element-wise lowering. What the CPU
cannot check (the wgmma/TMA pipeline, RS fragment registers at run time, timing) is run by
benchmarks/kernels_h200.py --only grouped on the H200.
"""

import re

import pytest
import torch

from deepinfer.codegen.kernels import _common, fp8_gemm
from deepinfer.codegen.kernels import moe_grouped_gemm as mg
from deepinfer.ir import dtypes as dt

E41, D41, I41 = 48, 5120, 2304  # EP8 slice of V4.1: 48 local experts, hidden 5120, moe_intermediate 2304


# ---------------------------------------------------------------------------------------------- torch side


def test_fp4_to_e4m3_bit_trick_is_exact_for_every_input():
    """deepinfer_fp4x4_to_e4m3 (Python mirror with PRMT semantics) over all 2^16 inputs: each byte is the e4m3
    encoding of the MODEL_SPEC e2m1 value times 2^-6 (sign included, low nibble first)."""
    xs = torch.arange(1 << 16)
    bits = torch.tensor([mg.fp4x4_to_e4m3_bits(int(x)) for x in xs], dtype=torch.int64)
    got = torch.stack([(bits >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = torch.stack([(xs >> (4 * i)) & 0xF for i in range(4)], -1)
    assert torch.equal(got.float() * 64.0, dt.fp4_decode(codes))


def test_ue8m0_exponent_is_exact():
    torch.manual_seed(0)
    amax = torch.rand(200_000) * torch.exp2(torch.randint(-40, 40, (200_000,)).float())
    edge = torch.tensor([0.0, 1e-4, 1e-30, 448.0, 896.0, 672.0, 1.75, 3.5, 7 * 2.0**-30, 3.0e38, 1.0, 0.875])
    amax = torch.cat([amax, edge, torch.nextafter(edge, torch.full_like(edge, float("inf")))])
    e = mg.ue8m0_exponent(amax)
    exact = torch.ceil(torch.log2(amax.double().clamp(min=float(torch.tensor(1e-4))) / 448.0))
    assert torch.equal(e.double(), exact)
    # torch's float32 pipeline (quant_act) agrees except a few ulp above mantissa 1.75 (rounding of amax/448)
    agree = torch.exp2(e.float()) == dt.pow2_scale(amax, 448.0, floor=1e-4)
    assert agree.float().mean() > 0.9999


def _fp4_experts(E, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(116, 126, (E, N, K // 32), dtype=torch.uint8, generator=g)
    return packed, scale


@pytest.mark.parametrize("masked", [True, False])
def test_w4a8_reference_matches_f64_loop(masked):
    E, N, K = 3, 64, 128
    packed, scale = _fp4_experts(E, N, K)
    if masked:
        counts = torch.tensor([3, 0, 8], dtype=torch.int32)
        re_ = mg.row_experts(counts, 8, masked=True)
    else:
        ids = torch.randint(0, E, (20,), generator=torch.Generator().manual_seed(1))
        ids[ids == 1] = 2  # an expert without rows
        _, tiles = mg.contiguous_layout(ids, E, 8)
        re_ = mg.row_experts(tiles, 8, masked=False)
    a, sa = _common.quant_fp8_groups(torch.randn(re_.numel(), K), 32)
    got = mg.reference_w4a8(a, sa, packed, scale, re_)
    want = mg.reference_w4a8_f64(a, sa, packed, scale, re_)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()
    assert (got[re_ < 0] == 0).all() and (got[re_ >= 0].abs().sum(1) > 0).all()
    # and the dequantised weights are ir/ops/quant.py's (the graph's moe_experts fmt "fp4")
    w = mg.dequant_fp4_experts(packed, scale)
    x = a[re_ >= 0][0].double() * sa[re_ >= 0][0].double().repeat_interleave(32)
    assert torch.allclose(w[int(re_[re_ >= 0][0])].double() @ x, want[re_ >= 0][0])


def test_w4a8_weights_and_gate_up_tiles():
    packed, scale = _fp4_experts(2, 8, 64)
    b, sb = mg.w4a8_weights(packed, scale.view(torch.float8_e8m0fnu))
    assert b.dtype == torch.int16 and b.shape == (2, 8, 16) and b.data_ptr() == packed.data_ptr()
    assert torch.equal(sb, scale.transpose(1, 2))
    w = torch.arange(2 * 12).view(1, 12, 2)  # 2I = 12 rows, tiles of 3 gate + 3 up rows
    t = mg.gate_up_tiles(w, 3)
    assert t[0, :, 0].tolist() == [0, 2, 4, 12, 14, 16, 6, 8, 10, 18, 20, 22]
    assert torch.equal(mg.gate_up_tiles(w.transpose(1, 2), 3, dim=2), t.transpose(1, 2))


def test_swiglu_quant_reference_is_the_graph_semantics():
    from deepinfer.ir.ops.moe import swiglu
    from deepinfer.runtime.kernel_adapters import quant_act

    torch.manual_seed(2)
    h = torch.randn(5, 128) * 8
    q, s = mg.swiglu_quant_reference(h, 10.0)
    rq, rs = quant_act(swiglu(h[:, :64], h[:, 64:], 10.0), 32)
    assert torch.equal(s, rs) and torch.equal(q.float(), rq.float())


def test_swab_config_single_wave_decode_choice():
    # 16 tokens: 16 active experts x 24 tiles of 192 rows = 384 CTAs <= 396 slots (H200: 71.6% vs 64.5% of HBM)
    assert mg.swab_config(2, "fp8", active_experts=16, N=2 * I41) == mg.SwabConfig(192, 16, 128, 2, 3, True)
    # 64 tokens (38 active experts: 2.3 waves of 192-row tiles), fp4, or no expert count: the 64-row default
    assert mg.swab_config(5, "fp8", active_experts=38, N=2 * I41).block_n == 64
    assert mg.swab_config(2, "fp4", active_experts=16, N=2 * I41).block_n == 64
    assert mg.swab_config(2, "fp8") == mg.SwabConfig(64, 16, 128, 4, 4, True)  # fp8 decode: wide TMA tiles
    assert not mg.swab_config(2, "fp4").wide_tma and not mg.swab_config(0, "fp8", contiguous=True).wide_tma


def test_rooflines():
    b8, f8 = mg.roofline(16, 4608, 5120, 16, 32, 32)
    b4, f4 = mg.roofline_w4a8(16, 4608, 5120, 16)
    assert f8 == f4 == 2.0 * 16 * 4608 * 5120
    assert 0.5 < b4 / b8 < 0.6  # half the weight bytes (plus 1/16 for the ue8m0 bytes vs 1/256 fp32 blocks)
    bg, _ = mg.roofline_swiglu(16, 4608, 5120, 16, "fp4")
    assert bg < b4


# ---------------------------------------------------------------------------------------------- c target


@pytest.fixture(scope="module")
def cpu(tilelang_required):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    return compile_cpu


def test_swab_fp8_contiguous_c_target(cpu):
    """fp8 weights, contiguous layout (W rows x tokens, swap-AB promotion with 32x32 block scales)."""
    torch.manual_seed(3)
    E, N, K, bt = 3, 128, 128, 4
    ids = torch.randint(0, E, (14,))
    ids[ids == 1] = 0
    rows, tiles = mg.contiguous_layout(ids, E, bt)
    a, sa = _common.quant_fp8_groups(torch.randn(rows.numel(), K), 32)
    quant = [_common.quant_fp8_blocks(torch.randn(N, K) * 0.05, 32) for _ in range(E)]
    b, sb = torch.stack([q for q, _ in quant]), torch.stack([s for _, s in quant])
    cfg = mg.SwabConfig(64, bt, 64, 2, 1)
    kernel = cpu(mg.swab_program(rows.numel(), N, K, E, fmt="fp8", cfg=cfg, target="cpu"))
    c = torch.zeros(rows.numel(), N)
    kernel(a.float(), sa.T.contiguous(), b.float(), sb, tiles, c)
    ref = mg.reference(a, sa, b, sb, tiles, bt, 32, 32)
    real = mg.row_experts(tiles, bt, masked=False) >= 0
    assert (c[real] - ref[real]).abs().max() <= 1e-5 * ref.abs().max()


def test_swab_fp8_masked_three_warpgroups_c_target(cpu):
    """block_n 192 (3 consumer warpgroups: the single-wave decode config at 16 tokens), masked layout with an idle
    expert: 192-row weight tiles cross 32-row scale blocks at every 32 rows."""
    torch.manual_seed(5)
    E, N, K, mr = 3, 384, 128, 16
    counts = torch.tensor([2, 0, 16], dtype=torch.int32)
    a, sa = _common.quant_fp8_groups(torch.randn(E * mr, K), 32)
    quant = [_common.quant_fp8_blocks(torch.randn(N, K) * 0.05, 32) for _ in range(E)]
    b, sb = torch.stack([q for q, _ in quant]), torch.stack([s for _, s in quant])
    cfg = mg.SwabConfig(192, 16, 64, 2, 3)
    kernel = cpu(mg.swab_program(E * mr, N, K, E, fmt="fp8", cfg=cfg, max_rows=mr, target="cpu"))
    c = torch.zeros(E * mr, N)
    kernel(a.float(), sa.T.contiguous(), b.float(), sb, counts, c)
    want = mg.reference_f64(a, sa, b, sb, mg.masked_tile_expert(counts, mr, mr), mr, 32, 32)
    real = mg.row_experts(counts, mr, masked=True) >= 0
    assert (c[real].double() - want[real]).abs().max() <= 1e-5 * want.abs().max()


def test_swab_w4a8_masked_swiglu_c_target(cpu):
    """fp4 weights (the kernel's bit trick and scale handling), masked layout with an idle expert and one
    spanning two token tiles, fused SwiGLU + ue8m0 quant: every scale and every e4m3 code as the reference."""
    E, N, K, mr, bt = 4, 128, 128, 8, 4
    packed, scale = _fp4_experts(E, N, K, seed=4)
    counts = torch.tensor([3, 0, 8, 5], dtype=torch.int32)
    re_ = mg.row_experts(counts, mr, masked=True)
    torch.manual_seed(4)
    a, sa = _common.quant_fp8_groups(torch.randn(E * mr, K), 32)
    cfg = mg.SwabConfig(64, bt, 64, 2, 1)
    b, sb = mg.w4a8_weights(mg.gate_up_tiles(packed, 32), mg.gate_up_tiles(scale, 32))
    kernel = cpu(mg.swab_program(E * mr, N, K, E, fmt="fp4", cfg=cfg, max_rows=mr, swiglu_limit=10.0, target="cpu"))
    hq, hs = torch.zeros(E * mr, N // 2), torch.zeros(N // 64, E * mr)
    kernel(a.float(), sa.T.contiguous(), b, sb, counts, hq, hs)
    h = mg.reference_w4a8(a, sa, packed, scale, re_)
    assert h.abs().max() > 10.0  # the clamp is exercised
    rq, rs = mg.swiglu_quant_reference(h, 10.0)
    real = re_ >= 0
    assert torch.equal(hs.T[real], rs[real])
    assert torch.equal(hq[real].to(torch.float8_e4m3fn).float(), rq[real].float())


def _grouped_fp8_inputs(E, N, K, g, tiles, bm, seed):
    torch.manual_seed(seed)
    a, sa = _common.quant_fp8_groups(torch.randn(tiles.numel() * bm, K), g)
    quant = [_common.quant_fp8_blocks(torch.randn(N, K) * 0.05, g) for _ in range(E)]
    return a, sa, torch.stack([q for q, _ in quant]), torch.stack([s for _, s in quant])


# the persistent grouped program's configs at c-target size (threads = 2 x block_m), 4-6 CTAs
_WS_CPU = {
    "g32-ovl": (32, fp8_gemm.Config(64, 128, 128, 3, 128, True, True, 1, persistent=True, raster=2, sms=5)),
    "g128-n2": (128, fp8_gemm.Config(64, 256, 128, 3, 128, False, True, 2, persistent=True, raster=2, sms=4)),
    "g32-128rows": (32, fp8_gemm.Config(128, 128, 128, 3, 256, False, True, 1, persistent=True, raster=4, sms=6)),
    "g128-pair-n": (128, fp8_gemm.Config(64, 128, 128, 3, 128, True, True, 1, persistent=True, raster=2, sms=6,
                                         cluster=2, pair_n=True)),  # fmt: skip
}


@pytest.mark.parametrize("name", list(_WS_CPU))
def test_persistent_grouped_c_target(cpu, name):
    """fp8_gemm's persistent schedule with experts (moe_grouped_gemm.program, cfg.persistent): every M tile on
    its expert's weights and scales, padding tiles (-1) anywhere in the sequence skipped (their rows stay NaN),
    an expert with several tiles, several waves. Against the float64 dequantised oracle."""
    g, cfg = _WS_CPU[name]
    E, N, K, bm = 4, 256, 256, cfg.block_m
    tiles = torch.tensor([2, 2, -1, 0, 3, -1, -1, 1, 2], dtype=torch.int32)  # 9 M tiles, 3 of padding
    a, sa, b, sb = _grouped_fp8_inputs(E, N, K, g, tiles, bm, seed=6)
    M = tiles.numel() * bm
    kernel = cpu(mg.program(M, N, K, E, act_group=g, weight_block=g, target="cpu", cfg=cfg))
    c = torch.full((M, N), float("nan"))
    kernel(a.float(), sa.T.contiguous(), b.float(), sb, tiles, c)
    want = mg.reference_f64(a, sa, b, sb, tiles, bm, g, g)
    real = mg.row_experts(tiles, bm, masked=False) >= 0
    assert (c[real].double() - want[real]).abs().max() <= 1e-5 * want.abs().max()
    assert c[~real].isnan().all(), "padding tiles are skipped, not computed"


def test_persistent_grouped_rejects_clusters_and_falls_back_for_the_masked_layout(tilelang_required):
    cfg = fp8_gemm.Config(128, 128, 128, 5, 256, True, True, 1, persistent=True, cluster=2)
    with pytest.raises(AssertionError, match="different experts"):
        fp8_gemm.WSPlan(4096, 4608, 5120, 32, 32, cfg, experts=48).check()
    fp8_gemm.WSPlan(4096, 4608, 5120, 32, 32, fp8_gemm.Config(**{**vars(cfg), "pair_n": True}), experts=48).check()
    # a persistent config handed to the masked layout (or the fused SwiGLU) runs the same tile on the plain loop
    func = mg.program(48 * 128, 4608, 5120, 48, act_group=32, weight_block=32, target="sm90", cfg=cfg, max_rows=128)
    assert str(func.attrs["global_symbol"]) == "moe_grouped_gemm_sm90"


# ---------------------------------------------------------------------------------------------- sm_90a builds


def _builds():
    return {
        # decode: 64-row weight tiles x 16 tokens, fp8 weights (the masked program's new default)
        "masked_fp8": lambda: mg.swab_program(E41 * 64, 2 * I41, D41, E41, fmt="fp8", cfg=mg.swab_config(4),
                                              max_rows=64),  # fmt: skip
        # decode W4A8 with the fused SwiGLU epilogue (w1|w3 -> Hq, Hs)
        "masked_fp4_swiglu": lambda: mg.swab_program(E41 * 64, 2 * I41, D41, E41, fmt="fp4",
                                                     cfg=mg.swab_config(4, "fp4"), max_rows=64,
                                                     swiglu_limit=10.0),  # fmt: skip
        # prefill W4A8: 128 weight rows (2 consumer warpgroups, 2 m64 blocks a fragment) x 128 tokens
        "contiguous_fp4": lambda: mg.swab_program(24576, 2 * I41, D41, E41, fmt="fp4",
                                                  cfg=mg.swab_config(0, "fp4", contiguous=True)),  # fmt: skip
        # prefill fp8 on fp8_gemm's persistent warp-specialised program: V4.1 (g32, 128x128 overlap) and V4 (g128,
        # 128x256 ping-pong)
        "contiguous_fp8_ws_g32": lambda: mg.program(24576, 2 * I41, D41, E41, act_group=32, weight_block=32,
                                                    target="sm90", cfg=fp8_gemm.Config(128, 128, 128, 5, 256, True,
                                                    True, 1, persistent=True)),  # fmt: skip
        "contiguous_fp8_ws_g128": lambda: mg.program(24576, 4096, 4096, 32, act_group=128, weight_block=128,
                                                     target="sm90", cfg=fp8_gemm.Config(128, 256, 128, 3, 256, False,
                                                     True, 2, persistent=True, pingpong=True)),  # fmt: skip
        # ... with CTA pairs on N-adjacent tiles of one M tile (one expert), sharing A by TMA multicast
        "contiguous_fp8_ws_g128_pair_n": lambda: mg.program(24576, 4096, 4096, 32, act_group=128, weight_block=128,
                                                            target="sm90", cfg=fp8_gemm.Config(128, 256, 128, 3, 256,
                                                            False, True, 2, persistent=True, pingpong=True, cluster=2,
                                                            pair_n=True)),  # fmt: skip
        # prefill fp8 on the 2-warpgroup overlapped loop with the fused SwiGLU epilogue
        "contiguous_fp8_swiglu": lambda: mg.program(24576, 2 * I41, D41, E41, act_group=32, weight_block=32,
                                                    target="sm90", cfg=mg.sm90_config(0, 2 * I41),
                                                    swiglu_limit=10.0),  # fmt: skip
    }


@pytest.mark.parametrize("name", list(_builds()))
def test_sm90_builds(codegen_cache, nvcc_required, name):
    from deepinfer.codegen import tilelang_backend as tb

    art = tb.build(f"moe_{name}", _builds()[name](), "sm90")
    ops = art.opcodes
    assert ops["QGMMA"] > 0 and ops["HGMMA"] == 0 and ops["HMMA"] == 0, "FP8 wgmma (QGMMA) expected"
    assert ops["UTMALDG"] > 0, "TMA loads expected"
    assert ops["LDL"] == 0 and ops["STL"] == 0, "register spills"
    if name.startswith("masked"):
        assert "__launch_bounds__(256, " in art.source and "warpgroup_reg_alloc" not in art.source
        assert ".64x16x32" in art.sass, "swap-AB: m64 weight rows x n16 tokens"
    if "fp4" in name:
        assert f"deepinfer_fp4_frag<{2 if 'contiguous' in name else 1}>" in art.source and "wgmma_rs" in art.source
        assert ops["PRMT"] > 0
    if "swiglu" in name:
        assert "tma_store" in art.source or "UTMASTG" in ops
    if "_ws_" in name:  # persistent: producer/consumer register split, TMA store epilogue, aligned TMA slots
        assert ops["USETMAXREG"] == 2 and ops["UTMASTG"] > 0 and "TileExpert[" in art.source
        assert fp8_gemm.tma_smem_misalignments(art.source) == []
        assert ("UTMALDG.2D.MULTICAST" in art.sass) == name.endswith("pair_n")
        if name.endswith("pair_n"):  # the A tile is the multicast one: its descriptor in the multicast load
            assert re.search(r"tma_load_multicast\(A_desc", art.source)


@pytest.mark.parametrize("block_n,max_rows", [(64, 16), (128, 0)])
def test_fp4_fragment_fill_matches_tilelang_layout(tilelang_required, block_n, max_rows):
    """deepinfer_fp4_frag writes register r of a thread from packed word (row, word) by PTX's wgmma A layout;
    TileLang's own element-wise lowering of the same program reads P_s at some index for register r: evaluate
    that index for every consumer thread and compare (catches a TileLang layout or warp-policy change)."""
    from deepinfer.codegen import tilelang_backend as tb

    cfg = mg.SwabConfig(block_n, 16, 128, 2, 1)
    M = 4 * max_rows if max_rows else 64
    src = tb.lower(mg.swab_program(M, 256, 256, 4, fmt="fp4", cfg=cfg, max_rows=max_rows, fast_dequant=False), "sm90")
    lines = src.splitlines()
    at = next(i for i, line in enumerate(lines) if "make_short4(" in line and "P_s" in line)
    loop = next(m for j in range(at, at - 8, -1) if (m := re.search(r"for \(int (i_\d+) = 0; \1 < (\d+);", lines[j])))
    var, n_regs = loop.group(1), int(loop.group(2))
    expr = re.search(r"\(\(short\*\)P_s\)\[(.*?)\], \(\(short\*\)P_s\)", lines[at]).group(1)
    expr = expr.replace("consumer_phase_cnt[0]", "0").replace("(int)threadIdx.x", "tid").replace("(int)", "")
    assert n_regs == 4 * (block_n // 64)
    stride = 128 // 4
    threads = cfg.threads
    for base in (0, 128):  # the consumer warpgroups come first or after the producer
        idx = [[eval(expr, {}, {"tid": base + t, var: r}) for r in range(n_regs)] for t in range(threads)]
        if all(0 <= i < block_n * stride for row in idx for i in row):
            break
    else:
        pytest.fail(f"cannot place the consumer threads for {expr}")
    for t in range(threads):
        tl = t & 127
        for r in range(n_regs):
            row = (tl >> 5) * 16 + (tl & 31) // 4 + (r & 1) * 8 + (r >> 2) * 64
            word = ((r >> 1) & 1) * 4 + (tl & 3)
            assert idx[t][r] == row * stride + word, (t, r)
