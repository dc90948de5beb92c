"""Graph, Node and Value: the SSA IR every stage of deepinfer reads and writes.

A Graph is a function of its inputs (tokens, positions, cache state) and parameters (named exactly like
checkpoint tensors) to its outputs. Nodes are kept in topological order; every Value is defined once (by a
graph input, a parameter, or one node output). Stateful ops (cache writes) are ordinary nodes whose op is
registered as stateful: they return the new version of the state, so the graph stays a pure function and
the runtime may perform the write in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.ir.dtypes import DType
from deepinfer.ir.shapes import Dim, Shape, as_shape, shape_str


@dataclass(frozen=True)
class TensorType:
    dtype: DType
    shape: Shape

    def __post_init__(self):
        # Accept "T//4"-style strings and lists; store a normalised tuple so types compare by value.
        object.__setattr__(self, "shape", as_shape(self.shape))

    def __str__(self) -> str:
        return f"{self.dtype.name}{shape_str(self.shape)}"

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_shape(self, shape) -> TensorType:
        return TensorType(self.dtype, tuple(shape))

    def with_dtype(self, dtype: DType) -> TensorType:
        return TensorType(dtype, self.shape)


class Value:
    """An SSA value. ``kind`` is ``input``, ``param`` or ``node`` (a node output)."""

    __slots__ = ("name", "type", "kind", "producer")

    def __init__(self, name: str, type: TensorType, kind: str = "node", producer: Node | None = None):
        self.name = name
        self.type = type
        self.kind = kind
        self.producer = producer

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    @property
    def shape(self) -> Shape:
        return self.type.shape

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass
class Node:
    op: str
    inputs: list[Value | None]
    attrs: dict[str, Any]
    outputs: list[Value] = field(default_factory=list)

    def __repr__(self) -> str:
        outs = ", ".join(f"%{o.name}" for o in self.outputs)
        return f"<{outs} = {self.op}>"

    @property
    def label(self) -> str:
        """How error messages name this node: its op and first output."""
        first = f"%{self.outputs[0].name}" if self.outputs else "(no outputs)"
        return f"{first} = {self.op}"


@dataclass
class Graph:
    name: str
    inputs: list[Value] = field(default_factory=list)
    params: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    # -- lookup --------------------------------------------------------------------------------------
    def values(self) -> dict[str, Value]:
        vals = {v.name: v for v in self.inputs}
        vals.update({v.name: v for v in self.params})
        for n in self.nodes:
            for o in n.outputs:
                vals[o.name] = o
        return vals

    def param(self, name: str) -> Value:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def users(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i is not None:
                    out.setdefault(i.name, []).append(n)
        return out

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def symbols(self) -> set[str]:
        out: set[str] = set()
        for v in self.inputs:
            for d in v.shape:
                if not isinstance(d, int):
                    out |= d.free_symbols
        return out

    def __str__(self) -> str:
        from deepinfer.ir.printer import print_graph

        return print_graph(self)

    # -- structural equality (used by round-trip tests) ----------------------------------------------
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Graph) and structure(self) == structure(other)

    __hash__ = None  # mutable


def _vsig(v: Value | None) -> tuple | None:
    return None if v is None else (v.name, v.type.dtype.name, tuple(map(_dsig, v.type.shape)))


def _dsig(d: Dim) -> str:
    from deepinfer.ir.shapes import dim_str

    return dim_str(d)


def _asig(a: Any) -> Any:
    if isinstance(a, list | tuple):
        return ("list", tuple(_asig(x) for x in a))
    if isinstance(a, DType):
        return ("dtype", a.name)
    if isinstance(a, float):
        return ("float", "nan" if a != a else a)  # nan != nan, but two nan attributes are the same graph
    if isinstance(a, bool):
        return ("bool", a)
    if isinstance(a, int):
        return ("int", a)
    if a is not None and not isinstance(a, str):
        return ("dim", _dsig(a))
    return a


def structure(g: Graph) -> tuple:
    """A hashable description of everything that makes two graphs the same."""
    nodes = tuple(
        (
            n.op,
            tuple(_vsig(i) for i in n.inputs),
            tuple(sorted((k, _asig(v)) for k, v in n.attrs.items())),
            tuple(_vsig(o) for o in n.outputs),
        )
        for n in g.nodes
    )
    return (
        g.name,
        tuple(map(_vsig, g.inputs)),
        tuple(map(_vsig, g.params)),
        nodes,
        tuple(map(_vsig, g.outputs)),
        tuple(sorted((k, repr(v)) for k, v in g.meta.items())),
    )
