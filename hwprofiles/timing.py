"""The timing harness of `profile calibrate`: where a rank computes, and medians of repeated calls.

torch is imported inside functions only (hwprofiles is data; these run on the ranks that measure).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True, slots=True)
class Measurement:
    kind: str
    size: float  # bytes for collectives, FLOPs for matmuls
    times_s: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def mean_s(self) -> float:
        """The expected time: what a step pays on average for this op, its tail included. A collective
        is priced by it, not by the median: gloo on this VM has a heavy tail (4 KB all-reduce: median
        0.29 ms, mean 0.7–1.4 ms, p90 3–4 ms, the tail in the collective itself once both ranks have
        arrived), and a step with k collectives pays k means."""
        return statistics.fmean(self.times_s)

    @property
    def spread(self) -> float:
        """Interquartile range over the median."""
        if len(self.times_s) < 4:
            return (max(self.times_s) - min(self.times_s)) / self.median_s
        q = statistics.quantiles(self.times_s, n=4)
        return (q[2] - q[0]) / self.median_s


def device_for(backend: str, rank: int) -> Any:
    import torch

    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], object], device: Any, *, warmup: int, repeats: int, min_time_s: float = 0.0) -> list[float]:
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_time_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def time_interleaved(fns: dict[str, Callable[[], object]], device: Any, *, min_time_s: float, repeats: int,
                      bursts: bool = True) -> dict[str, float]:
    """Median seconds of each function, in round-robin passes (at least `repeats`, and `min_time_s` in
    all). A shared VM's core alternates between speeds for seconds at a time (here: one state
    1.4–1.7× slower than the other, for 1–3 s); timed one after the other, each figure would catch
    one state at random, and their ratios (a curve, a difference) would be noise. Interleaved, every
    figure sees the same mix of states. In a pass each function runs a burst of about 2 ms, its
    first call untimed unless it is the only one: a small kernel is timed on warm caches, as it runs
    in a step right after the op producing its input, not after the previous function's sweep.
    Without `bursts`, one call each per pass (functions that form a sequence, e.g. a training step
    and its optimizer step)."""
    burst = {}
    for name, fn in fns.items():
        fn()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        burst[name] = max(1, min(1000, int(2e-3 / max(time.perf_counter() - t0, 1e-7)))) if bursts else 1
    times: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    passes = 0
    while passes < repeats or time.perf_counter() - start < min_time_s:
        passes += 1
        for name, fn in fns.items():
            for i in range(burst[name]):
                t0 = time.perf_counter()
                fn()
                sync(device)
                if i > 0 or burst[name] == 1:
                    times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}
