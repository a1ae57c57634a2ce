"""``OscarTritonAttnBackend``: SGLang's Triton attention backend over the INT2 pool.

Inherits every piece of metadata and CUDA-graph plumbing of ``TritonAttnBackend`` and replaces
the two forward paths:

* rotate per layer and kv head -- ``q R_k`` (fp32), ``k R_k`` and ``v R_v`` (fp32, rounded to
  the model dtype as the oracle's HP tier) -- write the rotated K/V into the pool (INT2 at the
  allocated slot, plus a BF16 copy for sink/recent positions), run the INT2 kernels, and return
  ``o R_v^T``; with a centred rotation set the rows are ``(k - mean_k) R_k`` / ``(v - mean_v) R_v``
  and the output ``o R_v^T + mean_v`` (the key mean shifts a query's scores by a constant);
* decode reads ``[BF16 sink | INT2 middle | BF16 recent]`` (window mode ``"decode"``), extend
  reads the sink in BF16 and everything else, the chunk itself included, through INT2 (window
  mode ``"extend"``), so a prompt's logits do not depend on chunking or on radix reuse;
* with ``--oscar-fold-rotations on`` the value rotation and mean of the layers in ``self.folded``
  live in ``qkv_proj`` / ``o_proj`` (:mod:`.fold`, folded once in ``__init__``): their V rows are
  written as they come and their output is returned in the rotated frame (:mod:`.step`); the layers
  of ``self.output_folded`` that are not in ``self.folded`` (Gemma-4's) fold ``o_proj`` only: V is
  rotated at run time, the output returned in the rotated frame.

The window bookkeeping of a forward (sink rows for new sink tokens, ring rows, ``hp_index`` and
``sink_lens`` of the batch's requests) runs once per forward: in ``init_forward_metadata``
(eager) or ``init_forward_metadata_in_graph`` (recorded into decode CUDA graphs); slots freed
by SGLang give their sink rows back in the out-of-graph part.

Decode attention is planned once per batch (:class:`~sglang_oscar.kernels.DecodePlan`: launch
config, engine, split counts, grid, workspace views), one plan per KV geometry group of the model's
layers (q / kv heads, head dims, logit cap on or off): in ``init_forward_metadata`` for an eager
decode batch, in ``init_forward_metadata_out_graph(in_capture=True)`` once per CUDA-graph batch size
before its capture (the plan is kept: the graph replays its launches). ``forward_decode`` then only
runs the plan of the layer's group. The stage-1 workspace is one buffer
(:class:`~sglang_oscar.kernels.DecodeWorkspace`) that every plan slices.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

from ..kernels import DecodePlan, DecodeWorkspace, ExtendPlan, GluonConfig, TritonConfig
from ..pool.int2_pool import OscarMHATokenToKVPool
from ..pool.linear_pool import OscarHybridLinearKVPool
from ..pool.minimax_pool import OscarMiniMaxSparseKVPool
from ..pool.swa_pool import OscarSWAKVPool
from .rotations import model_geometry, rank_means, rank_rotations, served_rotation_set
from .step import fold_model, rotate_inputs, rotate_output

logger = logging.getLogger("sglang_oscar")


class Geometry(NamedTuple):
    """What a decode plan is built for: one group of layers.

    ``sliding_window``: keys a query sees, its own included (HF's ``sliding_window``; SGLang's
    ``RadixAttention.sliding_window_size`` + 1), 0 for full attention. ``swa``: the layer's rows live
    in the sliding pool of an :class:`~sglang_oscar.pool.swa_pool.OscarSWAKVPool`. ``output_folded``:
    ``o_proj`` holds ``R_v`` (``--oscar-fold-rotations``), so the plans write the output in the
    model dtype (the pool's HP dtype) instead of fp32 for a rotation, saving the cast's launch.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    logit_cap: bool
    sliding_window: int = 0
    swa: bool = False
    output_folded: bool = False


def layer_geometry(layer, pool=None, output_folded: frozenset[int] = frozenset()) -> Geometry:
    """The :class:`Geometry` of an attention layer (SGLang's ``RadixAttention`` attributes; ``pool``
    says whether its rows live in a sliding pool, ``output_folded`` holds the ids of the layers whose
    ``o_proj`` took ``R_v``)."""
    sw = getattr(layer, "sliding_window_size", None)
    return Geometry(layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim,
                    bool(layer.logit_cap and layer.logit_cap > 0), sw + 1 if sw is not None and sw > -1 else 0,
                    bool(pool is not None and pool.is_swa_layer(layer.layer_id)), layer.layer_id in output_folded)


def decode_config(config):
    """The decode plans' ``config`` for ``--oscar-decode-engine`` (``config.decode_engine``): ``None``
    for ``auto`` (the kernels pick: Gluon where it applies), else the config type of that engine
    (:class:`~sglang_oscar.kernels.TritonConfig` / :class:`~sglang_oscar.kernels.GluonConfig`,
    whose defaults the plan resolves per batch)."""
    return {"auto": None, "triton": TritonConfig, "gluon": GluonConfig}[config.decode_engine]


class OscarTritonAttnBackend(TritonAttnBackend):
    """Triton attention over :class:`~sglang_oscar.pool.OscarMHATokenToKVPool` (module docstring).

    Raises:
        RuntimeError: the pool is not the INT2 pool (a hook did not apply).
        ValueError: rotation file / geometry problems (see :func:`.rotations.served_rotation_set`).
    """

    def __init__(self, model_runner, *args, **kwargs):
        pool = model_runner.token_to_kv_pool
        # MiniMax-M3's pool: this backend serves its dense layers (and owns the windows bookkeeping)
        if not isinstance(pool, (OscarMHATokenToKVPool, OscarSWAKVPool, OscarHybridLinearKVPool,
                                 OscarMiniMaxSparseKVPool)):
            raise RuntimeError(
                f"--kv-cache-dtype int2: the token pool is {type(pool).__name__}, not the INT2 pool; the "
                f"sglang-oscar pool hook did not apply (check the log for hook errors)"
            )
        super().__init__(model_runner, *args, **kwargs)
        from sglang.srt.runtime_context import get_parallel

        self.pool = pool
        self.windows = pool.windows
        self.config = pool.oscar_config
        par = get_parallel()
        geometry, rs = self._served_rotations(model_runner.model_config.hf_config, log=par.attn_tp_rank == 0)
        layer_ids = [layer.layer_id for layer in geometry.layers
                     if pool.start_layer <= layer.layer_id <= pool.end_layer and pool.is_int2_layer(layer.layer_id)]
        self.rotations = rank_rotations(rs, geometry, par.attn_tp_rank, par.attn_tp_size, model_runner.device,
                                        layer_ids)
        self.means = rank_means(rs, geometry, par.attn_tp_rank, par.attn_tp_size, model_runner.device, layer_ids)
        # --oscar-fold-rotations on: layers whose V rotation and mean live in qkv_proj / o_proj
        # (output_folded: also the layers whose o_proj alone took R_v, V rotated at run time)
        self.folded, self.output_folded = fold_model(self.config, getattr(model_runner, "model", None),
                                                     self.rotations, self.means, par)
        self._hp_rows = None
        self._missed_seen = 0
        self._int2_req_to_token = model_runner.req_to_token_pool.req_to_token
        # sliding-pool slots of each request's window positions (hybrid sliding-window pools only)
        self._swa_table = (pool.new_swa_table(self._int2_req_to_token)
                           if isinstance(pool, OscarSWAKVPool) and pool.skip != "sliding" else None)
        self._swa_loc = None
        self._decode_config = decode_config(self.config)
        self.set_geometry(layer for layer in self._model_layers(getattr(model_runner, "model", None))
                          if pool.start_layer <= layer.layer_id <= pool.end_layer and pool.is_int2_layer(layer.layer_id))

    def _served_rotations(self, hf_config, log: bool):
        """``(geometry, rotation set)`` of the layers this backend serves: the model's MHA/GQA geometry
        and :func:`.rotations.served_rotation_set` (subclasses serve another geometry of the model)."""
        geometry = model_geometry(hf_config)
        return geometry, served_rotation_set(self.config, geometry, log=log, hf_config=hf_config)

    def _model_layers(self, model) -> list:
        """The model's attention modules this backend plans for (every ``RadixAttention``-like module)."""
        return _attention_layers(model)

    # ------------------------------------------------------------------ decode plans
    def set_geometry(self, layers) -> None:
        """Group ``layers`` (objects with ``RadixAttention``'s head / dim / logit-cap attributes) by
        :class:`Geometry`: one decode plan per group and batch. Also resets the plans."""
        self._layer_geometry = {layer.layer_id: self._geometry(layer) for layer in layers}
        self._group_layer = {}
        for layer_id, geo in sorted(self._layer_geometry.items()):
            self._group_layer.setdefault(geo, layer_id)  # a layer whose buffers stand for the group's
        self._workspace = DecodeWorkspace(self.pool.device)
        # the widest window of the sliding-pool layers: the prefix positions an extend refreshes
        self._swa_window = max((g.sliding_window for g in self._layer_geometry.values() if g.swa), default=0)
        self._decode_plans = None
        self._extend_plans = None
        self._graph_plans = {}

    def _geometry(self, layer) -> Geometry:
        return layer_geometry(layer, self.pool, self.output_folded)

    def _out_dtype(self, geo: Geometry) -> torch.dtype:
        """fp32 for the output rotation, or the model dtype (= the HP dtype) for a folded ``o_proj``."""
        return self.pool.hp_dtype if geo.output_folded else torch.float32

    def plan_decode(self, forward_batch) -> dict:
        """Build the decode plans of ``forward_batch`` (one per geometry group) and make them current."""
        plans = {}
        for geo, layer_id in self._group_layer.items():
            plans[geo] = DecodePlan(
                self.pool.layout_of(layer_id), geo.num_q_heads, self.pool.int2_buffers(layer_id),
                self.windows.hp_index, self._req_to_token_of(geo), forward_batch.req_pool_indices,
                forward_batch.seq_lens, sink=self.config.sink_tokens, recent=self.config.recent_tokens,
                q_dtype=torch.float32, sink_lens=self.windows.sink_lens, sliding_window=geo.sliding_window or None,
                logit_cap=geo.logit_cap or None, out_dtype=self._out_dtype(geo),
                max_seq_len=self.max_context_len, workspace=self._workspace, config=self._decode_config)
        self._decode_plans = plans
        return plans

    def plan_extend(self, forward_batch, num_tokens: int) -> dict:
        """Build the extend plans of ``forward_batch`` (``num_tokens`` query rows; one plan per geometry
        group; needs ``forward_metadata``'s ``qo_indptr`` / ``max_extend_len``) and make them current."""
        bs = forward_batch.batch_size
        md = self.forward_metadata
        plans = {}
        for geo, layer_id in self._group_layer.items():
            plans[geo] = ExtendPlan(
                self.pool.layout_of(layer_id), geo.num_q_heads, num_tokens, self.pool.int2_buffers(layer_id),
                self.windows.hp_index, self._req_to_token_of(geo), forward_batch.req_pool_indices,
                md.qo_indptr[: bs + 1], forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens,
                sink=self.config.sink_tokens, q_dtype=torch.float32, max_extend_len=md.max_extend_len,
                sink_lens=self.windows.sink_lens, sliding_window=geo.sliding_window or None,
                logit_cap=geo.logit_cap or None, out_dtype=self._out_dtype(geo))
        self._extend_plans = plans
        return plans

    def _req_to_token_of(self, geo: Geometry) -> torch.Tensor:
        """The ``[request, position]`` slot table a group's kernels read: SGLang's ``req_to_token``,
        or the sliding-pool table for the sliding layers of a hybrid pool."""
        return self._swa_table if geo.swa else self._int2_req_to_token

    def _plan_late(self, layer, forward_batch) -> dict:
        """Plans for a decode forward that was not planned ahead (no ``init_forward_metadata`` for it,
        or a layer the model scan missed): adds the layer's group and plans the batch now. During a
        CUDA-graph capture the new plans are kept beside the batch size's first ones: the graph
        replays the launches of both, so both plans' workspace views must stay alive with it."""
        geo = self._layer_geometry.setdefault(layer.layer_id, self._geometry(layer))
        self._group_layer.setdefault(geo, layer.layer_id)
        plans = self.plan_decode(forward_batch)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self._graph_plans.setdefault(forward_batch.batch_size, []).append(plans)
        return plans

    # ------------------------------------------------------------------ per-forward bookkeeping
    def _token_tables(self, fb):
        """``(positions, request slot, request end)`` per new token of the batch."""
        if fb.forward_mode.is_decode():
            return fb.positions, fb.req_pool_indices, fb.seq_lens
        n = fb.out_cache_loc.shape[0]
        req = torch.repeat_interleave(fb.req_pool_indices, fb.extend_seq_lens, output_size=n)
        end = torch.repeat_interleave(fb.seq_lens, fb.extend_seq_lens, output_size=n)
        return fb.positions, req, end

    def _windows_in_forward(self, fb) -> None:
        if fb.forward_mode.is_idle() or fb.batch_size == 0:
            self._hp_rows = None
            return
        if not (fb.forward_mode.is_decode() or fb.forward_mode.is_extend()):
            raise NotImplementedError(f"--kv-cache-dtype int2 does not support forward mode {fb.forward_mode}")
        pos, req, end = self._token_tables(fb)
        self._hp_rows = self.windows.assign(fb.out_cache_loc, pos, req, end)
        self.windows.refresh(fb.req_pool_indices, self._int2_req_to_token)
        if self._swa_table is not None:
            extend = fb.forward_mode.is_extend()
            self._swa_loc = self.pool.update_swa_table(
                self._swa_table, self._int2_req_to_token, req, pos, fb.out_cache_loc, self._swa_window,
                fb.req_pool_indices if extend else None, fb.extend_prefix_lens if extend else None)

    def _windows_out_of_graph(self) -> None:
        self.windows.process_releases()
        # report sink-arena exhaustion (read back without a sync: the copy lands by the next step)
        seen = int(self.windows.host_missed)
        if seen > self._missed_seen:
            logger.warning(
                "sglang-oscar: the BF16 sink arena was full for %d sink tokens so far; they are read "
                "through INT2. Lower the number of cached prefixes, raise --mem-fraction-static or "
                "lower --max-running-requests", seen)
            self._missed_seen = seen
        self.windows.publish()

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self._windows_out_of_graph()
        self._windows_in_forward(forward_batch)
        self._decode_plans = self._extend_plans = None
        if forward_batch.batch_size > 0 and forward_batch.forward_mode.is_decode():
            self.plan_decode(forward_batch)
        elif forward_batch.batch_size > 0 and forward_batch.forward_mode.is_extend():
            self.plan_extend(forward_batch, forward_batch.out_cache_loc.shape[0])

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        self._windows_out_of_graph()
        if in_capture and forward_batch.forward_mode.is_decode():
            # built before the capture and kept: the graph replays this plan's launches (its index
            # tensors are the graph's static inputs, its workspace views stay allocated)
            self._graph_plans[forward_batch.batch_size] = [self.plan_decode(forward_batch)]

    def init_forward_metadata_in_graph(self, forward_batch):
        super().init_forward_metadata_in_graph(forward_batch)
        self._windows_in_forward(forward_batch)

    # ------------------------------------------------------------------ forward paths
    def _check_layer(self, layer, sinks, score_mod) -> None:
        if sinks is not None and any(m is not None for m in self._mean(layer.layer_id)):
            raise NotImplementedError(f"layer {layer.layer_id} has attention-sink logits but its rotation is centred "
                                      "(k_mean / v_mean), which does not commute with them: refit without --center")
        if score_mod is not None:
            raise NotImplementedError("--kv-cache-dtype int2 does not support score_mod attention")
        if getattr(layer, "is_cross_attention", False):
            raise NotImplementedError("--kv-cache-dtype int2 does not support cross attention")
        attn_type = getattr(layer, "attn_type", None)
        kind = None if attn_type is None else getattr(attn_type, "name", str(attn_type))
        # SGLang's Gemma-3 layers are DECODER_BIDIRECTIONAL (for image tokens); upstream's Triton
        # backend runs them causally unless CUDA graphs are fully off and chunked prefill is -1
        # (``allow_bidirectional_attention_in_extend``): accept them exactly when they stay causal.
        if kind == "DECODER_BIDIRECTIONAL" and not getattr(self, "allow_bidirectional_attention_in_extend", False):
            kind = "DECODER"
        if kind not in (None, "DECODER"):
            raise NotImplementedError(f"--kv-cache-dtype int2 supports causal decoder attention only, not {attn_type}"
                                      + (" (bidirectional extend: keep CUDA graphs or chunked prefill on)"
                                         if kind == "DECODER_BIDIRECTIONAL" else ""))
        if (getattr(layer, "xai_temperature_len", None) or -1) > 0:
            raise NotImplementedError("--kv-cache-dtype int2 does not support xai temperature scaling (Grok)")
        if layer.logit_cap and getattr(layer, "logit_capping_method", "tanh") != "tanh":
            raise NotImplementedError(f"--kv-cache-dtype int2 supports only tanh logit capping, "
                                      f"not {layer.logit_capping_method!r}")
        if layer.logit_cap and self._mean(layer.layer_id)[0] is not None:
            raise NotImplementedError(
                f"layer {layer.layer_id} caps its logits (logit_cap {layer.logit_cap}) but the rotation file "
                f"{self.config.rotation_path} centres the keys (k_mean), which shifts the scores before the cap: "
                "refit the rotation without --center for this model")

    def _mean(self, layer_id: int):
        """``(mean_k, mean_v)`` of a layer (``None`` each when the rotation set is not centred)."""
        return self.means[layer_id]

    def _prepare(self, q, k, v, layer, fb, save_kv_cache):
        """Rotate q (and write the layer's new K/V rows): ``q_rot`` fp32 ``[T, H_q, D_k]``
        (:func:`.step.rotate_inputs`; a folded layer's V is written as it comes)."""
        if k is None or v is None:
            raise NotImplementedError("--kv-cache-dtype int2 does not support KV-shared layers (k is None)")
        hq, hkv = layer.tp_q_head_num, layer.tp_k_head_num
        dk, dv = layer.qk_head_dim, layer.v_head_dim
        q3 = q.reshape(-1, hq, dk)
        k3, v3 = (k.reshape(-1, hkv, dk), v.reshape(-1, hkv, dv)) if save_kv_cache else (None, None)
        q_rot, k_rot, v_rot = rotate_inputs(q3, k3, v3, self.rotations[layer.layer_id], self._mean(layer.layer_id),
                                            self.pool.hp_dtype, self.config.rotate_engine,
                                            layer.layer_id in self.folded)
        if save_kv_cache:
            loc = self._swa_loc if self.pool.is_swa_layer(layer.layer_id) else fb.out_cache_loc
            self.pool.write_rotated(layer.layer_id, loc, k_rot, v_rot, self._hp_rows)
        return q_rot

    def _output_precision(self, fb) -> str:
        """The Triton output rotation's precision (:mod:`.step`): TF32x3 MMAs for the extend-mode
        batches of a 16-bit model (MIXED and TARGET_VERIFY included), IEEE fp32 for decode batches
        and fp32 models."""
        return "tf32x3" if fb.forward_mode.is_extend() and self.pool.hp_dtype != torch.float32 else "ieee"

    def _output(self, o, layer, dtype, fb):
        """``o`` back in the model's frame (or as is for a folded layer), ``[T, H_q * D_v]`` in ``dtype``."""
        lid = layer.layer_id
        return rotate_output(o, self.rotations[lid][1], self._mean(lid)[1], dtype, self.config.rotate_engine,
                             lid in self.output_folded, self._output_precision(fb)).reshape(
                                 o.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None,
                       aux_tensors=None):
        if not self.pool.is_int2_layer(layer.layer_id):  # --oscar-skip-layers: SGLang's BF16 pool and kernels
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, sinks, score_mod, aux_tensors)
        self._check_layer(layer, sinks, score_mod)
        q_rot = self._prepare(q, k, v, layer, forward_batch, save_kv_cache)
        geo = self._layer_geometry.get(layer.layer_id)
        plans = self._decode_plans
        if geo is None or plans is None or geo not in plans:
            plans = self._plan_late(layer, forward_batch)
            geo = self._layer_geometry[layer.layer_id]
        o = plans[geo].run(q_rot, *self.pool.int2_buffers(layer.layer_id), sm_scale=layer.scaling,
                           logit_cap=layer.logit_cap or None, sinks=sinks)
        return self._output(o, layer, q.dtype, forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None,
                       aux_tensors=None):
        if not self.pool.is_int2_layer(layer.layer_id):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, sinks, score_mod, aux_tensors)
        self._check_layer(layer, sinks, score_mod)
        q_rot = self._prepare(q, k, v, layer, forward_batch, save_kv_cache)
        geo = self._layer_geometry.setdefault(layer.layer_id, self._geometry(layer))
        plans = self._extend_plans
        if plans is None or geo not in plans or plans[geo].q_shape[0] != q_rot.shape[0]:
            # not planned ahead (no init_forward_metadata for this batch, or a layer the model scan missed)
            self._group_layer.setdefault(geo, layer.layer_id)
            plans = self.plan_extend(forward_batch, q_rot.shape[0])
        o = plans[geo].run(q_rot, *self.pool.int2_buffers(layer.layer_id), sm_scale=layer.scaling,
                           logit_cap=layer.logit_cap or None, sinks=sinks)
        return self._output(o, layer, q.dtype, forward_batch)


def _attention_layers(model) -> list:
    """The model's attention layers (modules with ``RadixAttention``'s ``layer_id`` and head counts)."""
    if model is None:
        return []
    return [m for m in model.modules()
            if all(hasattr(m, a) for a in ("layer_id", "tp_q_head_num", "tp_k_head_num", "qk_head_dim", "v_head_dim",
                                            "logit_cap"))]
