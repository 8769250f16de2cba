"""The strategy: what `meshplan plan` decides, typed, and its versioned JSON (`strategy.schema.json`).

A `Strategy` names the model (path, fingerprint of structure and shapes, bound dims), the profile
(name, digest, where it was loaded from), the mesh, the plan's settings and the training step's
(micro-batches, ZeRO stage, recomputation per layer group), the pipeline stages, every tensor's
placements (`Spec`), every node's strategy (input and output `Spec`s, local kernels) and the
collectives charged to it, the reshards on edges, the fallback ops, the predicted cost (and the
composer policy that summed it) and the solver statistics. Everything is a frozen dataclass; JSON is
only the file format: `to_json` writes schema version 2, `from_json` validates (JSON Schema), migrates
version-1 files on read and builds the objects. The executor reads `Spec`s, never strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from core.collectives import Cadence, Collective, Phase, PricedBucket, PricedCollective, Purpose
from core.errors import MeshplanError
from core.graph import OpGraph, TensorKind
from core.levers import Attention, LossKind, Mode, Offload, Recompute, Runtime, Search
from core.mesh import DeviceMesh
from core.placement import Spec, parse_spec
from costmodel.buckets import GRAD_BUCKET_BYTES, CommFusion
from planner.strategy_migrate import MIGRATIONS
from planner.strategy_pipeline import Pipeline, pipeline_doc, pipeline_of

SCHEMA_VERSION = 2


class StrategyError(MeshplanError):
    """A strategy file that is broken, of another schema version, or for another model."""


@dataclass(frozen=True, kw_only=True)
class ModelRef:
    path: str
    name: str
    fingerprint: str
    dims: Mapping[str, int]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ProfileRef:
    name: str
    digest: str
    source: str = ""  # a preset's name or the file's absolute path (`explain` loads it again)


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    mode: Mode
    search: Search
    dtype: str
    memory_limit_bytes: float | None
    solver: str
    follow: bool
    pins: Mapping[str, str]
    batch: int | None
    loss: LossKind = LossKind.AUTO
    runtime: Runtime = Runtime.EAGER  # written only when compiled


@dataclass(frozen=True, kw_only=True)
class TrainingSettings:
    """The training step's levers: micro-batches (gradient accumulation steps) per optimizer step, the
    ZeRO stage (0–2; ZeRO-3 is the parameters' placements), recomputation per layer group (group →
    policy; none yet), and the batch in Megatron's terms: sequences per optimizer step, and per
    data-parallel rank per micro-step."""
    micro_batches: int = 1
    zero_stage: int = 0
    recompute: Mapping[str, Recompute] = field(default_factory=dict)
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    layout: str | None = None  # the hand layout the plan was held to (torchtitan's degrees), if any
    comm_fusion: CommFusion = field(default_factory=CommFusion)  # bucket caps per fused kind
    zero_threshold_bytes: float = 0.0  # ZeRO-1/2 leave parameters smaller than this unsharded
    # Parameter → ZeRO stage (1: optimizer states, 2: also gradients sharded over the axes its gradient
    # is reduced on); absent: unsharded states. Written by the planner; None in files from before it,
    # where every parameter at or above the threshold has `zero_stage`.
    zero_stages: Mapping[str, int] | None = None
    recompute_layers: Mapping[str, int] = field(default_factory=dict)  # group → its first n layers recomputed
    # MindSpore's switches: gradients averaged over the data-parallel ranks (False: summed, each rank's
    # loss the mean of its own batch), parameters broadcast from rank 0 at start, reductions in fp32.
    gradients_mean: bool = True
    parameter_broadcast: bool = False
    force_fp32_communication: bool = False
    zero_shard_size: int | None = None  # optimizer_weight_shard_size: ZeRO-1/2 shard groups of this many ranks
    # How the runtime runs attention (costmodel/attention.py's ATTENTION_KERNELS) and the dropout on its
    # probabilities (a cost only where the probabilities are materialised).
    attention: Attention = Attention.FLASH
    attention_dropout: float = 0.0
    # Parameter → where its states live (`core.levers.Offload`: "optimizer", "params,optimizer"); absent:
    # on the device.
    offload: Mapping[str, Offload] = field(default_factory=dict)
    # Layer group → how many of its layers, after those it recomputes, save their activations in host
    # memory (`costmodel/host_activations.py`); absent: none.
    offload_activations: Mapping[str, int] = field(default_factory=dict)
    # Mixture-of-experts models: the capacity factor their experts' tokens were priced at (uniform share ×
    # this); None for dense models.
    capacity_factor: float | None = None
    # How each rank reads its inputs (planner/search/dataset.py): data_parallel, full_batch, or the per-input splits.
    dataset_strategy: str = "data_parallel"

    @property
    def bucket_bytes(self) -> float:
        """The gradient all-reduce buckets' cap (DDP's bucket_cap_mb)."""
        return self.comm_fusion.allreduce

    def recomputed_layers(self, group: str, layers: int) -> int:
        """How many of a group's `layers` are recomputed (the first ones): as planned, all where the
        group is recomputed without a count, none where it is not recomputed."""
        if group not in self.recompute:
            return 0
        return min(layers, self.recompute_layers.get(group, layers))

    @property
    def recompute_policy(self) -> Recompute:
        """The one policy every recomputed group has (NONE without any); groups differ in no plan yet."""
        policies = set(self.recompute.values())
        if len(policies) > 1:
            raise StrategyError(f"recomputation differs between layer groups ({dict(self.recompute)}); this meshplan "
                                "plans one policy for all")
        return policies.pop() if policies else Recompute.NONE


@dataclass(frozen=True, kw_only=True)
class TensorPlacement:
    kind: TensorKind  # INPUT, PARAM or ACTIVATION (constants are not placed)
    shape: tuple[int, ...]
    spec: Spec


@dataclass(frozen=True, kw_only=True)
class NodePlan:
    op_type: str
    module: str
    strategy: str
    inputs: tuple[Spec | None, ...]
    outputs: tuple[Spec, ...]
    kernels: tuple[str, ...]
    compute_s: float
    collectives: tuple[PricedCollective, ...]


@dataclass(frozen=True, kw_only=True)
class Reshard:
    tensor: str
    consumer: str
    src: Spec
    dst: Spec
    collectives: tuple[PricedCollective, ...]  # the forward ones (the backward are on the consumer)


@dataclass(frozen=True, kw_only=True)
class Fallback:
    node: str
    op_type: str


@dataclass(frozen=True, kw_only=True)
class PredictedCost:
    step_time_s: float
    compute_s: float
    optimizer_s: float
    overhead_s: float
    comm_s: float
    memory: Mapping[str, float]  # bytes per device by category
    flops_per_device: float
    composer: str = "serial"  # the step composer's policy (costmodel/compose.py)
    hidden_comm_s: float = 0.0  # communication the composer hides under compute (not in comm_s)
    bubble_s: float = 0.0  # a pipeline's idle time (fill and drain), in step_time_s
    # Offloaded states: host-link copies the step waits for (in step_time_s) and those under compute, the
    # bytes copied a step, and the bytes held in host memory per device.
    host_s: float = 0.0
    hidden_host_s: float = 0.0
    host_copy_bytes: float = 0.0
    host_memory_bytes: float = 0.0

    peak_bytes: float | None = None  # the most held at once (`costmodel.compose.peak_bytes`); None: the sum

    @property
    def memory_bytes_per_device(self) -> float:
        return sum(self.memory.values()) if self.peak_bytes is None else self.peak_bytes


@dataclass(frozen=True, kw_only=True)
class SolverStats:
    status: str
    objective: float  # seconds
    bound: float  # seconds
    gap: float
    time_s: float
    num_variables: int
    num_constraints: int
    num_decision_nodes: int
    num_edges: int


@dataclass(frozen=True, kw_only=True)
class CandidateRecord:
    mesh: tuple[int, ...]
    axis_names: tuple[str, ...]
    step_time_s: float | None
    memory_bytes_per_device: float | None
    solver_status: str | None
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class HandLayoutRecord:
    """A hand layout the planner priced as written beside its own search (`planner/search/incumbents.py`)."""
    name: str
    layout: str
    zero: int
    step_time_s: float | None
    memory_bytes_per_device: float | None
    fits: bool
    chosen: bool = False  # faster than the search's plan: the plan is this layout's
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class Strategy:
    model: ModelRef
    profile: ProfileRef
    mesh: DeviceMesh
    settings: PlanSettings
    training: TrainingSettings
    tensors: Mapping[str, TensorPlacement]
    nodes: Mapping[str, NodePlan]
    reshards: tuple[Reshard, ...]
    fallbacks: tuple[Fallback, ...]
    cost: PredictedCost
    solver: SolverStats
    pipeline: Pipeline | None = None  # pipelined: `mesh` is one stage's sub-mesh
    candidates: tuple[CandidateRecord, ...] = ()
    # The gradient collectives as the ranks run them, packed (the nodes' bucketed collectives carry
    # their shares of these); None: a file written before meshplan recorded them.
    buckets: tuple[PricedBucket, ...] | None = ()
    hand_layouts: tuple[HandLayoutRecord, ...] = ()  # the incumbents the plan was checked against

    @property
    def fingerprint(self) -> str:
        return self.model.fingerprint

    @property
    def step_time_s(self) -> float:
        return self.cost.step_time_s

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.mesh.shape

    def spec_of(self, tensor: str) -> Spec | None:
        """Where the plan stores a parameter or feeds an input (None: it does not say)."""
        entry = self.tensors.get(tensor)
        return entry.spec if entry is not None else None

    def check_model(self, graph: OpGraph) -> None:
        if graph.fingerprint != self.fingerprint:
            raise StrategyError(
                f"the strategy was planned for model fingerprint {self.fingerprint} "
                f"({self.model.name}, dims {dict(self.model.dims)}) but this model is "
                f"{graph.fingerprint} ({graph.name}, dims {graph.dims}); re-plan it with meshplan plan")

    def to_dict(self) -> dict[str, Any]:
        return _document(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


# ---------------------------------------------------------------------------------------------------
# JSON: write (schema 2)


def _collective_doc(c: PricedCollective, mesh: DeviceMesh) -> dict[str, Any]:
    return {"kind": c.kind.value, "axes": [mesh.axis_names[a] for a in c.axes], "bytes": c.size_bytes,
            "time_s": c.time_s, "phase": c.phase.value,
            "purpose": c.purpose.value, "tensor": c.tensor, "cadence": c.cadence.value}


def _bucket_doc(b: PricedBucket, mesh: DeviceMesh) -> dict[str, Any]:
    return {"kind": b.kind.value, "axes": [mesh.axis_names[a] for a in b.axes], "bytes": b.size_bytes,
            "time_s": b.time_s, "cadence": b.cadence.value, "stage": b.stage, "tensors": list(b.tensors)}


def _bucket(b: Mapping[str, Any], mesh: DeviceMesh) -> PricedBucket:
    return PricedBucket(kind=Collective(b["kind"]), axes=_axes(b["axes"], mesh, "a gradient bucket"),
                        size_bytes=float(b["bytes"]), time_s=float(b["time_s"]), cadence=Cadence(b["cadence"]),
                        tensors=tuple(b["tensors"]), stage=b["stage"])


def _axes(names: list[str], mesh: DeviceMesh, what: str) -> tuple[int, ...]:
    """Mesh axes by name, as the file records them, by index; one the mesh lacks is an error."""
    missing = [a for a in names if a not in mesh.axis_names]
    if missing:
        raise StrategyError(f"{what} spans mesh axis {missing[0]!r}, which the strategy's mesh "
                            f"{list(mesh.axis_names)} lacks; plan again")
    return tuple(mesh.axis_names.index(a) for a in names)


def _document(s: Strategy) -> dict[str, Any]:
    m = s.model
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {"path": m.path, "name": m.name, "fingerprint": m.fingerprint, "dims": dict(m.dims),
                  **({"notes": list(m.notes)} if m.notes else {})},
        "profile": {"name": s.profile.name, "digest": s.profile.digest, "source": s.profile.source},
        "mesh": {"shape": list(s.mesh.shape), "axis_names": list(s.mesh.axis_names), "devices": list(s.mesh.devices),
                 "devices_per_node": s.mesh.devices_per_node},
        "settings": {"mode": s.settings.mode, "search": s.settings.search, "dtype": s.settings.dtype,
                     "memory_limit_bytes": s.settings.memory_limit_bytes, "solver": s.settings.solver,
                     "follow": s.settings.follow, "pins": dict(s.settings.pins), "batch": s.settings.batch,
                     "loss": s.settings.loss,
                     **({"runtime": s.settings.runtime} if s.settings.runtime is not Runtime.EAGER else {})},
        "training": {"micro_batches": s.training.micro_batches, "zero_stage": s.training.zero_stage,
                     "recompute": dict(s.training.recompute), "global_batch_size": s.training.global_batch_size,
                     "micro_batch_size": s.training.micro_batch_size, "layout": s.training.layout,
                     "comm_fusion": s.training.comm_fusion.as_dict(),
                     "zero_threshold_bytes": s.training.zero_threshold_bytes,
                     "recompute_layers": dict(s.training.recompute_layers),
                     "gradients_mean": s.training.gradients_mean, "parameter_broadcast": s.training.parameter_broadcast,
                     "force_fp32_communication": s.training.force_fp32_communication,
                     "zero_shard_size": s.training.zero_shard_size,
                     "attention": s.training.attention, "attention_dropout": s.training.attention_dropout,
                     **({"zero_stages": dict(s.training.zero_stages)} if s.training.zero_stages is not None else {}),
                     **({"offload": {t: str(m) for t, m in s.training.offload.items()}} if s.training.offload else {}),
                     **({"offload_activations": dict(s.training.offload_activations)}
                        if s.training.offload_activations else {}),
                     **({"capacity_factor": s.training.capacity_factor}
                        if s.training.capacity_factor is not None else {}),
                     **({"dataset_strategy": s.training.dataset_strategy}
                        if s.training.dataset_strategy != "data_parallel" else {})},
        "pipeline": pipeline_doc(s.pipeline),
        "tensors": {t: {"kind": p.kind.value, "shape": list(p.shape), "placements": [str(x) for x in p.spec.placements],
                        "dims_mapping": p.spec.dims_mapping(len(p.shape))} for t, p in s.tensors.items()},
        "nodes": {n: {"op_type": p.op_type, "module": p.module, "strategy": p.strategy,
                      "inputs": [str(x) if x is not None else None for x in p.inputs],
                      "outputs": [str(x) for x in p.outputs], "kernels": list(p.kernels), "compute_s": p.compute_s,
                      "collectives": [_collective_doc(c, s.mesh) for c in p.collectives]} for n, p in s.nodes.items()},
        "reshards": [{"tensor": r.tensor, "consumer": r.consumer, "from": str(r.src), "to": str(r.dst),
                      "collectives": [_collective_doc(c, s.mesh) for c in r.collectives]} for r in s.reshards],
        "fallback_ops": [{"node": f.node, "op_type": f.op_type} for f in s.fallbacks],
        "cost": {"composer": s.cost.composer, "hidden_comm_s": s.cost.hidden_comm_s,
                 "step_time_s": s.cost.step_time_s, "compute_s": s.cost.compute_s,
                 "optimizer_s": s.cost.optimizer_s, "overhead_s": s.cost.overhead_s, "comm_s": s.cost.comm_s,
                 "memory_bytes_per_device": s.cost.memory_bytes_per_device, "memory": dict(s.cost.memory),
                 "flops_per_device": s.cost.flops_per_device, "bubble_s": s.cost.bubble_s,
                 **({"host": {"exposed_s": s.cost.host_s, "hidden_s": s.cost.hidden_host_s,
                              "copy_bytes": s.cost.host_copy_bytes, "memory_bytes_per_device": s.cost.host_memory_bytes}}
                    if s.cost.host_copy_bytes or s.cost.host_memory_bytes else {}),
                 **({"buckets": [_bucket_doc(b, s.mesh) for b in s.buckets]} if s.buckets is not None else {})},
        "solver": {"status": s.solver.status, "objective": s.solver.objective, "bound": s.solver.bound,
                   "gap": s.solver.gap, "time_s": s.solver.time_s, "num_variables": s.solver.num_variables,
                   "num_constraints": s.solver.num_constraints, "num_decisions": s.solver.num_decision_nodes,
                   "num_edges": s.solver.num_edges},
        "candidates": [{"mesh": list(c.mesh), "axis_names": list(c.axis_names), "step_time_s": c.step_time_s,
                        "memory_bytes_per_device": c.memory_bytes_per_device, "solver_status": c.solver_status,
                        "error": c.error} for c in s.candidates],
        **({"hand_layouts": [{"name": h.name, "layout": h.layout, "zero": h.zero, "step_time_s": h.step_time_s,
                              "memory_bytes_per_device": h.memory_bytes_per_device, "fits": h.fits,
                              "chosen": h.chosen, "error": h.error} for h in s.hand_layouts]}
           if s.hand_layouts else {}),
    }


# ---------------------------------------------------------------------------------------------------
# JSON: read (schema 2; schema 1 migrated)


@cache
def schema(version: int = SCHEMA_VERSION) -> dict[str, Any]:
    name = "strategy.schema.json" if version == SCHEMA_VERSION else f"strategy.v{version}.schema.json"
    return json.loads(resources.files("planner").joinpath(name).read_text())


def _validate(data: Mapping[str, Any], version: int, origin: str) -> None:
    try:
        jsonschema.validate(data, schema(version))
    except jsonschema.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        raise StrategyError(f"{origin}: field {where}: {e.message}; re-plan with meshplan plan") from e


def from_dict(data: Mapping[str, Any], origin: str = "strategy") -> Strategy:
    if not isinstance(data, Mapping):
        raise StrategyError(f"{origin}: not a strategy (a JSON object is expected); write one with meshplan plan -o")
    version = data.get("schema_version")
    if version in MIGRATIONS:
        _validate(data, version, origin)
        data = MIGRATIONS[version](data)
    elif version != SCHEMA_VERSION:
        raise StrategyError(f"{origin}: schema_version {version!r} is not one this meshplan reads (1 or "
                            f"{SCHEMA_VERSION}); re-plan with this meshplan")
    _validate(data, SCHEMA_VERSION, origin)
    try:
        return _build(data)
    except MeshplanError as e:  # a placement or mesh the schema admits but that does not hold together
        raise StrategyError(f"{origin}: {e}; re-plan with meshplan plan") from e


def _collective(c: Mapping[str, Any], mesh: DeviceMesh) -> PricedCollective:
    return PricedCollective(kind=Collective(c["kind"]), axes=_axes(c["axes"], mesh, "a collective"),
                            size_bytes=float(c["bytes"]), time_s=float(c["time_s"]), phase=Phase(c["phase"]),
                            purpose=Purpose(c["purpose"]), tensor=c["tensor"], cadence=Cadence(c["cadence"]))


def _build(d: Mapping[str, Any]) -> Strategy:
    m, p, me, st, tr, c, sv = (d[k] for k in ("model", "profile", "mesh", "settings", "training", "cost", "solver"))
    mesh = DeviceMesh(shape=tuple(me["shape"]), axis_names=tuple(me["axis_names"]), devices=tuple(me["devices"]),
                      devices_per_node=me["devices_per_node"])
    for name, t in d["tensors"].items():
        spec = parse_spec(",".join(t["placements"]), len(t["shape"]))
        spec.validate(tuple(t["shape"]), mesh.shape, f"tensor {name}")
    return Strategy(
        model=ModelRef(path=m["path"], name=m["name"], fingerprint=m["fingerprint"], dims=dict(m["dims"]),
                       notes=tuple(m.get("notes", ()))),
        profile=ProfileRef(name=p["name"], digest=p["digest"], source=p["source"]),
        mesh=mesh,
        settings=PlanSettings(mode=Mode(st["mode"]), search=Search(st["search"]), dtype=st["dtype"],
                              memory_limit_bytes=st["memory_limit_bytes"], solver=st["solver"], follow=st["follow"],
                              pins=dict(st["pins"]), batch=st["batch"], loss=LossKind(st["loss"]),
                              runtime=Runtime(st.get("runtime", "eager"))),
        training=TrainingSettings(micro_batches=tr["micro_batches"], zero_stage=tr["zero_stage"],
                                  recompute={g: Recompute(x) for g, x in tr["recompute"].items()},
                                  global_batch_size=tr["global_batch_size"],
                                  micro_batch_size=tr["micro_batch_size"], layout=tr["layout"],
                                  comm_fusion=CommFusion(**tr["comm_fusion"]) if "comm_fusion" in tr else
                                  CommFusion.uniform(tr.get("bucket_bytes", GRAD_BUCKET_BYTES)),
                                  zero_threshold_bytes=tr["zero_threshold_bytes"],
                                  zero_stages=dict(tr["zero_stages"]) if "zero_stages" in tr else None,
                                  recompute_layers=dict(tr.get("recompute_layers", {})),
                                  gradients_mean=tr.get("gradients_mean", True),
                                  parameter_broadcast=tr.get("parameter_broadcast", False),
                                  force_fp32_communication=tr.get("force_fp32_communication", False),
                                  zero_shard_size=tr.get("zero_shard_size"),
                                  attention=Attention(tr.get("attention", "flash")),
                                  attention_dropout=tr.get("attention_dropout", 0.0),
                                  offload={t: Offload(m) for t, m in tr.get("offload", {}).items()},
                                  offload_activations=dict(tr.get("offload_activations", {})),
                                  capacity_factor=tr.get("capacity_factor"),
                                  dataset_strategy=tr.get("dataset_strategy", "data_parallel")),
        pipeline=pipeline_of(d["pipeline"]),
        tensors={name: TensorPlacement(kind=TensorKind(t["kind"]), shape=tuple(t["shape"]),
                                       spec=parse_spec(",".join(t["placements"]), len(t["shape"])))
                 for name, t in d["tensors"].items()},
        nodes={name: NodePlan(op_type=n["op_type"], module=n["module"], strategy=n["strategy"],
                              inputs=tuple(parse_spec(x) if x is not None else None for x in n["inputs"]),
                              outputs=tuple(parse_spec(x) for x in n["outputs"]), kernels=tuple(n["kernels"]),
                              compute_s=float(n["compute_s"]),
                              collectives=tuple(_collective(x, mesh) for x in n["collectives"]))
               for name, n in d["nodes"].items()},
        reshards=tuple(Reshard(tensor=r["tensor"], consumer=r["consumer"], src=parse_spec(r["from"]),
                               dst=parse_spec(r["to"]), collectives=tuple(_collective(x, mesh) for x in r["collectives"]))
                       for r in d["reshards"]),
        fallbacks=tuple(Fallback(node=f["node"], op_type=f["op_type"]) for f in d["fallback_ops"]),
        cost=PredictedCost(step_time_s=c["step_time_s"], compute_s=c["compute_s"], optimizer_s=c["optimizer_s"],
                           overhead_s=c["overhead_s"], comm_s=c["comm_s"], memory=dict(c["memory"]),
                           flops_per_device=c["flops_per_device"], composer=c["composer"],
                           hidden_comm_s=c["hidden_comm_s"], bubble_s=c.get("bubble_s", 0.0),
                           peak_bytes=c.get("memory_bytes_per_device"),
                           host_s=c.get("host", {}).get("exposed_s", 0.0),
                           hidden_host_s=c.get("host", {}).get("hidden_s", 0.0),
                           host_copy_bytes=c.get("host", {}).get("copy_bytes", 0.0),
                           host_memory_bytes=c.get("host", {}).get("memory_bytes_per_device", 0.0)),
        solver=SolverStats(status=sv["status"], objective=sv["objective"], bound=sv["bound"], gap=sv["gap"],
                           time_s=sv["time_s"], num_variables=sv["num_variables"],
                           num_constraints=sv["num_constraints"], num_decision_nodes=sv["num_decisions"],
                           num_edges=sv["num_edges"]),
        candidates=tuple(CandidateRecord(mesh=tuple(x["mesh"]), axis_names=tuple(x["axis_names"]),
                                         step_time_s=x["step_time_s"],
                                         memory_bytes_per_device=x["memory_bytes_per_device"],
                                         solver_status=x["solver_status"], error=x["error"])
                         for x in d["candidates"]),
        hand_layouts=tuple(HandLayoutRecord(**x) for x in d.get("hand_layouts", ())),
        buckets=tuple(_bucket(b, mesh) for b in c["buckets"]) if "buckets" in c else None,
    )


def from_json(text: str, origin: str = "strategy") -> Strategy:
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StrategyError(f"{origin}: not JSON ({e}); write a strategy with meshplan plan -o") from e
    if isinstance(data, dict) and data.get("only_trainable_params"):
        raise StrategyError(f"{origin} holds only the trainable parameters' placements (only_trainable_params); "
                            f"plan with `strategy_in` {origin} for a strategy to run")
    return from_dict(data, origin)


# ---------------------------------------------------------------------------------------------------
# Strategy checkpoints (MindSpore's strategy_ckpt_save_file / load_file): the parameters' layout


def load_strategy(path: str | Path) -> Strategy:
    p = Path(path)
    if not p.is_file():
        raise StrategyError(f"{p}: no such strategy file; write one with meshplan plan -o {p}")
    try:
        text = p.read_text()
    except UnicodeDecodeError as e:
        raise StrategyError(f"{p}: not JSON ({e}); write a strategy with meshplan plan -o") from e
    return from_json(text, str(p))


