"""The INT2 format: packing, clipping, uniform and Lloyd-Max group quantizers, bit accounting."""

from .bits import bits_per_element, bytes_per_token_per_head, quant_bits_per_element
from .int2 import (
    LLOYD_MAX_CODEBOOK,
    QUANTIZERS,
    SCALE_DTYPES,
    UNIFORM_CODEBOOK,
    Codebook,
    QuantizedRows,
    check_clip_ratio,
    check_quantizer,
    clip_index,
    clip_rows,
    codebook,
    dequantize_rows,
    fake_quantize,
    quantize_rows,
    resolve_group_size,
    scale_torch_dtype,
)
from .lloyd_max import gaussian_lloyd_max
from .packing import check_head_dim, pack_quarter, unpack_quarter

__all__ = [name for name in dir() if not name.startswith("_")]
