"""Decode attention over the two-tier cache: plan once per batch, run once per layer.

:class:`DecodePlan` resolves everything a decode step's launches need that does not depend on a
layer's data -- the launch config (whose type is the stage-1 engine, Triton or Gluon), the HP / INT2
split counts, the grid, the buffer strides, the stage-1 workspace -- and checks the batch's tables once; :meth:`DecodePlan.run` then
launches stage 1 (:mod:`.triton_stage1` or :mod:`.gluon_stage1`) and the merge (:mod:`.merge`) for
one layer. A plan's launch choices depend only on host constants (batch size, head counts, the
static context bound), so a plan built before a CUDA-graph capture stays valid for every replay of
that batch size. :func:`decode_attention` is the one-shot form (build a plan, run it).
"""

from __future__ import annotations

import torch

from ..attention import (
    attn_constants,
    check_cache,
    check_out_dtype,
    check_query,
    debug_request_indices,
    layout_constexprs,
    plan_head_blocks,
    resolve_mma_dtype,
    run_once,
    run_scales,
)
from ..compile_check import launch as _launch
from ..layout import TORCH_TO_TL, Int2Layout
from ..configs import effective_convert, permuting_ok
from ..validate import INDEX_DTYPES, check_sinks, check_tensor, debug_enabled, needs_idx64
from .engine import decode_config
from .gluon_stage1 import gluon_decode_supported, launch_gluon_decode
from .merge import launch_merge, merge_launch
from .splits import _head_programs, _split_keys, decode_num_hp_splits, default_num_kv_splits
from .triton_stage1 import _decode_stage1


class DecodeWorkspace:
    """One fp32 scratch buffer for the stage-1 partial outputs and log-sum-exps of many plans.

    Plans take views of its first elements (:meth:`views`), so one allocation serves every batch
    size: reserve the largest once (e.g. before CUDA-graph capture) and no step allocates. Growing it
    later allocates a new buffer; views taken before keep the old one alive (a captured graph's
    plan keeps pointing at memory nobody else uses).
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self._buf = None

    @staticmethod
    def numel(batch: int, num_q_heads: int, head_dim_v: int, total_splits: int) -> int:
        """fp32 elements of one plan's ``o_part [B, H_q, S, D_v]`` plus ``lse [B, H_q, S]``."""
        return batch * num_q_heads * total_splits * (head_dim_v + 1)

    def reserve(self, numel: int) -> None:
        """Make the buffer hold at least ``numel`` fp32 elements (allocates only when it grows)."""
        if self._buf is None or self._buf.numel() < numel:
            self._buf = torch.empty(max(1, numel), dtype=torch.float32, device=self.device)

    def views(self, batch: int, num_q_heads: int, head_dim_v: int, total_splits: int) -> tuple:
        """``(o_part [B, H_q, S, D_v], lse [B, H_q, S])`` views of the buffer (reserved as needed)."""
        n_o = batch * num_q_heads * total_splits * head_dim_v
        self.reserve(self.numel(batch, num_q_heads, head_dim_v, total_splits))
        o_part = self._buf[:n_o].view(batch, num_q_heads, total_splits, head_dim_v)
        lse = self._buf[n_o:n_o + batch * num_q_heads * total_splits].view(batch, num_q_heads, total_splits)
        return o_part, lse


class DecodePlan:
    """The launches of one decode step for one KV geometry (one :class:`Int2Layout` and head counts).

    Args:
        layout: the layers' :class:`Int2Layout`.
        num_q_heads: q heads ``H_q`` per layer (a multiple of the buffers' kv heads).
        buffers: ``(k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v)`` of one layer (every layer the
            plan runs must have buffers of these shapes, dtypes and strides): INT2 buffers
            ``[S, H_kv, D/4]`` uint8 / ``[S, H_kv, 2*D/G]`` in ``layout.scale_dtype``, HP buffers
            ``[R, H_kv, D]`` (rotated frame).
        hp_index: int ``[max_reqs, >= sink + recent]``: HP row of sink position ``p`` at entry
            ``p``, of recent position ``p`` at entry ``sink + p % recent``.
        req_to_token: int ``[max_reqs, max_ctx]`` INT2 slot of each position.
        req_pool_indices, seq_lens: int ``[B]`` on the device (``seq_lens`` includes the query; 0
            marks a padding row, e.g. of a CUDA-graph batch, whose output is zeros). The plan keeps
            these tensors: their values may change between runs (CUDA-graph replays), their shapes not.
        sink, recent: HP window sizes (tokens).
        q_dtype: dtype of the queries ``run`` gets (float32 / float16 / bfloat16).
        sink_lens: optional int32 ``[max_reqs]``: request ``r`` reads only positions
            ``< min(sink_lens[r], sink)`` from sink rows and the rest of ``[0, sink)`` through INT2
            (the served pool, when its sink-row arena could not give a token a row).
        sliding_window: key ``j`` visible iff ``L-1-j < W``.
        logit_cap: whether (and, for the check, with what cap) the layers cap their logits,
            ``cap * tanh(s / cap)``: ``None`` / 0 = off. The cap itself is a :meth:`run` argument;
            on or off is fixed per plan (a kernel constant, and the Gluon engine has no cap).
        out_dtype: dtype of the output (default ``q_dtype``).
        mma_dtype: operand dtype of the MMAs (default fp16, fp32 when the HP dtype is fp32).
        num_kv_splits / num_hp_splits: INT2 / HP splits (default: :func:`.splits.choose_num_splits`
            through :func:`.splits.default_num_kv_splits`, :func:`.splits.decode_num_hp_splits`, both
            capped for a sliding layer by :func:`.splits.sliding_split_caps`).
        max_seq_len: a static bound on the context (the server's), used by the default split count
            (with ``sliding_window``, the smaller of the two).
        workspace: ``(o_part, lse)`` with at least ``B`` rows and ``num_hp_splits + num_kv_splits``
            splits, or a :class:`DecodeWorkspace` to take views of, or ``None`` (allocated here).
        config: ``None`` (auto: the Gluon engine where it applies, else Triton), the type
            :class:`~..configs.TritonConfig` / :class:`~..configs.GluonConfig` (that engine's
            defaults for this layout and ``B x H_kv``), or an instance (:func:`.engine.decode_config`).
        debug: check index values on every run (host sync); default ``SGLANG_OSCAR_DEBUG``.

    Attributes:
        config: the :class:`~..configs.TritonConfig` or :class:`~..configs.GluonConfig` it runs;
        engine: ``config.engine`` (``"triton"`` / ``"gluon"``); num_hp_splits, num_kv_splits, grid
        (stage 1), o_part, lse (the workspace views).

    Raises:
        ValueError: an unsupported layout, mismatched shapes / dtypes / devices, a config
            the call cannot run (a Gluon config outside the Gluon scope), a workspace too small.
    """

    def __init__(self, layout: Int2Layout, num_q_heads: int, buffers: tuple, hp_index: torch.Tensor,
                 req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, *,
                 sink: int, recent: int, q_dtype: torch.dtype, sink_lens: torch.Tensor | None = None,
                 sliding_window: int | None = None, logit_cap: float | None = None,
                 out_dtype: torch.dtype | None = None, mma_dtype: torch.dtype | None = None,
                 num_kv_splits: int | None = None, num_hp_splits: int | None = None,
                 max_seq_len: int | None = None, workspace=None, config=None, debug: bool | None = None):
        k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v = buffers
        check_tensor(k_codes, "k_codes", ndim=3)
        dev = k_codes.device
        hq = num_q_heads
        hkv = check_cache(layout, dev, hq, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v, hp_index, req_to_token,
                          sink, recent, sliding_window, logit_cap)
        check_tensor(req_pool_indices, "req_pool_indices", ndim=1, dtypes=INDEX_DTYPES, device=dev)
        bsz = req_pool_indices.shape[0]
        check_tensor(seq_lens, "seq_lens", ndim=1, dtypes=INDEX_DTYPES, device=dev, shape=(bsz,))
        if sink_lens is not None:
            check_tensor(sink_lens, "sink_lens", ndim=1, dtypes=INDEX_DTYPES, device=dev)
        op = resolve_mma_dtype(mma_dtype, hp_k.dtype)
        if q_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"q dtype {q_dtype} is not float32/float16/bfloat16")
        out_dtype = out_dtype or q_dtype
        check_out_dtype(out_dtype)
        has_cap = logit_cap is not None and logit_cap > 0
        cfg = decode_config(config, layout, bsz * hkv, lambda: gluon_decode_supported(
            layout, dev, op, has_cap, hp_k.dtype, (k_codes, k_pairs, v_codes, v_pairs)), mma_dtype=op)
        engine = cfg.engine
        bpk = None
        if engine == "triton":
            group, hpb, bpk, block_h = plan_head_blocks(hq, hkv, cfg.min_block_h, cfg.max_block_h)
        if num_hp_splits is None:
            num_hp_splits = decode_num_hp_splits(sink, recent, programs=bsz * _head_programs(cfg, hq, hkv, bpk),
                                                 sliding_window=sliding_window)
        if num_kv_splits is None:
            num_kv_splits = default_num_kv_splits(cfg, bsz, hq, hkv, device=dev, max_seq_len=max_seq_len,
                                                  blocks_per_kv=bpk, sliding_window=sliding_window)
        if num_hp_splits < 1 or num_kv_splits < 1:
            raise ValueError("num_hp_splits and num_kv_splits must be >= 1")
        ns = num_hp_splits + num_kv_splits
        dv = layout.v.head_dim
        if workspace is None:
            workspace = DecodeWorkspace(dev)
        if isinstance(workspace, DecodeWorkspace):
            o_part, lse = workspace.views(bsz, hq, dv, ns)
        else:
            o_part, lse = workspace
            check_tensor(o_part, "workspace o_part", ndim=4, dtypes=torch.float32, device=dev,
                         shape=(None, hq, None, dv), last_contiguous=True)
            check_tensor(lse, "workspace lse", ndim=3, dtypes=torch.float32, device=dev, shape=(None, hq, None))
        # a workspace sized for another split count would be written past its end
        if o_part.shape[0] < bsz or lse.shape[0] < bsz or o_part.shape[2] < ns or lse.shape[2] < ns:
            raise ValueError(f"workspace too small for batch {bsz} and {ns} splits: "
                             f"{tuple(o_part.shape)}, {tuple(lse.shape)}; size it with decode_num_hp_splits + "
                             "num_kv_splits, or pass both split counts")

        self.layout, self.device, self.engine, self.config = layout, dev, engine, cfg
        self.batch, self.num_q_heads, self.num_kv_heads = bsz, hq, hkv
        self.q_shape = (bsz, hq, layout.k.head_dim)
        self.out_shape = (bsz, hq, dv)
        self.q_dtype, self.out_dtype, self.mma_dtype = q_dtype, out_dtype, op
        self.sink, self.recent, self.sliding_window, self.has_cap = sink, recent, sliding_window, has_cap
        self.num_hp_splits, self.num_kv_splits, self.num_splits = num_hp_splits, num_kv_splits, ns
        self.o_part, self.lse = o_part, lse
        self.hp_index, self.req_to_token, self.sink_lens = hp_index, req_to_token, sink_lens
        self.req_pool_indices, self.seq_lens = req_pool_indices, seq_lens
        self.debug = debug_enabled(debug)
        self._merge = merge_launch(bsz, hq, dv, ns)
        self._hp_rows, self._slots = hp_k.shape[0], k_codes.shape[0]
        # the split floor as the kernels take it: a multiple of block_n
        self.min_chunk = -(-_split_keys(cfg, bsz * _head_programs(cfg, hq, hkv, bpk)) // cfg.block_n) * cfg.block_n
        if engine == "gluon":
            self.grid = None  # launch_gluon_decode forms its grid (blocks of 8 q heads)
            self._gluon = dict(sink=sink, recent=recent, sliding_window=sliding_window, num_hp_splits=num_hp_splits,
                               num_kv_splits=num_kv_splits, block_n=cfg.block_n, min_chunk=self.min_chunk,
                               maxnreg=cfg.maxnreg)
        else:
            self.grid = (bsz, hkv * bpk, ns)
            # token-major tiles need one (scale, zero) group per K and V row
            token_major = layout.k.num_groups == 1 and layout.v.num_groups == 1
            self._idx64 = needs_idx64(*buffers)
            self._constexprs = dict(
                GROUP=group, HEADS_PER_BLOCK=hpb, BLOCKS_PER_KV=bpk, BLOCK_H=block_h, **layout_constexprs(layout),
                OP=TORCH_TO_TL[op], PREC="ieee" if op == torch.float32 else None,
                CONVERT=effective_convert(cfg.convert, op, permuting_ok(layout), subnormal_ok=token_major),
                HAS_CAP=has_cap, HAS_WINDOW=sliding_window is not None, IDX64=self._idx64,
                TOKEN_MAJOR=token_major,
                NS_HP=num_hp_splits, NS_Q=num_kv_splits, MIN_CHUNK=self.min_chunk,
                BLOCK_N=cfg.block_n, HAS_SINKL=sink_lens is not None,
                PAIRS_AHEAD=cfg.pairs_ahead, DEFER_SUMS=cfg.defer_sums,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.launch_options(),
            )
            self._consts = attn_constants(layout)
            # every layer's buffers have the plan's strides (the docstring's contract), so the row and
            # head strides and the tables' / workspace's strides are fixed here, not read per run
            self._strides = tuple((t.stride(0), t.stride(1)) for t in buffers)
            self._tables = (hp_index, hp_index.stride(0), req_to_token, req_to_token.stride(0), req_pool_indices,
                            seq_lens, hp_index if sink_lens is None else sink_lens,
                            o_part, o_part.stride(0), o_part.stride(1), o_part.stride(2),
                            lse, lse.stride(0), lse.stride(1))

    def run(self, q: torch.Tensor, k_codes: torch.Tensor, k_pairs: torch.Tensor, v_codes: torch.Tensor,
            v_pairs: torch.Tensor, hp_k: torch.Tensor, hp_v: torch.Tensor, *, sm_scale: float | None = None,
            logit_cap: float | None = None, out: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of one layer: stage 1 into the plan's workspace, then the merge.

        Args:
            q: ``[B, H_q, D_k]`` rotated queries (query ``b`` at position ``seq_lens[b] - 1``),
                last dim contiguous, in the plan's ``q_dtype``.
            k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v: the layer's buffers, shaped as the
                plan's ``buffers`` (not checked again: the plan did).
            sm_scale: softmax scale (default ``1/sqrt(D_k)``); logit_cap: the layer's cap, > 0 iff
                the plan was built with one.
            out: optional ``[B, H_q, D_v]`` output (last dim contiguous), else allocated in
                ``out_dtype``.
            sinks: optional fp32 ``[H_q]`` attention-sink logits (GPT-OSS), natural log, added to
                each head's softmax denominator only (in the merge).

        Returns:
            ``[B, H_q, D_v]`` in the rotated V frame.

        Raises:
            ValueError: ``q`` of another shape or dtype than the plan's, ``sm_scale`` not finite and > 0, a
                logit cap on a plan without one (or none on a plan with one), (debug) bad indices.
        """
        if q.shape != self.q_shape:
            raise ValueError(f"q has shape {tuple(q.shape)}; this plan was built for {self.q_shape}")
        if q.dtype != self.q_dtype:
            raise ValueError(f"q has dtype {q.dtype}; this plan was built for {self.q_dtype}")
        check_sinks(sinks, self.q_shape[1], self.device, "DecodePlan.run")
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        if self.debug:
            debug_request_indices(self.req_pool_indices, self.seq_lens, self.hp_index, self.req_to_token,
                                  self._hp_rows, self._slots, self.sink, self.recent, prefix_mode=False,
                                  sink_lens=self.sink_lens, sliding_window=self.sliding_window)
        if self.batch == 0:
            return out
        qscale, cap_log2e = run_scales(self.has_cap, q.shape[-1], sm_scale, logit_cap)
        if self.engine == "gluon":
            # stage 1, both tiers, in one Gluon launch
            launch_gluon_decode(q, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v, self.hp_index, self.req_to_token,
                                self.req_pool_indices, self.seq_lens, self.sink_lens, self.o_part, self.lse,
                                qscale=qscale, **self._gluon)
        else:
            kc, kp, vc, vp, hk, hv = self._strides
            _launch(_decode_stage1, self.grid, q, q.stride(0), q.stride(1),
                k_codes, *kc, k_pairs, *kp, v_codes, *vc, v_pairs, *vp, hp_k, *hk, hp_v, *hv, *self._tables,
                qscale, cap_log2e, self.sink, self.recent, self.sliding_window or 0,
                *self._consts, **self._constexprs,
            )
        launch_merge(self.o_part, self.lse, out, self.num_splits, *self._merge, sinks=sinks)
        return out


def decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_pairs: torch.Tensor,
    v_codes: torch.Tensor,
    v_pairs: torch.Tensor,
    hp_k: torch.Tensor,
    hp_v: torch.Tensor,
    hp_index: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: Int2Layout,
    *,
    sink: int,
    recent: int,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    rotation_v: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    num_kv_splits: int | None = None,
    num_hp_splits: int | None = None,
    max_seq_len: int | None = None,
    workspace: tuple | None = None,
    mma_dtype: torch.dtype | None = None,
    config=None,
    sink_lens: torch.Tensor | None = None,
    debug: bool | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One-shot decode attention: build a :class:`DecodePlan` for this call and run it.

    Args:
        q: ``[B, H_q, D_k]`` rotated queries; the other tensors and settings as :class:`DecodePlan`
            and :meth:`DecodePlan.run` take them.
        rotation_v: if given (``[D_v, D_v]`` or ``[H_kv, D_v, D_v]``), return ``o R_v^T``.
        sinks: optional fp32 ``[H_q]`` attention-sink logits (natural log, denominator only).
        out: optional ``[B, H_q, D_v]`` output (the counter-rotated one with ``rotation_v``).
        out_dtype: default ``out.dtype`` if ``out`` is given, else ``q.dtype``.

    Returns:
        ``[B, H_q, D_v]`` in ``out_dtype``.

    Raises:
        ValueError: as :class:`DecodePlan` and :meth:`DecodePlan.run`.
    """
    check_query(layout, q)
    out_dtype = out_dtype or (out.dtype if out is not None else q.dtype)
    plan = DecodePlan(layout, q.shape[1], (k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v), hp_index, req_to_token,
                      req_pool_indices, seq_lens, sink=sink, recent=recent, q_dtype=q.dtype, sink_lens=sink_lens,
                      sliding_window=sliding_window, logit_cap=logit_cap, out_dtype=out_dtype, mma_dtype=mma_dtype,
                      num_kv_splits=num_kv_splits, num_hp_splits=num_hp_splits, max_seq_len=max_seq_len,
                      workspace=workspace, config=config, debug=debug)
    check_tensor(req_pool_indices, "req_pool_indices", ndim=1, dtypes=INDEX_DTYPES, device=q.device, shape=(q.shape[0],))
    return run_once(plan, q, (k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v), sm_scale=sm_scale,
                    logit_cap=logit_cap, out=out, out_dtype=out_dtype, rotation_v=rotation_v, empty=plan.batch == 0,
                    sinks=sinks)
