"""How each rank reads its inputs (MindSpore's dataset_strategy): `data_parallel` (the default), each
rank its data-parallel share, split as the plan splits the input; `full_batch`, each rank the whole
batch, sliced after loading (the rows beyond its share moved for nothing: priced as input traffic over
the host link, `CostModel.price_items`); or SPLITS, MindSpore's tuple of per-input splits — one tuple
per graph input, one split count per dim, `((2, 1), (2, 1))` — which places each input: a dim split k
ways is sharded over mesh axes whose sizes multiply to k (pins on the inputs)."""

from __future__ import annotations

import ast
import itertools
import math

from core.errors import MeshplanError
from core.graph import OpGraph
from core.mesh import DeviceMesh
from planner.search.decisions import PinError

DATA_PARALLEL, FULL_BATCH = "data_parallel", "full_batch"


def parse_dataset_strategy(text: str) -> str | tuple[tuple[int, ...], ...]:
    """The word, or the splits as a tuple of int tuples; a one-line error otherwise."""
    if text in (DATA_PARALLEL, FULL_BATCH):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if not isinstance(value, tuple) or not value or not all(
            isinstance(t, tuple) and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in t)
            for t in value):
        raise MeshplanError(f"`dataset_strategy` {text!r}: give data_parallel, full_batch, or one tuple of positive "
                            "split counts per input, e.g. ((2, 1), (2, 1))")
    return value


def check_splits(splits: tuple[tuple[int, ...], ...], graph: OpGraph) -> None:
    """One tuple per input, one count per dim, each dividing its dim (a `PinError`: no mesh changes it)."""
    if len(splits) != len(graph.inputs):
        raise PinError(f"`dataset_strategy` gives {len(splits)} input splits; {graph.name} has {len(graph.inputs)} "
                            f"inputs ({', '.join(graph.inputs)}): give one tuple each")
    for name, split in zip(graph.inputs, splits, strict=True):
        shape = graph.tensors[name].shape
        if len(split) != len(shape):
            raise PinError(f"`dataset_strategy` {split} for input {name}: it has {len(shape)} dims {tuple(shape)}; "
                                "give one split count per dim")
        for d, (k, n) in enumerate(zip(split, shape, strict=True)):
            if n % k:
                raise PinError(f"`dataset_strategy` splits dim {d} of input {name} ({n}) {k} ways, which does not "
                                    f"divide it; give a split that divides {n}")


def split_pins(splits: tuple[tuple[int, ...], ...], graph: OpGraph, mesh: DeviceMesh) -> dict[str, str]:
    """Each input's placement on `mesh` (pins): a dim split k ways sharded over the first unused mesh axes
    whose sizes multiply to k; a one-line error where none do."""
    out: dict[str, str] = {}
    for name, split in zip(graph.inputs, splits, strict=True):
        used: set[int] = set()
        placements = ["R"] * mesh.ndim
        for d, k in enumerate(split):
            if k == 1:
                continue
            axes = _axes_for(k, mesh.shape, used)
            if axes is None:
                raise MeshplanError(f"`dataset_strategy` splits dim {d} of input {name} {k} ways; no mesh axes of mesh "
                                    f"{list(mesh.shape)} left multiply to {k}: give splits the mesh's axes make")
            used |= set(axes)
            for a in axes:
                placements[a] = f"S({d})"
        out[name] = ",".join(placements)
    return out


def _axes_for(k: int, shape: tuple[int, ...], used: set[int]) -> tuple[int, ...] | None:
    free = [a for a in range(len(shape)) if a not in used and shape[a] > 1]
    for r in range(1, len(free) + 1):
        for axes in itertools.combinations(free, r):
            if math.prod(shape[a] for a in axes) == k:
                return axes
    return None
