"""The tensor-parallel half of `meshplan.apply` (`executor/apply.py`): the plan's placements on a
tensor-parallel axis in module-boundary form, and every re-placement of the plan on that axis that
such boundaries cannot run (the deviations `apply` falls back on).

Each leaf module the plan computes split on the axis gets one `PlannedStyle`: its parameters at their
planned placements (DTensors on the axis), its input made a DTensor at the layout it arrives in and
re-placed to the one the module computes with, its output re-placed to the layout its consumers read
and handed on as a local tensor. Inside the module DTensor computes; between modules the local shards
flow through the user's code, which is right wherever the plan itself computes there on local shards
(no re-placement outside a module boundary, no parameter read there on split activations). This one
form covers Megatron-LM's column-wise and row-wise linears (GPT-2's Conv1D and embeddings too),
sequence parallelism (norms computing on sequence shards, gathered before a column-wise linear and
reduce-scattered after a row-wise one) and heads split through attention. A re-placement of a
module's output that all its readers share runs at the module's output; one only some readers want
runs at the input of the module that reads it; several modules under one parent reading one input
alike get it re-placed once, at the parent (one gradient reduction, as the plan prices it)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
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
from core.graph import OpGraph, TensorKind
from executor.binding import ApplyError, Binding
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


_COLWISE_WEIGHT_DIM = {"Linear": 0, "Conv1D": 1, "Embedding": 1}  # the output features' dim


@dataclass
class Boundary:
    """One leaf module on the axis, as the plan places it (placements on the axis, ONNX dims)."""
    fqn: str
    kind: str  # its class name
    params: dict[str, mp.Placement] = field(default_factory=dict)  # the split ones, by local name
    input: str | None = None  # the activation it reads from outside (ONNX name)
    arrives: mp.Placement | None = None
    computes: mp.Placement | None = None
    output: str | None = None  # the activation it hands on
    produced: mp.Placement | None = None
    leaves: mp.Placement | None = None
    internal: bool = False  # the plan re-places something inside it
    has_params: bool = False  # it holds parameters (split or not)
    identity: bool = False  # its nodes are identities (a dropout exported for evaluation)
    passes: bool = False  # an identity handing on what the module before it re-placed

    @property
    def hooked(self) -> bool:
        # split parameters, re-placements at its boundary or inside, or its own parameters computed on
        # split activations (their gradients reduced over the axis); a module without parameters
        # computing on its shards as they come (an activation function) runs as it is
        split = any(p is not None and not isinstance(p, mp.Replicate) for p in (self.arrives, self.produced))
        return bool(self.params) or self.internal or self.arrives != self.computes or self.produced != self.leaves \
            or (split and self.has_params)

    @property
    def role(self) -> str:
        weight = self.params.get("weight")
        if isinstance(weight, mp.Shard) and self.kind in _COLWISE_WEIGHT_DIM:
            return "colwise" if self.weight_dim == _COLWISE_WEIGHT_DIM[self.kind] else "rowwise"
        if isinstance(self.computes, mp.Shard):
            return "sequence" if self.computes.dim == 1 else "split"
        return "re-layout"

    weight_dim: int = -1  # the torch weight's split dim (set where the weight splits)


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
    """The module-boundary form of the plan on tensor-parallel axis `axis`, and where the plan
    departs from it."""
    s = strategy
    mods = dict(module.named_modules())
    param_names = {b.onnx for b in bindings}
    prefix = _onnx_prefix(bindings)
    leaf = {fqn for fqn, m in mods.items() if fqn and next(m.children(), None) is None}
    compute = [n for n in graph.nodes if n.name not in graph.constant_nodes]
    owner = {n.name: n.module_path[len(prefix):] for n in compute
             if n.module_path.startswith(prefix) and n.module_path[len(prefix):] in leaf}

    def at(t: str) -> mp.Placement:
        spec = s.spec_of(t)
        return spec.placements[axis] if spec is not None else mp.Replicate()

    bounds: dict[str, Boundary] = {}
    made: dict[str, set[str]] = defaultdict(set)
    for n in compute:
        if n.name in owner:
            made[owner[n.name]].update(t for t in n.outputs if t)
    readers: dict[str, list[str]] = defaultdict(list)  # tensor → the nodes reading it
    for n in compute:
        for t in n.inputs:
            if t:
                readers[t].append(n.name)
    deviations: list[str] = []
    for fqn in sorted(made):
        inside = [n for n in compute if owner.get(n.name) == fqn]
        ins = sorted({t for n in inside for t in n.inputs if t and t not in made[fqn] and t in graph.tensors
                      and graph.tensors[t].kind in (TensorKind.INPUT, TensorKind.ACTIVATION)
                      and graph.producer.get(t) not in graph.constant_nodes and source_parameter(graph, t) not in param_names})
        outs = sorted(t for t in made[fqn] if t in graph.outputs or any(owner.get(r) != fqn for r in readers[t]))
        b = Boundary(fqn, type(mods[fqn]).__name__, has_params=next(mods[fqn].parameters(recurse=False), None) is not None,
                     identity=all(n.op_type == "Identity" for n in inside))
        floats = [t for t in ins if graph.tensors[t].is_float]
        if len(floats) > 1 and any(not isinstance(at(t), mp.Replicate) for t in floats):
            deviations.append(f"{fqn} reads {len(floats)} activations split over the axis ({', '.join(floats)}); a "
                              "module boundary re-places one")
        if floats:
            b.input = floats[0]
            b.arrives = b.computes = at(b.input)
        if len(outs) == 1:
            b.output = outs[0]
            b.produced = b.leaves = at(b.output)
        elif any(not isinstance(at(t), mp.Replicate) for t in outs):
            deviations.append(f"{fqn} hands on {len(outs)} activations, split over the axis")
        bounds[fqn] = b
    # A parameter stored whole over the axis but used split (a free slice): held split, as it computes.
    used: dict[str, mp.Placement] = {}
    for r in s.reshards:
        if r.tensor in param_names and isinstance(r.src.placements[axis], mp.Replicate) \
                and isinstance(r.dst.placements[axis], mp.Shard) and used.get(r.tensor, r.dst.placements[axis]) \
                == r.dst.placements[axis]:
            used[r.tensor] = r.dst.placements[axis]
    for bnd in bindings:
        p = used.get(bnd.onnx, planned_spec(s, bnd.onnx).placements[axis])
        if not isinstance(p, mp.Shard):
            continue
        for fqn in bnd.fqns:  # (tied: every module holding it, one parameter split alike)
            where, _, pname = fqn.rpartition(".")
            b = bounds.setdefault(where, Boundary(where, type(mods[where]).__name__))
            b.params[pname] = p
            if pname == "weight":
                torch_where = placement(p, ndim=len(s.tensors[bnd.onnx].shape), transposed=bnd.transposed)
                b.weight_dim = torch_where.dim  # type: ignore[attr-defined]
    for b in bounds.values():
        if b.params and (b.kind not in _COLWISE_WEIGHT_DIM or "weight" not in b.params):
            deviations.append(f"{b.fqn} ({b.kind}): its parameters are split, but only a Linear, Conv1D or Embedding "
                              "weight splits at module boundaries")
    # Every re-placement of an activation on the axis: at its producer's output, else its reader's input.
    deviation_s = 0.0
    moves: dict[str, list[Any]] = defaultdict(list)
    for r in s.reshards:
        src, dst = r.src.placements[axis], r.dst.placements[axis]
        if src == dst:
            continue
        if source_parameter(graph, r.tensor) in param_names:
            if used.get(r.tensor) == dst:
                continue  # held split (above)
            reader = bounds.get(owner.get(r.consumer, ""))
            if reader is not None and reader.role == "rowwise" and isinstance(dst, mp.Partial):
                continue  # a row-wise module's bias, added once: DTensor's addmm does the same
            deviations.append(f"{r.tensor} re-placed {src} → {dst} at {r.consumer} (a parameter stored one way and "
                              "used another)")
            deviation_s += sum(c.time_s for c in r.collectives)
            continue
        moves[r.tensor].append(r)
    delivered: dict[str, mp.Placement] = {}  # an activation as a module's output hook hands it on
    entries: dict[str, tuple[str, mp.Placement, mp.Placement]] = {}  # block FQN → its input, as it comes, as taken
    for t, rs in moves.items():
        producer = bounds.get(owner.get(graph.producer.get(t, ""), ""))
        wants = {n: at(t) for n in readers[t]}  # each reading node → the placement it reads
        wants.update({r.consumer: r.dst.placements[axis] for r in rs})
        outside = {n: w for n, w in wants.items() if producer is None or owner.get(n) != producer.fqn}
        if producer is not None:  # re-placements inside the module that makes it: DTensor's own
            producer.internal |= len(outside) < len(wants)
        user = {n: w for n, w in outside.items() if owner.get(n) not in bounds}  # read by the user's code
        # Read re-placed by the user's code in a block (a decoder layer's residual stream): re-placed on
        # entry to the block, where all its code reads it alike (the model's own code around the blocks
        # reads it as made: a model reads the sequence length off its embeddings)
        blocks: dict[str, mp.Placement] | None = {}
        for r in rs:
            block = _entry_block(graph, t, r.consumer, prefix, mods) if r.consumer in user else None
            if r.consumer in user and (block is None or blocks is None or blocks.get(block, wants[r.consumer])
                                       != wants[r.consumer]):
                blocks = None
            elif block is not None and blocks is not None:
                blocks[block] = wants[r.consumer]
        if blocks and all(w == blocks.get(next((b for b in blocks if _within(graph.node_by_name[n].module_path,
                                                                               prefix + b)), ""), at(t))
                          for n, w in user.items()):
            for block, dst in blocks.items():
                entries[block] = (t, at(t), dst)
            continue
        if producer is not None and producer.output == t and t not in graph.outputs and len(set(user.values())) == 1:
            # At the producer's output: the placement the user's code reads there (modules reading it
            # take it as it comes and re-place it at their input, or DTensor inside them). Read by modules
            # alone, each re-places it at its input (one DTensor from its shard: the gradient comes back
            # reduce-scattered, as the plan prices the gather's backward)
            delivered[t] = producer.leaves = next(iter(user.values()))
            before = producer.input
            up = bounds.get(owner.get(graph.producer.get(before, ""), "")) if before is not None else None
            if producer.identity and up is not None and before is not None and up.output == before \
                    and all(owner.get(n) == producer.fqn for n in readers[before]):
                # through an identity (a dropout exported for evaluation) from the module before it: there
                up.leaves = delivered[before] = producer.produced = producer.leaves
                producer.passes = True
            continue
        for r in rs:
            if owner.get(r.consumer) in bounds:
                continue  # at a module's input, or inside the module making it: below and above
            node = s.nodes[r.consumer]
            deviations.append(f"{t} re-placed {r.src} → {r.dst} at {r.consumer} ({node.module or 'top level'})")
            deviation_s += sum(c.time_s for c in r.collectives)
    # Outside the repeated layers the model's own code reads its tensors' shapes (a sequence length off
    # the embeddings, the hidden size for a final view): a module there hands its output on whole.
    blocks_at = [f"{g.prefix}.{i}" for g in graph.layers for i in g.indices]

    def in_block(path: str) -> bool:
        return any(_within(path, b) for b in blocks_at)

    def modules_alone(t: str) -> bool:
        """`t` read only by modules apply hooks (through identities)."""
        reads = [graph.node_by_name[n] for n in readers[t]]
        return bool(reads) and t not in graph.outputs and all(
            (owner.get(n.name) in bounds and bounds[owner[n.name]].input == t)
            or (n.op_type == "Identity" and owner.get(n.name) not in bounds and modules_alone(n.outputs[0]))
            for n in reads)

    for bd in bounds.values():
        if bd.output is not None and not in_block(prefix + bd.fqn) and not modules_alone(bd.output):
            bd.leaves = delivered[bd.output] = mp.Replicate()
    for n in compute:  # the model's code there computes on whole tensors when they arrive whole
        if owner.get(n.name) not in bounds and not in_block(n.module_path):
            reads = [t for t in n.inputs if t and t in s.tensors and graph.tensors[t].kind is TensorKind.ACTIVATION]
            if reads and all(isinstance(delivered.get(t, at(t)), mp.Replicate) for t in reads):
                delivered.update({t: mp.Replicate() for t in n.outputs if t in s.tensors})
    for block, (t, _, dst) in list(entries.items()):
        entries[block] = (t, delivered.get(t, at(t)), dst)

    def arrival(t: str, path: str) -> mp.Placement:
        """`t` as code at module path `path` receives it: re-placed on entry to a block holding it, or as
        its producer's output hook hands it on, or as made."""
        for block, (entering, _, taken) in entries.items():
            if entering == t and _within(path, prefix + block):
                return taken
        return delivered.get(t, at(t))

    for bd in bounds.values():  # each module's input as it arrives, and as its first reading op takes it
        if bd.input is None:
            continue
        bd.arrives = arrival(bd.input, prefix + bd.fqn)
        first = next(n for n in readers[bd.input] if owner.get(n) == bd.fqn)
        takes = {r.consumer: r.dst.placements[axis] for r in moves.get(bd.input, ())}
        bd.computes = bd.arrives if bd.passes else takes.get(first, at(bd.input))
        bd.internal |= not bd.passes and any(takes.get(n, at(bd.input)) != bd.computes for n in readers[bd.input]
                            if owner.get(n) == bd.fqn)
    for bnd in bindings:  # a tied parameter stays one: every module holding it hooked if one is
        owners = [f.rpartition(".")[0] for f in bnd.fqns]
        if len(owners) > 1 and any(o in bounds and bounds[o].hooked for o in owners):
            for o in owners:
                bounds.setdefault(o, Boundary(o, type(mods[o]).__name__)).internal = True
    hooked = {fqn: b for fqn, b in bounds.items() if b.hooked}
    # Outside the hooked modules the user's code computes on local shards: no parameter may be read there
    # on split activations (its gradient would be one rank's part), and the logits leave whole.
    for n in compute:
        if owner.get(n.name) in hooked:
            continue
        if not in_block(n.module_path) and n.op_type != "Identity":
            split = [t for t in n.inputs if t and t in s.tensors and graph.tensors[t].kind is TensorKind.ACTIVATION
                     and not isinstance(arrival(t, n.module_path), mp.Replicate)]
            if split:
                deviations.append(f"{split[0]} split over the axis, read at {n.name} ({n.module_path or 'top level'}) "
                                  "outside the repeated layers, where apply keeps tensors whole")
        params = [t for t in n.inputs if t and source_parameter(graph, t) in param_names]
        split = [t for t in n.inputs if t and t not in params and t in s.tensors
                 and not isinstance(arrival(t, n.module_path), mp.Replicate)]
        if params and split:
            deviations.append(f"{params[0]} read at {n.name} ({n.module_path or 'top level'}) on {split[0]} split over "
                              "the axis, outside a module apply hooks")
    for t in graph.outputs:  # handed on whole, as the plan's loss reads them (partial sums reduced, logits split
        # over the vocabulary gathered: `costmodel.loss.loss_input_spec`)
        made_by = bounds.get(owner.get(graph.producer.get(t, ""), ""))
        if made_by is not None and made_by.output == t:
            made_by.leaves = mp.Replicate()
        elif not isinstance(at(t), mp.Replicate):
            deviations.append(f"the output {t} leaves {at(t)} over the axis, made outside a module apply hooks")
    styles: dict[str, ParallelStyle] = {}
    distributed: dict[int, nn.Parameter] = {}  # a module's parameter → its DTensor (tied ones shared)
    for fqn, b in hooked.items():
        torch_params = {}
        for bnd in bindings:
            for f in bnd.fqns:
                where, _, pname = f.rpartition(".")
                if where == fqn and pname in b.params:
                    torch_params[pname] = placement(b.params[pname], ndim=len(s.tensors[bnd.onnx].shape),
                                                    transposed=bnd.transposed)
        styles[fqn] = PlannedStyle(torch_params, _torch(b.arrives, b.input, graph), _torch(b.computes, b.input, graph),
                                   _torch(b.leaves, b.output, graph) or Replicate(), distributed)
    for block, (t, arrives, taken) in entries.items():
        styles[block] = SharedInput(_torch(arrives, t, graph) or Replicate(), _torch(taken, t, graph) or Replicate(),
                                    local=True)
    # Hooked siblings reading one input alike: re-placed once at their parent.
    shared: dict[str, list[str]] = {}
    groups: dict[tuple[str, str], list[Boundary]] = defaultdict(list)
    for bd in hooked.values():
        if bd.input is not None:
            groups[(bd.fqn.rpartition(".")[0], bd.input)].append(bd)
    for (parent, t), members in groups.items():
        if len(members) > 1 and parent and len({(str(m.arrives), str(m.computes)) for m in members}) == 1:
            shared[parent] = sorted(m.fqn for m in members)
            lead = members[0]
            styles[parent] = SharedInput(_torch(lead.arrives, t, graph) or Replicate(),
                                         _torch(lead.computes, t, graph) or Replicate())
    # (`run` turns a replicated bias into addends by keeping it on one rank, its gradient all-reduced in
    # backward; DTensor's addmm splits it evenly, its gradient whole on every rank: no reduction)
    bias_grads = {r.tensor for r in s.reshards if isinstance(r.dst.placements[axis], mp.Partial)
                  and isinstance(r.src.placements[axis], mp.Replicate) and r.tensor in param_names}
    expected = Counter(c.kind.value for node in s.nodes.values() for c in node.collectives if axis in c.axes
                       and not (c.tensor in bias_grads and c.phase.value == "backward"))
    return TensorParallel(styles, {fqn: b.role for fqn, b in hooked.items()}, shared, deviations, deviation_s,
                          dict(expected))


def _within(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _entry_block(graph: OpGraph, tensor: str, consumer: str, prefix: str, mods: dict[str, nn.Module]) -> str | None:
    """The outermost module holding `consumer` but not `tensor`'s producer: where the tensor enters the
    code that reads it (a decoder layer's residual input), or None."""
    made_at = graph.node_by_name[graph.producer[tensor]].module_path if tensor in graph.producer else ""
    path = graph.node_by_name[consumer].module_path
    if not path.startswith(prefix):
        return None
    parts = path[len(prefix):].split(".")
    for k in range(1, len(parts) + 1):
        fqn = ".".join(parts[:k])
        if fqn in mods and not isinstance(mods[fqn], nn.ModuleList | nn.ModuleDict) and not _within(made_at, prefix + fqn):
            return fqn
    return None


def _torch(p: mp.Placement | None, tensor: str | None, graph: OpGraph) -> Placement | None:
    if p is None or tensor is None:
        return None
    return placement(p, ndim=len(graph.tensors[tensor].shape))


def _onnx_prefix(bindings: tuple[Binding, ...]) -> str:
    """What the exporter puts before a module's FQN in its node paths ("model.")."""
    for b in bindings:
        if b.onnx.endswith(b.fqns[0]):
            return b.onnx[: len(b.onnx) - len(b.fqns[0])]
    return ""


_VIEWS = frozenset({"Identity", "Reshape", "Cast", "Dropout", "Squeeze", "Unsqueeze", "Flatten"})


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


def planned_spec(s: Strategy, tensor: str) -> mp.Spec:
    spec = s.spec_of(tensor)
    if spec is None:
        raise ApplyError(f"the strategy places no {tensor}; plan again with this meshplan")
    return spec
