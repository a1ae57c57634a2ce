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


# ---------------------------------------------------------------------------------------------
# MLA layers (DeepSeek-V3 family, GLM-5, Kimi-K2.5, Kimi-Linear's MLA layers): bytes per token
# and layer. SGLang's BF16 MLA pool row is [c_kv | k_pe], kv_lora_rank + qk_rope_head_dim
# elements in the KV dtype (sglang/srt/mem_cache/memory_pool.py:3837-3841, buffer
# [slots, 1, R + P] at :3862-3868).


def mla_bf16_bytes_per_token(kv_lora_rank: int = 512, qk_rope_head_dim: int = 64, dtype: str = "bfloat16") -> int:
    """Bytes of one token and layer in SGLang's MLA pool: ``(R + P) * itemsize``.

    DeepSeek-V3 (R 512, P 64, BF16): ``576 * 2 = 1152``.

    Raises:
        ValueError: negative sizes or an unknown dtype.
    """
    if kv_lora_rank <= 0 or qk_rope_head_dim < 0:
        raise ValueError(f"kv_lora_rank must be > 0 and qk_rope_head_dim >= 0, got {kv_lora_rank}, {qk_rope_head_dim}")
    if dtype not in _HP_BYTES:
        raise ValueError(f"dtype {dtype!r} not in {sorted(_HP_BYTES)}")
    return (kv_lora_rank + qk_rope_head_dim) * _HP_BYTES[dtype]


def mla_latent_bytes_per_token(kv_lora_rank: int = 512, qk_rope_head_dim: int = 64, group_size: int | None = None,
                               scale_dtype="float16", rope_dtype: str = "bfloat16") -> int:
    """Bytes of one token and layer in the packed INT2 latent pool (BF16 windows not included).

    ``R / 4`` code bytes (quarter-split rows of the rotated latent, :mod:`.packing`) +
    ``2 * scale_bytes * R / G`` for the (scale, zero) pairs + ``P * 2`` for ``k_pe`` kept in BF16.
    DeepSeek-V3 (R 512, P 64), float16 pairs: ``128 + 16 + 128 = 272`` at ``G = 128`` (4.24x fewer
    than BF16's 1152), ``288`` at 64 (4.0x), ``320`` at 32 (3.6x), ``260`` unset (one group, 4.43x).

    Raises:
        ValueError: a group size that does not divide ``R``, bad dtypes.
    """
    g = resolve_group_size(kv_lora_rank, group_size)
    sb = scale_torch_dtype(scale_dtype).itemsize
    if qk_rope_head_dim < 0:
        raise ValueError(f"qk_rope_head_dim must be >= 0, got {qk_rope_head_dim}")
    if rope_dtype not in _HP_BYTES:
        raise ValueError(f"rope_dtype {rope_dtype!r} not in {sorted(_HP_BYTES)}")
    return kv_lora_rank // 4 + 2 * sb * (kv_lora_rank // g) + qk_rope_head_dim * _HP_BYTES[rope_dtype]


def mla_latent_bytes_per_token_at(context_len: int, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64,
                                  group_size: int | None = None, scale_dtype="float16", sink: int = 64,
                                  recent: int = 256, hp_dtype: str = "bfloat16") -> float:
    """Average bytes per token and layer of a request of ``context_len`` tokens, windows included.

    Every token is in the packed pool; the ``min(L, sink + recent)`` window tokens also keep the
    full BF16 row ``[c_kv | k_pe]`` (as the MHA pool keeps BF16 copies, docs/design.md):
    ``packed + n_hp * (R + P) * hp_bytes / L``. DeepSeek-V3 at 131072 tokens, ``G = 128``:
    ``272 + 320 * 1152 / 131072 = 274.8`` (4.19x fewer than BF16).

    Raises:
        ValueError: non-positive context, negative windows, bad sizes or dtypes.
    """
    if context_len <= 0:
        raise ValueError(f"context_len must be positive, got {context_len}")
    if sink < 0 or recent < 0:
        raise ValueError(f"window sizes must be >= 0, got sink={sink}, recent={recent}")
    n_hp = min(context_len, sink + recent)
    packed = mla_latent_bytes_per_token(kv_lora_rank, qk_rope_head_dim, group_size, scale_dtype)
    return packed + n_hp * mla_bf16_bytes_per_token(kv_lora_rank, qk_rope_head_dim, hp_dtype) / context_len


def mla_expanded_bytes_per_token(num_heads: int, qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64,
                                 v_head_dim: int = 128, group_size: int | None = None, scale_dtype="float16") -> int:
    """Bytes of one token and layer with expanded-MHA storage in the INT2 MHA pool.

    Every head caches ``K = [k_nope | k_pe]`` (``N + P``) and ``V`` (``V``) as INT2 rows
    (:func:`bytes_per_token_per_head`), so the cost scales with the (TP-local) head count.
    DeepSeek-V3 (128 heads, K 192 / V 128), ``G = 64``, float16 pairs: ``(48 + 12) + (32 + 8) = 100``
    bytes per head, ``12800`` per token: 11x *more* than the BF16 latent (1152), 6.4x less than
    BF16 expanded MHA (``128 * 320 * 2 = 81920``).

    Raises:
        ValueError: ``num_heads <= 0``, or a group size that does not divide both head dims.
    """
    if num_heads <= 0:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    return num_heads * bytes_per_token_per_head(qk_nope_head_dim + qk_rope_head_dim, v_head_dim, group_size, scale_dtype)
