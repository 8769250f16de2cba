"""Context parallelism's causal load balance: each rank's share of a causal attention's work when the
sequence is split over cp ranks.

A causal mask leaves query i the keys 0…i: the score blocks a rank computes grow with the positions of
its queries. Split in cp contiguous chunks, rank r computes r full blocks and half a diagonal one —
(r + ½)/cp² of the s² grid, the last rank (2cp − 1)× the first. The zig-zag order (torch's
`context_parallel` load balancer, Megatron-LM's) cuts the sequence in 2·cp chunks and gives rank r
chunks r and 2cp − 1 − r: (r + ½ + 2cp − 1 − r + ½)/(2cp)² = 1/(2cp) of the grid each, half of 1/cp,
the mean — every rank alike.

The cost model prices a query shard of s/cp rows against all s keys, halved under a causal mask
(`costmodel/flash.py`): exactly the zig-zag share, the order the planned step assumes. (`run` splits
the sequence contiguously and computes every block's scores whole, masked: the same numbers, each
rank twice the causal share.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from core.collectives import Cadence, Collective, Phase, PricedCollective, Purpose
from core.graph import OpGraph, OpNode
from core.mesh import DeviceMesh
from costmodel.comm import collective_time_s
from costmodel.compute import tensor_bytes
from costmodel.device import matmul_time_s
from costmodel.memory import Precision
from hwprofiles.profile import HardwareProfile


def causal_shares(cp: int, *, zigzag: bool = True) -> tuple[float, ...]:
    """Each of `cp` ranks' share of a causal attention's s² score grid (the diagonal's blocks at half)
    with the sequence split in the zig-zag order (2·cp chunks, rank r holding r and 2cp − 1 − r) or in
    cp contiguous chunks."""
    if zigzag:
        return tuple(((r + 0.5) + (2 * cp - 1 - r + 0.5)) / (2 * cp) ** 2 for r in range(cp))
    return tuple((r + 0.5) / cp**2 for r in range(cp))


def zigzag_order(length: int, cp: int) -> list[list[int]]:
    """The token positions each of `cp` ranks holds in the zig-zag order (`length` divisible by 2·cp)."""
    assert length % (2 * cp) == 0, (length, cp)
    c = length // (2 * cp)
    return [[*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)] for r in range(cp)]


def ring_events(node: OpNode, keys: bool, graph: OpGraph, shapes: Mapping[str, tuple[int, ...]], axis: int,
                mesh: DeviceMesh, profile: HardwareProfile, precision: Precision, *, causal: bool, overlap: bool,
                recomputed: bool) -> tuple[PricedCollective, ...]:
    """Ring attention's passes at one of its products (`core/context.py`): its second operand (kᵀ at
    q·kᵀ, `keys`; v at P·v) — its local block, as the product reads it — sent to the next rank of the cp ring cp − 1 times
    forward (the last block is not passed on), and its gradient's blocks cp − 1 times backward, back the
    way they came (as `executor/context.py` runs them); again forward in backward where the layer is
    recomputed. Each pass is priced at what outlasts its share of the block of attention it runs beside
    (`overlap`: the overlapped step, each of the two passes beside half a block, the backward's twice the
    forward's FLOPs; a causal block at the zig-zag order's half), whole otherwise."""
    cp = mesh.shape[axis]
    t = node.inputs[1]
    size = tensor_bytes(graph.tensors[t], shapes[t], precision)
    send = collective_time_s(profile, mesh, Collective.SEND_RECV, size, (axis,)) + (profile.device.reshard_overhead_s or 0.0)
    hidden = 0.0
    if overlap:  # a block: the rank's queries against one block of keys, both products
        a, kv = shapes[node.inputs[0]], shapes[t]
        rows = float(math.prod(a[:-1]))
        inner, cols = (float(kv[-2]), float(kv[-1])) if keys else (float(kv[-1]), float(kv[-2]))
        flops = 2 * 2.0 * rows * inner * cols * (0.5 if causal else 1.0)
        dtype = precision.compute_dtype if precision.compute_dtype in profile.device.peak_flops_per_s else "fp32"
        hidden = matmul_time_s(profile.device, flops, dtype) / 2
    out = []
    for phase, beside in ((Phase.FORWARD, hidden), (Phase.BACKWARD, 2 * hidden)):
        for _ in range(cp - 1):
            out.append(PricedCollective(Collective.SEND_RECV, (axis,), size, max(0.0, send - beside), phase,
                                        Purpose.CONTEXT_PASS, t, Cadence.MICRO_BATCH))
    if recomputed:
        out += [replace(e, phase=Phase.BACKWARD) for e in out[:cp - 1]]
    return tuple(out)
