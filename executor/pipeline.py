"""One rank's work for a pipelined plan: its stage's model chunks run by torch.distributed.pipelining.

The ranks form a (pp, *stage mesh) device mesh: stage s holds ranks s·n … (s + 1)·n − 1, laid out as the
strategy's mesh, which is one stage's. Each rank builds the model, keeps the parameters its stage reads
(`SpmdRunner` on its stage's sub-mesh, which applies the intra-stage placements with DTensor) and
wraps each of its model chunks (chunk c of p·v on stage c mod p) as a `PipelineStage` whose forward
runs the chunk's nodes. What crosses a chunk boundary (`planner.pipeline.crossings`) is sent as each
rank's local shard, to the rank at the same place of the next stage's sub-mesh (the plan gives a
tensor one placement on every stage, so the shard is what the receiver needs); a float one's gradient
comes back. The schedule (`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`) splits the
step's batch into the plan's micro-batches, runs the loss on the last stage and accumulates the
gradients. Then a parameter several stages read (tied embeddings) has its gradient all-reduced between
their copies, each stage reduces its gradients over its own mesh (buckets, ZeRO) and steps its optimizer.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import Shard

from costmodel.loss import loss_input_spec, loss_kind
from executor.interpreter import load_module
from executor.measure import CollectiveCounter, SavedMeter
from executor.spmd import SpmdRunner, local_shard
from planner.errors import MeshplanError
from planner.graph import OpGraph
from planner.pipeline import crossings, param_stages, strategy_chunks
from planner.placement import Spec
from planner.strategy import Strategy

# A pipelined step's measured phases, in order (summed over the micro-batches): its chunks' forwards and
# backwards, the rest of the schedule (waits, sends, the loss), the gradient reductions after it, the
# optimizer step.
PIPELINE_PHASES = ("forward", "backward", "pipeline_wait", "gradient_sync", "optimizer")


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
                                   f"on ranks {s * n}…{(s + 1) * n - 1} (plan with --layout pp=…)")
    tr = strategy.training
    stages = set(tr.zero_stages.values()) if tr.zero_stages is not None else {tr.zero_stage}
    p, v, m = len(pipe.stages), pipe.virtual_stages, tr.micro_batches
    if 2 in stages and v > 1:
        raise PipelineRunError("ZeRO-2 reduce-scatters each micro-batch's gradients, and interleaved stages finish a "
                               "micro-batch's backward chunk by chunk; plan with --zero 1 or --zero 3, or without vpp")
    held = param_stages(graph, strategy_chunks(graph, pipe), p)
    zero = tr.zero_stages or {}
    tied = sorted(t for t, s in held.items() if len(s) > 1 and zero.get(t, 0) in (1, 2))
    if tied:
        raise PipelineRunError(f"{tied[0]} is read by pipeline stages {', '.join(map(str, held[tied[0]]))} (a tied weight) "
                               f"and its optimizer states are ZeRO-{zero[tied[0]]} sharded: the executor sums "
                               "the copies' gradients after each stage's reduction, which ZeRO-1/2 leave scattered; "
                               "plan with --zero 0 or --zero 3")
    if v > 1 and m % p:
        raise PipelineRunError(f"interleaved 1F1B runs micro-batches in rounds of {p} (the stages); {m} micro-batches "
                               f"are not a multiple: plan with --global-batch-size a multiple of {p} micro-batches")


def schedule_class(schedule: str) -> type:
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[schedule]


class ChunkModule(nn.Module):
    """One model chunk as the pipeline stage's module: the tensors sent to it in, the tensors it sends
    (the last chunk: the model's first output, which the loss reads) out, all local shards."""

    def __init__(self, runner: SpmdRunner, nodes: set[str], inputs: list[str], outputs: list[str], graph: OpGraph,
                 last: bool) -> None:
        super().__init__()
        self.runner, self.nodes, self.inputs, self.outputs, self.last = runner, nodes, inputs, outputs, last
        # A float tensor sent on is one whose gradient comes back (`crossings`): one that needs none here
        # (computed from the ids alone) is sent as a leaf that does, its gradient then dropped.
        self.float_out = [graph.tensors[t].is_float for t in outputs]

    def forward(self, *xs: torch.Tensor) -> Any:
        outs = self.runner.run_chunk(dict(zip(self.inputs, xs, strict=True)), self.nodes, self.outputs)
        outs = [o.detach().requires_grad_() if f and not o.requires_grad else o
                for o, f in zip(outs, self.float_out, strict=True)]
        return outs[0] if self.last else tuple(outs)


class CountedStage(PipelineStage):
    """A pipeline stage that counts the sends it issues (forward activations, backward gradients)
    while `counting` is set, times its chunks' forwards and backwards (`spent`, seconds since the
    last reset: the compute alone — the schedule waits for a chunk's inputs before it, and posts its
    sends after it), and calls `after_backward` (ZeRO-2's reduce-scatter) after each micro-batch's
    backward."""

    counting = False
    sends = 0
    spent: ClassVar[dict[str, float]] = {"forward": 0.0, "backward": 0.0}  # this rank's stages, as `sends`
    after_backward: Callable[[], None] | None = None

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> Any:
        t0 = time.perf_counter()
        out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        CountedStage.spent["forward"] += time.perf_counter() - t0
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        t0 = time.perf_counter()
        out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                         last_backward=last_backward)
        CountedStage.spent["backward"] += time.perf_counter() - t0
        if self.after_backward is not None:
            self.after_backward()
        return out

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_bwd_send_ops(bwd_chunk_id))

    def _counted(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        if CountedStage.counting:
            CountedStage.sends += len(ops)
        return ops


@contextmanager
def counting_sends() -> Iterator[None]:
    CountedStage.counting, CountedStage.sends = True, 0
    try:
        yield
    finally:
        CountedStage.counting = False


def run_pipelined_rank(strategy: Strategy, model_path: str, opts: Any, device: torch.device) -> dict[str, Any]:
    """Runs on every rank of an initialised process group; returns this rank's report (as `run_rank`)."""
    from executor.train import Loss, _batch_shards, _optimizer, diverge, make_batch, micro_batch, state_bytes

    pipe = strategy.pipeline
    assert pipe is not None
    p, v, m = len(pipe.stages), pipe.virtual_stages, strategy.training.micro_batches
    axes = tuple(strategy.mesh.axis_names)
    world = init_device_mesh(device.type, (p, *strategy.mesh.shape), mesh_dim_names=("pp", *axes))
    mesh: DeviceMesh = world[axes if len(axes) > 1 else axes[0]]
    rank = dist.get_rank()
    n = strategy.mesh.num_devices
    stage, place = divmod(rank, n)
    module = load_module(model_path, strategy.model.dims, seed=opts.seed).to_device(device)
    graph = module.graph
    strategy.check_model(graph)
    check_pipeline(strategy, graph)
    chunk_of = strategy_chunks(graph, pipe)
    mine = [c for c in range(p * v) if c % p == stage]
    nodes = {chunk: {x for x, c in chunk_of.items() if c == chunk} for chunk in mine}
    holders = param_stages(graph, chunk_of, p)
    shared = sorted(t for t, held in holders.items() if len(held) > 1)
    # Every rank creates every group, in the same order.
    tie_groups = {}
    for t in shared:
        for j in range(n):
            group = dist.new_group([pipe.stages[s].devices[j] for s in holders[t]])
            if j == place and stage in holders[t]:
                tie_groups[t] = group
    stage_group = [dist.new_group(list(st.devices)) for st in pipe.stages][stage]
    if opts.diverge_ranks:
        with torch.no_grad():
            diverge(module, opts.seed)
    runner = SpmdRunner(module, strategy, mesh, nodes=set().union(*nodes.values()))
    before = 0  # optimizer steps the parameters had (a loaded checkpoint's)
    if opts.load:
        from executor import checkpoint

        before = int(checkpoint.check_model(opts.load, strategy)["optimizer_steps"])
        checkpoint.load_model(opts.load, runner)
    with torch.no_grad():
        if strategy.training.parameter_broadcast:  # every stage starts from its first rank's parameters
            for prm in module.parameters():
                dist.broadcast(prm.data, src=pipe.stages[stage].devices[0], group=stage_group)
            for t in shared:  # and a tied weight's copies from the first stage's
                dist.broadcast(runner._params[t].data, src=pipe.stages[holders[t][0]].devices[place],
                               group=tie_groups[t])

    cpu_batch = make_batch(graph, opts.seed, m)
    batch = [b.to(device) for b in cpu_batch]
    loss_of = Loss(graph, loss_kind(graph, strategy.settings.loss if opts.loss == "auto" else opts.loss), opts.seed, m,
                   scale=1.0 if strategy.training.gradients_mean else _batch_shards(strategy))
    out_name = graph.outputs[0]
    need = runner.dtensor(loss_input_spec(loss_of.kind, strategy.spec_of(out_name) or Spec.replicated(mesh.ndim),
                                          len(graph.tensors[out_name].shape)))
    split = [a for a, pl in enumerate(need) if isinstance(pl, Shard)]
    first, last = stage == 0, stage == p - 1
    # The step's batch as this rank's data loader gives it: each micro-batch's shard, stacked, so that the
    # schedule's split along dim 0 hands each micro-batch its shard.
    inputs = [torch.cat(parts) for parts in zip(*(runner.shard_inputs([micro_batch(x, i, m) for x in batch])
                                                 for i in range(m)), strict=True)] if first else []
    target = torch.cat([local_shard(micro_batch(loss_of.labels.to(device), i, m), need, mesh) for i in range(m)]) \
        if last and loss_of.labels is not None else None

    def loss_fn(y: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = loss_of.local(runner.output_as(0, y, need), labels)
        return out

    xs = crossings(graph, chunk_of)
    stages = []
    for c in mine:
        ins = list(graph.inputs) if c == 0 else [x.tensor for x in xs if x.crosses(c - 1)]
        outs = [out_name] if c == p * v - 1 else [x.tensor for x in xs if x.crosses(c)]
        stages.append(CountedStage(ChunkModule(runner, nodes[c], ins, outs, graph, c == p * v - 1), c, p * v,
                                    device, group=world.get_group("pp")))
    if v == 1:
        # ZeRO-2: a micro-batch's gradients reduce-scattered as soon as its backward ends here. Not in the
        # first step: its micro-batches in flight were run on the parameters before the buckets fused
        # them, and the step's reduction reduce-scatters their sum once.
        stages[0].after_backward = lambda: runner.after_micro_batch() if runner.packed else None
    kind = schedule_class(pipe.schedule)
    schedule = kind(stages if pipe.schedule == "interleaved" else stages[0], m, loss_fn=loss_fn, scale_grads=False)
    meter = SavedMeter(module)

    def step(measure: bool = False, count: bool = False) -> tuple[torch.Tensor, dict[str, int], list[float]]:
        runner.zero_grad()
        losses: list[torch.Tensor] = []
        meter.reset()
        runner.regather.on_saved = meter.pack if measure else None
        runner.on_kept = meter.keep if measure else None  # a recomputed layer's inputs, kept to backward
        runner.recompute_watch = meter.watch if measure else None
        comm = CollectiveCounter() if count else None
        hooks = torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack) if measure else nullcontext()
        with comm if comm is not None else nullcontext(), counting_sends() if count else nullcontext():
            CountedStage.spent = {"forward": 0.0, "backward": 0.0}
            t0 = time.perf_counter()
            with hooks:
                schedule.step(*inputs, target=target, losses=losses)
            t1 = time.perf_counter()
            fwd, bwd = CountedStage.spent["forward"], CountedStage.spent["backward"]
            runner.reduce_gradients()
            # A tied weight's copies: each one's gradient reduced over its own stage's mesh (whatever way
            # its uses there left it partial), then the copies' gradients summed (Megatron's embedding group).
            for t, group in tie_groups.items():
                dist.all_reduce(runner._params[t].grad, group=group)
            loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=device)
            if pipe.result_broadcast:  # every stage learns the step's loss (this rank's addend of it)
                dist.broadcast(loss, src=pipe.stages[-1].devices[place], group=world.get_group("pp"))
        executed = dict(comm.counts) if comm is not None else {}
        # The schedule's time beyond its chunks' compute: waiting for the other stages' sends (their
        # compute and the transfer), posting its own, the last stage's loss, ZeRO-2's reduce-scatters.
        return loss, executed, [fwd, bwd, t1 - t0 - fwd - bwd, time.perf_counter() - t1]

    report: dict[str, Any] = {"rank": rank, "stage": stage}
    first_loss, _, _ = step(measure=True)  # the first step also infers the stages' shapes
    optim = _optimizer(runner.optimizer_parameters(), opts)
    if opts.load:
        checkpoint.init_optimizer_state(runner, optim)
        checkpoint.load_optimizer(opts.load, runner, optim)
    first_loss = first_loss.to(device)
    for a in split:
        dist.all_reduce(first_loss, group=mesh.get_group(a))
    if not pipe.result_broadcast:  # only the last stage's ranks hold it
        dist.all_reduce(first_loss, group=world.get_group("pp"))
    own = [(name, runner._params[name]) for name in module.param_names]
    if opts.verify:
        grads = {name: runner.gradient(name).cpu().clone() for name, _ in own}
    optim.step()
    runner.after_optimizer_step()
    if opts.verify:
        after = {name: runner.full_parameter(name, prm.detach()).cpu().clone() for name, prm in own}
    times, phases = [], []
    peak_saved = meter.peak
    rounds = max(opts.warmup, 1) + opts.steps  # the first warm-up step counts what it runs
    for i in range(rounds):
        warm = i < rounds - opts.steps
        dist.barrier()
        t0 = time.perf_counter()
        _, executed, spans = step(measure=warm and i > 0, count=i == 0)
        t1 = time.perf_counter()
        if i == 0:
            with CollectiveCounter() as comm:
                optim.step()
                runner.after_optimizer_step()
            report["collectives_executed"] = {**dict(Counter(executed) + comm.counts),
                                              **({"send": CountedStage.sends} if CountedStage.sends else {})}
        else:
            optim.step()
            runner.after_optimizer_step()
        t2 = time.perf_counter()
        if warm and i > 0:
            peak_saved = max(peak_saved, meter.peak)
        if not warm:
            times.append(t2 - t0)
            phases.append([*spans, t2 - t1])
    if opts.verify:
        from executor.train import verify_against_one_process

        final = {name: runner.full_parameter(name, prm.detach()).cpu() for name, prm in own}
        report["trained_parameters"] = sum(t.numel() for name, t in final.items()
                                           if holders[name][0] == stage)  # a tied weight once
        dims = dict(strategy.model.dims)
        dims["batch"] *= m
        report.update(verify_against_one_process(model_path, dims, opts, cpu_batch, loss_of, float(first_loss),
                                                 grads, after, final, steps=1 + rounds, offset=before))
    if opts.save:
        from executor import checkpoint

        checkpoint.save(opts.save, runner, optim, strategy, before + 1 + rounds)
    report["optimizer_steps_before"] = before
    report["loss"] = float(first_loss)
    report["measured_step_s"] = statistics.median(times) if times else None
    report["measured_phases_s"] = {name: statistics.median(ph[k] for ph in phases) for k, name in
                                   enumerate(PIPELINE_PHASES)} if phases else {}
    report["measured_memory_bytes"] = state_bytes(module, optim, runner) + peak_saved
    return report


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

