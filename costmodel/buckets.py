"""Communication fusion, as DDP and MindSpore's comm_fusion build it: collectives of the same kind over
the same mesh axes packed in a fixed order (parameter names, sorted) into buckets of at most a cap, one
collective per bucket and axis, latency paid per bucket. One module for the three that must agree: the
cost model prices these buckets, the executor runs them, the launcher counts them.

- gradient all-reduces: buckets of at most `CommFusion.allreduce` bytes (DDP's bucket_cap_mb);
- ZeRO-1/2: the parameters whose optimizer states are sharded are packed, per stage and per axes, into
  units of at most `reducescatter` bytes (the seed's ZeRO-1 tensor fusion: one flat buffer each, one
  reduce-scatter per axis); after the optimizer step consecutive units of the same axes are gathered
  together up to `allgather` bytes (one all-gather per axis for the group)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

# Gradient collectives are fused into buckets, as PyTorch DDP does (bucket_cap_mb = 25) and MindSpore's
# all_reduce_fusion_config: latency is paid per bucket, not per parameter.
GRAD_BUCKET_BYTES = 25 * 2**20
FUSION_KINDS = ("allreduce", "allgather", "reducescatter")


@dataclass(frozen=True, kw_only=True, slots=True)
class CommFusion:
    """Bucket caps in bytes per fused kind (MindSpore's comm_fusion: allreduce / allgather / reducescatter)."""

    allreduce: float = GRAD_BUCKET_BYTES
    allgather: float = GRAD_BUCKET_BYTES
    reducescatter: float = GRAD_BUCKET_BYTES

    @classmethod
    def uniform(cls, size: float) -> CommFusion:
        return cls(allreduce=size, allgather=size, reducescatter=size)

    def __post_init__(self) -> None:
        for kind in FUSION_KINDS:
            if getattr(self, kind) <= 0:
                raise ValueError(f"comm fusion {kind}: the bucket size must be positive, got {getattr(self, kind)}")

    def as_dict(self) -> dict[str, float]:
        return {kind: getattr(self, kind) for kind in FUSION_KINDS}

    def __str__(self) -> str:
        sizes = self.as_dict()
        if len(set(sizes.values())) == 1:
            return _mib(self.allreduce)
        return ",".join(f"{k}={_mib(v)}" for k, v in sizes.items())


def _mib(size: float) -> str:
    return f"{size / 2**20:g}MB" if size >= 2**20 else f"{size / 2**10:g}KB" if size >= 2**10 else f"{size:g}B"


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


@dataclass(frozen=True, slots=True)
class ZeroUnit:
    """One fused ZeRO-1/2 buffer: its parameters, the axes its states are sharded over (in order: it
    is reduce-scattered over the first, then the second, ...), and its stage."""

    axes: tuple[int, ...]
    names: tuple[str, ...]
    stage: int


def zero_units(grads: dict[str, tuple[tuple[int, ...], float]], stages: dict[str, int],
               fusion: CommFusion) -> list[ZeroUnit]:
    """The ZeRO-1/2 buffers of the parameters in `stages` (name → 1 or 2): per stage, packed by the
    reduce-scatter cap."""
    out: list[ZeroUnit] = []
    for stage in (1, 2):
        mine = {n: g for n, g in grads.items() if stages.get(n) == stage}
        out += [ZeroUnit(axes, tuple(names), stage) for axes, names in pack_buckets(mine, fusion.reducescatter)]
    return out


def gather_groups(units: list[ZeroUnit], nbytes: dict[str, float], cap: float) -> list[list[int]]:
    """Consecutive units over the same axes gathered by one all-gather per axis, up to `cap` bytes of
    parameters (at least one unit each). Returns unit indices per group."""
    groups: list[list[int]] = []
    size = 0.0
    for i, unit in enumerate(units):
        b = sum(nbytes[n] for n in unit.names)
        if groups and units[groups[-1][-1]].axes == unit.axes and size + b <= cap:
            groups[-1].append(i)
            size += b
        else:
            groups.append([i])
            size = b
    return groups


def zero_split(axes: tuple[int, ...], mesh_shape: tuple[int, ...], shard_size: int | None
               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """MindSpore's optimizer_weight_shard_size: ZeRO shards over the inner axes of `axes` whose sizes
    multiply to `shard_size` (consecutive ranks), the outer ones all-reduce the shard. Returns (the axes
    the states are sharded over, the axes the shard is all-reduced over); None or a size at least the
    whole group: every axis shards. A size no inner run of axes makes raises ValueError."""
    total = 1
    for a in axes:
        total *= mesh_shape[a]
    if shard_size is None or shard_size >= total:
        return axes, ()
    size = 1
    for i in range(len(axes) - 1, -1, -1):
        size *= mesh_shape[axes[i]]
        if size == shard_size:
            return axes[i:], axes[:i]
        if size > shard_size:
            break
    sizes = [1]
    for a in reversed(axes):
        sizes.append(sizes[-1] * mesh_shape[a])
    raise ValueError(f"a ZeRO shard group of {shard_size} ranks is not the inner axes of the {total} ranks a "
                     f"gradient is reduced over (mesh axes of sizes {[mesh_shape[a] for a in axes]}); pick a shard "
                     f"size among {', '.join(map(str, sizes[1:]))} or a mesh whose inner data-parallel axis is "
                     f"{shard_size}")
