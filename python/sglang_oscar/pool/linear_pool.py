"""``OscarHybridLinearKVPool``: SGLang's pool for linear-attention hybrids over an INT2 attention pool.

Qwen3.5 / Qwen3-Next interleave full-attention layers with Gated-DeltaNet (linear-attention)
layers, Kimi-Linear MLA layers with KDA layers. SGLang keeps the linear layers' recurrent state in
its ``MambaPool`` (one fixed-size state per request, untouched here) and the attention layers' KV in
``HybridLinearKVPool.full_kv_pool``, addressed by the attention layers' *local* index
(``full_attention_layer_id_mapping``). Here that inner pool is an
:class:`~.int2_pool.OscarMHATokenToKVPool` (GQA attention layers) or an
:class:`~.latent_pool.OscarMLATokenToKVPool` (MLA layers) over the attention layers only (its
``start_layer`` 0, its layers the local indices), handed to SGLang's own constructor as
``full_kv_pool``; this class adds the INT2 backends' per-layer access by *global* layer id. SGLang's
allocator, radix cache and linear-attention backends run unchanged, but for where the mamba radix cache
tracks a prefill's state (``plugin.serving.after_init_next_round_input``).
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

from ..kernels.layout import Int2Layout
from .int2_pool import OscarMHATokenToKVPool
from .latent_pool import OscarMLATokenToKVPool


class OscarHybridLinearKVPool(HybridLinearKVPool):
    """``HybridLinearKVPool`` whose attention layers are cached in INT2 (module docstring).

    Args:
        full_kv_pool: the :class:`~.int2_pool.OscarMHATokenToKVPool` or
            :class:`~.latent_pool.OscarMLATokenToKVPool` of the attention layers
            (``layer_num = len(full_attention_layer_ids)``, ``start_layer`` 0).
        **kwargs: ``HybridLinearKVPool``'s arguments (``size``, ``dtype``, ``page_size``, ``head_num``,
            ``head_dim``, ``full_attention_layer_ids``, ``device``, ``mamba_pool``, ``start_layer``,
            ``use_mla``, ``kv_lora_rank``, ``qk_rope_head_dim``, ...).

    Raises:
        ValueError: the inner pool is not INT2, has another layer count than the attention layers, or
            is a latent pool without ``use_mla=True`` (or an MHA pool with it).
    """

    def __init__(self, *, full_kv_pool: OscarMHATokenToKVPool | OscarMLATokenToKVPool, **kwargs):
        ids = list(kwargs["full_attention_layer_ids"])
        latent = isinstance(full_kv_pool, OscarMLATokenToKVPool)
        if (not isinstance(full_kv_pool, OscarMHATokenToKVPool) and not latent) or full_kv_pool.layer_num != len(ids):
            raise ValueError(f"OscarHybridLinearKVPool needs an INT2 pool of the {len(ids)} attention layers, got "
                             f"{type(full_kv_pool).__name__} with {getattr(full_kv_pool, 'layer_num', '?')} layers")
        if latent != bool(kwargs.get("use_mla")):
            raise ValueError(f"OscarHybridLinearKVPool: use_mla={kwargs.get('use_mla')} but the inner pool is "
                             f"{type(full_kv_pool).__name__}: an MLA model's latent pool needs use_mla=True, a GQA pool False")
        super().__init__(full_kv_pool=full_kv_pool, **kwargs)
        self.oscar_config = full_kv_pool.oscar_config
        self.hp_dtype = full_kv_pool.hp_dtype
        self.windows = full_kv_pool.windows
        # SGLang's allocator over this pool frees the attention slots, the keys of the sink rows
        self.owns_windows = True
        self.end_layer = max(ids) if ids else self.start_layer
        if latent:
            self.kv_lora_rank, self.qk_rope_head_dim = full_kv_pool.kv_lora_rank, full_kv_pool.qk_rope_head_dim
            self.layout = full_kv_pool.layout

    def _local(self, layer_id: int) -> int:
        return self._transfer_full_attention_id(layer_id)

    def is_int2_layer(self, layer_id: int) -> bool:
        """Whether a global layer id is an (INT2-cached) attention layer."""
        return layer_id in self.full_attention_layer_id_mapping

    def is_swa_layer(self, layer_id: int) -> bool:
        """No sliding pool here."""
        return False

    def layout_of(self, layer_id: int) -> Int2Layout:
        """The :class:`~sglang_oscar.kernels.layout.Int2Layout` of the attention layers."""
        return self.full_kv_pool.layout

    def int2_buffers(self, layer_id: int):
        """``(k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v)`` of a global attention layer id."""
        return self.full_kv_pool.int2_buffers(self._local(layer_id))

    def write_rotated(self, layer_id: int, loc: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor,
                      hp_rows: torch.Tensor | None) -> None:
        """:meth:`.OscarMHATokenToKVPool.write_rotated` of a global attention layer id."""
        self.full_kv_pool.write_rotated(self._local(layer_id), loc, k_rot, v_rot, hp_rows)

    def latent_buffers(self, layer_id: int) -> dict:
        """:meth:`.OscarMLATokenToKVPool.latent_buffers` of a global MLA layer id."""
        return self.full_kv_pool.latent_buffers(self._local(layer_id))

    def write_latent(self, layer_id: int, loc: torch.Tensor, c_rot: torch.Tensor, k_pe: torch.Tensor,
                     hp_rows: torch.Tensor | None) -> None:
        """:meth:`.OscarMLATokenToKVPool.write_latent` of a global MLA layer id."""
        self.full_kv_pool.write_latent(self._local(layer_id), loc, c_rot, k_pe, hp_rows)

    def int2_bytes_per_token(self) -> int:
        """INT2 bytes of one token over the attention layers (K + V of all local kv heads; for a latent
        pool its codes, pairs and ``k_pe``)."""
        return self.full_kv_pool.int2_bytes_per_token()

    def hp_bytes(self) -> int:
        """Bytes of the BF16 window rows of the attention layers."""
        return self.full_kv_pool.hp_bytes()
