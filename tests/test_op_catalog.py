"""One op catalog: every op type the planner has a sharding rule for runs in the executor, and runs
as ONNX defines it (each rule case of tests/test_rules.py, executed by the torch op against the ONNX
reference); a model with an op the executor lacks is refused by `run` before any rank starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from cli import main
from executor.launch import check_executable
from executor.ops import OPS, run_op
from executor.preflight import RunError
from planner.graph import graph_from_proto
from planner.rules import registered_ops
from tests.spmd import run_node
from tests.test_rules import CASES, Case, build


def test_every_planned_op_is_executable() -> None:
    missing = sorted(registered_ops() - set(OPS))
    assert missing == [], f"op types with a sharding rule and no executor op: {missing}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_executor_op_matches_onnx(case: Case) -> None:
    graph, node, values = build(case)
    (opnode,) = graph.compute_nodes
    expected = run_node(node, values, case.opset)
    got = run_op(opnode, [torch.from_numpy(np.array(v)) for v in values])
    for e, g in zip(expected, got, strict=False):
        np.testing.assert_allclose(np.asarray(g, dtype=np.float64), np.asarray(e, dtype=np.float64),
                                   rtol=1e-4, atol=1e-5, err_msg=case.id)


def _model_with(op: str) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node(op, ["h"], ["y"], name="odd")]
    return helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 4])], initializer=[w]),
        opset_imports=[helper.make_opsetid("", 17)])


def test_run_refuses_an_unexecutable_op() -> None:
    graph = graph_from_proto(_model_with("Hardmax"), {})
    assert "Hardmax" not in OPS
    with pytest.raises(RunError, match=r"cannot run op type\(s\) Hardmax"):
        check_executable(graph)


def test_cli_run_refuses_in_one_line(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(_model_with("Hardmax"), str(model))
    runner = CliRunner()
    plan = runner.invoke(main, ["plan", str(model), "--devices", "2", "--profile", "cpu", "-o", str(tmp_path / "s.json")])
    assert plan.exit_code == 0, plan.output
    r = runner.invoke(main, ["run", str(tmp_path / "s.json"), "--model", str(model), "--nproc", "2"])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Hardmax" in lines[0] and "Traceback" not in r.output
