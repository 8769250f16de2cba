"""One H100's whole training steps (bench/gpu/h100/steps.json) against meshplan's predictions from a
profile fitted to the same GPU's microbenchmarks alone (`calibrate --from bench/gpu/h100/micro.json`):
nothing here is fitted to the steps.

    python -m bench.run --only gpu

Each of the four transformers configs (bench/gpu/configs) is exported shape-only (cached in the zoo
directory) and planned on one device at the precision and runtime the row was measured in:

| steps.json | meshplan |
|---|---|
| `amp` (fp32 weights, torch.autocast bf16, fused AdamW, SDPA) | `--dtype amp` |
| `amp+compile` (the same under torch.compile) | `--dtype amp --runtime compiled` |
| `fsdp2-bf16` (fully_shard, MixedPrecisionPolicy(bf16, fp32), 1 device) | `--dtype mixed` |
| `fp32` (TF32 off) | `--dtype fp32` |
"""

from __future__ import annotations

import fcntl
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

GPU = Path(__file__).parent / "gpu"
# steps.json precision → the plan's dtype and runtime.
PRECISIONS: dict[str, tuple[str, str]] = {"amp": ("amp", "eager"), "amp+compile": ("amp", "compiled"),
                                          "fsdp2-bf16": ("mixed", "eager"), "fp32": ("fp32", "eager")}


def fitted_profile(out_dir: Path) -> Path:
    """The profile `calibrate --from bench/gpu/h100/micro.json` writes, in `out_dir`."""
    from hwprofiles.measured import fit_measurements, load_measurements

    fitted, _ = fit_measurements(load_measurements(GPU / "h100" / "micro.json"), origin="bench/gpu/h100/micro.json",
                                 name="h100-measured")
    path = out_dir / "h100-measured.json"
    path.write_text(json.dumps(fitted, indent=1))
    return path


def exported(name: str) -> Path:
    """bench/gpu/configs/<name>.json exported shape-only into the zoo directory (once)."""
    from bench.zoo import DEFAULT_DIR
    from planner.export import export_hf_config

    path = DEFAULT_DIR / f"gpu-{name}.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:  # one exporter at a time (parallel test workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            partial = path.with_suffix(".partial.onnx")
            export_hf_config(str(GPU / "configs" / f"{name}.json"), str(partial), dims={"batch": None, "seq": None})
            partial.replace(path)
    return path


def predictions(profile: str | None = None) -> list[dict[str, Any]]:
    """Every measured row of steps.json with meshplan's prediction beside it (None where not priced), on
    `profile` (default: the one fitted from micro.json)."""
    from planner.search.plan import make_plan
    from planner.search.request import PlanRequest

    runs = json.loads((GPU / "h100" / "steps.json").read_text())["runs"]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        profile = profile or str(fitted_profile(Path(tmp)))
        for r in runs:
            if "step_s" not in r:  # out of memory on the H100
                continue
            row = {**r, "predicted_step_s": None, "predicted_bytes": None}
            if r["precision"] in PRECISIONS:
                dtype, runtime = PRECISIONS[r["precision"]]
                s, _ = make_plan(PlanRequest(model=str(exported(r["model"])), dims={"batch": r["batch"], "seq": r["seq"]},
                                             profile=str(profile), devices=1, dtype=dtype, runtime=runtime))
                row.update(predicted_step_s=s.step_time_s, predicted_bytes=s.cost.memory_bytes_per_device)
            out.append(row)
    return out


OFFLOAD = GPU / "h100" / "session-2026-11-26-2330" / "offload.json"


def offload_predictions(profile: str = "h100-sxm-calibrated") -> list[dict[str, Any]]:
    """The whole steps of bench/gpu/measure_offload.py (a 0.85B Llama, 4 × 2048, fully_shard per block on
    one H100 with MixedPrecisionPolicy(bf16, fp32), fused AdamW; with and without CPUOffloadPolicy) beside
    meshplan's plans of the same: `--dtype mixed`, every parameter's states on the host or none."""
    from planner.search.plan import make_plan
    from planner.search.request import PlanRequest

    out = []
    for r in json.loads(OFFLOAD.read_text())["steps"]:
        s, _ = make_plan(PlanRequest(model=str(exported("llama-0.85b")), dims={"batch": r["batch"], "seq": r["seq"]},
                                     profile=profile, devices=1, dtype="mixed", recompute="none",
                                     offload="params,optimizer" if r["offload"] else "none"))
        out.append({**r, "predicted_step_s": s.step_time_s, "predicted_optimizer_s": s.cost.optimizer_s,
                    "predicted_host_s": s.cost.host_s, "predicted_bytes": s.cost.memory_bytes_per_device})
    return out


def bench_gpu_steps(console: Console) -> None:
    """The steps on the profile fitted from micro.json, then on `h100-sxm-calibrated` (calibrate run on
    an H100 on 2026-11-26: the same kind of GPU, another machine and day)."""
    for profile, title in ((None, "profile fitted from micro.json alone"),
                           ("h100-sxm-calibrated", "preset h100-sxm-calibrated: calibrate on an H100, 2026-11-26")):
        _table(console, predictions(profile), title)
    table = Table(title="one H100: FSDP2 steps with and without CPUOffloadPolicy (offload.json) against meshplan "
                        "(h100-sxm-calibrated)")
    for col in ("offload", "step measured", "predicted", "error", "optimizer measured", "predicted",
                "host copies waited (predicted)", "peak memory measured", "predicted"):
        table.add_column(col, justify="right")
    for r in offload_predictions():
        table.add_row("params,optimizer" if r["offload"] else "none", f"{r['step_s'] * 1e3:.1f} ms",
                      f"{r['predicted_step_s'] * 1e3:.1f} ms", f"{r['predicted_step_s'] / r['step_s'] - 1:+.1%}",
                      f"{r['optimizer_s'] * 1e3:.1f} ms", f"{r['predicted_optimizer_s'] * 1e3:.1f} ms",
                      f"{r['predicted_host_s'] * 1e3:.1f} ms", f"{r['peak_bytes'] / 2**30:.1f} GiB",
                      f"{r['predicted_bytes'] / 2**30:.1f} GiB")
    console.print(table)


def _table(console: Console, rows: list[dict[str, Any]], title: str) -> None:
    table = Table(title=f"one H100: steps.json against meshplan ({title})")
    for col in ("model", "batch × seq", "precision", "step measured", "predicted", "error",
                "peak memory measured", "predicted", "error"):
        table.add_column(col, justify="left" if col in ("model", "precision") else "right")
    step_err, mem_err = [], []
    for r in rows:
        if r["predicted_step_s"] is None:
            table.add_row(r["model"], f"{r['batch']} × {r['seq']}", r["precision"], f"{r['step_s'] * 1e3:.1f} ms",
                          "not priced", "", f"{r['peak_bytes'] / 2**30:.1f} GiB", "", "")
            continue
        e_s = r["predicted_step_s"] / r["step_s"] - 1
        e_m = r["predicted_bytes"] / r["peak_bytes"] - 1
        step_err.append(abs(e_s))
        mem_err.append(abs(e_m))
        table.add_row(r["model"], f"{r['batch']} × {r['seq']}", r["precision"], f"{r['step_s'] * 1e3:.1f} ms",
                      f"{r['predicted_step_s'] * 1e3:.1f} ms", f"{e_s:+.1%}", f"{r['peak_bytes'] / 2**30:.1f} GiB",
                      f"{r['predicted_bytes'] / 2**30:.1f} GiB", f"{e_m:+.1%}")
    console.print(table)
    if step_err:
        console.print(f"{len(step_err)} rows priced: step time median |error| {statistics.median(step_err):.1%} "
                      f"(largest {max(step_err):.1%}); peak memory median |error| {statistics.median(mem_err):.1%} "
                      f"(largest {max(mem_err):.1%})")
