"""Batch invariance (phase 4): in that mode, no reduction's split or order may depend on the token count.

A request's numbers must not change with what it is batched with, so every node must use, in every shape
bucket, the same implementation and the same values of the config fields that fix its reductions (the
``reduce`` fields select_kernels records: split-K and block_k, threads per RMSNorm row, the attention's KV
chunk, a collective's algorithm, where "auto" means "picked per message size" and so fails). The check reads
``graph.meta["kernels"]`` and raises naming the first node that breaks this; it runs when
DEEPINFER_BATCH_INVARIANT=1 or ``enabled=True`` and is a no-op otherwise.

Not checked, and listed in ``meta["batch_invariance"]["unchecked"]``: torch_ref fallbacks (ATen/cuBLAS pick
their own algorithms per shape; invariance there needs torch's deterministic/batch-invariant settings).
"""

from __future__ import annotations

from deepinfer.errors import VerificationError
from deepinfer.ir.graph import Graph
from deepinfer.passes.pipeline import register_pass
from deepinfer.passes.select_kernels import batch_invariant_mode

BUCKET_DEPENDENT = ("auto",)  # a config value that means "chosen per shape at run time"


def node_problem(rec: dict) -> str | None:
    """Why one node's bindings are not batch-invariant (None when they are)."""
    per = rec["buckets"]
    names = list(per)
    families = {per[n]["family"] for n in names}
    if len(families) > 1:
        shown = ", ".join(f"{per[n]['family']} at {n}" for n in names)
        return f"uses different implementations per bucket ({shown})"
    first = per[names[0]]
    for field in first.get("reduce", []):
        values = {n: per[n]["config"][field] for n in names}
        if any(v in BUCKET_DEPENDENT for v in values.values()):
            return f"reduction field {field!r} is chosen at run time ({values})"
        if len(set(values.values())) > 1:
            shown = ", ".join(f"{v} at {n}" for n, v in values.items())
            return f"reduction field {field!r} depends on the bucket ({shown})"
    return None


@register_pass("check_batch_invariance")
def check_batch_invariance(g: Graph, *, enabled: bool | None = None) -> Graph:
    """Fail naming the node if, in batch-invariant mode, a reduction's split or order differs between buckets."""
    if not batch_invariant_mode(enabled):
        return g
    kernels = g.meta.get("kernels")
    if not kernels:
        raise VerificationError("check_batch_invariance: run select_kernels first (no graph.meta['kernels'])")
    labels = {n.outputs[0].name: n.label for n in g.nodes}
    unchecked = []
    for name, rec in kernels["nodes"].items():
        problem = node_problem(rec)
        if problem:
            raise VerificationError(f"batch invariance: node {labels.get(name, '%' + name)} {problem}")
        if any(b["family"] == "torch_ref" for b in rec["buckets"].values()):
            unchecked.append(name)
    g.meta["batch_invariance"] = {"buckets": list(kernels["buckets"]), "unchecked": len(unchecked)}
    return g
