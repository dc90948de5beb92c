"""Fold the explicit Q/DQ pairs of phase 1 back into the ops that read them (GPU pipelines, after fusion).

    xq, xs = quant_fp8(x) {g}      x' = dequant_fp8(xq, xs) {g, f32}
    y = linear_fp8(x', W, s) {act_group 0}   ->  y = linear_fp8(x, W, s) {act_group g}
    z = other(x')                             ->  z = other(fake_quant_fp8(x) {g})
    (xq, xs = rmsnorm_quant_fp8(v, w) {eps, g}: the same with x = rmsnorm(v, w) {eps}, its reference's first half)

Both rewrites keep the reference numbers bit for bit: linear_fp8 with act_group g quantises x exactly as
quant_fp8 + dequant_fp8 do (fake_quant_fp8(x, g) first), and fake_quant_fp8 is that pair as one op. Why: the
Q/DQ form is phase 1's way to make the quantisation visible to the fusions, but at run time every pair is two
reference nodes (a dozen small launches, and an e8m0 round trip) in front of kernels that quantise their input
anyway -- fp8_gemm's adapter re-quantises x' per group, which reproduces xq exactly (power-of-two scales).
Only f32 pairs whose codes and scales have no other reader are touched; a pair a fused op produced (rmsnorm /
attention FP8 epilogues) has no quant_fp8 node and stays as it is.
"""

from __future__ import annotations

from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.ir.registry import get_op
from deepinfer.passes.dce import dce
from deepinfer.passes.pipeline import register_pass


def _qdq_source(x: Value, users: dict) -> tuple[Value | Node, int] | None:
    """(the unquantised value, group) when x = dequant_fp8(quant_fp8(v)) in f32 with private codes/scales; for
    x = dequant_fp8(rmsnorm_quant_fp8(v, w)) the rmsnorm_quant_fp8 node (its unquantised value is rmsnorm(v, w))."""
    d = x.producer
    if d is None or d.op != "dequant_fp8" or d.attrs["dtype"] != dt.f32:
        return None
    q = d.inputs[0].producer
    if q is None or q.op not in QUANTISERS or list(d.inputs) != list(q.outputs):
        return None
    if q.attrs["group"] != d.attrs["group"] or q.inputs[0].dtype != dt.f32:
        return None
    if any(len(users.get(o.name, [])) != 1 or o.name in users["__outputs__"] for o in q.outputs):
        return None
    return (q.inputs[0] if q.op == "quant_fp8" else q), q.attrs["group"]


QUANTISERS = ("quant_fp8", "rmsnorm_quant_fp8")  # rmsnorm_quant_fp8(v, w) = quant_fp8(rmsnorm(v, w)) (its reference)


def _rmsnorm(rq: Node) -> Node:
    """rmsnorm_quant_fp8's unquantised half: rmsnorm(x, w) {eps}, named after its codes."""
    attrs = get_op("rmsnorm").bind_attrs({"eps": rq.attrs["eps"]})
    node = Node("rmsnorm", list(rq.inputs), attrs)
    types = get_op("rmsnorm").infer([None if v is None else v.type for v in rq.inputs], attrs)
    node.outputs = [Value(f"{rq.outputs[0].name}.y", types[0], "node", node)]
    return node


def _fake_quant(v: Value, group: int, name: str) -> Node:
    attrs = get_op("fake_quant_fp8").bind_attrs({"group": group})
    node = Node("fake_quant_fp8", [v], attrs)
    node.outputs = [Value(name, get_op("fake_quant_fp8").infer([v.type], attrs)[0], "node", node)]
    return node


@register_pass("fold_qdq")
def fold_qdq(g: Graph) -> Graph:
    """linear_fp8(dequant(quant(x))) -> linear_fp8(x, act_group); other readers of a pair -> fake_quant_fp8."""
    users = {**g.users(), "__outputs__": {v.name for v in g.outputs}}  # a graph output is a reader too
    fq: dict[str, Value] = {}  # dequant output name -> its fake_quant_fp8 replacement
    norms: dict[str, Value] = {}  # rmsnorm_quant_fp8 codes name -> the rmsnorm replacing it
    nodes: list[Node] = []
    for n in g.nodes:
        for i, x in enumerate(n.inputs):
            src = _qdq_source(x, users) if x is not None else None
            if src is None:
                continue
            v, group = src
            if isinstance(v, Node):  # rmsnorm_quant_fp8: its rmsnorm, made once, where the fused node stood
                if v.outputs[0].name not in norms:
                    norm = _rmsnorm(v)
                    nodes.insert(next(j for j, m in enumerate(nodes) if m is v), norm)
                    norms[v.outputs[0].name] = norm.outputs[0]
                v = norms[v.outputs[0].name]
            if n.op == "linear_fp8" and i == 0 and not n.attrs.get("act_group"):
                n.inputs = [v, *n.inputs[1:]]
                n.attrs = {**n.attrs, "act_group": group}
                continue
            if x.name not in fq:  # placed right after the dequant it replaces (its input is defined there)
                node = _fake_quant(v, group, f"{x.name}.fq")
                fq[x.name] = node.outputs[0]
                at = next(j for j, m in enumerate(nodes) if m is x.producer) + 1
                nodes.insert(at, node)
            n.inputs = [*n.inputs[:i], fq[x.name], *n.inputs[i + 1 :]]
        nodes.append(n)
    g.nodes = nodes
    return dce(g)
