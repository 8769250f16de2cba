"""The hand layouts practitioners write, priced by the plan's own cost model: what `explain` sets
beside a plan. A plan's search reaches every one of them, so the plan is never slower than one that
fits in memory."""

from __future__ import annotations

from dataclasses import replace

from core.errors import MeshplanError
from core.graph import OpGraph
from core.layout import Layout
from core.levers import Mode, Recompute, Search
from core.mesh import DeviceMesh
from core.placement import OpStrategy, Shard, Spec
from costmodel.compose import StepCost
from costmodel.memory import PRECISIONS
from costmodel.step import CostModel
from hwprofiles.files import load_profile
from planner.rules import OpContext, replicated_strategy, rules_for_graph
from planner.search.build import build_strategy
from planner.search.propagate import data_parallel_pins, propagate
from planner.search.solve import ShardingILP
from planner.strategy import PlanSettings, ProfileRef, Strategy


def hand_layouts(graph: OpGraph, mesh: DeviceMesh, cm: CostModel) -> dict[str, StepCost | str]:
    """The hand layouts practitioners start from, on the plan's mesh and training step (micro-steps,
    ZeRO stage): replicated; DDP (batch split over every axis, parameters whole); FSDP (parameters
    split on dim 0 over every axis, gathered for use); on a 2-d mesh FSDP + TP (FSDP over the first
    axis, the second tensor-parallel as the ILP decides: Megatron's column/row split where it pays);
    and each of the last three with full recomputation of the repeated layers."""
    rules = rules_for_graph(graph, mesh)
    out: dict[str, StepCost | str] = {}
    out["replicated"] = cm.price(*replicated_plan(graph, mesh))
    try:
        pins = data_parallel_pins(graph, mesh)
    except MeshplanError as e:  # a batch smaller than the mesh
        note = reason(e)
        pins = None
        out["data-parallel"] = out["fsdp"] = note
    plans: dict[str, tuple[dict[str, OpStrategy], dict[str, Spec]]] = {}
    if pins is not None:
        choice, params, _ = propagate(graph, rules, cm, pins)
        plans["data-parallel"] = (choice, params)
        plans["fsdp"] = (choice, {p.name: Spec((Shard(0),) * mesh.ndim) if p.shape and p.shape[0] >= mesh.num_devices
                                  else Spec.replicated(mesh.ndim) for p in graph.params})
    if mesh.ndim == 2:
        layout = Layout((("dp_shard", mesh.shape[0]), ("tp", mesh.shape[1])))
        named = replace(mesh, axis_names=layout.axis_names)
        try:
            sol = ShardingILP(graph, rules, cm, pins=layout.input_pins(graph, named),
                              param_layout=layout.param_layout(graph, named), shard_freely=False).solve()
            plans["fsdp+tp"] = (sol.choice, sol.param_specs)
        except MeshplanError as e:
            out["fsdp+tp"] = reason(e)
    full = None
    if graph.layers and cm.recompute is not Recompute.FULL:
        full = CostModel(graph, mesh, cm.profile, cm.precision, loss=cm.loss, micro_batches=cm.micro_batches,
                         zero_stage=cm.zero_stage, recompute=Recompute.FULL, composer=cm.composer,
                         fusion=cm.fusion, zero_threshold_bytes=cm.zero_threshold_bytes,
                         fp32_communication=cm.fp32_communication, zero_shard_size=cm.zero_shard_size,
                         attention=cm.attention, attention_dropout=cm.attention_dropout, runtime=cm.runtime,
                         capacity_factor=cm.capacity_factor)
    for name, (choice, params) in plans.items():
        out[name] = cm.price(choice, params)
        if full is not None:
            out[f"{name} + full recompute"] = full.price(choice, params)
    return out


def replicated_plan(graph: OpGraph, mesh: DeviceMesh) -> tuple[dict[str, OpStrategy], dict[str, Spec]]:
    """Every op and parameter whole on every rank."""
    return ({n.name: replicated_strategy(OpContext.of(n, graph), mesh.ndim) for n in graph.compute_nodes},
            {p.name: Spec.replicated(mesh.ndim) for p in graph.params})


def reason(e: MeshplanError) -> str:
    """Why a baseline cannot be priced, for its table cell: the error's message without the option
    that caused it or the advice after it."""
    return str(e).split(": ", 1)[-1].split(";")[0]


def data_parallel_strategy(graph: OpGraph, n: int) -> Strategy:
    """`graph` data-parallel over n ranks, built directly: the batch split, parameters replicated, every
    op propagated to its cheapest strategy around them (what `plan --mode data-parallel` writes)."""
    profile = load_profile("cpu")
    mesh = DeviceMesh.build(n, (n,))
    rules = rules_for_graph(graph, mesh)
    cm = CostModel(graph, mesh, profile, PRECISIONS["fp32"])
    choice, params, stats = propagate(graph, rules, cm, data_parallel_pins(graph, mesh))
    settings = PlanSettings(mode=Mode.DATA_PARALLEL, search=Search.PROPAGATION, dtype="fp32", memory_limit_bytes=None,
                            solver="none", follow=False, pins={}, batch=None, loss=cm.loss)
    return build_strategy(graph, "", ProfileRef(name=profile.name, digest=profile.digest, source="cpu"), mesh, rules,
                          choice, cm.price(choice, params), stats, settings)
