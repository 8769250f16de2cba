"""The flow's boundaries (../shared/DESIGN.md): planning never imports torch, and no stage imports a
later one. Checked twice: by running a whole plan in a fresh interpreter and looking at sys.modules,
and by walking every import statement of the planning packages (lazy ones inside functions too)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package → modules it must not import (a name and everything below it)
BANNED = {
    "planner": ("torch", "executor", "cli", "rich", "click"),
    "costmodel": ("torch", "executor", "cli", "rich", "click", "planner.solve", "planner.plan", "planner.milp"),
    "hwprofiles": ("executor", "cli", "rich", "click", "planner"),
}
# Every stage may import the error hierarchy, the root of the flow.
ALLOWED = ("planner.errors",)
# Lazy imports that are part of the design: the exporter drives torch (planner/export.py, DESIGN.md).
EXCEPTIONS = {
    ("planner/export.py", "torch"),
}


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for pkg, banned in BANNED.items():
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            for m in _imports(f):
                if m in ALLOWED or (rel, m) in EXCEPTIONS:
                    continue
                if any(m == b or m.startswith(b + ".") for b in banned):
                    found.append(f"{rel} imports {m}")
    return found


def test_no_stage_imports_a_later_one() -> None:
    assert violations() == []


def test_the_collective_vocabulary_is_a_leaf() -> None:
    """Meshes, reshards, the cost model and the profiles all speak costmodel/collectives.py; it speaks
    no other module of meshplan, and the planner's mesh and reshard plans need no profile."""
    own = ("planner", "costmodel", "hwprofiles", "executor", "cli", "bench", "meshplan")
    assert [m for m in _imports(ROOT / "costmodel" / "collectives.py") if m.split(".")[0] in own] == []
    for f in ("planner/mesh.py", "planner/reshard.py"):
        assert not [m for m in _imports(ROOT / f) if m.startswith("hwprofiles")], f


def test_the_walk_catches_a_new_import(tmp_path: Path) -> None:
    """The check itself: a planning module that imports torch is reported."""
    for pkg in BANNED:
        (tmp_path / pkg).mkdir()
    (tmp_path / "costmodel" / "fast.py").write_text("def f():\n    import torch\n    from planner.solve import X\n")
    assert violations(tmp_path) == ["costmodel/fast.py imports torch", "costmodel/fast.py imports planner.solve"]


def test_planning_leaves_torch_unimported(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    """Import, rules, cost, solve and the strategy write, end to end in a fresh interpreter."""
    model = zoo("gpt2-tiny")
    code = (
        "import sys\n"
        "from planner.plan import PlanRequest, make_plan\n"
        "from costmodel.summary import graph_summary\n"
        "from planner.graph import load_graph\n"
        f"graph_summary(load_graph({str(model)!r}, {{'batch': 4, 'seq': 32}}))\n"
        f"s, _ = make_plan(PlanRequest(model={str(model)!r}, dims={{'batch': 4, 'seq': 32}}, profile='cpu', devices=4))\n"
        f"s.save({str(tmp_path / 's.json')!r})\n"
        "import cli\n"
        "heavy = sorted(m for m in ('torch', 'executor', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"planning imported {r.stdout.strip()}"
    assert (tmp_path / "s.json").exists()


@pytest.mark.parametrize("module", ["planner.export", "meshplan"])
def test_export_imports_torch_only_when_called(module: str) -> None:
    code = f"import sys, {module}\nprint('torch' in sys.modules)\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr
