"""The rule registry and the expansion of single-axis rules to a mesh (see the package docstring)."""


from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from core.errors import MeshplanError
from core.graph import OpGraph, OpNode, TensorKind
from core.mesh import DeviceMesh
from core.placement import OpStrategy, Placement, R, Shard, Spec
from planner.rules.experts import expert_parallel


class MissingRuleError(MeshplanError):
    """--strict and some op types have no sharding rule."""


@dataclass(frozen=True, slots=True)
class AxisStrategy:
    """Placements on one mesh axis. `inputs[i] is None`: input i is not placed (a shape or dtype
    operand, or absent). `kernel` names a local computation that differs from the op itself
    (e.g. "masked_gather" for a vocab-parallel embedding), for the executor and the test harness."""

    inputs: tuple[Placement | None, ...]
    outputs: tuple[Placement, ...]
    kernel: str = ""
    even: bool = False  # every sharded dim must divide evenly (views that merge or split dims)


@dataclass(frozen=True)
class OpContext:
    """What a rule may look at: the node, its static shapes, and which inputs are placeable."""

    node: OpNode
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    placeable: tuple[bool, ...]  # False: absent, or a scalar constant
    const_inputs: tuple[object, ...] = ()  # numpy value of small constant inputs, else None
    constant: tuple[bool, ...] = ()  # input i is a constant (its placement is a free local slice)

    @staticmethod
    def of(node: OpNode, graph: OpGraph) -> OpContext:
        def shape_of(t: str) -> tuple[int, ...]:
            return graph.tensors[t].shape if t in graph.tensors else ()

        # Constants with more than one element are placed too (every rank holds them, so a split is a
        # free local slice): a folded attention mask must be split with the batch it is added to.
        placeable = tuple(bool(t) and t in graph.tensors and (graph.tensors[t].kind is not TensorKind.CONSTANT
                                                             or graph.tensors[t].numel > 1)
                          for t in node.inputs)
        return OpContext(node=node, in_shapes=tuple(shape_of(t) for t in node.inputs),
                         out_shapes=tuple(shape_of(t) for t in node.outputs), placeable=placeable,
                         const_inputs=tuple(graph.constant_value(t) if t else None for t in node.inputs),
                         constant=tuple(bool(t) and t in graph.tensors and graph.tensors[t].kind is TensorKind.CONSTANT
                                        for t in node.inputs))

    def rank(self, i: int = 0) -> int:
        return len(self.in_shapes[i])

    def out_rank(self, i: int = 0) -> int:
        return len(self.out_shapes[i])

    def ints_input(self, i: int) -> tuple[int, ...] | None:
        """A small constant int input (axes, split sizes) as a tuple, if its value is known."""
        if i >= len(self.const_inputs) or self.const_inputs[i] is None:
            return None
        return tuple(int(x) for x in np.asarray(self.const_inputs[i]).reshape(-1))

    def axis_attr(self, name: str, default: int, rank: int) -> int:
        a = int(self.node.attr(name, default))  # type: ignore[call-overload]
        return a + rank if a < 0 else a


RuleFn = Callable[[OpContext], Sequence[AxisStrategy]]
_RULES: dict[str, RuleFn] = {}


def register_rule(*op_types: str) -> Callable[[RuleFn], RuleFn]:
    def deco(fn: RuleFn) -> RuleFn:
        for op in op_types:
            if op in _RULES:
                raise RuntimeError(f"two rules for {op}")
            _RULES[op] = fn
        return fn

    return deco


def registered_ops() -> frozenset[str]:
    return frozenset(_RULES)


def has_rule(op_type: str) -> bool:
    return op_type in _RULES


@dataclass(frozen=True)
class NodeStrategies:
    node: OpNode
    strategies: tuple[OpStrategy, ...]
    fallback: bool = False  # no rule: replicated only


@dataclass
class RuleSet:
    """Strategies for every compute node of a graph on a mesh (what the solver chooses from)."""

    mesh: DeviceMesh
    by_node: dict[str, NodeStrategies] = field(default_factory=dict)

    @property
    def fallbacks(self) -> list[OpNode]:
        return [ns.node for ns in self.by_node.values() if ns.fallback]


def replicated_strategy(ctx: OpContext, mesh_ndim: int) -> OpStrategy:
    return OpStrategy(
        input_specs=tuple(Spec.replicated(mesh_ndim) if p else None for p in ctx.placeable),
        output_specs=tuple(Spec.replicated(mesh_ndim) for _ in ctx.out_shapes),
        kernels=("",) * mesh_ndim,
    )


def _fits(spec: Spec, dims: tuple[int, ...], mesh: DeviceMesh, even: bool) -> bool:
    for d, size in enumerate(dims):
        k = spec.num_shards(d, mesh.shape)
        if k > 1 and (size < k or (even and size % k)):
            return False
    return all(not isinstance(p, Shard) or p.dim < len(dims) for p in spec.placements)


def expand(ctx: OpContext, axis_strategies: Sequence[AxisStrategy], mesh: DeviceMesh) -> tuple[OpStrategy, ...]:
    """Single-axis strategies → strategies on every axis of `mesh` (their product), valid ones only."""
    singles = list(dict.fromkeys(axis_strategies))  # ordered, unique
    # (an input every rule strategy leaves unplaced — read for its dtype or shape — unplaced here too)
    unplaced = [bool(singles) and all(s.inputs[i] is None for s in singles) for i in range(len(ctx.placeable))]
    replicated = AxisStrategy(inputs=tuple(R if p and not u else None for p, u in zip(ctx.placeable, unplaced, strict=True)),
                              outputs=tuple(R for _ in ctx.out_shapes))
    if replicated not in singles:
        singles.insert(0, replicated)
    out: dict[OpStrategy, None] = {}
    for combo in itertools.product(singles, repeat=mesh.ndim):
        even = any(c.even for c in combo)
        in_specs: list[Spec | None] = []
        ok = True
        for i, in_dims in enumerate(ctx.in_shapes):
            if not ctx.placeable[i] or combo[0].inputs[i] is None:
                in_specs.append(None)
                continue
            spec = Spec(tuple(c.inputs[i] or R for c in combo))
            if not _fits(spec, in_dims, mesh, even):
                ok = False
                break
            in_specs.append(spec)
        if not ok:
            continue
        out_specs = tuple(Spec(tuple(c.outputs[j] for c in combo)) for j in range(len(ctx.out_shapes)))
        if not all(_fits(s, d, mesh, even) for s, d in zip(out_specs, ctx.out_shapes, strict=True)):
            continue
        out[OpStrategy(tuple(in_specs), out_specs, tuple(c.kernel for c in combo))] = None
    # Strategies that differ only in how a constant is split are one strategy (the slice is free).
    unique: dict[tuple[object, ...], OpStrategy] = {}
    for st in out:
        key = (tuple(sp for sp, c in zip(st.input_specs, ctx.constant or (False,) * len(st.input_specs), strict=True)
                     if not c), st.output_specs, st.kernels)
        unique.setdefault(key, st)
    return tuple(unique.values())


def strategies_for(node: OpNode, graph: OpGraph, mesh: DeviceMesh) -> NodeStrategies:
    ctx = OpContext.of(node, graph)
    rule = _RULES.get(node.op_type)
    if rule is None:
        return NodeStrategies(node, (replicated_strategy(ctx, mesh.ndim),), fallback=True)
    singles = [s for s in rule(ctx) if _arity_ok(s, ctx)]
    return NodeStrategies(node, expand(ctx, singles, mesh))


def _arity_ok(s: AxisStrategy, ctx: OpContext) -> bool:
    assert len(s.inputs) == len(ctx.in_shapes), (ctx.node.op_type, s, ctx.in_shapes)
    assert len(s.outputs) == len(ctx.out_shapes), (ctx.node.op_type, s, ctx.out_shapes)
    return True


def rules_for_graph(graph: OpGraph, mesh: DeviceMesh, *, strict: bool = False) -> RuleSet:
    missing = sorted({n.op_type for n in graph.compute_nodes if not has_rule(n.op_type)})
    if strict and missing:
        raise MissingRuleError(f"no sharding rule for op types {', '.join(missing)}; drop `strict` to run them "
                               "replicated (the fallback) or add rules in planner/rules/")
    rs = RuleSet(mesh=mesh)
    # Repeated layers repeat signatures: expand each distinct (op, attrs, shapes, constants) once.
    seen: dict[tuple[object, ...], NodeStrategies] = {}
    for n in graph.compute_nodes:
        ctx = OpContext.of(n, graph)
        consts = tuple(None if v is None else tuple(np.asarray(v).reshape(-1).tolist()) for v in ctx.const_inputs)
        key = (n.op_type, n.attrs, ctx.in_shapes, ctx.out_shapes, ctx.placeable, consts)
        hit = seen.get(key)
        if hit is None:
            hit = seen[key] = strategies_for(n, graph, mesh)
        rs.by_node[n.name] = NodeStrategies(n, hit.strategies, hit.fallback)
    # an ep axis: the expert gathers' strategies there made expert-parallel
    for name, strategies in expert_parallel({n: ns.strategies for n, ns in rs.by_node.items()}, graph, mesh).items():
        rs.by_node[name] = NodeStrategies(rs.by_node[name].node, strategies, rs.by_node[name].fallback)
    return rs


def follow(ctx: OpContext, dims_in_to_out: Sequence[tuple[int, int]], *, inputs: Sequence[int] = (0,),
           even: bool = False) -> list[AxisStrategy]:
    """Strategies where input dim i (on each listed input) maps to output dim o: Shard(i) → Shard(o)."""
    strategies = []
    for di, do in dims_in_to_out:
        ins = tuple(Shard(di) if k in inputs else (R if ctx.placeable[k] else None) for k in range(len(ctx.in_shapes)))
        strategies.append(AxisStrategy(inputs=ins, outputs=(Shard(do),) * len(ctx.out_shapes), even=even))
    return strategies


# Import every family so that its rules register (order does not matter).
