"""What every rank's training loop shares, plain or pipelined: the seeded batch and its micro-batches,
the loss (the plan's), the optimizer, the rank's device, and the one-process reference that `--verify`
compares a run with.

Data and labels are seeded, identical in every process: integer inputs are token ids below the
vocabulary their embedding reads, float inputs standard normal. The loss is the one the plan priced
(`costmodel/loss.py`): cross-entropy against seeded labels on logits, else the mean of squares. It
runs on each rank's rows of the output (their sum over the global count: the loss's addends), after
the planned reshard that reduces partial sums and, for cross-entropy, gathers a split class dim.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Container, Mapping
from typing import Any

import torch
import torch.distributed as dist

from core.graph import OpGraph, TensorKind
from core.levers import LossKind
from executor.dtensors import full_grad
from executor.interpreter import OnnxModule, load_module
from executor.preflight import RunOptions
from executor.spmd import SpmdRunner
from planner.strategy import Strategy


def make_batch(graph: OpGraph, seed: int, micro_batches: int = 1) -> list[torch.Tensor]:
    """One optimizer step's inputs: `micro_batches` micro-batches of the graph's (micro-step) shape,
    stacked along dim 0 (the batch dim of every input)."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for name in graph.inputs:
        info = graph.tensors[name]
        shape = _global_shape(info.shape, micro_batches)
        if info.is_float:
            out.append(torch.randn(shape, generator=g))
            continue
        high = 2
        for n in graph.compute_nodes:  # ids read by an embedding: stay below its vocabulary
            if n.op_type == "Gather" and len(n.inputs) > 1 and n.inputs[1] == name:
                axis = int(n.attr("axis", 0))  # type: ignore[call-overload]
                high = graph.tensors[n.inputs[0]].shape[axis]
        out.append(torch.randint(0, high, shape, generator=g, dtype=torch.int64))
    return out


def _global_shape(shape: tuple[int, ...], micro_batches: int) -> tuple[int, ...]:
    return (shape[0] * micro_batches, *shape[1:]) if shape else shape


def micro_batch(x: torch.Tensor, i: int, micro_batches: int) -> torch.Tensor:
    """Micro-batch i of a step's tensor (rows split evenly along dim 0)."""
    rows = x.shape[0] // micro_batches
    return x[i * rows:(i + 1) * rows]


class Loss:
    """The training loss on the output of one optimizer step's batch (all its micro-batches), computable
    on any row shard of any micro-batch: `local(y, labels)` is the shard's addend (its rows' sum over
    the step's count), so the addends of every rank and micro-batch sum to the loss of the whole batch
    (MindSpore's loss_repeated_mean: the mean over the global batch, not a mean of means)."""

    def __init__(self, graph: OpGraph, kind: str, seed: int, micro_batches: int = 1, scale: float = 1.0) -> None:
        """`scale`: the loss multiplied by it (the data-parallel degree when gradients are summed over
        the ranks rather than averaged, MindSpore's gradients_mean=False: each rank's loss is the mean
        of its own batch, and their gradients add up)."""
        out = graph.tensors[graph.outputs[0]]
        shape = _global_shape(out.shape, micro_batches)
        self.kind = kind
        self.labels: torch.Tensor | None = None
        if kind is LossKind.CROSS_ENTROPY:
            g = torch.Generator().manual_seed(seed + 2)
            self.labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
        self.count = (math.prod(shape[:-1]) if kind is LossKind.CROSS_ENTROPY else math.prod(shape)) / scale

    def local(self, y: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if self.kind is LossKind.CROSS_ENTROPY:
            assert labels is not None
            return torch.nn.functional.cross_entropy(y.reshape(-1, y.shape[-1]).float(), labels.reshape(-1),
                                                     reduction="sum") / self.count
        return (y.float() ** 2).sum() / self.count

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        return self.local(y, self.labels)


# The precisions the executor runs under torch.autocast(bfloat16). `mixed` (FSDP2's MixedPrecisionPolicy)
# too, its split parameters gathered as the policy gathers them (`dtensors.low_gather`: cast to bf16,
# gathered in bf16, the gradient reduced in fp32); the other weights stay fp32 and autocast casts them
# where a matmul reads them.
AUTOCAST = ("amp", "mixed")


def precision_context(dtype: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """How the step runs the plan's precision: `amp` and `mixed` under torch.autocast(bfloat16) on the
    rank's device (fp32 weights, gradients and optimizer states; CPU autocast on gloo ranks), the rest
    as fp32."""
    if dtype in AUTOCAST:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def clock(device: torch.device | None = None) -> float:
    """Now, once the device has finished what was issued (a GPU runs behind its host; None: the
    current CUDA device where CUDA is in use)."""
    if device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def make_optimizer(params: Any, opts: RunOptions) -> torch.optim.Optimizer:
    if opts.optimizer == "sgd":
        return torch.optim.SGD(params, lr=opts.lr)
    params = list(params)
    if params and all(p.is_cuda for p in params):  # the fused kernel on GPUs, as the GPU profiles price it
        return torch.optim.AdamW(params, lr=opts.lr, fused=True)
    return torch.optim.AdamW(params, lr=opts.lr, foreach=False)


def ordered_params(module: OnnxModule) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, module.params[key]) for name, key in module.param_names.items()]


def rank_device(backend: str, env: Mapping[str, str]) -> torch.device:
    """Where a rank computes: its local GPU (torchrun's LOCAL_RANK) under nccl, else the CPU (gloo)."""
    if backend == "nccl":
        return torch.device("cuda", int(env.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def diverge(module: torch.nn.Module, seed: int) -> None:
    """Every rank but 0 perturbs its parameters (RunOptions.diverge_ranks)."""
    rank = dist.get_rank()
    if rank:
        g = torch.Generator().manual_seed(seed + rank)
        for p in module.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g).to(p.device))


def state_bytes(module: torch.nn.Module, optim: torch.optim.Optimizer, runner: SpmdRunner, *,
                host: Container[int] = frozenset()) -> int:
    """Model states held by this rank's device: weights, gradients, optimizer state tensors (but those of
    the parameters stepped on the host, by id: `host`), ZeRO-2 gradient shards."""
    out = sum(p.numel() * p.element_size() for p in module.parameters())
    out += sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
    out += sum(v.numel() * v.element_size() for p, st in optim.state.items() if id(p) not in host for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out + runner.grad_shard_bytes()


def batch_shards(strategy: Strategy) -> int:
    """Ranks the batch is split over (the data-parallel degree): the shards of the inputs' dim 0."""
    specs = [strategy.spec_of(t) for t in strategy.tensors if strategy.tensors[t].kind is TensorKind.INPUT]
    return max((sp.num_shards(0, strategy.mesh.shape) for sp in specs if sp is not None), default=1)


def verify_against_one_process(model_path: str, dims: dict[str, int], opts: RunOptions, batch: list[torch.Tensor],
                               loss_of: Loss, dist_loss: float, grads: dict[str, torch.Tensor],
                               after: dict[str, torch.Tensor], final: dict[str, torch.Tensor], *,
                               steps: int | None = None, offset: int = 0, micro_batches: int = 1,
                               dtype: str = "fp32") -> dict[str, Any]:
    """The same training in one process: the first step's loss, gradients and updated parameters,
    and the parameters after all the run's `steps` (`final`; default 1 + warm-up + timed steps). The
    parameters compared are those of `grads` (a pipeline stage's own). `offset`: optimizer steps the
    run's parameters had before it (a loaded checkpoint's), which the one process trains first, from
    the start: the check of a checkpoint is this uninterrupted run. `micro_batches`: the step's batch
    as that many micro-batches, their gradients accumulated (a model traced at a static batch, which
    takes one micro-batch at a time); 1: the whole batch at once (the model bound at the step's batch).
    `dtype`: the plan's precision, which the one process trains in too (`precision_context`)."""
    ref = load_module(model_path, dims, seed=opts.seed)
    optim = make_optimizer(ref.parameters(), opts)

    def step_loss() -> torch.Tensor:
        optim.zero_grad(set_to_none=True)
        if micro_batches == 1:
            with precision_context(dtype, torch.device("cpu")):
                loss = loss_of(ref(*batch))
            loss.backward()
            return loss.detach()
        total = torch.zeros(())
        for i in range(micro_batches):
            labels = None if loss_of.labels is None else micro_batch(loss_of.labels, i, micro_batches)
            with precision_context(dtype, torch.device("cpu")):
                part = loss_of.local(ref(*[micro_batch(x, i, micro_batches) for x in batch]), labels)
            part.backward()
            total = total + part.detach()
        return total

    for _ in range(offset):
        step_loss()
        optim.step()
    loss = step_loss()
    mine = [(n, p) for n, p in ordered_params(ref) if n in grads]
    grad_diff = max(float((grads[n] - full_grad(p)).abs().max()) for n, p in mine)
    optim.step()
    param_diff = max(float((after[n] - p.detach()).abs().max()) for n, p in mine)
    loss_diff = abs(float(loss) - dist_loss)
    for _ in range((1 + opts.warmup + opts.steps if steps is None else steps) - 1):
        step_loss()
        optim.step()
    final_diff = max(float((final[n] - p.detach()).abs().max()) for n, p in mine)
    out: dict[str, Any] = {
        "single_process_loss": float(loss), "loss_abs_diff": loss_diff, "grad_max_abs_diff": grad_diff,
        "param_max_abs_diff": param_diff, "final_param_max_abs_diff": final_diff,
        "max_abs_diff": max(loss_diff, grad_diff, param_diff, final_diff)}
    n_steps = 1 + opts.warmup + opts.steps if steps is None else steps
    tol = verify_tolerance(dtype, opts, float(loss), n_steps)
    if tol is not None:
        out["tolerance"] = tol
        out["within_tolerance"] = loss_diff <= tol["loss"] and grad_diff <= tol["grads"] and \
            param_diff <= tol["params_after_step"] and final_diff <= tol["params_after_run"]
    return out


def verify_tolerance(dtype: str, opts: RunOptions, loss: float, steps: int) -> dict[str, float] | None:
    """What bf16 arithmetic leaves between a distributed run and one process in the same precision
    (None: fp32, which agrees to rounding): the loss to 1e-3 of itself and the gradients to 1e-2, as
    each rank's bf16 matmuls round partial sums the one process rounds whole; the parameters to 2·lr a
    step, AdamW's update being about lr in size whatever the gradient's, so a gradient near zero whose
    sign the rounding flips moves its parameter by up to 2·lr (SGD: lr times the gradients' tolerance)."""
    if dtype not in AUTOCAST:
        return None
    per_step = 2 * opts.lr if opts.optimizer == "adamw" else opts.lr * 1e-2
    return {"loss": 1e-3 * max(abs(loss), 1.0), "grads": 1e-2, "params_after_step": per_step + 1e-6,
            "params_after_run": per_step * steps + 1e-6}
