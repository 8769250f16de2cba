"""`meshplan run`: spawn the ranks on 127.0.0.1 (gloo), collect their reports, compare with the plan.

The ranks are processes started here with a free port, one thread each; if any rank fails or the run
exceeds its time limit, every rank is stopped and one line says which and why. For several nodes,
launch `python -m executor` under torchrun instead (README).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from costmodel.collectives import Cadence, Collective, Purpose
from executor.ranks import run_ranks
from executor.train import RunOptions, worker
from planner.errors import MeshplanError
from planner.graph import OpGraph, load_graph
from planner.params import Fold
from planner.strategy import Strategy, load_strategy


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
    from costmodel.buckets import gather_groups, pack_buckets, zero_split, zero_units

    params = {t for t, v in strategy.tensors.items() if v.kind == "param"}
    mine: set[str] | None = None
    out: Counter[str] = Counter()
    if strategy.pipeline is not None:
        from executor.pipeline import planned_sends, shared_parameters, stage_nodes

        assert graph is not None, "a pipelined plan's counts need its graph"
        mine = stage_nodes(strategy, graph, stage)
        params &= {t for n in mine for t in graph.node_by_name[n].inputs}
        out["send"] = planned_sends(strategy, graph, stage)
        out[Collective.ALL_REDUCE.value] += len(shared_parameters(strategy, graph, stage))
        if strategy.pipeline.result_broadcast:
            out[Collective.BROADCAST.value] += 1
    resharded = {r.tensor for r in strategy.reshards}
    axis_index = {n: i for i, n in enumerate(strategy.mesh.axis_names)}
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
                bucketed[c.purpose][c.tensor] = (axes | {axis_index[a] for a in c.axes}, max(nbytes, c.bytes))
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
        from executor.pipeline import check_pipeline

        check_pipeline(strategy, graph)
    tr = strategy.training
    if tr.attention == "fused-softmax" or tr.attention_dropout:
        raise RunError(f"the executor runs attention as FlashAttention (torch's SDPA) or torch's eager ops, without "
                       f"dropout; this plan prices {tr.attention} attention"
                       + (f" with dropout {tr.attention_dropout:g}" if tr.attention_dropout else "")
                       + ": plan with --attention flash or eager and --attention-dropout 0 to run it")
    k = strategy.training.micro_batches
    batch = strategy.model.dims.get("batch")
    odd = [t for t in graph.inputs if not graph.tensors[t].shape or graph.tensors[t].shape[0] != batch]
    if k > 1 and (batch is None or odd):
        raise RunError(f"{k} micro-batches split every input along dim 0, the batch, but input(s) "
                       f"{', '.join(odd) or graph.inputs[0]} do not start with the batch dim; plan with "
                       "--accumulation-steps 1")


def check_executable(graph: OpGraph) -> None:
    """Refuse, before any rank starts, a model the executor cannot train as the torch module would."""
    from executor.ops import OPS

    missing = sorted({n.op_type for n in graph.nodes if n.op_type not in OPS and n.op_type not in ("Shape", "Size")})
    if missing:
        raise RunError(f"the executor cannot run op type(s) {', '.join(missing)} (they plan, replicated or by rule); "
                       "add them to executor/ops.py, or plan without run")
    static = [f"{p.name} ← {p.origin}" for p in graph.parameters.values() if p.fold is Fold.STATIC]
    if static:
        raise RunError(f"parameter(s) {', '.join(static)} were folded at the export's static shapes: training them "
                       "would not train the module's tensors; re-export with dynamic_shapes or optimize=False")


def run(strategy_path: str, model_path: str, *, nproc: int, opts: RunOptions, timeout_s: float = 600.0) -> dict[str, Any]:
    strategy = load_strategy(strategy_path)
    if not Path(model_path).exists():
        raise RunError(f"{model_path}: no such model; pass the .onnx file the strategy was planned for")
    try:
        graph = load_graph(model_path, strategy.model.dims)
    except MeshplanError as e:
        raise RunError(f"{model_path} is not the model the strategy was planned for ({strategy.model.name}, dims "
                       f"{dict(strategy.model.dims)}): {e}") from e
    strategy.check_model(graph)
    check_executable(graph)
    check_step(strategy, graph)
    if opts.save or opts.load:
        from executor import checkpoint

        checkpoint.check_plan(strategy)
        if opts.load:
            checkpoint.check_model(opts.load, strategy)
    mesh_size = strategy.mesh.num_devices if strategy.pipeline is None else strategy.pipeline.devices
    if nproc != mesh_size:
        where = f"mesh {strategy.mesh.describe_shape()}" if strategy.pipeline is None else \
            f"{len(strategy.pipeline.stages)} pipeline stages of mesh {strategy.mesh.describe_shape()}"
        raise RunError(f"--nproc {nproc} but the strategy's {where} has {mesh_size} devices; run with --nproc {mesh_size}")
    reports: dict[int, dict[str, Any]] = {}

    def handle(msg: tuple[Any, ...]) -> bool:
        reports[msg[1]] = msg[2]  # ("report", rank, report)
        return len(reports) == nproc

    run_ranks(worker, nproc, lambda r, port, out: (r, nproc, port, strategy.to_json(), str(model_path), opts, out),
              handle, timeout_s=timeout_s, error=RunError, what="the run")
    r0 = reports[0]
    result = {
        "strategy": str(strategy_path), "nproc": nproc, "loss": r0["loss"],
        "predicted_step_s": strategy.step_time_s,
        "measured_step_s": max(r["measured_step_s"] for r in reports.values()),
        "measured_step_s_by_rank": [reports[r]["measured_step_s"] for r in sorted(reports)],
        "measured_phases_s": max((r["measured_phases_s"] for r in reports.values()),
                                 key=lambda p: sum(p.values())),  # the slowest rank's
        "predicted_phases_s": {"compute_s": strategy.cost.compute_s, "comm_s": strategy.cost.comm_s,
                               "bubble_s": strategy.cost.bubble_s, "optimizer_s": strategy.cost.optimizer_s,
                               "overhead_s": strategy.cost.overhead_s},
        "predicted_memory_bytes": strategy.cost.memory_bytes_per_device,
        "measured_memory_bytes": max(r["measured_memory_bytes"] for r in reports.values()),
        "collectives_planned": planned_counts(strategy, graph=graph),
        "collectives_executed": r0["collectives_executed"],
    }
    # Every rank checks what it holds (a pipeline stage: its own parameters) against one process.
    result["optimizer_steps_before"] = r0.get("optimizer_steps_before", 0)
    if "load_peak_extra_bytes" in r0:
        result["load_peak_extra_bytes"] = max(r["load_peak_extra_bytes"] for r in reports.values())
        result["largest_parameter_bytes"] = r0["largest_parameter_bytes"]
    for key in ("max_abs_diff", "loss_abs_diff", "grad_max_abs_diff", "param_max_abs_diff", "final_param_max_abs_diff"):
        if key in r0:
            result[key] = max(r[key] for r in reports.values())
    if "speed_probe_s" in r0:  # RunOptions.probe
        result["speed_probe_s_by_rank"] = [reports[r]["speed_probe_s"] for r in sorted(reports)]
        result["measured_step_times_s_by_rank"] = [reports[r]["measured_step_times_s"] for r in sorted(reports)]
    if "single_process_loss" in r0:
        result["single_process_loss"] = r0["single_process_loss"]
    if "trained_parameters" in r0:
        result["trained_parameters"] = r0["trained_parameters"] if strategy.pipeline is None else \
            sum(reports[st.devices[0]]["trained_parameters"] for st in strategy.pipeline.stages)
    if strategy.pipeline is not None:  # ranks differ by stage: each stage's first rank, planned and executed
        result["micro_batches"] = strategy.training.micro_batches
        result["stages"] = [{"stage": s, "rank": st.devices[0], "predicted_memory_bytes": st.memory_bytes,
                             "measured_memory_bytes": reports[st.devices[0]]["measured_memory_bytes"],
                             "measured_step_s": reports[st.devices[0]]["measured_step_s"],
                             "measured_phases_s": reports[st.devices[0]]["measured_phases_s"],
                             "predicted_micro_batch_s": st.time_s,
                             "collectives_planned": planned_counts(strategy, graph=graph, stage=s),
                             "collectives_executed": reports[st.devices[0]]["collectives_executed"]}
                            for s, st in enumerate(strategy.pipeline.stages)]
    return result
