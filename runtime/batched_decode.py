"""One decode step of B sequences through the batched graph (passes/batch_decode.py) on the sm90 executor.

    dec = BatchedDecoder(plan.graph, params, device="cuda", max_model_len=4096)
    caches = dec.stack([seq0_caches, seq1_caches, ...])     # [B, *shape] per cache (or allocate(B))
    logits, caches = dec.step(tokens, positions, caches)     # logits [B, vocab]; caches updated (in place)

The batched graph's row-wise nodes keep the plan's kernel bindings (select_kernels bound them per T bucket, and
T is now the number of sequences): the GEMMs, MoE, norms and mHC run their kernels at T = B, reading every
weight once for the B sequences. Attention runs the decode kernel unchanged over the flattened pools (each
query gathers its own rows: flat row ids). The batched_* ops (ir/ops/batched.py) run their vectorised torch
references, sync-free (no host reads), so the step can be captured as CUDA graphs (runtime/layer_graphs.py).

Cache writes in place (``donate_caches``, the default): the graph writes each cache with scatter_rows, whose
functional form -- and the cache_rows kernel adapter -- copies the whole pool first. At B sequences x 4k context
that copy is B times one sequence's cache per write (0.5 GB for a V4.1 ratio-1 layer at B = 64), so the decoder
writes the rows into the pool itself: the verifier guarantees the old version has no later reader, and the pool
is a view of the caller's [B, ...] cache tensor (the graph's output for that cache is a view of it too); step()
copies the small functional states (compressor rings, Engram history) back, so every tensor passed in holds the
new state afterwards, as the runtime's static decode slots want. Each sequence writes at most one row per pool per step, into its own rows, so a
skipped write (-1: a compressor that did not close a window) rewrites a row of its own with its current value,
a fixed-shape index_copy_ without a host read. A replay of the same step writes the same rows with the same
values (the compressor states are functional outputs), so CUDA-graph replays stay idempotent.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deepinfer.ir.graph import Graph
from deepinfer.passes.batch_decode import batch_decode
from deepinfer.runtime.cuda_executor import GraphExecutor, KernelCache, Step
from deepinfer.runtime.kernel_adapters import MAX_POSITIONS
from deepinfer.runtime.session import allocate_caches


def scatter_rows_in_place(pool: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """pool[index[b]] = rows[b] in place for one row per sequence (index [B], flat rows of sequence b's part of
    pool, or -1 = skip); returns pool. See the module doc for why a skip rewrites row b*N."""
    b = index.shape[0]
    own = torch.arange(b, device=index.device) * (pool.shape[0] // b)
    keep = index >= 0
    dest = torch.where(keep, index.long(), own)
    vals = torch.where(keep.view(-1, *([1] * (rows.dim() - 1))), rows, pool[own])
    return pool.index_copy_(0, dest, vals)


class BatchedExecutor(GraphExecutor):
    """GraphExecutor for a batched decode graph: scatter_rows into the pools in place (donate=True)."""

    def __init__(self, g: Graph, params: Mapping[str, torch.Tensor], *, donate: bool = True, **kw):
        super().__init__(g, params, **kw)
        self.donate = donate

    def _run_node(self, step: Step, args: list, attrs: dict, t: int) -> list:
        if self.donate and step.node.op == "scatter_rows" and _one_row_per_sequence(args, t):
            self.stats.compiled["scatter_rows in place"] += 1
            self.stats.per_node[step.outputs[0]] = "compiled scatter_rows in place"
            return [scatter_rows_in_place(*args)]
        return super()._run_node(step, args, attrs, t)


def _one_row_per_sequence(args: list, t: int) -> bool:
    pool, index, _ = args
    return index.dim() == 1 and index.shape[0] == t and pool.shape[0] % t == 0


class BatchedDecoder:
    """The batched decode step of a plan graph on ``device`` (see the module doc). ``compiled=False`` runs every
    node's torch reference (the eager baseline of the same batched graph)."""

    def __init__(self, g: Graph, params: Mapping[str, torch.Tensor], device: str | torch.device = "cuda", *,
                 max_model_len: int, compiled: bool = True, donate_caches: bool = True,
                 kernels: KernelCache | None = None, verify: bool = True):  # fmt: skip
        self.single = g
        self.graph = batch_decode(g)
        self.device = torch.device(device)
        self.max_len = max_model_len
        self.cache_names = [e["name"] for e in g.meta.get("caches", [])]
        self.exec = BatchedExecutor(self.graph, params, donate=donate_caches, compiled=compiled, kernels=kernels,
                                    verify=verify, sync_free="always", max_positions=max_model_len)  # fmt: skip
        self.exec.prep_cache[MAX_POSITIONS] = max_model_len

    def allocate(self, n_seq: int) -> dict[str, torch.Tensor]:
        """Initial caches of n_seq empty sequences, [n_seq, *shape] each."""
        one = allocate_caches(self.single, self.max_len, device=self.device)
        return {k: v.unsqueeze(0).repeat(n_seq, *([1] * v.dim())) for k, v in one.items()}

    def stack(self, seqs: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One [B, *shape] tensor per cache from B sequences' dense caches (sized by max_model_len)."""
        return {k: torch.stack([s[k] for s in seqs]).to(self.device) for k in self.cache_names}

    def feeds(self, tokens, positions, caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dev = self.device
        return {"tokens": torch.as_tensor(tokens, dtype=torch.long).to(dev),
                "positions": torch.as_tensor(positions, dtype=torch.long).to(dev), **caches}  # fmt: skip

    def step(self, tokens, positions, caches: Mapping[str, torch.Tensor]):
        """One token for each of B sequences: (logits [B, vocab] on the device, new caches by name). With
        donate_caches the tensors passed in hold the new state afterwards (the pools written in place, the small
        states -- compressor rings, Engram history -- copied back) and are the ones returned."""
        outs = self.exec.run(self.feeds(tokens, positions, caches))
        new = dict(zip(self.cache_names, outs[1 : 1 + len(self.cache_names)]))
        if not self.exec.donate:
            return outs[0], new
        for k, v in new.items():
            if v.data_ptr() != caches[k].data_ptr():
                caches[k].copy_(v)
        return outs[0], {k: caches[k] for k in self.cache_names}

    def report(self) -> str:
        return self.exec.report()
