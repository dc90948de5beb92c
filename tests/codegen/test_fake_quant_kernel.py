"""fake_quant_fp8 as one Triton launch (act_quant.triton_fake_quant; the runtime's FakeQuantAdapter where Triton runs)
against the op's torch formula (ir/ops/quant.py fake_quant_fp8) bit for bit: every e4m3 code's value and the exact
midpoints between neighbouring codes (ties: to even), values just off the midpoints, the subnormal codes' grid, the
clamp, zero groups, groups spanning many binades. CPU: the interpreter; sm_90a build; gpu: the prefill MoE input's
shape."""

from __future__ import annotations

import pytest
import torch

from deepinfer.codegen.kernels import act_quant
from deepinfer.ir.ops.quant import fake_quant_fp8
from deepinfer.runtime import kernel_adapters as ka


def _e4m3_values() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending (0, the 7 subnormals, the normals up to 448)."""
    v = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(v[torch.isfinite(v) & (v >= 0)])


def _rounding_cases(group: int) -> torch.Tensor:
    """Rows of `group` values whose group scale is 1 (each group leads with 448): the codes, the midpoints between
    neighbours, one fp32 ulp either side of them, both signs; the tail padded with zeros."""
    c = _e4m3_values()
    mid = (c[1:] + c[:-1]) / 2
    vals = torch.cat([c, mid, torch.nextafter(mid, torch.zeros(1)), torch.nextafter(mid, torch.full((1,), 1e9)),
                      torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 500.0, 1e9])])  # fmt: skip
    vals = torch.cat([vals, -vals])
    per = group - 1
    rows = -(-vals.numel() // per // 4) * 4  # whole rows of 4 groups
    body = torch.zeros(rows * per)
    body[: vals.numel()] = vals
    return torch.cat([torch.full((rows, 1), 448.0), body.view(rows, per)], 1).reshape(-1, 4 * group)


def _wide(t: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g) * torch.logspace(-40, 40, d, base=2.0)
    x[0] = 0.0  # a zero row: the floor's scale
    x[1, :64] = 0.0  # zero groups
    return x


@pytest.mark.parametrize("group", [32, 128])
def test_fake_quant_kernel_rounds_as_the_cast(interpret, group):
    cases = _rounding_cases(group)
    for x in (cases, _wide(5, 1024, group)):
        y = act_quant.triton_fake_quant(x, group)
        want = fake_quant_fp8(x, group)
        assert y.dtype == torch.float32 and torch.equal(y, want), (y != want).nonzero()[:5]


def test_the_rounding_cases_are_not_vacuous():
    """The midpoints do round both ways (ties to even) and the +-ulp neighbours go to different codes."""
    c = _e4m3_values()
    mid = (c[1:] + c[:-1]) / 2
    up = mid.to(torch.float8_e4m3fn).float() == c[1:]
    assert up.any() and (~up).any()
    assert torch.equal(torch.nextafter(mid, torch.full((1,), 1e9)).to(torch.float8_e4m3fn).float(), c[1:])


def test_the_adapter_takes_the_kernel_and_keeps_the_numbers(interpret, monkeypatch):
    """FakeQuantAdapter where act_quant's kernels run (CUDA; here the interpreter, as quant_rows' tests turn it on):
    one triton_fake_quant launch, the op's numbers."""
    monkeypatch.setattr(ka, "ACT_QUANT_KERNEL_ON_CPU", True)
    monkeypatch.setattr(ka, "EMULATE", True)
    launches = []
    kernel = act_quant.triton_fake_quant
    monkeypatch.setattr(act_quant, "triton_fake_quant", lambda *a: launches.append(a) or kernel(*a))
    x = _wide(6, 512, 3).view(2, 3, 512)
    call = ka.Call("fake_quant_fp8", {"group": 32}, [x], ["x"], [False], {})
    adapter = ka.FakeQuantAdapter()
    assert adapter.keys(call) == []
    (y,) = adapter.run(call, [])
    assert len(launches) == 1 and y.shape == x.shape and torch.equal(y, fake_quant_fp8(x, 32))


def test_fake_quant_kernel_compiles_for_hopper_spill_free():
    """sm_90a build at V4.1's D = 5120 per 32: no spills, no fp8 conversion (the rounding is arithmetic), and the
    1.5 * 2^23 add/subtract pair kept, not folded away."""
    from tests.codegen._triton_aot import compile_sm90, spill_free

    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "K": "i32", "stride_x": "i32"}
    ptx, report = compile_sm90("deepinfer.codegen.kernels.act_quant", "_fake_quant_kernel", sig,
                               dict(G=160, GROUP=32, BLOCK_G=256), num_warps=4)  # fmt: skip
    assert spill_free(report), report
    assert "e4m3" not in ptx
    assert "0f4B400000" in ptx and "0fCB400000" in ptx, "+ 1.5 * 2^23 (fma with the exact product), - 1.5 * 2^23"


@pytest.mark.gpu
def test_cuda_fake_quant_at_the_prefill_moe_input():
    x = _wide(8192, 5120, 9).cuda()
    for group in (32, 128):
        assert torch.equal(act_quant.triton_fake_quant(x, group), fake_quant_fp8(x, group))
    cases = _rounding_cases(32).cuda()
    assert torch.equal(act_quant.triton_fake_quant(cases, 32), fake_quant_fp8(cases, 32))
