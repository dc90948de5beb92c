"""linear's exact CUDA path for f32 activations x bf16 weights (three bf16 terms, fp32 accumulation) against the
fp32 reference it replaces (F.linear on fp32 copies)."""

import pytest
import torch
import torch.nn.functional as F

from deepinfer.ir.ops import core


def _fp32_mm(a, b):
    # what torch.mm(bf16, bf16, out_dtype=fp32) computes: exact bf16 products, fp32 sums
    return a.float() @ b.float()


def test_split_terms_sum_back_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 257, generator=g) * torch.logspace(-30, 30, 257)
    terms = core.split_f32_to_bf16(x)
    assert terms.dtype == torch.bfloat16 and terms.shape == (3, *x.shape)
    back = terms[0].float() + (terms[1].float() + terms[2].float())
    assert torch.equal(back, x)


@pytest.mark.parametrize("rows,stacked", [(5, True), (7, False)])
def test_split_linear_matches_fp32_reference(monkeypatch, rows, stacked):
    if not stacked:  # the per-term branch (large outputs): force it
        monkeypatch.setattr(core, "STACKED_OUT_BYTES", 0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, rows, 320, generator=g)
    w = torch.randn(96, 320, generator=g).bfloat16()
    b = torch.randn(96, generator=g)
    y = core.linear_f32_bf16(x, w, b, mm=_fp32_mm)
    ref = F.linear(x, w.float(), b)
    assert y.shape == ref.shape and y.dtype == torch.float32
    # summation order only: a few fp32 ulps of the sum of |products|
    bound = 8 * torch.finfo(torch.float32).eps * (x.abs() @ w.float().abs().T)
    assert ((y - ref).abs() <= bound).all()
    # a single bf16 term (what a plain bf16 cast of x would give) is far outside that bound
    coarse = F.linear(x.bfloat16().float(), w.float(), b)
    assert not ((coarse - ref).abs() <= bound).all()


@pytest.mark.gpu
def test_split_linear_cuda_matches_fp32_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 5120, generator=g).cuda()
    w = (torch.randn(4096, 5120, generator=g) * 0.02).bfloat16().cuda()
    y = core.Linear.reference(x, w, None)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # the old reference: full fp32 (no TF32)
    try:
        ref = F.linear(x, w.float())
    finally:
        torch.set_float32_matmul_precision(before)
    bound = 16 * torch.finfo(torch.float32).eps * (x.abs() @ w.float().abs().T)
    assert ((y - ref).abs() <= bound).all(), float(((y - ref).abs() / bound).max())
