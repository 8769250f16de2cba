"""The CLI's shared options and the parsers behind them (`cli.py` declares the commands)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from costmodel.buckets import CommFusion

F = TypeVar("F", bound=Callable[..., Any])


def parse_dims(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, int]:
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
    "--dim", "dims", multiple=True, callback=parse_dims, metavar="NAME=N",
    help="Bind a symbolic input dimension, e.g. --dim batch=8 --dim seq=1024 (repeatable).",
)


def parse_mesh_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    from core.mesh import MeshError

    parts = text.lower().replace("×", "x").split("x")
    if not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise MeshError(f"--mesh {text!r} does not parse; write sizes joined by x, e.g. 8x8")
    return tuple(int(p) for p in parts)


def build_mesh(devices: int, mesh: str | None, axis_names: str | None, devices_per_node: int) -> Any:
    from core.mesh import DeviceMesh

    names = tuple(n.strip() for n in axis_names.split(",")) if axis_names else None
    return DeviceMesh.build(devices, parse_mesh_shape(mesh), names, devices_per_node=devices_per_node)


def mesh_options(fn: F) -> F:
    for opt in reversed([
        click.option("--devices", type=int, required=True, help="Number of devices N."),
        click.option("--mesh", default=None, metavar="AxB", help="Mesh shape, e.g. 8x8 (default: 1-d over N)."),
        click.option("--axis-names", default=None, metavar="a,b", help="Mesh axis names (default dp or dp,tp)."),
        click.option("--profile", "profile_name", default="h100-sxm", show_default=True,
                     help="Hardware profile: a preset name or a JSON path."),
        click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
                     help="Training precision (default: bf16 on GPU profiles, fp32 on cpu)."),
    ]):
        fn = opt(fn)
    return fn


def precision_for(dtype: str | None, profile: Any) -> Any:
    from costmodel.memory import PRECISIONS

    if dtype is None:
        dtype = "bf16" if "bf16" in profile.device.peak_flops_per_s else "fp32"
    return PRECISIONS[dtype]


def parse_export_dims(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, int | None]:
    dims: dict[str, int | None] = {}
    for v in values:
        name, sep, num = v.partition("=")
        if not name or (sep and not num.strip().isdigit()):
            raise click.BadParameter(f"{v!r} is not NAME or NAME=N (e.g. --dim batch --dim seq=2048)")
        dims[name] = int(num) if sep else None
    return dims


def parse_pins(pins: tuple[str, ...], pin_file: str | None) -> dict[str, str]:
    from pathlib import Path

    from planner.search.solve import PinError

    out: dict[str, str] = {}
    if pin_file:
        try:
            data = json.loads(Path(pin_file).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PinError(f"--pin-file {pin_file}: {e}; write a JSON object such as {{\"ids\": \"S(0),R\"}}") from e
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise PinError(f"--pin-file {pin_file}: must map tensor names to placement strings, e.g. {{\"ids\": \"S(0),R\"}}")
        out.update(data)
    for p in pins:
        name, sep, spec = p.partition("=")
        if not sep or not name or not spec:
            raise PinError(f"--pin {p!r} is not TENSOR=PLACEMENTS (e.g. --pin ids=S(0),R)")
        out[name] = spec
    return out


_UNITS = {"B": 1, "KB": 2**10, "KIB": 2**10, "MB": 2**20, "MIB": 2**20, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str, option: str, *, allow_zero: bool = False) -> float:
    """"25MB" → bytes (binary units, as DDP's bucket_cap_mb and MindSpore's comm_fusion count them)."""
    from core.errors import MeshplanError

    t = text.strip().upper()
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if t.endswith(u)), "B")
    number = t[:len(t) - len(unit)] if t.endswith(unit) else t
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise MeshplanError(f"{option} {text}: give a size such as 25MB, 512KB or 1048576") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise MeshplanError(f"{option} {text}: give a positive size, e.g. 25MB")
    return value


def parse_zero(text: str) -> int | None:
    """`--zero 0|1|2|3|auto` → the stage, or None for auto."""
    from core.errors import MeshplanError

    t = text.strip().lower()
    if t == "auto":
        return None
    if t not in ("0", "1", "2", "3"):
        raise MeshplanError(f"--zero {text}: choose 0, 1, 2, 3 (ZeRO's stages) or auto")
    return int(t)


def parse_fusion(text: str) -> CommFusion | None:
    """`--comm-fusion` → bucket caps: "25MB" (every kind), "allreduce=25MB,allgather=50MB" (the kinds not
    named keep DDP's 25 MB), or "auto" (None: the planner chooses)."""
    from core.errors import MeshplanError
    from costmodel.buckets import FUSION_KINDS, CommFusion

    t = text.strip()
    if t.lower() == "auto":
        return None
    if "=" not in t:
        return CommFusion.uniform(parse_size(t, "--comm-fusion"))
    sizes: dict[str, float] = {}
    for item in t.split(","):
        kind, _, size = item.partition("=")
        kind = kind.strip().lower()
        if kind not in FUSION_KINDS or not size.strip():
            raise MeshplanError(f"--comm-fusion {text}: {item.strip()!r} is not KIND=SIZE with KIND one of "
                                f"{', '.join(FUSION_KINDS)} (e.g. allreduce=25MB,allgather=50MB), a size, or auto")
        sizes[kind] = parse_size(size, f"--comm-fusion {kind}")
    return CommFusion(**sizes)
