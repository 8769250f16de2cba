"""Apply a strategy with DTensor: every node runs on its local shards with the planned placements.

For each compute node, in order: each input is redistributed to the spec the plan requires (so the
collectives DTensor runs are the planned reshards), taken to its local shard with the gradient
placement the cost model assumes (partial on the mesh axes where the op is split and the input is
replicated), the op runs on local tensors (shape operands and the rules' local kernels adapted to
the shard), and its outputs are wrapped back with the planned output placements. Backward is torch
autograd through those same boundaries; after it, each parameter's gradient is reduced to the
parameter's placements (the data-parallel all-reduce, FSDP's reduce-scatter).
"""

from __future__ import annotations

import contextlib
import functools
from collections import ChainMap
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from core.context import RING, GatheredFeeds, cp_axis
from core.experts import EXPERT_PARALLEL, ExpertRegion, ep_axis, expert_region, find_expert_blocks
from core.graph import OpNode
from core.levers import Attention, Recompute
from core.placement import Spec, gradient_spec, split_axes
from costmodel.attention import AttentionRegion, attention_regions
from costmodel.autocast import LOW_OPS as AUTOCAST_LOW
from executor.context import ring_attention
from executor.dtensors import (
    contiguous_stride,
    full_grad,
    grad_as_partial,
    local_shape,
    local_shard,
    low_gather,
    mesh_coords,
    redistribute,
    scatter_first,
    shard_full,
    to_dtensor,
)
from executor.experts import run_expert_region
from executor.host_activations import HostActivations, planned_host_layers
from executor.interpreter import OnnxModule
from executor.kernels import run_local
from executor.ops import eager_attention, fused_attention
from executor.recompute import selective_contexts
from executor.zero import Regather, ZeroBucket, gather_units
from planner.strategy import Strategy


class SpmdRunner:
    """Runs one training forward of `module` under `strategy` on `mesh` (this process's rank). A pipeline
    stage's runner runs only its `nodes` and holds only the parameters they read (the module's others are
    dropped); `run_chunk` runs one model chunk of them."""

    def __init__(self, module: OnnxModule, strategy: Strategy, mesh: DeviceMesh,
                 nodes: Collection[str] | None = None) -> None:
        self.module, self.strategy, self.mesh = module, strategy, mesh
        mine = module.graph.compute_nodes if nodes is None else [n for n in module.graph.compute_nodes
                                                                 if n.name in set(nodes)]
        if nodes is not None:  # a stage: the other stages' parameters are not here
            read = {t for n in mine for t in n.inputs}
            for name in [n for n in module.param_names if n not in read]:
                del module.params[module.param_names.pop(name)]
        self.regather = Regather(self)  # ZeRO-3 / FSDP: gathered parameters gathered again for backward
        # A `mixed` plan (FSDP2's MixedPrecisionPolicy): split parameters gathered in bf16, their gradients
        # reduced in fp32 (`dtensors.low_gather`); the rest under autocast (`step.precision_context`).
        self.param_dtype = torch.bfloat16 if strategy.settings.dtype == "mixed" else None
        # ZeRO-1/2 per parameter as planned (files from before per-parameter stages: every parameter at or
        # above the threshold at the plan's stage). ZeRO-3 is in the placements: DTensor gathers them.
        tr = strategy.training
        self.zero_stages = tr.zero_stages
        self._has_zero2 = 2 in tr.zero_stages.values() if tr.zero_stages is not None else tr.zero_stage % 3 == 2
        self.zero_buckets: list[ZeroBucket] = []  # ZeRO-1/2: the buckets whose optimizer states are sharded
        self._gathers: list[list[ZeroBucket]] = []  # the buckets gathered together after the optimizer step
        self.mesh_shape = tuple(int(x) for x in mesh.shape)
        self.graph = module.graph
        self._constants: dict[tuple[str, tuple[Placement, ...]], torch.Tensor] = {}
        # Parameters are plain local shards (fast to update); their placements are kept here.
        self.stored: dict[str, list[Placement]] = {}
        for name, key in module.param_names.items():
            full = module.params[key].detach()
            placements = self.placements(name)
            module.params[key] = nn.Parameter(shard_full(full, placements, mesh).to_local().clone())
            self.stored[name] = placements
        # This step: parameter → axes its local gradient is partial on (reset by `zero_grad`).
        self.partial_grads: dict[str, set[int]] = {name: set() for name in self.stored}
        self._plans: dict[str, tuple[list[Any], list[list[Placement]], set[int], list[str]]] = {}
        self._grads: dict[str, list[tuple[list[Placement], bool] | None]] = {}  # per input: placements, any partial
        self._shape_operand: dict[str, torch.Tensor] = {}  # Reshape/Expand: the local output shape
        # cp's all-gather design: the keys' and values' feeds pass partial gradients back (as priced)
        feeds = GatheredFeeds.of(self.graph, strategy.mesh, [(r.nodes[0], r.nodes[-1])
                                                             for r in attention_regions(self.graph).values()])
        made = {t: sp.normalized(self.mesh_shape) for n in self.graph.compute_nodes
                for t, sp in zip(n.outputs, strategy.nodes[n.name].outputs, strict=False)} if feeds else {}
        for n in self.graph.compute_nodes:
            plan = strategy.nodes[n.name]
            in_specs = [x.normalized(self.mesh_shape) if x is not None else None for x in plan.inputs]
            out_specs = [x.normalized(self.mesh_shape) for x in plan.outputs]
            divided = split_axes([*in_specs, *out_specs], self.mesh_shape)  # as the cost model priced it
            want_in = [to_dtensor(sp) if sp is not None else None for sp in in_specs]
            want_out = [to_dtensor(sp) for sp in out_specs]
            self._plans[n.name] = (want_in, want_out, set(divided), list(plan.kernels))
            grads = [to_dtensor(gradient_spec(sp, feeds.gradient_split(t, made[t], sp, divided) if feeds and t in made
                                              else divided)) if sp is not None else None
                     for t, sp in zip(n.inputs, in_specs, strict=True)]
            self._grads[n.name] = [(gp, any(isinstance(p, Partial) for p in gp)) if gp is not None else None
                                   for gp in grads]
            if n.op_type in ("Reshape", "Expand"):
                self._shape_operand[n.name] = torch.tensor(
                    local_shape(self.graph.tensors[n.outputs[0]].shape, want_out[0], mesh), dtype=torch.int64)
        # Attention chains that run as one kernel: those the plan keeps local (no reshard inside).
        names = {n.name for n in mine}
        self.regions = {last: r for last, r in attention_regions(self.graph).items()
                        if self._is_local(r) and set(r.nodes) <= names}
        # Context parallelism's ring design: those chains whose products run the ring on the cp axis.
        self._cp = cp_axis(strategy.mesh)
        def ring(name: str) -> bool:
            return self._cp is not None and self._plans[name][3][self._cp:self._cp + 1] == [RING]

        chains = [r for r in attention_regions(self.graph).values() if r.nodes[0] in names]
        self.ring = {r.nodes[-1] for r in chains if ring(r.nodes[0]) and ring(r.nodes[-1])}
        mixed = [r.nodes[-1] for r in chains if ring(r.nodes[0]) != ring(r.nodes[-1])]
        if mixed:
            raise ValueError(f"the attention ending at {mixed[0]} runs one product as ring attention and the other "
                             "not; plan it with `cp_method` ring or allgather")
        if self.ring - set(self.regions):
            raise ValueError(f"the attention ending at {sorted(self.ring - set(self.regions))[0]} runs ring attention "
                             "but the plan moves tensors inside it; the executor runs a ring chain as one kernel")
        # Mixture-of-experts blocks split over ep: each block's expert region runs as one entry at its last
        # node, the tokens sent to their experts and back (`executor/experts.py`).
        self._ep = ep_axis(strategy.mesh)
        self.expert_regions = self._expert_regions(names)
        self.fused_away = {n for r in self.regions.values() for n in r.nodes[:-1]} | \
            {n for e in self.expert_regions.values() for n in e.nodes[:-1]}
        self.input_placements = {name: self.placements(name) for name in self.graph.inputs}
        # Where every activation lies (as produced: fixed by the plan) and the ops to run, with what
        # each needs, decided once: a step is then only the ops and the planned collectives.
        self.placed: dict[str, list[Placement]] = dict(self.input_placements)
        for n in self.graph.compute_nodes:
            self.placed.update(zip(n.outputs, self._plans[n.name][1], strict=False))
        direct = self._direct_inputs()
        self._program = [(n, self.regions.get(n.name) or self.expert_regions.get(n.name), direct[n.name],
                          self._plans[n.name][1], self._plans[n.name][3]) for n in mine if n.name not in self.fused_away]
        # Full recomputation: each repeated layer's run of the program is one checkpointed segment.
        self._selective: set[int] = set()  # segments recomputed selectively (`executor/recompute.py`)
        self._segments = self._recomputed_segments()
        # Layers whose saved activations the plan keeps on the host: start → end, as recomputed ones.
        self.host_activations = HostActivations()
        self._host_segments = self._layer_segments(self._host_layers())
        self._segment_reads, self._segment_outputs = self._segment_boundaries()
        # A tensor's shared redistributes are dropped after the program entry that reads it last.
        last: dict[str, int] = {}
        for i, (node, region, *_) in enumerate(self._program):
            reads = node.inputs if region is None else [self.graph.node_by_name[x].inputs[j] for x, j in region.inputs]
            last.update((t, i) for t in reads if t)
        self._last_read: dict[int, list[str]] = {}
        for t, i in last.items():
            self._last_read.setdefault(i, []).append(t)
        # Measuring memory (executor/measure.py's SavedMeter): told the tensors held after forward for the
        # recomputed segments, and a context each recomputation runs in.
        self.on_kept: Callable[[list[torch.Tensor]], object] | None = None
        self.recompute_watch: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
        self.params = {name: module.params[key] for name, key in module.param_names.items()}
        self._buckets: list[tuple[tuple[int, ...], torch.Tensor]] | None = None  # packed at the first reduction
        self._bucketed: set[str] = set()
        # Axes on which each parameter's local gradient is left partial by some use (and so reduced,
        # bucketed, after backward): every other use must then contribute a partial gradient too.
        self.reduced_axes: dict[str, set[int]] = {name: set() for name in self.stored}
        for n in mine:
            want_in, _, split, _ = self._plans[n.name]
            for t, want in zip(n.inputs, want_in, strict=True):
                if t in self.stored and want == self.stored[t]:
                    self.reduced_axes[t] |= {a for a in split if isinstance(want[a], Replicate)}

    def _expert_regions(self, names: set[str]) -> dict[str, ExpertRegion]:
        """The expert regions of the blocks whose gathers the plan splits over ep, by their last node."""
        a = self._ep
        if a is None:
            return {}
        out = {}
        for block in find_expert_blocks(self.graph):
            if block.gathers[0] not in names:  # another pipeline chunk's
                continue
            kernels = self._plans[block.gathers[0]][3]
            if len(kernels) <= a or kernels[a] != EXPERT_PARALLEL:
                continue
            region = expert_region(self.graph, block)
            if region is None or not set(region.nodes) <= names:
                raise ValueError(f"the experts of {block.module or block.topk} are not one row-wise region the "
                                 "executor can run expert-parallel (`preflight.check_step` refuses such plans)")
            out[region.nodes[-1]] = region
        return out

    def _region_op(self, name: str, x: list[Any]) -> list[Any]:
        node = self.graph.node_by_name[name]
        return self._run_local(node, x, self._plans[name][1], self._plans[name][3])

    def _is_local(self, region: AttentionRegion) -> bool:
        """The plan runs the chain without moving its inner tensors: every inner edge is consumed in
        the spec it is produced in, none partial."""
        produced: dict[str, list[Placement]] = {}
        for name in region.nodes:
            node = self.graph.node_by_name[name]
            want_in, want_out, _, _ = self._plans[name]
            for t, want in zip(node.inputs, want_in, strict=True):
                if t in produced and want != produced[t]:
                    return False
            for t, placements in zip(node.outputs, want_out, strict=False):
                if name != region.nodes[-1] and any(isinstance(p, Partial) for p in placements):
                    return False
                produced[t] = placements
        return True

    def _direct_inputs(self) -> dict[str, list[bool]]:
        """Per node, the inputs it reads as they are: activations produced in the placements the node
        requires whose gradient needs no reduction. Placements are fixed by the plan, so this is
        decided once; every other input goes through `prepare` (parameters, constants, reshards)."""
        produced = self.placed
        out = {}
        for n in self.graph.compute_nodes:
            want_in = self._plans[n.name][0]
            out[n.name] = [bool(t) and t in produced and w is not None and grad is not None and not grad[1]
                           and produced[t] == w for t, w, grad in zip(n.inputs, want_in, self._grads[n.name], strict=True)]
        return out

    def shard_inputs(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's shards of a batch every rank holds whole: what its data loader would give it."""
        return [local_shard(x, self.input_placements[name], self.mesh) for name, x in zip(self.graph.inputs, inputs,
                                                                                        strict=True)]

    def placements(self, tensor: str) -> list[Placement]:
        """Where the plan stores a parameter or feeds an input (replicated when it does not say)."""
        spec = self.strategy.spec_of(tensor)
        return self.dtensor(spec if spec is not None else Spec.replicated(self.mesh.ndim))

    def dtensor(self, spec: Spec) -> list[Placement]:
        """A planned spec as DTensor placements on this mesh (an axis of one device: replicated)."""
        return to_dtensor(spec.normalized(self.mesh_shape))

    def forward(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The whole graph. `inputs`: this rank's shards (`shard_inputs`); returns the outputs' local
        tensors, placed as the plan says (`output_as` moves them)."""
        return self._forward(dict(zip(self.graph.inputs, inputs, strict=True)), 0, len(self._program),
                             self.graph.outputs)

    def run_chunk(self, feeds: Mapping[str, torch.Tensor], nodes: Collection[str],
                  outputs: Sequence[str]) -> list[torch.Tensor]:
        """One pipeline chunk: its `nodes` (a contiguous run of the program) on the tensors an earlier
        chunk sent (`feeds`: local, placed as the plan produces them); returns `outputs`, local."""
        at = [i for i, entry in enumerate(self._program) if entry[0].name in nodes]
        if at and at[-1] - at[0] + 1 != len(at):
            raise ValueError("a pipeline chunk's nodes are not one contiguous run of the program")
        return self._forward(feeds, at[0] if at else 0, at[-1] + 1 if at else 0, outputs)

    def _forward(self, feeds: Mapping[str, torch.Tensor], start: int, end: int,
                 outputs: Sequence[str]) -> list[torch.Tensor]:
        """Activations stay local tensors with known placements; DTensor is entered only where the
        plan reshards a tensor or where its gradient comes out partial and must be reduced — one
        cached wrapper per tensor, so that several consumers' partial gradients sum before the one
        reduction."""
        g, mesh = self.graph, self.mesh
        local: dict[str, Any] = dict(self.module.values)  # constants: whole on every rank
        spec = self.placed
        wrapped: dict[str, DTensor] = {}
        local.update(feeds)
        params = self.params
        # Where the ops read and write: these two dicts, or a recomputed segment's own scope over them.
        # Activations redistributed, each once for the consumers of one layer that need it in one spec
        # with the same gradient placements (`costmodel.comm.shared_reshard`); a recomputed layer
        # redistributes anew. Dropped after the tensor's last reader (from a recomputed layer's dict and
        # the step's), and all of them when the forward ends.
        resharded: dict[str, dict[Any, Any]] = {}
        scope: dict[str, Any] = {"local": local, "wrapped": wrapped, "resharded": resharded}

        def prepare(node_name: str, i: int) -> Any:
            """Input i of a node, local, as the node's strategy requires it."""
            local, wrapped = scope["local"], scope["wrapped"]
            t = g.node_by_name[node_name].inputs[i]
            want_in, _, split, _ = self._plans[node_name]
            want = want_in[i]
            if not t:
                return None
            if t in params:
                assert want is not None
                grad_info = self._grads[node_name][i]
                assert grad_info is not None
                return self._param(t, params[t], want, split, grad_info[0], wrapped,
                                   low=g.node_by_name[node_name].op_type in AUTOCAST_LOW)
            if t not in spec:  # a constant, whole on every rank: its placement is a local slice
                return self._constant(t, local.get(t), want)
            if want is None:  # read for its dtype or shape only
                return local[t].detach() if isinstance(local[t], torch.Tensor) else local[t]
            grad_info = self._grads[node_name][i]
            assert grad_info is not None
            grad, any_partial = grad_info
            if spec[t] == want and not (any_partial and local[t].requires_grad):
                return local[t]  # already there, nothing to reduce: no DTensor at all
            key = (g.layer_of.get(node_name), tuple(want), tuple(grad))  # once per layer, as priced
            cached = scope["resharded"].setdefault(t, {})
            if key in cached:
                return cached[key]
            if t not in wrapped:
                shape = g.tensors[t].shape
                wrapped[t] = DTensor.from_local(
                    local[t], mesh, spec[t], shape=torch.Size(shape), stride=contiguous_stride(shape),
                    grad_placements=[Replicate() if isinstance(p, Partial) else p for p in spec[t]])
            out = cached[key] = redistribute(wrapped[t], want).to_local(grad_placements=grad)
            return out

        attention = eager_attention if self.strategy.training.attention == Attention.EAGER else fused_attention

        def run(start: int, end: int) -> None:
            local = scope["local"]
            for at, (node, region, direct, want_out, kernels) in enumerate(self._program[start:end], start):
                if isinstance(region, ExpertRegion):  # the block's experts, where they are
                    assert self._ep is not None
                    outs = [run_expert_region(region, {k: prepare(*k) for k in region.inputs}, g,
                                              self.mesh.get_group(self._ep), self.mesh_shape[self._ep], self._region_op)]
                elif region is not None and node.name in self.ring:  # its keys and values passed round cp
                    assert self._cp is not None
                    q, kt, *mask, v = (prepare(n, i) for n, i in region.inputs)
                    outs = [ring_attention(q, kt, mask[0] if mask else None, v, self.mesh.get_group(self._cp))]
                elif region is not None:  # the attention chain ending here, as the planned kernel(s)
                    outs = [attention(*(prepare(n, i) for n, i in region.inputs))]
                else:
                    outs = self._run_local(node, [local[t] if d else prepare(node.name, i)
                                                  for i, (t, d) in enumerate(zip(node.inputs, direct, strict=True))],
                                           want_out, kernels)
                local.update(zip(node.outputs, outs, strict=False))
                for t in self._last_read.get(at, ()):
                    scope["resharded"].pop(t, None)
                    resharded.pop(t, None)

        forward = [True]

        def segment(start: int, end: int) -> None:
            """A recomputed layer, in a scope of its own: what it makes is dropped when it returns, but
            for what is read after it (in forward; its recomputation in backward publishes nothing)."""
            outer = dict(scope)
            scope["local"], scope["wrapped"], scope["resharded"] = ChainMap({}, local), ChainMap({}, wrapped), {}
            try:
                run(start, end)
                if forward[0]:
                    made = scope["local"].maps[0]
                    local.update((t, made[t]) for t in self._segment_outputs[start] if t in made)
                    wrapped.update((t, w) for t, w in scope["wrapped"].maps[0].items() if t not in made)
            finally:
                scope.update(outer)

        with self.regather.saving():
            self._run_program(run, segment, start, end)
        forward[0] = False
        resharded.clear()
        result = [local[t] for t in outputs]
        if self._segments:  # the checkpoints hold `run` until backward, and with it these dicts: keep only
            keep = self._segment_reads  # what the recomputed layers read (their inputs), and constants
            for d in (local, wrapped):
                for t in [t for t in d if t not in keep and t not in self.module.values and t not in params]:
                    del d[t]
            if self.on_kept is not None:  # its record lives in the dict, as long as what it counts
                local[" kept"] = self.on_kept([v for t, v in local.items()
                                               if isinstance(v, torch.Tensor) and t not in self.module.values])
        return result

    def _run_program(self, run: Any, segment: Any, start: int, end: int) -> None:
        i = start
        if self._host_segments:  # a forward (of a pipeline stage: a chunk)
            self.host_activations.begin([*self.params.values(), *(v for v in self.module.values.values()
                                                                  if isinstance(v, torch.Tensor))])
        while i < end:
            stop = self._segments.get(i)
            if stop is None and (on_host := self._host_segments.get(i)) is not None:
                self.regather.to_host = self.host_activations.pack  # what its ops save, copied to the host
                try:
                    run(i, min(on_host, end))
                finally:
                    self.regather.to_host = None
                i = min(on_host, end)
            elif stop is None:
                run(i, i + 1)
                i += 1
            else:  # a recomputed layer: nothing inside it saved, all its ops (and reshards) run again in backward
                # (selectively: attention's and every other matmul's outputs saved, the rest run again)
                contexts = functools.partial(self._recompute_contexts, i in self._selective)
                with set_checkpoint_early_stop(False):  # as planned: the whole layer, not up to its last saved tensor
                    checkpoint(segment, i, stop, use_reentrant=False, context_fn=contexts)
                i = stop

    def _recompute_contexts(self, selective: bool) -> tuple[contextlib.AbstractContextManager[Any],
                                                             contextlib.AbstractContextManager[Any]]:
        """checkpoint's (forward, recomputation) contexts: the meter's watch around each recomputation;
        selective recomputation's, what its forward saves counted by the meter (`on_kept`)."""
        watch = (self.recompute_watch or contextlib.nullcontext)()
        if not selective:
            return contextlib.nullcontext(), watch
        forward, recompute = selective_contexts(self.on_kept)

        @contextlib.contextmanager
        def both() -> Iterator[None]:
            with watch, recompute:
                yield

        return forward, both()

    def _segment_boundaries(self) -> tuple[frozenset[str], dict[int, frozenset[str]]]:
        """What the recomputed segments read from outside themselves (kept from forward to backward),
        and per segment what it makes that is read after it (by any node of the graph, or an output)."""
        g = self.graph
        read_by: dict[str, set[str]] = {}
        for n in g.compute_nodes:
            for t in n.inputs:
                read_by.setdefault(t, set()).add(n.name)
        reads: set[str] = set()
        outs: dict[int, frozenset[str]] = {}
        for a, b in self._segments.items():
            entries = self._program[a:b]
            inside = {n.name for node, region, *_ in entries for n in
                      ([node] if region is None else [g.node_by_name[x] for x in region.nodes])}
            made = {t for node, *_ in entries for t in node.outputs if t}
            ins: set[str] = set()
            for node, region, *_ in entries:
                ins.update(node.inputs if region is None else (g.node_by_name[x].inputs[i] for x, i in region.inputs))
            reads |= {t for t in ins if t and t not in made}
            outs[a] = frozenset(t for t in made if (read_by.get(t, set()) - inside) or t in g.outputs)
        return frozenset(reads), outs

    def _recomputed_segments(self) -> dict[int, int]:
        """Program index where each recomputed layer starts → where it ends (exclusive): the first layers
        of each group the plan recomputes fully, every layer of a group it recomputes selectively (their
        starts in `_selective`)."""
        tr = self.strategy.training
        layers: list[tuple[str, ...]] = []
        for group in self.graph.layers:
            policy = tr.recompute.get(group.prefix)
            if policy not in (Recompute.FULL, Recompute.SELECTIVE):
                continue
            count = group.num_layers if policy == Recompute.SELECTIVE else tr.recomputed_layers(group.prefix,
                                                                                                group.num_layers)
            layers += group.nodes[:count]
            if policy == Recompute.SELECTIVE:
                self._selective.update(self._layer_segments(group.nodes[:count]))
        return self._layer_segments(layers)

    def _host_layers(self) -> list[tuple[str, ...]]:
        """The layers whose saved activations the plan keeps on the host (`costmodel/host_activations.py`)."""
        tr = self.strategy.training
        on_host, _, _ = planned_host_layers(tr, self.graph)
        by_layer: dict[str, list[str]] = {}
        for node, layer in on_host.items():
            by_layer.setdefault(layer, []).append(node)
        return [tuple(ns) for ns in by_layer.values()]

    def _layer_segments(self, layers: Sequence[Sequence[str]]) -> dict[int, int]:
        """Program index where each of `layers` (its nodes) starts → where it ends (exclusive), for those
        whose ops are one contiguous run of the program (every layer of the zoo's models)."""
        at = {entry[0].name: i for i, entry in enumerate(self._program)}
        out = {}
        for names in layers:
            idx = sorted(at[n] for n in names if n in at)
            if idx and idx[-1] - idx[0] + 1 == len(idx):
                out[idx[0]] = idx[-1] + 1
        return out

    def output_as(self, index: int, local: torch.Tensor, want: list[Placement]) -> torch.Tensor:
        """Output `index` (this rank's local tensor from `forward`) brought to the placements `want`:
        the tensor itself when it lies there, else through DTensor's redistribute (its planned
        collectives, and their backward)."""
        t = self.graph.outputs[index]
        have = self.placed[t]
        if have == want:
            return local
        shape = self.graph.tensors[t].shape
        y = DTensor.from_local(local, self.mesh, have, shape=torch.Size(shape), stride=contiguous_stride(shape),
                               grad_placements=[Replicate() if isinstance(p, Partial) else p for p in have])
        return redistribute(y, want).to_local(grad_placements=want)

    def _param(self, name: str, p: torch.Tensor, want: list[Placement], split: set[int], grad: list[Placement],
               wrapped: dict[str, DTensor], *, low: bool = False) -> torch.Tensor:
        """A parameter's local value as a node needs it. Stored as required: the local shard itself,
        its gradient left partial on the split axes for the bucketed reduction (`reduce_gradients`).
        Otherwise through DTensor (the planned reshard and its backward); a gathered one a matmul
        (`low`) reads under autocast cast here, so backward saves a copy the re-gather can remake."""
        stored = self.stored[name]
        reduced = self.reduced_axes[name]
        if want == stored:
            here = {a for a in split if isinstance(want[a], Replicate)}
            self.partial_grads[name] |= reduced
            return grad_as_partial(p, self.mesh, reduced - here)
        gathered = any(isinstance(s, Shard) and isinstance(w, Replicate) for s, w in zip(stored, want, strict=True))
        whole_reduced = {a for a in reduced if isinstance(stored[a], Replicate)}
        if self.param_dtype is not None and p.is_floating_point() and not whole_reduced and any(
                isinstance(s, Shard) and not isinstance(w, Shard) for s, w in zip(stored, want, strict=True)):
            # a `mixed` plan: gathered (to whole, or whole then addends) as the policy gathers
            to_partial = {a for a, w in enumerate(want) if isinstance(w, Partial)}
            whole = [Replicate() if a in to_partial else w for a, w in enumerate(want)]
            arrives = [Partial() if a in to_partial else g for a, g in enumerate(grad)]  # summed over the axes
            local = low_gather(p, self.mesh, stored, whole, arrives, self.graph.tensors[name].shape, self.param_dtype,
                               ordered=not to_partial)  # (addends: in DTensor's order, as priced)
            if to_partial and not all(mesh_coords(self.mesh)[a][1] == 0 for a in to_partial):
                local = local * 0  # addends: the first rank of each group keeps the value (`redistribute`)
            if not low:  # an op autocast runs in fp32 (a norm's weight) reads the bf16 values in fp32, as
                local = local.to(p.dtype)  # autocast would cast them (CPU kernels refuse bf16 beside fp32)
            self.regather.gathered(name, want, local, None if low else p.dtype, gather_dtype=self.param_dtype)
            return local
        if name not in wrapped:
            shape = self.graph.tensors[name].shape
            source = grad_as_partial(p, self.mesh, whole_reduced)
            wrapped[name] = DTensor.from_local(source, self.mesh, stored, shape=torch.Size(shape),
                                               stride=contiguous_stride(shape), grad_placements=stored)
        out = redistribute(wrapped[name], want)
        if not any(isinstance(w, Partial) for w in want):  # (addends: DTensor's order, as priced)
            out = scatter_first(out, stored, grad)
        local = out.to_local(grad_placements=grad)
        if gathered:
            autocast = low and torch.is_autocast_enabled(local.device.type) and local.is_floating_point()
            dtype = torch.get_autocast_dtype(local.device.type) if autocast else None
            local = local.to(dtype) if dtype is not None else local
            self.regather.gathered(name, want, local, dtype)
        return local

    def reduce_gradients(self) -> int:
        """After the step's last micro-batch: all-reduce the partial local gradients, packed into buckets
        like DDP; returns the bucket count. The first call packs them; from then on each gradient is a
        view of its bucket (DDP's gradient_as_bucket_view): backward accumulates into the bucket, which
        is reduced in place. Under ZeRO-1 a bucket is reduce-scattered instead, each rank keeping its
        shard's sum for its optimizer step (ZeRO-2 did that after every micro-batch)."""
        import torch.distributed as dist

        late = self._buckets is None  # packed only now: ZeRO-2's gradients were not reduce-scattered yet
        if late:
            self._pack()
        assert self._buckets is not None
        if late:
            self.after_micro_batch()  # the micro-batches' sum at once (a pipeline's first step)
        for axes, flat in self._buckets:
            for a in axes:
                dist.all_reduce(flat, group=self.mesh.get_group(a))
        for b in self.zero_buckets:
            if b.stage == 1:
                assert b.grads is not None  # ZeRO-1 buckets keep the whole gradients
                b.reduce_scatter(b.grads)
        return len(self._buckets) + len(self.zero_buckets)

    @property
    def packed(self) -> bool:
        """The gradient buckets exist (after the first step's reduction, or its first micro-batch)."""
        return self._buckets is not None

    def after_micro_batch(self) -> None:
        """ZeRO-2: each micro-batch's gradients reduce-scattered at once and added to this rank's shard;
        the whole gradients freed until the next backward."""
        if not self._has_zero2:
            return
        if self._buckets is None:
            self._pack()
        for b in self.zero_buckets:
            if b.stage != 2:
                continue
            params = [self.params[n] for n in b.names]
            flat = torch.zeros_like(b.weights)
            torch.cat([p.grad.reshape(-1) for p in params], out=flat[:b.numel])  # every one set: see `_pack`
            b.reduce_scatter(flat, accumulate=True)
            for p in params:
                p.grad = None

    def _pack(self) -> None:
        """This step's partial gradients (the same parameters every step: the plan fixes them) into flat
        buckets (`costmodel.buckets`). Without ZeRO each gradient becomes a view of its bucket; with it,
        the parameters of a bucket become views of one flat buffer too (the seed's tensor fusion), of
        which each rank of the data-parallel group owns a contiguous shard for the optimizer."""
        from costmodel.buckets import gather_groups, pack_buckets, zero_units

        grads = {name: (tuple(sorted(axes)), float(p.numel() * p.element_size()))
                 for name, axes in self.partial_grads.items() if axes and (p := self.params[name]).grad is not None}
        tr = self.strategy.training
        if self.zero_stages is not None:
            stages = {n: s for n, s in self.zero_stages.items() if n in grads}
        else:
            stages = {n: tr.zero_stage % 3 for n, (_, nbytes) in grads.items()
                      if tr.zero_stage % 3 and nbytes >= tr.zero_threshold_bytes}
        self._buckets = []
        units = zero_units({n: grads[n] for n in stages}, stages, tr.comm_fusion)
        for unit in units:
            self._bucketed.update(unit.names)
            self.zero_buckets.append(ZeroBucket.pack(self, unit))
        self._gathers = [[self.zero_buckets[i] for i in group] for group in gather_groups(
            units, {n: grads[n][1] for u in units for n in u.names}, tr.comm_fusion.allgather)]
        for axes, names in pack_buckets({n: g for n, g in grads.items() if n not in stages}, tr.comm_fusion.allreduce):
            self._bucketed.update(names)
            params = [self.params[n] for n in names]
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # every one set: see `grads`
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            self._buckets.append((axes, flat))

    def optimizer_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: every parameter, except that a ZeRO bucket is stepped on this rank's
        shard of it only (call after the first step, which packs the buckets)."""
        return [p for _, p in self.optimizer_groups()]

    def optimizer_groups(self) -> list[tuple[tuple[str, ...], torch.nn.Parameter]]:
        """`optimizer_parameters`, each with the graph parameters it holds (a ZeRO bucket's, or one)."""
        zeroed = {n for b in self.zero_buckets for n in b.names}
        return [((n,), p) for n, p in self.params.items() if n not in zeroed] + \
            [(tuple(b.names), b.shard) for b in self.zero_buckets]

    def after_optimizer_step(self) -> None:
        """ZeRO: every rank's updated shard all-gathered into the flat parameters (the module's views)."""
        for group in self._gathers:
            gather_units(group)

    def zero_grad(self) -> None:
        """Before a step: bucketed gradients zeroed in place (one fill per bucket, their views kept),
        ZeRO shards' gradients too, the others unset."""
        for _, flat in self._buckets or ():
            flat.zero_()
        for b in self.zero_buckets:
            b.zero_grad()
        for name, p in self.params.items():
            if name not in self._bucketed or any(b.stage == 2 and name in b.names for b in self.zero_buckets):
                p.grad = None
        self.partial_grads = {name: set() for name in self.params}

    def gradient(self, name: str) -> torch.Tensor:
        """The step's reduced gradient of a parameter, whole (for verification: ZeRO keeps only a shard)."""
        for b in self.zero_buckets:
            if name in b.names:
                return b.full_gradient(name, self.params[name])
        return self.full_parameter(name, full_grad(self.params[name]))

    def grad_shard_bytes(self) -> int:
        """Bytes of gradient shards held apart from the parameters' gradients (ZeRO-2)."""
        return sum(b.shard.grad.numel() * b.shard.grad.element_size() for b in self.zero_buckets
                   if b.stage == 2 and b.shard.grad is not None)

    def full_parameter(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The whole parameter (or gradient) from this rank's shard: a gather over the mesh."""
        shape = self.graph.tensors[name].shape
        return DTensor.from_local(value, self.mesh, self.stored[name], shape=torch.Size(shape),
                                  stride=contiguous_stride(shape)).full_tensor()

    def _constant(self, name: str, value: Any, want: list[Placement] | None) -> Any:
        """A constant's local slice (zero-filled where the plan needs it partial), computed once."""
        if want is None or not isinstance(value, torch.Tensor):
            return value
        key = (name, tuple(want))
        if key not in self._constants:
            whole = [Replicate() if isinstance(p, Partial) else p for p in want]
            self._constants[key] = redistribute(shard_full(value, whole, self.mesh), want).to_local().detach()
        return self._constants[key]

    def _run_local(self, node: OpNode, x: list[Any], want_out: list[list[Placement]], kernels: list[str]) -> list[Any]:
        if node.op_type in ("Reshape", "Expand"):  # the shape operand describes the local output
            x = [x[0], self._shape_operand[node.name], *x[2:]]
        return run_local(node, x, kernels, mesh_coords(self.mesh), self.graph)
