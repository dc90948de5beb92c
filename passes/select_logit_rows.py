"""select_logit_rows: compute the logits only for the rows a caller asks for (the sampled ones).

A model graph's head (hc_head / hc_collapse, the final RMSNorm, the LM head) runs on every row it is given,
but an engine samples one row per prefill (the prompt's last) and nothing at all from a chunk that does not
end the prompt. At a real V4.1 prefill of 8192 tokens the full head is a [8192, 129280] f32 tensor (4 GB)
and tens of milliseconds; the last row alone is one GEMV.

The rewrite adds one graph input and one gather in front of the head:

    inputs   ... logit_rows i64[L]    rows of the logits the graph returned before (T of them; compact V4.1:
                                      the last min(T, keep_tokens)), any order, repeats allowed, L may be 0
    head     every row-indexed input of the head's entry node (hc_head: the streams; hc_collapse: the streams
             and the pre-mix weights) goes through index_select(axis 0, logit_rows) first; every node from the
             entry to the logits keeps its name and op, its row dim becomes L
    outputs  logits f32[L, vocab]; the caches and any other output (the final streams for MTP) unchanged

Every node of the head is row-wise, so what holds (tests/runtime/test_logit_rows.py, V4 and V4.1):
- the head's input rows are bit-identical: row i of every gathered input is row logit_rows[i] of the old one;
- row i of the new logits equals row logit_rows[i] of the old ones up to GEMM summation order only: the head's
  GEMMs (the hc mixes, the LM head) at M=L may sum in another order than at M=T (CPU and cuBLAS alike; ~2e-6 on
  logits of ~5 seen), so they are bit-equal to the same head ops run by hand on the gathered rows, not to the
  full head's rows;
- the sampled tokens are the same (same argmax; the tests check it).

Why a rewrite rather than a model-builder option: compiled plans (on disk too) and the tests, benchmarks and
passes that feed model graphs by name keep their interface; the runtime applies this to the plan graph it runs
(as it applies batch_decode), so the head's kernel bindings, looked up by node name, still apply.

The head is found structurally: from the logits output back along each node's first input to a node whose op is
in HEAD_ENTRY_OPS. A fusion that swallows that op must add its fused op there (the tests compile the tiny cpu and
sm90 plans and fail if the head is not found).
"""

from __future__ import annotations

import torch

from deepinfer.errors import DeepInferError, IRError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import Graph, Node, TensorType, Value
from deepinfer.ir.registry import get_op
from deepinfer.ir.shapes import evaluate, parse_dim, sym
from deepinfer.ir.verifier import verify
from deepinfer.passes.pattern import clone_graph, fresh_name
from deepinfer.passes.pipeline import register_pass

ROWS_INPUT = "logit_rows"
ROWS_SYMBOL = "L"
HEAD_ENTRY_OPS = ("hc_head", "hc_collapse")  # the op that starts the per-row tail (V4, V4.1)


def has_logit_rows(g: Graph) -> bool:
    return any(v.name == ROWS_INPUT for v in g.inputs)


@register_pass("select_logit_rows")
def select_logit_rows(g: Graph) -> Graph:
    """``g`` with a ``logit_rows`` input selecting the head's rows (a new graph; ``g`` is untouched). See the
    module doc. A graph that already has the input is returned as it is."""
    if has_logit_rows(g):
        return g
    out = clone_graph(g)
    entry = head_entry(out)
    rows = Value(ROWS_INPUT, TensorType(dt.i64, (sym(ROWS_SYMBOL),)), "input")
    out.inputs.append(rows)
    gathers = _gather_row_inputs(out, entry, rows)
    at = next(i for i, n in enumerate(out.nodes) if n is entry)
    out.nodes[at:at] = gathers
    _reinfer_downstream(out.nodes[at + len(gathers) :], {v.name for n in gathers for v in n.outputs})
    out.meta["logit_rows"] = {"input": ROWS_INPUT, "head_rows": str(g.outputs[0].shape[0])}
    verify(out)
    return out


def rows_graph(g: Graph) -> tuple[Graph, str | None]:
    """For a runtime: (g with logit_rows, None), or (g, why not) where the head is not found."""
    try:
        return select_logit_rows(g), None
    except IRError as e:
        return g, str(e)


def head_rows(g: Graph, t: int) -> int:
    """The rows of the unselected logits for a call of t tokens (T; compact V4.1: min(T, keep_tokens))."""
    return evaluate(parse_dim(g.meta["logit_rows"]["head_rows"]), {"T": t})


def row_indices(g: Graph, t: int, rows=None) -> torch.Tensor:
    """The logit_rows feed (on the host) for a call of t tokens: ``rows`` (ints, negative from the end) or, by
    default, every row."""
    n = head_rows(g, t)
    if rows is None:
        return torch.arange(n)
    idx = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
    if idx.numel() and not bool(((idx >= -n) & (idx < n)).all()):
        raise DeepInferError(f"logit_rows {idx.tolist()}: the call has {n} logits rows")
    return idx % n


def rows_feed(g: Graph, t: int, rows=None, why_not: str | None = None) -> dict[str, torch.Tensor]:
    """A runner's logit_rows feed (on the host) for a call of t tokens: {logit_rows: row_indices(...)} where g has
    the input, {} where it has not and every row is asked for; asking for rows of a graph without the input is an
    error naming why it has none (rows_graph's reason)."""
    if has_logit_rows(g):
        return {ROWS_INPUT: row_indices(g, t, rows)}
    if rows is not None:
        raise DeepInferError(f"this runner computes every logits row: {why_not}")
    return {}


def head_entry(g: Graph) -> Node:
    """The node that starts the head: from the producer of outputs[0] (named "logits", as the models name it)
    back along first inputs to the first node whose op is in HEAD_ENTRY_OPS."""
    v = g.outputs[0]
    if v.name != "logits":  # e.g. the DSpark draft block, whose every row is a draft (its first output: hidden)
        raise IRError(f"select_logit_rows: the first output is %{v.name}, not the logits")
    seen: list[str] = []
    while v is not None and v.producer is not None:
        if v.producer.op in HEAD_ENTRY_OPS:
            return v.producer
        seen.append(v.producer.op)
        v = v.producer.inputs[0]
    ops = " <- ".join(seen)
    raise IRError(f"select_logit_rows: no {'/'.join(HEAD_ENTRY_OPS)} node before the logits ({ops})")


def _gather_row_inputs(g: Graph, entry: Node, rows: Value) -> list[Node]:
    """index_select nodes for the entry's inputs that have one row per token (node values, not parameters,
    with the first input's row dim); the entry reads the gathered rows instead."""
    n_rows = entry.inputs[0].shape[0]
    taken = set(g.values())
    nodes = []
    for k, v in enumerate(entry.inputs):
        if v is None or v.kind == "param" or not v.shape or v.shape[0] != n_rows:
            continue
        node = Node("index_select", [v, rows], {"axis": 0})
        name = fresh_name(g, f"{v.name}.{ROWS_INPUT}", taken)
        taken.add(name)
        node.outputs = [Value(name, v.type, "node", node)]
        _reinfer(node)
        entry.inputs[k] = node.outputs[0]
        nodes.append(node)
    return nodes


def _reinfer_downstream(nodes: list[Node], changed: set[str]) -> None:
    """Re-type, in order, every node reading a value whose row dim became L (the head; nothing else reads it)."""
    for node in nodes:
        if any(v is not None and v.name in changed for v in node.inputs):
            _reinfer(node)
            changed.update(v.name for v in node.outputs)


def _reinfer(node: Node) -> None:
    """Output types from the op and the (now L-row) input types; names kept."""
    opdef = get_op(node.op)
    types = opdef.infer([None if v is None else v.type for v in opdef.bind_inputs(list(node.inputs))],
                        opdef.bind_attrs(node.attrs))  # fmt: skip
    for v, ty in zip(node.outputs, types):
        v.type = ty
