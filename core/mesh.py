"""DeviceMesh: N devices arranged as an n-d grid with named axes (Paddle's ProcessMesh).

Devices are numbered row-major, so the last axis is the innermost: with 8 devices per node, a (8, 8)
mesh keeps axis 1 inside a node and spreads axis 0 across nodes. Each axis knows which link level its
groups cross, and so does any group spanning several axes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from core.collectives import LinkLevel
from core.errors import MeshplanError


class MeshError(MeshplanError):
    """A mesh that cannot be built on the given devices."""


@dataclass(frozen=True, kw_only=True)
class DeviceMesh:
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    devices: tuple[int, ...]  # device ids, row-major over `shape`
    devices_per_node: int = 1

    def __post_init__(self) -> None:
        if not self.shape:
            raise MeshError("a mesh needs at least one axis")
        for name, size in zip(self.axis_names, self.shape, strict=False):
            if size < 1:
                raise MeshError(f"mesh axis {name!r} has size {size}; every axis needs at least 1 device")
        if len(self.axis_names) != len(self.shape):
            raise MeshError(f"{len(self.axis_names)} axis names for a {len(self.shape)}-d mesh; give one name per axis")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise MeshError(f"axis names {', '.join(self.axis_names)} repeat; give each axis its own name")
        if math.prod(self.shape) != len(self.devices):
            raise MeshError(f"mesh {self.describe_shape()} holds {math.prod(self.shape)} devices, not {len(self.devices)}")
        if self.devices_per_node < 1:
            raise MeshError(f"devices_per_node must be at least 1, got {self.devices_per_node}")

    @classmethod
    def build(cls, num_devices: int, shape: tuple[int, ...] | None = None, axis_names: tuple[str, ...] | None = None,
              *, devices_per_node: int = 1) -> DeviceMesh:
        """The mesh over devices 0..N−1; `shape` defaults to 1-d, names to dp, tp (2-d) or axis0, axis1, …"""
        if num_devices < 1:
            raise MeshError(f"`devices` {num_devices}: needs at least 1 device")
        shape = shape or (num_devices,)
        if any(s < 1 for s in shape):
            raise MeshError(f"mesh {'x'.join(map(str, shape))}: every axis needs at least 1 device")
        if math.prod(shape) != num_devices:
            raise MeshError(f"mesh {'x'.join(map(str, shape))} multiplies to {math.prod(shape)}, not `devices` "
                            f"{num_devices}; pick a shape whose sizes multiply to {num_devices}")
        if axis_names is None:
            axis_names = {1: ("dp",), 2: ("dp", "tp")}.get(len(shape), tuple(f"axis{i}" for i in range(len(shape))))
        return cls(shape=tuple(shape), axis_names=tuple(axis_names), devices=tuple(range(num_devices)),
                   devices_per_node=devices_per_node)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def describe_shape(self) -> str:
        return "x".join(map(str, self.shape))

    def __str__(self) -> str:
        return f"{self.describe_shape()} ({', '.join(f'{n}={s}' for n, s in zip(self.axis_names, self.shape, strict=True))})"

    def axis_index(self, name: str) -> int:
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise MeshError(f"no mesh axis {name!r}; the axes are {', '.join(self.axis_names)}") from None

    def group_size(self, axes: tuple[int, ...]) -> int:
        return math.prod(self.shape[a] for a in axes)

    @cached_property
    def _grid(self) -> np.ndarray:
        return np.array(self.devices).reshape(self.shape)

    @functools.cache  # noqa: B019 — meshes are few, immutable and hashable
    def groups(self, axes: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The device groups of a collective over `axes`: one group per index of the other axes."""
        others = [a for a in range(self.ndim) if a not in axes]
        moved = np.transpose(self._grid, others + list(axes))
        return [tuple(int(d) for d in g) for g in moved.reshape(-1, self.group_size(axes))]

    @functools.cache  # noqa: B019
    def level(self, axes: tuple[int, ...]) -> LinkLevel:
        """INTER_NODE if any group over `axes` spans more than one node."""
        for g in self.groups(axes):
            if len({d // self.devices_per_node for d in g}) > 1:
                return LinkLevel.INTER_NODE
        return LinkLevel.INTRA_NODE

    @functools.cache  # noqa: B019
    def inner_group_size(self, axes: tuple[int, ...]) -> int:
        """Devices of one group that share a node (for hierarchical collectives)."""
        g = self.groups(axes)[0]
        node0 = g[0] // self.devices_per_node
        return sum(1 for d in g if d // self.devices_per_node == node0)
