"""What pricing a step produces, item by item (`step.py` prices, `compose.py` adds up): each collective
(`core.collectives.PricedCollective`, with its phase, purpose and cadence), each node's compute and saved bytes (`NodeCost`,
and the loss's, `LossCost`), and the whole step's items (`PricedStep`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from core.collectives import Cadence, PricedBucket, PricedCollective
from core.levers import Offload
from core.placement import Spec
from costmodel.buckets import CommFusion
from costmodel.compute import ComputeCost


@dataclass(frozen=True, slots=True)
class LossCost:
    """The loss on the model's output, charged to the node producing it (`costmodel/loss.py`)."""
    kind: str
    compute_s: float
    events: tuple[PricedCollective, ...]  # the output brought to where the loss needs it
    saved_bytes: float
    workspace_bytes: float = 0.0  # allocated by its backward beside what it saved (`loss.loss_bytes`)

    @property
    def time_s(self) -> float:
        return self.compute_s + sum(e.time_s for e in self.events)


@dataclass(frozen=True, slots=True)
class NodeCost:
    compute: ComputeCost
    activation_bytes: float  # its saved outputs, local (and the loss's, on the output's producer)
    loss: LossCost | None = None
    # In a recomputed layer: its forward again in backward, and what it would have saved (live only
    # while its layer's backward runs); `activation_bytes` is then the layer's input it keeps, if any.
    recompute_s: float = 0.0
    recomputed_bytes: float = 0.0
    # Collectives inside the op (expert parallelism's dispatch and combine all-to-alls), both passes.
    events: tuple[PricedCollective, ...] = ()

    @property
    def time_s(self) -> float:
        return self.compute.total_s + self.recompute_s + (self.loss.time_s if self.loss is not None else 0.0) \
            + sum(e.time_s for e in self.events)

    @property
    def compute_s(self) -> float:
        """`time_s` less the loss's collectives: the step's compute, as the composer counts it."""
        return self.compute.total_s + self.recompute_s + (self.loss.compute_s if self.loss is not None else 0.0)


@dataclass(frozen=True, slots=True)
class HostCopy:
    """One copy over the device's host link: of an offloaded parameter (`ModelStates.host_copies`), an
    input's rows (`full_batch`), or a layer's saved activations (`host_activations.py`)."""

    tensor: str
    what: str  # "weights to device" (for a use, or after the host's optimizer step), "gradient to host"
    size_bytes: float
    time_s: float
    cadence: Cadence
    hideable: bool  # runs under compute on its own copy engine: a weight fetched ahead of its use, a gradient
    # copied out as backward goes on (not: the weights copied back after the optimizer step, before the next)


@dataclass
class PricedStep:
    """What one step's work costs, item by item, before composition (`compose.py` adds it up)."""

    micro_batches: int = 1  # gradient accumulation steps: per-micro-batch items run this many times
    node_compute_s: dict[str, float] = field(default_factory=dict)  # forward + backward (+ the loss's kernels)
    backward_s: float = 0.0  # of that, one micro-batch's backward (recomputation included): what overlaps
    params: frozenset[str] = frozenset()  # the parameters (their gathers and reductions may overlap)
    fusion: CommFusion = field(default_factory=CommFusion)  # the bucket caps its gradient collectives were packed by
    events: list[PricedCollective] = field(default_factory=list)  # every collective, in node order
    node_events: dict[str, list[PricedCollective]] = field(default_factory=dict)  # the same, by the node charged
    optimizer_s: dict[str, float] = field(default_factory=dict)  # per parameter, its local shard's update
    optimizer_fixed_s: float = 0.0  # per step (a calibrated optimizer's fixed cost)
    overhead_s: float = 0.0  # the executor's fixed host cost per step
    rank_skew: float = 0.0  # the profile's: a synchronising step waits this fraction of its compute
    memory: dict[str, dict[str, float]] = field(default_factory=dict)  # category → owner → bytes per device
    flops_matmul: float = 0.0  # per device, forward + backward
    placed: dict[str, Spec] = field(default_factory=dict)  # every tensor's spec as produced (or stored)
    reshards: list[tuple[str, str, Spec, Spec, tuple[PricedCollective, ...]]] = field(default_factory=list)
    zero_stages: dict[str, int] = field(default_factory=dict)  # parameter → its ZeRO-1/2 stage, where applied
    buckets: list[PricedBucket] = field(default_factory=list)  # the packed gradient collectives (`bucketing.py`)
    # Offloaded parameters (`core.levers.Offload`): where each one's states live, its copies over the host
    # link, and the bytes it holds in host memory (its device bytes are in `memory`).
    offload: dict[str, Offload] = field(default_factory=dict)
    host_copies: list[HostCopy] = field(default_factory=list)
    host_memory: dict[str, float] = field(default_factory=dict)
    host_activations: dict[str, int] = field(default_factory=dict)  # layer group → layers saving to the host

    def replace_events(self, by_id: Mapping[int, Sequence[PricedCollective]]) -> None:
        """Each event whose id is a key replaced by its events, in the step's list and its node's."""
        if by_id:
            self.events = [x for e in self.events for x in by_id.get(id(e), (e,))]
            self.node_events = {n: [x for e in evs for x in by_id.get(id(e), (e,))]
                                for n, evs in self.node_events.items()}
