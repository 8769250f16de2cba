"""Memory per device: model states (weights, gradients, optimizer) and activations saved for backward.

Model states per parameter (ZeRO paper, Rajbhandari et al. SC'20, §5), AdamW:
  mixed precision (bf16/fp16): 2 bytes weights + 2 bytes gradients + K = 12 bytes of fp32 master
  weights, momentum and variance;  fp32: 4 + 4 + 8 (momentum, variance).
With data-parallel degree N_d, ZeRO stage 1 shards the optimizer states, 2 also the gradients, 3 also
the weights: (2 + 2 + K)Ψ, 4Ψ + KΨ/N_d, 2Ψ + (2 + K)Ψ/N_d, (4 + K)Ψ/N_d for mixed precision.

Activations: what each op's backward reads, counted once per tensor (by `saved_tensors`). Attention
(QKᵀ → scale/mask → Softmax → ·V, as exporters decompose scaled_dot_product_attention) is priced as
the fused kernel training runs (FlashAttention: scores recomputed in backward), so its s×s score and
probability tensors are not kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.attention import attention_regions
from planner.graph import OpGraph, TensorKind


@dataclass(frozen=True, kw_only=True, slots=True)
class Precision:
    name: str
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # per parameter: fp32 master + Adam moments (mixed), or the moments (fp32)
    activation_bytes: int

    @property
    def model_state_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


PRECISIONS = {
    "bf16": Precision(name="bf16", weight_bytes=2, grad_bytes=2, optimizer_bytes=12, activation_bytes=2),
    "fp16": Precision(name="fp16", weight_bytes=2, grad_bytes=2, optimizer_bytes=12, activation_bytes=2),
    "fp32": Precision(name="fp32", weight_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4),
}


def model_states(num_params: float, precision: Precision, *, zero_stage: int = 0,
                 dp_degree: int = 1) -> tuple[float, float, float]:
    """Per-device bytes of weights, gradients and optimizer states of `num_params` parameters under a
    ZeRO stage over `dp_degree` ranks (Rajbhandari et al. 2020, §5: stage 1 shards the optimizer
    states, 2 the gradients too, 3 the weights too)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage: must be 0, 1, 2 or 3, got {zero_stage}")
    nd = max(dp_degree, 1)
    w, g, k = (b * num_params for b in (precision.weight_bytes, precision.grad_bytes, precision.optimizer_bytes))
    return (w / nd if zero_stage >= 3 else w, g / nd if zero_stage >= 2 else g, k / nd if zero_stage >= 1 else k)


def model_state_bytes(num_params: float, precision: Precision, *, zero_stage: int = 0, dp_degree: int = 1) -> float:
    """Per-device bytes of weights, gradients and optimizer states of `num_params` parameters."""
    return sum(model_states(num_params, precision, zero_stage=zero_stage, dp_degree=dp_degree))


# What the backward pass of an op reads: its inputs, its outputs, or nothing beyond the gradient.
SAVES_OUTPUT = frozenset({"Softmax", "LogSoftmax", "Tanh", "Sigmoid", "Exp", "Sqrt", "Reciprocal", "Relu"})
SAVES_NOTHING = frozenset({
    "Add", "Sub", "Neg", "Identity", "Cast", "CastLike", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze",
    "Expand", "Slice", "Concat", "Split", "SplitToSequence", "SequenceAt", "ReduceMean", "ReduceSum",
    "GlobalAveragePool", "AveragePool", "Equal", "And", "Or", "Not", "IsNaN", "IsInf", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "Where",
})


def attention_score_tensors(graph: OpGraph) -> frozenset[str]:
    """Tensors inside a fused attention (`attention.py`): scores, mask sum, probabilities, NaN guard."""
    return frozenset(t for region in attention_regions(graph).values() for name in region.nodes[:-1]
                     for t in graph.node_by_name[name].outputs if t)


def saved_tensors(graph: OpGraph) -> frozenset[str]:
    """Float activations (and inputs) some op's backward reads; parameters are counted as model states.
    A fused attention keeps its output for backward (FlashAttention: O, and the row log-sum-exp, which
    is 1/head_dim of it and left out)."""
    scores = attention_score_tensors(graph)
    out: set[str] = set()
    for n in graph.compute_nodes:
        if n.op_type == "MatMul" and any(t in scores for t in n.inputs):
            out.update(n.outputs[:1])
        if n.op_type in SAVES_NOTHING:
            continue
        names = n.outputs[:1] if n.op_type in SAVES_OUTPUT else n.inputs
        for t in names:
            info = graph.tensors.get(t)
            if info is not None and info.is_float and info.kind in (TensorKind.ACTIVATION, TensorKind.INPUT):
                out.add(t)
    return frozenset(out - scores)
