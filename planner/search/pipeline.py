"""Pipeline stages: the repeated layers cut into p contiguous stages (v chunks each, interleaved), every
stage on its own sub-mesh of N/p devices with the same intra-stage plan, one ILP deciding it.

The cut: the model's (largest) repeated-layer group is split into p·v chunks of consecutive layers;
chunk c runs on stage c mod p (v = 1: stage c). With v = 1 the layers need not divide evenly: the
extra layers go to the middle stages, the first and last carrying the embedding and the head. Nodes
outside the layers run with the layer before them (the embedding with the first, the head and the loss
with the last).

The ILP (`planner/search/solve.py`) decides the sharding of every node on the sub-mesh, as for one device
group, with one memory row per stage: its nodes' parameters' states, and their saved activations times
the micro-batches the stage holds at once under the schedule (`costmodel/pipeline.py`). Its objective
is the sum of all stages' work, which the pipelined step is proportional to when stages balance; the
plan is then priced per stage: each stage's time per micro-batch (its nodes' forward and backward and
their per-micro-batch collectives) and its sends (the activations that cross into the next stage and
their gradients back), the step as `pipeline_step_s` composes them (the sends where the schedule
waits for them), plus the slowest stage's per-step work (gradient reductions, optimizer).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

from core.collectives import Cadence, Collective, PricedBucket
from core.errors import MeshplanError
from core.graph import OpGraph
from core.layout import Layout
from core.levers import Recompute, Schedule
from core.mesh import DeviceMesh
from costmodel.bucketing import is_bucketed, stage_buckets
from costmodel.comm import collective_time_s
from costmodel.compose import compose
from costmodel.compute import tensor_bytes
from costmodel.device import link_collective_time_s
from costmodel.items import PricedStep
from costmodel.memory import Precision
from costmodel.pipeline import bubble_fraction, in_flight, pipeline_step_s
from costmodel.step import CostModel
from hwprofiles.profile import HardwareProfile
from planner.rules import rules_for_graph
from planner.search import build
from planner.search.decisions import CUTOFF_MARGIN
from planner.search.propagate import resolve_pins
from planner.search.request import Candidate, PlanRequest
from planner.stagecut import Cut, crossings, cut, param_stages
from planner.strategy import CandidateRecord, PredictedCost, ProfileRef, Strategy
from planner.strategy_pipeline import Pipeline, PipelineStage


@dataclass(frozen=True)
class StageCost:
    time_s: float  # per micro-batch: its nodes' forward and backward and their per-micro-batch collectives
    compute_s: float  # per micro-batch
    step_s: float  # per step: reductions once per step and the optimizer
    optimizer_s: float
    memory: dict[str, float]
    in_flight: float
    send_bytes: float  # per micro-batch, forward and backward, to and from the next stage
    send_s: float = 0.0  # their transfer times (`pipeline_step_s` counts them where the schedule waits)
    buckets: tuple[PricedBucket, ...] = ()  # its ranks' packed gradient collectives (in `time_s` or `step_s`)

    @property
    def busy_s(self) -> float:
        """Its time per micro-batch were its sends its own work (the balance of the layers' cut)."""
        return self.time_s + self.send_s


def price_stages(cm: CostModel, priced: PricedStep, graph: OpGraph, the_cut: Cut, full: DeviceMesh, schedule: Schedule,
                 m: int) -> list[StageCost]:
    """Each stage's time per micro-batch, per-step work and memory from the priced items of the whole
    graph on one stage's sub-mesh."""
    p, v = the_cut.stages, the_cut.virtual
    compute = [0.0] * p
    micro = [0.0] * p
    per_step = [0.0] * p
    optimizer = [0.0] * p
    for name, secs in priced.node_compute_s.items():
        compute[the_cut.stage_of(name)] += secs
    holders = param_stages(graph, the_cut.chunk_of, p)
    resharded = {t for t, *_ in priced.reshards}
    for name, events in priced.node_events.items():
        s = the_cut.stage_of(name)
        for e in events:
            if is_bucketed(e, cm.param_owner, resharded):  # packed per stage, below
                continue
            if e.cadence is Cadence.MICRO_BATCH:
                micro[s] += e.time_s
            else:
                per_step[s] += e.time_s
    # Each stage's ranks pack the gradients of the parameters they hold, apart from the other stages'.
    holding = {t: holders.get(t, (the_cut.stage_of(owner),)) for t, owner in cm.param_owner.items()}
    buckets = stage_buckets(priced, holding, p, cm.bucket_time_s)
    for bucket in buckets:
        if bucket.cadence is Cadence.MICRO_BATCH:
            micro[bucket.stage] += bucket.time_s
        else:
            per_step[bucket.stage] += bucket.time_s
    for param, secs in priced.optimizer_s.items():
        for s in holders.get(param, (the_cut.stage_of(cm.param_owner[param]),)):  # a shared one: every copy
            optimizer[s] += secs
    # A parameter several stages read (tied embeddings): each holds a copy, and after backward their
    # gradients are all-reduced between those stages (Megatron's embedding group) over the pipeline axis.
    level = full.level((0,))
    for param, readers in holders.items():
        if len(readers) > 1:
            grad = priced.memory["parameters"].get(param, 0.0) / cm.precision.weight_bytes * cm.precision.grad_bytes
            for s in readers:
                per_step[s] += link_collective_time_s(cm.profile, Collective.ALL_REDUCE, grad, len(readers), level)
    # Sends: every tensor a later chunk reads crosses each chunk boundary on its way (Megatron passes it
    # along), forward; a float one's gradient comes back.
    sends = [0.0] * p
    send_s = [0.0] * p
    acts: dict[int, float] = defaultdict(float)
    for x in crossings(graph, the_cut.chunk_of):
        info = graph.tensors[x.tensor]
        spec = priced.placed.get(x.tensor)
        local = spec.local_shape(info.shape, cm.mesh.shape) if spec is not None else info.shape
        one = tensor_bytes(info, local, cm.precision)
        for boundary in range(x.src, x.last):
            s = boundary % p
            sends[s] += 2 * one if x.grad else one
            send_s[s] += (2 if x.grad else 1) * collective_time_s(cm.profile, full, Collective.SEND_RECV, one, (0,))
        if x.tensor in cm.saved and x.tensor not in graph.inputs:  # saved where backward reads it: a stage
            # that received it keeps its own copy (the producer's stage, where it is priced, holds its
            # output to its backward anyway: the schedule's stage backward starts from it)
            for c in {the_cut.chunk_of[n] for n in cm.backward_readers.get(x.tensor, ())} - {x.src}:
                acts[c % p] += one
    inputs = 0.0
    transient = priced.memory["activations"].get("(recomputed layer)", 0.0)
    for owner, b in priced.memory["activations"].items():
        if owner in the_cut.chunk_of:
            acts[the_cut.stage_of(owner)] += b
        elif owner in graph.tensors:
            inputs += b  # an input saved for backward: on the first stage
    states: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for category in ("parameters", "gradients", "optimizer"):
        for t, b in priced.memory[category].items():
            for s in holders.get(t, (the_cut.stage_of(cm.param_owner[t]),)):
                states[s][category] += b
    loss_stage = the_cut.stage_of(graph.producer[cm.loss_tensor]) if graph.producer.get(cm.loss_tensor) else p - 1
    out = []
    for s in range(p):
        held = in_flight(schedule, p, m, s, v)
        memory = {**states[s], "activations": (acts[s] + (inputs if s == 0 else 0.0)) * held + transient}
        if s == loss_stage:  # one micro-batch's loss backward at a time
            memory["loss"] = sum(priced.memory.get("loss", {}).values())
        out.append(StageCost(time_s=compute[s] + micro[s], compute_s=compute[s],
                             step_s=per_step[s] + optimizer[s], optimizer_s=optimizer[s], memory=memory,
                             in_flight=held, send_bytes=sends[s], send_s=send_s[s],
                             buckets=tuple(x for x in buckets if x.stage == s)))
    return out


def balanced_counts(stages: list[StageCost], the_cut: Cut) -> list[int] | None:
    """Layers per stage (v = 1) that make the slowest stage as fast as the layers allow: each stage's
    time is its own extra work (the embedding, the head and loss, sends) plus its layers at one layer's
    time; layers move one at a time from the slowest stage to the fastest while that lowers the
    maximum. None when the even cut stays best (or the schedule interleaves: chunks stay equal)."""
    if the_cut.virtual > 1 or the_cut.stages == 1:
        return None
    counts = list(the_cut.layers_per_chunk)
    middle = [s for s in range(the_cut.stages) if counts[s]]
    per_layer = min(stages[s].busy_s / counts[s] for s in middle)  # a stage of layers only is the cheapest
    extra = [stages[s].busy_s - counts[s] * per_layer for s in range(the_cut.stages)]

    def time(s: int) -> float:
        return extra[s] + counts[s] * per_layer

    # Each move lowers Σ t² by 2δ(t_slow − t_fast − δ) > 0, so the loop ends; the margin keeps rounding
    # from moving a layer back and forth between two stages whose times differ by one layer's.
    while True:
        slow = max(range(len(counts)), key=time)
        fast = min(range(len(counts)), key=lambda s: time(s) + per_layer)
        if counts[slow] <= 1 or slow == fast or time(fast) + per_layer >= time(slow) * (1 - 1e-9):
            break
        counts[slow] -= 1
        counts[fast] += 1
    return counts if counts != list(the_cut.layers_per_chunk) else None


def pipelined_cost(stages: list[StageCost], schedule: Schedule, m: int, v: int, fixed_s: float,
                   flops: float, composer: str) -> PredictedCost:
    """The step: the pipeline over its stages (`pipeline_step_s`, the sends where the schedule waits for
    them), then the slowest stage's per-step work; compute, communication (the pacing stage's
    collectives, the sends the schedule waits for, the per-step reductions) and bubble told apart."""
    times = [st.time_s for st in stages]
    without_sends = pipeline_step_s(schedule, times, m, v)
    pipe = pipeline_step_s(schedule, times, m, v, [st.send_s for st in stages])
    pacing = max(range(len(stages)), key=lambda s: times[s])
    last = max(range(len(stages)), key=lambda s: stages[s].step_s)
    step = pipe + stages[last].step_s + fixed_s
    peak = max(stages, key=lambda st: sum(st.memory.values()))
    compute = m * stages[pacing].compute_s
    return PredictedCost(step_time_s=step, compute_s=compute, optimizer_s=stages[last].optimizer_s, overhead_s=fixed_s,
                         comm_s=m * (times[pacing] - stages[pacing].compute_s) + (pipe - without_sends)
                         + stages[last].step_s - stages[last].optimizer_s,
                         memory=dict(peak.memory), peak_bytes=sum(peak.memory.values()), flops_per_device=flops,
                         composer=composer,
                         bubble_s=without_sends - m * times[pacing])


def pipeline_of(the_cut: Cut, stages: list[StageCost], graph: OpGraph, schedule: Schedule, m: int,
                stage_devices: int) -> Pipeline:
    first: dict[int, str] = {}
    last: dict[int, str] = {}
    for node in graph.compute_nodes:
        c = the_cut.chunk_of[node.name]
        first.setdefault(c, node.name)
        last[c] = node.name
    p, v = the_cut.stages, the_cut.virtual
    out = []
    for s in range(p):
        chunks = [c for c in range(p * v) if c % p == s and c in first]
        out.append(PipelineStage(first_node=first[chunks[0]], last_node=last[chunks[-1]],
                                 devices=tuple(range(s * stage_devices, (s + 1) * stage_devices)),
                                 chunks=tuple((first[c], last[c]) for c in chunks),
                                 layers=sum(the_cut.layers_per_chunk[c] for c in chunks),
                                 time_s=stages[s].time_s, send_s=stages[s].send_s, step_s=stages[s].step_s,
                                 memory_bytes=sum(stages[s].memory.values()),
                                 workspace_bytes=stages[s].memory.get("loss", 0.0), in_flight=stages[s].in_flight))
    return Pipeline(stages=tuple(out), schedule=schedule, virtual_stages=v,
                    bubble_fraction=bubble_fraction(schedule, p, m, v), p2p_bytes=max(st.send_bytes for st in stages))


def full_mesh(layout: Layout, sub: DeviceMesh, profile: HardwareProfile) -> DeviceMesh:
    """The cluster's mesh: the pipeline axis outermost, then one stage's."""
    return DeviceMesh.build(layout.devices, (layout.pipeline, *sub.shape), ("pp", *sub.axis_names),
                            devices_per_node=profile.devices_per_node)


def stage_limit_check(stages: list[StageCost], limit: float, say: Callable[[str], None]) -> None:
    worst = max(range(len(stages)), key=lambda s: sum(stages[s].memory.values()))
    need = sum(stages[worst].memory.values())
    if need > limit:
        raise MeshplanError(f"memory: pipeline stage {worst} needs {need / 2**30:.2f} GiB per device but `memory_limit_gib` "
                            f"is {limit / 2**30:.2f} GiB; raise `memory_limit_gib`, add stages or devices, or recompute")
    say(f"pipeline: {len(stages)} stages, peak {need / 2**30:.1f} GiB on stage {worst}")


CANDIDATE_TIME_LIMIT_S = 8.0


def candidates(devices: int, devices_per_node: int, layers: int) -> list[Layout]:
    """The pipelines `plan` tries without a layout, Megatron's way, shallow to deep: p stages (a power
    of two, at most the layers), tensor parallelism over as much of a node as a stage has
    (tp = min(node, N/p)), data parallelism over the rest. The search (`planner.search.plan`) walks them in
    this order and stops once a plan that fits gets slower."""
    out = []
    p = 2
    while p <= min(devices, layers):
        if devices % p == 0:
            tp = min(devices_per_node, devices // p)
            if (devices // p) % tp == 0:
                dp = devices // p // tp
                sizes = ((("dp_replicate", dp),) if dp > 1 else ()) + ((("tp", tp),) if tp > 1 else ())
                out.append(Layout(sizes, pipeline=p))
        p *= 2
    return out


def interleaved(layout: Layout, layers: int) -> Layout | None:
    """The same pipeline with 2 model chunks per stage (interleaved 1F1B), where the layers split into
    2·p equal chunks."""
    if layers % (2 * layout.pipeline):
        return None
    return Layout(layout.sizes, pipeline=layout.pipeline, virtual=2)


def plan_pipelined(req: PlanRequest, graph: OpGraph, profile: HardwareProfile, precision: Precision, steps: int,
                   recompute: Recompute, layout: Layout, limit: float, say: Callable[[str], None], *,
                   enforce_limit: bool = False, cutoff_s: float | None = None) -> tuple[Strategy, list[Candidate]]:
    """A pipelined plan for a layout with pp > 1: the cut, one ILP over a stage's sub-mesh with a memory
    row per stage, the stages priced, the strategy with its `pipeline`. A hand layout is priced fitting
    or not; under `enforce_limit` (the planner's own candidates) every stage must fit. `cutoff_s`: the step
    of a plan already held; the ILP's objective, all p stages' work, must then be below p times it
    (`CUTOFF_MARGIN` above: it prices some collectives per edge), else NotBetterError — the step is at
    least (m·Σ t + Σ per-step work)/p: the slowest stage paces m micro-batches and does the most per-step
    work."""
    p, v = layout.pipeline, layout.virtual
    schedule = req.schedule or (Schedule.INTERLEAVED if v > 1 else Schedule.ONE_F_ONE_B)
    the_cut = cut(graph, p, v)
    sub = DeviceMesh.build(layout.stage_devices, layout.mesh_shape, layout.axis_names,
                           devices_per_node=profile.devices_per_node)
    full = full_mesh(layout, sub, profile)
    say(f"pipeline {p} stages × {sub}: rules")
    rules = rules_for_graph(graph, sub, strict=req.strict)
    if req.layout is not None:  # the user's, priced as written (the search's own are its choice)
        rules = build.as_written(rules, graph, layout, req.cp_method)
    policy = Recompute.FULL if recompute is Recompute.FULL else Recompute.NONE
    cm = build.cost_model_for(req, graph, sub, profile, precision, steps, policy)
    pins = {**layout.input_pins(graph, sub), **resolve_pins(graph, sub, req.pins)}
    held = [in_flight(schedule, p, steps, s, v) for s in range(p)]
    say(f"pipeline {p} stages × {sub}: solving")
    # The planner's own candidates are many: each gets a few seconds (a hand layout, all).
    sol = build.sharding_ilp(req, graph, rules, cm, sub, layout, pins=pins, memory_limit_bytes=limit if enforce_limit else None,
                       time_limit_s=min(req.time_limit_s, CANDIDATE_TIME_LIMIT_S) if enforce_limit else None,
                       cutoff_s=p * cutoff_s * (1 + CUTOFF_MARGIN) if cutoff_s is not None else None,
                       stages=the_cut.node_stage, in_flight=held).solve()
    priced = cm.price_items(sol.choice, sol.param_specs, zero=sol.zero)
    stages = price_stages(cm, priced, graph, the_cut, full, schedule, steps)
    counts = balanced_counts(stages, the_cut)
    if counts is not None:  # the same per-layer plan, the layers moved off the stages with more to do
        balanced = cut(graph, p, v, counts)
        trial = price_stages(cm, priced, graph, balanced, full, schedule, steps)
        if max(st.busy_s for st in trial) < max(st.busy_s for st in stages) and \
                max(sum(st.memory.values()) for st in trial) <= max(limit, max(sum(st.memory.values()) for st in stages)):
            the_cut, stages = balanced, trial
    if enforce_limit:
        stage_limit_check(stages, limit, say)
    overhead = priced.overhead_s + priced.optimizer_fixed_s
    if req.pipeline_result_broadcast:  # the loss (fp32 scalar) from the last stage to the others, each step
        overhead += collective_time_s(profile, full, Collective.BROADCAST, 4.0, (0,))
    cost = pipelined_cost(stages, schedule, steps, v, overhead, priced.flops_matmul, cm.composer)
    say(f"pipeline {p} stages × {sub}: step {cost.step_time_s * 1e3:.1f} ms, {cost.memory_bytes_per_device / 2**30:.1f} "
        "GiB per device")
    settings = build.plan_settings(req, graph, search=req.search, dtype=precision.name, limit=limit, loss=cm.loss)
    training = build.training_settings(req, graph, steps, priced, data_parallel=layout.data_parallel, layout=layout,
                                 recompute={g.prefix: Recompute.FULL for g in graph.layers} if policy is Recompute.FULL else {})
    ref = ProfileRef(name=profile.name, digest=profile.digest, source=build.profile_source(req.profile))
    record = CandidateRecord(mesh=full.shape, axis_names=full.axis_names, step_time_s=cost.step_time_s,
                             memory_bytes_per_device=cost.memory_bytes_per_device, solver_status=sol.stats.status)
    strategy = build.build_strategy(graph, req.model, ref, sub, rules, sol.choice, compose(priced, cm.composer), sol.stats,
                              settings, (record,), training)
    strategy = replace(strategy, pipeline=replace(pipeline_of(the_cut, stages, graph, schedule, steps, sub.num_devices),
                                                  result_broadcast=req.pipeline_result_broadcast), cost=cost,
                       buckets=tuple(b for st in stages for b in st.buckets))
    return strategy, [Candidate(mesh=full, cost=None, stats=sol.stats)]
