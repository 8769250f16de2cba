"""What a device and its links take, from a profile's numbers (hwprofiles holds the numbers, this
module the formulas): a matmul or convolution by the roofline with the calibrated efficiency curves,
one collective call by the link's measured table or its α-β model.

Collective times follow the nccl-tests conventions (doc/PERFORMANCE.md): for a message of S bytes on
n ranks, time = steps(n)·α + factor(n)·S/β_bus, with the ring algorithm's
  all_reduce      steps 2(n−1), factor 2(n−1)/n     (S = the buffer)
  all_gather      steps  n−1,   factor  (n−1)/n     (S = the gathered output)
  reduce_scatter  steps  n−1,   factor  (n−1)/n     (S = the input)
  all_to_all      steps  n−1,   factor  (n−1)/n     (S = the buffer each rank holds)
  broadcast       steps  n−1,   factor  1
  send_recv       steps  1,     factor  1
A measured table (message size → time at a given n) takes precedence inside its range, interpolated
log-log through its monotone least-squares fit (a bigger message never takes less time).
"""

from __future__ import annotations

from functools import cache

import numpy as np

from core.collectives import Collective, LinkLevel, alpha_beta_time_s
from hwprofiles.fit import monotone_fit
from hwprofiles.profile import CollectiveModel, DeviceSpec, HardwareProfile, TablePoint


def matmul_time_s(device: DeviceSpec, flops: float, dtype: str, narrow: float | None = None,
                  align_bytes: int = 16) -> float:
    """A matmul of `flops` FLOPs whose GEMMs' narrowest dim is `narrow` (None: unknown): the FLOPs
    curve, and no faster than the narrow dim allows where the profile has that curve; at the profile's
    fraction for GEMMs whose k or n is aligned to only `align_bytes` bytes."""
    if flops <= 0:
        return 0.0
    curve = device.matmul_curve(dtype)
    t = flops / (device.peak_for(dtype) * curve.fraction(flops))
    narrow_curve = device.matmul_narrow_efficiency
    if narrow_curve is not None and narrow:  # at this dtype's own ceiling where it has its own curve
        ceiling = curve.max_fraction / device.matmul_efficiency.max_fraction
        t = max(t, flops / (device.peak_for(dtype) * narrow_curve.fraction(narrow) * ceiling))
    return t / device.alignment_fraction(align_bytes)


def conv_time_s(device: DeviceSpec, flops: float, channels: float, dtype: str) -> float:
    """A convolution: at the rate its channels allow where the profile measured convolutions (a CPU's
    direct convolution kernels may beat its matmul at many channels, or fall to half of it at few),
    scaled by the matmul curve's small-size factor F/(F + F½); else as a matmul of its FLOPs."""
    if device.conv_efficiency is None or flops <= 0 or channels <= 0:
        return matmul_time_s(device, flops, dtype)
    size = flops / (flops + device.matmul_efficiency.half_flops)
    return flops / (device.peak_for(dtype) * device.conv_efficiency.fraction(channels) * size)


def collective_call_s(model: CollectiveModel, kind: Collective, size_bytes: float, num_ranks: int) -> float:
    """One call on one link level: the measured table where it covers the size, else α-β."""
    if num_ranks <= 1 or size_bytes <= 0:
        return 0.0
    measured = _interpolate(model.table, num_ranks, size_bytes)
    if measured is not None:
        return measured
    return alpha_beta_time_s(kind, size_bytes, num_ranks, model.alpha_s, model.bus_bandwidth_bytes_per_s)


def link_collective_time_s(profile: HardwareProfile, kind: Collective, size_bytes: float, num_ranks: int,
                           level: LinkLevel) -> float:
    """One call of a collective as a step makes it: the link's table or α-β model, plus the device's
    collective wait (after compute) where calibrated."""
    return collective_call_s(profile.collectives[(level, kind)], kind, size_bytes, num_ranks) + \
        (profile.device.collective_wait_s or 0.0)


@cache
def _table_arrays(table: tuple[TablePoint, ...], num_ranks: int) -> tuple[np.ndarray, np.ndarray] | None:
    pts = sorted((p.size_bytes, p.time_s) for p in table if p.ranks == num_ranks)
    if len(pts) < 2:
        return None
    sizes = np.log(np.array([s for s, _ in pts]))
    return sizes, np.log(monotone_fit([t for _, t in pts]))


def _interpolate(table: tuple[TablePoint, ...], num_ranks: int, size_bytes: float) -> float | None:
    arrays = _table_arrays(table, num_ranks) if table else None
    if arrays is None:
        return None
    log_sizes, log_times = arrays
    x = np.log(size_bytes)
    if x < log_sizes[0] or x > log_sizes[-1]:
        return None
    return float(np.exp(np.interp(x, log_sizes, log_times)))
