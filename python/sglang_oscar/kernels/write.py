"""Cache write: quantize rotated HP rows and scatter codes + pairs at SGLang slots.

``quantize_tile`` is the one implementation of the format's quantizer in Triton. It follows ``sglang_oscar.quant.int2`` step by step, in the same fp32 operations:

* clip threshold = the ``(idx+1)``-th smallest ``|x|``, found exactly by a 31-step binary search on
  the fp32 bit patterns of ``|x|`` (non-negative floats order like their bit patterns): the
  largest ``T`` with ``#{|x| <= T} < idx+1``, plus one ulp, is that order statistic;
* uniform pair: ``s = div_rn(max - min, 3)`` with the floors, ``s' = round(s)``,
  ``z' = round(div_rn(-min, s'))``; Lloyd-Max pair: mean and population variance summed in fp64,
  ``std = sqrt(var + 1e-8)`` in fp64, rounded to fp32;
* code ``= #{k : div_rn(x, s') + z' >= thr[k]}``; quarter-split packing.

Rows are processed as ``[BLOCK_R, 4, QP]`` tiles (quarter ``k``, lane ``j`` = element ``k*Q + j``,
``Q = D/4``, ``QP = next_pow2(Q)`` with masked lanes, so head_dim 192 works). Groups of any size
dividing ``D`` are handled with a one-hot ``[.., NGP]`` axis (``NG = 1`` needs none).

Slot convention: a token whose ``loc < 0`` is skipped (nothing written); the same holds for
``hp_rows < 0`` in the optional fused HP-copy store. CUDA-graph padding should use ``-1`` (or
SGLang's reserved slot 0, which is then overwritten harmlessly).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .codes import round_to
from .compile_check import interpreting
from .compile_check import launch as _launch
from .layout import Int2Layout, next_pow2
from .validate import INDEX_DTYPES, check_finite, check_float, check_int2_buffers, check_range, check_tensor, debug_enabled

# bits of the float64 nearest to 1e-8 (the Lloyd-Max variance epsilon of quant.int2).
LM_VAR_EPS_BITS = tl.constexpr(0x3E45798EE2308C3A)


@triton.jit
def clip_threshold(x, lane, R: tl.constexpr, CLIP_K: tl.constexpr):
    """The ``CLIP_K``-th smallest ``|x|`` over each row's real elements (``lane``) of ``x [R, 4, QP]``
    fp32, exactly, as fp32 ``[R]``: the largest bit pattern ``T`` with ``#{|x| <= T} < CLIP_K``, plus
    one (31-step binary search; ``CLIP_K`` in ``[1, #lanes]``). A radix variant (2-5 bits per step)
    wrote the same bytes and was no faster on the H200 (branch ``exp/clip-radix``).
    """
    a = tl.abs(x).to(tl.int32, bitcast=True)
    a = tl.where(lane, a, 0x7FFFFFFF)
    below = tl.full([R], -1, tl.int32)
    for it in range(31):
        cand = below + (1 << (30 - it))
        cnt = tl.sum(tl.sum((a <= cand[:, None, None]).to(tl.int32), axis=2), axis=1)
        below = tl.where(cnt < CLIP_K, cand, below)
    return (below + 1).to(tl.float32, bitcast=True)


@triton.jit
def quantize_tile(
    x,
    lane,
    R: tl.constexpr,
    Q: tl.constexpr,
    QP: tl.constexpr,
    G: tl.constexpr,
    NG: tl.constexpr,
    NGP: tl.constexpr,
    CLIP_K: tl.constexpr,
    LLOYD: tl.constexpr,
    SDT: tl.constexpr,
    smin,
    t0,
    t1,
    t2,
):
    """Quantize rows held as ``x [R, 4, QP]`` fp32 (``lane`` marks real elements).

    Returns ``(packed uint8 [R, QP], scale [R, NGP] in SDT, zero [R, NGP] in SDT)``.
    """
    INF: tl.constexpr = float("inf")
    # ---- clip: exact order statistic by binary search on the bit patterns of |x|
    if CLIP_K > 0:
        t = clip_threshold(x, lane, R, CLIP_K)
        tb = t[:, None, None]
        x = tl.minimum(tl.maximum(x, -tb), tb)

    kk = tl.arange(0, 4)
    jj = tl.arange(0, QP)
    gid = (kk[:, None] * Q + jj[None, :]) // G  # [4, QP]
    if NG > 1:
        gg = tl.arange(0, NGP)
        onehot = (gid[None, :, :, None] == gg[None, None, None, :]) & lane[:, :, :, None]

    # ---- group statistics -> offset (value of level 0 / mean) and unrounded scale, [R, NGP]
    if LLOYD:
        x64 = x.to(tl.float64)
        eps = tl.full([1], LM_VAR_EPS_BITS, tl.int64).to(tl.float64, bitcast=True)
        if NG == 1:
            tot = tl.sum(tl.sum(tl.where(lane, x64, 0.0), axis=2), axis=1)
            mean = (tot / G)[:, None]
            d = tl.where(lane, x64 - mean[:, :, None], 0.0)
            var = (tl.sum(tl.sum(d * d, axis=2), axis=1) / G)[:, None]
        else:
            x64g = x64[:, :, :, None]
            tot = tl.sum(tl.sum(tl.where(onehot, x64g, 0.0), axis=2), axis=1)
            mean = tot / G
            mean_e = tl.sum(tl.where(onehot, mean[:, None, None, :], 0.0), axis=3)
            d = tl.where(lane, x64 - mean_e, 0.0)
            dd = (d * d)[:, :, :, None]
            var = tl.sum(tl.sum(tl.where(onehot, dd, 0.0), axis=2), axis=1) / G
        s = tl.sqrt(var + eps).to(tl.float32)
        offset = mean.to(tl.float32)
    else:
        if NG == 1:
            lo = tl.min(tl.min(tl.where(lane, x, INF), axis=2), axis=1)[:, None]
            hi = tl.max(tl.max(tl.where(lane, x, -INF), axis=2), axis=1)[:, None]
        else:
            xg = x[:, :, :, None]
            lo = tl.min(tl.min(tl.where(onehot, xg, INF), axis=2), axis=1)
            hi = tl.max(tl.max(tl.where(onehot, xg, -INF), axis=2), axis=1)
        s = tl.math.div_rn(hi - lo, tl.full(hi.shape, 3.0, tl.float32))
        offset = lo

    # ---- pair (same order of operations as quant.int2.quantize_rows)
    s = tl.maximum(s, smin)
    s = tl.maximum(s, tl.math.div_rn(tl.abs(offset), tl.full(offset.shape, 32768.0, tl.float32)))
    s_st = round_to(s, SDT)
    s_f = s_st.to(tl.float32)
    z_st = round_to(tl.math.div_rn(-offset, s_f), SDT)
    z_f = z_st.to(tl.float32)

    # ---- codes
    if NG == 1:
        s_e = s_f[:, :, None]
        z_e = z_f[:, :, None]
    else:
        s_e = tl.sum(tl.where(onehot, s_f[:, None, None, :], 0.0), axis=3)
        z_e = tl.sum(tl.where(onehot, z_f[:, None, None, :], 0.0), axis=3)
        s_e = tl.where(lane, s_e, 1.0)
    u = tl.math.div_rn(x, s_e + tl.zeros(x.shape, tl.float32)) + z_e
    code = (u >= t0).to(tl.int32) + (u >= t1).to(tl.int32) + (u >= t2).to(tl.int32)
    code = tl.where(lane, code, 0)
    packed = tl.sum(code << (2 * kk)[None, :, None], axis=1).to(tl.uint8)
    return packed, s_st, z_st


@triton.jit
def quantize_rows_to_slots(
    X,
    stride_xn,
    stride_xh,
    src_n,
    dst,
    ok,
    hh,
    CODES,
    stride_cs,
    stride_ch,
    PAIRS,
    stride_ps,
    stride_ph,
    R: tl.constexpr,
    Q: tl.constexpr,
    QP: tl.constexpr,
    G: tl.constexpr,
    NG: tl.constexpr,
    NGP: tl.constexpr,
    CLIP_K: tl.constexpr,
    LLOYD: tl.constexpr,
    SDT: tl.constexpr,
    smin,
    t0,
    t1,
    t2,
):
    """Load rows ``X[src_n, hh, :]`` (``ok`` rows only), quantize, store at ``dst`` slots."""
    kk = tl.arange(0, 4)
    jj = tl.arange(0, QP)
    col = kk[:, None] * Q + jj[None, :]
    lane = (jj < Q)[None, None, :] & (kk < 4)[None, :, None] & ok[:, None, None]
    ptr = X + src_n[:, None, None] * stride_xn + hh[:, None, None] * stride_xh + col[None, :, :]
    x = tl.load(ptr, mask=lane, other=0.0).to(tl.float32)
    exists = (jj < Q)[None, None, :] & (kk < 4)[None, :, None] & (hh >= 0)[:, None, None]
    packed, s_st, z_st = quantize_tile(x, exists, R, Q, QP, G, NG, NGP, CLIP_K, LLOYD, SDT, smin, t0, t1, t2)
    cptr = CODES + dst[:, None] * stride_cs + hh[:, None] * stride_ch + jj[None, :]
    tl.store(cptr, packed, mask=ok[:, None] & (jj < Q)[None, :])
    gg = tl.arange(0, NGP)
    pptr = PAIRS + dst[:, None] * stride_ps + hh[:, None] * stride_ph + 2 * gg[None, :]
    pmask = ok[:, None] & (gg < NG)[None, :]
    tl.store(pptr, s_st, mask=pmask)
    tl.store(pptr + 1, z_st, mask=pmask)


@triton.jit
def _write_kernel(
    K,
    stride_kn,
    stride_kh,
    V,
    stride_vn,
    stride_vh,
    LOC,
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
    HP_ROWS,
    HPK,
    stride_hkr,
    stride_hkh,
    HPV,
    stride_hvr,
    stride_hvh,
    smin,
    k_t0,
    k_t1,
    k_t2,
    v_t0,
    v_t1,
    v_t2,
    R: tl.constexpr,
    HAS_V: tl.constexpr,
    HAS_HP: tl.constexpr,
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
    """One program = ``R`` consecutive (token, head) rows of K (``program_id(1)`` 0) or of V (1):
    the two quantizations are independent latency chains (each a 31-step threshold search), so
    they run in separate programs; each program also copies its own rows to the HP buffer."""
    pid = tl.program_id(0)
    kv = tl.program_id(1)
    r = pid * R + tl.arange(0, R)
    valid = r < N * H
    n = tl.where(valid, r // H, 0)
    hh = tl.where(valid, r % H, 0)
    loc = tl.load(LOC + n, mask=valid, other=-1).to(tl.int64)
    ok = valid & (loc >= 0)
    dst = tl.where(ok, loc, 0)
    n64 = n.to(tl.int64)
    hh64 = hh.to(tl.int64)
    if HAS_HP:
        hrow = tl.load(HP_ROWS + n, mask=valid, other=-1).to(tl.int64)
        okh = valid & (hrow >= 0)
        hrow = tl.where(okh, hrow, 0)
    if kv == 0:
        quantize_rows_to_slots(K, stride_kn, stride_kh, n64, dst, ok, hh64, KC, stride_kcs, stride_kch,
                               KP, stride_kps, stride_kph, R, QK, QKP, GK, NGK, NGKP, CLIP_KK, LLOYD, SDT,
                               smin, k_t0, k_t1, k_t2)
        if HAS_HP:
            _copy_rows(K, stride_kn, stride_kh, n64, HPK, stride_hkr, stride_hkh, hrow, hh64, okh, QK, QKP)
    else:
        if HAS_V:
            quantize_rows_to_slots(V, stride_vn, stride_vh, n64, dst, ok, hh64, VC, stride_vcs, stride_vch,
                                   VP, stride_vps, stride_vph, R, QV, QVP, GV, NGV, NGVP, CLIP_KV, LLOYD, SDT,
                                   smin, v_t0, v_t1, v_t2)
            if HAS_HP:
                _copy_rows(V, stride_vn, stride_vh, n64, HPV, stride_hvr, stride_hvh, hrow, hh64, okh, QV, QVP)


@triton.jit
def _copy_rows(X, stride_xn, stride_xh, n64, HP, stride_hr, stride_hh, hrow, hh64, okh,
               Q: tl.constexpr, QP: tl.constexpr):
    """Copy rows ``X[n, hh, :4Q]`` to ``HP[hrow, hh, :]`` (``okh`` rows only) as stored."""
    j = tl.arange(0, 4 * QP)
    c = (j // QP) * Q + (j % QP)
    m = okh[:, None] & ((j % QP) < Q)[None, :]
    x = tl.load(X + n64[:, None] * stride_xn + hh64[:, None] * stride_xh + c[None, :], mask=m)
    tl.store(HP + hrow[:, None] * stride_hr + hh64[:, None] * stride_hh + c[None, :], x, mask=m)


# ---------------------------------------------------------------------------------------------
# launch wrapper
# ---------------------------------------------------------------------------------------------



# GPU: fewer rows per write program until the grid has this many programs, so decode-sized writes
# (a few hundred rows) run as many small programs instead of a few latency-bound ones
# (docs/kernels.md#write-rows-per-program).
WRITE_MIN_PROGRAMS = 256


def _rows_per_program(layout: Int2Layout, num_rows: int, budget: int | None = None,
                      min_programs: int | None = None) -> int:
    """Rows per write program: the largest power of two whose tile stays within ~2K
    (interpreter: ~8K) elements, one-hot axis included, and -- on the GPU -- that still gives the
    grid ``min_programs`` (default :data:`WRITE_MIN_PROGRAMS`, 256) programs where
    there are that many rows. Decode writes are small (batch x kv_heads rows: 256 at batch 32 x 8
    kv heads): with 16 rows per program they run 16 latency-bound programs; 1 row per program
    halved the write time (docs/kernels.md#write-rows-per-program). Prefill writes keep the full
    tiles; the interpreter always does."""
    worst = max(4 * layout.k.quarter_p2 * (layout.k.num_groups_p2 if layout.k.num_groups > 1 else 1),
                4 * layout.v.quarter_p2 * (layout.v.num_groups_p2 if layout.v.num_groups > 1 else 1))
    interp = interpreting()
    if budget is None:
        budget = 8192 if interp else 2048
    r = min(64, 1 << (max(1, budget // worst).bit_length() - 1))
    if min_programs is None:
        min_programs = 1 if interp else WRITE_MIN_PROGRAMS
    while r > 1 and -(-num_rows // r) < min_programs:
        r //= 2
    return max(1, min(r, next_pow2(max(num_rows, 1))))


def _check_rows_per_program(r, layout: Int2Layout):
    """``None`` or a power of two in [1, the layout's tile budget] (:func:`_rows_per_program`).

    Raises:
        ValueError: not a power of two, or more rows than one program's tile budget allows.
    """
    if r is None:
        return None
    r = int(r)
    cap = _rows_per_program(layout, 1 << 30, budget=2048, min_programs=1)  # the GPU tile budget, on every platform
    if r < 1 or r > cap or r & (r - 1):
        raise ValueError(f"rows_per_program={r} must be a power of two in [1, {cap}] for this layout "
                         f"(head dims {layout.k.head_dim}/{layout.v.head_dim}, groups {layout.k.group_size}/"
                         f"{layout.v.group_size})")
    return r


@functools.lru_cache(maxsize=256)
def _quant_constexprs(layout: Int2Layout, has_v: bool) -> dict:
    k, v = layout.k, layout.v
    return dict(
        SDT=layout.tl_scale_dtype,
        LLOYD=layout.lloyd,
        QK=k.quarter, QKP=k.quarter_p2, GK=k.group_size, NGK=k.num_groups, NGKP=k.num_groups_p2,
        CLIP_KK=k.clip_k,
        QV=v.quarter, QVP=v.quarter_p2, GV=v.group_size, NGV=v.num_groups, NGVP=v.num_groups_p2,
        CLIP_KV=v.clip_k,
        HAS_V=has_v,
    )


@functools.lru_cache(maxsize=256)
def _threshold_args(layout: Int2Layout) -> tuple:
    t = layout.thresholds
    return (layout.scale_min, t[0], t[1], t[2], t[0], t[1], t[2])


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor | None,
    loc: torch.Tensor,
    k_codes: torch.Tensor,
    k_pairs: torch.Tensor,
    v_codes: torch.Tensor | None,
    v_pairs: torch.Tensor | None,
    layout: Int2Layout,
    *,
    hp_rows: torch.Tensor | None = None,
    hp_k: torch.Tensor | None = None,
    hp_v: torch.Tensor | None = None,
    debug: bool | None = None,
    validate: bool = True,
    rows_per_program: int | None = None,
) -> None:
    """Quantize rotated rows and scatter them into the INT2 buffers at ``loc``.

    Args:
        k: ``[N, H, D_k]`` rotated rows in the HP dtype (quantized from these exact values);
            v: ``[N, H, D_v]`` or ``None`` (K only).
        loc: int32/int64 ``[N]`` slots; ``loc < 0`` = skip the token (nothing written).
        k_codes, k_pairs, v_codes, v_pairs: pool buffers ``[S, H, D/4]`` uint8 and
            ``[S, H, 2*D/G]`` in ``layout.scale_dtype``.
        layout: :class:`Int2Layout`.
        hp_rows: optional int ``[N]``; with ``hp_k``/``hp_v`` (``[R, H, D]``, same dtype as the
            rows) also store the rows there (``hp_rows < 0`` = skip).
        debug: check index ranges and finiteness (host sync); default ``SGLANG_OSCAR_DEBUG``.
        validate: shape/dtype/device checks (pure Python, no sync); ``False`` skips them on hot
            paths whose arguments were validated once (saves tens of microseconds of CPU).
        rows_per_program: (token, head) rows quantized per program, a power of two up to the
            layout's tile budget (default :func:`_rows_per_program`: tiles of ~2K elements, fewer rows
            while the grid has under ``WRITE_MIN_PROGRAMS`` = 256 programs). Fewer rows per program give more,
            smaller programs (one warp per row at 1); timed by ``python -m benchmarks.bench_decode``.

    Raises:
        ValueError: bad shapes, dtypes, devices, or (debug) out-of-range indices / non-finite rows.
    """
    if validate:
        _validate_write(layout, k, v, loc, k_codes, k_pairs, v_codes, v_pairs, hp_rows, hp_k, hp_v)
    n, h, _ = k.shape
    has_v = v is not None
    has_hp = hp_rows is not None
    if debug_enabled(debug):
        check_range(loc, "loc", 0, k_codes.shape[0], allow_negative=True)
        check_finite(k, "k")
        if has_v:
            check_finite(v, "v")
        if has_hp:
            check_range(hp_rows, "hp_rows", 0, hp_k.shape[0], allow_negative=True)
    if n == 0:
        return
    r = _check_rows_per_program(rows_per_program, layout) or _rows_per_program(layout, n * h)
    vv = v if has_v else k
    vc = v_codes if has_v else k_codes
    vp = v_pairs if has_v else k_pairs
    hrows = hp_rows if has_hp else loc
    hk = hp_k if has_hp else k
    hv = hp_v if (has_hp and has_v) else hk
    grid = (triton.cdiv(n * h, r), 2 if has_v else 1)  # K programs, V programs
    _launch(_write_kernel, grid,
        k, k.stride(0), k.stride(1), vv, vv.stride(0), vv.stride(1), loc, n, h,
        k_codes, k_codes.stride(0), k_codes.stride(1), k_pairs, k_pairs.stride(0), k_pairs.stride(1),
        vc, vc.stride(0), vc.stride(1), vp, vp.stride(0), vp.stride(1),
        hrows, hk, hk.stride(0), hk.stride(1), hv, hv.stride(0), hv.stride(1),
        *_threshold_args(layout),
        R=r, HAS_HP=has_hp, num_warps=_write_warps(layout, r), enable_fp_fusion=False,
        **_quant_constexprs(layout, has_v),
    )


def _validate_write(layout, k, v, loc, k_codes, k_pairs, v_codes, v_pairs, hp_rows, hp_k, hp_v):
    check_tensor(k, "k", ndim=3, last_contiguous=True)
    check_float(k, "k")
    dev = k.device
    n, h, dk = k.shape
    if dk != layout.k.head_dim:
        raise ValueError(f"k head_dim {dk} does not match the layout's {layout.k.head_dim}")
    has_v = v is not None
    if has_v:
        check_tensor(v, "v", ndim=3, device=dev, shape=(n, h, layout.v.head_dim), last_contiguous=True)
        check_float(v, "v")
        if v_codes is None or v_pairs is None:
            raise ValueError("v given but v_codes / v_pairs missing")
    check_tensor(loc, "loc", ndim=1, dtypes=INDEX_DTYPES, device=dev, shape=(n,))
    check_int2_buffers(layout, k_codes, k_pairs, v_codes if has_v else None, v_pairs, h, dev)
    has_hp = hp_rows is not None
    if has_hp:
        check_tensor(hp_rows, "hp_rows", ndim=1, dtypes=INDEX_DTYPES, device=dev, shape=(n,))
        check_tensor(hp_k, "hp_k", ndim=3, dtypes=k.dtype, device=dev, shape=(None, h, dk), last_contiguous=True)
        if has_v:
            check_tensor(hp_v, "hp_v", ndim=3, dtypes=v.dtype, device=dev,
                         shape=(hp_k.shape[0], h, layout.v.head_dim), last_contiguous=True)


def _write_warps(layout: Int2Layout, r: int) -> int:
    elems = r * 4 * max(layout.k.quarter_p2, layout.v.quarter_p2)
    return max(1, min(8, elems // 256))
