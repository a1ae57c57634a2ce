"""Storage of the INT2 cache of the served pool (no SGLang import: kernels tests and benchmarks use it
on machines without sglang).

The pool keeps, per layer, a code plane ``[slots, kv_heads, D/4]`` uint8 and a pair plane
``[slots, kv_heads, 2 * groups]`` in the scale dtype, each stored head-major
(:func:`kv_head_major_zeros`). :func:`int2_row_views` reads the interleaved alternative (codes and
pairs in one uint8 row per (slot, kv head), allocated by :func:`kv_head_major_zeros` too), which
tests and the benchmark's ``--pool-layout rows`` compare against (docs/benchmarks.md#kernel-choices)."""

from __future__ import annotations

import torch


def kv_head_major_zeros(slots: int, kv_heads: int, width: int, dtype: torch.dtype, device, *,
                        head_major: bool = True) -> torch.Tensor:
    """Zeros ``[slots, kv_heads, width]`` of ``dtype``. ``head_major`` (the pool's layout): the memory is
    ``[kv_heads, slots, width]`` and the result its transposed view (strides ``(width, slots * width,
    1)``), so one kv head's entries at consecutive slots are adjacent (a decode program reads one kv
    head); ``False``: a contiguous slot-major tensor."""
    if head_major:
        return torch.zeros((kv_heads, slots, width), dtype=dtype, device=device).transpose(0, 1)
    return torch.zeros((slots, kv_heads, width), dtype=dtype, device=device)


def int2_row_views(rows: torch.Tensor, head_dim: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, pairs)`` views of INT2 rows ``[slots, kv_heads, row_bytes]`` (uint8, any strides
    with a contiguous last dim): codes uint8 ``[slots, kv_heads, head_dim / 4]`` (``row[:D/4]``) and
    the ``(scale, zero)`` pairs ``[slots, kv_heads, 2 * groups]`` in ``scale_dtype`` (the rest)."""
    q = head_dim // 4
    return rows[..., :q], rows[..., q:].view(scale_dtype)
