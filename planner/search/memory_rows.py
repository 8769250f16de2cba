"""The sharding ILP's memory rows (`ShardingILP`'s, split out): the memory limit at the step's peak,
one row per binding pipeline stage and one at the end of backward, and the infeasibility check that
needs no solver (the row is separable: its minimum is the sum of per-decision minima)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from core.levers import Offload
from costmodel.step import CostModel
from planner.search.decisions import KIB, Decision, InfeasiblePlanError, MemoryFloorError, ParamDecision
from planner.search.milp import LinearModel
from planner.search.offload import LayerOffload
from planner.search.recompute import BIG, GroupTerms

# The price of 1 KiB over the memory limit in the objective (ns): 1 s per MiB, beyond any step time a
# plan could gain by it in practice; a solution that pays it is solved again with the limit hard.
OVER_NS_PER_KIB = 10**6
# The most excess a soft memory row may carry (a layout priced fitting or not; `MemoryRows._over`),
# unless the limit is larger: 2e9 KiB (1.9 TiB). A row held to the limit carries at most the limit.
# Measured (CBC): the stage model that aborted its simplex (excess bounded at 9.95e9 KiB) solves capped at
# 2e9, 1.2e9, 1e8 or 7e7 KiB; GPT-145B's own plan on 1536 A100 takes 20 s with held rows capped at the
# limit, 112 s at 2e9; Llama-3-8B's search on 8x8 (bound 1.15e9) 3.9 s capped at its limit, 3.6 s at 2e9.
EXCESS_CAP_KIB = 2 * 10**9


class MemoryRows:
    """Mixed into `ShardingILP`, which sets these."""

    decisions: dict[Decision, int]
    x: dict[Decision, list[int]]
    model: LinearModel
    constraint_counts: dict[str, int]
    layer_terms: dict[str, GroupTerms]
    memory_limit_bytes: float | None
    floor_limit_bytes: float | None
    gradients_held: bool
    stage_mem: list[dict[Decision, list[float]]]
    end_mem: dict[Decision, list[float]]
    over_vars: list[int]  # each memory row's excess over the limit, KiB (`_over`)
    memory_soft: bool  # the rows priced, never held (a layout priced fitting or not)
    offload: Offload
    offload_terms: dict[tuple[int, Offload], LayerOffload]
    act_groups: list[LayerOffload]
    cost: CostModel

    def _check_floor(self, mem: dict[Decision, list[float]]) -> None:
        """No plan fits if even every tensor split as far as its rules allow (and every layer recomputed,
        where the ILP may) does not: the memory row is separable, its minimum the sum of per-decision
        minima (a pipeline's: each stage's row)."""
        if self.floor_limit_bytes is None:
            return
        if self.stage_mem:  # each stage's row apart
            for i in self._binding_stages():
                floor = self.min_memory_bytes(self.stage_mem[i])
                if floor > self.floor_limit_bytes:
                    raise InfeasiblePlanError(
                        f"memory: pipeline stage {i} needs at least {floor / 2**30:.1f} GiB per device but "
                        f"`memory_limit_gib` is {self.floor_limit_bytes / 2**30:.1f} GiB; raise `memory_limit_gib`, add "
                        "stages or devices, or recompute")
            return
        peak = self._with_all_recomputed(self._with_all_offloaded(mem, "saved_kib"))
        states = self.min_memory_bytes({d: bs for d, bs in peak.items() if isinstance(d, ParamDecision)})
        activations = self.min_memory_bytes({d: bs for d, bs in peak.items() if not isinstance(d, ParamDecision)})
        end = self.min_memory_bytes(self._with_all_offloaded(self.end_mem, "saved_end_kib"))
        floor = max(states + activations, end)
        if floor > self.floor_limit_bytes:
            raise MemoryFloorError(
                f"memory: the plan needs at least {floor / 2**30:.1f} GiB per device (every tensor split as far "
                f"as its rules allow) but `memory_limit_gib` is {self.floor_limit_bytes / 2**30:.1f} GiB; raise "
                f"`memory_limit_gib`{self._offload_hint()} or add devices", parts=((states, activations, end),))

    def _offload_hint(self) -> str:
        """Where states could go to the host and the plan does not let them: the lever that would."""
        return ", offload model states to the host (`offload` auto)," if (
            self.offload is Offload.NONE and self.cost.profile.host is not None) else ","

    def add_memory(self, mem: dict[Decision, list[float]], extra: Sequence[tuple[int, int]] = (),
                   end_extra: Sequence[tuple[int, int]] = ()) -> None:
        """The memory row (one per pipeline stage); `extra`: (variable, KiB) terms of the recomputation and
        offload counts; `end_extra`: the offload counts' in the end-of-backward row."""
        if self.memory_limit_bytes is None:
            return
        rows = dict(enumerate(self.stage_mem or [mem]))
        if self.stage_mem:
            rows = {i: self.stage_mem[i] for i in self._binding_stages()}
        for i, row in rows.items():  # (each stage's floor checked before the edges: `_check_floor`)
            terms = [(x, math.ceil(b / KIB)) for v, bs in row.items() for b, x in zip(bs, self.x[v], strict=True) if b]
            over = self._over(f"memory_over[{i}]" if self.stage_mem else "memory_over", row, extra)
            self.model.add(f"memory[{i}]" if self.stage_mem else "memory", [*terms, *extra, (over, -1)], -BIG,
                           int(self.memory_limit_bytes // KIB))
            self.constraint_counts["memory"] += 1
        if not self.gradients_held:
            terms = [(x, math.ceil(b / KIB)) for v, bs in self.end_mem.items() for b, x in zip(bs, self.x[v], strict=True)
                     if b]
            over = self._over("memory_over[end of backward]", self.end_mem, end_extra)
            self.model.add("memory[end of backward]", [*terms, *end_extra, (over, -1)], -BIG,
                           int(self.memory_limit_bytes // KIB))
            self.constraint_counts["memory"] += 1

    def _over(self, name: str, row: dict[Decision, list[float]], extra: Sequence[tuple[int, int]]) -> int:
        """A row's excess over the limit (KiB), priced `OVER_NS_PER_KIB` in the objective: every rounding of
        the relaxation is then a solution, which CBC's heuristics otherwise fail to find on tight rows
        (Llama-3-70B, 8x8, 1 micro-step, recomputation counted: no solution in 60 s). A solution with
        excess 0 is optimal for the rows held hard; one with any excess is solved again so (`solve`).
        The excess is capped at the limit on rows held to it, at EXCESS_CAP_KIB or the limit (the larger)
        on soft ones (a plan further over is no solution): bounded only by the most every choice could
        hold — a giant tensor whole on every device, ten terabytes —, CBC's simplex aborted the process
        (CoinError: GPT-145B on 1536 A100, a pipeline stage's ILP)."""
        assert self.memory_limit_bytes is not None
        limit = int(self.memory_limit_bytes // KIB)
        most = sum(math.ceil(max(bs) / KIB) for bs in row.values() if bs) + \
            sum(c * self.model.bounds.get(v, (0, 1))[1] for v, c in extra if c > 0)
        bound = min(most - limit, max(limit, EXCESS_CAP_KIB) if self.memory_soft else limit)
        over = self.model.int_var(name, 0, max(1, bound))  # (CP-SAT: no overflow)
        self.over_vars.append(over)
        return over

    def hold_memory_hard(self) -> None:
        """Every row's excess bounded to 0: the limit a hard constraint again."""
        for v in self.over_vars:
            self.model.bounds[v] = (0, 0)

    def _binding_stages(self) -> list[int]:
        """The pipeline stages whose memory rows are not implied by another's: row i is implied by row j
        when each of its coefficients is at most j's (every variable is 0/1, the recomputation terms the
        same in both), so the ILP keeps j's alone — exactly the same feasible set. Under 1F1B the first
        stage holds the most micro-batches of the same layers and implies every middle stage of no more
        layers; deep pipelines keep two or three rows of p."""
        keys = list(self.decisions)
        flat = np.array([[b for d in keys for b in row[d]] for row in self.stage_mem])
        kept: list[int] = []
        for i in sorted(range(len(flat)), key=lambda i: -float(flat[i].sum())):
            if not any(np.all(flat[i] <= flat[j]) for j in kept):
                kept.append(i)
        return sorted(kept)

    def _with_all_recomputed(self, mem: dict[Decision, list[float]]) -> dict[Decision, list[float]]:
        """Each choice's memory less what recomputing every layer of its group, or saving its activations
        on the host, could save (the more of the two: a lower bound for the infeasibility check, the
        transient layer left out)."""
        saved: dict[int, float] = defaultdict(float)
        for terms in {id(t): t for t in self.layer_terms.values()}.values():
            for var, kib in terms.saved_kib.items():
                saved[var] += max(kib, 0.0) * KIB * terms.layers
        on_host: dict[int, float] = defaultdict(float)
        for g in self.act_groups:
            for var, kib in g.saved_kib.items():
                on_host[var] += max(kib, 0.0) * KIB * g.layers
        for var, b in on_host.items():
            saved[var] = max(saved[var], b)
        return {d: [b - saved.get(x, 0.0) for b, x in zip(bs, self.x[d], strict=True)] for d, bs in mem.items()}

    def _with_all_offloaded(self, mem: dict[Decision, list[float]], row: str) -> dict[Decision, list[float]]:
        """Each choice's memory less the most offloading every layer under any mode could free (`row`: the
        terms' peak or end-of-backward savings; a lower bound for the infeasibility check)."""
        saved: dict[int, float] = defaultdict(float)
        for terms in self.offload_terms.values():
            layers = terms.layers
            for var, kib in getattr(terms, row).items():
                saved[var] = max(saved[var], max(kib, 0.0) * KIB * layers)
        if not saved:
            return mem
        return {d: [b - saved.get(x, 0.0) for b, x in zip(bs, self.x[d], strict=True)] for d, bs in mem.items()}

    @staticmethod
    def min_memory_bytes(mem: dict[Decision, list[float]]) -> float:
        return sum(min(bs) for bs in mem.values() if bs)

