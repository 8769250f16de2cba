"""Image ops beyond convolution: local response normalisation and resizing.

  LRN                  X S(d), d ≠ 1 (its window spans channels)          → Y S(d)
  Upsample / Resize    X S(0) or S(1) (batch, channels); scales, roi,      → Y same
                       sizes not placed (spatial splits would need halos)
"""

from __future__ import annotations

from core.placement import Shard
from planner.rules.registry import AxisStrategy, OpContext, register_rule


@register_rule("LRN")
def lrn_rule(ctx: OpContext) -> list[AxisStrategy]:
    return [AxisStrategy(inputs=(Shard(d),), outputs=(Shard(d),)) for d in range(ctx.rank()) if d != 1]


@register_rule("Upsample", "Resize")
def resize_rule(ctx: OpContext) -> list[AxisStrategy]:
    rest = (None,) * (len(ctx.in_shapes) - 1)
    return [AxisStrategy(inputs=(Shard(d), *rest), outputs=(Shard(d),)) for d in (0, 1)]
