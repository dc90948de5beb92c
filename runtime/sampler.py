"""Sampling parameters and the per-request sampler.

A request's samples depend only on (its logits, its seed, the position being sampled): the uniform draw for
the token at position p comes from a counter-based generator (Philox4x32-10) keyed by the request's seed with
p as the counter. No generator state is shared between requests or carried between steps, so the same request
gives the same tokens alone, batched with others, chunked differently, or recomputed after a preemption.

Order of processing one logits row (vLLM's order):
    logits processors (the seam for structured output and speculative decoding)
    -> repetition / presence / frequency penalties -> temperature (0 = greedy)
    -> top-k -> top-p -> min-p -> inverse-CDF draw with the Philox uniform.
Logprobs are the model's raw distribution (log_softmax of the unprocessed logits), as vLLM reports by default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.errors import DeepInferError

# A logits processor sees the request's token history (prompt + generated) and the logits row, and returns
# the row to sample from (e.g. a grammar bitmask sets disallowed tokens to -inf).
LogitsProcessor = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]


class InvalidRequestError(DeepInferError):
    """A request that cannot run (empty prompt, too long, bad sampling parameters)."""


@dataclass
class SamplingParams:
    """How to sample one request; the vLLM names and defaults (temperature 1.0; 0 means greedy)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: the engine draws one per request from its own seed
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # also return this many most likely tokens per step (0: only the sampled one)
    skip_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] = field(default_factory=list)

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or positive, got {self.top_k!r}")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise InvalidRequestError(f"logprobs must be a non-negative integer, got {self.logprobs!r}")
        self.stop_strings()  # checks its type
        if self.stop_token_ids is not None and not all(isinstance(t, int) for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop] if self.stop else []
        if isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            return [s for s in self.stop if s]
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")


# ---------------------------------------------------------------------------------------------------
# Counter-based uniform: Philox4x32-10 (Salmon et al. 2011), the generator cuRAND and JAX use.
# ---------------------------------------------------------------------------------------------------

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def philox4x32(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (
            ((p1 >> 32) ^ c1 ^ k0) & _MASK32,
            p1 & _MASK32,
            ((p0 >> 32) ^ c3 ^ k1) & _MASK32,
            p0 & _MASK32,
        )
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that is a pure function of (seed, position): 53 random bits of one Philox block."""
    seed &= (1 << 64) - 1
    r = philox4x32((position & _MASK32, (position >> 32) & _MASK32, 0, 0), (seed & _MASK32, seed >> 32))
    return ((r[0] << 21) ^ (r[1] >> 11)) / float(1 << 53)


# ---------------------------------------------------------------------------------------------------
# Sampling one row
# ---------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    token: int
    logprob: float | None = None  # of the sampled token under the raw distribution
    top_logprobs: dict[int, float] | None = None


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: Sequence[int]):
    """Repetition (prompt + output, divides positive logits), presence and frequency (output only)."""
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        if len(seen):
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output:
        ids, counts = torch.tensor(list(output), dtype=torch.long).unique(return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)
    return logits


def _kept_mask(sorted_probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Which of the descending-sorted probabilities survive top-k, top-p and min-p (the first always does)."""
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k :] = False
    if p.top_p < 1.0:
        before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass strictly ahead of each token
        keep &= before < p.top_p
    if p.min_p > 0:
        keep &= sorted_probs >= p.min_p * sorted_probs[0]
    keep[0] = True
    return keep


def sample_row(
    logits: torch.Tensor, p: SamplingParams, seed: int, position: int, prompt: Sequence[int], output: Sequence[int]
) -> Sample:
    """Sample the token at ``position`` from one row of logits [vocab]."""
    raw = logits.float()
    row = raw.clone()
    for proc in p.logits_processors:
        row = proc(list(prompt), list(output), row)
    row = apply_penalties(row, p, prompt, output)
    if p.temperature == 0:
        token = int(torch.argmax(row))
    else:
        probs = torch.softmax(row.double() / p.temperature, dim=-1)
        # a stable sort: ties break by token id, so the order never depends on anything but the row
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        kept = sorted_probs * _kept_mask(sorted_probs, p)
        cdf = torch.cumsum(kept, 0)
        u = uniform(seed, position) * float(cdf[-1])
        idx = min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True)), len(cdf) - 1)
        while float(kept[idx]) == 0:  # never land on a filtered token through rounding at the boundary
            idx -= 1
        token = int(order[idx])
    return _with_logprobs(raw, token, p.logprobs)


def _with_logprobs(raw: torch.Tensor, token: int, n: int | None) -> Sample:
    if n is None:
        return Sample(token)
    lp = torch.log_softmax(raw, dim=-1)
    top = {}
    if n > 0:
        vals, ids = torch.topk(lp, min(n, lp.numel()))
        top = {int(i): float(v) for i, v in zip(ids, vals)}
    return Sample(token, float(lp[token]), top)
