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

from collections.abc import Mapping

from core.experts import EXPERT_PARALLEL, ep_axis, expert_dim, find_expert_blocks, splits_over
from core.graph import OpGraph
from core.mesh import DeviceMesh
from core.placement import OpStrategy, Replicate, Shard, Spec


def expert_parallel(strategies: Mapping[str, tuple[OpStrategy, ...]], graph: OpGraph,
                    mesh: DeviceMesh) -> dict[str, tuple[OpStrategy, ...]]:
    """The expert gathers' strategies (of `strategies`, node → its strategies on `mesh`) made
    expert-parallel on the ep axis: node → its new strategies (none on a mesh without one, or for a
    block the axis cannot split). `planner/rules/registry.rules_for_graph` applies them."""
    a = ep_axis(mesh)
    out: dict[str, tuple[OpStrategy, ...]] = {}
    if a is None:
        return out
    for block in find_expert_blocks(graph):
        if not splits_over(graph, block, mesh.shape[a]) or any(g not in strategies for g in block.gathers):
            continue
        split: dict[str, tuple[OpStrategy, ...]] = {}
        for name in block.gathers:
            d = expert_dim(graph, name)
            kept = tuple(s for st in strategies[name] if (s := _split(st, a, d)))
            if not kept:
                break
            split[name] = kept
        else:
            out.update(split)
    return out


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
