"""Sizes of the GPU cases (``@pytest.mark.gpu``) in the per-op kernel test files.

The GPU cases run at real sizes (contexts up to 128K, batch up to 64) on ``OSCAR_GPU_TEST_DEVICE``
(default ``cuda``). ``OSCAR_GPU_TEST_DEVICE=cpu OSCAR_GPU_TEST_SCALE=0.002`` with ``TRITON_INTERPRET=1``
dry-runs their logic on a CPU at tiny sizes (call the test functions directly: the ``gpu`` marker
skips them under the interpreter in pytest).
"""

from __future__ import annotations

import os

DEV = os.environ.get("OSCAR_GPU_TEST_DEVICE", "cuda")
SCALE = float(os.environ.get("OSCAR_GPU_TEST_SCALE", "1"))
#: the served default windows at real scale, the CPU tests' small ones in a dry run
GPU_SINK, GPU_RECENT = (64, 256) if SCALE >= 0.1 else (4, 8)


def scaled(x: int) -> int:
    """``x`` scaled by ``OSCAR_GPU_TEST_SCALE``, at least 1."""
    return max(1, int(x * SCALE))
