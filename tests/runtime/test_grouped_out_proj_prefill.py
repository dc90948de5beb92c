"""GroupedOutProjAdapter at prefill: wo_a on the contiguous grouped program (group g = expert g with all T rows, the
bucket's tiles past T skipped), the intermediate quantised chunk-major and moved token-major for wo_b's fp8_gemm.
CPU: the plan and keys at V4.1's prefill dims (stand-in tensors, nothing built), the numbers at small shapes with
the emulated kernels and with the persistent program itself on TileLang's `c` target; the oracles are the op's own
fp32 reference and the swap-AB path (the same numbers up to wo_a's fp32 summation order)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.codegen.kernels import fp8_gemm
from deepinfer.codegen.kernels import moe_grouped_gemm as mg
from deepinfer.runtime import kernel_adapters as ka

from .test_kernel_adapters_out_proj import TOL, out_proj_call, reference, rel_err

V41 = {"t": 8192, "g": 8, "k": 4096, "r": 1024, "n": 5120}  # o_groups 8 x 4096 inputs, o_lora_rank 1024, hidden


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)
    monkeypatch.delenv(ka.OUT_PROJ_PREFILL_ENV, raising=False)


def adapter(min_t: int = 0) -> ka.GroupedOutProjAdapter:
    """An adapter taking the contiguous path from max(min_t, 65) tokens (65: above the dense swap-AB range)."""
    a = ka.GroupedOutProjAdapter()
    a.contiguous_min_t = min_t
    return a


def stub_call(t: int, g: int, k: int, r: int, n: int) -> ka.Call:
    """A grouped_out_proj call of these dims on expanded scalars (shapes and dtypes only: no memory)."""

    def like(dtype, *shape):
        return torch.zeros((), dtype=dtype).expand(*shape)

    f8, e8 = torch.float8_e4m3fn, torch.float8_e8m0fnu
    args = [like(torch.float32, t, g, k), like(f8, g * r, k), like(f8, n, g * r), like(e8, g * r // 32, k // 32),
            like(e8, n // 32, g * r // 32)]  # fmt: skip
    attrs = {"block_a": 32, "block_b": 32, "mid_group": 32}
    return ka.Call("grouped_out_proj", attrs, args, ["x", "wa", "wb", "sa", "sb"], [False] + [True] * 4, {}, {})


# ---------------------------------------------------------------------------------------------- plan and keys


@pytest.mark.parametrize("t, rows", [(8192, 8192), (4096, 4096), (5000, 8192)])
def test_v41_prefill_keys(t, rows):
    """The prefill bucket: one persistent grouped launch over G groups of `rows` (T's power-of-two bucket), then
    fp8_gemm's tuned program for wo_b at the same rows (the grouped program, tiles past T skipped, where the bucket
    is mostly padding: SkipTiles)."""
    call = stub_call(t, **{d: v for d, v in V41.items() if d != "t"})
    a = ka.adapter_for("fp8_gemm", "grouped_out_proj")
    assert a.path(call) == "contiguous"
    wo_a, wo_b = a.keys(call)
    cfg = mg.sm90_config(0, 1024, k_group=32)
    assert cfg.persistent and cfg.block_m == 128
    assert wo_a == ka._key("moe_grouped_gemm", "program", (8 * rows, 1024, 4096, 8), cfg, act_group=32,
                           weight_block=32)  # fmt: skip
    if rows == t:
        assert wo_b == ka._key("fp8_gemm", "program", (rows, 5120, 8192), fp8_gemm.sm90_config(rows, 5120, 32),
                               act_group=32, weight_block=32)  # fmt: skip
    else:  # a mostly-padding bucket: wo_b on the grouped program as one expert, its tiles past T skipped
        cfg_b = mg.sm90_config(0, 5120, k_group=32)
        assert wo_b == ka._key("moe_grouped_gemm", "program", (rows, 5120, 8192, 1), cfg_b, act_group=32,
                               weight_block=32)  # fmt: skip


@pytest.mark.parametrize("t", [1, 64, 255])
def test_decode_keeps_the_swap_ab_program(t):
    call = stub_call(t, **{d: v for d, v in V41.items() if d != "t"})
    a = ka.adapter_for("fp8_gemm", "grouped_out_proj")
    assert a.path(call) == "swab"
    assert a.keys(call)[0].program == "swab_program"


def test_the_env_switch_keeps_swap_ab_at_prefill(monkeypatch):
    monkeypatch.setenv(ka.OUT_PROJ_PREFILL_ENV, "swab")
    assert adapter().path(stub_call(**V41)) == "swab"


def test_dense_swab_range_stays_swap_ab():
    """At T <= 64 wo_b is the dense swap-AB program, which quantises u itself: the contiguous path starts above."""
    assert adapter(0).path(stub_call(64, 2, 128, 256, 96)) == "swab"
    assert adapter(0).path(stub_call(65, 2, 128, 256, 96)) == "contiguous"


def test_group_tiles():
    """Group j's tiles are j's up to T, padding (-1) after: T = 260 in 512-row buckets of 128-row tiles."""
    got = ka._group_tiles(ka.Call("x", {}, [], [], [], {}, {}), 3, 260, 512, 128, "cpu")
    want = torch.tensor([0, 0, 0, -1, 1, 1, 1, -1, 2, 2, 2, -1], dtype=torch.int32)
    assert torch.equal(got, want)


def test_token_major_matches_quantising_u():
    """Quantising wo_a's chunk-major output per 32 and moving codes and scales token-major gives quant_rows of the
    token-major u [T, G*R] bit for bit (padding rows: zero codes)."""
    g, rows, t, r = 3, 256, 200, 64
    c = (torch.randn(g * rows, r) * 4).bfloat16()
    q, sq = ka.quant_rows(c, 32, g * rows)
    a, sa = ka._token_major(q, sq, g, rows, t, 256)
    u = c.view(g, rows, r)[:, :t].transpose(0, 1).reshape(t, g * r).float()
    qu, squ = ka.quant_rows(u, 32, 256)
    assert torch.equal(a.view(torch.uint8), qu.view(torch.uint8))
    assert torch.equal(sa[:, :t], squ[:, :t])


# ---------------------------------------------------------------------------------------------- numbers


def junk_padding(builder):
    """builder's kernels, with wo_a's padding tiles overwritten by NaN after the call (the compiled program leaves
    them unwritten: junk that nothing may read)."""

    def build(key):
        kernel = builder(key)
        if key.program != "program" or key.family != "moe_grouped_gemm":
            return kernel
        bm = dict(dict(key.kwargs)["cfg"])["block_m"]

        def run(a, sa, b, sb, tiles, c):
            kernel(a, sa, b, sb, tiles, c)
            c.view(-1, bm, c.shape[1])[tiles.long() < 0] = float("nan")

        return run

    return build


def run_with(a: ka.GroupedOutProjAdapter, call: ka.Call, builder) -> torch.Tensor:
    return a.run(call, [builder(key) for key in a.keys(call)])[0]


@pytest.mark.parametrize("t", [65, 128, 260])  # 260: 3 real tiles and a skipped one per group
def test_emulated_contiguous_matches_reference_and_swab(t):
    call = out_proj_call(t, g=3, k=128, r=256, n=96)
    a = adapter()
    assert a.path(call) == "contiguous"
    got = run_with(a, call, junk_padding(ka.emulated_kernel))
    ref = reference(call)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert rel_err(got, ref) < TOL
    swab_call = out_proj_call(t, g=3, k=128, r=256, n=96)
    swab = run_with(adapter(1 << 30), swab_call, ka.emulated_kernel)
    # the stand-ins compute wo_a alike in both layouts: any difference would be the layouts' (the compiled programs
    # differ in wo_a's fp32 summation order only)
    assert torch.equal(got, swab)


def test_a_wrong_group_mapping_is_caught():
    call = out_proj_call(130, g=2, k=128, r=256)
    ref = reference(call)
    swapped = ka.Call(call.op, call.attrs, [call.args[0].flip(1), *call.args[1:]], call.names, call.is_param, {}, {})
    assert rel_err(run_with(adapter(), swapped, ka.emulated_kernel), ref) > 10 * TOL


def test_portable_config_where_r_does_not_tile_by_256():
    call = out_proj_call(130, g=2, k=128, r=128)
    a = adapter()
    assert a.path(call) == "contiguous"
    assert not dict(dict(a.keys(call)[0].kwargs)["cfg"])["persistent"]
    assert rel_err(run_with(a, call, ka.emulated_kernel), reference(call)) < TOL


def test_on_the_c_target_persistent_program():
    """The persistent grouped program itself (its c-target schedule: tile order, TileExpert lookup, skipped padding
    tiles between the groups' real ones: T = 260 in 512-row buckets) for wo_a; wo_b emulated."""
    call = out_proj_call(260, g=2, k=128, r=256)
    a = adapter()
    keys = a.keys(call)
    assert dict(dict(keys[0].kwargs)["cfg"])["persistent"]
    kernels = [junk_padding(ka.c_target_kernel)(keys[0]), ka.emulated_kernel(keys[1])]
    assert rel_err(a.run(call, kernels)[0], reference(call)) < TOL


_INTERPRETED = r"""
import torch
from deepinfer.codegen.kernels import act_quant
from deepinfer.runtime import kernel_adapters as ka
from test_kernel_adapters_out_proj import out_proj_call

ka.EMULATE = True
calls = []
_quant = act_quant.triton_act_quant
act_quant.triton_act_quant = lambda *a, **k: calls.append(a[0].dtype) or _quant(*a, **k)
adapter = ka.GroupedOutProjAdapter()
adapter.contiguous_min_t = 0
outs = []
for on in (False, True):
    ka.ACT_QUANT_KERNEL_ON_CPU = on
    call = out_proj_call(70, g=2, k=128, r=256, n=96)
    outs.append(adapter.run(call, [ka.emulated_kernel(key) for key in adapter.keys(call)])[0])
assert adapter.path(call) == "contiguous"
assert calls == [torch.float32, torch.bfloat16], calls
assert torch.equal(*outs)
print("OK")
"""


def test_act_quant_kernel_gives_the_torch_numbers():
    """On CUDA the x and intermediate quantisations are act_quant's Triton kernel (the intermediate read as bf16):
    under Triton's interpreter the contiguous path's output equals the torch quantisation's bit for bit."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "DEEPINFER_ADAPTER_INTERPRET": "1",
           "PYTHONPATH": str(Path(__file__).parent)}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [300, 1024])  # 300: 3 real tiles and a skipped one per group (512-row bucket)
def test_gpu_contiguous_matches_reference_and_swab(t):
    """The compiled programs on the H200 (V4.1's G, R, K; a smaller N): the contiguous path against the op's
    reference, and against the swap-AB path (the same numbers up to wo_a's fp32 summation order: a bf16 rounding of
    the intermediate may differ, then one e4m3 step of u)."""
    cpu = out_proj_call(t, g=8, k=4096, r=1024, n=512)
    args = [a.cuda() for a in cpu.args]
    outs = []
    for min_t in (0, 1 << 30):
        call = ka.Call(cpu.op, cpu.attrs, args, cpu.names, cpu.is_param, {}, {})
        a = adapter(min_t)
        outs.append(a.run(call, [ka.build_kernel(key) for key in a.keys(call)])[0])
        assert a.path(call) == ("contiguous" if min_t == 0 else "swab")
    ref = reference(ka.Call(cpu.op, cpu.attrs, args, cpu.names, cpu.is_param, {}, {}))
    assert rel_err(outs[0], ref) < TOL
    assert rel_err(outs[0], outs[1]) < 1e-2
