"""The step composer: from priced items (`PricedStep`) to one training step's time and memory.

Pricing (`costmodel/step.py`) says what each piece of work costs alone — every node's compute, every
collective with its phase, purpose and cadence, every parameter's optimizer update and states, every
saved activation. Composing says how those pieces add up into a step, and that is a policy:

  serial   nothing overlapped: step = k × (compute + per-micro-batch communication) + per-step
           communication + optimizer + the executor's fixed cost, for k accumulation steps (the
           graph is bound at one micro-step's batch); memory = every item by category, and the
           most the step holds at once (`peak_bytes`). A step with collectives
           also waits for its slowest rank: the profile's rank skew × compute, counted as exposed
           communication (ranks meet at each collective; 0 where the profile measured none).

  overlap  `serial` less what DDP and FSDP hide under compute on GPUs (`overlap` below); the
           gloo executor here runs every collective synchronously, so it is checked against serial.

Pipeline bubbles are a further policy over the same items: policies change how items are counted,
not how they are priced.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.collectives import Cadence, Collective, PricedCollective, Purpose
from core.levers import Composer, lever

if TYPE_CHECKING:
    from core.placement import Spec
    from costmodel.items import PricedStep


@dataclass(frozen=True)
class StepCost:
    """A composed step: its totals, the policy that composed them, and the items they came from."""

    priced: PricedStep
    policy: str
    compute_s: float  # forward + backward of every op (and the loss); the optimizer step apart
    comm_s: float  # exposed: what the step waits for
    optimizer_s: float
    overhead_s: float  # the executor's fixed host cost per step (the profile's step_overhead_s)
    memory: Mapping[str, float] = field(default_factory=dict)  # bytes per device by category
    hidden_comm_s: float = 0.0  # communication that runs under compute (not in the step time)
    host_s: float = 0.0  # offloaded parameters' copies over the host link the step waits for (`host_copies`)
    hidden_host_s: float = 0.0  # those that run under compute (not in the step time)

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.optimizer_s + self.comm_s + self.overhead_s + self.host_s

    @property
    def host_copy_bytes(self) -> float:
        """Bytes over the host link in one step (every copy, hidden or not)."""
        per_step = {Cadence.MICRO_BATCH: self.priced.micro_batches, Cadence.STEP: 1}
        return sum(c.size_bytes * per_step[c.cadence] for c in self.priced.host_copies)

    @property
    def memory_bytes(self) -> float:
        """At the step's peak (`peak_bytes`)."""
        return peak_bytes(self.memory, gradients_held=self.priced.micro_batches > 1)

    # The items, as a strategy file lists them.
    @property
    def events(self) -> list[PricedCollective]:
        return self.priced.events

    @property
    def node_compute_s(self) -> dict[str, float]:
        return self.priced.node_compute_s

    @property
    def node_events(self) -> dict[str, list[PricedCollective]]:
        return self.priced.node_events

    @property
    def placed(self) -> dict[str, Spec]:
        return self.priced.placed

    @property
    def reshards(self) -> list[tuple[str, str, Spec, Spec, tuple[PricedCollective, ...]]]:
        return self.priced.reshards

    @property
    def flops_matmul(self) -> float:
        return self.priced.flops_matmul


def serial(p: PricedStep) -> StepCost:
    k = p.micro_batches
    per_step = {Cadence.MICRO_BATCH: k, Cadence.STEP: 1}
    compute = sum(p.node_compute_s.values()) * k
    return StepCost(
        priced=p, policy="serial",
        compute_s=compute, host_s=sum(c.time_s * per_step[c.cadence] for c in p.host_copies),
        comm_s=sum(e.time_s * per_step[e.cadence] for e in p.events) + (p.rank_skew * compute if p.events else 0.0),
        optimizer_s=sum(p.optimizer_s.values(), p.optimizer_fixed_s),
        overhead_s=p.overhead_s,
        memory={category: sum(items.values()) for category, items in p.memory.items()},
    )


def peak_bytes(memory: Mapping[str, float], *, gradients_held: bool) -> float:
    """Bytes per device at the step's peak, from its items by category (`memory`). Weights and
    optimizer states are held throughout. Activations grow through the forward and are all held when
    the loss's backward allocates its workspace; gradients appear through backward as activations are
    freed, and are freed after the optimizer step (`zero_grad(set_to_none=True)`, torch's default).
    So one micro-batch's step peaks either at the loss (activations + its workspace, no gradient yet)
    or at the end of backward (every gradient, no activation left). With gradient accumulation (or a
    pipeline) the gradients of earlier micro-batches are held through the later ones' loss: every
    item at once. Activations are a sum over the nodes that save them, not a liveness peak of their own."""
    total = sum(memory.values())
    if gradients_held:
        return total
    grads, at_loss = memory.get("gradients", 0.0), memory.get("activations", 0.0) + memory.get("loss", 0.0)
    return total - min(grads, at_loss)


def overlap(p: PricedStep) -> StepCost:
    """What DDP and FSDP overlap on GPUs (separate streams), on top of `serial`: a parameter's gradient
    reductions (DDP's bucketed all-reduce, ZeRO's and FSDP's reduce-scatters) run under backward —
    those of every micro-batch under its own backward, those once a step under the last one's —, all
    but the last bucket; a split parameter's gathers for use (FSDP's prefetch, and its gathers again
    for backward) run under the previous layer's compute, all but the first. Hidden time is bounded by
    the compute it hides under. Everything else — tensor-parallel collectives on the critical path,
    reshards of activations, the loss's, ZeRO's gather after the optimizer — stays exposed."""
    base = serial(p)
    k = p.micro_batches
    per_micro = once = last_bucket = 0.0
    for purpose, cap in ((Purpose.GRAD_SYNC, p.fusion.allreduce), (Purpose.GRAD_REDUCE_SCATTER, p.fusion.reducescatter)):
        grads = [e for e in p.events if hides_under_backward(e, p.params) and e.purpose is purpose]
        micro = sum(e.time_s for e in grads if e.cadence is Cadence.MICRO_BATCH)
        step = sum(e.time_s for e in grads if e.cadence is Cadence.STEP)
        per_micro, once = per_micro + micro, once + step
        nbytes = sum(e.size_bytes for e in grads)
        last_bucket = max(last_bucket, (micro + step) * min(1.0, cap / nbytes) if nbytes else 0.0)  # waits
    b = p.backward_s
    exposed_grads = (k - 1) * max(0.0, per_micro - b) + max(per_micro + once - b, min(last_bucket, per_micro + once))
    hidden_grads = k * per_micro + once - exposed_grads
    gathers = [e for e in p.events if prefetched(e, p.params)]
    gather_s = sum(e.time_s for e in gathers)
    first = max((e.time_s for e in gathers), default=0.0)  # the first (the largest) gather waits
    hidden_gathers = k * min(max(0.0, gather_s - first), base.compute_s / k)
    hidden = hidden_grads + hidden_gathers
    host_s, hidden_host = host_exposed(p, base.compute_s)
    return StepCost(priced=p, policy="overlap", compute_s=base.compute_s, comm_s=base.comm_s - hidden,
                    optimizer_s=base.optimizer_s, overhead_s=base.overhead_s, memory=base.memory, hidden_comm_s=hidden,
                    host_s=host_s, hidden_host_s=hidden_host)


def host_exposed(p: PricedStep, compute_s: float) -> tuple[float, float]:
    """The host link's copies the overlapped step waits for, and those it hides: each copy that can run
    under compute (a layer's weights fetched while the previous layer computes, a gradient copied out
    as backward goes on) does, on its own copy engine, up to the step's compute — all but the first
    (the largest), which waits; the weights copied back after the host's optimizer step wait whole.
    Exposed = max(first, hideable − compute) + the rest."""
    per_step = {Cadence.MICRO_BATCH: p.micro_batches, Cadence.STEP: 1}
    hideable = [c for c in p.host_copies if c.hideable]
    total = sum(c.time_s * per_step[c.cadence] for c in p.host_copies)
    h = sum(c.time_s * per_step[c.cadence] for c in hideable)
    exposed = max(max((c.time_s for c in hideable), default=0.0), h - compute_s) + (total - h)
    return exposed, total - exposed


_PREFETCHED = frozenset({Purpose.RESHARD, Purpose.REGATHER})
_GRADIENTS = frozenset({Purpose.GRAD_SYNC, Purpose.GRAD_REDUCE_SCATTER})


def hides_under_backward(e: PricedCollective, params: Container[str]) -> bool:
    """A parameter's gradient reduction: what `overlap` runs under backward."""
    return e.purpose in _GRADIENTS and e.tensor in params


def prefetched(e: PricedCollective, params: Container[str]) -> bool:
    """A split parameter's gather for use: what `overlap` prefetches under the previous layer's compute."""
    return e.purpose in _PREFETCHED and e.kind is Collective.ALL_GATHER and e.tensor in params

POLICIES: dict[Composer, Callable[[PricedStep], StepCost]] = {Composer.SERIAL: serial, Composer.OVERLAP: overlap}


def compose(priced: PricedStep, policy: str = Composer.SERIAL) -> StepCost:
    return POLICIES[lever(Composer, policy, "composer")](priced)
