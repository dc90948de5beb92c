"""linear_bf16: decode `linear` (fp32 x, bf16 weight) as one Triton kernel with K split over CTAs. Oracles: a
float64 product (independent) and the op's reference (fp32 copy of the weight); the split of x into three bf16
terms is exact. CPU: the Triton interpreter (bf16 operands multiplied in fp32 there: the same exact products);
sm90: the PTX builds with bf16 wgmmas; the gpu test runs the compiled kernel at V4.1's decode dims."""

import pytest
import torch

from deepinfer.codegen.kernels import linear_bf16 as lb
from deepinfer.ir.ops.core import Linear, split_f32_to_bf16
from tests.codegen._triton_aot import compile_sm90, spill_free


def _inputs(t: int, n: int, k: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-3, 3, k)  # values over 20 binades: all three terms count
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    return x.to(device), w.to(device)


def _err(y, want):
    return ((y.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("t,n,k", [(5, 96, 256), (64, 32, 512), (70, 64, 320)])
def test_interpreter_matches_f64_and_the_op(interpret, t, n, k):
    x, w = _inputs(t, n, k, seed=t * n)
    cfg = lb.default_config(t, n, k)
    assert cfg.splits > 1  # the split partials and their sum are exercised
    y = lb.triton_linear(x, w, cfg)
    want = x.double() @ w.double().T
    assert _err(y, want) < 5e-7
    assert _err(y, Linear.reference(x, w, None).double()) < 5e-7


def test_three_bf16_terms_are_exact():
    x, _ = _inputs(64, 1, 512, seed=1)
    assert torch.equal(split_f32_to_bf16(x).double().sum(0), x.double())


@pytest.mark.parametrize("t,n,k", [(64, 512, 5120), (64, 32, 5120), (1, 512, 5120), (256, 512, 5120)])
def test_default_config_splits_k_evenly(t, n, k):
    cfg = lb.default_config(t, n, k)
    lb.check_config(n, k, cfg)
    ctas = -(-n // cfg.block_n) * cfg.splits * -(-t // cfg.block_t)
    assert ctas <= max(132, -(-n // cfg.block_n) * -(-t // cfg.block_t)) and (t > 64 or ctas >= 64)


def test_compiles_for_hopper_with_bf16_wgmma():
    sig = {"x_ptr": "*fp32", "w_ptr": "*bf16", "p_ptr": "*fp32", "T": "i32", "N": "i32", "K": "i32",
           "stride_x": "i32", "ROWS": "i32"}  # fmt: skip
    consts = dict(BN=64, BK=64, BT=64, STEPS=5, STAGES=3, F32_DOTS=False)
    ptx, report = compile_sm90("deepinfer.codegen.kernels.linear_bf16", "_kernel", sig, consts,
                               num_warps=lb.Config().warps)
    assert spill_free(report), report
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx and ".f32.bf16.bf16" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("t,n", [(64, 512), (64, 32), (1, 512)])
def test_cuda_kernel_at_decode_dims(t, n):
    x, w = _inputs(t, n, 5120, seed=n, device="cuda")
    y = lb.triton_linear(x, w)
    want = x.cpu().double() @ w.cpu().double().T
    # fp32 sums of K = 5120 exact products (kernel and reference in different orders): ~sqrt(K) * 2^-24 of the
    # products' magnitude, ~1e-6 of the output's maximum (H200: 1.1e-6); a lost term or split is >= 1e-3
    assert _err(y.cpu(), want) < 1e-5
    assert _err(y.cpu(), Linear.reference(x, w, None).cpu().double()) < 1e-5
