"""The 2-bit "quarter split" packing layout of INT2 KV rows.

Source: docs/format.md (spec §1.2 of the original system). A row of ``D`` 2-bit codes
(``D % 4 == 0``) is stored as ``D/4`` bytes. Byte ``j`` holds the codes of elements
``j``, ``j + D/4``, ``j + D/2`` and ``j + 3D/4`` in bits 0-1, 2-3, 4-5 and 6-7:

    byte[j] = c[j] | c[j + D/4] << 2 | c[j + D/2] << 4 | c[j + 3D/4] << 6

so every quarter of the row is one contiguous lane of the packed byte vector.
"""

from __future__ import annotations

import torch

CODES_PER_BYTE = 4
BITS = 2


def check_head_dim(head_dim: int) -> None:
    """Raise ``ValueError`` unless ``head_dim`` is a positive multiple of 4."""
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % CODES_PER_BYTE:
        raise ValueError(
            f"head_dim={head_dim!r} is not supported by the INT2 quarter-split layout: "
            f"it must be a positive multiple of {CODES_PER_BYTE} (e.g. 64, 128, 192, 256, 512)"
        )


def pack_quarter(codes: torch.Tensor) -> torch.Tensor:
    """Pack 2-bit codes into bytes with the quarter-split layout.

    Args:
        codes: integer tensor ``[..., D]`` with values in ``[0, 3]``; ``D % 4 == 0``.

    Returns:
        ``uint8`` tensor ``[..., D/4]``.

    Raises:
        ValueError: if ``D`` is not a multiple of 4, the dtype is not an integer type, or a
            code is outside ``[0, 3]``.
    """
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
    d = codes.shape[-1]
    check_head_dim(d)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 3):
        raise ValueError("codes must lie in [0, 3] for 2-bit packing")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], CODES_PER_BYTE, d // CODES_PER_BYTE)
    return c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)


def unpack_quarter(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_quarter`.

    Args:
        packed: ``uint8`` tensor ``[..., D/4]``.

    Returns:
        ``uint8`` codes ``[..., D]`` in ``[0, 3]``.

    Raises:
        ValueError: if ``packed`` is not ``uint8``.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    parts = [(packed >> (BITS * k)) & 3 for k in range(CODES_PER_BYTE)]
    return torch.cat(parts, dim=-1)
