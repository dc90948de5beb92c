"""bench_slice's prefill MoE report on CPU (--preset tiny: kernel stand-ins, nominal limits): both --moe-format rows of
one slice, each layer's MoE part (routing, the experts' input quant, the experts) with the activation record the
executor ran with."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from deepinfer.runtime import kernel_adapters as ka

ROOT = Path(__file__).resolve().parents[2]


def _bench_slice():
    spec = importlib.util.spec_from_file_location("bench_slice_g128_test", ROOT / "benchmarks" / "bench_slice.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prefill_rows_report_the_moe_part_per_format(tmp_path, monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", False)  # the smoke mode turns it on; restored after the test
    bs = _bench_slice()
    args = ["--preset", "tiny", "--layers", "2,6", "--batches", "", "--context", "12", "--prefill", "24", "--reps", "1"]
    rc = bs.main([*args, "--no-torch-compile", "--moe-format", "w128,g128", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "bench_slice.json").read_text())
    rows = {r["case"]: r for r in data["rows"]}
    assert set(rows) == {"prefill 24 [w128]", "prefill 24 [g128]"}
    assert "1x32 at decode and prefill" in rows["prefill 24 [w128]"]["moe_act"]
    assert "1x128 at prefill" in rows["prefill 24 [g128]"]["moe_act"]
    for r in rows.values():
        assert "error" not in r, r.get("error")
        assert set(r["moe"]) == {"l0", "l1"}
        for m in r["moe"].values():
            ops = {n["op"] for n in m["nodes"].values()}
            assert {"moe_gate_route", "moe_grouped_experts"} <= ops and "fake_quant_fp8" in ops
            assert 0 < m["ms"] <= m["layer_ms"] and m["flops"] > 0


def test_formats_with_different_weight_blocks_need_separate_runs():
    bs = _bench_slice()
    assert bs.moe_formats("w128,g128") == ["w128", "g128"]
    for bad in ("g32,g128", "g64", ""):
        try:
            bs.moe_formats(bad)
        except ValueError:
            continue
        raise AssertionError(f"--moe-format {bad!r} was accepted")
