"""Measuring a training step as the cost model predicts it: the collectives it runs, and the
activations it keeps for backward.

`CollectiveCounter` is a dispatch mode that counts the collectives torch runs, by our kind names:
DTensor's functional collectives and the c10d ones called directly (bucketed all-reduces, ZeRO). It
tracks no modules (torch's CommDebugMode does, and its tracker breaks on a pipeline stage's module).

`SavedMeter` is a pair of saved-tensor hooks: every tensor autograd saves (parameters, views of them
and the module's constants aside: they are model states, or held whether or not a step runs) is held
through a small `Held` record that adds its storage's bytes while it lives and takes them off when
autograd lets it go after backward (several saved views of one storage count once). Under full
recomputation it also counts the layers' inputs the executor keeps (`keep`) and what each
recomputation leaves alive for its layer's backward (`watch`). The meter's peak is the most a step held at one time: one micro-batch's worth when they
run one after another, several when a pipeline schedule keeps several in flight.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# Collective ops (their overload packets' names) → our kinds. Functional collectives (DTensor's), and
# c10d's (bucketed gradient all-reduces, ZeRO's reduce-scatters and gathers).
COLLECTIVE_KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                    "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all",
                    "allreduce_": "all_reduce", "_reduce_scatter_base_": "reduce_scatter",
                    "_allgather_base_": "all_gather", "broadcast_": "broadcast",
                    "alltoall_base_": "all_to_all"}
_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")


class CollectiveCounter(TorchDispatchMode):
    """The collectives torch runs, by kind, and by kind and dtype (`by_dtype`); and the dtypes the
    reducing ones (all-reduce, reduce-scatter) carried, over every counter of this process
    (`reduce_dtypes`)."""

    reduce_dtypes: ClassVar[set[str]] = set()

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.by_dtype: Counter[tuple[str, str]] = Counter()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile compiles under this mode (otherwise Dynamo runs every frame eager while a mode is
        on); it counts the collectives outside compiled code (FSDP2's, DDP's), not those traced into a
        compiled graph."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor first turns itself into local ops and collectives
        if isinstance(func, torch._ops.OpOverload) and func.namespace in _NAMESPACES:
            kind = COLLECTIVE_KINDS.get(func._overloadpacket.__name__)
            if kind is not None:
                self.counts[kind] += 1
                first = next((a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)), None)
                if first is not None:
                    dtype = str(first.dtype).removeprefix("torch.")
                    self.by_dtype[kind, dtype] += 1
                    if kind in ("all_reduce", "reduce_scatter"):
                        CollectiveCounter.reduce_dtypes.add(dtype)
        return func(*args, **(kwargs or {}))


class SavedMeter:
    def __init__(self, module: torch.nn.Module | None = None) -> None:
        self.now = 0
        self.peak = 0
        self._refs: Counter[int] = Counter()
        self._bytes: dict[int, int] = {}
        self._module = module
        self._held_anyway: frozenset[int] = frozenset()

    def reset(self) -> None:
        """A new step: the peak from what is held now. The storages of the module's parameters and
        constants (an attention mask folded at load, a transposed weight's storage) are read again
        here, as a ZeRO bucket or a loaded checkpoint may have moved them."""
        self.peak = self.now
        if self._module is not None:
            values = getattr(self._module, "values", {})
            tensors = [*self._module.parameters(), *(v for v in values.values() if isinstance(v, torch.Tensor))]
            self._held_anyway = frozenset(_storage_key(t) for t in tensors)

    def pack(self, t: torch.Tensor) -> object:
        if isinstance(t, torch.nn.Parameter):
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._held_anyway:
            return t
        if not self._refs[key]:
            self._bytes[key] = storage.nbytes()
            self.now += self._bytes[key]
            self.peak = max(self.peak, self.now)
        self._refs[key] += 1
        # Held keeps a detached alias (same storage, no grad_fn): a saved *output* held as itself would
        # point back at the node that saves it (node → saved variable → Held → tensor → grad_fn = node),
        # a cycle through C++ that gc cannot see, so a graph dropped without its backward (pipelining's
        # shape-inference forward on the first stage) would stay alive and counted for the whole run.
        # Autograd puts the grad_fn back on unpack.
        return Held(t.detach(), key, self)

    def release(self, key: int) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.now -= self._bytes.pop(key)

    @staticmethod
    def unpack(x: object) -> torch.Tensor:
        return unwrap(x)

    def keep(self, tensors: list[torch.Tensor]) -> list[object]:
        """Tensors held outside autograd for as long as the returned records live (a recomputed
        layer's inputs, which the executor keeps from forward to backward)."""
        return [self.pack(t) for t in tensors]

    def watch(self) -> RecomputeWatch:
        return RecomputeWatch(self)


class RecomputeWatch(TorchDispatchMode):
    """Around one recomputation (torch.utils.checkpoint's, in backward): the storages its ops make,
    and when it ends, those still alive — what the checkpoint keeps for the layer's backward, the
    rest freed as it returned — on top of what the meter holds at that moment."""

    def __init__(self, meter: SavedMeter) -> None:
        super().__init__()
        self.meter = meter
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor first turns itself into local ops and collectives
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if type(t) is torch.Tensor:  # not a wrapper subclass (a functional collective's pending result)
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and (key not in self.made or self.made[key][0].expired()):
                    self.made[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        alive = sum(n for ref, n in self.made.values() if not ref.expired())
        self.meter.peak = max(self.meter.peak, self.meter.now + alive)


def _storage_key(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.untyped_storage().data_ptr()


class Held:
    """A saved tensor while autograd holds it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter.release(self.key)


def unwrap(x: object) -> torch.Tensor:
    return x.tensor if isinstance(x, Held) else x  # type: ignore[return-value]
