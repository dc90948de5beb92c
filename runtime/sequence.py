"""One request as the scheduler, executor and engine see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from deepinfer.runtime.kv_cache import CacheAllocation
from deepinfer.runtime.sampler import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request: its tokens, how far the scheduler has taken it, and what it produced.

    ``num_computed`` counts tokens whose step has been *scheduled* (vLLM v1's meaning), and ``num_inflight``
    the samples those scheduled-but-not-yet-processed steps will add; so the scheduler can plan step N+1 while
    step N runs. ``epoch`` goes up on every preemption: results of steps scheduled before it are dropped.
    """

    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_len: int  # prompt + max_tokens: sizes the dense caches, like Session(max_len=...)
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    num_inflight: int = 0
    epoch: int = 0
    cache: CacheAllocation | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    logprobs: list = field(default_factory=list)
    text: str = ""
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # reused from the prefix cache at the last admission

    @property
    def num_tokens(self) -> int:
        """Prompt + generated + the samples that steps in flight will add."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def outputs_scheduled(self) -> int:
        return len(self.output_ids) + self.num_inflight
