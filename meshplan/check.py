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
import os
import statistics
import tempfile
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from core.errors import MeshplanError
from core.layout import parse_layout
from core.levers import Mode, Recompute, Schedule, lever
from planner.search.request import PlanRequest
from planner.strategy import Strategy

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


@dataclass(frozen=True)
class Finding:
    case: str
    metric: str
    old: float | str | None
    new: float | str | None
    status: str  # regression | improvement | changed | ok
    note: str = ""

    def line(self) -> str:
        return f"{self.case}: {self.metric} {show(self.old)} → {show(self.new)}" + (f" ({self.note})" if self.note else "")


@dataclass
class CaseResult:
    case: str
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None

    @property
    def regressed(self) -> bool:
        return any(f.status == "regression" for f in self.findings)


# ---------------------------------------------------------------------------------------------
# The config

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


# ---------------------------------------------------------------------------------------------
# Comparing a plan with its baseline


def comm_bytes_per_step(s: Strategy) -> float:
    """Bytes the plan's collectives move per optimizer step (a per-micro-batch one k times)."""
    from core.collectives import Cadence

    k = s.training.micro_batches
    return sum(c.size_bytes * (k if c.cadence is Cadence.MICRO_BATCH else 1) for n in s.nodes.values() for c in n.collectives)


def structure(s: Strategy) -> dict[str, str]:
    """The plan's shape as short texts, compared field by field."""
    tr = s.training
    out = {"mesh": " × ".join(f"{a}={n}" for a, n in zip(s.mesh.axis_names, s.mesh.shape, strict=True)),
           "micro-steps": str(tr.micro_batches),
           "ZeRO": str(tr.zero_stage) + (f" ({sum(1 for v in tr.zero_stages.values() if v)} parameters sharded)"
                                         if tr.zero_stages else ""),
           "recomputation": ", ".join(f"{g} {p}" + (f" {tr.recompute_layers[g]}" if g in tr.recompute_layers else "")
                                      for g, p in sorted(tr.recompute.items())) or "none"}
    if s.pipeline is not None:
        out["pipeline"] = (f"{len(s.pipeline.stages)} stages × {s.pipeline.virtual_stages} chunks, {s.pipeline.schedule}, "
                           f"layers {[st.layers for st in s.pipeline.stages]}")
    return out


def compare(case: Case, old: Strategy, new: Strategy, slowdown: float = 1.0) -> list[Finding]:
    """The new plan against the baseline's; `slowdown`: this machine's planning speed now against when
    the baseline was written (`planning_reference_s` now / then; 1 where none was stored)."""
    t, name = case.tolerance, case.name
    out: list[Finding] = []

    def relative(metric: str, a: float, b: float, tol: float) -> None:
        limit = a * (1 + tol)
        if b > limit:
            out.append(Finding(name, metric, a, b, "regression", f"+{b / a - 1:.1%} > tolerance +{tol:.0%}"))
        elif b < a * (1 - tol):
            out.append(Finding(name, metric, a, b, "improvement", f"{b / a - 1:.1%}"))
        else:
            out.append(Finding(name, metric, a, b, "ok", f"{b / a - 1:+.1%} within ±{tol:.0%}"))

    relative("predicted step time (s)", old.cost.step_time_s, new.cost.step_time_s, t.step_time)
    relative("memory per device (bytes)", old.cost.memory_bytes_per_device, new.cost.memory_bytes_per_device, t.memory)
    solver = solver_time_finding(name, old.solver.time_s, new.solver.time_s, slowdown, t)
    if solver is not None:
        out.append(solver)
    if old.solver.status != new.solver.status:
        out.append(Finding(name, "solver status", old.solver.status, new.solver.status,
                           "regression" if new.solver.status != "OPTIMAL" else "improvement"))
    for label, x, y in (("compute (s)", old.cost.compute_s, new.cost.compute_s),
                        ("communication (s)", old.cost.comm_s, new.cost.comm_s),
                        ("bubble (s)", old.cost.bubble_s, new.cost.bubble_s),
                        ("collective bytes per step", comm_bytes_per_step(old), comm_bytes_per_step(new))):
        if abs(y - x) > 1e-9 * max(abs(x), 1e-30):
            out.append(Finding(name, label, x, y, "changed"))
    s_old, s_new = structure(old), structure(new)
    for key in sorted(set(s_old) | set(s_new)):
        if s_old.get(key) != s_new.get(key):
            out.append(Finding(name, key, s_old.get(key), s_new.get(key), "changed"))
    moved = sorted(tn for tn, p in new.tensors.items() if tn in old.tensors and old.tensors[tn].spec != p.spec)
    if moved:
        out.append(Finding(name, "placements", None, f"{len(moved)} tensors re-placed", "changed",
                           ", ".join(moved[:5]) + (" …" if len(moved) > 5 else "")))
    return out


def solver_time_finding(name: str, old_s: float, new_s: float, slowdown: float, t: Tolerance) -> Finding | None:
    """A solver time past its tolerance, judged at the baseline's machine speed: `new_s / slowdown`
    against `old_s` (a factor, and at least `solver_slack_s` more). None where it is within."""
    b = new_s / slowdown
    if b > old_s * t.solver_time and b - old_s > t.solver_slack_s:
        speed = f" at the baseline's machine speed (this machine ×{slowdown:.2f} slower)" if slowdown != 1.0 else ""
        return Finding(name, "solver time (s)", old_s, new_s, "regression",
                       f"×{b / old_s:.1f}{speed} > tolerance ×{t.solver_time:g} (and +{b - old_s:.1f} s)")
    return None


def planning_reference_s(rounds: int = 15) -> float:
    """This machine's speed for planning now, without torch: the fastest of `rounds` of a fixed
    pure-Python workload (tuples hashed into a dict and read back, 7–14 ms a round here), the kind of
    interpreter work the cost model's pricing and the ILP's model building are made of. A shared VM's
    speed moves by 2× and more between days: Llama-3-8B's 8×8 solve took 1.7 s when its baseline was
    written and 4.2–5.3 s a day later on the same code (plan 0562fc0 too: 3.2 s wall then, 8.2 s now).
    The fastest round, not the median: within minutes single rounds scatter 7–14 ms without the
    solve beside them moving with them (6 solves of llama-tiny: 5.7–7.5 s, their ratio to the median
    reference scattering more than the raw times, 1.54× against 1.30×), while the fastest round held
    at 6.3–7.3 ms that day (3.4 ms on a fast one)."""
    import time

    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        table: dict[tuple[int, int, int], int] = {}
        for i in range(20_000):
            table[(i, i % 7, i % 13)] = i
        total = 0
        for i in range(20_000):
            total += table[(i, i % 7, i % 13)]
        times.append(time.perf_counter() - t0)
    return min(times)


# ---------------------------------------------------------------------------------------------
# Measured runs


def measure(case: Case, strategy_path: Path, baseline_path: Path | None = None) -> dict[str, Any]:
    """`meshplan run` of the case's plan `runs` times — interleaved with as many runs of the baseline's
    plan (`baseline_path`), A B A B …, so that both meet the machine in the same states — each run
    between two timings of a fixed reference workload (`reference_s`). Per plan: each run's step time,
    also as a multiple of the reference's time at that moment, their median and median absolute
    deviation; the prediction's drift from the median; with a baseline plan, the paired ratios new /
    baseline of the runs side by side."""
    plans = {"new": strategy_path} if baseline_path is None else {"new": strategy_path, "baseline": baseline_path}
    raw: dict[str, list[tuple[float, float]]] = {k: [] for k in plans}
    for i in range(case.runs):
        for key in (list(plans) if i % 2 == 0 else list(plans)[::-1]):  # A B, B A, …: no side always first
            raw[key].append(_one_run(case, plans[key]))
    out = _summary(raw["new"], _load(strategy_path).cost.step_time_s)
    if baseline_path is not None:
        out["baseline_now"] = _summary(raw["baseline"], _load(baseline_path).cost.step_time_s)
        pairs = [b[0] / a[0] for a, b in zip(raw["baseline"], raw["new"], strict=True)]
        med = statistics.median(pairs)
        out["paired"] = {"ratios": pairs, "median": med, "mad": statistics.median(abs(x - med) for x in pairs)}
    return out


def _one_run(case: Case, path: Path) -> tuple[float, float]:
    """(measured step s, reference s around it)."""
    from executor.launch import run
    from executor.preflight import RunOptions

    s = _load(path)
    nproc = s.pipeline.devices if s.pipeline is not None else s.mesh.num_devices
    before = reference_s()
    r = run(str(path), case.model, nproc=nproc, opts=RunOptions(steps=case.steps, warmup=2))
    return float(r["measured_step_s"]), (before + reference_s()) / 2


def _summary(runs: list[tuple[float, float]], predicted_s: float) -> dict[str, Any]:
    samples = [x for x, _ in runs]
    ratios = [x / ref for x, ref in runs]
    med = statistics.median(ratios)
    return {"samples_s": samples, "reference_s": [ref for _, ref in runs], "median_s": statistics.median(samples),
            "median_ratio": med, "mad_ratio": statistics.median(abs(x - med) for x in ratios),
            "predicted_s": predicted_s, "drift_points": 100 * abs(predicted_s / statistics.median(samples) - 1)}


def reference_s() -> float:
    """The machine's speed now: the median time of 5 rounds of 20 single-threaded 256×256 fp32
    matmuls (about 20 ms here), the kind of work a CPU rank's step is made of."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(20):
                a @ a
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def _se(mad: float, n: int) -> float:
    """The standard error of a median of n samples whose median absolute deviation is `mad` (normal
    samples: σ ≈ 1.4826·MAD, and the median's error ≈ 1.2533·σ/√n)."""
    return 1.2533 * 1.4826 * mad / max(n, 1) ** 0.5


def compare_measured(case: Case, old: dict[str, Any], new: dict[str, Any]) -> list[Finding]:
    """Judged on runs side by side, each only past its tolerance and k × the median's error: is the new
    plan slower than the baseline's (the paired ratios)? Did its prediction drift further from its
    measurement than the baseline's from the baseline plan's, measured now? Reported, and judged only
    where `stored_step_time` is set: the baseline's plan now against its measurement when accepted
    (as multiples of a reference workload's time, so that a machine slower as a whole is not a
    regression). On this VM the same plan measured 14.3–17.5 ms from one check to the next with the
    reference unchanged: beyond any 10% gate on stored figures; side by side, within ±5%."""
    t, name = case.tolerance, case.name
    out = []

    def judge(metric: str, a: float, b: float, noise: float, tol: float | None, note: str) -> None:
        if tol is not None and b > a * (1 + tol) and b - a > t.noise_k * noise:
            out.append(Finding(name, metric, a, b, "regression",
                               f"+{b / a - 1:.1%} > tolerance +{tol:.0%} and > {t.noise_k:g}× the noise; {note}"))
        elif b < a * (1 - (tol if tol is not None else 0.0)) and a - b > t.noise_k * noise:
            out.append(Finding(name, metric, a, b, "improvement", f"{b / a - 1:.1%}; {note}"))
        else:
            out.append(Finding(name, metric, a, b, "ok" if tol is not None or abs(b / a - 1) < 1e-12 else "changed",
                               f"{b / a - 1:+.1%}; {note}"))

    paired, now = new.get("paired"), new.get("baseline_now")
    if paired is not None and now is not None:
        mad = _se(float(paired["mad"]), len(paired["ratios"]))
        judge("measured step, new plan / baseline plan", 1.0, float(paired["median"]), mad, t.measured_step_time,
              f"{len(paired['ratios'])} runs of each side by side; noise ±{mad:.1%} (the median ratio's error)")
        d_base, d_new = float(now["drift_points"]), float(new["drift_points"])
        if d_new - d_base > t.drift:
            out.append(Finding(name, "prediction drift (points)", d_base, d_new, "regression",
                               f"|predicted/measured − 1| of the new plan exceeds the baseline plan's, both measured now, "
                               f"by {d_new - d_base:.1f} points > tolerance {t.drift:g}"))
    else:
        now = new
    a, b = float(old["median_ratio"]), float(now["median_ratio"])
    noise = max(_se(float(old["mad_ratio"]), len(old["samples_s"])), _se(float(now["mad_ratio"]), len(now["samples_s"])))
    speed = statistics.median(now["reference_s"]) / statistics.median(old["reference_s"])
    judge("measured step of the baseline plan, now / accepted (× reference)", a, b, noise, t.stored_step_time,
          f"step {old['median_s'] * 1e3:.2f} → {now['median_s'] * 1e3:.2f} ms, the machine at ×{1 / speed:.2f} its "
          f"baseline speed; noise ±{noise / a:.1%} (the medians' error)"
          + ("" if t.stored_step_time is not None else "; reported, not judged (stored_step_time unset)"))
    return out


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
        result.findings += compare(case, _load(baseline_plan), new, reference / _baseline_reference_s(where, reference))
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


def _load(path: Path) -> Strategy:
    from planner.strategy import from_json, load_strategy

    try:
        if path.suffix == ".gz":
            return from_json(gzip.decompress(path.read_bytes()).decode(), str(path))
        return load_strategy(str(path))
    except (MeshplanError, OSError, UnicodeDecodeError) as e:  # (a corrupt .gz: OSError)
        raise CheckError(f"{path}: the baseline does not load ({str(e).splitlines()[0]}); write it again with "
                         "meshplan check --update") from e


def exit_code(results: list[CaseResult]) -> int:
    if any(r.error for r in results):
        return 2
    return 1 if any(r.regressed for r in results) else 0


# ---------------------------------------------------------------------------------------------
# Reports


def markdown(results: list[CaseResult]) -> str:
    """For $GITHUB_STEP_SUMMARY."""
    code = exit_code(results)
    head = {0: "✅ no regression", 1: "❌ regression", 2: "⚠️ error"}[code]
    lines = [f"## meshplan check: {head}", "", "| case | metric | old | new | status | note |", "|---|---|---|---|---|---|"]
    for r in results:
        if r.error:
            lines.append(f"| {r.case} | — | — | — | error | {r.error} |")
        for f in r.findings:
            lines.append(f"| {f.case} | {f.metric} | {_cell(f.old)} | {_cell(f.new)} | {f.status} | {f.note} |")
    return "\n".join(lines) + "\n"


def show(x: float | str | None) -> str:
    """An old or new value in a report."""
    return f"{x:.6g}" if isinstance(x, float) else "—" if x is None else str(x)


def _cell(x: float | str | None) -> str:
    return show(x).replace("|", "\\|")


def junit(results: list[CaseResult]) -> str:
    """One testcase per case: a failure per regression, an error per case that could not be checked."""
    failures = sum(r.regressed for r in results)
    errors = sum(r.error is not None for r in results)
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<testsuite name="meshplan check" tests="{len(results)}" failures="{failures}" errors="{errors}">']
    for r in results:
        out.append(f'  <testcase classname="meshplan.check" name="{escape(r.case)}">')
        if r.error:
            out.append(f'    <error message="{escape(r.error, {chr(34): "&quot;"})}"/>')
        for f in r.findings:
            if f.status == "regression":
                out.append(f'    <failure message="{escape(f.line(), {chr(34): "&quot;"})}"/>')
        body = "\n".join(f.line() for f in r.findings)
        out.append(f"    <system-out>{escape(body)}</system-out>")
        out.append("  </testcase>")
    out.append("</testsuite>")
    return "\n".join(out) + "\n"


def as_json(results: list[CaseResult]) -> str:
    return json.dumps({"exit_code": exit_code(results), "cases": [
        {"case": r.case, "error": r.error, "regressed": r.regressed,
         "findings": [{"metric": f.metric, "old": f.old, "new": f.new, "status": f.status, "note": f.note}
                      for f in r.findings]} for r in results]}, indent=1)
