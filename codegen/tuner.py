"""Autotuner with a persistent tuning database.

    db = TuningDB()                                     # $DEEPINFER_TUNE_DB or <user cache>/deepinfer/tuning.json
    cfg, hit = tune("fp8_gemm", {"M": 4096, "N": 5120, "K": 8192, "g": 32}, candidates, time_fn, db=db, target="sm90")

A record is keyed by (kernel family, shape bucket, dtype, target, toolkit versions). The versions are
tilelang, nvcc, torch and the GPU name (`toolkit_versions`): a record made under other versions is not
found (it is *invalidated*, and `TuningDB.prune` drops it), so upgrading a compiler or moving to another
GPU retunes instead of reusing a stale choice.

Shape buckets: the token dimension (`M`, `T`, `B`, named per family in `TOKEN_DIMS`) is rounded up to a
power of two (at least 64); every other dimension is exact (they come from the model config).

Batch invariance (`DEEPINFER_BATCH_INVARIANT=1`, or `batch_invariant=True`): the token dimension is
dropped from the key (bucket `M=*`) and tuning is done once at a fixed reference size (`PIN_TOKENS`),
so one config serves every batch size. Our kernels compute each output row independently of the others
with a fixed reduction order for a given config (no split-K, no atomics), so pinning the config is what
makes a row's result independent of how many other rows share the launch. The pinned record is stored
under its own key, so pinned and unpinned choices never mix.

The database is one JSON file: {"version": 1, "records": {key: record}}. Writes are atomic (temporary
file in the same directory, fsync, os.replace) and merge with what is on disk at save time, so two
tuners writing different keys do not lose each other's records.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

from deepinfer.errors import ConfigError

DB_ENV = "DEEPINFER_TUNE_DB"
BATCH_INVARIANT_ENV = "DEEPINFER_BATCH_INVARIANT"
FORMAT_VERSION = 1
PIN_TOKENS = 4096  # the reference token count a pinned (batch-invariant) config is tuned at
TOKEN_DIMS = {
    "fp8_gemm": "M",
    "moe_grouped_gemm": "M",
    "rmsnorm_quant": "M",
    "moe_routing": "T",
    "hyper_connection": "T",
    "sparse_attn_decode": "B",
}


def db_path() -> Path:
    """`$DEEPINFER_TUNE_DB`, else `$XDG_CACHE_HOME/deepinfer/tuning.json`, else ~/.cache/deepinfer/tuning.json."""
    env = os.environ.get(DB_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deepinfer" / "tuning.json"


def batch_invariant_mode() -> bool:
    val = os.environ.get(BATCH_INVARIANT_ENV, "")
    if val not in ("", "0", "1"):
        raise ConfigError(f"{BATCH_INVARIANT_ENV} must be 0 or 1, got {val!r}")
    return val == "1"


def toolkit_versions() -> dict[str, str]:
    """The versions a tuning result depends on; missing tools read 'none'."""
    out = {}
    try:
        import tilelang

        out["tilelang"] = str(getattr(tilelang, "__version__", "unknown"))
    except ImportError:
        out["tilelang"] = "none"
    try:
        from deepinfer.codegen.tilelang_backend import nvcc_path, nvcc_version

        out["nvcc"] = nvcc_version() if nvcc_path() else "none"
    except Exception:  # nvcc present but broken: key on that, do not crash the lookup
        out["nvcc"] = "none"
    try:
        import torch

        out["torch"] = torch.__version__
        out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    except ImportError:
        out["torch"], out["gpu"] = "none", "none"
    return out


def shape_bucket(family: str, shape: dict[str, int], batch_invariant: bool = False) -> str:
    """Canonical text of a shape: token dim rounded up to a power of two (or `*` when pinned)."""
    tok = TOKEN_DIMS.get(family)
    parts = []
    for name in sorted(shape):
        val = shape[name]
        if name == tok:
            val = "*" if batch_invariant else str(max(64, 1 << max(0, int(val) - 1).bit_length()))
        parts.append(f"{name}={val}")
    return ",".join(parts)


@dataclass(frozen=True)
class Key:
    family: str
    bucket: str
    dtype: str
    target: str
    versions: tuple[tuple[str, str], ...]

    def text(self) -> str:
        vers = ";".join(f"{k}={v}" for k, v in self.versions)
        return f"{self.family}|{self.bucket}|{self.dtype}|{self.target}|{vers}"


def make_key(
    family: str,
    shape: dict[str, int],
    *,
    dtype: str,
    target: str,
    versions: dict[str, str] | None = None,
    batch_invariant: bool | None = None,
) -> Key:
    bi = batch_invariant_mode() if batch_invariant is None else batch_invariant
    vers = toolkit_versions() if versions is None else versions
    return Key(family, shape_bucket(family, shape, bi), dtype, target, tuple(sorted(vers.items())))


def config_to_dict(cfg) -> dict:
    return asdict(cfg) if is_dataclass(cfg) else dict(cfg)


class TuningDB:
    """The persistent JSON database. Load is lazy; `save` is atomic and merges with the file on disk."""

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else db_path()
        self._records: dict[str, dict] | None = None

    @property
    def records(self) -> dict[str, dict]:
        if self._records is None:
            self._records = self._read()
        return self._records

    def _read(self) -> dict[str, dict]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"tuning database {self.path} is unreadable ({e}); delete it to retune") from None
        if data.get("version") != FORMAT_VERSION:
            return {}  # another format: start over (the file is replaced on the next save)
        return dict(data.get("records", {}))

    def get(self, key: Key) -> dict | None:
        return self.records.get(key.text())

    def put(self, key: Key, config: dict, time_ms: float, timings: dict[str, float] | None = None) -> dict:
        rec = {
            "family": key.family,
            "bucket": key.bucket,
            "dtype": key.dtype,
            "target": key.target,
            "versions": dict(key.versions),
            "config": config,
            "time_ms": time_ms,
            "timings": timings or {},
            "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        self.records[key.text()] = rec
        return rec

    def prune(self, versions: dict[str, str] | None = None) -> int:
        """Drop records made under other toolkit versions; returns how many were dropped."""
        vers = toolkit_versions() if versions is None else versions
        stale = [k for k, r in self.records.items() if r.get("versions") != vers]
        for k in stale:
            del self.records[k]
        return len(stale)

    def save(self) -> Path:
        on_disk = self._read()
        merged = {**on_disk, **self.records}
        self._records = merged
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump({"version": FORMAT_VERSION, "records": merged}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        return self.path


@dataclass
class TuneResult:
    config: dict
    time_ms: float
    cached: bool
    key: Key
    timings: dict[str, float]


def tune(
    family: str,
    shape: dict[str, int],
    candidates: Sequence,
    time_fn: Callable[[object, dict[str, int]], float],
    *,
    db: TuningDB,
    target: str,
    dtype: str,
    versions: dict[str, str] | None = None,
    batch_invariant: bool | None = None,
    force: bool = False,
    save: bool = True,
) -> TuneResult:
    """Return the fastest candidate for `shape`, from the database when it has the key.

    `time_fn(config, shape)` returns milliseconds (raise to reject a candidate). With batch invariance
    the candidates are timed at the pinned shape (token dim = PIN_TOKENS), whatever `shape` says.
    """
    bi = batch_invariant_mode() if batch_invariant is None else batch_invariant
    key = make_key(family, shape, dtype=dtype, target=target, versions=versions, batch_invariant=bi)
    rec = None if force else db.get(key)
    if rec is not None:
        return TuneResult(rec["config"], rec["time_ms"], True, key, rec.get("timings", {}))
    if not candidates:
        raise ConfigError(f"no candidate configs for {family} at {key.bucket}")
    timed_shape = dict(shape)
    tok = TOKEN_DIMS.get(family)
    if bi and tok in timed_shape:
        timed_shape[tok] = PIN_TOKENS
    timings: dict[str, float | None] = {}
    best, best_ms = None, float("inf")
    for cfg in candidates:
        label = getattr(cfg, "tag", None) or json.dumps(config_to_dict(cfg), sort_keys=True)
        try:
            ms = float(time_fn(cfg, timed_shape))
        except Exception:  # a config that fails to build, run or check is skipped (recorded as null)
            timings[label] = None
            continue
        timings[label] = ms
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise ConfigError(f"every candidate failed for {family} at {key.bucket}")
    db.put(key, config_to_dict(best), best_ms, timings)
    if save:
        db.save()
    return TuneResult(config_to_dict(best), best_ms, False, key, timings)


# ---------------------------------------------------------------------------------------------- GPU tuning


def _fp8_gemm_space(shape: dict[str, int]):
    from deepinfer.codegen.kernels import fp8_gemm

    return fp8_gemm.sm90_tune_space(shape["M"], shape["N"], shape["K"], shape["g"])


def _fp8_gemm_timer(cfg, shape: dict[str, int]) -> float:  # pragma: no cover - needs a GPU
    import tilelang
    import torch
    from triton.testing import do_bench

    from deepinfer.codegen.kernels import fp8_gemm
    from deepinfer.codegen.kernels._common import quant_fp8_blocks, quant_fp8_groups

    M, N, K, g = shape["M"], shape["N"], shape["K"], shape["g"]
    prog = fp8_gemm.program(M, N, K, act_group=g, weight_block=g, target="sm90", cfg=cfg)
    kernel = tilelang.compile(prog, target={"kind": "cuda", "arch": "sm_90a"}, execution_backend="tvm_ffi")
    a, sa = quant_fp8_groups(torch.randn(M, K, device="cuda"), g)
    b, sb = quant_fp8_blocks(torch.randn(N, K, device="cuda") * 0.05, g)
    sa_t, c = sa.T.contiguous(), torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    kernel(a, sa_t, b, sb, c)
    ref = fp8_gemm.reference(a, sa, b, sb, g, g)
    err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
    if not err < 2e-2:
        raise AssertionError(f"config {cfg.tag} is wrong: rel err {err:.2e}")
    return do_bench(lambda: kernel(a, sa_t, b, sb, c), warmup=10, rep=40, return_mode="median")


# family -> (shapes to tune at, dtype, candidate space, GPU timer); V4.1-Flash prefill GEMMs
TUNABLE = {
    "fp8_gemm": (
        [{"M": 4096, "N": n, "K": k, "g": 32} for n, k in ((1280, 5120), (32768, 1280), (5120, 8192), (2304, 5120))],
        "e4m3/ue8m0",
        _fp8_gemm_space,
        _fp8_gemm_timer,
    ),
}


def tune_target(target: str, kernels: Sequence[str] | None, *, db: TuningDB | None = None, log=print) -> int:
    """`deepinfer tune`: tune every (family, shape) of TUNABLE on this machine's GPU."""
    import torch

    if target != "sm90":
        raise ConfigError(f"tuning runs on the target's own GPU; only sm90 (H100/H200) is tunable here, not {target}")
    if not torch.cuda.is_available():
        raise ConfigError("no CUDA GPU on this machine: tuning needs the target GPU (run `deepinfer tune` there)")
    names = list(kernels) if kernels else list(TUNABLE)
    unknown = [n for n in names if n not in TUNABLE]
    if unknown:
        raise ConfigError(f"no tuner for {', '.join(unknown)}; tunable: {', '.join(TUNABLE)}")
    db = db or TuningDB()
    versions = toolkit_versions()
    t_all = time.time()
    for name in names:
        shapes, dtype, space, timer = TUNABLE[name]
        for shape in shapes:
            t0 = time.time()
            res = tune(name, shape, space(shape), timer, db=db, target=target, dtype=dtype, versions=versions)
            how = "cached" if res.cached else f"tuned {len(res.timings)} configs"
            log(f"{name} {res.key.bucket}: {res.time_ms * 1e3:.1f} us {res.config} ({how}, {time.time() - t0:.1f} s)")
    log(f"tuning database: {db.path} ({time.time() - t_all:.1f} s)")
    return 0
