"""The CLI's shared options and the parsers behind them (`cli.py` declares the commands)."""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from core.errors import MeshplanError
from core.levers import Attention, LeverError, LossKind, Mode, Runtime, Search

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
        click.option("--mesh", default=None, metavar="AxB",
                     help="Mesh shape, e.g. 8x8 (default: every N or N/t × t whose inner axis t fits a node)."),
        click.option("--axis-names", default=None, metavar="a,b", help="Mesh axis names (default dp or dp,tp)."),
        click.option("--profile", "profile_name", default="h100-sxm", show_default=True,
                     help="Hardware profile: a preset name or a JSON path."),
        click.option("--dtype", type=click.Choice(["amp", "mixed", "bf16", "fp16", "fp32"]), default=None,
                     help="Training precision: amp (torch.autocast bf16 over fp32 weights, gradients and "
                          "AdamW states), mixed (FSDP2's MixedPrecisionPolicy bf16/fp32: the model in bf16 on weights "
                          "cast where gathered, the same fp32 states), bf16 (Megatron's: bf16 weights, fp32 master weights in the optimizer), "
                          "fp16, fp32 (default: mixed on GPU profiles, fp32 on cpu)."),
    ]):
        fn = opt(fn)
    return fn


def precision_for(dtype: str | None, profile: Any) -> Any:
    from core.levers import default_dtype
    from costmodel.memory import PRECISIONS

    return PRECISIONS[dtype or default_dtype(profile.device.is_gpu).value]


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

    from planner.search.decisions import PinError

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


def plan_options(fn: F) -> F:
    """`meshplan plan`'s levers, after MODEL, --dim and the mesh options."""
    for opt in reversed([
        click.option("--mode", type=click.Choice([m.value for m in Mode]), default="auto",
                     show_default=True, help="auto: the ILP; semi: honour pins, decide the rest; data-parallel; stand-alone."),
        click.option("--search", type=click.Choice([s.value for s in Search]), default="ilp", show_default=True,
                     help="How auto/semi decide: the ILP, or greedy propagation (fast, no ILP)."),
        click.option("--pin", "pins", multiple=True, metavar="TENSOR=PLACEMENTS", help="Fix a tensor's placements (repeatable)."),
        click.option("--pin-file", default=None, help="JSON map of tensor → placements."),
        click.option("--memory-limit", "memory_limit", type=float, default=None, metavar="GIB",
                     help="Per-device memory limit in GiB (default: 90% of the device's capacity)."),
        click.option("--time-limit", type=float, default=60.0, show_default=True, metavar="S", help="Solver time limit."),
        click.option("--solver", type=click.Choice(["cbc", "cpsat", "scip", "highs"]), default="cbc", show_default=True),
        click.option("--workers", type=int, default=2, show_default=True,
                     help="Solver threads (CP-SAT; CBC runs one). The plan is the same whatever the count."),
        click.option("--no-follow", is_flag=True, help="Give every op its own decision (exact, slower)."),
        click.option("--no-all-to-all", is_flag=True, help="Reshard S(i)→S(j) by all_gather + slice."),
        click.option("--strict", is_flag=True, help="Fail if an op type has no sharding rule."),
        click.option("--loss", type=click.Choice([k.value for k in LossKind]), default="auto", show_default=True,
                     help="The training loss on the first output (auto: cross-entropy on logits, else mse)."),
        click.option("--global-batch-size", type=int, default=None, metavar="G",
                     help="Sequences per optimizer step, split into micro-steps (instead of --dim batch)."),
        click.option("--accumulation-steps", default="auto", show_default=True, metavar="K|auto",
                     help="Micro-steps per optimizer step with --global-batch-size (auto: the fewest that fit)."),
        click.option("--zero", "zero_stage", default="auto", show_default=True, metavar="0|1|2|3|auto",
                     help="ZeRO stage: 1 shards optimizer states over the data-parallel ranks, 2 gradients, 3 parameters; "
                       "auto: each parameter's stage chosen by the ILP."),
        click.option("--recompute", default="auto", show_default=True, metavar="none|selective|full|auto",
                     help="Activation recomputation of the repeated layers (auto: the ILP decides how many layers of each "
                       "group, only where memory needs it)."),
        click.option("--recompute-layers", type=int, default=None, metavar="N",
                     help="With --recompute full: only the first N layers of each group (Megatron's --recompute-num-layers)."),
        click.option("--gradient-accumulation-shard", "gradient_accumulation_shard", default="auto", show_default=True,
                     type=click.Choice(["auto", "on", "off"]),
                     help="Under ZeRO-1/2 with accumulation steps > 1 (MindSpore's gradient_accumulation_shard): on keeps "
                       "the accumulated gradient sharded, a reduce-scatter per micro-step (ZeRO-2); off keeps it whole, "
                       "reduced once (ZeRO-1); auto: the ILP's choice per parameter."),
        click.option("--dataset-strategy", "dataset_strategy", default="data_parallel", show_default=True,
                     metavar="data_parallel|full_batch|SPLITS",
                     help="How each rank reads its inputs (MindSpore's dataset_strategy): its data-parallel share, the "
                       "whole batch sliced after loading (the extra rows priced over the host link), or per-input "
                       "splits, one tuple of split counts per input, e.g. '((2, 1), (2, 1))' (the inputs placed so)."),
        click.option("--offload", default="none", show_default=True, metavar="none|optimizer|params,optimizer|activations|...|auto",
                     help="Model states in host memory: every parameter's optimizer states (optimizer, ZeRO-Offload), or "
                       "its weights, gradients and optimizer states (params,optimizer, FSDP2's CPUOffloadPolicy), the "
                       "optimizer step on the host; with activations (alone or after either), every layer's saved "
                       "activations not recomputed, copied to the host as saved and back for backward; auto: the ILP "
                       "decides per parameter and per layer group."),
        click.option("--comm-fusion", "comm_fusion", default="25MB", show_default=True, metavar="SIZE|KIND=SIZE,...|auto",
                     help="Bucket caps for gradient all-reduces and ZeRO's reduce-scatters and gathers (DDP's bucket_cap_mb, "
                       "MindSpore's comm_fusion): one size for all, per kind (allreduce=25MB,allgather=50MB,"
                       "reducescatter=25MB), or auto (the planner's choice)."),
        click.option("--zero-threshold", default="0", show_default=True, metavar="SIZE",
                     help="ZeRO-1/2 leave parameters smaller than this whole (MindSpore's parallel_optimizer_threshold)."),
        click.option("--zero-shard-size", type=int, default=None, metavar="N",
                     help="ZeRO-1/2 shard groups of N ranks inside the data-parallel group, the shard all-reduced across "
                       "them (MindSpore's optimizer_weight_shard_size)."),
        click.option("--gradients-sum", is_flag=True,
                     help="Sum gradients over the data-parallel ranks, each rank's loss the mean of its own batch "
                       "(MindSpore's gradients_mean=False; default: averaged)."),
        click.option("--parameter-broadcast", is_flag=True, help="Broadcast the parameters from rank 0 before training."),
        click.option("--pipeline-result-broadcast", is_flag=True,
                     help="A pipelined plan's loss broadcast from the last stage to every stage after each step."),
        click.option("--force-fp32-communication", is_flag=True,
                     help="All-reduces and reduce-scatters in fp32 whatever the training dtype (priced so)."),
        click.option("--overlap/--serial", default=None,
                     help="Price the step with gradient reductions and FSDP gathers overlapping compute, as NCCL "
                          "streams run them, or as their plain sum, the upper bound (the default: the search "
                          "minimises the sum, and the gloo executor runs it)."),
        click.option("--attention", type=click.Choice([a.value for a in Attention]), default="flash", show_default=True,
                     help="How the runtime runs attention: FlashAttention (scores on chip), torch's eager ops or "
                       "Megatron-LM's fused scale-mask-softmax (scores and probabilities through memory; priced per kernel)."),
        click.option("--runtime", type=click.Choice([r.value for r in Runtime]), default="eager", show_default=True,
                     help="How the framework runs the ops: eager (a kernel each) or compiled (torch.compile: the "
                          "element-wise ops between matmuls fused, one kernel per chain)."),
        click.option("--attention-dropout", type=float, default=0.0, metavar="P",
                     help="Dropout on the attention probabilities (priced where they are materialised)."),
        click.option("--capacity-factor", "capacity_factor", type=float, default=1.25, show_default=True, metavar="F",
                     help="Mixture-of-experts blocks: the tokens an expert is sized for, its uniform share times F "
                       "(the slowest expert's grouped GEMM bounds the block)."),
        click.option("--layout", default=None, metavar="dp_replicate=A,dp_shard=B,ep=E,cp=S,tp=C",
                     help="Hold the plan to a layout in torchtitan's degrees (ep borrows from dp_shard) and compare it "
                       "with the ILP's best."),
        click.option("--schedule", default=None, metavar="gpipe|1f1b|interleaved",
                     help="A pipeline layout's schedule (default 1f1b; interleaved with vpp)."),
        click.option("--cp-method", "cp_method", default=None, metavar="allgather|ring|auto",
                     help="With cp in --layout: attention's keys and values gathered over cp, passed around its "
                          "ring, or the faster as priced (default auto)."),
        click.option("--micro-batch-size", type=int, default=None, metavar="M",
                     help="Sequences per data-parallel rank per micro-step (with --global-batch-size and --layout)."),
        click.option("-o", "--out", "out_path", default=None, help="Strategy JSON to write (default: MODEL_STEM.strategy.json)."),
        click.option("--group-ckpt-out", "group_ckpt_out", default=None, metavar="FILE",
                     help="Write every process group the plan's run creates (mesh axes, pipeline stages, tied weights) "
                       "as rank lists with their purpose (MindSpore's group_ckpt_save_file); the executor checks at "
                       "start that it created these."),
        click.option("--strategy-out", default=None, metavar="FILE",
                     help="Also write a strategy checkpoint (MindSpore's strategy_ckpt_save_file): the strategy JSON, or "
                       "with --only-trainable-params the parameters' layout only."),
        click.option("--only-trainable-params", is_flag=True,
                     help="--strategy-out holds only the trainable parameters' placements and the mesh."),
        click.option("--strategy-in", default=None, metavar="FILE",
                     help="Hold the plan to a strategy checkpoint's parameter placements and mesh (a strategy JSON or "
                       "a --only-trainable-params file); the rest is planned anew."),
        click.option("--json", "as_json", is_flag=True, help="Print the strategy JSON instead of the summary."),
    ]):
        fn = opt(fn)
    return fn


def parse_strategy_in(path: str, model: str, dims: dict[str, int], shape: tuple[int, ...] | None,
                 names: tuple[str, ...] | None, devices: int) -> tuple[tuple[int, ...], tuple[str, ...], dict[str, str]]:
    """A strategy checkpoint's mesh and parameter placements, checked against the model and the flags."""
    from planner.graph import load_graph
    from planner.strategy_ckpt import held_to_layout, load_parameter_layout

    layout = load_parameter_layout(path)
    pins = held_to_layout(layout, load_graph(model, dims), path)
    n = 1
    for d in layout.mesh_shape:
        n *= d
    if n != devices:
        raise MeshplanError(f"--strategy-in {path} lays parameters out over {n} devices, not --devices {devices}; "
                            "plan for those devices, or without --strategy-in")
    if shape is not None and tuple(shape) != layout.mesh_shape:
        raise MeshplanError(f"--mesh {'x'.join(map(str, shape))} differs from --strategy-in {path}'s "
                            f"{'x'.join(map(str, layout.mesh_shape))}; drop --mesh")
    if names is not None and tuple(names) != layout.axis_names:
        raise MeshplanError(f"--axis-names {','.join(names)} differ from --strategy-in {path}'s "
                            f"{','.join(layout.axis_names)}; drop --axis-names")
    return layout.mesh_shape, layout.axis_names, pins


# The CLI's flag for each option the core names in its messages (as `name`: the PlanRequest field, the
# RunOptions field, the calibration's or the export's argument). The core never names a flag.
FLAGS = {
    "layout": "--layout", "global_batch_size": "--global-batch-size", "dims": "--dim", "memory_limit_gib": "--memory-limit",
    "pins": "--pin", "zero_stage": "--zero", "nproc": "--nproc", "mode": "--mode", "micro_batch_size": "--micro-batch-size",
    "accumulation_steps": "--accumulation-steps", "devices": "--devices", "base": "--base", "verify": "--verify",
    "strategy_in": "--strategy-in", "recompute_layers": "--recompute-layers", "mesh_shape": "--mesh",
    "zero_shard_size": "--zero-shard-size", "time_limit_s": "--time-limit", "strategy_out": "--strategy-out",
    "search": "--search", "save": "--save", "recompute": "--recompute", "offload": "--offload",
    "gradient_accumulation_shard": "--gradient-accumulation-shard", "dataset_strategy": "--dataset-strategy", "strict": "--strict", "steps": "--steps",
    "solver": "--solver", "schedule": "--schedule", "cp_method": "--cp-method", "optimizer": "--optimizer", "load": "--load", "hf_config": "--hf-config",
    "fusion": "--comm-fusion", "attention_dropout": "--attention-dropout", "capacity_factor": "--capacity-factor", "attention": "--attention", "workers": "--workers",
    "warmup": "--warmup", "profile": "--profile", "quick": "--quick", "compute_only": "--compute-only",
    "axis_names": "--axis-names", "dtype": "--dtype", "loss": "--loss", "zero_threshold_bytes": "--zero-threshold",
    "backend": "--backend", "runtime": "--runtime",
}
_OPTION = re.compile(r"`(" + "|".join(sorted(FLAGS, key=len, reverse=True)) + r")`")


def worded(message: str) -> str:
    """A core message as the CLI says it: each option it names (`name`) as its flag."""
    return _OPTION.sub(lambda m: FLAGS[m.group(1)], message)


def worded_error(e: MeshplanError) -> str:
    """The core names a lever by its API name; the CLI by its flag."""
    if isinstance(e, LeverError):
        return f"{FLAGS.get(e.lever, '--' + e.lever.replace('_', '-'))} {e.value}: choose one of {', '.join(e.choices)}"
    return worded(str(e))


def one_line_errors(fn: F) -> F:
    """A command whose MeshplanError prints one line, worded with the CLI's flags, and exits 2."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MeshplanError as e:
            click.echo(f"meshplan: error: {worded_error(e)}", err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


class OneLineGroup(click.Group):
    """The CLI's group: a usage error (a choice it does not take, a missing argument, an unknown
    option) is one line naming it and exit 2, as every other error is, not click's usage block."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("standalone_mode", None)
        try:
            return super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]
        except click.exceptions.NoArgsIsHelpError as e:  # `meshplan` alone: its help, as click prints it
            click.echo(e.format_message())
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"meshplan: error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            sys.exit(1)
