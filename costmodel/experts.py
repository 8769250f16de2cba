"""Mixture-of-experts blocks priced as training runs them (`core/experts.py` finds them). An export
writes each routed slot's expert weights gathered (`[tokens × top-k, out, in]`) and multiplied in one
batched matmul, a GEMV per slot; a training step runs a grouped GEMM instead (Megatron's, torchtitan's
`_grouped_mm`): per expert one GEMM of the tokens routed to it, the expert's weights read once, nothing
gathered. So the gathers and views between the weights and the matmul cost nothing and hold no memory
(a view of a parameter), and the matmul is priced as the grouped GEMM: its FLOPs (2 · slots · out · in,
and the same again per gradient), at the efficiency of a GEMM whose narrowest dim is the tokens an
expert gets — its uniform share times the capacity factor, whose slowest expert bounds the kernel —,
no faster than reading the tokens and every expert's weights.

Expert parallelism (an `ep` mesh axis: `EXPERT_PARALLEL`, the kernel of an expert gather split there)
places E/ep experts on each rank of the axis: each rank sends every routed slot's token to its expert's
rank and gets the expert's output back — after one all-to-all of its per-expert counts, two of
slots × hidden a micro-batch, and two in backward (each gradient back the way it came), each at the
slowest rank's share: the capacity factor times the uniform one. Its grouped GEMM then runs its E/ep experts on ep ranks' tokens: ep times the
tokens per expert, E/ep experts' weights read; its expert weights' gradients are reduced only over the
ranks holding the same experts (the parameters are split over ep, so none is partial there)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from core.collectives import Cadence, Collective, Phase, PricedCollective, Purpose
from core.experts import ExpertBlock, expert_matmuls, find_expert_blocks
from core.graph import OpGraph, OpNode
from core.mesh import DeviceMesh
from costmodel.comm import collective_time_s
from costmodel.compute import (
    BACKWARD_BYTES_FACTOR,
    BACKWARD_FLOPS_FACTOR,
    ComputeCost,
    tensor_bytes,
    with_launch,
)
from costmodel.device import matmul_time_s
from costmodel.memory import Precision
from hwprofiles.profile import HardwareProfile

NO_COST = ComputeCost(fwd_flops=0.0, fwd_matmul_flops=0.0, bwd_matmul_flops=0.0, fwd_bytes=0.0, fwd_s=0.0, bwd_s=0.0)


class ExpertOps:
    """The graph's expert matmuls (node → its block and its gathered operand's index) and the gathers
    and views feeding them their weights (`views`, their outputs `view_tensors`)."""

    def __init__(self, graph: OpGraph) -> None:
        self.blocks = find_expert_blocks(graph)
        self.matmuls: dict[str, tuple[ExpertBlock, int]] = {}
        views: set[str] = set()
        # each gathered view as the experts' weights it stands for: [E, …] in place of [slots, …]
        self.weight_shapes: dict[str, tuple[int, ...]] = {}
        for b in self.blocks:
            mm, chain = expert_matmuls(graph, b)
            self.matmuls.update((n, (b, i)) for n, i in mm.items())
            views |= chain
            self.weight_shapes.update((t, (b.num_experts, *graph.tensors[t].shape[1:])) for n in chain
                                      for t in graph.node_by_name[n].outputs if t and graph.tensors[t].shape)
        self.views = frozenset(views)
        self.view_tensors = frozenset(t for n in views for t in graph.node_by_name[n].outputs if t)
        # each block's first gather carries its dispatch and combine under expert parallelism
        self.dispatch = {b.gathers[0]: b for b in self.blocks if b.gathers}
        self.hidden = {b.topk: block_hidden(graph, b) for b in self.blocks}


def block_hidden(graph: OpGraph, block: ExpertBlock) -> int:
    """The width of a token a block routes: its router's weight's other dim than the experts'; else the
    widest dim every expert weight has (gate-up [E, 2F, h] and down [E, h, F] share h)."""
    for p in block.router:
        shape = graph.tensors[p].shape
        if len(shape) == 2 and block.num_experts in shape:
            return shape[1] if shape[0] == block.num_experts else shape[0]
    shared = set.intersection(*(set(graph.tensors[p].shape[1:]) for p in block.experts))
    return max(shared or {d for p in block.experts for d in graph.tensors[p].shape[1:]})


def dispatch_events(slots: float, hidden: int, experts: int, axis: int, mesh: DeviceMesh, profile: HardwareProfile,
                    precision: Precision, capacity_factor: float, tensor: str) -> tuple[PricedCollective, ...]:
    """A block's all-to-alls under expert parallelism over `axis`, one micro-batch: first each rank's
    count of slots for every expert (`experts` int64s), then the tokens — `slots` routed slots a rank
    sends (tokens × top-k), each of `hidden` values — there and back, and both again in backward; each
    token exchange priced at the receiving side of the most loaded rank (the capacity factor times the
    uniform share)."""
    overhead = profile.device.reshard_overhead_s or 0.0
    counts = PricedCollective(Collective.ALL_TO_ALL, (axis,), experts * 8.0, collective_time_s(
        profile, mesh, Collective.ALL_TO_ALL, experts * 8.0, (axis,)) + overhead, Phase.FORWARD,
        Purpose.EXPERT_DISPATCH, tensor, Cadence.MICRO_BATCH)
    size = slots * hidden * precision.activation_bytes
    t = collective_time_s(profile, mesh, Collective.ALL_TO_ALL, size * capacity_factor, (axis,)) + overhead
    return (counts, *(PricedCollective(Collective.ALL_TO_ALL, (axis,), size, t, phase, purpose, tensor, Cadence.MICRO_BATCH)
                      for phase in (Phase.FORWARD, Phase.BACKWARD)
                      for purpose in (Purpose.EXPERT_DISPATCH, Purpose.EXPERT_COMBINE)))


def grouped_gemm_cost(node: OpNode, block: ExpertBlock, operand: int, graph: OpGraph,
                      shapes: Mapping[str, tuple[int, ...]], profile: HardwareProfile, precision: Precision,
                      needs_grad: frozenset[str], capacity_factor: float, ep: int = 1) -> ComputeCost:
    """An expert matmul (`operand`: its gathered weights' input) as the grouped GEMM of its block, on
    `ep` expert-parallel ranks (E/ep experts here, each with the tokens of ep ranks)."""
    w = shapes[node.inputs[operand]]
    slots, out_dim, in_dim = float(math.prod(w[:-2])), float(w[-2]), float(w[-1])
    flops = 2.0 * slots * out_dim * in_dim
    dev = profile.device
    dtype = precision.compute_dtype if precision.compute_dtype in dev.peak_flops_per_s else "fp32"
    per_expert = max(1.0, slots * capacity_factor * ep / block.num_experts)
    narrow = min(per_expert, out_dim, in_dim) if dev.matmul_narrow_efficiency is not None else None
    mm_s = matmul_time_s(dev, flops * capacity_factor, dtype, narrow)
    tokens = sum(tensor_bytes(graph.tensors[t], shapes[t], precision) for i, t in enumerate(node.inputs)
                 if t and i != operand) + sum(tensor_bytes(graph.tensors[t], shapes[t], precision)
                                              for t in node.outputs if t)
    weights = block.num_experts / ep * out_dim * in_dim * precision.moved_weight_bytes
    mem_s = (tokens + weights) / dev.mem_bandwidth_bytes_per_s
    grads = sum(1 for t in node.inputs[:2] if t in needs_grad)
    fwd = with_launch(max(mm_s, mem_s), dev.graph_op_s, dev.async_launch)
    bwd = with_launch(max(grads * mm_s, BACKWARD_BYTES_FACTOR * mem_s), BACKWARD_FLOPS_FACTOR * dev.graph_op_s,
                      dev.async_launch) if grads else 0.0
    return ComputeCost(fwd_flops=flops, fwd_matmul_flops=flops, bwd_matmul_flops=grads * flops,
                       fwd_bytes=tokens + weights, fwd_s=fwd, bwd_s=bwd)
