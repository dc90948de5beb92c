"""engram_hash (V4.1's Engram row ids, MODEL_SPEC §2.14) in one Triton launch.

Per token row r of a sequence, with lookback[r, s] = the id s tokens back (s = 0: its own; -1: before the sequence):

    c_s      = cmap[lookback[r, s]], or cmap[pad] once a lookback (this one or a shorter one) is negative or the image
               token                                         cmap: the tokenizer's compressed map (99,092 classes)
    h_n      = XOR_{s<n} c_s * mult[s]                       n = 2..N; int64 (no wraparound at the model's numbers)
    out[r, (n-2) * H + h] = h_n mod P[n][h] + offset[n][h]   floor modulo; offset = the primes' prefix sum

The op's torch reference (ir/ops/engram.py hash_lookbacks) is ~25 + 2 x 24 small int64 launches: 0.14 ms of a
2.75 ms decode layer in session 11's H200 run (5%). Here a program takes `block_rows` rows: their N lookbacks, N
gathers from the map, the N-1 hashes, then the [rows, K] tile of remainders (K = (N-1) x H = 24; KP = K padded to a
power of two) -- a few us, launch-bound. The multipliers, primes and offsets are one small int64 tensor (the same
program for both Engram layers), the map an int64 tensor on the device; both are made once by the caller
(runtime/kernel_adapters.EngramHashAdapter caches them), so a captured step has no host -> device copy.

Two row layouts (the `batched` flag): one sequence (engram_hash: tokens [T] after history [N-1], oldest first) and B
sequences of one token each (batched_engram_hash: tokens [B], history [B*(N-1)], each row its own history).
Token ids past the map are the caller's error: the reference raises on them, the kernel reads class 0 (a device
check would need a host read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # optional; the jit functions are module globals so the interpreter (TRITON_INTERPRET=1) can run them
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

FAMILY = "engram_hash"


@dataclass(frozen=True)
class Config:
    block_rows: int = 32  # token rows a program hashes (a power of two)
    num_warps: int = 2

    @property
    def tag(self) -> str:
        return f"r{self.block_rows}w{self.num_warps}"


def default_config(T_: int) -> Config:
    """32 rows a program on 2 warps: a decode step of 64 tokens is 2 programs, a 4096-token prefill 128."""
    return Config()


def config_space(T_: int) -> list[Config]:
    return [Config(), *(Config(r, w) for r in (8, 16, 32, 64) for w in (1, 2, 4) if (r, w) != (32, 2))]


def check_config(cfg: Config) -> None:
    if cfg.block_rows <= 0 or cfg.block_rows & (cfg.block_rows - 1):
        raise ValueError(f"engram_hash: block_rows must be a power of two, got {cfg.block_rows}")


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def roofline(T_: int, N: int, K: int, batched: bool) -> float:
    """Bytes: the token ids and histories read (int64), N map entries gathered a row (int64), the ids written."""
    history = (N - 1) * (T_ if batched else 1)
    return float(8 * (T_ + history + T_ * N + T_ * K))


def reference(tokens, history, *, batched: bool = False, **attrs) -> torch.Tensor:
    """The op's reference (engram_hash, or batched_engram_hash)."""
    from deepinfer.ir.ops.batched import BatchedEngramHash
    from deepinfer.ir.ops.engram import EngramHash

    return (BatchedEngramHash if batched else EngramHash).reference(tokens, history, **attrs)


def hash_constants(multipliers, primes, device=None) -> torch.Tensor:
    """mult [N] | primes [K] | offsets [K] (the primes' prefix sums, in column order) as one int64 tensor."""
    offsets, total = [], 0
    for p in primes:
        offsets.append(total)
        total += int(p)
    return torch.tensor([*map(int, multipliers), *map(int, primes), *offsets], dtype=torch.int64, device=device)


def device_tables(attrs: dict, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the compressed token map on `device`, hash_constants, the pad id's class) for the op's attributes."""
    from deepinfer.ir.ops.engram import token_map

    cmap = token_map(int(attrs["vocab"]), int(attrs["compressed_vocab"]))
    pad_class = int(cmap[int(attrs["pad_id"])])
    return cmap.to(device), hash_constants(attrs["multipliers"], attrs["primes"], device), pad_class


if triton is not None:

    @triton.jit
    def _lookback(tok_ptr, hist_ptr, r, live, s: tl.constexpr, N: tl.constexpr, BATCHED: tl.constexpr):
        """The ids s tokens back from rows r (int64; -1 before the sequence)."""
        if BATCHED:  # row r: its own token, then its history (oldest first) backwards
            if s == 0:
                tok = tl.load(tok_ptr + r, mask=live, other=-1)
            else:
                tok = tl.load(hist_ptr + r * (N - 1) + (N - 1 - s), mask=live, other=-1)
        else:  # one sequence: concat(history [N-1], tokens [T]), row r's id s back at N-1 + r - s
            j = r - s
            from_tokens = tl.load(tok_ptr + j, mask=live & (j >= 0), other=-1)
            from_history = tl.load(hist_ptr + (N - 1) + j, mask=live & (j < 0), other=-1)
            tok = tl.where(j >= 0, from_tokens, from_history)
        return tok.to(tl.int64)

    @triton.jit
    def _hash_kernel(tok_ptr, hist_ptr, cmap_ptr, const_ptr, out_ptr, T, V, pad_class, image_id, N: tl.constexpr,
                     K: tl.constexpr, KP: tl.constexpr, HEADS: tl.constexpr, BR: tl.constexpr,
                     BATCHED: tl.constexpr):  # fmt: skip
        r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        live = r < T
        col = tl.arange(0, KP)
        prime = tl.load(const_ptr + N + col, mask=col < K, other=1)
        offset = tl.load(const_ptr + N + K + col, mask=col < K, other=0)
        blocked = r < 0  # (all False: a lookback past a negative id or the image token blocks the longer ones)
        h = tl.zeros([BR], tl.int64)
        hashes = tl.zeros([BR, KP], tl.int64)  # column c holds h_n of its order n = 2 + c // HEADS
        for s in tl.static_range(N):
            tok = _lookback(tok_ptr, hist_ptr, r, live, s, N, BATCHED)
            blocked = blocked | (tok < 0) | (tok == image_id)
            c = tl.load(cmap_ptr + tok, mask=live & ~blocked & (tok < V), other=0)
            h = h ^ (tl.where(blocked, pad_class, c) * tl.load(const_ptr + s))
            if s > 0:
                order = (col >= (s - 1) * HEADS) & (col < s * HEADS)
                hashes = tl.where(order[None, :], h[:, None], hashes)
        rem = hashes % prime[None, :]
        rem = tl.where(rem < 0, rem + prime[None, :], rem)  # floor modulo, as torch.remainder (a wrapped hash)
        mask = live[:, None] & (col < K)[None, :]
        tl.store(out_ptr + r[:, None] * K + col[None, :], rem + offset[None, :], mask=mask)


def hash_jit(interpret: bool = False):
    """The @triton.jit kernel (tests/codegen/_triton_aot.py's factory form)."""
    return _hash_kernel


def triton_engram_hash(tokens: torch.Tensor, history: torch.Tensor, cmap: torch.Tensor, consts: torch.Tensor, *,
                       n_heads: int, pad_class: int, image_token_id: int, batched: bool = False,
                       cfg: Config | None = None) -> torch.Tensor:  # fmt: skip
    """Row ids i64 [T, (N-1) * n_heads] from tokens [T] and history ([N-1], or [T*(N-1)] when batched); cmap and
    consts from device_tables (N = the multipliers' count, read from consts' length). One launch, no host read of
    device data (CUDA-graph capturable)."""
    k = -1
    if tokens.dim() == 1 and consts.dim() == 1 and n_heads > 0:
        n = (consts.shape[0] + 2 * n_heads) // (2 * n_heads + 1)  # consts = N + 2 (N-1) H values
        k = (n - 1) * n_heads
    want_history = (n - 1) * (tokens.shape[0] if batched else 1) if k > 0 else -1
    if k <= 0 or consts.shape[0] != n + 2 * k or history.shape != (want_history,):
        raise ValueError(f"engram_hash: needs tokens [T], history [{'T*' if batched else ''}(N-1)] and N + 2(N-1)H "
                         f"constants, got {tuple(tokens.shape)}, {tuple(history.shape)}, {tuple(consts.shape)} "
                         f"(H={n_heads})")  # fmt: skip
    cfg = cfg or default_config(tokens.shape[0])
    check_config(cfg)
    t = tokens.shape[0]
    out = torch.empty(t, k, dtype=torch.int64, device=tokens.device)
    if t:
        _hash_kernel[(triton.cdiv(t, cfg.block_rows),)](
            tokens.contiguous(), history.contiguous(), cmap, consts, out, t, cmap.shape[0], int(pad_class),
            int(image_token_id), N=n, K=k, KP=_pow2(k), HEADS=n_heads, BR=cfg.block_rows, BATCHED=batched,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    return out


def engram_hash(tokens, history, *, batched: bool = False, cfg: Config | None = None, **attrs) -> torch.Tensor:
    """The op on the kernel, its tables made here (tests and benchmarks; the runtime's adapter keeps them)."""
    cmap, consts, pad_class = device_tables(attrs, tokens.device)
    return triton_engram_hash(tokens, history, cmap, consts, n_heads=int(attrs["n_heads"]), pad_class=pad_class,
                              image_token_id=int(attrs["image_token_id"]), batched=batched, cfg=cfg)  # fmt: skip
