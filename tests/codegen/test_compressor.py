"""compressor family: reference vs the IR ops (pair_compressor + rmsnorm) and a float64 oracle, fp32 numerics
on TileLang's `c` target (ratio 2 with and without a pending row, ratio 1), sm90/sm100 builds, roofline."""

import pytest
import torch

from deepinfer.codegen.kernels import compressor as cp
from deepinfer.ir.ops.core import RMSNorm
from deepinfer.ir.ops.v41 import PairCompressor

D, EPS = 512, 1e-6


def _inputs(T_, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, z = torch.randn(T_, d, generator=g), torch.randn(T_, d, generator=g) * 3
    sa, sz = torch.randn(1, d, generator=g), torch.randn(1, d, generator=g) * 3
    return a, z, sa, sz, torch.rand(d, generator=g) + 0.5


@pytest.mark.parametrize("start", [0, 6, 7])
def test_ratio2_reference_matches_the_ir_ops(start):
    T_ = 9
    a, z, sa, sz, w = _inputs(T_)
    pos = torch.arange(start, start + T_)
    pooled, _, idx, new_a, _ = PairCompressor.reference(a, z, sa, sz, pos)
    done = pooled[idx >= 0]  # the groups completed in this batch
    want = RMSNorm.reference(done.bfloat16(), w, eps=EPS)  # latent = RMSNorm(bf16(c))
    odd = start % 2 == 1
    got = cp.reference(a, z, w, ratio=2, eps=EPS, state_a=sa, state_z=sz, odd=odd)
    assert got.shape == want.shape == (cp.n_groups(T_, 2, odd), D)
    assert ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-2)).max() < 1e-2
    assert torch.equal(new_a[0], a[-1]) == ((start + T_ - 1) % 2 == 0)  # the unfinished row is the new state


def test_ratio1_reference_matches_rmsnorm():
    a, _, _, _, w = _inputs(5)
    assert torch.equal(cp.reference(a, None, w, ratio=1, eps=EPS), RMSNorm.reference(a.bfloat16(), w, eps=EPS))


@pytest.mark.parametrize("ratio,odd", [(2, False), (2, True), (1, False)])
def test_reference_matches_the_float64_oracle(ratio, odd):
    a, z, sa, sz, w = _inputs(11, seed=2)
    got = cp.reference(a, z, w, ratio=ratio, eps=EPS, state_a=sa, state_z=sz, odd=odd, out_dtype=torch.float32)
    want = cp.reference_f64(a, z, w, ratio=ratio, eps=EPS, state_a=sa, state_z=sz, odd=odd)
    assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("ratio,odd,T_", [(2, False, 10), (2, True, 9), (2, True, 8), (1, False, 7)])
def test_c_target(tilelang_required, ratio, odd, T_):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    d = 64
    a, z, sa, sz, w = _inputs(T_, d, seed=3)
    kernel = compile_cpu(cp.program(T_, d, ratio=ratio, eps=EPS, odd=odd, target="cpu", cfg=cp.Config(4, 128)))
    y = torch.full((cp.n_groups(T_, ratio, odd), d), float("nan"))
    kernel(*((a, z, sa, sz, w, y) if ratio == 2 else (a, w, y)))  # G not a multiple of block_g: tail guarded
    want = cp.reference_f64(a, z, w, ratio=ratio, eps=EPS, state_a=sa, state_z=sz, odd=odd)
    assert (y.double() - want).abs().max() < 1e-5


@pytest.fixture(scope="module")
def builds(codegen_cache, nvcc_required):
    from deepinfer.codegen import tilelang_backend as tb

    # V4.1 prefill: 4096 tokens -> 2048 ratio-2 groups of 512 channels
    return {t: tb.build(f"compressor_r2_{t}", cp.program(4096, D, ratio=2, eps=EPS, target=t), t)
            for t in ("sm90", "sm100")}  # fmt: skip


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_builds_for_cuda(builds, target):
    art = builds[target]
    assert art.cubin_path.exists() and art.opcodes["LDG"] > 0 and art.opcodes["STG"] > 0
    assert art.opcodes["LDL"] == 0 and art.opcodes["STL"] == 0, "no local-memory spills"
    assert art.opcodes["MUFU"] > 0, "exp and rsqrt on the special-function units"


def test_roofline_and_config_space():
    b, f = cp.roofline(4096, D, 2)
    assert b == 4 * 4096 * D * 2 + 2048 * D * 2 + 4 * D and f == 2048 * D * 10
    b1, _ = cp.roofline(4096, D, 1)
    assert b1 == 4 * 4096 * D + 4096 * D * 2 + 4 * D
    assert all(c.block_g * D >= 4 * c.threads for c in cp.config_space(2048, D))


def test_ascend950_structure(tilelang_required, codegen_cache):
    """AscendC for Ascend 950 (emitted, not compiled): vector cores only, UB DMA both ways fenced before
    vector compute, SIMT pooling with exp, SIMD row sums, rsqrt."""
    import re

    from deepinfer.codegen import tilelang_backend as tb

    art = tb.build("compressor_r2_ascend", cp.ascend_program(4096, D, eps=EPS), "ascend950")
    src = art.source
    sig = re.search(r'extern "C" __global__ (\S+(?: \S+)?) void (\w+)\(', src)
    assert sig and sig.group(1) == "__vector__" and "ASC_IS_AIC" not in src
    assert "asc_copy_gm2ub_align" in src and "asc_copy_ub2gm_align" in src
    notifies = re.findall(r"asc_sync_notify\((PIPE_\w+), (PIPE_\w+)", src)
    waits = re.findall(r"asc_sync_wait\((PIPE_\w+), (PIPE_\w+)", src)
    assert ("PIPE_MTE2", "PIPE_V") in notifies and sorted(set(notifies)) == sorted(set(waits))
    assert "__simt_vf__" in src and "expf" in src and "rsqrtf" in src
    assert "__simd_vf__" in src and "vcadd" in src
