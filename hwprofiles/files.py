"""Profiles by name or path: the presets shipped in `hwprofiles/presets/`, and profile JSON files."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from core.errors import ProfileError
from hwprofiles.profile import HardwareProfile, profile_from_json, profile_to_json

PRESETS_PACKAGE = "hwprofiles.presets"


def list_presets() -> list[str]:
    return sorted(f.name.removesuffix(".json") for f in resources.files(PRESETS_PACKAGE).iterdir()
                  if f.name.endswith(".json"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A preset by name (`h100-sxm`) or a profile JSON by path."""
    s = str(name_or_path)
    if s in list_presets():
        text = resources.files(PRESETS_PACKAGE).joinpath(f"{s}.json").read_text()
        return _parse(text, s)
    p = Path(s)
    if p.suffix == ".json" or p.exists():
        if not p.is_file():
            raise ProfileError(f"{p}: no such profile file; pass a preset name ({', '.join(list_presets())}) or a path")
        return _parse(p.read_text(), str(p))
    raise ProfileError(f"unknown profile {s!r}; known presets: {', '.join(list_presets())} (or pass a JSON path)")


def _parse(text: str, origin_hint: str) -> HardwareProfile:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{origin_hint}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    return profile_from_json(data, origin_hint=origin_hint)


def save_profile(p: HardwareProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile_to_json(p), indent=1) + "\n")
