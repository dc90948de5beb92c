"""The parallel layout (phase 3): a layout, each rank's role in it, and one graph per rank.

    layout = {"world": 4, "dp": 2, "cp": 1, "ep": 4, "eplb": {"n_redundant": 4, "load": [...]}}
    g_r = shard_for_rank(graph, rank, layout)            # what rank r runs
    pipe = layout_pipeline(layout, rank)                 # the default pipeline with phase 3 filled in

Attention is data parallel (``dp`` groups, each serving its own requests: the graph stays the one-sequence
graph, and the plan's rank table says which request slot a rank serves) and, inside a group, context parallel
(``cp`` ranks share one long prompt, passes/context_parallel.py). ``world / (dp * cp)`` ranks hold the same
tokens (attention replicated). The MoE is expert parallel over ``ep`` ranks (passes/expert_parallel.py): with
every rank holding the same tokens the partial outputs are all-reduced; with distinct tokens per rank they
are all-gathered and reduce-scattered, which needs every rank at the same bucket T (the runtime pads).

Supported: ep in (1, world); either dp * cp == world (tokens distinct) or dp == cp == 1 (tokens replicated);
cp > 1 only with dp == 1 (collectives span the whole world; CP sub-groups inside DP are not built).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from deepinfer.errors import ConfigError
from deepinfer.ir.graph import Graph
from deepinfer.passes.context_parallel import context_parallel
from deepinfer.passes.expert_parallel import expert_parallel, prune_params
from deepinfer.passes.pipeline import Pipeline, register_pass


@dataclass(frozen=True)
class Layout:
    world: int
    dp: int = 1
    cp: int = 1
    ep: int = 1
    eplb: dict | None = field(default=None, compare=False)

    @classmethod
    def parse(cls, d: Mapping | Layout) -> Layout:
        if isinstance(d, Layout):
            return d
        unknown = set(d) - {"world", "dp", "cp", "ep", "eplb"}
        if unknown:
            raise ConfigError(f"layout: unknown key {sorted(unknown)[0]!r} (keys: world, dp, cp, ep, eplb)")
        for k in ("world", "dp", "cp", "ep"):
            v = d.get(k, 1)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"layout: {k} must be a positive integer, got {v!r}")
        lay = cls(d.get("world", 1), d.get("dp", 1), d.get("cp", 1), d.get("ep", 1), d.get("eplb"))
        lay.check()
        return lay

    def check(self) -> None:
        w, attn = self.world, self.dp * self.cp
        if self.ep not in (1, w):
            raise ConfigError(f"layout: ep must be 1 or the world size {w}, got {self.ep}")
        if attn not in (1, w):
            raise ConfigError(f"layout: dp*cp must be 1 (replicated attention) or the world size {w}, got {attn}")
        if self.cp > 1 and self.dp > 1:
            raise ConfigError("layout: cp > 1 with dp > 1 needs CP sub-groups, which are not built")
        if self.eplb and self.ep == 1:
            raise ConfigError("layout: eplb needs ep > 1")

    @property
    def tokens(self) -> str:
        """Whether ranks hold the same tokens (replicated) or each their own (distinct)."""
        return "distinct" if self.dp * self.cp > 1 else "replicated"

    def rank_role(self, rank: int) -> dict:
        """What rank ``rank`` does: its DP request slot, its CP chunks, its EP rank."""
        if not 0 <= rank < self.world:
            raise ConfigError(f"layout: rank {rank} not in 0..{self.world - 1}")
        cp_rank = rank % self.cp
        role = {"rank": rank, "dp_slot": rank // self.cp if self.dp > 1 else 0, "cp_rank": cp_rank}
        role["cp_chunks"] = [cp_rank, 2 * self.cp - 1 - cp_rank] if self.cp > 1 else None
        role["ep_rank"] = rank if self.ep > 1 else None
        return role

    def to_json(self) -> dict:
        out = {"world": self.world, "dp": self.dp, "cp": self.cp, "ep": self.ep}
        return out | ({"eplb": self.eplb} if self.eplb else {})


def rank_table(layout: Mapping | Layout) -> list[dict]:
    """The plan's rank assignment: one role per rank."""
    lay = Layout.parse(layout)
    return [lay.rank_role(r) for r in range(lay.world)]


@register_pass("parallel_layout")
def shard_for_rank(g: Graph, rank: int = 0, layout: Mapping | Layout | None = None) -> Graph:
    """Rank ``rank``'s graph under ``layout`` (mutates and returns g; no layout: g unchanged)."""
    if not layout:
        return g
    lay = Layout.parse(layout)
    role = lay.rank_role(rank)
    if lay.cp > 1:
        g = context_parallel(g, world=lay.world, rank=rank)
    if lay.ep > 1:
        g = expert_parallel(g, world=lay.world, rank=rank, tokens=lay.tokens, eplb=lay.eplb)
    prune_params(g)
    g.meta.setdefault("parallel", {}).update(layout=lay.to_json(), role=role, tokens=lay.tokens)
    g.name = f"{g.name}.rank{rank}"
    return g


def layout_pipeline(layout: Mapping, rank: int, base: Pipeline | None = None) -> Pipeline:
    """``base`` (default pipeline) with phase 3 set to this rank's layout."""
    base = base or Pipeline.default()
    return base.with_phase("parallel", [("parallel_layout", {"rank": rank, "layout": dict(layout)}), "dce"])
