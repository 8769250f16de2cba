"""The collective vocabulary: kinds, link levels and the α-β (ring) formulas, as data-free facts.

A leaf of the flow (it imports nothing of meshplan): the planner's meshes and reshards, the cost
model, and the hardware profiles' data all speak it. Formulas follow nccl-tests' conventions: a
message of S bytes on n ranks takes steps(n)·α + bus_factor(n)·S/β on a link of bus bandwidth β
(ring all-reduce: 2(n−1)·α + 2(n−1)/n·S/β).
"""

from __future__ import annotations

import enum


class LinkLevel(enum.Enum):
    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"


class Collective(enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"

    def steps(self, n: int) -> int:
        """Latency terms of the ring algorithm on n ranks."""
        if n <= 1:
            return 0
        if self is Collective.ALL_REDUCE:
            return 2 * (n - 1)
        if self is Collective.SEND_RECV:
            return 1
        return n - 1

    def bus_factor(self, n: int) -> float:
        """Bytes each rank moves over its link per byte of message (nccl-tests' bus-bandwidth factor)."""
        if n <= 1:
            return 0.0
        if self is Collective.ALL_REDUCE:
            return 2 * (n - 1) / n
        if self in (Collective.BROADCAST, Collective.SEND_RECV):
            return 1.0
        return (n - 1) / n


def alpha_beta_time_s(kind: Collective, size_bytes: float, num_ranks: int, alpha_s: float,
                      bus_bandwidth_bytes_per_s: float) -> float:
    """Seconds of one collective of `size_bytes` on `num_ranks` ranks over a link with latency α and
    bus bandwidth β (the ring algorithm's terms)."""
    return kind.steps(num_ranks) * alpha_s + kind.bus_factor(num_ranks) * size_bytes / bus_bandwidth_bytes_per_s


class Purpose(enum.Enum):
    """Why a collective runs (the strategy file writes the value)."""

    RESHARD = "reshard"  # a tensor moved to the placement its consumer needs, or its gradient back
    GRAD_SYNC = "grad sync"  # a gradient left partial, all-reduced
    GRAD_REDUCE_SCATTER = "grad reduce-scatter"  # a gradient reduced onto the shards of a gathered tensor
    REGATHER = "re-gather"  # ZeRO-3/FSDP: a freed parameter gathered again for backward
    LOSS = "loss"  # the output brought to where the loss reads it
    PIPELINE_SEND = "pipeline send"  # an activation sent to the next pipeline stage (or its gradient back)
    PIPELINE_RECV = "pipeline recv"


class Phase(enum.Enum):
    """The part of a training step a collective runs in."""

    FORWARD = "forward"
    BACKWARD = "backward"


class Cadence(enum.Enum):
    """How often a collective runs: once per micro-batch (activations, their gradients, a sharded
    parameter's gathers) or once per optimizer step (a parameter's accumulated gradient, reduced once
    after the last micro-batch, as DDP's no_sync and FSDP's gradient accumulation do)."""

    MICRO_BATCH = "per micro-batch"
    STEP = "per step"


def cadence_of(purpose: Purpose, is_param: bool) -> Cadence:
    """A parameter's gradient reduction waits for the last micro-batch; everything else runs in each."""
    if is_param and purpose in (Purpose.GRAD_SYNC, Purpose.GRAD_REDUCE_SCATTER):
        return Cadence.STEP
    return Cadence.MICRO_BATCH
