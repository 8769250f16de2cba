"""What a plan is asked for (`PlanRequest`, every lever the user sets) and what the search reports
back per mesh (`Candidate`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from core.context import CP_AXIS
from core.errors import MeshplanError
from core.layout import Layout, parse_layout
from core.levers import (
    ActivationOffload,
    Attention,
    Composer,
    CpMethod,
    Dtype,
    LossKind,
    Mode,
    Offload,
    Recompute,
    Runtime,
    Schedule,
    Search,
    default_dtype,
    lever,
    offload_levers,
)
from core.mesh import DeviceMesh
from costmodel.buckets import CommFusion
from costmodel.compose import StepCost
from planner.search.dataset import parse_dataset_strategy
from planner.strategy import (
    SolverStats,
)

Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: str
    dims: Mapping[str, int] = field(default_factory=dict)
    profile: str = "h100-sxm"
    devices: int = 1
    mesh_shape: tuple[int, ...] | None = None
    axis_names: tuple[str, ...] | None = None
    mode: Mode = Mode.AUTO
    search: Search = Search.ILP
    pins: Mapping[str, str] = field(default_factory=dict)
    memory_limit_gib: float | None = None  # default: 90% of the device's capacity
    time_limit_s: float = 60.0
    dtype: Dtype | None = None  # None: the profile's default (`for_profile`)
    solver: str = "cbc"
    workers: int = 2  # the solver's threads (CP-SAT; CBC here runs one); the plan does not depend on them
    follow: bool = True
    strict: bool = False
    all_to_all: bool = True
    loss: LossKind = LossKind.AUTO
    # The training step's levers. The global batch (sequences per optimizer step) is split into
    # `accumulation_steps` micro-steps (None: the fewest that fit in memory); the graph's `batch` dim
    # is bound at one micro-step's batch, global / steps. Without it, `--dim batch` is one step.
    global_batch_size: int | None = None
    accumulation_steps: int | None = None
    zero_stage: int | None = None  # 0–3, or None: auto (each parameter's stage 0–2 chosen by the ILP)
    recompute: Recompute = Recompute.AUTO  # AUTO: the ILP decides how many layers per group
    recompute_layers: int | None = None  # with full: the first N layers of each group (Megatron's block method)
    offload: Offload = Offload.NONE  # model states in host memory: every parameter's, or AUTO (the ILP, per parameter)
    # The repeated layers' saved activations in host memory: every layer not recomputed, or AUTO (the ILP,
    # per layer group). `offload` given as words with "activations" among them (or "auto") sets both.
    offload_activations: ActivationOffload = ActivationOffload.NONE
    # MindSpore's gradient_accumulation_shard: under ZeRO with accumulation, the accumulated gradient kept
    # sharded (a reduce-scatter per micro-step: ZeRO-2) or whole (reduced once: ZeRO-1); "auto": the
    # ILP's choice per parameter (`zero_options`).
    gradient_accumulation_shard: str = "auto"
    # MindSpore's dataset_strategy (planner/search/dataset.py): data_parallel, full_batch, or per-input splits
    dataset_strategy: str = "data_parallel"
    # torchtitan's degrees (core/layout.py), given parsed or as text ("dp_shard=8,tp=8"; pp, vpp pipeline)
    layout: Layout | None = None
    schedule: Schedule | None = None  # a pipeline's (default 1f1b; interleaved with vpp)
    # With cp in the layout: how an attention sees every key and value (`core/context.py`); None: auto
    cp_method: CpMethod | None = None
    micro_batch_size: int | None = None  # per data-parallel rank per micro-step (needs the dp degree)
    # How priced items add up (costmodel/compose.py); None: the profile's default (`for_profile`).
    composer: Composer | None = None
    # Communication fusion (MindSpore's comm_fusion, DDP's bucket_cap_mb): bucket caps per kind, or None:
    # auto (the fastest of FUSION_CANDIDATES per kind, priced on the plan found).
    fusion: CommFusion | None = field(default_factory=CommFusion)
    zero_threshold_bytes: float = 0.0  # MindSpore's parallel_optimizer_threshold: smaller parameters unsharded
    # MindSpore's switches (planner/strategy.py TrainingSettings): priced where they change the step.
    gradients_mean: bool = True
    parameter_broadcast: bool = False
    force_fp32_communication: bool = False
    attention: Attention = Attention.FLASH  # how the runtime runs attention
    runtime: Runtime = Runtime.EAGER  # op by op, or compiled (torch.compile: element-wise chains fused)
    attention_dropout: float = 0.0  # dropout on the attention probabilities (priced where materialised)
    capacity_factor: float = 1.25  # mixture-of-experts: an expert sized for its uniform share of tokens × this
    zero_shard_size: int | None = None  # optimizer_weight_shard_size (None: the whole data-parallel group)
    pipeline_result_broadcast: bool = False  # a pipelined plan's loss broadcast to every stage each step
    # A layout's plan must fit the memory limit (the planner's own hand layouts, `incumbents.py`); a
    # user's layout is priced fitting or not.
    must_fit: bool = False

    def __post_init__(self) -> None:
        # The typed levers, from their words where a caller gave words; the layout parsed once.
        if isinstance(self.offload, str) and not isinstance(self.offload, Offload):
            states, acts = offload_levers(self.offload)
            if "activations" not in self.offload and self.recompute in (Recompute.FULL, Recompute.SELECTIVE) \
                    and self.recompute_layers is None:
                acts = ActivationOffload.NONE  # `auto` under full recomputation: every layer recomputed already
            object.__setattr__(self, "offload", states)
            if self.offload_activations is ActivationOffload.NONE:
                object.__setattr__(self, "offload_activations", acts)
        object.__setattr__(self, "offload_activations",
                           lever(ActivationOffload, self.offload_activations, "offload_activations"))
        for name, kind in (("mode", Mode), ("search", Search), ("loss", LossKind), ("recompute", Recompute),
                           ("offload", Offload),
                           ("composer", Composer), ("attention", Attention), ("runtime", Runtime), ("dtype", Dtype)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, lever(kind, getattr(self, name), name))
        if self.schedule is not None:
            object.__setattr__(self, "schedule", lever(Schedule, self.schedule, "schedule"))
        if self.cp_method is not None:
            object.__setattr__(self, "cp_method", lever(CpMethod, self.cp_method, "cp_method"))
        if isinstance(self.layout, str):
            object.__setattr__(self, "layout", parse_layout(self.layout, self.devices))
        if self.devices < 1:
            raise MeshplanError(f"`devices` {self.devices}: needs at least 1 device")
        if self.workers < 1:
            raise MeshplanError(f"`workers` {self.workers}: needs at least 1 solver thread")
        if self.mode is Mode.SEMI and not self.pins:
            raise MeshplanError("`mode` semi plans around pins: give at least one `pins` TENSOR=PLACEMENTS")
        if self.memory_limit_gib is not None and self.memory_limit_gib <= 0:
            raise MeshplanError(f"`memory_limit_gib` {self.memory_limit_gib}: must be a positive number of GiB")
        if self.layout is not None:
            self.layout.check_devices(self.devices)
            if self.mesh_shape is not None:
                raise MeshplanError("`layout` and `mesh_shape` both fix the mesh; give one")
            if not self.decides:
                raise MeshplanError(f"`layout` is priced by the ILP: use `mode` auto or semi, not {self.mode}")
        if self.axis_names is not None and CP_AXIS in self.axis_names:  # (its rules and design come with a layout)
            raise MeshplanError(f"`axis_names` {','.join(self.axis_names)}: '{CP_AXIS}' is context parallelism's axis, "
                                "planned from a layout: give `layout` with cp=N (e.g. dp_shard=8,cp=8), or name the "
                                "axis otherwise")
        if self.cp_method not in (None, CpMethod.AUTO) and (self.layout is None or self.layout.context_parallel == 1):
            raise MeshplanError(f"`cp_method` {self.cp_method}: context parallelism needs a cp axis; give `layout` "
                                "with cp=N (e.g. dp_shard=8,cp=8), or drop `cp_method`")
        pp = self.layout
        if pp is not None and pp.pipeline > 1 and self.global_batch_size is None and "batch" in self.dims:
            raise MeshplanError("`layout` pp: a pipeline runs micro-batches of a global batch; give "
                                "`global_batch_size` (and `micro_batch_size`, default 1 per data-parallel rank)")
        if self.schedule is not None:
            if pp is None or pp.pipeline == 1:
                raise MeshplanError(f"`schedule` {self.schedule} schedules pipeline stages: give `layout` with pp=N")
            if (pp.virtual > 1) != (self.schedule is Schedule.INTERLEAVED):
                raise MeshplanError(f"`schedule` {self.schedule} with vpp={pp.virtual}: the interleaved schedule is the "
                                    "one with virtual stages (vpp > 1), and it needs them")
        if self.micro_batch_size is not None:
            if self.micro_batch_size < 1:
                raise MeshplanError(f"`micro_batch_size` {self.micro_batch_size}: needs at least 1 sequence")
            if self.global_batch_size is None:
                raise MeshplanError("`micro_batch_size` counts sequences per data-parallel rank per micro-step of a "
                                    "global batch: give `global_batch_size` too")
            if self.accumulation_steps is not None:
                raise MeshplanError("`micro_batch_size` and `accumulation_steps` both fix the micro-steps; give one")
            dp = self.data_parallel_degree()
            if self.global_batch_size % (self.micro_batch_size * dp):
                raise MeshplanError(f"`global_batch_size` {self.global_batch_size} is not divisible by micro-batch "
                                    f"{self.micro_batch_size} × {dp} data-parallel ranks; pick sizes whose product "
                                    f"divides it")
        if self.recompute_layers is not None and (self.recompute is not Recompute.FULL or self.recompute_layers < 0):
            raise MeshplanError(f"`recompute_layers` {self.recompute_layers}: counts the layers of each group that "
                                "full recomputation covers; give `recompute` full and a count of 0 or more")
        if self.recompute_layers is not None and not self.decides:
            raise MeshplanError("`recompute_layers` is decided with the sharding by the ILP: use `mode` auto or semi")
        if not self.capacity_factor > 0:
            raise MeshplanError(f"`capacity_factor` {self.capacity_factor}: an expert's tokens are its share times a "
                                "positive factor (1.25 is usual; 1 is exact balance)")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise MeshplanError(f"`attention_dropout` {self.attention_dropout}: a probability in [0, 1)")
        if self.zero_shard_size is not None and self.zero_shard_size < 1:
            raise MeshplanError(f"`zero_shard_size` {self.zero_shard_size}: a ZeRO shard group needs at least 1 rank")
        if self.zero_stage not in (None, 0, 1, 2, 3):
            raise MeshplanError(f"`zero_stage` {self.zero_stage}: choose 0, 1, 2, 3 (ZeRO's stages) or auto")
        if self.zero_stage == 3 and not self.decides:
            raise MeshplanError(f"`zero_stage` 3 places the parameters through the ILP: use `mode` auto or semi (for data "
                                f"parallelism with FSDP, `layout` dp_shard=N), not {self.mode}")
        self._check_accumulation_shard()
        parse_dataset_strategy(self.dataset_strategy)
        if self.offload is not Offload.NONE:
            if self.offload is Offload.AUTO and not self.decides:
                raise MeshplanError(f"`offload` auto is decided with the sharding by the ILP: use `mode` auto or semi, not "
                                    f"{self.mode} (or hold it: `offload` optimizer or params,optimizer)")
            if self.layout is not None and self.layout.pipeline > 1:
                raise MeshplanError(f"`offload` {self.offload} with pp={self.layout.pipeline}: offload is not planned "
                                    "for pipeline stages yet; drop pp from `layout` or use `offload` none")
        self._check_activation_offload()
        k, g = self.accumulation_steps, self.global_batch_size
        if k is not None and k < 1:
            raise MeshplanError(f"`accumulation_steps` {k}: needs at least 1 micro-step")
        if g is not None:
            if g < 1:
                raise MeshplanError(f"`global_batch_size` {g}: needs at least 1 sequence")
            if "batch" in self.dims:
                raise MeshplanError("`global_batch_size` and `dims` batch both set the batch; give one "
                                    "(the global batch is bound per micro-step as batch = global / steps)")
            if k is not None and g % k:
                raise MeshplanError(f"`global_batch_size` {g} is not divisible by `accumulation_steps` {k}; "
                                    f"pick steps among {', '.join(map(str, _divisors(g)))}")
        elif k is not None and k > 1 and "batch" in self.dims:
            raise MeshplanError(f"`accumulation_steps` {k} splits a global batch: give `global_batch_size` "
                                "(the batch per optimizer step) instead of `dims` batch")

    def _check_activation_offload(self) -> None:
        acts = self.offload_activations
        if acts is ActivationOffload.NONE:
            return
        if not self.decides:
            raise MeshplanError(f"`offload` activations are placed per layer by the ILP: use `mode` auto or semi, not "
                                f"{self.mode}")
        if self.layout is not None and self.layout.pipeline > 1:
            raise MeshplanError(f"`offload` activations with pp={self.layout.pipeline}: offload is not planned for "
                                "pipeline stages yet; drop pp from `layout` or drop activations from `offload`")
        if self.recompute in (Recompute.FULL, Recompute.SELECTIVE) and self.recompute_layers is None:
            raise MeshplanError(f"`offload` activations with `recompute` {self.recompute}: every layer is recomputed, "
                                "none saves its activations; use `recompute` auto or none, or a `recompute_layers` count")
        if self.recompute is Recompute.SELECTIVE:
            raise MeshplanError("`offload` activations with `recompute` selective: a layer's saved activations are "
                                "either recomputed or offloaded; use `recompute` auto, none or full")

    def _check_accumulation_shard(self) -> None:
        gas = self.gradient_accumulation_shard
        if gas not in ("auto", "on", "off"):
            raise MeshplanError(f"`gradient_accumulation_shard` {gas!r}: choose on, off or auto")
        if gas == "auto":
            return
        if self.zero_stage in (0, 3):
            raise MeshplanError(f"`gradient_accumulation_shard` {gas} chooses how ZeRO-1/2 accumulate gradients; with "
                                f"`zero_stage` {self.zero_stage} there is no such choice: give `zero_stage` 1, 2 or auto")
        k = self.accumulation_steps
        if k is None and self.micro_batch_size is not None and self.global_batch_size is not None and \
                self.layout is not None:
            k = self.global_batch_size // (self.micro_batch_size * self.layout.data_parallel)
        if k is None or k < 2:
            raise MeshplanError(f"`gradient_accumulation_shard` {gas} keeps an accumulated gradient sharded or whole "
                                "over micro-steps; give `accumulation_steps` 2 or more (with `global_batch_size`)")
        if self.zero_stage is not None:  # ZeRO-1 with sharded accumulation is ZeRO-2, ZeRO-2 without it ZeRO-1
            object.__setattr__(self, "zero_stage", 2 if gas == "on" else 1)

    def for_profile(self, gpu: bool) -> PlanRequest:
        """The request with the levers left to the profile decided: the precision (`default_dtype`:
        mixed on a GPU profile, fp32 on a CPU one); the step overlapped on a GPU (NCCL's streams:
        `compose.overlap`, which the ILP minimises), the serial sum on a CPU (gloo runs every
        collective in line)."""
        return replace(self, dtype=self.dtype or default_dtype(gpu),
                       composer=self.composer or (Composer.OVERLAP if gpu else Composer.SERIAL))

    @property
    def decides(self) -> bool:
        """The ILP decides the sharding (auto or semi mode with the ILP search), not propagation."""
        return self.mode in (Mode.AUTO, Mode.SEMI) and self.search is Search.ILP

    def data_parallel_degree(self) -> int:
        """Ranks that split the batch, where the request fixes it: the layout's dp_replicate × dp_shard,
        or every device in data-parallel mode."""
        if self.layout is not None:
            return self.layout.data_parallel
        if self.mode is Mode.DATA_PARALLEL:
            return self.devices
        raise MeshplanError("`micro_batch_size` needs the data-parallel degree: give `layout` (e.g. "
                            "dp_shard=8,tp=8) or `mode` data-parallel, or use `accumulation_steps`")

    def step_candidates(self) -> list[int]:
        """Accumulation steps to try, fewest first (a larger micro-batch runs at least as efficiently)."""
        if self.global_batch_size is None:
            return [1]
        if self.micro_batch_size is not None:
            return [self.global_batch_size // (self.micro_batch_size * self.data_parallel_degree())]
        if self.layout is not None and self.layout.pipeline > 1:
            return [self.global_batch_size // self.data_parallel_degree()]  # Megatron's default: 1 per rank
        if self.accumulation_steps:
            return [self.accumulation_steps]
        if self.layout is not None:  # each data-parallel rank takes whole sequences
            dp = self.data_parallel_degree()
            steps = [k for k in _divisors(self.global_batch_size) if (self.global_batch_size // k) % dp == 0]
            if not steps:
                raise MeshplanError(f"`global_batch_size` {self.global_batch_size} does not split over the layout's "
                                    f"{dp} data-parallel ranks; give a multiple of {dp}")
            return steps
        return _divisors(self.global_batch_size)

    def static_steps(self, batch: int) -> int:
        """Micro-steps of a model traced at a static batch, which is one micro-step's: the global batch
        over it, or the accumulation steps asked for, or 1."""
        g, k = self.global_batch_size, self.accumulation_steps
        if self.micro_batch_size is not None and self.micro_batch_size * self.data_parallel_degree() != batch:
            raise MeshplanError(f"`micro_batch_size` {self.micro_batch_size}: the model's static batch {batch} is one "
                                f"micro-step's, {batch // self.data_parallel_degree()} per data-parallel rank; drop "
                                "`micro_batch_size`, or re-export with a dynamic batch dim")
        if g is None:
            return k or 1
        if g % batch:
            raise MeshplanError(f"`global_batch_size` {g} is not a multiple of the model's static batch {batch} (the "
                                f"traced batch: one micro-step's); give a multiple of {batch}, or re-export with a "
                                "dynamic batch dim")
        if k is not None and k != g // batch:
            raise MeshplanError(f"`accumulation_steps` {k}: `global_batch_size` {g} over the model's static batch "
                                f"{batch} is {g // batch} micro-steps; give one of the two")
        return g // batch

    def searches_pipelines(self) -> bool:
        """Pipelines are tried where the planner chooses the mesh of a global batch."""
        return (self.layout is None and self.mesh_shape is None and self.mode is Mode.AUTO and self.search is Search.ILP
                and self.offload is Offload.NONE and self.offload_activations is ActivationOffload.NONE
                and self.global_batch_size is not None and self.micro_batch_size is None
                and self.accumulation_steps is None and self.devices > 1)

    def recompute_candidates(self, devices_per_node: int = 1) -> list[Recompute]:
        """Recomputation policies to try, cheapest first (selective — op-level, `costmodel/step.py` — only
        when asked for). Under auto the ILP decides how
        many layers of each group to recompute ("auto"); without an ILP, none and then full (also where
        pipelines are searched on several nodes: their candidates and the plans without them are many, and the counted
        recomputation's ILP takes tens of seconds on meshes of hundreds of devices; for the planner's
        hand layouts, which practitioners run with full checkpointing or none; and for a pipelined layout,
        whose stages' ILP recomputes whole groups or none)."""
        if self.recompute is not Recompute.AUTO:
            return [self.recompute]
        counted = self.decides and not (self.searches_pipelines() and self.devices > devices_per_node) \
            and not self.must_fit and not (self.layout is not None and self.layout.pipeline > 1)
        return [Recompute.NONE, Recompute.AUTO if counted else Recompute.FULL]

    def dims_for(self, steps: int) -> dict[str, int]:
        if self.global_batch_size is None:
            return dict(self.dims)
        return {**self.dims, "batch": self.global_batch_size // steps}


    def zero_options(self) -> tuple[int, ...]:
        """The ZeRO-1/2 stages a parameter may take (ZeRO-3 is a placement, chosen by the ILP)."""
        if self.zero_stage is not None:
            return (self.zero_stage % 3,)
        return {"on": (0, 2), "off": (0, 1)}.get(self.gradient_accumulation_shard, (0, 1, 2))


# Bucket caps `--comm-fusion auto` chooses among, per fused kind.
FUSION_CANDIDATES = tuple(float(mib * 2**20) for mib in (1, 4, 25, 100, 400))


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass
class Candidate:
    mesh: DeviceMesh
    cost: StepCost | None
    stats: SolverStats | None
    error: str = ""


def mesh_candidates(devices: int, devices_per_node: int) -> list[tuple[int, ...]]:
    """(N,) and every (N/t, t) with 1 < t < N whose inner axis t fits inside a node."""
    out: list[tuple[int, ...]] = [(devices,)]
    for t in range(2, devices):
        if devices % t == 0 and t <= devices_per_node:
            out.append((devices // t, t))
    return out


def expert_mesh_candidates(shapes: list[tuple[int, ...]], experts: int, devices_per_node: int,
                           ) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """For a mixture of `experts` (the experts every block's count is a multiple of), each (dp, tp)
    candidate with an ep axis taken from dp, between them (torchtitan's order): the most experts' ranks
    a node holds beside tp (the all-to-alls over the node's links), and the most that divide both dp and
    the experts (across nodes, hierarchical); axes of one rank dropped."""
    out: list[tuple[tuple[int, ...], tuple[str, ...]]] = []
    for shape in shapes:
        dp, tp = shape[0], shape[1] if len(shape) > 1 else 1
        fits = [e for e in range(2, dp + 1) if dp % e == 0 and experts % e == 0]
        inside = [e for e in fits if e * tp <= devices_per_node]
        for e in sorted({*inside[-1:], *fits[-1:]}):
            axes = [(n, s) for n, s in (("dp", dp // e), ("ep", e), ("tp", tp)) if s > 1]
            out.append((tuple(s for _, s in axes), tuple(n for n, _ in axes)))
    return out
