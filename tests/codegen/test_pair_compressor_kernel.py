"""pair_compressor.triton_batched_pair_keys: batched_pair_compressor_keys (B sequences, one token each, each its own
pending row and position) in one Triton launch. Oracle: the op's torch reference (ir/ops/batched.py), fp32 both:
entry / keys within 1e-5 of the row range, entry_idx and the new states exactly. CPU: the interpreter at small
shapes; sm90: the PTX builds without spills or fused products; the adapter through the executor's Call; the gpu
test at V4.1's dims (d 512, di 128, RoPE 64), B 64."""

import pytest
import torch

from deepinfer.codegen.kernels import pair_compressor, rope
from deepinfer.ir.ops.attention import rope_inv_freq
from deepinfer.ir.registry import get_op
from tests.codegen._triton_aot import compile_sm90, spill_free

OP = "batched_pair_compressor_keys"
ROPE = {"rope_dim": 16, "theta": 160000.0, "yarn_factor": 16.0, "yarn_orig_len": 65536, "beta_fast": 32.0,
        "beta_slow": 1.0}  # fmt: skip
EPS = 1e-6


def _case(positions, d: int, di: int, seed: int, device="cpu"):
    """kv, score, state_kv, state_score [B, d], positions [B], norm, wk, k_norm (bf16, as the checkpoint's)."""
    g = torch.Generator().manual_seed(seed)
    b = len(positions)
    kv, score = torch.randn(b, d, generator=g), torch.randn(b, d, generator=g) * 3
    skv, ssc = torch.randn(b, d, generator=g), torch.randn(b, d, generator=g) * 3
    norm, wk = (torch.rand(d, generator=g) + 0.5).bfloat16(), (torch.randn(di, d, generator=g) / d**0.5).bfloat16()
    k_norm = (torch.rand(di, generator=g) + 0.5).bfloat16()
    args = [kv, score, skv, ssc, torch.tensor(positions, dtype=torch.long), norm, wk, k_norm]
    return [a.to(device) for a in args]


def _table(rope_attrs, device="cpu"):
    freq = rope_inv_freq(*(rope_attrs[k] for k in ("rope_dim", "theta", "yarn_factor", "yarn_orig_len",
                                                   "beta_fast", "beta_slow")))  # fmt: skip
    return rope.cos_sin_table(8192, freq).to(device)


def _kernel(args, rope_attrs, cfg=None):
    return pair_compressor.triton_batched_pair_keys(*args, _table(rope_attrs, args[0].device), eps=EPS,
                                                    rope_dim=rope_attrs["rope_dim"], cfg=cfg)  # fmt: skip


def _check(got, ref, tol=1e-5):
    assert len(got) == len(ref) == 5
    for i, (a, b) in enumerate(zip(got, ref)):
        a, b = a.cpu(), b.cpu()
        assert a.shape == b.shape and a.dtype == b.dtype, (i, a.shape, b.shape, a.dtype, b.dtype)
        if i < 2:  # entry, keys
            err = (a - b).abs().max()
            assert err <= tol * b.abs().max().clamp_min(1e-30), (i, float(err))
        else:  # entry_idx, the new pending rows: selections, exact
            assert torch.equal(a, b), i


# odd positions close a pair (entry p // 2 at RoPE position p - 1), even ones leave the token pending; 0 and
# 1 (the first pair), and positions near the 4k context of the benchmark
POSITIONS = [4095, 4096, 1, 0, 77, 300, 4097, 6]


def test_interpreter_matches_the_op(interpret):
    args = _case(POSITIONS, 64, 32, seed=1)
    _check(_kernel(args, ROPE), get_op(OP).run(args, {"eps": EPS, **ROPE}))


def test_interpreter_wide_out_block_and_no_closing_row(interpret):
    """out_block = di (one step of the keys product) and a batch where no sequence closes a pair (all zero rows:
    the norm of 0 must stay 0, not NaN)."""
    args = _case([2, 4, 8], 32, 16, seed=2)
    got = _kernel(args, ROPE, pair_compressor.Config(out_block=16, warps=2))
    _check(got, get_op(OP).run(args, {"eps": EPS, **ROPE}))
    assert not got[0].abs().any() and (got[2] == -1).all()


def _one_sequence_kernel(args, rope_attrs):
    """Each sequence through the one-sequence op's kernel (compressor.triton_compressor_keys at T = 1)."""
    from deepinfer.codegen.kernels import compressor

    kv, score, skv, ssc, pos, norm, wk, k_norm = args
    table = _table(rope_attrs, kv.device)
    outs = [compressor.triton_compressor_keys(kv[b : b + 1], pos[b : b + 1], norm, wk, k_norm, table, eps=EPS,
                                              rope_dim=rope_attrs["rope_dim"], score=score[b : b + 1],
                                              state_kv=skv[b : b + 1], state_score=ssc[b : b + 1])
            for b in range(kv.shape[0])]  # fmt: skip
    return [torch.cat(parts) for parts in zip(*outs)]


def test_interpreter_equals_the_one_sequence_kernel_bitwise(interpret):
    """Row b is what the one-sequence graph's kernel gives sequence b alone, bit for bit (the same per-row
    arithmetic in the same order): the batched graph at B = 1 keeps the one-sequence graph's numbers."""
    args = _case(POSITIONS, 64, 32, seed=6)
    for got, want in zip(_kernel(args, ROPE), _one_sequence_kernel(args, ROPE)):
        assert torch.equal(got, want)


def test_kernel_reference_matches_the_op():
    """The kernel file's own torch formula (on the cos | sin table) is the op's numbers."""
    args = _case(POSITIONS, 64, 32, seed=3)
    got = pair_compressor.reference(*args, _table(ROPE), eps=EPS, rope_dim=ROPE["rope_dim"])
    _check(list(got), get_op(OP).run(args, {"eps": EPS, **ROPE}))


def test_shape_checks_reject_what_the_kernel_cannot_tile():
    with pytest.raises(AssertionError, match="power of two"):
        pair_compressor.check_shapes(96, 32, 16, pair_compressor.Config())
    with pytest.raises(AssertionError, match="rope_dim"):
        pair_compressor.check_shapes(64, 16, 32, pair_compressor.Config())


def test_roofline_counts_the_weight_once():
    small, _ = pair_compressor.roofline(1, 512, 128, 64)
    large, flops = pair_compressor.roofline(64, 512, 128, 64)
    assert small > 2 * 128 * 512 and large - small < 63 * 4 * 8 * 512  # per sequence: ~7 fp32 rows of d
    assert flops > 2 * 64 * 512 * 128


def test_compiles_for_hopper_without_spills_or_fused_products():
    sig = {n: "*fp32" for n in ("kv_ptr", "sc_ptr", "skv_ptr", "ssc_ptr", "cs_ptr", "entry_ptr", "keys_ptr",
                                "nkv_ptr", "nsc_ptr")}  # fmt: skip
    sig.update({"pos_ptr": "*i64", "norm_ptr": "*bf16", "wk_ptr": "*bf16", "knorm_ptr": "*bf16", "eidx_ptr": "*i64",
                "eps": "fp32"})  # fmt: skip
    cfg = pair_compressor.default_config(64, 512, 128)
    ptx, report = compile_sm90("deepinfer.codegen.kernels.pair_compressor", "_kernel", sig,
                               dict(D=512, DI=128, R=64, OB=cfg.out_block), num_warps=cfg.warps,
                               enable_fp_fusion=False)  # fmt: skip
    assert ".target sm_90a" in ptx and "fma.rn.f32" not in ptx and spill_free(report), report


# ---------------------------------------------------------------------------------------------- adapter, binder


def _call(args, rope_attrs, cache):
    from deepinfer.runtime import kernel_adapters as ka

    names = ["kv", "score", "state_kv", "state_score", "positions", "norm", "wk", "k_norm"]
    return ka.Call(OP, {"eps": EPS, **rope_attrs}, args, names, [False] * 5 + [True] * 3, {}, cache)


def test_adapter_runs_the_kernel_under_the_batched_graphs_binding(interpret, monkeypatch):
    """The batched graph keeps the one-sequence node's "compressor" binding: that family finds this adapter, which
    runs the kernel (the adapters' interpreter on) with the runner's rope table, and declines without the
    position bound."""
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setattr(ka, "EMULATE", True)
    monkeypatch.setenv(ka.ADAPTER_INTERPRET_ENV, "1")
    adapter = ka.adapter_for("compressor", OP)
    assert adapter is ka.adapter_for("pair_compressor", OP) and adapter is not None
    args = _case(POSITIONS, 64, 32, seed=4)
    with pytest.raises(ka.Decline, match="position bound"):
        adapter.keys(_call(args, ROPE, {}))
    call = _call(args, ROPE, {ka.MAX_POSITIONS: 5000})
    assert adapter.keys(call) == []
    calls = []
    real = pair_compressor.triton_batched_pair_keys
    monkeypatch.setattr(pair_compressor, "triton_batched_pair_keys", lambda *a, **k: calls.append(1) or real(*a, **k))
    _check(adapter.run(call, []), get_op(OP).run(args, {"eps": EPS, **ROPE}))
    assert calls == [1]


def test_binder_binds_the_batched_op_on_cuda_targets_only():
    from deepinfer.codegen.targets import get_target
    from deepinfer.ir import dtypes as dt
    from deepinfer.ir.graph import Node, TensorType, Value
    from deepinfer.passes import select_kernels as sk

    f32 = lambda *s: Value("x", TensorType(dt.f32, s))  # noqa: E731
    bf16 = lambda *s: Value("w", TensorType(dt.bf16, s))  # noqa: E731
    ins = [f32(64, 512)] * 4 + [Value("p", TensorType(dt.i64, (64,))), bf16(512), bf16(128, 512), bf16(128)]
    node = Node(OP, ins, {"eps": EPS, **ROPE}, [f32(64, 512)])
    family, program, shape, cfg, reduce = sk.BINDERS[OP](sk._Ctx(node, {}, get_target("sm90")))
    assert (family, program, shape) == ("pair_compressor", "triton", {"B": 64, "d": 512, "di": 128})
    assert set(reduce) <= set(cfg) and cfg == sk.BINDERS[OP](sk._Ctx(node, {}, get_target("sm100")))[3]
    with pytest.raises(sk.Fallback):
        sk.BINDERS[OP](sk._Ctx(node, {}, get_target("cpu")))


# ---------------------------------------------------------------------------------------------- H200


@pytest.mark.gpu
def test_cuda_kernel_at_v41_dims():
    """B 64 sequences at V4.1's dims, positions around 4k (half close a pair), vs the op's reference on the GPU;
    then a CUDA graph replay of the launch gives the same outputs (no host work in it); each row equals the
    one-sequence kernel's result for that sequence bit for bit."""
    rope_attrs = {**ROPE, "rope_dim": 64}
    positions = [4095 + (i % 3) + 2 * (i % 5) for i in range(64)]
    args = _case(positions, 512, 128, seed=5, device="cuda")
    table = _table(rope_attrs, "cuda")
    ref = get_op(OP).run(args, {"eps": EPS, **rope_attrs})
    run = lambda: pair_compressor.triton_batched_pair_keys(*args, table, eps=EPS, rope_dim=64)  # noqa: E731
    _check(run(), ref)
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    _check(out, ref)
    for got, want in zip(run(), _one_sequence_kernel(args, rope_attrs)):  # the one-sequence kernel's bits
        assert torch.equal(got, want)
