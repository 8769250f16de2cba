"""The executor's op registry: `@op("Add", ...)` registers a torch implementation of ONNX op types
into `OPS`; each family module (`ops`, `ops_math`, `ops_vision`) registers its own, and `executor.ops`
imports them all. Helpers every family uses to read a node's attributes and constant inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from core.errors import MeshplanError
from core.graph import OpNode

TorchOp = Callable[[OpNode, list[Any]], list[Any]]


OPS: dict[str, TorchOp] = {}


class UnsupportedOpError(MeshplanError):
    """The executor has no torch implementation of an op type."""


def op(*names: str) -> Callable[[TorchOp], TorchOp]:
    def deco(fn: TorchOp) -> TorchOp:
        for n in names:
            OPS[n] = fn
        return fn

    return deco


def ints(t: Any) -> list[int]:
    v = t.tolist() if isinstance(t, torch.Tensor) else t
    return [int(x) for x in v] if isinstance(v, list | tuple) else [int(v)]


def attr_axis(node: OpNode, rank: int, default: int = 0) -> int:
    a = int(node.attr("axis", default))  # type: ignore[call-overload]
    return a + rank if a < 0 else a
