"""Sharding rules: for every op, the strategies it can run with — required input specs → output specs.

A rule is written for ONE mesh axis: it lists `AxisStrategy`s, each giving a placement per input and
output (DTensor's single-dim strategies). `strategies_for` expands them to an N-d mesh as the product
over axes, keeps the combinations whose tensors can be split that finely, and always includes the
all-replicated strategy. Rules list placements only; the cost model prices them.

Rules are registered by decorator per ONNX op type (`@register_rule("MatMul", "Gemm")`), one module
per op family; importing this package imports every family. An op with no rule gets the replicated
fallback (inputs gathered, computed everywhere) and is reported; `strict=True` makes that an error.
"""

# Importing a family registers its rules.
from planner.rules import conv, elementwise, gather, image, matmul, norm, reduction, shape  # noqa: F401
from planner.rules.registry import (
    AxisStrategy,
    MissingRuleError,
    NodeStrategies,
    OpContext,
    RuleSet,
    expand,
    follow,
    has_rule,
    register_rule,
    registered_ops,
    replicated_strategy,
    rules_for_graph,
    strategies_for,
)

__all__ = [
    "AxisStrategy",
    "MissingRuleError",
    "NodeStrategies",
    "OpContext",
    "RuleSet",
    "expand",
    "follow",
    "has_rule",
    "register_rule",
    "registered_ops",
    "replicated_strategy",
    "rules_for_graph",
    "strategies_for",
]
