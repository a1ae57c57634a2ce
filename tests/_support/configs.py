"""Writing model configs for tests."""

from __future__ import annotations

import json


def write_config(tmp_path, cfg: dict, name: str = "config.json") -> str:
    """Write ``cfg`` as JSON to ``tmp_path / name`` and return the path as a string."""
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return str(p)
