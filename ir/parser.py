"""Parse the text form written by ``ir.printer.print_graph`` back into a Graph.

``parse_graph(print_graph(g)) == g`` and printing the result gives the same text. The grammar, one item per
line (blank lines and lines starting with ``#`` are skipped)::

    graph "name" {
      meta {JSON object}
      input %name: dtype[dim, ...]
      param %name: dtype[dim, ...]
      %out: dtype[...], %out2: dtype[...] = op(%in, _, ...) {attr=value, ...}
      output %name, ...
    }

Attribute values are read by the op schema's attribute kind, so ``bf16`` is a dtype, ``T//4`` a dim and
``[T, 4, -1]`` a shape. Every error is a ParseError ``source:line:col: what is wrong``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from deepinfer.errors import IRError, ParseError
from deepinfer.ir.dtypes import ALL_DTYPES
from deepinfer.ir.graph import Graph, Node, TensorType, Value
from deepinfer.ir.registry import REQUIRED, OpDef, get_op, has_op
from deepinfer.ir.shapes import Dim, parse_dim

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-/$")
_IDENT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")
_JSON = json.JSONDecoder()


class _Line:
    """A cursor over one line of text; errors carry source:line:col."""

    def __init__(self, text: str, lineno: int, source: str):
        self.text = text
        self.pos = 0
        self.lineno = lineno
        self.source = source

    # -- errors ----------------------------------------------------------------------------------------
    def error(self, msg: str, pos: int | None = None) -> ParseError:
        col = (self.pos if pos is None else pos) + 1
        return ParseError(f"{self.source}:{self.lineno}:{col}: {msg}")

    def _near(self) -> str:
        rest = self.text[self.pos :].strip()
        if not rest:
            return "end of line"
        return repr(rest[:12] + ("..." if len(rest) > 12 else ""))

    # -- scanning --------------------------------------------------------------------------------------
    def ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def peek(self) -> str:
        self.ws()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def at_end(self) -> bool:
        return self.peek() == ""

    def accept(self, tok: str) -> bool:
        self.ws()
        if self.text.startswith(tok, self.pos):
            self.pos += len(tok)
            return True
        return False

    def expect(self, tok: str, what: str | None = None) -> None:
        if not self.accept(tok):
            raise self.error(f"expected {what or repr(tok)}, found {self._near()}")

    def expect_end(self) -> None:
        if not self.at_end():
            raise self.error(f"unexpected {self._near()} at end of line")

    def ident(self, what: str = "a name") -> str:
        self.ws()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in _IDENT_CHARS:
            self.pos += 1
        if start == self.pos:
            raise self.error(f"expected {what}, found {self._near()}")
        return self.text[start : self.pos]

    def value_name(self) -> tuple[str, int]:
        """``%name``; returns the name and the column of the ``%``."""
        self.ws()
        start = self.pos
        if not self.accept("%"):
            raise self.error(f"expected a value name like %x, found {self._near()}")
        begin = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in _NAME_CHARS:
            self.pos += 1
        if begin == self.pos:
            raise self.error("empty value name after '%'", start)
        return self.text[begin : self.pos], start

    def json_value(self, what: str) -> Any:
        self.ws()
        try:
            v, end = _JSON.raw_decode(self.text, self.pos)
        except json.JSONDecodeError as e:
            raise self.error(f"bad {what}: {e.msg}", e.pos) from None
        self.pos = end
        return v

    def balanced(self, stops: str) -> tuple[str, int]:
        """Text up to the next top-level stop character (parentheses may nest); returns (text, start)."""
        self.ws()
        start, depth = self.pos, 0
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c == "(":
                depth += 1
            elif c == ")":
                if depth == 0 and ")" in stops:
                    break
                depth -= 1
                if depth < 0:
                    raise self.error("unbalanced ')'")
            elif depth == 0 and c in stops:
                break
            elif c == '"':
                raise self.error("unexpected string")
            self.pos += 1
        if depth:
            raise self.error("missing ')'", start)
        return self.text[start : self.pos].strip(), start


# ---------------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------------


def _dim(cur: _Line, stops: str) -> Dim:
    text, start = cur.balanced(stops)
    if not text:
        raise cur.error("expected a dimension", start)
    try:
        return parse_dim(text)
    except IRError as e:
        raise cur.error(str(e), start) from None


def _type(cur: _Line) -> TensorType:
    cur.ws()
    start = cur.pos
    name = cur.ident("a dtype")
    if name not in ALL_DTYPES:
        raise cur.error(f"unknown dtype {name!r} (known: {', '.join(ALL_DTYPES)})", start)
    cur.expect("[", "'[' starting the shape")
    dims: list[Dim] = []
    if not cur.accept("]"):
        while True:
            dims.append(_dim(cur, ",]"))
            if cur.accept("]"):
                break
            cur.expect(",", "',' or ']' in the shape")
    return TensorType(ALL_DTYPES[name], tuple(dims))


def _typed_value(cur: _Line) -> tuple[str, TensorType, int]:
    name, col = cur.value_name()
    cur.expect(":", "':' and a type after the value name")
    return name, _type(cur), col


def _scalar_token(cur: _Line, stops: str) -> tuple[str, int]:
    text, start = cur.balanced(stops)
    if not text:
        raise cur.error("expected a value", start)
    return text, start


def _parse_int(cur: _Line, stops: str) -> int:
    text, start = _scalar_token(cur, stops)
    try:
        return int(text, 10)
    except ValueError:
        raise cur.error(f"expected an integer, found {text!r}", start) from None


def _parse_float(cur: _Line, stops: str) -> float:
    text, start = _scalar_token(cur, stops)
    low = text.lower()
    if low in ("nan", "+nan", "-nan"):
        return math.nan
    if low in ("inf", "+inf", "-inf"):
        return -math.inf if low[0] == "-" else math.inf
    try:
        return float(text)
    except ValueError:
        raise cur.error(f"expected a number, found {text!r}", start) from None


def _parse_scalar(cur: _Line, kind: str, stops: str) -> Any:
    if kind in ("str",):
        if cur.peek() != '"':
            raise cur.error(f"expected a string in double quotes, found {cur._near()}")
        v = cur.json_value("string")
        if not isinstance(v, str):
            raise cur.error("expected a string")
        return v
    if kind == "int":
        return _parse_int(cur, stops)
    if kind == "float":
        return _parse_float(cur, stops)
    if kind == "bool":
        text, start = _scalar_token(cur, stops)
        if text not in ("true", "false"):
            raise cur.error(f"expected true or false, found {text!r}", start)
        return text == "true"
    if kind == "dtype":
        text, start = _scalar_token(cur, stops)
        if text not in ALL_DTYPES:
            raise cur.error(f"unknown dtype {text!r} (known: {', '.join(ALL_DTYPES)})", start)
        return ALL_DTYPES[text]
    if kind == "dim":
        return _dim(cur, stops)
    raise cur.error(f"attribute kind {kind} is not supported by the parser")


_LIST_OF = {"ints": "int", "floats": "float", "strs": "str", "shape": "dim"}


def _attr_value(cur: _Line, kind: str) -> Any:
    start = cur.pos
    cur.ws()
    if cur.text.startswith("none", cur.pos):
        after = cur.pos + 4
        rest = cur.text[after:].lstrip(" \t")
        if not rest or rest[0] in ",}":
            cur.pos = after
            return None
    if kind in _LIST_OF:
        cur.expect("[", f"'[' starting a list ({kind})")
        out: list = []
        if not cur.accept("]"):
            while True:
                out.append(_parse_scalar(cur, _LIST_OF[kind], ",]"))
                if cur.accept("]"):
                    break
                cur.expect(",", "',' or ']' in the list")
        return out
    if cur.peek() == "[":
        raise cur.error(f"expected a {kind}, found a list", start)
    return _parse_scalar(cur, kind, ",}")


def _attrs(cur: _Line, opdef: OpDef) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    if not cur.accept("{"):
        return attrs
    if cur.accept("}"):
        return attrs
    while True:
        cur.ws()
        kstart = cur.pos
        key = cur.ident("an attribute name")
        if key not in opdef.attrs:
            known = ", ".join(opdef.attrs) or "none"
            raise cur.error(f"{opdef.name} has no attribute {key!r} (attributes: {known})", kstart)
        if key in attrs:
            raise cur.error(f"attribute {key!r} given twice", kstart)
        cur.expect("=", f"'=' after attribute {key}")
        attrs[key] = _attr_value(cur, opdef.attrs[key].kind)
        if cur.accept("}"):
            break
        cur.expect(",", "',' or '}' after the attribute value")
    return attrs


# ---------------------------------------------------------------------------------------------------
# Graph
# ---------------------------------------------------------------------------------------------------


class _State:
    def __init__(self, source: str):
        self.source = source
        self.values: dict[str, Value] = {}
        self.where: dict[str, int] = {}

    def define(self, cur: _Line, name: str, col: int, v: Value) -> None:
        if name in self.values:
            raise cur.error(f"%{name} is already defined (line {self.where[name]})", col)
        self.values[name] = v
        self.where[name] = cur.lineno

    def use(self, cur: _Line) -> Value:
        name, col = cur.value_name()
        try:
            return self.values[name]
        except KeyError:
            raise cur.error(f"undefined value %{name}", col) from None


def _node(cur: _Line, st: _State) -> Node:
    outs: list[tuple[str, TensorType, int]] = []
    if cur.peek() != "=":
        while True:
            outs.append(_typed_value(cur))
            if not cur.accept(","):
                break
    cur.expect("=", "'=' after the node's outputs")
    cur.ws()
    op_col = cur.pos
    op = cur.ident("an op name")
    if not has_op(op):
        raise cur.error(f"unknown op {op!r}", op_col)
    opdef = get_op(op)
    cur.expect("(", f"'(' after {op}")
    inputs: list[Value | None] = []
    if not cur.accept(")"):
        while True:
            cur.ws()
            if cur.peek() == "_" and cur.text[cur.pos + 1 : cur.pos + 2] in ("", ",", ")", " "):
                cur.pos += 1
                inputs.append(None)
            else:
                inputs.append(st.use(cur))
            if cur.accept(")"):
                break
            cur.expect(",", "',' or ')' in the inputs")
    try:
        opdef.bind_inputs(inputs)
    except IRError as e:
        raise cur.error(str(e), op_col) from None
    cur.ws()
    attrs_col = cur.pos if cur.peek() == "{" else op_col
    attrs = _attrs(cur, opdef)
    cur.expect_end()
    missing = [k for k, a in opdef.attrs.items() if a.default is REQUIRED and k not in attrs]
    if missing:
        raise cur.error(f"{op}: attribute {missing[0]!r} is required", attrs_col)
    node = Node(op, inputs, attrs)
    for name, t, col in outs:
        v = Value(name, t, "node", node)
        st.define(cur, name, col, v)
        node.outputs.append(v)
    return node


def parse_graph(text: str, source: str = "<string>") -> Graph:
    """Parse the printer's text form; raises ParseError ``source:line:col: message``."""
    lines = text.splitlines()
    st = _State(source)
    g: Graph | None = None
    closed = False
    last = 0
    for i, raw in enumerate(lines, 1):
        cur = _Line(raw, i, source)
        if cur.at_end() or cur.peek() == "#":
            continue
        last = i
        if closed:
            raise cur.error(f"unexpected {cur._near()} after the closing '}}'")
        if g is None:
            kw_col = cur.pos
            if cur.text[cur.pos :].split(" ", 1)[0] != "graph":
                raise cur.error(f"expected 'graph \"name\" {{', found {cur._near()}", kw_col)
            cur.pos += len("graph")
            if cur.peek() == '"':
                name = cur.json_value("graph name")
                if not isinstance(name, str):
                    raise cur.error("graph name must be a string")
            else:
                name = cur.ident("a graph name")
            cur.expect("{", "'{' after the graph name")
            cur.expect_end()
            g = Graph(name)
            continue
        if cur.accept("}"):
            cur.expect_end()
            closed = True
            continue
        _statement(cur, st, g)
    if g is None:
        raise ParseError(f"{source}:{max(last, 1)}:1: no graph found (expected 'graph \"name\" {{')")
    if not closed:
        n = len(lines)
        col = len(lines[-1]) + 1 if lines else 1
        raise ParseError(f"{source}:{max(n, 1)}:{col}: missing closing '}}' of graph {g.name!r}")
    return g


def _statement(cur: _Line, st: _State, g: Graph) -> None:
    if cur.peek() == "%" or cur.peek() == "=":
        g.nodes.append(_node(cur, st))
        return
    kw_col = cur.pos
    kw = cur.ident("a statement (input, param, output, meta or a node)")
    if kw in ("input", "param"):
        name, t, col = _typed_value(cur)
        cur.expect_end()
        v = Value(name, t, kw)
        st.define(cur, name, col, v)
        (g.inputs if kw == "input" else g.params).append(v)
    elif kw == "output":
        if not cur.at_end():
            while True:
                g.outputs.append(st.use(cur))
                if not cur.accept(","):
                    break
        cur.expect_end()
    elif kw == "meta":
        if cur.peek() != "{":
            raise cur.error(f"expected a JSON object after meta, found {cur._near()}")
        meta = cur.json_value("meta JSON")
        cur.expect_end()
        g.meta.update(meta)
    else:
        raise cur.error(f"unknown statement {kw!r} (expected input, param, output, meta or a node)", kw_col)
