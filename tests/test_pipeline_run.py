"""Pipelined plans run with torch.distributed.pipelining on 4 gloo ranks, against one process: the loss,
every stage's gradients and parameters after the first step and after the last, within 2.5e-5 (fp32);
and each stage's executed collectives and sends, counted as they run, equal to the planned ones."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from executor.launch import run
from executor.pipeline import PIPELINE_PHASES
from executor.preflight import RunOptions
from planner.graph import load_graph
from planner.search.plan import make_plan
from planner.search.request import PlanRequest
from planner.stagecut import crossings, param_stages, strategy_chunks

# (model, layout, schedule): 2 stages × 2 data-parallel ranks and 4 stages of one rank, GPipe and 1F1B,
# on GPT-2 (tied embedding and LM head: a weight on the first and the last stage) and Llama; interleaved
# 1F1B with 2 chunks per stage on the 4-layer models. 32 sequences of 32 tokens per step, 4 micro-batches.
# Each schedule on a tied (GPT-2: the embedding on the first and last stage) and an untied model, with and
# without data parallelism beside the stages. (GPT-2 dp×pp under 1F1B and Llama dp×pp under GPipe, run
# until 2026-11-26, added no property to these: 20 s of the suite.)
CASES = [("gpt2-tiny", "dp_replicate=2,pp=2", "gpipe"), ("llama-tiny", "dp_replicate=2,pp=2", "1f1b"),
         ("gpt2-tiny-4l", "pp=4", "gpipe"), ("llama-tiny-4l", "pp=4", "1f1b"),
         ("gpt2-tiny-4l", "dp_replicate=2,pp=2,vpp=2", "interleaved"), ("llama-tiny-4l", "pp=2,vpp=2", "interleaved")]


def _plan(zoo: Callable[[str], Path], tmp: Path, name: str, layout: str, schedule: str, **kw: object) -> Path:
    dp = 2 if "dp_replicate=2" in layout else 1
    devices = dp * (2 if "pp=2" in layout else 4)
    s, _ = make_plan(PlanRequest(model=str(zoo(name)), dims={"seq": 32}, profile="cpu", devices=devices, layout=layout,
                                 global_batch_size=32, micro_batch_size=8 // dp, schedule=schedule,
                                 **kw))  # type: ignore[arg-type]
    assert s.pipeline is not None and s.training.micro_batches == 4
    out = tmp / "s.json"
    s.save(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layout", "schedule"), CASES, ids=[f"{n}-{lay}-{s}" for n, lay, s in CASES])
def test_pipelined_run_equals_one_process(name: str, layout: str, schedule: str, zoo: Callable[[str], Path],
                                          zoo_meta: Callable[[str], dict], tmp_path: Path) -> None:
    path = _plan(zoo, tmp_path, name, layout, schedule)
    plan = json.loads(path.read_text())
    nproc = sum(len(st["devices"]) for st in plan["pipeline"]["stages"])
    r = run(str(path), str(zoo(name)), nproc=nproc, opts=RunOptions(steps=1, warmup=1, verify=True), timeout_s=300)
    # fp32; 2e-5: the machine of 2026-11-27 (3.7x slower planning, another CPU) gives 1.96e-5 for GPT-2 4l
    # under GPipe with this session's code and the previous one's alike (1e-5 held on the machine before)
    assert r["max_abs_diff"] < 2.5e-5, r
    # Every parameter trained once, a tied weight counted once (the count torch gives at export).
    assert r["trained_parameters"] == zoo_meta(name)["num_params"]
    for st in r["stages"]:
        assert st["collectives_executed"] == st["collectives_planned"], st
        assert st["collectives_executed"]["send"] > 0


def test_what_the_stages_send_and_share(zoo: Callable[[str], Path]) -> None:
    # GPT-2 (4 layers) on 4 stages: the residual stream is all that crosses each cut (the ids are read
    # by the embedding only), a float tensor whose gradient comes back; the tied embedding / LM head
    # weight is read by the first and the last stage; every other parameter by one.
    g = load_graph(zoo("gpt2-tiny-4l"), {"batch": 8, "seq": 32})
    s, _ = make_plan(PlanRequest(model=str(zoo("gpt2-tiny-4l")), dims={"seq": 32}, profile="cpu", devices=4,
                                 layout="pp=4", global_batch_size=32, micro_batch_size=8))
    assert s.pipeline is not None
    chunk_of = strategy_chunks(g, s.pipeline)
    xs = crossings(g, chunk_of)
    assert [(x.src, x.last, x.grad) for x in xs] == [(0, 1, True), (1, 2, True), (2, 3, True)]
    assert all(g.tensors[x.tensor].shape == (8, 32, 64) for x in xs)
    shared = {t: held for t, held in param_stages(g, chunk_of, 4).items() if len(held) > 1}
    assert shared == {"model.lm_head.weight": (0, 3)}


def _cli(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.stderr


def test_runs_refused_before_any_rank_starts(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # A tied weight whose optimizer states ZeRO-1 shards: its copies' gradients are summed after each
    # stage's reduction, which the reduce-scatter leaves scattered. And the rank count of all stages.
    model = zoo("gpt2-tiny")
    path = _plan(zoo, tmp_path, "gpt2-tiny", "dp_replicate=2,pp=2", "1f1b", zero_stage=1)
    code, err = _cli("run", str(path), "--model", str(model), "--nproc", "4")
    assert code == 2 and "model.lm_head.weight is read by pipeline stages 0, 1" in err, err
    assert len(err.strip().splitlines()) == 1
    path = _plan(zoo, tmp_path, "gpt2-tiny", "dp_replicate=2,pp=2", "1f1b")
    code, err = _cli("run", str(path), "--model", str(model), "--nproc", "2")
    assert code == 2 and "the strategy's 2 pipeline stages of mesh 2 has 4 devices; run with --nproc 4" in err, err


@pytest.mark.slow
def test_pipeline_result_broadcast(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # MindSpore's pipeline_result_broadcast: the last stage's loss broadcast to every stage after each
    # step — one broadcast per step on every stage, planned (and priced) and executed; the loss each
    # rank reports is the whole loss, equal to one process's.
    path = _plan(zoo, tmp_path, "gpt2-tiny", "dp_replicate=2,pp=2", "1f1b", pipeline_result_broadcast=True)
    assert json.loads(path.read_text())["pipeline"]["result_broadcast"] is True
    r = run(str(path), str(zoo("gpt2-tiny")), nproc=4, opts=RunOptions(steps=1, warmup=1, verify=True), timeout_s=300)
    assert r["loss_abs_diff"] < 1e-5
    for st in r["stages"]:
        assert st["collectives_planned"]["broadcast"] == 1
        assert st["collectives_executed"] == st["collectives_planned"], st


def test_each_stages_memory_is_the_measured_one(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # GPT-2 in 2 stages (1F1B): the last stage saves, for its first LayerNorm's backward, its own copy
    # of the residual stream it received (the producer's stage holds its output to its backward too),
    # one micro-batch in flight; the first stage holds two. Each stage's predicted memory is the
    # executor's measured one within 2.5% (last stage +0.5%, first −2.1%; without the received copy the
    # last is 2.4% short; with the meter's old record of a saved output, which kept the graph of
    # pipelining's shape-inference forward alive, the first stage measured 21% over).
    s, _ = make_plan(PlanRequest(model=str(zoo("gpt2-tiny")), dims={"seq": 64}, profile="cpu", devices=2, layout="pp=2",
                                 global_batch_size=16, micro_batch_size=4))
    s.save(tmp_path / "s.json")
    r = run(str(tmp_path / "s.json"), str(zoo("gpt2-tiny")), nproc=2, opts=RunOptions(steps=1, warmup=1), timeout_s=300)
    for st in r["stages"]:
        assert st["measured_memory_bytes"] == pytest.approx(st["predicted_memory_bytes"], rel=0.025), st
        # Its step, phase by phase: the chunks' forwards and backwards (timed around torch's calls), the
        # rest of the schedule (waits, sends, the loss), then the reductions and the optimizer — parts of
        # the one timed step, which also zeroes the gradients before them.
        ph = st["measured_phases_s"]
        assert tuple(ph) == PIPELINE_PHASES and ph["forward"] > 0 and ph["backward"] > 0, ph
        assert all(v >= 0 for v in ph.values()) and sum(ph.values()) <= st["measured_step_s"], (ph, st)
