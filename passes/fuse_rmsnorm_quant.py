"""Fusion: rmsnorm followed by per-token-group FP8 quantisation -> rmsnorm_quant_fp8.

The quantised activation is what an FP8 GEMM reads, so the fused kernel reads x once and writes codes and
scales once (codegen/kernels/rmsnorm_quant.py); the normalised tensor never reaches memory. That is only
allowed when nothing else reads it: the norm's output must be single-use.
"""

from __future__ import annotations

from deepinfer.ir.graph import Graph
from deepinfer.passes.pattern import Any, Op, rewrite_matches
from deepinfer.passes.pipeline import register_pass

# quant_fp8(rmsnorm(x, w?)) with the norm's output read only by the quant.
PATTERN = Op(
    "quant_fp8",
    Op("rmsnorm", Any("x"), Any("w", optional=True), capture="norm", single_use=True),
    capture="quant",
)


def check(m) -> bool:
    # The fused kernel quantises whole groups of the row it normalised: the row must split into groups.
    k = m["x"].shape[-1]
    return not isinstance(k, int) or k % m.node("quant").attrs["group"] == 0


def rewrite(m):
    attrs = {"eps": m.node("norm").attrs["eps"], "group": m.node("quant").attrs["group"]}
    return "rmsnorm_quant_fp8", [m["x"], m["w"]], attrs


@register_pass("fuse_rmsnorm_quant")
def fuse_rmsnorm_quant(g: Graph) -> Graph:
    """rmsnorm + quant_fp8 -> rmsnorm_quant_fp8."""
    rewrite_matches(g, PATTERN, rewrite, where=check)
    return g
