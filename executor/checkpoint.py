"""Sharded checkpoints with torch.distributed.checkpoint: saved under one plan, loaded under another.

Every parameter, and AdamW's states of it (exp_avg, exp_avg_sq, step), is saved as a DTensor with the
placements the plan stores it at: each rank writes its own shards, DCP the metadata of how they tile
the whole tensor. Loading builds the same state dict with the *new* plan's placements and lets DCP
read each rank's shard of it from whatever shards were written — another mesh, another tensor-parallel
degree, ZeRO-3 or not — a parameter at a time, never a whole model on one rank. Beside DCP's files,
`meshplan.json` says what was saved: the model's fingerprint, the plan's mesh and layout, and how many
optimizer steps the parameters have had.

A pipeline stage's ranks save and load their stage's parameters (a tied weight's copies are the same
tensor: DCP writes it once).

ZeRO-1/2 fuse a bucket's parameters into one flat buffer and step each rank's contiguous shard of it
(the seed's tensor fusion): a rank's optimizer states cover a flat range that starts and ends inside
parameters, unevenly. Each parameter's part of that range is saved as the hyper-rectangles of the
parameter it tiles (a partial row, whole rows, a partial row; `flat_boxes`), each with its offsets —
a `ShardedTensor` of the parameter's own shape with this rank's pieces (views of the live states).
The parameter's states are then one tensor in the checkpoint whatever wrote them, and load into
another world size, another bucket layout, or a plan without ZeRO, by DCP's overlap of chunks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from core.errors import MeshplanError
from core.graph import Fold, TensorKind
from executor.spmd import SpmdRunner, contiguous_stride
from planner.strategy import Strategy

META = "meshplan.json"
ADAM_STATES = ("exp_avg", "exp_avg_sq")
Stepped = Mapping[int, torch.Tensor] | None  # a parameter's id → the tensor the optimizer steps for it


def _stepped(stepped: Stepped, p: torch.Tensor) -> torch.Tensor:
    """The tensor the optimizer steps for `p`: its host copy where `stepped` names one, else itself."""
    return stepped.get(id(p), p) if stepped else p


class CheckpointError(MeshplanError):
    """A checkpoint that cannot be written or does not match the model or plan."""


def check_plan(strategy: Strategy) -> None:
    """Refuse, before any rank starts, a plan whose checkpoints are not written yet."""
    tr = strategy.training
    zero = set((tr.zero_stages or {}).values()) if tr.zero_stages is not None else {tr.zero_stage % 3}
    if zero & {1, 2} and tr.zero_shard_size is not None:
        raise CheckpointError("`save`/`load`: ZeRO-1/2 with a shard group smaller than the data-parallel group "
                              "(optimizer_weight_shard_size) keeps copies of each shard; checkpoint it without "
                              "`zero_shard_size`")


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flat (row-major) range [lo, hi) of a tensor of `shape` as hyper-rectangles, in order, each
    (offsets, sizes) and each a contiguous part of the range: the rest of a partial first row, whole
    rows, the start of a partial last row (a row being the sub-tensor at one index of dim 0)."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))]
    inner = 1
    for d in shape[1:]:
        inner *= d

    def in_row(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row, *o), (1, *z)) for o, z in flat_boxes(shape[1:], a, b)]

    first, last = lo // inner, (hi - 1) // inner  # the rows the range touches
    if first == last:
        return in_row(first, lo - first * inner, hi - first * inner)
    out = []
    if lo % inner:
        out += in_row(first, lo % inner, inner)
        first += 1
    whole_to = last + 1 if hi % inner == 0 else last
    if whole_to > first:
        out.append(((first, *(0,) * (len(shape) - 1)), (whole_to - first, *shape[1:])))
    if hi % inner:
        out += in_row(last, 0, hi % inner)
    return out


# Pieces a saved tensor is written in, at most: a load reads (and deserialises: twice its size) one
# saved piece at a time, whatever the tensor, so a load holds about this much beyond the live shards,
# not a whole parameter (GPT-2's 50257 × 768 embedding is 147 MiB).
PIECE_BYTES = 16 << 20


class Pieces:
    """A tensor of `shape` as this rank's boxes of it, each (offsets, a view of live data): what DCP
    writes and reads through the protocol DTensor implements (`__create_write_items__`,
    `__get_tensor_shard__`; DCP's planner finds tensors by type, hence `_save_planner`). A box the
    same on several ranks (a replicated tensor's) is written once: DCP deduplicates writes by offsets."""

    def __init__(self, shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        self.shape = torch.Size(shape)
        self.boxes = {torch.Size(o): t for o, t in boxes}

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=o, sizes=t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for o, t in self.boxes.items()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self.boxes[torch.Size(index.offset)]


def _save_planner() -> Any:
    """DCP's default save planner, finding a `Pieces` box by its offsets (its lookup takes tensors only)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class PiecesSavePlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            obj = self.state_dict.get(index.fqn)
            return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else super().lookup_object(index)

    return PiecesSavePlanner()


def _rows(offsets: tuple[int, ...], t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """A box split along its first dim into pieces of at most PIECE_BYTES (views; a row is never split)."""
    if t.dim() == 0 or t.numel() * t.element_size() <= PIECE_BYTES:
        return [(offsets, t)]
    per = max(1, PIECE_BYTES // max(1, (t.numel() // t.shape[0]) * t.element_size()))
    return [((offsets[0] + a, *offsets[1:]), t[a:a + per]) for a in range(0, t.shape[0], per)]


def _local(runner: SpmdRunner, name: str, local: torch.Tensor) -> Pieces:
    """A parameter-shaped tensor's local shard at the plan's placements, in pieces, for saving."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(runner.graph.tensors[name].shape)
    _, offsets = compute_local_shape_and_global_offset(shape, runner.mesh, runner.stored[name])
    return Pieces(shape, _rows(tuple(offsets), local))


def _fused(runner: SpmdRunner, name: str, flat_state: torch.Tensor, *, saving: bool) -> Any:
    """A fused ZeRO parameter's state on this rank: its part of the shard's flat state, as the boxes of
    the parameter it covers (views, so loading fills the live state). Saved as `Pieces`; loaded into a
    ShardedTensor of those boxes (DCP's own uneven shards: no two ranks' ZeRO shards overlap)."""
    bucket = next(b for b in runner.zero_buckets if name in b.names)
    shape = tuple(runner.graph.tensors[name].shape)
    numel = math.prod(shape)
    start, end = bucket.start, bucket.start + bucket.shard.numel()
    begin = bucket.offsets[name]
    lo, hi = max(begin, start), min(begin + numel, end)
    boxes: list[tuple[tuple[int, ...], torch.Tensor]] = []
    at = lo - start
    for offsets, sizes in flat_boxes(shape, lo - begin, hi - begin):
        n = math.prod(sizes)
        box = flat_state[at:at + n].view(sizes)
        boxes += _rows(offsets, box) if saving else [(offsets, box)]
        at += n
    if saving:
        return Pieces(shape, boxes)
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    device = flat_state.device
    where = f"rank:{dist.get_rank()}/{device}"
    return init_from_local_shards([Shard(t, ShardMetadata(list(o), list(t.shape), where)) for o, t in boxes], *shape)


def read_meta(path: str | Path) -> dict[str, Any]:
    p = Path(path) / META
    if not p.is_file():
        raise CheckpointError(f"{path}: no meshplan checkpoint there ({META} missing); write one with run `save`")
    meta: dict[str, Any] = json.loads(p.read_text())
    return meta


def check_files(path: str | Path) -> Any:
    """DCP's metadata, and every file it names holding the bytes it says: a checkpoint whose save did
    not finish (no `.metadata`), or whose files were cut short or lost, is refused before any rank
    reads it. Returns the metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # missing, truncated or not DCP's: pickle, EOF and OS errors alike
        raise CheckpointError(f"{path}: DCP's .metadata is missing or unreadable ({type(e).__name__}): the save did "
                              "not finish; save the checkpoint again") from e
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = Path(path) / name
        have = f.stat().st_size if f.is_file() else -1
        if have < size:
            what = "is missing" if have < 0 else f"holds {have} bytes of the {size} its metadata names"
            raise CheckpointError(f"{path}: {name} {what}: the checkpoint is truncated; save it again")
    return md


def inspect(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds: meshplan's record of it, and per saved tensor its shape and the shards
    it was written in (DCP's metadata; nothing is loaded)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = read_meta(path)
    md = check_files(path)
    tensors = {k: {"shape": list(v.size), "shards": len(v.chunks)} for k, v in sorted(md.state_dict_metadata.items())
               if isinstance(v, TensorStorageMetadata)}
    return {**meta, "tensors": tensors}


def _params(strategy: Strategy) -> dict[str, list[int]]:
    return {t: list(v.shape) for t, v in sorted(strategy.tensors.items()) if v.kind is TensorKind.PARAM}


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
    check_files(path)
    return meta


def _dtensor(runner: SpmdRunner, name: str, local: torch.Tensor) -> DTensor:
    shape = runner.graph.tensors[name].shape
    return DTensor.from_local(local, runner.mesh, runner.stored[name], shape=torch.Size(shape),
                              stride=contiguous_stride(shape), run_check=False)


def _state(runner: SpmdRunner, optim: torch.optim.Optimizer | None, *, saving: bool = False,
           stepped: Stepped = None, moved: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict[str, Any]:
    """The state dict over this rank's shards (views: loading writes into the live tensors): saved in
    pieces of at most PIECE_BYTES, loaded into DTensors at the plan's placements (a fused ZeRO
    parameter's states: into the pieces of them this rank's shard holds). `stepped`: where the
    optimizer steps a parameter (or ZeRO shard) through another tensor, by the id of the runner's —
    its host copy (`executor.offload.HostStates`), whose states are saved as the parameter's. `moved`:
    where a DTensor to load into is not the live tensor but its copy on the mesh's device (a host
    copy's state on a GPU mesh), (that copy, the live tensor), for the loader to copy back."""
    params = runner.params

    def shard(n: str, local: torch.Tensor) -> Any:
        if saving:
            return _local(runner, n, local)
        d = _dtensor(runner, n, local)
        if moved is not None and d.to_local().data_ptr() != local.data_ptr():
            moved.append((d.to_local(), local))
        return d

    out: dict[str, Any] = {"model": {n: shard(n, p.detach()) for n, p in params.items()}}
    if optim is not None:
        shards = {n: b.shard for b in runner.zero_buckets for n in b.names}
        out["optim"] = {}
        for n, p in params.items():
            if n in shards:  # a fused ZeRO bucket's: the shard's states, this parameter's part of them
                st = optim.state[_stepped(stepped, shards[n])]
                out["optim"][n] = {**{k: _fused(runner, n, st[k], saving=saving) for k in ADAM_STATES},
                                   "step": st["step"]}
            else:
                st = optim.state[_stepped(stepped, p)]
                out["optim"][n] = {**{k: shard(n, st[k]) for k in ADAM_STATES}, "step": st["step"]}
    return out


def init_optimizer_state(runner: SpmdRunner, optim: torch.optim.Optimizer, stepped: Stepped = None) -> None:
    """AdamW's states, zero, for every parameter the optimizer steps (a ZeRO bucket's shard for its
    parameters, a host copy for an offloaded one; torch creates them at the first step, loading needs
    them to exist)."""
    zero_states(optim, [_stepped(stepped, p) for p in runner.optimizer_parameters()])


def zero_states(optim: torch.optim.Optimizer, params: Any) -> None:
    """AdamW's states, zero, for each of `params` the optimizer has not stepped yet."""
    group = optim.param_groups[0]
    on_device = bool(group.get("fused") or group.get("capturable"))  # the fused kernel reads `step` there
    for p in params:
        if not optim.state[p]:
            optim.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                              **{k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in ADAM_STATES}}


def save(path: str | Path, runner: SpmdRunner, optim: torch.optim.Optimizer, strategy: Strategy, steps: int,
         stepped: Stepped = None) -> None:
    if not isinstance(optim, torch.optim.AdamW):
        raise CheckpointError("`save`: checkpoints hold AdamW's states; run with `optimizer` adamw")
    dcp.save(_state(runner, optim, saving=True, stepped=stepped), checkpoint_id=str(path), planner=_save_planner())
    write_meta(path, strategy, steps, _folded(runner))


def write_meta(path: str | Path, strategy: Strategy, steps: int, folded: dict[str, dict[str, Any]] | None = None) -> None:
    """meshplan's record beside DCP's files (rank 0 writes it; every rank waits for it)."""
    if dist.get_rank() == 0:
        (Path(path) / META).write_text(json.dumps({
            "model_name": strategy.model.name, "model_fingerprint": strategy.model.fingerprint,
            "mesh": list(strategy.mesh.shape), "axis_names": list(strategy.mesh.axis_names),
            "layout": strategy.training.layout, "optimizer_steps": steps,
            "pipeline_stages": len(strategy.pipeline.stages) if strategy.pipeline is not None else 1,
            "parameters": sorted(_params(strategy)), "parameter_shapes": _params(strategy),
            # A parameter the exporter folded at static shapes (a position table sliced to the traced
            # positions) is saved as the rows it is: which module parameter they are, by torch's name.
            **({"folded": folded} if folded else {})}, indent=1) + "\n")
    dist.barrier()


def _folded(runner: SpmdRunner) -> dict[str, dict[str, Any]]:
    """The module parameters behind the graph's parameters folded at the export's static shapes."""
    graph = runner.graph
    return {name: {"origin": p.origin, "shape": list(graph.tensors[name].shape)}
            for name, p in sorted(graph.parameters.items()) if p.fold is Fold.STATIC and name in runner.params}


class LoadPeak:
    """How far a load raises this process's resident memory above what it held before: the kernel's
    high-water mark (VmHWM, reset through /proc/self/clear_refs) after the load, less the resident
    set (VmRSS) before it. What DCP reads goes straight into the live shards; this is what it held
    besides them (read buffers, metadata). 0 where /proc cannot say (not Linux)."""

    def __init__(self) -> None:
        self.peak_extra_bytes = 0

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def __enter__(self) -> LoadPeak:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self._before = self._status("VmRSS")
        except OSError:
            self._before = -1
        return self

    def __exit__(self, *exc: object) -> None:
        if self._before >= 0:
            self.peak_extra_bytes = max(self.peak_extra_bytes, self._status("VmHWM") - self._before)


def load_model(path: str | Path, runner: SpmdRunner) -> None:
    """This rank's shards of every parameter, from whatever shards the checkpoint holds."""
    state = _state(runner, None)
    missing = sorted(set(state["model"]) - set(read_meta(path)["parameters"]))
    if missing:
        raise CheckpointError(f"{path} holds no parameter {missing[0]}; it was saved for another model")
    with torch.no_grad():
        dcp.load(state, checkpoint_id=str(path))


def load_optimizer(path: str | Path, runner: SpmdRunner, optim: torch.optim.Optimizer,
                   stepped: Stepped = None) -> None:
    if not isinstance(optim, torch.optim.AdamW):
        raise CheckpointError("`load`: checkpoints hold AdamW's states; run with `optimizer` adamw")
    init_optimizer_state(runner, optim, stepped)
    moved: list[tuple[torch.Tensor, torch.Tensor]] = []
    state = _state(runner, optim, stepped=stepped, moved=moved)
    del state["model"]
    with torch.no_grad():
        dcp.load(state, checkpoint_id=str(path))
        for loaded, live in moved:  # (DTensor.from_local moved a host copy's state to the mesh's device)
            live.copy_(loaded)
