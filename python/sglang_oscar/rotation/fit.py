"""OSCAR rotation fitting math, as pure functions on tensors (float64 throughout).

Sources: spec §3.4.

* K objective (GQA-aware query covariance): for kv head ``h`` with query heads
  ``Q_h = {h*g, ..., h*g + g - 1}`` (``g = H_q / H_kv``, the HF/SGLang GQA mapping
  ``kv_head = q_head // g``), ``C_h = sum_{t, i in Q_h} q_{t,i}^T q_{t,i} / (T g)``.
  The K quantization error ``e`` perturbs scores by ``q e^T``, whose mean square is
  ``e C_h e^T``, so directions with large query energy need small key error.
* V objective (score-weighted value covariance): weights ``w_t = k_t C_h k_t^T`` (the
  expected squared score of key ``t``), ``S_h = sum_t w_t v_t^T v_t / sum_t w_t``.
* Rotation (composition ``r_h_pbr``): ``Sigma = U diag(lambda) U^T`` (``eigh``, ascending),
  ``R = U H P`` with ``H`` the normalised Hadamard (block-Hadamard when ``D`` is not a power
  of two) and ``P`` the eigenvalue-sorted bit-reversal permutation
  (:func:`.hadamard.eig_bitrev_permutation`). Rows are rotated as ``x R``.
* Per layer: ``Sigma = mean_h`` of the per-head matrices. Per head: one ``R`` per kv head.
"""

from __future__ import annotations

import torch

from .hadamard import default_hadamard, eig_bitrev_permutation


def _check_rows(name: str, x: torch.Tensor, ndim: int = 3) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or Inf")


def gqa_group(num_q_heads: int, num_kv_heads: int) -> int:
    """Query heads per kv head. Raises ``ValueError`` unless ``num_kv_heads`` divides ``num_q_heads``."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return num_q_heads // num_kv_heads


def query_second_moment_sums(q: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, int]:
    """Unnormalised GQA query second moments, for streaming accumulation.

    Args:
        q: ``[T, H_q, D]`` post-RoPE queries (any float dtype).
        num_kv_heads: ``H_kv``.

    Returns:
        ``(sums, rows_per_head)``: float64 ``[H_kv, D, D]`` (on ``q``'s device) with
        ``sums[h] = sum_{t, i in Q_h} q_{t,i}^T q_{t,i}``, and ``T * g`` (int).

    Raises:
        ValueError: ``q`` not 3-D, non-finite, or ``num_kv_heads`` not dividing its heads.
    """
    _check_rows("q", q)
    t, hq, d = q.shape
    g = gqa_group(hq, num_kv_heads)
    qg = q.double().reshape(t, num_kv_heads, g, d).permute(1, 0, 2, 3).reshape(num_kv_heads, t * g, d)
    return torch.einsum("hnd,hne->hde", qg, qg), t * g


def query_covariance(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """GQA-aware query second moment per kv head, ``C_h`` (float64 ``[H_kv, D, D]``).

    Raises:
        ValueError: bad shapes, non-finite input, or no tokens.
    """
    sums, rows = query_second_moment_sums(q, num_kv_heads)
    if rows == 0:
        raise ValueError("query_covariance needs at least one token")
    return sums / rows


def value_weighted_sums(k: torch.Tensor, v: torch.Tensor, qcov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised score-weighted value second moments, for streaming accumulation.

    Args:
        k: ``[T, H_kv, D_k]`` post-RoPE keys.
        v: ``[T, H_kv, D_v]`` values.
        qcov: float64 ``[H_kv, D_k, D_k]`` query covariance :func:`query_covariance`.

    Returns:
        ``(sums, weight_sums)``: float64 ``[H_kv, D_v, D_v]`` with
        ``sums[h] = sum_t w_{t,h} v_{t,h}^T v_{t,h}`` and float64 ``[H_kv]`` ``sum_t w_{t,h}``,
        where ``w_{t,h} = k_{t,h} C_h k_{t,h}^T``.
    """
    _check_rows("k", k)
    _check_rows("v", v)
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share [tokens, kv_heads]")
    h, dk = k.shape[1], k.shape[2]
    if tuple(qcov.shape) != (h, dk, dk):
        raise ValueError(f"qcov must have shape {(h, dk, dk)}, got {tuple(qcov.shape)}")
    kd, vd = k.double(), v.double()
    w = torch.einsum("thd,hde,the->th", kd, qcov.double(), kd)
    sums = torch.einsum("th,thd,the->hde", w, vd, vd)
    return sums, w.sum(dim=0)


def score_weighted_value_covariance(k: torch.Tensor, v: torch.Tensor, qcov: torch.Tensor) -> torch.Tensor:
    """``S_h = sum_t w_t v_t^T v_t / sum_t w_t`` per kv head (float64 ``[H_kv, D_v, D_v]``).

    Raises:
        ValueError: bad shapes, non-finite input, or all weights zero.
    """
    sums, wsum = value_weighted_sums(k, v, qcov)
    if not bool((wsum > 0).all()):
        raise ValueError("score weights sum to zero for some kv head (all-zero queries or keys)")
    return sums / wsum[:, None, None]


def canonical_signs(u: torch.Tensor) -> torch.Tensor:
    """Eigenvectors (columns of ``u``, ``[..., D, D]``) with a fixed sign: each column is flipped so
    that its entry of largest magnitude is positive (the first such entry on a tie).

    ``eigh`` returns each eigenvector up to its sign, and LAPACK (CPU) and cuSOLVER (GPU) choose
    differently; under ``U H`` a sign flip is not a sign of an output coordinate but a different
    rotation (the Hadamard mixes the eigen-directions), with a different INT2 error. Fixing the
    signs makes a fit the same file on any device (up to rounding and degenerate eigenvalues).
    """
    idx = u.abs().argmax(dim=-2, keepdim=True)
    sign = torch.where(torch.gather(u, -2, idx) < 0, -1.0, 1.0).to(u.dtype)
    return u * sign


def rotation_from_covariance(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OSCAR rotation ``R = U H P`` of one symmetric PSD matrix (``U`` with :func:`canonical_signs`).

    Args:
        sigma: ``[D, D]`` second-moment matrix (symmetrised here).

    Returns:
        ``(R, eigvals)``: float64 ``[D, D]`` orthogonal rotation and ``[D]`` eigenvalues
        (ascending).

    Raises:
        ValueError: non-square or non-finite input.
    """
    if sigma.dim() != 2 or sigma.shape[0] != sigma.shape[1]:
        raise ValueError(f"covariance must be square [D, D], got {tuple(sigma.shape)}")
    s = sigma.double()
    if not torch.isfinite(s).all():
        raise ValueError("covariance contains NaN or Inf")
    s = 0.5 * (s + s.T)
    eigvals, u = torch.linalg.eigh(s)
    u = canonical_signs(u)
    d = s.shape[0]
    r = u @ default_hadamard(d, device=s.device) @ eig_bitrev_permutation(eigvals)
    return r, eigvals


def rotations_from_covariances(cov: torch.Tensor, per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit one layer's rotation(s) from per-kv-head covariances.

    Args:
        cov: ``[H_kv, D, D]``.
        per_head: ``False`` -> one matrix from the head-mean covariance; ``True`` -> one per head.

    Returns:
        ``(R, eigvals)``: float64 ``[D, D]`` and ``[D]`` (per layer) or ``[H_kv, D, D]`` and
        ``[H_kv, D]`` (per head).
    """
    if cov.dim() != 3:
        raise ValueError(f"covariances must be [kv_heads, D, D], got {tuple(cov.shape)}")
    if not per_head:
        return rotation_from_covariance(cov.double().mean(dim=0))
    pairs = [rotation_from_covariance(c) for c in cov]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def fit_layer(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per_head: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit ``(R_k, R_v)`` of one attention layer directly from captured rows.

    Args:
        q: ``[T, H_q, D_k]`` post-RoPE queries; k: ``[T, H_kv, D_k]``; v: ``[T, H_kv, D_v]``.
        per_head: per-(layer, kv head) matrices instead of one per layer.

    Returns:
        float64 ``R_k``, ``R_v``: ``[D, D]`` or ``[H_kv, D, D]``.
    """
    qcov = query_covariance(q, k.shape[1])
    vcov = score_weighted_value_covariance(k, v, qcov)
    return rotations_from_covariances(qcov, per_head)[0], rotations_from_covariances(vcov, per_head)[0]
