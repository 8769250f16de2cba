"""The rules' local kernels in torch: where a rule runs an op on a shard as something other than the op
itself (`planner/rules`' kernel names), what each rank computes."""

from __future__ import annotations

from typing import Any

import torch

from core.graph import OpGraph, OpNode
from core.placement import chunk
from executor.ops import run_op
from planner.rules.conv import SPLIT_GROUPS
from planner.rules.gather import MASKED_GATHER


def run_local(node: OpNode, x: list[Any], kernels: list[str], coords: tuple[tuple[int, int], ...],
              graph: OpGraph) -> list[Any]:
    """`node` on this rank's local inputs `x`, with the kernel each mesh axis names (`coords`: each
    axis's size and this rank's index on it)."""
    if node.op_type == "SequenceAt":
        return [x[0][int(x[1])]]
    if MASKED_GATHER in kernels:
        return [masked_gather(node, x, kernels, coords, graph)]
    if SPLIT_GROUPS in kernels:
        groups = x[0].shape[1]
        local = OpNode(name=node.name, op_type=node.op_type, inputs=node.inputs, outputs=node.outputs,
                       attrs=tuple((k, groups if k == "group" else v) for k, v in node.attrs))
        return run_op(local, x)
    return run_op(node, x)


def masked_gather(node: OpNode, x: list[Any], kernels: list[str], coords: tuple[tuple[int, int], ...],
                  graph: OpGraph) -> torch.Tensor:
    """Vocab-parallel lookup: ids outside this rank's rows read zeros (the output is partial)."""
    data, idx = x
    axis = int(node.attr("axis", 0))  # type: ignore[call-overload]
    lo, n = 0, graph.tensors[node.inputs[0]].shape[axis]
    for a, kernel in enumerate(kernels):
        if kernel == MASKED_GATHER:
            start, n = chunk(n, *coords[a])
            lo += start
    local = idx - lo
    inside = (local >= 0) & (local < n)
    out = torch.index_select(data, axis, torch.where(inside, local, 0).reshape(-1))
    out = out.reshape(*data.shape[:axis], *idx.shape, *data.shape[axis + 1:])
    mask = inside.reshape(*([1] * axis), *idx.shape, *([1] * (data.dim() - axis - 1)))
    return out * mask.to(out.dtype)
