"""MindSpore's training switches: force_fp32_communication (priced), gradients_mean,
parameter_broadcast and gradient_accumulation_shard (run), each against what it must mean."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from core.collectives import Cadence, Collective, Purpose
from core.errors import MeshplanError
from core.mesh import DeviceMesh
from costmodel.memory import PRECISIONS
from costmodel.step import CostModel
from hwprofiles.files import load_profile
from planner.graph import load_graph
from planner.search.plan import make_plan
from planner.search.request import PlanRequest
from tests.test_training_step import data_parallel_plan, run_equals_one_process

H100 = load_profile("h100-sxm")
BF16 = PRECISIONS["bf16"]


@pytest.mark.parametrize("zero", [0, 1])
def test_fp32_communication_doubles_bf16_reductions(zero: int, zoo: Callable[[str], Path]) -> None:
    # bf16 training, data parallelism over 4: the gradient all-reduce (ZeRO-1: its reduce-scatter)
    # carries Ψ·4 bytes instead of Ψ·2 under force_fp32_communication; ZeRO's gather of the bf16
    # weights does not change (it reduces nothing).
    g = load_graph(zoo("mlp"), {"batch": 32})
    mesh = DeviceMesh.build(4, devices_per_node=8)
    plan = data_parallel_plan(g, mesh)
    base, fp32 = (CostModel(g, mesh, H100, BF16, zero_stage=zero, fp32_communication=f).price(plan) for f in (False, True))

    def volume(cost, kind: Collective) -> float:
        return sum(e.size_bytes for e in cost.events if e.kind is kind)

    reduce = Collective.ALL_REDUCE if zero == 0 else Collective.REDUCE_SCATTER
    assert volume(base, reduce) == g.num_params * 2 and volume(fp32, reduce) == g.num_params * 4
    assert volume(fp32, Collective.ALL_GATHER) == volume(base, Collective.ALL_GATHER)
    assert fp32.comm_s > base.comm_s and fp32.compute_s == base.compute_s
    assert {e.purpose for e in fp32.events if e.kind is reduce} <= {Purpose.GRAD_SYNC, Purpose.GRAD_REDUCE_SCATTER}


@pytest.mark.slow
def test_gradients_summed_over_ranks(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # gradients_mean=False on 2 data-parallel ranks: each rank's loss is the mean over its own batch and
    # the gradients add up — the loss is 2× the global mean's, the run equals one process training on
    # that loss, and the collectives are those of the averaging plan.
    model = zoo("gpt2-tiny")
    req = dict(model=str(model), dims={"batch": 8, "seq": 32}, profile="cpu", devices=2, mesh_shape=(2,),
               mode="data-parallel", zero_stage=0)
    mean, _ = make_plan(PlanRequest(**req))
    summed, _ = make_plan(PlanRequest(**req, gradients_mean=False))
    assert not summed.training.gradients_mean
    for sub in ("mean", "sum"):
        (tmp_path / sub).mkdir()
    r_mean = run_equals_one_process(mean, model, tmp_path / "mean")
    r_sum = run_equals_one_process(summed, model, tmp_path / "sum")
    assert r_sum["loss"] == pytest.approx(2 * r_mean["loss"], rel=1e-6)
    assert r_sum["collectives_planned"] == r_mean["collectives_planned"]


@pytest.mark.slow
def test_parameter_broadcast_makes_ranks_agree(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # Ranks that start from different parameters (every rank but 0 perturbs its own): without
    # parameter_broadcast the data-parallel run no longer equals one process; with it, rank 0's
    # parameters reach every rank before the first step, and it does.
    from executor.launch import run
    from executor.preflight import RunOptions

    model = zoo("mlp")
    req = dict(model=str(model), dims={"batch": 64}, profile="cpu", devices=2, mesh_shape=(2,), mode="data-parallel")
    opts = RunOptions(steps=1, warmup=1, verify=True, optimizer="sgd", diverge_ranks=True)
    for broadcast in (False, True):
        s, _ = make_plan(PlanRequest(**req, parameter_broadcast=broadcast))
        path = tmp_path / f"s-{broadcast}.json"
        s.save(path)
        r = run(str(path), str(model), nproc=2, timeout_s=240, opts=opts)
        assert (r["max_abs_diff"] < 1e-5) is broadcast, r["max_abs_diff"]


@pytest.mark.slow
@pytest.mark.parametrize(("shard", "stage", "per_step"), [("on", 2, 4), ("off", 1, 1)])
def test_gradient_accumulation_shard_runs_as_planned(shard: str, stage: int, per_step: int,
                                                     zoo: Callable[[str], Path], tmp_path: Path) -> None:
    """Under ZeRO with 4 micro-steps on 2 gloo ranks: `on` keeps the accumulated gradient sharded, a
    reduce-scatter of every bucket after each micro-step (ZeRO-2: 4 × the buckets a step); `off` keeps it
    whole and reduces it once (ZeRO-1). Each equals one process with the collectives planned, and holds
    the memory planned (within 10%, measured); the sharded one less."""
    from executor.launch import run
    from executor.preflight import RunOptions

    model = zoo("gpt2-tiny")
    s, _ = make_plan(PlanRequest(model=str(model), dims={"seq": 32}, profile="cpu", devices=2, global_batch_size=8,
                                 accumulation_steps=4, mode="data-parallel", zero_stage=1,
                                 gradient_accumulation_shard=shard))
    assert set((s.training.zero_stages or {}).values()) == {stage} and s.training.micro_batches == 4
    buckets = [b for b in s.buckets or () if b.kind is Collective.REDUCE_SCATTER]
    assert buckets and {b.cadence for b in buckets} == {Cadence.MICRO_BATCH if stage == 2 else Cadence.STEP}
    r = run_equals_one_process(s, model, tmp_path)
    assert r["collectives_executed"]["reduce_scatter"] == per_step * len(buckets), r
    s.save(tmp_path / "s.json")
    m = run(str(tmp_path / "s.json"), str(model), nproc=2, timeout_s=240, opts=RunOptions(steps=1, warmup=1))
    assert m["measured_memory_bytes"] == pytest.approx(m["predicted_memory_bytes"], rel=0.10), m
    held = s.cost.memory["gradients"]
    sharded, _ = make_plan(PlanRequest(model=str(model), dims={"seq": 32}, profile="cpu", devices=2,
                                       global_batch_size=8, accumulation_steps=4, mode="data-parallel",
                                       zero_stage=1, gradient_accumulation_shard="on" if shard == "off" else "off"))
    assert (held < sharded.cost.memory["gradients"]) == (shard == "on")


@pytest.mark.parametrize(("kw", "want"), [
    ({"zero_stage": 0, "accumulation_steps": 4}, "with `zero_stage` 0 there is no such choice"),
    ({"zero_stage": 3, "accumulation_steps": 4}, "with `zero_stage` 3 there is no such choice"),
    ({"zero_stage": 1}, "give `accumulation_steps` 2 or more"),
    ({"zero_stage": 1, "accumulation_steps": 1}, "give `accumulation_steps` 2 or more")])
def test_gradient_accumulation_shard_needs_zero_and_accumulation(kw: dict[str, int], want: str) -> None:
    with pytest.raises(MeshplanError, match=want):
        PlanRequest(model="m.onnx", dims={"seq": 32}, devices=2, global_batch_size=8, gradient_accumulation_shard="on",
                    **kw)
