"""MiniMax-M3 (sparse / MSA attention) with ``--kv-cache-dtype int2``: sizing, pool and backend hooks.

SGLang 0.5.16 serves MiniMax-M3 (``is_minimax_sparse``: ``MiniMaxM3SparseForCausalLM`` /
``MiniMaxM3SparseForConditionalGeneration``, ``srt/configs/model_config.py:136-141``) with

* one ``MiniMaxSparseKVPool`` (main K/V of every layer + BF16 index pools of the sparse layers,
  ``srt/mem_cache/kv_cache_configurator.py:_build_minimax_sparse_kv_pool``), sized by
  ``DefaultPoolConfigurator._compute_cell_size``'s M3 branch (``model_executor/pool_configurator.py:218-259``);
* ``attn_backend_wrapper`` (``srt/layers/attention/attention_registry.py:263-283``), which wraps the
  full-attention backend into ``MiniMaxHybridAttnBackend(full, MiniMaxSparseAttnBackend(runner), sparse ids)``.

For an int2 server this module supplies the INT2 counterparts, called from :mod:`.serving`'s hooks
(cell size, memory-pool log, pool build) and from :func:`around_attn_backend_wrapper` (its own AROUND
hook): :class:`~sglang_oscar.pool.minimax_pool.OscarMiniMaxSparseKVPool` and
:class:`~sglang_oscar.backend.minimax_backend.OscarMiniMaxSparseBackend` under SGLang's own hybrid
backend, whose dense side is the OSCAR Triton backend.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

logger = logging.getLogger("sglang_oscar")

INT2 = "int2"
MINIMAX_HOOK_TARGETS = ("sglang.srt.layers.attention.attention_registry.attn_backend_wrapper",)


def is_minimax_sparse_config(hf_config) -> bool:
    """SGLang's ``is_minimax_sparse`` on an HF config object (``False`` for a config without
    ``architectures``, e.g. the dicts and stand-ins of other families)."""
    if hf_config is None or isinstance(hf_config, dict) or not hasattr(hf_config, "architectures"):
        return False
    from sglang.srt.configs.model_config import is_minimax_sparse

    return bool(is_minimax_sparse(hf_config))


def is_minimax_kvc(kvc) -> bool:
    """Whether a ``KVCacheConfigurator`` (or model runner) serves a MiniMax-M3 sparse model."""
    return is_minimax_sparse_config(getattr(getattr(kvc, "model_config", None), "hf_config", None))


class MiniMaxLayers(NamedTuple):
    """This rank's layers of a MiniMax-M3 model (global ids) and the index geometry."""

    dense: list[int]
    sparse: list[int]
    index_kv: list[int]  # sparse layers whose index keeps a key and a value
    index_k_only: list[int]  # sparse layers with sparse_disable_index_value (key only)
    idx_head_dim: int


def minimax_layers(kvc) -> MiniMaxLayers:
    """The local dense / sparse layers of ``kvc.layer_info``'s range ``[start_layer, end_layer)``, as
    SGLang's pool and cell size split them (``pool_configurator.py:227-243``, ``memory_pool.py:4653-4667``).

    Raises:
        ValueError: SGLang's own error for a config without ``sparse_attention_config``.
    """
    from sglang.srt.configs.model_config import (
        get_minimax_sparse_attention_config,
        get_minimax_sparse_disable_value_layer_ids,
        get_minimax_sparse_layer_ids,
    )

    cfg = get_minimax_sparse_attention_config(kvc.model_config.hf_config)
    dense, sparse = get_minimax_sparse_layer_ids(cfg)
    no_value = set(get_minimax_sparse_disable_value_layer_ids(cfg))
    start, end = kvc.layer_info.start_layer, kvc.layer_info.end_layer
    dense = [i for i in dense if start <= i < end]
    sparse = [i for i in sparse if start <= i < end]
    return MiniMaxLayers(dense, sparse, [i for i in sparse if i not in no_value], [i for i in sparse if i in no_value],
                         int(cfg["sparse_index_dim"]))


def _index_bytes(layers: MiniMaxLayers, dtype) -> int:
    from ..pool.minimax_pool import minimax_index_bytes

    return minimax_index_bytes(len(layers.index_kv), len(layers.index_k_only), layers.idx_head_dim, dtype)


def minimax_index_bytes_of(kvc) -> int:
    """Bytes per token of the BF16 index pools of this rank's sparse layers (``kvc.model_dtype``, as
    SGLang builds them), 0 for other models."""
    return _index_bytes(minimax_layers(kvc), kvc.model_dtype) if is_minimax_kvc(kvc) else 0


def minimax_cell_size(kvc, config, heads: int, head_dim: int, v_head_dim: int) -> int:
    """Bytes per token of an int2 MiniMax-M3 server: INT2 main K/V of the local dense + sparse layers
    (:func:`~sglang_oscar.pool.sizing.int2_cell_size`) plus the BF16 index pools; SGLang's M3 cell size
    is the same sum with BF16 main rows (``pool_configurator.py:249-259``)."""
    from ..pool.sizing import int2_cell_size

    layers = minimax_layers(kvc)
    return int2_cell_size(config, heads, head_dim, v_head_dim, len(layers.dense) + len(layers.sparse)) + \
        _index_bytes(layers, kvc.model_dtype)


def log_minimax_sizes(kvc, config, heads: int, head_dim: int, v_head_dim: int, tokens: int) -> None:
    """Startup log of an int2 MiniMax-M3 server: bytes per token of the main K/V (INT2 vs BF16), of the
    index pools (BF16 in both), both totals, and the token budget."""
    from ..pool.sizing import hp_row_bytes, int2_cell_size

    layers = minimax_layers(kvc)
    n = len(layers.dense) + len(layers.sparse)
    main_int2 = int2_cell_size(config, heads, head_dim, v_head_dim, n)
    main_bf16 = hp_row_bytes(heads, head_dim, v_head_dim, n, kvc.model_dtype)
    index = _index_bytes(layers, kvc.model_dtype)
    logger.info("sglang-oscar: MiniMax-M3 main K/V (%d dense + %d sparse layers x %d kv heads x %d): %d bytes/token "
                "INT2 (BF16: %d, %.2fx fewer); index pools (BF16, %d key+value + %d key-only layers x %d): %d "
                "bytes/token; total %d bytes/token (BF16: %d, %.2fx fewer); tokens: %d (%.2f GiB)",
                len(layers.dense), len(layers.sparse), heads, head_dim, main_int2, main_bf16,
                main_bf16 / max(main_int2, 1), len(layers.index_kv), len(layers.index_k_only), layers.idx_head_dim,
                index, main_int2 + index, main_bf16 + index, (main_bf16 + index) / max(main_int2 + index, 1),
                tokens or 0, (tokens or 0) * (main_int2 + index) / 2**30)


def build_minimax_pool(kvc, size: int, common: dict):
    """The INT2 MiniMax-M3 pool (``KVCacheConfigurator._build_minimax_sparse_kv_pool``'s arguments, with
    the INT2 main pool's settings from the pool hook's ``common`` dict: page size, geometry, device,
    OSCAR config, HP dtype, request slots, sink rows).

    Raises:
        ValueError: ``v_head_dim != head_dim`` (SGLang's M3 pool has one head_dim), and the pool's.
    """
    from sglang.srt.configs.model_config import (
        get_minimax_sparse_attention_config,
        get_minimax_sparse_disable_value_layer_ids,
        get_minimax_sparse_layer_ids,
    )

    from ..pool.minimax_pool import OscarMiniMaxSparseKVPool

    if common["v_head_dim"] not in (None, common["head_dim"]):
        raise ValueError(f"MiniMax-M3: v_head_dim {common['v_head_dim']} != head_dim {common['head_dim']}; SGLang's "
                         "MiniMax sparse pool keeps one head_dim")
    cfg = get_minimax_sparse_attention_config(kvc.model_config.hf_config)
    dense, sparse = get_minimax_sparse_layer_ids(cfg)
    pool = OscarMiniMaxSparseKVPool(
        size=size, page_size=common["page_size"], dtype=common["dtype"], head_num=common["head_num"],
        head_dim=common["head_dim"], idx_head_dim=int(cfg["sparse_index_dim"]), dense_layer_ids=dense,
        sparse_layer_ids=sparse, device=common["device"],
        disable_value_sparse_layer_ids=get_minimax_sparse_disable_value_layer_ids(cfg),
        enable_memory_saver=kvc.server_args.enable_memory_saver, index_dtype=kvc.model_dtype,
        start_layer=kvc.layer_info.start_layer, end_layer=kvc.layer_info.end_layer,
        oscar_config=common["oscar_config"], hp_dtype=common["hp_dtype"], max_reqs=common["max_reqs"],
        sink_rows=common["sink_rows"], enable_alt_stream=not getattr(kvc.server_args, "enable_pdmux", False))
    main = pool.main_pool
    logger.info("sglang-oscar: MiniMax-M3 pool: INT2 main K/V %d slots x %d layers (%d sparse), %d B/token; BF16 "
                "index pools %d B/token; BF16 windows %.2f GiB (%d sink rows, %d ring rows)", pool.size, pool.layer_num,
                len(pool.sparse_layer_id_mapping), main.int2_bytes_per_token(), pool.index_bytes_per_token(),
                pool.hp_bytes() / 2**30, pool.windows.sink_rows, pool.windows.num_rows - pool.windows.sink_rows)
    return pool


def around_attn_backend_wrapper(original_fn, runner, full_attn_backend, *args, **kwargs):
    """``attention_registry.attn_backend_wrapper`` (AROUND): for an int2 MiniMax-M3 runner, SGLang's
    ``MiniMaxHybridAttnBackend`` over the OSCAR Triton backend (dense layers) and
    :class:`~sglang_oscar.backend.minimax_backend.OscarMiniMaxSparseBackend` (sparse layers); otherwise
    the original wrapper (``attention_registry.py:263-283``).

    Raises:
        RuntimeError: the full-attention backend is not the OSCAR Triton backend (another
            ``--attention-backend``, or the backend factory hook did not apply).
    """
    server_args = getattr(runner, "server_args", None)
    if getattr(server_args, "kv_cache_dtype", None) != INT2 or not is_minimax_kvc(runner):
        return original_fn(runner, full_attn_backend, *args, **kwargs)
    from sglang.srt.layers.attention.minimax_sparse_backend import MiniMaxHybridAttnBackend

    from ..backend import minimax_backend
    from ..backend.triton_backend import OscarTritonAttnBackend

    if not isinstance(full_attn_backend, OscarTritonAttnBackend):
        raise RuntimeError(f"MiniMax-M3 with --kv-cache-dtype int2: the dense layers' backend is "
                           f"{type(full_attn_backend).__name__}, not the OSCAR Triton backend; use "
                           "--attention-backend triton (or leave it unset)")
    sparse = minimax_backend.OscarMiniMaxSparseBackend(runner)
    return MiniMaxHybridAttnBackend(full_attn_backend, sparse, sparse.sparse_layer_ids)
