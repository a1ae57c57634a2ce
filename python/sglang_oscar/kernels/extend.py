"""Extend / prefill attention over the two-tier cache (window mode ``"extend"``).

A batch of new chunks (varlen: request ``b`` has ``extend_seq_lens[b]`` new tokens after
``extend_prefix_lens[b]`` cached ones; its queries are rows ``qo_indptr[b] ...`` of ``q``)
attends causally to its prefix *and itself*: position ``p < sink`` is read from the HP row
``hp_index[req, p]``, every other position from the INT2 slot ``req_to_token[req, p]`` -- the
chunk's own tokens included, so they must be written (``write_kv``) before this kernel runs.
The result of a position therefore does not depend on how the prompt was chunked.

Grid ``(cdiv(max_extend_len, BLOCK_M), batch, q_heads)``; one program = ``BLOCK_M`` query
tokens of one head, single pass (flash attention), output written in the rotated V frame, plus
the natural-log LSE per (token, head) if requested.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import (
    attn_constants,
    check_cache,
    check_out_dtype,
    check_query,
    debug_request_indices,
    layout_constexprs,
    resolve_mma_dtype,
    run_once,
    run_scales,
)
from .compile_check import launch as _launch
from .compile_check import row_args
from .layout import TORCH_TO_TL, Int2Layout
from .configs import GluonConfig, TritonConfig, default_triton_config, effective_convert
from .validate import INDEX_DTYPES, check_sinks, check_tensor, debug_enabled, needs_idx64
from .tiles import (
    NEG_INF,
    hp_scores,
    hp_values,
    int2_scores,
    int2_values,
    load_q_quarter,
    request_sink_len,
    softmax_update,
    store_quarters,
)


@triton.jit
def _extend_kernel(
    Q, stride_qn, stride_qh,
    KC, stride_kcs, stride_kch, KP, stride_kps, stride_kph,
    VC, stride_vcs, stride_vch, VP, stride_vps, stride_vph,
    HK, stride_hkr, stride_hkh, HV, stride_hvr, stride_hvh,
    HPI, stride_hpi, R2T, stride_r2t, RPI, QO_INDPTR, PREFIX, EXTLEN, SINKL,
    O, stride_on, stride_oh, LSE, stride_ln, stride_lh, SINKS,
    qscale, cap_log2e, sink, window,
    A4, RB, C0, l0, l1, l2, l3,
    GROUP: tl.constexpr,
    QK: tl.constexpr, QKP: tl.constexpr, GK: tl.constexpr, NGK: tl.constexpr, K_FAST: tl.constexpr,
    QV: tl.constexpr, QVP: tl.constexpr, GV: tl.constexpr, NGV: tl.constexpr, V_FAST: tl.constexpr,
    LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, CONVERT: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_LSE: tl.constexpr, OUT_DT: tl.constexpr,
    IDX64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINKL: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):
    mb = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    ext = tl.load(EXTLEN + b).to(tl.int32)
    if mb * BLOCK_M < ext:
        kvh64 = (h // GROUP).to(tl.int64)
        h64 = h.to(tl.int64)
        req = tl.load(RPI + b).to(tl.int64)
        q_start = tl.load(QO_INDPTR + b).to(tl.int64)
        prefix = tl.load(PREFIX + b).to(tl.int32)
        sink_r = request_sink_len(SINKL, req, sink, prefix, HAS_SINKL)
        mi = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = mi < ext
        pos_q = prefix + mi
        rows_q = q_start + mi.to(tl.int64)
        qoff = rows_q * stride_qn + h64 * stride_qh
        q0, qb0, sq0 = load_q_quarter(Q, qoff, rmask, qscale, RB, 0, QK, QKP, OP, LM)
        q1, qb1, sq1 = load_q_quarter(Q, qoff, rmask, qscale, RB, 1, QK, QKP, OP, LM)
        q2, qb2, sq2 = load_q_quarter(Q, qoff, rmask, qscale, RB, 2, QK, QKP, OP, LM)
        q3, qb3, sq3 = load_q_quarter(Q, qoff, rmask, qscale, RB, 3, QK, QKP, OP, LM)

        m = tl.full([BLOCK_M], NEG_INF, tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc0 = tl.zeros([BLOCK_M, QVP], tl.float32)
        acc1 = tl.zeros([BLOCK_M, QVP], tl.float32)
        acc2 = tl.zeros([BLOCK_M, QVP], tl.float32)
        acc3 = tl.zeros([BLOCK_M, QVP], tl.float32)

        hi = prefix + tl.minimum(mb * BLOCK_M + BLOCK_M, ext)
        if HAS_WINDOW:
            lo = tl.maximum(prefix + mb * BLOCK_M - window + 1, 0)
        else:
            lo = hi * 0

        # ---- HP sink positions [lo, min(sink_r, hi))
        HK_h = HK + kvh64 * stride_hkh
        HV_h = HV + kvh64 * stride_hvh
        for j0 in range(lo, tl.minimum(sink_r, hi), BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            tm = j < tl.minimum(sink_r, hi)
            rows = tl.load(HPI + req * stride_hpi + j, mask=tm, other=-1)
            tm = tm & (rows >= 0)
            rows = tl.where(tm, rows, 0)
            if IDX64:
                rows = rows.to(tl.int64)
            else:
                rows = rows.to(tl.int32)
            vis = tm[None, :] & (j[None, :] <= pos_q[:, None])
            if HAS_WINDOW:
                vis = vis & ((pos_q[:, None] - j[None, :]) < window)
            s = hp_scores(q0, q1, q2, q3, HK_h, stride_hkr, rows, tm, QK, QKP, OP, PREC)
            p, alpha, m, l = softmax_update(s, vis, m, l, cap_log2e, HAS_CAP)
            acc0, acc1, acc2, acc3 = hp_values(p, alpha, acc0, acc1, acc2, acc3, HV_h, stride_hvr, rows, tm,
                                               QV, QVP, OP, PREC)

        # ---- INT2 positions [max(sink_r, lo), hi)
        KC_h = KC + kvh64 * stride_kch
        KP_h = KP + kvh64 * stride_kph
        VC_h = VC + kvh64 * stride_vch
        VP_h = VP + kvh64 * stride_vph
        r2t = R2T + req * stride_r2t
        corr = tl.zeros([BLOCK_M], tl.float32)
        ref = 1.0
        for j0 in range(tl.maximum(sink_r, lo), hi, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            tm = j < hi
            slots = tl.load(r2t + j, mask=tm, other=-1)
            tm = tm & (slots >= 0)
            slots = tl.where(tm, slots, 0)
            if IDX64:
                slots = slots.to(tl.int64)
            else:
                slots = slots.to(tl.int32)
            vis = tm[None, :] & (j[None, :] <= pos_q[:, None])
            if HAS_WINDOW:
                vis = vis & ((pos_q[:, None] - j[None, :]) < window)
            s = int2_scores(q0, q1, q2, q3, qb0, qb1, qb2, qb3, sq0, sq1, sq2, sq3, KC_h, stride_kcs, KP_h,
                            stride_kps, slots, tm, A4, C0, l0, l1, l2, l3, QK, QKP, GK, NGK, K_FAST, LM, OP, PREC,
                            CONVERT)
            p, alpha, m, l = softmax_update(s, vis, m, l, cap_log2e, HAS_CAP)
            acc0, acc1, acc2, acc3, corr, ref = int2_values(
                p, alpha, acc0, acc1, acc2, acc3, corr, ref, VC_h, stride_vcs, VP_h, stride_vps, slots, tm,
                slots, tm, A4, RB, C0, l0, l1, l2, l3, QV, QVP, GV, NGV, V_FAST, LM, OP, PREC, CONVERT, True)

        if HAS_SINKS:
            # the head's sink logit (natural log) joins the denominator only, relative to the running max
            sink2 = tl.load(SINKS + h64).to(tl.float32) * 1.4426950408889634
            l += tl.where(m > NEG_INF, tl.exp2(sink2 - tl.where(m > NEG_INF, m, 0.0)), 0.0)
        has = l > 0.0
        inv_l = tl.where(has, 1.0 / tl.where(has, l, 1.0), 0.0)
        ooff = rows_q * stride_on + h64 * stride_oh
        store_quarters(O, ooff, rmask, acc0, acc1, acc2, acc3, inv_l, QV, QVP, OUT_DT)
        if HAS_LSE:
            lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453, NEG_INF)
            tl.store(LSE + rows_q * stride_ln + h64 * stride_lh, lse, mask=rmask)


class ExtendPlan:
    """The launch of one extend (prefill) batch for one KV geometry: checks, config, grid and kernel
    constants resolved once; :meth:`run` launches one layer.

    Args:
        layout: the layers' :class:`Int2Layout`; num_q_heads: ``H_q``; num_tokens: ``N``, the rows of
            the ``q`` that :meth:`run` gets (all chunks of the batch).
        buffers: ``(k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v)`` of one layer, shaped like every
            layer the plan runs (as :class:`~.decode.plan.DecodePlan`).
        hp_index, req_to_token, req_pool_indices, sink_lens: as :class:`~.decode.plan.DecodePlan`.
        qo_indptr: int ``[B+1]`` (or ``[B]``): request ``b``'s queries are rows ``qo_indptr[b] :
            qo_indptr[b] + extend_seq_lens[b]`` of ``q``, at positions ``extend_prefix_lens[b] + i``.
        extend_prefix_lens, extend_seq_lens: int ``[B]``.
        sink: HP sink size (tokens); q_dtype: dtype of the queries.
        max_extend_len: host bound on ``extend_seq_lens`` (default: read from the device, a sync).
        sliding_window, logit_cap (on / off; the value is a :meth:`run` argument), out_dtype,
            mma_dtype, debug: as :class:`~.decode.plan.DecodePlan`.
        config: ``None`` or the type :class:`~.configs.TritonConfig` (:func:`~.configs.default_triton_config`
            for extend), or a :class:`~.configs.TritonConfig` (extend has only a Triton kernel).
        return_lse: :meth:`run` also returns the natural-log LSE ``[N, H_q]`` fp32.

    Raises:
        ValueError: unsupported layout, mismatched shapes / dtypes / devices, a config that is not a
            :class:`~.configs.TritonConfig`, (debug) bad indices.
    """

    def __init__(self, layout: Int2Layout, num_q_heads: int, num_tokens: int, buffers: tuple,
                 hp_index: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                 qo_indptr: torch.Tensor, extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor, *,
                 sink: int, q_dtype: torch.dtype, max_extend_len: int | None = None,
                 sink_lens: torch.Tensor | None = None, sliding_window: int | None = None,
                 logit_cap: float | None = None, out_dtype: torch.dtype | None = None,
                 mma_dtype: torch.dtype | None = None, config=None, return_lse: bool = False,
                 debug: bool | None = None):
        if not (config is None or config is TritonConfig or isinstance(config, TritonConfig)):
            what = "GluonConfig (the Gluon engine is decode only)" if config is GluonConfig or isinstance(
                config, GluonConfig) else repr(config)
            raise ValueError(f"extend config must be None or a TritonConfig, got {what}")
        k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v = buffers
        check_tensor(k_codes, "k_codes", ndim=3)
        dev = k_codes.device
        n, hq = num_tokens, num_q_heads
        hkv = check_cache(layout, dev, hq, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v, hp_index, req_to_token,
                          sink, 0, sliding_window, logit_cap)
        check_tensor(req_pool_indices, "req_pool_indices", ndim=1, dtypes=INDEX_DTYPES, device=dev)
        bsz = req_pool_indices.shape[0]
        check_tensor(extend_prefix_lens, "extend_prefix_lens", ndim=1, dtypes=INDEX_DTYPES, device=dev, shape=(bsz,))
        check_tensor(extend_seq_lens, "extend_seq_lens", ndim=1, dtypes=INDEX_DTYPES, device=dev, shape=(bsz,))
        check_tensor(qo_indptr, "qo_indptr", ndim=1, dtypes=INDEX_DTYPES, device=dev)
        if qo_indptr.shape[0] not in (bsz, bsz + 1):
            raise ValueError(f"qo_indptr has {qo_indptr.shape[0]} entries for {bsz} requests")
        op = resolve_mma_dtype(mma_dtype, hp_k.dtype)
        has_cap = logit_cap is not None and logit_cap > 0
        tn = config if isinstance(config, TritonConfig) else default_triton_config(
            layout, extend=True, mma_dtype=op, windowed=sliding_window is not None, capped=has_cap)
        out_dtype = out_dtype or q_dtype
        check_out_dtype(out_dtype)
        if debug_enabled(debug):
            ext = extend_seq_lens.long().cpu()
            ind = qo_indptr.long().cpu()
            if bsz and (int(ext.min()) < 0 or int((ind[:bsz] + ext).max()) > n or int(ind[:bsz].min()) < 0):
                raise ValueError("qo_indptr / extend_seq_lens address rows outside q")
            if int(extend_prefix_lens.min()) < 0 if bsz else False:
                raise ValueError("extend_prefix_lens has negative entries")
            debug_request_indices(req_pool_indices, (extend_prefix_lens + extend_seq_lens), hp_index, req_to_token,
                                  hp_k.shape[0], k_codes.shape[0], sink, 0, prefix_mode=True, sink_lens=sink_lens,
                                  sliding_window=sliding_window, first_query=extend_prefix_lens)
        if max_extend_len is None:
            max_extend_len = int(extend_seq_lens.max()) if bsz else 0
        self.layout, self.device, self.config = layout, dev, tn
        self.num_kv_heads, self.q_shape = hkv, (n, hq, layout.k.head_dim)
        self.out_shape = (n, hq, layout.v.head_dim)
        self.q_dtype, self.out_dtype, self.return_lse = q_dtype, out_dtype, return_lse
        self.has_cap = has_cap
        self.empty = not (bsz and max_extend_len > 0 and n > 0)
        self._tables = (hp_index, hp_index.stride(0), req_to_token, req_to_token.stride(0), req_pool_indices,
                        qo_indptr, extend_prefix_lens, extend_seq_lens, hp_index if sink_lens is None else sink_lens)
        self._scalars = (sink, sliding_window or 0)
        self.grid = (triton.cdiv(max_extend_len, tn.block_m), bsz, hq)
        self._consts = attn_constants(layout)
        self._constexprs = dict(
            GROUP=hq // hkv, **layout_constexprs(layout),
            OP=TORCH_TO_TL[op], PREC="ieee" if op == torch.float32 else None,
            CONVERT=effective_convert(tn.convert, op, False),
            HAS_CAP=self.has_cap, HAS_WINDOW=sliding_window is not None, HAS_LSE=return_lse,
            IDX64=needs_idx64(*buffers), BLOCK_M=tn.block_m, BLOCK_N=tn.block_n,
            HAS_SINKL=sink_lens is not None,
            num_warps=tn.num_warps, num_stages=tn.num_stages, **tn.launch_options(),
        )

    def run(self, q: torch.Tensor, k_codes: torch.Tensor, k_pairs: torch.Tensor, v_codes: torch.Tensor,
            v_pairs: torch.Tensor, hp_k: torch.Tensor, hp_v: torch.Tensor, *, sm_scale: float | None = None,
            logit_cap: float | None = None, out: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
        """Extend attention of one layer (buffers shaped as the plan's; not checked again). ``sinks``:
        optional fp32 ``[H_q]`` attention-sink logits (natural log), added to each head's softmax
        denominator (as :class:`~.decode.plan.DecodePlan.run`).

        Returns:
            ``o [N, H_q, D_v]`` in the rotated V frame (``out`` if given, else in ``out_dtype``), and
            the LSE ``[N, H_q]`` fp32 if the plan was built with ``return_lse``.

        Raises:
            ValueError: ``q`` of another shape or dtype than the plan's, ``sm_scale`` not finite and > 0, a
                logit cap that does not match the plan's.
        """
        if q.shape != self.q_shape:
            raise ValueError(f"q has shape {tuple(q.shape)}; this plan was built for {self.q_shape}")
        if q.dtype != self.q_dtype:
            raise ValueError(f"q has dtype {q.dtype}; this plan was built for {self.q_dtype}")
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        lse = torch.empty(self.out_shape[:2], dtype=torch.float32, device=self.device) if self.return_lse else out
        check_sinks(sinks, self.q_shape[1], self.device, "ExtendPlan.run")
        if not self.empty:
            qscale, cap_log2e = run_scales(self.has_cap, q.shape[-1], sm_scale, logit_cap)
            _launch(_extend_kernel, self.grid,
                *row_args(q, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v), *self._tables,
                out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1), lse if sinks is None else sinks,
                qscale, cap_log2e, *self._scalars, *self._consts,
                OUT_DT=TORCH_TO_TL[out.dtype], HAS_SINKS=sinks is not None, **self._constexprs,
            )
        return (out, lse) if self.return_lse else out


def extend_attention(
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
    qo_indptr: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    layout: Int2Layout,
    *,
    sink: int,
    max_extend_len: int | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    rotation_v: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    return_lse: bool = False,
    mma_dtype: torch.dtype | None = None,
    config=None,
    sink_lens: torch.Tensor | None = None,
    debug: bool | None = None,
    sinks: torch.Tensor | None = None,
):
    """One-shot extend attention: build an :class:`ExtendPlan` for this call and run it.

    Causal attention of new chunks over their cached prefix and themselves: positions ``< sink``
    are read from HP rows ``hp_index[req, p]``; every other position -- the chunk's own tokens
    included, which must already be written -- from INT2 slots ``req_to_token[req, p]``.

    Args:
        q: ``[N, H_q, D_k]`` rotated queries of all chunks; the other tensors and settings as
            :class:`ExtendPlan` and :meth:`ExtendPlan.run` take them.
        rotation_v: if given (``[D_v, D_v]`` or ``[H_kv, D_v, D_v]``), return ``o R_v^T``.
        sinks: optional fp32 ``[H_q]`` attention-sink logits (natural log, denominator only).
        out: optional ``[N, H_q, D_v]`` output (the counter-rotated one with ``rotation_v``).
        out_dtype: default ``out.dtype`` if ``out`` is given, else ``q.dtype``.

    Returns:
        ``o [N, H_q, D_v]`` (and the natural-log LSE ``[N, H_q]`` fp32, rotated frame, if ``return_lse``).

    Raises:
        ValueError: as :class:`ExtendPlan` and :meth:`ExtendPlan.run`.
    """
    check_query(layout, q)
    out_dtype = out_dtype or (out.dtype if out is not None else q.dtype)
    plan = ExtendPlan(layout, q.shape[1], q.shape[0], (k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v), hp_index,
                      req_to_token, req_pool_indices, qo_indptr, extend_prefix_lens, extend_seq_lens, sink=sink,
                      q_dtype=q.dtype, max_extend_len=max_extend_len, sink_lens=sink_lens,
                      sliding_window=sliding_window, logit_cap=logit_cap, out_dtype=out_dtype, mma_dtype=mma_dtype,
                      config=config, return_lse=return_lse, debug=debug)
    return run_once(plan, q, (k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v), sm_scale=sm_scale,
                    logit_cap=logit_cap, out=out, out_dtype=out_dtype, rotation_v=rotation_v, sinks=sinks)
