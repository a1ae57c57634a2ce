"""Triton kernels of the OSCAR INT2 KV cache (see docs/kernels.md).

Wrappers (validated, launch-ready): :func:`write_kv`, :func:`rotate_and_write_kv`,
:func:`rotate_rows_hp`, :func:`flush_hp_rows`, :func:`dequantize_slots`,
:func:`decode_attention` (+ :func:`decode_workspace`, :func:`choose_num_splits`),
:func:`extend_attention`; :class:`Int2Layout` describes one layer geometry.
"""

from .launch import (
    AttnTuning,
    choose_num_splits,
    decode_attention,
    decode_num_hp_splits,
    decode_workspace,
    dequantize_slots,
    extend_attention,
    flush_hp_rows,
    interpreting,
    plan_head_blocks,
    rotate_and_write_kv,
    rotate_rows_hp,
    write_kv,
)
from .layout import Int2Layout, TensorLayout
from .validate import debug_enabled

__all__ = [
    "AttnTuning",
    "Int2Layout",
    "TensorLayout",
    "choose_num_splits",
    "debug_enabled",
    "decode_attention",
    "decode_num_hp_splits",
    "decode_workspace",
    "dequantize_slots",
    "extend_attention",
    "flush_hp_rows",
    "interpreting",
    "plan_head_blocks",
    "rotate_and_write_kv",
    "rotate_rows_hp",
    "write_kv",
]
