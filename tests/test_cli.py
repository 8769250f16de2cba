"""The CLI: `inspect` output contract, and one-line errors with exit code 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from onnx import helper

from cli import main

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh interpreter, as a user would (catches import-time tracebacks too)."""
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_inspect_json(zoo: Callable[[str], Path]) -> None:
    r = CliRunner().invoke(main, ["inspect", str(zoo("mlp")), "--dim", "batch=32", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    # Linear(64→256) and Linear(256→64) with biases.
    assert s["parameters"] == 64 * 256 + 256 + 256 * 64 + 64
    assert s["op_types"] == {"Gemm": 2, "Gelu": 1}
    assert s["flops_forward"] == 2 * 32 * (64 * 256 + 256 * 64)
    assert s["inputs"] == [{"name": "x", "shape": [32, 64], "dtype": "float32"}]


def test_inspect_table(zoo: Callable[[str], Path]) -> None:
    r = CliRunner().invoke(main, ["inspect", str(zoo("gpt2-tiny")), "--dim", "batch=2", "--dim", "seq=16"])
    assert r.exit_code == 0, r.output
    assert "repeated layers" in r.stdout and "model.transformer.h" in r.stdout


def _bad_inputs(tmp: Path, gpt2: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "empty.onnx").write_bytes(b"")
    (tmp / "text.onnx").write_text("this is not a model\n" * 20)
    data = gpt2.read_bytes()
    (tmp / "truncated.onnx").write_bytes(data[: len(data) // 3])
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [])), str(tmp / "nonodes.onnx"))
    return {
        "empty": ([str(tmp / "empty.onnx")], "the file is empty"),
        "text": ([str(tmp / "text.onnx")], "not a readable ONNX model"),
        "truncated": ([str(tmp / "truncated.onnx")], "not a readable ONNX model"),
        "missing": ([str(tmp / "missing.onnx")], "no such file"),
        "no nodes": ([str(tmp / "nonodes.onnx")], "has no nodes"),
        "unbound dim": ([str(gpt2)], "unbound symbolic dims: batch, seq"),
        "unknown dim": ([str(gpt2), "--dim", "batch=2", "--dim", "seq=8", "--dim", "heads=2"],
                        "--dim names heads not in the model"),
        "bad dim syntax": ([str(gpt2), "--dim", "batch"], "is not NAME=N"),
    }


@pytest.mark.parametrize("case", ["empty", "text", "truncated", "missing", "no nodes", "unbound dim",
                                  "unknown dim", "bad dim syntax"])
def test_bad_input_one_line_exit_2(case: str, tmp_path: Path, zoo: Callable[[str], Path]) -> None:
    args, message = _bad_inputs(tmp_path, zoo("gpt2-tiny"))[case]
    r = _run("inspect", *args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert message in r.stderr
    if case != "bad dim syntax":  # click's usage errors print a usage line first
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_explain_with_a_profile_file_and_refusal_after_an_edit(tmp_path: Path, zoo: Callable[[str], Path]) -> None:
    """A plan made with a profile *file* explains (the strategy records the file, not only the
    profile's name), and refuses in one line once that file changed. (A schema-1 file without the
    source finds its preset by name: tests/test_strategy.py.)"""
    import json

    from hwprofiles.files import load_profile, save_profile

    profile = tmp_path / "mycluster.json"
    save_profile(load_profile("cpu"), profile)
    data = json.loads(profile.read_text())
    data["name"] = "mycluster"
    profile.write_text(json.dumps(data))
    runner = CliRunner()
    out = tmp_path / "s.json"
    r = runner.invoke(main, ["plan", str(zoo("mlp")), "--dim", "batch=32", "--devices", "2", "--profile", str(profile),
                             "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert runner.invoke(main, ["explain", str(out)]).exit_code == 0
    data["device"]["kernel_launch_s"]["value"] *= 2
    profile.write_text(json.dumps(data))
    r = runner.invoke(main, ["explain", str(out)])
    assert r.exit_code == 2 and "changed since planning" in r.output and len(r.output.strip().splitlines()) == 1
