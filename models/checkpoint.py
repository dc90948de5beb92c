"""Checkpoint I/O: HF-style safetensors directories with the real tensor names and formats (MODEL_SPEC §4).

A checkpoint directory holds ``config.json``, shards ``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {tensor: shard}}``).
A single ``model.safetensors`` without an index is read too (the HF single-file form).

Storage formats (what each IR dtype is on disk):

| IR dtype   | in memory (torch)      | on disk                                                                  |
|------------|------------------------|--------------------------------------------------------------------------|
| f8e4m3     | float8_e4m3fn          | ``F8_E4M3``; block scales in ``<name>.scale`` [ceil(out/b), ceil(in/b)] |
| e8m0       | float8_e8m0fnu         | ``F8_E8M0`` (value 2^(byte-127))                                         |
| f4e2m1x2   | uint8 [out, in/2]      | ``I8`` [out, in/2] (written); ``U8`` and ``F4`` [out, in] also read     |
| bf16 / f32 | bfloat16 / float32     | ``BF16`` / ``F32``                                                       |
| i32 / i64  | int32 / int64          | ``I32`` / ``I64`` (either is accepted for the other: tid2eid, §7.4)      |

Public API:
    save_checkpoint(dir, tensors, config, max_shard_bytes=...) -> Path     atomic: temp dir + rename
    load_checkpoint(dir, expected=None) -> dict[str, Tensor]               validates before loading anything
    random_weights(params, seed, block=None) -> dict[str, Tensor]          realistic values, per-name seeded
    make_checkpoint(model, preset, out, seed=0) -> Path                    `deepinfer make-checkpoint`
    checkpoint_params(model, config) -> list[Value]                        what a checkpoint of a config holds
    resolve_model(spec=None) -> (model name, config dict, checkpoint dir | None)
    read_config(dir) -> dict
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from deepinfer.errors import CheckpointError, ConfigError, NotBuiltError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import Value

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # HF's default shard size
ENV_MODEL_DIR = "DEEPINFER_HF_MODEL_DIR"
FP4_GROUP = 32  # one ue8m0 scale per 32 inputs of an FP4 expert row (§4.3)

# safetensors dtype string -> torch dtype for the formats we write
_ST_TO_TORCH = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
}
_ST_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "F8_E5M2": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
}

# IR dtype -> safetensors dtype strings accepted for it (first = the one written)
_ACCEPTED = {
    "bf16": ("BF16",),
    "f16": ("F16",),
    "f32": ("F32",),
    "f64": ("F64",),
    "f8e4m3": ("F8_E4M3",),
    "e8m0": ("F8_E8M0",),
    "f4e2m1x2": ("I8", "U8", "F4"),
    "u8": ("U8", "I8"),  # uint8 tensors are written as I8 (see _storage_tensor)
    "i8": ("I8",),
    "i32": ("I32", "I64"),
    "i64": ("I64", "I32"),
    "bool": ("BOOL",),
}


def shard_name(k: int, n: int) -> str:
    """The k-th (1-based) of n shard file names."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------


def _storage_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"tensor {name}: expected a torch.Tensor, got {type(t).__name__}")
    t = t.detach().cpu().contiguous()
    if t.dtype == getattr(torch, "float4_e2m1fn_x2", None) or t.dtype == torch.uint8:
        # packed FP4 (two E2M1 codes per byte) is stored as I8 [out, in/2], as the released checkpoints do
        return t.view(torch.int8)
    return t


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def save_checkpoint(
    path: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    config: dict,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    *,
    overwrite: bool = False,
) -> Path:
    """Write ``tensors`` (name -> tensor, in memory formats as in the module table) and ``config`` as an HF-style
    sharded safetensors directory. Shards are filled in the dict's order up to ``max_shard_bytes`` (a bigger tensor
    gets a shard of its own). The directory appears complete or not at all (written to a temp dir, then renamed).
    An existing ``path`` is an error unless ``overwrite``."""
    from safetensors.torch import save_file

    out = Path(path)
    if out.exists() and not overwrite:
        raise CheckpointError(f"checkpoint directory {out} already exists (pass overwrite=True to replace it)")
    if not tensors:
        raise CheckpointError(f"refusing to write checkpoint {out} with no tensors")
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")

    stored: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"tensor names must be non-empty strings, got {name!r}")
        s = _storage_tensor(name, t)
        ptr = s.untyped_storage().data_ptr()
        if s.numel() and ptr in seen_storage:  # safetensors refuses tensors that share storage (tied weights)
            s = s.clone()
            ptr = s.untyped_storage().data_ptr()
        if s.numel():
            seen_storage.add(ptr)
        stored[name] = s

    shards: list[list[str]] = [[]]
    size = 0
    for name, t in stored.items():
        nb = _tensor_bytes(t)
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nb

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        weight_map = {}
        n = len(shards)
        for k, names in enumerate(shards, 1):
            fname = shard_name(k, n)
            save_file({nm: stored[nm] for nm in names}, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({nm: fname for nm in names})
        index = {"metadata": {"total_size": sum(map(_tensor_bytes, stored.values()))}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        umask = _umask()
        for f in tmp.iterdir():  # mkdtemp and safetensors create owner-only files; use the usual modes
            f.chmod(0o666 & ~umask)
        tmp.chmod(0o777 & ~umask)
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / "old")
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------


def read_header(file: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file header ({name: {dtype, shape, data_offsets}}), after checking
    that the file holds all the bytes the header promises."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"shard {file} is truncated: {size} bytes, no safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 2**20:
                raise CheckpointError(f"shard {file} is truncated or corrupt: header length {n}, file {size} bytes")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"shard {file} cannot be read: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"shard {file} has a corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"shard {file} has a corrupt safetensors header (not an object)")
    header.pop("__metadata__", None)
    end = 0
    for name, e in header.items():
        try:
            _, stop = e["data_offsets"]
            shape, dtype = e["shape"], e["dtype"]
            end = max(end, int(stop))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"shard {file} has a corrupt header entry for tensor {name}") from None
        if dtype in _ST_ITEMSIZE:
            want = math.prod(shape) * _ST_ITEMSIZE[dtype]
            if stop - e["data_offsets"][0] != want:
                raise CheckpointError(
                    f"shard {file}: tensor {name} has {stop - e['data_offsets'][0]} bytes, "
                    f"its {dtype}{list(shape)} needs {want}"
                )
    if end > size - 8 - n:
        raise CheckpointError(f"shard {file} is truncated: header needs {end} data bytes, file has {size - 8 - n}")
    return header


def _weight_map(d: Path) -> dict[str, str]:
    idx = d / INDEX_FILE
    if not idx.exists():
        if (d / SINGLE_FILE).exists():
            return dict.fromkeys(read_header(d / SINGLE_FILE), SINGLE_FILE)
        raise CheckpointError(f"checkpoint {d} has no {INDEX_FILE} (and no single {SINGLE_FILE})")
    try:
        index = json.loads(idx.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint index {idx} is not valid JSON: {e}") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"checkpoint index {idx} has no weight_map of tensor name -> shard file")
    return wm


def _int_shape(v: Value) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in v.type.shape)
    except TypeError:
        return None


def _expected_file_shape(v: Value, st_dtype: str) -> tuple[int, ...] | None:
    shape = _int_shape(v)
    if shape is not None and v.type.dtype is dt.f4e2m1x2 and st_dtype == "F4":
        return shape[:-1] + (shape[-1] * 2,)  # safetensors' F4 records the logical (unpacked) shape
    return shape


def _fmt(st_dtype: str, shape) -> str:
    return f"{st_dtype}[{', '.join(map(str, shape))}]"


def _check_expected(d: Path, v: Value, entry: dict | None, shard: str | None) -> str | None:
    """One line describing what is wrong with expected param ``v`` in the checkpoint, or None."""
    want_dtypes = _ACCEPTED.get(v.type.dtype.name)
    want = f"{v.type.dtype.name}{list(v.type.shape)}"
    if entry is None:
        return f"checkpoint {d} is missing tensor {v.name} (expected {want})"
    got_dtype, got_shape = entry["dtype"], tuple(entry["shape"])
    if want_dtypes is None or got_dtype not in want_dtypes:
        ok = "/".join(want_dtypes or ("?",))
        return (
            f"tensor {v.name} in {shard} has dtype {got_dtype}, expected {ok} "
            f"(for {v.type.dtype.name}); shape {list(got_shape)}"
        )
    exp_shape = _expected_file_shape(v, got_dtype)
    if exp_shape is not None and got_shape != exp_shape:
        return f"tensor {v.name} in {shard} has shape {list(got_shape)}, expected {list(exp_shape)} ({want})"
    return None


def _convert(name: str, t: torch.Tensor, v: Value | None) -> torch.Tensor:
    if v is None:
        return t
    want = v.type.dtype
    if want in (dt.f4e2m1x2, dt.u8):
        return t.view(torch.uint8)
    if t.dtype != want.torch_dtype and want in (dt.i32, dt.i64):
        if want is dt.i32 and t.numel() and (t.max() > 2**31 - 1 or t.min() < -(2**31)):
            raise CheckpointError(f"tensor {name}: int64 values do not fit the expected int32")
        return t.to(want.torch_dtype)
    return t


def load_checkpoint(path: str | os.PathLike, expected: Iterable[Value] | None = None) -> dict[str, torch.Tensor]:
    """Read a checkpoint directory into ``{name: tensor}`` (in-memory formats as in the module table).

    With ``expected`` (e.g. ``graph.params``) every expected tensor must be present with an accepted dtype and the
    exact shape, and only those tensors are returned (FP4 as uint8 [out, in/2], integers converted to the expected
    width). Everything is checked before any tensor data is read; a problem raises CheckpointError with one line
    naming the tensor (or the index/shard file) and what is wrong."""
    from safetensors import safe_open

    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {d} does not exist")
    wm = _weight_map(d)
    headers: dict[str, dict] = {}
    for shard in dict.fromkeys(wm.values()):
        f = d / shard
        if not f.is_file():
            first = next(k for k, v in wm.items() if v == shard)
            raise CheckpointError(f"checkpoint {d}: shard {shard} (listed in {INDEX_FILE} for {first}) is missing")
        headers[shard] = read_header(f)
    for name, shard in wm.items():
        if name not in headers[shard]:
            raise CheckpointError(f"tensor {name} is listed in {INDEX_FILE} under {shard} but that shard lacks it")

    want: dict[str, Value | None]
    if expected is None:
        want = dict.fromkeys(wm)
    else:
        want = {v.name: v for v in expected}
        problems = []
        for name, v in want.items():
            shard = wm.get(name)
            entry = headers[shard].get(name) if shard else None
            if (msg := _check_expected(d, v, entry, shard)) is not None:
                problems.append(msg)
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise CheckpointError(problems[0] + more)

    by_shard: dict[str, list[str]] = {}
    for name in want:
        by_shard.setdefault(wm[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for shard, names in by_shard.items():
        try:
            with safe_open(str(d / shard), framework="pt", device="cpu") as f:
                for name in names:
                    out[name] = _convert(name, f.get_tensor(name), want[name])
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types; say which file
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"shard {d / shard} cannot be loaded: {msg}") from None
    return {name: out[name] for name in want}


def read_config(path: str | os.PathLike) -> dict:
    """``config.json`` of a checkpoint directory."""
    f = Path(path) / CONFIG_FILE
    try:
        cfg = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f} is not a JSON object")
    return cfg


# ---------------------------------------------------------------------------------------------------
# Random weights in the storage formats
# ---------------------------------------------------------------------------------------------------


def _generator(seed: int, name: str) -> torch.Generator:
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & (2**63 - 1))


def _infer_block(n: int, blocks: int, preferred: int | None, what: str) -> int:
    """The block length b with ceil(n / b) == blocks, preferring ``preferred``, then 1, then powers of two."""
    cands = ([preferred] if preferred else []) + [1] + [2**k for k in range(1, 21)]
    for b in cands:
        if dt.ceil_div(n, b) == blocks:
            return b
    raise CheckpointError(f"{what}: no block size gives {blocks} blocks over {n} elements")


def _quant_fp8_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8: codes [N, K] and ue8m0 scales [ceil(N/bn), ceil(K/bk)] with s = 2^ceil(log2(amax/448))."""
    n, k = w.shape
    a, b = dt.ceil_div(n, bn), dt.ceil_div(k, bk)
    padded = torch.zeros(a * bn, b * bk)
    padded[:n, :k] = w
    amax = padded.view(a, bn, b, bk).abs().amax(dim=(1, 3))
    s = dt.pow2_scale(amax, dt.FP8_MAX, floor=1e-30)
    s_full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return dt.float_to_fp8(w / s_full), dt.float_to_e8m0(s)


def _quant_fp4_rows(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed FP4 [N, K/2] and ue8m0 scales [N, K/group] with s = 2^ceil(log2(amax/6))."""
    g = w.unflatten(-1, (-1, group))
    s = dt.pow2_scale(g.abs().amax(-1, keepdim=True), dt.FP4_MAX, floor=1e-30)
    codes = dt.fp4_encode((g / s).clamp(-dt.FP4_MAX, dt.FP4_MAX)).flatten(-2)
    return dt.pack_fp4(codes), dt.float_to_e8m0(s.squeeze(-1))


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _float_values(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    leaf = _leaf(name)
    randn = torch.randn(shape, generator=g)
    if name.endswith(("norm.weight", "q_weight", "k_weight")) or leaf in ("enorm", "hnorm"):
        return 1.0 + 0.1 * randn  # norm-like weights: near 1
    if leaf.startswith("hc_") and leaf.endswith("_fn"):
        return randn / math.sqrt(shape[-1])
    if leaf.startswith("hc_") and leaf.endswith("_base"):
        return 0.1 * randn
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return 0.05 + 0.1 * torch.rand(shape, generator=g)
    if leaf in ("attn_sink", "ape"):
        return 0.1 * randn
    if leaf.startswith("bias"):  # gate.bias, gate.bias_vl, proj.bias
        return 0.02 * randn
    if name == "embed.weight" or name.endswith(("embed.weight",)):
        return randn  # embeddings (main, Engram tables, Markov head): unit scale
    if len(shape) >= 2:
        return randn / math.sqrt(shape[-1])  # linear weights: N(0, 1/fan_in)
    return 0.02 * randn


def _sibling(name: str, leaf: str) -> str:
    return name.rsplit(".", 1)[0] + "." + leaf if "." in name else leaf


def _tid2eid(v: Value, shapes: dict[str, tuple], n_experts: int | None, seed: int) -> torch.Tensor:
    rows, k = _int_shape(v)
    if n_experts is None:
        gate = shapes.get(_sibling(v.name, "weight")) or shapes.get(_sibling(v.name, "bias"))
        if gate is None:
            raise CheckpointError(f"tensor {v.name}: cannot tell the number of experts (no gate weight beside it)")
        n_experts = gate[0]
    if k > n_experts:
        raise CheckpointError(f"tensor {v.name}: {k} distinct experts per row, but only {n_experts} experts")
    g = _generator(seed, v.name)
    out = torch.empty(rows, k, dtype=torch.int64)
    for r0 in range(0, rows, 16384):  # row chunks keep memory bounded for the real vocabulary
        r1 = min(rows, r0 + 16384)
        out[r0:r1] = torch.rand(r1 - r0, n_experts, generator=g).topk(k, dim=1).indices
    return out.to(v.type.dtype.torch_dtype)


def random_weights(
    params: Iterable[Value],
    seed: int = 0,
    block: int | tuple[int, int] | None = None,
    n_experts: int | None = None,
) -> dict[str, torch.Tensor]:
    """Random tensors for ``params`` (e.g. ``graph.params``) in their storage formats, deterministic per
    (seed, tensor name): a tensor's values do not depend on which other params are in the list.

    - FP8 ``X.weight`` [out, in] with ``X.scale``: W ~ N(0, 1/in) quantised per block with ue8m0 scales
      2^ceil(log2(amax/448)); the block comes from ``block`` (the config's weight_block_size) if it fits the
      scale's shape, else from the shapes. Both tensors derive from the weight's name.
    - FP4 ``X.weight`` [out, in/2] with ``X.scale`` [out, in/32]: W ~ N(0, 1/in) rounded to E2M1 with per-32
      scales 2^ceil(log2(amax/6)).
    - bf16/f32: norms 1 + 0.1 N; embeddings N(0, 1); other matrices N(0, 1/fan_in); hc fn N(0, 1/fan_in),
      base 0.1 N, scale U(0.05, 0.15); attn_sink and ape 0.1 N; biases 0.02 N; other vectors 0.02 N.
    - ``tid2eid`` [vocab, k]: k distinct expert ids per row, below the gate's expert count (or ``n_experts``).
    - other integer or bool tensors: zeros.
    """
    params = list(params)
    by_name = {p.name: p for p in params}
    shapes = {p.name: _int_shape(p) for p in params}
    for p in params:
        if shapes[p.name] is None:
            raise CheckpointError(f"param {p.name} has a symbolic shape {p.type}; random_weights needs numbers")
    pref = (block, block) if isinstance(block, int) else tuple(block) if block else (None, None)

    pairs: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def quantised(wname: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if wname in pairs:
            return pairs[wname]
        w = by_name[wname]
        sname = _sibling(wname, "scale")
        sv = by_name.get(sname)
        g = _generator(seed, wname)
        if w.type.dtype is dt.f8e4m3:
            n, k = shapes[wname]
            x = torch.randn(n, k, generator=g) / math.sqrt(k)
            if sv is None or sv.type.dtype is not dt.e8m0:
                pairs[wname] = (dt.float_to_fp8(x), None)
            else:
                a, b = shapes[sname]
                bn = _infer_block(n, a, pref[0], f"scale {sname}")
                bk = _infer_block(k, b, pref[1], f"scale {sname}")
                pairs[wname] = _quant_fp8_blocks(x, bn, bk)
        else:  # f4e2m1x2
            n, kp = shapes[wname]
            k = kp * 2
            group = FP4_GROUP
            if sv is not None:
                if k % shapes[sname][-1]:
                    raise CheckpointError(
                        f"scale {sname} {list(shapes[sname])} does not divide FP4 {wname}'s {k} columns"
                    )
                group = k // shapes[sname][-1]
            x = torch.randn(n, k, generator=g) / math.sqrt(k)
            pairs[wname] = _quant_fp4_rows(x, group)
        return pairs[wname]

    out: dict[str, torch.Tensor] = {}
    for p in params:
        name, d, shape = p.name, p.type.dtype, shapes[p.name]
        if d in (dt.f8e4m3, dt.f4e2m1x2):
            if len(shape) != 2:
                raise CheckpointError(f"param {name}: {d} weights must be 2-D, got {list(shape)}")
            t = quantised(name)[0]
        elif d is dt.e8m0:
            wname = _sibling(name, "weight")
            wv = by_name.get(wname)
            if wv is not None and wv.type.dtype in (dt.f8e4m3, dt.f4e2m1x2) and len(shapes[wname]) == 2:
                t = quantised(wname)[1]
            else:  # a scale without its weight: powers of two around 2^-4
                g = _generator(seed, name)
                t = (
                    (torch.randint(119, 127, shape, generator=g, dtype=torch.int64))
                    .to(torch.uint8)
                    .view(torch.float8_e8m0fnu)
                )
        elif d.is_float:
            t = _float_values(name, shape, _generator(seed, name)).to(d.torch_dtype)
        elif _leaf(name) == "tid2eid":
            if len(shape) != 2:
                raise CheckpointError(f"param {name}: tid2eid must be [vocab, k], got {list(shape)}")
            t = _tid2eid(p, shapes, n_experts, seed)
        else:
            t = torch.zeros(shape, dtype=d.torch_dtype)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"param {name}: generated {list(t.shape)} for declared {list(shape)}")
        out[name] = t
    return out


# ---------------------------------------------------------------------------------------------------
# Model resolution and make-checkpoint
# ---------------------------------------------------------------------------------------------------


def checkpoint_params(model: str, config: dict) -> list[Value]:
    """Every tensor a checkpoint of ``model`` with ``config`` holds, as IR Values (name, dtype, shape).

    A model module may define ``checkpoint_params(cfg)``; otherwise this is the union of the params of
    ``build_graph(cfg)`` and, where the module has ``build_mtp_graph``, of ``build_mtp_graph(cfg, k=k)`` for each of
    the config's ``num_mtp_layers`` (shared tensors such as ``embed.weight`` once; they must agree)."""
    from deepinfer.models import get_model

    try:
        mod = get_model(model)
    except ImportError as e:
        raise NotBuiltError(f"the {model} graph is not built yet ({e.name} is missing)") from None
    if not hasattr(mod, "build_graph") or not hasattr(mod, "parse_config"):
        raise NotBuiltError(f"the {model} graph is not built yet ({mod.__name__} has no parse_config/build_graph)")
    cfg = mod.parse_config(config)
    if hasattr(mod, "checkpoint_params"):
        return list(mod.checkpoint_params(cfg))
    graphs = [mod.build_graph(cfg)]
    if hasattr(mod, "build_mtp_graph"):
        graphs += [mod.build_mtp_graph(cfg, k=k) for k in range(int(getattr(cfg, "num_mtp_layers", 0) or 0))]
    out: dict[str, Value] = {}
    for g in graphs:
        for v in g.params:
            if v.name in out and out[v.name].type != v.type:
                raise CheckpointError(f"param {v.name} is {out[v.name].type} in one graph and {v.type} in another")
            out.setdefault(v.name, v)
    return list(out.values())


def params_bytes(params: Iterable[Value]) -> int:
    return sum(math.prod(int(d) for d in v.type.shape) * v.type.dtype.itemsize for v in params)


def make_checkpoint(
    model: str,
    preset: str,
    out: str | os.PathLike,
    seed: int = 0,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    max_total_bytes: int = 16 * 2**30,
) -> Path:
    """Write a random checkpoint of ``model`` at ``preset`` in the real format: config.json of the preset, every
    checkpoint tensor (``checkpoint_params``) under its name, random_weights(seed). Refuses to generate more than
    ``max_total_bytes`` (the real preset is ~160 GB)."""
    from deepinfer.models.presets import preset_config, weight_block_size

    out = Path(out)
    if out.exists() and not overwrite:
        raise CheckpointError(f"output directory {out} already exists")
    config = preset_config(model, preset)
    params = checkpoint_params(model, config)
    total = params_bytes(params)
    if total > max_total_bytes:
        raise CheckpointError(
            f"{model} preset {preset} would need {total / 1e9:.1f} GB of random weights "
            f"(limit {max_total_bytes / 1e9:.1f} GB); use the tiny or small preset"
        )
    weights = random_weights(params, seed, block=weight_block_size(config))
    return save_checkpoint(out, weights, config, max_shard_bytes=max_shard_bytes, overwrite=overwrite)


def resolve_model(spec: str | os.PathLike | None = None) -> tuple[str, dict, Path | None]:
    """What ``--model`` names: ``(model name, config.json dict, checkpoint directory or None)``.

    - a directory (with config.json): that checkpoint; the model from its ``model_type``;
    - ``name:preset`` (e.g. ``deepseek-v4-flash:small``): the preset's config, no weights;
    - ``name``: the checkpoint in ``$DEEPINFER_HF_MODEL_DIR`` if that is set and holds this model, else the
      ``tiny`` preset (the embedded default);
    - None: ``$DEEPINFER_HF_MODEL_DIR`` if set, else the default model's ``tiny`` preset.
    """
    from deepinfer.models import DEFAULT_MODEL, MODEL_MODULES
    from deepinfer.models.presets import model_name_for, preset_config

    env = os.environ.get(ENV_MODEL_DIR)
    if spec is None:
        spec = env if env else DEFAULT_MODEL
    s = os.fspath(spec)
    if s in MODEL_MODULES:
        if env:
            env_dir = Path(env)
            if not env_dir.is_dir():
                raise ConfigError(f"{ENV_MODEL_DIR}={env} is not a directory")
            cfg = read_config(env_dir)
            if model_name_for(cfg, f"{env_dir / CONFIG_FILE}") == s:
                return s, cfg, env_dir
        return s, preset_config(s, "tiny"), None
    name, sep, preset = s.partition(":")
    if sep and name in MODEL_MODULES:
        return name, preset_config(name, preset), None
    p = Path(s)
    if p.is_dir():
        cfg = read_config(p)
        return model_name_for(cfg, str(p / CONFIG_FILE)), cfg, p
    known = ", ".join(MODEL_MODULES)
    raise ConfigError(f"--model {s!r} is neither a model ({known}), model:preset, nor a checkpoint directory")
