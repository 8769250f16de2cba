"""`python -m bench.run --only collectives`: what a gloo collective costs inside a step against what
calibrate measures. calibrate times each collective back to back (the ranks arrive together, the
collective's threads are warm); in a training step it follows compute, and each rank arrives when its
own compute ends. Here: a reduce-scatter and an all-reduce of 64 KiB on 2 ranks, back to back and
after a burst of matmuls (about 5 ms, the ranks released together by a barrier before it), each rank's
time inside the collective (median, mean). The difference is what the cost model does not price yet:
the wait for the slower rank and the collective's cold start (README, fidelity)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

CASES = ("back to back", "after compute")


def _rank(rank: int, port: int, numel: int, rounds: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    flat, half = torch.randn(numel), torch.empty(numel // 2)
    a, b = torch.randn(256, 256), torch.randn(256, 1024)
    result: dict[str, tuple[float, float]] = {}
    for kind, run in (("reduce_scatter", lambda: dist.reduce_scatter_tensor(half, flat)),
                      ("all_reduce", lambda: dist.all_reduce(flat))):
        for case in CASES:
            times = []
            for i in range(rounds + 20):  # the first 20: warm-up
                dist.barrier()
                if case == "after compute":
                    for _ in range(4):
                        a @ b
                t0 = time.perf_counter()
                run()
                if i >= 20:
                    times.append(time.perf_counter() - t0)
            result[f"{kind}, {case}"] = (statistics.median(times), statistics.mean(times))
    out.put((rank, result))
    dist.destroy_process_group()


def measure(numel: int = 16384, rounds: int = 300) -> dict[str, list[tuple[float, float]]]:
    """Per case, each rank's (median, mean) seconds inside the collective."""
    from core.errors import MeshplanError
    from executor.ranks import run_ranks

    got: dict[int, dict[str, tuple[float, float]]] = {}

    def handle(msg: tuple[Any, ...]) -> bool:
        got[msg[0]] = msg[1]
        return len(got) == 2

    run_ranks(_rank, 2, lambda r, port, out: (r, port, numel, rounds, out), handle, timeout_s=300,
              error=MeshplanError, what="the collective benchmark")
    return {case: [got[r][case] for r in range(2)] for case in got[0]}


def bench_collective_wait(console: Any, repeat: int) -> None:
    from rich.table import Table

    table = Table(title="gloo, 2 ranks, 64 KiB: ms inside the collective per rank (median / mean of 300), "
                        f"{repeat} run(s)")
    for col in ("collective", "rank 0", "rank 1"):
        table.add_column(col)
    for _ in range(repeat):
        for case, ranks in measure().items():
            table.add_row(case, *(f"{m * 1e3:.2f} / {x * 1e3:.2f}" for m, x in ranks))
    console.print(table)
