"""`make bench`: the figures the issues ask for, measured on this machine, printed as tables.

    python -m bench.run [--only import] [--repeat N]

Each benchmark prints its median over `--repeat` runs and the spread (min–max).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from bench import zoo

console = Console()


def _timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_import(repeat: int) -> None:
    """ONNX import (load without weights, bind dims, infer shapes, classify, find layers)."""
    from planner.graph import load_graph

    table = Table(title=f"import: load_graph, median of {repeat}")
    for col in ("model", "nodes", "params", "layers", "median s", "min–max s"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for name in ("gpt2-medium", "llama3-8b", "llama3-70b"):
        path = zoo.export(name)
        dims = zoo.ZOO[name].default_dims
        graph = load_graph(path, dims)
        times = _timed(lambda p=path, d=dims: load_graph(p, d).layers, repeat)
        layers = ", ".join(f"{g.num_layers}×{g.nodes_per_layer}" for g in graph.layers[:2])
        table.add_row(name, str(len(graph.nodes)), f"{graph.num_params / 1e9:.2f} B", layers,
                      f"{statistics.median(times):.2f}", f"{min(times):.2f}–{max(times):.2f}")
    console.print(table)


BENCHMARKS: dict[str, Callable[[int], None]] = {"import": bench_import}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.run")
    ap.add_argument("--only", choices=list(BENCHMARKS), action="append")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    for name in args.only or list(BENCHMARKS):
        BENCHMARKS[name](args.repeat)


if __name__ == "__main__":
    main()
