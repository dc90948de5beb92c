"""The interpreter session: greedy decoding with explicit caches equals re-running the full prompt."""

import pytest
import torch

from deepinfer.errors import ConfigError, DeepInferError
from deepinfer.ir.builder import GraphBuilder
from deepinfer.models import deepseek_v4
from deepinfer.models.checkpoint import random_weights
from deepinfer.runtime.session import Session, allocate_caches, cache_symbols, greedy_generate


@pytest.fixture(scope="module")
def tiny():
    cfg = deepseek_v4.TINY_CONFIGS["tiny"]
    g = deepseek_v4.build_graph(deepseek_v4.parse_config(cfg))
    return g, random_weights(g.params, seed=3, block=(128, 128))


def test_caches_are_sized_by_ratio(tiny):
    g, _ = tiny
    env = cache_symbols(g, max_len=33)
    assert env == {"C4": 9, "C8": 5}  # ceil(33/4), ceil(33/8)
    caches = allocate_caches(g, 33)
    assert {e["name"] for e in g.meta["caches"]} == set(caches)
    assert all(float(t.abs().sum()) == 0 for t in caches.values())


def test_greedy_decode_equals_full_forward_argmax(tiny):
    g, params = tiny
    prompt = [5, 77, 300, 12, 9, 41, 200, 3, 8, 150, 2, 99, 7]
    res = greedy_generate(g, params, prompt, max_tokens=10)
    assert len(res.output_ids) == 10
    # independent check: one prefill over prompt + generated tokens, argmax at each generated position
    full = Session(g, params, max_len=len(prompt) + 10).forward(prompt + res.output_ids[:-1])
    want = torch.argmax(full[len(prompt) - 1 :], dim=-1).tolist()
    assert res.output_ids == want


def test_session_rejects_overflow_and_empty_input(tiny):
    g, params = tiny
    s = Session(g, params, max_len=4)
    with pytest.raises(DeepInferError, match="at least one token"):
        s.forward([])
    with pytest.raises(DeepInferError, match="over max_len 4"):
        s.forward([1, 2, 3, 4, 5])
    assert s.length == 0  # nothing accepted was lost


def test_unknown_cache_symbol_is_a_config_error():
    b = GraphBuilder("g", meta={"caches": [{"name": "c", "shape": ["N", 4]}]})
    b.output(b.neg(b.input("c", "f32", ["N", 4])))
    with pytest.raises(ConfigError, match="cannot size symbol N"):
        cache_symbols(b.build(), 8)
