"""Engram n-gram hash memory ops (MODEL_SPEC §2.14): the compressed token map, the hash row ids, the n-gram
history update, the table lookup (FP8 rows with ue8m0 scales per 32 values) and the gate.

Per sequence, the Engram state is the last ``N-1`` token ids (``history``, oldest first, -1 where the
position is negative); positions are contiguous as everywhere else.
"""

from __future__ import annotations

import functools
import math

import torch

from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import TensorType
from deepinfer.ir.registry import Attr, register_op, shape_fail

REAL_VOCAB = 129280


@functools.lru_cache(maxsize=1)
def _real_token_map() -> torch.Tensor:
    """The compressed token map of the DeepSeek tokenizer (99,092 classes), built once per process.

    The tokenizer owns the rule (models/tokenizer.py, ``Tokenizer.engram_token_map``); the op only needs the
    table, so it is kept here as one int64 tensor instead of being rebuilt from a Python list every call."""
    from deepinfer.models.tokenizer import get_tokenizer

    return torch.tensor(get_tokenizer().engram_token_map(), dtype=torch.int64)


def token_map(vocab: int, compressed_vocab: int, device=None) -> torch.Tensor:
    """Token id -> compressed class: the tokenizer map for the real 129,280-id vocabulary, else (tiny test
    vocabularies) ``t % compressed_vocab``."""
    if vocab == REAL_VOCAB:
        return _real_token_map().to(device)
    return torch.arange(vocab, dtype=torch.int64, device=device) % compressed_vocab


def hash_lookbacks(lookback, *, multipliers, primes, n_heads, pad_id, vocab, compressed_vocab, image_token_id):
    """Engram row ids from lookbacks: lookback [R, N], column s = the token s back (s = 0: the row's own token),
    -1 = none -> i64 [R, (N-1)*n_heads] (engram_hash's doc has the formula)."""
    n, rows = len(multipliers), lookback.shape[0]
    cmap = token_map(vocab, compressed_vocab, lookback.device)
    pad_c = cmap[pad_id]
    blocked = torch.zeros(rows, dtype=torch.bool, device=lookback.device)
    h = torch.zeros(rows, dtype=torch.int64, device=lookback.device)
    cols, offset = [], 0
    for s in range(n):  # c_s: once a lookback passes a negative position or an image token, so do the longer ones
        tok = lookback[:, s]
        blocked = blocked | (tok < 0) | (tok == image_token_id)
        h = h ^ (torch.where(blocked, pad_c, cmap[tok.clamp(min=0)]) * multipliers[s])
        if s == 0:
            continue
        for p in primes[(s - 1) * n_heads : s * n_heads]:
            cols.append(torch.remainder(h, p) + offset)
            offset += p
    return torch.stack(cols, dim=-1)


def hash_ids(tokens, history, **attrs):
    """One sequence: tokens [T] after history [N-1] (oldest first)."""
    n, t = len(attrs["multipliers"]), tokens.shape[0]
    toks = torch.cat([history.long(), tokens.long()])  # row r = position start - (n-1) + r; -1 = none
    return hash_lookbacks(torch.stack([toks[n - 1 - s : n - 1 - s + t] for s in range(n)], dim=1), **attrs)


HASH_ATTRS = {
    "multipliers": Attr("ints"),
    "primes": Attr("ints"),
    "n_heads": Attr("int"),
    "pad_id": Attr("int", 2),
    "vocab": Attr("int"),
    "compressed_vocab": Attr("int"),
    "image_token_id": Attr("int", -2),
}


@register_op("engram_hash", "tokens, history", HASH_ATTRS, level="model")
class EngramHash:
    """Engram table row ids (MODEL_SPEC §2.14) for one Engram layer.

    tokens [T] (positions start..), history [N-1] (ids of positions start-N+1 .. start-1, -1 = none) ->
    i64 [T, (N-1)*n_heads], columns in (n-gram size 2..N, head) order. c_s = cmap[token_{t-s}], or cmap[pad]
    once the lookback passes a negative position or an image token; hash_n = XOR_{s<n} c_s * mult[s];
    row = hash_n mod P[n][h] + offset[n][h] (offset = prefix sum of the primes). ``multipliers`` has N
    entries (2v+1, from numpy default_rng(10007*layer)), ``primes`` (N-1)*n_heads.
    """

    def infer(tokens, history, *, multipliers, primes, n_heads, **_):
        n = len(multipliers)
        if tokens.rank != 1 or history.shape != (n - 1,) or len(primes) != (n - 1) * n_heads:
            raise shape_fail(
                "engram_hash", f"needs tokens [T], history [{n - 1}] and (N-1)*heads primes", tokens, history
            )
        return TensorType(dt.i64, (tokens.shape[0], len(primes)))

    def reference(tokens, history, **attrs):
        return hash_ids(tokens, history, **attrs)


@register_op("engram_history", "history, tokens", stateful=True, writes={0: 0}, level="model")
class EngramHistory:
    """The n-gram history after this batch: the last N-1 ids of concat(history, tokens) (MODEL_SPEC §2.14)."""

    def infer(history, tokens):
        if history.rank != 1 or tokens.rank != 1:
            raise shape_fail("engram_history", "needs history [N-1] and tokens [T]", history, tokens)
        return history

    def reference(history, tokens):
        n = history.shape[0]
        return torch.cat([history, tokens.to(history.dtype)])[-n:].clone() if n else history.clone()


@register_op("engram_embed", "table, scale?, ids", level="model")
class EngramEmbed:
    """Gather Engram table rows and concatenate them (MODEL_SPEC §2.14): table [R, hd] (f32/bf16, or f8e4m3
    with e8m0 scale [R, hd/32]), ids [T, K] -> f32 [T, K*hd]."""

    def infer(table, scale, ids):
        if table.rank != 2 or ids.rank != 2 or ids.dtype not in (dt.i32, dt.i64):
            raise shape_fail("engram_embed", "needs table [R, hd] and integer ids [T, K]", table, ids)
        if (table.dtype == dt.f8e4m3) != (scale is not None):
            raise shape_fail("engram_embed", "an f8e4m3 table needs its scale (and only it)", table, scale)
        return TensorType(dt.f32, (ids.shape[0], ids.shape[1] * table.shape[1]))

    def reference(table, scale, ids):
        rows = table[ids.long()].float()  # [T, K, hd]
        if scale is not None:
            s = dt.e8m0_to_float(scale[ids.long()])  # [T, K, hd/32]
            rows = (rows.unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(-2)
        return rows.flatten(-2)


@register_op(
    "engram_gate",
    "x, kv, q_weight, k_weight, tokens",
    {"eps": Attr("float", 1e-20), "clamp": Attr("float", 1e-6), "image_token_id": Attr("int", -2)},
    level="model",
)
class EngramGate:
    """Engram gating into the residual streams (MODEL_SPEC §2.14), all fp32.

    x [T, n, D]; kv [T, (n+1)*D] = n keys then the value; q_weight, k_weight [n, D]; tokens [T].
    dot_i = sum_d X_i q_i k_i key_i * rsqrt(ms(X_i)+eps) * rsqrt(ms(key_i)+eps) * D^-0.5,
    g_i = sigmoid(sign(dot_i) * sqrt(max(|dot_i|, clamp))) (sign + at 0), X_i += g_i * value.
    Rows whose token is the image token are left unchanged.
    """

    def infer(x, kv, q_weight, k_weight, tokens, **_):
        if x.rank != 3:
            raise shape_fail("engram_gate", "x must be [T, n, D]", x)
        t, n, d = x.shape
        if kv.shape != (t, (n + 1) * d) or q_weight.shape != (n, d) or k_weight.shape != (n, d):
            raise shape_fail("engram_gate", "needs kv [T, (n+1)*D], q/k weights [n, D]", x, kv, q_weight, k_weight)
        if tokens.shape != (t,):
            raise shape_fail("engram_gate", "tokens must be [T]", x, tokens)
        return x

    def reference(x, kv, q_weight, k_weight, tokens, *, eps, clamp, image_token_id):
        t, n, d = x.shape
        xf = x.float()
        key = kv.float()[:, : n * d].unflatten(-1, (n, d))
        value = kv.float()[:, n * d :]
        r = torch.rsqrt(xf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
        dot = (xf * (q_weight.float() * k_weight.float()) * key).sum(-1) * r / math.sqrt(d)
        mag = dot.abs().clamp(min=clamp).sqrt()
        g = torch.sigmoid(torch.where(dot < 0, -mag, mag))
        out = xf + g.unsqueeze(-1) * value.unsqueeze(1)
        img = (tokens.long() == image_token_id).view(t, 1, 1)
        return torch.where(img, xf, out).to(x.dtype)
