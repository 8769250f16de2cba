"""The flow's boundaries (docs/architecture.md): no import circle between files or between folders,
no stage importing a later one, and planning never importing torch.

The import graph is read from the source (every `import`, lazy ones inside functions, TYPE_CHECKING
blocks and `importlib.import_module("…")` with a literal name), so an import that dodges a circle at
run time still counts. The checks run on a tree given as a path: the tests plant a circle and an
importlib of `bench` in a copy and see them reported."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "hwprofiles", "costmodel", "planner", "executor", "meshplan", "bench")
TOP_MODULES = ("cli",)

# Stages in flow order: a module may import its own stage and earlier ones, never a later one
# (docs/architecture.md). A path prefix names the stage's folder (or file).
STAGES = (
    ("core", ("core",)),
    ("profiles", ("hwprofiles",)),
    ("cost model", ("costmodel",)),
    ("import and rules", ("planner.graph", "planner.lookups", "planner.shapes", "planner.params",
                          "planner.export", "planner.rules", "planner")),
    ("strategy", ("planner.strategy", "planner.strategy_ckpt", "planner.strategy_migrate", "planner.stagecut",
                  "planner.explain", "planner.groups")),
    ("search", ("planner.search",)),
    ("executor", ("executor",)),
    ("api", ("meshplan", "bench", "cli")),
)
# Besides the order, the edges the design rules out by name (an import that the order would allow).
FORBIDDEN = (
    ("hwprofiles", "costmodel"),  # profiles are data; formulas live in the cost model
    ("core", "costmodel"),
    ("planner.rules", "costmodel"),
    ("core.mesh", "costmodel"),
    ("executor", "planner.search"),  # the executor applies a strategy, never plans
    ("planner.strategy", "planner.search"),
    ("planner.explain", "planner.search"),  # explain reads a strategy without the solver
    ("planner.search.solve", "planner.search.pipeline"),
    ("meshplan", "bench"),  # the gate receives a model path
    ("core", "torch"), ("hwprofiles.profile", "torch"), ("costmodel", "torch"), ("planner", "torch"),
)
# Lazy torch imports that are part of the design: the exporter drives torch.
ALLOWED = {("planner.export", "torch")}


def module_files(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")) if (root / pkg).is_dir() else []:
            name = ".".join(f.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    for m in TOP_MODULES:
        if (root / f"{m}.py").exists():
            out[m] = root / f"{m}.py"
    return out


def _imported_names(path: Path, module: str) -> list[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            names += [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name) and \
                getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__") and \
                node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            names.append(node.args[0].value)
    return names


def import_graph(root: Path = ROOT) -> tuple[nx.DiGraph, dict[str, set[str]]]:
    """Module → module edges inside meshplan, and each module's imports of anything (torch included)."""
    files = module_files(root)
    g: nx.DiGraph = nx.DiGraph()
    raw: dict[str, set[str]] = {}
    for mod, path in files.items():
        g.add_node(mod)
        raw[mod] = set(_imported_names(path, mod))
        for name in raw[mod]:
            target = name
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != mod:
                g.add_edge(mod, target)
    return g, raw


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def stage_of(module: str) -> int:
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(STAGES) for p in prefixes if _under(module, p)),
               default=None)
    assert best is not None, f"{module} is in no stage: add it to STAGES and docs/architecture.md"
    return best[1]


def folder_of(module: str, files: dict[str, Path]) -> str:
    return module if files[module].name == "__init__.py" else module.rpartition(".")[0] or module


def violations(root: Path = ROOT) -> list[str]:
    g, raw = import_graph(root)
    files = module_files(root)
    found = [f"import circle: {', '.join(sorted(c))}" for c in nx.simple_cycles(g)]
    for level, name in (("folder", lambda m: folder_of(m, files)), ("top folder", lambda m: m.split(".")[0])):
        folders: nx.DiGraph = nx.DiGraph((name(a), name(b)) for a, b in g.edges if name(a) != name(b))
        found += [f"{level} circle: {', '.join(sorted(c))}" for c in nx.simple_cycles(folders)]
    for a, b in g.edges:
        if stage_of(b) > stage_of(a):
            found.append(f"{a} imports {b}: stage {STAGES[stage_of(a)][0]!r} comes before {STAGES[stage_of(b)][0]!r}")
    for mod, names in raw.items():
        for src, dst in FORBIDDEN:
            if _under(mod, src) and (mod, dst) not in ALLOWED and any(_under(n, dst) for n in names):
                found.append(f"{mod} imports {dst}")
    return sorted(set(found))


def test_the_import_graph_has_no_circle_and_flows_one_way() -> None:
    assert violations() == []


def _copy_tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.json", "*.toml"))
    for m in TOP_MODULES:
        shutil.copy(ROOT / f"{m}.py", root / f"{m}.py")
    return root


def test_the_check_catches_a_planted_circle_and_a_planted_importlib_of_bench(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    assert violations(root) == []
    # core/mesh.py imports core/collectives.py; a lazy import back closes a circle
    with (root / "core" / "collectives.py").open("a") as f:
        f.write("\n\ndef _planted():\n    from core.mesh import DeviceMesh\n    return DeviceMesh\n")
    with (root / "meshplan" / "check" / "__init__.py").open("a") as f:
        f.write("\n\ndef _planted_zoo():\n    import importlib\n    return importlib.import_module('bench.zoo')\n")
    found = violations(root)
    assert "import circle: core.collectives, core.mesh" in found
    assert "meshplan.check imports bench" in found


def test_a_stage_importing_a_later_one_is_reported(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    with (root / "costmodel" / "comm.py").open("a") as f:
        f.write("\n\ndef _planted():\n    import torch\n    from planner.search.solve import ShardingILP\n    return torch, ShardingILP\n")
    found = violations(root)
    assert "costmodel.comm imports torch" in found
    assert any(v.startswith("costmodel.comm imports planner.search.solve: stage 'cost model'") for v in found)


def test_planning_leaves_torch_unimported(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    """Import, rules, cost, solve and the strategy write, end to end in a fresh interpreter."""
    model = zoo("gpt2-tiny")
    code = (
        "import sys\n"
        "from planner.search.plan import PlanRequest, make_plan\n"
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
