"""The ILP's lower bound without edges (`planner/search/floor.py`): its closed form, a bound of every
brute-forced optimum, and an ILP whose bound is above the cutoff refused without a solve."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from core.levers import Recompute
from core.mesh import DeviceMesh
from costmodel.memory import PRECISIONS
from hwprofiles.files import load_profile
from planner.rules import rules_for_graph
from planner.search import floor as floor_mod
from planner.search.build import cost_model_for, graph_for, sharding_ilp
from planner.search.decisions import NotBetterError
from planner.search.floor import Group, time_floor
from planner.search.request import PlanRequest


def test_two_choices_under_a_limit_closed_form() -> None:
    # One decision: 1 s at 10 bytes or 3 s at 2 bytes, 5 bytes allowed. The ILP must take the second (3 s);
    # L(λ) = min(1 + 10λ, 3 + 2λ) − 5λ is largest where both choices tie, λ = 1/4: 3.5 − 1.25 = 2.25.
    # Without memory the bound is the cheaper choice, 1 s.
    f = time_floor({"a": [1.0, 3.0]}, {"a": [10.0, 2.0]}, {"a": [0, 1]}, [], 5.0)
    assert f.seconds == pytest.approx(2.25, rel=1e-9) and f.by_memory
    free = time_floor({"a": [1.0, 3.0]}, {"a": [10.0, 2.0]}, {"a": [0, 1]}, [], float("inf"))
    assert free.seconds == 1.0 and not free.by_memory


def test_recomputed_layers_closed_form() -> None:
    # One group of 4 layers, its one decision 1 s holding 10 bytes; each recomputed layer adds 0.5 s and
    # saves 2 bytes; 5 bytes allowed: the ILP recomputes 3 layers (10 − 6 = 4 ≤ 5), 2.5 s. For a fixed λ
    # the relaxation's count is at an end, n = 0 or 4: L(λ) = min(1 + 5λ, 3 − 3λ), largest at λ = 1/4,
    # 2.25 — below the optimum by the duality gap of a count that is not at an end.
    g = Group(lo=0, hi=4, time_s={0: 0.5}, saved_bytes={0: 2.0})
    f = time_floor({"a": [1.0]}, {"a": [10.0]}, {"a": [0]}, [g], 5.0)
    assert f.seconds == pytest.approx(2.25, rel=1e-6) and f.by_memory
    held = Group(lo=4, hi=4, time_s={0: 0.5}, saved_bytes={0: 2.0})  # --recompute-layers 4: 3 s, fitting
    h = time_floor({"a": [1.0]}, {"a": [10.0]}, {"a": [0]}, [held], 5.0)
    assert h.seconds == pytest.approx(3.0) and not h.by_memory


def test_floor_bounds_every_brute_forced_optimum() -> None:
    # Random instances: three decisions (two in a recomputed group), two or three choices each.
    rng = random.Random(0)
    for _ in range(300):
        ds = ["a", "b", "c"]
        width = {d: rng.choice((2, 3)) for d in ds}
        x, v = {}, 0
        for d in ds:
            x[d] = list(range(v, v + width[d]))
            v += width[d]
        costs = {d: [rng.uniform(0.1, 2.0) for _ in x[d]] for d in ds}
        mem = {d: [rng.uniform(1.0, 10.0) for _ in x[d]] for d in ds}
        g = Group(lo=0, hi=3, time_s={i: rng.uniform(0.0, 0.5) for d in "ab" for i in x[d]},
                  saved_bytes={i: rng.uniform(0.0, mem[d][x[d].index(i)] / 3) for d in "ab" for i in x[d]})
        limit = rng.uniform(5.0, 25.0)
        best = min((sum(costs[d][i] for d, i in zip(ds, pick, strict=True))
                    + n * sum(g.time_s[x[d][i]] for d, i in zip("ab", pick[:2], strict=True))
                    for pick in itertools.product(*(range(width[d]) for d in ds)) for n in range(4)
                    if sum(mem[d][i] for d, i in zip(ds, pick, strict=True))
                    - n * sum(g.saved_bytes[x[d][i]] for d, i in zip("ab", pick[:2], strict=True)) <= limit),
                   default=None)
        f = time_floor(costs, mem, x, [g], limit)
        if best is not None:
            assert f.seconds <= best * (1 + 1e-9)


@pytest.fixture
def tight_ilp(zoo: Callable[[str], Path]) -> Callable[[float], object]:
    """GPT-2-medium, 16 × 1024 tokens on 2 H100s at 12 GiB, the count of recomputed layers the ILP's
    (tests/test_recompute_counts.py: some of the 24 layers must be recomputed): its ILP given a cutoff."""
    req = PlanRequest(model=str(zoo("gpt2-medium")), dims={"seq": 1024}, profile="h100-sxm", devices=2,
                      mesh_shape=(2,), global_batch_size=16, accumulation_steps=1, memory_limit_gib=12.0)
    profile = load_profile(req.profile)
    req = req.for_profile(profile.device.is_gpu)
    graph = graph_for(req.model, req.dims_for(1))
    mesh = DeviceMesh.build(2, (2,), None, devices_per_node=profile.devices_per_node)
    assert req.dtype is not None
    model = lambda policy: cost_model_for(req, graph, mesh, profile, PRECISIONS[req.dtype], 1, policy)  # noqa: E731

    def make(cutoff_s: float) -> object:
        return sharding_ilp(req, graph, rules_for_graph(graph, mesh), model(Recompute.NONE), mesh, None, pins={},
                            memory_limit_bytes=12 * 2**30, cutoff_s=cutoff_s, recompute_model=model(Recompute.FULL))
    return make


def test_an_ilp_below_its_floor_is_not_solved(tight_ilp: Callable[[float], object],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    floors: list[floor_mod.Floor] = []
    real = floor_mod.time_floor

    def spy(*args: object, **kwargs: object) -> floor_mod.Floor:
        floors.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return floors[-1]

    monkeypatch.setattr("planner.search.solve.time_floor", spy)
    sol = tight_ilp(1e9).solve()  # type: ignore[attr-defined]
    (f,) = floors
    # The bound needs the memory row (without it, nothing is recomputed), and it is below the optimum.
    assert f.by_memory and sum(sol.recompute.values()) > 0
    assert 0 < f.seconds <= sol.stats.objective
    # A cutoff under the floor: refused before the edges are priced and the solver runs.
    import planner.search.milp as milp

    def no_solve(*args: object, **kwargs: object) -> None:
        raise AssertionError("the solver ran")

    monkeypatch.setattr(milp.LinearModel, "solve", no_solve)
    with pytest.raises(NotBetterError, match="fits the memory limit") as e:  # between L(0) and the bound
        tight_ilp(f.without_memory + 0.9 * (f.seconds - f.without_memory)).solve()  # type: ignore[attr-defined]
    assert e.value.memory
    with pytest.raises(NotBetterError) as e:  # below L(0): not for memory
        tight_ilp(f.without_memory * 0.99).solve()  # type: ignore[attr-defined]
    assert not e.value.memory


def test_counts_the_memory_floor_rules_out_are_not_imported(zoo: Callable[[str], Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # GPT-2-medium, a global batch of 64 × 1024 on 2 H100s at 20 GiB: one micro-step's floor is over the
    # limit by more than twice its activations' share, so 2 micro-steps (half the activations, the same
    # states) cannot fit either: not imported; the plan is the one the unskipped walk finds.
    import planner.search.plan as plan_mod
    from planner.search.decisions import MemoryFloorError
    from planner.search.plan import make_plan

    f = MemoryFloorError("m", parts=((10.0, 40.0, 12.0), (30.0, 8.0, 31.0)))
    assert f.may_fit(0.25, 20.0) and not f.may_fit(0.5, 20.0)  # 10 + 40·¼ = 20; 10 + 20 = 30 and 30 + 4 > 20
    assert not MemoryFloorError("m", parts=((1.0, 1.0, 25.0),)).may_fit(0.01, 20.0)  # the end of backward's

    req = PlanRequest(model=str(zoo("gpt2-medium")), dims={"seq": 1024}, profile="h100-sxm", devices=2, mesh_shape=(2,),
                      global_batch_size=64, memory_limit_gib=20.0, recompute="none")
    imported: list[int] = []
    real = plan_mod.graph_for
    monkeypatch.setattr(plan_mod, "graph_for", lambda path, dims: imported.append(dims["batch"]) or real(path, dims))
    skipped, _ = make_plan(req)
    monkeypatch.setattr(MemoryFloorError, "may_fit", lambda *_: True)
    walked = list(imported)
    imported.clear()
    every, _ = make_plan(req)
    assert skipped.step_time_s == every.step_time_s and skipped.training.micro_batches == every.training.micro_batches
    assert len(walked) < len(imported), (walked, imported)
