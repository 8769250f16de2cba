"""A strategy's pipeline: its stages over sub-meshes and its schedule, as the strategy records them,
and their JSON (part of the strategy file, `planner/strategy.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.levers import Schedule


@dataclass(frozen=True, kw_only=True)
class PipelineStage:
    """One pipeline stage: the devices of its sub-mesh (laid out as the strategy's mesh, which is one
    stage's), the compute nodes it runs (per model chunk: the first and last in topological order), and
    what the planner predicts for it."""
    first_node: str  # its first chunk's first node
    last_node: str  # its last chunk's last node
    devices: tuple[int, ...]
    chunks: tuple[tuple[str, str], ...] = ()  # (first node, last node) per model chunk (several: interleaved)
    layers: int = 0  # repeated layers it holds
    time_s: float = 0.0  # per micro-batch: forward + backward of its nodes, their per-micro-batch collectives
    send_s: float = 0.0  # per micro-batch: its sends to the next stage and their gradients back
    step_s: float = 0.0  # per step: its gradient reductions and optimizer
    memory_bytes: float = 0.0  # per device: its parameters' states and the activations it holds at its peak
    workspace_bytes: float = 0.0  # of that, the loss's backward workspace (allocated there, not saved)
    in_flight: float = 0.0  # micro-batches of activations it holds at its peak


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """Pipeline parallelism: stages over sub-meshes, the schedule, model chunks per device."""
    stages: tuple[PipelineStage, ...]
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    bubble_fraction: float = 0.0  # idle over ideal compute: (p − 1)/(v·m)
    p2p_bytes: float = 0.0  # sent between consecutive stages per micro-batch (forward and backward)
    result_broadcast: bool = False  # MindSpore's pipeline_result_broadcast: the last stage's loss sent to all, each step

    @property
    def devices(self) -> int:
        return sum(len(st.devices) for st in self.stages)



def pipeline_doc(p: Pipeline | None) -> dict[str, Any]:
    if p is None:
        return {"stages": []}
    return {"stages": [{"first_node": st.first_node, "last_node": st.last_node, "devices": list(st.devices),
                        "chunks": [list(c) for c in st.chunks], "layers": st.layers, "time_s": st.time_s,
                        "send_s": st.send_s, "step_s": st.step_s, "memory_bytes": st.memory_bytes, "in_flight": st.in_flight,
                        **({"workspace_bytes": st.workspace_bytes} if st.workspace_bytes else {})}
                       for st in p.stages],
            "schedule": p.schedule, "virtual_stages": p.virtual_stages, "bubble_fraction": p.bubble_fraction,
            "p2p_bytes": p.p2p_bytes, "result_broadcast": p.result_broadcast}


def pipeline_of(d: Mapping[str, Any]) -> Pipeline | None:
    if not d["stages"]:
        return None
    stages = tuple(PipelineStage(first_node=st["first_node"], last_node=st["last_node"], devices=tuple(st["devices"]),
                                 chunks=tuple((a, b) for a, b in st.get("chunks", ())), layers=st.get("layers", 0),
                                 time_s=st.get("time_s", 0.0), send_s=st.get("send_s", 0.0),
                                 step_s=st.get("step_s", 0.0),
                                 memory_bytes=st.get("memory_bytes", 0.0),
                                 workspace_bytes=st.get("workspace_bytes", 0.0), in_flight=st.get("in_flight", 0.0))
                   for st in d["stages"])
    return Pipeline(stages=stages, schedule=Schedule(d.get("schedule", "1f1b")), virtual_stages=d.get("virtual_stages", 1),
                    bubble_fraction=d.get("bubble_fraction", 0.0), p2p_bytes=d.get("p2p_bytes", 0.0),
                    result_broadcast=d.get("result_broadcast", False))
