"""benchmarks/gpu_e2e.py's weight-independent kernel check (PairedKernels: each kernel against its emulation on
identical operands) and its --formats parsing, on synthetic kernels (CPU, no plan)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_e2e as g  # noqa: E402


def _paired(real, emulated, calls: int = 2) -> g.PairedKernels:
    paired = g.PairedKernels(calls=calls)
    paired.ka = SimpleNamespace(build_kernel=lambda key: real, emulated_kernel=lambda key: emulated)
    return paired


def _key(family="fp8_gemm", program="program"):
    return SimpleNamespace(family=family, program=program)


def _off(paired) -> list[str]:
    return [k for k, v in paired.err.items() if v[1] > g.KERNEL_REL_L2 or v[2] > g.KERNEL_FP8_CODES]


def _gemm(scale: float = 1.0):
    def run(a, out):
        out.copy_((a @ a.T) * scale)

    return run


def test_a_kernel_off_its_emulation_is_flagged_and_one_ulp_is_not():
    a = torch.randn(16, 32)
    ok = _paired(_gemm(1.0 + 2.0**-9), _gemm())  # one bf16 ulp everywhere: what accumulation order can do
    ok(_key())(a, torch.empty(16, 16))
    assert _off(ok) == [] and 0 < ok.err["fp8_gemm.program"][1] < 1e-2
    bad = _paired(_gemm(1.05), _gemm())
    run = bad(_key())
    run(a, torch.empty(16, 16))
    assert _off(bad) == ["fp8_gemm.program"]
    # after `calls` paired calls only the real kernel runs (the record keeps the worst seen)
    run(a, torch.empty(16, 16))
    out = torch.empty(16, 16)
    run(a, out)
    assert torch.allclose(out, (a @ a.T) * 1.05)


def test_fp8_code_flips_are_counted():
    x = torch.randn(64, 32)

    def quant(shift: int):
        def run(src, codes):
            c = src.to(torch.float8_e4m3fn).view(torch.uint8).clone()
            c[:shift] += 1  # one e4m3 step up on the first `shift` rows
            codes.copy_(c.view(torch.float8_e4m3fn))

        return run

    paired = _paired(quant(4), quant(0))
    paired(_key("rmsnorm_quant"))(x, torch.empty(64, 32, dtype=torch.float8_e4m3fn))
    assert paired.err["rmsnorm_quant.program"][2] == pytest.approx(4 / 64)
    assert _off(paired) == ["rmsnorm_quant.program"]


def test_empty_chunk_sentinels_are_not_compared_by_size():
    """A split-K chunk with no valid entry keeps its running max at -1e30 (scaled by the softmax scale in the
    kernel, not in the emulation): both are "empty", not a 30-orders-of-magnitude error."""

    def partial(sentinel: float):
        def run(q, mp):
            mp.copy_(q)
            mp[:, 1] = sentinel

        return run

    q = torch.randn(4, 3)
    paired = _paired(partial(-1e30 * 0.088), partial(-1e30))
    paired(_key("sparse_attn_decode"))(q, torch.empty(4, 3))
    assert _off(paired) == [] and paired.err["sparse_attn_decode.program"][3] == 0
    one_sided = _paired(partial(-1e30), partial(-3.0))
    one_sided(_key("sparse_attn_decode"))(q, torch.empty(4, 3))
    assert one_sided.err["sparse_attn_decode.program"][3] == 4


def test_formats_entries_parse_with_their_weights():
    assert g.parse_formats("deepseek-v4-flash=tiny,deepseek-v4.1-flash=tiny:peaked") == [
        ("deepseek-v4-flash", "tiny", "random"), ("deepseek-v4.1-flash", "tiny", "peaked")]
    for bad in ("deepseek-v4.1-flash=tiny:trained", "deepseek-v4.1-flash"):
        with pytest.raises(SystemExit):
            g.parse_formats(bad)
