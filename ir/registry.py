"""The op registry: one registration gives an op its schema, type/shape inference and torch reference.

An op is declared as a class:

    @register_op("rmsnorm", inputs="x, weight?", attrs={"eps": Attr("float", 1e-6)})
    class RMSNorm:
        "RMSNorm in fp32, cast back to x's dtype."
        def infer(x, weight, *, eps):            # TensorTypes in, TensorType (or tuple) out
            return x
        def reference(x, weight, *, eps):        # torch tensors in, tensor (or tuple) out
            ...

`inputs` is a comma-separated list: a trailing ``?`` marks an optional input (``None`` when absent), a
leading ``*`` a variadic tail. ``stateful=True`` with ``writes={out: in}`` marks a cache-writing op whose
output ``out`` is the new version of input ``in``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer.errors import IRError, ShapeError, UnknownOpError
from deepinfer.ir.dtypes import DType, dtype
from deepinfer.ir.graph import TensorType
from deepinfer.ir.shapes import Dim, Sym, parse_dim

REQUIRED = object()

ATTR_KINDS = ("int", "float", "bool", "str", "ints", "floats", "strs", "dtype", "dim", "shape")


@dataclass(frozen=True)
class Attr:
    kind: str
    default: Any = REQUIRED

    def __post_init__(self):
        if self.kind not in ATTR_KINDS:
            raise IRError(f"unknown attribute kind {self.kind!r}")

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class InputSpec:
    name: str
    optional: bool = False
    variadic: bool = False


@dataclass
class OpDef:
    name: str
    inputs: tuple[InputSpec, ...]
    attrs: dict[str, Attr]
    infer_fn: Callable
    reference_fn: Callable
    stateful: bool = False
    writes: dict[int, int] = field(default_factory=dict)
    doc: str = ""
    level: str = "core"  # core | model | kernel

    # -- schema checks -------------------------------------------------------------------------------
    def bind_inputs(self, args: list) -> list:
        """Check the number of inputs, padding missing optional ones with None."""
        fixed = [s for s in self.inputs if not s.variadic]
        variadic = any(s.variadic for s in self.inputs)
        n_req = sum(1 for s in fixed if not s.optional)
        if len(args) < n_req or (not variadic and len(args) > len(fixed)):
            want = f"{n_req}..{len(fixed)}" if n_req != len(fixed) else str(n_req)
            if variadic:
                want = f"at least {n_req}"
            raise IRError(f"{self.name} takes {want} inputs ({self.signature()}), got {len(args)}")
        args = list(args)
        if not variadic:
            args += [None] * (len(fixed) - len(args))
        for spec, a in zip(fixed, args):
            if a is None and not spec.optional:
                raise IRError(f"{self.name}: input {spec.name!r} is required")
        return args

    def bind_attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Check attribute names and kinds, fill defaults; returns normalised attributes."""
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise IRError(f"{self.name}: unknown attribute {sorted(unknown)[0]!r} (has {sorted(self.attrs)})")
        out = {}
        for name, spec in self.attrs.items():
            if name in attrs:
                out[name] = coerce_attr(self.name, name, spec.kind, attrs[name])
            elif spec.required:
                raise IRError(f"{self.name}: attribute {name!r} is required")
            else:
                out[name] = spec.default
        return out

    def signature(self) -> str:
        ins = ", ".join(("*" if s.variadic else "") + s.name + ("?" if s.optional else "") for s in self.inputs)
        return f"{self.name}({ins})"

    # -- inference and reference ---------------------------------------------------------------------
    def infer(self, in_types: list[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
        out = self.infer_fn(*in_types, **attrs)
        outs = list(out) if isinstance(out, tuple | list) else [out]
        for t in outs:
            if not isinstance(t, TensorType):
                raise IRError(f"{self.name}: infer returned {t!r}, not a TensorType")
        return outs

    def run(self, tensors: list, attrs: dict[str, Any]) -> list:
        out = self.reference_fn(*tensors, **attrs)
        return list(out) if isinstance(out, tuple | list) else [out]


_REGISTRY: dict[str, OpDef] = {}


def parse_inputs(spec: str) -> tuple[InputSpec, ...]:
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        variadic = part.startswith("*")
        optional = part.endswith("?")
        out.append(InputSpec(part.strip("*?"), optional, variadic))
    return tuple(out)


def register_op(
    name: str,
    inputs: str = "",
    attrs: dict[str, Attr] | None = None,
    *,
    stateful: bool = False,
    writes: dict[int, int] | None = None,
    level: str = "core",
):
    """Class decorator registering an op from its ``infer`` and ``reference`` functions."""

    def deco(cls):
        if name in _REGISTRY:
            raise IRError(f"op {name!r} registered twice")
        infer = cls.__dict__["infer"]
        ref = cls.__dict__["reference"]
        infer = infer.__func__ if isinstance(infer, staticmethod) else infer
        ref = ref.__func__ if isinstance(ref, staticmethod) else ref
        _REGISTRY[name] = OpDef(
            name=name,
            inputs=parse_inputs(inputs),
            attrs=dict(attrs or {}),
            infer_fn=infer,
            reference_fn=ref,
            stateful=stateful,
            writes=dict(writes or {}),
            doc=inspect.getdoc(cls) or "",
            level=level,
        )
        cls.opdef = _REGISTRY[name]
        return cls

    return deco


def get_op(name: str) -> OpDef:
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownOpError(f"unknown op {name!r}") from None


def has_op(name: str) -> bool:
    _ensure_loaded()
    return name in _REGISTRY


def all_ops() -> dict[str, OpDef]:
    _ensure_loaded()
    return dict(_REGISTRY)


_LOADED = False


def _ensure_loaded() -> None:
    """Import the modules that register ops (once)."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        import deepinfer.ir.ops  # noqa: F401


# ---------------------------------------------------------------------------------------------------
# Attribute coercion
# ---------------------------------------------------------------------------------------------------


def coerce_attr(op: str, name: str, kind: str, v: Any) -> Any:
    """Normalise an attribute value to its kind, or raise naming the op and attribute."""
    try:
        if v is None:
            return None
        if kind == "int":
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError
            return int(v)
        if kind == "float":
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TypeError
            return float(v)
        if kind == "bool":
            if not isinstance(v, bool):
                raise TypeError
            return v
        if kind == "str":
            if not isinstance(v, str):
                raise TypeError
            return v
        if kind == "dtype":
            return dtype(v)
        if kind == "dim":
            return parse_dim(v) if isinstance(v, str) else _check_dim(v)
        if kind == "ints":
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise TypeError
            return [int(x) for x in v]
        if kind == "floats":
            return [float(x) for x in v]
        if kind == "strs":
            if not all(isinstance(x, str) for x in v):
                raise TypeError
            return list(v)
        if kind == "shape":
            return [parse_dim(x) if isinstance(x, str) else _check_dim(x) for x in v]
    except (TypeError, ValueError):
        raise IRError(f"{op}: attribute {name!r} must be {kind}, got {v!r}") from None
    raise IRError(f"{op}: attribute {name!r} has unknown kind {kind}")


def _check_dim(v: Any) -> Dim:
    if isinstance(v, bool) or not isinstance(v, int | Sym):
        raise TypeError
    return v


def shape_fail(op: str, msg: str, *types: TensorType | None) -> ShapeError:
    shown = ", ".join(str(t) if t is not None else "None" for t in types)
    return ShapeError(f"{op}: {msg} (got {shown})")


__all__ = [
    "Attr",
    "DType",
    "OpDef",
    "REQUIRED",
    "all_ops",
    "coerce_attr",
    "get_op",
    "has_op",
    "register_op",
    "shape_fail",
]
