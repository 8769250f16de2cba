"""Memory per device: model states (weights, gradients, optimizer) and activations saved for backward.

Model states per parameter (ZeRO paper, Rajbhandari et al. SC'20, §5), AdamW:
  mixed precision (bf16/fp16): 2 bytes weights + 2 bytes gradients + K = 12 bytes of fp32 master
  weights, momentum and variance;  fp32: 4 + 4 + 8 (momentum, variance).
With data-parallel degree N_d, ZeRO stage 1 shards the optimizer states, 2 also the gradients, 3 also
the weights: (2 + 2 + K)Ψ, 4Ψ + KΨ/N_d, 2Ψ + (2 + K)Ψ/N_d, (4 + K)Ψ/N_d for mixed precision.

Activations: what each op's backward reads as torch's autograd saves it (`backward_reads`: a
product's operand only for the other operand's gradient), counted once per storage (`storage_roots`:
views share their input's), by `saved_tensors`; checked against the storages torch saves on six zoo
models (tests/test_interpreter.py). Attention
(QKᵀ → scale/mask → Softmax → ·V, as exporters decompose scaled_dot_product_attention) is priced as
the fused kernel training runs (FlashAttention: scores recomputed in backward), so its s×s score and
probability tensors are not kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from core.graph import OpGraph, OpNode, TensorInfo, TensorKind
from costmodel.attention import attention_regions


@dataclass(frozen=True, kw_only=True)
class Precision:
    """The training step's dtypes. `amp` is torch.autocast's (HF Trainer bf16=True): fp32 weights,
    gradients and AdamW states, bf16 matmuls, each other op in the dtype autocast gives it
    (`autocast.py`), fp32 gradient reduction; `mixed` is FSDP2's MixedPrecisionPolicy (torchtitan's
    default): the same fp32 states, the model run in bf16 on weights cast where gathered; `bf16` is Megatron's (bf16 weights and gradients, fp32
    master weights in the optimizer); `fp32` all fp32."""

    name: str
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # per parameter: fp32 master + Adam moments (mixed), or the moments (fp32)
    activation_bytes: int
    compute: str = ""  # the dtype matmuls run in ("": `name`)
    autocast: bool = False  # torch.autocast over fp32 weights: each op's dtype by autocast's lists
    # FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 weights cast to bf16 where
    # gathered for use, the model run in bf16, gradients cast back to fp32 for the reduction.
    param_casts: bool = False
    # Under autocast, for one graph (`autocast.for_graph`): each float tensor's bytes, and each node's
    # fp32 inputs cast to bf16 before it runs.
    float_bytes: Mapping[str, int] | None = field(default=None, compare=False, repr=False)
    cast_inputs: Mapping[str, tuple[str, ...]] | None = field(default=None, compare=False, repr=False)

    @property
    def model_state_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def moved_weight_bytes(self) -> int:
        """A weight's bytes in a gather: its compute dtype's where cast before it (FSDP2's param_dtype)."""
        return 2 if self.param_casts else self.weight_bytes

    @property
    def compute_dtype(self) -> str:
        return self.compute or self.name

    def bytes_of(self, info: TensorInfo) -> int:
        """A tensor's bytes per element as the step holds it."""
        if not info.is_float:
            return info.itemsize_bytes
        if self.float_bytes is not None:
            return self.float_bytes.get(info.name, self.activation_bytes)
        return self.activation_bytes


PRECISIONS = {
    "amp": Precision(name="amp", weight_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=2, compute="bf16",
                     autocast=True),
    "mixed": Precision(name="mixed", weight_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=2,
                       compute="bf16", param_casts=True),
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
# Products: the gradient of each operand is the incoming gradient times the other operand, so an
# operand is read only for the other's gradient (Gemm's bias, input 2, for none).
PRODUCTS = frozenset({"Mul", "MatMul", "Gemm"})
# Ops whose output is a view of their first input in torch (no new storage): saved, a view keeps the
# whole storage alive, once however many views of it are saved.
ALIAS_OPS = frozenset({"Identity", "Squeeze", "Unsqueeze", "Transpose", "Reshape", "Flatten", "Expand", "Slice",
                       "Split", "SplitToSequence", "SequenceAt"})
_STRIDED = frozenset({"Expand", "Slice", "Split", "SplitToSequence", "SequenceAt"})  # views with gaps or repeats


def gradient_tensors(graph: OpGraph) -> frozenset[str]:
    """Float tensors that depend on a parameter: the only ones backward computes a gradient for."""
    out = {t.name for t in graph.params}
    for n in graph.compute_nodes:
        if any(t in out for t in n.inputs):  # a sequence (SplitToSequence) carries its elements' gradients
            out.update(t for t in n.outputs if t in graph.tensors and
                       (graph.tensors[t].is_float or graph.tensors[t].dtype == "sequence"))
    return frozenset(out)


def backward_reads(node: OpNode, needs_grad: frozenset[str]) -> tuple[int, ...]:
    """Indices of the inputs an op's backward reads, as torch's autograd saves them: only for the
    gradients it computes (an op none of whose inputs needs a gradient saves nothing; x·c with c a
    constant saves c, not x); an op in SAVES_OUTPUT or SAVES_NOTHING reads none of its inputs."""
    ins = node.inputs
    if node.op_type in SAVES_NOTHING or node.op_type in SAVES_OUTPUT or not any(t in needs_grad for t in ins if t):
        return ()
    if node.op_type in PRODUCTS:
        return tuple(i for i, other in ((0, 1), (1, 0)) if ins[other] in needs_grad)
    if node.op_type == "Div":  # a/b: d/da reads b; d/db reads a and b
        return (0, 1) if ins[1] in needs_grad else (1,)
    if node.op_type == "Gather":  # an embedding's backward scatters by the indices, never reads the table
        return (1,)
    return tuple(i for i, t in enumerate(ins) if t)


def storage_roots(graph: OpGraph) -> dict[str, str]:
    """Each tensor → the tensor whose storage it shares in torch (itself unless made by an ALIAS_OPS
    view). A reshape is a view unless it merges dims its input does not hold contiguously (after a
    transpose, an expand or a slice), where torch copies: that output is a storage of its own. Each
    tensor's physical dim order is followed through transposes; a fused attention's output is laid
    out (batch, seq, heads, head_dim) under its logical (batch, heads, seq, head_dim), as
    FlashAttention and torch's SDPA kernels write it, so the usual transpose-and-merge of heads after
    it is a view."""
    root: dict[str, str] = {}
    order: dict[str, tuple[int, ...] | None] = {}  # logical dims, outermost first in memory; None: strided
    for r in attention_regions(graph).values():
        if len(graph.tensors[r.out].shape) == 4:
            order[r.out] = (0, 2, 1, 3)
    for n in graph.compute_nodes:
        src = n.inputs[0] if n.inputs else ""
        if not src or src not in graph.tensors:
            continue
        shape = graph.tensors[src].shape
        have = order.get(src, tuple(range(len(shape))))
        dense = have is not None and _in_order(have, shape)
        for t in n.outputs:
            if not t or t not in graph.tensors:
                continue
            op, new = n.op_type, graph.tensors[t].shape
            if op not in ALIAS_OPS or (op in ("Reshape", "Flatten") and not dense and not _splits_only(shape, new)):
                root[t] = t
                order.setdefault(t, tuple(range(len(new))))
                continue
            root[t] = root.get(src, src)
            if op == "Transpose" and have is not None:
                perm = [int(p) for p in n.attr("perm") or range(len(shape))[::-1]]  # type: ignore[attr-defined]
                order[t] = tuple(perm.index(d) for d in have)
            elif op in _STRIDED:
                order[t] = None
            elif new == shape:  # an identity view keeps its input's layout
                order[t] = have
            elif not dense:
                order[t] = None
            else:
                order[t] = tuple(range(len(new)))
    return root


def _in_order(order: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this physical dim order is contiguous (size-1 dims anywhere)."""
    moved = [d for d in order if shape[d] != 1]
    return moved == sorted(moved)


def _splits_only(old: tuple[int, ...], new: tuple[int, ...]) -> bool:
    """Whether `new` only splits dims of `old` (each old dim is the product of consecutive new dims):
    a view of any strided tensor."""
    i = 0
    for d in old:
        prod = 1
        while prod < d and i < len(new):
            prod *= new[i]
            i += 1
        if prod != d:
            return False
        while i < len(new) and new[i] == 1 and d == 1:
            i += 1
    return all(x == 1 for x in new[i:])


def read_in_backward(graph: OpGraph, needs_grad: frozenset[str]) -> frozenset[str]:
    """Every tensor some op's backward reads (`backward_reads`), and the inputs of views of them (a
    weight whose transpose a matmul saves is read in backward)."""
    read = {n.inputs[i] for n in graph.compute_nodes for i in backward_reads(n, needs_grad)}
    for n in reversed(graph.compute_nodes):
        if n.op_type in ALIAS_OPS and n.inputs and any(t in read for t in n.outputs):
            read.add(n.inputs[0])
    return frozenset(read)


def attention_score_tensors(graph: OpGraph) -> frozenset[str]:
    """Tensors inside a fused attention (`attention.py`): scores, mask sum, probabilities, NaN guard."""
    return frozenset(t for region in attention_regions(graph).values() for name in region.nodes[:-1]
                     for t in graph.node_by_name[name].outputs if t)


def saved_tensors(graph: OpGraph) -> frozenset[str]:
    """Float activation (and input) storages some op's backward reads, each named by its root tensor
    (`storage_roots`: views of one storage count once, a view of a parameter not at all, parameters
    being model states). What an op reads follows torch's autograd (`backward_reads`). A fused
    attention keeps its output for backward (FlashAttention: O, and the row log-sum-exp, which is
    1/head_dim of it and left out)."""
    scores = attention_score_tensors(graph)
    needs = gradient_tensors(graph)
    roots = storage_roots(graph)
    out: set[str] = set()
    for n in graph.compute_nodes:
        if n.op_type == "MatMul" and any(t in scores for t in n.inputs) and any(t in needs for t in n.inputs):
            out.update(n.outputs[:1])  # P·V: the fused kernel's output O
        names = n.outputs[:1] if n.op_type in SAVES_OUTPUT and any(t in needs for t in n.inputs) else \
            [n.inputs[i] for i in backward_reads(n, needs)]
        out.update(roots.get(t, t) for t in names)
    return frozenset(t for t in out - scores if (info := graph.tensors.get(t)) is not None and info.is_float
                     and info.kind in (TensorKind.ACTIVATION, TensorKind.INPUT))
