"""Repeated layers: the structure the solver ties so that an 80-layer model costs about one layer.

A layer is the set of compute nodes whose module path starts with `<prefix>.<index>`, a numbered
component of the path: `model.layers.7`, `encoder.layer.3`, `stages.1.0`. Layers under one prefix are
*repeated* when their signatures match: the same op types, attributes and tensor shapes in the same
order. Node k of one layer then plays the role of node k in every other layer of its group.

Levels are tried from the outermost numbered component inwards (`stages.1` before `stages.1.0`); a
node taken by a group at an outer level is not regrouped at an inner one, so ResNet stages that
differ find their repeated blocks one level down.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.graph import OpGraph

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
