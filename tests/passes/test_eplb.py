"""EPLB placement: slot counts, replica choice, and the promised balance on a skewed histogram.

The bound (passes/eplb.py): max rank load <= mean + p_max, p_max = max over experts of load / replicas.
"""

from __future__ import annotations

import random

import pytest

from deepinfer.errors import ConfigError
from deepinfer.passes.eplb import balance_bound, contiguous_placement, eplb_placement, replicate


def zipf(n: int, s: float = 1.2, scale: float = 10000.0) -> list[float]:
    """A skewed expert-load histogram: expert e gets scale / (rank_e + 1)^s tokens, ranks shuffled."""
    order = list(range(n))
    random.Random(0).shuffle(order)
    return [scale / (order[e] + 1) ** s for e in range(n)]


def _ratio(loads: list[float]) -> float:
    return max(loads) / (sum(loads) / len(loads))


def test_skewed_histogram_meets_the_bound_and_beats_contiguous():
    load, world, redundant = zipf(64), 8, 16
    p = eplb_placement(load, world, redundant)
    assert all(len(r) == (64 + redundant) // world for r in p.slots)
    assert sum(p.replicas) == 64 + redundant and max(p.replicas) <= world
    held = {e for r in p.slots for e, _ in r}
    assert held == set(range(64))
    loads = p.rank_loads(load)
    assert abs(sum(loads) - sum(load)) < 1e-6 * sum(load)
    assert max(loads) <= balance_bound(load, p) + 1e-9
    base = _ratio(contiguous_placement(64, world).rank_loads(load))
    eplb = _ratio(loads)
    bound = balance_bound(load, p) / (sum(load) / world)
    print(f"max/mean: contiguous {base:.3f}, eplb {eplb:.3f}, promised <= {bound:.3f}, colocated {p.colocated()}")
    assert eplb <= bound and eplb < base / 2 and eplb < 1.1


@pytest.mark.parametrize("seed", range(20))
def test_bound_holds_on_random_histograms(seed):
    rng = random.Random(seed)
    world = rng.choice([2, 4, 8])
    n = world * rng.randint(1, 6)
    redundant = min(world * rng.randint(0, 3), n * (world - 1))
    load = [rng.paretovariate(1.0) * rng.choice([0, 1, 1, 1]) for _ in range(n)]
    p = eplb_placement(load, world, redundant)
    assert max(p.rank_loads(load)) <= balance_bound(load, p) + 1e-9


def test_replication_minimises_the_largest_load_per_replica():
    load = [100.0, 30.0, 30.0, 1.0]
    assert replicate(load, 3, max_replicas=4) == [4, 1, 1, 1]  # 100/4 = 25 < 30: the next would go to a 30
    assert replicate(load, 4, max_replicas=4) == [4, 2, 1, 1]


def test_bad_inputs():
    with pytest.raises(ConfigError, match="do not fill 4 ranks"):
        eplb_placement([1.0] * 8, 4, 2)
    with pytest.raises(ConfigError, match="do not split"):
        contiguous_placement(6, 4)
