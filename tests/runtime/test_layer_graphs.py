"""Per-layer decode graphs (runtime/layer_graphs.py) and the straight-line layer export (runtime/layer_export.py),
on CPU: the tiny V4.1 slice of benchmarks/bench_slice.py (layers 2 and 6: a ratio-2 kv source and the ratio-1
kv / index / candidate source), kernels replaced by their torch stand-ins, CUDA graphs by the emulated backend
(capture under a strict HostSyncGuard, replay = rerun into the captured outputs).

The oracle is the executor's own eager run of the whole graph (GraphExecutor.run): the per-layer step must give
the same bits, whichever segments replay and whichever fall back."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from deepinfer.passes.select_logit_rows import select_logit_rows
from deepinfer.runtime import cuda_graphs as cg
from deepinfer.runtime import kernel_adapters as ka
from deepinfer.runtime.cuda_executor import GraphExecutor, KernelCache
from deepinfer.runtime.layer_export import export_segment
from deepinfer.runtime.layer_graphs import LayerGraphs, compare_outputs, split_segments
from deepinfer.runtime.session import allocate_caches

ROOT = Path(__file__).resolve().parents[2]


def _bench_slice():
    spec = importlib.util.spec_from_file_location("bench_slice_for_tests", ROOT / "benchmarks" / "bench_slice.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_slice():
    bs = _bench_slice()
    g = bs.slice_graph((2, 6), "fp8", "tiny")
    return bs, g, bs.gpu_weights(g, device="cpu")


def _stand_in(key):
    kernel = ka.emulated_kernel(key)

    def run(*args):
        with cg.unguarded():  # a torch stand-in reads values on the host; the kernel it stands for does not
            return kernel(*args)

    return run


def _executor(g, params, **kw) -> GraphExecutor:
    return GraphExecutor(g, params, kernels=KernelCache(builder=_stand_in), sync_free="always", max_positions=64,
                         **kw)  # fmt: skip


def _feeds(g, t: int, context: int = 12) -> dict:
    gen = torch.Generator().manual_seed(t)
    return {"tokens": torch.randint(3, 500, (t,), generator=gen), "positions": torch.arange(context, context + t),
            **allocate_caches(g, context + t)}  # fmt: skip


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def test_segments_cover_the_steps_in_order_and_read_only_what_came_before(tiny_slice):
    _, g, params = tiny_slice
    ex = GraphExecutor(g, params, compiled=False)
    segs = split_segments(ex.steps, g)
    assert [s.name for s in segs] == ["embed", "l0", "l1", "head"]
    assert [st for s in segs for st in s.steps] == ex.steps
    available = {v.name for v in g.inputs}
    for s in segs:
        assert set(s.inputs) <= available, (s.name, set(s.inputs) - available)
        available |= set(s.outputs)
        assert all(p in params for p in s.params)
    assert {v.name for v in g.outputs} <= available
    # every returned value (logits, each layer's new caches) is some segment's output, and a segment keeps
    # only what a later segment reads or the graph returns
    returned = {v.name for v in g.outputs}
    assert sum(n in returned for s in segs for n in s.outputs) == len(returned)
    for i, s in enumerate(segs):
        read_later = {n for later in segs[i + 1 :] for n in later.inputs}
        assert all(n in returned or n in read_later for n in s.outputs), s.name


def test_every_layer_replays_a_graph_and_the_step_equals_the_eager_run(tiny_slice, monkeypatch):
    _, g, params = tiny_slice
    monkeypatch.setattr(ka, "EMULATE", True)
    feeds = _feeds(g, 1)
    want = _executor(g, params).run(feeds)
    backend = cg.EmulatedGraphBackend()
    lg = LayerGraphs(_executor(g, params), feeds, backend)
    lg.prepare()
    assert not lg.eager, lg.report()
    assert backend.captures == 4 and "4 of 4 segments replay a graph" in lg.report()
    assert lg.ex.stats.compiled["moe_grouped_gemm"] + lg.ex.stats.compiled["fp8_gemm"] > 0, lg.ex.report()
    for _ in range(2):
        assert _same(lg.run(timed=True), want)
    assert set(lg.layer_ms()) == {"embed", "l0", "l1", "head"} and all(v >= 0 for v in lg.layer_ms().values())


def test_new_contents_of_the_static_feeds_are_what_the_graphs_read(tiny_slice, monkeypatch):
    _, g, params = tiny_slice
    monkeypatch.setattr(ka, "EMULATE", True)
    feeds = _feeds(g, 1)
    feeds["positions"].fill_(11)
    lg = LayerGraphs(_executor(g, params), feeds, cg.EmulatedGraphBackend())
    first = lg.run()  # prepares on the first step
    names = [e["name"] for e in g.meta["caches"]]
    nxt = {"tokens": torch.tensor([77]), "positions": torch.tensor([12]),
           **{n: c.clone() for n, c in zip(names, first[1 : 1 + len(names)])}}  # fmt: skip
    for k, v in nxt.items():
        feeds[k].copy_(v)  # the next decode step written into the static buffers
    assert not lg.eager and _same(lg.run(), _executor(g, params).run(nxt))


def test_a_layer_that_reads_the_host_runs_eagerly_with_the_read_named(tiny_slice, monkeypatch):
    _, g, params = tiny_slice
    monkeypatch.setattr(ka, "EMULATE", True)
    feeds = _feeds(g, 1)
    want = _executor(g, params).run(feeds)
    ex = _executor(g, params)
    run_node = ex._run_node

    def reads_in_l1(step, args, attrs, t):
        if step.layer == "l1" and args and isinstance(args[0], torch.Tensor):
            float(args[0].float().sum())  # the host read a graph cannot hold
        return run_node(step, args, attrs, t)

    monkeypatch.setattr(ex, "_run_node", reads_in_l1)
    lg = LayerGraphs(ex, feeds, cg.EmulatedGraphBackend())
    lg.prepare()
    assert set(lg.fell_back()) == {"l1"}, lg.report()
    assert "host read of a device value" in lg.fell_back()["l1"] and "test_layer_graphs.py" in lg.fell_back()["l1"]
    assert "l1     eager -- reads device values on the host" in lg.report()
    assert _same(lg.run(), want)


class _FlakyBackend(cg.EmulatedGraphBackend):
    """Capture of the n-th segment raises; replay of the m-th writes wrong numbers."""

    def __init__(self, fail_capture: int | None = None, corrupt_replay: int | None = None):
        super().__init__()
        self.fail_capture, self.corrupt_replay, self.seen = fail_capture, corrupt_replay, 0
        self.index: dict = {}

    def capture(self, fn):
        i, self.seen = self.seen, self.seen + 1
        if i == self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        handle, outs = super().capture(fn)
        self.index[id(fn)] = i
        return handle, outs

    def replay(self, handle, outs):
        super().replay(handle, outs)
        if self.index.get(id(handle)) == self.corrupt_replay:
            for t in cg._flat(outs):
                if t.is_floating_point() and t.element_size() > 1:
                    t.add_(1.0)
        return outs


@pytest.mark.parametrize("flaw", ["capture", "replay"])
def test_a_failed_capture_or_replay_check_falls_back_for_that_layer_only(tiny_slice, monkeypatch, flaw):
    _, g, params = tiny_slice
    monkeypatch.setattr(ka, "EMULATE", True)
    feeds = _feeds(g, 1)
    want = _executor(g, params).run(feeds)
    backend = _FlakyBackend(fail_capture=1) if flaw == "capture" else _FlakyBackend(corrupt_replay=2)
    lg = LayerGraphs(_executor(g, params), feeds, backend)
    lg.prepare()
    expected = {"capture": ("l0", "capture failed: RuntimeError"), "replay": ("l1", "replay differs")}[flaw]
    assert list(lg.fell_back()) == [expected[0]], lg.report()
    assert expected[1] in lg.fell_back()[expected[0]]
    assert _same(lg.run(), want)


def test_graphs_off_runs_every_segment_eagerly(tiny_slice, monkeypatch):
    _, g, params = tiny_slice
    monkeypatch.setattr(ka, "EMULATE", True)
    feeds = _feeds(g, 4)
    lg = LayerGraphs(_executor(g, params), feeds, None)
    assert _same(lg.run(), _executor(g, params).run(feeds))
    assert set(lg.fell_back().values()) == {"graphs off"}


def test_compare_outputs_bounds():
    x = torch.randn(4, 8)
    assert compare_outputs({"a": x.clone()}, {"a": x}) == (True, "bit-identical")
    assert not compare_outputs({"a": x + 0.1}, {"a": x})[0]
    assert not compare_outputs({"a": x[:2]}, {"a": x})[0]
    q = torch.randn(64, 64).to(torch.float8_e4m3fn)
    flipped = q.clone()
    flipped.view(torch.uint8)[0, 0] ^= 1
    assert compare_outputs({"q": flipped}, {"q": q})[0]  # one code in 4096: an atomic's order
    flipped.view(torch.uint8)[:8] ^= 1
    assert not compare_outputs({"q": flipped}, {"q": q})[0]
    assert compare_outputs({"n": torch.tensor([float("nan")])}, {"n": torch.tensor([1.0])})[0] is False
    masked = torch.tensor([float("-inf"), 2.0, float("nan")])  # masked scores: equal infinities are equal
    assert compare_outputs({"s": masked.clone()}, {"s": masked}) == (True, "bit-identical")
    assert not compare_outputs({"s": torch.tensor([0.0, 2.0, float("nan")])}, {"s": masked})[0]


def test_straight_line_layers_are_the_executor_references_node_for_node(tiny_slice):
    _, g, params = tiny_slice
    feeds = _feeds(g, 4)
    ex = GraphExecutor(g, params, compiled=False)
    lg = LayerGraphs(ex, feeds, None)
    lg.prepare()
    for i, seg in enumerate(lg.segments):
        fn = export_segment(seg, g, lg.env)
        assert fn.source.count("_seq(_r") == len(seg.steps)
        vals = lg._vals(i, lg._warm_source(i))
        x, p = fn.arguments(vals, params)
        assert _same(fn(x, p), [lg.warm[i][n] for n in seg.outputs]), seg.name


def test_sync_free_at_every_t_gives_the_same_bits(tiny_slice):
    _, g, params = tiny_slice
    feeds = _feeds(g, 4)
    plain = GraphExecutor(g, params, compiled=False).run(feeds)
    assert _same(GraphExecutor(g, params, compiled=False, sync_free="always").run(feeds), plain)


def test_bench_slice_tiny_smoke_mode_reports_graph_rows(tiny_slice, tmp_path, monkeypatch, capsys):
    bs, _, _ = tiny_slice
    monkeypatch.setattr(ka, "EMULATE", False)  # the smoke mode turns it on; restored after the test
    rc = bs.main(["--preset", "tiny", "--layers", "2,6", "--batches", "1", "--context", "12", "--prefill", "0",
                  "--reps", "1", "--no-torch-compile", "--profile-batches", "1", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "bench_slice.json").read_text())
    (row,) = data["rows"]
    prof = row["profile"]  # a graph per node: every node timed once, none eager, op sums = node sum
    ran = select_logit_rows(tiny_slice[1])  # the slice as bench_slice runs it: the head's rows selected
    assert len(prof["nodes"]) == len(ran.nodes) == len(tiny_slice[1].nodes) + 2 and prof["eager_nodes"] == []
    assert sum(prof["by_op"].values()) == pytest.approx(prof["node_graphs_ms"])
    assert data["nominal_limits"] and "error" not in row, row.get("error")
    assert set(row["layers"]) == {"embed", "l0", "l1", "head"} and row["fell_back"] == {}
    for layer in ("l0", "l1"):
        m = row["layers"][layer]
        assert m["graph_ms"] >= 0 and m["line_ms"] >= 0 and m["line_vs_exec"] == 0.0
        assert m["compile_note"].startswith("off")
    out = capsys.readouterr().out
    assert "graph ms" in out and "4 of 4 segments replay a graph" in out


def test_deepinfer_bench_tiny_runs_on_cpu(tmp_path, monkeypatch):
    """`deepinfer bench` loads bench_slice.py by path (no package around it) and passes the graph arguments."""
    from deepinfer.cli import main

    monkeypatch.setattr(ka, "EMULATE", False)
    rc = main(["bench", "--preset", "tiny", "--layers", "2,6", "--batches", "1", "--context", "12", "--prefill", "0",
               "--reps", "1", "--no-torch-compile", "--graphs", "off", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    (row,) = json.loads((tmp_path / "bench_slice.json").read_text())["rows"]
    assert row["graphs"] == "off (--graphs off)" and row["layers"]["l0"]["line_ms"] >= 0


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_gpu_layer_graphs_replay_the_eager_step(tiny_slice, t):
    """On the H200: the tiny slice's step with its compiled kernels, as CUDA graphs per layer, equals the eager
    executor bit for bit; at T=1 every layer is captured (at T=4 the tiny MoE's contiguous layout reads its
    tile count on the host: that layer must fall back with the read named)."""
    bs, g, _ = tiny_slice
    params = bs.gpu_weights(g, device="cuda")
    feeds = {k: v.cuda() for k, v in _feeds(g, t).items()}
    kernels = KernelCache()
    want = GraphExecutor(g, params, kernels=kernels, sync_free="always", max_positions=64).run(feeds)
    ex = GraphExecutor(g, params, kernels=kernels, sync_free="always", max_positions=64)
    lg = LayerGraphs(ex, feeds, cg.CudaGraphBackend(torch.device("cuda")))
    got = lg.run(timed=True)
    assert _same(got, want), lg.report()
    assert ex.stats.compiled, ex.report()
    if t == 1:
        assert not lg.eager, lg.report()
    assert all(why for why in lg.fell_back().values()) and all(v >= 0 for v in lg.layer_ms().values())
