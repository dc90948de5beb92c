"""Sparse attention decode with the attention sink (MODEL_SPEC §2.10), MQA over gathered KV rows.

One query token per request, H heads sharing one 512-d KV row per entry (K = V):
    ℓ_hj = (q_h · kv_j) · d^-0.5                         j over the request's selected entries
    p_hj = exp(ℓ_hj − m_h) / (Σ_j exp(ℓ_hj − m_h) + exp(sink_h − m_h))
    o_h  = Σ_j p_hj · kv_j
Entries are physical KV-pool rows listed in Idx [B, topk] (window + selected compressed rows), −1 =
invalid. Because all heads share the KV, one CTA takes every head of a request: each KV row is read
from HBM once, QKᵀ and PV are [H x block] x [block x d] tensor-core GEMMs, and the softmax is online
over blocks (flash-decoding with a sink).

Small batches leave most SMs idle with one CTA per request, so `num_split` > 1 cuts each request's entries
into chunks (split-K): one CTA per (chunk, request) writes its unnormalised fp32 output with its running
max and sum, and a second kernel folds the chunks together with the sink (exactly: a chunk of only -1
entries has weight 0). `stages` = 2 pipelines the KV gather of the next block under the math.

Two programs: the portable single program (every target, `config_space`), and on sm90 the
warp-specialised one (`Config.ws`, `_program_ws`, chosen by `sm90_config`): a QK^T/softmax warpgroup
and two PV warpgroups (one per D half) that also gather their half of the rows into an mbarrier ring of
stages, so the gather, QK^T, the softmax and PV of consecutive blocks overlap. It also reads the FP8 KV
cache (`kv_fp8`: e4m3 codes + ue8m0 exponents per 32, MODEL_SPEC §3), dequantised to bf16 (exactly) in
shared memory. `_program_ws_cpu` mirrors it on TileLang's c target (fp32) for the CPU tests.

Prefill is the same program at B = T (`prefill_config`): the op is per query -- each token of a chunk has its own
window list (causal inside the chunk) and its own selected entries -- so a chunk of T tokens is T "requests"
whose rows mostly hit L2 (the chunk's pools are ~10-25 MB): compute-bound (`prefill_roofline`). `Config.persist`
runs a persistent grid (one CTA an SM walking the requests, its KV ring and the next Q running on between them):
the per-CTA fixed cost is then paid once per SM, not once per token.
Not yet here: q's RoPE inside the kernel (`triton_q_operand` does it in one launch before it) and the inverse
RoPE of o's last 64 dims.

Where the decode time goes (H200, session 8: `Config.trace` stamps, kernels_h200 'sparse_attn s8 trace', the runtime's
4k operands, B128 k640, 39.3 us after a read flush; 70% of the HBM roofline would be 33.9 us):
- ~7 us outside the CTAs (read-flush time 41.2 us of the traced build vs 34.0 us from the first CTA's start to the
  last one's end: launch, drain, events); the skeleton build (no loads but Q, no MMAs) shows the same ~6.5 us.
- ~6 us from a CTA's start to its first block's rows: Q (landed at 2.6 us) and blocks 0 and 1 (192 KB a CTA) are
  requested together; loading the row ids before Q (session 8's ids_first) did not move it.
- steady blocks: WG0's period ~1.95 us = data wait ~0.25 | QK^T ~1.2 (0.78 alone; PV(j - 1) shares the tensor
  cores) | softmax + P ~0.41 | P hand-off ~0.1; PV (both halves) ~0.77. The tensor work is ~1.55 us a block, the
  block's HBM share ~1.96 us (bf16), so the chain (QK^T + softmax in series on WG0) and HBM coincide at B128/B256;
  shortening the chain pays where HBM does not bind (B64, L2-hot rows, FP8 KV: 1.05 us of bytes a block).
- ~6.7 us from the last PV to the O stores issued (4.5 us with no KV loads, 1.1 us in the skeleton). Session 9 (call
  3, new stamps): the fin wait is 0.15 us; the rest is the stores themselves -- 64 4-byte stores a thread in the wgmma
  accumulator layout (a warp store: 8 heads' rows x 16 B), as slow when they store zeros from a rolled loop (the
  traffic pattern, not the code: running the epilogue's code once early, a removed warm_tail option, gained
  nothing: B128 44.1 us, B64 split 35.6 vs 33.5). Through
  the free KV stage and 16-B stores of whole 512-B rows (Config.o_smem, now the default) the tail is 2.4 us (8.4 MB
  of O at about the HBM write rate; 0.2 us with no stores at all): B128 44.2 -> 40.0 us (59.1%; 69.0% after a
  read flush), B256 persistent 74.4 -> 67.9 us (69.7%), B64 unsplit 32.4 us (split 2 + combine: 33.5). Also
  measured there and removed: split 2 with the combine folded into each request's last CTA (an arrival counter, the
  partials read back from L2), 37.8 us at B64 -- slower, as session 4's in-kernel merge was.
Next steps, in that order: the split pass's fp32 partial stores the same way (bf16 partials through the stage:
Config.o_smem + partial_bf16; fp32 needs both stages of the half ring); block 0 gathered before Q (the first QK^T
needs both; Q + two blocks at once delay block 0: the start is ~25 MB at B128, HBM-bound); the chain -- QK^T of
block j + 1 under softmax(j) needs a third 64-row stage (with two, `lookahead` waits for block j + 1's rows before
softmax(j): the ring's latency enters the chain), i.e. Q out of shared memory: Q halves in the PV warpgroups'
registers (RS wgmma; setmaxnreg ~208 for them, ~96 for a softmax-only WG0) or QK^T split over two warpgroups.
Session 8's early_p (P published before the row sum) and lazy_rescale (m rises only past 2^8, the PV rescale skipped
otherwise) shortened the chain by ~0.1 us a block at most (B128 read flush 38.6 vs 39.7 us; within 1% under do_bench,
sessions 8 and 9); they and ids_first were removed in session 10.
Session 10: Config.evict_first (the copies under an L2 evict_first policy, so the gather's misses evict its own lines,
not the dirty ones do_bench's flush -- or a step's earlier kernels -- leave): B128 40.1 -> 36.9 / 37.3 us = 64%, B256
persistent 67.6 -> 65.9 / 66.0 us = 71.7-71.9% of HBM (H200 calls 2 and 3; on from 128 requests: EVICT_FIRST_MIN_B);
no gain on the small batches' split passes (B1 / B16 equal, B32 29.1 vs 28.3 us) nor on prefill (T4096 969.5 vs
962.6 us). Config.q_regs (Q's left half in WG0's registers, an RS wgmma): B64 31.9 vs 32.5 us (on there: Q_REGS_MIN_B),
slower with evict_first at B128 / B256. Measured and removed: a request's two split-2 chunks as one 2-CTA cluster
folding their partials in shared memory over DSMEM (no combine kernel; correct): B64 33.3 us vs the unsplit 32.8 (31.0
with evict_first under do_bench, but 38.0 vs 31.6 after a read flush), B48 30.7 vs split 2 + combine 30.2.
Next (after session 10): the persistent grid's request boundary -- the next Q is issued only after the last QK^T and
the next request's block 1 only after the O stores -- and the lockstep start / tail are the fixed costs left at B256;
a third 64-row stage still needs the 64 KB of Q out of shared memory (q_regs frees no smem: Q is staged through it).
"""

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from deepinfer.codegen.kernels._common import Mem, quant_fp8_groups

FAMILY = "sparse_attn_decode"


@dataclass(frozen=True)
class Config:
    block_n: int = 64
    threads: int = 256
    num_split: int = 1  # split-K: the request's entries are cut into this many chunks, one CTA each
    stages: int = 1  # software pipeline depth of the KV gather (2: the next block's rows load during the math)
    ws: bool = False  # warp-specialised sm90 program (3 warpgroups, mbarrier ring of `stages` KV blocks)
    lookahead: bool = False  # ws: QK^T of the next block is issued before this block's softmax
    # Diagnostics only (ws, wrong results): comma-separated parts of the ws program left out of the build --
    # "gather" (the KV row copies), "ids" (the row-id copies for WG0's mask: with "gather", no global load
    # arms the ring), "qk" (the QK^T wgmmas), "softmax" (max / exp / sum: P = S, alpha = 1), "pv" (the PV
    # wgmmas), "pvfence" (the PV warpgroups' proxy fence after their waits: it compiles to MEMBAR.ALL.CTA,
    # which may hold them until their own outstanding global loads land) -- so that one H200 run shows which
    # part bounds the CTA's time (BENCHMARKS.md, session 4). "ostore" (session 9): the O / partial stores of the
    # epilogue (the time from the last PV to the CTA's end without them); "ovals": the single pass's O stores keep
    # their addresses but store zeros from a rolled loop (the same traffic without the unrolled register code).
    skip: str = ""
    # ws, bf16 KV, diagnostic (wrong layout: needs skip "qk,pv"): "bulk" copies each gathered half-row with one
    # 1-D bulk copy (cp.async.bulk, the TMA engine: 512 B, one thread a row, complete_tx on the ring barrier)
    # instead of 16-B cp.async from every loader thread. Its rows land unswizzled, so the wgmmas cannot read
    # them; the row times whether the TMA engine streams the gather faster than per-thread LDGSTS.
    copy: str = "cp"
    # ws, bf16 KV (new, not yet measured): each refill of block j also prefetches block j + l2_prefetch into L2
    # (cp.async.bulk.prefetch.L2: one instruction per half-row, no register or shared destination, nothing for
    # a fence to wait on). Why: with a read-only L2 flush the gather alone streams at 87% of HBM, yet the full
    # program is 11 us slower -- a 2-stage ring issues block j only when PV(j - 2) is done, so its HBM latency
    # under load (~2 us) is exposed at every block; from L2 the refill lands in ~1 us. 0: off.
    l2_prefetch: int = 0
    # ws, bf16 KV, single pass: a persistent grid of `persist` CTAs, each walking the requests c, c + persist, ...
    # (prefill: T query tokens, one "request" each). Why: a CTA's fixed cost (launch, Q load, ring start-up,
    # epilogue) is paid once per CTA, not once per token; the KV ring runs on across tokens (the last round of
    # token k gathers token k + 1's first blocks) and the next token's Q loads under the last PV of this one.
    # H200 (session 6 call 3, checked): prefill T8192 k640 1772.0 vs 1803.9 us one CTA a token; decode B256
    # 72.4 vs 74.4 us -- the per-block pipeline, not the per-CTA cost, bounds both. With `lookahead` it spills
    # (~90 local loads) and is slower (2550.9 / 105.0 us). 0: one CTA per request.
    persist: int = 0
    # ws, split (new, not yet measured): the chunks' unnormalised outputs Op in bf16, not fp32 -- half the bytes the
    # split kernel writes and the combine reads back (B64 x 2 chunks: 16.8 -> 8.4 MB; the combine alone was 10.3 of
    # the pair's 32.6 us). Each chunk's partial takes one bf16 rounding more before the weighted sum (~2^-9 relative).
    partial_bf16: bool = False
    # Diagnostic (session 8; correct results): the ws program, two pools, not persistent, no lookahead, takes the
    # single pass's and the split pass's outputs (Sink, O, Op, Mp, Lp: the other pass's are left alone) and records
    # per-CTA timestamps into a trailing int64 argument Trace [B * num_split, trace_slots(nb)]
    # (TRACE_* slots: SM clock64 at each hand-off of every block, globaltimer at the CTA's start and end), so that
    # one H200 run shows where a block's time goes: waiting for its rows, QK^T, softmax, the PV warpgroups' hand-off
    # and PV, and the CTA's start-up and tail (kernels_h200 'sparse_attn s8 trace').
    trace: bool = False
    # ws, bf16 KV, single pass, 64-row blocks (session 9, not yet measured): the O epilogue goes through shared memory.
    # Each PV warpgroup writes its normalised bf16 half of O (64 x 256) into its KV stage 0 (free once its last PV is
    # done: WG0 published the last P, so every QK^T is done too), then stores it with 16-B vector stores, a warp
    # writing 512 contiguous bytes of one head (16 stores a thread) instead of 64 4-byte stores a thread, each warp's
    # touching 8 heads' rows (16 B of each): the trace put ~6.7 us between the last PV and the O stores issued
    # (1.1 us with no loads or math). Same values: bit-identical output. Persistent grid: the stage of the request's
    # last block, whose refill with the next request's block (the ring runs on across requests) waits for the stores.
    # The split pass with bf16 partials (Config.partial_bf16): the partial goes the same way (fp32 ones would need
    # the whole half ring). H200 (session 9 call 3, all bit-equal): B128 44.2 -> 40.0 us (tail 7.0 -> 2.4 us), B256
    # persistent 74.4 -> 67.9 us, B64 unsplit 34.8 -> 32.4 us; zeros stored from a rolled loop at the same addresses
    # were as slow as the default (the traffic pattern, not the code). Call 4: B64 split 2 with bf16 partials through
    # the stage 31.2 us under do_bench but 36.3 after a read flush (the unsplit default: 32.5 / 31.6): not the default.
    o_smem: bool = False
    # ws, bf16 KV (session 10; on from EVICT_FIRST_MIN_B requests): the KV rows', row ids' and Q's 16-B copies carry
    # an L2 evict_first cache policy (cp.async.cg ... L2::cache_hint, createpolicy.fractional.L2::evict_first). Why:
    # every byte the kernel reads is read once a step, yet each miss allocates an L2 line that evicts another; when the
    # L2 holds dirty lines (the step's earlier outputs; do_bench's zeroing flush) those evictions are write-backs that
    # share HBM with the gather -- B128 40.0 us under do_bench vs 34.8 after a read-only flush (session 9 call 4).
    # Evict-first lines are the victims of later misses, so the stream recycles its own lines. Same values (bit-equal
    # on the H200). Call 2: B128 40.1 -> 36.9 us, B256 persistent 67.6 -> 65.9 us, B64 unsplit neutral (32.5 / 32.9).
    evict_first: bool = False
    # ws, bf16 KV (session 10; on at Q_REGS_MIN_B .. Q_REGS_MAX_B requests): WG0 keeps Q's left half in registers (a
    # 64 x 256 bf16 wgmma A fragment: 64 registers a thread) and issues that half of QK^T as an RS wgmma; the right
    # half stays in shared memory. Why: QK^T reads both operands from shared memory (Q 64 KB + the block 64 KB per
    # 64-row block) and, with PV and the gather's writes, shared-memory bandwidth bounds the per-block chain (QK^T 0.78
    # us alone, ~1.2 under PV): a quarter less traffic for the QK^T on the chain. H200 call 3 (bit-equal everywhere):
    # B64 31.9 vs 32.5 us (read flush 31.3 vs 31.6); with evict_first B128 37.9 vs 37.3, B256 persistent 67.7 vs 66.0.
    q_regs: bool = False

    def __post_init__(self):
        if self.ws and self.threads != WS_THREADS:
            object.__setattr__(self, "threads", WS_THREADS)
        assert not self.skip or self.ws, "component skipping is a diagnostic of the ws program"
        assert set(self.skipped) <= set(SKIPPABLE), self.skip
        assert not {"ostore", "ovals"} & set(self.skipped) or self.num_split == 1, "ostore / ovals: the single pass"
        assert self.copy in ("cp", "bulk"), self.copy
        assert self.l2_prefetch >= 0 and (not self.l2_prefetch or (self.ws and self.copy == "cp")), "l2_prefetch"
        if self.persist:
            assert self.ws and self.num_split == 1 and not self.l2_prefetch, "persist"
            assert self.copy == "cp" and not self.skip, "persist: the full bf16 program"
        assert not self.partial_bf16 or (self.ws and self.num_split > 1), "partial_bf16: the ws split pass"
        assert not self.trace or (self.ws and not self.persist and not self.lookahead), "trace: ws, not persist/la"
        assert not self.o_smem or (self.ws and (self.num_split == 1 or self.partial_bf16) and self.block_n == WS_HEADS
                                   and self.copy == "cp"), "o_smem: ws, 64-row blocks, bf16 partials"  # fmt: skip
        assert not self.evict_first or (self.ws and self.copy == "cp"), "evict_first: the ws program's cp.async"
        assert not self.q_regs or (self.ws and not self.lookahead and self.copy == "cp"), "q_regs: ws, no lookahead"
        if self.copy == "bulk":  # unswizzled rows: only the gather-only diagnostic can run it
            assert self.ws and {"qk", "pv"} <= set(self.skipped) , "bulk: a ws diagnostic"

    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(p for p in self.skip.split(",") if p)

    @property
    def tag(self) -> str:
        if self.ws:
            head = f"ws{'L' if self.lookahead else ''}n{self.block_n}s{self.stages}"
        else:
            head = f"n{self.block_n}t{self.threads}s{self.stages}"
        head += f"x{self.num_split}" if self.num_split > 1 else ""
        head += "B" if self.copy == "bulk" else ""
        head += f"pf{self.l2_prefetch}" if self.l2_prefetch else ""
        head += f"p{self.persist}" if self.persist else ""
        head += "h" if self.partial_bf16 else ""
        head += "o" if self.o_smem else ""
        head += "f" if self.evict_first else ""
        head += "r" if self.q_regs else ""
        head += "T" if self.trace else ""
        return head + "".join(f"-no{p}" for p in self.skipped)


SKIPPABLE = ("gather", "ids", "qk", "softmax", "pv", "pvfence", "ostore", "ovals")


WS_THREADS = 384  # QK/softmax warpgroup + two PV warpgroups (each also gathers its half of the KV rows)
WS_HEADS = 64  # the ws program's head block: one wgmma M tile (V4.1-Flash has 64 heads)
# Every shared-memory hand-off of the ws program is ordered by its own mbarriers; TileLang's automatic
# thread syncs would only add named barriers (and could reuse a barrier id across warpgroups). The ws
# prim_funcs carry this as a function attribute, which tilelang.compile applies; callers of
# tilelang.lower must open `tvm.transform.PassContext(config=WS_PASS_CONFIGS)` themselves.
WS_PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}


def ws_supported(H: int, D: int, target: str) -> bool:
    """The ws program: sm90 (its CPU mirror on "cpu"), 64 heads, D a multiple of 128. Elsewhere program()
    runs a ws config's chunking (block_n, num_split) on the portable program."""
    return H == WS_HEADS and D % 128 == 0 and target in ("sm90", "cpu")


def config_space(B: int, topk: int) -> list[Config]:
    """The portable single-program configs (every target): the non-sm90 binding picks from these."""
    out = [Config(bn, t) for bn in (32, 64) for t in (128, 256) if topk % bn == 0]
    for ns in (1, 2, 4, 5, 10):
        out += [Config(bn, 256, ns, 2) for bn in (32, 64) if topk % (ns * bn) == 0]
    return out


SPLITS = (1, 2, 4, 5, 8, 10, 16, 20)


def ws_configs(topk: int, num_split: int, *, fp8: bool = False) -> list[Config]:
    """The warp-specialised configs for one split count: 64-row blocks in 2 stages, 32-row blocks in 4
    (bf16; FP8 KV: 32-row blocks in 2 stages, its raw staging takes the rest of shared memory)."""
    out = []
    for bn, stages in ((32, 2),) if fp8 else ((64, 2), (32, 4)):
        if topk % (num_split * bn) == 0:
            out += [Config(bn, WS_THREADS, num_split, stages, True, la) for la in (False, True)]
    return out


def sm90_config_space(B: int, topk: int, *, fp8: bool = False) -> list[Config]:
    """What the sm90 tuner searches: the ws configs at every split count, plus the portable split configs."""
    out = [c for ns in SPLITS for c in ws_configs(topk, ns, fp8=fp8)]
    return out + ([] if fp8 else [c for c in config_space(B, topk) if c.stages == 2])


def portable_split_config(B: int, topk: int, num_sms: int = 132) -> Config:
    """The previous sm90 choice (single program, 32-row blocks, 2 stages, split-K to fill the SMs): kept for
    same-run comparisons (benchmarks) and for targets without the ws program."""
    bn = 32
    ns = 1
    for cand in (1, 2, 4, 5, 10, 20):
        if topk % (cand * bn) == 0:
            ns = cand
            if B * cand >= 0.9 * num_sms:
                break
    return Config(bn, 256, ns, 2)


def sm90_config(B: int, topk: int, num_sms: int = 132, *, fp8: bool = False, one_wave: bool = True) -> Config:
    """The ws program with the fewest splits whose B x num_split CTAs cover ~90% of the SMs. A split adds
    B x H x D fp32 of partial output written and read back by the combine, so large batches use none.
    one_wave: when that split count needs more CTAs than SMs (one CTA an SM fits: a second, mostly idle wave --
    B16 x10 = 160, B8 x20 = 160) while a smaller one fits in one wave, take the smaller (H200, B16: x5 20.6 us vs
    x10 27.8 us, checked; session 5 final call). one_wave=False: the previous rule. From PERSIST_MIN_B requests
    (bf16 KV, whole ring rounds) the single pass runs as the persistent grid of num_sms CTAs."""
    best = None
    for ns in SPLITS:
        cands = ws_configs(topk, ns, fp8=fp8)
        if not cands:
            continue
        if one_wave and best is not None and B * ns > num_sms and B * best.num_split <= num_sms:
            break  # keep the one-wave split count
        best = cands[0]  # 64-row blocks when the chunk allows, no lookahead (it spills: see _program_ws)
        if B * ns >= 0.9 * num_sms or (UNSPLIT_MIN_B and B >= UNSPLIT_MIN_B and not fp8):
            break
    if best is not None and PERSIST_MIN_B and B >= PERSIST_MIN_B and not fp8 and persist_fits(best, topk):
        # more requests than SMs
        return _chain_options(Config(best.block_n, WS_THREADS, 1, best.stages, True, persist=num_sms), B)
    if best is not None and not fp8:
        best = _decode_options(best, B)
    return best or Config(32, 256, 1, 2)  # top-k not a multiple of 32: no config fits (the binding falls back)


# Decode switches; each value is the measured default. UNSPLIT_MIN_B: from this many requests no split (64: B64 runs 64
# CTAs and no combine instead of split 2; 0 off). SPLIT_PARTIAL_BF16: split passes write bf16 partials
# (Config.partial_bf16). DECODE_L2_PREFETCH: the single pass's Config.l2_prefetch (blocks ahead; 0 off; the persistent
# grid takes none). H200, session 7 call 3 (kernels_h200 --only "sparse_attn s7", the runtime's operands at 4k context,
# all checked): B64 split 2 33.3 us vs unsplit 34.8 vs bf16 partials 35.8 (slower: keep fp32); B128 pf1 44.0 vs 44.2 us
# (noise); after a read-only flush instead of do_bench's zeroing, unsplit B64 33.7 vs 36.8 us -- the protocols disagree,
# so a switch waits for the batched step in graphs (DEEPINFER_ATTN_DECODE below).
UNSPLIT_MIN_B = 64  # (session 9, with DECODE_O_SMEM: see there)
SPLIT_PARTIAL_BF16 = False
DECODE_L2_PREFETCH = 0
# Session 9: Config.o_smem on every bf16 ws decode config it fits (one pass, 64-row blocks: the single pass and the
# persistent grid; the split passes keep their fp32 partial stores). H200 call 3 (kernels_h200 'sparse_attn s9', the
# runtime's 4k operands, all bit-equal to the plain configs): B128 44.2 -> 40.0 us, B256 persistent 74.4 -> 67.9 us;
# B64 unsplit with it 32.4 us vs the split-2 default 33.5 us (read flush 31.6 vs 37.4: the protocols agree now), so
# UNSPLIT_MIN_B = 64 with it (bf16 KV; FP8 KV keeps its split counts: not measured unsplit).
DECODE_O_SMEM = 1
# Session 10: Config.evict_first on the bf16 ws decode configs from this many requests (0: none; never prefill, whose
# tokens re-read their chunk's pools from L2). H200 (call 2, kernels_h200 'attn s10', the runtime's 4k operands, every
# row bit-equal): B128 40.1 -> 36.9 us (59.0 -> 64.1% of HBM; read flush 34.6 / 34.9), B256 persistent 67.6 -> 65.9 us
# (69.9 -> 71.7%); B64 unsplit 32.5 vs 32.9 (neutral: 64 CTAs do not stream at the HBM rate); B64 split 2 with bf16
# partials 30.7 -> 28.3 us under do_bench (36.8 / 36.4 after a read flush). Call 3: B1 / B16 splits equal, B32 x4
# 29.1 vs 28.3 us (slower), prefill T4096 969.5 vs 962.6 us (slower): so from 128 only.
EVICT_FIRST_MIN_B = 128
# Session 10: Config.q_regs on the bf16 ws single pass of Q_REGS_MIN_B .. Q_REGS_MAX_B requests (0: none). H200 call
# 3 ('attn s10r2', bit-equal): B64 31.9 vs 32.5 us; B128 / B256 (with evict_first) slower; splits not measured.
Q_REGS_MIN_B = 64
Q_REGS_MAX_B = 127


def _chain_options(cfg: Config, B: int) -> Config:
    """DECODE_O_SMEM / EVICT_FIRST_MIN_B / Q_REGS_MIN_B .. MAX_B applied to a bf16 ws decode config for B requests."""
    o_smem = bool(DECODE_O_SMEM) and cfg.num_split == 1 and cfg.block_n == WS_HEADS
    return dataclasses.replace(cfg, o_smem=o_smem, evict_first=bool(EVICT_FIRST_MIN_B) and B >= EVICT_FIRST_MIN_B,
                               q_regs=bool(Q_REGS_MIN_B) and Q_REGS_MIN_B <= B <= Q_REGS_MAX_B and cfg.num_split == 1
                               and not cfg.lookahead)  # fmt: skip


def _decode_options(cfg: Config, B: int) -> Config:
    """sm90_config's bf16-KV choice for B requests with the switches above applied (ws programs only)."""
    if not cfg.ws:
        return cfg
    cfg = _chain_options(cfg, B)
    if cfg.num_split > 1 and SPLIT_PARTIAL_BF16:
        return dataclasses.replace(cfg, partial_bf16=True)
    if cfg.num_split == 1 and DECODE_L2_PREFETCH:
        return dataclasses.replace(cfg, l2_prefetch=DECODE_L2_PREFETCH)
    return cfg


# decode: from this many requests sm90_config takes the persistent grid (0: never). H200, B256: 72.4 vs 74.4 us (both
# checked; session 6 call 3); session 7 call 3 on the runtime's operands: 74.6 vs 75.9 us, but 75.3 vs 70.8 us (single
# pass faster) after a read-only flush; between the SM count and 256 not measured.
PERSIST_MIN_B = 256

DECODE_SWITCHES = ("UNSPLIT_MIN_B", "SPLIT_PARTIAL_BF16", "DECODE_L2_PREFETCH", "PERSIST_MIN_B", "DECODE_O_SMEM",
                   "EVICT_FIRST_MIN_B", "Q_REGS_MIN_B", "Q_REGS_MAX_B")
# "UNSPLIT_MIN_B=64,PERSIST_MIN_B=0": the switches set at import, for an A/B of a whole decode step without an edit
DECODE_SWITCHES_ENV = "DEEPINFER_ATTN_DECODE"


def apply_decode_switches(text: str) -> None:
    """Set the decode switches from "NAME=int,..." (DEEPINFER_ATTN_DECODE's form); an unknown name raises."""
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in DECODE_SWITCHES:
            raise ValueError(f"{DECODE_SWITCHES_ENV}: {name!r} is not one of {DECODE_SWITCHES}")
        globals()[name] = type(globals()[name])(int(value))


apply_decode_switches(os.environ.get(DECODE_SWITCHES_ENV, ""))


def persist_fits(cfg: Config, topk: int) -> bool:
    """The persistent grid runs whole ring rounds, at least two a request (bf16 KV, a single pass)."""
    nb = topk // cfg.block_n
    return cfg.ws and cfg.num_split == 1 and nb % cfg.stages == 0 and nb >= 2 * cfg.stages


PREFILL_PERSIST = True  # prefill_config's default: the persistent grid (H200, T8192 k640: 1772.0 vs 1803.9 us)
MAX_LAUNCH_ROWS = 32768  # one launch's requests: the grid is (num_split, B) and gridDim.y <= 65535


def prefill_config(T: int, topk: int, num_sms: int = 132, *, persist: bool | None = None) -> Config:
    """Prefill (T query tokens of one chunk). The op is per query -- each token has its own window list
    (causal inside the chunk: window_indices) and its own selected compressed entries (-1 where not yet
    visible) -- so the decode program at B = T is the prefill program, exactly. T >= the SM count fills the
    machine without a split (a split only adds T x H x D fp32 partials and a combine), so: one CTA per token,
    64-row blocks in 2 stages; `persist` (Config.persist = num_sms CTAs walking the tokens) where chosen.
    T is not part of the choice: one build (its B is symbolic) serves every chunk length."""
    cands = ws_configs(topk, 1)
    if not cands:
        return Config(32, 256, 1, 2)  # top-k not a multiple of 32: no ws config (the binding falls back)
    persist = PREFILL_PERSIST if persist is None else persist
    base = cands[0]
    if persist and persist_fits(base, topk):
        return Config(base.block_n, WS_THREADS, 1, base.stages, True, persist=num_sms)
    return base


def prefill_roofline(T: int, H: int, D: int, topk: int, pool_rows: int, act_bytes: int = 2) -> dict:
    """The bounds of a T-token prefill: 'hbm' bytes (q and o once, the index lists, every pool row once -- the
    chunk's pools are ~10-25 MB and stay in L2, so the per-query gathers are L2 traffic), 'gathers' (the bytes
    the queries gather, T x topk rows: what the decode roofline counts), 'flops' (QK^T + PV). V4.1, T 8192, 640
    entries: 0.69 TFLOP = 0.99 ms at 694 TFLOPS (bf16 matmul, H200) vs 1.1 GB = 0.26 ms at 4.3 TB/s. The gathers
    (5.4 GB) would take 1.25 ms at the HBM rate, but they re-read a ~13 MB pool that L2 holds: the matrix bound
    applies while they hit L2."""
    return {
        "hbm": float(T * (2 * H * D * act_bytes + topk * 4) + pool_rows * D * act_bytes),
        "gathers": float(T * topk * D * act_bytes),
        "flops": float(4 * T * H * topk * D),
    }


def program(B: int, H: int, D: int, S: int, topk: int, *, target: str, cfg: Config = Config(), kv_fp8: bool = False,
            n_win: int = 0, S_cmp: int = 0):  # fmt: skip
    """prim_func(Q [B, H, D] act, KV [S, D] act, Idx [B, topk] int32, Sink [H] f32, O [B, H, D] act).

    With cfg.num_split > 1 this is the first of two kernels (`split_programs`), and its signature is
    (Q, KV, Idx, Op [B, ns, H, D] f32, Mp [B, ns, H] f32, Lp [B, ns, H] f32): each CTA writes its chunk's
    unnormalised output, running max and sum; `combine_program` folds the chunks and the sink.

    cfg.ws selects the warp-specialised sm90 program (`_program_ws`); kv_fp8 (ws only) takes the FP8 KV
    cache instead: KV [S, D] float8_e4m3fn and KVs [S, D/32] uint8 ue8m0 exponents follow Q in the signature.

    Two pools (0 < n_win < topk; the graph's fused_attention inputs win_kv/win_idx + cmp_kv/cmp_idx, so the
    runtime never concatenates its SWA-ring and compressed pools): KV and Idx are replaced by
        KVw [S, D], KVc [S_cmp, D], IdxW [B, n_win] int32, IdxC [B, topk - n_win] int32
    (FP8: KVw, KVsw [S, D/32], KVc, KVsc [S_cmp, D/32], IdxW, IdxC), everything else as above:
        (Q, KVw, KVc, IdxW, IdxC, Sink, O)            split: (Q, KVw, KVc, IdxW, IdxC, Op, Mp, Lp)
    Entry j < n_win of request b is row IdxW[b, j] of KVw; entry j >= n_win is row IdxC[b, j - n_win] of KVc;
    -1 = invalid in either list. topk counts both lists (V4.1: 128 + 512 = 640); blocks and split chunks run
    over the concatenated entry order, so cfg's divisibility rules apply to topk, and the ws program needs
    n_win % 4 == 0 (its row-id copies move 4 ids). A window-only layer passes its one pool with n_win = 0.
    The ws program's pool sizes are symbolic (S / S_cmp are ignored); the others take them as given.
    """
    import tilelang.language as T

    assert 0 <= n_win < topk, (n_win, topk)
    if cfg.ws and ws_supported(H, D, target):
        assert n_win % 4 == 0, "the ws program copies row ids 4 at a time: n_win % 4 == 0"
        if Mem(target).cpu:
            return _program_ws_cpu(B, H, D, S, topk, cfg=cfg, kv_fp8=kv_fp8, n_win=n_win, S_cmp=S_cmp)
        func = _program_ws(B, H, D, S, topk, cfg=cfg, kv_fp8=kv_fp8, n_win=n_win)
        return func.with_attr("tilelang_pass_configs", WS_PASS_CONFIGS)
    if cfg.ws:  # same chunking (block_n, num_split: the reduction order) on the portable program
        cfg = Config(cfg.block_n, 256, cfg.num_split, 2)
    assert not kv_fp8, "FP8 KV: the ws program only"
    bn, ns = cfg.block_n, cfg.num_split
    assert topk % (bn * ns) == 0
    chunk = topk // ns
    mem = Mem(target)
    act = "float32" if mem.cpu else "bfloat16"
    scale = D**-0.5
    NEG = -3.0e38
    # The MMA tiles M by 16 rows: fewer heads (the small preset's 8) are padded with zero query rows that are never
    # stored (each head's row is computed alone: the real rows' numbers do not change); the padded rows' warps go
    # along N, so the CTA takes at most one warp per 16 x 8 tile of the QK^T block (8 heads, 32-row blocks: 128
    # threads). 64 heads: HP = H and the given threads (the same program as before).
    HP = -(-H // 16) * 16
    threads = min(cfg.threads, 32 * (HP // 16) * (bn // 8))

    @T.macro
    def load_q(Q, b, q_s):
        if HP == H:
            T.copy(Q[b, 0, 0], q_s)
        else:
            for h, d in mem.par(HP, D):
                q_s[h, d] = T.if_then_else(h < H, Q[b, T.min(h, H - 1), d], T.cast(0, act))

    @T.macro
    def body(Q, src, b, sp, q_s, kv_s, p_s, s, o, m, m_new, l_blk, l):
        load_q(Q, b, q_s)
        T.clear(o)
        T.clear(l)
        T.fill(m, NEG)
        for blk in T.Pipelined(chunk // bn, num_stages=cfg.stages):
            for r, d in mem.par(bn, D):  # gather: rows are arbitrary pool slots (no TMA box)
                e = sp * chunk + blk * bn + r
                kv_s[r, d] = src.load(e, T.max(src.row_id(b, e), 0), d)
            T.gemm(q_s, kv_s, s, transpose_B=True, clear_accum=True)
            for h, j in mem.par(H, bn):
                s[h, j] = T.if_then_else(src.row_id(b, sp * chunk + blk * bn + j) >= 0, s[h, j] * scale, NEG)
            T.reduce_max(s, m_new, dim=1, clear=True)
            for h in mem.par(H):
                m_new[h] = T.max(m_new[h], m[h])
            for h, d in mem.par(H, D):  # rescale the running output to the new max
                o[h, d] = o[h, d] * T.exp(m[h] - m_new[h])
            for h, j in mem.par(H, bn):
                # -1 entries weigh exactly 0, even while every entry so far is invalid (m_new = NEG)
                s[h, j] = T.if_then_else(
                    src.row_id(b, sp * chunk + blk * bn + j) >= 0, T.exp(s[h, j] - m_new[h]), T.float32(0)
                )
            T.reduce_sum(s, l_blk, dim=1)
            for h in mem.par(H):
                l[h] = l[h] * T.exp(m[h] - m_new[h]) + l_blk[h]
                m[h] = m_new[h]
            T.copy(s, p_s)
            T.gemm(p_s, kv_s, o)  # V = K: the same gathered rows

    @T.macro
    def cta(Q, src, Sink, O, Op, Mp, Lp, sp, b):
        q_s = mem.shared((HP, D), act)
        kv_s = mem.shared((bn, D), act)
        p_s = mem.shared((HP, bn), act)
        s = mem.fragment((HP, bn), "float32")
        o = mem.fragment((HP, D), "float32")
        m = mem.fragment((HP,), "float32")
        m_new = mem.fragment((HP,), "float32")
        l_blk = mem.fragment((HP,), "float32")
        l = mem.fragment((HP,), "float32")
        body(Q, src, b, sp, q_s, kv_s, p_s, s, o, m, m_new, l_blk, l)
        # One store path for every head count: the padded rows (h >= H) are never stored; at HP == H the guard is
        # true over the whole loop and TVM's simplifier removes it (the 64-head CUDA is the unguarded store's).
        if ns == 1:
            for h, d in mem.par(HP, D):
                if h < H:  # the sink joins the denominator only (it has no value row)
                    O[b, h, d] = T.cast(o[h, d] / (l[h] + T.exp(Sink[h] - m[h])), act)
        else:
            for h, d in mem.par(HP, D):
                if h < H:
                    Op[b, sp, h, d] = o[h, d]
            for h in mem.par(HP):
                if h < H:
                    Mp[b, sp, h] = m[h]
                    Lp[b, sp, h] = l[h]

    if n_win:
        return _two_pool_entry(cta, B=B, H=H, D=D, Sw=S, Sc=S_cmp or S, nw=n_win, nc=topk - n_win, ns=ns, kvt=act,
                               fp8=False, split=ns > 1, threads=None if mem.cpu else threads, act=act)  # fmt: skip
    if ns == 1:

        @T.prim_func
        def sparse_attn_decode(
            Q: T.Tensor((B, H, D), act),
            KV: T.Tensor((S, D), act),
            Idx: T.Tensor((B, topk), "int32"),
            Sink: T.Tensor((H,), "float32"),
            O: T.Tensor((B, H, D), act),
        ):
            with T.Kernel(B, threads=threads) as b:
                cta(Q, _Src(KV, None, Idx), Sink, O, None, None, None, 0, b)

        return sparse_attn_decode

    @T.prim_func
    def sparse_attn_decode_split(
        Q: T.Tensor((B, H, D), act),
        KV: T.Tensor((S, D), act),
        Idx: T.Tensor((B, topk), "int32"),
        Op: T.Tensor((B, ns, H, D), "float32"),
        Mp: T.Tensor((B, ns, H), "float32"),
        Lp: T.Tensor((B, ns, H), "float32"),
    ):
        with T.Kernel(ns, B, threads=threads) as (sp, b):
            cta(Q, _Src(KV, None, Idx), None, None, Op, Mp, Lp, sp, b)

    return sparse_attn_decode_split


# ---------------------------------------------------------------------------------------------- ws (sm90)


LOG2E = 1.4426950408889634
# tl::tma_load's 1-D form (cp.async.bulk): TileLang includes this header only for the copies it lowers itself
BULK_PRELUDE = "#include <tl_templates/cuda/copy_sm90.h>\n"
# Config.l2_prefetch: a bulk L2 prefetch (sm90; bytes a multiple of 16, a 16-B aligned address)
L2_PRELUDE = """
__device__ __forceinline__ void di_prefetch_l2(const void* ptr, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(ptr), "r"(bytes) : "memory");
}
"""
# Config.evict_first: tl::cp_async_gs<16>'s copy (no clobber, as there) under an L2 evict_first policy, made inside
# the same asm block (a 64-bit register for one instruction, unseen by the compiler: the policy made once and kept
# live, the persistent grid spilled 28 words instead of its 6). di_cp_async_ef_if: tl::cp_async_gs_conditional<16>'s
# form, which TileLang gives the pool-row copies (src-size 0: 16 zero bytes and no read where the row is past the pool,
# e.g. an empty pool). It takes the pool's base pointer and a byte offset, not an element of the pool: on an element
# TileLang wraps the call in its own bound check, an `if` that skips the copy (no zero fill) and cost the persistent
# grid 20 spilled words instead of 6.
EF_PRELUDE = """
__device__ __forceinline__ void di_cp_async_ef(void const* const smem, void const* gmem) {
  asm volatile("{\\n .reg .b64 policy;\\n createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\\n"
               " cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, policy;\\n}\\n"
               :: "r"((unsigned)__cvta_generic_to_shared(smem)), "l"(gmem));
}
__device__ __forceinline__ void di_cp_async_ef_if(void const* const smem, void const* pool, long long byte_offset,
                                                  bool pred) {
  asm volatile("{\\n .reg .b64 policy;\\n createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\\n"
               " cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, policy;\\n}\\n"
               :: "r"((unsigned)__cvta_generic_to_shared(smem)), "l"((char const*)pool + byte_offset),
                  "r"(pred ? 16 : 0));
}
"""


# Config.trace: Trace[b * num_split + sp, slot] (int64). Per CTA: globaltimer (ns) and clock64 at its start, WG0's clock
# when Q has landed, WG1's clock after its O (or partial) stores and globaltimer then, WG0's clock after its final
# max / sum; per block j, from TRACE_BLOCK0 + TRACE_PER_BLOCK * j: WG0 ready for block j (before its data wait), its
# rows landed, QK^T done, P published (p_full), then WG1 given P (after its waits) and WG1's PV done.
TRACE_GT0, TRACE_CLK0, TRACE_Q, TRACE_END, TRACE_GT_END, TRACE_FIN = range(6)
# session 9: WG1's clock once fin has completed (before its stores) and WG2's clock after its own stores
TRACE_FIN_WAITED, TRACE_END2 = 6, 7
TRACE_BLOCK0, TRACE_PER_BLOCK = 8, 6
TRACE_EVENTS = ("ready", "landed", "qk_done", "p_published", "pv_given_p", "pv_done")
TRACE_PRELUDE = """
__device__ __forceinline__ long long di_clock() { return clock64(); }
__device__ __forceinline__ long long di_gtimer() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return (long long)t;
}
"""


def trace_slots(nb: int) -> int:
    """Config.trace's slots a CTA writes for nb blocks."""
    return TRACE_BLOCK0 + TRACE_PER_BLOCK * nb


class _WsGeom:
    """Sizes of the ws program and the data each loader thread (t in 0..127 of a PV warpgroup) moves;
    shared with its CPU mirror (`_program_ws_cpu`), which checks this index arithmetic on TileLang's c target.

    bf16 KV: a block's half-rows are copied 16 B (8 elements) a thread: row r * 16 + t // 8 (r < bn/16),
    column u * 64 + t % 8 * 8 of the half (u < D/128). FP8 KV: tpr = D/32 threads per half-row, 16 e4m3
    bytes each: row r * RS + t // tpr (RS = 128 / tpr), column t % tpr * 16; the thread also copies the
    4-byte word of ue8m0 exponents that holds its 16 values' group (32 values a group)."""

    def __init__(self, H: int, D: int, topk: int, cfg: Config, kv_fp8: bool):
        self.bn, self.ns, self.NS = cfg.block_n, cfg.num_split, cfg.stages
        self.chunk = topk // self.ns
        self.nb = self.chunk // self.bn  # blocks per CTA
        self.D2 = D // 2
        self.tpr = self.D2 // 16 if kv_fp8 else 8  # threads sharing a half-row (FP8) or a 64-column group (bf16)
        self.RS = 128 // self.tpr if kv_fp8 else 16  # block rows covered by one pass of the 128 loader threads
        self.R = self.bn // self.RS  # rows a loader thread copies per block
        self.QC = H * self.D2 // 8 // 128  # Q half: 16 B copies a thread
        assert self.R >= 1 and self.bn % self.RS == 0 and self.QC * 1024 == H * self.D2 and self.D2 % 64 == 0

    def row(self, r, t):
        return r * self.RS + t // self.tpr

    def col(self, u, t):  # bf16: first of the 8 elements a copy moves (u-th 64-column group of the half)
        return u * 64 + t % 8 * 8

    def col8(self, t):  # FP8: first of the 16 bytes a copy moves
        return t % self.tpr * 16

    def scale_word(self, hf: int, t):  # FP8: first of the 4 exponent bytes this thread copies
        return (hf * self.D2 + self.col8(t)) // 128 * 4

    def scale_byte(self, hf: int, t):  # FP8: this thread's group among those 4 bytes
        return (hf * self.D2 + self.col8(t)) // 32 % 4

    def q_row(self, k, t):
        return (k * 128 + t) // (self.D2 // 8)

    def q_col(self, k, t):
        return (k * 128 + t) % (self.D2 // 8) * 8


class _Src(NamedTuple):
    """Where a program's entries come from: one pool (kv, kvs, idx) or two (`n_win` > 0: entry e < n_win is
    row idx[b, e] of kv, entry e >= n_win row idx2[b, e - n_win] of kv2). kvs / kvs2: the FP8 exponents
    (None for bf16 KV). Built inside the prim_func from its parameters; the macros branch on it statically."""

    kv: object
    kvs: object
    idx: object
    kv2: object = None
    kvs2: object = None
    idx2: object = None
    n_win: int = 0

    def row_id(self, b, e):
        """The pool row of entry e of request b (-1: invalid)."""
        import tilelang.language as T

        if not self.n_win:
            return self.idx[b, e]
        return T.if_then_else(e < self.n_win, self.idx[b, e], self.idx2[b, e - self.n_win])

    def load(self, e, row, col, scales: bool = False):
        """Element (row, col) of entry e's pool (its exponents with `scales`): the CPU mirror's gather."""
        import tilelang.language as T

        one = self.kvs if scales else self.kv
        if not self.n_win:
            return one[row, col]
        return T.if_then_else(e < self.n_win, one[row, col], (self.kvs2 if scales else self.kv2)[row, col])


def _program_ws(B: int, H: int, D: int, S: int, topk: int, *, cfg: Config, kv_fp8: bool, n_win: int = 0):
    """The warp-specialised sm90 program (FlashMLA-style). One CTA per (chunk, request), 3 warpgroups:

      WG0 (QK)    waits for block i's KV rows, S = Q K^T (wgmma, fp32), online softmax in base 2, writes
                  P (bf16) and the rescale factor alpha of block i to shared memory. With `lookahead` the
                  QK^T of block i+1 is issued (async wgmma) before the softmax of block i.
      WG1 / WG2   O[:, half] = alpha * O[:, half] + P V[:, half] (V = K) for the two D halves (64 x 256 fp32
                  accumulators: 128 registers a thread), then refill the stage they just freed with their
                  half of block i + stages: bf16 rows by cp.async (16 B a thread, rows clamped to >= 0);
                  FP8 KV: raw e4m3 bytes and ue8m0 exponent words were cp.async'd a ring earlier into a
                  staging buffer and are dequantised to bf16 (exact) into the freed stage by the thread that
                  loaded them (so only that thread's cp.async groups need to have landed).

    mbarriers: full[half, stage] (the half's 128 loaders: cp.async.mbarrier.arrive.noinc for bf16; a release
    arrive after the dequant stores and a proxy fence for FP8), p_full[stage] (WG0), p_empty[stage] (WG1 +
    WG2), bar_q (Q loaded), fin (WG0's final max and sum). Parity of block i: (i // stages) & 1.
    Base-2 softmax: s2 = (q.k) * d^-0.5 * log2(e); invalid entries are -inf before the max (weight exactly
    0); the running max starts at a finite -1e30, so a chunk of only invalid entries has l = 0, o = 0.
    Registers: ptxas caps every thread at 65536 / 384 = 168 (setmaxnreg does not raise the compile cap).
    """
    import tilelang.language as T

    g = _WsGeom(H, D, topk, cfg, kv_fp8)
    bn, ns, NS, la = cfg.block_n, cfg.num_split, cfg.stages, cfg.lookahead
    trace = cfg.trace
    assert not trace or (n_win and not kv_fp8), "trace: the two-pool bf16 program"
    skip = cfg.skipped  # diagnostics: parts left out (Config.skip)
    bulk = cfg.copy == "bulk"  # diagnostic: 1-D bulk row copies (async proxy: no proxy fence before the wgmmas)
    assert not (bulk and kv_fp8), "bulk copies: bf16 KV"
    pf = cfg.l2_prefetch  # blocks between a refill and the block it prefetches into L2
    assert not (pf and kv_fp8), "l2_prefetch: bf16 KV"
    ef = cfg.evict_first
    assert not (ef and kv_fp8), "evict_first: bf16 KV (its copies are all 16 B)"
    assert H == WS_HEADS and D % 128 == 0 and bn in (32, 64) and NS >= 2, (H, D, bn, NS)
    assert topk % (bn * ns) == 0
    assert not la or NS % 2 == 0, "lookahead alternates two S accumulators: an even stage count"
    if kv_fp8:
        assert bn == 32 and NS == 2, "FP8 KV: 32-row blocks in 2 stages (the staging buffer needs the room)"
    chunk, nb, D2, R = g.chunk, g.nb, g.D2, g.R
    opt = "bfloat16" if cfg.partial_bf16 else "float32"  # the split pass's Op
    rounds, tail = divmod(nb, NS)
    bf, f32, i32 = "bfloat16", "float32", "int32"
    scale = D**-0.5
    c2 = scale * LOG2E
    NEG = -1.0e30
    split = ns > 1
    pre = min(NS, nb)  # blocks loaded before the loop
    SL = NS if kv_fp8 else 1  # staging slots (FP8 only; 1-element dummies otherwise)
    # Python lists: these loops unroll at trace time, so stage indices and branches are static
    ring, tail_blocks, pre_blocks = list(range(NS)), list(range(tail)), list(range(pre))
    la_rounds, la_tail = (nb - 1) // NS, list(range((nb - 1) % NS))  # lookahead: the blocks that issue a next
    pf_pre = list(range(NS, min(NS + pf, nb))) if pf else []  # l2_prefetch: blocks the prologue prefetches

    def alloc_q_regs():
        """Config.q_regs: WG0's register fragment of Q's left half (None otherwise)."""
        return T.alloc_fragment((H, D2), bf) if cfg.q_regs else None

    def q_operand(q_l, q_f):
        """WG0's QK^T operand for Q's left half: q_l (shared), or with Config.q_regs its register fragment q_f. (A call
        at each use, not a variable: a Python name bound to q_l would rename the buffer in the generated source.)"""
        return q_f if cfg.q_regs else q_l

    def cp_async(dst, src_ptr, n: int):
        """cp.async of n elements (16 B with Config.evict_first, then under its L2 evict_first policy)."""
        if ef:
            return T.call_extern("handle", "di_cp_async_ef", dst, src_ptr)
        return T.ptx_cp_async(dst, src_ptr, n)

    def cp_pool_row(dst, pool, row, col, n: int):
        """cp.async n elements of pool row max(row, 0) from column col; Config.evict_first: 16 B (bf16) under its
        policy, zero-filled where the row is past the pool (the bound TileLang gives its own copy of a pool row)."""
        if not ef:
            return T.ptx_cp_async(dst, T.access_ptr(pool[T.max(row, 0), col], "r", n), n)
        offset = (T.cast(T.max(row, 0), "int64") * pool.shape[1] + col) * 2
        return T.call_extern("handle", "di_cp_async_ef_if", dst, pool.data, offset, T.max(row, 0) < pool.shape[0])

    @T.macro
    def wait_kv(full, st, ph):
        T.barrier_wait(full[st], ph)
        T.barrier_wait(full[NS + st], ph)
        if not bulk:
            T.fence_proxy_async()  # rows written by other threads (cp.async / st.shared), read by wgmma

    @T.macro
    def qk(q_l, q_r, kv_l, kv_r, Sacc, idx_s, full, st, ph, sync: bool):
        wait_kv(full, st, ph)
        for h, j in T.Parallel(H, bn):
            Sacc[h, j] = T.if_then_else(idx_s[st, j] >= 0, T.float32(0), -T.infinity(f32))
        if "qk" not in skip:
            T.wgmma_gemm(q_l, kv_l[st, :, :], Sacc, transpose_B=True)  # both halves back to back, one wait
            T.wgmma_gemm(q_r, kv_r[st, :, :], Sacc, transpose_B=True)
        if sync:
            T.wait_wgmma(0)

    @T.macro
    def stamp(Trace, row, slot, t, clock: bool = True):
        """Config.trace: thread t == 0 of its warpgroup writes the SM clock (or the globaltimer) to Trace[row, slot]."""
        if trace:
            if t == 0:
                Trace[row, slot] = T.call_extern("int64", "di_clock" if clock else "di_gtimer")

    @T.macro
    def row_sum(Sacc, l, lblk, alpha):
        T.reduce_sum(Sacc, lblk, dim=1)
        for h in T.Parallel(H):
            l[h] = l[h] * alpha[h] + lblk[h]

    @T.macro
    def softmax(Sacc, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, rnd):
        """Block rnd * NS + st's softmax (rnd: its ring round; barrier parity rnd & 1)."""
        if "softmax" in skip:
            for h in T.Parallel(H):
                alpha[h] = T.float32(1)
        else:
            T.copy(m, m_prev)
            T.reduce_max(Sacc, m, dim=1, clear=False)
            for h in T.Parallel(H):
                alpha[h] = T.exp2((m_prev[h] - m[h]) * c2)
            for h, j in T.Parallel(H, bn):
                Sacc[h, j] = T.exp2(Sacc[h, j] * c2 - m[h] * c2)
            row_sum(Sacc, l, lblk, alpha)
        T.barrier_wait(p_empty[st], (rnd & 1) ^ 1)
        T.copy(Sacc, p_s[st, :, :])
        for h in T.Parallel(H):
            alpha_s[st, h] = alpha[h]
        T.fence_proxy_async()  # P is read by the PV warpgroups' wgmma (async proxy)
        T.barrier_arrive(p_full[st])

    @T.macro
    def load_rid(src, b, base, blk, t, rid, k):
        if bulk:  # one row a thread (rows t % bn: the threads past bn load a duplicate and copy nothing)
            rid[k, 0] = src.row_id(b, base + blk * bn + t % bn)
        else:
            for r in T.unroll(R, explicit=True):
                rid[k, r] = src.row_id(b, base + blk * bn + g.row(r, t))

    @T.macro
    def bulk_row(src, dst, e, row, col, bar):
        """cp.async.bulk (1-D, the TMA engine) of D2 elements of pool row `row` (clamped to >= 0) from column
        col of entry e's pool to dst = (shared buffer, index tuple), completing bytes on mbarrier `bar`."""
        if src.n_win:
            if e < src.n_win:
                T.call_extern("handle", "tl::tma_load", T.access_ptr(dst[0][dst[1]], "w", D2),
                              T.access_ptr(src.kv[T.max(row, 0), col], "r", D2), bar, D2 * 2)  # fmt: skip
            else:
                T.call_extern("handle", "tl::tma_load", T.access_ptr(dst[0][dst[1]], "w", D2),
                              T.access_ptr(src.kv2[T.max(row, 0), col], "r", D2), bar, D2 * 2)  # fmt: skip
        else:
            T.call_extern("handle", "tl::tma_load", T.access_ptr(dst[0][dst[1]], "w", D2),
                          T.access_ptr(src.kv[T.max(row, 0), col], "r", D2), bar, D2 * 2)  # fmt: skip

    @T.macro
    def cp_row(src, dst, e, row, col, n: int, scales: bool):
        """cp.async n elements of pool row `row` (clamped to >= 0), from column col, of entry e's pool (the KV
        or, with `scales`, its FP8 exponents) to dst = (shared buffer, index tuple): two pools branch on e
        (uniform across a warp's rows unless a block straddles the pools). dst stays a tuple so that the
        access_ptr is built here (cp.async needs it literally, not through a macro's let binding)."""
        if src.n_win:
            if e < src.n_win:
                cp_pool_row(T.access_ptr(dst[0][dst[1]], "w", n), src.kvs if scales else src.kv, row, col, n)
            else:
                cp_pool_row(T.access_ptr(dst[0][dst[1]], "w", n), src.kvs2 if scales else src.kv2, row, col, n)
        else:
            cp_pool_row(T.access_ptr(dst[0][dst[1]], "w", n), src.kvs if scales else src.kv, row, col, n)

    @T.macro
    def cp_ids(src, dst, b, e):
        """cp.async the 4 row ids of entries e .. e + 3 (one list: n_win % 4 == 0), for WG0's mask."""
        if src.n_win:
            if e < src.n_win:
                cp_async(T.access_ptr(dst[0][dst[1]], "w", 4), T.access_ptr(src.idx[b, e], "r", 4), 4)
            else:
                cp_async(
                    T.access_ptr(dst[0][dst[1]], "w", 4), T.access_ptr(src.idx2[b, e - src.n_win], "r", 4), 4
                )
        else:
            cp_async(T.access_ptr(dst[0][dst[1]], "w", 4), T.access_ptr(src.idx[b, e], "r", 4), 4)

    @T.macro
    def gather(src, kvh, raw, sc, stg_idx, full, b, base, blk, st, hf: int, t, rid, k):
        """bf16: cp.async this half of block blk's rows into stage st and arm full[hf, st].
        FP8: cp.async the raw bytes and scale words into staging slot st (completion: cp.async groups)."""
        for r in T.unroll(R, explicit=True):
            e = base + blk * bn + g.row(r, t)
            if kv_fp8:
                cp_row(src, (raw, (st, g.row(r, t), g.col8(t))), e, rid[k, r],
                       hf * D2 + g.col8(t), 16, False)  # fmt: skip
                # the aligned 4 exponent bytes holding this chunk's group
                cp_row(src, (sc, (st, g.row(r, t), t % g.tpr * 4)), e, rid[k, r],
                       g.scale_word(hf, t), 4, True)  # fmt: skip
            elif "gather" not in skip and not bulk:
                for u in T.unroll(D2 // 64, explicit=True):
                    cp_row(src, (kvh, (st, g.row(r, t), g.col(u, t))), e, rid[k, r],
                           hf * D2 + g.col(u, t), 8, False)  # fmt: skip
        if bulk and "gather" not in skip:
            if t < bn:
                bulk_row(src, (kvh, (st, t, 0)), base + blk * bn + t, rid[k, 0], hf * D2, full[hf * NS + st])
        if hf == 0 and "ids" not in skip:
            if t < bn // 4:  # the block's row ids, for WG0's mask
                cp_ids(src, (stg_idx, (st, t * 4)), b, base + blk * bn + t * 4)
        if bulk and "gather" not in skip:
            if t == 0:  # the rows' bytes join the phase; every thread still arrives (its id copies, if any)
                T.mbarrier_expect_tx(full[hf * NS + st], bn * D2 * 2)
        if not kv_fp8:
            T.cp_async_barrier_noinc(full[hf * NS + st])

    @T.macro
    def dequant(raw, sc, stg_idx, kvh, idx_s, full, st, hf: int, t, buf, obuf):
        """FP8: staging slot st -> bf16 stage st (e4m3 x 2^(e - 127) is exact in bf16); arm full[hf, st]."""
        T.ptx_wait_group(NS - 1)  # this thread's copies of the block (NS groups in flight, oldest done)
        for r in T.unroll(R, explicit=True):
            for v in T.vectorized(16):
                buf[v] = raw[st, g.row(r, t), g.col8(t) + v]
            for v in T.unroll(16, explicit=True):
                obuf[v] = T.cast(
                    T.cast(buf[v], f32)
                    * T.exp2(T.cast(sc[st, g.row(r, t), t % g.tpr * 4 + g.scale_byte(hf, t)], f32) - 127.0),
                    bf,
                )
            for v in T.vectorized(16):
                kvh[st, g.row(r, t), g.col8(t) + v] = obuf[v]
        if hf == 0:
            if t < bn // 4:
                for v in T.vectorized(4):
                    idx_s[st, t * 4 + v] = stg_idx[st, t * 4 + v]
        T.fence_proxy_async()  # generic stores read by wgmma
        T.barrier_arrive(full[hf * NS + st])

    @T.macro
    def l2_block(src, b, base, blk, hf: int, t, rid):
        """l2_prefetch: threads t < bn prefetch this half of row t of block blk (its pool row in rid[NS, 0])."""
        if t < bn:
            e = base + blk * bn + t
            if src.n_win:
                if e < src.n_win:
                    T.call_extern("handle", "di_prefetch_l2", T.access_ptr(src.kv[T.max(rid[NS, 0], 0), hf * D2],
                                  "r", D2), D2 * 2)  # fmt: skip
                else:
                    T.call_extern("handle", "di_prefetch_l2", T.access_ptr(src.kv2[T.max(rid[NS, 0], 0), hf * D2],
                                  "r", D2), D2 * 2)  # fmt: skip
            else:
                T.call_extern("handle", "di_prefetch_l2", T.access_ptr(src.kv[T.max(rid[NS, 0], 0), hf * D2], "r", D2),
                              D2 * 2)  # fmt: skip

    @T.macro
    def refill(src, kvh, raw, sc, stg_idx, idx_s, full, b, base, blk, st, hf: int, t, rid, buf, obuf):
        """After PV(blk - NS) freed stage st: bf16 gathers block blk; FP8 dequantises block blk (loaded a
        ring ago) and stages block blk + NS. rid[0] holds the next gather's row ids; refreshed here."""
        if kv_fp8:
            dequant(raw, sc, stg_idx, kvh, idx_s, full, st, hf, t, buf, obuf)
            if blk + NS < nb:
                gather(src, kvh, raw, sc, stg_idx, full, b, base, blk + NS, st, hf, t, rid, 0)
            T.ptx_commit_group()  # always: keeps NS groups in flight for wait_group
            if blk + NS + 1 < nb:
                load_rid(src, b, base, blk + NS + 1, t, rid, 0)
        else:
            gather(src, kvh, raw, sc, idx_s, full, b, base, blk, st, hf, t, rid, 0)
            if blk + 1 < nb:
                load_rid(src, b, base, blk + 1, t, rid, 0)
            if pf:
                if blk + pf < nb:
                    l2_block(src, b, base, blk + pf, hf, t, rid)
                if blk + 1 + pf < nb:  # the row the next refill's prefetch needs (slot NS)
                    rid[NS, 0] = src.row_id(b, base + (blk + 1 + pf) * bn + t % bn)

    @T.macro
    def pv_wait(full, p_full, st, ph, hf: int):
        T.barrier_wait(p_full[st], ph)
        T.barrier_wait(full[hf * NS + st], ph)
        if "pvfence" not in skip and not bulk:
            T.fence_proxy_async()

    @T.macro
    def rescale_o(o, alpha_s, st):
        for h, d in T.Parallel(H, D2):
            o[h, d] = o[h, d] * alpha_s[st, h]

    @T.macro
    def pv_math(o, p_s, alpha_s, kvh, p_empty, st, rnd, hf: int):
        rescale_o(o, alpha_s, st)
        if "pv" not in skip:
            T.gemm(p_s[st, :, :], kvh[st, :, :], o)
        T.barrier_arrive(p_empty[st])
        # wgmma.wait_group is per warp: before any thread of this warpgroup refills the stage, all four warps'
        # MMAs (which all read the whole stage) must be done. Named barrier 1 + hf, 128 threads.
        T.sync_threads(1 + hf, 128)

    @T.macro
    def pv(o, p_s, alpha_s, kvh, full, p_full, p_empty, st, rnd, hf: int):
        """Block rnd * NS + st's PV (rnd: its ring round)."""
        pv_wait(full, p_full, st, rnd & 1, hf)
        pv_math(o, p_s, alpha_s, kvh, p_empty, st, rnd, hf)

    @T.macro
    def store_o_smem(O, Op, b, sp, hf: int, t, o, kvh, fin_s, st: int = 0, refilled: bool = False):
        """Config.o_smem: this warpgroup's normalised bf16 half of O (the split pass: its unnormalised bf16 partial,
        Config.partial_bf16) through its free KV stage st (the H x D2 tile in Q's 16-B pieces, `_WsGeom.q_row /
        q_col`: a warp stores 512 contiguous bytes of one head at a time). refilled: the stage is gathered into
        next (persistent grid), so every warp's reads must be done first."""
        for h, d in T.Parallel(H, D2):
            kvh[st, h, d] = T.cast(o[h, d], bf) if split else T.cast(o[h, d] * fin_s[h], bf)
        T.sync_threads(1 + hf, 128)  # the tile is written by all four warps of the warpgroup
        for k in T.unroll(g.QC, explicit=True):
            for v in T.vectorized(8):
                if split:
                    Op[b, sp, g.q_row(k, t), hf * D2 + g.q_col(k, t) + v] = kvh[st, g.q_row(k, t), g.q_col(k, t) + v]
                else:
                    O[b, g.q_row(k, t), hf * D2 + g.q_col(k, t) + v] = kvh[st, g.q_row(k, t), g.q_col(k, t) + v]
        if refilled:
            T.sync_threads(1 + hf, 128)

    @T.macro
    def store_zeros_rolled(O, b, hf: int, t):
        """Config.skip "ovals" (diagnostic): the single pass's O stores at their addresses (the wgmma accumulator's:
        thread t holds rows t // 32 * 16 + t % 32 // 4 (+ 8), column pairs i * 8 + t % 4 * 2) but zeros, from a rolled
        loop: the epilogue's traffic without its 64 unrolled register stores a thread (its code)."""
        for i in T.unroll(D2 // 4, annotations={"pragma_unroll_factor": 1}):  # a rolled loop: #pragma unroll 1
            for v in T.vectorized(2):
                O[b, t // 32 * 16 + i % 2 * 8 + t % 32 // 4, hf * D2 + i // 2 * 8 + t % 4 * 2 + v] = T.cast(0, bf)

    @T.macro
    def store_outputs(O, Op, b, sp, hf: int, t, o, kvh, fin_s):
        """The epilogue's stores of this warpgroup's D half: the split pass's partial, or the normalised O."""
        if cfg.o_smem:
            store_o_smem(O, Op, b, sp, hf, t, o, kvh, fin_s)
        elif split:
            for h, d in T.Parallel(H, D2):
                Op[b, sp, h, hf * D2 + d] = T.cast(o[h, d], opt)
        else:
            for h, d in T.Parallel(H, D2):
                O[b, h, hf * D2 + d] = T.cast(o[h, d] * fin_s[h], bf)

    @T.macro
    def pv_block(o, p_s, alpha_s, kvh, full, p_full, p_empty, st, rnd, hf: int, t, Trace, tr_row):
        """Block rnd * NS + st's PV, with Config.trace's two stamps (WG1: given P, PV done)."""
        if trace and hf == 0:
            pv_wait(full, p_full, st, rnd & 1, hf)
            stamp(Trace, tr_row, TRACE_BLOCK0 + TRACE_PER_BLOCK * (rnd * NS + st) + 4, t)
            pv_math(o, p_s, alpha_s, kvh, p_empty, st, rnd, hf)
            stamp(Trace, tr_row, TRACE_BLOCK0 + TRACE_PER_BLOCK * (rnd * NS + st) + 5, t)
        else:
            pv(o, p_s, alpha_s, kvh, full, p_full, p_empty, st, rnd, hf)

    @T.macro
    def pv_blocks(src, O, b, base, hf: int, t, o, kvh, raw, sc, stg_idx, idx_s, p_s, alpha_s, full, p_full, p_empty,
                  fin, rid, buf, obuf, Trace, tr_row):  # fmt: skip
        """A PV warpgroup's blocks after the prologue (PV, then the refill of the freed stage), up to fin."""
        for it in T.serial(rounds):
            for st in ring:
                pv_block(o, p_s, alpha_s, kvh, full, p_full, p_empty, st, it, hf, t, Trace, tr_row)
                if (it + 1) * NS + st < nb:
                    refill(src, kvh, raw, sc, stg_idx, idx_s, full, b, base, (it + 1) * NS + st, st, hf,
                           t, rid, buf, obuf)  # fmt: skip
        for st in tail_blocks:
            pv_block(o, p_s, alpha_s, kvh, full, p_full, p_empty, st, rounds, hf, t, Trace, tr_row)
        T.barrier_wait(fin, 0)
        if hf == 0:
            stamp(Trace, tr_row, TRACE_FIN_WAITED, t)

    @T.macro
    def pv_role(
        Q,
        src,
        O,
        Op,
        b,
        sp,
        base,
        hf: int,
        t,
        o,
        q_h,
        kvh,
        raw,
        sc,
        stg_idx,
        idx_s,
        p_s,
        alpha_s,
        fin_s,
        full,
        p_full,
        p_empty,
        bar_q,
        fin,
        rid,
        buf,
        obuf,
        Trace=None,
        tr_row=0,
    ):
        T.fill(o, 0.0)
        for k in T.unroll(g.QC, explicit=True):  # this half of Q (WG0 reads both)
            cp_async(
                T.access_ptr(q_h[g.q_row(k, t), g.q_col(k, t)], "w", 8),
                T.access_ptr(Q[b, g.q_row(k, t), hf * D2 + g.q_col(k, t)], "r", 8),
                8,
            )
        T.cp_async_barrier_noinc(bar_q)
        for j in pre_blocks:
            load_rid(src, b, base, j, t, rid, j)
        if kv_fp8:
            for j in ring:
                if j < nb:
                    gather(src, kvh, raw, sc, stg_idx, full, b, base, j, j, hf, t, rid, j)
                T.ptx_commit_group()
            if NS < nb:
                load_rid(src, b, base, NS, t, rid, 0)
            for j in pre_blocks:
                dequant(raw, sc, stg_idx, kvh, idx_s, full, j, hf, t, buf, obuf)
                if j + NS < nb:
                    gather(src, kvh, raw, sc, stg_idx, full, b, base, j + NS, j, hf, t, rid, 0)
                T.ptx_commit_group()
                if j + NS + 1 < nb:
                    load_rid(src, b, base, j + NS + 1, t, rid, 0)
        else:
            for j in pre_blocks:
                gather(src, kvh, raw, sc, idx_s, full, b, base, j, j, hf, t, rid, j)
            if NS < nb:
                load_rid(src, b, base, NS, t, rid, 0)
            for j in pf_pre:  # the blocks before the first refill's prefetch target
                rid[NS, 0] = src.row_id(b, base + j * bn + t % bn)
                l2_block(src, b, base, j, hf, t, rid)
            if pf and NS + pf < nb:
                rid[NS, 0] = src.row_id(b, base + (NS + pf) * bn + t % bn)
        pv_blocks(src, O, b, base, hf, t, o, kvh, raw, sc, stg_idx, idx_s, p_s, alpha_s, full, p_full, p_empty, fin,
                  rid, buf, obuf, Trace, tr_row)  # fmt: skip
        if "ovals" in skip:
            store_zeros_rolled(O, b, hf, t)
        if "ostore" in skip or "ovals" in skip:
            if fin_s[0] < 0:  # never (fin_s > 0): keeps O, hence every PV, live without running the stores' code
                store_outputs(O, Op, b, sp, hf, t, o, kvh, fin_s)
        else:
            store_outputs(O, Op, b, sp, hf, t, o, kvh, fin_s)
        if hf == 0:
            stamp(Trace, tr_row, TRACE_END, t)
            stamp(Trace, tr_row, TRACE_GT_END, t, False)
        else:
            stamp(Trace, tr_row, TRACE_END2, t)

    @T.macro
    def wg0_block_traced(q_l, q_r, kv_l, kv_r, s0, idx_s, full, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full,
                         p_empty, st, rnd, Trace, tr_row, tx):  # fmt: skip
        """WG0's block rnd * NS + st with Config.trace's stamps (the data wait first: qk's own wait then passes)."""
        slot = TRACE_BLOCK0 + TRACE_PER_BLOCK * (rnd * NS + st)
        stamp(Trace, tr_row, slot, tx)
        wait_kv(full, st, rnd & 1)
        stamp(Trace, tr_row, slot + 1, tx)
        qk(q_l, q_r, kv_l, kv_r, s0, idx_s, full, st, rnd & 1, True)
        stamp(Trace, tr_row, slot + 2, tx)
        softmax(s0, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, rnd)
        stamp(Trace, tr_row, slot + 3, tx)

    @T.macro
    def body(Q, src, Sink, O, Op, Mp, Lp, sp, b, Trace=None):
        q_l = T.alloc_shared((H, D2), bf)
        q_r = T.alloc_shared((H, D2), bf)
        kv_l = T.alloc_shared((NS, bn, D2), bf)
        kv_r = T.alloc_shared((NS, bn, D2), bf)
        p_s = T.alloc_shared((NS, H, bn), bf)
        alpha_s = T.alloc_shared((NS, H), f32)
        idx_s = T.alloc_shared((NS, bn), i32)
        fin_s = T.alloc_shared((H,), f32)
        raw_l = T.alloc_shared((SL, bn, D2 if kv_fp8 else 16), "float8_e4m3fn")
        raw_r = T.alloc_shared((SL, bn, D2 if kv_fp8 else 16), "float8_e4m3fn")
        sc_l = T.alloc_shared((SL, bn, g.tpr * 4), "uint8")
        sc_r = T.alloc_shared((SL, bn, g.tpr * 4), "uint8")
        stg_idx = T.alloc_shared((SL, bn), i32)
        q_f = alloc_q_regs()  # Config.q_regs only
        s0 = T.alloc_fragment((H, bn), f32)
        s1 = T.alloc_fragment((H, bn), f32)
        o_l = T.alloc_fragment((H, D2), f32)
        o_r = T.alloc_fragment((H, D2), f32)
        m = T.alloc_fragment((H,), f32)
        m_prev = T.alloc_fragment((H,), f32)
        l = T.alloc_fragment((H,), f32)
        lblk = T.alloc_fragment((H,), f32)
        alpha = T.alloc_fragment((H,), f32)
        rid = T.alloc_local((NS + (1 if pf else 0), R), i32)  # l2_prefetch: slot NS holds the prefetch's row
        buf = T.alloc_local((16,), "float8_e4m3fn")
        obuf = T.alloc_local((16,), bf)
        bar_q = T.alloc_barrier(256)
        full = T.alloc_barrier([128] * (2 * NS))
        p_full = T.alloc_barrier([128] * NS)
        p_empty = T.alloc_barrier([256] * NS)
        fin = T.alloc_barrier(128)
        base = sp * chunk
        tr_row = b * ns + sp  # Config.trace's row
        tx = T.get_thread_binding()
        stamp(Trace, tr_row, TRACE_GT0, tx, False)
        stamp(Trace, tr_row, TRACE_CLK0, tx)
        if tx < 128:  # ------------------------------------------------------ WG0: QK^T + softmax
            T.fill(m, NEG)
            T.fill(l, 0.0)
            T.barrier_wait(bar_q, 0)
            if cfg.q_regs:
                T.copy(q_l, q_f)
            stamp(Trace, tr_row, TRACE_Q, tx)
            if trace:
                for it in T.serial(rounds):
                    for st in ring:
                        wg0_block_traced(q_operand(q_l, q_f), q_r, kv_l, kv_r, s0, idx_s, full, m, m_prev, l,
                                         lblk, alpha, p_s, alpha_s, p_full, p_empty, st, it, Trace, tr_row,
                                         tx)  # fmt: skip
                for st in tail_blocks:
                    wg0_block_traced(q_operand(q_l, q_f), q_r, kv_l, kv_r, s0, idx_s, full, m, m_prev, l, lblk,
                                     alpha, p_s, alpha_s, p_full, p_empty, st, rounds, Trace, tr_row, tx)  # fmt: skip
            elif la:
                # blocks 0 .. nb-2 issue the next block's QK^T before their softmax (unconditionally: a
                # wgmma under a data-dependent branch makes ptxas serialise every wgmma, C7518); S[i % 2]
                qk(q_l, q_r, kv_l, kv_r, s0, idx_s, full, 0, 0, False)
                for it in T.serial(la_rounds):
                    for st in ring:
                        T.wait_wgmma(0)
                        nst, nph = (st + 1, it & 1) if st + 1 < NS else (0, (it + 1) & 1)
                        if st % 2 == 0:
                            qk(q_l, q_r, kv_l, kv_r, s1, idx_s, full, nst, nph, False)
                            softmax(s0, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, it)
                        else:
                            qk(q_l, q_r, kv_l, kv_r, s0, idx_s, full, nst, nph, False)
                            softmax(s1, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, it)
                for st in la_tail:
                    T.wait_wgmma(0)
                    if st % 2 == 0:
                        qk(q_l, q_r, kv_l, kv_r, s1, idx_s, full, st + 1, la_rounds & 1, False)
                        softmax(s0, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, la_rounds)
                    else:
                        qk(q_l, q_r, kv_l, kv_r, s0, idx_s, full, st + 1, la_rounds & 1, False)
                        softmax(s1, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, la_rounds)
                T.wait_wgmma(0)  # the last block, nb - 1 = la_rounds * NS + len(la_tail)
                if len(la_tail) % 2 == 0:
                    softmax(s0, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, len(la_tail), la_rounds)
                else:
                    softmax(s1, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, len(la_tail), la_rounds)
            else:
                for it in T.serial(rounds):
                    for st in ring:
                        qk(q_operand(q_l, q_f), q_r, kv_l, kv_r, s0, idx_s, full, st, it & 1, True)
                        softmax(s0, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, it)
                for st in tail_blocks:
                    qk(q_operand(q_l, q_f), q_r, kv_l, kv_r, s0, idx_s, full, st, rounds & 1, True)
                    softmax(s0, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, rounds)
            if split:
                for h in T.Parallel(H):
                    Mp[b, sp, h] = m[h] * scale  # natural-log units, as the combine expects
                    Lp[b, sp, h] = l[h]
            else:
                for h in T.Parallel(H):  # the sink joins the denominator only
                    fin_s[h] = 1.0 / (l[h] + T.exp2(Sink[h] * LOG2E - m[h] * c2))
            T.barrier_arrive(fin)
            stamp(Trace, tr_row, TRACE_FIN, tx)
        elif tx < 256:  # --------------------------------------------- WG1: PV, left D half + its loads
            pv_role(Q, src, O, Op, b, sp, base, 0, tx - 128, o_l, q_l, kv_l, raw_l, sc_l, stg_idx,
                    idx_s, p_s, alpha_s, fin_s, full, p_full, p_empty, bar_q, fin, rid, buf, obuf, Trace,
                    tr_row)  # fmt: skip
        else:  # ------------------------------------------------------ WG2: PV, right D half + its loads
            pv_role(Q, src, O, Op, b, sp, base, 1, tx - 256, o_r, q_r, kv_r, raw_r, sc_r, stg_idx,
                    idx_s, p_s, alpha_s, fin_s, full, p_full, p_empty, bar_q, fin, rid, buf, obuf, Trace,
                    tr_row)  # fmt: skip

    # The batch and the pool sizes are symbolic: one build serves every batch size and KV pool (the tuner
    # still keys on the B bucket; the code does not depend on it).
    Bd, Sd, Sc = T.dynamic("B"), T.dynamic("S"), T.dynamic("S_cmp")

    # ------------------------------------------------------------------------ persistent grid (Config.persist)
    P = cfg.persist
    if P:
        assert not split and not kv_fp8 and not pf and not skip and not bulk, "persist: bf16 single pass"
        assert tail == 0 and rounds >= 2, "persist: whole rounds, at least two (blocks of a token % stages == 0)"

    @T.macro
    def load_q(Q, b, hf: int, t, q_h, bar_q):
        """This PV warpgroup's half of request b's Q (cp.async), completing on bar_q."""
        for u in T.unroll(g.QC, explicit=True):
            cp_async(
                T.access_ptr(q_h[g.q_row(u, t), g.q_col(u, t)], "w", 8),
                T.access_ptr(Q[b, g.q_row(u, t), hf * D2 + g.q_col(u, t)], "r", 8),
                8,
            )
        T.cp_async_barrier_noinc(bar_q)

    @T.macro
    def next_rid(src, b, blk, t, rid):
        """Row ids of the next gather into rid[0]: block blk of request b, or past its last block, block 0 of
        the CTA's next request (none after the last)."""
        if blk < nb:
            load_rid(src, b, 0, blk, t, rid, 0)
        elif b + P < Bd:
            load_rid(src, b + P, 0, 0, t, rid, 0)

    @T.macro
    def next_first_blocks(src, kvh, idx_s, full, nb_req, st: int, hf: int, t, rid):
        """Persistent grid, the last round of a request: gather block st of the CTA's next request nb_req into the
        stage just freed, then load the row ids of its block st + 1."""
        gather(src, kvh, None, None, idx_s, full, nb_req, 0, st, st, hf, t, rid, 0)
        load_rid(src, nb_req, 0, st + 1, t, rid, 0)

    @T.macro
    def request_blocks_p(Q, src, b, k, hf: int, t, o, q_h, kvh, idx_s, p_s, alpha_s, full, p_full, p_empty, bar_q, fin,
                         rid):  # fmt: skip
        """The persistent grid's PV warpgroups: the CTA's k-th request b, its blocks up to fin."""
        for it in T.serial(rounds - 1):
            for st in ring:
                pv(o, p_s, alpha_s, kvh, full, p_full, p_empty, st, k * rounds + it, hf)
                gather(src, kvh, None, None, idx_s, full, b, 0, (it + 1) * NS + st, st, hf, t, rid, 0)
                next_rid(src, b, (it + 1) * NS + st + 1, t, rid)
        for st in ring:  # the last round: its refills gather the next request's first NS blocks
            pv_wait(full, p_full, st, (k * rounds + rounds - 1) & 1, hf)
            if st == NS - 1:
                if b + P < Bd:  # WG0 is past its last QK^T of request b (it armed p_full of this block)
                    load_q(Q, b + P, hf, t, q_h, bar_q)
            pv_math(o, p_s, alpha_s, kvh, p_empty, st, k * rounds + rounds - 1, hf)
            if not (cfg.o_smem and st == NS - 1):
                if b + P < Bd:
                    next_first_blocks(src, kvh, idx_s, full, b + P, st, hf, t, rid)
        T.barrier_wait(fin, k & 1)  # WG0's fin_s of request b (it cannot be a request ahead: see body_p)

    @T.macro
    def pv_role_p(Q, src, O, c, ntok, hf: int, t, o, q_h, kvh, idx_s, p_s, alpha_s, fin_s, full, p_full, p_empty,
                  bar_q, fin, rid):  # fmt: skip
        """The PV warpgroups of the persistent grid. Block i of the CTA's k-th request is global block
        k * nb + i: stage i % NS, parity (k * rounds + i // NS) & 1 (nb % NS == 0), so the ring never drains."""
        T.fill(o, 0.0)
        if c < Bd:  # the first request: Q, the ring's first NS blocks, the next block's row ids
            load_q(Q, c, hf, t, q_h, bar_q)
            for j in pre_blocks:
                load_rid(src, c, 0, j, t, rid, j)
            for j in pre_blocks:
                gather(src, kvh, None, None, idx_s, full, c, 0, j, j, hf, t, rid, j)
            load_rid(src, c, 0, NS, t, rid, 0)
        for k in T.serial(ntok):
            b = c + k * P
            request_blocks_p(Q, src, b, k, hf, t, o, q_h, kvh, idx_s, p_s, alpha_s, full, p_full, p_empty, bar_q, fin,
                             rid)  # fmt: skip
            if cfg.o_smem:  # O through the last block's stage; the next request's block NS - 1 is gathered after
                store_o_smem(O, None, b, 0, hf, t, o, kvh, fin_s, NS - 1, True)
                if b + P < Bd:
                    next_first_blocks(src, kvh, idx_s, full, b + P, NS - 1, hf, t, rid)
            else:
                for h, d in T.Parallel(H, D2):
                    O[b, h, hf * D2 + d] = T.cast(o[h, d] * fin_s[h], bf)
            T.fill(o, 0.0)

    @T.macro
    def wg0_lookahead_p(q_l, q_r, kv_l, kv_r, s0, s1, idx_s, full, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full,
                        p_empty, kr):  # fmt: skip
        """WG0's blocks of one request with `lookahead` (as in body; kr = the request's first ring round): the
        QK^T of block i + 1 is issued before the softmax of block i, alternating S accumulators; nb is a whole
        number of rounds here, so blocks 0 .. nb - 2 issue a next and block nb - 1 (stage NS - 1) does not."""
        qk(q_l, q_r, kv_l, kv_r, s0, idx_s, full, 0, kr & 1, False)
        for it in T.serial(rounds - 1):
            for st in ring:
                T.wait_wgmma(0)
                nst, nph = (st + 1, (kr + it) & 1) if st + 1 < NS else (0, (kr + it + 1) & 1)
                if st % 2 == 0:
                    qk(q_l, q_r, kv_l, kv_r, s1, idx_s, full, nst, nph, False)
                    softmax(s0, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, kr + it)
                else:
                    qk(q_l, q_r, kv_l, kv_r, s0, idx_s, full, nst, nph, False)
                    softmax(s1, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, kr + it)
        for st in ring:  # the last round: its last block issues nothing
            T.wait_wgmma(0)
            rnd = kr + rounds - 1
            ph = rnd & 1
            if st + 1 < NS:
                if st % 2 == 0:
                    qk(q_l, q_r, kv_l, kv_r, s1, idx_s, full, st + 1, ph, False)
                    softmax(s0, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, rnd)
                else:
                    qk(q_l, q_r, kv_l, kv_r, s0, idx_s, full, st + 1, ph, False)
                    softmax(s1, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, rnd)
            elif st % 2 == 0:
                softmax(s0, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, rnd)
            else:
                softmax(s1, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st, rnd)

    @T.macro
    def body_p(Q, src, Sink, O, Op, Mp, Lp, sp, c):
        """The persistent CTA c: requests c, c + P, ... Hand-offs as in body, plus two that span requests:
        bar_q (parity k & 1: the next Q, loaded by the PV warpgroups once WG0 armed p_full of the request's
        last block, i.e. finished its last QK^T) and fin (parity k & 1). WG0 cannot write fin_s of request
        k + 1 before the PV warpgroups read that of request k: its last softmax of k + 1 waits p_empty of a
        block of k + 1, which they arm only after their epilogue of k."""
        q_l = T.alloc_shared((H, D2), bf)
        q_r = T.alloc_shared((H, D2), bf)
        kv_l = T.alloc_shared((NS, bn, D2), bf)
        kv_r = T.alloc_shared((NS, bn, D2), bf)
        p_s = T.alloc_shared((NS, H, bn), bf)
        alpha_s = T.alloc_shared((NS, H), f32)
        idx_s = T.alloc_shared((NS, bn), i32)
        fin_s = T.alloc_shared((H,), f32)
        q_f = alloc_q_regs()  # Config.q_regs only
        s0 = T.alloc_fragment((H, bn), f32)
        s1 = T.alloc_fragment((H, bn), f32)
        o_l = T.alloc_fragment((H, D2), f32)
        o_r = T.alloc_fragment((H, D2), f32)
        m = T.alloc_fragment((H,), f32)
        m_prev = T.alloc_fragment((H,), f32)
        l = T.alloc_fragment((H,), f32)
        lblk = T.alloc_fragment((H,), f32)
        alpha = T.alloc_fragment((H,), f32)
        rid = T.alloc_local((NS, R), i32)
        bar_q = T.alloc_barrier(256)
        full = T.alloc_barrier([128] * (2 * NS))
        p_full = T.alloc_barrier([128] * NS)
        p_empty = T.alloc_barrier([256] * NS)
        fin = T.alloc_barrier(128)
        ntok = (Bd - c + P - 1) // P  # c < P: >= 0, and 0 for a CTA past the last request
        tx = T.get_thread_binding()
        if tx < 128:  # ------------------------------------------------------ WG0: QK^T + softmax
            for k in T.serial(ntok):
                T.fill(m, NEG)
                T.fill(l, 0.0)
                T.barrier_wait(bar_q, k & 1)
                if cfg.q_regs:
                    T.copy(q_l, q_f)
                if la:
                    wg0_lookahead_p(q_l, q_r, kv_l, kv_r, s0, s1, idx_s, full, m, m_prev, l, lblk, alpha, p_s,
                                    alpha_s, p_full, p_empty, k * rounds)  # fmt: skip
                else:
                    for it in T.serial(rounds):
                        for st in ring:
                            qk(q_operand(q_l, q_f), q_r, kv_l, kv_r, s0, idx_s, full, st, (k * rounds + it) & 1, True)
                            softmax(s0, m, m_prev, l, lblk, alpha, p_s, alpha_s, p_full, p_empty, st,
                                    k * rounds + it)  # fmt: skip
                for h in T.Parallel(H):  # the sink joins the denominator only
                    fin_s[h] = 1.0 / (l[h] + T.exp2(Sink[h] * LOG2E - m[h] * c2))
                T.barrier_arrive(fin)
        elif tx < 256:
            pv_role_p(Q, src, O, c, ntok, 0, tx - 128, o_l, q_l, kv_l, idx_s, p_s, alpha_s, fin_s, full, p_full,
                      p_empty, bar_q, fin, rid)  # fmt: skip
        else:
            pv_role_p(Q, src, O, c, ntok, 1, tx - 256, o_r, q_r, kv_r, idx_s, p_s, alpha_s, fin_s, full, p_full,
                      p_empty, bar_q, fin, rid)  # fmt: skip

    prelude = BULK_PRELUDE if bulk else (L2_PRELUDE if pf else (TRACE_PRELUDE if trace else None))
    if ef:
        prelude = (prelude or "") + EF_PRELUDE
    kvt = "float8_e4m3fn" if kv_fp8 else bf
    nw, nc = n_win, topk - n_win  # two pools: the window list's and the compressed list's entries
    if n_win:
        return _two_pool_entry(body_p if P else body, B=Bd, H=H, D=D, Sw=Sd, Sc=Sc, nw=nw, nc=nc, ns=ns, kvt=kvt,
                                  fp8=kv_fp8, split=split, prelude=prelude, persist=P, op_dtype=opt,
                                  trace_slots=trace_slots(nb) if trace else 0)  # fmt: skip
    if P:

        @T.prim_func
        def sparse_attn_decode_ws_persist(
            Q: T.Tensor((Bd, H, D), bf),
            KV: T.Tensor((Sd, D), kvt),
            Idx: T.Tensor((Bd, topk), i32),
            Sink: T.Tensor((H,), f32),
            O: T.Tensor((Bd, H, D), bf),
        ):
            with T.Kernel(P, threads=WS_THREADS) as c:
                body_p(Q, _Src(KV, None, Idx), Sink, O, None, None, None, 0, c)

        return sparse_attn_decode_ws_persist
    if kv_fp8 and split:

        @T.prim_func
        def sparse_attn_decode_ws_fp8_split(
            Q: T.Tensor((Bd, H, D), bf),
            KV: T.Tensor((Sd, D), kvt),
            KVs: T.Tensor((Sd, D // 32), "uint8"),
            Idx: T.Tensor((Bd, topk), i32),
            Op: T.Tensor((Bd, ns, H, D), opt),
            Mp: T.Tensor((Bd, ns, H), f32),
            Lp: T.Tensor((Bd, ns, H), f32),
        ):
            with T.Kernel(ns, Bd, threads=WS_THREADS, prelude=prelude) as (sp, b):
                body(Q, _Src(KV, KVs, Idx), None, None, Op, Mp, Lp, sp, b)

        return sparse_attn_decode_ws_fp8_split
    if kv_fp8:

        @T.prim_func
        def sparse_attn_decode_ws_fp8(
            Q: T.Tensor((Bd, H, D), bf),
            KV: T.Tensor((Sd, D), kvt),
            KVs: T.Tensor((Sd, D // 32), "uint8"),
            Idx: T.Tensor((Bd, topk), i32),
            Sink: T.Tensor((H,), f32),
            O: T.Tensor((Bd, H, D), bf),
        ):
            with T.Kernel(ns, Bd, threads=WS_THREADS, prelude=prelude) as (sp, b):
                body(Q, _Src(KV, KVs, Idx), Sink, O, None, None, None, sp, b)

        return sparse_attn_decode_ws_fp8
    if split:

        @T.prim_func
        def sparse_attn_decode_ws_split(
            Q: T.Tensor((Bd, H, D), bf),
            KV: T.Tensor((Sd, D), kvt),
            Idx: T.Tensor((Bd, topk), i32),
            Op: T.Tensor((Bd, ns, H, D), opt),
            Mp: T.Tensor((Bd, ns, H), f32),
            Lp: T.Tensor((Bd, ns, H), f32),
        ):
            with T.Kernel(ns, Bd, threads=WS_THREADS, prelude=prelude) as (sp, b):
                body(Q, _Src(KV, None, Idx), None, None, Op, Mp, Lp, sp, b)

        return sparse_attn_decode_ws_split

    @T.prim_func
    def sparse_attn_decode_ws(
        Q: T.Tensor((Bd, H, D), bf),
        KV: T.Tensor((Sd, D), kvt),
        Idx: T.Tensor((Bd, topk), i32),
        Sink: T.Tensor((H,), f32),
        O: T.Tensor((Bd, H, D), bf),
    ):
        with T.Kernel(ns, Bd, threads=WS_THREADS, prelude=prelude) as (sp, b):
            body(Q, _Src(KV, None, Idx), Sink, O, None, None, None, sp, b)

    return sparse_attn_decode_ws


def _two_pool_entry(body, *, B, H, D, Sw, Sc, nw, nc, ns, kvt, fp8: bool, split: bool, threads=WS_THREADS,
                       act="bfloat16", prelude=None, persist: int = 0, op_dtype="float32",
                       trace_slots: int = 0):  # fmt: skip
    """The two-pool prim_funcs (signatures: `program`) around a CTA body(Q, src, Sink, O, Op, Mp, Lp, sp, b)
    of any of the programs; threads None: TileLang's c target. persist: a grid of that many CTAs, body's b
    is the CTA index (the persistent ws body walks the requests itself). trace_slots (Config.trace, bf16 ws): one
    prim_func for the single and the split pass, (Q, KVw, KVc, IdxW, IdxC, Sink, O, Op, Mp, Lp, Trace) with Trace
    [B * ns, trace_slots] int64, passed to body as Trace."""
    import tilelang.language as T

    f32, i32 = "float32", "int32"
    if trace_slots:  # one entry for both passes: the pass's unused outputs (Op, Mp, Lp or Sink, O) are left alone

        @T.prim_func
        def sparse_attn_decode_ws2_trace(
            Q: T.Tensor((B, H, D), act),
            KVw: T.Tensor((Sw, D), kvt),
            KVc: T.Tensor((Sc, D), kvt),
            IdxW: T.Tensor((B, nw), i32),
            IdxC: T.Tensor((B, nc), i32),
            Sink: T.Tensor((H,), f32),
            O: T.Tensor((B, H, D), act),
            Op: T.Tensor((B, ns, H, D), op_dtype),
            Mp: T.Tensor((B, ns, H), f32),
            Lp: T.Tensor((B, ns, H), f32),
            Trace: T.Tensor((B * ns, trace_slots), "int64"),
        ):
            with T.Kernel(ns, B, threads=threads, prelude=prelude) as (sp, b):
                body(Q, _Src(KVw, None, IdxW, KVc, None, IdxC, nw), Sink, O, Op, Mp, Lp, sp, b, Trace)

        return sparse_attn_decode_ws2_trace
    if persist:

        @T.prim_func
        def sparse_attn_decode_ws2_persist(
            Q: T.Tensor((B, H, D), act),
            KVw: T.Tensor((Sw, D), kvt),
            KVc: T.Tensor((Sc, D), kvt),
            IdxW: T.Tensor((B, nw), i32),
            IdxC: T.Tensor((B, nc), i32),
            Sink: T.Tensor((H,), f32),
            O: T.Tensor((B, H, D), act),
        ):
            with T.Kernel(persist, threads=threads, prelude=prelude) as c:
                body(Q, _Src(KVw, None, IdxW, KVc, None, IdxC, nw), Sink, O, None, None, None, 0, c)

        return sparse_attn_decode_ws2_persist
    if fp8 and split:

        @T.prim_func
        def sparse_attn_decode_ws2_fp8_split(
            Q: T.Tensor((B, H, D), act),
            KVw: T.Tensor((Sw, D), kvt),
            KVsw: T.Tensor((Sw, D // 32), "uint8"),
            KVc: T.Tensor((Sc, D), kvt),
            KVsc: T.Tensor((Sc, D // 32), "uint8"),
            IdxW: T.Tensor((B, nw), i32),
            IdxC: T.Tensor((B, nc), i32),
            Op: T.Tensor((B, ns, H, D), op_dtype),
            Mp: T.Tensor((B, ns, H), f32),
            Lp: T.Tensor((B, ns, H), f32),
        ):
            with T.Kernel(ns, B, threads=threads, prelude=prelude) as (sp, b):
                body(Q, _Src(KVw, KVsw, IdxW, KVc, KVsc, IdxC, nw), None, None, Op, Mp, Lp, sp, b)

        return sparse_attn_decode_ws2_fp8_split
    if fp8:

        @T.prim_func
        def sparse_attn_decode_ws2_fp8(
            Q: T.Tensor((B, H, D), act),
            KVw: T.Tensor((Sw, D), kvt),
            KVsw: T.Tensor((Sw, D // 32), "uint8"),
            KVc: T.Tensor((Sc, D), kvt),
            KVsc: T.Tensor((Sc, D // 32), "uint8"),
            IdxW: T.Tensor((B, nw), i32),
            IdxC: T.Tensor((B, nc), i32),
            Sink: T.Tensor((H,), f32),
            O: T.Tensor((B, H, D), act),
        ):
            with T.Kernel(ns, B, threads=threads, prelude=prelude) as (sp, b):
                body(Q, _Src(KVw, KVsw, IdxW, KVc, KVsc, IdxC, nw), Sink, O, None, None, None, sp, b)

        return sparse_attn_decode_ws2_fp8
    if split:

        @T.prim_func
        def sparse_attn_decode_ws2_split(
            Q: T.Tensor((B, H, D), act),
            KVw: T.Tensor((Sw, D), kvt),
            KVc: T.Tensor((Sc, D), kvt),
            IdxW: T.Tensor((B, nw), i32),
            IdxC: T.Tensor((B, nc), i32),
            Op: T.Tensor((B, ns, H, D), op_dtype),
            Mp: T.Tensor((B, ns, H), f32),
            Lp: T.Tensor((B, ns, H), f32),
        ):
            with T.Kernel(ns, B, threads=threads, prelude=prelude) as (sp, b):
                body(Q, _Src(KVw, None, IdxW, KVc, None, IdxC, nw), None, None, Op, Mp, Lp, sp, b)

        return sparse_attn_decode_ws2_split

    @T.prim_func
    def sparse_attn_decode_ws2(
        Q: T.Tensor((B, H, D), act),
        KVw: T.Tensor((Sw, D), kvt),
        KVc: T.Tensor((Sc, D), kvt),
        IdxW: T.Tensor((B, nw), i32),
        IdxC: T.Tensor((B, nc), i32),
        Sink: T.Tensor((H,), f32),
        O: T.Tensor((B, H, D), act),
    ):
        with T.Kernel(ns, B, threads=threads, prelude=prelude) as (sp, b):
            body(Q, _Src(KVw, None, IdxW, KVc, None, IdxC, nw), Sink, O, None, None, None, sp, b)

    return sparse_attn_decode_ws2


def _program_ws_cpu(
    B: int, H: int, D: int, S: int, topk: int, *, cfg: Config, kv_fp8: bool, n_win: int = 0, S_cmp: int = 0
):
    """CPU mirror of `_program_ws` for TileLang's c target (fp32 data): the same geometry and per-thread
    index arithmetic (`_WsGeom`) for the Q, KV-row, FP8-exponent-word and row-id copies, the same stage
    ring and chunking, the mask (-inf before the max, finite -1e30 start), the base-2 online softmax with
    alpha applied to O before P V, the split outputs and the sink. The warpgroups run one after another
    for each block and each thread's copies are a serial loop over t; the barriers' ordering is program
    order here. It checks the index arithmetic and the math, not the synchronisation."""
    import tilelang.language as T

    g = _WsGeom(H, D, topk, cfg, kv_fp8)
    bn, ns, NS = cfg.block_n, cfg.num_split, cfg.stages
    assert topk % (bn * ns) == 0
    chunk, nb, D2, R, tpr = g.chunk, g.nb, g.D2, g.R, g.tpr
    f32, i32 = "float32", "int32"
    scale = D**-0.5
    c2 = scale * LOG2E
    NEG = -1.0e30
    split = ns > 1

    @T.macro
    def body(Q, src, Sink, O, Op, Mp, Lp, sp, b):
        q = T.alloc_local((2, H, D2), f32)
        kv = T.alloc_local((2, NS, bn, D2), f32)  # [half, stage, row, column]
        raw = T.alloc_local((2, NS, bn, D2), f32)
        sc = T.alloc_local((2, NS, bn, tpr * 4), "uint8")
        idx_s = T.alloc_local((NS, bn), i32)
        p = T.alloc_local((NS, H, bn), f32)
        alpha_s = T.alloc_local((NS, H), f32)
        sacc = T.alloc_local((H, bn), f32)
        o = T.alloc_local((2, H, D2), f32)
        m = T.alloc_local((H,), f32)
        m_prev = T.alloc_local((H,), f32)
        l = T.alloc_local((H,), f32)
        acc = T.alloc_local((1,), f32)
        rid = T.alloc_local((R,), i32)
        base = sp * chunk
        for hf in T.serial(2):
            for t in T.serial(128):
                for k in T.serial(g.QC):
                    for v in T.serial(8):
                        q[hf, g.q_row(k, t), g.q_col(k, t) + v] = Q[b, g.q_row(k, t), hf * D2 + g.q_col(k, t) + v]
        for h in T.serial(H):
            m[h] = NEG
            l[h] = 0.0
            for hf in T.serial(2):
                for d in T.serial(D2):
                    o[hf, h, d] = 0.0
        for i in T.serial(nb):
            st = i % NS
            for hf in T.serial(2):  # the PV warpgroups' loaders fill block i into stage st
                for t in T.serial(128):
                    for r in T.serial(R):
                        rid[r] = src.row_id(b, base + i * bn + g.row(r, t))
                    for r in T.serial(R):
                        row, pr, e = g.row(r, t), T.max(rid[r], 0), base + i * bn + g.row(r, t)
                        if kv_fp8:
                            for v in T.serial(16):
                                raw[hf, st, row, g.col8(t) + v] = src.load(e, pr, hf * D2 + g.col8(t) + v)
                            for v in T.serial(4):
                                sc[hf, st, row, t % tpr * 4 + v] = src.load(e, pr, g.scale_word(hf, t) + v, True)
                            for v in T.serial(16):  # the dequant, by the same thread
                                kv[hf, st, row, g.col8(t) + v] = raw[hf, st, row, g.col8(t) + v] * T.exp2(
                                    T.cast(sc[hf, st, row, t % tpr * 4 + g.scale_byte(hf, t)], f32) - 127.0
                                )
                        else:
                            for u in T.serial(D2 // 64):
                                for v in T.serial(8):
                                    kv[hf, st, row, g.col(u, t) + v] = src.load(e, pr, hf * D2 + g.col(u, t) + v)
                    if hf == 0:
                        if t < bn // 4:
                            for v in T.serial(4):
                                idx_s[st, t * 4 + v] = src.row_id(b, base + i * bn + t * 4 + v)
            for h in T.serial(H):  # WG0
                m_prev[h] = m[h]
                for j in T.serial(bn):
                    sacc[h, j] = T.if_then_else(idx_s[st, j] >= 0, T.float32(0), -T.infinity(f32))
                    for hf in T.serial(2):
                        for d in T.serial(D2):
                            sacc[h, j] = sacc[h, j] + q[hf, h, d] * kv[hf, st, j, d]
                    m[h] = T.max(m[h], sacc[h, j])
                alpha_s[st, h] = T.exp2((m_prev[h] - m[h]) * c2)
                acc[0] = 0.0
                for j in T.serial(bn):
                    p[st, h, j] = T.exp2(sacc[h, j] * c2 - m[h] * c2)
                    acc[0] = acc[0] + p[st, h, j]
                l[h] = l[h] * alpha_s[st, h] + acc[0]
            for hf in T.serial(2):  # WG1 / WG2
                for h in T.serial(H):
                    for d in T.serial(D2):
                        o[hf, h, d] = o[hf, h, d] * alpha_s[st, h]
                        for j in T.serial(bn):
                            o[hf, h, d] = o[hf, h, d] + p[st, h, j] * kv[hf, st, j, d]
        for h in T.serial(H):
            if split:
                Mp[b, sp, h] = m[h] * scale
                Lp[b, sp, h] = l[h]
                for hf in T.serial(2):
                    for d in T.serial(D2):
                        if cfg.o_smem:  # staged in the half's KV stage 0 (bn == H), stored below
                            kv[hf, 0, h, d] = o[hf, h, d]
                        else:
                            Op[b, sp, h, hf * D2 + d] = o[hf, h, d]
            else:
                acc[0] = 1.0 / (l[h] + T.exp2(Sink[h] * LOG2E - m[h] * c2))
                for hf in T.serial(2):
                    for d in T.serial(D2):
                        if cfg.o_smem:  # staged in the half's KV stage 0 (bn == H), stored below
                            kv[hf, 0, h, d] = o[hf, h, d] * acc[0]
                        else:
                            O[b, h, hf * D2 + d] = o[hf, h, d] * acc[0]
        if cfg.o_smem:  # each PV warpgroup's 16-B pieces of its half (store_o_smem's mapping)
            for hf in T.serial(2):
                for t in T.serial(128):
                    for k in T.serial(g.QC):
                        for v in T.serial(8):
                            row, col = g.q_row(k, t), g.q_col(k, t) + v
                            if split:
                                Op[b, sp, row, hf * D2 + col] = kv[hf, 0, row, col]
                            else:
                                O[b, row, hf * D2 + col] = kv[hf, 0, row, col]

    if n_win:
        return _two_pool_entry(body, B=B, H=H, D=D, Sw=S, Sc=S_cmp or S, nw=n_win, nc=topk - n_win, ns=ns,
                                  kvt=f32, fp8=kv_fp8, split=split, threads=None, act=f32)  # fmt: skip
    if kv_fp8 and split:

        @T.prim_func
        def ws_cpu_fp8_split(
            Q: T.Tensor((B, H, D), f32),
            KV: T.Tensor((S, D), f32),
            KVs: T.Tensor((S, D // 32), "uint8"),
            Idx: T.Tensor((B, topk), i32),
            Op: T.Tensor((B, ns, H, D), f32),
            Mp: T.Tensor((B, ns, H), f32),
            Lp: T.Tensor((B, ns, H), f32),
        ):
            with T.Kernel(ns, B) as (sp, b):
                body(Q, _Src(KV, KVs, Idx), None, None, Op, Mp, Lp, sp, b)

        return ws_cpu_fp8_split
    if kv_fp8:

        @T.prim_func
        def ws_cpu_fp8(
            Q: T.Tensor((B, H, D), f32),
            KV: T.Tensor((S, D), f32),
            KVs: T.Tensor((S, D // 32), "uint8"),
            Idx: T.Tensor((B, topk), i32),
            Sink: T.Tensor((H,), f32),
            O: T.Tensor((B, H, D), f32),
        ):
            with T.Kernel(ns, B) as (sp, b):
                body(Q, _Src(KV, KVs, Idx), Sink, O, None, None, None, sp, b)

        return ws_cpu_fp8
    if split:

        @T.prim_func
        def ws_cpu_split(
            Q: T.Tensor((B, H, D), f32),
            KV: T.Tensor((S, D), f32),
            Idx: T.Tensor((B, topk), i32),
            Op: T.Tensor((B, ns, H, D), f32),
            Mp: T.Tensor((B, ns, H), f32),
            Lp: T.Tensor((B, ns, H), f32),
        ):
            with T.Kernel(ns, B) as (sp, b):
                body(Q, _Src(KV, None, Idx), None, None, Op, Mp, Lp, sp, b)

        return ws_cpu_split

    @T.prim_func
    def ws_cpu(
        Q: T.Tensor((B, H, D), f32),
        KV: T.Tensor((S, D), f32),
        Idx: T.Tensor((B, topk), i32),
        Sink: T.Tensor((H,), f32),
        O: T.Tensor((B, H, D), f32),
    ):
        with T.Kernel(ns, B) as (sp, b):
            body(Q, _Src(KV, None, Idx), Sink, O, None, None, None, sp, b)

    return ws_cpu


def combine_program(B: int, H: int, D: int, num_split: int, *, target: str, threads: int = 128,
                    op_dtype: str = "float32"):  # fmt: skip
    """prim_func(Op, Mp, Lp, Sink, O): O[b, h] = Σ_s e^(m_s − M) o_s / (Σ_s e^(m_s − M) l_s + e^(sink − M)),
    M = max(max_s m_s, sink). A chunk with no valid entry has m_s = NEG, l_s = 0, o_s = 0: weight exactly 0.
    op_dtype: Op's dtype (bfloat16: Config.partial_bf16; the c target keeps fp32)."""
    import tilelang.language as T

    ns = num_split
    mem = Mem(target)
    act = "float32" if mem.cpu else "bfloat16"
    opt = "float32" if mem.cpu else op_dtype

    @T.prim_func
    def sparse_attn_combine(
        Op: T.Tensor((B, ns, H, D), opt),
        Mp: T.Tensor((B, ns, H), "float32"),
        Lp: T.Tensor((B, ns, H), "float32"),
        Sink: T.Tensor((H,), "float32"),
        O: T.Tensor((B, H, D), act),
    ):
        with T.Kernel(H, B, threads=threads) as (h, b):
            mx = T.alloc_local((1,), "float32")
            den = T.alloc_local((1,), "float32")
            acc = mem.fragment((D,), "float32")
            mx[0] = Sink[h]
            for sp in T.serial(ns):
                mx[0] = T.max(mx[0], Mp[b, sp, h])
            den[0] = T.exp(Sink[h] - mx[0])
            for sp in T.serial(ns):
                den[0] = den[0] + Lp[b, sp, h] * T.exp(Mp[b, sp, h] - mx[0])
            for d in mem.par(D):
                acc[d] = 0.0
            for sp in T.serial(ns):
                for d in mem.par(D):
                    acc[d] = acc[d] + T.cast(Op[b, sp, h, d], "float32") * T.exp(Mp[b, sp, h] - mx[0])
            for d in mem.par(D):
                O[b, h, d] = T.cast(acc[d] / den[0], act)

    return sparse_attn_combine


def combine_program_wide(B: int, H: int, D: int, num_split: int, *, target: str, heads: int = 8, threads: int = 256,
                         op_dtype: str = "float32"):  # fmt: skip
    """The combine of `combine_program` (same signature and result) with one CTA per (request, `heads` heads):
    8 threads first fold the chunks' (max, sum) and the sink into each head's chunk weights
    e^(m_s - M) / den (shared memory), then every thread streams its Op values with independent vector
    loads. The one-head CTAs of combine_program took 10.9 us at B64 / split 2 on the H200 (21 MB: 1.9 TB/s),
    each CTA a chain of dependent loads; this one 10.3 us (split_programs uses it from WIDE_COMBINE_MIN_B)."""
    import tilelang.language as T

    ns = num_split
    mem = Mem(target)
    act = "float32" if mem.cpu else "bfloat16"
    opt = "float32" if mem.cpu else op_dtype  # Op's dtype (Config.partial_bf16: bfloat16)
    hb_n = heads if H % heads == 0 else 1
    chunks, rest = list(range(ns)), list(range(1, ns))  # Python lists: these loops unroll at trace time
    preload = ns <= 4 and hb_n * D <= 16 * threads  # at most 16 registers a thread per chunk

    @T.prim_func
    def sparse_attn_combine_wide(
        Op: T.Tensor((B, ns, H, D), opt),
        Mp: T.Tensor((B, ns, H), "float32"),
        Lp: T.Tensor((B, ns, H), "float32"),
        Sink: T.Tensor((H,), "float32"),
        O: T.Tensor((B, H, D), act),
    ):
        with T.Kernel(H // hb_n, B, threads=None if mem.cpu else threads) as (hb, b):
            wt = mem.shared((hb_n, ns), "float32")
            # up to 4 chunks the partial outputs are loaded first (registers): their latency overlaps the
            # weights' (Mp, Lp) loads; more chunks read Op after the weights
            vals = [mem.fragment((hb_n, D), "float32") for _ in chunks] if preload else []
            for sp in chunks if preload else []:
                for i, d in mem.par(hb_n, D):
                    vals[sp][i, d] = T.cast(Op[b, sp, hb * hb_n + i, d], "float32")
            for i in mem.par(hb_n):
                h = hb * hb_n + i
                top = Sink[h]  # the max counts the sink: every exponent <= 0, an all-invalid chunk weighs 0
                for sp in chunks:
                    top = T.max(top, Mp[b, sp, h])
                den = T.exp(Sink[h] - top)
                for sp in chunks:
                    den = den + Lp[b, sp, h] * T.exp(Mp[b, sp, h] - top)
                for sp in chunks:
                    wt[i, sp] = T.exp(Mp[b, sp, h] - top) / den
            for i, d in mem.par(hb_n, D):
                acc = (vals[0][i, d] if preload else T.cast(Op[b, 0, hb * hb_n + i, d], "float32")) * wt[i, 0]
                for sp in rest:
                    acc = acc + (vals[sp][i, d] if preload else T.cast(Op[b, sp, hb * hb_n + i, d], "float32")) * wt[
                        i, sp]
                O[b, hb * hb_n + i, d] = T.cast(acc, act)

    return sparse_attn_combine_wide


WIDE_COMBINE_MIN_B = 64  # below, combine_program_wide's B x H / 8 CTAs leave most SMs idle


def combine_name(B: int) -> str:
    """The combine program split_programs pairs with the partial kernel at batch B: the wide one from
    WIDE_COMBINE_MIN_B requests (H200, B64 split 2: 10.3 vs 11.4 us alone, 32.7 vs 33.7 us for the pair, both
    checked; session 5 round 1), the one-head-a-CTA one below (not measured there)."""
    return "combine_program_wide" if B >= WIDE_COMBINE_MIN_B else "combine_program"


def split_programs(B: int, H: int, D: int, S: int, topk: int, *, target: str, cfg: Config, kv_fp8: bool = False,
                   n_win: int = 0, S_cmp: int = 0):  # fmt: skip
    """(partial, combine) prim_funcs for cfg.num_split > 1; `run_split` calls them in order."""
    assert cfg.num_split > 1
    return (
        program(B, H, D, S, topk, target=target, cfg=cfg, kv_fp8=kv_fp8, n_win=n_win, S_cmp=S_cmp),
        globals()[combine_name(B)](B, H, D, cfg.num_split, target=target, **combine_kwargs(cfg, H, D)),
    )


def _bf16_partials(cfg: Config, H: int, D: int) -> bool:
    return cfg.partial_bf16 and ws_supported(H, D, "sm90")  # elsewhere the portable program writes fp32 partials


def combine_kwargs(cfg: Config, H: int, D: int) -> dict:
    """The combine factory's arguments that follow the partial pass's config (Op's dtype)."""
    return {"op_dtype": "bfloat16"} if _bf16_partials(cfg, H, D) else {}


def partial_dtype(cfg: Config, H: int, D: int) -> torch.dtype:
    """Op's torch dtype for a split config (the scratch run_split / the runtime allocate)."""
    return torch.bfloat16 if _bf16_partials(cfg, H, D) else torch.float32


def _as_args(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def run_split(kernels, q, kv, idx, sink, out, num_split: int, scratch=None, op_dtype=torch.float32):
    """Launch the split pair; `scratch` (Op, Mp, Lp) can be passed to skip the allocations. kv is the
    bf16 pool or a tuple of the KV arguments in signature order ((codes, exponents) for the FP8-KV program;
    two pools: (KVw, KVc) or (KVw, KVsw, KVc, KVsc)); idx the Idx tensor or (IdxW, IdxC)."""
    B, H, D = q.shape
    if scratch is None:
        scratch = (
            torch.empty(B, num_split, H, D, device=q.device, dtype=op_dtype),
            torch.empty(B, num_split, H, device=q.device, dtype=torch.float32),
            torch.empty(B, num_split, H, device=q.device, dtype=torch.float32),
        )
    op, mp, lp = scratch
    kernels[0](q, *_as_args(kv), *_as_args(idx), op, mp, lp)
    kernels[1](op, mp, lp, sink, out)
    return out


# ---------------------------------------------------------------------------------------------- q operand (Triton)


@functools.lru_cache(maxsize=2)
def _q_operand_kernel(interpret: bool):
    """Built lazily, once per interpreter mode (triton fixes it at decoration time)."""
    import triton
    import triton.language as tl

    @triton.jit
    def q_operand_kernel(q_ptr, pos_ptr, cs_ptr, out_ptr, T, ratio, H: tl.constexpr, D: tl.constexpr,
                         R: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
        t = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        c = tl.arange(0, D)[None, :]
        live = (t < T) & (h < H)
        j = c - (D - R)  # position among the rotated channels (< 0: not rotated)
        rot = (j >= 0) & live
        x = tl.load(q_ptr + (t * H + h) * D + c, mask=live, other=0.0)
        mate = tl.load(q_ptr + (t * H + h) * D + (c ^ 1), mask=rot, other=0.0)  # the pair's other channel
        p = tl.load(pos_ptr + t, mask=t < T, other=0)
        i = tl.where(j >= 0, j // 2, 0)
        cos = tl.load(cs_ptr + p * R + i, mask=rot, other=1.0)
        sin = tl.load(cs_ptr + p * R + R // 2 + i, mask=rot, other=0.0)
        # pair (e, o) -> (e cos - o sin, e sin + o cos): an even channel holds e, an odd one o
        y = tl.where(j % 2 == 0, x * cos - mate * sin, mate * sin + x * cos)
        y = tl.where(j >= 0, y, x) * ratio
        # round to nearest even on the bits (Triton's interpreter truncates on the cast), then an exact cast
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        tl.store(out_ptr + (t * H + h) * D + c, bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=h < H)

    return q_operand_kernel


def triton_q_operand(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, ratio: float, rope_dim: int,
                     rows: int) -> torch.Tensor:  # fmt: skip
    """fused_attention's q as the kernel reads it, in one launch: q [T, H, D] fp32 (after the op's q RMSNorm, if
    any) -> bf16 [rows, H, D], the last rope_dim channels rotated as interleaved pairs with cos | sin rows of
    `cos_sin` (rope.cos_sin_table: [positions, rope_dim]) at each token's position, everything times `ratio` (the
    op's scale over D^-0.5), one rounding to bf16; rows past T are zero. The torch formulation (the op's apply_rope,
    a slice copy and casts) is ~14 launches, most of the attention node's time at decode besides the kernel."""
    import os

    t, h, d = q.shape
    out = torch.empty(rows, h, d, dtype=torch.bfloat16, device=q.device)
    block_h = 8 if h % 8 == 0 else 1
    kernel = _q_operand_kernel(os.environ.get("TRITON_INTERPRET") == "1")
    kernel[(rows, h // block_h)](q.contiguous(), positions.contiguous(), cos_sin, out, t, float(ratio), H=h, D=d,
                                 R=rope_dim, BLOCK_H=block_h)  # fmt: skip
    return out


@functools.lru_cache(maxsize=2)
def _o_epilogue_kernel(interpret: bool):
    """Built lazily, once per interpreter mode (triton fixes it at decoration time)."""
    import triton
    import triton.language as tl

    @triton.jit
    def o_epilogue_kernel(o_ptr, pos_ptr, cs_ptr, q_ptr, e_ptr, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                          GROUP: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)  # (token, head): D channels, D / GROUP quantisation groups
        t = row // H
        g = tl.arange(0, D // GROUP)[:, None]
        c = g * GROUP + tl.arange(0, GROUP)[None, :]
        j = c - (D - R)
        rot = j >= 0
        x = tl.load(o_ptr + row * D + c).to(tl.float32)
        mate = tl.load(o_ptr + row * D + (c ^ 1), mask=rot, other=0.0).to(tl.float32)
        p = tl.load(pos_ptr + t)
        i = tl.where(rot, j // 2, 0)
        cos = tl.load(cs_ptr + p * R + i, mask=rot, other=1.0)
        sin = tl.load(cs_ptr + p * R + R // 2 + i, mask=rot, other=0.0)
        # the inverse rotation: pair (e, o) -> (e cos + o sin, o cos - e sin)
        y = tl.where(rot, tl.where(j % 2 == 0, x * cos + mate * sin, x * cos - mate * sin), x)
        # act_quant's exact power-of-two scale: exponent from the float's bits (see act_quant.py)
        amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-4)
        bits = amax.to(tl.uint32, bitcast=True)
        ex = ((bits >> 23) & 0xFF).to(tl.int32) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        inv = ((127 - ex).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        codes = tl.clamp(y * inv[:, None], -448.0, 448.0)
        tl.store(q_ptr + row * D + c, codes.to(q_ptr.dtype.element_ty))
        tl.store(e_ptr + row * (D // GROUP) + tl.arange(0, D // GROUP), (ex + 127).to(tl.uint8))

    return o_epilogue_kernel


def triton_o_epilogue(o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rope_dim: int, group: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fused_attention's output epilogue in one launch (opt-in: DEEPINFER_ATTN_O_EPILOGUE=triton; not yet measured):
    o [T, H, D] (the kernel's bf16) -> the inverse RoPE of each head's last rope_dim channels (cos | sin rows of
    `cos_sin` at each token's position, fp32) and FP8 per `group` channels with act_quant's power-of-two scales:
    (e4m3 codes [T, H * D], ue8m0 exponent bytes [T, H * D / group]) -- the [T, groups, K] out-group layout is a
    view of them. Instead of the rope kernel, its bf16 output and act_quant (and the scales' transpose): the codes
    come from the fp32 rotation (no bf16 rounding in between). Under Triton's interpreter the codes are returned as
    fp32 values of e4m3 codes (no fp8 stores there; the caller's cast is exact)."""
    import os

    t, h, d = o.shape
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    codes = torch.empty(t, h * d, dtype=torch.float32 if interp else torch.float8_e4m3fn, device=o.device)
    exps = torch.empty(t, h * d // group, dtype=torch.uint8, device=o.device)
    if t:
        _o_epilogue_kernel(interp)[(t * h,)](o.contiguous(), positions.contiguous(), cos_sin, codes, exps, H=h, D=d,
                                             R=rope_dim, GROUP=group)  # fmt: skip
    return codes, exps


# ---------------------------------------------------------------------------------------------- reference


def reference(q, kv, idx, sink) -> torch.Tensor:
    """Torch reference: softmax over [selected entries ; sink] per head, sink column dropped."""
    B, H, D = q.shape
    rows = kv[idx.clamp_min(0).long()].float()  # [B, topk, D]
    logits = torch.einsum("bhd,bjd->bhj", q.float(), rows) * D**-0.5
    logits = logits.masked_fill((idx < 0).unsqueeze(1), float("-inf"))
    full = torch.cat([logits, sink.float().view(1, H, 1).expand(B, H, 1)], dim=-1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    return torch.einsum("bhj,bjd->bhd", p, rows).to(q.dtype)


def reference_f64_loops(q, kv, idx, sink) -> torch.Tensor:
    """Independent oracle: per (request, head) loops in float64 over the valid entries only."""
    B, H, D = q.shape
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        valid = [int(i) for i in idx[b] if i >= 0]
        rows = kv[valid].double()
        for h in range(H):
            lg = rows @ q[b, h].double() / D**0.5
            mx = max(lg.max().item(), float(sink[h]))
            w = torch.exp(lg - mx)
            out[b, h] = (w[:, None] * rows).sum(0) / (w.sum() + torch.exp(torch.tensor(float(sink[h]) - mx)))
    return out


def quant_kv_fp8(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, D] -> (e4m3 codes [S, D], uint8 ue8m0 exponents [S, D/32]): the V4.1 window-KV cache layout
    (MODEL_SPEC §3: 512 fp8 + 16 ue8m0 bytes a token), i.e. the values the model's fake_quant_fp8(kv, 32)
    leaves, stored as codes and power-of-two scales 2^(e - 127)."""
    codes, scale = quant_fp8_groups(kv.float(), 32)
    return codes, (torch.log2(scale).round() + 127).to(torch.uint8)


def dequant_kv_fp8(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """fp32 [S, D] from quant_kv_fp8's pair (what the FP8-KV kernel computes with, exactly, in bf16)."""
    s = torch.exp2(exps.float() - 127.0).repeat_interleave(32, dim=1)
    return codes.float() * s


def roofline(B: int, H: int, D: int, topk: int, kv_bytes: int = 2, act_bytes: int = 2, *, kv_fp8: bool = False
             ) -> tuple[float, float]:  # fmt: skip
    """(bytes, flops): each selected KV row once per request (plus its int32 index), q and o once; QKᵀ + PV.
    kv_fp8: a row is D e4m3 bytes + D/32 ue8m0 exponent bytes."""
    row = D + D // 32 if kv_fp8 else D * kv_bytes
    return float(B * (topk * (row + 4) + 2 * H * D * act_bytes)), float(4 * B * H * topk * D)
