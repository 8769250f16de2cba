"""meshplan — how should I shard this model on these devices, and how fast and big is one step?

The `meshplan` console script. Each command is thin: parse, call the stage, render. Errors a user
can cause (`MeshplanError`) print as one line on stderr and exit 2; nothing here imports torch.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from core.errors import MeshplanError
from core.layout import parse_layout
from core.levers import (
    ActivationOffload,
    Attention,
    Composer,
    CpMethod,
    Dtype,
    LossKind,
    Mode,
    Offload,
    Recompute,
    Runtime,
    Schedule,
    Search,
    lever,
    offload_levers,
)
from meshplan.cli.options import (
    OneLineGroup,
    build_mesh,
    dim_option,
    mesh_options,
    one_line_errors,
    parse_export_dims,
    parse_fusion,
    parse_mesh_shape,
    parse_pins,
    parse_size,
    parse_strategy_in,
    parse_zero,
    plan_options,
    precision_for,
    worded,
)
from meshplan.cli.render import (
    console,
    err_console,
    render_checkpoint,
    render_diff,
    render_explain,
    render_fits,
    render_layout_comparison,
    render_plan,
    render_presets,
    render_profile,
    render_reshard,
    render_run,
    render_strategies,
    render_summary,
)


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="meshplan")
def main() -> None:
    """Plan how to shard a model (ONNX) over a device mesh, and predict one training step."""


@main.command()
@click.argument("model", type=click.Path(dir_okay=True, path_type=str))
@dim_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@one_line_errors
def inspect(model: str, dims: dict[str, int], as_json: bool) -> None:
    """Import MODEL (.onnx) and report ops, parameters, forward FLOPs, inputs/outputs and repeated layers."""
    from costmodel.summary import graph_summary
    from planner.graph import load_graph

    summary = graph_summary(load_graph(model, dims))
    if as_json:
        return click.echo(json.dumps(summary, indent=1))
    render_summary(summary)
    for note in summary["notes"]:
        err_console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)


@main.command("export")
@click.option("--hf-config", "hf_config", required=True, type=click.Path(path_type=str),
              help="A transformers config.json (or the folder holding it); no weights are read or made.")
@click.option("--dim", "dims", multiple=True, callback=parse_export_dims, metavar="NAME[=N]",
              help="An input dim: NAME stays symbolic (bound by --dim NAME=N at plan time), NAME=N is static. "
                   "Token models take batch and seq (both symbolic by default).")
@click.option("-o", "--out", "out_path", required=True, help="The .onnx file to write (shape-only).")
@one_line_errors
def export_cmd(hf_config: str, dims: dict[str, int | None], out_path: str) -> None:
    """Write a shape-only ONNX of a transformers model: every parameter declared, no weights."""
    from planner.export import export_hf_config

    with err_console.status("exporting"):
        r = export_hf_config(hf_config, out_path, dims=dims)
    note = f", layers repeated ({r.repeated_layers})" if r.repeated_layers else ""
    click.echo(f"wrote {r.path}: {r.num_params:,} parameters, shape-only, {r.seconds:.1f} s{note}")


@main.command()
@click.argument("model", type=click.Path(dir_okay=True, path_type=str))
@dim_option
@mesh_options
@plan_options
@one_line_errors
def plan(model: str, dims: dict[str, int], devices: int, mesh: str | None, axis_names: str | None, profile_name: str,
         dtype: str | None, mode: str, search: str, pins: tuple[str, ...], pin_file: str | None,
         memory_limit: float | None, time_limit: float, solver: str, workers: int, no_follow: bool, no_all_to_all: bool,
         strict: bool, loss: str, global_batch_size: int | None, accumulation_steps: str, zero_stage: str,
         recompute: str, recompute_layers: int | None, gradient_accumulation_shard: str, dataset_strategy: str,
         offload: str, comm_fusion: str, zero_threshold: str, zero_shard_size: int | None, gradients_sum: bool,
         parameter_broadcast: bool, pipeline_result_broadcast: bool, force_fp32_communication: bool, overlap: bool | None,
         attention: str, attention_dropout: float, capacity_factor: float, runtime: str, layout: str | None, schedule: str | None,
         cp_method: str | None, micro_batch_size: int | None, out_path: str | None, strategy_out: str | None, group_ckpt_out: str | None,
         only_trainable_params: bool,
         strategy_in: str | None, as_json: bool) -> None:
    """Plan how to shard MODEL over N devices: the ILP's choice, its predicted step time and memory."""
    from dataclasses import replace
    from pathlib import Path

    from planner.search.plan import make_plan
    from planner.search.request import PlanRequest

    if accumulation_steps != "auto" and not accumulation_steps.isdigit():
        raise MeshplanError(f"--accumulation-steps {accumulation_steps}: give a positive integer or auto")

    if only_trainable_params and not strategy_out:
        raise MeshplanError("--only-trainable-params shapes the --strategy-out file; pass --strategy-out FILE")
    shape = parse_mesh_shape(mesh)
    names = tuple(n.strip() for n in axis_names.split(",")) if axis_names else None
    held: dict[str, str] = {}
    if strategy_in:
        shape, names, held = parse_strategy_in(strategy_in, model, dims, shape, names, devices)
        mode = Mode.SEMI if mode == Mode.AUTO else mode
    user_pins = parse_pins(pins, pin_file)
    clash = sorted(t for t in set(held) & set(user_pins) if held[t] != user_pins[t])
    if clash:
        raise MeshplanError(f"--pin {clash[0]}={user_pins[clash[0]]} contradicts --strategy-in {strategy_in} "
                            f"({held[clash[0]]}); drop one")
    states_offload, activations_offload = offload_levers(offload)
    req = PlanRequest(model=model, dims=dims, profile=profile_name, devices=devices, mesh_shape=shape, axis_names=names,
                      mode=Mode(mode), search=Search(search), pins={**held, **user_pins}, memory_limit_gib=memory_limit,
                      time_limit_s=time_limit, dtype=None if dtype is None else Dtype(dtype), solver=solver, workers=workers, follow=not no_follow,
                      strict=strict,
                      all_to_all=not no_all_to_all, loss=LossKind(loss), global_batch_size=global_batch_size,
                      accumulation_steps=None if accumulation_steps == "auto" else int(accumulation_steps),
                      zero_stage=parse_zero(zero_stage), recompute=Recompute(recompute),
                      recompute_layers=recompute_layers, offload=states_offload, offload_activations=activations_offload,
                      gradient_accumulation_shard=gradient_accumulation_shard, dataset_strategy=dataset_strategy,
                      layout=parse_layout(layout, devices) if layout else None,
                      micro_batch_size=micro_batch_size, schedule=lever(Schedule, schedule, "schedule") if schedule else None,
                      cp_method=lever(CpMethod, cp_method, "cp_method") if cp_method else None,
                      composer=None if overlap is None else Composer.OVERLAP if overlap else Composer.SERIAL,
                      fusion=parse_fusion(comm_fusion),
                      zero_threshold_bytes=parse_size(zero_threshold, "--zero-threshold", allow_zero=True),
                      gradients_mean=not gradients_sum, parameter_broadcast=parameter_broadcast,
                      force_fp32_communication=force_fp32_communication, zero_shard_size=zero_shard_size,
                      pipeline_result_broadcast=pipeline_result_broadcast, attention=Attention(attention),
                      attention_dropout=attention_dropout, runtime=Runtime(runtime),
                      capacity_factor=capacity_factor)
    with err_console.status("planning") as status:
        strategy, candidates = make_plan(req, progress=lambda msg: status.update(msg))
        best = None
        if layout is not None:  # the same cluster and global batch, every lever the ILP's
            status.update("the ILP's best for comparison")
            best, _ = make_plan(replace(req, layout=None, micro_batch_size=None, accumulation_steps=None, schedule=None,
                                        cp_method=None,
                                        recompute=Recompute.AUTO, recompute_layers=None, gradient_accumulation_shard="auto",
                                        offload=Offload.AUTO if states_offload is not Offload.NONE else Offload.NONE,
                                        offload_activations=ActivationOffload.AUTO
                                        if activations_offload is not ActivationOffload.NONE else ActivationOffload.NONE), progress=lambda msg: status.update(f"best: {msg}"))
    out = Path(out_path) if out_path else Path(f"{Path(model).stem}.strategy.json")
    strategy.save(out)
    if group_ckpt_out:
        from planner.graph import load_graph
        from planner.groups import save_groups

        save_groups(strategy, load_graph(model, dict(strategy.model.dims)) if strategy.pipeline else None, group_ckpt_out)
    if strategy_out:
        from planner.strategy_ckpt import save_strategy_checkpoint

        save_strategy_checkpoint(strategy, strategy_out, only_trainable_params=only_trainable_params)
    if as_json:
        click.echo(strategy.to_json())
        return
    render_plan(strategy, candidates, out)
    if best is not None:
        render_layout_comparison(strategy, best)


@main.command()
@click.argument("strategy_path", metavar="STRATEGY")
@click.option("--top", type=int, default=10, show_default=True, help="Most expensive ops shown.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--report", default=None, metavar="PATH.html", help="Write an HTML report with plots.")
@click.option("--timeline", default=None, metavar="PATH.png", help="Draw a pipelined plan's schedule.")
@one_line_errors
def explain(strategy_path: str, top: int, as_json: bool, report: str | None, timeline: str | None) -> None:
    """Explain a strategy: costly ops, collectives, memory, and the same model under the baselines."""
    from planner.explain import explain_strategy, write_html_report
    from planner.search.baselines import hand_layouts
    from planner.strategy import load_strategy

    data = explain_strategy(strategy_path, top=top, hand_layouts=hand_layouts)
    if report:
        write_html_report(data, report)
    if timeline:
        from meshplan.cli.timeline import draw_timeline

        draw_timeline(load_strategy(strategy_path), timeline)
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    render_explain(data, report)


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
def diff(a: str, b: str, as_json: bool) -> None:
    """What changed between two strategies: placements, node strategies, collectives, predicted cost."""
    from planner.explain import diff as strategy_diff
    from planner.strategy import load_strategy

    d = strategy_diff(load_strategy(a), load_strategy(b))
    if as_json:
        click.echo(json.dumps(d, indent=1))
        return
    render_diff(d)


@main.command()
@click.option("--shape", required=True, metavar="D0,D1,…", help="Global shape of the tensor, e.g. 1024,4096.")
@click.option("--from", "src", required=True, metavar="PLACEMENTS", help="Source placements, e.g. S(0),R.")
@click.option("--to", "dst", required=True, metavar="PLACEMENTS", help="Target placements, e.g. R,S(1).")
@mesh_options
@click.option("--no-all-to-all", is_flag=True, help="Replace all_to_all by all_gather + slice (MindSpore's enable_alltoall=False).")
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
def reshard(shape: str, src: str, dst: str, devices: int, mesh: str | None, axis_names: str | None,
            profile_name: str, dtype: str | None, no_all_to_all: bool, as_json: bool) -> None:
    """The collectives that move a tensor from one sharding to another, with bytes and time."""
    from core.mesh import MeshError
    from core.placement import parse_spec
    from core.reshard import plan_reshard
    from costmodel.comm import collective_time_s
    from hwprofiles.files import load_profile

    prof = load_profile(profile_name)
    m = build_mesh(devices, mesh, axis_names, prof.devices_per_node)
    try:
        dims = tuple(int(x) for x in shape.split(","))
    except ValueError:
        raise MeshError(f"--shape {shape!r} does not parse; write dims joined by commas, e.g. 1024,4096") from None
    a, b = parse_spec(src, len(dims)), parse_spec(dst, len(dims))
    a.validate(dims, m.shape, "--from")
    b.validate(dims, m.shape, "--to")
    prec = precision_for(dtype, prof)
    plan = plan_reshard(a, b, dims, m.shape, prec.activation_bytes, enable_all_to_all=not no_all_to_all)
    rows = []
    for st in plan.steps:
        t = collective_time_s(prof, m, st.collective, st.size_bytes, (st.axis,)) if st.collective else 0.0
        rows.append({"op": st.collective.value if st.collective else "local", "axis": m.axis_names[st.axis],
                     "from": str(st.src), "to": str(st.dst), "bytes": st.size_bytes, "time_s": t})
    if as_json:
        click.echo(json.dumps({"from": str(a), "to": str(b), "mesh": list(m.shape), "steps": rows}, indent=1))
        return
    render_reshard(rows, f"{a} → {b} on mesh {m} ({prof.name}, {prec.name})")


@main.command()
@click.argument("model", type=click.Path(dir_okay=True, path_type=str))
@dim_option
@mesh_options
@click.option("--op", "op_types", multiple=True, help="Only nodes of these op types (repeatable).")
@click.option("--node", "node_names", multiple=True, help="Only these nodes (repeatable).")
@click.option("--top", type=int, default=10, show_default=True, help="Strategies shown per node, cheapest first.")
@click.option("--strict", is_flag=True, help="Fail if an op type has no sharding rule.")
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
def strategies(model: str, dims: dict[str, int], devices: int, mesh: str | None, axis_names: str | None,
               profile_name: str, dtype: str | None, op_types: tuple[str, ...], node_names: tuple[str, ...], top: int,
               strict: bool, as_json: bool) -> None:
    """Each op's sharding strategies on the mesh, priced for one training step (without resharding)."""
    from costmodel.step import CostModel
    from hwprofiles.files import load_profile
    from planner.graph import load_graph
    from planner.rules import rules_for_graph

    prof = load_profile(profile_name)
    m = build_mesh(devices, mesh, axis_names, prof.devices_per_node)
    graph = load_graph(model, dims)
    rs = rules_for_graph(graph, m, strict=strict)
    cm = CostModel(graph, m, prof, precision_for(dtype, prof))
    out: list[dict[str, Any]] = []
    for name, ns in rs.by_node.items():
        if (op_types and ns.node.op_type not in op_types) or (node_names and name not in node_names):
            continue
        rows: list[dict[str, Any]] = []
        for s in ns.strategies:
            # Parameters stored as this strategy requires them: their states and gradient syncs.
            params = [(t, spec) for t, spec in zip(ns.node.inputs, s.input_specs, strict=True)
                      if spec is not None and t in cm.param_owner]
            sync = sum(e.time_s for t, spec in params for e in cm.edge_events(t, spec, spec, cm.split_axes(s)))
            c = cm.node_cost(ns.node, s)
            rows.append({"strategy": s.name, "compute_s": c.compute.total_s, "comm_s": sync,
                         "param_bytes": sum(cm.states.param_state_bytes(t, spec) for t, spec in params),
                         "activation_bytes": c.activation_bytes})
        rows.sort(key=lambda r: r["compute_s"] + r["comm_s"])
        out.append({"node": name, "op_type": ns.node.op_type, "module": ns.node.module_path, "fallback": ns.fallback,
                    "num_strategies": len(ns.strategies), "strategies": rows[:top]})
    fallbacks = sorted({n.op_type for n in rs.fallbacks})
    if as_json:
        click.echo(json.dumps({"mesh": list(m.shape), "nodes": out, "fallback_op_types": fallbacks}, indent=1))
        return
    render_strategies(out, fallbacks)


@main.command()
@click.option("--config", "config_path", default="meshplan-check.toml", show_default=True,
              help="The cases to check (TOML, see examples/ci).")
@click.option("--baseline", default=None, help="Baseline directory (default: meshplan-baseline beside the config).")
@click.option("--run", "run_cases", is_flag=True, help="Also execute every case and compare what it measures.")
@click.option("--update", is_flag=True, help="Write the new baseline (the only way it changes).")
@click.option("--summary", "summary_path", default=None, metavar="PATH.md", help="Markdown report (e.g. $GITHUB_STEP_SUMMARY).")
@click.option("--junit", "junit_path", default=None, metavar="PATH.xml", help="JUnit XML report.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@one_line_errors
def check(config_path: str, baseline: str | None, run_cases: bool, update: bool, summary_path: str | None,
          junit_path: str | None, as_json: bool) -> None:
    """Gate CI on regressions: plan every case again (and run it, with --run) and compare with the
    committed baseline. Exit 0: nothing regressed; 1: something did; 2: an error."""
    from meshplan.check import check as run_check
    from meshplan.check import exit_code
    from meshplan.check.report import as_json as report_json
    from meshplan.check.report import junit, markdown
    from meshplan.cli.render import render_check

    with err_console.status("checking") as status:
        results = run_check(config_path, baseline=baseline, run=run_cases, update=update,
                            progress=lambda msg: status.update(msg))
    if summary_path:
        with open(summary_path, "a") as f:  # $GITHUB_STEP_SUMMARY is appended to
            f.write(markdown(results))
    if junit_path:
        with open(junit_path, "w") as f:
            f.write(junit(results))
    if as_json:
        click.echo(report_json(results))
    else:
        render_check(results)
    for r in results:
        if r.error:
            err_console.print(f"meshplan: error: {worded(r.error)}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(exit_code(results))


@main.command("run")
@click.argument("strategy_path", metavar="STRATEGY")
@click.option("--model", "model_path", required=True, help="The .onnx file the strategy was planned for.")
@click.option("--nproc", type=int, required=True, help="Ranks to spawn (must equal the mesh size).")
@click.option("--steps", type=int, default=5, show_default=True, help="Measured steps after warm-up.")
@click.option("--warmup", type=int, default=2, show_default=True)
@click.option("--verify", is_flag=True, help="Compare loss, gradients and updated parameters with one process.")
@click.option("--loss", type=click.Choice(["auto", "cross-entropy", "mse"]), default="auto", show_default=True,
              help="auto: the loss the strategy was planned with.")
@click.option("--optimizer", type=click.Choice(["adamw", "sgd"]), default="adamw", show_default=True)
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="Seconds before every rank is stopped.")
@click.option("--save", "save_dir", default=None, metavar="DIR",
              help="Save the model and optimizer state after the last step (torch.distributed.checkpoint, sharded).")
@click.option("--load", "load_dir", default=None, metavar="DIR",
              help="Start from a checkpoint, saved under this plan or another (resharded as it loads).")
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
def run_cmd(strategy_path: str, model_path: str, nproc: int, steps: int, warmup: int, verify: bool, loss: str,
            optimizer: str, timeout_s: float, save_dir: str | None, load_dir: str | None, as_json: bool) -> None:
    """Train with a strategy on N spawned ranks (DTensor, gloo on CPU); verify against one process."""
    from executor.launch import run
    from executor.preflight import RunError, RunOptions

    if nproc < 1:
        raise RunError(f"--nproc {nproc}: needs at least 1 rank")
    result = run(strategy_path, model_path, nproc=nproc, timeout_s=timeout_s,
                 opts=RunOptions(steps=steps, warmup=warmup, verify=verify, loss=LossKind(loss), optimizer=optimizer,
                                 save=save_dir, load=load_dir))
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    render_run(result, strategy_path, nproc, 1 + warmup + steps)


@main.group("checkpoint")
def checkpoint_group() -> None:
    """Sharded checkpoints written by run --save."""


@checkpoint_group.command("inspect")
@click.argument("path", metavar="DIR")
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
def checkpoint_inspect(path: str, as_json: bool) -> None:
    """What DIR holds, and under which plan it was saved."""
    from executor.checkpoint import inspect as inspect_checkpoint

    info = inspect_checkpoint(path)
    if as_json:
        click.echo(json.dumps(info, indent=1))
        return
    render_checkpoint(path, info)


@main.group()
def profile() -> None:
    """Hardware profiles: datasheet presets, and calibration by microbenchmarks."""


@profile.command("list")
@one_line_errors
def profile_list() -> None:
    """List the preset profiles shipped with meshplan."""
    from hwprofiles.files import list_presets, load_profile

    render_presets([load_profile(name) for name in list_presets()])


@profile.command("show")
@click.argument("name_or_path")
@click.option("--json", "as_json", is_flag=True, help="Print the profile JSON.")
@one_line_errors
def profile_show(name_or_path: str, as_json: bool) -> None:
    """Show a profile (a preset name or a JSON path): every value with its unit and source."""
    from hwprofiles.files import load_profile
    from hwprofiles.profile import profile_to_json

    p = load_profile(name_or_path)
    data = profile_to_json(p)
    if as_json:
        click.echo(json.dumps(data, indent=1, ensure_ascii=False))
        return
    render_profile(p, data)


@profile.command("calibrate")
@click.option("--nproc", type=int, default=2, show_default=True, help="Ranks to spawn for the collectives.")
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default=None,
              help="nccl where CUDA is present (one GPU per rank), else gloo.")
@click.option("--quick", is_flag=True, help="Fewer sizes and repetitions (under 2 minutes at --nproc 2 on a CPU).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default="calibrated.json", show_default=True,
              help="Profile JSON to write; beside it a PNG plot and a report JSON (gloo), or the GPU's "
                   "measurements, OUT.micro.json (nccl).")
@click.option("--base", default=None, help="Start from this preset and keep what is not measured.")
@click.option("--compute-only", is_flag=True,
              help="Measure compute only (all ranks at once) and keep --base's links: seconds, not minutes.")
@click.option("--name", default=None, help="Name of the new profile.")
@click.option("--from", "from_path", type=click.Path(dir_okay=False), default=None,
              help="Fit the profile from this measurement file (the format of measure_micro.py's micro.json: "
                   "GEMMs, element-wise ops, launch, AdamW) instead of measuring here.")
@one_line_errors
def profile_calibrate(nproc: int, backend: str | None, quick: bool, out_path: str, base: str | None,
                      compute_only: bool, name: str | None, from_path: str | None) -> None:
    """Measure this machine (matmul sweep, memory copy, collectives), or read --from, and fit a profile."""

    if from_path is not None:
        from hwprofiles.measured import calibrate_from

        render_fits(calibrate_from(from_path, out_path, base=base, name=name), from_path)
        console.print(f"wrote {out_path}")
        return

    import torch

    from meshplan.cli.calibrate import calibrate_cpu, calibrate_gpu

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    run = calibrate_gpu if backend == "nccl" else calibrate_cpu
    run(nproc=nproc, backend=backend, quick=quick, out_path=out_path, base=base, compute_only=compute_only, name=name)


if __name__ == "__main__":
    main()
