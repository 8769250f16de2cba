"""Placements and sharding specs: how one tensor lies on a device mesh.

A spec holds one placement per mesh axis, the vocabulary of `torch.distributed.tensor` so that the
executor maps 1:1: `Shard(d)` splits tensor dim d over the axis (torch.chunk semantics: the first
ranks hold ceil(n/k), the last may hold less or nothing), `Replicate()` copies it, `Partial("sum")`
holds addends that sum to the tensor. `dims_mapping` is Paddle's view of the same: for each tensor
dim, the mesh axis that splits it or −1. String form, as on the CLI and in JSON: "S(0),R", "P,S(1)".
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from core.errors import MeshplanError


class PlacementError(MeshplanError):
    """A placement string that does not parse or does not fit its tensor or mesh."""


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    reduce_op: str = "sum"

    def __str__(self) -> str:
        return "P" if self.reduce_op == "sum" else f"P({self.reduce_op})"


Placement = Shard | Replicate | Partial
R = Replicate()
P = Partial()


@dataclass(frozen=True, slots=True)
class Spec:
    """Placements of one tensor, one per mesh axis."""

    placements: tuple[Placement, ...]
    # Its hash, taken once: specs key the planner's caches, ~10^6 lookups for an 80-layer model
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(self.placements))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[Spec], tuple[tuple[Placement, ...]]]:
        return Spec, (self.placements,)  # (a string's hash differs between processes: taken again)

    def __str__(self) -> str:
        return ",".join(map(str, self.placements))

    def __repr__(self) -> str:
        return f"Spec({self})"

    @staticmethod
    def replicated(mesh_ndim: int) -> Spec:
        return Spec((R,) * mesh_ndim)

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    @property
    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def storable(self) -> Spec:
        """The spec a stored value (a parameter, loaded data) can have: partial sums are not stored,
        replicated instead (a consumer needing P converts locally)."""
        return Spec(tuple(R if isinstance(p, Partial) else p for p in self.placements))

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes splitting tensor dim `dim`, outermost first."""
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim)

    def num_shards(self, dim: int, mesh_shape: tuple[int, ...]) -> int:
        return math.prod(mesh_shape[a] for a in self.shard_axes(dim))

    def dims_mapping(self, ndim: int) -> list[int | list[int]]:
        """Tensor dim → the mesh axis splitting it (−1 if none; a list if several axes do)."""
        out: list[int | list[int]] = []
        for d in range(ndim):
            axes = list(self.shard_axes(d))
            out.append(-1 if not axes else axes[0] if len(axes) == 1 else axes)
        return out

    def local_shape(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The largest local shard (rank 0's under torch.chunk), the one that bounds time and memory."""
        return _local_shape(self, tuple(shape), tuple(mesh_shape))

    def normalized(self, mesh_shape: tuple[int, ...]) -> Spec:
        """On a mesh axis of one device every placement holds the same data: call it replicated."""
        return Spec(tuple(R if mesh_shape[a] == 1 else p for a, p in enumerate(self.placements)))

    def shard_count(self, mesh_shape: tuple[int, ...]) -> int:
        """Into how many pieces the tensor is cut (the product of the sizes of the axes that split it)."""
        return math.prod(mesh_shape[a] for a, p in enumerate(self.placements) if isinstance(p, Shard))

    def validate(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...], what: str = "tensor") -> None:
        if len(self.placements) != len(mesh_shape):
            raise PlacementError(f"{what}: {len(self.placements)} placements ({self}) for a {len(mesh_shape)}-d mesh; "
                                 "give one per mesh axis")
        for p in self.placements:
            if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
                raise PlacementError(f"{what}: {p} names dim {p.dim} but the tensor has {len(shape)} dims "
                                     f"(shape {list(shape)})")


def chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """Start and length of chunk i of n split k ways, as torch.chunk (and DTensor's Shard) cut it: chunks
    of ⌈n/k⌉, the last ones shorter or empty. The one place this arithmetic lives (planner, cost model
    and executor all use it)."""
    c = -(-n // k)
    start = min(i * c, n)
    return start, max(0, min((i + 1) * c, n) - start)


def split_axes(specs: Iterable[Spec | None], mesh_shape: tuple[int, ...]) -> frozenset[int]:
    """Mesh axes along which an op divides its work: some input or output is not replicated there.
    The one definition the cost model (which gradients come out partial) and the executor share."""
    placed = [s for s in specs if s is not None]
    return frozenset(a for a in range(len(mesh_shape)) if mesh_shape[a] > 1 and any(
        not isinstance(s.placements[a], Replicate) for s in placed))


def gradient_spec(want: Spec, split: frozenset[int]) -> Spec:
    """The gradient arriving at an input an op reads at `want`: partial where the op is split and the
    input replicated (each rank's addend), replicated where the input is partial (d(sum)/d(addend) is
    the same everywhere), else placed as the input."""
    return Spec(tuple(Partial("sum") if isinstance(p, Replicate) and a in split else R if isinstance(p, Partial)
                      else p for a, p in enumerate(want.placements)))


def fully_sharded(shape: tuple[int, ...], mesh: tuple[int, ...], spec: Spec,
                  over: tuple[int, ...] | None = None) -> Spec | None:
    """ZeRO-3 / FSDP as a choice per parameter: stored split on dim 0 over every axis it is replicated
    on (of `over`, where given), gathered for use (and again in backward), its gradient
    reduce-scattered. None when there is no such axis or dim 0 is smaller than the shards."""
    axes = [a for a, pl in enumerate(spec.placements)
            if isinstance(pl, Replicate) and mesh[a] > 1 and (over is None or a in over)]
    if not axes or not shape or shape[0] < math.prod(mesh[a] for a in axes) * spec.num_shards(0, mesh):
        return None
    return Spec(tuple(Shard(0) if a in axes else pl for a, pl in enumerate(spec.placements)))


_TOKEN = re.compile(r"^(?:S\((-?\d+)\)|R|P(?:\((sum|avg|max)\))?)$")


def parse_placement(text: str) -> Placement:
    m = _TOKEN.match(text.strip())
    if not m:
        raise PlacementError(f"placement {text.strip()!r} does not parse; use S(dim), R or P")
    t = text.strip()
    if t.startswith("S"):
        return Shard(int(m.group(1)))
    if t.startswith("P"):
        return Partial(m.group(2) or "sum")
    return R


def parse_spec(text: str, ndim: int | None = None) -> Spec:
    """"S(0),R" → Spec((Shard(0), Replicate())); negative dims count from the end when `ndim` is known."""
    parts = [p for p in re.split(r",(?![^(]*\))", text) if p.strip()]
    if not parts:
        raise PlacementError(f"placements {text!r} are empty; write one per mesh axis, e.g. S(0),R")
    out: list[Placement] = []
    for part in parts:
        p = parse_placement(part)
        if isinstance(p, Shard) and p.dim < 0:
            if ndim is None:
                raise PlacementError(f"placement {p} counts from the end; give a non-negative dim")
            p = Shard(p.dim + ndim)
        out.append(p)
    return Spec(tuple(out))


@dataclass(frozen=True, slots=True)
class OpStrategy:
    input_specs: tuple[Spec | None, ...]
    output_specs: tuple[Spec, ...]
    kernels: tuple[str, ...] = ()  # per mesh axis, "" for the op itself

    @property
    def name(self) -> str:
        ins = " ".join(f"[{s}]" if s is not None else "-" for s in self.input_specs)
        outs = " ".join(f"[{s}]" for s in self.output_specs)
        return f"{ins} → {outs}"

    def __str__(self) -> str:
        return self.name

    @property
    def is_replicated(self) -> bool:
        return all(s is None or s.is_replicated for s in (*self.input_specs, *self.output_specs))


@functools.lru_cache(maxsize=1 << 16)
def _local_shape(spec: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """`Spec.local_shape`, memoised: the planner asks it of the same few (spec, shape) pairs ~10^5 times."""
    return tuple(chunk(size, spec.num_shards(d, mesh_shape), 0)[1] if size else 0 for d, size in enumerate(shape))
