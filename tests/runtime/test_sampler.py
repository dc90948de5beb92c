"""The sampler: the counter-keyed uniform, each filter and penalty, logprobs, parameter validation."""

import pytest
import torch

from deepinfer.runtime.sampler import InvalidRequestError, SamplingParams, apply_penalties, sample_row, uniform


def test_philox_uniform_is_a_pure_function_of_seed_and_position():
    draws = [uniform(7, p) for p in range(2000)]
    assert draws == [uniform(7, p) for p in range(2000)]
    assert all(0 <= u < 1 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03
    assert uniform(7, 5) != uniform(8, 5) and uniform(7, 5) != uniform(7, 6)


def _row():
    return torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9])


def test_greedy_and_filters():
    greedy = SamplingParams(temperature=0)
    assert sample_row(_row(), greedy, 0, 0, [], []).token == 1
    # top_k=1 and a tiny top_p leave only the most likely token, whatever the draw
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=0.99)):
        assert {sample_row(_row(), p, s, 0, [], []).token for s in range(50)} == {1}
    # top_k=2 samples only among the two most likely
    assert {sample_row(_row(), SamplingParams(top_k=2), s, 3, [], []).token for s in range(200)} == {1, 4}


def test_sampling_follows_the_distribution():
    counts = torch.zeros(5)
    for s in range(3000):
        counts[sample_row(_row(), SamplingParams(), s, 0, [], []).token] += 1
    want = torch.softmax(_row(), 0)
    assert torch.allclose(counts / 3000, want, atol=0.03)


def test_penalties():
    row = _row()
    out = apply_penalties(row.clone(), SamplingParams(repetition_penalty=2.0), prompt=[1], output=[3])
    assert out[1] == 1.5 and out[3] == 0.25 and out[0] == 1.0  # seen tokens (prompt and output) divided
    out = apply_penalties(row.clone(), SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), [], [4, 4, 2])
    assert out[4] == pytest.approx(2.9 - 1.0 - 1.0) and out[2] == pytest.approx(2.0 - 1.5) and out[1] == 3.0


def test_logits_processor_hook_runs_before_sampling():
    ban_best = SamplingParams(
        temperature=0, logits_processors=[lambda prompt, out, r: r.index_fill(0, torch.tensor([1]), -1e9)]
    )
    assert sample_row(_row(), ban_best, 0, 0, [], []).token == 4


def test_logprobs_are_the_raw_distribution():
    s = sample_row(_row(), SamplingParams(temperature=0, logprobs=2), 0, 0, [], [])
    lp = torch.log_softmax(_row(), 0)
    assert s.logprob == pytest.approx(float(lp[1]))
    assert list(s.top_logprobs) == [1, 4]


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"max_tokens": 0}, "max_tokens must be a positive"),
        ({"max_tokens": -3}, "max_tokens must be a positive"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stop": 5}, "stop must be a string or a list of strings"),
        ({"stop": ["a", 3]}, "stop must be"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_parameters_name_the_field(kw, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        SamplingParams(**kw).validate()
