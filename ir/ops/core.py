"""Core tensor ops: elementwise, shape manipulation, reductions, matmul, norms, indexing, cache writes.

Each op: its schema, its type/shape inference (symbolic dims welcome) and its torch reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.errors import ShapeError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import TensorType
from deepinfer.ir.registry import Attr, register_op, shape_fail
from deepinfer.ir.shapes import broadcast_shapes, exact_div, numel, shape_str


def _axis(axis: int, rank: int, op: str) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"{op}: axis {axis} out of range for rank {rank}")
    return axis % rank if rank else 0


# ---------------------------------------------------------------------------------------------------
# Elementwise
# ---------------------------------------------------------------------------------------------------

_UNARY = {
    "neg": torch.neg,
    "abs": torch.abs,
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "square": torch.square,
    "sign": torch.sign,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "relu": torch.relu,
    "tanh": torch.tanh,
    "softplus": F.softplus,
}


def _register_unary(name: str, fn) -> None:
    class Unary:
        def infer(x):
            if not x.dtype.is_float:
                raise shape_fail(name, "needs a float input", x)
            return x

        def reference(x, _fn=fn):
            return _fn(x)

    Unary.__doc__ = f"Elementwise {name}."
    register_op(name, "x")(Unary)


for _n, _f in _UNARY.items():
    _register_unary(_n, _f)

_BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "pow": torch.pow,
}
_COMPARE = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}


def _broadcast(name: str, a: TensorType, b: TensorType):
    shape = broadcast_shapes(a.shape, b.shape)
    if shape is None:
        raise shape_fail(name, "shapes do not broadcast", a, b)
    if a.dtype != b.dtype:
        raise shape_fail(name, "dtypes differ", a, b)
    return shape


def _register_binary(name: str, fn, compare: bool) -> None:
    class Binary:
        def infer(a, b):
            shape = _broadcast(name, a, b)
            return TensorType(dt.boolean if compare else a.dtype, shape)

        def reference(a, b, _fn=fn):
            return _fn(a, b)

    Binary.__doc__ = f"Elementwise {name} with numpy broadcasting; both inputs have one dtype."
    register_op(name, "a, b")(Binary)


for _n, _f in _BINARY.items():
    _register_binary(_n, _f, False)
for _n, _f in _COMPARE.items():
    _register_binary(_n, _f, True)


@register_op("scale", "x", {"factor": Attr("float"), "bias": Attr("float", 0.0)})
class Scale:
    """x * factor + bias with Python-number constants (keeps graphs free of scalar tensors)."""

    def infer(x, *, factor, bias):
        return x

    def reference(x, *, factor, bias):
        return x * factor + bias if bias else x * factor


@register_op("clamp", "x", {"min": Attr("float", None), "max": Attr("float", None)})
class Clamp:
    """Clamp to [min, max]; either bound may be absent."""

    def infer(x, *, min, max):
        return x

    def reference(x, *, min, max):
        return torch.clamp(x, min=min, max=max)


@register_op("where", "cond, a, b")
class Where:
    """cond ? a : b with broadcasting."""

    def infer(cond, a, b):
        if cond.dtype != dt.boolean:
            raise shape_fail("where", "cond must be bool", cond)
        shape = broadcast_shapes(cond.shape, _broadcast("where", a, b))
        if shape is None:
            raise shape_fail("where", "shapes do not broadcast", cond, a, b)
        return TensorType(a.dtype, shape)

    def reference(cond, a, b):
        return torch.where(cond, a, b)


@register_op("cast", "x", {"dtype": Attr("dtype")})
class Cast:
    """Convert to another dtype (round to nearest)."""

    def infer(x, *, dtype):
        if dtype.packed != 1 or x.dtype.packed != 1:
            raise shape_fail("cast", "packed fp4 needs quantize/dequantize ops, not cast", x)
        return x.with_dtype(dtype)

    def reference(x, *, dtype):
        return x.to(dtype.torch_dtype)


@register_op("full", "", {"shape": Attr("shape"), "value": Attr("float"), "dtype": Attr("dtype", dt.f32)})
class Full:
    """A tensor filled with one value (shape may be symbolic)."""

    def infer(*, shape, value, dtype):
        return TensorType(dtype, tuple(shape))

    def reference(*, shape, value, dtype):
        return torch.full(tuple(shape), value, dtype=dtype.torch_dtype)


@register_op("arange", "", {"end": Attr("dim"), "start": Attr("int", 0), "dtype": Attr("dtype", dt.i64)})
class Arange:
    """start, start+1, ..., end-1."""

    def infer(*, end, start, dtype):
        return TensorType(dtype, (end - start if start else end,))

    def reference(*, end, start, dtype):
        return torch.arange(start, end, dtype=dtype.torch_dtype)


# ---------------------------------------------------------------------------------------------------
# Shape manipulation
# ---------------------------------------------------------------------------------------------------


@register_op("reshape", "x", {"shape": Attr("shape")})
class Reshape:
    """Reshape; one dim may be -1 and is inferred (also through symbolic dims like T*4096/(T*32))."""

    def infer(x, *, shape):
        total = numel(x.shape)
        if sum(1 for d in shape if d == -1) > 1:
            raise shape_fail("reshape", f"more than one -1 in {shape_str(tuple(shape))}", x)
        known = numel(tuple(d for d in shape if d != -1))
        if -1 in shape:
            missing = exact_div(total, known)
            if missing is None:
                raise shape_fail("reshape", f"cannot infer -1 in {shape_str(tuple(shape))}", x)
            shape = [missing if d == -1 else d for d in shape]
        elif known != total:
            raise shape_fail("reshape", f"target {shape_str(tuple(shape))} has a different size", x)
        return x.with_shape(shape)

    def reference(x, *, shape):
        return x.reshape(tuple(shape))


@register_op("transpose", "x", {"perm": Attr("ints")})
class Transpose:
    """Permute dims: out.shape[i] = x.shape[perm[i]]."""

    def infer(x, *, perm):
        if sorted(perm) != list(range(x.rank)):
            raise shape_fail("transpose", f"perm {perm} is not a permutation of {x.rank} dims", x)
        return x.with_shape([x.shape[p] for p in perm])

    def reference(x, *, perm):
        return x.permute(*perm).contiguous()


@register_op("expand", "x", {"shape": Attr("shape")})
class Expand:
    """Broadcast x to shape (x's dims must be 1 or equal)."""

    def infer(x, *, shape):
        if broadcast_shapes(x.shape, tuple(shape)) != tuple(shape):
            raise shape_fail("expand", f"cannot expand to {shape_str(tuple(shape))}", x)
        return x.with_shape(shape)

    def reference(x, *, shape):
        return x.expand(*shape).contiguous()


@register_op("concat", "*xs", {"axis": Attr("int")})
class Concat:
    """Concatenate along axis; other dims must agree."""

    def infer(*xs, axis):
        first = xs[0]
        ax = _axis(axis, first.rank, "concat")
        for x in xs[1:]:
            same = x.rank == first.rank and all(
                x.shape[i] == first.shape[i] for i in range(first.rank) if i != ax
            )
            if not same or x.dtype != first.dtype:
                raise shape_fail("concat", f"inputs disagree off axis {axis}", first, x)
        size = xs[0].shape[ax]
        for x in xs[1:]:
            size = size + x.shape[ax]
        return first.with_shape(first.shape[:ax] + (size,) + first.shape[ax + 1 :])

    def reference(*xs, axis):
        return torch.cat(xs, dim=axis)


@register_op("slice", "x", {"axis": Attr("int"), "start": Attr("dim"), "end": Attr("dim"), "step": Attr("int", 1)})
class Slice:
    """x[start:end:step] along axis (start/end may be symbolic, must lie within the dim)."""

    def infer(x, *, axis, start, end, step):
        ax = _axis(axis, x.rank, "slice")
        if step < 1:
            raise shape_fail("slice", f"step {step} must be >= 1", x)
        length = end - start
        if step != 1:
            length = (length + (step - 1)) // step
        return x.with_shape(x.shape[:ax] + (length,) + x.shape[ax + 1 :])

    def reference(x, *, axis, start, end, step):
        idx = [slice(None)] * x.dim()
        idx[axis] = slice(start, end, step)
        return x[tuple(idx)].contiguous()


@register_op("split", "x", {"axis": Attr("int"), "sizes": Attr("shape")})
class Split:
    """Split along axis into pieces of the given sizes (they must add up to the dim)."""

    def infer(x, *, axis, sizes):
        ax = _axis(axis, x.rank, "split")
        total = sizes[0]
        for s in sizes[1:]:
            total = total + s
        if total != x.shape[ax]:
            raise shape_fail("split", f"sizes {shape_str(tuple(sizes))} do not add up to dim {ax}", x)
        return tuple(x.with_shape(x.shape[:ax] + (s,) + x.shape[ax + 1 :]) for s in sizes)

    def reference(x, *, axis, sizes):
        return tuple(t.contiguous() for t in torch.split(x, list(sizes), dim=axis))


# ---------------------------------------------------------------------------------------------------
# Reductions and normalisation
# ---------------------------------------------------------------------------------------------------


def _reduce_shape(x: TensorType, axes: list[int], keepdim: bool, op: str):
    axs = sorted({_axis(a, x.rank, op) for a in axes})
    if keepdim:
        return tuple(1 if i in axs else d for i, d in enumerate(x.shape))
    return tuple(d for i, d in enumerate(x.shape) if i not in axs)


def _register_reduce(name: str, fn) -> None:
    class Reduce:
        def infer(x, *, axes, keepdim):
            return x.with_shape(_reduce_shape(x, axes, keepdim, name))

        def reference(x, *, axes, keepdim, _fn=fn):
            return _fn(x, axes, keepdim)

    Reduce.__doc__ = f"{name} over axes."
    register_op(name, "x", {"axes": Attr("ints"), "keepdim": Attr("bool", False)})(Reduce)


_register_reduce("reduce_sum", lambda x, a, k: x.sum(dim=a, keepdim=k))
_register_reduce("reduce_mean", lambda x, a, k: x.mean(dim=a, keepdim=k))
_register_reduce("reduce_max", lambda x, a, k: x.amax(dim=a, keepdim=k))
_register_reduce("reduce_min", lambda x, a, k: x.amin(dim=a, keepdim=k))


@register_op("softmax", "x", {"axis": Attr("int", -1)})
class Softmax:
    """Softmax along axis, computed in fp32, cast back."""

    def infer(x, *, axis):
        _axis(axis, x.rank, "softmax")
        return x

    def reference(x, *, axis):
        return torch.softmax(x.float(), dim=axis).to(x.dtype)


@register_op("rmsnorm", "x, weight?", {"eps": Attr("float", 1e-6)})
class RMSNorm:
    """w * x * rsqrt(mean(x^2) + eps) over the last dim, in fp32 with the weight in fp32, cast back."""

    def infer(x, weight, *, eps):
        if weight is not None and (weight.rank != 1 or weight.shape[0] != x.shape[-1]):
            raise shape_fail("rmsnorm", "weight must be [last dim of x]", x, weight)
        return x

    def reference(x, weight, *, eps):
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = y * weight.float()
        return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Matrix products
# ---------------------------------------------------------------------------------------------------


@register_op("matmul", "a, b")
class Matmul:
    """Batched a @ b with broadcast batch dims; accumulates in fp32 for low-precision inputs."""

    def infer(a, b):
        if a.rank < 2 or b.rank < 2 or a.shape[-1] != b.shape[-2] or a.dtype != b.dtype:
            raise shape_fail("matmul", "needs [..., M, K] @ [..., K, N] of one dtype", a, b)
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
        if batch is None:
            raise shape_fail("matmul", "batch dims do not broadcast", a, b)
        return TensorType(a.dtype, batch + (a.shape[-2], b.shape[-1]))

    def reference(a, b):
        return torch.matmul(a.float(), b.float()).to(a.dtype)


@register_op("linear", "x, weight, bias?")
class Linear:
    """x @ weight^T (+ bias); weight is [out, in] as in checkpoints. fp32 accumulation."""

    def infer(x, weight, bias):
        if weight.rank != 2 or x.shape[-1] != weight.shape[1]:
            raise shape_fail("linear", "needs x [..., in] and weight [out, in]", x, weight)
        if bias is not None and bias.shape != (weight.shape[0],):
            raise shape_fail("linear", "bias must be [out]", weight, bias)
        return TensorType(x.dtype, x.shape[:-1] + (weight.shape[0],))

    def reference(x, weight, bias):
        if x.is_cuda and x.dtype == torch.float32 and weight.dtype == torch.bfloat16 and weight.numel() >= SPLIT_MIN:
            return linear_f32_bf16(x, weight, bias)
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)


def split_f32_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """[3, *x.shape] bf16 terms hi, mid, lo with hi + mid + lo == x exactly in fp32 (for finite x above ~2^-110:
    each residual is exact in fp32, and three 8-bit significands cover fp32's 24). Values so small that lo falls
    below bf16's subnormals lose their lowest bits, far under any GEMM's rounding."""
    hi = x.to(torch.bfloat16)
    r = x - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo])


# weights from this many elements take linear_f32_bf16 on CUDA (the head: 662M); smaller ones (the compressor and
# indexer projections, <= 2.6M) keep the fp32 copy: 2 launches, where the split takes ~9 for a few microseconds
SPLIT_MIN = 1 << 24
STACKED_OUT_BYTES = 1 << 29  # the three partial products in one GEMM while their fp32 output stays this small


def linear_f32_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mm=None) -> torch.Tensor:
    """f32 x @ bf16 weight^T with fp32 accumulation, the numbers of the fp32 reference up to summation order,
    without the per-call fp32 copy of the weight (2.6 GB written for the V4.1 head): x split into three bf16
    terms (split_f32_to_bf16), whose products with a bf16 weight are exact in fp32, through bf16 GEMMs with fp32
    output. Decode is memory-bound, so the extra MMAs cost nothing; the weight is read once while the three
    partial outputs fit STACKED_OUT_BYTES (one GEMM over the stacked terms), else once per term.
    ``mm(a, b)`` is the bf16 x bf16 -> fp32 GEMM (default torch.mm with out_dtype, CUDA only; tests pass one)."""
    mm = mm or (lambda a, b: torch.mm(a, b, out_dtype=torch.float32))
    k, n = x.shape[-1], weight.shape[0]
    terms = split_f32_to_bf16(x.reshape(-1, k))
    rows = terms.shape[1]
    wt = weight.T
    if 3 * rows * n * 4 <= STACKED_OUT_BYTES:
        hi, mid, lo = mm(terms.reshape(3 * rows, k), wt).view(3, rows, n)
    else:
        hi, mid, lo = (mm(t, wt) for t in terms)
    y = hi + (mid + lo)  # the small terms first: their sum is exact or nearly so
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------------------------------------------
# Indexing
# ---------------------------------------------------------------------------------------------------


def _int_index(op: str, idx: TensorType, *others) -> None:
    if idx.dtype not in (dt.i32, dt.i64):
        raise shape_fail(op, "index must be i32 or i64", idx, *others)


@register_op("embedding", "table, ids")
class Embedding:
    """table[ids]: rows of a [V, D] table for integer ids of any shape."""

    def infer(table, ids):
        _int_index("embedding", ids, table)
        if table.rank != 2:
            raise shape_fail("embedding", "table must be [V, D]", table, ids)
        return TensorType(table.dtype, ids.shape + (table.shape[1],))

    def reference(table, ids):
        return table[ids.long()]


@register_op("gather", "x, index", {"axis": Attr("int")})
class Gather:
    """torch.gather: out[i][j] = x[i][index[i][j]] along axis; index has x's rank."""

    def infer(x, index, *, axis):
        _int_index("gather", index, x)
        if index.rank != x.rank:
            raise shape_fail("gather", "index must have x's rank", x, index)
        _axis(axis, x.rank, "gather")
        return TensorType(x.dtype, index.shape)

    def reference(x, index, *, axis):
        return torch.gather(x, axis, index.long())


@register_op("index_select", "x, index", {"axis": Attr("int")})
class IndexSelect:
    """Select whole slices along axis with a 1-D index."""

    def infer(x, index, *, axis):
        _int_index("index_select", index, x)
        if index.rank != 1:
            raise shape_fail("index_select", "index must be 1-D", x, index)
        ax = _axis(axis, x.rank, "index_select")
        return x.with_shape(x.shape[:ax] + (index.shape[0],) + x.shape[ax + 1 :])

    def reference(x, index, *, axis):
        return torch.index_select(x, axis, index.long())


@register_op("topk", "x", {"k": Attr("dim"), "axis": Attr("int", -1), "largest": Attr("bool", True)})
class TopK:
    """Top-k values and i64 indices along axis, sorted. Ties go to the lower index (stable sort)."""

    def infer(x, *, k, axis, largest):
        ax = _axis(axis, x.rank, "topk")
        shape = x.shape[:ax] + (k,) + x.shape[ax + 1 :]
        return x.with_shape(shape), TensorType(dt.i64, shape)

    def reference(x, *, k, axis, largest):
        # A stable sort makes tie-breaking deterministic (lower index first), unlike torch.topk.
        order = torch.sort(x, dim=axis, descending=largest, stable=True).indices
        idx = order.narrow(axis, 0, k)
        return torch.gather(x, axis, idx), idx


@register_op("argmax", "x", {"axis": Attr("int", -1)})
class Argmax:
    """Index of the largest value along axis (first one on ties), i64."""

    def infer(x, *, axis):
        ax = _axis(axis, x.rank, "argmax")
        return TensorType(dt.i64, x.shape[:ax] + x.shape[ax + 1 :])

    def reference(x, *, axis):
        return torch.argmax(x, dim=axis)


@register_op("cumsum", "x", {"axis": Attr("int")})
class Cumsum:
    """Inclusive prefix sum along axis."""

    def infer(x, *, axis):
        _axis(axis, x.rank, "cumsum")
        return x

    def reference(x, *, axis):
        return torch.cumsum(x, dim=axis).to(x.dtype)


@register_op("scatter_rows", "cache, index, rows", stateful=True, writes={0: 0})
class ScatterRows:
    """Write rows into a cache: cache[index[i]] = rows[i] along dim 0. Negative indices are skipped.

    This is the model's state-write primitive (KV caches, compressor state): it returns the new cache, and
    the runtime may perform it in place because the old version has no later use (the verifier checks).
    """

    def infer(cache, index, rows):
        _int_index("scatter_rows", index, cache, rows)
        if index.rank != 1 or rows.shape != (index.shape[0],) + cache.shape[1:] or rows.dtype != cache.dtype:
            raise shape_fail("scatter_rows", "needs cache [N, ...], index [M], rows [M, ...]", cache, index, rows)
        return cache

    def reference(cache, index, rows):
        out = cache.clone()
        keep = index >= 0
        out[index[keep].long()] = rows[keep]
        return out
