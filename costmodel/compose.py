"""The step composer: from priced items (`PricedStep`) to one training step's time and memory.

Pricing (`costmodel/step.py`) says what each piece of work costs alone — every node's compute, every
collective with its phase, purpose and cadence, every parameter's optimizer update and states, every
saved activation. Composing says how those pieces add up into a step, and that is a policy:

  serial   nothing overlapped: step = k × (compute + per-micro-batch communication) + per-step
           communication + optimizer + the executor's fixed cost, for k accumulation steps (the
           graph is bound at one micro-step's batch); memory = model states + every activation one
           micro-batch saves (a sum over the step, not a liveness peak).

Overlap of communication with compute, pipeline bubbles and recomputation are further policies over
the same items: they change how items are counted, not how they are priced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from costmodel.collectives import Cadence

if TYPE_CHECKING:  # step.py prices and calls compose(): the types only, no import cycle
    from costmodel.step import CommEvent, PricedStep
    from planner.placement import Spec


@dataclass(frozen=True)
class StepCost:
    """A composed step: its totals, the policy that composed them, and the items they came from."""

    priced: PricedStep
    policy: str
    compute_s: float  # forward + backward of every op (and the loss); the optimizer step apart
    comm_s: float
    optimizer_s: float
    overhead_s: float  # the executor's fixed host cost per step (the profile's step_overhead_s)
    memory: Mapping[str, float] = field(default_factory=dict)  # bytes per device by category

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.optimizer_s + self.comm_s + self.overhead_s

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    # The items, as a strategy file lists them.
    @property
    def events(self) -> list[CommEvent]:
        return self.priced.events

    @property
    def node_compute_s(self) -> dict[str, float]:
        return self.priced.node_compute_s

    @property
    def node_events(self) -> dict[str, list[CommEvent]]:
        return self.priced.node_events

    @property
    def placed(self) -> dict[str, Spec]:
        return self.priced.placed

    @property
    def reshards(self) -> list[tuple[str, str, Spec, Spec, tuple[CommEvent, ...]]]:
        return self.priced.reshards

    @property
    def flops_matmul(self) -> float:
        return self.priced.flops_matmul


def serial(p: PricedStep) -> StepCost:
    k = p.micro_batches
    per_step = {Cadence.MICRO_BATCH: k, Cadence.STEP: 1}
    return StepCost(
        priced=p, policy="serial",
        compute_s=sum(p.node_compute_s.values()) * k,
        comm_s=sum(e.time_s * per_step[e.cadence] for e in p.events),
        optimizer_s=_running_sum(p.optimizer_fixed_s, p.optimizer_s.values()),
        overhead_s=p.overhead_s,
        memory={category: sum(items.values()) for category, items in p.memory.items()},
    )


def _running_sum(start: float, values: Iterable[float]) -> float:
    total = start
    for v in values:
        total += v
    return total


POLICIES: dict[str, Callable[[PricedStep], StepCost]] = {"serial": serial}


def compose(priced: PricedStep, policy: str = "serial") -> StepCost:
    try:
        return POLICIES[policy](priced)
    except KeyError:
        raise ValueError(f"unknown step composer policy {policy!r}; one of {', '.join(POLICIES)}") from None
