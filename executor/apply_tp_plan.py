"""The tensor-parallel axis of a plan in module-boundary form (`executor/apply_tp.py` turns it into torch's
parallel styles): which leaf modules of the user's module compute split on the axis, the layout each
one's input arrives in and is computed in, the layout each hands on, and every re-placement of the plan
on the axis that module boundaries cannot run (the deviations `apply` falls back on).

A re-placement of a module's output all its readers in the model's own code share runs at the module's
output; one that modules alone read runs at each reading module's input (the gradient of a gather comes
back reduce-scattered, as the plan prices it); one the model's code in a repeated layer reads runs on
entry to that layer (a decoder layer's residual stream split on the sequence). Outside the repeated
layers modules hand on whole tensors: the model's own code reads shapes there (a sequence length off
the embeddings, GPT-2's hidden size after its dropout)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from torch import nn

from core import placement as mp
from core.graph import OpGraph, TensorKind
from executor.binding import ApplyError, Binding
from executor.dtensors import placement
from planner.strategy import Reshard, Strategy

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


class AxisPlan:
    """The plan on tensor-parallel axis `axis` of `module`, at its leaf modules' boundaries: `bounds`
    (every leaf module the graph runs), `hooked` (those computing split or re-placing), `entries` (blocks
    re-placing their input on entry: FQN → tensor, as it comes, as taken), `deviations` (and the plan's
    time of their collectives), `expected` (the plan's collectives on the axis, one micro-batch)."""

    def __init__(self, strategy: Strategy, graph: OpGraph, module: nn.Module, bindings: tuple[Binding, ...],
                 axis: int) -> None:
        self.s, self.graph, self.bindings, self.axis = strategy, graph, bindings, axis
        self.mods = dict(module.named_modules())
        self.param_names = {b.onnx for b in bindings}
        self.prefix = _onnx_prefix(bindings)
        leaf = {fqn for fqn, m in self.mods.items() if fqn and next(m.children(), None) is None}
        self.compute = [n for n in graph.nodes if n.name not in graph.constant_nodes]
        p = self.prefix
        self.owner = {n.name: n.module_path[len(p):] for n in self.compute
                      if n.module_path.startswith(p) and n.module_path[len(p):] in leaf}
        self.readers: dict[str, list[str]] = defaultdict(list)  # tensor → the nodes reading it
        for n in self.compute:
            for t in n.inputs:
                if t:
                    self.readers[t].append(n.name)
        self.blocks_at = [f"{g.prefix}.{i}" for g in graph.layers for i in g.indices]  # the repeated layers
        self.bounds: dict[str, Boundary] = {}
        self.deviations: list[str] = []
        self.deviation_s = 0.0
        self.delivered: dict[str, mp.Placement] = {}  # an activation as a module's output hook hands it on
        self.entries: dict[str, tuple[str, mp.Placement, mp.Placement]] = {}
        self._scan_modules()
        self.used = self._split_parameters()
        self.moves = self._moves()
        for t, rs in self.moves.items():
            self._attribute(t, rs)
        self._whole_outside_layers()
        self._arrivals()
        self._keep_tied()
        self.hooked = {fqn: b for fqn, b in self.bounds.items() if b.hooked}
        self._check_the_models_code()
        self.expected = self._expected()

    def at(self, t: str) -> mp.Placement:
        """`t` on the axis as the plan makes it."""
        spec = self.s.spec_of(t)
        return spec.placements[self.axis] if spec is not None else mp.Replicate()

    def in_layer(self, path: str) -> bool:
        return any(_within(path, b) for b in self.blocks_at)

    def arrival(self, t: str, path: str) -> mp.Placement:
        """`t` as code at module path `path` receives it: re-placed on entry to a block holding it, or as
        its producer's output hook hands it on, or as made."""
        for block, (entering, _, taken) in self.entries.items():
            if entering == t and _within(path, self.prefix + block):
                return taken
        return self.delivered.get(t, self.at(t))

    # -- the steps -----------------------------------------------------------------------------------

    def _scan_modules(self) -> None:
        """Each leaf module: the activation it reads, the one it hands on, as the plan makes them."""
        g, at = self.graph, self.at
        made: dict[str, set[str]] = defaultdict(set)
        for n in self.compute:
            if n.name in self.owner:
                made[self.owner[n.name]].update(t for t in n.outputs if t)
        for fqn in sorted(made):
            inside = [n for n in self.compute if self.owner.get(n.name) == fqn]
            ins = sorted({t for n in inside for t in n.inputs if t and t not in made[fqn] and t in g.tensors
                          and g.tensors[t].kind in (TensorKind.INPUT, TensorKind.ACTIVATION)
                          and g.producer.get(t) not in g.constant_nodes
                          and source_parameter(g, t) not in self.param_names})
            outs = sorted(t for t in made[fqn] if t in g.outputs or any(self.owner.get(r) != fqn for r in self.readers[t]))
            b = Boundary(fqn, type(self.mods[fqn]).__name__,
                         has_params=next(self.mods[fqn].parameters(recurse=False), None) is not None,
                         identity=all(n.op_type == "Identity" for n in inside))
            floats = [t for t in ins if g.tensors[t].is_float]
            if len(floats) > 1 and any(not isinstance(at(t), mp.Replicate) for t in floats):
                self.deviations.append(f"{fqn} reads {len(floats)} activations split over the axis "
                                       f"({', '.join(floats)}); a module boundary re-places one")
            if floats:
                b.input = floats[0]
                b.arrives = b.computes = at(b.input)
            if len(outs) == 1:
                b.output = outs[0]
                b.produced = b.leaves = at(b.output)
            elif any(not isinstance(at(t), mp.Replicate) for t in outs):
                self.deviations.append(f"{fqn} hands on {len(outs)} activations, split over the axis")
            self.bounds[fqn] = b

    def _split_parameters(self) -> dict[str, mp.Placement]:
        """Each split parameter on the modules holding it (tied: every one, alike); a parameter stored whole
        but used split (a free slice) is held split, as it computes. Returns those."""
        s, axis = self.s, self.axis
        used: dict[str, mp.Placement] = {}
        for r in s.reshards:
            src, dst = r.src.placements[axis], r.dst.placements[axis]
            if r.tensor in self.param_names and isinstance(src, mp.Replicate) and isinstance(dst, mp.Shard) \
                    and used.get(r.tensor, dst) == dst:
                used[r.tensor] = dst
        for bnd in self.bindings:
            p = used.get(bnd.onnx, planned_spec(s, bnd.onnx).placements[axis])
            if not isinstance(p, mp.Shard):
                continue
            for fqn in bnd.fqns:
                where, _, pname = fqn.rpartition(".")
                b = self.bounds.setdefault(where, Boundary(where, type(self.mods[where]).__name__))
                b.params[pname] = p
                if pname == "weight":
                    torch_where = placement(p, ndim=len(s.tensors[bnd.onnx].shape), transposed=bnd.transposed)
                    b.weight_dim = torch_where.dim  # type: ignore[attr-defined]
        for b in self.bounds.values():
            if b.params and (b.kind not in _COLWISE_WEIGHT_DIM or "weight" not in b.params):
                self.deviations.append(f"{b.fqn} ({b.kind}): its parameters are split, but only a Linear, Conv1D or "
                                       "Embedding weight splits at module boundaries")
        return used

    def _moves(self) -> dict[str, list[Reshard]]:
        """The plan's re-placements of activations on the axis, by tensor (a parameter's: deviations, but
        a free slice held split and a row-wise bias added once, which DTensor's addmm does too)."""
        axis = self.axis
        moves: dict[str, list[Reshard]] = defaultdict(list)
        for r in self.s.reshards:
            src, dst = r.src.placements[axis], r.dst.placements[axis]
            if src == dst:
                continue
            if source_parameter(self.graph, r.tensor) in self.param_names:
                if self.used.get(r.tensor) == dst:
                    continue
                reader = self.bounds.get(self.owner.get(r.consumer, ""))
                if reader is not None and reader.role == "rowwise" and isinstance(dst, mp.Partial):
                    continue
                self._deviate(r, "a parameter stored one way and used another")
                continue
            moves[r.tensor].append(r)
        return moves

    def _deviate(self, r: Reshard, why: str = "") -> None:
        node = self.s.nodes[r.consumer]
        self.deviations.append(f"{r.tensor} re-placed {r.src} → {r.dst} at {r.consumer} "
                               f"({why or node.module or 'top level'})")
        self.deviation_s += sum(c.time_s for c in r.collectives)

    def _attribute(self, t: str, rs: list[Reshard]) -> None:
        """Where `t`'s re-placements run: on entry to the layers whose code reads it re-placed, at its
        producer's output, or at each reading module's input; else a deviation."""
        g, at, owner, bounds, prefix = self.graph, self.at, self.owner, self.bounds, self.prefix
        producer = bounds.get(owner.get(g.producer.get(t, ""), ""))
        wants = {n: at(t) for n in self.readers[t]}  # each reading node → the placement it reads
        wants.update({r.consumer: r.dst.placements[self.axis] for r in rs})
        outside = {n: w for n, w in wants.items() if producer is None or owner.get(n) != producer.fqn}
        if producer is not None:  # re-placements inside the module that makes it: DTensor's own
            producer.internal |= len(outside) < len(wants)
        user = {n: w for n, w in outside.items() if owner.get(n) not in bounds}  # read by the model's code
        blocks: dict[str, mp.Placement] | None = {}
        for r in rs:
            block = _entry_block(g, t, r.consumer, prefix, self.mods) if r.consumer in user else None
            if r.consumer in user and (block is None or blocks is None or blocks.get(block, wants[r.consumer])
                                       != wants[r.consumer]):
                blocks = None
            elif block is not None and blocks is not None:
                blocks[block] = wants[r.consumer]
        if blocks and all(w == blocks.get(next((b for b in blocks if _within(g.node_by_name[n].module_path,
                                                                               prefix + b)), ""), at(t))
                          for n, w in user.items()):
            for block, dst in blocks.items():
                self.entries[block] = (t, at(t), dst)
            return
        if producer is not None and producer.output == t and t not in g.outputs and len(set(user.values())) == 1:
            self.delivered[t] = producer.leaves = next(iter(user.values()))
            before = producer.input
            up = bounds.get(owner.get(g.producer.get(before, ""), "")) if before is not None else None
            if producer.identity and up is not None and before is not None and up.output == before \
                    and all(owner.get(n) == producer.fqn for n in self.readers[before]):
                # through an identity (a dropout exported for evaluation) from the module before it: there
                up.leaves = self.delivered[before] = producer.produced = producer.leaves
                producer.passes = True
            return
        for r in rs:
            if owner.get(r.consumer) not in bounds:  # (at a module's input, or inside its producer: below)
                self._deviate(r)

    def _whole_outside_layers(self) -> None:
        """Outside the repeated layers modules hand on whole tensors (but to modules alone, through
        identities: those re-place at their input), and the model's code there computes on them whole."""
        g, at = self.graph, self.at

        def modules_alone(t: str) -> bool:
            reads = [g.node_by_name[n] for n in self.readers[t]]
            return bool(reads) and t not in g.outputs and all(
                (self.owner.get(n.name) in self.bounds and self.bounds[self.owner[n.name]].input == t)
                or (n.op_type == "Identity" and self.owner.get(n.name) not in self.bounds
                    and modules_alone(n.outputs[0]))
                for n in reads)

        for bd in self.bounds.values():
            if bd.output is not None and not self.in_layer(self.prefix + bd.fqn) and not modules_alone(bd.output):
                bd.leaves = self.delivered[bd.output] = mp.Replicate()
        for n in self.compute:
            if self.owner.get(n.name) not in self.bounds and not self.in_layer(n.module_path):
                reads = [t for t in n.inputs if t and t in self.s.tensors and g.tensors[t].kind is TensorKind.ACTIVATION]
                if reads and all(isinstance(self.delivered.get(t, at(t)), mp.Replicate) for t in reads):
                    self.delivered.update({t: mp.Replicate() for t in n.outputs if t in self.s.tensors})
        for block, (t, _, dst) in list(self.entries.items()):
            self.entries[block] = (t, self.delivered.get(t, at(t)), dst)
        for t in g.outputs:  # as the plan's loss reads them: partial sums reduced, logits split over the
            # vocabulary gathered (`costmodel.loss.loss_input_spec`)
            made_by = self.bounds.get(self.owner.get(g.producer.get(t, ""), ""))
            if made_by is not None and made_by.output == t:
                made_by.leaves = mp.Replicate()
            elif not isinstance(at(t), mp.Replicate):
                self.deviations.append(f"the output {t} leaves {at(t)} over the axis, made outside a module apply hooks")

    def _arrivals(self) -> None:
        """Each module's input as it arrives, and as its first reading op takes it."""
        for bd in self.bounds.values():
            if bd.input is None:
                continue
            bd.arrives = self.arrival(bd.input, self.prefix + bd.fqn)
            mine = [n for n in self.readers[bd.input] if self.owner.get(n) == bd.fqn]
            takes = {r.consumer: r.dst.placements[self.axis] for r in self.moves.get(bd.input, ())}
            bd.computes = bd.arrives if bd.passes else takes.get(mine[0], self.at(bd.input))
            bd.internal |= not bd.passes and any(takes.get(n, self.at(bd.input)) != bd.computes for n in mine)

    def _keep_tied(self) -> None:
        """A tied parameter stays one: every module holding it hooked if one is."""
        for bnd in self.bindings:
            owners = [f.rpartition(".")[0] for f in bnd.fqns]
            if len(owners) > 1 and any(o in self.bounds and self.bounds[o].hooked for o in owners):
                for o in owners:
                    self.bounds.setdefault(o, Boundary(o, type(self.mods[o]).__name__)).internal = True

    def _check_the_models_code(self) -> None:
        """Outside the hooked modules the model's code computes on local shards: no parameter read there on
        split activations (its gradient would be one rank's part), nothing split outside the layers."""
        g = self.graph
        for n in self.compute:
            if self.owner.get(n.name) in self.hooked:
                continue
            split = [t for t in n.inputs if t and t in self.s.tensors and g.tensors[t].kind is TensorKind.ACTIVATION
                     and not isinstance(self.arrival(t, n.module_path), mp.Replicate)]
            if split and not self.in_layer(n.module_path) and n.op_type != "Identity":
                self.deviations.append(f"{split[0]} split over the axis, read at {n.name} "
                                       f"({n.module_path or 'top level'}) outside the repeated layers, where apply "
                                       "keeps tensors whole")
            params = [t for t in n.inputs if t and source_parameter(g, t) in self.param_names]
            if params and split:
                self.deviations.append(f"{params[0]} read at {n.name} ({n.module_path or 'top level'}) on {split[0]} "
                                       "split over the axis, outside a module apply hooks")

    def _expected(self) -> dict[str, int]:
        """The plan's collectives on the axis (`run` turns a replicated bias into addends kept on one rank,
        its gradient all-reduced in backward; DTensor's addmm splits it evenly, its gradient whole on every
        rank: not counted)."""
        axis = self.axis
        bias_grads = {r.tensor for r in self.s.reshards if isinstance(r.dst.placements[axis], mp.Partial)
                      and isinstance(r.src.placements[axis], mp.Replicate) and r.tensor in self.param_names}
        return dict(Counter(c.kind.value for node in self.s.nodes.values() for c in node.collectives
                            if axis in c.axes and not (c.tensor in bias_grads and c.phase.value == "backward")))


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
