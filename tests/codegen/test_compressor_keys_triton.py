"""compressor.triton_compressor_keys: pair_compressor_keys / compressor_keys at decode in one Triton launch. The
oracle is the ops' torch references (fp32 both: 1e-5 of the range; the integer and state outputs exactly); CPU:
the interpreter; sm90: the PTX builds without spills; the gpu test at V4.1's dims (d 512, di 128, RoPE 64)."""

import pytest
import torch

from deepinfer.codegen.kernels import compressor, rope
from deepinfer.ir.ops.attention import rope_inv_freq
from deepinfer.ir.registry import get_op
from tests.codegen._triton_aot import compile_sm90, spill_free

ROPE = {"rope_dim": 64, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 65536, "beta_fast": 32.0,
        "beta_slow": 1.0}  # fmt: skip


def _case(op: str, t: int, start: int, d: int, di: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    kv, score = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g) * 3
    norm, wk = (torch.rand(d, generator=g) + 0.5).bfloat16(), (torch.randn(di, d, generator=g) / d**0.5).bfloat16()
    k_norm = (torch.rand(di, generator=g) + 0.5).bfloat16()
    pos = torch.arange(start, start + t)
    args = [kv, pos, norm, wk, k_norm]
    if op == "pair_compressor_keys":
        args = [kv, score, torch.randn(1, d, generator=g), torch.randn(1, d, generator=g), pos, norm, wk, k_norm]
    return [a.to(device) for a in args]


def _run(op: str, args, table):
    kw = {"eps": 1e-6, "rope_dim": ROPE["rope_dim"]}
    if op == "pair_compressor_keys":
        kv, score, skv, ssc, pos, norm, wk, kn = args
        return compressor.triton_compressor_keys(kv, pos, norm, wk, kn, table, score=score, state_kv=skv,
                                                 state_score=ssc, **kw)  # fmt: skip
    kv, pos, norm, wk, kn = args
    return compressor.triton_compressor_keys(kv, pos, norm, wk, kn, table, **kw)


def _check(got, ref, tol):
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        a, b = a.cpu(), b.cpu()
        assert a.shape == b.shape, i
        if i < 2:
            assert (a - b).abs().max() <= tol * b.abs().max().clamp_min(1e-30), (i, float((a - b).abs().max()))
        else:
            assert torch.equal(a, b.to(a.dtype)), i


def _table(device="cpu"):
    return rope.cos_sin_table(8192, rope_inv_freq(*ROPE.values())).to(device)


@pytest.mark.parametrize("op,t,start", [("pair_compressor_keys", 7, 4095), ("pair_compressor_keys", 8, 4096),
                                         ("compressor_keys", 5, 300)])  # fmt: skip
def test_interpreter_matches_the_op(interpret, op, t, start):
    args = _case(op, t, start, 128, 64, seed=t)
    _check(_run(op, args, _table()), get_op(op).run(args, {"eps": 1e-6, **ROPE}), 1e-5)


def test_compiles_for_hopper_without_spills_or_fused_products():
    sig = {n: "*fp32" for n in ("kv_ptr", "sc_ptr", "skv_ptr", "ssc_ptr")}
    sig.update({"pos_ptr": "*i64", "norm_ptr": "*bf16", "wk_ptr": "*bf16", "knorm_ptr": "*bf16", "cs_ptr": "*fp32",
                "entry_ptr": "*fp32", "keys_ptr": "*fp32", "epos_ptr": "*i64", "eidx_ptr": "*i64",
                "nkv_ptr": "*fp32", "nsc_ptr": "*fp32", "T": "i32", "eps": "fp32"})  # fmt: skip
    for pair in (True, False):
        ptx, report = compile_sm90("deepinfer.codegen.kernels.compressor", "_keys_kernel", sig,
                                   dict(D=512, DI=128, R=64, PAIR=pair, OB=16), num_warps=4, enable_fp_fusion=False)
        assert ".target sm_90a" in ptx and "fma.rn.f32" not in ptx and spill_free(report), (pair, report)


@pytest.mark.gpu
@pytest.mark.parametrize("op,start", [("pair_compressor_keys", 4096), ("pair_compressor_keys", 4097),
                                      ("compressor_keys", 4096)])  # fmt: skip
def test_cuda_kernel_at_decode_dims(op, start):
    args = _case(op, 64, start, 512, 128, seed=start, device="cuda")
    _check(_run(op, args, _table("cuda")), get_op(op).run(args, {"eps": 1e-6, **ROPE}), 1e-5)
