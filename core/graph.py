"""The graph vocabulary every stage speaks: tensors, nodes, parameters and `OpGraph`.

Built by the importer (planner/graph.py) from an ONNX file; read by the rules, the cost model, the
search and the executor. Torch-free and ONNX-free: only the types and what follows from them.
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import networkx as nx
import numpy as np

# dtypes numpy names as we do (a CastLike target read for its dtype is fed as a numpy zero of it).
NUMPY_DTYPES = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"})
# Ops whose output depends only on the *shape* of their inputs, which is static once dims are bound.
SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})


class Fold(enum.Enum):
    NONE = "none"  # the initializer is the torch parameter itself
    LAYOUT = "layout"  # folded through a re-layout of one weight (a transpose): same values, other order
    STATIC = "static"  # folded at the export's static shapes: only the part the export read is here


class Init(enum.Enum):
    """Where a parameter's initial value comes from, for the executor."""

    SOURCE = "source"  # the `source` initializer's data (seeded where a shape-only file has none)
    ZEROS = "zeros"  # a zero bias the exporter's optimizer removed
    SEEDED = "seeded"  # declared by shape only (ConstantOfShape): a seeded init, as shape-only files get


@dataclass(frozen=True, slots=True)
class Parameter:
    """A trainable tensor of the graph and what it stands for in the torch module."""

    name: str  # graph tensor name
    source: str  # the initializer holding its value (another's where a merged one was split); "" if none
    origin: str = ""  # torch's name for it, where the file says ("model.layers.0.mlp.up_proj.weight")
    fold: Fold = Fold.NONE
    init: Init = Init.SOURCE


class TensorKind(enum.Enum):
    INPUT = "input"
    PARAM = "param"
    CONSTANT = "constant"
    ACTIVATION = "activation"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name: "float32", "bfloat16", "int64", …
    kind: TensorKind

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize_bytes(self) -> int:
        return _ITEMSIZE_BYTES.get(self.dtype, 4)

    @property
    def size_bytes(self) -> int:
        return self.numel * self.itemsize_bytes

    @property
    def is_float(self) -> bool:
        return self.dtype in _FLOAT_DTYPES


@dataclass(frozen=True, slots=True)
class OpNode:
    name: str
    op_type: str
    inputs: tuple[str, ...]  # "" marks an absent optional input, as in ONNX
    outputs: tuple[str, ...]
    attrs: tuple[tuple[str, object], ...]
    domain: str = ""
    module_path: str = ""  # torch module that emitted the node, e.g. "model.layers.0.mlp.up_proj"

    def attr(self, key: str, default: object = None) -> object:
        for k, v in self.attrs:
            if k == key:
                return v
        return default


_FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "float8e4m3fn", "float8e5m2"})
_ITEMSIZE_BYTES = {
    "float8e4m3fn": 1, "float8e5m2": 1, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}


SEQUENCE_DIM = "seq"  # the symbolic dim of a sequence's tokens


class OpGraph:
    """An ONNX graph with static shapes: nodes in topological order, tensors by name, and structure.

    `graph` is a networkx DiGraph over node names (an edge per producer → consumer, with the tensor
    names it carries in the `tensors` edge attribute). Constant nodes stay in `nodes` (the executor
    needs them) but are listed in `constant_nodes`; planning stages iterate `compute_nodes`.
    """

    def __init__(
        self,
        *,
        name: str,
        nodes: tuple[OpNode, ...],
        tensors: Mapping[str, TensorInfo],
        inputs: tuple[str, ...],
        outputs: tuple[str, ...],
        constant_nodes: frozenset[str],
        opset: int,
        dims: Mapping[str, int],
        const_values: Mapping[str, np.ndarray] | None = None,
        parameters: Mapping[str, Parameter] | None = None,
        notes: tuple[str, ...] = (),
        input_dims: Mapping[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.name = name
        self.nodes = nodes
        self.tensors = dict(tensors)
        self.inputs = inputs
        self.outputs = outputs
        self.constant_nodes = constant_nodes
        self.opset = opset
        self.dims = dict(dims)
        self.const_values = dict(const_values or {})
        # Every PARAM tensor's provenance: the initializer holding its value, the torch name it stands for.
        self.parameters = dict(parameters or {})
        self.notes = notes  # what the import changed or could not recover, for inspect and plan to say
        # each input's dims by the symbolic name the file gives them ("" where a dim is a number)
        self.input_dims = dict(input_dims or {})
        self.node_by_name = {n.name: n for n in nodes}
        self.producer = {t: n.name for n in nodes for t in n.outputs if t}
        self.graph = self._build_digraph()

    def sequence_dims(self) -> dict[str, int]:
        """The inputs with a sequence dim — a dim the file names `seq`, as `meshplan export` writes it
        and `--dim seq=N` binds — and its index (context parallelism splits them there)."""
        return {t: names.index(SEQUENCE_DIM) for t, names in self.input_dims.items() if SEQUENCE_DIM in names}

    def _build_digraph(self) -> nx.DiGraph:
        g = nx.DiGraph()
        g.add_nodes_from(n.name for n in self.nodes)
        for n in self.nodes:
            for t in n.inputs:
                src = self.producer.get(t)
                if src is None:
                    continue
                if g.has_edge(src, n.name):
                    g.edges[src, n.name]["tensors"] += (t,)
                else:
                    g.add_edge(src, n.name, tensors=(t,))
        return g

    @cached_property
    def compute_nodes(self) -> tuple[OpNode, ...]:
        return tuple(n for n in self.nodes if n.name not in self.constant_nodes)

    @cached_property
    def params(self) -> tuple[TensorInfo, ...]:
        return tuple(t for t in self.tensors.values() if t.kind is TensorKind.PARAM)

    @cached_property
    def layers(self) -> tuple[LayerGroup, ...]:
        return find_repeated_layers(self)

    @cached_property
    def layer_of(self) -> dict[str, tuple[int, int]]:
        """Each node of a repeated layer → (its group's index, the layer's index in the group)."""
        return {n: (gi, li) for gi, group in enumerate(self.layers) for li, names in enumerate(group.nodes)
                for n in names}

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.params)

    @property
    def param_bytes(self) -> int:
        return sum(t.size_bytes for t in self.params)

    @cached_property
    def fingerprint(self) -> str:
        """Digest of the compute structure and shapes; names of nodes are left out on purpose so
        that a re-export of the same model with the same shapes keeps its fingerprint."""
        h = hashlib.sha256()
        index = {t: i for i, t in enumerate(self.tensors)}
        for n in self.compute_nodes:
            h.update(n.op_type.encode())
            for t in (*n.inputs, *n.outputs):
                info = self.tensors.get(t)
                h.update(repr((index.get(t, -1), info.shape if info else None)).encode())
        return h.hexdigest()[:16]

    def constant_value(self, name: str) -> np.ndarray | None:
        """The value of a small constant (an initializer or a Constant node's output), if known."""
        return self.const_values.get(name)

    def __repr__(self) -> str:
        return (
            f"OpGraph({self.name!r}, nodes={len(self.nodes)}, compute={len(self.compute_nodes)}, "
            f"params={self.num_params})"
        )


def shape_op_value(graph: OpGraph, node: OpNode) -> np.ndarray:
    """The value of a Shape or Size node: known from the static shapes once dims are bound."""
    shape = list(graph.tensors[node.inputs[0]].shape)
    if node.op_type == "Size":
        return np.array(int(np.prod(shape)), dtype=np.int64)
    end = node.attr("end")
    return np.array(shape[int(node.attr("start", 0)):None if end is None else int(end)],  # type: ignore[call-overload]
                    dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Repeated layers
#
# Repeated layers: the structure the solver ties so that an 80-layer model costs about one layer.
#
# A layer is the set of compute nodes whose module path starts with `<prefix>.<index>`, a numbered
# component of the path: `model.layers.7`, `encoder.layer.3`, `stages.1.0`. Layers under one prefix are
# *repeated* when their signatures match: the same op types, attributes and tensor shapes in the same
# order. Node k of one layer then plays the role of node k in every other layer of its group.
#
# Levels are tried from the outermost numbered component inwards (`stages.1` before `stages.1.0`); a
# node taken by a group at an outer level is not regrouped at an inner one, so ResNet stages that
# differ find their repeated blocks one level down.
_NUMBER = re.compile(r"\.(\d+)(?=\.|$)")


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers with one signature: `nodes[i][k]` is node k of layer `indices[i]`."""

    prefix: str
    indices: tuple[int, ...]
    nodes: tuple[tuple[str, ...], ...]

    @property
    def num_layers(self) -> int:
        return len(self.indices)

    @property
    def nodes_per_layer(self) -> int:
        return len(self.nodes[0])


def numbered_levels(module_path: str) -> list[tuple[str, int]]:
    """("a.layers.3.mlp.0.fc") → [("a.layers", 3), ("a.layers.3.mlp", 0)], outermost first."""
    return [(module_path[: m.start()], int(m.group(1))) for m in _NUMBER.finditer(module_path)]


def find_repeated_layers(graph: OpGraph) -> tuple[LayerGroup, ...]:
    levels = {n.name: numbered_levels(n.module_path) for n in graph.compute_nodes}
    taken: set[str] = set()
    groups: list[LayerGroup] = []
    for depth in range(max((len(v) for v in levels.values()), default=0)):
        members: dict[tuple[str, int], list[str]] = defaultdict(list)
        for n in graph.compute_nodes:
            if n.name not in taken and depth < len(levels[n.name]):
                members[levels[n.name][depth]].append(n.name)
        by_signature: dict[tuple[str, tuple[object, ...]], list[tuple[int, tuple[str, ...]]]] = defaultdict(list)
        for (prefix, index), names in members.items():
            by_signature[(prefix, _signature(graph, names))].append((index, tuple(names)))
        for (prefix, _), layers in by_signature.items():
            if len(layers) < 2:
                continue
            layers.sort()
            group = LayerGroup(prefix=prefix, indices=tuple(i for i, _ in layers), nodes=tuple(ns for _, ns in layers))
            groups.append(group)
            taken.update(name for ns in group.nodes for name in ns)
    groups.sort(key=lambda g: (-g.num_layers * g.nodes_per_layer, g.prefix))
    return tuple(groups)


def _signature(graph: OpGraph, names: list[str]) -> tuple[object, ...]:
    sig: list[object] = []
    for name in names:
        n = graph.node_by_name[name]
        shapes = tuple(graph.tensors[t].shape if t in graph.tensors else None for t in (*n.inputs, *n.outputs))
        sig.append((n.op_type, n.attrs, shapes))
    return tuple(sig)
