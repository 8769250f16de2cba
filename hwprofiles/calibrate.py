"""`meshplan profile calibrate`: microbenchmarks on this machine, fitted into a profile JSON.

What is measured (warm-up first, then repetitions; the median is kept, the spread reported), by whom:
- `timing.py`: the harness — where a rank computes, medians of repeated calls, and the interleaved
  timing all of a rank's compute figures use (this VM's cores switch speed every few seconds);
- `sweeps.py`: compute, on all ranks at once (as training runs it; the slowest rank's medians are
  kept): a matmul sweep (one rank = one process with one thread on CPU, one GPU with nccl) → the
  efficiency curve P·F/(F + F½); a large buffer copy → bandwidth; a one-element op; an element-wise
  kernel mix → its bandwidth; 3×3 convolutions over channel counts → P_c·d/(d + d½); AdamW on large
  tensors → its cost per parameter;
- `executor/calibrate.py`: the ranks themselves (spawned on 127.0.0.1 with a free port) and what
  only the executor can measure: DTensor's host cost per reshard, its cost per op and per step, and
  AdamW's per tensor and per step where it runs;
- `collective_sweeps.py`: each collective over message sizes at the requested world size; a
  repetition's time is the slowest rank's → α and β per collective (`fit.py`), and the raw table,
  which the cost model prefers inside its range;
- `report.py`: the report, the profile fitted from it, its plots and JSON.
This module holds the options. torch is imported inside functions only, on the measuring ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.errors import MeshplanError


class CalibrationError(MeshplanError):
    """The microbenchmarks could not run (bad options, a rank that failed or hung)."""


KiB, MiB = 1 << 10, 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationConfig:
    nproc: int = 2
    backend: str = "gloo"
    quick: bool = False
    base: str | None = None
    name: str | None = None
    timeout_s: float = 600.0
    compute_only: bool = False  # measure compute on all ranks at once; links from `base`

    def __post_init__(self) -> None:
        if self.compute_only and self.base is None:
            raise CalibrationError("`compute_only` keeps another profile's links: pass `base` NAME (a preset or a "
                                   "profile JSON calibrated on this machine)")
        if self.nproc < 1:
            raise CalibrationError(f"`nproc` {self.nproc}: needs at least 1 rank (2 or more to measure collectives)")
        if self.nproc < 2 and self.base is None:
            raise CalibrationError(f"`nproc` {self.nproc} measures no link; calibrate with `nproc` 2 or more, or pass "
                                   "`base` NAME to keep a preset's links")
        if self.backend not in ("gloo", "nccl"):
            raise CalibrationError(f"`backend` {self.backend}: use gloo (CPU) or nccl (GPUs)")

    @property
    def message_sizes(self) -> list[int]:
        top = 16 * MiB if self.quick else 256 * MiB
        sizes, s = [], 4 * KiB
        while s <= top:
            sizes.append(s)
            s *= 4
        return sizes

    @property
    def matmul_sizes(self) -> list[int]:
        return [32, 64, 128, 256, 384, 512, 768] if self.quick else [32, 64, 128, 256, 384, 512, 768, 1024, 1536]

    @property
    def repeats(self) -> int:
        """Fewest timed repetitions per size (more are taken while `budget_s` allows)."""
        return 15 if self.quick else 25

    @property
    def max_repeats(self) -> int:
        return 300 if self.quick else 1000

    @property
    def budget_s(self) -> float:
        """Time spent timing one collective at one size."""
        return 0.2 if self.quick else 0.6


ProgressFn = Callable[[str, int, int], None]
