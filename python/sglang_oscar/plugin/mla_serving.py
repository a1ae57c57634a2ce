"""MLA models (DeepSeek-V2/V3, GLM-5 DSA, Kimi-Linear's MLA layers) with ``--kv-cache-dtype int2``: sizing,
pool and dispatch, called from :mod:`.serving`'s hooks.

SGLang 0.5.16 serves these models with ``use_mla_backend`` set (``model_runner.py``: ``attention_arch ==
MLA``): its pool configurator counts one ``[c_kv | k_pe]`` row per token and layer, its pool hook builds an
``MLATokenToKVPool``, and ``DeepseekV2AttentionMLA.dispatch_attn_forward_method`` picks a forward method per
batch. An int2 server keeps ``use_mla_backend`` as it is and stores, by ``--oscar-mla-storage``:

* ``latent`` (default): :class:`~sglang_oscar.pool.latent_pool.OscarMLATokenToKVPool` (the INT2 latent + BF16
  ``k_pe``; :class:`~sglang_oscar.pool.dsa_pool.OscarDSALatentPool` for DSA models, inside SGLang's hybrid
  linear pool for Kimi-Linear), absorbed ``MLA`` for every forward;
* ``expanded``: :class:`~sglang_oscar.pool.int2_pool.OscarMHATokenToKVPool` with ``H / tp`` heads of K
  ``qk_nope_head_dim + qk_rope_head_dim`` and V ``v_head_dim`` (DeepSeek-V3: 192 / 128), plain ``MHA`` for
  every forward, attended by :class:`~sglang_oscar.backend.expanded_backend.OscarExpandedMLABackend`.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("sglang_oscar")

LATENT, EXPANDED = "latent", "expanded"


def _config(server_args):
    from . import oscar_config_of

    return oscar_config_of(server_args)


def is_expanded_kvc(kvc) -> bool:
    """Whether a ``KVCacheConfigurator`` serves an MLA model with ``--oscar-mla-storage expanded``."""
    server_args = getattr(kvc, "server_args", None)  # (stand-ins of the configurator may carry none: latent)
    return bool(kvc.use_mla_backend) and server_args is not None and _config(server_args).mla_storage == EXPANDED


def expanded_geometry(kvc) -> tuple[int, int, int]:
    """``(heads per rank, K head_dim, V head_dim)`` of expanded storage: ``kv_b_proj`` is column-parallel, so
    a rank holds ``num_attention_heads / attn_tp_size`` heads of K ``qk_nope_head_dim + qk_rope_head_dim`` and
    V ``v_head_dim`` (SGLang's ``attn_mha``)."""
    from sglang.srt.runtime_context import get_parallel

    mc = kvc.model_config
    return (mc.get_num_attention_heads(get_parallel().attn_tp_size), mc.qk_nope_head_dim + mc.qk_rope_head_dim,
            mc.v_head_dim)


def dsa_index_head_dim(kvc) -> int:
    """The DSA indexer's key width of a DSA model (GLM-5: 128), else 0."""
    from sglang.srt.configs.model_config import get_dsa_index_head_dim, is_deepseek_dsa

    hf = kvc.model_config.hf_config
    return get_dsa_index_head_dim(hf) if kvc.use_mla_backend and is_deepseek_dsa(hf) else 0


def dsa_index_bytes(kvc, num_layers: int) -> int:
    """Bytes per token of a DSA model's indexer keys over ``num_layers`` layers (0 without DSA)."""
    from ..pool.dsa_pool import dsa_index_bytes as per_layers

    dim = dsa_index_head_dim(kvc)
    return per_layers(dim, num_layers) if dim else 0


def mla_kv_group(kvc, num_layers: int) -> tuple[str, int, int, int, int]:
    """The memory plan's group of an MLA model: ``("latent", layers, 1, kv_lora_rank, qk_rope_head_dim)`` (a
    window row is ``[c_kv | k_pe]``) or ``("expanded", layers, heads per rank, K, V)``."""
    if is_expanded_kvc(kvc):
        return (EXPANDED, num_layers, *expanded_geometry(kvc))
    mc = kvc.model_config
    return (LATENT, num_layers, 1, mc.kv_lora_rank, mc.qk_rope_head_dim)


def mla_cell_size(kvc, num_layers: int) -> int:
    """INT2 bytes per token of an MLA model's ``num_layers`` layers on this rank, as its pool allocates them:
    the latent's (+ the DSA indexer's FP8 keys) or the expanded per-head K/V rows'.

    Raises:
        ValueError: a group size the geometry does not take.
    """
    from ..pool.sizing import int2_cell_size, latent_cell_size

    config = _config(kvc.server_args)
    if is_expanded_kvc(kvc):
        return int2_cell_size(config, *expanded_geometry(kvc), num_layers)
    mc = kvc.model_config
    return (latent_cell_size(config, mc.kv_lora_rank, mc.qk_rope_head_dim, num_layers, kvc.model_dtype)
            + dsa_index_bytes(kvc, num_layers))


def build_mla_pool(kvc, size: int, config, max_reqs: int, req_to_token_pool):
    """The INT2 pool of an MLA model (the pool hook's MLA branch): the latent pool (alone, or inside SGLang's
    hybrid linear pool for Kimi-Linear) or the expanded MHA pool.

    Raises:
        ValueError: expanded storage of a DSA or linear-attention hybrid model (the launch check refuses
            them first; this stops a launch that skipped it).
    """
    from .serving import _attention_layer_ids, _hybrid_linear_pool

    li = kvc.layer_info
    if config.mla_storage == EXPANDED:
        if kvc.mambaish_config is not None or dsa_index_head_dim(kvc):
            raise ValueError("--oscar-mla-storage expanded serves dense DeepSeek-V2/V3 models only (not DSA or "
                             "linear-attention hybrids); use --oscar-mla-storage latent")
        return build_expanded_pool(kvc, size, config, max_reqs)
    if kvc.mambaish_config is None:
        return build_latent_pool(kvc, size, config, max_reqs, li.num_effective_layers, li.start_layer, li.end_layer)
    # Kimi-Linear: the MLA layers' latent pool inside SGLang's HybridLinearKVPool (local ids 0..n-1)
    ids = _attention_layer_ids(kvc)
    inner = build_latent_pool(kvc, size, config, max_reqs, len(ids), 0, len(ids) - 1)
    mc = kvc.model_config
    pool = _hybrid_linear_pool(kvc, inner, ids, size, req_to_token_pool, 1, mc.kv_lora_rank + mc.qk_rope_head_dim,
                               use_mla=True, kv_lora_rank=mc.kv_lora_rank, qk_rope_head_dim=mc.qk_rope_head_dim)
    logger.info("sglang-oscar: the INT2 latent pool holds the %d MLA layers; %d linear-attention layers keep "
                "SGLang's state pool", len(ids), li.num_effective_layers - len(ids))
    return pool


def build_latent_pool(kvc, size: int, config, max_reqs: int, layer_num: int, start_layer: int, end_layer: int):
    """The INT2 latent pool of an MLA model's ``layer_num`` MLA layers (``KVCacheConfigurator._build_mla_kv_pool``'s
    arguments; ``start_layer`` / ``end_layer``: SGLang's ``layer_info`` bounds (end exclusive, as SGLang passes
    them to its own pool), or 0 / n-1 inside a linear-attention hybrid's pool)."""
    from ..pool.dsa_pool import OscarDSALatentPool
    from ..pool.latent_pool import OscarMLATokenToKVPool
    from ..pool.sizing import hp_row_bytes, sink_rows_for

    mc = kvc.model_config
    index = dsa_index_head_dim(kvc)
    cls, extra = (OscarDSALatentPool, dict(index_head_dim=index)) if index else (OscarMLATokenToKVPool, {})
    pool = cls(
        size, page_size=kvc.server_args.page_size, dtype=torch.uint8, kv_lora_rank=mc.kv_lora_rank,
        qk_rope_head_dim=mc.qk_rope_head_dim, layer_num=layer_num, device=kvc.device,
        enable_memory_saver=kvc.server_args.enable_memory_saver, start_layer=start_layer,
        end_layer=end_layer, oscar_config=config, hp_dtype=kvc.model_dtype, max_reqs=max_reqs,
        sink_rows=sink_rows_for(config, max_reqs), **extra)
    logger.info("sglang-oscar: INT2 MLA latent pool: %d slots x %d layers, %d B/token (c_kv %d INT2 + k_pe %d "
                "BF16%s; BF16 MLA: %d); BF16 windows %.2f GiB (%d sink rows, %d ring rows)", pool.size, pool.layer_num,
                pool.int2_bytes_per_token(), mc.kv_lora_rank, mc.qk_rope_head_dim,
                f" + DSA index key {index} FP8" if index else "",
                hp_row_bytes(1, mc.kv_lora_rank, mc.qk_rope_head_dim, pool.layer_num, pool.hp_dtype)
                + dsa_index_bytes(kvc, pool.layer_num),
                pool.hp_bytes() / 2**30, pool.windows.sink_rows, pool.windows.num_rows - pool.windows.sink_rows)
    return pool


def expanded_bytes(kvc, config, num_layers: int) -> dict[str, int]:
    """Bytes per token on this rank over ``num_layers`` layers, for the startup log: ``int2`` (expanded INT2
    rows), ``bf16`` (the same rows in the model dtype), ``bf16_latent`` (SGLang's BF16 latent pool) and
    ``int2_latent`` (the latent pool's, ``--oscar-mla-storage latent``; 0 when the group size does not divide
    ``kv_lora_rank``)."""
    from ..pool.sizing import hp_row_bytes, int2_cell_size, latent_cell_size

    heads, dk, dv = expanded_geometry(kvc)
    mc = kvc.model_config
    try:
        latent = latent_cell_size(config, mc.kv_lora_rank, mc.qk_rope_head_dim, num_layers, kvc.model_dtype)
    except ValueError:
        latent = 0
    return dict(int2=int2_cell_size(config, heads, dk, dv, num_layers),
                bf16=hp_row_bytes(heads, dk, dv, num_layers, kvc.model_dtype),
                bf16_latent=hp_row_bytes(1, mc.kv_lora_rank, mc.qk_rope_head_dim, num_layers, kvc.model_dtype),
                int2_latent=latent)


def build_expanded_pool(kvc, size: int, config, max_reqs: int):
    """The INT2 MHA pool of expanded storage: this rank's ``heads`` x K / V rows (:func:`expanded_geometry`)
    for SGLang's ``layer_info`` range, with its BF16 windows; logs its bytes per token against the BF16
    expanded and latent pools and the INT2 latent one."""
    from ..pool.int2_pool import OscarMHATokenToKVPool
    from ..pool.sizing import sink_rows_for

    heads, dk, dv = expanded_geometry(kvc)
    li, sa = kvc.layer_info, kvc.server_args
    pool = OscarMHATokenToKVPool(
        size, page_size=sa.page_size, dtype=torch.uint8, head_num=heads, head_dim=dk, v_head_dim=dv,
        layer_num=li.num_effective_layers, device=kvc.device, enable_memory_saver=sa.enable_memory_saver,
        start_layer=li.start_layer, end_layer=li.end_layer, enable_alt_stream=not sa.enable_pdmux,
        oscar_config=config, hp_dtype=kvc.model_dtype, max_reqs=max_reqs, sink_rows=sink_rows_for(config, max_reqs))
    b = expanded_bytes(kvc, config, pool.layer_num)
    logger.info("sglang-oscar: INT2 MLA expanded pool: %d slots x %d layers x %d heads (K %d / V %d), %d B/token INT2 "
                "(BF16 expanded: %d; BF16 latent: %d; INT2 latent, --oscar-mla-storage latent: %d, %.1fx less); BF16 "
                "windows %.2f GiB (%d sink rows, %d ring rows)", pool.size, pool.layer_num, heads, dk, dv,
                pool.int2_bytes_per_token(), b["bf16"], b["bf16_latent"], b["int2_latent"],
                pool.int2_bytes_per_token() / max(b["int2_latent"], 1), pool.hp_bytes() / 2**30,
                pool.windows.sink_rows, pool.windows.num_rows - pool.windows.sink_rows)
    return pool


def around_mla_dispatch(original_fn, self, forward_batch, *args, **kwargs):
    """``DeepseekV2AttentionMLA.dispatch_attn_forward_method`` for every forward of an int2 server: absorbed
    ``MLA`` over the latent pool (SGLang's Triton handler runs a prefill without prefix as non-absorbed MHA,
    which writes BF16 latent rows the INT2 pool refuses and never reads the cache), plain ``MHA`` over the
    expanded pool (the backend's ``prepare_prefill_qkv`` builds per-head K/V in every mode; never the
    chunked / one-shot MHA methods, whose ``attn_mha`` calls pass prefix rows). Other servers: SGLang's choice."""
    from . import serving

    method = original_fn(self, forward_batch, *args, **kwargs)  # also sets current_attention_backend
    if serving._ACTIVE["recent"] is None:
        return method
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    return AttnForwardMethod.MHA if serving._ACTIVE.get("mla_storage") == EXPANDED else AttnForwardMethod.MLA
