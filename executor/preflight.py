"""What is known of a run before any rank starts, without torch: the options a run is asked for, the
checks that refuse a plan the executor cannot run as planned, and the collectives each rank should
run in a step, as the strategy file records them (its nodes' priced collectives and the buckets its
training settings say).

`meshplan run` checks before spawning the ranks; a rank started by torchrun checks again."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from core.collectives import Cadence, Collective, Purpose
from core.errors import MeshplanError
from core.graph import OpGraph, TensorKind
from core.levers import Attention, LossKind
from costmodel.buckets import gather_groups, pack_buckets, zero_split, zero_units
from planner.stagecut import crossings, param_stages, strategy_chunks
from planner.strategy import Strategy


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    steps: int = 5
    warmup: int = 2
    verify: bool = False
    loss: LossKind = LossKind.AUTO  # AUTO: the plan's
    optimizer: str = "adamw"  # adamw | sgd
    lr: float = 1e-3
    seed: int = 0
    # Every rank but 0 perturbs its parameters (as ranks that loaded different checkpoints): only a plan
    # with parameter_broadcast makes them agree again.
    diverge_ranks: bool = False
    # Sharded checkpoints (executor/checkpoint.py): loaded before the first step, saved after the last.
    save: str | None = None
    load: str | None = None
    # Time `hwprofiles.timing.SpeedProbe` before the warm-up and after every timed step (outside the
    # step's time): how fast the machine ran during the steps against just before them.
    probe: bool = False


class RunError(MeshplanError):
    """A run that cannot start (mismatched strategy, model, rank count) or a rank that failed."""


def planned_counts(strategy: Strategy, *, backend: str = "gloo", graph: OpGraph | None = None,
                   stage: int = 0) -> dict[str, int]:
    """The plan's collectives by kind in one optimizer step, as the executor runs them: those of each
    micro-batch as many times as there are micro-batches; a parameter's gradient all-reduces (when it
    is used where it is stored; ZeRO: its reduce-scatters and gathers) packed into buckets like DDP
    (`costmodel.buckets`), once per step or (ZeRO-2's reduce-scatter) per micro-batch; DTensor on
    CPU performs an all_to_all as all_gather + local chunk. A pipelined plan's (`graph` needed): those
    of a rank of `stage`, its nodes' and its parameters' only, with its sends to the neighbouring
    stages (`send`) and one all-reduce per tied parameter it holds a copy of."""
    params = {t for t, v in strategy.tensors.items() if v.kind is TensorKind.PARAM}
    mine: set[str] | None = None
    out: Counter[str] = Counter()
    if strategy.pipeline is not None:
        assert graph is not None, "a pipelined plan's counts need its graph"
        mine = stage_nodes(strategy, graph, stage)
        params &= {t for n in mine for t in graph.node_by_name[n].inputs}
        out["send"] = planned_sends(strategy, graph, stage)
        out[Collective.ALL_REDUCE.value] += len(shared_parameters(strategy, graph, stage))
        if strategy.pipeline.result_broadcast:
            out[Collective.BROADCAST.value] += 1
    resharded = {r.tensor for r in strategy.reshards}
    k = strategy.training.micro_batches
    fusion = strategy.training.comm_fusion
    # A parameter's gradient all-reduce (ZeRO: its reduce-scatters and the updated shard's gathers) when
    # it is used where stored: bucketed (`costmodel.buckets`) — tensor → (axes, bytes) per purpose.
    bucketed: dict[Purpose, dict[str, tuple[set[int], float]]] = {p: {} for p in _BUCKETED}
    stages: dict[str, int] = {}
    for name, node in strategy.nodes.items():
        for c in node.collectives:
            if c.purpose in _BUCKETED and c.tensor in params and c.tensor not in resharded:
                axes, nbytes = bucketed[c.purpose].get(c.tensor, (set(), 0.0))
                bucketed[c.purpose][c.tensor] = (axes | set(c.axes), max(nbytes, c.size_bytes))
                if c.purpose is Purpose.GRAD_REDUCE_SCATTER:
                    stages[c.tensor] = 2 if c.cadence is Cadence.MICRO_BATCH else 1
                continue
            if mine is not None and name not in mine:  # another pipeline stage's
                continue
            kind = c.kind
            if kind is Collective.ALL_TO_ALL and backend == "gloo":
                kind = Collective.ALL_GATHER
            out[kind.value] += k if c.cadence is Cadence.MICRO_BATCH else 1

    def grads(purpose: Purpose) -> dict[str, tuple[tuple[int, ...], float]]:
        return {t: (tuple(sorted(axes)), b) for t, (axes, b) in bucketed[purpose].items()}

    syncs = grads(Purpose.GRAD_SYNC)  # a ZeRO parameter's: the all-reduce of its shard (a shard group
    # smaller than the data-parallel group), per unit
    for bucket_axes, _ in pack_buckets({t: g for t, g in syncs.items() if t not in stages}, fusion.allreduce):
        out[Collective.ALL_REDUCE.value] += len(bucket_axes)
    units = zero_units({t: (tuple(sorted({*axes, *syncs.get(t, ((), 0.0))[0]})), b)
                        for t, (axes, b) in grads(Purpose.GRAD_REDUCE_SCATTER).items()}, stages, fusion)
    shape = tuple(strategy.mesh.shape)
    for unit in units:
        sharded, rest = zero_split(unit.axes, shape, strategy.training.zero_shard_size)
        per = k if unit.stage == 2 else 1
        out[Collective.REDUCE_SCATTER.value] += len(sharded) * per
        if rest:
            out[Collective.ALL_REDUCE.value] += len(rest) * per
    weights = {t: b for t, (_, b) in bucketed[Purpose.PARAM_GATHER].items()}
    for group in gather_groups(units, weights, fusion.allgather):
        out[Collective.ALL_GATHER.value] += len(zero_split(units[group[0]].axes, shape,
                                                           strategy.training.zero_shard_size)[0])
    return {kind: n for kind, n in out.items() if n}


_BUCKETED = (Purpose.GRAD_SYNC, Purpose.GRAD_REDUCE_SCATTER, Purpose.PARAM_GATHER)


def check_step(strategy: Strategy, graph: OpGraph) -> None:
    """Refuse, before any rank starts, a training step the executor cannot run as planned."""
    if strategy.pipeline is not None:
        check_pipeline(strategy, graph)
    tr = strategy.training
    if tr.attention == Attention.FUSED_SOFTMAX or tr.attention_dropout:
        raise RunError(f"the executor runs attention as FlashAttention (torch's SDPA) or torch's eager ops, without "
                       f"dropout; this plan prices {tr.attention} attention"
                       + (f" with dropout {tr.attention_dropout:g}" if tr.attention_dropout else "")
                       + ": plan with `attention` flash or eager and `attention_dropout` 0 to run it")
    k = strategy.training.micro_batches
    # The batch every input starts with: bound as the dim "batch", or (a static export) as traced.
    first = graph.tensors[graph.inputs[0]].shape if graph.inputs else ()
    batch = strategy.model.dims.get("batch", first[0] if first else None)
    odd = [t for t in graph.inputs if not graph.tensors[t].shape or graph.tensors[t].shape[0] != batch]
    if k > 1 and (batch is None or odd):
        raise RunError(f"{k} micro-batches split every input along dim 0, the batch, but input(s) "
                       f"{', '.join(odd) or graph.inputs[0]} do not start with the batch dim; plan with "
                       "`accumulation_steps` 1")


class PipelineRunError(MeshplanError):
    """A pipelined plan the executor cannot run as planned."""


def check_pipeline(strategy: Strategy, graph: OpGraph) -> None:
    """Refuse, before any rank starts, a pipeline the executor cannot run as planned."""
    pipe = strategy.pipeline
    assert pipe is not None
    n = strategy.mesh.num_devices
    for s, st in enumerate(pipe.stages):
        if tuple(st.devices) != tuple(range(s * n, (s + 1) * n)):
            raise PipelineRunError(f"pipeline stage {s} runs on devices {list(st.devices)}; the executor lays stage s "
                                   f"on ranks {s * n}…{(s + 1) * n - 1} (plan with `layout` pp=…)")
    tr = strategy.training
    stages = set(tr.zero_stages.values()) if tr.zero_stages is not None else {tr.zero_stage}
    p, v, m = len(pipe.stages), pipe.virtual_stages, tr.micro_batches
    if 2 in stages and v > 1:
        raise PipelineRunError("ZeRO-2 reduce-scatters each micro-batch's gradients, and interleaved stages finish a "
                               "micro-batch's backward chunk by chunk; plan with `zero_stage` 1 or `zero_stage` 3, or without vpp")
    held = param_stages(graph, strategy_chunks(graph, pipe), p)
    zero = tr.zero_stages or {}
    tied = sorted(t for t, s in held.items() if len(s) > 1 and zero.get(t, 0) in (1, 2))
    if tied:
        raise PipelineRunError(f"{tied[0]} is read by pipeline stages {', '.join(map(str, held[tied[0]]))} (a tied weight) "
                               f"and its optimizer states are ZeRO-{zero[tied[0]]} sharded: the executor sums "
                               "the copies' gradients after each stage's reduction, which ZeRO-1/2 leave scattered; "
                               "plan with `zero_stage` 0 or `zero_stage` 3")
    if v > 1 and m % p:
        raise PipelineRunError(f"interleaved 1F1B runs micro-batches in rounds of {p} (the stages); {m} micro-batches "
                               f"are not a multiple: plan with `global_batch_size` a multiple of {p} micro-batches")


def planned_sends(strategy: Strategy, graph: OpGraph, stage: int) -> int:
    """The sends a rank of `stage` runs in one step: per micro-batch, what crosses out of each of its
    chunks forward, and the gradients of the float tensors that crossed into it, backward."""
    pipe = strategy.pipeline
    assert pipe is not None
    p, v = len(pipe.stages), pipe.virtual_stages
    xs = crossings(graph, strategy_chunks(graph, pipe))
    per_micro = sum(sum(x.crosses(c) for x in xs) + sum(x.grad and x.crosses(c - 1) for x in xs)
                    for c in range(p * v) if c % p == stage)
    return per_micro * strategy.training.micro_batches


def stage_nodes(strategy: Strategy, graph: OpGraph, stage: int) -> set[str]:
    pipe = strategy.pipeline
    assert pipe is not None
    return {x for x, c in strategy_chunks(graph, pipe).items() if c % len(pipe.stages) == stage}


def shared_parameters(strategy: Strategy, graph: OpGraph, stage: int) -> list[str]:
    """The parameters `stage` holds a copy of, all-reduced with the other stages' copies each step."""
    pipe = strategy.pipeline
    assert pipe is not None
    held = param_stages(graph, strategy_chunks(graph, pipe), len(pipe.stages))
    return sorted(t for t, s in held.items() if len(s) > 1 and stage in s)
