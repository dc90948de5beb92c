"""topk_select (the split indexer's exact top-k): reference vs the IR op, exact selection on TileLang's `c` target
(ties, -0.0, invisible columns, fewer than k visible, the candidate filter's fallbacks, several CTAs per row with
the last-arrival merge), the Triton variant in its interpreter, sm90 builds and configs."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from deepinfer.codegen.kernels import topk_select as ts
from deepinfer.ir.ops.v41 import TopKEntries


def _scores(kind: str, T_: int, C: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "rand":
        return torch.randn(T_, C, generator=g)
    if kind == "ints":  # few distinct values: exact ties everywhere, -0.0 next to +0.0
        s = torch.randint(-3, 4, (T_, C), generator=g).float()
        s[:, ::5] = torch.where(s[:, ::5] == 0, -0.0, s[:, ::5])
        return s
    if kind == "const":  # one value: every chunk overflows the candidate filter
        return torch.zeros(T_, C)
    if kind == "step":  # -1, but 0 in columns 256..511 (the 2nd chunk of a 32 x 8 config) except -0.5 in 260..271
        c = torch.arange(C)
        s = torch.where((c >= 256) & (c < 512), 0.0, -1.0)
        return torch.where((c >= 260) & (c < 272), -0.5, s).repeat(T_, 1)
    if kind == "ramp":  # increasing: the group maxima bound is loose, later chunks beat earlier ones
        return torch.arange(C).float().repeat(T_, 1) * 0.5 - 7.0
    if kind == "limits":  # +inf, the largest finite, subnormals, both zeros, -inf (= not visible) among randoms
        s = torch.randn(T_, C, generator=g)
        special = torch.tensor([float("inf"), 3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 0.0, -0.0, float("-inf")])
        pick = torch.randint(0, 8, (T_, C), generator=g)
        return torch.where(torch.rand(T_, C, generator=g) < 0.3, special[pick], s)
    raise ValueError(kind)


def _as_set(idx: torch.Tensor, C: int) -> torch.Tensor:
    """IR-op output (listed by score) -> the kernels' convention (the set by column, -1 padding)."""
    srt = torch.where(idx >= 0, idx, C).sort(-1).values
    return torch.where(srt == C, -1, srt)


@pytest.mark.parametrize("ratio", [1, 2])
def test_reference_is_topk_entries(ratio):
    T_, C, k = 5, 300, 40
    s = _scores("ints", T_, C)
    pos = torch.tensor([0, 7, 70, 299, 900])
    vis = torch.arange(C) < ((pos + 1) // ratio).unsqueeze(-1)
    want = _as_set(TopKEntries.reference(s.masked_fill(~vis, float("-inf")), None, topk=k, block=1), C)
    assert torch.equal(ts.reference(s, k, pos, ratio), want)
    # without positions, -inf marks what is not visible
    assert torch.equal(ts.reference(s.masked_fill(~vis, float("-inf")), k), want)
    assert (ts.reference(s, k, pos, ratio)[0] == -1).all() if ratio == 2 else (want[0, 1:] == -1).all()


def _run_c(kernel, s, k, pos, cfg):
    T_, C = s.shape
    out = torch.full((T_, k), 7, dtype=torch.int32)
    scratch = ts.make_scratch(T_, C, k, cfg, "cpu")
    p = pos.int() if pos is not None else torch.zeros(T_, dtype=torch.int32)
    kernel(s.contiguous(), p, out, *scratch)
    assert int(scratch[-1].abs().sum()) == 0, "the arrival counters must be left at zero"
    return out.long()


@pytest.fixture(scope="module")
def c_kernels(tilelang_required):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    k = 16
    direct = ts.Config(32, 8, 256, False)  # one CTA per row, the row in registers
    multi = ts.Config(32, 8, 512, True, 4, 32)  # 2 segments x 2 chunks, filter, cap 32 (falls back often)
    merge = ts.Config(32, 8, 256, True, 4, 32, merge_all=True)  # 4 one-chunk segments, one select of the union
    return {
        "direct": (compile_cpu(ts.program(4, 256, k=k, ratio=2, cfg=direct, target="cpu")), direct),
        "multi": (compile_cpu(ts.program(3, 1024, k=k, ratio=1, cfg=multi, target="cpu")), multi),
        "merge": (compile_cpu(ts.program(3, 1024, k=k, ratio=1, cfg=merge, target="cpu")), merge),
    }


@pytest.mark.parametrize("kind", ["rand", "ints", "const"])
def test_c_target_one_cta_per_row(c_kernels, kind):
    """Ties (incl. -0.0 vs +0.0) go to the lower column; rows with 0, 1, fewer than k and all visible."""
    kernel, cfg = c_kernels["direct"]
    s = _scores(kind, 4, 256)
    pos = torch.tensor([0, 2, 40, 600])  # ratio 2: 0, 1, 20 and 256 visible
    assert torch.equal(_run_c(kernel, s, 16, pos, cfg), ts.reference(s, 16, pos, 2))


@pytest.mark.parametrize("which", ["multi", "merge"])
@pytest.mark.parametrize("kind", ["rand", "ints", "const", "ramp"])
def test_c_target_filter_and_multi_cta_rows(c_kernels, kind, which):
    """Candidate filter (group maxima, running bound), its fallback to a chunk's exact top-k, the buffer cut to
    its top-k when full, the next chunk fetched ahead, and the last-arriving CTA's merge (in cuts, or `merge_all`:
    one select of every segment's set); run twice (the arrival counters reset)."""
    kernel, cfg = c_kernels[which]
    s = _scores(kind, 3, 1024, seed=1)
    pos = torch.tensor([5, 700, 5000])  # ratio 1: 6, 701 (the 2nd segment half visible) and 1024 visible
    want = ts.reference(s, 16, pos, 1)
    assert torch.equal(_run_c(kernel, s, 16, pos, cfg), want)
    assert torch.equal(_run_c(kernel, s, 16, pos, cfg), want)


@pytest.mark.parametrize("which", ["multi", "merge", "hist"])
def test_c_target_dead_segments_exit(request, which):
    """With positions, the segments past a row's limit exit at once and the live ones merge only the live slots: a
    run over whole rows first leaves every slot's count and (large) keys in the scratch, which the short rows after
    must not see (1, 2 and 3 live segments; a row of one visible column). Both programs (hist: the histogram
    program, 4 one-chunk segments a row)."""
    if which == "hist":
        from deepinfer.codegen.tilelang_backend import compile_cpu

        cfg = ts.HistConfig(32, 8, 256)
        kernel = compile_cpu(ts.program(3, 1024, k=16, ratio=1, cfg=cfg, target="cpu"))
    else:
        kernel, cfg = request.getfixturevalue("c_kernels")[which]
    T_, C, k = 3, 1024, 16
    scratch = ts.make_scratch(T_, C, k, cfg, "cpu")

    def run(s, pos):
        out = torch.full((T_, k), 7, dtype=torch.int32)
        kernel(s.contiguous(), pos.int(), out, *scratch)
        assert int(scratch[-1].abs().sum()) == 0, "the arrival counters must be left at zero"
        return out.long()

    big, full = _scores("rand", T_, C, seed=7) + 100.0, torch.tensor([5000] * T_)
    assert torch.equal(run(big, full), ts.reference(big, k, full, 1))
    s, pos = _scores("ints", T_, C, seed=8), torch.tensor([0, 300, 700])  # 1 / 301 / 701 columns (ratio 1)
    live = [min(max(-(-(int(p) + 1) // cfg.seg), 1), ts.n_segments(C, cfg)) for p in pos]
    assert live == ([1, 1, 2] if which == "multi" else [1, 2, 3])
    assert torch.equal(run(s, pos), ts.reference(s, k, pos, 1))


@pytest.fixture(scope="module")
def c_hist_kernels(tilelang_required):
    """The histogram-bound program: one CTA streaming 4 chunks of a row, and 2 segments of 2 chunks (merge)."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    one, two = ts.HistConfig(32, 8, 1024), ts.HistConfig(32, 8, 512)
    one_f, two_f = ts.HistConfig(32, 8, 1024, fused=True), ts.HistConfig(32, 8, 512, fused=True)
    one_f2 = ts.HistConfig(32, 8, 1024, fused=2)  # (the bin search of chunk j during chunk j + 1's pushes)
    one_v = ts.HistConfig(32, 8, 1024, fused=2, fast=True)
    two_v = ts.HistConfig(32, 8, 512, fused=1, fast=True, trim=True)  # (+ selections over the buffer's entries only)
    one_t = ts.HistConfig(32, 8, 1024, trim=True)
    return {
        "one": (compile_cpu(ts.program(4, 1024, k=16, ratio=2, cfg=one, target="cpu")), one, 2, [0, 2, 40, 5000]),
        "two": (compile_cpu(ts.program(3, 1024, k=16, ratio=1, cfg=two, target="cpu")), two, 1, [5, 700, 5000]),
        "one_fused": (compile_cpu(ts.program(4, 1024, k=16, ratio=2, cfg=one_f, target="cpu")), one_f, 2,
                      [0, 2, 40, 5000]),
        "two_fused": (compile_cpu(ts.program(3, 1024, k=16, ratio=1, cfg=two_f, target="cpu")), two_f, 1,
                      [5, 700, 5000]),
        "one_fused2": (compile_cpu(ts.program(4, 1024, k=16, ratio=2, cfg=one_f2, target="cpu")), one_f2, 2,
                       [0, 2, 40, 5000]),
        "one_fast": (compile_cpu(ts.program(4, 1024, k=16, ratio=2, cfg=one_v, target="cpu")), one_v, 2,
                     [0, 2, 40, 5000]),
        "two_fast": (compile_cpu(ts.program(3, 1024, k=16, ratio=1, cfg=two_v, target="cpu")), two_v, 1,
                     [5, 700, 5000]),
        "one_trim": (compile_cpu(ts.program(4, 1024, k=16, ratio=2, cfg=one_t, target="cpu")), one_t, 2,
                     [0, 2, 40, 5000]),
    }  # fmt: skip


def test_c_target_hist_without_positions(tilelang_required):
    """has_pos=False (the runtime's topk_entries adapter): -inf marks the invisible columns, rows padded with
    -inf rows give all -1; two segments, so the merge sees empty and partial sets."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    cfg = ts.HistConfig(32, 8, 512)
    kernel = compile_cpu(ts.program(4, 1024, k=16, ratio=1, cfg=cfg, target="cpu", has_pos=False))
    s = _scores("ints", 4, 1024, seed=4)
    vis = torch.arange(1024) < torch.tensor([0, 9, 600, 1024]).unsqueeze(-1)
    s = s.masked_fill(~vis, float("-inf"))
    assert torch.equal(_run_c(kernel, s, 16, None, cfg), ts.reference(s, 16))


@pytest.mark.parametrize(
    "which", ["one", "two", "one_fused", "two_fused", "one_fused2", "one_fast", "two_fast", "one_trim"]
)
@pytest.mark.parametrize("kind", ["rand", "ints", "const", "ramp", "limits", "step"])
def test_c_target_hist_bound(c_hist_kernels, kind, which):
    """The histogram bound (12-bit bins; the first chunk counted whole, later ones above the bound), the buffer
    cut to its exact top-k when the next chunk might not fit (every chunk of `const` and `ramp`) and the strict
    bound after it (a later tie with the k-th loses), several segments merged by the last CTA; rows with 0, 1,
    fewer than k and all columns visible; infinities, subnormals, -0.0 next to +0.0. Run twice (arrivals).
    fused: chunks after the first reserve room as they push; `const`, `ramp` and `step` run out of it mid-chunk
    (some threads' keys written, the rest not), so the buffer's complete part is cut and the rest pushed after
    -- in `step` the first 4 threads' zeros (columns 256..259, 384..399) are cut to 256..259 and 384..395, and
    the other threads' zeros in 272..383 tie with that k-th key at LOWER columns: they must still be pushed,
    and win."""
    kernel, cfg, ratio, pos = c_hist_kernels[which]
    s = _scores(kind, len(pos), 1024, seed=3)
    pos = torch.tensor(pos)
    want = ts.reference(s, 16, pos, ratio)
    assert torch.equal(_run_c(kernel, s, 16, pos, cfg), want)
    assert torch.equal(_run_c(kernel, s, 16, pos, cfg), want)


@pytest.fixture(scope="module")
def c_lean_kernel(tilelang_required):
    """Session 8's variants in one program: fused fast chunks with `lean` (no per-score column checks: the chunk
    that straddles the limit gets -inf past it when its bits are copied; every warp counts) and `compact` (the
    final selection on the members staged in the fine histogram, room for 64: random rows fit, tied rows do not
    and select in the buffer as before)."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    cfg = ts.HistConfig(32, 8, 1024, fused=2, fast=True, lean=True, compact=64)
    return compile_cpu(ts.program(4, 1024, k=16, ratio=2, cfg=cfg, target="cpu")), cfg


@pytest.fixture(scope="module")
def c_rsel_kernel(tilelang_required):
    """lean + compact with rsel: every member fits the stage (room for all 288 buffer entries), so tied rows are
    selected in registers too (the second pass over -id at the k-th key)."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    cfg = ts.HistConfig(32, 8, 1024, fused=2, fast=True, lean=True, compact=2048, rsel=True)
    return compile_cpu(ts.program(4, 1024, k=16, ratio=2, cfg=cfg, target="cpu")), cfg


@pytest.fixture(scope="module")
def c_search_kernel(tilelang_required):
    """The rsel program with the bound's bin search on every 2nd chunk only (`search`: of the 3 fused chunks, the
    last one's; the others push against the first chunk's bound)."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    cfg = ts.HistConfig(32, 8, 1024, fused=2, fast=True, lean=True, compact=2048, rsel=True, search=2)
    return compile_cpu(ts.program(4, 1024, k=16, ratio=2, cfg=cfg, target="cpu")), cfg


@pytest.fixture(scope="module")
def c_search_at_kernel(tilelang_required):
    """The rsel program with the bound's bin search at chunk 2 only (`search_at`: during the 2nd of the 3 fused
    chunks, from the counts of chunks 0-1; the last chunk pushes against that bound, and the final selection too)."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    cfg = ts.HistConfig(32, 8, 1024, fused=2, fast=True, lean=True, compact=2048, rsel=True, search_at=(2,))
    return compile_cpu(ts.program(4, 1024, k=16, ratio=2, cfg=cfg, target="cpu")), cfg


@pytest.fixture(scope="module")
def c_peel_kernel(tilelang_required):
    """The search program with the first chunk peeled out of the chunk loop (`peel`: the loop runs the fused chunks
    only, the rare overflow cut inside its branch), its bound by the fused chunks' bin search (`warp_first`; on the
    `c` target the CTA threshold's serial scan) and the final selection from the rank-k fine bin (`bin_sel`: rows
    without a cut; tied rows overflow the 288-entry buffer in the fused chunks and select as before)."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    cfg = ts.HistConfig(32, 8, 1024, fused=2, fast=True, lean=True, compact=2048, rsel=True, search=2, peel=1,
                        warp_first=True, bin_sel=True)  # fmt: skip
    return compile_cpu(ts.program(4, 1024, k=16, ratio=2, cfg=cfg, target="cpu")), cfg


@pytest.mark.parametrize("which", ["lean", "rsel", "search", "search_at", "peel"])
@pytest.mark.parametrize("kind", ["rand", "ints", "const", "ramp", "limits", "step"])
def test_c_target_hist_lean_compact(request, which, kind):
    """lean + compact (+ rsel, + a bin search every 2nd chunk or at chunk 2 only, + the first chunk peeled) exact,
    ties included. Row 2 sees 701 columns: the limit falls inside the third (fused) chunk and inside a float4, whose
    invisible columns 701..703 hold the row's largest scores -- never taken. Run twice."""
    kernel, cfg = request.getfixturevalue(f"c_{which}_kernel")
    s = _scores(kind, 4, 1024, seed=5)
    s[:, 701:704] = 1e30
    pos = torch.tensor([0, 40, 1402, 5000])  # ratio 2: 0, 20, 701 and 1024 visible
    want = ts.reference(s, 16, pos, 2)
    assert torch.equal(_run_c(kernel, s, 16, pos, cfg), want)
    assert torch.equal(_run_c(kernel, s, 16, pos, cfg), want)


@pytest.fixture(scope="module")
def c_row_start_kernel(tilelang_required):
    """The rsel program (lean + compact + wscan + rsel) with its rows' first chunks fetched early: eager (one row a
    CTA, its first chunk read whole before the row's limit is known)."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    cfg = ts.HistConfig(32, 8, 1024, fused=2, fast=True, lean=True, compact=2048, wscan=True, rsel=True, eager=True)
    return compile_cpu(ts.program(7, 1024, k=16, ratio=2, cfg=cfg, target="cpu")), cfg


@pytest.mark.parametrize("kind", ["rand", "ints", "const", "ramp", "limits", "step"])
def test_c_target_hist_row_start(c_row_start_kernel, kind):
    """eager: rows of every length (none, one, 20, 300, 701 -- the limit mid-float4 before columns holding the
    largest scores --, all), the largest scores of all also in columns 5..8 (inside the first chunk, which eager reads
    whole: invisible to the rows of < 5 columns); exact, ties included, twice."""
    kernel, cfg = c_row_start_kernel
    s = _scores(kind, 7, 1024, seed=6)
    s[:, 701:704] = 1e30
    s[:, 5:9] = 1e30
    pos = torch.tensor([5000, 1402, 0, 40, 1, 2047, 600])  # ratio 2: 1024, 701, 0, 20, 1, 1024, 300 visible
    want = ts.reference(s, 16, pos, 2)
    assert torch.equal(_run_c(kernel, s, 16, pos, cfg), want)
    assert torch.equal(_run_c(kernel, s, 16, pos, cfg), want)


def _gpu_exact(kb, T_: int, C: int, cfg, kind: str, seed: int) -> None:
    """`cfg`'s kernel on the H200 against topk_entries' set (ts.reference), run twice (the arrival counters reset):
    heavy ties ("ints": 7 values, -0.0 next to +0.0), all zeros or randn, causal limits anywhere in a chunk (random
    positions: rows with none, fewer than k and all columns visible)."""
    kern = kb.build(ts.program(T_, C, k=512, ratio=2, cfg=cfg, target="sm90"))
    g = torch.Generator().manual_seed(seed)
    s = {"ints": lambda: torch.randint(-3, 4, (T_, C), generator=g).float(), "zeros": lambda: torch.zeros(T_, C),
         "randn": lambda: torch.randn(T_, C, generator=g)}[kind]()  # fmt: skip
    s[:, ::5] = torch.where(s[:, ::5] == 0, -0.0, s[:, ::5])
    pos = torch.randint(0, 2 * C + 8, (T_,), generator=g, dtype=torch.int32)  # some rows see < k, some all
    s, pos = s.cuda(), pos.cuda()
    want = ts.reference(s, 512, pos, 2)
    out = torch.empty(T_, 512, device="cuda", dtype=torch.int32)
    scratch = ts.make_scratch(T_, C, 512, cfg, "cuda")
    for _ in range(2):
        out.fill_(7)
        kern(s, pos, out, *scratch)
        bad = (out.long() != want).any(1)
        assert not bad.any(), f"{cfg.tag}: {int(bad.sum())} rows differ (first {int(bad.nonzero()[0])})"


@pytest.mark.gpu
@pytest.mark.parametrize("T_,C", [(264, 16384), (64, 65536), (1, 65536)])
@pytest.mark.parametrize("kind", ["ints", "zeros", "randn"])
def test_gpu_lean_compact_exact(kb, T_, C, kind):
    """lean + compact + wscan + rsel on the H200 against topk_entries' set: the tie test's "fast" program per shape
    (T264: one CTA a row, eager, compact staged and selected in registers -- or not: all-zero rows have every key at
    the bound; T64 / T1: 8 segments a row, lean and wscan only, the dead ones idle) on heavy ties, all zeros (buffer
    overflows mid-chunk) and randn, causal limits anywhere in a chunk; run twice (the arrival counters reset)."""
    cfg = kb.topk_s8_test_config(T_, C)
    assert cfg.eager == (T_ == 264)
    _gpu_exact(kb, T_, C, cfg, kind, T_ + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ints", "zeros", "randn"])
def test_gpu_prefill_default_exact(kb, kind):
    """The prefill default at T4096 C65536 (one 256-thread CTA a row, eager, rsel, the bound searched on every 4th
    chunk since session 10 -- every n-th with DEEPINFER_TOPK_SEARCH=n: a lagging bound pushes more, all-zero rows
    overflow the buffer in every chunk) against topk_entries' set, as test_gpu_lean_compact_exact."""
    cfg = ts.default_config(4096, 65536)
    assert cfg.threads == 256 and cfg.eager and cfg.rsel
    assert cfg.search == int(os.environ.get("DEEPINFER_TOPK_SEARCH", 4))
    at = os.environ.get("DEEPINFER_TOPK_SEARCH_AT", ts.PREFILL_SEARCH_AT)  # (and the schedule / emit_regs switches)
    assert cfg.search_at == (ts.search_schedule(at, 16) if cfg.search > 1 else ())
    assert cfg.emit_regs == (os.environ.get("DEEPINFER_TOPK_EMIT_REGS", str(int(ts.PREFILL_EMIT_REGS))) == "1")
    assert cfg.peel == int(os.environ.get("DEEPINFER_TOPK_PEEL", ts.PREFILL_PEEL))
    assert cfg.warp_first == (cfg.peel > 0 and os.environ.get("DEEPINFER_TOPK_WARP_FIRST",
                                                              str(int(ts.PREFILL_WARP_FIRST))) == "1")  # fmt: skip
    assert cfg.emit_wc == (os.environ.get("DEEPINFER_TOPK_EMIT_WC", str(int(ts.PREFILL_EMIT_WC))) == "1"
                           and not cfg.emit_regs)  # fmt: skip
    assert cfg.bin_sel == (os.environ.get("DEEPINFER_TOPK_BIN_SEL", str(int(ts.PREFILL_BIN_SEL))) == "1"
                           and cfg.peel > 0)  # fmt: skip
    assert cfg.l2_ahead == (int(os.environ.get("DEEPINFER_TOPK_L2_AHEAD", ts.PREFILL_L2_AHEAD)) if cfg.peel else 0)
    _gpu_exact(kb, 4096, 65536, cfg, kind, 7)


def _barrier_between(src: str, first: str, then: str) -> bool:
    """Whether a `__syncthreads()` lies between the last line with `first` before the first `then` on a later
    line (the atomic's own line may name the buffer too)."""
    a = src.index(first)
    b = src.index(then, src.index("\n", a))
    return "__syncthreads()" in src[src.rindex(first, 0, b) : b]


def test_sm90_barrier_after_shared_atomics(tilelang_required):
    """Regression (H200, T=4096 C=2048: ~1/4 of the rows wrong): TileLang's sync planner cannot see the shared
    atomics, and for a one-CTA row (bitmap zeroed and popcounted by the same thread) it moved the barrier after
    the marking `atomicOr`s past the popcounts. The race does not exist on the serial `c` target, so the CUDA
    source is checked: a barrier after every phase of shared atomics, before the reads."""
    from deepinfer.codegen import tilelang_backend as tb

    cfg = ts.Config(32, 8, 256, False)
    src = tb.lower(ts.program(4, 256, k=16, ratio=2, cfg=cfg, target="sm90"), tb.get_target("sm90"))
    assert _barrier_between(src, "atomicOr(", "__popc("), "bitmap marks -> popcounts"
    assert _barrier_between(src, "atomicAdd((&(((int*)hist)", "((int*)hist)["), "histogram -> its bin search"


@pytest.mark.parametrize(
    "C,cfg",
    [(2048, None), (4096, ts.TritonConfig(1024, True, 8, 256, 4)), (4096, ts.TritonConfig(1024, False, 8, 128, 4))],
)
def test_triton_variant_interpreter(interpret, C, cfg):
    for kind in ("rand", "ints"):
        s = _scores(kind, 2, C, seed=2)
        pos = torch.tensor([700, 9000], dtype=torch.int32)
        assert torch.equal(ts.triton_topk(s, 64, pos, 2, cfg=cfg).long(), ts.reference(s, 64, pos, 2))


def test_sm90_build_multi_cta_row(codegen_cache, nvcc_required, monkeypatch):
    """The filter program's decode config (T=64 rows of 64k scores: 8 CTAs per row, one-shot merge) builds for
    sm90 without local memory, with shared atomics, fenced arrivals and L2 reads of the other CTAs' candidates,
    and fits an SM."""
    from deepinfer.codegen import tilelang_backend as tb

    monkeypatch.setenv("DEEPINFER_TOPK_HIST", "0")
    cfg = ts.default_config(64, 65536)
    assert ts.n_segments(65536, cfg) > 1 and cfg.filter and cfg.merge_all
    art = tb.build("topk_select_sm90", ts.program(64, 65536, k=512, ratio=2, cfg=cfg, target="sm90"), "sm90")
    assert art.opcodes["LDL"] == 0 and art.opcodes["STL"] == 0, "no local-memory spills"
    assert art.opcodes["ATOMS"] > 0 and art.opcodes["LDG"] > 0 and art.opcodes["STG"] > 0
    assert "__threadfence" in art.source and "__ldcg" in art.source and "atomicOr" in art.source
    assert _barrier_between(art.source, "atomicAdd((&(((int*)ctl)", "((int*)ctl)[0]"), "pushes -> their count"
    usage = subprocess.run([tb.cuobjdump_path(), "--dump-resource-usage", str(art.cubin_path)],
                           capture_output=True, text=True).stdout  # fmt: skip
    regs = int(usage.split("REG:")[1].split()[0])
    assert regs * cfg.threads <= 65536, f"{regs} registers x {cfg.threads} threads: more than an SM has"


def test_hist_default_configs(monkeypatch):
    """Long rows of 32+ queries take the histogram-bound program (prefill one CTA a row: 256 threads at 64k, 128
    at 16k, as measured; decode segments within one wave of 4 CTAs an SM and a merge of at most MERGE_ALL_MAX);
    T1 and short rows keep the other programs; DEEPINFER_TOPK_HIST=1 / 0 forces hist / filter for long rows."""
    for T_, C in ((64, 65536), (64, 16384), (4096, 16384), (4096, 65536)):
        cfg = ts.default_config(T_, C)
        assert isinstance(cfg, ts.HistConfig)
        ts.check_config(C, 512, cfg)
        nseg = ts.n_segments(C, cfg)
        assert nseg == 1 if T_ == 4096 else (T_ * nseg <= 2 * 132 and nseg * 512 <= ts.MERGE_ALL_MAX)
        assert ts.hist_buffer(C, 512, cfg) >= 512 + cfg.chunk
    assert ts.default_config(4096, 65536).threads == 256 and ts.default_config(4096, 16384).threads == 128
    assert ts.n_segments(65536, ts.default_config(64, 65536)) == 4  # the measured T64 config
    assert isinstance(ts.default_config(1, 65536), ts.Config) and isinstance(ts.default_config(4096, 2048), ts.Config)
    monkeypatch.setenv("DEEPINFER_TOPK_HIST", "1")
    assert isinstance(ts.default_config(1, 65536), ts.HistConfig)
    monkeypatch.setenv("DEEPINFER_TOPK_HIST", "0")
    assert isinstance(ts.default_config(4096, 65536), ts.Config)
    monkeypatch.delenv("DEEPINFER_TOPK_HIST")
    # the fused chunk loop with fast chunks: both measured prefill widths (256 threads at 64k, 128 at 16k); decode
    # keeps the barrier-per-phase loop; DEEPINFER_TOPK_FAST=0 fused without fast, DEEPINFER_TOPK_FUSED=0 neither
    # (session 8: lean fast chunks, the compact final selection, no L2 prefetch; DEEPINFER_TOPK_LEAN=0: session 7's)
    s8 = dict(lean=True, compact=2048, wscan=True)
    fast64 = ts.HistConfig(256, 16, 65536, l2_ahead=2, fused=2, min_blocks=3, ffs=True, fast=True)
    fast16 = ts.HistConfig(128, 16, 16384, l2_ahead=2, fused=2, ffs=True, fast=True)
    at, regs = ts.search_schedule(ts.PREFILL_SEARCH_AT, 16), ts.PREFILL_EMIT_REGS  # (session 11's switches)
    peel, wf = ts.PREFILL_PEEL, ts.PREFILL_PEEL > 0 and ts.PREFILL_WARP_FIRST  # (session 12's)
    wc, bs = ts.PREFILL_EMIT_WC and not regs, ts.PREFILL_BIN_SEL and peel > 0
    l2 = ts.PREFILL_L2_AHEAD if peel > 0 else 0
    assert ts.default_config(4096, 65536) == ts.HistConfig(256, 16, 65536, fused=2, min_blocks=3, ffs=True, fast=True,
                                                           rsel=True, eager=True, search=4, search_at=at,
                                                           emit_regs=regs, peel=peel, warp_first=wf, emit_wc=wc,
                                                           bin_sel=bs, l2_ahead=l2, **s8)  # fmt: skip
    # (session 10: the bound searched on every 4th chunk at 64k+ columns -- every n-th with the switch; every chunk at
    # 16k / 32k whatever the switch)
    assert ts.default_config(4096, 32768).search == 1 and ts.default_config(4096, 131072).search == 4
    monkeypatch.setenv("DEEPINFER_TOPK_SEARCH", "8")
    assert ts.default_config(4096, 65536).search == 8 and ts.default_config(4096, 16384).search == 1
    monkeypatch.delenv("DEEPINFER_TOPK_SEARCH")
    monkeypatch.setenv("DEEPINFER_TOPK_SEARCH_AT", "2,3,5,9,15")  # (a schedule: the same rows only)
    assert ts.default_config(4096, 65536).search_at == (2, 3, 5, 9, 15) and not ts.default_config(4096, 16384).search_at
    monkeypatch.setenv("DEEPINFER_TOPK_SEARCH_AT", "g1")  # (by name: the same at 16 chunks, scaled at 32)
    assert ts.default_config(4096, 65536).search_at == (2, 3, 5, 9, 15)
    assert ts.default_config(4096, 131072).search_at == (2, 3, 5, 9, 17, 31)
    monkeypatch.setenv("DEEPINFER_TOPK_SEARCH_AT", "")
    assert ts.default_config(4096, 65536).search_at == ()
    monkeypatch.delenv("DEEPINFER_TOPK_SEARCH_AT")
    monkeypatch.setenv("DEEPINFER_TOPK_EMIT_REGS", "1")
    assert ts.default_config(4096, 65536).emit_regs and not ts.default_config(4096, 16384).emit_regs
    monkeypatch.setenv("DEEPINFER_TOPK_EMIT_REGS", "0")
    assert not ts.default_config(4096, 65536).emit_regs
    monkeypatch.delenv("DEEPINFER_TOPK_EMIT_REGS")
    monkeypatch.setenv("DEEPINFER_TOPK_PEEL", "2")  # (the first chunk peeled, + its bound by one warp: 64k+ rows)
    monkeypatch.setenv("DEEPINFER_TOPK_WARP_FIRST", "1")
    monkeypatch.setenv("DEEPINFER_TOPK_BIN_SEL", "1")
    assert ts.default_config(4096, 65536).peel == 2 and ts.default_config(4096, 65536).warp_first
    assert ts.default_config(4096, 65536).bin_sel
    monkeypatch.setenv("DEEPINFER_TOPK_L2_AHEAD", "1")
    assert ts.default_config(4096, 65536).l2_ahead == 1 and ts.default_config(4096, 16384).l2_ahead == 0
    assert not ts.default_config(4096, 16384).peel and not ts.default_config(4096, 16384).warp_first
    monkeypatch.setenv("DEEPINFER_TOPK_PEEL", "0")  # (warp_first: with peel only)
    assert not ts.default_config(4096, 65536).peel and not ts.default_config(4096, 65536).warp_first
    assert not ts.default_config(4096, 65536).bin_sel and ts.default_config(4096, 65536).l2_ahead == 0
    monkeypatch.delenv("DEEPINFER_TOPK_BIN_SEL")
    monkeypatch.delenv("DEEPINFER_TOPK_L2_AHEAD")
    monkeypatch.delenv("DEEPINFER_TOPK_PEEL")
    monkeypatch.delenv("DEEPINFER_TOPK_WARP_FIRST")
    monkeypatch.setenv("DEEPINFER_TOPK_EMIT_WC", "1")  # (the warp-contiguous output: the same rows, not with emit_regs)
    assert ts.default_config(4096, 65536).emit_wc and not ts.default_config(4096, 16384).emit_wc
    monkeypatch.setenv("DEEPINFER_TOPK_EMIT_REGS", "1")
    assert not ts.default_config(4096, 65536).emit_wc
    monkeypatch.delenv("DEEPINFER_TOPK_EMIT_REGS")
    monkeypatch.delenv("DEEPINFER_TOPK_EMIT_WC")
    assert ts.search_schedule("g2", 16) == (2, 4, 8, 15) and ts.search_schedule("g1", 4) == (2, 3)
    assert ts.default_config(4096, 16384) == ts.HistConfig(128, 16, 16384, fused=2, ffs=True, fast=True, eager=True,
                                                           **s8)  # fmt: skip
    monkeypatch.setenv("DEEPINFER_TOPK_EAGER", "0")  # (session 9's eager first chunk off)
    assert not ts.default_config(4096, 65536).eager and not ts.default_config(4096, 16384).eager
    monkeypatch.delenv("DEEPINFER_TOPK_EAGER")
    # decode (session 8): the fused loop with lean fast chunks and wscan, no L2 prefetch, the same segments
    dec = dict(fused=2, ffs=True, fast=True, lean=True, wscan=True)
    assert ts.default_config(64, 65536) == ts.HistConfig(128, 16, 16384, **dec)
    assert ts.default_config(64, 16384) == ts.HistConfig(128, 16, 8192, **dec)
    monkeypatch.setenv("DEEPINFER_TOPK_LEAN", "0")
    assert ts.default_config(4096, 65536) == fast64 and ts.default_config(4096, 16384) == fast16
    assert not ts.default_config(64, 65536).fused
    monkeypatch.delenv("DEEPINFER_TOPK_LEAN")
    monkeypatch.setenv("DEEPINFER_TOPK_FAST", "0")
    assert ts.default_config(4096, 65536) == ts.HistConfig(256, 16, 65536, l2_ahead=2, fused=2, min_blocks=3, ffs=True)
    monkeypatch.setenv("DEEPINFER_TOPK_FUSED", "0")
    assert ts.default_config(4096, 65536) == ts.HistConfig(256, 16, 65536, l2_ahead=2)
    monkeypatch.delenv("DEEPINFER_TOPK_FUSED")
    monkeypatch.delenv("DEEPINFER_TOPK_FAST")
    # decode rows up to 8192 columns: one 512-thread CTA a row, the row in registers (measured at T64 C4160)
    assert ts.default_config(64, 4160) == ts.Config(512, 16, 8192, False, 8, 2048)
    assert isinstance(ts.default_config(64, 8196), ts.HistConfig) and isinstance(ts.default_config(16, 6000), ts.Config)
    monkeypatch.setenv("DEEPINFER_TOPK_HIST", "1")
    assert isinstance(ts.default_config(64, 4160), ts.HistConfig)


@pytest.mark.parametrize("T_,C,cfg", [(64, 4100, None), (64, 4100, ts.HistConfig(128, 16, 6144, l2_ahead=2)),
                                     (1, 4100, None)])  # fmt: skip
def test_c_target_decode_padded_rows(tilelang_required, T_, C, cfg):
    """The programs the runtime's topk_entries takes at decode for the indexer's C = 4097 (padded by the adapter to
    4100 with -inf columns): T64's row in registers (512 threads x 16), the hist program it took before (3 chunks
    of a 6144-column segment, the last partial) and T1's two merge_all segments (the second holds 4 columns);
    without positions, the last real column the largest, a row with fewer than k visible; exactly the reference
    set (4 rows of the T64 programs)."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    cfg, rows = cfg or ts.default_config(T_, C), min(T_, 4)
    kernel = compile_cpu(ts.program(rows, C, k=512, ratio=1, cfg=cfg, target="cpu", has_pos=False))
    s = _scores("ints", rows, C, seed=C)
    s[:, C - 3 :] = float("-inf")
    s[0, C - 4] = 50.0
    if rows > 1:
        s[1, 100:] = float("-inf")
    assert torch.equal(_run_c(kernel, s, 512, None, cfg), ts.reference(s, 512))


def test_sm90_lowers_decode_hist(tilelang_required):
    """Regression: the hist program of issue 8's layer-20 decode row (T64 C4160: one 6144-column segment, 3 chunks,
    2 prefetched into L2; the default until the row in registers measured faster) failed to lower ("Cannot match
    type handle vs int32": an in-loop L2 prefetch that is never in range) -- only prefetches that can be in range
    are emitted now."""
    from deepinfer.codegen import tilelang_backend as tb

    cfg = ts.HistConfig(128, 16, 6144, l2_ahead=2)
    assert cfg.seg // cfg.chunk <= 1 + cfg.l2_ahead
    src = tb.lower(ts.program(64, 4160, k=512, ratio=1, cfg=cfg, target="sm90", has_pos=False), tb.get_target("sm90"))
    assert "tl_topk_prefetch_l2(" in src


def test_sm90_lowers_decode_c32768(tilelang_required):
    """Regression (H200 session 8: batched decode with caches for max_model_len 65536, ratio 2): the then default
    config at T64 C32768 (4 segments of 8192, 2 chunks prefetched into L2) failed to lower in TileLang's layout
    inference ("Can't fetch the lanes of a scalable vector at a compile time") on the prefetch's
    `address_of(S[t, 0])`; thread 0 now prefetches from the scores' base, row and offset."""
    from deepinfer.codegen import tilelang_backend as tb

    cfg = ts.HistConfig(128, 16, 8192, l2_ahead=2)  # (the default there until session 8's lean decode form)
    assert ts.n_segments(32768, cfg) == 4
    src = tb.lower(ts.program(64, 32768, k=512, ratio=1, cfg=cfg, target="sm90", has_pos=False), tb.get_target("sm90"))
    assert "tl_topk_prefetch_l2(" in src


@pytest.mark.parametrize("hist", [False, True])
def test_sm90_lowers_live_segment_merge(tilelang_required, hist):
    """Regression (session 9, helper D's dry-run): the live-segment merge of both programs failed to lower for sm90
    ("address_of argument must be a BufferLoad": its L2 read's slot index was clamped with a local variable); the
    T1 decode's filter program at C >= 16384 did not build."""
    from deepinfer.codegen import tilelang_backend as tb

    cfg = ts.HistConfig(32, 8, 512) if hist else ts.Config(32, 8, 256, True, 4, 32, merge_all=True)
    assert ts.n_segments(1024, cfg) > 1
    src = tb.lower(ts.program(3, 1024, k=16, ratio=1, cfg=cfg, target="sm90"), tb.get_target("sm90"))
    assert "__ldcg(" in src


def test_sm90_lowers_ffs_one_word_a_thread(tilelang_required):
    """Regression: the __ffs output did not lower where a thread owns one bitmap word and some threads none (C 2048
    at 128 threads: the 'fused' GPU tie test at T512; here C 1024 at 64 threads): its loop bound was a shared load
    (TileLang's sync planner: 'allow_append_ ... bitmap[tx]'). The bound is a register now."""
    from deepinfer.codegen import tilelang_backend as tb

    cfg = ts.HistConfig(64, 8, 1024, fused=2, ffs=True)
    src = tb.lower(ts.program(4, 1024, k=16, ratio=2, cfg=cfg, target="sm90"), tb.get_target("sm90"))
    assert "__ffs(" in src


def test_sm90_staging_loop_has_no_barrier(tilelang_required):
    """Regression (session 10): the final selection's staging loop (compact) wrote the stage with stores TileLang's
    sync planner saw, and it put a __syncthreads in every iteration -- inside the per-thread branch of the threads
    whose range fits the stage: a divergent barrier on heavy ties (more members than the stage holds), ~8 barriers a
    row otherwise. The stage's stores are opaque `put`s now and every thread runs the loop: no barrier in it."""
    from deepinfer.codegen import tilelang_backend as tb

    cfg = ts.HistConfig(64, 8, 1024, fused=2, fast=True, lean=True, compact=128)
    src = tb.lower(ts.program(4, 1024, k=16, ratio=2, cfg=cfg, target="sm90"), tb.get_target("sm90"))
    put = src.index("tl_topk_put((&(((int*)hist_f)[0]))")  # the stage (hist_f) written by the staging loop
    loop = src.rindex("for (", 0, put)
    assert "__syncthreads" not in src[loop:put], "a barrier inside the staging loop"


def test_sm90_lowers_clock_probe(tilelang_required):
    """HistConfig.clock (diagnostics): the real program plus thread 0's SM clock at the checkpoints hist_clock_points
    names -- the start, the workspace, every chunk (one site in the chunk loop), the staged members, the selection,
    the marks and the output -- written over the row's first entries after a barrier; only one-segment compact
    programs take it (bad configs: one-line errors)."""
    from deepinfer.codegen import tilelang_backend as tb

    cfg = ts.HistConfig(64, 8, 1024, fused=2, fast=True, lean=True, compact=128, clock=True)
    names = ts.hist_clock_points(cfg)
    assert names[:3] == ["start", "ws", "c0"] and names[-4:] == ["stage", "select", "mark", "emit"] and len(names) == 8
    src = tb.lower(ts.program(4, 1024, k=16, ratio=2, cfg=cfg, target="sm90"), tb.get_target("sm90"))
    assert src.count("= tl_topk_clock();") == 7 and "clk[(it + 2)] = tl_topk_clock();" in src
    assert "(clk[u" in src and "tl_topk_clock" not in tb.lower(
        ts.program(4, 1024, k=16, ratio=2, cfg=replace(cfg, clock=False), target="sm90"), tb.get_target("sm90"))
    with pytest.raises(AssertionError, match="clock"):
        ts.check_config(1024, 16, replace(cfg, compact=0))


@pytest.mark.parametrize("fused", [False, True])
def test_sm90_build_hist_prefill(codegen_cache, nvcc_required, fused):
    """The histogram-bound program at the prefill shape (one 256-thread CTA streams a 64k row, two chunks
    prefetched into L2) builds for sm90 without local memory and in at most 80 registers: 3 CTAs fit an SM (the
    occupancy the streaming needs; the T64 regression of the other program was 137 registers = 1 CTA/SM), with
    a barrier between the histogram atomics and the bin search, and the bulk L2 prefetch. The fused chunk loop (the
    default here) needs min_blocks=3 for it (85 registers without: 2 CTAs/SM; an earlier form spilled a
    just-loaded float4, which stalls on the load). Since session 8 the default is lean + compact + wscan + rsel
    without the prefetch: the same limits."""
    from deepinfer.codegen import tilelang_backend as tb

    cfg = ts.default_config(4096, 65536) if fused else ts.HistConfig(256, 16, 65536, l2_ahead=2)
    assert bool(cfg.fused) == fused
    art = tb.build("topk_select_sm90", ts.program(4096, 65536, k=512, ratio=2, cfg=cfg, target="sm90"), "sm90")
    assert art.opcodes["LDL"] == 0 and art.opcodes["STL"] == 0, "no local-memory spills"
    assert "cp.async.bulk.prefetch.L2.global" in art.source and art.opcodes["ATOMS"] > 0
    assert _barrier_between(art.source, "atomicAdd((&(((int*)hist_c)", "((int*)hist_c)["), "counts -> bin search"
    usage = subprocess.run([tb.cuobjdump_path(), "--dump-resource-usage", str(art.cubin_path)],
                           capture_output=True, text=True).stdout  # fmt: skip
    regs = int(usage.split("REG:")[1].split()[0])
    # (registers are allotted to a warp in units of 8 a thread: 85 would be 88, and 3 x 256 x 88 > 64k)
    assert -(-regs // 8) * 8 * cfg.threads * 3 <= 65536, f"{regs} registers x {cfg.threads}: fewer than 3 CTAs an SM"


_AOT = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer.codegen.kernels import topk_select as ts
sig = {"S": "*fp32", "stride_s": "i32", "Pos": "*i32", "Out": "*i32", "CKey": "*fp32", "CIdx": "*i32",
       "CCnt": "*i32", "Count": "*i32", "n_cols": "i32", "ratio": "i32", "K": "constexpr", "SEG": "constexpr",
       "NSEG": "constexpr", "HAS_POS": "constexpr", "FILTER": "constexpr", "G": "constexpr", "CAP": "constexpr",
       "MB": "constexpr"}
consts = dict(K=512, SEG=16384, NSEG=4, HAS_POS=True, FILTER=True, G=16, CAP=2048, MB=8192)
k = triton.compile(ASTSource(fn=ts._topk_kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 16})
print(k.asm["ptx"])
"""


def test_triton_variant_compiles_for_hopper():
    pytest.importorskip("triton", reason="triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ".target sm_90a" in proc.stdout and "atom.global.gpu.acq_rel.add" in proc.stdout


def test_tail_split():
    """T4096 at 3 CTAs an SM: 10 whole waves of one-CTA rows, then the 136 last rows in 2 segments (one wave of
    half-rows); nothing to split without a known occupancy, with whole waves only, or for segmented rows."""
    cfg = ts.HistConfig(256, 16, 65536, fused=2, min_blocks=3, fast=True, lean=True)
    (r0, n0, c0), (r1, n1, c1) = ts.tail_split(4096, 65536, cfg)
    assert (r0, n0, c0) == (0, 3960, cfg) and (r1, n1) == (3960, 136)
    assert ts.n_segments(65536, c1) == 2 and c1 == ts.HistConfig(**{**vars(cfg), "seg": 32768})
    assert n1 * ts.n_segments(65536, c1) <= 3 * 132
    assert ts.tail_split(4096, 65536, ts.HistConfig(256, 16, 65536)) == [(0, 4096, ts.HistConfig(256, 16, 65536))]
    assert len(ts.tail_split(396 * 4, 65536, cfg)) == 1 and len(ts.tail_split(300, 65536, cfg)) == 1
    assert len(ts.tail_split(4096, 65536, ts.HistConfig(256, 16, 16384, min_blocks=3))) == 1
    # eager (one segment a row) stays with the whole rows
    (_, _, e0), (_, _, e1) = ts.tail_split(4096, 65536, replace(cfg, eager=True))
    assert e0.eager and not e1.eager and e1.seg == 32768


def test_configs_and_roofline():
    for T_, C in ((1, 2048), (4096, 2048), (1, 65536), (64, 65536), (4096, 16384), (4096, 65536)):
        cfg = ts.default_config(T_, C)
        ts.check_config(C, 512, cfg)
        assert cfg.seg * ts.n_segments(C, cfg) >= C
    assert not ts.default_config(4096, 2048).filter  # short rows: the row in registers, one CTA per row
    assert ts.n_segments(65536, ts.default_config(4096, 65536)) == 1  # many rows: one CTA streams each row
    assert ts.n_segments(65536, ts.default_config(64, 65536)) * 64 >= 2 * 128  # few rows: ~2 CTAs per SM
    assert ts.roofline(64, 65536, 512) == (4.0 * 64 * 65536 + 4 * 64 * 512, 0.0)
    assert ts.roofline(2, 100, 8, visible=150)[0] == 4 * 150 + 4 * 2 * 8
    for cfg in ts.config_space(4096, 65536):
        ts.check_config(65536, 512, cfg)
    with pytest.raises(AssertionError):
        ts.check_config(4096, 512, ts.Config(128, 16, 2048, True, 8, 2048))  # 256 groups < 2k: no filter
