"""The strategy file: what `meshplan plan` decides, as versioned JSON (schema `strategy.schema.json`).

It names the model (path, fingerprint of structure and shapes, bound dims), the profile (name,
digest), the mesh, the settings, every tensor's placements, every node's strategy (input and output
specs, local kernels) and the collectives charged to it, the reshards on edges, the fallback ops, the
predicted costs and the solver statistics. The loader is strict: JSON Schema first, then the model's
fingerprint must match the graph it is applied to.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from planner.errors import MeshplanError
from planner.graph import OpGraph

SCHEMA_VERSION = 1


class StrategyError(MeshplanError):
    """A strategy file that is broken, of another schema version, or for another model."""


@dataclass(frozen=True)
class Strategy:
    data: Mapping[str, Any]  # the JSON document, validated

    @property
    def fingerprint(self) -> str:
        return str(self.data["model"]["fingerprint"])

    @property
    def step_time_s(self) -> float:
        return float(self.data["cost"]["step_time_s"])

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.data["mesh"]["shape"])

    def check_model(self, graph: OpGraph) -> None:
        if graph.fingerprint != self.fingerprint:
            raise StrategyError(
                f"the strategy was planned for model fingerprint {self.fingerprint} "
                f"({self.data['model']['name']}, dims {self.data['model']['dims']}) but this model is "
                f"{graph.fingerprint} ({graph.name}, dims {graph.dims}); re-plan it with meshplan plan")

    def to_json(self) -> str:
        return json.dumps(self.data, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


@cache
def schema() -> dict[str, Any]:
    return json.loads(resources.files("planner").joinpath("strategy.schema.json").read_text())


def from_dict(data: Mapping[str, Any], origin: str = "strategy") -> Strategy:
    if not isinstance(data, Mapping):
        raise StrategyError(f"{origin}: not a strategy (a JSON object is expected); write one with meshplan plan -o")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise StrategyError(f"{origin}: schema_version {version!r} is not {SCHEMA_VERSION}; re-plan with this meshplan")
    try:
        jsonschema.validate(data, schema())
    except jsonschema.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        raise StrategyError(f"{origin}: field {where}: {e.message}; re-plan with meshplan plan") from e
    return Strategy(data)


def load_strategy(path: str | Path) -> Strategy:
    p = Path(path)
    if not p.is_file():
        raise StrategyError(f"{p}: no such strategy file; write one with meshplan plan -o {p}")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StrategyError(f"{p}: not JSON ({e}); write a strategy with meshplan plan -o") from e
    return from_dict(data, str(p))


def diff(a: Strategy, b: Strategy) -> dict[str, Any]:
    """What changed from `a` to `b`: mesh, placements, node strategies, collectives, predicted cost."""
    da, db = a.data, b.data
    tensors = {t: (da["tensors"].get(t, {}).get("placements"), db["tensors"].get(t, {}).get("placements"))
               for t in sorted(set(da["tensors"]) | set(db["tensors"]))}
    nodes = {n: (da["nodes"].get(n, {}).get("strategy"), db["nodes"].get(n, {}).get("strategy"))
             for n in sorted(set(da["nodes"]) | set(db["nodes"]))}

    def collective_totals(d: Mapping[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        for node in d["nodes"].values():
            for c in node["collectives"]:
                out[c["kind"]] = out.get(c["kind"], 0.0) + c["bytes"]
        return out

    ca, cb = collective_totals(da), collective_totals(db)
    return {
        "same_model": a.fingerprint == b.fingerprint,
        "mesh": None if da["mesh"] == db["mesh"] else {"from": da["mesh"], "to": db["mesh"]},
        "tensors": {t: {"from": x, "to": y} for t, (x, y) in tensors.items() if x != y},
        "nodes": {n: {"from": x, "to": y} for n, (x, y) in nodes.items() if x != y},
        "collective_bytes": {k: {"from": ca.get(k, 0.0), "to": cb.get(k, 0.0)} for k in sorted(set(ca) | set(cb))
                             if ca.get(k, 0.0) != cb.get(k, 0.0)},
        "cost": {k: {"from": da["cost"][k], "to": db["cost"][k]}
                 for k in ("step_time_s", "compute_s", "comm_s", "memory_bytes_per_device")},
    }
