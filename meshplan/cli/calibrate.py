"""`meshplan profile calibrate` when it measures: on CPUs (gloo: the sweeps of hwprofiles/sweeps.py and
the collectives, a profile, a plot and a report) and on GPUs (nccl: the device's kernels by
hwprofiles/gpu_sweeps.py, fitted as `--from` fits a file, the measurements written beside the profile).
torch is imported inside, on the machine that measures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshplan.cli.render import console, err_console, render_calibration, render_fits


def calibrate_cpu(*, nproc: int, backend: str, quick: bool, out_path: str, base: str | None, compute_only: bool,
                  name: str | None) -> None:
    """The machine's compute and links (gloo), fitted into a profile; a plot and a report beside it."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from executor.calibrate import calibrate
    from hwprofiles.calibrate import CalibrationConfig
    from hwprofiles.files import load_profile, save_profile
    from hwprofiles.report import dump_report, plot_report
    from planner.search.baselines import data_parallel_strategy

    cfg = CalibrationConfig(nproc=nproc, backend=backend, quick=quick, base=base, name=name, compute_only=compute_only)
    if base:
        load_profile(base)  # fail before measuring
    out = Path(out_path)
    with Progress(TextColumn("{task.description:<16}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err_console) as bar:
        tasks: dict[str, Any] = {}

        def progress(label: str, done: int, total: int) -> None:
            key = "collectives" if label != "compute" else label
            if key not in tasks:
                tasks[key] = bar.add_task(key, total=total)
            bar.update(tasks[key], completed=done, description=f"{key} {label if key == 'collectives' else ''}")

        prof, report = calibrate(cfg, progress, plan_data_parallel=data_parallel_strategy)
    save_profile(prof, out)
    if report.collectives:
        plot_report(report, prof, out.with_suffix(".png"))
    dump_report(report, out.with_suffix(".report.json"))

    render_calibration(report, nproc, backend)
    plot = f"{out.with_suffix('.png')}, " if report.collectives else ""
    console.print(f"wrote {out}, {plot}{out.with_suffix('.report.json')}")


def calibrate_gpu(*, nproc: int, backend: str, quick: bool, out_path: str, base: str | None, compute_only: bool,
                  name: str | None) -> None:
    """calibrate on GPUs: the device's microbenchmarks, sized from it (`hwprofiles/gpu_sweeps.py`), fitted
    as `--from` fits a file; with 2 or more ranks and not --compute-only, the links measured too."""
    import torch

    from hwprofiles.calibrate import CalibrationConfig, CalibrationError
    from hwprofiles.files import load_profile
    from hwprofiles.gpu_sweeps import CudaTimer, measure
    from hwprofiles.measured import BASES, calibrate_measured
    from hwprofiles.profile import profile_to_json

    cfg = CalibrationConfig(nproc=nproc, backend="nccl", quick=quick, base=base, name=name, compute_only=compute_only)
    if not torch.cuda.is_available():
        raise CalibrationError("--backend nccl needs CUDA, and torch sees no GPU here; calibrate with --backend gloo")
    if torch.cuda.device_count() < nproc and not compute_only:
        raise CalibrationError(f"--nproc {nproc} needs {nproc} GPUs and torch sees {torch.cuda.device_count()}; "
                               "pass --nproc up to that, or --compute-only with --base for the links")
    if base is None:  # the preset the device's name implies, before minutes of measuring
        device_name = torch.cuda.get_device_name(torch.cuda.current_device())
        base = next((b for key, b in BASES.items() if key in device_name), None)
        if base is None:
            raise CalibrationError(f"{device_name} has no preset to start from; pass --base (a preset or a profile "
                                   "JSON with the device's datasheet peaks)")
    load_profile(base)  # fail before measuring
    links = None
    if nproc >= 2 and not compute_only:
        from executor.calibrate import calibrate
        from planner.search.baselines import data_parallel_strategy

        links = profile_to_json(calibrate(cfg, plan_data_parallel=data_parallel_strategy)[0])
    device = torch.device("cuda", torch.cuda.current_device())
    data = measure(CudaTimer(device), quick=quick, progress=lambda what: err_console.print(f"measured {what}"))
    out = Path(out_path)
    render_fits(calibrate_measured(data, out, base=base, name=name, links=links), "this GPU's measurements")
    console.print(f"wrote {out} and its measurements, {out.with_suffix('.micro.json')}")
