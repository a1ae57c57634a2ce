"""Storage of the INT2 rows of the served pool (no SGLang import: kernels tests and benchmarks use it
on machines without sglang)."""

from __future__ import annotations

import torch


def int2_row_storage(slots: int, kv_heads: int, row_bytes: int, device, *, head_major: bool = True) -> torch.Tensor:
    """Zeroed INT2 rows of one layer's K or V: uint8 ``[slots, kv_heads, row_bytes]``.

    ``head_major`` (the pool's layout): the memory is ``[kv_heads, slots, row_bytes]`` and the
    result its transposed view (strides ``(row_bytes, slots * row_bytes, 1)``), so the rows of one
    kv head at consecutive slots are adjacent; ``False``: a contiguous slot-major tensor (tests and
    benchmarks compare the two).
    """
    if head_major:
        return torch.zeros((kv_heads, slots, row_bytes), dtype=torch.uint8, device=device).transpose(0, 1)
    return torch.zeros((slots, kv_heads, row_bytes), dtype=torch.uint8, device=device)


def int2_row_views(rows: torch.Tensor, head_dim: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, pairs)`` views of INT2 rows ``[slots, kv_heads, row_bytes]`` (uint8, any strides
    with a contiguous last dim): codes uint8 ``[slots, kv_heads, head_dim / 4]`` (``row[:D/4]``) and
    the ``(scale, zero)`` pairs ``[slots, kv_heads, 2 * groups]`` in ``scale_dtype`` (the rest)."""
    q = head_dim // 4
    return rows[..., :q], rows[..., q:].view(scale_dtype)
