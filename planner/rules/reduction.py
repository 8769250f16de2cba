"""Reductions and pooling.

  Reduce*(axes)     X S(d), d kept              → Y S(d')   (d' = d less the reduced dims before it)
  ReduceSum         X S(d), d reduced           → Y P       (partial sums)
  ReduceMean        X S(d), d reduced, even     → Y P(avg)  (equal shards: the mean of the means)
  Global*Pool       X S(0) or S(1)              → Y same    (batch, channels)
  MaxPool/AveragePool   as Global*Pool (spatial splits need halos: not offered)
  TopK(axis)        X S(d), d ≠ axis            → values, indices S(d)  (a router's top-k per token)
"""

from __future__ import annotations

from core.placement import Partial, Shard
from planner.rules.registry import AxisStrategy, OpContext, follow, register_rule

REDUCE = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceLogSumExp", "ReduceSumSquare")


def reduced_axes(ctx: OpContext) -> tuple[int, ...]:
    r = ctx.rank()
    axes = ctx.node.attr("axes")
    if axes is None and len(ctx.in_shapes) > 1:
        axes = ctx.ints_input(1)
    if axes is None:  # from shapes: with keepdims the reduced dims are those that became 1
        if int(ctx.node.attr("keepdims", 1)) and ctx.out_rank() == r:  # type: ignore[call-overload]
            return tuple(d for d in range(r) if ctx.out_shapes[0][d] == 1 and ctx.in_shapes[0][d] != 1)
        return tuple(range(r)) if not ctx.node.attr("noop_with_empty_axes", 0) else ()
    return tuple(sorted(int(a) % r for a in axes))  # type: ignore[attr-defined]


@register_rule(*REDUCE)
def reduce_rule(ctx: OpContext) -> list[AxisStrategy]:
    r = ctx.rank()
    axes = reduced_axes(ctx)
    keep = bool(ctx.node.attr("keepdims", 1))
    kept = [(d, d if keep else d - sum(a < d for a in axes)) for d in range(r) if d not in axes]
    out = follow(ctx, kept)
    partial = {"ReduceSum": Partial("sum"), "ReduceMean": Partial("avg")}.get(ctx.node.op_type)
    if partial is not None:
        for a in axes:
            ins = (Shard(a), *(None for _ in ctx.in_shapes[1:]))
            out.append(AxisStrategy(inputs=ins, outputs=(partial,), even=partial.reduce_op == "avg"))
    return out


@register_rule("GlobalAveragePool", "GlobalMaxPool", "MaxPool", "AveragePool", "LpPool", "GlobalLpPool")
def pool_rule(ctx: OpContext) -> list[AxisStrategy]:
    return follow(ctx, [(0, 0), (1, 1)])


@register_rule("TopK")
def topk_rule(ctx: OpContext) -> list[AxisStrategy]:
    axis = ctx.axis_attr("axis", -1, ctx.rank())
    return follow(ctx, [(d, d) for d in range(ctx.rank()) if d != axis])
