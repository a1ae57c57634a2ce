"""Token-major INT2 tiles of the decode kernel (:mod:`.triton_stage1`, ``TOKEN_MAJOR``).

The MMA's large dimension is the token axis: scores are ``S^T [N, M] = codes [N, Q] @ q^T [Q, M]`` and
values ``O^T [Q_v, M] = codes^T [Q_v, N] @ P^T [N, M]``. With few q heads per kv head (M = 4..8) this
halves the per-element fp32 work of the padded head-major tiles (:mod:`..tiles`, whose module
docstring derives the fast-path algebra both share).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..codes import code_operand, perm4_index, round_to
from ..tiles import NEG_INF, SUB_SHIFT



@triton.jit
def load_qt_quarter(Q, qoff, rmask, qscale, RB, K: tl.constexpr, QD: tl.constexpr, QDP: tl.constexpr,
                    OP: tl.constexpr, LM: tl.constexpr, PERM: tl.constexpr = False, SUB: tl.constexpr = False):
    """Transposed :func:`load_q_quarter`: ``[QDP, M]`` operands and ``[M]`` sums.

    ``SUB`` (subnormal code operands ``c * 2^(2K-24)``): the operands are ``q * 2^(SUB_SHIFT-2K)``
    and, for Lloyd-Max, ``round(q * 2 RB) * 2^(SUB_SHIFT-2K)`` -- power-of-two scalings of the
    rounded values, exact while they stay fp16-normal (``SUB_SHIFT`` = 8 keeps quarter 3's operand
    4x the rounded q, so only elements below ~2^-16 go subnormal; overflow needs |q| > 256 after
    the softmax pre-scale); the sums stay those of the unscaled rounded ``q``.
    """
    jq = tl.arange(0, QDP)
    if PERM:
        jq = perm4_index(jq)
    q = tl.load(Q + qoff[None, :] + (K * QD + jq)[:, None], mask=rmask[None, :] & (jq < QD)[:, None], other=0.0)
    q = round_to(q.to(tl.float32) * qscale, OP)
    sq = tl.sum(q.to(tl.float32), axis=0)
    if SUB:
        f: tl.constexpr = (2.0 ** SUB_SHIFT) / (4 ** K)
        if LM:
            qb = round_to(round_to(q.to(tl.float32) * (2.0 * RB), OP).to(tl.float32) * f, OP)
        else:
            qb = q
        q = round_to(q.to(tl.float32) * f, OP)
        if not LM:
            qb = q
    elif LM:
        qb = round_to(q.to(tl.float32) * RB, OP)
    else:
        qb = q
    return q, qb, sq


@triton.jit
def load_int2_codes_t(KC_h, stride_kcs, VC_h, stride_vcs, slots, tmask, vslots, vmask, QK: tl.constexpr,
                      QKP: tl.constexpr, QV: tl.constexpr, QVP: tl.constexpr):
    """Code tiles of one token-major INT2 block: ``bk [N, QKP]`` and ``bv [QVP, N]`` uint8 (masked -> 0)."""
    jq = tl.arange(0, QKP)
    bk = tl.load(KC_h + slots[:, None] * stride_kcs + jq[None, :],
                 mask=tmask[:, None] & (jq < QK)[None, :], other=0)
    jv = tl.arange(0, QVP)
    bv = tl.load(VC_h + vslots[None, :] * stride_vcs + jv[:, None],
                 mask=(jv < QV)[:, None] & vmask[None, :], other=0)
    return bk, bv


@triton.jit
def load_int2_pairs_t(KP_h, stride_kps, VP_h, stride_vps, slots, tmask):
    """``(sk, zk, sv, zv)`` ``[N]`` (storage dtype; masked -> 0) of one block, one pair group per row."""
    sk = tl.load(KP_h + slots * stride_kps, mask=tmask, other=0.0)
    zk = tl.load(KP_h + slots * stride_kps + 1, mask=tmask, other=0.0)
    sv = tl.load(VP_h + slots * stride_vps, mask=tmask, other=0.0)
    zv = tl.load(VP_h + slots * stride_vps + 1, mask=tmask, other=0.0)
    return sk, zk, sv, zv


@triton.jit
def int2_scores_t_loaded(q0, q1, q2, q3, qb0, qb1, qb2, qb3, sq0, sq1, sq2, sq3, bk, sk, zk, A4, C0, RB,
                         LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, CONVERT: tl.constexpr):
    """``S^T [N, M]`` from a loaded block (:func:`load_int2_codes_t`, :func:`load_int2_pairs_t`);
    ``RB = B2 / A4`` (Lloyd-Max bit-0 coefficient, ``layout.affine_levels``).

    Subnormal operands (``CONVERT`` 5/6): with ``level = (A4/4) c + (B2/2) b0 + C0'`` (``C0' = A4 +
    B2 + C0``, ``B2 = RB A4``) and q pre-scaled by ``2^(S-2K)`` (:func:`load_qt_quarter`, ``S =
    SUB_SHIFT``), the MMA gives ``d = 2^(S-24) (q . c + 2 RB q . b0)``, so ``score = s A4 2^(22-S)
    (d - 2^(S-24) (4/A4) (z - C0') sum q)``.
    """
    if CONVERT >= 5:
        sc = sk.to(tl.float32) * (A4 * (2.0 ** (22 - SUB_SHIFT)))
        zc = (zk.to(tl.float32) - (A4 + RB * A4 + C0)) * (4.0 / A4 * (2.0 ** (SUB_SHIFT - 24)))
    else:
        sc = sk.to(tl.float32) * A4
        zc = (zk.to(tl.float32) - C0) / A4
    d = tl.dot(code_operand(bk, 0, OP, False, CONVERT, 1), q0, input_precision=PREC)
    d = tl.dot(code_operand(bk, 1, OP, False, CONVERT, 1), q1, d, input_precision=PREC)
    d = tl.dot(code_operand(bk, 2, OP, False, CONVERT, 1), q2, d, input_precision=PREC)
    d = tl.dot(code_operand(bk, 3, OP, False, CONVERT, 1), q3, d, input_precision=PREC)
    if LM:
        d = tl.dot(code_operand(bk, 0, OP, True, CONVERT, 1), qb0, d, input_precision=PREC)
        d = tl.dot(code_operand(bk, 1, OP, True, CONVERT, 1), qb1, d, input_precision=PREC)
        d = tl.dot(code_operand(bk, 2, OP, True, CONVERT, 1), qb2, d, input_precision=PREC)
        d = tl.dot(code_operand(bk, 3, OP, True, CONVERT, 1), qb3, d, input_precision=PREC)
    sqt = sq0 + sq1 + sq2 + sq3
    return sc[:, None] * (d - zc[:, None] * sqt[None, :])


@triton.jit
def softmax_update_t(s, valid, m, l, cap_log2e, HAS_CAP: tl.constexpr, DEFER: tl.constexpr = False):
    """:func:`softmax_update` on ``S^T [N, M]`` (reductions over axis 0). ``DEFER``: ``l`` is an
    ``[N, M]`` tile of per-position partial sums (no cross-lane reduction per block; the caller sums
    it over axis 0 once at the end)."""
    if HAS_CAP:
        t = cap_log2e * (2.0 * tl.sigmoid(2.0 * s) - 1.0)
    else:
        t = s
    t = tl.where(valid, t, NEG_INF)
    m_new = tl.maximum(m, tl.max(t, axis=0))
    m_use = tl.where(m_new == NEG_INF, 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(t - m_use[None, :])
    if DEFER:
        l = tl.fma(l, tl.broadcast_to(alpha[None, :], l.shape), p)
    else:
        l = l * alpha + tl.sum(p, axis=0)
    return p, alpha, m_new, l


@triton.jit
def _vt_mma(pw, pwb, bv, K: tl.constexpr, LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
            CONVERT: tl.constexpr, acc):
    acc = tl.dot(code_operand(bv, K, OP, False, CONVERT, 1), pw, acc, input_precision=PREC)
    if LM:
        acc = tl.dot(code_operand(bv, K, OP, True, CONVERT, 1), pwb, acc, input_precision=PREC)
    return acc


@triton.jit
def int2_values_t_loaded(p, alpha, acc0, acc1, acc2, acc3, corr, ref, bv, svr, zvr, A4, RB, C0,
                         LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, CONVERT: tl.constexpr,
                         DEFER: tl.constexpr = False):
    """Transposed :func:`int2_values` (fast path, one group per row, running-reference units) on a
    loaded block: ``acc_k^T [QVP, M]``, ``p [N, M]``, ``bv [QVP, N]`` (token order permuted for the
    permuting conversion), ``svr``/``zvr`` ``[N]`` in storage dtype. Returns ``(acc0..3, corr, ref)``.
    ``DEFER``: ``corr`` is an ``[N, M]`` tile of per-position partial sums (summed over axis 0 by
    the caller once at the end) instead of ``[M]``."""
    sv = svr.to(tl.float32)
    zv = zvr.to(tl.float32)
    new_ref = tl.maximum(tl.maximum(ref, tl.max(sv, axis=0)), 1e-30)
    beta = alpha * (ref / new_ref)
    pw = round_to(p * (sv / new_ref)[:, None], OP)
    pwf = pw.to(tl.float32)
    if CONVERT >= 5:
        # subnormal operands: acc_k = 2^(2k-24) sum pw (c + 2 RB b0); the correction is in the same
        # (A4/4) units: sum pw (C0' - z) 4/A4 (see int2_scores_t_loaded; finish_int2_values_t)
        pwb = round_to(pwf * (2.0 * RB), OP)
        zt = (A4 + RB * A4 + C0 - zv) * (4.0 / A4)
    else:
        pwb = round_to(pwf * RB, OP)
        zt = (C0 - zv) / A4
    if DEFER:
        corr = tl.fma(corr, tl.broadcast_to(beta[None, :], corr.shape), pwf * zt[:, None])
    else:
        corr = corr * beta + tl.sum(pwf * zt[:, None], axis=0)
    b = tl.broadcast_to(beta[None, :], acc0.shape)
    z0 = tl.zeros(acc0.shape, tl.float32)  # fresh MMA per block, fp32 fma (see the module doc)
    acc0 = tl.fma(acc0, b, _vt_mma(pw, pwb, bv, 0, LM, OP, PREC, CONVERT, z0))
    acc1 = tl.fma(acc1, b, _vt_mma(pw, pwb, bv, 1, LM, OP, PREC, CONVERT, z0))
    acc2 = tl.fma(acc2, b, _vt_mma(pw, pwb, bv, 2, LM, OP, PREC, CONVERT, z0))
    acc3 = tl.fma(acc3, b, _vt_mma(pw, pwb, bv, 3, LM, OP, PREC, CONVERT, z0))
    return acc0, acc1, acc2, acc3, corr, new_ref


@triton.jit
def int2_block_t(qt0, qt1, qt2, qt3, qtb0, qtb1, qtb2, qtb3, sqt0, sqt1, sqt2, sqt3, bk, sk, zk, bv, sv, zv, valid,
                 mt, lt, at0, at1, at2, at3, corr, ref, A4, RB, C0, cap_log2e, HAS_CAP: tl.constexpr,
                 LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, CONVERT: tl.constexpr,
                 DEFER: tl.constexpr = False):
    """One loaded token-major INT2 block into the running state: scores, online softmax, values.

    Returns the new ``(mt, lt, at0..3, corr, ref)`` (``DEFER``: ``lt`` and ``corr`` are ``[N, M]``
    per-position partial sums, see :func:`softmax_update_t`).
    """
    st = int2_scores_t_loaded(qt0, qt1, qt2, qt3, qtb0, qtb1, qtb2, qtb3, sqt0, sqt1, sqt2, sqt3, bk, sk, zk, A4,
                              C0, RB, LM, OP, PREC, CONVERT)
    pt, alpha, mt, lt = softmax_update_t(st, valid[:, None], mt, lt, cap_log2e, HAS_CAP, DEFER)
    at0, at1, at2, at3, corr, ref = int2_values_t_loaded(pt, alpha, at0, at1, at2, at3, corr, ref, bv, sv, zv, A4, RB,
                                                         C0, LM, OP, PREC, CONVERT, DEFER)
    return mt, lt, at0, at1, at2, at3, corr, ref


@triton.jit
def finish_int2_values_t(at0, at1, at2, at3, corr, ref, A4, CONVERT: tl.constexpr):
    """Token-major accumulators ``[QVP, M]`` of :func:`int2_values_t_loaded` -> value units,
    transposed to ``[M, QVP]``."""
    if CONVERT >= 5:
        f = ref * A4 * 0.25
        acc0 = tl.trans((at0 * 16777216.0 + corr[None, :]) * f)  # 2^24
        acc1 = tl.trans((at1 * 4194304.0 + corr[None, :]) * f)  # 2^22
        acc2 = tl.trans((at2 * 1048576.0 + corr[None, :]) * f)  # 2^20
        acc3 = tl.trans((at3 * 262144.0 + corr[None, :]) * f)  # 2^18
    else:
        f = ref * A4
        acc0 = tl.trans((at0 + corr[None, :]) * f)
        acc1 = tl.trans((at1 + corr[None, :]) * f)
        acc2 = tl.trans((at2 + corr[None, :]) * f)
        acc3 = tl.trans((at3 + corr[None, :]) * f)
    return acc0, acc1, acc2, acc3
