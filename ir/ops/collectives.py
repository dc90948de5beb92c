"""Collectives and the other ops the parallel layout (phase 3) writes into per-rank graphs.

A collective is an ordinary op: its schema says what shape comes out on every rank, its reference runs the
torch.distributed collective when a process group is initialised (gloo on CPU, NCCL on GPU). Without a
process group the reference is the single-process case, which exists only for ``world == 1``: the identity
(all_reduce, reduce_scatter, all_to_all) or a concatenation of one part (all_gather). Any other ``world``
without a process group is an error, not a silent identity. Groups are the whole world (every layout the
passes build today communicates over all ranks).

- ``all_reduce(x)``: the sum over ranks. Gloo and NCCL give every rank the same bits, so a value made
  replicated by an all_reduce stays bitwise replicated.
- ``all_gather(x)``: the ranks' tensors concatenated along ``axis`` in rank order.
- ``reduce_scatter(x)``: the sum over ranks, then rank r keeps part r of ``axis``. Gloo has no
  reduce-scatter, so there it is an all_reduce and a slice (same numbers, more bytes moved).
- ``all_to_all(x)``: part j of ``axis`` goes to rank j; rank r's output is the ranks' parts r in rank order
  (equal splits; a token dispatch with data-dependent counts is not expressible with static shapes).
- ``cp_gather(x)`` / ``cp_take(x)``: the zig-zag context-parallel split of a sequence of N = 2*R*c rows
  into 2R chunks of c rows, rank r holding chunks r and 2R-1-r (balanced for the causal mask). cp_gather
  turns every rank's local rows into the full sequence in order; cp_take selects this rank's rows.
- ``moe_experts_local``: ``moe_experts`` restricted to the expert replicas one expert-parallel rank holds;
  the sum over ranks of its outputs is ``moe_experts``'s output.
"""

from __future__ import annotations

import torch

from deepinfer.errors import IRError
from deepinfer.ir.graph import TensorType
from deepinfer.ir.ops.moe import EXPERT_FORMATS, MoEExperts, _expert_weight, swiglu
from deepinfer.ir.registry import Attr, register_op, shape_fail
from deepinfer.ir.shapes import exact_div


def _dist(op: str, world: int):
    """torch.distributed when it is initialised with ``world`` ranks; None for the single-process case."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != world:
            raise IRError(f"{op}: built for {world} ranks, the process group has {dist.get_world_size()}")
        return dist
    if world != 1:
        raise IRError(f"{op}: world {world} needs torch.distributed to be initialised")
    return None


def _axis_ok(op: str, x: TensorType, axis: int) -> int:
    if not 0 <= axis < x.rank:
        raise shape_fail(op, f"axis {axis} out of range", x)
    return axis


def _with_dim(x: TensorType, axis: int, d) -> TensorType:
    return x.with_shape(x.shape[:axis] + (d,) + x.shape[axis + 1 :])


def _gather_list(dist, x: torch.Tensor, world: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return parts


@register_op("all_reduce", "x", {"world": Attr("int"), "reduce": Attr("str", "sum")}, level="kernel")
class AllReduce:
    """Sum of x over the ranks, on every rank."""

    def infer(x, *, world, reduce):
        if reduce != "sum":
            raise shape_fail("all_reduce", f"reduce {reduce!r} is not 'sum'", x)
        return x

    def reference(x, *, world, reduce):
        dist = _dist("all_reduce", world)
        out = x.clone()
        if dist is not None:
            dist.all_reduce(out)
        return out


@register_op("all_gather", "x", {"world": Attr("int"), "axis": Attr("int", 0)}, level="kernel")
class AllGather:
    """The ranks' x concatenated along axis in rank order."""

    def infer(x, *, world, axis):
        return _with_dim(x, _axis_ok("all_gather", x, axis), x.shape[axis] * world)

    def reference(x, *, world, axis):
        dist = _dist("all_gather", world)
        return x.clone() if dist is None else torch.cat(_gather_list(dist, x, world), dim=axis)


def _part(x: torch.Tensor, axis: int, world: int, r: int) -> torch.Tensor:
    n = x.shape[axis] // world
    return x.narrow(axis, r * n, n).contiguous()


def _check_split(op: str, x: TensorType, axis: int, world: int):
    part = exact_div(x.shape[_axis_ok(op, x, axis)], world)
    if part is None:
        raise shape_fail(op, f"axis {axis} does not split into {world} equal parts", x)
    return part


@register_op("reduce_scatter", "x", {"world": Attr("int"), "axis": Attr("int", 0)}, level="kernel")
class ReduceScatter:
    """Sum over ranks of x, split into `world` parts along axis; rank r gets part r."""

    def infer(x, *, world, axis):
        return _with_dim(x, axis, _check_split("reduce_scatter", x, axis, world))

    def reference(x, *, world, axis):
        dist = _dist("reduce_scatter", world)
        if dist is None:
            return x.clone()
        if dist.get_backend() != "gloo":
            out = torch.empty_like(_part(x, axis, world, 0))
            dist.reduce_scatter(out, [_part(x, axis, world, r) for r in range(world)])
            return out
        total = x.clone()  # gloo: no reduce_scatter; all_reduce then keep this rank's part
        dist.all_reduce(total)
        return _part(total, axis, world, dist.get_rank())


@register_op("all_to_all", "x", {"world": Attr("int"), "axis": Attr("int", 0)}, level="kernel")
class AllToAll:
    """Equal-split all-to-all: part j of axis goes to rank j; the output is the received parts in rank order."""

    def infer(x, *, world, axis):
        _check_split("all_to_all", x, axis, world)
        return x

    def reference(x, *, world, axis):
        dist = _dist("all_to_all", world)
        if dist is None:
            return x.clone()
        if dist.get_backend() != "gloo":
            out = [torch.empty_like(_part(x, axis, world, 0)) for _ in range(world)]
            dist.all_to_all(out, [_part(x, axis, world, r) for r in range(world)])
            return torch.cat(out, dim=axis)
        # gloo has no all_to_all: gather everything and keep what was sent to this rank.
        me = dist.get_rank()
        return torch.cat([_part(p, axis, world, me) for p in _gather_list(dist, x, world)], dim=axis)


# ---------------------------------------------------------------------------------------------------
# Zig-zag context parallel
# ---------------------------------------------------------------------------------------------------


def zigzag_chunks(rank: int, world: int) -> tuple[int, int]:
    """The two chunks (of 2*world) rank holds: r and 2R-1-r, so every rank has as many early as late rows."""
    return rank, 2 * world - 1 - rank


def zigzag_take(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's rows of a full sequence x [N, ...] (N divisible by 2*world)."""
    n = x.shape[0]
    if n % (2 * world):
        raise IRError(f"cp_take: {n} rows do not split into {2 * world} equal chunks")
    c = n // (2 * world)
    return torch.cat([x[k * c : (k + 1) * c] for k in zigzag_chunks(rank, world)])


def zigzag_merge(parts: list[torch.Tensor]) -> torch.Tensor:
    """The full sequence from every rank's local rows (parts in rank order)."""
    world = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * world)
    for r, p in enumerate(parts):
        if p.shape[0] % 2:
            raise IRError(f"cp_gather: rank {r} holds {p.shape[0]} rows, not two equal chunks")
        c = p.shape[0] // 2
        first, second = zigzag_chunks(r, world)
        chunks[first], chunks[second] = p[:c], p[c:]
    return torch.cat(chunks)


@register_op("cp_gather", "x", {"world": Attr("int")}, level="kernel")
class CPGather:
    """All-gather along axis 0 and reorder the zig-zag chunks: every rank gets the full sequence [R*T, ...]."""

    def infer(x, *, world):
        return _with_dim(x, _axis_ok("cp_gather", x, 0), x.shape[0] * world)

    def reference(x, *, world):
        dist = _dist("cp_gather", world)
        return zigzag_merge([x] if dist is None else _gather_list(dist, x, world))


@register_op("cp_take", "x", {"world": Attr("int"), "rank": Attr("int")}, level="kernel")
class CPTake:
    """This rank's zig-zag rows of a full sequence: [R*T, ...] -> [T, ...] (chunks r and 2R-1-r). Local."""

    def infer(x, *, world, rank):
        if not 0 <= rank < world:
            raise shape_fail("cp_take", f"rank {rank} not in 0..{world - 1}", x)
        return _with_dim(x, 0, _check_split("cp_take", x, 0, world))

    def reference(x, *, world, rank):
        return zigzag_take(x, rank, world)


# ---------------------------------------------------------------------------------------------------
# Expert parallel
# ---------------------------------------------------------------------------------------------------


@register_op(
    "moe_experts_local",
    "x, weights, idx, *experts",
    {
        "n_experts": Attr("int"),
        "slot_expert": Attr("ints"),
        "slot_replica": Attr("ints"),
        "replicas": Attr("ints"),
        "fmt": Attr("str", "float"),
        "swiglu_limit": Attr("float", 0.0),
        "block": Attr("int", 128),
    },
    level="model",
)
class MoEExpertsLocal:
    """The routed experts one expert-parallel rank holds (moe_experts restricted to its slots).

    Slot s holds replica ``slot_replica[s]`` of logical expert ``slot_expert[s]``; ``experts`` are the slots'
    tensors in slot order (as moe_experts lists them per expert). Logical expert e has ``replicas[e]``
    replicas over all ranks; the (token row t, expert e) pair is served by replica t % replicas[e], a rule
    every rank computes alike, so each pair is computed exactly once over the ranks and the sum over
    ranks of this op's output is moe_experts's output. Returns the partial sum [T, D] in x's dtype.
    """

    def infer(x, weights, idx, *experts, n_experts, slot_expert, slot_replica, replicas, fmt, swiglu_limit, block):
        if len(slot_replica) != len(slot_expert) or len(replicas) != n_experts:
            raise shape_fail("moe_experts_local", "needs one replica index per slot and a count per expert", x)
        for e, j in zip(slot_expert, slot_replica):
            if not (0 <= e < n_experts and 0 <= j < replicas[e]):
                raise shape_fail("moe_experts_local", f"slot (expert {e}, replica {j}) is out of range", x)
        return MoEExperts.infer(
            x, weights, idx, *experts, n_experts=len(slot_expert), fmt=fmt, swiglu_limit=swiglu_limit, block=block
        )

    def reference(x, weights, idx, *experts, n_experts, slot_expert, slot_replica, replicas, fmt, swiglu_limit, block):
        per = EXPERT_FORMATS[fmt]
        step = per // 3
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        xf = x.float()
        rows = torch.arange(idx.shape[0], device=idx.device).unsqueeze(-1)
        # Ascending expert order, as moe_experts accumulates, so a one-rank layout gives the same bits.
        for s in sorted(range(len(slot_expert)), key=lambda s: slot_expert[s]):
            e, j = slot_expert[s], slot_replica[s]
            mine = (idx == e) & (rows % replicas[e] == j)
            tok, slot = torch.nonzero(mine, as_tuple=True)
            if tok.numel() == 0:
                continue
            ws = experts[per * s : per * (s + 1)]
            scales = ws[1::2] if step == 2 else (None, None, None)
            w1, w2, w3 = (_expert_weight(fmt, w, sc, block) for w, sc in zip(ws[::step], scales))
            h = swiglu(xf[tok] @ w1.T, xf[tok] @ w3.T, swiglu_limit)
            out.index_add_(0, tok, (h @ w2.T) * weights[tok, slot].float().unsqueeze(-1))
        return out.to(x.dtype)
