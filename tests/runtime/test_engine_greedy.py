"""Done-when #1: greedy generation through compile -> Plan -> engine equals the interpreter Session, token
for token, for 8 prompts of different lengths batched together (tiny V4 and V4.1)."""

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.runtime.plan import load_plan, write_plan

from .conftest import GEN_TOKENS, prompts_of_lengths, session_greedy

LENGTHS = [1, 3, 7, 12, 17, 24, 33, 40]  # short, one block, several blocks (block size 16)


@pytest.mark.parametrize("which", ["tiny_v4", "tiny_v41"])
def test_batched_greedy_equals_session(which, request, tmp_path):
    model = request.getfixturevalue(which)
    write_plan(model.plan, tmp_path / "plan")  # the engine reads the plan from disk, as `deepinfer run` does
    llm = LLM(plan=str(tmp_path / "plan"), max_num_seqs=8, max_num_batched_tokens=64)
    prompts = prompts_of_lengths(LENGTHS, seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True))
    want = session_greedy(model, prompts, GEN_TOKENS)
    for i, (out, ref) in enumerate(zip(outs, want)):
        assert out.token_ids == ref, f"prompt {i} ({LENGTHS[i]} tokens)"
        assert out.finish_reason == "length" and out.ttft_s > 0 and out.tpot_s > 0
    assert len(llm.batch_log[0]) - 1 < 8  # the 64-token budget chunked the first prefills
    assert llm.kv.num_used_blocks == 0 and llm.kv.num_used_slots == 0
    assert load_plan(tmp_path / "plan").model == model.name
