"""TileLang backend: lower a prim_func for a target, compile CUDA to cubin, read its SASS.

The path is the one TOOLCHAIN.md §2 verified on a GPU-less machine:
  prim_func --tilelang.lower (JSON-dict target, inside `with Target(...)`)--> CUDA C++ / AscendC text
  CUDA C++  --local nvcc, tilelang's own include paths and flags-->         cubin
  cubin     --cuobjdump shipped in the triton wheel-->                       SASS, opcode counts
Ascend 950 stops at AscendC source: `bisheng` (CANN) is not available here.

Everything expensive is cached on disk by a content hash of its inputs (source text, arch, flags,
compiler version), so the second build of an unchanged kernel costs only the lowering.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from deepinfer.codegen.targets import Target, get_target
from deepinfer.errors import ConfigError

# The flags tilelang itself passes to nvcc (tilelang/cuda/backend.py); -lineinfo keeps SASS readable.
NVCC_FLAGS = ("--cubin", "-O3", "-lineinfo", "-std=c++20", "-w")


@dataclass
class Artifact:
    """What one kernel build produced.

    Attributes:
        name: kernel name (family + shape + config), used for file names.
        target: target name.
        source: generated CUDA C++ or AscendC text.
        source_path: where the source was written.
        cubin_path: compiled cubin (CUDA targets after `compile_cubin`), else None.
        sass: disassembly of the cubin ("" until `dump_sass`).
        opcodes: SASS opcode counts (base mnemonic, e.g. "HGMMA", "UTCQMMA").
    """

    name: str
    target: str
    source: str
    source_path: Path
    cubin_path: Path | None = None
    sass: str = ""
    opcodes: Counter = field(default_factory=Counter)


def cache_dir() -> Path:
    """`DEEPINFER_CODEGEN_CACHE`, else `$TILELANG_CACHE_DIR/deepinfer`, else ~/.cache/deepinfer/codegen."""
    env = os.environ.get("DEEPINFER_CODEGEN_CACHE")
    if env:
        root = Path(env)
    elif os.environ.get("TILELANG_CACHE_DIR"):
        root = Path(os.environ["TILELANG_CACHE_DIR"]) / "deepinfer"
    else:
        root = Path.home() / ".cache" / "deepinfer" / "codegen"
    root.mkdir(parents=True, exist_ok=True)
    return root


def content_hash(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


# ---------------------------------------------------------------------------------------------- tools


def tilelang_available() -> bool:
    try:
        import tilelang  # noqa: F401
    except ImportError:
        return False
    return True


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def cuobjdump_path() -> str | None:
    """The system cuobjdump, else the one the triton wheel carries (CUDA 12.8, reads sm_90a/sm_100a)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.exists() else None


@lru_cache(maxsize=1)
def nvcc_version() -> str:
    out = subprocess.run([nvcc_path() or "nvcc", "--version"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def tilelang_include_dirs() -> list[str]:
    import tilelang.env as env

    return [str(Path(env.TILELANG_TEMPLATE_PATH).resolve()), str(Path(env.CUTLASS_INCLUDE_DIR).resolve())]


# ---------------------------------------------------------------------------------------------- lower


def lower(prim_func, target: Target | str) -> str:
    """Lower a TileLang prim_func to device source text (CUDA C++ or AscendC) for `target`."""
    import tilelang
    from tvm.target import Target as TvmTarget

    tgt = get_target(target) if isinstance(target, str) else target
    if tgt.name == "cpu":
        raise ConfigError("target 'cpu' has no device source; use compile_cpu() for the `c` target")
    # 0.1.15 rejects CLI target strings and needs a Target context around lower() (TOOLCHAIN.md §2).
    with TvmTarget(tgt.tilelang_target):
        return tilelang.lower(prim_func, target=tgt.tilelang_target).kernel_source


def write_source(name: str, target: Target, source: str) -> Path:
    ext = ".cpp" if target.name == "ascend950" else ".cu"
    path = cache_dir() / target.name / f"{name}-{content_hash(source)}{ext}"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        _atomic_write(path, source.encode())
    return path


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------- compile


def _cubin_path(source_path: Path, target: Target) -> Path:
    key = content_hash(source_path.read_text(), target.arch, " ".join(NVCC_FLAGS), nvcc_version())
    return cache_dir() / target.name / f"{source_path.stem}-{key}.cubin"


def cached_cubin(source_path: Path, target: Target) -> Path | None:
    """compile_cubin's output if it is already in the cache (nothing is compiled), else None."""
    if not target.is_cuda or nvcc_path() is None:
        return None
    out = _cubin_path(source_path, target)
    return out if out.exists() else None


def compile_cubin(source_path: Path, target: Target) -> Path:
    """nvcc the generated source into a cubin; cached by (source, arch, flags, nvcc version)."""
    if not target.is_cuda:
        raise ConfigError(f"target {target.name!r} does not compile to cubin")
    nvcc = nvcc_path()
    if nvcc is None:
        raise ConfigError("nvcc not found on PATH; cannot compile CUDA sources")
    out = _cubin_path(source_path, target)
    if out.exists():
        return out
    incs = [f"-I{d}" for d in tilelang_include_dirs()]
    tmp = out.with_suffix(f".tmp{os.getpid()}.cubin")
    cmd = [nvcc, *NVCC_FLAGS, f"-arch={target.arch}", *incs, "-o", str(tmp), str(source_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {source_path.name}:\n{proc.stderr[-4000:]}")
    tmp.replace(out)
    return out


_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def dump_sass(cubin: Path) -> str:
    tool = cuobjdump_path()
    if tool is None:
        raise ConfigError("cuobjdump not found (install triton, whose wheel carries it)")
    proc = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True, check=True)
    return proc.stdout


def count_opcodes(sass: str) -> Counter:
    """Count SASS instructions by base mnemonic (`HGMMA.64x128x16.F32.BF16` counts as `HGMMA`)."""
    return Counter(m.group(1) for m in _SASS_OP.finditer(sass))


# ---------------------------------------------------------------------------------------------- build


def build(name: str, prim_func, target: Target | str, *, sass: bool = True) -> Artifact:
    """Lower, write, and (for CUDA) compile and disassemble one kernel."""
    tgt = get_target(target) if isinstance(target, str) else target
    source = lower(prim_func, tgt)
    art = Artifact(name=name, target=tgt.name, source=source, source_path=write_source(name, tgt, source))
    if tgt.is_cuda:
        art.cubin_path = compile_cubin(art.source_path, tgt)
        if sass:
            art.sass = dump_sass(art.cubin_path)
            art.opcodes = count_opcodes(art.sass)
    return art


def compile_cpu(prim_func, out_idx=None):
    """Compile for TileLang's `c` target (g++ via the cython backend): fp32 numerics checks only."""
    import tilelang

    return tilelang.compile(prim_func, out_idx=out_idx, target="c", execution_backend="cython")
