"""act_quant (Triton): per-token-group FP8 activation quantisation in one launch, bit for bit the runtime's torch
quant_act (the oracle) -- scales from the float's bits, codes, padding rows. CPU: the Triton interpreter; the
gpu test runs the compiled kernel against the same oracle at the real V4.1 widths."""

import pytest
import torch

from deepinfer.codegen.kernels import act_quant
from deepinfer.runtime.kernel_adapters import quant_act
from tests.codegen._triton_aot import compile_sm90


def _hard_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """Values spread over 60 binades, exact powers of two and 1.75 * 2^p (the exponent rule's boundary) as group
    maxima, zero groups, a row of zeros, and values that round to the e4m3 boundaries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-20, 20, k, base=2.0)
    x[0, :32] = 0.0
    x[1] = 0.0
    x[2, 0], x[2, 32], x[2, 64] = 1.75 * 2.0**3, 2.0**5, -1.75 * 2.0**-7
    x[2, 33], x[2, 65] = 1.75 * 2.0**5 * (1 + 2.0**-23), 2.0**-9 * (1 - 2.0**-24)
    x[3, 96:128] = 448.0 * 2.0 ** torch.arange(32).float().sub(16)
    return x


@pytest.mark.parametrize("m,rows,k", [(5, 5, 256), (4, 16, 160)])
def test_interpreter_matches_quant_act_bit_for_bit(interpret, m, rows, k):
    x = _hard_rows(max(m, 4), k, seed=m)[:m]
    q, s = act_quant.triton_act_quant(x, 32, rows)
    rq, rs = quant_act(x, 32)
    assert torch.equal(s[:, :m], rs.T) and torch.equal(q[:m].to(torch.float8_e4m3fn).float(), rq.float())
    assert (q[m:] == 0).all() and (s[:, m:] == 2.0**-22).all()  # padding rows: zero codes, the floor's scale
    aq, asc = act_quant.reference(x, 32, rows)
    assert torch.equal(aq.float(), q.to(torch.float8_e4m3fn).float()) and torch.equal(asc, s)


@pytest.mark.parametrize("m,rows,chunks", [(5, 8, 4), (8, 8, 2)])
def test_interpreter_chunk_major_layout(interpret, m, rows, chunks):
    """chunks > 1: row j * rows + t holds chunk j of token t, with the one-chunk codes and scales of that chunk
    (padding rows: zero codes, the floor's scale)."""
    x = _hard_rows(max(m, 4), 512, seed=chunks)[:m]
    q, s = act_quant.triton_act_quant(x, 32, rows, chunks=chunks)
    q1, s1 = act_quant.triton_act_quant(x, 32, rows)
    kc = 512 // chunks
    for j in range(chunks):
        assert torch.equal(q[j * rows : j * rows + m], q1[:m, j * kc : (j + 1) * kc])
        assert torch.equal(s[:, j * rows : j * rows + m], s1[j * kc // 32 : (j + 1) * kc // 32, :m])
        assert (q[j * rows + m : (j + 1) * rows] == 0).all() and (s[:, j * rows + m : (j + 1) * rows] == 2.0**-22).all()


def test_interpreter_bf16_input(interpret):
    x = (torch.randn(3, 128) * 5).bfloat16()
    q, s = act_quant.triton_act_quant(x, 32)
    rq, rs = quant_act(x, 32)
    assert torch.equal(s, rs.T) and torch.equal(q.to(torch.float8_e4m3fn).float(), rq.float())


@pytest.mark.gpu
@pytest.mark.parametrize("k", [5120, 4096, 1280, 8192])
def test_cuda_kernel_matches_quant_act(k):
    x = _hard_rows(64, k, seed=k).cuda()
    q, s = act_quant.triton_act_quant(x, 32, 128)
    rq, rs = quant_act(x, 32)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(s[:, :64], rs.T) and torch.equal(q[:64].view(torch.uint8), rq.view(torch.uint8))


def test_compiles_for_hopper_without_approximate_log2():
    """sm_90a PTX: an e4m3 conversion with saturation, and no lg2/ex2 (the scale comes from the bits)."""
    sig = {"x_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32", "K": "i32", "stride_x": "i32",
           "ROWS": "i32", "ROWS_PER": "i32", "CHUNK_OFF": "i32"}  # fmt: skip
    ptx, _ = compile_sm90("deepinfer.codegen.kernels.act_quant", "_kernel", sig, dict(G=160, GROUP=32, BLOCK_G=256),
                          num_warps=4)
    assert ".target sm_90a" in ptx and "e4m3x2" in ptx
    assert "lg2." not in ptx and "ex2." not in ptx


def _dequant_case(shape=(3, 8, 256), seed=0):
    from deepinfer.ir import dtypes as dt

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(-6, 6, shape[-1])
    q = (x * 8).clamp(-448, 448).to(torch.float8_e4m3fn)  # subnormal codes included
    s = 2.0 ** torch.randint(-40, 20, (*shape[:-1], shape[-1] // 128), generator=g).float()
    return q, dt.float_to_e8m0(s)


def test_interpreter_dequant_bit_for_bit(interpret):
    """triton_dequant == dequant_fp8_groups (the op's reference) bit for bit, scales over 60 binades."""
    from deepinfer.ir.ops.quant import dequant_fp8_groups

    q, s = _dequant_case()
    y = act_quant.triton_dequant(q.float(), s, 128)  # the interpreter takes the codes' values
    assert torch.equal(y, dequant_fp8_groups(q, s, 128))


@pytest.mark.gpu
def test_cuda_dequant_bit_for_bit():
    from deepinfer.ir.ops.quant import dequant_fp8_groups

    q, s = _dequant_case((64, 8, 4096), seed=1)
    y = act_quant.triton_dequant(q.cuda(), s.cuda(), 128)
    assert torch.equal(y.cpu(), dequant_fp8_groups(q, s, 128))
