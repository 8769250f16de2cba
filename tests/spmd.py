"""A numpy SPMD simulator: split tensors per simulated rank, run ops per rank, reassemble.

Used by the rule and resharding tests to check, numerically, that a strategy computes what the
unsharded op computes. Placements are applied axis by axis, mesh axis 0 first (DTensor's order), with
torch.chunk semantics for uneven splits; Partial values are random addends that sum (or average) to
the tensor, so a rule that mishandles a partial input fails.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

from core.placement import Partial, Replicate, Shard, Spec

Coord = tuple[int, ...]
Locals = dict[Coord, np.ndarray]


def coords(mesh_shape: tuple[int, ...]) -> list[Coord]:
    return list(itertools.product(*(range(s) for s in mesh_shape)))


def chunk_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """torch.chunk: pieces of ceil(n/k); the last ones may be short or empty."""
    c = -(-n // k)
    return min(i * c, n), min((i + 1) * c, n)


def _noise(shape: tuple[int, ...], key: tuple[object, ...]) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:4], "little")
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float64)


def shard(x: np.ndarray, spec: Spec, mesh_shape: tuple[int, ...]) -> Locals:
    out: Locals = {}
    for c in coords(mesh_shape):
        local = x
        for a, p in enumerate(spec.placements):
            k, i = mesh_shape[a], c[a]
            if isinstance(p, Shard):
                lo, hi = chunk_bounds(local.shape[p.dim], k, i)
                local = np.take(local, range(lo, hi), axis=p.dim)
            elif isinstance(p, Partial):
                if not np.issubdtype(local.dtype, np.floating):
                    raise ValueError("Partial of a non-float tensor")
                addends = [_noise(local.shape, (a, c[:a], j)).astype(local.dtype) for j in range(k - 1)]
                total = local * (k if p.reduce_op == "avg" else 1)
                last = total - sum(addends, np.zeros_like(local))
                local = addends[i] if i < k - 1 else last
        out[c] = local
    return out


def unshard(locals_: Mapping[Coord, np.ndarray], spec: Spec, mesh_shape: tuple[int, ...],
            *, check_replicas: bool = True) -> np.ndarray:
    current: dict[Coord, np.ndarray] = dict(locals_)
    for a in reversed(range(len(mesh_shape))):
        p = spec.placements[a]
        merged: dict[Coord, np.ndarray] = {}
        for c in {c[:a] + c[a + 1:] for c in current}:
            pieces = [current[(*c[:a], i, *c[a:])] for i in range(mesh_shape[a])]
            if isinstance(p, Shard):
                merged[c] = np.concatenate(pieces, axis=p.dim)
            elif isinstance(p, Partial):
                total = np.sum(pieces, axis=0)
                merged[c] = total / len(pieces) if p.reduce_op == "avg" else total
            else:
                assert isinstance(p, Replicate)
                if check_replicas:
                    for q in pieces[1:]:
                        np.testing.assert_allclose(q, pieces[0], rtol=1e-5, atol=1e-5, err_msg="replicas differ")
                merged[c] = pieces[0]
        current = merged
    (result,) = current.values()
    return result


def local_shape(shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...], c: Coord) -> tuple[int, ...]:
    out = list(shape)
    for a, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            lo, hi = chunk_bounds(out[p.dim], mesh_shape[a], c[a])
            out[p.dim] = hi - lo
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Running one ONNX node per rank


def _lrn(node: onnx.NodeProto, x: np.ndarray) -> np.ndarray:
    """LRN as the ONNX spec defines it: onnx.reference's (1.23) sums its window over the batch
    index instead of the channels (op_lrn.py loops over x.shape[0]), so it is not the reference."""
    a = {k.name: helper.get_attribute_value(k) for k in node.attribute}
    size, alpha, beta, bias = int(a["size"]), a.get("alpha", 1e-4), a.get("beta", 0.75), a.get("bias", 1.0)
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = np.pad(x.astype(np.float64) ** 2, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))
    window = sum(sq[:, i:i + x.shape[1]] for i in range(size))
    return (x / (bias + alpha / size * window) ** beta).astype(x.dtype)


def run_node(node: onnx.NodeProto, inputs: Sequence[np.ndarray | None], opset: int = 20) -> list[np.ndarray]:
    if node.op_type == "LRN":
        return [_lrn(node, inputs[0])]  # type: ignore[arg-type]
    names = [n for n in node.input]
    feeds = {n: v for n, v in zip(names, inputs, strict=True) if n and v is not None}
    graph = helper.make_graph(
        [node], "one",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)) for n, v in feeds.items()],
        [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 10)
    return list(ReferenceEvaluator(model).run(None, feeds))
