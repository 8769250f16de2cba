"""The facts `meshplan inspect` reports: what the graph is and what one forward pass costs in FLOPs."""

from __future__ import annotations

from collections import Counter
from typing import Any

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
        "notes": list(graph.notes),  # what the import restored or could not recover
    }
