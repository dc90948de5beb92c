"""Row-symbolic families (moe_routing, rope, engram embed/gate): the runtime adapters ask for ONE kernel whatever
the token count (the key's row count is None: the program's T is symbolic), so `deepinfer compile` builds one
kernel where it built one per bucket; and that one kernel, built for TileLang's `c` target from the key, runs
the adapter at two token counts with the op's reference results."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ir.registry import get_op
from deepinfer.runtime import kernel_adapters as ka

ROPE = {"rope_dim": 64, "theta": 10000.0, "yarn_factor": 1.0, "yarn_orig_len": 0, "beta_fast": 32.0,
        "beta_slow": 1.0, "inverse": False}  # fmt: skip
ROUTE = {"topk": 4, "scoring": "sqrtsoftplus", "route_scale": 1.5, "normalize": True}
GATE = {"eps": 1e-20, "clamp": 1e-6, "image_token_id": 99}


@pytest.fixture(autouse=True)
def emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)  # the adapters' "CUDA tensors only" check: CPU tensors stand in
    torch.set_num_threads(1)


def _call(op: str, attrs: dict, args: list, params: list, config: dict) -> ka.Call:
    return ka.Call(op, attrs, args, [f"v{i}" for i in range(len(args))], params, config,
                   {ka.MAX_POSITIONS: 300})  # fmt: skip


def _routing(t: int, g: torch.Generator) -> ka.Call:
    x, gate, bias = torch.randn(t, 64, generator=g), torch.randn(16, 64, generator=g), torch.randn(16, generator=g)
    return _call("moe_gate_route", ROUTE, [x, gate, bias * 0.1, None, None], [False, True, True, False, False],
                 {"block_m": 2, "threads": 32})  # fmt: skip


def _rope(t: int, g: torch.Generator) -> ka.Call:
    x, pos = torch.randn(t, 3, 96, generator=g), torch.randint(0, 300, (t,), generator=g)
    return _call("rope", ROPE, [x, pos], [False, False], {"block_t": 4, "threads": 128})


def _embed(t: int, g: torch.Generator, rows: int = 40) -> ka.Call:
    from deepinfer.codegen.kernels import engram

    q, s = engram.quantize_table(torch.randn(rows, engram.HEAD_DIM, generator=g))
    ids = torch.randint(0, rows, (t, 24), generator=g)
    return _call("engram_embed", {}, [q, s.view(torch.float8_e8m0fnu), ids], [True, True, False],
                 {"block_t": 2, "threads": 128})  # fmt: skip


def _gate(t: int, g: torch.Generator) -> ka.Call:
    n, d = 4, 256
    x, kv = torch.randn(t, n, d, generator=g), torch.randn(t, (n + 1) * d, generator=g)
    qw, kw = torch.rand(n, d, generator=g) + 0.5, torch.rand(n, d, generator=g) + 0.5
    tokens = torch.arange(t) + 98  # token 99 (the image token) at row 1
    return _call("engram_gate", GATE, [x, kv, qw, kw, tokens], [False, False, True, True, False],
                 {"block_d": 128, "threads": 128})  # fmt: skip


CASES = {"moe_routing": _routing, "rope": _rope, "engram.embed": _embed, "engram.gate": _gate}
TOL = {"rope": 1e-2, "engram.gate": 1e-2}  # relative to the largest output: the kernels round x to bf16 (io)


def _adapter(call: ka.Call):
    fam = {"moe_gate_route": "moe_routing", "rope": "rope"}.get(call.op, "engram")
    return ka.adapter_for(fam, call.op)


@pytest.mark.parametrize("case", CASES)
def test_one_key_for_every_token_count(case):
    """Bucket sizes 1, 5 (a prefill between buckets), 64 and 4096 ask for the same kernel; its row count is None."""
    g = torch.Generator().manual_seed(0)
    keys = {t: _adapter(c).keys(c) for t in (1, 5, 64, 4096) for c in [CASES[case](t, g)]}
    assert all(len(k) == 1 for k in keys.values())
    assert len({k[0] for k in keys.values()}) == 1, {t: k[0].describe() for t, k in keys.items()}
    assert keys[1][0].args[0] is None, keys[1][0].describe()


def test_embed_tables_of_two_sizes_share_the_kernel():
    g = torch.Generator().manual_seed(1)
    a, b = _embed(3, g, rows=40), _embed(3, g, rows=17)
    assert _adapter(a).keys(a) == _adapter(b).keys(b)


@pytest.mark.parametrize("case", CASES)
def test_one_c_target_build_runs_two_token_counts(tilelang_required, case):
    """The key's program built once for the `c` target; the adapter runs 5 and 2 tokens on it (no padding: the
    kernel sees the real rows) and gives the op's reference (routing: the same experts)."""
    g = torch.Generator().manual_seed(2)
    first = CASES[case](5, g)
    kernel = ka.c_target_kernel(_adapter(first).keys(first)[0])
    for call in (first, CASES[case](2, g)):
        got = _adapter(call).run(call, [kernel])
        want = get_op(call.op).run(call.args, call.attrs)
        want = want if isinstance(want, (list, tuple)) else [want]
        for t, (o, w) in enumerate(zip(got, want, strict=True)):
            assert o.shape == w.shape and o.dtype == w.dtype, (case, t, o.shape, w.shape)
            if o.dtype.is_floating_point:
                assert (o.float() - w.float()).abs().max() <= TOL.get(case, 1e-5) * max(1.0, w.abs().max()), case
            else:
                assert torch.equal(o, w), case
