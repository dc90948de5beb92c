"""The MoE adapter with V4.1's FP4 experts converted to 128x128 FP8 blocks: the activation group it takes per bucket
(the plan's record: 1x32 at decode; 1x128 at prefill only with the g128 option), the same bits as the 32x32
conversion wherever the numbers are meant to be exact, and the option's deviation. CPU: the kernels' torch stand-ins
(kernel_adapters.emulated_kernel); the oracle is the node's own reference and the 32x32 path."""

from __future__ import annotations

import functools

import pytest
import torch

from deepinfer.ir.registry import get_op
from deepinfer.models.checkpoint import _quant_fp4_rows
from deepinfer.passes.convert_fp4_to_fp8 import fp4_to_fp8_checked
from deepinfer.runtime import kernel_adapters as ka

D, INTER, E, K = 256, 128, 8, 2
EXACT = {"decode": 32, "prefill": 32, "weight_block": 128}
G128 = {"decode": 32, "prefill": 128, "weight_block": 128}


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)


def _fp4_experts(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per expert (w1, w2, w3) as the checkpoint stores them: packed FP4 with ue8m0 per 32 inputs."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(INTER, D), (D, INTER), (INTER, D)]
    return [_quant_fp4_rows(torch.randn(n, k, generator=gen) / k**0.5, 32) for _ in range(E) for n, k in shapes]


@functools.lru_cache(maxsize=4)
def _converted(seed: int, block: int) -> tuple[torch.Tensor, ...]:
    return tuple(t for packed, scale in _fp4_experts(seed) for t in fp4_to_fp8_checked(packed, scale, block))


def moe_call(t: int, block: int, record: dict | None, seed: int = 0) -> ka.Call:
    """A moe_grouped_experts call on the experts converted at `block` (the convert pass's checked conversion), with
    the plan's activation record in the runner's cache (None: no record)."""
    gen = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(t, D, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)])
    weights = torch.rand(t, K, generator=gen)
    args = [x, weights, idx, *([None] * 6), *_converted(seed, block)]
    names = ["x", "w", "idx"] + [f"p{i}" for i in range(len(args) - 3)]
    is_param = [False, False, False] + [a is not None for a in args[3:]]
    attrs = {"n_experts": E, "fmt": "fp8", "swiglu_limit": 10.0, "block": block, "layout": "auto", "masked_max_t": 64,
             "shared_limit": 10.0, "shared_block": 32, "shared_mid_group": 32}  # fmt: skip
    cache = ka.moe_act_cache_entries({"moe_act_groups": record} if record else {})
    return ka.Call("moe_grouped_experts", attrs, args, names, is_param, {}, cache)


def run(call: ka.Call) -> torch.Tensor:
    adapter = ka.MoEGroupedAdapter()
    return adapter.run(call, [ka.emulated_kernel(k) for k in adapter.keys(call)])[0]


def groups(call: ka.Call) -> list[tuple[int, int]]:
    return [(dict(k.kwargs)["act_group"], dict(k.kwargs)["weight_block"]) for k in ka.MoEGroupedAdapter().keys(call)]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_the_activation_group_follows_the_bucket_and_the_record():
    # decode: 1x32 activations on the 32-grid (the 128x128 scales expanded), with or without the option
    assert groups(moe_call(3, 128, EXACT)) == groups(moe_call(3, 128, G128)) == [(32, 32), (32, 32)]
    # prefill: the model's 1x32 on the 128x128 blocks; 1x128 only with the option
    assert groups(moe_call(80, 128, EXACT)) == [(32, 128), (32, 128)]
    assert groups(moe_call(80, 128, G128)) == [(128, 128), (128, 128)]
    assert ka.MoEGroupedAdapter().path(moe_call(80, 128, G128)) == "contiguous[act128]"
    assert ka.MoEGroupedAdapter().path(moe_call(80, 128, EXACT)) == "contiguous"
    # prefill GEMMs on the persistent program (moe_grouped_gemm.sm90_config with k_group = the act group)
    (k1, k2) = ka.MoEGroupedAdapter().keys(moe_call(80, 128, G128))
    assert dict(dict(k1.kwargs)["cfg"])["persistent"] and dict(dict(k2.kwargs)["cfg"])["pingpong"]
    # no record: the weight block at every bucket (natively FP8 experts, V4's format): why runners must pass it
    assert groups(moe_call(3, 128, None))[0] == (128, 128) and groups(moe_call(80, 128, None))[0] == (128, 128)


@pytest.mark.parametrize("t", [3, 80])
def test_128_blocks_with_1x32_activations_give_the_bits_of_32_blocks(t):
    """The same FP4 experts converted at 32 and at 128 (exact conversions): decode (expanded scales) and exact
    prefill compute the same products -- the outputs agree bit for bit."""
    assert torch.equal(run(moe_call(t, 128, EXACT)), run(moe_call(t, 32, None)))


def test_the_g128_option_is_close_to_the_exact_prefill_and_to_the_reference():
    exact, opt = moe_call(80, 128, EXACT), moe_call(80, 128, G128)
    ref = get_op("moe_grouped_experts").run(exact.args, exact.attrs)[0]
    got_exact, got_opt = run(exact), run(opt)
    assert rel(got_exact, ref) < 0.08 and rel(got_opt, ref) < 0.08  # e4m3 activations vs the fp32 reference
    assert not torch.equal(got_opt, got_exact)  # the option changes numbers (this test can see it)
    assert rel(got_opt, got_exact) < 1e-2


def test_an_inexact_block_is_an_error_not_a_rounding():
    from deepinfer.errors import CheckpointError
    from deepinfer.ir import dtypes as dt

    packed, scale = _fp4_experts(0)[0]
    scale = scale.view(torch.uint8).clone()
    scale[:32, 1] -= 16  # one 32x32 block 16 binades below the rest of its 128x128 block: off the grid at 128
    with pytest.raises(CheckpointError, match="w1 .* not exact in 128x128 .* block=32"):
        fp4_to_fp8_checked(packed, scale.view(dt.e8m0.torch_dtype), 128, "w1")
    fp4_to_fp8_checked(packed, scale.view(dt.e8m0.torch_dtype), 32, "w1")  # its own 32x32 block: exact
    scale[0, 2] -= 16  # one row's group alone: inexact in any FP8 block (its 32x32 block holds 31 other rows)
    with pytest.raises(CheckpointError, match="not exact in 32x32 .* keep the FP4 experts"):
        fp4_to_fp8_checked(packed, scale.view(dt.e8m0.torch_dtype), 32, "w1")


@pytest.mark.parametrize("record", [EXACT, G128])
def test_prefill_with_the_triton_launches_in_the_interpreter(interpret, monkeypatch, record):
    """The prefill path as it runs on CUDA: x quantised by act_quant's kernel, the SwiGLU + quant and the
    un-permute as Triton launches (the interpreter), the GEMMs' stand-ins -- against the torch path."""
    call = moe_call(80, 128, record)
    want = run(call)
    monkeypatch.setenv(ka.ADAPTER_INTERPRET_ENV, "1")
    monkeypatch.setattr(ka, "ACT_QUANT_KERNEL_ON_CPU", True)
    got = run(moe_call(80, 128, record))
    assert rel(got, want) < 1e-2  # a SwiGLU code may round one E4M3 step the other way (act_quant.py)


def test_a_runner_can_ask_for_the_prefill_padding():
    call = moe_call(80, 128, G128)
    call.cache[ka.MOE_TILE_STATS] = {}
    ka.MoEGroupedAdapter().keys(call)
    (st,) = call.cache[ka.MOE_TILE_STATS].values()
    assert st["pairs"] == 80 * K and st["tile_rows"] % 128 == 0 and st["pairs"] <= st["tile_rows"] <= st["rows"]
