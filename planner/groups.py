"""The process groups a plan's run creates, as rank lists with their purpose (`plan --group-ckpt-out`,
MindSpore's group_ckpt_save_file): a later job or a checkpoint tool rebuilds them from the file, and
the executor checks at start that torch made exactly these (`executor/groups.py`).

Ranks are laid out as `init_device_mesh` lays them: row-major over the mesh — (pp, *stage mesh) for a
pipeline, whose stage s holds ranks s·n … s·n + n − 1. The groups:
  mesh axis NAME     one per slice along the axis (DeviceMesh makes one for every axis, size 1 too)
  pipeline stage     each stage's devices (its sub-mesh)
  tied weight T      the copies of a weight read by several stages (the embedding and the head), one
                     group per position in the stage mesh, summing their gradients
ZeRO's shard groups are whole mesh axes (`costmodel.buckets.zero_split`): they are the axes' groups."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.graph import OpGraph
from planner.stagecut import param_stages, strategy_chunks
from planner.strategy import Strategy

VERSION = 1


@dataclass(frozen=True)
class Group:
    purpose: str  # "mesh axis NAME", "pipeline stage", "tied weight T"
    ranks: tuple[int, ...]


def plan_groups(s: Strategy, graph: OpGraph | None = None) -> list[Group]:
    """Every group a run of `s` creates, in the order the executor creates them. `graph`: the model, for
    a pipeline's tied weights (which stages read a weight)."""
    pipe = s.pipeline
    shape = (len(pipe.stages), *s.mesh.shape) if pipe is not None else tuple(s.mesh.shape)
    names = ("pp", *s.mesh.axis_names) if pipe is not None else tuple(s.mesh.axis_names)
    out = [Group(f"mesh axis {name}", ranks) for a, name in enumerate(names) for ranks in _slices(shape, a)]
    if pipe is None:
        return out
    if graph is None:
        raise ValueError("a pipelined plan's groups need its graph (the stages that read each weight)")
    holders = param_stages(graph, strategy_chunks(graph, pipe), len(pipe.stages))
    n = s.mesh.num_devices
    for t in sorted(t for t, held in holders.items() if len(held) > 1):
        out += [Group(f"tied weight {t}", tuple(pipe.stages[st].devices[j] for st in holders[t])) for j in range(n)]
    out += [Group("pipeline stage", tuple(st.devices)) for st in pipe.stages]
    return out


def _slices(shape: tuple[int, ...], axis: int) -> list[tuple[int, ...]]:
    """The rank lists along `axis` of a row-major mesh of `shape`, in order of the other coordinates."""
    stride = math.prod(shape[axis + 1:])
    others = [i for i in range(math.prod(shape)) if (i // stride) % shape[axis] == 0]
    return [tuple(base + k * stride for k in range(shape[axis])) for base in others]


def groups_doc(s: Strategy, groups: list[Group]) -> dict[str, Any]:
    return {"version": VERSION, "model": s.model.name, "world_size": s.pipeline.devices if s.pipeline else
            s.mesh.num_devices, "mesh": {"shape": list(s.mesh.shape), "axis_names": list(s.mesh.axis_names)},
            "pipeline_stages": len(s.pipeline.stages) if s.pipeline else 1,
            "groups": [{"purpose": g.purpose, "ranks": list(g.ranks)} for g in groups]}


def save_groups(s: Strategy, graph: OpGraph | None, path: str | Path) -> list[Group]:
    groups = plan_groups(s, graph)
    Path(path).write_text(json.dumps(groups_doc(s, groups), indent=1) + "\n")
    return groups
