"""The tensor-parallel half of `meshplan.apply` (`executor/apply.py`): the plan on a tensor-parallel axis
(`executor/apply_tp_plan.py`: which leaf modules compute split, the layouts at their boundaries) as
torch's parallel styles — one `PlannedStyle` per such module (`distribute_module`: its parameters as
DTensors, its input and output re-placed at its boundary, handed on as local tensors), a `SharedInput`
on a parent whose children read one input alike and on a layer whose input is re-placed on entry.
Inside a hooked module DTensor computes; between modules the local shards flow through the model's own
code, which is right wherever the plan itself computes there on local shards."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle

from core import placement as mp
from core.graph import OpGraph
from executor.apply_tp_plan import AxisPlan, Boundary
from executor.binding import Binding
from executor.dtensors import placement
from planner.strategy import Strategy


class PlannedStyle(ParallelStyle):
    """One module's tensor parallelism as the plan places it (`distribute_module`'s partition, input and
    output functions). `arrives` None: the input is left as it comes (an integer one is made a
    replicated DTensor, as DTensor's embedding needs)."""

    def __init__(self, params: dict[str, Placement], arrives: Placement | None, computes: Placement | None,
                 leaves: Placement, distributed: dict[int, nn.Parameter] | None = None) -> None:
        super().__init__()
        self.params, self.arrives, self.computes, self.leaves = params, arrives, computes, leaves
        self.distributed = {} if distributed is None else distributed  # shared by the plan's styles: tied
        # parameters distributed once, each module holding them then holding that one

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            if id(p) not in self.distributed:
                where = self.params.get(pname, Replicate())
                self.distributed[id(p)] = nn.Parameter(distribute_tensor(p, mesh, [where]), requires_grad=p.requires_grad)
            module.register_parameter(pname, self.distributed[id(p)])

    def _input(self, mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if not isinstance(x, DTensor):
            if self.arrives is None:
                if isinstance(x, torch.Tensor) and not x.is_floating_point():
                    return (DTensor.from_local(x, mesh, [Replicate()], run_check=False), *inputs[1:])
                return inputs
            x = DTensor.from_local(x, mesh, [self.arrives], run_check=False)
        if self.computes is not None and x.placements != (self.computes,):
            x = x.redistribute(placements=[self.computes])
        return (x, *inputs[1:])

    def _output(self, mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
        if isinstance(self.leaves, Partial) and isinstance(out.placements[0], Partial):
            # handed on as partial sums (of any kind: an embedding split over the vocabulary masks
            # its rows); their gradient is whole on every rank
            return out.to_local(grad_placements=[Replicate()])
        if out.placements != (self.leaves,):
            out = out.redistribute(placements=[self.leaves])
        return out.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition,
                                 self._input,  # type: ignore[arg-type]  # torch's stub says it returns None
                                 self._output)


class SharedInput(ParallelStyle):
    """A module's input (its first tensor argument, or `hidden_states`) made a DTensor and re-placed on
    entry: a parent whose hooked children read it alike (re-placed once, the children receiving the
    DTensor), or a block whose own code reads it re-placed (`local`: handed on as a local tensor)."""

    def __init__(self, arrives: Placement, computes: Placement, local: bool = False) -> None:
        super().__init__()
        self.arrives, self.computes, self.local = arrives, computes, local

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def convert(x: torch.Tensor) -> torch.Tensor:
            d = DTensor.from_local(x, device_mesh, [self.arrives], run_check=False)
            d = d.redistribute(placements=[self.computes]) if self.computes != self.arrives else d
            return d.to_local() if self.local else d

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if args and isinstance(args[0], torch.Tensor) and not isinstance(args[0], DTensor):
                return (convert(args[0]), *args[1:]), kwargs
            key = "hidden_states" if "hidden_states" in kwargs else next(
                (k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
            if key is not None and not isinstance(kwargs[key], DTensor):
                kwargs = {**kwargs, key: convert(kwargs[key])}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


@dataclass
class TensorParallel:
    styles: dict[str, ParallelStyle]
    roles: dict[str, str]
    shared_inputs: dict[str, list[str]]  # parent module FQN → its hooked children sharing one input
    deviations: list[str]
    deviation_s: float
    expected: dict[str, int]  # the plan's collectives on the axis, one micro-batch (forward and backward)


def module_boundaries(strategy: Strategy, graph: OpGraph, module: nn.Module, bindings: tuple[Binding, ...],
                      axis: int) -> TensorParallel:
    """The plan on tensor-parallel axis `axis` as torch's parallel styles (`apply_tp_plan.AxisPlan`), and
    where the plan departs from them."""
    plan = AxisPlan(strategy, graph, module, bindings, axis)
    s = strategy
    styles: dict[str, ParallelStyle] = {}
    distributed: dict[int, nn.Parameter] = {}  # a module's parameter → its DTensor (tied ones shared)
    for fqn, b in plan.hooked.items():
        torch_params = {}
        for bnd in bindings:
            for f in bnd.fqns:
                where, _, pname = f.rpartition(".")
                if where == fqn and pname in b.params:
                    torch_params[pname] = placement(b.params[pname], ndim=len(s.tensors[bnd.onnx].shape),
                                                    transposed=bnd.transposed)
        styles[fqn] = PlannedStyle(torch_params, _torch(b.arrives, b.input, graph), _torch(b.computes, b.input, graph),
                                   _torch(b.leaves, b.output, graph) or Replicate(), distributed)
    for block, (t, arrives, taken) in plan.entries.items():
        styles[block] = SharedInput(_torch(arrives, t, graph) or Replicate(), _torch(taken, t, graph) or Replicate(),
                                    local=True)
    # Hooked siblings reading one input alike: re-placed once at their parent.
    shared: dict[str, list[str]] = {}
    groups: dict[tuple[str, str], list[Boundary]] = defaultdict(list)
    for bd in plan.hooked.values():
        if bd.input is not None:
            groups[(bd.fqn.rpartition(".")[0], bd.input)].append(bd)
    for (parent, t), members in groups.items():
        if len(members) > 1 and parent and len({(str(m.arrives), str(m.computes)) for m in members}) == 1:
            shared[parent] = sorted(m.fqn for m in members)
            lead = members[0]
            styles[parent] = SharedInput(_torch(lead.arrives, t, graph) or Replicate(),
                                         _torch(lead.computes, t, graph) or Replicate())
    return TensorParallel(styles, {fqn: b.role for fqn, b in plan.hooked.items()}, shared, plan.deviations,
                          plan.deviation_s, plan.expected)


def _torch(p: mp.Placement | None, tensor: str | None, graph: OpGraph) -> Placement | None:
    if p is None or tensor is None:
        return None
    return placement(p, ndim=len(graph.tensors[tensor].shape))
