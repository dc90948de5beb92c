"""One sequence through a model graph with the interpreter, the session owning the explicit caches.

This is the reference execution path (the runtime's batched executor is checked against it): the graph is a
pure function (tokens, positions, caches) -> (logits, new caches), so a session just keeps the caches the
graph returns and feeds them back on the next call. Prefill is one call with the prompt; each decode step is
one call with one token. ``forward(tokens, logit_rows=[-1])`` computes only the logits rows asked for (the graph
rewritten by passes/select_logit_rows.py, made on first use); by default every row, through the graph as given.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import torch

from deepinfer.errors import ConfigError, DeepInferError
from deepinfer.ir import dtypes as dt
from deepinfer.ir import interpreter
from deepinfer.ir.graph import Graph
from deepinfer.ir.shapes import evaluate, parse_dim
from deepinfer.passes.select_logit_rows import ROWS_INPUT, row_indices, select_logit_rows

_RATIO_SYMBOL = re.compile(r"C(\d+)$")


def cache_symbols(g: Graph, max_len: int) -> dict[str, int]:
    """Sizes of the cache-length symbols: ``C{m}`` holds one row per m tokens, so ceil(max_len / m)."""
    env: dict[str, int] = {}
    for entry in g.meta.get("caches", []):
        for d in entry["shape"]:
            for name in _free_symbols(d):
                m = _RATIO_SYMBOL.match(name)
                if not m:
                    raise ConfigError(f"cache {entry['name']}: cannot size symbol {name} (expected C<ratio>)")
                env[name] = max(1, math.ceil(max_len / int(m.group(1))))
    return env


def _free_symbols(d: str) -> set[str]:
    dim = parse_dim(d)
    return set() if isinstance(dim, int) else dim.free_symbols


def allocate_caches(g: Graph, max_len: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Zero-filled caches for one sequence of at most max_len tokens, as graph.meta["caches"] describes."""
    env = cache_symbols(g, max_len)
    out = {}
    for entry in g.meta.get("caches", []):
        shape = tuple(evaluate(parse_dim(d), env) for d in entry["shape"])
        dtype = dt.dtype(entry.get("dtype", "f32")).torch_dtype
        # A cache starts zeroed unless the graph says otherwise (e.g. Engram history starts at -1, "none").
        out[entry["name"]] = torch.full(shape, entry.get("init", 0), dtype=dtype, device=device)
    return out


@dataclass
class Session:
    """Greedy or externally-sampled decoding of one sequence through the interpreter."""

    graph: Graph
    params: dict[str, torch.Tensor]
    max_len: int
    caches: dict[str, torch.Tensor] = field(default_factory=dict)
    length: int = 0

    def __post_init__(self):
        if not self.caches:
            self.caches = allocate_caches(self.graph, self.max_len)
        self._cache_names = [e["name"] for e in self.graph.meta.get("caches", [])]
        self._rows_graph: Graph | None = None

    def forward(self, tokens: list[int], logit_rows=None) -> torch.Tensor:
        """Run the next len(tokens) tokens; returns their logits [T, vocab] (only the rows ``logit_rows`` names,
        negative from the end, when given) and keeps the new caches."""
        if not tokens:
            raise DeepInferError("forward needs at least one token")
        if self.length + len(tokens) > self.max_len:
            n = self.length + len(tokens)
            raise DeepInferError(f"sequence would reach {n} tokens, over max_len {self.max_len}")
        feeds = {
            "tokens": torch.tensor(tokens, dtype=torch.long),
            "positions": torch.arange(self.length, self.length + len(tokens)),
            **self.caches,
        }
        graph = self.graph
        if logit_rows is not None:
            graph = self._rows_graph = self._rows_graph or select_logit_rows(self.graph)
            feeds[ROWS_INPUT] = row_indices(graph, len(tokens), logit_rows)
        outs = interpreter.run(graph, feeds, self.params)
        logits, new_caches = outs[0], outs[1 : 1 + len(self._cache_names)]
        self.caches = dict(zip(self._cache_names, new_caches))
        self.length += len(tokens)
        return logits


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    prefill_s: float
    decode_s: float

    @property
    def decode_tok_s(self) -> float:
        steps = max(len(self.output_ids) - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0


def greedy_generate(
    graph: Graph, params: dict[str, torch.Tensor], prompt_ids: list[int], max_tokens: int, stop_ids=()
) -> GenerationResult:
    """Prefill the prompt, then decode one token at a time, always taking the most likely token."""
    session = Session(graph, params, max_len=len(prompt_ids) + max_tokens)
    t0 = time.perf_counter()
    logits = session.forward(prompt_ids, logit_rows=[-1])
    nxt = int(torch.argmax(logits[-1]))
    prefill_s = time.perf_counter() - t0
    out = [nxt]
    t1 = time.perf_counter()
    while len(out) < max_tokens and nxt not in stop_ids:
        nxt = int(torch.argmax(session.forward([nxt])[-1]))
        out.append(nxt)
    return GenerationResult(list(prompt_ids), out, prefill_s, time.perf_counter() - t1)
