"""ONNX graph → torch module: runs an OpGraph with torch ops, trainable.

Float initializers the importer classed as parameters become `nn.Parameter`s (their ONNX values, or,
for shape-only files, a deterministic seeded init, identical in every process); other initializers
are buffers. Constant subgraphs are evaluated once at construction from the static shapes, so a
step runs only the compute nodes; attention chains run as one fused kernel (`costmodel/attention.py`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from core.graph import Init, OpGraph, shape_op_value
from costmodel.attention import attention_regions
from executor.ops import fused_attention, run_op
from planner.graph import load_graph, load_model_proto


def _seeded_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic in the name and seed only: every process builds the same weights."""
    digest = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(digest)
    fan_in = shape[-1] if len(shape) >= 2 else 1
    return torch.randn(shape, generator=g) / max(fan_in, 1) ** 0.5 if len(shape) >= 2 else \
        torch.ones(shape) + 0.02 * torch.randn(shape, generator=g)


def _key(name: str) -> str:
    return name.replace(".", "__")


def _initializer_value(init: onnx.TensorProto, base_dir: Path | None) -> np.ndarray | None:
    """An initializer's value: inline, or from its external data file beside the model (torch.onnx
    saves weights there by default); None where that file is absent (a shape-only model)."""
    if init.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(init)
    location = next((e.value for e in init.external_data if e.key == "location"), "")
    if base_dir is None or not location or not (base_dir / location).is_file():
        return None
    t = onnx.TensorProto()
    t.CopyFrom(init)
    onnx.external_data_helper.load_external_data_for_tensor(t, str(base_dir))
    t.data_location = onnx.TensorProto.DEFAULT
    return numpy_helper.to_array(t)


class OnnxModule(nn.Module):
    def __init__(self, graph: OpGraph, proto: onnx.ModelProto, *, seed: int = 0, base_dir: Path | None = None) -> None:
        super().__init__()
        self.graph = graph
        inits = {t.name: t for t in proto.graph.initializer}
        self.params = nn.ParameterDict()
        self.param_names: dict[str, str] = {}
        for name, p in graph.parameters.items():  # a split merged initializer gives its value to each part
            shape = graph.tensors[name].shape
            data = _initializer_value(inits[p.source], base_dir) if p.source in inits else None
            if p.init is Init.ZEROS:  # a zero bias the exporter's optimizer removed
                value = torch.zeros(shape)
            elif data is None:  # shape-only: no weights anywhere
                value = _seeded_init(name, shape, seed)
            else:
                value = torch.from_numpy(np.array(data, dtype=np.float32))
            self.params[_key(name)] = nn.Parameter(value.to(torch.float32))
            self.param_names[name] = _key(name)
        consts: dict[str, torch.Tensor] = {}
        for name, init in inits.items():
            data = None if name in graph.parameters else _initializer_value(init, base_dir)
            if data is not None:
                consts[name] = torch.from_numpy(np.array(data))
        self.values = self._fold_constants(consts)
        # Attention chains run as one fused kernel (costmodel/attention.py).
        self.regions = attention_regions(graph)
        self.fused_away = {n for r in self.regions.values() for n in r.nodes[:-1]}

    def _fold_constants(self, consts: dict[str, torch.Tensor]) -> dict[str, Any]:
        g = self.graph
        values: dict[str, Any] = dict(consts)
        for node in g.nodes:
            if node.name not in g.constant_nodes:
                continue
            if node.op_type in ("Shape", "Size"):
                outs: list[Any] = [torch.from_numpy(shape_op_value(g, node))]
            else:
                outs = run_op(node, [values[t] if t in values else self._meta(t) if t else None for t in node.inputs])
            values.update(zip(node.outputs, outs, strict=False))
        return values

    def _meta(self, name: str) -> torch.Tensor:
        """An activation read by a constant node (CastLike's dtype source): shape and dtype, no data."""
        info = self.graph.tensors[name]
        dtype = getattr(torch, info.dtype) if hasattr(torch, info.dtype) else torch.float32
        return torch.empty(info.shape, dtype=dtype, device="meta")

    def to_device(self, device: torch.device) -> OnnxModule:
        """Parameters and folded constants on `device` (a rank's GPU under nccl); constants are folded
        on the CPU at construction, from the static shapes."""
        self.to(device)
        self.values = {k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
                       for k, v in self.values.items()}
        return self

    def parameter(self, name: str) -> nn.Parameter:
        return self.params[self.param_names[name]]

    def forward(self, *inputs: torch.Tensor) -> Any:
        g = self.graph
        env: dict[str, Any] = dict(self.values)
        env.update(zip(g.inputs, inputs, strict=True))
        for name, key in self.param_names.items():
            env[name] = self.params[key]
        for node in g.compute_nodes:
            if node.name in self.fused_away:
                continue
            region = self.regions.get(node.name)
            if region is not None:
                outs = [fused_attention(env[region.q], env[region.kt], env.get(region.mask) if region.mask else None,
                                   env[region.v])]
            else:
                outs = run_op(node, [env.get(t) if t else None for t in node.inputs])
            env.update(zip(node.outputs, outs, strict=False))
        result = [env[t] for t in g.outputs]
        return result[0] if len(result) == 1 else tuple(result)


def load_module(path: str | Path, dims: Mapping[str, int], *, seed: int = 0) -> OnnxModule:
    return OnnxModule(load_graph(path, dims), load_model_proto(path), seed=seed, base_dir=Path(path).parent)
