"""Argument checks run by the wrappers before any launch (clear ``ValueError`` messages).

Shape/dtype/device checks are always on and cost no device work. Checks of index *values*
(slots, rows, request indices, lengths) read device memory, so they run only in debug mode:
``debug=True`` on the wrapper or the environment variable ``SGLANG_OSCAR_DEBUG=1``.
"""

from __future__ import annotations

import os

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def offset_extent(t: torch.Tensor) -> int:
    """Largest element offset a kernel can form into ``t``'s storage from its data pointer:
    ``sum((size_i - 1) * |stride_i|)`` (elements of ``t.dtype``; 0 for an empty tensor). For a
    strided view (e.g. the served pool's codes ``rows[..., :32]`` out of 36-byte rows) this exceeds
    ``numel()``, which therefore cannot decide whether int32 offsets suffice."""
    if t.numel() == 0:
        return 0
    return sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))


def needs_idx64(*tensors) -> bool:
    """Some buffer's offsets (in its own element units, :func:`offset_extent`) reach 2**31 - 1: index
    math in int64 (else int32, cheaper). Kernels that address a buffer in bytes pass byte views.
    ``SGLANG_OSCAR_FORCE_IDX64=1`` forces the int64 path (tests)."""
    if os.environ.get("SGLANG_OSCAR_FORCE_IDX64", "") == "1":
        return True
    return any(t is not None and offset_extent(t) >= 2**31 - 1 for t in tensors)


def debug_enabled(debug: bool | None) -> bool:
    """``debug`` if given, else ``SGLANG_OSCAR_DEBUG`` in ``{"1", "true", "yes", "on"}``."""
    if debug is not None:
        return bool(debug)
    return os.environ.get("SGLANG_OSCAR_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def check_tensor(t, name: str, *, ndim: int | None = None, dtypes=None, device=None, shape=None,
                 last_contiguous: bool = False) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``t`` is a tensor with ``ndim`` dims, a dtype in
    ``dtypes``, on ``device``, of ``shape`` (``None`` entries: any size) and, with ``last_contiguous``,
    stride 1 in its last dim."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dts = dtypes if isinstance(dtypes, (tuple, list)) else (dtypes,)
        if t.dtype not in dts:
            raise ValueError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dts]}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; dim {i} must be {want}")
        if len(shape) != t.dim():
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {len(shape)} dims")
    if last_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride()})")


def check_float(t, name: str) -> None:
    """Raises ``ValueError`` unless ``t`` is float32 / float16 / bfloat16."""
    if not t.dtype.is_floating_point or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name} must be float32/float16/bfloat16, got {t.dtype}")


def check_range(t: torch.Tensor, name: str, lo: int, hi: int, *, allow_negative: bool = False) -> None:
    """Debug: every entry of ``t`` in ``[lo, hi)`` (negative entries allowed if ``allow_negative``)."""
    if t.numel() == 0:
        return
    v = t.long()
    if allow_negative:
        v = v[v >= 0]
        if v.numel() == 0:
            return
    mn, mx = int(v.min()), int(v.max())
    if mn < lo or mx >= hi:
        raise ValueError(f"{name} has entries in [{mn}, {mx}] outside the valid range [{lo}, {hi})")


def check_finite(t: torch.Tensor, name: str) -> None:
    """Raises ``ValueError`` if ``t`` holds a NaN or an Inf (host sync)."""
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or Inf")


def check_int2_buffers(layout, k_codes, k_pairs, v_codes, v_pairs, heads, device):
    """Raises ``ValueError`` unless the INT2 planes fit ``layout``: codes uint8 ``[S, heads, D/4]``,
    (scale, zero) pairs ``[S, heads, 2 * groups]`` in ``layout.scale_dtype``, on ``device``, last dim
    contiguous."""
    check_tensor(k_codes, "k_codes", ndim=3, dtypes=torch.uint8, device=device,
                 shape=(None, heads, layout.k.head_dim // 4), last_contiguous=True)
    check_tensor(k_pairs, "k_pairs", ndim=3, dtypes=layout.scale_dtype, device=device,
                 shape=(k_codes.shape[0], heads, 2 * layout.k.num_groups), last_contiguous=True)
    if v_codes is not None:
        check_tensor(v_codes, "v_codes", ndim=3, dtypes=torch.uint8, device=device,
                     shape=(k_codes.shape[0], heads, layout.v.head_dim // 4), last_contiguous=True)
        check_tensor(v_pairs, "v_pairs", ndim=3, dtypes=layout.scale_dtype, device=device,
                     shape=(k_codes.shape[0], heads, 2 * layout.v.num_groups), last_contiguous=True)


def check_sinks(sinks: torch.Tensor | None, num_q_heads: int, device, who: str) -> None:
    """``sinks`` is ``None`` or a contiguous float ``[num_q_heads]`` tensor on ``device`` (fp32, bf16 --
    GPT-OSS's parameter under SGLang's Triton backend -- or fp16; the kernels read it in fp32), else
    ``ValueError``."""
    if sinks is not None:
        check_tensor(sinks, f"{who}: sinks", ndim=1, dtypes=(torch.float32, torch.bfloat16, torch.float16),
                     device=device, shape=(num_q_heads,), last_contiguous=True)
