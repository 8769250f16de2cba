"""`meshplan check`: a CI gate on regressions of plans and of measured steps.

A team commits `meshplan-check.toml` (cases: a model, its dims or batch, devices, profile, optional
mesh, layout, pins, memory limit, tolerances) and a baseline directory beside it holding, per case,
the last accepted strategy (`<case>/strategy.json.gz`, gzipped: Llama-3-70B's is 4.6 MB as text) and, when runs are part of the check, what they
measured (`<case>/measured.json`). `check` plans every case again and compares: the predicted step
time and memory per device against their tolerances, the solver's time (a factor, and at least a
second more, in units of a fixed planning workload timed beside it and stored with the baseline
(`<case>/reference.json`): a shared machine runs 2× slower on one day than another), and, for information, the step's split, the collective bytes per step and the plan's
structure (mesh, micro-steps, ZeRO, recomputation, stages, re-placed tensors). With `run`, it executes
the new plan and the baseline's side by side, several times (A B, B A, …), and flags, each only past
both the tolerance and k × the median's error: a new plan that runs slower than the baseline's; a new
plan whose prediction is further from its measurement than the baseline plan's. The baseline plan
measured now against its measurement when accepted (a change of code or machine) is reported, and
judged where the case sets `stored_step_time`. `update` is the only way a baseline changes.

Exit status: 0 nothing regressed, 1 something did (each named with old → new and its tolerance), 2 an
error (a broken config, a missing baseline, a model that no longer imports).
"""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path
from typing import Any

from core.errors import MeshplanError
from meshplan.check.compare import (
    CaseResult,
    Finding,
    compare,
    exit_code,
    planning_reference_s,
    show,
    solver_time_finding,
)
from meshplan.check.config import (
    BASELINE_DIR,
    BASELINE_PLAN,
    BASELINE_REFERENCE,
    CONFIG_NAME,
    Case,
    CheckError,
    Tolerance,
    load_config,
    load_plan,
)
from meshplan.check.measure import compare_measured, measure, reference_s

# ---------------------------------------------------------------------------------------------
# The config


# ---------------------------------------------------------------------------------------------
# Comparing a plan with its baseline


# ---------------------------------------------------------------------------------------------
# Measured runs


# ---------------------------------------------------------------------------------------------
# The gate


def check(config: str | Path, *, baseline: str | Path | None = None, run: bool = False, update: bool = False,
          progress: Any = None) -> list[CaseResult]:
    """Every case planned again (and run, with `run`), compared with its baseline, or (`update`) written
    as the new baseline. Raises CheckError for a broken config or a missing baseline; a case whose
    model no longer imports or plans is a CaseResult with its error."""
    from planner.search.plan import make_plan

    say = progress or (lambda _m: None)
    cases = load_config(config)
    root = Path(baseline) if baseline is not None else Path(config).parent / BASELINE_DIR
    if not update:
        for case in cases:
            if _baseline_plan(root / case.name) is None:
                raise CheckError(f"no baseline for case {case.name!r} in {root}; write one with meshplan check --update")
            if run and not (root / case.name / "measured.json").is_file():
                raise CheckError(f"no measured baseline for case {case.name!r} in {root}; write one with "
                                 "meshplan check --run --update")
    results = []
    for case in cases:
        say(f"{case.name}: planning")
        result = CaseResult(case.name)
        results.append(result)
        try:
            before = planning_reference_s()
            new, _ = make_plan(case.request)
            reference = min(before, planning_reference_s())  # the machine's speed around the plan
        except MeshplanError as e:
            result.error = f"{case.name}: {str(e).splitlines()[0]}"
            continue
        where = root / case.name
        with tempfile.TemporaryDirectory() as tmp:  # the baseline changes only under `update`
            fresh = Path(tmp) / "strategy.json"
            new.save(fresh)
            measured = None
            if run:
                say(f"{case.name}: running {case.runs}× {case.steps} steps" + ("" if update else ", and the baseline's"))
                try:
                    measured = measure(case, fresh, None if update else _baseline_plan(where))
                except MeshplanError as e:
                    result.error = f"{case.name}: {str(e).splitlines()[0]}"
                    continue
            if update:
                where.mkdir(parents=True, exist_ok=True)
                (where / "strategy.json").unlink(missing_ok=True)
                (where / BASELINE_PLAN).write_bytes(gzip.compress(fresh.read_bytes(), mtime=0))
                (where / BASELINE_REFERENCE).write_text(json.dumps({"planning_reference_s": reference}) + "\n")
                if measured is not None:
                    (where / "measured.json").write_text(json.dumps(measured, indent=1) + "\n")
                result.findings.append(Finding(case.name, "baseline", None, "written", "ok", str(where)))
                continue
        baseline_plan = _baseline_plan(where)
        assert baseline_plan is not None
        result.findings += compare(case, load_plan(baseline_plan), new, reference / _baseline_reference_s(where, reference))
        if measured is not None:
            old = json.loads((where / "measured.json").read_text())
            result.findings += compare_measured(case, old, measured)
    return results


def _baseline_reference_s(where: Path, default: float) -> float:
    """The planning workload's time stored with a baseline; `default` (no correction) for a baseline
    written before it was stored."""
    path = where / BASELINE_REFERENCE
    if not path.is_file():
        return default
    try:
        value = float(json.loads(path.read_text())["planning_reference_s"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckError(f"{path}: not a planning reference ({e}); write the baseline again with meshplan check "
                         "--update") from e
    if not value > 0:
        raise CheckError(f"{path}: planning_reference_s must be positive, got {value}; write the baseline again "
                         "with meshplan check --update")
    return value


def _baseline_plan(where: Path) -> Path | None:
    """A case's accepted plan: gzipped as `update` writes it, or a plain strategy file put there."""
    return next((p for p in (where / BASELINE_PLAN, where / "strategy.json") if p.is_file()), None)


# ---------------------------------------------------------------------------------------------
# Reports


__all__ = ["CONFIG_NAME", "Case", "CaseResult", "CheckError", "Finding", "Tolerance", "check", "compare_measured",
           "exit_code", "load_config", "reference_s", "show", "solver_time_finding"]
