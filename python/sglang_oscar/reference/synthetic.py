"""Synthetic post-RoPE Q/K/V of one attention layer with the structure that hurts 2-bit caches.

Used by ``sglang-oscar demo`` and by tests (no model download needed). What is planted:

* keys with an anisotropic spectrum (variances spread over 1.5 decades) and a few **outlier
  channels** carrying large per-channel offsets (the "massive activation" channels of LLM keys);
* queries whose covariance is **anisotropic** (energy concentrated in a few directions) and
  that also load on the key outlier channels;
* values with their own anisotropic spectrum and two offset channels;
* an **attention sink**: the first token's key is aligned with a component that every query
  carries in the lowest-frequency rotary channels (which RoPE barely rotates);
* **recency**: queries and keys share a component spread over a band of mid-frequency rotary
  channels, so after RoPE ``q_i . k_j`` carries ``sum_c cos((i - j) theta_c)``, which peaks
  at ``i = j`` and decays with distance;
* standard RoPE (base 10000, half-split pairing as in Llama/Qwen) applied to Q and K.

Everything is seeded; two seeds give two independent draws of the same distribution
(calibration vs held-out).
"""

from __future__ import annotations

import torch

OUTLIER_CHANNELS = (5, 37, 69, 100)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Half-split RoPE of ``x [T, H, D]`` at integer ``positions [T]`` (fp32)."""
    d = x.shape[-1]
    half = d // 2
    inv = 1.0 / (base ** (torch.arange(half, dtype=torch.float32) / half))
    ang = positions.float()[:, None] * inv[None]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


def _orthogonal(d: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, d, generator=gen))[0]


def synthetic_qkv(
    seq_len: int = 2048,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 128,
    seed: int = 0,
    structure_seed: int = 1234,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw ``(q [T, H_q, D], k [T, H_kv, D], v [T, H_kv, D])`` in fp32.

    Args:
        seq_len, num_q_heads, num_kv_heads, head_dim: shapes (``head_dim`` even, >= 104 so the
            outlier channels exist; smaller head_dims use channels modulo ``head_dim``).
        seed: seed of the token draws (vary it for calibration vs held-out data).
        structure_seed: seed of the fixed bases and spectra (keep it for "the same model").
    """
    d = head_dim
    sgen = torch.Generator().manual_seed(structure_seed)
    uk, uq, uv = _orthogonal(d, sgen), _orthogonal(d, sgen), _orthogonal(d, sgen)
    outliers = torch.tensor(sorted({c % d for c in OUTLIER_CHANNELS}))
    offsets = torch.tensor([8.0, -6.0, 7.0, 5.0])[: len(outliers)]
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(seq_len)
    k = (torch.randn(seq_len, num_kv_heads, d, generator=gen) * torch.logspace(0, -1.5, d)) @ uk.T
    k[..., outliers] += offsets + 2.0 * torch.randn(seq_len, num_kv_heads, len(outliers), generator=gen)
    q = (torch.randn(seq_len, num_q_heads, d, generator=gen) * torch.logspace(0.5, -1, d)) @ uq.T
    q[..., outliers] += 3.0
    v = (torch.randn(seq_len, num_kv_heads, d, generator=gen) * torch.logspace(0.3, -1, d)) @ uv.T
    v[..., [3 % d, 90 % d]] += torch.tensor([4.0, -3.0])
    half = d // 2
    # Attention sink: lowest-frequency rotary pairs (channels half-4..half-1 and their partners).
    sink_dir = torch.zeros(d)
    sink_dir[half - 4 : half] = 1.0
    q += 1.5 * sink_dir
    k[0] += 20 * sink_dir
    # Recency: a band of mid-frequency rotary pairs (theta from ~0.3 down to ~0.01).
    band = torch.zeros(d)
    lo, hi = max(1, half // 8), max(2, half // 2)
    band[lo:hi] = 1.0
    q += 0.7 * band
    k += 0.7 * band
    return apply_rope(q, pos), apply_rope(k, pos), v
