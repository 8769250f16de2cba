"""The training step's levers against closed forms: gradient accumulation (k micro-steps, gradients
reduced once), ZeRO-1/2 (optimizer states, then gradients, sharded over the data-parallel ranks;
reduce-scatter + all-gather instead of all-reduce), and the planner's and CLI's handling of them."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cli import main
from core.collectives import Cadence, Collective, Phase, Purpose
from core.graph import OpGraph, TensorKind
from core.mesh import DeviceMesh
from core.placement import OpStrategy, R, Shard, Spec
from costmodel.buckets import CommFusion, pack_buckets
from costmodel.comm import collective_time_s
from costmodel.memory import PRECISIONS, model_state_bytes
from costmodel.step import CostModel
from hwprofiles.files import load_profile
from planner.graph import load_graph
from planner.rules import OpContext, replicated_strategy, strategies_for
from planner.search.plan import make_plan
from planner.search.request import PlanRequest
from planner.strategy import Strategy, load_strategy

H100 = load_profile("h100-sxm")
BF16 = PRECISIONS["bf16"]


def data_parallel_plan(g: OpGraph, mesh: DeviceMesh) -> dict[str, OpStrategy]:
    """Every node with its batch split over axis 0, everything else replicated."""
    def dp(s: OpStrategy) -> bool:
        return str(s.input_specs[0]) == "S(0)" and all(sp is None or str(sp) == "R" for sp in s.input_specs[1:])

    return {n.name: next(filter(dp, strategies_for(n, g, mesh).strategies)) for n in g.compute_nodes}


def run_equals_one_process(s: Strategy, model: Path, tmp: Path, optimizer: str = "adamw") -> dict[str, Any]:
    """Run a strategy on its mesh's ranks (a step, then one more; verified against one process) and
    check it equals one process (< 1e-5, fp32) and runs the planned collectives, per kind and count."""
    from executor.launch import run
    from executor.preflight import RunOptions

    s.save(tmp / "s.json")
    r = run(str(tmp / "s.json"), str(model), nproc=s.pipeline.devices if s.pipeline else s.mesh.num_devices, timeout_s=240,
            opts=RunOptions(steps=1, warmup=1, verify=True, optimizer=optimizer))
    assert r["max_abs_diff"] < 1e-5, r
    assert r["collectives_executed"] == r["collectives_planned"]
    return r


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_stages_model_states_and_collectives(stage: int, zoo: Callable[[str], Path]) -> None:
    # Data parallelism over n = 4: ZeRO's per-device model states (Rajbhandari et al. 2020, §5) —
    # stage 0 (2+2+12)Ψ, stage 1 (2+2)Ψ + 12Ψ/n, stage 2 2Ψ + (2+12)Ψ/n — and the gradient all-reduce
    # replaced by a reduce-scatter of the gradients (2Ψ bytes) and an all-gather of the updated weights
    # (2Ψ bytes): the all-reduce's volume, in as many buckets.
    g = load_graph(zoo("mlp"), {"batch": 32})
    n = 4
    mesh = DeviceMesh.build(n, devices_per_node=8)
    cost = CostModel(g, mesh, H100, BF16, zero_stage=stage).price(data_parallel_plan(g, mesh))
    psi = g.num_params
    states = cost.memory["parameters"] + cost.memory["gradients"] + cost.memory["optimizer"]
    assert states == pytest.approx(model_state_bytes(psi, BF16, zero_stage=stage, dp_degree=n))
    kinds = {(e.kind, e.purpose, e.phase, e.cadence) for e in cost.events}
    if stage == 0:
        assert kinds == {(Collective.ALL_REDUCE, Purpose.GRAD_SYNC, Phase.BACKWARD, Cadence.STEP)}
        return
    reduce_cadence = Cadence.STEP if stage == 1 else Cadence.MICRO_BATCH
    assert kinds == {(Collective.REDUCE_SCATTER, Purpose.GRAD_REDUCE_SCATTER, Phase.BACKWARD, reduce_cadence),
                     (Collective.ALL_GATHER, Purpose.PARAM_GATHER, Phase.OPTIMIZER, Cadence.STEP)}
    rs = [e for e in cost.events if e.kind is Collective.REDUCE_SCATTER]
    ag = [e for e in cost.events if e.kind is Collective.ALL_GATHER]
    assert sum(e.size_bytes for e in rs) == psi * BF16.grad_bytes
    assert sum(e.size_bytes for e in ag) == psi * BF16.weight_bytes
    assert {e.tensor for e in rs} == {e.tensor for e in ag} == {p.name for p in g.params}
    # All of the mlp's gradients fit one 25 MiB bucket: one reduce-scatter and one all-gather in all.
    assert sum(e.time_s for e in rs) == pytest.approx(
        collective_time_s(H100, mesh, Collective.REDUCE_SCATTER, psi * BF16.grad_bytes, (0,)))
    assert sum(e.time_s for e in ag) == pytest.approx(
        collective_time_s(H100, mesh, Collective.ALL_GATHER, psi * BF16.weight_bytes, (0,)))
    # The optimizer steps a quarter of every tensor.
    plain = CostModel(g, mesh, H100, BF16).price(data_parallel_plan(g, mesh))
    assert cost.optimizer_s < plain.optimizer_s


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accumulation_composes_k_micro_steps(k: int, zoo: Callable[[str], Path]) -> None:
    # A global batch of 32 in k micro-steps of 32/k: compute and activation-gradient traffic k times
    # (at the micro-batch's size), the gradient sync once, its bytes independent of k; the optimizer
    # once; activations saved for one micro-batch.
    n, global_batch = 4, 32
    mesh = DeviceMesh.build(n, devices_per_node=8)
    g = load_graph(zoo("mlp"), {"batch": global_batch // k})
    plan = data_parallel_plan(g, mesh)
    cost = CostModel(g, mesh, H100, BF16, micro_batches=k).price(plan)
    one = CostModel(g, mesh, H100, BF16).price(plan)  # the same micro-step, once
    syncs = [e for e in cost.events if e.purpose is Purpose.GRAD_SYNC and e.cadence is Cadence.STEP]
    assert sum(e.size_bytes for e in syncs) == g.num_params * BF16.grad_bytes
    per_micro = sum(e.time_s for e in cost.events if e.cadence is Cadence.MICRO_BATCH)
    per_step = sum(e.time_s for e in cost.events if e.cadence is Cadence.STEP)
    assert cost.compute_s == pytest.approx(k * one.compute_s)
    assert cost.comm_s == pytest.approx(k * per_micro + per_step)
    assert cost.optimizer_s == one.optimizer_s and cost.memory == one.memory
    # k micro-steps hold the earlier ones' gradients through the later ones' loss: every item at once
    assert cost.memory_bytes == (sum(one.memory.values()) if k > 1 else one.memory_bytes)
    assert one.memory_bytes == sum(one.memory.values()) - min(one.memory["gradients"],
                                                              one.memory["activations"] + one.memory["loss"])
    assert cost.step_time_s == pytest.approx(k * one.compute_s + k * per_micro + per_step + one.optimizer_s
                                             + one.overhead_s)


def test_planner_takes_the_fewest_micro_steps_that_fit(zoo: Callable[[str], Path]) -> None:
    # gpt2-tiny, global batch 64 × 64 tokens on 2 cpu ranks under a memory limit that one micro-step
    # of the whole batch exceeds: the planner binds batch = 64 / k for k = 1, 2, … and keeps the first
    # plan that fits.
    model = str(zoo("gpt2-tiny"))
    whole, _ = make_plan(PlanRequest(model=model, dims={"seq": 64}, profile="cpu", devices=2, mesh_shape=(2,),
                                     global_batch_size=64, accumulation_steps=1))
    assert whole.training.micro_batches == 1 and whole.model.dims["batch"] == 64
    limit = whole.cost.memory_bytes_per_device * 0.6
    s, _ = make_plan(PlanRequest(model=model, dims={"seq": 64}, profile="cpu", devices=2, mesh_shape=(2,),
                                 global_batch_size=64, memory_limit_gib=limit / 2**30))
    k = s.training.micro_batches
    assert k > 1 and s.model.dims["batch"] == 64 // k and s.training.global_batch_size == 64
    assert s.cost.memory_bytes_per_device <= limit
    dp = math.prod(s.mesh.shape[a] for a, p in enumerate(s.spec_of("ids").placements) if str(p) == "S(0)")
    assert s.training.micro_batch_size == 64 // k // dp
    fewer, _ = make_plan(PlanRequest(model=model, dims={"seq": 64}, profile="cpu", devices=2, mesh_shape=(2,),
                                     global_batch_size=64, accumulation_steps=k // 2,
                                     memory_limit_gib=limit / 2**30 * 100))
    assert fewer.cost.memory_bytes_per_device > limit  # k // 2 micro-steps would not have fitted


@pytest.mark.parametrize(("args", "message"), [
    (["--global-batch-size", "64", "--accumulation-steps", "3"], "not divisible by --accumulation-steps 3"),
    (["--zero", "5"], "--zero 5: choose 0, 1, 2, 3 (ZeRO's stages) or auto"),
    (["--layout", "dp_shard=4"], "multiplies to 4 devices, not --devices 2"),
    (["--layout", "dp_shard=1,fsdp=2"], "--layout fsdp: unknown key"),
    (["--layout", "dp_shard=2", "--mesh", "2"], "--layout and --mesh both fix the mesh"),
    (["--layout", "dp_shard=2", "--global-batch-size", "12", "--micro-batch-size", "4"],
     "--global-batch-size 12 is not divisible by micro-batch 4 × 2 data-parallel ranks"),
    (["--global-batch-size", "16", "--micro-batch-size", "4"], "--micro-batch-size needs the data-parallel degree"),
    (["--micro-batch-size", "4"], "give --global-batch-size too"),
    (["--comm-fusion", "lots"], "--comm-fusion lots: give a size such as 25MB"),
    (["--comm-fusion", "0MB"], "--comm-fusion 0MB: give a positive size"),
    (["--accumulation-steps", "2", "--dim", "batch=8"], "give --global-batch-size"),
    (["--global-batch-size", "64", "--dim", "batch=8"], "both set the batch"),
    (["--global-batch-size", "64", "--accumulation-steps", "two"], "give a positive integer or auto"),
])
def test_bad_levers(args: list[str], message: str, zoo: Callable[[str], Path], tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["plan", str(zoo("gpt2-tiny")), "--dim", "seq=32", "--devices", "2", "--profile", "cpu",
                                  *args,
                                  "-o", str(tmp_path / "s.json")])
    assert r.exit_code == 2, r.output
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


ACCUMULATION_CASES = [
    # (model, dims, global batch, micro-steps, mesh, mode, pins)
    ("gpt2-tiny", {"seq": 32}, 16, 4, (2,), "data-parallel", {}),
    ("mlp", {}, 64, 4, (2,), "semi", {"fc1.weight": "S(0)", "fc2.weight": "S(1)"}),
    ("llama-tiny", {"seq": 32}, 16, 2, (2, 2), "semi",
     {"ids": "S(0),R", "model.model.layers.0.mlp.up_proj.weight": "R,S(0)",
      "model.model.layers.0.mlp.down_proj.weight": "R,S(1)"}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dims", "global_batch", "k", "mesh", "mode", "pins"), ACCUMULATION_CASES,
                         ids=[f"{c[0]}-k{c[3]}-{'x'.join(map(str, c[4]))}" for c in ACCUMULATION_CASES])
def test_accumulated_step_equals_the_whole_batch_at_once(name: str, dims: dict[str, int], global_batch: int, k: int,
                                                         mesh: tuple[int, ...], mode: str, pins: dict[str, str],
                                                         zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # k micro-batches, gradients accumulated and reduced once, against one process taking the whole
    # global batch in one forward and backward (the model bound at the global batch): same loss,
    # gradients and parameters after 1 + 2 steps; the collectives run are the planned ones.
    model = zoo(name)
    s, _ = make_plan(PlanRequest(model=str(model), dims=dims, profile="cpu", devices=math.prod(mesh), mesh_shape=mesh,
                                 mode=mode, pins=pins, global_batch_size=global_batch, accumulation_steps=k))
    assert s.training.micro_batches == k and s.model.dims["batch"] == global_batch // k
    run_equals_one_process(s, model, tmp_path, "sgd")


ZERO_CASES = [
    # (model, dims, global batch, micro-steps, mesh, mode, pins, zero stage, optimizer)
    ("gpt2-tiny", {"seq": 32}, 8, 1, (2,), "data-parallel", {}, 1, "adamw"),
    ("gpt2-tiny", {"seq": 32}, 8, 1, (2,), "data-parallel", {}, 2, "adamw"),
    ("mlp", {}, 64, 4, (2,), "data-parallel", {}, 1, "sgd"),
    ("mlp", {}, 64, 4, (2,), "data-parallel", {}, 2, "sgd"),
    ("llama-tiny", {"seq": 32}, 16, 2, (2, 2), "semi",
     {"ids": "S(0),R", "model.model.layers.0.mlp.up_proj.weight": "R,S(0)",
      "model.model.layers.0.mlp.down_proj.weight": "R,S(1)"}, 2, "sgd"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dims", "global_batch", "k", "mesh", "mode", "pins", "zero", "optimizer"), ZERO_CASES,
                         ids=[f"{c[0]}-zero{c[7]}-k{c[3]}-{'x'.join(map(str, c[4]))}-{c[8]}" for c in ZERO_CASES])
def test_zero_step_equals_one_process(name: str, dims: dict[str, int], global_batch: int, k: int, mesh: tuple[int, ...],
                                      mode: str, pins: dict[str, str], zero: int, optimizer: str,
                                      zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # ZeRO-1/2 with fused flat buffers (each bucket's parameters views of one flat tensor, each rank
    # stepping its contiguous shard): the same loss, gradients and parameters as one process; the
    # reduce-scatters and all-gathers run are the planned ones, per kind and count. AdamW is checked
    # without accumulation: with it, elements whose gradient is ~1e-8 (rows no token of the batch
    # reaches) turn fp32 summation-order noise into lr-sized Adam updates, on one process as well.
    model = zoo(name)
    s, _ = make_plan(PlanRequest(model=str(model), dims=dims, profile="cpu", devices=math.prod(mesh), mesh_shape=mesh,
                                 mode=mode, pins=pins, global_batch_size=global_batch, accumulation_steps=k,
                                 zero_stage=zero))
    params = {t for t, p in s.tensors.items() if p.kind is TensorKind.PARAM}  # (an activation's gradient under
    kinds = {c.kind for n in s.nodes.values() for c in n.collectives  # tensor parallelism is all-reduced)
             if c.purpose is not Purpose.RESHARD and c.tensor in params}
    assert {Collective.REDUCE_SCATTER, Collective.ALL_GATHER} <= kinds and Collective.ALL_REDUCE not in kinds
    run_equals_one_process(s, model, tmp_path, optimizer)


def test_full_recomputation_closed_forms(zoo: Callable[[str], Path]) -> None:
    # GPT-2-medium (L = 24, h = 1024, V = 50257), b = 2, s = 1024, one device: training matmul FLOPs
    # 72·B·s·L·h²·(1 + s/6h) + 6·B·s·h·V without recomputation, 96·… with full recomputation (one
    # more forward of every layer; Korthikanti et al. 2022: 96·B·s·L·h²·(1 + s/6h + V/16hL)). Memory
    # (bf16 activations, 2 bytes): a recomputed layer keeps only its input, 2·s·b·h bytes, and one
    # layer's full activations are live while its backward runs — exactly what one layer saves without
    # recomputation. (That per-layer figure is the exported graph's: GeLU-tanh unfused, attention
    # fused, no dropout, so not Korthikanti's 34·s·b·h.)
    b, s, h, n_layer, v = 2, 1024, 1024, 24, 50257
    g = load_graph(zoo("gpt2-medium"), {"batch": b, "seq": s})
    mesh = DeviceMesh.build(1)
    plan = {n.name: replicated_strategy(OpContext.of(n, g), 1) for n in g.compute_nodes}
    layer0 = set(g.layers[0].nodes[0])
    costs = {}
    for policy, coefficient in (("none", 72), ("full", 96)):
        cm = CostModel(g, mesh, H100, BF16, recompute=policy)
        priced = cm.price_items(plan)
        cost = cm.price(plan)
        assert cost.flops_matmul == pytest.approx(coefficient * b * s * n_layer * h * h * (1 + s / (6 * h))
                                                  + 6 * b * s * h * v, rel=1e-9)
        acts = priced.memory["activations"]
        costs[policy] = (sum(x for k, x in acts.items() if k in layer0), acts.get("(recomputed layer)", 0.0), cost)
    (none_layer, _, none), (full_layer, peak, full) = costs["none"], costs["full"]
    assert full_layer == 2 * s * b * h
    assert peak == none_layer
    assert full.memory["activations"] < none.memory["activations"] / 4
    assert full.compute_s > none.compute_s


def test_recomputation_only_when_nothing_else_fits(zoo: Callable[[str], Path]) -> None:
    model = str(zoo("gpt2-tiny"))
    free, _ = make_plan(PlanRequest(model=model, dims={"batch": 16, "seq": 64}, profile="cpu", devices=2,
                                    mesh_shape=(2,)))
    assert free.training.recompute_policy == "none"
    forced, _ = make_plan(PlanRequest(model=model, dims={"batch": 16, "seq": 64}, profile="cpu", devices=2,
                                      mesh_shape=(2,), recompute="full"))
    assert set(forced.training.recompute.values()) == {"full"}
    assert forced.cost.memory_bytes_per_device < free.cost.memory_bytes_per_device
    limit = (forced.cost.memory_bytes_per_device + free.cost.memory_bytes_per_device) / 2
    tight, _ = make_plan(PlanRequest(model=model, dims={"batch": 16, "seq": 64}, profile="cpu", devices=2,
                                     mesh_shape=(2,), memory_limit_gib=limit / 2**30))
    assert tight.training.recompute_policy == "full" and tight.cost.memory_bytes_per_device <= limit


RECOMPUTE_CASES = [
    # (model, dims, global batch, micro-steps, mesh, mode, pins, zero stage, optimizer)
    ("gpt2-tiny", {"seq": 32}, 8, 1, (2,), "data-parallel", {}, 0, "adamw"),
    ("llama-tiny", {"seq": 32}, 16, 2, (2, 2), "semi",
     {"ids": "S(0),R", "model.model.layers.0.mlp.up_proj.weight": "R,S(0)",
      "model.model.layers.0.mlp.down_proj.weight": "R,S(1)"}, 2, "sgd"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dims", "global_batch", "k", "mesh", "mode", "pins", "zero", "optimizer"),
                         RECOMPUTE_CASES,
                         ids=[f"{c[0]}-zero{c[7]}-k{c[3]}-{'x'.join(map(str, c[4]))}" for c in RECOMPUTE_CASES])
def test_recomputed_step_equals_one_process(name: str, dims: dict[str, int], global_batch: int, k: int,
                                            mesh: tuple[int, ...], mode: str, pins: dict[str, str], zero: int,
                                            optimizer: str, zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # Every repeated layer checkpointed (torch.utils.checkpoint, non-reentrant, no early stop): its
    # forward, tensor-parallel reshards included, runs again in backward — counted in the plan too.
    # The second case combines accumulation, recomputation and ZeRO-2 on 4 ranks.
    model = zoo(name)
    s, _ = make_plan(PlanRequest(model=str(model), dims=dims, profile="cpu", devices=math.prod(mesh), mesh_shape=mesh,
                                 mode=mode, pins=pins, global_batch_size=global_batch, accumulation_steps=k,
                                 zero_stage=zero, recompute="full"))
    assert s.training.recompute_policy == "full"
    run_equals_one_process(s, model, tmp_path, optimizer)


@pytest.mark.hand_layouts  # (their planning once failed on a static batch)
def test_global_batch_on_a_static_model_from_elsewhere(tmp_path: Path) -> None:
    # The onnx wheel's SqueezeNet has a static batch of 1: the traced batch is one micro-step's, so a
    # global batch of 4 is 4 micro-steps of it.
    import onnx

    model = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / "light_squeezenet.onnx"
    r = CliRunner().invoke(main, ["plan", str(model), "--devices", "2", "--global-batch-size", "4",
                                  "-o", str(tmp_path / "s.json")])
    assert r.exit_code == 0, r.output
    training = json.loads((tmp_path / "s.json").read_text())["training"]
    assert training["micro_batches"] == 4 and training["global_batch_size"] == 4


def test_layout_holds_the_plan_to_its_degrees(zoo: Callable[[str], Path]) -> None:
    # HSDP on 4 ranks: dp_replicate=2 × dp_shard=2. The batch is split over both axes; every parameter
    # whose dim 0 has at least 2 rows is stored split on dim 0 over dp_shard (FSDP) and whole over
    # dp_replicate; with a global batch of 16 and 2 sequences per rank per micro-step: 16 / (2 × 4) = 2
    # micro-steps.
    s, _ = make_plan(PlanRequest(model=str(zoo("gpt2-tiny")), dims={"seq": 32}, profile="cpu", devices=4,
                                 layout="dp_replicate=2,dp_shard=2", global_batch_size=16, micro_batch_size=2))
    assert s.mesh.shape == (2, 2) and s.mesh.axis_names == ("dp_replicate", "dp_shard")
    assert s.training.layout == "dp_replicate=2,dp_shard=2"
    assert s.training.micro_batches == 2 and s.training.micro_batch_size == 2 and s.model.dims["batch"] == 8
    assert s.spec_of("ids") == Spec((Shard(0), Shard(0)))
    for name, t in s.tensors.items():
        if t.kind is TensorKind.PARAM:
            want = Spec((R, Shard(0))) if t.shape and t.shape[0] >= 2 else Spec((R, R))
            assert t.spec == want, name


def test_zero3_stores_every_parameter_split(zoo: Callable[[str], Path]) -> None:
    # --zero 3 on 4 ranks: no parameter with at least 4 rows on dim 0 is left whole: each is stored
    # split on dim 0 (FSDP: gathered for use and again for backward, its gradient reduce-scattered) or
    # split as a tensor-parallel consumer uses it; the model states shrink to about a quarter.
    model = str(zoo("gpt2-tiny"))
    plain, _ = make_plan(PlanRequest(model=model, dims={"batch": 8, "seq": 32}, profile="cpu", devices=4,
                                     mesh_shape=(4,), mode="data-parallel"))
    z3, _ = make_plan(PlanRequest(model=model, dims={"batch": 8, "seq": 32}, profile="cpu", devices=4,
                                  mesh_shape=(4,), zero_stage=3))
    assert z3.training.zero_stage == 3
    params = {n: t for n, t in z3.tensors.items() if t.kind is TensorKind.PARAM}
    assert all(t.spec.shard_count((4,)) == 4 for t in params.values() if t.shape and t.shape[0] >= 4)
    purposes = {c.purpose for n in z3.nodes.values() for c in n.collectives}
    assert Purpose.REGATHER in purposes
    states = sum(z3.cost.memory[k] for k in ("parameters", "gradients", "optimizer"))
    whole = sum(plain.cost.memory[k] for k in ("parameters", "gradients", "optimizer"))
    assert states < whole / 3.5


FSDP_CASES = [
    # (model, dims, global batch, micro-batch size, devices, layout, zero stage, optimizer, recompute)
    ("gpt2-tiny", {"seq": 32}, 8, None, 2, None, 3, "adamw", "none"),
    ("gpt2-tiny", {"seq": 32}, 8, 2, 2, "dp_shard=2", 0, "sgd", "none"),
    ("gpt2-tiny", {"seq": 32}, 8, 2, 2, "dp_shard=2", 0, "sgd", "full"),
    ("llama-tiny", {"seq": 32}, 16, 2, 4, "dp_replicate=2,dp_shard=2", 1, "sgd", "none"),
    ("gpt2-tiny", {"seq": 32}, 16, 2, 4, "dp_replicate=2,dp_shard=2", 0, "sgd", "none"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dims", "global_batch", "micro", "devices", "layout", "zero", "optimizer", "recompute"),
                         FSDP_CASES, ids=[f"{c[0]}-{c[5] or 'auto'}-zero{c[6]}-recompute-{c[8]}" for c in FSDP_CASES])
def test_fsdp_and_layouts_equal_one_process(name: str, dims: dict[str, int], global_batch: int, micro: int | None,
                                            devices: int, layout: str | None, zero: int, optimizer: str, recompute: str,
                                            zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # ZeRO-3 (parameters stored split, gathered for use by DTensor and again for backward), FSDP by
    # layout (2 micro-steps of 2 sequences per rank; with full recomputation, the recomputed layer's
    # gathers are the ones backward uses), and HSDP on 4 ranks with ZeRO-1 over dp_replicate, and without
    # (each gradient reduce-scattered over dp_shard, then its shard all-reduced over dp_replicate).
    model = zoo(name)
    s, _ = make_plan(PlanRequest(model=str(model), dims=dims, profile="cpu", devices=devices, global_batch_size=global_batch,
                                 micro_batch_size=micro, layout=layout, zero_stage=zero, recompute=recompute,
                                 mesh_shape=None if layout else (devices,)))
    run_equals_one_process(s, model, tmp_path, optimizer)


def test_overlap_hides_gradient_buckets_under_backward(zoo: Callable[[str], Path]) -> None:
    # DDP on GPUs reduces each 25 MiB bucket as soon as backward fills it: all but the last bucket run
    # under the rest of backward. With 4 KiB buckets, the mlp's bf16 gradients (Ψ·2 bytes) fill
    # ⌈Ψ·2 / 4096⌉ buckets; one bucket's worth stays exposed, the rest hides as far as backward lasts.
    g = load_graph(zoo("mlp"), {"batch": 32})
    mesh = DeviceMesh.build(4, devices_per_node=8)
    plan = data_parallel_plan(g, mesh)
    serial = CostModel(g, mesh, H100, BF16, fusion=CommFusion.uniform(4096)).price(plan)
    cm = CostModel(g, mesh, H100, BF16, fusion=CommFusion.uniform(4096), composer="overlap")
    priced, overlapped = cm.price_items(plan), cm.price(plan)
    grads = [e for e in serial.events if e.purpose is Purpose.GRAD_SYNC]
    grad_s, grad_bytes = sum(e.time_s for e in grads), sum(e.size_bytes for e in grads)
    assert grad_bytes == g.num_params * BF16.grad_bytes > 4096
    hidden = min(grad_s * (1 - 4096 / grad_bytes), priced.backward_s)
    assert overlapped.hidden_comm_s == pytest.approx(hidden)
    assert overlapped.comm_s == pytest.approx(serial.comm_s - hidden)
    assert overlapped.compute_s == serial.compute_s and overlapped.memory == serial.memory
    # One bucket holding every gradient (the default 25 MiB): nothing to overlap it with.
    assert CostModel(g, mesh, H100, BF16, composer="overlap").price(plan).hidden_comm_s == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1])
def test_comm_fusion_buckets_as_planned(zero: int, zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # --comm-fusion 16KB: the mlp's fp32 gradients (Ψ·4 bytes over 4 tensors) no longer fit one bucket;
    # the executor packs the buckets the plan priced (DDP's all-reduce, or ZeRO-1's reduce-scatter and
    # gather, one per bucket) and the step still equals one process.
    model = zoo("mlp")
    out = tmp_path / "s.json"
    r = CliRunner().invoke(main, ["plan", str(model), "--dim", "batch=64", "--devices", "2", "--mesh", "2",
                                  "--mode", "data-parallel", "--profile", "cpu", "--zero", str(zero),
                                  "--comm-fusion", "16KB", "-o", str(out)])
    assert r.exit_code == 0, r.output
    s = load_strategy(out)
    assert s.training.bucket_bytes == 16 * 1024
    g = load_graph(model, {"batch": 64})
    buckets = len(pack_buckets({p.name: ((0,), p.numel * 4.0) for p in g.params}, 16 * 1024))
    assert buckets > 1
    got = run_equals_one_process(s, model, tmp_path)
    want = {"all_reduce": buckets} if zero == 0 else {"reduce_scatter": buckets, "all_gather": buckets}
    assert got["collectives_planned"] == want


@pytest.mark.slow
def test_zero_threshold_leaves_small_parameters_whole(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # ZeRO-1 with a 2 KB threshold (MindSpore's parallel_optimizer_threshold): the mlp's biases (1 KB, 256 B in
    # fp32) keep their all-reduce and whole optimizer states, the weights are reduce-scattered and
    # gathered; the executor splits them the same way and still equals one process.
    model = zoo("mlp")
    out = tmp_path / "s.json"
    r = CliRunner().invoke(main, ["plan", str(model), "--dim", "batch=64", "--devices", "2", "--mesh", "2",
                                  "--mode", "data-parallel", "--profile", "cpu", "--zero", "1",
                                  "--zero-threshold", "2KB", "-o", str(out)])
    assert r.exit_code == 0, r.output
    s = load_strategy(out)
    kinds = {c.tensor: c.kind for n in s.nodes.values() for c in n.collectives if c.phase is not Phase.OPTIMIZER}
    assert kinds == {"fc1.weight": Collective.REDUCE_SCATTER, "fc2.weight": Collective.REDUCE_SCATTER,
                     "fc1.bias": Collective.ALL_REDUCE, "fc2.bias": Collective.ALL_REDUCE}
    got = run_equals_one_process(s, model, tmp_path)
    assert got["collectives_planned"] == {"all_reduce": 1, "reduce_scatter": 1,
                                                                         "all_gather": 1}
