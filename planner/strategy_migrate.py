"""Strategy files of an older schema, read as the current one: each migration takes a document of
version N to version N + 1."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from core.collectives import Phase, Purpose, cadence_of


def migrate_v1(data: Mapping[str, Any]) -> dict[str, Any]:
    """A schema-1 document as schema 2: collectives' `reason` becomes `purpose` (same words) and gains
    its cadence (`cadence_of`: a parameter's gradient all-reduce per step unless the parameter is
    resharded for use, the rest per micro-batch; one micro-batch ran either way); one micro-batch,
    no ZeRO stage or recomputation beyond the placements, no pipeline; the profile's source defaults to
    its name (files of that time named a preset); the cost was the plain sum ("serial")."""
    d = json.loads(json.dumps(data))  # a deep copy
    params = {t for t, v in d["tensors"].items() if v["kind"] == "param"} - {r["tensor"] for r in d["reshards"]}

    def collective(c: dict[str, Any]) -> dict[str, Any]:
        purpose = Purpose(c.pop("reason", Purpose.RESHARD.value))
        tensor = c.get("tensor", "")
        return {**c, "time_s": c.get("time_s", 0.0), "phase": c.get("phase", Phase.FORWARD.value),
                "tensor": tensor, "purpose": purpose.value, "cadence": cadence_of(purpose, tensor in params).value}

    for node in d["nodes"].values():
        node["collectives"] = [collective(c) for c in node["collectives"]]
        node.setdefault("compute_s", 0.0)
    for r in d["reshards"]:
        r["collectives"] = [collective(c) for c in r["collectives"]]
    d["schema_version"] = 2
    d["profile"].setdefault("source", d["profile"]["name"])
    d["settings"].setdefault("loss", "auto")
    d["training"] = {"micro_batches": 1, "zero_stage": 0, "recompute": {}, "global_batch_size": d["settings"]["batch"],
                     "micro_batch_size": None, "layout": None, "zero_threshold_bytes": 0.0}
    d["pipeline"] = {"stages": []}
    d["cost"] = {"composer": "serial", "hidden_comm_s": 0.0, "optimizer_s": 0.0, "overhead_s": 0.0, **d["cost"]}
    d["solver"] = {"num_decisions": 0, "num_edges": 0, **d["solver"]}
    d["candidates"] = [{"error": "", **c} for c in d.get("candidates", [])]
    return d


MIGRATIONS = {1: migrate_v1}
