"""From a search's solution to a `Strategy`: one cost model per request, the parameter layout the
request allows, and the one builder of the strategy file every search path uses."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from core.collectives import Phase
from core.context import cp_axis, key_value_feeds
from core.experts import ep_axis, expert_weight_nodes, find_expert_blocks
from core.graph import SEQUENCE_DIM, OpGraph, TensorKind
from core.layout import WHOLE_AXES, Layout
from core.levers import Composer, CpMethod, LossKind, Recompute, Search
from core.mesh import DeviceMesh
from core.placement import OpStrategy, Partial, Placement, Replicate, Shard, Spec, fully_sharded
from costmodel.attention import attention_regions, causal_regions
from costmodel.compose import StepCost
from costmodel.items import PricedStep
from costmodel.memory import Precision
from costmodel.step import CostModel
from hwprofiles.files import list_presets
from hwprofiles.profile import HardwareProfile
from planner.graph import load_graph
from planner.rules import RuleSet
from planner.rules.context import context_parallel
from planner.search.decisions import SolverOptions
from planner.search.request import PlanRequest
from planner.search.solve import ShardingILP
from planner.strategy import (
    CandidateRecord,
    Fallback,
    ModelRef,
    NodePlan,
    PlanSettings,
    PredictedCost,
    ProfileRef,
    Reshard,
    SolverStats,
    Strategy,
    TensorPlacement,
    TrainingSettings,
)


def param_layout_for(req: PlanRequest, layout: Layout | None, graph: OpGraph,
                  mesh: DeviceMesh) -> Callable[[str, Spec], Spec | None] | None:
    """How parameters may be stored: as the layout says, and under --zero 3 split on dim 0 (FSDP),
    wherever they can be, over every axis they would be replicated on — with a layout, over its
    sharding axes only: dp_shard, or dp_replicate where it has no dp_shard (DDP at ZeRO-3 is FSDP), never
    tp (HSDP keeps a whole copy per replica, FSDP + TP a tp-replicated norm weight whole over tp)."""
    held = layout.param_layout(graph, mesh) if layout is not None else None
    if req.zero_stage != 3:
        return held
    over = None
    if layout is not None:  # (a layout without data-parallel axes, tp alone, shards over what it has, as before)
        names = mesh.axis_names
        over = tuple(a for a, n in enumerate(names) if n in ("dp_shard", "ep", "cp")) or \
            tuple(a for a, n in enumerate(names) if n == "dp_replicate") or None

    def zero3(param: str, spec: Spec) -> Spec | None:
        stored = held(param, spec) if held is not None else spec
        if stored is None:
            return None
        return fully_sharded(graph.tensors[param].shape, mesh.shape, stored, over) or stored

    return zero3


# One planning call's shared work (`sharing`): each model import and each cost model (its caches hold
# every edge it priced), reused by the hand layouts planned beside the search on the same graphs.
_SHARED: dict[tuple[object, ...], Any] | None = None


@contextmanager
def sharing() -> Iterator[None]:
    """Within, `graph_for` and `cost_model_for` return what they made before for the same arguments."""
    global _SHARED
    if _SHARED is not None:  # nested: the outer call's
        yield
        return
    _SHARED = {}
    try:
        yield
    finally:
        _SHARED = None


def graph_for(path: str, dims: Mapping[str, int]) -> OpGraph:
    """`load_graph`, once per model and dims within `sharing`."""
    if _SHARED is None:
        return load_graph(path, dims)
    key = ("graph", path, tuple(sorted(dims.items())))
    if key not in _SHARED:
        _SHARED[key] = load_graph(path, dims)
    graph: OpGraph = _SHARED[key]
    return graph


def cost_model_for(req: PlanRequest, graph: OpGraph, mesh: DeviceMesh, profile: HardwareProfile, precision: Precision,
                steps: int, policy: Recompute, layers: Mapping[str, int] | None = None) -> CostModel:
    """The request's cost model (once per graph, mesh and levers within `sharing`: the axes' names do
    not change a price but for an expert-parallel axis and a context-parallel one (the ring's passes),
    and ZeRO-3 is in the placements, so a request at stage 3 shares stage 0's)."""
    if _SHARED is None:
        return _cost_model(req, graph, mesh, profile, precision, steps, policy, layers)
    key = ("cost model", id(graph), mesh.shape, ep_axis(mesh), cp_axis(mesh), mesh.devices, mesh.devices_per_node, profile.digest,
           precision.name, steps, policy,
           tuple(sorted((layers or {}).items())), req.all_to_all, req.loss, (req.zero_stage or 0) % 3, req.composer,
           req.fusion, req.zero_threshold_bytes, req.force_fp32_communication, req.zero_shard_size, req.attention,
           req.attention_dropout, req.runtime, req.dataset_strategy == "full_batch", req.capacity_factor)
    if key not in _SHARED:
        _SHARED[key] = _cost_model(req, graph, mesh, profile, precision, steps, policy, layers)
    cm: CostModel = _SHARED[key]
    return cm


def _cost_model(req: PlanRequest, graph: OpGraph, mesh: DeviceMesh, profile: HardwareProfile, precision: Precision,
                steps: int, policy: Recompute, layers: Mapping[str, int] | None) -> CostModel:
    return CostModel(graph, mesh, profile, precision, enable_all_to_all=req.all_to_all, loss=req.loss,
                     micro_batches=steps, zero_stage=req.zero_stage or 0, recompute=policy,
                     composer=req.composer or Composer.SERIAL,
                     fusion=req.fusion, zero_threshold_bytes=req.zero_threshold_bytes, recompute_layers=layers,
                     fp32_communication=req.force_fp32_communication, zero_shard_size=req.zero_shard_size,
                     attention=req.attention, attention_dropout=req.attention_dropout, runtime=req.runtime,
                     capacity_factor=req.capacity_factor,
                     full_batch=req.dataset_strategy == "full_batch")


def profile_source(name_or_path: str) -> str:
    """How `explain` finds the profile again: a preset's name, or the file's absolute path."""
    return name_or_path if name_or_path in list_presets() else str(Path(name_or_path).resolve())


def batch_of(graph: OpGraph) -> int | None:
    for t in graph.inputs:
        if graph.tensors[t].shape:
            return graph.tensors[t].shape[0]
    return None


def build_strategy(graph: OpGraph, model_path: str, profile: ProfileRef, mesh: DeviceMesh, rules: RuleSet,
                   choice: Mapping[str, OpStrategy], cost: StepCost, stats: SolverStats, settings: PlanSettings,
                   candidates: tuple[CandidateRecord, ...] = (), training: TrainingSettings | None = None) -> Strategy:
    tensors = {}
    for t, spec in cost.placed.items():
        info = graph.tensors[t]
        if info.kind is TensorKind.CONSTANT or info.dtype == "sequence":
            continue
        tensors[t] = TensorPlacement(kind=info.kind, shape=tuple(info.shape), spec=spec)
    nodes = {}
    for n in graph.compute_nodes:
        s = choice[n.name]
        nodes[n.name] = NodePlan(op_type=n.op_type, module=n.module_path, strategy=s.name, inputs=tuple(s.input_specs),
                                 outputs=tuple(s.output_specs), kernels=tuple(s.kernels),
                                 compute_s=cost.node_compute_s.get(n.name, 0.0),
                                 collectives=tuple(cost.node_events.get(n.name, [])))
    return Strategy(
        model=ModelRef(path=str(Path(model_path).resolve()), name=graph.name, fingerprint=graph.fingerprint,
                       dims=dict(graph.dims), notes=tuple(graph.notes)),
        profile=profile, mesh=mesh, settings=settings, training=training or TrainingSettings(),
        tensors=tensors, nodes=nodes,
        reshards=tuple(Reshard(tensor=t, consumer=c, src=a, dst=b,
                               collectives=tuple([e for e in ev if e.phase is Phase.FORWARD]))
                       for t, c, a, b, ev in cost.reshards),
        fallbacks=tuple(Fallback(node=n.name, op_type=n.op_type) for n in rules.fallbacks),
        cost=PredictedCost(step_time_s=cost.step_time_s, compute_s=cost.compute_s, optimizer_s=cost.optimizer_s,
                           overhead_s=cost.overhead_s, comm_s=cost.comm_s, memory=dict(cost.memory),
                           flops_per_device=cost.flops_matmul, composer=cost.policy, hidden_comm_s=cost.hidden_comm_s,
                           peak_bytes=cost.memory_bytes, host_s=cost.host_s, hidden_host_s=cost.hidden_host_s,
                           host_copy_bytes=cost.host_copy_bytes,
                           host_memory_bytes=sum(cost.priced.host_memory.values())),
        solver=stats, candidates=candidates, buckets=tuple(cost.priced.buckets),
    )


def plan_settings(req: PlanRequest, graph: OpGraph, *, search: Search, dtype: str, limit: float,
                  loss: LossKind) -> PlanSettings:
    """What the search was asked and how it ran, as the strategy file records it."""
    return PlanSettings(mode=req.mode, search=search, dtype=dtype, memory_limit_bytes=limit, solver=req.solver,
                        follow=req.follow, pins=dict(req.pins), batch=batch_of(graph), loss=loss, runtime=req.runtime)


def training_settings(req: PlanRequest, graph: OpGraph, steps: int, priced: PricedStep, *, data_parallel: int,
                      layout: Layout | None, recompute: Mapping[str, Recompute],
                      recompute_layers: Mapping[str, int] | None = None) -> TrainingSettings:
    """The training step's levers as the plan chose them: one builder for every search path. The
    micro-batch per data-parallel rank is rank 0's: the traced batch split as torch.chunk splits it
    (the larger share first)."""
    micro = batch_of(graph)
    zero = dict(priced.zero_stages)
    return TrainingSettings(
        micro_batches=steps,
        zero_stage=req.zero_stage if req.zero_stage is not None else max(zero.values(), default=0),
        zero_stages=zero, comm_fusion=priced.fusion, recompute=dict(recompute),
        recompute_layers=dict(recompute_layers or {}), gradients_mean=req.gradients_mean,
        parameter_broadcast=req.parameter_broadcast, force_fp32_communication=req.force_fp32_communication,
        attention=req.attention, attention_dropout=req.attention_dropout, zero_shard_size=req.zero_shard_size,
        global_batch_size=micro * steps if micro is not None else None,
        micro_batch_size=-(-micro // data_parallel) if micro is not None else None,
        layout=str(layout) if layout is not None else None, zero_threshold_bytes=req.zero_threshold_bytes,
        offload=dict(priced.offload), offload_activations=dict(priced.host_activations),
        capacity_factor=req.capacity_factor if find_expert_blocks(graph) else None,
        dataset_strategy=req.dataset_strategy)


def as_written(rules: RuleSet, graph: OpGraph, layout: Layout | None,
               cp_method: CpMethod | None = None) -> RuleSet:
    """The rules a user's layout leaves. On its data-parallel axes (dp_replicate, dp_shard) every op
    (and cp: context parallelism) uses its parameters whole, as DDP and FSDP run them (FSDP gathers them
    for use): no op may split a weight over a data-parallel axis, which would be tensor parallelism the
    layout did not ask for; and, with cp and without ep, every activation led by the batch is split on
    it there (each rank its own sequences). On tp every op splits its matrices (parameters of two or
    more dims: linear weights, embedding tables), as Megatron-LM runs them: an op holding them whole
    there would make tp a data-parallel axis the layout did not ask for. A node no strategy of which
    does either keeps its strategies. On ep the same as on the data-parallel axes, but for the expert gathers (and the views of the experts' weights
    before them), which split their experts there (`planner/rules/experts.py`). On cp every op's float
    activations stay split (on the sequence, or wherever the ILP finds cheaper: attention's scores by
    its queries), none whole: only what an op reads may be gathered there — an attention's keys and
    values, all of them for each rank's queries: gathered (context parallelism's all-gather design), or
    under `cp_method` ring passed around the cp ring (`planner/rules/context.py`); None: all-gather.
    Gathered, they are gathered where smallest: the ops that only move, repeat or scale them on the way
    to the products (`key_value_feeds`) run whole on cp, so GQA's keys and values cross cp before their
    repeat (n_kv_heads of them, not n_heads)."""
    if layout is None:
        return rules
    layout.check_experts(graph)
    if layout.context_parallel > 1:
        layout.check_context(graph, causal=bool(causal_regions(graph)))
    dp = [a for a, name in enumerate(layout.axis_names) if name in WHOLE_AXES]
    ep = [a for a, name in enumerate(layout.axis_names) if name == "ep"]
    experts = {n for b in find_expert_blocks(graph) for n in expert_weight_nodes(graph, b)} if ep else set()
    tp = [a for a, name in enumerate(layout.axis_names) if name == "tp"]
    cp = [a for a, name in enumerate(layout.axis_names) if name == "cp"]
    batch = graph.dims.get("batch") if graph.dims.get("batch") != graph.dims.get(SEQUENCE_DIM) else None
    # Beside cp, DDP's and FSDP's axes split every activation led by the batch on it: each rank its own
    # sequences (without it a dp × cp × tp mesh's ILP is too large to solve). Not yet on other layouts.
    by_batch = [a for a in dp if layout.axis_names[a] in ("dp_replicate", "dp_shard") and layout.mesh_shape[a] > 1] \
        if batch and cp and not ep else []
    if not dp and not tp:
        return rules
    # A parameter read through a view or cast (Llama exports: W -> Transpose -> MatMul) is a parameter too.
    chains = [(r.nodes[0], r.nodes[-1]) for r in attention_regions(graph).values()] if cp else []
    gathered = key_value_feeds(graph, chains) if cp and cp_method is not CpMethod.RING else frozenset()
    held = {t for t, info in graph.tensors.items() if info.kind is TensorKind.PARAM}
    for node in graph.compute_nodes:
        if node.op_type in ("Transpose", "Cast", "Reshape", "Identity") and node.inputs and node.inputs[0] in held:
            held.update(node.outputs)
    out = RuleSet(rules.mesh)
    for name, ns in rules.by_node.items():
        params = [i for i, t in enumerate(ns.node.inputs) if t in held]
        strategies = ns.strategies
        data = [a for a in dp if a not in ep] if name in experts else dp
        whole = tuple(st for st in strategies if all(
            (spec := st.input_specs[i]) is None or all(isinstance(spec.placements[a], Replicate) for a in data)
            for i in params))
        strategies = whole if whole and params else strategies
        matrices = [i for i in params if len(graph.tensors[ns.node.inputs[i]].shape or ()) >= 2]
        split = tuple(st for st in strategies if all(
            (spec := st.input_specs[i]) is None or all(isinstance(spec.placements[a], Shard) for a in tp)
            for i in matrices))
        strategies = split if split and matrices and tp else strategies
        acts = [t for t in ns.node.outputs if t and t not in held and graph.tensors[t].kind is TensorKind.ACTIVATION
                and graph.tensors[t].is_float]
        # (a feed of the gathered keys and values whole on cp, any other activation split there)
        on_cp = (lambda p, _: isinstance(p, Replicate)) if name in gathered \
            else (lambda p, shape: _split_off_batch(p, shape, batch))
        along = tuple(st for st in strategies if all(
            on_cp(st.output_specs[j].placements[a], graph.tensors[t].shape)
            for j, t in enumerate(ns.node.outputs) if t in acts for a in cp))
        strategies = along if along and acts and cp else strategies
        batched = tuple(st for st in strategies if all(
            _on_batch(st.output_specs[j].placements[a], graph.tensors[t].shape, batch)
            for j, t in enumerate(ns.node.outputs) if t and t not in held for a in by_batch))
        strategies = batched if batched and by_batch else strategies
        out.by_node[name] = replace(ns, strategies=strategies)
    ring = context_parallel({n: ns.strategies for n, ns in out.by_node.items()}, graph, rules.mesh,
                            cp_method or CpMethod.ALLGATHER, chains)
    for name, strategies in ring.items():
        out.by_node[name] = replace(out.by_node[name], strategies=strategies)
    return out


def _on_batch(p: Placement, shape: tuple[int, ...], batch: int | None) -> bool:
    """A data-parallel axis' placement of an activation led by the batch (dim 0 a multiple of it: the
    batch, or the batch merged with the tokens): split there, as each rank holds its own sequences;
    partial (a sum over the batch, the loss's). An activation not so led: any placement."""
    if batch is None or not shape or shape[0] % batch or shape[0] < batch:
        return True
    return p == Shard(0) or isinstance(p, Partial)


def _split_off_batch(p: Placement, shape: tuple[int, ...], batch: int | None) -> bool:
    """A context-parallel axis' placement of an activation: split, and not on its batch (a leading dim
    of the batch's size: that would be data parallelism the layout gave dp_shard)."""
    if isinstance(p, Shard):
        return not (p.dim == 0 and batch is not None and bool(shape) and shape[0] == batch)
    return isinstance(p, Partial)


def sharding_ilp(req: PlanRequest, graph: OpGraph, rules: RuleSet, cm: CostModel, mesh: DeviceMesh,
                 layout: Layout | None, *, pins: Mapping[str, Spec], memory_limit_bytes: float | None,
                 time_limit_s: float | None = None, cutoff_s: float | None = None, **shape: Any) -> ShardingILP:
    """The ILP as the request asks for it: its solver and limits, the parameter placements its layout
    (and ZeRO-3) allow — exactly those where the user gave a layout or a ZeRO stage —, the ZeRO stages
    it allows; `cutoff_s`: an objective a plan must beat; `shape`: the search's own (pipeline stages,
    recomputation counts, parameters held at stage 0)."""
    return ShardingILP(graph, rules, cm, memory_limit_bytes=memory_limit_bytes, pins=pins, follow=req.follow,
                       options=SolverOptions(time_limit_s=time_limit_s or req.time_limit_s, backend=req.solver,
                                             num_workers=req.workers, cutoff_s=cutoff_s),
                       param_layout=param_layout_for(req, layout, graph, mesh), zero_stages=req.zero_options(),
                       shard_freely=req.layout is None and req.zero_stage is None,
                       offload=req.offload, offload_activations=req.offload_activations, **shape)
