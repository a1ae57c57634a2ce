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

import triton
import triton.language as tl

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
    O, stride_on, stride_oh, LSE, stride_ln, stride_lh,
    qscale, cap_log2e, sink, window,
    A4, RB, C0, l0, l1, l2, l3,
    GROUP: tl.constexpr,
    QK: tl.constexpr, QKP: tl.constexpr, GK: tl.constexpr, NGK: tl.constexpr, K_FAST: tl.constexpr,
    QV: tl.constexpr, QVP: tl.constexpr, GV: tl.constexpr, NGV: tl.constexpr, V_FAST: tl.constexpr,
    LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, CONVERT: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_LSE: tl.constexpr, OUT_DT: tl.constexpr,
    IDX64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINKL: tl.constexpr = False,
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

        has = l > 0.0
        inv_l = tl.where(has, 1.0 / tl.where(has, l, 1.0), 0.0)
        ooff = rows_q * stride_on + h64 * stride_oh
        store_quarters(O, ooff, rmask, acc0, acc1, acc2, acc3, inv_l, QV, QVP, OUT_DT)
        if HAS_LSE:
            lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453, NEG_INF)
            tl.store(LSE + rows_q * stride_ln + h64 * stride_lh, lse, mask=rmask)
