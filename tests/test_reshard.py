"""Resharding sequences, checked by running their collectives on simulated ranks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from core.collectives import Collective
from core.placement import P, Partial, Placement, R, Shard, Spec, parse_spec
from core.reshard import ReshardStep, conjugate, plan_reshard
from tests.spmd import Locals, chunk_bounds, coords, shard, unshard

SHAPE = (8, 12, 4)


def _groups(mesh_shape: tuple[int, ...], axis: int) -> list[list[tuple[int, ...]]]:
    out: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for c in coords(mesh_shape):
        out.setdefault(c[:axis] + c[axis + 1:], []).append(c)
    return [sorted(g, key=lambda c: c[axis]) for g in out.values()]


def simulate(step: ReshardStep, locals_: Locals, mesh_shape: tuple[int, ...]) -> Locals:
    """Run one step's collective (or local op) on the simulated ranks of each group along its axis."""
    out: Locals = {}
    a, k = step.axis, mesh_shape[step.axis]
    for group in _groups(mesh_shape, a):
        pieces = [locals_[c] for c in group]
        for i, c in enumerate(group):
            if step.collective is Collective.ALL_GATHER:
                assert isinstance(step.src, Shard)
                out[c] = np.concatenate(pieces, axis=step.src.dim)
            elif step.collective is Collective.ALL_REDUCE:
                total = np.sum(pieces, axis=0)
                out[c] = total / k if isinstance(step.src, Partial) and step.src.reduce_op == "avg" else total
            elif step.collective is Collective.REDUCE_SCATTER:
                assert isinstance(step.dst, Shard)
                total = np.sum(pieces, axis=0)
                lo, hi = chunk_bounds(total.shape[step.dst.dim], k, i)
                out[c] = np.take(total, range(lo, hi), axis=step.dst.dim)
            elif step.collective is Collective.ALL_TO_ALL:
                assert isinstance(step.src, Shard) and isinstance(step.dst, Shard)
                full = np.concatenate(pieces, axis=step.src.dim)
                lo, hi = chunk_bounds(full.shape[step.dst.dim], k, i)
                out[c] = np.take(full, range(lo, hi), axis=step.dst.dim)
            elif isinstance(step.dst, Shard):  # local slice
                lo, hi = chunk_bounds(pieces[i].shape[step.dst.dim], k, i)
                out[c] = np.take(pieces[i], range(lo, hi), axis=step.dst.dim)
            else:  # local R → P: one rank keeps the value
                assert isinstance(step.dst, Partial)
                out[c] = pieces[i] if i == 0 else np.zeros_like(pieces[i])
    return out


PLACEMENTS: list[Placement] = [R, P, Shard(0), Shard(1), Shard(2)]


def _all_specs(ndim: int) -> list[Spec]:
    return [Spec(ps) for ps in itertools.product(PLACEMENTS, repeat=ndim)]


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("all_to_all", [True, False], ids=["a2a", "no-a2a"])
def test_every_reshard_pair_numerically(mesh_shape: tuple[int, ...], all_to_all: bool) -> None:
    x = np.random.default_rng(0).standard_normal(SHAPE)
    specs = _all_specs(len(mesh_shape))
    for src, dst in itertools.product(specs, specs):
        plan = plan_reshard(src, dst, SHAPE, mesh_shape, 8, enable_all_to_all=all_to_all)
        locals_ = shard(x, src, mesh_shape)
        for step in plan.steps:
            locals_ = simulate(step, locals_, mesh_shape)
        np.testing.assert_allclose(unshard(locals_, dst, mesh_shape), x, atol=1e-9, err_msg=f"{src} → {dst}: {plan.steps}")
        if not all_to_all:
            assert all(s.collective is not Collective.ALL_TO_ALL for s in plan.steps)


@pytest.mark.parametrize(
    ("src", "dst", "kinds"),
    [
        ("S(0)", "R", [Collective.ALL_GATHER]),
        ("P", "R", [Collective.ALL_REDUCE]),
        ("P", "S(1)", [Collective.REDUCE_SCATTER]),
        ("S(0)", "S(1)", [Collective.ALL_TO_ALL]),
        ("R", "S(1)", [None]),
        ("R", "P", [None]),
        ("S(0),R", "R,S(0)", [Collective.ALL_GATHER, None]),
        ("P,P", "R,R", [Collective.ALL_REDUCE, Collective.ALL_REDUCE]),
    ],
)
def test_sequences_are_the_cheapest_known(src: str, dst: str, kinds: list[Collective | None]) -> None:
    s, d = parse_spec(src), parse_spec(dst)
    mesh = (4,) * len(s.placements)
    plan = plan_reshard(s, d, (16, 16), mesh, 4)
    assert [st.collective for st in plan.steps] == kinds


def test_message_sizes_follow_nccl_conventions() -> None:
    # A 16×16 fp32 tensor (1 KiB) on 4 ranks: all_gather's size is the gathered output (1 KiB),
    # reduce_scatter's the input (1 KiB), all_to_all's the local buffer (256 B).
    shape, mesh = (16, 16), (4,)
    assert plan_reshard(parse_spec("S(0)"), parse_spec("R"), shape, mesh).steps[0].size_bytes == 1024
    assert plan_reshard(parse_spec("P"), parse_spec("S(0)"), shape, mesh).steps[0].size_bytes == 1024
    assert plan_reshard(parse_spec("S(0)"), parse_spec("S(1)"), shape, mesh).steps[0].size_bytes == 256
    assert plan_reshard(parse_spec("P"), parse_spec("R"), shape, mesh).steps[0].size_bytes == 1024


def test_backward_conjugates() -> None:
    def one(src: str, dst: str) -> Collective | None:
        return conjugate(plan_reshard(parse_spec(src), parse_spec(dst), (16, 16), (4,)).steps[0])

    assert one("S(0)", "R") is None  # whole gradient: a local slice (partial ones: see edge_events)
    assert one("P", "S(0)") is Collective.ALL_GATHER
    assert one("S(0)", "S(1)") is Collective.ALL_TO_ALL
    assert one("P", "R") is None
    assert one("R", "S(0)") is Collective.ALL_GATHER  # the replicated source needs the whole gradient
    assert one("R", "P") is Collective.ALL_REDUCE
