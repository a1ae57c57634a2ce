"""``Int2Layout``: the static description of one layer's INT2 cache that every kernel needs.

Built once per layer geometry (from an :class:`~sglang_oscar.config.OscarConfig` and the K/V head
dims) and passed to the wrappers in :mod:`.launch`. It validates the head_dim / group
combination and precomputes the constants the kernels take (clip order-statistic index,
thresholds, levels, the affine form of the levels used by the decode kernels).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton.language as tl

from ..quant.int2 import (
    _SCALE_MIN,
    check_clip_ratio,
    check_quantizer,
    clip_index,
    codebook,
    resolve_group_size,
    scale_torch_dtype,
)

#: head dims the attention kernels are built and tested for (any multiple of 16 in [64, 512]
#: is accepted; these are the ones covered by tests).
TESTED_HEAD_DIMS = (64, 128, 192, 256, 512)
MIN_ATTN_HEAD_DIM = 64
MAX_HEAD_DIM = 512

TORCH_TO_TL = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``): Triton block shapes must be powers of two."""
    return 1 << max(0, (int(n) - 1).bit_length())


def check_head_dim_supported(d: int, what: str, attention: bool = True) -> None:
    """Raise ``ValueError`` unless ``d`` is a head dim the kernels support."""
    if not isinstance(d, int) or d % 16 or d > MAX_HEAD_DIM or (attention and d < MIN_ATTN_HEAD_DIM) or d <= 0:
        raise ValueError(
            f"{what} head_dim={d!r} is not supported by the INT2 kernels: it must be a multiple of 16 "
            f"in [{MIN_ATTN_HEAD_DIM}, {MAX_HEAD_DIM}] (tested: {TESTED_HEAD_DIMS})"
        )


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Per-tensor (K or V) constants."""

    head_dim: int
    group_size: int
    clip_ratio: float

    @property
    def quarter(self) -> int:
        return self.head_dim // 4

    @property
    def quarter_p2(self) -> int:
        return next_pow2(self.quarter)

    @property
    def num_groups(self) -> int:
        return self.head_dim // self.group_size

    @property
    def num_groups_p2(self) -> int:
        return next_pow2(self.num_groups)

    @property
    def clip_k(self) -> int:
        """``idx + 1`` of the clip order statistic, 0 when clipping is off."""
        return clip_index(self.head_dim, self.clip_ratio) + 1

    @property
    def quarter_aligned(self) -> bool:
        """Every quarter of the row lies inside one group (the decode fast path)."""
        return self.group_size % self.quarter == 0


@dataclasses.dataclass(frozen=True)
class Int2Layout:
    """INT2 cache layout of one layer geometry.

    Attributes:
        k, v: :class:`TensorLayout` of K and V.
        quantizer: ``"uniform"`` or ``"lloyd-max"``.
        scale_dtype: torch dtype of the (scale, zero) pairs.
    """

    k: TensorLayout
    v: TensorLayout
    quantizer: str = "uniform"
    scale_dtype: torch.dtype = torch.float16

    @classmethod
    def create(
        cls,
        head_dim_k: int,
        head_dim_v: int | None = None,
        *,
        group_size: int | None = None,
        group_size_v: int | None = None,
        k_clip_ratio: float = 0.0,
        v_clip_ratio: float = 0.0,
        quantizer: str = "uniform",
        scale_dtype="float16",
        attention: bool = True,
    ) -> "Int2Layout":
        """Validate and build. ``group_size`` applies to K (and to V unless ``group_size_v``).

        Raises:
            ValueError: unsupported head_dim / group combination, quantizer, scale dtype or
                clip ratio.
        """
        head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
        check_head_dim_supported(head_dim_k, "K", attention)
        check_head_dim_supported(head_dim_v, "V", attention)
        gk = resolve_group_size(head_dim_k, group_size)
        gv = resolve_group_size(head_dim_v, group_size if group_size_v is None else group_size_v)
        check_quantizer(quantizer)
        sdt = scale_torch_dtype(scale_dtype)
        return cls(
            k=TensorLayout(head_dim_k, gk, check_clip_ratio(k_clip_ratio, "K clip ratio")),
            v=TensorLayout(head_dim_v, gv, check_clip_ratio(v_clip_ratio, "V clip ratio")),
            quantizer=quantizer,
            scale_dtype=sdt,
        )

    @classmethod
    def from_config(cls, config, head_dim_k: int, head_dim_v: int | None = None, attention: bool = True) -> "Int2Layout":
        """From an :class:`~sglang_oscar.config.OscarConfig` (its single ``group_size`` applies to K and V)."""
        return cls.create(
            head_dim_k,
            head_dim_v,
            group_size=config.group_size,
            k_clip_ratio=config.k_clip_ratio,
            v_clip_ratio=config.v_clip_ratio,
            quantizer=config.quantizer,
            scale_dtype=config.scale_dtype,
            attention=attention,
        )

    # ---- derived constants
    @property
    def lloyd(self) -> bool:
        return self.quantizer == "lloyd-max"

    @property
    def tl_scale_dtype(self):
        return TORCH_TO_TL[self.scale_dtype]

    @property
    def scale_min(self) -> float:
        return float(_SCALE_MIN[self.scale_dtype])

    @property
    def thresholds(self) -> tuple[float, float, float]:
        return tuple(float(t) for t in codebook(self.quantizer).thresholds)

    @property
    def levels(self) -> tuple[float, float, float, float]:
        return tuple(float(v) for v in codebook(self.quantizer).levels)

    @property
    def affine_levels(self) -> tuple[float, float, float]:
        """``(A4, B2, C0)`` with ``level[c] = A4 * (1 + c/4) + B2 * (1 + b0/2) + C0`` (``b0 = c & 1``).

        Exact for any 4 levels with ``l0 + l3 == l1 + l2`` (uniform and the symmetric Lloyd-Max
        codebook); these are the operands the decode/extend kernels feed the MMA.
        """
        l0, l1, l2, l3 = self.levels
        if not math.isclose(l0 + l3, l1 + l2, rel_tol=0.0, abs_tol=1e-6):
            raise ValueError("levels are not affine in (c, c & 1); the fast path cannot represent them")
        a = (l2 - l0) / 2.0
        bc = l3 - l0 - 3.0 * a
        return 4.0 * a, 2.0 * bc, l0 - 4.0 * a - 2.0 * bc

    def pair_width(self, which: str) -> int:
        t = self.k if which == "k" else self.v
        return 2 * t.num_groups

    def buffer_shapes(self, num_slots: int, num_kv_heads: int) -> dict:
        """Shapes of the four INT2 buffers for ``num_slots`` slots."""
        return {
            "k_codes": (num_slots, num_kv_heads, self.k.head_dim // 4),
            "k_pairs": (num_slots, num_kv_heads, 2 * self.k.num_groups),
            "v_codes": (num_slots, num_kv_heads, self.v.head_dim // 4),
            "v_pairs": (num_slots, num_kv_heads, 2 * self.v.num_groups),
        }

    def allocate(self, num_slots: int, num_kv_heads: int, device) -> dict:
        """Zero-initialised INT2 buffers (``k_codes, k_pairs, v_codes, v_pairs``)."""
        out = {}
        for name, shape in self.buffer_shapes(num_slots, num_kv_heads).items():
            dt = torch.uint8 if name.endswith("codes") else self.scale_dtype
            out[name] = torch.zeros(shape, dtype=dt, device=device)
        return out
