"""Flush: quantize rows gathered from the HP buffer into INT2 slots.

``src_rows[i]`` is an HP row index (``hp_k[src_rows[i]]``), ``dst_loc[i]`` the INT2 slot it goes
to; entries with ``src_rows < 0`` or ``dst_loc < 0`` are skipped, so a fixed-size (CUDA-graph
friendly) plan can pad with ``-1``. The rows go through :func:`.write.quantize_tile`, the same
code as the direct write, so a flushed row and a directly written row have identical bytes.
Nothing is read back to the host.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .write import quantize_rows_to_slots


@triton.jit
def _flush_kernel(
    HPK,
    stride_kn,
    stride_kh,
    HPV,
    stride_vn,
    stride_vh,
    SRC,
    DST,
    N,
    H,
    KC,
    stride_kcs,
    stride_kch,
    KP,
    stride_kps,
    stride_kph,
    VC,
    stride_vcs,
    stride_vch,
    VP,
    stride_vps,
    stride_vph,
    smin,
    k_t0,
    k_t1,
    k_t2,
    v_t0,
    v_t1,
    v_t2,
    R: tl.constexpr,
    HAS_V: tl.constexpr,
    SDT: tl.constexpr,
    LLOYD: tl.constexpr,
    QK: tl.constexpr,
    QKP: tl.constexpr,
    GK: tl.constexpr,
    NGK: tl.constexpr,
    NGKP: tl.constexpr,
    CLIP_KK: tl.constexpr,
    QV: tl.constexpr,
    QVP: tl.constexpr,
    GV: tl.constexpr,
    NGV: tl.constexpr,
    NGVP: tl.constexpr,
    CLIP_KV: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid * R + tl.arange(0, R)
    valid = r < N * H
    n = tl.where(valid, r // H, 0)
    hh = tl.where(valid, r % H, 0).to(tl.int64)
    src = tl.load(SRC + n, mask=valid, other=-1).to(tl.int64)
    dst = tl.load(DST + n, mask=valid, other=-1).to(tl.int64)
    ok = valid & (src >= 0) & (dst >= 0)
    src = tl.where(ok, src, 0)
    dst = tl.where(ok, dst, 0)
    # K rows in programs (pid, 0), V rows in (pid, 1): independent latency chains (as in _write_kernel)
    if tl.program_id(1) == 0:
        quantize_rows_to_slots(HPK, stride_kn, stride_kh, src, dst, ok, hh, KC, stride_kcs, stride_kch,
                               KP, stride_kps, stride_kph, R, QK, QKP, GK, NGK, NGKP, CLIP_KK, LLOYD, SDT,
                               smin, k_t0, k_t1, k_t2)
    else:
        if HAS_V:
            quantize_rows_to_slots(HPV, stride_vn, stride_vh, src, dst, ok, hh, VC, stride_vcs, stride_vch,
                                   VP, stride_vps, stride_vph, R, QV, QVP, GV, NGV, NGVP, CLIP_KV, LLOYD, SDT,
                                   smin, v_t0, v_t1, v_t2)
