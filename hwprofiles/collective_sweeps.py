"""Collective sweeps of `profile calibrate`: each collective over message sizes, timed on every rank
of an initialised process group (a repetition's time is the slowest rank's), and their α-β fits.
The ranks are spawned by the executor's launcher (`executor/calibrate.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from core.collectives import Collective
from hwprofiles.calibrate import CalibrationConfig
from hwprofiles.fit import fit_alpha_beta
from hwprofiles.report import CalibrationReport
from hwprofiles.timing import Measurement, sync


def collective_fn(kind: Collective, size_bytes: int, rank: int, n: int, device: Any) -> Callable[[], object]:
    import torch
    import torch.distributed as dist

    elems = max(size_bytes // 4, n)
    elems -= elems % n  # divisible by n so that shards are equal
    if kind is Collective.ALL_REDUCE:
        t = torch.ones(elems, device=device)
        return lambda: dist.all_reduce(t)
    if kind is Collective.ALL_GATHER:  # S = the gathered output
        out, inp = torch.empty(elems, device=device), torch.ones(elems // n, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if kind is Collective.REDUCE_SCATTER:  # S = the input
        out, inp = torch.empty(elems // n, device=device), torch.ones(elems, device=device)
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: rs(out, inp)
    if kind is Collective.ALL_TO_ALL:
        out, inp = torch.empty(elems, device=device), torch.ones(elems, device=device)
        return lambda: dist.all_to_all_single(out, inp)
    if kind is Collective.BROADCAST:
        t = torch.ones(elems, device=device)
        return lambda: dist.broadcast(t, 0)
    # send_recv: ranks pair up (0↔1, 2↔3, …); an odd last rank idles.
    t = torch.ones(elems, device=device)
    peer = rank ^ 1
    if peer >= n:
        return lambda: None
    if rank % 2 == 0:
        return lambda: (dist.send(t, peer), dist.recv(t, peer))
    return lambda: (dist.recv(t, peer), dist.send(t, peer))



def collective_times(cfg: CalibrationConfig, rank: int, n: int, device: Any,
                     progress: Callable[[str, int, int], None]) -> dict[str, list[tuple[int, list[float]]]]:
    """Every collective at every message size on this rank's initialised process group: per size, the
    slowest rank's time of each repetition (every rank returns the same table)."""
    import torch
    import torch.distributed as dist

    sizes, repeats, max_repeats, budget_s = cfg.message_sizes, cfg.repeats, cfg.max_repeats, cfg.budget_s
    results: dict[str, list[tuple[int, list[float]]]] = {}
    total, done = len(Collective) * len(sizes), 0
    for kind in Collective:
        for size in sizes:
            fn = collective_fn(kind, size, rank, n, device)
            for _ in range(2):
                fn()
            sync(device)
            # Every op is timed on its own (gloo's latency has a heavy tail, p90 up to 10× p50 here);
            # the table keeps every repetition, and the profile the mean (what a step pays). The count comes from a
            # MAX-reduced probe, hence is the same on every rank.
            t0 = time.perf_counter()
            fn()
            sync(device)
            probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(probe, op=dist.ReduceOp.MAX)
            count = int(min(max_repeats, max(repeats, budget_s // max(probe.item(), 1e-6))))
            mine = []
            dist.barrier()
            for _ in range(count):
                t0 = time.perf_counter()
                fn()
                sync(device)
                mine.append(time.perf_counter() - t0)
            slowest = torch.tensor(mine, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            results.setdefault(kind.value, []).append((size, slowest.tolist()))
            done += 1
            progress(kind.value, done, total)
    return results


def fit_collectives(cfg: CalibrationConfig, report: CalibrationReport,
                    results: dict[str, list[tuple[int, list[float]]]]) -> None:
    """The measured tables into the report, with each collective's α-β fit."""
    for kind_name, rows in results.items():
        kind = Collective(kind_name)
        ms = [Measurement(kind=kind_name, size=float(s), times_s=t) for s, t in rows]
        report.collectives[kind_name] = ms
        report.fits[kind_name] = fit_alpha_beta(kind, cfg.nproc, [m.size for m in ms], [m.mean_s for m in ms])
