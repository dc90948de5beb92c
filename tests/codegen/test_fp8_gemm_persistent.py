"""The persistent warp-specialised FP8 GEMM (`fp8_gemm._program_sm90_ws`, the `ws` rows of the H200 sweep),
checked without a GPU:

* tile order: every output tile exactly once over the CTAs and waves, L2 panels, 2-CTA clusters on
  M-adjacent tile pairs (pure Python, the same `WSPlan.tile_of` the kernels use);
* numerics: the same schedule (CTA count, tile order, per-stage operand and scale slices, units, promotion
  indices) on TileLang's `c` target in fp32, against the torch reference, for V4's 128 groups, V4.1's 32
  groups and the mixed format, with several waves, a partial last wave and a narrower last panel;
* shared-memory alignment of every TMA transfer in the generated CUDA (each stage's slot 128-byte aligned: a
  64-byte weight-scale slot faulted with "misaligned address" on the H200);
* sm_90a builds of each code path (lower + nvcc + SASS): FP8 wgmma (QGMMA), TMA loads and stores,
  setmaxnreg in both roles, no local-memory spills; the cluster variant multicasts B.

The GPU run of the same configs is tests/codegen/test_gpu_kernels.py::test_fp8_gemm_persistent.
"""

import pytest
import torch

from deepinfer.codegen.kernels import fp8_gemm

WS = fp8_gemm.Config(128, 256, 128, 3, 256, False, True, 2, persistent=True)  # 128x256, 2 N slices
WS_OVL = fp8_gemm.Config(128, 128, 128, 5, 256, True, True, 1, persistent=True)  # async wgmma overlap


def _plan(M, N, K, cfg, g=128):
    return fp8_gemm.WSPlan(M, N, K, g, g, cfg)


@pytest.mark.parametrize(
    "M,N,raster,sms,cluster",
    [
        (4096, 32768, 16, 132, 1),  # V4 wq_b: 4096 tiles, 31 waves + 4
        (2560, 4096, 16, 132, 1),  # 20 M tiles: the last panel is 4 rows
        (384, 1280, 2, 4, 1),  # tiny: 3 M tiles in panels of 2, 4 CTAs
        (4096, 1024, 16, 132, 1),  # 128 tiles: one partial wave
        (8192, 8192, 16, 132, 2),  # clusters: pairs of M tiles
        (2560, 4096, 16, 132, 2),  # clusters with a narrower last panel
        (2560, 4096, 16, 132, -2),  # pairs along N (pair_n)
        (384, 1024, 2, 4, -2),  # pairs along N, 3 M tiles in panels of 2
    ],
)
def test_tile_order_covers_every_tile_once(M, N, raster, sms, cluster):
    pair_n, cluster = cluster < 0, abs(cluster)
    cfg = fp8_gemm.Config(128, 256, 128, 3, 256, False, True, 2, True, raster=raster, sms=sms, cluster=cluster,
                          pair_n=pair_n)  # fmt: skip
    plan = _plan(M, N, 1024, cfg)
    plan.check()
    seen = {}
    for bid in range(sms):
        for w in range(plan.waves):
            valid, m, n = plan.tile_of(w, bid)
            if valid:
                assert (m, n) not in seen, f"tile {(m, n)} twice"
                seen[m, n] = (bid, w)
                if cluster > 1:  # the cluster's CTAs take M- (pair_n: N-) adjacent tiles in the same wave
                    _, m0, n0 = plan.tile_of(w, bid - bid % cluster)
                    assert (m, n) == ((m0, n0 + bid % cluster) if pair_n else (m0 + bid % cluster, n0))
    assert sorted(seen) == [(m, n) for m in range(plan.m_tiles) for n in range(plan.n_tiles)]


def test_tile_order_walks_panels_of_raster_m_tiles():
    # M fastest inside a panel of 2 M tiles, then N; the last panel (1 M tile) is narrower
    assert [fp8_gemm.tile_coords(t, 3, 2, 2) for t in range(6)] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]


def test_plan_rejects_what_the_kernel_cannot_do():
    with pytest.raises(AssertionError, match="spill"):  # acc 128 + 2 partials of 64 registers per thread
        _plan(4096, 4096, 4096, fp8_gemm.Config(128, 256, 128, 3, 256, True, True, 2, persistent=True)).check()
    with pytest.raises(AssertionError, match="whole tiles"):
        _plan(4000, 4096, 4096, WS).check()
    with pytest.raises(AssertionError, match="even K block count"):  # overlap pairs K blocks (1 unit each)
        _plan(4096, 4096, 128 * 7, WS_OVL).check()
    with pytest.raises(AssertionError, match="pingpong"):
        _plan(4096, 4096, 4096, fp8_gemm.Config(**{**vars(WS_OVL), "pingpong": True})).check()
    s4 = fp8_gemm.Config(**{**vars(WS), "stages": 4})  # 4 x 48 KiB stages + the 64 KiB output tile
    with pytest.raises(AssertionError, match="shared memory"):
        _plan(4096, 4096, 4096, s4).check()
    _plan(4096, 4096, 4096, fp8_gemm.Config(**{**vars(s4), "direct_store": True})).check()  # no output tile


@pytest.fixture(scope="module")
def cpu(tilelang_required):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    return compile_cpu


@pytest.mark.parametrize(
    "ag,wb,cfg,shape,sms",
    [
        (128, 128, WS, (384, 512, 512), 4),  # V4 format: 6 tiles on 4 CTAs, panels of 2 M tiles (last: 1)
        (32, 32, WS_OVL, (384, 512, 512), 5),  # V4.1 format: per-32 scales from the [bN/32, 4] box
        (32, 128, fp8_gemm.Config(128, 128, 128, 4, 256, False, True, 2, persistent=True), (256, 384, 256), 4),
        (128, 128, fp8_gemm.Config(**{**vars(WS_OVL), "cluster": 2}), (256, 384, 256), 4),  # 2 clusters of 2
    ],
    ids=["v4-128x256", "v41-ovl", "mixed", "v4-cluster"],
)
def test_persistent_schedule_c_target(cpu, ag, wb, cfg, shape, sms):
    M, N, K = shape
    cfg = fp8_gemm.Config(**{**vars(cfg), "raster": 2, "sms": sms})
    plan = fp8_gemm.WSPlan(M, N, K, ag, wb, cfg)
    assert plan.waves >= 2 and plan.cluster_tiles % (cfg.sms // cfg.cluster), "several waves, the last partial"
    a, sa, b, sb = fp8_gemm.make_inputs(M, N, K, ag, wb, seed=5)
    kernel = cpu(fp8_gemm.program(M, N, K, act_group=ag, weight_block=wb, target="cpu", cfg=cfg))
    out = torch.full((M, N), float("nan"))  # a tile left out stays NaN
    kernel(a.float(), sa.T.contiguous(), b.float(), sb, out)
    ref = fp8_gemm.reference(a, sa, b, sb, ag, wb)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize(
    "g,cfg,shape",
    [
        (128, WS, (4096, 32768, 1024)),  # scalar weight scales via the producer, 2 N slices, sync wgmma
        (128, WS_OVL, (4096, 32768, 1024)),  # one unit per stage: the loop body pairs K blocks
        (32, fp8_gemm.Config(**{**vars(WS_OVL), "cluster": 2}), (4096, 32768, 1280)),  # scale boxes, multicast
        (128, fp8_gemm.Config(**{**vars(WS), "cluster": 2, "pingpong": True}), (4096, 4096, 8192)),  # turns
        (32, fp8_gemm.Config(**{**vars(WS), "stages": 4, "direct_store": True}), (4096, 5120, 8192)),  # no smem C
    ],
    ids=["g128-128x256", "g128-ovl", "g32-ovl-c2", "g128-pp-c2", "g32-s4-direct"],
)
def test_persistent_sm90_build(codegen_cache, nvcc_required, g, cfg, shape):
    from deepinfer.codegen import tilelang_backend as tb

    M, N, K = shape
    func = fp8_gemm.program(M, N, K, act_group=g, weight_block=g, target="sm90", cfg=cfg)
    art = tb.build(f"fp8_gemm_ws_g{g}_{cfg.tag}_{M}x{N}x{K}", func, "sm90")
    ops = art.opcodes
    assert ops["QGMMA"] > 0, "FP8 wgmma (QGMMA) missing from SASS"
    assert ops["UTMALDG"] > 0, "TMA loads"
    if cfg.direct_store:  # bf16 pairs from the accumulator registers
        assert ops["UTMASTG"] == 0 and ops["STG"] > 0
    else:
        assert ops["UTMASTG"] > 0, "the TMA store epilogue"
    assert ops["USETMAXREG"] == 2, "setmaxnreg: producer dealloc + consumer alloc"
    assert ops["LDL"] == 0 and ops["STL"] == 0, "register spills"
    assert ops["FFMA"] > 0, "the promotion"
    assert ("UTMALDG.2D.MULTICAST" in art.sass) == (cfg.cluster > 1)
    if cfg.pingpong:  # turns: bar.sync on one named barrier, bar.arrive on the other
        assert "__named_barrier_arrive(13, 256)" in art.source and "__sync_thread_partial(12, 256)" in art.source
    assert f"__launch_bounds__({cfg.threads + 128}, 1)" in art.source


# ------------------------------------------------------------------------------ TMA shared-memory alignment

def test_tma_alignment_check_finds_a_64_byte_slot():
    # the unpadded weight-scale ring of the crashing g32 128x128 kernel: 16 floats per stage at offset 206848
    src = """  void* SB_s = ((void*)((char*)buf_dyn_shmem + 206848));
            tl::tma_load(SB_desc, full[(k % 5)], (&(((float*)SB_s)[((k % 5) * 16)])), (k * 4), 0);"""
    assert fp8_gemm.tma_smem_misalignments(src) == ["SB_s[((k % 5) * 16)] at {'k': 1}: byte 206912"]
    assert fp8_gemm.tma_smem_misalignments(src.replace("* 16)", "* 32)")) == []


@pytest.mark.parametrize(
    "cfg",
    [
        fp8_gemm.Config(128, 128, 128, 5, 256, False, True, 1, persistent=True),  # "ws 128x128" (crashed)
        fp8_gemm.Config(128, 128, 128, 5, 256, True, True, 1, persistent=True),  # "ws 128x128 ovl" (crashed)
        fp8_gemm.Config(128, 256, 128, 3, 256, False, True, 2, persistent=True, cluster=2, pingpong=True),
    ],
    ids=["128x128", "128x128-ovl", "128x256-pp-c2"],
)
def test_persistent_g32_tma_destinations_aligned(tilelang_required, cfg):
    from deepinfer.codegen import tilelang_backend as tb

    func = fp8_gemm.program(1024, 1024, 1280, act_group=32, weight_block=32, target="sm90", cfg=cfg)
    source = tb.lower(func, "sm90")
    assert source.count("tl::tma_load") >= 4, "A, B and both scale rings by TMA"
    assert fp8_gemm.tma_smem_misalignments(source) == []
