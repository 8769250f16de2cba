"""A solver-neutral 0-1 linear program, and its solution with CP-SAT or a MIP solver.

The sharding ILP is written once against `LinearModel` (boolean and bounded integer variables, named
linear constraints lo ≤ Σ coef·var ≤ hi, a linear objective to minimise, hints) and solved by the
backend the user picks.
Measured on Llama-3-8B (32 layers, batch 16 × seq 8192) on an 8×8 mesh, the same 37k-variable model,
proved optimal by each (this machine, 2 cores): CBC 1.8 s, SCIP 7.8 s, CP-SAT 4.5–12 s (max_lp + core,
2 workers; varies run to run), HiGHS 126 s. CBC is the default. Under the overlapped objective (`overlap.py`: two integer variables
bounded below by rows over thousands of terms) CP-SAT's bound comes slowly: the same 8B case 38 s with
these parameters (10 s with CP-SAT's defaults, but then 2 workers search in no fixed order), llama-tiny
on a 2x2 mesh 51 s against CBC's 1.6 s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from core.errors import MeshplanError

BACKENDS = ("cbc", "cpsat", "scip", "highs")


@dataclass
class MilpResult:
    status: str  # OPTIMAL, FEASIBLE (time limit, a plan with a gap), INFEASIBLE, UNKNOWN
    values: list[int]  # per variable (0 or 1 for a boolean)
    objective: float
    bound: float
    time_s: float
    note: str = ""  # how it was solved, where not as asked (the MIP solver crashed: CP-SAT instead)


@dataclass
class LinearModel:
    names: list[str] = field(default_factory=list)
    constraints: list[tuple[str, list[tuple[int, int]], int, int]] = field(default_factory=list)
    objective: list[tuple[int, int]] = field(default_factory=list)
    hints: dict[int, bool] = field(default_factory=dict)
    bounds: dict[int, tuple[int, int]] = field(default_factory=dict)  # integer variables' ranges
    cutoff: int | None = None  # the objective must not exceed it (a plan already found): else INFEASIBLE
    # Solved by a MIP backend in a forked process, so that the solver crashing is not the end of the
    # planner: the ILP is solved again by CP-SAT (`MilpResult.note` says so). CBC died of a segmentation
    # fault inside Solver.Solve twice on Llama-3-70B's offload search on 8 H100 (`planner/search/
    # offload.py`), and aborted (CoinError) on Mixtral-8x7B's on 16 H100 and on MPT-30B's own plan on 8
    # A100 (published row 5, at bc9e26e); not yet found which ILPs. `ShardingILP` isolates every solve.
    isolated: bool = False
    _names: set[str] = field(default_factory=set)

    def bool_var(self, name: str) -> int:
        self.names.append(name)
        return len(self.names) - 1

    def int_var(self, name: str, lo: int, hi: int) -> int:
        v = self.bool_var(name)
        self.bounds[v] = (lo, hi)
        return v

    def add(self, name: str, terms: list[tuple[int, int]], lo: int, hi: int) -> None:
        self.constraints.append((name, terms, lo, hi))
        self._names.add(name)
        assert len(self._names) == len(self.constraints), f"constraint name {name} used twice"

    def add_equal(self, name: str, left: list[int], right: list[int]) -> None:
        """Σ left = Σ right, all coefficients 1."""
        self.add(name, [(v, 1) for v in left] + [(v, -1) for v in right], 0, 0)

    @property
    def num_variables(self) -> int:
        return len(self.names)

    @property
    def num_constraints(self) -> int:
        return len(self.constraints)

    def solve(self, backend: str, *, time_limit_s: float, num_workers: int = 2, log: bool = False) -> MilpResult:
        if backend not in BACKENDS:
            raise MeshplanError(f"`solver` {backend}: choose one of {', '.join(BACKENDS)}")
        t0 = time.perf_counter()
        if backend == "cpsat":
            result = self._cpsat(time_limit_s, num_workers, log)
        elif self.isolated:
            try:
                result = _forked(lambda: self._mip(backend, time_limit_s, log), backend)
            except SolverCrash as e:
                result = self._cpsat(max(1.0, time_limit_s - (time.perf_counter() - t0)), num_workers, log)
                result.note = f"{e.solver} crashed ({e.how}): solved by cpsat"
        else:
            result = self._mip(backend, time_limit_s, log)
        result.time_s = time.perf_counter() - t0
        return result

    def _cpsat(self, time_limit_s: float, num_workers: int, log: bool) -> MilpResult:
        from ortools.sat.python import cp_model

        m = cp_model.CpModel()
        xs = [m.new_int_var(*self.bounds[i], n) if i in self.bounds else m.new_bool_var(n)
              for i, n in enumerate(self.names)]
        for name, terms, lo, hi in self.constraints:
            m.add_linear_constraint(sum(c * xs[v] for v, c in terms), lo, hi).with_name(name)
        for v, value in self.hints.items():
            m.add_hint(xs[v], value)
        m.minimize(sum(c * xs[v] for v, c in self.objective))
        if self.cutoff is not None:
            m.add(sum(c * xs[v] for v, c in self.objective) <= self.cutoff)
        solver = cp_model.CpSolver()
        p = solver.parameters
        p.max_time_in_seconds = time_limit_s
        p.num_workers = num_workers
        # Reproducible: the same model gives the same solution, run after run (`meshplan check`).
        p.random_seed = 0
        p.interleave_search = True
        for s in ("max_lp", "core"):  # LP-heavy search and core-based bounds: best measured here
            p.subsolvers.append(s)
        p.log_search_progress = log
        status = solver.solve(m)
        name = solver.status_name(status)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return MilpResult(name, [], 0.0, 0.0, 0.0)
        return MilpResult(name, [int(solver.value(x)) for x in xs], solver.objective_value,
                          solver.best_objective_bound, 0.0)

    def _mip(self, backend: str, time_limit_s: float, log: bool) -> MilpResult:
        from ortools.linear_solver import pywraplp

        solver = pywraplp.Solver.CreateSolver(backend.upper())
        if solver is None:
            raise MeshplanError(f"`solver` {backend}: not available in this OR-Tools build; use cbc or cpsat")
        if log:
            solver.EnableOutput()
        xs = [solver.IntVar(*self.bounds[i], n) if i in self.bounds else solver.BoolVar(n)
              for i, n in enumerate(self.names)]
        for name, terms, lo, hi in self.constraints:
            ct = solver.Constraint(lo, hi, name)
            for v, c in _summed(terms):
                ct.SetCoefficient(xs[v], c)
        obj = solver.Objective()
        objective = _summed(self.objective)
        for v, c in objective:
            obj.SetCoefficient(xs[v], c)
        obj.SetMinimization()
        if self.cutoff is not None:  # (CBC through OR-Tools takes no cutoff parameter: a row)
            ct = solver.Constraint(-solver.infinity(), self.cutoff, "cutoff")
            for v, c in objective:
                ct.SetCoefficient(xs[v], c)
        if self.hints:
            solver.SetHint(xs, [float(self.hints.get(i, False)) for i in range(len(xs))])
        solver.SetTimeLimit(int(time_limit_s * 1000))
        status = solver.Solve()
        names = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
                 pywraplp.Solver.INFEASIBLE: "INFEASIBLE"}
        name = names.get(status, "UNKNOWN")
        if name not in ("OPTIMAL", "FEASIBLE"):
            return MilpResult(name, [], 0.0, 0.0, 0.0)
        bound = obj.BestBound() if name == "FEASIBLE" else obj.Value()
        return MilpResult(name, [round(x.solution_value()) for x in xs], obj.Value(), bound, 0.0)


class SolverCrash(MeshplanError):
    """The MIP solver's process died on an ILP (a signal, or an abort)."""

    def __init__(self, solver: str, how: str) -> None:
        super().__init__(f"the solver ({solver}) crashed on this ILP ({how}); plan with `solver` cpsat")
        self.solver, self.how = solver, how


def _forked(solve: Callable[[], MilpResult], backend: str) -> MilpResult:
    """`solve()` in a forked child (copy-on-write: the model is not sent), its result pickled back; a child
    that dies without one is a `SolverCrash` naming the solver."""
    import os
    import pickle

    if not hasattr(os, "fork"):
        return solve()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        os.close(read)
        try:
            data = pickle.dumps(("ok", solve()))
        except BaseException as e:  # (sent to the parent, which raises it)
            data = pickle.dumps(("error", e))
        with os.fdopen(write, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit code {os.WEXITSTATUS(status)}"
        raise SolverCrash(backend, how)
    kind, value = pickle.loads(data)
    if kind == "error":
        raise value
    assert isinstance(value, MilpResult)
    return value


def _summed(terms: list[tuple[int, int]]) -> Iterable[tuple[int, int]]:
    """(variable, coefficient) terms with each variable's coefficients summed (a solver row holds one)."""
    if len({v for v, _ in terms}) == len(terms):
        return terms
    out: dict[int, int] = {}
    for v, c in terms:
        out[v] = out.get(v, 0) + c
    return out.items()
