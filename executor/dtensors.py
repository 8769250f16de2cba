"""meshplan's placements as DTensor's, and the DTensor moves the executor makes: the one converter
(`to_dtensor`), redistribute with R → P, a split parameter's gradient scattered first, a rank's shard of a whole tensor, and the mesh coordinates
every op asks for."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from core import placement as mp
from core.placement import Spec, chunk


def to_dtensor(spec: Spec) -> list[Placement]:
    """meshplan's placements → DTensor's, one to one (the same vocabulary: S(d), R, P(op))."""
    return [placement(p) for p in spec.placements]


def placement(p: mp.Placement, *, ndim: int | None = None, transposed: bool = False) -> Placement:
    """One placement as DTensor's. `ndim` and `transposed`: a 2-d weight the module holds as the
    transpose of the exported one (a `Fold.LAYOUT` parameter) is split on the other dim."""
    if isinstance(p, mp.Shard):
        d = p.dim % ndim if ndim is not None else p.dim
        return Shard(ndim - 1 - d if transposed and ndim is not None else d)
    if isinstance(p, mp.Partial):
        return Partial(p.reduce_op)
    return Replicate()


@functools.cache
def mesh_coords(mesh: DeviceMesh) -> tuple[tuple[int, int], ...]:
    """(size, this rank's index) per mesh axis: asked for on every op, fixed for a run."""
    return tuple((mesh.size(a), mesh.get_local_rank(a)) for a in range(mesh.ndim))


class _GradAsPartial(torch.autograd.Function):
    """Forward: the value itself. Backward: a whole gradient turned into addends — kept on the first
    rank of the given mesh axes, zero elsewhere — so that it can join partial ones in one reduction."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: bool) -> torch.Tensor:
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad if ctx.keep else torch.zeros_like(grad)), None


def grad_as_partial(x: torch.Tensor, mesh: DeviceMesh, axes: set[int]) -> torch.Tensor:
    if not axes:
        return x
    keep = all(mesh_coords(mesh)[a][1] == 0 for a in axes)
    out: torch.Tensor = _GradAsPartial.apply(x, keep)
    return out


class _ScatterFirst(torch.autograd.Function):
    """Forward: the DTensor itself. Backward: its gradient reduce-scattered onto `mid` first (the
    axes a parameter is split on), so that the all-reduce over the other axes that follows (in
    redistribute's backward) carries a shard, not the whole gradient."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, mid: tuple[Placement, ...]) -> DTensor:
        ctx.mid = mid
        out: DTensor = x.view_as(x)  # type: ignore[assignment]
        return out

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None]:
        return grad.redistribute(grad.device_mesh, list(ctx.mid)), None


class _LowGather(torch.autograd.Function):
    """FSDP2's MixedPrecisionPolicy on one parameter: forward, its fp32 shard cast to the compute dtype
    and gathered in it (`redistribute` from `stored` to `want`); backward, the gradient cast up to the
    shard's dtype and reduced in it, onto the split axes first (`scatter_first`), then to `stored`.
    (Through autograd the cast either precedes the gather — a low-precision reduction — or follows it —
    a full-precision gather; this runs both halves as the policy does.)"""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, mesh: DeviceMesh, stored: tuple[Placement, ...], want: tuple[Placement, ...],
                grad: tuple[Placement, ...], shape: torch.Size, dtype: torch.dtype, ordered: bool) -> torch.Tensor:
        ctx.meta = (mesh, stored, grad, shape, p.dtype, ordered)
        with torch.no_grad():
            x = DTensor.from_local(p.detach().to(dtype), mesh, list(stored), shape=shape, stride=contiguous_stride(shape))
            out: torch.Tensor = redistribute(x, want).to_local()
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        mesh, stored, grad, shape, dtype, ordered = ctx.meta
        with torch.no_grad():
            d = DTensor.from_local(g.to(dtype), mesh, list(grad), shape=shape, stride=contiguous_stride(shape))
            mid = _scatter_mid(stored, grad) if ordered else None
            if mid is not None:
                d = d.redistribute(mesh, list(mid))
            if tuple(d.placements) != tuple(stored):
                d = d.redistribute(mesh, list(stored))
        return d.to_local(), None, None, None, None, None, None, None


def low_gather(p: torch.Tensor, mesh: DeviceMesh, stored: Sequence[Placement], want: Sequence[Placement],
               grad: Sequence[Placement], shape: Sequence[int], dtype: torch.dtype, *, ordered: bool = True) -> torch.Tensor:
    """`p` (a parameter's local shard, stored at `stored`) gathered to `want` in `dtype`, its gradient
    (arriving as `grad`) reduced in p's dtype (`_LowGather`); `ordered`: scatter axes first, else in
    axis order (DTensor's)."""
    out: torch.Tensor = _LowGather.apply(p, mesh, tuple(stored), tuple(want), tuple(grad), torch.Size(shape), dtype,
                                         ordered)
    return out


def _scatter_mid(stored: Sequence[Placement], grad: Sequence[Placement]) -> tuple[Placement, ...] | None:
    """Where a gradient arriving as `grad` is first reduced to, so that it is reduce-scattered over the
    axes its parameter is stored split on before it is all-reduced over the others; None: in axis order
    already."""
    scatter = [a for a, (s, g) in enumerate(zip(stored, grad, strict=True)) if isinstance(g, Partial) and isinstance(s, Shard)]
    reduce = [a for a, (s, g) in enumerate(zip(stored, grad, strict=True)) if isinstance(g, Partial) and not isinstance(s, Shard)]
    if not scatter or not reduce or min(reduce) > max(scatter):
        return None
    return tuple(stored[a] if a in scatter else g for a, g in enumerate(grad))


def scatter_first(x: DTensor, stored: Sequence[Placement], grad: Sequence[Placement]) -> DTensor:
    """`x` (a parameter redistributed from `stored` for use), whose gradient arrives as `grad`, ordered
    so that backward reduce-scatters over the axes the parameter is stored split on before it
    all-reduces over those it is stored whole on — FSDP2's HSDP order. DTensor's redistribute takes
    the axes in order, all-reducing the whole gradient first where a whole axis comes before a split one."""
    mid = _scatter_mid(stored, grad)
    if mid is None:
        return x  # in axis order already
    out: DTensor = _ScatterFirst.apply(x, mid)
    return out


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def redistribute(x: DTensor, want: Sequence[Placement]) -> DTensor:
    """DTensor's redistribute, plus R → P (DTensor refuses to redistribute *to* Partial): the first rank
    of each group along the axis keeps the value, the others hold zeros."""
    mesh = x.device_mesh
    want = list(want)
    to_partial = [a for a, p in enumerate(want) if isinstance(p, Partial) and not isinstance(x.placements[a], Partial)]
    first = [Replicate() if a in to_partial else p for a, p in enumerate(want)]
    if list(x.placements) != first:
        x = x.redistribute(mesh, first)
    if not to_partial:
        return x
    local = x.to_local(grad_placements=[Partial("sum") if a in to_partial else p for a, p in enumerate(first)])
    keep = all(mesh_coords(mesh)[a][1] == 0 for a in to_partial)
    local = local if keep else local * 0
    return DTensor.from_local(local, mesh, want, shape=x.shape, stride=x.stride(),
                              grad_placements=[Replicate() if a in to_partial else p for a, p in enumerate(want)])


def shard_full(full: torch.Tensor, placements: Sequence[Placement], mesh: DeviceMesh) -> DTensor:
    """This rank's shard of a tensor every rank holds whole (same seed, same data): no communication."""
    return DTensor.from_local(local_shard(full, placements, mesh), mesh, placements, shape=full.shape,
                              stride=full.stride())


def local_shard(full: torch.Tensor, placements: Sequence[Placement], mesh: DeviceMesh) -> torch.Tensor:
    """`shard_full`'s local tensor, without the DTensor around it."""
    local = full
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            local = local.narrow(p.dim, *chunk(local.shape[p.dim], *mesh_coords(mesh)[a]))
        elif isinstance(p, Partial):
            raise ValueError("a whole tensor is not partial")
    if local.untyped_storage().nbytes() > local.numel() * local.element_size():
        local = local.clone()  # this rank holds its shard only, as a data loader would give it
    return local.contiguous()


def local_shape(shape: Sequence[int], placements: Sequence[Placement], mesh: DeviceMesh) -> list[int]:
    out = list(shape)
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            out[p.dim] = chunk(out[p.dim], *mesh_coords(mesh)[a])[1]
    return out


def full_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """A parameter's whole gradient (gathered where it is a DTensor)."""
    if p.grad is None:
        raise RuntimeError("a parameter received no gradient")
    return p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
