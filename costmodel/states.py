"""A parameter's model states per device — weights, gradients, optimizer states — under its ZeRO
stage, the optimizer step on its shard, and ZeRO-1/2's collectives in place of its gradient's
all-reduce. `CostModel.states`; the ILP reads the same object."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from core.collectives import Cadence, Collective, Phase, PricedCollective, Purpose
from core.errors import MeshplanError
from core.graph import OpGraph
from core.levers import Offload
from core.mesh import DeviceMesh
from core.placement import Replicate, Spec
from costmodel.buckets import zero_split
from costmodel.comm import collective_time_s
from costmodel.items import HostCopy
from costmodel.memory import Precision, model_states
from hwprofiles.profile import HardwareProfile, HostSpec

# The optimizer step (AdamW, one tensor at a time): per element it reads the weight, gradient and two
# moments and writes back the weight and moments, 7 fp32 words (mixed precision updates the fp32
# master copy: the same traffic); per tensor about a dozen element-wise kernels (torch's
# single-tensor AdamW: lerp, mul, addcmul, sqrt, div, addcdiv, ...).
OPTIMIZER_BYTES_PER_PARAM = 7 * 4
OPTIMIZER_OPS_PER_TENSOR = 12


@dataclass(frozen=True, eq=False)
class ModelStates:
    """The ZeRO settings of a cost model over its graph, mesh, profile and precision."""

    graph: OpGraph
    mesh: DeviceMesh
    profile: HardwareProfile
    precision: Precision
    zero_stage: int  # every parameter's stage unless a plan says otherwise
    zero_threshold_bytes: float
    zero_shard_size: int | None

    def eligible(self, tensor: str) -> bool:
        """Whether ZeRO-1/2 may shard this parameter: it is not below the threshold."""
        return self.graph.tensors[tensor].numel * self.precision.weight_bytes >= self.zero_threshold_bytes

    def stage_of(self, tensor: str, zero: Mapping[str, int] | None = None) -> int:
        """A parameter's ZeRO-1/2 stage: as the plan says (`zero`, parameter → stage), else the model's
        stage; 0 below the threshold."""
        stage = self.zero_stage if zero is None else zero.get(tensor, 0)
        return stage if stage and self.eligible(tensor) else 0

    def degree(self, tensor: str, spec: Spec, stage: int | None = None) -> int:
        """Ranks sharing a parameter's optimizer states (and, stage 2, gradients) when the exact axes are
        not known yet (the solver's view): every axis the parameter is stored replicated on, as a ZeRO
        data-parallel group; 1 without ZeRO. `price_items` uses the axes its gradient is reduced on."""
        stage = self.stage_of(tensor) if stage is None else stage if self.eligible(tensor) else 0
        if not stage:
            return 1
        group = math.prod(n for n, p in zip(self.mesh.shape, spec.placements, strict=True) if isinstance(p, Replicate))
        return min(group, self.zero_shard_size or group)

    def optimizer_s(self, tensor: str, spec: Spec, zero_degree: int | None = None, *, stage: int | None = None) -> float:
        """Time of the optimizer step for one parameter's local shard (its ZeRO shard): as calibrated
        (per tensor and per parameter) where the profile has it, else memory-bound plus launches."""
        local = self.shard_numel(tensor, spec, zero_degree, stage=stage)
        dev = self.profile.device
        if dev.optimizer_step is not None:
            return dev.optimizer_step.tensor_s + local * dev.optimizer_step.param_s
        return local * OPTIMIZER_BYTES_PER_PARAM / dev.mem_bandwidth_bytes_per_s + OPTIMIZER_OPS_PER_TENSOR * dev.kernel_launch_s

    def shard_numel(self, tensor: str, spec: Spec, zero_degree: int | None = None, *, stage: int | None = None) -> float:
        """Elements of a parameter the optimizer steps on this device: its local part at `spec`, over its
        ZeRO degree."""
        dp = self.degree(tensor, spec, stage) if zero_degree is None else zero_degree
        return float(self.graph.tensors[tensor].numel) / spec.shard_count(self.mesh.shape) / max(dp, 1)

    def param_states(self, tensor: str, spec: Spec, zero_degree: int | None = None, *,
                     stage: int | None = None) -> tuple[float, float, float]:
        """Bytes per device of a parameter's weights, gradients and optimizer states at `spec`, under
        its ZeRO stage (`memory.model_states`; ZeRO-3 is already in `spec`)."""
        stage = self.stage_of(tensor) if stage is None else stage
        dp = self.degree(tensor, spec, stage) if zero_degree is None else zero_degree
        local = float(self.graph.tensors[tensor].numel) / spec.shard_count(self.mesh.shape)
        return model_states(local, self.precision, zero_stage=stage if dp > 1 else 0, dp_degree=dp)

    def param_state_bytes(self, tensor: str, spec: Spec, *, stage: int | None = None) -> float:
        return sum(self.param_states(tensor, spec, stage=stage))

    def events(self, tensor: str, spec: Spec, axes: tuple[int, ...], grad_bytes: float,
                    stage: int) -> list[PricedCollective]:
        """ZeRO-1/2 in place of a gradient's all-reduce over `axes`: reduce-scatters over each axis in
        turn (each on what the previous left: the shard shrinks), once per step at stage 1 and per
        micro-batch at stage 2 (gradients kept sharded), and after the optimizer step the updated shard
        all-gathered back over the axes in reverse (ring: the all-reduce's volume in all). `grad_bytes`:
        the all-reduce's (in fp32 under fp32_communication)."""
        weights = float(self.graph.tensors[tensor].numel) / spec.shard_count(self.mesh.shape) * self.precision.weight_bytes
        cadence = Cadence.STEP if stage == 1 else Cadence.MICRO_BATCH
        sharded, rest = self.shard_axes(axes)
        rs, ag, g, w = [], [], grad_bytes, weights
        for a in sharded:
            rs.append(PricedCollective(Collective.REDUCE_SCATTER, (a,), g,
                                collective_time_s(self.profile, self.mesh, Collective.REDUCE_SCATTER, g, (a,)),
                                Phase.BACKWARD, Purpose.GRAD_REDUCE_SCATTER, tensor, cadence))
            ag.append(PricedCollective(Collective.ALL_GATHER, (a,), w,
                                collective_time_s(self.profile, self.mesh, Collective.ALL_GATHER, w, (a,)),
                                Phase.OPTIMIZER, Purpose.PARAM_GATHER, tensor, Cadence.STEP))
            g, w = g / self.mesh.shape[a], w / self.mesh.shape[a]
        # A shard group smaller than the data-parallel group (optimizer_weight_shard_size): the other
        # axes all-reduce the shard, once per reduce-scatter.
        ar = [PricedCollective(Collective.ALL_REDUCE, (a,), g, collective_time_s(self.profile, self.mesh, Collective.ALL_REDUCE,
                                                                           g, (a,)),
                        Phase.BACKWARD, Purpose.GRAD_SYNC, tensor, cadence) for a in rest]
        return rs + ar + ag[::-1]

    def shard_axes(self, axes: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The axes a gradient reduced over `axes` has its states sharded over, and those that all-reduce
        the shard (`buckets.zero_split`, by the model's shard size)."""
        try:
            return zero_split(axes, self.mesh.shape, self.zero_shard_size)
        except ValueError as e:
            raise MeshplanError(f"`zero_shard_size` {self.zero_shard_size}: {e}") from None

    # -- offload (`core.levers.Offload`) ---------------------------------------------------------------

    def offloaded(self, tensor: str, spec: Spec, mode: Offload, zero_degree: int | None = None, *,
                  stage: int | None = None) -> tuple[tuple[float, float, float], float]:
        """A parameter's (weights, gradients, optimizer states) bytes left on the device under `mode`, and
        the bytes it holds in host memory: OPTIMIZER, the optimizer's shard's states with its gradient
        copied out and, where the weights are fp32 (no master copy among the states), the fp32 weights it
        steps (ZeRO-Offload's host copy); PARAMS, the whole states (FSDP2 keeps the sharded fp32
        parameters, their gradients and the optimizer states on the host)."""
        w, g, o = self.param_states(tensor, spec, zero_degree, stage=stage)
        if mode is Offload.OPTIMIZER:
            p = self.precision
            shard = self.shard_numel(tensor, spec, zero_degree, stage=stage)
            return (w, g, 0.0), o + shard * (p.grad_bytes + (p.weight_bytes if p.weight_bytes == 4 else 0))
        if mode is Offload.PARAMS:
            return (0.0, 0.0, 0.0), w + g + o
        return (w, g, o), 0.0

    def host_copies(self, tensor: str, spec: Spec, mode: Offload, zero_degree: int | None = None, *,
                    stage: int | None = None) -> list[HostCopy]:
        """A parameter's copies over the host link in one step under `mode` (at the profile's copy rate
        with every device of a node copying, `HostSpec.copy_rate`). OPTIMIZER: the gradient of the
        optimizer's shard (its ZeRO shard) to the host after the last backward, its updated weights back
        after the host's step. PARAMS: the stored weights to the device for each use — the forward and
        the backward of every micro-batch — and the gradient (its ZeRO-2 shard) to the host after each."""
        if mode is Offload.NONE:
            return []
        rate = self.host_rate()
        w, g, _ = self.param_states(tensor, spec, zero_degree, stage=stage)

        def copy(what: str, nbytes: float, cadence: Cadence, hideable: bool) -> HostCopy:
            return HostCopy(tensor, what, nbytes, nbytes / rate, cadence, hideable)

        if mode is Offload.OPTIMIZER:
            shard = self.shard_numel(tensor, spec, zero_degree, stage=stage)
            return [copy("gradient to host", shard * self.precision.grad_bytes, Cadence.STEP, True),
                    copy("weights to device", shard * self.precision.weight_bytes, Cadence.STEP, False)]
        return [copy("weights to device", w, Cadence.MICRO_BATCH, True),
                copy("weights to device", w, Cadence.MICRO_BATCH, True),
                copy("gradient to host", g, Cadence.MICRO_BATCH, True)]

    def host_optimizer_s(self, tensor: str, spec: Spec, zero_degree: int | None = None, *,
                         stage: int | None = None) -> float:
        """The optimizer step of a parameter's local (ZeRO) shard on the host (`HostSpec.optimizer_step`)."""
        local = self.shard_numel(tensor, spec, zero_degree, stage=stage)
        step = self.host().optimizer_step
        return step.tensor_s + local * step.param_s

    def host_rate(self) -> float:
        """Bytes a second one device copies to or from the host, every device of its node copying."""
        return self.host().copy_rate(min(self.mesh.num_devices, self.profile.devices_per_node))

    def host(self) -> HostSpec:
        if self.profile.host is None:
            raise MeshplanError(f"profile {self.profile.name} has no `host` (copy bandwidth, host optimizer step): "
                                "nothing can be offloaded on it; add a host block or use `offload` none")
        return self.profile.host
