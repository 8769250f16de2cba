"""Context parallelism's ring design, as the planner, the cost model and the executor name it.

On an axis named `cp` an attention chain (`costmodel/attention.py`: q·kᵀ → [+ mask] → softmax → ·v)
whose queries are split on their tokens may hold its keys and values split too: each rank computes its
queries against the block of keys and values it holds, passes that block to the next rank of the ring
and takes the previous rank's, cp times, merging the blocks' softmaxes as they come (ring attention).
Its two products then carry the kernel `RING` on the cp axis, with kᵀ split on its tokens (its last
dim) and v on its tokens (its second-to-last) there (`planner/rules/context.py`); without it they read
kᵀ and v whole there (gathered: the all-gather design), gathered where they are smallest — before the
ops that only move, repeat or scale them on their way (`key_value_feeds`: grouped-query attention's
repeat among them), which then run whole on cp, their gradients each rank's addends (`GatheredFeeds`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from core.graph import OpGraph, TensorKind
from core.mesh import DeviceMesh
from core.placement import Replicate, Spec

RING = "ring_attention"
CP_AXIS = "cp"


def cp_axis(mesh: DeviceMesh) -> int | None:
    """The mesh's context-parallel axis (named `cp`, more than one rank), if any."""
    return next((a for a, n in enumerate(mesh.axis_names) if n == CP_AXIS and mesh.shape[a] > 1), None)


# Ops that only move, repeat or scale a tensor (with constants beside it): transformers' `repeat_kv`
# (Unsqueeze → Expand → Reshape), kᵀ's Transpose, the scale folded into kᵀ, autocast's casts.
_FEEDS = frozenset({"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Identity", "Cast", "Mul", "Div"})


def key_value_feeds(graph: OpGraph, chains: Iterable[tuple[str, str]]) -> frozenset[str]:
    """The nodes between each attention chain's keys and values and its products (`chains`: each chain's
    q·kᵀ and P·v nodes) that only move, repeat or scale them: walking back from each product's second
    operand, nodes of those ops with one activation input and constants beside it, that input and the
    output each read by the one node alone; the walk stops at anything else (rotary's add, a
    projection)."""
    readers = Counter(t for n in graph.compute_nodes for t in n.inputs if t)
    out: set[str] = set()
    for first, last in chains:
        for product in (first, last):
            t = graph.node_by_name[product].inputs[1]
            while (p := graph.producer.get(t)) is not None and readers[t] == 1:
                node = graph.node_by_name[p]
                kinds = [graph.tensors[x].kind for x in node.inputs if x and x in graph.tensors]
                acts = [x for x in node.inputs if x in graph.tensors and graph.tensors[x].kind is TensorKind.ACTIVATION]
                if node.op_type not in _FEEDS or len(node.outputs) != 1 or len(acts) != 1 \
                        or kinds.count(TensorKind.CONSTANT) != len(kinds) - 1 or readers[acts[0]] != 1:
                    break
                out.add(p)
                t = acts[0]
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class GatheredFeeds:
    """The all-gather design's keys and values gathered before their feeds (`key_value_feeds`), which run
    whole on the cp axis: each rank's backward through them carries its own queries' share of the keys'
    and values' gradient — an addend, partial on cp. The feeds are linear, so the addends pass back
    through them as they are and are reduce-scattered once, where the gather was (the all-gather's
    transpose, at the smaller, pre-repeat size), not all-reduced at the attention product. One rule for
    the cost model and the executor (`gradient_split`). It holds where the attention products are split
    on cp, as a layout's cp axis makes them (`planner/search/build.as_written`; an axis named cp is
    refused outside a layout: `PlanRequest`). `reads`, `makes`: the tensors the feeds read and
    produce."""

    axis: int
    reads: frozenset[str]
    makes: frozenset[str]

    @staticmethod
    def of(graph: OpGraph, mesh: DeviceMesh, chains: Iterable[tuple[str, str]]) -> GatheredFeeds | None:
        a = cp_axis(mesh)
        if a is None:
            return None
        feeds = [graph.node_by_name[n] for n in key_value_feeds(graph, chains)]
        return GatheredFeeds(a, frozenset(t for n in feeds for t in n.inputs if t),
                             frozenset(t for n in feeds for t in n.outputs if t))

    def gradient_split(self, tensor: str, src: Spec, dst: Spec, split: frozenset[int]) -> frozenset[int]:
        """The axes on which `tensor`'s gradient arrives partial at an edge (`src` → `dst`) whose consumer
        divides its work over `split`: on cp, where the tensor is whole there, partial into a feed (which
        passes it back as it is: an addend) and passed to a feed that made it without a reduction."""
        a = self.axis
        if not isinstance(dst.placements[a], Replicate):
            return split
        if tensor in self.makes and isinstance(src.placements[a], Replicate):
            return split - {a}
        if tensor in self.reads:
            return split | {a}
        return split
