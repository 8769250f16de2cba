"""Hand layouts as incumbents: what a practitioner would write for the same devices and global batch,
each planned as written (`--layout`, `--zero`: `build.as_written`), with the recomputation and
micro-batch count that fit. `make_plan` returns the fastest of them where the search's own plan is
slower, and says which: a plan is never predicted slower than a hand layout that fits.

  DDP        dp_replicate=N, ZeRO 0          parameters whole, gradients all-reduced
  FSDP       dp_shard=N, ZeRO 3              parameters split on dim 0, gathered for use
  HSDP       dp_replicate=nodes, dp_shard=G  FSDP inside a node of G devices, replicas across nodes
  FSDP + TP  dp_shard=N/G, tp=G, ZeRO 3      Megatron's column/row split inside a node (the ILP
                                             places the tensors inside tp), FSDP across nodes (on
                                             more than one node: inside one, tp places everything
                                             as the search itself does)
  FSDP + CP  dp_shard=N/G, cp=G, ZeRO 3      long sequences (LONG_CONTEXT tokens or more): the
                                             sequence split over a node (context parallelism,
                                             `--cp-method` auto), FSDP over both
  FSDP + EP  dp_shard=N, ep=E, ZeRO 3        a mixture of experts (torchtitan's): the experts split
                                             over E ranks of a node (the most of them that divide N
                                             and every block's experts), ep borrowing them from
                                             dp_shard; FSDP over the rest
  Megatron 3D  dp_replicate=N/(G·P), tp=G,   where the planner searches pipelines (several nodes): a
             pp=P, ZeRO 0                    node's tensor parallelism, P pipeline stages (the fewest,
                                             a power of two, whose model states can fit), data
                                             parallelism over the rest, one sequence per micro-batch
                                             (Megatron-LM's, SC'21), 1F1B

Each is tried on the request's mesh shape where the request fixes one, on its own otherwise, and at
the request's ZeRO stage where it fixes one (and its other levers: precision, recomputation, micro-steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from core.errors import MeshplanError
from core.layout import Layout, parse_layout
from core.levers import Mode
from costmodel.memory import Precision, model_state_bytes
from planner.search.request import PlanRequest
from planner.strategy import HandLayoutRecord, Strategy


@dataclass(frozen=True)
class HandLayout:
    name: str
    layout: str
    zero: int


MEGATRON_3D = "Megatron 3D"

# From this many tokens per sequence a practitioner splits the sequence (Llama-3's long-context stage: 128k)
LONG_CONTEXT = 32768


def hand_layouts(devices: int, devices_per_node: int, sequence: int | None = None,
                 experts: int | None = None, layers: int | None = None) -> list[HandLayout]:
    """The hand layouts for `devices` GPUs in nodes of `devices_per_node`; `sequence`: the tokens of the
    model's sequence dim, where it has one; `experts`: what every mixture-of-experts block's count of
    experts is a multiple of, where the model has such blocks; `layers`: the repeated layers a pipeline
    cuts, where pipelines are searched (Megatron 3D at every depth: `incumbents` plans the shallowest
    whose states can fit)."""
    n, g = devices, min(devices_per_node, devices)
    out = [HandLayout("DDP", f"dp_replicate={n}", 0), HandLayout("FSDP", f"dp_shard={n}", 3)]
    if n > g > 1 and n % g == 0:
        out.append(HandLayout("HSDP", f"dp_replicate={n // g},dp_shard={g}", 3))
    if n > g > 1 and n % g == 0:
        out.append(HandLayout("FSDP + TP", f"dp_shard={n // g},tp={g}", 3))
    if sequence is not None and sequence >= LONG_CONTEXT and g > 1 and n % g == 0:
        out.append(HandLayout("FSDP + CP", f"dp_shard={n // g},cp={g}" if n > g else f"cp={g}", 3))
    ep = max((e for e in range(2, g + 1) if n % e == 0 and experts and experts % e == 0), default=None)
    if ep is not None:
        out.append(HandLayout("FSDP + EP", f"dp_shard={n},ep={ep}", 3))
    if layers and n > g > 1 and n % g == 0:
        p = 2
        while p <= min(layers, n // g):
            if (n // g) % p == 0:
                dp = n // g // p
                out.append(HandLayout(MEGATRON_3D, (f"dp_replicate={dp}," if dp > 1 else "") + f"tp={g},pp={p}", 0))
            p *= 2
    return out


def states_floor(layout: Layout, zero: int, num_params: float, precision: Precision) -> float:
    """A lower bound of a layout's model states per device: ZeRO's forms (`memory.model_states`) over
    all its data-parallel ranks (and cp's: FSDP shards over dp_shard × cp), tensor parallelism splitting
    every parameter, pipeline stages their layers (the stage holding the most holds at least the mean)."""
    return model_state_bytes(num_params / layout.degree.get("tp", 1) / layout.pipeline, precision, zero_stage=zero,
                             dp_degree=layout.data_parallel * layout.context_parallel)


def one_axis(hand: HandLayout) -> bool:
    """DDP and FSDP: a mesh of one axis, whose ILP is small (a few strategies an op) — planned first where
    the search's plans are many (`plan._make_plan`), their step then the bound the search must beat."""
    return "," not in hand.layout


def incumbents(req: PlanRequest, devices_per_node: int, plan: Callable[[PlanRequest], Strategy], *,
               num_params: float, precision: Precision, limit: float, sequence: int | None = None,
               experts: int | None = None, layers: int | None = None,
               which: Callable[[HandLayout], bool] = lambda _: True) -> list[tuple[HandLayout, Strategy | str]]:
    """Each hand layout (those `which` keeps) planned by `plan` as written for the request (its devices,
    global batch, precision and levers) at the fewest micro-steps and the recomputation that fit, or why
    none fits."""
    out: list[tuple[HandLayout, Strategy | str]] = []
    deeper: tuple[HandLayout, str] | None = None  # Megatron 3D out of memory at the depth tried: try deeper
    for hand in filter(which, hand_layouts(req.devices, devices_per_node, sequence, experts, layers)):
        if hand.name == MEGATRON_3D and deeper is None and any(h.name == MEGATRON_3D for h, _ in out):
            continue  # (the shallowest pipeline that fits is planned)
        tried = _planned_as_written(hand, req, plan, num_params=num_params, precision=precision, limit=limit)
        if tried is None:
            continue
        if hand.name == MEGATRON_3D:
            if isinstance(tried, str) and "memory" in tried:
                deeper = (hand, tried)
                continue
            deeper = None
        out.append((hand, tried))
    if deeper is not None:
        out.append(deeper)
    return out


def _planned_as_written(hand: HandLayout, req: PlanRequest, plan: Callable[[PlanRequest], Strategy], *,
                        num_params: float, precision: Precision, limit: float) -> Strategy | str | None:
    """One hand layout planned as written for the request, or why none fits; None where the request
    rules it out (its mesh shape or ZeRO stage)."""
    if req.zero_stage is not None:  # the user's ZeRO stage holds for every layout: DDP at 3 is FSDP,
        # and a dp_shard layout shards its parameters (ZeRO-3) whatever the stage says
        if (hand.name == "DDP") == (req.zero_stage == 3):
            return None
        hand = replace(hand, zero=req.zero_stage)
    layout = parse_layout(hand.layout, req.devices)
    if req.mesh_shape is not None and tuple(req.mesh_shape) != layout.mesh_shape:
        return None
    floor = states_floor(layout, hand.zero, num_params, precision)
    if floor > limit:  # its model states alone do not fit: no need to plan it
        return f"memory: its model states alone need at least {floor / 2**30:.1f} GiB per device"
    if req.global_batch_size is not None and req.global_batch_size % layout.data_parallel:
        return f"the global batch {req.global_batch_size} does not split over {layout.data_parallel} data-parallel ranks"
    try:
        return plan(replace(req, layout=layout, zero_stage=hand.zero, mesh_shape=None, axis_names=None, mode=Mode.AUTO,
                            must_fit=True, micro_batch_size=1 if layout.pipeline > 1 else req.micro_batch_size,
                            gradient_accumulation_shard="auto" if hand.zero in (0, 3) else req.gradient_accumulation_shard))
    except MeshplanError as e:
        return str(e).splitlines()[0]


def planned(hands: Callable[[], list[tuple[HandLayout, Strategy | str]]] | None,
            say: Callable[[str], None]) -> list[tuple[HandLayout, Strategy | str]]:
    """The hand layouts planned (none where there are none to plan, or their planning failed: the
    search's plan stands alone then)."""
    if hands is None:
        return []
    say("hand layouts")
    try:
        return hands()
    except MeshplanError as e:  # a comparison, never a reason to lose the search's plan
        say(f"hand layouts not compared: {str(e).splitlines()[0]}")
        return []


def fastest_fitting(tried: list[tuple[HandLayout, Strategy | str]], limit: float) -> Strategy | None:
    """The fastest hand layout planned that fits, if any."""
    fits = [s for _, s in tried if not isinstance(s, str) and s.cost.memory_bytes_per_device <= limit]
    return min(fits, key=lambda s: s.step_time_s, default=None)


def against_hand_layouts(plan: Strategy | None, tried: list[tuple[HandLayout, Strategy | str]],
                         limit: float) -> Strategy:
    """The search's plan, or the fastest hand layout that fits where that is faster (or where the
    search found none: then one must fit), with every hand layout's price recorded."""
    records: list[HandLayoutRecord] = []
    best = plan
    for hand, s in tried:
        if isinstance(s, str):
            records.append(HandLayoutRecord(name=hand.name, layout=hand.layout, zero=hand.zero, step_time_s=None,
                                            memory_bytes_per_device=None, fits=False, error=s))
            continue
        fits = s.cost.memory_bytes_per_device <= limit
        records.append(HandLayoutRecord(name=hand.name, layout=hand.layout, zero=hand.zero, step_time_s=s.step_time_s,
                                        memory_bytes_per_device=s.cost.memory_bytes_per_device, fits=fits))
        if fits and (best is None or s.step_time_s < best.step_time_s):
            best = s
    assert best is not None
    chosen = [replace(r, chosen=True) if best is not plan and r.layout == best.training.layout else r for r in records]
    return replace(best, hand_layouts=tuple(chosen))
