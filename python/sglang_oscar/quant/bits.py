"""Bits-per-element accounting of an OSCAR KV cache.

Source: spec §1.8. A quantized element costs its 2-bit code plus its share of the group's
(scale, zero) pair: ``q = 2 + 2 * 8 * scale_bytes / G`` bits. The BF16 sink and recent
windows cost ``8 * hp_bytes`` bits per element. At context length ``L`` with ``n_hp =
min(L, sink + recent)`` window tokens:

* this project's cache writes every token in INT2 *and* keeps BF16 copies of the window
  tokens (docs/design.md), so it costs ``bpe(L) = q + n_hp * 8 * hp_bytes / L``;
* the original system stored window tokens *instead of* their INT2 form
  (``hp_also_quantized=False``): ``bpe(L) = (n_hp * 8 * hp_bytes + (L - n_hp) * q) / L``.

Examples (D = G = 128, fp16 pair, sink 64, recent 256): at L = 131072 this cache costs
2.2891 bits; the original's formula gives 2.2836 (spec §1.8 quotes 2.28).
"""

from __future__ import annotations

from .int2 import resolve_group_size, scale_torch_dtype

_HP_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def quant_bits_per_element(head_dim: int, group_size: int | None, scale_dtype="float16") -> float:
    """Bits per element of the INT2 tier alone (codes + pair share).

    Raises:
        ValueError: bad head_dim/group_size/scale_dtype.
    """
    g = resolve_group_size(head_dim, group_size)
    scale_bytes = scale_torch_dtype(scale_dtype).itemsize
    return 2.0 + 2.0 * 8.0 * scale_bytes / g


def bits_per_element(
    head_dim: int,
    group_size: int | None,
    scale_dtype="float16",
    context_len: int = 131072,
    sink: int = 64,
    recent: int = 256,
    hp_dtype: str = "bfloat16",
    hp_also_quantized: bool = True,
) -> float:
    """Effective bits per KV element at ``context_len`` tokens, windows included.

    Args:
        head_dim: ``D`` of the quantized tensor.
        group_size: ``G`` (``None`` = one group per row).
        scale_dtype: dtype of the (scale, zero) pair.
        context_len: tokens in the cache (> 0).
        sink, recent: BF16 window sizes in tokens (>= 0).
        hp_dtype: dtype of the windows (``"bfloat16"``, ``"float16"`` or ``"float32"``).
        hp_also_quantized: ``True`` (this project: window tokens are stored in INT2 too) or
            ``False`` (the original's accounting, windows replace INT2).

    Returns:
        bits per element (float).

    Raises:
        ValueError: non-positive context, negative windows, unknown dtypes.
    """
    if context_len <= 0:
        raise ValueError(f"context_len must be positive, got {context_len}")
    if sink < 0 or recent < 0:
        raise ValueError(f"window sizes must be >= 0, got sink={sink}, recent={recent}")
    if hp_dtype not in _HP_BYTES:
        raise ValueError(f"hp_dtype {hp_dtype!r} not in {sorted(_HP_BYTES)}")
    n_hp = min(context_len, sink + recent)
    q_bits = quant_bits_per_element(head_dim, group_size, scale_dtype)
    n_q = context_len if hp_also_quantized else context_len - n_hp
    return (n_hp * 8.0 * _HP_BYTES[hp_dtype] + n_q * q_bits) / context_len


def bytes_per_token_per_head(head_dim_k: int, head_dim_v: int, group_size: int | None, scale_dtype="float16") -> int:
    """Bytes of one INT2 token of one kv head (K and V codes + pairs).

    Raises:
        ValueError: bad dims/group/scale dtype.
    """
    sb = scale_torch_dtype(scale_dtype).itemsize
    total = 0
    for d in (head_dim_k, head_dim_v):
        g = resolve_group_size(d, group_size)
        total += d // 4 + 2 * sb * (d // g)
    return total
