"""Compilation targets as data.

A target says what a kernel may use (architecture, shared memory, dtypes, backends) and what the cost
model should expect (SM count, bandwidth, peak rates). The bandwidth and peak figures here are NOMINAL
vendor numbers (ANCHORS.md §A.0); benchmarks measure the real limits in the same run and report against
those, never against these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.errors import ConfigError

TB = 1e12  # bytes/s or flop/s per "T"


@dataclass(frozen=True)
class Target:
    """One compilation target.

    Attributes:
        name: our name (`cpu`, `sm90`, `sm100`, `ascend950`).
        arch: the architecture string the toolchain wants (`sm_90a`, `sm_100a`, `dav-3510`, `x86_64`).
        tilelang_target: the JSON-dict target TileLang 0.1.15 accepts (CLI strings are rejected).
        sm_count: streaming multiprocessors (or AI cores) for grid sizing and the cost model.
        smem_per_block: max dynamic shared memory (UB on Ascend) per block, in bytes.
        hbm_bw_nominal: nominal HBM bandwidth, bytes/s (vendor sheet, not measured).
        peak_fp8_nominal: nominal dense FP8 rate, flop/s (0 where there is no FP8 unit).
        peak_bf16_nominal: nominal dense BF16 rate, flop/s.
        dtypes: storage dtypes kernels may take.
        backends: code generators that apply, in order of preference.
        mma_sass: SASS opcode that proves the tensor cores are used (empty where not checkable).
    """

    name: str
    arch: str
    tilelang_target: dict | str
    sm_count: int
    smem_per_block: int
    hbm_bw_nominal: float
    peak_fp8_nominal: float
    peak_bf16_nominal: float
    dtypes: tuple[str, ...]
    backends: tuple[str, ...]
    mma_sass: str = ""
    notes: str = field(default="", compare=False)

    @property
    def is_cuda(self) -> bool:
        return self.arch.startswith("sm_")

    @property
    def cc(self) -> int:
        """CUDA compute capability as an int (90, 100); 0 for non-CUDA targets."""
        return int(self.arch[3:].rstrip("a")) if self.is_cuda else 0

    def ridge_point(self, dtype: str = "fp8") -> float:
        """Arithmetic intensity (flop/byte) where the nominal roofline turns compute-bound."""
        peak = self.peak_fp8_nominal if dtype == "fp8" else self.peak_bf16_nominal
        return peak / self.hbm_bw_nominal


_CUDA_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3", "float8_e8m0", "int32", "int64")

TARGETS: dict[str, Target] = {
    "cpu": Target(
        name="cpu",
        arch="x86_64",
        tilelang_target="c",
        sm_count=1,
        smem_per_block=0,
        hbm_bw_nominal=0.05 * TB,
        peak_fp8_nominal=0.0,
        peak_bf16_nominal=0.001 * TB,
        dtypes=("float32", "bfloat16", "int32", "int64"),
        backends=("torch", "tilelang-c", "triton-interpret"),
        notes="torch references; TileLang `c` target only for fp32 numerics checks",
    ),
    "sm90": Target(
        name="sm90",
        arch="sm_90a",
        tilelang_target={"kind": "cuda", "arch": "sm_90a"},
        sm_count=132,
        smem_per_block=227 * 1024,
        hbm_bw_nominal=4.8 * TB,  # H200 SXM; H100 is 3.35
        peak_fp8_nominal=1979 * 1e12,
        peak_bf16_nominal=989 * 1e12,
        dtypes=_CUDA_DTYPES,
        backends=("tilelang", "triton", "torch"),
        mma_sass="HGMMA",
    ),
    "sm100": Target(
        name="sm100",
        arch="sm_100a",
        tilelang_target={"kind": "cuda", "arch": "sm_100a"},
        sm_count=148,
        smem_per_block=227 * 1024,
        hbm_bw_nominal=8.0 * TB,  # B200 HGX
        peak_fp8_nominal=4500 * 1e12,
        peak_bf16_nominal=2250 * 1e12,
        dtypes=_CUDA_DTYPES + ("float4_e2m1",),
        backends=("tilelang", "triton", "torch"),
        mma_sass="UTCHMMA",
        notes="compile-only here: cubin + SASS checks",
    ),
    "ascend950": Target(
        name="ascend950",
        arch="dav-3510",
        tilelang_target="ascend",
        sm_count=32,  # AI cores (cube); nominal, not verified
        smem_per_block=256 * 1024,  # UB per vector core; nominal
        hbm_bw_nominal=1.6 * TB,  # nominal, unverified
        peak_fp8_nominal=0.0,
        peak_bf16_nominal=430 * 1e12,  # derived in ANCHORS.md §A.0
        dtypes=("float32", "bfloat16", "float16", "int32"),
        backends=("tilelang-ascend",),
        notes="AscendC source emission only; compiles where CANN's bisheng exists",
    ),
}


def get_target(name: str) -> Target:
    """Look a target up by name; unknown names raise ConfigError with a one-line message."""
    try:
        return TARGETS[name]
    except KeyError:
        known = ", ".join(TARGETS)
        raise ConfigError(f"unknown target {name!r}; expected one of: {known}") from None
