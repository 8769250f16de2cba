"""`--layout`: a parallelism layout in torchtitan's words (`ParallelDims`), priced as a hand configuration.

    --layout dp_replicate=2,dp_shard=8,tp=4

fixes the mesh (one axis per degree above 1, in that order, named by its key) and the kind of
parallelism on each: the batch is split over dp_replicate × dp_shard; parameters are replicated over
dp_replicate and, where dp_shard > 1, stored split on their first dim over it and gathered for use
(FSDP / ZeRO-3; both together are HSDP); the tensor-parallel axis, and everything else, is the ILP's
to decide. With --micro-batch-size the data-parallel degree the layout names turns a global batch into
its accumulation steps, as Megatron and torchtitan count them.

    --layout tp=8,pp=8,dp_replicate=24,vpp=2

adds pipeline stages (`planner/search/pipeline.py`): pp stages of the repeated layers, each on a sub-mesh of
the other degrees (the mesh above is one stage's), and with vpp > 1 the interleaved schedule's model
chunks per device (Megatron's virtual pipeline stages; not a device degree).

    --layout dp_shard=8,ep=4,tp=2

adds expert parallelism as torchtitan does: ep borrows its ranks from dp_shard (it divides it). The
mesh splits dp_shard into dp_shard/ep × ep (axes dp_shard, ep); for every op but a mixture-of-experts
block's experts both are one data-parallel group (the batch split, FSDP over both); the experts are
split over ep (E/ep a rank, the tokens sent to them and back by all-to-alls, `planner/rules/experts.py`)
and FSDP-split over dp_shard/ep on their next free dim.

    --layout dp_shard=8,cp=8

adds context parallelism: every input's sequence dim (the one named `seq`) split over cp, every op
using its parameters whole there and FSDP storing them split over dp_shard × cp (torchtitan's rule).
The ILP places the activations, none of them whole on cp (`planner/search/build.as_written`): an
attention keeps its queries split and sees all keys and values, gathered over cp before it and their
gradients reduce-scattered after (Llama-3's all-gather design), its causal work priced in the zig-zag
order (`costmodel/context.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from core.errors import MeshplanError
from core.experts import find_expert_blocks
from core.graph import OpGraph
from core.mesh import DeviceMesh
from core.placement import Replicate, Shard, Spec

LAYOUT_KEYS = ("dp_replicate", "dp_shard", "ep", "cp", "tp")  # mesh axes, outer to inner
PIPELINE_KEYS = ("pp", "vpp")
DATA_AXES = ("dp_replicate", "dp_shard", "ep")  # the batch's axes (ep: of dp_shard's ranks)
WHOLE_AXES = (*DATA_AXES, "cp")  # the axes every op uses its parameters whole on


@dataclass(frozen=True)
class Layout:
    sizes: tuple[tuple[str, int], ...]  # (axis, degree) in LAYOUT_KEYS order: one pipeline stage's mesh
    # (with ep, dp_shard's degree here is dp_shard/ep: the user's dp_shard is the two together)
    pipeline: int = 1  # pp: stages
    virtual: int = 1  # vpp: model chunks per stage (interleaved 1F1B)

    @property
    def degree(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def devices(self) -> int:
        return math.prod(n for _, n in self.sizes) * self.pipeline

    @property
    def stage_devices(self) -> int:
        return math.prod(n for _, n in self.sizes)

    @property
    def data_parallel(self) -> int:
        return math.prod(self.degree.get(k, 1) for k in DATA_AXES)

    @property
    def expert_parallel(self) -> int:
        return self.degree.get("ep", 1)

    @property
    def context_parallel(self) -> int:
        return self.degree.get("cp", 1)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.sizes if n > 1) or (1,)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(k for k, n in self.sizes if n > 1) or ("dp_shard",)

    def check_devices(self, devices: int) -> None:
        """The layout's degrees cover exactly `devices`."""
        if self.devices != devices:
            raise MeshplanError(f"`layout` {self} multiplies to {self.devices} devices, not `devices` {devices}; "
                                f"make the degrees multiply to {devices}")

    def __str__(self) -> str:
        extra: tuple[tuple[str, int], ...] = (("pp", self.pipeline),) if self.pipeline > 1 else ()
        extra += (("vpp", self.virtual),) if self.virtual > 1 else ()
        ep = self.expert_parallel  # written as torchtitan's: dp_shard the ranks ep borrows from too
        items: list[tuple[str, int]] = []
        for k, n in (*self.sizes, *extra):
            if k == "ep" and "dp_shard" not in self.degree:
                items.append(("dp_shard", ep))
            items.append((k, n * ep if k == "dp_shard" else n))
        return ",".join(f"{k}={n}" for k, n in items)

    def check_experts(self, graph: OpGraph) -> None:
        """ep > 1 needs a mixture of experts whose every block's experts it divides."""
        ep = self.expert_parallel
        if ep == 1:
            return
        blocks = find_expert_blocks(graph)
        if not blocks:
            raise MeshplanError(f"`layout` ep={ep}: the model has no mixture-of-experts blocks to split; drop ep "
                                "(its ranks are data-parallel as dp_shard)")
        for b in blocks:
            if b.num_experts % ep:
                raise MeshplanError(f"`layout` ep={ep} does not divide the {b.num_experts} experts of "
                                    f"{b.module or b.topk}; pick an ep that divides {b.num_experts}")

    def input_pins(self, graph: OpGraph, mesh: DeviceMesh) -> dict[str, Spec]:
        """Every input split on its batch dim (0) over the data-parallel axes and on its sequence dim
        over cp (`check_context`), replicated elsewhere."""
        dp_axes = [a for a, name in enumerate(mesh.axis_names) if name in DATA_AXES and mesh.shape[a] > 1]
        cp_axes = [a for a, name in enumerate(mesh.axis_names) if name == "cp" and mesh.shape[a] > 1]
        seq = graph.sequence_dims() if cp_axes else {}
        pins = {}
        for t in graph.inputs:
            shape = graph.tensors[t].shape
            if dp_axes and (not shape or shape[0] < self.data_parallel):
                raise MeshplanError(f"`layout` {self}: input {t} has batch {shape[0] if shape else 0} per micro-step, "
                                    f"fewer than the {self.data_parallel} data-parallel ranks; raise the batch or "
                                    "lower dp_replicate × dp_shard")
            pins[t] = Spec(tuple(Shard(0) if a in dp_axes else Shard(seq[t]) if a in cp_axes and t in seq
                                 else Replicate() for a in range(mesh.ndim)))
        return pins

    def check_context(self, graph: OpGraph, causal: bool) -> None:
        """cp > 1 needs inputs with a sequence dim (`OpGraph.sequence_dims`) that cp divides, 2·cp under a
        causal mask (the zig-zag order: each rank two chunks of 2·cp, `costmodel/context.py`)."""
        cp = self.context_parallel
        if cp == 1:
            return
        seq = graph.sequence_dims()
        if not seq:
            raise MeshplanError(f"`layout` cp={cp}: the model's inputs have no sequence dim to split (none named "
                                "`seq`); drop cp, or export the model with its token dim named seq "
                                "(`meshplan export` does)")
        length = graph.dims.get("seq") or max(graph.tensors[t].shape[d] for t, d in seq.items())
        chunks = 2 * cp if causal else cp
        if length % chunks:
            raise MeshplanError(f"`layout` cp={cp} splits the sequence of {length} tokens into {chunks} "
                                f"{'zig-zag chunks (2·cp, a causal mask)' if causal else 'chunks'}, which does not "
                                f"divide it; pick a cp with {chunks // cp}·cp dividing {length}, or pad the sequence")

    def param_layout(self, graph: OpGraph, mesh: DeviceMesh) -> Callable[[str, Spec], Spec | None]:
        """A parameter as the layout stores it when a consumer needs it at `spec`: whole on
        dp_replicate; on dp_shard split on dim 0 (FSDP, gathered for use; a scalar stays whole), or on
        the first dim tp does not split where tp splits dim 0 (FSDP2 over a tensor-parallel shard
        splits that shard again — torch's _StridedShard — and gathers it over dp_shard alone; a spec
        splitting one dim over both axes would nest dp_shard outside tp and need tp to gather too);
        as needed on tp. On ep, a block's experts split on their experts' dim, as its expert gathers need
        them, and stored split over dp_shard on their next free dim; every other parameter as on dp_shard
        (split on dim 0 over both). None when the consumer would need it split along a data-parallel
        axis (or an expert whole along ep)."""
        replicate = [a for a, n in enumerate(mesh.axis_names) if n == "dp_replicate"]
        shard = [a for a, n in enumerate(mesh.axis_names) if n in ("dp_shard", "cp")]
        ep = [a for a, n in enumerate(mesh.axis_names) if n == "ep" and mesh.shape[a] > 1]
        experts = {p for b in find_expert_blocks(graph) for p in b.experts} if ep else set()

        def store(param: str, spec: Spec) -> Spec | None:
            placements = list(spec.placements)
            expert = param in experts
            for a in (*replicate, *shard, *([] if expert else ep)):
                if not isinstance(placements[a], Replicate):
                    return None
            if expert and not all(isinstance(placements[a], Shard) and placements[a] == Shard(0) for a in ep):
                return None
            shape = graph.tensors[param].shape
            if shape:
                taken = {p.dim for p in placements if isinstance(p, Shard)}
                split = shard + ([] if expert else ep)
                n = math.prod(mesh.shape[a] for a in split)
                free = [d for d in range(len(shape)) if d not in taken and shape[d] % n == 0] if split else []
                for a in split:
                    placements[a] = Shard(free[0] if 0 in taken and free else 0)
            return Spec(tuple(placements))

        return store


def parse_layout(text: str, devices: int) -> Layout:
    sizes: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, eq, value = part.partition("=")
        key = key.strip()
        if key not in (*LAYOUT_KEYS, *PIPELINE_KEYS):
            raise MeshplanError(f"`layout` {key}: unknown key; use {', '.join((*LAYOUT_KEYS, *PIPELINE_KEYS))} "
                                "(torchtitan's names, Megatron's pp and vpp)")
        if not eq or not value.strip().isdigit() or int(value) < 1:
            raise MeshplanError(f"`layout` {part}: give KEY=N with N a positive integer, e.g. dp_shard=8,tp=8")
        if key in sizes:
            raise MeshplanError(f"`layout` {key} given twice; give each degree once")
        sizes[key] = int(value)
    if sizes.get("cp", 1) > 1 and sizes.get("ep", 1) > 1:
        raise MeshplanError(f"`layout` cp={sizes['cp']} with ep={sizes['ep']}: context parallelism is planned beside "
                            "dp_replicate, dp_shard, tp and pp, not beside experts yet; drop one of them")
    if "ep" in sizes:  # torchtitan's: ep borrows its ranks from dp_shard
        ep, shard = sizes["ep"], sizes.get("dp_shard", 1)
        if shard % ep:
            raise MeshplanError(f"`layout` ep={ep} borrows its ranks from dp_shard, which is {shard}; give dp_shard "
                                f"a multiple of {ep} (e.g. dp_shard={ep * max(1, shard // ep)},ep={ep})")
        sizes["dp_shard"] = shard // ep
        if sizes["dp_shard"] == 1:
            del sizes["dp_shard"]
    layout = Layout(tuple((k, sizes[k]) for k in LAYOUT_KEYS if k in sizes), pipeline=sizes.get("pp", 1),
                    virtual=sizes.get("vpp", 1))
    if layout.virtual > 1 and layout.pipeline == 1:
        raise MeshplanError(f"`layout` vpp={layout.virtual}: virtual stages interleave a pipeline; give pp too")
    layout.check_devices(devices)
    return layout
