"""linear_fp8 at prefill with a mostly-padding row bucket (M just above a power of two) on the MoE's persistent
grouped program as one expert, the bucket's tiles past M skipped (SkipTiles). Oracle: the op's reference, and the
fp8_gemm path over the whole bucket (DEEPINFER_DENSE_SKIP_TILES=0) on the same emulated kernels."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ir.registry import get_op
from deepinfer.runtime import kernel_adapters as ka
from tests.runtime.test_kernel_adapters_dense_swab import linear_call


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)
    monkeypatch.delenv(ka.SKIP_TILES_ENV, raising=False)
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)


def _families(call):
    return [(k.family, k.program) for k in ka.adapter_for("fp8_gemm", "linear_fp8").keys(call)]


def _run(call):
    adapter = ka.adapter_for("fp8_gemm", "linear_fp8")
    return adapter.run(call, [ka.emulated_kernel(k) for k in adapter.keys(call)])[0]


def test_a_mostly_padding_bucket_takes_the_grouped_program_and_skips_its_tiles():
    call = linear_call(300, n=256, k=256, seed=1)  # bucket 512 rows: 212 padding, tiles 3 used + 1 skipped
    assert _families(call) == [("moe_grouped_gemm", "program")]
    key, rows, plan = ka.adapter_for("fp8_gemm", "linear_fp8")._plan(call)[0]
    assert rows == 512 and key.args == (512, 256, 256, 1) and plan == ka.SkipTiles(256, 128)
    stub = ka.Call("x", {}, [], [], [], {}, {})
    assert ka._group_tiles(stub, 1, 300, 512, 128, "cpu").tolist() == [0, 0, 0, -1]
    assert ka._group_tiles(stub, 1, 256, 512, 128, "cpu").tolist() == [0, 0, -1, -1]


def test_same_numbers_as_fp8_gemm_over_the_whole_bucket(monkeypatch):
    call = linear_call(300, n=256, k=256, seed=2)
    got = _run(call)
    ref = get_op("linear_fp8").run(call.args, call.attrs)[0]
    monkeypatch.setenv(ka.SKIP_TILES_ENV, "0")
    call_off = linear_call(300, n=256, k=256, seed=2)
    assert _families(call_off) == [("fp8_gemm", "program")]
    off = _run(call_off)
    assert got.shape == ref.shape == off.shape == (300, 256) and got.dtype == ref.dtype
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-2  # bf16 output of exact fp8 products
    assert torch.equal(got, off)  # the same emulated products and rounding: only the skipped rows differ


@pytest.mark.parametrize("t,n,why", [(256, 256, "a full bucket"), (480, 256, "under 1/8 padding"),
                                     (300, 128, "N not a multiple of 256")])  # fmt: skip
def test_other_shapes_keep_fp8_gemm(t, n, why):
    assert _families(linear_call(t, n=n, k=256)) == [("fp8_gemm", "program")], why


def test_batch_invariant_mode_keeps_fp8_gemm(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert _families(linear_call(300, n=256, k=256)) == [("fp8_gemm", "program")]


@pytest.mark.gpu
def test_on_the_h200(monkeypatch):
    """A prefill chunk of 5000 tokens (bucket 8192: 39% padding) at K = V4.1's q_lora_rank 1280, N 4096, on both
    forms: each within bf16 rounding of the reference and of each other."""
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA device")
    from deepinfer.runtime.cuda_executor import KernelCache

    cache = KernelCache()
    adapter = ka.adapter_for("fp8_gemm", "linear_fp8")
    outs = {}
    for env, family in (("1", "moe_grouped_gemm"), ("0", "fp8_gemm")):
        monkeypatch.setenv(ka.SKIP_TILES_ENV, env)
        call = linear_call(5000, n=4096, k=1280, seed=5)
        cpu_args = list(call.args)
        call.args = [a.cuda() for a in call.args]
        keys = adapter.keys(call)
        assert keys[0].family == family
        outs[env] = adapter.run(call, [cache.get(k) for k in keys])[0].cpu()
    ref = get_op("linear_fp8").run(cpu_args, call.attrs)[0]
    for env, y in outs.items():
        assert float((y - ref).abs().max() / ref.abs().max()) < 2e-2, env
    assert float((outs["1"] - outs["0"]).abs().max() / outs["0"].abs().max()) < 1e-2
