"""The interpreter gives what direct torch evaluation gives, binds symbols, and rejects bad feeds."""

import pytest
import torch
import torch.nn.functional as F

from deepinfer.errors import IRError, ShapeError
from deepinfer.ir import interpreter
from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.ops.quant import dequant_fp8_blocks


def swiglu_block():
    """norm -> two projections -> silu(gate)*up -> down -> residual, then top-2 of a softmax."""
    b = GraphBuilder("swiglu")
    x = b.input("x", "f32", ["T", 32])
    nw = b.param("norm.weight", "f32", [32])
    w1 = b.param("w1.weight", "f32", [48, 32])
    w3 = b.param("w3.weight", "f32", [48, 32])
    w2 = b.param("w2.weight", "f32", [32, 48])
    h = b.rmsnorm(x, nw, eps=1e-6)
    gate = b.clamp(b.linear(h, w1), max=10.0)
    up = b.clamp(b.linear(h, w3), min=-10.0, max=10.0)
    y = b.add(x, b.linear(b.mul(b.silu(gate), up), w2))
    vals, idx = b.topk(b.softmax(y, axis=-1), k=2)
    b.output(y, vals, idx)
    return b.build()


def direct(x, p):
    h = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * p["norm.weight"]
    gate = (h @ p["w1.weight"].T).clamp(max=10.0)
    up = (h @ p["w3.weight"].T).clamp(-10.0, 10.0)
    y = x + (F.silu(gate) * up) @ p["w2.weight"].T
    vals, idx = torch.softmax(y, -1).topk(2, dim=-1)
    return y, vals, idx


def params(g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {p.name: 0.2 * torch.randn(tuple(p.shape), generator=gen) for p in g.params}  # no softmax underflow ties


@pytest.mark.parametrize("T", [1, 7, 33])
def test_interpreter_equals_direct_torch(T):
    g = swiglu_block()
    p = params(g)
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(T))
    got = interpreter.run(g, {"x": x}, p, check=True)
    want = direct(x, p)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[2], want[2])


def test_fp8_linear_equals_dequantise_then_matmul_in_float64():
    b = GraphBuilder("fp8")
    x = b.input("x", "f32", ["T", 64])
    w = b.param("w.weight", "f8e4m3", [40, 64])
    s = b.param("w.scale", "e8m0", [2, 2])
    b.output(b.linear_fp8(x, w, s, block=32))
    g = b.build()
    gen = torch.Generator().manual_seed(1)
    wt = torch.randn(40, 64, generator=gen).to(torch.float8_e4m3fn)
    st = torch.randint(120, 130, (2, 2), generator=gen, dtype=torch.uint8)
    xt = torch.randn(5, 64, generator=gen)
    (got,) = interpreter.run(g, {"x": xt}, {"w.weight": wt, "w.scale": st.view(torch.float8_e8m0fnu)})
    # independent: scale of block (i//32, j//32) is 2^(byte-127)
    scale = torch.exp2(st.double() - 127).repeat_interleave(32, 0)[:40].repeat_interleave(32, 1)
    want = xt.double() @ (wt.double() * scale).T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dequant_fp8_blocks(wt, st.view(torch.float8_e8m0fnu), 32).double(), wt.double() * scale)


def test_symbols_bind_consistently():
    b = GraphBuilder("two")
    x = b.input("x", "f32", ["T", 4])
    y = b.input("y", "f32", ["T", 4])
    b.output(b.add(x, y))
    g = b.build()
    with pytest.raises(ShapeError, match="symbol T is 3 elsewhere but 5 here"):
        interpreter.run(g, {"x": torch.zeros(3, 4), "y": torch.zeros(5, 4)})
    with pytest.raises(ShapeError, match=r"input %x: expected shape \[T=3, 5\], got \(3, 4\)"):
        b2 = GraphBuilder("one")
        b2.output(b2.neg(b2.input("x", "f32", ["T", 5])))
        interpreter.run(b2.build(), {"x": torch.zeros(3, 4)})
    with pytest.raises(IRError, match="missing input tensor %y"):
        interpreter.run(g, {"x": torch.zeros(3, 4)})
    with pytest.raises(ShapeError, match="expected dtype f32, got torch.float16"):
        interpreter.run(g, {"x": torch.zeros(3, 4), "y": torch.zeros(3, 4, dtype=torch.float16)})


def test_stateful_write_does_not_mutate_the_callers_cache():
    b = GraphBuilder("cache")
    cache = b.input("cache", "f32", [6, 2])
    rows = b.input("rows", "f32", ["T", 2])
    slots = b.input("slots", "i64", ["T"])
    b.output(b.scatter_rows(cache, slots, rows))
    g = b.build()
    c = torch.zeros(6, 2)
    (new,) = interpreter.run(g, {"cache": c, "rows": torch.ones(3, 2), "slots": torch.tensor([4, -1, 0])})
    assert new[:, 0].tolist() == [1, 0, 0, 0, 1, 0]  # slot -1 is skipped
    assert c.abs().sum() == 0
