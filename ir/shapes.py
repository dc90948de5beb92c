"""Symbolic dimensions.

A dimension is an ``int`` or a :class:`Sym` expression over named symbols (``T`` tokens in the batch,
``R`` requests, ``S`` cached length, ...). Expressions are built through constructors that normalise them
(constants folded, sums and products flattened and sorted), so two spellings of the same dim compare
equal: ``2*T == T*2`` and ``(4*T)//4 == T``. The text form (``T//4``, ``2*T+1``, ``min(T, 512)``) parses
back to an equal expression.
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass
from typing import Union

from deepinfer.errors import IRError, ShapeError

Dim = Union[int, "Sym"]
Shape = tuple  # tuple[Dim, ...]

_OPS = ("add", "mul", "floordiv", "mod", "min", "max")


@dataclass(frozen=True)
class Sym:
    """A symbolic expression node: ``op`` is ``"sym"`` (a name) or one of ``_OPS`` over ``args``."""

    op: str
    args: tuple

    # -- arithmetic sugar so model code can write `T // 4`, `2 * T` -------------------------------
    def __add__(self, o: Dim) -> Dim:
        return add(self, o)

    __radd__ = __add__

    def __sub__(self, o: Dim) -> Dim:
        return add(self, mul(-1, o))

    def __rsub__(self, o: Dim) -> Dim:
        return add(o, mul(-1, self))

    def __mul__(self, o: Dim) -> Dim:
        return mul(self, o)

    __rmul__ = __mul__

    def __floordiv__(self, o: Dim) -> Dim:
        return floordiv(self, o)

    def __mod__(self, o: Dim) -> Dim:
        return mod(self, o)

    def __neg__(self) -> Dim:
        return mul(-1, self)

    def __str__(self) -> str:
        return dim_str(self)

    def __repr__(self) -> str:
        return f"Sym({dim_str(self)})"

    @property
    def free_symbols(self) -> set[str]:
        if self.op == "sym":
            return {self.args[0]}
        out: set[str] = set()
        for a in self.args:
            if isinstance(a, Sym):
                out |= a.free_symbols
        return out


def sym(name: str) -> Sym:
    if not name.isidentifier():
        raise IRError(f"bad symbol name {name!r}")
    return Sym("sym", (name,))


def _key(d: Dim) -> str:
    return dim_str(d)


def add(*terms: Dim) -> Dim:
    const, rest = 0, []
    for t in terms:
        if isinstance(t, int):
            const += t
        elif t.op == "add":
            for a in t.args:
                if isinstance(a, int):
                    const += a
                else:
                    rest.append(a)
        else:
            rest.append(t)
    rest = _collect_like_terms(rest)
    if not rest:
        return const
    args = tuple(sorted(rest, key=_key)) + ((const,) if const else ())
    return args[0] if len(args) == 1 else Sym("add", args)


def _split_coef(t: Sym) -> tuple[int, Dim]:
    if t.op == "mul" and isinstance(t.args[0], int):
        rest = t.args[1:]
        return t.args[0], rest[0] if len(rest) == 1 else Sym("mul", rest)
    return 1, t


def _collect_like_terms(terms: list[Sym]) -> list[Dim]:
    coefs: dict[str, list] = {}
    for t in terms:
        c, base = _split_coef(t)
        entry = coefs.setdefault(_key(base), [0, base])
        entry[0] += c
    out = []
    for c, base in coefs.values():
        if c:
            out.append(base if c == 1 else mul(c, base))
    return out


def mul(*factors: Dim) -> Dim:
    const, rest = 1, []
    for f in factors:
        if isinstance(f, int):
            const *= f
        elif f.op == "mul":
            for a in f.args:
                if isinstance(a, int):
                    const *= a
                else:
                    rest.append(a)
        else:
            rest.append(f)
    if const == 0 or not rest:
        return const
    # Distribute a constant over a sum so `2*(T+1)` and `2*T+2` are the same dim.
    if const != 1 and len(rest) == 1 and rest[0].op == "add":
        return add(*(mul(const, a) for a in rest[0].args))
    rest.sort(key=_key)
    args = ((const,) if const != 1 else ()) + tuple(rest)
    return args[0] if len(args) == 1 else Sym("mul", args)


def floordiv(a: Dim, b: Dim) -> Dim:
    if isinstance(b, int):
        if b == 0:
            raise ShapeError("dimension division by zero")
        if b == 1:
            return a
        if isinstance(a, int):
            return a // b
        coef, base = _split_coef(a)
        if coef % b == 0:
            return mul(coef // b, base)
    return Sym("floordiv", (a, b))


def mod(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a % b
    if b == 1:
        return 0
    return Sym("mod", (a, b))


def dmin(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    if a == b:
        return a
    x, y = sorted((a, b), key=_key)
    return Sym("min", (x, y))


def dmax(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    if a == b:
        return a
    x, y = sorted((a, b), key=_key)
    return Sym("max", (x, y))


# ---------------------------------------------------------------------------------------------------
# Text form
# ---------------------------------------------------------------------------------------------------

_PREC = {"add": 1, "mul": 2, "floordiv": 2, "mod": 2}


def dim_str(d: Dim) -> str:
    if isinstance(d, int):
        return str(d)
    return _fmt(d, 0)


def _fmt(d: Dim, parent_prec: int) -> str:
    if isinstance(d, int):
        return str(d) if d >= 0 or parent_prec == 0 else f"({d})"
    if d.op == "sym":
        return d.args[0]
    if d.op in ("min", "max"):
        return f"{d.op}({_fmt(d.args[0], 0)}, {_fmt(d.args[1], 0)})"
    prec = _PREC[d.op]
    if d.op == "add":
        s = _fmt(d.args[0], prec)
        for a in d.args[1:]:
            if isinstance(a, int) and a < 0:
                s += f"-{-a}"
            else:
                c, base = _split_coef(a) if isinstance(a, Sym) else (1, a)
                s += f"-{_fmt(mul(-c, base), prec)}" if c < 0 else f"+{_fmt(a, prec)}"
        text = s
    elif d.op == "mul":
        if d.args[0] == -1:
            text = "-" + "*".join(_fmt(a, prec + 1) for a in d.args[1:])
        else:
            text = "*".join(_fmt(a, prec + 1) for a in d.args)
    else:
        sep = "//" if d.op == "floordiv" else "%"
        text = f"{_fmt(d.args[0], prec)}{sep}{_fmt(d.args[1], prec + 1)}"
    return f"({text})" if prec < parent_prec else text


def parse_dim(text: str | int) -> Dim:
    """Parse ``"T//4"``, ``"2*T+1"``, ``"min(T, 512)"`` or ``"128"`` into a normalised dim."""
    if isinstance(text, int):
        return text
    try:
        tree = ast.parse(str(text).strip(), mode="eval").body
        return _from_ast(tree)
    except (SyntaxError, ValueError) as e:
        raise IRError(f"bad dimension {text!r}: {e}") from None


def _from_ast(n: ast.AST) -> Dim:
    if isinstance(n, ast.Constant) and isinstance(n.value, int) and not isinstance(n.value, bool):
        return n.value
    if isinstance(n, ast.Name):
        return sym(n.id)
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
        return mul(-1, _from_ast(n.operand))
    if isinstance(n, ast.BinOp):
        a, b = _from_ast(n.left), _from_ast(n.right)
        if isinstance(n.op, ast.Add):
            return add(a, b)
        if isinstance(n.op, ast.Sub):
            return add(a, mul(-1, b))
        if isinstance(n.op, ast.Mult):
            return mul(a, b)
        if isinstance(n.op, ast.FloorDiv):
            return floordiv(a, b)
        if isinstance(n.op, ast.Mod):
            return mod(a, b)
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("min", "max"):
        if len(n.args) == 2:
            f = dmin if n.func.id == "min" else dmax
            return f(_from_ast(n.args[0]), _from_ast(n.args[1]))
    raise ValueError(f"unsupported expression {ast.unparse(n)!r}")


# ---------------------------------------------------------------------------------------------------
# Evaluation and shape helpers
# ---------------------------------------------------------------------------------------------------


def evaluate(d: Dim, env: dict[str, int]) -> int:
    if isinstance(d, int):
        return d
    if d.op == "sym":
        try:
            return env[d.args[0]]
        except KeyError:
            raise ShapeError(f"symbol {d.args[0]} is not bound") from None
    vals = [evaluate(a, env) for a in d.args]
    if d.op == "add":
        return sum(vals)
    if d.op == "mul":
        out = 1
        for v in vals:
            out *= v
        return out
    if d.op == "floordiv":
        return vals[0] // vals[1]
    if d.op == "mod":
        return vals[0] % vals[1]
    return min(vals) if d.op == "min" else max(vals)


def substitute(d: Dim, env: dict[str, Dim]) -> Dim:
    """Replace symbols by dims (ints or expressions), re-normalising."""
    if isinstance(d, int):
        return d
    if d.op == "sym":
        return env.get(d.args[0], d)
    args = [substitute(a, env) for a in d.args]
    return _BUILDERS[d.op](*args)


_BUILDERS = {"add": add, "mul": mul, "floordiv": floordiv, "mod": mod, "min": dmin, "max": dmax}


def shape_str(shape: Shape) -> str:
    return "[" + ", ".join(dim_str(d) for d in shape) + "]"


def as_shape(dims) -> Shape:
    return tuple(parse_dim(d) if isinstance(d, str) else d for d in dims)


def is_static(shape: Shape) -> bool:
    return all(isinstance(d, int) for d in shape)


def numel(shape: Shape) -> Dim:
    return mul(*shape) if shape else 1


def _monomial(d: Dim) -> tuple[int, Counter] | None:
    """Write d as coef * product(atoms); None if it is not a monomial (e.g. a sum)."""
    if isinstance(d, int):
        return d, Counter()
    if d.op == "mul":
        coef = d.args[0] if isinstance(d.args[0], int) else 1
        atoms = [a for a in d.args if not isinstance(a, int)]
        return coef, Counter(_key(a) for a in atoms)
    return 1, Counter([_key(d)])


def exact_div(a: Dim, b: Dim) -> Dim | None:
    """a / b when it is exact for every value of the symbols, else None (used to infer reshape's -1)."""
    if isinstance(a, int) and isinstance(b, int):
        return a // b if b and a % b == 0 else None
    if a == b:
        return 1
    ma, mb = _monomial(a), _monomial(b)
    if ma is None or mb is None or mb[0] == 0 or ma[0] % mb[0]:
        return None
    rest = ma[1].copy()
    rest.subtract(mb[1])
    if any(v < 0 for v in rest.values()):
        return None
    factors = [parse_dim(k) for k, v in rest.items() for _ in range(v)]
    return mul(ma[0] // mb[0], *factors)


def dims_equal(a: Dim, b: Dim) -> bool:
    return a == b


def broadcast_shapes(a: Shape, b: Shape) -> Shape | None:
    """Numpy-style broadcasting; None if the shapes do not broadcast."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(reversed(out))
