"""rmsnorm_quant and rope with io="float32": the graph's fp32 activations read and written as they are (no cast
launch on either side of the kernel) with the bf16 kernel's numbers. sm90: the programs lower and compile, and the
loads round to bf16 (cvt.rn.bf16.f32 in the source); the gpu tests compare them bit for bit with the bf16 programs
on the bf16-rounded input (the previous adapter path: x.to(bf16) -> kernel -> .to(float32))."""

import pytest
import torch

from deepinfer.codegen.kernels import rmsnorm_quant, rope
from deepinfer.ir.ops.attention import rope_inv_freq

ROPE = {"rope_dim": 64, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 65536, "beta_fast": 32.0,
        "beta_slow": 1.0}  # fmt: skip


def test_sm90_f32_io_programs_build_and_round_on_load(codegen_cache, nvcc_required):
    from deepinfer.codegen import tilelang_backend as tb

    progs = {
        "rmsnorm_f32io": rmsnorm_quant.program(64, 5120, group=32, quant=False, eps=1e-6, target="sm90",
                                               cfg=rmsnorm_quant.Config(1, 256), io="float32"),
        "rmsnorm_quant_f32io": rmsnorm_quant.program(64, 1280, group=32, quant=True, eps=1e-6, target="sm90",
                                                     cfg=rmsnorm_quant.Config(1, 128), io="float32"),
        "rope_f32io": rope.program(64, 32, 128, 8192, rope_dim=64, inverse=False, target="sm90", io="float32"),
    }  # fmt: skip
    for name, prog in progs.items():
        art = tb.build(name, prog, "sm90")
        assert art.cubin_path is not None and "float* __restrict__ X" in art.source.replace("const ", ""), name
        assert "((bfloat16_t)" in art.source or "__float2bfloat16" in art.source, name  # the load rounds


def _bf16_path(kernel_bf16, x, *rest_in, out_like):
    """The previous adapter path: x.to(bf16) -> the bf16 program -> widened to fp32."""
    y = torch.empty_like(out_like, dtype=torch.bfloat16)
    kernel_bf16(x.bfloat16(), *rest_in, y)
    return y.float()


@pytest.mark.gpu
def test_cuda_rmsnorm_and_rope_f32_io_equal_the_bf16_programs():
    import tilelang

    tgt = {"kind": "cuda", "arch": "sm_90a"}
    x = torch.randn(64, 5120, device="cuda") * 3
    w = torch.rand(5120, device="cuda") + 0.5
    cfg = rmsnorm_quant.Config(1, 256)
    mk = lambda io: tilelang.compile(rmsnorm_quant.program(64, 5120, group=32, quant=False, eps=1e-6, target="sm90",  # noqa: E731
                                                           cfg=cfg, io=io), target=tgt, execution_backend="tvm_ffi")
    y = torch.empty_like(x)
    mk("float32")(x, w, y)
    assert torch.equal(y, _bf16_path(mk(""), x, w, out_like=x))
    table = rope.cos_sin_table(8192, rope_inv_freq(*ROPE.values())).cuda()
    q = torch.randn(64, 32, 128, device="cuda")
    pos = torch.arange(4096, 4160, device="cuda", dtype=torch.int32)
    mr = lambda io: tilelang.compile(rope.program(64, 32, 128, 8192, rope_dim=64, inverse=False, target="sm90",  # noqa: E731
                                                  io=io), target=tgt, execution_backend="tvm_ffi")
    out = torch.empty_like(q)
    mr("float32")(q, pos, table, out)
    assert torch.equal(out, _bf16_path(mr(""), q, pos, table, out_like=q))
