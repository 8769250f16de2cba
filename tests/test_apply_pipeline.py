"""`meshplan.apply` of a pipelined plan on the user's own module: a transformers GPT-2 / Llama split at
the plan's stage boundaries by torch.distributed.pipelining's tracer and run under the plan's schedule
on gloo ranks (`executor/apply_pp.py`).

The check is independent of meshplan's executor: one process trains the same transformers module on
the whole batch (plain eager torch), and the pipelined loss, every parameter's gradient (each rank's
chunks, gathered whole) and every parameter after one SGD step must equal it (< 1e-5).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core.errors import MeshplanError
from tests.test_apply import _data, _loss, applied, hf_module

B, S = 8, 32


def worker(rank: int, port: int, strategy: str, zoo_json: str, out: Any, world: int, dp: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    try:
        module = applied(rank, port, world, strategy, zoo_json)
        report = module.meshplan_report
        run = report.pipeline
        ids, labels = _data(module.config.vocab_size)
        place = rank % dp
        rows = slice(place * B // dp, (place + 1) * B // dp)  # this rank's data-parallel rows
        optim = torch.optim.SGD(run.parameters(), lr=0.1)
        loss = run.step(ids[rows], target=labels[rows])
        total = loss.clone()
        dist.all_reduce(total)  # every rank holds its replica's loss: the mean over them
        total /= world

        def full(t: Any) -> Any:
            return t.full_tensor() if isinstance(t, DTensor) else t

        grads = {n: full(p.grad).detach().numpy().copy() for c in run.chunks for n, p in c.named_parameters()
                 if p.grad is not None}
        optim.step()
        params = {n: full(p).detach().numpy().copy() for c in run.chunks for n, p in c.named_parameters()}
        out.put(("report", rank, float(total), grads, params, report.lines()))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from e


CASES = {  # name: (model, layout, schedule, ranks, data-parallel degree, ZeRO stage)
    "llama-pp2-dp2-1f1b": ("llama-tiny", "pp=2,dp_shard=2", "1f1b", 4, 2, 0),
    "gpt2-pp2-dp2-1f1b-zero3": ("gpt2-tiny", "pp=2,dp_shard=2", "1f1b", 4, 2, 3),  # tied copies, sharded
    "llama-pp2-ddp2-1f1b": ("llama-tiny", "pp=2,dp_replicate=2", "1f1b", 4, 2, 0),  # DDP: FSDP2's replicate
    "llama-pp2-interleaved": ("llama-tiny-4l", "pp=2,vpp=2", "interleaved", 2, 1, 0),
    "gpt2-pp2-interleaved": ("gpt2-tiny-4l", "pp=2,vpp=2", "interleaved", 2, 1, 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.extended)
                                  if c.endswith("interleaved") or "ddp" in c else c
                                  for c in sorted(CASES)])  # (interleaved and DDP's: `make check`)
def test_pipelined_apply_equals_one_process(case: str, zoo: Callable[[str], Path], tmp_path: Path) -> None:
    import torch

    from executor.ranks import run_ranks
    from planner.search.plan import make_plan
    from planner.search.request import PlanRequest

    name, layout, schedule, world, dp, zero = CASES[case]
    s, _ = make_plan(PlanRequest(model=str(zoo(name)), dims={"seq": S}, profile="cpu", devices=world, layout=layout,
                                 global_batch_size=B, micro_batch_size=B // dp // 2, schedule=schedule,  # type: ignore[arg-type]
                                 zero_stage=zero))
    assert s.pipeline is not None and s.training.micro_batches == 2 and s.training.zero_stage == zero
    path = tmp_path / "s.json"
    s.save(path)
    zoo_json = zoo(name).with_suffix(".json")
    got: list[tuple[Any, ...]] = []

    def handle(msg: tuple[Any, ...]) -> bool:
        got.append(msg)
        return len(got) == world

    run_ranks(worker, world, lambda r, port, q: (r, port, str(path), str(zoo_json), q, world, dp), handle,
              timeout_s=240, error=MeshplanError, what="apply")
    ref = hf_module(zoo_json)
    ids, labels = _data(ref.config.vocab_size)
    ref_loss = _loss(ref, ids, labels)
    ref_loss.backward()
    ref_grads = {n: p.grad.numpy().copy() for n, p in ref.named_parameters(remove_duplicate=False)}
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    ref_params = {n: p.detach().numpy() for n, p in ref.named_parameters(remove_duplicate=False)}
    seen: set[str] = set()
    for _, rank, loss, grads, params, lines in got:
        assert abs(loss - float(ref_loss)) < 1e-5, (rank, loss, float(ref_loss))
        for n, g in grads.items():
            assert float(abs(g - ref_grads[n]).max()) < 1e-5, (rank, n)
        for n, q in params.items():
            assert float(abs(q - ref_params[n]).max()) < 1e-5, (rank, n)
        seen |= set(params)
        assert not [ln for ln in lines if ln.startswith("fallback")], lines
        assert [ln for ln in lines if ln.startswith("pipeline: 2 stages, ")], lines
        # dp_shard: parameters sharded; dp_replicate: whole, under FSDP2's replicate (the stage holds its
        # gradient sync to the last micro-batch, as fully_shard's)
        said = "replicate over dp_replicate" if "dp_replicate" in layout else "fully_shard over dp_shard"
        assert (f"data parallel: {said}" in lines) == (dp > 1), lines
    assert seen == set(ref_params)  # every parameter is on some stage


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("model,layout", [("llama", ("pp=2,dp_shard=2", "--micro-batch-size", "4")),
                                          ("llama", ("dp_shard=2,tp=2",)), ("gpt2", ("dp_shard=2,tp=2",))],
                         ids=["llama-pp2-dp2", "llama-dp2-tp2", "gpt2-dp2-tp2"])
def test_example_on_four_ranks_equals_one_rank(model: str, layout: tuple[str, ...], tmp_path: Path) -> None:
    """examples/train_hf.py as a user runs it: `--layout pp=2,dp_shard=2` (a pipeline of data-parallel
    stages) and `--layout dp_shard=2,tp=2` (fully_shard over tensor parallelism) on 4 ranks, against the
    same script on 1 rank — the first steps' losses (AdamW between them) equal to 1e-5, nothing falling back."""
    four = example_losses(tmp_path, "train_hf.py", 4, "--model", model, "--layout", *layout)
    one = example_losses(tmp_path, "train_hf.py", 1, "--model", model)
    assert len(one) == len(four) == 3
    assert max(abs(a - b) for a, b in zip(four, one, strict=True)) < 1e-5, (four, one)


def test_a_stage_boundary_inside_a_layer_is_refused(zoo: Callable[[str], Path]) -> None:
    """A pipelined strategy whose second chunk starts inside a layer (its second node): apply cannot split
    a module there; one line naming the node and the layer, before any rank builds a stage."""
    import dataclasses

    from executor.apply_layers import layer_module, module_keys
    from executor.apply_pp import split_points
    from executor.binding import ApplyError
    from planner.graph import load_graph
    from planner.search.plan import make_plan
    from planner.search.request import PlanRequest

    s, _ = make_plan(PlanRequest(model=str(zoo("llama-tiny")), dims={"seq": S}, profile="cpu", devices=2, layout="pp=2",
                                 global_batch_size=B, micro_batch_size=2))
    assert s.pipeline is not None
    graph = load_graph(zoo("llama-tiny"), dict(s.model.dims))
    module = hf_module(zoo("llama-tiny").with_suffix(".json"))
    keys = module_keys(module)

    def find(path: str) -> str | None:
        found = layer_module(path, module, keys)
        return found[0] if found else None

    assert split_points(s, graph, module, find) == ["model.layers.1"]  # the plan's cut: between the two layers
    stage = s.pipeline.stages[1]
    (first, last), = stage.chunks
    order = [n.name for n in graph.compute_nodes]
    inside = order[order.index(first) + 1]
    moved = dataclasses.replace(s, pipeline=dataclasses.replace(s.pipeline, stages=(
        s.pipeline.stages[0], dataclasses.replace(stage, first_node=inside, chunks=((inside, last),)))))
    with pytest.raises(ApplyError, match=rf"^pipeline chunk 1 starts at node {inside}, inside layer model\.model\.layers\.1 "
                                         rf"\(its first node is {first}\); apply splits the module only between") as e:
        split_points(moved, graph, module, find)
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("layout", ["dp_shard=2", "pp=2,dp_shard=2"])
def test_plain_llama_example_equals_one_rank(layout: str, tmp_path: Path) -> None:
    """examples/train_llama.py: a plain-PyTorch Llama (no transformers) exported, planned and applied,
    FSDP on 2 ranks and a pipeline × FSDP on 4, against the same script on 1 rank (losses to 1e-5)."""
    ranks = 4 if "pp=" in layout else 2
    applied = example_losses(tmp_path, "train_llama.py", ranks, "--batch", "16", "--layout", layout,
                             *(["--micro-batch-size", "4"] if "pp=" in layout else []))
    one = example_losses(tmp_path, "train_llama.py", 1, "--batch", "16")
    assert len(one) == len(applied) == 3
    assert max(abs(a - b) for a, b in zip(applied, one, strict=True)) < 1e-5, (applied, one)


def example_losses(tmp_path: Path, script: str, n: int, *args: str) -> list[float]:
    """`torchrun --nproc-per-node n examples/SCRIPT ARGS`: its steps' printed losses (no fallback allowed)."""
    import re
    import subprocess
    import sys

    path = Path(__file__).resolve().parents[1] / "examples" / script
    torchrun = Path(sys.executable).parent / "torchrun"
    r = subprocess.run([str(torchrun), "--nproc-per-node", str(n), str(path), "--steps", "3",
                        "--workdir", str(tmp_path / f"w{n}"), *args], capture_output=True, text=True, timeout=400,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not re.search(r"^apply: fallback", r.stdout, re.M), r.stdout
    return [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)", r.stdout, re.M)]
