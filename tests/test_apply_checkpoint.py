"""Checkpoints of a module trained under `meshplan.apply` (`executor/apply_checkpoint.py`, DCP in
`meshplan run`'s format): saved from a transformers GPT-2 under one plan after two AdamW steps, loaded
into the module under another plan, and training continued — the third step's loss and the parameters
after it equal one process that trained the same batch three times without stopping (< 1e-5). The
same checkpoint loads into `meshplan run`, and one `run` saved loads into the module with every
parameter equal to what `run` wrote (read back apart, by DCP's own converter)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core.errors import MeshplanError
from tests.test_apply import _data, _loss, _plan, applied, hf_module

LR = 1e-3
# AdamW divides a gradient by its own root mean square: one whose entries are all rounding noise moves by about
# lr whatever that noise is, so two exact runs differ there by up to lr. An eps above that noise keeps the step
# Lipschitz in the gradient (lr * g / eps), while gradients well above eps still take AdamW's normalised step.
EPS = 1e-4


def worker(rank: int, port: int, phase: str, strategy: str, zoo_json: str, ck: str, out: Any, world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import meshplan

    try:
        module = applied(rank, port, world, strategy, zoo_json)
        report = module.meshplan_report
        optim = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
        ids, labels = _data(module.config.vocab_size)
        if report.dp_axis:
            rows = slice(rank * ids.shape[0] // world, (rank + 1) * ids.shape[0] // world)
            ids, labels = ids[rows], labels[rows]

        def full(t: Any) -> Any:
            return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()

        def step() -> float:
            loss = _loss(module, ids, labels)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            if report.dp_axis:
                dist.all_reduce(total)
                total /= world
            return float(total)

        result: Any = None
        if phase == "save":
            step(), step()
            meshplan.save_checkpoint(ck, module, optim, steps=2)
        elif phase == "continue":
            before = meshplan.load_checkpoint(ck, module, optim)
            loss = step()
            result = (before, loss, {n: full(p) for n, p in module.named_parameters()})
        else:  # "read": the parameters as loaded
            meshplan.load_checkpoint(ck, module)
            result = {n: full(p) for n, p in module.named_parameters()}
        if rank == 0:
            out.put(("report", result))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from e


def _ranks(phase: str, strategy: Path, zoo_json: Path, ck: Path) -> Any:
    from executor.ranks import run_ranks

    got: list[Any] = []

    def handle(msg: tuple[Any, ...]) -> bool:
        got.append(msg[1])
        return True

    run_ranks(worker, 2, lambda r, port, q: (r, port, phase, str(strategy), str(zoo_json), str(ck), q, 2), handle,
              timeout_s=240, error=MeshplanError, what="apply")
    return got[0]


CASES = [pytest.param("zero3", "dp", marks=pytest.mark.extended),  # (`make check`: the checkpoints' tests are
         pytest.param("tp", "zero3", marks=pytest.mark.extended),   # multi-phase, a minute each on 2 cores)
         pytest.param("zero3-offload", "dp", marks=pytest.mark.extended)]  # (CPUOffloadPolicy's host states)


@pytest.mark.slow
@pytest.mark.parametrize(("a", "b"), CASES, ids=["zero3-to-dp", "tp-to-zero3", "zero3-offload-to-dp"])
def test_module_checkpoint_continues_under_another_plan(a: str, b: str, zoo: Callable[[str], Path],
                                                       tmp_path: Path) -> None:
    import torch

    zoo_json = zoo("gpt2-tiny").with_suffix(".json")
    pa, pb = _plan(zoo, tmp_path, "gpt2-tiny", a), _plan(zoo, tmp_path, "gpt2-tiny", b)
    ck = tmp_path / "ck"
    _ranks("save", pa, zoo_json, ck)
    before, loss, params = _ranks("continue", pb, zoo_json, ck)
    ref = hf_module(zoo_json)
    ids, labels = _data(ref.config.vocab_size)
    optim = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    for _ in range(3):
        ref_loss = _loss(ref, ids, labels)
        ref_loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    assert before == 2
    assert abs(loss - float(ref_loss)) < 1e-5, (loss, float(ref_loss))
    for n, p in ref.named_parameters():
        assert float(abs(params[n] - p.detach().numpy()).max()) < 1e-5, n


@pytest.mark.slow
@pytest.mark.extended
def test_module_checkpoint_loads_into_run(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    """The module's checkpoint in `meshplan run`: it loads and continues from its third step."""
    from executor.launch import run
    from executor.preflight import RunOptions

    pa, pb = _plan(zoo, tmp_path, "gpt2-tiny", "zero3"), _plan(zoo, tmp_path, "gpt2-tiny", "dp")
    ck = tmp_path / "ck"
    _ranks("save", pa, zoo("gpt2-tiny").with_suffix(".json"), ck)
    r = run(str(pb), str(zoo("gpt2-tiny")), nproc=2, opts=RunOptions(steps=1, warmup=0, load=str(ck)), timeout_s=240)
    assert r["optimizer_steps_before"] == 2, r


@pytest.mark.slow
@pytest.mark.extended
def test_run_checkpoint_loads_into_the_module(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from executor.binding import bind_parameters
    from executor.launch import run
    from executor.preflight import RunOptions
    from planner.graph import load_graph
    from planner.strategy import load_strategy

    model = zoo("gpt2-tiny")
    pa, pb = _plan(zoo, tmp_path, "gpt2-tiny", "dp"), _plan(zoo, tmp_path, "gpt2-tiny", "zero3")
    ck = tmp_path / "ck"
    run(str(pa), str(model), nproc=2, opts=RunOptions(steps=1, warmup=1, save=str(ck)), timeout_s=240)
    loaded = _ranks("read", pb, model.with_suffix(".json"), ck)
    dcp_to_torch_save(str(ck), str(tmp_path / "whole.pt"))
    written = torch.load(tmp_path / "whole.pt", weights_only=False)["model"]
    strategy = load_strategy(pb)
    bindings = bind_parameters(strategy, load_graph(model, dict(strategy.model.dims)), hf_module(model.with_suffix(".json")))
    assert len(bindings) == len(written)
    for bd in bindings:
        want = written[bd.onnx].t() if bd.transposed else written[bd.onnx]
        for fqn in bd.fqns:
            if fqn in loaded:
                assert float(abs(loaded[fqn] - want.numpy()).max()) == 0.0, fqn
