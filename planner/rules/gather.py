"""Gather family: embeddings and index selection.

Gather(data, indices, axis) = Y with shape data[:axis] + indices.shape + data[axis+1:]:
  data S(d), d ≠ axis; indices R  → Y S(d or d + rank(indices) − 1)
  data R; indices S(j)            → Y S(axis + j)             (tokens split: data parallel)
  data S(axis); indices R         → Y P, kernel masked_gather (vocab-parallel embedding: each rank
                                     looks up the ids in its row range and writes zeros elsewhere)
GatherElements(axis): data and indices S(d), d ≠ axis → Y S(d).
GatherND(batch_dims=b), indices [..., m], Y = indices[:-1] + data[b + m:]:
  data and indices S(d), d < b                  → Y S(d)
  data R; indices S(j), b ≤ j < rank(indices) − 1 → Y S(j)   (rows looked up split: data parallel)
  data S(d), d ≥ b + m; indices R               → Y S(rank(indices) − 1 + d − b − m)
An expert gather's split over the `ep` axis (data and indices split) is `planner/rules/experts.py`'s.

Scatters write updates into a copy of data; a dim no index addresses splits all three alike:
ScatterND, indices [..., m], updates indices[:-1] + data[m:]  (an exporter's `x[..., a:b] = y`):
  data S(d), d ≥ m; indices R; updates S(rank(indices) − 1 + d − m) → Y S(d)
ScatterElements(axis): data, indices and updates S(d), d ≠ axis       → Y S(d)
Both, reduction add, or none with known indices writing no place twice:
  data P, indices R, updates P                                         → Y P   (linear in both)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from core.placement import P, R, Shard
from planner.rules.registry import AxisStrategy, OpContext, register_rule

MASKED_GATHER = "masked_gather"


@register_rule("Gather")
def gather_rule(ctx: OpContext) -> list[AxisStrategy]:
    data, idx = ctx.in_shapes
    axis = ctx.axis_attr("axis", 0, len(data))
    idx_placed = ctx.placeable[1]
    idx_r = R if idx_placed else None
    out = []
    for d in range(len(data)):
        if d == axis:
            continue
        y_dim = d if d < axis else d + len(idx) - 1
        out.append(AxisStrategy(inputs=(Shard(d), idx_r), outputs=(Shard(y_dim),)))
    if idx_placed:
        for j in range(len(idx)):
            out.append(AxisStrategy(inputs=(R if ctx.placeable[0] else None, Shard(j)), outputs=(Shard(axis + j),)))
    if ctx.placeable[0]:
        out.append(AxisStrategy(inputs=(Shard(axis), idx_r), outputs=(P,), kernel=MASKED_GATHER))
    return out


@register_rule("GatherElements")
def gather_elements_rule(ctx: OpContext) -> list[AxisStrategy]:
    data, idx = ctx.in_shapes
    axis = ctx.axis_attr("axis", 0, len(data))
    return [AxisStrategy(inputs=(Shard(d), Shard(d) if ctx.placeable[1] else None), outputs=(Shard(d),))
            for d in range(len(data)) if d != axis and data[d] == idx[d]]


@register_rule("GatherND")
def gather_nd_rule(ctx: OpContext) -> list[AxisStrategy]:
    b = int(ctx.node.attr("batch_dims", 0))  # type: ignore[call-overload]
    data, idx = ctx.in_shapes
    out = [AxisStrategy(inputs=(Shard(d), Shard(d) if ctx.placeable[1] else None), outputs=(Shard(d),))
           for d in range(b)]
    if not idx or idx[-1] <= 0:
        return out
    m, q = idx[-1], len(idx)
    if ctx.placeable[1]:
        out += [AxisStrategy(inputs=(R if ctx.placeable[0] else None, Shard(j)), outputs=(Shard(j),))
                for j in range(b, q - 1)]
    if ctx.placeable[0]:
        out += [AxisStrategy(inputs=(Shard(d), R if ctx.placeable[1] else None), outputs=(Shard(q - 1 + d - b - m),))
                for d in range(b + m, len(data))]
    return out


def _partial_scatter(ctx: OpContext, rows: Callable[[np.ndarray], np.ndarray]) -> list[AxisStrategy]:
    """Y is linear in (data, updates) jointly when writes add, or overwrite each place once (indices known,
    `rows(indices)` the places written, none twice: which duplicate wins is undefined): addends scatter alike."""
    reduction = str(ctx.node.attr("reduction", "none"))
    if reduction not in ("none", "add") or not (ctx.placeable[0] and ctx.placeable[2]):
        return []
    if reduction == "none":
        idx = ctx.const_inputs[1] if len(ctx.const_inputs) > 1 else None
        if idx is None:
            return []
        places = rows(np.asarray(idx))
        if len(np.unique(places, axis=0)) != len(places):
            return []
    return [AxisStrategy(inputs=(P, R if ctx.placeable[1] else None, P), outputs=(P,))]


@register_rule("ScatterND")
def scatter_nd_rule(ctx: OpContext) -> list[AxisStrategy]:
    data, idx, _ = ctx.in_shapes
    if not idx or idx[-1] <= 0 or not (ctx.placeable[0] and ctx.placeable[2]):
        return []
    m, q = idx[-1], len(idx)
    idx_r = R if ctx.placeable[1] else None
    out = [AxisStrategy(inputs=(Shard(d), idx_r, Shard(q - 1 + d - m)), outputs=(Shard(d),))
           for d in range(m, len(data))]
    return out + _partial_scatter(ctx, lambda i: i.reshape(-1, i.shape[-1]))


@register_rule("ScatterElements")
def scatter_elements_rule(ctx: OpContext) -> list[AxisStrategy]:
    data, idx, upd = ctx.in_shapes
    axis = ctx.axis_attr("axis", 0, len(data))
    if not (ctx.placeable[0] and ctx.placeable[2]):
        return []
    idx_s = (lambda d: Shard(d)) if ctx.placeable[1] else (lambda d: None)
    out = [AxisStrategy(inputs=(Shard(d), idx_s(d), Shard(d)), outputs=(Shard(d),))
           for d in range(len(data)) if d != axis and data[d] == idx[d] == upd[d]]

    def places(i: np.ndarray) -> np.ndarray:  # each index's full coordinate, its axis's taken from it
        grid = np.indices(i.shape).reshape(i.ndim, -1).T
        grid[:, axis] = (i % data[axis]).reshape(-1)
        return grid

    return out + _partial_scatter(ctx, places)
