"""Peaked weights: a preset's seeded random weights with a deterministic next-token rule written into the
embedding and the head, for end-to-end token-equality checks (benchmarks/gpu_e2e.py ``=tiny:peaked``).

    peaked_weights(params, seed=0) -> (params', PeakedTask)

Why. With the presets' random weights, V4.1 tiny is chaotic at its kernels' number formats: a 1e-6 relative
perturbation of node outputs flips FP8 codes, MoE routes and index top-k choices, the flips cascade through the
ten layers, and the logits move by 30-48% of their range (benchmarks/format_sensitivity.py), so no two
implementations that sum in a different order can agree token for token. Two properties of a trained
checkpoint are missing from random weights: (1) its residual stream is much larger than each layer's update
(every sublayer reads it through an RMSNorm, so a layer's own activations keep their usual scale while its
write is a small relative change -- a perturbed write reaches the next layers' inputs damped), and
(2) its predictions are peaked where the continuation is determined (top-2 margins of several logits, not the
~0.15 of a 129,280-way random head).

What changes (two tensors; the graph, its number formats and every kernel stay those of the preset):
- ``embed.weight``: the rows of ``n_tokens`` seeded task tokens are multiplied by ``embed_gain`` (the
  residual stream then carries the current token at ``embed_gain`` times a layer's write; 0 and the other ids
  keep their random rows);
- ``head.weight``: the row of token next(x) becomes the vector whose dot product with x's final-norm image
  (RMSNorm of x's embed row, times ``norm.weight``) is ``head_logit``, where next() is one seeded cycle
  through the task tokens, so greedy decoding from any task token walks the cycle;
- nothing else: attention, the compressors, the indexer and candidate selection, Engram, mHC (Sinkhorn) and the
  MoE keep the preset's random weights, see unit-scale inputs (RMSNorm), and still add their outputs to the
  residual stream, so they move every logit (format_sensitivity.py reports by how much).

Measured on the CPU (format_sensitivity.py --weights peaked, 3 prompts + 40 tokens, perturbation seeds 0-2): the
1e-6 envelope falls from 3.2-5.3 logits (32-48% of the range) to 0.5-0.92 (2-4%), MoE route flips from 386 to 52
and index top-k row flips from 434 to 149 over the three sequences (the layers stay sensitive inside, less so),
top-2 margins are 7-9 logits so every continuation step is decisive, and the layers still move the logits by ~2.3.
On the H200 (8 prompts x 64 tokens, BENCHMARKS.md): envelope 1.33, compiled vs formats 1.24, 512/512 steps
decisive, tokens equal 8/8 x 64.

What it does not weaken: the kernels compute on operands of the same shapes and scales as with the random
weights (every sublayer's input is RMS-normalised), every node still runs, and the compared quantities are the
same (per-step max |logit difference| against the formats path, free-running tokens). What it does weaken: a
wrong layer output now moves the logits by ``1/embed_gain`` of what it did, so a kernel bug must be larger to
flip a token; the per-kernel comparison against the emulation on identical operands (gpu_e2e.PairedKernels)
is the check that does not depend on the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TASK_TOKENS = 512  # task vocabulary: enough for 8 prompts of up to 55 tokens plus 64 generated, all distinct
# a small gain with a safety factor (CPU, seed 0): envelope / decisive steps at gain 4: 1.4-3.6 logits, not all
# decisive; 6: 1.0-1.5, all; 8: 0.67-0.92, all, margins (>= 7) ~4x twice the envelope; 16: 0.34-0.39 (the layers'
# effect on the logits shrinks with the gain too: ~2.9 at 6, ~2.3 at 8, ~1.2 at 16)
EMBED_GAIN = 8.0
HEAD_LOGIT = 16.0  # the task logit when the final hidden state is exactly the current token's image


@dataclass(frozen=True)
class PeakedTask:
    """The seeded next-token rule: ``tokens`` in cycle order; next(tokens[i]) = tokens[(i + 1) % n]."""

    tokens: tuple[int, ...]

    def next_token(self, x: int) -> int:
        i = self.tokens.index(x)
        return self.tokens[(i + 1) % len(self.tokens)]

    def prompts(self, lens: tuple[int, ...]) -> list[list[int]]:
        """BOS (0) then task tokens, a different seeded stretch of ids per prompt (not cycle runs, so the
        prompt's continuation is decided by its last token alone)."""
        g = torch.Generator().manual_seed(1234)
        out = []
        for n in lens:
            pick = torch.randperm(len(self.tokens), generator=g)[: n - 1].tolist()
            out.append([0, *[self.tokens[i] for i in pick]])
        return out

    def continuation(self, prompt: list[int], n: int) -> list[int]:
        out, x = [], prompt[-1]
        for _ in range(n):
            x = self.next_token(x)
            out.append(x)
        return out


def task_for(vocab: int, seed: int = 0, n_tokens: int = TASK_TOKENS) -> PeakedTask:
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(vocab - 1, generator=g)[:n_tokens] + 1).tolist()  # never 0 (BOS)
    return PeakedTask(tuple(ids))


def peaked_weights(params: dict, seed: int = 0, n_tokens: int = TASK_TOKENS, embed_gain: float = EMBED_GAIN,
                   head_logit: float = HEAD_LOGIT) -> tuple[dict, PeakedTask]:  # fmt: skip
    """``params`` (the preset's tensors by checkpoint name) with the task written into embed and head rows.
    Deterministic in (params, seed); the input dict is not modified."""
    embed, head, norm = params["embed.weight"], params["head.weight"], params["norm.weight"]
    task = task_for(embed.shape[0], seed, n_tokens)
    ids = torch.tensor(task.tokens)
    new_embed = embed.clone()
    new_embed[ids] = (embed[ids].float() * embed_gain).to(embed.dtype)
    rows = new_embed[ids].float()
    hidden = rows / rows.pow(2).mean(-1, keepdim=True).sqrt() * norm.float()  # the final RMSNorm's image of x
    new_head = head.clone()
    new_head[ids.roll(-1)] = (head_logit * hidden / hidden.pow(2).sum(-1, keepdim=True)).to(head.dtype)
    out = dict(params)
    out["embed.weight"], out["head.weight"] = new_embed, new_head
    return out, task
