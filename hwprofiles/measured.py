"""A profile fitted from a measurement file instead of from sweeps run here: `meshplan profile
calibrate --from FILE`. The file is what a GPU's microbenchmarks write (the format of
shared/gpu/h100/micro.json, by its measure_micro.py): GEMMs by shape and dtype, element-wise ops by
type, size and dtype, a kernel launch, and optionally AdamW steps. This is how a profile is fitted
from someone else's measurements, and how the GPU fits are tested on a machine without one.

What is fitted (numpy only, relative errors, as `fit.py`):
- `kernel_launch_s`: the file's tiny kernel, wall time per call — every op's floor (`async_launch`:
  the host issues kernels ahead of the device, so an op costs the longer of its kernel and its
  launch);
- the GEMM curve: t = launch + F/P · max((F + F½)/F, (d + d½)/d) over the GEMMs whose k and n are
  16-byte aligned, in the training dtype (bf16): P the achieved peak (the profile's
  `matmul_efficiency.max_fraction` = P / the base's datasheet peak, and the narrow curve's), F½ the
  FLOPs at half of it, d½ the narrowest dim at half of it (Levenberg–Marquardt on log times);
- `matmul_alignment`: for GEMMs whose k or n is aligned to only 2, 4 or 8 bytes, the median fraction
  of the aligned curve's rate they reach;
- element-wise rates by ONNX op type, forward (bytes in + out per second) and backward (forward bytes
  per second of backward), in the training dtype (`_fit_elementwise`);
- `mem_bandwidth_bytes_per_s`: the fastest element-wise rate, where below the base's (a matmul's
  operands stream at it);
- FlashAttention's forward and backward rates by sequence, head dim and causality (`_fit_attention`);
- `optimizer_step` from the fused AdamW rows (what fused=True runs): t = fixed + tensors·per tensor +
  params·per parameter, non-negative least squares.

Each fit's median and largest relative error over its points is reported (`FitLine`). A fit whose
median error exceeds `REFUSE_MEDIAN_ERROR` is refused: the base profile's value stays, and the line
says why."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from hwprofiles.calibrate import CalibrationError
from hwprofiles.files import load_profile
from hwprofiles.fit import levenberg_marquardt, nonnegative_lstsq
from hwprofiles.profile import profile_to_json

REFUSE_MEDIAN_ERROR = 0.15  # a fit predicting its own points worse than this is not written
TRAINING_DTYPE = "bf16"
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# The file's element-wise ops → the ONNX op types priced at their rates (the decomposed forms of
# GELU and SiLU are priced op by op: an Erf, a Sigmoid at the unary ops' rate).
ELEMENTWISE_OPS = {
    "add": ("Add", "Sub"), "mul": ("Mul", "Div", "Where"), "gelu_tanh": ("Gelu", "FastGelu"), "gelu_erf": ("Erf",),
    "silu": ("Sigmoid",), "exp": ("Exp", "Log", "Pow", "Sqrt", "Reciprocal", "Neg"), "tanh": ("Tanh",),
    "softmax": ("Softmax", "LogSoftmax"), "layer_norm": ("LayerNormalization",),
    "rms_norm_fused": ("RMSNormalization", "SimplifiedLayerNormalization"), "dropout": ("Dropout",),
    "cast_to_fp32": ("Cast",),
}
# The base a file's device name implies, where `base` is not given.
BASES = {"H100": "h100-sxm", "A100": "a100-sxm"}


class MeasurementError(CalibrationError):
    """A file that is not a measurement file, or one a profile cannot be fitted from."""


@dataclass(frozen=True, slots=True)
class FitLine:
    what: str
    model: str  # the fitted parameters, in words
    points: int
    median_error: float  # |model − measured| / measured over the points
    max_error: float
    accepted: bool
    note: str = ""


_REQUIRED = {"matmul": ("m", "n", "k", "dtype", "s"), "elementwise": ("op", "dtype", "numel", "fwd_s", "fwd_bwd_s")}


WHAT = "give a file written by measure_micro.py or calibrate on a GPU (the format of shared/gpu/h100/micro.json)"


def load_measurements(path: str | Path) -> dict[str, Any]:
    """The measurement file at `path`, checked for what the fits read."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MeasurementError(f"measurement file {path} does not exist; {WHAT}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MeasurementError(f"{path} is not JSON ({e}); {WHAT}") from None
    return check_measurements(data, path)


def check_measurements(data: Any, path: str | Path) -> dict[str, Any]:
    """`data` (a file's, or a sweep's just measured) checked for what the fits read."""
    what = WHAT
    if not isinstance(data, dict):
        raise MeasurementError(f"{path} is not a measurement file (a JSON object is expected); {what}")
    for key, fields in _REQUIRED.items():
        rows = data.get(key)
        if not isinstance(rows, list) or not rows:
            raise MeasurementError(f"{path} is not a measurement file (no `{key}` list); {what}")
        for i, row in enumerate(rows):
            missing = [f for f in fields if not isinstance(row, dict) or f not in row]
            if missing:
                raise MeasurementError(f"{path}: {key}[{i}] lacks {', '.join(missing)}; {what}")
            if any(isinstance(row[f], (int, float)) and row[f] <= 0 for f in fields if f not in ("op", "dtype")):
                raise MeasurementError(f"{path}: {key}[{i}] has a size or time that is not positive; {what}")
    launch = data.get("launch_s")
    if not isinstance(launch, (int, float)) or launch <= 0:
        raise MeasurementError(f"{path} is not a measurement file (no positive `launch_s`); {what}")
    return data


def calibrate_from(path: str | Path, out: str | Path, *, base: str | None = None,
                   name: str | None = None) -> list[FitLine]:
    """`calibrate --from`: the profile fitted from the measurement file at `path`, written to `out`
    (checked as any profile is read); its fits' lines."""
    from hwprofiles.files import save_profile
    from hwprofiles.profile import profile_from_json

    fitted, lines = fit_measurements(load_measurements(path), base=base, name=name, origin=str(path))
    save_profile(profile_from_json(fitted, origin_hint=str(path)), out)
    return lines


def calibrate_measured(data: Mapping[str, Any], out: str | Path, *, base: str | None = None, name: str | None = None,
                       links: Mapping[str, Any] | None = None) -> list[FitLine]:
    """`calibrate` on a GPU: the profile fitted from `data` (the device's own measurements,
    `gpu_sweeps.measure`), written to `out` with the file beside it (`out` with suffix .micro.json, its
    provenance); `links` (a profile's JSON) gives the node, network and collectives where they were
    measured too, else the base's stay."""
    from hwprofiles.files import save_profile
    from hwprofiles.profile import profile_from_json

    out = Path(out)
    micro = out.with_suffix(".micro.json")
    micro.write_text(json.dumps(data, indent=1))
    fitted, lines = fit_measurements(check_measurements(dict(data), micro), base=base, name=name, origin=micro.name)
    if links is not None:
        fitted.update({k: links[k] for k in ("node", "network", "collectives") if k in links})
    save_profile(profile_from_json(fitted, origin_hint=str(micro)), out)
    return lines


def fit_measurements(data: Mapping[str, Any], *, base: str | None = None, name: str | None = None,
                     origin: str = "measurements") -> tuple[dict[str, Any], list[FitLine]]:
    """A profile (JSON, the base's with every accepted fit replacing its value) and the fits' lines."""
    base = base or next((b for key, b in BASES.items() if key in str(data.get("device", ""))), None)
    if base is None:
        raise MeasurementError(f"{origin}: device {data.get('device')!r} has no preset to start from; pass `base` "
                               "(a preset or a profile JSON with the device's datasheet peaks)")
    profile = profile_to_json(load_profile(base))
    dev = profile["device"]
    if TRAINING_DTYPE not in dev["peak_flops_per_s"]:
        raise MeasurementError(f"{origin}: base {base} has no {TRAINING_DTYPE} peak; pass a GPU preset as `base`")
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    tag = (f"fitted {now} from {origin} ({data.get('device', 'device unnamed')}, torch {data.get('torch', '?')}, "
           f"{data.get('notes', 'times as measured')})")
    launch = float(data["launch_s"])
    lines: list[FitLine] = []

    def q(value: float, unit: str, what: str) -> dict[str, Any]:
        return {"value": value, "unit": unit, "source": f"{tag}: {what}"}

    dev["kernel_launch_s"] = q(launch, "s", "a tiny kernel's wall time per call")
    lines.append(FitLine("kernel launch", f"{launch * 1e6:.1f} µs", 1, 0.0, 0.0, True))
    dev.pop("graph_op_overhead_s", None)  # an op of the graph costs the kernel's launch on a GPU
    dev["async_launch"] = True  # which the host issues ahead of the device

    peak = float(dev["peak_flops_per_s"][TRAINING_DTYPE]["value"])
    others = {d: float(v["value"]) for d, v in dev["peak_flops_per_s"].items()
              if d != TRAINING_DTYPE and any(r["dtype"] == d for r in data["matmul"])}
    gemm = _fit_gemm(data["matmul"], launch, peak, others)
    lines += gemm.lines
    if gemm.accepted:
        dev["matmul_efficiency"] = {"max_fraction": q(gemm.fraction, "1", "GEMM curve fit: achieved peak / datasheet"),
                                    "half_flops": q(gemm.half_flops, "FLOP", "GEMM curve fit")}
        dev["matmul_narrow_efficiency"] = {
            "max_fraction": q(gemm.fraction, "1", "GEMM curve fit: achieved peak / datasheet"),
            "half_channels": q(gemm.half_dim, "1", "GEMM curve fit: the narrowest dim at half the rate")}
        dev.pop("matmul_efficiency_by_dtype", None)  # a base's own curves belong to its bf16 curve, not this one
        if gemm.by_dtype:
            dev["matmul_efficiency_by_dtype"] = {
                dtype: {"max_fraction": q(frac, "1", f"GEMM curve fit in {dtype}: achieved peak / datasheet"),
                        "half_flops": q(half, "FLOP", f"GEMM curve fit in {dtype}")}
                for dtype, (frac, half) in sorted(gemm.by_dtype.items())}
        if gemm.alignment:
            dev["matmul_alignment"] = {str(b): q(f, "1", f"GEMMs with k or n aligned to {b} bytes: median fraction "
                                                         "of the aligned curve's rate")
                                       for b, f in sorted(gemm.alignment.items())}
    fwd, bwd, ew_lines = _fit_elementwise(data["elementwise"], launch)
    lines += ew_lines
    if fwd:
        dev["elementwise_by_op"] = {op: q(r, "B/s", f"{src}: t = launch + bytes / rate")
                                    for op, (r, src) in sorted(fwd.items())}
        dev["elementwise_backward_by_op"] = {op: q(r, "B/s", f"{src} backward: forward bytes per second of backward")
                                             for op, (r, src) in sorted(bwd.items())}
        mix = float(np.median([r for r, _ in fwd.values()]))
        dev["elementwise_bandwidth_bytes_per_s"] = q(mix, "B/s", "median of the element-wise ops' fitted rates")
        best = max(r for r, _ in fwd.values())
        if best < float(dev["mem_bandwidth_bytes_per_s"]["value"]):  # the datasheet's stays where no op falls short
            dev["mem_bandwidth_bytes_per_s"] = q(best, "B/s", "the fastest element-wise op's fitted rate (bytes in + out)")
    if data.get("attention_sdpa"):
        floor = _backward_floor(data["elementwise"])
        for key, curve, line in _fit_attention(data["attention_sdpa"], launch, floor, peak):
            lines.append(line)
            if line.accepted:
                dev[key] = {k: q(v, unit, f"scaled_dot_product_attention fit ({line.what})")
                            for (k, v), unit in zip(curve.items(), ("FLOP/s", "1", "1", "1"), strict=True)}
    if data.get("adamw"):
        opt = _fit_adamw(data["adamw"])
        lines.append(opt.line)
        if opt.line.accepted:
            dev["optimizer_step"] = {k: q(v, "s", f"fused AdamW fit: {k}") for k, v in opt.terms.items()}
    profile["name"] = name or f"{base}-measured"
    profile["origin"] = {"kind": "calibrated", "date": now, "host": str(data.get("device", "")), "base": base}
    profile["description"] = f"{data.get('device', base)}: {tag}"
    return profile, lines


# ---------------------------------------------------------------------------------------------------
# GEMMs


@dataclass(frozen=True)
class _GemmFit:
    accepted: bool
    fraction: float
    half_flops: float
    half_dim: float
    alignment: dict[int, float]
    lines: list[FitLine]
    by_dtype: dict[str, tuple[float, float]] = field(default_factory=dict)  # dtype → (fraction, F½) of its own curve


def align_bytes(dim: int, element_bytes: int) -> int:
    """The largest power of two (at most 16) dividing `dim` elements' bytes."""
    b = dim * element_bytes
    return min(16, b & -b)


def _fit_gemm(rows: Sequence[Mapping[str, Any]], launch: float, peak: float,
              other_peaks: Mapping[str, float]) -> _GemmFit:
    eb = ELEMENT_BYTES[TRAINING_DTYPE]
    mine = [r for r in rows if r["dtype"] == TRAINING_DTYPE]
    aligned = [r for r in mine if min(align_bytes(r["k"], eb), align_bytes(r["n"], eb)) == 16]
    if len(aligned) < 4:
        line = FitLine(f"GEMM curve ({TRAINING_DTYPE})", "", len(aligned), 1.0, 1.0, False,
                       f"needs 4 or more {TRAINING_DTYPE} GEMMs with k and n multiples of 8; the base's curve kept")
        return _GemmFit(False, 0.0, 0.0, 0.0, {}, [line])
    flops = np.array([2.0 * r["m"] * r["n"] * r["k"] for r in aligned])
    narrow = np.array([float(min(r["m"], r["n"], r["k"])) for r in aligned])
    times = np.array([float(r["s"]) for r in aligned])

    def curve(x: np.ndarray, f: np.ndarray = flops, d: np.ndarray = narrow) -> np.ndarray:
        p, half, dhalf = np.exp(x)
        return launch + f / p * np.maximum((f + half) / f, (d + dhalf) / d)

    x = levenberg_marquardt(lambda v: np.log(curve(v)) - np.log(times),
                             [float(np.log(0.75 * peak)), float(np.log(1e9)), float(np.log(64.0))])
    p, half, dhalf = (float(v) for v in np.exp(x))
    err = np.abs(curve(x) / times - 1)
    fraction = min(p / peak, 1.0)
    ok = float(np.median(err)) <= REFUSE_MEDIAN_ERROR
    lines = [FitLine(f"GEMM curve ({TRAINING_DTYPE}, k and n 16-byte aligned)",
                     f"{p / 1e12:.0f} TFLOP/s ({fraction:.0%} of the datasheet's {peak / 1e12:.0f}), half at "
                     f"{half / 1e9:.2f} GFLOP or a narrowest dim of {dhalf:.0f}", len(aligned),
                     float(np.median(err)), float(np.max(err)), ok,
                     "" if ok else f"median error above {REFUSE_MEDIAN_ERROR:.0%}: the base's curve kept")]
    alignment: dict[int, float] = {}
    if ok:
        groups: dict[int, list[float]] = {}
        for r in mine:
            b = min(align_bytes(r["k"], eb), align_bytes(r["n"], eb))
            if b < 16:
                f = np.array([2.0 * r["m"] * r["n"] * r["k"]])
                d = np.array([float(min(r["m"], r["n"], r["k"]))])
                ideal = float(curve(x, f, d)[0]) - launch
                groups.setdefault(b, []).append(ideal / max(float(r["s"]) - launch, 1e-12))
        alignment = {b: min(1.0, float(np.median(v))) for b, v in groups.items()}
        if alignment:
            errs = [abs(alignment[b] / v - 1) for b, vs in groups.items() for v in vs]
            lines.append(FitLine("GEMM alignment (k or n not a multiple of 16 bytes)",
                                 ", ".join(f"{b}-byte aligned at {f:.2f}" for b, f in sorted(alignment.items())),
                                 len(errs), float(np.median(errs)), float(np.max(errs)), True))
    by_dtype: dict[str, tuple[float, float]] = {}
    for dtype, dtype_peak in sorted(other_peaks.items()):
        other = [r for r in rows if r["dtype"] == dtype and
                 min(align_bytes(r["k"], ELEMENT_BYTES.get(dtype, 4)), align_bytes(r["n"], ELEMENT_BYTES.get(dtype, 4))) == 16]
        if not ok or not other:
            continue
        f = np.array([2.0 * r["m"] * r["n"] * r["k"] for r in other])
        d = np.array([float(min(r["m"], r["n"], r["k"])) for r in other])
        t = np.array([float(r["s"]) for r in other])
        if len(other) < 4:  # the training dtype's curve at this dtype's datasheet peak: how far off it is
            e = np.abs((launch + (curve(x, f, d) - launch) * peak / dtype_peak) / t - 1)
            lines.append(FitLine(f"GEMMs in {dtype} (aligned)", f"not fitted (needs 4 or more): the {TRAINING_DTYPE} "
                                 f"curve at {dtype}'s datasheet peak", len(other), float(np.median(e)), float(np.max(e)), True))
            continue

        def own(v: np.ndarray, f: np.ndarray = f, d: np.ndarray = d) -> np.ndarray:  # its own P and F½, bf16's d½
            return launch + f / np.exp(v[0]) * np.maximum((f + np.exp(v[1])) / f, (d + dhalf) / d)

        def residuals(v: np.ndarray, t: np.ndarray = t, own: Callable[..., np.ndarray] = own) -> np.ndarray:
            return np.log(own(v)) - np.log(t)

        v = levenberg_marquardt(residuals, [float(np.log(0.75 * dtype_peak)), float(np.log(1e9))])
        e = np.abs(own(v) / t - 1)
        p_own, half_own = float(np.exp(v[0])), float(np.exp(v[1]))
        accepted = float(np.median(e)) <= REFUSE_MEDIAN_ERROR and p_own <= dtype_peak
        if accepted:
            by_dtype[dtype] = (p_own / dtype_peak, half_own)
        lines.append(FitLine(f"GEMM curve ({dtype}, aligned)", f"{p_own / 1e12:.1f} TFLOP/s ({p_own / dtype_peak:.0%} of "
                             f"the datasheet's {dtype_peak / 1e12:.1f}), half at {half_own / 1e9:.2f} GFLOP", len(other),
                             float(np.median(e)), float(np.max(e)), accepted,
                             "" if accepted else f"median error above {REFUSE_MEDIAN_ERROR:.0%} or above the datasheet: "
                                                 f"the {TRAINING_DTYPE} curve at {dtype}'s peak kept"))
    return _GemmFit(ok, fraction, half, dhalf, alignment, lines, by_dtype)


# ---------------------------------------------------------------------------------------------------
# Element-wise ops and the optimizer


def _rate(nbytes: np.ndarray, times: np.ndarray) -> float:
    """The rate r of t = bytes/r minimising Σ((bytes/r − t)/t)²."""
    w = nbytes / times
    return float(np.sum(w * w) / np.sum(w))


def _fit_elementwise(rows: Sequence[Mapping[str, Any]], launch: float
                     ) -> tuple[dict[str, tuple[float, str]], dict[str, tuple[float, str]], list[FitLine]]:
    """Forward: t = launch + bytes/rate, the rate from the sizes whose time is at least twice the launch,
    the error over every size. Backward (the file's forward + backward less the forward): a standalone
    backward call carries autograd's start-up (its smallest sizes' time, about 70 µs on an H100),
    which a training step's backward pays once, not per op: t = that floor + bytes/rate, from and
    over the sizes at least twice the floor."""
    fwd: dict[str, tuple[float, str]] = {}
    bwd: dict[str, tuple[float, str]] = {}
    lines = []
    eb = ELEMENT_BYTES[TRAINING_DTYPE]
    for op in sorted({r["op"] for r in rows}):
        mine = sorted((r for r in rows if r["op"] == op and r["dtype"] == TRAINING_DTYPE), key=lambda r: r["numel"])
        if op not in ELEMENTWISE_OPS or len(mine) < 2:
            continue
        # Bytes in + out of the forward: the file's rate × time where it gives one, else in + out once; a
        # cast to fp32 reads its dtype's and writes 4 a value (the file counts it as the dtype's twice).
        nbytes = np.array([(eb + 4.0) * float(r["numel"]) if op == "cast_to_fp32" else
                           float(r["fwd_GBps_min_traffic"]) * 1e9 * float(r["fwd_s"]) if "fwd_GBps_min_traffic" in r
                           else 2.0 * eb * float(r["numel"]) for r in mine])
        f_t = np.array([float(r["fwd_s"]) for r in mine])
        b_t = np.array([float(r["fwd_bwd_s"]) - float(r["fwd_s"]) for r in mine])
        big = f_t >= 2 * launch
        floor = float(np.min(b_t))
        big_b = b_t >= 2 * floor
        if not big.any() or not big_b.any():
            lines.append(FitLine(f"element-wise {op} ({TRAINING_DTYPE})", "", len(mine), 1.0, 1.0, False,
                                 "no size runs long enough past the launch to show a rate; not written"))
            continue
        rate_f = _rate(nbytes[big], f_t[big] - launch)
        rate_b = _rate(nbytes[big_b], b_t[big_b] - floor)
        err = np.abs((launch + nbytes / rate_f) / f_t - 1)
        err_b = np.abs((floor + nbytes[big_b] / rate_b) / b_t[big_b] - 1)
        both = np.concatenate([err, err_b])
        ok = float(np.median(both)) <= REFUSE_MEDIAN_ERROR
        lines.append(FitLine(f"element-wise {op} ({TRAINING_DTYPE}) → {', '.join(ELEMENTWISE_OPS[op])}",
                             f"forward {rate_f / 1e9:.0f} GB/s, backward {rate_b / 1e9:.0f} GB/s of forward bytes",
                             len(both), float(np.median(both)), float(np.max(both)), ok,
                             "" if ok else f"median error above {REFUSE_MEDIAN_ERROR:.0%}: not written"))
        if ok:
            for onnx_op in ELEMENTWISE_OPS[op]:
                fwd[onnx_op] = (rate_f, f"{op} fit")
                bwd[onnx_op] = (rate_b, f"{op} fit")
    return fwd, bwd, lines


def _backward_floor(rows: Sequence[Mapping[str, Any]]) -> float:
    """What a standalone backward call costs beyond its kernels (autograd's start-up): the least
    backward time of any element-wise op in the file."""
    return min(float(r["fwd_bwd_s"]) - float(r["fwd_s"]) for r in rows)


_ATTENTION_KEYS = ("batch", "heads", "seq", "head_dim", "causal", "fwd_s", "fwd_bwd_s")


def _fit_attention(rows: Sequence[Mapping[str, Any]], launch: float, floor: float, peak: float
                   ) -> list[tuple[str, dict[str, float], FitLine]]:
    """FlashAttention (torch's SDPA) forward and backward: t = floor + F / (P · s/(s + s½) · d/(d + d½)
    · c if causal), F its forward FLOPs (4·b·h·s²·d, halved when causal); the forward's floor the
    launch, the backward's a standalone backward call's; P at most the datasheet's peak."""
    mine = [r for r in rows if all(k in r for k in _ATTENTION_KEYS)]
    if len(mine) < 6:
        return []
    flops = np.array([4.0 * r["batch"] * r["heads"] * r["seq"] ** 2 * r["head_dim"] * (0.5 if r["causal"] else 1.0)
                      for r in mine])
    seq = np.array([float(r["seq"]) for r in mine])
    dim = np.array([float(r["head_dim"]) for r in mine])
    causal = np.array([bool(r["causal"]) for r in mine])
    out = []
    for key, times, t0 in (("attention_forward", np.array([float(r["fwd_s"]) for r in mine]), launch),
                           ("attention_backward", np.array([float(r["fwd_bwd_s"]) - float(r["fwd_s"]) for r in mine]),
                            floor)):
        def params(x: np.ndarray) -> tuple[float, float, float, float]:
            return peak / (1 + float(np.exp(-x[0]))), float(np.exp(x[1])), float(np.exp(x[2])), float(np.exp(x[3]))

        def model(x: np.ndarray, t0: float = t0) -> np.ndarray:
            p, sh, dh, c = params(x)
            return t0 + flops / (p * seq / (seq + sh) * dim / (dim + dh) * np.where(causal, c, 1.0))

        def residuals(x: np.ndarray, times: np.ndarray = times, model: Callable[..., np.ndarray] = model) -> np.ndarray:
            return np.log(model(x)) - np.log(times)

        x = levenberg_marquardt(residuals, [0.0, float(np.log(256.0)), float(np.log(32.0)), 0.0])
        p, sh, dh, c = params(x)
        err = np.abs(model(x) / times - 1)
        ok = float(np.median(err)) <= REFUSE_MEDIAN_ERROR
        what = "FlashAttention " + key.split("_")[1]
        out.append((key, {"flops_per_s": p, "half_seq": sh, "half_head_dim": dh, "causal_fraction": c},
                    FitLine(what, f"{p / 1e12:.0f} TFLOP/s of forward FLOPs, half at seq {sh:.0f} or head dim "
                                  f"{dh:.0f}, causal at {c:.2f}", len(mine), float(np.median(err)),
                            float(np.max(err)), ok, "" if ok else f"median error above {REFUSE_MEDIAN_ERROR:.0%}: "
                                                                 "its FLOPs priced as matmuls")))
    return out


@dataclass(frozen=True)
class _OptimizerFit:
    terms: dict[str, float]
    line: FitLine


def _fit_adamw(rows: Sequence[Mapping[str, Any]]) -> _OptimizerFit:
    fused = [r for r in rows if r.get("impl") == "fused" and {"params", "tensors", "step_s"} <= set(r)]
    if len(fused) < 3:
        return _OptimizerFit({}, FitLine("AdamW (fused)", "", len(fused), 1.0, 1.0, False,
                                         "needs 3 or more fused AdamW rows; the base's kept"))
    t = np.array([float(r["step_s"]) for r in fused])
    design = np.stack([np.ones_like(t), [float(r["tensors"]) for r in fused], [float(r["params"]) for r in fused]],
                      axis=1) / t[:, None]
    coef = nonnegative_lstsq(design, np.ones_like(t))
    model = design @ coef * t
    err = np.abs(model / t - 1)
    ok = float(np.median(err)) <= REFUSE_MEDIAN_ERROR
    terms = {"fixed_s": float(coef[0]), "tensor_s": float(coef[1]), "param_s": float(coef[2])}
    return _OptimizerFit(terms, FitLine(
        "AdamW (fused)", f"{terms['fixed_s'] * 1e6:.0f} µs + {terms['tensor_s'] * 1e6:.2f} µs per tensor + "
        f"{terms['param_s'] * 1e12:.2f} ps per parameter ({16 / max(terms['param_s'], 1e-30) / 1e12:.2f} TB/s of its "
        "16 bytes each)", len(fused), float(np.median(err)), float(np.max(err)), ok,
        "" if ok else f"median error above {REFUSE_MEDIAN_ERROR:.0%}: the base's kept"))
