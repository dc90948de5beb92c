"""The verifier: checks a graph is well formed and says which node is wrong and how.

Checks, in order: names are defined once (SSA); every input is defined before its use; ops are known;
inputs and attributes fit the op's schema; declared output types equal the inferred ones; outputs exist;
and a state that a stateful op has overwritten is not read again (so the write can happen in place).
"""

from __future__ import annotations

from deepinfer.errors import IRError, VerificationError
from deepinfer.ir.graph import Graph, Node
from deepinfer.ir.registry import get_op


def _where(i: int, node: Node) -> str:
    return f"node {i} ({node.label})"


def verify(g: Graph) -> None:
    """Raise VerificationError on the first problem found; return None for a good graph."""
    errors = check(g, first_only=True)
    if errors:
        raise VerificationError(f"graph {g.name!r}: {errors[0]}")


def check(g: Graph, first_only: bool = False) -> list[str]:
    """Every problem found, one line each (empty list: the graph is good)."""
    errs: list[str] = []

    def fail(msg: str) -> bool:
        errs.append(msg)
        return first_only

    defined: dict[str, str] = {}
    for kind, vals in (("input", g.inputs), ("param", g.params)):
        for v in vals:
            if v.name in defined:
                if fail(f"{kind} %{v.name} is defined twice"):
                    return errs
            defined[v.name] = kind

    overwritten: dict[str, str] = {}  # state value name -> the node that replaced it
    for i, node in enumerate(g.nodes):
        if not node.outputs:
            if fail(f"{_where(i, node)}: has no outputs"):
                return errs
        for v in node.inputs:
            if v is None:
                continue
            if v.name not in defined:
                if fail(f"{_where(i, node)}: uses %{v.name} before it is defined"):
                    return errs
            elif v.name in overwritten:
                msg = f"{_where(i, node)}: reads state %{v.name} after {overwritten[v.name]} overwrote it"
                if fail(msg):
                    return errs
        problem = _check_node(node)
        if problem and fail(f"{_where(i, node)}: {problem}"):
            return errs
        for o in node.outputs:
            if o.name in defined:
                if fail(f"{_where(i, node)}: redefines %{o.name} (already a {defined[o.name]})"):
                    return errs
            defined[o.name] = "node output"
        _mark_overwritten(node, overwritten, i)

    if not g.outputs and fail("graph has no outputs"):
        return errs
    for v in g.outputs:
        if v.name not in defined:
            if fail(f"output %{v.name} is not defined"):
                return errs
        elif v.name in overwritten:
            if fail(f"output %{v.name} is a state that {overwritten[v.name]} overwrote"):
                return errs
    return errs


def _check_node(node: Node) -> str | None:
    try:
        opdef = get_op(node.op)
    except IRError as e:
        return str(e)
    try:
        args = opdef.bind_inputs(list(node.inputs))
        attrs = opdef.bind_attrs(node.attrs)
        inferred = opdef.infer([None if a is None else a.type for a in args], attrs)
    except IRError as e:
        return str(e)
    if len(inferred) != len(node.outputs):
        return f"{node.op} gives {len(inferred)} outputs, node declares {len(node.outputs)}"
    for k, (want, out) in enumerate(zip(inferred, node.outputs)):
        if want != out.type:
            return f"output {k} %{out.name} is declared {out.type} but {node.op} gives {want}"
    return None


def _mark_overwritten(node: Node, overwritten: dict[str, str], i: int) -> None:
    try:
        opdef = get_op(node.op)
    except IRError:
        return
    if opdef.stateful:
        for _out, inp in opdef.writes.items():
            v = node.inputs[inp] if inp < len(node.inputs) else None
            if v is not None:
                overwritten[v.name] = _where(i, node)
