"""rmsnorm_quant, rope and the mHC kernels with io="float32": the graph's fp32 activations read and written as they
are (no cast launch on either side of the kernel) with the bf16 kernels' numbers (the split hc_pre partial's
reductions up to their order). sm90: the programs lower and compile, and the
loads round to bf16 (cvt.rn.bf16.f32 in the source); the gpu tests compare them bit for bit with the bf16 programs
on the bf16-rounded input (the previous adapter path: x.to(bf16) -> kernel -> .to(float32))."""

import pytest
import torch

from deepinfer.codegen.kernels import hyper_connection as hc
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
        "hc_post_f32io": hc.post_program(64, 5120, target="sm90", io="float32"),
        "hc_pre_partial_f32io": hc.pre_partial_program(64, 5120, eps=1e-20, hc_eps=1e-6, iters=20, target="sm90",
                                                       splits=40, io="float32"),
    }  # fmt: skip
    for name, prog in progs.items():
        art = tb.build(name, prog, "sm90")
        assert art.cubin_path is not None and "float* __restrict__ X" in art.source.replace("const ", ""), name
        rounds = ("((bfloat16_t)", "__float2bfloat16", "__float22bfloat162_rn")  # scalar or vectorised RN casts
        assert any(r in art.source for r in rounds), name  # the load rounds to bf16


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


@pytest.mark.gpu
def test_cuda_hc_f32_io_equals_the_bf16_programs():
    """post_program and the split partial's collapse with io="float32" == the bf16 programs on bf16-rounded streams,
    bit for bit (element-wise math); the partial mixes and sums of squares to 1e-6 (reductions whose order follows
    the fragment layout TileLang infers, which may differ between an fp32 and a bf16 shared tile: the H200 run of
    an all-bitwise version of this test failed; a wrong operand or layout is O(1))."""
    import tilelang

    tgt = {"kind": "cuda", "arch": "sm_90a"}
    comp = lambda f: tilelang.compile(f, target=tgt, execution_backend="tvm_ffi")  # noqa: E731
    T_, D, S = 64, 5120, 40
    x, y = torch.randn(T_, 4, D, device="cuda"), torch.randn(T_, D, device="cuda")
    post, comb = torch.rand(T_, 4, device="cuda") * 2, torch.rand(T_, 16, device="cuda") / 4
    out = torch.empty_like(x)
    comp(hc.post_program(T_, D, target="sm90", io="float32"))(x, y, post, comb, out)
    out_b = torch.empty_like(x, dtype=torch.bfloat16)
    comp(hc.post_program(T_, D, target="sm90"))(x.bfloat16(), y.bfloat16(), post, comb, out_b)
    assert torch.equal(out, out_b.float())
    fn_p = hc.pad_fn(torch.randn(24, 4 * D, device="cuda") * 0.01)
    prev = torch.rand(T_, 4, device="cuda")
    kw = {"eps": 1e-20, "hc_eps": 1e-6, "iters": 20, "target": "sm90", "splits": S}
    res = []
    for io, xin, ydt in (("float32", out, torch.float32), ("", out_b, torch.bfloat16)):
        yc = torch.empty(T_, D, device="cuda", dtype=ydt)
        pm, psq = torch.empty(S, T_, 32, device="cuda"), torch.empty(S, T_, device="cuda")
        comp(hc.pre_partial_program(T_, D, io=io, **kw))(xin.view(T_, -1), fn_p, prev, yc, pm, psq)
        res.append((yc.float(), pm, psq))
    (y32, pm32, sq32), (y16, pm16, sq16) = res
    assert torch.equal(y32, y16), float((y32 - y16).abs().max())
    for a, b in ((pm32, pm16), (sq32, sq16)):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 1e-6, err
