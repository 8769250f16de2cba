"""One error hierarchy for everything meshplan rejects.

Every error a user can cause derives from `MeshplanError`; `cli.py` prints it as one line and exits 2.
Messages name the problem and the fix. This module is the root of the flow: every stage may import it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MeshplanError(Exception):
    """A problem with the user's input (model, profile, mesh, strategy, limits); never a bug."""


class ModelError(MeshplanError):
    """The ONNX file cannot be read or its graph cannot be planned as given."""


class DimBindingError(ModelError):
    """A symbolic dimension is unbound, bound twice, or bound to a name the model does not have."""

    def __init__(self, message: str, *, unknown: tuple[str, ...] = (), unbound: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.unknown = unknown  # names bound that the model does not have
        self.unbound = unbound  # the model's symbolic dims left unbound


class ProfileError(MeshplanError):
    """A hardware profile is unknown, malformed or inconsistent."""


def read_json(path: Path, error: type[MeshplanError], fix: str) -> Any:
    """A user's JSON file, or `error` in one line: the file missing, or not JSON; `fix` says what to
    pass instead (`…; {fix}`)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise error(f"{path}: no such file; {fix}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not JSON ({e.__class__.__name__}: {e}); {fix}") from e
