"""Compute sweeps of `profile calibrate`, one rank's: matmuls over sizes, a buffer copy, a one-element
op, a mix of element-wise kernels, 3×3 convolutions over channel counts, and AdamW per parameter,
all timed interleaved (`timing.time_interleaved`); the slowest rank's figures by `reduce_max`.
The executor's own costs (per op, per step, per reshard) are measured by the executor
(`executor/calibrate.py`) and join these medians there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hwprofiles.calibrate import CalibrationConfig, MiB, ProgressFn
from hwprofiles.timing import CacheScrub, time_interleaved

CONV_CHANNELS = (8, 16, 32, 64, 128)
# Matmuls with one narrow dim (768 × d · d × 768, and 768 × 768 · 768 × d): a hidden size of 64, an
# attention head of 16 run below the square-matmul curve at the same FLOPs.
NARROW_DIMS = (8, 16, 32, 64, 128, 256)
NARROW_SIDE = 768


def narrow_flops(d: int) -> float:
    """FLOPs of the sweep's matmuls with narrow dim d (both shapes: 2·768·768·d)."""
    return 2.0 * NARROW_SIDE * NARROW_SIDE * d


def conv_flops(c: int) -> float:
    """FLOPs of the sweep's 3×3 convolution at c → c channels (batch 8, 32×32)."""
    return 2.0 * 8 * 32 * 32 * c * c * 9


def compute_medians(cfg: CalibrationConfig, device: Any, progress: ProgressFn) -> dict[str, float]:
    """Median seconds by name: "matmul n" per size, "copy per byte" of a buffer copy, "bare op" (a
    one-element op), "element-wise per byte" of the kernel mix, "element-wise OP per byte" and
    "backward OP per byte" (per byte its forward moves) by op type, "conv c" per channel count and
    "optimizer per parameter". Larger is slower, so the slowest rank's figures are a MAX-reduction
    away (`reduce_max`). The executor adds its own figures (`executor/calibrate.py`)."""
    import torch

    torch.set_num_threads(1)  # one rank = one process on one core
    dtype = torch.float32 if cfg.backend == "gloo" else torch.bfloat16
    fns: dict[str, Callable[[], object]] = {}
    # (A GPU's compute is measured by `gpu_sweeps`, which replaces these figures; under nccl they are
    # taken only beside the collectives, at the CPU's sizes.)
    for n in cfg.matmul_sizes:
        fns[f"matmul {n}"] = functools.partial(torch.matmul, torch.randn(n, n, device=device, dtype=dtype),
                                               torch.randn(n, n, device=device, dtype=dtype))
    nbytes = (32 if cfg.quick else 128) * MiB
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    fns["copy"] = functools.partial(dst.copy_, src)
    one = torch.ones(1, device=device)
    fns["bare op"] = functools.partial(one.add, 1.0)
    kernels = elementwise_kernels(device)
    fns.update({f"element-wise {op}": fn for op, (fn, _) in kernels.items()})
    for tag, elems in BACKWARD_SIZES.items():  # the difference of two sizes: autograd's per-call cost out
        fns.update({f"backward {op} {tag}": fn for op, fn in elementwise_backward_kernels(device, elems).items()})
    wide = NARROW_SIDE
    for d in NARROW_DIMS:  # the narrow dim inner (k), then outer (n)
        fns[f"narrow k {d}"] = functools.partial(torch.matmul, torch.randn(wide, d, device=device, dtype=dtype),
                                                 torch.randn(d, wide, device=device, dtype=dtype))
        fns[f"narrow n {d}"] = functools.partial(torch.matmul, torch.randn(wide, wide, device=device, dtype=dtype),
                                                 torch.randn(wide, d, device=device, dtype=dtype))
    for c in CONV_CHANNELS:  # 3×3 convolutions, batch 8 at 32×32, c → c channels
        fns[f"conv {c}"] = functools.partial(torch.nn.functional.conv2d, torch.randn(8, c, 32, 32, device=device, dtype=dtype),
                                             torch.randn(c, c, 3, 3, device=device, dtype=dtype), padding=1)
    progress("compute", 0, 3)
    out = time_interleaved(fns, device, min_time_s=1.5 if cfg.quick else 4.0, repeats=cfg.repeats)
    out["copy per byte"] = out.pop("copy") / (2 * nbytes)
    times = {op: out.pop(f"element-wise {op}") for op in kernels}
    out["element-wise per byte"] = sum(times[op] for op in MIX) / sum(kernels[op][1] for op in MIX)
    out.update({f"element-wise {op} per byte": times[op] / kernels[op][1] for op in kernels})
    more = BACKWARD_SIZES["large"] - BACKWARD_SIZES["small"]
    for op, (_, tensors) in _elementwise_ops().items():  # seconds per byte the forward moved; 0: lost in noise
        extra = out.pop(f"backward {op} large") - out.pop(f"backward {op} small")
        out[f"backward {op} per byte"] = max(extra, 0.0) / (tensors * more * 4.0)
    out["optimizer per parameter"] = optimizer_param_s(device)
    progress("compute", 1, 3)
    return out


def reduce_max(medians: dict[str, float]) -> dict[str, float]:
    """Every figure at its slowest rank's value (all ranks measured the same names)."""
    import torch
    import torch.distributed as dist

    names = sorted(medians)
    values = torch.tensor([medians[k] for k in names], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(names, values.tolist(), strict=True))


# Element-wise backwards are timed at two sizes (floats per input): per byte, their difference.
BACKWARD_SIZES = {"large": 1 << 16, "small": 1 << 12}
# The kernel mix whose summed bytes over summed times is the profile's element-wise bandwidth (the
# rate of op types not measured one by one).
MIX = ("Add", "Mul", "Where", "Tanh", "Erf", "Exp", "Pow", "Softmax")
# ONNX op types priced at another op's measured kernel (`elementwise_kernels` measures the others by
# their own name).
ELEMENTWISE_ALIASES = {"Sub": "Add"}


def _elementwise_ops() -> dict[str, tuple[Callable[..., Any], float]]:
    """The element-wise kernels transformers run, by the ONNX op type each stands for: a function of
    (x, y, pos, mask) — two inputs, a positive one, a boolean one — and the tensors it reads + writes,
    in units of one input."""
    import torch
    import torch.nn.functional as F

    def rows(x: Any) -> Any:
        return x.view(-1, 256)

    def stats(x: Any) -> Any:  # per channel: running mean and variance, scale, shift
        return torch.ones(16, device=x.device)

    return {
        "Add": (lambda x, y, p, m: x + y, 3), "Mul": (lambda x, y, p, m: x * y, 3),
        "Div": (lambda x, y, p, m: x / p, 3), "Where": (lambda x, y, p, m: torch.where(m, x, y), 4),
        "Tanh": (lambda x, y, p, m: torch.tanh(x), 2), "Erf": (lambda x, y, p, m: torch.erf(x), 2),
        "Exp": (lambda x, y, p, m: torch.exp(x), 2), "Pow": (lambda x, y, p, m: torch.pow(x, 3.0), 2),
        "Sqrt": (lambda x, y, p, m: torch.sqrt(p), 2), "Sigmoid": (lambda x, y, p, m: torch.sigmoid(x), 2),
        "Softmax": (lambda x, y, p, m: torch.softmax(rows(x), -1), 2),
        "ReduceMean": (lambda x, y, p, m: rows(x).mean(-1), 1 + 1 / 256),
        "LayerNormalization": (lambda x, y, p, m: F.layer_norm(rows(x), (256,)), 2),
        "Relu": (lambda x, y, p, m: torch.relu(x), 2), "Neg": (lambda x, y, p, m: torch.neg(x), 2),
        "Gelu": (lambda x, y, p, m: F.gelu(x), 2),
        # ONNX's default (training_mode 0, what exports write): the running statistics' affine map.
        "BatchNormalization": (lambda x, y, p, m: F.batch_norm(x.view(16, 16, -1, 16), stats(x), stats(x), stats(x),
                                                               stats(x), training=False), 2),
        "Concat": (lambda x, y, p, m: torch.cat([x, y]), 4),
    }


def _pool(device: Any, elems: int, pool: int, grad: bool) -> list[tuple[Any, Any, Any, Any]]:
    import torch

    out: list[tuple[Any, Any, Any, Any]] = []
    for _ in range(pool):
        x, y = torch.randn(elems, device=device), torch.randn(elems, device=device)
        out.append((x.requires_grad_(grad), y.requires_grad_(grad), (x.detach().abs() + 1.0).requires_grad_(grad),
                    x.detach() > 0))
    return out


def elementwise_kernels(device: Any, elems: int = 1 << 16, pool: int = 128) -> dict[str, tuple[Callable[[], object], float]]:
    """Each op of `_elementwise_ops` on tensors of `elems` floats, with the bytes it reads + writes:
    bytes over time is what the roofline's memory-bound side achieves for that op (on a CPU core far
    below a copy's bandwidth, and a tanh at a thirtieth of an add's rate). Each call reads the next of
    `pool` inputs (32 MiB of each kind, past the caches), as a model's ops read what the ops before
    them wrote: a kernel timed on one input kept in cache runs its memory-bound ops 2–3× faster than
    they run in a step."""
    inputs = _pool(device, elems, pool, grad=False)
    turn = [0]

    def call(fn: Callable[..., Any]) -> Callable[[], object]:
        def run() -> object:
            turn[0] = (turn[0] + 1) % pool
            return fn(*inputs[turn[0]])
        return run

    return {op: (call(fn), tensors * elems * 4.0) for op, (fn, tensors) in _elementwise_ops().items()}


def elementwise_backward_kernels(device: Any, elems: int, pool: int = 16) -> dict[str, Callable[[], object]]:
    """Each op of `_elementwise_ops`'s backward through autograd (the gradient kernels torch runs for
    it: tanh's is a multiply-add on its output, not a tanh) on tensors of `elems` floats, every float
    input needing a gradient, each call the next of `pool` recorded forwards (the ops share the
    inputs; with their outputs, past the core's caches)."""
    import torch

    inputs = _pool(device, elems, pool, grad=True)
    kernels: dict[str, Callable[[], object]] = {}
    for op, (fn, _) in _elementwise_ops().items():
        recorded: list[tuple[Any, tuple[Any, ...], Any]] = []
        for x, y, p, m in inputs:
            out = fn(x, y, p, m)
            recorded.append((out, (x, y, p), torch.randn_like(out)))
        turn = [0]

        def run(recorded: list[Any] = recorded, turn: list[int] = turn) -> object:
            turn[0] = (turn[0] + 1) % len(recorded)
            out, leaves, grad = recorded[turn[0]]
            return torch.autograd.grad(out, leaves, grad, retain_graph=True, allow_unused=True)

        kernels[op] = run
    return kernels


def optimizer_param_s(device: Any, small: int = 256, large: int = 1 << 17, tensors: int = 8) -> float:
    """The optimizer's time per parameter (torch's AdamW, one tensor at a time: its dozen kernels'
    memory traffic): `tensors` tensors of `large` floats against as many of `small` floats, each call
    from cold caches on a CPU."""
    import torch

    def optimizer(numel: int) -> Callable[[], object]:
        params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn(numel, device=device)
        return torch.optim.AdamW(params, lr=1e-3, foreach=False).step

    # From cold caches on a CPU (`CacheScrub`): in a step, the states were last touched a step ago.
    t = time_interleaved({"small": optimizer(small), "large": optimizer(large)}, device, min_time_s=0.5, repeats=20,
                         before=CacheScrub(device) if device.type == "cpu" else None)
    return max(0.0, (t["large"] - t["small"]) / (tensors * (large - small)))
