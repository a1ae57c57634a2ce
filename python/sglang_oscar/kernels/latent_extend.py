"""Extend (prefill) attention of MLA layers straight over the packed INT2 latent, keys in one order.

The oracle is :func:`sglang_oscar.reference.latent.latent_attention` (``output="latent_rotated"``,
window mode ``"extend"``): query ``i`` of a request's chunk sits at position ``prefix + i`` and
attends to positions ``<= prefix + i``; a position below the request's sink length is read from its
BF16 sink row, every other one -- the prefix and the chunk itself, written before the call --
through INT2. One program takes ``BLOCK_T`` consecutive query tokens x ``BLOCK_H`` heads of one
request (all of them share each latent tile: MQA) and walks the keys from position 0 in
``BLOCK_N`` tiles up to its last query, with a causal mask per row. A row's sum therefore runs over
the same tiles in the same order however the prompt was chunked or which tokens share its program,
so a chunked prefill or a radix hit gives the bits of one prefill with the same tile setting (another
``block_t x block_h`` changes the MMA shape, and on the GPU the sums' rounding; SGLang's extend kernel, used by
the gather path of :mod:`sglang_oscar.backend.latent_backend`, splits prefix and chunk into two
loops whose boundary moves with the chunk). It also reads the codes in place, with no gathered copy
of the prefix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.int2 import codebook
from .codes import LOG2E
from .compile_check import launch as _launch
from .latent import (PRECISIONS, _attend_tile, _empty_state, _latent_tile, _load_query, check_dot_options,
                     check_latent_planes, check_latent_width, check_pow2)
from .layout import next_pow2
from .tiles import request_sink_len
from .validate import INDEX_DTYPES, check_tensor


@triton.jit
def _latent_extend(
    QA, stride_qat, stride_qah, QP, stride_qpt, stride_qph,
    KC, stride_kcs, KPR, stride_kps, KPE, stride_kpe, HC, stride_hcr, HPE, stride_hper,
    HPI, stride_hpi, R2T, stride_r2t, RPI, QO, PRE, SINKL, OUT, stride_ot, stride_oh,
    qscale, sink, l0, l1, l2, l3,
    H: tl.constexpr, Q: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, G: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINKL: tl.constexpr,
    DOT: tl.constexpr,
):
    """Grid ``(requests, token blocks, head blocks)``; rows ``r = t * BLOCK_H + h`` of the program are
    query token ``t`` of its block and head ``h`` of its head block (module docstring)."""
    b = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    qo = tl.load(QO + b).to(tl.int64)
    n_new = (tl.load(QO + b + 1) - qo).to(tl.int32)
    if t0 >= n_new:
        return
    req = tl.load(RPI + b).to(tl.int64)
    prefix = tl.load(PRE + b).to(tl.int32)
    M: tl.constexpr = BLOCK_T * BLOCK_H
    r = tl.arange(0, M)
    t = t0 + r // BLOCK_H
    h = tl.program_id(2) * BLOCK_H + r % BLOCK_H
    rmask = (t < n_new) & (h < H)
    pos_q = prefix + t
    tok, hrow = qo + t.to(tl.int64), h.to(tl.int64)
    q0, q1, q2, q3, qp, pcols, pmask = _load_query(QA, QP, tok * stride_qat + hrow * stride_qah,
                                                   tok * stride_qpt + hrow * stride_qph, rmask, qscale, Q, P, PP)
    sink_r = request_sink_len(SINKL, req, sink, prefix, HAS_SINKL)
    hi = prefix + tl.minimum(t0 + BLOCK_T, n_new)  # one past the block's last query position

    m, l, acc0, acc1, acc2, acc3 = _empty_state(M, Q)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        row = tl.load(HPI + req * stride_hpi + pos, mask=valid & (pos < sink_r), other=-1)
        hp = valid & (pos < sink_r) & (row >= 0)
        int2 = valid & ~hp
        rows = tl.where(hp, row, 0).to(tl.int64)
        slots = tl.load(R2T + req * stride_r2t + pos, mask=int2, other=0).to(tl.int64)
        int2 = int2 & (slots >= 0)
        slots = tl.where(int2, slots, 0)
        c0, c1, c2, c3, kpe = _latent_tile(KC, stride_kcs, KPR, stride_kps, KPE, stride_kpe, HC, stride_hcr, HPE,
                                           stride_hper, slots, rows, int2, hp, pcols, pmask, l0, l1, l2, l3, Q, G)
        causal = valid[None, :] & (pos[None, :] <= pos_q[:, None])
        m, l, acc0, acc1, acc2, acc3 = _attend_tile(q0, q1, q2, q3, qp, c0, c1, c2, c3, kpe, causal, m, l,
                                                    acc0, acc1, acc2, acc3, M, BLOCK_N, DOT)

    inv = tl.where(l > 0.0, 1.0 / tl.where(l > 0.0, l, 1.0), 0.0)
    cols = tl.arange(0, Q)
    o = OUT + (tok * stride_ot + hrow * stride_oh)[:, None] + cols[None, :]
    ty = OUT.dtype.element_ty
    tl.store(o, (acc0 * inv[:, None]).to(ty), mask=rmask[:, None])
    tl.store(o + Q, (acc1 * inv[:, None]).to(ty), mask=rmask[:, None])
    tl.store(o + 2 * Q, (acc2 * inv[:, None]).to(ty), mask=rmask[:, None])
    tl.store(o + 3 * Q, (acc3 * inv[:, None]).to(ty), mask=rmask[:, None])


def latent_extend_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, codes: torch.Tensor, pairs: torch.Tensor,
                            k_pe: torch.Tensor, hp_latent: torch.Tensor, hp_pe: torch.Tensor, hp_index: torch.Tensor,
                            req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, qo_indptr: torch.Tensor,
                            prefix_lens: torch.Tensor, *, group_size: int, quantizer: str, sink: int, sm_scale: float,
                            max_extend_len: int, sink_lens: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, precision: str = "ieee", block_t: int = 1,
                            block_h: int = 16, block_n: int = 16, num_warps: int = 4) -> torch.Tensor:
    """Absorbed-MQA extend attention over the packed latent cache of one MLA layer (module docstring).

    Args:
        q_abs: ``[T, H, R]`` rotated absorbed queries of the batch's new tokens (request-major, any
            float dtype, last dim contiguous); q_pe: ``[T, H, P]`` their post-RoPE rope parts.
        codes, pairs, k_pe, hp_latent, hp_pe: the layer's planes
            (:meth:`~sglang_oscar.pool.latent_pool.OscarMLATokenToKVPool.latent_buffers`); the chunk's
            own rows must be written already.
        hp_index: int ``[max_reqs, >= sink]`` sink rows (``HPWindows.hp_index``; -1 = no row).
        req_to_token: int ``[max_reqs, ctx]`` slots; req_pool_indices: int ``[B]``.
        qo_indptr: int ``[B + 1]`` the requests' query rows in ``q_abs``; prefix_lens: int ``[B]``
            cached positions before each chunk (query ``i`` of request ``b`` sits at ``prefix + i``).
        group_size, quantizer: the latent's INT2 format; sink: sink window (tokens).
        sm_scale: the layer's softmax scale (natural units); max_extend_len: a bound on the new
            tokens of any request (host int: the grid).
        sink_lens: optional int ``[max_reqs]``: request ``r`` reads only its first
            ``min(sink_lens[r], sink)`` positions from sink rows (the rest through INT2).
        out: optional ``[T, H, R]`` output (any float dtype, last dim contiguous), else fp32.
        precision: dot operands, :data:`~.latent.PRECISIONS` (``"bf16"`` on a GPU only).
        block_t, block_h, block_n: query tokens, heads and key positions per tile (powers of two;
            ``block_t * block_h >= 16``, ``block_n >= 16``).
        num_warps: warps per program (4 or 8).

    Returns:
        ``o' [T, H, R]`` (``out`` or fp32): the latent outputs in the rotated frame.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (as the decode's), tile sizes that are
            not powers of two or too small, ``max_extend_len < 1``, an unknown ``precision`` or
            ``"bf16"`` off the GPU, ``num_warps`` not 4 or 8.
    """
    check_tensor(q_abs, "q_abs", ndim=3, last_contiguous=True)
    n_tok, h, r = q_abs.shape
    dev = q_abs.device
    check_latent_width(r, group_size)
    check_tensor(q_pe, "q_pe", ndim=3, device=dev, last_contiguous=True)
    p = q_pe.shape[-1]
    if tuple(q_pe.shape[:2]) != (n_tok, h):
        raise ValueError(f"q_abs {tuple(q_abs.shape)} and q_pe {tuple(q_pe.shape)} must share [T, H]")
    for value, name, low in ((block_t, "block_t", 1), (block_h, "block_h", 1), (block_n, "block_n", 16)):
        check_pow2(value, name, low)
    if block_t * block_h < 16:
        raise ValueError(f"block_t * block_h must be >= 16 (an MMA's rows), got {block_t} x {block_h}")
    if max_extend_len < 1:
        raise ValueError(f"max_extend_len must be >= 1, got {max_extend_len}")
    check_dot_options(precision, num_warps, dev)
    if check_latent_planes(codes, pairs, k_pe, hp_latent, hp_pe, group_size, dev, rank=r)[1] != p:
        raise ValueError(f"q_pe {tuple(q_pe.shape)} and k_pe {tuple(k_pe.shape)} differ in the rope width")
    for tt, name, nd in ((hp_index, "hp_index", 2), (req_to_token, "req_to_token", 2),
                         (req_pool_indices, "req_pool_indices", 1), (qo_indptr, "qo_indptr", 1),
                         (prefix_lens, "prefix_lens", 1)) + (() if sink_lens is None else ((sink_lens, "sink_lens", 1),)):
        check_tensor(tt, name, ndim=nd, dtypes=INDEX_DTYPES, device=dev)
    bsz = req_pool_indices.shape[0]
    if qo_indptr.shape[0] != bsz + 1 or prefix_lens.shape[0] != bsz:
        raise ValueError(f"qo_indptr {tuple(qo_indptr.shape)} / prefix_lens {tuple(prefix_lens.shape)} must be "
                         f"[{bsz + 1}] / [{bsz}]")
    if hp_index.shape[1] < sink:
        raise ValueError(f"hp_index has {hp_index.shape[1]} columns, fewer than sink = {sink}")
    if out is None:
        out = torch.empty(n_tok, h, r, dtype=torch.float32, device=dev)
    if n_tok and bsz:
        grid = (bsz, triton.cdiv(max_extend_len, block_t), triton.cdiv(h, block_h))
        _launch(_latent_extend, grid,
                q_abs, q_abs.stride(0), q_abs.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1),
                codes, codes.stride(0), pairs, pairs.stride(0), k_pe, k_pe.stride(0), hp_latent, hp_latent.stride(0),
                hp_pe, hp_pe.stride(0), hp_index, hp_index.stride(0), req_to_token, req_to_token.stride(0),
                req_pool_indices, qo_indptr, prefix_lens, prefix_lens if sink_lens is None else sink_lens,
                out, out.stride(0), out.stride(1), sm_scale * LOG2E, sink, *codebook(quantizer).levels,
                H=h, Q=r // 4, P=p, PP=max(16, next_pow2(p)), G=group_size, BLOCK_T=block_t, BLOCK_H=block_h,
                BLOCK_N=block_n, HAS_SINKL=sink_lens is not None, DOT=PRECISIONS[precision], num_warps=num_warps)
    return out
