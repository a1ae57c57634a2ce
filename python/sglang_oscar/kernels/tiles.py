"""Triton building blocks of the attention kernels (decode and extend share them).

A query tile has ``M`` rows (decode: the q heads of one kv head; extend: query tokens of one
head) and is kept as four *quarter* tiles ``q_k = q[:, k*Q:(k+1)*Q]`` in the MMA operand dtype,
because the packed byte ``j`` of a row holds the codes of elements ``j + k*Q`` (quarter split):
every quarter of the codes is an elementwise function of the same byte tile, so no register
shuffles are needed to unpack, and every product is four MMAs with ``K = Q``. Queries are
pre-multiplied by the softmax scale (times ``log2 e``; divided by the cap with a logit cap) when
they are loaded, so scores come out of the MMA epilogue ready for ``exp2``.

INT2 scores, fast path (every quarter inside one group; ``G % Q == 0``). With the code operand
``E = 1 + c/4`` (and, for Lloyd-Max, ``B = 1 + b0/2``, ``b0 = c & 1``), the levels are affine,
``level[c] = A4*E + B2*B + C0`` (``layout.affine_levels``), so for one group

    q . k_hat = s * (q . level[c] - z * sum(q))
              = (s * A4) * (q . E + qb . B - ((z - C0) / A4) * sum(q)),    qb = q * B2 / A4,

where ``sum(q)`` is taken over the *rounded* operand values: one MMA chain (two for Lloyd-Max)
and two fp32 operations per score. Only codes are converted; operands stay in [1, 1.75]. (The
decode token-major variant ``CONVERT`` 5/6 uses fp16-subnormal operands ``c * 2^(2K-24)`` instead,
with q and the epilogue rescaled: :func:`int2_scores_t_loaded`.)

V, fast path: with softmax weights ``p`` and per-token pairs ``(sv, zv)``,
``sum_n p sv (level - zv) = A4 * ref * (sum_n pw (E + RB*B) + sum_n pw (C0 - zv) / A4)`` where
``pw = p * sv / ref`` is in [0, 1] (rounded to the operand dtype; the correction uses the rounded
``pw`` too) and ``ref`` is the running maximum of ``sv`` seen by the program. A growing ``ref``
rescales the accumulator together with the online-softmax factor, so the accumulator is updated
by the MMA alone (``TRUE_UNITS=False``, decode); ``TRUE_UNITS=True`` (extend, which mixes HP and
INT2 blocks in one accumulator) rescales each block's product into value units instead.

General path (any group size): dequantize ``s * (level - z)`` elementwise in fp32 with per-element
pair loads, round to the operand dtype, MMA.

Softmax runs in base 2 (``exp2``); masked keys get ``-inf``; a row with no visible key so far
keeps ``m = -inf`` and contributes nothing.

Accumulation (one-group fast paths, decode): the value MMAs of every block start from a zero
accumulator and the block's product is added to the running fp32 accumulator by an ordinary
(round-to-nearest) fp32 ``fma`` (not ``acc * beta + dot``, which Triton's combine pass folds back
into ``dot(.., acc * beta)``). The grouped / general value paths and the HP tier still feed the
running accumulator to the MMA: they hold values (no zero-point term cancels against them) and
the HP tier spans at most ``sink + recent`` keys, so the truncation bias stays at fp32 level there. Tensor
cores truncate the low bits when they accumulate; fed the running accumulator directly, that bias
grows with the number of blocks a split walks, and the zero-point correction (which cancels most
of ``sum pw E``) amplifies it: measured on the H200, a 64K-token split of zero-mean random data
was off by 1-8% (rel. L2) against the same decode cut into many short splits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import code_operand, level_of, perm4_index, round_to, to_operand

NEG_INF = tl.constexpr(float("-inf"))
# subnormal code operands (CONVERT 5/6): q operands carry 2^(SUB_SHIFT - 2K), see load_qt_quarter
SUB_SHIFT = tl.constexpr(8)


@triton.jit
def hp_split_range(sink_r, win_lo, L, sink, recent, split, num_splits, BLOCK: tl.constexpr):
    """HP split ``split`` of ``num_splits`` (decode): the HP positions are sink ``[0, n_sink)`` then
    recent ``[rec_start, L)``, one virtual range ``[0, n_hp)`` cut into equal ``BLOCK``-aligned
    chunks. Returns ``(n_sink, rec_start, lo, hi)`` (virtual indices; ``lo >= hi`` = empty).
    A sink wholly below the sliding window's start ``win_lo`` (0 without a window) is left out
    (``n_sink = 0``): past the window the splits then cover only keys the query sees; a sink the
    window cuts stays whole and the caller masks ``pos < win_lo``. Shared by the Triton and the
    Gluon stage 1, so both cut the splits the same way."""
    n_sink = tl.minimum(sink_r, L)
    n_sink = tl.where(win_lo >= n_sink, 0, n_sink)
    rec_start = tl.maximum(sink, L - recent)
    n_hp = n_sink + tl.maximum(L - rec_start, 0)
    chunk = tl.cdiv(tl.cdiv(n_hp, num_splits), BLOCK) * BLOCK
    lo = split * chunk
    return n_sink, rec_start, lo, tl.minimum(lo + chunk, n_hp)


@triton.jit
def request_sink_len(SINKL, req, sink, like, HAS_SINKL: tl.constexpr):
    """Sink positions request ``req`` reads from HP rows: ``min(SINKL[req], sink)`` with per-request
    sink lengths (``HAS_SINKL``), else ``sink`` (int32, ``like`` gives the scalar type: any int32
    value of the program). ``sink`` itself stays the ``hp_index`` layout offset. Shared by the
    Triton decode and extend kernels and the Gluon decode kernel."""
    if HAS_SINKL:
        return tl.minimum(tl.load(SINKL + req).to(tl.int32), sink)
    else:
        return like * 0 + sink


@triton.jit
def int2_split_range(sink_r, win_lo, L, sink, recent, split, num_splits, BLOCK: tl.constexpr, min_chunk):
    """INT2 split ``split`` of ``num_splits`` (decode) of the middle ``[max(sink_r, win_lo),
    min(max(L - recent, sink), L))`` -- sink positions without a row (``[sink_r, sink)``) included,
    never the recent ring -- cut into equal ``BLOCK``-aligned chunks of at least ``min_chunk``
    positions (a multiple of ``BLOCK``; a short middle then fills only the first splits and the
    others are empty: the split count is a host constant, for CUDA graphs, while the work per split
    follows this step's length). Returns ``(lo, hi)`` (positions; ``lo >= hi`` = empty). Shared by
    the Triton and the Gluon stage 1."""
    mid_hi = tl.minimum(tl.maximum(L - recent, sink), L)
    mid_lo = tl.maximum(sink_r, win_lo)
    n_mid = tl.maximum(mid_hi - mid_lo, 0)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(n_mid, num_splits), BLOCK) * BLOCK, tl.maximum(min_chunk, BLOCK))
    # splits past the last non-empty one start at the end of the middle (no int32 overflow of
    # split * chunk for any floor the launcher accepts, configs.MAX_MIN_SPLIT_KEYS)
    lo = mid_lo + tl.minimum(split, tl.cdiv(n_mid, chunk)) * chunk
    return lo, tl.minimum(lo + chunk, mid_hi)


@triton.jit
def load_int2_slots(r2t, n0, hi, BLOCK_N: tl.constexpr, IDX64: tl.constexpr, PERM: tl.constexpr):
    """Slot ids of positions ``[n0, n0 + BLOCK_N)`` below ``hi`` from a ``req_to_token`` row.

    Returns ``(slots, valid, vslots, vmask)``: key slots and their mask (invalid -> slot 0), and
    the same for the value tile, whose token order is permuted when ``PERM`` (converts 3-6).
    """
    pos = n0 + tl.arange(0, BLOCK_N)
    tm = pos < hi
    slots = tl.load(r2t + pos, mask=tm, other=-1)
    valid = tm & (slots >= 0)
    slots = tl.where(valid, slots, 0)
    if IDX64:
        slots = slots.to(tl.int64)
    else:
        slots = slots.to(tl.int32)
    if PERM:
        vpos = n0 + perm4_index(tl.arange(0, BLOCK_N))
        vmask = vpos < hi
        vslots = tl.load(r2t + vpos, mask=vmask, other=-1)
        vmask = vmask & (vslots >= 0)
        vslots = tl.where(vmask, vslots, 0)
        if IDX64:
            vslots = vslots.to(tl.int64)
        else:
            vslots = vslots.to(tl.int32)
    else:
        vslots = slots
        vmask = valid
    return slots, valid, vslots, vmask


@triton.jit
def load_q_quarter(Q, qoff, rmask, qscale, RB, K: tl.constexpr, QD: tl.constexpr, QDP: tl.constexpr,
                   OP: tl.constexpr, LM: tl.constexpr, PERM: tl.constexpr = False):
    """``q[:, K*QD:(K+1)*QD] * qscale`` as ``[M, QDP]`` operand, ``q * RB`` (Lloyd-Max) and fp32 row sums.

    ``PERM``: columns in :func:`.codes.perm4_index` order (for the permuting code conversion).
    """
    jq = tl.arange(0, QDP)
    if PERM:
        jq = perm4_index(jq)
    q = tl.load(Q + qoff[:, None] + (K * QD + jq)[None, :], mask=rmask[:, None] & (jq < QD)[None, :], other=0.0)
    qf = q.to(tl.float32) * qscale
    q = round_to(qf, OP)
    if LM:
        qb = round_to(q.to(tl.float32) * RB, OP)
    else:
        qb = q
    return q, qb, tl.sum(q.to(tl.float32), axis=1)


# ------------------------------------------------------------------------------------- scores


@triton.jit
def _k_quarter_fast(acc, q, qb, sq, bk, KP_h, stride_kps, slots, tmask, K: tl.constexpr, NGK: tl.constexpr,
                    A4, C0, LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, CONVERT: tl.constexpr):
    g: tl.constexpr = (K * NGK) // 4
    sc = tl.load(KP_h + slots * stride_kps + 2 * g, mask=tmask, other=0.0).to(tl.float32) * A4
    zk = (tl.load(KP_h + slots * stride_kps + 2 * g + 1, mask=tmask, other=0.0).to(tl.float32) - C0) / A4
    d = tl.dot(q, code_operand(bk, K, OP, False, CONVERT), input_precision=PREC)
    if LM:
        d = tl.dot(qb, code_operand(bk, K, OP, True, CONVERT), d, input_precision=PREC)
    return acc + sc[None, :] * (d - zk[None, :] * sq[:, None])


@triton.jit
def _k_quarter_general(acc, q, bk, KP_h, stride_kps, slots, tmask, l0, l1, l2, l3, K: tl.constexpr,
                       QK: tl.constexpr, QKP: tl.constexpr, GK: tl.constexpr, OP: tl.constexpr,
                       PREC: tl.constexpr):
    jq = tl.arange(0, QKP)
    m2 = (jq < QK)[:, None] & tmask[None, :]
    c = (bk.to(tl.int32) >> (2 * K)) & 3
    lev = level_of(c, l0, l1, l2, l3)
    pp = KP_h + slots[None, :] * stride_kps + (2 * ((K * QK + jq) // GK))[:, None]
    sc = tl.load(pp, mask=m2, other=0.0).to(tl.float32)
    zk = tl.load(pp + 1, mask=m2, other=0.0).to(tl.float32)
    kh = to_operand(sc * (lev - zk), OP)
    return tl.dot(q, kh, acc, input_precision=PREC)


@triton.jit
def int2_scores(q0, q1, q2, q3, qb0, qb1, qb2, qb3, sq0, sq1, sq2, sq3, KC_h, stride_kcs, KP_h, stride_kps,
                slots, tmask, A4, C0, l0, l1, l2, l3,
                QK: tl.constexpr, QKP: tl.constexpr, GK: tl.constexpr, NGK: tl.constexpr,
                FAST: tl.constexpr, LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
                CONVERT: tl.constexpr):
    """Scores ``q . k_hat`` ``[M, N]`` fp32 (q pre-scaled) of the INT2 keys at ``slots``."""
    jq = tl.arange(0, QKP)
    bk = tl.load(KC_h + slots[None, :] * stride_kcs + jq[:, None],
                 mask=(jq < QK)[:, None] & tmask[None, :], other=0)  # [QKP, N] uint8
    zero = tl.zeros((q0.shape[0], slots.shape[0]), tl.float32)
    if FAST:
        if NGK == 1:
            sc = tl.load(KP_h + slots * stride_kps, mask=tmask, other=0.0).to(tl.float32) * A4
            zk = (tl.load(KP_h + slots * stride_kps + 1, mask=tmask, other=0.0).to(tl.float32) - C0) / A4
            d = tl.dot(q0, code_operand(bk, 0, OP, False, CONVERT), input_precision=PREC)
            d = tl.dot(q1, code_operand(bk, 1, OP, False, CONVERT), d, input_precision=PREC)
            d = tl.dot(q2, code_operand(bk, 2, OP, False, CONVERT), d, input_precision=PREC)
            d = tl.dot(q3, code_operand(bk, 3, OP, False, CONVERT), d, input_precision=PREC)
            if LM:
                d = tl.dot(qb0, code_operand(bk, 0, OP, True, CONVERT), d, input_precision=PREC)
                d = tl.dot(qb1, code_operand(bk, 1, OP, True, CONVERT), d, input_precision=PREC)
                d = tl.dot(qb2, code_operand(bk, 2, OP, True, CONVERT), d, input_precision=PREC)
                d = tl.dot(qb3, code_operand(bk, 3, OP, True, CONVERT), d, input_precision=PREC)
            sqt = sq0 + sq1 + sq2 + sq3
            s = sc[None, :] * (d - zk[None, :] * sqt[:, None])
        else:
            s = _k_quarter_fast(zero, q0, qb0, sq0, bk, KP_h, stride_kps, slots, tmask, 0, NGK, A4, C0, LM, OP, PREC, CONVERT)
            s = _k_quarter_fast(s, q1, qb1, sq1, bk, KP_h, stride_kps, slots, tmask, 1, NGK, A4, C0, LM, OP, PREC, CONVERT)
            s = _k_quarter_fast(s, q2, qb2, sq2, bk, KP_h, stride_kps, slots, tmask, 2, NGK, A4, C0, LM, OP, PREC, CONVERT)
            s = _k_quarter_fast(s, q3, qb3, sq3, bk, KP_h, stride_kps, slots, tmask, 3, NGK, A4, C0, LM, OP, PREC, CONVERT)
    else:
        s = _k_quarter_general(zero, q0, bk, KP_h, stride_kps, slots, tmask, l0, l1, l2, l3, 0, QK, QKP, GK, OP, PREC)
        s = _k_quarter_general(s, q1, bk, KP_h, stride_kps, slots, tmask, l0, l1, l2, l3, 1, QK, QKP, GK, OP, PREC)
        s = _k_quarter_general(s, q2, bk, KP_h, stride_kps, slots, tmask, l0, l1, l2, l3, 2, QK, QKP, GK, OP, PREC)
        s = _k_quarter_general(s, q3, bk, KP_h, stride_kps, slots, tmask, l0, l1, l2, l3, 3, QK, QKP, GK, OP, PREC)
    return s


@triton.jit
def hp_scores(q0, q1, q2, q3, HK_h, stride_hkr, rows, tmask, QK: tl.constexpr, QKP: tl.constexpr,
              OP: tl.constexpr, PREC: tl.constexpr):
    """Scores ``q . k`` ``[M, N]`` (q pre-scaled) of HP rows ``rows`` (kv head base ``HK_h``)."""
    jq = tl.arange(0, QKP)
    m2 = (jq < QK)[:, None] & tmask[None, :]
    base = HK_h + rows[None, :] * stride_hkr + jq[:, None]
    s = tl.dot(q0, to_operand(tl.load(base, mask=m2, other=0.0), OP), input_precision=PREC)
    s = tl.dot(q1, to_operand(tl.load(base + QK, mask=m2, other=0.0), OP), s, input_precision=PREC)
    s = tl.dot(q2, to_operand(tl.load(base + 2 * QK, mask=m2, other=0.0), OP), s, input_precision=PREC)
    s = tl.dot(q3, to_operand(tl.load(base + 3 * QK, mask=m2, other=0.0), OP), s, input_precision=PREC)
    return s


# ------------------------------------------------------------------------------------- softmax


@triton.jit
def softmax_update(s, valid, m, l, cap_log2e, HAS_CAP: tl.constexpr):
    """Online softmax step in base 2 on pre-scaled scores. Returns ``(p, alpha, m_new, l_new)``.

    Without a cap ``s`` is already ``score * sm_scale * log2(e)``; with a cap it is
    ``score * sm_scale / cap`` and the logit is ``cap * log2(e) * tanh(s)``.
    """
    if HAS_CAP:
        t = cap_log2e * (2.0 * tl.sigmoid(2.0 * s) - 1.0)
    else:
        t = s
    t = tl.where(valid, t, NEG_INF)
    m_new = tl.maximum(m, tl.max(t, axis=1))
    m_use = tl.where(m_new == NEG_INF, 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(t - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l


# ------------------------------------------------------------------------------------- values


@triton.jit
def _v_mma(pw, pwb, bv, K: tl.constexpr, LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
           CONVERT: tl.constexpr, acc):
    acc = tl.dot(pw, code_operand(bv, K, OP, False, CONVERT), acc, input_precision=PREC)
    if LM:
        acc = tl.dot(pwb, code_operand(bv, K, OP, True, CONVERT), acc, input_precision=PREC)
    return acc


@triton.jit
def _v_quarter_grouped(acc, p, beta, ref, bv, VP_h, stride_vps, slots, tmask, K: tl.constexpr, NGV: tl.constexpr,
                       A4, RB, C0, LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, CONVERT: tl.constexpr,
                       TRUE_UNITS: tl.constexpr):
    # quarter K lies in group g: its own pair, same reference ``ref`` for all groups
    g: tl.constexpr = (K * NGV) // 4
    sv = tl.load(VP_h + slots * stride_vps + 2 * g, mask=tmask, other=0.0).to(tl.float32)
    zv = tl.load(VP_h + slots * stride_vps + 2 * g + 1, mask=tmask, other=0.0).to(tl.float32)
    pw = round_to(p * (sv / ref)[None, :], OP)
    pwf = pw.to(tl.float32)
    pwb = round_to(pwf * RB, OP)
    corr = tl.sum(pwf * ((C0 - zv) / A4)[None, :], axis=1)
    if TRUE_UNITS:
        d = _v_mma(pw, pwb, bv, K, LM, OP, PREC, CONVERT, tl.zeros(acc.shape, tl.float32))
        return acc * beta[:, None] + (ref * A4) * (d + corr[:, None])
    else:
        return _v_mma(pw, pwb, bv, K, LM, OP, PREC, CONVERT, acc * beta[:, None]) + corr[:, None]


@triton.jit
def _v_quarter_general(acc, p16, alpha, bv, VP_h, stride_vps, slots, tmask, l0, l1, l2, l3, K: tl.constexpr,
                       QV: tl.constexpr, QVP: tl.constexpr, GV: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr):
    jv = tl.arange(0, QVP)
    m2 = tmask[:, None] & (jv < QV)[None, :]
    c = (bv.to(tl.int32) >> (2 * K)) & 3
    lev = level_of(c, l0, l1, l2, l3)
    pp = VP_h + slots[:, None] * stride_vps + (2 * ((K * QV + jv) // GV))[None, :]
    sv = tl.load(pp, mask=m2, other=0.0).to(tl.float32)
    zv = tl.load(pp + 1, mask=m2, other=0.0).to(tl.float32)
    vh = to_operand(sv * (lev - zv), OP)
    return tl.dot(p16, vh, acc * alpha[:, None], input_precision=PREC)


@triton.jit
def int2_values(p, alpha, acc0, acc1, acc2, acc3, corr, ref, VC_h, stride_vcs, VP_h, stride_vps, slots, tmask,
                vslots, vmask, A4, RB, C0, l0, l1, l2, l3,
                QV: tl.constexpr, QVP: tl.constexpr, GV: tl.constexpr, NGV: tl.constexpr,
                FAST: tl.constexpr, LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr,
                CONVERT: tl.constexpr, TRUE_UNITS: tl.constexpr):
    """Rescale the accumulators by ``alpha`` and add ``p @ v_hat`` of the INT2 values at ``slots``.

    ``vslots``/``vmask`` address the code tile (tokens in :func:`.codes.perm4_index` order with a
    permuting conversion, else equal to ``slots``/``tmask``). Returns ``(acc0..3, corr, ref)``. With ``FAST and not TRUE_UNITS`` the accumulators are in
    units of ``A4 * ref`` and ``corr`` (``NGV == 1``) is a per-row term still to be added (see the
    module docstring, :func:`finish_int2_values`); otherwise they hold values.
    """
    jv = tl.arange(0, QVP)
    bv = tl.load(VC_h + vslots[:, None] * stride_vcs + jv[None, :],
                 mask=vmask[:, None] & (jv < QV)[None, :], other=0)  # [N, QVP] uint8
    if FAST:
        if NGV == 1:
            sv = tl.load(VP_h + slots * stride_vps, mask=tmask, other=0.0).to(tl.float32)
            zv = tl.load(VP_h + slots * stride_vps + 1, mask=tmask, other=0.0).to(tl.float32)
            blk = tl.max(sv, axis=0)
        else:
            blk = tl.max(tl.load(VP_h + slots * stride_vps, mask=tmask, other=0.0).to(tl.float32), axis=0)
            for g in tl.static_range(1, NGV):
                blk = tl.maximum(blk, tl.max(tl.load(VP_h + slots * stride_vps + 2 * g, mask=tmask,
                                                     other=0.0).to(tl.float32), axis=0))
        if TRUE_UNITS:
            new_ref = tl.maximum(blk, 1e-30)
            beta = alpha
        else:
            new_ref = tl.maximum(tl.maximum(ref, blk), 1e-30)
            beta = alpha * (ref / new_ref)
        if NGV == 1:
            pw = round_to(p * (sv / new_ref)[None, :], OP)
            pwf = pw.to(tl.float32)
            pwb = round_to(pwf * RB, OP)
            cblk = tl.sum(pwf * ((C0 - zv) / A4)[None, :], axis=1)
            if TRUE_UNITS:
                f = new_ref * A4
                z0 = tl.zeros(acc0.shape, tl.float32)
                acc0 = acc0 * beta[:, None] + f * (_v_mma(pw, pwb, bv, 0, LM, OP, PREC, CONVERT, z0) + cblk[:, None])
                acc1 = acc1 * beta[:, None] + f * (_v_mma(pw, pwb, bv, 1, LM, OP, PREC, CONVERT, z0) + cblk[:, None])
                acc2 = acc2 * beta[:, None] + f * (_v_mma(pw, pwb, bv, 2, LM, OP, PREC, CONVERT, z0) + cblk[:, None])
                acc3 = acc3 * beta[:, None] + f * (_v_mma(pw, pwb, bv, 3, LM, OP, PREC, CONVERT, z0) + cblk[:, None])
            else:
                # each block's MMA starts from zero and is added in fp32 (round-to-nearest): tensor
                # cores truncate when they accumulate, which biases a long running sum (see module doc)
                corr = corr * beta + cblk
                z0 = tl.zeros(acc0.shape, tl.float32)
                bb = tl.broadcast_to(beta[:, None], acc0.shape)
                acc0 = tl.fma(acc0, bb, _v_mma(pw, pwb, bv, 0, LM, OP, PREC, CONVERT, z0))
                acc1 = tl.fma(acc1, bb, _v_mma(pw, pwb, bv, 1, LM, OP, PREC, CONVERT, z0))
                acc2 = tl.fma(acc2, bb, _v_mma(pw, pwb, bv, 2, LM, OP, PREC, CONVERT, z0))
                acc3 = tl.fma(acc3, bb, _v_mma(pw, pwb, bv, 3, LM, OP, PREC, CONVERT, z0))
        else:
            acc0 = _v_quarter_grouped(acc0, p, beta, new_ref, bv, VP_h, stride_vps, slots, tmask, 0, NGV, A4, RB, C0,
                                      LM, OP, PREC, CONVERT, TRUE_UNITS)
            acc1 = _v_quarter_grouped(acc1, p, beta, new_ref, bv, VP_h, stride_vps, slots, tmask, 1, NGV, A4, RB, C0,
                                      LM, OP, PREC, CONVERT, TRUE_UNITS)
            acc2 = _v_quarter_grouped(acc2, p, beta, new_ref, bv, VP_h, stride_vps, slots, tmask, 2, NGV, A4, RB, C0,
                                      LM, OP, PREC, CONVERT, TRUE_UNITS)
            acc3 = _v_quarter_grouped(acc3, p, beta, new_ref, bv, VP_h, stride_vps, slots, tmask, 3, NGV, A4, RB, C0,
                                      LM, OP, PREC, CONVERT, TRUE_UNITS)
        if not TRUE_UNITS:
            ref = new_ref
    else:
        p16 = to_operand(p, OP)
        acc0 = _v_quarter_general(acc0, p16, alpha, bv, VP_h, stride_vps, slots, tmask, l0, l1, l2, l3, 0, QV, QVP, GV, OP, PREC)
        acc1 = _v_quarter_general(acc1, p16, alpha, bv, VP_h, stride_vps, slots, tmask, l0, l1, l2, l3, 1, QV, QVP, GV, OP, PREC)
        acc2 = _v_quarter_general(acc2, p16, alpha, bv, VP_h, stride_vps, slots, tmask, l0, l1, l2, l3, 2, QV, QVP, GV, OP, PREC)
        acc3 = _v_quarter_general(acc3, p16, alpha, bv, VP_h, stride_vps, slots, tmask, l0, l1, l2, l3, 3, QV, QVP, GV, OP, PREC)
    return acc0, acc1, acc2, acc3, corr, ref


@triton.jit
def finish_int2_values(acc0, acc1, acc2, acc3, corr, ref, A4, NGV: tl.constexpr, FAST: tl.constexpr):
    """Accumulators of :func:`int2_values` (``TRUE_UNITS=False``) -> value units."""
    if FAST:
        f = ref * A4
        if NGV == 1:
            acc0 = (acc0 + corr[:, None]) * f
            acc1 = (acc1 + corr[:, None]) * f
            acc2 = (acc2 + corr[:, None]) * f
            acc3 = (acc3 + corr[:, None]) * f
        else:
            acc0 = acc0 * f
            acc1 = acc1 * f
            acc2 = acc2 * f
            acc3 = acc3 * f
    return acc0, acc1, acc2, acc3


@triton.jit
def hp_values(p, alpha, acc0, acc1, acc2, acc3, HV_h, stride_hvr, rows, tmask, QV: tl.constexpr,
              QVP: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr):
    """``acc_k = acc_k * alpha + p @ v[:, quarter k]`` for HP rows ``rows``."""
    jv = tl.arange(0, QVP)
    m2 = tmask[:, None] & (jv < QV)[None, :]
    base = HV_h + rows[:, None] * stride_hvr + jv[None, :]
    p16 = to_operand(p, OP)
    a = alpha[:, None]
    acc0 = tl.dot(p16, to_operand(tl.load(base, mask=m2, other=0.0), OP), acc0 * a, input_precision=PREC)
    acc1 = tl.dot(p16, to_operand(tl.load(base + QV, mask=m2, other=0.0), OP), acc1 * a, input_precision=PREC)
    acc2 = tl.dot(p16, to_operand(tl.load(base + 2 * QV, mask=m2, other=0.0), OP), acc2 * a, input_precision=PREC)
    acc3 = tl.dot(p16, to_operand(tl.load(base + 3 * QV, mask=m2, other=0.0), OP), acc3 * a, input_precision=PREC)
    return acc0, acc1, acc2, acc3


@triton.jit
def store_quarters(O, ooff, rmask, acc0, acc1, acc2, acc3, inv_l, QV: tl.constexpr, QVP: tl.constexpr,
                   OUT_DT: tl.constexpr):
    """Store ``acc_k * inv_l`` at ``O + ooff[:, None] + k*QV + j`` (rows ``rmask``)."""
    jv = tl.arange(0, QVP)
    m2 = rmask[:, None] & (jv < QV)[None, :]
    base = O + ooff[:, None] + jv[None, :]
    il = inv_l[:, None]
    tl.store(base, round_to(acc0 * il, OUT_DT), mask=m2)
    tl.store(base + QV, round_to(acc1 * il, OUT_DT), mask=m2)
    tl.store(base + 2 * QV, round_to(acc2 * il, OUT_DT), mask=m2)
    tl.store(base + 3 * QV, round_to(acc3 * il, OUT_DT), mask=m2)
