"""Offload as a decision of the sharding ILP: how many layers n_g,m of each repeated-layer group g keep
their model states in host memory under mode m (`core.levers.Offload`: the optimizer states, or the
weights, gradients and optimizer states), the first layers of the group; the parameters outside the
repeated layers one more group of one layer. A layer is offloaded whole, as FSDP2 offloads a
`fully_shard` unit (CPUOffloadPolicy) and ZeRO-Offload a model's optimizer.

Per layer of group g offloaded under m, under the sharding decisions x (`ModelStates`):
  T_g,m(x)  the time it adds to the objective: the host's optimizer step less the device's, and its
            copies the step waits for whatever the compute (all of them under the serial step; under
            the overlapped one those after the optimizer step) (ns; negative where the host is faster);
  S_g,m(x)  the device bytes it frees, in the step's peak row and in the end-of-backward row (KiB);
  H_g,m(x)  its copies that can run under compute (ns; overlapped step only);
  F_p,m(x)  the longest such copy of its parameter p (ns).
With n = Σ_j 2^j·b_j, b_j ∈ {0,1}, the products are linearised exactly as for recomputation
(`recompute.py`), T shifted by its least value T⁻ (≤ 0) to keep the bound rows one-sided:
  time      u_j ≥ (T − T⁻) − U·(1 − b_j), u_j ≥ 0      objective + Σ_j 2^j·(u_j + T⁻·b_j)
  memory    v_j ≤ S, v_j ≤ U_S·b_j                     each row − Σ_j 2^j·v_j
  hideable  h_j ≥ H − U_H·(1 − b_j), h_j ≥ 0
  exposed   E ≥ Σ 2^j·h_j − compute(x) − recomputation, E ≥ F_p,m(x) − U_F·(1 − z_g,m), z ≥ b_j, E ≥ 0
Σ_m n_g,m ≤ L_g. At an optimum u_j = b_j·(T − T⁻) and h_j = b_j·H (the objective pushes them down), and
E = max(the longest copy offloaded, hideable − compute), as `compose.host_exposed` prices it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from core.levers import Offload
from planner.search.milp import LinearModel
from planner.search.recompute import BIG

MODES = (Offload.OPTIMIZER, Offload.PARAMS)


@dataclass
class LayerOffload:
    """One group's per-layer expressions under one mode, as coefficients by variable."""

    prefix: str  # the layer group's ("" for the parameters outside the repeated layers)
    mode: Offload
    layers: int
    fixed: int | None = None  # the count, where the request holds it (every layer: `offload` optimizer, ...)
    time_ns: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    saved_kib: dict[int, float] = field(default_factory=lambda: defaultdict(float))  # at the step's peak
    saved_end_kib: dict[int, float] = field(default_factory=lambda: defaultdict(float))  # at the end of backward
    hideable_ns: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    first_ns: list[dict[int, float]] = field(default_factory=list)  # per parameter: its longest hideable copy


@dataclass
class OffloadCounts:
    """What the counts add to the ILP: objective terms (ns), the two memory rows' terms (KiB), the
    hideable copies' terms (ns, for the exposed row) with the longest copies' rows still to add, and
    per (group, mode) the bits whose weighted sum is its count."""

    objective: list[tuple[int, int]]
    memory: list[tuple[int, int]]
    memory_end: list[tuple[int, int]]
    hideable: list[tuple[int, int]]
    firsts: list[tuple[int, list[tuple[int, int]], int]]  # (z, the parameter's terms, their bound)
    bits: dict[tuple[str, Offload], list[tuple[int, int]]]


def add_offload_counts(model: LinearModel, groups: Sequence[LayerOffload], decision: Mapping[int, int]) -> OffloadCounts:
    """`decision`: each choice variable's decision (one choice of each is taken: an expression's bounds
    are the sums of its per-decision extremes, not of all its coefficients, which keeps the linearisation's
    big-M rows tight)."""
    out = OffloadCounts([], [], [], [], [], {})
    by_group: dict[str, list[tuple[int, int]]] = defaultdict(list)

    def most(e: Mapping[int, int]) -> int:
        best: dict[int, int] = defaultdict(int)
        for v, c in e.items():
            best[decision.get(v, -v - 1)] = max(best[decision.get(v, -v - 1)], c)
        return sum(best.values())

    def least(e: Mapping[int, int]) -> int:
        return -most({v: -c for v, c in e.items()})

    for gi, g in enumerate(groups):
        t = {v: round(c) for v, c in g.time_ns.items() if round(c)}
        low = least(t)  # T⁻: the least T takes (≤ 0)
        hi = max(1, most(t) - low)
        s = {v: int(c) for v, c in g.saved_kib.items() if int(c)}  # rounded down: the saving is not overstated
        se = {v: int(c) for v, c in g.saved_end_kib.items() if int(c)}
        h = {v: round(c) for v, c in g.hideable_ns.items() if round(c)}
        us, use, uh = (max(1, most(e)) for e in (s, se, h))
        width = g.layers.bit_length()
        b = [model.bool_var(f"offload_bit[{gi},{j}]") for j in range(width)]
        out.bits[(g.prefix, g.mode)] = [(v, 2**j) for j, v in enumerate(b)]
        by_group[g.prefix].extend(out.bits[(g.prefix, g.mode)])
        lo, up = (g.fixed, g.fixed) if g.fixed is not None else (0, g.layers)
        model.add(f"offload_count[{gi}]", out.bits[(g.prefix, g.mode)], lo, up)
        z = model.bool_var(f"offload_any[{gi}]")
        for j, bj in enumerate(b):
            model.add(f"offload_any[{gi},{j}]", [(z, 1), (bj, -1)], 0, 1)
            u = model.int_var(f"offload_time[{gi},{j}]", 0, hi)
            # u ≥ (T − T⁻) − hi·(1 − b): T⁻ moves to the right-hand side
            model.add(f"offload_time[{gi},{j}]", [(u, 1), *((v, -c) for v, c in t.items()), (bj, -hi)], -hi - low, BIG)
            out.objective += [(u, 2**j), (bj, low * 2**j)]
            for name, e, ub, terms in (("saved", s, us, out.memory), ("saved_end", se, use, out.memory_end)):
                if e:
                    v_ = model.int_var(f"offload_{name}[{gi},{j}]", 0, ub)
                    model.add(f"offload_{name}[{gi},{j}]", [(v_, 1), *((v, -c) for v, c in e.items())], -BIG, 0)
                    model.add(f"offload_{name}_bit[{gi},{j}]", [(v_, 1), (bj, -ub)], -BIG, 0)
                    terms.append((v_, -(2**j)))
            if h:
                hv = model.int_var(f"offload_hideable[{gi},{j}]", 0, uh)
                model.add(f"offload_hideable[{gi},{j}]", [(hv, 1), *((v, -c) for v, c in h.items()), (bj, -uh)],
                          -uh, BIG)
                out.hideable.append((hv, 2**j))
        for f in g.first_ns:
            terms = [(v, round(c)) for v, c in f.items() if round(c)]
            if terms:
                out.firsts.append((z, terms, max(c for _, c in terms)))
    for prefix, bits in by_group.items():  # a layer is offloaded under one mode at most
        layers = next(g.layers for g in groups if g.prefix == prefix)
        model.add(f"offload_layers[{prefix or '(outside layers)'}]", bits, 0, layers)
    return out


def add_exposed_row(model: LinearModel, counts: OffloadCounts, cover: Sequence[tuple[int, int]]) -> int | None:
    """E ≥ Σ hideable − cover (the step's compute and recomputation, as (variable, ns) terms) and
    E ≥ each offloaded parameter's longest copy; E's variable (None: nothing hideable)."""
    if not counts.hideable and not counts.firsts:
        return None
    bound = max(1, sum(c * model.bounds.get(v, (0, 1))[1] for v, c in counts.hideable))
    e = model.int_var("exposed_host", 0, bound)
    model.add("exposed_host", [(e, 1), *[(v, -c) for v, c in counts.hideable], *cover], 0, BIG)
    for k, (z, terms, most) in enumerate(counts.firsts):
        # E ≥ F − most·(1 − z)
        model.add(f"first_host_copy[{k}]", [(e, 1), *[(v, -c) for v, c in terms], (z, -most)], -most, BIG)
    return e
