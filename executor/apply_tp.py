"""The tensor-parallel half of `meshplan.apply` (`executor/apply.py`): the plan's placements on a
tensor-parallel axis in module-boundary form — one `PlannedStyle` per linear, Conv1D or embedding whose
weight the plan splits, column-wise or row-wise — and every re-placement or collective of the plan on
that axis that such boundaries cannot run (the deviations `apply` falls back on)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle

from core import placement as mp
from core.graph import OpGraph
from executor.binding import ApplyError, Binding
from executor.dtensors import placement
from planner.strategy import Strategy


class PlannedStyle(ParallelStyle):
    """One module's tensor parallelism as the plan places it: each parameter at its placement, the
    input made a DTensor at the layout it arrives in and re-placed to the one the module computes
    with, the output re-placed to the layout its consumers read, handed on as a local tensor
    (`distribute_module`'s input and output hooks)."""

    def __init__(self, params: dict[str, Placement], arrives: Placement | None, computes: Placement | None,
                 leaves: Placement) -> None:
        super().__init__()
        self.params, self.arrives, self.computes, self.leaves = params, arrives, computes, leaves

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            where = self.params.get(pname, Replicate())
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [where]),
                                                          requires_grad=p.requires_grad))

    def _input(self, mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if not isinstance(x, DTensor):
            if self.arrives is None:
                return inputs
            x = DTensor.from_local(x, mesh, [self.arrives], run_check=False)
        if self.computes is not None and x.placements != (self.computes,):
            x = x.redistribute(placements=[self.computes])
        return (x, *inputs[1:])

    def _output(self, mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
        if out.placements != (self.leaves,):
            out = out.redistribute(placements=[self.leaves])
        return out.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition,
                                 self._input,  # type: ignore[arg-type]  # torch's stub says it returns None
                                 self._output)


_COLWISE_WEIGHT_DIM = {"Linear": 0, "Conv1D": 1, "Embedding": 1}  # the output features' dim


@dataclass
class TensorParallel:
    styles: dict[str, ParallelStyle]
    roles: dict[str, str]
    shared_inputs: dict[str, list[str]]  # parent module FQN → its column-wise children sharing one input
    deviations: list[str]
    deviation_s: float


def module_boundaries(strategy: Strategy, graph: OpGraph, module: nn.Module, bindings: tuple[Binding, ...],
                     axis: int) -> TensorParallel:
    """The module-boundary form of the plan on tensor-parallel axis `axis`, and where the plan
    departs from it."""
    mods = dict(module.named_modules())
    deviations: list[str] = []
    roles: dict[str, str] = {}
    params_at: dict[str, dict[str, Placement]] = defaultdict(dict)
    onnx_module: dict[str, str] = {}  # ONNX module path → FQN
    param_names = {b.onnx for b in bindings}
    for b in bindings:
        p = planned_spec(strategy, b.onnx).placements[axis]
        fqn = b.fqns[0]
        owner, _, pname = fqn.rpartition(".")
        if not isinstance(p, mp.Shard):
            continue
        ndim = len(strategy.tensors[b.onnx].shape)
        where = placement(p, ndim=ndim, transposed=b.transposed)
        params_at[owner][pname] = where
        kind = type(mods[owner]).__name__
        if pname == "weight" and kind in _COLWISE_WEIGHT_DIM:
            roles[owner] = "colwise" if where.dim == _COLWISE_WEIGHT_DIM[kind] else "rowwise"  # type: ignore[attr-defined]
        for n in graph.nodes:
            if b.onnx in n.inputs:
                onnx_module[n.module_path] = owner
    for owner in params_at:
        if owner not in roles:
            deviations.append(f"{owner} ({type(mods[owner]).__name__}): its parameters are split, but only a "
                              "Linear, Conv1D or Embedding weight splits at module boundaries")
    styled = {path for path, owner in onnx_module.items() if owner in roles}
    # Every re-placement and collective on the axis must be one a module boundary runs.
    deviation_s = 0.0
    colwise_inputs: dict[str, set[str]] = defaultdict(set)  # tensor → column-wise modules reading it
    for r in strategy.reshards:
        src, dst = r.src.placements[axis], r.dst.placements[axis]
        if src == dst:
            continue
        consumer = strategy.nodes[r.consumer]
        from_module = _origin_module(graph, r.tensor)
        if isinstance(src, mp.Partial) and isinstance(dst, mp.Replicate) and from_module in styled \
                and roles.get(onnx_module[from_module]) == "rowwise":
            continue  # a row-wise module's output, all-reduced at its boundary
        if source_parameter(graph, r.tensor) in param_names and consumer.module in styled \
                and isinstance(dst, mp.Partial):
            continue  # a row-wise module's bias, added once: DTensor's addmm does the same
        deviations.append(f"{r.tensor} re-placed {src} → {dst} at {r.consumer} ({consumer.module or 'top level'})")
        deviation_s += sum(c.time_s for c in r.collectives)
    for path in styled:
        owner = onnx_module[path]
        if roles[owner] == "colwise" and type(mods[owner]).__name__ != "Embedding":
            for t in _boundary_inputs(graph, path, param_names):
                colwise_inputs[t].add(owner)
    for name, node in strategy.nodes.items():
        for c in node.collectives:
            if strategy.mesh.axis_names[axis] not in c.axes or source_parameter(graph, c.tensor) in param_names:
                continue
            if c.purpose.value == "grad sync" and (c.tensor in colwise_inputs or (
                    node.module in styled and roles[onnx_module[node.module]] == "colwise")):
                continue  # a column-wise module's input gradient, all-reduced at its boundary
            if any(r.tensor == c.tensor and r.consumer == name for r in strategy.reshards):
                continue  # judged above
            deviations.append(f"{c.kind.value} of {c.tensor} at {name} ({node.module or 'top level'})")
            deviation_s += c.time_s
    styles: dict[str, ParallelStyle] = {}
    shared: dict[str, list[str]] = {}
    for owner, role in roles.items():
        last = Shard(-1)
        if role == "colwise":
            styles[owner] = PlannedStyle(params_at[owner], Replicate(), Replicate(), last)
        else:
            styles[owner] = PlannedStyle(params_at[owner], last, last, Replicate())
        if type(mods[owner]).__name__ == "Embedding":  # ids in, never split: no input layout to keep
            styles[owner] = PlannedStyle(params_at[owner], None, None,
                                         last if role == "colwise" else Replicate())
    for _tensor, owners in colwise_inputs.items():
        parents = {o.rpartition(".")[0] for o in owners}
        if len(owners) > 1 and len(parents) == 1:
            shared[parents.pop()] = sorted(owners)
    return TensorParallel(styles, roles, shared, deviations, deviation_s)


_VIEWS = frozenset({"Identity", "Reshape", "Cast", "Dropout", "Squeeze", "Unsqueeze", "Flatten"})


def _origin_module(graph: OpGraph, tensor: str) -> str:
    """The module that computed `tensor`, looking through the views and identities after it (a
    dropout module's identity in evaluation, a Conv1D's reshape back to 3-D)."""
    while True:
        producer = graph.producer.get(tensor)
        if producer is None:
            return ""
        node = graph.node_by_name[producer]
        if node.op_type not in _VIEWS or not node.inputs:
            return node.module_path
        tensor = node.inputs[0]


def source_parameter(graph: OpGraph, tensor: str) -> str:
    """The parameter `tensor` is a view of (a transposed or cast weight), or `tensor` itself."""
    while True:
        producer = graph.producer.get(tensor)
        if producer is None:
            return tensor
        node = graph.node_by_name[producer]
        if node.op_type not in _VIEWS | {"Transpose"} or not node.inputs:
            return tensor
        tensor = node.inputs[0]


def _boundary_inputs(graph: OpGraph, path: str, params: set[str]) -> set[str]:
    """The activations a module's nodes read from outside it."""
    inside = [n for n in graph.nodes if n.module_path == path]
    made = {t for n in inside for t in n.outputs}
    return {t for n in inside for t in n.inputs
            if t and t not in made and t not in params and t not in graph.const_values
            and graph.producer.get(t) not in graph.constant_nodes and graph.tensors[t].is_float}


def planned_spec(s: Strategy, tensor: str) -> mp.Spec:
    spec = s.spec_of(tensor)
    if spec is None:
        raise ApplyError(f"the strategy places no {tensor}; plan again with this meshplan")
    return spec
