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
read the picked entries: ≈ 3 passes forward, 2× that backward) and saves the log-probabilities (one
logits-sized fp32 tensor); mse reads the output once and saves it.
"""

from __future__ import annotations

from core.graph import OpGraph
from core.levers import LossKind, lever
from core.placement import Partial, Replicate, Shard, Spec

LOSSES = (LossKind.CROSS_ENTROPY, LossKind.MSE)
# Memory passes over the local output, forward: log-softmax read + write and NLL read; mse's one read.
PASSES = {LossKind.CROSS_ENTROPY: 3.0, LossKind.MSE: 1.0}
KERNELS = 2  # forward launches of either (log-softmax + NLL; square + sum)


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
