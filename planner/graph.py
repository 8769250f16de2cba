"""ONNX → OpGraph: the first stage of the flow.

`load_graph(path, dims)` reads an ONNX file without its weights, binds the symbolic dimensions the
user gives (`--dim batch=8`), infers every tensor's static shape, classifies tensors (input,
parameter, constant, activation), marks constant subgraphs (Shape→Gather→Concat→Reshape chains) so
that later stages skip them, keeps the torch module path of every node, and records repeated layers
(`layers.0 … layers.31`) for the solver to tie.

Both torch exporters are accepted: the dynamo exporter (module paths in the node metadata
`pkg.torch.onnx.name_scopes`, parameter kinds in `value_info` metadata) and the legacy TorchScript
exporter (module paths in `/a/b/c/Op` node names, parameters recognised as float initializers).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from core.errors import ModelError
from core.graph import SHAPE_ONLY_OPS, Init, OpGraph, OpNode, TensorInfo, TensorKind
from planner.params import DroppedBias, ParameterTable, find_parameters
from planner.shapes import bind_dims, static_shape, with_static_shapes

# Constant attribute tensors up to this many elements keep their values (indices, axes, scalars).
_SMALL_TENSOR_ELEMS = 64
_INDEXED = frozenset({"Gather", "GatherElements", "GatherND", "ScatterND", "ScatterElements"})  # input 1: indices

# Inputs that contribute only their dtype or shape, never their values (CastLike's target_type).
_META_ONLY_INPUTS = {"CastLike": (1,)}
_SCOPES_KEY = "pkg.torch.onnx.name_scopes"


def _dtype_name(elem_type: int) -> str:
    if elem_type == onnx.TensorProto.BFLOAT16:
        return "bfloat16"
    if elem_type == onnx.TensorProto.FLOAT8E4M3FN:
        return "float8e4m3fn"
    if elem_type == onnx.TensorProto.FLOAT8E5M2:
        return "float8e5m2"
    if elem_type == onnx.TensorProto.UNDEFINED:
        return "undefined"
    return str(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


# ---------------------------------------------------------------------------------------------
# Loading


def load_model_proto(path: str | Path) -> onnx.ModelProto:
    """Read an ONNX file's structure, never its external weights. Errors name the file and the fix."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"{p}: no such file; pass the path of an .onnx file")
    if p.is_dir():
        raise ModelError(f"{p}: is a directory; pass the path of an .onnx file")
    if p.stat().st_size == 0:
        raise ModelError(f"{p}: the file is empty; re-export the model with torch.onnx.export")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError, RuntimeWarning-derived or ValueError
        raise ModelError(
            f"{p}: not a readable ONNX model ({type(e).__name__}); the file is truncated or not ONNX — "
            "re-export it with torch.onnx.export"
        ) from e
    if not model.graph.node:
        raise ModelError(f"{p}: the ONNX graph has no nodes; export a model with at least one operator")
    if not model.opset_import:
        raise ModelError(f"{p}: the model declares no opset; re-export it with torch.onnx.export")
    return model


def load_graph(path: str | Path, dims: Mapping[str, int] | None = None) -> OpGraph:
    """Import an ONNX file as an OpGraph with every shape static. `dims` binds symbolic dims. A file
    imported again at other dims (the planner binds the batch once per micro-step count) is parsed once."""
    p = Path(path)
    stat = p.stat() if p.is_file() else None
    if stat is None or stat.st_size > _KEPT_BYTES:
        return graph_from_proto(load_model_proto(path), dims or {}, name=p.stem)
    version = (str(p.resolve()), stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)
    model, structure = _parsed(str(path), version)
    return graph_from_proto(model, dims or {}, name=p.stem, structure=structure)


# Files up to this size (shape-only exports, small models with their weights inside) are kept parsed.
_KEPT_BYTES = 64 * 2**20


@dataclass(frozen=True)
class _Structure:
    """What an import takes from the file whatever the dims bound: its parameters and its nodes."""

    table: ParameterTable
    nodes: tuple[OpNode, ...]


@functools.lru_cache(maxsize=4)
def _parsed(path: str, version: tuple[object, ...]) -> tuple[onnx.ModelProto, _Structure]:
    """The file's model (never changed after: `with_static_shapes` copies it) and its structure, once
    per file version (`version`: its inode, times and size; a file written again is parsed again);
    `path` as the user gave it, for the errors."""
    model = load_model_proto(path)
    return model, _structure(model)


def _structure(model: onnx.ModelProto) -> _Structure:
    table = find_parameters(model.graph)  # before inference, which drops value_info metadata
    return _Structure(table, tuple(_op_node(n, i, table.renamed_inputs) for i, n in enumerate(model.graph.node)))


def graph_from_proto(model: onnx.ModelProto, dims: Mapping[str, int], *, name: str = "model",
                     structure: _Structure | None = None) -> OpGraph:
    """`model` as an OpGraph at `dims` (`structure`: `_parsed`'s for this model, else found here)."""
    structure = structure or _structure(model)
    g = model.graph
    init_names = {t.name for t in g.initializer}
    user_inputs = [v for v in g.input if v.name not in init_names]
    bound = bind_dims(user_inputs, dims)
    table = structure.table
    model = with_static_shapes(model, bound)
    g = model.graph

    infos: dict[str, tuple[tuple[int, ...] | None, str]] = {}
    sequences: set[str] = set()
    for v in (*g.input, *g.value_info, *g.output):
        if v.type.HasField("sequence_type"):
            sequences.add(v.name)
        infos[v.name] = (static_shape(v.type), _dtype_name(v.type.tensor_type.elem_type))

    tensors: dict[str, TensorInfo] = {}
    for v in user_inputs:
        shape, dtype = infos[v.name]
        tensors[v.name] = TensorInfo(v.name, shape or (), dtype, TensorKind.INPUT)
    for init in g.initializer:
        kind = TensorKind.PARAM if init.name in table.params else TensorKind.CONSTANT
        tensors[init.name] = TensorInfo(init.name, tuple(int(d) for d in init.dims), _dtype_name(init.data_type), kind)
    for p in table.params.values():
        if p.name in tensors:
            continue
        if p.source:  # a merged initializer split into the parameters it stood for
            src = tensors[p.source]
            tensors[p.name] = TensorInfo(p.name, src.shape, src.dtype, TensorKind.PARAM)
        elif p.init is Init.SEEDED:  # a weight declared by ConstantOfShape
            shape, dtype = infos.get(p.name, (None, "float32"))
            if shape is not None:
                tensors[p.name] = TensorInfo(p.name, shape, dtype, TensorKind.PARAM)

    nodes = _restore_dropped_biases(list(structure.nodes), table.dropped_biases, infos, tensors)
    nodes = _fold_flattened_transposes(nodes, infos, {v.name for v in g.output})
    constant_nodes = _constant_nodes(nodes, tensors)
    read = {t for n in nodes for t in n.inputs if t} | {v.name for v in g.output}
    missing: list[str] = []
    unshaped: list[str] = []  # constants of values shape inference does not follow (a Range's indices)
    for node in nodes:
        kind = TensorKind.CONSTANT if node.name in constant_nodes else TensorKind.ACTIVATION
        for t in node.outputs:
            if not t or t in tensors:
                continue
            shape, dtype = infos.get(t, (None, "undefined"))
            if t in sequences:
                # A sequence (SplitToSequence → SequenceAt) stands for the tensor it was split from:
                # that shape tells the rules which dims its elements share with it.
                dtype = "sequence"
                shape = tensors[node.inputs[0]].shape if node.op_type == "SplitToSequence" else shape
            elif shape is None and kind is TensorKind.ACTIVATION and t in read:
                # An output nothing reads (Dropout's mask, training-mode statistics) needs no shape.
                missing.append(f"{t!r} (output of {node.op_type} node {node.name!r})")
            elif shape is None and kind is TensorKind.CONSTANT and t in read:
                unshaped.append(t)
            tensors[t] = TensorInfo(t, shape or (), dtype, kind)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelError(
            f"ONNX shape inference could not give tensor {missing[0]}{more} a static shape at the bound dims "
            f"({', '.join(f'{k}={v}' for k, v in bound.items()) or 'no symbolic dims'}); re-export the model "
            "with static shapes or a newer opset"
        )

    const_values: dict[str, np.ndarray] = {}
    for init in g.initializer:
        if int(np.prod(init.dims)) <= _SMALL_TENSOR_ELEMS and init.data_location != onnx.TensorProto.EXTERNAL:
            const_values[init.name] = numpy_helper.to_array(init)
    for node in nodes:
        if node.op_type == "Constant" and node.outputs:
            value = _constant_node_value(node)
            if value is not None:
                const_values[node.outputs[0]] = value

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    graph = OpGraph(
        name=name,
        nodes=nodes,
        tensors=tensors,
        inputs=tuple(v.name for v in user_inputs),
        outputs=tuple(v.name for v in g.output),
        constant_nodes=constant_nodes,
        opset=opset,
        dims=bound,
        const_values=const_values,
        parameters={k: p for k, p in table.params.items() if k in tensors},
        notes=table.notes,
        input_dims={v.name: tuple(d.dim_param for d in v.type.tensor_type.shape.dim) for v in user_inputs},
    )
    from planner.lookups import check_constant_lookups, shape_constants  # they evaluate constant subgraphs

    # (only indices a data op reads: their rules need the shape, and an index is one int per looked-up row)
    indices = {n.inputs[1] for n in nodes if n.name not in constant_nodes and n.op_type in _INDEXED and len(n.inputs) > 1}
    shape_constants(model, graph, [t for t in unshaped if t in indices], _SMALL_TENSOR_ELEMS)
    check_constant_lookups(model, graph)
    return graph


def _restore_dropped_biases(nodes: list[OpNode], dropped: tuple[DroppedBias, ...],
                            infos: dict[str, tuple[tuple[int, ...] | None, str]],
                            tensors: dict[str, TensorInfo]) -> tuple[OpNode, ...]:
    """Give back the zero biases the exporter's optimizer removed: Gemm's and Conv's bias slot, or
    an Add after the MatMul (its output renamed, so that every reader still reads the biased value)."""
    inserted: dict[int, OpNode] = {}
    for d in dropped:
        node = nodes[d.node_index]
        out = node.outputs[0]
        shape, dtype = infos.get(out, (None, "float32"))
        if not shape:
            continue
        tensors[d.name] = TensorInfo(d.name, (shape[1] if d.conv else shape[-1],), dtype, TensorKind.PARAM)
        if node.op_type in ("Gemm", "Conv"):
            nodes[d.node_index] = replace(node, inputs=(*node.inputs[:2], d.name))
            continue
        unbiased = f"{out}__unbiased"
        infos[unbiased] = (shape, dtype)
        nodes[d.node_index] = replace(node, outputs=(unbiased, *node.outputs[1:]))
        inserted[d.node_index] = OpNode(name=f"{node.name}__bias", op_type="Add", inputs=(unbiased, d.name),
                                        outputs=(out,), attrs=(), module_path=node.module_path)
    return tuple(x for i, n in enumerate(nodes) for x in ((n, inserted[i]) if i in inserted else (n,)))


# ---------------------------------------------------------------------------------------------
# Nodes


def _fold_flattened_transposes(nodes: tuple[OpNode, ...], infos: Mapping[str, tuple[tuple[int, ...] | None, str]],
                               outputs: set[str]) -> tuple[OpNode, ...]:
    """One Transpose of the last two dims for each Reshape (leading dims merged into one) → Transpose
    (perm 0,2,1) → Reshape (the same leading dims again) chain, as the dynamo exporter writes
    `key.transpose(-2, -1)` inside attention. The chain computes exactly that transpose, but the merged
    dim mixes batch and heads: no placement splits batch over one mesh axis and heads over another
    through it, so every plan that shards both would gather there. The 4-D Transpose keeps them apart."""
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for t in n.inputs:
            if t:
                readers.setdefault(t, []).append(i)

    def shape(t: str) -> tuple[int, ...] | None:
        return infos.get(t, (None, ""))[0]

    def only_reader(t: str, op_type: str) -> int | None:
        r = readers.get(t, [])
        return r[0] if len(r) == 1 and t not in outputs and nodes[r[0]].op_type == op_type else None

    dropped: set[int] = set()
    folded: dict[int, OpNode] = {}
    for i, merge in enumerate(nodes):
        if merge.op_type != "Reshape" or not merge.inputs or not merge.outputs:
            continue
        x, y = merge.inputs[0], merge.outputs[0]
        sx, sy = shape(x), shape(y)
        if sx is None or sy is None or len(sx) < 4 or len(sy) != 3 or sy != (int(np.prod(sx[:-2])), *sx[-2:]):
            continue
        j = only_reader(y, "Transpose")
        if j is None or tuple(nodes[j].attr("perm") or ()) != (0, 2, 1):  # type: ignore[arg-type]
            continue
        k = only_reader(nodes[j].outputs[0], "Reshape")
        if k is None or shape(nodes[k].outputs[0]) != (*sx[:-2], sx[-1], sx[-2]):
            continue
        lead = len(sx) - 2
        dropped.update((i, j))
        folded[k] = replace(nodes[j], inputs=(x,), outputs=nodes[k].outputs,
                            attrs=(("perm", (*range(lead), lead + 1, lead)),))
    return tuple(folded.get(i, n) for i, n in enumerate(nodes) if i not in dropped)


def _attr_value(a: onnx.AttributeProto) -> object:
    v = onnx.helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, onnx.TensorProto):
        if int(np.prod(v.dims)) <= _SMALL_TENSOR_ELEMS and not v.HasField("data_location"):
            arr = numpy_helper.to_array(v)
            return ("tensor", str(arr.dtype), tuple(arr.shape), tuple(arr.reshape(-1).tolist()))
        return ("tensor", _dtype_name(v.data_type), tuple(v.dims), None)
    if isinstance(v, list):
        return tuple(x.decode(errors="replace") if isinstance(x, bytes) else x for x in v
                     if not isinstance(x, onnx.TensorProto | onnx.GraphProto))
    if isinstance(v, onnx.GraphProto):
        return ("graph", v.name)
    return v


def module_path(n: onnx.NodeProto) -> str:
    """The torch module that emitted node `n` (the dynamo exporter's name scopes, or the legacy
    exporter's `/a/b/Op` node name), e.g. "model.layers.0.mlp.up_proj"; "" if unknown."""
    for p in n.metadata_props:
        if p.key == _SCOPES_KEY:
            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                return ""
            # The last entry names the op itself ("addmm_3"); the one before is its module.
            return str(scopes[-2]) if len(scopes) >= 2 else ""
    if n.name.startswith("/"):  # legacy exporter: "/stages/stages.0/stages.0.1/conv1/Conv"
        path = ""
        for part in n.name.split("/")[1:-1]:
            # A container's children are named by their qualified name ("stages.0" under "stages").
            path = part if not path or part.startswith(path + ".") else f"{path}.{part}"
        return path
    return ""


def _op_node(n: onnx.NodeProto, index: int, renamed: Mapping[tuple[int, int], str]) -> OpNode:
    return OpNode(
        name=n.name or f"{n.op_type}_{index}",
        op_type=n.op_type,
        inputs=tuple(renamed.get((index, j), t) for j, t in enumerate(n.input)),
        outputs=tuple(n.output),
        attrs=tuple((a.name, _attr_value(a)) for a in n.attribute),
        domain=n.domain,
        module_path=module_path(n),
    )


def _constant_node_value(node: OpNode) -> np.ndarray | None:
    for key, v in node.attrs:
        if key == "value" and isinstance(v, tuple) and v[0] == "tensor" and v[3] is not None:
            return np.array(v[3], dtype=v[1]).reshape(v[2])
        if key in ("value_int", "value_float"):
            return np.array(v)
        if key in ("value_ints", "value_floats"):
            return np.array(v)
    return None


def _constant_nodes(nodes: tuple[OpNode, ...], tensors: Mapping[str, TensorInfo]) -> frozenset[str]:
    """Nodes whose outputs are known before any data arrives: constants, shape queries, and
    everything computed only from those (the exporters' Shape→Gather→Concat→Reshape chains)."""
    const_tensors = {t.name for t in tensors.values() if t.kind is TensorKind.CONSTANT}
    out: set[str] = set()
    for n in nodes:  # ONNX requires topological order
        skip = _META_ONLY_INPUTS.get(n.op_type, ())
        ins = [t for i, t in enumerate(n.inputs) if t and i not in skip]
        if n.op_type in SHAPE_ONLY_OPS or all(t in const_tensors for t in ins):
            out.add(n.name)
            const_tensors.update(t for t in n.outputs if t)
    return frozenset(out)
