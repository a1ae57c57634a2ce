"""Hooks that wire the INT2 pool and attention backend into SGLang (scheduler-side).

Each hook passes through unchanged unless the server runs ``--kv-cache-dtype int2``:

* ``kv_cache_dtype.configure_kv_cache_dtype`` (AROUND): ``int2`` -> logical dtype ``uint8`` (so
  bf16-only fused KV writes switch themselves off);
* ``models.utils.enable_fused_set_kv_buffer`` (AROUND): ``False`` with the INT2 pool;
* ``DefaultPoolConfigurator._compute_cell_size`` (AROUND) and ``HybridSWAPoolConfigurator.__init__``
  (AFTER): the packed INT2 bytes per token (per layer kind for hybrid sliding-window models, the
  INT2 latent + BF16 ``k_pe`` or the expanded per-head K/V rows for MLA models, :mod:`.mla_serving`);
* ``KVCacheConfigurator._resolve_memory_pool_config`` (AROUND): reserve the BF16 windows and
  bound ``max_running_requests`` (:func:`~sglang_oscar.pool.sizing.plan_windows`), log both budgets;
* ``KVCacheConfigurator._build_token_to_kv_pool`` (AROUND): build
  :class:`~sglang_oscar.pool.int2_pool.OscarMHATokenToKVPool` for MHA/GQA models,
  :class:`~sglang_oscar.pool.swa_pool.OscarSWAKVPool` for hybrid sliding-window ones,
  :class:`~sglang_oscar.pool.latent_pool.OscarMLATokenToKVPool` for MLA ones
  (:class:`~sglang_oscar.pool.dsa_pool.OscarDSALatentPool` for DSA ones: GLM-5; an
  ``OscarMHATokenToKVPool`` of per-head K/V with ``--oscar-mla-storage expanded``; :mod:`.mla_serving`),
  :class:`~sglang_oscar.pool.minimax_pool.OscarMiniMaxSparseKVPool` for MiniMax-M3 (:mod:`.minimax_serving`);
* ``DeepseekV2AttentionMLA.dispatch_attn_forward_method`` (AROUND, :mod:`.mla_serving`): absorbed MLA for
  every forward (plain MHA with ``--oscar-mla-storage expanded``);
* ``TokenToKVPoolAllocator.free`` / ``.clear`` (AROUND / AFTER), and the paged allocator's of DSA
  models: freed slots (whole pages) return their sink rows;
* ``overrides._dsa_kv_cache_dtype_default`` (AROUND): keeps ``int2`` (SGLang's DSA defaults assert
  BF16 / FP8);
* ``Req._compute_max_prefix_len`` (AROUND): radix matches stop ``recent`` tokens before the end of
  the prompt, so a reused prefix never covers positions a fresh run reads from its BF16 ring;
* ``Req.init_next_round_input`` (AFTER): under SGLang's mamba radix cache, the prefill's recurrent state
  is tracked before that cap, so a repeated prompt can hit;
* ``Scheduler.get_next_batch_to_run`` (BEFORE): evict radix leaves when the sink arena runs low;
* ``WeightUpdater.update_weights_from_*`` / ``init_weights_update_group`` (AROUND): refused with
  ``(False, reason)`` when ``--oscar-fold-rotations on`` folded value rotations into the weights;
* ``ATTENTION_BACKENDS["triton"]`` / ``["dsa"]`` (registry entries): :class:`OscarTritonAttnBackend`
  for int2 (:class:`OscarTritonLatentBackend` over the latent pool, :class:`OscarExpandedMLABackend`
  over an MLA model's expanded pool, :class:`OscarDSALatentBackend` for DSA models);
* ``attention_registry.attn_backend_wrapper`` (AROUND, :mod:`.minimax_serving`): MiniMax-M3's sparse
  layers run :class:`~sglang_oscar.backend.minimax_backend.OscarMiniMaxSparseBackend` under SGLang's hybrid.
"""

from __future__ import annotations

import logging

import torch

from .minimax_serving import MINIMAX_HOOK_TARGETS, is_minimax_kvc, minimax_index_bytes_of
from .mla_serving import EXPANDED, build_mla_pool, dsa_index_bytes, expanded_bytes, mla_cell_size, mla_kv_group

logger = logging.getLogger("sglang_oscar")

INT2 = "int2"
_MP = "sglang.srt.mem_cache"
SERVING_HOOK_TARGETS = (
    f"{_MP}.kv_cache_dtype.configure_kv_cache_dtype",
    "sglang.srt.models.utils.enable_fused_set_kv_buffer",
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
    f"{_MP}.kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config",
    f"{_MP}.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool",
    f"{_MP}.allocator.token.TokenToKVPoolAllocator.free",
    f"{_MP}.allocator.token.TokenToKVPoolAllocator.clear",
    "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len",
    "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
    "sglang.srt.model_executor.pool_configurator.HybridSWAPoolConfigurator.__init__",
    "sglang.srt.models.deepseek_v2.DeepseekV2AttentionMLA.dispatch_attn_forward_method",
    "sglang.srt.managers.schedule_batch.Req.init_next_round_input",
)
# In-place weight updates (RL / online updates): refused for a model whose value rotations are folded
# into its weights (--oscar-fold-rotations on), which a reload would silently unfold.
_WU = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
WEIGHT_UPDATE_METHODS = ("init_weights_update_group", "update_weights_from_disk", "update_weights_from_tensor",
                         "update_weights_from_distributed", "update_weights_from_ipc")
WEIGHT_UPDATE_HOOK_TARGETS = tuple(f"{_WU}.{m}" for m in WEIGHT_UPDATE_METHODS)
SERVING_HOOK_TARGETS = SERVING_HOOK_TARGETS + WEIGHT_UPDATE_HOOK_TARGETS
# DSA models (GLM-5): SGLang runs them with page size 64 (a paged allocator) and asserts a BF16 / FP8
# KV dtype in its DSA defaults pass (called through the module attribute at its legacy slot).
DSA_HOOK_TARGETS = (f"{_MP}.allocator.paged.PagedTokenToKVPoolAllocator.free",
                    f"{_MP}.allocator.paged.PagedTokenToKVPoolAllocator.clear",
                    "sglang.srt.arg_groups.overrides._dsa_kv_cache_dtype_default")
SERVING_HOOK_TARGETS = SERVING_HOOK_TARGETS + DSA_HOOK_TARGETS
# MiniMax-M3: SGLang's attention wrapper builds its sparse backend over the main pool (minimax_serving)
SERVING_HOOK_TARGETS = SERVING_HOOK_TARGETS + MINIMAX_HOOK_TARGETS

# Set in the scheduler process when the INT2 pool is built: the recent window that radix
# matches must leave to be recomputed (None = not serving int2 in this process), and what an MLA
# model's pool stores ("latent" / "expanded"; None for other models), which the MLA dispatch hook reads.
_ACTIVE = {"recent": None, "mla_storage": None}


def _is_int2(server_args) -> bool:
    return getattr(server_args, "kv_cache_dtype", None) == INT2


def _config(server_args):
    from . import oscar_config_of

    return oscar_config_of(server_args)


# ---------------------------------------------------------------------------------- dtype
def around_configure_kv_cache_dtype(original_fn, *args, **kwargs):
    """``configure_kv_cache_dtype``: an int2 launch stores uint8 codes (SGLang knows no ``int2`` dtype)."""
    if kwargs.get("server_args_kv_cache_dtype") == INT2:
        return None, torch.uint8
    return original_fn(*args, **kwargs)


def around_enable_fused_set_kv_buffer(original_fn, *args, **kwargs):
    """``enable_fused_set_kv_buffer``: off while an INT2 pool serves, whose writes quantize through
    ``set_kv_buffer`` (a fused RoPE + BF16 write would skip them)."""
    if _ACTIVE["recent"] is not None:
        return False
    return original_fn(*args, **kwargs)


# ---------------------------------------------------------------------------------- sizing
def _geometry(kvc):
    from sglang.srt.runtime_context import get_parallel

    mc = kvc.model_config
    heads = mc.get_num_kv_heads(get_parallel().attn_tp_size)
    return heads, mc.head_dim, mc.v_head_dim


def _swa_geometry(kvc):
    """``(kv heads, head_dim, v_head_dim)`` of the sliding layers of a hybrid model, as
    ``_build_hybrid_swa_kv_pool`` sizes its sliding pool (its own geometry only for the models
    SGLang marks ``is_hybrid_swa_compress``, e.g. Gemma-4; else the full layers')."""
    from sglang.srt.runtime_context import get_parallel

    if not kvc.is_hybrid_swa_compress:
        return _geometry(kvc)
    mc = kvc.model_config
    heads = max(1, mc.hf_text_config.swa_num_key_value_heads // get_parallel().attn_tp_size)
    return heads, mc.swa_head_dim, mc.swa_v_head_dim


def _skip(kvc) -> str:
    """The kind ``--oscar-skip-layers`` keeps BF16 (``"none"``, ``"sliding"``, ``"full"``;
    :func:`sglang_oscar.plugin.skip_kind`, checked at launch)."""
    from . import skip_kind
    from ..backend.rotations import model_geometry

    hf = kvc.model_config.hf_config
    return skip_kind(_config(kvc.server_args), model_geometry(hf), hf)


def _attention_layer_ids(kvc) -> list[int]:
    """Global ids of this rank's layers that have a KV cache: all of them, or the full-attention
    layers of a linear-attention hybrid (``mambaish_config``, as SGLang's own configurator counts)."""
    start, end = kvc.layer_info.start_layer, kvc.layer_info.end_layer
    if kvc.mambaish_config is not None:
        return [i for i in kvc.mambaish_config.full_attention_layer_ids if start <= i < end]
    return list(range(start, start + kvc.layer_info.num_effective_layers))


def _kv_groups(kvc) -> list[tuple[str, int, int, int, int]]:
    """``(kind, layers, kv heads, head_dim, v_head_dim)`` of each pool of the model: one ``"all"``
    group, ``"full"`` and ``"sliding"`` for a hybrid sliding-window model, or for an MLA model one
    ``"latent"`` group ``(1 head, kv_lora_rank, qk_rope_head_dim)`` (a window row is ``[c_kv | k_pe]``) or
    one ``"expanded"`` group ``(heads per rank, K, V)`` (:func:`.mla_serving.mla_kv_group`)."""
    if kvc.use_mla_backend:
        return [mla_kv_group(kvc, len(_attention_layer_ids(kvc)))]
    if not kvc.is_hybrid_swa:
        return [("all", len(_attention_layer_ids(kvc)), *_geometry(kvc))]
    mc = kvc.model_config
    return [("full", len(mc.full_attention_layer_ids), *_geometry(kvc)),
            ("sliding", len(mc.swa_attention_layer_ids), *_swa_geometry(kvc))]


def around_compute_cell_size(original_fn, self, kvc, num_layers, *args, **kwargs):
    """``DefaultPoolConfigurator._compute_cell_size``: bytes per token of the INT2 pool (codes + pairs),
    so ``max_total_num_tokens`` reflects what the pool really holds."""
    if not _is_int2(kvc.server_args):
        return original_fn(self, kvc, num_layers, *args, **kwargs)
    from ..pool.sizing import int2_cell_size

    if kvc.use_mla_backend:
        return mla_cell_size(kvc, num_layers)
    heads, d, dv = _geometry(kvc)
    if is_minimax_kvc(kvc):  # INT2 main K/V of the local layers + SGLang's BF16 index pools
        from .minimax_serving import minimax_cell_size

        return minimax_cell_size(kvc, _config(kvc.server_args), heads, d, dv)
    return int2_cell_size(_config(kvc.server_args), heads, d, dv, num_layers)


def after_hybrid_swa_configurator_init(result, self, kvc, *args, **kwargs):
    """INT2 bytes per token of each layer kind of a hybrid sliding-window model, and the cell size
    SGLang's ``HybridSWAPoolConfigurator`` derives from them (its formula, with INT2 per-token bytes:
    full layers count once per full token, sliding ones ``--swa-full-tokens-ratio`` times). The kind
    ``--oscar-skip-layers`` names is a model-dtype sub-pool (:class:`~..pool.swa_pool.OscarSWAKVPool`):
    SGLang counted it at the 1-byte element of the int2 server's ``uint8`` KV dtype, so it is recounted."""
    if not _is_int2(kvc.server_args):
        return result
    from ..pool.sizing import hp_row_bytes, int2_cell_size

    config = _config(kvc.server_args)
    skip = _skip(kvc)

    def per_token(kind, geometry):
        return hp_row_bytes(*geometry, 1, kvc.model_dtype) if skip == kind else int2_cell_size(config, *geometry, 1)

    self._full_per_token = per_token("full", _geometry(kvc))
    self._swa_per_token = per_token("sliding", _swa_geometry(kvc))
    swa_layers = self._swa_layers_num + self._draft_swa_full_layers_num
    if self._full_layers_num == 0:
        self._cell_size = self._swa_per_token * swa_layers + self._full_per_token * self._draft_full_layers_num
    else:
        self._cell_size = (self._full_per_token * (self._full_layers_num + self._draft_full_layers_num)
                           + self._swa_per_token * self._draft_swa_full_layers_num
                           + self._swa_full_tokens_ratio * self._swa_per_token * self._swa_layers_num)
    return result


def around_resolve_memory_pool_config(original_fn, self, pre_model_load_memory, *args, **kwargs):
    """``KVCacheConfigurator._resolve_memory_pool_config``: takes the BF16 sink/recent windows' bytes out of
    the budget before SGLang sizes the token pool (:func:`~sglang_oscar.pool.sizing.plan_windows`)."""
    if not _is_int2(self.server_args):
        return original_fn(self, pre_model_load_memory, *args, **kwargs)
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    from ..pool.sizing import WINDOW_BUDGET_SHARE, hp_row_bytes, int2_cell_size, latent_cell_size, plan_windows

    config = _config(self.server_args)
    groups = _kv_groups(self)
    skip = _skip(self) if self.is_hybrid_swa else "none"
    available = self._profile_available_bytes(pre_model_load_memory)
    # a BF16 window row holds one token of every INT2 layer (the windows are shared by the pools)
    row = sum(hp_row_bytes(h, d, dv, n, self.model_dtype) for kind, n, h, d, dv in groups if kind != skip)
    plan = plan_windows(config, available, row, self.server_args.max_running_requests)
    pool_config = self.config_from_budget(plan.int2_budget)
    pool_config.max_running_requests = min(self.resolve_max_num_reqs(pool_config.max_total_num_tokens),
                                           plan.max_running_requests)
    pool_config = create_memory_pool_configurator(self).finalize_with_max_running_requests(pool_config)
    pool_config.mem_fraction_static = self.server_args.mem_fraction_static
    if plan.reduced_from is not None:
        logger.warning("sglang-oscar: --max-running-requests %d reduced to %d so the BF16 windows fit in %.0f%% "
                       "of the KV budget", plan.reduced_from, plan.max_running_requests, 100 * WINDOW_BUDGET_SHARE)
    for kind, n, h, d, dv in groups:
        tokens = (pool_config.swa_max_total_num_tokens if kind == "sliding" else
                  pool_config.full_max_total_num_tokens if kind == "full" else pool_config.max_total_num_tokens)
        # the DSA indexer's keys and MiniMax-M3's index pools stay as SGLang keeps them
        index = (dsa_index_bytes(self, n) if kind == "latent" else minimax_index_bytes_of(self) if kind == "all"
                 else 0)
        bf16 = hp_row_bytes(h, d, dv, n, self.model_dtype) + index
        cell = (bf16 if kind == skip else latent_cell_size(config, d, dv, n, self.model_dtype) + index
                if kind == "latent" else int2_cell_size(config, h, d, dv, n) + index)
        latent = expanded_bytes(self, config, n) if kind == EXPANDED else None  # what the latent would cost
        if index and kind == "all":
            from .minimax_serving import log_minimax_sizes

            log_minimax_sizes(self, config, h, d, dv, tokens)
        logger.info("sglang-oscar: %s KV cache%s: %d bytes/token (BF16: %d, %.2fx fewer); tokens: %d (%.2f GiB)",
                    "BF16 (--oscar-skip-layers)" if kind == skip else "INT2",
                    (", MiniMax-M3 main K/V + BF16 index pools" if index else "") if kind == "all"
                    else f", MLA latent ({n} layers x c_kv {d} + k_pe {dv}"
                    f"{' + DSA index key' if index else ''})" if kind == "latent"
                    else f", MLA expanded ({n} layers x {h} heads x K {d} / V {dv}; BF16 latent "
                    f"{latent['bf16_latent']}, INT2 latent {latent['int2_latent']})" if kind == EXPANDED
                    else f", {kind} layers ({n} x {h} kv heads x {d}/{dv})",
                    cell, bf16, bf16 / max(cell, 1), tokens or 0, (tokens or 0) * cell / 2**30)
    logger.info("sglang-oscar: BF16 windows (sink %d + recent %d per request, %d requests): %.2f GiB",
                config.sink_tokens, config.recent_tokens, pool_config.max_running_requests, plan.window_bytes / 2**30)
    return pool_config


# ---------------------------------------------------------------------------------- pool
def around_build_token_to_kv_pool(original_fn, self, *args, **kwargs):
    """``KVCacheConfigurator._build_token_to_kv_pool``: builds the INT2 pool (MHA, hybrid sliding-window or
    latent) in place of SGLang's BF16 one."""
    if not _is_int2(self.server_args):
        return original_fn(self, *args, **kwargs)
    from ..pool.int2_pool import OscarMHATokenToKVPool
    from ..pool.sizing import sink_rows_for
    from ..pool.swa_pool import OscarSWAKVPool

    sizes = kwargs["sizes"]
    req_to_token_pool = kwargs["req_to_token_pool"]
    arch = getattr(self.model_config.hf_config, "architectures", None)
    unsupported = [name for name, flag in (
        ("only sliding-window layers in its hybrid pool",
         self.is_hybrid_swa and not self.model_config.full_attention_layer_ids),
        ("a draft model (speculative decoding)", self.is_draft_worker)) if flag]
    if unsupported:
        raise ValueError(f"--kv-cache-dtype int2 does not serve {arch}: it uses {', '.join(unsupported)}; "
                         f"serve it with --kv-cache-dtype auto")
    config = _config(self.server_args)
    max_reqs = req_to_token_pool.req_to_token.shape[0]
    if self.use_mla_backend:
        pool = build_mla_pool(self, sizes.max_total_num_tokens, config, max_reqs, req_to_token_pool)
        _ACTIVE["recent"], _ACTIVE["mla_storage"] = config.recent_tokens, config.mla_storage
        return pool
    heads, head_dim, v_head_dim = _geometry(self)
    common = dict(page_size=self.server_args.page_size, dtype=torch.uint8, head_num=heads, head_dim=head_dim,
                  v_head_dim=v_head_dim, device=self.device, oscar_config=config, hp_dtype=self.model_dtype,
                  max_reqs=max_reqs, sink_rows=sink_rows_for(config, max_reqs))
    if is_minimax_kvc(self):  # INT2 main K/V of every layer + SGLang's BF16 index pools of the sparse ones
        from .minimax_serving import build_minimax_pool

        pool = build_minimax_pool(self, sizes.max_total_num_tokens, common)
    elif self.is_hybrid_swa:
        swa_heads, swa_dim, swa_v_dim = _swa_geometry(self)
        pool = OscarSWAKVPool(
            size=sizes.full_max_total_num_tokens, size_swa=sizes.swa_max_total_num_tokens,
            swa_attention_layer_ids=self.model_config.swa_attention_layer_ids,
            full_attention_layer_ids=self.model_config.full_attention_layer_ids,
            swa_head_num=swa_heads, swa_head_dim=swa_dim, swa_v_head_dim=swa_v_dim, skip=_skip(self), **common)
        full, swa = pool.int2_bytes_per_token()
        logger.info("sglang-oscar: hybrid pool (BF16 kind: %s): full %d slots x %d layers (%d B/token), sliding %d "
                    "slots x %d layers (%d B/token); BF16 windows %.2f GiB (%d sink rows, %d ring rows)", pool.skip,
                    pool.size,
                    pool.full_layer_nums, full, pool.size_swa, pool.swa_layer_nums, swa, pool.hp_bytes() / 2**30,
                    pool.windows.sink_rows, pool.windows.num_rows - pool.windows.sink_rows)
    elif self.mambaish_config is not None:
        ids = _attention_layer_ids(self)
        inner = OscarMHATokenToKVPool(
            sizes.max_total_num_tokens, layer_num=len(ids), enable_memory_saver=self.server_args.enable_memory_saver,
            enable_alt_stream=not self.server_args.enable_pdmux, **common)
        pool = _hybrid_linear_pool(self, inner, ids, sizes.max_total_num_tokens, req_to_token_pool, heads, head_dim)
        logger.info("sglang-oscar: INT2 pool of the %d attention layers (%d linear-attention layers keep SGLang's "
                    "state pool): %d slots, %d B/token INT2; BF16 windows %.2f GiB", len(ids),
                    self.layer_info.num_effective_layers - len(ids), inner.size, inner.int2_bytes_per_token(),
                    inner.hp_bytes() / 2**30)
    else:
        pool = OscarMHATokenToKVPool(
            sizes.max_total_num_tokens, layer_num=self.layer_info.num_effective_layers,
            enable_memory_saver=self.server_args.enable_memory_saver, start_layer=self.layer_info.start_layer,
            end_layer=self.layer_info.end_layer, enable_alt_stream=not self.server_args.enable_pdmux, **common)
        logger.info("sglang-oscar: INT2 pool: %d slots x %d layers, %d B/token INT2; BF16 windows %.2f GiB "
                    "(%d sink rows, %d ring rows)", pool.size, pool.layer_num, pool.int2_bytes_per_token(),
                    pool.hp_bytes() / 2**30, pool.windows.sink_rows, pool.windows.num_rows - pool.windows.sink_rows)
    _ACTIVE["recent"], _ACTIVE["mla_storage"] = config.recent_tokens, None
    return pool


def _hybrid_linear_pool(self, inner, ids: list[int], size: int, req_to_token_pool, head_num: int, head_dim: int,
                        **mla):
    """SGLang's ``HybridLinearKVPool`` (as :class:`~sglang_oscar.pool.linear_pool.OscarHybridLinearKVPool`)
    around the INT2 pool ``inner`` of the attention layers ``ids``; its state pool is SGLang's.

    Args:
        self: SGLang's ``KVCacheConfigurator`` (the pool hook's ``self``: server args, device, layers).
        inner: the INT2 MHA or latent pool of the ``len(ids)`` attention layers (local ids 0..n-1).
        ids: global ids of the attention layers; size: token slots; req_to_token_pool: SGLang's
            (its ``mamba_pool`` holds the linear layers' state).
        head_num, head_dim: what SGLang's pool reports (1 and ``R + P`` for a latent pool).
        **mla: ``use_mla``, ``kv_lora_rank``, ``qk_rope_head_dim`` for a latent pool.
    """
    from ..pool.linear_pool import OscarHybridLinearKVPool

    return OscarHybridLinearKVPool(
        full_kv_pool=inner, size=size, dtype=torch.uint8, page_size=self.server_args.page_size, head_num=head_num,
        head_dim=head_dim, full_attention_layer_ids=ids, device=self.device, mamba_pool=req_to_token_pool.mamba_pool,
        start_layer=self.layer_info.start_layer, **mla)


def _owned_windows(allocator):
    """The :class:`~sglang_oscar.pool.windows.HPWindows` keyed by this allocator's slots, or ``None``
    (not an INT2 pool, or the sliding sub-pool of a hybrid model: its slots are another index space)."""
    kvcache = allocator.get_kvcache()
    return kvcache.windows if getattr(kvcache, "owns_windows", False) else None


def around_allocator_free(original_fn, self, free_index, *args, **kwargs):
    """``TokenToKVPoolAllocator.free``: freed slots (whole pages for a paged allocator) return their sink rows."""
    windows = _owned_windows(self)
    if windows is not None and self.is_not_in_free_group and free_index is not None and free_index.numel():
        # SGLang usually passes a view of req_to_token and rewrites it right after the free
        # (cache_unfinished_req): copy now, on the current stream, before that happens.
        page = getattr(self, "page_size", 1)
        if page > 1:  # a paged allocator frees the whole page of every index it is given
            pages = torch.unique(free_index // page)
            free_slots = (pages[:, None] * page + torch.arange(page, device=pages.device)).reshape(-1)
        else:
            free_slots = free_index.clone()
        windows.release(free_slots)
    return original_fn(self, free_index, *args, **kwargs)


def after_allocator_clear(result, self, *args, **kwargs):
    """``TokenToKVPoolAllocator.clear``: empties the BF16 windows with the pool."""
    windows = _owned_windows(self)
    if windows is not None:
        windows.reset()
    return result


def around_dsa_kv_cache_dtype_default(original_fn, view, *args, **kwargs):
    """SGLang's DSA defaults pass (``arg_groups/overrides.py``) asserts a BF16 / FP8 KV dtype: an int2
    server keeps ``int2`` (its latent pool is the INT2 one; the indexer's key buffer stays FP8)."""
    if getattr(view, "kv_cache_dtype", None) == INT2:
        return {}
    return original_fn(view, *args, **kwargs)


# ---------------------------------------------------------------------------------- radix cap
def around_compute_max_prefix_len(original_fn, self, input_len, *args, **kwargs):
    """``Req._compute_max_prefix_len``: a radix match stops ``recent`` tokens before the prompt's end, so a
    reused prefix never covers positions a fresh run reads from its BF16 ring (docs/design.md, radix cap)."""
    limit = original_fn(self, input_len, *args, **kwargs)
    recent = _ACTIVE["recent"]
    if recent is None:
        return limit
    return max(0, min(limit, input_len - recent))


def after_init_next_round_input(result, req, tree_cache=None, *args, **kwargs):
    """``Req.init_next_round_input`` (AFTER): under SGLang's mamba radix cache (linear-attention hybrids:
    Qwen3-Next, Qwen3.5, Kimi-Linear; ``extra_buffer`` strategy) track the prefill's recurrent state at the
    last chunk-aligned position before the radix cap, not at the prompt's end.

    SGLang keeps one state per prefill at ``prefix + (extend_len // chunk) * chunk`` (``chunk`` =
    ``server_args.mamba_cache_chunk_size``, 64) and a match must end on a node holding a state; our cap
    (``input_len - recent``) usually falls before that point, where a repeated prompt would match nothing. The
    point is handed over as SGLang's own ``mamba_branching_seqlen``, which its ``prepare_for_extend``
    tracks instead of the end; a branching point SGLang chose itself past the matched prefix (a prefix
    shared with a cached request) is kept. The state moves up to one chunk earlier than SGLang's, so a
    later request that extends this prompt (a next turn) may match up to ``chunk`` fewer tokens.
    Returns ``result`` unchanged.
    """
    recent = _ACTIVE["recent"]
    supports_mamba = getattr(tree_cache, "supports_mamba", None)
    if recent is None or supports_mamba is None or not supports_mamba():
        return result
    prefix = len(req.prefix_indices)
    # SGLang's point past the matched state is tracked as it is (it lies at or before the cap); one
    # at the prefix itself is ignored by SGLang (it tracks only points past the prefix), so ours replaces it
    if req.mamba_branching_seqlen is not None and req.mamba_branching_seqlen > prefix:
        return result
    from sglang.srt.runtime_context import get_server_args

    server_args = get_server_args()
    if not server_args.enable_mamba_extra_buffer():
        return result
    chunk = server_args.mamba_cache_chunk_size
    point = prefix + (len(req.full_untruncated_fill_ids) - recent - prefix) // chunk * chunk
    if point > prefix:
        req.mamba_branching_seqlen = point
    return result


def before_get_next_batch_to_run(*args, **kwargs):
    """Tier-aware eviction: free radix-cache leaves when the BF16 sink arena runs low."""
    sched = args[0] if args else None
    alloc = getattr(sched, "token_to_kv_pool_allocator", None)
    windows = None if alloc is None else getattr(alloc.get_kvcache(), "windows", None)  # a composite pool's shared ones
    if windows is not None and getattr(sched, "tree_cache", None) is not None:
        n = windows.maybe_reclaim(sched.tree_cache)
        if n:
            logger.info("sglang-oscar: BF16 sink arena low (%d rows free); evicted %d cached tokens",
                        int(windows.host_free), n)
    return None


# ---------------------------------------------------------------------------------- weight updates
def around_weight_update(original_fn, self, *args, **kwargs):
    """``WeightUpdater.update_weights_from_*`` / ``init_weights_update_group``: ``(False, reason)``
    when the model holds folded value rotations (SGLang returns the pair to the caller and logs
    it; the server keeps running on its folded weights), else the original."""
    from ..backend.fold import folded_layer_ids

    get_model = getattr(self, "get_model", None)
    folded = folded_layer_ids(get_model() if get_model is not None else None)
    if not folded:
        return original_fn(self, *args, **kwargs)
    name = getattr(original_fn, "__name__", "weight update")
    return False, (f"{name}: this int2 server runs with --oscar-fold-rotations on: the value rotations of "
                   f"{len(folded)} layers are folded into qkv_proj / o_proj, and weights loaded in place would "
                   "be unfolded under a backend that reads them as folded; restart the server with the new "
                   "weights, or with --oscar-fold-rotations off to update weights in place")


# ---------------------------------------------------------------------------------- backend
def install_backend_factory() -> None:
    """Replace ``ATTENTION_BACKENDS["triton"]`` and ``["dsa"]`` by factories that build the OSCAR backends
    for int2 servers and the original backends otherwise (idempotent)."""
    from sglang.srt.layers.attention import attention_registry

    backends = attention_registry.ATTENTION_BACKENDS
    original = backends["triton"]
    if not getattr(original, "_oscar", False):
        def create_triton_backend(runner):
            if _is_int2(runner.server_args):
                from ..backend.latent_backend import OscarTritonLatentBackend
                from ..backend.triton_backend import OscarTritonAttnBackend
                from ..pool.int2_pool import OscarMHATokenToKVPool
                from ..pool.latent_pool import OscarMLATokenToKVPool

                pool = runner.token_to_kv_pool
                if isinstance(getattr(pool, "full_kv_pool", pool), OscarMLATokenToKVPool):
                    return OscarTritonLatentBackend(runner)
                # an MLA model's INT2 MHA pool holds its expanded per-head K/V (--oscar-mla-storage expanded)
                if getattr(runner, "use_mla_backend", False) and isinstance(pool, OscarMHATokenToKVPool):
                    from ..backend.expanded_backend import OscarExpandedMLABackend

                    return OscarExpandedMLABackend(runner)
                return OscarTritonAttnBackend(runner)
            return original(runner)

        create_triton_backend._oscar = True
        backends["triton"] = create_triton_backend
    original_dsa = backends.get("dsa")
    if original_dsa is not None and not getattr(original_dsa, "_oscar", False):
        def create_dsa_backend(runner):
            if _is_int2(runner.server_args):
                from ..backend.dsa_backend import OscarDSALatentBackend

                return OscarDSALatentBackend(runner)
            return original_dsa(runner)

        create_dsa_backend._oscar = True
        backends["dsa"] = create_dsa_backend
