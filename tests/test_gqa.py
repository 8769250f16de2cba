"""Grouped-query attention under tensor parallelism: k and v split by KV head through repeat_kv, and an
activation redistributed once for all the consumers that need it alike (q, k and v reading one gathered
input), in the plan, the price and the executor."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.gqa import DIMS, _pins, kv_placement
from executor.launch import run
from executor.preflight import RunOptions
from planner.graph import load_graph
from planner.search.plan import make_plan
from planner.search.request import Mode, PlanRequest
from planner.strategy import Strategy


def _plan(path: Path, profile: str, placement: str | None) -> Strategy:
    graph = load_graph(str(path), DIMS)
    strategy, _ = make_plan(PlanRequest(model=str(path), dims=DIMS, profile=profile, devices=4, mesh_shape=(4,),
                                        axis_names=("tp",), mode=Mode.SEMI, pins=_pins(graph, placement)))
    return strategy


def test_kv_split_by_kv_head_on_h100(zoo: Callable[[str], Path]) -> None:
    # Megatron's split of the other projections pinned, k and v left to the ILP on 4 H100s (tensor
    # parallel over 4, 4 KV heads). By KV head (column) they need no communication of their own, through
    # repeat_kv's Expand/Reshape and the exporter's transpose of k for attention's batched matmul (written
    # as a merge of batch and heads, (8, 16, 128, 16) -> (128, 128, 16), transposed and split again:
    # imported as one 4-D Transpose, so the heads stay split through it). Left to the ILP, both are
    # computed by KV head; row-parallel (pinned) is priced slower.
    path = zoo("llama-gqa")
    free, column, row = (_plan(path, "h100-sxm", p) for p in (None, "S(0)", "S(1)"))
    assert kv_placement(column) == "column" and kv_placement(free) == "column"
    assert {str(row.tensors[f"model.model.layers.{i}.self_attn.{p}_proj.weight"].spec) for i in (0, 1) for p in "kv"} \
        == {"S(1)"}  # the row pin held (computed with the weight re-placed: `kv_placement` says "other: P")
    attention = [r for r in column.reshards if column.nodes[r.consumer].module.endswith("self_attn")]
    assert attention == []  # heads split from the projections to o_proj, nothing gathered
    assert free.step_time_s <= column.step_time_s * (1 + 1e-9) and row.step_time_s > column.step_time_s


@pytest.mark.slow
def test_kv_by_kv_head_runs_as_planned(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # The column plan on 4 gloo ranks equals one process, its collectives executed as planned; among them
    # redistributes shared by several consumers (a reshard record without collectives of its own where
    # another consumer's, the same tensor from and to the same specs, carries them).
    path = zoo("llama-gqa")
    strategy = _plan(path, "cpu", "S(0)")
    out = tmp_path / "s.json"
    strategy.save(out)
    doc = json.loads(out.read_text())
    moves = Counter((r["tensor"], r["from"], r["to"], bool(r["collectives"])) for r in doc["reshards"])
    assert any(shared and moves[(t, a, b, True)] for (t, a, b, has), shared in moves.items() if not has)
    r = run(str(out), str(path), nproc=4, opts=RunOptions(steps=1, warmup=0, verify=True, optimizer="sgd"),
            timeout_s=300)
    assert r["max_abs_diff"] < 1e-4
    assert r["collectives_executed"] == r["collectives_planned"]
