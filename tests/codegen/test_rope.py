"""RoPE family: reference vs the model op, fp32 numerics on TileLang's `c` target, and sm90/sm100 builds."""

import pytest
import torch

from deepinfer.codegen.kernels import rope
from deepinfer.ir.ops.attention import apply_rope, rope_inv_freq

# V4.1-Flash-like attrs: rope on the last 64 of 512 channels, YaRN on
ATTRS = dict(rope_dim=64, theta=10000.0, yarn_factor=16.0, yarn_orig_len=65536, beta_fast=32.0, beta_slow=1.0)


@pytest.mark.parametrize("inverse", [False, True])
def test_reference_matches_the_model_op(inverse):
    torch.manual_seed(0)
    x = torch.randn(12, 4, 128)
    pos = torch.randint(0, 1 << 20, (12,))
    table = rope.cos_sin_table(int(pos.max()) + 1, rope_inv_freq(**ATTRS))
    got = rope.reference(x, pos, table, 64, inverse)
    want = apply_rope(x, pos, inverse=inverse, **ATTRS)
    assert torch.equal(got[..., :64], x[..., :64])
    assert (got - want).abs().max() < 1e-5


def test_inverse_undoes_the_rotation():
    x = torch.randn(5, 2, 64)
    pos = torch.arange(5) * 1000
    table = rope.cos_sin_table(5000, rope_inv_freq(64, 10000.0))
    back = rope.reference(rope.reference(x, pos, table, 64), pos, table, 64, inverse=True)
    assert (back - x).abs().max() < 1e-5


@pytest.mark.parametrize("inverse", [False, True])
def test_c_target(tilelang_required, inverse):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    T_, H, D, r, P = 7, 3, 96, 64, 300  # T not a multiple of block_t: the tail block is guarded
    torch.manual_seed(1)
    x, pos = torch.randn(T_, H, D), torch.randint(0, P, (T_,), dtype=torch.int32)
    table = rope.cos_sin_table(P, rope_inv_freq(r, 10000.0))
    kernel = compile_cpu(rope.program(T_, H, D, P, rope_dim=r, inverse=inverse, target="cpu", cfg=rope.Config(2, 128)))
    y = torch.full((T_, H, D), float("nan"))
    kernel(x, pos, table, y)
    assert (y - rope.reference(x, pos, table, r, inverse)).abs().max() < 1e-6


def test_symbolic_rows_one_build_two_token_counts(tilelang_required):
    """T_=None: ONE c-target build runs 5 and 2 tokens (block_t 4: a partial tail block each time, whose rows past T
    are not written)."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    H, D, r, P = 2, 96, 64, 300
    table = rope.cos_sin_table(P, rope_inv_freq(r, 10000.0))
    kernel = compile_cpu(rope.program(None, H, D, P, rope_dim=r, inverse=False, target="cpu", cfg=rope.Config(4, 128)))
    torch.manual_seed(2)
    for t in (5, 2):
        x, pos = torch.randn(t, H, D), torch.randint(0, P, (t,), dtype=torch.int32)
        y = torch.full((t + 4, H, D), float("nan"))  # a write past row t shows in the spare rows
        kernel(x, pos, table, y[:t])
        assert (y[:t] - rope.reference(x, pos, table, r)).abs().max() < 1e-6, t
        assert y[t:].isnan().all(), "rows past T written"


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_builds_for_cuda(codegen_cache, nvcc_required, target):
    from deepinfer.codegen import tilelang_backend as tb

    # V4.1 decode/prefill query: any token count (symbolic, as the runtime builds it) x 64 heads x 512, rope on the
    # last 64, 1M-position table
    art = tb.build(f"rope_{target}", rope.program(None, 64, 512, 1 << 20, rope_dim=64, inverse=False, target=target),
                   target)  # fmt: skip
    assert art.opcodes["EXIT"] >= 1 and art.opcodes["LDG"] > 0 and art.opcodes["STG"] > 0
    assert art.opcodes["STL"] == 0 and art.opcodes["LDL"] == 0, "no local-memory spills"
    assert art.opcodes["MUFU"] == 0, "cos/sin come from the table, not from special-function units"


def test_roofline_and_config_space():
    b, f = rope.roofline(4096, 64, 512, 64)
    assert b == 2 * 4096 * 64 * 512 * 2 + 4096 * (4 + 256) and f == 6 * 4096 * 64 * 32
    assert all(c.block_t * 64 * 32 >= c.threads for c in rope.config_space(4096, 64))
