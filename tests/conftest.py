"""Shared fixtures: the exported model zoo (cached outside git) and small ONNX builders."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

ZOO_DIR = Path(os.environ.get("MESHPLAN_ZOO_DIR", Path.home() / ".cache" / "meshplan" / "zoo"))


@pytest.fixture(scope="session")
def zoo() -> Callable[[str], Path]:
    """`zoo(name)` → path of the exported zoo model (exports on first use; needs torch + transformers)."""
    from bench import zoo as zoo_mod

    def get(name: str) -> Path:
        return zoo_mod.export(name, ZOO_DIR)

    return get


@pytest.fixture(scope="session")
def zoo_meta() -> Callable[[str], dict]:
    from bench import zoo as zoo_mod

    return lambda name: zoo_mod.metadata(name, ZOO_DIR)


@pytest.fixture(autouse=True)
def _hand_layouts(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans skip the hand layouts they are checked against (`planner/search/incumbents.py`) unless the
    test is marked `hand_layouts`: planning each one again in every test would take the suite past its
    ten minutes. The marked tests (tests/test_incumbents.py, the never-worse checks) run them."""
    if request.node.get_closest_marker("hand_layouts") is None:
        monkeypatch.setenv("MESHPLAN_HAND_LAYOUTS", "0")


# Variants of multi-process tests whose ground is covered by a lighter variant of the same test that
# `make test` keeps, and a few heavy tests with none (said beside them): run by `make check` (CI runs both),
# so that `make test` stays under ten minutes on a fresh clone of this 2-core machine (834 tests took
# 9 min 40 s there on 2026-11-26; these first ten take about 165 s of the two workers' time; 975 tests
# took 14 min 51 s on 2026-11-29, and the 27 after them took 590 s of it; with the first 25 of those moved,
# 953 took 9 min 23 s on a fresh clone alone on the machine, so two more went, and the new pp × ep run).
EXTENDED = {
    "tests/test_training_step.py::test_recomputed_step_equals_one_process[llama-tiny-zero2-k2-2x2]",
    "tests/test_training_step.py::test_fsdp_and_layouts_equal_one_process[llama-tiny-dp_replicate=2,dp_shard=2-zero1-recompute-none]",
    "tests/test_training_step.py::test_accumulated_step_equals_the_whole_batch_at_once[llama-tiny-k2-2x2]",
    "tests/test_executor.py::test_several_steps_match[dp-tp-2x2]",
    "tests/test_checkpoint.py::test_checkpoint_resharded_continues_as_one_process[zero1-4-to-dp2]",
    "tests/test_checkpoint.py::test_checkpoint_resharded_continues_as_one_process[dp2-to-tp2]",
    "tests/test_pipeline_run.py::test_pipelined_run_equals_one_process[llama-tiny-4l-pp=4-1f1b]",
    "tests/test_pipeline_run.py::test_pipelined_run_equals_one_process[llama-tiny-dp_replicate=2,pp=2-1f1b]",
    "tests/test_zero.py::test_zero_shard_group_runs_as_planned[2]",
    "tests/test_zero.py::test_zero_over_two_axes_runs_as_planned[2]",
    # 2026-11-29 (durations of that run, seconds):
    "tests/test_groups.py::test_group_file_lists_the_groups_the_executor_creates",  # 8 ranks, 40; none lighter
    "tests/test_amp_run.py::test_amp_plan_trains_in_bf16_as_one_process_does[dp]",  # 40 (tp and mixed kept)
    "tests/test_amp_run.py::test_amp_plan_trains_in_bf16_as_one_process_does[fsdp]",  # 22
    "tests/test_expert_parallel.py::test_expert_parallel_run_equals_one_process[deepseek-v3-tiny-dp_shard=4,ep=4]",  # 28
    "tests/test_pipeline_run.py::test_pipelined_run_equals_one_process[gpt2-tiny-4l-pp=4-gpipe]",  # 27
    "tests/test_pipeline_run.py::test_pipelined_run_equals_one_process[gpt2-tiny-4l-dp_replicate=2,pp=2,vpp=2-interleaved]",
    "tests/test_training_step.py::test_zero_step_equals_one_process[llama-tiny-zero2-k2-2x2-sgd]",  # 24
    "tests/test_training_step.py::test_accumulated_step_equals_the_whole_batch_at_once[gpt2-tiny-k4-2]",  # 10
    "tests/test_checkpoint.py::test_checkpoint_resharded_continues_as_one_process[dp2-to-pp2]",  # 22; none lighter
    "tests/test_checkpoint.py::test_checkpoint_resharded_continues_as_one_process[tp2-to-zero3]",  # 20 (test_static_export
    # loads a checkpoint under tensor parallelism; zero1-2-to-zero1-4 keeps another world size)
    "tests/test_context_parallel.py::test_context_parallel_run_equals_one_process[dp_shard=2,cp=2-ring]",  # 20
    "tests/test_executor.py::test_distributed_equals_one_process[convnet-data-parallel-2]",  # 19
    "tests/test_executor.py::test_distributed_equals_one_process[bert-tiny-data-parallel-2]",  # 10
    "tests/test_executor.py::test_distributed_equals_one_process[mlp-data-parallel-2]",  # 8
    "tests/test_executor.py::test_distributed_equals_one_process[vit-tiny-data-parallel-2]",  # 7
    "tests/test_apply.py::test_apply_equals_one_process[gpt2-tiny-hsdp]",  # 12 (llama-tiny-hsdp kept)
    "tests/test_apply.py::test_apply_equals_one_process[llama-tiny-dp]",  # 7
    "tests/test_exporters.py::test_default_export_runs_distributed_equal_to_one_process[llama-tiny]",  # 15
    "tests/test_incumbents.py::test_ddp_and_fsdp_bound_the_pipelined_search",  # 26 (two whole searches)
    # (up to 10 s each where its worker has not exported llama-tiny that way yet; the default export's stays)
    "tests/test_exporters.py::test_keys_and_values_gathered_before_their_repeat_on_every_export[no-optimize]",
    "tests/test_exporters.py::test_keys_and_values_gathered_before_their_repeat_on_every_export[meshplan-export]",
    "tests/test_exporters.py::test_keys_and_values_gathered_before_their_repeat_on_every_export[no-metadata]",
    "tests/test_exporters.py::test_default_export_runs_distributed_equal_to_one_process[bert-tiny]",  # 10
    "tests/test_switches.py::test_gradient_accumulation_shard_runs_as_planned[off-1-1]",  # 13
    "tests/test_export.py::test_repeated_layers_keep_the_first_layers_built_otherwise",  # 39, one process; none lighter
    "tests/test_gpu_pricing.py::test_h100_steps_from_the_microbenchmarks_alone",  # 45 (14 plans; whole steps below)
    "tests/test_gpu_profile.py::test_vocab_alignment_in_a_whole_step[gpt2-50257-h100-sxm-calibrated]",  # 9
    "tests/test_gpu_profile.py::test_vocab_alignment_in_a_whole_step[gpt2-50257-micro.json]",  # 6
    "tests/test_gpu_profile.py::test_vocab_alignment_in_a_whole_step[llama2-32001-micro.json]",  # 11
    "tests/test_executor.py::test_distributed_equals_one_process[llama-tiny-data-parallel-2]",  # 8
    "tests/test_training_step.py::test_zero_step_equals_one_process[mlp-zero2-k4-2-sgd]",  # 7
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    found = set()
    for item in items:
        if item.nodeid in EXTENDED:
            item.add_marker(pytest.mark.extended)
            found.add(item.nodeid)
    # Every name above must still name a test where its function was collected (a renamed variant
    # would silently join make test again).
    functions = {item.nodeid.split("[")[0] for item in items}
    missing = sorted(n for n in EXTENDED - found if n.split("[")[0] in functions)
    if missing:
        raise pytest.UsageError(f"tests/conftest.py EXTENDED names no collected test: {missing}")
