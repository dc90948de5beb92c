"""Exact row-wise top-k of fp32 scores (the V4.1 indexer's `topk_entries`, MODEL_SPEC §2.13).

    Idx[t] = the k largest S[t, j] over the visible j (j < lim_t; -inf = not visible), ties to the LOWER j,
             as a SET in ascending j order, int32, -1 padding at the end (fewer than k visible)

`lim_t = min((pos_t + 1) // ratio, C)` when positions are given: the columns past it are -inf by the op's
definition and are not read at all. Without positions every column is read and -inf marks what is not
visible. NaN scores are not supported (the reference sorts them first; the scores kernel never makes one).

TileLang program (`program`), one kernel, every score read from HBM once into registers:
* a CTA owns `seg` columns of one row (grid: segments x rows) and streams them in chunks of
  threads x per_thread scores held in registers (float4 loads, coalesced).
* `filter=True` (long rows, k << chunk): the maxima of groups of `group` scores of a chunk bound its k-th
  largest score from below for free -- the k-th largest group maximum L (each of the k groups at or above it
  holds one score >= L). Running L = max over chunks is a lower bound of the row's k-th largest score, so
  only scores >= L go to a candidate buffer in shared memory (about 1.4k of 8k for k=512 on smooth data).
  A chunk with more than `cap` candidates (heavy ties) hands on its exact top-k instead; a full buffer is
  cut to its exact top-k. Both keep every score that can still be in the row's top-k, ties included.
* `filter=False` (short rows): the chunk in registers is the candidate set.
* exact selection (`_make_select`): adaptive radix select on the order-preserving int32 keys -- each
  round histograms (shared-memory atomics) the candidates inside the current key range into 256 bins of equal
  width, keeps the bin holding the wanted rank, and stops when that bin is taken whole or one key is left
  (<= 4 rounds); ties at the k-th key take the lowest column ids (a second radix pass over -id).
* output: selected columns are set in a shared bitmap of the row and written in ascending order
  (popcounts, a prefix sum over threads, then each thread's words).
* several segments per row (decode: few rows, long rows): each segment writes its exact local top-k to a
  scratch slot; the last CTA of a row to arrive (an acq_rel counter per row, reset by it: no second launch,
  no co-residency needed) selects from the union. The global top-k is the top-k of that union because
  (score desc, column asc) is a strict total order.

Threads are written as `for i in T.Parallel(threads)` phases with per-thread unrolled loops and shared-memory
communication between phases, so the same program also runs serially on TileLang's `c` target (atomics
become plain read-modify-writes): the CPU tests check exact selection, ties included, on it.

A second TileLang program (`hist_program`, chosen by passing a `HistConfig` to `program`; same arguments and
output) bounds the k-th key by a 12-bit histogram instead of group maxima: only the keys above a running bound
are counted and kept, and one exact selection runs on the kept ones (its docstring has the details). It is the
default for long rows of 32+ queries (`default_config`, H200 figures there). `HistConfig.fused` (one CTA
barrier a chunk instead of ~17; with `min_blocks`=3 and the `ffs` output the default for the 256-thread prefill
rows: H200 T4096 C65536 557.5 us = 44.5% of HBM vs 757.4 us); `HistConfig.fast` (fused chunks compared with the
bound as raw floats, whole warps below it skipping their pass: ~3 instructions a score instead of ~20; the default
for the prefill rows: 541.0 us = 45.8%); `HistConfig.trim` (selections over the buffer's entries only; session 7:
561.8 us, slower) is opt-in; `HistConfig.diag` cuts a chunk's work down to a stage (H200 stage costs; not a top-k).
Measured and removed (session 6, T4096 C65536, same run as fast's 541.0 us): the first chunk's coarse bins summed
from the fine ones instead of counted with atomics (544.0 us), a CTA prefetching the row that takes its slot next
into L2 at its final selection (548.2 us).
Session 8 (H200 call 4, T4096 C65536, same run, every row exact; the defaults since): the chunk loop is issue-bound
(a fused chunk ~420 SASS instructions a warp for 16 scores a thread), so `HistConfig.lean` cuts it to ~250: no
per-score column checks (the chunk that straddles the limit gets -inf when its bits are copied; a wholly visible
next chunk loads unpredicated), the count as a bit mask's popcount, each pushed key converted once (480.3 us vs
543.6); the L2 prefetch off (the grid's read stage alone: 259.7 us without it, 306.7 with); `compact` (the final
selection on the members >= the bound staged in the free fine histogram, after the chunk loop; 471.5 us), `wscan`
(the output offsets by warp scans; 471.2) and `rsel` (the staged members selected in registers, 3 barriers a radix
round: the final selection cost ~60 us whatever its size -- barriers, not passes): 460.8 us = 53.8%. Stage probes of
that run: lean chunks without the final selection 373.2 us, with the selection but no output 423.9 us. fused=1
(no lagging bound) 483.7 us. `tail_split` (the last wave's rows as 2-segment rows in a second launch, ~4.5% by
the wave count) is unmeasured.
Session 9 (H200 call 3, same run): `HistConfig.eager` (one CTA a row: the first chunk's loads issued whole at the
CTA's start, before the row's limit -- a dependent load of Pos -- and the workspace's zeroing and barrier; the default
since: 455.0 us = 54.8% vs 459.5). Measured and removed (session 10): a persistent grid (rows by stride, the next
row's first chunk fetched into registers before this row's output or final selection, so no CTA start and no
first-chunk latency between rows): 611.8 us, 553.5 without rsel -- its row loop cost nvcc ~20 registers (111 uncapped
vs 90), spills at the 80 of 3 CTAs an SM. With positions, a row's segments past its limit do no selection and hand
nothing on (the filter program's exit at once), and the row's last live segment merges only the live ones' slots.
Session 10 (H200 calls 2-3, T4096 C65536, same runs, exact): TileLang's sync planner had put a barrier in every
iteration of the final selection's staging loop, inside a per-thread branch (divergent on heavy ties: the GPU tie
test hung); without it 442.8 us = 56.3%. Stage probes then: the chunk loop alone 363.9 us, up to the final selection
407.3, the read alone 237.7, the first chunk real and the others read 256.9. The bound's bin search is one warp's
extra work on its chunk's critical path: on every 4th chunk only (`HistConfig.search`, the default at 64k+ columns)
424.3 us = 58.8% (the loop alone 344.0).
Session 11 (H200 calls 4-5, T4096 C65536, same runs, exact): the default 423.2 / 423.8 us = 58.9% / 58.5%. The clock
probe (`HistConfig.clock`, cycles a row of 75.4k, ~1.81 GHz): ws 779, the first chunk 8076, chunks 1-3 ~4.2k, 4-7
~3.6k, 8-11 ~3.2k, 12-15 ~2.8k (the HBM pace: 3 CTAs x 16 KB / 2.8k cycles an SM = 4.2 TB/s), a bin search ~400-500
more; the staged members 2942, the selection 5721, the marks 827, the output 4545. Measured and not taken: search
schedules dense early (`search_at`; g1 2,3,5,9,15: 430.4, g2 2,4,8,15: 430.7, g3 2,3,4,6,9,15: 432.6 -- a search costs
more than the early pushes it saves); emit_regs 422.8 (noise). Measured and removed: the output bitmap's words skewed
to w + w // 8 (conflict-free reads: the output 3744 cycles, but the marks and the stage slower; with emit_regs 427.9),
the first chunk's coarse counts warp-aggregated with __match_any_sync (434.9: its first chunk 10.1k cycles). Probe
`HistConfig.xbar` (3 more back-to-back barriers a fused chunk): 429.5 -- so the 3 that TileLang's planner adds a fused
chunk (hoisted out of the first chunk's and the overflow cut's branches) cost ~5.7 us: peeling the first chunk out of
the loop is the next lever, with the tail (selection + output ~14k cycles a row) and the first chunk.

Session 12 (H200 call 3, T4096 C65536, same run, exact): TileLang's sync planner had hoisted the first chunk's and the
rare overflow cut's barriers into every fused chunk (5 a chunk); `HistConfig.peel` 1 runs the first chunk before the
chunk loop (2 a fused chunk) and `warp_first` finds its bound by one warp's bin search: 398.1 us = 62.3% vs 423.0 (the
default since), with `bin_sel` (the final selection from the fine bin holding rank k of the final counts, its range
and rank known: no count / min / max reduction) 394.4 us = 62.9% in call 4. Measured and not taken: peel 2 (the
chunks' shared accesses through pointer handles: 1 barrier a chunk, but the handles kept 2.9 KB more shared a CTA and
the chunks ran ~0.45k cycles slower: 423.1), `emit_wc` (426.2), l2_ahead 1 / 2 (417.8 / 419.1 on peel 2; 407.6 on
peel 1).

A Triton variant (`triton_topk`, the same candidate-filter idea with bisection and prefix sums; runs in the
Triton interpreter) is kept for comparison.
"""

import os
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

try:  # optional; the jit functions are module globals so the interpreter (TRITON_INTERPRET=1) can run them
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

FAMILY = "topk_select"
NONE = -(2**31) + 1  # key of "not a candidate": below every real key (-inf is 0x807fffff; NaN unsupported)
INT_MAX = 2**31 - 1
NB = 256  # histogram bins per radix round (8 bits)
MERGE_ALL_MAX = 4096  # candidates of a default merge_all buffer (segments x k; 8192 at 512 threads: spills)
HIST_MIN_ROWS = 32  # long rows of at least this many queries take the hist program (H200: T64 yes, T1 no)


@dataclass(frozen=True)
class Config:
    threads: int = 128
    per_thread: int = 16  # scores a thread holds per chunk (multiple of 4: float4 loads)
    seg: int = 2048  # columns per CTA (a multiple of the chunk = threads * per_thread)
    filter: bool = False  # group-max candidate filter + shared candidate buffer (needs chunk / group >= 2k)
    group: int = 8
    cap: int = 2048  # candidates one chunk may add before it falls back to its exact top-k
    merge_all: bool = False  # the buffer holds every segment's top-k: the last CTA of a row selects once

    @property
    def chunk(self) -> int:
        return self.threads * self.per_thread

    @property
    def tag(self) -> str:
        f = f"f{self.group}c{self.cap}" if self.filter else "x"
        return f"t{self.threads}e{self.per_thread}s{self.seg}{f}{'m' if self.merge_all else ''}"


HB = 4096  # fine bins of the histogram bound: the key's top 12 bits (sign, exponent, 3 mantissa bits)
HSHIFT = 20  # key >> HSHIFT is the fine bin (minus HB / 2)
HSUB = HB // NB  # fine bins per coarse bin (the coarse level has NB bins)


@dataclass(frozen=True)
class HistConfig:
    """`hist_program`: a CTA streams `seg` columns of a row (a multiple of the chunk) in chunks of threads x
    per_thread scores; `buf`: entries of the shared candidate buffer (0: the least that always fits, k + chunk,
    or segments x k for the last CTA's merge)."""

    threads: int = 256
    per_thread: int = 16
    seg: int = 4096
    buf: int = 0
    l2_ahead: int = 0  # chunks prefetched into L2 beyond the one in flight to registers (one bulk prefetch each)
    # fused (chunks after the first): count + push in one pass, one barrier, the bin search by one warp: after the
    # barrier (1), or (2) during the next chunk's pushes (the bound then lags a chunk more)
    fused: int = 0
    min_blocks: int = 0  # __launch_bounds__ CTAs an SM (nvcc caps the registers to fit them), 0: not set
    ffs: bool = False  # the output's set bits found with __ffs (GPU)
    # (fused) chunks after the first kept as raw float bits and compared with the bound as floats; a warp whose
    # maximum is below it skips the count, reservation and push (no key conversion of the ~all keys that fail)
    fast: bool = False
    trim: bool = False  # the buffer's selections, cuts and marks visit its ctl[0] entries, not all BUF
    # (fast) no per-score column check and no max pre-pass in the fused chunks: the one chunk that straddles the
    # visible limit gets -inf past it when its bits are copied, and every warp counts (~all have keys at the bound)
    lean: bool = False
    # (one segment a row) the final selection on the buffer's members >= the bound copied to the free fine
    # histogram (up to `compact` of them; more: the buffer as before) instead of all BUF entries in place
    compact: int = 0
    wscan: bool = False  # the output offsets by warp shuffle scans (one barrier), not T.cumsum (one warp, serial)
    # (compact) the staged members' selection in registers with few barriers (`_make_reg_select`), not select_b
    rsel: bool = False
    # (one segment a row, C >= a chunk) the first chunk's loads issued at the CTA's start, whole and unpredicated --
    # before the row's limit (a dependent load of Pos) and the workspace's zeroing and barrier -- so that their
    # latency overlaps both (columns past the limit are read, then masked: at most a chunk's bytes more a row)
    eager: bool = False
    # (fused) the bound's bin search on every `search`-th chunk only (counted back from the last, so the final bound is
    # as tight): it is one warp's extra work on its chunk's critical path -- the other warps wait for it at the chunk's
    # barrier. A bound that lags more pushes more keys, never a wrong one.
    search: int = 1
    # (fused) the chunks whose bin search runs, as chunk indices (the search during chunk `it` reads the counts of
    # chunks 0 .. it - 1 and the part of `it` counted so far); overrides `search` when not empty. Dense early: the
    # first fused chunks push ~k keys each against the first chunk's bound, the later ones few against any bound.
    search_at: tuple[int, ...] = ()
    # (GPU, ffs) the output's bitmap words read once into registers (vector loads), not twice word by word
    emit_regs: bool = False
    diag: str = ""  # diagnostics only (wrong output): the per-chunk work cut down to a stage, see HIST_DIAGS
    # (GPU, one segment a row; diagnostics: not a top-k) the real program, then Idx[t, :hist_clock_points] = the SM
    # clock at its checkpoints (`hist_clock_points`) minus the first: each stage's cycles on the CTA's critical path
    clock: bool = False
    # (probe; the output stays exact) xbar more CTA barriers after each fused chunk's, back to back like the three
    # TileLang's sync planner adds to a fused chunk: their cost is what peeling the first chunk could save
    xbar: int = 0
    # (fused=2 lean fast chunks, compact, one segment) 1: the first chunk's count / bound / push before the chunk loop,
    # the loop over the fused chunks only: TileLang's sync planner had hoisted the first chunk's and the rare overflow
    # cut's barriers into every fused chunk (5 a chunk, 1 needed; peeled: 2, its loop-top one for the cut's writes
    # against the chunks' pointer accesses); 2: and the fused chunks' shared accesses through pointer handles bound
    # before the loop (no access the planner sees: one barrier a chunk; sm90: 2 spilled words, floor and fl)
    peel: int = 0
    # (peel) the first chunk's bound by one warp's bin search (the fused chunks' `warp_threshold`), not the CTA-wide
    # threshold (find_bin's shuffle scan: ~8 barriers)
    warp_first: bool = False
    # (GPU, ffs, wscan) the output's bitmap words owned warp-contiguously (`_make_emit_wc`: conflict-free reads kept in
    # registers, a warp scan a round), not 8 contiguous words a thread (8-way bank conflicts, read twice); the `c`
    # target keeps `_make_emit`
    emit_wc: bool = False
    # (peel, rsel) the final selection from the fine bin holding rank k of the final counts (one warp's search after the
    # chunk loop): without an overflow cut every key at or above that bin was counted and pushed, so the members above
    # it are all taken and the k-th key is the (k - count above)-th of the bin's own -- the staged set is the members
    # from that bin up, and the register selection starts in its 2^20-key range without the count / min / max
    # reduction (a cut: as before)
    bin_sel: bool = False
    # (probe; the output stays exact) smem_pad more int32 of shared memory a CTA, live through the whole kernel: does
    # the shared size alone cost (session 12: builds whose pointer handles kept 2.9 KB more shared ran ~20 us slower)?
    smem_pad: int = 0

    @property
    def chunk(self) -> int:
        return self.threads * self.per_thread

    @property
    def tag(self) -> str:
        fused = "f" * min(int(self.fused), 1) + (str(self.fused) if self.fused > 1 else "")
        return (f"h{self.threads}e{self.per_thread}s{self.seg}" + (f"b{self.buf}" if self.buf else "")
                + (f"p{self.l2_ahead}" if self.l2_ahead else "") + fused
                + (f"m{self.min_blocks}" if self.min_blocks else "") + ("x" if self.ffs else "")
                + ("v" if self.fast else "") + ("t" if self.trim else "") + ("l" if self.lean else "")
                + (f"z{self.compact}" if self.compact else "") + ("w" if self.wscan else "")
                + ("r" if self.rsel else "") + ("a" if self.eager else "")
                + (f"q{self.search}" if self.search > 1 and not self.search_at else "")
                + ("g" + "_".join(map(str, self.search_at)) if self.search_at else "") + ("o" if self.emit_regs else "")
                + (f"-{self.diag}" if self.diag else "") + ("-clock" if self.clock else "")
                + (f"-xb{self.xbar}" if self.xbar else "") + (f"-peel{self.peel}" if self.peel else "")
                + ("-wf" if self.warp_first else "") + ("-wc" if self.emit_wc else "")
                + ("-bs" if self.bin_sel else "") + (f"-pad{self.smem_pad}" if self.smem_pad else ""))  # fmt: skip


# `HistConfig.diag`: what a chunk still does (H200 stage costs; the output is NOT the top-k): "read" streams the
# scores and their keys (a per-thread max written out), "count" adds the histogram bound, "push" the candidate
# buffer and its cuts; only the final selection / output is left out. "" = the real program. HIST_DIAG_FIRST:
# (fused) the first chunk's bound and push as in the real program, the later chunks read only. HIST_DIAG_SELECT:
# the real program up to its final selection, without the output's bitmap marks and emit.
HIST_DIAGS = ("read", "count", "push")
HIST_DIAG_FIRST = "first"
HIST_DIAG_SELECT = "select"


def hist_clock_points(cfg: HistConfig) -> list[str]:
    """(HistConfig.clock) the names of the checkpoints whose clocks a row's Idx[t, :n] holds (relative to the first):
    the CTA's start, its workspace zeroed (+ the first chunk's loads issued, eager), the end of every chunk (its
    pushes; the fused ones after their barrier), the final selection's members staged, selected, the output's bitmap
    marked, the output written."""
    return ["start", "ws", *(f"c{i}" for i in range(cfg.seg // cfg.chunk)), "stage", "select", "mark", "emit"]


def hist_buffer(C: int, k: int, cfg: HistConfig) -> int:
    """Candidate buffer entries: room for the exact top-k plus a whole chunk (a cut always makes room), and for
    every segment's top-k (the merge)."""
    nseg = n_segments(C, cfg)
    return _round_up(max(cfg.buf, k + cfg.chunk, nseg * k if nseg > 1 else 0), cfg.threads)


def n_segments(C: int, cfg: Config) -> int:
    return -(-C // cfg.seg)


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def check_config(C: int, k: int, cfg: Config | HistConfig) -> None:
    nt, e = cfg.threads, cfg.per_thread
    if isinstance(cfg, HistConfig):
        assert nt in (32, 64, 128, 256, 512, 1024) and e % 4 == 0 and C % 4 == 0, (cfg, C)
        assert cfg.seg % cfg.chunk == 0, "a segment is a whole number of chunks"
        assert cfg.diag in ("", *HIST_DIAGS, HIST_DIAG_FIRST, HIST_DIAG_SELECT), cfg
        assert cfg.diag != HIST_DIAG_FIRST or cfg.fused, "diag first: the fused loop's later chunks read only"
        assert not cfg.clock or (n_segments(C, cfg) == 1 and cfg.compact and not cfg.diag
                                 and len(hist_clock_points(cfg)) <= k), "clock: the real one-segment compact program"
        assert cfg.search >= 1 and (cfg.search == 1 or cfg.fused), "search: the fused loop's bin search"
        nch = cfg.seg // cfg.chunk
        assert not cfg.search_at or (cfg.fused and list(cfg.search_at) == sorted(set(cfg.search_at))
                                     and 1 <= cfg.search_at[0] and cfg.search_at[-1] < nch), (
            f"search_at {cfg.search_at}: ascending fused chunk indices in [1, {nch})")  # fmt: skip
        assert not cfg.eager or (n_segments(C, cfg) == 1 and C >= cfg.chunk), "eager: whole first chunks, one segment"
        assert cfg.peel in (0, 1, 2), f"peel {cfg.peel}: 0, 1 or 2"
        assert not cfg.peel or (cfg.fused == 2 and cfg.fast and cfg.lean and cfg.compact and n_segments(C, cfg) == 1
                                and not cfg.diag), "peel: fused=2 lean fast compact, one segment"
        assert not cfg.warp_first or cfg.peel, "warp_first: the peeled first chunk's bound"
        assert not cfg.bin_sel or (cfg.peel and cfg.rsel), "bin_sel: peel + rsel"
        assert not cfg.emit_wc or (cfg.ffs and cfg.wscan and not cfg.emit_regs), "emit_wc: ffs + wscan, no emit_regs"
        return
    assert nt in (32, 64, 128, 256, 512, 1024) and e % 4 == 0 and C % 4 == 0, (cfg, C)
    assert cfg.seg % cfg.chunk == 0, "a segment is a whole number of chunks"
    assert not cfg.filter or (e % cfg.group == 0 and cfg.chunk // cfg.group >= 2 * k and cfg.cap >= k), cfg


# the bound's search schedules by name (`search_schedule`): chunk indices for a segment of n chunks, the last always
# (the final bound as tight as every chunk's); "g1": the chunks after 1, 2, 4, 8, ... counted (2, 3, 5, 9, 15 of 16),
# "g2": at 2, 4, 8, ... (2, 4, 8, 15 of 16). Session 11's CPU model of the real scores' pushes a row at 16 chunks:
# g1 ~3200, g2 ~3370, every 4th ~3520 (the first chunks push ~k each against the first chunk's bound)
SEARCH_SCHEDULES = {"g1": lambda n: [(1 << m) + 1 for m in range(n.bit_length())],
                    "g2": lambda n: [1 << m for m in range(1, n.bit_length())]}  # fmt: skip
PREFILL_SEARCH_AT = ""  # the 256-thread 64k+ prefill rows' schedule: "" every `search`-th chunk, a name, or a list
PREFILL_EMIT_REGS = False  # those rows' emit_regs
PREFILL_PEEL = 1  # those rows' `peel` (1: the first chunk out of the chunk loop, 2: + one barrier a fused chunk)
PREFILL_WARP_FIRST = True  # those rows' `warp_first` (the peeled first chunk's bound by one warp; with peel only)
PREFILL_EMIT_WC = False  # those rows' `emit_wc` (the output's words owned warp-contiguously)
PREFILL_BIN_SEL = True  # those rows' `bin_sel` (the final selection from the rank-k fine bin; with peel only)
PREFILL_L2_AHEAD = 0  # those rows' `l2_ahead` (chunks prefetched into L2 beyond the one in flight; with peel only)


def search_schedule(spec: str, nch: int) -> tuple[int, ...]:
    """`HistConfig.search_at` for a segment of nch chunks: "" none (every `search`-th chunk), a SEARCH_SCHEDULES
    name, or chunk indices "2,3,5,9,15" (as they are)."""
    if not spec:
        return ()
    if spec in SEARCH_SCHEDULES:
        return tuple(sorted({a for a in SEARCH_SCHEDULES[spec](nch) if 2 <= a < nch - 1} | {nch - 1}))
    return tuple(int(a) for a in spec.split(","))


def hist_default_config(T_: int, C: int, k: int = 512, sms: int = 132) -> HistConfig:
    """The histogram-bound program for long rows. Many rows (prefill): one CTA streams a row, two chunks
    prefetched into L2; 256 threads (80 registers: 3 CTAs an SM) for 64k rows, 128 for 16k rows (H200: 761.6 us
    vs 851.6 at T4096 C65536, 256.1 vs 275.0 at C16384). The 256-thread rows take the fused chunk loop (fused=2,
    __ffs output, min_blocks=3: 80 registers; H200, same run, exact on heavy ties and real scores: T4096 C65536
    557.5 us = 44.5% of HBM vs 757.4 us = 32.7%; the grid's streaming ceiling, diag read, 306.8 us = 80.8%).
    Both prefill widths take the fused loop with `fast` chunks (session 6, H200, same run, exact on heavy ties and
    real scores: T4096 C65536 541.0 us = 45.8% vs 559.3 us fused; C16384 at 128 threads 217.2 us = 27.9% vs
    257.7 us non-fused). Session 8 (H200 call 4, same run, every row exact on heavy ties and real scores): `lean`
    fast chunks, the `compact` final selection, `wscan` output offsets, no L2 prefetch, and at 256 threads `rsel`
    (the staged members selected in registers): T4096 C65536 460.8 us = 53.8% vs 543.6 us; C16384 (no rsel)
    208.3 us vs 229.1 us. Session 9 (H200 call 3, same run, read-only L2 flush, every row exact): `eager` (the
    first chunk's loads issued before the row's limit and the workspace's zeroing) 455.0 us = 54.8% vs 459.5 at
    C65536, 206.7 vs 207.9 at C16384 (DEEPINFER_TOPK_EAGER=0: without); measured slower: a persistent grid
    (611.8; removed), tail_split (487.7), rsel at 128 threads (278.6 at C16384: 141 registers).
    Session 10 (H200 call 3, same run, exact): the 256-thread rows of 64k+ columns search the bound on every 4th
    chunk only (`search`): 424.3 us = 58.8% vs 443.8 (search 2: 430.7; the chunk loop alone 344.0 vs 363.9); the
    128-thread C16384 rows keep every chunk (search 2 there: 261.5 vs 195.0 us -- 2048-score chunks, a 2560-entry
    buffer: the lagging bound's extra pushes fill it, and it is cut). Measured slower at C65536: 8 scores a thread at
    4 CTAs x 256 (620.2) or 2 x 512 (952.1), 128-thread CTAs at 4 (672.5) or 5 with rsel (662.3).
    Session 11 (H200 calls 4-5, same runs, exact: 423.2 / 423.8 us): search schedules dense early 430.4-432.6,
    emit_regs 422.8 (noise) -- not taken (module docstring: the clock probe's stage costs).
    Session 12 (H200 call 3, same run, HBM copy 4.30 TB/s, exact): the 64k+ rows `peel` 1 + `warp_first` (the first
    chunk before the chunk loop, its bound by one warp): 398.1 us = 62.3% vs 423.0 (call 2, at 89efc51 -- the same
    barriers and SASS but for the shared layout: pointer handles kept 2.9 KB more shared a CTA -- 419.6 vs 423.7).
    Not taken (call 3): peel 2 (one barrier a fused chunk, through pointer handles: 423.1), + emit_wc 426.2, + bin_sel
    418.0, + l2_ahead 1 417.8 / 2 419.1. Call 4 (same run, HBM 4.30 TB/s, exact; GPU tie tests passed): peel 1 +
    warp_first 399.0 us, + `bin_sel` 394.4 = 62.9% (the default since), + l2_ahead 1 407.6 (with bin_sel 405.3: not
    taken), one more barrier a fused chunk (xbar 1) 400.8; session 11's default 423.6.
    DEEPINFER_TOPK_SEARCH=n: those rows' bound searched every n-th chunk (1: every chunk);
    DEEPINFER_TOPK_SEARCH_AT=g1 or 2,3,5,9,15: at the chunks of that schedule (`search_schedule`; with n > 1 only;
    "": every n-th), default PREFILL_SEARCH_AT; DEEPINFER_TOPK_EMIT_REGS=1 / 0: those rows' `emit_regs`, default
    PREFILL_EMIT_REGS; DEEPINFER_TOPK_PEEL=2 / 1 / 0 and DEEPINFER_TOPK_WARP_FIRST=1 / 0 (with peel only): their
    `peel` and `warp_first`, default PREFILL_PEEL / PREFILL_WARP_FIRST; DEEPINFER_TOPK_EMIT_WC=1 / 0: `emit_wc` (not
    with emit_regs), default PREFILL_EMIT_WC; DEEPINFER_TOPK_BIN_SEL=1 / 0: `bin_sel` (with peel only), default
    PREFILL_BIN_SEL; DEEPINFER_TOPK_L2_AHEAD=n: `l2_ahead` (with peel only), default PREFILL_L2_AHEAD (session 12's
    candidates).
    DEEPINFER_TOPK_FUSED=0: the barrier-per-phase loop; DEEPINFER_TOPK_FAST=0: fused without fast;
    DEEPINFER_TOPK_LEAN=0: session 7's defaults (2 chunks prefetched into L2, neither lean nor compact; decode
    barrier-per-phase).
    Few rows: 128-thread segments of >= 8192 columns (128 registers: 4 CTAs an SM) while the grid stays within
    one wave and the last CTA merges <= MERGE_ALL_MAX; since session 8 in the fused loop with lean fast chunks and
    wscan, no L2 prefetch (call 4: T64 C65536 58.6 us vs 63.0, T64 C16384 36.7 vs 39.6)."""
    if T_ >= 2 * sms:
        nt = 256 if C > 16384 else 128
        if os.environ.get("DEEPINFER_TOPK_FUSED", "") != "0":
            fast = os.environ.get("DEEPINFER_TOPK_FAST", "") != "0"
            cfg = HistConfig(nt, 16, _round_up(C, nt * 16), l2_ahead=2, fused=2, min_blocks=3 if nt == 256 else 0,
                             ffs=True, fast=fast)  # fmt: skip
            if fast and os.environ.get("DEEPINFER_TOPK_LEAN", "") != "0":  # (rsel: slower at 128 threads)
                cfg = replace(cfg, l2_ahead=0, lean=True, compact=2048, wscan=True, rsel=nt == 256,
                              eager=os.environ.get("DEEPINFER_TOPK_EAGER", "") != "0" and C >= cfg.chunk,
                              search=int(os.environ.get("DEEPINFER_TOPK_SEARCH", 4)) if nt == 256 and C >= 65536 else 1)
                if cfg.search > 1:  # (the same rows: 256 threads, 64k+ columns)
                    at = os.environ.get("DEEPINFER_TOPK_SEARCH_AT", PREFILL_SEARCH_AT)
                    regs = os.environ.get("DEEPINFER_TOPK_EMIT_REGS", "1" if PREFILL_EMIT_REGS else "0") == "1"
                    peel = int(os.environ.get("DEEPINFER_TOPK_PEEL", PREFILL_PEEL))
                    wf = os.environ.get("DEEPINFER_TOPK_WARP_FIRST", "1" if PREFILL_WARP_FIRST else "0") == "1"
                    wc = os.environ.get("DEEPINFER_TOPK_EMIT_WC", "1" if PREFILL_EMIT_WC else "0") == "1"
                    bs = os.environ.get("DEEPINFER_TOPK_BIN_SEL", "1" if PREFILL_BIN_SEL else "0") == "1"
                    l2 = int(os.environ.get("DEEPINFER_TOPK_L2_AHEAD", PREFILL_L2_AHEAD)) if peel > 0 else 0
                    cfg = replace(cfg, search_at=search_schedule(at, cfg.seg // cfg.chunk), emit_regs=regs, peel=peel,
                                  warp_first=wf and peel > 0, emit_wc=wc and not regs, bin_sel=bs and peel > 0,
                                  l2_ahead=l2)  # fmt: skip
            return cfg
        return HistConfig(nt, 16, _round_up(C, nt * 16), l2_ahead=2)
    seg = _round_up(C, 2048)
    while seg >= 16384 and T_ * -(-C // (seg // 2)) <= 2 * sms and -(-C // (seg // 2)) * k <= MERGE_ALL_MAX:
        seg //= 2
    if os.environ.get("DEEPINFER_TOPK_LEAN", "") != "0":
        return HistConfig(128, 16, seg, fused=2, ffs=True, fast=True, lean=True, wscan=True)
    return HistConfig(128, 16, seg, l2_ahead=2)


def tail_split(T_: int, C: int, cfg: HistConfig, sms: int = 132) -> list[tuple[int, int, HistConfig]]:
    """Launches (first row, rows, config) covering T_ one-CTA rows of `cfg` (min_blocks CTAs an SM) without the
    last wave's idle slots: the whole waves as they are, the rest's rows split into segments (the last CTA of a
    row merges them) so that they fill about one wave. At T4096 and 3 CTAs an SM: 3960 rows, then 136 rows of 2
    segments (272 CTAs half a row long) -- 10.5 row times instead of 11."""
    slots = cfg.min_blocks * sms  # (min_blocks 0: the occupancy is not known, no split)
    full = T_ // slots * slots if slots else 0
    rest = T_ - full
    if rest == 0 or full == 0 or n_segments(C, cfg) > 1:
        return [(0, T_, cfg)]
    nseg = max(slots // rest, 1)
    seg = _round_up(-(-C // nseg), cfg.chunk)
    if nseg == 1 or seg >= cfg.seg:
        return [(0, T_, cfg)]
    return [(0, full, cfg), (full, rest, replace(cfg, seg=seg, eager=False))]  # (eager: one segment a row)


def selected_columns(cols: int, n_blocks: int | None, block: int) -> tuple[int, bool]:
    """(the columns the program selects from, whether they are a row's gathered candidate columns) for a top-k of a
    row of `cols` scores, two-level when n_blocks candidate blocks of `block` columns are given: the blocks' columns
    gathered (ascending) when they are fewer than the row's, else the whole row (the other columns -inf). The
    binding (passes/select_kernels) and the runtime adapter both decide by this, so their keys agree. A gathered
    row's invisible columns are -inf already: only an ungathered one takes the queries' positions."""
    if n_blocks is not None and n_blocks * block < cols:
        return n_blocks * block, True
    return cols, False


def default_config(T_: int, C: int, k: int = 512, sms: int = 132) -> Config | HistConfig:
    """Short rows (C <= 4096): one CTA per row, the row in registers (`program`'s group-max filter program).
    Long rows with T >= HIST_MIN_ROWS: the histogram-bound program (`hist_default_config`; H200, same run, every
    row exact: T4096 C65536 761.6 us = 32.5% of HBM vs 1225.2 us = 20.2%, 557.5 us = 44.5% with the fused chunk
    loop; C16384 256.1 us vs 408; T64 C65536 63.0 us vs 88.4). Fewer rows (T1 C65536: 33.7 us vs 31.2 for the
    filter program): the filter program, a row split into segments (one CTA each) until the grid covers the GPU
    twice or the last CTA's one-shot merge buffer (segments x k <= MERGE_ALL_MAX) is full. DEEPINFER_TOPK_HIST=1
    / 0: the hist / filter program for every long row. Decode rows of HIST_MIN_ROWS+ queries up to 8192 columns
    (issue 8's T64 C4160): one 512-thread CTA a row with the row in registers (H200, same run, exact: 16.0 us vs
    20.3 us for the hist default)."""
    force = os.environ.get("DEEPINFER_TOPK_HIST")
    if C <= 4096 or 4096 // 4 < 2 * k or (C <= 8192 and HIST_MIN_ROWS <= T_ < 2 * sms and force != "1"):
        chunk = max(1 << max(C - 1, 1).bit_length(), 512)
        nt = min(max(chunk // 16, 32), 512)
        return Config(nt, chunk // nt, chunk, False, 8, 2048)
    if force == "1" or (force != "0" and T_ >= HIST_MIN_ROWS):
        return hist_default_config(T_, C, k, sms)
    nt, e = 256, 16
    chunk = nt * e
    nchunks = -(-C // chunk)
    if T_ >= 2 * sms or nchunks == 1:
        return Config(nt, e, chunk * nchunks, True, 4, 2048)
    nseg = 1
    while (nseg < nchunks and T_ * nseg < 2 * sms and 2 * nseg * k <= MERGE_ALL_MAX
           and nchunks % (2 * nseg) == 0):  # fmt: skip
        nseg *= 2
    return Config(512, 8, chunk * (nchunks // nseg), True, 4, 2048, merge_all=nseg > 1)


def config_space(T_: int, C: int, k: int = 512) -> list[Config]:
    out = []
    for nt, e in ((64, 32), (128, 16), (128, 32), (256, 16), (256, 32), (512, 16)):
        chunk = nt * e
        for filt in (False, True):
            for nch in (1, 2, 4, 8, 16):
                cfg = Config(nt, e, chunk * nch, filt, 8, 2048)
                if cfg.seg > _round_up(C, chunk):
                    continue
                try:
                    check_config(C, k, cfg)
                except AssertionError:
                    continue
                out.append(cfg)
    return out


def scratch_shapes(T_: int, C: int, k: int, cfg: Config) -> dict[str, tuple[int, ...]]:
    """Shapes of the program's scratch arguments (candidate keys/ids/counts and arrival counters); a single
    element each when there is one segment per row (unused then)."""
    nseg = n_segments(C, cfg)
    if nseg == 1:
        return {"CKey": (1,), "CIdx": (1,), "CCnt": (1,), "Arrive": (1,)}
    return {"CKey": (T_ * nseg * k,), "CIdx": (T_ * nseg * k,), "CCnt": (T_ * nseg,), "Arrive": (T_,)}


def make_scratch(T_: int, C: int, k: int, cfg: Config, device) -> list[torch.Tensor]:
    """[CKey, CIdx, CCnt, Arrive] for `program` (zeroed: the arrival counters must start at 0)."""
    return [torch.zeros(s, dtype=torch.int32, device=device) for s in scratch_shapes(T_, C, k, cfg).values()]


# ---------------------------------------------------------------------------------------------- TileLang


class _Ops:
    """Target-dependent pieces: the `c` target runs every thread loop serially, so atomics are plain
    read-modify-writes, barriers vanish, and the bit intrinsics are the gcc builtins."""

    def __init__(self, cpu: bool):
        self.cpu = cpu

    def sh(self, shape, dtype):
        import tilelang.language as T

        return T.alloc_local(shape, dtype) if self.cpu else T.alloc_shared(shape, dtype)

    def fr(self, shape, dtype):
        import tilelang.language as T

        return T.alloc_local(shape, dtype) if self.cpu else T.alloc_fragment(shape, dtype)

    def par(self, *ext):
        import tilelang.language as T

        return T.grid(*ext) if self.cpu else T.Parallel(*ext)

    def unroll(self, n):
        """Per-thread loop over a register array: unrolled on CUDA (constant indices keep it in registers),
        a plain loop on the `c` target (keeps its IR small)."""
        import tilelang.language as T

        return T.serial(n) if self.cpu else T.unroll(n)

    def sync(self):
        """A CTA barrier between phases whose shared accesses TileLang can see (its sync planner may merge or
        move it)."""
        import tilelang.language as T

        if not self.cpu:
            T.sync_threads()

    def barrier(self):
        """A CTA barrier that is always emitted where written: around phases of shared atomics. TileLang's sync
        planner re-derives barriers from the shared accesses it can see, and the atomics (`atomicAdd`/`atomicOr`
        extern calls) are invisible to it: after the bitmap marking of a one-CTA row (zeroed and read back by
        the same thread) it moved the `T.sync_threads()` past the popcounts -- about 1/4 of the rows wrong on the
        H200 at T=4096, C=2048. An opaque extern call is never moved or elided."""
        import tilelang.language as T

        if not self.cpu:
            T.evaluate(T.call_extern("handle", "__syncthreads"))

    def popc_add(self, acc, x):
        """acc + the set bits of the int32 x (GPU: __popc; the `c` target adds the bits one by one)."""
        import tilelang.language as T

        if not self.cpu:
            return acc + T.call_extern("int32", "__popc", x)
        for b in range(32):
            acc = acc + T.bitwise_and(T.shift_right(x, b), 1)
        return acc

    def bitlen64(self, x):
        """Bits needed for 0 < x < 2^33 (int64) (GPU: __clzll; the `c` target compares powers of two)."""
        import tilelang.language as T

        x = T.cast(x, "int64")
        if not self.cpu:
            return 64 - T.call_extern("int32", "__clzll", x)
        n = T.int32(0)
        for b in range(33):
            n = n + T.if_then_else(x >= T.int64(1 << b), 1, 0)
        return n


def _tl_key(f):
    import tilelang.language as T

    b = T.reinterpret(T.if_then_else(f == T.float32(0.0), T.float32(0.0), f), "int32")
    return T.if_then_else(b >= 0, b, T.bitwise_xor(b, 0x7FFFFFFF))


def _tl_unkey(k):
    import tilelang.language as T

    return T.reinterpret(T.if_then_else(k >= 0, k, T.bitwise_xor(k, 0x7FFFFFFF)), "float32")


KEY_NEG_INF = -(2**31) + 0x7FFFFF  # the key of -inf (bits 0xff800000 ^ 0x7fffffff = 0x807fffff)
RED0 = NB  # offset of block_sum's warp partials in the `cum` scratch (find_bin's warp sums below it)


def cum_size(NT: int) -> int:
    """Ints of the `cum` shared scratch: find_bin's warp sums, then the block reductions' 3 partials a warp."""
    return RED0 + 3 * max(NT // 32, 1)


def _make_block_reduce3(NT: int):
    """GPU macro block_reduce3(red, sumf, minf, maxf): the CTA's sum, min and max of per-thread int32 values
    (warp `__reduce_*_sync`, the warp partials through red[RED0:], two barriers); red3_total(red, j) reads
    result j (0 sum, 1 min, 2 max) until the next block reduction."""
    import tilelang.language as T

    NWARP = NT // 32

    @T.macro
    def block_reduce3(red, sumf, minf, maxf):
        full = T.uint32(0xFFFFFFFF)
        T.evaluate(T.call_extern("handle", "__syncthreads"))  # (every read of the previous partials is done)
        for i in T.Parallel(NT):
            w_sum = T.call_extern("int32", "__reduce_add_sync", full, sumf(i))
            w_min = T.call_extern("int32", "__reduce_min_sync", full, minf(i))
            w_max = T.call_extern("int32", "__reduce_max_sync", full, maxf(i))
            if i % 32 == 0:
                red[RED0 + i // 32 * 3] = w_sum
                red[RED0 + i // 32 * 3 + 1] = w_min
                red[RED0 + i // 32 * 3 + 2] = w_max
        T.evaluate(T.call_extern("handle", "__syncthreads"))

    def red3_total(red, j):
        v = red[RED0 + j]
        for w in range(1, NWARP):
            x = red[RED0 + w * 3 + j]
            v = v + x if j == 0 else (T.min(v, x) if j == 1 else T.max(v, x))
        return v

    return block_reduce3, red3_total


def _make_block_sum(NT: int):
    """GPU macro block_sum(red, valf): the CTA's sum of per-thread int32 values valf(i), one `__reduce_add_sync`
    per warp, the warp partials through red[RED0:], two barriers (TileLang's AllReduce at 256 threads: three
    shared rounds of two barriers each). `red_total(red)` then reads the sum until the next block_sum (whose
    first barrier protects it)."""
    import tilelang.language as T

    NWARP = NT // 32

    @T.macro
    def block_sum(red, valf):
        full = T.uint32(0xFFFFFFFF)
        T.evaluate(T.call_extern("handle", "__syncthreads"))  # (every read of the previous partials is done)
        for i in T.Parallel(NT):
            w_sum = T.call_extern("int32", "__reduce_add_sync", full, valf(i))
            if i % 32 == 0:
                red[RED0 + i // 32] = w_sum
        T.evaluate(T.call_extern("handle", "__syncthreads"))

    def red_total(red):
        v = red[RED0]
        for w in range(1, NWARP):
            v = v + red[RED0 + w]
        return v

    return block_sum, red_total


def _make_find_bin(NT: int):
    """GPU macro find_bin over NB bins: the radix rounds' bin search and the histogram bound's coarse level."""
    import tilelang.language as T

    BPT = max(NB // NT, 1)  # bins a thread owns (contiguous)
    NWARP = NT // 32

    @T.macro
    def find_bin(hist, wsum, bc, r, own, sfx):
        """GPU: bc[0] = the bin holding rank r counted from the top (suffix count >= r, above it < r), bc[1] =
        the count above it. Each thread sums its bins, a suffix scan over the threads (warp shuffles, warp totals
        through `wsum`, one barrier) gives every bin's suffix count -- instead of a one-warp scan of all bins.
        own, sfx: per-thread int32 fragments [NT] (scratch)."""
        full = T.uint32(0xFFFFFFFF)
        for i in T.Parallel(NT):
            own[i] = 0
            for u in T.unroll(BPT):
                if i * BPT + u < NB:
                    own[i] = own[i] + hist[T.min(i * BPT + u, NB - 1)]
            sfx[i] = own[i]  # this thread's bins and its higher lanes'
            for d in (1, 2, 4, 8, 16):
                dn = T.call_extern("int32", "__shfl_down_sync", full, sfx[i], d)
                sfx[i] = sfx[i] + T.if_then_else(i % 32 + d < 32, dn, 0)
            if i % 32 == 0:
                wsum[i // 32] = sfx[i]
        T.evaluate(T.call_extern("handle", "__syncthreads"))
        for i in T.Parallel(NT):
            above = T.alloc_var("int32", init=sfx[i] - own[i])  # the bins above this thread's
            for w in T.unroll(NWARP):
                if w > i // 32:
                    above = above + wsum[w]
            hit = T.alloc_var("int32", init=-1)  # (one shared write after the loop: no barrier per bin)
            hit_above = T.alloc_var("int32", init=0)
            for v in T.unroll(BPT):
                b = i * BPT + BPT - 1 - v
                if b < NB:
                    h = hist[T.min(b, NB - 1)]
                    if T.And(above < r, above + h >= r):
                        hit = b
                        hit_above = above
                    above = above + h
            if hit >= 0:
                bc[0] = hit
                bc[1] = hit_above

    return find_bin


def _make_radix(ops: _Ops, NT: int, Q: int, warp_reduce: bool = False, unroll: bool = True):
    """Macro: exact threshold of the `kk_req` largest of a per-thread set of int32 keys, keyf(i, q) for thread
    i's q-th (NONE = not a member). Adaptive radix select: each round histograms the members inside the current
    key range [lo, hi] into NB bins of equal key width (shared-memory atomics), keeps the bin holding the wanted
    rank, and stops when that bin is taken whole or one key is left: at most ceil(32 / 8) = 4 rounds.
    Out: st[0] = threshold key lo; st[1] = 1 when every member >= lo is taken, else 0 (lo is the kk-th key and
    only st[2] of the members equal to it are taken); st[3] = kk = min(kk_req, members).
    warp_reduce (GPU): the member count / min / max by warp reductions and one exchange (block_reduce3: 2
    barriers, not 3 x 6) -- for the streamed programs; the one-CTA-per-row one keeps TileLang's AllReduce (the
    warp reductions took it from 56 to 104 registers). unroll=False: plain loops over q (keys read from shared
    memory need no constant register indices; a much smaller program)."""
    import tilelang.language as T

    qloop = ops.unroll if unroll else T.serial

    block_reduce3, red3_total = _make_block_reduce3(NT)
    find_bin = _make_find_bin(NT)

    @T.macro
    def radix(keyf, kk_req, st, hist, cum, bc, ra, rb, rc, r1, nq=None):
        """nq (unroll=False): a runtime count of q's to visit instead of Q (the members are the first nq * NT)."""
        QN = Q if nq is None else nq
        lo = T.alloc_var("int32")
        hi = T.alloc_var("int32")
        r = T.alloc_var("int32")
        done = T.alloc_var("int32")
        kk = T.alloc_var("int32")
        for i in ops.par(NT):
            ra[i] = INT_MAX
            rb[i] = NONE
            rc[i] = 0
            for q in qloop(QN):
                kq = keyf(i, q)
                if kq != NONE:
                    ra[i] = T.min(ra[i], kq)
                    rb[i] = T.max(rb[i], kq)
                    rc[i] = rc[i] + 1
        if warp_reduce and not ops.cpu:
            block_reduce3(cum, lambda i: rc[i], lambda i: ra[i], lambda i: rb[i])
            n_all = T.alloc_var("int32", init=red3_total(cum, 0))
            kk = T.min(kk_req, n_all)
            done = T.if_then_else(kk == n_all, 1, 0)
            lo = T.if_then_else(kk == 0, INT_MAX, red3_total(cum, 1))
            hi = red3_total(cum, 2)
        else:
            T.reduce_sum(rc, r1, dim=0)
            kk = T.min(kk_req, r1[0])
            done = T.if_then_else(kk == r1[0], 1, 0)  # every member is taken: lo = the smallest
            T.reduce_min(ra, r1, dim=0)
            lo = T.if_then_else(kk == 0, INT_MAX, r1[0])
            T.reduce_max(rb, r1, dim=0)
            hi = r1[0]
        r = kk
        for _rd in T.serial(5):
            if T.And(done == 0, lo < hi):
                shift = T.alloc_var("int32", init=0)
                shift = T.max(ops.bitlen64(T.cast(hi, "int64") - T.cast(lo, "int64")) - 8, 0)
                for b in ops.par(NB):
                    hist[b] = 0
                ops.barrier()  # (shared atomics next)
                for i in ops.par(NT):
                    for q in qloop(QN):
                        kq = keyf(i, q)
                        if T.And(kq != NONE, T.And(kq >= lo, kq <= hi)):
                            bn = T.cast(T.shift_right(T.cast(kq, "int64") - T.cast(lo, "int64"), shift), "int32")
                            if ops.cpu:
                                hist[bn] = hist[bn] + 1
                            else:
                                T.evaluate(T.call_extern("int32", "atomicAdd", T.address_of(hist[bn]), 1))
                ops.barrier()
                if ops.cpu:
                    acc = T.alloc_var("int32", init=0)
                    for bb in T.serial(NB):
                        if T.And(acc < r, acc + hist[NB - 1 - bb] >= r):
                            bc[0] = NB - 1 - bb
                            bc[1] = acc
                        acc = acc + hist[NB - 1 - bb]
                else:
                    find_bin(hist, cum, bc, r, ra, rb)
                ops.sync()
                bs = bc[0]
                r = r - bc[1]
                lo_new = T.cast(lo, "int64") + T.shift_left(T.cast(bs, "int64"), shift)
                hi = T.cast(T.min(T.cast(hi, "int64"), lo_new + T.shift_left(T.int64(1), shift) - 1), "int32")
                lo = T.cast(lo_new, "int32")
                if hist[bs] == r:
                    done = 1
                ops.sync()
        if done == 0:  # one key left (lo == hi): it is the kk-th; are all its copies taken?
            for i in ops.par(NT):
                rc[i] = 0
                for q in qloop(QN):
                    if keyf(i, q) == lo:
                        rc[i] = rc[i] + 1
            T.reduce_sum(rc, r1, dim=0)
            done = T.if_then_else(r1[0] == r, 1, 0)
        st[0] = lo
        st[1] = done
        st[2] = r
        st[3] = kk

    return radix


def _taken(key, idx, st, st2):
    """Whether a (key, id) of the set `_make_select` ran on is among its selection (st, st2 its results)."""
    import tilelang.language as T

    tie_ok = T.Or(st[1] == 1, -idx >= st2[0])
    return T.And(T.And(st[3] > 0, key != NONE), T.Or(key > st[0], T.And(key == st[0], tie_ok)))


def _pass_key(keyf, idf, st, ps):
    """The key a selection pass ranks: pass 0 the keys; pass 1 (after pass 0 found its k-th key tied) -id of the
    keys equal to it (the lowest ids rank first), NONE for the rest."""
    import tilelang.language as T

    return lambda i, q: T.if_then_else(ps == 0, keyf(i, q), T.if_then_else(keyf(i, q) == st[0], -idf(i, q), NONE))


def _make_store_pass():
    """Macro store_pass(ps, stw, st, st2): a pass's results to st (pass 0, the keys) or st2 (pass 1, the ties)."""
    import tilelang.language as T

    @T.macro
    def store_pass(ps, stw, st, st2):
        for u in T.serial(4):
            if ps == 0:
                st[u] = stw[u]
            else:
                st2[u] = stw[u]

    return store_pass


def _make_select(ops: _Ops, NT: int, Q: int, warp_reduce: bool = False, unroll: bool = True):
    """Macro: the kk = min(kk_req, members) largest keys of a per-thread set (keyf, idf callables), ties to the
    LOWER id (ids unique); `_taken(key, id, st, st2)` then tells the selected ones. Pass 0 runs the radix select
    on the keys; pass 1 (only when the kk-th key is tied) on -id of the tied keys, to take their lowest `need`
    ids. One radix expansion serves both passes (smaller programs); nothing is stored per element."""
    import tilelang.language as T

    radix = _make_radix(ops, NT, Q, warp_reduce, unroll)
    store_pass = _make_store_pass()

    @T.macro
    def select(keyf, idf, kk_req, st, st2, hist, cum, bc, ra, rb, rc, r1, nq=None):
        stw = T.alloc_local((4,), "int32")
        st2[0] = NONE
        st[1] = 1
        for ps in T.serial(2):
            if T.Or(ps == 0, st[1] == 0):  # (the radix expands right here, once for both passes)
                radix(_pass_key(keyf, idf, st, ps), T.if_then_else(ps == 0, kk_req, st[2]), stw, hist, cum, bc, ra,
                      rb, rc, r1, nq)  # fmt: skip
                store_pass(ps, stw, st, st2)

    return select


def _make_volatile(ops: _Ops):
    """(ld, st): a shared word read / written through volatile helpers (GPU; plain accesses on the `c` target),
    opaque to TileLang's sync planner -- for words other warps write without a barrier between (the fused loop),
    or phases whose barriers are all explicit (the register selection)."""
    import tilelang.language as T

    def ld(buf, j, hnd=None):  # hnd: a pointer handle to buf (no access TileLang's sync planner sees)
        if ops.cpu:
            return buf[j]
        if hnd is not None:
            return T.call_extern("int32", "tl_topk_ldi", hnd, j)
        return T.call_extern("int32", "tl_topk_ld", T.address_of(buf[j]))

    @T.macro
    def st(buf, j, v, hnd=None):
        if ops.cpu:
            buf[j] = v
        elif hnd is not None:
            T.evaluate(T.call_extern("handle", "tl_topk_sti", hnd, j, v))
        else:
            T.evaluate(T.call_extern("handle", "tl_topk_st", T.address_of(buf[j]), v))

    return ld, st


def _make_put(ops: _Ops):
    """Macro put(buf, j, v): a plain shared store the sync planner does not see (GPU: an extern call on the buffer's
    start and an int32 offset), for stores whose ordering the caller's explicit barriers provide: a store the
    planner sees inside a per-thread branch gets a barrier inside that branch (a divergent __syncthreads)."""
    import tilelang.language as T

    @T.macro
    def put(buf, j, v, hnd=None):
        if ops.cpu:
            buf[j] = v
        elif hnd is not None:  # (the buffer's start as a pointer handle bound outside the loop: no access at all)
            T.evaluate(T.call_extern("handle", "tl_topk_putv", hnd, j, v))
        else:
            T.evaluate(T.call_extern("handle", "tl_topk_put", T.address_of(buf[0]), j, v))

    return put


def _make_reg_select(ops: _Ops, NT: int, QR: int):
    """Macro reg_select(keyf, idf, kk_req, st, st2, h2, red, bc): `_make_select` for a per-thread set held in
    registers (QR a thread; keyf(i, q) NONE = not a member, idf unique ids), with few barriers: the same adaptive
    radix rounds (ties at the k-th key by a second pass over -id), but on two NB-bin histograms used alternately
    (h2: 2 NB ints), 3 barriers a round and rounds only while needed. Every shared access is opaque to TileLang's
    sync planner (its barriers ran every round of the 5 and split each one further), the barriers explicit.
    red: >= 3 * NT // 32 ints of scratch, bc: 4 ints."""
    import tilelang.language as T

    NWARP = max(NT // 32, 1)
    BPT = max(NB // NT, 1)  # bins a thread owns (contiguous)
    full = T.uint32(0xFFFFFFFF)
    ld, st_ = _make_volatile(ops)
    store_pass = _make_store_pass()

    @T.macro
    def reduce3(cnt, mn, mx, red, res):
        """res[0..2] = the CTA's sum of cnt, min of mn, max of mx (per-thread fragments [NT]); one barrier."""
        if ops.cpu:
            res[0] = 0
            res[1] = INT_MAX
            res[2] = NONE
            for i in T.serial(NT):
                res[0] = res[0] + cnt[i]
                res[1] = T.min(res[1], mn[i])
                res[2] = T.max(res[2], mx[i])
        else:
            for i in T.Parallel(NT):
                w_sum = T.call_extern("int32", "__reduce_add_sync", full, cnt[i])
                w_min = T.call_extern("int32", "__reduce_min_sync", full, mn[i])
                w_max = T.call_extern("int32", "__reduce_max_sync", full, mx[i])
                if i % 32 == 0:
                    st_(red, i // 32 * 3, w_sum)
                    st_(red, i // 32 * 3 + 1, w_min)
                    st_(red, i // 32 * 3 + 2, w_max)
            ops.barrier()
            res[0] = ld(red, 0)
            res[1] = ld(red, 1)
            res[2] = ld(red, 2)
            for w in T.unroll(NWARP - 1):
                res[0] = res[0] + ld(red, w * 3 + 3)
                res[1] = T.min(res[1], ld(red, w * 3 + 4))
                res[2] = T.max(res[2], ld(red, w * 3 + 5))

    @T.macro
    def find(h2, base, r, red, bc, own, sfx, other):
        """bc[0] = the bin of h2[base : base + NB] holding rank r from the top, bc[1] = the count above it; the
        bins of h2[other : other + NB] zeroed (the next round's). Between a barrier behind the counts and one
        after (2 barriers inside: the warp totals, the result)."""
        if ops.cpu:
            acc = T.alloc_var("int32", init=0)
            for bb in T.serial(NB):
                h = h2[base + NB - 1 - bb]
                if T.And(acc < r, acc + h >= r):
                    bc[0] = NB - 1 - bb
                    bc[1] = acc
                acc = acc + h
                h2[other + NB - 1 - bb] = 0
        else:
            for i in T.Parallel(NT):
                own[i] = 0
                for u in T.unroll(BPT):
                    if i * BPT + u < NB:
                        own[i] = own[i] + ld(h2, base + T.min(i * BPT + u, NB - 1))
                sfx[i] = own[i]  # this thread's bins and its higher lanes'
                for d in (1, 2, 4, 8, 16):
                    dn = T.call_extern("int32", "__shfl_down_sync", full, sfx[i], d)
                    sfx[i] = sfx[i] + T.if_then_else(i % 32 + d < 32, dn, 0)
                if i % 32 == 0:
                    st_(red, i // 32, sfx[i])
            ops.barrier()
            for i in T.Parallel(NT):
                above = T.alloc_var("int32", init=sfx[i] - own[i])  # the bins above this thread's
                for w in T.unroll(NWARP):
                    if w > i // 32:
                        above = above + ld(red, w)
                for v in T.unroll(BPT):
                    b = i * BPT + BPT - 1 - v
                    if b < NB:
                        h = ld(h2, base + T.min(b, NB - 1))
                        if T.And(above < r, above + h >= r):
                            st_(bc, 0, b)
                            st_(bc, 1, above)
                        above = above + h
                        st_(h2, other + T.min(b, NB - 1), 0)
        ops.barrier()

    @T.macro
    def radix(keyf, kk_req, stw, h2, red, bc, own, sfx, rc, res, ini=None):
        """ini (cond, lo, hi, r): where cond holds, the kk_req-th key is known to be the r-th largest of the members in
        [lo, hi] (every member above hi taken, at least kk_req members): no count / min / max reduction."""
        lo = T.alloc_var("int32")
        hi = T.alloc_var("int32")
        r = T.alloc_var("int32")
        done = T.alloc_var("int32")
        kk = T.alloc_var("int32")
        for i in ops.par(NT):  # both histograms zeroed, the members' count / min / max
            for u in T.unroll(BPT):
                if i * BPT + u < NB:
                    st_(h2, T.min(i * BPT + u, NB - 1), 0)
                    st_(h2, NB + T.min(i * BPT + u, NB - 1), 0)
            rc[i] = 0
            own[i] = INT_MAX
            sfx[i] = NONE
            for q in ops.unroll(QR):
                kq = keyf(i, q)
                if kq != NONE:
                    rc[i] = rc[i] + 1
                    own[i] = T.min(own[i], kq)
                    sfx[i] = T.max(sfx[i], kq)
        if ini is None:
            reduce3(rc, own, sfx, red, res)  # (its barrier also orders the zeroing before the first counts)
            kk = T.min(kk_req, res[0])
            done = T.if_then_else(kk == res[0], 1, 0)  # every member taken: lo = the smallest
            lo = T.if_then_else(kk == 0, INT_MAX, res[1])
            hi = res[2]
            r = kk
        elif ini[0]:
            ops.barrier()  # (the zeroing before the first counts)
            kk = kk_req
            done = 0
            lo = ini[1]
            hi = ini[2]
            r = ini[3]
        else:
            reduce3(rc, own, sfx, red, res)
            kk = T.min(kk_req, res[0])
            done = T.if_then_else(kk == res[0], 1, 0)
            lo = T.if_then_else(kk == 0, INT_MAX, res[1])
            hi = res[2]
            r = kk
        for rd in T.serial(4):  # (8 bits a round: 4 rounds cover 32)
            if T.And(done == 0, lo < hi):
                shift = T.alloc_var("int32", init=T.max(ops.bitlen64(T.cast(hi, "int64") - T.cast(lo, "int64")) - 8,
                                                        0))  # fmt: skip
                base = T.alloc_var("int32", init=(rd % 2) * NB)
                for i in ops.par(NT):
                    for q in ops.unroll(QR):
                        kq = keyf(i, q)
                        if T.And(kq != NONE, T.And(kq >= lo, kq <= hi)):
                            bn = T.cast(T.shift_right(T.cast(kq, "int64") - T.cast(lo, "int64"), shift), "int32")
                            if ops.cpu:
                                h2[base + bn] = h2[base + bn] + 1
                            else:
                                T.evaluate(T.call_extern("int32", "atomicAdd", T.address_of(h2[base + bn]), 1))
                ops.barrier()
                find(h2, base, r, red, bc, own, sfx, NB - base)
                bs = T.alloc_var("int32", init=ld(bc, 0))
                r = r - ld(bc, 1)
                lo_new = T.cast(lo, "int64") + T.shift_left(T.cast(bs, "int64"), shift)
                hi = T.cast(T.min(T.cast(hi, "int64"), lo_new + T.shift_left(T.int64(1), shift) - 1), "int32")
                lo = T.cast(lo_new, "int32")
                if ld(h2, base + bs) == r:
                    done = 1
        if done == 0:  # one key left (lo == hi): it is the kk-th; are all its copies taken?
            for i in ops.par(NT):
                rc[i] = 0
                for q in ops.unroll(QR):
                    if keyf(i, q) == lo:
                        rc[i] = rc[i] + 1
            ops.barrier()  # (the last round's reads of red are done)
            reduce3(rc, rc, rc, red, res)
            done = T.if_then_else(res[0] == r, 1, 0)
        stw[0] = lo
        stw[1] = done
        stw[2] = r
        stw[3] = kk

    @T.macro
    def reg_select(keyf, idf, kk_req, st, st2, h2, red, bc, own, sfx, rc, ini=None):
        """ini (cond, lo, hi, r): the first pass's known range (radix)."""
        stw = T.alloc_local((4,), "int32")
        res = T.alloc_local((3,), "int32")
        st2[0] = NONE
        st[1] = 1
        for ps in T.serial(2):
            if T.Or(ps == 0, st[1] == 0):
                ops.barrier()  # (the previous pass's reads of h2, red, bc are done)
                radix(_pass_key(keyf, idf, st, ps), T.if_then_else(ps == 0, kk_req, st[2]), stw, h2, red, bc, own,
                      sfx, rc, res, None if ini is None else (T.And(ps == 0, ini[0]), ini[1], ini[2], ini[3]))
                store_pass(ps, stw, st, st2)

    return reg_select


def _make_emit(ops: _Ops, NT: int, C: int, K: int, ffs: bool = False, warp_scan: bool = False):
    """Macro: the marked columns of `bitmap` (C bits) -> Idx[t, 0:kk] in ascending column order, -1 after.
    ffs (GPU): a non-zero word's set bits visited with __ffs (popcount iterations, not 32). warp_scan (GPU): the
    threads' output offsets by a shuffle scan in each warp and the warp totals (one barrier), not T.cumsum (one
    warp walking all NT counts). wv (GPU, ffs): a per-thread int32 fragment [NT, WPT] -- a thread's WPT bitmap words
    read once (contiguous: vector loads) and kept in registers for both passes, not read twice word by word."""
    import tilelang.language as T

    NW = -(-C // 32)
    WPT = -(-NW // NT)
    NWARP = max(NT // 32, 1)
    WSCAN = warp_scan and not ops.cpu
    full = T.uint32(0xFFFFFFFF)

    @T.macro
    def emit(bitmap, wcnt, wbase, Idx, t, kk, wv=None):
        assert wv is None or (ffs and not ops.cpu), "wv: the GPU's __ffs output"
        for i in ops.par(NT):
            c = T.alloc_var("int32", init=0)
            if wv is not None:
                for u in T.unroll(WPT):
                    wv[i, u] = T.if_then_else(i * WPT + u < NW, bitmap[T.min(i * WPT + u, NW - 1)], 0)
                    c = c + T.call_extern("int32", "__popc", wv[i, u])
            else:
                for u in T.serial(WPT):
                    if i * WPT + u < NW:
                        c = ops.popc_add(c, bitmap[T.min(i * WPT + u, NW - 1)])
            if WSCAN:  # wbase[i]: the count before thread i in its warp; wcnt[w]: warp w's total
                incl = T.alloc_var("int32", init=c)
                for d in (1, 2, 4, 8, 16):
                    up = T.call_extern("int32", "__shfl_up_sync", full, incl, d)
                    incl = incl + T.if_then_else(i % 32 >= d, up, 0)
                wbase[i] = incl - c
                if i % 32 == 31:
                    wcnt[i // 32] = incl
            else:
                wcnt[i] = c
        if ops.cpu:
            acc = T.alloc_var("int32", init=0)
            for i in T.serial(NT):
                wbase[i] = acc
                acc = acc + wcnt[i]
        elif not WSCAN:
            T.cumsum(src=wcnt, dst=wbase, dim=0)
        if WSCAN:
            ops.barrier()
        else:
            ops.sync()
        for i in ops.par(NT):
            p = T.alloc_var("int32", init=wbase[i] if ops.cpu else (0 if WSCAN else wbase[i] - wcnt[i]))
            if WSCAN:
                p = wbase[i]
                for w in T.unroll(NWARP):
                    if w < i // 32:
                        p = p + wcnt[w]
            if wv is not None:
                for u in T.unroll(WPT):
                    rest = T.alloc_var("int32", init=wv[i, u])
                    nset = T.alloc_var("int32", init=T.call_extern("int32", "__popc", rest))
                    for _b in T.serial(nset):
                        Idx[t, p] = (i * WPT + u) * 32 + T.call_extern("int32", "__ffs", rest) - 1
                        p = p + 1
                        rest = T.bitwise_and(rest, rest - 1)
            for u in T.serial(WPT if wv is None else 0):
                w = i * WPT + u
                if w < NW:
                    word = bitmap[T.min(w, NW - 1)]
                    if ffs and not ops.cpu:
                        # (the loop bound in a register: a shared load in a loop extent broke TileLang's sync
                        # planner when a thread owns one word -- C 2048 at 128 threads)
                        rest = T.alloc_var("int32", init=word)
                        nset = T.alloc_var("int32", init=T.call_extern("int32", "__popc", rest))
                        for _b in T.serial(nset):
                            Idx[t, p] = w * 32 + T.call_extern("int32", "__ffs", rest) - 1
                            p = p + 1
                            rest = T.bitwise_and(rest, rest - 1)  # (the lowest set bit cleared)
                    elif word != 0:
                        for b in T.serial(32):
                            if T.bitwise_and(T.shift_right(word, b), 1) == 1:
                                Idx[t, p] = w * 32 + b
                                p = p + 1
        for p in ops.par(K):
            if p >= kk:
                Idx[t, p] = -1

    return emit


def _make_emit_wc(NT: int, C: int, K: int):
    """(GPU; HistConfig.emit_wc) Macro emit(bitmap, wcnt, Idx, t, kk, wv, wo): `_make_emit`'s output (__ffs, offsets by
    warp scans) with the bitmap words owned warp-contiguously: warp w owns words [w * WPW, (w + 1) * WPW), its lane l
    word w * WPW + 32 u + l in round u -- a warp load reads 32 consecutive words (thread-contiguous words put lanes 4
    apart on one bank: 8-way conflicts, read twice), the words stay in registers (wv), each round's offsets come from
    a warp scan (wo), and a round's output lands in one stretch of the row. wv, wo: int32 fragments [NT, R]."""
    import tilelang.language as T

    NW = -(-C // 32)
    NWARP = max(NT // 32, 1)
    WPW = _round_up(-(-NW // NWARP), 32)  # words a warp
    R = WPW // 32  # rounds
    full = T.uint32(0xFFFFFFFF)

    @T.macro
    def emit(bitmap, wcnt, Idx, t, kk, wv, wo):
        for i in T.Parallel(NT):
            run = T.alloc_var("int32", init=0)  # the warp's set bits in the rounds before
            for u in T.unroll(R):
                w = (i // 32) * WPW + u * 32 + i % 32
                wv[i, u] = T.if_then_else(w < NW, bitmap[T.min(w, NW - 1)], 0)
                c = T.alloc_var("int32", init=T.call_extern("int32", "__popc", wv[i, u]))
                incl = T.alloc_var("int32", init=c)
                for d in (1, 2, 4, 8, 16):
                    up = T.call_extern("int32", "__shfl_up_sync", full, incl, d)
                    incl = incl + T.if_then_else(i % 32 >= d, up, 0)
                wo[i, u] = run + incl - c
                run = run + T.call_extern("int32", "__shfl_sync", full, incl, 31)
            if i % 32 == 31:
                wcnt[i // 32] = run
        T.sync_threads()  # (planner-visible: the warp totals are plain shared accesses)
        for i in T.Parallel(NT):
            base = T.alloc_var("int32", init=0)
            for v in T.unroll(NWARP):
                if v < i // 32:
                    base = base + wcnt[v]
            for u in T.unroll(R):
                rest = T.alloc_var("int32", init=wv[i, u])
                nset = T.alloc_var("int32", init=T.call_extern("int32", "__popc", rest))
                p = T.alloc_var("int32", init=base + wo[i, u])
                for _b in T.serial(nset):
                    Idx[t, p] = ((i // 32) * WPW + u * 32 + i % 32) * 32 + T.call_extern("int32", "__ffs", rest) - 1
                    p = p + 1
                    rest = T.bitwise_and(rest, rest - 1)  # (the lowest set bit cleared)
        for p in T.Parallel(K):
            if p >= kk:
                Idx[t, p] = -1

    return emit


def _make_row_io(ops: _Ops, NT: int, E: int, NW: int, EB: int):
    """The streamed programs' shared pieces: chunk loads (thread i's j-th score of a chunk: float4 j // 4, strided
    by the threads) and keys, warp-aggregated pushes into a shared buffer, the buffer back into registers (EB a
    thread), the bitmap marking of selected columns (NW words), L2 reads of other CTAs' scratch."""
    import tilelang.language as T

    NEG = -T.infinity("float32")

    def ld_cg(buf, idx):  # a global int32 another CTA wrote during this kernel: read it at L2 (no stale L1 line)
        return buf[idx] if ops.cpu else T.call_extern("int32", "__ldcg", T.address_of(buf[idx]))

    @T.macro
    def arrive(CCnt, Arrive, bc, slot, t, nb):
        """A segment's set is in the scratch: its count nb to CCnt[slot], then the row's arrival (acq_rel, after
        every thread's writes are fenced GPU-wide); bc[2] = how many segments arrived before, for every thread."""
        if not ops.cpu:
            T.evaluate(T.call_extern("handle", "__threadfence"))
            T.evaluate(T.call_extern("handle", "__syncthreads"))  # (opaque: never elided)
        for _z in ops.par(1):
            CCnt[slot] = nb
            if ops.cpu:
                bc[2] = Arrive[t]
                Arrive[t] = Arrive[t] + 1
            else:
                T.evaluate(T.call_extern("handle", "__threadfence"))
                bc[2] = T.atomic_add(Arrive[t], 1, memory_order="acq_rel", return_prev=True)
        ops.barrier()

    @T.macro
    def atomic_add_ret(buf, idx, val, out):
        if ops.cpu:
            out[0] = buf[idx]
            buf[idx] = buf[idx] + val
        else:
            out[0] = T.call_extern("int32", "atomicAdd", T.address_of(buf[idx]), val)

    @T.macro
    def warp_reserve(ctl, slot, x, lane, out, ctr=None):
        """out[0] = where this thread's x entries start: an inclusive warp scan of x (shuffles), the warp's
        total reserved by its last lane with one atomicAdd on ctl[slot] (or on the counter a pointer handle `ctr`
        points at: invisible to TileLang's sync planner), the base broadcast back."""
        full = T.uint32(0xFFFFFFFF)
        incl = T.alloc_var("int32", init=x)
        for d in (1, 2, 4, 8, 16):
            up = T.call_extern("int32", "__shfl_up_sync", full, incl, d)
            incl = incl + T.if_then_else(lane >= d, up, 0)
        base = T.alloc_var("int32", init=0)
        if lane == 31:
            if ctr is None:
                base = T.call_extern("int32", "atomicAdd", T.address_of(ctl[slot]), incl)
            else:
                base = T.call_extern("int32", "tl_topk_atomic_addv", ctr, incl)
        out[0] = T.call_extern("int32", "__shfl_sync", full, base, 31) + incl - x

    @T.macro
    def mark(bitmap, idf, takef, Q, unroll=True):
        for w in ops.par(NW):
            bitmap[w] = 0
        ops.barrier()  # (shared atomics next)
        for i in ops.par(NT):
            for q in ops.unroll(Q) if unroll else T.serial(Q):
                if takef(i, q):
                    c = idf(i, q)
                    if ops.cpu:
                        bitmap[c // 32] = T.bitwise_or(bitmap[c // 32], T.shift_left(1, c % 32))
                    else:
                        T.evaluate(T.call_extern("int32", "atomicOr", T.address_of(bitmap[c // 32]),
                                                 T.shift_left(1, c % 32)))  # fmt: skip
        ops.barrier()

    @T.macro
    def push(dst_k, dst_i, base, ctl, slot, keyf, idf, takef, Q, cnt, tmp, unroll=True, lead=True):
        """Append the taken (key, id) pairs of every thread at dst[base + ...] (slot order is free); the running
        count is ctl[slot] (atomics: every earlier read of it is behind the first barrier, the count and the
        entries are complete after the second). unroll=False: plain loops (sources in shared memory). lead=False:
        without the first barrier (the caller's last one stands for it)."""
        if lead:
            ops.barrier()
        for i in ops.par(NT):
            cnt[i] = 0
            for q in ops.unroll(Q) if unroll else T.serial(Q):
                cnt[i] = cnt[i] + T.if_then_else(takef(i, q), 1, 0)
        for i in ops.par(NT):
            if ops.cpu:
                atomic_add_ret(ctl, slot, cnt[i], tmp)
            else:  # one shared atomic per warp (not per thread: they serialise on the one counter)
                warp_reserve(ctl, slot, cnt[i], i % 32, tmp)
            p = T.alloc_var("int32", init=tmp[0])
            for q in ops.unroll(Q) if unroll else T.serial(Q):
                if takef(i, q):
                    dst_k[base + p] = keyf(i, q)
                    dst_i[base + p] = idf(i, q)
                    p = p + 1
        ops.barrier()

    def col_of(c0, i, j):  # thread i's j-th score of the chunk at c0: float4 j // 4, strided by the threads
        return c0 + ((j // 4) * NT + i) * 4 + j % 4

    # per-element accessors of the two candidate sets (chunk registers kc; buffer/union registers bk, bi)
    def key_c(kc):
        return lambda i, j: kc[i, j]

    def id_c(c0):
        return lambda i, j: col_of(c0, i, j)

    def take_c(kc, c0, st, st2):
        return lambda i, j: _taken(kc[i, j], col_of(c0, i, j), st, st2)

    def key_b(bk):
        return lambda i, q: bk[i, q]

    def id_b(bi):
        return lambda i, q: bi[i, q]

    def take_b(bk, bi, st, st2):
        return lambda i, q: _taken(bk[i, q], bi[i, q], st, st2)

    def cand(kc, c0, lower, fb, st, st2):
        """A chunk candidate: at least the running bound, and in the chunk's exact top-k after a fallback."""
        in_c = lambda i, j: T.Or(fb == 0, _taken(kc[i, j], col_of(c0, i, j), st, st2))  # noqa: E731
        return lambda i, j: T.And(T.And(kc[i, j] != NONE, kc[i, j] >= lower), in_c(i, j))

    @T.macro
    def fetch_chunk(S, t, c0, lim, xr):
        for i in ops.par(NT):
            for j in ops.unroll(E):  # float4 loads; a float4 wholly past the limit is not read
                xr[i, j] = T.if_then_else(col_of(c0, i, j - j % 4) < lim, S[t, col_of(c0, i, j)], NEG)

    @T.macro
    def chunk_keys(c0, lim, xr, kc):
        for i in ops.par(NT):
            for j in ops.unroll(E):
                b = T.alloc_var("int32")
                b = T.reinterpret(T.if_then_else(xr[i, j] == T.float32(0.0), T.float32(0.0), xr[i, j]), "int32")
                kc[i, j] = T.if_then_else(T.And(col_of(c0, i, j) < lim, xr[i, j] > NEG),
                                          T.if_then_else(b >= 0, b, T.bitwise_xor(b, 0x7FFFFFFF)), NONE)  # fmt: skip

    @T.macro
    def load_chunk(S, t, c0, lim, xr, kc):
        fetch_chunk(S, t, c0, lim, xr)
        chunk_keys(c0, lim, xr, kc)

    @T.macro
    def load_buffer(bufk, bufi, nb, bk, bi):
        for i in ops.par(NT):
            for q in ops.unroll(EB):
                bk[i, q] = T.if_then_else(q * NT + i < nb, bufk[q * NT + i], NONE)
                bi[i, q] = bufi[q * NT + i]

    return SimpleNamespace(
        ld_cg=ld_cg,
        arrive=arrive,
        atomic_add_ret=atomic_add_ret,
        warp_reserve=warp_reserve,
        mark=mark,
        push=push,
        col_of=col_of,
        key_c=key_c,
        id_c=id_c,
        take_c=take_c,
        key_b=key_b,
        id_b=id_b,
        take_b=take_b,
        cand=cand,
        fetch_chunk=fetch_chunk,
        chunk_keys=chunk_keys,
        load_chunk=load_chunk,
        load_buffer=load_buffer,
    )


def _select_workspace(ops: _Ops, NT: int, NW: int, n_bc: int):
    """Both programs' selection and output workspace, allocated in the calling kernel: the radix histogram, the
    reductions' scratch, n_bc bin/arrival words, control words, the output bitmap (NW words) and its per-thread
    counts/bases, and the per-thread reduction fragments ra, rb, rc, r1."""
    return (
        ops.sh((NB,), "int32"), ops.sh((cum_size(NT),), "int32"), ops.sh((n_bc,), "int32"), ops.sh((4,), "int32"),
        ops.sh((NW,), "int32"), ops.sh((NT,), "int32"), ops.sh((NT,), "int32"),
        ops.fr((NT,), "int32"), ops.fr((NT,), "int32"), ops.fr((NT,), "int32"), ops.fr((1,), "int32"),
    )  # fmt: skip


def program(T_: int, C: int, *, k: int, ratio: int = 1, cfg: Config, target: str, has_pos: bool = True):
    """prim_func(S [T, C] f32, Pos [T] i32, Idx [T, k] i32, CKey, CIdx, CCnt, Arrive (int32 scratch, see
    `scratch_shapes`; Arrive zeroed once, the kernel leaves it zeroed)), grid (segments, T)."""
    import tilelang.language as T

    if isinstance(cfg, HistConfig):
        return hist_program(T_, C, k=k, ratio=ratio, cfg=cfg, target=target, has_pos=has_pos)
    check_config(C, k, cfg)
    T_ = T.dynamic("T") if T_ is None else T_
    ops = _Ops(target == "cpu")
    NT, E, G, SEG = cfg.threads, cfg.per_thread, cfg.group, cfg.seg
    CH, NSEG, FILTER = cfg.chunk, n_segments(C, cfg), cfg.filter
    MERGE_ALL = cfg.merge_all and NSEG > 1
    NCH, EG = SEG // CH, E // G
    # the shared candidate buffer, also held in registers (EB per thread) when it is cut to its top-k: the filter's
    # (the exact top-k plus one chunk's candidates) or the last CTA's (the top-k so far plus one segment's set;
    # merge_all: every segment's set, loaded at once and selected once -- no serial cuts in the merge)
    STREAM = FILTER or NSEG > 1 or NCH > 1  # chunks / segment sets stream through a shared candidate buffer
    BUF = _round_up(max(k + (cfg.cap if FILTER else k), NT, NSEG * k if MERGE_ALL else 0), NT)
    EB = BUF // NT
    NW = -(-C // 32)
    sh = scratch_shapes(T_, C, k, cfg)

    select_c = _make_select(ops, NT, E, STREAM)
    radix_g = _make_radix(ops, NT, max(EG, 1), STREAM)
    select_b = _make_select(ops, NT, EB, STREAM)
    emit = _make_emit(ops, NT, C, k)
    block_sum, red_total = _make_block_sum(NT)

    io = _make_row_io(ops, NT, E, NW, EB)
    ld_cg, mark, push, cand, arrive = io.ld_cg, io.mark, io.push, io.cand, io.arrive
    key_c, id_c, take_c = io.key_c, io.id_c, io.take_c
    key_b, id_b, take_b = io.key_b, io.id_b, io.take_b
    fetch_chunk, chunk_keys, load_chunk, load_buffer = io.fetch_chunk, io.chunk_keys, io.load_chunk, io.load_buffer

    def c0_of(sg, it):  # first column of chunk `it` of segment `sg` (an expression: keeps float4 alignment)
        return sg * SEG + it * CH

    @T.prim_func
    def topk_select(
        S: T.Tensor((T_, C), "float32"),
        Pos: T.Tensor((T_,), "int32"),
        Idx: T.Tensor((T_, k), "int32"),
        CKey: T.Tensor(sh["CKey"], "int32"),
        CIdx: T.Tensor(sh["CIdx"], "int32"),
        CCnt: T.Tensor(sh["CCnt"], "int32"),
        Arrive: T.Tensor(sh["Arrive"], "int32"),
    ):
        with T.Kernel(NSEG, T_, threads=NT) as (sg, t):
            hist, cum, bc, ctl, bitmap, wcnt, wbase, ra, rb, rc, r1 = _select_workspace(ops, NT, NW, 4)
            stc = T.alloc_local((4,), "int32")  # the chunk's selection
            stc2 = T.alloc_local((4,), "int32")
            stb = T.alloc_local((4,), "int32")  # the buffer's / the union's selection
            stb2 = T.alloc_local((4,), "int32")
            tmp = T.alloc_local((1,), "int32")
            xr = ops.fr((NT, E), "float32")
            kc = ops.fr((NT, E), "int32")
            bk = ops.fr((NT, EB), "int32")
            bi = ops.fr((NT, EB), "int32")
            lim = T.alloc_var("int32", init=C)
            if has_pos:
                lim = T.min((Pos[t] + 1) // ratio, C)
            for u in T.serial(4):
                stc[u] = 0
                stc2[u] = NONE
            if not STREAM:  # one chunk, no buffer: select straight from the registers
                load_chunk(S, t, sg * SEG, lim, xr, kc)
                select_c(key_c(kc), id_c(sg * SEG), k, stc, stc2, hist, cum, bc, ra, rb, rc, r1)
                mark(bitmap, id_c(sg * SEG), take_c(kc, sg * SEG, stc, stc2), E)
                emit(bitmap, wcnt, wbase, Idx, t, stc[3])
            else:
                bufk = ops.sh((BUF,), "int32")
                bufi = ops.sh((BUF,), "int32")
                gk = ops.fr((NT, max(EG, 1)), "int32")
                lower = T.alloc_var("int32", init=NONE)  # running lower bound of the segment's k-th key
                fb = T.alloc_var("int32", init=0)  # 1: the chunk hands on its exact top-k
                m = T.alloc_var("int32", init=0)  # candidates of this iteration's source
                # live segments: those with a visible column (at least one: it writes a row without any);
                # the others exit at once, the live ones merge only the live slots
                nlive = T.alloc_var("int32", init=T.max(T.min((lim + SEG - 1) // SEG, NSEG), 1))
                last = T.alloc_var("int32", init=T.if_then_else(nlive == 1, 1, 0))  # the CTA that finishes the row
                if sg < nlive:
                    for _z in ops.par(1):
                        ctl[0] = 0
                    ops.sync()
                    if c0_of(sg, 0) < lim:  # the first chunk in flight; each later one is fetched a chunk ahead
                        fetch_chunk(S, t, c0_of(sg, 0), lim, xr)
                    # iterations: this segment's chunks, then (the last CTA of the row) the segments' top-k sets
                    for it in T.serial(NCH + (0 if NSEG == 1 else (1 if MERGE_ALL else NSEG))):
                        m = 0
                        if it < NCH:
                            if c0_of(sg, it) < lim:
                                chunk_keys(c0_of(sg, it), lim, xr, kc)
                                if NCH > 1:  # the next chunk's loads fly while this one is filtered and pushed
                                    if T.And(it + 1 < NCH, c0_of(sg, it + 1) < lim):
                                        fetch_chunk(S, t, c0_of(sg, it + 1), lim, xr)
                                fb = 1
                                if FILTER:  # candidates: at least the running bound (tightened first if too many)
                                    fb = 0
                                    for ps in T.serial(2):
                                        if T.Or(ps == 0, m > cfg.cap):
                                            if ps == 1:  # the k-th largest group maximum bounds the chunk's k-th
                                                for i in ops.par(NT):
                                                    for g in ops.unroll(EG):
                                                        gm = T.alloc_var("int32", init=NONE)
                                                        for u in ops.unroll(G):
                                                            gm = T.max(gm, kc[i, g * G + u])
                                                        gk[i, g] = gm
                                                radix_g(lambda i, g: gk[i, g], k, stb, hist, cum, bc, ra, rb, rc, r1)
                                                if stb[3] == k:
                                                    lower = T.max(lower, stb[0])
                                            for i in ops.par(NT):
                                                rc[i] = 0
                                                for j in ops.unroll(E):
                                                    is_c = cand(kc, c0_of(sg, it), lower, fb, stc, stc2)(i, j)
                                                    rc[i] = rc[i] + T.if_then_else(is_c, 1, 0)
                                            if ops.cpu:
                                                T.reduce_sum(rc, r1, dim=0)
                                                m = r1[0]
                                            else:
                                                block_sum(cum, lambda i: rc[i])
                                                m = red_total(cum)
                                    if m > cfg.cap:  # still too many (heavy ties): the chunk's exact top-k instead
                                        fb = 1
                                if fb == 1:
                                    select_c(key_c(kc), id_c(c0_of(sg, it)), k, stc, stc2,
                                             hist, cum, bc, ra, rb, rc, r1)  # fmt: skip
                                    m = stc[3]
                                    if stc[3] == k:  # k scores >= the chunk's k-th: it bounds the segment's k-th
                                        lower = T.max(lower, stc[0])
                        elif T.And(T.And(it > NCH, last == 1), it - NCH < nlive):
                            m = ld_cg(CCnt, t * NSEG + it - NCH)
                        # full, or the segment is done (several live segments): cut to the top-k
                        if T.Or(ctl[0] + m > BUF, T.And(it == NCH, nlive > 1)):
                            load_buffer(bufk, bufi, ctl[0], bk, bi)
                            select_b(key_b(bk), id_b(bi), k, stb, stb2, hist, cum, bc, ra, rb, rc, r1)
                            ops.sync()
                            for _z in ops.par(1):
                                ctl[0] = 0
                            push(bufk, bufi, 0, ctl, 0, key_b(bk), id_b(bi), take_b(bk, bi, stb, stb2), EB, rc, tmp)
                            if stb[3] == k:  # the buffer's k-th key: a (much) tighter bound from now on
                                lower = T.max(lower, stb[0])
                        if T.And(it == NCH, nlive > 1):  # (several live segments) the segment's top-k handed on;
                            nb = ctl[0]
                            for e in ops.par(BUF):
                                if e < nb:
                                    CKey[(t * NSEG + sg) * k + e] = bufk[e]
                                    CIdx[(t * NSEG + sg) * k + e] = bufi[e]
                            arrive(CCnt, Arrive, bc, t * NSEG + sg, t, nb)
                            if bc[2] == nlive - 1:  # the last CTA goes on
                                last = 1
                                for _z in ops.par(1):
                                    ctl[0] = 0
                                    Arrive[t] = 0  # ready for the next call
                                ops.sync()
                                m = ld_cg(CCnt, t * NSEG)
                        if it < NCH:
                            if m > 0:
                                push(bufk, bufi, 0, ctl, 0, key_c(kc), id_c(c0_of(sg, it)),
                                     cand(kc, c0_of(sg, it), lower, fb, stc, stc2), E, rc, tmp)  # fmt: skip
                        elif T.And(T.And(last == 1, nlive > 1), MERGE_ALL):  # every live segment's set at once,
                            for e in ops.par(NSEG * k):  # NONE-padded to k each
                                ok = T.And(e // k < nlive, (e % k) < ld_cg(CCnt, t * NSEG + e // k))
                                bufk[e] = T.if_then_else(ok, ld_cg(CKey, t * NSEG * k + e), NONE)
                                bufi[e] = T.if_then_else(ok, ld_cg(CIdx, t * NSEG * k + e), 0)
                            ops.sync()
                            for _z in ops.par(1):
                                ctl[0] = NSEG * k
                            ops.sync()
                        elif T.And(last == 1, nlive > 1):  # the segments' sets: L2 reads (other CTAs wrote them)
                            nb = ctl[0]
                            src = (t * NSEG + it - NCH) * k
                            for e in ops.par(k):
                                if e < m:
                                    bufk[nb + e] = ld_cg(CKey, src + e)
                                    bufi[nb + e] = ld_cg(CIdx, src + e)
                            ops.sync()
                            for _z in ops.par(1):
                                ctl[0] = nb + m
                            ops.sync()
                    if last == 1:
                        load_buffer(bufk, bufi, ctl[0], bk, bi)
                        select_b(key_b(bk), id_b(bi), k, stb, stb2, hist, cum, bc, ra, rb, rc, r1)
                        mark(bitmap, id_b(bi), take_b(bk, bi, stb, stb2), EB)
                        emit(bitmap, wcnt, wbase, Idx, t, stb[3])

    return topk_select


def _make_count_key(ops: _Ops):
    """Macro count_key(hist_f, hist_c, key): one key into the fine (its top 12 bits) and coarse (top 8) histograms
    (shared atomics on the GPU)."""
    import tilelang.language as T

    @T.macro
    def count_key(hist_f, hist_c, kq, hp=None):
        """hp: the loop's pointer handles (`_make_fused`), by buffer name."""
        f = T.shift_right(kq, HSHIFT) + HB // 2
        if ops.cpu:
            hist_f[f] = hist_f[f] + 1
            hist_c[f // HSUB] = hist_c[f // HSUB] + 1
        elif hp is not None:
            T.evaluate(T.call_extern("int32", "tl_topk_atomic_addi", hp["hist_f"], f, 1))
            T.evaluate(T.call_extern("int32", "tl_topk_atomic_addi", hp["hist_c"], f // HSUB, 1))
        else:
            T.evaluate(T.call_extern("int32", "atomicAdd", T.address_of(hist_f[f]), 1))
            T.evaluate(T.call_extern("int32", "atomicAdd", T.address_of(hist_c[f // HSUB]), 1))

    return count_key


def _make_hist_bound(ops: _Ops, NT: int):
    """Macros of the histogram bound (`hist_program`): count(hist_f, hist_c, keyf, Q, beta) adds the members >= beta
    of a per-thread key set to the fine (HB bins: the key's top 12 bits) and coarse (NB bins: top 8 bits)
    histograms; threshold(...) finds the fine bin holding rank r from the top: the coarse bin by find_bin's
    shuffle scan, then its HSUB fine bins (one thread each, no scan of all HB bins)."""
    import tilelang.language as T

    find_bin = _make_find_bin(NT)
    count_key = _make_count_key(ops)
    NWARP = NT // 32

    @T.macro
    def count(hist_f, hist_c, keyf, Q, beta):
        for i in ops.par(NT):
            for q in ops.unroll(Q):
                kq = keyf(i, q)
                if T.And(kq != NONE, kq >= beta):
                    count_key(hist_f, hist_c, kq)

    @T.macro
    def threshold(hist_f, hist_c, cum, bc, r, own, sfx):
        """bc[2] = the fine bin holding rank r from the top, -1 when fewer than r are counted; bc[3] = the count at
        and above it (the total when -1). After a barrier behind the counts; ends with a barrier."""
        if ops.cpu:
            acc = T.alloc_var("int32", init=0)
            bc[2] = -1
            for bb in T.serial(HB):
                h = hist_f[HB - 1 - bb]
                if T.And(acc < r, acc + h >= r):
                    bc[2] = HB - 1 - bb
                    bc[3] = acc + h
                acc = acc + h
            if bc[2] < 0:
                bc[3] = acc
        else:
            for i in T.Parallel(NT):
                if i == 0:
                    bc[0] = -1  # (find_bin writes it only when the rank is reached)
            find_bin(hist_c, cum, bc, r, own, sfx)
            T.evaluate(T.call_extern("handle", "__syncthreads"))
            for i in T.Parallel(NT):
                cb = bc[0]
                s = T.alloc_var("int32", init=0)
                if T.And(i < HSUB, cb >= 0):  # fine bin i of the coarse bin: the count at and above it
                    for u in T.unroll(HSUB):
                        if u >= i:
                            s = s + hist_f[cb * HSUB + u]
                    s = s + bc[1]
                    if T.And(s >= r, s - hist_f[cb * HSUB + i] < r):
                        bc[2] = cb * HSUB + i
                        bc[3] = s
                if T.And(i == 0, cb < 0):
                    for w in T.unroll(NWARP):
                        s = s + cum[w]  # (find_bin's warp totals)
                    bc[2] = -1
                    bc[3] = s
            T.evaluate(T.call_extern("handle", "__syncthreads"))

    return count, threshold


# fused chunks: words of the `fz` shared control array -- per chunk parity p (chunk it: p = it % 3) an overflow
# flag FZ_FLAG + p and the lowest failed reservation FZ_MINF + p; the running bound the bin-search warp raises
FZ_FLAG, FZ_MINF, FZ_BETA, FZ_SIZE = 0, 3, 6, 8


def _make_fused(ops: _Ops, NT: int, E: int, BUF: int, warp_reserve):
    """Macros of `HistConfig.fused` (chunks after the first), so that a chunk costs one CTA barrier:

    * reserve_push: every thread counts its keys >= its bound, reserves room in the buffer (warp scan, one
      atomicAdd a warp on ctl[0]) and writes them at once -- unless its range ends past BUF: then it writes
      nothing, keeps them (fl[i] = 1), sets the chunk's overflow flag and atomicMin's its range start into
      FZ_MINF. Ranges are handed out in order, so every range below the lowest failed start was written.
    * warp_threshold: one warp finds the fine bin holding rank r from the top (coarse bins 8 a lane, a shuffle
      suffix scan, the crossing lane's 8 bins, then the 16 fine bins) and atomicMax'es its lowest key into
      FZ_BETA -- while the other warps go on with the next chunk and add counts. Every count it reads is a
      number of real keys of the row (counts only grow), so a bound from any mix of old and new counts still
      has r keys at or above it: racing reads give a looser bound, never a wrong one.
    The shared words another warp may be writing are read and written through volatile helpers (opaque to
    TileLang's sync planner, which would otherwise add barriers for them)."""
    import tilelang.language as T

    full = T.uint32(0xFFFFFFFF)
    CPL = NB // 32  # coarse bins a lane
    count_key = _make_count_key(ops)
    ld, st = _make_volatile(ops)

    put = _make_put(ops)

    def rd(buf, j, hp, name):  # buf[j], or through the pointer handle hp[name] to buf (warp_threshold's hp)
        return buf[j] if hp is None else T.call_extern("int32", "tl_topk_ldv", hp[name], j)

    def warp_any(pred):  # (GPU) whether any lane of the warp has pred; the `c` target takes every thread's path
        return T.call_extern("int32", "__any_sync", full, pred) != 0

    @T.macro
    def reserve_push(bufk, bufi, ctl, fz, par, keyf, idf, takef, fl, tmp, hist_f=None, hist_c=None, hitx=None,
                     fm=None, hp=None):  # fmt: skip
        """hitx = (xf, thr) (GPU): no key of thread i is taken unless max_q xf(i, q) >= thr (a float): a warp
        where that holds for no lane skips the count, the reservation and the push. fm (lean, no hitx): a
        per-thread int32 fragment for the taken keys as a bit mask -- the count is its popcount (not a chain of
        selects and adds), the push tests its bits and converts each key once; a warp without a key to push
        skips the reservation and the push. hp (GPU): pointer handles by buffer name (bufk, bufi, ctl, fz, hist_f,
        hist_c) bound before the chunk loop, so that the pushes, counts, flags and the reservation are no access
        TileLang's sync planner sees in the loop."""
        hitf = None if hitx is None or ops.cpu else hitx
        skip = hitf is not None or (fm is not None and not ops.cpu)  # (warp-uniform) idle warps skip the reservation
        assert fm is None or (hitx is None and E < 32), "the lean mask: one bit a key"
        if hitf is not None:  # fl = whether the thread's largest float reaches the bound
            for i in ops.par(NT):  # (one loop over a register array per parallel loop: TileLang's layouts)
                xm = T.alloc_var("float32", init=-T.infinity("float32"))
                for q in ops.unroll(E):
                    xm = T.max(xm, hitf[0](i, q))
                fl[i] = T.if_then_else(xm >= hitf[1], 1, 0)
        for i in ops.par(NT):  # (the count in fl first: one loop over the keys a parallel loop)
            if fm is not None:
                fm[i] = 0
                for q in ops.unroll(E):
                    fm[i] = T.bitwise_or(fm[i], T.if_then_else(takef(i, q), T.shift_left(1, q), 0))
                fl[i] = ops.popc_add(T.int32(0), fm[i])
            elif hitf is None:
                fl[i] = 0
                for q in ops.unroll(E):
                    fl[i] = fl[i] + T.if_then_else(takef(i, q), 1, 0)
            elif warp_any(fl[i] != 0):  # (warp-uniform) most warps of a later chunk have no key at the bound
                fl[i] = 0
                for q in ops.unroll(E):
                    fl[i] = fl[i] + T.if_then_else(takef(i, q), 1, 0)
            else:
                fl[i] = 0
        for i in ops.par(NT):
            n = T.alloc_var("int32", init=fl[i])
            if ops.cpu:
                tmp[0] = ctl[0]
                ctl[0] = ctl[0] + n
            elif not skip:
                warp_reserve(ctl, 0, n, i % 32, tmp, None if hp is None else hp["ctl"])
            elif warp_any(n > 0):  # (warp-uniform: the shuffles need every lane) no atomic for an idle warp
                warp_reserve(ctl, 0, n, i % 32, tmp, None if hp is None else hp["ctl"])
            p = T.alloc_var("int32", init=tmp[0])
            fl[i] = T.if_then_else(T.And(n > 0, p + n > BUF), 1, 0)
            if fl[i] == 1:
                if ops.cpu:
                    fz[FZ_FLAG + par] = 1
                    fz[FZ_MINF + par] = T.min(fz[FZ_MINF + par], p)
                elif hp is not None:
                    T.evaluate(T.call_extern("handle", "tl_topk_sti", hp["fz"], FZ_FLAG + par, 1))
                    T.evaluate(T.call_extern("int32", "tl_topk_atomic_mini", hp["fz"], FZ_MINF + par, p))
                else:
                    T.evaluate(T.call_extern("handle", "tl_topk_st", T.address_of(fz[FZ_FLAG + par]), 1))
                    T.evaluate(T.call_extern("int32", "atomicMin", T.address_of(fz[FZ_MINF + par]), p))
            elif T.bool(True) if not skip else n > 0:  # (opaque stores on the GPU: the planner put a
                if fm is not None:  # barrier into this divergent branch for them)
                    # (GPU: the mask through an opaque move, else nvcc keeps the count's 16 predicates live in
                    # a register -- two bit operations a key -- instead of testing the mask's bits)
                    mb = T.alloc_var("int32", init=fm[i] if ops.cpu else T.call_extern("int32", "tl_topk_opaque",
                                                                                          fm[i]))  # fmt: skip
                    for q in ops.unroll(E):
                        if T.bitwise_and(T.shift_right(mb, q), 1) == 1:
                            kq = T.alloc_var("int32", init=keyf(i, q))
                            put(bufk, p, kq, None if hp is None else hp["bufk"])
                            put(bufi, p, idf(i, q), None if hp is None else hp["bufi"])
                            p = p + 1
                            if hist_f is not None:
                                count_key(hist_f, hist_c, kq, hp)
                else:
                    for q in ops.unroll(E):
                        if takef(i, q):
                            put(bufk, p, keyf(i, q), None if hp is None else hp["bufk"])
                            put(bufi, p, idf(i, q), None if hp is None else hp["bufi"])
                            p = p + 1
                            if hist_f is not None:  # counted here, not in a loop of its own (fewer registers)
                                count_key(hist_f, hist_c, keyf(i, q))

    @T.macro
    def warp_threshold(hist_f, hist_c, fz, r, w, hp=None, out=None):
        """(GPU) warp w: FZ_BETA = max(FZ_BETA, the lowest key of the fine bin holding rank r), when r are counted.
        hp: the loop's pointer handles by buffer name (reserve_push), read and written through. out: instead, out[2] =
        that fine bin (-1: fewer than r counted), out[3] = the count at and above it (as the CTA's `threshold`)."""
        for i in T.Parallel(NT):
            if i // 32 == w:
                lane = i % 32
                if out is not None:
                    if lane == 0:
                        st(out, 2, -1)
                own = T.alloc_var("int32", init=0)
                for u in T.unroll(CPL):
                    own = own + rd(hist_c, lane * CPL + u, hp, "hist_c")
                sfx = T.alloc_var("int32", init=own)  # this lane's bins and the higher lanes'
                for d in (1, 2, 4, 8, 16):
                    dn = T.call_extern("int32", "__shfl_down_sync", full, sfx, d)
                    sfx = sfx + T.if_then_else(lane + d < 32, dn, 0)
                hits = T.alloc_var("int32", init=T.call_extern("int32", "__ballot_sync", full, sfx >= r))
                if hits != 0:  # (warp-uniform) the highest lane with >= r at and above it
                    hl = 31 - T.call_extern("int32", "__clz", hits)
                    above = T.call_extern("int32", "__shfl_sync", full, sfx - own, hl)  # < r
                    # that lane's CPL bins, one a lane (read again: at least as many as summed above)
                    h = T.alloc_var("int32", init=T.if_then_else(
                        lane < CPL, rd(hist_c, hl * CPL + lane % CPL, hp, "hist_c"), 0))
                    s = T.alloc_var("int32", init=h)
                    for d in (1, 2, 4):
                        dn = T.call_extern("int32", "__shfl_down_sync", full, s, d)
                        s = s + T.if_then_else(lane + d < CPL, dn, 0)
                    s = s + above
                    h2 = T.alloc_var("int32", init=T.call_extern("int32", "__ballot_sync", full,
                                                                  T.And(lane < CPL, s >= r)))  # fmt: skip
                    if h2 != 0:  # (always: lane 0's sum >= the first read)
                        cl = 31 - T.call_extern("int32", "__clz", h2)
                        cb = hl * CPL + cl
                        cabove = T.call_extern("int32", "__shfl_sync", full, s - h, cl)
                        f = T.alloc_var("int32", init=T.if_then_else(
                            lane < HSUB, rd(hist_f, cb * HSUB + lane % HSUB, hp, "hist_f"), 0))
                        for d in (1, 2, 4, 8):
                            dn = T.call_extern("int32", "__shfl_down_sync", full, f, d)
                            f = f + T.if_then_else(lane + d < HSUB, dn, 0)
                        h3 = T.alloc_var("int32", init=T.call_extern("int32", "__ballot_sync", full,
                                                                      T.And(lane < HSUB, f + cabove >= r)))  # fmt: skip
                        # no fine bin reaches r (its counts read lower than the coarse one's): the coarse bin's
                        # lowest key, which the coarse counts read (cabove + its own) already bound
                        fb = cb * HSUB + T.if_then_else(h3 != 0, 31 - T.call_extern("int32", "__clz", h3), 0)
                        if out is not None:  # (counts final: a fine bin always reaches r here)
                            at = T.alloc_var("int32", init=T.call_extern(
                                "int32", "__shfl_sync", full, f, T.if_then_else(h3 != 0, 31 - T.call_extern(
                                    "int32", "__clz", h3), 0)))  # fmt: skip
                            if T.And(lane == 0, h3 != 0):
                                st(out, 2, fb)
                                st(out, 3, cabove + at)
                        elif hp is None:
                            if lane == 0:
                                T.evaluate(T.call_extern("int32", "atomicMax", T.address_of(fz[FZ_BETA]),
                                                         T.shift_left(fb - HB // 2, HSHIFT)))  # fmt: skip
                        elif lane == 0:
                            T.evaluate(T.call_extern("int32", "tl_topk_atomic_maxi", hp["fz"], FZ_BETA,
                                                     T.shift_left(fb - HB // 2, HSHIFT)))  # fmt: skip

    return SimpleNamespace(ld=ld, st=st, reserve_push=reserve_push, warp_threshold=warp_threshold)


# l2_ahead: a bulk L2 prefetch of a chunk's bytes by one thread (no registers, no shared memory); fused: volatile
# shared loads / stores of words other warps write without a barrier between
_L2_PREFETCH_PRELUDE = r"""
__device__ __forceinline__ void tl_topk_prefetch_l2(const float* base, int row, int row_len, int off, int bytes) {
  const float* p = base + (long long)row * row_len + off;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}
__device__ __forceinline__ int tl_topk_ld(const int* p) { return *(const volatile int*)p; }
__device__ __forceinline__ void tl_topk_st(int* p, int v) { *(volatile int*)p = v; }
__device__ __forceinline__ void tl_topk_put(int* p, int j, int v) { p[j] = v; }
__device__ __forceinline__ void tl_topk_putv(void* p, int j, int v) { ((int*)p)[j] = v; }
__device__ __forceinline__ int tl_topk_atomic_addv(void* p, int v) { return atomicAdd((int*)p, v); }
__device__ __forceinline__ int tl_topk_ldv(void* p, int j) { return ((int*)p)[j]; }
__device__ __forceinline__ int tl_topk_ldi(void* p, int j) { return ((volatile int*)p)[j]; }
__device__ __forceinline__ void tl_topk_sti(void* p, int j, int v) { ((volatile int*)p)[j] = v; }
__device__ __forceinline__ int tl_topk_atomic_addi(void* p, int j, int v) { return atomicAdd((int*)p + j, v); }
__device__ __forceinline__ int tl_topk_atomic_mini(void* p, int j, int v) { return atomicMin((int*)p + j, v); }
__device__ __forceinline__ int tl_topk_atomic_maxi(void* p, int j, int v) { return atomicMax((int*)p + j, v); }
__device__ __forceinline__ int tl_topk_opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
"""

# (HistConfig.clock) the SM clock, kept in place relative to the memory operations around it
_CLOCK_PRELUDE = r"""
__device__ __forceinline__ int tl_topk_clock() {
  int c;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(c) :: "memory");
  return c;
}
"""


def hist_program(T_: int, C: int, *, k: int, ratio: int = 1, cfg: HistConfig, target: str, has_pos: bool = True):
    """`program` for a HistConfig: the same arguments and output, a histogram bound instead of the group maxima.

    A CTA streams its segment in chunks (the next one fetched during the current one). Every chunk's keys at or
    above the running bound beta are counted in a 12-bit histogram (shared atomics; before the bound rises
    that is the whole first chunk, later only the few keys above it); the fine bin holding rank k of what was
    counted gives beta = that bin's lowest key (a lower bound of the row's k-th key: at least k counted keys are
    >= it), and the chunk's keys >= beta are appended to a shared candidate buffer. On random scores that is
    about k + one bin's share of the first chunk and ~k / j of the j-th. The exact selection (`_make_select`)
    runs once, on the buffer's members >= beta. A buffer that might not hold the next chunk's candidates (the
    bin's count bounds them) is first cut to its exact top-k: beta is then its k-th key + 1 (later chunks
    have higher columns, so a tie with the k-th loses; the buffer's own members keep the histogram's bound),
    which always leaves room for a whole chunk.
    Several segments: each hands on its exact top-k; the last CTA of the row selects from all of them.

    fused (chunks after the first; `_make_fused`): the chunk's keys >= the bound so far are counted and pushed in
    one pass, each thread reserving its room in the buffer as it goes; one barrier; then one warp moves the
    bound (after the barrier, or with fused=2 during the next chunk's pushes). No capacity check before a
    chunk: a thread whose range ends past the buffer writes nothing, the chunk's flag is set, and after the
    barrier the buffer's complete part (below the lowest failed start) is cut to its exact top-k through the
    common cut and only the keys without room are pushed after it, against the cut's k-th key (not + 1: some
    kept keys of this chunk have higher columns). Flags rotate over 3 chunk slots (a slot is reset two
    barriers after its last read)."""
    import tilelang.language as T

    check_config(C, k, cfg)
    ops = _Ops(target == "cpu")
    NT, E, SEG, CH = cfg.threads, cfg.per_thread, cfg.seg, cfg.chunk
    NSEG, NCH = n_segments(C, cfg), cfg.seg // cfg.chunk
    BUF = hist_buffer(C, k, cfg)
    EB, NW = BUF // NT, -(-C // 32)
    sh = scratch_shapes(T_, C, k, cfg)

    select_b = _make_select(ops, NT, EB, True, unroll=False)  # (the buffer stays in shared memory)
    emit = _make_emit(ops, NT, C, k, cfg.ffs, cfg.wscan)
    count, threshold = _make_hist_bound(ops, NT)
    io = _make_row_io(ops, NT, E, NW, EB)
    ld_cg, mark, push, fetch_chunk, chunk_keys = io.ld_cg, io.mark, io.push, io.fetch_chunk, io.chunk_keys
    arrive = io.arrive
    key_c, id_c = io.key_c, io.id_c
    KT = _round_up(k, NT)  # the cut's staging area (it keeps at most k entries)
    helpers = cfg.l2_ahead > 0 or cfg.fused or cfg.rsel or cfg.compact
    prelude = _L2_PREFETCH_PRELUDE if helpers and not ops.cpu else None
    if cfg.clock and not ops.cpu:
        prelude = (prelude or "") + _CLOCK_PRELUDE
    DIAG, FUSED, NWARP = cfg.diag, cfg.fused, NT // 32
    fused = _make_fused(ops, NT, E, BUF, io.warp_reserve)
    put = _make_put(ops)
    OLD_CHUNKS = 1 if FUSED else NCH  # chunks that take the barrier-per-phase path (fused: the first only)
    FAST = bool(cfg.fast) and FUSED > 0  # (fused chunks: raw float bits in kc, float compares, idle warps skip)
    LEAN = FAST and cfg.lean  # (fast chunks: kc is -inf past the limit, no column checks; no max pre-pass)
    # (compact) the final selection's members staged in hist_f: keys at [0, STAGE), ids at [STAGE, 2 STAGE)
    STAGE = min(cfg.compact, HB // 2, BUF) // NT * NT
    COMPACT = cfg.compact > 0 and NSEG == 1 and STAGE > 0
    RSEL = COMPACT and cfg.rsel
    QR = STAGE // NT  # (rsel) staged members a thread holds in registers
    reg_select = _make_reg_select(ops, NT, QR) if RSEL else None
    block_sum, red_total = _make_block_sum(NT)
    EAGER = cfg.eager  # (check_config: one segment a row, C >= a chunk)
    EMIT_REGS = cfg.emit_regs and cfg.ffs and not ops.cpu
    CLOCK = cfg.clock and not ops.cpu  # (the `c` target has no SM clock: there the program is the real one)
    PEEL = cfg.peel  # (check_config: fused=2 lean fast compact, one segment)
    EMIT_WC = cfg.emit_wc and not ops.cpu
    BIN_SEL = cfg.bin_sel and RSEL  # (check_config: with peel)
    emit_wc = _make_emit_wc(NT, C, k) if EMIT_WC else None
    NCLK = len(hist_clock_points(cfg))

    def c0_of(sg, it):  # first column of chunk `it` of segment `sg`
        return sg * SEG + it * CH

    def searching(it, first):  # (fused) whether chunk `it` (>= first) runs the bound's bin search (`search`)
        if cfg.search_at:  # (chunks before `first` have no bin search to run)
            hits = [a for a in cfg.search_at if a >= first]
            if not hits:
                return it < 0  # (never)
            cond = it == hits[0]
            for a in hits[1:]:
                cond = T.Or(cond, it == a)
            return cond
        return it >= first if cfg.search == 1 else T.And(it >= first, (NCH - 1 - it) % cfg.search == 0)

    def at_least(kc, beta):
        return lambda i, j: T.And(kc[i, j] != NONE, kc[i, j] >= beta)

    # (fast) a fused chunk's kc holds the raw float bits: key >= bound and visible <=> x >= the float of
    # max(bound, key(-inf) + 1) (keys are the floats' order; the max keeps -inf and NONE out) and col < lim
    def raw_x(kc, i, j):
        return T.reinterpret(kc[i, j], "float32")

    def bound_x(bound):
        return _tl_unkey(T.max(bound, KEY_NEG_INF + 1))

    def raw_at_least(kc, c0, lim, bound):
        if LEAN:  # (raw_bits put -inf past the limit)
            return lambda i, j: raw_x(kc, i, j) >= bound_x(bound)
        return lambda i, j: T.And(io.col_of(c0, i, j) < lim, raw_x(kc, i, j) >= bound_x(bound))

    def raw_key(kc):  # (of a key that passed raw_at_least: visible, not -inf)
        return lambda i, j: _tl_key(raw_x(kc, i, j))

    def raw_hit(kc, bound):  # (reserve_push's hitx) a thread's floats, and the float of the bound
        return (lambda i, j: raw_x(kc, i, j)), bound_x(bound)

    @T.macro
    def fetch_next(S, t, c0, lim, xr):
        """The next chunk's loads; lean: a wholly visible chunk without the per-float4 limit checks and -inf
        defaults (two code paths: ~20 fewer instructions a chunk)."""
        if LEAN:
            if c0 + CH <= lim:
                for i in ops.par(NT):
                    for j in ops.unroll(E):
                        xr[i, j] = S[t, io.col_of(c0, i, j)]
            else:
                fetch_chunk(S, t, c0, lim, xr)
        else:
            fetch_chunk(S, t, c0, lim, xr)

    @T.macro
    def raw_bits(xr, kc, c0, lim):
        if LEAN:
            if c0 + CH > lim:  # (the chunk that straddles the limit; fetch_chunk reads whole float4s)
                for i in ops.par(NT):
                    for j in ops.unroll(E):
                        kc[i, j] = T.reinterpret(T.if_then_else(io.col_of(c0, i, j) < lim, xr[i, j],
                                                                -T.infinity("float32")), "int32")  # fmt: skip
            else:
                for i in ops.par(NT):
                    for j in ops.unroll(E):
                        kc[i, j] = T.reinterpret(xr[i, j], "int32")
        else:
            for i in ops.par(NT):
                for j in ops.unroll(E):
                    kc[i, j] = T.reinterpret(xr[i, j], "int32")

    @T.macro
    def bin_search(hist_f, hist_c, cum, bc, ra, rb, fz, it, hp=None):
        """(fused) FZ_BETA raised to the bound of the counts so far: one warp (it % NWARP) on the GPU (hp: see
        warp_threshold)."""
        if ops.cpu:
            threshold(hist_f, hist_c, cum, bc, k, ra, rb)
            if bc[2] >= 0:
                fz[FZ_BETA] = T.max(fz[FZ_BETA], T.shift_left(bc[2] - HB // 2, HSHIFT))
        else:
            fused.warp_threshold(hist_f, hist_c, fz, k, it % NWARP, hp)

    def pushed(kc, fl, mode, beta, floor):
        """The chunk keys a push after the chunk's bound (and a cut) takes: mode 1 (the barrier-per-phase path) those
        >= the bounds; mode 2 (fused, after a mid-chunk cut) only those of threads that found no room, against
        floor - 1 (the cut's k-th key, or looser): the kept keys include this chunk's, some at higher columns."""
        def take(i, j):
            bound = T.if_then_else(mode == 2, T.max(beta, floor - 1), T.max(beta, floor))
            return T.And(T.Or(mode != 2, fl[i] == 1), T.And(kc[i, j] != NONE, kc[i, j] >= bound))

        return take

    def raw_pushed(kc, c0, lim, fl, beta, floor):
        """(fast) `pushed` in mode 2 on a fused chunk's raw bits."""
        def take(i, j):
            return T.And(fl[i] == 1, raw_at_least(kc, c0, lim, T.max(beta, floor - 1))(i, j))

        return take

    # the buffer's members, read in shared memory where they are used (not held in registers: the chunk in flight
    # and its keys are what the registers hold): thread i's q-th is entry q * NT + i (`members` NONE-d the others)
    def key_s(bufk):
        return lambda i, q: bufk[q * NT + i]

    def id_s(bufi):
        return lambda i, q: bufi[q * NT + i]

    def take_s(bufk, bufi, st, st2):
        return lambda i, q: _taken(bufk[q * NT + i], bufi[q * NT + i], st, st2)

    # (compact) the final selection's set: the staged members (hist_f: keys, then ids at STAGE; ctl[2] of them) or,
    # when they did not fit, the buffer as `members` left it. Indices clamped: both loads are evaluated.
    def key_u(bufk, stage, staged, ctl):
        def key(i, q):
            e = q * NT + i
            on_stage = T.if_then_else(e < ctl[2], stage[T.min(e, STAGE - 1)], NONE)
            return T.if_then_else(staged == 1, on_stage, bufk[T.min(e, BUF - 1)])

        return key

    def id_u(bufi, stage, staged):
        return lambda i, q: T.if_then_else(staged == 1, stage[STAGE + T.min(q * NT + i, STAGE - 1)],
                                           bufi[T.min(q * NT + i, BUF - 1)])  # fmt: skip

    def key_r(rk):
        return lambda i, q: rk[i, q]

    def id_r(ri):
        return lambda i, q: ri[i, q]

    def take_u(bufk, bufi, stage, staged, ctl, st, st2):
        return lambda i, q: _taken(key_u(bufk, stage, staged, ctl)(i, q), id_u(bufi, stage, staged)(i, q), st, st2)

    @T.macro
    def stage_members(bufk, bufi, ctl, beta, stage, tmp):
        """(compact) the buffer's members (its ctl[0] entries >= beta) to the stage: keys at [0, M), ids at
        [STAGE, STAGE + M); ctl[2] = M. A thread whose range would end past STAGE writes nothing (M > STAGE then:
        the caller selects on the buffer). hist_f is free here: the last bound was found before the last chunk.
        Every thread runs both loops (no branch around them) and the stage's stores are `put`s: a store TileLang's
        sync planner saw here got a barrier in every iteration of the loop -- inside the per-thread `fits` branch
        (a divergent __syncthreads on heavy ties, where some threads' ranges end past STAGE)."""
        for _z in ops.par(1):
            ctl[2] = 0
        ops.barrier()  # (ctl[0] may come from atomics; ctl[2] is reserved with atomics next)
        for i in ops.par(NT):
            nb = T.alloc_var("int32", init=ctl[0])
            nq = T.alloc_var("int32", init=T.min((nb + NT - 1) // NT, EB))
            low = T.alloc_var("int32", init=T.max(beta, NONE + 1))
            n = T.alloc_var("int32", init=0)
            for q in T.serial(nq):
                if T.And(q * NT + i < nb, bufk[q * NT + i] >= low):
                    n = n + 1
            if ops.cpu:
                io.atomic_add_ret(ctl, 2, n, tmp)
            else:
                io.warp_reserve(ctl, 2, n, i % 32, tmp)
            p = T.alloc_var("int32", init=tmp[0])
            fits = T.alloc_var("int32", init=T.if_then_else(p + n <= STAGE, 1, 0))
            for q in T.serial(nq):
                kq = T.alloc_var("int32", init=bufk[q * NT + i])
                if T.And(fits == 1, T.And(q * NT + i < nb, kq >= low)):
                    put(stage, T.min(p, STAGE - 1), kq)
                    put(stage, STAGE + T.min(p, STAGE - 1), bufi[q * NT + i])
                    p = p + 1
        ops.barrier()

    @T.macro
    def members(bufk, nb, beta, nq):
        """NONE in the buffer past its nb entries and below beta (not in the top-k): the selection reads single
        loads (small programs) and sees only members. Opaque barrier: nb may be ctl[0], just written by one thread.
        nq: the q's visited (EB, or with trim the nb entries' ceil(nb / NT): later ones are never read)."""
        ops.barrier()
        for i in ops.par(NT):
            for q in T.serial(nq):  # (plain loops over the buffer here and below: unrolled, their loads cost registers)
                if T.Or(q * NT + i >= nb, bufk[q * NT + i] < beta):
                    bufk[q * NT + i] = NONE
        ops.sync()

    @T.macro
    def prefetch_l2(S, t, sg, it, lim):
        """(l2_ahead, GPU) chunk `it` of the segment into L2: HBM requests in flight beyond the register chunk."""
        if not ops.cpu and cfg.l2_ahead > 0 and NCH > 1:
            # thread 0 by its index, the scores by their base, row and offset: in a T.Parallel loop, the layout
            # inference of `address_of(S[t, 0])` failed at C = 32768 ("Can't fetch the lanes of a scalable
            # vector", T64 decode), and without a buffer access the loop is not bound to the threads
            if T.And(T.get_thread_binding(0) == 0, T.And(it < NCH, c0_of(sg, it) < lim)):
                n = T.min(CH, lim - c0_of(sg, it))  # (rounded up to float4s: within the row, C % 4 == 0)
                T.evaluate(T.call_extern("handle", "tl_topk_prefetch_l2", S.data, t, C, c0_of(sg, it),
                                         (n + 3) // 4 * 16))  # fmt: skip

    @T.macro
    def keep(bufk, bufi, st, st2, tk, ti, ctl, rc, tmp, nq):
        """Cut the buffer to the selected members: through the staging area to its front; ctl[0] = their count."""
        ops.sync()
        for _z in ops.par(1):
            ctl[1] = 0
        push(tk, ti, 0, ctl, 1, key_s(bufk), id_s(bufi), take_s(bufk, bufi, st, st2), nq, rc, tmp, unroll=False)
        for e in ops.par(KT):
            if e < ctl[1]:
                bufk[e] = tk[e]
                bufi[e] = ti[e]
        for _z in ops.par(1):
            ctl[0] = ctl[1]
        ops.barrier()  # (every thread reads the count next; TileLang's planner dropped a plain barrier here)

    @T.macro
    def hand_on(bufk, bufi, ctl, bc, CKey, CIdx, CCnt, Arrive, t, sg):
        """(several segments) the segment's top-k (the buffer's ctl[0] entries) to the scratch slot, then the
        row's arrival: bc[2] = how many segments arrived before this one."""
        nb = ctl[0]
        for i in ops.par(NT):
            for q in T.serial(EB):
                if q * NT + i < T.min(nb, k):
                    CKey[(t * NSEG + sg) * k + q * NT + i] = bufk[q * NT + i]
                    CIdx[(t * NSEG + sg) * k + q * NT + i] = bufi[q * NT + i]
        arrive(CCnt, Arrive, bc, t * NSEG + sg, t, nb)

    @T.macro
    def load_segments(bufk, bufi, ctl, CKey, CIdx, CCnt, Arrive, t, nlive):
        """(the row's last CTA) every live segment's set into the buffer, NONE-padded to k each (L2 reads: other
        CTAs wrote them during this kernel; the dead segments' slots are stale); the arrival counter reset."""
        for i in ops.par(NT):
            for q in T.serial(-(-NSEG * k // NT)):
                e = q * NT + i
                if e < NSEG * k:
                    ok = T.And(e // k < nlive, (e % k) < ld_cg(CCnt, t * NSEG + e // k))
                    bufk[e] = T.if_then_else(ok, ld_cg(CKey, t * NSEG * k + e), NONE)
                    bufi[e] = T.if_then_else(ok, ld_cg(CIdx, t * NSEG * k + e), 0)
        for _z in ops.par(1):
            ctl[0] = NSEG * k
            Arrive[t] = 0
        ops.barrier()

    @T.macro
    def tick(clk, n):
        """(clock) every thread keeps the SM clock as checkpoint n in its own array (local memory: no shared
        access the sync planner would fence, no buffer its storage planner could alias); thread 0's are written out."""
        if CLOCK:
            clk[n] = T.call_extern("int32", "tl_topk_clock")

    def row_limit(Pos, t):  # row t's visible columns
        return T.min((Pos[t] + 1) // ratio, C) if has_pos else C

    @T.prim_func
    def topk_select_hist(
        S: T.Tensor((T_, C), "float32"),
        Pos: T.Tensor((T_,), "int32"),
        Idx: T.Tensor((T_, k), "int32"),
        CKey: T.Tensor(sh["CKey"], "int32"),
        CIdx: T.Tensor(sh["CIdx"], "int32"),
        CCnt: T.Tensor(sh["CCnt"], "int32"),
        Arrive: T.Tensor(sh["Arrive"], "int32"),
    ):
        with T.Kernel(NSEG, T_, threads=NT, prelude=prelude) as (sg, t):
            if cfg.min_blocks > 0 and not ops.cpu:
                T.annotate_min_blocks_per_sm(cfg.min_blocks)
            hist_f = ops.sh((HB,), "int32")
            hist_c = ops.sh((NB,), "int32")
            hist, cum, bc, ctl, bitmap, wcnt, wbase, ra, rb, rc, r1 = _select_workspace(ops, NT, NW, 8)
            bufk = ops.sh((BUF,), "int32")
            bufi = ops.sh((BUF,), "int32")
            stb = T.alloc_local((4,), "int32")
            stb2 = T.alloc_local((4,), "int32")
            tmp = T.alloc_local((1,), "int32")
            xr = ops.fr((NT, E), "float32")
            kc = ops.fr((NT, E), "int32")
            tk = ops.sh((KT,), "int32")
            ti = ops.sh((KT,), "int32")
            lim = T.alloc_var("int32", init=C)
            beta = T.alloc_var("int32", init=NONE)  # the histogram's bound: keys below it are not in the top-k
            floor = T.alloc_var("int32", init=NONE)  # the last cut's k-th key + 1: later columns need at least it
            cut = T.alloc_var("int32", init=0)
            cuts = T.alloc_var("int32", init=0)  # (peel) 1: an overflow cut ran (the counts are then no member count)
            mode = T.alloc_var("int32", init=1)  # this chunk's push: 1 (of the old path) or 2 (fused: the overflow)
            staged = T.alloc_var("int32", init=0)  # (compact) 1: the final selection's members are in hist_f
            nsel = T.alloc_var("int32", init=EB)  # (compact) the q's the final selection visits
            fz = ops.sh((FZ_SIZE,), "int32")  # (fused) the chunk overflow flags / failed starts, the warp's bound
            padb = ops.sh((max(cfg.smem_pad, 1),), "int32") if cfg.smem_pad else None  # (probe smem_pad)
            fl = ops.fr((NT,), "int32")  # (fused) 1: this thread's keys of the chunk found no room
            fm = ops.fr((NT,), "int32")  # (lean) the chunk's keys at the bound, a bit each
            wv = ops.fr((NT, -(-NW // NT)), "int32") if EMIT_REGS else None  # (emit_regs) a thread's output words
            if EMIT_WC:  # (emit_wc) a thread's output words and their offsets in the warp's stretch
                wv = ops.fr((NT, _round_up(-(-NW // max(NT // 32, 1)), 32) // 32), "int32")
                wo = ops.fr((NT, _round_up(-(-NW // max(NT // 32, 1)), 32) // 32), "int32")
            clk = T.alloc_local((NCLK,), "int32") if CLOCK else None  # (clock) the checkpoints' clocks
            tick(clk, 0)
            if RSEL:  # (rsel) the staged members in registers
                rk = ops.fr((NT, QR), "int32")
                ri = ops.fr((NT, QR), "int32")
            # (several segments a row) the live ones: those with a visible column (at least one: it writes a row
            # without any); the others skip their selection and hand nothing on, the live ones merge only the live
            # slots (a loop extent or branch around the row for the dead ones broke TileLang's loop unswitching /
            # Python's block nesting limit)
            if NSEG > 1:  # (a variable: as an expression, TileLang's loop unswitching broke the merge's L2 reads)
                nlive = T.alloc_var("int32", init=T.max(T.min((row_limit(Pos, t) + SEG - 1) // SEG, NSEG), 1))
            else:
                nlive = 1
            last = T.alloc_var("int32", init=T.if_then_else(T.And(nlive == 1, sg == 0), 1, 0))  # it finishes the row
            if EAGER:  # the first chunk whole, unpredicated, before the limit is known: chunk_keys masks it
                for i in ops.par(NT):
                    for j in ops.unroll(E):
                        xr[i, j] = S[t, io.col_of(0, i, j)]
            lim = row_limit(Pos, t)
            for u in T.serial(4):
                stb[u] = 0
                stb2[u] = NONE
            for b in ops.par(HB):
                hist_f[b] = 0
            for b in ops.par(NB):
                hist_c[b] = 0
            if cfg.smem_pad:  # (probe) written here, read at the end: live throughout
                for b in ops.par(cfg.smem_pad):
                    padb[b] = 0
            for _z in ops.par(1):
                ctl[0] = 0
                for u in T.serial(3):
                    fz[FZ_FLAG + u] = 0
                    fz[FZ_MINF + u] = INT_MAX
                fz[FZ_BETA] = NONE
            for i in ops.par(NT):
                fl[i] = 0
                if DIAG in ("read", HIST_DIAG_FIRST):
                    rc[i] = NONE
            ops.barrier()  # (shared atomics next)
            tick(clk, 1)
            if not EAGER:  # (eager: its loads were issued before the limit and the workspace)
                if c0_of(sg, 0) < lim:  # the first chunk in flight; each later one is fetched a chunk ahead
                    fetch_chunk(S, t, c0_of(sg, 0), lim, xr)
            if cfg.l2_ahead > 0 and NCH > 1:
                for a in T.serial(min(cfg.l2_ahead, NCH - 1)):
                    prefetch_l2(S, t, sg, a + 1, lim)
            if PEEL:
                # (peel, static) the first chunk before the loop, the loop over the fused chunks only: TileLang's
                # sync planner hoisted the first chunk's and the overflow cut's barriers into every fused chunk
                # (5 a chunk, 1 needed). The first chunk never cuts: at most a chunk's keys into an empty buffer
                hp = None  # (peel 2, GPU) the chunks' shared accesses through pointer handles: TileLang's sync planner
                # then sees no access of theirs, and the rare cut's writes are no loop-carried conflict (its
                # planner treats every shared buffer as one and a pointer access as touching all of it)
                if cfg.peel == 2 and not ops.cpu:
                    hk = T.address_of(bufk[0])  # (each bound to a variable here, not inlined into the loop)
                    hi = T.address_of(bufi[0])
                    hc = T.address_of(ctl[0])
                    hz = T.address_of(fz[0])
                    hf = T.address_of(hist_f[0])
                    hcs = T.address_of(hist_c[0])
                    hp = {"bufk": hk, "bufi": hi, "ctl": hc, "fz": hz, "hist_f": hf, "hist_c": hcs}
                hz_ = None if hp is None else hp["fz"]
                if c0_of(sg, 0) < lim:
                    chunk_keys(c0_of(sg, 0), lim, xr, kc)
                    if NCH > 1 + cfg.l2_ahead:  # (l2_ahead: chunks 1 .. l2_ahead were prefetched before)
                        prefetch_l2(S, t, sg, 1 + cfg.l2_ahead, lim)
                    if NCH > 1:
                        if c0_of(sg, 1) < lim:
                            fetch_next(S, t, c0_of(sg, 1), lim, xr)
                    count(hist_f, hist_c, key_c(kc), E, beta)
                    ops.barrier()
                    if cfg.warp_first:  # one warp's bin search (FZ_BETA), not the CTA's threshold (~8 barriers)
                        bin_search(hist_f, hist_c, cum, bc, ra, rb, fz, 0, hp)
                        ops.barrier()
                        beta = T.max(beta, fused.ld(fz, FZ_BETA, hz_))
                    else:
                        threshold(hist_f, hist_c, cum, bc, k, ra, rb)
                        if bc[2] >= 0:  # the bin's lowest key
                            beta = T.max(beta, T.shift_left(bc[2] - HB // 2, HSHIFT))
                    if cfg.peel == 2:  # as a fused chunk pushes: no barrier inside, none the planner adds
                        fused.reserve_push(bufk, bufi, ctl, fz, 0, key_c(kc), id_c(c0_of(sg, 0)),
                                           at_least(kc, T.max(beta, floor)), fl, tmp, None, None, None, fm, hp)
                        ops.barrier()  # (before chunk 1's reservations: no chunk-0 range may land past the buffer)
                    else:
                        push(bufk, bufi, 0, ctl, 0, key_c(kc), id_c(c0_of(sg, 0)), pushed(kc, fl, 1, beta, floor),
                             E, rc, tmp, lead=not cfg.warp_first)  # fmt: skip
                tick(clk, 2)
                for it in T.serial(1, NCH):
                    if c0_of(sg, it) < lim:
                        c0 = c0_of(sg, it)
                        raw_bits(xr, kc, c0, lim)
                        if NCH > 1 + cfg.l2_ahead:
                            prefetch_l2(S, t, sg, it + 1 + cfg.l2_ahead, lim)
                        if T.And(it + 1 < NCH, c0_of(sg, it + 1) < lim):
                            fetch_next(S, t, c0_of(sg, it + 1), lim, xr)
                        if searching(it, 2):  # (fused=2) the previous chunk's bin search during this one's pushes
                            bin_search(hist_f, hist_c, cum, bc, ra, rb, fz, it - 1, hp)
                        beta = T.max(beta, fused.ld(fz, FZ_BETA, hz_))
                        for _z in ops.par(1):  # chunk it + 1's flags (all read them 2 barriers ago)
                            fused.st(fz, FZ_FLAG + (it + 1) % 3, 0, hz_)
                            fused.st(fz, FZ_MINF + (it + 1) % 3, INT_MAX, hz_)
                        fused.reserve_push(bufk, bufi, ctl, fz, it % 3, raw_key(kc), id_c(c0),
                                           raw_at_least(kc, c0, lim, T.max(beta, floor)), fl, tmp, hist_f, hist_c,
                                           None, fm, hp)  # fmt: skip
                        if cfg.peel == 1:
                            ops.barrier()  # (the chunk's barrier; the planner adds one at the loop top)
                        else:  # (the chunk's one barrier: TileLang's planner drops a T.sync_threads it sees no need
                            # for, and puts its own right here -- the rare cut's writes are a loop-carried conflict
                            # for it and nothing before in the loop body is an access it sees;
                            # seen in the lowered sm90 CUDA, session 12: peel 2 was not taken, no test pins it)
                            ops.sync()
                        if cfg.xbar:  # (probe) what a barrier more costs
                            for _x in T.serial(cfg.xbar):
                                ops.barrier()
                        if fused.ld(fz, FZ_FLAG + it % 3, hz_) != 0:  # (rare: ties; CTA-uniform) no room for some keys:
                            # the buffer's complete part (below the lowest failed start) cut to its top-k, then the
                            # keys without room pushed against its k-th key (`pushed` mode 2). The complete part's
                            # size is read from FZ_MINF (no ctl[0] store: one the planner sees here got a barrier
                            # before the branch); keep sets ctl[0]
                            cuts = 1
                            members(bufk, fused.ld(fz, FZ_MINF + it % 3, hz_), beta, EB)
                            select_b(key_s(bufk), id_s(bufi), k, stb, stb2, hist, cum, bc, ra, rb, rc, r1)
                            keep(bufk, bufi, stb, stb2, tk, ti, ctl, rc, tmp, EB)
                            if stb[3] == k:  # later columns tied with the k-th key lose to it
                                floor = stb[0] + 1
                            push(bufk, bufi, 0, ctl, 0, raw_key(kc), id_c(c0), raw_pushed(kc, c0, lim, fl, beta, floor),
                                 E, rc, tmp)  # fmt: skip
                    tick(clk, 2 + it)
            else:
                # iterations: the chunks, the segment's selection (compact: after the loop), (several segments, the
                # row's last CTA) the merge
                for it in T.serial(NCH + (0 if COMPACT else (1 if NSEG == 1 else 2))):
                    cut = 0
                    mode = 1
                    if it < NCH:
                        if c0_of(sg, it) < lim:
                            if not FAST:
                                chunk_keys(c0_of(sg, it), lim, xr, kc)
                            elif it < OLD_CHUNKS:
                                chunk_keys(c0_of(sg, it), lim, xr, kc)
                            else:  # (fast) no key conversion: the bits, compared as floats
                                raw_bits(xr, kc, c0_of(sg, it), lim)
                            if NCH > 1 + cfg.l2_ahead:  # (a prefetch never in range failed to lower: "handle vs int32")
                                prefetch_l2(S, t, sg, it + 1 + cfg.l2_ahead, lim)
                            if NCH > 1:  # the next chunk's loads fly while this one is counted and pushed
                                if T.And(it + 1 < NCH, c0_of(sg, it + 1) < lim):
                                    fetch_next(S, t, c0_of(sg, it + 1), lim, xr)
                            if DIAG == "read":  # (diagnostics) the keys' per-thread max only
                                for i in ops.par(NT):
                                    for j in ops.unroll(E):
                                        rc[i] = T.max(rc[i], kc[i, j])
                            else:
                                if it < OLD_CHUNKS:
                                    count(hist_f, hist_c, key_c(kc), E, T.max(beta, floor))
                                    ops.barrier()
                                    threshold(hist_f, hist_c, cum, bc, k, ra, rb)
                                    if bc[2] >= 0:
                                        # the bin's lowest key
                                        beta = T.max(beta, T.shift_left(bc[2] - HB // 2, HSHIFT))
                                    # this chunk's candidates are counted keys of bins >= bc[2]: at most bc[3]
                                    if ctl[0] + T.min(bc[3], T.min(CH, lim - c0_of(sg, it))) > BUF:
                                        cut = 1
                                if FUSED:  # one barrier: count and push at the bound so far, then one warp raises it
                                    if it >= OLD_CHUNKS:
                                        if FUSED == 2:  # the previous chunk's bin search overlaps this chunk's pushes
                                            if searching(it, OLD_CHUNKS + 1):
                                                bin_search(hist_f, hist_c, cum, bc, ra, rb, fz, it - 1)
                                        beta = T.max(beta, fused.ld(fz, FZ_BETA))
                                        for _z in ops.par(1):  # chunk it + 1's flags (all read them 2 barriers ago)
                                            fused.st(fz, FZ_FLAG + (it + 1) % 3, 0)
                                            fused.st(fz, FZ_MINF + (it + 1) % 3, INT_MAX)
                                        if DIAG == "count":
                                            count(hist_f, hist_c, key_c(kc), E, T.max(beta, floor))
                                        elif DIAG == HIST_DIAG_FIRST:  # (diagnostics) the later chunks read only
                                            for i in ops.par(NT):
                                                for j in ops.unroll(E):
                                                    rc[i] = T.max(rc[i], kc[i, j])
                                        elif FAST:
                                            c0, bnd = c0_of(sg, it), T.max(beta, floor)
                                            fused.reserve_push(bufk, bufi, ctl, fz, it % 3, raw_key(kc), id_c(c0),
                                                               raw_at_least(kc, c0, lim, bnd), fl, tmp, hist_f, hist_c,
                                                               None if LEAN else raw_hit(kc, bnd),
                                                               fm if LEAN else None)  # fmt: skip
                                        else:  # (the keys without room are not counted: a looser bound, rare)
                                            fused.reserve_push(bufk, bufi, ctl, fz, it % 3, key_c(kc),
                                                               id_c(c0_of(sg, it)), at_least(kc, T.max(beta, floor)),
                                                               fl, tmp,
                                                               hist_f, hist_c)  # fmt: skip
                                        ops.barrier()
                                        if cfg.xbar:  # (probe) what a barrier more costs
                                            for _x in T.serial(cfg.xbar):
                                                ops.barrier()
                                        if fused.ld(fz, FZ_FLAG + it % 3) != 0:  # (rare: ties) no room for some keys
                                            # the buffer's complete part (below the lowest failed start) is cut below,
                                            # then the keys without room pushed (mode 2)
                                            for _z in ops.par(1):
                                                ctl[0] = fused.ld(fz, FZ_MINF + it % 3)
                                            cut = 1
                                            mode = 2
                                        elif FUSED == 1:
                                            if searching(it, OLD_CHUNKS):
                                                bin_search(hist_f, hist_c, cum, bc, ra, rb, fz, it)
                    elif it == NCH:  # (a dead segment: nothing to select or hand on)
                        cut = T.if_then_else(sg < nlive, 1, 0) if DIAG in ("", HIST_DIAG_SELECT) else 0
                    if NSEG > 1:  # (a static branch: no merge code in one-segment programs)
                        if T.And(it == NCH + 1, T.And(last == 1, nlive > 1)):
                            load_segments(bufk, bufi, ctl, CKey, CIdx, CCnt, Arrive, t, nlive)
                            beta = NONE
                            floor = NONE
                            cut = 1
                    if cut == 1:  # the exact top-k of the buffer's members
                        if cfg.trim:  # (after a barrier: ctl[0] may come from atomics or one thread)
                            ops.barrier()
                        # the buffer's q's the selection visits (trim: its entries' only; not live across the chunks)
                        nqv = T.alloc_var("int32", init=T.min((ctl[0] + NT - 1) // NT, EB))
                        members(bufk, ctl[0], beta, nqv if cfg.trim else EB)
                        select_b(key_s(bufk), id_s(bufi), k, stb, stb2, hist, cum, bc, ra, rb, rc, r1,
                                 nqv if cfg.trim else None)  # fmt: skip
                        if T.Or(it < NCH, T.And(nlive > 1, it == NCH)):  # kept: the buffer cut to it
                            keep(bufk, bufi, stb, stb2, tk, ti, ctl, rc, tmp, nqv if cfg.trim else EB)
                            if stb[3] == k:  # later columns tied with the k-th key lose to it
                                floor = stb[0] + 1
                        if NSEG > 1:
                            if T.And(it == NCH, nlive > 1):
                                hand_on(bufk, bufi, ctl, bc, CKey, CIdx, CCnt, Arrive, t, sg)
                                if bc[2] == nlive - 1:
                                    last = 1
                    if DIAG in ("", "push", HIST_DIAG_FIRST, HIST_DIAG_SELECT):
                        if not FAST:
                            if T.And(T.Or(it < OLD_CHUNKS, mode == 2), c0_of(sg, it) < lim):
                                push(bufk, bufi, 0, ctl, 0, key_c(kc), id_c(c0_of(sg, it)),
                                     pushed(kc, fl, mode, beta, floor), E, rc, tmp)  # fmt: skip
                        elif T.And(it < OLD_CHUNKS, c0_of(sg, it) < lim):
                            push(bufk, bufi, 0, ctl, 0, key_c(kc), id_c(c0_of(sg, it)),
                                 pushed(kc, fl, mode, beta, floor), E, rc, tmp)  # fmt: skip
                        elif T.And(mode == 2, c0_of(sg, it) < lim):  # (fast: a fused chunk's raw bits)
                            push(bufk, bufi, 0, ctl, 0, raw_key(kc), id_c(c0_of(sg, it)),
                                 raw_pushed(kc, c0_of(sg, it), lim, fl, beta, floor), E, rc, tmp)  # fmt: skip
                    tick(clk, 2 + it)
            if COMPACT and DIAG in ("", HIST_DIAG_SELECT):  # the final selection, after the chunk loop
                ini = None
                if BIN_SEL:  # the fine bin holding rank k of the final counts: bc[2] (-1: fewer), bc[3] at and above it
                    if ops.cpu:
                        threshold(hist_f, hist_c, cum, bc, k, ra, rb)
                    else:
                        fused.warp_threshold(hist_f, hist_c, fz, k, 0, None, bc)
                        ops.barrier()
                    fbin = T.alloc_var("int32", init=fused.ld(bc, 2))
                    bsel = T.alloc_var("int32", init=T.if_then_else(T.And(fbin >= 0, cuts == 0), 1, 0))
                    lo0 = T.alloc_var("int32", init=T.shift_left(T.max(fbin, 0) - HB // 2, HSHIFT))
                    r0 = T.alloc_var("int32", init=k - fused.ld(bc, 3) + hist_f[T.max(fbin, 0)])  # (before the stage)
                    beta = T.if_then_else(bsel == 1, lo0, beta)
                    ini = (bsel == 1, lo0, lo0 + ((1 << HSHIFT) - 1), r0)
                stage_members(bufk, bufi, ctl, beta, hist_f, tmp)
                tick(clk, NCLK - 4)
                if ctl[2] <= STAGE:
                    staged = 1
                    nsel = (ctl[2] + NT - 1) // NT
                    if RSEL:  # the members into registers; hist_f is then the selection's two histograms
                        for i in ops.par(NT):
                            for q in ops.unroll(QR):
                                rk[i, q] = T.if_then_else(q * NT + i < ctl[2], hist_f[q * NT + i], NONE)
                                ri[i, q] = hist_f[STAGE + q * NT + i]
                        ops.barrier()
                        reg_select(key_r(rk), id_r(ri), k, stb, stb2, hist_f, cum, bc, ra, rb, rc, ini)
                else:  # (heavy ties) in the buffer as before
                    nsel = T.min((ctl[0] + NT - 1) // NT, EB) if cfg.trim else EB
                    members(bufk, ctl[0], beta, nsel)
                if not RSEL:
                    select_b(key_u(bufk, hist_f, staged, ctl), id_u(bufi, hist_f, staged), k, stb, stb2, hist, cum,
                             bc, ra, rb, rc, r1, nsel)  # fmt: skip
                elif staged == 0:
                    select_b(key_u(bufk, hist_f, staged, ctl), id_u(bufi, hist_f, staged), k, stb, stb2, hist, cum,
                             bc, ra, rb, rc, r1, nsel)  # fmt: skip
                tick(clk, NCLK - 3)
            if DIAG == "read":  # (diagnostics) something the stage computed, so that none of it is dead code
                for i in ops.par(NT):
                    if i < k:
                        Idx[t, i] = rc[i]
            elif DIAG == HIST_DIAG_SELECT:  # the selection's results only
                for i in ops.par(NT):
                    if i < k:
                        Idx[t, i] = T.if_then_else(i == 0, stb[0], T.if_then_else(i == 1, stb[3], stb2[0]))
            elif DIAG == HIST_DIAG_FIRST:
                for i in ops.par(NT):
                    if i < k:
                        Idx[t, i] = T.if_then_else(i == 0, ctl[0], T.max(rc[i], beta))
            elif DIAG != "":
                for i in ops.par(NT):
                    if i < k:
                        Idx[t, i] = T.if_then_else(i == 0, ctl[0], beta)
            elif last == 1:
                if RSEL:
                    if staged == 1:
                        mark(bitmap, id_r(ri), lambda i, q: _taken(rk[i, q], ri[i, q], stb, stb2), QR)
                    else:
                        mark(bitmap, id_u(bufi, hist_f, staged), take_u(bufk, bufi, hist_f, staged, ctl, stb, stb2),
                             nsel, unroll=False)  # fmt: skip
                elif COMPACT:  # (nsel: the q's the final selection visited, staged or in the buffer)
                    mark(bitmap, id_u(bufi, hist_f, staged), take_u(bufk, bufi, hist_f, staged, ctl, stb, stb2),
                         nsel, unroll=False)  # fmt: skip
                else:
                    nqm = T.alloc_var("int32", init=T.min((ctl[0] + NT - 1) // NT, EB))  # (the last cut's buffer)
                    mark(bitmap, id_s(bufi), take_s(bufk, bufi, stb, stb2), nqm if cfg.trim else EB, unroll=False)
                tick(clk, NCLK - 2)
                if EMIT_WC:
                    emit_wc(bitmap, wcnt, Idx, t, stb[3], wv, wo)
                else:
                    emit(bitmap, wcnt, wbase, Idx, t, stb[3], wv)
                if cfg.smem_pad:  # (probe: never true -- the pad is zero)
                    for i in ops.par(NT):
                        if T.And(i == 0, padb[cfg.smem_pad - 1] != 0):
                            Idx[t, 0] = -7
                if CLOCK:  # (after every thread's output stores: thread 0's clocks replace the first entries)
                    tick(clk, NCLK - 1)
                    ops.barrier()
                    if T.get_thread_binding(0) == 0:
                        for u in T.serial(NCLK):
                            Idx[t, u] = clk[u] - clk[0]

    return topk_select_hist


# ---------------------------------------------------------------------------------------------- triton

TRITON_MAX_BLOCK = 16384  # scores one Triton program holds in registers


@dataclass(frozen=True)
class TritonConfig:
    """Triton variant: `seg` columns per program (power of two), group-max filter with `group`, up to `cap`
    candidates per segment (power of two, >= k), `warps` warps."""

    seg: int = 16384
    filter: bool = True
    group: int = 16
    cap: int = 2048
    warps: int = 16

    @property
    def tag(self) -> str:
        return f"s{self.seg}{'f' + str(self.group) if self.filter else 'x'}c{self.cap}w{self.warps}"


def triton_check_config(C: int, k: int, cfg: TritonConfig) -> None:
    nseg = -(-C // cfg.seg)
    assert cfg.seg & (cfg.seg - 1) == 0 and cfg.cap & (cfg.cap - 1) == 0, "seg and cap must be powers of two"
    assert cfg.seg <= TRITON_MAX_BLOCK and k <= cfg.cap, (cfg, k)
    assert not cfg.filter or cfg.seg // cfg.group >= 2 * k, "filter needs at least 2k groups per segment"
    assert nseg == 1 or nseg * cfg.cap <= TRITON_MAX_BLOCK, "the last program holds nseg * cap candidates"


def triton_default_config(T_: int, C: int, k: int = 512, sms: int = 132) -> TritonConfig:
    """One program per row when the row fits and there are enough rows; else segments covering the GPU."""
    seg = min(TRITON_MAX_BLOCK, max(1 << (C - 1).bit_length(), 1024))
    while seg > 2048 and T_ * -(-C // seg) < 2 * sms:
        seg //= 2
    nseg = -(-C // seg)
    cap = 1 << max(k - 1, 1).bit_length()
    filt = seg // 16 >= 2 * k
    if filt:
        cap = max(cap, 2048)
    while nseg > 1 and nseg * cap > TRITON_MAX_BLOCK and cap > k:
        cap //= 2
    while nseg > 1 and nseg * cap > TRITON_MAX_BLOCK:  # too many segments for one merge: longer segments
        seg *= 2
        nseg = -(-C // seg)
        filt = seg // 16 >= 2 * k
    return TritonConfig(seg, filt, 16, cap, 16 if seg >= 8192 else (8 if seg >= 4096 else 4))


if triton is not None:

    @triton.jit
    def _key(x):
        """Order-preserving int32 image of an fp32 (-0.0 and +0.0 map to the same key)."""
        b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)

    @triton.jit
    def _unkey(k):
        b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _threshold(x, keff, nvalid):
        """Largest t with #(x >= t) >= keff (t is then the keff-th largest x), found by bisection on the int32
        key between the smallest valid and the largest x; stops early when exactly keff scores are >= t.
        Returns (t, #(x >= t)). Needs 1 <= keff <= nvalid; -inf entries are never counted."""
        lo = _key(tl.min(tl.where(x > float("-inf"), x, float("inf")), axis=0))
        hi = _key(tl.max(x, axis=0))
        cnt = nvalid
        while (lo < hi) & (cnt > keff):
            mid = ((lo.to(tl.int64) + hi.to(tl.int64) + 1) >> 1).to(tl.int32)
            c = tl.sum((x >= _unkey(mid)).to(tl.int32), axis=0)
            take = c >= keff
            hi = tl.where(take, hi, mid - 1)
            lo = tl.where(take, mid, lo)
            cnt = tl.where(take, c, cnt)
        return _unkey(lo), cnt

    @triton.jit
    def _select(x, keff, nvalid):
        """(sel, pos): the keff largest x (ties to the lower position) and their exclusive rank in position
        order. Positions past the selection are meaningless. keff may be 0 (nothing selected)."""
        t, cnt = _threshold(x, tl.maximum(keff, 1), nvalid)
        t = tl.where(keff == 0, float("inf"), t)
        gt = x > t
        eq = x == t
        need = keff - tl.sum(gt.to(tl.int32), axis=0)
        packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)  # both counts < 2^15 (<= TRITON_MAX_BLOCK)
        before = tl.cumsum(packed, axis=0) - packed
        ties_before = before >> 16
        sel = gt | (eq & (ties_before < need))
        pos = (before & 0xFFFF) + tl.minimum(ties_before, need)
        return sel, pos

    @triton.jit
    def _write(x, ids, out_row, K: tl.constexpr):
        """Select the top-K of x (carrying ids) into out_row[0:K] in position order, -1 padding."""
        nvalid = tl.sum((x > float("-inf")).to(tl.int32), axis=0)
        keff = tl.minimum(nvalid, K)
        sel, pos = _select(x, keff, nvalid)
        tl.store(out_row + pos, ids, mask=sel)
        p = tl.arange(0, K)
        tl.store(out_row + p, tl.full([K], -1, tl.int32), mask=p >= keff)

    @triton.jit
    def _topk_kernel(
        S, stride_s, Pos, Out, CKey, CIdx, CCnt, Count, n_cols, ratio,
        K: tl.constexpr, SEG: tl.constexpr, NSEG: tl.constexpr, HAS_POS: tl.constexpr, FILTER: tl.constexpr,
        G: tl.constexpr, CAP: tl.constexpr, MB: tl.constexpr,
    ):  # fmt: skip
        seg = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        lim = n_cols
        if HAS_POS:
            lim = tl.minimum((tl.load(Pos + row) + 1) // ratio, n_cols)
        offs = seg * SEG + tl.arange(0, SEG)
        x = tl.load(S + row * stride_s + offs, mask=offs < lim, other=float("-inf"), eviction_policy="evict_first")
        if NSEG == 1 and not FILTER:
            _write(x, offs, Out + row * K, K)
        else:
            nvalid = tl.sum((x > float("-inf")).to(tl.int32), axis=0)
            if FILTER:
                gmax = tl.max(tl.reshape(x, (SEG // G, G)), axis=1)
                nvg = tl.sum((gmax > float("-inf")).to(tl.int32), axis=0)
                if nvg >= K:  # L = the K-th largest group maximum
                    lower, _ = _threshold(gmax, K, nvg)
                    cand = x >= lower
                else:
                    cand = x > float("-inf")
                m = tl.sum(cand.to(tl.int32), axis=0)
                if m <= CAP:
                    pos = tl.cumsum(cand.to(tl.int32), axis=0) - cand.to(tl.int32)
                else:  # too many candidates: hand on the exact local top-k instead
                    m = tl.minimum(nvalid, K)
                    cand, pos = _select(x, m, nvalid)
            else:
                m = tl.minimum(nvalid, K)
                cand, pos = _select(x, m, nvalid)
            slot = (row * NSEG + seg) * CAP
            tl.store(CKey + slot + pos, x, mask=cand)
            tl.store(CIdx + slot + pos, offs, mask=cand)
            tl.store(CCnt + row * NSEG + seg, m)
            tl.debug_barrier()  # every thread's candidates are written before the arrival below
            if NSEG == 1:
                last = True
            else:
                last = tl.atomic_add(Count + row, 1, sem="acq_rel", scope="gpu") == NSEG - 1
            if last:
                j = tl.arange(0, MB)
                s = j // CAP
                ok = (s < NSEG) & ((j % CAP) < tl.load(CCnt + row * NSEG + s, mask=s < NSEG, other=0))
                base = row * NSEG * CAP
                ck = tl.load(CKey + base + j, mask=ok, other=float("-inf"), cache_modifier=".cg")
                ci = tl.load(CIdx + base + j, mask=ok, other=-1, cache_modifier=".cg")
                _write(ck, ci, Out + row * K, K)
                if NSEG > 1:
                    tl.store(Count + row, 0)  # ready for the next call


class TritonWorkspace:
    """Scratch for one (T, C, k, config): candidate slots, counts, and the per-row arrival counters (zeroed
    once; the last program of a row resets its counter, so a workspace is reusable call after call)."""

    def __init__(self, T_: int, C: int, k: int, cfg: TritonConfig, device):
        nseg = -(-C // cfg.seg)
        self.key = torch.empty(T_ * nseg * cfg.cap, dtype=torch.float32, device=device)
        self.idx = torch.empty(T_ * nseg * cfg.cap, dtype=torch.int32, device=device)
        self.cnt = torch.empty(T_ * nseg, dtype=torch.int32, device=device)
        self.arrive = torch.zeros(T_, dtype=torch.int32, device=device)


def triton_topk(scores: torch.Tensor, k: int, positions: torch.Tensor | None = None, ratio: int = 1,
                cfg: TritonConfig | None = None, out: torch.Tensor | None = None,
                ws: TritonWorkspace | None = None) -> torch.Tensor:  # fmt: skip
    """Triton variant: int32 [T, k], the top-k set of each row in ascending column order, -1 padding."""
    assert triton is not None, "triton is not installed"
    T_, C = scores.shape
    assert scores.dtype == torch.float32 and scores.stride(1) == 1
    cfg = cfg or triton_default_config(T_, C, k)
    triton_check_config(C, k, cfg)
    nseg = -(-C // cfg.seg)
    ws = ws or TritonWorkspace(T_, C, k, cfg, scores.device)
    out = out if out is not None else torch.empty(T_, k, dtype=torch.int32, device=scores.device)
    pos = positions if positions is not None else ws.cnt  # (unused when HAS_POS is false)
    _topk_kernel[(nseg, T_)](
        scores, scores.stride(0), pos, out, ws.key, ws.idx, ws.cnt, ws.arrive, C, ratio,
        K=k, SEG=cfg.seg, NSEG=nseg, HAS_POS=positions is not None, FILTER=cfg.filter, G=cfg.group, CAP=cfg.cap,
        MB=1 << (nseg * cfg.cap - 1).bit_length(), num_warps=cfg.warps,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- references


def visible_limit(positions: torch.Tensor, ratio: int, C: int) -> torch.Tensor:
    return ((positions.long() + 1) // ratio).clamp(max=C)


def reference(scores: torch.Tensor, k: int, positions: torch.Tensor | None = None, ratio: int = 1) -> torch.Tensor:
    """Torch: the top-k set (stable descending sort: ties to the lower column; -inf never taken) in ascending
    column order, int64 [T, k], -1 padding -- `topk_entries`' selection in the kernel's output order."""
    s = scores.float()
    T_, C = s.shape
    if positions is not None:
        vis = torch.arange(C, device=s.device) < visible_limit(positions, ratio, C).unsqueeze(-1)
        s = s.masked_fill(~vis, float("-inf"))
    kk = min(k, C)
    idx = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :kk]
    idx = torch.where(torch.gather(s, 1, idx) > float("-inf"), idx, C).sort(-1).values
    idx = torch.where(idx == C, -1, idx)
    return torch.nn.functional.pad(idx, (0, k - kk), value=-1)


def roofline(T_: int, C: int, k: int = 512, visible: float | None = None) -> tuple[float, float]:
    """(bytes, flops): the visible scores read once (fp32) and the indices written once (int32)."""
    vis = T_ * C if visible is None else visible
    return float(4 * vis + 4 * T_ * k), 0.0
