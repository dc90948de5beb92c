"""Continuous batching: which tokens of which requests run in the next step.

One ``schedule()`` call (nano-vllm's shape, vLLM v1's token-budget form):

1. running requests first, in admission order: each gets its next chunk (a decode step is a chunk of one
   token). When the blocks run out, the most recently admitted request is preempted (by recompute: its blocks
   and slot are released and it goes back to the head of the queue, to be prefilled again over prompt + the
   tokens it had generated; the counter-keyed sampler makes the continuation identical);
2. then waiting requests, FIFO, while a slot, blocks and token budget remain (none after a preemption).

Asynchronous scheduling. The scheduler never waits for the step in flight: ``schedule()`` for step N+1 runs
right after step N is handed to the executor, and counts every sample step N will produce as if it had
happened (``num_inflight``). A decode item names its token by position; the executor reads it from the
request when it runs, after step N's results are in. A request that stops at step N may already sit in step
N+1; the executor skips it (same for one aborted or preempted since). Since no scheduling decision reads a
step's results, the sequence of batches is the same whether step N+1 is planned while step N runs (overlap)
or after it; the test checks exactly that.

Chunked prefill: a prompt longer than the remaining token budget is split; with prefix caching on, a prompt's
prefill also ends one chunk at its last full block, so that block's state can be snapshotted for reuse.
Bounded replay (V4.1 compact mode, ``compact_keep_tokens``): the graph drops early rows of a chunk longer than
keep_tokens in its late layers, which is only DeepSeek's semantics for the whole prompt; so a prompt is never
split (it may then exceed the step budget, up to max_num_batched_tokens on its own), tokens after it are
recomputed in chunks of at most keep_tokens (where nothing is dropped), and prefix reuse is off.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deepinfer.runtime.kv_cache import KVCacheManager
from deepinfer.runtime.sequence import Sequence, Status


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    chunked_prefill: bool = True
    compact_keep_tokens: int | None = None  # set for a V4.1 graph built in compact (bounded replay) mode


@dataclass(frozen=True)
class ScheduledItem:
    """Tokens [start, end) of one request, with what the executor needs captured at scheduling time."""

    seq: Sequence
    epoch: int
    start: int
    end: int
    samples: bool  # the last row's logits give the next token
    block_ids: tuple[int, ...]
    slot: int
    initial_state: object  # kv_cache.INIT, a snapshot, or None (read the slot)

    @property
    def stale(self) -> bool:
        """The request finished, was aborted or preempted after this was scheduled: skip it."""
        return self.seq.finished or self.seq.epoch != self.epoch


@dataclass
class Batch:
    step: int
    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.end - i.start for i in self.items)

    def signature(self) -> list[tuple]:
        """What was scheduled, for comparing two runs."""
        return [(i.seq.request_id, i.start, i.end, i.samples) for i in self.items] + [("preempt", *self.preempted)]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_steps = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a request out (stopped, length, aborted) and give its cache back."""
        if seq.finished:
            return
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.cache is not None:
            self.kv.release(seq.cache)
            seq.cache = None

    # -- one step ----------------------------------------------------------------------------------------
    def schedule(self) -> Batch:
        batch = Batch(self.num_steps)
        self.num_steps += 1
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk(seq, budget, seq.num_computed)
            if n and self._reserve(seq, n, batch):
                batch.items.append(self._item(seq, n))
                budget -= n
        while not batch.preempted and self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            if not self._admit(self.waiting[0], budget, batch):
                break
            budget -= batch.items[-1].end - batch.items[-1].start
        return batch

    def _admit(self, seq: Sequence, budget: int, batch: Batch) -> bool:
        tokens = seq.token_ids()
        hit = self.kv.match_prefix(tokens)
        reused = len(hit[0]) * self.kv.block_size if hit else 0
        n = self._chunk(seq, budget, reused)
        if not n or not self._fits_new(hit, reused + n):
            return False
        self.waiting.popleft()
        seq.cache = self.kv.admit(tokens)
        seq.num_computed = seq.num_cached_tokens = seq.cache.num_reused_tokens
        self.kv.allocate(seq.cache, seq.num_computed + n)
        seq.status = Status.RUNNING
        self.running.append(seq)
        batch.items.append(self._item(seq, n))
        return True

    def _fits_new(self, hit, num_tokens: int) -> bool:
        """A slot, plus blocks for num_tokens beyond the hit (a free cached hit block leaves the free list)."""
        shared = hit[0] if hit else []
        revived = sum(1 for b in shared if self.kv.blocks[b].ref_count == 0)
        need = self.kv.blocks_for(num_tokens) - len(shared) + revived
        return bool(self.kv.free_slots) and need <= self.kv.num_free_blocks

    def _chunk(self, seq: Sequence, budget: int, computed: int) -> int:
        """How many tokens of seq to run next, starting at `computed`; 0 when none now."""
        if seq.outputs_scheduled() >= seq.params.max_tokens:
            return 0  # its last sample is in flight; it finishes when that step is processed
        remaining = seq.num_tokens - computed
        if remaining <= 0:
            return 0
        if self._whole_prompt(seq, computed):
            n = seq.num_prompt_tokens - computed if self.config.compact_keep_tokens else remaining
            # may go over this step's remaining budget, never over a step's whole budget on its own
            return n if n <= budget or (n <= self.config.max_num_batched_tokens and budget > 0) else 0
        n = min(remaining, budget)
        if self.config.compact_keep_tokens:
            n = min(n, self.config.compact_keep_tokens)  # nothing dropped by the late layers
        return self._align_to_blocks(seq, computed, n)

    def _whole_prompt(self, seq: Sequence, computed: int) -> bool:
        if self.config.compact_keep_tokens:
            return computed == 0
        return not self.config.chunked_prefill and computed < seq.num_prompt_tokens

    def _align_to_blocks(self, seq: Sequence, computed: int, n: int) -> int:
        """End a prompt chunk on a block boundary when it helps prefix reuse (a snapshot is taken there)."""
        if not self.kv.enable_prefix_caching or computed >= seq.num_prompt_tokens:
            return n
        bs = self.kv.block_size
        last_full = (seq.num_prompt_tokens - 1) // bs * bs  # the prompt's last boundary before its final token
        if computed < last_full:
            n = min(n, last_full - computed)
            aligned = (computed + n) // bs * bs - computed
            n = aligned if aligned > 0 else n
        return n

    def _reserve(self, seq: Sequence, n: int, batch: Batch) -> bool:
        """Blocks for seq's next n tokens, preempting from the tail; False if seq itself had to go."""
        while not self.kv.can_allocate(seq.cache, seq.num_computed + n):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        self.kv.allocate(seq.cache, seq.num_computed + n)
        return True

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        self.kv.release(seq.cache)
        seq.cache = None
        seq.num_computed = seq.num_inflight = 0
        seq.epoch += 1
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        batch.preempted.append(seq.request_id)

    def _item(self, seq: Sequence, n: int) -> ScheduledItem:
        start, end = seq.num_computed, seq.num_computed + n
        seq.num_computed = end
        samples = end == seq.num_tokens
        if samples:
            seq.num_inflight += 1
        init, seq.cache.initial_state = seq.cache.initial_state, None
        return ScheduledItem(seq, seq.epoch, start, end, samples, tuple(seq.cache.block_ids), seq.cache.slot, init)
