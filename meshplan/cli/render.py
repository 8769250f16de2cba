"""How the CLI shows its results: rich tables on the console (errors and notes on stderr).

`cli.py` parses options and calls the planner, the executor and the profiles; what it prints is here.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from core.levers import Attention

if TYPE_CHECKING:
    from hwprofiles.measured import FitLine
    from hwprofiles.profile import HardwareProfile
    from hwprofiles.report import CalibrationReport
    from planner.strategy import Strategy, TrainingSettings

console = Console()
err_console = Console(stderr=True)


def fmt_count(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f}"


def fmt_ms(x: float) -> str:
    return f"{x * 1e3:.3f} ms"


def fmt_bytes(x: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def render_summary(s: dict[str, Any]) -> None:
    head = Table(title=f"{s['model']}  (opset {s['opset']}, fingerprint {s['fingerprint']})", show_header=False)
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_row("nodes (compute / constant)", f"{s['nodes']} ({s['compute_nodes']} / {s['constant_nodes']})")
    head.add_row("parameters", f"{s['parameters']:,} in {s['parameter_tensors']} tensors")
    head.add_row("parameter bytes", fmt_bytes(s["parameter_bytes"]))
    head.add_row("forward FLOPs (matmul-class)", fmt_count(s["flops_forward"]))
    head.add_row("forward FLOPs (other ops)", fmt_count(s["flops_forward_other"]))
    head.add_row("bound dims", ", ".join(f"{k}={v}" for k, v in s["dims"].items()) or "none (static)")
    console.print(head)

    io = Table(title="inputs and outputs")
    for col in ("", "name", "shape", "dtype"):
        io.add_column(col)
    for kind in ("inputs", "outputs"):
        for t in s[kind]:
            io.add_row(kind[:-1], t["name"], "×".join(map(str, t["shape"])) or "scalar", t["dtype"])
    console.print(io)

    ops = Table(title="compute ops")
    ops.add_column("op type")
    ops.add_column("count", justify="right")
    for op, n in s["op_types"].items():
        ops.add_row(op, str(n))
    console.print(ops)

    layers = Table(title="repeated layers (tied by the solver)")
    for col in ("prefix", "layers", "ops per layer"):
        layers.add_column(col)
    for g in s["layers"]:
        idx = g["indices"]
        layers.add_row(g["prefix"], f"{g['num_layers']} ({min(idx)}..{max(idx)})", str(g["nodes_per_layer"]))
    if not s["layers"]:
        layers.add_row("none found", "", "")
    console.print(layers)
    e = s.get("experts")
    if e:
        moe = Table(title="mixture of experts", show_header=False)
        moe.add_column(style="bold")
        moe.add_column(justify="right")
        moe.add_row("blocks", str(e["blocks"]))
        moe.add_row("experts per block, top-k", f"{'/'.join(map(str, e['num_experts']))}, top-"
                    f"{'/'.join(map(str, e['top_k']))}")
        moe.add_row("parameters: routed / shared / router", f"{e['routed_parameters']:,} / {e['shared_parameters']:,} "
                    f"/ {e['router_parameters']:,}")
        moe.add_row("parameters active per token", f"{e['active_parameters']:,} of {s['parameters']:,} "
                    f"({e['active_parameters'] / s['parameters']:.1%})")
        moe.add_row("tokens per expert", e["routing"])
        console.print(moe)


def render_plan(s: Strategy, candidates: list[Any], out: Any) -> None:
    c, sv = s.cost, s.solver
    head = Table(title=f"plan for {s.model.name} on {s.profile.name}", show_header=False)
    head.add_column(style="bold")
    head.add_column()
    stage_mesh = " × ".join(f"{n}={k}" for n, k in zip(s.mesh.axis_names, s.mesh.shape, strict=True))
    pl = s.pipeline
    head.add_row("mesh", stage_mesh if pl is None else
                 f"pp={len(pl.stages)} stages × ({stage_mesh}), {pl.schedule}"
                 + (f", {pl.virtual_stages} chunks per stage" if pl.virtual_stages > 1 else "")
                 + f"; bubble {pl.bubble_fraction:.1%} of compute")
    head.add_row("mode", f"{s.settings.mode} ({s.settings.search}, {s.settings.dtype})")
    tr = s.training
    if tr.global_batch_size is not None:
        head.add_row("batch", f"{tr.global_batch_size} per step = {tr.micro_batches} micro-step(s) × "
                     f"{tr.micro_batch_size} per data-parallel rank; ZeRO {zero_text(tr)}; recomputation "
                     f"{recompute_text(tr)}")
        head.add_row("comm fusion", str(tr.comm_fusion))
        switches = [name for name, on in (("gradients summed over data-parallel ranks", not tr.gradients_mean),
                                          ("parameters broadcast from rank 0", tr.parameter_broadcast),
                                          ("fp32 reductions", tr.force_fp32_communication)) if on]
        if switches:
            head.add_row("switches", "; ".join(switches))
    if tr.attention != Attention.FLASH:
        head.add_row("attention", f"{tr.attention} (scores through memory)"
                     + (f", dropout {tr.attention_dropout:g}" if tr.attention_dropout else ""))
    overhead = f" + per-step overhead {c.overhead_s * 1e3:.2f} ms" if c.overhead_s else ""
    if c.bubble_s:
        overhead += f" + pipeline bubble {c.bubble_s * 1e3:.2f} ms"
    if c.hidden_comm_s:
        overhead += f" ({c.hidden_comm_s * 1e3:.2f} ms more communication hidden under compute)"
    host = f" + host copies {c.host_s * 1e3:.2f} ms" if c.host_copy_bytes else ""
    head.add_row("step time", f"{c.step_time_s * 1e3:.2f} ms = compute {c.compute_s * 1e3:.2f} ms "
                 f"+ optimizer {c.optimizer_s * 1e3:.2f} ms + communication {c.comm_s * 1e3:.2f} ms{host}{overhead}")
    head.add_row("memory per device", f"{fmt_bytes(c.memory_bytes_per_device)} at the peak ("
                 + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in c.memory.items()) + ")")
    if tr.offload or tr.offload_activations:
        head.add_row("offload", offload_text(s))
    if tr.dataset_strategy != "data_parallel":
        head.add_row("dataset", f"{tr.dataset_strategy}" + (
            f": each rank loads the whole batch, {fmt_bytes(c.host_copy_bytes)} a step beyond its share over the "
            f"host link ({c.host_s * 1e3:.3f} ms)" if tr.dataset_strategy == "full_batch" and not tr.offload else
            ": the inputs placed as split"))
    limit = s.settings.memory_limit_bytes
    if limit is not None and c.memory_bytes_per_device > limit:
        head.add_row("fits", f"NO: {fmt_bytes(c.memory_bytes_per_device)} > the limit {fmt_bytes(limit)}")
    head.add_row("solver", f"{sv.status} in {sv.time_s:.2f} s, objective {sv.objective:.6g} s, gap "
                 f"{sv.gap:.2%}, {sv.num_variables} variables, {sv.num_constraints} constraints")
    fb = sorted({f.op_type for f in s.fallbacks})
    head.add_row("fallbacks", ", ".join(fb) if fb else "none")
    head.add_row("written", str(out))
    console.print(head)
    for note in s.model.notes:
        err_console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if pl is not None:
        render_stages(s)
    if s.hand_layouts:
        t = Table(title="hand layouts, each planned as written (the plan is never slower than one that fits)")
        for col in ("layout", "degrees", "step time", "memory", "fits"):
            t.add_column(col)
        for h in s.hand_layouts:
            t.add_row(h.name + (" ← the plan" if h.chosen else ""), f"{h.layout}, ZeRO {h.zero}",
                      f"{h.step_time_s * 1e3:.2f} ms" if h.step_time_s is not None else "—",
                      fmt_bytes(h.memory_bytes_per_device) if h.memory_bytes_per_device is not None else "—",
                      ("yes" if h.fits else "no") if not h.error else h.error[:60])
        console.print(t)
        for h in s.hand_layouts:
            if h.chosen:
                err_console.print(f"note: the hand layout {h.name} ({h.layout}, ZeRO {h.zero}) is faster than the "
                                  "search's own plan: it is the plan written", markup=False, highlight=False)
    if len(candidates) > 1:
        t = Table(title="mesh candidates")
        for col in ("mesh", "step time", "memory", "status"):
            t.add_column(col)
        for cand in candidates:
            t.add_row(str(cand.mesh), f"{cand.cost.step_time_s * 1e3:.2f} ms" if cand.cost else "—",
                      fmt_bytes(cand.cost.memory_bytes) if cand.cost else "—",
                      cand.stats.status if cand.stats else cand.error[:60])
        console.print(t)


def render_explain(e: dict[str, Any], report: str | None) -> None:
    t = Table(title=f"{e['model']} — plan and baselines, priced by one cost model")
    for col in ("plan", "mesh", "step time", "compute", "comm", "memory/device", "fits"):
        t.add_column(col)
    for b in e["baselines"]:
        if b["step_time_s"] is None:
            t.add_row(b["name"], b["mesh"], "n/a", "", "", "", b.get("note", ""))
            continue
        t.add_row(b["name"], b["mesh"], f"{b['step_time_s'] * 1e3:.2f} ms",
                  *(f"{b[k] * 1e3:.2f} ms" if b[k] is not None else "" for k in ("compute_s", "comm_s")),
                  fmt_bytes(b["memory_bytes_per_device"]), "yes" if b["fits"] else "no")
    console.print(t)
    if e["pipeline"]["stages"]:
        pl = e["pipeline"]
        console.print(stages_table(f"pipeline stages ({pl['schedule']}, bubble {pl['bubble_fraction']:.1%} of compute)",
                                   pl["stages"]))
    ops = Table(title="most expensive ops (compute + their collectives)")
    for col in ("node", "op", "module", "strategy", "time"):
        ops.add_column(col, overflow="fold")
    for o in e["top_ops"]:
        ops.add_row(o["node"], o["op_type"], o["module"], o["strategy"], f"{o['time_s'] * 1e6:.1f} µs")
    console.print(ops)
    colls = Table(title="collectives per step")
    for name in ("kind", "axes", "phase", "count", "bytes", "time"):
        colls.add_column(name)
    for c in e["collectives"]:
        colls.add_row(c["kind"], ",".join(c["axes"]), c["phase"], str(c["count"]), fmt_bytes(c["bytes"]),
                      f"{c['time_s'] * 1e3:.3f} ms")
    console.print(colls)
    if e.get("experts"):
        x = e["experts"]
        line = (f"experts: ep={x['expert_parallel']}, all-to-alls {fmt_bytes(x['all_to_all_bytes'])} a step per rank, "
                f"{x['all_to_all_s'] * 1e3:.2f} ms ({x['all_to_all_share']:.1%} of the step; capacity factor "
                f"{x['capacity_factor']:g})")
        if x["without_ep"]:
            w = x["without_ep"]
            line += f"; the best plan without expert parallelism, {w['name']}: {w['step_time_s'] * 1e3:.2f} ms"
        console.print(line)
    if e.get("context"):
        x = e["context"]
        what = "passes of keys and values" if x["design"] == "ring" else "collectives on cp"
        line = (f"context: cp={x['context_parallel']}, {x['design']} design, {x['count']} {what} a step per rank, "
                f"{fmt_bytes(x['bytes'])}, {x['time_s'] * 1e3:.2f} ms priced")
        if x["without_cp"]:
            w = x["without_cp"]
            line += f"; the best plan without context parallelism, {w['name']}: {w['step_time_s'] * 1e3:.2f} ms"
        console.print(line)
    if e.get("host"):
        h = e["host"]
        console.print("host: " + "; ".join([*(f"{m} for {len(ts)} parameters" for m, ts in e["offload"].items()),
                                            *(f"saved activations of {n} layers of {g}"
                                              for g, n in e.get("offload_activations", {}).items())])
                      + f" ({fmt_bytes(h['memory_bytes_per_device'])} of host memory per device); host link "
                      f"{fmt_bytes(h['copy_bytes'])} a step, {h['exposed_s'] * 1e3:.3f} ms waited for, "
                      f"{h['hidden_s'] * 1e3:.3f} ms under compute")
    console.print("memory: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in e["memory"].items())
                  + f"; fallbacks: {', '.join(e['fallback_op_types']) or 'none'}")
    if report:
        console.print(f"report written to {report}")


def render_diff(d: dict[str, Any]) -> None:
    if not d["same_model"]:
        console.print("[bold]different models[/bold] (fingerprints differ)")
    if d["mesh"]:
        console.print(f"mesh: {d['mesh']['from']['shape']} → {d['mesh']['to']['shape']}")
    table = Table(title="predicted cost")
    for col in ("", "A", "B", "change"):
        table.add_column(col)
    for k, v in d["cost"].items():
        f, to = v["from"], v["to"]
        fmt = fmt_bytes if "memory" in k else fmt_ms
        table.add_row(k, fmt(f), fmt(to), f"{(to - f) / f:+.1%}" if f else "")
    console.print(table)
    console.print(f"{len(d['nodes'])} node strategies and {len(d['tensors'])} tensor placements differ")
    for n, v in list(d["nodes"].items())[:20]:
        console.print(f"  {n}: {v['from']}  →  {v['to']}", markup=False)
    for k, v in d["collective_bytes"].items():
        console.print(f"  {k}: {fmt_bytes(v['from'])} → {fmt_bytes(v['to'])} per step")


def render_calibration(report: CalibrationReport, nproc: int, backend: str) -> None:
    table = Table(title=f"calibration ({report.elapsed_s:.0f} s, {nproc} ranks, {backend})")
    for col in ("measured", "fit", "median |fit − measured| / measured"):
        table.add_column(col)
    assert report.efficiency is not None
    e = report.efficiency
    table.add_row("matmul sweep", f"P = {e.peak_achieved_flops_per_s / 1e9:.1f} GFLOP/s, F½ = {e.half_flops:.3g} FLOP",
                  f"{e.median_rel_error:.1%}")
    if report.conv_efficiency is not None:
        c = report.conv_efficiency
        table.add_row("3×3 conv sweep", f"P·d/(d + d½) by channels d: P = {c.peak_achieved_flops_per_s / 1e9:.1f} GFLOP/s, "
                      f"d½ = {c.half_flops:.0f}", f"{c.median_rel_error:.1%}")
    table.add_row("memory copy", f"{report.copy_bandwidth_bytes_per_s / 1e9:.2f} GB/s", "")
    table.add_row("element-wise mix", f"{report.elementwise_bandwidth_bytes_per_s / 1e9:.2f} GB/s", "")
    table.add_row("op overhead", f"{report.op_overhead_s * 1e6:.2f} µs per op through the executor "
                  f"({report.bare_op_s * 1e6:.2f} µs bare), {report.step_overhead_s * 1e6:.0f} µs per step", "")
    table.add_row("optimizer step (AdamW)", f"{report.optimizer_fixed_s * 1e6:.0f} µs + {report.optimizer_tensor_s * 1e6:.1f} µs "
                  f"per tensor + {report.optimizer_param_s * 1e9:.2f} ns per parameter", "")
    if report.reshard_overhead_s > 0:
        table.add_row("reshard overhead", f"{report.reshard_overhead_s * 1e6:.0f} µs per DTensor redistribute", "")
    for k, fit in report.fits.items():
        table.add_row(k, f"α = {fit.alpha_s * 1e6:.1f} µs, β = {fit.bus_bandwidth_bytes_per_s / 1e9:.2f} GB/s",
                      f"{fit.median_rel_error:.1%}")
    console.print(table)


def render_fits(lines: list[FitLine], origin: str) -> None:
    table = Table(title=f"profile fitted from {origin}")
    for col in ("fit", "model", "points", "median / largest |fit − measured| / measured", "written"):
        table.add_column(col)
    for f in lines:
        err = "" if f.median_error != f.median_error or f.points < 2 else f"{f.median_error:.1%} / {f.max_error:.1%}"
        table.add_row(f.what, f.model, str(f.points), err, "yes" if f.accepted else f"no: {f.note}")
    console.print(table)


def render_run(result: dict[str, Any], strategy_path: str, nproc: int, steps: int) -> None:
    t = Table(title=f"run of {strategy_path} on {nproc} ranks", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("loss", f"{result['loss']:.6f}")
    if "within_tolerance" in result:
        t.add_row("bf16 tolerance", ("within" if result["within_tolerance"] else "OUTSIDE") +
                  " (loss {loss:.1e}, grads {grads:.0e}, params {params_after_step:.0e} a step)".format(**result["tolerance"]))
    if result.get("reduce_dtypes"):
        t.add_row("reductions in", ", ".join(result["reduce_dtypes"]))
    if "max_abs_diff" in result:
        t.add_row("vs one process", f"max |diff| {result['max_abs_diff']:.2e} (loss {result['loss_abs_diff']:.1e}, "
                  f"grads {result['grad_max_abs_diff']:.1e}, params after step {result['param_max_abs_diff']:.1e}, "
                  f"after {steps} steps {result['final_param_max_abs_diff']:.1e})")
    ms, ps = result["measured_step_s"], result["predicted_step_s"]
    t.add_row("step time", f"measured {ms * 1e3:.2f} ms, predicted {ps * 1e3:.2f} ms (ratio {ps / ms:.2f})")
    mp, pp = result["measured_phases_s"], result["predicted_phases_s"]
    t.add_row("  measured", ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.2f}" for k, v in mp.items()) + " ms")
    bubble = f"pipeline bubble {pp['bubble_s'] * 1e3:.2f}, " if pp.get("bubble_s") else ""
    t.add_row("  predicted", f"compute {pp['compute_s'] * 1e3:.2f}, communication {pp['comm_s'] * 1e3:.2f}, {bubble}"
              f"optimizer {pp['optimizer_s'] * 1e3:.2f}, per-step overhead {pp.get('overhead_s', 0.0) * 1e3:.2f} ms")
    mm, pm = result["measured_memory_bytes"], result["predicted_memory_bytes"]
    t.add_row("memory per rank", f"measured {fmt_bytes(mm)} (model states + saved activations), "
              f"predicted {fmt_bytes(pm)}")
    if "stages" not in result:
        t.add_row("collectives planned", _planned(result["collectives_planned"]))
        t.add_row("collectives executed", json.dumps(result["collectives_executed"], sort_keys=True))
    console.print(t)
    if "stages" in result:  # pipelined: ranks differ by stage
        st = Table(title="pipeline stages (each stage's first rank)")
        for col in ("stage", "rank", "step", "per micro-batch: forward + backward measured / planned",
                    "memory measured / predicted", "collectives and sends planned", "executed"):
            st.add_column(col)
        m = result["micro_batches"]
        for row in result["stages"]:
            ph = row["measured_phases_s"]
            st.add_row(str(row["stage"]), str(row["rank"]), f"{row['measured_step_s'] * 1e3:.2f} ms",
                       f"{(ph['forward'] + ph['backward']) / m * 1e3:.2f} / {row['predicted_micro_batch_s'] * 1e3:.2f} ms",
                       f"{fmt_bytes(row['measured_memory_bytes'])} / {fmt_bytes(row['predicted_memory_bytes'])}",
                       _planned(row["collectives_planned"]),
                       json.dumps(row["collectives_executed"], sort_keys=True))
        console.print(st)


def _planned(counts: dict[str, int] | None) -> str:
    if counts is None:
        return "not recorded (a strategy written before its gradient buckets were; plan again to compare)"
    return json.dumps(counts, sort_keys=True)


def render_layout_comparison(held: Strategy, best: Strategy) -> None:
    """A hand layout's predicted step next to the ILP's best plan for the same cluster and batch."""
    t = Table(title="the layout against the ILP's best plan (same devices, global batch, profile)")
    for col in ("plan", "mesh", "micro-steps × per-rank batch", "ZeRO", "recompute", "step time", "memory/device",
                "fits"):
        t.add_column(col)
    for name, s in ((f"layout {held.training.layout}", held), ("ILP's best", best)):
        tr, limit = s.training, s.settings.memory_limit_bytes
        t.add_row(name, " × ".join(f"{n}={k}" for n, k in zip(s.mesh.axis_names, s.mesh.shape, strict=True)),
                  f"{tr.micro_batches} × {tr.micro_batch_size}", zero_text(tr, short=True), recompute_text(tr, short=True),
                  f"{s.cost.step_time_s * 1e3:.1f} ms", fmt_bytes(s.cost.memory_bytes_per_device),
                  "yes" if limit is None or s.cost.memory_bytes_per_device <= limit else "no")
    console.print(t)
    ratio = held.cost.step_time_s / best.cost.step_time_s
    limit = held.settings.memory_limit_bytes
    if limit is not None and held.cost.memory_bytes_per_device > limit:
        console.print(f"the layout does not fit ({fmt_bytes(held.cost.memory_bytes_per_device)} per device > "
                      f"{fmt_bytes(limit)}); the ILP's best that fits takes {best.cost.step_time_s * 1e3:.1f} ms")
    else:
        console.print(f"the layout's step is {ratio:.2f}× the ILP's best")


def zero_text(tr: TrainingSettings, *, short: bool = False) -> str:
    """The plan's ZeRO: its stage, and how many parameters (tied ones counted alone) take each."""
    if tr.zero_stages is None:
        return str(tr.zero_stage) if short else f"stage {tr.zero_stage}"
    counts = Counter(tr.zero_stages.values())
    if short:
        return "/".join(map(str, sorted({tr.zero_stage, *counts})))
    parts = ", ".join(f"{n} parameters at stage {stage}" for stage, n in sorted(counts.items()))
    return f"stage {tr.zero_stage}" + (f" ({parts})" if parts else "")


def offload_text(s: Strategy) -> str:
    """What the plan keeps in host memory, and what its host link carries."""
    c, tr = s.cost, s.training
    by_mode: dict[str, int] = {}
    for m in tr.offload.values():
        by_mode[str(m)] = by_mode.get(str(m), 0) + 1
    modes = ", ".join([*(f"{m} of {n} parameter(s)" for m, n in sorted(by_mode.items())),
                       *(f"saved activations of {n} layer(s) of {g}" for g, n in tr.offload_activations.items())])
    share = c.host_s / c.step_time_s if c.step_time_s else 0.0
    return (f"{modes} on the host ({fmt_bytes(c.host_memory_bytes)} of host memory per device); host link "
            f"{fmt_bytes(c.host_copy_bytes)} a step, {c.host_s * 1e3:.2f} ms waited for ({share:.1%} of the step), "
            f"{c.hidden_host_s * 1e3:.2f} ms under compute" + ("; optimizer step on the host" if by_mode else ""))


def recompute_text(tr: TrainingSettings, *, short: bool = False) -> str:
    """The recomputation policy per layer group, with the layers recomputed where counted."""
    if not tr.recompute:
        return "none"
    out = []
    for group, policy in tr.recompute.items():
        n = tr.recompute_layers.get(group)
        out.append(policy + ("" if n is None else f" {n}" if short else f" on {n} layer(s) of {group}"))
    return "; ".join(out)


def render_stages(s: Strategy) -> None:
    """A pipelined plan's stages: devices, layers, time per micro-batch, its sends (round trip), per-step
    work, peak memory."""
    assert s.pipeline is not None
    console.print(stages_table(f"pipeline stages ({s.training.micro_batches} micro-batches)",
                               [vars(st) for st in s.pipeline.stages]))


def stages_table(title: str, stages: list[dict[str, Any]]) -> Table:
    """One row per pipeline stage, from its fields as the strategy file writes them."""
    t = Table(title=title)
    for col in ("stage", "devices", "layers", "per micro-batch", "sends", "per step", "in flight", "memory/device"):
        t.add_column(col)
    for i, st in enumerate(stages):
        t.add_row(str(i), f"{st['devices'][0]}–{st['devices'][-1]}", str(st["layers"]), f"{st['time_s'] * 1e3:.2f} ms",
                  f"{st.get('send_s', 0.0) * 1e3:.2f} ms", f"{st['step_s'] * 1e3:.2f} ms", f"{st['in_flight']:g}",
                  fmt_bytes(st["memory_bytes"]))
    return t


def render_check(results: list[Any]) -> None:
    """`meshplan check`'s report: per case, what regressed, improved or changed (old → new)."""
    from meshplan.check import exit_code, show
    from meshplan.cli.options import worded

    t = Table(title="meshplan check")
    for col in ("case", "metric", "old", "new", "status", "note"):
        t.add_column(col)
    style = {"regression": "bold red", "improvement": "green", "changed": "yellow", "ok": ""}
    for r in results:
        if r.error:
            t.add_row(r.case, "—", "—", "—", "[bold red]error[/]", worded(r.error))
        for f in r.findings:
            cell = [show(f.old), show(f.new)]
            t.add_row(f.case, f.metric, *cell, f"[{style[f.status]}]{f.status}[/]" if style[f.status] else f.status,
                      f.note)
    console.print(t)
    code = exit_code(results)
    console.print({0: "no regression", 1: "regression: " + "; ".join(f.line() for r in results for f in r.findings
                                                                       if f.status == "regression"),
                   2: "error: a case could not be checked"}[code], markup=False, highlight=False, soft_wrap=True)


def render_reshard(rows: list[dict[str, Any]], title: str) -> None:
    """`meshplan reshard`: the collectives that move a tensor, one row a step."""
    table = Table(title=title)
    for col in ("op", "axis", "placement", "bytes", "time"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["op"], r["axis"], f"{r['from']} → {r['to']}", fmt_bytes(r["bytes"]), f"{r['time_s'] * 1e6:.1f} µs")
    if not rows:
        table.add_row("none", "", "already there", "", "")
    console.print(table)


def render_strategies(nodes: list[dict[str, Any]], fallbacks: list[str]) -> None:
    """`meshplan strategies`: a table per node, its strategies cheapest first."""
    for entry in nodes:
        table = Table(title=f"{entry['node']} ({entry['op_type']}, {entry['module'] or 'no module'}): "
                            f"{entry['num_strategies']} strategies{' — FALLBACK' if entry['fallback'] else ''}")
        for col in ("strategy", "compute", "grad sync", "params+states", "saved act."):
            table.add_column(col)
        for r in entry["strategies"]:
            table.add_row(r["strategy"], f"{r['compute_s'] * 1e6:.1f} µs", f"{r['comm_s'] * 1e6:.1f} µs",
                          fmt_bytes(r["param_bytes"]), fmt_bytes(r["activation_bytes"]))
        console.print(table)
    console.print(f"fallback (replicated) op types: {', '.join(fallbacks) or 'none'}")


def render_checkpoint(path: str, info: dict[str, Any]) -> None:
    """`meshplan checkpoint inspect`: what a checkpoint holds, under which plan it was saved."""
    console.print(f"{path}: {info['model_name']} (fingerprint {info['model_fingerprint']}), saved after "
                  f"{info['optimizer_steps']} optimizer steps under mesh "
                  + " × ".join(f"{a}={n}" for a, n in zip(info["axis_names"], info["mesh"], strict=True))
                  + (f", layout {info['layout']}" if info.get("layout") else ""), markup=False, highlight=False)
    t = Table()
    for col in ("tensor", "shape", "shards"):
        t.add_column(col)
    for k, v in info["tensors"].items():
        t.add_row(k, "×".join(map(str, v["shape"])) or "scalar", str(v["shards"]))
    console.print(t)


def render_presets(profiles: list[HardwareProfile]) -> None:
    """`meshplan profile list`."""
    table = Table(title="hardware profile presets")
    for col in ("name", "origin", "description"):
        table.add_column(col)
    for p in profiles:
        table.add_row(p.name, p.origin.get("kind", ""), p.description)
    console.print(table)


def render_profile(p: HardwareProfile, data: dict[str, Any]) -> None:
    """`meshplan profile show`: every value of the profile with its unit and source."""
    table = Table(title=f"{p.name} — {p.description}  (digest {p.digest})")
    for col in ("field", "value", "unit", "source"):
        table.add_column(col, overflow="fold", no_wrap=col == "field")
    for path, q in _quantities(data):
        table.add_row(path, f"{q['value']:.4g}", q["unit"], q["source"])
    console.print(table)


def _quantities(obj: Any, prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
    if isinstance(obj, dict) and {"value", "unit", "source"} <= obj.keys():
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() if k != "table" for x in _quantities(v, f"{prefix}.{k}" if prefix else k)]
    return []
