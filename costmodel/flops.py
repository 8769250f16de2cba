"""Forward FLOPs per operator, on full (unsharded) shapes.

Two classes, kept apart because the field reports them apart:
- *matmul-class* (MatMul, Gemm, Conv, ConvTranspose, Einsum): 2 FLOPs per multiply-add. Their sum is
  the "model FLOPs" of MFU figures and of Megatron-LM's 72·B·s·L·h²·(1 + s/6h + V/12hL) per step
  (Korthikanti et al. 2022, appendix A), so `flops_forward` counts only these;
- *other* (element-wise, normalisations, softmax, reductions): a per-element count, reported
  separately; on real sizes it is a few percent of the total but it is memory-bound work, priced by
  bytes in the roofline, not by FLOPs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from core.graph import OpGraph, OpNode

ShapeOf = Callable[[str], tuple[int, ...]]
FlopsFn = Callable[[OpNode, ShapeOf], float]
_MATMUL_CLASS: dict[str, FlopsFn] = {}
_PER_ELEMENT: dict[str, float] = {}


def register_flops(*op_types: str) -> Callable[[FlopsFn], FlopsFn]:
    def deco(fn: FlopsFn) -> FlopsFn:
        for op in op_types:
            _MATMUL_CLASS[op] = fn
        return fn

    return deco


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@register_flops("MatMul")
def _matmul(node: OpNode, shape: ShapeOf) -> float:
    a = shape(node.inputs[0])
    k = a[-1] if a else 1
    return 2.0 * _numel(shape(node.outputs[0])) * k


@register_flops("Gemm")
def _gemm(node: OpNode, shape: ShapeOf) -> float:
    a = shape(node.inputs[0])
    k = a[0] if node.attr("transA", 0) else a[1]
    return 2.0 * _numel(shape(node.outputs[0])) * k


@register_flops("Conv", "ConvTranspose")
def _conv(node: OpNode, shape: ShapeOf) -> float:
    # Each output element (Conv) or input element (ConvTranspose) takes Cin/group · prod(kernel) MACs.
    w = shape(node.inputs[1])  # Conv: (Cout, Cin/g, k…); ConvTranspose: (Cin, Cout/g, k…)
    kernel = _numel(w[2:])
    if node.op_type == "Conv":
        return 2.0 * _numel(shape(node.outputs[0])) * w[1] * kernel
    return 2.0 * _numel(shape(node.inputs[0])) * w[1] * kernel


def conv_channels(node: OpNode, shape: ShapeOf) -> int:
    """The narrowest dim of a convolution's implicit GEMM, per group: its output channels or its
    input channels × kernel size (what bounds its efficiency, `ChannelCurve`)."""
    w = shape(node.inputs[1])  # Conv: (Cout, Cin/g, k…); ConvTranspose: (Cin, Cout/g, k…)
    groups = int(node.attr("group", 1))  # type: ignore[call-overload]
    kernel = _numel(w[2:])
    if node.op_type == "Conv":
        return min(w[0] // max(groups, 1), w[1] * kernel)
    return min(w[1], w[0] // max(groups, 1) * kernel)


def matmul_dims(node: OpNode, shape: ShapeOf) -> tuple[int, int, int]:
    """A MatMul's or Gemm's m, k, n per GEMM (batch dims apart)."""
    a, b = shape(node.inputs[0]), shape(node.inputs[1])
    if node.op_type == "Gemm":
        m, k = (a[1], a[0]) if node.attr("transA", 0) else (a[0], a[1])
        return m, k, b[0] if node.attr("transB", 0) else b[1]
    return (a[-2] if len(a) >= 2 else 1), (a[-1] if a else 1), (b[-1] if len(b) >= 2 else 1)


def matmul_narrow_dim(node: OpNode, shape: ShapeOf) -> int:
    """The narrowest of a MatMul's or Gemm's m, k, n per GEMM (batch dims apart): what bounds its
    efficiency beside its FLOPs (`DeviceSpec.matmul_narrow_efficiency`) — a 64-wide hidden size or a
    16-wide attention head."""
    dims = matmul_dims(node, shape)
    if node.op_type == "Gemm":
        return min(dims)
    return min(d for d in dims if d > 1) if max(dims) > 1 else 1


def matmul_alignment_bytes(node: OpNode, shape: ShapeOf, element_bytes: int) -> int:
    """The bytes a MatMul's or Gemm's k and n are both multiples of (at most 16): what its GEMMs' rows
    are aligned to, forward and backward alike (dX reads the output's n as its k, dW the weight's k and
    n as its m and n). A vocabulary of 50257 in bf16: 2 bytes."""
    _, k, n = matmul_dims(node, shape)
    out = 16
    for d in (k, n):
        if d > 1:
            out = min(out, (d * element_bytes) & -(d * element_bytes))
    return out


@register_flops("Einsum")
def _einsum(node: OpNode, shape: ShapeOf) -> float:
    eq = str(node.attr("equation", "")).replace(" ", "")
    lhs = eq.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for term, t in zip(lhs, node.inputs, strict=False):
        for letter, size in zip(term, shape(t), strict=False):
            sizes[letter] = size
    return 2.0 * float(np.prod(list(sizes.values()), dtype=np.float64))


# Approximate FLOPs per output element for the memory-bound ops (what a fused kernel computes).
for _op, _per in {
    "Add": 1, "Sub": 1, "Mul": 1, "Div": 1, "Pow": 1, "Sqrt": 1, "Reciprocal": 1, "Neg": 1, "Max": 1, "Min": 1,
    "Relu": 1, "Tanh": 4, "Sigmoid": 4, "Erf": 4, "Gelu": 8, "Exp": 1, "Log": 1, "Where": 1,
    "Softmax": 5, "LogSoftmax": 5, "LayerNormalization": 8, "BatchNormalization": 4,
    "SimplifiedLayerNormalization": 6, "ReduceMean": 1, "ReduceSum": 1,
    "AveragePool": 1, "MaxPool": 1, "GlobalAveragePool": 1,
}.items():
    _PER_ELEMENT[_op] = float(_per)


@dataclass(frozen=True, slots=True)
class FlopCount:
    matmul: float
    other: float

    @property
    def total(self) -> float:
        return self.matmul + self.other


def node_flops(node: OpNode, shape: ShapeOf) -> FlopCount:
    """Forward FLOPs of one node with tensor shapes from `shape` (full shapes, or one rank's shards)."""
    fn = _MATMUL_CLASS.get(node.op_type)
    if fn is not None:
        return FlopCount(fn(node, shape), 0.0)
    per = _PER_ELEMENT.get(node.op_type)
    if per is None or not node.outputs:
        return FlopCount(0.0, 0.0)
    src = node.inputs[0] if node.op_type.startswith(("Reduce", "Global")) else node.outputs[0]
    return FlopCount(0.0, per * _numel(shape(src)))


def graph_flops(graph: OpGraph) -> FlopCount:
    """Forward FLOPs of the whole graph (constant subgraphs excluded)."""
    mm = other = 0.0
    for n in graph.compute_nodes:
        c = node_flops(n, lambda t: graph.tensors[t].shape)
        mm += c.matmul
        other += c.other
    return FlopCount(mm, other)
