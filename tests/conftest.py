"""Project-wide pytest hooks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_sessionstart(session):
    """Refuse to test another tree: ``sglang_oscar`` must be imported from this checkout's ``python/``.

    An editable install made in another clone (``pip install -e .`` there, e.g. by ``.ci/run``)
    would otherwise make every test here exercise that clone's code. ``SGLANG_OSCAR_TEST_INSTALLED=1``
    accepts an installed wheel on purpose.
    """
    here = (REPO / "python").resolve()
    hint = f"run `pip install -e .` in {REPO} or set PYTHONPATH={here}"
    try:
        import sglang_oscar
    except ImportError as exc:
        pytest.exit(f"sglang_oscar cannot be imported ({exc}): {hint}", returncode=4)
    found = Path(sglang_oscar.__file__).resolve()
    if here not in found.parents and os.environ.get("SGLANG_OSCAR_TEST_INSTALLED") != "1":
        pytest.exit(f"sglang_oscar is imported from {found.parent}, not from this checkout ({here}): {hint} "
                    "(or set SGLANG_OSCAR_TEST_INSTALLED=1 to test an installed wheel on purpose)", returncode=4)


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
