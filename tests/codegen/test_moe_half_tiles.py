"""Half tiles (issue 8): an expert's last 128-row tile holding at most 64 pairs is flagged in the contiguous layout's
tile table (moe_routing, half_tiles) and the persistent grouped program (fp8_gemm._program_sm90_ws, half_tiles) runs
it as 64 rows: both halves of the A stage get those rows, each consumer warpgroup one N slice. Checked here: the
flagged table against an oracle written from the definition (interpreter and torch reference, bit for bit), the
program's schedule on TileLang's `c` target against the float64 oracle and bit for bit against the program without
the option (padding rows of the half tiles filled with NaN: they must never reach a real row), the plan's limits,
the sm_90a builds, and (gpu) the compiled program against the default one on a layout of V4.1's one-GPU shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.codegen.kernels import _common, fp8_gemm
from deepinfer.codegen.kernels import moe_grouped_gemm as mg
from deepinfer.codegen.kernels import moe_routing as mr
from deepinfer.runtime import kernel_adapters as ka

FLAG = fp8_gemm.HALF_TILE_FLAG


def spread_routing(t: int, k: int, e: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()


def oracle_tiles(idx: torch.Tensor, e: int, block_m: int) -> list[int]:
    """The flagged table of the exact tiles, from the counts: expert x's tiles in order, its last one flagged when
    it holds at most block_m / 2 of x's pairs."""
    flat = idx.reshape(-1).tolist()
    tiles = []
    for x in range(e):
        n = flat.count(x)
        full, tail = divmod(n, block_m)
        tiles += [x] * full
        if tail:
            tiles.append(x + FLAG if 2 * tail <= block_m else x)
    return tiles


@pytest.mark.parametrize("t,k,e,bm,halves", [(200, 6, 48, 16, 24), (60, 6, 384, 16, 230), (300, 6, 12, 128, 12),
                                             (150, 2, 3, 64, 1)])  # fmt: skip
def test_half_tile_table_matches_the_oracle_and_the_reference(interpret, t, k, e, bm, halves):
    """halves: how many half tiles the oracle finds (every tile a half one at 384 experts x 16 rows; one of 6)."""
    idx = spread_routing(t, k, e, seed=t)
    n_tiles = ka._tile_bucket(mr.layout_tile_bound(t * k, e, bm))
    got = mr.triton_contiguous_layout(idx, e, bm, n_tiles, half_tiles=True)
    want = oracle_tiles(idx, e, bm)
    assert got[1].tolist() == want + [-1] * (n_tiles - len(want))
    assert sum(x >= FLAG for x in want) == halves
    plain = mr.triton_contiguous_layout(idx, e, bm, n_tiles)
    assert torch.equal(mg.tile_experts(got[1]), plain[1])  # the flag is all that changes
    for a, b in zip(got[:1] + got[2:], plain[:1] + plain[2:]):
        assert torch.equal(a, b)
    ref = mr.contiguous_layout_reference(idx, e, bm, n_tiles, half_tiles=True)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_reference_layout_flags_without_the_interpreter():
    """The torch reference alone (what the adapter runs without Triton): counts 70, 64, 65, 128, 0, 1 at 128 rows."""
    idx = torch.tensor([0] * 70 + [1] * 64 + [2] * 65 + [3] * 128 + [5], dtype=torch.int32).view(-1, 1)
    _, tiles, _, total = mr.contiguous_layout_reference(idx, 6, 128, 8, half_tiles=True)
    assert tiles.tolist() == [0, 1 + FLAG, 2, 3, 5 + FLAG, -1, -1, -1] and total.tolist() == [5]
    assert mg.row_experts(tiles[:5], 128, masked=False).view(5, 128)[:, 64:].tolist() == (
        [[0] * 64, [-1] * 64, [2] * 64, [3] * 64, [-1] * 64]
    )


def test_flagging_slots_kernel_compiles_for_hopper_spill_free():
    """sm_90a build of the layout's slots kernel with the flag (E = 384: a [64, 512] owner match per program)."""
    from tests.codegen._triton_aot import compile_sm90, spill_free

    sig = {"idx_ptr": "*i32", "part_ptr": "*i32", "counts_ptr": "*i32", "slot_ptr": "*i32", "tile_expert_ptr": "*i32",
           "total_ptr": "*i64", "P": "i32", "E": "i32", "S": "i32", "SEG": "i32", "N_TILES": "i32",
           "BLOCK_M": "i32"}  # fmt: skip
    consts = dict(BLOCK=mr.LAYOUT_BLOCK, BLOCK_E=512, BLOCK_S=4, TILE_BLOCK=mr.TILE_BLOCK, HALF_FLAG=FLAG)
    _, report = compile_sm90("deepinfer.codegen.kernels.moe_routing", "_layout_slots_kernel", sig, consts,
                             num_warps=mr.LAYOUT_WARPS)  # fmt: skip
    assert spill_free(report), report


def test_swiglu_quant_skips_the_rows_the_gemms_skip(interpret, monkeypatch):
    """act_quant.triton_swiglu_quant with the half-tile table (16-row tiles here): the rows it computes equal the
    table-less call's bit for bit; the rows of padding tiles and of half tiles' second halves (NaN here, as the
    GEMM leaves them unwritten) are skipped: codes and scales keep what the buffers held (7 here)."""
    from deepinfer.codegen.kernels import act_quant

    bm, inter = 16, 64
    tiles = torch.tensor([2, 0 + FLAG, -1, 1 + FLAG, 1], dtype=torch.int32)
    live = mg.row_experts(tiles, bm, masked=False) >= 0
    c = (torch.randn(tiles.numel() * bm, 2 * inter, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    c[~live] = float("nan")
    q0, s0 = act_quant.triton_swiglu_quant(c, 10.0, 32)
    full = torch.full
    monkeypatch.setattr(torch, "empty", lambda *shape, dtype=None, device=None: full(shape, 7.0, dtype=dtype,
                                                                                     device=device))  # fmt: skip
    q, s = act_quant.triton_swiglu_quant(c, 10.0, 32, tiles=tiles, block_m=bm)
    assert torch.equal(q[live], q0[live]) and torch.equal(s[:, live], s0[:, live])
    assert q0[~live].isnan().all(), "the table-less call computes them from the NaN"
    assert (q[~live] == 7.0).all() and (s[:, ~live] == 7.0).all(), "skipped: neither read nor written"


def test_swiglu_quant_with_the_table_compiles_for_hopper_spill_free():
    from tests.codegen._triton_aot import compile_sm90, spill_free

    sig = {"c_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "INTER": "i32", "stride_c": "i32",
           "ROWS": "i32", "LIMIT": "fp32", "tiles_ptr": "*i32", "BLOCK_M": "i32"}  # fmt: skip
    _, report = compile_sm90("deepinfer.codegen.kernels.act_quant", "_swiglu_kernel", sig,
                             dict(G=72, GROUP=32, BLOCK_G=128, HALF_FLAG=FLAG), num_warps=4)  # fmt: skip
    assert spill_free(report), report


# ---------------------------------------------------------------------------------------------- c target


@pytest.fixture(scope="module")
def cpu(tilelang_required):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    return compile_cpu


def _cfg(ag: int) -> fp8_gemm.Config:
    """The adapter's prefill tile (128 x 256, 2 N slices; ping-pong for 1x128) with c-target raster and CTAs."""
    return dataclasses.replace(mg.sm90_config(0, 256, k_group=ag), raster=2, sms=3)


@pytest.mark.parametrize("ag", [32, 128])
def test_half_tiles_c_target_equal_the_default_program_on_real_rows(cpu, ag):
    """Half tiles among full and padding tiles (expert 1's last tile, expert 0's only one, expert 2's last), 128x128
    weight blocks, 1x32 (the exact path) or 1x128 activations. The padding rows of the half tiles hold NaN (codes
    and scales): the real rows still match the float64 oracle and the default program bit for bit, and the half
    tiles' padding rows are left unwritten."""
    E, N, K, bm, wb = 3, 256, 384, 128, 128
    tiles = torch.tensor([1, 1 + FLAG, -1, 0 + FLAG, 2, 2 + FLAG], dtype=torch.int32)
    M = tiles.numel() * bm
    real = mg.row_experts(tiles, bm, masked=False) >= 0
    torch.manual_seed(ag)
    a, sa = _common.quant_fp8_groups(torch.randn(M, K), ag)
    quant = [_common.quant_fp8_blocks(torch.randn(N, K) * 0.05, wb) for _ in range(E)]
    b, sb = torch.stack([q for q, _ in quant]), torch.stack([s for _, s in quant])
    a, sa = a.float(), sa.clone()
    a[~real], sa[~real] = float("nan"), float("nan")
    half = cpu(mg.program(M, N, K, E, act_group=ag, weight_block=wb, target="cpu", cfg=_cfg(ag), half_tiles=True))
    plain = cpu(mg.program(M, N, K, E, act_group=ag, weight_block=wb, target="cpu", cfg=_cfg(ag)))
    c_half, c_plain = torch.full((M, N), float("nan")), torch.full((M, N), float("nan"))
    half(a, sa.T.contiguous(), b.float(), sb, tiles, c_half)
    plain(a, sa.T.contiguous(), b.float(), sb, mg.tile_experts(tiles), c_plain)
    want = mg.reference_f64(a, sa, b, sb, tiles, bm, ag, wb)
    assert (c_half[real].double() - want[real]).abs().max() <= 1e-5 * want[real].abs().max()
    assert torch.equal(c_half[real], c_plain[real])
    assert c_half[~real].isnan().all(), "half tiles' padding rows and padding tiles are not written"


def test_the_plan_refuses_half_tiles_where_the_program_has_no_two_slices():
    ok = mg.sm90_config(0, 4608, k_group=128)
    fp8_gemm.WSPlan(8192, 4608, 5120, 128, 128, ok, 384, half_tiles=True).check()
    bad = {
        "one N slice": dataclasses.replace(ok, block_n=128, n_split=1),
        "64-row tiles": dataclasses.replace(ok, block_m=64, threads=128),
        "overlap": dataclasses.replace(ok, pingpong=False, overlap=True, block_n=128, n_split=2),
        "direct store": dataclasses.replace(ok, direct_store=True),
    }
    for why, cfg in bad.items():
        with pytest.raises(AssertionError):
            fp8_gemm.WSPlan(8192, 4608, 5120, 128, 128, cfg, 384, half_tiles=True).check()
            pytest.fail(why)
    with pytest.raises(AssertionError):  # dense: no tile table
        fp8_gemm.WSPlan(8192, 4608, 5120, 128, 128, ok, 0, half_tiles=True).check()


# ---------------------------------------------------------------------------------------------- sm_90a builds

E41, D41, I41 = 384, 5120, 2304  # V4.1's experts, hidden and expert dims


@pytest.mark.parametrize("ag,which", [(128, "w13"), (32, "w2")])
def test_half_tiles_sm90_build(codegen_cache, nvcc_required, ag, which):
    """The adapter's prefill programs at V4.1's dims with half tiles: FP8 wgmma, no spills, the producer/consumer
    register split, aligned TMA destinations, the flag tested, half tiles stored from registers."""
    from deepinfer.codegen import tilelang_backend as tb

    n, k = (2 * I41, D41) if which == "w13" else (D41, I41)
    func = mg.program(128 * 64, n, k, E41, act_group=ag, weight_block=128, target="sm90",
                      cfg=mg.sm90_config(0, n, k_group=ag), half_tiles=True)  # fmt: skip
    art = tb.build(f"moe_half_tiles_a{ag}_{which}", func, "sm90")
    ops = art.opcodes
    assert ops["QGMMA"] > 0 and ops["USETMAXREG"] == 2 and ops["UTMASTG"] > 0 and ops["STG"] > 0
    assert ops["LDL"] == 0 and ops["STL"] == 0, "register spills"
    assert f"{FLAG} <= TileExpert[" in art.source and f"& {FLAG - 1})" in art.source
    assert fp8_gemm.tma_smem_misalignments(art.source) == []


def _ptxas_report(func, tmp_path) -> str:
    """ptxas -v output of the program's sm_90a build (nvcc with the backend's flags)."""
    import subprocess

    from deepinfer.codegen import tilelang_backend as tb

    src = tmp_path / "k.cu"
    src.write_text(tb.lower(func, "sm90"))
    incs = [f"-I{d}" for d in tb.tilelang_include_dirs()]
    cmd = [tb.nvcc_path(), *tb.NVCC_FLAGS, "-arch=sm_90a", *incs, "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
           str(src)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


@pytest.mark.parametrize("half", [False, True])
def test_grouped_g128_program_keeps_its_wgmma_pipeline(nvcc_required, tmp_path, half):
    """The one-GPU prefill's w1|w3 program (g128 ping-pong), without and with half tiles: ptxas keeps its async
    wgmmas pipelined -- no "wgmma.mma_async instructions are serialized" (C7518), which costs the MMA / promotion
    overlap of every tile. (The half-tile program measured in session 8 had its wgmmas under thread-dependent
    branches and got C7518: 0.78-0.93x the default on the H200.)"""
    func = mg.program(128 * 64, 2 * I41, D41, E41, act_group=128, weight_block=128, target="sm90",
                      cfg=mg.sm90_config(0, 2 * I41, k_group=128), half_tiles=half)  # fmt: skip
    report = _ptxas_report(func, tmp_path)
    assert "Used " in report and "C7518" not in report, report


# ---------------------------------------------------------------------------------------------- gpu


@pytest.mark.gpu
@pytest.mark.parametrize("ag", [32, 128])
def test_cuda_half_tiles_equal_the_default_program(ag):
    """V4.1's w1|w3 GEMM on the adapter's persistent config, 1024 tokens x top-6 over 48 experts (~128 pairs an
    expert: full and half tiles mixed), the Triton layout: the half-tile program's real rows equal the default
    program's bit for bit, and experts 0-3 match the float64 oracle (rel 2e-2)."""
    t, k, e, n, d, bm = 1024, 6, 48, 2 * I41, D41, 128
    idx = spread_routing(t, k, e, seed=1).cuda()
    n_tiles = ka._tile_bucket(mr.layout_tile_bound(t * k, e, bm))
    tiles = mr.triton_contiguous_layout(idx, e, bm, n_tiles, half_tiles=True)[1]
    m = n_tiles * bm
    row_e = mg.row_experts(tiles, bm, masked=False).cuda()
    real = row_e >= 0
    assert (tiles >= FLAG).any() and ((tiles >= 0) & (tiles < FLAG)).any()
    a, sa = _common.quant_fp8_groups(torch.randn(m, d, device="cuda"), ag)
    b = torch.randint(0, 256, (e, n, d), dtype=torch.uint8, device="cuda").bitwise_and_(0xBF).view(torch.float8_e4m3fn)
    sb = torch.exp2(torch.randint(-9, -5, (e, n // 128, d // 128), device="cuda").float())
    cfg = mg.sm90_config(0, n, k_group=ag)
    outs = []
    for half in (True, False):
        extra = {"half_tiles": True} if half else {}
        kernel = ka.build_kernel(ka._key("moe_grouped_gemm", "program", (m, n, d, e), cfg, act_group=ag,
                                         weight_block=128, **extra))  # fmt: skip
        c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        kernel(a, sa.T.contiguous(), b, sb, tiles if half else mg.tile_experts(tiles), c)
        torch.cuda.synchronize()
        outs.append(c)
    assert torch.equal(outs[0][real], outs[1][real])  # (real: every row but the half tiles' second halves)
    for x in range(4):
        rows = row_e == x
        a64 = a[rows].double() * _common.expand_scales(sa[rows].double(), 1, ag, (int(rows.sum()), d))
        b64 = b[x].double() * _common.expand_scales(sb[x].double(), 128, 128, (n, d))
        want = a64 @ b64.T
        assert ((outs[0][rows].double() - want).abs().max() / want.abs().max()).item() <= 2e-2


# ---------------------------------------------------------------------------------------------- the adapter


def test_adapter_half_tiles_switch_gives_the_same_output(monkeypatch, tilelang_required):
    """MoEGroupedAdapter's fp8 prefill with DEEPINFER_MOE_HALF_TILES=1: both grouped GEMMs' keys carry half_tiles and
    run the real programs (their c-target builds) on the flagged layout; the node's output equals the default path's
    bit for bit (the half tiles' padding rows, unwritten now, are never read into a real row). 600 tokens x top-2
    over 8 experts: ~150 pairs an expert, so most experts end in a half tile."""
    from tests.codegen.test_moe_prefill_g128_adapter import G128, moe_call

    monkeypatch.setattr(ka, "EMULATE", True)  # CPU tensors accepted (the kernels here are the c-target builds)

    def run(on: bool):
        monkeypatch.setenv(ka.MOE_HALF_TILES_ENV, "1" if on else "0")
        call = moe_call(600, 128, G128)
        adapter = ka.MoEGroupedAdapter()
        keys = adapter.keys(call)
        assert [dict(k.kwargs).get("half_tiles", False) for k in keys] == [on, on]
        tiles = adapter._plan(call).layout[1]
        assert (tiles >= FLAG).any() == on
        return adapter.run(call, [ka.c_target_kernel(k) for k in keys])[0]

    assert torch.equal(run(True), run(False))
