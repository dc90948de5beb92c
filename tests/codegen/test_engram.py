"""engram family: gather and gate references vs the IR ops (engram_embed, engram_gate) and float64 oracles,
fp32 numerics on TileLang's `c` target, sm90/sm100 builds (FP8 table), roofline."""

import pytest
import torch

from deepinfer.codegen.kernels import engram as eg
from deepinfer.ir.ops.engram import EngramEmbed, EngramGate

IMG, EPS, CLAMP = 129264, 1e-20, 1e-6


def _table(R, seed=0):
    g = torch.Generator().manual_seed(seed)
    return eg.quantize_table(torch.randn(R, eg.HEAD_DIM, generator=g) * (torch.rand(R, 1, generator=g) * 8 + 0.01))


def test_embed_reference_matches_the_ir_op_and_oracle():
    q, s = _table(40)
    ids = torch.randint(0, 40, (5, 24))
    got = eg.embed_reference(q, s, ids)
    assert torch.equal(got, EngramEmbed.reference(q, s.view(torch.float8_e8m0fnu), ids))
    assert torch.equal(got.double(), eg.embed_reference_f64(q, s, ids))  # powers of two: exact
    deq = q.float().view(40, 8, 32) * torch.exp2(s.float() - 127).unsqueeze(-1)
    assert torch.equal(got.view(5, 24, 256)[0, 0], deq.view(40, 256)[ids[0, 0]])


def _gate_inputs(T_, n, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T_, n, D, generator=g)
    kv = torch.randn(T_, (n + 1) * D, generator=g)
    qw, kw = torch.rand(n, D, generator=g) + 0.5, torch.rand(n, D, generator=g) + 0.5
    tok = torch.arange(T_, dtype=torch.int32) + 5
    tok[1] = IMG
    return x, kv, qw, kw, tok


def test_gate_reference_matches_the_ir_op_and_oracle():
    x, kv, qw, kw, tok = _gate_inputs(4, 4, 64)
    kv[2, :64] = 0.0  # a zero key: dot = 0 -> the clamp and the + sign
    got = eg.gate_reference(x, kv, qw * kw, tok, eps=EPS, clamp=CLAMP, image_token_id=IMG)
    want = EngramGate.reference(x, kv, qw, kw, tok, eps=EPS, clamp=CLAMP, image_token_id=IMG)
    assert (got - want).abs().max() < 1e-5
    assert torch.equal(got[1], x[1]), "image-token rows are left unchanged"
    oracle = eg.gate_reference_f64(x, kv, qw, kw, tok, eps=EPS, clamp=CLAMP, image_token_id=IMG)
    assert (got.double() - oracle).abs().max() < 1e-5
    g0 = torch.sigmoid(torch.tensor(CLAMP**0.5))
    assert torch.allclose(got[2, 0], x[2, 0] + g0 * kv[2, 4 * 64 :], atol=1e-6)


def test_c_target_embed(tilelang_required):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    R, T_, K = 50, 3, 24
    q, s = _table(R, seed=1)
    ids = torch.randint(0, R, (T_, K), dtype=torch.int32)
    kernel = compile_cpu(eg.embed_program(T_, K, R, target="cpu", cfg=eg.EmbedConfig(2, 128)))
    m = torch.full((T_, K * eg.HEAD_DIM), float("nan"))
    kernel(q.float(), s, ids, m)  # the `c` target has no fp8 type: fp32 holding the fp8 values
    assert torch.equal(m.double(), eg.embed_reference_f64(q, s, ids))


def test_c_target_gate(tilelang_required):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    T_, n, D = 3, 4, 256
    x, kv, qw, kw, tok = _gate_inputs(T_, n, D, seed=2)
    kernel = compile_cpu(eg.gate_program(T_, n, D, eps=EPS, clamp=CLAMP, image_token_id=IMG, target="cpu",
                                         cfg=eg.GateConfig(128, 128)))  # fmt: skip
    y = torch.full_like(x, float("nan"))
    kernel(x, kv, (qw * kw).contiguous(), tok, y)  # two D chunks per stream
    oracle = eg.gate_reference_f64(x, kv, qw, kw, tok, eps=EPS, clamp=CLAMP, image_token_id=IMG)
    assert (y.double() - oracle).abs().max() < 1e-5


def test_symbolic_rows_embed_one_build_two_token_counts_two_tables(tilelang_required):
    """T_=None, R=None: ONE c-target build gathers 3 and 2 tokens (block_t 2: a partial tail block) from tables of
    50 and 17 rows, each against the float64 oracle; rows past T are not written."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    K = 24
    kernel = compile_cpu(eg.embed_program(None, K, None, target="cpu", cfg=eg.EmbedConfig(2, 128)))
    for t, r in ((3, 50), (2, 17)):
        q, s = _table(r, seed=t)
        ids = torch.randint(0, r, (t, K), dtype=torch.int32)
        m = torch.full((t + 2, K * eg.HEAD_DIM), float("nan"))  # a write past row t shows in the spare rows
        kernel(q.float(), s, ids, m[:t])
        assert torch.equal(m[:t].double(), eg.embed_reference_f64(q, s, ids)), (t, r)
        assert m[t:].isnan().all(), "rows past T written"


def test_symbolic_rows_gate_one_build_two_token_counts(tilelang_required):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    n, D = 4, 256
    kernel = compile_cpu(eg.gate_program(None, n, D, eps=EPS, clamp=CLAMP, image_token_id=IMG, target="cpu",
                                         cfg=eg.GateConfig(128, 128)))  # fmt: skip
    for t in (3, 2):
        x, kv, qw, kw, tok = _gate_inputs(t, n, D, seed=t)
        y = torch.full_like(x, float("nan"))
        kernel(x, kv, (qw * kw).contiguous(), tok, y)
        oracle = eg.gate_reference_f64(x, kv, qw, kw, tok, eps=EPS, clamp=CLAMP, image_token_id=IMG)
        assert (y.double() - oracle).abs().max() < 1e-5, t


@pytest.fixture(scope="module")
def builds(codegen_cache, nvcc_required):
    from deepinfer.codegen import tilelang_backend as tb

    out = {}
    # V4.1 as the runtime builds it: any token count (symbolic), 24 rows of 256 from a table of any size (symbolic;
    # 384M rows there); 4 streams of 5120
    for t in ("sm90", "sm100"):
        out[t, "embed"] = tb.build(f"engram_embed_{t}", eg.embed_program(None, 24, None, target=t), t)
        out[t, "gate"] = tb.build(f"engram_gate_{t}", eg.gate_program(
            None, 4, 5120, eps=EPS, clamp=CLAMP, image_token_id=IMG, target=t), t)  # fmt: skip
    return out


@pytest.mark.parametrize("target", ["sm90", "sm100"])
@pytest.mark.parametrize("kind", ["embed", "gate"])
def test_builds_for_cuda(builds, target, kind):
    art = builds[target, kind]
    assert art.cubin_path.exists() and art.opcodes["LDG"] > 0 and art.opcodes["STG"] > 0
    assert art.opcodes["LDL"] == 0 and art.opcodes["STL"] == 0, "no local-memory spills"
    if kind == "embed":
        assert "fp8_e4_t" in art.source or "__nv_fp8" in art.source, "the table is read as fp8"
        assert "(int64_t)Ids[" in art.source, "row * 256 overflows int32 in the 384M-row table: 64-bit offsets"


def test_roofline_and_config_space():
    b, f = eg.embed_roofline(4096, 24)
    assert b == 4096 * 24 * (4 + 256 + 8 + 1024) and f == 4096 * 24 * 256
    bg, fg = eg.gate_roofline(4096, 4, 5120)
    assert bg == 2 * 4096 * 4 * 5120 * 2 + 4 * 4096 * 5 * 5120 + 4 * 4 * 5120 + 4 * 4096 and fg == 4096 * 4 * 5120 * 8
    assert all(5120 % c.block_d == 0 for c in eg.gate_config_space(5120))
