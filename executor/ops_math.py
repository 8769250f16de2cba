"""ONNX math ops in torch: activations, variadic element-wise ops, reductions, normalisations, Einsum.

Registered into `executor.ops.OPS` (imported by it); opsets 7–23 as found in the wild: attributes that
later opsets moved to inputs (Clip's bounds, Dropout's ratio) are read from either.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from core.graph import OpNode
from executor.opset import UnsupportedOpError, attr_axis, ints, op


def _f(node: OpNode, name: str, default: float) -> float:
    return float(node.attr(name, default))  # type: ignore[arg-type]


_ACTIVATIONS: dict[str, Any] = {
    "Floor": torch.floor, "Ceil": torch.ceil, "Round": torch.round, "Sign": torch.sign, "Softplus": F.softplus,
    "Mish": F.mish, "HardSwish": F.hardswish, "IsInf": torch.isinf,
}


@op(*_ACTIVATIONS)
def _activation(node: OpNode, x: list[Any]) -> list[Any]:
    return [_ACTIVATIONS[node.op_type](x[0])]


@op("LeakyRelu")
def _leaky_relu(node: OpNode, x: list[Any]) -> list[Any]:
    return [F.leaky_relu(x[0], _f(node, "alpha", 0.01))]


@op("Elu")
def _elu(node: OpNode, x: list[Any]) -> list[Any]:
    return [F.elu(x[0], _f(node, "alpha", 1.0))]


@op("Selu")
def _selu(node: OpNode, x: list[Any]) -> list[Any]:
    alpha, gamma = _f(node, "alpha", 1.67326319217681884765625), _f(node, "gamma", 1.05070102214813232421875)
    return [gamma * torch.where(x[0] > 0, x[0], alpha * (torch.exp(x[0]) - 1))]


@op("HardSigmoid")
def _hard_sigmoid(node: OpNode, x: list[Any]) -> list[Any]:
    return [torch.clamp(_f(node, "alpha", 0.2) * x[0] + _f(node, "beta", 0.5), 0.0, 1.0)]


@op("PRelu")
def _prelu(node: OpNode, x: list[Any]) -> list[Any]:
    return [torch.where(x[0] >= 0, x[0], x[1] * x[0])]


@op("Clip")
def _clip(node: OpNode, x: list[Any]) -> list[Any]:
    """Bounds are attributes before opset 11, optional inputs from it on."""
    lo = x[1] if len(x) > 1 and x[1] is not None else node.attr("min")
    hi = x[2] if len(x) > 2 and x[2] is not None else node.attr("max")
    lo = lo.item() if isinstance(lo, torch.Tensor) else lo
    hi = hi.item() if isinstance(hi, torch.Tensor) else hi
    return [torch.clamp(x[0], lo, hi)]  # type: ignore[arg-type]


@op("Mod")
def _mod(node: OpNode, x: list[Any]) -> list[Any]:
    return [torch.fmod(x[0], x[1]) if node.attr("fmod", 0) else torch.remainder(x[0], x[1])]


_BITWISE: dict[str, Any] = {"BitwiseAnd": torch.bitwise_and, "BitwiseOr": torch.bitwise_or, "Xor": torch.logical_xor}


@op(*_BITWISE)
def _bitwise(node: OpNode, x: list[Any]) -> list[Any]:
    return [_BITWISE[node.op_type](x[0], x[1])]


@op("Sum", "Mean")
def _variadic_sum(node: OpNode, x: list[Any]) -> list[Any]:
    out = x[0]
    for t in x[1:]:
        out = out + t
    return [out / len(x) if node.op_type == "Mean" else out]


@op("LogSoftmax")
def _log_softmax(node: OpNode, x: list[Any]) -> list[Any]:
    return [torch.log_softmax(x[0], attr_axis(node, x[0].dim(), -1))]


def _reduce_dims(node: OpNode, x: list[Any]) -> tuple[list[int], bool]:
    axes = node.attr("axes")
    if axes is None and len(x) > 1 and x[1] is not None:
        axes = ints(x[1])
    dims = list(range(x[0].dim())) if not axes else [int(a) % x[0].dim() for a in axes]  # type: ignore[attr-defined]
    return dims, bool(node.attr("keepdims", 1))


_REDUCE: dict[str, Any] = {
    "ReduceMin": lambda t, d, k: t.amin(dim=d, keepdim=k),
    "ReduceProd": lambda t, d, k: _prod(t, d, k),
    "ReduceL1": lambda t, d, k: t.abs().sum(dim=d, keepdim=k),
    "ReduceL2": lambda t, d, k: t.square().sum(dim=d, keepdim=k).sqrt(),
    "ReduceLogSumExp": lambda t, d, k: torch.logsumexp(t, dim=d, keepdim=k),
    "ReduceSumSquare": lambda t, d, k: t.square().sum(dim=d, keepdim=k),
}


def _prod(t: torch.Tensor, dims: list[int], keep: bool) -> torch.Tensor:
    for d in sorted(dims, reverse=True):
        t = t.prod(dim=d, keepdim=keep)
    return t


@op(*_REDUCE)
def _reduce_more(node: OpNode, x: list[Any]) -> list[Any]:
    dims, keep = _reduce_dims(node, x)
    return [_REDUCE[node.op_type](x[0], dims, keep)]


@op("RMSNormalization", "SimplifiedLayerNormalization")
def _rms_norm(node: OpNode, x: list[Any]) -> list[Any]:
    """Normalised over the dims from `axis` on (opset 23's RMSNormalization; onnxruntime's contrib
    SimplifiedLayerNormalization is the same function)."""
    axis = attr_axis(node, x[0].dim(), -1)
    return [F.rms_norm(x[0], x[0].shape[axis:], x[1], eps=_f(node, "epsilon", 1e-5))]


@op("Einsum")
def _einsum(node: OpNode, x: list[Any]) -> list[Any]:
    return [torch.einsum(str(node.attr("equation")).replace(" ", ""), *x)]


@op("GlobalMaxPool")
def _global_max_pool(node: OpNode, x: list[Any]) -> list[Any]:
    return [x[0].amax(dim=tuple(range(2, x[0].dim())), keepdim=True)]


@op("GlobalLpPool", "LpPool")
def _lp_pool(node: OpNode, x: list[Any]) -> list[Any]:
    p = int(node.attr("p", 2))  # type: ignore[call-overload]
    if node.op_type == "GlobalLpPool":
        return [x[0].abs().pow(p).sum(dim=tuple(range(2, x[0].dim())), keepdim=True).pow(1.0 / p)]
    spatial = x[0].dim() - 2
    if any(ints(node.attr("pads", [0]))):
        raise UnsupportedOpError(f"{node.name}: LpPool with pads is not supported")
    fn: Any = {1: F.lp_pool1d, 2: F.lp_pool2d, 3: F.lp_pool3d}[spatial]
    return [fn(x[0], p, ints(node.attr("kernel_shape")), stride=ints(node.attr("strides", [1] * spatial)))]
