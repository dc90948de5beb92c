"""linear_fp8 at decode (T <= 64) on moe_grouped_gemm's swap-AB program, K split over 'experts' where N gives too
few CTAs (the dense fp8_gemm tiles M by 128 rows: ~29% of HBM at 64 x 32768 x 1280 on the H200). Oracle: the op's
reference (fake-quantised x times the dequantised weight); the real swap-AB program built for the c target, the
emulated one, and the fallbacks (T > 64, DEEPINFER_DENSE_SWAB=0, batch-invariant mode) on fp8_gemm."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ir.dtypes import float_to_e8m0
from deepinfer.ir.registry import get_op
from deepinfer.runtime import kernel_adapters as ka


def linear_call(t: int, n: int = 128, k: int = 256, seed: int = 0, act_group: int = 32) -> ka.Call:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    w = (torch.randn(n, k, generator=g) * 0.5).to(torch.float8_e4m3fn)
    s = float_to_e8m0(2.0 ** torch.randint(-8, -4, (n // 32, k // 32), generator=g).float())
    return ka.Call("linear_fp8", {"block": 32, "act_group": act_group}, [x, w, s], ["x", "w", "s"],
                   [False, True, True], {}, {})  # fmt: skip


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)
    monkeypatch.delenv(ka.DENSE_SWAB_ENV, raising=False)
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)


@pytest.mark.parametrize("t,n,k,kernels", [(5, 128, 256, "emulated"), (64, 128, 512, "emulated"),
                                           (16, 16384, 256, "emulated"), (3, 128, 256, "c_target")])  # fmt: skip
def test_decode_rows_take_the_swab_program(t, n, k, kernels):
    call = linear_call(t, n, k, seed=t)
    adapter = ka.adapter_for("fp8_gemm", "linear_fp8")
    keys = adapter.keys(call)
    splits = ka.dense_swab_splits(n, k)
    assert [kk.program for kk in keys] == ["swab_program"] and keys[0].args[-1] == splits  # K chunks as experts
    assert (splits > 1) == (n < 16384)  # padded (T 5) and unpadded (T 64) token tiles both split K here
    make = ka.emulated_kernel if kernels == "emulated" else ka.c_target_kernel
    got = adapter.run(call, [make(k) for k in keys])[0]
    ref = get_op("linear_fp8").run(call.args, call.attrs)[0]
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert _rel(got, ref) < 1e-2  # bf16 output of exact fp8 products


def test_more_rows_and_the_switch_keep_fp8_gemm(monkeypatch):
    adapter = ka.adapter_for("fp8_gemm", "linear_fp8")
    assert [k.program for k in adapter.keys(linear_call(65))] == ["program"]
    monkeypatch.setenv(ka.DENSE_SWAB_ENV, "0")
    assert [k.program for k in adapter.keys(linear_call(5))] == ["program"]
    monkeypatch.delenv(ka.DENSE_SWAB_ENV)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert [k.program for k in adapter.keys(linear_call(5))] == ["program"]


def test_splits_fill_the_gpu_at_small_n():
    assert ka.dense_swab_splits(512, 5120) == 10 and ka.dense_swab_splits(32768, 1280) == 1
    for n, k in ((512, 5120), (1280, 5120), (4096, 1280), (5120, 8192)):
        s = ka.dense_swab_splits(n, k)
        assert (k // 128) % s == 0 and n // 64 * s <= ka.DENSE_SWAB_CTAS and s <= ka.DENSE_SWAB_MAX_SPLITS
