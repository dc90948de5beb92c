"""V4.1 MoE prefill in the V4 format (issue 8): the 1x32 -> 1x128 activation statement (act_quant.py's module doc),
the one-launch SwiGLU + quant that feeds the prefill w2 GEMM, and the persistent grouped program with 128x128 weight
blocks and 1x32 or 1x128 activation groups on TileLang's `c` target against the float64 oracle."""

import dataclasses

import pytest
import torch

from deepinfer.codegen.kernels import _common, act_quant, fp8_gemm
from deepinfer.codegen.kernels import moe_grouped_gemm as mg


def _heavy_tailed(m: int, k: int, seed: int) -> torch.Tensor:
    """Post-norm-like activations: per-channel scales over ~3 binades, Student-t rows, a few massive channels
    (x300): many 128-groups hold one large value next to small ones (the case the statement is about)."""
    g = torch.Generator().manual_seed(seed)
    chan = torch.exp(torch.randn(k, generator=g))
    chan[torch.randperm(k, generator=g)[: max(1, k // 128)]] *= 300.0
    return _student_t(m, k, g) * chan


def _student_t(m: int, k: int, g: torch.Generator, df: int = 4) -> torch.Tensor:
    z = torch.randn(m, k, generator=g)
    chi2 = torch.randn(df, m, k, generator=g).pow(2).sum(0)
    return z / (chi2 / df).sqrt()


def _cases() -> dict[str, torch.Tensor]:
    hard = torch.randn(4, 512, generator=torch.Generator().manual_seed(1)) * torch.logspace(-12, 12, 512, base=2.0)
    heavy = _heavy_tailed(64, 1024, seed=2)
    rebase = act_quant.reference(heavy, 32)  # the prefill x: already 1x32-quantised (fake_quant_fp8), dequantised
    x32 = rebase[0].float() * rebase[1].T.repeat_interleave(32, 1)
    return {"hard": hard, "heavy": heavy, "rebase of 1x32 values": x32, "gaussian": torch.randn(64, 1024)}


@pytest.mark.parametrize("name", list(_cases()))
def test_coarser_groups_keep_every_value_above_the_threshold(name):
    """1x32 vs 1x128 quantisation: bit-identical dequantised values wherever |v| >= 2^-6 s128; below, within
    2^-9 s128 (act_quant.py's statement)."""
    stats = act_quant.rebase_stats(_cases()[name], 32, 128)
    assert stats["above_identical"], stats
    assert stats["max_below_over_scale"] <= 2.0**-9, stats
    assert stats["differ"] <= stats["below"]


def test_the_statement_is_not_vacuous():
    """On the heavy-tailed rows some values do sit below the threshold and do change (else the test above could
    not fail), and quantising per 128 without the threshold rule would not be bit-identical everywhere."""
    stats = act_quant.rebase_stats(_cases()["heavy"], 32, 128)
    assert stats["below"] > 1e-3 and stats["differ"] > 0 and stats["max_below_over_scale"] > 2.0**-12


@pytest.mark.parametrize("group,limit", [(32, 10.0), (128, 10.0), (128, 0.0)])
def test_swiglu_quant_interpreter_matches_the_torch_formula(interpret, group, limit):
    """triton_swiglu_quant vs swiglu (ir/ops/moe.py) + reference quantisation: the same scales, the same codes
    except where the fp32 SwiGLU differs by an ulp at a rounding boundary (then one E4M3 step)."""
    g = torch.Generator().manual_seed(group + int(limit))
    inter = 256
    c = (torch.randn(5, 2 * inter, generator=g) * 4).bfloat16()
    c[0, :inter] = 20.0  # gates beyond the clamp
    c[1] = 0.0  # a zero row: the floor's scale
    q, s = act_quant.triton_swiglu_quant(c, limit, group)
    rq, rs = act_quant.swiglu_quant_reference(c, limit, group)
    assert q.shape == (5, inter) and s.shape == (inter // group, 5)
    assert torch.equal(s, rs)
    got, want = q.to(torch.float8_e4m3fn).float(), rq.float()
    step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2.0**-6))) - 3)  # one E4M3 step at that value
    assert ((got - want).abs() <= step).all() and (got == want).float().mean() >= 0.99


def test_swiglu_quant_rejects_groups_that_do_not_split_the_row(interpret):
    with pytest.raises(AssertionError):
        act_quant.triton_swiglu_quant(torch.zeros(2, 2 * 96), 10.0, 128)


# ---------------------------------------------------------------------------------------------- c target


@pytest.fixture(scope="module")
def cpu(tilelang_required):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    return compile_cpu


_WS_128 = {  # (act group, config): c-target sizes, and the adapter's own sm90_config tile (128 x 256, 2 N slices)
    "a32 64x128": (32, fp8_gemm.Config(64, 128, 128, 3, 128, True, True, 1, persistent=True, raster=2, sms=5)),
    "a128 64x128": (128, fp8_gemm.Config(64, 128, 128, 3, 128, False, True, 1, persistent=True, raster=2, sms=5)),
    "a32 sm90_config": (32, dataclasses.replace(mg.sm90_config(0, 256, k_group=32), raster=2, sms=3)),
    "a128 sm90_config": (128, dataclasses.replace(mg.sm90_config(0, 256, k_group=128), raster=2, sms=3)),
}


@pytest.mark.parametrize("name", list(_WS_128))
def test_persistent_grouped_128_blocks_c_target(cpu, name):
    """The prefill program the adapter takes for 128x128 experts (fp8_gemm's persistent schedule with experts):
    1x32 activations (exact path: 4 promotions per 128-K weight block, one weight scale) and 1x128 (the option).
    Padding tiles skipped; against the float64 dequantised oracle."""
    ag, cfg = _WS_128[name]
    E, N, K, bm, wb = 3, 256, 384, cfg.block_m, 128
    tiles = torch.tensor([1, 1, -1, 0, 2, -1, 2], dtype=torch.int32)
    torch.manual_seed(ag)
    a, sa = _common.quant_fp8_groups(torch.randn(tiles.numel() * bm, K), ag)
    quant = [_common.quant_fp8_blocks(torch.randn(N, K) * 0.05, wb) for _ in range(E)]
    b, sb = torch.stack([q for q, _ in quant]), torch.stack([s for _, s in quant])
    M = tiles.numel() * bm
    kernel = cpu(mg.program(M, N, K, E, act_group=ag, weight_block=wb, target="cpu", cfg=cfg))
    c = torch.full((M, N), float("nan"))
    kernel(a.float(), sa.T.contiguous(), b.float(), sb, tiles, c)
    want = mg.reference_f64(a, sa, b, sb, tiles, bm, ag, wb)
    real = mg.row_experts(tiles, bm, masked=False) >= 0
    assert (c[real].double() - want[real]).abs().max() <= 1e-5 * want.abs().max()
    assert c[~real].isnan().all()


@pytest.mark.parametrize("group,bg", [(32, 128), (128, 32)])
def test_swiglu_quant_compiles_for_hopper_spill_free(group, bg):
    """sm_90a build at V4.1's I = 2304 (bf16 in, e4m3 out): no spills, the e4m3 conversion, no lg2 (the scale
    comes from the bits)."""
    from tests.codegen._triton_aot import compile_sm90, spill_free

    sig = {"c_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "INTER": "i32", "stride_c": "i32",
           "ROWS": "i32", "LIMIT": "fp32", "tiles_ptr": "*i32", "BLOCK_M": "i32"}  # fmt: skip
    ptx, report = compile_sm90("deepinfer.codegen.kernels.act_quant", "_swiglu_kernel", sig,
                               dict(G=2304 // group, GROUP=group, BLOCK_G=bg), num_warps=4)  # fmt: skip
    assert ".target sm_90a" in ptx and "e4m3x2" in ptx and "lg2." not in ptx
    assert spill_free(report), report


@pytest.mark.gpu
@pytest.mark.parametrize("group", [32, 128])
def test_cuda_swiglu_quant_matches_the_torch_formula(group):
    """The compiled kernel at the prefill w2 operand's shape (rows x 2 x 2304, bf16) against swiglu + quant."""
    c = (torch.randn(4096, 2 * 2304, device="cuda") * 4).bfloat16()
    q, s = act_quant.triton_swiglu_quant(c, 10.0, group)
    rq, rs = act_quant.swiglu_quant_reference(c, 10.0, group)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(s, rs)
    got, want = q.float(), rq.float()
    step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2.0**-6))) - 3)
    assert ((got - want).abs() <= step).all() and (got == want).float().mean() >= 0.99


# ---------------------------------------------------------------------------------------------- the un-permute


def test_combine_rows_interpreter_matches_the_torch_formula(interpret):
    """y[t] = sum_j w[t, j] C[slot[t K + j]]: padding rows of C never read, D not a multiple of the block."""
    g = torch.Generator().manual_seed(7)
    t, k, d, rows = 5, 3, 1100, 40
    c = torch.randn(rows, d, generator=g).bfloat16()
    slot = torch.randperm(rows, generator=g)[: t * k]
    c[torch.tensor([i for i in range(rows) if i not in set(slot.tolist())])] = float("nan")
    w = torch.rand(t, k, generator=g)
    got = mg.combine_rows(c, slot, w, block_d=512)
    want = mg.combine_rows_reference(c, slot, w)
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    base = torch.randn(t, d, generator=g)  # the shared expert's output, added in the same launch
    got = mg.combine_rows(c, slot, w, base, block_d=512)
    assert torch.allclose(got, mg.combine_rows_reference(c, slot, w, base), rtol=1e-6, atol=1e-6)


def test_combine_rows_compiles_for_hopper_spill_free():
    from tests.codegen._triton_aot import compile_sm90, spill_free

    sig = {"c_ptr": "*bf16", "slot_ptr": "*i64", "w_ptr": "*fp32", "y_ptr": "*fp32", "base_ptr": "*fp32", "D": "i32",
           "stride_c": "i32"}  # fmt: skip
    ptx, report = compile_sm90("deepinfer.codegen.kernels.moe_grouped_gemm", "_combine_kernel", sig,
                               dict(K=6, BLOCK_D=1024, HAS_BASE=True), num_warps=4)  # fmt: skip
    assert ".target sm_90a" in ptx and spill_free(report), report


@pytest.mark.gpu
def test_cuda_combine_rows_matches_the_torch_formula():
    t, k, d = 8192, 6, 5120
    c = torch.randn(t * k + 500, d, device="cuda").bfloat16()
    slot = torch.randperm(t * k + 500, device="cuda")[: t * k]
    w = torch.rand(t, k, device="cuda")
    got = mg.combine_rows(c, slot, w)
    assert torch.allclose(got, mg.combine_rows_reference(c, slot, w), rtol=1e-5, atol=1e-5)
