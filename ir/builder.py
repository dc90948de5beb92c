"""The builder API model code uses to write graphs.

    b = GraphBuilder("mlp")
    x = b.input("x", "bf16", ["T", 64])
    w = b.param("layers.0.w1.weight", "bf16", [128, 64])
    y = b.silu(b.linear(x, w))
    b.output(y)
    g = b.build()

Every registered op is a method (``b.rmsnorm(x, w, eps=1e-6)``) or reachable through ``b.op(name, ...)``.
Types and shapes are inferred as nodes are added, so a mismatch fails here, at build time, with both
shapes and the node in the message.
"""

from __future__ import annotations

from deepinfer.errors import IRError, ShapeError
from deepinfer.ir.dtypes import DType, dtype
from deepinfer.ir.graph import Graph, Node, TensorType, Value
from deepinfer.ir.registry import get_op, has_op
from deepinfer.ir.shapes import as_shape


class GraphBuilder:
    def __init__(self, name: str, meta: dict | None = None):
        self.graph = Graph(name, meta=dict(meta or {}))
        self._taken: set[str] = set()
        self._counter = 0
        self._scope: list[str] = []

    # -- naming --------------------------------------------------------------------------------------
    def scope(self, prefix: str):
        """Context manager: values created inside get names like ``layers.3.attn.12``."""
        builder = self

        class _Scope:
            def __enter__(self):
                builder._scope.append(prefix)

            def __exit__(self, *exc):
                builder._scope.pop()

        return _Scope()

    def _fresh(self, hint: str | None) -> str:
        prefix = ".".join(self._scope)
        if hint is None:
            while True:
                name = f"{prefix}.{self._counter}" if prefix else str(self._counter)
                self._counter += 1
                if name not in self._taken:
                    break
        else:
            base = f"{prefix}.{hint}" if prefix else hint
            name, i = base, 1
            while name in self._taken:
                name, i = f"{base}_{i}", i + 1
        self._taken.add(name)
        return name

    def _claim(self, name: str) -> str:
        if name in self._taken:
            raise IRError(f"value name %{name} is already defined")
        self._taken.add(name)
        return name

    # -- graph interface -----------------------------------------------------------------------------
    def input(self, name: str, dt: str | DType, shape) -> Value:
        v = Value(self._claim(name), TensorType(dtype(dt), as_shape(shape)), "input")
        self.graph.inputs.append(v)
        return v

    def param(self, name: str, dt: str | DType, shape) -> Value:
        """A weight, named exactly like its checkpoint tensor."""
        v = Value(self._claim(name), TensorType(dtype(dt), as_shape(shape)), "param")
        self.graph.params.append(v)
        return v

    def op(self, opname: str, *inputs: Value | None, name: str | None = None, **attrs):
        """Add one node; returns its output Value, or a tuple for multi-output ops."""
        opdef = get_op(opname)
        for v in inputs:
            if v is not None and not isinstance(v, Value):
                raise IRError(f"{opname}: inputs must be Values, got {type(v).__name__}")
        try:
            args = opdef.bind_inputs(list(inputs))
            attrs = opdef.bind_attrs(attrs)
            out_types = opdef.infer([None if a is None else a.type for a in args], attrs)
        except ShapeError as e:
            raise ShapeError(f"building {opname} node {len(self.graph.nodes)}: {e}") from None
        except IRError as e:
            raise IRError(f"building {opname} node {len(self.graph.nodes)}: {e}") from None
        node = Node(opname, args, attrs)
        many = len(out_types) > 1
        for i, t in enumerate(out_types):
            hint = None if name is None else (f"{name}.{i}" if many else name)
            node.outputs.append(Value(self._fresh(hint), t, "node", node))
        self.graph.nodes.append(node)
        return tuple(node.outputs) if many else node.outputs[0]

    def output(self, *values: Value) -> None:
        self.graph.outputs.extend(values)

    def build(self, verify: bool = True) -> Graph:
        if verify:
            from deepinfer.ir.verifier import verify as run_verify

            run_verify(self.graph)
        return self.graph

    def __getattr__(self, opname: str):
        if opname.startswith("_") or not has_op(opname):
            raise AttributeError(opname)

        def call(*inputs, **attrs):
            return self.op(opname, *inputs, **attrs)

        call.__name__ = opname
        return call
