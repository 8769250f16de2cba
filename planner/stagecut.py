"""The pipeline's stage cut: which model chunk and stage each compute node runs in, what crosses
between stages, which stages read each parameter. One module for the search that makes the cut
(planner/search/pipeline.py) and the executor that runs it (executor/pipeline.py)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.errors import MeshplanError
from core.graph import OpGraph, TensorKind
from planner.strategy_pipeline import Pipeline

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class Cut:
    """Where each compute node runs: its chunk (0 … p·v − 1) and stage (chunk mod p)."""

    stages: int
    virtual: int
    chunk_of: dict[str, int]
    layers_per_chunk: tuple[int, ...]

    def stage_of(self, node: str) -> int:
        return self.chunk_of[node] % self.stages

    @property
    def node_stage(self) -> dict[str, int]:
        return {n: c % self.stages for n, c in self.chunk_of.items()}


def cut(graph: OpGraph, p: int, v: int = 1, counts: list[int] | None = None) -> Cut:
    """`counts`: layers per chunk (default: even, the extra layers to the middle chunks)."""
    if not graph.layers:
        raise MeshplanError(f"`layout` pp={p}: pipeline stages cut the repeated layers, and {graph.name} has none "
                            "meshplan recognises; plan without pp")
    group = max(graph.layers, key=lambda g: g.num_layers)
    n_layers = group.num_layers
    if p > n_layers:
        raise MeshplanError(f"`layout` pp={p}: more stages than the {n_layers} repeated layers of {group.prefix}; "
                            f"use pp ≤ {n_layers}")
    chunks = p * v
    if v > 1 and n_layers % chunks:
        raise MeshplanError(f"`layout` vpp={v}: {n_layers} layers over {p} stages × {v} chunks do not divide evenly "
                            f"(each chunk needs the same layers); pick vpp dividing {n_layers // p if n_layers % p == 0 else n_layers}/pp")
    if counts is None:
        base, extra = divmod(n_layers, chunks)
        # Extra layers to the middle chunks: the first and last carry the embedding and the head.
        order = sorted(range(chunks), key=lambda c: (c in (0, chunks - 1), abs(c - (chunks - 1) / 2)))
        counts = [base + (1 if c in order[:extra] else 0) for c in range(chunks)]
    layer_chunk: list[int] = [c for c in range(chunks) for _ in range(counts[c])]
    chunk_of: dict[str, int] = {}
    in_layer = {n: layer_chunk[i] for i, names in enumerate(group.nodes) for n in names}
    current = 0
    for node in graph.compute_nodes:
        current = in_layer.get(node.name, current)
        chunk_of[node.name] = current
    return Cut(stages=p, virtual=v, chunk_of=chunk_of, layers_per_chunk=tuple(counts))


def strategy_chunks(graph: OpGraph, pipeline: Pipeline) -> dict[str, int]:
    """A pipelined strategy's cut: each compute node's chunk, from its stages' (first node, last node)
    ranges (chunk j of stage s is model chunk j·p + s), walked in the graph's order as `cut` made them."""
    p = len(pipeline.stages)
    starts = {first: j * p + s for s, st in enumerate(pipeline.stages) for j, (first, _) in enumerate(st.chunks)}
    missing = sorted(set(starts) - set(graph.node_by_name))
    if missing:
        raise MeshplanError(f"the strategy's pipeline starts a chunk at node {missing[0]}, which {graph.name} lacks; "
                            "plan again for this model")
    out: dict[str, int] = {}
    current = 0
    for node in graph.compute_nodes:
        current = starts.get(node.name, current)
        out[node.name] = current
    return out


@dataclass(frozen=True)
class Crossing:
    """A tensor a later model chunk reads: sent from chunk `src` (a graph input: from the first, which
    the data loader feeds) across every boundary up to chunk `last`, the last that reads it; a float
    one's gradient comes back the same way."""

    tensor: str
    src: int
    last: int
    grad: bool

    def crosses(self, boundary: int) -> bool:
        """Sent from chunk `boundary` to chunk `boundary + 1`."""
        return self.src <= boundary < self.last


def crossings(graph: OpGraph, chunk_of: dict[str, int]) -> list[Crossing]:
    """What the stages send each other, in the graph's order (inputs first, then by producer)."""
    last: dict[str, int] = {}
    for node in graph.compute_nodes:
        for t in node.inputs:
            if t:
                last[t] = max(last.get(t, -1), chunk_of[node.name])
    out = []
    order = [*graph.inputs, *(t for n in graph.compute_nodes for t in n.outputs)]
    for t in order:
        info = graph.tensors.get(t)
        if info is None or t not in last or info.kind not in (TensorKind.INPUT, TensorKind.ACTIVATION):
            continue
        src = chunk_of.get(graph.producer.get(t, ""), -1) if info.kind is TensorKind.ACTIVATION else 0
        if src >= 0 and last[t] > src:
            out.append(Crossing(tensor=t, src=src, last=last[t], grad=info.is_float))
    return out


def param_stages(graph: OpGraph, chunk_of: dict[str, int], p: int) -> dict[str, tuple[int, ...]]:
    """The stages that read each parameter (one, except tied weights: the embedding and the LM head)."""
    out: dict[str, set[int]] = defaultdict(set)
    for node in graph.compute_nodes:
        for t in node.inputs:
            if t in graph.parameters:
                out[t].add(chunk_of[node.name] % p)
    return {t: tuple(sorted(s)) for t, s in out.items()}
