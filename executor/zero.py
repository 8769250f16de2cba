"""ZeRO in the executor. ZeRO-1/2: a gradient bucket whose optimizer states (and gradients) are sharded
over its mesh axes, with its parameters fused into one flat buffer (the seed's ZeRO-1 tensor fusion).
ZeRO-3 / FSDP: a parameter gathered from its shards for use is saved for backward only as how to
gather it again (FSDP's reshard after forward), and gathered again when backward needs it."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from core.graph import OpGraph
from executor.dtensors import contiguous_stride, redistribute
from executor.host_activations import OnHost
from executor.interpreter import OnnxModule
from executor.measure import unwrap
from planner.strategy import Strategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement

    from costmodel.buckets import ZeroUnit


class SpmdRunner(Protocol):
    """What ZeRO's buckets and the gather hooks read and replace of the SPMD runner that owns them
    (executor/spmd.py)."""

    mesh: DeviceMesh
    strategy: Strategy
    graph: OpGraph
    module: OnnxModule
    params: dict[str, nn.Parameter]
    stored: dict[str, list[Placement]]


@dataclass
class ZeroBucket:
    """ZeRO-1/2 on one fused unit (`costmodel.buckets.ZeroUnit`): its parameters are views of one flat
    buffer (`weights`, padded to a multiple of the group size), each rank owns a contiguous shard of it
    (`shard`, a view: what the optimizer steps, its states a shard's size). Over several mesh axes the
    buffer is reduce-scattered over the first axis, then the part left over the second, and so on;
    the shard is where that leaves this rank. ZeRO-1 keeps the whole gradients as views of `grads` and
    reduce-scatters once per step (the shard's sum lands in `grads`' own shard, `shard.grad`); ZeRO-2
    has no whole gradient buffer: it reduce-scatters every micro-batch's gradients into `shard.grad` and
    frees them. A shard group smaller than the data-parallel group (optimizer_weight_shard_size) has
    the other axes all-reduce the shard. After the optimizer step the shards are all-gathered back into `weights`
    (`gather_units`, several units in one collective per axis)."""

    names: list[str]
    offsets: dict[str, int]  # where each parameter starts in the flat buffers
    axes: tuple[int, ...]  # the axes the states are sharded over
    groups: list[Any]  # the process group of each
    others: list[Any]  # the groups of the axes that all-reduce the shard (a smaller shard group)
    stage: int
    numel: int  # of the parameters (the buffers are padded beyond it)
    start: int  # where this rank's shard starts in the flat buffers (its length: `shard.numel()`)
    weights: torch.Tensor
    grads: torch.Tensor | None  # ZeRO-1 only
    shard: torch.nn.Parameter

    @classmethod
    def pack(cls, runner: SpmdRunner, unit: ZeroUnit) -> ZeroBucket:
        from costmodel.buckets import zero_split

        mesh = runner.mesh
        names = list(unit.names)
        params = [runner.params[n] for n in names]
        numel = sum(p.numel() for p in params)
        axes, rest = zero_split(unit.axes, tuple(int(x) for x in mesh.shape), runner.strategy.training.zero_shard_size)
        sizes = [int(mesh.shape[a]) for a in axes]
        chunk = -(-numel // math.prod(sizes))
        weights = torch.zeros(chunk * math.prod(sizes), dtype=params[0].dtype, device=params[0].device)
        grads = torch.zeros_like(weights) if unit.stage == 1 else None
        offset, offsets = 0, {}
        for name, p in zip(names, params, strict=True):
            n = p.numel()
            offsets[name] = offset
            weights[offset:offset + n].copy_(p.detach().reshape(-1))
            view = nn.Parameter(weights[offset:offset + n].view_as(p))
            view.grad = p.grad
            if grads is not None:  # this step's local gradient, kept as a view of the bucket
                assert p.grad is not None
                grads[offset:offset + n].copy_(p.grad.reshape(-1))
                view.grad = grads[offset:offset + n].view_as(p)
            runner.params[name] = view
            runner.module.params[runner.module.param_names[name]] = view
            offset += n
        start, length = 0, weights.numel()
        for a, size in zip(axes, sizes, strict=True):  # each reduce-scatter keeps this rank's part
            length //= size
            start += int(mesh.get_local_rank(a)) * length
        shard = nn.Parameter(weights[start:start + chunk])
        shard.grad = (grads[start:start + chunk] if grads is not None
                      else torch.zeros(chunk, dtype=weights.dtype, device=weights.device))
        return cls(names=names, offsets=offsets, axes=axes, groups=[mesh.get_group(a) for a in axes],
                   others=[mesh.get_group(a) for a in rest], stage=unit.stage, numel=numel, start=start,
                   weights=weights,
                   grads=grads, shard=shard)

    def reduce_scatter(self, flat: torch.Tensor, *, accumulate: bool = False) -> None:
        import torch.distributed as dist

        part = flat
        for group in self.groups:
            out = torch.empty(part.numel() // dist.get_world_size(group), dtype=part.dtype, device=part.device)
            dist.reduce_scatter_tensor(out, part.contiguous(), group=group)
            part = out
        for group in self.others:
            dist.all_reduce(part, group=group)
        grad = self.shard_grad
        if accumulate:
            grad.add_(part)
        else:
            grad.copy_(part)

    @property
    def shard_grad(self) -> torch.Tensor:
        """The gradient of this rank's shard (always set: `pack` gives it one)."""
        assert self.shard.grad is not None
        return self.shard.grad

    def zero_grad(self) -> None:
        self.shard_grad.zero_()
        if self.grads is not None:
            self.grads.zero_()

    def full_gradient(self, name: str, p: torch.nn.Parameter) -> torch.Tensor:
        (whole,) = _gather([self.shard_grad.detach()], self.groups)
        start = self.offsets[name]
        return whole[start:start + p.numel()].view_as(p)


def gather_units(units: list[ZeroBucket]) -> None:
    """After the optimizer step: the units' updated shards all-gathered into their flat parameters, one
    all-gather per axis for them all (MindSpore's allgather fusion)."""
    with torch.no_grad():
        for unit, whole in zip(units, _gather([u.shard.detach() for u in units], units[0].groups), strict=True):
            unit.weights.copy_(whole)


def _gather(pieces: list[torch.Tensor], groups: list[Any]) -> list[torch.Tensor]:
    """Undo the reduce-scatters: over the axes in reverse, the pieces concatenated, all-gathered, and
    each piece's part of every rank's contribution put back together (rank-major)."""
    import torch.distributed as dist

    for group in reversed(groups):
        n = dist.get_world_size(group)
        cat = torch.cat([p.reshape(-1) for p in pieces])
        out = torch.empty(n * cat.numel(), dtype=cat.dtype, device=cat.device)
        dist.all_gather_into_tensor(out, cat, group=group)
        rows, offset, parts = out.view(n, cat.numel()), 0, []
        for p in pieces:
            parts.append(rows[:, offset:offset + p.numel()].reshape(-1))
            offset += p.numel()
        pieces = parts
    return pieces


@dataclass(frozen=True)
class _Saved:
    """A gathered parameter (or a view of it) saved for backward, kept as how to gather it again."""

    name: str
    want: list[Any]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: Any = None  # cast to after the gather (autocast's copy for a matmul); None: as gathered
    gather_dtype: Any = None  # cast to before the gather (a `mixed` plan's gather in bf16); None: as stored


class Regather:
    """Saved-tensor hooks over the runner's forward: tensors autograd saves that are (views of) gathered
    parameters become `_Saved` recipes, gathered again in backward (one planned
    re-gather each, through DTensor); in a layer whose activations the plan keeps on the host, every other
    saved tensor goes there (`to_host`); elsewhere it is kept, or what `on_saved` makes of it if set (the run's memory
    measurement, whose own hooks the runner's replace inside its forward)."""

    def __init__(self, runner: SpmdRunner) -> None:
        self.runner = runner
        # This forward's gathered parameters by the id of their storage's tensor, held until forward
        # ends so that the id names them alone.
        self._gathered: dict[int, tuple[str, list[Any], torch.Tensor, Any, bool]] = {}
        self.on_saved: Callable[[torch.Tensor], Any] | None = None
        # Inside a layer whose saved activations the plan keeps on the host: their packer
        # (`HostActivations.pack`), ahead of `on_saved` (the meter counts the device's bytes).
        self.to_host: Callable[[torch.Tensor], Any] | None = None

    def gathered(self, name: str, want: list[Any], local: torch.Tensor, dtype: Any = None, *,
                 gather_dtype: Any = None) -> None:
        root = local._base if local._base is not None else local  # views of it are saved as such too
        self._gathered[id(root)] = (name, want, root, dtype, gather_dtype)

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
            if self.to_host is not None and isinstance(packed := self.to_host(t), OnHost):
                return packed
            return self.on_saved(t) if self.on_saved is not None else t
        return _Saved(hit[0], hit[1], tuple(t.size()), tuple(t.stride()), int(t.storage_offset()), hit[3], hit[4])

    def _unpack(self, x: Any) -> torch.Tensor:
        if isinstance(x, OnHost):
            return x.restore()
        if not isinstance(x, _Saved):
            return unwrap(x)  # a saved tensor, or a measured one (`on_saved`)
        from torch.distributed.tensor import DTensor


        r = self.runner
        shape = r.graph.tensors[x.name].shape
        with torch.no_grad():
            source = r.params[x.name].detach()
            full = DTensor.from_local(source if x.gather_dtype is None else source.to(x.gather_dtype), r.mesh, r.stored[x.name],
                                      shape=torch.Size(shape), stride=contiguous_stride(shape))
            gathered = redistribute(full, x.want).to_local()
            return (gathered if x.dtype is None else gathered.to(x.dtype)).as_strided(x.size, x.stride, x.offset)
