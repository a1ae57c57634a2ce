"""Baseline 2-bit quantizers that OSCAR is compared against (not used by the cache).

* ``naive``: per-token symmetric INT2 without rotation (the paper's "naive INT2"):
  ``s = max|x| / 1.5``, levels ``s * {-1.5, -0.5, 0.5, 1.5}``.
* ``kivi``: KIVI-style (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization
  for KV Cache"): keys quantized per channel over a block of tokens, values per token,
  asymmetric min/max, 4 levels.
"""

from __future__ import annotations

import torch


def naive_symmetric_int2(x: torch.Tensor) -> torch.Tensor:
    """Fake-quantize rows ``[..., D]`` with per-row symmetric INT2 (fp32 math, returns ``x.dtype``)."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 1.5
    q = torch.clamp(torch.floor(xf / s) + 0.5, -1.5, 1.5)
    return (q * s).to(x.dtype)


def asymmetric_int2(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Fake-quantize with asymmetric 4-level min/max along ``dim`` (fp32 math, returns ``x.dtype``)."""
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    s = (hi - lo).clamp_min(1e-8) / 3.0
    q = torch.clamp(torch.round((xf - lo) / s), 0, 3)
    return (q * s + lo).to(x.dtype)


def kivi_int2(k: torch.Tensor, v: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI-style 2-bit fake quantization.

    Args:
        k, v: ``[T, H, D]`` rows of one layer.
        block: tokens per per-channel key block (the last partial block is quantized too).

    Returns:
        ``(k_hat, v_hat)`` of the same shapes and dtypes: K per channel within token blocks,
        V per token.
    """
    k_hat = torch.empty_like(k)
    for start in range(0, k.shape[0], block):
        k_hat[start : start + block] = asymmetric_int2(k[start : start + block], dim=0)
    return k_hat, asymmetric_int2(v, dim=-1)
