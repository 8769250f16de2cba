"""`plan --group-ckpt-out` (MindSpore's group_ckpt_save_file): every process group a plan's run creates,
as rank lists with their purpose, against the groups torch creates when the executor sets up the run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core.errors import MeshplanError


def worker(rank: int, port: int, strategy: str, model: str, out: Any) -> None:
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from executor.groups import check_groups, mesh_groups
    from executor.pipeline import stage_groups
    from planner.graph import load_graph
    from planner.stagecut import param_stages, strategy_chunks
    from planner.strategy import load_strategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=8)
    try:
        s = load_strategy(strategy)
        graph = load_graph(model, dict(s.model.dims))
        pipe = s.pipeline
        assert pipe is not None
        # as PipelinedStep sets up its run: the (pp, *stage mesh) device mesh, then the stages' groups
        world = init_device_mesh("cpu", (len(pipe.stages), *s.mesh.shape), mesh_dim_names=("pp", *s.mesh.axis_names))
        holders = param_stages(graph, strategy_chunks(graph, pipe), len(pipe.stages))
        shared = sorted(t for t, held in holders.items() if len(held) > 1)
        n = s.mesh.num_devices
        ties, stage = stage_groups(pipe, holders, shared, rank // n, rank % n)
        created = [*mesh_groups(world), ("pipeline stage", tuple(dist.get_process_group_ranks(stage))),
                   *((f"tied weight {t}", tuple(dist.get_process_group_ranks(g))) for t, g in ties.items())]
        checked = check_groups(s, graph, created)
        out.put(("report", rank, created, checked))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    del torch


@pytest.mark.slow
def test_group_file_lists_the_groups_the_executor_creates(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    """gpt2-tiny-4l as pp=2 × dp_shard=2 × tp=2 on 8 ranks: the file lists each axis's 4 groups of 2, the 2
    stages' groups of 4 and the tied embedding's 4 groups (one per stage-mesh position: its copies on the
    first and last stage); the union of the groups torch made on the 8 gloo ranks, read back from torch,
    is exactly that list, and each rank's check against the plan passes."""
    from executor.ranks import run_ranks

    model = zoo("gpt2-tiny-4l")
    groups = tmp_path / "groups.json"
    r = subprocess.run([sys.executable, "-m", "cli", "plan", str(model), "--dim", "seq=32", "--devices", "8",
                        "--profile", "cpu", "--global-batch-size", "8", "--layout", "pp=2,dp_shard=2,tp=2",
                        "--zero", "3", "-o", str(tmp_path / "s.json"), "--group-ckpt-out", str(groups)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(groups.read_text())
    listed = {(g["purpose"], tuple(g["ranks"])) for g in doc["groups"]}
    assert len(listed) == len(doc["groups"]) and doc["world_size"] == 8
    by_purpose: dict[str, int] = {}
    for purpose, ranks in listed:
        kind = "tied weight" if purpose.startswith("tied weight") else purpose
        by_purpose[kind] = by_purpose.get(kind, 0) + 1
        assert len(ranks) == (4 if purpose == "pipeline stage" else 2), (purpose, ranks)
    assert by_purpose == {"mesh axis pp": 4, "mesh axis dp_shard": 4, "mesh axis tp": 4, "pipeline stage": 2,
                          "tied weight": 4}, by_purpose
    created: set[tuple[str, tuple[int, ...]]] = set()
    checked: list[int] = []

    def handle(msg: tuple[Any, ...]) -> bool:
        created.update(msg[2])
        checked.append(msg[3])
        return len(checked) == 8

    run_ranks(worker, 8, lambda rank, port, q: (rank, port, str(tmp_path / "s.json"), str(model), q), handle,
              timeout_s=300, error=MeshplanError, what="the groups")
    assert created == listed
    assert checked == [3 + 1 + 1] * 8  # per rank: its 3 axes' groups, its stage's, its tied weight's


def test_group_file_of_a_mesh(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    """Without a pipeline: each axis's slices of the row-major mesh (dp_shard=2 × tp=2: ranks 0 and 2
    share a tp position, 0 and 1 a dp_shard one)."""
    from planner.groups import plan_groups
    from planner.search.plan import make_plan
    from planner.search.request import PlanRequest

    s, _ = make_plan(PlanRequest(model=str(zoo("gpt2-tiny")), dims={"batch": 8, "seq": 32}, profile="cpu", devices=4,
                                 layout="dp_shard=2,tp=2", zero_stage=3))
    assert [(g.purpose, g.ranks) for g in plan_groups(s)] == [
        ("mesh axis dp_shard", (0, 2)), ("mesh axis dp_shard", (1, 3)), ("mesh axis tp", (0, 1)),
        ("mesh axis tp", (2, 3))]
