"""Decode attention over the two-tier cache: split-KV flash decoding + merge.

Semantics (``reference.attention`` window mode ``"decode"``): request ``b`` of length
``L = seq_lens[b]`` has its query at position ``L - 1``; position ``p`` is read from the HP
buffer iff ``p < sink`` (row ``hp_index[req, p]``) or ``p >= L - recent`` (row
``hp_index[req, sink + p % recent]``), else from the INT2 slot ``req_to_token[req, p]``. With a
sliding window only ``p >= L - window`` is visible.

Stage 1, grid ``(batch, kv_heads * head_blocks, NS_HP + NS_Q)``: a program handles the q heads
of one kv head (a head block never straddles two kv heads: it covers the whole group or a
divisor of it) and one split. Splits ``[0, NS_HP)`` cover the HP positions (sink then recent,
as one virtual range), splits ``[NS_HP, NS_HP + NS_Q)`` the INT2 middle ``[sink, L - recent)``,
each range cut into equal ``BLOCK_N``-aligned chunks computed on the device from ``seq_lens``.
Each split writes its normalised partial output and base-2 log-sum-exp (``-inf`` when empty).
The grid depends only on host constants, so the launch can be captured in a CUDA graph.
INT2 splits use token-major tiles (``TOKEN_MAJOR``, one pair group per row) or head-major tiles
(:mod:`.tiles`); with the permuting code conversions (``CONVERT`` 3-6) q is loaded with permuted
columns and the V code tile with permuted tokens (``perm4_index``), HP splits never permute.

Stage 2, grid ``(batch, q_heads, dim blocks)``: merges the splits (zeros when no split saw a key).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tiles import (
    NEG_INF,
    finish_int2_values,
    hp_scores,
    hp_split_range,
    hp_values,
    int2_scores,
    int2_split_range,
    int2_values,
    load_int2_slots,
    load_q_quarter,
    request_sink_len,
    softmax_update,
    store_quarters,
)
from .token_major import (
    finish_int2_values_t,
    int2_block_t,
    load_int2_codes_t,
    load_int2_pairs_t,
    load_qt_quarter,
)


@triton.jit
def _decode_stage1(
    Q, stride_qb, stride_qh,
    KC, stride_kcs, stride_kch, KP, stride_kps, stride_kph,
    VC, stride_vcs, stride_vch, VP, stride_vps, stride_vph,
    HK, stride_hkr, stride_hkh, HV, stride_hvr, stride_hvh,
    HPI, stride_hpi, R2T, stride_r2t, RPI, SEQ, SINKL,
    OPART, stride_ob, stride_oh, stride_os, LSE, stride_lb, stride_lh,
    qscale, cap_log2e, sink, recent, window,
    A4, RB, C0, l0, l1, l2, l3,
    GROUP: tl.constexpr, HEADS_PER_BLOCK: tl.constexpr, BLOCKS_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr,
    QK: tl.constexpr, QKP: tl.constexpr, GK: tl.constexpr, NGK: tl.constexpr, K_FAST: tl.constexpr,
    QV: tl.constexpr, QVP: tl.constexpr, GV: tl.constexpr, NGV: tl.constexpr, V_FAST: tl.constexpr,
    LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, CONVERT: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, IDX64: tl.constexpr, TOKEN_MAJOR: tl.constexpr,
    NS_HP, NS_Q, MIN_CHUNK, BLOCK_N: tl.constexpr, HAS_SINKL: tl.constexpr = False, PAIRS_AHEAD: tl.constexpr = False,
    DEFER_SUMS: tl.constexpr = False,
):
    PERM: tl.constexpr = CONVERT >= 3
    SUB: tl.constexpr = CONVERT >= 5  # subnormal code operands (token-major fast path only)
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    kvh = hb // BLOCKS_PER_KV
    h_in = (hb % BLOCKS_PER_KV) * HEADS_PER_BLOCK + tl.arange(0, BLOCK_H)
    rmask = (tl.arange(0, BLOCK_H) < HEADS_PER_BLOCK) & (h_in < GROUP)
    heads = (kvh * GROUP + h_in).to(tl.int64)
    kvh64 = kvh.to(tl.int64)

    req = tl.load(RPI + b).to(tl.int64)
    L = tl.load(SEQ + b).to(tl.int32)
    # Sink positions read from HP rows: [0, sink_r); ``sink`` stays the hp_index layout offset.
    sink_r = request_sink_len(SINKL, req, sink, L, HAS_SINKL)

    qoff = b.to(tl.int64) * stride_qb + heads * stride_qh

    m = tl.full([BLOCK_H], NEG_INF, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, QVP], tl.float32)
    acc1 = tl.zeros([BLOCK_H, QVP], tl.float32)
    acc2 = tl.zeros([BLOCK_H, QVP], tl.float32)
    acc3 = tl.zeros([BLOCK_H, QVP], tl.float32)

    if HAS_WINDOW:
        win_lo = tl.maximum(L - window, 0)
    else:
        win_lo = L * 0

    if sp < NS_HP:
        # ---------------- HP tier: sink [0, n_sink) then recent [rec_start, L), one virtual range
        n_sink, rec_start, lo, hi = hp_split_range(sink_r, win_lo, L, sink, recent, sp, NS_HP, BLOCK_N)
        ring = tl.maximum(recent, 1)
        q0, qb0, sq0 = load_q_quarter(Q, qoff, rmask, qscale, RB, 0, QK, QKP, OP, LM)
        q1, qb1, sq1 = load_q_quarter(Q, qoff, rmask, qscale, RB, 1, QK, QKP, OP, LM)
        q2, qb2, sq2 = load_q_quarter(Q, qoff, rmask, qscale, RB, 2, QK, QKP, OP, LM)
        q3, qb3, sq3 = load_q_quarter(Q, qoff, rmask, qscale, RB, 3, QK, QKP, OP, LM)
        HK_h = HK + kvh64 * stride_hkh
        HV_h = HV + kvh64 * stride_hvh
        for v0 in range(lo, hi, BLOCK_N):
            v = v0 + tl.arange(0, BLOCK_N)
            tm = v < hi
            pos = tl.where(v < n_sink, v, rec_start + v - n_sink)
            entry = tl.where(pos < sink, pos, sink + pos % ring)
            rows = tl.load(HPI + req * stride_hpi + entry, mask=tm, other=-1)
            valid = tm & (rows >= 0) & (pos >= win_lo)
            rows = tl.where(valid, rows, 0)
            if IDX64:
                rows = rows.to(tl.int64)
            else:
                rows = rows.to(tl.int32)
            s = hp_scores(q0, q1, q2, q3, HK_h, stride_hkr, rows, valid, QK, QKP, OP, PREC)
            p, alpha, m, l = softmax_update(s, valid[None, :], m, l, cap_log2e, HAS_CAP)
            acc0, acc1, acc2, acc3 = hp_values(p, alpha, acc0, acc1, acc2, acc3, HV_h, stride_hvr, rows, valid,
                                               QV, QVP, OP, PREC)
    else:
        # ---------------- INT2 tier: [max(sink, window start), L - recent)
        # sink positions without a row ([sink_r, sink)) are read here too, never from the ring
        lo, hi = int2_split_range(sink_r, win_lo, L, sink, recent, sp - NS_HP, NS_Q, BLOCK_N, MIN_CHUNK)
        KC_h = KC + kvh64 * stride_kch
        KP_h = KP + kvh64 * stride_kph
        VC_h = VC + kvh64 * stride_vch
        VP_h = VP + kvh64 * stride_vph
        r2t = R2T + req * stride_r2t
        if TOKEN_MAJOR:
            qt0, qtb0, sqt0 = load_qt_quarter(Q, qoff, rmask, qscale, RB, 0, QK, QKP, OP, LM, PERM, SUB)
            qt1, qtb1, sqt1 = load_qt_quarter(Q, qoff, rmask, qscale, RB, 1, QK, QKP, OP, LM, PERM, SUB)
            qt2, qtb2, sqt2 = load_qt_quarter(Q, qoff, rmask, qscale, RB, 2, QK, QKP, OP, LM, PERM, SUB)
            qt3, qtb3, sqt3 = load_qt_quarter(Q, qoff, rmask, qscale, RB, 3, QK, QKP, OP, LM, PERM, SUB)
            mt = tl.full([BLOCK_H], NEG_INF, tl.float32)
            if DEFER_SUMS:  # per-position partial sums, reduced once after the loop
                lt = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
                corr = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
            else:
                lt = tl.zeros([BLOCK_H], tl.float32)
                corr = tl.zeros([BLOCK_H], tl.float32)
            at0 = tl.zeros([QVP, BLOCK_H], tl.float32)
            at1 = tl.zeros([QVP, BLOCK_H], tl.float32)
            at2 = tl.zeros([QVP, BLOCK_H], tl.float32)
            at3 = tl.zeros([QVP, BLOCK_H], tl.float32)
            ref = 0.0
            if PAIRS_AHEAD:
                # The code tiles go through Triton's software pipeline (asynchronous copies, addresses
                # from the in-loop slot load); the (scale, zero) loads do not (they feed no dot), so
                # here they are prefetched by hand: slot ids two blocks ahead, pairs one block ahead,
                # so that no iteration waits a full memory latency for them (the loop was mostly
                # stalled on these loads; docs/kernels.md#decode-defaults).
                slots, valid, vslots, vmask = load_int2_slots(r2t, lo, hi, BLOCK_N, IDX64, False)
                sk, zk, sv, zv = load_int2_pairs_t(KP_h, stride_kps, VP_h, stride_vps, slots, valid)
                slots1, valid1, _, _ = load_int2_slots(r2t, lo + BLOCK_N, hi, BLOCK_N, IDX64, False)
                for n0 in tl.range(lo, hi, BLOCK_N):
                    slots, valid, vslots, vmask = load_int2_slots(r2t, n0, hi, BLOCK_N, IDX64, PERM)
                    bk, bv = load_int2_codes_t(KC_h, stride_kcs, VC_h, stride_vcs, slots, valid, vslots, vmask,
                                               QK, QKP, QV, QVP)
                    slots2, valid2, _, _ = load_int2_slots(r2t, n0 + 2 * BLOCK_N, hi, BLOCK_N, IDX64,
                                                                      False)
                    sk1, zk1, sv1, zv1 = load_int2_pairs_t(KP_h, stride_kps, VP_h, stride_vps, slots1, valid1)
                    mt, lt, at0, at1, at2, at3, corr, ref = int2_block_t(
                        qt0, qt1, qt2, qt3, qtb0, qtb1, qtb2, qtb3, sqt0, sqt1, sqt2, sqt3, bk, sk, zk, bv, sv, zv,
                        valid, mt, lt, at0, at1, at2, at3, corr, ref, A4, RB, C0, cap_log2e, HAS_CAP, LM, OP, PREC,
                        CONVERT, DEFER_SUMS)
                    sk, zk, sv, zv = sk1, zk1, sv1, zv1
                    slots1, valid1 = slots2, valid2
            else:
                for n0 in tl.range(lo, hi, BLOCK_N):
                    slots, valid, vslots, vmask = load_int2_slots(r2t, n0, hi, BLOCK_N, IDX64, PERM)
                    bk, bv = load_int2_codes_t(KC_h, stride_kcs, VC_h, stride_vcs, slots, valid, vslots, vmask,
                                               QK, QKP, QV, QVP)
                    sk, zk, sv, zv = load_int2_pairs_t(KP_h, stride_kps, VP_h, stride_vps, slots, valid)
                    mt, lt, at0, at1, at2, at3, corr, ref = int2_block_t(
                        qt0, qt1, qt2, qt3, qtb0, qtb1, qtb2, qtb3, sqt0, sqt1, sqt2, sqt3, bk, sk, zk, bv, sv, zv,
                        valid, mt, lt, at0, at1, at2, at3, corr, ref, A4, RB, C0, cap_log2e, HAS_CAP, LM, OP, PREC,
                        CONVERT, DEFER_SUMS)
            if DEFER_SUMS:
                lt = tl.sum(lt, axis=0)
                corr = tl.sum(corr, axis=0)
            acc0, acc1, acc2, acc3 = finish_int2_values_t(at0, at1, at2, at3, corr, ref, A4, CONVERT)
            m = mt
            l = lt
        else:
            q0, qb0, sq0 = load_q_quarter(Q, qoff, rmask, qscale, RB, 0, QK, QKP, OP, LM, PERM)
            q1, qb1, sq1 = load_q_quarter(Q, qoff, rmask, qscale, RB, 1, QK, QKP, OP, LM, PERM)
            q2, qb2, sq2 = load_q_quarter(Q, qoff, rmask, qscale, RB, 2, QK, QKP, OP, LM, PERM)
            q3, qb3, sq3 = load_q_quarter(Q, qoff, rmask, qscale, RB, 3, QK, QKP, OP, LM, PERM)
            corr = tl.zeros([BLOCK_H], tl.float32)
            ref = 0.0
            for n0 in tl.range(lo, hi, BLOCK_N):
                slots, valid, vslots, vmask = load_int2_slots(r2t, n0, hi, BLOCK_N, IDX64, PERM)
                s = int2_scores(q0, q1, q2, q3, qb0, qb1, qb2, qb3, sq0, sq1, sq2, sq3, KC_h, stride_kcs, KP_h,
                                stride_kps, slots, valid, A4, C0, l0, l1, l2, l3, QK, QKP, GK, NGK, K_FAST, LM, OP,
                                PREC, CONVERT)
                p, alpha, m, l = softmax_update(s, valid[None, :], m, l, cap_log2e, HAS_CAP)
                acc0, acc1, acc2, acc3, corr, ref = int2_values(
                    p, alpha, acc0, acc1, acc2, acc3, corr, ref, VC_h, stride_vcs, VP_h, stride_vps, slots, valid,
                    vslots, vmask, A4, RB, C0, l0, l1, l2, l3, QV, QVP, GV, NGV, V_FAST, LM, OP, PREC, CONVERT, False)
            acc0, acc1, acc2, acc3 = finish_int2_values(acc0, acc1, acc2, acc3, corr, ref, A4, NGV, V_FAST)

    has = l > 0.0
    inv_l = tl.where(has, 1.0 / tl.where(has, l, 1.0), 0.0)
    ooff = b.to(tl.int64) * stride_ob + heads * stride_oh + sp.to(tl.int64) * stride_os
    store_quarters(OPART, ooff, rmask, acc0, acc1, acc2, acc3, inv_l, QV, QVP, tl.float32)
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), NEG_INF)
    tl.store(LSE + b.to(tl.int64) * stride_lb + heads * stride_lh + sp, lse, mask=rmask)
