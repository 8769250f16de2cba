"""One rank's work for `meshplan run`, plain or pipelined: build, train K steps under the strategy,
verify, measure. One loop (`run_rank`) for every plan; what differs is the step it drives:
`PlainStep` here (the SPMD runner over the whole mesh, k micro-batches accumulated locally) or
`executor.pipeline.PipelinedStep` (this rank's stage of a torch.distributed.pipelining schedule).

Verification runs the same graph, init, data, loss and optimizer in one process and compares the
loss, every parameter's gradient (gathered) and every parameter after the first optimizer step, and
every parameter after all the run's steps.
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from core.collectives import Collective
from core.levers import LossKind
from core.placement import Spec
from costmodel.loss import loss_input_spec, loss_kind
from executor.context import ring_passes
from executor.dtensors import local_shard
from executor.groups import check_groups, mesh_groups
from executor.interpreter import OnnxModule, load_module
from executor.measure import CollectiveCounter, SavedMeter
from executor.offload import HostStates
from executor.pipeline import PipelinedStep
from executor.preflight import RunError, RunOptions, check_step
from executor.spmd import SpmdRunner
from executor.step import (
    Loss,
    batch_shards,
    clock,
    diverge,
    make_batch,
    make_optimizer,
    micro_batch,
    precision_context,
    rank_device,
    state_bytes,
    verify_against_one_process,
)
from hwprofiles.timing import SpeedProbe, probe_medians
from planner.strategy import Strategy

# The measured step's phases, in order: forward with the loss, backward (with the reshards and
# gradient reductions DTensor runs in it), the bucketed gradient all-reduces, the optimizer step.
PHASES = ("forward", "backward", "gradient_sync", "optimizer")


class TrainingStep(Protocol):
    """What the rank loop drives: a built model under the plan, one step of it at a time."""

    groups_checked: int  # the process groups checked against the plan's at start (`executor/groups.py`)
    runner: SpmdRunner
    module: OnnxModule
    phases: tuple[str, ...]  # the measured phases `step` returns the seconds of, in order (then the optimizer)
    cpu_batch: list[torch.Tensor]  # the step's whole batch, for the one-process reference
    loss: Loss
    counted_by_dtype: Counter[tuple[str, str]]  # the last counted step's collectives by kind and dtype

    def after_load(self) -> None:
        """After a checkpoint's parameters are loaded, before the first step."""

    def step(self, *, measure: bool = False, count: bool = False) -> tuple[torch.Tensor, dict[str, int], list[float], int]:
        """One step up to the optimizer. Returns this rank's addend of the loss, the collectives it ran by
        kind (under `count`), the seconds of each phase but the optimizer, and the bytes autograd saved
        for backward (under `measure`)."""
        ...

    def whole_loss(self, addend: torch.Tensor) -> torch.Tensor:
        """The step's loss from this rank's addend (reduced over the ranks that hold the others)."""
        ...

    def trained_parameters(self, final: dict[str, torch.Tensor]) -> int:
        """Elements of the parameters this rank trains, counted once over all ranks' reports."""
        ...


class PlainStep:
    """A plan without pipeline stages: the SPMD runner over the whole mesh; k micro-batches, each forward
    then backward with the gradients accumulated locally, then the gradients reduced once (DDP's no_sync)."""

    phases: tuple[str, ...] = PHASES[:-1]

    def __init__(self, strategy: Strategy, model_path: str, opts: RunOptions, device: torch.device) -> None:
        self.mesh = init_device_mesh(device.type, strategy.mesh.shape, mesh_dim_names=strategy.mesh.axis_names)
        self.groups_checked = check_groups(strategy, None, mesh_groups(self.mesh))  # as `plan --group-ckpt-out` lists
        self.dtype, self.device = strategy.settings.dtype, device
        self.module = load_module(model_path, strategy.model.dims, seed=opts.seed).to_device(device)
        graph = self.module.graph
        with torch.no_grad():
            if opts.diverge_ranks:
                diverge(self.module, opts.seed)
            if strategy.training.parameter_broadcast:  # every rank starts from rank 0's parameters (whole:
                for p in self.module.parameters():  # before the runner places them)
                    dist.broadcast(p.data, src=0)
        strategy.check_model(graph)
        check_step(strategy, graph)  # torchrun starts ranks without `run`'s checks
        self.counted_by_dtype: Counter[tuple[str, str]] = Counter()  # the counted step's collectives by dtype
        k = self.k = strategy.training.micro_batches
        self.cpu_batch = make_batch(graph, opts.seed, k)  # the one-process reference runs on the CPU, all at once
        self.loss = Loss(graph, loss_kind(graph, strategy.settings.loss if opts.loss == LossKind.AUTO else opts.loss),
                         opts.seed, k, scale=1.0 if strategy.training.gradients_mean else batch_shards(strategy))
        self.runner = runner = SpmdRunner(self.module, strategy, self.mesh)
        # Where the loss reads the output: its planned spec with partial sums reduced and (cross-entropy)
        # the class dim gathered; the labels are split like the output's rows.
        out_name = graph.outputs[0]
        self.need = runner.dtensor(loss_input_spec(self.loss.kind, strategy.spec_of(out_name) or
                                                   Spec.replicated(self.mesh.ndim), len(graph.tensors[out_name].shape)))
        self.labels = [None if self.loss.labels is None else
                       local_shard(micro_batch(self.loss.labels.to(device), i, k), self.need, self.mesh)
                       for i in range(k)]  # no class dim split
        self.split = [a for a, p in enumerate(self.need) if isinstance(p, Shard)]  # the loss's addends summed over these
        # Once, as a data loader hands each rank its shard of each micro-batch (`planner/search/dataset.py`): its share
        # sliced on the host and moved, or under full_batch the whole batch moved and sliced on the device.
        if strategy.training.dataset_strategy == "full_batch":
            whole = [b.to(device) for b in self.cpu_batch]
            self.local_batches = [runner.shard_inputs([micro_batch(x, i, k) for x in whole]) for i in range(k)]
        else:
            self.local_batches = [[x.to(device) for x in runner.shard_inputs([micro_batch(x, i, k) for x in self.cpu_batch])]
                                  for i in range(k)]
        self.meter = SavedMeter(self.module)  # the tensors autograd keeps for backward, while it keeps them

    def after_load(self) -> None:
        pass

    def precision(self) -> contextlib.AbstractContextManager[object]:
        return precision_context(self.dtype, self.device)

    def step(self, *, measure: bool = False, count: bool = False) -> tuple[torch.Tensor, dict[str, int], list[float], int]:
        runner, meter = self.runner, self.meter
        runner.zero_grad()
        comm = CollectiveCounter() if count else None
        loss = torch.zeros(())
        fwd_s = bwd_s = 0.0
        meter.reset()
        runner.regather.on_saved = meter.pack if measure else None  # inside the runner's forward (its own hooks)
        runner.on_kept = meter.keep if measure else None  # a recomputed layer's inputs, kept to backward
        runner.recompute_watch = meter.watch if measure else None
        passes = ring_passes()  # ring attention's sends (point to point: no collective torch counts)
        with comm if comm is not None else contextlib.nullcontext():
            for i in range(self.k):
                t0 = clock(self.device)
                with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack) if measure \
                        else contextlib.nullcontext(), self.precision():
                    y = runner.forward(self.local_batches[i])[0]  # the loss reads the first output
                    micro_loss = self.loss.local(runner.output_as(0, y, self.need), self.labels[i])
                t1 = clock(self.device)
                micro_loss.backward()
                runner.after_micro_batch()  # ZeRO-2 reduce-scatters here
                fwd_s, bwd_s = fwd_s + t1 - t0, bwd_s + clock(self.device) - t1
                loss = loss + micro_loss.detach().cpu()
            t2 = clock(self.device)
            runner.reduce_gradients()
        if comm is not None:
            self.counted_by_dtype = comm.by_dtype
            if ring_passes() > passes:
                comm.counts[Collective.SEND_RECV.value] += ring_passes() - passes
        return loss, dict(comm.counts) if comm is not None else {}, [fwd_s, bwd_s, clock(self.device) - t2], \
            meter.peak

    def whole_loss(self, addend: torch.Tensor) -> torch.Tensor:
        for a in self.split:
            dist.all_reduce(addend, group=self.mesh.get_group(a))
        return addend

    def trained_parameters(self, final: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() for t in final.values())


def run_rank(strategy: Strategy, model_path: str, opts: RunOptions) -> dict[str, Any]:
    """Runs on every rank of an initialised process group; returns this rank's report.

    The loop: build (the plan's step), load a checkpoint, one step whose gradients and updated
    parameters `--verify` keeps, then the rounds: warm-up (memory measured; the first one also counts
    the collectives and sends it runs) and timed steps; verify against one process; save."""
    torch.manual_seed(opts.seed)
    device = rank_device(str(dist.get_backend()), os.environ)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if strategy.settings.dtype in ("amp", "mixed", "bf16") and not torch.cuda.is_bf16_supported():
            raise RunError(f"the plan trains in {strategy.settings.dtype} (bf16) and {torch.cuda.get_device_name(device)} "
                           "cannot compute bf16; plan with `dtype` fp32")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    train: TrainingStep = PlainStep(strategy, model_path, opts, device) if strategy.pipeline is None else \
        PipelinedStep(strategy, model_path, opts, device)
    runner, module = train.runner, train.module
    graph = module.graph
    before = 0  # optimizer steps the parameters had (a loaded checkpoint's)
    report: dict[str, Any] = {"rank": dist.get_rank(), "backend": str(dist.get_backend()),
                              "groups_checked": train.groups_checked}
    load_peak = None
    if opts.load:
        from executor import checkpoint

        before = int(checkpoint.check_model(opts.load, strategy)["optimizer_steps"])
        load_peak = checkpoint.LoadPeak()
        with load_peak:
            checkpoint.load_model(opts.load, runner)
    train.after_load()

    first_loss, _, _, peak_saved = train.step(measure=True)  # a pipeline's first step also infers its shapes
    host = HostStates(runner, dict(strategy.training.offload), device) if strategy.training.offload else None
    # (the first step packed ZeRO's shards; offloaded ones stepped through their host copies)
    optim = make_optimizer(host.params if host is not None else runner.optimizer_parameters(), opts)
    if opts.load:
        stepped = host.stepped if host is not None else None  # offloaded states: their host copies'
        checkpoint.init_optimizer_state(runner, optim, stepped)  # this rank's shards of the states, which the load fills
        assert load_peak is not None
        with load_peak:
            checkpoint.load_optimizer(opts.load, runner, optim, stepped)
        # What a load held beyond this rank's own shards, against the largest parameter (whole).
        report["load_peak_extra_bytes"] = load_peak.peak_extra_bytes
        report["largest_parameter_bytes"] = max(graph.tensors[n].size_bytes for n in runner.params)
    first_loss = train.whole_loss(first_loss.to(device))  # for the report (not part of a training step)
    own = [(name, runner.params[name]) for name in module.param_names]
    if opts.verify:
        # Copies: a replicated value's full tensor is the local one, which later steps update in place.
        grads = {n: runner.gradient(n).cpu().clone() for n, _ in own}
    optimizer_step(optim, host)
    runner.after_optimizer_step()  # ZeRO: the updated shards gathered
    if opts.verify:
        after = {n: runner.full_parameter(n, p.detach()).cpu().clone() for n, p in own}

    times, phases = [], []
    # MESHPLAN_PROFILE=FILE: the timed steps of rank MESHPLAN_PROFILE_RANK (default 0) under
    # torch.profiler, its op table written to FILE (where the step's time goes, op by op).
    trace = os.environ.get("MESHPLAN_PROFILE") \
        if dist.get_rank() == int(os.environ.get("MESHPLAN_PROFILE_RANK", "0")) else None
    profiler = None
    probe = SpeedProbe(device) if opts.probe else None
    probed_before = [probe() for _ in range(50)] if probe else []
    probed_during: list[dict[str, float]] = []
    warmup = max(opts.warmup, 1)  # the first warm-up step counts what it runs
    if device.type == "cuda":  # the peak over the steps, not over loading the model
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + opts.steps):
        warm = i < warmup
        if trace and i == warmup:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        dist.barrier()  # every step starts together; the barrier itself is not timed
        t0 = clock(device)
        # Memory is measured in the warm-up steps, time in the others; counting and measuring both
        # intercept ops in Python, so the counted step measures nothing.
        _, executed, spans, peak = train.step(measure=warm and i > 0, count=i == 0)
        t1 = clock(device)
        with CollectiveCounter() if i == 0 else contextlib.nullcontext() as comm:
            optimizer_step(optim, host)
            runner.after_optimizer_step()
        t2 = clock(device)
        if comm is not None:
            report["collectives_executed"] = dict(Counter(executed) + comm.counts)
            report["reduce_dtypes"] = sorted(CollectiveCounter.reduce_dtypes)
            both = train.counted_by_dtype + comm.by_dtype
            report["gathers_by_dtype"] = {d: n for (k, d), n in sorted(both.items()) if k == "all_gather"}
            report["reduce_scatters_by_dtype"] = {d: n for (k, d), n in sorted(both.items()) if k == "reduce_scatter"}
        if warm and i > 0:
            peak_saved = max(peak_saved, peak)
        elif not warm:
            times.append(t2 - t0)
            phases.append([*spans, t2 - t1])
            if probe:
                probed_during.append(probe())
    if profiler is not None and trace:
        profiler.__exit__(None, None, None)
        Path(trace).write_text(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    steps = before + 1 + warmup + opts.steps
    if opts.verify:  # after the timed steps, which it would disturb
        final = {n: runner.full_parameter(n, p.detach()).cpu() for n, p in own}
        report["trained_parameters"] = train.trained_parameters(final)  # what the optimizer stepped, whole
        dims = dict(strategy.model.dims)
        k = strategy.training.micro_batches
        if "batch" in dims:  # the reference takes the whole step's batch at once
            dims["batch"] *= k
            k = 1
        report.update(verify_against_one_process(model_path, dims, opts, train.cpu_batch, train.loss,
                                                 float(first_loss), grads, after, final, steps=steps - before,
                                                 offset=before, micro_batches=k, dtype=strategy.settings.dtype))
    if opts.save:
        from executor import checkpoint

        checkpoint.save(opts.save, runner, optim, strategy, steps, host.stepped if host is not None else None)
    report["optimizer_steps_before"] = before
    report["loss"] = float(first_loss)
    report["measured_step_s"] = statistics.median(times) if times else None
    if probe:
        report["speed_probe_s"] = {"before": probe_medians(probed_before), "during": probe_medians(probed_during)}
        report["measured_step_times_s"] = times
    # Where the time went (medians per phase; waits for other ranks fall in the phase that waits).
    report["measured_phases_s"] = {name: statistics.median(p[k] for p in phases) for k, name in
                                   enumerate((*train.phases, "optimizer"))} if phases else {}
    # Memory the cost model predicts, measured: model states and the activations autograd saved for
    # backward in one step (the largest step's).
    report["measured_memory_bytes"] = state_bytes(module, optim, runner, host=host.host if host else frozenset()) \
        + peak_saved
    if host is not None or runner.host_activations.peak_bytes:  # states and saved activations on the host
        report["measured_host_bytes"] = (host.host_bytes(optim) if host is not None else 0) \
            + runner.host_activations.peak_bytes
    if device.type == "cuda":  # what the allocator held at its peak over the steps (states, activations, transients)
        report["measured_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    report["peak_rss_growth_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    return report


def optimizer_step(optim: torch.optim.Optimizer, host: HostStates | None) -> None:
    """The optimizer's step; offloaded states stepped on the host, their gradients copied there first and
    their weights back after (`executor/offload.py`)."""
    if host is not None:
        host.before_step()
    optim.step()
    if host is not None:
        host.after_step()


def worker(rank: int, world: int, port: int, strategy_json: str, model_path: str, opts: RunOptions, out: Any) -> None:
    """Entry point of a spawned rank: one thread, nccl on its own GPU where there are enough, else gloo
    on loopback; report to the parent."""
    import warnings

    from planner.strategy import from_json

    warnings.filterwarnings("ignore")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        # One GPU per rank where CUDA is present (nccl; LOCAL_RANK for `rank_device`), else gloo on CPUs.
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
        if cuda:
            os.environ["LOCAL_RANK"] = str(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        report = run_rank(from_json(strategy_json), model_path, opts)
        out.put(("report", rank, report))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # the parent stops every rank and prints one line
        out.put(("error", rank, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        raise SystemExit(1) from e
