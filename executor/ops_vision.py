"""ONNX image ops in torch: pooling with ONNX padding semantics, LRN, Upsample/Resize, Dropout's mask.

Registered into `executor.ops.OPS` (imported by it). Opsets 7–21: `auto_pad`, asymmetric `pads`,
`ceil_mode`, `count_include_pad`, and Upsample/Resize's scales given as an attribute or an input.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from core.graph import OpNode
from executor.opset import UnsupportedOpError, ints, op


def _pads(node: OpNode, x: torch.Tensor, kernel: list[int], strides: list[int], dilations: list[int]) -> list[int]:
    """ONNX pads [begin…, end…] for the spatial dims, `auto_pad` resolved."""
    spatial = len(kernel)
    auto = str(node.attr("auto_pad", "NOTSET"))
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for d in range(spatial):
            size = x.shape[2 + d]
            out = math.ceil(size / strides[d])
            total = max((out - 1) * strides[d] + (kernel[d] - 1) * dilations[d] + 1 - size, 0)
            small, big = total // 2, total - total // 2
            begin.append(small if auto == "SAME_UPPER" else big)
            end.append(big if auto == "SAME_UPPER" else small)
        return begin + end
    if auto == "VALID":
        return [0] * 2 * spatial
    return ints(node.attr("pads", [0] * 2 * spatial))


def _torch_pad(pads: list[int]) -> list[int]:
    """ONNX [b1, b2, …, e1, e2, …] → F.pad's last-dim-first [b_n, e_n, …, b_1, e_1]."""
    n = len(pads) // 2
    out: list[int] = []
    for d in reversed(range(n)):
        out += [pads[d], pads[n + d]]
    return out


@op("MaxPool", "AveragePool")
def _pool(node: OpNode, x: list[Any]) -> list[Any]:
    data = x[0]
    kernel = ints(node.attr("kernel_shape"))
    spatial = len(kernel)
    strides = ints(node.attr("strides", [1] * spatial))
    dilations = ints(node.attr("dilations", [1] * spatial))
    pads = _pads(node, data, kernel, strides, dilations)
    ceil = bool(node.attr("ceil_mode", 0))
    symmetric = pads[:spatial] == pads[spatial:] and all(2 * p <= k for p, k in zip(pads, kernel, strict=False))
    if node.op_type == "MaxPool":
        fn: Any = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[spatial]
        if not symmetric:
            data, pads = F.pad(data, _torch_pad(pads), value=float("-inf")), [0] * 2 * spatial
        if len(node.outputs) > 1 and node.outputs[1]:
            raise UnsupportedOpError(f"{node.name}: MaxPool's Indices output is not supported")
        return [fn(data, kernel, strides, pads[:spatial], dilations, ceil_mode=ceil)]
    if any(d != 1 for d in dilations):
        raise UnsupportedOpError(f"{node.name}: AveragePool with dilations is not supported")
    include = bool(node.attr("count_include_pad", 0))
    fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[spatial]
    if not symmetric:
        if not include:  # the count of the real cells per window: pool a padded map of ones
            ones = F.pad(torch.ones_like(data[:1, :1]), _torch_pad(pads))
            total = fn(F.pad(data, _torch_pad(pads)), kernel, strides, 0, ceil_mode=ceil, count_include_pad=True)
            return [total / fn(ones, kernel, strides, 0, ceil_mode=ceil, count_include_pad=True)]
        data, pads = F.pad(data, _torch_pad(pads)), [0] * 2 * spatial
    return [fn(data, kernel, strides, pads[:spatial], ceil_mode=ceil, count_include_pad=include)]


@op("LRN")
def _lrn(node: OpNode, x: list[Any]) -> list[Any]:
    """y = x / (bias + α/size · Σ x² over `size` channels)^β: torch's local_response_norm averages
    the squares over the window, which is the same α/size scaling."""
    return [F.local_response_norm(x[0], int(node.attr("size")), alpha=float(node.attr("alpha", 1e-4)),  # type: ignore[call-overload, arg-type]
                                  beta=float(node.attr("beta", 0.75)), k=float(node.attr("bias", 1.0)))]  # type: ignore[arg-type]


@op("Dropout")
def _dropout(node: OpNode, x: list[Any]) -> list[Any]:
    """Inference form (the exported graph was traced in eval mode); the mask, where asked, is all kept."""
    if len(node.outputs) > 1 and node.outputs[1]:
        return [x[0], torch.ones_like(x[0], dtype=torch.bool)]
    return [x[0]]


@op("Upsample", "Resize")
def _resize(node: OpNode, x: list[Any]) -> list[Any]:
    """Nearest (asymmetric, floor — Upsample's and Resize-10's rule) and (bi/tri)linear with
    half_pixel or align_corners coordinates; scales from the attribute (Upsample-7), the input, or
    Resize's sizes."""
    data = x[0]
    spatial = data.dim() - 2
    scales: Any = node.attr("scales")
    if node.op_type == "Upsample" and len(x) > 1 and x[1] is not None:
        scales = x[1].tolist()
    elif node.op_type == "Resize":
        if len(x) > 2 and x[2] is not None and x[2].numel():
            scales = x[2].tolist()
        elif len(x) > 3 and x[3] is not None and x[3].numel():
            sizes = ints(x[3])
            scales = [s / d for s, d in zip(sizes, data.shape, strict=True)]
    if scales is None:
        raise UnsupportedOpError(f"{node.name}: {node.op_type} without scales or sizes")
    scales = [float(s) for s in scales]
    if scales[0] != 1.0 or scales[1] != 1.0:
        raise UnsupportedOpError(f"{node.name}: {node.op_type} over the batch or channel dims is not supported")
    mode = str(node.attr("mode", "nearest"))
    size = [math.floor(data.shape[2 + d] * scales[2 + d]) for d in range(spatial)]
    coord = str(node.attr("coordinate_transformation_mode", "asymmetric" if node.op_type == "Upsample" or
                          mode == "nearest" else "half_pixel"))
    if mode == "nearest":
        nearest = str(node.attr("nearest_mode", "round_prefer_floor" if node.op_type == "Resize" else "floor"))
        if coord != "asymmetric" or nearest not in ("floor", "round_prefer_floor") or \
                (nearest == "round_prefer_floor" and any(s != int(s) for s in scales[2:])):
            raise UnsupportedOpError(f"{node.name}: Resize nearest with {coord}/{nearest} is not supported")
        return [F.interpolate(data, size=size, mode="nearest")]
    if mode in ("linear", "bilinear", "trilinear") and coord in ("half_pixel", "pytorch_half_pixel", "align_corners"):
        torch_mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[spatial]
        return [F.interpolate(data, size=size, mode=torch_mode, align_corners=coord == "align_corners")]
    raise UnsupportedOpError(f"{node.name}: {node.op_type} mode {mode!r} with {coord} is not supported")
