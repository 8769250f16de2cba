"""The gate's config: `meshplan-check.toml`'s cases, read strictly, models resolved beside it."""

from __future__ import annotations

import gzip
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from core.errors import MeshplanError
from core.layout import parse_layout
from core.levers import Mode, Recompute, Schedule, lever
from planner.search.request import PlanRequest
from planner.strategy import Strategy, from_json, load_strategy

CONFIG_NAME = "meshplan-check.toml"


BASELINE_DIR = "meshplan-baseline"


BASELINE_PLAN = "strategy.json.gz"


BASELINE_REFERENCE = "reference.json"  # the planning workload's time when the baseline was written


class CheckError(MeshplanError):
    """A check that cannot be made: its config, baseline or model is broken (exit 2)."""


@dataclass(frozen=True)
class Tolerance:
    step_time: float = 0.02  # predicted step time: relative increase allowed
    memory: float = 0.02  # predicted memory per device: relative increase allowed
    solver_time: float = 2.0  # solver time: factor allowed (and at least `solver_slack_s` more)
    solver_slack_s: float = 1.0
    measured_step_time: float = 0.10  # measured step time: relative increase allowed, beyond the noise
    noise_k: float = 3.0  # ... and beyond k × the median's standard error (from the median absolute deviation)
    drift: float = 10.0  # |predicted / measured − 1| may grow by this many percentage points
    # The baseline's plan measured now against its measurement when accepted (a change of code or
    # machine): reported; a regression only past this tolerance, where set (a quiet, dedicated runner).
    stored_step_time: float | None = None


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    request: PlanRequest
    tolerance: Tolerance
    # `--run`: repetitions of each plan, each `meshplan run` timing `steps` steps. A shared VM switches
    # speeds every few seconds: a run should time a few seconds of steps, or it catches one speed.
    runs: int = 3
    steps: int = 100


_CASE_KEYS = {"name", "model", "hf_config", "devices", "profile", "dims", "mesh", "axis_names", "layout",
              "global_batch_size", "micro_batch_size", "accumulation_steps", "pins", "memory_limit_gib", "mode",
              "dtype", "zero", "recompute", "schedule", "solver", "time_limit_s", "workers", "tolerance", "runs",
              "steps"}


def load_config(path: str | Path) -> list[Case]:
    """The cases of a `meshplan-check.toml`; models and recipes resolved beside it."""
    path = Path(path)
    if not path.is_file():
        raise CheckError(f"{path}: no such check config; write one (see examples/ci/{CONFIG_NAME}) or pass --config")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CheckError(f"{path}: not valid TOML ({e}); fix the file") from e
    unknown = sorted(set(data) - {"case"})
    if unknown:
        raise CheckError(f"{path}: unknown top-level key {unknown[0]!r}; cases go in [[case]] tables")
    raw = data.get("case")
    if not isinstance(raw, list) or not raw:
        raise CheckError(f"{path}: no [[case]] tables; add at least one case (name, model, devices, profile)")
    cases, names = [], set()
    for i, c in enumerate(raw):
        case = _case(c, i, path.parent, path)
        if case.name in names:
            raise CheckError(f"{path}: two cases named {case.name!r}; give each case its own name")
        names.add(case.name)
        cases.append(case)
    return cases


def _case(c: dict[str, Any], i: int, root: Path, path: Path) -> Case:
    where = f"{path}: case {c.get('name', i + 1)!r}"
    bad = sorted(set(c) - _CASE_KEYS)
    if bad:
        raise CheckError(f"{where}: unknown key {bad[0]!r}; allowed: {', '.join(sorted(_CASE_KEYS))}")
    for key in ("name", "devices"):
        if key not in c:
            raise CheckError(f"{where}: missing key {key!r}")
    sources = [k for k in ("model", "hf_config") if k in c]
    if len(sources) != 1:
        raise CheckError(f"{where}: give the model as exactly one of model (an .onnx path) or hf_config (a "
                         "transformers config.json to export)")
    model = _model(c, sources[0], root, where)
    tol = c.get("tolerance", {})
    if not isinstance(tol, dict):
        raise CheckError(f"{where}: [case.tolerance] must be a table")
    known = {f.name for f in fields(Tolerance)}
    if set(tol) - known:
        raise CheckError(f"{where}: unknown tolerance {sorted(set(tol) - known)[0]!r}; allowed: {', '.join(sorted(known))}")
    zero = c.get("zero", "auto")
    mesh = c.get("mesh")
    profile = str(c.get("profile", "h100-sxm"))
    if (root / profile).is_file():  # a profile JSON committed beside the config
        profile = str((root / profile).resolve())
    try:
        request = PlanRequest(
            model=model, dims=dict(c.get("dims", {})), profile=profile,
            devices=int(c["devices"]),
            mesh_shape=tuple(int(x) for x in str(mesh).lower().split("x")) if mesh is not None else None,
            axis_names=tuple(c["axis_names"]) if "axis_names" in c else None,
            mode=lever(Mode, str(c.get("mode", "auto")), "mode"), pins=dict(c.get("pins", {})),
            memory_limit_gib=c.get("memory_limit_gib"), dtype=c.get("dtype"), solver=str(c.get("solver", "cbc")),
            time_limit_s=float(c.get("time_limit_s", 60.0)), workers=int(c.get("workers", 1)),
            global_batch_size=c.get("global_batch_size"), micro_batch_size=c.get("micro_batch_size"),
            accumulation_steps=c.get("accumulation_steps"), zero_stage=None if zero == "auto" else int(zero),
            recompute=lever(Recompute, str(c.get("recompute", "auto")), "recompute"),
            layout=parse_layout(str(c["layout"]), int(c["devices"])) if "layout" in c else None,
            schedule=lever(Schedule, str(c["schedule"]), "schedule") if "schedule" in c else None)
    except (MeshplanError, TypeError, ValueError) as e:
        raise CheckError(f"{where}: {str(e).splitlines()[0]}") from e
    try:
        tolerance = Tolerance(**{k: float(v) for k, v in tol.items()})
    except (TypeError, ValueError) as e:
        raise CheckError(f"{where}: tolerances are numbers ({e})") from e
    return Case(name=str(c["name"]), model=model, request=request, tolerance=tolerance,
                runs=int(c.get("runs", 3)), steps=int(c.get("steps", 100)))


def _model(c: dict[str, Any], source: str, root: Path, where: str) -> str:
    if source == "model":
        # `${VAR}` in the path: a model kept outside the repository (this repository's own gate names
        # `${MESHPLAN_ZOO_DIR}/<model>.onnx`, which `make check` exports first).
        text = os.path.expandvars(str(c["model"]))
        if "$" in text:
            raise CheckError(f"{where}: model {c['model']} names an unset environment variable; set it or give a path")
        p = (root / text).resolve()
        if not p.is_file():
            raise CheckError(f"{where}: model {text} not found beside the config ({p}); commit it or use hf_config")
        return str(p)
    cfg = (root / str(c["hf_config"])).resolve()
    if not cfg.is_file():
        raise CheckError(f"{where}: hf_config {c['hf_config']} not found beside the config ({cfg})")
    import hashlib

    digest = hashlib.sha256(cfg.read_bytes()).hexdigest()[:12]
    out = root / ".meshplan-cache" / f"{cfg.stem}-{digest}.onnx"  # re-exported when the config changes
    if not out.is_file():
        from planner.export import export_hf_config

        out.parent.mkdir(parents=True, exist_ok=True)
        export_hf_config(cfg, out)
    return str(out)


def load_plan(path: Path) -> Strategy:
    try:
        if path.suffix == ".gz":
            return from_json(gzip.decompress(path.read_bytes()).decode(), str(path))
        return load_strategy(str(path))
    except (MeshplanError, OSError, UnicodeDecodeError) as e:  # (a corrupt .gz: OSError)
        raise CheckError(f"{path}: the baseline does not load ({str(e).splitlines()[0]}); write it again with "
                         "meshplan check --update") from e
