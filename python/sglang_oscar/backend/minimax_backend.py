"""``OscarMiniMaxSparseBackend``: MiniMax-M3's sparse (MSA) layers over the INT2 main K/V pool.

SGLang 0.5.16 runs a MiniMax-M3 sparse layer in ``MiniMaxSparseAttnBackend``
(``srt/layers/attention/minimax_sparse_backend.py``) in three steps
(``srt/layers/attention/minimax_sparse_ops/minimax_sparse.py``): a small *index* attention
(``idx_q`` of ``H_idx`` heads against one BF16 index key head, plus its own output ``idx_o`` when the
layer keeps an index value) picks ``sparse_topk_blocks`` key blocks of ``sparse_block_size`` tokens per
index head and query; ``topk_index_reduce`` unions the lists of each kv head's index heads when
``H_idx > H_kv``; the main attention reads only the selected blocks of the main K/V.

This subclass keeps the first two steps (SGLang's indexer kernels over SGLang's BF16 index pools,
:meth:`OscarMiniMaxSparseBackend._select`) and replaces what touches the main K/V:

* the layer's new K/V rows are rotated and written into the INT2 main pool by the dense OSCAR
  backend's ``_prepare`` (``self.dense_backend``, set by SGLang's ``MiniMaxHybridAttnBackend``; it
  also runs the windows' bookkeeping once per forward for every layer), the index keys (and values)
  by SGLang's ``set_index_kv_buffer`` / ``set_index_k_buffer``;
* the main attention is :func:`sglang_oscar.kernels.sparse.block_sparse_attention` over the two-tier
  cache, with the window modes of the dense backend: a decode row reads ``[BF16 sink | INT2 | BF16
  recent]`` (``recent`` = the pool's), an extend chunk one row per token with ``row_len = position + 1``
  and ``recent = 0`` (only the sink in BF16);
* the output goes back to the model's frame through the dense backend's ``_output``.

SGLang's MSA (SM100 ``fmha_sm100``) and dense-sparse-decode main paths read BF16 main rows, so they are
forced off after SGLang's ``__init__`` (the launch refuses ``SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE``).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.minimax_sparse_backend import MiniMaxSparseAttnBackend

from ..kernels.sparse import BLOCK_SIZES, block_sparse_attention, block_sparse_num_splits
from ..pool.minimax_pool import OscarMiniMaxSparseKVPool

logger = logging.getLogger("sglang_oscar")


class OscarMiniMaxSparseBackend(MiniMaxSparseAttnBackend):
    """SGLang's MiniMax-M3 sparse backend whose main attention reads the INT2 pool (module docstring).

    Args:
        runner: SGLang's ``ModelRunner`` (``token_to_kv_pool``, ``req_to_token_pool``, ``model_config``).

    Raises:
        RuntimeError: the pool is not :class:`~sglang_oscar.pool.minimax_pool.OscarMiniMaxSparseKVPool`
            (the pool hook did not apply).
        ValueError: a ``sparse_block_size`` the INT2 block-sparse kernel does not take (16, 32, 64, 128).
    """

    def __init__(self, runner):
        pool = runner.token_to_kv_pool
        if not isinstance(pool, OscarMiniMaxSparseKVPool):
            raise RuntimeError(f"MiniMax-M3 with --kv-cache-dtype int2: the token pool is {type(pool).__name__}, not "
                               "the INT2 MiniMax pool; the sglang-oscar pool hook did not apply (check the log)")
        super().__init__(runner)
        # MSA and the dense-sparse decode read BF16 main K/V rows (minimax_sparse_backend.py:81-156)
        self.use_msa = self._use_msa_decode = self._msa_owns_decode = False
        self.use_dense_sparse_decode = False
        if self.block_size_k not in BLOCK_SIZES:
            raise ValueError(f"MiniMax-M3 sparse_block_size {self.block_size_k}: the INT2 block-sparse attention "
                             f"takes {BLOCK_SIZES}; serve this model with --kv-cache-dtype auto")
        logger.info("sglang-oscar: MiniMax-M3 sparse layers %s over the INT2 main K/V (block %d, top-%d blocks, "
                    "SGLang's indexer over its BF16 index pools)", self.sparse_layer_ids, self.block_size_k,
                    self.topk_blocks)

    # ------------------------------------------------------------------ pieces
    def _dense(self):
        """The OSCAR Triton backend of the dense layers (``MiniMaxHybridAttnBackend`` sets it)."""
        from .triton_backend import OscarTritonAttnBackend

        dense = self.dense_backend
        if not isinstance(dense, OscarTritonAttnBackend):
            raise RuntimeError(f"MiniMax-M3 int2: the sparse backend needs the OSCAR Triton backend as its dense "
                               f"backend (it writes the rows and owns the windows), got {type(dense).__name__}")
        return dense

    def _write_index(self, layer, loc: torch.Tensor, idx_k: torch.Tensor, idx_v: torch.Tensor | None,
                     disable_value: bool) -> None:
        """The new tokens' index key (and value) into SGLang's BF16 index pools, by SGLang's methods
        (``memory_pool.py:4808-4852``)."""
        if disable_value:
            self.kv_pool.set_index_k_buffer(layer, loc, idx_k)
        else:
            self.kv_pool.set_index_kv_buffer(layer, loc, idx_k, idx_v)

    def _select(self, idx_q: torch.Tensor, layer, forward_batch, disable_value: bool):
        """SGLang's indexer over the index pools: ``(idx_o, blocks)``.

        Args:
            idx_q: ``[N, H_idx, Di]`` index queries (model dtype), one row per query token.
            layer: the ``RadixAttention`` (``layer_id``, ``tp_k_head_num``).
            forward_batch: a decode or extend batch (``seq_lens``, ``req_pool_indices``; for extend
                ``extend_seq_lens`` / ``extend_prefix_lens`` / ``extend_seq_lens_cpu``).
            disable_value: the layer keeps no index value (``idx_o`` is then ``None``).

        Returns:
            ``idx_o``: ``[N, H_idx, Di]`` (model dtype) or ``None``; ``blocks``: int32 ``[H_kv, N, k]``
            absolute block ids per kv head and row, ``-1`` padded (``k = topk`` or, with
            ``H_idx > H_kv``, ``(H_idx / H_kv) * topk`` after ``topk_index_reduce``'s union).

        SGLang's calls: decode ``minimax_sparse.py:215-246``, extend ``:86-117``; the kernels are
        autotuned Triton (not run by the interpreter: CPU tests replace this method).
        """
        from sglang.kernels.ops.attention.minimax_sparse.common.index import topk_index_reduce
        from sglang.kernels.ops.attention.minimax_sparse.common.utils import get_cu_seqblocks
        from sglang.kernels.ops.attention.minimax_sparse.decode.flash_with_topk_idx import flash_decode_with_topk_idx
        from sglang.kernels.ops.attention.minimax_sparse.prefill.flash_with_topk_idx import (
            flash_prefill_with_topk_index,
        )

        lid = layer.layer_id
        if disable_value:
            idx_k_cache, idx_v_cache = self.kv_pool.get_index_k_buffer(lid), None
        else:
            idx_k_cache, idx_v_cache = self.kv_pool.get_index_kv_buffer(lid)
        common = dict(req_to_token=self.req_to_token, slot_ids=forward_batch.req_pool_indices, topk=self.topk_blocks,
                      init_blocks=self.init_blocks, local_blocks=self.local_blocks, score_type=self.score_type,
                      disable_index_value=disable_value)
        if forward_batch.forward_mode.is_decode():
            idx_o, topk_idx, _ = flash_decode_with_topk_idx(
                q=idx_q, sink=None, k_cache=idx_k_cache, v_cache=idx_v_cache, seq_lens=forward_batch.seq_lens,
                max_seqlen=self._max_seqlen_k, block_size=self.block_size_k, use_dense_main_attn=False,
                page_size=self.page_size, **common)
        else:
            extend = forward_batch.extend_seq_lens.to(torch.int32)
            cu_seqlens = torch.nn.functional.pad(extend.cumsum(0, dtype=torch.int32), (1, 0))
            seq_lens = forward_batch.seq_lens.to(torch.int32)
            prefix = forward_batch.extend_prefix_lens
            prefix = seq_lens - extend if prefix is None else prefix.to(torch.int32)
            cu_blocks, max_blocks, all_blocks, *_ = get_cu_seqblocks(
                cu_seqlens, self._max_seqlen_q, self.block_size_q, self.block_size_k, forward_batch.extend_seq_lens_cpu)
            idx_o, topk_idx = flash_prefill_with_topk_index(
                q=idx_q, k_cache=idx_k_cache, v_cache=idx_v_cache, sink=None, cu_seqlens=cu_seqlens,
                seq_lens=seq_lens, prefix_lens=prefix, max_seqlen_q=self._max_seqlen_q,
                max_seqlen_k=self._max_seqlen_k, block_size_q=self.block_size_q, block_size_k=self.block_size_k,
                cu_seqblocks_q=cu_blocks, max_seqblock_q=max_blocks, all_seqblock_q=all_blocks, **common)
        hkv = layer.tp_k_head_num
        group = idx_q.shape[1] // hkv
        if group > 1:
            topk_idx = topk_index_reduce(topk_idx.view(hkv, group, -1, self.topk_blocks), dim=1)
        return idx_o, topk_idx.to(torch.int32)

    def _rows(self, forward_batch, rows: int):
        """``(row_req, row_len, recent)`` of the main attention's ``rows`` query rows: a decode row per
        request (its ``seq_lens``, the pool's recent window), an extend row per real chunk token
        (``position + 1``, ``recent = 0``: window mode "extend"; a padded batch's tail left out)."""
        if forward_batch.forward_mode.is_decode():
            return forward_batch.req_pool_indices, forward_batch.seq_lens, self.kv_pool.oscar_config.recent_tokens
        req = torch.repeat_interleave(forward_batch.req_pool_indices, forward_batch.extend_seq_lens, output_size=rows)
        return req, forward_batch.positions[:rows] + 1, 0

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache, idx_q, idx_k, idx_v):
        dense = self._dense()
        lid = layer.layer_id
        if self._is_sparse_kv_cached_by_fusion(forward_batch, lid):
            raise RuntimeError(f"MiniMax-M3 layer {lid}: the model's fused norm+RoPE+cache kernel (ROCm) wrote BF16 "
                               "main K/V rows, which the INT2 pool does not hold; --kv-cache-dtype int2 does not "
                               "serve MiniMax-M3 on ROCm")
        dense._check_layer(layer, None, None)
        disable_value = lid in self.disable_value_layer_ids
        n = q.shape[0]
        # an extend batch padded past its tokens (the breakable prefill graph's bucket): the query rows
        # are the real tokens only, the rest come back as zeros (SGLang's forward_extend, :313-366; the
        # indexer's block lists have one row per real token)
        rows = n
        if not forward_batch.forward_mode.is_decode() and forward_batch.extend_seq_lens_cpu is not None:
            rows = min(n, int(sum(forward_batch.extend_seq_lens_cpu)))
        q_rot = dense._prepare(q, k, v, layer, forward_batch, save_kv_cache)  # writes the INT2 rows first
        if save_kv_cache:
            self._write_index(layer, forward_batch.out_cache_loc, idx_k, idx_v, disable_value)
        idx_o, blocks = self._select(idx_q[:rows], layer, forward_batch, disable_value)
        row_req, row_len, recent = self._rows(forward_batch, rows)
        pool, windows = self.kv_pool, self.kv_pool.windows
        o = block_sparse_attention(
            q_rot[:rows], pool.layout_of(lid), pool.int2_buffers(lid), windows.hp_index, dense._int2_req_to_token,
            row_req, row_len, blocks, block_size=self.block_size_k, sink=pool.oscar_config.sink_tokens,
            recent=recent, sm_scale=layer.scaling, sink_lens=windows.sink_lens,
            num_splits=block_sparse_num_splits(blocks.shape[2], self.block_size_k,
                                               decode=forward_batch.forward_mode.is_decode()))
        out = dense._output(o, layer, q.dtype, forward_batch)
        if idx_o is None or disable_value:
            idx_o = None
        else:
            idx_o = idx_o.reshape(rows, -1)
        if rows < n:
            out = torch.cat([out, out.new_zeros(n - rows, out.shape[1])])
            idx_o = None if idx_o is None else torch.cat([idx_o, idx_o.new_zeros(n - rows, idx_o.shape[1])])
        return (None if idx_o is None else idx_o.contiguous()), out

    # ------------------------------------------------------------------ SGLang's entry points
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, idx_q, idx_k, idx_v, **kwargs):
        """A decode batch of a sparse layer: ``(idx_o [B, H_idx * Di] or None, o [B, H_q * D_v])`` in
        ``q``'s dtype (``MiniMaxSparseAttnBackend.forward_decode``'s return, ``minimax_sparse_backend.py:404-490``).

        Args:
            q: ``[B, H_q, D]``; k, v: ``[B, H_kv, D]`` (model dtype); idx_q ``[B, H_idx, Di]``, idx_k
                ``[B, 1, Di]``, idx_v ``[B, 1, Di]`` or ``None`` (a layer without index value).

        Raises:
            NotImplementedError: extra keyword arguments (SGLang's asserts none), and the dense
                backend's layer checks.
        """
        if kwargs:
            raise NotImplementedError(f"MiniMax-M3 int2 sparse decode takes no extra arguments, got {sorted(kwargs)}")
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, idx_q, idx_k, idx_v)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, idx_q, idx_k, idx_v, **kwargs):
        """An extend batch of a sparse layer (one query row per chunk token): as :meth:`forward_decode`,
        ``N`` = the chunk's tokens (``minimax_sparse_backend.py:266-366``).

        Raises:
            NotImplementedError: extra keyword arguments, and the dense backend's layer checks.
        """
        if kwargs:
            raise NotImplementedError(f"MiniMax-M3 int2 sparse extend takes no extra arguments, got {sorted(kwargs)}")
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, idx_q, idx_k, idx_v)
