"""Each family's torch reference against an independent formula (no TileLang needed)."""

import pytest
import torch

from deepinfer.codegen.kernels import _common, fp8_gemm, hyper_connection, moe_routing, rmsnorm_quant


@pytest.mark.parametrize("group", [32, 128])
def test_fp8_gemm_reference_matches_dequantise_then_matmul_f64(group):
    M, N, K = 48, 256, 512
    a, sa, b, sb = fp8_gemm.make_inputs(M, N, K, group, group, seed=1)
    out = fp8_gemm.reference(a, sa, b, sb, group, group)
    oracle = fp8_gemm.reference_dequant_f64(a, sa, b, sb, group, group)
    assert (out.double() - oracle).abs().max() / oracle.abs().max() < 1e-6


def test_fp8_gemm_mixed_granularity_v41_activations_v4_weights():
    # groups of 32 on the activations, 128x128 weight blocks: the step is the finer of the two
    a, sa, b, sb = fp8_gemm.make_inputs(16, 256, 256, 32, 128, seed=2)
    out = fp8_gemm.reference(a, sa, b, sb, 32, 128)
    oracle = fp8_gemm.reference_dequant_f64(a, sa, b, sb, 32, 128)
    assert (out.double() - oracle).abs().max() / oracle.abs().max() < 1e-6


def test_fp8_quantisation_is_close_and_scales_are_powers_of_two():
    x = torch.randn(8, 256) * 3
    q, s = _common.quant_fp8_groups(x, 32)
    assert torch.equal(torch.log2(s), torch.round(torch.log2(s)))  # ue8m0
    deq = q.float() * s.repeat_interleave(32, 1)
    assert (deq - x).abs().max() <= 0.07 * x.abs().max()  # e4m3 has a 3-bit mantissa
    assert q.float().abs().max() <= _common.FP8_MAX


def test_rmsnorm_reference_matches_f64_formula():
    x, w = torch.randn(16, 5120), torch.rand(5120) + 0.5
    y = rmsnorm_quant.reference(x, w, 1e-6)
    assert (y.double() - rmsnorm_quant.reference_f64(x, w, 1e-6)).abs().max() < 1e-5


def test_rmsnorm_quant_reference_round_trips():
    x, w = torch.randn(4, 256, dtype=torch.bfloat16), torch.rand(256) + 0.5
    q, s = rmsnorm_quant.reference(x, w, 1e-20, group=32)
    y = rmsnorm_quant.reference_f64(x.float(), w, 1e-20)
    assert ((q.float() * s.repeat_interleave(32, 1)).double() - y).abs().max() < 0.08 * y.abs().max()


def test_moe_routing_reference_matches_f64_argsort():
    torch.manual_seed(0)
    logits, bias = torch.randn(32, 384), torch.randn(384) * 0.1
    idx, w = moe_routing.reference(logits, bias, 6, 1.5)
    oidx, ow = moe_routing.reference_f64(logits, bias, 6, 1.5)
    assert torch.equal(idx.long(), oidx)
    assert (w.double() - ow).abs().max() < 1e-6
    assert torch.allclose(w.sum(-1), torch.full((32,), 1.5))


def test_moe_routing_ties_go_to_lowest_expert():
    logits = torch.zeros(1, 16)
    idx, _ = moe_routing.reference(logits, torch.zeros(16), 4, 1.0)
    assert idx.tolist() == [[0, 1, 2, 3]]


def test_hc_sinkhorn_converges_to_doubly_stochastic_and_is_not_symmetric():
    torch.manual_seed(0)
    mixes, base, scale = torch.randn(5, 24), torch.randn(24), torch.rand(3) + 0.5
    pre, post, c = hyper_connection.coefficients_reference(mixes, base, scale, 1e-6, 20)
    assert torch.allclose(c.sum(-2), torch.ones(5, 4), atol=1e-4)  # columns exactly after the last step
    assert torch.allclose(c.sum(-1), torch.ones(5, 4), atol=1e-2)
    assert (pre > 0).all() and (pre < 1 + 1e-5).all() and (post > 0).all() and (post < 2).all()
    assert not torch.allclose(c, c.transpose(-1, -2), atol=1e-3)  # makes the orientation test meaningful


def test_hc_post_reference_sums_over_first_index_of_c():
    torch.manual_seed(0)
    x, y = torch.randn(3, 4, 32), torch.randn(3, 32)
    post, c = torch.rand(3, 4), torch.rand(3, 4, 4)
    out = hyper_connection.post_reference(x, y, post, c)
    assert (out.double() - hyper_connection.post_reference_loops(x, y, post, c)).abs().max() < 1e-5
    wrong = hyper_connection.post_reference(x, y, post, c.transpose(-1, -2))
    assert (wrong - out).abs().max() > 1e-2


def test_hc_pre_reference_collapses_with_previous_pre():
    x = torch.randn(2, 4, 16)
    p = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 2.0]])
    y, *_ = hyper_connection.pre_reference(x, torch.randn(24, 64), torch.zeros(24), torch.ones(3), p, 1e-20, 1e-6, 3)
    assert torch.allclose(y[0], x[0, 0]) and torch.allclose(y[1], 2 * x[1, 3])


@pytest.mark.parametrize(
    "fn,args",
    [
        (fp8_gemm.roofline, (4096, 5120, 5120, 32, 32)),
        (rmsnorm_quant.roofline, (4096, 5120, 32)),
        (moe_routing.roofline, (4096, 384, 6)),
        (hyper_connection.pre_roofline, (4096, 5120)),
        (hyper_connection.post_roofline, (4096, 5120)),
    ],
)
def test_rooflines_are_positive(fn, args):
    bytes_, flops = fn(*args)
    assert bytes_ > 0 and flops > 0


def test_fp8_gemm_roofline_counts():
    bytes_, flops = fp8_gemm.roofline(128, 256, 512, 128, 128)
    assert flops == 2 * 128 * 256 * 512
    assert bytes_ == 128 * 512 + 256 * 512 + 4 * 128 * 4 + 4 * 2 * 4 + 2 * 128 * 256


def test_moe_grouped_gemm_reference_matches_per_row_f64():
    from deepinfer.codegen.kernels import moe_grouped_gemm

    torch.manual_seed(4)
    E, N, K, bm, g = 3, 64, 128, 8, 32
    ids = torch.randint(0, E, (30,))
    rows, tiles = moe_grouped_gemm.contiguous_layout(ids, E, bm)
    assert rows.numel() % bm == 0 and (rows >= 0).sum() == 30
    assert sorted(rows[rows >= 0].tolist()) == list(range(30))  # a permutation of the routed rows
    x = torch.randn(30, K)
    a, sa = _common.quant_fp8_groups(torch.where(rows[:, None] >= 0, x[rows.clamp_min(0)], 0.0), g)
    quant = [_common.quant_fp8_blocks(torch.randn(N, K) * 0.05, g) for _ in range(E)]
    b, sb = torch.stack([q for q, _ in quant]), torch.stack([s for _, s in quant])
    out = moe_grouped_gemm.reference(a, sa, b, sb, tiles, bm, g, g)
    oracle = moe_grouped_gemm.reference_f64(a, sa, b, sb, tiles, bm, g, g)
    assert (out.double() - oracle).abs().max() < 1e-6 * oracle.abs().max()


def test_sparse_attn_reference_matches_f64_loops_and_sink_matters():
    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    torch.manual_seed(6)
    q, kv = torch.randn(2, 4, 32), torch.randn(50, 32)
    idx = torch.randint(0, 50, (2, 16), dtype=torch.int32)
    idx[0, :3] = -1
    sink = torch.randn(4)
    out = sad.reference(q, kv, idx, sink)
    assert (out.double() - sad.reference_f64_loops(q, kv, idx, sink)).abs().max() < 1e-5
    # a huge sink absorbs the probability mass; a very negative one is plain softmax attention
    assert sad.reference(q, kv, idx, torch.full((4,), 1e4)).abs().max() < 1e-6
    plain = sad.reference(q, kv, idx, torch.full((4,), -1e4))
    assert not torch.allclose(plain, out, atol=1e-3)
