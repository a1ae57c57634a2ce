"""Project-wide pytest hooks."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_sessionstart(session):
    """Refuse to test another tree: ``sglang_oscar`` must be imported from this checkout's ``python/``.

    An editable install made in another clone (``pip install -e .`` there, e.g. by ``.ci/run``)
    would otherwise make every test here exercise that clone's code.
    """
    import sglang_oscar

    here = (REPO / "python").resolve()
    found = Path(sglang_oscar.__file__).resolve()
    if here not in found.parents:
        pytest.exit(f"sglang_oscar is imported from {found.parent}, not from this checkout ({here}): run "
                    f"`pip install -e .` in {REPO} or set PYTHONPATH={here}", returncode=4)


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
