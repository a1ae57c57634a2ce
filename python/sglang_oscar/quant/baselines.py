"""Baseline 2-bit quantizers that OSCAR is compared against (not used by the cache).

* ``naive``: per-token symmetric INT2 without rotation (the paper's "naive INT2"):
  ``s = max|x| / 1.5``, levels ``s * {-1.5, -0.5, 0.5, 1.5}``.
"""

from __future__ import annotations

import torch


def naive_symmetric_int2(x: torch.Tensor) -> torch.Tensor:
    """Fake-quantize rows ``[..., D]`` with per-row symmetric INT2 (fp32 math, returns ``x.dtype``)."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 1.5
    q = torch.clamp(torch.floor(xf / s) + 0.5, -1.5, 1.5)
    return (q * s).to(x.dtype)
