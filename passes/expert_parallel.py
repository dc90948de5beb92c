"""Expert parallel (phase 3): each rank keeps only its routed experts; collectives give the full MoE output.

Tokens replicated over the ranks (attention replicated, DP=1):

    y = moe_experts(x, w, idx, *all experts)
    ->  part = moe_experts_local(x, w, idx, *this rank's slots)      y = all_reduce(part)

Tokens distinct per rank (attention data or context parallel; every rank runs the same bucket T):

    ->  xg, wg, ig = all_gather(x), all_gather(w), all_gather(idx)  # [R*T, ...]: every rank's tokens
        part = moe_experts_local(xg, wg, ig, *this rank's slots)    y = reduce_scatter(part)  # back to [T, D]

(the all-gather/reduce-scatter form of the dispatch/combine all-to-all: static shapes at the price of
moving every token to every rank; a variable-count all-to-all needs data-dependent shapes the IR lacks).
Where the slots come from: experts split contiguously, or EPLB (passes/eplb.py) from a load histogram, with
redundant replicas. The rank's graph names only its own expert parameters (the loader reads just those).
"""

from __future__ import annotations

from deepinfer.errors import ConfigError
from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.ir.ops.moe import EXPERT_FORMATS
from deepinfer.passes.emit import Emitter
from deepinfer.passes.eplb import Placement, contiguous_placement, eplb_placement
from deepinfer.passes.pipeline import register_pass

TOKEN_MODES = ("replicated", "distinct")
MOE_OPS = {"moe_experts": 3, "moe_grouped_experts": 9}  # op -> index of its first expert tensor


def layer_key(node: Node) -> str:
    """The MoE layer a MoE node belongs to: its first expert tensor's prefix (``layers.3.ffn``)."""
    return node.inputs[MOE_OPS[node.op]].name.split(".experts.")[0]


def _layer_load(eplb: dict, key: str, n_experts: int) -> list[float]:
    load = eplb.get("load")
    if isinstance(load, dict):  # one histogram per layer, or "*" for the rest
        load = load.get(key, load.get("*"))
    if not isinstance(load, list | tuple) or len(load) != n_experts:
        raise ConfigError(f"expert_parallel: eplb needs a load list of {n_experts} experts for {key}")
    return [float(x) for x in load]


def placement_for(node: Node, world: int, eplb: dict | None) -> Placement:
    n = node.attrs["n_experts"]
    if not eplb:
        return contiguous_placement(n, world)
    return eplb_placement(_layer_load(eplb, layer_key(node), n), world, int(eplb.get("n_redundant", 0)))


def _shard(em: Emitter, node: Node, p: Placement, rank: int, world: int, tokens: str) -> list[Node]:
    """The nodes replacing one MoE node on ``rank``; the last takes over its output."""
    per = EXPERT_FORMATS[node.attrs["fmt"]]
    x, w, idx = node.inputs[:3]
    experts = node.inputs[MOE_OPS[node.op] :]
    tensors = [t for e, _ in p.slots[rank] for t in experts[per * e : per * (e + 1)]]
    new: list[Node] = []

    def add(op: str, inputs: list, attrs: dict, reuse=()) -> Value:
        new.append(em.node(op, inputs, attrs, node.outputs[0].name, reuse))
        return new[-1].outputs[0]

    xs = [add("all_gather", [v], {"world": world}) for v in (x, w, idx)] if tokens == "distinct" else [x, w, idx]
    attrs = {k: node.attrs[k] for k in ("n_experts", "fmt", "swiglu_limit", "block")}
    attrs.update(
        slot_expert=[e for e, _ in p.slots[rank]], slot_replica=[j for _, j in p.slots[rank]], replicas=list(p.replicas)
    )
    part = add("moe_experts_local", [*xs, *tensors], attrs)
    combine = "all_reduce" if tokens == "replicated" else "reduce_scatter"
    shared = node.op == "moe_grouped_experts" and node.inputs[3] is not None
    routed = add(combine, [part], {"world": world}, reuse=() if shared else node.outputs)
    if shared:  # the shared expert runs once per token, on the rank holding the token, after the combine
        add("add", [routed, _shared_expert(node, add)], {}, reuse=node.outputs)
    return new


def _shared_expert(node: Node, add) -> Value:
    """moe_grouped_experts's shared expert as the ops it fused (same order, so the same numbers)."""
    x, (sw1, sw3, sw2, ss1, ss3, ss2), a = node.inputs[0], node.inputs[3:9], node.attrs
    h = add("swiglu_gate_up", [x, sw1, sw3, ss1, ss3], {"limit": a["shared_limit"], "block": a["shared_block"]})
    if a["shared_mid_group"]:
        codes = add("quant_fp8", [h], {"group": a["shared_mid_group"]})
        scales = codes.producer.outputs[1]
        h = add("dequant_fp8", [codes, scales], {"group": a["shared_mid_group"], "dtype": h.dtype})
    if ss2 is None:
        return add("linear", [h, sw2], {})
    return add("linear_fp8", [h, sw2, ss2], {"block": a["shared_block"]})


def prune_params(g: Graph) -> None:
    """Keep only the parameters some node reads (a rank's graph names only the weights it loads)."""
    used = {v.name for n in g.nodes for v in n.inputs if v is not None} | {v.name for v in g.outputs}
    g.params = [p for p in g.params if p.name in used]


@register_pass("expert_parallel")
def expert_parallel(g: Graph, *, world: int, rank: int, tokens: str = "replicated", eplb: dict | None = None) -> Graph:
    """Shard every moe_experts over ``world`` ranks and keep ``rank``'s part (EPLB placement if ``eplb``)."""
    if tokens not in TOKEN_MODES:
        raise ConfigError(f"expert_parallel: tokens must be one of {TOKEN_MODES}, got {tokens!r}")
    if not 0 <= rank < world:
        raise ConfigError(f"expert_parallel: rank {rank} not in 0..{world - 1}")
    em, nodes = Emitter(g), []
    plan: dict[str, dict] = {}
    for node in g.nodes:
        if node.op not in MOE_OPS:
            nodes.append(node)
            continue
        p = placement_for(node, world, eplb)
        plan[layer_key(node)] = p.to_json()
        nodes += _shard(em, node, p, rank, world, tokens)
    g.nodes = nodes
    prune_params(g)
    g.meta.setdefault("parallel", {})["experts"] = plan
    return g
