"""Shape specialisation: bind symbols (T, the tokens in the batch) to a bucket's value.

Every input, parameter and node output type and every dim/shape attribute gets the concrete value
(expressions such as (T+3)//4 become numbers), so later phases (kernel selection, memory planning) see
static shapes for that bucket. `bucket_graphs` makes the prefill and decode graphs from one symbolic graph.
Symbols not bound (e.g. the compressed-cache lengths C4, C8) stay symbolic.
"""

from __future__ import annotations

from deepinfer.errors import ConfigError
from deepinfer.ir.graph import Graph, TensorType, Value
from deepinfer.ir.registry import get_op
from deepinfer.ir.shapes import substitute
from deepinfer.passes.pattern import clone_graph
from deepinfer.passes.pipeline import register_pass


def _bind_value(v: Value, env: dict) -> None:
    v.type = TensorType(v.dtype, tuple(substitute(d, env) for d in v.shape))


def _bind_attrs(op: str, attrs: dict, env: dict) -> dict:
    spec = get_op(op).attrs
    out = dict(attrs)
    for k, v in attrs.items():
        kind = spec[k].kind if k in spec else None
        if kind == "dim" and v is not None:
            out[k] = substitute(v, env)
        elif kind == "shape" and v is not None:
            out[k] = [substitute(d, env) for d in v]
    return out


@register_pass("specialize_shapes")
def specialize_shapes(g: Graph, **bindings: int) -> Graph:
    """Bind symbols to values (``specialize_shapes(g, T=16)``); a bucket graph records them in meta['bucket']."""
    for name, value in bindings.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"specialize_shapes: {name} must be a positive integer, got {value!r}")
    env = dict(bindings)
    for v in [*g.inputs, *g.params]:
        _bind_value(v, env)
    for n in g.nodes:
        n.attrs = _bind_attrs(n.op, n.attrs, env)
        for o in n.outputs:
            _bind_value(o, env)
    g.meta["bucket"] = {**g.meta.get("bucket", {}), **bindings}
    return g


def bucket_graphs(g: Graph, buckets: dict[str, dict[str, int]]) -> dict[str, Graph]:
    """One specialised copy per bucket, e.g. ``{"prefill": {"T": 64}, "decode": {"T": 1}}``."""
    return {name: specialize_shapes(clone_graph(g), **b) for name, b in buckets.items()}
