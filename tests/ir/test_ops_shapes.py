"""Symbolic shape inference through every core and quant op, checked by running them.

Each case builds a graph whose inputs have the symbolic token count T, then runs it with the interpreter
at two values of T with ``check=True``: every produced tensor must have the shape and dtype that symbolic
inference predicted. A test also checks every op of ir/ops/core.py and ir/ops/quant.py has a case.
"""

import pytest
import torch

from deepinfer.ir import interpreter
from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.registry import all_ops

UNARY = ["neg", "abs", "exp", "log", "sqrt", "rsqrt", "square", "sign", "sigmoid", "silu", "relu", "tanh", "softplus"]
BINARY = ["add", "sub", "mul", "div", "maximum", "minimum", "pow", "eq", "ne", "lt", "le", "gt", "ge"]


def _x(b, shape=("T", 64), name="x", dt="f32"):
    return b.input(name, dt, list(shape))


def case_unary(op):
    return lambda b: getattr(b, op)(_x(b))


def case_binary(op):
    return lambda b: getattr(b, op)(_x(b), b.input("y", "f32", [1, 64]))


CASES = {op: case_unary(op) for op in UNARY}
CASES.update({op: case_binary(op) for op in BINARY})
CASES.update(
    {
        "scale": lambda b: b.scale(_x(b), factor=0.5, bias=1.0),
        "clamp": lambda b: b.clamp(_x(b), min=-1.0, max=None),
        "where": lambda b: b.where(b.gt(_x(b), b.input("z", "f32", [1])), _x(b, name="a"), _x(b, name="c")),
        "cast": lambda b: b.cast(_x(b), dtype="bf16"),
        "full": lambda b: b.add(_x(b), b.full(shape=["T", 64], value=2.0)),
        "arange": lambda b: b.add(b.cast(b.arange(end="T", start=0), dtype="f32"), b.input("v", "f32", ["T"])),
        "reshape": lambda b: b.reshape(_x(b), shape=[-1, 8, 4, 2]),
        "transpose": lambda b: b.transpose(b.reshape(_x(b), shape=["T", 8, 8]), perm=[1, 0, 2]),
        "expand": lambda b: b.expand(b.input("v", "f32", ["T", 1]), shape=["T", 16]),
        "concat": lambda b: b.concat(_x(b), _x(b, ("T", 8), "y"), axis=1),
        "slice": lambda b: b.slice(_x(b), axis=0, start=1, end="T//2+1", step=1),
        "split": lambda b: b.split(_x(b), axis=1, sizes=[16, 48]),
        "reduce_sum": lambda b: b.reduce_sum(_x(b), axes=[0], keepdim=True),
        "reduce_mean": lambda b: b.reduce_mean(_x(b), axes=[1]),
        "reduce_max": lambda b: b.reduce_max(_x(b), axes=[0, 1]),
        "reduce_min": lambda b: b.reduce_min(_x(b), axes=[-1], keepdim=True),
        "softmax": lambda b: b.softmax(_x(b), axis=0),
        "rmsnorm": lambda b: b.rmsnorm(_x(b), b.param("norm.weight", "f32", [64]), eps=1e-20),
        "matmul": lambda b: b.matmul(b.reshape(_x(b), shape=["T", 8, 8]), b.input("m", "f32", [8, 3])),
        "linear": lambda b: b.linear(_x(b), b.param("w.weight", "f32", [32, 64]), b.param("w.bias", "f32", [32])),
        "embedding": lambda b: b.embedding(b.param("embed.weight", "bf16", [50, 16]), b.input("ids", "i64", ["T"])),
        "gather": lambda b: b.gather(_x(b), b.input("cols3", "i64", ["T", 3]), axis=1),
        "index_select": lambda b: b.index_select(_x(b), b.input("cols", "i32", [5]), axis=1),
        "topk": lambda b: b.topk(_x(b), k="T//2", axis=0),
        "argmax": lambda b: b.argmax(_x(b), axis=-1),
        "cumsum": lambda b: b.cumsum(_x(b), axis=0),
        "scatter_rows": lambda b: b.scatter_rows(
            b.input("cache", "f32", [40, 64]), b.input("rows", "i64", ["T"]), _x(b)
        ),
        "quant_fp8": lambda b: b.quant_fp8(_x(b), group=32),
        "dequant_fp8": lambda b: b.dequant_fp8(*b.quant_fp8(_x(b), group=32), group=32, dtype="bf16"),
        "fake_quant_fp8": lambda b: b.fake_quant_fp8(_x(b), group=32),
        "fake_quant_fp4": lambda b: b.fake_quant_fp4(_x(b), group=32),
        "dequant_fp8_block": lambda b: b.dequant_fp8_block(
            b.param("w.weight", "f8e4m3", [96, 64]), b.param("w.scale", "e8m0", [3, 2]), block=32
        ),
        "dequant_fp4": lambda b: b.dequant_fp4(
            b.param("w.weight", "f4e2m1x2", [16, 32]), b.param("w.scale", "e8m0", [16, 2]), group=32
        ),
        "linear_fp8": lambda b: b.linear_fp8(
            _x(b), b.param("w.weight", "f8e4m3", [96, 64]), b.param("w.scale", "e8m0", [1, 1]), block=128, act_group=32
        ),
        "linear_fp4": lambda b: b.linear_fp4(
            _x(b), b.param("w.weight", "f4e2m1x2", [16, 32]), b.param("w.scale", "e8m0", [16, 2]), act_group=32
        ),
        # collectives at world size 1 (the multi-process runs are in tests/passes/test_parallel_mp.py)
        "all_reduce": lambda b: b.all_reduce(_x(b), world=1),
        "all_gather": lambda b: b.all_gather(_x(b), world=1, axis=0),
        "reduce_scatter": lambda b: b.reduce_scatter(_x(b), world=1, axis=0),
        "all_to_all": lambda b: b.all_to_all(_x(b), world=1, axis=0),
        "cp_gather": lambda b: b.cp_gather(_x(b), world=1),
        "cp_take": lambda b: b.cp_take(_x(b), world=1, rank=0),
    }
)


INDEX_RANGE = {"ids": 50, "cols3": 64, "cols": 64, "rows": 40}  # embedding rows, x columns, cache rows


def random_tensor(v, T):
    """A valid random tensor for a value (indices within range for the cases above)."""
    shape = tuple(T if str(d) == "T" else d for d in v.shape)
    g = torch.Generator().manual_seed(hash(v.name) % 1000)
    d = v.dtype
    if d.name in ("i32", "i64"):
        high = INDEX_RANGE[v.name]
        return torch.randint(0, high, shape, generator=g).to(d.torch_dtype)
    if d.name == "f4e2m1x2":
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if d.name == "e8m0":
        return torch.randint(120, 130, shape, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    if d.name == "f8e4m3":
        return torch.randn(shape, generator=g).to(torch.float8_e4m3fn)
    return (torch.rand(shape, generator=g) + 0.5).to(d.torch_dtype)  # positive: log/sqrt/pow stay finite


@pytest.mark.parametrize("op", sorted(CASES))
@pytest.mark.parametrize("T", [4, 10])
def test_inferred_shape_matches_execution(op, T):
    b = GraphBuilder(op)
    out = CASES[op](b)
    b.output(*(out if isinstance(out, tuple) else (out,)))
    g = b.build()
    assert op in g.op_counts()
    feeds = {v.name: random_tensor(v, T) for v in g.inputs}
    params = {v.name: random_tensor(v, T) for v in g.params}
    interpreter.run(g, feeds, params, check=True)  # raises if any tensor differs from its inferred type


def test_every_core_and_quant_op_has_a_case():
    mine = {
        name
        for name, d in all_ops().items()
        if d.reference_fn.__module__ in ("deepinfer.ir.ops.core", "deepinfer.ir.ops.quant")
    }
    assert mine - set(CASES) == set()
