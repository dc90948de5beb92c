"""ONNX export/import with a ``deepinfer`` custom domain, and an ONNX ReferenceEvaluator over our ops.

Export (``export_onnx``):
- every node is an op of domain ``deepinfer`` (opset 1), named ``"<index>:<first output>"``; absent optional
  inputs are ``""``;
- attributes by the op schema's kind: int/bool -> INT, str/dtype/dim -> STRING (dims as ``"T//4"``), ints ->
  INTS, strs/shape -> STRINGS, float/floats -> a float64 TENSOR (exact; ONNX FLOAT attributes are float32);
  attributes whose value is None are listed in the STRINGS attribute ``_deepinfer_none``;
- symbolic dims are ``dim_param`` strings; dtypes map to ONNX element types (f8e4m3 -> FLOAT8E4M3FN,
  e8m0 -> FLOAT8E8M0, packed fp4 -> UINT8 with the dtype recorded in the metadata ``deepinfer.dtypes``);
- parameters are graph inputs, or initializers when tensors are given (``params=``); their declared types
  are also kept in ``value_info`` then;
- metadata_props: ``deepinfer.format``, ``deepinfer.version``, ``deepinfer.meta`` (graph meta as JSON),
  ``deepinfer.params`` (parameter names in order), ``deepinfer.dtypes``.

``import_onnx`` inverts it exactly (``import_onnx(export_onnx(g)) == g``); a node whose op is not registered,
or a standard-domain op that has no mapping, raises SerializationError naming the node and op.

``reference_evaluator(g)`` runs the exported model in ``onnx.reference.ReferenceEvaluator`` with one OpRun
per registered op calling our torch reference.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from deepinfer.errors import DeepInferError, SerializationError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.dtypes import DType
from deepinfer.ir.graph import Graph, Node, TensorType, Value
from deepinfer.ir.registry import OpDef, all_ops, get_op, has_op
from deepinfer.ir.serialize import attr_kind_of
from deepinfer.ir.shapes import dim_str, parse_dim

DOMAIN = "deepinfer"
DOMAIN_VERSION = 1
ONNX_OPSET = 21
FORMAT = "deepinfer.onnx"
VERSION = 1
NONE_ATTR = "_deepinfer_none"

_ELEM: dict[str, int] = {
    "bf16": TensorProto.BFLOAT16,
    "f16": TensorProto.FLOAT16,
    "f32": TensorProto.FLOAT,
    "f64": TensorProto.DOUBLE,
    "f8e4m3": TensorProto.FLOAT8E4M3FN,
    "e8m0": TensorProto.FLOAT8E8M0,
    "f4e2m1x2": TensorProto.UINT8,  # packed: recorded in deepinfer.dtypes
    "u8": TensorProto.UINT8,
    "i8": TensorProto.INT8,
    "i32": TensorProto.INT32,
    "i64": TensorProto.INT64,
    "bool": TensorProto.BOOL,
}
_FROM_ELEM: dict[int, DType] = {e: dt.ALL_DTYPES[n] for n, e in _ELEM.items() if n != "f4e2m1x2"}

# Standard ONNX ops (default domain) without attributes that map one-to-one onto ours.
STANDARD_OPS = {
    "Add": "add",
    "Sub": "sub",
    "Mul": "mul",
    "Div": "div",
    "Pow": "pow",
    "Max": "maximum",
    "Min": "minimum",
    "Neg": "neg",
    "Abs": "abs",
    "Exp": "exp",
    "Log": "log",
    "Sqrt": "sqrt",
    "Sigmoid": "sigmoid",
    "Relu": "relu",
    "Tanh": "tanh",
    "Softplus": "softplus",
    "MatMul": "matmul",
    "Where": "where",
}


# ---------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------


def _value_info(v: Value) -> onnx.ValueInfoProto:
    shape = [d if isinstance(d, int) else dim_str(d) for d in v.shape]
    return helper.make_tensor_value_info(v.name, _ELEM[v.dtype.name], shape)


def _encode_attr(name: str, kind: str, v: Any) -> AttributeProto:
    if kind in ("int", "bool"):
        return helper.make_attribute(name, int(v), attr_type=AttributeProto.INT)
    if kind in ("float", "floats"):
        arr = np.array(v if kind == "float" else list(v), dtype=np.float64)
        return helper.make_attribute(name, numpy_helper.from_array(arr, name), attr_type=AttributeProto.TENSOR)
    if kind == "str":
        return helper.make_attribute(name, v, attr_type=AttributeProto.STRING)
    if kind == "dtype":
        return helper.make_attribute(name, v.name if isinstance(v, DType) else str(v), attr_type=AttributeProto.STRING)
    if kind == "dim":
        return helper.make_attribute(name, dim_str(v), attr_type=AttributeProto.STRING)
    if kind == "ints":
        return helper.make_attribute(name, [int(x) for x in v], attr_type=AttributeProto.INTS)
    if kind == "strs":
        return helper.make_attribute(name, list(v), attr_type=AttributeProto.STRINGS)
    if kind == "shape":
        return helper.make_attribute(name, [dim_str(d) for d in v], attr_type=AttributeProto.STRINGS)
    raise SerializationError(f"attribute {name!r}: kind {kind!r} cannot be written to ONNX")


def _tensor_proto(name: str, t: torch.Tensor, d: DType) -> TensorProto:
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return helper.make_tensor(name, _ELEM[d.name], list(t.shape), raw, raw=True)


def export_onnx(
    g: Graph, params: Mapping[str, torch.Tensor] | None = None, path: str | os.PathLike | None = None
) -> onnx.ModelProto:
    """The graph as an ONNX model (and written to ``path`` if given)."""
    nodes = []
    for i, n in enumerate(g.nodes):
        attrs, nones = [], []
        for k, v in n.attrs.items():
            if v is None:
                nones.append(k)
            else:
                attrs.append(_encode_attr(k, attr_kind_of(n.op, k, v), v))
        if nones:
            attrs.append(helper.make_attribute(NONE_ATTR, nones, attr_type=AttributeProto.STRINGS))
        node = helper.make_node(
            n.op,
            ["" if x is None else x.name for x in n.inputs],
            [o.name for o in n.outputs],
            name=n.outputs[0].name if n.outputs else f"node{i}",
            domain=DOMAIN,
        )
        node.attribute.extend(attrs)
        nodes.append(node)

    out_names = {v.name for v in g.outputs}
    inputs = [_value_info(v) for v in g.inputs]
    value_info = [_value_info(o) for n in g.nodes for o in n.outputs if o.name not in out_names]
    initializers = []
    if params is None:
        inputs += [_value_info(p) for p in g.params]
    else:
        for p in g.params:
            if p.name not in params:
                raise SerializationError(f"export_onnx: no tensor for parameter %{p.name} ({p.type})")
            initializers.append(_tensor_proto(p.name, params[p.name], p.dtype))
            value_info.append(_value_info(p))
    graph = helper.make_graph(
        nodes, g.name, inputs, [_value_info(v) for v in g.outputs], initializer=initializers, value_info=value_info
    )
    model = helper.make_model(
        graph,
        producer_name="deepinfer",
        opset_imports=[helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
    )
    special = {v.name: v.dtype.name for v in g.values().values() if v.dtype.name == "f4e2m1x2"}
    props = {
        "deepinfer.format": FORMAT,
        "deepinfer.version": str(VERSION),
        "deepinfer.meta": json.dumps(g.meta, sort_keys=True),
        "deepinfer.params": json.dumps([p.name for p in g.params]),
        "deepinfer.dtypes": json.dumps(special, sort_keys=True),
    }
    helper.set_model_props(model, props)
    if path is not None:
        onnx.save(model, os.fspath(path))
    return model


# ---------------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------------


def _load_model(model_or_path: Any) -> tuple[onnx.ModelProto, str]:
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path, "<onnx model>"
    if isinstance(model_or_path, bytes):
        try:
            return onnx.load_from_string(model_or_path), "<onnx bytes>"
        except Exception as e:  # protobuf raises its own DecodeError
            raise SerializationError(f"<onnx bytes>: not an ONNX model: {e}") from None
    src = os.fspath(model_or_path)
    if not os.path.isfile(src):
        raise SerializationError(f"{src}: no such file")
    try:
        return onnx.load(src), src
    except Exception as e:
        raise SerializationError(f"{src}: not an ONNX model: {str(e).splitlines()[0] if str(e) else e}") from None


def _json_prop(props: dict[str, str], key: str, default: Any, src: str) -> Any:
    if key not in props:
        return default
    try:
        return json.loads(props[key])
    except json.JSONDecodeError as e:
        raise SerializationError(f"{src}: metadata {key}: bad JSON: {e.msg}") from None


def _type_from(vi: onnx.ValueInfoProto, dtypes: dict[str, str], src: str) -> TensorType:
    where = f"{src}: value {vi.name!r}"
    if not vi.type.HasField("tensor_type"):
        raise SerializationError(f"{where}: not a tensor")
    tt = vi.type.tensor_type
    if vi.name in dtypes:
        if dtypes[vi.name] not in dt.ALL_DTYPES:
            raise SerializationError(f"{where}: unknown dtype {dtypes[vi.name]!r} in deepinfer.dtypes")
        d = dt.ALL_DTYPES[dtypes[vi.name]]
    elif tt.elem_type in _FROM_ELEM:
        d = _FROM_ELEM[tt.elem_type]
    else:
        raise SerializationError(f"{where}: element type {TensorProto.DataType.Name(tt.elem_type)} has no dtype")
    if not tt.HasField("shape"):
        raise SerializationError(f"{where}: no shape")
    dims = []
    for j, dim in enumerate(tt.shape.dim):
        if dim.HasField("dim_value"):
            dims.append(int(dim.dim_value))
        elif dim.HasField("dim_param"):
            try:
                dims.append(parse_dim(dim.dim_param))
            except DeepInferError as e:
                raise SerializationError(f"{where}: dim {j}: {e}") from None
        else:
            raise SerializationError(f"{where}: dim {j} is unknown")
    return TensorType(d, tuple(dims))


def _attr_value(a: AttributeProto, kind: str, where: str) -> Any:
    A = AttributeProto
    want = {
        "int": A.INT,
        "bool": A.INT,
        "float": A.TENSOR,
        "floats": A.TENSOR,
        "str": A.STRING,
        "dtype": A.STRING,
        "dim": A.STRING,
        "ints": A.INTS,
        "strs": A.STRINGS,
        "shape": A.STRINGS,
    }[kind]
    # Accept plain ONNX FLOAT/FLOATS too (written by other tools), though they are only float32.
    if kind == "float" and a.type == A.FLOAT:
        return float(a.f)
    if kind == "floats" and a.type == A.FLOATS:
        return [float(x) for x in a.floats]
    if a.type != want:
        raise SerializationError(
            f"{where}: expected an ONNX {A.AttributeType.Name(want)} attribute ({kind}), "
            f"got {A.AttributeType.Name(a.type)}"
        )
    try:
        if kind == "int":
            return int(a.i)
        if kind == "bool":
            return bool(a.i)
        if kind in ("float", "floats"):
            arr = numpy_helper.to_array(a.t).astype(np.float64)
            if kind == "float":
                if arr.ndim != 0:
                    raise ValueError("expected a scalar tensor")
                return float(arr)
            if arr.ndim != 1:
                raise ValueError("expected a 1-D tensor")
            return [float(x) for x in arr]
        if kind == "str":
            return a.s.decode()
        if kind == "dtype":
            return dt.dtype(a.s.decode())
        if kind == "dim":
            return parse_dim(a.s.decode())
        if kind == "ints":
            return [int(x) for x in a.ints]
        if kind == "strs":
            return [s.decode() for s in a.strings]
        return [parse_dim(s.decode()) for s in a.strings]
    except (ValueError, UnicodeDecodeError, DeepInferError) as e:
        raise SerializationError(f"{where}: {e}") from None


def node_attrs(node: onnx.NodeProto, opdef: OpDef, where: str) -> dict[str, Any]:
    """Decode an exported node's attributes by the op schema's kinds."""
    attrs: dict[str, Any] = {}
    for a in node.attribute:
        if a.name == NONE_ATTR:
            for k in (s.decode() for s in a.strings):
                if k not in opdef.attrs:
                    raise SerializationError(f"{where}: {opdef.name} has no attribute {k!r}")
                attrs[k] = None
            continue
        if a.name not in opdef.attrs:
            raise SerializationError(f"{where}: {opdef.name} has no attribute {a.name!r}")
        attrs[a.name] = _attr_value(a, opdef.attrs[a.name].kind, f"{where}: attribute {a.name!r}")
    # Keep the exporter's order (the node's attribute order), with None-valued ones where the schema puts them.
    order = [a.name for a in node.attribute if a.name != NONE_ATTR]
    return {k: attrs[k] for k in sorted(attrs, key=lambda k: order.index(k) if k in order else len(order))}


def _resolve_op(node: onnx.NodeProto, where: str) -> OpDef:
    domain = node.domain or ""
    if domain == DOMAIN:
        if not has_op(node.op_type):
            raise SerializationError(f"{where}: unknown op '{DOMAIN}.{node.op_type}'")
        return get_op(node.op_type)
    if domain in ("", "ai.onnx") and node.op_type in STANDARD_OPS:
        if node.attribute:
            raise SerializationError(f"{where}: ONNX op {node.op_type} with attributes is not supported")
        return get_op(STANDARD_OPS[node.op_type])
    shown = f"{domain}.{node.op_type}" if domain else node.op_type
    raise SerializationError(f"{where}: unknown op {shown!r} (no deepinfer mapping)")


def import_onnx(model_or_path: Any) -> Graph:
    """An ONNX model (ModelProto, bytes or a path) as a Graph; exact inverse of ``export_onnx``."""
    model, src = _load_model(model_or_path)
    props = {p.key: p.value for p in model.metadata_props}
    meta = _json_prop(props, "deepinfer.meta", {}, src)
    param_names = _json_prop(props, "deepinfer.params", None, src)
    dtypes = _json_prop(props, "deepinfer.dtypes", {}, src)
    og = model.graph
    inits = {t.name: t for t in og.initializer}
    if param_names is None:  # a foreign model: its initializers are the parameters
        param_names = [t.name for t in og.initializer]
    infos: dict[str, onnx.ValueInfoProto] = {}
    for vi in list(og.value_info) + list(og.input) + list(og.output):
        infos.setdefault(vi.name, vi)

    def declared(name: str) -> TensorType | None:
        if name in infos:
            return _type_from(infos[name], dtypes, src)
        if name in inits:
            t = inits[name]
            vi = helper.make_tensor_value_info(name, t.data_type, list(t.dims))
            return _type_from(vi, dtypes, src)
        return None

    g = Graph(og.name, meta=dict(meta) if isinstance(meta, dict) else {})
    values: dict[str, Value] = {}
    pset = set(param_names)
    for vi in og.input:
        if vi.name in pset or vi.name in inits:
            continue
        v = Value(vi.name, _type_from(vi, dtypes, src), "input")
        g.inputs.append(v)
        values[v.name] = v
    for name in param_names:
        t = declared(name)
        if t is None:
            raise SerializationError(f"{src}: parameter {name!r} has no type")
        v = Value(name, t, "param")
        g.params.append(v)
        values[name] = v

    for i, node in enumerate(og.node):
        first = f"%{node.output[0]}" if node.output else "(no outputs)"
        where = f"{src}: node {i} ({first} = {node.op_type})"
        opdef = _resolve_op(node, where)
        ins: list[Value | None] = []
        for name in node.input:
            if name == "":
                ins.append(None)
            elif name not in values:
                raise SerializationError(f"{where}: input {name!r} is not defined")
            else:
                ins.append(values[name])
        attrs = node_attrs(node, opdef, where) if node.domain == DOMAIN else {}
        n = Node(opdef.name, ins, attrs)
        types = [declared(o) for o in node.output]
        if any(t is None for t in types):
            try:
                inferred = opdef.infer(
                    [None if a is None else a.type for a in opdef.bind_inputs(ins)], opdef.bind_attrs(attrs)
                )
            except DeepInferError as e:
                raise SerializationError(f"{where}: {e}") from None
            types = [t if t is not None else inferred[k] for k, t in enumerate(types)]
        for name, t in zip(node.output, types):
            v = Value(name, t, "node", n)
            n.outputs.append(v)
            values[name] = v
        g.nodes.append(n)
    for vi in og.output:
        if vi.name not in values:
            raise SerializationError(f"{src}: graph output {vi.name!r} is not defined")
        g.outputs.append(values[vi.name])
    return g


# ---------------------------------------------------------------------------------------------------
# ReferenceEvaluator with our ops
# ---------------------------------------------------------------------------------------------------

_ML = {
    "bf16": ml_dtypes.bfloat16,
    "f8e4m3": ml_dtypes.float8_e4m3fn,
    "e8m0": ml_dtypes.float8_e8m0fnu,
}
_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def to_torch(a: Any, d: DType | None) -> torch.Tensor:
    """A numpy array (maybe of an ml_dtypes type) as a torch tensor of dtype ``d`` (bit-exact)."""
    a = np.asarray(a)
    if d is None or d.name not in _ML:
        t = torch.from_numpy(np.ascontiguousarray(a).copy())
        return t if d is None or d.packed != 1 else t.to(d.torch_dtype)
    size = a.dtype.itemsize
    raw = torch.from_numpy(np.ascontiguousarray(a).view(_INT_OF_SIZE[size]).copy())
    return raw.view(d.torch_dtype)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    d = dt.from_torch(t.dtype) if t.dtype != torch.uint8 else dt.u8
    if d.name in _ML:
        size = t.element_size()
        return t.view(_TORCH_INT_OF_SIZE[size]).numpy().view(_ML[d.name])
    return t.numpy()


def reference_evaluator(g: Graph, params: Mapping[str, torch.Tensor] | None = None):
    """``onnx.reference.ReferenceEvaluator`` over ``export_onnx(g, params)`` running our torch references.

    Symbolic dims in attributes are evaluated from the fed input shapes, as the interpreter does. Feed
    numpy arrays (ml_dtypes arrays for bf16/fp8/e8m0) by graph input (and parameter, unless given) names.
    """
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    from deepinfer.ir.interpreter import bind_symbols, concrete_attrs

    model = export_onnx(g, params)
    types = {name: v.dtype for name, v in g.values().items()}
    env: dict[str, int] = {}

    def make(opdef: OpDef) -> type:
        def _run(self, *inputs, **_onnx_attrs):
            if not hasattr(self, "_di_attrs"):
                self._di_attrs = node_attrs(self.onnx_node, opdef, f"node {self.onnx_node.name!r}")
            names = list(self.onnx_node.input)
            tensors = [None if a is None else to_torch(a, types.get(n)) for a, n in zip(inputs, names)]
            attrs = concrete_attrs(Node(opdef.name, [], self._di_attrs), env)
            return tuple(to_numpy(t) for t in opdef.run(tensors, attrs))

        return type(opdef.name, (OpRun,), {"op_domain": DOMAIN, "_run": _run})

    class Evaluator(ReferenceEvaluator):
        def run(self, output_names, feed_inputs, *args, **kwargs):
            feeds = {v.name: to_torch(feed_inputs[v.name], v.dtype) for v in g.inputs if v.name in feed_inputs}
            env.clear()
            env.update(bind_symbols(g, feeds))
            return super().run(output_names, feed_inputs, *args, **kwargs)

    return Evaluator(model, new_ops=[make(o) for o in all_ops().values()])
