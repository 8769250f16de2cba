"""One rank's work for a pipelined plan: its stage's model chunks run by torch.distributed.pipelining.

The ranks form a (pp, *stage mesh) device mesh: stage s holds ranks s·n … (s + 1)·n − 1, laid out as the
strategy's mesh, which is one stage's. Each rank builds the model, keeps the parameters its stage reads
(`SpmdRunner` on its stage's sub-mesh, which applies the intra-stage placements with DTensor) and
wraps each of its model chunks (chunk c of p·v on stage c mod p) as a `PipelineStage` whose forward
runs the chunk's nodes. What crosses a chunk boundary (`planner.search.pipeline.crossings`) is sent as each
rank's local shard, to the rank at the same place of the next stage's sub-mesh (the plan gives a
tensor one placement on every stage, so the shard is what the receiver needs); a float one's gradient
comes back. The schedule (`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`) splits the
step's batch into the plan's micro-batches, runs the loss on the last stage and accumulates the
gradients. Then a parameter several stages read (tied embeddings) has its gradient all-reduced between
their copies, each stage reduces its gradients over its own mesh (buckets, ZeRO) and steps its optimizer.
"""

from __future__ import annotations

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

from core.collectives import Collective
from core.graph import OpGraph
from core.levers import LossKind, Schedule
from core.placement import Spec
from costmodel.loss import loss_input_spec, loss_kind
from executor.context import ring_passes
from executor.dtensors import local_shard
from executor.groups import check_groups, mesh_groups
from executor.interpreter import load_module
from executor.measure import CollectiveCounter, SavedMeter
from executor.preflight import RunOptions, check_step
from executor.spmd import SpmdRunner
from executor.step import Loss, batch_shards, clock, diverge, make_batch, micro_batch, precision_context
from planner.stagecut import crossings, param_stages, strategy_chunks
from planner.strategy import Strategy
from planner.strategy_pipeline import Pipeline

# A pipelined step's measured phases, in order (summed over the micro-batches): its chunks' forwards and
# backwards, the rest of the schedule (waits, sends, the loss), the gradient reductions after it, the
# optimizer step.
PIPELINE_PHASES = ("forward", "backward", "pipeline_wait", "gradient_sync", "optimizer")


def schedule_class(schedule: Schedule) -> type:
    return {Schedule.GPIPE: ScheduleGPipe, Schedule.ONE_F_ONE_B: Schedule1F1B,
            Schedule.INTERLEAVED: ScheduleInterleaved1F1B}[Schedule(schedule)]


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
        t0 = clock()
        out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        CountedStage.spent["forward"] += clock() - t0
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        t0 = clock()
        out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                         last_backward=last_backward)
        CountedStage.spent["backward"] += clock() - t0
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


def stage_groups(pipe: Pipeline, holders: dict[str, tuple[int, ...]], shared: list[str], stage: int,
                 place: int) -> tuple[dict[str, Any], Any]:
    """The groups summing a tied weight's copies across the stages reading it (one per position in the
    stage mesh), this rank's by weight, and this rank's stage group. Every rank creates every group, in
    the same order (`planner/groups.py` lists them)."""
    tie_groups = {}
    for t in shared:
        for j in range(len(pipe.stages[0].devices)):
            group = dist.new_group([pipe.stages[s].devices[j] for s in holders[t]])
            if j == place and stage in holders[t]:
                tie_groups[t] = group
    return tie_groups, [dist.new_group(list(st.devices)) for st in pipe.stages][stage]


class PipelinedStep:
    """This rank's part of a pipelined plan (the rank loop is `executor.train.run_rank`): its stage's
    chunks as `PipelineStage`s on a (pp, *stage mesh) device mesh, driven by the plan's schedule; then
    the tied weights' copies summed across stages and the stage's gradients reduced over its mesh."""

    phases: tuple[str, ...] = PIPELINE_PHASES[:-1]

    def __init__(self, strategy: Strategy, model_path: str, opts: RunOptions, device: torch.device) -> None:
        assert strategy.pipeline is not None
        self.counted_by_dtype: Counter[tuple[str, str]] = Counter()
        pipe = self.pipe = strategy.pipeline
        p, v, m = len(pipe.stages), pipe.virtual_stages, strategy.training.micro_batches
        axes = tuple(strategy.mesh.axis_names)
        self.world = init_device_mesh(device.type, (p, *strategy.mesh.shape), mesh_dim_names=("pp", *axes))
        self.mesh: DeviceMesh = self.world[axes if len(axes) > 1 else axes[0]]
        self.device, self.strategy_dtype = device, strategy.settings.dtype
        n = strategy.mesh.num_devices
        self.stage, self.place = stage, place = divmod(dist.get_rank(), n)
        self.module = module = load_module(model_path, strategy.model.dims, seed=opts.seed).to_device(device)
        graph = module.graph
        strategy.check_model(graph)
        check_step(strategy, graph)
        chunk_of = strategy_chunks(graph, pipe)
        mine = [c for c in range(p * v) if c % p == stage]
        nodes = {chunk: {x for x, c in chunk_of.items() if c == chunk} for chunk in mine}
        self.holders = holders = param_stages(graph, chunk_of, p)
        self.shared = sorted(t for t, held in holders.items() if len(held) > 1)
        self.tie_groups, self.stage_group = stage_groups(pipe, holders, self.shared, stage, place)
        self.groups_checked = check_groups(strategy, graph, [
            *mesh_groups(self.world), ("pipeline stage", tuple(dist.get_process_group_ranks(self.stage_group))),
            *((f"tied weight {t}", tuple(dist.get_process_group_ranks(g))) for t, g in self.tie_groups.items())])
        if opts.diverge_ranks:
            with torch.no_grad():
                diverge(module, opts.seed)
        self.runner = runner = SpmdRunner(module, strategy, self.mesh, nodes=set().union(*nodes.values()))
        self.parameter_broadcast = strategy.training.parameter_broadcast

        self.cpu_batch = make_batch(graph, opts.seed, m)
        batch = [b.to(device) for b in self.cpu_batch]
        self.loss = loss_of = Loss(graph, loss_kind(graph, strategy.settings.loss if opts.loss == LossKind.AUTO else opts.loss),
                                   opts.seed, m, scale=1.0 if strategy.training.gradients_mean else batch_shards(strategy))
        out_name = graph.outputs[0]
        need = runner.dtensor(loss_input_spec(loss_of.kind, strategy.spec_of(out_name) or Spec.replicated(self.mesh.ndim),
                                              len(graph.tensors[out_name].shape)))
        self.split = [a for a, pl in enumerate(need) if isinstance(pl, Shard)]
        first, last = stage == 0, stage == p - 1
        # The step's batch as this rank's data loader gives it: each micro-batch's shard, stacked, so that the
        # schedule's split along dim 0 hands each micro-batch its shard.
        self.inputs = [torch.cat(parts) for parts in zip(*(runner.shard_inputs([micro_batch(x, i, m) for x in batch])
                                                          for i in range(m)), strict=True)] if first else []
        self.target = torch.cat([local_shard(micro_batch(loss_of.labels.to(device), i, m), need, self.mesh)
                                 for i in range(m)]) if last and loss_of.labels is not None else None

        def loss_fn(y: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
            out: torch.Tensor = loss_of.local(runner.output_as(0, y, need), labels)
            return out

        xs = crossings(graph, chunk_of)
        stages = []
        for c in mine:
            ins = list(graph.inputs) if c == 0 else [x.tensor for x in xs if x.crosses(c - 1)]
            outs = [out_name] if c == p * v - 1 else [x.tensor for x in xs if x.crosses(c)]
            stages.append(CountedStage(ChunkModule(runner, nodes[c], ins, outs, graph, c == p * v - 1), c, p * v,
                                        device, group=self.world.get_group("pp")))
        if v == 1:
            # ZeRO-2: a micro-batch's gradients reduce-scattered as soon as its backward ends here. Not in the
            # first step: its micro-batches in flight were run on the parameters before the buckets fused
            # them, and the step's reduction reduce-scatters their sum once.
            stages[0].after_backward = lambda: runner.after_micro_batch() if runner.packed else None
        kind = schedule_class(pipe.schedule)
        self.schedule = kind(stages if pipe.schedule == Schedule.INTERLEAVED else stages[0], m, loss_fn=loss_fn,
                             scale_grads=False)
        self.meter = SavedMeter(module)

    def after_load(self) -> None:
        pipe, runner = self.pipe, self.runner
        with torch.no_grad():
            if self.parameter_broadcast:  # every stage starts from its first rank's parameters
                for prm in self.module.parameters():
                    dist.broadcast(prm.data, src=pipe.stages[self.stage].devices[0], group=self.stage_group)
                for t in self.shared:  # and a tied weight's copies from the first stage's
                    dist.broadcast(runner.params[t].data, src=pipe.stages[self.holders[t][0]].devices[self.place],
                                   group=self.tie_groups[t])

    def step(self, *, measure: bool = False, count: bool = False) -> tuple[torch.Tensor, dict[str, int], list[float], int]:
        runner, meter = self.runner, self.meter
        runner.zero_grad()
        losses: list[torch.Tensor] = []
        meter.reset()
        runner.regather.on_saved = meter.pack if measure else None
        runner.on_kept = meter.keep if measure else None  # a recomputed layer's inputs, kept to backward
        runner.recompute_watch = meter.watch if measure else None
        comm = CollectiveCounter() if count else None
        passes = ring_passes()  # ring attention's sends, inside a stage's chunks (point to point: not counted by torch)
        hooks = torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack) if measure else nullcontext()
        with comm if comm is not None else nullcontext(), counting_sends() if count else nullcontext():
            CountedStage.spent = {"forward": 0.0, "backward": 0.0}
            t0 = clock(self.device)
            with hooks, precision_context(self.strategy_dtype, self.device):  # forward and backward: the
                self.schedule.step(*self.inputs, target=self.target, losses=losses)  # schedule interleaves them
            t1 = clock(self.device)
            fwd, bwd = CountedStage.spent["forward"], CountedStage.spent["backward"]
            runner.reduce_gradients()
            # A tied weight's copies: each one's gradient reduced over its own stage's mesh (whatever way
            # its uses there left it partial), then the copies' gradients summed (Megatron's embedding group).
            for t, group in self.tie_groups.items():
                dist.all_reduce(runner.params[t].grad, group=group)
            loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.device)
            if self.pipe.result_broadcast:  # every stage learns the step's loss (this rank's addend of it)
                dist.broadcast(loss, src=self.pipe.stages[-1].devices[self.place], group=self.world.get_group("pp"))
        executed = dict(comm.counts) if comm is not None else {}
        if comm is not None:
            self.counted_by_dtype = comm.by_dtype
        if count and CountedStage.sends:
            executed["send"] = CountedStage.sends
        if count and ring_passes() > passes:
            executed[Collective.SEND_RECV.value] = executed.get(Collective.SEND_RECV.value, 0) + ring_passes() - passes
        # The schedule's time beyond its chunks' compute: waiting for the other stages' sends (their
        # compute and the transfer), posting its own, the last stage's loss, ZeRO-2's reduce-scatters.
        return loss, executed, [fwd, bwd, t1 - t0 - fwd - bwd, clock(self.device) - t1], meter.peak

    def whole_loss(self, addend: torch.Tensor) -> torch.Tensor:
        for a in self.split:
            dist.all_reduce(addend, group=self.mesh.get_group(a))
        if not self.pipe.result_broadcast:  # only the last stage's ranks hold it
            dist.all_reduce(addend, group=self.world.get_group("pp"))
        return addend

    def trained_parameters(self, final: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() for name, t in final.items() if self.holders[name][0] == self.stage)  # a tied weight once
