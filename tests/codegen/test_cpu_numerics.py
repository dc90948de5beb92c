"""fp32 numerics of the TileLang programs on TileLang's `c` target (g++), against the torch references.

The CPU programs are the same factories with `target="cpu"`: local buffers, serial loops, fp32 data
(TOOLCHAIN.md §2). They check indexing, scaling and reduction logic, not GPU code generation.
"""

import pytest
import torch

from deepinfer.codegen.kernels import fp8_gemm, hyper_connection, moe_routing, rmsnorm_quant


@pytest.fixture(scope="module")
def cpu(tilelang_required):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    return compile_cpu


@pytest.mark.parametrize("ag,wb", [(32, 32), (128, 128), (32, 128)])
def test_fp8_gemm_c_target(cpu, ag, wb):
    M, N, K = 64, 256, 256
    a, sa, b, sb = fp8_gemm.make_inputs(M, N, K, ag, wb, seed=3)
    cfg = fp8_gemm.Config(32, 64, min(ag, wb), 2, 128)
    kernel = cpu(fp8_gemm.program(M, N, K, act_group=ag, weight_block=wb, target="cpu", cfg=cfg))
    out = torch.empty(M, N)
    kernel(a.float(), sa.T.contiguous(), b.float(), sb, out)
    ref = fp8_gemm.reference(a, sa, b, sb, ag, wb)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


# 1280: V4.1 q_lora_rank, 40 groups (padded to 64 by the quantising program at block_m 2, unpadded at block_m 1)
@pytest.mark.parametrize("D, block_m", [(256, 2), (1280, 2), (1280, 1), (5120, 1)])
@pytest.mark.parametrize("quant", [False, True])
def test_rmsnorm_c_target(cpu, quant, D, block_m):
    M, g = 6, 32
    torch.manual_seed(0)
    x, w = torch.randn(M, D) * 2, torch.rand(D) + 0.5
    cfg = rmsnorm_quant.Config(block_m, 128)
    kernel = cpu(rmsnorm_quant.program(M, D, group=g, quant=quant, eps=1e-6, target="cpu", cfg=cfg))
    if not quant:
        y = torch.empty(M, D)
        kernel(x, w, y)
        assert (y - rmsnorm_quant.reference(x, w, 1e-6)).abs().max() < 1e-5
        return
    q, s = torch.empty(M, D), torch.empty(D // g, M)
    kernel(x, w, q, s)
    rq, rs = rmsnorm_quant.reference(x, w, 1e-6, group=g)
    assert torch.equal(s.T, rs)  # power-of-two scales agree exactly
    assert torch.equal(q.to(torch.float8_e4m3fn).float(), rq.float())  # the CPU run stops before the fp8 cast


def test_rmsnorm_row_width():
    """Only the quantising program's multi-row blocks pad the row to a power-of-two group count."""
    assert rmsnorm_quant.row_width(5120, 32, 1, True) == 5120  # 160 groups: the padded form ran 4x slower
    assert rmsnorm_quant.row_width(1280, 32, 2, True) == 2048  # 40 groups -> 64
    assert rmsnorm_quant.row_width(1280, 32, 2, False) == 1280
    assert rmsnorm_quant.row_width(4096, 32, 4, True) == 4096  # already a power of two


def test_moe_routing_c_target(cpu):
    T_, E, k = 24, 64, 6
    torch.manual_seed(1)
    logits, bias = torch.randn(T_, E) * 2, torch.randn(E) * 0.2
    kernel = cpu(moe_routing.program(T_, E, topk=k, route_scale=1.5, target="cpu", cfg=moe_routing.Config(4, 128)))
    idx, w = torch.empty(T_, k, dtype=torch.int32), torch.empty(T_, k)
    kernel(logits, bias, idx, w)
    ridx, rw = moe_routing.reference(logits, bias, k, 1.5)
    assert torch.equal(idx, ridx)
    assert (w - rw).abs().max() < 1e-6


def test_hc_pre_and_post_c_target(cpu):
    T_, D = 8, 64
    torch.manual_seed(2)
    x = torch.randn(T_, 4, D)
    fn, base, scale = torch.randn(24, 4 * D) * 0.05, torch.randn(24) * 0.3, torch.rand(3) + 0.5
    p_prev = torch.rand(T_, 4)
    pre_k = cpu(
        hyper_connection.pre_program(
            T_, D, eps=1e-20, hc_eps=1e-6, iters=20, target="cpu", cfg=hyper_connection.Config(4, 32, 128)
        )
    )
    y, pre, post, comb = torch.empty(T_, D), torch.empty(T_, 4), torch.empty(T_, 4), torch.empty(T_, 16)
    pre_k(x.reshape(T_, -1), hyper_connection.pad_fn(fn), base, scale, p_prev, y, pre, post, comb)
    ry, rpre, rpost, rc = hyper_connection.pre_reference(x, fn, base, scale, p_prev, 1e-20, 1e-6, 20)
    for got, want in ((y, ry), (pre, rpre), (post, rpost), (comb, rc.reshape(T_, 16))):
        assert (got - want).abs().max() < 1e-5
    post_k = cpu(hyper_connection.post_program(T_, D, target="cpu", block_m=2, block_d=32))
    out = torch.empty(T_, 4, D)
    post_k(x, y, post, comb, out)
    assert (out - hyper_connection.post_reference(x, y, post, rc)).abs().max() < 1e-5


def test_moe_grouped_gemm_c_target(cpu):
    from deepinfer.codegen.kernels import _common, moe_grouped_gemm

    torch.manual_seed(3)
    E, N, K, bm, g = 4, 64, 128, 16, 32
    ids = torch.randint(0, E, (60,))
    ids[ids == 2] = 1  # an expert with no rows, another spanning several tiles
    rows, tiles = moe_grouped_gemm.contiguous_layout(ids, E, bm)
    x = torch.randn(60, K)
    a, sa = _common.quant_fp8_groups(torch.where(rows[:, None] >= 0, x[rows.clamp_min(0)], 0.0), g)
    quant = [_common.quant_fp8_blocks(torch.randn(N, K) * 0.05, g) for _ in range(E)]
    b, sb = torch.stack([q for q, _ in quant]), torch.stack([s for _, s in quant])
    M = rows.numel()
    cfg = fp8_gemm.Config(bm, 32, 32, 2, 128)
    kernel = cpu(moe_grouped_gemm.program(M, N, K, E, act_group=g, weight_block=g, target="cpu", cfg=cfg))
    out = torch.empty(M, N)
    kernel(a.float(), sa.T.contiguous(), b.float(), sb, tiles, out)
    ref = moe_grouped_gemm.reference(a, sa, b, sb, tiles, bm, g, g)
    assert tiles.tolist().count(1) >= 2 and 2 not in tiles.tolist()
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_sparse_attn_decode_c_target(cpu):
    from deepinfer.codegen.kernels import sparse_attn_decode

    torch.manual_seed(5)
    B, H, D, S, K = 3, 8, 64, 200, 64
    q, kv = torch.randn(B, H, D), torch.randn(S, D)
    idx = torch.randint(0, S, (B, K), dtype=torch.int32)
    idx[:, -5:] = -1  # invalid slots, including in the last block
    sink = torch.randn(H) * 2
    kernel = cpu(sparse_attn_decode.program(B, H, D, S, K, target="cpu", cfg=sparse_attn_decode.Config(32, 128)))
    out = torch.empty(B, H, D)
    kernel(q, kv, idx, sink, out)
    assert (out - sparse_attn_decode.reference(q, kv, idx, sink)).abs().max() < 1e-5


def test_sparse_attn_decode_split_c_target(cpu):
    """split-K (4 chunks) + combine: a chunk of only -1 entries and the sink stay exact."""
    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    torch.manual_seed(6)
    B, H, D, S, K, ns = 2, 8, 64, 200, 128, 4
    q, kv = torch.randn(B, H, D), torch.randn(S, D)
    idx = torch.randint(0, S, (B, K), dtype=torch.int32)
    idx[0, 96:] = -1  # request 0: its whole last chunk is invalid
    idx[1, 40:45] = -1
    sink = torch.randn(H) * 2
    cfg = sad.Config(32, 128, ns, 1)
    part, comb = (cpu(f) for f in sad.split_programs(B, H, D, S, K, target="cpu", cfg=cfg))
    out = torch.empty(B, H, D)
    sad.run_split((part, comb), q, kv, idx, sink, out, ns)
    assert (out - sad.reference(q, kv, idx, sink)).abs().max() < 1e-5


def test_hc_pre_split_c_target(cpu):
    """The few-token hc_pre (D split over CTAs, partials summed in split order by a second kernel) against the
    reference and against the one-kernel program on the same inputs."""
    T_, D, splits = 8, 128, 4
    torch.manual_seed(5)
    x = torch.randn(T_, 4, D)
    fn, base, scale = torch.randn(24, 4 * D) * 0.05, torch.randn(24) * 0.3, torch.rand(3) + 0.5
    p_prev = torch.rand(T_, 4)
    cfg = hyper_connection.Config(4, 32, 128)
    partial, finish = (
        cpu(f)
        for f in hyper_connection.pre_split_programs(
            T_, D, eps=1e-20, hc_eps=1e-6, iters=20, target="cpu", splits=splits, cfg=cfg, finish_rows=4
        )
    )
    y, pre, post, comb = torch.empty(T_, D), torch.empty(T_, 4), torch.empty(T_, 4), torch.empty(T_, 16)
    pm, psq = torch.full((splits, T_, 32), float("nan")), torch.full((splits, T_), float("nan"))
    partial(x.reshape(T_, -1), hyper_connection.pad_fn(fn), p_prev, y, pm, psq)
    finish(pm, psq, base, scale, pre, post, comb)
    ry, rpre, rpost, rc = hyper_connection.pre_reference(x, fn, base, scale, p_prev, 1e-20, 1e-6, 20)
    for got, want in ((y, ry), (pre, rpre), (post, rpost), (comb, rc.reshape(T_, 16))):
        assert (got - want).abs().max() < 1e-5
    one = cpu(hyper_connection.pre_program(T_, D, eps=1e-20, hc_eps=1e-6, iters=20, target="cpu", cfg=cfg))
    y1, pre1, post1, comb1 = torch.empty(T_, D), torch.empty(T_, 4), torch.empty(T_, 4), torch.empty(T_, 16)
    one(x.reshape(T_, -1), hyper_connection.pad_fn(fn), base, scale, p_prev, y1, pre1, post1, comb1)
    assert torch.equal(y, y1)  # the collapse does not depend on the split
    assert (comb - comb1).abs().max() < 1e-6 and (pre - pre1).abs().max() < 1e-6
