"""`meshplan plan`: from a model, a profile and N devices to a strategy file.

Modes (MindSpore's parallel_mode / search_mode):
  auto           the ILP over every op's strategies (default)
  semi           the user's pins (`--pin TENSOR=PLACEMENTS`, the seed's shard_tensor) are honoured and
                 the rest is decided: by the ILP with the pins fixed (`--search ilp`, default), or by
                 propagation (`--search propagation`): in topological order each op takes the
                 cheapest strategy given where its inputs already are — fast, no ILP
  data-parallel  every input split on its batch dim over all mesh axes, parameters replicated,
                 gradients all-reduced; the rest propagated
  stand-alone    one device, everything replicated
Without `--mesh`, every factorisation of N whose inner axis stays inside a node is planned and the
best kept; the candidates are reported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import TypeVar

from core.errors import DimBindingError, MeshplanError
from core.experts import find_expert_blocks
from core.graph import SEQUENCE_DIM, OpGraph
from core.layout import Layout
from core.levers import ActivationOffload, CpMethod, Mode, Offload, Recompute, Search
from core.mesh import DeviceMesh
from core.placement import OpStrategy, Spec
from costmodel.compose import StepCost
from costmodel.memory import PRECISIONS, Precision
from costmodel.step import CostModel
from hwprofiles.files import load_profile
from hwprofiles.profile import HardwareProfile
from planner.rules import RuleSet, rules_for_graph
from planner.search.baselines import replicated_plan
from planner.search.build import (
    as_written,
    batch_of,
    build_strategy,
    cost_model_for,
    graph_for,
    plan_settings,
    profile_source,
    sharding_ilp,
    sharing,
    training_settings,
)
from planner.search.dataset import check_splits, parse_dataset_strategy, split_pins
from planner.search.decisions import CUTOFF_MARGIN, MemoryFloorError, NotBetterError, PinError
from planner.search.incumbents import (
    HandLayout,
    against_hand_layouts,
    fastest_fitting,
    incumbents,
    one_axis,
    planned,
)
from planner.search.offload import host_size
from planner.search.pipeline import candidates as pipeline_candidates
from planner.search.pipeline import interleaved, plan_pipelined
from planner.search.propagate import data_parallel_pins, propagate, resolve_pins
from planner.search.request import (
    FUSION_CANDIDATES,
    Candidate,
    PlanRequest,
    Progress,
    expert_mesh_candidates,
    mesh_candidates,
)
from planner.strategy import (
    CandidateRecord,
    ProfileRef,
    SolverStats,
    Strategy,
)

_T = TypeVar("_T")


def make_plan(req: PlanRequest, progress: Progress | None = None) -> tuple[Strategy, list[Candidate]]:
    """The best plan for the request: without recomputation at the fewest micro-steps that fit, and
    (under --recompute auto) with the layers the ILP chooses to recompute (without an ILP: every layer)
    at fewer micro-steps while that is faster; without --mesh, over mesh shapes; never slower than a
    hand layout that fits (`incumbents.py`)."""
    with sharing():
        if req.layout is not None and req.layout.context_parallel > 1 and req.cp_method in (None, CpMethod.AUTO):
            # context parallelism's two designs, each planned; the faster of those that fit (a layout is
            # priced fitting or not), else the faster
            plans, errors = [], []
            for m in (CpMethod.ALLGATHER, CpMethod.RING):
                try:
                    plans.append(_make_plan(replace(req, cp_method=m), progress))
                except PinError:
                    raise
                except MeshplanError as e:  # (the other design may fit)
                    errors.append(e)
            if not plans:
                raise errors[0]
            return _fastest(plans, _memory_limit(req, load_profile(req.profile)))
        return _make_plan(req, progress)


def _make_plan(req: PlanRequest, progress: Progress | None = None) -> tuple[Strategy, list[Candidate]]:
    say = progress or (lambda _msg: None)
    profile = load_profile(req.profile)
    if (req.offload is not Offload.NONE or req.offload_activations is not ActivationOffload.NONE) and profile.host is None:
        raise MeshplanError(f"`offload` {req.offload if req.offload is not Offload.NONE else 'activations'}: profile {profile.name} has no `host` block (the host link's copy "
                            "bandwidth and the host's optimizer step); use a profile with one or `offload` none")
    req = req.for_profile(profile.device.is_gpu)
    assert req.dtype is not None
    precision = PRECISIONS[req.dtype]
    policies = req.recompute_candidates(profile.devices_per_node)
    traced, graphs = _traced(req)
    steps = [req.static_steps(batch_of(traced) or 1)] if traced is not None else req.step_candidates()
    if traced is not None:
        graphs[steps[0]] = traced
    failures: list[MeshplanError] = []
    found: list[tuple[int, tuple[Strategy, list[Candidate]]]] = []
    limit = _memory_limit(req, profile)
    job = _hand_layouts(req, profile)
    early: list[tuple[HandLayout, Strategy | str]] = []  # DDP and FSDP, planned before the pipelines' search
    incumbent: Strategy | None = None  # the fastest of them that fits: what every later plan must beat
    settled: list[int] = []  # micro-step counts whose plans (without recomputation) are all slower than one held

    floors: dict[Recompute, tuple[int, MemoryFloorError]] = {}  # per policy, the most micro-steps whose floor failed

    def attempt(k: int, recompute: Recompute) -> tuple[Strategy, list[Candidate]] | None:
        if recompute in floors and k != steps[-1]:  # more micro-steps than a count whose memory floor failed:
            # skipped, not imported, where that floor says they cannot fit either (the last count is tried)
            k0, floor = floors[recompute]
            if k0 < k and not floor.may_fit(k0 / k, limit):
                failures.append(floor)
                return None
        if k not in graphs:
            dims = req.dims_for(k)
            say("importing the model" + (f" (batch {dims['batch']} per micro-step, {k} micro-steps)" if k > 1 else ""))
            try:
                graphs[k] = graph_for(req.model, dims)
            except DimBindingError as e:
                if req.global_batch_size is None or "batch" not in e.unknown:
                    raise
                raise DimBindingError(f"`global_batch_size` binds the model's dim 'batch' per micro-step: {e}") from e
        held = [f[1][0] for f in found] + ([incumbent] if incumbent is not None else [])
        try:
            plan = _plan_meshes(req, graphs[k], profile, precision, k, recompute, say,
                                cutoff_s=min((_incumbent_s(s) for s in held), default=None))
        except PinError:
            raise
        except MeshplanError as e:  # out of memory
            if len(steps) * len(policies) == 1:
                raise
            failures.append(e)
            if isinstance(e, NotBetterError) and not e.memory and recompute is policies[0]:
                settled.append(k)
            if isinstance(e, MemoryFloorError):
                floors[recompute] = (k, e)
            return None
        found.append((k, plan))
        return plan

    # The pipelines' search runs beside the rest (another process, forked: the machine's second core);
    # it needs only the layer count, known once the model is imported.
    Beside = tuple[list[tuple[int, tuple[Strategy, list[Candidate]]]], list[tuple[HandLayout, Strategy | str]]]
    pipelines: Callable[[], Beside] | None = None
    tried = 0
    every = partial(job, which=lambda _: True) if job is not None else None
    hands = None if every is None else _beside(every, say) if not req.searches_pipelines() else partial(every, say)
    if req.searches_pipelines() and traced is None:  # a static batch is one micro-batch: no other to try
        attempt(steps[0], policies[0])
        tried = 1
        if job is not None:  # DDP and FSDP first (small ILPs): the step every later plan must beat, the
            # pipelines' candidates too (a hand layout as the search's incumbent: CBC takes no start solution)
            early = planned(partial(job, say, which=one_axis), say)
            incumbent = fastest_fitting(early, limit)
        layers = max((g.num_layers for g in graphs[steps[0]].layers), default=0)
        later = None if job is None else partial(job, which=lambda h: not one_axis(h))
        cutoff = _incumbent_s(incumbent) if incumbent is not None else None

        def beside(said: Progress) -> Beside:  # the pipelines, then the other hand layouts, on the other core
            piped = _pipelines(req, profile, precision, layers, said, cutoff_s=cutoff)
            return piped, planned(partial(later, said) if later is not None else None, said)

        pipelines, hands = _beside(beside, say), None
    if req.must_fit:  # a hand layout as practitioners size it: the fewest micro-steps at which it fits
        # without recomputation, or else with every layer recomputed (two solves a count, not a walk)
        for k in steps:
            if any(attempt(k, policy) is not None for policy in policies):
                break
        policies = policies[:1]
    # Without recomputation (or with the policy asked for) at the fewest micro-steps that fit: more
    # micro-steps only add per-micro-step costs.
    for k in steps[tried:] if not found else []:
        if attempt(k, policies[0]) is not None or settled:
            break  # (or its plans are all slower than one held: more micro-steps only add to them)
    over = all(f[1][0].cost.memory_bytes_per_device > limit for f in found)
    if len(policies) > 1 and found and (over or req.offload is not Offload.NONE
                                        or req.offload_activations is not ActivationOffload.NONE):
        # Recomputation at the same micro-steps: where a layout priced as written does not fit without it
        # (the layers the ILP chooses; in a pipeline's stages, every layer), and where offload made the plan
        # without it fit (recomputing keeps more states on the device instead: the host's optimizer step
        # and copies against a forward again)
        attempt(min(k0 for k0, _ in found), policies[1])
    # Under --recompute auto: with the layers the ILP recomputes at fewer micro-steps (larger
    # micro-batches). The step against the micro-steps is taken as unimodal: fewer add recomputation,
    # more add per-micro-step work. First the fewest micro-steps: if that beats the plan without
    # recomputation, more of them while each is faster; else from the most (below the plan without
    # recomputation) down while each is faster.
    if len(policies) > 1:
        fewest = min([k0 for k0, _ in found] + settled, default=steps[-1] + 1)
        below = [k for k in steps if k < fewest]

        def walk(order: list[int]) -> None:  # more micro-steps while each is faster
            for k in order:
                best = min((f[1][0].step_time_s for f in found), default=math.inf)
                plan = attempt(k, policies[1])
                if plan is None or plan[0].step_time_s >= best:
                    break

        def down(order: list[int]) -> None:  # fewer micro-steps until none fits: recomputing the layers
            # costs a forward at any count, which fewer micro-steps may win back (fewer per-micro-step
            # gathers and all-to-alls) only below the first count that fits
            for k in order:
                if attempt(k, policies[1]) is None and not (isinstance(failures[-1], NotBetterError)
                                                            and not failures[-1].memory):
                    break  # fewer micro-steps need more memory: none fits (or none faster fits)

        if below:
            before = min((f[1][0].step_time_s for f in found), default=math.inf)
            plan = attempt(below[0], policies[1])
            if plan is not None and plan[0].step_time_s < before:
                walk(below[1:])
            else:
                down(below[:0:-1])
    try:
        hand_plans = early + planned(hands, say)
    finally:  # the pipelines' process waited for, whatever the hand layouts raise
        piped, more = pipelines() if pipelines is not None else ([], [])
    found += piped
    hand_plans += more
    if not found:
        if not any(not isinstance(s, str) and s.cost.memory_bytes_per_device <= limit for _, s in hand_plans):
            raise MeshplanError(f"no accumulation step count or recomputation fits: with {steps[-1]} micro-steps and "
                                f"recomputation {policies[-1]}, {failures[-1]}")
        return against_hand_layouts(None, hand_plans, limit), []
    best = _fastest([plan for _, plan in found], limit)
    if job is None:
        return best
    chosen = against_hand_layouts(best[0], hand_plans, limit)
    return chosen, best[1] if chosen.training.layout == best[0].training.layout else []


def _hand_layouts(req: PlanRequest, profile: HardwareProfile,
                  ) -> Callable[..., list[tuple[HandLayout, Strategy | str]]] | None:
    """How to plan the hand layouts (those `which` keeps) to check the search's plan against
    (`incumbents.py`); None where the request leaves the planner no freedom to compare (a layout, pins, a
    mode other than auto, one device) or MESHPLAN_HAND_LAYOUTS=0 says to skip them (faster; no
    never-worse check)."""
    if req.layout is not None or req.mode is not Mode.AUTO or not req.decides or req.pins or req.devices == 1 \
            or os.environ.get("MESHPLAN_HAND_LAYOUTS") == "0":
        return None

    def job(_say: Progress, which: Callable[[HandLayout], bool]) -> list[tuple[HandLayout, Strategy | str]]:
        try:
            graph = graph_for(req.model, req.dims_for(req.step_candidates()[0]))
        except DimBindingError:  # a static export: its batch is its own
            graph = graph_for(req.model, req.dims)
        blocks = find_expert_blocks(graph)
        return incumbents(req, profile.devices_per_node, lambda r: make_plan(r)[0], num_params=graph.num_params,
                          precision=PRECISIONS[req.dtype or "fp32"], limit=_memory_limit(req, profile),
                          sequence=graph.dims.get(SEQUENCE_DIM) if graph.sequence_dims() else None,
                          experts=math.gcd(*(b.num_experts for b in blocks)) if blocks else None,
                          layers=max((g.num_layers for g in graph.layers), default=0) if req.searches_pipelines() else None,
                          which=which)

    return job


def _traced(req: PlanRequest) -> tuple[OpGraph | None, dict[int, OpGraph]]:
    """Whether the model's batch is static (a default export, traced at one micro-step's batch) where
    the request runs micro-steps or pipeline micro-batches: the model imported at its traced batch, or
    None where the batch is a symbolic dim bound per micro-step (with the import of the first
    candidate's, when that told)."""
    pipelined = req.layout is not None and req.layout.pipeline > 1
    if "batch" in req.dims or (req.global_batch_size is None and not req.accumulation_steps and not pipelined):
        return None, {}
    if req.global_batch_size is not None:  # the usual case, a symbolic batch: no import beyond the first one
        k = req.step_candidates()[0]
        try:
            return None, {k: graph_for(req.model, req.dims_for(k))}
        except DimBindingError as e:
            if "batch" not in e.unknown:
                raise
        return graph_for(req.model, req.dims), {}
    try:
        return graph_for(req.model, req.dims), {}
    except DimBindingError as e:
        if "batch" not in e.unbound:
            raise
        what = "a pipeline runs micro-batches" if pipelined else f"`accumulation_steps` {req.accumulation_steps} runs micro-steps"
        raise DimBindingError(f"{what} of a global batch, and the model's batch is a symbolic dim: give "
                              "`global_batch_size` (the batch per optimizer step, bound per micro-step)",
                              unbound=("batch",)) from None


def _multi_node_search(req: PlanRequest, profile: HardwareProfile) -> bool:
    """With pipelines in the search, the plans without them keep Megatron's shape: tensor parallelism
    over a node, data parallelism across nodes (one mesh instead of every factorisation)."""
    return (req.searches_pipelines() and req.devices > profile.devices_per_node
            and req.devices % profile.devices_per_node == 0)


def _pipelines(req: PlanRequest, profile: HardwareProfile, precision: Precision, layers: int,
               say: Progress, *, cutoff_s: float | None = None) -> list[tuple[int, tuple[Strategy, list[Candidate]]]]:
    """The planner's pipeline candidates (`planner/search/pipeline.py`) for a model of `layers` repeated layers,
    each with one sequence per data-parallel rank per micro-batch, without recomputation or else with
    every layer recomputed; those that fit. `cutoff_s`: the step of a plan already held (a hand layout),
    which a candidate must beat."""
    assert req.global_batch_size is not None
    limit = _memory_limit(req, profile)
    out: list[tuple[int, tuple[Strategy, list[Candidate]]]] = []
    graphs: dict[int, OpGraph] = {}

    def attempt(layout: Layout) -> tuple[int, tuple[Strategy, list[Candidate]]] | None:
        dp = layout.data_parallel
        if req.global_batch_size is None or req.global_batch_size % dp:
            return None
        k = req.global_batch_size // dp
        if layout.virtual > 1 and k % layout.pipeline:
            return None  # interleaved 1F1B runs micro-batches in rounds of p
        if dp not in graphs:
            graphs[dp] = graph_for(req.model, {**req.dims, "batch": dp})
        for recompute in (Recompute.NONE, Recompute.FULL):
            try:
                return k, plan_pipelined(req, graphs[dp], profile, precision, k, recompute, layout, limit, say,
                                         enforce_limit=True, cutoff_s=cutoff_s)
            except NotBetterError as e:
                if not e.memory:  # its plans are all slower than the one held (recomputing adds to them)
                    raise
            except MeshplanError:  # (a pin error included: a candidate the model's rules cannot hold)
                continue
        return None

    # Deeper pipelines hold less per device and idle more: from shallow to deep, until one that fits is
    # slower than the one before it, or than the plan held; then the best with 2 interleaved chunks per stage.
    best: tuple[float, Layout] | None = None
    for layout in pipeline_candidates(req.devices, profile.devices_per_node, layers):
        try:
            found = attempt(layout)
        except NotBetterError:
            break
        if found is None:
            continue
        out.append(found)
        t = found[1][0].step_time_s
        if best is not None and t > best[0]:
            break
        best = (t, layout) if best is None or t < best[0] else best
    if best is not None and (chunked := interleaved(best[1], layers)) is not None:
        try:
            found = attempt(chunked)
        except NotBetterError:
            found = None
        if found is not None:
            out.append(found)
    return out


def _beside(job: Callable[[Progress], _T], say: Progress) -> Callable[[], _T]:
    """Start `job` in a forked process where the machine has a core to spare (it inherits everything
    loaded; only its result travels back, pickled); the returned call waits for that result. Where
    there is no spare core or no fork, the call runs `job` here."""
    import multiprocessing as mp
    import os

    if (os.cpu_count() or 1) < 2 or "fork" not in mp.get_all_start_methods():
        return lambda: job(say)
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            send.send(("ok", job(lambda _msg: None)))  # its progress is not shown: the console is the parent's
        except BaseException as e:
            send.send(("error", e))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()

    def result() -> _T:
        try:
            kind, value = receive.recv()
        except EOFError:
            raise MeshplanError(f"the pipeline search's process ended without a result (exit code {proc.exitcode})") \
                from None
        finally:
            proc.join()
        if kind == "error":
            raise value
        out: _T = value
        return out
    return result


def _fastest(plans: list[tuple[Strategy, list[Candidate]]], limit: float) -> tuple[Strategy, list[Candidate]]:
    """The fastest of the plans that fit `limit` (bytes a device), else of all (a layout is priced fitting
    or not)."""
    fitting = [p for p in plans if p[0].cost.memory_bytes_per_device <= limit]
    return min(fitting or plans, key=lambda p: p[0].step_time_s)


def _memory_limit(req: PlanRequest, profile: HardwareProfile) -> float:
    """--memory-limit in bytes; by default 90% of the device's capacity."""
    return req.memory_limit_gib * 2**30 if req.memory_limit_gib is not None else 0.9 * profile.device.mem_capacity_bytes


def _incumbent_s(plan: Strategy) -> float:
    """What a later ILP must beat: the plan's step, or its ILP objective where pricing came out lower
    (bucketed ZeRO stages, fusion, a simpler plan of the same price: `_plan_meshes`)."""
    return max(plan.step_time_s, plan.solver.objective)


def _plan_meshes(req: PlanRequest, graph: OpGraph, profile: HardwareProfile, precision: Precision, steps: int,
                 recompute: Recompute, say: Progress, *,
                 cutoff_s: float | None = None) -> tuple[Strategy, list[Candidate]]:
    """The best plan over the candidate meshes at `steps` micro-steps under `recompute`. `cutoff_s`: the
    step of a plan already found; each mesh's ILP (and each after the best so far) must then beat it by
    the objective's own measure, with `CUTOFF_MARGIN` for what the objective prices otherwise than the
    composer (redistributes priced per edge, the overlap's lower bound). None beating it: NotBetterError."""
    devices = 1 if req.mode is Mode.STAND_ALONE else req.devices
    layout = req.layout
    limit = _memory_limit(req, profile)
    if layout is not None and layout.pipeline > 1:
        return plan_pipelined(req, graph, profile, precision, steps, recompute, layout, limit, say,
                              enforce_limit=req.must_fit)
    # A layout is solved with its memory rows soft (`ShardingILP(memory_soft=True)`): where its degrees
    # leave placements open (inside tp), the plan that fits, else the one over by the least — never a
    # proof of infeasibility (minutes of MIP on hundreds of devices). A user's is priced fitting or not
    # (the table says which), the planner's hand layouts must fit as priced.
    priced_as_is = layout is not None and not req.must_fit
    shapes: list[tuple[int, ...]] = [layout.mesh_shape] if layout is not None else \
        [req.mesh_shape] if req.mesh_shape and req.mode is not Mode.STAND_ALONE else \
        [(1,)] if req.mode is Mode.STAND_ALONE else \
        [(devices // profile.devices_per_node, profile.devices_per_node)] if _multi_node_search(req, profile) else \
        mesh_candidates(devices, profile.devices_per_node)
    named: list[tuple[tuple[int, ...], tuple[str, ...] | None]] = [
        (shape, layout.axis_names if layout is not None else req.axis_names if req.mesh_shape else None)
        for shape in shapes]
    blocks = find_expert_blocks(graph)
    if blocks and layout is None and not req.mesh_shape and req.mode is Mode.AUTO and devices > 1:
        # mixtures of experts: each mesh again with an expert-parallel axis (`planner/rules/experts.py`)
        bases = shapes if (devices,) in shapes else [*shapes, (devices,)]  # (and ep beside tp=1 across nodes)
        named += expert_mesh_candidates(bases, math.gcd(*(b.num_experts for b in blocks)), profile.devices_per_node)
    best: tuple[float, DeviceMesh, RuleSet, CostModel, dict[str, OpStrategy], StepCost, SolverStats,
                dict[str, int]] | None = None
    candidates: list[Candidate] = []
    errors: list[MeshplanError] = []
    for shape, names in named:
        mesh = DeviceMesh.build(devices, shape, names, devices_per_node=profile.devices_per_node)
        say(f"mesh {mesh}: rules")
        rules = as_written(rules_for_graph(graph, mesh, strict=req.strict), graph, layout, req.cp_method)
        model = partial(cost_model_for, req, graph, mesh, profile, precision, steps)
        # The ILP decides the count of recomputed layers per group (auto), or holds it (--recompute-layers).
        counted = graph.layers and req.decides and (recompute is Recompute.AUTO or req.recompute_layers is not None)
        cm = model(Recompute.NONE if counted or recompute is Recompute.AUTO else recompute)
        recomputed = {g.prefix: g.num_layers for g in graph.layers} if recompute is Recompute.FULL else {}
        pins = resolve_pins(graph, mesh, req.pins)
        splits = parse_dataset_strategy(req.dataset_strategy)
        if isinstance(splits, tuple):  # the inputs placed as the dataset splits them
            check_splits(splits, graph)
            pins = {**resolve_pins(graph, mesh, split_pins(splits, graph, mesh)), **pins}
        if req.mode is Mode.DATA_PARALLEL:
            pins = {**data_parallel_pins(graph, mesh), **pins}
        if layout is not None:
            pins = {**layout.input_pins(graph, mesh), **pins}
        try:
            if req.decides:
                say(f"mesh {mesh}: solving")
                # A hand layout is priced as it is, fitting or not (the table says which).
                no_zero: frozenset[str] = frozenset()
                base = cm
                while True:  # ZeRO-1/2 shards a parameter's states only where its gradient is reduced where
                    # stored: where a parameter the solver sharded is not, and the plan does not fit without
                    # its saving, it is held at stage 0 and the ILP solved again
                    bound = min((c for c in (cutoff_s, max(best[0], best[6].objective) if best else None)
                                 if c is not None), default=None)
                    ilp = sharding_ilp(req, graph, rules, base, mesh, layout, pins=pins,
                                       cutoff_s=bound * (1 + CUTOFF_MARGIN) if bound is not None and layout is None
                                       else None,
                                       memory_limit_bytes=limit, memory_soft=layout is not None, no_zero=no_zero,
                                       floor_limit_bytes=limit if req.must_fit else None,
                                       recompute_model=model(Recompute.FULL) if counted else None,
                                       recompute_layers=req.recompute_layers)
                    sol = ilp.solve()
                    choice, param_specs, stats = sol.choice, sol.param_specs, sol.stats
                    if sol.recompute:  # priced with the layers the solver recomputes
                        cm, recomputed = model(Recompute.FULL, sol.recompute), sol.recompute
                    else:
                        cm, recomputed = base, {} if counted else recomputed
                    if sol.offload or sol.activations:  # priced with what the solver offloads where it put it
                        cm = cm.offloaded(sol.offload, sol.activations)
                    cost = cm.price(choice, param_specs, zero=sol.zero)
                    unsharded = {ilp.param_rep[p] for p in sol.zero if p not in cost.priced.zero_stages}
                    if not unsharded or cost.memory_bytes <= limit or priced_as_is:
                        break  # priced as it runs (those parameters at stage 0), and it fits
                    no_zero |= unsharded
                if req.zero_stage is None:  # the solver prices each gradient alone; bucketed, one stage for
                    # all on the same placements can come out faster
                    cost = _best_uniform_zero(cm, choice, param_specs, req.zero_options(), limit, cost)
                if layout is None and req.zero_stage != 3 and not sol.recompute:
                    choice, param_specs, cost = _or_simpler(req, graph, rules, cm, pins, limit, choice, param_specs,
                                                            cost)
            else:
                say(f"mesh {mesh}: propagating")
                choice, param_specs, stats = propagate(graph, rules, cm, pins)
                if req.offload is not Offload.NONE:  # held for every parameter (auto needs the ILP: refused)
                    cm = cm.offloaded(dict.fromkeys(cm.param_owner, req.offload))
                cost = _best_uniform_zero(cm, choice, param_specs, req.zero_options(), limit)
            if req.fusion is None:
                cost = _best_fusion(cm, cost)
            if cost.memory_bytes > limit and not priced_as_is:  # the solver's memory row is its own estimate:
                # a plan priced over the limit is refused, never returned
                raise MeshplanError(f"memory: the {req.mode} plan needs {cost.memory_bytes / 2**30:.2f} GiB per device "
                                    f"but `memory_limit_gib` is {limit / 2**30:.2f} GiB; raise `memory_limit_gib`, add devices, "
                                    "or use more micro-steps or recomputation" +
                                    (" or `mode` auto" if req.mode is not Mode.AUTO else ""))
            share = cm.profile.host_memory_per_device
            on_host = sum(cost.priced.host_memory.values())
            if share is not None and on_host > share and not priced_as_is:  # (the ILP's row: its own estimate;
                # propagation and the re-pricings after it have none)
                raise MeshplanError(f"host memory: the {req.mode} plan keeps {host_size(on_host)} per device on the "
                                    f"host but the profile's host holds {host_size(share)} per device "
                                    f"(host.node_memory_bytes over {cm.profile.devices_per_node} devices); offload "
                                    "less (`offload` auto) or add devices")
        except PinError:
            raise
        except MeshplanError as e:
            if len(named) == 1:
                raise
            errors.append(e)
            candidates.append(Candidate(mesh=mesh, cost=None, stats=None, error=str(e)))
            continue
        candidates.append(Candidate(mesh=mesh, cost=cost, stats=stats))
        if best is None or cost.step_time_s < best[0]:
            best = (cost.step_time_s, mesh, rules, cm, choice, cost, stats, recomputed)
    if best is None:  # (a mesh that fits but beats no plan the search holds says so first)
        beaten = [e for e in errors if isinstance(e, NotBetterError)]
        if all(isinstance(e, MemoryFloorError) for e in errors):  # every mesh's floor, for the counts after
            raise MemoryFloorError(str(errors[0]), parts=tuple(p for e in errors for p in e.parts))  # type: ignore[attr-defined]
        raise next((e for e in beaten if not e.memory), beaten[0] if beaten else errors[0])
    _, mesh, rules, cm, choice, cost, stats, recomputed = best
    settings = plan_settings(req, graph, search=req.search if req.mode in (Mode.AUTO, Mode.SEMI) else Search.PROPAGATION,
                             dtype=precision.name, limit=limit, loss=cm.loss)
    records = tuple(
        CandidateRecord(mesh=c.mesh.shape, axis_names=c.mesh.axis_names,
                        step_time_s=c.cost.step_time_s if c.cost else None,
                        memory_bytes_per_device=c.cost.memory_bytes if c.cost else None,
                        solver_status=c.stats.status if c.stats else None, error=c.error)
        for c in candidates)
    dp = cost.placed[graph.inputs[0]].num_shards(0, mesh.shape) if graph.inputs and graph.inputs[0] in cost.placed else 1
    training = training_settings(
        req, graph, steps, cost.priced, data_parallel=dp, layout=layout, recompute_layers=recomputed,
        recompute={g: Recompute.FULL for g in recomputed} if recomputed else
        {group.prefix: recompute for group in graph.layers} if recompute is Recompute.SELECTIVE else {})
    ref = ProfileRef(name=profile.name, digest=profile.digest, source=profile_source(req.profile))
    strategy = build_strategy(graph, req.model, ref, mesh, rules, choice, cost, stats, settings, records, training)
    return strategy, candidates


def _or_simpler(req: PlanRequest, graph: OpGraph, rules: RuleSet, cm: CostModel, pins: Mapping[str, Spec],
                limit: float, choice: dict[str, OpStrategy], param_specs: dict[str, Spec],
                cost: StepCost) -> tuple[dict[str, OpStrategy], dict[str, Spec], StepCost]:
    """The solver's plan, or a simpler one where that composes faster and fits: the replicated plan (the
    solver's hint; without pins), or with pins what propagation makes of them. The solver's objective
    is not the composed step (edges priced alone; under overlap a lower bound,
    `ShardingILP.add_overlap`), so a plan it prefers by a hair can compose slower than these."""
    options = [(choice, param_specs, cost)]
    if not pins:
        rep_choice, rep_params = replicated_plan(graph, rules.mesh)
        options.append((rep_choice, rep_params, cm.price(rep_choice, rep_params)))
    if pins:  # semi mode: what propagation guesses around the pins (it prices every strategy of every
        # node: seconds on a large model, so only where the user pinned)
        try:
            prop_choice, prop_params, _ = propagate(graph, rules, cm, pins)
        except MeshplanError:  # pins propagation cannot honour (the ILP can: around them)
            pass
        else:
            options.append((prop_choice, prop_params, _best_uniform_zero(cm, prop_choice, prop_params,
                                                                         req.zero_options(), limit)))
    fitting = [o for o in options if o[2].memory_bytes <= limit] or options[:1]
    return min(fitting, key=lambda o: o[2].step_time_s)


def _best_uniform_zero(cm: CostModel, choice: Mapping[str, OpStrategy], param_specs: Mapping[str, Spec],
                       stages: tuple[int, ...], limit: float, found: StepCost | None = None) -> StepCost:
    """Every parameter at one ZeRO stage (a propagated plan has no ILP to choose per parameter), the
    fastest that fits, or `found` (the solver's per-parameter stages) if faster; less memory among
    equals; the smallest if none fits."""
    priced = [cm.price(choice, param_specs, zero=dict.fromkeys(param_specs, s)) for s in stages]
    priced += [found] if found is not None else []
    fitting = [c for c in priced if c.memory_bytes <= limit]
    if not fitting:
        return min(priced, key=lambda c: c.memory_bytes)
    return min(fitting, key=lambda c: (c.step_time_s, c.memory_bytes))


def _best_fusion(cm: CostModel, cost: StepCost) -> StepCost:
    """`--comm-fusion auto`: per fused kind in turn, the bucket cap among FUSION_CANDIDATES that makes
    the step fastest (the larger among equals: fewer collectives), the plan's items priced once."""
    best = cost
    for kind in ("allreduce", "reducescatter", "allgather"):
        for size in FUSION_CANDIDATES:
            fusion = replace(best.priced.fusion, **{kind: size})
            trial = cm.rebucket(best.priced, fusion)
            if trial.step_time_s <= best.step_time_s:
                best = trial
    return best


# ---------------------------------------------------------------------------------------------------
# The strategy


