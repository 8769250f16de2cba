"""Saved activations in host memory, as the plan places them (`costmodel/host_activations.py`): inside
the layers it names, each tensor autograd saves is copied to the host — pinned, without blocking, on a
GPU — and the saved record holds the copy alone, so the device's is freed with the forward's last use
of it; backward copies it back where it reads it. Used through saved-tensor hooks (the run's `Regather`
hooks, `apply`'s per layer): torch's `save_on_cpu` does the same copies, but also copies the weights a
matmul saves and every saved view of one tensor apart; here each storage is copied once a forward (its
saved views kept as views of the copy), and parameters and constants, which the device holds anyway,
stay. On a CPU rank the copy is a second
tensor in the same memory: the path run is the one a GPU runs, its copies included."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from core.graph import OpGraph
from core.levers import Recompute
from costmodel.host_activations import host_layers
from planner.strategy import TrainingSettings


def planned_host_layers(tr: TrainingSettings, graph: OpGraph) -> tuple[dict[str, str], dict[str, int], dict[str, int]]:
    """The plan's layers with activations on the host (`costmodel.host_activations.host_layers`: node →
    layer, group → count), and per group the layers recomputed before them."""
    before = {g.prefix: g.num_layers if tr.recompute.get(g.prefix) == Recompute.SELECTIVE
              else tr.recomputed_layers(g.prefix, g.num_layers) for g in graph.layers}
    on_host, counts = host_layers(graph, tr.offload_activations, before)
    return on_host, counts, before


class HostStorage:
    """One device storage's bytes copied to the host, and its copy back to the device once backward reads
    a view of it (held by the views' saved records: freed with the last, as the storage would have been)."""

    __slots__ = ("__weakref__", "back", "device", "host")

    def __init__(self, device: torch.device, host: torch.Tensor) -> None:
        self.device, self.host = device, host
        self.back: torch.UntypedStorage | None = None

    def restored(self) -> torch.UntypedStorage:
        if self.back is None:
            self.back = self.host.to(self.device, non_blocking=self.host.is_pinned()).untyped_storage()
        return self.back


class OnHost:
    """A saved tensor: a view (dtype, size, stride, offset) of a storage copied to the host."""

    __slots__ = ("dtype", "offset", "size", "storage", "stride")

    def __init__(self, storage: HostStorage, t: torch.Tensor) -> None:
        self.storage, self.dtype = storage, t.dtype
        self.size, self.stride, self.offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()

    def restore(self) -> torch.Tensor:
        storage = self.storage.restored()
        return torch.empty(0, dtype=self.dtype, device=self.storage.device).set_(storage, self.offset, self.size,
                                                                                 self.stride)


class HostActivations:
    """Packs saved tensors to host copies (`pack`; `OnHost.restore` unpacks), each storage once a forward
    (`begin`), counting the host bytes it holds (`peak_bytes`: the most one forward held)."""

    def __init__(self) -> None:
        # data pointer → the device storage and its host copy, both weakly: the copy lives as long as the
        # saved records holding it (autograd frees them as backward uses them), and with it its copy back
        self._copies: dict[int, tuple[StorageWeakRef, weakref.ref[HostStorage]]] = {}
        self._held: set[int] = set()
        self.forward_bytes = 0
        self.peak_bytes = 0

    def begin(self, held: Iterable[torch.Tensor] = ()) -> None:
        """A new forward (a micro-batch): its tensors are new; `held`: tensors the device holds anyway
        (parameters, constants), whose storages saved through views stay."""
        self._copies.clear()
        self._held = {t.untyped_storage().data_ptr() for t in held}
        self.forward_bytes = 0

    def pack(self, t: torch.Tensor) -> Any:
        """`t` itself where it stays on the device (a parameter or a view of one, a constant, a wrapper
        subclass such as a DTensor, not a float), else its view of its storage's host copy."""
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) or \
                type(t) is not torch.Tensor or not t.is_floating_point():
            return t
        storage = t.untyped_storage()
        if storage.data_ptr() in self._held:
            return t
        hit = self._copies.get(storage.data_ptr())
        copy = hit[1]() if hit is not None and not hit[0].expired() else None
        if copy is None:
            pin = t.is_cuda
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            host.copy_(whole, non_blocking=pin)
            copy = HostStorage(t.device, host)
            self._copies[storage.data_ptr()] = (StorageWeakRef(storage), weakref.ref(copy))
            self.forward_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.forward_bytes)
        return OnHost(copy, t)

    @staticmethod
    def unpack(x: Any) -> torch.Tensor:
        return x.restore() if isinstance(x, OnHost) else x

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Saved-tensor hooks that move what is saved inside them to the host."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield
