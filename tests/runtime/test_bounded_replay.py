"""V4.1 compact mode (DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact): the engine keeps each prompt in one
chunk, so the late layers drop exactly the rows DeepSeek's bounded replay drops, and matches the Session."""

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.models import deepseek_v41

from .conftest import compile_tiny, prompts_of_lengths, session_greedy, v41_tiny_config


@pytest.fixture(scope="module")
def compact():
    cfg = v41_tiny_config()
    parsed = deepseek_v41.parse_config(cfg)
    keep = parsed.window + parsed.dspark_block_size  # the smallest keep the model allows
    model = compile_tiny("deepseek-v4.1-flash", cfg, mode="compact", keep_tokens=keep)
    assert model.plan.graph.meta["mode"] == "compact"
    return model, keep


def test_compact_prompts_run_whole_and_match_the_session(compact):
    model, keep = compact
    lengths = [keep + 9, 5, keep + 2]  # two prompts long enough for rows to be dropped
    prompts = prompts_of_lengths(lengths, seed=11)
    # a budget smaller than the prompts: exact mode would chunk them; compact mode must not
    llm = LLM(plan=model.plan, params=model.params, max_num_batched_tokens=keep + 10, enable_prefix_caching=True)
    assert not llm.kv.enable_prefix_caching  # reuse would split prompts
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == session_greedy(model, prompts, 6)
    firsts = {}
    for step in llm.batch_log:
        for rid, start, end, _ in step[:-1]:
            firsts.setdefault(rid, (start, end))
    assert [firsts[str(i)] for i in range(3)] == [(0, n) for n in lengths]


def test_compact_prompt_over_the_step_budget_is_an_error(compact):
    model, keep = compact
    llm = LLM(plan=model.plan, params=model.params, max_num_batched_tokens=keep)
    out = llm.generate([prompts_of_lengths([keep + 1])[0]], SamplingParams(max_tokens=2))[0]
    assert out.finish_reason == "error" and "cannot be split" in out.error
