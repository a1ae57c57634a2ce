"""Decode attention: :class:`DecodePlan` (config, engine, splits, workspace; built once per batch) and
its launches -- stage 1 in Triton (:mod:`.triton_stage1`) or Gluon (:mod:`.gluon_stage1`), the merge
(:mod:`.merge`)."""

from .merge import decode_merge, merge_block_d
from .plan import DecodePlan, DecodeWorkspace, decode_attention
from .splits import choose_num_splits, decode_num_hp_splits, default_num_kv_splits

__all__ = ["DecodePlan", "DecodeWorkspace", "choose_num_splits", "decode_attention", "decode_merge",
           "decode_num_hp_splits", "default_num_kv_splits", "merge_block_d"]
