"""Offload as a decision of the sharding ILP: how many layers n_g,m of each repeated-layer group g keep
their model states in host memory under mode m (`core.levers.Offload`: the optimizer states, or the
weights, gradients and optimizer states), the first layers of the group; the parameters outside the
repeated layers one more group of one layer. A layer is offloaded whole, as FSDP2 offloads a
`fully_shard` unit (CPUOffloadPolicy) and ZeRO-Offload a model's optimizer.

Per layer of group g offloaded under m, under the sharding decisions x (`ModelStates`), each linear in
the choice variables x_c (Σ_c e_c·x_c):
  T_g,m(x)  the time it adds to the objective: the host's optimizer step less the device's, and its
            copies the step waits for whatever the compute (all of them under the serial step; under
            the overlapped one those after the optimizer step) (ns; negative where the host is faster);
  S_g,m(x)  the device bytes it frees, in the step's peak row and in the end-of-backward row (KiB);
  H_g,m(x)  its copies that can run under compute (ns; overlapped step only);
  F_p,m(x)  the longest such copy of its parameter p (ns).
The count n is an integer variable; its products with the x_c are w_c = n·x_c, exact for binary x_c
(McCormick: w_c ≤ L·x_c, w_c ≤ n, w_c ≥ n − L·(1 − x_c), 0 ≤ w_c ≤ L), so n·T = Σ_c t_c·w_c and so on:
  objective  + Σ_c t_c·w_c
  memory     − Σ_c s_c·w_c                           (each row its own s)
  exposed    E ≥ Σ_c h_c·w_c − compute(x) − recomputation,  E ≥ F_p,m(x) − F⁺·(1 − z_g,m),  n ≤ L·z,  E ≥ 0
  host       Σ_c m_c·w_c ≤ the device's share of its node's host memory, where the profile states it
             (m_c: the bytes a layer holds there, states and saved activations alike)
Σ_m n_g,m ≤ L_g. With x integral the relaxation holds w_c = n·x_c, so the solver branches on the counts
themselves (a first form, n as bits with big-M rows per bit, took CBC 4–18 s a solve on Llama-3-8B on
one device, where the sharding is fixed and the problem a knapsack of a few counts). E = max(the
longest copy offloaded, hideable − compute) at an optimum, as `compose.host_exposed` prices it.

Saved activations (`core.levers.ActivationOffload`) are counted the same way, per group g a count a_g of
layers after the recomputed ones, with the per-layer terms of its first layer's nodes under x: the bytes
they save (freed from the peak row) and their two copies a micro-batch, waited for (on the compute
stream, `costmodel/host_activations.py`). A layer is recomputed or saves to the host, not both:
a_g + r_g ≤ L_g (= L_g where every layer not recomputed is asked for), r_g the recomputation count."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from core.collectives import Cadence
from core.graph import OpGraph, TensorKind
from core.levers import ActivationOffload, Offload, Recompute
from core.placement import Spec
from costmodel.step import CostModel
from planner.search.decisions import KIB, NS_PER_S, Decision, InfeasiblePlanError
from planner.search.milp import LinearModel
from planner.search.recompute import BIG

MODES = (Offload.OPTIMIZER, Offload.PARAMS)


@dataclass
class LayerOffload:
    """One group's per-layer expressions under one mode, as coefficients by variable."""

    prefix: str  # the layer group's ("" for the parameters outside the repeated layers)
    mode: Offload | None  # None: the layer's saved activations (`costmodel/host_activations.py`)
    layers: int
    fixed: int | None = None  # the count, where the request holds it (every layer: `offload` optimizer, ...)
    time_ns: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    saved_kib: dict[int, float] = field(default_factory=lambda: defaultdict(float))  # at the step's peak
    saved_end_kib: dict[int, float] = field(default_factory=lambda: defaultdict(float))  # at the end of backward
    hideable_ns: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    host_kib: dict[int, float] = field(default_factory=lambda: defaultdict(float))  # what it holds in host memory
    first_ns: list[dict[int, float]] = field(default_factory=list)  # per parameter: its longest hideable copy


@dataclass
class OffloadCounts:
    """What the counts add to the ILP: objective terms (ns), the two memory rows' terms (KiB), the
    hideable copies' terms (ns, for the exposed row) with the longest copies' rows still to add, the
    host memory's terms (KiB), and per (group, mode) its count's variable."""

    objective: list[tuple[int, int]]
    memory: list[tuple[int, int]]
    memory_end: list[tuple[int, int]]
    hideable: list[tuple[int, int]]
    host: list[tuple[int, int]]
    firsts: list[tuple[int, list[tuple[int, int]], int]]  # (z, the parameter's terms, their bound)
    counts: dict[tuple[str, Offload | None], int]
    hideable_most: int = 1  # the most the hideable terms sum to (each decision's largest, times its layers)


def add_offload_counts(model: LinearModel, groups: Sequence[LayerOffload], decision: Mapping[int, int], *,
                       tag: str = "offload") -> OffloadCounts:
    """`decision`: each choice variable's decision (one choice of each is taken: bounds from each
    decision's largest coefficient); `tag`: the variables' and rows' names begin with it."""
    out = OffloadCounts([], [], [], [], [], [], {})
    by_group: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for gi, g in enumerate(groups):
        lo, up = (g.fixed, g.fixed) if g.fixed is not None else (0, g.layers)
        n = model.int_var(f"{tag}_count[{gi}]", lo, up)
        out.counts[(g.prefix, g.mode)] = n
        by_group[g.prefix].append((n, 1))
        t = {v: round(c) for v, c in g.time_ns.items() if round(c)}
        s = {v: int(c) for v, c in g.saved_kib.items() if int(c)}  # rounded down: the saving is not overstated
        se = {v: int(c) for v, c in g.saved_end_kib.items() if int(c)}
        h = {v: round(c) for v, c in g.hideable_ns.items() if round(c)}
        hm = {v: math.ceil(c) for v, c in g.host_kib.items() if c > 0}  # rounded up: the host's use not understated
        big = g.layers
        largest: dict[int, int] = defaultdict(int)
        for v, c in h.items():
            largest[decision.get(v, -v - 1)] = max(largest[decision.get(v, -v - 1)], c)
        out.hideable_most += big * sum(largest.values())
        for x in sorted(set(t) | set(s) | set(se) | set(h) | set(hm)):
            w = model.int_var(f"{tag}_layers_at[{gi},{x}]", 0, big)  # n·x
            model.add(f"{tag}_at_choice[{gi},{x}]", [(w, 1), (x, -big)], -BIG, 0)
            model.add(f"{tag}_at_count[{gi},{x}]", [(w, 1), (n, -1)], -BIG, 0)
            model.add(f"{tag}_at_both[{gi},{x}]", [(w, 1), (n, -1), (x, -big)], -big, BIG)
            if x in t:
                out.objective.append((w, t[x]))
            if x in s:
                out.memory.append((w, -s[x]))
            if x in se:
                out.memory_end.append((w, -se[x]))
            if x in h:
                out.hideable.append((w, h[x]))
            if x in hm:
                out.host.append((w, hm[x]))
        if g.first_ns:
            z = model.bool_var(f"{tag}_any[{gi}]")
            model.add(f"{tag}_any[{gi}]", [(n, 1), (z, -big)], -BIG, 0)
            for f in g.first_ns:
                terms = [(v, round(c)) for v, c in f.items() if round(c)]
                if terms:
                    out.firsts.append((z, terms, max(c for _, c in terms)))
    for prefix, counts in by_group.items():  # a layer is offloaded under one mode at most
        layers = next(g.layers for g in groups if g.prefix == prefix)
        model.add(f"{tag}_layers[{prefix or '(outside layers)'}]", counts, 0, layers)
    return out


def host_size(b: float) -> str:
    """Bytes of host memory in a message: GiB, or MiB below one."""
    return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def add_exposed_row(model: LinearModel, counts: OffloadCounts, cover: Sequence[tuple[int, int]]) -> int | None:
    """E ≥ Σ hideable − cover (the step's compute and recomputation, as (variable, ns) terms) and
    E ≥ each offloaded parameter's longest copy; E's variable (None: nothing hideable)."""
    if not counts.hideable and not counts.firsts:
        return None
    e = model.int_var("exposed_host", 0, counts.hideable_most)
    model.add("exposed_host", [(e, 1), *[(v, -c) for v, c in counts.hideable], *cover], 0, BIG)
    for k, (z, terms, most) in enumerate(counts.firsts):
        # E ≥ F − most·(1 − z)
        model.add(f"first_host_copy[{k}]", [(e, 1), *[(v, -c) for v, c in terms], (z, -most)], -most, BIG)
    return e


class OffloadDecisions:
    """The offload counts' terms from the sharding ILP's parameter decisions (mixed into `ShardingILP`,
    which sets these), and the parameters' places from the counts solved."""

    graph: OpGraph
    offload: Offload
    offload_activations: ActivationOffload
    params: list[str]
    param_rep: dict[str, str]
    x: dict[Decision, list[int]]
    cost: CostModel
    gradients_held: bool
    overlapped: bool
    constraint_counts: dict[str, int]
    memory_soft: bool

    def _offload_groups(self) -> None:
        """Under offload, each representative parameter's layer group (−1: outside the repeated layers),
        how many of it one layer holds, and per (group, mode) its per-layer terms (`offload.py`)."""
        self.offload_terms: dict[tuple[int, Offload], LayerOffload] = {}
        self.param_group: dict[str, tuple[int, float]] = {}  # representative → (group, instances per layer)
        if self.offload is Offload.NONE:
            return
        g = self.graph
        per: dict[str, int] = defaultdict(int)
        for r in self.param_rep.values():
            per[r] += 1
        for gi, group in enumerate(g.layers):
            for name in group.nodes[0]:
                for t in g.node_by_name[name].inputs:
                    if t in g.tensors and g.tensors[t].kind is TensorKind.PARAM and self.param_rep.get(t) is not None:
                        r = self.param_rep[t]
                        self.param_group.setdefault(r, (gi, per[r] / group.num_layers))
        for r in self.params:
            self.param_group.setdefault(r, (-1, per[r]))
        for gi in [-1, *range(len(g.layers))]:
            layers = g.layers[gi].num_layers if gi >= 0 else 1
            for mode in MODES:
                fixed = None if self.offload is Offload.AUTO else layers if mode is self.offload else 0
                self.offload_terms[(gi, mode)] = LayerOffload(prefix=self.group_key(gi), mode=mode, layers=layers,
                                                              fixed=fixed)

    def _activation_groups(self) -> None:
        """Under activation offload, each group's per-layer terms (`act_groups`), and its first layer's
        nodes → them (`act_terms`): none where the model recomputes every layer already (held full)."""
        self.act_groups: list[LayerOffload] = []
        self.act_terms: dict[str, LayerOffload] = {}
        if self.offload_activations is ActivationOffload.NONE or self.cost.recompute is not Recompute.NONE:
            return
        loss_node = self.graph.producer.get(self.cost.loss_tensor)
        for group in self.graph.layers:
            terms = LayerOffload(prefix=group.prefix, mode=None, layers=group.num_layers)
            self.act_groups.append(terms)
            self.act_terms.update({n: terms for n in group.nodes[0] if n != loss_node})

    def _activation_terms(self, node: str, saved: Sequence[tuple[int, float]]) -> None:
        """A first-layer node's share of its group's activation terms: per choice (variable, bytes it saves)."""
        terms = self.act_terms.get(node)
        if terms is None:
            return
        per_byte = 2 * self.cost.micro_batches / self.cost.states.host_rate() * NS_PER_S  # to host and back
        for var, b in saved:
            terms.saved_kib[var] += b / KIB
            terms.host_kib[var] += b / KIB
            terms.time_ns[var] += b * per_byte

    def add_host_row(self, model: LinearModel, terms: Sequence[tuple[int, int]], decision: Mapping[int, int]) -> None:
        """Σ host bytes ≤ the device's share of its node's host memory (`HostSpec.node_memory_bytes` over
        the node's devices), where the profile states it; refused before solving where the counts the
        request holds (every layer, for a mode other than auto) cannot fit however the states are split."""
        share = self.cost.profile.host_memory_per_device
        if share is None or not terms:
            return
        per_node = self.cost.profile.devices_per_node
        choices: dict[int, int] = defaultdict(int)
        for d in decision.values():
            choices[d] += 1
        floor_kib = 0.0
        for g in self.offload_terms.values():
            if not g.fixed:
                continue
            held: dict[int, list[float]] = defaultdict(list)  # per decision: what its choices hold there
            for var, kib in g.host_kib.items():
                held[decision[var]].append(kib)
            floor_kib += g.fixed * sum(min(kibs) if len(kibs) == choices[d] else 0.0 for d, kibs in held.items())
        if floor_kib * KIB > share:
            raise InfeasiblePlanError(
                f"host memory: offload {self.offload.value} keeps at least {host_size(floor_kib * KIB)} per device "
                f"on the host (every tensor split as far as its rules allow) but the profile's host holds "
                f"{host_size(share)} per device (host.node_memory_bytes over {per_node} devices); offload less (`offload` auto) or add devices")
        if not self.memory_soft:  # (a layout priced as it is: fitting or not, as the device's rows)
            model.add("host_memory", list(terms), 0, math.floor(share / KIB))
            self.constraint_counts["host memory"] += 1

    def add_activation_rows(self, model: LinearModel, counts: OffloadCounts,
                            recomputed: Mapping[str, list[tuple[int, int]]]) -> None:
        """a_g + r_g ≤ L_g, = L_g where every layer not recomputed saves to the host."""
        every = self.offload_activations is ActivationOffload.ALL
        for gi, g in enumerate(self.act_groups):
            row = [(counts.counts[(g.prefix, None)], 1), *recomputed.get(g.prefix, [])]
            model.add(f"host_activations_or_recompute[{gi}]", row, g.layers if every else 0, g.layers)

    def group_key(self, gi: int) -> str:
        """A layer group's name in the offload counts ("" outside the layers; the index where two share a prefix)."""
        if gi < 0:
            return ""
        prefix = self.graph.layers[gi].prefix
        return prefix if sum(1 for x in self.graph.layers if x.prefix == prefix) == 1 else f"{prefix}[{gi}]"

    def _offload_param_terms(self, d: Decision, p: str, at: Sequence[tuple[Spec, int]]) -> None:
        """A representative parameter's share of its group's per-layer offload terms, per choice: the
        time one layer's instances add offloaded, the device bytes they free, their copies under compute."""
        gi, k = self.param_group[p]
        states = self.cost.states
        per_step = {Cadence.MICRO_BATCH: self.cost.micro_batches, Cadence.STEP: 1}
        for mode in MODES:
            terms = self.offload_terms[(gi, mode)]
            first: dict[int, float] = {}
            for c, (spec, stage) in enumerate(at):
                var = self.x[d][c]
                w, g_, o = states.param_states(p, spec, stage=stage)
                (w2, g2, o2), host = states.offloaded(p, spec, mode, stage=stage)
                peak = (w + g_ + o) - (w2 + g2 + o2) if self.gradients_held else (w + o) - (w2 + o2)
                terms.saved_kib[var] += peak * k / KIB
                terms.saved_end_kib[var] += ((w + g_ + o) - (w2 + g2 + o2)) * k / KIB
                terms.host_kib[var] += host * k / KIB
                copies = states.host_copies(p, spec, mode, stage=stage)
                waited = [x for x in copies if not (self.overlapped and x.hideable)]
                hidden = [x for x in copies if self.overlapped and x.hideable]
                terms.time_ns[var] += (states.host_optimizer_s(p, spec, stage=stage) - states.optimizer_s(p, spec, stage=stage)
                                       + sum(x.time_s * per_step[x.cadence] for x in waited)) * k * NS_PER_S
                terms.hideable_ns[var] += sum(x.time_s * per_step[x.cadence] for x in hidden) * k * NS_PER_S
                if hidden:
                    first[var] = max(x.time_s for x in hidden) * NS_PER_S
            if first:
                terms.first_ns.append(first)


    def offloaded_layers(self, counts: Mapping[tuple[str, Offload | None], int]) -> dict[str, Offload]:
        """Every parameter's place from the counts: in each group, its first layers' states on the host
        under params,optimizer, the next under optimizer; outside the layers, as that group's count says."""
        g = self.graph
        out: dict[str, Offload] = {}
        in_layers: set[str] = set()
        for gi, group in enumerate(g.layers):
            key = self.group_key(gi)
            modes = [Offload.PARAMS] * counts.get((key, Offload.PARAMS), 0) + \
                [Offload.OPTIMIZER] * counts.get((key, Offload.OPTIMIZER), 0)
            for i, layer in enumerate(group.nodes):
                for name in layer:
                    for t in g.node_by_name[name].inputs:
                        if t in g.tensors and g.tensors[t].kind is TensorKind.PARAM and t in self.param_rep:
                            in_layers.add(t)
                            if i < len(modes):
                                out.setdefault(t, modes[i])
        for mode in (Offload.PARAMS, Offload.OPTIMIZER):
            if counts.get(("", mode)):
                out.update({t: mode for t in self.param_rep if t not in in_layers and t not in out})
        return out
