"""Symbolic dims and static shapes: the part of the import that binds `--dim` values and infers
every tensor's shape (planner/graph.py calls it). Exporters write intermediate shapes as expressions
("batch*seq", "s0 + 1"); they are evaluated with the bound dims before ONNX shape inference runs.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Mapping

import onnx
from onnx import shape_inference

from core.errors import DimBindingError, ModelError

# Protobuf refuses messages over 2 GiB; above this a model's shapes are inferred on the file.
_PROTO_LIMIT_BYTES = 2**31 - 1



def bind_dims(user_inputs: list[onnx.ValueInfoProto], dims: Mapping[str, int]) -> dict[str, int]:
    needed: list[str] = []
    for v in user_inputs:
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param and d.dim_param not in needed:
                needed.append(d.dim_param)
            elif not d.dim_param and not d.HasField("dim_value"):
                raise DimBindingError(
                    f"input {v.name!r} has an unnamed dynamic dim; re-export with named dynamic dims "
                    "(torch.export.Dim) or static shapes"
                )
    unknown = sorted(set(dims) - set(needed))
    if unknown:
        hint = ", ".join(needed) if needed else "none: every input shape is static"
        raise DimBindingError(f"`dims` names {', '.join(unknown)} not in the model; its symbolic dims: {hint}",
                              unknown=tuple(unknown))
    unbound = [d for d in needed if d not in dims]
    if unbound:
        flags = " ".join(f"`dims` {d}=N" for d in unbound)
        raise DimBindingError(f"unbound symbolic dims: {', '.join(unbound)}; bind them with {flags}",
                              unbound=tuple(unbound))
    for k, size in dims.items():
        if size <= 0:
            raise DimBindingError(f"`dims` {k}={size}: a dimension must be a positive integer")
    return {d: int(dims[d]) for d in needed}


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _eval_dim(expr: str, bound: Mapping[str, int]) -> int | None:
    """Evaluate an exporter's dim expression such as "2*seq" or "s0 + 1" with the bound dims."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in bound:
            return bound[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(expr)

    try:
        return ev(ast.parse(expr, mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError):
        return None


# Above this batch, shapes are inferred at batches 1, 2, 3 and 7 and carried to the bound one along their
# affine course (`_extrapolated`): ONNX's data propagation holds every value it propagates as a shape
# proto, and a mixture of experts' routing indices (a constant expanded to tokens × top-k) then take
# ~100 MB per sequence of 4096 — gigabytes at a global batch.
EXTRAPOLATE_ABOVE = 4


def with_static_shapes(model: onnx.ModelProto, bound: Mapping[str, int]) -> onnx.ModelProto:
    """Copy the model with bound dims substituted everywhere and the remaining shapes inferred."""
    batch = bound.get("batch", 0)
    if batch > EXTRAPOLATE_ABOVE:
        found = _extrapolated(model, bound)
        if found is not None:
            return found
    return _inferred(model, bound)


def _extrapolated(model: onnx.ModelProto, bound: Mapping[str, int]) -> onnx.ModelProto | None:
    """The model's shapes at `bound` from those at batches 1, 2, 3 and 7: each dim d(b) = d(1) + (d(2) −
    d(1))·(b − 1), where every dim of every tensor follows that line through all four (else None: the
    full inference decides; 7, past the others, catches a max(batch, 4) or a batch // 4 flat on 1–3)."""
    base, (d1, d2, d3, d7) = _bases(model, bound)
    b = bound["batch"]
    if not (d1.keys() == d2.keys() == d3.keys() == d7.keys()):
        return None
    out = onnx.ModelProto()
    out.CopyFrom(base)
    for v in (*out.graph.input, *out.graph.value_info, *out.graph.output):
        if not v.type.HasField("tensor_type"):
            continue
        a, c, e, f = d1[v.name], d2[v.name], d3[v.name], d7[v.name]
        if not (len(a) == len(c) == len(e) == len(f)):
            return None
        for d, x, y, z, w in zip(v.type.tensor_type.shape.dim, a, c, e, f, strict=True):
            if x is None or y is None or z is None or w is None:
                if not (x is None and y is None and z is None and w is None):
                    return None
                continue
            if z - y != y - x or w - x != 6 * (y - x):
                return None
            d.dim_value = x + (y - x) * (b - 1)
    return out


_Dims = dict[str, list[int | None]]
# The inferences at batches 1, 2, 3, 7 of the last models extrapolated (the planner binds the batch once
# per micro-step count: one inference of four, not four each): (model, its other dims) → the model it
# is checked to be, the batch-1 inference and the four inferences' dims.
_BASES: dict[tuple[int, tuple[tuple[str, int], ...]], tuple[onnx.ModelProto, onnx.ModelProto, list[_Dims]]] = {}
_BASES_KEPT = 2


def _bases(model: onnx.ModelProto, bound: Mapping[str, int]) -> tuple[onnx.ModelProto, list[_Dims]]:
    key = (id(model), tuple(sorted((k, v) for k, v in bound.items() if k != "batch")))
    hit = _BASES.get(key)
    if hit is not None and hit[0] is model:
        return hit[1], hit[2]
    ms = [_inferred(model, {**bound, "batch": b}) for b in (1, 2, 3, 7)]

    def dims(m: onnx.ModelProto) -> _Dims:
        return {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
                for v in (*m.graph.input, *m.graph.value_info, *m.graph.output) if v.type.HasField("tensor_type")}

    found = [dims(m) for m in ms]
    while len(_BASES) >= _BASES_KEPT:
        _BASES.pop(next(iter(_BASES)))
    _BASES[key] = (model, ms[0], found)
    return ms[0], found


def _inferred(model: onnx.ModelProto, bound: Mapping[str, int]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for v in m.graph.input:
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param in bound:
                d.dim_value = bound[d.dim_param]
    # The dynamo exporter declares every intermediate shape with expressions ("batch*seq"): make them
    # static too, so that inference need not rediscover what the exporter knew.
    for v in (*m.graph.value_info, *m.graph.output):
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param:
                val = _eval_dim(d.dim_param, bound)
                d.Clear()
                if val is not None:
                    d.dim_value = val
    try:
        if m.ByteSize() < _PROTO_LIMIT_BYTES:
            return shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            src, dst = f"{tmp}/in.onnx", f"{tmp}/out.onnx"
            onnx.save(m, src, save_as_external_data=True)
            shape_inference.infer_shapes_path(src, dst, strict_mode=False, data_prop=True)
            return onnx.load(dst, load_external_data=False)
    except (onnx.shape_inference.InferenceError, ValueError) as e:
        raise ModelError(
            f"ONNX shape inference failed: {str(e).splitlines()[0]}; check the `dims` values"
        ) from e


def static_shape(tp: onnx.TypeProto) -> tuple[int, ...] | None:
    tt = tp.tensor_type
    if not tp.HasField("tensor_type") or not tt.HasField("shape"):
        return None
    out: list[int] = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value"):
            return None
        out.append(int(d.dim_value))
    return tuple(out)
