"""A priced step's gradient collectives packed as the runtime runs them (`buckets.py` packs; this
prices): one collective per bucket and mesh axis (`core.collectives.PricedBucket`), its time shared
among the parameters in it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace

from core.collectives import BUCKETED, Collective, PricedBucket, PricedCollective, Purpose
from costmodel.buckets import gather_groups, pack_buckets, zero_units
from costmodel.items import PricedStep

BucketTime = Callable[[Collective, float, tuple[int, ...]], float]


def is_bucketed(e: PricedCollective, params: Collection[str], resharded: Collection[str]) -> bool:
    """A parameter's gradient collective (or ZeRO's gather) that runs packed with others: the parameter
    is used where it is stored."""
    return (e.kind, e.purpose) in BUCKETED and e.tensor in params and e.tensor not in resharded


def price_buckets(cost: PricedStep, params: Collection[str], time_s: BucketTime) -> None:
    """Parameter gradients' collectives as they run (`buckets.py`): the all-reduces of parameters
    used where stored packed by the all-reduce cap; ZeRO's reduce-scatters per fused unit, its
    gathers per group of units; one collective per bucket and axis (`time_s`: its time on the mesh),
    each parameter's event carrying its bytes' share of that collective's time. The buckets are
    recorded in `cost.buckets`."""
    buckets, priced = _pack(cost, params, time_s)
    cost.replace_events(priced)
    cost.buckets = buckets


def stage_buckets(cost: PricedStep, holders: Mapping[str, Sequence[int]], stages: int,
                  time_s: BucketTime) -> list[PricedBucket]:
    """A pipelined plan's buckets: each stage's ranks pack the gradients of the parameters they hold
    (`holders`: parameter → its stages; a tied one is held, and reduced, on each), apart from the
    other stages'."""
    out: list[PricedBucket] = []
    for s in range(stages):
        mine = {t for t, held in holders.items() if s in held}
        out += [replace(b, stage=s) for b in _pack(cost, mine, time_s)[0]]
    return out


def _pack(cost: PricedStep, params: Collection[str],
          time_s: BucketTime) -> tuple[list[PricedBucket], dict[int, list[PricedCollective]]]:
    resharded = {t for t, *_ in cost.reshards}
    zeroed = cost.zero_stages

    def of(kind: Collective, purpose: Purpose) -> dict[str, list[PricedCollective]]:
        out: dict[str, list[PricedCollective]] = {}
        for e in cost.events:
            if e.kind is kind and e.purpose is purpose and is_bucketed(e, params, resharded):
                out.setdefault(e.tensor, []).append(e)
        return out

    buckets: list[PricedBucket] = []
    priced: dict[int, list[PricedCollective]] = {}

    def share(kind: Collective, names: Sequence[str], syncs: dict[str, list[PricedCollective]]) -> None:
        evs = [e for t in names for e in syncs[t]]
        for a in sorted({a for e in evs for a in e.axes}):
            on_axis = [e for e in evs if e.axes == (a,)]
            total = sum(e.size_bytes for e in on_axis)
            bucket_s = time_s(kind, total, (a,))
            buckets.append(PricedBucket(kind=kind, axes=(a,), size_bytes=total, time_s=bucket_s,
                                        cadence=on_axis[0].cadence, tensors=tuple(e.tensor for e in on_axis)))
            priced.update({id(e): [replace(e, time_s=bucket_s * e.size_bytes / total)] for e in on_axis})

    syncs = {t: evs for t, evs in of(Collective.ALL_REDUCE, Purpose.GRAD_SYNC).items() if t not in zeroed}
    grads = {t: (_axes(evs), evs[0].size_bytes) for t, evs in syncs.items()}
    fusion = cost.fusion
    for _, names in pack_buckets(grads, fusion.allreduce):
        share(Collective.ALL_REDUCE, names, syncs)
    scatters = of(Collective.REDUCE_SCATTER, Purpose.GRAD_REDUCE_SCATTER)
    gathers = of(Collective.ALL_GATHER, Purpose.PARAM_GATHER)
    shard_syncs = {t: evs for t, evs in of(Collective.ALL_REDUCE, Purpose.GRAD_SYNC).items() if t in zeroed}
    units = zero_units({t: (_axes(evs + shard_syncs.get(t, [])), max(e.size_bytes for e in evs))
                        for t, evs in scatters.items()
                        if t in zeroed}, zeroed, fusion)
    for unit in units:
        share(Collective.REDUCE_SCATTER, unit.names, scatters)
        share(Collective.ALL_REDUCE, [t for t in unit.names if t in shard_syncs], shard_syncs)
    weights = {t: max(e.size_bytes for e in gathers[t]) for u in units for t in u.names}
    for group in gather_groups(units, weights, fusion.allgather):
        share(Collective.ALL_GATHER, [t for i in group for t in units[i].names], gathers)
    return buckets, priced


def _axes(events: list[PricedCollective]) -> tuple[int, ...]:
    return tuple(sorted({a for e in events for a in e.axes}))
