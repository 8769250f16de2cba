"""The facts `meshplan inspect` reports: what the graph is and what one forward pass costs in FLOPs."""

from __future__ import annotations

from collections import Counter
from typing import Any

from core.experts import CAPACITY_FACTOR, active_params, find_expert_blocks
from core.graph import OpGraph
from costmodel.flops import graph_flops


def graph_summary(graph: OpGraph) -> dict[str, Any]:
    """One JSON-ready dict; the keys are the contract of `inspect --json`."""
    flops = graph_flops(graph)
    ops = Counter(n.op_type for n in graph.compute_nodes)

    def io(names: tuple[str, ...]) -> list[dict[str, Any]]:
        return [{"name": t, "shape": list(graph.tensors[t].shape), "dtype": graph.tensors[t].dtype} for t in names]

    return {
        "model": graph.name,
        "opset": graph.opset,
        "fingerprint": graph.fingerprint,
        "dims": graph.dims,
        "nodes": len(graph.nodes),
        "compute_nodes": len(graph.compute_nodes),
        "constant_nodes": len(graph.constant_nodes),
        "op_types": dict(ops.most_common()),
        "parameters": graph.num_params,
        "parameter_tensors": len(graph.params),
        "parameter_bytes": graph.param_bytes,
        "flops_forward": flops.matmul,
        "flops_forward_other": flops.other,
        "inputs": io(graph.inputs),
        "outputs": io(graph.outputs),
        "layers": [
            {"prefix": g.prefix, "indices": list(g.indices), "num_layers": g.num_layers,
             "nodes_per_layer": g.nodes_per_layer}
            for g in graph.layers
        ],
        "experts": experts_summary(graph),
        "notes": list(graph.notes),  # what the import restored or could not recover
    }


def experts_summary(graph: OpGraph) -> dict[str, Any] | None:
    """The graph's mixture-of-experts blocks (`core/experts.py`), or None for a dense model."""
    blocks = find_expert_blocks(graph)
    if not blocks:
        return None

    def numel(names: tuple[str, ...]) -> int:
        return sum(graph.tensors[p].numel for p in names)

    return {
        "blocks": len(blocks),
        "num_experts": sorted({b.num_experts for b in blocks}),
        "top_k": sorted({b.top_k for b in blocks}),
        "routed_parameters": sum(numel(b.experts) for b in blocks),
        "shared_parameters": sum(numel(b.shared) for b in blocks),
        "router_parameters": sum(numel(b.router) for b in blocks),
        "active_parameters": active_params(graph, blocks),
        "capacity_factor": CAPACITY_FACTOR,
        "routing": f"assumed uniform: each expert sized for its share of the tokens x {CAPACITY_FACTOR:g}",
        "modules": [b.module for b in blocks],
    }
