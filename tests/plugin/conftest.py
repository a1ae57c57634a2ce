"""Served-path tests: the INT2 pool and the OSCAR backend's forward paths on CPU.

Kernels run under the Triton interpreter (set here before any kernel module is imported when
there is no CUDA device).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    os.environ["TRITON_INTERPRET"] = "1"
