"""`meshplan reshard` and `meshplan strategies`: output, and one-line errors on bad input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main


def test_reshard_json_lists_the_collectives() -> None:
    r = CliRunner().invoke(main, ["reshard", "--shape", "4096,4096", "--from", "S(0),P", "--to", "R,S(1)",
                                  "--devices", "16", "--mesh", "2x8", "--json"])
    assert r.exit_code == 0, r.output
    steps = json.loads(r.stdout)["steps"]
    assert [(s["op"], s["axis"]) for s in steps] == [("reduce_scatter", "tp"), ("all_gather", "dp")]
    # h100's default precision (mixed) computes in bf16: the reduce-scatter's input is the local 2048×4096 block = 16 MiB.
    assert steps[0]["bytes"] == 2048 * 4096 * 2


def test_strategies_lists_zero_fallbacks(zoo: Callable[[str], Path]) -> None:
    r = CliRunner().invoke(main, ["strategies", str(zoo("gpt2-tiny")), "--dim", "batch=4", "--dim", "seq=32",
                                  "--devices", "4", "--mesh", "2x2", "--op", "Gemm", "--top", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["fallback_op_types"] == []
    assert {n["op_type"] for n in out["nodes"]} == {"Gemm"}
    assert all(len(n["strategies"]) == 3 for n in out["nodes"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from", "X(0)", "--to", "R", "--devices", "4"], "placement 'X(0)' does not parse"),
        (["--from", "S(5)", "--to", "R", "--devices", "4"], "S(5) names dim 5 but the tensor has 2 dims"),
        (["--from", "S(0)", "--to", "R", "--devices", "4", "--mesh", "2x3"], "mesh 2x3 multiplies to 6, not --devices 4"),
        (["--from", "S(0)", "--to", "R", "--devices", "4", "--mesh", "0x4"], "every axis needs at least 1 device"),
        (["--from", "S(0)", "--to", "R", "--devices", "0"], "--devices 0: needs at least 1 device"),
        (["--from", "S(0),R", "--to", "R", "--devices", "4"], "2 placements (S(0),R) for a 1-d mesh"),
        (["--from", "S(0)", "--to", "R", "--devices", "4", "--mesh", "2xx"], "--mesh '2xx' does not parse"),
        (["--from", "S(0)", "--to", "R", "--devices", "4", "--profile", "tpu"], "unknown profile 'tpu'"),
    ],
)
def test_reshard_bad_input(args: list[str], message: str) -> None:
    r = CliRunner().invoke(main, ["reshard", "--shape", "8,8", *args])
    assert r.exit_code == 2
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
