"""Constant subgraphs evaluated at import, with ONNX's numpy reference evaluator on the static shapes:
the shapes of constants that shape inference does not follow (indices from a Range over a shape), and
constant lookups checked — a parameter table read at constant indices (a position embedding read at
0 … seq−1) must hold every index at the bound dims, or training fails at run time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from core.errors import DimBindingError
from core.graph import NUMPY_DTYPES, SHAPE_ONLY_OPS, OpGraph, TensorInfo, TensorKind, shape_op_value


def check_constant_lookups(model: onnx.ModelProto, graph: OpGraph) -> None:
    """A parameter table read at constant indices (a position embedding read at 0 … seq−1) must hold
    every index at the bound dims, or training fails at run time; the indices' constant subgraph is
    evaluated here (ONNX's numpy reference evaluator, on the static shapes)."""
    lookups = [n for n in graph.compute_nodes if n.op_type == "Gather" and len(n.inputs) > 1
               and graph.tensors[n.inputs[0]].kind is TensorKind.PARAM
               and graph.tensors[n.inputs[1]].kind is TensorKind.CONSTANT]
    if not lookups:
        return
    protos = {n.name or f"{n.op_type}_{i}": n for i, n in enumerate(model.graph.node)}  # as _op_node names them
    for node in lookups:
        table, idx = graph.tensors[node.inputs[0]], graph.tensors[node.inputs[1]]
        value = _evaluate_constant(model, graph, protos, idx.name)
        if value is None or value.size == 0:
            continue
        rows = table.shape[int(node.attr("axis", 0))]  # type: ignore[call-overload]
        top = int(value.max())
        if top >= rows or int(value.min()) < -rows:
            bound = ", ".join(f"{k}={v}" for k, v in graph.dims.items() if v in idx.shape) or \
                ", ".join(f"{k}={v}" for k, v in graph.dims.items())
            raise DimBindingError(f"{node.name} reads row {top} of {table.name}, which has {rows} rows, at {bound}: "
                                  f"the model holds {rows} positions; bind that dim to at most {rows}")


def shape_constants(model: onnx.ModelProto, graph: OpGraph, names: list[str], small: int) -> None:
    """Give `names` (constants read by data ops whose shapes inference left unknown: indices from a
    Range over a shape, as the dynamo exporter writes `x[..., a:b] = y`) the shape of their value, and
    the value itself where it has at most `small` elements."""
    protos = {n.name or f"{n.op_type}_{i}": n for i, n in enumerate(model.graph.node)}
    for t in names:
        value = _evaluate_constant(model, graph, protos, t)
        if value is None:
            continue
        graph.tensors[t] = TensorInfo(t, tuple(int(d) for d in value.shape), graph.tensors[t].dtype, TensorKind.CONSTANT)
        if value.size <= small:
            graph.const_values[t] = value


def _evaluate_constant(model: onnx.ModelProto, graph: OpGraph, protos: Mapping[str, onnx.NodeProto],
                       name: str) -> np.ndarray | None:
    """The value of a tensor computed by constant nodes only (None when it depends on data)."""
    from onnx.reference import ReferenceEvaluator

    inits = {t.name: t for t in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    keep: set[str] = set()
    stack = [name]
    while stack:
        t = stack.pop()
        if not t or t in feeds or t in inits:
            if t in inits and inits[t].data_location == onnx.TensorProto.EXTERNAL:
                return None
            continue
        src = graph.producer.get(t)
        if src is None:
            return None  # a graph input: data
        if src in keep:
            continue
        node = graph.node_by_name[src]
        if node.op_type in SHAPE_ONLY_OPS:
            feeds[t] = shape_op_value(graph, node)
            continue
        keep.add(src)
        for i, inp in enumerate(node.inputs):
            info = graph.tensors.get(inp)
            if node.op_type == "CastLike" and i == 1 and info is not None and info.kind is TensorKind.ACTIVATION:
                feeds[inp] = np.zeros((), dtype=np.dtype(info.dtype) if info.dtype in NUMPY_DTYPES else np.float32)
            else:
                stack.append(inp)
    nodes = [protos[n.name] for n in graph.nodes if n.name in keep]  # graph order
    used = {i for n in nodes for i in n.input}
    sub = onnx.helper.make_model(
        onnx.helper.make_graph(
            nodes, "constant", [onnx.helper.make_tensor_value_info(k, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                                for k, v in feeds.items()],
            [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)],
            initializer=[inits[i] for i in sorted(used & set(inits))]),
        opset_imports=model.opset_import)
    try:
        outs: Any = ReferenceEvaluator(sub).run(None, dict(feeds))
        return np.asarray(outs[0])
    except Exception:  # an op the reference evaluator lacks: no check, as before
        return None
