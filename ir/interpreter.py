"""The interpreter: executes any graph on torch tensors (CPU or CUDA) with the ops' reference code.

It binds the symbolic dims from the input shapes, evaluates symbolic attributes (slice bounds, reshape
targets) with those bindings, runs the nodes in order, and frees each value after its last use. With
``check=True`` it also checks every produced tensor against the inferred type, which is how the tests show
that symbolic shape inference is right for every op.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deepinfer.errors import IRError, ShapeError
from deepinfer.ir.graph import Graph, Node, TensorType, Value
from deepinfer.ir.registry import get_op
from deepinfer.ir.shapes import Sym, dim_str, evaluate, shape_str


def bind_symbols(g: Graph, inputs: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Symbol values implied by the input tensors' shapes (plain-symbol dims bind, expressions check)."""
    env: dict[str, int] = {}
    for v in g.inputs:
        t = _lookup(inputs, v, "input")
        if t.dim() != len(v.shape):
            want = f"rank {len(v.shape)} {shape_str(v.shape)}"
            raise ShapeError(f"input %{v.name}: expected {want}, got {tuple(t.shape)}")
        for d, n in zip(v.shape, t.shape):
            if isinstance(d, Sym) and d.op == "sym":
                name = d.args[0]
                if env.setdefault(name, int(n)) != int(n):
                    raise ShapeError(f"input %{v.name}: symbol {name} is {env[name]} elsewhere but {n} here")
    for v in g.inputs:
        _check_tensor(v, inputs[v.name], env, "input")
    return env


def _lookup(src: Mapping[str, torch.Tensor], v: Value, kind: str) -> torch.Tensor:
    try:
        return src[v.name]
    except KeyError:
        raise IRError(f"missing {kind} tensor %{v.name} ({v.type})") from None


def _check_tensor(v: Value, t: torch.Tensor, env: dict[str, int], where: str) -> None:
    want = tuple(evaluate(d, env) for d in v.shape)
    if tuple(t.shape) != want:
        shown = ", ".join(f"{dim_str(d)}={w}" if not isinstance(d, int) else str(w) for d, w in zip(v.shape, want))
        raise ShapeError(f"{where} %{v.name}: expected shape [{shown}], got {tuple(t.shape)}")
    if not _dtype_ok(v.type, t):
        raise ShapeError(f"{where} %{v.name}: expected dtype {v.dtype}, got {t.dtype}")


def _dtype_ok(tt: TensorType, t: torch.Tensor) -> bool:
    if tt.dtype.packed == 2:
        return t.dtype in (torch.uint8, getattr(torch, "float4_e2m1fn_x2", torch.uint8))
    return t.dtype == tt.dtype.torch_dtype


def concrete_attrs(node: Node, env: dict[str, int]) -> dict:
    """Attributes with symbolic dims replaced by their values."""
    opdef = get_op(node.op)
    attrs = opdef.bind_attrs(node.attrs)
    for name, spec in opdef.attrs.items():
        v = attrs[name]
        if v is None:
            continue
        if spec.kind == "dim":
            attrs[name] = evaluate(v, env)
        elif spec.kind == "shape":
            attrs[name] = [evaluate(d, env) for d in v]
    return attrs


def run(
    g: Graph,
    inputs: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor] | None = None,
    *,
    check: bool = False,
) -> list[torch.Tensor]:
    """Execute the graph; returns its outputs in order."""
    params = params or {}
    env = bind_symbols(g, inputs)
    vals: dict[str, torch.Tensor] = {v.name: inputs[v.name] for v in g.inputs}
    for p in g.params:
        t = _lookup(params, p, "parameter")
        if check:
            _check_tensor(p, t, env, "parameter")
        vals[p.name] = t
    last_use = _last_uses(g)
    keep = {v.name for v in g.outputs}
    for i, node in enumerate(g.nodes):
        args = [None if v is None else vals[v.name] for v in node.inputs]
        try:
            outs = get_op(node.op).run(args, concrete_attrs(node, env))
        except (RuntimeError, ValueError, IndexError) as e:
            raise IRError(f"node {i} ({node.label}) failed: {e}") from e
        if len(outs) != len(node.outputs):
            raise IRError(f"node {i} ({node.label}): reference returned {len(outs)} outputs")
        for v, t in zip(node.outputs, outs):
            if check:
                _check_tensor(v, t, env, f"node {i} ({node.label}) output")
            vals[v.name] = t
        for v in node.inputs:
            if v is not None and last_use.get(v.name) == i and v.name not in keep and v.kind == "node":
                vals.pop(v.name, None)
    return [vals[v.name] for v in g.outputs]


def _last_uses(g: Graph) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, n in enumerate(g.nodes):
        for v in n.inputs:
            if v is not None:
                out[v.name] = i
    return out
