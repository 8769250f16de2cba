"""One training step under a plan: per-node and per-edge costs, kept split, and their totals.

A plan chooses one `OpStrategy` per compute node. Its step costs
- compute: every node's forward and backward time on its local shard (`compute.py`);
- communication, every collective listed with its phase and reason:
  * on each edge, the reshard from the producer's output spec to the consumer's required spec in the
    forward pass, and its conjugate on the gradient in the backward pass (`reshard.conjugate`);
  * gradient synchronisation: an input that is replicated on a mesh axis along which its op is split
    (some input or output of the op is not replicated there) gets a partial gradient on that axis,
    all-reduced in the backward pass — a parameter's data-parallel gradient all-reduce, and Megatron's
    all-reduce of the input gradient of a column-parallel matmul alike;
- memory per device: model states of every parameter at the spec its first consumer requires, plus
  the activations saved for backward at their local size (a sum over the step, not a liveness peak).
Graph inputs and parameters are placed as their first consumer requires (the data loader and the
initialiser can produce any placement); constants cost nothing. Step time = compute + communication
(no overlap is assumed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from costmodel.comm import collective_time_s
from costmodel.compute import ComputeCost, compute_cost, local_shapes, tensor_bytes
from costmodel.memory import Precision, saved_tensors
from hwprofiles.profile import Collective, HardwareProfile
from planner.graph import OpGraph, OpNode, TensorKind
from planner.mesh import DeviceMesh
from planner.placement import Replicate, Shard, Spec
from planner.reshard import conjugate, plan_reshard
from planner.rules import OpStrategy


@dataclass(frozen=True, slots=True)
class CommEvent:
    kind: Collective
    axes: tuple[int, ...]
    size_bytes: float
    time_s: float
    backward: bool
    reason: str  # "reshard <tensor>" or "grad sync <tensor>"


@dataclass(frozen=True, slots=True)
class NodeCost:
    compute: ComputeCost
    comm: tuple[CommEvent, ...]
    param_bytes: float  # model states of the parameters this node owns (first consumer)
    activation_bytes: float  # its saved outputs, local

    @property
    def comm_s(self) -> float:
        return sum(e.time_s for e in self.comm)


@dataclass
class StepCost:
    compute_s: float = 0.0
    comm_s: float = 0.0
    memory: dict[str, float] = field(default_factory=dict)
    events: list[CommEvent] = field(default_factory=list)
    flops_matmul: float = 0.0  # per device, forward + backward

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())


class CostModel:
    """Prices strategies of one graph on one mesh and profile, in one precision."""

    def __init__(self, graph: OpGraph, mesh: DeviceMesh, profile: HardwareProfile, precision: Precision, *,
                 enable_all_to_all: bool = True) -> None:
        self.graph, self.mesh, self.profile, self.precision = graph, mesh, profile, precision
        self.enable_all_to_all = enable_all_to_all
        self.saved = saved_tensors(graph)
        self.param_owner: dict[str, str] = {}
        for n in graph.compute_nodes:
            for t in n.inputs:
                if t in graph.tensors and graph.tensors[t].kind is TensorKind.PARAM:
                    self.param_owner.setdefault(t, n.name)

    # -- one node --------------------------------------------------------------------------------

    def node_cost(self, node: OpNode, strategy: OpStrategy) -> NodeCost:
        g, mesh = self.graph, self.mesh
        specs: dict[str, Spec | None] = dict(zip(node.inputs, strategy.input_specs, strict=True))
        specs.update(zip(node.outputs, strategy.output_specs, strict=True))
        shapes = local_shapes(node, g, specs, mesh)
        compute = compute_cost(node, g, shapes, self.profile, self.precision)

        split_axes = [a for a in range(mesh.ndim) if mesh.shape[a] > 1 and any(
            s is not None and not isinstance(s.placements[a], Replicate) for s in (*strategy.input_specs, *strategy.output_specs))]
        events: list[CommEvent] = []
        param_bytes = 0.0
        for t, spec in zip(node.inputs, strategy.input_specs, strict=True):
            info = g.tensors.get(t) if t else None
            if spec is None or info is None or not info.is_float or info.kind in (TensorKind.INPUT, TensorKind.CONSTANT):
                continue
            is_param = info.kind is TensorKind.PARAM
            if is_param and self.param_owner.get(t) == node.name:
                param_bytes += float(info.numel) / _shards(spec, mesh) * self.precision.model_state_bytes
            axes = tuple(a for a in split_axes if isinstance(spec.placements[a], Replicate))
            if axes:
                itemsize = self.precision.grad_bytes if is_param else self.precision.activation_bytes
                size = float(info.numel) / _shards(spec, mesh) * itemsize
                events.append(CommEvent(Collective.ALL_REDUCE, axes, size,
                                        collective_time_s(self.profile, mesh, Collective.ALL_REDUCE, size, axes),
                                        backward=True, reason=f"grad sync {t}"))
        act = sum(tensor_bytes(g.tensors[t], shapes[t], self.precision) for t in node.outputs if t in self.saved)
        return NodeCost(compute=compute, comm=tuple(events), param_bytes=param_bytes, activation_bytes=act)

    # -- one edge --------------------------------------------------------------------------------

    def reshard_events(self, tensor: str, src: Spec, dst: Spec) -> tuple[CommEvent, ...]:
        if src == dst:
            return ()
        info = self.graph.tensors[tensor]
        itemsize = (self.precision.weight_bytes if info.kind is TensorKind.PARAM else
                    self.precision.activation_bytes if info.is_float else info.itemsize_bytes)
        plan = plan_reshard(src, dst, info.shape, self.mesh.shape, itemsize, enable_all_to_all=self.enable_all_to_all)
        events = []
        for step in plan.steps:
            axes = (step.axis,)
            if step.collective is not None:
                events.append(CommEvent(step.collective, axes, step.size_bytes,
                                        collective_time_s(self.profile, self.mesh, step.collective, step.size_bytes, axes),
                                        backward=False, reason=f"reshard {tensor}"))
            back = conjugate(step) if info.is_float and info.kind is not TensorKind.INPUT else None
            if back is not None:
                events.append(CommEvent(back, axes, step.size_bytes,
                                        collective_time_s(self.profile, self.mesh, back, step.size_bytes, axes),
                                        backward=True, reason=f"reshard {tensor}"))
        return tuple(events)

    # -- a whole plan ----------------------------------------------------------------------------

    def price(self, choice: Mapping[str, OpStrategy]) -> StepCost:
        g = self.graph
        cost = StepCost()
        placed: dict[str, Spec] = {}  # tensor → the spec it is produced (or first placed) in
        mem = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0, "activations": 0.0}
        p = self.precision
        for node in g.compute_nodes:
            strategy = choice[node.name]
            nc = self.node_cost(node, strategy)
            cost.compute_s += nc.compute.total_s
            cost.flops_matmul += nc.compute.fwd_matmul_flops * (1 + 2)
            cost.events.extend(nc.comm)
            for t, need in zip(node.inputs, strategy.input_specs, strict=True):
                if need is None or not t:
                    continue
                have = placed.setdefault(t, need)
                cost.events.extend(self.reshard_events(t, have, need))
            for t, spec in zip(node.outputs, strategy.output_specs, strict=True):
                placed[t] = spec
            states = nc.param_bytes
            mem["parameters"] += states * p.weight_bytes / p.model_state_bytes
            mem["gradients"] += states * p.grad_bytes / p.model_state_bytes
            mem["optimizer"] += states * p.optimizer_bytes / p.model_state_bytes
            mem["activations"] += nc.activation_bytes
        for t in g.inputs:  # saved graph inputs (e.g. pixels read by the first conv)
            if t in self.saved and t in placed:
                mem["activations"] += tensor_bytes(g.tensors[t], placed[t].local_shape(g.tensors[t].shape, self.mesh.shape), p)
        cost.comm_s = sum(e.time_s for e in cost.events)
        cost.memory = mem
        return cost


def _shards(spec: Spec, mesh: DeviceMesh) -> int:
    n = 1
    for a, pl in enumerate(spec.placements):
        if isinstance(pl, Shard):
            n *= mesh.shape[a]
    return n
