"""Decode stage 2: merge the splits' partial outputs by their log-sum-exp (kernel and launcher).

Grid ``(batch, q_heads, dim blocks)``; zeros where no split saw a key. The grid depends only on
shapes, so the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..codes import round_to
from ..compile_check import launch as _launch
from ..layout import TORCH_TO_TL, next_pow2
from ..tiles import NEG_INF
from ..validate import check_float, check_sinks, check_tensor


@triton.jit
def _decode_stage2(
    OPART, stride_ob, stride_oh, stride_os, LSE, stride_lb, stride_lh, SINKS,
    O, stride_b, stride_h, NS,
    NSP: tl.constexpr, SB: tl.constexpr, BD: tl.constexpr, DV: tl.constexpr,
    OUT_DT: tl.constexpr, HAS_SINKS: tl.constexpr = False,
):
    """Merge of the splits for request ``program_id(0)``, q head ``program_id(1)`` and output dims
    ``[BD * program_id(2), + BD)``: ``O = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max)``.
    Chunks of ``SB`` splits x ``BD`` dims (unrolled, independent loads: one memory round trip
    for a few hundred splits); splits with ``lse = -inf`` (empty) are not read. With ``HAS_SINKS``
    the head's sink logit ``SINKS[h]`` (natural log) joins the denominator only, as SGLang's
    ``_fwd_kernel_stage2`` adds ``exp(sink - max)``."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.program_id(2) * BD + tl.arange(0, BD)
    dm = d < DV
    s_all = tl.arange(0, NSP)
    lse_row = LSE + b * stride_lb + h * stride_lh
    mx = tl.max(tl.load(lse_row + s_all, mask=s_all < NS, other=NEG_INF), axis=0)
    if HAS_SINKS:
        sink2 = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634  # base 2, as the LSEs
        mx = tl.maximum(mx, sink2)
    mx = tl.where(mx == NEG_INF, 0.0, mx)
    acc = tl.zeros([BD], tl.float32)
    tot = 0.0
    base = OPART + b * stride_ob + h * stride_oh
    for s0 in tl.static_range(0, NSP, SB):
        ss = s0 + tl.arange(0, SB)
        sm = ss < NS
        ls = tl.load(lse_row + ss, mask=sm, other=NEG_INF)
        w = tl.exp2(ls - mx)
        live = sm & (ls > NEG_INF)  # empty splits: no read of their (zero) partial output
        o = tl.load(base + ss[:, None] * stride_os + d[None, :], mask=live[:, None] & dm[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
        tot += tl.sum(w, axis=0)
    if HAS_SINKS:
        tot += tl.exp2(sink2 - mx)
    inv = tl.where(tot > 0.0, 1.0 / tl.where(tot > 0.0, tot, 1.0), 0.0)
    tl.store(O + b * stride_b + h * stride_h + d, round_to(acc * inv, OUT_DT), mask=dm)


#: merge (stage 2): split x dim elements per unrolled chunk, and the smallest grid (programs) that the
#: choice of output dims per program aims at (``decode_merge``)
MERGE_CHUNK = 4096
MERGE_MIN_PROGRAMS = 2048


def merge_block_d(bsz: int, hq: int, dv: int) -> int:
    """Output dims per merge program: the largest of 16 / 32 / 64 / 128 (at most ``next_pow2(dv)``)
    whose grid ``bsz x hq x ceil(dv / block_d)`` still has :data:`MERGE_MIN_PROGRAMS` programs,
    else 16: few programs with many splits favour narrow blocks, many programs with few splits wide
    ones; one program-count threshold is a compromise (docs/kernels.md#merge-grid)."""
    top = next_pow2(dv)
    bd = 16
    for cand in (32, 64, 128):
        if cand <= top and bsz * hq * -(-dv // cand) >= MERGE_MIN_PROGRAMS:
            bd = cand
    return min(bd, top)


def _check_merge_args(o_part, lse, out, num_splits, block_d, chunk) -> None:
    """The argument checks of :func:`decode_merge` (``ValueError`` naming the problem)."""
    check_tensor(out, "decode_merge: out", ndim=3, last_contiguous=True)
    check_float(out, "decode_merge: out")
    bsz, hq, dv = out.shape
    check_tensor(o_part, "decode_merge: o_part", ndim=4, dtypes=torch.float32, device=out.device,
                 shape=(None, hq, None, dv), last_contiguous=True)
    check_tensor(lse, "decode_merge: lse", ndim=3, dtypes=torch.float32, device=out.device, shape=(None, hq, None),
                 last_contiguous=True)
    if o_part.shape[0] < bsz or lse.shape[0] < bsz:  # a workspace preallocated for a larger batch is fine
        raise ValueError(f"decode_merge: o_part {tuple(o_part.shape)} / lse {tuple(lse.shape)} hold fewer than "
                         f"the {bsz} requests of out")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) \
            or not 1 <= num_splits <= min(o_part.shape[2], lse.shape[2]):
        raise ValueError(f"decode_merge: num_splits={num_splits!r} must be an int in "
                         f"[1, {min(o_part.shape[2], lse.shape[2])}] (the workspace's split dimension)")
    for name, v in (("block_d", block_d), ("chunk", chunk)):
        if v is not None and (not isinstance(v, int) or v < 1 or v & (v - 1)):
            raise ValueError(f"decode_merge: {name}={v!r} must be a power of two")


def merge_launch(bsz: int, hq: int, dv: int, num_splits: int, block_d: int | None = None,
                 chunk: int = MERGE_CHUNK) -> tuple:
    """``(grid, constexprs)`` of the merge kernel for ``out [bsz, hq, dv]`` and ``num_splits`` splits
    (no ``OUT_DT``: that follows the output). Host constants only (CUDA graphs)."""
    nsp = next_pow2(num_splits)
    bd = min(next_pow2(dv), block_d or merge_block_d(bsz, hq, dv))
    return (bsz, hq, triton.cdiv(dv, bd)), dict(NSP=nsp, SB=max(1, min(nsp, chunk // bd)), BD=bd, DV=dv)


def launch_merge(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, num_splits: int, grid: tuple,
                 constexprs: dict, num_warps: int = 1, sinks: torch.Tensor | None = None) -> None:
    """Launch the merge with launch parameters from :func:`merge_launch` (``sinks``: fp32 ``[H_q]``
    attention-sink logits or ``None``); no checks (a :class:`~.plan.DecodePlan` checked its workspace
    when it was built, and checks ``sinks``)."""
    _launch(_decode_stage2, grid,
        o_part, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse, lse.stride(0), lse.stride(1),
        lse if sinks is None else sinks, out, out.stride(0), out.stride(1), num_splits,
        OUT_DT=TORCH_TO_TL[out.dtype], num_warps=num_warps, HAS_SINKS=sinks is not None, **constexprs,
    )


def decode_merge(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, num_splits: int,
                 block_d: int | None = None, chunk: int = MERGE_CHUNK, num_warps: int = 1,
                 sinks: torch.Tensor | None = None) -> None:
    """Stage 2 of decode attention: merge ``num_splits`` partial outputs into ``out``.

    Args:
        o_part: ``[>= B, H_q, >= num_splits, D_v]`` fp32 normalised partial outputs (stage 1; a
            workspace from :meth:`.plan.DecodeWorkspace.views`, possibly sized for a larger batch), last
            dim contiguous.
        lse: ``[>= B, H_q, >= num_splits]`` fp32 base-2 log-sum-exp of each split (``-inf`` =
            empty), last dim contiguous.
        out: ``[B, H_q, D_v]`` (any float dtype, last dim contiguous), written: the LSE-weighted
            mean of the splits, zeros where every split is empty.
        num_splits: splits to merge, ``>= 1``.
        block_d: output dims per program, a power of two (grid ``(B, H_q, ceil(D_v / block_d))``;
            ``None`` = :func:`merge_block_d`). Cutting D_v over programs keeps a batch-1 merge from
            being a few programs walking hundreds of rows in dependent steps
            (docs/kernels.md#merge-grid).
        chunk: splits x dims per unrolled step, a power of two (all loads of a few hundred splits in
            flight at once).
        num_warps: warps per program (one was fastest or within 0.1 us of it at every point timed).
        sinks: optional ``[H_q]`` attention-sink logits (natural log, fp32, contiguous): joins each
            head's denominator (:func:`sglang_oscar.reference.attention.attend`'s ``sinks``).

    Raises:
        ValueError: wrong dims / shapes / dtypes / devices, ``num_splits`` not an int in
            ``[1, o_part.shape[2]]``, a last dim that is not contiguous, ``block_d`` / ``chunk`` not
            powers of two.

    The grid depends only on shapes (CUDA graphs).
    """
    _check_merge_args(o_part, lse, out, num_splits, block_d, chunk)
    check_sinks(sinks, out.shape[1], out.device, "decode_merge")
    grid, constexprs = merge_launch(*out.shape, num_splits, block_d, chunk)
    launch_merge(o_part, lse, out, num_splits, grid, constexprs, num_warps, sinks)
