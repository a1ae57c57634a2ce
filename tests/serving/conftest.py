"""Fixtures of the serving-harness tests: ``scripts/gpu_e2e.py`` as a module, a tiny checkpoint."""

from __future__ import annotations

import pytest
from e2e_tiny import TINY, load_harness


@pytest.fixture(scope="session")
def e2e():
    return load_harness()


@pytest.fixture(scope="session")
def tiny_qwen3(e2e, tmp_path_factory):
    """A saved tiny seeded Qwen3 checkpoint: (path, build info)."""
    path = str(tmp_path_factory.mktemp("tiny_qwen3"))
    info = e2e.build_checkpoint("qwen3", path, seed=3, **TINY)
    return path, info
