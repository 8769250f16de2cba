"""Normalisations and softmax: split any dim the op does not normalise over.

  Softmax(axis)              X S(d), d ≠ axis                         → Y S(d)
  LayerNormalization(axis)   X S(d), d < axis; scale, bias R          → Y, mean, inv_std S(d)
  RMSNormalization(axis)     as LayerNormalization
  BatchNormalization         X S(d), d ≠ 1; scale, B, mean, var R     → Y S(d)
                             X S(1); scale, B, mean, var S(0)         → Y S(1)   (channels)
BatchNormalization is priced with its inference form, per-channel affine, which is what exports of a
model in eval mode contain; a training-mode node (running-stat outputs) only splits channels.
The decomposed RMSNorm pattern of exports (Pow → ReduceMean → Add → Sqrt → Reciprocal → Mul → Mul) is
covered by the element-wise and reduction rules, node by node.
"""

from __future__ import annotations

from core.placement import R, Shard
from planner.rules.registry import AxisStrategy, OpContext, follow, register_rule


@register_rule("Softmax", "LogSoftmax")
def softmax_rule(ctx: OpContext) -> list[AxisStrategy]:
    r = ctx.rank()
    axis = ctx.axis_attr("axis", -1, r)
    return follow(ctx, [(d, d) for d in range(r) if d != axis])


@register_rule("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization")
def layer_norm_rule(ctx: OpContext) -> list[AxisStrategy]:
    r = ctx.rank()
    axis = ctx.axis_attr("axis", -1, r)
    return follow(ctx, [(d, d) for d in range(axis)])


@register_rule("BatchNormalization")
def batch_norm_rule(ctx: OpContext) -> list[AxisStrategy]:
    params = tuple(R if p else None for p in ctx.placeable[1:])
    channel = AxisStrategy(inputs=(Shard(1), *(Shard(0) if p else None for p in ctx.placeable[1:])),
                           outputs=(Shard(1),) + (Shard(0),) * (len(ctx.out_shapes) - 1))
    if len(ctx.out_shapes) > 1:  # training mode: batch statistics are outputs
        return [channel]
    spatial = [AxisStrategy(inputs=(Shard(d), *params), outputs=(Shard(d),)) for d in range(ctx.rank()) if d != 1]
    return [*spatial, channel]
