"""Baseline 2-bit quantizers that OSCAR is compared against (not used by the cache).

* ``naive``: per-token symmetric INT2 without rotation (the paper's "naive INT2"):
  ``s = max|x| / 1.5``, levels ``s * {-1.5, -0.5, 0.5, 1.5}``; one scale per row, so
  ``2 + 8 * scale_bytes / D`` bits per element (:func:`naive_bits_per_element`).
* ``kivi``: KIVI-style asymmetric 2-bit cache (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit
  Quantization for KV Cache", ICML 2024, arXiv 2402.02750, §3-4 and its reference code
  ``quant/new_pack.py`` / ``models/llama_kivi.py``):

  * **keys per channel**: the cache is cut along the token axis into groups of ``G_k`` tokens
    (aligned at position 0); every (group, head, channel) gets its own min/max
    (:func:`kivi_quantize_keys`);
  * **values per token**: every (token, head) row is cut along head_dim into groups of ``G_v``
    elements, each with its own min/max (:func:`kivi_quantize_values`);
  * quantizer (both): ``scale = (max - min) / 3``, ``code = clamp(round((x - min) / scale), 0, 3)``,
    ``x_hat = code * scale + min`` (KIVI's ``(2**bits - 1)`` levels), ``scale`` and ``min`` stored
    in 16 bits (rounded to ``scale_dtype`` before the codes are computed);
  * **residual** of ``R`` full-precision tokens (``R`` a multiple of ``G_k``; KIVI's default
    ``R = 128``). KIVI's decode loop keeps the newest keys in full precision until ``R`` of them
    have accumulated and then quantizes all ``R`` at once, so at cache length ``n`` the first
    ``floor(n / R) * R`` keys are INT2; values leave the full-precision window one at a time, so
    the newest ``min(n, R)`` values are full precision (:func:`kivi_hp_masks`,
    :func:`kivi_cache`). Residual tokens are stored in full precision only (not also in INT2).
"""

from __future__ import annotations

import torch

_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def naive_symmetric_int2(x: torch.Tensor) -> torch.Tensor:
    """Fake-quantize rows ``[..., D]`` with per-row symmetric INT2 (fp32 math, returns ``x.dtype``)."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 1.5
    q = torch.clamp(torch.floor(xf / s) + 0.5, -1.5, 1.5)
    return (q * s).to(x.dtype)


def naive_bits_per_element(head_dim: int, scale_bytes: int = 2) -> float:
    """True bits per element of :func:`naive_symmetric_int2`: the 2-bit code plus one scale of
    ``scale_bytes`` per row of ``head_dim`` elements (no zero point, no windows).

    Raises:
        ValueError: ``head_dim`` or ``scale_bytes`` not positive.
    """
    if head_dim <= 0 or scale_bytes <= 0:
        raise ValueError(f"head_dim ({head_dim}) and scale_bytes ({scale_bytes}) must be positive")
    return 2.0 + 8.0 * scale_bytes / head_dim


def _scale_dtype(scale_dtype) -> torch.dtype:
    if isinstance(scale_dtype, torch.dtype):
        return scale_dtype
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {sorted(_SCALE_DTYPES)}, got {scale_dtype!r}")
    return _SCALE_DTYPES[scale_dtype]


def kivi_fake_quant_groups(x: torch.Tensor, scale_dtype="float16") -> torch.Tensor:
    """KIVI's asymmetric 2-bit fake quantization of groups along the **last** dim of ``x``.

    ``mn = min``, ``scale = (max - min) / 3`` (both rounded to ``scale_dtype``, as stored),
    ``code = clamp(round((x - mn) / scale), 0, 3)`` (round half to even, as ``torch.round`` in
    KIVI's reference), ``x_hat = code * scale + mn``. A constant group (``scale == 0``) gives
    ``x_hat = mn``.

    Args:
        x: float ``[..., G]`` (any float dtype, read in fp32).
        scale_dtype: storage dtype of ``scale`` and ``mn`` (``"float16"``, KIVI's, by default).

    Returns:
        fp32 ``[..., G]``.

    Raises:
        ValueError: non-float input or unknown ``scale_dtype``.
    """
    if not x.dtype.is_floating_point:
        raise ValueError(f"KIVI quantizes float tensors, got {x.dtype}")
    sdt = _scale_dtype(scale_dtype)
    xf = x.float()
    mn = xf.amin(dim=-1, keepdim=True).to(sdt).float()
    scale = ((xf.amax(dim=-1, keepdim=True) - mn) / 3.0).to(sdt).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    code = torch.clamp(torch.round((xf - mn) / safe), 0.0, 3.0)
    code = torch.where(scale > 0, code, torch.zeros_like(code))
    return code * scale + mn


def kivi_quantize_keys(k: torch.Tensor, group_size: int = 128, scale_dtype="float16") -> torch.Tensor:
    """KIVI per-channel key quantization: groups of ``group_size`` tokens along the token axis.

    Group ``g`` covers tokens ``[g G, (g + 1) G)`` (aligned at position 0); every (group, head,
    channel) has its own ``(scale, min)``. A trailing partial group is quantized over its own
    tokens (in KIVI those tokens are still in the full-precision residual and never read in INT2).

    Args:
        k: ``[T, H, D]`` keys (any float dtype).
        group_size: tokens per group ``G_k`` (> 0).
        scale_dtype: storage dtype of the pairs.

    Returns:
        fp32 ``[T, H, D]`` dequantized keys.

    Raises:
        ValueError: ``k`` not 3-D, ``group_size`` not positive.
    """
    if k.dim() != 3:
        raise ValueError(f"keys must be [tokens, heads, head_dim], got {tuple(k.shape)}")
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    t, h, d = k.shape
    full = (t // group_size) * group_size
    out = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    if full:
        blocks = k[:full].reshape(full // group_size, group_size, h, d).permute(0, 2, 3, 1)  # [n, H, D, G]
        out[:full] = kivi_fake_quant_groups(blocks, scale_dtype).permute(0, 3, 1, 2).reshape(full, h, d)
    if full < t:
        out[full:] = kivi_fake_quant_groups(k[full:].permute(1, 2, 0), scale_dtype).permute(2, 0, 1)
    return out


def kivi_quantize_values(v: torch.Tensor, group_size: int = 128, scale_dtype="float16") -> torch.Tensor:
    """KIVI per-token value quantization: groups of ``group_size`` contiguous elements along head_dim.

    Args:
        v: ``[..., D]`` values (any float dtype).
        group_size: elements per group ``G_v``, dividing ``D``.
        scale_dtype: storage dtype of the pairs.

    Returns:
        fp32 ``[..., D]`` dequantized values.

    Raises:
        ValueError: ``group_size`` that does not divide ``D``.
    """
    d = v.shape[-1]
    if group_size <= 0 or d % group_size:
        raise ValueError(f"value group size {group_size} must be positive and divide head_dim {d}")
    grouped = v.reshape(*v.shape[:-1], d // group_size, group_size)
    return kivi_fake_quant_groups(grouped, scale_dtype).reshape(v.shape)


def check_kivi_residual(residual: int, key_group: int) -> None:
    """Raise ``ValueError`` unless ``residual`` is a non-negative multiple of ``key_group`` (KIVI
    flushes the key residual in whole token groups)."""
    if key_group <= 0 or residual < 0 or residual % key_group:
        raise ValueError(f"KIVI residual ({residual}) must be a non-negative multiple of the key group size ({key_group})")


def kivi_hp_masks(q_positions: torch.Tensor, seq_len: int, residual: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys and values a decoding query reads in full precision in a KIVI cache.

    The query at absolute position ``i`` sees a cache of ``n = i + 1`` tokens: key ``j`` is full
    precision iff ``j >= floor(n / R) * R`` (the key residual), value ``j`` iff ``j > i - R``
    (the ``R`` newest values). ``residual = 0`` reads everything in INT2.

    Args:
        q_positions: int ``[Tq]`` absolute query positions.
        seq_len: keys ``T``.
        residual: ``R`` (>= 0).

    Returns:
        ``(hp_k, hp_v)``: bool ``[Tq, T]`` each.
    """
    j = torch.arange(seq_len, device=q_positions.device).unsqueeze(0)
    i = q_positions.unsqueeze(1)
    if residual <= 0:
        none = torch.zeros(i.shape[0], seq_len, dtype=torch.bool, device=q_positions.device)
        return none, none
    n = i + 1
    hp_k = j >= torch.div(n, residual, rounding_mode="floor") * residual
    hp_v = j > i - residual
    return hp_k, hp_v


def kivi_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    residual: int = 128,
    key_group: int = 128,
    value_group: int = 128,
    scale_dtype="float16",
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a KIVI cache of ``T`` tokens returns when read: dequantized INT2 rows plus the exact
    residual rows.

    Keys ``[0, floor(T / R) * R)`` are per-channel INT2 (:func:`kivi_quantize_keys`), the rest
    exact; values ``[0, T - R)`` are per-token INT2 (:func:`kivi_quantize_values`), the newest
    ``min(T, R)`` exact.

    Args:
        k: ``[T, H, D_k]``; v: ``[T, H, D_v]`` (any float dtype).
        residual: ``R``, a multiple of ``key_group``.
        key_group, value_group: ``G_k`` (tokens), ``G_v`` (elements, dividing ``D_v``).
        scale_dtype: storage dtype of the pairs.

    Returns:
        ``(k_hat, v_hat)`` fp32, shapes of ``k`` and ``v``.

    Raises:
        ValueError: bad residual/group sizes or shapes.
    """
    check_kivi_residual(residual, key_group)
    if k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, H, D] with equal T and H")
    t = k.shape[0]
    nk = (t // residual) * residual if residual else t
    nv = max(t - residual, 0)
    k_hat, v_hat = k.float().clone(), v.float().clone()
    if nk:
        k_hat[:nk] = kivi_quantize_keys(k[:nk], key_group, scale_dtype)
    if nv:
        v_hat[:nv] = kivi_quantize_values(v[:nv], value_group, scale_dtype)
    return k_hat, v_hat


def kivi_bits_per_element(
    context_len: int,
    head_dim: int,
    *,
    residual: int = 128,
    key_group: int = 128,
    value_group: int = 128,
    scale_bytes: int = 2,
    hp_bytes: int = 2,
) -> float:
    """True bits per KV element of a KIVI cache holding ``context_len`` tokens (K and V averaged,
    equal head dims).

    INT2 keys cost ``2 + 2 * 8 * scale_bytes / G_k`` bits (one (scale, min) pair per ``G_k``
    tokens of one channel), INT2 values ``2 + 2 * 8 * scale_bytes / G_v``; residual tokens cost
    ``8 * hp_bytes`` bits and are not also stored in INT2. With ``n_k = floor(L / R) * R`` INT2
    keys and ``n_v = max(L - R, 0)`` INT2 values:
    ``bpe = ((n_k q_k + (L - n_k) h) + (n_v q_v + (L - n_v) h)) / (2 L)``.
    Example: ``L = 131072, R = 128, G_k = G_v = 128``, 16-bit pairs -> 2.2567 (keys 2.25, values 2.2634).

    Raises:
        ValueError: non-positive context/head_dim/groups, or a residual that is not a multiple of ``key_group``.
    """
    check_kivi_residual(residual, key_group)
    if context_len <= 0 or head_dim <= 0 or value_group <= 0 or head_dim % value_group:
        raise ValueError(f"bad KIVI geometry: context {context_len}, head_dim {head_dim}, value group {value_group}")
    h = 8.0 * hp_bytes
    q_k = 2.0 + 2.0 * 8.0 * scale_bytes / key_group
    q_v = 2.0 + 2.0 * 8.0 * scale_bytes / value_group
    n_k = (context_len // residual) * residual if residual else context_len
    n_v = max(context_len - residual, 0)
    return ((n_k * q_k + (context_len - n_k) * h) + (n_v * q_v + (context_len - n_v) * h)) / (2.0 * context_len)
