"""Shared fixtures: the exported model zoo (cached outside git) and small ONNX builders."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

ZOO_DIR = Path(os.environ.get("MESHPLAN_ZOO_DIR", Path.home() / ".cache" / "meshplan" / "zoo"))


@pytest.fixture(scope="session")
def zoo() -> Callable[[str], Path]:
    """`zoo(name)` → path of the exported zoo model (exports on first use; needs torch + transformers)."""
    from bench import zoo as zoo_mod

    def get(name: str) -> Path:
        return zoo_mod.export(name, ZOO_DIR)

    return get


@pytest.fixture(scope="session")
def zoo_meta() -> Callable[[str], dict]:
    from bench import zoo as zoo_mod

    return lambda name: zoo_mod.metadata(name, ZOO_DIR)


@pytest.fixture(autouse=True)
def _hand_layouts(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans skip the hand layouts they are checked against (`planner/search/incumbents.py`) unless the
    test is marked `hand_layouts`: planning each one again in every test would take the suite past its
    ten minutes. The marked tests (tests/test_incumbents.py, the never-worse checks) run them."""
    if request.node.get_closest_marker("hand_layouts") is None:
        monkeypatch.setenv("MESHPLAN_HAND_LAYOUTS", "0")


# Variants of multi-process tests whose ground is covered by a lighter variant of the same test that
# `make test` keeps: run by `make check` (CI runs both), so that `make test` stays under ten minutes on
# a fresh clone of this 2-core machine (834 tests took 9 min 40 s there on 2026-11-26; these ten take
# about 165 s of the two workers' time).
EXTENDED = {
    "tests/test_training_step.py::test_recomputed_step_equals_one_process[llama-tiny-zero2-k2-2x2]",
    "tests/test_training_step.py::test_fsdp_and_layouts_equal_one_process[llama-tiny-dp_replicate=2,dp_shard=2-zero1-recompute-none]",
    "tests/test_training_step.py::test_accumulated_step_equals_the_whole_batch_at_once[llama-tiny-k2-2x2]",
    "tests/test_executor.py::test_several_steps_match[dp-tp-2x2]",
    "tests/test_checkpoint.py::test_checkpoint_resharded_continues_as_one_process[zero1-4-to-dp2]",
    "tests/test_checkpoint.py::test_checkpoint_resharded_continues_as_one_process[dp2-to-tp2]",
    "tests/test_pipeline_run.py::test_pipelined_run_equals_one_process[llama-tiny-4l-pp=4-1f1b]",
    "tests/test_pipeline_run.py::test_pipelined_run_equals_one_process[llama-tiny-dp_replicate=2,pp=2-1f1b]",
    "tests/test_zero.py::test_zero_shard_group_runs_as_planned[2]",
    "tests/test_zero.py::test_zero_over_two_axes_runs_as_planned[2]",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    found = set()
    for item in items:
        if item.nodeid in EXTENDED:
            item.add_marker(pytest.mark.extended)
            found.add(item.nodeid)
    # Every name above must still name a test where its function was collected (a renamed variant
    # would silently join make test again).
    functions = {item.nodeid.split("[")[0] for item in items}
    missing = sorted(n for n in EXTENDED - found if n.split("[")[0] in functions)
    if missing:
        raise pytest.UsageError(f"tests/conftest.py EXTENDED names no collected test: {missing}")
