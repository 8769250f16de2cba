"""HardwareProfile: what one kind of node can do — devices, links, and collectives per link level.

A profile is a JSON file (schema `profile.schema.json`, version 1) in which every number is a
quantity `{"value": …, "unit": …, "source": …}`: datasheet values name their datasheet, fitted values
say "calibrated …" with the date and the machine. The loader is strict: structure is checked with the
JSON Schema, then every dataclass validates its own fields in `__post_init__`; the first problem is
raised as one `ProfileError` naming the field. Data only: the formulas that read these numbers are
the cost model's (`costmodel/device.py`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from types import MappingProxyType
from typing import Any

import jsonschema

from core.collectives import Collective, LinkLevel
from core.errors import ProfileError
from hwprofiles.curves import (
    ATTENTION_FIELDS,
    AttentionCurve,
    ChannelCurve,
    EfficiencyCurve,
    OptimizerStep,
    check_positive,
)

SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class TablePoint:
    ranks: int
    size_bytes: float
    time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveModel:
    """α-β model of one collective on one link level, with an optional measured table."""

    alpha_s: float
    bus_bandwidth_bytes_per_s: float
    table: tuple[TablePoint, ...] = ()

    def __post_init__(self) -> None:
        check_positive(self, "alpha_s", allow_zero=True)
        check_positive(self, "bus_bandwidth_bytes_per_s")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    name: str
    peak_flops_per_s: Mapping[str, float]  # by dtype: "fp32", "tf32", "bf16", "fp16", "fp8"
    mem_bandwidth_bytes_per_s: float
    mem_capacity_bytes: float
    kernel_launch_s: float
    matmul_efficiency: EfficiencyCurve
    # What element-wise kernels achieve (bytes in + out per second); None: the memory bandwidth.
    elementwise_bandwidth_bytes_per_s: float | None = None
    # Per-launch cost of an op of the model's graph where an executor adds its own work to the
    # kernel's (CPU: the interpreter and autograd's bookkeeping); None: the kernel launch. Plain
    # kernels (the optimizer's, the loss's) cost `kernel_launch_s`.
    graph_op_overhead_s: float | None = None
    conv_efficiency: ChannelCurve | None = None  # None: convolutions run like matmuls of their FLOPs
    # Matmuls by the narrowest dim of each GEMM (`ChannelCurve`, channels = that dim), calibrated: a
    # 64-wide or 16-wide GEMM runs below the square-matmul curve at the same FLOPs. None: by FLOPs only.
    matmul_narrow_efficiency: ChannelCurve | None = None
    # Host time an executor spends issuing one reshard collective beyond the collective itself
    # (DTensor's redistribute: placement logic, functional collective, wait); None: nothing.
    reshard_overhead_s: float | None = None
    # An executor's host time per training step beyond its ops (autograd's engine, bookkeeping);
    # None: nothing.
    step_overhead_s: float | None = None
    # The optimizer step, calibrated; None: priced from its memory traffic and kernel launches.
    optimizer_step: OptimizerStep | None = None
    # What element-wise kernels achieve by ONNX op type (bytes in + out per second), calibrated: on a
    # CPU core an erf or a pow runs at a fraction of an add's rate. Op types not listed: the mix's.
    elementwise_by_op: Mapping[str, float] | None = None
    # A GEMM whose k or n (the dims its operands and result are laid out along) is a multiple of only
    # this many bytes runs at this fraction of the aligned rate (tensor cores load 16-byte rows: on an
    # H100 a bf16 LM head with vocab 50257, 2-byte aligned, runs at 0.17 of vocab 50304's). By
    # alignment in bytes (2, 4, 8); a dim aligned to 16 bytes or more, and alignments not listed, at 1.
    matmul_alignment: Mapping[int, float] | None = None
    # A dtype's own GEMM curve, calibrated (fp32 GEMMs run on CUDA cores, not tensor cores: they
    # saturate sooner and at another fraction of their datasheet peak); dtypes not listed:
    # `matmul_efficiency`.
    matmul_efficiency_by_dtype: Mapping[str, EfficiencyCurve] | None = None
    # The host issues kernels ahead of the device (CUDA streams): an op costs the longer of its kernel
    # and its launch, not their sum, and a view (no kernel) costs the device nothing. False (a CPU
    # rank): the host runs the kernels, so an op costs its launch plus its work.
    async_launch: bool = False
    # FlashAttention's measured rates, forward and backward (`AttentionCurve`); None: its FLOPs priced
    # as matmuls.
    attention_forward: AttentionCurve | None = None
    attention_backward: AttentionCurve | None = None
    # What their backwards achieve, by op type (bytes the forward moved per second of backward, every
    # float input needing a gradient), calibrated: torch's gradient kernels are not the forward's — a
    # tanh's is a multiply-add on its output (0.2× the forward's time here), a pow's a pow and two
    # multiplies (5×). Op types not listed: 2× the forward's time.
    elementwise_backward_by_op: Mapping[str, float] | None = None
    # How much later than the mean the slowest rank finishes the same work between two collectives (a
    # fraction), measured: a step that synchronises waits that much beyond its compute. None: 0.
    rank_skew: float | None = None
    # What one collective call costs, as a step makes it (entered after compute), beyond the same
    # collective back to back as the link tables time it and beyond the skew's wait, measured: a rank
    # blocked in the collective is woken late (gloo on this 2-core VM: 0.1–0.8 ms measured). None: 0.
    collective_wait_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops_per_s", MappingProxyType(dict(self.peak_flops_per_s)))
        for name in ("elementwise_by_op", "elementwise_backward_by_op"):
            rates = getattr(self, name)
            if rates is not None:
                object.__setattr__(self, name, MappingProxyType(dict(rates)))
                for op, v in rates.items():
                    if not v > 0:
                        raise ValueError(f"{name}.{op}: must be a positive number, got {v!r}")
        if "fp32" not in self.peak_flops_per_s:
            raise ValueError("peak_flops_per_s.fp32: every device needs an fp32 peak")
        for dtype, v in self.peak_flops_per_s.items():
            if not v > 0:
                raise ValueError(f"peak_flops_per_s.{dtype}: must be a positive number, got {v!r}")
        check_positive(self, "mem_bandwidth_bytes_per_s")
        check_positive(self, "mem_capacity_bytes")
        check_positive(self, "kernel_launch_s", allow_zero=True)
        if self.elementwise_bandwidth_bytes_per_s is not None:
            check_positive(self, "elementwise_bandwidth_bytes_per_s")
        if self.graph_op_overhead_s is not None:
            check_positive(self, "graph_op_overhead_s", allow_zero=True)
        if self.reshard_overhead_s is not None:
            check_positive(self, "reshard_overhead_s", allow_zero=True)
        if self.step_overhead_s is not None:
            check_positive(self, "step_overhead_s", allow_zero=True)
        if self.rank_skew is not None:
            check_positive(self, "rank_skew", allow_zero=True)
        if self.collective_wait_s is not None:
            check_positive(self, "collective_wait_s", allow_zero=True)

    @property
    def elementwise_bytes_per_s(self) -> float:
        return self.elementwise_bandwidth_bytes_per_s or self.mem_bandwidth_bytes_per_s

    def elementwise_rate(self, op_type: str) -> float:
        """Bytes in + out per second an element-wise kernel of this ONNX op type achieves."""
        by_op = self.elementwise_by_op
        return by_op.get(op_type, self.elementwise_bytes_per_s) if by_op else self.elementwise_bytes_per_s

    def elementwise_backward_rate(self, op_type: str) -> float | None:
        """Forward bytes per second of this ONNX op type's backward (every float input needing a
        gradient), where calibrated; None: not measured."""
        by_op = self.elementwise_backward_by_op
        return by_op.get(op_type) if by_op else None

    @property
    def graph_op_s(self) -> float:
        return self.kernel_launch_s if self.graph_op_overhead_s is None else self.graph_op_overhead_s

    @property
    def is_gpu(self) -> bool:
        """A device with bf16 tensor cores (every GPU preset); a CPU profile lists fp32 only."""
        return "bf16" in self.peak_flops_per_s

    def matmul_curve(self, dtype: str) -> EfficiencyCurve:
        """The GEMM efficiency curve matmuls in `dtype` run on."""
        own = self.matmul_efficiency_by_dtype
        return own.get(dtype, self.matmul_efficiency) if own else self.matmul_efficiency

    def alignment_fraction(self, align_bytes: int) -> float:
        """The fraction of the aligned GEMM rate at a k or n aligned to `align_bytes` bytes (one the
        profile did not measure: as the nearest smaller alignment it did, so the table stays monotone)."""
        table = self.matmul_alignment
        if not table or align_bytes >= 16:
            return 1.0
        below = [b for b in table if b <= align_bytes]  # unmeasured: as the nearest worse alignment measured
        return table[max(below)] if below else table[min(table)]

    def peak_for(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype; fp32 matmuls use tf32 tensor cores where the device has them."""
        return self.peak_flops_per_s.get(dtype, self.peak_flops_per_s["fp32"])

@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    name: str
    bandwidth_bytes_per_s: float  # per device, per direction
    latency_s: float
    rails: int = 1

    def __post_init__(self) -> None:
        check_positive(self, "bandwidth_bytes_per_s")
        check_positive(self, "latency_s", allow_zero=True)
        if self.rails < 1:
            raise ValueError(f"rails: must be at least 1, got {self.rails}")


@dataclass(frozen=True, kw_only=True, slots=True)
class HostSpec:
    """The host a device offloads to: its copies to and from pinned host memory (one device copying
    alone, per direction; all the node's devices copying at once, in all) and the optimizer step run
    on its CPU cores (AdamW on one device's share of them)."""

    copy_bandwidth_bytes_per_s: float
    optimizer_step: OptimizerStep
    node_copy_bandwidth_bytes_per_s: float | None = None  # None: no shared limit below the devices' own
    node_memory_bytes: float | None = None  # the node's host memory, its devices' share each; None: not bounded

    def __post_init__(self) -> None:
        check_positive(self, "copy_bandwidth_bytes_per_s")
        for name in ("node_copy_bandwidth_bytes_per_s", "node_memory_bytes"):
            if getattr(self, name) is not None:
                check_positive(self, name)

    def copy_rate(self, copying: int) -> float:
        """Bytes per second each of `copying` devices of one node moves when all copy at once."""
        node = self.node_copy_bandwidth_bytes_per_s
        return min(self.copy_bandwidth_bytes_per_s, node / copying) if node is not None else \
            self.copy_bandwidth_bytes_per_s


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    name: str
    description: str
    origin: Mapping[str, str]  # {"kind": "datasheet"|"calibrated", "date": …, "host": …}
    device: DeviceSpec
    devices_per_node: int
    links: Mapping[LinkLevel, LinkSpec]
    collectives: Mapping[tuple[LinkLevel, Collective], CollectiveModel]
    sources: Mapping[str, str] = field(default_factory=dict)  # dotted field path → where the number comes from
    host: HostSpec | None = None  # None: nothing may be offloaded to the host

    def __post_init__(self) -> None:
        if self.devices_per_node < 1:
            raise ValueError(f"node.devices_per_node: must be at least 1, got {self.devices_per_node}")
        for level in LinkLevel:
            if level not in self.links:
                raise ValueError(f"{'node.link' if level is LinkLevel.INTRA_NODE else 'network'}: missing")
        # A collective the file does not list is priced from its link: α = latency, β = link bandwidth.
        full = dict(self.collectives)
        for level in LinkLevel:
            link = self.links[level]
            for kind in Collective:
                full.setdefault((level, kind), CollectiveModel(alpha_s=link.latency_s,
                                                               bus_bandwidth_bytes_per_s=link.bandwidth_bytes_per_s))
        object.__setattr__(self, "collectives", MappingProxyType(full))
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))
        object.__setattr__(self, "origin", MappingProxyType(dict(self.origin)))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    @property
    def host_memory_per_device(self) -> float | None:
        """A device's share of its node's host memory (the node's devices each hold as much), where the
        profile states it: a job's devices are taken to be a node's, and all of the memory usable."""
        if self.host is None or self.host.node_memory_bytes is None:
            return None
        return self.host.node_memory_bytes / self.devices_per_node

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(profile_to_json(self), sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# JSON


@cache
def _schema() -> dict[str, Any]:
    return json.loads(resources.files("hwprofiles").joinpath("profile.schema.json").read_text())


_UNITS = {
    "peak_flops_per_s": "FLOP/s", "mem_bandwidth_bytes_per_s": "B/s", "mem_capacity_bytes": "B", "kernel_launch_s": "s",
    "graph_op_overhead_s": "s", "reshard_overhead_s": "s", "step_overhead_s": "s", "fixed_s": "s", "tensor_s": "s",
    "param_s": "s", "elementwise_bandwidth_bytes_per_s": "B/s", "max_fraction": "1", "half_flops": "FLOP",
    "half_channels": "1", "devices_per_node": "1", "bandwidth_bytes_per_s": "B/s", "latency_s": "s", "rails": "1",
    "alpha_s": "s", "bus_bandwidth_bytes_per_s": "B/s", "elementwise_by_op": "B/s", "elementwise_backward_by_op": "B/s",
    "rank_skew": "1", "collective_wait_s": "s", "matmul_alignment": "1", "flops_per_s": "FLOP/s",
    "half_seq": "1", "half_head_dim": "1", "causal_fraction": "1", "copy_bandwidth_bytes_per_s": "B/s",
    "node_copy_bandwidth_bytes_per_s": "B/s", "node_memory_bytes": "B"}


class _Reader:
    """Reads quantities out of the JSON, checking units and collecting sources by field path."""

    def __init__(self) -> None:
        self.sources: dict[str, str] = {}

    def q(self, obj: Mapping[str, Any], key: str, path: str) -> float:
        quantity = obj[key]
        parent = path.split(".")[-2]
        unit_key = parent if parent in ("peak_flops_per_s", "elementwise_by_op", "elementwise_backward_by_op",
                                          "matmul_alignment") else key
        expected = _UNITS[unit_key]
        if quantity["unit"] != expected:
            raise ProfileError(f"field {path}: unit must be {expected!r}, got {quantity['unit']!r}")
        self.sources[path] = quantity["source"]
        return float(quantity["value"])


def _attention(r: _Reader, dev: Mapping[str, Any], key: str) -> AttentionCurve | None:
    if key not in dev:
        return None
    return AttentionCurve(**{k: r.q(dev[key], k, f"device.{key}.{k}") for k in ATTENTION_FIELDS})


def profile_from_json(data: Mapping[str, Any], *, origin_hint: str = "profile") -> HardwareProfile:
    try:
        jsonschema.validate(data, _schema())
    except jsonschema.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        raise ProfileError(f"{origin_hint}: field {where}: {e.message}") from e
    if data["schema_version"] != SCHEMA_VERSION:
        raise ProfileError(f"{origin_hint}: schema_version {data['schema_version']} is not {SCHEMA_VERSION}")
    r = _Reader()
    try:
        dev = data["device"]
        eff = dev["matmul_efficiency"]
        device = DeviceSpec(
            name=dev["name"],
            peak_flops_per_s={k: r.q(dev["peak_flops_per_s"], k, f"device.peak_flops_per_s.{k}")
                              for k in dev["peak_flops_per_s"]},
            mem_bandwidth_bytes_per_s=r.q(dev, "mem_bandwidth_bytes_per_s", "device.mem_bandwidth_bytes_per_s"),
            mem_capacity_bytes=r.q(dev, "mem_capacity_bytes", "device.mem_capacity_bytes"),
            kernel_launch_s=r.q(dev, "kernel_launch_s", "device.kernel_launch_s"),
            elementwise_bandwidth_bytes_per_s=(r.q(dev, "elementwise_bandwidth_bytes_per_s",
                                                   "device.elementwise_bandwidth_bytes_per_s")
                                               if "elementwise_bandwidth_bytes_per_s" in dev else None),
            graph_op_overhead_s=(r.q(dev, "graph_op_overhead_s", "device.graph_op_overhead_s")
                                 if "graph_op_overhead_s" in dev else None),
            reshard_overhead_s=(r.q(dev, "reshard_overhead_s", "device.reshard_overhead_s")
                                if "reshard_overhead_s" in dev else None),
            step_overhead_s=(r.q(dev, "step_overhead_s", "device.step_overhead_s") if "step_overhead_s" in dev else None),
            rank_skew=r.q(dev, "rank_skew", "device.rank_skew") if "rank_skew" in dev else None,
            collective_wait_s=(r.q(dev, "collective_wait_s", "device.collective_wait_s")
                               if "collective_wait_s" in dev else None),
            elementwise_by_op=({k: r.q(dev["elementwise_by_op"], k, f"device.elementwise_by_op.{k}")
                                for k in dev["elementwise_by_op"]} if "elementwise_by_op" in dev else None),
            elementwise_backward_by_op=({k: r.q(dev["elementwise_backward_by_op"], k,
                                                f"device.elementwise_backward_by_op.{k}")
                                         for k in dev["elementwise_backward_by_op"]}
                                        if "elementwise_backward_by_op" in dev else None),
            async_launch=bool(dev.get("async_launch", False)),
            attention_forward=_attention(r, dev, "attention_forward"),
            attention_backward=_attention(r, dev, "attention_backward"),
            matmul_efficiency_by_dtype=({k: EfficiencyCurve(
                max_fraction=r.q(c, "max_fraction", f"device.matmul_efficiency_by_dtype.{k}.max_fraction"),
                half_flops=r.q(c, "half_flops", f"device.matmul_efficiency_by_dtype.{k}.half_flops"))
                for k, c in dev["matmul_efficiency_by_dtype"].items()} if "matmul_efficiency_by_dtype" in dev else None),
            matmul_alignment=({int(k): r.q(dev["matmul_alignment"], k, f"device.matmul_alignment.{k}")
                               for k in dev["matmul_alignment"]} if "matmul_alignment" in dev else None),
            optimizer_step=(OptimizerStep(**{k: r.q(dev["optimizer_step"], k, f"device.optimizer_step.{k}")
                                             for k in ("fixed_s", "tensor_s", "param_s")})
                            if "optimizer_step" in dev else None),
            matmul_narrow_efficiency=(ChannelCurve(
                max_fraction=r.q(dev["matmul_narrow_efficiency"], "max_fraction",
                                 "device.matmul_narrow_efficiency.max_fraction"),
                half_channels=r.q(dev["matmul_narrow_efficiency"], "half_channels",
                                  "device.matmul_narrow_efficiency.half_channels"))
                if "matmul_narrow_efficiency" in dev else None),
            conv_efficiency=(ChannelCurve(
                max_fraction=r.q(dev["conv_efficiency"], "max_fraction", "device.conv_efficiency.max_fraction"),
                half_channels=r.q(dev["conv_efficiency"], "half_channels", "device.conv_efficiency.half_channels"))
                if "conv_efficiency" in dev else None),
            matmul_efficiency=EfficiencyCurve(
                max_fraction=r.q(eff, "max_fraction", "device.matmul_efficiency.max_fraction"),
                half_flops=r.q(eff, "half_flops", "device.matmul_efficiency.half_flops"),
            ),
        )
        links = {
            LinkLevel.INTRA_NODE: _link(r, data["node"]["link"], "node.link"),
            LinkLevel.INTER_NODE: _link(r, data["network"], "network"),
        }
        collectives: dict[tuple[LinkLevel, Collective], CollectiveModel] = {}
        for level_name, per_kind in data.get("collectives", {}).items():
            level = LinkLevel(level_name)
            for kind_name, c in per_kind.items():
                path = f"collectives.{level_name}.{kind_name}"
                collectives[(level, Collective(kind_name))] = CollectiveModel(
                    alpha_s=r.q(c, "alpha_s", f"{path}.alpha_s"),
                    bus_bandwidth_bytes_per_s=r.q(c, "bus_bandwidth_bytes_per_s", f"{path}.bus_bandwidth_bytes_per_s"),
                    table=tuple(TablePoint(ranks=int(p["ranks"]), size_bytes=float(p["bytes"]),
                                           time_s=float(p["seconds"])) for p in c.get("table", [])),
                )
        host = data.get("host")
        return HardwareProfile(
            host=HostSpec(
                copy_bandwidth_bytes_per_s=r.q(host, "copy_bandwidth_bytes_per_s", "host.copy_bandwidth_bytes_per_s"),
                node_copy_bandwidth_bytes_per_s=(r.q(host, "node_copy_bandwidth_bytes_per_s",
                                                     "host.node_copy_bandwidth_bytes_per_s")
                                                 if "node_copy_bandwidth_bytes_per_s" in host else None),
                node_memory_bytes=(r.q(host, "node_memory_bytes", "host.node_memory_bytes")
                                   if "node_memory_bytes" in host else None),
                optimizer_step=OptimizerStep(**{k: r.q(host["optimizer_step"], k, f"host.optimizer_step.{k}")
                                                for k in ("fixed_s", "tensor_s", "param_s")}),
            ) if host is not None else None,
            name=data["name"],
            description=data.get("description", ""),
            origin=data["origin"],
            device=device,
            devices_per_node=int(r.q(data["node"], "devices_per_node", "node.devices_per_node")),
            links=links,
            collectives=collectives,
            sources=r.sources,
        )
    except ValueError as e:
        raise ProfileError(f"{origin_hint}: {e}") from e


def _link(r: _Reader, obj: Mapping[str, Any], path: str) -> LinkSpec:
    return LinkSpec(
        name=obj["name"],
        bandwidth_bytes_per_s=r.q(obj, "bandwidth_bytes_per_s", f"{path}.bandwidth_bytes_per_s"),
        latency_s=r.q(obj, "latency_s", f"{path}.latency_s"),
        rails=int(r.q(obj, "rails", f"{path}.rails")) if "rails" in obj else 1,
    )


def _quantity(value: float, unit: str, source: str) -> dict[str, Any]:
    return {"value": value, "unit": unit, "source": source}


def profile_to_json(p: HardwareProfile, *, include_derived: bool = False) -> dict[str, Any]:
    """The JSON form; collectives derived from links are left out unless `include_derived`."""
    src = p.sources

    def q(value: float, unit: str, path: str) -> dict[str, Any]:
        return _quantity(value, unit, src.get(path, "derived"))

    def link(lk: LinkSpec, path: str) -> dict[str, Any]:
        out = {"name": lk.name, "bandwidth_bytes_per_s": q(lk.bandwidth_bytes_per_s, "B/s", f"{path}.bandwidth_bytes_per_s"),
               "latency_s": q(lk.latency_s, "s", f"{path}.latency_s")}
        if f"{path}.rails" in src:
            out["rails"] = q(lk.rails, "1", f"{path}.rails")
        return out

    collectives: dict[str, dict[str, Any]] = {}
    for (level, kind), c in p.collectives.items():
        path = f"collectives.{level.value}.{kind.value}"
        if not include_derived and f"{path}.alpha_s" not in src:
            continue
        entry: dict[str, Any] = {
            "alpha_s": q(c.alpha_s, "s", f"{path}.alpha_s"),
            "bus_bandwidth_bytes_per_s": q(c.bus_bandwidth_bytes_per_s, "B/s", f"{path}.bus_bandwidth_bytes_per_s"),
        }
        if c.table:
            entry["table"] = [{"ranks": t.ranks, "bytes": t.size_bytes, "seconds": t.time_s} for t in c.table]
        collectives.setdefault(level.value, {})[kind.value] = entry
    d = p.device
    return {
        "schema_version": SCHEMA_VERSION,
        "name": p.name,
        "description": p.description,
        "origin": dict(p.origin),
        "device": {
            "name": d.name,
            "peak_flops_per_s": {k: q(v, "FLOP/s", f"device.peak_flops_per_s.{k}") for k, v in d.peak_flops_per_s.items()},
            "mem_bandwidth_bytes_per_s": q(d.mem_bandwidth_bytes_per_s, "B/s", "device.mem_bandwidth_bytes_per_s"),
            "mem_capacity_bytes": q(d.mem_capacity_bytes, "B", "device.mem_capacity_bytes"),
            "kernel_launch_s": q(d.kernel_launch_s, "s", "device.kernel_launch_s"),
            **({"elementwise_bandwidth_bytes_per_s": q(d.elementwise_bandwidth_bytes_per_s, "B/s",
                                                       "device.elementwise_bandwidth_bytes_per_s")}
               if d.elementwise_bandwidth_bytes_per_s else {}),
            **({"elementwise_by_op": {k: q(v, "B/s", f"device.elementwise_by_op.{k}")
                                      for k, v in d.elementwise_by_op.items()}}
               if d.elementwise_by_op else {}),
            **({"elementwise_backward_by_op": {k: q(v, "B/s", f"device.elementwise_backward_by_op.{k}")
                                               for k, v in d.elementwise_backward_by_op.items()}}
               if d.elementwise_backward_by_op else {}),
            **({"graph_op_overhead_s": q(d.graph_op_overhead_s, "s", "device.graph_op_overhead_s")}
               if d.graph_op_overhead_s is not None else {}),
            **({"reshard_overhead_s": q(d.reshard_overhead_s, "s", "device.reshard_overhead_s")}
               if d.reshard_overhead_s is not None else {}),
            **({"step_overhead_s": q(d.step_overhead_s, "s", "device.step_overhead_s")}
               if d.step_overhead_s is not None else {}),
            **({"rank_skew": q(d.rank_skew, "1", "device.rank_skew")} if d.rank_skew is not None else {}),
            **({"collective_wait_s": q(d.collective_wait_s, "s", "device.collective_wait_s")}
               if d.collective_wait_s is not None else {}),
            **({"optimizer_step": {k: q(getattr(d.optimizer_step, k), "s", f"device.optimizer_step.{k}")
                                   for k in ("fixed_s", "tensor_s", "param_s")}}
               if d.optimizer_step is not None else {}),
            **({"async_launch": True} if d.async_launch else {}),
            **{key: {k: q(getattr(c, k), unit, f"device.{key}.{k}") for k, unit in ATTENTION_FIELDS.items()}
               for key, c in (("attention_forward", d.attention_forward), ("attention_backward", d.attention_backward))
               if c is not None},
            **({"matmul_efficiency_by_dtype": {
                k: {"max_fraction": q(c.max_fraction, "1", f"device.matmul_efficiency_by_dtype.{k}.max_fraction"),
                    "half_flops": q(c.half_flops, "FLOP", f"device.matmul_efficiency_by_dtype.{k}.half_flops")}
                for k, c in sorted(d.matmul_efficiency_by_dtype.items())}} if d.matmul_efficiency_by_dtype else {}),
            **({"matmul_alignment": {str(k): q(v, "1", f"device.matmul_alignment.{k}")
                                     for k, v in sorted(d.matmul_alignment.items())}}
               if d.matmul_alignment else {}),
            **({"matmul_narrow_efficiency": {
                "max_fraction": q(d.matmul_narrow_efficiency.max_fraction, "1",
                                  "device.matmul_narrow_efficiency.max_fraction"),
                "half_channels": q(d.matmul_narrow_efficiency.half_channels, "1",
                                   "device.matmul_narrow_efficiency.half_channels")}}
               if d.matmul_narrow_efficiency is not None else {}),
            **({"conv_efficiency": {
                "max_fraction": q(d.conv_efficiency.max_fraction, "1", "device.conv_efficiency.max_fraction"),
                "half_channels": q(d.conv_efficiency.half_channels, "1", "device.conv_efficiency.half_channels")}}
               if d.conv_efficiency is not None else {}),
            "matmul_efficiency": {
                "max_fraction": q(d.matmul_efficiency.max_fraction, "1", "device.matmul_efficiency.max_fraction"),
                "half_flops": q(d.matmul_efficiency.half_flops, "FLOP", "device.matmul_efficiency.half_flops"),
            },
        },
        "node": {"devices_per_node": q(p.devices_per_node, "1", "node.devices_per_node"),
                 "link": link(p.links[LinkLevel.INTRA_NODE], "node.link")},
        "network": link(p.links[LinkLevel.INTER_NODE], "network"),
        "collectives": collectives,
        **({"host": _host_json(p.host, q)} if p.host is not None else {}),
    }


def _host_json(h: HostSpec, q: Any) -> dict[str, Any]:
    return {"copy_bandwidth_bytes_per_s": q(h.copy_bandwidth_bytes_per_s, "B/s", "host.copy_bandwidth_bytes_per_s"),
            **({"node_copy_bandwidth_bytes_per_s": q(h.node_copy_bandwidth_bytes_per_s, "B/s",
                                                     "host.node_copy_bandwidth_bytes_per_s")}
               if h.node_copy_bandwidth_bytes_per_s is not None else {}),
            **({"node_memory_bytes": q(h.node_memory_bytes, "B", "host.node_memory_bytes")}
               if h.node_memory_bytes is not None else {}),
            "optimizer_step": {k: q(getattr(h.optimizer_step, k), "s", f"host.optimizer_step.{k}")
                               for k in ("fixed_s", "tensor_s", "param_s")}}
