"""The typed strategy and its file: schema 2 round-trips, and a schema-1 file written by the planner
before the change (tests/data/strategy-v1-mlp.json: mlp, 2×2 mesh, batch split on dp, fc1 split on tp)
loads, migrates to what the planner decides today, explains and runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from core.collectives import Cadence, Collective, Phase, Purpose
from core.placement import R, Shard, Spec
from executor.launch import run
from executor.preflight import RunOptions
from planner.search.plan import make_plan
from planner.search.request import PlanRequest
from planner.strategy import Strategy, StrategyError, from_dict, from_json, load_strategy

V1 = Path(__file__).parent / "data" / "strategy-v1-mlp.json"
# What the v1 file was planned with; a v1 plan had no ZeRO (today's default, auto, may choose it).
V1_REQUEST = dict(dims={"batch": 64}, profile="cpu", devices=4, mesh_shape=(2, 2), mode="semi",
                  pins={"x": "S(0),R", "fc1.weight": "R,S(0)"}, zero_stage=0)


def _v1_here(zoo: Callable[[str], Path], tmp: Path, *, without_source: bool = False) -> Path:
    """The schema-1 file, pointing at this machine's mlp export (the path is the only edit); schema-1
    files written before the profile's source was recorded lack it."""
    data = json.loads(V1.read_text())
    data["model"]["path"] = str(zoo("mlp"))
    if without_source:
        del data["profile"]["source"]
    out = tmp / "v1.json"
    out.write_text(json.dumps(data))
    return out


def test_v1_file_migrates(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    s = load_strategy(_v1_here(zoo, tmp_path))
    assert s.training.micro_batches == 1 and s.training.zero_stage == 0 and not s.training.recompute
    assert s.pipeline is None and s.cost.composer == "serial"
    assert s.profile.source == "cpu"  # v1 plans named a preset
    assert s.spec_of("x") == Spec((Shard(0), R)) and s.spec_of("fc1.weight") == Spec((R, Shard(0)))
    assert s.nodes["node_linear"].outputs == (Spec((Shard(0), Shard(1))),)
    syncs = [c for n in s.nodes.values() for c in n.collectives if c.purpose is Purpose.GRAD_SYNC]
    assert {c.tensor for c in syncs} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert all(c.cadence is Cadence.STEP and c.phase is Phase.BACKWARD and c.axes == (s.mesh.axis_names.index("dp"),) for c in syncs)
    (gather,) = [c for n in s.nodes.values() for c in n.collectives if c.purpose is Purpose.RESHARD]
    assert (gather.kind, gather.tensor, gather.axes, gather.cadence) == (
        Collective.ALL_GATHER, "gelu", (s.mesh.axis_names.index("tp"),), Cadence.MICRO_BATCH)
    # What the planner decides today for the same request is what the old file says.
    now, _ = make_plan(PlanRequest(model=str(zoo("mlp")), **V1_REQUEST))  # type: ignore[arg-type]
    assert now.tensors == s.tensors and now.nodes.keys() == s.nodes.keys()
    for name, node in now.nodes.items():
        old = s.nodes[name]
        assert (node.strategy, node.inputs, node.outputs, node.kernels) == (old.strategy, old.inputs, old.outputs,
                                                                            old.kernels)
        assert [(c.kind, c.axes, c.size_bytes, c.phase, c.purpose, c.tensor, c.cadence) for c in node.collectives] == \
               [(c.kind, c.axes, c.size_bytes, c.phase, c.purpose, c.tensor, c.cadence) for c in old.collectives]
    assert now.cost.step_time_s == pytest.approx(s.cost.step_time_s, rel=1e-12)
    # (the loss's workspace is priced since the file was written: a category of its own)
    assert {k: b for k, b in now.cost.memory.items() if k != "loss"} == pytest.approx(s.cost.memory, rel=1e-12)


@pytest.mark.parametrize("without_source", [False, True])
def test_v1_file_explains(without_source: bool, zoo: Callable[[str], Path], tmp_path: Path) -> None:
    path = _v1_here(zoo, tmp_path, without_source=without_source)
    r = CliRunner().invoke(main, ["explain", str(path), "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["baselines"][0]
    assert plan["name"] == "plan (semi)"
    assert plan["step_time_s"] == json.loads(V1.read_text())["cost"]["step_time_s"]


@pytest.mark.slow
def test_v1_file_runs(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    r = run(str(_v1_here(zoo, tmp_path)), str(zoo("mlp")), nproc=4,
            opts=RunOptions(steps=1, warmup=0, verify=True, optimizer="sgd"), timeout_s=240)
    assert r["max_abs_diff"] < 1e-5
    # A schema-1 file records no gradient buckets: what it plans to run is not known, and not guessed.
    assert r["collectives_planned"] is None and r["collectives_executed"]


def test_round_trip_and_refusals(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    s, _ = make_plan(PlanRequest(model=str(zoo("gpt2-tiny")), dims={"batch": 8, "seq": 32}, profile="cpu", devices=4))
    assert isinstance(s, Strategy) and len(s.candidates) == 2
    assert from_json(s.to_json()) == s
    doc = s.to_dict()
    assert doc["schema_version"] == 2
    bad = json.loads(json.dumps(doc))
    next(iter(bad["tensors"].values()))["placements"] = ["S(7)"] * s.mesh.ndim  # a dim the tensor lacks
    with pytest.raises(StrategyError, match="names dim 7 but the tensor has"):
        from_dict(bad, "edited.json")
    bad = json.loads(json.dumps(doc))
    next(iter(bad["nodes"].values()))["collectives"] = [{"kind": "all_reduce", "axes": ["dp"], "bytes": 1.0,
                                                         "time_s": 0.0, "phase": "forward", "purpose": "why not",
                                                         "tensor": "x", "cadence": "per step"}]
    with pytest.raises(StrategyError, match="'why not' is not one of"):
        from_dict(bad, "edited.json")
    with pytest.raises(StrategyError, match="schema_version 3 is not one this meshplan reads"):
        from_dict({**doc, "schema_version": 3}, "future.json")


def test_strategy_checkpoint_holds_a_new_plan_to_the_parameters(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    """MindSpore's strategy checkpoints: `plan --strategy-out F --only-trainable-params` writes the mesh and
    every trainable parameter's placements only; `plan --strategy-in F` (that file, or a whole strategy)
    plans again — here a batch twice as large — with every parameter laid out as before."""
    model = str(zoo("llama-tiny"))
    base = ["plan", model, "--devices", "4", "--dim", "seq=32", "--profile", "cpu"]
    up = "model.model.layers.0.mlp.up_proj.weight"
    ck, full = tmp_path / "ck.json", tmp_path / "full.json"
    r = CliRunner().invoke(main, [*base, "--dim", "batch=8", "--mesh", "2x2", "--pin", f"{up}=R,S(0)", "-o", str(full),
                                  "--strategy-out", str(ck), "--only-trainable-params"])
    assert r.exit_code == 0, r.output
    saved = json.loads(ck.read_text())
    whole = json.loads(full.read_text())
    params = {n: v for n, v in whole["tensors"].items() if v["kind"] == "param"}
    assert saved["only_trainable_params"] is True and saved["mesh"] == {"shape": [2, 2], "axis_names": ["dp", "tp"]}
    assert {n: v["placements"] for n, v in saved["parameters"].items()} == {n: v["placements"] for n, v in params.items()}
    assert saved["parameters"][up]["placements"] == ["R", "S(0)"] and len(ck.read_text()) < len(full.read_text()) / 10
    for source in (ck, full):
        again = tmp_path / f"again-{source.stem}.json"
        r = CliRunner().invoke(main, [*base, "--dim", "batch=16", "--strategy-in", str(source), "-o", str(again)])
        assert r.exit_code == 0, r.output
        new = json.loads(again.read_text())
        assert new["mesh"]["shape"] == [2, 2] and new["model"]["dims"]["batch"] == 16
        assert {n: v["placements"] for n, v in new["tensors"].items() if v["kind"] == "param"} == \
            {n: v["placements"] for n, v in params.items()}

    def refused(argv: list[str], message: str) -> None:
        r = CliRunner().invoke(main, argv)
        assert r.exit_code == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

    refused(["run", str(ck), "--model", model, "--nproc", "4"], "holds only the trainable parameters' placements")
    refused(["plan", str(zoo("gpt2-tiny")), "--devices", "4", "--dim", "batch=8", "--dim", "seq=32", "--profile", "cpu",
             "--strategy-in", str(ck)], "is for model llama-tiny, whose parameters differ: model.model.embed_tokens.weight (not in this model)")
    refused([*base, "--dim", "batch=8", "--strategy-in", str(ck), "--pin", f"{up}=R,R"], f"--pin {up}=R,R contradicts")
    refused([*base, "--dim", "batch=8", "--strategy-in", str(ck), "--mesh", "4"], "--mesh 4 differs from --strategy-in")
    refused([*base, "--dim", "batch=8", "--only-trainable-params"], "pass --strategy-out FILE")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**saved, "mesh": {"shape": [0], "axis_names": ["dp"]}}))
    refused([*base, "--dim", "batch=8", "--strategy-in", str(bad)], "not a strategy checkpoint (mesh/shape/0")


def test_recorded_buckets_are_what_the_nodes_pay(zoo: Callable[[str], Path]) -> None:
    """The strategy's gradient buckets (`cost.buckets`, what the executor's expected counts read) are
    the ones its nodes' collectives carry shares of: every bucketed parameter gradient in exactly one
    bucket per axis, each bucket's bytes and time the sums of its members' shares."""
    from core.collectives import BUCKETED

    s, _ = make_plan(PlanRequest(model=str(zoo("gpt2-tiny")), dims={"batch": 8, "seq": 32}, profile="cpu", devices=2,
                                 mode="data-parallel", zero_stage=0))
    assert s.buckets
    shares = [c for n in s.nodes.values() for c in n.collectives if (c.kind, c.purpose) in BUCKETED]
    for b in s.buckets:
        members = [c for c in shares if c.tensor in b.tensors and c.kind is b.kind and c.axes == b.axes]
        assert sorted(c.tensor for c in members) == sorted(b.tensors)
        assert sum(c.size_bytes for c in members) == pytest.approx(b.size_bytes)
        assert sum(c.time_s for c in members) == pytest.approx(b.time_s)
    assert sorted(t for b in s.buckets for t in b.tensors) == sorted(c.tensor for c in shares)
