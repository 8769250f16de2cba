"""Sharded checkpoints with torch.distributed.checkpoint: saved under one plan, loaded under another.

Every parameter, and AdamW's states of it (exp_avg, exp_avg_sq, step), is saved as a DTensor with the
placements the plan stores it at: each rank writes its own shards, DCP the metadata of how they tile
the whole tensor. Loading builds the same state dict with the *new* plan's placements and lets DCP
read each rank's shard of it from whatever shards were written — another mesh, another tensor-parallel
degree, ZeRO-3 or not — a parameter at a time, never a whole model on one rank. Beside DCP's files,
`meshplan.json` says what was saved: the model's fingerprint, the plan's mesh and layout, and how many
optimizer steps the parameters have had.

A pipeline stage's ranks save and load their stage's parameters (a tied weight's copies are the same
tensor: DCP writes it once). Not yet: plans whose optimizer steps fused ZeRO-1/2 buckets (their states
are per bucket shard), refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from executor.spmd import SpmdRunner, contiguous_stride
from planner.errors import MeshplanError
from planner.strategy import Strategy

META = "meshplan.json"
ADAM_STATES = ("exp_avg", "exp_avg_sq")


class CheckpointError(MeshplanError):
    """A checkpoint that cannot be written or does not match the model or plan."""


def check_plan(strategy: Strategy) -> None:
    """Refuse, before any rank starts, a plan whose checkpoints are not written yet."""
    tr = strategy.training
    zero = set((tr.zero_stages or {}).values()) if tr.zero_stages is not None else {tr.zero_stage % 3}
    if zero & {1, 2}:
        raise CheckpointError("--save/--load: plans with ZeRO-1/2 (optimizer states per fused bucket shard) are not "
                              "checkpointed yet; plan with --zero 0 or --zero 3")


def read_meta(path: str | Path) -> dict[str, Any]:
    p = Path(path) / META
    if not p.is_file():
        raise CheckpointError(f"{path}: no meshplan checkpoint there ({META} missing); write one with run --save")
    meta: dict[str, Any] = json.loads(p.read_text())
    return meta


def inspect(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds: meshplan's record of it, and per saved tensor its shape and the shards
    it was written in (DCP's metadata; nothing is loaded)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = read_meta(path)
    md = FileSystemReader(str(path)).read_metadata()
    tensors = {k: {"shape": list(v.size), "shards": len(v.chunks)} for k, v in sorted(md.state_dict_metadata.items())
               if isinstance(v, TensorStorageMetadata)}
    return {**meta, "tensors": tensors}


def _params(strategy: Strategy) -> dict[str, list[int]]:
    return {t: list(v.shape) for t, v in sorted(strategy.tensors.items()) if v.kind == "param"}


def check_model(path: str | Path, strategy: Strategy) -> dict[str, Any]:
    """The checkpoint's parameters are the plan's, name for name and shape for shape (the batch the
    model was bound at may differ: a pipeline's micro-batch, another global batch)."""
    meta = read_meta(path)
    saved, here = meta.get("parameter_shapes", {}), _params(strategy)
    for name in sorted(set(saved) | set(here)):
        if saved.get(name) != here.get(name):
            what = "not in it" if name not in saved else "not in this model" if name not in here else \
                f"{saved[name]} there, {here[name]} here"
            raise CheckpointError(f"{path} was saved for model {meta['model_name']}, whose parameters differ: {name} "
                                  f"({what}); load it with the model it was saved for")
    return meta


def _dtensor(runner: SpmdRunner, name: str, local: torch.Tensor) -> DTensor:
    shape = runner.graph.tensors[name].shape
    return DTensor.from_local(local, runner.mesh, runner.stored[name], shape=torch.Size(shape),
                              stride=contiguous_stride(shape), run_check=False)


def _state(runner: SpmdRunner, optim: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The state dict over this rank's shards (views: loading writes into the live tensors)."""
    params = runner._params
    out: dict[str, Any] = {"model": {n: _dtensor(runner, n, p.detach()) for n, p in params.items()}}
    if optim is not None:
        out["optim"] = {n: {**{k: _dtensor(runner, n, optim.state[p][k]) for k in ADAM_STATES},
                            "step": optim.state[p]["step"]} for n, p in params.items()}
    return out


def init_optimizer_state(runner: SpmdRunner, optim: torch.optim.Optimizer) -> None:
    """AdamW's states, zero, for every parameter (torch creates them at the first step; loading needs
    them to exist)."""
    for p in runner._params.values():
        if not optim.state[p]:
            optim.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                              **{k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in ADAM_STATES}}


def save(path: str | Path, runner: SpmdRunner, optim: torch.optim.Optimizer, strategy: Strategy, steps: int) -> None:
    if not isinstance(optim, torch.optim.AdamW):
        raise CheckpointError("--save: checkpoints hold AdamW's states; run with --optimizer adamw")
    dcp.save(_state(runner, optim), checkpoint_id=str(path))
    if dist.get_rank() == 0:
        (Path(path) / META).write_text(json.dumps({
            "model_name": strategy.model.name, "model_fingerprint": strategy.model.fingerprint,
            "mesh": list(strategy.mesh.shape), "axis_names": list(strategy.mesh.axis_names),
            "layout": strategy.training.layout, "optimizer_steps": steps,
            "pipeline_stages": len(strategy.pipeline.stages) if strategy.pipeline is not None else 1,
            "parameters": sorted(_params(strategy)), "parameter_shapes": _params(strategy)}, indent=1) + "\n")
    dist.barrier()


def load_model(path: str | Path, runner: SpmdRunner) -> None:
    """This rank's shards of every parameter, from whatever shards the checkpoint holds."""
    state = _state(runner, None)
    missing = sorted(set(state["model"]) - set(read_meta(path)["parameters"]))
    if missing:
        raise CheckpointError(f"{path} holds no parameter {missing[0]}; it was saved for another model")
    with torch.no_grad():
        dcp.load(state, checkpoint_id=str(path))


def load_optimizer(path: str | Path, runner: SpmdRunner, optim: torch.optim.Optimizer) -> None:
    if not isinstance(optim, torch.optim.AdamW):
        raise CheckpointError("--load: checkpoints hold AdamW's states; run with --optimizer adamw")
    init_optimizer_state(runner, optim)
    state = _state(runner, optim)
    del state["model"]
    with torch.no_grad():
        dcp.load(state, checkpoint_id=str(path))
