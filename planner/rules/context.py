"""Context parallelism's designs as the attention products' strategies on the cp axis (`core/context.py`).

An attention chain's products whose queries are split on their tokens over cp read their second operand
(kᵀ, v) whole there: gathered, the all-gather design. Its ring strategy splits that operand on its
tokens too (kᵀ's last dim, v's second-to-last) with the kernel `RING`; the product's output is as
before (the queries' rows). On the cp axis a product keeps only its strategies of the design asked
for — `allgather` those, `ring` their ring ones — so both products of a chain run the same design (the
executor runs the chain as one kernel), and neither splits the heads instead (DeepSpeed-Ulysses' design,
not planned). Under the all-gather design the keys and values are gathered where they are smallest: the
nodes that only move, repeat or scale them on their way to the products (`core/context.key_value_feeds`: grouped-query
attention's repeat, kᵀ's transpose, the scale) run whole on cp, so the gather falls before the repeat,
as Llama-3 gathers its KV heads (`planner/search/build.as_written`, `core/context.GatheredFeeds`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from core.context import RING, cp_axis
from core.graph import OpGraph
from core.levers import CpMethod
from core.mesh import DeviceMesh
from core.placement import OpStrategy, Replicate, Shard, Spec


def context_parallel(strategies: Mapping[str, tuple[OpStrategy, ...]], graph: OpGraph, mesh: DeviceMesh,
                     method: CpMethod, chains: Iterable[tuple[str, str]]) -> dict[str, tuple[OpStrategy, ...]]:
    """The attention products' strategies (of `strategies`, node → its strategies on `mesh`) under
    `method` on the cp axis: node → its new strategies (none without a cp axis). `chains`: each
    attention chain's q·kᵀ and P·v nodes (`costmodel.attention.attention_regions`)."""
    a = cp_axis(mesh)
    out: dict[str, tuple[OpStrategy, ...]] = {}
    if a is None:
        return out
    for first, last in chains:
        for name, keys in ((first, True), (last, False)):
            if name in strategies:
                rank = len(graph.tensors[graph.node_by_name[name].inputs[1]].shape)
                q = len(graph.tensors[graph.node_by_name[name].inputs[0]].shape)
                pairs = [(st, ring) for st in strategies[name]
                         if (ring := _ring(st, a, q - 2, rank - 1 if keys else rank - 2)) is not None]
                if pairs:
                    out[name] = tuple(ring if method is CpMethod.RING else st for st, ring in pairs)
    return out


def _ring(st: OpStrategy, a: int, row: int, dim: int) -> OpStrategy | None:
    """A product's all-gather strategy on axis `a` — its rows (M, the queries' tokens) split, its second
    operand whole — as the ring's: that operand split on its tokens (`dim`), kernel RING; None for any
    other."""
    rows, other = st.input_specs[0], st.input_specs[1]
    if rows is None or other is None or any(st.kernels):
        return None
    m = rows.placements[a]
    if m != Shard(row) or st.output_specs[0].placements[a] != Shard(row) or not isinstance(other.placements[a], Replicate) \
            or any(x == Shard(dim) for x in other.placements):
        return None
    placements = list(other.placements)
    placements[a] = Shard(dim)
    kernels = [""] * len(placements)
    kernels[a] = RING
    return OpStrategy((rows, Spec(tuple(placements)), *st.input_specs[2:]), st.output_specs, tuple(kernels))

