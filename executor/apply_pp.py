"""A pipelined plan on the user's own module (`meshplan.apply`): the module split at the plan's stage
boundaries by torch.distributed.pipelining's tracer, each rank's model chunks run as `PipelineStage`s
under the plan's schedule, each chunk data-parallel over its stage's mesh as `apply` runs one.

The cut: chunk c of the plan starts at a node of one repeated layer (`planner/stagecut.py`); that
layer's module (by the exporter's names) is where `pipeline(..., split_spec={fqn: SplitPoint.BEGINNING})`
splits the traced module, so the chunks hold the layers the plan gives them, under the module's own
parameter names. What a later chunk reads from an earlier one that is not its neighbour (the causal
mask, rotary tables: a skip connection, which torch's schedules do not send) is carried through the
chunks between, as the plan's crossings are (`_carried`). A weight several chunks read (GPT-2's tied
embedding and head) is one copy per chunk: after the schedule each copy's gradient is summed with the
others' over the ranks holding them, as Megatron's embedding group does, so the copies step alike.

Each rank must build the module with the same weights (a seed or a checkpoint): parameters are not
broadcast between stages.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from core.graph import OpGraph
from executor.binding import ApplyError
from planner.strategy import Strategy


def cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The default loss on the last chunk's output: cross-entropy of its logits (the first tensor it
    returns) against the target, over every position (shift the labels for next-token prediction)."""
    logits = output if isinstance(output, torch.Tensor) else next(iter(output.values() if isinstance(output, dict)
                                                                        else output))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


@dataclass
class PipelineRun:
    """This rank's part of a pipelined plan on the module: its chunks (`stages`), the schedule, and the
    groups that sum a shared weight's copies. `step(inputs..., target=...)` runs one training step's
    forward and backward (every rank calls it: the first stage passes the inputs, the last the target)
    and returns the step's mean loss on every rank; then step the optimizer over `parameters()`."""

    schedule: Any
    chunks: list[nn.Module]  # this rank's model chunks (GraphModules holding the module's parameters)
    first: bool
    last: bool
    group: Any  # the pipeline's process group (this rank's place on every stage)
    last_rank: int  # the last stage's rank in `group`'s global numbering
    ties: dict[str, Any] = field(default_factory=dict)  # a shared weight → the group of its copies' ranks
    aliases: dict[str, str] = field(default_factory=dict)  # every parameter name → its weight's first name
    stages: int = 1
    indices: tuple[int, ...] = ()  # this rank's chunks' indices (chunk c on stage c mod stages)
    chunks_total: int = 1
    schedule_name: str = ""

    def parameters(self) -> Iterator[nn.Parameter]:
        seen: set[int] = set()
        for chunk in self.chunks:
            for p in chunk.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = inputs if self.first else ()
        if self.last:
            if target is None:
                raise ApplyError("the last pipeline stage needs the step's target: step(..., target=labels)")
            self.schedule.step(*args, target=target, losses=losses)
        else:
            self.schedule.step(*args)
        self._sum_copies()
        device = next(self.parameters()).device
        loss = torch.stack([x.detach().float() for x in losses]).mean() if losses else torch.zeros((), device=device)
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss

    def _sum_copies(self) -> None:
        """A weight held by several chunks: its copies' gradients (each from its own chunk's use) summed
        over the ranks holding them, and on every copy."""
        for weight, group in self.ties.items():
            copies = {id(p): p for c in self.chunks for n, p in c.named_parameters(remove_duplicate=False)
                      if self.aliases.get(n) == weight}.values()
            grads = [_local(p.grad) for p in copies if p.grad is not None]
            total = torch.stack(grads).sum(0) if grads else torch.zeros_like(_local(next(iter(copies)).data))
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in copies:
                if p.grad is None:
                    p.grad = _like(p, total.clone())
                else:
                    _local(p.grad).copy_(total)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements) if isinstance(p, DTensor) else local


def split_points(s: Strategy, graph: OpGraph, module: nn.Module, layer_module: Callable[[str], str | None]) -> list[str]:
    """The module FQN each model chunk after the first starts at, in chunk order."""
    assert s.pipeline is not None
    p = len(s.pipeline.stages)
    starts = {j * p + st: first for st, stage in enumerate(s.pipeline.stages) for j, (first, _) in enumerate(stage.chunks)}
    layer_of = {n: f"{g.prefix}.{i}" for g in graph.layers for i, names in zip(g.indices, g.nodes, strict=True)
                for n in names}
    first_of: dict[str, str] = {}  # each layer's first node in the graph's order: where a module boundary is
    for node in graph.compute_nodes:
        if node.name in layer_of:
            first_of.setdefault(layer_of[node.name], node.name)
    out = []
    for c in range(1, len(starts)):
        layer = layer_of.get(starts[c])
        fqn = layer_module(layer) if layer is not None else None
        if layer is None or fqn is None or first_of[layer] != starts[c]:
            where = "inside no repeated layer" if layer is None else \
                f"inside layer {layer} (its first node is {first_of[layer]})" if first_of[layer] != starts[c] else \
                f"at layer {layer}, which has no module here"
            raise ApplyError(f"pipeline chunk {c} starts at node {starts[c]}, {where}; apply splits the module only "
                             "between its layers' modules (plan the pipeline with `layout` pp on this module's export)")
        out.append(fqn)
    return out


def trace(module: nn.Module, example: torch.Tensor, splits: list[str]) -> Any:
    """The module traced and split before each of `splits` (torch.distributed.pipelining.pipeline), called
    with `example` as its first argument (and use_cache=False where it has that argument: a transformers
    model's cache is not a tensor the tracer can return)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    params = list(inspect.signature(module.forward).parameters)
    kwargs: dict[str, Any] = {params[0]: example}
    if "use_cache" in params:
        kwargs["use_cache"] = False
    try:
        return pipeline(module, mb_args=(), mb_kwargs=kwargs, split_spec={f: SplitPoint.BEGINNING for f in splits})
    except Exception as e:
        raise ApplyError(f"pipeline: torch's tracer cannot split this module ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]}); plan without pp for apply, or run the plan with "
                         "`meshplan run`") from e


def carried_chunks(split_gm: fx.GraphModule) -> list[fx.GraphModule]:
    """Each chunk of the traced split as a GraphModule taking what crosses into it (for the first: the
    module's inputs) and returning what crosses out of it (for the last: the module's output): values a
    later chunk reads carried through the chunks between (torch's schedules send to neighbours only)."""
    top = split_gm.graph
    calls = [n for n in top.nodes if n.op == "call_module"]
    chunk_of = {n: i for i, n in enumerate(calls)}
    producer: dict[fx.Node, int] = {}
    for n in top.nodes:
        if n.op == "placeholder":
            producer[n] = -1
        elif n in chunk_of:
            producer[n] = chunk_of[n]
        elif n.op == "call_function" and n.target is operator.getitem and n.args[0] in chunk_of:
            producer[n] = chunk_of[n.args[0]]
    k = len(calls)
    last_use: dict[fx.Node, int] = {}
    for c, call in enumerate(calls):
        for a in call.args:
            if isinstance(a, fx.Node):
                last_use[a] = max(last_use.get(a, -1), c)
    output = next(n for n in top.nodes if n.op == "output")
    finals = _leaves(output.args)
    for a in finals:
        last_use[a] = k
    order = [n for n in top.nodes if n in producer and n in last_use]

    def crossing(b: int) -> list[fx.Node]:
        return [v for v in order if producer[v] <= b < last_use[v]]

    return [_carried(getattr(split_gm, str(call.target)), call, crossing(c - 1),
                     finals if c == k - 1 else crossing(c), {v for v in order if producer[v] == c})
            for c, call in enumerate(calls)]


def _carried(sub: fx.GraphModule, call: fx.Node, ins: list[fx.Node], outs: list[fx.Node],
             produced: set[fx.Node]) -> fx.GraphModule:
    """One chunk (`sub`, called at `call` in the split's graph) taking `ins` and returning `outs`: its own
    results where it `produced` them, the inputs it carries through otherwise."""
    g = fx.Graph()
    new_ph = {v: g.placeholder(f"x{i}_{v.name}") for i, v in enumerate(ins)}
    env: dict[fx.Node, Any] = {}
    old_ph = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for ph, a in zip(old_ph, call.args, strict=True):
        env[ph] = new_ph[a]  # type: ignore[index]
    result: Any = None
    for n in sub.graph.nodes:
        if n.op == "output":
            result = fx.node.map_arg(n.args[0], env.__getitem__)
        elif n.op != "placeholder":
            env[n] = g.node_copy(n, env.__getitem__)
    values = [(result if v is call else result[v.args[1]]) if v in produced else new_ph[v] for v in outs]
    g.output(values[0] if len(values) == 1 else tuple(values))
    return fx.GraphModule(sub, g)


def _leaves(args: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(args, lambda x: found.append(x) or x)  # type: ignore[func-returns-value]
    return found


def shared_weights(module: nn.Module, chunks: list[fx.GraphModule], p: int) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Every parameter name → its weight's first name in the module (tied names → one), and each weight
    held by more than one chunk → the stages holding it (one, where an interleaved stage holds two)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for n, prm in module.named_parameters(remove_duplicate=False):
        aliases[n] = first.setdefault(id(prm), n)
    held: dict[str, set[int]] = {}
    for c, chunk in enumerate(chunks):
        for n, _ in chunk.named_parameters(remove_duplicate=False):
            held.setdefault(aliases.get(n, n), set()).add(c)
    return aliases, {w: sorted({c % p for c in cs}) for w, cs in sorted(held.items()) if len(cs) > 1}


def build(s: Strategy, graph: OpGraph, module: nn.Module, world: DeviceMesh, splits: list[str],
          example: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
          parallelize: Callable[[nn.Module], None]) -> PipelineRun:
    """This rank's chunks of `module` (cut before `splits`) as PipelineStages on `world` (pp, *stage mesh),
    each `parallelize`d on the stage's mesh, and the plan's schedule over them."""
    from torch.distributed.pipelining import PipelineStage

    from executor.pipeline import schedule_class

    assert s.pipeline is not None
    p, v, m = len(s.pipeline.stages), s.pipeline.virtual_stages, s.training.micro_batches
    n = s.mesh.num_devices
    stage, place = divmod(dist.get_rank(), n)
    pipe = trace(module, example, splits)
    chunks = carried_chunks(pipe.split_gm)
    if len(chunks) != p * v:
        raise ApplyError(f"pipeline: the traced module split into {len(chunks)} chunks where the plan has {p * v}; "
                         "run the plan with `meshplan run`")
    aliases, shared = shared_weights(module, chunks, p)
    ties = {}
    for w, holders in shared.items():  # every rank creates every group, in the same order
        for j in range(n):
            group = dist.new_group([s.pipeline.stages[st].devices[j] for st in holders]) if len(holders) > 1 else None
            if j == place and stage in holders:
                ties[w] = group  # (None: this stage holds every copy, summed here)
    device = torch.device(world.device_type, torch.cuda.current_device()) if world.device_type == "cuda" \
        else torch.device("cpu")
    pp_group = world.get_group("pp")
    mine = [c for c in range(p * v) if c % p == stage]
    stages = []
    for c in mine:
        chunk = chunks[c].to(device)
        parallelize(chunk)
        stages.append(PipelineStage(chunk, c, p * v, device, group=pp_group))
    kind = schedule_class(s.pipeline.schedule)
    schedule = kind(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=loss_fn)
    last_rank = s.pipeline.stages[-1].devices[place]
    return PipelineRun(schedule=schedule, chunks=[chunks[c] for c in mine], first=stage == 0, last=stage == p - 1,
                       group=pp_group, last_rank=last_rank, ties=ties, aliases=aliases, stages=p, indices=tuple(mine),
                       chunks_total=p * v, schedule_name=kind.__name__)
