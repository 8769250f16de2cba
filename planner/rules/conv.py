"""Conv: batch, output-channel and input-channel splits (spatial splits need halos: not offered).

One mesh axis, X[N, Cin, …] * W[Cout, Cin/g, …] + B[Cout] = Y[N, Cout, …]:
  batch  X S(0), W R,    B R    → Y S(0)
  Cout   X R,    W S(0), B S(0) → Y S(1)
  Cin    X S(1), W S(1), B P    → Y P      (group = 1 only: partial sums over input channels)
Depthwise (group = Cin = Cout) splits channels on all three together; each rank then runs a conv
with `group` = its local channel count (kernel "split_groups").
"""

from __future__ import annotations

from core.placement import P, R, Shard
from planner.rules.registry import AxisStrategy, OpContext, register_rule

SPLIT_GROUPS = "split_groups"


@register_rule("Conv")
def conv_rule(ctx: OpContext) -> list[AxisStrategy]:
    group = int(ctx.node.attr("group", 1))  # type: ignore[call-overload]
    has_b = len(ctx.in_shapes) > 2 and bool(ctx.node.inputs[2])
    b = (lambda p: (p,)) if has_b else (lambda p: ())
    x, w = ctx.in_shapes[0], ctx.in_shapes[1]
    out = [AxisStrategy(inputs=(Shard(0), R, *b(R)), outputs=(Shard(0),))]
    if group == 1:
        out.append(AxisStrategy(inputs=(R, Shard(0), *b(Shard(0))), outputs=(Shard(1),)))
        out.append(AxisStrategy(inputs=(Shard(1), Shard(1), *b(P)), outputs=(P,)))
    elif group == x[1] == w[0]:
        out.append(AxisStrategy(inputs=(Shard(1), Shard(0), *b(Shard(0))), outputs=(Shard(1),), kernel=SPLIT_GROUPS,
                                even=True))
    return out
