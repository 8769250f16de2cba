"""How each rank reads its inputs (`--dataset-strategy`, MindSpore's dataset_strategy): full_batch's
rows beyond each rank's share priced over the host link; per-input splits placing the inputs; each run
equal to one process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from core.errors import MeshplanError
from hwprofiles.files import load_profile
from planner.search.plan import make_plan
from planner.search.request import PlanRequest
from tests.test_training_step import run_equals_one_process


def test_full_batch_prices_the_rows_beyond_each_share(zoo: Callable[[str], Path]) -> None:
    """gpt2-tiny data-parallel on 2 ranks, 4 micro-steps of 4 × 32 int64 ids: under full_batch each rank
    loads a micro-step's 4 rows where its share is 2 — 2 × 32 × 8 bytes more, 4 times a step, at the
    host's copy rate, all waited for (the serial step) — and the plan is otherwise the data-parallel one."""
    base = dict(model=str(zoo("gpt2-tiny")), dims={"seq": 32}, profile="cpu", devices=2, global_batch_size=16,
                accumulation_steps=4, mode="data-parallel", zero_stage=0)
    dp, _ = make_plan(PlanRequest(**base))
    full, _ = make_plan(PlanRequest(**base, dataset_strategy="full_batch"))
    host = load_profile("cpu").host
    assert host is not None
    extra = 4 * (2 * 32 * 8)
    assert full.cost.host_copy_bytes == extra and dp.cost.host_copy_bytes == 0
    assert full.cost.host_s == pytest.approx(extra / host.copy_bandwidth_bytes_per_s, rel=1e-12)
    assert full.cost.step_time_s - dp.cost.step_time_s == pytest.approx(full.cost.host_s, rel=1e-9)
    assert full.training.dataset_strategy == "full_batch"


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["full_batch", "((2, 1),)"])
def test_dataset_strategy_runs_equal_to_one_process(dataset: str, zoo: Callable[[str], Path], tmp_path: Path) -> None:
    """The same run under full_batch, and with the ids split 2 ways on the batch by the dataset (the plan
    left to the ILP around that placement): equal to one process with the planned collectives; the split
    input is placed as the dataset splits it."""
    model = zoo("gpt2-tiny")
    mode = {"mode": "data-parallel"} if dataset == "full_batch" else {}
    s, _ = make_plan(PlanRequest(model=str(model), dims={"batch": 8, "seq": 32}, profile="cpu", devices=2,
                                 dataset_strategy=dataset, **mode))
    if dataset != "full_batch":
        assert str(s.tensors["ids"].spec) == "S(0)"
    run_equals_one_process(s, model, tmp_path)


@pytest.mark.parametrize(("dataset", "want"), [
    ("((3, 1),)", "splits dim 0 of input ids (8) 3 ways, which does not divide it"),
    ("((2, 1), (2, 1))", "gives 2 input splits; gpt2-tiny has 1 inputs"),
    ("((2,),)", "it has 2 dims"),
    ("((4, 1),)", "no mesh axes of mesh [2] left multiply to 4"),
    ("rows", "give data_parallel, full_batch, or one tuple of positive split counts per input")])
def test_dataset_strategy_refusals(dataset: str, want: str, zoo: Callable[[str], Path]) -> None:
    with pytest.raises(MeshplanError, match=want.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        make_plan(PlanRequest(model=str(zoo("gpt2-tiny")), dims={"batch": 8, "seq": 32}, profile="cpu", devices=2,
                              mesh_shape=(2,), dataset_strategy=dataset))
