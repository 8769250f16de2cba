"""Expert parallelism as a mesh axis: on an axis named `ep`, a mixture-of-experts block's expert
gathers (`core/experts.py`) run split — each rank holds E/ep of the experts (their weights split on
the experts' dim) and the tokens routed to them, sent there and back by all-to-alls
(`costmodel/experts.py` prices them at the block's first gather). Every other op treats `ep` as any
axis (a layout makes it data-parallel: torchtitan's ep borrows its ranks from dp_shard).

On the ep axis, each data-parallel strategy of an expert gather — the weights whole, the looked-up rows
split — becomes its expert-parallel one: the weights split on their experts' dim too, kernel
`EXPERT_PARALLEL`; its other strategies are dropped there, and those splitting the experts' dim over
another axis too. A block's gathers split all or none (`core.experts.splits_over`).
"""

from __future__ import annotations

from dataclasses import replace

from core.experts import EXPERT_PARALLEL, ep_axis, expert_dim, find_expert_blocks, splits_over
from core.graph import OpGraph
from core.placement import OpStrategy, Replicate, Shard, Spec
from planner.rules.registry import NodeStrategies, RuleSet


def expert_parallel(rules: RuleSet, graph: OpGraph) -> RuleSet:
    """`rules` with each expert gather's strategies on the ep axis made expert-parallel (unchanged on a
    mesh without one, or for a block the axis cannot split)."""
    a = ep_axis(rules.mesh)
    if a is None:
        return rules
    for block in find_expert_blocks(graph):
        if not splits_over(graph, block, rules.mesh.shape[a]) or any(g not in rules.by_node for g in block.gathers):
            continue
        split: dict[str, NodeStrategies] = {}
        for name in block.gathers:
            ns = rules.by_node[name]
            d = expert_dim(graph, name)
            kept = tuple(s for st in ns.strategies if (s := _split(st, a, d)))
            if not kept:
                break
            split[name] = replace(ns, strategies=kept)
        else:
            rules.by_node.update(split)
    return rules


def _split(st: OpStrategy, a: int, expert_dim: int) -> OpStrategy | None:
    """A gather's data-parallel strategy on axis `a` (weights whole, rows split, the experts' dim split
    on no other axis) as expert-parallel."""
    w, rows = st.input_specs[0], st.input_specs[1]
    if w is None or rows is None or not isinstance(w.placements[a], Replicate) \
            or not isinstance(rows.placements[a], Shard) or any(k for k in st.kernels) \
            or any(p == Shard(expert_dim) for p in w.placements):
        return None
    placements = list(w.placements)
    placements[a] = Shard(expert_dim)
    kernels = list(st.kernels or ("",) * len(placements))
    kernels[a] = EXPERT_PARALLEL
    return OpStrategy((Spec(tuple(placements)), *st.input_specs[1:]), st.output_specs, tuple(kernels))
