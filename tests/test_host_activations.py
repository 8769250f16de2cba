"""Saved activations in host memory (`core.levers.ActivationOffload`, `costmodel/host_activations.py`):
per layer group, the ILP counts the layers after the recomputed ones whose saved tensors are copied to the
host as autograd saves them and back as backward reads them; the copies run on the compute stream, so
the step waits for both. Executed by `meshplan run` (the Regather hooks) and `meshplan.apply` (per-layer
hooks), CPU to CPU here."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from core.levers import ActivationOffload, Offload
from hwprofiles.files import load_profile
from hwprofiles.profile import profile_to_json
from planner.search.plan import make_plan
from planner.search.request import PlanRequest
from planner.strategy import load_strategy

TINY = {"batch": 4, "seq": 64}


def test_activations_on_the_host_are_the_closed_form(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    """llama-tiny on one H100 (one device: the same plan either way), every layer's saved activations on
    the host: the device's activations fall by what the host holds, the host link carries that twice a
    step (out in forward, back in backward) at the profile's rate, and the step is the plan's without
    offload plus those copies, whole (on the compute stream, nothing hides them)."""
    base = dict(model=str(zoo("llama-tiny")), dims=TINY, profile="h100-sxm", devices=1, recompute="none")
    plain, _ = make_plan(PlanRequest(**base))
    s, _ = make_plan(PlanRequest(**base, offload="activations"))
    host = load_profile("h100-sxm").host
    assert host is not None
    assert s.training.offload_activations == {"model.model.layers": 2} and not s.training.offload
    moved = plain.cost.memory["activations"] - s.cost.memory["activations"]
    assert moved > 0.5 * plain.cost.memory["activations"]  # both layers' (what stays: embedding, norm, head)
    assert s.cost.host_memory_bytes == pytest.approx(moved, rel=1e-12)
    assert s.cost.host_copy_bytes == pytest.approx(2 * moved, rel=1e-12)
    assert s.cost.host_s == pytest.approx(2 * moved / host.copy_rate(1), rel=1e-9) and s.cost.hidden_host_s == 0
    assert s.cost.step_time_s == pytest.approx(plain.cost.step_time_s + s.cost.host_s, rel=1e-9)
    s.save(tmp_path / "s.json")
    assert load_strategy(tmp_path / "s.json").training.offload_activations == s.training.offload_activations


def test_a_layer_is_recomputed_or_on_the_host(zoo: Callable[[str], Path]) -> None:
    """With the first layer recomputed (`recompute_layers` 1), every other layer's activations go to the
    host: a recomputed layer saves only its input, and is not offloaded too."""
    s, _ = make_plan(PlanRequest(model=str(zoo("llama-tiny-4l")), dims=TINY, profile="h100-sxm", devices=1,
                                 recompute="full", recompute_layers=1, offload="activations"))
    assert dict(s.training.recompute_layers) == {"model.model.layers": 1}
    assert s.training.offload_activations == {"model.model.layers": 3}


def test_auto_picks_the_cheapest_way_to_fit(zoo: Callable[[str], Path]) -> None:
    """GPT-2-medium on one H100 under a limit 30% below what it needs: `offload` auto with recomputation
    held off decides the states' and the activations' places together, no slower than any held way that
    fits (every layer's activations on the host, every optimizer state, every parameter). With
    recomputation free too, the ILP recomputes instead: a layer's forward again costs less than two
    copies of its activations over PCIe."""
    base = dict(model=str(zoo("gpt2-medium")), dims={"batch": 4, "seq": 512}, profile="h100-sxm", devices=1)
    free, _ = make_plan(PlanRequest(**base, recompute="none"))
    tight = free.cost.memory_bytes_per_device / 2**30 * 0.7
    auto, _ = make_plan(PlanRequest(**base, memory_limit_gib=tight, recompute="none", offload="auto"))
    assert auto.cost.memory_bytes_per_device <= tight * 2**30
    held = [make_plan(PlanRequest(**base, memory_limit_gib=tight, recompute="none", offload=o))[0]
            for o in ("activations", "optimizer", "params,optimizer")]
    assert held[0].training.offload_activations == {"model.transformer.h": 24}
    for h in held:
        assert auto.cost.step_time_s <= h.cost.step_time_s * (1 + 1e-9)
    both, _ = make_plan(PlanRequest(**base, memory_limit_gib=tight, offload="auto"))
    assert both.training.recompute_layers and not both.training.offload_activations
    assert both.cost.step_time_s < auto.cost.step_time_s


@pytest.mark.parametrize("case", ["no-host", "data-parallel", "recompute-full", "pipeline", "word"])
def test_activation_offload_refusals_are_one_line(case: str, zoo: Callable[[str], Path], tmp_path: Path) -> None:
    model = str(zoo("llama-tiny"))
    args = [model, "--dim", "batch=4", "--dim", "seq=64", "--devices", "1", "--offload", "activations",
            "-o", str(tmp_path / "s.json")]
    if case == "no-host":
        doc = profile_to_json(load_profile("cpu"))
        del doc["host"]
        (tmp_path / "p.json").write_text(json.dumps(doc))
        args += ["--profile", str(tmp_path / "p.json")]
        want = "--offload activations: profile cpu has no `host` block"
    elif case == "data-parallel":
        args += ["--mode", "data-parallel"]
        want = "--offload activations are placed per layer by the ILP: use --mode auto or semi"
    elif case == "recompute-full":
        args += ["--recompute", "full"]
        want = "every layer is recomputed, none saves its activations"
    elif case == "pipeline":
        args = [model, "--dim", "seq=64", "--global-batch-size", "4", "--devices", "2", "--layout", "pp=2",
                "--offload", "activations", "-o", str(tmp_path / "s.json")]
        want = "not planned for pipeline stages"
    else:
        args[args.index("activations")] = "activations,disk"
        want = "--offload activations,disk: choose one of"
    r = subprocess.run([sys.executable, "-m", "cli", "plan", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert want in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_offload_words() -> None:
    from core.levers import offload_levers

    assert offload_levers("auto") == (Offload.AUTO, ActivationOffload.AUTO)
    assert offload_levers("optimizer") == (Offload.OPTIMIZER, ActivationOffload.NONE)
    assert offload_levers("activations") == (Offload.NONE, ActivationOffload.ALL)
    assert offload_levers("params,optimizer,activations") == (Offload.PARAMS, ActivationOffload.ALL)
    # `auto` under full recomputation offloads states only (every layer is recomputed already), as before
    req = PlanRequest(model="m.onnx", devices=1, offload="auto", recompute="full")
    assert (req.offload, req.offload_activations) == (Offload.AUTO, ActivationOffload.NONE)


@pytest.mark.slow
def test_run_with_activations_and_optimizer_on_the_host_equals_one_process(zoo: Callable[[str], Path],
                                                                          tmp_path: Path) -> None:
    """`meshplan run` of gpt2-tiny on 2 gloo ranks, its first layer recomputed and the second's saved
    activations on the host, every optimizer state on the host too: equal to one process (< 1e-5, fp32)
    with the planned collectives; the memory meter shows the device bytes the plan predicts (within 10%)
    and the host the bytes it predicts — its states and one forward's saved activations (within 2%)."""
    from tests.test_training_step import run_equals_one_process

    model = zoo("gpt2-tiny")
    s, _ = make_plan(PlanRequest(model=str(model), dims={"batch": 8, "seq": 32}, profile="cpu", devices=2,
                                 recompute="full", recompute_layers=1, offload="optimizer,activations"))
    assert s.training.offload_activations == {"model.transformer.h": 1}
    assert dict(s.training.recompute_layers) == {"model.transformer.h": 1}
    assert set(s.training.offload.values()) == {Offload.OPTIMIZER}
    r = run_equals_one_process(s, model, tmp_path)
    assert r["measured_memory_bytes"] == pytest.approx(r["predicted_memory_bytes"], rel=0.10), r
    assert r["measured_host_bytes"] == pytest.approx(r["predicted_host_bytes"], rel=0.02), r
