"""The overlapped step in the sharding ILP (`ShardingILP` under `compose.overlap`, the GPU default).

Each edge's time splits into what stays exposed, its parameters' gradient reductions (all-reduces,
reduce-scatters) and its parameters' gathers for use (`CostModel.edge_time_parts`). The exposed part
stays in the objective; the other two leave it for two integer variables (ns), bounded below:
  E_g ≥ Σ grads·y − k Σ backward·x   the gradient reductions beyond the k micro-batches' backward
  E_g ≥ λ_c Σ grads_c·y              per collective c (all-reduce, reduce-scatter): its last bucket,
                                     λ_c = min(1, cap_c / B) / k, B the most gradient bytes the buckets
                                     can hold (every axis, fp32 where reductions are forced to it)
  E_a ≥ E_b, E_a ≥ E_f                the exposed gathers, the larger of:
  E_b ≥ Σ gathers·y − Σ compute·x     the parameter gathers beyond the step's compute
  E_f ≥ Σ_y first_e,y·y               the first gather waits: edge e's longest gather under y (k times;
                                     one y of an edge is chosen; rows for the FIRST_GATHER_ROWS edges of
                                     the longest)
  E ≥ 0
At its solution the objective is then the composed step (to each coefficient's rounding to an integer
ns; `test_ilp_objective_is_the_composed_step`), and a lower bound of it where the composer's terms are
not linear in y: with k > 1 micro-steps (the composer takes max(0, ·) per micro-step), where the plan's
gradient bytes fall short of B (a ratio: the last bucket is cap_c / the plan's bytes of the
reductions), beyond FIRST_GATHER_ROWS gathering edges, and where the plan's gradients pack into more
buckets than one (each pays a latency; a y pays its bytes' share of one: `CostModel._bucket_share`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from costmodel.buckets import CommFusion
from planner.search.decisions import NS_PER_S, Decision
from planner.search.milp import LinearModel
from planner.search.recompute import BIG

FIRST_GATHER_ROWS = 256


@dataclass
class OverlapTerms:
    """The hideable parts of the edges' y variables, gathered while the edges are added."""

    # (y, ns) of the gradient all-reduces, reduce-scatters and parameter gathers
    hideable: dict[str, list[tuple[int, int]]] = field(
        default_factory=lambda: {"allreduce": [], "reducescatter": [], "gathers": []})
    one_gather: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # edge → (y, one gather's ns)

    def add_edge(self, edge: int, var: int, multiplicity: int, grads_ar: int, grads_rs: int, gathers: int,
                 first: int) -> None:
        """`first`: the edge's longest gather (of one instance, per micro-batch × k)."""
        for kind, t in (("allreduce", grads_ar), ("reducescatter", grads_rs), ("gathers", gathers)):
            if t:
                self.hideable[kind].append((var, t))
        if first:
            self.one_gather.setdefault(edge, []).append((var, first))

    def add_rows(self, model: LinearModel, x: Mapping[Decision, Sequence[int]],
                 backward_s: Mapping[Decision, Sequence[float]], compute_s: Mapping[Decision, Sequence[float]],
                 fusion: CommFusion, gradient_bytes: float,
                 micro_batches: int) -> tuple[list[tuple[int, int]], dict[str, int], int]:
        """The variables and rows above: their objective terms (coefficient, variable), the variables by
        name, and how many rows. `gradient_bytes`: at least the bytes the composer's buckets pack;
        `micro_batches`: k (per-micro-batch reductions are in the y's k times, the last bucket once)."""
        out: list[tuple[int, int]] = []
        variables: dict[str, int] = {}
        rows = 0
        grads = self.hideable["allreduce"] + self.hideable["reducescatter"]
        for name, hideable, under in (("exposed_grads", grads, backward_s),
                                      ("exposed_gathers", self.hideable["gathers"], compute_s)):
            if not hideable:
                continue
            bound = sum(ns for _, ns in hideable)
            var = variables[name] = model.int_var(name, 0, bound)
            out.append((1, var))
            cover = [(v, round(t * NS_PER_S)) for d, ts in under.items() for t, v in zip(ts, x[d], strict=True)
                     if round(t * NS_PER_S)]
            if name == "exposed_gathers":
                # E_a = max(E_b, E_f) on three variables: with both bounds' rows on E_a itself, CBC's
                # preprocessing strengthens one row a pass for 10 passes (0.2-0.5 s each)
                beyond, first = model.int_var("beyond_gathers", 0, bound), model.int_var("first_gather", 0, bound)
                model.add(name, [(beyond, 1), *[(y, -ns) for y, ns in hideable], *cover], 0, BIG)
                largest = sorted(self.one_gather.values(), key=lambda ys: -max(ns for _, ns in ys))
                for k, ys in enumerate(largest[:FIRST_GATHER_ROWS]):
                    model.add(f"first_gather[{k}]", [(first, 1), *[(y, -ns) for y, ns in ys]], 0, BIG)
                for part in (beyond, first):
                    model.add(f"exposed_gathers[{model.names[part]}]", [(var, 1), (part, -1)], 0, BIG)
                rows += 3 + len(largest[:FIRST_GATHER_ROWS])
                continue
            model.add(name, [(var, 1), *[(y, -ns) for y, ns in hideable], *cover], 0, BIG)
            rows += 1
            for kind in ("allreduce", "reducescatter"):
                share = (min(1.0, getattr(fusion, kind) / gradient_bytes) if gradient_bytes else 1.0) / micro_batches
                if self.hideable[kind]:
                    model.add(f"last_bucket[{kind}]",
                              [(var, 1), *[(y, -math.ceil(ns * share)) for y, ns in self.hideable[kind]]], 0, BIG)
                    rows += 1
        return out, variables, rows
