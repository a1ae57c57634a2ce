"""Kernel tests: CPU tests run under the Triton interpreter, GPU tests (``gpu`` marker) compiled.

* Without CUDA, ``TRITON_INTERPRET=1`` is set here (before any kernel module is imported), so
  ``pytest tests/kernels`` works on a CPU-only machine.
* Under the interpreter the ``gpu`` tests are skipped (real sizes); without the interpreter the
  CPU-sized interpreter tests are skipped (they pass CPU tensors to the kernels).
* A test run on both takes the ``device`` fixture: ``"cpu"`` (interpreter, small sizes) or ``"cuda"``
  (compiled, real sizes; the ``gpu`` marker, so ``-m gpu`` selects it and ``-m "not gpu"`` deselects
  it); the test picks its sizes from the device.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    os.environ["TRITON_INTERPRET"] = "1"

@pytest.fixture(params=[pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """Where a kernel test runs: ``"cpu"`` under the interpreter, ``"cuda"`` compiled (``gpu`` marker)."""
    return request.param


# modules that do not go through the interpreter themselves
_EITHER = {"test_compile.py"}


def pytest_collection_modifyitems(config, items):
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    here = os.path.dirname(os.path.abspath(__file__))
    skip_gpu = pytest.mark.skip(reason="gpu test: not under TRITON_INTERPRET")
    skip_cpu = pytest.mark.skip(reason="interpreter test: run with TRITON_INTERPRET=1")
    for item in items:
        path = str(item.fspath)
        if os.path.dirname(path) != here or os.path.basename(path) in _EITHER:
            continue
        if "gpu" in item.keywords:
            if interp:
                item.add_marker(skip_gpu)
        elif not interp:
            item.add_marker(skip_cpu)
