"""benchmarks/bench_slice.py with an Engram layer (issue 8's layers 1 and 14), on CPU: the memory estimate at the real
dims (one Engram layer fits an H200, two do not), the roofline's Engram bytes (the rows gathered, not the table), the
chunked FP8 fill, and the tiny preset's Engram layer through the benchmark's path (compiled stand-ins, layer graphs,
eager references, straight-line export) with the table shared by all of them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from deepinfer.runtime import kernel_adapters as ka

ROOT = Path(__file__).resolve().parents[2]
REAL_ROWS_L1, REAL_ROWS_L14 = 384_006_168, 384_016_682  # MODEL_SPEC §2.14: the two tables' rows (prime sums)


@pytest.fixture(scope="module")
def bs():
    spec = importlib.util.spec_from_file_location("bench_slice_engram_tests", ROOT / "benchmarks" / "bench_slice.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _meta_params(g) -> dict:
    """The graph's parameters as meta tensors: shapes and dtypes at the real dims, nothing allocated."""
    return {p.name: torch.empty(tuple(int(d) for d in p.shape), dtype=p.type.dtype.torch_dtype, device="meta")
            for p in g.params}  # fmt: skip


def test_real_dims_one_engram_layer_fits_an_h200_two_do_not(bs):
    free = bs.H200_FREE_GIB * bs.GiB
    for layers in ((1,), (14,)):
        est = bs.memory_estimate(bs.slice_graph(layers), 4096 + 64)
        assert est["engram_tables"] == REAL_ROWS_L1 * (256 + 8)  # FP8 rows + a ue8m0 byte per 32 values
        assert 14e9 < est["other_weights"] < 20e9  # 384 FP8 experts (13.6 GB), attention, embedding and head
        bs.check_fits(est, free, layers)
    both = bs.memory_estimate(bs.slice_graph((1, 14)), 4096 + 64)
    assert both["engram_tables"] == (REAL_ROWS_L1 + REAL_ROWS_L14) * 264  # both the model's tables
    with pytest.raises(bs.SliceMemoryError, match=r"layers \[1, 14\] need ~2\d\d\.\d GiB .*engram tables 188\.8.*"
                                                  r"139\.0 GiB free \(one Engram layer per GPU"):  # fmt: skip
        bs.check_fits(both, free, (1, 14))
    glu = bs.memory_estimate(bs.slice_graph((1,)), 4096 + 64, moe_glu="on")
    assert glu["glu_copies"] == 384 * 2 * 2304 * 5120  # --moe-glu on: the interleaved w1|w3 copy of the FP8 experts


def test_real_dims_engram_roofline_counts_the_gathered_rows_not_the_table(bs):
    g = bs.slice_graph((1,))
    params = _meta_params(g)
    t = 64
    rows = bs.engram_bytes(g, params, t)
    assert rows == {"l0": t * 24 * (256 + 8)}  # 3 n-gram sizes x 8 heads, each 256 FP8 values + 8 scale bytes
    bytes_l0, _ = bs.layer_roofline(g, params, t)["l0"]
    table = params["layers.0.engram.embed.weight"].numel()
    assert rows["l0"] < bytes_l0 < table / 5  # the layer's weights and rows, far below the 98 GB table
    plain = bs.layer_roofline(bs.slice_graph((0,)), _meta_params(bs.slice_graph((0,))), t)["l0"][0]
    wkv = 5 * 5120 * 6144  # the Engram projection [(4+1) D, 24 x 256] in FP8, read once
    assert bytes_l0 - plain == pytest.approx(wkv + rows["l0"], rel=0.02)  # + its scales, q/k weights


def test_fp8_fill_in_chunks_has_no_nan_codes(bs):
    x = bs._fp8((1000, 33), "cpu", step=4096)  # 9 chunks, the last one short
    codes = x.view(torch.uint8).view(-1)
    assert not bool(((codes & 0x7F) == 0x7F).any())
    chunks = x.float().view(-1).split(4096)
    assert len(chunks) == 9 and all(8 < float(c.std()) < 24 for c in chunks)  # every chunk filled with N(0, 16^2)


def test_tiny_engram_layer_runs_the_bench_path_on_one_table(bs, tmp_path, monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", False)  # the smoke mode turns it on; restored after the test
    rc = bs.main(["--preset", "tiny", "--layers", "1", "--batches", "2", "--context", "12", "--prefill", "0",
                  "--reps", "1", "--no-torch-compile", "--profile-batches", "", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    (row,) = json.loads((tmp_path / "bench_slice.json").read_text())["rows"]
    assert "error" not in row, row.get("error")
    assert row["node_runs"]["compiled"].get("engram", 0) == 2, row["node_runs"]  # gather and gate: the stand-ins
    assert row["fell_back"] == {} and set(row["layers"]) == {"embed", "l0", "head"}
    m = row["layers"]["l0"]
    assert m["line_vs_exec"] == 0.0 and m["graph_ms"] >= 0
    assert m["engram_bytes"] == 2 * 6 * (32 + 1)  # tiny: 3 n-gram sizes x 2 heads, rows of 32 FP8 + 1 scale byte


def test_compiled_and_eager_executors_read_the_one_table(bs, monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", False)
    st = bs._setup((1,), "fp8", "auto", False, "tiny", 60.0, 16)
    name = "layers.0.engram.embed.weight"
    assert st.comp.params[name] is st.params[name] and st.eager.params[name] is st.params[name]
    st.comp.run(bs._inputs(st.g, 2, 12, "cpu"))
    scale = st.params["layers.0.engram.embed.scale"]
    s = st.comp.prep_cache[("engram_s", "layers.0.engram.embed.scale")]
    assert s.untyped_storage().data_ptr() == scale.untyped_storage().data_ptr()  # the kernel's bytes: a view


def test_a_slice_that_does_not_fit_is_one_line_and_exit_2(bs, monkeypatch, capsys):
    est = bs.memory_estimate(bs.slice_graph((1, 14)), 4096 + 64)

    def refuse(args):
        bs.check_fits(est, bs.H200_FREE_GIB * bs.GiB, (1, 14))

    monkeypatch.setattr(bs, "run_from_args", refuse)
    monkeypatch.setattr(bs.torch.cuda, "is_available", lambda: True)  # past main's no-device check
    assert bs.main(["--layers", "1,14"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_slice: error: layers [1, 14] need ~") and "free" in err
