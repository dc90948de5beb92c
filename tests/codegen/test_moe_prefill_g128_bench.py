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
        # the EP-rank row: at the tiny dims (D 64, I 32) no kernel tile fits -- declined, with the reason
        assert r["moe_ep"]["local_experts"] == 2 and "do not tile" in r["moe_ep"]["declined"]


def test_formats_with_different_weight_blocks_need_separate_runs():
    bs = _bench_slice()
    assert bs.moe_formats("w128,g128") == ["w128", "g128"]
    for bad in ("g32,g128", "g64", ""):
        try:
            bs.moe_formats(bad)
        except ValueError:
            continue
        raise AssertionError(f"--moe-format {bad!r} was accepted")


def test_the_ep_rank_row_runs_the_adapter_and_compares_the_formats(monkeypatch):
    """moe_ep_rank at dims the kernels tile (D 256, I 128, 16 experts -> EP8: 2 local), kernel stand-ins: the
    exact and g128 rank outputs on the same x / routing / weights, both near the node's reference, and close."""
    import time
    import types

    from deepinfer.models import get_model
    from deepinfer.passes.pipeline import run_pipeline
    from deepinfer.runtime.cuda_executor import KernelCache

    monkeypatch.setattr(ka, "EMULATE", True)
    bs = _bench_slice()
    cfg = bs.slice_config((2, 6), "tiny")
    cfg["text_config"].update(hidden_size=256, moe_intermediate_size=128, n_routed_experts=16)
    mod = get_model("deepseek-v4.1-flash")
    g, _ = run_pipeline(mod.build_graph(mod.parse_config(cfg)), bs.slice_pipeline("fp8", "w128"))
    comp = types.SimpleNamespace(prep_cache={ka.MOE_TILE_STATS: {}, **ka.moe_act_cache_entries(g.meta)},
                                 kernels=KernelCache(builder=bs._cpu_stand_in))  # fmt: skip
    lim = types.SimpleNamespace(fp8=1.98e15)
    st = types.SimpleNamespace(g=g, params=bs.gpu_weights(g, device="cpu"), comp=comp, device="cpu", lim=lim,
                               ep_ranks=8, ep_first=None, format="w128")  # fmt: skip
    row = {"moe": {"l0": {"nodes": {"r": {"op": "moe_gate_route", "ms": 0.5}}}}}
    exact = bs._ep_row(st, row, 300, 0, time.time() + 60)
    comp.prep_cache.update(ka.moe_act_cache_entries({"moe_act_groups": {"decode": 32, "prefill": 128,
                                                                        "weight_block": 128}}))  # fmt: skip
    st.format = "g128"
    opt = bs._ep_row(st, row, 300, 0, time.time() + 60)
    assert (exact["local_experts"], exact["pairs"], exact["path"], opt["path"]) == (2, 600, "contiguous",
                                                                                    "contiguous[act128]")  # fmt: skip
    assert exact["tile_rows"] >= 600 and exact["with_routing_ms"] > exact["ms"] > 0
    assert exact["err_vs_ref"]["norm"] < 0.05 and opt["err_vs_ref"]["norm"] < 0.05
    assert 0 < opt["dev_vs_first"]["norm"] < 1e-2 and opt["dev_vs_first"]["format"] == "w128"


def test_ep_only_runs_just_the_ep_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", False)
    bs = _bench_slice()
    args = ["--preset", "tiny", "--layers", "2", "--batches", "", "--prefill", "24", "--reps", "1", "--ep-only"]
    assert bs.main([*args, "--no-torch-compile", "--moe-format", "w128,g128", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_slice.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["moe EP4 rank 24 tok [w128]", "moe EP4 rank 24 tok [g128]"]
    assert all("layers" not in r and r["moe_ep"]["local_experts"] == 2 for r in rows)
