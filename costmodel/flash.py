"""FlashAttention priced where a profile measured it (`DeviceSpec.attention_forward`/`_backward`,
fitted by `hwprofiles/measured.py` from an H100's SDPA timings): one kernel per chain, forward and
backward, at the chain's last node; without those curves the chain's FLOPs are priced as matmuls
(`compute.py`, scores on chip)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from core.graph import OpGraph, OpNode
from costmodel.attention import AttentionRegion
from costmodel.compute import ComputeCost, cast_s, with_launch
from costmodel.memory import Precision
from hwprofiles.profile import DeviceSpec


def flash_s(device: DeviceSpec, probs: tuple[int, ...], head_dim: float, causal: bool) -> tuple[float, float]:
    """FlashAttention's forward and backward on a local shard whose score tensor is `probs` (b, h, s_q,
    s_k), at the profile's measured rates (`DeviceSpec.attention_forward`/`_backward`): its forward
    FLOPs 4·b·h·s_q·s_k·d, halved when causal. Each is one kernel; a launch on a GPU overlaps it."""
    assert device.attention_forward is not None and device.attention_backward is not None
    flops = 4.0 * float(np.prod(probs, dtype=np.float64)) * head_dim * (0.5 if causal else 1.0)
    seq = float(probs[-1])
    out = []
    for curve in (device.attention_forward, device.attention_backward):
        out.append(with_launch(curve.time_s(flops, seq, head_dim, causal), device.kernel_launch_s, device.async_launch))
    return out[0], out[1]


def flash_cost(device: DeviceSpec, precision: Precision, graph: OpGraph, node: OpNode, region: AttentionRegion,
               shapes: Mapping[str, tuple[int, ...]], compute: ComputeCost, causal: bool) -> ComputeCost:
    """A node of a FlashAttention chain where the profile measured the kernel: its time at the chain's
    last node (P·V: the score tensor's local shape and v's head dim; `causal`: its mask is,
    `attention.causal_regions`), with autocast's casts of fp32 q, k and v; the other nodes keep their FLOPs, no time."""
    if node.name != region.nodes[-1]:
        return replace(compute, fwd_s=0.0, bwd_s=0.0)
    probs, v = shapes[node.inputs[0]], shapes[region.v]
    fwd, bwd = flash_s(device, probs, float(v[-1]), causal)
    casts = (precision.cast_inputs or {}).get(node.name, ())
    if casts:  # at their local size: v's global-to-local ratio
        local = float(np.prod(v, dtype=np.float64)) / graph.tensors[region.v].numel
        c_fwd, c_bwd = cast_s(device, sum(graph.tensors[t].numel * local for t in casts))
        fwd, bwd = fwd + c_fwd, bwd + c_bwd
    return replace(compute, fwd_s=fwd, bwd_s=bwd)
