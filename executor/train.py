"""One rank's work for `meshplan run`: build, train K steps under the strategy, verify, measure.

Data and labels are seeded, identical in every process: integer inputs are token ids below the
vocabulary their embedding reads, float inputs standard normal. The loss is the one the plan priced
(`costmodel/loss.py`): cross-entropy against seeded labels on logits, else the mean of squares. It
runs on each rank's rows of the output (their sum over the global count: the loss's addends), after
the planned reshard that reduces partial sums and, for cross-entropy, gathers a split class dim.
Verification runs the same graph, init, data, loss and optimizer in one process and compares the
loss, every parameter's gradient (gathered) and every parameter after the first optimizer step, and
every parameter after all the run's steps.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import statistics
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from costmodel.loss import loss_input_spec, loss_kind
from executor.interpreter import OnnxModule, load_module
from executor.measure import CollectiveCounter, SavedMeter
from executor.spmd import SpmdRunner, local_shard
from hwprofiles.timing import SpeedProbe, probe_medians
from planner.graph import OpGraph
from planner.placement import Spec
from planner.strategy import Strategy

# The measured step's phases, in order: forward with the loss, backward (with the reshards and
# gradient reductions DTensor runs in it), the bucketed gradient all-reduces, the optimizer step.
PHASES = ("forward", "backward", "gradient_sync", "optimizer")


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    steps: int = 5
    warmup: int = 2
    verify: bool = False
    loss: str = "auto"  # auto (the plan's) | cross-entropy | mse
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


def make_batch(graph: OpGraph, seed: int, micro_batches: int = 1) -> list[torch.Tensor]:
    """One optimizer step's inputs: `micro_batches` micro-batches of the graph's (micro-step) shape,
    stacked along dim 0 (the batch dim of every input)."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for name in graph.inputs:
        info = graph.tensors[name]
        shape = _global_shape(info.shape, micro_batches)
        if info.is_float:
            out.append(torch.randn(shape, generator=g))
            continue
        high = 2
        for n in graph.compute_nodes:  # ids read by an embedding: stay below its vocabulary
            if n.op_type == "Gather" and len(n.inputs) > 1 and n.inputs[1] == name:
                axis = int(n.attr("axis", 0))  # type: ignore[call-overload]
                high = graph.tensors[n.inputs[0]].shape[axis]
        out.append(torch.randint(0, high, shape, generator=g, dtype=torch.int64))
    return out


def _global_shape(shape: tuple[int, ...], micro_batches: int) -> tuple[int, ...]:
    return (shape[0] * micro_batches, *shape[1:]) if shape else shape


def micro_batch(x: torch.Tensor, i: int, micro_batches: int) -> torch.Tensor:
    """Micro-batch i of a step's tensor (rows split evenly along dim 0)."""
    rows = x.shape[0] // micro_batches
    return x[i * rows:(i + 1) * rows]


class Loss:
    """The training loss on the output of one optimizer step's batch (all its micro-batches), computable
    on any row shard of any micro-batch: `local(y, labels)` is the shard's addend (its rows' sum over
    the step's count), so the addends of every rank and micro-batch sum to the loss of the whole batch
    (MindSpore's loss_repeated_mean: the mean over the global batch, not a mean of means)."""

    def __init__(self, graph: OpGraph, kind: str, seed: int, micro_batches: int = 1, scale: float = 1.0) -> None:
        """`scale`: the loss multiplied by it (the data-parallel degree when gradients are summed over
        the ranks rather than averaged, MindSpore's gradients_mean=False: each rank's loss is the mean
        of its own batch, and their gradients add up)."""
        out = graph.tensors[graph.outputs[0]]
        shape = _global_shape(out.shape, micro_batches)
        self.kind = kind
        self.labels: torch.Tensor | None = None
        if kind == "cross-entropy":
            g = torch.Generator().manual_seed(seed + 2)
            self.labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
        self.count = (math.prod(shape[:-1]) if kind == "cross-entropy" else math.prod(shape)) / scale

    def local(self, y: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "cross-entropy":
            assert labels is not None
            return torch.nn.functional.cross_entropy(y.reshape(-1, y.shape[-1]).float(), labels.reshape(-1),
                                                     reduction="sum") / self.count
        return (y.float() ** 2).sum() / self.count

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        return self.local(y, self.labels)


def _optimizer(params: Any, opts: RunOptions) -> torch.optim.Optimizer:
    if opts.optimizer == "sgd":
        return torch.optim.SGD(params, lr=opts.lr)
    return torch.optim.AdamW(params, lr=opts.lr, foreach=False)


def _ordered_params(module: OnnxModule) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, module.params[key]) for name, key in module.param_names.items()]


def rank_device(backend: str, env: Mapping[str, str]) -> torch.device:
    """Where a rank computes: its local GPU (torchrun's LOCAL_RANK) under nccl, else the CPU (gloo)."""
    if backend == "nccl":
        return torch.device("cuda", int(env.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def run_rank(strategy: Strategy, model_path: str, opts: RunOptions) -> dict[str, Any]:
    """Runs on every rank of an initialised process group; returns this rank's report."""
    torch.manual_seed(opts.seed)
    device = rank_device(str(dist.get_backend()), os.environ)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if strategy.pipeline is not None:
        from executor.pipeline import run_pipelined_rank

        return run_pipelined_rank(strategy, model_path, opts, device)
    mesh = init_device_mesh(device.type, strategy.mesh.shape, mesh_dim_names=strategy.mesh.axis_names)
    module = load_module(model_path, strategy.model.dims, seed=opts.seed).to_device(device)
    graph = module.graph
    with torch.no_grad():
        if opts.diverge_ranks:
            diverge(module, opts.seed)
        if strategy.training.parameter_broadcast:  # every rank starts from rank 0's parameters
            for p in module.parameters():
                dist.broadcast(p.data, src=0)
    strategy.check_model(graph)
    from executor.launch import check_step  # (launch imports this module)

    check_step(strategy, graph)  # torchrun starts ranks without `run`'s checks
    k = strategy.training.micro_batches
    cpu_batch = make_batch(graph, opts.seed, k)  # the one-process reference runs on the CPU, all of it at once
    batch = [b.to(device) for b in cpu_batch]
    loss_of = Loss(graph, loss_kind(graph, strategy.settings.loss if opts.loss == "auto" else opts.loss),
                   opts.seed, k, scale=1.0 if strategy.training.gradients_mean else _batch_shards(strategy))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    runner = SpmdRunner(module, strategy, mesh)
    before = 0  # optimizer steps the parameters had (a loaded checkpoint's)
    if opts.load:
        from executor import checkpoint

        before = int(checkpoint.check_model(opts.load, strategy)["optimizer_steps"])
        load_peak = checkpoint.LoadPeak()
        with load_peak:
            checkpoint.load_model(opts.load, runner)

    # Where the loss reads the output: its planned spec with partial sums reduced and (cross-entropy)
    # the class dim gathered; the labels are split like the output's rows.
    out_name = graph.outputs[0]
    out_spec = strategy.spec_of(out_name) or Spec.replicated(mesh.ndim)
    need = runner.dtensor(loss_input_spec(loss_of.kind, out_spec, len(graph.tensors[out_name].shape)))
    labels = [None if loss_of.labels is None else local_shard(micro_batch(loss_of.labels.to(device), i, k), need, mesh)
              for i in range(k)]  # no class dim split
    split = [a for a, p in enumerate(need) if isinstance(p, Shard)]  # the loss's addends are summed over these

    # Once, as a data loader hands each rank its shard of each micro-batch.
    local_batches = [runner.shard_inputs([micro_batch(x, i, k) for x in batch]) for i in range(k)]
    meter = SavedMeter(module)  # the tensors autograd keeps for backward, while it keeps them

    def step(count: bool = False, measure: bool = False) -> tuple[torch.Tensor, dict[str, int], list[float], int]:
        """One training step up to the optimizer: k micro-batches, each forward then backward with the
        gradients accumulated locally, then the parameters' gradients reduced once (DDP's no_sync).
        Under `count`, the collectives it ran by kind; under `measure`, the tensors a micro-batch saved
        for backward. Both intercept ops in Python, so timed steps do neither. Returns this rank's
        addend of the loss, the counts, the seconds of forward, backward and the gradient reduction,
        and the bytes saved by the largest micro-batch."""
        runner.zero_grad()
        comm = CollectiveCounter() if count else None
        loss = torch.zeros(())
        fwd_s = bwd_s = 0.0
        meter.reset()
        runner.regather.on_saved = meter.pack if measure else None  # inside the runner's forward (its own hooks)
        runner.on_kept = meter.keep if measure else None  # a recomputed layer's inputs, kept to backward
        runner.recompute_watch = meter.watch if measure else None
        with comm if comm is not None else contextlib.nullcontext():
            for i in range(k):
                t0 = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack) if measure \
                        else contextlib.nullcontext():
                    y = runner.forward(local_batches[i])[0]  # the loss reads the first output
                    micro_loss = loss_of.local(runner.output_as(0, y, need), labels[i])
                t1 = time.perf_counter()
                micro_loss.backward()
                runner.after_micro_batch()  # ZeRO-2 reduce-scatters here
                fwd_s, bwd_s = fwd_s + t1 - t0, bwd_s + time.perf_counter() - t1
                loss = loss + micro_loss.detach().cpu()
            t2 = time.perf_counter()
            runner.reduce_gradients()
        return loss, dict(comm.counts) if comm is not None else {}, [fwd_s, bwd_s,
                                                                              time.perf_counter() - t2], meter.peak

    report: dict[str, Any] = {"rank": dist.get_rank()}
    first_loss, executed, _, peak_saved = step(count=True, measure=True)
    optim = _optimizer(runner.optimizer_parameters(), opts)  # the first step packed ZeRO's shards
    if opts.load:
        checkpoint.init_optimizer_state(runner, optim)  # this rank's shards of the states, which the load fills
        with load_peak:
            checkpoint.load_optimizer(opts.load, runner, optim)
        # What a load held beyond this rank's own shards, against the largest parameter (whole).
        report["load_peak_extra_bytes"] = load_peak.peak_extra_bytes
        report["largest_parameter_bytes"] = max(graph.tensors[n].size_bytes for n in runner._params)
    first_loss = first_loss.to(device)
    for a in split:  # the whole loss, for the report (not part of a training step)
        dist.all_reduce(first_loss, group=mesh.get_group(a))
    if opts.verify:
        # Copies: a replicated value's full tensor is the local one, which later steps update in place.
        grads = {n: runner.gradient(n).cpu().clone() for n, _ in _ordered_params(module)}
    with CollectiveCounter() as comm:
        optim.step()
        runner.after_optimizer_step()  # ZeRO: the updated shards gathered
    report["collectives_executed"] = dict(Counter(executed) + comm.counts)
    if opts.verify:
        after = {n: runner.full_parameter(n, p.detach()).cpu().clone() for n, p in _ordered_params(module)}
    times, phases = [], []
    # MESHPLAN_PROFILE=FILE: the timed steps of rank MESHPLAN_PROFILE_RANK (default 0) under
    # torch.profiler, its op table written to FILE (where the step's time goes, op by op).
    trace = os.environ.get("MESHPLAN_PROFILE") \
        if dist.get_rank() == int(os.environ.get("MESHPLAN_PROFILE_RANK", "0")) else None
    profiler = None
    probe = SpeedProbe(device) if opts.probe else None
    probed_before = [probe() for _ in range(50)] if probe else []
    probed_during: list[dict[str, float]] = []
    for i in range(opts.warmup + opts.steps):
        warm = i < opts.warmup
        if trace and i == opts.warmup:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        dist.barrier()  # every step starts together; the barrier itself is not timed
        t0 = time.perf_counter()
        _, _, spans, peak = step(measure=warm)  # memory is measured in the warm-up steps, time in the others
        t1 = time.perf_counter()
        optim.step()
        runner.after_optimizer_step()
        t2 = time.perf_counter()
        if warm:
            peak_saved = max(peak_saved, peak)
        else:
            times.append(t2 - t0)
            phases.append([*spans, t2 - t1])
            if probe:
                probed_during.append(probe())
    if profiler is not None and trace:
        profiler.__exit__(None, None, None)
        Path(trace).write_text(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    if opts.verify:  # after the timed steps, which it would disturb
        final = {n: runner.full_parameter(n, p.detach()).cpu() for n, p in _ordered_params(module)}
        report["trained_parameters"] = sum(t.numel() for t in final.values())  # what the optimizer stepped, whole
        dims = dict(strategy.model.dims)
        if k > 1:  # the reference takes the whole step's batch at once
            dims["batch"] *= k
        report.update(verify_against_one_process(model_path, dims, opts, cpu_batch, loss_of,
                                                 float(first_loss), grads, after, final, offset=before))
    if opts.save:
        from executor import checkpoint

        checkpoint.save(opts.save, runner, optim, strategy, before + 1 + opts.warmup + opts.steps)
    report["optimizer_steps_before"] = before
    report["loss"] = float(first_loss)
    report["measured_step_s"] = statistics.median(times) if times else None
    if probe:
        report["speed_probe_s"] = {"before": probe_medians(probed_before), "during": probe_medians(probed_during)}
        report["measured_step_times_s"] = times
    # Where the time went (medians per phase; waits for other ranks fall in the phase that waits).
    report["measured_phases_s"] = {name: statistics.median(p[k] for p in phases) for k, name in
                                   enumerate(PHASES)} if phases else {}
    # Memory the cost model predicts, measured: model states and the activations autograd saved for
    # backward in one step (the largest step's).
    report["measured_memory_bytes"] = state_bytes(module, optim, runner) + peak_saved
    report["peak_rss_growth_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    return report


def diverge(module: torch.nn.Module, seed: int) -> None:
    """Every rank but 0 perturbs its parameters (RunOptions.diverge_ranks)."""
    rank = dist.get_rank()
    if rank:
        g = torch.Generator().manual_seed(seed + rank)
        for p in module.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g).to(p.device))


def state_bytes(module: torch.nn.Module, optim: torch.optim.Optimizer, runner: SpmdRunner) -> int:
    """Model states held by this rank: weights, gradients, optimizer state tensors, ZeRO-2 gradient shards."""
    out = sum(p.numel() * p.element_size() for p in module.parameters())
    out += sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
    out += sum(v.numel() * v.element_size() for st in optim.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out + runner.grad_shard_bytes()


def _batch_shards(strategy: Strategy) -> int:
    """Ranks the batch is split over (the data-parallel degree): the shards of the inputs' dim 0."""
    specs = [strategy.spec_of(t) for t in strategy.tensors if strategy.tensors[t].kind == "input"]
    return max((sp.num_shards(0, strategy.mesh.shape) for sp in specs if sp is not None), default=1)


def _full(t: torch.Tensor | None) -> torch.Tensor:
    if t is None:
        raise RuntimeError("a parameter received no gradient")
    return t.full_tensor() if isinstance(t, DTensor) else t


def verify_against_one_process(model_path: str, dims: dict[str, int], opts: RunOptions, batch: list[torch.Tensor],
                               loss_of: Any, dist_loss: float, grads: dict[str, torch.Tensor],
                               after: dict[str, torch.Tensor], final: dict[str, torch.Tensor], *,
                               steps: int | None = None, offset: int = 0) -> dict[str, Any]:
    """The same training in one process: the first step's loss, gradients and updated parameters,
    and the parameters after all the run's `steps` (`final`; default 1 + warm-up + timed steps). The
    parameters compared are those of `grads` (a pipeline stage's own). `offset`: optimizer steps the
    run's parameters had before it (a loaded checkpoint's), which the one process trains first, from
    the start: the check of a checkpoint is this uninterrupted run."""
    ref = load_module(model_path, dims, seed=opts.seed)
    optim = _optimizer(ref.parameters(), opts)
    for _ in range(offset):
        optim.zero_grad(set_to_none=True)
        loss_of(ref(*batch)).backward()
        optim.step()
    optim.zero_grad(set_to_none=True)
    loss = loss_of(ref(*batch))
    loss.backward()
    mine = [(n, p) for n, p in _ordered_params(ref) if n in grads]
    grad_diff = max(float((grads[n] - _full(p.grad)).abs().max()) for n, p in mine)
    optim.step()
    param_diff = max(float((after[n] - p.detach()).abs().max()) for n, p in mine)
    loss_diff = abs(float(loss) - dist_loss)
    for _ in range((1 + opts.warmup + opts.steps if steps is None else steps) - 1):
        optim.zero_grad(set_to_none=True)
        loss_of(ref(*batch)).backward()
        optim.step()
    final_diff = max(float((final[n] - p.detach()).abs().max()) for n, p in mine)
    return {"single_process_loss": float(loss), "loss_abs_diff": loss_diff, "grad_max_abs_diff": grad_diff,
            "param_max_abs_diff": param_diff, "final_param_max_abs_diff": final_diff,
            "max_abs_diff": max(loss_diff, grad_diff, param_diff, final_diff)}


def worker(rank: int, world: int, port: int, strategy_json: str, model_path: str, opts: RunOptions, out: Any) -> None:
    """Entry point of a spawned rank: one thread, gloo on loopback, report to the parent."""
    import warnings

    from planner.strategy import from_json

    warnings.filterwarnings("ignore")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        report = run_rank(from_json(strategy_json), model_path, opts)
        out.put(("report", rank, report))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # the parent stops every rank and prints one line
        out.put(("error", rank, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        raise SystemExit(1) from e
