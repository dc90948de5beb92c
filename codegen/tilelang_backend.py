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
    out.parent.mkdir(parents=True, exist_ok=True)  # (a source outside the cache: compile_cubins' callers)
    tmp = out.with_suffix(f".tmp{os.getpid()}.cubin")
    cmd = [nvcc, *NVCC_FLAGS, f"-arch={target.arch}", *incs, "-o", str(tmp), str(source_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {source_path.name}:\n{proc.stderr[-4000:]}")
    tmp.replace(out)
    return out


# ---------------------------------------------------------------------------------------------- compile many

# nvcc spends ~2 of a TileLang kernel's ~2.3 CPU seconds on the #include prelude (gcc -E and cicc parsing cute /
# cutlass / tl_templates), the same text in every source of a family. compile_cubins therefore puts the bodies of
# sources with one prelude into ONE translation unit (kernels renamed apart, `#line` keeping each body's own file
# and line numbers), runs cicc on it once (nvcc --ptx), cuts each kernel's entry back out of the PTX under its own
# name and runs ptxas on that alone: the same flags as compile_cubin's nvcc, so the same code (the cubins' code,
# constant, shared-memory and symbol sections are byte-identical to compile_cubin's: test_cuda_build); only the
# debug sections (line tables, the embedded PTX text) differ.
PTXAS_FLAGS = ("-m64", "--generate-line-info", "-w")  # what nvcc passes ptxas for NVCC_FLAGS (nvcc --dryrun)
# The archs whose batched code is the one-source code (test_cuda_build compares every section). Not sm_100a: there
# cicc's code for the tcgen05 GEMMs changed when fp8_gemm and moe_grouped_gemm shared a translation unit (more
# registers, other address arithmetic: a module-wide optimisation sees the callers of the shared templates).
BATCH_ARCHS = ("sm_90a",)
_KERNEL_DEF = re.compile(r'^extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(', re.M)
_GLOBL = re.compile(r"\s*// \.globl\s+(\w+)")
_ENTRY = re.compile(r"\.visible \.entry (\w+)\(")
_MODULE_DECL = re.compile(r"^\.(?:extern|shared|global|const|weak)\b.*?(\w+)\s*(?:\[[^\]]*\])?\s*(?:=.*)?;\s*$")
_RENAMED = re.compile(r"_dk\d+z")


class BatchError(RuntimeError):
    """A batch could not be compiled as one translation unit (its sources are then compiled one by one)."""


def split_source(text: str) -> tuple[str, str, int]:
    """(prelude, body, the body's first line number): TileLang's CUDA source is #includes, then extern "C" kernels."""
    at = text.find('extern "C"')
    if at < 0 or not _KERNEL_DEF.search(text, at):
        raise BatchError('no extern "C" __global__ kernel in the source')
    return text[:at], text[at:], text.count("\n", 0, at) + 1


def _renamed(name: str, n: int) -> str:
    return f"{name}_dk{n}z"  # the 'z' ends the number: _dk1z is not a prefix of _dk10z


def _batch_unit(sources: list[Path]) -> tuple[str, list[list[str]]]:
    """One translation unit of sources sharing a prelude, and each source's kernel names."""
    prelude, parts, names = None, [], []
    for n, src in enumerate(sources):
        pre, body, line = split_source(src.read_text())
        if prelude is None:
            prelude, parts = pre, [pre]
        elif pre != prelude:
            raise BatchError(f"{src.name}: a different #include prelude")
        kernels = sorted(set(_KERNEL_DEF.findall(body)))
        for k in kernels:
            body = re.sub(rf"\b{k}\b", _renamed(k, n), body)
        parts.append(f'#line {line} "{src.resolve()}"\n{body}\n')
        names.append(kernels)
    return "".join(parts), names


def entry_ptx(ptx: str, keep: set) -> str:
    """The PTX of a module with only the entries in ``keep``. nvcc writes a header, then for each entry a
    '// .globl' line, the module-scope declarations first used there and the entry, then the .file table and the
    debug sections (kept whole). A declaration stays when the kept entries use it, or when it belongs to no
    entry (the headers' own globals, which a one-source compile also keeps)."""
    lines = ptx.splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if _GLOBL.match(ln)]
    tail = next((i for i, ln in enumerate(lines) if re.match(r"\s*\.file\s", ln) or ln.startswith(".section")),
                len(lines))  # fmt: skip
    if not starts or any(re.match(r"(?:\.visible |\.weak )?\.func\b", ln) for ln in lines):
        raise BatchError("PTX without entries, or with device functions (not cut apart here)")
    chunks = [lines[a:b] for a, b in zip(starts, starts[1:] + [tail], strict=True)]
    decls, out = [], list(lines[: starts[0]])
    for c in chunks:
        at = next((i for i, ln in enumerate(c) if _ENTRY.match(ln)), None)
        if at is None:
            raise BatchError(f"no .entry after {c[0].strip()}")
        decls += [ln for ln in c[:at] if _MODULE_DECL.match(ln)]
    for c in chunks:
        if _GLOBL.match(c[0]).group(1) not in keep:
            continue
        at = next(i for i, ln in enumerate(c) if _ENTRY.match(ln))
        body = "".join(c[at:])
        used = [d for d in decls if re.search(rf"\b{_MODULE_DECL.match(d).group(1)}\b", body)
                or not (d.startswith(".extern") or _RENAMED.search(d))]  # fmt: skip
        out += [c[0], *used, "\n", *c[at:]]
    return "".join(out + lines[tail:])


def _restore_names(ptx: str, kernels: list[str], n: int) -> str:
    """Each renamed kernel back to its own name, in mangled names too (their length prefix: _ZZ28..._dk0zE8 -> 23)."""
    for k in kernels:
        r = _renamed(k, n)
        ptx = re.sub(rf"(\d*){r}", lambda m, k=k, r=r: (str(len(k)) if m.group(1) == str(len(r)) else m.group(1)) + k,
                     ptx)  # fmt: skip
    return ptx


def _ptxas_path(nvcc: str) -> str:
    """The ptxas of nvcc's own toolkit (what nvcc itself runs)."""
    own = Path(nvcc).resolve().parent / "ptxas"
    return str(own) if own.exists() else (shutil.which("ptxas") or "ptxas")


def _run(cmd: list, what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BatchError(f"{what} failed:\n{proc.stderr[-4000:]}")


def _compile_batch(sources: list[Path], target: Target) -> dict[Path, Path]:
    """One cicc for the sources (one prelude), one ptxas per source; the cubins go where compile_cubin puts them."""
    import tempfile

    nvcc = nvcc_path()
    unit, names = _batch_unit(sources)
    incs = [f"-I{d}" for d in tilelang_include_dirs()]
    flags = [f for f in NVCC_FLAGS if f != "--cubin"]
    with tempfile.TemporaryDirectory(prefix="deepinfer-batch-") as tmp:
        cu, ptx_path = Path(tmp) / "batch.cu", Path(tmp) / "batch.ptx"
        cu.write_text(unit)
        _run([nvcc, "--ptx", *flags, f"-arch={target.arch}", *incs, "-o", str(ptx_path), str(cu)], "nvcc --ptx")
        ptx = ptx_path.read_text()
        out = {}
        for n, (src, kernels) in enumerate(zip(sources, names, strict=True)):
            one = Path(tmp) / f"k{n}.ptx"
            one.write_text(_restore_names(entry_ptx(ptx, {_renamed(k, n) for k in kernels}), kernels, n))
            dest = _cubin_path(src, target)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp_cubin = dest.with_suffix(f".tmp{os.getpid()}.cubin")
            _run([_ptxas_path(nvcc), f"-arch={target.arch}", *PTXAS_FLAGS, "-o", str(tmp_cubin), str(one)],
                 f"ptxas for {src.name}")  # fmt: skip
            tmp_cubin.replace(dest)
            out[src] = dest
    return out


def compile_cubins(sources: list[Path], target: Target) -> dict[Path, Path | str]:
    """compile_cubin for several sources at once: those not in the cache, grouped by #include prelude, through
    one cicc per group (see above; BATCH_ARCHS only, other archs one source per nvcc). A group that fails as a
    whole is compiled source by source, so an error names its own source. Returns {source: cubin, or the error's
    text}."""
    if not target.is_cuda:
        raise ConfigError(f"target {target.name!r} does not compile to cubin")
    if nvcc_path() is None:
        raise ConfigError("nvcc not found on PATH; cannot compile CUDA sources")
    out: dict[Path, Path | str] = {}
    groups: dict[str, list[Path]] = {}
    for src in dict.fromkeys(sources):
        hit = cached_cubin(src, target)
        if hit is not None:
            out[src] = hit
            continue
        try:
            if target.arch not in BATCH_ARCHS:
                raise BatchError(f"{target.arch}: one source per nvcc")
            groups.setdefault(split_source(src.read_text())[0], []).append(src)
        except BatchError:
            groups.setdefault(f"\0{src}", []).append(src)  # compiled alone below
    for group in groups.values():
        try:
            if len(group) < 2:
                raise BatchError("one source")
            out.update(_compile_batch(group, target))
        except BatchError:
            for src in group:
                try:
                    out[src] = compile_cubin(src, target)
                except (RuntimeError, ConfigError) as e:
                    out[src] = str(e)
    return out


_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_SASS_ADDR_OP = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")  # with the address


def dump_sass(cubin: Path) -> str:
    tool = cuobjdump_path()
    if tool is None:
        raise ConfigError("cuobjdump not found (install triton, whose wheel carries it)")
    proc = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True, check=True)
    return proc.stdout


def count_opcodes(sass: str) -> Counter:
    """Count SASS instructions by base mnemonic (`HGMMA.64x128x16.F32.BF16` counts as `HGMMA`)."""
    return Counter(m.group(1) for m in _SASS_OP.finditer(sass))


def nvdisasm_path() -> str | None:
    """The system nvdisasm, else the one the triton wheel carries (beside its cuobjdump)."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    dump = cuobjdump_path()
    path = Path(dump).parent / "nvdisasm" if dump else None
    return str(path) if path is not None and path.exists() else None


def cubin_sections(cubin: Path) -> dict[str, bytes]:
    """The cubin's ELF64 sections by name (read from the section headers directly; a NOBITS one -- shared memory --
    as zeros of its size)."""
    import struct

    elf = cubin.read_bytes()
    if elf[:4] != b"\x7fELF":
        raise ConfigError(f"{cubin.name}: not an ELF cubin")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]
    out = {}
    for name, kind, _, _, offset, size in heads:
        label = elf[names + name : elf.index(b"\0", names + name)].decode()
        out[label] = bytes(size) if kind == 8 else elf[offset : offset + size]  # 8: SHT_NOBITS
    return out


def _text_sections(cubin: Path) -> bytes:
    """The cubin's code: its .text.* sections in file order."""
    return b"".join(data for name, data in cubin_sections(cubin).items() if name.startswith(".text."))


def count_opcodes_many(cubins: list[Path], target: Target) -> list[Counter]:
    """count_opcodes(dump_sass(c)) for each cubin, from ONE disassembler process: the cubins' code sections laid
    end to end as a raw instruction binary (nvdisasm --binary), each instruction counted for the cubin whose
    address range holds it. A cuobjdump process costs ~0.4 CPU s whatever the cubin's size (its nvdisasm's start);
    the counts are the same (test_cuda_build). Without an nvdisasm: one cuobjdump per cubin."""
    import tempfile
    from bisect import bisect_right

    tool = nvdisasm_path()
    if tool is None or not cubins:
        return [count_opcodes(dump_sass(c)) for c in cubins]
    codes = [_text_sections(c) for c in cubins]
    starts = [sum(len(c) for c in codes[:i]) for i in range(len(codes))]
    with tempfile.NamedTemporaryFile(suffix=".bin") as raw:
        raw.write(b"".join(codes))
        raw.flush()
        arch = "SM" + target.arch.removeprefix("sm_")  # sm_90a -> SM90a
        proc = subprocess.run([tool, "--binary", arch, raw.name], capture_output=True, text=True)
    if proc.returncode != 0:  # an nvdisasm that does not know the arch: one cuobjdump per cubin
        return [count_opcodes(dump_sass(c)) for c in cubins]
    counts = [Counter() for _ in cubins]
    for m in _SASS_ADDR_OP.finditer(proc.stdout):
        counts[bisect_right(starts, int(m.group(1), 16)) - 1][m.group(2)] += 1
    return counts


# ---------------------------------------------------------------------------------------------- build


def build(name: str, prim_func, target: Target | str, *, sass: bool = True) -> Artifact:
    """Lower, write, and (for CUDA) compile and disassemble one kernel."""
    tgt = get_target(target) if isinstance(target, str) else target
    return build_source(name, lower(prim_func, tgt), tgt, sass=sass)


def build_source(name: str, source: str, target: Target | str, *, sass: bool = True) -> Artifact:
    """build() of an already lowered source: write, and (for CUDA) compile and disassemble it. Touches no TileLang
    state, so callers may run it in threads (nvcc and cuobjdump are subprocesses) while lowering the next kernel."""
    tgt = get_target(target) if isinstance(target, str) else target
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
