"""Project-wide pytest hooks."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    """Skip ``@pytest.mark.gpu`` tests when no CUDA device is available."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
