"""EPLB: where each expert-parallel rank's experts come from, with redundant replicas of the hot experts.

    p = eplb_placement(load, world=8, n_redundant=32)   # load: tokens per expert (a measured histogram)
    p.slots[r]        -> [(expert, replica), ...] the S = (E + n_redundant) / world slots rank r holds
    p.replicas[e]     -> how many replicas expert e has
    p.rank_loads(load) -> the expected load per rank (an expert's load splits evenly over its replicas)

Two greedy steps (the shape of DeepSeek's EPLB, one level: no node groups):
1. Replicate: each redundant slot goes to the expert with the largest load per replica (ties: lower id),
   at most ``world`` replicas per expert. This minimises p_max = max_e load_e / replicas_e exactly (each step
   lowers the current maximum; the classic apportionment argument).
2. Pack, in rounds (LPT with equal slot counts): sort the replicas by load, heaviest first; round k hands
   replicas k*R .. k*R+R-1 to the R ranks, the heaviest of the round to the rank that is lightest so far, the
   next to the next lightest, and so on. Every rank gets exactly one replica per round, so slot counts are
   equal without a capacity check.

The bound (why the rounds): let q_1 >= .. >= q_R be a round's loads and l_1 <= .. <= l_R the ranks' loads
before it. After it, for ranks i < j: (l_i + q_i) - (l_j + q_j) <= q_i - q_j <= q_1 - q_R, and for i > j:
(l_i + q_i) - (l_j + q_j) <= l_i - l_j <= the spread before. So the spread (max - min) never exceeds the
largest in-round spread, which is at most p_max, and since min <= mean:

        max rank load <= mean + p_max        (mean = total / R; p_max after replication, as above)

Replicas of one expert have equal loads and sort next to each other, so they usually share a round and land on
distinct ranks; when two land on one rank (``colocated``) the bound still holds, the replica is just wasted.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    world: int
    replicas: tuple[int, ...]  # per logical expert
    slots: tuple[tuple[tuple[int, int], ...], ...]  # per rank: (expert, replica index)

    @property
    def n_experts(self) -> int:
        return len(self.replicas)

    def rank_loads(self, load: list[float]) -> list[float]:
        return [sum(load[e] / self.replicas[e] for e, _ in rank) for rank in self.slots]

    def colocated(self) -> int:
        """Replicas that share a rank with another replica of their expert (they add no capacity)."""
        return sum(len(rank) - len({e for e, _ in rank}) for rank in self.slots)

    def to_json(self) -> dict:
        return {"replicas": list(self.replicas), "slots": [[list(s) for s in rank] for rank in self.slots]}


def contiguous_placement(n_experts: int, world: int) -> Placement:
    """No EPLB: rank r holds experts r*E/R .. (r+1)*E/R - 1, one replica each."""
    if n_experts % world:
        raise ConfigError(f"expert parallel: {n_experts} experts do not split over {world} ranks")
    per = n_experts // world
    slots = tuple(tuple((r * per + i, 0) for i in range(per)) for r in range(world))
    return Placement(world, (1,) * n_experts, slots)


def replicate(load: list[float], n_redundant: int, max_replicas: int) -> list[int]:
    """Step 1: replica counts minimising the largest load per replica."""
    reps = [1] * len(load)
    for _ in range(n_redundant):
        open_ = [e for e in range(len(load)) if reps[e] < max_replicas]
        if not open_:
            raise ConfigError(f"eplb: {n_redundant} redundant slots exceed {max_replicas} replicas of every expert")
        hot = max(open_, key=lambda e: (load[e] / reps[e], -e))
        reps[hot] += 1
    return reps


def pack_rounds(items: list[tuple[float, int, int]], world: int) -> list[list[tuple[int, int]]]:
    """Step 2: (load, expert, replica) items, heaviest first, one per rank per round, heaviest to lightest rank."""
    items = sorted(items, key=lambda it: (-it[0], it[1], it[2]))
    ranks: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    loads = [0.0] * world
    for k in range(0, len(items), world):
        order = sorted(range(world), key=lambda r: (loads[r], r))  # lightest first
        for (w, e, j), r in zip(items[k : k + world], order):
            ranks[r].append((e, j))
            loads[r] += w
    return ranks


def eplb_placement(load: list[float], world: int, n_redundant: int = 0) -> Placement:
    """Replicate the hottest experts into ``n_redundant`` extra slots, then pack replicas onto ranks by load."""
    n = len(load)
    if (n + n_redundant) % world:
        raise ConfigError(f"eplb: {n} experts + {n_redundant} redundant do not fill {world} ranks evenly")
    if any(x < 0 for x in load):
        raise ConfigError("eplb: expert loads must be >= 0")
    reps = replicate([float(x) for x in load], n_redundant, world)
    items = [(load[e] / reps[e], e, j) for e in range(n) for j in range(reps[e])]
    ranks = pack_rounds(items, world)
    return Placement(world, tuple(reps), tuple(tuple(sorted(r)) for r in ranks))


def balance_bound(load: list[float], p: Placement) -> float:
    """What the algorithm promises for max rank load: mean + p_max."""
    return sum(load) / p.world + max(load[e] / p.replicas[e] for e in range(len(load)))
