"""Training in the plan's precision: an `amp` plan runs under torch.autocast (bf16 matmuls over fp32
weights, gradients and AdamW states; CPU autocast on gloo ranks) and `--verify` compares it with one
process under the same autocast, within the bf16 tolerance the report states; its collectives are the
planned ones, parameter gradients reduced in fp32."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core.collectives import Collective
from core.graph import TensorKind
from executor.launch import run
from executor.preflight import RunOptions
from planner.search.plan import make_plan
from planner.search.request import PlanRequest
from planner.strategy import load_strategy

pytestmark = [pytest.mark.zoo, pytest.mark.slow]

TP_PINS = {**{f"model.transformer.h.{i}.mlp.c_fc.weight": "S(1)" for i in (0, 1)},
           **{f"model.transformer.h.{i}.mlp.c_proj.weight": "S(0)" for i in (0, 1)}, "mul_204": "S(2)", "ids": "R"}
PLANS: dict[str, dict[str, Any]] = {"dp": {"mode": "data-parallel", "zero_stage": 0},
                                    "tp": {"mode": "semi", "pins": TP_PINS},
                                    "fsdp": {"zero_stage": 3}}


def _run(zoo: Callable[[str], Path], tmp: Path, kind: str, dtype: str) -> dict[str, Any]:
    s, _ = make_plan(PlanRequest(model=str(zoo("gpt2-tiny")), dims={"batch": 8, "seq": 32}, profile="cpu", devices=2,
                                 dtype=dtype, **PLANS[kind]))
    path = tmp / f"{kind}-{dtype}.json"
    s.save(path)
    return run(str(path), str(zoo("gpt2-tiny")), nproc=2, opts=RunOptions(steps=2, warmup=1, verify=True),
               timeout_s=240)


@pytest.mark.parametrize("kind", list(PLANS))
def test_amp_plan_trains_in_bf16_as_one_process_does(zoo: Callable[[str], Path], tmp_path: Path, kind: str) -> None:
    r = _run(zoo, tmp_path, kind, "amp")
    assert r["within_tolerance"], r
    assert r["collectives_executed"] == r["collectives_planned"]
    assert "reduce_scatter" in r["collectives_executed"] if kind == "fsdp" else True
    # Parameter gradients reduce in fp32 (their dtype); activations and their gradients (a tensor-parallel
    # row split's partial outputs) in the bf16 autocast's matmuls gave them.
    assert "float32" in r["reduce_dtypes"] and set(r["reduce_dtypes"]) <= {"float32", "bfloat16"}
    assert ("bfloat16" in r["reduce_dtypes"]) == (kind != "dp")
    if kind == "dp":  # the same plan in fp32: the one-process losses differ by bf16 rounding (amp is not
        fp32 = _run(zoo, tmp_path, "dp", "fp32")  # fp32), and fp32 agrees exactly (no bf16 tolerance)
        assert 1e-6 < abs(r["single_process_loss"] - fp32["single_process_loss"]) < 1e-1
        assert "tolerance" not in fp32 and fp32["max_abs_diff"] < 1e-5


def test_mixed_plan_trains_as_the_policy_does(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    """A `mixed` plan (FSDP2's bf16/fp32 policy) under ZeRO-3: the executor gathers the split parameters
    in bf16 and reduce-scatters their gradients in fp32, as the policy (and the plan's prices) do,
    the rest under autocast; equal to one process in the same precision within the bf16 tolerance,
    its collectives the planned ones. The amp plan gathers fp32 weights (autocast casts after)."""
    r = _run(zoo, tmp_path, "fsdp", "mixed")
    assert r["within_tolerance"], r
    assert r["collectives_executed"] == r["collectives_planned"] and "reduce_scatter" in r["collectives_executed"]
    s = load_strategy(tmp_path / "fsdp-mixed.json")
    params = {t for t, v in s.tensors.items() if v.kind is TensorKind.PARAM}
    gathers = Counter("param" if c.tensor in params else "activation" for n in s.nodes.values() for c in n.collectives
                      if c.kind is Collective.ALL_GATHER)
    assert gathers["param"] > 0
    # every parameter gather of the step in bf16, the activations' as autocast made them (fp32 here)
    assert r["gathers_by_dtype"] == {"bfloat16": gathers["param"], "float32": gathers["activation"]}, r
    # and every parameter's gradient reduce-scattered in fp32 (the policy's reduce dtype)
    scatters = sum(1 for n in s.nodes.values() for c in n.collectives if c.kind is Collective.REDUCE_SCATTER)
    assert r["reduce_scatters_by_dtype"] == {"float32": scatters}, r
    amp = _run(zoo, tmp_path, "fsdp", "amp")
    assert amp["gathers_by_dtype"] == {"float32": gathers["param"] + gathers["activation"]}, amp
