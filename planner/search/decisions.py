"""The ILP's vocabulary: its options and errors, its decisions (a node's strategy, a parameter's
stored spec), the edges between them, and the problem shrunk to them (`DecisionGraph`, which
`ShardingILP` formulates; planner/search/solve.py states the ILP)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.errors import MeshplanError
from core.graph import OpGraph, TensorKind
from core.levers import Offload
from core.placement import OpStrategy, Replicate, Spec, fully_sharded
from costmodel.step import CostModel
from planner.rules import RuleSet
from planner.strategy import SolverStats

NS_PER_S = 1e9


KIB = 1024

# How far above a plan already found an ILP's objective may be and still be solved: the objective prices
# some redistributes per edge where execution shares them and gradient buckets by their bytes' share, so
# a plan it prices above the incumbent can price below it composed.
CUTOFF_MARGIN = 0.05


class InfeasiblePlanError(MeshplanError):
    """No plan satisfies the constraints (memory limit, pins)."""


class NotBetterError(InfeasiblePlanError):
    """No plan of the ILP beats the cutoff it was given (a plan the search already holds); `memory`: the
    plans that would have beaten it exceed the memory limit."""

    def __init__(self, message: str, *, memory: bool = False) -> None:
        super().__init__(message)
        self.memory = memory

    def __reduce__(self) -> tuple[object, ...]:  # (a forked solve's error comes back pickled)
        return _not_better, (str(self), self.memory)


def _not_better(message: str, memory: bool) -> NotBetterError:
    return NotBetterError(message, memory=memory)


class MemoryFloorError(InfeasiblePlanError):
    """Even the least memory every decision can take is over the limit (`MemoryRows._check_floor`), on each
    of the meshes tried: per mesh, `parts` (bytes a device) the least its parameters' decisions hold at
    the step's peak, the least its nodes' (activations) hold there, and the least at the end of backward."""

    def __init__(self, message: str, *, parts: tuple[tuple[float, float, float], ...]) -> None:
        super().__init__(message)
        self.parts = parts

    def __reduce__(self) -> tuple[object, ...]:  # (a forked search's error comes back pickled)
        return _memory_floor, (str(self), self.parts)

    def may_fit(self, scale: float, limit: float) -> bool:
        """Whether some mesh may fit with each micro-step's batch `scale` times this one's (< 1: more
        micro-steps): its activations then hold at least `scale` times these (a tensor with a batch dim
        scales so, one without holds the same, a split the smaller batch does not divide is lost), its
        parameters at least as much."""
        return any(max(states + activations * scale, end) <= limit for states, activations, end in self.parts)


def _memory_floor(message: str, parts: tuple[tuple[float, float, float], ...]) -> MemoryFloorError:
    return MemoryFloorError(message, parts=parts)


class PinError(MeshplanError):
    """A pin names an unknown tensor or a spec no strategy can produce."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverOptions:
    time_limit_s: float = 60.0
    backend: str = "cbc"  # see planner/search/milp.py for the measurements behind the default
    num_workers: int = 2
    log: bool = False
    cutoff_s: float | None = None  # a plan must price below this objective (s) to be wanted (`ShardingILP.solve`)

    def __post_init__(self) -> None:
        if self.time_limit_s <= 0:
            raise MeshplanError(f"`time_limit_s` {self.time_limit_s}: must be positive seconds")


@dataclass
class Solution:
    choice: dict[str, OpStrategy]  # every compute node
    param_specs: dict[str, Spec]  # every parameter
    stats: SolverStats
    zero: dict[str, int] = field(default_factory=dict)  # parameter → its ZeRO-1/2 stage, where one was chosen
    recompute: dict[str, int] = field(default_factory=dict)  # layer group → layers recomputed (the first), where any
    offload: dict[str, Offload] = field(default_factory=dict)  # parameter → where its states live, where not the device
    activations: dict[str, int] = field(default_factory=dict)  # layer group → layers saving activations to the host
    constraints_by_family: dict[str, int] = field(default_factory=dict)
    # Under the overlapped step: the seconds of communication the objective leaves exposed, by term
    # (`ShardingILP.add_overlap`: "exposed_grads", "exposed_gathers").
    exposed_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NodeDecision:
    """The strategy of a representative node, and of the nodes tied to it or following it."""

    node: str

    def __str__(self) -> str:
        return self.node


@dataclass(frozen=True, slots=True)
class ParamDecision:
    """The stored spec of a representative parameter (and of the parameters tied to it)."""

    param: str

    def __str__(self) -> str:
        return f"param:{self.param}"


Decision = NodeDecision | ParamDecision


@dataclass
class Edge:
    tensor: str  # a representative tensor: its cost matrix stands for all tied ones
    producer: Decision
    consumer: Decision
    producer_node: str | None  # graph node producing the tensor (None for a parameter)
    consumer_node: str
    in_index: int
    out_index: int
    multiplicity: int = 0


class DecisionGraph:
    """The problem the ILP decides, shrunk: repeated layers tied to their first (`rep`), parameters to
    theirs (`param_rep`), element-wise and shape-only nodes following their producer's decision
    (`sigma`: representative → its decision and each choice's strategy index), every decision's choice
    count (`decisions`) and the edges between decisions (`edges`), a cost matrix each."""

    def __init__(self, graph: OpGraph, rules: RuleSet, cost: CostModel, *, pins: Mapping[str, Spec],
                 param_layout: Callable[[str, Spec], Spec | None] | None, zero_options: tuple[int, ...],
                 no_zero: frozenset[str], follow: bool, shard_freely: bool = True) -> None:
        self.graph, self.rules, self.cost = graph, rules, cost
        self.shard_freely = shard_freely
        self.pins = dict(pins)
        self.param_layout = param_layout
        self.zero_options = zero_options
        self.no_zero = no_zero
        self._tie_layers()
        self._tie_params()
        self._assign_decisions(follow)
        self._collect_edges()

    # -- shrinking -------------------------------------------------------------------------------------

    def _tie_layers(self) -> None:
        g = self.graph
        self.rep: dict[str, str] = {n.name: n.name for n in g.compute_nodes}
        loss_node = g.producer.get(self.cost.loss_tensor)  # it also pays the loss: not like its peers
        for group in g.layers:
            for layer in group.nodes[1:]:
                for k, name in enumerate(layer):
                    if name != loss_node:
                        self.rep[name] = group.nodes[0][k]

    def _tie_params(self) -> None:
        g = self.graph
        self.param_rep: dict[str, str] = {}
        for n in g.compute_nodes:
            rep_node = g.node_by_name[self.rep[n.name]]
            for i, t in enumerate(n.inputs):
                if t in g.tensors and g.tensors[t].kind is TensorKind.PARAM and t not in self.param_rep:
                    self.param_rep[t] = rep_node.inputs[i] if rep_node.inputs[i] in g.tensors else t
        self.params = sorted(set(self.param_rep.values()))
        self.param_specs: dict[str, list[Spec]] = {}  # per choice: the stored spec, and its ZeRO stage
        self.param_stages: dict[str, list[int]] = {}
        for p in self.params:
            opts: dict[Spec, None] = {}
            used: set[Spec] = set()  # the specs consumers use it at
            for n in g.compute_nodes:
                if self.rep[n.name] != n.name:
                    continue
                for i, t in enumerate(n.inputs):
                    if self.param_rep.get(t) == p:
                        for st in self._strategies(n.name):
                            spec = st.input_specs[i]
                            if spec is not None:
                                stored: Spec | None = spec.storable()
                                if stored is not None:
                                    used.add(stored)
                                if self.param_layout is not None and stored is not None:
                                    stored = self.param_layout(p, stored)
                                if stored is not None:
                                    opts[stored] = None
                                    fsdp = self._fully_sharded(p, stored) if self.shard_freely else None
                                    if fsdp is not None:
                                        opts[fsdp] = None
            if p not in self.pins and not opts:
                raise PinError(f"the layout leaves parameter {p} no placement its consumers can use; change `layout`")
            choices = [(spec, stage) for spec in ([self.pins[p]] if p in self.pins else list(opts))
                       for stage in (self._stages(p, spec) if spec in used else [0])]
            self.param_specs[p] = [spec for spec, _ in choices]
            self.param_stages[p] = [stage for _, stage in choices]

    def _stages(self, param: str, spec: Spec) -> list[int]:
        """The ZeRO-1/2 stages worth a choice for a parameter stored at `spec` (one some consumer uses it
        at: ZeRO-1/2 shards only a gradient reduced where it is stored): those allowed, where it is
        replicated on some axis and not below the threshold (elsewhere only 0: nothing to shard)."""
        replicated = any(isinstance(p, Replicate) and n > 1
                         for p, n in zip(spec.placements, self.rules.mesh.shape, strict=True))
        if not replicated or not self.cost.states.eligible(param) or param in self.no_zero:
            return [0]
        return sorted(set(self.zero_options))

    def _fully_sharded(self, param: str, spec: Spec) -> Spec | None:
        return fully_sharded(self.graph.tensors[param].shape, self.rules.mesh.shape, spec)

    def _follow_source(self, name: str) -> tuple[str, int, int] | None:
        """(producer, its output index, this node's input index) if `name` can follow its producer (where
        it accepts every spec the producer outputs: `_assign_decisions`)."""
        g = self.graph
        node = g.node_by_name[name]
        strategies = self._strategies(name)
        placed = [i for i, sp in enumerate(strategies[0].input_specs)
                  if sp is not None and g.tensors[node.inputs[i]].kind is not TensorKind.CONSTANT]
        if len(placed) != 1 or len(strategies) < 2:
            return None
        i = placed[0]
        t = node.inputs[i]
        src = g.producer.get(t)
        if g.tensors[t].kind is not TensorKind.ACTIVATION or src is None or src not in self.rep:
            return None
        if len({st.input_specs[i] for st in strategies}) != len(strategies):
            return None  # the input spec does not tell the strategies apart (constants' specs do)
        if any(t in self.pins for t in node.outputs):
            return None
        return src, g.node_by_name[src].outputs.index(t), i

    def _assign_decisions(self, follow: bool) -> None:
        """σ: every representative node → (decision, choice → its strategy index)."""
        g = self.graph
        self.sigma: dict[Decision, tuple[Decision, list[int]]] = {}
        for n in g.compute_nodes:  # topological: producers are assigned before followers
            if self.rep[n.name] != n.name:
                continue
            source = self._follow_source(n.name) if follow else None
            if source is None:
                own = NodeDecision(n.name)
                self.sigma[own] = (own, list(range(len(self._strategies(n.name)))))
                continue
            src, out_index, in_index = source
            d, src_map = self.sigma[NodeDecision(self.rep[src])]
            src_strats = self._strategies(self.rep[src])
            mine = self._strategies(n.name)
            by_input = {st.input_specs[in_index]: j for j, st in enumerate(mine)}
            if any(src_strats[k].output_specs[out_index] not in by_input for k in src_map):
                own = NodeDecision(n.name)
                self.sigma[own] = (own, list(range(len(mine))))
                continue
            self.sigma[NodeDecision(n.name)] = (d, [by_input[src_strats[k].output_specs[out_index]] for k in src_map])
        for p in self.params:
            self.sigma[ParamDecision(p)] = (ParamDecision(p), list(range(len(self.param_specs[p]))))
        self.decisions: dict[Decision, int] = {}
        for d, m in self.sigma.values():
            self.decisions[d] = len(m)

    def _collect_edges(self) -> None:
        g = self.graph
        edges: dict[tuple[Decision, str, int, int], Edge] = {}
        for n in g.compute_nodes:
            v = self.rep[n.name]
            strat = self._strategies(v)[0]
            for i, t in enumerate(n.inputs):
                if not t or strat.input_specs[i] is None or t not in g.tensors:
                    continue
                info = g.tensors[t]
                if info.kind is TensorKind.INPUT:
                    continue  # delivered in the spec required, no gradient
                u: Decision
                if info.kind is TensorKind.PARAM:
                    u, out_index, prod = ParamDecision(self.param_rep[t]), 0, None
                else:
                    src = g.producer.get(t)
                    if src is None or src not in self.rep:
                        continue
                    u, out_index, prod = NodeDecision(self.rep[src]), g.node_by_name[src].outputs.index(t), self.rep[src]
                key = (u, v, i, out_index)
                e = edges.setdefault(key, Edge(tensor=t, producer=self.sigma[u][0], consumer=self.sigma[NodeDecision(v)][0],
                                                producer_node=prod, consumer_node=v, in_index=i, out_index=out_index))
                e.multiplicity += 1
        self.edges = list(edges.values())

    # -- helpers -----------------------------------------------------------------------------------------

    def _strategies(self, v: str) -> tuple[OpStrategy, ...]:
        return self.rules.by_node[v].strategies

    def _node_strategy(self, node: str, choice: int) -> OpStrategy:
        """The strategy of representative `node` when its decision takes `choice`."""
        _, m = self.sigma[NodeDecision(node)]
        return self._strategies(node)[m[choice]]


def merge_identical(vectors: list[tuple[Any, ...]], members: list[list[int]]) -> list[tuple[int, list[int]]]:
    """Group classes whose cost vectors are equal: (index of one representative, union of members)."""
    groups: dict[tuple[Any, ...], tuple[int, list[int]]] = {}
    for i, (vec, mem) in enumerate(zip(vectors, members, strict=True)):
        if vec in groups:
            groups[vec][1].extend(mem)
        else:
            groups[vec] = (i, list(mem))
    return list(groups.values())


def takes(i: int, spec: Spec) -> Callable[[OpStrategy], bool]:
    return lambda s: s.input_specs[i] == spec


def makes(i: int, spec: Spec) -> Callable[[OpStrategy], bool]:
    return lambda s: s.output_specs[i] == spec
