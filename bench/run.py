"""`make bench`: the figures the issues ask for, measured on this machine, printed as tables.

    python -m bench.run [--only import] [--repeat N]

Each benchmark prints its median over `--repeat` runs and the spread (min–max).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import zoo

console = Console(width=160)


def _timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_import(repeat: int) -> None:
    """ONNX import (load without weights, bind dims, infer shapes, classify, find layers)."""
    from planner.graph import load_graph

    table = Table(title=f"import: load_graph, median of {repeat}")
    for col in ("model", "nodes", "params", "layers", "median s", "min–max s"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for name in ("gpt2-medium", "llama3-8b", "llama3-70b"):
        path = zoo.export(name)
        dims = zoo.ZOO[name].default_dims
        graph = load_graph(path, dims)
        times = _timed(lambda p=path, d=dims: load_graph(p, d).layers, repeat)
        layers = ", ".join(f"{g.num_layers}×{g.nodes_per_layer}" for g in graph.layers[:2])
        table.add_row(name, str(len(graph.nodes)), f"{graph.num_params / 1e9:.2f} B", layers,
                      f"{statistics.median(times):.2f}", f"{min(times):.2f}–{max(times):.2f}")
    console.print(table)


def _recompute(training: dict[str, Any]) -> str:
    """A plan's recomputation: per group its policy, with the layers it covers where counted."""
    counts = training.get("recompute_layers", {})
    return ", ".join(f"{policy} {counts[g]}" if g in counts else policy
                     for g, policy in training["recompute"].items()) or "none"


def _plan_run(model: str, dims: dict[str, int], devices: int, mesh: str, out: str, extra: tuple[str, ...] = ()
              ) -> tuple[float, dict[str, Any]]:
    """`meshplan plan` on an (dp, tp) mesh of H100s, end to end in a fresh process."""
    args = ["--devices", str(devices), "--mesh", mesh, "--axis-names", "dp,tp", "--profile", "h100-sxm", *extra]
    for k, v in dims.items():
        args += ["--dim", f"{k}={v}"]
    return _timed_plan(model, out, args)


def _timed_plan(model: str, out: str, args: list[str], timeout_s: float = 900) -> tuple[float, dict[str, Any]]:
    """`meshplan plan MODEL ARGS -o OUT` in a fresh process (interpreter start and import included):
    its wall time and the strategy it wrote."""
    import json
    import subprocess
    import sys

    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "cli", "plan", model, *args, "-o", out], capture_output=True, text=True,
                       timeout=timeout_s)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"plan failed: {r.stderr.strip()}")
    return wall, json.loads(open(out).read())


def bench_plan(repeat: int) -> None:
    """Planner speed: Llama-3-8B (batch 16 × seq 8192) and Llama-3-70B (batch 4 × seq 8192) in one
    step, and both at a global batch of 16 × 8192 with the training step's levers left to the planner
    (micro-steps, recomputation), on 64 H100s as an 8×8 (dp, tp) mesh, import included; to compare:
    meta-pytorch/autoparallel ≈ 114 s for the 8B case on this kind of machine (45.7 s in its ILP)."""
    import resource

    table = Table(title=f"meshplan plan, 64 H100 as 8×8 (dp, tp), median of {repeat} end-to-end runs")
    for col in ("model", "tokens per step", "wall s (median)", "min–max", "solver s", "status", "variables",
                "micro-steps", "recompute", "step ms", "memory GiB", "peak RSS MiB"):
        table.add_column(col, justify="right" if col != "model" else "left")
    cases: tuple[tuple[str, dict[str, int], tuple[str, ...]], ...] = (
        ("llama3-8b", {"batch": 16, "seq": 8192}, ()), ("llama3-70b", {"batch": 4, "seq": 8192}, ()),
        ("llama3-8b", {"seq": 8192}, ("--global-batch-size", "16")),
        ("llama3-70b", {"seq": 8192}, ("--global-batch-size", "16")))
    for name, dims, extra in cases:
        path = str(zoo.export(name))
        runs = [_plan_run(path, dims, 64, "8x8", f"/tmp/meshplan-bench-{name}.json", extra) for _ in range(repeat)]
        walls = [w for w, _ in runs]
        s = runs[-1][1]
        sv, cost, tr = s["solver"], s["cost"], s["training"]  # type: ignore[index]
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        batch = extra[1] if extra else str(dims["batch"])
        table.add_row(name, f"{batch}×{dims['seq']}", f"{statistics.median(walls):.2f}",
                      f"{min(walls):.2f}–{max(walls):.2f}", f"{sv['time_s']:.2f}", sv["status"],  # type: ignore[index]
                      str(sv["num_variables"]), str(tr["micro_batches"]),  # type: ignore[index]
                      _recompute(tr),  # type: ignore[arg-type]
                      f"{cost['step_time_s'] * 1e3:.1f}",  # type: ignore[index]
                      f"{cost['memory_bytes_per_device'] / 2**30:.1f}", f"{rss:.0f}")  # type: ignore[index]
    console.print(table)


def bench_layers(repeat: int) -> None:
    """Planner time against depth at Llama-3-8B's width (batch 4 × seq 8192, 8×8): it must stay flat."""
    table = Table(title="meshplan plan time against layer count (Llama-3-8B width, 4×8192 tokens, 8×8)")
    for col in ("layers", "nodes", "wall s (median)", "solver s", "status", "variables"):
        table.add_column(col, justify="right")
    for layers, name in ((4, "llama3-8b-4l"), (8, "llama3-8b-8l"), (16, "llama3-8b-16l"), (32, "llama3-8b"),
                         (80, "llama3-8b-80l")):
        path = str(zoo.export(name))
        runs = [_plan_run(path, {"batch": 4, "seq": 8192}, 64, "8x8", f"/tmp/meshplan-bench-{name}.json")
                for _ in range(repeat)]
        s = runs[-1][1]
        sv = s["solver"]  # type: ignore[index]
        table.add_row(str(layers), str(len(s["nodes"])), f"{statistics.median(w for w, _ in runs):.2f}",  # type: ignore[arg-type]
                      f"{sv['time_s']:.2f}", sv["status"], str(sv["num_variables"]))  # type: ignore[index]
    console.print(table)


# The plans `--only fidelity` predicts and runs: (label, zoo model, dims, PlanRequest levers) — every
# small zoo model as the ILP plans it for 2 ranks, and GPT-2 under each lever of the training step.
_GPT2 = {"batch": 8, "seq": 64}
FIDELITY_PLANS: list[tuple[str, str, dict[str, int], dict[str, Any]]] = [
    ("mlp", "mlp", {"batch": 256}, {}), ("mlp-legacy", "mlp-legacy", {"batch": 256}, {}),
    ("convnet", "convnet", {"batch": 16}, {}), ("convnet-legacy", "convnet-legacy", {"batch": 16}, {}),
    ("gpt2-tiny", "gpt2-tiny", _GPT2, {}), ("bert-tiny", "bert-tiny", {"batch": 8, "seq": 64}, {}),
    ("vit-tiny", "vit-tiny", {"batch": 16}, {}), ("llama-tiny", "llama-tiny", {"batch": 8, "seq": 64}, {}),
    ("gpt2-tiny accumulation ×2", "gpt2-tiny", {"seq": 64}, {"global_batch_size": 16, "accumulation_steps": 2}),
    ("gpt2-tiny full recompute", "gpt2-tiny", _GPT2, {"recompute": "full"}),
    ("gpt2-tiny ZeRO-2", "gpt2-tiny", _GPT2, {"mode": "data-parallel", "zero_stage": 2}),
    ("gpt2-tiny eager attention", "gpt2-tiny", _GPT2, {"attention": "eager"}),
    ("gpt2-tiny 2 stages", "gpt2-tiny", {"seq": 64}, {"mesh_shape": None, "layout": "pp=2", "global_batch_size": 16,
                                                "micro_batch_size": 4}),
]


def bench_fidelity(rounds: int, profile: str | None = None, plans: list[str] | None = None) -> None:
    """Predicted vs measured: every plan of FIDELITY_PLANS (the small zoo models planned by the ILP for
    2 ranks, GPT-2 with accumulation, recomputation, ZeRO-2, eager attention, 2 pipeline stages) on a
    profile calibrated on this machine and run by the executor (gloo); |predicted − measured| / measured for step time
    and memory. This machine's speed drifts over hours (a shared VM: the same matmul takes 212 µs in
    one hour and 270 µs in another), so by default the profile is calibrated first, here and now;
    `--profile cpu` starts from the stored preset instead; `--plan LABEL` (repeatable) runs only the plans
    whose label starts with LABEL. Each plan runs `rounds` times (about 3 s
    of timed steps each, rounds interleaved across models, each run planned on compute re-measured just
    before it); the median round (by error) is reported."""
    from executor.calibrate import calibrate
    from executor.launch import run
    from executor.preflight import RunOptions
    from hwprofiles.calibrate import CalibrationConfig
    from hwprofiles.files import load_profile, save_profile
    from planner.search.baselines import data_parallel_strategy
    from planner.search.plan import make_plan
    from planner.search.request import PlanRequest

    if profile is None:
        console.print("calibrating this machine first (about 90 s) ...")
        fresh, report = calibrate(CalibrationConfig(nproc=2, name="cpu"), plan_data_parallel=data_parallel_strategy)
        profile = "/tmp/meshplan-fidelity-profile.json"
        save_profile(fresh, profile)
        stored, d = load_profile("cpu").device, fresh.device
        console.print(f"calibrated in {report.elapsed_s:.0f} s: matmul peak {d.peak_for('fp32') / 1e9:.1f} GFLOP/s "
                      f"(stored cpu preset {stored.peak_for('fp32') / 1e9:.1f}), copy {d.mem_bandwidth_bytes_per_s / 1e9:.1f} GB/s "
                      f"({stored.mem_bandwidth_bytes_per_s / 1e9:.1f}), element-wise {d.elementwise_bytes_per_s / 1e9:.1f} GB/s "
                      f"({stored.elementwise_bytes_per_s / 1e9:.1f}), executor per-op overhead {d.graph_op_s * 1e6:.2f} µs "
                      f"({stored.graph_op_s * 1e6:.2f})")

    table = Table(title=f"fidelity: cost model (links from {profile}, compute re-measured before each run) vs executor on "
                        f"2 gloo ranks, median of {rounds} rounds")
    for col in ("plan", "mesh", "predicted ms", "measured ms", "rounds min–max", "time error", "predicted MiB",
                "measured MiB",
                "memory error", "collectives (planned = executed)", "probe during/before"):
        table.add_column(col, justify="right" if col != "plan" else "left")
    phases = Table(title="where the time goes (ms, median round): measured phases of the slowest rank vs predicted terms")
    for col in ("plan", "measured", "predicted"):
        phases.add_column(col)
    # Rounds over all plans; each planned on compute figures measured just before its run (the links
    # stay those of the full calibration): prediction and measurement see the same machine.
    chosen = [p for p in FIDELITY_PLANS if not plans or any(p[0].startswith(x) for x in plans)]
    if not chosen:
        raise SystemExit(f"--plan {plans}: no fidelity plan is labelled so; the labels: "
                         f"{', '.join(p[0] for p in FIDELITY_PLANS)}")
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in chosen}
    for _ in range(rounds):
        for label, name, dims, levers in chosen:
            now, _ = calibrate(CalibrationConfig(nproc=2, name="cpu", base=profile, compute_only=True),
                                plan_data_parallel=data_parallel_strategy)
            save_profile(now, "/tmp/meshplan-fidelity-round.json")
            path = str(zoo.export(name))
            strategy, _ = make_plan(PlanRequest(model=path, dims=dims, profile="/tmp/meshplan-fidelity-round.json",
                                                devices=2, **({"mesh_shape": (2,)} | levers)))  # type: ignore[arg-type]
            out = f"/tmp/meshplan-fidelity-{label.replace(' ', '-')}.json"
            strategy.save(out)
            # About 3 s of timed steps: this VM's cores switch speed every few seconds, and a short run
            # would catch one speed at random.
            steps = min(1500, max(30, math.ceil(3.0 / strategy.step_time_s)))
            runs[label].append(run(out, path, nproc=2, opts=RunOptions(steps=steps, warmup=5, probe=True)))
    t_err, m_err = [], []
    for label, rs in runs.items():
        for x in rs:
            x["time_error"] = abs(x["predicted_step_s"] - x["measured_step_s"]) / x["measured_step_s"]
        r = sorted(rs, key=lambda x: x["time_error"])[len(rs) // 2]  # the median round
        me = abs(r["predicted_memory_bytes"] - r["measured_memory_bytes"]) / max(r["measured_memory_bytes"], 1)
        t_err.append(r["time_error"])
        m_err.append(me)
        steps = [x["measured_step_s"] * 1e3 for x in rs]
        table.add_row(label, "2", f"{r['predicted_step_s'] * 1e3:.2f}", f"{r['measured_step_s'] * 1e3:.2f}",
                      f"{min(steps):.1f}–{max(steps):.1f}", f"{r['time_error']:.0%}",
                      f"{r['predicted_memory_bytes'] / 2**20:.1f}", f"{r['measured_memory_bytes'] / 2**20:.1f}", f"{me:.0%}",
                      "yes" if all(x["collectives_planned"] == x["collectives_executed"] for x in rs) else
                      f"no: {r['collectives_planned']} vs {r['collectives_executed']}", _probe_ratios(r))
        phases.add_row(label, ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.2f}" for k, v in r["measured_phases_s"].items()),
                       ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.2f}" for k, v in r["predicted_phases_s"].items() if v))
    console.print(table)
    console.print(phases)
    console.print(f"median time error {statistics.median(t_err):.0%}, median memory error {statistics.median(m_err):.0%} "
                  "(memory measured as model-state tensors + the storages autograd saved for backward)")


def _probe_ratios(r: dict[str, Any]) -> str:
    """The speed probe's time during the steps over before them (`RunOptions.probe`), the slowest
    rank's, per part: how much slower the machine ran while timed than the moment before."""
    by_rank = r.get("speed_probe_s_by_rank")
    if not by_rank:
        return "—"  # (a pipelined run: not probed)
    parts = by_rank[0]["before"]
    return ", ".join(f"{k} {max(p['during'][k] / p['before'][k] for p in by_rank):.2f}" for k in parts)


def bench_pipeline(repeat: int) -> None:
    """The planner's search with pipeline stages in it (stages, sub-meshes, the per-stage ILP with
    recomputation and ZeRO, micro-steps), end to end, on clusters where published runs pipelined and
    one where nothing should; and Megatron-LM's hand layouts (SC'21 Table 1) priced next to the
    planner's own choice for the same cluster and batch."""
    table = Table(title=f"meshplan plan with pipelines in the search, median of {repeat} end-to-end runs")
    for col in ("model", "cluster", "tokens per step", "wall s (median)", "min–max", "plan", "micro-steps",
                "recompute", "step s", "memory GiB", "gap"):
        table.add_column(col, justify="left" if col in ("model", "cluster", "plan", "recompute") else "right")
    # (model, profile, devices, seq, global batch, dtype, Megatron's layout and micro-batch per rank or None)
    cases: tuple[tuple[str, str, int, int, int, str, tuple[str, int] | None], ...] = (
        ("llama3-70b", "h100-sxm", 512, 8192, 1024, "bf16", None),
        ("gpt3-175b", "a100-sxm", 512, 2048, 1536, "fp16", None),
        ("gpt-1.3b", "a100-sxm", 8, 2048, 512, "fp16", None),
        ("gpt-145b", "a100-sxm", 1536, 2048, 2304, "fp16", ("tp=8,pp=8,dp_replicate=24,vpp=2", 2)),
        ("gpt-145b", "a100-sxm", 1536, 2048, 2304, "fp16", None),
        ("gpt-1t", "a100-sxm", 3072, 2048, 3072, "fp16", ("tp=8,pp=64,dp_replicate=6", 1)),
        ("gpt-1t", "a100-sxm", 3072, 2048, 3072, "fp16", None))
    for name, profile, devices, seq, batch, dtype, held in cases:
        path = str(zoo.export(name))
        extra = ["--dtype", dtype, "--global-batch-size", str(batch)]
        if held is not None:  # as Megatron-LM ran it: every layer recomputed
            extra += ["--layout", held[0], "--micro-batch-size", str(held[1]), "--recompute", "full"]
        args = ["--devices", str(devices), "--profile", profile, "--dim", f"seq={seq}", *extra]
        runs = [_timed_plan(path, f"/tmp/meshplan-bench-{name}.json", args) for _ in range(repeat)]
        walls = [w for w, _ in runs]
        s = runs[-1][1]
        tr, cost, sv = s["training"], s["cost"], s["solver"]
        pipe = s.get("pipeline") if (s.get("pipeline") or {}).get("stages") else None
        mesh = " × ".join(f"{a}={n}" for a, n in zip(s["mesh"]["axis_names"], s["mesh"]["shape"], strict=True))
        shape = f"pp={len(pipe['stages'])}" + (f", vpp={pipe.get('virtual_stages', 1)}" if pipe.get("virtual_stages", 1) > 1 else "") \
            + f" × ({mesh})" if pipe else mesh
        table.add_row(name + (" (Megatron's layout)" if held else ""), f"{devices} {profile}", f"{batch}×{seq}",
                      f"{statistics.median(walls):.1f}", f"{min(walls):.1f}–{max(walls):.1f}", shape,
                      str(tr["micro_batches"]), _recompute(tr), f"{cost['step_time_s']:.2f}",
                      f"{cost['memory_bytes_per_device'] / 2**30:.1f}", f"{sv['gap']:.2%}")
    console.print(table)


def bench_published_runs(repeat: int) -> None:
    """The cost model against the published runs of bench/published_runs.toml (see bench/published.py)."""
    from bench.published import bench_published

    bench_published(console)


def bench_collectives(repeat: int) -> None:
    """A gloo collective back to back (as calibrate times it) and after compute (as a step runs it)."""
    from bench.collective_wait import bench_collective_wait

    bench_collective_wait(console, max(1, min(repeat, 3)))


def bench_gpu(repeat: int) -> None:
    """One H100's training steps (bench/gpu/h100/steps.json) against plans priced on a profile fitted
    from its microbenchmarks (bench/gpu_steps.py)."""
    from bench.gpu_steps import bench_gpu_steps

    bench_gpu_steps(console)


def bench_gqa(repeat: int) -> None:
    """GQA under tensor parallelism: k and v by KV head against row-parallel, predicted and measured on 4
    gloo ranks (bench/gqa.py)."""
    from bench.gqa import bench_gqa as gqa

    gqa(console, rounds=repeat)


BENCHMARKS: dict[str, Callable[[int], None]] = {"collectives": bench_collectives, "fidelity": bench_fidelity,
                                                "import": bench_import, "plan": bench_plan, "layers": bench_layers,
                                                "pipeline": bench_pipeline, "published": bench_published_runs,
                                                "gpu": bench_gpu, "gqa": bench_gqa}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.run")
    ap.add_argument("--only", choices=list(BENCHMARKS), action="append")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", help="fidelity: a profile name or JSON (default: calibrate this machine first)")
    ap.add_argument("--plan", action="append", help="fidelity: only the plans whose label starts with this")
    args = ap.parse_args()
    for name in args.only or list(BENCHMARKS):
        if name == "fidelity":
            bench_fidelity(args.repeat, args.profile, args.plan)
        else:
            BENCHMARKS[name](args.repeat)


if __name__ == "__main__":
    main()
