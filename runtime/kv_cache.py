"""Cache blocks for every cache a model graph lists in ``graph.meta["caches"]``.

Two families of cache, told apart by their shape (so a new kind needs no code here):

- **growing** caches have a first dim ``C{m}``: one row per m tokens (compressed KV ``compressed``, index keys
  ``index_keys``; V4's index keys are kind ``compressed`` too). They are paged: a block covers ``block_size``
  tokens, that is ``block_size / m`` rows of every growing cache, and one block table per request indexes all
  of them (vLLM's layout). Row j is final once token (j+1)*m-1 has run, so a *full* block never changes again.
- **state** caches have a fixed shape: the SWA ring (``window``), compressor pending rows
  (``compressor_state``), the Engram token history (``engram_history``). They are per-request state *at a
  position*, overwritten every step, so each running request owns one slot of each.

Prefix reuse. A full block's rows are a function of the token prefix up to its end, so full blocks are keyed by
a hash chain of their tokens and shared (reference counted) between requests. That alone is not enough to
resume: the state caches at the end of the prefix (the last W tokens' KV, pending compressor rows, the n-gram
history) are needed too, and they cannot be rebuilt from the blocks. So when a request's computed length lands
exactly on a block boundary the manager snapshots its state slot under that block's hash (LRU, bounded); a new
request reuses the longest chain of cached blocks that ends in a snapshot, and starts its state from the copy.
Not reused: a block that is not full (its rows are still being written), and anything under V4.1's compact
bounded replay (splitting a prompt changes which rows the late layers see; the scheduler turns reuse off).

The executor runs one sequence at a time through the graph, which takes dense per-sequence caches; so
``gather`` copies a request's blocks and slot into dense tensors (``gather_into``: into given ones, the
static buffers of a CUDA-graph decode slot) and ``scatter`` writes the step's updates back. The pools, slots
and snapshots live on ``device`` (the runner's: cuda for sm90 plans, cpu by default), so these copies never
cross the host-device boundary; a paged attention kernel would read the pools through the block table instead.

Dtypes. Each cache is held in its entry's dtype -- f32 as the model declares it, or bf16 where the compiler stores it
for the attention kernel (passes/cache_storage.py: the SWA rings and compressed KV of an sm90 plan) -- in its pools,
slots, snapshots and the dense copies alike, so gather, scatter and snapshots are same-dtype copies, and a block
costs the bytes of its dtype (CacheSpec.row_bytes: the engine's default block count follows it).

Rows and slots are initialised when read, not when allocated: ``gather`` resets every row the request has not
computed yet and takes the state from its initial value or snapshot on a request's first step. So a block or
slot handed over while the step that used it last is still running can never leak old values (asynchronous
scheduling frees blocks before the in-flight step finishes).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from deepinfer.errors import ConfigError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import Graph
from deepinfer.ir.shapes import parse_dim

_RATIO_SYMBOL = re.compile(r"C(\d+)$")
INIT = "init"  # the initial state: the graph's init values (zeros, -1 for the Engram history)


@dataclass(frozen=True)
class CacheSpec:
    name: str
    kind: str
    ratio: int  # tokens per row for a growing cache; 0 for a state cache
    shape: tuple[int, ...]  # the row shape (growing) or the whole shape (state)
    dtype: torch.dtype
    init: float | int

    @property
    def growing(self) -> bool:
        return self.ratio > 0

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def cache_specs(graph: Graph) -> list[CacheSpec]:
    """The graph's caches, classified as growing (first dim C{m}) or state (fixed shape)."""
    specs = []
    for e in graph.meta.get("caches", []):
        dims = [parse_dim(d) for d in e["shape"]]
        ratio = 0
        if dims and not isinstance(dims[0], int):
            m = _RATIO_SYMBOL.match(str(e["shape"][0]))
            if not m:
                raise ConfigError(f"cache {e['name']}: cannot page first dim {e['shape'][0]} (expected C<ratio>)")
            ratio, dims = int(m.group(1)), dims[1:]
        if not all(isinstance(d, int) for d in dims):
            raise ConfigError(f"cache {e['name']}: shape {e['shape']} has symbols beyond the first dim")
        dtype = dt.dtype(e.get("dtype", "f32")).torch_dtype
        specs.append(CacheSpec(e["name"], e["kind"], ratio, tuple(dims), dtype, e.get("init", 0)))
    return specs


def default_block_size(specs: list[CacheSpec], at_least: int = 16) -> int:
    """The smallest multiple of every ratio (so a block holds whole rows) that is >= at_least tokens."""
    lcm = math.lcm(*[s.ratio for s in specs if s.growing] or [1])
    return lcm * math.ceil(at_least / lcm)


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and published


@dataclass
class CacheAllocation:
    """One request's share of the caches: its block table, its state slot, and how it starts."""

    block_ids: list[int] = field(default_factory=list)
    slot: int = -1
    num_hashed: int = 0  # leading blocks already published (their chain hash known)
    last_hash: bytes = b""
    initial_state: object = INIT  # INIT, a snapshot dict, or None once the first step has taken it
    num_reused_tokens: int = 0


class KVCacheManager:
    """Block pools for the growing caches, slot pools for the state caches, and the prefix cache."""

    def __init__(
        self,
        graph: Graph,
        num_blocks: int,
        max_seqs: int,
        block_size: int | None = None,
        enable_prefix_caching: bool = True,
        max_snapshots: int = 256,
        device: str | torch.device = "cpu",
    ):
        self.specs = cache_specs(graph)
        self.device = torch.device(device)
        self.block_size = block_size or default_block_size(self.specs)
        for s in self.specs:
            if s.growing and self.block_size % s.ratio:
                raise ConfigError(f"block_size {self.block_size} is not a multiple of cache {s.name}'s ratio {s.ratio}")
        self.num_blocks, self.max_seqs = num_blocks, max_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self.max_snapshots = max_snapshots
        dev = self.device
        self.pools = {
            s.name: torch.full((num_blocks, self.block_size // s.ratio, *s.shape), s.init, dtype=s.dtype, device=dev)
            for s in self.specs
            if s.growing
        }
        self.slots = {
            s.name: torch.full((max_seqs, *s.shape), s.init, dtype=s.dtype, device=dev)
            for s in self.specs
            if not s.growing
        }
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in LRU order; a free block may still hold a published prefix (evicted when handed out)
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.free_slots = list(range(max_seqs - 1, -1, -1))
        self.hash_to_block: dict[bytes, int] = {}
        self.snapshots: OrderedDict[bytes, dict[str, torch.Tensor]] = OrderedDict()

    # -- accounting --------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def num_used_slots(self) -> int:
        return self.max_seqs - len(self.free_slots)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def usage(self) -> dict[str, dict]:
        """Per cache kind: the unit (block or slot), used / total units, bytes used / total."""
        out: dict[str, dict] = {}
        for s in self.specs:
            if s.growing:
                per = s.row_bytes * self.block_size // s.ratio
                unit, used, total = "block", self.num_used_blocks, self.num_blocks
            else:
                unit, used, total, per = "slot", self.num_used_slots, self.max_seqs, s.row_bytes
            k = out.setdefault(s.kind, {"unit": unit, "used": used, "total": total, "bytes_used": 0, "bytes_total": 0})
            k["bytes_used"] += used * per
            k["bytes_total"] += total * per
        snap = sum(t.numel() * t.element_size() for d in self.snapshots.values() for t in d.values())
        out["prefix_snapshots"] = {"unit": "snapshot", "used": len(self.snapshots), "total": self.max_snapshots,
                                   "bytes_used": snap, "bytes_total": snap}  # fmt: skip
        return out

    # -- allocation (scheduler side: bookkeeping only, never touches tensors) ----------------------------
    def can_allocate(self, alloc: CacheAllocation | None, num_tokens: int, new_slot: bool = False) -> bool:
        have = len(alloc.block_ids) if alloc else 0
        slot_ok = not new_slot or bool(self.free_slots)
        return slot_ok and self.blocks_for(num_tokens) - have <= self.num_free_blocks

    def allocate(self, alloc: CacheAllocation, num_tokens: int) -> None:
        """Grow the block table to cover num_tokens tokens."""
        while len(alloc.block_ids) < self.blocks_for(num_tokens):
            alloc.block_ids.append(self._take_free_block())

    def _take_free_block(self) -> int:
        if not self.free_blocks:
            raise RuntimeError("no free cache block (the scheduler should have checked can_allocate)")
        bid, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:  # evict the prefix it held
            if self.hash_to_block.get(block.hash) == bid:
                del self.hash_to_block[block.hash]
            self.snapshots.pop(block.hash, None)
            block.hash = None
        block.ref_count = 1
        return bid

    def admit(self, token_ids: list[int]) -> CacheAllocation:
        """A new allocation for a request about to compute token_ids: a slot, and any reusable prefix."""
        alloc = CacheAllocation(slot=self.free_slots.pop())
        hit = self.match_prefix(token_ids)
        if hit is not None:
            block_ids, last_hash = hit
            for bid in block_ids:
                self._share(bid)
            alloc.block_ids = list(block_ids)
            alloc.num_hashed, alloc.last_hash = len(block_ids), last_hash
            alloc.initial_state = self.snapshots[last_hash]
            self.snapshots.move_to_end(last_hash)
            alloc.num_reused_tokens = len(block_ids) * self.block_size
        return alloc

    def _share(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free_blocks[bid]
        block.ref_count += 1

    def release(self, alloc: CacheAllocation) -> None:
        """Give back a finished, aborted or preempted request's blocks and slot (published blocks stay cached)."""
        for bid in reversed(alloc.block_ids):  # the tail first, so the LRU evicts it before the shared head
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[bid] = None
        alloc.block_ids = []
        if alloc.slot >= 0:
            self.free_slots.append(alloc.slot)
            alloc.slot = -1

    # -- prefix cache ------------------------------------------------------------------------------------
    def _chain(self, prev: bytes, tokens: list[int]) -> bytes:
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
        return h.digest()

    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], bytes] | None:
        """The longest run of cached full blocks ending in a state snapshot, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return None
        best, chain, h = None, [], b""
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            h = self._chain(h, token_ids[i * bs : (i + 1) * bs])
            bid = self.hash_to_block.get(h)
            if bid is None:
                break
            chain.append(bid)
            if h in self.snapshots:
                best = (list(chain), h)
        return best

    def publish(self, alloc: CacheAllocation, token_ids: list[int], num_computed: int) -> None:
        """After a step: key the newly full blocks by their prefix hash, and snapshot the state at a boundary."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        while alloc.num_hashed < min(num_computed // bs, len(alloc.block_ids)):
            i = alloc.num_hashed
            alloc.last_hash = self._chain(alloc.last_hash, token_ids[i * bs : (i + 1) * bs])
            bid = alloc.block_ids[i]
            self.blocks[bid].hash = alloc.last_hash
            self.hash_to_block.setdefault(alloc.last_hash, bid)
            alloc.num_hashed += 1
        if num_computed % bs == 0 and alloc.num_hashed == num_computed // bs > 0 and alloc.slot >= 0:
            self._snapshot(alloc.last_hash, alloc.slot)

    def _snapshot(self, key: bytes, slot: int) -> None:
        if self.max_snapshots <= 0 or key in self.snapshots:
            return
        self.snapshots[key] = {name: t[slot].clone() for name, t in self.slots.items()}
        while len(self.snapshots) > self.max_snapshots:
            self.snapshots.popitem(last=False)

    # -- dense views for the executor --------------------------------------------------------------------
    def gather(self, block_ids: list[int], slot: int, computed: int, max_len: int, initial_state) -> dict:
        """Dense caches for one sequence, as the graph takes them, sized for max_len tokens (like Session)."""
        out = {}
        for s in self.specs:
            shape = (math.ceil(max_len / s.ratio), *s.shape) if s.growing else s.shape
            out[s.name] = torch.empty(shape, dtype=s.dtype, device=self.device)
        return self.gather_into(out, block_ids, slot, computed, initial_state)

    def gather_into(self, out: dict, block_ids: list[int], slot: int, computed: int, initial_state) -> dict:
        """gather() into the given dense tensors (any row count; on this manager's device): the computed rows
        from the blocks, every later row reset, the state from the slot, the initial value or a snapshot."""
        idx = None
        for s in self.specs:
            dense = out[s.name]
            if s.growing:
                valid = min(computed // s.ratio, dense.shape[0])  # rows past the computed tokens may hold old data
                if valid:
                    if idx is None:
                        idx = torch.as_tensor(block_ids[: self.blocks_for(computed)], device=self.device)
                    have = self.pools[s.name][idx].reshape(-1, *s.shape)
                    dense[:valid].copy_(have[:valid])
                dense[valid:].fill_(s.init)
            elif initial_state is INIT:
                dense.fill_(s.init)
            elif initial_state is not None:
                dense.copy_(initial_state[s.name])
            else:
                dense.copy_(self.slots[s.name][slot])
        return out

    def scatter(self, block_ids: list[int], slot: int, caches: dict, start: int, end: int) -> None:
        """Write back the rows written by tokens [start, end) and the state at end."""
        bs = self.block_size
        first, last = start // bs, min(math.ceil(end / bs), len(block_ids))
        for s in self.specs:
            if s.growing:
                per = bs // s.ratio
                for b in range(first, last):
                    rows = caches[s.name][b * per : (b + 1) * per]  # the last block may reach past max_len
                    self.pools[s.name][block_ids[b], : len(rows)] = rows
            else:
                self.slots[s.name][slot] = caches[s.name]
