"""GroupedOutProjAdapter (issue 8): grouped_out_proj's wo_a groups through the swap-AB masked program (a group is an
expert with all T rows) and wo_b through fp8_gemm. CPU: emulated stand-ins (from the programs' docstrings) and,
at small shapes, the real swap-AB program on TileLang's `c` target; the oracle is the op's own fp32 reference."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ir import dtypes as dt
from deepinfer.ir.ops.quant import quant_fp8_groups
from deepinfer.ir.registry import get_op
from deepinfer.passes.select_kernels import bind_grouped_out_proj
from deepinfer.runtime import kernel_adapters as ka

# the intermediate is the kernel's bf16, re-quantised to e4m3 per 32 (the reference quantises its fp32): at most
# one e4m3 step on a few values; a wrong group, row or transpose is O(1)
TOL = 0.05


def _fp8_weight(n: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=gen) / k**0.5
    s = dt.pow2_scale(w.view(n // 32, 32, k // 32, 32).abs().amax(dim=(1, 3)), dt.FP8_MAX)
    q = (w / s.repeat_interleave(32, 0).repeat_interleave(32, 1)).to(torch.float8_e4m3fn)
    return q, dt.float_to_e8m0(s)


def out_proj_call(t: int, g: int = 2, k: int = 128, r: int = 64, n: int = 96, seed: int = 0) -> ka.Call:
    """x as the graph hands it over: the attention's FP8 epilogue dequantised (per 32)."""
    gen = torch.Generator().manual_seed(seed)
    q, s = quant_fp8_groups(torch.randn(t, g, k, generator=gen) * 3, 32)
    x = get_op("dequant_fp8").run([q, s], {"group": 32, "dtype": dt.f32})[0]
    wa, sa = _fp8_weight(g * r, k, gen)
    wb, sb = _fp8_weight(n, g * r, gen)
    attrs = {"block_a": 32, "block_b": 32, "mid_group": 32}
    return ka.Call("grouped_out_proj", attrs, [x, wa, wb, sa, sb], ["x", "wa", "wb", "sa", "sb"],
                   [False, True, True, True, True], {}, {})  # fmt: skip


def run_adapter(call: ka.Call, builder) -> torch.Tensor:
    adapter = ka.adapter_for("fp8_gemm", "grouped_out_proj")
    return adapter.run(call, [builder(key) for key in adapter.keys(call)])[0]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def reference(call: ka.Call) -> torch.Tensor:
    return get_op("grouped_out_proj").run(call.args, call.attrs)[0]


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)


@pytest.mark.parametrize("t", [1, 5, 40, 64])  # 64: no padding rows (the contiguous copy path)
def test_emulated_kernels_match_the_reference(t):
    call = out_proj_call(t, g=4)
    got, ref = run_adapter(call, ka.emulated_kernel), reference(call)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert rel_err(got, ref) < TOL


def test_the_first_gemm_sees_the_reference_operands():
    """Re-quantising the dequantised x per block_a reproduces it exactly (power-of-two scales, same group): the
    grouped GEMM multiplies the reference's own operands."""
    call = out_proj_call(4, g=2)
    x = call.args[0]
    q, s = ka.quant_act(x, 32)
    assert torch.equal((q.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2), x)


def test_a_wrong_group_mapping_is_caught():
    call = out_proj_call(3, g=2)
    ref = reference(call)
    swapped = ka.Call(call.op, call.attrs, [call.args[0].flip(1), *call.args[1:]], call.names, call.is_param, {}, {})
    assert rel_err(run_adapter(swapped, ka.emulated_kernel), ref) > 10 * TOL


def test_bf16_weights_decline():
    call = out_proj_call(2)
    call.args[3] = None
    with pytest.raises(ka.Decline, match="block-scaled FP8"):
        ka.adapter_for("fp8_gemm", "grouped_out_proj").keys(call)


def test_on_the_c_target_program():
    call = out_proj_call(3, g=2, k=128, r=64)
    adapter = ka.adapter_for("fp8_gemm", "grouped_out_proj")
    keys = adapter.keys(call)
    kernels = [ka.c_target_kernel(keys[0]), ka.emulated_kernel(keys[1])]  # the swap-AB program itself; wo_b emulated
    got = adapter.run(call, kernels)[0]
    assert rel_err(got, reference(call)) < TOL


def test_binding_names_the_adapter_family():
    from deepinfer.codegen.targets import get_target
    from deepinfer.ir.builder import GraphBuilder
    from deepinfer.passes.select_kernels import _Ctx

    b = GraphBuilder("t")
    x = b.input("x", "f32", [64, 8, 4096])
    wa, sa = b.param("wa", "f8e4m3", [8192, 4096]), b.param("sa", "e8m0", [256, 128])
    wb, sb = b.param("wb", "f8e4m3", [5120, 8192]), b.param("sb", "e8m0", [160, 256])
    y = b.op("grouped_out_proj", x, wa, wb, sa, sb, block_a=32, block_b=32, mid_group=32)
    fam, prog, shape, cfg, _ = bind_grouped_out_proj(_Ctx(y.producer, {}, get_target("sm90")))
    assert (fam, prog, shape["R"], shape["N"]) == ("fp8_gemm", "grouped_out_proj", 1024, 5120)
    assert ka.adapter_for(fam, "grouped_out_proj") is not None


def _codes_in(call: ka.Call) -> ka.Call:
    """The same call with x as the attention's FP8 codes and scales (fuse_out_proj's codes-in form)."""
    x = call.args[0]
    q, s = quant_fp8_groups(x, 32)
    return ka.Call(call.op, call.attrs, [q, *call.args[1:5], s], [*call.names, "xs"], [*call.is_param, False], {},
                   {})  # fmt: skip


@pytest.mark.parametrize("t", [3, 64, 130])  # 130: the contiguous wo_a path (prefill); 3 / 64: swap-AB
def test_codes_in_equals_the_dequantised_x_bit_for_bit(monkeypatch, t):
    """x's own codes moved to the GEMM's chunk-major layout are the operand quant_rows makes from the dequantised
    x, value for value: the node's output is the same, bit for bit, and the op's reference agrees (the codes-in
    reference dequantises first)."""
    monkeypatch.setattr(ka.GroupedOutProjAdapter, "contiguous_min_t", 0)
    monkeypatch.delenv(ka.OUT_PROJ_PREFILL_ENV, raising=False)
    call = out_proj_call(t, g=3, k=128, r=256)
    fp8 = _codes_in(call)
    assert fp8.args[0].dtype == torch.float8_e4m3fn
    adapter = ka.adapter_for("fp8_gemm", "grouped_out_proj")
    assert adapter.keys(fp8) == adapter.keys(call)
    assert adapter.path(fp8) == ("contiguous" if t > 64 else "swab")
    got, want = run_adapter(fp8, ka.emulated_kernel), run_adapter(call, ka.emulated_kernel)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(reference(fp8), reference(call))


def test_codes_chunk_major_layout():
    t, g, k, rows = 3, 2, 64, 8
    q, s = quant_fp8_groups(torch.randn(t, g, k, generator=torch.Generator().manual_seed(4)) * 5, 32)
    a, sa = ka._codes_chunk_major(q, s, rows)
    want_a, want_sa = ka.quant_rows(get_op("dequant_fp8").run([q, s], {"group": 32, "dtype": dt.f32})[0]
                                    .reshape(t, g * k), 32, rows, chunks=g)  # fmt: skip
    real = torch.cat([torch.arange(j * rows, j * rows + t) for j in range(g)])

    def values(codes, scales):  # the operand's values: codes x their group's scale
        return (codes[real].float().unflatten(-1, (-1, 32)) * scales[:, real].T.unsqueeze(-1)).flatten(-2)

    # the same values; the codes themselves may differ by a power of two where e4m3 rounding brought a group's
    # maximum down to a smaller scale's 448 (re-quantising the dequantised x then picks that smaller scale)
    assert torch.equal(values(a, sa), values(want_a, want_sa))
    assert not a.view(torch.uint8)[rows - 1].any()  # a padding row


def test_codes_chunk_major_kernel_equals_the_torch_copies(monkeypatch):
    """act_quant.triton_codes_chunk_major under Triton's interpreter: the torch layout's bytes and scales exactly
    (padding rows included), ue8m0 byte 0 (2^-127) decoded too."""
    pytest.importorskip("triton")
    t, g, k, rows = 5, 3, 64, 8
    q, s = quant_fp8_groups(torch.randn(t, g, k, generator=torch.Generator().manual_seed(5)) * 3, 32)
    s.view(torch.uint8)[0, 0, 0] = 0
    want_a, want_sa = ka._codes_chunk_major(q, s, rows)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ka, "ACT_QUANT_KERNEL_ON_CPU", True)
    a, sa = ka._codes_chunk_major(q, s, rows)
    assert a.dtype == torch.float8_e4m3fn and a.shape == want_a.shape and sa.shape == want_sa.shape
    assert torch.equal(a.view(torch.uint8), want_a.view(torch.uint8))
    assert torch.equal(sa, want_sa) and sa[0, 0].item() == 2.0**-127


def test_codes_chunk_major_kernel_compiles_for_hopper_spill_free():
    """sm_90a build at V4.1's out-group width (K = 4096 codes, 128 scales a chunk): no spills."""
    from tests.codegen._triton_aot import compile_sm90, spill_free

    sig = {"q_ptr": "*u8", "e_ptr": "*u8", "a_ptr": "*u8", "s_ptr": "*fp32", "M": "i32", "ROWS": "i32",
           "ROWS_PER": "i32", "CHUNKS": "i32"}  # fmt: skip
    _, report = compile_sm90("deepinfer.codegen.kernels.act_quant", "_codes_kernel", sig,
                             dict(KC=4096, G=128, BLOCK_K=4096, BLOCK_G=128), num_warps=4)  # fmt: skip
    assert spill_free(report), report


@pytest.mark.gpu
def test_cuda_codes_chunk_major_at_v41_prefill():
    """On the H200 at V4.1's prefill shape (8192 tokens, 8 out-groups of 4096): the kernel's bytes equal the torch
    copies' (run on the same device tensors with the kernel switched off)."""
    t, g, k, rows = 8192, 8, 4096, 8192
    q, s = quant_fp8_groups(torch.randn(t, g, k, device="cuda") * 3, 32)
    a, sa = ka._codes_chunk_major(q, s, rows)
    cpu_a, cpu_sa = ka._codes_chunk_major(q.cpu(), s.cpu(), rows)
    assert torch.equal(a.view(torch.uint8).cpu(), cpu_a.view(torch.uint8)) and torch.equal(sa.cpu(), cpu_sa)
