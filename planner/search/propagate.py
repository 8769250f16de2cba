"""Pins and propagation: the user's `--pin`s resolved to specs, the data-parallel pins, and the
greedy search (`--search propagation`): in topological order each op takes the cheapest strategy
given where its inputs already are."""

from __future__ import annotations

import math
from collections.abc import Mapping

from core.errors import MeshplanError
from core.graph import OpGraph, TensorKind
from core.mesh import DeviceMesh
from core.placement import OpStrategy, Shard, Spec, parse_spec
from costmodel.step import CostModel
from planner.rules import RuleSet
from planner.search.decisions import PinError
from planner.strategy import (
    SolverStats,
)


def resolve_pins(graph: OpGraph, mesh: DeviceMesh, raw: Mapping[str, str]) -> dict[str, Spec]:
    pins = {}
    for name, text in raw.items():
        if name not in graph.tensors or graph.tensors[name].kind is TensorKind.CONSTANT:
            close = sorted(t for t in graph.tensors if name.lower() in t.lower())[:3]
            hint = f" (did you mean {', '.join(close)}?)" if close else " (see meshplan inspect for tensor names)"
            raise PinError(f"`pins` {name}: no input, parameter or activation of that name in the model{hint}")
        info = graph.tensors[name]
        spec = parse_spec(text, len(info.shape))
        spec.validate(info.shape, mesh.shape, f"`pins` {name}")
        if info.kind is TensorKind.PARAM and spec.has_partial:
            raise PinError(f"`pins` {name}={spec}: a parameter is stored whole or split, never as partial sums; "
                           "use S(dim) or R")
        pins[name] = spec
    return pins


def data_parallel_pins(graph: OpGraph, mesh: DeviceMesh) -> dict[str, Spec]:
    """Inputs split on dim 0 over every mesh axis, parameters replicated."""
    pins: dict[str, Spec] = {}
    for t in graph.inputs:
        shape = graph.tensors[t].shape
        if not shape or shape[0] < mesh.num_devices:
            raise MeshplanError(f"`mode` data-parallel: input {t} has batch {shape[0] if shape else 0} < "
                                f"{mesh.num_devices} devices; raise the batch (`dims`) or use fewer devices")
        pins[t] = Spec((Shard(0),) * mesh.ndim)
    for p in graph.params:
        pins[p.name] = Spec.replicated(mesh.ndim)
    return pins


def propagate(graph: OpGraph, rules: RuleSet, cm: CostModel,
              pins: Mapping[str, Spec]) -> tuple[dict[str, OpStrategy], dict[str, Spec], SolverStats]:
    """Greedy: in topological order, each op takes the strategy that respects the pins and costs
    least given where its inputs already are (parameters are placed by their first consumer)."""
    import time

    t0 = time.perf_counter()
    placed: dict[str, Spec] = {}
    choice: dict[str, OpStrategy] = {}
    total = 0.0
    for node in graph.compute_nodes:
        options = [s for s in rules.by_node[node.name].strategies if _respects(node.inputs, node.outputs, s, pins)]
        if not options:
            raise PinError(f"the pins leave {node.name} ({node.op_type}) no strategy; "
                           "pin a placement its op supports (see meshplan strategies)")
        best, best_cost = options[0], math.inf
        for s in options:
            split = cm.split_axes(s)
            c = cm.node_cost(node, s).time_s * cm.micro_batches
            for i, (t, need) in enumerate(zip(node.inputs, s.input_specs, strict=True)):
                if need is None or not t or graph.tensors[t].kind is TensorKind.INPUT:
                    continue
                c += cm.edge_time_s(t, placed.get(t, pins.get(t, _stored(graph, t, need))), need, split,
                                    recomputed=node.name in cm.layer_of,
                                    saved=cm.reads_in_backward(node, i))
            if c < best_cost:
                best, best_cost = s, c
        choice[node.name] = best
        total += best_cost
        for t, need in zip(node.inputs, best.input_specs, strict=True):
            if need is not None and t:
                placed.setdefault(t, pins.get(t, _stored(graph, t, need)))
        placed.update(zip(node.outputs, best.output_specs, strict=True))
    param_specs = {p.name: placed[p.name] for p in graph.params if p.name in placed}
    stats = SolverStats(status="PROPAGATED", objective=total, bound=0.0, gap=0.0, time_s=time.perf_counter() - t0,
                        num_variables=0, num_constraints=0, num_decision_nodes=len(choice), num_edges=0)
    return choice, param_specs, stats


def _stored(graph: OpGraph, t: str, need: Spec) -> Spec:
    return need.storable() if graph.tensors[t].kind is TensorKind.PARAM else need


def _respects(inputs: tuple[str, ...], outputs: tuple[str, ...], s: OpStrategy, pins: Mapping[str, Spec]) -> bool:
    for t, spec in zip(inputs, s.input_specs, strict=True):
        if t in pins and spec is not None and spec != pins[t]:
            return False
    return all(not (t in pins and spec != pins[t]) for t, spec in zip(outputs, s.output_specs, strict=True))
