"""ONNX operators in torch, one function per op type (opsets 7–23), registered by decorator.

Each takes the node and its input tensors (None for absent optional inputs) and returns the outputs.
This module holds the core (element-wise, matmul, conv, views, gathers); `ops_math` and `ops_vision`
register the rest. Every op type the planner has a sharding rule for runs here (a test walks both
tables); `meshplan run` refuses a model with any other op type before starting its ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from core.graph import OpNode

# The other families register into OPS on import.
from executor import ops_math, ops_vision  # noqa: F401
from executor.opset import OPS, UnsupportedOpError, attr_axis, ints, op

_DTYPES = {1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32, 7: torch.int64,
           9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16}


def fused_attention(q: torch.Tensor, kt: torch.Tensor, mask: torch.Tensor | None, v: torch.Tensor) -> torch.Tensor:
    """An exporter-decomposed attention chain (`costmodel/attention.py`) as torch's fused SDPA: the
    scale is already in q and kᵀ."""
    return F.scaled_dot_product_attention(q, kt.transpose(-1, -2), v, attn_mask=mask, scale=1.0)


def eager_attention(q: torch.Tensor, kt: torch.Tensor, mask: torch.Tensor | None, v: torch.Tensor) -> torch.Tensor:
    """The same chain as torch's eager ops (transformers' eager attention): the scores and the
    probabilities written to memory, each step its own kernel (`attention.materialized_kernels`)."""
    scores = torch.matmul(q, kt)
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def run_op(node: OpNode, inputs: list[Any]) -> list[Any]:
    fn = OPS.get(node.op_type)
    if fn is None:
        raise UnsupportedOpError(f"the executor cannot run {node.op_type} (node {node.name}); "
                                 "add it to executor/ops.py")
    return fn(node, inputs)


_BINARY: dict[str, Callable[..., Any]] = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Equal": torch.eq,
           "And": torch.logical_and, "Or": torch.logical_or, "Less": torch.lt, "LessOrEqual": torch.le,
           "Greater": torch.gt, "GreaterOrEqual": torch.ge}
_UNARY: dict[str, Callable[..., Any]] = {"Neg": torch.neg, "Sqrt": torch.sqrt, "Reciprocal": torch.reciprocal, "Relu": torch.relu,
          "Tanh": torch.tanh, "Sigmoid": torch.sigmoid, "Erf": torch.erf, "Cos": torch.cos, "Sin": torch.sin,
          "Exp": torch.exp, "Log": torch.log, "Abs": torch.abs, "IsNaN": torch.isnan, "Not": torch.logical_not}


@op(*_BINARY)
def _binary(node: OpNode, x: list[Any]) -> list[Any]:
    return [_BINARY[node.op_type](x[0], x[1])]


@op(*_UNARY)
def _unary(node: OpNode, x: list[Any]) -> list[Any]:
    return [_UNARY[node.op_type](x[0])]


@op("Pow")
def _pow(node: OpNode, x: list[Any]) -> list[Any]:
    """A constant one-element exponent (GELU's x³, RMSNorm's x²) is passed as a number: torch's
    scalar-exponent kernels are ~20× faster on a CPU than the broadcast tensor one."""
    e = x[1]
    if isinstance(e, torch.Tensor) and e.numel() == 1 and not e.requires_grad and e.is_floating_point() \
            and e.dim() <= x[0].dim():
        return [torch.pow(x[0], float(e))]
    return [torch.pow(x[0], e)]


@op("Div")
def _div(node: OpNode, x: list[Any]) -> list[Any]:
    if not x[0].is_floating_point():
        return [torch.div(x[0], x[1], rounding_mode="trunc")]
    return [x[0] / x[1]]


@op("Max", "Min")
def _max(node: OpNode, x: list[Any]) -> list[Any]:
    fn = torch.maximum if node.op_type == "Max" else torch.minimum
    out = x[0]
    for t in x[1:]:
        out = fn(out, t)
    return [out]


@op("Where")
def _where(node: OpNode, x: list[Any]) -> list[Any]:
    return [torch.where(x[0], x[1], x[2])]


@op("Identity")
def _identity(node: OpNode, x: list[Any]) -> list[Any]:
    return [x[0]]


@op("Gelu")
def _gelu(node: OpNode, x: list[Any]) -> list[Any]:
    return [F.gelu(x[0], approximate=str(node.attr("approximate", "none")))]


@op("Cast")
def _cast(node: OpNode, x: list[Any]) -> list[Any]:
    return [x[0].to(_DTYPES[int(node.attr("to"))])]  # type: ignore[call-overload]


@op("CastLike")
def _cast_like(node: OpNode, x: list[Any]) -> list[Any]:
    return [x[0].to(x[1].dtype)]


@op("MatMul")
def _matmul(node: OpNode, x: list[Any]) -> list[Any]:
    return [torch.matmul(x[0], x[1])]


@op("Gemm")
def _gemm(node: OpNode, x: list[Any]) -> list[Any]:
    """One fused kernel, addmm (as nn.Linear runs), instead of a matmul, a scale and an add."""
    a = x[0].t() if node.attr("transA", 0) else x[0]
    b = x[1].t() if node.attr("transB", 0) else x[1]
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))  # type: ignore[arg-type]
    if len(x) > 2 and x[2] is not None:
        return [torch.addmm(x[2], a, b, beta=beta, alpha=alpha)]
    return [a @ b if alpha == 1.0 else alpha * (a @ b)]


@op("Conv")
def _conv(node: OpNode, x: list[Any]) -> list[Any]:
    spatial = x[1].dim() - 2
    pads = ints(node.attr("pads", [0] * 2 * spatial))
    if pads[:spatial] != pads[spatial:]:
        raise UnsupportedOpError(f"{node.name}: asymmetric Conv padding is not supported")
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spatial]
    return [fn(x[0], x[1], x[2] if len(x) > 2 else None, stride=ints(node.attr("strides", [1] * spatial)),
               padding=pads[:spatial], dilation=ints(node.attr("dilations", [1] * spatial)),
               groups=int(node.attr("group", 1)))]  # type: ignore[call-overload]


@op("BatchNormalization")
def _batch_norm(node: OpNode, x: list[Any]) -> list[Any]:
    """Inference form (running statistics), or with `training_mode` (opset 14+) batch statistics and
    the updated running statistics as outputs: running = momentum · running + (1 − momentum) · batch."""
    eps = float(node.attr("epsilon", 1e-5))  # type: ignore[arg-type]
    if not node.attr("spatial", 1):
        raise UnsupportedOpError(f"{node.name}: BatchNormalization-7 with spatial=0 is not supported")
    if not node.attr("training_mode", 0):
        return [F.batch_norm(x[0], x[3], x[4], x[1], x[2], training=False, eps=eps)]
    axes = [d for d in range(x[0].dim()) if d != 1]
    batch_mean, batch_var = x[0].mean(dim=axes), x[0].var(dim=axes, unbiased=False)  # ONNX: population variance
    momentum = float(node.attr("momentum", 0.9))  # type: ignore[arg-type]
    y = F.batch_norm(x[0], None, None, x[1], x[2], training=True, eps=eps)
    return [y, momentum * x[3] + (1 - momentum) * batch_mean, momentum * x[4] + (1 - momentum) * batch_var]


@op("LayerNormalization")
def _layer_norm(node: OpNode, x: list[Any]) -> list[Any]:
    axis = attr_axis(node, x[0].dim(), -1)
    bias = x[2] if len(x) > 2 else None
    return [F.layer_norm(x[0], x[0].shape[axis:], x[1], bias, eps=float(node.attr("epsilon", 1e-5)))]  # type: ignore[arg-type]


@op("Softmax")
def _softmax(node: OpNode, x: list[Any]) -> list[Any]:
    return [torch.softmax(x[0], attr_axis(node, x[0].dim(), -1))]


@op("ReduceMean", "ReduceSum", "ReduceMax")
def _reduce(node: OpNode, x: list[Any]) -> list[Any]:
    axes = node.attr("axes")
    if axes is None and len(x) > 1 and x[1] is not None:
        axes = ints(x[1])
    keep = bool(node.attr("keepdims", 1))
    dims = list(range(x[0].dim())) if not axes else [int(a) % x[0].dim() for a in axes]  # type: ignore[attr-defined]
    if node.op_type == "ReduceMean":
        return [x[0].mean(dim=dims, keepdim=keep)]
    if node.op_type == "ReduceSum":
        return [x[0].sum(dim=dims, keepdim=keep)]
    return [x[0].amax(dim=dims, keepdim=keep)]


@op("GlobalAveragePool")
def _gap(node: OpNode, x: list[Any]) -> list[Any]:
    return [x[0].mean(dim=tuple(range(2, x[0].dim())), keepdim=True)]


@op("Reshape")
def _reshape(node: OpNode, x: list[Any]) -> list[Any]:
    shape = ints(x[1])
    if not node.attr("allowzero", 0):
        shape = [x[0].shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return [x[0].reshape(shape)]


@op("Flatten")
def _flatten(node: OpNode, x: list[Any]) -> list[Any]:
    a = attr_axis(node, x[0].dim(), 1)
    return [x[0].reshape(int(torch.tensor(x[0].shape[:a]).prod()), -1)]


@op("Transpose")
def _transpose(node: OpNode, x: list[Any]) -> list[Any]:
    perm = node.attr("perm") or tuple(reversed(range(x[0].dim())))
    return [x[0].permute(*ints(perm))]


@op("Squeeze")
def _squeeze(node: OpNode, x: list[Any]) -> list[Any]:
    axes = ints(x[1]) if len(x) > 1 and x[1] is not None else ints(node.attr("axes", []))
    if not axes:
        return [x[0].squeeze()]
    return [x[0].squeeze(tuple(a % x[0].dim() for a in axes))]


@op("Unsqueeze")
def _unsqueeze(node: OpNode, x: list[Any]) -> list[Any]:
    axes = ints(x[1]) if len(x) > 1 and x[1] is not None else ints(node.attr("axes", []))
    out = x[0]
    rank = x[0].dim() + len(axes)
    for a in sorted(a % rank for a in axes):
        out = out.unsqueeze(a)
    return [out]


@op("Expand")
def _expand(node: OpNode, x: list[Any]) -> list[Any]:
    return [torch.broadcast_to(x[0], torch.broadcast_shapes(tuple(x[0].shape), tuple(ints(x[1]))))]


@op("Concat")
def _concat(node: OpNode, x: list[Any]) -> list[Any]:
    return [torch.cat([t for t in x if t is not None], dim=attr_axis(node, x[0].dim()))]


@op("Slice")
def _slice(node: OpNode, x: list[Any]) -> list[Any]:
    data = x[0]
    starts, ends = ints(x[1]), ints(x[2])
    axes = ints(x[3]) if len(x) > 3 and x[3] is not None else list(range(len(starts)))
    steps = ints(x[4]) if len(x) > 4 and x[4] is not None else [1] * len(starts)
    index: list[Any] = [slice(None)] * data.dim()
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        if st <= 0:
            raise UnsupportedOpError(f"{node.name}: Slice with step {st} is not supported")
        n = data.shape[a]
        index[a % data.dim()] = slice(max(min(s if s >= 0 else s + n, n), 0), max(min(e if e >= 0 else e + n, n), 0), st)
    return [data[tuple(index)]]


@op("Split", "SplitToSequence")
def _split(node: OpNode, x: list[Any]) -> list[Any]:
    a = attr_axis(node, x[0].dim())
    if len(x) > 1 and x[1] is not None:
        sizes = ints(x[1])
        scalar = isinstance(x[1], torch.Tensor) and x[1].dim() == 0
        parts = list(torch.split(x[0], sizes[0] if scalar else sizes, dim=a))
    else:
        n = int(node.attr("num_outputs", len(node.outputs)))  # type: ignore[call-overload]
        parts = list(torch.tensor_split(x[0], n, dim=a)) if node.op_type == "Split" else \
            list(torch.split(x[0], 1, dim=a))
    if node.op_type == "SplitToSequence":
        if not node.attr("keepdims", 1) and (len(x) < 2 or x[1] is None):
            parts = [p.squeeze(a) for p in parts]
        return [parts]
    return parts


@op("SequenceAt")
def _sequence_at(node: OpNode, x: list[Any]) -> list[Any]:
    return [x[0][int(x[1])]]


@op("Gather")
def _gather(node: OpNode, x: list[Any]) -> list[Any]:
    data, idx = x
    a = attr_axis(node, data.dim())
    idx = torch.where(idx < 0, idx + data.shape[a], idx)
    out = data.index_select(a, idx.reshape(-1))
    return [out.reshape((*data.shape[:a], *idx.shape, *data.shape[a + 1:]))]  # (a scalar index: a 0-d shape)


@op("TopK")
def _topk(node: OpNode, x: list[Any]) -> list[Any]:
    k = int(x[1].reshape(-1)[0]) if isinstance(x[1], torch.Tensor) else int(x[1])
    values, indices = torch.topk(x[0], k, dim=int(node.attr("axis", -1)),  # type: ignore[call-overload]
                                 largest=bool(node.attr("largest", 1)), sorted=bool(node.attr("sorted", 1)))
    return [values, indices]


@op("ScatterND")
def _scatter_nd(node: OpNode, x: list[Any]) -> list[Any]:
    data, idx, updates = x
    reduction = str(node.attr("reduction", "none"))
    if reduction not in ("none", "add"):
        raise UnsupportedOpError(f"the executor cannot run ScatterND with reduction {reduction} (node {node.name}); "
                                 "add it to executor/ops.py")
    idx = torch.where(idx < 0, idx + torch.tensor(data.shape[:idx.shape[-1]], device=idx.device), idx)
    return [data.index_put(tuple(idx.unbind(-1)), updates, accumulate=reduction == "add")]


@op("ScatterElements")
def _scatter_elements(node: OpNode, x: list[Any]) -> list[Any]:
    data, idx, updates = x
    a = attr_axis(node, data.dim())
    reduction = str(node.attr("reduction", "none"))
    idx = torch.where(idx < 0, idx + data.shape[a], idx)
    if reduction == "none":
        return [data.scatter(a, idx, updates)]
    if reduction in ("add", "mul"):
        return [data.scatter_reduce(a, idx, updates, "sum" if reduction == "add" else "prod")]
    raise UnsupportedOpError(f"the executor cannot run ScatterElements with reduction {reduction} (node "
                             f"{node.name}); add it to executor/ops.py")


@op("GatherElements")
def _gather_elements(node: OpNode, x: list[Any]) -> list[Any]:
    a = attr_axis(node, x[0].dim())
    idx = torch.where(x[1] < 0, x[1] + x[0].shape[a], x[1])
    return [torch.gather(x[0], a, idx)]


@op("GatherND")
def _gather_nd(node: OpNode, x: list[Any]) -> list[Any]:
    data, idx = x
    b = int(node.attr("batch_dims", 0))  # type: ignore[call-overload]
    k = idx.shape[-1]
    batch = data.shape[:b]
    flat_d = data.reshape(-1, *data.shape[b:])  # (B, ...)
    flat_i = idx.reshape(flat_d.shape[0], -1, k)  # (B, M, k)
    rows = [flat_d[i][tuple(flat_i[i, :, j] for j in range(k))] for i in range(flat_d.shape[0])]
    out = torch.stack(rows)
    return [out.reshape(*batch, *idx.shape[b:-1], *data.shape[b + k:])]


@op("Shape")
def _shape(node: OpNode, x: list[Any]) -> list[Any]:
    dims = list(x[0].shape)
    start, end = int(node.attr("start", 0)), node.attr("end")  # type: ignore[call-overload]
    return [torch.tensor(dims[start:None if end is None else int(end)], dtype=torch.int64)]  # type: ignore[call-overload]


@op("Range")
def _range(node: OpNode, x: list[Any]) -> list[Any]:
    return [torch.arange(x[0].item(), x[1].item(), x[2].item(), dtype=x[0].dtype)]


@op("CumSum")
def _cumsum(node: OpNode, x: list[Any]) -> list[Any]:
    a = int(x[1].item()) % x[0].dim()
    t = x[0].flip(a) if node.attr("reverse", 0) else x[0]
    out = torch.cumsum(t, a)
    if node.attr("exclusive", 0):
        out = out - t
    return [out.flip(a) if node.attr("reverse", 0) else out]


@op("ConstantOfShape")
def _constant_of_shape(node: OpNode, x: list[Any]) -> list[Any]:
    v = node.attr("value")
    fill = v[3][0] if isinstance(v, tuple) and v[3] else 0.0
    dtype = getattr(torch, str(v[1])) if isinstance(v, tuple) else torch.float32
    return [torch.full(ints(x[0]), fill, dtype=dtype)]


@op("Constant")
def _constant(node: OpNode, x: list[Any]) -> list[Any]:
    for key, v in node.attrs:
        if key == "value" and isinstance(v, tuple):
            if v[3] is None:
                raise UnsupportedOpError(f"{node.name}: a large Constant tensor is not kept by the importer")
            return [torch.tensor(v[3], dtype=getattr(torch, str(v[1]))).reshape(v[2])]
        if key in ("value_int", "value_ints"):
            return [torch.tensor(v, dtype=torch.int64)]
        if key in ("value_float", "value_floats"):
            return [torch.tensor(v, dtype=torch.float32)]
    raise UnsupportedOpError(f"{node.name}: Constant without a supported value attribute")


