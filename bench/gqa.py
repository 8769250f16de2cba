"""`python -m bench.run --only gqa`: grouped-query attention under tensor parallelism, predicted against
measured.

llama-gqa (16 query heads, 4 KV heads) on 4 gloo ranks as one tensor-parallel axis, planned twice with
q, gate and up column-parallel and o and down row-parallel as Megatron-LM splits them, and the rest but
the k and v projections left to the ILP (`--mode semi`):
  column  k and v split by KV head (weights S(0)): one KV head per rank, its input the one q reads;
  row     k and v split over their input (weights S(1)): partial sums, reduced where attention reads
          them (the plan `plan` chose before a redistribute shared by q, k and v was priced once).
Both, and the plan with k and v left to the ILP, run by the executor on this machine's profile
(calibrated first, links and compute), in alternating rounds; the table puts the predicted ratios of
their steps next to the measured ones.
"""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import zoo

LAYOUTS = {"column": "S(0)", "row": "S(1)"}
DIMS = {"batch": 8, "seq": 128}


MEGATRON = {"self_attn.q_proj": "S(0)", "self_attn.o_proj": "S(1)", "mlp.gate_proj": "S(0)", "mlp.up_proj": "S(0)",
            "mlp.down_proj": "S(1)"}


OUTPUT = {"S(0)": "S(2)", "S(1)": "P"}  # a projection's output ([batch, seq, features]) by its weight's split


def _pins(graph: Any, placement: str | None) -> dict[str, str]:
    """Megatron's column/row split of the projections, weights and outputs; k and v at `placement`
    (None: left to the ILP)."""
    split = {**MEGATRON, **({} if placement is None else {f"self_attn.{p}_proj": placement for p in "kv"})}
    pins = {}
    for n in graph.compute_nodes:
        m = next((m for m in split if n.module_path.endswith(m)), None)
        if m is not None and n.op_type in ("MatMul", "Gemm"):
            pins[f"{n.module_path}.weight"] = split[m]
            pins[n.outputs[0]] = OUTPUT[split[m]]
    return pins


def kv_placement(strategy: Any) -> str:
    """Which of LAYOUTS a plan computes the k and v projections in ("other" for neither): each weight's
    spec where its MatMul reads it (a weight stored split but gathered for use computes replicated)."""
    used = {str(_used_spec(strategy, f"model.model.layers.{i}.self_attn.{p}_proj.weight")) for i in range(2) for p in "kv"}
    for name, placement in LAYOUTS.items():
        if used == {placement}:
            return name
    return "other: " + ", ".join(sorted(used))


def projection_placement(strategy: Any, proj: str) -> str:
    """The spec both layers compute projection `proj` ("k", "v") with, or "mixed"."""
    used = {str(_used_spec(strategy, f"model.model.layers.{i}.self_attn.{proj}_proj.weight")) for i in range(2)}
    return used.pop() if len(used) == 1 else "mixed"


def _used_spec(strategy: Any, weight: str) -> Any:
    """The spec a weight is used in: where the plan re-places it for its reader, else where it is stored."""
    moved = [r.dst for r in strategy.reshards if r.tensor == weight]
    return moved[0] if moved else strategy.tensors[weight].spec


def bench_gqa(console: Console, rounds: int = 3) -> None:
    from executor.calibrate import calibrate
    from executor.launch import run
    from executor.preflight import RunOptions
    from hwprofiles.calibrate import CalibrationConfig
    from hwprofiles.files import save_profile
    from planner.graph import load_graph
    from planner.search.baselines import data_parallel_strategy
    from planner.search.plan import make_plan
    from planner.search.request import Mode, PlanRequest

    path = str(zoo.export("llama-gqa"))
    console.print("calibrating this machine on 4 ranks first ...")
    profile, _ = calibrate(CalibrationConfig(nproc=4, name="cpu"), plan_data_parallel=data_parallel_strategy)
    where = "/tmp/meshplan-gqa-profile.json"
    save_profile(profile, where)
    base = PlanRequest(model=path, dims=DIMS, profile=where, devices=4, mesh_shape=(4,), axis_names=("tp",))
    graph = load_graph(path, DIMS)
    variants: dict[str, str | None] = {**LAYOUTS, "ilp": None}
    measured: dict[str, list[float]] = {name: [] for name in variants}
    predicted: dict[str, float] = {}
    for _ in range(rounds):
        for name, placement in variants.items():
            strategy, _ = make_plan(PlanRequest(**{**base.__dict__, "mode": Mode.SEMI, "pins": _pins(graph, placement)}))
            if placement is None:
                free = strategy
            out = f"/tmp/meshplan-gqa-{name}.json"
            strategy.save(out)
            predicted[name] = strategy.step_time_s
            steps = min(500, max(20, int(3.0 / strategy.step_time_s)))
            r = run(out, path, nproc=4, opts=RunOptions(steps=steps, warmup=5))
            measured[name].append(r["measured_step_s"])
    table = Table(title=f"llama-gqa {DIMS['batch']}×{DIMS['seq']} on 4 gloo ranks (tp=4): k and v placement, "
                        f"median of {rounds} alternating rounds")
    for col in ("k, v", "predicted ms", "measured ms", "rounds min–max ms"):
        table.add_column(col, justify="left" if col == "k, v" else "right")
    med = {n: statistics.median(v) for n, v in measured.items()}
    for name, placement in variants.items():
        table.add_row(f"{name} ({placement or 'left to it: ' + kv_placement(free)})", f"{predicted[name] * 1e3:.2f}", f"{med[name] * 1e3:.2f}",
                      f"{min(measured[name]) * 1e3:.2f}–{max(measured[name]) * 1e3:.2f}")
    console.print(table)
    console.print(f"row / column: predicted {predicted['row'] / predicted['column']:.3f}, measured "
                  f"{med['row'] / med['column']:.3f}; the ILP's / column: predicted "
                  f"{predicted['ilp'] / predicted['column']:.3f}, measured {med['ilp'] / med['column']:.3f}")
