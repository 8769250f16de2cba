"""`meshplan.apply(module, strategy)`: run a plan on the user's own `nn.Module` (a Hugging Face model,
their own code) instead of meshplan's ONNX interpreter.

The strategy prices a graph exported from that module; its parameters are the module's, under the
exporter's names. `apply`:

1. **Binds names** (`executor/binding.py`): each ONNX parameter to the module parameters it stands
   for, or one line naming the first mismatch.
2. **Reads the mesh's axes from the plan**: the axes that split the model input's batch are data
   parallel; the other one tensor parallel (one of each, or HSDP's two, with or without it: FSDP over
   tensor parallelism as torchtitan applies it — tensor parallelism first, then `fully_shard` on the
   data-parallel sub-mesh over its DTensor shards).
3. **Tensor parallelism** (`executor/apply_tp.py`; `parallelize_module` with one `PlannedStyle` per
   leaf module the plan computes split on the tensor-parallel axis): the module's parameters as
   DTensors at the plan's placements, its input re-placed at its boundary to the layout the plan computes
   it in, its output to the one its readers take — Megatron-LM's column- and row-wise linears (GPT-2's
   Conv1D, embeddings), norms on sequence shards (sequence parallelism), heads split through attention.
   A block's input the plan re-places on entry (a decoder layer's residual stream split on the sequence)
   is re-placed by a hook on the block; modules under one parent reading one input alike get it once
   from the parent (one gradient reduction, as the plan prices it). Outside the repeated layers the
   model's own code reads shapes (a sequence length off the embeddings): modules there hand on whole
   tensors. Every other re-placement the plan makes on the axis (in the model's own code between
   modules), a parameter stored one way there and used another, or a split module that is not a linear,
   Conv1D or embedding, falls back: the axis runs replicated and the report says which tensor, at
   which node, and what the fallback costs by the plan's own prices.
4. **Data parallelism** over the data-parallel axis: DDP's reducer through the composable
   `replicate` (gradient buckets of the plan's all-reduce fusion size) where parameters are
   replicated (beside tensor parallelism, whose DTensors DDP's reducer takes none of, FSDP2's
   `replicate`: one all-reduce of the gradients a step); `fully_shard` (FSDP2) where the plan shards them (ZeRO-3), and ZeRO-1/2 as
   `fully_shard(reshard_after_forward=False)`: parameters gathered once a step and whole through
   backward, gradients reduce-scattered, states sharded — the plan's collectives (parameters rest
   sharded between steps). Activations the plan gathers over the batch inside the model run batch-local instead
   (the same numbers, fewer collectives); the report lists them. Two data-parallel axes with every
   parameter whole over the first and split over the second are HSDP: `fully_shard` on that 2-D mesh
   (gradients reduce-scattered over the shards, the shard all-reduced over the replicas).
5. **Recomputation**: each recomputed layer of the plan is wrapped with the composable
   `checkpoint` (`torch.utils.checkpoint`; names unchanged).
6. **Compile** (opt-in: `compile=True`, or a plan whose runtime is `compiled`): `nn.Module.compile`
   (Inductor) in place, after tensor parallelism and before data parallelism (torchtitan's order);
   names unchanged. The whole module, as the compiled runtime is priced; each layer alone where the
   plan recomputes layers (`executor/apply_layers.py`).

Nothing of this leaks into the module's names: `state_dict()` keys are the user's own (the composable
APIs keep FQNs; DDP's wrapper would add "module."). The report (`ApplyReport`) is on the module as
`module.meshplan_report` and says what runs, what fell back and why, and the collectives one step
runs per micro-batch, which a test counts.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from core import placement as mp
from core.collectives import Collective
from core.context import cp_axis
from core.graph import OpGraph, TensorKind
from core.levers import Offload, Recompute, Runtime
from executor.apply_experts import apply_expert_parallel, expert_parallel_blocks
from executor.apply_layers import (
    compile_module,
    host_activation_layers,
    inductor_missing,
    layer_module,
    module_keys,
    offloaded_units,
    recompute_layers,
    weights_offloaded,
)
from executor.apply_tp import module_boundaries
from executor.apply_tp_plan import planned_spec, source_parameter
from executor.binding import ApplyError, Binding, bind_parameters
from planner.graph import load_graph
from planner.strategy import Strategy, load_strategy

_ROLE_WORDS = {"colwise": "column-wise", "rowwise": "row-wise", "sequence": "sequence-parallel",
               "split": "split-activation", "re-layout": "re-laid"}


@dataclass
class ApplyReport:
    data_parallel: str  # "replicate" (DDP), "fully_shard" (ZeRO-3), or "" (no data-parallel axis)
    dp_axis: str | None
    tp_axis: str | None
    styles: dict[str, str] = field(default_factory=dict)  # module FQN → "colwise", "rowwise", "sequence", ...
    fallbacks: list[str] = field(default_factory=list)  # what runs other than planned, and why
    batch_local: list[str] = field(default_factory=list)  # activations the plan gathers over the batch
    recomputed: list[str] = field(default_factory=list)  # module FQNs wrapped with checkpoint
    recompute: str = ""  # their policy: "full" or "selective"
    expected: dict[str, int] = field(default_factory=dict)  # collectives of one micro-batch's step
    micro_batches: int = 1
    planned_step_s: float = 0.0
    fallback_saves_s: float = 0.0  # the plan's time of the collectives a fallback does not run
    bindings: tuple[Binding, ...] = ()
    precision: str = "fp32"  # the plan's (`amp`: run forward and loss under `autocast()`)
    mixed_policy: bool = False  # fully_shard's MixedPrecisionPolicy(bf16, fp32) applied (a `mixed` plan)
    zero: str = ""  # how a ZeRO-1/2 plan runs (`_zero_as_fully_shard`)
    zero_stage: int = 0  # that plan's stage (1 or 2); 0 otherwise
    device: str = "cpu"  # the mesh's device type
    compiled: list[str] = field(default_factory=list)  # module FQNs compiled (torch.compile, Inductor)
    pipeline: Any = None  # a pipelined plan's `apply_pp.PipelineRun`: this rank's chunks and the schedule
    strategy: Strategy | None = None  # the plan applied (its names and shapes: checkpoints)
    runtime: str = "eager"  # the plan's runtime (what it priced)
    dp_rank: int = 0  # this rank's share of the batch (its index over the data-parallel axes) …
    dp_size: int = 1  # … among this many
    offloaded: list[str] = field(default_factory=list)  # fully_shard units under CPUOffloadPolicy ("" the root)
    host_activations: list[str] = field(default_factory=list)  # layer FQNs whose saved activations go to the host
    host: Any = None  # their `HostActivations` (the host bytes one forward held: `host.peak_bytes`)
    fsdp2_replicated: bool = False  # DDP as FSDP2's replicate (`_replicate_fsdp2`)
    experts: list[str] = field(default_factory=list)  # experts modules split over ep (`executor/apply_experts.py`)
    ep: int = 1  # … over this many ranks

    def batch_share(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch, as a data loader gives them (all rows where no axis splits
        the batch; the same rows on every rank of a tensor-parallel group)."""
        return batch.chunk(self.dp_size)[self.dp_rank] if self.dp_size > 1 else batch

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The context the training loop runs forward and loss in: torch.autocast(bfloat16) for an amp
        plan, and a mixed one not under fully_shard (DDP, tensor parallelism, one device), on the
        module's device; nothing to do otherwise (mixed under fully_shard: its policy casts)."""
        if not self.runs_autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=torch.bfloat16)

    def micro_batch(self, module: nn.Module, index: int) -> None:
        """Before micro-batch `index` of a step (0 … micro_batches − 1): under ZeRO-1/2 as fully_shard, the
        parameters stay gathered until the last micro-batch's backward, which reshards them for the
        optimizer step; ZeRO-1 reduce-scatters on the last only; DDP beside tensor parallelism all-reduces
        on the last only. Nothing to do otherwise."""
        last = index == self.micro_batches - 1
        if self.fsdp2_replicated:  # FSDP2's replicate: the gradients all-reduced once, on the last
            module.set_requires_gradient_sync(last)  # type: ignore[operator]
        if not self.zero_stage:
            return
        module.set_reshard_after_backward(last)  # type: ignore[operator]
        if self.zero_stage == 1:
            module.set_requires_gradient_sync(last)  # type: ignore[operator]

    @property
    def runs_autocast(self) -> bool:
        return self.precision == "amp" or (self.precision == "mixed" and not self.mixed_policy)

    def lines(self) -> list[str]:
        out = [f"data parallel: {self.data_parallel or 'none'} over {self.dp_axis}" if self.dp_axis
               else "data parallel: none"]
        if self.precision != "fp32":
            out.append(f"precision: {self.precision}" + (" (run forward and loss under report.autocast())"
                                                         if self.runs_autocast else
                                                         " (fully_shard's MixedPrecisionPolicy: bf16 compute, fp32 "
                                                         "reductions)" if self.mixed_policy else ""))
        if self.tp_axis and self.styles:
            roles = Counter(self.styles.values())
            out.append(f"tensor parallel over {self.tp_axis}: " + ", ".join(
                f"{roles[r]} {_ROLE_WORDS[r]}" for r in _ROLE_WORDS if roles[r]) + " modules")
        elif self.tp_axis:
            out.append(f"replicated over {self.tp_axis}: every rank computes the whole step, as the plan does")
        if self.zero:
            out.append(self.zero)
        if self.experts:
            out.append(f"expert parallel over ep={self.ep}: {len(self.experts)} experts modules split, tokens sent to "
                       "their experts and back (all_to_all_single; none dropped, as the module drops none)")
        if self.offloaded:
            layers = [u for u in self.offloaded if u]
            out.append(f"offload: weights, gradients and optimizer states on the host (fully_shard's CPUOffloadPolicy) "
                       f"for {len(layers)} layers" + (" and the root" if "" in self.offloaded else ""))
        if self.host_activations:
            out.append(f"activations on the host: {len(self.host_activations)} layers (what autograd saves copied "
                       "there, back for backward)")
        if self.recomputed:
            out.append(f"recomputed: {len(self.recomputed)} modules"
                       + (" (selective: attention's and every other matmul's outputs saved)"
                          if self.recompute == "selective" else ""))
        if self.compiled:
            out.append(("compiled: the whole module" if self.compiled == ["(the whole module)"] else
                        f"compiled: {len(self.compiled)} layers") + " (torch.compile, Inductor)"
                       + ("; the plan priced eager kernels (plan with `runtime` compiled to price Inductor's "
                          "fused ones)" if self.runtime != "compiled" else ""))
        if self.pipeline is not None:
            run = self.pipeline
            out.append(f"pipeline: {run.stages} stages, {run.chunks_total} model chunks, {run.schedule_name}, "
                       f"{self.micro_batches} micro-batches; this rank runs chunks {run.indices} (call "
                       "report.pipeline.step(inputs, target=labels) for a step, optimize report.pipeline.parameters(); "
                       "the module's own parameters are not the chunks' — save with meshplan.save_checkpoint)")
        elif self.micro_batches > 1:
            out.append(f"{self.micro_batches} micro-batches per step: accumulate them, synchronising on the last"
                       + (" (call report.micro_batch(module, i) before each)" if self.zero_stage or self.fsdp2_replicated
                          else ""))
        out += [f"fallback: {f}" for f in self.fallbacks]
        if self.batch_local:
            out.append(f"{len(self.batch_local)} activation gather(s) over the batch run batch-local instead "
                       f"(first: {self.batch_local[0]})")
        return out


# ---------------------------------------------------------------------------------------------
# the plan's axes and what each module does on them


def _batch_coordinate(mesh: DeviceMesh, axes: list[int]) -> tuple[int, int]:
    """This rank's index among the batch's shares (the data-parallel `axes` of `mesh`, in mesh order) and
    their count."""
    coord = mesh.get_coordinate() or [0] * mesh.ndim
    index, count = 0, 1
    for a in axes:
        index, count = index * mesh.size(a) + coord[a], count * mesh.size(a)
    return index, count


def _data_parallel_axes(strategy: Strategy) -> set[int]:
    axes: set[int] = set()
    for t, v in strategy.tensors.items():
        if v.kind is TensorKind.INPUT and len(v.shape) > 0:
            spec = strategy.spec_of(t)
            if spec is not None:
                axes |= set(spec.shard_axes(0))
    return axes


# ---------------------------------------------------------------------------------------------
# apply


def apply(module: nn.Module, strategy: Strategy | str | Path, mesh: DeviceMesh | None = None, *,
          model: str | Path | None = None, compile: bool | None = None,
          loss_fn: Callable[..., torch.Tensor] | None = None) -> nn.Module:
    """Distribute `module` as `strategy` plans it (see the module docstring); returns the module, with
    `module.meshplan_report`. `model`: the ONNX file the strategy was planned on, where it has moved
    since (default: the path the strategy names). `compile`: torch.compile (default: where the plan's
    runtime is `compiled`). `loss_fn(output, target)`: a pipelined plan's loss on its last stage (default:
    cross-entropy of the logits, `apply_pp.cross_entropy`)."""
    s = strategy if isinstance(strategy, Strategy) else load_strategy(strategy)
    path = Path(model) if model is not None else Path(s.model.path)
    if not path.exists():
        raise ApplyError(f"{path}: the strategy's model is not there; pass model= the ONNX file it was planned on")
    graph = load_graph(path, dict(s.model.dims))
    if not dist.is_initialized():
        raise ApplyError("apply needs torch.distributed initialised (torchrun, then "
                         "dist.init_process_group); it places parameters on the process group's ranks")
    shape = tuple(s.mesh.shape)
    names = s.mesh.axis_names
    dp_axes = _data_parallel_axes(s)
    big = [i for i, n in enumerate(shape) if n > 1]
    tp_axes = [i for i in big if i not in dp_axes]
    dp_big = [i for i in big if i in dp_axes]
    if s.pipeline is None and (len(tp_axes) > 1 or len(dp_big) > 2):
        raise ApplyError(f"apply runs one tensor-parallel axis and up to two data-parallel ones (HSDP); this plan's "
                         f"mesh {list(shape)} {list(names)} has more; plan with `mesh_shape` N (or run "
                         "it with `meshplan run`)")
    if s.pipeline is None and tp_axes and len(dp_big) == 2:  # (8 ranks at the least: not run here, not claimed)
        raise ApplyError(f"apply runs two data-parallel axes (HSDP) without a tensor-parallel one; this plan has "
                         f"'{names[dp_big[0]]}', '{names[dp_big[1]]}' and '{names[tp_axes[0]]}': plan with one "
                         "data-parallel axis beside tp (`layout` dp_shard=N,tp=M), or run it with `meshplan run`")
    devices = s.pipeline.devices if s.pipeline is not None else s.mesh.num_devices
    if dist.get_world_size() != devices:
        raise ApplyError(f"the strategy's {'pipeline' if s.pipeline else 'mesh'} "
                         f"{[len(s.pipeline.stages), *shape] if s.pipeline else list(shape)} needs {devices} ranks, "
                         f"this run has {dist.get_world_size()}; launch with --nproc-per-node {devices} or plan for "
                         f"{dist.get_world_size()} devices")
    if cp_axis(s.mesh) is not None:
        raise ApplyError("apply does not run context parallelism yet (torch's context_parallel, GPU only); run the "
                         "plan with `meshplan run` (both designs, any device), or plan without cp")
    if s.pipeline is not None:
        if expert_parallel_blocks(s, graph):
            raise ApplyError("apply does not run expert parallelism inside pipeline stages yet; plan without pp or "
                             "without ep")
        return _apply_pipelined(s, graph, module, mesh, loss_fn, compile)
    if mesh is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=tuple(s.mesh.axis_names))
    elif tuple(mesh.shape) != shape:
        raise ApplyError(f"the mesh given is {list(mesh.shape)}, the strategy's {list(shape)}")
    elif tuple(mesh.mesh_dim_names or ()) != tuple(s.mesh.axis_names):
        raise ApplyError(f"the mesh given names its axes {list(mesh.mesh_dim_names or ())}, the strategy "
                         f"{list(s.mesh.axis_names)}; pass init_device_mesh(..., mesh_dim_names={tuple(s.mesh.axis_names)}) "
                         "or leave `mesh` out")
    if compile is None:
        compile = s.settings.runtime is Runtime.COMPILED
    if compile:
        missing = inductor_missing(mesh.device_type)
        if missing:
            raise ApplyError(f"compile: {missing}; apply without compile=True (and plan with `runtime` eager)")
    bindings = bind_parameters(s, graph, module)
    report = ApplyReport(data_parallel="", dp_axis="+".join(names[a] for a in dp_big) if dp_big else None,
                         tp_axis=names[tp_axes[0]] if tp_axes else None, micro_batches=s.training.micro_batches,
                         planned_step_s=s.cost.step_time_s, bindings=bindings, precision=s.settings.dtype,
                         device=mesh.device_type, runtime=s.settings.runtime.value, strategy=s)
    report.dp_rank, report.dp_size = _batch_coordinate(mesh, dp_big)
    recompute_layers(s, graph, module, report)
    host_activation_layers(s, graph, module, report)
    selective = Recompute.SELECTIVE in s.training.recompute.values()
    if expert_parallel_blocks(s, graph) and (tp_axes or compile or selective):
        raise ApplyError("apply runs expert parallelism beside data parallelism only, eager, without selective "
                         "recomputation; this plan has " + ("a tensor-parallel axis" if tp_axes else "compile" if compile
                                                            else "selective recomputation")
                         + ": run it with `meshplan run`, or plan without it")
    apply_expert_parallel(s, graph, module, mesh, bindings, report)
    if tp_axes:
        _apply_tensor_parallel(s, graph, module, mesh, bindings, tp_axes[0], report)
    if compile:
        compile_module(graph, module, report)
    elif s.settings.runtime is Runtime.COMPILED:
        report.fallbacks.append("runtime: the plan prices torch.compile's fused kernels, the module runs eager "
                                "(apply with compile=True, or plan with `runtime` eager)")
    if len(dp_big) == 2:
        _apply_hybrid(s, graph, module, mesh, bindings, dp_big, report)
    elif dp_big:
        _apply_data_parallel(s, graph, module, mesh, bindings, dp_big[0], report)
    elif (s.settings.dtype == "mixed" or weights_offloaded(s)) and not tp_axes:  # one device: the policy (and
        # the offload) alone, as a user's FSDP2 run has them
        _fully_shard(s, module, mesh[names[0]] if len(names) > 1 else mesh, None, report)
    if any(m == Offload.OPTIMIZER for m in s.training.offload.values()):
        report.fallbacks.append("offload optimizer: the optimizer is yours and FSDP2 offloads no optimizer state alone; "
                                "its states stay on the device (plan with `offload` params,optimizer for "
                                "CPUOffloadPolicy, or train with meshplan run)")
    if s.settings.dtype in ("bf16", "fp16"):  # no policy is applied for them, under fully_shard or not
        report.fallbacks.append(f"{s.settings.dtype}: the module trains in its own dtype (plan with `dtype` mixed "
                                "for fully_shard's MixedPrecisionPolicy, or amp to run under report.autocast())")
    module.meshplan_report = report  # type: ignore[assignment]
    return module


def _apply_pipelined(s: Strategy, graph: OpGraph, module: nn.Module, mesh: DeviceMesh | None,
                     loss_fn: Callable[..., torch.Tensor] | None, compile: bool | None) -> nn.Module:
    """A pipelined plan (`executor/apply_pp.py`): the module split into the plan's chunks, this rank's run
    by the plan's schedule (`report.pipeline`), each chunk data-parallel over its stage's mesh."""
    from executor import apply_pp

    assert s.pipeline is not None
    p, shape, names = len(s.pipeline.stages), tuple(s.mesh.shape), tuple(s.mesh.axis_names)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if mesh is None:
        mesh = init_device_mesh(device_type, (p, *shape), mesh_dim_names=("pp", *names))
    elif tuple(mesh.shape) != (p, *shape) or tuple(mesh.mesh_dim_names or ()) != ("pp", *names):
        raise ApplyError(f"a pipelined plan runs on a mesh {[p, *shape]} named {['pp', *names]}; the mesh given is "
                         f"{list(mesh.shape)} {list(mesh.mesh_dim_names or ())}; leave `mesh` out")
    bindings = bind_parameters(s, graph, module)
    dp_axes = _data_parallel_axes(s)
    big = [i for i, n in enumerate(shape) if n > 1]
    if [i for i in big if i not in dp_axes] or len(big) > 1:
        raise ApplyError(f"apply runs a pipeline's stages over one data-parallel axis; this plan's stage mesh {list(shape)} "
                         f"{list(names)} has more (plan with `layout` pp={p},dp_shard=N, or run it with `meshplan run`)")
    report = ApplyReport(data_parallel="", dp_axis=names[big[0]] if big else None, tp_axis=None,
                         micro_batches=s.training.micro_batches, planned_step_s=s.cost.step_time_s, bindings=bindings,
                         precision=s.settings.dtype, device=mesh.device_type, runtime=s.settings.runtime.value,
                         strategy=s)
    report.dp_rank, report.dp_size = _batch_coordinate(mesh, [1 + a for a in big])
    if s.training.recompute:
        report.fallbacks.append("pipeline: the plan's recomputation is not applied to traced chunks; activations kept")
    if s.training.offload_activations:
        report.fallbacks.append("pipeline: the plan's activations on the host are not applied to traced chunks; kept "
                                "on the device")
    if compile or (compile is None and s.settings.runtime is Runtime.COMPILED):
        report.fallbacks.append("pipeline: the traced chunks run eager (compile is not applied to them)")
    if s.settings.dtype in ("bf16", "fp16") or (s.settings.dtype == "mixed" and not big):
        report.fallbacks.append(f"pipeline: {s.settings.dtype}: no precision policy on the chunks (mixed gets "
                                "fully_shard's MixedPrecisionPolicy only over a data-parallel axis); they train in "
                                "the module's dtype")
    keys = module_keys(module)
    splits = apply_pp.split_points(s, graph, module, lambda path: (layer_module(path, module, keys) or (None,))[0])
    dims = dict(s.model.dims)
    rows = dims.get("batch", 1) // (shape[big[0]] if big else 1)  # the graph's batch: one micro-batch's, all ranks'
    example = torch.zeros((rows, dims.get("seq", 1)), dtype=torch.long, device=mesh.device_type)

    def parallelize(chunk: nn.Module) -> None:
        if not big:
            return
        held = {n for n, _ in chunk.named_parameters(remove_duplicate=False)}
        mine = tuple(b for b in bindings if set(b.fqns) & held)
        # (DDP as FSDP2's replicate: torch's PipelineStage holds its gradient sync to the last micro-batch, as
        # it does fully_shard's; DDP's reducer would reduce at the first micro-batch's backward alone)
        _apply_data_parallel(s, graph, chunk, mesh, mine, big[0], report, fsdp2_replicate=True)

    run = apply_pp.build(s, graph, module, mesh, splits, example, loss_fn or apply_pp.cross_entropy, parallelize)
    report.pipeline = run
    report.fallbacks = list(dict.fromkeys(report.fallbacks))  # (each chunk's data parallelism said it once)
    report.expected = {}  # (per chunk and micro-batch under the schedule: not counted here)
    module.meshplan_report = report  # type: ignore[assignment]
    return module


def _apply_tensor_parallel(s: Strategy, graph: OpGraph, module: nn.Module, mesh: DeviceMesh,
                           bindings: tuple[Binding, ...], axis: int, report: ApplyReport) -> None:
    tp = module_boundaries(s, graph, module, bindings, axis)
    name = s.mesh.axis_names[axis]
    if tp.deviations:
        held = sum(1 for b in bindings if isinstance(planned_spec(s, b.onnx).placements[axis], mp.Shard))
        report.fallbacks.append(
            f"'{name}': the plan re-places {tp.deviations[0]}"
            + (f" (and {len(tp.deviations) - 1} more)" if len(tp.deviations) > 1 else "")
            + f", which module-boundary hooks cannot express; the module runs replicated over '{name}' "
              f"({held} split parameters held whole; the plan's {tp.deviation_s * 1e3:.3f} ms of those "
              "collectives not run)")
        report.fallback_saves_s += tp.deviation_s
        return
    parallelize_module(module, mesh[name], dict(tp.styles))
    report.styles = dict(tp.roles)
    counts = dict(tp.expected)
    if mesh.device_type == "cpu" and "all_to_all" in counts:  # DTensor's all-to-all on CPU meshes: an
        # all-gather and a chunk (gloo has none; torch's `shard_dim_alltoall`)
        counts["all_gather"] = counts.get("all_gather", 0) + counts.pop("all_to_all")
    _expect(report, counts)


def _apply_data_parallel(s: Strategy, graph: OpGraph, module: nn.Module, mesh: DeviceMesh,
                         bindings: tuple[Binding, ...], axis: int, report: ApplyReport, *,
                         fsdp2_replicate: bool = False) -> None:
    """(The experts expert parallelism holds, `report.experts`, are left out of the data-parallel wrapping.)
    `fsdp2_replicate`: whole parameters under FSDP2's replicate rather than DDP's reducer (a pipeline's
    chunks); so too beside tensor parallelism."""
    name = s.mesh.axis_names[axis]
    _batch_local(s, graph, bindings, [axis], report)
    bindings = _without_experts(bindings, report)
    sharded = [b for b in bindings if isinstance(planned_spec(s, b.onnx).placements[axis], mp.Shard)]
    sub = mesh[name]
    if sharded or s.training.zero_stage:
        if len(sharded) < len(bindings):
            _sharded_together(name, len(bindings) - len(sharded), report)
        zero = s.training.zero_stage
        again = zero not in (1, 2)  # ZeRO-3 gathers the parameters again for backward, as the plan prices it
        _fully_shard(s, module, sub, again, report)
        report.data_parallel = "fully_shard"
        if not again:
            _zero_as_fully_shard(module, zero, report)
        units = 1 + len([u for u in report.offloaded if u])  # the root, and each offloaded layer
        _expect(report, {"all_gather": (2 if again else 1) * units, "reduce_scatter": units})
    else:
        if weights_offloaded(s):
            raise ApplyError(f"the plan keeps weights on the host (offload params,optimizer) and every parameter whole "
                             f"over '{name}' (DDP); apply offloads weights with fully_shard's CPUOffloadPolicy: plan with "
                             "`zero_stage` 3 (or `layout` dp_shard=N)")
        if fsdp2_replicate or report.tp_axis is not None:  # (tensor parallelism's DTensors: DDP takes none)
            _replicate_fsdp2(s, module, sub, report)
            return
        from torch.distributed._composable.replicate import replicate

        cap = s.training.comm_fusion.allreduce
        replicate(module, process_group=sub.get_group(), bucket_cap_mb=cap / 2**20, broadcast_buffers=False,
                  ignored_modules=[module.get_submodule(f) for f in report.experts])
        # DDP's set-up now rather than in the first forward: rank 0's parameters broadcast to every
        # rank (the seeds' parameter_broadcast), once, not inside the first step.
        replicate.state(module).lazy_init()
        report.data_parallel = "replicate"
        if s.buckets is not None:  # DDP's buckets, as the plan priced them
            _expect(report, {"all_reduce": sum(1 for b in s.buckets if b.kind is Collective.ALL_REDUCE and b.axes == (axis,))})


def _replicate_fsdp2(s: Strategy, module: nn.Module, mesh: DeviceMesh, report: ApplyReport) -> None:
    """DDP over `mesh` as FSDP2's `replicate` — beside tensor parallelism, as torchtitan runs it (DDP's
    reducer takes no DTensor), and in a pipeline's chunks (torch's PipelineStage syncs its gradients on
    the last micro-batch): parameters whole over the data-parallel axis, the gradients all-reduced once
    for the module after backward (one flat buffer: the plan's buckets are not kept), a mixed plan under
    its MixedPrecisionPolicy. Unlike DDP's reducer it broadcasts no parameters: every rank starts from the
    same weights, as under fully_shard."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(module, mesh=mesh, mp_policy=_precision_policy(s), ignored_params=_experts_params(module, report))
    report.fsdp2_replicated = True
    report.data_parallel = "replicate"
    report.mixed_policy = s.settings.dtype == "mixed"
    _expect(report, {"all_reduce": 1})


def _precision_policy(s: Strategy) -> Any:
    """FSDP2's MixedPrecisionPolicy for the plan: a mixed plan's bf16 compute on the gathered weights with
    fp32 reductions and states; the module's own dtype otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if s.settings.dtype == "mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _experts_params(module: nn.Module, report: ApplyReport) -> set[nn.Parameter] | None:
    """The parameters of the experts modules expert parallelism holds (kept out of data parallelism's units)."""
    return {p for f in report.experts for p in module.get_submodule(f).parameters()} or None


def _expect(report: ApplyReport, counts: dict[str, int]) -> None:
    """The collectives of one more part of the step (data parallelism beside tensor parallelism's)."""
    report.expected = {k: v for k, v in (Counter(report.expected) + Counter(counts)).items() if v}


def _zero_as_fully_shard(module: nn.Module, zero: int, report: ApplyReport) -> None:
    """ZeRO-1/2 as FSDP2 runs them: `reshard_after_forward=False` gathers the parameters once for the step
    and keeps them whole through backward (ZeRO-1/2 hold them whole), the gradients are reduce-scattered
    and each rank steps its shard of the optimizer states — the plan's reduce-scatter and all-gather,
    the gather before forward rather than after the optimizer step. Over k micro-batches the parameters
    stay gathered to the last, where they are resharded for the optimizer step: ZeRO-2 reduce-scatters
    every micro-batch, ZeRO-1 once, on the last — the loop calls `report.micro_batch(module, i)` before
    each (it sets `set_reshard_after_backward` and, at ZeRO-1, `set_requires_gradient_sync`). Between
    steps the parameters rest sharded: less memory than the plan's, never more."""
    report.zero_stage = zero
    report.zero = f"ZeRO-{zero} as fully_shard(reshard_after_forward=False): parameters gathered once a step, " \
        "gradients reduce-scattered" + (" on the last micro-batch" if zero == 1 and report.micro_batches > 1 else "") \
        + ", optimizer states sharded; parameters sharded between steps"


def _apply_hybrid(s: Strategy, graph: OpGraph, module: nn.Module, mesh: DeviceMesh, bindings: tuple[Binding, ...],
                  axes: list[int], report: ApplyReport) -> None:
    """Two data-parallel axes: HSDP (`fully_shard` on the 2-D mesh, replicas over the first axis, shards
    over the second) where the plan stores every parameter whole over one and split over the other."""
    names = s.mesh.axis_names
    _batch_local(s, graph, bindings, axes, report)
    bindings = _without_experts(bindings, report)
    split = {a: [isinstance(planned_spec(s, b.onnx).placements[a], mp.Shard) for b in bindings] for a in axes}
    replicate, shard = axes
    if any(split[replicate]) or not any(split[shard]):
        raise ApplyError(f"apply runs two data-parallel axes as HSDP: every parameter whole over '{names[replicate]}' "
                         f"and split over '{names[shard]}'; this plan stores them otherwise (plan with `layout` "
                         f"dp_replicate={s.mesh.shape[replicate]},dp_shard={s.mesh.shape[shard]}, or with `mesh_shape` "
                         f"{s.mesh.shape[replicate] * s.mesh.shape[shard]} for one data-parallel axis, or run it with "
                         "`meshplan run`)")
    if not all(split[shard]):
        _sharded_together(names[shard], split[shard].count(False), report)
    _fully_shard(s, module, mesh[(names[replicate], names[shard])], True, report)
    report.data_parallel = "fully_shard (HSDP)"
    # One unit, the root: gathered over the shards for forward and again for backward, its gradients
    # reduce-scattered over them and the shard all-reduced over the replicas.
    _expect(report, {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1})


def _batch_local(s: Strategy, graph: OpGraph, bindings: tuple[Binding, ...], axes: list[int],
                 report: ApplyReport) -> None:
    """Activations the plan gathers over the batch (re-placed on a data-parallel axis): batch-local here."""
    params = {b.onnx for b in bindings}
    for r in s.reshards:
        what = f"{r.tensor} {r.src} → {r.dst} at {r.consumer}"
        if what not in report.batch_local and source_parameter(graph, r.tensor) not in params and \
                any(r.src.placements[a] != r.dst.placements[a] for a in axes):  # (once: a pipeline's chunks ask each)
            report.batch_local.append(what)
            report.fallback_saves_s += sum(c.time_s for c in r.collectives)


def _without_experts(bindings: tuple[Binding, ...], report: ApplyReport) -> tuple[Binding, ...]:
    return tuple(b for b in bindings if not any(f.rpartition(".")[0] in report.experts for f in b.fqns))


def _sharded_together(axis: str, whole: int, report: ApplyReport) -> None:
    report.fallbacks.append(f"'{axis}': {whole} parameters the plan keeps whole are sharded too (fully_shard "
                            "shards a module's parameters together)")


def _fully_shard(s: Strategy, module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool | None,
                 report: ApplyReport) -> None:
    """`fully_shard` on `mesh`; a mixed plan under MixedPrecisionPolicy (bf16 compute on the gathered
    weights, fp32 reductions and states). `reshard_after_forward` None: FSDP2's default. Where the plan
    keeps layers' weights on the host (offload params,optimizer), each such layer its own unit under
    CPUOffloadPolicy, and the root under it where the parameters outside them are too
    (`apply_layers.offloaded_units`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = _precision_policy(s)
    host = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    units, root = offloaded_units(s, module, report)
    ignored = _experts_params(module, report)
    for fqn, layer in units:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy, offload_policy=host,
                    ignored_params=ignored)
        report.offloaded.append(fqn)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                offload_policy=host if root else OffloadPolicy(), ignored_params=ignored)
    if root:
        report.offloaded.append("")
    report.mixed_policy = s.settings.dtype == "mixed"
