"""A compiled runtime's kernels (`--runtime compiled`: torch.compile's Inductor): every connected chain
of the ops between matmuls — element-wise ops, norms, reductions, views, casts, with no matmul on a
path between two of its ops — runs as one fused kernel, which reads the chain's inputs from memory and writes only what leaves it; what stays inside
is neither written nor saved for backward (the backward recomputes it inside its own fused kernel).
Matmuls, attention chains and embedding lookups stay kernels of their own, the chains' boundaries.

Per node (`FusedNode`): the inputs that come from outside its chain, the outputs that leave it, and
whether it is the chain's first node (which pays the one launch). Chains are graph properties, so a
node is priced alone, as the ILP needs."""

from __future__ import annotations

from dataclasses import dataclass, replace

from core.graph import OpGraph
from core.levers import Runtime
from costmodel.attention import attention_regions
from costmodel.memory import Precision

# Kernels of their own: libraries' GEMMs and convolutions, FlashAttention, gathers.
UNFUSED = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Gather", "GatherElements", "ScatterND",
                     "ScatterElements"})


@dataclass(frozen=True, slots=True)
class FusedNode:
    chain: int
    external_inputs: frozenset[str]  # read from memory: produced outside the chain (or a graph input)
    external_outputs: frozenset[str]  # written to memory: read outside the chain, or a graph output
    head: bool  # the chain's first node: its launch

    def reads(self, tensor: str) -> bool:
        return tensor in self.external_inputs


def fusion_chains(graph: OpGraph) -> dict[str, FusedNode]:
    """Node → its place in a fused chain, for every node a compiled runtime fuses."""
    in_attention = {n for r in attention_regions(graph).values() for n in r.nodes}
    fusible = {n.name for n in graph.compute_nodes if n.op_type not in UNFUSED and n.name not in in_attention}
    producer = {t: n.name for n in graph.compute_nodes for t in n.outputs if t}
    consumers: dict[str, list[str]] = {}
    for n in graph.compute_nodes:
        for t in n.inputs:
            if t:
                consumers.setdefault(t, []).append(n.name)
    # A node's level: the unfused kernels on the longest path to it. Two fusible nodes fuse only at the
    # same level — between a residual add and the next one runs a matmul, which no kernel spans.
    level: dict[str, int] = {}
    for n in graph.compute_nodes:
        level[n.name] = max((level[p] + (p not in fusible) for t in n.inputs if t
                             for p in (producer.get(t),) if p is not None), default=0)
    # Chains: connected components of fusible nodes over the tensors between them (union-find).
    parent = {n: n for n in fusible}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in graph.compute_nodes:
        if n.name not in fusible:
            continue
        for t in n.inputs:
            p = producer.get(t) if t else None
            if p in fusible and level[p] == level[n.name]:
                parent[root(p)] = root(n.name)
    chain_of = {n: root(n) for n in fusible}
    ids = {r: i for i, r in enumerate(dict.fromkeys(chain_of[n.name] for n in graph.compute_nodes if n.name in fusible))}
    outputs = set(graph.outputs)
    out: dict[str, FusedNode] = {}
    seen: set[str] = set()
    for n in graph.compute_nodes:
        if n.name not in fusible:
            continue
        c = chain_of[n.name]
        ext_in = frozenset(t for t in n.inputs if t and chain_of.get(producer.get(t, "")) != c)
        ext_out = frozenset(t for t in n.outputs if t and (t in outputs or any(
            chain_of.get(m) != c for m in consumers.get(t, ()))))
        out[n.name] = FusedNode(chain=ids[c], external_inputs=ext_in, external_outputs=ext_out, head=c not in seen)
        seen.add(c)
    return out


def internal_tensors(graph: OpGraph, chains: dict[str, FusedNode]) -> frozenset[str]:
    """The tensors that never leave their chain: not written, not saved."""
    out: set[str] = set()
    for n in graph.compute_nodes:
        f = chains.get(n.name)
        if f is not None:
            out.update(t for t in n.outputs if t and t not in f.external_outputs)
    return frozenset(out)


def compiled(graph: OpGraph, precision: Precision,
             runtime: Runtime) -> tuple[dict[str, FusedNode], frozenset[str], Precision]:
    """A compiled runtime's chains, the tensors they keep inside, and `precision` without autocast's
    casts of activations a chain produces (each part of that chain's kernel); eager: none."""
    if runtime is not Runtime.COMPILED:
        return {}, frozenset(), precision
    chains = fusion_chains(graph)
    if precision.cast_inputs:
        chained = {t for n in graph.compute_nodes if n.name in chains for t in n.outputs}
        precision = replace(precision, cast_inputs={n: tuple(t for t in ts if t not in chained)
                                                    for n, ts in precision.cast_inputs.items()})
    return chains, internal_tensors(graph, chains), precision
