"""Mixture-of-experts blocks found in exported graphs (`core/experts.py`): router, top-k, routed experts
stacked `[E, …]`, shared experts; the parameters a token runs through, against closed forms from the
configs and torch's own counts (the zoo's metadata)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from core.experts import CAPACITY_FACTOR, find_expert_blocks
from costmodel.summary import graph_summary
from planner.graph import load_graph

DIMS = {"batch": 2, "seq": 16}


def _torch_count(model: Path) -> int:
    return int(json.loads(model.with_suffix(".json").read_text())["num_params"])


def test_mixtral_blocks_and_active_parameters(zoo: Callable[[str], Path]) -> None:
    """Mixtral (2 layers, h 64, 4 experts of intermediate 128, top-2): per layer one block, its router
    the gate's [4, 64] weight, its experts the stacked gate-up [4, 256, 64] and down [4, 64, 128]
    weights; a token runs through 2 of 4 experts, so half the routed parameters are idle."""
    model = zoo("mixtral-tiny")
    g = load_graph(model, DIMS)
    blocks = find_expert_blocks(g)
    assert [b.module for b in blocks] == ["model.model.layers.0.mlp", "model.model.layers.1.mlp"]
    for i, b in enumerate(blocks):
        assert (b.num_experts, b.top_k, b.shared) == (4, 2, ())
        assert b.router == (f"model.model.layers.{i}.mlp.gate.weight",)
        assert b.experts == (f"model.model.layers.{i}.mlp.experts.down_proj",
                             f"model.model.layers.{i}.mlp.experts.gate_up_proj")
    routed = 2 * 4 * 3 * 64 * 128
    s = graph_summary(g)
    assert s["parameters"] == _torch_count(model)
    e = s["experts"]
    assert (e["blocks"], e["num_experts"], e["top_k"], e["routed_parameters"]) == (2, [4], [2], routed)
    assert e["active_parameters"] == s["parameters"] - routed // 2
    assert e["capacity_factor"] == CAPACITY_FACTOR == 1.25 and "uniform" in e["routing"]


def test_deepseek_v3_shared_and_routed_experts(zoo: Callable[[str], Path]) -> None:
    """DeepSeek-V3's structure (a dense first layer, then 8 routed experts of intermediate 32 top-2
    beside one shared expert, group-limited routing: three TopKs a block, one of them choosing experts):
    two blocks, each with its shared expert's three weights active for every token."""
    model = zoo("deepseek-v3-tiny")
    g = load_graph(model, DIMS)
    blocks = find_expert_blocks(g)
    assert [b.module for b in blocks] == ["model.model.layers.1.mlp", "model.model.layers.2.mlp"]
    for i, b in zip((1, 2), blocks, strict=True):
        assert (b.num_experts, b.top_k) == (8, 2)
        assert b.shared == tuple(f"model.model.layers.{i}.mlp.shared_experts.{w}_proj.weight"
                                 for w in ("down", "gate", "up"))
    routed, shared = 2 * 8 * 3 * 64 * 32, 2 * 3 * 64 * 32
    e = graph_summary(g)["experts"]
    assert (e["routed_parameters"], e["shared_parameters"]) == (routed, shared)
    assert e["active_parameters"] == _torch_count(model) - routed * 6 // 8


def test_a_dense_model_has_no_experts(zoo: Callable[[str], Path]) -> None:
    assert graph_summary(load_graph(zoo("llama-tiny"), DIMS))["experts"] is None


@pytest.mark.slow
@pytest.mark.extended
def test_inspect_mixtral_8x7b(zoo: Callable[[str], Path]) -> None:
    """`meshplan inspect` of Mixtral-8x7B's config exported shape-only: 46.7 B parameters (torch's count),
    12.9 B active per token, 8 experts top-2 in each of 32 blocks. Closed form from the config (h 4096,
    intermediate 14336, 32 layers, 32 heads of 128 with 8 KV heads, vocabulary 32000): per layer
    attention 2·h² + 2·h·1024, router 8·h, two norms, 8 experts of 3·h·14336; embeddings and head 2·32000·h,
    the final norm; a token visits 2 of the 8 experts."""
    model = zoo("mixtral-8x7b")
    h, inter, layers, vocab = 4096, 14336, 32, 32000
    expert = 3 * h * inter
    per_layer = 2 * h * h + 2 * h * 1024 + 8 * h + 2 * h + 8 * expert
    total = layers * per_layer + 2 * vocab * h + h
    active = total - layers * 6 * expert
    r = subprocess.run([sys.executable, "-m", "cli", "inspect", str(model), "--dim", "batch=1", "--dim", "seq=4096",
                        "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["parameters"] == total == _torch_count(model) and round(total / 1e9, 1) == 46.7
    e = s["experts"]
    assert e["active_parameters"] == active and round(active / 1e9, 1) == 12.9
    assert (e["blocks"], e["num_experts"], e["top_k"]) == (32, [8], [2])


def test_expert_matmuls_are_priced_as_grouped_gemms(zoo: Callable[[str], Path]) -> None:
    """mixtral-tiny on one H100, 4 × 64 tokens: the export's gathered expert weights ([tokens × k, out, in])
    are views of the parameters (no kernel, nothing saved) and each expert matmul is the grouped GEMM's
    FLOPs, 2 · tokens · k · out · in (gate-up: out 2·128, in 64; down: out 64, in 128); the step's saved
    activations are smaller than one such gathered tensor; a capacity factor of 2 prices the experts no
    faster than 1.25 does, and none at all is refused."""
    from core.mesh import DeviceMesh
    from core.placement import OpStrategy, Spec
    from costmodel.memory import PRECISIONS
    from costmodel.step import CostModel
    from hwprofiles.files import load_profile
    from planner.search.plan import make_plan
    from planner.search.request import PlanRequest

    model = zoo("mixtral-tiny")
    dims = {"batch": 4, "seq": 64}
    g = load_graph(model, dims)
    mesh = DeviceMesh.build(1, devices_per_node=8)
    profile = load_profile("h100-sxm")
    cm = CostModel(g, mesh, profile, PRECISIONS["mixed"])
    slots = 4 * 64 * 2
    assert len(cm.experts.matmuls) == 4 and not cm.experts.view_tensors & cm.saved
    flops = []
    for name in cm.experts.matmuls:
        node = g.node_by_name[name]
        st = OpStrategy(input_specs=tuple(Spec.replicated(1) if t else None for t in node.inputs),
                        output_specs=tuple(Spec.replicated(1) for _ in node.outputs))
        flops.append(cm.node_cost(node, st).compute.fwd_matmul_flops)
    assert sorted(flops) == sorted([2 * slots * 256 * 64, 2 * slots * 64 * 128] * 2)
    s, _ = make_plan(PlanRequest(model=str(model), dims=dims, profile="h100-sxm", devices=1, recompute="none"))
    assert s.cost.memory["activations"] < slots * 256 * 64 * 2
    wide, _ = make_plan(PlanRequest(model=str(model), dims=dims, profile="h100-sxm", devices=1, recompute="none",
                                    capacity_factor=2.0))
    assert wide.cost.compute_s >= s.cost.compute_s
    assert (s.training.capacity_factor, wide.training.capacity_factor) == (1.25, 2.0)  # recorded with the plan
    with pytest.raises(ValueError, match="capacity_factor"):
        CostModel(g, mesh, profile, PRECISIONS["mixed"], capacity_factor=0.0)
