"""Bad input gets an error for that request only; engine-level errors are one line; 1,000 random requests
with random aborts leave no cache block or slot allocated."""

import json
import random

import pytest
import torch

from deepinfer import LLM, DeepInferError, SamplingParams
from deepinfer.runtime.cuda_executor import CudaUnavailableError
from deepinfer.runtime.plan import write_plan

from .conftest import prompts_of_lengths


def test_bad_requests_fail_alone(tiny_v4):
    llm = LLM(plan=tiny_v4.plan, params=tiny_v4.params, max_model_len=64)
    good = prompts_of_lengths([6], seed=1)[0]
    ok = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    cases = [
        (good, ok, None),
        ([], ok, "empty prompt"),
        (good * 11, ok, "max_model_len is 64"),
        (good, SamplingParams(max_tokens=0), "max_tokens must be a positive"),
        (good, SamplingParams(stop=42), "stop must be a string or a list of strings"),
        ([5, 9999], ok, "outside the vocabulary"),
        (3.5, ok, "a prompt is a string"),
        (good, ok, None),
    ]
    outs = llm.generate([c[0] for c in cases], [c[1] for c in cases])
    for out, (_, _, msg) in zip(outs, cases):
        if msg is None:
            assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.error is None
        else:
            assert out.finish_reason == "error" and msg in out.error and out.token_ids == []
    assert outs[0].token_ids == outs[-1].token_ids


def test_missing_plan_and_wrong_target_are_one_line_errors(tiny_v4, tmp_path):
    with pytest.raises(DeepInferError, match="no plan here") as e:
        LLM(plan=str(tmp_path / "nope"))
    assert "\n" not in str(e.value)
    write_plan(tiny_v4.plan, tmp_path / "plan")
    doc = json.loads((tmp_path / "plan" / "plan.json").read_text())
    (tmp_path / "plan" / "plan.json").write_text(json.dumps({**doc, "target": "sm90"}))
    with pytest.raises(DeepInferError, match="compiled for sm90"):
        LLM(plan=str(tmp_path / "plan"))
    with pytest.raises(CudaUnavailableError, match="CUDA") as e:  # this machine has no GPU
        LLM(plan=str(tmp_path / "plan"), target="sm90")
    assert "\n" not in str(e.value)


class FastFakeRunner:
    """Stands in for the model (this test is about bookkeeping, not numerics): logits are a hash of the
    tokens, and the caches pass through unchanged (so gather/scatter still run)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def forward(self, tokens, positions, caches):
        g = torch.Generator().manual_seed(int(tokens.sum()) * 1009 + int(positions[-1]))
        return torch.randn(len(tokens), self.vocab, generator=g), caches


def test_thousand_random_requests_with_aborts_leak_nothing(tiny_v4):
    rng = random.Random(0)
    llm = LLM(
        plan=tiny_v4.plan, params={}, max_num_seqs=8, max_num_batched_tokens=24, num_blocks=10, block_size=8,
        max_model_len=40,
    )  # fmt: skip
    llm.executor.runner = FastFakeRunner(512)
    shared = prompts_of_lengths([16], seed=3)[0]  # a common prefix, so the prefix cache is exercised
    ids, done = [], {}
    while len(ids) < 1000 or llm.has_unfinished():
        for _ in range(min(rng.randrange(0, 6), 1000 - len(ids))):
            prompt = shared[: rng.randrange(0, 17)] + prompts_of_lengths([rng.randrange(1, 9)], rng.random())[0]
            params = SamplingParams(max_tokens=rng.randrange(1, 4), seed=rng.randrange(100), stop_token_ids=[3])
            ids.append(llm.add_request(prompt, params))
        for rid in rng.sample(ids, 2) if ids and rng.random() < 0.3 else []:
            llm.abort(rid)
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.finish_reason
    assert len(done) == 1000 and set(done.values()) <= {"stop", "length", "abort"}
    assert "abort" in done.values()
    assert llm.kv.num_used_blocks == 0 and llm.kv.num_used_slots == 0
    assert all(b.ref_count == 0 for b in llm.kv.blocks)
    assert llm.kv.usage()["compressed"]["used"] == 0
