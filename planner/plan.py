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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TypeVar

from costmodel.attention import ATTENTION_KERNELS
from costmodel.buckets import CommFusion
from costmodel.collectives import Phase
from costmodel.compose import POLICIES, StepCost
from costmodel.memory import PRECISIONS, Precision
from costmodel.pipeline import SCHEDULES
from costmodel.step import RECOMPUTE, CommEvent, CostModel
from hwprofiles.profile import HardwareProfile, list_presets, load_profile
from planner.errors import DimBindingError, MeshplanError
from planner.graph import OpGraph, TensorKind, load_graph
from planner.layout import Layout, parse_layout
from planner.mesh import DeviceMesh
from planner.pipeline import candidates as pipeline_candidates
from planner.pipeline import interleaved, plan_pipelined
from planner.placement import Shard, Spec, fully_sharded, parse_spec
from planner.rules import OpStrategy, RuleSet, rules_for_graph
from planner.solve import PinError, ShardingILP, SolverOptions
from planner.strategy import (
    CandidateRecord,
    CollectiveRecord,
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

MODES = ("auto", "semi", "data-parallel", "stand-alone")
SEARCHES = ("ilp", "propagation")
Progress = Callable[[str], None]
_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: str
    dims: Mapping[str, int] = field(default_factory=dict)
    profile: str = "h100-sxm"
    devices: int = 1
    mesh_shape: tuple[int, ...] | None = None
    axis_names: tuple[str, ...] | None = None
    mode: str = "auto"
    search: str = "ilp"
    pins: Mapping[str, str] = field(default_factory=dict)
    memory_limit_gib: float | None = None  # default: 90% of the device's capacity
    time_limit_s: float = 60.0
    dtype: str | None = None
    solver: str = "cbc"
    workers: int = 2  # the solver's threads (CP-SAT; CBC here runs one); the plan does not depend on them
    follow: bool = True
    strict: bool = False
    all_to_all: bool = True
    loss: str = "auto"  # auto | cross-entropy | mse (costmodel/loss.py)
    # The training step's levers. The global batch (sequences per optimizer step) is split into
    # `accumulation_steps` micro-steps (None: the fewest that fit in memory); the graph's `batch` dim
    # is bound at one micro-step's batch, global / steps. Without it, `--dim batch` is one step.
    global_batch_size: int | None = None
    accumulation_steps: int | None = None
    zero_stage: int | None = None  # 0–3, or None: auto (each parameter's stage 0–2 chosen by the ILP)
    recompute: str = "auto"  # none | selective | full | auto (the ILP decides how many layers per group)
    recompute_layers: int | None = None  # with full: the first N layers of each group (Megatron's block method)
    layout: str | None = None  # torchtitan's degrees, e.g. "dp_shard=8,tp=8" (planner/layout.py); pp, vpp pipeline
    schedule: str | None = None  # a pipeline's: gpipe | 1f1b | interleaved (default 1f1b; interleaved with vpp)
    micro_batch_size: int | None = None  # per data-parallel rank per micro-step (needs the dp degree)
    composer: str = "serial"  # how priced items add up (costmodel/compose.py): serial | overlap
    # Communication fusion (MindSpore's comm_fusion, DDP's bucket_cap_mb): bucket caps per kind, or None:
    # auto (the fastest of FUSION_CANDIDATES per kind, priced on the plan found).
    fusion: CommFusion | None = field(default_factory=CommFusion)
    zero_threshold_bytes: float = 0.0  # MindSpore's parallel_optimizer_threshold: smaller parameters unsharded
    # MindSpore's switches (planner/strategy.py TrainingSettings): priced where they change the step.
    gradients_mean: bool = True
    parameter_broadcast: bool = False
    force_fp32_communication: bool = False
    attention: str = "flash"  # how the runtime runs attention: flash | eager | fused-softmax
    attention_dropout: float = 0.0  # dropout on the attention probabilities (priced where materialised)
    zero_shard_size: int | None = None  # optimizer_weight_shard_size (None: the whole data-parallel group)
    pipeline_result_broadcast: bool = False  # a pipelined plan's loss broadcast to every stage each step

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise MeshplanError(f"--mode {self.mode}: choose one of {', '.join(MODES)}")
        if self.search not in SEARCHES:
            raise MeshplanError(f"--search {self.search}: choose ilp or propagation")
        if self.devices < 1:
            raise MeshplanError(f"--devices {self.devices}: needs at least 1 device")
        if self.workers < 1:
            raise MeshplanError(f"--workers {self.workers}: needs at least 1 solver thread")
        if self.mode == "semi" and not self.pins:
            raise MeshplanError("--mode semi plans around pins: give at least one --pin TENSOR=PLACEMENTS")
        if self.memory_limit_gib is not None and self.memory_limit_gib <= 0:
            raise MeshplanError(f"--memory-limit {self.memory_limit_gib}: must be a positive number of GiB")
        if self.layout is not None:
            if self.mesh_shape is not None:
                raise MeshplanError("--layout and --mesh both fix the mesh; give one")
            if self.mode not in ("auto", "semi") or self.search != "ilp":
                raise MeshplanError(f"--layout is priced by the ILP: use --mode auto or semi, not {self.mode}")
            parse_layout(self.layout, self.devices)
        pp = parse_layout(self.layout, self.devices) if self.layout is not None else None
        if self.schedule is not None:
            if self.schedule not in SCHEDULES:
                raise MeshplanError(f"--schedule {self.schedule}: choose one of {', '.join(SCHEDULES)}")
            if pp is None or pp.pipeline == 1:
                raise MeshplanError(f"--schedule {self.schedule} schedules pipeline stages: give --layout with pp=N")
            if (pp.virtual > 1) != (self.schedule == "interleaved"):
                raise MeshplanError(f"--schedule {self.schedule} with vpp={pp.virtual}: the interleaved schedule is the "
                                    "one with virtual stages (vpp > 1), and it needs them")
        if pp is not None and pp.pipeline > 1 and self.global_batch_size is None:
            raise MeshplanError("--layout pp: a pipeline runs micro-batches of a global batch; give "
                                "--global-batch-size (and --micro-batch-size, default 1 per data-parallel rank)")
        if self.micro_batch_size is not None:
            if self.micro_batch_size < 1:
                raise MeshplanError(f"--micro-batch-size {self.micro_batch_size}: needs at least 1 sequence")
            if self.global_batch_size is None:
                raise MeshplanError("--micro-batch-size counts sequences per data-parallel rank per micro-step of a "
                                    "global batch: give --global-batch-size too")
            if self.accumulation_steps is not None:
                raise MeshplanError("--micro-batch-size and --accumulation-steps both fix the micro-steps; give one")
            dp = self.data_parallel_degree()
            if self.global_batch_size % (self.micro_batch_size * dp):
                raise MeshplanError(f"--global-batch-size {self.global_batch_size} is not divisible by micro-batch "
                                    f"{self.micro_batch_size} × {dp} data-parallel ranks; pick sizes whose product "
                                    f"divides it")
        if self.composer not in POLICIES:
            raise MeshplanError(f"composer {self.composer}: choose {', '.join(POLICIES)}")
        if self.recompute not in (*RECOMPUTE, "auto"):
            raise MeshplanError(f"--recompute {self.recompute}: choose {', '.join(RECOMPUTE)} or auto")
        if self.recompute_layers is not None and (self.recompute != "full" or self.recompute_layers < 0):
            raise MeshplanError(f"--recompute-layers {self.recompute_layers}: counts the layers of each group that "
                                "full recomputation covers; give --recompute full and a count of 0 or more")
        if self.recompute_layers is not None and (self.mode not in ("auto", "semi") or self.search != "ilp"):
            raise MeshplanError("--recompute-layers is decided with the sharding by the ILP: use --mode auto or semi")
        if self.attention not in ATTENTION_KERNELS:
            raise MeshplanError(f"--attention {self.attention}: choose {', '.join(ATTENTION_KERNELS)} (FlashAttention, "
                                f"torch's eager ops, Megatron-LM's fused softmax)")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise MeshplanError(f"--attention-dropout {self.attention_dropout}: a probability in [0, 1)")
        if self.zero_shard_size is not None and self.zero_shard_size < 1:
            raise MeshplanError(f"--zero-shard-size {self.zero_shard_size}: a ZeRO shard group needs at least 1 rank")
        if self.zero_stage not in (None, 0, 1, 2, 3):
            raise MeshplanError(f"--zero {self.zero_stage}: choose 0, 1, 2, 3 (ZeRO's stages) or auto")
        if self.zero_stage == 3 and (self.mode not in ("auto", "semi") or self.search != "ilp"):
            raise MeshplanError(f"--zero 3 places the parameters through the ILP: use --mode auto or semi (for data "
                                f"parallelism with FSDP, --layout dp_shard=N), not {self.mode}")
        k, g = self.accumulation_steps, self.global_batch_size
        if k is not None and k < 1:
            raise MeshplanError(f"--accumulation-steps {k}: needs at least 1 micro-step")
        if g is not None:
            if g < 1:
                raise MeshplanError(f"--global-batch-size {g}: needs at least 1 sequence")
            if "batch" in self.dims:
                raise MeshplanError("--global-batch-size and --dim batch both set the batch; give one "
                                    "(the global batch is bound per micro-step as batch = global / steps)")
            if k is not None and g % k:
                raise MeshplanError(f"--global-batch-size {g} is not divisible by --accumulation-steps {k}; "
                                    f"pick steps among {', '.join(map(str, _divisors(g)))}")
        elif k is not None and k > 1:
            raise MeshplanError(f"--accumulation-steps {k} splits a global batch: give --global-batch-size "
                                "(the batch per optimizer step) instead of --dim batch")

    def data_parallel_degree(self) -> int:
        """Ranks that split the batch, where the request fixes it: the layout's dp_replicate × dp_shard,
        or every device in data-parallel mode."""
        if self.layout is not None:
            return parse_layout(self.layout, self.devices).data_parallel
        if self.mode == "data-parallel":
            return self.devices
        raise MeshplanError("--micro-batch-size needs the data-parallel degree: give --layout (e.g. "
                            "dp_shard=8,tp=8) or --mode data-parallel, or use --accumulation-steps")

    def step_candidates(self) -> list[int]:
        """Accumulation steps to try, fewest first (a larger micro-batch runs at least as efficiently)."""
        if self.global_batch_size is None:
            return [1]
        if self.micro_batch_size is not None:
            return [self.global_batch_size // (self.micro_batch_size * self.data_parallel_degree())]
        if self.layout is not None and parse_layout(self.layout, self.devices).pipeline > 1:
            return [self.global_batch_size // self.data_parallel_degree()]  # Megatron's default: 1 per rank
        return [self.accumulation_steps] if self.accumulation_steps else _divisors(self.global_batch_size)

    def searches_pipelines(self) -> bool:
        """Pipelines are tried where the planner chooses the mesh of a global batch."""
        return (self.layout is None and self.mesh_shape is None and self.mode == "auto" and self.search == "ilp"
                and self.global_batch_size is not None and self.micro_batch_size is None
                and self.accumulation_steps is None and self.devices > 1)

    def recompute_candidates(self, devices_per_node: int = 1) -> list[str]:
        """Recomputation policies to try, cheapest first (selective is priced as none: attention runs
        fused, its scores recomputed in backward, whatever the policy). Under auto the ILP decides how
        many layers of each group to recompute ("auto"); without an ILP, none and then full (also where
        pipelines are searched on several nodes: their candidates and the plans without them are many, and the counted
        recomputation's ILP takes tens of seconds on meshes of hundreds of devices)."""
        if self.recompute != "auto":
            return [self.recompute]
        counted = self.mode in ("auto", "semi") and self.search == "ilp" and not (
            self.searches_pipelines() and self.devices > devices_per_node)
        return ["none", "auto" if counted else "full"]

    def dims_for(self, steps: int) -> dict[str, int]:
        if self.global_batch_size is None:
            return dict(self.dims)
        return {**self.dims, "batch": self.global_batch_size // steps}


    def zero_options(self) -> tuple[int, ...]:
        """The ZeRO-1/2 stages a parameter may take (ZeRO-3 is a placement, chosen by the ILP)."""
        return (0, 1, 2) if self.zero_stage is None else (self.zero_stage % 3,)


# Bucket caps `--comm-fusion auto` chooses among, per fused kind.
FUSION_CANDIDATES = tuple(float(mib * 2**20) for mib in (1, 4, 25, 100, 400))


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass
class Candidate:
    mesh: DeviceMesh
    cost: StepCost | None
    stats: SolverStats | None
    error: str = ""


def mesh_candidates(devices: int, devices_per_node: int) -> list[tuple[int, ...]]:
    """(N,) and every (N/t, t) with 1 < t < N whose inner axis t fits inside a node."""
    out: list[tuple[int, ...]] = [(devices,)]
    for t in range(2, devices):
        if devices % t == 0 and t <= devices_per_node:
            out.append((devices // t, t))
    return out


def make_plan(req: PlanRequest, progress: Progress | None = None) -> tuple[Strategy, list[Candidate]]:
    """The best plan for the request: without recomputation at the fewest micro-steps that fit, and
    (under --recompute auto) with the layers the ILP chooses to recompute (without an ILP: every layer)
    at fewer micro-steps while that is faster; without --mesh, over mesh shapes."""
    say = progress or (lambda _msg: None)
    profile = load_profile(req.profile)
    precision = PRECISIONS[req.dtype or ("bf16" if "bf16" in profile.device.peak_flops_per_s else "fp32")]
    steps, policies = req.step_candidates(), req.recompute_candidates(profile.devices_per_node)
    failures: list[MeshplanError] = []
    graphs: dict[int, OpGraph] = {}
    found: list[tuple[int, tuple[Strategy, list[Candidate]]]] = []
    def attempt(k: int, recompute: str) -> tuple[Strategy, list[Candidate]] | None:
        dims = req.dims_for(k)
        if k not in graphs:
            say("importing the model" + (f" (batch {dims['batch']} per micro-step, {k} micro-steps)" if k > 1 else ""))
            try:
                graphs[k] = load_graph(req.model, dims)
            except DimBindingError as e:
                if req.global_batch_size is None or "batch" not in e.unknown:
                    raise
                raise DimBindingError(
                    f"--global-batch-size binds the model's symbolic dim 'batch' per micro-step, but {e}; "
                    "export the model with a dynamic dim named batch, or plan one step with --dim") from e
        try:
            plan = _plan_meshes(req, graphs[k], profile, precision, k, recompute, say)
        except PinError:
            raise
        except MeshplanError as e:  # out of memory
            if len(steps) * len(policies) == 1:
                raise
            failures.append(e)
            return None
        found.append((k, plan))
        return plan

    # The pipelines' search runs beside the rest (another process, forked: the machine's second core);
    # it needs only the layer count, known once the model is imported.
    pipelines: Callable[[], list[tuple[int, tuple[Strategy, list[Candidate]]]]] | None = None
    tried = 0
    if req.searches_pipelines():
        attempt(steps[0], policies[0])
        tried = 1
        layers = max((g.num_layers for g in graphs[steps[0]].layers), default=0)
        pipelines = _beside(partial(_pipelines, req, profile, precision, layers), say)
    # Without recomputation (or with the policy asked for) at the fewest micro-steps that fit: more
    # micro-steps only add per-micro-step costs.
    for k in steps[tried:] if not found else []:
        if attempt(k, policies[0]) is not None:
            break
    # Under --recompute auto: with the layers the ILP recomputes at fewer micro-steps (larger
    # micro-batches). The step against the micro-steps is taken as unimodal: fewer add recomputation,
    # more add per-micro-step work. First the fewest micro-steps: if that beats the plan without
    # recomputation, more of them while each is faster; else from the most (below the plan without
    # recomputation) down while each is faster.
    if len(policies) > 1:
        fewest = min((k0 for k0, _ in found), default=steps[-1] + 1)
        below = [k for k in steps if k < fewest]

        def walk(order: list[int]) -> None:
            for k in order:
                best = min((f[1][0].step_time_s for f in found), default=math.inf)
                plan = attempt(k, policies[1])
                if plan is None or plan[0].step_time_s >= best:
                    break  # fewer micro-steps need more memory: none fits; or recomputation costs more

        if below:
            before = min((f[1][0].step_time_s for f in found), default=math.inf)
            plan = attempt(below[0], policies[1])
            if plan is not None and plan[0].step_time_s < before:
                walk(below[1:])
            else:
                walk(below[:0:-1])
    if pipelines is not None:
        found += pipelines()
    if not found:
        raise MeshplanError(f"no accumulation step count or recomputation fits: with {steps[-1]} micro-steps and "
                            f"recomputation {policies[-1]}, {failures[-1]}")
    return min((plan for _, plan in found), key=lambda plan: plan[0].step_time_s)


def _multi_node_search(req: PlanRequest, profile: HardwareProfile) -> bool:
    """With pipelines in the search, the plans without them keep Megatron's shape: tensor parallelism
    over a node, data parallelism across nodes (one mesh instead of every factorisation)."""
    return (req.searches_pipelines() and req.devices > profile.devices_per_node
            and req.devices % profile.devices_per_node == 0)


def _pipelines(req: PlanRequest, profile: HardwareProfile, precision: Precision, layers: int,
               say: Progress) -> list[tuple[int, tuple[Strategy, list[Candidate]]]]:
    """The planner's pipeline candidates (`planner/pipeline.py`) for a model of `layers` repeated layers,
    each with one sequence per data-parallel rank per micro-batch, without recomputation or else with
    every layer recomputed; those that fit."""
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
            graphs[dp] = load_graph(req.model, {**req.dims, "batch": dp})
        for recompute in ("none", "full"):
            try:
                return k, plan_pipelined(req, graphs[dp], profile, precision, k, recompute, layout, limit, say,
                                         enforce_limit=True)
            except MeshplanError:  # (a pin error included: a candidate the model's rules cannot hold)
                continue
        return None

    # Deeper pipelines hold less per device and idle more: from shallow to deep, until one that fits is
    # slower than the one before it; then the best with 2 interleaved chunks per stage.
    best: tuple[float, Layout] | None = None
    for layout in pipeline_candidates(req.devices, profile.devices_per_node, layers):
        found = attempt(layout)
        if found is None:
            continue
        out.append(found)
        t = found[1][0].step_time_s
        if best is not None and t > best[0]:
            break
        best = (t, layout) if best is None or t < best[0] else best
    if best is not None and (chunked := interleaved(best[1], layers)) is not None:
        found = attempt(chunked)
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


def _memory_limit(req: PlanRequest, profile: HardwareProfile) -> float:
    """--memory-limit in bytes; by default 90% of the device's capacity."""
    return req.memory_limit_gib * 2**30 if req.memory_limit_gib is not None else 0.9 * profile.device.mem_capacity_bytes


def _plan_meshes(req: PlanRequest, graph: OpGraph, profile: HardwareProfile, precision: Precision, steps: int,
                 recompute: str, say: Progress) -> tuple[Strategy, list[Candidate]]:
    devices = 1 if req.mode == "stand-alone" else req.devices
    layout = parse_layout(req.layout, devices) if req.layout is not None else None
    limit = _memory_limit(req, profile)
    if layout is not None and layout.pipeline > 1:
        return plan_pipelined(req, graph, profile, precision, steps, recompute, layout, limit, say)
    shapes = [layout.mesh_shape] if layout is not None else \
        [req.mesh_shape] if req.mesh_shape and req.mode != "stand-alone" else \
        [(1,)] if req.mode == "stand-alone" else \
        [(devices // profile.devices_per_node, profile.devices_per_node)] if _multi_node_search(req, profile) else \
        mesh_candidates(devices, profile.devices_per_node)
    best: tuple[float, DeviceMesh, RuleSet, CostModel, dict[str, OpStrategy], StepCost, SolverStats,
                dict[str, int]] | None = None
    candidates: list[Candidate] = []
    errors: list[MeshplanError] = []
    for shape in shapes:
        names = layout.axis_names if layout is not None else req.axis_names if req.mesh_shape else None
        mesh = DeviceMesh.build(devices, shape, names, devices_per_node=profile.devices_per_node)
        say(f"mesh {mesh}: rules")
        rules = rules_for_graph(graph, mesh, strict=req.strict)
        model = partial(_cost_model, req, graph, mesh, profile, precision, steps)
        # The ILP decides the count of recomputed layers per group (auto), or holds it (--recompute-layers).
        counted = graph.layers and req.search == "ilp" and req.mode in ("auto", "semi") and (
            recompute == "auto" or req.recompute_layers is not None)
        cm = model("none" if counted or recompute == "auto" else recompute)
        recomputed = {g.prefix: g.num_layers for g in graph.layers} if recompute == "full" else {}
        pins = resolve_pins(graph, mesh, req.pins)
        if req.mode == "data-parallel":
            pins = {**data_parallel_pins(graph, mesh), **pins}
        if layout is not None:
            pins = {**layout.input_pins(graph, mesh), **pins}
        try:
            if req.mode in ("auto", "semi") and req.search == "ilp":
                say(f"mesh {mesh}: solving")
                # A hand layout is priced as it is, fitting or not (the table says which).
                no_zero: frozenset[str] = frozenset()
                base = cm
                while True:  # ZeRO-1/2 shards a parameter's states only where its gradient is reduced where
                    # stored: where a parameter the solver sharded is not, and the plan does not fit without
                    # its saving, it is held at stage 0 and the ILP solved again
                    ilp = ShardingILP(graph, rules, base, memory_limit_bytes=None if layout is not None else limit,
                                      pins=pins, follow=req.follow,
                                      options=SolverOptions(time_limit_s=req.time_limit_s, backend=req.solver,
                                                            num_workers=req.workers),
                                      param_layout=_param_layout(req, layout, graph, mesh),
                                      zero_stages=req.zero_options(), no_zero=no_zero,
                                      recompute_model=model("full") if counted else None,
                                      recompute_layers=req.recompute_layers)
                    sol = ilp.solve()
                    choice, param_specs, stats = sol.choice, sol.param_specs, sol.stats
                    if sol.recompute:  # priced with the layers the solver recomputes
                        cm, recomputed = model("full", sol.recompute), sol.recompute
                    else:
                        cm, recomputed = base, {} if counted else recomputed
                    cost = cm.price(choice, param_specs, zero=sol.zero)
                    unsharded = {ilp.param_rep[p] for p in sol.zero if p not in cost.priced.zero_stages}
                    if not unsharded or cost.memory_bytes <= limit or layout is not None:
                        break  # priced as it runs (those parameters at stage 0), and it fits
                    no_zero |= unsharded
                if req.zero_stage is None:  # the solver prices each gradient alone; bucketed, one stage for
                    # all on the same placements can come out faster
                    cost = _best_uniform_zero(cm, choice, param_specs, req.zero_options(), limit, cost)
            else:
                say(f"mesh {mesh}: propagating")
                choice, param_specs, stats = propagate(graph, rules, cm, pins)
                cost = _best_uniform_zero(cm, choice, param_specs, req.zero_options(), limit)
            if req.fusion is None:
                cost = _best_fusion(cm, cost)
            if cost.memory_bytes > limit and layout is None:  # the solver's memory row is its own estimate:
                # a plan priced over the limit is refused, never returned
                raise MeshplanError(f"memory: the {req.mode} plan needs {cost.memory_bytes / 2**30:.2f} GiB per device "
                                    f"but --memory-limit is {limit / 2**30:.2f} GiB; raise --memory-limit, add devices, "
                                    "or use more micro-steps or recomputation" +
                                    (" or --mode auto" if req.mode != "auto" else ""))
        except PinError:
            raise
        except MeshplanError as e:
            if len(shapes) == 1:
                raise
            errors.append(e)
            candidates.append(Candidate(mesh=mesh, cost=None, stats=None, error=str(e)))
            continue
        candidates.append(Candidate(mesh=mesh, cost=cost, stats=stats))
        if best is None or cost.step_time_s < best[0]:
            best = (cost.step_time_s, mesh, rules, cm, choice, cost, stats, recomputed)
    if best is None:
        raise errors[0]
    _, mesh, rules, cm, choice, cost, stats, recomputed = best
    settings = PlanSettings(
        mode=req.mode, search=req.search if req.mode in ("auto", "semi") else "propagation",
        dtype=precision.name, memory_limit_bytes=limit, solver=req.solver, follow=req.follow,
        pins=dict(req.pins), batch=_batch(graph), loss=cm.loss)
    records = tuple(
        CandidateRecord(mesh=c.mesh.shape, axis_names=c.mesh.axis_names,
                        step_time_s=c.cost.step_time_s if c.cost else None,
                        memory_bytes_per_device=c.cost.memory_bytes if c.cost else None,
                        solver_status=c.stats.status if c.stats else None, error=c.error)
        for c in candidates)
    micro = _batch(graph)
    dp = cost.placed[graph.inputs[0]].num_shards(0, mesh.shape) if graph.inputs and graph.inputs[0] in cost.placed else 1
    zero = dict(cost.priced.zero_stages)
    training = TrainingSettings(micro_batches=steps,
                                zero_stage=req.zero_stage if req.zero_stage is not None else max(zero.values(), default=0),
                                zero_stages=zero, comm_fusion=cost.priced.fusion,
                                recompute={g: "full" for g in recomputed} if recomputed else
                                {group.prefix: recompute for group in graph.layers} if recompute == "selective" else {},
                                recompute_layers=recomputed, gradients_mean=req.gradients_mean,
                                parameter_broadcast=req.parameter_broadcast,
                                force_fp32_communication=req.force_fp32_communication,
                                attention=req.attention, attention_dropout=req.attention_dropout,
                                zero_shard_size=req.zero_shard_size,
                                global_batch_size=micro * steps if micro is not None else None,
                                micro_batch_size=-(-micro // dp) if micro is not None else None,  # rank 0's
                                layout=str(layout) if layout is not None else None,
                                zero_threshold_bytes=req.zero_threshold_bytes)
    ref = ProfileRef(name=profile.name, digest=profile.digest, source=profile_source(req.profile))
    strategy = build_strategy(graph, req.model, ref, mesh, rules, choice, cost, stats, settings, records, training)
    return strategy, candidates


def _param_layout(req: PlanRequest, layout: Layout | None, graph: OpGraph,
                  mesh: DeviceMesh) -> Callable[[str, Spec], Spec | None] | None:
    """How parameters may be stored: as the layout says, and under --zero 3 split on dim 0 over every
    axis they would be replicated on (FSDP), wherever they can be."""
    held = layout.param_layout(graph, mesh) if layout is not None else None
    if req.zero_stage != 3:
        return held

    def zero3(param: str, spec: Spec) -> Spec | None:
        stored = held(param, spec) if held is not None else spec
        if stored is None:
            return None
        return fully_sharded(graph.tensors[param].shape, mesh.shape, stored) or stored

    return zero3


def _cost_model(req: PlanRequest, graph: OpGraph, mesh: DeviceMesh, profile: HardwareProfile, precision: Precision,
                steps: int, policy: str, layers: Mapping[str, int] | None = None) -> CostModel:
    return CostModel(graph, mesh, profile, precision, enable_all_to_all=req.all_to_all, loss=req.loss,
                     micro_batches=steps, zero_stage=req.zero_stage or 0, recompute=policy, composer=req.composer,
                     fusion=req.fusion, zero_threshold_bytes=req.zero_threshold_bytes, recompute_layers=layers,
                     fp32_communication=req.force_fp32_communication, zero_shard_size=req.zero_shard_size,
                     attention=req.attention, attention_dropout=req.attention_dropout)


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


def profile_source(name_or_path: str) -> str:
    """How `explain` finds the profile again: a preset's name, or the file's absolute path."""
    return name_or_path if name_or_path in list_presets() else str(Path(name_or_path).resolve())


def _batch(graph: OpGraph) -> int | None:
    for t in graph.inputs:
        if graph.tensors[t].shape:
            return graph.tensors[t].shape[0]
    return None


def resolve_pins(graph: OpGraph, mesh: DeviceMesh, raw: Mapping[str, str]) -> dict[str, Spec]:
    pins = {}
    for name, text in raw.items():
        if name not in graph.tensors or graph.tensors[name].kind is TensorKind.CONSTANT:
            close = sorted(t for t in graph.tensors if name.lower() in t.lower())[:3]
            hint = f" (did you mean {', '.join(close)}?)" if close else " (see meshplan inspect for tensor names)"
            raise PinError(f"--pin {name}: no input, parameter or activation of that name in the model{hint}")
        info = graph.tensors[name]
        spec = parse_spec(text, len(info.shape))
        spec.validate(info.shape, mesh.shape, f"--pin {name}")
        if info.kind is TensorKind.PARAM and spec.has_partial:
            raise PinError(f"--pin {name}={spec}: a parameter is stored whole or split, never as partial sums; "
                           "use S(dim) or R")
        pins[name] = spec
    return pins


def data_parallel_pins(graph: OpGraph, mesh: DeviceMesh) -> dict[str, Spec]:
    """Inputs split on dim 0 over every mesh axis, parameters replicated."""
    pins: dict[str, Spec] = {}
    for t in graph.inputs:
        shape = graph.tensors[t].shape
        if not shape or shape[0] < mesh.num_devices:
            raise MeshplanError(f"--mode data-parallel: input {t} has batch {shape[0] if shape else 0} < "
                                f"{mesh.num_devices} devices; raise the batch (--dim) or use fewer devices")
        pins[t] = Spec((Shard(0),) * mesh.ndim)
    for p in graph.params:
        pins[p.name] = Spec.replicated(mesh.ndim)
    return pins


def propagate(graph: OpGraph, rules: RuleSet, cm: CostModel,
              pins: Mapping[str, Spec]) -> tuple[dict[str, OpStrategy], dict[str, Spec], SolverStats]:
    """Greedy: in topological order, each op takes the strategy that respects the pins and costs
    least given where its inputs already are (parameters are placed by their first consumer)."""
    import time

    t0 = time.perf_counter()
    placed: dict[str, Spec] = {}
    choice: dict[str, OpStrategy] = {}
    total = 0.0
    for node in graph.compute_nodes:
        options = [s for s in rules.by_node[node.name].strategies if _respects(node.inputs, node.outputs, s, pins)]
        if not options:
            raise PinError(f"the pins leave {node.name} ({node.op_type}) no strategy; "
                           "pin a placement its op supports (see meshplan strategies)")
        best, best_cost = options[0], math.inf
        for s in options:
            split = cm.split_axes(s)
            c = cm.node_cost(node, s).time_s * cm.micro_batches
            for i, (t, need) in enumerate(zip(node.inputs, s.input_specs, strict=True)):
                if need is None or not t or graph.tensors[t].kind is TensorKind.INPUT:
                    continue
                c += cm.edge_time_s(t, placed.get(t, pins.get(t, _stored(graph, t, need))), need, split,
                                    recomputed=node.name in cm.layer_of,
                                    saved=cm.reads_in_backward(node, i))
            if c < best_cost:
                best, best_cost = s, c
        choice[node.name] = best
        total += best_cost
        for t, need in zip(node.inputs, best.input_specs, strict=True):
            if need is not None and t:
                placed.setdefault(t, pins.get(t, _stored(graph, t, need)))
        placed.update(zip(node.outputs, best.output_specs, strict=True))
    param_specs = {p.name: placed[p.name] for p in graph.params if p.name in placed}
    stats = SolverStats(status="PROPAGATED", objective=total, bound=0.0, gap=0.0, time_s=time.perf_counter() - t0,
                        num_variables=0, num_constraints=0, num_decision_nodes=len(choice), num_edges=0)
    return choice, param_specs, stats


def _stored(graph: OpGraph, t: str, need: Spec) -> Spec:
    return need.storable() if graph.tensors[t].kind is TensorKind.PARAM else need


def _respects(inputs: tuple[str, ...], outputs: tuple[str, ...], s: OpStrategy, pins: Mapping[str, Spec]) -> bool:
    for t, spec in zip(inputs, s.input_specs, strict=True):
        if t in pins and spec is not None and spec != pins[t]:
            return False
    return all(not (t in pins and spec != pins[t]) for t, spec in zip(outputs, s.output_specs, strict=True))


# ---------------------------------------------------------------------------------------------------
# The strategy


def _collectives(events: list[CommEvent] | tuple[CommEvent, ...], mesh: DeviceMesh) -> tuple[CollectiveRecord, ...]:
    return tuple(CollectiveRecord(kind=e.kind, axes=tuple(mesh.axis_names[a] for a in e.axes), bytes=e.size_bytes,
                                  time_s=e.time_s, phase=e.phase, purpose=e.purpose, tensor=e.tensor, cadence=e.cadence)
                 for e in events)


def build_strategy(graph: OpGraph, model_path: str, profile: ProfileRef, mesh: DeviceMesh, rules: RuleSet,
                   choice: Mapping[str, OpStrategy], cost: StepCost, stats: SolverStats, settings: PlanSettings,
                   candidates: tuple[CandidateRecord, ...] = (), training: TrainingSettings | None = None) -> Strategy:
    tensors = {}
    for t, spec in cost.placed.items():
        info = graph.tensors[t]
        if info.kind is TensorKind.CONSTANT or info.dtype == "sequence":
            continue
        tensors[t] = TensorPlacement(kind=info.kind.value, shape=tuple(info.shape), spec=spec)
    nodes = {}
    for n in graph.compute_nodes:
        s = choice[n.name]
        nodes[n.name] = NodePlan(op_type=n.op_type, module=n.module_path, strategy=s.name, inputs=tuple(s.input_specs),
                                 outputs=tuple(s.output_specs), kernels=tuple(s.kernels),
                                 compute_s=cost.node_compute_s.get(n.name, 0.0),
                                 collectives=_collectives(cost.node_events.get(n.name, []), mesh))
    return Strategy(
        model=ModelRef(path=str(Path(model_path).resolve()), name=graph.name, fingerprint=graph.fingerprint,
                       dims=dict(graph.dims), notes=tuple(graph.notes)),
        profile=profile, mesh=mesh, settings=settings, training=training or TrainingSettings(),
        tensors=tensors, nodes=nodes,
        reshards=tuple(Reshard(tensor=t, consumer=c, src=a, dst=b,
                               collectives=_collectives([e for e in ev if e.phase is Phase.FORWARD], mesh))
                       for t, c, a, b, ev in cost.reshards),
        fallbacks=tuple(Fallback(node=n.name, op_type=n.op_type) for n in rules.fallbacks),
        cost=PredictedCost(step_time_s=cost.step_time_s, compute_s=cost.compute_s, optimizer_s=cost.optimizer_s,
                           overhead_s=cost.overhead_s, comm_s=cost.comm_s, memory=dict(cost.memory),
                           flops_per_device=cost.flops_matmul, composer=cost.policy, hidden_comm_s=cost.hidden_comm_s),
        solver=stats, candidates=candidates,
    )
