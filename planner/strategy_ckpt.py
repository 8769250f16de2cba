"""Strategy checkpoints (MindSpore's strategy_ckpt_save_file / load_file): a plan's parameter
placements and mesh written apart from the strategy, and read back as pins that hold a new plan to
them (`plan --strategy-out`, `--strategy-in`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from core.errors import read_json
from core.graph import OpGraph, TensorKind
from planner.strategy import SCHEMA_VERSION, Strategy, StrategyError, from_dict

_LAYOUT_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["schema_version", "only_trainable_params", "model", "mesh", "parameters"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION}, "only_trainable_params": {"const": True},
        "model": {"type": "object", "required": ["name", "fingerprint"],
                  "properties": {"name": {"type": "string"}, "fingerprint": {"type": "string"}}},
        "mesh": {"type": "object", "required": ["shape", "axis_names"],
                 "properties": {"shape": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                                "axis_names": {"type": "array", "items": {"type": "string"}}}},
        "parameters": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["shape", "placements"], "additionalProperties": False,
            "properties": {"shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                           "placements": {"type": "array", "items": {"type": "string"}}}}},
    },
}



@dataclass(frozen=True, kw_only=True)
class ParameterLayout:
    """What a strategy checkpoint holds: the mesh, and each trainable parameter's shape and placements
    (MindSpore's `only_trainable_params`). `plan --strategy-in` holds a new plan to it, so that its
    parameters are laid out as a run's before (its checkpoints, its other jobs) whatever else changed."""

    model_name: str
    fingerprint: str
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    parameters: Mapping[str, tuple[tuple[int, ...], str]]  # name → (shape, placements as a pin: "S(0),R")


def parameter_layout(s: Strategy) -> ParameterLayout:
    return ParameterLayout(model_name=s.model.name, fingerprint=s.model.fingerprint, mesh_shape=tuple(s.mesh.shape),
                           axis_names=tuple(s.mesh.axis_names),
                           parameters={t: (tuple(v.shape), str(v.spec)) for t, v in sorted(s.tensors.items())
                                       if v.kind is TensorKind.PARAM})


def save_strategy_checkpoint(s: Strategy, path: str | Path, *, only_trainable_params: bool = False) -> None:
    """The strategy as a strategy checkpoint: the whole file (as `plan -o`), or with
    `only_trainable_params` the parameters' layout only."""
    if not only_trainable_params:
        s.save(path)
        return
    layout = parameter_layout(s)
    doc = {"schema_version": SCHEMA_VERSION, "only_trainable_params": True,
           "model": {"name": layout.model_name, "fingerprint": layout.fingerprint},
           "mesh": {"shape": list(layout.mesh_shape), "axis_names": list(layout.axis_names)},
           "parameters": {n: {"shape": list(shape), "placements": [str(p) for p in s.tensors[n].spec.placements]}
                          for n, (shape, _) in layout.parameters.items()}}  # as in the strategy file
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load_parameter_layout(path: str | Path) -> ParameterLayout:
    """A strategy checkpoint: a parameters-only file, or any strategy file (its parameters' layout)."""
    p = Path(path)
    data = read_json(p, StrategyError, f"write one with plan `strategy_out` {p}")
    if not (isinstance(data, dict) and data.get("only_trainable_params")):
        return parameter_layout(from_dict(data, str(p)))
    try:
        jsonschema.validate(data, _LAYOUT_SCHEMA)
    except jsonschema.ValidationError as e:
        where = "/".join(str(x) for x in e.absolute_path) or "top level"
        raise StrategyError(f"{p}: not a strategy checkpoint ({where}: {e.message}); write one with plan "
                            "`strategy_out`") from e
    return ParameterLayout(model_name=data["model"]["name"], fingerprint=data["model"]["fingerprint"],
                           mesh_shape=tuple(data["mesh"]["shape"]), axis_names=tuple(data["mesh"]["axis_names"]),
                           parameters={n: (tuple(v["shape"]), ",".join(v["placements"]))
                                       for n, v in data["parameters"].items()})


def held_to_layout(layout: ParameterLayout, graph: OpGraph, origin: str) -> dict[str, str]:
    """Pins holding a plan of `graph` to a strategy checkpoint's parameter placements; the first
    parameter that is not the model's (name or shape) refused in one line."""
    params = {t.name: t.shape for t in graph.params}
    for name in sorted(set(params) | set(layout.parameters)):
        mine, theirs = params.get(name), layout.parameters.get(name, (None, ""))[0]
        if mine != theirs:
            what = "not in this model" if mine is None else "not in the checkpoint" if theirs is None else \
                f"{list(theirs)} there, {list(mine)} here"
            raise StrategyError(f"`strategy_in` {origin} is for model {layout.model_name}, whose parameters differ: "
                                f"{name} ({what}); plan this model without it, or pass its own")
    return {n: spec for n, (_, spec) in layout.parameters.items()}
