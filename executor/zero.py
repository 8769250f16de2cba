"""ZeRO in the executor. ZeRO-1/2: a gradient bucket whose optimizer states (and gradients) are sharded
over one mesh axis, with its parameters fused into one flat buffer (the seed's ZeRO-1 tensor fusion).
ZeRO-3 / FSDP: a parameter gathered from its shards for use is saved for backward only as how to
gather it again (FSDP's reshard after forward), and gathered again when backward needs it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from executor.spmd import SpmdRunner


@dataclass
class ZeroBucket:
    """ZeRO-1/2 on one gradient bucket reduced over one mesh axis: its parameters are views of one
    flat buffer (`weights`, padded to a multiple of the group size), each rank of the axis owns a
    contiguous shard of it (`shard`, a view: what the optimizer steps, its states a shard's size).
    ZeRO-1 keeps the whole gradients as views of `grads` and reduce-scatters once per step (the
    shard's sum lands in `grads`' own shard, `shard.grad`); ZeRO-2 has no whole gradient buffer: it
    reduce-scatters every micro-batch's gradients into `shard.grad` and frees them. After the
    optimizer step the shards are all-gathered back into `weights`."""

    names: list[str]
    offsets: dict[str, int]  # where each parameter starts in the flat buffers
    group: Any
    numel: int  # of the parameters (the buffers are padded beyond it)
    weights: torch.Tensor
    grads: torch.Tensor | None  # ZeRO-1 only
    shard: torch.nn.Parameter

    @classmethod
    def pack(cls, runner: SpmdRunner, axis: int, names: list[str]) -> ZeroBucket:
        mesh = runner.mesh
        params = [runner._params[n] for n in names]
        numel = sum(p.numel() for p in params)
        size, rank = int(mesh.shape[axis]), int(mesh.get_local_rank(axis))
        chunk = -(-numel // size)
        weights = torch.zeros(chunk * size, dtype=params[0].dtype, device=params[0].device)
        grads = torch.zeros_like(weights) if runner.zero_stage == 1 else None
        offset, offsets = 0, {}
        for name, p in zip(names, params, strict=True):
            n = p.numel()
            offsets[name] = offset
            weights[offset:offset + n].copy_(p.detach().reshape(-1))
            view = nn.Parameter(weights[offset:offset + n].view_as(p))
            view.grad = p.grad
            if grads is not None:  # this step's local gradient, kept as a view of the bucket
                grads[offset:offset + n].copy_(p.grad.reshape(-1))
                view.grad = grads[offset:offset + n].view_as(p)
            runner._params[name] = view
            runner.module.params[runner.module.param_names[name]] = view
            offset += n
        shard = nn.Parameter(weights[rank * chunk:(rank + 1) * chunk])
        shard.grad = (grads[rank * chunk:(rank + 1) * chunk] if grads is not None
                      else torch.zeros(chunk, dtype=weights.dtype, device=weights.device))
        return cls(names=names, offsets=offsets, group=mesh.get_group(axis), numel=numel, weights=weights,
                   grads=grads, shard=shard)

    def reduce_scatter(self, flat: torch.Tensor, *, accumulate: bool = False) -> None:
        import torch.distributed as dist

        grad = self.shard_grad
        out = torch.empty_like(grad)
        dist.reduce_scatter_tensor(out, flat, group=self.group)
        if accumulate:
            grad.add_(out)
        else:
            grad.copy_(out)

    @property
    def shard_grad(self) -> torch.Tensor:
        """The gradient of this rank's shard (always set: `pack` gives it one)."""
        assert self.shard.grad is not None
        return self.shard.grad

    def gather(self) -> None:
        import torch.distributed as dist

        with torch.no_grad():
            dist.all_gather_into_tensor(self.weights, self.shard.detach().clone(), group=self.group)

    def zero_grad(self) -> None:
        self.shard_grad.zero_()
        if self.grads is not None:
            self.grads.zero_()

    def full_gradient(self, name: str, p: torch.nn.Parameter) -> torch.Tensor:
        import torch.distributed as dist

        whole = torch.empty_like(self.weights)
        dist.all_gather_into_tensor(whole, self.shard_grad.contiguous(), group=self.group)
        start = self.offsets[name]
        return whole[start:start + p.numel()].view_as(p)


@dataclass(frozen=True)
class _Saved:
    """A gathered parameter (or a view of it) saved for backward, kept as how to gather it again."""

    name: str
    want: list[Any]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class Regather:
    """Saved-tensor hooks over the runner's forward: tensors autograd saves that are (views of) gathered
    parameters become `_Saved` recipes, gathered again in backward (one planned
    re-gather each, through DTensor); every other saved tensor is kept and shown to `on_saved` (the run's memory
    measurement, whose own hooks the runner's replace inside its forward)."""

    def __init__(self, runner: SpmdRunner) -> None:
        self.runner = runner
        # This forward's gathered parameters by the id of their storage's tensor, held until forward
        # ends so that the id names them alone.
        self._gathered: dict[int, tuple[str, list[Any], torch.Tensor]] = {}
        self.on_saved: Callable[[torch.Tensor], Any] | None = None

    def gathered(self, name: str, want: list[Any], local: torch.Tensor) -> None:
        root = local._base if local._base is not None else local  # views of it are saved as such too
        self._gathered[id(root)] = (name, want, root)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._gathered = {}

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        hit = self._gathered.get(id(base))
        if hit is None:
            if self.on_saved is not None:
                self.on_saved(t)
            return t
        return _Saved(hit[0], hit[1], tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))

    def _unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, _Saved):
            return x
        from torch.distributed.tensor import DTensor

        from executor.spmd import contiguous_stride, redistribute

        r = self.runner
        shape = r.graph.tensors[x.name].shape
        with torch.no_grad():
            full = DTensor.from_local(r._params[x.name].detach(), r.mesh, r.stored[x.name], shape=torch.Size(shape),
                                      stride=contiguous_stride(shape))
            return redistribute(full, x.want).to_local().as_strided(x.size, x.stride, x.offset)
