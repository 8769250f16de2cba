"""The loss: the last consumer of the model's output, priced like any other op.

A training step ends in a loss on the model's first output. Which one (`loss_kind`):
  cross-entropy  when the output looks like logits (float, rank ≥ 2, more than one class in the last
                 dim) — against integer labels, averaged over the rows;
  mse            otherwise: the mean of the squared output.
The loss runs where the output lies, as torchtitan's loss parallel does for the rows: every rank
computes its rows' sum divided by the global count, the addends of the loss, so neither the rows nor
their gradient travel. What it cannot take is partial sums (they are reduced first: an all_reduce),
nor, for cross-entropy, a split class dim (the softmax needs the whole row: an all_gather, whose
gradient is a local slice).

Cost: cross-entropy is log-softmax + NLL, element-wise kernels over the local logits (read, write,
read the picked entries: ≈ 3 passes forward, 2× that backward); mse reads the output once.

Memory (`loss_bytes`), per element of the local output: what the loss saves for backward, and the
workspace its backward allocates on top (live at the step's peak: every activation is still held
there, and no gradient of a parameter exists yet).
  cross-entropy, eager  saves the fp32 log-probabilities (4 bytes); its backward holds NLL's gradient
                        and log-softmax's, both fp32 and logits-sized, beside them (8 bytes: more
                        than the forward's compute-dtype logits and their fp32 upcast, 6)
  cross-entropy, compiled  one fused kernel each way: saves the logits in their own dtype and the
                        row log-sum-exp; its backward writes one gradient in that dtype
  mse                   saves the output; its backward writes the output's gradient
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.collectives import PricedCollective
from core.graph import OpGraph, TensorInfo
from core.levers import LossKind, lever
from core.placement import Partial, Replicate, Shard, Spec
from costmodel.compute import BACKWARD_BYTES_FACTOR
from costmodel.items import LossCost

if TYPE_CHECKING:
    from costmodel.memory import Precision
    from hwprofiles.profile import DeviceSpec

LOSSES = (LossKind.CROSS_ENTROPY, LossKind.MSE)
# Memory passes over the local output, forward: log-softmax read + write and NLL read; mse's one read.
PASSES = {LossKind.CROSS_ENTROPY: 3.0, LossKind.MSE: 1.0}
KERNELS = 2  # forward launches of either (log-softmax + NLL; square + sum)


def loss_bytes(kind: LossKind, output_bytes: int, *, fused: bool) -> tuple[int, int]:
    """Bytes per element of the local output: saved for backward, and the backward's workspace.
    `output_bytes`: the output's element size as produced; `fused`: a compiled runtime's kernel."""
    if kind is LossKind.CROSS_ENTROPY and not fused:
        return 4, 8
    return output_bytes, output_bytes


def loss_kind(graph: OpGraph, requested: str = LossKind.AUTO) -> LossKind:
    """The loss a training step applies to the first output."""
    kind = lever(LossKind, requested, "loss")
    if kind is not LossKind.AUTO:
        return kind
    out = graph.tensors[graph.outputs[0]]
    return LossKind.CROSS_ENTROPY if out.is_float and len(out.shape) >= 2 and out.shape[-1] > 1 else LossKind.MSE


def loss_input_spec(kind: str, spec: Spec, ndim: int) -> Spec:
    """Where the loss needs the output: as produced, but no partial sums and (cross-entropy) no split
    class dim; those axes become replicated."""
    def ok(p: object) -> bool:
        if isinstance(p, Partial):
            return False
        return not (kind is LossKind.CROSS_ENTROPY and isinstance(p, Shard) and p.dim == ndim - 1)
    return Spec(tuple(p if ok(p) else Replicate() for p in spec.placements))


def loss_cost(kind: LossKind, numel: float, precision: Precision, output: TensorInfo, device: DeviceSpec,
              events: tuple[PricedCollective, ...], *, fused: bool) -> LossCost:
    """The loss over `numel` local elements of the output: its element-wise kernels forward and
    backward, what it saves and its workspace (`loss_bytes`); `events` bring the output where it runs."""
    itemsize = 4 if kind is LossKind.CROSS_ENTROPY else precision.activation_bytes  # logits upcast to fp32
    fwd = PASSES[kind] * numel * itemsize / device.elementwise_bytes_per_s + KERNELS * device.kernel_launch_s
    saved, workspace = loss_bytes(kind, precision.bytes_of(output), fused=fused)
    return LossCost(kind=kind, compute_s=fwd * (1 + BACKWARD_BYTES_FACTOR), events=events,
                    saved_bytes=numel * saved, workspace_bytes=numel * workspace)
