"""The collective vocabulary: kinds, link levels and the α-β (ring) formulas, as data-free facts.

A leaf of the flow (it imports nothing of meshplan): the planner's meshes and reshards, the cost
model, and the hardware profiles' data all speak it. Formulas follow nccl-tests' conventions: a
message of S bytes on n ranks takes steps(n)·α + bus_factor(n)·S/β on a link of bus bandwidth β
(ring all-reduce: 2(n−1)·α + 2(n−1)/n·S/β).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
    PARAM_GATHER = "param all-gather"  # ZeRO-1/2: the updated shards gathered back after the optimizer step
    PIPELINE_SEND = "pipeline send"  # an activation sent to the next pipeline stage (or its gradient back)
    PIPELINE_RECV = "pipeline recv"
    EXPERT_DISPATCH = "expert dispatch"  # expert parallelism: each routed token sent to its expert's rank
    EXPERT_COMBINE = "expert combine"  # and its expert's output brought back
    CONTEXT_PASS = "context pass"  # ring attention: a block of keys or values passed to the next cp rank


class Phase(enum.Enum):
    """The part of a training step a collective runs in."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"  # around the optimizer step (ZeRO-1/2's gather of updated parameters)


class Cadence(enum.Enum):
    """How often a collective runs: once per micro-batch (activations, their gradients, a parameter
    gathered for use and its gradient reduced back by the runtime in backward, as FSDP does) or once
    per optimizer step (the bucketed gradient all-reduce of a parameter used where it is stored,
    after the last micro-batch, as DDP's no_sync does; ZeRO-1's reduce-scatter and gather)."""

    MICRO_BATCH = "per micro-batch"
    STEP = "per step"


def cadence_of(purpose: Purpose, is_param: bool) -> Cadence:
    """A parameter's gradient all-reduce waits for the last micro-batch; everything else runs in each.
    (A parameter that is also moved to another placement for use has all its collectives in each
    micro-batch: the pricing of a whole plan knows that, and corrects it.)"""
    if is_param and purpose is Purpose.GRAD_SYNC:
        return Cadence.STEP
    return Cadence.MICRO_BATCH


@dataclass(frozen=True, slots=True)
class PricedCollective:
    """One collective a plan runs, priced: its kind, the mesh axes it spans (by index), its message
    (bytes per rank) and time, when it runs (phase, cadence), why (purpose) and for which tensor.
    The cost model makes them; the strategy file records them (the axes by name there)."""

    kind: Collective
    axes: tuple[int, ...]
    size_bytes: float
    time_s: float
    phase: Phase
    purpose: Purpose
    tensor: str
    cadence: Cadence = Cadence.MICRO_BATCH


# A parameter's collectives that run packed into buckets with other parameters' when it is used where
# it is stored (`costmodel.bucketing`): its gradient all-reduce, ZeRO's reduce-scatter and gather.
BUCKETED = frozenset({(Collective.ALL_REDUCE, Purpose.GRAD_SYNC), (Collective.REDUCE_SCATTER, Purpose.GRAD_REDUCE_SCATTER),
                      (Collective.ALL_GATHER, Purpose.PARAM_GATHER)})


@dataclass(frozen=True, slots=True)
class PricedBucket:
    """One bucketed gradient collective as a rank runs it: parameters' gradient all-reduces (or ZeRO's
    reduce-scatters and gathers) packed together, on one mesh axis, with the time the cost model gave
    it. The strategy file records them (`cost.buckets`); the executor's expected counts read them.
    `stage`: the pipeline stage whose ranks run it (0 without a pipeline)."""

    kind: Collective
    axes: tuple[int, ...]
    size_bytes: float
    time_s: float
    cadence: Cadence
    tensors: tuple[str, ...]
    stage: int = 0

