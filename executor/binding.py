"""`apply`'s first step: each ONNX parameter of a strategy bound to the module parameters it stands
for. Names are compared in torch's spellings (`normalize`), with the prefixes wrappers and exporters
add ("model.", "module.", "p_") matched by the longest common dotted suffix; a tied weight is one ONNX
parameter and one `Parameter` object under two names; a weight the exporter stored transposed
(`Fold.LAYOUT`) binds with its dims swapped. Anything left over, or a shape that differs, is refused
in one line (`ApplyError`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from torch import nn

from core.errors import MeshplanError
from core.graph import Fold, OpGraph, TensorKind
from planner.params import normalize
from planner.strategy import Strategy


class ApplyError(MeshplanError):
    """A strategy that does not fit the module (names, shapes, mesh), or a plan `apply` cannot run."""


@dataclass(frozen=True)
class Binding:
    """One ONNX parameter and the module parameter it is: its names there (several when tied)."""

    onnx: str
    fqns: tuple[str, ...]
    transposed: bool


def bind_parameters(strategy: Strategy, graph: OpGraph, module: nn.Module) -> tuple[Binding, ...]:
    """ONNX parameters ↔ the module's parameters, or an `ApplyError` naming the first mismatch."""
    named = list(module.named_parameters(remove_duplicate=False))
    by_object: dict[int, list[str]] = defaultdict(list)
    shapes: dict[int, tuple[int, ...]] = {}
    for fqn, p in named:
        by_object[id(p)].append(fqn)
        shapes[id(p)] = tuple(p.shape)
    keys = {fqn: name_key(fqn) for fqn, _ in named}
    obj_of = {fqn: id(p) for fqn, p in named}
    onnx_params = [t for t, v in strategy.tensors.items() if v.kind is TensorKind.PARAM]
    bound: list[Binding] = []
    used: set[int] = set()
    for name in onnx_params:
        info = graph.parameters.get(name)
        origin: str = info.origin if info is not None and info.origin else name
        match = best_match(name_key(origin), keys)
        if match is None:
            raise ApplyError(f"strategy parameter {origin} {list(strategy.tensors[name].shape)} has no parameter in "
                             f"the module; plan the ONNX exported from this module (meshplan export)")
        fqn = match
        obj = obj_of[fqn]
        want = tuple(strategy.tensors[name].shape)
        have = shapes[obj]
        transposed = info is not None and info.fold is Fold.LAYOUT and have == want[::-1] and len(want) == 2
        if have != want and not transposed:
            raise ApplyError(f"parameter {fqn}: the module's shape is {list(have)}, the strategy's {origin} is "
                             f"{list(want)}; plan the ONNX exported from this module (meshplan export)")
        if obj in used:
            raise ApplyError(f"module parameter {fqn} stands for two strategy parameters; plan the ONNX exported "
                             "from this module (meshplan export)")
        used.add(obj)
        bound.append(Binding(name, tuple(by_object[obj]), transposed))
    for fqn, p in named:
        if id(p) not in used and p.requires_grad:
            raise ApplyError(f"module parameter {fqn} {list(p.shape)} is not in the strategy; plan the ONNX exported "
                             "from this module (meshplan export)")
    return tuple(bound)


def name_key(name: str) -> str:
    n = name[2:] if name.startswith(("p_", "b_")) else name
    return normalize(n)


def best_match(key: str, keys: dict[str, str]) -> str | None:
    """The module name whose normalised form equals `key` or ends it (or is ended by it) on a name
    boundary: wrappers add prefixes ("model.", "module."); the longest match wins."""
    best: tuple[int, str] | None = None
    for fqn, k in keys.items():
        if k == key:
            return fqn
        if key.endswith("_" + k) or k.endswith("_" + key):
            score = min(len(k), len(key))
            if best is None or score > best[0]:
                best = (score, fqn)
    return best[1] if best else None
