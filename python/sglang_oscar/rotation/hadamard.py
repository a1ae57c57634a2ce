"""Hadamard matrices and the bit-reversal permutation used by OSCAR rotations.

Sources: Sylvester's construction ``H_{2n} = [[H_n, H_n], [H_n, -H_n]] / sqrt(2)``
(orthonormal); spec §3.4 for the eigenvalue-sorted bit-reversal permutation ``P``.
"""

from __future__ import annotations

import torch


def is_power_of_two(n: int) -> bool:
    """True iff ``n`` is a positive int power of two."""
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix ``[n, n]`` (orthonormal, symmetric), on ``device``.

    Raises:
        ValueError: if ``n`` is not a power of two (use :func:`block_hadamard`).
    """
    if not is_power_of_two(n):
        raise ValueError(f"Sylvester Hadamard needs a power-of-two size, got {n}; use block_hadamard")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / h.shape[0] ** 0.5).to(dtype=dtype, device=device)


def largest_pow2_divisor(n: int) -> int:
    """Largest power of two dividing ``n`` (``n > 0``)."""
    return n & (-n)


def block_hadamard(n: int, block: int | None = None, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """Block-diagonal orthonormal Hadamard ``[n, n]`` with Sylvester blocks of size ``block``.

    For power-of-two ``n`` with ``block=None`` this is the full :func:`hadamard_matrix`. For
    other ``n`` (e.g. 192) the default block is the largest power of two dividing ``n``
    (192 -> three 64-blocks).

    Raises:
        ValueError: if ``block`` is not a power of two dividing ``n``.
    """
    if n <= 0:
        raise ValueError(f"size must be positive, got {n}")
    b = largest_pow2_divisor(n) if block is None else block
    if not is_power_of_two(b) or n % b:
        raise ValueError(f"block size {b} must be a power of two dividing {n}")
    return torch.block_diag(*([hadamard_matrix(b, dtype, device)] * (n // b)))


def default_hadamard(n: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The data-free rotation of size ``n``: full Hadamard if ``n`` is a power of two, else block.

    Raises:
        ValueError: ``n`` not positive.
    """
    if is_power_of_two(n):
        return hadamard_matrix(n, dtype, device)
    return block_hadamard(n, dtype=dtype, device=device)


def bit_reversal_permutation(n: int) -> torch.Tensor:
    """Bit-reversal order of ``0..n-1`` (int64 ``[n]``, CPU).

    For a power-of-two ``n`` entry ``i`` is ``i`` with its ``log2(n)`` bits reversed. For
    other ``n`` it is the bit-reversal order of ``next_pow2(n)`` with entries ``>= n`` dropped
    (still a permutation that spreads consecutive indices apart).

    Raises:
        ValueError: ``n`` not positive.
    """
    if n <= 0:
        raise ValueError(f"size must be positive, got {n}")
    bits = max((n - 1).bit_length(), 0)
    m = 1 << bits
    idx = torch.arange(m)
    rev = torch.zeros_like(idx)
    for b in range(bits):
        rev |= ((idx >> b) & 1) << (bits - 1 - b)
    return rev[rev < n]


def eig_bitrev_permutation(eigvals: torch.Tensor) -> torch.Tensor:
    """Permutation matrix ``P [D, D]`` from eigenvalues (spec §3.4, composition ``r_h_pbr``).

    Indices sorted by eigenvalue descending are placed at bit-reversed positions:
    ``perm[br[i]] = argsort(-lambda)[i]``, ``P = I[:, perm]`` (column ``c`` of ``P`` selects
    coordinate ``perm[c]``), so ``(x P)[c] = x[perm[c]]``.

    Args:
        eigvals: ``[D]`` eigenvalues.

    Returns:
        float64 ``[D, D]`` permutation matrix on ``eigvals``' device.
    """
    d = eigvals.shape[-1]
    order = torch.argsort(-eigvals.double().cpu(), stable=True)
    br = bit_reversal_permutation(d)
    perm = torch.empty(d, dtype=torch.long)
    perm[br] = order
    return torch.eye(d, dtype=torch.float64)[:, perm].to(eigvals.device)
