"""Quantisation (phase 1): per-token-group FP8 activation quantisation as explicit ops before FP8 GEMMs.

The real FP8 GEMMs (codegen/kernels/fp8_gemm.py, moe_grouped_gemm.py) read their activation A as E4M3 codes
with one ue8m0 scale per token per `group` input channels: 128 for V4, 32 for V4.1 (the weight block,
MODEL_SPEC §4.2). This pass writes that quantisation into the graph in quantise/dequantise (Q/DQ) form:

    y = linear_fp8(x, W, s) {block=b}
    ->  xq, xs = quant_fp8(x) {group=b}      x' = dequant_fp8(xq, xs) {group=b}      y = linear_fp8(x', W, s)

A `dequant_fp8` feeding a GEMM is the GEMM's FP8 A operand: kernel selection reads the pair as one FP8 GEMM
(as ONNX runtimes read DequantizeLinear -> MatMul). Q/DQ keeps every GEMM op what it was, so the fusions
after this phase match with quantisation on or off, and a `quant_fp8` is what `fuse_rmsnorm_quant` (and the
attention output quant of `fuse_attention`) absorb. One quant serves every FP8 GEMM that reads the same value
with the same group (wq_a and wkv read one normalised x).

GEMMs covered: `linear_fp8` (group = its block), `linear_fp8`/`linear_fp4` with `act_group` set,
`grouped_linear` with an FP8 weight (wo_a; its K must split into groups) and `moe_experts` with FP4/FP8
experts (the routed experts' input; the quantisation of the experts' SwiGLU output, inside the op, is not
modelled). A GEMM that already
quantises implicitly (`act_group > 0`) is always made explicit (same numbers); the others only with
``enabled=True``. Off (the default) the graph stays exact fp32; on, it computes the quantised reference:
bit-identical to `linear_fp8` with `act_group = block`.
"""

from __future__ import annotations

from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.ir.registry import get_op
from deepinfer.passes.pipeline import register_pass


def _group(n: Node, enabled: bool) -> int:
    """The activation group this GEMM node should read its input with (0: leave it as it is)."""
    op, a = n.op, n.attrs
    if a.get("act_group", 0):  # linear_fp8 / linear_fp4 quantising implicitly
        return a["act_group"]
    if op == "linear_fp8":
        return a["block"] if enabled else 0
    if not enabled:
        return 0
    if op == "grouped_linear" and n.inputs[2] is not None:
        return a["block"]
    if op == "moe_experts" and a["fmt"] in ("fp4", "fp8"):
        return a["block"]
    return 0


def _fit(x: Value, group: int) -> int:
    """The group as the row allows: a row shorter than the group is one group (as a kernel's partial tile
    reads it; the tiny configs' rows are shorter than V4's 128); a row that does not split: 0 (skipped)."""
    k = x.shape[-1]
    if not isinstance(k, int) or k % group == 0:
        return group
    return k if k < group else 0


def _is_fp8(x: Value, group: int) -> bool:
    """x is already the dequantised FP8 version of a value, with this group."""
    p = x.producer
    return p is not None and p.op == "dequant_fp8" and p.attrs["group"] == group


def _node(op: str, inputs: list[Value], attrs: dict, names: list[str]) -> Node:
    opdef = get_op(op)
    attrs = opdef.bind_attrs(attrs)
    node = Node(op, inputs, attrs)
    types = opdef.infer([v.type for v in inputs], attrs)
    node.outputs = [Value(name, t, "node", node) for name, t in zip(names, types)]
    return node


@register_pass("quantize_activations")
def quantize_activations(g: Graph, enabled: bool = False) -> Graph:
    """Explicit per-token-group FP8 activation quantisation (quant_fp8 + dequant_fp8) before FP8 GEMMs."""
    taken = set(g.values())

    def name(hint: str) -> str:
        out, i = hint, 1
        while out in taken:
            out, i = f"{hint}_{i}", i + 1
        taken.add(out)
        return out

    made: dict[tuple[str, int], Value] = {}  # (value, group) -> its dequantised FP8 version
    nodes: list[Node] = []
    for n in g.nodes:
        x = n.inputs[0] if n.inputs else None
        group = _fit(x, _group(n, enabled)) if x is not None and _group(n, enabled) else 0
        if group and not _is_fp8(x, group):  # (an FP8 x: the pass ran before; it is idempotent)
            key = (x.name, group)
            if key not in made:
                q = _node("quant_fp8", [x], {"group": group}, [name(f"{x.name}.q"), name(f"{x.name}.qs")])
                dq = _node("dequant_fp8", q.outputs, {"group": group, "dtype": x.dtype}, [name(f"{x.name}.dq")])
                nodes += [q, dq]
                made[key] = dq.outputs[0]
            n.inputs = [made[key], *n.inputs[1:]]
        if group and "act_group" in n.attrs:
            n.attrs = {**n.attrs, "act_group": 0}
        nodes.append(n)
    g.nodes = nodes
    return g
