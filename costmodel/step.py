"""Pricing one training step under a plan: per-node and per-edge items, kept split (`PricedStep`);
`compose.py` adds them up into the step's time and memory under a policy.

A plan chooses one `OpStrategy` per compute node and one spec per parameter. Its step costs
- compute: every node's forward and backward time on its local shard (`compute.py`);
- communication, every collective listed with its phase and purpose, all of it on edges (a tensor
  from the spec it is produced in to the spec a consumer requires):
  * forward: the reshard (`reshard.plan_reshard`);
  * backward, per mesh axis: if the consumer is *split* on the axis (some input or output of its
    strategy is not replicated there) and requires the tensor replicated there, the gradient comes
    out partial and is reduced — by a reduce_scatter when the forward gathered a shard (all_gather ↔
    reduce_scatter, FSDP's pattern; a parameter is also gathered again for backward), else by an all_reduce (a parameter's data-parallel gradient
    sync; Megatron's all-reduce of a column-parallel matmul's input gradient). Otherwise the forward
    step's conjugate runs: a slice's gradient is all-gathered, a reduce_scatter's too, an all_to_all's
    goes back by all_to_all, an all_reduce's and a gather's need nothing, R → P needs an all_reduce;
  A tensor read by several consumers has its partial gradient reduced once per axis (autograd sums
  the partials first), and an activation several consumers need in one spec (with the same gradient
  placements) is redistributed once for them (`comm.shared_reshard`; the executor does the same). Parameter-gradient all-reduces are bucketed (25 MiB, DDP's default,
  `buckets.py`): the plan is priced per bucket, each gradient carrying its share of its bucket's time;
  an edge alone pays its share of the latency of a bucket holding every gradient;
- the loss on the output (`loss.py`), charged to the node producing it: its kernels, the collectives
  that bring the output where the loss needs it, the log-probabilities it saves;
- memory per device: model states of every parameter at its spec, plus the activations saved for
  backward at their local size (a sum over the step, not a liveness peak).
Graph inputs arrive in the spec their consumers require (the loader splits the batch), need no gradient;
constants cost nothing. Every collective carries its phase, purpose and cadence (per micro-batch, or
per step for a parameter's gradient reduction); the composer adds the items into a step (`compose.py`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from core.collectives import Cadence, Collective, Phase, PricedCollective, Purpose, cadence_of
from core.context import RING, GatheredFeeds, cp_axis
from core.experts import CAPACITY_FACTOR, EXPERT_PARALLEL, ep_axis, splits_over
from core.graph import OpGraph, OpNode, TensorKind
from core.levers import Attention, Composer, LossKind, Offload, Recompute, Runtime, lever
from core.mesh import DeviceMesh
from core.placement import OpStrategy, Partial, Shard, Spec, gradient_spec, split_axes
from core.reshard import conjugate, plan_reshard
from costmodel import autocast
from costmodel.attention import (
    AttentionRegion,
    attention_regions,
    causal_regions,
    grouped_kv,
    kernels_s,
    materialized_kernels,
)
from costmodel.bucketing import price_buckets
from costmodel.buckets import CommFusion
from costmodel.comm import collective_time_s, seen_reduction, shared_reshard
from costmodel.compose import StepCost, compose, hides_under_backward, prefetched
from costmodel.compute import (
    ComputeCost,
    compute_cost,
    local_shapes,
    tensor_bytes,
)
from costmodel.context import ring_events
from costmodel.experts import NO_COST, ExpertOps, dispatch_events, grouped_gemm_cost
from costmodel.flash import flash_cost
from costmodel.fusion import compiled
from costmodel.host_activations import host_layers, price_host_activations
from costmodel.items import HostCopy, LossCost, NodeCost, PricedStep
from costmodel.loss import loss_cost, loss_input_spec, loss_kind
from costmodel.memory import (
    ALIAS_OPS,
    Precision,
    attention_score_tensors,
    backward_reads,
    gradient_tensors,
    read_in_backward,
    saved_tensors,
)
from costmodel.states import ModelStates
from hwprofiles.profile import HardwareProfile

# Activation recomputation of the repeated layers. Full: each layer's forward again in backward from
# its input. Selective: op-level selective checkpointing (torchtitan's `op_sac`; `run` and
# `meshplan.apply` run it, `executor/recompute.py`): in each layer the outputs of attention and of every
# other matmul (the 1st, 3rd, … in the layer's order) are saved, everything else — its collectives
# too, as under full — is run again from them in backward. (Korthikanti et al.'s selective — attention's
# scores recomputed — is what the fused attention priced here does anyway.) The policies a cost model prices (AUTO is the search's: it
# counts the recomputed layers).
RECOMPUTE = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
MATMULS = frozenset({"MatMul", "Gemm"})  # what selective recomputation alternates on (torch: mm, addmm, bmm)


class CostModel:
    """Prices strategies of one graph on one mesh and profile, in one precision."""

    def __init__(self, graph: OpGraph, mesh: DeviceMesh, profile: HardwareProfile, precision: Precision, *,
                 enable_all_to_all: bool = True, fusion: CommFusion | None = None, loss: str = LossKind.AUTO,
                 micro_batches: int = 1, zero_stage: int = 0, recompute: str = Recompute.NONE,
                 composer: str = Composer.SERIAL, zero_threshold_bytes: float = 0.0,
                 recompute_layers: Mapping[str, int] | None = None,
                 fp32_communication: bool = False, zero_shard_size: int | None = None, attention: str = Attention.FLASH,
                 attention_dropout: float = 0.0, runtime: str = Runtime.EAGER, full_batch: bool = False,
                 capacity_factor: float = CAPACITY_FACTOR) -> None:
        """`micro_batches`: gradient accumulation steps (the graph is bound at one micro-step's batch);
        `zero_stage`: every parameter's ZeRO stage unless a plan says otherwise (`price_items`' `zero`):
        1 shards optimizer states, 2 also gradients, over the axes a parameter's gradient is all-reduced
        on (3: the parameters' placements are split over those axes, priced as such); `fusion`: the
        bucket caps of gradient all-reduces and ZeRO's reduce-scatters and gathers (`buckets.py`);
        `zero_threshold_bytes`: parameters smaller (at the training dtype) stay unsharded under ZeRO-1/2
        (MindSpore's parallel_optimizer_threshold); `recompute`: "full" keeps only each repeated
        layer's input and runs its forward again in backward (torch.utils.checkpoint per layer) — of
        every layer, or of the first `recompute_layers[group]` layers of a group (Megatron's block
        method) —, "selective" saves attention's and every other matmul's outputs and recomputes the rest
        (`RECOMPUTE`), "none" saves every activation; `composer`: the step composer's
        policy; `fp32_communication`: all-reduces and reduce-scatters carry fp32 whatever the training
        dtype (MindSpore's force_fp32_communication); `zero_shard_size`: ZeRO-1/2 shard groups of that
        many ranks, the inner ones of a gradient's data-parallel group (optimizer_weight_shard_size);
        `attention`: how the runtime runs attention (`attention.ATTENTION_KERNELS`): FlashAttention, or
        with its s×s tensors in memory (torch's eager ops, Megatron-LM's fused softmax), whose kernels
        `attention.materialized_kernels` lists — with dropout on the probabilities when
        `attention_dropout` > 0 (FlashAttention drops in-kernel: no cost); `full_batch`: every rank loads
        each input whole and slices its share (MindSpore's dataset_strategy full_batch): the rows beyond
        its share cross the host link for nothing, each micro-batch (`planner/search/dataset.py`);
        `capacity_factor`: the tokens a mixture-of-experts block's expert is sized for, its uniform share
        times this (`costmodel/experts.py`)."""
        self.full_batch = full_batch
        self.fp32_communication = fp32_communication
        attention, composer = lever(Attention, attention, "attention"), lever(Composer, composer, "composer")
        recompute = lever(Recompute, recompute, "recompute")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout}")
        self.attention, self.attention_dropout = attention, attention_dropout
        self.zero_shard_size = zero_shard_size  # optimizer_weight_shard_size: ranks a ZeRO shard group spans
        self.composer = composer
        self.zero_threshold_bytes = zero_threshold_bytes
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
        precision = autocast.for_graph(precision, graph, "cuda" if profile.device.is_gpu else "cpu")
        # A compiled runtime's fused chains (`fusion.py`): what stays inside one is not written or saved.
        self.runtime = lever(Runtime, runtime, "runtime")
        self.chains, internal, precision = compiled(graph, precision, self.runtime)
        self.graph, self.mesh, self.profile, self.precision = graph, mesh, profile, precision
        # ZeRO-3 is in the parameters' placements (split, gathered for use): priced by them, not here.
        self.micro_batches, self.zero_stage, self.recompute = micro_batches, zero_stage % 3, recompute
        self.states = ModelStates(graph, mesh, profile, precision, zero_stage % 3, zero_threshold_bytes, zero_shard_size)
        # Recomputed layers: node → its layer's key; node → the layer inputs it is the first to read.
        self.layer_of: dict[str, tuple[int, int]] = {}
        self.layer_inputs: dict[str, tuple[str, ...]] = {}
        self.recompute_layers = dict(recompute_layers or {})
        if recompute in (Recompute.FULL, Recompute.SELECTIVE):  # (selective: every layer of every group)
            self._find_recomputed_layers(every=recompute is Recompute.SELECTIVE)
        self.loss = loss_kind(graph, loss)
        self.loss_tensor = graph.outputs[0]
        self.enable_all_to_all = enable_all_to_all
        self.fusion = fusion or CommFusion()
        # What one bucket holds when every gradient is reduced whole: a gradient's share of a bucket's
        # latency, as an edge is priced alone (`price` packs the plan's actual buckets).
        total = max(1.0, sum(float(t.numel) * precision.grad_bytes for t in graph.params))
        self.bucket_fill = {kind: min(self.fusion.as_dict()[name], total) for kind, name in _FUSED.items()}
        # Mixture-of-experts blocks: their matmuls priced as grouped GEMMs, the gathered weights as views.
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
        self.capacity_factor = capacity_factor
        self.experts = ExpertOps(graph)
        self.ep_axis = ep_axis(mesh) if self.experts.blocks else None
        self.ep_blocks = frozenset(b.topk for b in self.experts.blocks if self.ep_axis is not None
                                   and splits_over(graph, b, mesh.shape[self.ep_axis]))  # split there (rules/experts.py)
        # A redistribute of gathered expert weights (a view, one expert's weights per routed slot) moves
        # the experts' weights themselves: priced at their shape, the experts in place of the slots.
        self.edge_shape = dict(self.experts.weight_shapes)
        # by storage: a view of a parameter (a transposed weight, gathered expert weights) is none
        self.saved = saved_tensors(graph) - internal - self.experts.view_tensors
        self.needs_grad = gradient_tensors(graph)
        self.backward_read = read_in_backward(graph, self.needs_grad)
        readers: dict[str, list[str]] = {}  # tensor → the nodes whose backward reads it (or a view of it)
        for n in graph.compute_nodes:
            for i, t in enumerate(n.inputs):
                if t and self.reads_in_backward(n, i):
                    readers.setdefault(t, []).append(n.name)
        self.backward_readers = {t: tuple(ns) for t, ns in readers.items()}
        self.on_chip = attention_score_tensors(graph)
        # Materialised attention: each chain priced as its runtime's kernels, at its last node.
        # Under FlashAttention, a grouped-query chain in fp32 on a GPU runs SDPA's math kernel: as eager.
        regions = attention_regions(graph).values()
        math_kernel = [r for r in regions if grouped_kv(graph, r)] if (
            attention is Attention.FLASH and profile.device.is_gpu and self.precision.compute_dtype == "fp32") else []
        self.materialized: dict[str, AttentionRegion] = {
            n: r for r in (regions if attention is not Attention.FLASH else math_kernel) for n in r.nodes}
        # FlashAttention where the profile measured it: each chain priced as the kernel, at its last node.
        measured = attention is Attention.FLASH and profile.device.attention_forward is not None
        self.flash = {n: r for r in regions for n in r.nodes if n not in self.materialized} if measured else {}
        self.causal = causal_regions(graph) if self.flash else frozenset()
        # Context parallelism's ring design: the attention products by name, the causal chains by last node.
        self.cp_axis = cp_axis(mesh)
        self.regions = {n: r for r in regions for n in r.nodes} if self.cp_axis is not None else {}
        self.causal_chains = causal_regions(graph) if self.cp_axis is not None else frozenset()
        # The all-gather design's keys and values gathered before their repeat: partial gradients pass back.
        self.feeds = GatheredFeeds.of(graph, mesh, [(r.nodes[0], r.nodes[-1]) for r in regions])
        self.selective_saves, self.selective_inside = self._selective_saves()
        self._edge_cache: dict[tuple[object, ...], tuple[PricedCollective, ...]] = {}
        self._edge_time_cache: dict[tuple[object, ...], tuple[float, float, float, float]] = {}
        self._first_gather_cache: dict[tuple[object, ...], float] = {}
        self._latency: dict[tuple[Collective, int], float] = {}
        self.offload: dict[str, Offload] = {}  # parameter → where its states live, where not the device (`offloaded`)
        self.host_activations: dict[str, int] = {}  # group → layers whose saved activations live on the host
        self.param_owner: dict[str, str] = {}
        for n in graph.compute_nodes:
            for t in n.inputs:
                if t in graph.tensors and graph.tensors[t].kind is TensorKind.PARAM:
                    self.param_owner.setdefault(t, n.name)

    # -- one node --------------------------------------------------------------------------------

    def node_cost(self, node: OpNode, strategy: OpStrategy) -> NodeCost:
        g = self.graph
        specs: dict[str, Spec | None] = dict(zip(node.inputs, strategy.input_specs, strict=True))
        specs.update(zip(node.outputs, strategy.output_specs, strict=True))
        if node.name in self.experts.views:  # expert weights gathered for a grouped GEMM: no kernel, nothing saved
            return NodeCost(compute=NO_COST, activation_bytes=0.0, events=self._dispatch(node, strategy))
        shapes = local_shapes(node, g, specs, self.mesh)
        if (expert := self.experts.matmuls.get(node.name)) is not None:
            w = strategy.input_specs[expert[1]]
            ep = self.mesh.shape[self.ep_axis] if self.ep_axis is not None and expert[0].topk in self.ep_blocks \
                and w is not None and isinstance(w.placements[self.ep_axis], Shard) else 1
            compute = grouped_gemm_cost(node, *expert, g, shapes, self.profile, self.precision, self.needs_grad,
                                        self.capacity_factor, ep)
        else:
            compute = compute_cost(node, g, shapes, self.profile, self.precision, on_chip=self.on_chip,
                                   needs_grad=self.needs_grad, fused=self.chains.get(node.name),
                                   padded=bool(self.chains))
        act = sum(tensor_bytes(g.tensors[t], shapes[t], self.precision) for t in node.outputs if t in self.saved)
        region = self.materialized.get(node.name)
        if region is not None:
            compute, saved = self._materialized(node, region, shapes, compute)
            act += saved
        elif node.name in self.flash:
            compute = flash_cost(self.profile.device, self.precision, g, node, self.flash[node.name], shapes, compute,
                                 causal=node.name in self.causal)  # (its last node's)
        ring = self._ring(node, strategy, shapes)
        loss = None
        if self.loss_tensor in node.outputs:
            loss = self.loss_cost(strategy.output_specs[node.outputs.index(self.loss_tensor)])
            act += loss.saved_bytes + loss.workspace_bytes  # (its workspace shown apart: `price_items`)
        if node.name in self.layer_of:  # recomputed: keeps the layer inputs it reads first
            kept = sum(tensor_bytes(g.tensors[t], shapes[t], self.precision) for t in self.layer_inputs.get(node.name, ()))
            if node.name in self.selective_saves:  # and what selective recomputation saves: the op's output, whole,
                # whatever its consumers' backward reads (an attention's: not its materialised probabilities)
                out = sum(tensor_bytes(g.tensors[t], shapes[t], self.precision) for t in node.outputs)
                return NodeCost(compute=compute, activation_bytes=kept + out, loss=loss, events=ring)
            if node.name in self.selective_inside:  # inside the attention saved whole: nothing of its own
                return NodeCost(compute=compute, activation_bytes=kept, loss=loss, events=ring)
            return NodeCost(compute=compute, activation_bytes=kept, loss=loss, recompute_s=compute.fwd_s,
                            recomputed_bytes=act, events=ring)
        return NodeCost(compute=compute, activation_bytes=act, loss=loss, events=ring)

    def _ring(self, node: OpNode, strategy: OpStrategy, shapes: Mapping[str, tuple[int, ...]]
              ) -> tuple[PricedCollective, ...]:
        """Ring attention's passes, at an attention product the plan runs so on the cp axis
        (`core/context.py`, `costmodel/context.py`); a recomputed layer's forward ones again (selectively
        too: the ring is no op whose output selective recomputation saves)."""
        a = self.cp_axis
        if a is None or len(strategy.kernels) <= a or strategy.kernels[a] != RING:
            return ()
        region = self.regions[node.name]
        return ring_events(node, node.name == region.nodes[0], self.graph, shapes, a, self.mesh, self.profile,
                           self.precision, causal=region.nodes[-1] in self.causal_chains,
                           overlap=self.composer is Composer.OVERLAP,
                           recomputed=node.name in self.layer_of
                           and self.recompute in (Recompute.FULL, Recompute.SELECTIVE))

    def _dispatch(self, node: OpNode, strategy: OpStrategy) -> tuple[PricedCollective, ...]:
        """Expert parallelism's all-to-alls, on its block's first expert gather where that runs split
        over the ep axis (`costmodel/experts.py`); in a recomputed layer, its forward pair again in
        backward."""
        block = self.experts.dispatch.get(node.name)
        a = self.ep_axis
        if block is None or a is None or len(strategy.kernels) <= a or strategy.kernels[a] != EXPERT_PARALLEL:
            return ()
        idx = node.inputs[1]
        spec = strategy.input_specs[1]
        assert spec is not None
        slots = float(math.prod(spec.local_shape(self.graph.tensors[idx].shape, self.mesh.shape)))
        events = dispatch_events(slots, self.experts.hidden[block.topk], block.num_experts, a, self.mesh, self.profile,
                                 self.precision, self.capacity_factor, idx)
        if node.name in self.layer_of and self.recompute in (Recompute.FULL, Recompute.SELECTIVE):
            events += tuple(replace(e, phase=Phase.BACKWARD) for e in events if e.phase is Phase.FORWARD)
        return events

    def _selective_saves(self) -> tuple[frozenset[str], frozenset[str]]:
        """The nodes of selectively recomputed layers whose outputs are saved — an attention's last node
        (the attention op's output, however its chain is priced), and every other matmul outside attention
        (the 1st, 3rd, … of its layer, in the graph's order) — and the other nodes of an attention chain."""
        if self.recompute is not Recompute.SELECTIVE:
            return frozenset(), frozenset()
        regions = {n: r for r in attention_regions(self.graph).values() for n in r.nodes}
        saves: set[str] = set()
        inside: set[str] = set()
        count: dict[tuple[int, int], int] = {}
        for node in self.graph.compute_nodes:
            layer = self.layer_of.get(node.name)
            if layer is None:
                continue
            region = regions.get(node.name)
            if region is not None:
                (saves if node.name == region.nodes[-1] else inside).add(node.name)
            elif node.op_type in MATMULS:
                count[layer] = count.get(layer, 0) + 1
                if count[layer] % 2:
                    saves.add(node.name)
        return frozenset(saves), frozenset(inside)

    def _materialized(self, node: OpNode, region: AttentionRegion, shapes: Mapping[str, tuple[int, ...]],
                      compute: ComputeCost) -> tuple[ComputeCost, float]:
        """A node of a materialised attention: the chain's kernels are timed at its last node (P·V, whose
        inputs give the score tensor's local shape and v's), the others keep their FLOPs and no time."""
        if node.name != region.nodes[-1]:
            return replace(compute, fwd_s=0.0, bwd_s=0.0), 0.0
        probs, v = shapes[node.inputs[0]], shapes[region.v]
        scores = float(np.prod(probs, dtype=np.float64))
        head_dim = float(v[-1])
        fwd, bwd, saved = materialized_kernels(
            Attention.EAGER if self.attention is Attention.FLASH else self.attention, scores=scores, q=scores / probs[-1] * head_dim, kv=float(np.prod(v, dtype=np.float64)),
            head_dim=head_dim, element_bytes=self.precision.activation_bytes, masked=region.mask is not None,
            dropout=self.attention_dropout > 0)
        dev = self.profile.device
        dtype = self.precision.compute_dtype if self.precision.compute_dtype in dev.peak_flops_per_s else "fp32"
        return replace(compute, fwd_s=kernels_s(fwd, dev, dtype, dev.graph_op_s),
                       bwd_s=kernels_s(bwd, dev, dtype, dev.graph_op_s)), saved

    def _find_recomputed_layers(self, every: bool = False) -> None:
        """Every (recomputed) layer of every repeated-layer group (`every`: all of each group's layers) is a
        checkpointed segment; its inputs are the float activations its nodes read that no node of the
        layer produces (charged to the first node reading them)."""
        g = self.graph
        for gi, group in enumerate(g.layers):
            count = len(group.nodes) if every else self.recompute_layers.get(group.prefix, len(group.nodes))
            for li, names in enumerate(group.nodes[:count]):
                produced = {t for n in names for t in g.node_by_name[n].outputs}
                seen: set[str] = set()
                for n in names:
                    self.layer_of[n] = (gi, li)
                    reads = [t for t in g.node_by_name[n].inputs if t and t not in produced and t not in seen
                             and g.tensors[t].kind in (TensorKind.ACTIVATION, TensorKind.INPUT) and g.tensors[t].is_float]
                    seen.update(reads)
                    if reads:
                        self.layer_inputs[n] = tuple(reads)

    def loss_cost(self, spec: Spec) -> LossCost:
        """The loss on the output produced at `spec`: its reshard (no gradient reduction: the loss
        is split exactly where its input is) and its element-wise kernels on the local shard."""
        t = self.loss_tensor
        info = self.graph.tensors[t]
        need = loss_input_spec(self.loss, spec, len(info.shape))
        events = tuple(replace(e, purpose=Purpose.LOSS) for e in self.edge_events(t, spec, need, frozenset()))
        numel = float(math.prod(need.local_shape(info.shape, self.mesh.shape)))
        return loss_cost(self.loss, numel, self.precision, info, self.profile.device, events,
                         fused=self.runtime is Runtime.COMPILED)

    def split_axes(self, strategy: OpStrategy) -> frozenset[int]:
        """Mesh axes along which a strategy divides the work (some input or output not replicated)."""
        return split_axes((*strategy.input_specs, *strategy.output_specs), self.mesh.shape)

    def gradient_split(self, tensor: str, src: Spec, dst: Spec, split: frozenset[int]) -> frozenset[int]:
        """The axes on which an edge's gradient arrives partial, its consumer divided over `split`: those,
        but for the keys' and values' feeds under context parallelism's all-gather (`GatheredFeeds`)."""
        return self.feeds.gradient_split(tensor, src, dst, split) if self.feeds is not None else split

    # -- one edge --------------------------------------------------------------------------------

    def edge_events(self, tensor: str, src: Spec, dst: Spec, consumer_split: frozenset[int], *,
                    saved: bool = True) -> tuple[PricedCollective, ...]:
        """Forward reshard of `tensor` from `src` to `dst` and the backward work on its gradient;
        `saved`: the consumer's backward reads the tensor (a gathered parameter is then gathered again)."""
        consumer_split = self.gradient_split(tensor, src, dst, consumer_split)
        return tuple(replace(e, tensor=tensor) for e in self._edge_events_alike(tensor, src, dst, consumer_split, saved))

    def _edge_events_alike(self, tensor: str, src: Spec, dst: Spec, consumer_split: frozenset[int],
                           saved: bool) -> tuple[PricedCollective, ...]:
        """`edge_events`, cached by shape: the events of the first tensor priced alike, under its name
        (a parameter's as a parameter's: `hides_under_backward` and `prefetched` ask; one that needs a
        gradient as one that does)."""
        info = self.graph.tensors[tensor]
        key = (self.edge_shape.get(tensor, info.shape), info.dtype, info.kind, tensor in self.param_owner, tensor in self.needs_grad, src, dst,
               consumer_split, saved)
        hit = self._edge_cache.get(key)
        if hit is None:
            hit = self._edge_cache[key] = self._edge_events(tensor, src, dst, consumer_split, saved)
        return hit

    def _bucket_share(self, kind: Collective, axis: int, size: float, t: float) -> float:
        """A bucketed collective's time `t` for `size` bytes as one member of a bucket pays it alone (the
        solver's view): its bandwidth term and its bytes' share of one bucket's latency."""
        latency = self._latency.get((kind, axis))
        if latency is None:  # the intercept of the affine α-β time
            one, two = (collective_time_s(self.profile, self.mesh, kind, b, (axis,)) for b in (1.0, 2.0))
            latency = self._latency[kind, axis] = 2 * one - two
        fill = self.bucket_fill.get(kind, self.bucket_fill[Collective.ALL_REDUCE])
        return t - latency * (1.0 - min(1.0, size / fill))

    def edge_time_s(self, tensor: str, src: Spec, dst: Spec, consumer_split: frozenset[int], *,
                    recomputed: bool = False, saved: bool = True, zero_stage: int = 0) -> float:
        """Seconds of `edge_events` in one step, each event once per micro-batch or once per step, the
        forward ones twice when the consumer's layer is recomputed; a parameter used where it is stored
        at ZeRO stage 1 or 2 has its gradient all-reduce replaced by `zero_events` (what the solver
        needs, cached by shape and specs)."""
        return sum(self.edge_time_parts(tensor, src, dst, consumer_split, recomputed=recomputed, saved=saved,
                                        zero_stage=zero_stage))

    def edge_time_parts(self, tensor: str, src: Spec, dst: Spec, consumer_split: frozenset[int], *,
                        recomputed: bool = False, saved: bool = True,
                        zero_stage: int = 0) -> tuple[float, float, float, float]:
        """`edge_time_s` in parts, as the overlapped step tells them apart (`compose.overlap`): what
        stays exposed; the gradient all-reduces and the gradient reduce-scatters that may run under the
        last backward (`compose.hides_under_backward`); the parameter gathers that may be prefetched
        under compute (`compose.prefetched`)."""
        consumer_split = self.gradient_split(tensor, src, dst, consumer_split)
        info = self.graph.tensors[tensor]
        stage = self._edge_stage(tensor, src, dst, zero_stage)
        key = self._edge_key(tensor, src, dst, consumer_split, recomputed, saved, zero_stage)
        t = self._edge_time_cache.get(key)
        if t is None:
            k = self.micro_batches
            events = [e for e in self._edge_events_alike(tensor, src, dst, consumer_split, saved)
                      if not (recomputed and e.purpose is Purpose.REGATHER)]
            synced = [e for e in events if e.purpose is Purpose.GRAD_SYNC and e.kind is Collective.ALL_REDUCE]
            if stage and synced:
                axes = tuple(sorted({a for e in synced for a in e.axes}))
                events = [e for e in events if e not in synced] + [
                    replace(z, time_s=self._bucket_share(z.kind, z.axes[0], z.size_bytes, z.time_s))
                    for z in self.states.events(tensor, src, axes, synced[0].size_bytes, stage)]
            # A parameter used in a spec other than the one it is stored in is reduced in every
            # micro-batch (`_resharded_params_per_micro_batch`), its per-step events k times.
            moved = info.kind is TensorKind.PARAM and src != dst
            parts = [0.0, 0.0, 0.0, 0.0]
            for e in events:
                part = (1 if e.purpose is Purpose.GRAD_SYNC else 2) if hides_under_backward(e, self.param_owner) else \
                    3 if prefetched(e, self.param_owner) else 0
                parts[part] += e.time_s * (k if e.cadence is Cadence.MICRO_BATCH or moved else 1) * (
                    2 if recomputed and e.phase is Phase.FORWARD else 1)
            t = self._edge_time_cache[key] = (parts[0], parts[1], parts[2], parts[3])
            self._first_gather_cache[key] = k * max((e.time_s for e in events if prefetched(e, self.param_owner)),
                                                    default=0.0)
        return t

    def first_gather_s(self, tensor: str, src: Spec, dst: Spec, consumer_split: frozenset[int], *,
                       recomputed: bool = False, saved: bool = True, zero_stage: int = 0) -> float:
        """The longest of one edge's gathers for use, once per micro-batch: what the overlapped step's
        first gather waits where this edge holds the step's longest (`compose.overlap`)."""
        consumer_split = self.gradient_split(tensor, src, dst, consumer_split)
        self.edge_time_parts(tensor, src, dst, consumer_split, recomputed=recomputed, saved=saved, zero_stage=zero_stage)
        return self._first_gather_cache[self._edge_key(tensor, src, dst, consumer_split, recomputed, saved, zero_stage)]

    def _edge_key(self, tensor: str, src: Spec, dst: Spec, consumer_split: frozenset[int], recomputed: bool,
                  saved: bool, zero_stage: int) -> tuple[object, ...]:
        """What an edge's price depends on (`edge_time_parts`' caches): the tensor's shape, dtype and role,
        not its name."""
        info = self.graph.tensors[tensor]
        return (self.edge_shape.get(tensor, info.shape), info.dtype, info.kind, tensor in self.param_owner, tensor in self.needs_grad, src, dst,
                consumer_split, recomputed, saved, self._edge_stage(tensor, src, dst, zero_stage))

    def _edge_stage(self, tensor: str, src: Spec, dst: Spec, zero_stage: int) -> int:
        """The ZeRO-1/2 stage an edge prices: a parameter's own, where it is used as stored."""
        eligible = self.graph.tensors[tensor].kind is TensorKind.PARAM and src == dst and self.states.eligible(tensor)
        return zero_stage if eligible else 0

    def fixed_s(self) -> tuple[float, float]:
        """What every plan of this model pays per step whatever its placements: the optimizer's fixed
        cost (a calibrated optimizer step) and the executor's host overhead."""
        dev = self.profile.device
        return (dev.optimizer_step.fixed_s if self.param_owner and dev.optimizer_step is not None else 0.0,
                dev.step_overhead_s or 0.0)

    def reads_in_backward(self, node: OpNode, index: int) -> bool:
        """Whether backward reads input `index` of an op (what decides a gathered parameter's second
        gather), as torch's autograd saves it (`memory.backward_reads`): not for ops that save nothing
        or only their output, not a Gemm's bias, not an operand of a product whose other operand needs
        no gradient; a view op's input when its consumer reads the view (a transposed weight)."""
        if node.op_type in ALIAS_OPS:
            return node.inputs[index] in self.backward_read
        return index in backward_reads(node, self.needs_grad)

    def _edge_events(self, tensor: str, src: Spec, dst: Spec, consumer_split: frozenset[int],
                     saved: bool = True) -> tuple[PricedCollective, ...]:
        info = self.graph.tensors[tensor]
        is_param = info.kind is TensorKind.PARAM
        itemsize = self.precision.moved_weight_bytes if is_param else self.precision.bytes_of(info)
        events: list[PricedCollective] = []

        def add(kind: Collective, axis: int, size: float, phase: Phase, purpose: Purpose) -> None:
            if self.fp32_communication and kind in _REDUCING:  # MindSpore's force_fp32_communication
                size *= 4 / (itemsize if phase is Phase.FORWARD else grad_item)
            t = collective_time_s(self.profile, self.mesh, kind, size, (axis,))
            if is_param and phase is Phase.BACKWARD and purpose is not Purpose.RESHARD:
                # Bucketed like DDP/FSDP: this gradient pays its share of one bucket's latency. (The
                # backward of a parameter's own reshard, e.g. R → P, runs alone: full latency.)
                t = self._bucket_share(kind, axis, size, t)
            else:  # issued on its own by the executor (a redistribute): its host cost too
                t += self.profile.device.reshard_overhead_s or 0.0
            events.append(PricedCollective(kind, (axis,), size, t, phase, purpose, tensor, cadence_of(purpose, is_param)))

        grad_item = self.precision.grad_bytes if is_param else self.precision.bytes_of(info)
        shape = self.edge_shape.get(tensor, info.shape)
        plan = plan_reshard(src, dst, shape, self.mesh.shape, itemsize, enable_all_to_all=self.enable_all_to_all)
        for step in plan.collectives:
            assert step.collective is not None
            add(step.collective, step.axis, step.size_bytes, Phase.FORWARD, Purpose.RESHARD)
        if tensor not in self.needs_grad:
            return tuple(events)  # no gradient flows back (inputs, constants, masks, rotary tables)
        grad_local = float(math.prod(dst.local_shape(shape, self.mesh.shape))) * grad_item
        by_axis = {st.axis: st for st in plan.steps}
        grad = gradient_spec(dst, consumer_split)  # as the executor receives it (core/placement.py)

        def scattered(a: int) -> bool:  # a gradient partial here goes back to a split parameter
            st = by_axis.get(a)
            return isinstance(grad.placements[a], Partial) and st is not None and st.collective is Collective.ALL_GATHER

        # A split parameter's gradient is reduce-scattered over the axes it is split on first, and what is
        # left all-reduced over the rest (FSDP2's HSDP; the executor orders DTensor's backward so,
        # `dtensors.scatter_first`): each on what the previous left. An activation's, and a parameter's
        # used as addends (a bias added once), in axis order (DTensor's).
        first = is_param and not any(isinstance(p, Partial) for p in dst.placements)
        order = sorted(range(self.mesh.ndim), key=lambda a: not scattered(a)) if first else range(self.mesh.ndim)
        left = grad_local
        for a in order:
            st = by_axis.get(a)
            if is_param and saved and st is not None and st.collective is Collective.ALL_GATHER:
                # ZeRO-3 / FSDP: the gathered weight is freed after forward and gathered again for
                # the backward matmuls (dX = dY·Wᵀ) — 1.5× data parallelism's volume in all.
                add(Collective.ALL_GATHER, a, st.size_bytes, Phase.BACKWARD, Purpose.REGATHER)
            if isinstance(grad.placements[a], Partial):  # the op is split here, the input replicated
                if scattered(a):
                    add(Collective.REDUCE_SCATTER, a, left, Phase.BACKWARD, Purpose.GRAD_REDUCE_SCATTER)
                    left = left / self.mesh.shape[a] if is_param else left
                else:
                    add(Collective.ALL_REDUCE, a, left, Phase.BACKWARD, Purpose.GRAD_SYNC)
            elif st is not None:
                back = conjugate(st)
                if back is Collective.ALL_REDUCE and isinstance(src.placements[a], Shard):
                    # S(d) → P forward (gathered, then made addends): the addends' gradient goes back to
                    # the source's shards in one reduce_scatter (as DTensor runs it), not all_reduce + slice.
                    back = Collective.REDUCE_SCATTER
                if back is not None:
                    # A slice's gradient is gathered back to the source's size (its local size × k).
                    size = st.size_bytes * self.mesh.shape[a] if st.collective is None and isinstance(st.dst, Shard) \
                        else st.size_bytes
                    add(back, a, size * grad_item / itemsize, Phase.BACKWARD, Purpose.RESHARD)
        return tuple(events)

    # -- a whole plan ----------------------------------------------------------------------------

    def price(self, choice: Mapping[str, OpStrategy], param_specs: Mapping[str, Spec] | None = None, *,
              buckets: bool = True, policy: str | None = None, zero: Mapping[str, int] | None = None) -> StepCost:
        """The step under a plan: its items priced (`price_items`), then composed under `policy` (by
        default the model's `composer`)."""
        return compose(self.price_items(choice, param_specs, buckets=buckets, zero=zero), policy or self.composer)

    def price_items(self, choice: Mapping[str, OpStrategy], param_specs: Mapping[str, Spec] | None = None, *,
                    buckets: bool = True, zero: Mapping[str, int] | None = None) -> PricedStep:
        """Every item of a plan's step, priced alone: a strategy per compute node; parameters at
        `param_specs`, by default at the spec their first consumer requires. `buckets=False`: gradient
        all-reduces priced edge by edge, as the ILP sees them (each its share of one full bucket's
        latency), instead of packed. `zero`: each parameter's ZeRO-1/2 stage (default: the model's)."""
        g, p = self.graph, self.precision
        priced = PricedStep(micro_batches=self.micro_batches, params=frozenset(self.param_owner),
                            fusion=self.fusion)
        placed = priced.placed
        placed.update(param_specs or {})  # tensor → the spec it is produced (or stored) in
        mem: dict[str, dict[str, float]] = {"parameters": {}, "gradients": {}, "optimizer": {}, "activations": {},
                                            "loss": {}}
        acts = mem["activations"]
        reduced: set[tuple[str, tuple[int, ...]]] = set()  # (tensor, axes) whose partial gradient is reduced
        shared: set[tuple[object, ...]] = set()  # activations' redistributes, each run once (`shared_reshard`)
        recomputed: dict[tuple[int, int], float] = {}  # layer → what its recomputation holds during its backward
        for node in g.compute_nodes:
            strategy = choice[node.name]
            nc = self.node_cost(node, strategy)
            priced.node_compute_s[node.name] = nc.compute_s
            priced.backward_s += nc.compute.bwd_s + nc.recompute_s
            priced.flops_matmul += nc.compute.fwd_matmul_flops * (2 if nc.recompute_s else 1) + nc.compute.bwd_matmul_flops
            divided = self.split_axes(strategy)
            mine = priced.node_events.setdefault(node.name, [])
            if nc.loss is not None:
                priced.events.extend(nc.loss.events)
                mine.extend(nc.loss.events)
            priced.events.extend(nc.events)
            mine.extend(nc.events)
            for i, (t, need) in enumerate(zip(node.inputs, strategy.input_specs, strict=True)):
                if need is None or not t:
                    continue
                info = g.tensors[t]
                if t not in placed:
                    placed[t] = need.storable() if info.kind is TensorKind.PARAM else need
                    if info.kind is TensorKind.INPUT and t in self.saved:
                        acts[t] = acts.get(t, 0.0) + tensor_bytes(info, need.local_shape(info.shape, self.mesh.shape), p)
                if info.kind is TensorKind.CONSTANT:
                    continue  # every rank holds constants whole: any placement is a local slice
                have = need if info.kind is TensorKind.INPUT else placed[t]
                split = self.gradient_split(t, have, need, divided)
                events = tuple(e for e in self.edge_events(t, have, need, split,
                                                           saved=self.reads_in_backward(node, i))
                               if not seen_reduction(e, reduced))
                key = shared_reshard(t, info.kind, have, need, split, g.layer_of.get(node.name))
                if key is not None and key in shared:  # another consumer's redistribute, and its backward
                    events = ()
                elif key is not None:
                    shared.add(key)
                if node.name in self.layer_of:  # the layer's forward runs again in backward, its reshards too;
                    # a parameter's gather among them is the one backward uses (no second re-gather)
                    events = tuple(e for e in events if e.purpose is not Purpose.REGATHER)
                    events += tuple(replace(e, phase=Phase.BACKWARD) for e in events if e.phase is Phase.FORWARD)
                priced.events.extend(events)
                mine.extend(events)
                if have != need:
                    priced.reshards.append((t, node.name, have, need, events))
            for t, spec in zip(node.outputs, strategy.output_specs, strict=True):
                placed[t] = spec
            workspace = nc.loss.workspace_bytes if nc.loss is not None and not nc.recompute_s else 0.0
            acts[node.name] = acts.get(node.name, 0.0) + nc.activation_bytes - workspace
            if workspace:
                mem["loss"][self.loss_tensor] = workspace
            if nc.recomputed_bytes:
                layer = self.layer_of[node.name]
                recomputed[layer] = recomputed.get(layer, 0.0) + nc.recomputed_bytes
        if recomputed:  # one layer's activations live at a time, while its backward runs
            acts["(recomputed layer)"] = max(recomputed.values())
        priced.optimizer_fixed_s, priced.overhead_s = self.fixed_s()
        priced.rank_skew = self.profile.device.rank_skew or 0.0
        self._resharded_params_per_micro_batch(priced)
        degree = self._apply_zero(priced, zero)
        for t in self.param_owner:
            dp, stage = degree.get(t, 1), priced.zero_stages.get(t, 0)
            mode = self.offload.get(t, Offload.NONE)
            if mode is Offload.NONE:
                priced.optimizer_s[t] = self.states.optimizer_s(t, placed[t], dp)
                mem["parameters"][t], mem["gradients"][t], mem["optimizer"][t] = self.states.param_states(
                    t, placed[t], dp, stage=stage)
                continue
            priced.offload[t] = mode
            priced.optimizer_s[t] = self.states.host_optimizer_s(t, placed[t], dp, stage=stage)
            (mem["parameters"][t], mem["gradients"][t], mem["optimizer"][t]), priced.host_memory[t] = \
                self.states.offloaded(t, placed[t], mode, dp, stage=stage)
            priced.host_copies.extend(self.states.host_copies(t, placed[t], mode, dp, stage=stage))
        priced.memory = mem
        if self.host_activations:
            before = {gr.prefix: len(gr.nodes) if self.recompute is Recompute.SELECTIVE
                      else self.recompute_layers.get(gr.prefix, len(gr.nodes)) if self.recompute is Recompute.FULL
                      else 0 for gr in g.layers}
            on_host, counts = host_layers(g, self.host_activations, before)
            price_host_activations(priced, acts, on_host, counts, self.states.host_rate())
        if self.full_batch:
            for t in g.inputs:
                info = g.tensors[t]
                whole = tensor_bytes(info, info.shape, p)
                extra = whole - (tensor_bytes(info, placed[t].local_shape(info.shape, self.mesh.shape), p)
                                 if t in placed else whole)
                if extra > 0:
                    priced.host_copies.append(HostCopy(t, "input rows beyond the share", extra,
                                                       extra / self.states.host_rate(), Cadence.MICRO_BATCH, False))
        if buckets:
            price_buckets(priced, self.param_owner, self.bucket_time_s)
        return priced

    def offloaded(self, offload: Mapping[str, Offload], activations: Mapping[str, int] | None = None) -> CostModel:
        """This model with the parameters in `offload` (parameter → where its states live) priced there
        (`ModelStates.offloaded`, `host_copies`), and `activations` (group → layers) saving their
        activations in host memory (`host_activations.py`): a copy, the model itself shared."""
        out = copy.copy(self)
        out.offload = {t: m for t, m in offload.items() if m is not Offload.NONE}
        out.host_activations = {p: n for p, n in (activations or {}).items() if n}
        return out

    def bucket_time_s(self, kind: Collective, size_bytes: float, axes: tuple[int, ...]) -> float:
        return collective_time_s(self.profile, self.mesh, kind, size_bytes, axes)

    def rebucket(self, priced: PricedStep, fusion: CommFusion) -> StepCost:
        """The same plan's step with its gradient collectives packed by other bucket caps (the items are
        not priced again: `bucketing.price_buckets` prices buckets from the events' sizes)."""
        step = replace(priced, fusion=fusion)
        price_buckets(step, self.param_owner, self.bucket_time_s)
        return compose(step, self.composer)

    def _resharded_params_per_micro_batch(self, priced: PricedStep) -> None:
        """A parameter moved to another placement for some use is reduced by the runtime in backward
        (DTensor), in every micro-batch, not bucketed after the last one."""
        resharded = {t for t, *_ in priced.reshards if t in self.param_owner}
        priced.replace_events({id(e): [replace(e, cadence=Cadence.MICRO_BATCH)] for e in priced.events
                               if e.tensor in resharded and e.cadence is Cadence.STEP})

    def _apply_zero(self, priced: PricedStep, zero: Mapping[str, int] | None) -> dict[str, int]:
        """ZeRO-1/2 on the parameters at a stage (`stage_of`) whose gradient is all-reduced where they are
        stored: the all-reduce becomes `zero_events`. Records each such parameter's stage in the priced
        step and returns its ZeRO degree (the product of the axes it is reduced over)."""
        resharded = {t for t, *_ in priced.reshards}
        synced: dict[str, list[PricedCollective]] = {}
        for e in priced.events:
            if (e.purpose is Purpose.GRAD_SYNC and e.kind is Collective.ALL_REDUCE and e.tensor in self.param_owner
                    and e.tensor not in resharded and self.states.stage_of(e.tensor, zero)):
                synced.setdefault(e.tensor, []).append(e)
        replaced: dict[int, list[PricedCollective]] = {}
        degree: dict[str, int] = {}
        for t, evs in synced.items():
            axes = tuple(sorted({a for e in evs for a in e.axes}))
            stage = priced.zero_stages[t] = self.states.stage_of(t, zero)
            replaced[id(evs[0])] = self.states.events(t, priced.placed[t], axes, evs[0].size_bytes, stage)
            replaced.update({id(e): [] for e in evs[1:]})
            degree[t] = math.prod(self.mesh.shape[a] for a in self.states.shard_axes(axes)[0])
        priced.replace_events(replaced)
        return degree


_REDUCING = frozenset({Collective.ALL_REDUCE, Collective.REDUCE_SCATTER})
_FUSED = {Collective.ALL_REDUCE: "allreduce", Collective.ALL_GATHER: "allgather",
          Collective.REDUCE_SCATTER: "reducescatter"}
