"""What `profile calibrate` measured (`CalibrationReport`), the profile fitted from it, its plots and
its JSON report.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.collectives import Collective, LinkLevel, alpha_beta_time_s
from hwprofiles.calibrate import CalibrationConfig, CalibrationError
from hwprofiles.files import load_profile
from hwprofiles.fit import AlphaBetaFit, EfficiencyFit, fit_efficiency
from hwprofiles.profile import HardwareProfile, profile_from_json, profile_to_json
from hwprofiles.sweeps import CONV_CHANNELS, ELEMENTWISE_ALIASES, NARROW_DIMS, conv_flops, narrow_flops
from hwprofiles.timing import Measurement


@dataclass(kw_only=True, slots=True)
class CalibrationReport:
    matmul: list[Measurement] = field(default_factory=list)
    efficiency: EfficiencyFit | None = None
    copy_bandwidth_bytes_per_s: float = 0.0
    op_overhead_s: float = 0.0  # the executor's per-op time: the profile's graph_op_overhead_s (gloo)
    elementwise_bandwidth_bytes_per_s: float = 0.0
    elementwise_by_op: dict[str, float] = field(default_factory=dict)  # ONNX op type → B/s
    elementwise_backward_by_op: dict[str, float] = field(default_factory=dict)  # its backward: forward B/s
    bare_op_s: float = 0.0  # a one-element torch op: the profile's kernel_launch_s
    conv: list[Measurement] = field(default_factory=list)  # size = channels
    conv_efficiency: EfficiencyFit | None = None  # achieved(d) = P·d/(d + d½), d = channels
    narrow: list[Measurement] = field(default_factory=list)  # size = a GEMM's narrow dim (k and n, interleaved)
    narrow_efficiency: EfficiencyFit | None = None  # achieved(d) = P·d/(d + d½), d = the narrow dim
    reshard_overhead_s: float = 0.0  # DTensor's redistribute beyond its collective (0: not measured)
    step_overhead_s: float = 0.0  # the executor's cost per training step beyond its ops
    rank_skew: float = 0.0  # the slowest rank's excess time over the mean for the same work
    collective_wait_s: float = 0.0  # a collective after compute beyond back to back and the skew, per call
    optimizer_fixed_s: float = 0.0  # AdamW's step: per step, per tensor, per parameter
    optimizer_tensor_s: float = 0.0
    optimizer_param_s: float = 0.0
    collectives: dict[str, list[Measurement]] = field(default_factory=dict)
    fits: dict[str, AlphaBetaFit] = field(default_factory=dict)
    elapsed_s: float = 0.0


def fill_compute(cfg: CalibrationConfig, report: CalibrationReport, medians: dict[str, float]) -> None:
    sizes = sorted(int(k.split()[1]) for k in medians if k.startswith("matmul "))  # a GPU's: as far as it saturates
    report.matmul = [Measurement(kind="matmul", size=2.0 * n**3, times_s=[medians[f"matmul {n}"]]) for n in sizes]
    report.efficiency = fit_efficiency([m.size for m in report.matmul], [m.size / m.median_s for m in report.matmul])
    report.copy_bandwidth_bytes_per_s = 1.0 / medians["copy per byte"]
    report.bare_op_s, report.op_overhead_s = medians["bare op"], medians["graph op"]
    report.step_overhead_s = medians["step overhead"]
    report.rank_skew = medians.get("rank skew", 0.0)
    report.collective_wait_s = medians.get("collective wait", 0.0)
    report.optimizer_fixed_s = medians["optimizer fixed"]
    report.optimizer_tensor_s = medians["optimizer per tensor"]
    report.optimizer_param_s = medians["optimizer per parameter"]
    report.elementwise_bandwidth_bytes_per_s = 1.0 / medians["element-wise per byte"]
    prefix, suffix = "element-wise ", " per byte"
    measured = {k[len(prefix):-len(suffix)]: 1.0 / v for k, v in medians.items()
                if k.startswith(prefix) and k.endswith(suffix) and k != "element-wise per byte"}
    report.elementwise_by_op = {**measured, **{op: measured[k] for op, k in ELEMENTWISE_ALIASES.items() if k in measured}}
    backward = {k.removeprefix("backward ").removesuffix(suffix): 1.0 / v for k, v in medians.items()
                if k.startswith("backward ") and k.endswith(suffix) and v > 0}  # 0: lost in the noise
    report.elementwise_backward_by_op = {**backward, **{op: backward[k] for op, k in ELEMENTWISE_ALIASES.items()
                                                        if k in backward}}
    report.conv = [Measurement(kind="conv", size=float(c), times_s=[medians[f"conv {c}"]]) for c in CONV_CHANNELS]
    report.reshard_overhead_s = medians["reshard"]
    report.narrow = [Measurement(kind="matmul", size=float(d), times_s=[medians[f"narrow {side} {d}"]])
                     for d in NARROW_DIMS for side in ("k", "n") if f"narrow {side} {d}" in medians]
    if report.narrow:
        report.narrow_efficiency = fit_efficiency([m.size for m in report.narrow],
                                                  [narrow_flops(int(m.size)) / m.median_s for m in report.narrow])
    report.conv_efficiency = fit_efficiency([m.size for m in report.conv],
                                            [conv_flops(int(m.size)) / m.median_s for m in report.conv])


def _host() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores)"


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8.0 * (1 << 30)


def build_profile(cfg: CalibrationConfig, report: CalibrationReport) -> HardwareProfile:
    """A profile from the measurements. With `base`, the base's datasheet values stay where nothing
    was measured (peak FLOP/s, capacity, the network between nodes); without, this machine is the
    node and its loopback the only link."""
    import torch

    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    host = _host()
    tag = f"calibrated {now} on {host}, torch {torch.__version__}, {cfg.backend}, {cfg.nproc} ranks"
    assert report.efficiency is not None
    eff = report.efficiency

    def q(value: float, unit: str, what: str) -> dict[str, Any]:
        return {"value": value, "unit": unit, "source": f"{tag}: {what}"}

    link: dict[str, Any] | None = None
    if report.fits:
        p2p = report.fits[Collective.SEND_RECV.value]
        link = {"name": f"{cfg.backend} over loopback" if cfg.backend == "gloo" else "intra-node, measured",
                "bandwidth_bytes_per_s": q(p2p.bus_bandwidth_bytes_per_s, "B/s", "send/recv α-β fit"),
                "latency_s": q(p2p.alpha_s, "s", "send/recv α-β fit")}

    if cfg.base:
        data = profile_to_json(load_profile(cfg.base))
        data["name"] = cfg.name or f"{cfg.base}-calibrated"
        data["origin"] = {"kind": "calibrated", "date": now, "host": host, "base": cfg.base}
        dtype = "fp32" if cfg.backend == "gloo" else "bf16"
        peak = data["device"]["peak_flops_per_s"][dtype]["value"]
        if eff.peak_achieved_flops_per_s > peak:  # the base was measured slower (or its datasheet is wrong)
            peak = eff.peak_achieved_flops_per_s
            data["device"]["peak_flops_per_s"][dtype] = q(peak, "FLOP/s", "asymptote of the fitted matmul curve, "
                                                                           "above the base's")
        if link is not None:
            data["node"]["link"] = link
    else:
        if link is None:
            raise CalibrationError("`nproc` 1 measures no link; calibrate with `nproc` 2 or more, or pass `base`")
        peak = eff.peak_achieved_flops_per_s
        assumed = "assumed: one machine, no inter-node link measured; equal to the loopback link"
        data = {
            "schema_version": 1,
            "name": cfg.name or "calibrated",
            "description": f"{host}: one rank = one process on one core, links = {cfg.backend} over loopback",
            "origin": {"kind": "calibrated", "date": now, "host": host},
            "device": {
                "name": f"CPU core ({host})",
                "peak_flops_per_s": {"fp32": q(peak, "FLOP/s", "asymptote of the fitted matmul curve")},
                "mem_capacity_bytes": q(_memory_bytes() / cfg.nproc, "B", "physical memory / ranks"),
            },
            "node": {"devices_per_node": q(os.cpu_count() or 1, "1", "cores on this machine"), "link": link},
            "network": {"name": "none (single machine)",
                        "bandwidth_bytes_per_s": {**link["bandwidth_bytes_per_s"], "source": assumed},
                        "latency_s": {**link["latency_s"], "source": assumed}},
        }
    dev = data["device"]
    dev["mem_bandwidth_bytes_per_s"] = q(report.copy_bandwidth_bytes_per_s, "B/s", "buffer copy, read + write")
    dev["elementwise_bandwidth_bytes_per_s"] = q(report.elementwise_bandwidth_bytes_per_s, "B/s",
                                                 "element-wise kernel mix (add, mul, where, tanh, erf, exp, pow, "
                                                 "softmax) on 64k floats, bytes in + out per second")
    if report.elementwise_by_op:
        dev["elementwise_by_op"] = {
            op: q(v, "B/s", f"torch's {ELEMENTWISE_ALIASES.get(op, op)} kernel on 64k floats (each call the next of "
                  f"128 inputs, past the caches), bytes in + out per second")
            for op, v in sorted(report.elementwise_by_op.items())}
    if report.elementwise_backward_by_op:
        dev["elementwise_backward_by_op"] = {
            op: q(v, "B/s", f"torch's backward of {ELEMENTWISE_ALIASES.get(op, op)} through autograd, every float input "
                  f"needing a gradient, at 64k floats less at 4k (autograd's per-call cost out), per byte its "
                  f"forward moves")
            for op, v in sorted(report.elementwise_backward_by_op.items())}
    dev["kernel_launch_s"] = q(report.bare_op_s, "s", "median time of a one-element op")
    if report.reshard_overhead_s > 0:
        dev["reshard_overhead_s"] = q(report.reshard_overhead_s, "s", "DTensor partial → replicated redistribute of "
                                      "4 KiB minus the same all-reduce through c10d, medians")
    if cfg.backend == "gloo":
        how = ("tiny transformer blocks trained by the meshplan executor (data-parallel over the ranks), forward + "
               "backward of 4 blocks and of one matmul")
        dev["graph_op_overhead_s"] = q(report.op_overhead_s, "s", f"{how}: their difference per op launch (3 per op)")
        dev["step_overhead_s"] = q(report.step_overhead_s, "s", f"{how}: the matmul's step beyond its launches")
        dev["rank_skew"] = q(report.rank_skew, "1", "the ranks run the same ~2 ms of matmuls and meet in an "
                             "all-reduce, for 3 s: Σ slowest rank's time / Σ mean − 1")
        dev["collective_wait_s"] = q(report.collective_wait_s, "s", "the same segments' all-reduce (after the "
                                     "matmuls) against the one right after it (back to back), mean per rank and call, "
                                     "less the skew's wait")
        in_step = ("torch AdamW (one tensor at a time) in the training step of 4 tiny transformer blocks and "
                   "of one matmul")
        dev["optimizer_step"] = {
            "fixed_s": q(report.optimizer_fixed_s, "s", f"{in_step}: the matmul's beyond one tensor"),
            "tensor_s": q(report.optimizer_tensor_s, "s", f"{in_step}: their difference per tensor"),
            "param_s": q(report.optimizer_param_s, "s", "torch AdamW (one tensor at a time): 8 tensors of 128 Ki "
                         "floats against 8 of 256, per parameter")}
    dev["matmul_efficiency"] = {
        "max_fraction": q(min(1.0, eff.peak_achieved_flops_per_s / peak), "1", "matmul sweep fit"),
        "half_flops": q(eff.half_flops, "FLOP", "matmul sweep fit"),
    }
    if report.narrow_efficiency is not None:
        ne = report.narrow_efficiency
        what = "matmul sweep with one narrow dim (768×d·d×768 and 768×768·768×d, d = 8–256) fit, by that dim"
        dev["matmul_narrow_efficiency"] = {"max_fraction": q(ne.peak_achieved_flops_per_s / peak, "1", what),
                                           "half_channels": q(ne.half_flops, "1", what)}
    if report.conv_efficiency is not None:
        ce = report.conv_efficiency
        what = "3×3 convolution sweep (batch 8, 32×32, 8–128 channels) fit, by channels"
        dev["conv_efficiency"] = {"max_fraction": q(ce.peak_achieved_flops_per_s / peak, "1", what),
                                  "half_channels": q(ce.half_flops, "1", what)}
    colls = data.setdefault("collectives", {}).setdefault(LinkLevel.INTRA_NODE.value, {})
    for kind_name, fit in report.fits.items():
        colls[kind_name] = {
            "alpha_s": q(fit.alpha_s, "s", "α-β fit of mean times"),
            "bus_bandwidth_bytes_per_s": q(fit.bus_bandwidth_bytes_per_s, "B/s", "α-β fit of mean times"),
            "table": [{"ranks": cfg.nproc, "bytes": m.size, "seconds": m.mean_s} for m in report.collectives[kind_name]],
        }
    return profile_from_json(data, origin_hint="calibrated profile")


def plot_report(report: CalibrationReport, profile: HardwareProfile, path: Path) -> None:
    """Measurements (points, with the spread as error bars) against the fitted models (lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    kinds = list(report.collectives)
    fig, axes = plt.subplots(2, 4, figsize=(16, 7.5))
    flat = axes.ravel()
    for ax, kind_name in zip(flat, kinds, strict=False):
        ms = report.collectives[kind_name]
        sizes = np.array([m.size for m in ms])
        med = np.array([m.mean_s for m in ms])
        err = np.array([m.spread * m.median_s / 2 for m in ms])
        model = profile.collectives[(LinkLevel.INTRA_NODE, Collective(kind_name))]
        xs = np.geomspace(sizes.min(), sizes.max(), 100)
        n = next(iter(p.ranks for p in model.table), 2)
        fit = [alpha_beta_time_s(Collective(kind_name), x, n, model.alpha_s, model.bus_bandwidth_bytes_per_s) for x in xs]
        ax.errorbar(sizes, med, yerr=err, fmt="o", label="measured (mean, IQR/2 bars)")
        ax.plot(xs, fit, "-", label=f"α-β fit ({report.fits[kind_name].median_rel_error:.0%} median error)")
        ax.set(xscale="log", yscale="log", title=f"{kind_name}, {n} ranks", xlabel="message bytes", ylabel="seconds")
        ax.legend(fontsize=7)
    ax = flat[len(kinds)]
    f = np.array([m.size for m in report.matmul])
    ach = np.array([m.size / m.median_s for m in report.matmul])
    assert report.efficiency is not None
    fs = np.geomspace(f.min(), f.max(), 100)
    e = report.efficiency
    ax.plot(f, ach / 1e9, "o", label="measured")
    ax.plot(fs, e.peak_achieved_flops_per_s * fs / (fs + e.half_flops) / 1e9, "-",
            label=f"P·F/(F+F½) ({e.median_rel_error:.0%} median error)")
    ax.set(xscale="log", title="matmul", xlabel="FLOPs per matmul", ylabel="achieved GFLOP/s")
    ax.legend(fontsize=7)
    for extra in flat[len(kinds) + 1:]:
        extra.axis("off")
    fig.suptitle(f"meshplan calibration — {profile.name}: {profile.origin.get('host', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def report_json(report: CalibrationReport) -> dict[str, Any]:
    return {
        "elapsed_s": report.elapsed_s,
        "matmul": [{"flops": m.size, "median_s": m.median_s, "spread": m.spread} for m in report.matmul],
        "efficiency_fit_median_rel_error": report.efficiency.median_rel_error if report.efficiency else None,
        "copy_bandwidth_bytes_per_s": report.copy_bandwidth_bytes_per_s,
        "op_overhead_s": report.op_overhead_s,
        "bare_op_s": report.bare_op_s,
        "elementwise_bandwidth_bytes_per_s": report.elementwise_bandwidth_bytes_per_s,
        "elementwise_by_op": report.elementwise_by_op,
        "elementwise_backward_by_op": report.elementwise_backward_by_op,
        "conv": [{"channels": m.size, "median_s": m.median_s} for m in report.conv],
        "reshard_overhead_s": report.reshard_overhead_s,
        "step_overhead_s": report.step_overhead_s,
        "rank_skew": report.rank_skew,
        "collective_wait_s": report.collective_wait_s,
        "optimizer_step": {"fixed_s": report.optimizer_fixed_s, "tensor_s": report.optimizer_tensor_s,
                           "param_s": report.optimizer_param_s},
        "conv_efficiency_fit_median_rel_error": report.conv_efficiency.median_rel_error if report.conv_efficiency else None,
        "narrow": [{"dim": m.size, "median_s": m.median_s} for m in report.narrow],
        "narrow_efficiency_fit_median_rel_error": (report.narrow_efficiency.median_rel_error
                                                   if report.narrow_efficiency else None),
        "collectives": {
            k: {"alpha_s": report.fits[k].alpha_s, "bus_bandwidth_bytes_per_s": report.fits[k].bus_bandwidth_bytes_per_s,
                "median_rel_error": report.fits[k].median_rel_error,
                "points": [{"bytes": m.size, "mean_s": m.mean_s, "median_s": m.median_s, "spread": m.spread}
                           for m in ms]}
            for k, ms in report.collectives.items()
        },
    }


def dump_report(report: CalibrationReport, path: Path) -> None:
    path.write_text(json.dumps(report_json(report), indent=1) + "\n")
