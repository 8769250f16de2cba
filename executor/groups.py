"""At a run's start, the process groups torch created against the plan's (`planner/groups.py`, what
`plan --group-ckpt-out` writes): every group this rank belongs to, read back from torch
(`dist.get_process_group_ranks`), must be the plan's group of that purpose holding this rank."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from core.graph import OpGraph
from executor.preflight import RunError
from planner.groups import plan_groups
from planner.strategy import Strategy


def mesh_groups(mesh: Any) -> list[tuple[str, tuple[int, ...]]]:
    """This rank's group along each axis of a DeviceMesh, as torch holds it."""
    return [(f"mesh axis {name}", tuple(dist.get_process_group_ranks(mesh.get_group(name))))
            for name in mesh.mesh_dim_names]


def check_groups(s: Strategy, graph: OpGraph | None, created: list[tuple[str, tuple[int, ...]]]) -> int:
    """Each created group (purpose, ranks) is the plan's group of that purpose holding this rank, and
    this rank is in a created group of every purpose the plan puts it in; returns how many it checked."""
    rank = dist.get_rank()
    mine: dict[str, set[tuple[int, ...]]] = {}
    for g in plan_groups(s, graph):
        if rank in g.ranks:
            mine.setdefault(g.purpose, set()).add(g.ranks)
    seen: set[str] = set()
    for purpose, ranks in created:
        if ranks not in mine.get(purpose, set()):
            raise RunError(f"rank {rank}: torch's process group for {purpose} holds ranks {list(ranks)}; the plan's "
                           f"groups of that purpose holding it: {sorted(list(r) for r in mine.get(purpose, ()))}")
        seen.add(purpose)
    missing = sorted(set(mine) - seen)
    if missing:
        raise RunError(f"rank {rank}: the plan puts it in a group for {missing[0]}, which the run did not create")
    return len(created)
