"""The executor on real ranks (gloo, CPU): distributed training equals one process, and the
collectives it runs are the planned ones. World sizes 2 and 4."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from executor.launch import run
from executor.preflight import RunOptions
from planner.search.plan import make_plan
from planner.search.request import PlanRequest

TOL = 1e-5  # fp32
SGD = RunOptions(steps=1, warmup=0, verify=True, optimizer="sgd")

CASES = [
    # (model, dims, mesh, mode, pins): data parallel, tensor parallel forced by pins, the ILP's choice
    ("mlp", {"batch": 64}, (2,), "data-parallel", {}),
    ("mlp", {"batch": 64}, (2,), "semi", {"fc1.weight": "S(0)", "fc2.weight": "S(1)"}),
    ("convnet", {"batch": 8}, (2,), "data-parallel", {}),
    ("convnet", {"batch": 8}, (2,), "semi", {"stages.0.0.conv1.weight": "S(0)"}),
    ("gpt2-tiny", {"batch": 8, "seq": 32}, (2,), "data-parallel", {}),
    ("gpt2-tiny", {"batch": 8, "seq": 32}, (2,), "semi",
     {"model.transformer.h.0.mlp.c_fc.weight": "S(1)", "model.transformer.h.0.mlp.c_proj.weight": "S(0)"}),
    ("gpt2-tiny", {"batch": 8, "seq": 32}, (2,), "auto", {}),
    ("bert-tiny", {"batch": 8, "seq": 32}, (2,), "data-parallel", {}),
    ("llama-tiny", {"batch": 8, "seq": 32}, (2,), "data-parallel", {}),
    ("llama-tiny", {"batch": 8, "seq": 32}, (2,), "semi",
     {"model.model.layers.0.mlp.up_proj.weight": "S(0)", "model.model.layers.0.mlp.down_proj.weight": "S(1)"}),
    ("vit-tiny", {"batch": 8}, (2,), "data-parallel", {}),
    ("gpt2-tiny", {"batch": 8, "seq": 32}, (2, 2), "semi",
     {"ids": "S(0),R", "model.transformer.h.0.mlp.c_fc.weight": "R,S(1)",
      "model.transformer.h.0.mlp.c_proj.weight": "R,S(0)"}),
]


def _plan(zoo: Callable[[str], Path], tmp: Path, name: str, dims: dict[str, int], mesh: tuple[int, ...], mode: str,
          pins: dict[str, str]) -> tuple[Path, Path]:
    model = zoo(name)
    strategy, _ = make_plan(PlanRequest(model=str(model), dims=dims, profile="cpu", devices=math.prod(mesh),
                                        mesh_shape=mesh, mode=mode, pins=pins))
    out = tmp / "s.json"
    strategy.save(out)
    return out, model


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dims", "mesh", "mode", "pins"), CASES,
                         ids=[f"{c[0]}-{c[3]}-{'x'.join(map(str, c[2]))}" for c in CASES])
def test_distributed_equals_one_process(name: str, dims: dict[str, int], mesh: tuple[int, ...], mode: str,
                                        pins: dict[str, str], zoo: Callable[[str], Path], tmp_path: Path) -> None:
    strategy, model = _plan(zoo, tmp_path, name, dims, mesh, mode, pins)
    plan = json.loads(strategy.read_text())
    for t, spec in pins.items():  # the pins were honoured
        assert ",".join(plan["tensors"][t]["placements"]) == spec
    r = run(str(strategy), str(model), nproc=len(plan["mesh"]["devices"]), opts=SGD, timeout_s=240)
    assert r["loss_abs_diff"] < TOL
    assert r["grad_max_abs_diff"] < TOL
    assert r["param_max_abs_diff"] < TOL
    assert r["collectives_executed"] == r["collectives_planned"]


@pytest.mark.slow
def test_adamw_step_matches(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    strategy, model = _plan(zoo, tmp_path, "gpt2-tiny", {"batch": 8, "seq": 32}, (2,), "data-parallel", {})
    r = run(str(strategy), str(model), nproc=2, opts=RunOptions(steps=1, warmup=0, verify=True), timeout_s=240)
    assert r["max_abs_diff"] < TOL


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "pins"), [((2,), {}), ((2, 2), {"ids": "S(0),R"})], ids=["dp-2", "dp-tp-2x2"])
def test_several_steps_match(mesh: tuple[int, ...], pins: dict[str, str], zoo: Callable[[str], Path],
                             tmp_path: Path) -> None:
    # From the second step on, gradients accumulate into their all-reduce buckets (DDP's gradient
    # views); the parameters after 4 steps still equal one process's.
    strategy, model = _plan(zoo, tmp_path, "gpt2-tiny", {"batch": 8, "seq": 32}, mesh, "semi" if pins else "data-parallel",
                            pins)
    r = run(str(strategy), str(model), nproc=math.prod(mesh), timeout_s=240,
            opts=RunOptions(steps=2, warmup=1, verify=True, optimizer="sgd", probe=True))
    assert r["final_param_max_abs_diff"] < TOL  # the speed probe between steps changes nothing trained
    assert r["max_abs_diff"] < TOL
    # Each rank's probe, before the steps and between them, by part; its step times, whose median is its figure.
    assert len(r["speed_probe_s_by_rank"]) == math.prod(mesh)
    for probe, times, step_s in zip(r["speed_probe_s_by_rank"], r["measured_step_times_s_by_rank"],
                                    r["measured_step_s_by_rank"], strict=True):
        for when in ("before", "during"):
            assert set(probe[when]) == {"matmul", "element-wise", "op"} and min(probe[when].values()) > 0
        assert len(times) == 2 and statistics.median(times) == step_s


def test_run_bad_input(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    strategy, model = _plan(zoo, tmp_path, "mlp", {"batch": 64}, (2,), "data-parallel", {})
    (tmp_path / "broken.json").write_text("[1, 2")
    cases = [
        (["run", str(strategy), "--model", str(zoo("mlp-legacy")), "--nproc", "2"], "planned for model fingerprint"),
        (["run", str(strategy), "--model", str(zoo("gpt2-tiny")), "--nproc", "2"], "is not the model the strategy"),
        (["run", str(strategy), "--model", str(model), "--nproc", "3"], "--nproc 3 but the strategy's mesh 2 has 2"),
        (["run", str(tmp_path / "broken.json"), "--model", str(model), "--nproc", "2"], "not JSON"),
        (["run", str(strategy), "--model", str(tmp_path / "nope.onnx"), "--nproc", "2"], "no such model"),
    ]
    for args, message in cases:
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2, r.output
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_crashing_rank_stops_everything(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # A strategy whose recorded placement cannot be applied (a dim the tensor lacks) makes the ranks
    # fail: one line, exit 2, no hang, no orphan processes.
    import multiprocessing

    strategy, model = _plan(zoo, tmp_path, "mlp", {"batch": 64}, (2,), "data-parallel", {})
    data = json.loads(strategy.read_text())
    first = next(iter(data["nodes"]))
    data["nodes"][first]["inputs"][0] = "S(7)"
    strategy.write_text(json.dumps(data))
    r = CliRunner().invoke(main, ["run", str(strategy), "--model", str(model), "--nproc", "2", "--timeout", "120"])
    assert r.exit_code == 2
    assert "rank" in r.stderr and "failed" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_eager_attention_runs_as_planned(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # --attention eager: the executor runs each attention as torch's eager ops (scores and probabilities
    # in memory); the step equals one process's, and the eager plan keeps every layer's probabilities
    # (b·heads·s² fp32 each) beyond what the flash plan keeps. A plan the executor cannot run as priced
    # (Megatron's fused softmax, dropout) is refused before any rank starts.
    model, dims = zoo("gpt2-tiny"), {"batch": 8, "seq": 32}
    plans = {}
    for kind in ("flash", "eager"):
        plans[kind], _ = make_plan(PlanRequest(model=str(model), dims=dims, profile="cpu", devices=2, mesh_shape=(2,),
                                               mode="data-parallel", attention=kind))
    layers, heads, s = 2, 4, 32
    out = plans["eager"].nodes["node_scaled_dot_product_attention"].outputs[0]  # batch split or not, as planned
    b = out.local_shape((8, heads, s, 16), (2,))[0]
    gap = plans["eager"].cost.memory["activations"] - plans["flash"].cost.memory["activations"]
    assert gap == pytest.approx(layers * b * heads * s * s * 4)
    plans["eager"].save(tmp_path / "eager.json")
    r = run(str(tmp_path / "eager.json"), str(model), nproc=2, opts=SGD, timeout_s=240)
    assert r["max_abs_diff"] < TOL and r["collectives_executed"] == r["collectives_planned"]
    for kind, p in (("fused-softmax", 0.0), ("eager", 0.1)):
        held, _ = make_plan(PlanRequest(model=str(model), dims=dims, profile="cpu", devices=2, mesh_shape=(2,),
                                        mode="data-parallel", attention=kind, attention_dropout=p))
        held.save(tmp_path / "held.json")
        r = CliRunner().invoke(main, ["run", str(tmp_path / "held.json"), "--model", str(model), "--nproc", "2"])
        assert r.exit_code == 2 and "--attention flash or eager" in r.stderr and \
            len(r.stderr.strip().splitlines()) == 1, r.stderr
