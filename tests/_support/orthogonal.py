"""The one random-orthogonal helper of the test suite."""

from __future__ import annotations

import torch


def random_orthogonal(d: int, heads: int | None = None, *, generator: torch.Generator | None = None,
                      dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """A Haar-random orthogonal ``[d, d]`` matrix (or ``[heads, d, d]`` stack), in ``dtype`` on ``device``.

    QR of a float64 Gaussian matrix with the signs of R's diagonal folded into Q (Mezzadri 2007,
    "How to generate random matrices from the classical compact groups"), so the draw is uniform
    over O(d) and ``generator`` makes it reproducible.
    """
    def one() -> torch.Tensor:
        q, r = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=generator))
        return q * torch.sign(torch.diagonal(r))

    m = one() if heads is None else torch.stack([one() for _ in range(heads)])
    return m.to(dtype=dtype, device=device).contiguous()
