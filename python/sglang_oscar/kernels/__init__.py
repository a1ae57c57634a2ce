"""Triton / Gluon kernels of the OSCAR INT2 KV cache (see docs/kernels.md).

One module per op: :mod:`.write` (quantize + scatter rows), :mod:`.rotate` (per-head rotations),
:mod:`.decode` (decode attention: plan, stage 1 in Triton or Gluon, merge), :mod:`.extend` (extend /
prefill attention), :mod:`.latent` + :mod:`.latent_plan` (decode of MLA layers over the packed INT2
latent), :mod:`.latent_extend` (their extend), :mod:`.sparse` (MiniMax-M3 block-sparse attention).
:class:`Int2Layout` describes one layer geometry; :class:`TritonConfig` and :class:`GluonConfig` are the
attention launch configurations (the type is the decode engine).
"""

from .compile_check import interpreting
from .attention import plan_head_blocks
from .decode import (
    DecodePlan,
    DecodeWorkspace,
    choose_num_splits,
    decode_attention,
    decode_num_hp_splits,
)
from .extend import ExtendPlan, extend_attention
from .latent import gather_latent
from .latent_plan import LatentDecodePlan, latent_decode_attention
from .layout import Int2Layout, TensorLayout
from .rotate import rotate_rows_hp
from .sparse import block_sparse_attention
from .configs import GluonConfig, TritonConfig, default_triton_config
from .validate import debug_enabled
from .write import write_kv

__all__ = [
    "DecodePlan",
    "DecodeWorkspace",
    "ExtendPlan",
    "GluonConfig",
    "Int2Layout",
    "TensorLayout",
    "TritonConfig",
    "block_sparse_attention",
    "choose_num_splits",
    "debug_enabled",
    "decode_attention",
    "decode_num_hp_splits",
    "default_triton_config",
    "extend_attention",
    "gather_latent",
    "interpreting",
    "LatentDecodePlan",
    "latent_decode_attention",
    "plan_head_blocks",
    "rotate_rows_hp",
    "write_kv",
]
