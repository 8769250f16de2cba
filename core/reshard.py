"""Resharding: from one spec of a tensor to another, as the sequence of collectives that does it.

Per mesh axis, placement src → dst:
  S(d) → R      all_gather          P → R       all_reduce
  P → S(d)      reduce_scatter      S(d) → S(e) all_to_all (all_gather + local slice when disabled,
  R → S(d)      local slice (free)                          MindSpore's enable_alltoall=False)
  R → P         local (one rank keeps the value, the others zeros; free)
Order matters when several mesh axes split one tensor dim (placements apply in mesh-axis order, axis 0
first): gathers and reductions run innermost axis first, slices outermost first, and an unchanged
inner axis that splits a dim an outer axis is about to change is gathered and re-split around it.
A fused step (reduce_scatter, all_to_all) is used only where that order allows it.

Each step carries its message size in the nccl-tests convention (all_gather: the gathered output;
reduce_scatter: the input; all_reduce and all_to_all: the buffer), so the cost model prices it and a
plan lists exactly the collectives it runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from core.collectives import Collective
from core.placement import Partial, Placement, R, Replicate, Shard, Spec


@dataclass(frozen=True, slots=True)
class ReshardStep:
    axis: int
    src: Placement
    dst: Placement
    collective: Collective | None  # None: a local op (slice, zero-fill), no communication
    size_bytes: float  # the message (nccl-tests convention); for a local op, the local tensor before it

    def __str__(self) -> str:
        what = self.collective.value if self.collective else "local"
        return f"{what}(axis {self.axis}: {self.src}→{self.dst}, {self.size_bytes:.0f} B)"


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    src: Spec
    dst: Spec
    steps: tuple[ReshardStep, ...]

    @property
    def collectives(self) -> tuple[ReshardStep, ...]:
        return tuple(s for s in self.steps if s.collective is not None)


def _local_bytes(spec: list[Placement], shape: tuple[int, ...], mesh_shape: tuple[int, ...], itemsize: int) -> float:
    return float(math.prod(Spec(tuple(spec)).local_shape(shape, mesh_shape))) * itemsize


def plan_reshard(src: Spec, dst: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...], itemsize: int = 4,
                 *, enable_all_to_all: bool = True) -> ReshardPlan:
    return _plan_reshard(src, dst, tuple(shape), tuple(mesh_shape), itemsize, enable_all_to_all)


@functools.lru_cache(maxsize=1 << 14)
def _plan_reshard(src: Spec, dst: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...], itemsize: int,
                  enable_all_to_all: bool) -> ReshardPlan:
    """`plan_reshard`, memoised (the planner prices the same few reshards for every tied edge)."""
    n = len(mesh_shape)
    if src == dst:
        return ReshardPlan(src, dst, ())
    changing = {a for a in range(n) if src.placements[a] != dst.placements[a] and mesh_shape[a] > 1}
    # An unchanged inner axis that splits a dim an outer changing axis touches must be undone and redone.
    touched: dict[int, set[int]] = {}
    for a in changing:
        for p in (src.placements[a], dst.placements[a]):
            if isinstance(p, Shard):
                touched.setdefault(p.dim, set()).add(a)
    for b in range(n):
        p = src.placements[b]
        if b not in changing and isinstance(p, Shard) and any(a < b for a in touched.get(p.dim, ())):
            changing.add(b)

    # On an axis of one device every placement holds the same data: relabel, nothing moves.
    cur = [dst.placements[a] if mesh_shape[a] == 1 else p for a, p in enumerate(src.placements)]
    steps: list[ReshardStep] = []

    def emit(axis: int, to: Placement, coll: Collective | None, size: float) -> None:
        steps.append(ReshardStep(axis, cur[axis], to, coll, size))
        cur[axis] = to

    # Phase A, innermost axis first: everything that gathers or reduces.
    for a in sorted(changing, reverse=True):
        s, d = cur[a], dst.placements[a]
        local = _local_bytes(cur, shape, mesh_shape, itemsize)
        k = mesh_shape[a]
        # A fused step leaves dim d split at axis a: no outer axis may still gather or slice d after it.
        fused_ok = isinstance(d, Shard) and not any(o < a for o in touched.get(d.dim, ()))
        if isinstance(s, Partial):
            if isinstance(d, Shard) and fused_ok:
                emit(a, d, Collective.REDUCE_SCATTER, local)
            elif isinstance(d, Partial) and d.reduce_op == s.reduce_op:
                continue
            else:
                emit(a, R, Collective.ALL_REDUCE, local)
        elif isinstance(s, Shard):
            if isinstance(d, Shard) and fused_ok and enable_all_to_all:
                emit(a, d, Collective.ALL_TO_ALL, local)
            else:
                emit(a, R, Collective.ALL_GATHER, local * k)
    # Phase B, outermost axis first: local slices and zero-fills.
    for a in sorted(changing):
        d = dst.placements[a]
        if cur[a] == d:
            continue
        assert isinstance(cur[a], Replicate), (src, dst, cur)
        emit(a, d, None, _local_bytes(cur, shape, mesh_shape, itemsize))
    assert tuple(cur) == dst.placements, (src, dst, cur)
    return ReshardPlan(src, dst, tuple(steps))


def conjugate(step: ReshardStep) -> Collective | None:
    """The collective the backward pass runs on a *whole* gradient (identical on the ranks of the axis)
    for a forward step: reduce_scatter ↔ all_gather, all_to_all ↔ all_to_all; after a forward gather
    or all_reduce the whole gradient is sliced or kept locally (nothing moves); a forward slice (R → S)
    gathers the gradient back (the replicated source needs all of it); a forward R → P (a replicated
    value turned into addends) all-reduces it. A *partial* gradient — the consumer split on the axis,
    the tensor replicated for it — is reduced instead (`CostModel.edge_events`: all_gather ↔
    reduce_scatter, FSDP's pattern, or all_reduce)."""
    if step.collective is Collective.REDUCE_SCATTER:
        return Collective.ALL_GATHER
    if step.collective is Collective.ALL_TO_ALL:
        return Collective.ALL_TO_ALL
    if step.collective is None and isinstance(step.dst, Shard):
        return Collective.ALL_GATHER
    if step.collective is None and isinstance(step.dst, Partial):
        return Collective.ALL_REDUCE
    return None
