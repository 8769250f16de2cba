"""Pipeline stages: the closed forms (bubble, micro-batches in flight, sends), a pipelined plan priced
stage by stage from them, its strategy file, and the inputs refused."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from core.collectives import Collective
from costmodel.device import link_collective_time_s
from costmodel.pipeline import bubble_fraction, hop_delays, in_flight, p2p_bytes, pipeline_step_s, simulate
from hwprofiles.files import load_profile
from hwprofiles.profile import LinkLevel
from planner.graph import load_graph
from planner.search.plan import make_plan
from planner.search.request import PlanRequest
from planner.strategy import from_json


@pytest.mark.parametrize(("schedule", "p", "m", "v", "want"), [
    ("gpipe", 4, 8, 1, 3 / 8), ("1f1b", 4, 8, 1, 3 / 8), ("1f1b", 8, 64, 1, 7 / 64), ("interleaved", 4, 8, 2, 3 / 16),
    ("1f1b", 1, 4, 1, 0.0)])
def test_bubble_fraction(schedule: str, p: int, m: int, v: int, want: float) -> None:
    # Narayanan et al. SC'21 §2.2: (p − 1)/m for GPipe and 1F1B, (p − 1)/(v·m) interleaved; and the
    # step of equal stages t is m·t·(1 + bubble).
    assert bubble_fraction(schedule, p, m, v) == pytest.approx(want)
    assert pipeline_step_s(schedule, [0.01] * p, m, v) == pytest.approx(m * 0.01 * (1 + want))


def test_micro_batches_in_flight() -> None:
    # 1F1B: stage i holds p − i micro-batches at its peak (the first p, the last 1), never more than m;
    # GPipe holds all m; interleaved, the first stage p·(1 + (p − 1)/(p·v)) (Korthikanti et al. §4.2.3).
    assert [in_flight("1f1b", 4, 8, i) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, 2, i) for i in range(4)] == [2, 2, 2, 1]
    assert [in_flight("gpipe", 4, 8, i) for i in range(4)] == [8] * 4
    assert in_flight("interleaved", 4, 8, 0, 2) == pytest.approx(4 * (1 + 3 / 8))
    with pytest.raises(ValueError, match="interleaved"):
        in_flight("1f1b", 4, 8, 0, 2)


def test_pipelined_plan_priced_from_its_stages(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # GPT-2 tiny (2 layers, h = 64), 2 stages × 2 data-parallel ranks, 8 sequences of 32 tokens per step,
    # 1 per rank per micro-batch: m = 4 micro-batches. Each stage holds one layer; the hidden state
    # crossing the cut is B·s·h elements at its planned placement, sent forward and its gradient back (bf16);
    # the step is the pipeline of the stages' times plus the slowest per-step work; stage i holds
    # min(p − i, m) micro-batches of activations under 1F1B.
    model = zoo("gpt2-tiny")
    s, _ = make_plan(PlanRequest(model=str(model), dims={"seq": 32}, profile="h100-sxm", devices=4,
                                 layout="dp_replicate=2,pp=2", global_batch_size=8))
    pl = s.pipeline
    assert pl is not None and pl.schedule == "1f1b" and s.training.micro_batches == 4
    assert [st.layers for st in pl.stages] == [1, 1] and [st.devices for st in pl.stages] == [(0, 1), (2, 3)]
    assert [st.in_flight for st in pl.stages] == [2, 1]
    assert pl.bubble_fraction == pytest.approx(1 / 4)
    g = load_graph(model, s.model.dims)
    (hidden,) = g.node_by_name[pl.stages[0].last_node].outputs  # the residual stream crossing the cut
    spec = s.spec_of(hidden)
    assert spec is not None and g.tensors[hidden].shape == (2, 32, 64)  # B·s·h, B = 2 over the 2 dp ranks
    assert pl.p2p_bytes == p2p_bytes(math.prod(spec.local_shape((2, 32, 64), s.mesh.shape)), 2)
    times, sends = [st.time_s for st in pl.stages], [st.send_s for st in pl.stages]
    # the first stage's sends: the hidden state forward and its gradient back, a send-receive each
    # within the node; the last stage sends nothing on
    link = link_collective_time_s(load_profile("h100-sxm"), Collective.SEND_RECV, pl.p2p_bytes / 2, 2, LinkLevel.INTRA_NODE)
    assert sends == [pytest.approx(2 * link), 0.0]
    assert s.cost.step_time_s == pytest.approx(pipeline_step_s("1f1b", times, 4, 1, sends)
                                               + max(st.step_s for st in pl.stages) + s.cost.overhead_s)
    assert s.cost.bubble_s == pytest.approx(pipeline_step_s("1f1b", times, 4) - 4 * max(times))
    assert s.cost.memory_bytes_per_device == pytest.approx(max(st.memory_bytes for st in pl.stages))
    again = from_json(s.to_json())  # the strategy file carries the pipeline (and validates against the schema)
    assert again.pipeline == pl and again.cost.bubble_s == s.cost.bubble_s


def test_interleaved_chunks_and_megatron_layout(zoo: Callable[[str], Path]) -> None:
    # Megatron's notation: tp=2,pp=2,vpp=2 needs 2 × 2 chunks of equal layers, and llama-tiny has 2
    # layers: refused, naming why. Without vpp, GPipe holds all m = 8 micro-batches on every stage and
    # its bubble is (p − 1)/m = 1/8.
    model = zoo("llama-tiny")
    with pytest.raises(Exception, match=r"vpp=2: 2 layers over 2 stages × 2 chunks do not divide evenly"):
        make_plan(PlanRequest(model=str(model), dims={"seq": 32}, profile="h100-sxm", devices=4,
                              layout="tp=2,pp=2,vpp=2", global_batch_size=8))
    s, _ = make_plan(PlanRequest(model=str(model), dims={"seq": 32}, profile="h100-sxm", devices=4,
                                 layout="tp=2,pp=2", global_batch_size=8, schedule="gpipe"))
    assert s.pipeline is not None and s.pipeline.schedule == "gpipe"
    assert [st.in_flight for st in s.pipeline.stages] == [8, 8]
    assert math.isclose(s.pipeline.bubble_fraction, 1 / 8)


@pytest.mark.parametrize(("args", "message"), [
    (["--layout", "pp=4", "--global-batch-size", "8"], "--layout pp=4: more stages than the 2 repeated layers"),
    (["--layout", "dp_replicate=2,pp=2", "--global-batch-size", "8", "--schedule", "zigzag"],
     "--schedule zigzag: choose one of gpipe, 1f1b, interleaved"),
    (["--layout", "dp_replicate=2,pp=2", "--global-batch-size", "8", "--schedule", "interleaved"],
     "the interleaved schedule is the one with virtual stages"),
    (["--layout", "dp_replicate=4", "--global-batch-size", "8", "--schedule", "1f1b"], "give --layout with pp=N"),
    (["--layout", "dp_replicate=2,vpp=2", "--global-batch-size", "8"], "vpp=2: virtual stages interleave a pipeline"),
    (["--layout", "dp_replicate=2,pp=2", "--dim", "batch=8"], "a pipeline runs micro-batches of a global batch"),
])
def test_bad_pipeline_input(args: list[str], message: str, zoo: Callable[[str], Path], tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["plan", str(zoo("gpt2-tiny")), "--dim", "seq=32", "--devices", "4", *args,
                                  "-o", str(tmp_path / "s.json")])
    assert r.exit_code == 2, r.output
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _planned_by_cli(model: Path, tmp_path: Path) -> Path:
    """gpt2-tiny on 2 stages × 2 data-parallel ranks, planned by `meshplan plan`; the strategy file."""
    out = tmp_path / "s.json"
    r = CliRunner().invoke(main, ["plan", str(model), "--dim", "seq=32", "--devices", "4", "--layout",
                                  "dp_replicate=2,pp=2", "--global-batch-size", "8", "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out


def test_explain_shows_stages_not_sub_mesh_baselines(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # A pipelined plan's mesh is one stage's: explain lists its stages and prices no baseline on that
    # sub-mesh (which would ignore the other stages), saying why.
    from planner.explain import explain_strategy

    s, _ = make_plan(PlanRequest(model=str(zoo("gpt2-tiny")), dims={"seq": 32}, profile="h100-sxm", devices=4,
                                 layout="dp_replicate=2,pp=2", global_batch_size=8))
    s.save(tmp_path / "s.json")
    e = explain_strategy(str(tmp_path / "s.json"))
    assert [b["name"] for b in e["baselines"]] == ["plan (auto)", "baselines"]
    assert "without pipeline stages" in e["baselines"][1]["note"]
    assert [st["layers"] for st in e["pipeline"]["stages"]] == [1, 1] and e["pipeline"]["schedule"] == "1f1b"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulated_schedule_matches_the_closed_form(schedule: str) -> None:
    # p = 4 equal stages, forward f and backward b per micro-batch, m = 8: both schedules end at
    # (m + p − 1)·(f + b), the step `pipeline_step_s` gives; 1F1B's first stage runs p − 1 = 3 forwards
    # before its first backward, GPipe's all 8.
    from costmodel.pipeline import simulate

    rows = simulate(schedule, [1.0] * 4, [2.0] * 4, 8)
    end = max(e for row in rows for *_, e in row)
    assert end == pytest.approx((8 + 4 - 1) * 3.0) == pytest.approx(pipeline_step_s(schedule, [3.0] * 4, 8))
    first_b = next(k for k, (kind, *_) in enumerate(rows[0]) if kind == "B")
    assert first_b == (4 if schedule == "1f1b" else 8)
    assert all(len(row) == 16 for row in rows)


@pytest.mark.parametrize("v", [2, 4])
def test_simulated_interleaved_schedule_matches_the_closed_form(v: int) -> None:
    # Interleaved 1F1B, p = 4 stages of v chunks, each chunk a 1/v of the stage (f = 1, b = 2 per stage),
    # m = 8: the fill and drain shrink by v, m·(f + b) + (p − 1)·(f + b)/v = 24 + 9/v; the first stage
    # runs (p − 1)·2 + (v − 1)·p warm-up forwards (Megatron-LM's), then one more before its first backward.
    from costmodel.pipeline import simulate

    rows = simulate("interleaved", [1.0] * 4, [2.0] * 4, 8, v)
    end = max(e for row in rows for *_, e in row)
    assert end == pytest.approx(24 + 9 / v) == pytest.approx(pipeline_step_s("interleaved", [3.0] * 4, 8, v))
    assert next(k for k, (kind, *_) in enumerate(rows[0]) if kind == "B") == 6 + (v - 1) * 4 + 1
    assert all(len(row) == 2 * 8 * v for row in rows)


def _end(rows: list[list[tuple[str, int, float, float]]]) -> float:
    return max(e for row in rows for *_, e in row)


def test_sends_pace_1f1b_where_micro_batches_in_flight_wait_for_them() -> None:
    # 2 stages, forward 1 and backward 2 each, a transfer of 1 each way (round trip 2). Stage 0 holds
    # 2 micro-batches in flight: it starts micro-batch k + 2 only when k's backward is back, a loop of
    # F(1) + send(1) + F(1) + B(2) + send(1) + B(2) = 8 for 2 micro-batches, so the steady pace is 4
    # per micro-batch, not the stages' 3 — and not 3 + 2 = 5, the closed form with the sends inside
    # the stage's time. Fill and drain: one micro-batch through and back, 6 + 2.
    ends = [_end(simulate("1f1b", [1.0, 1.0], [2.0, 2.0], m, send_s=[1.0, 0.0])) for m in (8, 12)]
    assert ends[1] - ends[0] == pytest.approx(4 * 4)
    assert pipeline_step_s("1f1b", [3.0, 3.0], 12, 1, [2.0, 0.0]) == pytest.approx(6 + 2 + 11 * 4)
    # Two stages hold no slack: a round trip of 0.5 still paces them, (6 + 0.5)/2 = 3.25. Four stages,
    # the first holding 4 in flight, absorb it: (12 + 3 × 0.5)/4 = 3.375 for the run of all four, but
    # the pairs' (6 + 0.5)/2 = 3.25 binds.
    ends = [_end(simulate("1f1b", [1.0, 1.0], [2.0, 2.0], m, send_s=[0.25, 0.0])) for m in (8, 12)]
    assert ends[1] - ends[0] == pytest.approx(4 * 3.25)
    ends = [_end(simulate("1f1b", [1.0] * 4, [2.0] * 4, m, send_s=[0.25] * 3 + [0.0])) for m in (16, 24)]
    assert ends[1] - ends[0] == pytest.approx(8 * 3.375)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_pipeline_step_with_sends_bounds_the_simulated_schedule(schedule: str) -> None:
    # Stage times and sends drawn at random (sends from 1% to as long as a stage): the step priced
    # never falls below the schedule simulated with each send as a delay (backward twice the forward),
    # GPipe's equals it, and (one chunk per stage) it is never above the closed form that counts the
    # sends in every stage's time (what was priced before); with no sends it is that closed form.
    import random

    rng = random.Random(0)
    over = []
    for _ in range(300):
        p = rng.choice([2, 3, 4, 8])
        v = rng.choice([2, 3]) if schedule == "interleaved" else 1
        m = p * rng.randint(1, 6) if v > 1 else rng.randint(1, 6 * p)
        t = [rng.uniform(0.5, 1.5) for _ in range(p)]
        x = [rng.choice([0.01, 0.1, 0.3, 1.0]) * (s < p - 1 or v > 1) for s in range(p)]
        sim = _end(simulate(schedule, [a / 3 for a in t], [2 * a / 3 for a in t], m, v, hop_delays(x, v)))
        priced = pipeline_step_s(schedule, t, m, v, x)
        assert priced >= sim * (1 - 1e-9)
        if v == 1:  # (interleaved: that closed form shrinks the fill's transfers by v, which the simulation does not)
            assert priced <= pipeline_step_s(schedule, [a + b for a, b in zip(t, x, strict=True)], m) * (1 + 1e-9)
        assert pipeline_step_s(schedule, t, m, v, [0.0] * p) == pipeline_step_s(schedule, t, m, v)
        over.append(priced / sim - 1)
    if schedule == "gpipe":
        assert max(over) == pytest.approx(0.0, abs=1e-9)
    else:
        assert sorted(over)[len(over) // 2] < 0.02  # the median within 2% of the simulation


def test_explain_draws_the_timeline(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    out = _planned_by_cli(zoo("gpt2-tiny"), tmp_path)
    r = CliRunner().invoke(main, ["explain", str(out), "--timeline", str(tmp_path / "t.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_balanced_counts_ends_and_never_slows_the_slowest() -> None:
    # Layers move from the slowest stage to the fastest while that lowers Σ t² (so the loop ends), never
    # raising the slowest stage's time. Stage times built as extra + layers × one layer's time, with the
    # extras whole multiples of a layer (the ties where rounding once moved a layer back and forth
    # between two stages forever: a 16-stage Llama-3-70B layout hung).
    import random

    from planner.search.pipeline import StageCost, balanced_counts
    from planner.stagecut import Cut

    rng = random.Random(0)
    for _ in range(300):
        p = rng.choice([2, 4, 8, 16, 32])
        per = rng.choice([0.1, 0.3, 1 / 3, 0.4471])
        counts = [rng.randint(1, 6) for _ in range(p)]
        extra = [per * rng.randint(0, 3) if s in (0, p - 1) else 0.0 for s in range(p)]
        stages = [StageCost(time_s=extra[s] + counts[s] * per, compute_s=0.0, step_s=0.0, optimizer_s=0.0,
                            memory={}, in_flight=1.0, send_bytes=0.0) for s in range(p)]
        moved = balanced_counts(stages, Cut(stages=p, virtual=1, chunk_of={}, layers_per_chunk=tuple(counts)))
        if moved is not None:
            assert sum(moved) == sum(counts) and min(moved) >= 1
            assert max(extra[s] + moved[s] * per for s in range(p)) <= max(st.time_s for st in stages) + 1e-12


def test_search_candidates_deepen_and_interleave() -> None:
    # Powers of two up to the layers, a node's tensor parallelism per stage, data parallelism over the
    # rest; interleaving where the layers split into 2·p equal chunks.
    from planner.search.pipeline import candidates, interleaved

    got = [(c.pipeline, c.degree) for c in candidates(512, 8, 80)]
    assert got == [(p, {"dp_replicate": 512 // p // 8, "tp": 8}) for p in (2, 4, 8, 16, 32)] + [(64, {"tp": 8})]
    assert [c.pipeline for c in candidates(8, 8, 24)] == [2, 4, 8]
    assert interleaved(candidates(512, 8, 80)[2], 80).virtual == 2  # 80 layers = 2 × 8 × 5
    assert interleaved(candidates(512, 8, 80)[3], 80) is None  # 80 / 32 chunks is not whole


def test_explain_draws_an_interleaved_timeline(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    model, out = zoo("gpt2-tiny-4l"), tmp_path / "s.json"
    r = CliRunner().invoke(main, ["plan", str(model), "--dim", "seq=32", "--devices", "2", "--layout", "pp=2,vpp=2",
                                  "--global-batch-size", "8", "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["explain", str(out), "--timeline", str(tmp_path / "t.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("model", "layout", "schedule"), [
    ("gpt2-tiny", "dp_replicate=4,pp=2", None), ("llama-tiny", "tp=4,pp=2", "gpipe"),
    ("gpt2-medium", "tp=2,pp=4", None), ("gpt2-medium", "dp_replicate=2,pp=4,vpp=2", None)])
def test_a_pipelined_step_is_at_least_its_objective_over_the_stages(model: str, layout: str, schedule: str | None,
                                                                     zoo: Callable[[str], Path]) -> None:
    # What lets the search refuse a pipeline candidate against a plan already held (`plan_pipelined`'s
    # cutoff, p times the held step): the step is at least the stage ILP's objective (all p stages' work)
    # over p — the slowest stage paces m micro-batches and does the most per-step work.
    s, _ = make_plan(PlanRequest(model=str(zoo(model)), dims={"seq": 64}, profile="h100-sxm", devices=8,
                                 layout=layout, global_batch_size=32, schedule=schedule))
    assert s.pipeline is not None
    p = len(s.pipeline.stages)
    assert s.step_time_s >= s.solver.objective / p
