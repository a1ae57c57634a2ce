"""Latent decode stage 1 that multiplies the 2-bit codes themselves (the ``"codes"`` engine of
:func:`~sglang_oscar.kernels.latent_plan.latent_decode_attention`).

With a uniform quantizer the level of code ``c`` is ``l0 + dl c``, and when a quarter of the rank
(``Q = R/4`` elements) lies in one group, row ``j`` of quarter ``k`` dequantizes to
``s_jk (l0 + dl c_j - z_jk)`` with one (scale, zero) pair ``(s_jk, z_jk)``. So, for a query quarter
``q_k`` with element sum ``S_k``:

    q_k . c'_jk        = s_jk (dl (q_k . c_j) + (l0 - z_jk) S_k)
    sum_j p_j c'_jk    = dl ((p * s_k) @ c)_k + sum_j p_j s_jk (l0 - z_jk)

The MMAs take the codes as exact small integers; the per-row scale and the affine terms are applied
to the ``[heads, BLOCK_N]`` products instead of the ``[BLOCK_N, Q]`` tiles, which saves the
elementwise dequantization (level lookup, subtract, multiply per element and head block). Positions
are split by tier as the MHA decode splits them: the INT2 interval ``[max(lo, sink_r), min(hi,
rec_start))`` of a program's range goes through codes, the sink and recent positions around it
through their BF16 rows. The result equals the dequantizing kernel's up to the rounding of the
operands (exact in fp32: ``tests/kernels/test_latent.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .latent import (_attend_tile, _empty_state, _load_query, _mma, _program, _quarter_pair, _softmax_step,
                     _store_partial)


@triton.jit
def _hp_block(pos, valid, req, sink, ring, sink_r, HPI, stride_hpi, HC, stride_hcr, HPE, stride_hper,
              q0, q1, q2, q3, qp, m, l, acc0, acc1, acc2, acc3, pcols, pmask,
              Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """One block of sink / recent positions: BF16 latent rows and their ``k_pe``."""
    cols = tl.arange(0, Q)
    entry = tl.where(pos < sink_r, pos, sink + pos % ring)
    row = tl.load(HPI + req * stride_hpi + entry, mask=valid, other=-1)
    ok = valid & (row >= 0)
    rows = tl.where(ok, row, 0).to(tl.int64)
    base = HC + rows[:, None] * stride_hcr + cols[None, :]
    c0 = tl.load(base, mask=ok[:, None], other=0.0).to(tl.float32)
    c1 = tl.load(base + Q, mask=ok[:, None], other=0.0).to(tl.float32)
    c2 = tl.load(base + 2 * Q, mask=ok[:, None], other=0.0).to(tl.float32)
    c3 = tl.load(base + 3 * Q, mask=ok[:, None], other=0.0).to(tl.float32)
    kpe = tl.load(HPE + rows[:, None] * stride_hper + pcols[None, :], mask=ok[:, None] & pmask[None, :],
                  other=0.0).to(tl.float32)
    return _attend_tile(q0, q1, q2, q3, qp, c0, c1, c2, c3, kpe, valid[None, :], m, l, acc0, acc1, acc2, acc3,
                        BLOCK_H, BLOCK_N, DOT)


@triton.jit
def _latent_decode_stage1_codes(
    QA, stride_qab, stride_qah, QP, stride_qpb, stride_qph,
    KC, stride_kcs, KPR, stride_kps, KPE, stride_kpe, HC, stride_hcr, HPE, stride_hper,
    HPI, stride_hpi, R2T, stride_r2t, RPI, SEQ, SINKL,
    OPART, stride_ob, stride_oh, stride_os, LSE, stride_lb, stride_lh,
    qscale, sink, recent, num_splits, l0, dl,
    H: tl.constexpr, Q: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, G: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINKL: tl.constexpr, DOT: tl.constexpr,
):
    """The grid and outputs of :func:`~sglang_oscar.kernels.latent._latent_decode_stage1`; levels
    ``l0 + dl c`` (uniform quantizer) and ``G`` a multiple of ``Q`` (module docstring)."""
    b, heads, hmask, sp, req, lo, hi, ring, sink_r, rec_start = _program(
        RPI, SEQ, SINKL, sink, recent, num_splits, H, BLOCK_H, BLOCK_N, HAS_SINKL)
    # this program's INT2 interval; sink and recent positions on either side of it
    i_lo = tl.minimum(tl.maximum(lo, sink_r), hi)
    i_hi = tl.maximum(tl.minimum(hi, rec_start), i_lo)

    hrow = heads.to(tl.int64)
    q0, q1, q2, q3, qp, pcols, pmask = _load_query(QA, QP, b.to(tl.int64) * stride_qab + hrow * stride_qah,
                                                   b.to(tl.int64) * stride_qpb + hrow * stride_qph, hmask, qscale,
                                                   Q, P, PP)
    cols = tl.arange(0, Q)
    if DOT == 2:  # the query as the MMA sees it, so the affine sums below match its products
        q0 = q0.to(tl.bfloat16).to(tl.float32)
        q1 = q1.to(tl.bfloat16).to(tl.float32)
        q2 = q2.to(tl.bfloat16).to(tl.float32)
        q3 = q3.to(tl.bfloat16).to(tl.float32)
    qs0 = tl.sum(q0, axis=1)
    qs1 = tl.sum(q1, axis=1)
    qs2 = tl.sum(q2, axis=1)
    qs3 = tl.sum(q3, axis=1)

    m, l, acc0, acc1, acc2, acc3 = _empty_state(BLOCK_H, Q)
    for n0 in range(lo, i_lo, BLOCK_N):  # sink positions before the INT2 interval
        pos = n0 + tl.arange(0, BLOCK_N)
        m, l, acc0, acc1, acc2, acc3 = _hp_block(pos, pos < i_lo, req, sink, ring, sink_r, HPI, stride_hpi, HC,
                                                 stride_hcr, HPE, stride_hper, q0, q1, q2, q3, qp, m, l, acc0, acc1,
                                                 acc2, acc3, pcols, pmask, Q, BLOCK_H, BLOCK_N, DOT)
    for n0 in range(i_lo, i_hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < i_hi
        slots = tl.load(R2T + req * stride_r2t + pos, mask=valid, other=0).to(tl.int64)
        ok = valid & (slots >= 0)  # a -1 slot (SGLang's padding) is never read: code 0, scale 0
        slots = tl.where(ok, slots, 0)
        byte = tl.load(KC + slots[:, None] * stride_kcs + cols[None, :], mask=ok[:, None], other=0)
        c0 = (byte & 3).to(tl.float32)
        c1 = ((byte >> 2) & 3).to(tl.float32)
        c2 = ((byte >> 4) & 3).to(tl.float32)
        c3 = ((byte >> 6) & 3).to(tl.float32)
        s0, z0 = _quarter_pair(KPR, slots, stride_kps, ok, 0, Q, G)
        s1, z1 = _quarter_pair(KPR, slots, stride_kps, ok, 1, Q, G)
        s2, z2 = _quarter_pair(KPR, slots, stride_kps, ok, 2, Q, G)
        s3, z3 = _quarter_pair(KPR, slots, stride_kps, ok, 3, Q, G)
        kpe = tl.load(KPE + slots[:, None] * stride_kpe + pcols[None, :], mask=ok[:, None] & pmask[None, :],
                      other=0.0).to(tl.float32)
        s = _mma(qp, tl.trans(kpe), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), DOT)
        zero_n = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        s += (dl * s0)[None, :] * _mma(q0, tl.trans(c0), zero_n, DOT) + ((l0 - z0) * s0)[None, :] * qs0[:, None]
        s += (dl * s1)[None, :] * _mma(q1, tl.trans(c1), zero_n, DOT) + ((l0 - z1) * s1)[None, :] * qs1[:, None]
        s += (dl * s2)[None, :] * _mma(q2, tl.trans(c2), zero_n, DOT) + ((l0 - z2) * s2)[None, :] * qs2[:, None]
        s += (dl * s3)[None, :] * _mma(q3, tl.trans(c3), zero_n, DOT) + ((l0 - z3) * s3)[None, :] * qs3[:, None]
        p, alpha, m, l = _softmax_step(s, valid[None, :], m, l)
        acc0 = _mma(p * (dl * s0)[None, :], c0, acc0 * alpha[:, None], DOT) + tl.sum(p * ((l0 - z0) * s0)[None, :], 1)[:, None]
        acc1 = _mma(p * (dl * s1)[None, :], c1, acc1 * alpha[:, None], DOT) + tl.sum(p * ((l0 - z1) * s1)[None, :], 1)[:, None]
        acc2 = _mma(p * (dl * s2)[None, :], c2, acc2 * alpha[:, None], DOT) + tl.sum(p * ((l0 - z2) * s2)[None, :], 1)[:, None]
        acc3 = _mma(p * (dl * s3)[None, :], c3, acc3 * alpha[:, None], DOT) + tl.sum(p * ((l0 - z3) * s3)[None, :], 1)[:, None]
    for n0 in range(i_hi, hi, BLOCK_N):  # recent positions after the INT2 interval (i_hi >= lo, or empty)
        pos = n0 + tl.arange(0, BLOCK_N)
        m, l, acc0, acc1, acc2, acc3 = _hp_block(pos, pos < hi, req, sink, ring, sink_r, HPI, stride_hpi, HC,
                                                 stride_hcr, HPE, stride_hper, q0, q1, q2, q3, qp, m, l, acc0, acc1,
                                                 acc2, acc3, pcols, pmask, Q, BLOCK_H, BLOCK_N, DOT)

    _store_partial(OPART, stride_ob, stride_oh, stride_os, LSE, stride_lb, stride_lh, b, heads, hmask, sp,
                   m, l, acc0, acc1, acc2, acc3, Q)
