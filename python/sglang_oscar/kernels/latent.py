"""Decode attention of MLA layers over the packed INT2 latent cache (absorbed MQA, split-KV).

The oracle is :func:`sglang_oscar.reference.latent.latent_attention` (``output="latent_rotated"``,
window mode ``"decode"``). Per token the pool holds the rotated latent ``c' = c Rot`` (``R`` =
kv_lora_rank) as INT2 codes + (scale, zero) pairs, and ``k_pe`` (``P`` dims) in BF16; the sink and
recent windows keep the BF16 latent row and ``k_pe`` in HP rows, addressed exactly as the MHA
pool's (:mod:`.decode.triton_stage1`: position ``p < sink_len`` from sink row ``hp_index[req, p]``,
``p >= max(sink, L - recent)`` from ring row ``hp_index[req, sink + p % recent]``, the rest from
INT2 slot ``req_to_token[req, p]``). Every q head of a request shares each latent read: one program takes
``BLOCK_H`` heads and one split of the positions, scores
``s_j = (q_abs' . c'_j + q_pe . k_pe_j) * scale`` and accumulates ``sum_j p_j c'_j`` from the same
dequantized tile (V is the latent itself, so its codes are read once). The output is the latent
``o' = o_latent Rot`` in the rotated frame ``[B, H, R]``; the caller counter-rotates and applies
``W_UV`` (``reference.latent`` module docstring). Stage 2 is the MHA decode merge
(:func:`.decode.merge.decode_merge`).

The launches (checks, split count, workspace, one plan per decode batch) are
:mod:`.latent_plan`'s. With ``SPARSE`` (DSA) a program walks entries of each request's top-k list of
positions instead of a range of them, each position still read from its tier. The kernel
dequantizes elementwise (``scale * (level[code] - zero)``, one pair load per element, any group
size) and multiplies with the engine ``precision`` names: fp32 (IEEE, what the
interpreter and the oracle compute; the exactness tests), TF32 or BF16 tensor cores (serving).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.int2 import codebook
from ..rotation.latent import latent_rank_supported
from .codes import level_of, round_to
from .compile_check import active as compiling
from .compile_check import launch as _launch
from .layout import next_pow2
from .tiles import NEG_INF, request_sink_len
from .validate import INDEX_DTYPES, check_tensor


@triton.jit
def _quarter_pair(KPR, slots, stride_kps, ok, K: tl.constexpr, Q: tl.constexpr, G: tl.constexpr):
    """``(scale, zero)`` fp32 ``[BLOCK_N]`` of quarter ``K`` of each row, when a quarter lies in one
    group (``G`` a multiple of ``Q``); 0 where ``ok`` is false."""
    pair = KPR + slots * stride_kps + 2 * ((K * Q) // G)
    return tl.load(pair, mask=ok, other=0.0).to(tl.float32), tl.load(pair + 1, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _latent_quarter(KC, stride_kcs, KPR, stride_kps, HC, stride_hcr, slots, rows, int2, hp,
                    l0, l1, l2, l3, K: tl.constexpr, Q: tl.constexpr, G: tl.constexpr):
    """Quarter ``K`` (elements ``[K*Q, (K+1)*Q)``) of the latent rows of one block, fp32
    ``[BLOCK_N, Q]``: HP rows where ``hp``, dequantized INT2 codes where ``int2``, else 0."""
    cols = tl.arange(0, Q)
    byte = tl.load(KC + slots[:, None] * stride_kcs + cols[None, :], mask=int2[:, None], other=0)
    code = (byte >> (2 * K)) & 3
    lv = level_of(code, l0, l1, l2, l3)
    if G % Q == 0:  # the quarter lies in one group: one pair per row (DeepSeek-V3: R 512, G 128)
        scale, zero = _quarter_pair(KPR, slots, stride_kps, int2, K, Q, G)
        deq = scale[:, None] * (lv - zero[:, None])
    else:
        pair = KPR + slots[:, None] * stride_kps + 2 * ((K * Q + cols[None, :]) // G)
        scale = tl.load(pair, mask=int2[:, None], other=0.0).to(tl.float32)
        zero = tl.load(pair + 1, mask=int2[:, None], other=0.0).to(tl.float32)
        deq = scale * (lv - zero)
    hpv = tl.load(HC + rows[:, None] * stride_hcr + K * Q + cols[None, :], mask=hp[:, None], other=0.0)
    return tl.where(hp[:, None], hpv.to(tl.float32), tl.where(int2[:, None], deq, 0.0))


@triton.jit
def _latent_tile(KC, stride_kcs, KPR, stride_kps, KPE, stride_kpe, HC, stride_hcr, HPE, stride_hper,
                 slots, rows, int2, hp, pcols, pmask, l0, l1, l2, l3, Q: tl.constexpr, G: tl.constexpr):
    """One block of latent rows as the attention kernels read it, fp32: the quarters ``c0..c3
    [BLOCK_N, Q]`` (:func:`_latent_quarter`) and ``k_pe [BLOCK_N, PP]``, each row from its HP row
    where ``hp``, its INT2 slot where ``int2``, else 0."""
    c0 = _latent_quarter(KC, stride_kcs, KPR, stride_kps, HC, stride_hcr, slots, rows, int2, hp, l0, l1, l2, l3, 0, Q, G)
    c1 = _latent_quarter(KC, stride_kcs, KPR, stride_kps, HC, stride_hcr, slots, rows, int2, hp, l0, l1, l2, l3, 1, Q, G)
    c2 = _latent_quarter(KC, stride_kcs, KPR, stride_kps, HC, stride_hcr, slots, rows, int2, hp, l0, l1, l2, l3, 2, Q, G)
    c3 = _latent_quarter(KC, stride_kcs, KPR, stride_kps, HC, stride_hcr, slots, rows, int2, hp, l0, l1, l2, l3, 3, Q, G)
    kpe_i = tl.load(KPE + slots[:, None] * stride_kpe + pcols[None, :], mask=int2[:, None] & pmask[None, :], other=0.0)
    kpe_h = tl.load(HPE + rows[:, None] * stride_hper + pcols[None, :], mask=hp[:, None] & pmask[None, :], other=0.0)
    return c0, c1, c2, c3, tl.where(hp[:, None], kpe_h.to(tl.float32), kpe_i.to(tl.float32))


# dot-product engines of the decode kernel: exact fp32 (the oracle's arithmetic), TF32 or BF16
# tensor cores (BF16: the operands SGLang's BF16 MLA kernels multiply; not under the interpreter)
PRECISIONS = {"ieee": 0, "tf32": 1, "bf16": 2}


@triton.jit
def _mma(a, b, acc, DOT: tl.constexpr):
    """``acc + a @ b`` (fp32 accumulate) with the operands of engine ``DOT`` (:data:`PRECISIONS`)."""
    if DOT == 2:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif DOT == 1:
        return tl.dot(a, b, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _program(RPI, SEQ, SINKL, sink, recent, num_splits, H: tl.constexpr, BLOCK_H: tl.constexpr,
             BLOCK_N: tl.constexpr, HAS_SINKL: tl.constexpr):
    """What a stage-1 program covers: ``(b, heads, hmask, sp, req, lo, hi, ring, sink_r, rec_start)``.
    Split ``sp`` of request ``b`` takes positions ``[lo, hi)`` (a multiple of ``BLOCK_N`` long but
    the last); the MHA decode's tiers (``tiles.hp_split_range`` / ``int2_split_range``): sink rows
    for ``p < sink_r``, the ring for ``p >= rec_start = max(sink, L - recent)``, INT2 between (sink
    positions without a row included)."""
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    sp = tl.program_id(2)
    req = tl.load(RPI + b).to(tl.int64)
    L = tl.load(SEQ + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(L, num_splits), BLOCK_N) * BLOCK_N
    lo = sp * chunk
    sink_r = request_sink_len(SINKL, req, sink, L, HAS_SINKL)
    return (b, heads, heads < H, sp, req, lo, tl.minimum(lo + chunk, L), tl.maximum(recent, 1), sink_r,
            tl.maximum(sink, L - recent))


@triton.jit
def _load_query(QA, QP, qa_rows, qp_rows, hmask, qscale, Q: tl.constexpr, P: tl.constexpr, PP: tl.constexpr):
    """The program's query rows (element offsets ``qa_rows`` / ``qp_rows`` int64 ``[rows]`` into
    ``QA`` / ``QP``; ``hmask`` the live ones): quarters and rope part, fp32 and pre-scaled by
    ``qscale``: ``(q0, q1, q2, q3 [rows, Q], qp [rows, PP], pcols, pmask)``."""
    qa = QA + qa_rows[:, None]
    cols = tl.arange(0, Q)
    q0 = tl.load(qa + cols[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * qscale
    q1 = tl.load(qa + Q + cols[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * qscale
    q2 = tl.load(qa + 2 * Q + cols[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * qscale
    q3 = tl.load(qa + 3 * Q + cols[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * qscale
    pcols = tl.arange(0, PP)
    pmask = pcols < P
    qp = tl.load(QP + qp_rows[:, None] + pcols[None, :], mask=hmask[:, None] & pmask[None, :],
                 other=0.0).to(tl.float32) * qscale
    return q0, q1, q2, q3, qp, pcols, pmask


@triton.jit
def _empty_state(BLOCK_H: tl.constexpr, Q: tl.constexpr):
    """Online-softmax state before the first block: ``(m = -inf, l = 0, acc0..acc3 = 0 [BLOCK_H, Q])``."""
    acc = tl.zeros([BLOCK_H, Q], tl.float32)
    return tl.full([BLOCK_H], NEG_INF, tl.float32), tl.zeros([BLOCK_H], tl.float32), acc, acc, acc, acc


@triton.jit
def _softmax_step(s, mask, m, l):
    """Online-softmax update of one block of base-2 scores ``s [rows, BLOCK_N]`` (``mask``: which
    scores count, ``[1, BLOCK_N]`` or ``[rows, BLOCK_N]``): ``(p, alpha, m, l)``."""
    s = tl.where(mask, s, NEG_INF)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.where(m_new > NEG_INF, tl.exp2(m - m_new), 1.0)
    p = tl.where(mask, tl.exp2(s - tl.where(m_new > NEG_INF, m_new, 0.0)[:, None]), 0.0)
    return p, alpha, m_new, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _attend_tile(q0, q1, q2, q3, qp, c0, c1, c2, c3, kpe, mask, m, l, acc0, acc1, acc2, acc3,
                 BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """One block of latent rows (quarters ``c0..c3 [BLOCK_N, Q]`` and ``kpe``, fp32) as K and V for
    ``BLOCK_H`` query rows (``mask`` as :func:`_softmax_step`'s): scores, online softmax, value sums;
    returns ``(m, l, acc0, acc1, acc2, acc3)``."""
    s = _mma(q0, tl.trans(c0), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), DOT)
    s = _mma(q1, tl.trans(c1), s, DOT)
    s = _mma(q2, tl.trans(c2), s, DOT)
    s = _mma(q3, tl.trans(c3), s, DOT)
    s = _mma(qp, tl.trans(kpe), s, DOT)
    p, alpha, m, l = _softmax_step(s, mask, m, l)
    acc0 = _mma(p, c0, acc0 * alpha[:, None], DOT)
    acc1 = _mma(p, c1, acc1 * alpha[:, None], DOT)
    acc2 = _mma(p, c2, acc2 * alpha[:, None], DOT)
    acc3 = _mma(p, c3, acc3 * alpha[:, None], DOT)
    return m, l, acc0, acc1, acc2, acc3


@triton.jit
def _store_partial(OPART, stride_ob, stride_oh, stride_os, LSE, stride_lb, stride_lh, b, heads, hmask, sp,
                   m, l, acc0, acc1, acc2, acc3, Q: tl.constexpr):
    """The program's normalised partial latent output and base-2 log-sum-exp (``-inf`` when empty)."""
    has = l > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, l, 1.0), 0.0)
    cols = tl.arange(0, Q)
    o = OPART + b.to(tl.int64) * stride_ob + heads[:, None].to(tl.int64) * stride_oh + sp.to(tl.int64) * stride_os
    tl.store(o + cols[None, :], acc0 * inv[:, None], mask=hmask[:, None])
    tl.store(o + Q + cols[None, :], acc1 * inv[:, None], mask=hmask[:, None])
    tl.store(o + 2 * Q + cols[None, :], acc2 * inv[:, None], mask=hmask[:, None])
    tl.store(o + 3 * Q + cols[None, :], acc3 * inv[:, None], mask=hmask[:, None])
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), NEG_INF)
    tl.store(LSE + b.to(tl.int64) * stride_lb + heads.to(tl.int64) * stride_lh + sp, lse, mask=hmask)


@triton.jit
def _latent_decode_stage1(
    QA, stride_qab, stride_qah, QP, stride_qpb, stride_qph,
    KC, stride_kcs, KPR, stride_kps, KPE, stride_kpe, HC, stride_hcr, HPE, stride_hper,
    HPI, stride_hpi, R2T, stride_r2t, RPI, SEQ, SINKL,
    OPART, stride_ob, stride_oh, stride_os, LSE, stride_lb, stride_lh,
    qscale, sink, recent, num_splits, l0, l1, l2, l3, TOPK, stride_tk, n_topk,
    H: tl.constexpr, Q: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, G: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINKL: tl.constexpr, DOT: tl.constexpr,
    SPARSE: tl.constexpr,
):
    """Grid ``(batch, head blocks, splits)``: split ``sp`` of request ``b`` covers positions
    ``[sp * chunk, (sp + 1) * chunk)`` of ``[0, L)`` (``chunk`` a multiple of ``BLOCK_N``) and
    writes its normalised partial latent output and base-2 log-sum-exp (``-inf`` when empty).
    ``SPARSE`` (DSA): the split covers entries ``[lo, hi)`` of the request's top-k list
    ``TOPK[b, :n_topk]`` instead, each a position in ``[0, L)`` or ``-1`` (unused); every position
    keeps its tier (sink row, ring row or INT2 slot)."""
    b, heads, hmask, sp, req, lo, hi, ring, sink_r, rec_start = _program(
        RPI, SEQ, SINKL, sink, recent, num_splits, H, BLOCK_H, BLOCK_N, HAS_SINKL)
    if SPARSE:
        L = tl.load(SEQ + b).to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(n_topk, num_splits), BLOCK_N) * BLOCK_N
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, n_topk)
    hrow = heads.to(tl.int64)
    q0, q1, q2, q3, qp, pcols, pmask = _load_query(QA, QP, b.to(tl.int64) * stride_qab + hrow * stride_qah,
                                                   b.to(tl.int64) * stride_qpb + hrow * stride_qph, hmask, qscale,
                                                   Q, P, PP)

    m, l, acc0, acc1, acc2, acc3 = _empty_state(BLOCK_H, Q)
    for n0 in range(lo, hi, BLOCK_N):
        idx = n0 + tl.arange(0, BLOCK_N)
        if SPARSE:
            pos = tl.load(TOPK + b.to(tl.int64) * stride_tk + idx, mask=idx < hi, other=-1).to(tl.int32)
            valid = (idx < hi) & (pos >= 0) & (pos < L)
        else:
            pos = idx
            valid = pos < hi
        in_sink = pos < sink_r
        in_hp = in_sink | (pos >= rec_start)
        entry = tl.where(in_sink, pos, sink + pos % ring)
        row = tl.load(HPI + req * stride_hpi + entry, mask=valid & in_hp, other=-1)
        hp = valid & in_hp & (row >= 0)
        int2 = valid & ~hp
        rows = tl.where(hp, row, 0).to(tl.int64)
        slots = tl.load(R2T + req * stride_r2t + pos, mask=int2, other=0).to(tl.int64)
        int2 = int2 & (slots >= 0)  # a -1 slot (SGLang's padding) is never read
        slots = tl.where(int2, slots, 0)
        c0, c1, c2, c3, kpe = _latent_tile(KC, stride_kcs, KPR, stride_kps, KPE, stride_kpe, HC, stride_hcr, HPE,
                                           stride_hper, slots, rows, int2, hp, pcols, pmask, l0, l1, l2, l3, Q, G)
        m, l, acc0, acc1, acc2, acc3 = _attend_tile(q0, q1, q2, q3, qp, c0, c1, c2, c3, kpe, valid[None, :], m, l,
                                                    acc0, acc1, acc2, acc3, BLOCK_H, BLOCK_N, DOT)

    _store_partial(OPART, stride_ob, stride_oh, stride_os, LSE, stride_lb, stride_lh, b, heads, hmask, sp,
                   m, l, acc0, acc1, acc2, acc3, Q)


@triton.jit
def _gather_latent(KC, stride_kcs, KPR, stride_kps, KPE, stride_kpe, SLOTS, OUT, stride_on,
                   n, l0, l1, l2, l3, Q: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, G: tl.constexpr,
                   BLOCK_T: tl.constexpr):
    """Rows ``[BLOCK_T * program_id(0), +BLOCK_T)`` of ``OUT [n, 4Q + P]``: the dequantized latent of
    slot ``SLOTS[i]`` then its ``k_pe``, rounded once to ``OUT``'s dtype."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < n
    slots = tl.load(SLOTS + t, mask=tm, other=0).to(tl.int64)
    no_hp = tl.zeros([BLOCK_T], tl.int64)
    o = OUT + t[:, None].to(tl.int64) * stride_on
    cols = tl.arange(0, Q)
    for k in tl.static_range(4):
        c = _latent_quarter(KC, stride_kcs, KPR, stride_kps, KPE, 0, slots, no_hp, tm, tm & False,
                            l0, l1, l2, l3, k, Q, G)
        tl.store(o + k * Q + cols[None, :], round_to(c, OUT.dtype.element_ty), mask=tm[:, None])
    pc = tl.arange(0, PP)
    pm = tm[:, None] & (pc[None, :] < P)
    kpe = tl.load(KPE + slots[:, None] * stride_kpe + pc[None, :], mask=pm, other=0.0)
    tl.store(o + 4 * Q + pc[None, :], round_to(kpe.to(tl.float32), OUT.dtype.element_ty), mask=pm)


def check_latent_width(r: int, group_size: int) -> None:
    """Raise ``ValueError`` unless the latent kernels take rank ``r`` with ``group_size``."""
    if not latent_rank_supported(r) or r % group_size:
        raise ValueError(f"latent width {r}: R/4 must be a power of two >= 16 (R = 64, 128, 256, 512, ...) and "
                         f"R a multiple of group_size {group_size}")


def check_latent_planes(codes, pairs, k_pe, hp_latent, hp_pe, group_size: int, device=None,
                        rank: int | None = None) -> tuple[int, int]:
    """Check one layer's latent planes (``codes`` uint8 ``[S, R/4]``, ``pairs`` ``[S, 2R/G]``, ``k_pe``
    ``[S, P]``, ``hp_latent`` ``[rows, R]``, ``hp_pe`` ``[rows, P]``, last dims contiguous, on
    ``device`` when given, ``R`` = ``rank`` when given) and return ``(R, P)``.

    Raises:
        ValueError: a plane of another shape, dtype or device; a width the kernels cannot take
            (:func:`check_latent_width`).
    """
    check_tensor(codes, "codes", ndim=2, dtypes=(torch.uint8,), device=device,
                 shape=(None, None if rank is None else rank // 4), last_contiguous=True)
    s_slots, r = codes.shape[0], 4 * codes.shape[1]
    check_latent_width(r, group_size)
    dev = codes.device
    p = k_pe.shape[-1] if k_pe.dim() == 2 else -1
    check_tensor(pairs, "pairs", ndim=2, device=dev, shape=(s_slots, 2 * r // group_size), last_contiguous=True)
    check_tensor(k_pe, "k_pe", ndim=2, device=dev, shape=(s_slots, p), last_contiguous=True)
    check_tensor(hp_latent, "hp_latent", ndim=2, device=dev, shape=(hp_latent.shape[0], r), last_contiguous=True)
    check_tensor(hp_pe, "hp_pe", ndim=2, device=dev, shape=(hp_latent.shape[0], p), last_contiguous=True)
    return r, p


def check_dot_options(precision: str, num_warps: int, device) -> None:
    """Raise ``ValueError`` unless the attention kernels take ``precision`` (:data:`PRECISIONS`;
    ``"bf16"`` on a GPU or in an offline compile only: the interpreter's BF16 dot is wrong) and
    ``num_warps`` (4 or 8) on ``device``."""
    if num_warps not in (4, 8):
        raise ValueError(f"num_warps must be 4 or 8, got {num_warps}")
    dev = torch.device(device).type
    if precision not in PRECISIONS or (precision == "bf16" and dev != "cuda" and not compiling()):
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)} ('bf16' on a GPU only: the Triton "
                         f"interpreter's BF16 dot is wrong), got {precision!r} on {dev}")


def check_pow2(value: int, name: str, low: int) -> None:
    """Raise ``ValueError`` unless ``value`` is a power of two ``>= low``."""
    if value < low or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {low}, got {value}")


def gather_latent(codes: torch.Tensor, pairs: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, *,
                  group_size: int, quantizer: str, out_dtype: torch.dtype = torch.bfloat16,
                  block_t: int = 16) -> torch.Tensor:
    """Dequantized latent rows of ``slots`` joined with their ``k_pe``: the ``[c_kv | k_pe]`` rows an
    MLA extend kernel reads (the chunk and its prefix through INT2, as the MHA extend reads them).

    Args:
        codes: uint8 ``[S, R/4]``; pairs: ``[S, 2R/G]``; k_pe: ``[S, P]`` (the latent pool's planes).
        slots: int ``[n]`` pool slots.
        group_size, quantizer: the latent's INT2 format.
        out_dtype: fp32 or BF16 (an FP8 checkpoint's rows are still joined in BF16: never cast down).
        block_t: rows per program (a power of two >= 1).

    Returns:
        ``[n, R + P]`` in ``out_dtype``: ``scale * (level[code] - zero)`` rounded once, then ``k_pe``.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (``codes`` uint8 ``[S, R/4]`` with
            ``R/4`` a power of two), ``out_dtype`` not fp32 / BF16, ``block_t`` not a power of two.
    """
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    check_tensor(codes, "codes", ndim=2, dtypes=(torch.uint8,), last_contiguous=True)
    s_slots, q = codes.shape
    r, p = 4 * q, k_pe.shape[-1]
    check_latent_width(r, group_size)
    check_pow2(block_t, "block_t", 1)
    check_tensor(pairs, "pairs", ndim=2, device=codes.device, shape=(s_slots, 2 * r // group_size), last_contiguous=True)
    check_tensor(k_pe, "k_pe", ndim=2, device=codes.device, shape=(s_slots, p), last_contiguous=True)
    check_tensor(slots, "slots", ndim=1, dtypes=INDEX_DTYPES, device=codes.device)
    n = slots.numel()
    out = torch.empty(n, r + p, dtype=out_dtype, device=codes.device)
    if n:
        _launch(_gather_latent, (triton.cdiv(n, block_t),), codes, codes.stride(0), pairs, pairs.stride(0), k_pe,
                k_pe.stride(0), slots, out, out.stride(0), n, *codebook(quantizer).levels,
                Q=q, P=p, PP=max(16, next_pow2(p)), G=group_size, BLOCK_T=block_t)
    return out
