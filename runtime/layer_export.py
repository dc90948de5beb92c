"""One segment (layer) of a graph exported as a straight-line Python function of its nodes' torch references.

    fn = export_segment(segment, graph, env)      # segment: runtime/layer_graphs.split_segments
    outs = fn(inputs, params)                     # lists in fn.inputs / fn.params order -> fn.outputs
    print(fn.source)

Each node becomes one line: its reference called with its attributes bound (concrete at the call's shapes),
values in local variables, each deleted after its last use (the executor's memory behaviour):

    def layer_l3(X, P):
        v0, = _seq(_r0(X[0], P[0], **_k0))       # rmsnorm
        v1, v2 = _seq(_r1(v0, **_k1))            # quant_fp8
        del v0
        ...
        return [v7, v9]

Why: torch.compile of the executor traces its ~1,000-node Python loop (dict lookups, adapters, counters) and
gives up; a straight-line function per layer is what dynamo traces well (graph breaks only where a reference
reads device values on the host), so it is the torch.compile baseline of the same graph, and run without
compiling it is the eager baseline without the executor's per-node overhead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.ir.interpreter import concrete_attrs
from deepinfer.ir.registry import get_op


@dataclass
class StraightLine:
    name: str
    source: str
    fn: Callable  # fn(X, P) -> list of outputs
    inputs: list[str]
    params: list[str]
    outputs: list[str]

    def __call__(self, inputs: list, params: list) -> list:
        return self.fn(inputs, params)

    def arguments(self, values: dict, params: dict) -> tuple[list, list]:
        """(X, P) for this function from value and parameter dicts."""
        return [values[n] for n in self.inputs], [params[n] for n in self.params]


def _seq(out):
    return out if isinstance(out, tuple | list) else (out,)


def export_segment(segment, graph, env: dict, wrap: Callable | None = None) -> StraightLine:
    """The straight-line function of ``segment`` at the shapes ``env`` binds (bind_symbols of the call's
    feeds). ``wrap(op, reference)`` may replace a reference (e.g. torch.compiler.disable around one)."""
    name = "layer_" + "".join(c if c.isalnum() else "_" for c in segment.name)
    where = {n: f"X[{i}]" for i, n in enumerate(segment.inputs)}
    where.update({n: f"P[{i}]" for i, n in enumerate(segment.params)})
    scope: dict = {"_seq": _seq}
    lines = [f"def {name}(X, P):"]
    local = 0
    for k, step in enumerate(segment.steps):
        node = step.node
        ref = get_op(node.op).reference_fn
        scope[f"_r{k}"] = wrap(node.op, ref) if wrap else ref
        scope[f"_k{k}"] = concrete_attrs(node, env)
        args = ", ".join("None" if n is None else where[n] for n in step.inputs)
        outs = []
        for o in step.outputs:
            where[o] = f"v{local}"
            outs.append(where[o])
            local += 1
        lines.append(f"    {', '.join(outs)}, = _seq(_r{k}({args}, **_k{k}))  # {node.op} {step.outputs[0]}")
        dead = [where[n] for n in step.free if where.get(n, "").startswith("v")]
        if dead:
            lines.append(f"    del {', '.join(dead)}")
    lines.append(f"    return [{', '.join(where[n] for n in segment.outputs)}]")
    source = "\n".join(lines) + "\n"
    code = compile(source, f"<deepinfer straight-line {segment.name}>", "exec")
    exec(code, scope)  # noqa: S102 -- our own generated source: one call per node, no user input
    return StraightLine(segment.name, source, scope[name], list(segment.inputs), list(segment.params),
                        list(segment.outputs))  # fmt: skip
