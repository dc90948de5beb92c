"""Determinism and scheduling on the tiny V4 model: seeds, batch invariance, chunked prefill, preemption,
overlap, prefix reuse, streaming."""

import pytest

from deepinfer import LLM, SamplingParams

from .conftest import prompts_of_lengths

SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.95, max_tokens=6, ignore_eos=True)


def _llm(model, **kw):
    kw.setdefault("max_num_seqs", 16)
    kw.setdefault("max_num_batched_tokens", 256)
    return LLM(plan=model.plan, params=model.params, **kw)


def test_same_seed_same_samples_and_seeds_matter(tiny_v4):
    llm = _llm(tiny_v4)
    prompt = prompts_of_lengths([9], seed=5)[0]
    a, b, c = llm.generate([prompt] * 3, [SamplingParams(seed=7, **SAMPLED)] * 2 + [SamplingParams(seed=8, **SAMPLED)])
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids  # 6 draws from ~500 tokens: equal by chance is negligible


@pytest.mark.parametrize("others", [1, 4, 16])
def test_request_output_is_the_same_alone_or_batched(tiny_v4, others):
    target = prompts_of_lengths([11], seed=9)[0]
    params = SamplingParams(seed=1234, **SAMPLED)
    alone = _llm(tiny_v4).generate([target], params)[0].token_ids
    crowd = prompts_of_lengths([3 + (5 * i) % 29 for i in range(others)], seed=others)
    mixed = [SamplingParams(seed=i, **SAMPLED) for i in range(others)]
    pos = others // 2
    outs = _llm(tiny_v4, max_num_batched_tokens=48).generate(
        crowd[:pos] + [target] + crowd[pos:], mixed[:pos] + [params] + mixed[pos:]
    )
    assert outs[pos].token_ids == alone


def _greedy(n=8):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_chunked_prefill_equals_unchunked(tiny_v4):
    prompts = prompts_of_lengths([5, 29, 40, 18], seed=3)
    whole = _llm(tiny_v4, chunked_prefill=False, enable_prefix_caching=False).generate(prompts, _greedy())
    chunked_llm = _llm(tiny_v4, max_num_batched_tokens=12, enable_prefix_caching=False)
    chunked = chunked_llm.generate(prompts, _greedy())
    assert [o.token_ids for o in whole] == [o.token_ids for o in chunked]
    assert any(item[1] > 0 and item[3] is False for step in chunked_llm.batch_log for item in step[:-1])


def test_preempted_and_resumed_equals_uninterrupted(tiny_v4):
    prompts = prompts_of_lengths([20, 25, 30, 14], seed=4)
    params = [SamplingParams(seed=i, **{**SAMPLED, "max_tokens": 20}) for i in range(4)]
    free = _llm(tiny_v4, enable_prefix_caching=False).generate(prompts, params)
    # 6 blocks of 16 tokens for 4 requests that grow to ~40-50 tokens each: someone must be preempted
    tight_llm = _llm(tiny_v4, num_blocks=6, enable_prefix_caching=False)
    tight = tight_llm.generate(prompts, params)
    assert sum(o.num_preemptions for o in tight) > 0
    assert [o.token_ids for o in free] == [o.token_ids for o in tight]
    assert tight_llm.kv.num_used_blocks == 0


def test_overlap_schedules_the_same_batches(tiny_v4):
    prompts = prompts_of_lengths([20, 25, 30, 14, 3, 9], seed=6)
    params = [SamplingParams(seed=i, stop_token_ids=[7, 9, 11], **{**SAMPLED, "max_tokens": 12}) for i in range(6)]
    runs = []
    for overlap in (False, True):
        llm = _llm(tiny_v4, num_blocks=7, max_num_batched_tokens=24, overlap=overlap)
        outs = llm.generate(prompts, params)
        runs.append((llm.batch_log, [o.token_ids for o in outs]))
    assert runs[0] == runs[1]
    assert any(step[-1] != ("preempt",) for step in runs[0][0])  # the schedule did preempt


def test_prefix_reuse_gives_the_same_output(tiny_v4):
    prompt = prompts_of_lengths([40], seed=8)[0]
    llm = _llm(tiny_v4)
    first = llm.generate([prompt], _greedy())[0]
    second = llm.generate([prompt + [5]], _greedy())[0]  # shares 2 full blocks (32 tokens) with the first
    fresh = _llm(tiny_v4, enable_prefix_caching=False).generate([prompt + [5]], _greedy())[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    assert second.token_ids == fresh.token_ids
    assert llm.kv.usage()["prefix_snapshots"]["used"] > 0 and llm.kv.num_used_blocks == 0


def test_stream_yields_growing_outputs_that_end_like_generate(tiny_v4):
    prompts = prompts_of_lengths([4, 10], seed=2)
    seen: dict[str, list] = {}
    for out in _llm(tiny_v4).stream(prompts, _greedy(5)):
        prev = seen.setdefault(out.request_id, [])
        assert out.token_ids[: len(prev)] == prev and len(out.token_ids) == len(prev) + 1
        seen[out.request_id] = out.token_ids
    assert list(seen.values()) == [o.token_ids for o in _llm(tiny_v4).generate(prompts, _greedy(5))]
