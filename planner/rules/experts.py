"""Expert parallelism as a mesh axis: on an axis named `ep`, a mixture-of-experts block's expert
gathers (`core/experts.py`) run split — each rank holds E/ep of the experts (their weights split on
the experts' dim) and the tokens routed to them, sent there and back by all-to-alls
(`costmodel/experts.py` prices them at the block's first gather). Every other op treats `ep` as any
axis (a layout makes it data-parallel: torchtitan's ep borrows its ranks from dp_shard).

On the ep axis, each data-parallel strategy of an expert gather — the weights whole, the looked-up rows
split — becomes its expert-parallel one: the weights split on their experts' dim too, kernel
`EXPERT_PARALLEL`; its other strategies are dropped there, so an ep axis always holds the experts split.
"""

from __future__ import annotations

from dataclasses import replace

from core.experts import EXPERT_PARALLEL, ep_axis, find_expert_blocks
from core.graph import OpGraph
from core.placement import OpStrategy, Replicate, Shard, Spec
from planner.rules.registry import RuleSet


def expert_parallel(rules: RuleSet, graph: OpGraph) -> RuleSet:
    """`rules` with each expert gather's strategies on the ep axis made expert-parallel (unchanged on a
    mesh without one, or for a gather whose weights' experts' dim the axis does not divide)."""
    a = ep_axis(rules.mesh)
    if a is None:
        return rules
    for block in find_expert_blocks(graph):
        for name in block.gathers:
            ns = rules.by_node.get(name)
            node = graph.node_by_name[name]
            data = graph.tensors[node.inputs[0]].shape
            key = "axis" if node.op_type == "Gather" else "batch_dims"
            expert_dim = int(node.attr(key, 0))  # type: ignore[call-overload]
            if ns is None or node.op_type not in ("Gather", "GatherND") or len(data) <= expert_dim \
                    or data[expert_dim] != block.num_experts:
                continue
            split = tuple(s for st in ns.strategies if (s := _split(st, a, expert_dim, data, rules.mesh.shape)))
            if split:
                rules.by_node[name] = replace(ns, strategies=split)
    return rules


def _split(st: OpStrategy, a: int, expert_dim: int, data: tuple[int, ...], mesh: tuple[int, ...]) -> OpStrategy | None:
    """A gather's data-parallel strategy on axis `a` (weights whole, rows split) as expert-parallel."""
    w, rows = st.input_specs[0], st.input_specs[1]
    if w is None or rows is None or not isinstance(w.placements[a], Replicate) \
            or not isinstance(rows.placements[a], Shard):
        return None
    placements = list(w.placements)
    placements[a] = Shard(expert_dim)
    spec = Spec(tuple(placements))
    if data[expert_dim] % spec.num_shards(expert_dim, mesh):
        return None
    kernels = list(st.kernels or ("",) * len(mesh))
    kernels[a] = EXPERT_PARALLEL
    return OpStrategy((spec, *st.input_specs[1:]), st.output_specs, tuple(kernels))
