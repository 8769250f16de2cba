"""What is known of a run before any rank starts, without torch: the options a run is asked for, the
checks that refuse a plan the executor cannot run as planned, and the collectives each rank should
run in a step, as the strategy file records them (its nodes' priced collectives and its priced
gradient buckets).

`meshplan run` checks before spawning the ranks; a rank started by torchrun checks again."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from core.collectives import Cadence, Collective, Purpose
from core.errors import MeshplanError
from core.experts import EXPERT_PARALLEL, ExpertRegion, expert_region, find_expert_blocks
from core.graph import OpGraph, TensorKind
from core.levers import Attention, LossKind, Offload, Recompute
from core.placement import Shard
from costmodel.bucketing import is_bucketed
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


EXPERT_PURPOSES = (Purpose.EXPERT_DISPATCH, Purpose.EXPERT_COMBINE)


class RunError(MeshplanError):
    """A run that cannot start (mismatched strategy, model, rank count) or a rank that failed."""


def planned_counts(strategy: Strategy, *, backend: str = "gloo", graph: OpGraph | None = None,
                   stage: int = 0) -> dict[str, int] | None:
    """The plan's collectives by kind in one optimizer step, as the strategy file records them: its
    nodes' collectives, those of each micro-batch as many times as there are micro-batches, and its
    gradient buckets (`cost.buckets`: the parameters' all-reduces, or ZeRO's reduce-scatters and
    gathers, packed as the cost model priced them), each once per step or (ZeRO-2's reduce-scatter)
    per micro-batch; DTensor on CPU performs an all_to_all as all_gather + local chunk (expert
    parallelism's own all-to-alls are all-to-alls on every backend). A pipelined
    plan's (`graph` needed): those of a rank of `stage`, its nodes' and its buckets only, with its
    sends to the neighbouring stages (`send`) and one all-reduce per tied parameter it holds a copy of.
    None: a file written before strategies recorded their buckets (it runs; its counts are not known)."""
    if strategy.buckets is None:
        return None
    params = {t for t, v in strategy.tensors.items() if v.kind is TensorKind.PARAM}
    mine: set[str] | None = None
    out: Counter[str] = Counter()
    if strategy.pipeline is not None:
        assert graph is not None, "a pipelined plan's counts need its graph"
        mine = stage_nodes(strategy, graph, stage)
        out["send"] = planned_sends(strategy, graph, stage)
        out[Collective.ALL_REDUCE.value] += len(shared_parameters(strategy, graph, stage))
        if strategy.pipeline.result_broadcast:
            out[Collective.BROADCAST.value] += 1
    resharded = {r.tensor for r in strategy.reshards}
    k = strategy.training.micro_batches
    for name, node in strategy.nodes.items():
        if mine is not None and name not in mine:  # another pipeline stage's
            continue
        for c in node.collectives:
            if is_bucketed(c, params, resharded):
                continue  # its share of a bucket, counted below
            kind = c.kind
            if kind is Collective.ALL_TO_ALL and backend == "gloo" and c.purpose not in EXPERT_PURPOSES:
                kind = Collective.ALL_GATHER
            out[kind.value] += k if c.cadence is Cadence.MICRO_BATCH else 1
    for b in strategy.buckets:
        if strategy.pipeline is None or b.stage == stage:
            out[b.kind.value] += k if b.cadence is Cadence.MICRO_BATCH else 1
    return {kind: n for kind, n in out.items() if n}


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
    weights_out = sorted(t for t, m in tr.offload.items() if m == Offload.PARAMS)
    if weights_out:
        raise RunError(f"the plan keeps {weights_out[0]}'s weights on the host (offload params,optimizer; "
                       f"{len(weights_out)} parameters): `run` keeps every weight on its device; train it under "
                       "meshplan.apply (FSDP2's CPUOffloadPolicy) or plan with `offload` optimizer")
    if tr.offload_activations and strategy.pipeline is not None:
        raise RunError("the plan keeps saved activations on the host inside pipeline stages, which meshplan does "
                       "not plan (a stage's chunks can cut a layer); plan with `offload` without activations")
    for block in find_expert_blocks(graph):
        kernels = strategy.nodes[block.gathers[0]].kernels
        if EXPERT_PARALLEL not in kernels:
            continue
        region = expert_region(graph, block)
        if region is None:
            raise RunError(f"the experts of {block.module or block.topk} are not one row-wise region from their "
                           "gathers to their last matmul, which the executor runs expert-parallel; plan without ep")
        check_expert_region(strategy, graph, region)
        if strategy.training.recompute_policy == Recompute.SELECTIVE:
            raise RunError("the plan splits experts over ep under selective recomputation, which the executor does "
                           "not run yet; plan with `recompute` none, full or auto")
    k = strategy.training.micro_batches
    # The batch every input starts with: bound as the dim "batch", or (a static export) as traced.
    first = graph.tensors[graph.inputs[0]].shape if graph.inputs else ()
    batch = strategy.model.dims.get("batch", first[0] if first else None)
    odd = [t for t in graph.inputs if not graph.tensors[t].shape or graph.tensors[t].shape[0] != batch]
    if k > 1 and (batch is None or odd):
        raise RunError(f"{k} micro-batches split every input along dim 0, the batch, but input(s) "
                       f"{', '.join(odd) or graph.inputs[0]} do not start with the batch dim; plan with "
                       "`accumulation_steps` 1")


def check_expert_region(strategy: Strategy, graph: OpGraph, region: ExpertRegion) -> None:
    """A block's experts run where they are only as planned: every tensor of the region one row per slot
    split on dim 0 over ep (the weights on the experts' dim, split there only), none reshaped (the rows a
    rank gets are known only at run time)."""
    ep = strategy.mesh.axis_names.index("ep")
    where = region.block.module or region.block.topk
    for name in region.nodes:
        node, plan = graph.node_by_name[name], strategy.nodes[name]
        if node.op_type in ("Reshape", "Expand"):
            raise RunError(f"the experts of {where} reshape their slots ({name}), which expert parallelism runs on "
                           "a count known only at run time; plan without ep")
        specs = [*zip(node.inputs, plan.inputs, strict=True), *zip(node.outputs, plan.outputs, strict=True)]
        for t, spec in specs:
            if spec is None or not t or graph.tensors[t].kind is TensorKind.CONSTANT:
                continue
            weights = name in region.block.gathers and t == node.inputs[0]
            if spec.placements[ep] != Shard(0) or (weights and spec.num_shards(0, strategy.mesh.shape) != strategy.mesh.shape[ep]):
                raise RunError(f"the experts of {where}: {t} is placed {spec} at {name}, not split on dim 0 over ep "
                               "alone as the executor runs expert parallelism; plan without ep")


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
