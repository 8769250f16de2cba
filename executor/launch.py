"""`meshplan run`: spawn the ranks on 127.0.0.1 (gloo), collect their reports, compare with the plan.

The ranks are processes started here with a free port, one thread each; if any rank fails or the run
exceeds its time limit, every rank is stopped and one line says which and why. For several nodes,
launch `python -m executor` under torchrun instead (README).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.errors import MeshplanError
from core.graph import OpGraph
from executor.preflight import RunError, RunOptions, check_step, planned_counts
from executor.ranks import run_ranks
from executor.train import worker
from planner.graph import load_graph
from planner.strategy import load_strategy


def metered(memory: Mapping[str, float]) -> float:
    """The predicted bytes the CPU meter measures: every item but the loss's workspace, gradients held."""
    return sum(b for category, b in memory.items() if category != "loss")


def check_executable(graph: OpGraph) -> None:
    """Refuse, before any rank starts, a model the executor cannot train as the torch module would."""
    from executor.ops import OPS  # every family registered

    missing = sorted({n.op_type for n in graph.nodes if n.op_type not in OPS and n.op_type not in ("Shape", "Size")})
    if missing:
        raise RunError(f"the executor cannot run op type(s) {', '.join(missing)} (they plan, replicated or by rule); "
                       "add them to executor/ops.py, or plan without run")


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
        raise RunError(f"`nproc` {nproc} but the strategy's {where} has {mesh_size} devices; run with `nproc` {mesh_size}")
    reports: dict[int, dict[str, Any]] = {}

    def handle(msg: tuple[Any, ...]) -> bool:
        reports[msg[1]] = msg[2]  # ("report", rank, report)
        return len(reports) == nproc

    run_ranks(worker, nproc, lambda r, port, out: (r, nproc, port, strategy.to_json(), str(model_path), opts, out),
              handle, timeout_s=timeout_s, error=RunError, what="the run")
    r0 = reports[0]
    # On a GPU the allocator's peak is measured; elsewhere the meter's states and saved activations
    # (`executor/measure.py`), which see neither the loss's backward workspace nor when gradients exist.
    on_gpu = r0.get("backend") == "nccl"
    result = {
        "strategy": str(strategy_path), "nproc": nproc, "loss": r0["loss"],
        "predicted_step_s": strategy.step_time_s,
        "measured_step_s": max(r["measured_step_s"] for r in reports.values()),
        "measured_step_s_by_rank": [reports[r]["measured_step_s"] for r in sorted(reports)],
        "measured_phases_s": max((r["measured_phases_s"] for r in reports.values()),
                                 key=lambda p: sum(p.values())),  # the slowest rank's
        "predicted_phases_s": {"compute_s": strategy.cost.compute_s, "comm_s": strategy.cost.comm_s,
                               "bubble_s": strategy.cost.bubble_s, "optimizer_s": strategy.cost.optimizer_s,
                               "overhead_s": strategy.cost.overhead_s, "host_s": strategy.cost.host_s},
        "predicted_memory_bytes": strategy.cost.memory_bytes_per_device if on_gpu else metered(strategy.cost.memory),
        "measured_memory_bytes": max(r["measured_memory_bytes"] for r in reports.values()),
        "collectives_planned": planned_counts(strategy, graph=graph, backend=r0.get("backend", "gloo")),
        "collectives_executed": r0["collectives_executed"],
        "reduce_dtypes": r0.get("reduce_dtypes", []),
        "gathers_by_dtype": r0.get("gathers_by_dtype", {}),
        "reduce_scatters_by_dtype": r0.get("reduce_scatters_by_dtype", {}),
    }
    # Every rank checks what it holds (a pipeline stage: its own parameters) against one process.
    result["optimizer_steps_before"] = r0.get("optimizer_steps_before", 0)
    if "measured_host_bytes" in r0:  # optimizer states, saved activations on the host (`executor/offload.py`, `host_activations.py`)
        result["predicted_host_bytes"] = strategy.cost.host_memory_bytes
        result["measured_host_bytes"] = max(r["measured_host_bytes"] for r in reports.values())
    if "load_peak_extra_bytes" in r0:
        result["load_peak_extra_bytes"] = max(r["load_peak_extra_bytes"] for r in reports.values())
        result["largest_parameter_bytes"] = r0["largest_parameter_bytes"]
    for key in ("max_abs_diff", "loss_abs_diff", "grad_max_abs_diff", "param_max_abs_diff", "final_param_max_abs_diff"):
        if key in r0:
            result[key] = max(r[key] for r in reports.values())
    if "tolerance" in r0:  # bf16: every rank within it
        result["tolerance"] = r0["tolerance"]
        result["within_tolerance"] = all(r["within_tolerance"] for r in reports.values())
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
        result["stages"] = [{"stage": s, "rank": st.devices[0],
                             "predicted_memory_bytes": st.memory_bytes if on_gpu else st.memory_bytes - st.workspace_bytes,
                             "measured_memory_bytes": reports[st.devices[0]]["measured_memory_bytes"],
                             "measured_step_s": reports[st.devices[0]]["measured_step_s"],
                             "measured_phases_s": reports[st.devices[0]]["measured_phases_s"],
                             "predicted_micro_batch_s": st.time_s,
                             "collectives_planned": planned_counts(strategy, graph=graph, stage=s,
                                                                   backend=r0.get("backend", "gloo")),
                             "collectives_executed": reports[st.devices[0]]["collectives_executed"]}
                            for s, st in enumerate(strategy.pipeline.stages)]
    return result
