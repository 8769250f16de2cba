"""The executor's side of `profile calibrate`: the ranks that measure, and what only the executor
can measure about itself.

`calibrate` spawns the ranks (`executor/ranks.py`); each rank times the compute sweeps
(`hwprofiles/sweeps.py`) and the executor's own costs on tiny tensors, all ranks at once, keeps the
slowest rank's figures, then times the collectives (`hwprofiles/collective_sweeps.py`); the report and
the fitted profile are `hwprofiles/report.py`'s. The executor's costs:
- a DTensor redistribute against the same all-reduce through c10d → DTensor's host cost per reshard;
- 4 tiny transformer blocks and a one-matmul model trained by the executor (its SPMD runner,
  data-parallel over the ranks, under a data-parallel strategy the caller's planner builds by propagation), forward +
  backward, then the optimizer → the per-op cost (the CPU's "kernel launch"), the per-step cost, and
  AdamW's cost per parameter tensor and per step where it runs.
With --nproc 1, one process measures compute alone and the links come from `--base`.
"""

from __future__ import annotations

import datetime as dt
import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from core.graph import OpGraph
from executor.ranks import run_ranks
from hwprofiles.calibrate import CalibrationConfig, CalibrationError, ProgressFn
from hwprofiles.collective_sweeps import collective_times, fit_collectives
from hwprofiles.profile import HardwareProfile
from hwprofiles.report import CalibrationReport, build_profile, fill_compute
from hwprofiles.sweeps import compute_medians, reduce_max
from hwprofiles.timing import CacheScrub, device_for, time_interleaved, time_op
from planner.strategy import Strategy

# Builds the data-parallel strategy the executor's own costs are measured under (the caller passes the
# planner's `planner.search.baselines.data_parallel_strategy`: the executor never plans).
PlanDataParallel = Callable[[OpGraph, int], Strategy]


def calibrate(cfg: CalibrationConfig, progress: ProgressFn | None = None, *,
              plan_data_parallel: PlanDataParallel) -> tuple[HardwareProfile, CalibrationReport]:
    progress = progress or (lambda _label, _done, _total: None)
    t0 = time.perf_counter()
    report = CalibrationReport()
    if cfg.nproc >= 2:
        measure_on_ranks(cfg, report, progress, plan_data_parallel)  # compute and collectives, on all ranks at once
    else:  # one process alone: compute only, links from --base
        medians = compute_medians(cfg, device_for(cfg.backend, 0), progress)
        fill_compute(cfg, report, {**medians, **executor_medians(cfg, progress, medians["bare op"], plan_data_parallel)})
    report.elapsed_s = time.perf_counter() - t0
    return build_profile(cfg, report), report


def executor_medians(cfg: CalibrationConfig, progress: ProgressFn, bare_op_s: float,
                     plan_data_parallel: PlanDataParallel) -> dict[str, float]:
    """The executor's figures, by name: "graph op", "step overhead", "optimizer fixed", "optimizer per
    tensor" (`executor_step_costs`), "reshard" (`reshard_overhead_s`; the ranks run it together), "rank
    skew" and "collective wait" (`rank_skew`).
    Measured on CPUs only: with nccl a graph op costs a bare op (`bare_op_s`), and the profile prices
    the optimizer by its memory traffic."""
    if cfg.backend != "gloo":
        progress("compute", 3, 3)
        return {"graph op": bare_op_s, "step overhead": 0.0, "optimizer per tensor": 0.0, "optimizer fixed": 0.0,
                "reshard": 0.0, "rank skew": 0.0, "collective wait": 0.0}
    out = executor_step_costs(plan_data_parallel, min_time_s=1.5 if cfg.quick else 3.0)
    progress("compute", 2, 3)
    out["reshard"] = reshard_overhead_s()
    out["rank skew"], out["collective wait"] = rank_skew(min_time_s=1.5 if cfg.quick else 3.0)
    progress("compute", 3, 3)
    return out


def _rank(rank: int, n: int, port: int, cfg: CalibrationConfig, plan_data_parallel: PlanDataParallel,
          out: Any) -> None:
    """One spawned rank: compute (with every other rank, as training runs it: cores or GPUs sharing
    power, caches and memory), the slowest rank's medians; then the collectives."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(cfg.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                                timeout=dt.timedelta(seconds=120))
        device = device_for(cfg.backend, rank)
        say = (lambda *a: out.put(("progress", *a))) if rank == 0 else (lambda *a: None)
        medians = compute_medians(cfg, device, say)
        medians = reduce_max({**medians, **executor_medians(cfg, say, medians["bare op"], plan_data_parallel)})
        if rank == 0:
            out.put(("compute", medians))
        results = {} if cfg.compute_only else collective_times(cfg, rank, n, device, say)
        if rank == 0:
            out.put(("result", results))
        gc.collect()  # the executor's runs' cycles (their gloo work) gone before the process groups are
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # reported to the parent, which stops every rank
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from e


def measure_on_ranks(cfg: CalibrationConfig, report: CalibrationReport, progress: ProgressFn,
                     plan_data_parallel: PlanDataParallel) -> None:
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
        run_ranks(_rank, cfg.nproc, lambda r, port, out: (r, cfg.nproc, port, cfg, plan_data_parallel, out), handle,
                  timeout_s=cfg.timeout_s, error=CalibrationError, what="the benchmarks (try `quick`)")
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    fit_collectives(cfg, report, results)


# ---------------------------------------------------------------------------------------------
# The executor's own costs


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
    dt_s = statistics.median(time_op(through_dtensor, cpu, warmup=10, repeats=repeats))
    c10d_s = statistics.median(time_op(through_c10d, cpu, warmup=10, repeats=repeats))
    return max(0.0, dt_s - c10d_s)


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


def rank_skew(min_time_s: float = 3.0, segment_s: float = 2e-3) -> tuple[float, float]:
    """How a step's ranks meet, measured as they meet in one: every rank runs the same ~2 ms of
    matmuls, times it, and the ranks' times meet in an all-reduce, followed at once by a second one;
    over `min_time_s` of segments. Returns (skew, wait):

    - skew: how much later than the mean the slowest rank finishes the same work, Σ slowest / Σ mean
      − 1 (on this VM, cores that switch speeds every few seconds, independently); a step that
      synchronises waits that much beyond one rank's compute.
    - wait: what a collective entered after compute costs beyond the same collective entered back to
      back (the second all-reduce, as calibrate's collective sweeps time them) and beyond the skew,
      per call, averaged over the ranks: a rank blocked in a collective is woken late (gloo: 0.3 ms
      back to back, 1–2 ms after compute at the median, `python -m bench.run --only collectives`).

    (0, 0) without a process group."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return 0.0, 0.0
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    t0 = time.perf_counter()
    reps = 0
    while time.perf_counter() - t0 < segment_s:  # matmuls per segment, agreed by all ranks (the max)
        torch.matmul(a, b)
        reps += 1
    agreed = torch.tensor([reps], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    slowest = mean = 0.0
    after = back = 0.0  # this rank's seconds inside the first (after compute) and second all-reduces
    segments = 0
    start = time.perf_counter()
    going = True
    while going:
        t = time.perf_counter()
        for _ in range(int(agreed)):
            torch.matmul(a, b)
        took = time.perf_counter() - t
        top, total = torch.tensor([took], dtype=torch.float64), torch.tensor([took], dtype=torch.float64)
        t1 = time.perf_counter()
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        t2 = time.perf_counter()
        dist.all_reduce(total)
        after, back = after + t2 - t1, back + time.perf_counter() - t2
        slowest, mean = slowest + float(top), mean + float(total) / dist.get_world_size()
        segments += 1
        more = torch.tensor([int(time.perf_counter() - start < min_time_s)])
        dist.all_reduce(more, op=dist.ReduceOp.MIN)  # every rank stops after the same segment
        going = bool(int(more))
    inside = torch.tensor([after, back], dtype=torch.float64)
    dist.all_reduce(inside)  # summed over the ranks
    n = dist.get_world_size() * segments
    # The first all-reduce holds each rank for the slower ranks' compute (the skew: Σ slowest − Σ
    # mean over the ranks, on average) and for the wake-up; the second, for neither.
    wait = (float(inside[0]) - float(inside[1])) / n - (slowest - mean) / segments
    return (max(0.0, slowest / mean - 1.0) if mean > 0 else 0.0), max(0.0, wait)


def executor_step_costs(plan_data_parallel: PlanDataParallel, blocks: int = 4,
                        min_time_s: float = 3.0) -> dict[str, float]:
    """The executor's costs on tiny tensors, where they arise: `tiny_blocks_model` trained as the
    executor trains it, forward + backward then the optimizer step (AdamW), at `blocks` blocks and
    as a single matmul, their iterations interleaved (`_time_interleaved`). With a process group of
    2 or more ranks, through the executor's SPMD runner under a data-parallel plan over all of them (what
    `meshplan run` executes); alone, through the interpreter. Per op launch (the cost model charges
    3 per op: 1 forward, 2 backward): the two steps' difference over their launches' difference; per
    step: what the matmul's step takes beyond its 3 launches; likewise the optimizer per parameter
    tensor and per step. Measured in the step rather than in a loop of its own, AdamW took 31–50 µs
    per tensor here against 27; a real graph's fan-outs and views cost autograd more than a chain of
    ops does (7–12 µs per launch against 2.8 for an add/mul chain). Each iteration starts from cold
    caches (`CacheScrub`), as a real step's ops find them: 7.0 µs per launch here against 6.2 in a
    warm loop."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size() if dist.is_initialized() else 1
    small, large = _TinyBlocksStep(0, n, plan_data_parallel), _TinyBlocksStep(blocks, n, plan_data_parallel)
    time_interleaved({"small": small.iteration, "large": large.iteration}, torch.device("cpu"), min_time_s=min_time_s,
                      repeats=30, before=CacheScrub(torch.device("cpu")))
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

    def __init__(self, depth: int, n: int, plan_data_parallel: PlanDataParallel) -> None:
        import torch

        from executor.interpreter import OnnxModule
        from planner.graph import graph_from_proto

        model = tiny_blocks_model(depth, b=max(n, 2))  # one sequence per rank at least
        graph = graph_from_proto(model, {})
        self.module = OnnxModule(graph, model)
        self.x = torch.randn(*graph.tensors["x"].shape)
        self.runner = None
        if n > 1:
            from torch.distributed.device_mesh import init_device_mesh

            from executor.spmd import SpmdRunner

            self.runner = SpmdRunner(self.module, plan_data_parallel(graph, n), init_device_mesh("cpu", (n,)))
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
