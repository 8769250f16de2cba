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
