"""Fits of measurements to the profile's models (numpy only, so they are tested without torch).

Both fits weigh *relative* error, since a profile is judged by how well it predicts a time as a
fraction of itself, at 4 KiB as much as at 256 MiB.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from core.collectives import Collective


@dataclass(frozen=True, slots=True)
class AlphaBetaFit:
    alpha_s: float
    bus_bandwidth_bytes_per_s: float
    median_rel_error: float  # |model − measured| / measured, median over the sizes


def fit_alpha_beta(kind: Collective, num_ranks: int, sizes_bytes: Sequence[float],
                   times_s: Sequence[float]) -> AlphaBetaFit:
    """Fit t = steps(n)·α + factor(n)·S/β minimising Σ|model − t|/t (L1 on relative residuals),
    α ≥ 0, β > 0.

    L1, not least squares, because measured collective times carry outliers (a slow scheduler
    quantum on a shared core) that squares would chase. An L1 optimum of a two-parameter linear
    model passes through two of the points (or lies on a bound), so enumerating those candidates
    finds it exactly.
    """
    s = np.asarray(sizes_bytes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if len(s) < 2 or np.any(t <= 0) or np.any(s <= 0):
        raise ValueError("need at least two sizes with positive times to fit α and β")
    steps, factor = kind.steps(num_ranks), kind.bus_factor(num_ranks)
    # Unknowns a = α and b = 1/β: model = steps·a + factor·S·b.
    candidates: list[tuple[float, float]] = []
    for i, j in itertools.combinations(range(len(s)), 2):
        if s[i] != s[j]:
            b = (t[j] - t[i]) / (factor * (s[j] - s[i]))
            candidates.append(((t[i] - factor * s[i] * b) / steps, b))
    candidates += [(0.0, ti / (factor * si)) for si, ti in zip(s, t, strict=True)]  # bound α = 0
    best: tuple[float, float, float] | None = None
    for a, b in candidates:
        if a < 0 or b <= 0:
            continue
        cost = float(np.sum(np.abs(steps * a + factor * s * b - t) / t))
        if best is None or cost < best[0]:
            best = (cost, a, b)
    assert best is not None  # the α = 0 candidates are always admissible
    _, alpha, inv_beta = best
    rel = np.abs(steps * alpha + factor * s * inv_beta - t) / t
    return AlphaBetaFit(alpha_s=alpha, bus_bandwidth_bytes_per_s=1.0 / inv_beta, median_rel_error=float(np.median(rel)))


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient ≥ 0: the free fit, else the best fit on each subset of
    the columns (few columns)."""
    best, best_err = np.zeros(a.shape[1]), float(b @ b)
    n = a.shape[1]
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(n)
        full[cols] = coef
        err = float(np.sum((a @ full - b) ** 2))
        if err < best_err:
            best, best_err = full, err
    return best


def levenberg_marquardt(residuals: Callable[[np.ndarray], np.ndarray], x0: Sequence[float],
                         iterations: int = 200) -> np.ndarray:
    """Least squares of `residuals` from x0 (a numeric Jacobian; few parameters)."""
    x = np.asarray(x0, dtype=np.float64)
    r = residuals(x)
    lam = 1e-3
    for _ in range(iterations):
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            step = np.zeros_like(x)
            step[j] = 1e-6
            jac[:, j] = (residuals(x + step) - r) / 1e-6
        a, g = jac.T @ jac, jac.T @ r
        delta = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), -g)
        trial = residuals(x + delta)
        if trial @ trial < r @ r:
            x, r, lam = x + delta, trial, lam / 3
            if np.max(np.abs(delta)) < 1e-10:
                break
        else:
            lam *= 4
            if lam > 1e12:
                break
    return x


@dataclass(frozen=True, slots=True)
class EfficiencyFit:
    peak_achieved_flops_per_s: float  # P: the asymptote of achieved FLOP/s
    half_flops: float  # F½: the matmul size reaching P/2
    median_rel_error: float


def fit_efficiency(flops: Sequence[float], achieved_flops_per_s: Sequence[float]) -> EfficiencyFit:
    """Fit achieved(F) = P·F/(F + F½): linear in 1/F as 1/achieved = 1/P + (F½/P)·(1/F)."""
    f = np.asarray(flops, dtype=np.float64)
    a = np.asarray(achieved_flops_per_s, dtype=np.float64)
    # Relative residuals again: weight each row by the achieved rate.
    design = np.stack([np.ones_like(f), 1.0 / f], axis=1) * a[:, None]
    coef = nonnegative_lstsq(design, np.ones_like(a))
    inv_p, half_over_p = float(coef[0]), float(coef[1])
    if inv_p <= 0:
        inv_p = 1.0 / float(np.max(a))
    peak = 1.0 / inv_p
    half = half_over_p * peak
    model = peak * f / (f + half)
    return EfficiencyFit(peak_achieved_flops_per_s=peak, half_flops=half,
                         median_rel_error=float(np.median(np.abs(model - a) / a)))


def monotone_fit(values: list[float]) -> np.ndarray:
    """The non-decreasing sequence nearest to `values` in least squares (pool adjacent violators):
    a run of measured times that falls with size is replaced by its mean. A calibrated table holds
    mean times, and gloo's heavy tail makes each mean noisy (±30% here); a running maximum would
    carry one high mean to every larger size, the pooled mean does not."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.full(int(c), t / c) for t, c in blocks])
