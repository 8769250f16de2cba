"""`meshplan profile calibrate`: microbenchmarks on this machine, fitted into a profile JSON.

What is measured (warm-up first, then repetitions; the median is kept, the spread reported):
- compute, measured on all ranks at once (as training runs it; the slowest rank's medians are kept):
  matmul sweep (one rank = one process with one thread on CPU, one GPU with nccl): n×n×n for a range
  of n → achieved FLOP/s per size → the efficiency curve P·F/(F + F½);
- memory copy of a large buffer → bandwidth (read + write bytes over time);
- 3×3 convolutions over channel counts → their efficiency by channels, P_c·d/(d + d½);
- a DTensor redistribute against the same all-reduce through c10d → DTensor's host cost per reshard;
- 4 tiny transformer blocks and a one-matmul model trained by the executor (its SPMD runner,
  data-parallel over the ranks), forward + backward, then the optimizer → the per-op cost (the
  CPU's "kernel launch"), the per-step cost, and AdamW's cost per parameter tensor and per step
  where it runs (a one-element torch op is reported for reference); AdamW on large tensors → its
  cost per parameter;
- all of a rank's compute figures timed interleaved (`_time_interleaved`): this VM's cores switch
  speed every few seconds;
- each collective over message sizes at the requested world size, ranks spawned here on 127.0.0.1
  with a free port; a repetition's time is the slowest rank's → α and β per collective (`fit.py`),
  and the raw table, which the cost model prefers inside its range.

Only this module (and the executor) imports torch, and only inside functions.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from costmodel.collectives import Collective, LinkLevel
from hwprofiles.fit import AlphaBetaFit, EfficiencyFit, fit_alpha_beta, fit_efficiency
from hwprofiles.profile import (
    HardwareProfile,
    load_profile,
    profile_from_json,
    profile_to_json,
)
from hwprofiles.ranks import run_ranks
from planner.errors import MeshplanError


class CalibrationError(MeshplanError):
    """The microbenchmarks could not run (bad options, a rank that failed or hung)."""


KiB, MiB = 1 << 10, 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationConfig:
    nproc: int = 2
    backend: str = "gloo"
    quick: bool = False
    base: str | None = None
    name: str | None = None
    timeout_s: float = 600.0
    compute_only: bool = False  # measure compute on all ranks at once; links from `base`

    def __post_init__(self) -> None:
        if self.compute_only and self.base is None:
            raise CalibrationError("--compute-only keeps another profile's links: pass --base NAME (a preset or a "
                                   "profile JSON calibrated on this machine)")
        if self.nproc < 1:
            raise CalibrationError(f"--nproc {self.nproc}: needs at least 1 rank (2 or more to measure collectives)")
        if self.nproc < 2 and self.base is None:
            raise CalibrationError(f"--nproc {self.nproc} measures no link; calibrate with --nproc 2 or more, or pass "
                                   "--base NAME to keep a preset's links")
        if self.backend not in ("gloo", "nccl"):
            raise CalibrationError(f"--backend {self.backend}: use gloo (CPU) or nccl (GPUs)")

    @property
    def message_sizes(self) -> list[int]:
        top = 16 * MiB if self.quick else 256 * MiB
        sizes, s = [], 4 * KiB
        while s <= top:
            sizes.append(s)
            s *= 4
        return sizes

    @property
    def matmul_sizes(self) -> list[int]:
        return [32, 64, 128, 256, 384, 512, 768] if self.quick else [32, 64, 128, 256, 384, 512, 768, 1024, 1536]

    @property
    def repeats(self) -> int:
        """Fewest timed repetitions per size (more are taken while `budget_s` allows)."""
        return 15 if self.quick else 25

    @property
    def max_repeats(self) -> int:
        return 300 if self.quick else 1000

    @property
    def budget_s(self) -> float:
        """Time spent timing one collective at one size."""
        return 0.2 if self.quick else 0.6


@dataclass(kw_only=True, slots=True)
class Measurement:
    kind: str
    size: float  # bytes for collectives, FLOPs for matmuls
    times_s: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def spread(self) -> float:
        """Interquartile range over the median."""
        if len(self.times_s) < 4:
            return (max(self.times_s) - min(self.times_s)) / self.median_s
        q = statistics.quantiles(self.times_s, n=4)
        return (q[2] - q[0]) / self.median_s


@dataclass(kw_only=True, slots=True)
class CalibrationReport:
    matmul: list[Measurement] = field(default_factory=list)
    efficiency: EfficiencyFit | None = None
    copy_bandwidth_bytes_per_s: float = 0.0
    op_overhead_s: float = 0.0  # the executor's per-op time: the profile's graph_op_overhead_s (gloo)
    elementwise_bandwidth_bytes_per_s: float = 0.0
    bare_op_s: float = 0.0  # a one-element torch op: the profile's kernel_launch_s
    conv: list[Measurement] = field(default_factory=list)  # size = channels
    conv_efficiency: EfficiencyFit | None = None  # achieved(d) = P·d/(d + d½), d = channels
    reshard_overhead_s: float = 0.0  # DTensor's redistribute beyond its collective (0: not measured)
    step_overhead_s: float = 0.0  # the executor's cost per training step beyond its ops
    optimizer_fixed_s: float = 0.0  # AdamW's step: per step, per tensor, per parameter
    optimizer_tensor_s: float = 0.0
    optimizer_param_s: float = 0.0
    collectives: dict[str, list[Measurement]] = field(default_factory=dict)
    fits: dict[str, AlphaBetaFit] = field(default_factory=dict)
    elapsed_s: float = 0.0


ProgressFn = Callable[[str, int, int], None]


# ---------------------------------------------------------------------------------------------
# Single-process benchmarks


def _device(backend: str, rank: int) -> Any:
    import torch

    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_op(fn: Callable[[], object], device: Any, *, warmup: int, repeats: int, min_time_s: float = 0.0) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_time_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _time_interleaved(fns: dict[str, Callable[[], object]], device: Any, *, min_time_s: float, repeats: int,
                      bursts: bool = True) -> dict[str, float]:
    """Median seconds of each function, in round-robin passes (at least `repeats`, and `min_time_s` in
    all). A shared VM's core alternates between speeds for seconds at a time (here: one state
    1.4–1.7× slower than the other, for 1–3 s); timed one after the other, each figure would catch
    one state at random, and their ratios (a curve, a difference) would be noise. Interleaved, every
    figure sees the same mix of states. In a pass each function runs a burst of about 2 ms, its
    first call untimed unless it is the only one: a small kernel is timed on warm caches, as it runs
    in a step right after the op producing its input, not after the previous function's sweep.
    Without `bursts`, one call each per pass (functions that form a sequence, e.g. a training step
    and its optimizer step)."""
    burst = {}
    for name, fn in fns.items():
        fn()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        burst[name] = max(1, min(1000, int(2e-3 / max(time.perf_counter() - t0, 1e-7)))) if bursts else 1
    times: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    passes = 0
    while passes < repeats or time.perf_counter() - start < min_time_s:
        passes += 1
        for name, fn in fns.items():
            for i in range(burst[name]):
                t0 = time.perf_counter()
                fn()
                _sync(device)
                if i > 0 or burst[name] == 1:
                    times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def compute_medians(cfg: CalibrationConfig, device: Any, progress: ProgressFn) -> dict[str, float]:
    """Median seconds by name: "matmul n" per size, "copy per byte" of a buffer copy, "bare op" (a
    one-element op), "element-wise per byte" of the kernel mix, "conv c" per channel count, the
    executor's "graph op", "step overhead", "optimizer fixed" and "optimizer per tensor"
    (`executor_step_costs`; gloo only, else zero or the bare op), "optimizer per parameter", and
    "reshard" (DTensor's cost per reshard; collective: the ranks run it together). Larger is slower,
    so the slowest rank's figures are a MAX-reduction away (`reduce_max`)."""
    import torch

    torch.set_num_threads(1)  # one rank = one process on one core
    dtype = torch.float32 if cfg.backend == "gloo" else torch.bfloat16
    fns: dict[str, Callable[[], object]] = {}
    for n in cfg.matmul_sizes:
        fns[f"matmul {n}"] = functools.partial(torch.matmul, torch.randn(n, n, device=device, dtype=dtype),
                                               torch.randn(n, n, device=device, dtype=dtype))
    nbytes = (32 if cfg.quick else 128) * MiB
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    fns["copy"] = functools.partial(dst.copy_, src)
    one = torch.ones(1, device=device)
    fns["bare op"] = functools.partial(one.add, 1.0)
    mix = elementwise_kernels(device)
    fns.update({f"element-wise {i}": fn for i, (fn, _) in enumerate(mix)})
    for c in CONV_CHANNELS:  # 3×3 convolutions, batch 8 at 32×32, c → c channels
        fns[f"conv {c}"] = functools.partial(torch.nn.functional.conv2d, torch.randn(8, c, 32, 32, device=device, dtype=dtype),
                                             torch.randn(c, c, 3, 3, device=device, dtype=dtype), padding=1)
    progress("compute", 0, 3)
    out = _time_interleaved(fns, device, min_time_s=1.5 if cfg.quick else 4.0, repeats=cfg.repeats)
    out["copy per byte"] = out.pop("copy") / (2 * nbytes)
    out["element-wise per byte"] = sum(out.pop(f"element-wise {i}") for i in range(len(mix))) / sum(b for _, b in mix)
    progress("compute", 1, 3)
    if cfg.backend == "gloo":
        out.update(executor_step_costs(min_time_s=1.5 if cfg.quick else 3.0))
    else:  # the executor's costs are measured on CPUs only (the profile then prices the optimizer by its traffic)
        out.update({"graph op": out["bare op"], "step overhead": 0.0, "optimizer per tensor": 0.0, "optimizer fixed": 0.0})
    out["optimizer per parameter"] = optimizer_param_s(device)
    progress("compute", 2, 3)
    out["reshard"] = reshard_overhead_s() if cfg.backend == "gloo" else 0.0
    progress("compute", 3, 3)
    return out


def reduce_max(medians: dict[str, float]) -> dict[str, float]:
    """Every figure at its slowest rank's value (all ranks measured the same names)."""
    import torch
    import torch.distributed as dist

    names = sorted(medians)
    values = torch.tensor([medians[k] for k in names], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(names, values.tolist(), strict=True))


CONV_CHANNELS = (8, 16, 32, 64, 128)


def _conv_flops(c: int) -> float:
    return 2.0 * 8 * 32 * 32 * c * c * 9


def fill_compute(cfg: CalibrationConfig, report: CalibrationReport, medians: dict[str, float]) -> None:
    report.matmul = [Measurement(kind="matmul", size=2.0 * n**3, times_s=[medians[f"matmul {n}"]])
                     for n in cfg.matmul_sizes]
    report.efficiency = fit_efficiency([m.size for m in report.matmul], [m.size / m.median_s for m in report.matmul])
    report.copy_bandwidth_bytes_per_s = 1.0 / medians["copy per byte"]
    report.bare_op_s, report.op_overhead_s = medians["bare op"], medians["graph op"]
    report.step_overhead_s = medians["step overhead"]
    report.optimizer_fixed_s = medians["optimizer fixed"]
    report.optimizer_tensor_s = medians["optimizer per tensor"]
    report.optimizer_param_s = medians["optimizer per parameter"]
    report.elementwise_bandwidth_bytes_per_s = 1.0 / medians["element-wise per byte"]
    report.conv = [Measurement(kind="conv", size=float(c), times_s=[medians[f"conv {c}"]]) for c in CONV_CHANNELS]
    report.reshard_overhead_s = medians["reshard"]
    report.conv_efficiency = fit_efficiency([m.size for m in report.conv],
                                            [_conv_flops(int(m.size)) / m.median_s for m in report.conv])


def measure_compute(cfg: CalibrationConfig, report: CalibrationReport, progress: ProgressFn) -> None:
    """One process alone (with --nproc 2 or more, the ranks measure compute together instead)."""
    fill_compute(cfg, report, compute_medians(cfg, _device(cfg.backend, 0), progress))


def elementwise_kernels(device: Any, elems: int = 1 << 16) -> list[tuple[Callable[[], object], float]]:
    """A mix of the element-wise kernels transformers run (add, mul, where, tanh, erf, exp, pow,
    softmax) on tensors of `elems` floats, each with the bytes it reads + writes: their summed bytes
    over their summed times is what the roofline's memory-bound side achieves for them (on a CPU
    core far below a copy's bandwidth)."""
    import torch

    x = torch.randn(elems, device=device)
    y = torch.randn(elems, device=device)
    mask = x > 0
    kernels: list[tuple[Callable[[], object], int]] = [  # (kernel, tensors read + written)
        (lambda: x + y, 3), (lambda: x * y, 3), (lambda: torch.where(mask, x, y), 4), (lambda: torch.tanh(x), 2),
        (lambda: torch.erf(x), 2), (lambda: torch.exp(x), 2), (lambda: torch.pow(x, 3.0), 2),
        (lambda: torch.softmax(x.view(-1, 256), -1), 2),
    ]
    return [(fn, tensors * elems * 4.0) for fn, tensors in kernels]


def reshard_overhead_s(elems: int = 1024, repeats: int = 200) -> float:
    """What DTensor adds to a collective (placement logic, functional collective, wait, wrapping):
    a partial → replicated redistribute of `elems` floats against the same all-reduce through c10d,
    medians of `repeats` each, on the default process group; 0 without one (a single process)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return 0.0
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.ones(elems)

    def through_dtensor() -> None:
        DTensor.from_local(x, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()

    def through_c10d() -> None:
        dist.all_reduce(x.clone())

    cpu = torch.device("cpu")
    dt_s = statistics.median(_time_op(through_dtensor, cpu, warmup=10, repeats=repeats))
    c10d_s = statistics.median(_time_op(through_c10d, cpu, warmup=10, repeats=repeats))
    return max(0.0, dt_s - c10d_s)


def optimizer_param_s(device: Any, small: int = 256, large: int = 1 << 17, tensors: int = 8) -> float:
    """The optimizer's time per parameter (torch's AdamW, one tensor at a time: its dozen kernels'
    memory traffic): `tensors` tensors of `large` floats against as many of `small` floats."""
    import torch

    def optimizer(numel: int) -> Callable[[], object]:
        params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn(numel, device=device)
        return torch.optim.AdamW(params, lr=1e-3, foreach=False).step

    t = _time_interleaved({"small": optimizer(small), "large": optimizer(large)}, device, min_time_s=0.5, repeats=20)
    return max(0.0, (t["large"] - t["small"]) / (tensors * (large - small)))


def tiny_blocks_model(blocks: int, b: int = 2, s: int = 4, h: int = 8, heads: int = 2) -> Any:
    """An ONNX model of `blocks` pre-norm transformer blocks (layer norm, q/k/v matmuls, head reshapes
    and transposes, softmax attention, residual adds, a GELU MLP; 0 blocks: a single matmul) on x of
    shape [b, s, h], written in ONNX ops as exporters write them; tiny, so that running it is almost
    all per-op overhead."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits: list[Any] = []
    nodes: list[Any] = []

    def const(name: str, value: Any) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(op_type: str, *inputs: str, **attrs: Any) -> str:
        out = f"v{len(nodes)}"
        nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"n{len(nodes)}", **attrs))
        return out

    def weight(name: str, rows: int, cols: int) -> str:
        return const(name, (0.1 * rng.standard_normal((rows, cols))).astype(np.float32))

    d = h // heads
    split, merge = const("split", np.array([b, s, heads, d], np.int64)), const("merge", np.array([b, s, h], np.int64))
    x = "x"
    for i in range(blocks):
        ln1 = op("LayerNormalization", x, const(f"g1_{i}", np.ones(h, np.float32)), const(f"b1_{i}", np.zeros(h, np.float32)),
                 axis=-1)
        q, k, v = (op("Transpose", op("Reshape", op("MatMul", ln1, weight(f"w{c}_{i}", h, h)), split), perm=[0, 2, 1, 3])
                   for c in "qkv")
        scores = op("Mul", op("MatMul", q, op("Transpose", k, perm=[0, 1, 3, 2])), const(f"scale_{i}", np.float32(d ** -0.5)))
        ctx = op("Reshape", op("Transpose", op("MatMul", op("Softmax", scores, axis=-1), v), perm=[0, 2, 1, 3]), merge)
        x = op("Add", x, op("MatMul", ctx, weight(f"wo_{i}", h, h)))
        ln2 = op("LayerNormalization", x, const(f"g2_{i}", np.ones(h, np.float32)), const(f"b2_{i}", np.zeros(h, np.float32)),
                 axis=-1)
        hidden = op("Gelu", op("Add", op("MatMul", ln2, weight(f"w1_{i}", h, 4 * h)), const(f"c1_{i}", np.zeros(4 * h, np.float32))))
        x = op("Add", x, op("MatMul", hidden, weight(f"w2_{i}", 4 * h, h)))
    if blocks == 0:  # the least a training step can be: one op on one parameter
        x = op("MatMul", x, weight("w", h, h))
    return helper.make_model(helper.make_graph(
        nodes, "blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, s, h])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [b, s, h])], initializer=inits),
        opset_imports=[helper.make_opsetid("", 20)])


def executor_step_costs(blocks: int = 4, min_time_s: float = 3.0) -> dict[str, float]:
    """The executor's costs on tiny tensors, where they arise: `tiny_blocks_model` trained as the
    executor trains it, forward + backward then the optimizer step (AdamW), at `blocks` blocks and
    as a single matmul, their iterations interleaved (`_time_interleaved`). With a process group of
    2 or more ranks, through the executor's SPMD runner under a data-parallel plan over all of them (what
    `meshplan run` executes); alone, through the interpreter. Per op launch (the cost model charges
    3 per op: 1 forward, 2 backward): the two steps' difference over their launches' difference; per
    step: what the matmul's step takes beyond its 3 launches; likewise the optimizer per parameter
    tensor and per step. Measured in the step rather than in a loop of its own, AdamW took 31–50 µs
    per tensor here against 27; a real graph's fan-outs and views cost autograd more than a chain of
    ops does (7–12 µs per launch against 2.8 for an add/mul chain)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size() if dist.is_initialized() else 1
    small, large = _TinyBlocksStep(0, n), _TinyBlocksStep(blocks, n)
    _time_interleaved({"small": small.iteration, "large": large.iteration}, torch.device("cpu"), min_time_s=min_time_s,
                      repeats=30)
    t = {"step 0": statistics.median(small.steps), "optimizer 0": statistics.median(small.updates),
         "step 1": statistics.median(large.steps), "optimizer 1": statistics.median(large.updates)}
    per_launch = (t["step 1"] - t["step 0"]) / (large.launches - small.launches)
    per_tensor = max(0.0, (t["optimizer 1"] - t["optimizer 0"]) / (large.tensors - small.tensors))
    return {"graph op": per_launch, "step overhead": max(0.0, t["step 0"] - per_launch * small.launches),
            "optimizer per tensor": per_tensor, "optimizer fixed": max(0.0, t["optimizer 0"] - per_tensor * small.tensors)}


class _TinyBlocksStep:
    """`tiny_blocks_model(depth)` set up for training as the executor runs it: data-parallel over the
    `n` ranks of the process group (alone: through the interpreter); `step` runs forward + backward
    up to the optimizer, `optim` is its AdamW, `iteration` runs both and records their times."""

    def __init__(self, depth: int, n: int) -> None:
        import tempfile

        import torch

        from executor.interpreter import OnnxModule
        from planner.graph import graph_from_proto

        model = tiny_blocks_model(depth, b=max(n, 2))  # one sequence per rank at least
        graph = graph_from_proto(model, {})
        self.module = OnnxModule(graph, model)
        self.x = torch.randn(*graph.tensors["x"].shape)
        self.runner = None
        if n > 1:
            import onnx
            from torch.distributed.device_mesh import init_device_mesh

            from executor.spmd import SpmdRunner
            from planner.plan import PlanRequest, make_plan

            with tempfile.TemporaryDirectory() as tmp:
                onnx.save(model, f"{tmp}/blocks.onnx")
                strategy, _ = make_plan(PlanRequest(model=f"{tmp}/blocks.onnx", profile="cpu", devices=n,
                                                    mesh_shape=(n,), mode="data-parallel"))
            self.runner = SpmdRunner(self.module, strategy, init_device_mesh("cpu", (n,)))
            self.x = self.runner.shard_inputs([self.x])[0]
        params = list(self.module.parameters())
        self.optim = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        self.launches, self.tensors = 3 * len(graph.compute_nodes), len(params)
        self.steps: list[float] = []  # seconds of each iteration's forward + backward, and optimizer step
        self.updates: list[float] = []

    def iteration(self) -> None:
        """One training iteration, its two parts timed."""
        t0 = time.perf_counter()
        self.step()
        t1 = time.perf_counter()
        self.optim.step()
        self.steps.append(t1 - t0)
        self.updates.append(time.perf_counter() - t1)

    def step(self) -> None:
        if self.runner is not None:
            self.runner.zero_grad()
            self.runner.forward([self.x])[0].sum().backward()
        else:
            self.module.zero_grad(set_to_none=True)
            self.module(self.x).sum().backward()


# ---------------------------------------------------------------------------------------------
# Collectives over spawned ranks


def _collective_fn(kind: Collective, size_bytes: int, rank: int, n: int, device: Any) -> Callable[[], object]:
    import torch
    import torch.distributed as dist

    elems = max(size_bytes // 4, n)
    elems -= elems % n  # divisible by n so that shards are equal
    if kind is Collective.ALL_REDUCE:
        t = torch.ones(elems, device=device)
        return lambda: dist.all_reduce(t)
    if kind is Collective.ALL_GATHER:  # S = the gathered output
        out, inp = torch.empty(elems, device=device), torch.ones(elems // n, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if kind is Collective.REDUCE_SCATTER:  # S = the input
        out, inp = torch.empty(elems // n, device=device), torch.ones(elems, device=device)
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: rs(out, inp)
    if kind is Collective.ALL_TO_ALL:
        out, inp = torch.empty(elems, device=device), torch.ones(elems, device=device)
        return lambda: dist.all_to_all_single(out, inp)
    if kind is Collective.BROADCAST:
        t = torch.ones(elems, device=device)
        return lambda: dist.broadcast(t, 0)
    # send_recv: ranks pair up (0↔1, 2↔3, …); an odd last rank idles.
    t = torch.ones(elems, device=device)
    peer = rank ^ 1
    if peer >= n:
        return lambda: None
    if rank % 2 == 0:
        return lambda: (dist.send(t, peer), dist.recv(t, peer))
    return lambda: (dist.recv(t, peer), dist.send(t, peer))


def _collective_worker(rank: int, n: int, port: int, cfg: CalibrationConfig, out: Any) -> None:
    backend, sizes, repeats, max_repeats, budget_s = (cfg.backend, cfg.message_sizes, cfg.repeats, cfg.max_repeats,
                                                      cfg.budget_s)
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                                timeout=dt.timedelta(seconds=120))
        device = _device(backend, rank)
        # Compute, measured on every rank at once as training runs it (cores or GPUs sharing power,
        # caches and memory): the slowest rank's medians.
        medians = reduce_max(compute_medians(cfg, device, (lambda *a: out.put(("progress", *a))) if rank == 0
                                             else (lambda *a: None)))
        if rank == 0:
            out.put(("compute", medians))
        results: dict[str, list[tuple[int, list[float]]]] = {}
        total, done = len(Collective) * len(sizes), 0
        for kind in () if cfg.compute_only else Collective:
            for size in sizes:
                fn = _collective_fn(kind, size, rank, n, device)
                for _ in range(2):
                    fn()
                _sync(device)
                # Every op is timed on its own: gloo's latency has a heavy tail (p90 up to 5× p50 here),
                # so a batch mean is unstable while the per-op median is not. The count comes from a
                # MAX-reduced probe, hence is the same on every rank.
                t0 = time.perf_counter()
                fn()
                _sync(device)
                probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(probe, op=dist.ReduceOp.MAX)
                count = int(min(max_repeats, max(repeats, budget_s // max(probe.item(), 1e-6))))
                mine = []
                dist.barrier()
                for _ in range(count):
                    t0 = time.perf_counter()
                    fn()
                    _sync(device)
                    mine.append(time.perf_counter() - t0)
                slowest = torch.tensor(mine, dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                results.setdefault(kind.value, []).append((size, slowest.tolist()))
                done += 1
                if rank == 0:
                    out.put(("progress", kind.value, done, total))
        if rank == 0:
            out.put(("result", results))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # reported to the parent, which stops every rank
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from e


def measure_collectives(cfg: CalibrationConfig, report: CalibrationReport, progress: ProgressFn) -> None:
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    results: dict[str, Any] = {}

    def handle(msg: tuple[Any, ...]) -> bool:
        if msg[0] == "progress":
            progress(msg[1], msg[2], msg[3])
        elif msg[0] == "compute":
            fill_compute(cfg, report, msg[1])
        else:  # ("result", collectives)
            results.update(msg[1])
            return True
        return False

    try:
        run_ranks(_collective_worker, cfg.nproc, lambda r, port, out: (r, cfg.nproc, port, cfg, out), handle,
                  timeout_s=cfg.timeout_s, error=CalibrationError, what="the benchmarks (try --quick)")
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    result = results
    for kind_name, rows in result.items():
        kind = Collective(kind_name)
        ms = [Measurement(kind=kind_name, size=float(s), times_s=t) for s, t in rows]
        report.collectives[kind_name] = ms
        report.fits[kind_name] = fit_alpha_beta(kind, cfg.nproc, [m.size for m in ms], [m.median_s for m in ms])


# ---------------------------------------------------------------------------------------------
# The profile


def _host() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores)"


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8.0 * (1 << 30)


def build_profile(cfg: CalibrationConfig, report: CalibrationReport) -> HardwareProfile:
    """A profile from the measurements. With `base`, the base's datasheet values stay where nothing
    was measured (peak FLOP/s, capacity, the network between nodes); without, this machine is the
    node and its loopback the only link."""
    import torch

    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    host = _host()
    tag = f"calibrated {now} on {host}, torch {torch.__version__}, {cfg.backend}, {cfg.nproc} ranks"
    assert report.efficiency is not None
    eff = report.efficiency

    def q(value: float, unit: str, what: str) -> dict[str, Any]:
        return {"value": value, "unit": unit, "source": f"{tag}: {what}"}

    link: dict[str, Any] | None = None
    if report.fits:
        p2p = report.fits[Collective.SEND_RECV.value]
        link = {"name": f"{cfg.backend} over loopback" if cfg.backend == "gloo" else "intra-node, measured",
                "bandwidth_bytes_per_s": q(p2p.bus_bandwidth_bytes_per_s, "B/s", "send/recv α-β fit"),
                "latency_s": q(p2p.alpha_s, "s", "send/recv α-β fit")}

    if cfg.base:
        data = profile_to_json(load_profile(cfg.base))
        data["name"] = cfg.name or f"{cfg.base}-calibrated"
        data["origin"] = {"kind": "calibrated", "date": now, "host": host, "base": cfg.base}
        dtype = "fp32" if cfg.backend == "gloo" else "bf16"
        peak = data["device"]["peak_flops_per_s"][dtype]["value"]
        if eff.peak_achieved_flops_per_s > peak:  # the base was measured slower (or its datasheet is wrong)
            peak = eff.peak_achieved_flops_per_s
            data["device"]["peak_flops_per_s"][dtype] = q(peak, "FLOP/s", "asymptote of the fitted matmul curve, "
                                                                           "above the base's")
        if link is not None:
            data["node"]["link"] = link
    else:
        if link is None:
            raise CalibrationError("--nproc 1 measures no link; calibrate with --nproc 2 or more, or pass --base")
        peak = eff.peak_achieved_flops_per_s
        assumed = "assumed: one machine, no inter-node link measured; equal to the loopback link"
        data = {
            "schema_version": 1,
            "name": cfg.name or "calibrated",
            "description": f"{host}: one rank = one process on one core, links = {cfg.backend} over loopback",
            "origin": {"kind": "calibrated", "date": now, "host": host},
            "device": {
                "name": f"CPU core ({host})",
                "peak_flops_per_s": {"fp32": q(peak, "FLOP/s", "asymptote of the fitted matmul curve")},
                "mem_capacity_bytes": q(_memory_bytes() / cfg.nproc, "B", "physical memory / ranks"),
            },
            "node": {"devices_per_node": q(os.cpu_count() or 1, "1", "cores on this machine"), "link": link},
            "network": {"name": "none (single machine)",
                        "bandwidth_bytes_per_s": {**link["bandwidth_bytes_per_s"], "source": assumed},
                        "latency_s": {**link["latency_s"], "source": assumed}},
        }
    dev = data["device"]
    dev["mem_bandwidth_bytes_per_s"] = q(report.copy_bandwidth_bytes_per_s, "B/s", "buffer copy, read + write")
    dev["elementwise_bandwidth_bytes_per_s"] = q(report.elementwise_bandwidth_bytes_per_s, "B/s",
                                                 "element-wise kernel mix (add, mul, where, tanh, erf, exp, pow, "
                                                 "softmax) on 64k floats, bytes in + out per second")
    dev["kernel_launch_s"] = q(report.bare_op_s, "s", "median time of a one-element op")
    if report.reshard_overhead_s > 0:
        dev["reshard_overhead_s"] = q(report.reshard_overhead_s, "s", "DTensor partial → replicated redistribute of "
                                      "4 KiB minus the same all-reduce through c10d, medians")
    if cfg.backend == "gloo":
        how = ("tiny transformer blocks trained by the meshplan executor (data-parallel over the ranks), forward + "
               "backward of 4 blocks and of one matmul")
        dev["graph_op_overhead_s"] = q(report.op_overhead_s, "s", f"{how}: their difference per op launch (3 per op)")
        dev["step_overhead_s"] = q(report.step_overhead_s, "s", f"{how}: the matmul's step beyond its launches")
        in_step = ("torch AdamW (one tensor at a time) in the training step of 4 tiny transformer blocks and "
                   "of one matmul")
        dev["optimizer_step"] = {
            "fixed_s": q(report.optimizer_fixed_s, "s", f"{in_step}: the matmul's beyond one tensor"),
            "tensor_s": q(report.optimizer_tensor_s, "s", f"{in_step}: their difference per tensor"),
            "param_s": q(report.optimizer_param_s, "s", "torch AdamW (one tensor at a time): 8 tensors of 128 Ki "
                         "floats against 8 of 256, per parameter")}
    dev["matmul_efficiency"] = {
        "max_fraction": q(min(1.0, eff.peak_achieved_flops_per_s / peak), "1", "matmul sweep fit"),
        "half_flops": q(eff.half_flops, "FLOP", "matmul sweep fit"),
    }
    if report.conv_efficiency is not None:
        ce = report.conv_efficiency
        what = "3×3 convolution sweep (batch 8, 32×32, 8–128 channels) fit, by channels"
        dev["conv_efficiency"] = {"max_fraction": q(ce.peak_achieved_flops_per_s / peak, "1", what),
                                  "half_channels": q(ce.half_flops, "1", what)}
    colls = data.setdefault("collectives", {}).setdefault(LinkLevel.INTRA_NODE.value, {})
    for kind_name, fit in report.fits.items():
        colls[kind_name] = {
            "alpha_s": q(fit.alpha_s, "s", "α-β fit"),
            "bus_bandwidth_bytes_per_s": q(fit.bus_bandwidth_bytes_per_s, "B/s", "α-β fit"),
            "table": [{"ranks": cfg.nproc, "bytes": m.size, "seconds": m.median_s} for m in report.collectives[kind_name]],
        }
    return profile_from_json(data, origin_hint="calibrated profile")


def calibrate(cfg: CalibrationConfig, progress: ProgressFn | None = None) -> tuple[HardwareProfile, CalibrationReport]:
    progress = progress or (lambda _label, _done, _total: None)
    t0 = time.perf_counter()
    report = CalibrationReport()
    if cfg.nproc >= 2:
        measure_collectives(cfg, report, progress)  # compute too, on all ranks at once
    else:
        measure_compute(cfg, report, progress)
    report.elapsed_s = time.perf_counter() - t0
    return build_profile(cfg, report), report


def plot_report(report: CalibrationReport, profile: HardwareProfile, path: Path) -> None:
    """Measurements (points, with the spread as error bars) against the fitted models (lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    kinds = list(report.collectives)
    fig, axes = plt.subplots(2, 4, figsize=(16, 7.5))
    flat = axes.ravel()
    for ax, kind_name in zip(flat, kinds, strict=False):
        ms = report.collectives[kind_name]
        sizes = np.array([m.size for m in ms])
        med = np.array([m.median_s for m in ms])
        err = np.array([m.spread * m.median_s / 2 for m in ms])
        model = profile.collectives[(LinkLevel.INTRA_NODE, Collective(kind_name))]
        xs = np.geomspace(sizes.min(), sizes.max(), 100)
        n = next(iter(p.ranks for p in model.table), 2)
        fit = [model.alpha_beta_time_s(Collective(kind_name), x, n) for x in xs]
        ax.errorbar(sizes, med, yerr=err, fmt="o", label="measured (median, IQR)")
        ax.plot(xs, fit, "-", label=f"α-β fit ({report.fits[kind_name].median_rel_error:.0%} median error)")
        ax.set(xscale="log", yscale="log", title=f"{kind_name}, {n} ranks", xlabel="message bytes", ylabel="seconds")
        ax.legend(fontsize=7)
    ax = flat[len(kinds)]
    f = np.array([m.size for m in report.matmul])
    ach = np.array([m.size / m.median_s for m in report.matmul])
    assert report.efficiency is not None
    fs = np.geomspace(f.min(), f.max(), 100)
    e = report.efficiency
    ax.plot(f, ach / 1e9, "o", label="measured")
    ax.plot(fs, e.peak_achieved_flops_per_s * fs / (fs + e.half_flops) / 1e9, "-",
            label=f"P·F/(F+F½) ({e.median_rel_error:.0%} median error)")
    ax.set(xscale="log", title="matmul", xlabel="FLOPs per matmul", ylabel="achieved GFLOP/s")
    ax.legend(fontsize=7)
    for extra in flat[len(kinds) + 1:]:
        extra.axis("off")
    fig.suptitle(f"meshplan calibration — {profile.name}: {profile.origin.get('host', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def report_json(report: CalibrationReport) -> dict[str, Any]:
    return {
        "elapsed_s": report.elapsed_s,
        "matmul": [{"flops": m.size, "median_s": m.median_s, "spread": m.spread} for m in report.matmul],
        "efficiency_fit_median_rel_error": report.efficiency.median_rel_error if report.efficiency else None,
        "copy_bandwidth_bytes_per_s": report.copy_bandwidth_bytes_per_s,
        "op_overhead_s": report.op_overhead_s,
        "bare_op_s": report.bare_op_s,
        "elementwise_bandwidth_bytes_per_s": report.elementwise_bandwidth_bytes_per_s,
        "conv": [{"channels": m.size, "median_s": m.median_s} for m in report.conv],
        "reshard_overhead_s": report.reshard_overhead_s,
        "step_overhead_s": report.step_overhead_s,
        "optimizer_step": {"fixed_s": report.optimizer_fixed_s, "tensor_s": report.optimizer_tensor_s,
                           "param_s": report.optimizer_param_s},
        "conv_efficiency_fit_median_rel_error": report.conv_efficiency.median_rel_error if report.conv_efficiency else None,
        "collectives": {
            k: {"alpha_s": report.fits[k].alpha_s, "bus_bandwidth_bytes_per_s": report.fits[k].bus_bandwidth_bytes_per_s,
                "median_rel_error": report.fits[k].median_rel_error,
                "points": [{"bytes": m.size, "median_s": m.median_s, "spread": m.spread} for m in ms]}
            for k, ms in report.collectives.items()
        },
    }


def dump_report(report: CalibrationReport, path: Path) -> None:
    path.write_text(json.dumps(report_json(report), indent=1) + "\n")
