"""Fusion: a V4.1 kv source's compressor with its index keys -> pair_compressor_keys / compressor_keys
(MODEL_SPEC §2.13).

Ratio 2 (pair pooling):

    pooled, entry_pos, entry_idx, state_kv', state_score' = pair_compressor(kv, score, state_kv, state_score, pos)
    latent = rmsnorm(pooled, norm)                  entry = rope(latent, entry_pos)
    keys   = rope(rmsnorm(linear(latent, wk), k_norm), entry_pos)
    ->  entry, keys, entry_idx, state_kv', state_score' = pair_compressor_keys(kv, score, ..., norm, wk, k_norm)

The pooled rows, the latent and the key projection stay on chip: pooled, latent and entry_pos are read only
inside the match (the latent by the wk GEMM and the entry RoPE, entry_pos by the two RoPEs), and both RoPEs
use one table. Ratio 1 (no pooling, one entry per token at its own position) is the same without the pair
compressor: latent = rmsnorm(kv, norm) with kv = x @ wkv^T, and both RoPEs at the token positions
-> entry, keys = compressor_keys(kv, positions, norm, wk, k_norm). The check also asks one eps for both norms.
The cache writes (scatter_rows) stay outside, and so do the QAT fake-quant points (``qat=True``), which sit
between the RoPEs and the writes.
"""

from __future__ import annotations

from deepinfer.ir.graph import Graph
from deepinfer.ir.ops import fused  # noqa: F401  (registers the fused ops)
from deepinfer.ir.ops.attention import ROPE_ATTRS
from deepinfer.passes.pattern import Absent, Any, Op, make_node
from deepinfer.passes.pipeline import register_pass
from deepinfer.passes.rewrite_patterns import find_pattern_matches, node_users


def _keys(pooled, entry_pos) -> Op:
    """The index-key RoPE over the chain from the latent; `pooled` is what the latent norm reads."""
    latent = Op("rmsnorm", pooled, Any("norm"), capture="latent")
    k = Op("linear", latent, Any("wk"), Absent(), capture="wk_gemm", single_use=True)
    k = Op("rmsnorm", k, Any("k_norm"), capture="k_norm_op", single_use=True)
    return Op("rope", k, entry_pos, attrs={"inverse": False}, capture="key_rope")


POOL_INPUTS = tuple(map(Any, ("kv", "score", "state_kv", "state_score", "pos")))
PATTERNS = [
    _keys(
        Op("pair_compressor", output=0, capture="pc", single_use=True),
        Op("pair_compressor", *POOL_INPUTS, output=1, capture="pc"),
    ),
    _keys(Any("kv"), Any("pos")),  # ratio 1
]


@register_pass("fuse_compressor")
def fuse_compressor(g: Graph) -> Graph:
    """[pair_compressor +] latent norm + entry RoPE + index-key GEMM/norm/RoPE -> [pair_]compressor_keys."""
    users, pos = node_users(g), {id(n): i for i, n in enumerate(g.nodes)}
    outputs = {v.name for v in g.outputs}
    entry_rope = {}

    def check(m) -> bool:
        pooled = "pc" in m.ops
        latent, entry_pos = m.node("latent").outputs[0], m.node("pc").outputs[1] if pooled else m["pos"]
        if m.node("latent").attrs["eps"] != m.node("k_norm_op").attrs["eps"]:
            return False
        others = [u for u in users[latent.name] if u is not m.node("wk_gemm")]
        if len(others) != 1 or others[0].op != "rope" or others[0].inputs != [latent, entry_pos]:
            return False
        rope, key_rope = others[0], m.root
        if any(rope.attrs[k] != key_rope.attrs[k] for k in (*ROPE_ATTRS, "inverse")):
            return False
        if latent.name in outputs or (pooled and (entry_pos.name in outputs or len(users[entry_pos.name]) != 2)):
            return False
        entry_rope[id(m.root)] = rope
        # The fused op sits at the key RoPE: nothing may read what it takes over before that.
        taken = [rope.outputs[0], *(m.node("pc").outputs[2:] if pooled else [])]
        return not any(pos[id(u)] < pos[id(m.root)] for v in taken for u in users.get(v.name, []))

    drop = set()
    for m in find_pattern_matches(g, PATTERNS, check, users):
        rope = entry_rope[id(m.root)]
        attrs = {"eps": m.node("latent").attrs["eps"], **{k: rope.attrs[k] for k in ROPE_ATTRS}}
        weights = [m["norm"], m["wk"], m["k_norm"]]
        if "pc" in m.ops:
            op, inputs = "pair_compressor_keys", [m["kv"], m["score"], m["state_kv"], m["state_score"], m["pos"]]
            reuse = [rope.outputs[0], m.root.outputs[0], *m.node("pc").outputs[2:]]
        else:
            op, inputs, reuse = "compressor_keys", [m["kv"], m["pos"]], [rope.outputs[0], m.root.outputs[0]]
        g.nodes[pos[id(m.root)]] = make_node(g, op, inputs + weights, attrs, reuse)
        drop |= {id(n) for n in [*m.nodes, rope] if n is not m.root}
    g.nodes = [n for n in g.nodes if id(n) not in drop]
    return g
