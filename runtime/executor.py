"""Run one scheduled batch through the plan's graph, and sample.

On ``cpu`` the batch runs one request at a time through the interpreter (the ops' torch references): the
graph is written for one sequence per call, so each item gathers its dense caches, runs its tokens, and
scatters the updated caches back (kv_cache.py). The seam for compiled kernels is ``ModelRunner``: a runner
for a GPU target takes the whole batch at once (ragged tokens + block tables into paged kernels, CUDA graphs
for decode batch-size buckets) and replaces ``Executor.forward_batch``; scheduling, caches bookkeeping and
sampling stay as they are.
"""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer.ir import interpreter
from deepinfer.ir.graph import Graph
from deepinfer.runtime.kv_cache import KVCacheManager
from deepinfer.runtime.sampler import Sample, sample_row
from deepinfer.runtime.scheduler import Batch, ScheduledItem


class ModelRunner(Protocol):
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, caches: dict) -> tuple[torch.Tensor, dict]:
        """One sequence: (logits [T', vocab], updated caches by name)."""


class InterpreterRunner:
    """The ``cpu`` target: the optimised graph through the interpreter."""

    def __init__(self, graph: Graph, params: dict[str, torch.Tensor]):
        self.graph, self.params = graph, params
        self.cache_names = [e["name"] for e in graph.meta.get("caches", [])]

    def forward(self, tokens, positions, caches):
        outs = interpreter.run(self.graph, {"tokens": tokens, "positions": positions, **caches}, self.params)
        return outs[0], dict(zip(self.cache_names, outs[1 : 1 + len(self.cache_names)]))


class Executor:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager):
        self.runner, self.kv = runner, kv

    def execute(self, batch: Batch) -> list[Sample | Exception | None]:
        """Per item, in order: its sample, None (no sample, or the item went stale), or the exception that
        failed it (that request finishes with "error"; the others carry on)."""
        return self.forward_batch(batch)

    def forward_batch(self, batch: Batch) -> list[Sample | Exception | None]:
        return [None if item.stale else self._run_guarded(item) for item in batch.items]

    def _run_guarded(self, item: ScheduledItem) -> Sample | Exception | None:
        try:
            return self.run_item(item)
        except Exception as e:  # one request's failure must not take the batch down
            return e

    def run_item(self, item: ScheduledItem) -> Sample | None:
        seq = item.seq
        # read the tokens now: a decode item's token was sampled by the previous step, processed just before
        tokens = seq.token_ids()[item.start : item.end]
        caches = self.kv.gather(list(item.block_ids), item.slot, item.start, seq.max_len, item.initial_state)
        logits, new = self.runner.forward(
            torch.tensor(tokens, dtype=torch.long), torch.arange(item.start, item.end), caches
        )
        self.kv.scatter(list(item.block_ids), item.slot, new, item.start, item.end)
        if not item.samples:
            return None
        return sample_row(logits[-1], seq.params, seq.seed, item.end, seq.prompt_ids, seq.output_ids)
