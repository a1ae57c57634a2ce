"""``OscarExpandedMLABackend``: MLA layers stored as expanded INT2 MHA rows (``--oscar-mla-storage expanded``).

A DeepSeek-V2/V3 layer (SGLang's ``DeepseekV2AttentionMLA``) has two ``RadixAttention`` modules with one
``layer_id``: ``attn_mqa`` (absorbed MQA over the latent, what the latent backend serves) and ``attn_mha``
(``H`` q heads and ``H`` kv heads, head_dim ``N + P`` = 192, ``v_head_dim`` ``V`` = 128, the non-absorbed
prefill's). With expanded storage the dispatch hook (:func:`sglang_oscar.plugin.mla_serving.around_mla_dispatch`)
sends every forward (prefill, extend with a prefix, decode) down SGLang's plain MHA method
(``forward_normal_prepare`` / ``forward_normal_core``,
``models/deepseek_common/attention_forward_methods/forward_mha.py``), and this backend:

* supplies ``prepare_prefill_qkv``, the hook ``forward_normal_prepare`` calls when the backend has one: RoPE on
  ``q_pe`` / ``k_pe`` (the layer's ``rotary_emb``), ``q = [q_nope | q_pe]``, ``kv_b_proj(c_kv)`` split per head
  into ``k_nope`` / ``v``, ``k = [k_nope | k_pe]`` (the layer's ``_concat_and_cast_mha_k``). SGLang then skips
  its own BF16 latent write (``_set_mla_kv_buffer``), the one-shot prefix gather and its own ``kv_b_proj``;
  ``forward_normal_core`` calls ``attn_mha(q, k, v, save_kv_cache=False)``. The hook computes and writes
  nothing else: under SGLang's breakable prefill CUDA graph it runs inside a captured segment;
* serves ``attn_mha`` as the MHA backend serves any GQA layer (ratio 1): rotate q, K, V per head
  (``R_k [192, 192]``, ``R_v [128, 128]``), write K/V into the INT2 MHA pool
  (:class:`~sglang_oscar.pool.int2_pool.OscarMHATokenToKVPool`, ``H / tp`` heads, 192 / 128) with its BF16
  sink/recent windows, read them with the decode / extend plans (window modes ``"decode"`` / ``"extend"``),
  counter-rotate the output. It writes even though SGLang passes ``save_kv_cache=False`` (see
  :meth:`OscarExpandedMLABackend.forward_extend`).

Everything else (window bookkeeping, plans, CUDA-graph plumbing, slot release) is
:class:`~.triton_backend.OscarTritonAttnBackend`'s. The oracle is the MHA oracle over
:func:`sglang_oscar.reference.latent.expand_latent`'s K/V (``reference/attention.py``).
"""

from __future__ import annotations

import logging

import torch

from .rotations import model_geometry, served_expanded_rotations
from .triton_backend import OscarTritonAttnBackend

logger = logging.getLogger("sglang_oscar")


def expanded_attention_layers(model) -> list:
    """The ``attn_mha`` modules of a DeepSeek-V2/V3 model (one per layer; its ``attn_mqa`` twins, which
    carry the same ``layer_id``, are left out), or ``[]`` for ``None``."""
    if model is None:
        return []
    return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "attn_mha"]


class OscarExpandedMLABackend(OscarTritonAttnBackend):
    """Triton attention over an INT2 MHA pool of an MLA model's expanded per-head K/V (module docstring).

    Raises:
        RuntimeError: the pool is not the INT2 pool (a hook did not apply).
        ValueError: the model or rotation file does not fit expanded storage
            (:func:`.rotations.served_expanded_rotations`).
    """

    def __init__(self, model_runner, *args, **kwargs):
        super().__init__(model_runner, *args, **kwargs)
        # SGLang sizes its split-KV decode scratch (attn_logits [tokens, heads, max_kv_splits, v_head_dim] fp32;
        # max_kv_splits up to 256 for an MLA model) by this; the INT2 plans keep their own workspace, and at
        # 128 heads x 256 CUDA-graph tokens x 128 the unused scratch would take 4.3 GB
        self.v_head_dim = 1
        from sglang.srt.runtime_context import get_parallel

        if get_parallel().attn_tp_rank == 0:
            geos = sorted({(g.num_q_heads, g.head_dim, g.v_head_dim) for g in self._layer_geometry.values()})
            logger.info("sglang-oscar: MLA expanded storage: %d layers served as MHA (q heads per rank, K, V): %s",
                        len(self._layer_geometry), geos)

    def _served_rotations(self, hf_config, log: bool):
        geometry = model_geometry(hf_config)
        rs = served_expanded_rotations(self.config, geometry, log=log,
                                       architectures=getattr(hf_config, "architectures", None), hf_config=hf_config)
        return geometry.expanded(), rs

    def _model_layers(self, model) -> list:
        return expanded_attention_layers(model)

    # ------------------------------------------------------------------ SGLang's MHA prefill hook
    def prepare_prefill_qkv(self, *, q: torch.Tensor, q_pe: torch.Tensor, kv_a: torch.Tensor, k_pe: torch.Tensor,
                            positions: torch.Tensor, layer, forward_batch):
        """Per-head ``(q, k, v)`` of an MLA layer for ``attn_mha`` (called by SGLang's ``forward_normal_prepare``
        in every forward mode of an expanded-storage server). Pure math: writes no cache row (the forward paths
        below write them) and keeps no state, so a captured CUDA-graph segment may hold it.

        Args:
            q: ``[T, H, N + P]`` model dtype, from ``q_b_proj`` (or ``q_proj``), before RoPE; its last ``P``
                columns are overwritten with the rotated ``q_pe`` (as SGLang's own path does).
            q_pe: ``[T, H, P]`` view of ``q``'s RoPE part; kv_a: ``[T, R]`` the latent after
                ``kv_a_layernorm``; k_pe: ``[T, 1, P]`` the shared RoPE key, before RoPE.
            positions: int ``[T]`` token positions; layer: the ``DeepseekV2AttentionMLA`` (its ``rotary_emb``
                (``None`` = no RoPE), ``kv_b_proj``, ``num_local_heads``, ``qk_nope_head_dim``, ``v_head_dim``,
                ``_concat_and_cast_mha_k``); forward_batch: SGLang's ``ForwardBatch``.

        Returns:
            ``(q [T, H, N + P], k [T, H, N + P], v [T, H, V])`` in the model dtype; ``v`` is a view of the
            ``kv_b_proj`` output (last dim contiguous).
        """
        if layer.rotary_emb is not None:
            q_pe, k_pe = layer.rotary_emb(positions, q_pe, k_pe)
        n = layer.qk_nope_head_dim
        q[..., n:] = q_pe
        kv = layer.kv_b_proj(kv_a)[0].view(-1, layer.num_local_heads, n + layer.v_head_dim)
        k = layer._concat_and_cast_mha_k(kv[..., :n], k_pe, forward_batch)
        return q, k, kv[..., n:]

    # ------------------------------------------------------------------ forward paths
    def _check_expanded_layer(self, layer, kwargs) -> None:
        given = sorted(name for name, value in kwargs.items() if value is not None)
        if given:
            raise NotImplementedError(f"layer {layer.layer_id}: the INT2 expanded-MLA backend takes per-head q / k / v "
                                      f"only, not {given}")
        geo = self._layer_geometry.get(layer.layer_id)
        if (geo is not None and (layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim)
                != (geo.num_kv_heads, geo.head_dim, geo.v_head_dim)) or layer.tp_k_head_num != layer.tp_q_head_num:
            raise NotImplementedError(
                f"layer {layer.layer_id}: --oscar-mla-storage expanded serves SGLang's attn_mha (per-head K/V, "
                f"{layer.tp_q_head_num} kv heads), got {layer.tp_k_head_num} kv heads, {layer.qk_head_dim}/"
                f"{layer.v_head_dim}: an absorbed (MLA) forward reached the backend (the dispatch hook did not apply)")

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None,
                       aux_tensors=None, **kwargs):
        """The MHA backend's extend, writing the chunk's K/V whatever ``save_kv_cache`` says.

        SGLang's ``forward_normal_core`` passes ``save_kv_cache=False`` (its own path wrote the BF16 latent in
        ``_set_mla_kv_buffer``, which ``prepare_prefill_qkv`` replaces). Writing here is right only because the
        dispatch hook never picks ``MHA_CHUNKED_KV`` / ``MHA_ONE_SHOT``, whose ``attn_mha`` calls pass prefix rows.

        Raises:
            NotImplementedError: not an ``attn_mha`` layer, or extra keyword inputs.
        """
        self._check_expanded_layer(layer, kwargs)
        # save_kv_cache=True: the K/V of this call are the chunk's own rows (plain MHA method only, docstring)
        return super().forward_extend(q, k, v, layer, forward_batch, True, sinks, score_mod, aux_tensors)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None,
                       aux_tensors=None, **kwargs):
        """The MHA backend's decode, writing the new token's K/V whatever ``save_kv_cache`` says (as
        :meth:`forward_extend`).

        Raises:
            NotImplementedError: not an ``attn_mha`` layer, or extra keyword inputs.
        """
        self._check_expanded_layer(layer, kwargs)
        # save_kv_cache=True: the plain MHA method's decode passes the new token's K/V (forward_extend's docstring)
        return super().forward_decode(q, k, v, layer, forward_batch, True, sinks, score_mod, aux_tensors)
