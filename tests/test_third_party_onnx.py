"""Real ONNX files from elsewhere: the ONNX model-zoo CNNs shipped inside the installed onnx wheel
(onnx/backend/test/data/light, opsets 8-9, weights declared as ConstantOfShape of their dims, unread
Dropout masks without shapes). Each imports and plans on 2 devices with no op left to the fallback."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from cli import main
from planner.graph import load_graph
from planner.search.plan import make_plan
from planner.search.request import PlanRequest

LIGHT = sorted((Path(onnx.__file__).parent / "backend" / "test" / "data" / "light").glob("light_*.onnx"))
# Published parameter counts of these architectures (Caffe/Caffe2 originals; torchvision's resnet50
# has the same 25,557,032): the count is the architecture's, not meshplan's.
PUBLISHED = {"light_bvlc_alexnet": 60_965_224, "light_resnet50": 25_557_032, "light_vgg19": 143_667_240}


def test_the_wheel_ships_them() -> None:
    assert len(LIGHT) >= 9


@pytest.mark.parametrize("path", LIGHT, ids=lambda p: p.stem)
def test_light_model_imports_and_plans(path: Path, tmp_path: Path) -> None:
    g = load_graph(path, {})
    assert g.num_params > 0
    if path.stem in PUBLISHED:
        assert g.num_params == PUBLISHED[path.stem]
    strategy, _ = make_plan(PlanRequest(model=str(path), dims={}, profile="h100-sxm", devices=2))
    assert strategy.fallbacks == ()
    assert strategy.solver.status in ("OPTIMAL", "FEASIBLE")


def test_cli_inspect_and_plan_exit_zero(tmp_path: Path) -> None:
    path = next(p for p in LIGHT if p.stem == "light_squeezenet")
    runner = CliRunner()
    assert runner.invoke(main, ["inspect", str(path)]).exit_code == 0
    r = runner.invoke(main, ["plan", str(path), "--devices", "2", "-o", str(tmp_path / "s.json")])
    assert r.exit_code == 0, r.output
