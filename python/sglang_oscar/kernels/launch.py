"""Launch wrappers of the INT2 kernels: validate, pick launch parameters, launch.

Public entry points (re-exported by :mod:`sglang_oscar.kernels`):

* :func:`rotate_rows_hp` -- ``x R`` in fp32, rounded to the HP dtype (as ``reference.build_cache``).
* :func:`write_kv` / :func:`rotate_and_write_kv` -- quantize rows and scatter codes + pairs at
  ``loc`` (optionally also store the HP copy at ``hp_rows``).
* :func:`flush_hp_rows` -- quantize HP-buffer rows into INT2 slots.
* :func:`dequantize_slots` -- packed slots -> rows.
* :func:`decode_attention` -- one query per request over [HP sink | INT2 middle | HP recent].
* :func:`extend_attention` -- a chunk of queries over its prefix and itself (extend semantics).

Launch parameters never depend on values that live on the device (no host sync outside debug
mode); decode's grid depends only on the batch size, head counts and ``num_kv_splits``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from .codes import (
    CONVERT_ARITH,
    CONVERT_ASM,
    CONVERT_ASM_PERM,
    CONVERT_BITS,
    CONVERT_PERM_EMULATED,
    CONVERT_SUBNORMAL,
    CONVERT_SUBNORMAL_EMULATED,
    LOG2E,
)
from .compile_check import active as compiling_offline
from .compile_check import interpreting
from .compile_check import launch as _launch
from .compile_check import row_args
from .decode import _decode_stage1, _decode_stage2
from .dequant import _dequant_kernel
from .extend import _extend_kernel
from .flush import _flush_kernel
from .gluon_decode import gluon_decode_supported, launch_gluon_decode
from .gluon_decode import head_blocks as gluon_head_blocks
from .layout import TORCH_TO_TL, Int2Layout, next_pow2
from .validate import (
    INDEX_DTYPES,
    check_finite,
    check_float,
    check_range,
    check_tensor,
    debug_enabled,
    needs_idx64,
)
from .write import _write_kernel


def _tl(dt: torch.dtype):
    return TORCH_TO_TL[dt]


# ---------------------------------------------------------------------------------------------
# rotation
# ---------------------------------------------------------------------------------------------


def rotate_rows_hp(x: torch.Tensor, rotation: torch.Tensor, hp_dtype: torch.dtype | None = None,
                   transpose: bool = False) -> torch.Tensor:
    """Rotate rows ``x [N, H, D]`` by ``R`` (``[D, D]`` or ``[H_r, D, D]`` with ``H % H_r == 0``).

    Computed in fp32 with the same einsum as ``reference.rotate_rows`` and rounded to
    ``hp_dtype`` (default ``x.dtype``), so the rows equal ``reference.build_cache``'s ``k_hp``.

    Raises:
        ValueError: shapes or devices that do not match.
    """
    check_tensor(x, "rows", ndim=3)
    check_float(x, "rows")
    check_tensor(rotation, "rotation", device=x.device)
    d = x.shape[-1]
    if rotation.dim() not in (2, 3) or rotation.shape[-1] != d or rotation.shape[-2] != d:
        raise ValueError(f"rotation of shape {tuple(rotation.shape)} does not fit head_dim {d}")
    r = rotation.float()
    h = x.shape[1]
    if r.dim() == 2:
        r = r.unsqueeze(0).expand(h, d, d)
    else:
        if h % r.shape[0]:
            raise ValueError(f"rotation has {r.shape[0]} matrices, which does not divide {h} heads")
        r = r.repeat_interleave(h // r.shape[0], dim=0)
    if transpose:
        r = r.transpose(-1, -2)
    out = torch.einsum("thd,hde->the", x.float(), r)
    return out.to(hp_dtype or x.dtype)


# ---------------------------------------------------------------------------------------------
# write / flush
# ---------------------------------------------------------------------------------------------


# GPU: fewer rows per write / flush program until the grid has this many programs (1 would mean
# full tiles always). 256 halved decode-sized write + flush time on the H200 (bench_decode's forced
# rows_per_program=1 variant, 2026-11-30); test_gpu_write_flush_decode_sized (bytes equal to the
# reference quantizer's at 1-2 rows per program) passed on the H200 (2026-11-30, third session).
WRITE_MIN_PROGRAMS = 256


def _rows_per_program(layout: Int2Layout, num_rows: int, budget: int | None = None,
                      min_programs: int | None = None) -> int:
    """Rows per write / flush program: the largest power of two whose tile stays within ~2K
    (interpreter: ~8K) elements, one-hot axis included, and -- on the GPU -- that still gives the
    grid ``min_programs`` (default :data:`WRITE_MIN_PROGRAMS`, 256) programs where
    there are that many rows. Decode writes are small (batch x kv_heads rows: 256 at batch 32 x 8
    kv heads): with 16 rows per program they run 16 latency-bound programs; 1 row per program
    halved write + flush time on the H200 (bench_decode, 2026-11-30: 42.0 -> 21.3 us at batch 32,
    7.1% -> 3.6% of the default decode step at 32K). Prefill writes keep the full tiles; the interpreter always does."""
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


def _check_int2_buffers(layout: Int2Layout, k_codes, k_pairs, v_codes, v_pairs, heads, device):
    check_tensor(k_codes, "k_codes", ndim=3, dtypes=torch.uint8, device=device,
                 shape=(None, heads, layout.k.head_dim // 4), last_contiguous=True)
    check_tensor(k_pairs, "k_pairs", ndim=3, dtypes=layout.scale_dtype, device=device,
                 shape=(k_codes.shape[0], heads, 2 * layout.k.num_groups), last_contiguous=True)
    if v_codes is not None:
        check_tensor(v_codes, "v_codes", ndim=3, dtypes=torch.uint8, device=device,
                     shape=(k_codes.shape[0], heads, layout.v.head_dim // 4), last_contiguous=True)
        check_tensor(v_pairs, "v_pairs", ndim=3, dtypes=layout.scale_dtype, device=device,
                     shape=(k_codes.shape[0], heads, 2 * layout.v.num_groups), last_contiguous=True)


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
            smaller programs (one warp per row at 1); timed by ``scripts/bench_decode.py``.

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
    _check_int2_buffers(layout, k_codes, k_pairs, v_codes if has_v else None, v_pairs, h, dev)
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


def rotate_and_write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    rotation_k: torch.Tensor,
    rotation_v: torch.Tensor,
    loc: torch.Tensor,
    k_codes: torch.Tensor,
    k_pairs: torch.Tensor,
    v_codes: torch.Tensor,
    v_pairs: torch.Tensor,
    layout: Int2Layout,
    *,
    hp_dtype: torch.dtype = torch.bfloat16,
    hp_rows: torch.Tensor | None = None,
    hp_k: torch.Tensor | None = None,
    hp_v: torch.Tensor | None = None,
    debug: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate unrotated ``k``/``v`` rows (fp32 einsum, rounded to ``hp_dtype``), then :func:`write_kv`.

    Returns:
        ``(k_rot, v_rot)`` in ``hp_dtype`` (the rotated rows, e.g. for in-chunk attention).
    """
    k_rot = rotate_rows_hp(k, rotation_k, hp_dtype)
    v_rot = rotate_rows_hp(v, rotation_v, hp_dtype)
    write_kv(k_rot, v_rot, loc, k_codes, k_pairs, v_codes, v_pairs, layout,
             hp_rows=hp_rows, hp_k=hp_k, hp_v=hp_v, debug=debug)
    return k_rot, v_rot


def flush_hp_rows(
    hp_k: torch.Tensor,
    hp_v: torch.Tensor | None,
    src_rows: torch.Tensor,
    dst_loc: torch.Tensor,
    k_codes: torch.Tensor,
    k_pairs: torch.Tensor,
    v_codes: torch.Tensor | None,
    v_pairs: torch.Tensor | None,
    layout: Int2Layout,
    *,
    debug: bool | None = None,
    validate: bool = True,
    rows_per_program: int | None = None,
) -> None:
    """Quantize HP rows ``hp_k[src_rows]`` (and V) into INT2 slots ``dst_loc``; no host sync.

    Args:
        hp_k, hp_v: HP buffers ``[R, H, D]``.
        src_rows: int ``[M]`` HP row indices; dst_loc: int ``[M]`` INT2 slots. An entry with
            either index negative is skipped (fixed-size plans can pad with -1).

        validate, rows_per_program: as :func:`write_kv`.

    Raises:
        ValueError: as :func:`write_kv`.
    """
    if validate:
        _validate_flush(layout, hp_k, hp_v, src_rows, dst_loc, k_codes, k_pairs, v_codes, v_pairs)
    h = hp_k.shape[1]
    has_v = hp_v is not None
    m = src_rows.shape[0]
    if debug_enabled(debug):
        check_range(src_rows, "src_rows", 0, hp_k.shape[0], allow_negative=True)
        check_range(dst_loc, "dst_loc", 0, k_codes.shape[0], allow_negative=True)
    if m == 0:
        return
    r = _check_rows_per_program(rows_per_program, layout) or _rows_per_program(layout, m * h)
    vv = hp_v if has_v else hp_k
    vc = v_codes if has_v else k_codes
    vp = v_pairs if has_v else k_pairs
    _launch(_flush_kernel, (triton.cdiv(m * h, r), 2 if has_v else 1),
        hp_k, hp_k.stride(0), hp_k.stride(1), vv, vv.stride(0), vv.stride(1), src_rows, dst_loc, m, h,
        k_codes, k_codes.stride(0), k_codes.stride(1), k_pairs, k_pairs.stride(0), k_pairs.stride(1),
        vc, vc.stride(0), vc.stride(1), vp, vp.stride(0), vp.stride(1),
        *_threshold_args(layout),
        R=r, num_warps=_write_warps(layout, r), enable_fp_fusion=False,
        **_quant_constexprs(layout, has_v),
    )


def _validate_flush(layout, hp_k, hp_v, src_rows, dst_loc, k_codes, k_pairs, v_codes, v_pairs):
    check_tensor(hp_k, "hp_k", ndim=3, last_contiguous=True)
    check_float(hp_k, "hp_k")
    dev = hp_k.device
    _, h, dk = hp_k.shape
    if dk != layout.k.head_dim:
        raise ValueError(f"hp_k head_dim {dk} does not match the layout's {layout.k.head_dim}")
    has_v = hp_v is not None
    if has_v:
        check_tensor(hp_v, "hp_v", ndim=3, device=dev, shape=(hp_k.shape[0], h, layout.v.head_dim),
                     last_contiguous=True)
        if v_codes is None or v_pairs is None:
            raise ValueError("hp_v given but v_codes / v_pairs missing")
    check_tensor(src_rows, "src_rows", ndim=1, dtypes=INDEX_DTYPES, device=dev)
    m = src_rows.shape[0]
    check_tensor(dst_loc, "dst_loc", ndim=1, dtypes=INDEX_DTYPES, device=dev, shape=(m,))
    _check_int2_buffers(layout, k_codes, k_pairs, v_codes if has_v else None, v_pairs, h, dev)


# ---------------------------------------------------------------------------------------------
# dequantize
# ---------------------------------------------------------------------------------------------


def dequantize_slots(
    codes: torch.Tensor,
    pairs: torch.Tensor,
    slots: torch.Tensor,
    *,
    group_size: int | None = None,
    quantizer: str = "uniform",
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    debug: bool | None = None,
) -> torch.Tensor:
    """Dequantize packed rows at ``slots``: ``[N]`` -> ``[N, H, D]`` in ``out_dtype``.

    Args:
        codes: ``[S, H, D/4]`` uint8; pairs: ``[S, H, 2*D/G]``.
        slots: int ``[N]``; entries ``< 0`` give zero rows.
        group_size: ``G`` (``None`` = one group per row); quantizer: selects the levels.
        out: optional preallocated ``[N, H, D]`` output.

    Returns:
        the rows; in fp32 they equal ``quant.dequantize_rows`` bit for bit.
    """
    check_tensor(codes, "codes", ndim=3, dtypes=torch.uint8, last_contiguous=True)
    dev = codes.device
    s_, h, q = codes.shape
    d = 4 * q
    layout = Int2Layout.create(d, d, group_size=group_size, quantizer=quantizer, scale_dtype=pairs.dtype,
                               attention=False)
    check_tensor(pairs, "pairs", ndim=3, device=dev, shape=(s_, h, 2 * layout.k.num_groups), last_contiguous=True)
    check_tensor(slots, "slots", ndim=1, dtypes=INDEX_DTYPES, device=dev)
    n = slots.shape[0]
    if out is None:
        if out_dtype not in TORCH_TO_TL:
            raise ValueError(f"out_dtype {out_dtype} is not float32/float16/bfloat16")
        out = torch.empty((n, h, d), dtype=out_dtype, device=dev)
    else:
        check_tensor(out, "out", ndim=3, device=dev, shape=(n, h, d), last_contiguous=True)
        check_float(out, "out")
    if debug_enabled(debug):
        check_range(slots, "slots", 0, s_, allow_negative=True)
    if n == 0:
        return out
    qp = next_pow2(q)
    r = max(1, min(64, (8192 if interpreting() else 2048) // (4 * qp)))
    r = 1 << (r.bit_length() - 1)
    lv = layout.levels
    _launch(_dequant_kernel, (triton.cdiv(n * h, r),),
        codes, codes.stride(0), codes.stride(1), pairs, pairs.stride(0), pairs.stride(1), slots, n, h,
        out, out.stride(0), out.stride(1), *lv,
        R=r, Q=q, QP=qp, G=layout.k.group_size, OUT_DT=_tl(out.dtype),
        num_warps=max(1, min(8, r * 4 * qp // 256)), enable_fp_fusion=False,
    )
    return out


# ---------------------------------------------------------------------------------------------
# attention: shared helpers
# ---------------------------------------------------------------------------------------------


# Smallest padded quarter (head_dim / 4, rounded up to a power of two) of K and V at which the
# permuting conversions (``CONVERT_ASM_PERM`` 3, ``CONVERT_SUBNORMAL`` 5) are used. They assume the
# register order in which the GPU holds a code tile's bytes; at head_dim 64 (quarter 16) that order
# differs (our reading of the failure): on the H200 every permuting tuning was 0.56-0.58 rel. L2 off
# the oracle while 0/1/2 were within 2.6e-3 (`scripts/decode_matrix.py`, 2026-11-30, third session);
# head_dim 128, 192/128 and 256 were within 3.3e-3 with every conversion, and 512 passes the
# GPU decode test with its default (convert 3). Head dims 80-112 (padded quarters of 32) are allowed
# the permuting conversions but have not run on a GPU.
PERMUTE_MIN_QUARTER = 32

# GPU decode, head_dim 65-128 default path: from this many (request, kv head) pairs per step the
# INT2 loop runs without the async-copy pipeline (``num_stages`` 1: 168 instead of 194 registers,
# 4 KB instead of 18.5 KB of shared memory, 12 instead of 8 resident programs per SM). H200,
# Qwen3-8B layer, batch 32 x 8 kv heads = 256 (bench_decode 2026-11-30, fourth session): 16K / 32K
# / 64K -9% / -12% / -13%, 128K 0%, 4K +3%; the third session's sweep gave -12% at 32K x 32. At
# batch 8 (64 pairs) it was within -1.6% / +5.7% and at batch 1 12-84% slower (the same bench
# runs' sweeps), so below the bound the two-stage pipeline stays. Keyed on pairs, not on the
# batch: the grid (pairs x the split policy's splits, which also follow pairs) decides occupancy.
# Timed only for one (scale, zero) group per row at head_dim 128; other layouts at head_dim 65-128
# follow the same rule (GPU-tested for correctness: test_gpu_decode_every_tuning runs num_stages 1
# on the general path). A host constant of the batch size only (CUDA-graph safe).
STAGES1_MIN_PAIRS = 256


def _permutable_head_dim(head_dim: int) -> bool:
    """``head_dim``'s padded quarter (:attr:`TensorLayout.quarter_p2`) has at least
    :data:`PERMUTE_MIN_QUARTER` codes (false for head_dim <= 64)."""
    return next_pow2(max(1, head_dim // 4)) >= PERMUTE_MIN_QUARTER


def permuting_ok(layout: Int2Layout) -> bool:
    """Whether the decode kernel may use a permuting conversion for ``layout``: every quarter of a
    K and a V row inside one group (:attr:`TensorLayout.quarter_aligned`) and padded quarters of at
    least :data:`PERMUTE_MIN_QUARTER` codes. Applies under the interpreter too, so CPU tests take
    the path the GPU takes."""
    return (layout.k.quarter_aligned and layout.v.quarter_aligned
            and _permutable_head_dim(layout.k.head_dim) and _permutable_head_dim(layout.v.head_dim))


def _int_knob(name: str, value) -> int:
    """``value`` as an int (ints and integral strings / floats), else ``ValueError`` naming the knob."""
    try:
        iv = int(value)
    except (TypeError, ValueError):
        iv = None
    if iv is None or isinstance(value, bool) or (isinstance(value, float) and value != iv):
        raise ValueError(f"tuning {name}={value!r} must be an integer")
    return iv


def _gluon_knobs(names) -> str:
    """The verb phrase of the Gluon-only-knob refusals, singular or plural by ``names``."""
    return "is a Gluon-engine knob" if len(names) == 1 else "are Gluon-engine knobs"


class AttnTuning:
    """Launch knobs of the attention kernels (defaults depend on CUDA vs interpreter).

    Attributes:
        block_n: keys per inner iteration; block_m: queries per extend program.
        num_warps, num_stages: Triton launch options.
        convert: code -> operand conversion: ``CONVERT_ARITH`` 0 (shift/convert/fma),
            ``CONVERT_BITS`` 1 (mantissa bit trick in Triton), ``CONVERT_ASM`` 2 (packed PTX,
            fp16 operands), ``CONVERT_ASM_PERM`` 3 (packed PTX without byte permutes, decode INT2
            fast path only; the kernel permutes q / the V token order to match). Under the
            interpreter 2 runs as 1 and 3 as its emulation (4); where 3 is not applicable it
            runs as 2 (extend, general path, non-fp16 operands as 1). ``CONVERT_SUBNORMAL`` 5
            (GPU decode default when K and V head_dim are both in 65-128; token-major fast path,
            fp16 operands; never where :func:`permuting_ok` is false): the code bits are read
            in place as fp16 subnormals ``c * 2^(2K-24)`` (one AND per two codes); 6 is its
            emulation (interpreter); fp32/bf16 operands on the GPU and the other paths run 5 as 3.
        min_block_h: rows of the decode query tile are padded to at least this (MMA M).
        max_block_h: a kv head's q heads are split into blocks of at most this many heads
            (a divisor of the group), so a program never straddles two kv heads.
        token_major: decode INT2 tiles with the token axis as the MMA's M dimension
            (``S^T = codes @ q^T``); used only with one (scale, zero) group per K and V row,
            otherwise ignored.
        pairs_ahead: decode token-major INT2 loop: load each block's (scale, zero) pairs one
            iteration early by hand (Triton's pipeliner stages only the code tiles, which feed
            MMAs; the pair loads were synchronous). ``None`` = on for decode when K and V head_dim
            are both in 65-128.
        defer_sums: decode token-major INT2 loop: keep the softmax denominator and the V zero-point
            correction as ``[block_n, M]`` tiles of per-position partial sums, summed once after
            the loop, instead of reducing them across lanes every block (sm_90 SASS: 691 -> 668
            warp-instructions per 32 keys, 194 -> 202 registers). ``None`` = on at K and V
            head_dim 65-128 where ``pairs_ahead`` is on and the loop keeps 2 pipeline stages (with 1
            stage the extra registers cost the occupancy that stage count is for: 168 -> 194).
        maxnreg: register cap per thread given to ``ptxas`` (Triton's ``maxnreg`` launch
            option; ``None`` = no cap). Fewer registers let more warps share an SM (65,536
            registers per SM, 16K per scheduler partition, allocated per warp in steps of 256:
            255 or 194 -> 8 warps, 168 -> 12, 128 -> 16, 96 -> 20, 64 -> 32) at the risk of spills.
        engine: decode stage 1: ``"triton"`` (:mod:`.decode`, every layout) or ``"gluon"``
            (:mod:`.gluon_decode`: explicit register layouts, no layout changes in the INT2 loop;
            CUDA sm_80+, head_dim 128, one fp16 pair group per row, uniform levels, fp16 operands,
            bf16 / fp16 HP rows, no logit cap -- naming ``"gluon"`` for a call outside that scope
            raises ``ValueError`` with the reason). ``None`` = ``"gluon"`` where it applies, else
            ``"triton"`` (so the interpreter and every other layout run Triton); a tuning that names
            any Triton-only knob (:attr:`TRITON_ONLY`: ``convert``, ``num_stages``, ...) with
            ``engine`` unset runs Triton, so the knobs it names take effect (with ``engine="gluon"``
            naming one is refused: the Gluon engine has none of them). The merge is Triton
            either way; with ``"gluon"`` the INT2 splits run ``block_n`` keys per iteration (16 or
            32) and ``maxnreg`` defaults to 168 (12 one-warp programs per SM; the split policy
            offers 11-12 per SM at batch 1-2, :func:`choose_num_splits`).
        async_stages: Gluon engine only: ``0`` = the next block's code and pair words are loaded
            into registers one block ahead; ``n`` in 2-4 = they go through a ring of ``n``
            shared-memory stages by ``cp.async``, ``n - 1`` blocks ahead, no registers held while
            in flight (2.3 KB per stage at ``block_n`` 32). ``None`` = :data:`GLUON_ASYNC_STAGES`
            (2). Naming it (0 included) with ``engine`` unset selects the Gluon engine
            (``ValueError`` where it cannot run); with ``engine="triton"`` it is refused.
        async_slots: Gluon engine only, with ``async_stages`` 2-4: the slot ids of each block also
            reach shared memory by ``cp.async``, ``2 async_stages - 1`` blocks ahead, so the INT2
            loop waits on no global load (``False``: they are loaded one block ahead of their
            words' copy, and that load is waited on in the loop). ``None`` = on whenever
            ``async_stages`` is 2-4 (H200, 2026-11-30 (8), against the register pipeline: 0-6%
            faster at batch 1, from 4% slower at 32K x 32 to 7% faster at batch 8-32;
            docs/benchmarks.md, eighth session). Same engine rules as
            ``async_stages``; ``True`` with ``async_stages`` 0 is refused.
        min_split_keys: decode, both engines: an INT2 split covers at least this many positions
            (rounded up to ``block_n``), so at a step shorter than ``splits x min_split_keys`` the
            last splits are empty and exit at once (:func:`.tiles.int2_split_range`): the split
            count stays a host constant (CUDA graphs) while short steps run fewer, longer splits.
            ``None`` = :func:`default_min_split_keys` (Gluon: 128 / 256 keys; Triton: 0).

    Note: :meth:`as_dict` of a *resolved* tuning names every knob, Triton-only ones included, so
    passed back as a tuning it selects the Triton engine; pass ``None`` or ``{}`` for the default.
    """

    KNOBS = ("block_n", "block_m", "num_warps", "num_stages", "convert", "min_block_h", "max_block_h",
             "token_major", "maxnreg", "pairs_ahead", "defer_sums", "engine", "async_stages", "async_slots",
             "min_split_keys")
    #: knobs only the Gluon engine has: naming one (any value, 0 / False included: those are Gluon
    #: choices too) with ``engine`` unset selects Gluon; with ``engine="triton"`` it is refused
    GLUON_ONLY = ("async_stages", "async_slots")
    #: knobs only the Triton engine has: naming one (with ``engine`` unset) selects Triton; with
    #: ``engine="gluon"`` it is refused
    TRITON_ONLY = ("block_m", "num_warps", "num_stages", "convert", "min_block_h", "max_block_h", "token_major",
                   "pairs_ahead", "defer_sums")
    #: largest ``min_split_keys`` (2^24 positions): keeps the kernels' int32 split arithmetic exact
    MAX_MIN_SPLIT_KEYS = 1 << 24
    __slots__ = KNOBS + ("explicit",)

    def __init__(self, block_n=None, block_m=None, num_warps=None, num_stages=None, convert=None,
                 min_block_h=None, max_block_h=None, token_major=None, maxnreg=None, pairs_ahead=None,
                 defer_sums=None, engine=None, async_stages=None, async_slots=None, min_split_keys=None):
        #: the knobs given a value here (resolved() keeps this set; decode_engine reads it)
        self.explicit = frozenset(k for k, v in locals().items() if k in self.KNOBS and v is not None)
        self.block_n = block_n
        self.block_m = block_m
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.convert = None if convert is None else int(convert)
        self.min_block_h = min_block_h
        self.max_block_h = max_block_h or 64
        self.token_major = True if token_major is None else bool(token_major)
        self.maxnreg = None if maxnreg is None else int(maxnreg)
        self.pairs_ahead = None if pairs_ahead is None else bool(pairs_ahead)
        self.defer_sums = None if defer_sums is None else bool(defer_sums)
        if engine not in (None, "triton", "gluon"):
            raise ValueError(f"tuning engine={engine!r} must be 'triton' or 'gluon'")
        self.engine = engine
        self.async_stages = None if async_stages is None else _int_knob("async_stages", async_stages)
        if self.async_stages not in (None, 0, 2, 3, 4):
            raise ValueError(f"tuning async_stages={async_stages} must be 0 (registers) or 2-4 (shared-memory stages)")
        if async_slots is not None and not isinstance(async_slots, bool):
            raise ValueError(f"tuning async_slots={async_slots!r} must be true or false")
        self.async_slots = async_slots
        self.min_split_keys = None if min_split_keys is None else _int_knob("min_split_keys", min_split_keys)
        if self.min_split_keys is not None and not 0 <= self.min_split_keys <= self.MAX_MIN_SPLIT_KEYS:
            raise ValueError(f"tuning min_split_keys={min_split_keys} must be in [0, {self.MAX_MIN_SPLIT_KEYS}] "
                             "(positions per INT2 split)")
        if async_slots and self.async_stages == 0:
            raise ValueError("tuning async_slots=True needs async_stages 2-4 (the slot ids share the cp.async "
                             "pipeline); drop async_slots or set async_stages")
        gluon_named = [k for k in self.GLUON_ONLY if k in self.explicit]
        if gluon_named and engine == "triton":
            raise ValueError(f"tuning {' and '.join(gluon_named)} {_gluon_knobs(gluon_named)}; drop it or use "
                             "engine='gluon'")

        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"tuning maxnreg={self.maxnreg} must be in [24, 255]")
        for name in ("block_n", "block_m", "min_block_h", "max_block_h", "num_warps", "num_stages"):
            if getattr(self, name) is not None:
                setattr(self, name, _int_knob(name, getattr(self, name)))
        for name in ("block_n", "block_m", "min_block_h", "num_warps"):
            val = getattr(self, name)
            if val is not None and (val < 1 or val & (val - 1)):
                raise ValueError(f"tuning {name}={val} must be a power of two")
        if self.convert not in (None, CONVERT_ARITH, CONVERT_BITS, CONVERT_ASM, CONVERT_ASM_PERM, CONVERT_PERM_EMULATED,
                                CONVERT_SUBNORMAL, CONVERT_SUBNORMAL_EMULATED):
            raise ValueError(f"tuning convert={self.convert} must be 0..6")

    def resolved(self, head_dim: int, extend: bool = False, min_head_dim: int | None = None,
                 pairs: int | None = None) -> "AttnTuning":
        """Copy with the unset knobs filled for ``head_dim`` (max of K/V), ``min_head_dim`` (min of
        K/V; default ``head_dim``), ``pairs`` (decode: requests x kv heads of the step; ``None`` =
        few) and the platform.

        GPU decode defaults (H200 sweeps, ``scripts/sweep_decode.py``, docs/benchmarks.md): one
        warp per program up to head_dim 128 (no cross-warp softmax reductions), 32 keys per
        iteration, codes read as fp16 subnormals (``CONVERT_SUBNORMAL``), (scale, zero) pairs
        loaded one block ahead (``pairs_ahead``), token-major tiles, q heads padded to 8 --
        194 registers, no spills, 18.5 KB of shared memory per program, 8 programs per SM
        (2026-11-30 sweep: 1.19x faster than ``CONVERT_ASM_PERM`` without ``pairs_ahead`` at
        32K x 1, 1.25x at 128K x 1). These two apply from head_dim 65 up to 128 (timed and
        GPU-tested at 128); larger heads keep ``CONVERT_ASM_PERM`` without ``pairs_ahead``
        (GPU-tested at 192 / 256 / 512); when K or V has head_dim 64 or less (``min_head_dim``),
        where the permuting conversions are wrong on the GPU (:data:`PERMUTE_MIN_QUARTER`),
        decode takes ``CONVERT_ASM`` without ``pairs_ahead`` (GPU-tested at 64 / 64). Under the
        interpreter decode defaults to the emulations (``CONVERT_SUBNORMAL_EMULATED`` with
        ``pairs_ahead`` for 65-128, ``CONVERT_PERM_EMULATED`` above, ``CONVERT_ASM`` run as
        ``CONVERT_BITS`` when K or V is <= 64); GPU decode at head_dim 65-128 with ``pairs`` >=
        :data:`STAGES1_MIN_PAIRS` (batch 32 of an 8-kv-head model) takes ``num_stages`` 1, 2 otherwise,
        and with 2 stages and ``pairs_ahead`` the deferred sums (``defer_sums``; H200 sweep,
        2026-11-30 (4): -4% to -7% at 32K / 128K x batch 1 and 8; the interpreter follows the same
        rule by ``pairs``);
        extend defaults to ``CONVERT_ASM`` (run as ``CONVERT_BITS`` under the interpreter) and no
        ``pairs_ahead``.

        Note: a knob left unset takes its default even when others are set, so
        ``{"convert": 3}`` resolves to ``convert=3, pairs_ahead=True`` for decode at head_dim
        65-128; name ``pairs_ahead=False`` for the pre-2026-11-30 default.
        """
        interp = interpreting()
        t = AttnTuning(**self.as_dict())
        t.explicit = self.explicit
        # K or V of head_dim <= 64: no permuting conversion (see permuting_ok)
        small = not _permutable_head_dim(min_head_dim or head_dim)
        # decode with K and V head_dim in 65-128: the timed fast path (pairs_ahead, num_stages by
        # pairs, defer_sums)
        fast = not extend and not small and head_dim <= 128
        if t.convert is None:
            # the interpreter runs decode with the emulated permutation of the GPU default, so the
            # CPU tests exercise its bookkeeping (q column / V token permutation)
            if extend or small:
                t.convert = CONVERT_ASM
            elif head_dim <= 128:
                t.convert = CONVERT_SUBNORMAL_EMULATED if interp else CONVERT_SUBNORMAL
            else:
                t.convert = CONVERT_PERM_EMULATED if interp else CONVERT_ASM_PERM
        if t.pairs_ahead is None:
            t.pairs_ahead = fast
        many = fast and pairs is not None and pairs >= STAGES1_MIN_PAIRS

        if interp:
            t.block_n = t.block_n or 16
            t.block_m = t.block_m or 16
            t.num_warps = t.num_warps or 4
            t.num_stages = t.num_stages or 1
            t.min_block_h = t.min_block_h or 1
        elif extend:
            t.block_n = t.block_n or 64
            t.block_m = t.block_m or 64
            t.num_warps = t.num_warps or 4
            t.num_stages = t.num_stages or 2
            t.min_block_h = t.min_block_h or 16
        else:
            t.block_n = t.block_n or (32 if head_dim <= 128 else 64)
            t.block_m = t.block_m or 64
            t.num_warps = t.num_warps or max(1, head_dim // 128)
            t.num_stages = t.num_stages or (1 if many else 2)
            t.min_block_h = t.min_block_h or 8
        if t.defer_sums is None:
            # the interpreter resolves num_stages to 1 regardless, so it follows the GPU's choice:
            # an explicit num_stages, else the pairs bound
            if interp:
                staged = self.num_stages >= 2 if self.num_stages is not None else not many
            else:
                staged = t.num_stages >= 2
            t.defer_sums = fast and bool(t.pairs_ahead) and staged
        return t

    @classmethod
    def of(cls, tuning) -> "AttnTuning":
        if tuning is None:
            return cls()
        if isinstance(tuning, cls):
            return tuning
        if isinstance(tuning, dict):
            unknown = set(tuning) - set(cls.KNOBS)
            if unknown:
                raise ValueError(f"unknown tuning keys {sorted(unknown)}; allowed: {cls.KNOBS}")
            return cls(**tuning)
        raise ValueError(f"tuning must be a dict or AttnTuning, got {type(tuning).__name__}")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.KNOBS}

    def launch_options(self) -> dict:
        """Extra Triton launch options (only those that are set; the interpreter ignores them)."""
        return {} if self.maxnreg is None or interpreting() else {"maxnreg": self.maxnreg}


_TUNING_CACHE: dict = {}


def _resolved_tuning(tuning, layout: Int2Layout, extend: bool, pairs: int | None = None) -> AttnTuning:
    """:meth:`AttnTuning.resolved` for ``layout``'s K/V head dims and ``pairs`` (requests x kv
    heads), memoized for ``None`` and dict tunings (hot path)."""
    hi = max(layout.k.head_dim, layout.v.head_dim)
    lo = min(layout.k.head_dim, layout.v.head_dim)
    # only the side of STAGES1_MIN_PAIRS matters to resolved(): one cache entry per side
    pairs = None if pairs is None or pairs < STAGES1_MIN_PAIRS else STAGES1_MIN_PAIRS
    if tuning is None or isinstance(tuning, dict):
        # the value's type is part of the key: True == 1 would otherwise let {"async_slots": 1} hit the
        # entry of {"async_slots": True} and skip AttnTuning's type check
        key = (None if tuning is None else tuple(sorted((k, type(v).__name__, v) for k, v in tuning.items())),
               hi, lo, extend, pairs, interpreting())
        hit = _TUNING_CACHE.get(key)
        if hit is None:
            hit = _TUNING_CACHE[key] = AttnTuning.of(tuning).resolved(hi, extend, min_head_dim=lo, pairs=pairs)
        return hit
    return AttnTuning.of(tuning).resolved(hi, extend, min_head_dim=lo, pairs=pairs)


def effective_convert(convert: int, op: torch.dtype, permuting_ok: bool, subnormal_ok: bool = False) -> int:
    """The conversion a kernel actually runs (see :class:`AttnTuning`).

    ``subnormal_ok``: the launch takes the decode token-major fast path (the only one that
    understands ``CONVERT_SUBNORMAL``'s scaling); otherwise 5/6 run as 3/4.
    """
    interp = interpreting()
    if convert in (CONVERT_SUBNORMAL, CONVERT_SUBNORMAL_EMULATED):
        if permuting_ok and subnormal_ok:
            if interp or convert == CONVERT_SUBNORMAL_EMULATED:
                return CONVERT_SUBNORMAL_EMULATED
            if op == torch.float16:
                return CONVERT_SUBNORMAL
            # fp32 / bf16 operands on the GPU: the fp16-subnormal trick does not apply; take the
            # path ``CONVERT_ASM_PERM`` takes (plain bit trick for non-fp16 operands)
        convert = CONVERT_ASM_PERM if convert == CONVERT_SUBNORMAL else CONVERT_PERM_EMULATED
    if convert in (CONVERT_ASM_PERM, CONVERT_PERM_EMULATED):
        if permuting_ok and (interp or convert == CONVERT_PERM_EMULATED):
            return CONVERT_PERM_EMULATED
        if permuting_ok and op == torch.float16:
            return CONVERT_ASM_PERM
        convert = CONVERT_ASM
    if convert == CONVERT_ASM and (interp or op != torch.float16):
        return CONVERT_BITS
    return convert


def plan_head_blocks(num_q_heads: int, num_kv_heads: int, min_block_h: int = 16, max_block_h: int = 64):
    """GQA tiling: ``(group, heads_per_block, blocks_per_kv, block_h)``.

    ``heads_per_block`` is the whole group when it fits in ``max_block_h``, else the largest
    divisor of the group that does, so a block never holds q heads of two kv heads.
    ``block_h = max(min_block_h, next_pow2(heads_per_block))`` (padded rows are masked).
    """
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    group = num_q_heads // num_kv_heads
    if group <= max_block_h:
        hpb = group
    else:
        hpb = max(d for d in range(1, max_block_h + 1) if group % d == 0)
    return group, hpb, group // hpb, max(min_block_h, next_pow2(hpb))


_SM_COUNT: dict = {}


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


#: programs per step (requests x head programs) for which the Gluon engine offers one resident wave
#: (:func:`choose_num_splits`)
ONE_WAVE_PROGRAMS = (256, 512)


def default_min_split_keys(engine: str, programs: int) -> int:
    """Default ``min_split_keys`` (:class:`AttnTuning`): the positions an INT2 split covers at least.

    Gluon: 128 up to 16 programs per step (batch 1-2 of an 8-kv-head model), 256 above. H200,
    2026-11-30 (9), served pool, split counts of the default policy: 4K x 1 13.1 -> 11.6 us (128),
    4K x 2 13.3 -> 12.4 us, 4K x 8 22.5 -> 19.0 us (256), 4K x 16 35.4 -> 33.9 us (256), 16K x 1
    15.1 -> 14.5 us; 256 at batch 1 cost 32K x 1 17.7 -> 19.3 us, so batch 1-2 keep 128; at 32K-128K
    with batch >= 4 the 256 floor was within 1.5% of none (the splits are longer anyway);
    docs/benchmarks.md, ninth session. Triton: 0 (not timed; every split gets an equal share).
    """
    if engine != "gluon":
        return 0
    return 128 if programs <= 16 else 256


def _head_programs(tuning: AttnTuning, engine: str, num_q_heads: int, num_kv_heads: int,
                   blocks_per_kv: int | None = None) -> int:
    """Stage-1 programs per request and split: kv heads x head blocks as the engine forms them (Triton:
    :func:`plan_head_blocks` of ``tuning``, or ``blocks_per_kv`` when the caller has it; Gluon: blocks
    of 8 q heads)."""
    if engine == "gluon":
        return num_kv_heads * gluon_head_blocks(num_q_heads // num_kv_heads)
    return num_kv_heads * (blocks_per_kv or plan_head_blocks(num_q_heads, num_kv_heads, tuning.min_block_h,
                                                             tuning.max_block_h)[2])


def _split_keys(tuning: AttnTuning, engine: str, programs: int) -> int:
    """``tuning.min_split_keys``, or :func:`default_min_split_keys` for ``programs`` per step."""
    return default_min_split_keys(engine, programs) if tuning.min_split_keys is None else tuning.min_split_keys


def choose_num_splits(batch: int, head_programs: int, *, device=None, max_seq_len: int | None = None,
                      block_n: int = 64, waves: float | None = None, max_splits: int = 256,
                      min_split_tokens: int = 64, engine: str = "triton") -> int:
    """INT2 splits per (request, head block): ``ceil(waves x SMs / (batch x head_programs))``.

    ``waves`` (programs per SM the grid offers) defaults, when ``batch x head_programs <= 16``
    (batch 1-2 of an 8-kv-head model), to 8 for the Triton engine (one wave of ~1,000 programs; more
    splits measured slower) and, for the Gluon engine (168-register programs, 12 per SM), to 11 up
    to 8 programs and 12 up to 16 (H200, 2026-11-30 (9), served pool, two sweeps: 128K x 1 40.0-40.5
    vs 41.2-41.6 us at 12; 32K x 2 24.7-25.3 us at 12 vs 25.3-25.5 at 11); from
    :data:`ONE_WAVE_PROGRAMS` (256-511 programs: batch 32 of an 8-kv-head model) the Gluon engine takes
    11 (one resident wave: 6 splits; 2-8% faster than 32 at 4K-128K x 32 in both sweeps); otherwise 32
    (several full waves; with the Triton default 9-63% faster than 8 at batch 8-32 except 4K x 8,
    12% slower; for Gluon at batch 4-16 and 64, 32 was best or within 1% at 32K-128K). Sweeps:
    docs/benchmarks.md. With ``max_seq_len``
    (a *static* bound such as the server's context length) a split keeps at least
    ``min_split_tokens`` keys (at 4K x batch 1: 16 splits of 256 keys 24 us and 128 splits 21 us
    with the convert-3 tuning, 128 splits 17.7 us with the fifth session's default; 64 splits of
    the earlier ``block_n`` 64 tuning 19 us). Depends only on host constants, never on per-step
    lengths, so a CUDA graph captured for a batch size stays valid.

    Args:
        batch: requests in the step; head_programs: programs per request (kv heads x head blocks
            of the engine: :func:`plan_head_blocks` for Triton, blocks of 8 q heads for Gluon).
        device: where the kernel runs (its SM count; 4 for CPU / the interpreter).
        max_seq_len, block_n, waves, max_splits, min_split_tokens: see above.
        engine: ``"triton"`` or ``"gluon"`` (:func:`decode_engine`), for the default ``waves``.

    Returns:
        The number of INT2 splits, in ``[1, max_splits]``.
    """
    sms = _sm_count(torch.device(device) if device is not None else torch.device("cpu"))
    programs = max(1, batch * head_programs)
    if waves is None:
        if engine != "gluon":
            waves = 8.0 if programs <= 16 else 32.0
        elif programs <= 8:
            waves = 11.0
        elif programs <= 16:
            waves = 12.0
        elif ONE_WAVE_PROGRAMS[0] <= programs < ONE_WAVE_PROGRAMS[1]:
            waves = 11.0
        else:
            waves = 32.0
    ns = math.ceil(waves * sms / programs)
    if max_seq_len is not None:
        ns = min(ns, max(1, math.ceil(max_seq_len / max(min_split_tokens, block_n))))
    return int(max(1, min(max_splits, ns)))


@functools.lru_cache(maxsize=256)
def _attn_constants(layout: Int2Layout) -> tuple:
    a4, b2, c0 = layout.affine_levels
    return (a4, b2 / a4, c0, *layout.levels)


def _check_sm_scale(sm_scale) -> float:
    """``sm_scale`` as a float; ``ValueError`` unless finite and > 0 (NaN / inf would zero every output)."""
    s = float(sm_scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"sm_scale={sm_scale!r} must be a finite positive number (default 1/sqrt(head_dim))")
    return s


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"out_dtype {out_dtype} is not float32/float16/bfloat16")


def _score_scales(sm_scale: float, logit_cap) -> tuple[float, float, bool]:
    """``(qscale, cap_log2e, has_cap)``: queries are pre-multiplied by ``qscale`` (see tiles.py)."""
    has_cap = logit_cap is not None and logit_cap > 0
    if has_cap:
        return sm_scale / float(logit_cap), float(logit_cap) * LOG2E, True
    return sm_scale * LOG2E, 1.0, False


def _mma_dtype(mma_dtype, hp_dtype: torch.dtype) -> torch.dtype:
    if mma_dtype is None:
        mma_dtype = torch.float32 if hp_dtype == torch.float32 else torch.float16
    if mma_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"mma_dtype {mma_dtype} must be float32, float16 or bfloat16")
    if mma_dtype == torch.bfloat16 and interpreting():
        raise ValueError("mma_dtype bfloat16 is wrong under TRITON_INTERPRET (tl.dot on bf16 multiplies raw bits); "
                         "use float16 or float32 there")
    return mma_dtype


def _check_attn_common(layout, q, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v, hp_index, req_to_token,
                       sink, recent, sliding_window, logit_cap):
    check_tensor(q, "q", ndim=3, last_contiguous=True)
    check_float(q, "q")
    dev = q.device
    if q.shape[-1] != layout.k.head_dim:
        raise ValueError(f"q head_dim {q.shape[-1]} does not match the layout's K head_dim {layout.k.head_dim}")
    check_tensor(k_codes, "k_codes", ndim=3)
    hkv = k_codes.shape[1]
    _check_int2_buffers(layout, k_codes, k_pairs, v_codes, v_pairs, hkv, dev)
    check_tensor(hp_k, "hp_k", ndim=3, device=dev, shape=(None, hkv, layout.k.head_dim), last_contiguous=True)
    check_float(hp_k, "hp_k")
    check_tensor(hp_v, "hp_v", ndim=3, dtypes=hp_k.dtype, device=dev,
                 shape=(hp_k.shape[0], hkv, layout.v.head_dim), last_contiguous=True)
    if not isinstance(sink, int) or not isinstance(recent, int) or sink < 0 or recent < 0:
        raise ValueError(f"sink and recent must be non-negative ints, got {sink!r}, {recent!r}")
    check_tensor(hp_index, "hp_index", ndim=2, dtypes=INDEX_DTYPES, device=dev, last_contiguous=True)
    if hp_index.shape[1] < sink + recent:
        raise ValueError(f"hp_index has {hp_index.shape[1]} columns; sink + recent = {sink + recent} needed")
    check_tensor(req_to_token, "req_to_token", ndim=2, dtypes=INDEX_DTYPES, device=dev, last_contiguous=True)
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if logit_cap is not None and not (logit_cap >= 0):
        raise ValueError(f"logit_cap must be >= 0 or None, got {logit_cap!r}")
    plan = plan_head_blocks(q.shape[1], hkv)  # validates the head ratio
    return dev, hkv, plan


def _counter_rotate(o: torch.Tensor, rotation_v: torch.Tensor, num_kv_heads: int, out_dtype) -> torch.Tensor:
    dv = o.shape[-1]
    if rotation_v.shape[-1] != dv or rotation_v.shape[-2] != dv or rotation_v.dim() not in (2, 3):
        raise ValueError(f"rotation_v {tuple(rotation_v.shape)} does not match V head_dim {dv}")
    if rotation_v.dim() == 3 and rotation_v.shape[0] != num_kv_heads:
        raise ValueError(f"rotation_v has {rotation_v.shape[0]} matrices for {num_kv_heads} kv heads")
    return rotate_rows_hp(o, rotation_v, out_dtype, transpose=True)


def _debug_request_indices(req_pool_indices, seq_lens, hp_index, req_to_token, hp_rows, slots, sink, recent,
                           prefix_mode: bool):
    check_range(req_pool_indices, "req_pool_indices", 0, min(req_to_token.shape[0], hp_index.shape[0]))
    check_range(seq_lens, "seq_lens", 0, req_to_token.shape[1] + 1)
    for req, L in zip(req_pool_indices.tolist(), seq_lens.tolist()):
        if L == 0:
            continue
        pos = torch.arange(L)
        hp = pos < sink
        if not prefix_mode:
            hp |= pos >= L - recent
        hp_pos = pos[hp]
        entries = torch.where(hp_pos < sink, hp_pos, sink + (hp_pos % max(recent, 1)))
        if entries.numel():
            rows = hp_index[req, entries.to(hp_index.device)]
            check_range(rows, f"hp_index[{req}] (positions needing an HP row)", 0, hp_rows)
        int2_pos = pos[~hp]
        if int2_pos.numel():
            s = req_to_token[req, int2_pos.to(req_to_token.device)]
            check_range(s, f"req_to_token[{req}] (INT2 positions)", 0, slots)


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------


#: register cap of the Gluon decode kernel unless the tuning names one (12 one-warp programs per SM)
GLUON_MAXNREG = 168
#: cp.async stages of the Gluon decode kernel unless the tuning names ``async_stages`` (H200 sweeps,
#: 2026-11-30 (8): 2 stages with the slot ids in the ring too were the fastest of 0 / 2 / 3 stages at
#: 32K / 128K x batch 1, 8 and 32 but for 32K x 32, 1-4% behind the register pipeline)
GLUON_ASYNC_STAGES = 2


def gluon_pipeline(tuning: "AttnTuning") -> dict:
    """``{"async_stages": n, "slot_ring": bool}`` the Gluon decode launch takes for ``tuning``:
    ``async_stages`` or :data:`GLUON_ASYNC_STAGES`; the slot ring per ``async_slots``, on by
    default whenever the words go through the ``cp.async`` ring (:class:`AttnTuning` refuses
    ``async_slots=True`` with ``async_stages`` 0)."""
    stages = GLUON_ASYNC_STAGES if tuning.async_stages is None else tuning.async_stages
    slots = bool(stages) if tuning.async_slots is None else bool(tuning.async_slots)
    return {"async_stages": stages, "slot_ring": slots}


def decode_engine(tuning: "AttnTuning", layout: Int2Layout, q: torch.Tensor, mma_dtype: torch.dtype,
                  has_cap: bool, hp_dtype: torch.dtype | None = None, buffers: tuple = ()) -> str:
    """The stage-1 engine a decode call runs: the tuning's ``engine``; with ``None``, ``"triton"`` if
    the tuning names a Triton-only knob (:attr:`AttnTuning.TRITON_ONLY`), ``"gluon"`` if it names a
    Gluon-only one (:attr:`AttnTuning.GLUON_ONLY`, any value; ``ValueError`` if the call is outside
    the Gluon scope or the tuning names knobs of both), else ``"gluon"`` where
    :func:`.gluon_decode.gluon_decode_supported` accepts the call (a CUDA sm_80+ device, not the
    interpreter, not an offline compile) and ``block_n`` is 16 / 32, else ``"triton"``.

    Args:
        tuning: the resolved :class:`AttnTuning`; layout, q, mma_dtype, has_cap, hp_dtype, buffers:
            as :func:`.gluon_decode.gluon_decode_supported` takes them.

    Raises:
        ValueError: ``engine="gluon"`` or a Gluon-only knob named for a call the Gluon engine cannot
            run (the reason is in the message), or Gluon-only and Triton-only knobs named together.
    """
    gluon_named = sorted(k for k in AttnTuning.GLUON_ONLY if k in tuning.explicit)
    if tuning.engine == "triton" or (tuning.engine is None
                                     and any(k in tuning.explicit for k in AttnTuning.TRITON_ONLY)):
        if gluon_named:
            named = sorted(k for k in tuning.explicit if k in AttnTuning.TRITON_ONLY)
            raise ValueError(f"tuning {', '.join(gluon_named)} {_gluon_knobs(gluon_named)}, but the tuning also names "
                             f"Triton-only knob(s) {named}, which select the Triton engine; drop one or the other")
        return "triton"  # no scope check needed (hot path)
    why = gluon_decode_supported(layout, q, mma_dtype, has_cap, hp_dtype, buffers)
    if why is None and tuning.block_n not in (16, 32):
        why = f"block_n {tuning.block_n} (16 or 32; 64 spills registers)"
    if tuning.engine == "gluon":
        triton_named = sorted(k for k in tuning.explicit if k in AttnTuning.TRITON_ONLY)
        if triton_named:
            raise ValueError(f"tuning engine='gluon' with Triton-engine knob(s) {triton_named}, which the Gluon "
                             "engine does not have; drop them or use engine='triton'")
    if tuning.engine == "gluon" or (tuning.engine is None and gluon_named):
        if why is not None:
            if tuning.engine == "gluon":
                raise ValueError(f"tuning engine='gluon' cannot run this decode call: {why}; "
                                 "use engine='triton' (or leave engine unset), which covers every layout")
            knobs = ", ".join(f"{k}={getattr(tuning, k)}" for k in gluon_named)
            raise ValueError(f"tuning {knobs} selects the Gluon engine, which cannot run this decode call: {why}; "
                             f"drop {' and '.join(gluon_named)} (the Triton engine covers every layout)")
        return "gluon"
    # an offline compile (compile_check.compile_only, CPU tensors) names the engine it compiles;
    # left unset it compiles the Triton kernel, as before the Gluon engine existed
    return "gluon" if why is None and not compiling_offline() else "triton"


#: merge (stage 2): split x dim elements per unrolled chunk, and the smallest grid (programs) that the
#: choice of output dims per program aims at (``decode_merge``)
MERGE_CHUNK = 4096
MERGE_MIN_PROGRAMS = 2048


def merge_block_d(bsz: int, hq: int, dv: int) -> int:
    """Output dims per merge program: the largest of 16 / 32 / 64 / 128 (at most ``next_pow2(dv)``)
    whose grid ``bsz x hq x ceil(dv / block_d)`` still has :data:`MERGE_MIN_PROGRAMS` programs,
    else 16. A compromise between the H200 timings (one warp per program, 32 q heads, D_v 128,
    2026-11-30 (7), call 2, docs/benchmarks.md): at batch 1 (205 splits) 16 dims was fastest
    (3.9 us), at batch 32 (24 splits) 64 (6.2 us; 128: 6.6); at batch 8 (73 splits) this rule picks
    16 (6.2 us) where 32 was fastest (6.0 us) -- no single program-count threshold fits all three."""
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


def decode_merge(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, num_splits: int,
                 block_d: int | None = None, chunk: int = MERGE_CHUNK, num_warps: int = 1,
                 validate: bool = True) -> None:
    """Stage 2 of decode attention: merge ``num_splits`` partial outputs into ``out``.

    Args:
        o_part: ``[>= B, H_q, >= num_splits, D_v]`` fp32 normalised partial outputs (stage 1; a
            workspace from :func:`decode_workspace`, possibly sized for a larger batch), last dim
            contiguous.
        lse: ``[>= B, H_q, >= num_splits]`` fp32 base-2 log-sum-exp of each split (``-inf`` =
            empty), last dim contiguous.
        out: ``[B, H_q, D_v]`` (any float dtype, last dim contiguous), written: the LSE-weighted
            mean of the splits, zeros where every split is empty.
        num_splits: splits to merge, ``>= 1``.
        block_d: output dims per program, a power of two (grid ``(B, H_q, ceil(D_v / block_d))``;
            ``None`` = :func:`merge_block_d`). Before 2026-11-30 (7) the grid was ``(B, H_q)`` with
            two warps: at batch 1, 32 programs each read a few hundred 512-byte rows in 16 dependent
            steps, 10.9 of the 67.3 us of a 128K x 1 decode call on the H200
            (``scripts/profile_decode.py``).
        chunk: splits x dims per unrolled step, a power of two (all loads of a few hundred splits in
            flight at once).
        num_warps: warps per program (one was fastest or within 0.1 us of it at every point timed).
        validate: check the arguments (``decode_attention`` passes ``False``: it has checked its
            workspace and output already).

    Raises:
        ValueError: wrong dims / shapes / dtypes / devices, ``num_splits`` not an int in
            ``[1, o_part.shape[2]]``, a last dim that is not contiguous, ``block_d`` / ``chunk`` not
            powers of two.

    The grid depends only on shapes (CUDA graphs).
    """
    if validate:
        _check_merge_args(o_part, lse, out, num_splits, block_d, chunk)
    bsz, hq, dv = out.shape
    nsp = next_pow2(num_splits)
    bd = min(next_pow2(dv), block_d or merge_block_d(bsz, hq, dv))
    _launch(_decode_stage2, (bsz, hq, triton.cdiv(dv, bd)),
        o_part, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse, lse.stride(0), lse.stride(1),
        out, out.stride(0), out.stride(1), num_splits,
        NSP=nsp, SB=max(1, min(nsp, chunk // bd)), BD=bd, DV=dv, OUT_DT=_tl(out.dtype),
        num_warps=num_warps,
    )


def default_num_kv_splits(tuning: AttnTuning, engine: str, bsz: int, num_q_heads: int, num_kv_heads: int, *,
                          device=None, max_seq_len: int | None = None, blocks_per_kv: int | None = None) -> int:
    """The INT2 split count :func:`decode_attention` uses when ``num_kv_splits`` is ``None``:
    :func:`choose_num_splits` over ``kv heads x head blocks`` programs per request, head blocks as the
    engine forms them (Triton: :func:`plan_head_blocks` of the resolved ``tuning``; Gluon: blocks of
    8 q heads). ``engine``: from :func:`decode_engine`; ``blocks_per_kv``: the Triton plan's
    blocks when the caller has it already (else computed). Callers sizing a workspace ahead of the
    call (benchmarks, CUDA-graph buffers) use this to match the call's own choice."""
    programs = _head_programs(tuning, engine, num_q_heads, num_kv_heads, blocks_per_kv)
    # with a static bound, no more splits than the split floor can ever fill
    return choose_num_splits(bsz, programs, device=device, max_seq_len=max_seq_len, block_n=tuning.block_n,
                             engine=engine,
                             min_split_tokens=max(64, _split_keys(tuning, engine, bsz * programs)))


def decode_workspace(batch: int, num_q_heads: int, head_dim_v: int, total_splits: int, device) -> tuple:
    """Stage-1 scratch ``(o_part [B, H_q, S, D_v] fp32, lse [B, H_q, S] fp32)`` (preallocate for graphs)."""
    return (torch.empty((batch, num_q_heads, total_splits, head_dim_v), dtype=torch.float32, device=device),
            torch.empty((batch, num_q_heads, total_splits), dtype=torch.float32, device=device))


#: HP positions per default HP split (:func:`decode_num_hp_splits`)
HP_SPLIT_POSITIONS = 48


def decode_num_hp_splits(sink: int, recent: int) -> int:
    """Default HP splits: one per :data:`HP_SPLIT_POSITIONS` (48) HP positions, 1..8 (a BF16 position
    costs several INT2 ones, so HP splits are kept short to not be the long pole at short contexts:
    7 splits for the default 64 + 256; 128 positions per split before the Gluon engine, whose HP
    loop is slower per key than its INT2 loop)."""
    return int(max(1, min(8, math.ceil((sink + recent) / HP_SPLIT_POSITIONS))))


def decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_pairs: torch.Tensor,
    v_codes: torch.Tensor,
    v_pairs: torch.Tensor,
    hp_k: torch.Tensor,
    hp_v: torch.Tensor,
    hp_index: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: Int2Layout,
    *,
    sink: int,
    recent: int,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    rotation_v: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    num_kv_splits: int | None = None,
    num_hp_splits: int | None = None,
    max_seq_len: int | None = None,
    workspace: tuple | None = None,
    mma_dtype: torch.dtype | None = None,
    tuning=None,
    sink_lens: torch.Tensor | None = None,
    debug: bool | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Decode attention of one rotated query per request over the two-tier cache.

    Args:
        q: ``[B, H_q, D_k]`` rotated queries (query ``b`` at position ``seq_lens[b] - 1``).
        k_codes, k_pairs, v_codes, v_pairs: INT2 buffers ``[S, H_kv, ...]``.
        hp_k, hp_v: HP buffers ``[R, H_kv, D]`` (rotated frame).
        hp_index: int ``[max_reqs, >= sink + recent]``: HP row of sink position ``p`` at entry
            ``p``, of recent position ``p`` at entry ``sink + p % recent``.
        req_to_token: int ``[max_reqs, max_ctx]`` INT2 slot of each position.
        req_pool_indices, seq_lens: int ``[B]`` on the device (``seq_lens`` includes the query;
            0 marks a padding row, e.g. of a CUDA-graph batch, whose output is zeros).
        layout: :class:`Int2Layout`; sink, recent: HP window sizes (tokens).
        sm_scale: default ``1/sqrt(D_k)``; sliding_window: key ``j`` visible iff ``L-1-j < W``;
            logit_cap: ``cap * tanh(s / cap)`` (``None``/0 = off).
        rotation_v: if given (``[D_v, D_v]`` or ``[H_kv, D_v, D_v]``), return ``o R_v^T``.
        out: optional ``[B, H_q, D_v]`` output (rotated frame; ignored with ``rotation_v``).
        num_kv_splits / num_hp_splits: INT2 / HP splits (default: :func:`choose_num_splits`,
            :func:`decode_num_hp_splits`); with ``max_seq_len`` a static bound used by the default.
        workspace: ``(o_part, lse)`` from :func:`decode_workspace` with at least
            ``num_hp_splits + num_kv_splits`` splits (CUDA graphs: allocate before capture).
        mma_dtype: operand dtype of the MMAs (default fp16, fp32 when the HP dtype is fp32).
        tuning: dict / :class:`AttnTuning`; unset knobs take :meth:`AttnTuning.resolved`'s defaults
            for this layout and ``B x H_kv`` (``num_stages`` depends on it).
        sink_lens: optional int32 ``[max_reqs]``: request ``r`` reads only positions
            ``< min(sink_lens[r], sink)`` from sink rows and the rest of ``[0, sink)`` through
            INT2 (never from the recent ring, which covers positions ``>= sink``). Used by the
            served pool when its sink-row arena could not give a token a row.
        debug: check index values (host sync); default ``SGLANG_OSCAR_DEBUG``.
        validate: shape/dtype/device checks (pure Python); ``False`` skips them (hot path, after
            the arguments were validated once).

    Returns:
        ``[B, H_q, D_v]`` in ``out_dtype`` (default ``q.dtype``).

    Raises:
        ValueError: unsupported layout, mismatched shapes/dtypes/devices, (debug) bad indices.
    """
    if validate:
        _check_attn_common(layout, q, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v, hp_index, req_to_token,
                           sink, recent, sliding_window, logit_cap)
    dev, hkv = q.device, k_codes.shape[1]
    bsz, hq, dk = q.shape
    tn = _resolved_tuning(tuning, layout, False, pairs=bsz * hkv)
    dv = layout.v.head_dim
    group, hpb, bpk, block_h = plan_head_blocks(hq, hkv, tn.min_block_h, tn.max_block_h)
    if validate:
        check_tensor(req_pool_indices, "req_pool_indices", ndim=1, dtypes=INDEX_DTYPES, device=dev, shape=(bsz,))
        check_tensor(seq_lens, "seq_lens", ndim=1, dtypes=INDEX_DTYPES, device=dev, shape=(bsz,))
    op = _mma_dtype(mma_dtype, hp_k.dtype)
    out_dtype = out_dtype or (out.dtype if out is not None else q.dtype)
    _check_out_dtype(out_dtype)
    engine = decode_engine(tn, layout, q, op, logit_cap is not None and logit_cap > 0, hp_k.dtype,
                           (k_codes, k_pairs, v_codes, v_pairs))
    gluon = engine == "gluon"
    if num_hp_splits is None:
        num_hp_splits = decode_num_hp_splits(sink, recent)
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(tn, engine, bsz, hq, hkv, device=dev, max_seq_len=max_seq_len,
                                              blocks_per_kv=bpk)
    if num_hp_splits < 1 or num_kv_splits < 1:
        raise ValueError("num_hp_splits and num_kv_splits must be >= 1")
    ns = num_hp_splits + num_kv_splits
    if workspace is None:
        workspace = decode_workspace(bsz, hq, dv, ns, dev)
    o_part, lse = workspace
    if validate:
        check_tensor(o_part, "workspace o_part", ndim=4, dtypes=torch.float32, device=dev,
                     shape=(None, hq, None, dv), last_contiguous=True)
        check_tensor(lse, "workspace lse", ndim=3, dtypes=torch.float32, device=dev, shape=(None, hq, None))
    # always (four integer compares): a workspace sized for another split count would be written past its end
    if o_part.shape[0] < bsz or lse.shape[0] < bsz or o_part.shape[2] < ns or lse.shape[2] < ns:
        raise ValueError(f"workspace too small for batch {bsz} and {ns} splits: "
                         f"{tuple(o_part.shape)}, {tuple(lse.shape)}; size it with decode_num_hp_splits + "
                         "num_kv_splits, or pass both split counts")
    if rotation_v is None:
        if out is None:
            out = torch.empty((bsz, hq, dv), dtype=out_dtype, device=dev)
        elif validate:
            check_tensor(out, "out", ndim=3, device=dev, shape=(bsz, hq, dv), last_contiguous=True)
            check_float(out, "out")
        o_rot = out
    else:
        if validate:
            check_tensor(rotation_v, "rotation_v", device=dev)
        o_rot = torch.empty((bsz, hq, dv), dtype=torch.float32, device=dev)
    if debug_enabled(debug):
        _debug_request_indices(req_pool_indices, seq_lens, hp_index, req_to_token, hp_k.shape[0],
                               k_codes.shape[0], sink, recent, prefix_mode=False)
    if bsz == 0:
        return o_rot if rotation_v is None else o_rot.to(out_dtype)
    sm_scale = 1.0 / math.sqrt(dk) if sm_scale is None else _check_sm_scale(sm_scale)
    qscale, cap_log2e, has_cap = _score_scales(sm_scale, logit_cap)
    # the split floor as the kernels take it: a multiple of block_n
    min_chunk = -(-_split_keys(tn, engine, bsz * _head_programs(tn, engine, hq, hkv, bpk)) // tn.block_n) * tn.block_n
    if gluon:
        # stage 1, both tiers, in one Gluon launch (kernels/gluon_decode.py)
        launch_gluon_decode(q, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v, hp_index, req_to_token,
                            req_pool_indices, seq_lens, sink_lens, o_part, lse, qscale=qscale, sink=sink, recent=recent,
                            sliding_window=sliding_window, num_hp_splits=num_hp_splits, num_kv_splits=num_kv_splits,
                            block_n=tn.block_n, min_chunk=min_chunk,
                            maxnreg=tn.maxnreg or GLUON_MAXNREG,
                            **gluon_pipeline(tn))
    else:
        # the Gluon launcher decides its own index width (on byte views); the rest is Triton-only too
        idx64 = needs_idx64(k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v)
        token_major = tn.token_major and layout.k.num_groups == 1 and layout.v.num_groups == 1
        convert = effective_convert(tn.convert, op, permuting_ok(layout), subnormal_ok=token_major)
        grid = (bsz, hkv * bpk, ns)
        _launch(_decode_stage1, grid,
            *row_args(q, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v),
            hp_index, hp_index.stride(0), req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens,
            hp_index if sink_lens is None else sink_lens,
            o_part, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse, lse.stride(0), lse.stride(1),
            qscale, cap_log2e, sink, recent, sliding_window or 0,
            *_attn_constants(layout),
            GROUP=group, HEADS_PER_BLOCK=hpb, BLOCKS_PER_KV=bpk, BLOCK_H=block_h,
            QK=layout.k.quarter, QKP=layout.k.quarter_p2, GK=layout.k.group_size, NGK=layout.k.num_groups,
            K_FAST=layout.k.quarter_aligned,
            QV=layout.v.quarter, QVP=layout.v.quarter_p2, GV=layout.v.group_size, NGV=layout.v.num_groups,
            V_FAST=layout.v.quarter_aligned,
            LM=layout.lloyd, OP=_tl(op), PREC="ieee" if op == torch.float32 else None,
            CONVERT=convert,
            HAS_CAP=has_cap, HAS_WINDOW=sliding_window is not None, IDX64=idx64,
            TOKEN_MAJOR=token_major,
            NS_HP=num_hp_splits, NS_Q=num_kv_splits, MIN_CHUNK=min_chunk,
            BLOCK_N=tn.block_n, HAS_SINKL=sink_lens is not None,
            PAIRS_AHEAD=tn.pairs_ahead, DEFER_SUMS=tn.defer_sums,
            num_warps=tn.num_warps, num_stages=tn.num_stages, **tn.launch_options(),
        )
    decode_merge(o_part, lse, o_rot, ns, validate=False)  # workspace and output checked above
    if rotation_v is None:
        return o_rot
    o = _counter_rotate(o_rot, rotation_v, hkv, out_dtype)
    if out is not None:
        check_tensor(out, "out", ndim=3, device=dev, shape=(bsz, hq, dv))
        out.copy_(o)
        return out
    return o


# ---------------------------------------------------------------------------------------------
# extend
# ---------------------------------------------------------------------------------------------


def extend_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_pairs: torch.Tensor,
    v_codes: torch.Tensor,
    v_pairs: torch.Tensor,
    hp_k: torch.Tensor,
    hp_v: torch.Tensor,
    hp_index: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    layout: Int2Layout,
    *,
    sink: int,
    max_extend_len: int | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    rotation_v: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    return_lse: bool = False,
    mma_dtype: torch.dtype | None = None,
    tuning=None,
    sink_lens: torch.Tensor | None = None,
    debug: bool | None = None,
):
    """Causal attention of new chunks over their cached prefix and themselves (extend semantics).

    Positions ``< sink`` are read from HP rows ``hp_index[req, p]``; every other position -- the
    chunk's own tokens included, which must already be written -- from INT2 slots
    ``req_to_token[req, p]``.

    Args:
        q: ``[N, H_q, D_k]`` rotated queries of all chunks, request ``b`` at rows
            ``qo_indptr[b] : qo_indptr[b] + extend_seq_lens[b]``, positions
            ``extend_prefix_lens[b] + i``.
        qo_indptr: int ``[B+1]`` (or ``[B]``); extend_prefix_lens, extend_seq_lens,
            req_pool_indices: int ``[B]``.
        max_extend_len: host bound on ``extend_seq_lens`` (default: read from the device, a sync).
        return_lse: also return the natural-log LSE ``[N, H_q]`` fp32 (rotated frame; for merging).
        sink_lens: as :func:`decode_attention`.
        Other arguments: as :func:`decode_attention`.

    Returns:
        ``o [N, H_q, D_v]`` (and ``lse`` if ``return_lse``).
    """
    tn = _resolved_tuning(tuning, layout, True)
    dev, hkv, _ = _check_attn_common(layout, q, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v, hp_index,
                                     req_to_token, sink, 0, sliding_window, logit_cap)
    n, hq, dk = q.shape
    dv = layout.v.head_dim
    check_tensor(req_pool_indices, "req_pool_indices", ndim=1, dtypes=INDEX_DTYPES, device=dev)
    bsz = req_pool_indices.shape[0]
    check_tensor(extend_prefix_lens, "extend_prefix_lens", ndim=1, dtypes=INDEX_DTYPES, device=dev, shape=(bsz,))
    check_tensor(extend_seq_lens, "extend_seq_lens", ndim=1, dtypes=INDEX_DTYPES, device=dev, shape=(bsz,))
    check_tensor(qo_indptr, "qo_indptr", ndim=1, dtypes=INDEX_DTYPES, device=dev)
    if qo_indptr.shape[0] not in (bsz, bsz + 1):
        raise ValueError(f"qo_indptr has {qo_indptr.shape[0]} entries for {bsz} requests")
    op = _mma_dtype(mma_dtype, hp_k.dtype)
    out_dtype = out_dtype or (out.dtype if out is not None else q.dtype)
    _check_out_dtype(out_dtype)
    if debug_enabled(debug):
        ext = extend_seq_lens.long().cpu()
        ind = qo_indptr.long().cpu()
        if bsz and (int(ext.min()) < 0 or int((ind[:bsz] + ext).max()) > n or int(ind[:bsz].min()) < 0):
            raise ValueError("qo_indptr / extend_seq_lens address rows outside q")
        if int(extend_prefix_lens.min()) < 0 if bsz else False:
            raise ValueError("extend_prefix_lens has negative entries")
        _debug_request_indices(req_pool_indices, (extend_prefix_lens + extend_seq_lens), hp_index, req_to_token,
                               hp_k.shape[0], k_codes.shape[0], sink, 0, prefix_mode=True)
    if max_extend_len is None:
        max_extend_len = int(extend_seq_lens.max()) if bsz else 0
    if rotation_v is None:
        if out is None:
            out = torch.empty((n, hq, dv), dtype=out_dtype, device=dev)
        else:
            check_tensor(out, "out", ndim=3, device=dev, shape=(n, hq, dv), last_contiguous=True)
            check_float(out, "out")
        o_rot = out
    else:
        check_tensor(rotation_v, "rotation_v", device=dev)
        o_rot = torch.empty((n, hq, dv), dtype=torch.float32, device=dev)
    lse = torch.empty((n, hq), dtype=torch.float32, device=dev) if return_lse else o_rot
    if bsz and max_extend_len > 0 and n > 0:
        group = hq // hkv
        sm_scale = 1.0 / math.sqrt(dk) if sm_scale is None else _check_sm_scale(sm_scale)
        qscale, cap_log2e, has_cap = _score_scales(sm_scale, logit_cap)
        idx64 = needs_idx64(k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v)
        grid = (triton.cdiv(max_extend_len, tn.block_m), bsz, hq)
        _launch(_extend_kernel, grid,
            *row_args(q, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v),
            hp_index, hp_index.stride(0), req_to_token, req_to_token.stride(0), req_pool_indices, qo_indptr,
            extend_prefix_lens, extend_seq_lens, hp_index if sink_lens is None else sink_lens,
            o_rot, o_rot.stride(0), o_rot.stride(1), lse, lse.stride(0), lse.stride(1),
            qscale, cap_log2e, sink, sliding_window or 0,
            *_attn_constants(layout),
            GROUP=group,
            QK=layout.k.quarter, QKP=layout.k.quarter_p2, GK=layout.k.group_size, NGK=layout.k.num_groups,
            K_FAST=layout.k.quarter_aligned,
            QV=layout.v.quarter, QVP=layout.v.quarter_p2, GV=layout.v.group_size, NGV=layout.v.num_groups,
            V_FAST=layout.v.quarter_aligned,
            LM=layout.lloyd, OP=_tl(op), PREC="ieee" if op == torch.float32 else None,
            CONVERT=effective_convert(tn.convert, op, False),
            HAS_CAP=has_cap, HAS_WINDOW=sliding_window is not None, HAS_LSE=return_lse,
            OUT_DT=_tl(o_rot.dtype), IDX64=idx64, BLOCK_M=tn.block_m, BLOCK_N=tn.block_n,
            HAS_SINKL=sink_lens is not None,
            num_warps=tn.num_warps, num_stages=tn.num_stages, **tn.launch_options(),
        )
    if rotation_v is None:
        o = o_rot
    else:
        o = _counter_rotate(o_rot, rotation_v, hkv, out_dtype)
        if out is not None:
            check_tensor(out, "out", ndim=3, device=dev, shape=(n, hq, dv))
            out.copy_(o)
            o = out
    return (o, lse) if return_lse else o
