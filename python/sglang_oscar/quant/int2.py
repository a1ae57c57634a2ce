"""INT2 group quantizer of KV rows: clip, quantize, pack, dequantize (the format's definition).

Every kernel and the served path must produce the bytes this module produces; the tests
compare against it. The format (docs/format.md):

* **Row**: the ``D`` values of one token and one kv head, after rotation, read in fp32 from
  the HP (BF16) copy of the row, so that writing a row directly and flushing it later from
  its BF16 copy give the same bytes.
* **Clip** (one rule on every path): ``idx = min(floor(clip_ratio * D), D - 1)``;
  ``t`` = the ``(idx+1)``-th smallest ``|x|`` of the row (an order statistic, so any
  algorithm that finds it gives the same value); ``x <- clamp(x, -t, t)``.
  ``clip_ratio == 0`` disables clipping. Source: spec §1.5 ("sort" rule).
* **Groups**: contiguous runs of ``group_size`` elements along head_dim.
* **Pair**: each group stores ``(scale, zero)`` in ``scale_dtype``; the value of code ``c``
  is ``scale * (level[c] - zero)``. Uniform: ``level = (0, 1, 2, 3)``; Lloyd-Max:
  ``level`` = the unit-Gaussian Lloyd-Max levels (:mod:`.lloyd_max`).
* **Uniform pair** (spec §1.4, with floors that keep fp16 finite):
  ``s = max((max - min) / 3, s_min(dtype), |min| / 2**15)``, ``s' = round(s)``,
  ``zero = round(-min / s')``.
* **Lloyd-Max pair**: group mean ``m`` and population variance ``var`` (accumulated in
  float64, then rounded to fp32), ``std = sqrt(var + 1e-8)``,
  ``s = max(std, s_min(dtype), |m| / 2**15)``, ``s' = round(s)``, ``zero = round(-m / s')``,
  so that ``s' * (level - zero) = m + std * level``.
* **Code**: ``u = x / s' + zero'`` in fp32 (IEEE division), ``code = #{k : u >= thr[k]}``
  where ``thr`` are the midpoints between adjacent levels (``0.5, 1.5, 2.5`` for uniform,
  ``-0.9816, 0, 0.9816`` for Lloyd-Max). Computing codes from the *stored* (rounded) pair
  means dequantization always picks the nearest level of the stored grid.
* **Packing**: :mod:`.packing` (quarter split). Pairs are interleaved
  ``[s0, z0, s1, z1, ...]`` per row.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from .lloyd_max import gaussian_lloyd_max
from .packing import check_head_dim, pack_quarter, unpack_quarter

QUANTIZERS = ("uniform", "lloyd-max")
SCALE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# Smallest scale per storage dtype: fp32/bf16 use the spec's 1e-8/3; fp16 the smallest
# normal number so that the stored scale never flushes to zero.
_SCALE_MIN = {torch.float32: 1e-8 / 3, torch.bfloat16: 1e-8 / 3, torch.float16: 2.0**-14}
# |zero| = |min| / scale stays below this, so zero is finite in fp16.
ZERO_MAX = 2.0**15
LM_VAR_EPS = 1e-8


def scale_torch_dtype(scale_dtype) -> torch.dtype:
    """Map ``"float32" | "float16" | "bfloat16"`` (or a torch dtype) to a torch dtype.

    Raises:
        ValueError: for any other name or dtype.
    """
    if isinstance(scale_dtype, torch.dtype):
        if scale_dtype in _SCALE_MIN:
            return scale_dtype
    elif scale_dtype in SCALE_DTYPES:
        return SCALE_DTYPES[scale_dtype]
    raise ValueError(
        f"scale dtype {scale_dtype!r} is not supported; use one of {sorted(SCALE_DTYPES)}"
    )


def check_quantizer(quantizer: str) -> str:
    """Return ``quantizer`` if it is ``"uniform"`` or ``"lloyd-max"``; raise ``ValueError`` otherwise."""
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer {quantizer!r} is not supported; use one of {QUANTIZERS}")
    return quantizer


def check_clip_ratio(clip_ratio: float, what: str = "clip ratio") -> float:
    """Return ``clip_ratio`` as a plain float if it is a real number (numpy scalars included; not a
    bool or a string) in ``[0, 1]``; raise ``ValueError`` naming ``what`` otherwise."""
    if isinstance(clip_ratio, bool) or not isinstance(clip_ratio, numbers.Real):
        raise ValueError(f"{what} must be a number in [0, 1] (0 disables clipping), got {clip_ratio!r}")
    r = float(clip_ratio)
    if not (0.0 <= r <= 1.0) or math.isnan(r):
        raise ValueError(f"{what} must be in [0, 1] (0 disables clipping), got {clip_ratio!r}")
    return r


def resolve_group_size(head_dim: int, group_size: int | None) -> int:
    """Return the effective group size (``None`` means one group per row).

    Raises:
        ValueError: if ``head_dim`` is not a multiple of 4 or ``group_size`` does not divide
            it (or is not positive).
    """
    check_head_dim(head_dim)
    g = head_dim if group_size is None else group_size
    if not isinstance(g, int) or g <= 0 or head_dim % g:
        raise ValueError(
            f"group_size={group_size!r} does not divide head_dim={head_dim}; pick a divisor "
            f"of {head_dim} (e.g. {head_dim}) or leave it unset for one group per row"
        )
    return g


def clip_index(head_dim: int, clip_ratio: float) -> int:
    """Order-statistic index of the clip threshold: ``min(floor(ratio * D), D - 1)``.

    Returns -1 when clipping is disabled (``clip_ratio == 0``).
    Example: D=128, ratio 0.96 -> 122; ratio 0.92 -> 117 (spec §1.5).
    """
    r = check_clip_ratio(clip_ratio)
    if r <= 0.0:
        return -1
    return min(int(math.floor(r * head_dim)), head_dim - 1)


def clip_rows(x: torch.Tensor, clip_ratio: float) -> torch.Tensor:
    """Symmetric per-row magnitude clip (the one clip rule of the project).

    Args:
        x: float tensor ``[..., D]``.
        clip_ratio: in ``[0, 1]``; 0 disables.

    Returns:
        fp32 tensor ``[..., D]``: ``clamp(x, -t, t)`` with ``t`` the
        ``(clip_index + 1)``-th smallest ``|x|`` of each row.
    """
    x = x.float()
    idx = clip_index(x.shape[-1], clip_ratio)
    if idx < 0 or x.numel() == 0:
        return x
    t = torch.kthvalue(x.abs(), idx + 1, dim=-1, keepdim=True).values
    return torch.minimum(torch.maximum(x, -t), t)


@dataclasses.dataclass(frozen=True)
class Codebook:
    """Levels and decision thresholds of a 4-level quantizer, in units of the group scale."""

    levels: tuple[float, float, float, float]
    thresholds: tuple[float, float, float]

    def levels_tensor(self, device=None) -> torch.Tensor:
        return torch.tensor(self.levels, dtype=torch.float32, device=device)

    def thresholds_tensor(self, device=None) -> torch.Tensor:
        return torch.tensor(self.thresholds, dtype=torch.float32, device=device)


UNIFORM_CODEBOOK = Codebook(levels=(0.0, 1.0, 2.0, 3.0), thresholds=(0.5, 1.5, 2.5))


def _lloyd_max_codebook() -> Codebook:
    levels, thresholds, _ = gaussian_lloyd_max(4)
    # Rounded once to fp32: these exact fp32 values are the format's constants.
    lv = tuple(float(torch.tensor(v, dtype=torch.float32)) for v in levels)
    th = tuple(float(torch.tensor(v, dtype=torch.float32)) for v in thresholds)
    return Codebook(levels=lv, thresholds=th)


LLOYD_MAX_CODEBOOK = _lloyd_max_codebook()


def codebook(quantizer: str) -> Codebook:
    """The :class:`Codebook` of ``"uniform"`` or ``"lloyd-max"``."""
    check_quantizer(quantizer)
    return UNIFORM_CODEBOOK if quantizer == "uniform" else LLOYD_MAX_CODEBOOK


@dataclasses.dataclass
class QuantizedRows:
    """Packed INT2 rows.

    Attributes:
        codes: ``uint8 [..., D/4]`` quarter-split codes.
        pairs: ``[..., 2 * D/G]`` in the scale dtype, interleaved ``[s0, z0, s1, z1, ...]``.
        group_size: ``G``.
        quantizer: ``"uniform"`` or ``"lloyd-max"``.
    """

    codes: torch.Tensor
    pairs: torch.Tensor
    group_size: int
    quantizer: str

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * 4

    def scales(self) -> torch.Tensor:
        """fp32 ``[..., num_groups]``."""
        return self.pairs[..., 0::2].float()

    def zeros(self) -> torch.Tensor:
        """fp32 ``[..., num_groups]``."""
        return self.pairs[..., 1::2].float()


def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(torch.float32)


def quantize_rows(
    x: torch.Tensor,
    *,
    group_size: int | None = None,
    clip_ratio: float = 0.0,
    quantizer: str = "uniform",
    scale_dtype="float16",
) -> QuantizedRows:
    """Quantize rows to INT2 with per-group (scale, zero) pairs (the format's definition).

    Args:
        x: float tensor ``[..., D]`` (any float dtype; read as fp32). For the KV cache this is
            the rotated row in its HP dtype (BF16).
        group_size: ``G`` dividing ``D``; ``None`` for one group per row.
        clip_ratio: per-row magnitude clip ratio in ``[0, 1]`` (0 = off).
        quantizer: ``"uniform"`` (asymmetric min/max, 4 levels) or ``"lloyd-max"``.
        scale_dtype: storage dtype of the pairs: ``"float32" | "float16" | "bfloat16"``.

    Returns:
        :class:`QuantizedRows`.

    Raises:
        ValueError: bad head_dim, group size, clip ratio, quantizer, scale dtype, a
            non-float input, or non-finite input values.
    """
    if not x.dtype.is_floating_point:
        raise ValueError(f"rows to quantize must be a float tensor, got {x.dtype}")
    d = x.shape[-1]
    g = resolve_group_size(d, group_size)
    sdt = scale_torch_dtype(scale_dtype)
    book = codebook(quantizer)
    if x.numel() and not torch.isfinite(x).all():
        raise ValueError("rows to quantize contain NaN or Inf")
    xf = clip_rows(x, clip_ratio)
    grouped = xf.reshape(*xf.shape[:-1], d // g, g)
    if quantizer == "uniform":
        lo = grouped.amin(dim=-1)
        hi = grouped.amax(dim=-1)
        # Tensor / tensor: IEEE division on every device (CUDA turns "/ 3.0" into "* (1/3)").
        s = (hi - lo) / torch.full_like(hi, 3.0)
        offset = lo  # value of level 0
    else:
        g64 = grouped.double()
        mean64 = g64.mean(dim=-1)
        var64 = ((g64 - mean64.unsqueeze(-1)) ** 2).mean(dim=-1)
        s = torch.sqrt(var64 + LM_VAR_EPS).float()
        offset = mean64.float()  # value of level 0.0 of the normalised group
    s = torch.clamp(s, min=_SCALE_MIN[sdt])
    s = torch.maximum(s, offset.abs() / torch.full_like(offset, ZERO_MAX))
    s_st = _round_to(s, sdt)
    if s_st.numel() and not torch.isfinite(s_st).all():
        raise ValueError(
            f"a group's scale ({float(s.max()):.3g}) overflows {sdt}; use scale dtype float32 or bfloat16 for rows this large"
        )
    z_st = _round_to(-offset / s_st, sdt)
    u = grouped / s_st.unsqueeze(-1) + z_st.unsqueeze(-1)
    thr = book.thresholds_tensor(device=x.device)
    q = (u.unsqueeze(-1) >= thr).sum(dim=-1).to(torch.uint8)
    codes = pack_quarter(q.reshape(*xf.shape[:-1], d))
    pairs = torch.stack([s_st, z_st], dim=-1).reshape(*xf.shape[:-1], 2 * (d // g)).to(sdt)
    return QuantizedRows(codes=codes, pairs=pairs, group_size=g, quantizer=quantizer)


def dequantize_rows(qr: QuantizedRows, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize :class:`QuantizedRows`: ``x_hat = scale * (level[code] - zero)`` in fp32.

    Returns:
        tensor ``[..., D]`` in ``out_dtype``.
    """
    d = qr.head_dim
    g = qr.group_size
    codes = unpack_quarter(qr.codes).long()
    lv = codebook(qr.quantizer).levels_tensor(device=codes.device)[codes]
    lv = lv.reshape(*codes.shape[:-1], d // g, g)
    x = qr.scales().unsqueeze(-1) * (lv - qr.zeros().unsqueeze(-1))
    return x.reshape(*codes.shape[:-1], d).to(out_dtype)


def fake_quantize(x: torch.Tensor, **kwargs) -> torch.Tensor:
    """``dequantize_rows(quantize_rows(x, **kwargs))`` in ``x.dtype``; same arguments as :func:`quantize_rows`."""
    return dequantize_rows(quantize_rows(x, **kwargs), out_dtype=x.dtype)
