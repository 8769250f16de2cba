"""The measured curves a device profile carries — a matmul's efficiency by size, by a narrow dim or a
convolution's channels, FlashAttention's rate, the optimizer step — each validated on construction.
Data and the curve's own shape only; the cost model reads them (`costmodel/device.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def check_positive(obj: object, field_name: str, *, allow_zero: bool = False) -> None:
    v = getattr(obj, field_name)
    if not isinstance(v, int | float) or isinstance(v, bool) or not np.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{field_name}: must be a {'non-negative' if allow_zero else 'positive'} number, got {v!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class EfficiencyCurve:
    """Achieved fraction of peak for a matmul of F FLOPs: max_fraction · F / (F + half_flops).

    Small matmuls are latency- and occupancy-bound; the curve saturates at the best achieved fraction.
    """

    max_fraction: float
    half_flops: float

    def __post_init__(self) -> None:
        check_positive(self, "max_fraction")
        check_positive(self, "half_flops", allow_zero=True)
        if self.max_fraction > 1.0:
            raise ValueError(f"max_fraction: a fraction of peak must be at most 1, got {self.max_fraction}")

    def fraction(self, flops: float) -> float:
        return self.max_fraction * flops / (flops + self.half_flops) if flops > 0 else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ChannelCurve:
    """Achieved fraction of peak for a convolution by the narrowest dim d of its implicit GEMM (output
    channels, or input channels × kernel size, per group): max_fraction · d/(d + half_channels).
    Few channels leave the vector units half idle whatever the FLOPs (on an Intel core a 3×3 conv
    with 32 channels ran at half the rate of a matmul of the same FLOPs). The fitted asymptote may lie
    above the matmul peak (max_fraction > 1: on an AMD EPYC core oneDNN's convolutions at 64–128
    channels outrun torch.matmul), and a convolution is priced at it."""

    max_fraction: float
    half_channels: float

    def __post_init__(self) -> None:
        check_positive(self, "max_fraction")
        check_positive(self, "half_channels", allow_zero=True)

    def fraction(self, channels: float) -> float:
        return self.max_fraction * channels / (channels + self.half_channels) if channels > 0 else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionCurve:
    """A fused attention kernel's rate (FlashAttention), forward or backward, by its forward FLOPs F
    (4·b·h·s_q·s_k·d, halved when causal): flops_per_s · s/(s + half_seq) · d/(d + half_head_dim),
    times causal_fraction for a causal (masked) one — short sequences and narrow heads leave the
    kernel's tiles idle, and a causal one skips only whole blocks."""

    flops_per_s: float
    half_seq: float
    half_head_dim: float
    causal_fraction: float

    def __post_init__(self) -> None:
        for name in ("flops_per_s", "causal_fraction"):
            check_positive(self, name)
        for name in ("half_seq", "half_head_dim"):
            check_positive(self, name, allow_zero=True)

    def time_s(self, flops: float, seq: float, head_dim: float, causal: bool) -> float:
        rate = self.flops_per_s * seq / (seq + self.half_seq) * head_dim / (head_dim + self.half_head_dim)
        return flops / (rate * (self.causal_fraction if causal else 1.0)) if flops > 0 else 0.0


ATTENTION_FIELDS = {"flops_per_s": "FLOP/s", "half_seq": "1", "half_head_dim": "1", "causal_fraction": "1"}


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerStep:
    """The optimizer step as an executor runs it, measured: a fixed cost per step, one per parameter
    tensor (its kernels' launches and the optimizer's own work on it) and one per parameter (the
    kernels' memory traffic: torch's one-tensor-at-a-time AdamW moves each value about 20 times)."""

    fixed_s: float
    tensor_s: float
    param_s: float

    def __post_init__(self) -> None:
        for name in ("fixed_s", "tensor_s", "param_s"):
            check_positive(self, name, allow_zero=True)
