"""A lower bound of the sharding ILP's objective that needs no solver: what a mesh's ILP must at least
cost, checked against the plan the search already holds before its edges are priced and it is solved.

The ILP without its edges (every edge costs ≥ 0) and with one memory row (the peak's; the others only
cut more) is a multiple-choice knapsack: each decision d takes one choice i at c[d,i] seconds and
m[d,i] bytes, and each recomputed layer group g takes a count n_g ∈ [lo_g, hi_g] of layers, each adding
f[d,i] seconds and saving s[d,i] bytes for the choices of its first layer's decisions:

  min  Σ_d c[d,i_d] + Σ_g n_g Σ_{d∈g} f[d,i_d]
  s.t. Σ_d m[d,i_d] − Σ_g n_g Σ_{d∈g} s[d,i_d] ≤ limit

Its Lagrangian relaxation is separable, per decision outside the groups and per (group, count):

  L(λ) = −λ·limit + Σ_{d∉G} min_i (c + λm) + Σ_g min_n Σ_{d∈g} min_i (c + n f + λ(m − n s))

Every L(λ), λ ≥ 0, is a lower bound of the ILP's optimum; L is concave, and its best λ is where the
memory of the minimising choices crosses the limit (bisection on that subgradient). L(0) is the bound
without memory: the cheapest choice of every decision. A bound above the cutoff proves the ILP has no
plan to beat it — the proof CBC otherwise finds by branch and bound, seconds on a two-axis mesh.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Group:
    """A recomputed layer group: its count's range, and per x variable what one more recomputed layer
    adds (seconds) and saves (bytes)."""

    lo: int
    hi: int
    time_s: Mapping[int, float]
    saved_bytes: Mapping[int, float]


@dataclass(frozen=True)
class Floor:
    seconds: float  # the best lower bound found
    without_memory: float  # L(0): every decision's cheapest choice

    @property
    def by_memory(self) -> bool:
        """The memory row raised the bound above L(0)."""
        return self.seconds > self.without_memory


def _padded(rows: Sequence[Sequence[float]], fill: float) -> np.ndarray:
    width = max((len(r) for r in rows), default=1)
    out = np.full((len(rows), width), fill)
    for k, r in enumerate(rows):
        out[k, :len(r)] = r
    return out


def time_floor(costs: Mapping[K, Sequence[float]], mem: Mapping[K, Sequence[float]], x: Mapping[K, Sequence[int]],
               groups: Sequence[Group], limit_bytes: float, *, iterations: int = 40) -> Floor:
    """The lower bound above: `costs[d]`, `mem[d]`: per choice of decision d, seconds and bytes;
    `x[d]`: its choices' variables, which `groups` key their per-layer terms by."""
    member: dict[K, int] = {}
    for gi, g in enumerate(groups):
        keys = set(g.time_s) | set(g.saved_bytes)
        member.update({d: gi for d, xs in x.items() if d not in member and any(v in keys for v in xs)})
    alone = [d for d in costs if d not in member and costs[d]]
    c0, m0 = _padded([costs[d] for d in alone], np.inf), _padded([mem[d] for d in alone], 0.0)
    parts = []
    for gi, g in enumerate(groups):
        ds = [d for d in costs if member.get(d) == gi and costs[d]]
        n = np.arange(g.lo, g.hi + 1, dtype=float)[:, None, None]
        c, m = _padded([costs[d] for d in ds], np.inf), _padded([mem[d] for d in ds], 0.0)
        f = _padded([[g.time_s.get(v, 0.0) for v in x[d]] for d in ds], 0.0)
        s = _padded([[g.saved_bytes.get(v, 0.0) for v in x[d]] for d in ds], 0.0)
        parts.append((c + n * np.maximum(f, 0.0), m - n * np.maximum(s, 0.0)))  # (counts, decisions, choices)

    def lagrangian(lam: float) -> tuple[float, float]:
        """L(λ), and the memory of its minimising choices (the subgradient's, plus the limit)."""
        v = c0 + lam * m0
        i = np.argmin(v, axis=1)
        rows = np.arange(len(i))
        value, used = float(v[rows, i].sum()), float(m0[rows, i].sum())
        for t, mm in parts:
            w = t + lam * mm
            j = np.argmin(w, axis=2)
            picked = np.take_along_axis(w, j[..., None], axis=2)[..., 0].sum(axis=1)
            held = np.take_along_axis(mm, j[..., None], axis=2)[..., 0].sum(axis=1)
            k = int(np.argmin(picked))
            value, used = value + float(picked[k]), used + float(held[k])
        return value - (lam * limit_bytes if lam else 0.0), used

    base, used = lagrangian(0.0)
    if used <= limit_bytes or not np.isfinite(base):
        return Floor(base, base)
    best, lo, hi = base, 0.0, max(base, 1e-9) / max(limit_bytes, 1.0)
    for _ in range(64):  # a multiplier at which the minimising choices fit
        value, used = lagrangian(hi)
        best = max(best, value)
        if used <= limit_bytes:
            break
        lo, hi = hi, hi * 4
    else:
        return Floor(best, base)  # (nothing fits: `_check_floor` tells that)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        value, used = lagrangian(mid)
        best = max(best, value)
        lo, hi = (mid, hi) if used > limit_bytes else (lo, mid)
    return Floor(best, base)
