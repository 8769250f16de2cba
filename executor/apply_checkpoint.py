"""Checkpoints of a module trained under `meshplan.apply`, in `meshplan run`'s format
(`executor/checkpoint.py`): each parameter and its AdamW states under the strategy's (the exported
graph's) name, as a DTensor where the module holds one (fully_shard, tensor parallelism, FSDP2's
replicate) or a plain tensor where it is whole (DDP's reducer, one device), a weight the exporter transposed saved transposed back to the graph's
layout. So a checkpoint saved from the module under one plan loads into the module under another, and
into `meshplan run`, and one `run` saved loads into the module: DCP reads each rank's shards from
whatever shards were written.

    meshplan.save_checkpoint("ck", model, optim, steps=100)   # every rank, after an optimizer step
    steps = meshplan.load_checkpoint("ck", model, optim)      # every rank, before the first step
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from executor.checkpoint import ADAM_STATES, check_model, write_meta, zero_states


def _report(module: nn.Module) -> Any:
    from executor.binding import ApplyError

    report = getattr(module, "meshplan_report", None)
    if report is None or report.strategy is None:
        raise ApplyError("checkpoints of a module: apply the plan first (meshplan.apply(module, strategy))")
    return report


def _parameters(module: nn.Module, report: Any) -> dict[str, nn.Parameter]:
    """The parameters this rank trains, by the module's names (a pipelined plan's: its chunks')."""
    if report.pipeline is not None:
        return {n: p for c in report.pipeline.chunks for n, p in c.named_parameters(remove_duplicate=False)}
    return dict(module.named_parameters(remove_duplicate=False))


def _state(module: nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, Any]:
    report = _report(module)
    params = _parameters(module, report)
    model: dict[str, Any] = {}
    states: dict[str, Any] = {}
    for b in report.bindings:
        fqn = next((f for f in b.fqns if f in params), None)
        if fqn is None:  # on another pipeline stage
            continue
        p = params[fqn]

        def graph_layout(t: torch.Tensor, transposed: bool = b.transposed) -> torch.Tensor:
            return t.t() if transposed else t

        model[b.onnx] = graph_layout(p.detach())
        if optim is not None:
            st = optim.state[p]
            states[b.onnx] = {**{k: graph_layout(st[k]) for k in ADAM_STATES}, "step": st["step"]}
    return {"model": model, **({"optim": states} if optim is not None else {})}


def save_checkpoint(path: str | Path, module: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    """Every rank: the module's parameters and `optim`'s AdamW states, after `steps` optimizer steps."""
    from executor.checkpoint import CheckpointError

    if not isinstance(optim, torch.optim.AdamW):
        raise CheckpointError("save_checkpoint: checkpoints hold AdamW's states; train with torch.optim.AdamW")
    dcp.save(_state(module, optim), checkpoint_id=str(path))
    write_meta(path, _report(module).strategy, steps)


def load_checkpoint(path: str | Path, module: nn.Module, optim: torch.optim.Optimizer | None = None) -> int:
    """Every rank: the module's parameters (and `optim`'s AdamW states) from a checkpoint of this model
    saved under any plan; returns the optimizer steps it had had."""
    from executor.checkpoint import CheckpointError

    report = _report(module)
    meta = check_model(path, report.strategy)
    if optim is not None:
        if not isinstance(optim, torch.optim.AdamW):
            raise CheckpointError("load_checkpoint: checkpoints hold AdamW's states; train with torch.optim.AdamW")
        zero_states(optim, [p for g in optim.param_groups for p in g["params"]])
    with torch.no_grad():
        dcp.load(_state(module, optim), checkpoint_id=str(path))
    steps: int = meta["optimizer_steps"]
    return steps
