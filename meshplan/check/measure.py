"""`check --run`: the new plan and the baseline's executed side by side, and what they measured compared."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from meshplan.check.compare import Finding
from meshplan.check.config import Case, load_plan


def measure(case: Case, strategy_path: Path, baseline_path: Path | None = None) -> dict[str, Any]:
    """`meshplan run` of the case's plan `runs` times — interleaved with as many runs of the baseline's
    plan (`baseline_path`), A B A B …, so that both meet the machine in the same states — each run
    between two timings of a fixed reference workload (`reference_s`). Per plan: each run's step time,
    also as a multiple of the reference's time at that moment, their median and median absolute
    deviation; the prediction's drift from the median; with a baseline plan, the paired ratios new /
    baseline of the runs side by side."""
    plans = {"new": strategy_path} if baseline_path is None else {"new": strategy_path, "baseline": baseline_path}
    raw: dict[str, list[tuple[float, float]]] = {k: [] for k in plans}
    for i in range(case.runs):
        for key in (list(plans) if i % 2 == 0 else list(plans)[::-1]):  # A B, B A, …: no side always first
            raw[key].append(_one_run(case, plans[key]))
    out = _summary(raw["new"], load_plan(strategy_path).cost.step_time_s)
    if baseline_path is not None:
        out["baseline_now"] = _summary(raw["baseline"], load_plan(baseline_path).cost.step_time_s)
        pairs = [b[0] / a[0] for a, b in zip(raw["baseline"], raw["new"], strict=True)]
        med = statistics.median(pairs)
        out["paired"] = {"ratios": pairs, "median": med, "mad": statistics.median(abs(x - med) for x in pairs)}
    return out


def _one_run(case: Case, path: Path) -> tuple[float, float]:
    """(measured step s, reference s around it)."""
    from executor.launch import run
    from executor.preflight import RunOptions

    s = load_plan(path)
    nproc = s.pipeline.devices if s.pipeline is not None else s.mesh.num_devices
    before = reference_s()
    r = run(str(path), case.model, nproc=nproc, opts=RunOptions(steps=case.steps, warmup=2))
    return float(r["measured_step_s"]), (before + reference_s()) / 2


def _summary(runs: list[tuple[float, float]], predicted_s: float) -> dict[str, Any]:
    samples = [x for x, _ in runs]
    ratios = [x / ref for x, ref in runs]
    med = statistics.median(ratios)
    return {"samples_s": samples, "reference_s": [ref for _, ref in runs], "median_s": statistics.median(samples),
            "median_ratio": med, "mad_ratio": statistics.median(abs(x - med) for x in ratios),
            "predicted_s": predicted_s, "drift_points": 100 * abs(predicted_s / statistics.median(samples) - 1)}


def reference_s() -> float:
    """The machine's speed now: the median time of 5 rounds of 20 single-threaded 256×256 fp32
    matmuls (about 20 ms here), the kind of work a CPU rank's step is made of."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(20):
                a @ a
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def _se(mad: float, n: int) -> float:
    """The standard error of a median of n samples whose median absolute deviation is `mad` (normal
    samples: σ ≈ 1.4826·MAD, and the median's error ≈ 1.2533·σ/√n)."""
    return 1.2533 * 1.4826 * mad / max(n, 1) ** 0.5


def compare_measured(case: Case, old: dict[str, Any], new: dict[str, Any]) -> list[Finding]:
    """Judged on runs side by side, each only past its tolerance and k × the median's error: is the new
    plan slower than the baseline's (the paired ratios)? Did its prediction drift further from its
    measurement than the baseline's from the baseline plan's, measured now? Reported, and judged only
    where `stored_step_time` is set: the baseline's plan now against its measurement when accepted
    (as multiples of a reference workload's time, so that a machine slower as a whole is not a
    regression). On this VM the same plan measured 14.3–17.5 ms from one check to the next with the
    reference unchanged: beyond any 10% gate on stored figures; side by side, within ±5%."""
    t, name = case.tolerance, case.name
    out = []

    def judge(metric: str, a: float, b: float, noise: float, tol: float | None, note: str) -> None:
        if tol is not None and b > a * (1 + tol) and b - a > t.noise_k * noise:
            out.append(Finding(name, metric, a, b, "regression",
                               f"+{b / a - 1:.1%} > tolerance +{tol:.0%} and > {t.noise_k:g}× the noise; {note}"))
        elif b < a * (1 - (tol if tol is not None else 0.0)) and a - b > t.noise_k * noise:
            out.append(Finding(name, metric, a, b, "improvement", f"{b / a - 1:.1%}; {note}"))
        else:
            out.append(Finding(name, metric, a, b, "ok" if tol is not None or abs(b / a - 1) < 1e-12 else "changed",
                               f"{b / a - 1:+.1%}; {note}"))

    paired, now = new.get("paired"), new.get("baseline_now")
    if paired is not None and now is not None:
        mad = _se(float(paired["mad"]), len(paired["ratios"]))
        judge("measured step, new plan / baseline plan", 1.0, float(paired["median"]), mad, t.measured_step_time,
              f"{len(paired['ratios'])} runs of each side by side; noise ±{mad:.1%} (the median ratio's error)")
        d_base, d_new = float(now["drift_points"]), float(new["drift_points"])
        if d_new - d_base > t.drift:
            out.append(Finding(name, "prediction drift (points)", d_base, d_new, "regression",
                               f"|predicted/measured − 1| of the new plan exceeds the baseline plan's, both measured now, "
                               f"by {d_new - d_base:.1f} points > tolerance {t.drift:g}"))
    else:
        now = new
    a, b = float(old["median_ratio"]), float(now["median_ratio"])
    noise = max(_se(float(old["mad_ratio"]), len(old["samples_s"])), _se(float(now["mad_ratio"]), len(now["samples_s"])))
    speed = statistics.median(now["reference_s"]) / statistics.median(old["reference_s"])
    judge("measured step of the baseline plan, now / accepted (× reference)", a, b, noise, t.stored_step_time,
          f"step {old['median_s'] * 1e3:.2f} → {now['median_s'] * 1e3:.2f} ms, the machine at ×{1 / speed:.2f} its "
          f"baseline speed; noise ±{noise / a:.1%} (the medians' error)"
          + ("" if t.stored_step_time is not None else "; reported, not judged (stored_step_time unset)"))
    return out
