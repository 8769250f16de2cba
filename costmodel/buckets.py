"""Gradient buckets, as DDP builds them: gradients that are reduced over the same mesh axes are
packed in a fixed order (parameter names, sorted) into buckets of at most `cap` bytes, one all-reduce
per bucket and axis. One function for the three that must agree: the cost model prices these
all-reduces, the executor runs them, the launcher counts them."""

from __future__ import annotations

from collections import defaultdict

# Gradient collectives are fused into buckets, as PyTorch DDP does (bucket_cap_mb = 25) and MindSpore's
# all_reduce_fusion_config: latency is paid per bucket, not per parameter.
GRAD_BUCKET_BYTES = 25 * 2**20


def pack_buckets(grads: dict[str, tuple[tuple[int, ...], float]], cap: float = GRAD_BUCKET_BYTES
            ) -> list[tuple[tuple[int, ...], list[str]]]:
    """grads: name → (mesh axes it is reduced over, bytes). Returns (axes, names) per bucket."""
    by_axes: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for name in sorted(grads):
        axes, _ = grads[name]
        if axes:
            by_axes[axes].append(name)
    out: list[tuple[tuple[int, ...], list[str]]] = []
    for axes in sorted(by_axes):
        current: list[str] = []
        size = 0.0
        for name in by_axes[axes]:
            nbytes = grads[name][1]
            if current and size + nbytes > cap:
                out.append((axes, current))
                current, size = [], 0.0
            current.append(name)
            size += nbytes
        if current:
            out.append((axes, current))
    return out
