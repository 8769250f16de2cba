"""The timing harness of `profile calibrate`: where a rank computes, and medians of repeated calls.

torch is imported inside functions only (hwprofiles is data; these run on the ranks that measure).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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
                      bursts: bool = True, before: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds of each function, in round-robin passes (at least `repeats`, and `min_time_s` in
    all). A shared VM's core alternates between speeds for seconds at a time (here: one state
    1.4–1.7× slower than the other, for 1–3 s); timed one after the other, each figure would catch
    one state at random, and their ratios (a curve, a difference) would be noise. Interleaved, every
    figure sees the same mix of states. In a pass each function runs a burst of about 2 ms, its
    first call untimed unless it is the only one: a small kernel is timed on warm caches, as it runs
    in a step right after the op producing its input, not after the previous function's sweep.
    Without `bursts`, one call each per pass (functions that form a sequence, e.g. a training step
    and its optimizer step). `before`, untimed, runs before every timed call (`CacheScrub`: each call
    from cold caches)."""
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
                if before is not None:
                    before()
                    sync(device)
                t0 = time.perf_counter()
                fn()
                sync(device)
                if i > 0 or burst[name] == 1:
                    times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def last_level_cache_bytes(default: int = 32 << 20, sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The CPU's last-level cache (Linux sysfs: the highest level among cpu0's caches), or `default`."""
    best = (0, default)
    for d in sysfs.glob("index*"):
        try:
            level, size = int((d / "level").read_text()), (d / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
        if level > best[0] and size.rstrip("KM").isdigit():
            best = (level, int(size.rstrip("KM")) * scale)
    return best[1]


class CacheScrub:
    """Writes a buffer twice the last-level cache: what runs next finds its data, and the Python and
    autograd records around it, evicted — as each op of a training step finds them, the step's other
    ops (two ranks' activations and model states, tens of MiB) having passed through the caches since
    it last ran. Measured here (AMD EPYC, 32 MiB L3): the executor's per-op cost on a tiny model is
    6.2 µs per launch timed in a loop and 7.0 µs with this between iterations, and the same 32
    one-element ops run 1.14× slower right after a step of bert-tiny than in a loop; AdamW per
    parameter 2.1 ns warm, 2.4–2.6 ns cold."""

    def __init__(self, device: Any, nbytes: int | None = None) -> None:
        import torch

        self.buffer = torch.empty((nbytes or 2 * last_level_cache_bytes()) // 4, device=device)

    def __call__(self) -> None:
        self.buffer.fill_(1.0)


class SpeedProbe:
    """A small fixed workload a rank times now and then, to see how fast this machine runs at that
    moment: a shared VM's speed moves within minutes (the same steps 10–20% slower than the compute
    calibrated seconds before them), and a run timed between two probes can be compared with the
    figures it was predicted from at the speed it ran. Three parts, each what one kind of cost in a
    step pays: `matmul` (4 matmuls of 128², cache-resident compute), `element-wise` (4 adds over 1 MiB
    inputs, past the core's L2), `op` (32 one-element ops: the dispatcher's per-op cost)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = device
        gen = torch.Generator().manual_seed(0)
        self.a = [torch.randn(128, 128, generator=gen).to(device) for _ in range(4)]
        self.x = [torch.randn(1 << 18, generator=gen).to(device) for _ in range(8)]
        self.one = torch.ones(1, device=device)
        self.scrub = torch.empty(1 << 20, device=device)  # 4 MiB, twice the core's L2
        self()  # first-call costs out of the figures

    def __call__(self) -> dict[str, float]:
        self.scrub.fill_(1.0)
        sync(self.device)
        t0 = time.perf_counter()
        for i in range(4):
            self.a[i] @ self.a[3 - i]
        sync(self.device)
        t1 = time.perf_counter()
        for i in range(4):
            self.x[i] + self.x[7 - i]
        sync(self.device)
        t2 = time.perf_counter()
        for _ in range(32):
            self.one.add(1.0)
        sync(self.device)
        t3 = time.perf_counter()
        return {"matmul": t1 - t0, "element-wise": t2 - t1, "op": t3 - t2}


def probe_medians(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]} if samples else {}
