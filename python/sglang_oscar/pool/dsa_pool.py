"""``OscarDSALatentPool``: the INT2 latent pool of a DSA model (GLM-5) with SGLang's indexer keys.

A DSA model's lightning indexer keeps one FP8 key (``index_head_dim`` 128) and one fp32 scale per
token and layer in SGLang's ``DSATokenToKVPool.index_k_with_scale_buffer`` (page-major uint8
``[pages, page_size x (128 + 4)]``, written and read by SGLang's indexer kernels through the pool
methods below) and selects each query's top-k positions from them; the attention then reads the
latents of the selected positions only. This pool is
:class:`~.latent_pool.OscarMLATokenToKVPool` (INT2 latent, BF16 ``k_pe`` and windows) plus that index
buffer and its accessors, taken unchanged from SGLang's ``DSATokenToKVPool`` (0.5.16,
``srt/mem_cache/memory_pool.py``) so the indexer runs as it does over a BF16 pool.

Pages: SGLang runs DSA models with page size 64 on CUDA (its indexer kernels read the page table
``req_to_token[:, ::64] // 64``, and ``DSATokenToKVPool`` asserts it); the INT2 latent planes and the
windows are slot-indexed, so any page size serves them. Bytes per token and layer: the latent's
(:func:`~.sizing.latent_cell_size`) plus the index key's ``128 + 4`` (:func:`dsa_index_bytes`).
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

from .latent_pool import OscarMLATokenToKVPool


def dsa_index_bytes(index_head_dim: int, num_layers: int) -> int:
    """Bytes per token of the DSA indexer's key buffer over ``num_layers`` layers: one FP8 key of
    ``index_head_dim`` and one fp32 scale per 128-element block (SGLang's ``DSATokenToKVPool``
    layout and its ``pool_configurator`` cell size)."""
    return num_layers * (index_head_dim + index_head_dim // DSATokenToKVPool.quant_block_size * 4)


class OscarDSALatentPool(OscarMLATokenToKVPool):
    """INT2 latent pool with the DSA indexer's key buffer (module docstring).

    Args:
        index_head_dim: the indexer key width (``get_dsa_index_head_dim``; 128).
        index_buf_size: slots of the index buffer (default ``size``).
        *args, **kwargs: :class:`~.latent_pool.OscarMLATokenToKVPool`'s (``use_dsa`` is implied).

    Raises:
        ValueError: an ``index_head_dim`` other than 128 (SGLang's indexer kernels), a page size other
            than 64 on CUDA (SGLang's DSA page size), and :class:`~.latent_pool.OscarMLATokenToKVPool`'s.
    """

    serves_dsa = True
    quant_block_size = DSATokenToKVPool.quant_block_size
    index_k_with_scale_buffer_dtype = DSATokenToKVPool.index_k_with_scale_buffer_dtype
    # SGLang's index-buffer layout and accessors, unchanged (the indexer's kernels read and write them)
    _index_buffer_shape = DSATokenToKVPool._index_buffer_shape
    _create_index_buffers = DSATokenToKVPool._create_index_buffers
    get_index_k_with_scale_buffer = DSATokenToKVPool.get_index_k_with_scale_buffer
    get_index_k_continuous = DSATokenToKVPool.get_index_k_continuous
    get_index_k_scale_continuous = DSATokenToKVPool.get_index_k_scale_continuous
    get_index_k_scale_buffer = DSATokenToKVPool.get_index_k_scale_buffer
    set_index_k_scale_buffer = DSATokenToKVPool.set_index_k_scale_buffer

    def __init__(self, *args, index_head_dim: int, index_buf_size: int | None = None, **kwargs):
        if index_head_dim != 128:
            raise ValueError(f"DSA index_head_dim {index_head_dim}: SGLang's indexer kernels take 128")
        page_size = kwargs.get("page_size", args[1] if len(args) > 1 else 1)
        device = kwargs.get("device", "cuda")
        if torch.device(device).type == "cuda" and page_size != 64:
            raise ValueError(f"--kv-cache-dtype int2 on a DSA model runs with SGLang's DSA page size 64 (got "
                             f"--page-size {page_size}); drop --page-size")
        super().__init__(*args, use_dsa=True, **kwargs)
        self.index_head_dim = index_head_dim
        self.index_buf_size = self.size if index_buf_size is None else index_buf_size
        self._create_index_buffers()
        # MLATokenToKVPool leaves the "KV Cache is allocated" log (and the scheduler's memory stats) to a
        # DSA pool, after its index buffers
        self._finalize_allocation_log(self.size)

    def _clear_buffers(self):
        super()._clear_buffers()
        del self.index_k_with_scale_buffer

    def get_kv_size_bytes(self):
        return super().get_kv_size_bytes() + sum(t.numel() * t.element_size() for t in self.index_k_with_scale_buffer)

    def int2_bytes_per_token(self) -> int:
        """Bytes of one token over all local layers: the latent pool's plus the index key's."""
        return super().int2_bytes_per_token() + dsa_index_bytes(self.index_head_dim, self.layer_num)
