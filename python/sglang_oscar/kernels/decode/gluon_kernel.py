"""The Gluon decode stage-1 kernel (``triton.experimental.gluon``); see :mod:`.gluon_stage1` for the
scheme and the scope, :mod:`.gluon_operands` for the fragment bookkeeping. Importable without Gluon
(``HAVE_GLUON`` is then false and no kernel is defined).
"""

from __future__ import annotations

from ..tiles import hp_split_range, int2_split_range, request_sink_len
from .gluon_operands import K_PERM, K_WORD_SPLIT, P_PERM, V_PERM, _k_asm, _v_asm

try:  # Gluon ships with triton >= 3.5; this module is optional (the Triton kernels cover everything)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - exercised only with an older triton
    HAVE_GLUON = False


if HAVE_GLUON:
    K_ASM = gl.constexpr(_k_asm())
    V_ASM = gl.constexpr(_v_asm())
    MOVM_ASM = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")
    OUT16 = gl.constexpr("=r," * 16 + "r,r")
    NEG_INF_C = gl.constexpr(float("-inf"))
    K_WORD_SPLIT_C = gl.constexpr(K_WORD_SPLIT)
    K_PERM_C = gl.constexpr(K_PERM)
    V_PERM_C = gl.constexpr(V_PERM)
    P_PERM_C = gl.constexpr(P_PERM)

    MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
    DA = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
    DB = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
    # K words [BLOCK_N, 8]: thread (g, t) holds words 2t, 2t+1 of rows g, g+8, ...
    KW = gl.constexpr(gl.BlockedLayout([1, 2], [8, 4], [1, 1], [1, 0]))
    # V words [BLOCK_N, 8]: thread (g, t) holds word g of keys 2t, 2t+1, 2t+8, 2t+9, ...
    VW = gl.constexpr(gl.BlockedLayout([2, 1], [4, 8], [1, 1], [0, 1]))
    # HP rows [BLOCK_N, 128] (bf16 / fp16): 16-byte loads, 16 lanes per row
    HW = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0]))
    ROW1 = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))  # one key per lane
    # cp.async stages of the word ring (the fastest of 0 / 2 / 3 stages where timed: docs/kernels.md#gluon-pipeline)
    RING_STAGES = gl.constexpr(2)
    # shared-memory rings: word tiles row-major, pairs and slot ids 1-D
    SM2 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    SM1 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))

    @gluon.jit
    def _join16(o):
        a0 = gl.join(o[0], o[1])
        a1 = gl.join(o[2], o[3])
        a2 = gl.join(o[4], o[5])
        a3 = gl.join(o[6], o[7])
        a4 = gl.join(o[8], o[9])
        a5 = gl.join(o[10], o[11])
        a6 = gl.join(o[12], o[13])
        a7 = gl.join(o[14], o[15])
        return gl.join(gl.join(gl.join(a0, a1), gl.join(a2, a3)), gl.join(gl.join(a4, a5), gl.join(a6, a7)))

    @gluon.jit
    def _k_dims(c):
        """In-kernel :func:`k_column_dims`: dim of K at score-MMA column ``c`` (int32 tensor)."""
        o = c // 8
        return 4 * (2 * ((c // 2) % 4) + o // 8) + 2 * (c % 2) + (o // 4) % 2 + 32 * (o % 4)

    @gluon.jit
    def _v_dims(r):
        """In-kernel :func:`v_row_dims`: dim of V at value-accumulator row ``r`` (int32 tensor)."""
        m = r // 8
        return 4 * (r % 8) + m // 4 + 32 * (m % 4)

    @gluon.jit
    def _k_operand(kw, BLOCK_N: gl.constexpr):
        """K words ``[BLOCK_N, 8]`` int32 (layout KW) -> A operand ``[BLOCK_N, 128]`` fp16 (DA)."""
        o = gl.inline_asm_elementwise(K_ASM, OUT16, [kw], dtype=(gl.float16,) * 16, is_pure=True, pack=2)
        # join appends its new axis last: d is [BLOCK_N, 8, b0, b1, b2, b3], output o = 8 b3 + 4 b2 + 2 b1 + b0
        d = _join16(o)
        e = gl.reshape(d, [BLOCK_N, K_WORD_SPLIT_C[0], K_WORD_SPLIT_C[1], 2, 2, 2, 2])  # word = 2 t + h
        e = gl.permute(e, [K_PERM_C[0], K_PERM_C[1], K_PERM_C[2], K_PERM_C[3], K_PERM_C[4], K_PERM_C[5],
                           K_PERM_C[6]])  # column = 8 o + 2 t + h
        a = gl.reshape(e, [BLOCK_N, 128])
        return gl.convert_layout(a, DA, assert_trivial=True)

    @gluon.jit
    def _v_operand(vw, BLOCK_N: gl.constexpr):
        """V words ``[BLOCK_N, 8]`` int32 (layout VW) -> A operand ``[128, BLOCK_N]`` fp16 (DA)."""
        o = gl.inline_asm_elementwise(V_ASM, OUT16, [vw], dtype=(gl.float16,) * 16, is_pure=True, pack=2)
        d = _join16(o)  # [BLOCK_N, 8 (word g), b0, b1, b2, b3], m = 8 b3 + 4 b2 + 2 b1 + b0 = 4 byte + quarter
        # row = 8 m + g
        e = gl.permute(d, [V_PERM_C[0], V_PERM_C[1], V_PERM_C[2], V_PERM_C[3], V_PERM_C[4], V_PERM_C[5]])
        a = gl.reshape(e, [128, BLOCK_N])
        return gl.convert_layout(a, DA, assert_trivial=True)

    @gluon.jit
    def _p_operand(pw, BLOCK_N: gl.constexpr):
        """``P [BLOCK_N, 8]`` (any 16-bit float) in the accumulator layout -> B operand of the value MMA (DB)."""
        y = gl.inline_asm_elementwise(MOVM_ASM, "=r,r", [pw], dtype=pw.dtype, is_pure=True, pack=2)
        # movmatrix transposed each 8x8 tile in place: y[8i + a, b] holds P[8i + b, a]
        z = gl.permute(gl.reshape(y, [BLOCK_N // 8, 8, 8]), [P_PERM_C[0], P_PERM_C[1], P_PERM_C[2]])
        z = gl.reshape(z, [BLOCK_N, 8])
        return gl.convert_layout(z, DB, assert_trivial=True)

    @gluon.jit
    def _idx(x, IDX64: gl.constexpr):
        """Slot ids for address math: int64 when ``IDX64`` (a buffer of 2 GiB or more: byte offsets
        overflow int32), else int32."""
        if IDX64:
            return x.to(gl.int64)
        else:
            return x.to(gl.int32)

    @gluon.jit
    def _code_ptrs(sk, sv, KC_h, stride_kcs, VC_h, stride_vcs):
        """Pointers (int32 words) to the K code words ``[BLOCK_N, 8]`` of the keys at slots ``sk``
        (layout KW) and the V code words of the keys at slots ``sv`` (layout VW).

        The buffers come as byte pointers with byte strides, so Triton's stride specialisation
        (multiples of 16 bytes) shows the compiler when the K words ``2t, 2t+1`` of a row are
        8-byte aligned: one 8-byte copy instead of two. (Row addresses stay 64-bit products: 32-bit
        ones save instructions but the loop is latency-bound and they measured slower;
        docs/kernels.md#gluon-pipeline.)"""
        wk = gl.arange(0, 8, layout=gl.SliceLayout(0, KW))
        wv = gl.arange(0, 8, layout=gl.SliceLayout(0, VW))
        krow = (KC_h + sk * stride_kcs).to(gl.pointer_type(gl.int32), bitcast=True)
        vrow = (VC_h + sv * stride_vcs).to(gl.pointer_type(gl.int32), bitcast=True)
        return krow[:, None] + wk[None, :], vrow[:, None] + wv[None, :]

    @gluon.jit
    def _pair_ptr(s, P_h, stride_ps):
        """Pointers to the (scale, zero) word of the keys at slots ``s``."""
        return (P_h + s * stride_ps).to(gl.pointer_type(gl.int32), bitcast=True)

    @gluon.jit
    def _word_ring(ASYNC: gl.constexpr, BLOCK_N: gl.constexpr):
        """The ``cp.async`` ring of ``ASYNC`` stages :func:`_issue_words` fills: ``(K words, V words,
        K pairs, V pairs)`` shared tiles, int32 ``[ASYNC, BLOCK_N, 8]`` / ``[ASYNC, BLOCK_N]``."""
        return (gl.allocate_shared_memory(gl.int32, [ASYNC, BLOCK_N, 8], SM2),
                gl.allocate_shared_memory(gl.int32, [ASYNC, BLOCK_N, 8], SM2),
                gl.allocate_shared_memory(gl.int32, [ASYNC, BLOCK_N], SM1),
                gl.allocate_shared_memory(gl.int32, [ASYNC, BLOCK_N], SM1))

    @gluon.jit
    def _issue_words(sk, sv, s1, ring, st, KC_h, stride_kcs, KP_h, stride_kps, VC_h, stride_vcs, VP_h, stride_vps):
        """``cp.async`` of the K / V code words and (scale, zero) words of the keys at slots ``sk`` / ``sv``
        (the same keys in two layouts), into stage ``st`` of ``ring`` = ``(K words, V words, K pairs,
        V pairs)`` shared tiles: the code words by the threads that read
        them back (:func:`_read_words`), the pair words one key per lane (slots ``s1``, layout ROW1:
        the read-back layout replicates each key over 4 lanes, whose copies would need guards)."""
        ksm, vsm, kpsm, vpsm = ring
        kptr, vptr = _code_ptrs(sk, sv, KC_h, stride_kcs, VC_h, stride_vcs)
        async_copy.async_copy_global_to_shared(ksm.index(st), kptr)
        async_copy.async_copy_global_to_shared(vsm.index(st), vptr)
        async_copy.async_copy_global_to_shared(kpsm.index(st), _pair_ptr(s1, KP_h, stride_kps))
        async_copy.async_copy_global_to_shared(vpsm.index(st), _pair_ptr(s1, VP_h, stride_vps))
        async_copy.commit_group()

    @gluon.jit
    def _issue_slots(R2T_r, n0, hi, slot_ring, st, BLOCK_N: gl.constexpr):
        """``cp.async`` of the slot ids of keys ``[n0, n0 + BLOCK_N)`` into stage ``st`` of ``slot_ring``
        (one key per lane; positions past ``hi`` read the slot of key ``hi - 1``: a real row, masked
        later). Not committed here: it joins the caller's group."""
        r = gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=ROW1), hi - 1)
        async_copy.async_copy_global_to_shared(slot_ring.index(st), R2T_r + r)

    @gluon.jit
    def _read_slots(slot_ring, st, IDX64: gl.constexpr):
        """Slot ids of stage ``st`` in the K-row, V-key and one-per-lane layouts (int64 when
        ``IDX64``, else int32, whatever the ring's dtype)."""
        sm = slot_ring.index(st)
        return (_idx(sm.load(gl.SliceLayout(1, KW)), IDX64), _idx(sm.load(gl.SliceLayout(1, VW)), IDX64),
                _idx(sm.load(ROW1), IDX64))

    @gluon.jit
    def _read_words(ring, st):
        """The words of stage ``st``: ``(K words [BLOCK_N, 8] in KW, V words in VW, K and V pair words
        [BLOCK_N] in the K-row layout)``."""
        ksm, vsm, kpsm, vpsm = ring
        return (ksm.index(st).load(KW), vsm.index(st).load(VW), kpsm.index(st).load(gl.SliceLayout(1, KW)),
                vpsm.index(st).load(gl.SliceLayout(1, KW)))

    @gluon.jit
    def _rcp(x):
        """``1 / x`` by ``rcp.approx.ftz.f32`` (within 1 ulp; ``/`` compiles to a range-checked
        division per numerator). Used for ``1 / ref``: while ``ref`` stays the same, the rescale
        factor ``ref * (1 / ref)`` may be ``1 +- 1 ulp`` instead of exactly 1, and it multiplies the
        value sums (not the softmax denominator) once per block, so the output can drift by about
        ``blocks x 2^-23`` relative: ~2e-5 at the default split counts, ~5e-4 for one split over 128K
        keys (``x`` normal; ``ref`` starts at 1e-30)."""
        return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _lo_half(w):
        return (w & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)

    @gluon.jit
    def _hi_half(w):
        return (w >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)

    @gluon.jit
    def _block(w, n0, hi, qb, qsum_u, m, ref, lt, corr, acc, zero_s, zero_o, BLOCK_N: gl.constexpr,
               MASKED: gl.constexpr):
        """One block of keys ``[n0, n0 + BLOCK_N)`` (words ``w`` from :func:`_read_words`) into the
        running state ``(m, ref, lt, corr, acc)``: scores, online softmax (base 2), values.
        ``MASKED``: the block may reach past ``hi`` (only a split's last block can: split ranges
        are ``BLOCK_N``-aligned, :func:`.tiles.int2_split_range`); full blocks skip every mask."""
        kw, vw, kp, vp = w
        # scores in units of 2^16: u = sk (d - zk qsum_u) with d = 2^-16 q.c (subnormal operands,
        # module doc) and qsum_u = 2^-16 sum q, so the score is s = 2^16 u (exact power-of-two
        # scaling) and the 2^16 goes into the max and the exponent's FFMA
        d = mma_v2(_k_operand(kw, BLOCK_N), qb, zero_s)
        kp_m = gl.convert_layout(kp, gl.SliceLayout(1, MMA), assert_trivial=True)
        vp_m = gl.convert_layout(vp, gl.SliceLayout(1, MMA), assert_trivial=True)
        u = (d - _hi_half(kp_m)[:, None] * qsum_u[None, :]) * _lo_half(kp_m)[:, None]
        sv = _lo_half(vp_m)
        zv = _hi_half(vp_m)
        if MASKED:
            # keys past the range read slot 0, whose pairs may be anything (even NaN): zero them
            valid = (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))) < hi
            u = gl.where(valid[:, None], u, NEG_INF_C)
            sv = gl.where(valid, sv, 0.0)
            zv = gl.where(valid, zv, 0.0)
        m_new = gl.maximum(m, gl.max(u, axis=0) * 65536.0)
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(u * 65536.0 - m_new[None, :])
        # values: P scaled by v_scale / ref (ref = running max of the V scales, keeps P <= 1)
        new_ref = gl.maximum(ref, gl.max(sv, axis=0))
        inv_ref = _rcp(new_ref)
        beta = alpha * (ref * inv_ref)
        pw = (p * (sv * inv_ref)[:, None]).to(gl.float16)
        lt = lt * alpha[None, :] + p
        corr = corr * beta[None, :] + pw.to(gl.float32) * zv[:, None]
        o = mma_v2(_v_operand(vw, BLOCK_N), _p_operand(pw, BLOCK_N), zero_o)
        acc = acc * beta[None, :] + o
        return m_new, new_ref, lt, corr, acc

    @gluon.jit
    def _int2_split(Q, stride_qb, stride_qh, KC, stride_kcs, stride_kch, KP, stride_kps, stride_kph,
                    VC, stride_vcs, stride_vch, VP, stride_vps, stride_vph, R2T, stride_r2t,
                    OPART, stride_ob, stride_oh, stride_os, lse_ptr,
                    b, kvh, h0, req, L, sink_r, win_lo, spq, sp, heads_o, hmask_o, qscale, sink, recent, NS_Q,
                    MIN_CHUNK,
                    GROUP: gl.constexpr, BLOCK_N: gl.constexpr, IDX64: gl.constexpr, ASYNC: gl.constexpr):
        """INT2 split ``spq`` of ``NS_Q`` over ``[max(sink_r, window start), L - recent)``."""
        lo, hi = int2_split_range(sink_r, win_lo, L, sink, recent, spq, NS_Q, BLOCK_N, MIN_CHUNK)
        if hi <= lo:  # empty split (short context): only its log-sum-exp, which the merge skips on
            gl.store(lse_ptr, gl.full([8], NEG_INF_C, gl.float32, gl.SliceLayout(0, MMA)), mask=hmask_o)
        else:
            # q as the B operand [128, 8]: column c of head h is q[h, k_dims(c)] * qscale, rounded to
            # fp16, times 2^(8 - 2k) for the quarter k of that dim (exact power-of-two scaling)
            cq = gl.arange(0, 128, layout=gl.SliceLayout(1, DB))
            hq = gl.arange(0, 8, layout=gl.SliceLayout(0, DB))
            hmask = (h0 + hq) < GROUP
            kdim = _k_dims(cq)
            heads = (kvh * GROUP + h0 + hq).to(gl.int64)
            qv = gl.load(Q + b.to(gl.int64) * stride_qb + heads[None, :] * stride_qh + kdim[:, None],
                         mask=hmask[None, :], other=0.0)
            qr = (qv.to(gl.float32) * qscale).to(gl.float16)
            qsum_u = gl.convert_layout(gl.sum(qr.to(gl.float32), axis=0), gl.SliceLayout(0, MMA)) * (1.0 / 65536.0)
            qf = gl.exp2((8 - 2 * (kdim // 32)).to(gl.float32))
            qb = (qr.to(gl.float32) * qf[:, None]).to(gl.float16)

            kvh64 = kvh.to(gl.int64)
            KC_h = KC + kvh64 * stride_kch
            KP_h = KP + kvh64 * stride_kph
            VC_h = VC + kvh64 * stride_vch
            VP_h = VP + kvh64 * stride_vph
            R2T_r = R2T + req * stride_r2t

            m = gl.full([8], NEG_INF_C, gl.float32, gl.SliceLayout(0, MMA))
            lt = gl.full([BLOCK_N, 8], 0.0, gl.float32, MMA)
            corr = gl.full([BLOCK_N, 8], 0.0, gl.float32, MMA)
            acc = gl.full([128, 8], 0.0, gl.float32, MMA)
            ref = 1e-30
            zero_s = gl.full([BLOCK_N, 8], 0.0, gl.float32, MMA)
            zero_o = gl.full([128, 8], 0.0, gl.float32, MMA)

            full_hi = lo + (hi - lo) // BLOCK_N * BLOCK_N  # the full blocks, then at most one partial block
            # pipeline through shared memory: code / pair words ASYNC - 1 blocks ahead by cp.async (no
            # registers held for them) and the slot ids SLOT_LEAD = 2 ASYNC - 1 blocks ahead, read back
            # by LDS in the three layouts, so no global load is waited on in the loop.
            # Groups: prologue word groups for blocks 0 .. ASYNC - 2, then one group per iteration j
            # with the words of block j + ASYNC - 1 and the slots of block j + SLOT_LEAD.
            SLOT_LEAD: gl.constexpr = 2 * ASYNC - 1
            # slot stages: the prologue fills 2 ASYNC - 1 without wrapping, and a stage is rewritten
            # ASYNC + 2 iterations after it was read (a simulation of the group accounting: >= 2 ASYNC - 1)
            SR: gl.constexpr = 2 * ASYNC + 2
            ring = _word_ring(ASYNC, BLOCK_N)
            # in req_to_token's own dtype (int32 in SGLang; int64 allowed): a copy converts nothing
            slot_ring = gl.allocate_shared_memory(R2T.dtype.element_ty, [SR, BLOCK_N], SM1)
            for i in gl.static_range(SLOT_LEAD):
                _issue_slots(R2T_r, lo + i * BLOCK_N, hi, slot_ring, i, BLOCK_N)
            async_copy.commit_group()
            async_copy.wait_group(0)
            for i in gl.static_range(ASYNC - 1):
                sk, sv, s1 = _read_slots(slot_ring, i, IDX64)
                _issue_words(sk, sv, s1, ring, i, KC_h, stride_kcs, KP_h, stride_kps, VC_h, stride_vcs, VP_h,
                             stride_vps)
            j = 0
            for n0 in range(lo, full_hi, BLOCK_N):
                # slots of block j + ASYNC - 1 (group j + ASYNC - 1 - SLOT_LEAD, or the prologue)
                async_copy.wait_group(SLOT_LEAD - ASYNC)
                sk, sv, s1 = _read_slots(slot_ring, (j + ASYNC - 1) % SR, IDX64)
                _issue_slots(R2T_r, n0 + SLOT_LEAD * BLOCK_N, hi, slot_ring, (j + SLOT_LEAD) % SR, BLOCK_N)
                _issue_words(sk, sv, s1, ring, (j + ASYNC - 1) % ASYNC, KC_h, stride_kcs, KP_h, stride_kps,
                             VC_h, stride_vcs, VP_h, stride_vps)  # commits this iteration's group
                async_copy.wait_group(ASYNC - 1)  # block j's words have landed
                m, ref, lt, corr, acc = _block(_read_words(ring, j % ASYNC), n0, hi, qb, qsum_u, m, ref, lt,
                                               corr, acc, zero_s, zero_o, BLOCK_N, False)
                j += 1
            async_copy.wait_group(0)
            if full_hi < hi:
                m, ref, lt, corr, acc = _block(_read_words(ring, j % ASYNC), full_hi, hi, qb, qsum_u, m, ref,
                                               lt, corr, acc, zero_s, zero_o, BLOCK_N, True)

            l_h = gl.sum(lt, axis=0)
            c_h = gl.sum(corr, axis=0)
            has = l_h > 0.0
            inv_l = gl.where(has, 1.0 / gl.where(has, l_h, 1.0), 0.0)
            r_o = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
            vdim = _v_dims(r_o)
            # O = ref (2^(24-2k) acc - sum pw zv), k = the quarter of the row's dim
            rf = gl.exp2((24 - 2 * (vdim // 32)).to(gl.float32))
            out = (acc * rf[:, None] - c_h[None, :]) * (ref * inv_l)[None, :]
            obase = OPART + b.to(gl.int64) * stride_ob + sp * stride_os
            gl.store(obase + heads_o[None, :] * stride_oh + vdim[:, None], out, mask=hmask_o[None, :])
            lse = gl.where(has, m + gl.log2(gl.where(has, l_h, 1.0)), NEG_INF_C)
            gl.store(lse_ptr, lse, mask=hmask_o)

    @gluon.jit
    def _hp_split(Q, stride_qb, stride_qh, HK, stride_hkr, stride_hkh, HV, stride_hvr, stride_hvh, HPI, stride_hpi,
                  OPART, stride_ob, stride_oh, stride_os, lse_ptr,
                  b, kvh, h0, req, L, sink_r, win_lo, sp, heads_o, hmask_o, qscale, sink, recent, NS_HP,
                  GROUP: gl.constexpr, HP_BLOCK: gl.constexpr):
        """HP split ``sp`` of ``NS_HP``: BF16/FP16 sink rows then recent-ring rows, one virtual range
        (``_decode_stage1``'s HP branch). Scores from fp16 operands (q and the K rows rounded to
        fp16, as in the Triton kernel); values from the V rows as stored (bf16 / fp16) and P as a
        rounded part plus the rounded remainder (two MMAs); P goes through ``movmatrix``, V^T
        through a shared-memory layout change (this tier is at most ``sink + recent`` keys)."""
        n_sink, rec_start, lo, hi = hp_split_range(sink_r, win_lo, L, sink, recent, sp, NS_HP, HP_BLOCK)
        if hi <= lo:
            gl.store(lse_ptr, gl.full([8], NEG_INF_C, gl.float32, gl.SliceLayout(0, MMA)), mask=hmask_o)
        else:
            ring = gl.maximum(recent, 1)
            cq = gl.arange(0, 128, layout=gl.SliceLayout(1, DB))
            hq = gl.arange(0, 8, layout=gl.SliceLayout(0, DB))
            heads = (kvh * GROUP + h0 + hq).to(gl.int64)
            qv = gl.load(Q + b.to(gl.int64) * stride_qb + heads[None, :] * stride_qh + cq[:, None],
                         mask=((h0 + hq) < GROUP)[None, :], other=0.0)
            # scores in fp16 (K rows rounded to fp16, as the Triton kernel does); values in the HP
            # buffer's own dtype with P split into a rounded part and the rounded remainder (two
            # MMAs), so P keeps ~16 significant bits even when the rows are bf16
            qn = (qv.to(gl.float32) * qscale).to(gl.float16)
            kvh64 = kvh.to(gl.int64)
            HK_h = HK + kvh64 * stride_hkh
            HV_h = HV + kvh64 * stride_hvh
            HPI_r = HPI + req * stride_hpi
            m = gl.full([8], NEG_INF_C, gl.float32, gl.SliceLayout(0, MMA))
            lt = gl.full([HP_BLOCK, 8], 0.0, gl.float32, MMA)
            acc = gl.full([128, 8], 0.0, gl.float32, MMA)
            zero_s = gl.full([HP_BLOCK, 8], 0.0, gl.float32, MMA)
            zero_o = gl.full([128, 8], 0.0, gl.float32, MMA)
            # row bookkeeping one key per lane (HP_BLOCK <= 32), then broadcast to the load layout
            rows_1 = gl.arange(0, HP_BLOCK, layout=ROW1)
            d_a = gl.arange(0, 128, layout=gl.SliceLayout(0, HW))
            for v0 in range(lo, hi, HP_BLOCK):
                v = v0 + rows_1
                tm = v < hi
                pos = gl.where(v < n_sink, v, rec_start + v - n_sink)
                entry = gl.where(pos < sink, pos, sink + pos % ring)
                hrow = gl.load(HPI_r + entry, mask=tm, other=-1)
                valid1 = tm & (hrow >= 0) & (pos >= win_lo)
                hrow = gl.convert_layout(gl.where(valid1, hrow, 0).to(gl.int64), gl.SliceLayout(1, HW))
                valid = gl.convert_layout(valid1, gl.SliceLayout(1, HW))
                kt = gl.load(HK_h + hrow[:, None] * stride_hkr + d_a[None, :], mask=valid[:, None], other=0.0)
                # rows past the range or without an HP row may hold anything: their values read as 0
                vt = gl.load(HV_h + hrow[:, None] * stride_hvr + d_a[None, :], mask=valid[:, None], other=0.0)
                s = mma_v2(gl.convert_layout(kt.to(gl.float32).to(gl.float16), DA), qn, zero_s)
                valid_m = gl.convert_layout(valid1, gl.SliceLayout(1, MMA))
                s = gl.where(valid_m[:, None], s, NEG_INF_C)
                m_new = gl.maximum(m, gl.max(s, axis=0))
                # a block whose keys are all invalid (e.g. sink rows outside a sliding window) keeps
                # m = -inf: exponentiate against 0 there, not -inf - (-inf) = NaN
                m_use = gl.where(m_new == NEG_INF_C, 0.0, m_new)
                alpha = gl.exp2(m - m_use)
                p = gl.exp2(s - m_use[None, :])
                lt = lt * alpha[None, :] + p
                vT = gl.convert_layout(gl.permute(vt, [1, 0]), DA)
                p_hi = p.to(HK.dtype.element_ty)
                p_lo = (p - p_hi.to(gl.float32)).to(HK.dtype.element_ty)
                o = mma_v2(vT, _p_operand(p_lo, HP_BLOCK), mma_v2(vT, _p_operand(p_hi, HP_BLOCK), zero_o))
                acc = acc * alpha[None, :] + o
                m = m_new
            l_h = gl.sum(lt, axis=0)
            has = l_h > 0.0
            inv_l = gl.where(has, 1.0 / gl.where(has, l_h, 1.0), 0.0)
            r_o = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
            obase = OPART + b.to(gl.int64) * stride_ob + sp.to(gl.int64) * stride_os
            gl.store(obase + heads_o[None, :] * stride_oh + r_o[:, None], acc * inv_l[None, :], mask=hmask_o[None, :])
            lse = gl.where(has, m + gl.log2(gl.where(has, l_h, 1.0)), NEG_INF_C)
            gl.store(lse_ptr, lse, mask=hmask_o)

    @gluon.jit
    def _gluon_decode_stage1(
        Q, stride_qb, stride_qh,
        KC, stride_kcs, stride_kch, KP, stride_kps, stride_kph,
        VC, stride_vcs, stride_vch, VP, stride_vps, stride_vph,
        HK, stride_hkr, stride_hkh, HV, stride_hvr, stride_hvh, HPI, stride_hpi,
        R2T, stride_r2t, RPI, SEQ, SINKL,
        OPART, stride_ob, stride_oh, stride_os, LSE, stride_lb, stride_lh,
        qscale, sink, recent, window, NS_HP, NS_Q, MIN_CHUNK,
        GROUP: gl.constexpr, BLOCKS_PER_KV: gl.constexpr, BLOCK_N: gl.constexpr,
        HAS_WINDOW: gl.constexpr, HAS_SINKL: gl.constexpr, IDX64: gl.constexpr, HP_BLOCK: gl.constexpr = 16,
    ):
        """Stage 1 of decode attention (the grid and outputs of :func:`.decode._decode_stage1`): split
        ``program_id(2)`` of request ``program_id(0)`` for 8 q heads of one kv head; splits
        ``[0, NS_HP)`` read the HP rows (sink, then the recent ring), ``[NS_HP, NS_HP + NS_Q)`` the INT2
        middle.

        ``KC``/``VC``: the code buffers ``[S, H_kv, 32]`` and ``KP``/``VP``: the (scale, zero) pairs
        ``[S, H_kv, 4]`` (fp16 scale in bytes 0-1), all as byte pointers with byte strides, read as
        int32 words (:func:`_issue_words`).
        Writes ``OPART[b, h, split, :]`` (normalised, fp32) and ``LSE[b, h, split]`` (base 2).
        """
        b = gl.program_id(0)
        hb = gl.program_id(1)
        sp = gl.program_id(2)
        kvh = hb // BLOCKS_PER_KV
        h0 = (hb % BLOCKS_PER_KV) * 8
        req = gl.load(RPI + b).to(gl.int64)
        L = gl.load(SEQ + b).to(gl.int32)
        sink_r = request_sink_len(SINKL, req, sink, L, HAS_SINKL)
        if HAS_WINDOW:
            win_lo = gl.maximum(L - window, 0)
        else:
            win_lo = L * 0
        h_o = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        hmask_o = (h0 + h_o) < GROUP
        heads_o = (kvh * GROUP + h0 + h_o).to(gl.int64)
        lse_ptr = LSE + b.to(gl.int64) * stride_lb + heads_o * stride_lh + sp
        if sp < NS_HP:
            _hp_split(Q, stride_qb, stride_qh, HK, stride_hkr, stride_hkh, HV, stride_hvr, stride_hvh, HPI,
                      stride_hpi, OPART, stride_ob, stride_oh, stride_os, lse_ptr,
                      b, kvh, h0, req, L, sink_r, win_lo, sp, heads_o, hmask_o, qscale, sink, recent, NS_HP,
                      GROUP, HP_BLOCK)
        else:
            _int2_split(Q, stride_qb, stride_qh, KC, stride_kcs, stride_kch, KP, stride_kps, stride_kph,
                        VC, stride_vcs, stride_vch, VP, stride_vps, stride_vph, R2T, stride_r2t,
                        OPART, stride_ob, stride_oh, stride_os, lse_ptr,
                        b, kvh, h0, req, L, sink_r, win_lo, sp - NS_HP, sp.to(gl.int64), heads_o, hmask_o, qscale,
                        sink, recent, NS_Q, MIN_CHUNK, GROUP, BLOCK_N, IDX64, RING_STAGES)
