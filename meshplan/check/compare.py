"""A case's new plan against its baseline: what changed, within or past its tolerance."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshplan.check.config import Case, Tolerance
from planner.strategy import Strategy


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


def show(x: float | str | None) -> str:
    """An old or new value in a report."""
    return f"{x:.6g}" if isinstance(x, float) else "—" if x is None else str(x)


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


def exit_code(results: list[CaseResult]) -> int:
    if any(r.error for r in results):
        return 2
    return 1 if any(r.regressed for r in results) else 0
