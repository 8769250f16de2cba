"""Sharded checkpoints (torch.distributed.checkpoint): saved under plan A after some steps, loaded under
plan B — another tensor-parallel layout, ZeRO-3, another world size, pipeline stages — and training
continued; checked
against one process that trained the same data from the start without stopping (loss, gradients and
parameters of the first step after loading, and the parameters after the last, < 1e-5)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from executor.launch import run
from executor.preflight import RunOptions
from planner.search.plan import make_plan
from planner.search.request import PlanRequest

TP = {"model.transformer.h.0.mlp.c_fc.weight": "S(1)", "model.transformer.h.0.mlp.c_proj.weight": "S(0)",
      "model.transformer.h.1.attn.c_attn.weight": "S(1)"}


def _plan(zoo: Callable[[str], Path], out: Path, devices: int, **kw: object) -> Path:
    dims = {"seq": 32} if "global_batch_size" in kw else {"batch": 8, "seq": 32}  # 8 sequences a step either way
    s, _ = make_plan(PlanRequest(model=str(zoo("gpt2-tiny")), dims=dims, profile="cpu", devices=devices,
                                 **kw))  # type: ignore[arg-type]
    s.save(out)
    return out


# (plan A, plan B): data parallel → tensor parallel (pins); tensor parallel → ZeRO-3 (FSDP's layout);
# data parallel on 2 ranks → on 4; no pipeline → 2 stages × 2 data-parallel ranks (GPT-2's tied
# embedding then on both stages), 4 micro-batches of the same 8 sequences.
# ZeRO-1's fused buckets: the optimizer states of one flat buffer per bucket, a contiguous shard per
# rank that starts and ends inside parameters, from 2 ranks to 4 (other cuts), and into a plan without
# ZeRO.
# (dp2 → dp4, run until 2026-11-26, is in zero1-2 → zero1-4: another world size, and more.)
# Optimizer states on the host (ZeRO-Offload, ZeRO-2's fused shards stepped through host copies): saved
# as any plan's states, loaded into a plan that keeps them on the device, and the other way (into fused
# shards' host copies and into whole parameters' host copies).
CASES = [("dp2", "tp2"), ("tp2", "zero3"), ("dp2", "pp2"), ("zero1-2", "zero1-4"), ("zero1-4", "dp2"),
         ("host-zero2", "dp2"), pytest.param("zero1-2", "host-zero2", marks=pytest.mark.extended),
         pytest.param("dp2", "host-dp2", marks=pytest.mark.extended)]
PLANS: dict[str, tuple[int, dict[str, object]]] = {
    "dp2": (2, {"mode": "data-parallel", "zero_stage": 0}), "dp4": (4, {"mode": "data-parallel", "zero_stage": 0}),
    "tp2": (2, {"mode": "semi", "pins": TP}), "zero3": (2, {"layout": "dp_shard=2", "zero_stage": 3}),
    "pp2": (4, {"layout": "dp_replicate=2,pp=2", "global_batch_size": 8, "zero_stage": 0}),
    "zero1-2": (2, {"mode": "data-parallel", "zero_stage": 1}), "zero1-4": (4, {"mode": "data-parallel", "zero_stage": 1}),
    "host-zero2": (2, {"mode": "data-parallel", "zero_stage": 2, "offload": "optimizer"}),
    "host-dp2": (2, {"mode": "data-parallel", "zero_stage": 0, "offload": "optimizer"})}


@pytest.mark.slow
@pytest.mark.parametrize(("a", "b"), CASES, ids=["-to-".join(c.values if hasattr(c, "values") else c) for c in CASES])
def test_checkpoint_resharded_continues_as_one_process(a: str, b: str, zoo: Callable[[str], Path],
                                                       tmp_path: Path) -> None:
    model = str(zoo("gpt2-tiny"))
    (na, ka), (nb, kb) = PLANS[a], PLANS[b]
    pa, pb = _plan(zoo, tmp_path / "a.json", na, **ka), _plan(zoo, tmp_path / "b.json", nb, **kb)
    da, db = json.loads(pa.read_text()), json.loads(pb.read_text())
    assert da["tensors"] != db["tensors"] or na != nb or da["training"] != db["training"]
    ck = tmp_path / "ck"
    first = run(str(pa), model, nproc=na, opts=RunOptions(steps=1, warmup=1, save=str(ck)), timeout_s=240)
    assert json.loads((ck / "meshplan.json").read_text())["optimizer_steps"] == 3
    shown = CliRunner().invoke(main, ["checkpoint", "inspect", str(ck), "--json"])
    held = json.loads(shown.stdout)["tensors"]
    assert len([k for k in held if k.startswith("model.")]) == len(json.loads(shown.stdout)["parameters"])
    # Each rank wrote its own shards: a weight split over 2 ranks is 2 chunks, a replicated one 1.
    assert held["model.model.transformer.h.0.mlp.c_fc.weight"]["shards"] == (2 if a == "tp2" else 1)
    if a.startswith("zero1"):  # a fused shard's edge inside a parameter: its states saved in pieces, by 2 ranks
        assert [k for k, v in held.items() if k.startswith("optim.") and v["shards"] > 1]
    r = run(str(pb), model, nproc=nb, opts=RunOptions(steps=1, warmup=1, verify=True, load=str(ck)), timeout_s=240)
    assert r["optimizer_steps_before"] == 3 and r["loss"] != first["loss"]  # it continued, from step 4
    assert r["loss_abs_diff"] < 1e-5 and r["max_abs_diff"] < 1e-5, r
    assert r["collectives_executed"] == r["collectives_planned"]
    assert math.isfinite(r["loss"])


def test_checkpoints_refused_in_one_line(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    model = str(zoo("gpt2-tiny"))
    z1 = _plan(zoo, tmp_path / "z1.json", 4, mode="data-parallel", zero_stage=1, zero_shard_size=2)
    r = CliRunner().invoke(main, ["run", str(z1), "--model", model, "--nproc", "4", "--save", str(tmp_path / "ck")])
    assert r.exit_code == 2 and "ZeRO-1/2 with a shard group smaller" in r.stderr and \
        len(r.stderr.strip().splitlines()) == 1, r.stderr
    dp = _plan(zoo, tmp_path / "dp.json", 2, mode="data-parallel", zero_stage=0)
    r = CliRunner().invoke(main, ["run", str(dp), "--model", model, "--nproc", "2", "--load", str(tmp_path / "none")])
    assert r.exit_code == 2 and "no meshplan checkpoint there" in r.stderr, r.stderr
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "meshplan.json").write_text(json.dumps({
        "model_name": "llama-tiny", "model_fingerprint": "0", "optimizer_steps": 1, "parameters": ["model.x"],
        "parameter_shapes": {"model.x": [4]}}))
    r = CliRunner().invoke(main, ["run", str(dp), "--model", model, "--nproc", "2", "--load", str(tmp_path / "other")])
    assert r.exit_code == 2 and "was saved for model llama-tiny, whose parameters differ" in r.stderr and \
        len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_flat_boxes_tile_the_range() -> None:
    """A ZeRO shard's flat range of a parameter, as boxes of the parameter: in order, they are exactly
    the range's elements (2,000 random shapes and ranges, against numpy's row-major order)."""
    import numpy as np

    from executor.checkpoint import flat_boxes

    rng = np.random.default_rng(0)
    for _ in range(2000):
        shape = tuple(int(d) for d in rng.integers(1, 6, size=int(rng.integers(1, 5))))
        n = int(np.prod(shape))
        lo = int(rng.integers(0, n + 1))
        hi = int(rng.integers(lo, n + 1))
        flat = np.arange(n).reshape(shape)
        got: list[int] = []
        boxes = flat_boxes(shape, lo, hi)
        for offsets, sizes in boxes:
            got += flat[tuple(slice(o, o + z) for o, z in zip(offsets, sizes, strict=True))].reshape(-1).tolist()
        assert got == list(range(lo, hi)), (shape, lo, hi, boxes)
        assert len(boxes) <= 2 * len(shape) - 1
    assert flat_boxes((4, 3), 2, 10) == [((0, 2), (1, 1)), ((1, 0), (2, 3)), ((3, 0), (1, 1))]


@pytest.mark.slow
def test_truncated_checkpoint_refused_in_one_line(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    """A checkpoint cut short (a shard file truncated, a file lost, the save's metadata never written):
    `run --load` and `checkpoint inspect` say which file and exit 2 before any rank reads it; the
    checkpoint is left as it was."""
    import shutil

    model = str(zoo("gpt2-tiny"))
    dp = _plan(zoo, tmp_path / "dp.json", 2, mode="data-parallel", zero_stage=0)
    ck = tmp_path / "ck"
    run(str(dp), model, nproc=2, opts=RunOptions(steps=1, warmup=0, save=str(ck)), timeout_s=240)
    shard = ck / "__0_0.distcp"
    for damage in ("truncate", "remove", "metadata"):
        bad = tmp_path / damage
        shutil.copytree(ck, bad)
        if damage == "truncate":
            (bad / shard.name).write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        elif damage == "remove":
            (bad / shard.name).unlink()
        else:
            (bad / ".metadata").unlink()
        before = sorted((p.name, p.stat().st_size) for p in bad.iterdir())
        for argv in (["run", str(dp), "--model", model, "--nproc", "2", "--load", str(bad)],
                     ["checkpoint", "inspect", str(bad)]):
            r = CliRunner().invoke(main, argv)
            assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, (damage, r.stderr)
            want = {"truncate": f"{shard.name} holds", "remove": f"{shard.name} is missing",
                    "metadata": ".metadata is missing or unreadable"}[damage]
            assert want in r.stderr and "save it again" in r.stderr.replace("save the checkpoint again",
                                                                          "save it again"), r.stderr
        assert sorted((p.name, p.stat().st_size) for p in bad.iterdir()) == before  # nothing written
