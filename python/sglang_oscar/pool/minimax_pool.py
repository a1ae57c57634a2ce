"""``OscarMiniMaxSparseKVPool``: MiniMax-M3's pool with an INT2 main K/V pool and SGLang's BF16 index pools.

MiniMax-M3 (``MiniMaxM3SparseForCausalLM`` / ``...ForConditionalGeneration``) mixes dense GQA layers
with sparse (MSA) layers. SGLang 0.5.16 keeps one ``MiniMaxSparseKVPool``
(``srt/mem_cache/memory_pool.py:4626-4961``) of three sub-pools, all addressed by the same slots:

* ``main_pool``: the K/V rows of every local layer (dense and sparse; ``layer_num`` = both counts,
  ``start_layer`` the rank's first layer, ``:4684-4695``). Here an
  :class:`~.int2_pool.OscarMHATokenToKVPool` (INT2 codes + pairs, BF16 sink/recent windows, page size 1).
* ``index_kv_pool``: the sparse layers' index key and value (one head of ``idx_head_dim``), and
  ``index_k_pool`` the index key alone for the layers whose index value is disabled
  (``sparse_disable_index_value``, ``:4697-4724``). Both stay SGLang's own BF16 (model dtype) pools:
  SGLang's indexer kernels read them (``srt/layers/attention/minimax_sparse_ops/minimax_sparse.py``),
  and they are small (one head per sparse layer).

Bytes per token: the main pool's INT2 rows plus :func:`minimax_index_bytes` (SGLang's
``pool_configurator.py:218-259`` counts the same index term). The main pool's BF16 writes
(``set_kv_buffer``, the fused main + index store) are refused: the OSCAR backend writes rotated rows
through :meth:`write_rotated`, and the index keys through SGLang's ``set_index_*`` methods, unchanged.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKOnlyPool, MHATokenToKVPool, MiniMaxSparseKVPool

from ..kernels.layout import Int2Layout
from .int2_pool import OscarMHATokenToKVPool


def minimax_index_bytes(num_index_kv_layers: int, num_index_k_only_layers: int, idx_head_dim: int,
                        index_dtype: torch.dtype) -> int:
    """Bytes per token of MiniMax-M3's index pools: ``(2 * n_kv + n_k_only) * idx_head_dim * itemsize``.

    Args:
        num_index_kv_layers: local sparse layers whose index keeps a key and a value (``index_kv_pool``).
        num_index_k_only_layers: local sparse layers with ``sparse_disable_index_value`` (key only).
        idx_head_dim: ``sparse_index_dim``; index_dtype: the index pools' dtype (SGLang: the model dtype,
            ``kv_cache_configurator.py:_build_minimax_sparse_kv_pool``).

    SGLang's own term: ``pool_configurator.py:252-256`` (``indexer_bytes``).
    """
    return (2 * num_index_kv_layers + num_index_k_only_layers) * idx_head_dim * torch.empty(
        (), dtype=index_dtype).element_size()


class OscarMiniMaxSparseKVPool(MiniMaxSparseKVPool):
    """``MiniMaxSparseKVPool`` whose main K/V pool is INT2 (module docstring).

    Args:
        size, page_size, head_num, head_dim, idx_head_dim, dense_layer_ids, sparse_layer_ids, device,
            disable_value_sparse_layer_ids, enable_memory_saver, index_dtype, start_layer, end_layer:
            ``MiniMaxSparseKVPool``'s (``memory_pool.py:4627-4643``; ``end_layer`` exclusive, as SGLang's
            configurator passes ``layer_info.end_layer``). ``index_dtype`` defaults to ``hp_dtype``.
        dtype: the main pool's logical dtype, ``torch.uint8``.
        oscar_config, hp_dtype, max_reqs, sink_rows: :class:`~.int2_pool.OscarMHATokenToKVPool`'s.
        enable_alt_stream: passed to the INT2 main pool.

    Raises:
        ValueError: page size other than 1, an ``idx_head_dim`` below 1, or
            :class:`~.int2_pool.OscarMHATokenToKVPool`'s geometry errors.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 idx_head_dim: int, dense_layer_ids: list[int], sparse_layer_ids: list[int], device: str,
                 disable_value_sparse_layer_ids: list[int] | None = None, enable_memory_saver: bool = False,
                 index_dtype: torch.dtype | None = None, start_layer: int | None = None,
                 end_layer: int | None = None, *, oscar_config, hp_dtype: torch.dtype, max_reqs: int,
                 sink_rows: int, enable_alt_stream: bool = True):
        # SGLang's __init__ builds a BF16 main pool (memory_pool.py:4684-4695): the same attributes are set
        # here, with the INT2 main pool in its place.
        if page_size != 1:
            raise ValueError(f"--kv-cache-dtype int2 needs --page-size 1 on MiniMax-M3 (got {page_size})")
        if idx_head_dim < 1:
            raise ValueError(f"MiniMax-M3 sparse_index_dim must be >= 1, got {idx_head_dim}")
        start = 0 if start_layer is None else start_layer
        end = len(dense_layer_ids) + len(sparse_layer_ids) if end_layer is None else end_layer
        self.size, self.page_size, self.dtype, self.device = size, page_size, dtype, device
        self.use_minimax_fused_kv_index_store = False  # main K/V and index keys are written apart
        local_dense = [i for i in dense_layer_ids if start <= i < end]
        local_sparse = [i for i in sparse_layer_ids if start <= i < end]
        no_value = set(disable_value_sparse_layer_ids or ())
        kv_sparse = [i for i in local_sparse if i not in no_value]
        k_only = [i for i in local_sparse if i in no_value]
        self.sparse_layer_id_mapping = {g: i for i, g in enumerate(local_sparse)}
        self.index_kv_layer_id_mapping = {g: i for i, g in enumerate(kv_sparse)}
        self.index_k_layer_id_mapping = {g: i for i, g in enumerate(k_only)}
        self.idx_head_dim = idx_head_dim
        self.index_dtype = hp_dtype if index_dtype is None else index_dtype
        self.main_pool = OscarMHATokenToKVPool(
            size, page_size=page_size, dtype=dtype, head_num=head_num, head_dim=head_dim,
            layer_num=len(local_dense) + len(local_sparse), device=device, enable_memory_saver=enable_memory_saver,
            start_layer=start_layer, end_layer=end_layer, enable_alt_stream=enable_alt_stream,
            oscar_config=oscar_config, hp_dtype=hp_dtype, max_reqs=max_reqs, sink_rows=sink_rows)
        index = dict(size=size, page_size=page_size, dtype=self.index_dtype, head_num=1, head_dim=idx_head_dim,
                     device=device, enable_memory_saver=enable_memory_saver)
        self.index_kv_pool = MHATokenToKVPool(layer_num=len(kv_sparse), **index) if kv_sparse else None
        self.index_k_pool = MHATokenToKOnlyPool(layer_num=len(k_only), **index) if k_only else None
        self.mem_usage = self.main_pool.mem_usage + sum(
            p.mem_usage for p in (self.index_kv_pool, self.index_k_pool) if p is not None)
        main = self.main_pool
        self.layer_num, self.start_layer, self.end_layer = main.layer_num, main.start_layer, main.end_layer
        self.head_num, self.head_dim = main.head_num, main.head_dim
        self.layer_transfer_counter = None
        # what the OSCAR backends and hooks read of an INT2 pool
        self.oscar_config, self.hp_dtype = main.oscar_config, main.hp_dtype
        self.windows, self.layout = main.windows, main.layout
        self.owns_windows = True  # SGLang's allocator over this pool frees the main slots, which key the windows

    # ------------------------------------------------------------------ INT2 access (the main pool's)
    def layout_of(self, layer_id: int) -> Int2Layout:
        """The :class:`~sglang_oscar.kernels.layout.Int2Layout` of the main K/V (every layer)."""
        return self.main_pool.layout

    def is_int2_layer(self, layer_id: int) -> bool:
        """Every local layer (dense and sparse) keeps its K/V in the INT2 main pool."""
        return self.start_layer <= layer_id < self.start_layer + self.layer_num

    def is_swa_layer(self, layer_id: int) -> bool:
        """No sliding pool here."""
        return False

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether a global layer id is one of this rank's sparse (MSA) layers."""
        return layer_id in self.sparse_layer_id_mapping

    def int2_buffers(self, layer_id: int):
        """``(k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v)`` of a global layer id (the main pool's)."""
        return self.main_pool.int2_buffers(layer_id)

    def write_rotated(self, layer_id: int, loc: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor,
                      hp_rows: torch.Tensor | None) -> None:
        """:meth:`.OscarMHATokenToKVPool.write_rotated` of the main pool (rotated K/V rows, HP copies)."""
        self.main_pool.write_rotated(layer_id, loc, k_rot, v_rot, hp_rows)

    def index_bytes_per_token(self) -> int:
        """Bytes per token of the BF16 index pools (:func:`minimax_index_bytes` of the local sparse layers)."""
        return minimax_index_bytes(len(self.index_kv_layer_id_mapping), len(self.index_k_layer_id_mapping),
                                   self.idx_head_dim, self.index_dtype)

    def int2_bytes_per_token(self) -> int:
        """Bytes of one slot over all local layers: the INT2 main K/V plus the BF16 index keys (and values)."""
        return self.main_pool.int2_bytes_per_token() + self.index_bytes_per_token()

    def hp_bytes(self) -> int:
        """Bytes of the BF16 window rows of the main pool (sink arena + recent rings, all layers)."""
        return self.main_pool.hp_bytes()

    # get_kv_size_bytes: SGLang's (memory_pool.py:4928-4931) sums the sub-pools': the INT2 main pool's
    # planes and windows, plus the index pools.

    # ------------------------------------------------------------------ refused BF16 writes of the main K/V
    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs):
        raise RuntimeError(
            "MiniMax-M3 with --kv-cache-dtype int2: the main K/V pool is INT2 and is written only by the OSCAR "
            "attention backends (rotated rows); something tried to write BF16 K/V rows directly (SGLang's own "
            "MiniMax sparse backend or a fused store). Serve with the default int2 backend, or --kv-cache-dtype auto")

    def set_fused_kv_index_buffer(self, layer, loc, cache_k, cache_v, cache_idx_k, cache_idx_v):
        raise RuntimeError(
            "MiniMax-M3 with --kv-cache-dtype int2: the fused main K/V + index store writes BF16 main rows, but "
            "the main pool is INT2 (the OSCAR sparse backend writes K/V and the index keys apart); serve with the "
            "default int2 backend, or --kv-cache-dtype auto")
