"""meshplan — how should I shard this model on these devices, and how fast and big is one step?

The `meshplan` console script. Each command is thin: parse, call the stage, render. Errors a user
can cause (`MeshplanError`) print as one line on stderr and exit 2; nothing here imports torch.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from planner.errors import MeshplanError

F = TypeVar("F", bound=Callable[..., Any])
console = Console()
err_console = Console(stderr=True)


def _parse_dims(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for v in values:
        name, sep, num = v.partition("=")
        if not sep or not name or not num.strip().lstrip("-").isdigit():
            raise click.BadParameter(f"{v!r} is not NAME=N (e.g. --dim batch=8)")
        if name in dims:
            raise click.BadParameter(f"{name} is bound twice")
        dims[name] = int(num)
    return dims


dim_option = click.option(
    "--dim", "dims", multiple=True, callback=_parse_dims, metavar="NAME=N",
    help="Bind a symbolic input dimension, e.g. --dim batch=8 --dim seq=1024 (repeatable).",
)


def _fmt_count(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f}"


def _fmt_bytes(x: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def _one_line_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MeshplanError as e:
            err_console.print(f"meshplan: error: {e}", markup=False, highlight=False, soft_wrap=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="meshplan")
def main() -> None:
    """Plan how to shard a model (ONNX) over a device mesh, and predict one training step."""


@main.command()
@click.argument("model", type=click.Path(dir_okay=True, path_type=str))
@dim_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@_one_line_errors
def inspect(model: str, dims: dict[str, int], as_json: bool) -> None:
    """Import MODEL (.onnx) and report ops, parameters, forward FLOPs, inputs/outputs and repeated layers."""
    from costmodel.summary import graph_summary
    from planner.graph import load_graph

    summary = graph_summary(load_graph(model, dims))
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    _render_summary(summary)


def _render_summary(s: dict[str, Any]) -> None:
    head = Table(title=f"{s['model']}  (opset {s['opset']}, fingerprint {s['fingerprint']})", show_header=False)
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_row("nodes (compute / constant)", f"{s['nodes']} ({s['compute_nodes']} / {s['constant_nodes']})")
    head.add_row("parameters", f"{s['parameters']:,} in {s['parameter_tensors']} tensors")
    head.add_row("parameter bytes", _fmt_bytes(s["parameter_bytes"]))
    head.add_row("forward FLOPs (matmul-class)", _fmt_count(s["flops_forward"]))
    head.add_row("forward FLOPs (other ops)", _fmt_count(s["flops_forward_other"]))
    head.add_row("bound dims", ", ".join(f"{k}={v}" for k, v in s["dims"].items()) or "none (static)")
    console.print(head)

    io = Table(title="inputs and outputs")
    for col in ("", "name", "shape", "dtype"):
        io.add_column(col)
    for kind in ("inputs", "outputs"):
        for t in s[kind]:
            io.add_row(kind[:-1], t["name"], "×".join(map(str, t["shape"])) or "scalar", t["dtype"])
    console.print(io)

    ops = Table(title="compute ops")
    ops.add_column("op type")
    ops.add_column("count", justify="right")
    for op, n in s["op_types"].items():
        ops.add_row(op, str(n))
    console.print(ops)

    layers = Table(title="repeated layers (tied by the solver)")
    for col in ("prefix", "layers", "ops per layer"):
        layers.add_column(col)
    for g in s["layers"]:
        idx = g["indices"]
        layers.add_row(g["prefix"], f"{g['num_layers']} ({min(idx)}..{max(idx)})", str(g["nodes_per_layer"]))
    if not s["layers"]:
        layers.add_row("none found", "", "")
    console.print(layers)


if __name__ == "__main__":
    main()
