"""Element-wise ops, from one table: every dim of the output follows the inputs that have it.

With broadcasting (numpy rules, right-aligned), an input that lacks a dim or has size 1 there is
replicated on that split. Partial passes through the ops that are linear in it:
  Add/Sub   P ± P → P            Neg, Identity   P → P
  Mul       P · R → P, R · P     Div             P / R → P
  Sum/Mean  P, …, P → P          (variadic, any number of inputs)
Inputs the table marks as "not placed" (Dropout's ratio, CastLike's dtype source, Clip's bounds)
take no placement and cost nothing.
"""

from __future__ import annotations

from core.placement import P, Placement, R, Shard
from planner.rules.registry import AxisStrategy, OpContext, register_rule

UNARY = (
    "Identity", "Neg", "Abs", "Relu", "LeakyRelu", "Elu", "Selu", "Tanh", "Sigmoid", "HardSigmoid", "Erf",
    "Gelu", "Softplus", "Sqrt", "Reciprocal", "Exp", "Log", "Sin", "Cos", "Floor", "Ceil", "Round", "Sign",
    "IsNaN", "IsInf", "Not", "Cast", "CastLike", "Dropout", "Clip", "HardSwish", "Mish",
)
BINARY = (
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Equal", "Less", "LessOrEqual", "Greater",
    "GreaterOrEqual", "And", "Or", "Xor", "Where", "PRelu", "BitwiseAnd", "BitwiseOr",
)
# Variadic: any number of same-role inputs, broadcast together; linear, so partial sums pass through.
VARIADIC = ("Sum", "Mean")
# The first input is the data; the others, when present, are parameters of the op, not placed.
_DATA_ONLY = {"CastLike": 1, "Dropout": 1, "Clip": 1}
_LINEAR_UNARY = frozenset({"Identity", "Neg"})


def _dims_strategies(ctx: OpContext, data_inputs: int) -> list[AxisStrategy]:
    y = ctx.out_shapes[0]
    n_out = len(ctx.out_shapes)
    out = []
    for d in range(len(y)):
        if y[d] <= 1:
            continue
        ins: list[Placement | None] = []
        for i, shape in enumerate(ctx.in_shapes):
            if i >= data_inputs or not ctx.placeable[i]:
                ins.append(None)
                continue
            k = d - (len(y) - len(shape))
            ins.append(Shard(k) if k >= 0 and shape[k] == y[d] else R)
        # Extra outputs (Dropout's mask) have the output's shape.
        out.append(AxisStrategy(inputs=tuple(ins), outputs=(Shard(d),) * n_out))
    return out


@register_rule(*UNARY)
def unary_rule(ctx: OpContext) -> list[AxisStrategy]:
    data_inputs = _DATA_ONLY.get(ctx.node.op_type, len(ctx.in_shapes))
    out = _dims_strategies(ctx, data_inputs)
    if ctx.node.op_type in _LINEAR_UNARY:
        out.append(AxisStrategy(inputs=(P,), outputs=(P,) * len(ctx.out_shapes)))
    return out


@register_rule(*BINARY)
def binary_rule(ctx: OpContext) -> list[AxisStrategy]:
    out = _dims_strategies(ctx, len(ctx.in_shapes))
    op = ctx.node.op_type
    # Partial sums are offered on computed operands only: turning a constant into addends is legal
    # but never useful, and would blur which strategy an operand's spec selects.
    placed = tuple(p and not (ctx.constant and ctx.constant[i]) for i, p in enumerate(ctx.placeable))

    def other(i: int) -> Placement | None:
        return R if ctx.placeable[i] else None  # a constant operand is the same on every rank

    if op in ("Add", "Sub") and all(placed[:2]):  # a constant addend would be added k times
        out.append(AxisStrategy(inputs=(P, P), outputs=(P,)))
    if op in ("Mul", "Div") and placed[0]:
        out.append(AxisStrategy(inputs=(P, other(1)), outputs=(P,)))
    if op == "Mul" and placed[1]:
        out.append(AxisStrategy(inputs=(other(0), P), outputs=(P,)))
    return out


@register_rule(*VARIADIC)
def variadic_rule(ctx: OpContext) -> list[AxisStrategy]:
    out = _dims_strategies(ctx, len(ctx.in_shapes))
    if all(p and not (ctx.constant and ctx.constant[i]) for i, p in enumerate(ctx.placeable)):
        out.append(AxisStrategy(inputs=(P,) * len(ctx.in_shapes), outputs=(P,)))  # Σ of partials, each rank's share
    return out
