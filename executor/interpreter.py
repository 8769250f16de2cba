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

from costmodel.attention import attention_regions
from executor.ops import fused_attention, run_op
from planner.graph import OpGraph, TensorKind, load_graph, load_model_proto, shape_op_value


def _seeded_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic in the name and seed only: every process builds the same weights."""
    digest = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(digest)
    fan_in = shape[-1] if len(shape) >= 2 else 1
    return torch.randn(shape, generator=g) / max(fan_in, 1) ** 0.5 if len(shape) >= 2 else \
        torch.ones(shape) + 0.02 * torch.randn(shape, generator=g)


def _key(name: str) -> str:
    return name.replace(".", "__")


class OnnxModule(nn.Module):
    def __init__(self, graph: OpGraph, proto: onnx.ModelProto, *, seed: int = 0) -> None:
        super().__init__()
        self.graph = graph
        inits = {t.name: t for t in proto.graph.initializer}
        self.params = nn.ParameterDict()
        self.param_names: dict[str, str] = {}
        consts: dict[str, torch.Tensor] = {}
        for name, init in inits.items():
            info = graph.tensors.get(name)
            absent = init.data_location == onnx.TensorProto.EXTERNAL
            if info is not None and info.kind is TensorKind.PARAM:
                value = _seeded_init(name, info.shape, seed) if absent else \
                    torch.from_numpy(np.array(numpy_helper.to_array(init), dtype=np.float32))
                self.params[_key(name)] = nn.Parameter(value.to(torch.float32))
                self.param_names[name] = _key(name)
            elif not absent:
                consts[name] = torch.from_numpy(np.array(numpy_helper.to_array(init)))
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
    return OnnxModule(load_graph(path, dims), load_model_proto(path), seed=seed)
