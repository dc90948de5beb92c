"""benchmarks/kernels_h200.py --families (issue 6's table): every FAMILY_ROWS entry resolves to exactly one row of
the full table, and the table covers the issue's eight kernel families."""

import pytest


def test_every_family_row_resolves(kb):
    rows = kb.family_cases()
    assert len(rows) == len(kb.FAMILY_ROWS)
    for (family, pattern, shape), (name, row_shape, run) in zip(kb.FAMILY_ROWS, rows):
        assert name.startswith(family + ": ") and row_shape == shape and callable(run)
        assert kb._family_match(pattern, name[len(family) + 2 :])
    assert {f.split()[0] for f, _, _ in kb.FAMILY_ROWS} == {str(i) for i in range(1, 9)}


def test_a_pattern_that_matches_nothing_is_an_error(kb, monkeypatch):
    monkeypatch.setattr(kb, "FAMILY_ROWS", [("9 nothing", "no such kernel *", "0x0")])
    with pytest.raises(SystemExit, match="no such kernel"):
        kb.family_cases()


def test_family_selection_filters_like_the_table(kb):
    picked = kb.selected(False, False, "RMSNorm", "", families=True)
    assert [n.split(":")[0] for n, _, _ in picked] == ["8 RMSNorm", "8 RMSNorm + FP8 quant"]
