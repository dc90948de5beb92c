"""IR data types, their torch storage types, and the pack/unpack helpers for the low-precision formats.

The formats follow the checkpoints (MODEL_SPEC §4):
- ``f8e4m3``: FP8 E4M3 (finite, max 448), stored as ``torch.float8_e4m3fn``.
- ``f4e2m1x2``: two FP4 E2M1 codes per byte, low nibble = even column. A tensor of this dtype has the
  *packed* shape (last dim = logical columns / 2), exactly as stored on disk.
- ``e8m0``: unsigned power-of-two scale, value = 2^(byte - 127), stored as ``torch.float8_e8m0fnu``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer.errors import IRError


@dataclass(frozen=True)
class DType:
    name: str
    torch_dtype: torch.dtype
    bits: int
    is_float: bool
    packed: int = 1  # logical elements per stored element

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"DType({self.name})"

    @property
    def itemsize(self) -> int:
        """Bytes per stored element."""
        return max(1, self.bits // 8)


bf16 = DType("bf16", torch.bfloat16, 16, True)
f16 = DType("f16", torch.float16, 16, True)
f32 = DType("f32", torch.float32, 32, True)
f64 = DType("f64", torch.float64, 64, True)
f8e4m3 = DType("f8e4m3", torch.float8_e4m3fn, 8, True)
f4e2m1x2 = DType("f4e2m1x2", torch.uint8, 8, True, packed=2)
e8m0 = DType("e8m0", torch.float8_e8m0fnu, 8, True)
u8 = DType("u8", torch.uint8, 8, False)
i8 = DType("i8", torch.int8, 8, False)
i32 = DType("i32", torch.int32, 32, False)
i64 = DType("i64", torch.int64, 64, False)
boolean = DType("bool", torch.bool, 8, False)

ALL_DTYPES: dict[str, DType] = {
    d.name: d for d in (bf16, f16, f32, f64, f8e4m3, f4e2m1x2, e8m0, u8, i8, i32, i64, boolean)
}
_FROM_TORCH = {d.torch_dtype: d for d in ALL_DTYPES.values() if d is not f4e2m1x2}
# torch has its own packed-fp4 dtype; treat it as ours.
if hasattr(torch, "float4_e2m1fn_x2"):
    _FROM_TORCH[torch.float4_e2m1fn_x2] = f4e2m1x2


def dtype(x: str | DType) -> DType:
    """Look up a dtype by name (``"bf16"``) or pass one through."""
    if isinstance(x, DType):
        return x
    try:
        return ALL_DTYPES[x]
    except KeyError:
        raise IRError(f"unknown dtype {x!r}; known: {', '.join(ALL_DTYPES)}") from None


def from_torch(t: torch.dtype) -> DType:
    try:
        return _FROM_TORCH[t]
    except KeyError:
        raise IRError(f"torch dtype {t} has no deepinfer dtype") from None


def is_floating(d: DType) -> bool:
    return d.is_float


# ---------------------------------------------------------------------------------------------------
# FP4 E2M1
# ---------------------------------------------------------------------------------------------------

# Code -> value table (MODEL_SPEC §4.3): codes 0..7 positive, 8..15 the same magnitudes negated.
FP4_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
FP4_MAX = 6.0


_FP4_MIDPOINTS = (FP4_VALUES[1:8] + FP4_VALUES[0:7]) / 2


def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """Round float values to the nearest E2M1 code, returning codes 0..15 as uint8.

    Values beyond +-6 saturate. A value exactly between two grid points goes to the even code (the grid
    point with a zero mantissa bit), which is IEEE round-to-nearest-even on the E2M1 grid.
    """
    x = x.float()
    mag = x.abs().clamp(max=FP4_MAX)
    mids = _FP4_MIDPOINTS.to(mag.device)
    code = torch.searchsorted(mids, mag.contiguous(), right=False)  # round half down
    tie = (code < 7) & (mag == mids[code.clamp(max=6)])
    code = torch.where(tie & (code % 2 == 1), code + 1, code)
    sign = torch.signbit(x)
    return (code + sign.long() * 8).to(torch.uint8)


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    return FP4_VALUES.to(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes [..., 2n] into bytes [..., n]: low nibble = even column, high nibble = odd column."""
    if codes.shape[-1] % 2:
        raise IRError(f"pack_fp4 needs an even last dim, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> E2M1 codes [..., 2n]."""
    p = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    lo, hi = p & 0xF, (p >> 4) & 0xF
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def fp4_to_float(packed: torch.Tensor) -> torch.Tensor:
    return fp4_decode(unpack_fp4(packed))


def float_to_fp4(x: torch.Tensor) -> torch.Tensor:
    return pack_fp4(fp4_encode(x))


# ---------------------------------------------------------------------------------------------------
# E8M0 (ue8m0) power-of-two scales
# ---------------------------------------------------------------------------------------------------


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """Decode ue8m0 scales (stored as float8_e8m0fnu or uint8 bytes) to float32: 2^(byte-127)."""
    byte = s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s.to(torch.uint8)
    return torch.exp2(byte.float() - 127.0)


def float_to_e8m0(x: torch.Tensor) -> torch.Tensor:
    """Encode exact powers of two (2^-127 .. 2^127) as ue8m0; other values round up to the next power."""
    x = x.float()
    if (x <= 0).any():
        raise IRError("e8m0 scales must be positive")
    exp = torch.ceil(torch.log2(x)).clamp(-127, 127)
    return (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def pow2_scale(amax: torch.Tensor, qmax: float, floor: float = 1e-4) -> torch.Tensor:
    """The ue8m0 quantisation scale 2^ceil(log2(max(amax, floor)/qmax)) (MODEL_SPEC §4.2/4.4)."""
    return torch.exp2(torch.ceil(torch.log2(amax.float().clamp(min=floor) / qmax)))


# ---------------------------------------------------------------------------------------------------
# FP8 E4M3
# ---------------------------------------------------------------------------------------------------

FP8_MAX = 448.0


def float_to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_to_float(x: torch.Tensor) -> torch.Tensor:
    return x.float()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
