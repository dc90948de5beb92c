"""swab_program(glu_split=True): the fused-SwiGLU swap-AB program reading the plain w1|w3 stacks (gate rows, then up
rows) with two copies per weight tile, instead of a tile-interleaved copy of the experts (9 GB per V4.1 layer).

On TileLang's `c` target: the split program's codes and scales equal the interleaved program's on the
interleaved stack, and the clamped-SwiGLU reference (fp8 and fp4 weights, an idle expert, an expert over two
token tiles). The sm_90a build keeps TMA loads, FP8 wgmma and no spills. What the CPU cannot check (the TMA
boxes into the two halves of the swizzled tile at run time, timing) is the gpu test below / gpu_runtime_check."""

import pytest
import torch

from deepinfer.codegen.kernels import _common
from deepinfer.codegen.kernels import moe_grouped_gemm as mg

E, N, K, MR, BT = 3, 256, 128, 8, 4  # N = 2I with I = 128: two 64-row CTA tiles, so the halves' offsets matter
COUNTS = torch.tensor([3, 0, 8], dtype=torch.int32)


@pytest.fixture(scope="module")
def cpu(tilelang_required):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    return compile_cpu


def _run(cpu, fmt, split, a, sa, b, sb):
    cfg = mg.SwabConfig(64, BT, 64, 2, 1)
    prog = mg.swab_program(E * MR, N, K, E, fmt=fmt, cfg=cfg, max_rows=MR, swiglu_limit=10.0, glu_split=split,
                           target="cpu")  # fmt: skip
    hq, hs = torch.zeros(E * MR, N // 2), torch.zeros(N // 64, E * MR)
    cpu(prog)(a.float(), sa.T.contiguous(), b, sb, COUNTS, hq, hs)
    return hq, hs


def _acts(seed):
    torch.manual_seed(seed)
    return _common.quant_fp8_groups(torch.randn(E * MR, K) * 4, 32)


def _check(hq, hs, h):
    rq, rs = mg.swiglu_quant_reference(h, 10.0)
    real = mg.row_experts(COUNTS, MR, masked=True) >= 0
    assert torch.equal(hs.T[real], rs[real])
    assert torch.equal(hq[real].to(torch.float8_e4m3fn).float(), rq[real].float())


def test_fp8_split_equals_interleaved_and_reference(cpu):
    a, sa = _acts(1)
    quant = [_common.quant_fp8_blocks(torch.randn(N, K) * 0.3, 32) for _ in range(E)]
    b, sb = torch.stack([q for q, _ in quant]), torch.stack([s for _, s in quant])
    hq, hs = _run(cpu, "fp8", True, a, sa, b.float(), sb)
    hq_i, hs_i = _run(cpu, "fp8", False, a, sa, mg.gate_up_tiles(b, 32).float(), mg.gate_up_tiles(sb, 1))
    real = mg.row_experts(COUNTS, MR, masked=True) >= 0
    assert torch.equal(hq[real], hq_i[real]) and torch.equal(hs[:, real], hs_i[:, real])
    h = mg.reference(a, sa, b, sb, mg.masked_tile_expert(COUNTS, MR, MR), MR, 32, 32)
    assert h.abs().max() > 10.0  # the clamp is exercised
    _check(hq, hs, h)
    # the same plain stack through the interleaved program is wrong: the test can tell the layouts apart
    hq_w, _ = _run(cpu, "fp8", False, a, sa, b.float(), sb)
    assert not torch.equal(hq_w[real], hq[real])


def test_fp4_split_matches_reference(cpu):
    a, sa = _acts(2)
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(116, 126, (E, N, K // 32), dtype=torch.uint8, generator=g)
    b, sb = mg.w4a8_weights(packed, scale)
    hq, hs = _run(cpu, "fp4", True, a, sa, b, sb)
    _check(hq, hs, mg.reference_w4a8(a, sa, packed, scale, mg.row_experts(COUNTS, MR, masked=True)))


def test_glu_split_needs_the_fused_swiglu(tilelang_required):
    with pytest.raises(AssertionError, match="glu_split"):
        mg.swab_program(E * MR, N, K, E, cfg=mg.SwabConfig(64, BT, 64, 2, 1), max_rows=MR, glu_split=True)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_sm90_build_keeps_tma_and_wgmma(codegen_cache, nvcc_required, fmt):
    from deepinfer.codegen import tilelang_backend as tb

    cfg = mg.swab_config(4, fmt)
    prog = mg.swab_program(384 * 16, 4608, 5120, 384, fmt=fmt, cfg=cfg, max_rows=16, swiglu_limit=10.0,
                           glu_split=True)  # fmt: skip
    art = tb.build(f"moe_swab_split_{fmt}", prog, "sm90")
    ops = art.opcodes
    assert ops["QGMMA"] > 0 and ops["UTMALDG"] > 0
    assert ops["LDL"] == 0 and ops["STL"] == 0, "register spills"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_split_matches_interleaved_on_the_h200(fmt):
    """V4.1 decode at 64 tokens (384 experts, 6 per token, I = 2304, K = 5120): the split program's codes and scales
    equal the interleaved program's bit for bit; prints both times (the split one should be as fast)."""
    from deepinfer.runtime import kernel_adapters as ka

    e, inter, k, t, topk = 384, 2304, 5120, 64, 6
    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)]).to(dev)
    cfg = mg.swab_config(4, fmt)
    max_rows = -(-t // cfg.block_t) * cfg.block_t
    dest, counts, _ = ka.masked_layout(idx, torch.ones(t, topk, device=dev), e, max_rows)
    rows = e * max_rows
    a, sa = _common.quant_fp8_groups(torch.randn(t * topk, k, device=dev), 32)
    a_m = torch.zeros(rows, k, dtype=torch.float8_e4m3fn, device=dev)
    a_m.view(torch.uint8)[dest] = a.view(torch.uint8)
    sa_m = torch.ones(k // 32, rows, device=dev)
    sa_m[:, dest] = sa.T
    if fmt == "fp8":
        b = (torch.randn(e, 2 * inter, k, device=dev) * 0.3).to(torch.float8_e4m3fn)
        sb = torch.exp2(torch.randint(-8, -4, (e, 2 * inter // 32, k // 32), device=dev).float())
        plain = (b, sb)
        tiled = (mg.gate_up_tiles(b, cfg.block_n // 2), mg.gate_up_tiles(sb, cfg.block_n // 64))
    else:
        packed = torch.randint(0, 256, (e, 2 * inter, k // 2), dtype=torch.uint8, device=dev)
        scale = torch.randint(116, 126, (e, 2 * inter, k // 32), dtype=torch.uint8, device=dev)
        plain = mg.w4a8_weights(packed, scale)
        tiled = mg.w4a8_weights(mg.gate_up_tiles(packed, cfg.block_n // 2), mg.gate_up_tiles(scale, cfg.block_n // 2))
    outs, times = {}, {}
    for split, (bw, bs) in ((False, tiled), (True, plain)):
        c = cfg if not split else mg.SwabConfig(cfg.block_n, cfg.block_t, cfg.block_k, cfg.stages,
                                                max(1, cfg.min_blocks // 2))  # fmt: skip
        kw = {"glu_split": True} if split else {}
        key = ka._key("moe_grouped_gemm", "swab_program", (rows, 2 * inter, k, e), c, act_group=32, fmt=fmt,
                      weight_block=32, max_rows=max_rows, swiglu_limit=10.0, **kw)  # fmt: skip
        kern = ka.build_kernel(key)
        hq = torch.zeros(rows, inter, dtype=torch.float8_e4m3fn, device=dev)
        hs = torch.zeros(inter // 32, rows, device=dev)
        args = (a_m, sa_m, bw, bs, counts, hq, hs)
        kern(*args)
        torch.cuda.synchronize()
        outs[split] = (hq.view(torch.uint8)[dest].clone(), hs[:, dest].clone())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            kern(*args)
        end.record()
        torch.cuda.synchronize()
        times[split] = start.elapsed_time(end) / 20 * 1e3
    print(f"\nswab {fmt} +swiglu T={t}: interleaved {times[False]:.1f} us, split {times[True]:.1f} us")
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
