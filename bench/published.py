"""`python -m bench.run --only published`: the cost model against published training runs.

Each row of `bench/published_runs.toml` (copied from ../shared/published-runs.md, with sources) is a
real run on GPUs nobody here has: meshplan prices that run's own layout (`plan --layout …
--micro-batch-size … --recompute … --global-batch-size …` on the matching profile) and the table puts
its predicted step next to the published one, with the plan's split (compute with recomputation,
exposed communication, pipeline bubble, optimizer and per-step terms). Then meshplan plans the same
cluster and global batch freely and prints its predicted speed-up over the published layout.

The table only checks the model: no profile value or constant is fitted to it (profiles hold
datasheet figures and others' microbenchmarks, each with its source).
"""

from __future__ import annotations

import statistics
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import zoo

RUNS = Path(__file__).with_name("published_runs.toml")


@dataclass(frozen=True)
class Run:
    id: str
    model: str
    seq: int
    gpus: int
    profile: str
    global_batch: int
    micro_batch: int
    layout: str
    zero: int
    recompute: str
    attention: str
    attention_dropout: float
    dtype: str
    published: str
    step_s: float
    source: str
    cp_method: str | None = None  # context parallelism's design (the run's own)
    own_plan: bool = True  # False: no own plan (a search too large for this bench: 16,384 devices)
    time_limit_s: float = 60.0  # the solver's, for the layout's ILP
    summary: bool = True  # False: printed apart from the median of the rest (a lever checked alone)


def runs() -> list[Run]:
    return [Run(**r) for r in tomllib.loads(RUNS.read_text())["run"]]


def _request(run: Run) -> Any:
    from planner.search.request import PlanRequest

    return PlanRequest(model=str(zoo.export(run.model)), dims={"seq": run.seq}, profile=run.profile, devices=run.gpus,
                       dtype=run.dtype, global_batch_size=run.global_batch, layout=run.layout,
                       micro_batch_size=run.micro_batch, zero_stage=run.zero, recompute=run.recompute,
                       attention=run.attention, attention_dropout=run.attention_dropout, composer="overlap",
                       cp_method=run.cp_method, time_limit_s=run.time_limit_s)


def price(run: Run) -> tuple[Any, float]:
    """The run's own layout, priced: the strategy and the seconds planning took."""
    from planner.search.plan import make_plan

    t0 = time.perf_counter()
    strategy, _ = make_plan(_request(run))
    return strategy, time.perf_counter() - t0


def own_plan(run: Run) -> Any:
    """meshplan's own plan for the same cluster and global batch (every lever its choice)."""
    from planner.search.plan import make_plan

    req = replace(_request(run), layout=None, micro_batch_size=None, zero_stage=None, recompute="auto")
    strategy, _ = make_plan(req)
    return strategy


def bench_published(console: Console, *, own: bool = True, only: set[str] | None = None) -> list[float]:
    """Print the table; return |predicted − published| / published per priced row."""
    table = Table(title="published runs: predicted (meshplan, the run's own layout) against published step time")
    for col in ("#", "model", "cluster", "layout (micro-batch, recompute)", "published s", "predicted s", "error",
                "compute", "exposed comm", "bubble", "optimizer+step", "memory GiB", "own plan s", "own speed-up"):
        table.add_column(col, justify="left" if col in ("model", "cluster", "layout (micro-batch, recompute)")
                         else "right")
    errors: list[float] = []
    unpriced: list[str] = []
    apart: list[str] = []
    for run in runs():
        if only and run.id not in only:
            continue
        cluster = f"{run.gpus} {run.profile}"
        shape = f"{run.layout} ({run.micro_batch}, {run.recompute})"
        try:
            s, _ = price(run)
        except Exception as e:  # a lever meshplan lacks: listed, not dropped
            unpriced.append(f"{run.id}: {str(e).splitlines()[0]}")
            table.add_row(run.id, run.model, cluster, shape, f"{run.step_s:.3g}", "—", "not priced", *[""] * 7)
            continue
        c = s.cost
        err = (c.step_time_s - run.step_s) / run.step_s
        if run.summary:
            errors.append(abs(err))
        else:
            apart.append(f"row {run.id} ({run.model}, {run.layout}): {err:+.0%}")
        mine, speedup = "", ""
        if own and run.own_plan:
            o = own_plan(run)
            mine, speedup = f"{o.cost.step_time_s:.3g}", f"{c.step_time_s / o.cost.step_time_s:.2f}×"
        table.add_row(run.id, run.model, cluster, shape, f"{run.step_s:.3g}", f"{c.step_time_s:.3g}", f"{err:+.0%}",
                      f"{c.compute_s:.3g}", f"{c.comm_s:.3g}", f"{c.bubble_s:.3g}",
                      f"{c.optimizer_s + c.overhead_s:.3g}", f"{c.memory_bytes_per_device / 2**30:.1f}", mine, speedup)
    console.print(table)
    if errors:
        console.print(f"{len(errors)} runs priced: median |error| {statistics.median(errors):.1%}, worst "
                      f"{max(errors):.1%}; within 15%: {sum(e <= 0.15 for e in errors)}, over 35%: "
                      f"{sum(e > 0.35 for e in errors)}")
    for line in apart:
        console.print(f"not in the summary: {line}")
    for line in unpriced:
        console.print(f"not priced: {line}")
    return errors
