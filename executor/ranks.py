"""Local ranks: spawn N processes on 127.0.0.1 (a free port), supervise them, stop them all.

Used by the executor's `run` and by `profile calibrate` (executor/calibrate.py). A rank reports
through the queue it is given; a message ("error", rank, text) from any rank, a rank that dies, or
the time limit stops every rank and raises one error naming which and why.

Each rank's allocator keeps the memory it frees (glibc: tensors up to 32 MiB from the heap, which is
never trimmed), as CPU training guides advise (or jemalloc/tcmalloc): a training step frees and
reallocates the same buffers every step, and returning them to the kernel makes every step fault
its pages in again. On this 2-core VM, where the two ranks' page faults also contend, that costs
10–25% of a step (convnet 24 → 19 ms, gpt2-tiny 18 → 15 ms, `meshplan run` at 30 steps). Settings
already in the environment are kept.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import time
from collections.abc import Callable
from typing import Any

from core.errors import MeshplanError

# Read by glibc when a rank's interpreter starts (M_MMAP_THRESHOLD's ceiling is 32 MiB on 64-bit).
RANK_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(target: Callable[..., None], nproc: int, make_args: Callable[[int, int, Any], tuple[Any, ...]],
              handle: Callable[[tuple[Any, ...]], bool], *, timeout_s: float, error: type[MeshplanError],
              what: str) -> None:
    """Start `target(*make_args(rank, port, queue))` on every rank; feed each message to `handle`
    until it returns True (done); then wait for the ranks to exit."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=make_args(r, port, out), daemon=True) for r in range(nproc)]
    try:
        with _environment(RANK_ENV):  # spawned interpreters inherit it
            for p in procs:
                p.start()
        deadline = time.monotonic() + timeout_s
        done = False
        while not done:
            if time.monotonic() > deadline:
                raise error(f"{what} did not finish in {timeout_s:.0f} s; check the ranks or allow more time")
            try:
                msg = out.get(timeout=0.5)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise error(f"rank {dead[0][0]} exited with code {dead[0][1]} before reporting") from None
                continue
            if msg[0] == "error":
                raise error(f"rank {msg[1]} failed: {msg[2]}")
            done = handle(msg)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Any:
    """Set what is not set yet, for the processes started inside; restored after."""
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
