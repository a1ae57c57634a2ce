"""``OscarTritonLatentBackend``: SGLang's Triton attention backend over the INT2 MLA latent pool.

MLA layers (DeepSeek-V3 family) reach the backend through SGLang's absorbed path
(``forward_mla.py``): ``q = [q_nope W_UK | q_pe]`` ``[T, H, R + P]``, ``k = [c_kv | k_pe]``
``[T, 1, R + P]``, ``v = c_kv``, output ``o_latent [T, H * R]`` that the model multiplies by
``W_UV``. An AROUND hook on ``DeepseekV2AttentionMLA.dispatch_attn_forward_method``
(:mod:`sglang_oscar.plugin.serving`) sends every forward of an int2 server down that path (the Triton
handler would run a prefill without prefix as non-absorbed MHA, which never reads the cache).

Per layer, with its orthogonal latent rotation ``Rot`` (:class:`~sglang_oscar.rotation.latent.LatentRotationSet`):

* write: ``c' = round(c Rot)`` to the model dtype, quantized to INT2 at the slot SGLang allocated,
  ``k_pe`` as is, both copied to the BF16 sink/recent rows
  (:meth:`~sglang_oscar.pool.latent_pool.OscarMLATokenToKVPool.write_latent`);
* decode: the batch's :class:`~sglang_oscar.kernels.latent_plan.LatentDecodePlan` run with ``q_abs' = q_abs Rot``
  (fp32) reads ``[BF16 sink | INT2 middle | BF16 recent]`` and returns ``o'``; the output is
  ``o' Rot^T`` (``Rot Rot^T = I``: ``reference.latent`` module docstring). The kernel multiplies
  the 2-bit codes themselves where the format allows (uniform levels, groups of whole quarters: the
  served default, :mod:`~sglang_oscar.kernels.latent_codes`), else dequantized tiles; on the GPU its
  dot products take BF16 operands for a BF16 model, as SGLang's BF16 MLA decode does (exact fp32 for
  an fp32 model, TF32 for fp16, fp32 under the interpreter, whose BF16 dot is wrong);
* extend: the batch's prefix and chunk rows are dequantized once per layer
  (:func:`~sglang_oscar.kernels.latent.gather_latent`, model dtype), sink positions replaced by their
  BF16 rows (window mode ``"extend"``: the chunk reads INT2 latents of itself too, as the MHA pool's
  extend), and SGLang's own Triton extend kernel attends over them.

DSA layers (GLM-5: :class:`~.dsa_backend.OscarDSALatentBackend` delegates to this backend, set up with
``dsa_topk`` = the indexer's top-k width) arrive split (``q_rope`` / ``k_rope``) with each layer's
``topk_indices`` (positions, ``-1``-padded): decode copies them into the batch's top-k plan's static
selection and runs it (every selected position from its tier); extend runs
:func:`~sglang_oscar.kernels.latent_plan.latent_sparse_extend_attention`, one selection per chunk token
(window mode ``"extend"``).

The window bookkeeping, CUDA-graph plumbing and slot release are the MHA backend's
(:class:`~.triton_backend.OscarTritonAttnBackend`); a decode batch's plan is one
:class:`~sglang_oscar.kernels.latent_plan.LatentDecodePlan` (every MLA layer has the same geometry), an
extend batch's the gather indices (:class:`LatentExtendPlan`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

from ..kernels.decode.plan import DecodeWorkspace
from ..kernels.latent import gather_latent
from ..kernels.latent_plan import (PLANES, LatentDecodePlan, codes_engine_applies, latent_decode_tiles,
                                   latent_sparse_extend_attention)
from ..pool.latent_pool import OscarMLATokenToKVPool
from .rotations import model_geometry, served_latent_rotations
from .triton_backend import OscarTritonAttnBackend, _attention_layers

logger = logging.getLogger("sglang_oscar")


class LatentExtendPlan(NamedTuple):
    """Rows an extend batch reads, built once per forward.

    ``slots`` int64 ``[n_prefix + n_new + 1]``: the requests' prefix slots (request-major, position
    order), the chunk's ``out_cache_loc``, then slot 0 for a spare row; ``sink_dest`` / ``sink_rows``
    int64 ``[B * sink]``: the row of each request's sink positions and the BF16 sink row it is read
    from instead (positions without one point at the spare row); ``kv_indptr`` int32 ``[B + 1]`` /
    ``kv_indices`` int64 ``[n_prefix]`` address the prefix part for SGLang's extend kernel."""

    slots: torch.Tensor
    sink_dest: torch.Tensor
    sink_rows: torch.Tensor
    n_prefix: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_extend_len: int


class OscarTritonLatentBackend(OscarTritonAttnBackend):
    """Triton attention over :class:`~sglang_oscar.pool.latent_pool.OscarMLATokenToKVPool` (module docstring).

    Raises:
        RuntimeError: the pool is not the INT2 latent pool (a hook did not apply).
        ValueError: rotation file / model problems (:func:`.rotations.served_latent_rotations`).
    """

    def __init__(self, model_runner, *args, dsa_topk: int = 0, **kwargs):
        pool = model_runner.token_to_kv_pool
        if not isinstance(getattr(pool, "full_kv_pool", pool), OscarMLATokenToKVPool):
            raise RuntimeError(f"--kv-cache-dtype int2 on an MLA model: the token pool is {type(pool).__name__}, not "
                               "the INT2 latent pool; the sglang-oscar pool hook did not apply (check the log)")
        TritonAttnBackend.__init__(self, model_runner, *args, **kwargs)
        # SGLang sizes its split-KV scratch (attn_logits [tokens, heads, max_kv_splits, v_head_dim] fp32,
        # per eager decode step and for CUDA graphs) by this; the latent plans keep their own workspace,
        # and with MLA's max_kv_splits of 256 on an H200 the unused scratch of 16 heads x 256 graph
        # tokens would take 2.1 GB
        self.v_head_dim = 1
        from sglang.srt.runtime_context import get_parallel

        config = pool.oscar_config
        hf_config = model_runner.model_config.hf_config
        geometry = model_geometry(hf_config)
        rs = served_latent_rotations(config, geometry, log=get_parallel().attn_tp_rank == 0,
                                     architectures=getattr(hf_config, "architectures", None), hf_config=hf_config)
        rotations = {lid: rs.matrix(lid).to(model_runner.device) for lid in rs.layer_ids
                     if pool.start_layer <= lid <= pool.end_layer}
        missing = sorted({layer.layer_id for layer in _attention_layers(getattr(model_runner, "model", None))}
                         - set(rotations))
        if missing:
            raise RuntimeError(f"--kv-cache-dtype int2: attention layers {missing[:8]} of {type(model_runner.model).__name__} "
                               f"have no latent rotation (the config describes layers {rs.layer_ids[:4]}...): this "
                               "model's layer numbering is not the one the INT2 latent pool serves; use "
                               "--kv-cache-dtype auto")
        heads = max(1, model_runner.model_config.num_attention_heads // get_parallel().attn_tp_size)
        self.setup_latent(pool, rotations, model_runner.req_to_token_pool.req_to_token, heads,
                          getattr(self, "device_core_count", None) or 132, dsa_topk=dsa_topk)
        if get_parallel().attn_tp_rank == 0:
            logger.info("sglang-oscar: MLA latent decode engine %s, %s dot operands, %d q heads per rank, tiles %s",
                        self._engine, self._precision, heads, self._decode_tiles)

    def setup_latent(self, pool, rotations: dict, req_to_token: torch.Tensor, num_heads: int, num_sms: int,
                     dsa_topk: int = 0) -> None:
        """Attributes the forward paths read (also how CPU tests build the backend without a model runner).

        Args:
            pool: the :class:`~sglang_oscar.pool.latent_pool.OscarMLATokenToKVPool`, or the
                :class:`~sglang_oscar.pool.linear_pool.OscarHybridLinearKVPool` around one (Kimi-Linear).
            rotations: ``{global layer id: fp32 [R, R]}`` on the pool's device, one per MLA layer.
            req_to_token: SGLang's ``ReqToTokenPool.req_to_token`` ``[max_reqs, ctx]``.
            num_heads: q heads of this rank (every MLA layer has the same).
            num_sms: streaming multiprocessors, for the decode split count.
            dsa_topk: the DSA indexer's top-k width (GLM-5: ``index_topk``, 2048), 0 for dense MLA: decode
                batches also get a top-k plan whose ``[B, dsa_topk]`` selection each layer's
                ``topk_indices`` are copied into (a static buffer: CUDA graphs replay the copies).
        """
        self.pool, self.windows, self.config = pool, pool.windows, pool.oscar_config
        if not rotations:
            raise RuntimeError("--kv-cache-dtype int2: this rank serves no MLA layer (no latent rotation to apply)")
        self.rotations = rotations
        self._plan_layer = min(rotations)  # a layer whose planes stand for every layer's in the decode plans
        self._hp_rows = None
        self._missed_seen = 0
        self._int2_req_to_token = req_to_token
        self._swa_table = None  # the MHA backend's window bookkeeping reads it: no sliding pool here
        self._num_sms = num_sms
        self._decode_plans = self._extend_plans = None
        self._graph_plans = {}
        self._workspace = DecodeWorkspace(pool.device)
        self._heads = num_heads
        # decode dot operands: BF16 for a BF16 model (as SGLang's BF16 MLA decode), exact fp32 for an fp32
        # one (accuracy runs), TF32 for fp16; fp32 everywhere under the interpreter (its BF16 dot is wrong)
        on_gpu = torch.device(pool.device).type == "cuda"
        self._precision = ({torch.bfloat16: "bf16", torch.float16: "tf32"}.get(pool.hp_dtype, "ieee")
                           if on_gpu else "ieee")
        # MMAs over the 2-bit codes where the format allows (1.4-2.1x faster than dequantizing tiles on the
        # H200: docs/benchmarks_mla.md); other quantizers / group sizes dequantize each tile
        self._engine = ("codes" if codes_engine_applies(self.config.quantizer, pool.layout.k.group_size,
                                                        pool.kv_lora_rank) else "dequant")
        self._decode_tiles = latent_decode_tiles(num_heads, self._engine)
        self._dsa_tiles = latent_decode_tiles(num_heads, "dequant")
        self._dsa_topk = int(dsa_topk)
        self._topk = (torch.full((req_to_token.shape[0], self._dsa_topk), -1, dtype=torch.int32, device=pool.device)
                      if self._dsa_topk else None)
        self._dsa_plan = None

    # ------------------------------------------------------------------ plans
    def plan_decode(self, forward_batch) -> LatentDecodePlan:
        """The :class:`~sglang_oscar.kernels.latent_plan.LatentDecodePlan` of ``forward_batch`` (its split
        count is static per batch size: CUDA graphs replay it), made current; with ``dsa_topk`` also
        the batch's top-k plan (``_dsa_plan``, dequant engine) over the first ``B`` rows of the
        static selection."""
        w = self.windows
        common = dict(num_heads=self._heads, group_size=self.pool.layout.k.group_size, quantizer=self.config.quantizer,
                      sink=self.config.sink_tokens, recent=self.config.recent_tokens, sink_lens=w.sink_lens,
                      num_sms=self._num_sms, precision=self._precision, workspace=self._workspace)
        tables = (self.pool.latent_buffers(self._plan_layer), w.hp_index, self._int2_req_to_token,
                  forward_batch.req_pool_indices, forward_batch.seq_lens)
        self._decode_plans = LatentDecodePlan(*tables, engine=self._engine, **common, **self._decode_tiles)
        if self._dsa_topk:
            self._dsa_plan = LatentDecodePlan(*tables, engine="dequant", topk=self._topk[: forward_batch.batch_size],
                                              **common, **self._dsa_tiles)
        return self._decode_plans

    def plan_extend(self, forward_batch, num_tokens: int) -> LatentExtendPlan:
        """The prefix + chunk rows of ``forward_batch`` (:class:`LatentExtendPlan`); one host read of the
        prefix total (``extend_prefix_lens_cpu`` when SGLang gives it)."""
        fb = forward_batch
        dev = fb.out_cache_loc.device
        bs = fb.batch_size
        prefix = fb.extend_prefix_lens.to(dev, torch.int64)
        cpu = getattr(fb, "extend_prefix_lens_cpu", None)
        n_prefix = int(sum(cpu)) if cpu is not None else int(prefix.sum())
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        kv_indptr[1:] = torch.cumsum(prefix, 0)
        req_pre = torch.repeat_interleave(fb.req_pool_indices.long(), prefix, output_size=n_prefix)
        pos_pre = (torch.arange(n_prefix, device=dev)
                   - torch.repeat_interleave(kv_indptr[:-1].long(), prefix, output_size=n_prefix))
        slots_pre = self._int2_req_to_token[req_pre, pos_pre].long()
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        qo_indptr[1:] = torch.cumsum(fb.extend_seq_lens, 0)
        n_rows = n_prefix + num_tokens
        # window mode "extend": each request's first sink positions come from their BF16 rows (as many as
        # have rows: sink_lens), everything else, the chunk included, through INT2
        sink = self.config.sink_tokens
        reqs = fb.req_pool_indices.long()
        p = torch.arange(sink, device=dev)[None, :]
        sink_r = torch.clamp(self.windows.sink_lens[reqs].long(), max=sink)[:, None]
        hp = self.windows.hp_index[reqs][:, :sink].long()
        valid = (p < sink_r) & (p < fb.seq_lens.long()[:, None]) & (hp >= 0)
        pre = prefix[:, None]
        row = torch.where(p < pre, kv_indptr[:-1, None].long() + p, n_prefix + qo_indptr[:-1, None].long() + p - pre)
        max_extend_len = getattr(getattr(self, "forward_metadata", None), "max_extend_len", None)
        if max_extend_len is None:
            max_extend_len = int(fb.extend_seq_lens.max())
        self._extend_plans = LatentExtendPlan(
            torch.cat([slots_pre, fb.out_cache_loc.long(), slots_pre.new_zeros(1)]),
            torch.where(valid, row, n_rows).reshape(-1), torch.where(valid, hp, 0).reshape(-1), n_prefix,
            qo_indptr, kv_indptr, torch.arange(n_prefix, dtype=torch.int64, device=dev), max_extend_len)
        return self._extend_plans

    def _plan_late(self, layer, forward_batch) -> LatentDecodePlan:
        plans = self.plan_decode(forward_batch)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self._graph_plans.setdefault(forward_batch.batch_size, []).extend(
                p for p in (plans, self._dsa_plan) if p is not None)
        return plans

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        if in_capture and forward_batch.forward_mode.is_decode() and self._dsa_plan is not None:
            # the graph replays the top-k plan's launches too: its workspace views must stay alive with it
            self._graph_plans[forward_batch.batch_size].append(self._dsa_plan)

    # ------------------------------------------------------------------ forward paths
    def _check_latent_layer(self, layer, sinks, score_mod, kwargs) -> None:
        if (sinks is not None or score_mod is not None or (layer.logit_cap and layer.logit_cap > 0)
                or kwargs.get("llama_4_scaling") is not None):
            raise NotImplementedError("--kv-cache-dtype int2 MLA layers take no attention sinks, score_mod, logit cap "
                                      "or Llama-4 query scaling")
        dsa = ("q_rope", "k_rope", "topk_indices") if self._dsa_topk else ()
        given = sorted(k for k in ("q_rope", "k_rope", "topk_indices", "cos_sin_cache")
                       if kwargs.get(k) is not None and k not in dsa)
        if given:
            raise NotImplementedError(f"layer {layer.layer_id}: the INT2 latent backend takes the absorbed query and "
                                      f"key whole ([q_abs | q_pe], [c_kv | k_pe]){' or split with a DSA top-k' if dsa else ''}"
                                      f", not {given}")
        r, p = self.pool.kv_lora_rank, self.pool.qk_rope_head_dim
        if layer.tp_k_head_num != 1 or layer.qk_head_dim != r + p or layer.v_head_dim != r:
            raise NotImplementedError(
                f"layer {layer.layer_id}: the INT2 latent pool serves SGLang's absorbed MLA attention (1 kv head, "
                f"head_dim {r + p}, v_head_dim {r}), got {layer.tp_k_head_num} kv heads, {layer.qk_head_dim}/"
                f"{layer.v_head_dim}: a non-absorbed (MHA) forward reached the backend")

    def _whole(self, q, k, layer, kwargs):
        """``(q [T, H, R + P], k [T, 1, R + P] or None)``: a DSA layer's split parts joined (``q`` =
        ``q_abs``, ``k`` = ``c_kv`` with ``q_rope`` / ``k_rope`` beside them), else as given."""
        q_rope, k_rope = kwargs.get("q_rope"), kwargs.get("k_rope")
        if q_rope is None:
            return q, k
        h, r = layer.tp_q_head_num, self.pool.kv_lora_rank
        q = torch.cat([q.reshape(-1, h, r), q_rope.reshape(-1, h, self.pool.qk_rope_head_dim).to(q.dtype)], -1)
        if k is not None and k_rope is not None:
            k = torch.cat([k.reshape(-1, 1, r), k_rope.reshape(-1, 1, self.pool.qk_rope_head_dim).to(k.dtype)], -1)
        return q, k

    def _selection(self, topk: torch.Tensor, layer) -> torch.Tensor:
        if topk.dim() != 2 or topk.shape[1] != self._dsa_topk:
            raise ValueError(f"layer {layer.layer_id}: topk_indices {tuple(topk.shape)}, expected [tokens, "
                             f"{self._dsa_topk}] (the DSA indexer's index_topk)")
        return topk

    def _prepare_latent(self, q, k, layer, fb, save_kv_cache):
        """Rotated absorbed query ``q_abs'`` fp32 ``[T, H, R]`` and ``q_pe`` ``[T, H, P]``; writes the
        layer's new latent rows."""
        r = self.pool.kv_lora_rank
        rot = self.rotations[layer.layer_id]
        q3 = q.reshape(-1, layer.tp_q_head_num, r + self.pool.qk_rope_head_dim)
        q_abs = q3[..., :r].float() @ rot
        q_pe = q3[..., r:].contiguous()
        if save_kv_cache:
            k2 = k.reshape(-1, r + self.pool.qk_rope_head_dim)
            c_rot = (k2[:, :r].float() @ rot).to(self.pool.hp_dtype)
            self.pool.write_latent(layer.layer_id, fb.out_cache_loc, c_rot, k2[:, r:], self._hp_rows)
        return q_abs, q_pe

    def _output(self, o, layer, dtype, fb=None):
        """``o' Rot^T`` ``[T, H * R]`` in ``dtype`` (``fb`` unused: one product for every step)."""
        return (o.float() @ self.rotations[layer.layer_id].T).to(dtype).reshape(o.shape[0], -1)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None,
                       aux_tensors=None, **kwargs):
        self._check_latent_layer(layer, sinks, score_mod, kwargs)
        q, k = self._whole(q, k, layer, kwargs)
        q_abs, q_pe = self._prepare_latent(q, k, layer, forward_batch, save_kv_cache)
        plan = self._decode_plans or self._plan_late(layer, forward_batch)
        topk = kwargs.get("topk_indices")
        if topk is not None:
            plan = self._dsa_plan
            plan.topk.copy_(self._selection(topk, layer)[: plan.batch])
        buf = self.pool.latent_buffers(layer.layer_id)
        o = plan.run(q_abs, q_pe, *(buf[k] for k in PLANES), sm_scale=layer.scaling)
        return self._output(o, layer, q.dtype)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None,
                       aux_tensors=None, **kwargs):
        self._check_latent_layer(layer, sinks, score_mod, kwargs)
        q, k = self._whole(q, k, layer, kwargs)
        q_abs, q_pe = self._prepare_latent(q, k, layer, forward_batch, save_kv_cache)
        buf = self.pool.latent_buffers(layer.layer_id)
        topk = kwargs.get("topk_indices")
        if topk is not None:
            # each chunk token attends to its own selection (window mode "extend", sink rows from BF16)
            pos, req, _ = self._token_tables(forward_batch)
            o = latent_sparse_extend_attention(
                q_abs, q_pe, buf, self.windows.hp_index, self._int2_req_to_token, req, pos,
                self._selection(topk, layer)[: q_abs.shape[0]], group_size=self.pool.layout.k.group_size,
                quantizer=self.config.quantizer, sink=self.config.sink_tokens, sm_scale=layer.scaling,
                sink_lens=self.windows.sink_lens, num_sms=self._num_sms, block_n=32, precision=self._precision,
                workspace=self._workspace)
            return self._output(o, layer, q.dtype)
        plan = self._extend_plans
        n_new = q_abs.shape[0]
        if not isinstance(plan, LatentExtendPlan) or plan.slots.numel() != plan.n_prefix + n_new + 1:
            plan = self.plan_extend(forward_batch, n_new)
        # gather_latent writes fp32 or BF16: an fp16 model's rows join in fp32 (never narrower than BF16)
        dtype = torch.bfloat16 if self.pool.hp_dtype == torch.bfloat16 else torch.float32
        # transient, per layer: (prefix + chunk) x (R + P) rows, as SGLang's BF16 extend reads from its pool
        rows = gather_latent(buf["codes"], buf["pairs"], buf["k_pe"], plan.slots,
                             group_size=self.pool.layout.k.group_size, quantizer=self.config.quantizer, out_dtype=dtype)
        rows[plan.sink_dest] = torch.cat([buf["hp_latent"][plan.sink_rows], buf["hp_pe"][plan.sink_rows]], -1).to(dtype)
        rows = rows.unsqueeze(1)  # [n + 1, 1, R + P]; the last is the spare row
        r = self.pool.kv_lora_rank
        k_pre, k_new = rows[: plan.n_prefix], rows[plan.n_prefix: plan.n_prefix + n_new]
        qx = torch.cat([q_abs, q_pe.float()], dim=-1).to(dtype)
        o = torch.empty(qx.shape[0], qx.shape[1], r, dtype=dtype, device=qx.device)
        self.extend_attention_fwd(qx, k_new, k_new[..., :r], o, k_pre, k_pre[..., :r], plan.qo_indptr,
                                  plan.kv_indptr, plan.kv_indices, None, True, None, plan.max_extend_len, 1.0, 1.0,
                                  layer.scaling)
        return self._output(o, layer, q.dtype)
