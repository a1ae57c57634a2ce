"""Dequantize packed INT2 slots to rows: ``x = scale * (level[code] - zero)`` in fp32.

The same operations as ``quant.dequantize_rows`` (fp32 subtract, then multiply), so the fp32
output is bit-identical to it; other output dtypes are rounded to nearest even. Slots ``< 0``
give rows of zeros. For readers other than the attention kernels (e.g. a dense prefix).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import level_of, round_to


@triton.jit
def _dequant_kernel(
    CODES,
    stride_cs,
    stride_ch,
    PAIRS,
    stride_ps,
    stride_ph,
    SLOTS,
    N,
    H,
    OUT,
    stride_on,
    stride_oh,
    l0,
    l1,
    l2,
    l3,
    R: tl.constexpr,
    Q: tl.constexpr,
    QP: tl.constexpr,
    G: tl.constexpr,
    OUT_DT: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid * R + tl.arange(0, R)
    valid = r < N * H
    n = tl.where(valid, r // H, 0).to(tl.int64)
    hh = tl.where(valid, r % H, 0).to(tl.int64)
    slot = tl.load(SLOTS + n, mask=valid, other=-1).to(tl.int64)
    ok = valid & (slot >= 0)
    slot = tl.where(ok, slot, 0)
    kk = tl.arange(0, 4)
    jj = tl.arange(0, QP)
    lane = (jj < Q)[None, None, :] & (kk < 4)[None, :, None]
    m3 = ok[:, None, None] & lane
    b = tl.load(CODES + slot[:, None] * stride_cs + hh[:, None] * stride_ch + jj[None, :],
                mask=ok[:, None] & (jj < Q)[None, :], other=0).to(tl.int32)
    c = (b[:, None, :] >> (2 * kk)[None, :, None]) & 3
    lev = level_of(c, l0, l1, l2, l3)
    col = kk[:, None] * Q + jj[None, :]
    pbase = PAIRS + slot[:, None, None] * stride_ps + hh[:, None, None] * stride_ph + 2 * (col // G)[None, :, :]
    s = tl.load(pbase, mask=m3, other=0.0).to(tl.float32)
    z = tl.load(pbase + 1, mask=m3, other=0.0).to(tl.float32)
    x = s * (lev - z)
    x = tl.where(m3, x, 0.0)
    optr = OUT + n[:, None, None] * stride_on + hh[:, None, None] * stride_oh + col[None, :, :]
    tl.store(optr, round_to(x, OUT_DT), mask=valid[:, None, None] & lane)
