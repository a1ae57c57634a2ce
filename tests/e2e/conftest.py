"""Fixtures of the device-harness tests: a tiny saved checkpoint."""

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
