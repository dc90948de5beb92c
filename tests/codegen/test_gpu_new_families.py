"""indexer_topk, compressor and engram against their torch references on the GPU, at V4.1-Flash shapes.

Marked `gpu`: skipped with a reason where there is no CUDA device. Each test runs the benchmark's case
(benchmarks/kernels_h200.py) in check-only mode on fresh random inputs, as tests/codegen/test_gpu_kernels.py
does for the older families.

    python3 -m pytest tests/codegen/test_gpu_new_families.py -m gpu -v      # on the H200
"""



import pytest

pytestmark = pytest.mark.gpu



@pytest.mark.parametrize(
    "T_,C,prefill,fp8",
    [(64, 65536, False, True), (1, 65536, False, True), (64, 65536, False, False), (4096, 2048, True, True),
     (3, 1024, False, True)],  # fmt: skip
)
def test_indexer_topk(kb, run_case, T_, C, prefill, fp8):
    run_case(kb.case_indexer_topk, T_, C, prefill, fp8)


_SPLIT = [(1, 2048), (1, 65536), (64, 16384), (64, 65536), (4096, 2048), (4096, 65536)]


@pytest.mark.parametrize("T_,C", _SPLIT)
def test_indexer_split_scores(kb, run_case, T_, C):
    run_case(kb.case_indexer_scores, T_, C)


@pytest.mark.parametrize("T_,C", _SPLIT)
@pytest.mark.parametrize("variant", ["tilelang", "triton"])
def test_indexer_split_topk_exact(kb, T_, C, variant):
    """Exact equality with topk_entries on the same scores (ties included), and again (arrival counters)."""
    kb.case_indexer_topk_select(kb.Row("test", ""), T_, C, True, False, variant)


@pytest.mark.parametrize("T_,C", _SPLIT)
def test_indexer_split_end_to_end(kb, run_case, T_, C):
    run_case(kb.case_indexer_split, T_, C)


@pytest.mark.parametrize("T_,C", [(512, 2048), (264, 16384), (64, 65536), (1, 65536)])
@pytest.mark.parametrize("kind", ["ints", "zeros", "randn"])
@pytest.mark.parametrize("program", ["default", "hist", "fused", "fast"])
def test_topk_select_ties_exact(kb, T_, C, kind, program):
    """The default top-k program per shape (one CTA per row / streamed rows / merge_all decode), and the
    histogram-bound program (one CTA streaming a row; at T <= 64, 8192-column segments and the last CTA's merge),
    on scores with heavy exact ties (few distinct values, -0.0 next to +0.0; or all zero: every chunk overflows
    the filter / the histogram's bin, so the buffer is cut to its exact top-k), causal limits included: exactly
    topk_entries' set, run twice (the arrival counters reset). "fused": the hist program's one-barrier chunk loop
    (warps push without waiting for each other; all-zero rows run out of buffer room mid-chunk) with the
    overlapped bin search, 3 CTAs/SM and the __ffs output. "fast": the fused loop on raw float bits, whole warps
    below the bound skipping their pass (the skip exists on the GPU only; "randn" rows take it)."""
    import torch

    from deepinfer.codegen.kernels import topk_select as ts

    k = 512
    cfg = kb.topk_tie_config(T_, C, program)  # (`kernels_h200.py --dry-run --only "topk_select tiebuild" -j N`
    kern = kb.build(ts.program(T_, C, k=k, ratio=2, cfg=cfg, target="sm90"))  # builds them all in parallel first)
    g = torch.Generator().manual_seed(T_)
    s = torch.randint(-3, 4, (T_, C), generator=g).float() if kind == "ints" else torch.zeros(T_, C)
    if kind == "randn":  # (no ties: most warps of a later chunk hold no key at the bound -- fast's skip)
        s = torch.randn(T_, C, generator=g)
    s[:, ::5] = torch.where(s[:, ::5] == 0, -0.0, s[:, ::5])
    pos = torch.randint(0, 2 * C + 8, (T_,), generator=g, dtype=torch.int32)  # some rows see < k, some all
    s, pos = s.cuda(), pos.cuda()
    want = ts.reference(s, k, pos, 2)
    out = torch.empty(T_, k, device="cuda", dtype=torch.int32)
    scratch = ts.make_scratch(T_, C, k, cfg, "cuda")
    for _ in range(2):
        out.fill_(7)
        kern(s, pos, out, *scratch)
        bad = (out.long() != want).any(1)
        assert not bad.any(), f"{cfg.tag}: {int(bad.sum())} rows differ (first {int(bad.nonzero()[0])})"


@pytest.mark.parametrize("T_,ratio", [(4096, 2), (64, 2), (4096, 1)])
def test_compressor(kb, run_case, T_, ratio):
    run_case(kb.case_compressor, T_, ratio)


@pytest.mark.parametrize("T_", [4096, 64])
def test_engram_embed(kb, run_case, T_):
    run_case(kb.case_engram_embed, T_)


@pytest.mark.parametrize("T_", [4096, 64])
def test_engram_gate(kb, run_case, T_):
    run_case(kb.case_engram_gate, T_)
