"""`meshplan explain`: a strategy next to the baselines, all priced by the same cost model.

Baselines on the strategy's own mesh: fully replicated (every op on every device), data parallel
(batch split over all axes, parameters replicated) and FSDP (data parallel with every parameter
split on its first dim over all axes, gathered for use). The plan's optimum is taken over a superset
of these, so it is never slower than one that fits in memory.
"""

from __future__ import annotations

import base64
import html
import io
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from core.collectives import Purpose
from core.context import RING, cp_axis
from core.errors import MeshplanError, ProfileError
from core.experts import CAPACITY_FACTOR
from core.graph import OpGraph, numbered_levels
from core.levers import CpMethod
from core.mesh import DeviceMesh
from costmodel.compose import StepCost
from costmodel.memory import PRECISIONS
from costmodel.step import CostModel
from hwprofiles.files import load_profile
from hwprofiles.profile import HardwareProfile
from planner.graph import load_graph
from planner.strategy import NodePlan, ProfileRef, Strategy, StrategyError, load_strategy


def _planned_profile(path: str, planned: ProfileRef) -> HardwareProfile:
    """The profile the plan was priced with, found again by its source (a preset or a file) and refused
    if it changed since."""
    source = planned.source or planned.name
    try:
        profile = load_profile(source)
    except ProfileError as e:
        raise StrategyError(f"{path}: the profile it was planned with cannot be loaded ({e}); re-plan with "
                            "meshplan plan") from e
    if profile.digest != planned.digest:
        raise StrategyError(f"{path}: the profile {source} changed since planning (digest {planned.digest}, now "
                            f"{profile.digest}); re-plan with meshplan plan `profile` {source}")
    return profile


# The hand layouts to price on a plan's mesh and training step (planner/search/baselines.py, passed in
# by the caller: explain reads a strategy and prices; it does not search).
Baselines = Callable[[OpGraph, DeviceMesh, CostModel], Mapping[str, "StepCost | str"]]


def explain_strategy(path: str, *, top: int = 10, hand_layouts: Baselines | None = None) -> dict[str, Any]:
    strategy = load_strategy(path)
    model_path = strategy.model.path
    if not Path(model_path).exists():
        raise MeshplanError(f"{path}: its model {model_path} is gone; re-plan with meshplan plan")
    graph = load_graph(model_path, strategy.model.dims)
    strategy.check_model(graph)
    profile = _planned_profile(path, strategy.profile)
    mesh, settings = strategy.mesh, strategy.settings
    cm = CostModel(graph, mesh, profile, PRECISIONS[settings.dtype], loss=settings.loss,
                   micro_batches=strategy.training.micro_batches, zero_stage=strategy.training.zero_stage,
                   recompute=strategy.training.recompute_policy, composer=strategy.cost.composer,
                   recompute_layers=strategy.training.recompute_layers,
                   fp32_communication=strategy.training.force_fp32_communication,
                   zero_shard_size=strategy.training.zero_shard_size,
                   attention=strategy.training.attention, attention_dropout=strategy.training.attention_dropout,
                   runtime=settings.runtime,
                   fusion=strategy.training.comm_fusion,
                   zero_threshold_bytes=strategy.training.zero_threshold_bytes,
                   capacity_factor=strategy.training.capacity_factor or CAPACITY_FACTOR)
    limit = settings.memory_limit_bytes
    c = strategy.cost
    baselines = [{"name": f"plan ({settings.mode})", "mesh": mesh.describe_shape(), "step_time_s": c.step_time_s,
                  "compute_s": c.compute_s, "comm_s": c.comm_s, "memory_bytes_per_device": c.memory_bytes_per_device,
                  "fits": limit is None or c.memory_bytes_per_device <= limit}]
    # A pipelined plan's mesh is one stage's: baselines priced on it would ignore the other stages.
    priced_baselines: Mapping[str, StepCost | str] = (
        {"baselines": "priced for plans without pipeline stages; plan without pp to compare"}
        if strategy.pipeline is not None else {} if hand_layouts is None else hand_layouts(graph, mesh, cm))
    for name, price in priced_baselines.items():
        baselines.append(_row(name, price, mesh, limit) if not isinstance(price, str) else
                         {"name": name, "mesh": mesh.describe_shape(), "step_time_s": None, "compute_s": None,
                          "comm_s": None, "memory_bytes_per_device": None, "fits": False, "note": price})

    for h in strategy.hand_layouts:  # the incumbents the planner checked its plan against, as it priced them
        baselines.append({"name": f"hand layout {h.name}" + (" (the plan)" if h.chosen else ""),
                          "mesh": f"{h.layout}, ZeRO {h.zero}", "step_time_s": h.step_time_s, "compute_s": None,
                          "comm_s": None, "memory_bytes_per_device": h.memory_bytes_per_device, "fits": h.fits,
                          **({"note": h.error} if h.error else {})})

    def node_time(node: NodePlan) -> float:
        return node.compute_s + sum(x.time_s for x in node.collectives)

    ops: list[dict[str, Any]] = [
        {"node": name, "op_type": node.op_type, "module": node.module, "strategy": node.strategy,
         "time_s": node_time(node)} for name, node in strategy.nodes.items()]
    ops.sort(key=lambda o: -o["time_s"])
    agg: dict[tuple[str, tuple[str, ...], str], dict[str, Any]] = {}
    for node in strategy.nodes.values():
        for x in node.collectives:
            key = (x.kind.value, tuple(mesh.axis_names[i] for i in x.axes), x.phase.value)
            a = agg.setdefault(key, {"kind": key[0], "axes": list(key[1]), "phase": key[2], "count": 0, "bytes": 0.0,
                                     "time_s": 0.0})
            a["count"] += 1
            a["bytes"] += x.size_bytes
            a["time_s"] += x.time_s
    by_layer: dict[str, float] = defaultdict(float)
    for node in strategy.nodes.values():
        levels = numbered_levels(node.module)
        layer = f"{levels[0][0]}.{levels[0][1]}" if levels else (node.module.split(".")[0] or "(top)")
        by_layer[layer] += node_time(node)
    document = strategy.to_dict()
    return {
        "model": strategy.model.name, "profile": strategy.profile.name, "mesh": list(mesh.shape),
        "axis_names": list(mesh.axis_names), "cost": document["cost"], "memory": dict(c.memory),
        "baselines": baselines, "top_ops": ops[:top],
        "collectives": sorted(agg.values(), key=lambda a: -a["time_s"]),
        "cost_by_layer": dict(by_layer),
        "fallback_op_types": sorted({f.op_type for f in strategy.fallbacks}),
        "solver": document["solver"], "pipeline": document["pipeline"],
        # Offloaded states: the parameters by where their states live, and the host link's traffic.
        "offload": {str(m): sorted(t for t, x in strategy.training.offload.items() if x == m)
                    for m in sorted(set(strategy.training.offload.values()))},
        # Saved activations on the host: layer group → how many of its layers (after those recomputed).
        "offload_activations": dict(strategy.training.offload_activations),
        "host": document["cost"].get("host"),
        "experts": _experts(strategy, mesh),
        "context": _context(strategy, mesh),
    }


def _context(strategy: Strategy, mesh: DeviceMesh) -> dict[str, Any] | None:
    """A context-parallel plan's design (ring where its attention products run `RING`, else all-gather),
    the traffic on its cp axis a step per rank (the ring's passes, or every collective on cp), and the
    best plan the planner found without cp (mesh candidates, hand layouts); None without a cp axis."""
    a = cp_axis(mesh)
    if a is None:
        return None
    ring = any(len(n.kernels) > a and n.kernels[a] == RING for n in strategy.nodes.values())
    events = [x for node in strategy.nodes.values() for x in node.collectives
              if (x.purpose is Purpose.CONTEXT_PASS if ring else a in x.axes)]
    k = strategy.training.micro_batches
    others = [(f"mesh {'x'.join(map(str, c.mesh))} ({', '.join(c.axis_names)})", c.step_time_s)
              for c in strategy.candidates if c.step_time_s is not None and "cp" not in c.axis_names]
    others += [(f"hand layout {h.name} ({h.layout})", h.step_time_s) for h in strategy.hand_layouts
               if h.step_time_s is not None and h.fits and not h.chosen and "cp=" not in h.layout]
    best = min(others, key=lambda o: o[1], default=None)
    return {"context_parallel": mesh.shape[a], "design": str(CpMethod.RING if ring else CpMethod.ALLGATHER),
            "count": len(events) * k, "bytes": sum(x.size_bytes for x in events) * k,
            "time_s": sum(x.time_s for x in events) * k,
            "without_cp": None if best is None else {"name": best[0], "step_time_s": best[1]}}


def _experts(strategy: Strategy, mesh: DeviceMesh) -> dict[str, Any] | None:
    """A mixture-of-experts plan's expert parallelism: its degree, its all-to-alls' time a step and share
    of the step, and the best plan the planner found without it (mesh candidates without an ep axis and
    the hand layouts, none of which split experts); None for a dense model."""
    if strategy.training.capacity_factor is None:
        return None
    events = [x for node in strategy.nodes.values() for x in node.collectives
              if x.purpose in (Purpose.EXPERT_DISPATCH, Purpose.EXPERT_COMBINE)]
    ep = dict(zip(mesh.axis_names, mesh.shape, strict=True)).get("ep", 1) if events else 1
    a2a_s = sum(x.time_s for x in events) * strategy.training.micro_batches
    others = [(f"mesh {'x'.join(map(str, c.mesh))} ({', '.join(c.axis_names)})", c.step_time_s)
              for c in strategy.candidates if c.step_time_s is not None and "ep" not in c.axis_names]
    others += [(f"hand layout {h.name} ({h.layout})", h.step_time_s) for h in strategy.hand_layouts
               if h.step_time_s is not None and h.fits and not h.chosen]
    best = min(others, key=lambda o: o[1], default=None)
    return {"expert_parallel": ep, "capacity_factor": strategy.training.capacity_factor,
            "all_to_all_bytes": sum(x.size_bytes for x in events) * strategy.training.micro_batches,
            "all_to_all_s": a2a_s, "all_to_all_share": a2a_s / strategy.cost.step_time_s,
            "without_ep": None if ep == 1 or best is None else {"name": best[0], "step_time_s": best[1]}}


def _row(name: str, cost: StepCost, mesh: DeviceMesh, limit: float | None) -> dict[str, Any]:
    return {"name": name, "mesh": mesh.describe_shape(), "step_time_s": cost.step_time_s, "compute_s": cost.compute_s,
            "comm_s": cost.comm_s, "memory_bytes_per_device": cost.memory_bytes,
            "fits": limit is None or cost.memory_bytes <= limit}


def write_html_report(e: dict[str, Any], path: str) -> None:
    """An HTML page with the tables and two plots: cost by layer and memory by category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def png(fig: Any) -> str:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        return base64.b64encode(buf.getvalue()).decode()

    layers = list(e["cost_by_layer"].items())
    fig, ax = plt.subplots(figsize=(max(6, len(layers) * 0.25), 3.5))
    ax.bar(range(len(layers)), [v * 1e3 for _, v in layers])
    ax.set_xticks(range(len(layers)), [k for k, _ in layers], rotation=90, fontsize=6)
    ax.set_ylabel("ms per step (compute + collectives)")
    ax.set_title("cost by layer")
    layer_png = png(fig)
    fig, ax = plt.subplots(figsize=(5, 3))
    mem = e["memory"]
    ax.bar(list(mem), [v / 2**30 for v in mem.values()])
    ax.set_ylabel("GiB per device")
    ax.set_title("memory by category")
    mem_png = png(fig)

    def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r[c]))}</td>" for c in cols) + "</tr>" for r in rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>meshplan: {html.escape(e['model'])}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 6px;font-size:12px}}</style>
</head><body><h1>{html.escape(e['model'])} on {html.escape(e['profile'])}, mesh {e['mesh']} ({', '.join(e['axis_names'])})</h1>
<h2>plan and baselines</h2>{table(e['baselines'], ['name', 'mesh', 'step_time_s', 'compute_s', 'comm_s', 'memory_bytes_per_device', 'fits'])}
<h2>cost by layer</h2><img src="data:image/png;base64,{layer_png}">
<h2>memory by category</h2><img src="data:image/png;base64,{mem_png}">
<h2>most expensive ops</h2>{table(e['top_ops'], ['node', 'op_type', 'module', 'strategy', 'time_s'])}
<h2>collectives per step</h2>{table(e['collectives'], ['kind', 'axes', 'phase', 'count', 'bytes', 'time_s'])}
<p>fallback op types: {html.escape(', '.join(e['fallback_op_types']) or 'none')}</p></body></html>"""
    Path(path).write_text(page)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)


def diff(a: Strategy, b: Strategy) -> dict[str, Any]:
    """What changed from `a` to `b`: mesh, placements, node strategies, collectives, predicted cost."""
    tensors = {t: (str(a.spec_of(t)) if t in a.tensors else None, str(b.spec_of(t)) if t in b.tensors else None)
               for t in sorted(set(a.tensors) | set(b.tensors))}
    nodes = {n: (a.nodes[n].strategy if n in a.nodes else None, b.nodes[n].strategy if n in b.nodes else None)
             for n in sorted(set(a.nodes) | set(b.nodes))}

    def collective_totals(s: Strategy) -> dict[str, float]:
        out: dict[str, float] = {}
        for node in s.nodes.values():
            for c in node.collectives:
                out[c.kind.value] = out.get(c.kind.value, 0.0) + c.size_bytes
        return out

    def mesh(s: Strategy) -> dict[str, Any]:
        return {"shape": list(s.mesh.shape), "axis_names": list(s.mesh.axis_names)}

    ca, cb = collective_totals(a), collective_totals(b)
    costs = {"step_time_s": lambda s: s.cost.step_time_s, "compute_s": lambda s: s.cost.compute_s,
             "comm_s": lambda s: s.cost.comm_s, "memory_bytes_per_device": lambda s: s.cost.memory_bytes_per_device}
    return {
        "same_model": a.fingerprint == b.fingerprint,
        "mesh": None if a.mesh == b.mesh else {"from": mesh(a), "to": mesh(b)},
        "tensors": {t: {"from": x, "to": y} for t, (x, y) in tensors.items() if x != y},
        "nodes": {n: {"from": x, "to": y} for n, (x, y) in nodes.items() if x != y},
        "collective_bytes": {k: {"from": ca.get(k, 0.0), "to": cb.get(k, 0.0)} for k in sorted(set(ca) | set(cb))
                             if ca.get(k, 0.0) != cb.get(k, 0.0)},
        "cost": {k: {"from": f(a), "to": f(b)} for k, f in costs.items()},
    }
