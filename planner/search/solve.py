"""The sharding ILP, on OR-Tools CP-SAT (the Alpa / XLA auto-sharding formulation).

Shrinking first, so that decisions are few while every node keeps its own strategy:
- constant subgraphs are already out (`OpGraph.compute_nodes`);
- repeated layers are tied: node k of every layer of a `LayerGroup` takes the decision of node k of
  the first layer, and so do the parameters they read (costs counted once per layer);
- followers (Alpa's "follow"): a node with one activation input, whose strategies are told apart by
  that input's spec alone (element-wise ops, views, softmax, norms), and which accepts every spec its
  producer can output, takes its producer's decision: it runs the strategy that accepts the
  producer's output spec. A node that cannot accept some (a softmax after a partial sum, a split of
  the dim a producer splits) keeps its own decision: had it followed, it would run replicated there,
  where the best plan reshards to another split. An 80-layer model thus costs about one layer's few
  matmuls. Following is still a restriction (a reshard between producer and follower is never
  chosen); `follow=False` is exact.
Each graph node n maps to a decision d(n) and a function σ_n from d's choices to n's strategies.

Decisions d: compute decisions (a node and its followers) and parameter decisions (the spec a tied
parameter is stored in, and its ZeRO-1/2 stage; choices: every spec some consumer strategy requires
for it, and — where neither a layout nor a ZeRO stage fixes how it is held — its fully sharded form
(ZeRO-3 / FSDP), each at every stage the request allows where the spec leaves the parameter
replicated on some axis).
Edges e = (u → v, tensor t) with d(u) ≠ d(v), tied like their ends, with multiplicity m_e.

Variables
  x[d,i] ∈ {0,1}        decision d takes choice i
  y[e,a,b] ∈ {0,1}      on edge e, the producer side is in class a (choices that produce t in one
                        spec) and the consumer side in class b (choices that require t in one spec
                        and split the same mesh axes) — classes instead of choices keep y small
Objective (integer nanoseconds of one training step)
  min Σ c[d,i]·x[d,i] + Σ m_e·C_e[a,b]·y[e,a,b] + Σ ⌈mem[d,i] / MiB⌉·x[d,i]  (1 ns per MiB: ties → less memory)
  c[d,i]: compute (forward + backward, local shards; × k accumulation steps) of every node mapped to
  d under choice i (for a parameter: the optimizer step on its local, ZeRO-sharded part), plus
  the edges inside d (producer → follower; layer i → layer i + 1 of one tied node); C_e: the forward
  reshard of t and the backward work on its gradient (`CostModel.edge_events`; per-micro-batch
  collectives × k, a parameter's gradient reduction once, or at ZeRO-1/2 its reduce-scatters and
  gathers, `CostModel.zero_events`). An activation redistributed alike for several consumers (q, k
  and v reading one gathered input) is redistributed once per layer (`costmodel.comm.shared_reshard`):
  for its edges into one layer, each (from, to) pair that costs anything is charged on z ≥ y of every such
  edge (`shared[·]`, z ∈ {0,1}) instead of on the y's. Otherwise each edge is priced alone: a tensor
  whose consumers need it in different specs and all leave its gradient partial is charged one
  reduction per consumer, where execution (and `CostModel.price`) reduces once — an upper bound.
  Under the overlapped step (`compose.overlap`, GPU profiles) each edge's gradient reductions and
  parameter gathers leave that sum for two exposed terms, integer variables (`add_overlap`):
    E_g ≥ Σ grads·y − k Σ backward·x,  E_g ≥ λ_c Σ grads_c·y,
    E_a ≥ max(Σ gathers·y − Σ compute·x, the longest gather chosen),  E ≥ 0
  (reductions beyond the backward, the last bucket of each collective, gathers beyond the step's
  compute, the first gather; `overlap.py`, where it is exact and where a lower bound).
  A multi-device step waits for its slowest rank: compute is charged × (1 + the profile's rank skew).
The solver's objective also holds the tie-break and any memory excess; the one reported
(`SolverStats.objective`) is the step at the solution: without them, with what every plan pays (the
optimizer's fixed cost, the executor's overhead).
Constraints (every one named)
  one_choice[d]:         Σ_i x[d,i] = 1
  edge_producer[e,a]:    Σ_b y[e,a,b] = Σ_{i∈a} x[d(u),i]
  edge_consumer[e,b]:    Σ_a y[e,a,b] = Σ_{i∈b} x[d(v),i]
  memory:                Σ mem[d,i]·x[d,i] − over ≤ limit (KiB), at the step's peak (`compose.peak_memory`):
                         the loss's backward — weights and optimizer states (ZeRO-sharded over the
                         axes a parameter is stored replicated on), one micro-batch's saved
                         activations (a sum, not a liveness peak) and the loss's workspace, and the
                         gradients only when accumulation (or a pipeline) holds them; without, a
                         second row for the end of backward: weights, gradients, optimizer states.
                         Each row's excess over ≥ 0 (integer KiB) costs `OVER_NS_PER_KIB` in the
                         objective, so every rounding is a solution (CBC takes no start solution); a
                         solution with over = 0 is optimal for the hard rows, one with over > 0 is
                         solved again with over held to 0
  pin[t]:                x[d,i] = 0 for every choice that puts a pinned tensor in another spec
  host_memory:           under offload, what the offloaded layers hold on the host ≤ the device's share
                         of its node's host memory (`planner/search/offload.py`; hard: a held mode that
                         cannot fit is refused before solving, by its floor)
Graph inputs are free (the loader delivers what the consumer requires); constants cost nothing.
Given a cutoff (a plan the search already holds, `SolverOptions.cutoff_s`), a row holds the
objective to it: an ILP whose relaxation already loses is then proved so without a search.
The replicated plan is given as a hint (CP-SAT and SCIP take it; OR-Tools' CBC takes none).
Infeasible memory is diagnosed without the solver: the memory row is separable, so its minimum is the
sum of per-decision minima.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from core.collectives import Collective, Purpose
from core.graph import OpGraph, TensorKind
from core.levers import ActivationOffload, Composer, Offload
from core.placement import OpStrategy, Replicate, Shard, Spec
from costmodel.step import CostModel
from planner.rules import RuleSet
from planner.search.decisions import (
    KIB,
    NS_PER_S,
    Decision,
    DecisionGraph,
    Edge,
    InfeasiblePlanError,
    NodeDecision,
    NotBetterError,
    ParamDecision,
    PinError,
    Solution,
    SolverOptions,
    makes,
    merge_identical,
    takes,
)
from planner.search.floor import Group, time_floor
from planner.search.memory_rows import OVER_NS_PER_KIB, MemoryRows
from planner.search.milp import LinearModel
from planner.search.offload import OffloadDecisions, add_exposed_row, add_offload_counts
from planner.search.overlap import OverlapTerms
from planner.search.recompute import GroupTerms, add_counts
from planner.stagecut import param_stages
from planner.strategy import SolverStats


class ShardingILP(MemoryRows, OffloadDecisions, DecisionGraph):
    """Builds and solves the ILP for one graph, mesh and cost model. One method per constraint family."""

    def __init__(self, graph: OpGraph, rules: RuleSet, cost: CostModel, *, memory_limit_bytes: float | None = None,
                 pins: Mapping[str, Spec] | None = None, options: SolverOptions | None = None,
                 follow: bool = True, param_layout: Callable[[str, Spec], Spec | None] | None = None,
                 zero_stages: tuple[int, ...] | None = None, no_zero: frozenset[str] = frozenset(),
                 recompute_model: CostModel | None = None, recompute_layers: int | None = None,
                 stages: Mapping[str, int] | None = None, in_flight: Sequence[float] = (),
                 shard_freely: bool = True, floor_limit_bytes: float | None = None, memory_soft: bool = False,
                 offload: Offload = Offload.NONE,
                 offload_activations: ActivationOffload = ActivationOffload.NONE) -> None:
        """`param_layout(param, spec)`: how a layout stores a parameter a consumer needs at `spec` (e.g.
        FSDP: split on its dp_shard axis), None where it cannot; every parameter spec is mapped by it.
        `shard_freely`: each parameter may also be split over every axis it would be whole on (ZeRO-3
        by the ILP's choice), where neither a layout nor a ZeRO stage says how it is held.
        `zero_stages`: the ZeRO-1/2 stages a parameter may take (default: the cost model's stage);
        `no_zero`: parameters held at stage 0 (pricing found their gradient not reduced where stored);
        `recompute_model`: the graph priced with every layer recomputed — given, how many layers of each
        group to recompute is decided too (`planner/search/recompute.py`; `cost` must recompute none), or held
        at `recompute_layers` (the first N of each group). `stages`: each compute node's pipeline stage —
        given, the memory row is one per stage (its nodes' parameters' states, and their activations
        times the micro-batches `in_flight[stage]` it holds at once, `costmodel/pipeline.py`).
        `floor_limit_bytes`: without a memory row, a limit the memory floor is checked against before
        the edges are built (a hand layout that must fit: its infeasible micro-step counts told fast).
        `memory_soft`: the memory rows' excess is only priced, never solved again held to 0 — the plan
        that fits where one does, else the one over by the least (a layout priced as written: proving a
        tight row infeasible takes a MIP minutes on hundreds of devices).
        `offload`: where the model states may live (`core.levers.Offload`): beside the sharding, how many
        layers of each group (and whether the parameters outside them) keep their states on the host,
        every layer held there for a mode other than auto (`planner/search/offload.py`)."""
        super().__init__(graph, rules, cost, pins=pins or {}, param_layout=param_layout, no_zero=no_zero, follow=follow,
                         zero_options=zero_stages if zero_stages is not None else (cost.zero_stage,),
                         shard_freely=shard_freely)
        self.stages, self.in_flight = stages, list(in_flight)
        # Under the overlapped step, gradient reductions and parameter gathers hide under compute (a
        # pipeline's stages keep the sum: with their memory rows the overlap rows take CBC minutes).
        self.overlapped = cost.composer is Composer.OVERLAP and stages is None
        # Gradients exist at the loss's backward only when earlier micro-batches left them there.
        self.gradients_held = cost.micro_batches > 1 or stages is not None
        self.recompute_model = recompute_model
        self.memory_limit_bytes = memory_limit_bytes
        self.memory_soft = memory_soft
        self.floor_limit_bytes = floor_limit_bytes if memory_soft or memory_limit_bytes is None else memory_limit_bytes
        self.options = options or SolverOptions()
        self.model = LinearModel()
        self.constraint_counts: dict[str, int] = defaultdict(int)
        self.over_vars: list[int] = []  # the memory rows' excess (`MemoryRows._over`)
        # A recomputed group's representative nodes (its first layer's) → the group's per-layer terms.
        self.layer_terms: dict[str, GroupTerms] = {}
        if recompute_model is not None:
            loss_node = graph.producer.get(cost.loss_tensor)
            for group in graph.layers:
                terms = GroupTerms(prefix=group.prefix, layers=group.num_layers,
                                   fixed=min(recompute_layers, group.num_layers) if recompute_layers is not None else None)
                self.layer_terms.update({n: terms for n in group.nodes[0] if n != loss_node})
        self.offload = offload
        self._offload_groups()
        self.offload_activations = offload_activations
        self._activation_groups()

    # -- helpers -----------------------------------------------------------------------------------------

    def _producer_spec(self, e: Edge, choice: int) -> tuple[Spec, int]:
        """The spec the edge's tensor is produced (stored) in, and (a parameter's) ZeRO stage."""
        if isinstance(e.producer, ParamDecision):
            p = e.producer.param
            return self.param_specs[p][choice], self.param_stages[p][choice]
        assert e.producer_node is not None
        return self._node_strategy(e.producer_node, choice).output_specs[e.out_index], 0

    def _consumer_class(self, e: Edge, choice: int) -> tuple[Spec, frozenset[int]]:
        """What an edge's cost depends on at the consumer: the spec it requires and the axes on which
        it is split *and* requires the tensor replicated (where the gradient comes out partial)."""
        st = self._node_strategy(e.consumer_node, choice)
        spec = st.input_specs[e.in_index]
        assert spec is not None
        split = frozenset(a for a in self.cost.split_axes(st) if isinstance(spec.placements[a], Replicate))
        return spec, split

    def _edge_s(self, e: Edge, src: tuple[Spec, int], dst: Spec, split: frozenset[int], *,
                recomputed: bool | None = None) -> float:
        return self.cost.edge_time_s(e.tensor, src[0], dst, split,
                                     recomputed=e.consumer_node in self.cost.layer_of if recomputed is None else recomputed,
                                     saved=self.cost.reads_in_backward(self.graph.node_by_name[e.consumer_node], e.in_index),
                                     zero_stage=src[1])

    def _edge_ns(self, e: Edge, src: tuple[Spec, int], dst: Spec, split: frozenset[int],
                 terms: GroupTerms | None) -> tuple[int, ...] | None:
        """An edge's ns in the step (all its instances), what recomputing one layer of the consumer's
        group adds to it (0 outside recomputed groups), and under the overlapped step its gradient
        reductions and parameter gathers apart (the first then holds only what stays exposed;
        `CostModel.edge_time_parts`); None where the pair cannot be: a
        parameter at a ZeRO-1/2 stage it chose (`--zero auto`) is used where it is stored and its
        gradient all-reduced there (its states are sharded only so; a stage the request fixes is
        priced where it applies, the others held at 0 by `make_plan`); and, under a hand layout, a
        parameter stored split over its tp axis but used otherwise there (ZeRO-3 over that axis: a
        freedom a layout does not give — it shards parameters over dp_shard only)."""
        if self.param_layout is not None and isinstance(e.producer, ParamDecision) and any(
                isinstance(a, Shard) and a != b for a, b, n in zip(src[0].placements, dst.placements,
                                                                  self.rules.mesh.axis_names, strict=True)
                if n == "tp"):
            return None
        if src[1] and len(self.zero_options) > 1 and (src[0] != dst or not any(
                ev.purpose is Purpose.GRAD_SYNC and ev.kind is Collective.ALL_REDUCE
                for ev in self.cost.edge_events(e.tensor, src[0], dst, split))):
            return None
        parts = [x * e.multiplicity * NS_PER_S for x in self._edge_parts(e, src, dst, split)]
        if self.overlapped:  # the hideable parts go to the overlap rows (`add_overlap`), with one gather's
            ns, hide = round(parts[0]), (*(round(x) for x in parts[1:]), round(self.cost.first_gather_s(
                e.tensor, src[0], dst, split, recomputed=e.consumer_node in self.cost.layer_of,
                saved=self._saved(e), zero_stage=src[1]) * NS_PER_S) if parts[3] else 0)
        else:
            ns, hide = round(sum(parts)), (0, 0, 0, 0)
        if terms is None:
            return ns, 0, *hide
        again = self._edge_s(e, src, dst, split, recomputed=True) - self._edge_s(e, src, dst, split)
        return ns, round(again * e.multiplicity / terms.layers * NS_PER_S), *hide

    def _edge_parts(self, e: Edge, src: tuple[Spec, int], dst: Spec,
                    split: frozenset[int]) -> tuple[float, float, float, float]:
        return self.cost.edge_time_parts(e.tensor, src[0], dst, split, recomputed=e.consumer_node in self.cost.layer_of,
                                         saved=self._saved(e), zero_stage=src[1])

    def _saved(self, e: Edge) -> bool:
        return self.cost.reads_in_backward(self.graph.node_by_name[e.consumer_node], e.in_index)

    # -- variables -----------------------------------------------------------------------------------

    def _add_variables(self) -> None:
        self.x = {d: [self.model.bool_var(f"x[{d},{i}]") for i in range(k)] for d, k in self.decisions.items()}

    # -- constraint families ---------------------------------------------------------------------------

    def add_one_choice(self) -> None:
        for d, xs in self.x.items():
            self.model.add(f"one_choice[{d}]", [(x, 1) for x in xs], 1, 1)
            self.constraint_counts["one_choice"] += 1

    def add_edges(self) -> list[tuple[int, int]]:
        """y variables with both marginals; returns the objective terms (ns). Edges within one
        decision become per-choice costs (`self.inner_cost`)."""
        terms: list[tuple[int, int]] = []
        self.inner_cost = {d: [0.0] * k for d, k in self.decisions.items()}
        self.overlap = OverlapTerms()  # under the overlapped step, the hideable parts of the y

        def charge(var: int, entry: tuple[int, ...], k: int, multiplicity: int, terms_g: GroupTerms | None) -> None:
            ns, extra, *hide = entry
            if ns:
                terms.append((ns, var))
            if any(hide):
                self.overlap.add_edge(k, var, multiplicity, *hide)
            if terms_g is not None and extra:
                terms_g.time_ns[var] += extra

        shared = self._shared_edges()
        shared_first: dict[tuple[object, ...], int] = {}
        for k, group in shared.items():
            shared_first.setdefault(group, k)
        pending: dict[tuple[tuple[object, ...], object], list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
        for k, e in enumerate(self.edges):
            if e.producer == e.consumer:
                for c in range(self.decisions[e.producer]):
                    dst, split = self._consumer_class(e, c)
                    self.inner_cost[e.producer][c] += e.multiplicity * self._edge_s(e, self._producer_spec(e, c), dst, split)
                    terms_g = self.layer_terms.get(e.consumer_node)
                    inner = self._edge_ns(e, self._producer_spec(e, c), dst, split, terms_g)
                    if terms_g is not None and inner is not None:  # (a node's own edges: never a parameter's)
                        terms_g.time_ns[self.x[e.producer][c]] += inner[1]
                continue
            producer_class: dict[tuple[Spec, int], list[int]] = defaultdict(list)
            for c in range(self.decisions[e.producer]):
                producer_class[self._producer_spec(e, c)].append(c)
            consumer_class: dict[tuple[Spec, frozenset[int]], list[int]] = defaultdict(list)
            for c in range(self.decisions[e.consumer]):
                consumer_class[self._consumer_class(e, c)].append(c)
            # Cost matrix over classes, then merge classes with identical rows (columns): exact, and
            # it shrinks y several-fold where many specs reshard alike. An edge whose redistribute is
            # shared keeps each of its (from, to) pairs apart where they cost anything.
            terms_g = self.layer_terms.get(e.consumer_node)
            cost = [[self._edge_ns(e, src, dst, split, terms_g) for (dst, split) in consumer_class] for src in producer_class]
            key = [[(src[0], *dst) if k in shared and c is not None and any(c) else None
                    for dst, c in zip(consumer_class, row, strict=True)] for src, row in zip(producer_class, cost, strict=True)]
            rows = merge_identical([tuple(zip(r, kr, strict=True)) for r, kr in zip(cost, key, strict=True)],
                                   list(producer_class.values()))
            cols = merge_identical([tuple((cost[i][j], key[i][j]) for i in range(len(cost))) for j in range(len(consumer_class))],
                                    list(consumer_class.values()))
            y = {}
            for a, (ra, _) in enumerate(rows):
                for b, (cb, _) in enumerate(cols):
                    entry = cost[ra][cb]
                    if entry is None:
                        continue
                    y[a, b] = var = self.model.bool_var(f"y[{k},{a},{b}]")
                    if key[ra][cb] is not None:  # charged once for the edges that share it, below
                        pending[shared[k], key[ra][cb]].append((var, entry))
                    else:
                        charge(var, entry, k, e.multiplicity, terms_g)
            for a, (_, members) in enumerate(rows):
                self.model.add_equal(f"edge_producer[{k},{a}]", [y[a, b] for b in range(len(cols)) if (a, b) in y],
                                     [self.x[e.producer][i] for i in members])
                self.constraint_counts["edge_producer"] += 1
            for b, (_, members) in enumerate(cols):
                self.model.add_equal(f"edge_consumer[{k},{b}]", [y[a, b] for a in range(len(rows)) if (a, b) in y],
                                     [self.x[e.consumer][j] for j in members])
                self.constraint_counts["edge_consumer"] += 1
        for n, ((group, _), ys) in enumerate(pending.items()):  # one redistribute: z ≥ y of every edge
            var, entry = ys[0]
            if len(ys) > 1:
                var = self.model.bool_var(f"shared[{n}]")
                for i, (y_, _) in enumerate(ys):
                    self.model.add(f"shared[{n},{i}]", [(var, 1), (y_, -1)], 0, 1)
                self.constraint_counts["shared"] += len(ys)
            first = shared_first[group]
            charge(var, entry, first, self.edges[first].multiplicity, self.layer_terms.get(self.edges[first].consumer_node))
        return terms

    def _shared_edges(self) -> dict[int, tuple[object, ...]]:
        """Edges whose redistribute one other edge shares where both need the same spec with the same
        gradient placements (`costmodel.comm.shared_reshard`): an activation's edges to consumers in the
        same layer, tied alike. Edge → its group."""
        groups: dict[tuple[object, ...], list[int]] = defaultdict(list)
        for k, e in enumerate(self.edges):
            if e.producer == e.consumer or self.graph.tensors[e.tensor].kind is not TensorKind.ACTIVATION:
                continue
            terms = self.layer_terms.get(e.consumer_node)
            groups[e.tensor, e.multiplicity, self.graph.layer_of.get(e.consumer_node),
                   self.cost.layer_of.get(e.consumer_node), terms.prefix if terms is not None else None].append(k)
        return {k: g for g, ks in groups.items() if len(ks) > 1 for k in ks}

    def _costs_and_memory(self) -> tuple[dict[Decision, list[float]], dict[Decision, list[float]]]:
        """Per choice of every decision: seconds (compute of its nodes, inner edges) and bytes
        (saved activations; parameter states), each node counted once per layer it stands for."""
        mult: dict[str, int] = defaultdict(int)
        for r in self.rep.values():
            mult[r] += 1
        pmult: dict[str, int] = defaultdict(int)
        for r in self.param_rep.values():
            pmult[r] += 1
        costs = {d: [0.0] * k for d, k in self.decisions.items()}  # the edges inside a decision: `add_edges`
        self.backward_s = {d: [0.0] * k for d, k in self.decisions.items()}  # the step's backward, of the nodes
        self.compute_s = {d: [0.0] * k for d, k in self.decisions.items()}  # the whole step's, of the nodes
        self.host_cover_s = {d: [0.0] * k for d, k in self.decisions.items()}  # the same less the loss's collectives
        mem = {d: [0.0] * k for d, k in self.decisions.items()}
        # Pipeline stages: per stage, how many of each representative's nodes (parameters) lie in it.
        count: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        pcount: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        if self.stages is not None:
            for n, r in self.rep.items():
                count[r][self.stages[n]] += 1
            # A tied weight: a copy on every stage that reads it (as the stages are priced).
            readers = param_stages(self.graph, dict(self.stages), len(self.in_flight))
            for t, r in self.param_rep.items():
                for st in readers.get(t) or (self.stages[self.cost.param_owner[t]],):
                    pcount[r][st] += 1
        self.stage_mem = [{d: [0.0] * k for d, k in self.decisions.items()} for _ in self.in_flight] \
            if self.stages is not None else []
        self.end_mem: dict[Decision, list[float]] = {}  # the parameters' states with their gradients
        # Ranks meet at collectives, and the step waits for the slowest: the profile's rank skew × compute
        # (`compose.serial`; charged to every multi-device plan here, where the composer spares one with
        # no collective at all: a fully replicated plan, never the best on several devices).
        skew = 1 + ((self.cost.profile.device.rank_skew or 0.0) if self.cost.mesh.num_devices > 1 else 0.0)
        for owner, (d, m) in self.sigma.items():
            if isinstance(owner, ParamDecision):
                p = owner.param
                at = list(zip(self.param_specs[p], self.param_stages[p], strict=True))
                states = [self.cost.states.param_states(p, spec, stage=stage) for spec, stage in at]
                whole = [sum(x) * pmult[p] for x in states]
                # Without accumulation no gradient exists yet at the loss (`compose.peak_memory`): they
                # are in the end-of-backward row instead.
                mem[d] = whole if self.gradients_held else [(w + o) * pmult[p] for w, _, o in states]
                self.end_mem[d] = whole
                for st, k in pcount[p].items():
                    self.stage_mem[st][d] = [b / pmult[p] * k for b in whole]
                costs[d] = [c + self.cost.states.optimizer_s(p, spec, stage=stage) * pmult[p]
                            for c, (spec, stage) in zip(costs[d], at, strict=True)]
                if self.offload_terms:
                    self._offload_param_terms(d, p, at)
                continue
            node = owner.node
            gnode, strategies = self.graph.node_by_name[node], self._strategies(node)
            priced = {j: self.cost.node_cost(gnode, strategies[j]) for j in set(m)}
            for c, j in enumerate(m):
                pj = priced[j]  # skewed: its compute, as the composer counts it (not the loss's collectives)
                costs[d][c] += (pj.time_s + (skew - 1) * pj.compute_s) * mult[node] * self.cost.micro_batches
                self.backward_s[d][c] += (priced[j].compute.bwd_s + priced[j].recompute_s) * mult[node] \
                    * self.cost.micro_batches
                # (the cover the gathers hide under: with the loss's collectives, as before — without them, the
                # same optimum took CBC past its 60 s on Llama-3-70B at global batch 16; a lower bound)
                self.compute_s[d][c] += pj.time_s * mult[node] * self.cost.micro_batches
                self.host_cover_s[d][c] += pj.compute_s * mult[node] * self.cost.micro_batches
                # A recomputed node holds its activations once (one layer at a time), its layer input
                # in every layer it stands for.
                mem[d][c] += priced[j].activation_bytes * mult[node] + priced[j].recomputed_bytes
                for st, k in count[node].items():  # a stage holds several micro-batches' activations
                    once = loss.workspace_bytes if (loss := priced[j].loss) is not None else 0.0  # its backward's
                    self.stage_mem[st][d][c] += ((priced[j].activation_bytes - once) * k * self.in_flight[st]
                                                 + once * k + priced[j].recomputed_bytes)
            if (terms := self.layer_terms.get(node)) is not None and self.recompute_model is not None:
                for c, j in enumerate(m):  # one layer of its group recomputed: time added, memory saved
                    full, var = self.recompute_model.node_cost(gnode, strategies[j]), self.x[d][c]
                    terms.time_ns[var] += (full.time_s - priced[j].time_s) * skew * self.cost.micro_batches * NS_PER_S
                    terms.saved_kib[var] += (priced[j].activation_bytes - full.activation_bytes) / KIB
                    terms.transient_kib[var] += full.recomputed_bytes / KIB
            if self.act_terms:
                self._activation_terms(node, [(self.x[d][c], priced[j].activation_bytes) for c, j in enumerate(m)])
        return costs, mem

    def _check_time_floor(self, costs: dict[Decision, list[float]], mem: dict[Decision, list[float]]) -> None:
        """Given a cutoff, no solve where the objective's lower bound without edges (`floor.py`) is already
        above it. (Not where offload trades memory for time outside the recomputation counts, nor on a
        pipeline's stage rows.)"""
        o = self.options
        if o.cutoff_s is None or self.offload_terms or self.act_groups or self.stage_mem or self.memory_soft:
            return
        groups = [Group(lo=t.fixed if t.fixed is not None else 0, hi=t.fixed if t.fixed is not None else t.layers,
                        time_s={v: c / NS_PER_S for v, c in t.time_ns.items()},
                        saved_bytes={v: c * KIB for v, c in t.saved_kib.items()})
                  for t in {id(t): t for t in self.layer_terms.values()}.values()]
        limit = self.memory_limit_bytes if self.memory_limit_bytes is not None else float("inf")
        floor = time_floor(costs, mem, self.x, groups, limit)
        # (the objective's coefficients are rounded to whole ns: at most half a ns each below these sums)
        slack, fixed = 0.5 * self.model.num_variables / NS_PER_S, sum(self.cost.fixed_s())
        if floor.seconds - slack + fixed > o.cutoff_s:
            memory = floor.without_memory - slack + fixed <= o.cutoff_s  # (the memory row took it over)
            raise NotBetterError(f"no plan {'fits the memory limit and ' if memory else ''}beats {o.cutoff_s:.6g} s "
                                 f"(a plan already found; lower bound {floor.seconds + fixed:.6g} s)", memory=memory)

    def add_overlap(self) -> list[tuple[int, int]]:
        """The overlapped step's exposed-communication terms (`overlap.py`); their objective terms."""
        cm = self.cost  # the most gradient bytes the composer's buckets can hold (over every axis, in fp32)
        most = self.graph.num_params * max(cm.precision.grad_bytes, 4 if cm.fp32_communication else 0) * cm.mesh.ndim
        terms, self.overlap_vars, rows = self.overlap.add_rows(
            self.model, self.x, self.backward_s, self.compute_s, cm.fusion, most, cm.micro_batches)
        self.constraint_counts["overlap"] += rows
        return terms

    def add_pins(self) -> None:
        g = self.graph
        for t, spec in self.pins.items():
            if t not in g.tensors:
                raise PinError(f"`pins` {t}: no tensor of that name in the model; pins name inputs, parameters or "
                               "activations (see meshplan inspect)")
            info = g.tensors[t]
            spec.validate(info.shape, self.rules.mesh.shape, f"`pins` {t}")
            if info.kind is TensorKind.PARAM:
                continue  # its decision has the pinned spec as its only choice
            matched = False
            if info.kind is TensorKind.INPUT:
                for n in g.compute_nodes:
                    for i, name in enumerate(n.inputs):
                        if name == t:
                            matched |= self._forbid(n.name, takes(i, spec), f"pin[{t}]")
            else:
                src = g.producer[t]
                idx = g.node_by_name[src].outputs.index(t)
                matched = self._forbid(src, makes(idx, spec), f"pin[{t}]")
            if not matched:
                raise PinError(f"`pins` {t}={spec}: no strategy of its op can produce or take that placement; "
                               "choose another (see meshplan strategies)")

    def _forbid(self, node: str, keep: Callable[[OpStrategy], bool], name: str) -> bool:
        v = self.rep.get(node, node)
        d, m = self.sigma[NodeDecision(v)]
        ok = [keep(self._strategies(v)[j]) for j in m]
        for i, (flag, var) in enumerate(zip(ok, self.x[d], strict=True)):
            if not flag:  # names must be unique: CBC aborts the process on a duplicate
                self.model.add(f"{name}[{d},{i}]", [(var, 1)], 0, 0)
                self.constraint_counts["pin"] += 1
        return any(ok)

    def _hint_replicated(self) -> None:
        for d, xs in self.x.items():
            if isinstance(d, ParamDecision):
                best = next((i for i, (s, z) in enumerate(zip(self.param_specs[d.param], self.param_stages[d.param],
                                                                   strict=True)) if s.is_replicated and not z), 0)
            else:
                best = next((i for i in range(len(xs)) if self._node_strategy(d.node, i).is_replicated), 0)
            for i, var in enumerate(xs):
                self.model.hints[var] = i == best

    # -- solve ------------------------------------------------------------------------------------------

    def solve(self) -> Solution:
        t0 = time.perf_counter()
        self._add_variables()
        self.add_one_choice()
        node_costs, mem = self._costs_and_memory()
        self._check_floor(mem)  # before the edges: an infeasible memory limit is told in a fraction of the time
        self._check_time_floor(node_costs, mem)  # and an ILP that cannot beat the plan the search holds
        edge_terms = self.add_edges()
        for d, inner in self.inner_cost.items():
            node_costs[d] = [a + b for a, b in zip(node_costs[d], inner, strict=True)]
        counts = add_counts(self.model, list({id(t): t for t in self.layer_terms.values()}.values()))
        # (`LinearModel.isolated`: CBC has aborted the process on offload, expert and published-run ILPs)
        self.model.isolated = True
        decision = {x: i for i, xs in enumerate(self.x.values()) for x in xs}
        offloads = add_offload_counts(self.model, list(self.offload_terms.values()), decision)
        host_acts = add_offload_counts(self.model, self.act_groups, decision, tag="host_activations")
        self.add_activation_rows(self.model, host_acts, counts.bits)
        self.add_host_row(self.model, [*offloads.host, *host_acts.host], decision)
        self.add_memory(mem, [*counts.memory, *offloads.memory, *host_acts.memory], end_extra=offloads.memory_end)
        edge_terms += self.add_overlap()
        cover = [(v, round(t * NS_PER_S)) for d, ts in self.host_cover_s.items()
                 for t, v in zip(ts, self.x[d], strict=True) if round(t * NS_PER_S)]
        exposed_host = add_exposed_row(self.model, offloads, [*cover, *counts.objective])
        if exposed_host is not None:
            edge_terms.append((1, exposed_host))
            self.overlap_vars["exposed_host"] = exposed_host
        self.add_pins()
        self._hint_replicated()
        node_terms = [(round(c * NS_PER_S), x) for d, cs in node_costs.items() for c, x in zip(cs, self.x[d], strict=True)]
        # Among plans of equal step time, prefer less memory: 1 ns per MiB per device, far below any
        # real difference in time (reported costs come from pricing the plan, not from this sum).
        tie_break = [(_tie_ns(b), x) for d, bs in mem.items() for b, x in zip(bs, self.x[d], strict=True) if b]
        self.model.objective = [(x, c) for c, x in (*node_terms, *edge_terms, *tie_break) if c] + counts.objective \
            + offloads.objective + host_acts.objective
        self.model.objective += [(v, OVER_NS_PER_KIB) for v in self.over_vars]
        o = self.options
        fixed_s = sum(self.cost.fixed_s())  # in every plan's step, not in the model
        if o.cutoff_s is not None:
            self.model.cutoff = round((o.cutoff_s - fixed_s) * NS_PER_S)
        result = self.model.solve(o.backend, time_limit_s=o.time_limit_s, num_workers=o.num_workers, log=o.log)
        held = result.status in ("OPTIMAL", "FEASIBLE") and not self.memory_soft and \
            any(result.values[v] for v in self.over_vars)
        if held:  # the best plan priced its excess: none fits, or one fits at a higher price (in the time left)
            self.hold_memory_hard()
            result = self.model.solve(o.backend, time_limit_s=max(1.0, o.time_limit_s - result.time_s),
                                      num_workers=o.num_workers, log=o.log)
        if result.status == "INFEASIBLE" and o.cutoff_s is not None:
            raise NotBetterError(f"no plan {'fits the memory limit and ' if held else ''}beats {o.cutoff_s:.6g} s "
                                 "(a plan already found)", memory=held)
        if result.status == "INFEASIBLE":
            families = ", ".join(f for f in ("memory", "host memory", "pin") if self.constraint_counts.get(f))
            raise InfeasiblePlanError(f"no plan satisfies the {families or 'model'} constraints together; "
                                      "raise `memory_limit_gib`, drop a pin, or add devices")
        if result.status not in ("OPTIMAL", "FEASIBLE"):
            raise InfeasiblePlanError(f"the solver found no plan within `time_limit_s` {o.time_limit_s:.0f} s "
                                      f"(status {result.status}); raise `time_limit_s`")
        picked = {d: next(i for i, x in enumerate(xs) if result.values[x]) for d, xs in self.x.items()}
        choice: dict[str, OpStrategy] = {}
        for n in self.graph.compute_nodes:
            d, m = self.sigma[NodeDecision(self.rep[n.name])]
            choice[n.name] = self.rules.by_node[n.name].strategies[m[picked[d]]]
        param_specs = {t: self.param_specs[r][picked[ParamDecision(r)]] for t, r in self.param_rep.items()}
        zero = {t: z for t, r in self.param_rep.items() if (z := self.param_stages[r][picked[ParamDecision(r)]])}
        recompute = {g: count for g, bits in counts.bits.items() if (count := sum(w * result.values[v] for v, w in bits))}
        offload = self.offloaded_layers({key: result.values[n] for key, n in offloads.counts.items()})
        activations = {prefix: result.values[n] for (prefix, _), n in host_acts.counts.items() if result.values[n]}
        # The step the model prices at the solution: less the tie-break and any excess's price, plus
        # what every plan pays; the bound less the most tie-break any solution could carry.
        aside = sum(c * result.values[x] for c, x in tie_break) + sum(OVER_NS_PER_KIB * result.values[v]
                                                                       for v in self.over_vars)
        most_tie = sum(max((_tie_ns(b) for b in bs if b), default=0) for bs in mem.values())
        obj = (result.objective - aside) / NS_PER_S + fixed_s
        bound = obj if result.status == "OPTIMAL" else min(obj, (result.bound - most_tie) / NS_PER_S + fixed_s)
        stats = SolverStats(
            status=result.status, objective=obj, bound=bound, gap=(obj - bound) / obj if obj > 0 else 0.0,
            time_s=time.perf_counter() - t0, num_variables=self.model.num_variables,
            num_constraints=self.model.num_constraints,
            num_decision_nodes=len(self.x), num_edges=sum(1 for e in self.edges if e.producer != e.consumer),
        )
        return Solution(choice=choice, param_specs=param_specs, stats=stats, zero=zero, recompute=recompute, offload=offload,
                        activations=activations,
                        constraints_by_family=dict(self.constraint_counts),
                        exposed_s={n: result.values[v] / NS_PER_S for n, v in self.overlap_vars.items()})


def _tie_ns(nbytes: float) -> int:
    """The memory tie-break's price of a choice holding `nbytes` a device: 1 ns per MiB, at least 1."""
    return max(1, round(nbytes / 2**20))
