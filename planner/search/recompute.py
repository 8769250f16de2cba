"""Activation recomputation as a decision of the sharding ILP: how many layers n_g of each repeated-layer
group g are recomputed (Megatron's --recompute-num-layers with the block method: the first n_g), any
count from none to all L_g, in the same model as the sharding.

Per layer of group g, under the sharding decisions x (and the edges' classes y):
  F_g(x, y)  the time recomputing one layer adds: its forward again, with its forward reshards (ns);
  S_g(x)     the memory it saves: its saved activations less the layer input it keeps (KiB);
  T_g(x)     its activations, live while its backward runs (KiB; one recomputed layer at a time).
The step costs n_g·F_g more and holds n_g·S_g less, plus T_g once if n_g ≥ 1. The products of the
integer n_g with the linear F_g and S_g are linearised exactly: n_g = Σ_j 2^j·b_j, b_j ∈ {0, 1},
  time    u_j ≥ F_g − U_F·(1 − b_j), u_j ≥ 0           objective + Σ_j 2^j·u_j
  memory  v_j ≤ S_g, v_j ≤ U_S·b_j, v_j ≥ 0             memory row − Σ_j 2^j·v_j
          w ≥ T_g − U_T·(1 − z), z ≥ b_j, w ≥ 0         memory row + w
with U the largest value each expression takes (the sum of its positive coefficients). At an optimum
u_j = b_j·F_g (the objective pushes it down) and, where the memory row binds, v_j = b_j·S_g."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from planner.search.milp import LinearModel

BIG = 2**62  # an open upper bound of a ≥ constraint


@dataclass
class GroupTerms:
    """The per-layer expressions of one layer group, as coefficients by variable."""

    prefix: str
    layers: int
    fixed: int | None = None  # the count, where the request holds it (--recompute-layers)
    time_ns: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    saved_kib: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    transient_kib: dict[int, float] = field(default_factory=lambda: defaultdict(float))


@dataclass
class Counts:
    """What the counts add to the ILP: objective terms (ns), memory-row terms (KiB), and per group the
    bits whose weighted sum is its count."""

    objective: list[tuple[int, int]]
    memory: list[tuple[int, int]]
    bits: dict[str, list[tuple[int, int]]]  # prefix → (variable, weight 2^j)


def add_counts(model: LinearModel, groups: list[GroupTerms]) -> Counts:
    objective: list[tuple[int, int]] = []
    memory: list[tuple[int, int]] = []
    bits: dict[str, list[tuple[int, int]]] = {}
    for gi, g in enumerate(groups):
        f = {v: round(c) for v, c in g.time_ns.items() if round(c)}
        s = {v: int(c) for v, c in g.saved_kib.items() if int(c)}  # rounded down: the saving is not overstated
        t = {v: -int(-c) for v, c in g.transient_kib.items() if c}  # rounded up
        uf, us, ut = (max(1, sum(c for c in e.values() if c > 0)) for e in (f, s, t))
        width = g.layers.bit_length()
        b = [model.bool_var(f"recompute_bit[{gi},{j}]") for j in range(width)]
        bits[g.prefix] = [(v, 2**j) for j, v in enumerate(b)]
        lo, hi = (g.fixed, g.fixed) if g.fixed is not None else (0, g.layers)
        model.add(f"recompute_count[{gi}]", bits[g.prefix], lo, hi)
        z = model.bool_var(f"recompute_any[{gi}]")
        w = model.int_var(f"recompute_transient[{gi}]", 0, ut)
        model.add(f"recompute_transient[{gi}]", [(w, 1), *((v, -c) for v, c in t.items()), (z, -ut)], -ut, BIG)
        memory.append((w, 1))
        for j, bj in enumerate(b):
            model.add(f"recompute_any[{gi},{j}]", [(z, 1), (bj, -1)], 0, 1)
            u = model.int_var(f"recompute_time[{gi},{j}]", 0, uf)
            model.add(f"recompute_time[{gi},{j}]", [(u, 1), *((v, -c) for v, c in f.items()), (bj, -uf)], -uf, BIG)
            objective.append((u, 2**j))
            v_ = model.int_var(f"recompute_saved[{gi},{j}]", 0, us)
            model.add(f"recompute_saved[{gi},{j}]", [(v_, 1), *((v, -c) for v, c in s.items())], -BIG, 0)
            model.add(f"recompute_saved_bit[{gi},{j}]", [(v_, 1), (bj, -us)], -BIG, 0)
            memory.append((v_, -(2**j)))
    return Counts(objective=objective, memory=memory, bits=bits)
