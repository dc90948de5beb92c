"""Run one scheduled batch through the plan's graph, and sample.

On ``cpu`` the batch runs one request at a time through the interpreter (the ops' torch references): the
graph is written for one sequence per call, so each item gathers its dense caches, runs its tokens, and
scatters the updated caches back (kv_cache.py). The seam for compiled kernels is ``ModelRunner``; scheduling,
caches bookkeeping and sampling stay as they are.

A runner may also offer (CudaRunner does):
  ``selects_logit_rows`` True: forward takes ``logit_rows`` (rows of its [T', vocab] logits, negative from the end)
                         and computes only those (passes/select_logit_rows.py): a prefill item asks for its last
                         row when it samples, for none otherwise (a chunk that does not end the prompt);
  ``cache_len``          dense caches are sized by it instead of the request's max_len;
  ``forward_device``     forward returning device logits (only the sampled row is copied to the host);
  ``decode_batch_max``   > 0: ``decode(tokens, positions, fill)`` runs up to that many single-token steps at
                         once (static slots, CUDA graphs per batch-size bucket); every T=1 item of a batch goes
                         there when the KV pools live on the runner's device, in chunks of decode_batch_max.
                         If a decode call raises, its items run one by one through ``forward`` instead.
"""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer.ir import interpreter
from deepinfer.ir.graph import Graph
from deepinfer.passes.select_logit_rows import rows_feed, rows_graph
from deepinfer.runtime.kv_cache import KVCacheManager
from deepinfer.runtime.sampler import Sample, sample_row
from deepinfer.runtime.scheduler import Batch, ScheduledItem


class ModelRunner(Protocol):
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, caches: dict) -> tuple[torch.Tensor, dict]:
        """One sequence: (logits [T', vocab], updated caches by name)."""


class InterpreterRunner:
    """The ``cpu`` target: the optimised graph (with logit_rows where its head is found) through the interpreter."""

    def __init__(self, graph: Graph, params: dict[str, torch.Tensor]):
        self.graph, self.logit_rows_off = rows_graph(graph)
        self.params = params
        self.cache_names = [e["name"] for e in graph.meta.get("caches", [])]
        self.selects_logit_rows = self.logit_rows_off is None

    def forward(self, tokens, positions, caches, logit_rows=None):
        feeds = {"tokens": tokens, "positions": positions, **caches,
                 **rows_feed(self.graph, len(tokens), logit_rows, self.logit_rows_off)}  # fmt: skip
        outs = interpreter.run(self.graph, feeds, self.params)
        return outs[0], dict(zip(self.cache_names, outs[1 : 1 + len(self.cache_names)]))


class Executor:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager):
        self.runner, self.kv = runner, kv

    def execute(self, batch: Batch) -> list[Sample | Exception | None]:
        """Per item, in order: its sample, None (no sample, or the item went stale), or the exception that
        failed it (that request finishes with "error"; the others carry on)."""
        return self.forward_batch(batch)

    def forward_batch(self, batch: Batch) -> list[Sample | Exception | None]:
        items = batch.items
        out: list[Sample | Exception | None] = [None] * len(items)
        rest = list(range(len(items)))
        chunk = getattr(self.runner, "decode_batch_max", 0)
        if chunk and _same_device(self.kv.device, getattr(self.runner, "device", None)):
            decode = [i for i in rest if items[i].end - items[i].start == 1]
            rest = [i for i in rest if items[i].end - items[i].start != 1]
            for k in range(0, len(decode), chunk):
                part = [i for i in decode[k : k + chunk] if not items[i].stale]  # stale: skipped, as below
                if part:
                    for i, res in zip(part, self._decode_guarded([items[i] for i in part])):
                        out[i] = res
        for i in rest:
            out[i] = None if items[i].stale else self._run_guarded(items[i])
        return out

    def _run_guarded(self, item: ScheduledItem) -> Sample | Exception | None:
        try:
            return self.run_item(item)
        except Exception as e:  # one request's failure must not take the batch down
            return e

    def run_item(self, item: ScheduledItem) -> Sample | None:
        seq = item.seq
        # read the tokens now: a decode item's token was sampled by the previous step, processed just before
        tokens = seq.token_ids()[item.start : item.end]
        length = getattr(self.runner, "cache_len", None) or seq.max_len
        caches = self.kv.gather(list(item.block_ids), item.slot, item.start, length, item.initial_state)
        forward = getattr(self.runner, "forward_device", None) or self.runner.forward
        # only the sampled row's logits (none for a chunk that does not end the prompt), where the runner can
        rows = {"logit_rows": [-1] if item.samples else []} if getattr(self.runner, "selects_logit_rows", False) else {}
        ids, pos = torch.tensor(tokens, dtype=torch.long), torch.arange(item.start, item.end)
        logits, new = forward(ids, pos, caches, **rows)
        self.kv.scatter(list(item.block_ids), item.slot, new, item.start, item.end)
        if not item.samples:
            return None
        return self._sample(item, logits[-1])

    def _sample(self, item: ScheduledItem, row: torch.Tensor) -> Sample:
        seq = item.seq
        row = row if row.device.type == "cpu" else row.float().cpu()
        return sample_row(row, seq.params, seq.seed, item.end, seq.prompt_ids, seq.output_ids)

    def _decode_guarded(self, items: list[ScheduledItem]) -> list[Sample | Exception | None]:
        """Single-token items through runner.decode; if that raises (before any cache was written back), each
        item runs alone through forward, so one bad request still fails only itself."""
        try:
            logits, new = self.runner.decode(
                [item.seq.token_ids()[item.start] for item in items], [item.start for item in items],
                lambda j, caches: self.kv.gather_into(caches, list(items[j].block_ids), items[j].slot,
                                                      items[j].start, items[j].initial_state),
            )  # fmt: skip
        except Exception:
            return [self._run_guarded(item) for item in items]
        out: list[Sample | Exception | None] = []
        for j, item in enumerate(items):
            try:
                self.kv.scatter(list(item.block_ids), item.slot, new[j], item.start, item.end)
                out.append(self._sample(item, logits[j]) if item.samples else None)
            except Exception as e:
                out.append(e)
        return out


def _same_device(a: torch.device, b) -> bool:
    return b is not None and a.type == torch.device(b).type and (a.index or 0) == (torch.device(b).index or 0)
