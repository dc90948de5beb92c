"""The autotuner and its database on CPU, with a fake timing function (no GPU, no compiler)."""

import json
from dataclasses import dataclass

import pytest

from deepinfer.codegen import tuner
from deepinfer.errors import ConfigError

V1 = {"tilelang": "0.1.15", "nvcc": "13.0", "torch": "2.13.0", "gpu": "NVIDIA H200"}


@dataclass(frozen=True)
class Cfg:
    block_m: int
    block_n: int


CANDS = [Cfg(64, 128), Cfg(128, 128), Cfg(128, 256)]


class FakeTimer:
    """128x256 is fastest for big M, 64x128 for small M; counts calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, cfg, shape):
        self.calls.append((cfg, dict(shape)))
        big = shape["M"] >= 1024
        return {64: 3.0 if big else 1.0, 128: 2.0, 256: 1.5 if big else 4.0}[cfg.block_m * cfg.block_n // 128]


def _tune(db, shape, timer, **kw):
    kw.setdefault("versions", V1)
    kw.setdefault("batch_invariant", False)
    return tuner.tune("fp8_gemm", shape, CANDS, timer, db=db, target="sm90", dtype="e4m3", **kw)


def test_db_round_trip_and_second_lookup_does_not_time(tmp_path):
    path = tmp_path / "sub" / "tuning.json"
    timer = FakeTimer()
    res = _tune(tuner.TuningDB(path), {"M": 4096, "N": 5120, "K": 8192}, timer)
    assert not res.cached and res.config == {"block_m": 128, "block_n": 256} and len(timer.calls) == 3
    data = json.loads(path.read_text())
    assert data["version"] == tuner.FORMAT_VERSION and len(data["records"]) == 1
    rec = next(iter(data["records"].values()))
    assert rec["versions"] == V1 and rec["time_ms"] == 1.5 and rec["target"] == "sm90"
    again = _tune(tuner.TuningDB(path), {"M": 4096, "N": 5120, "K": 8192}, timer)  # a fresh process
    assert again.cached and again.config == res.config and len(timer.calls) == 3
    assert not list(path.parent.glob(".*tmp*")), "temporary file left behind"


def test_keys_bucket_tokens_and_separate_everything_else():
    key = tuner.make_key("fp8_gemm", {"M": 3000, "N": 5120, "K": 8192}, dtype="e4m3", target="sm90", versions=V1,
                         batch_invariant=False)  # fmt: skip
    assert key.bucket == "K=8192,M=4096,N=5120"
    same = tuner.make_key("fp8_gemm", {"M": 2049, "N": 5120, "K": 8192}, dtype="e4m3", target="sm90", versions=V1,
                          batch_invariant=False)  # fmt: skip
    assert same == key
    assert tuner.shape_bucket("fp8_gemm", {"M": 1, "N": 8, "K": 8}) == "K=8,M=64,N=8"
    others = [
        tuner.make_key("fp8_gemm", {"M": 4096, "N": 1280, "K": 8192}, dtype="e4m3", target="sm90", versions=V1),
        tuner.make_key("fp8_gemm", {"M": 4096, "N": 5120, "K": 8192}, dtype="bf16", target="sm90", versions=V1),
        tuner.make_key("fp8_gemm", {"M": 4096, "N": 5120, "K": 8192}, dtype="e4m3", target="sm100", versions=V1),
        tuner.make_key("moe_grouped_gemm", {"M": 4096, "N": 5120, "K": 8192}, dtype="e4m3", target="sm90",
                       versions=V1),  # fmt: skip
    ]
    assert len({k.text() for k in others} | {key.text()}) == 5


@pytest.mark.parametrize("changed", ["tilelang", "nvcc", "torch", "gpu"], ids=lambda c: f"changed-{c}")
def test_a_version_change_invalidates(tmp_path, changed):
    db, timer = tuner.TuningDB(tmp_path / "t.json"), FakeTimer()
    _tune(db, {"M": 4096, "N": 5120, "K": 8192}, timer)
    v2 = {**V1, changed: "other"}
    res = _tune(tuner.TuningDB(tmp_path / "t.json"), {"M": 4096, "N": 5120, "K": 8192}, timer, versions=v2)
    assert not res.cached and len(timer.calls) == 6
    db2 = tuner.TuningDB(tmp_path / "t.json")
    assert len(db2.records) == 2 and db2.prune(v2) == 1 and len(db2.records) == 1


def test_batch_invariant_pins_one_config_for_every_batch_size(tmp_path, monkeypatch):
    monkeypatch.setenv(tuner.BATCH_INVARIANT_ENV, "1")
    db, timer = tuner.TuningDB(tmp_path / "t.json"), FakeTimer()
    small = tuner.tune("fp8_gemm", {"M": 16, "N": 5120, "K": 8192}, CANDS, timer, db=db, target="sm90",
                       dtype="e4m3", versions=V1)  # fmt: skip
    assert small.key.bucket == "K=8192,M=*,N=5120"
    assert {s["M"] for _, s in timer.calls} == {tuner.PIN_TOKENS}  # timed at the pinned size, not at 16
    big = tuner.tune("fp8_gemm", {"M": 8192, "N": 5120, "K": 8192}, CANDS, timer, db=db, target="sm90",
                     dtype="e4m3", versions=V1)  # fmt: skip
    assert big.cached and big.config == small.config and len(timer.calls) == 3
    # unpinned, the small batch gets its own (different) choice under a different key
    monkeypatch.setenv(tuner.BATCH_INVARIANT_ENV, "0")
    free = tuner.tune("fp8_gemm", {"M": 16, "N": 5120, "K": 8192}, CANDS, timer, db=db, target="sm90",
                      dtype="e4m3", versions=V1)  # fmt: skip
    assert not free.cached and free.config == {"block_m": 64, "block_n": 128} != small.config


def test_bad_env_and_failing_candidates(tmp_path, monkeypatch):
    monkeypatch.setenv(tuner.BATCH_INVARIANT_ENV, "yes")
    with pytest.raises(ConfigError, match="DEEPINFER_BATCH_INVARIANT"):
        tuner.batch_invariant_mode()
    monkeypatch.delenv(tuner.BATCH_INVARIANT_ENV)

    def flaky(cfg, shape):
        if cfg.block_n == 256:
            raise RuntimeError("does not build")
        return float(cfg.block_m)

    res = _tune(tuner.TuningDB(tmp_path / "t.json"), {"M": 64, "N": 256, "K": 256}, flaky)
    assert res.config == {"block_m": 64, "block_n": 128}
    assert res.timings['{"block_m": 128, "block_n": 256}'] is None  # recorded as failed
    with pytest.raises(ConfigError, match="every candidate failed"):
        _tune(tuner.TuningDB(tmp_path / "u.json"), {"M": 64, "N": 256, "K": 256}, lambda c, s: 1 / 0)


def test_save_merges_with_records_written_by_another_tuner(tmp_path):
    path = tmp_path / "t.json"
    a, b = tuner.TuningDB(path), tuner.TuningDB(path)
    assert a.records == {} and b.records == {}  # both loaded the empty file
    _tune(a, {"M": 4096, "N": 5120, "K": 8192}, FakeTimer())
    _tune(b, {"M": 4096, "N": 1280, "K": 5120}, FakeTimer())
    assert len(tuner.TuningDB(path).records) == 2


def test_corrupt_db_is_a_one_line_error(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        tuner.TuningDB(path).get(tuner.make_key("fp8_gemm", {"M": 1}, dtype="e4m3", target="sm90", versions=V1))


def test_db_path_env_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv(tuner.DB_ENV, str(tmp_path / "x.json"))
    assert tuner.db_path() == tmp_path / "x.json"
    monkeypatch.delenv(tuner.DB_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuner.db_path() == tmp_path / "deepinfer" / "tuning.json"


def test_cli_tune_without_gpu_says_so_in_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from deepinfer.cli import main

    assert main(["tune", "--target", "sm90", "--kernels", "fp8_gemm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU" in err[0]


def test_fp8_gemm_tune_space_fits_v41_shapes():
    from deepinfer.codegen.kernels import fp8_gemm

    for n, k in ((1280, 5120), (32768, 1280), (5120, 8192), (2304, 5120)):
        space = fp8_gemm.sm90_tune_space(4096, n, k, 32)
        assert space and all(n % c.block_n == 0 and k % c.block_k == 0 for c in space)
