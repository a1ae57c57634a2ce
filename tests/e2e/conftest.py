"""Fixtures of the device-harness tests: tiny saved checkpoints."""

from __future__ import annotations

import pytest

from .checkpoints import build_checkpoint
from .tiny import TINY


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A saved tiny seeded Qwen3 checkpoint: (path, build info)."""
    path = str(tmp_path_factory.mktemp("tiny_qwen3"))
    info = build_checkpoint("qwen3", path, seed=3, **TINY)
    return path, info


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """Build (once per session) and return ``(path, build info)`` of a tiny seeded checkpoint of a
    family at its CPU size (:data:`~.tiny.TINY_FAMILY`): ``tiny_family("gpt_oss")``."""
    from .tiny import TINY_FAMILY

    built: dict = {}

    def get(name: str):
        if name not in built:
            path = str(tmp_path_factory.mktemp(f"tiny_{name}"))
            built[name] = (path, build_checkpoint(name, path, seed=3, **TINY_FAMILY[name]))
        return built[name]

    return get
