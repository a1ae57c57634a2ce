"""Per-kv-head rotation of attention rows in one launch: ``(x - mu_in) R`` or ``x R^T + mu_out``.

The served backend rotates, per layer and step, the queries (``q R_k``), the new keys and values
(``(k - mu_k) R_k``, ``(v - mu_v) R_v``, rounded to the model dtype as the oracle's HP tier) and
the attention output back (``o R_v^T + mu_v``). In PyTorch each of these is 3-6 small kernels
(dtype cast, mean, einsum's permutes and batched matmul, cast back); :func:`rotate_heads` is one
kernel with the same fp32 arithmetic up to the summation order of the dot products.

Rows ``x [T, H, D_in]``, ``H = H_r * G`` (GQA: head ``h`` uses matrix ``h // G``). A program
takes ``BLOCK_M`` consecutive (token, head) rows of one matrix ``r`` (row ``i`` = token ``i // G``,
head ``r * G + i % G``) and accumulates ``x R`` over ``BLOCK_K``-wide slices of ``D_in`` with
``tl.dot`` in IEEE fp32 (the HP rows are rounded from these values, and the oracle computes
them in fp32), rounded to the output dtype with round-to-nearest-even (``codes.round_to``:
the interpreter's own bf16 cast truncates). ``R`` is read through strides, so the transpose costs
nothing. A program covers ``BLOCK_N`` output dims (``block_n``; default ``"auto"``,
:func:`auto_block_n`: whole rows for prefill-sized inputs, else the widest of 64 / 32 / 16 whose
grid still has :data:`MIN_PROGRAMS` programs, so a decode step's few rows per kv head are spread
over the SMs).

``precision="tf32x3"`` computes each product as three TF32 MMAs on the tensor cores (about 2^-21
relative to the fp32 products) instead of CUDA-core FMAs; the backend uses it for the output rotation
of a 16-bit model's extend steps, where it is 2.8x faster for an 8K-token chunk of a Qwen3-8B layer
(the q / K / V launch was slower at TF32x3 and stays IEEE: docs/benchmarks_extend.md). Its launch
shape is fixed per head_dim (per (D_k, D_v) pair for :func:`rotate_qkv`; :func:`_tf32x3_shape`),
never the row count's, so a row gets the same bits in a 64-token chunk and in a whole prompt; an
IEEE launch may differ from it in the last bit of a rounded element.

:func:`rotate_qkv` runs the step's three input products (q, K, V) in one launch: the grid's third
axis selects the product and the output slice, and each program runs the same block body as
:func:`rotate_heads`. The backend rotates q, K and V with it and the output with :func:`rotate_heads`,
both with ``block_n="auto"`` (IEEE launches): one launch of output slices fills the GPU at decode
batch sizes, where four launches of whole rows are a few latency-bound programs each
(docs/kernels.md#rotations).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codes import round_to
from .compile_check import launch as _launch
from .layout import TORCH_TO_TL
from .validate import check_float, check_tensor


@triton.jit
def _rotate_block(
    X, stride_xt, stride_xh, R, stride_rh, stride_rk, stride_rn, MU_IN, MU_OUT, OUT, stride_ot, stride_oh, T,
    pid, rh, pid_n,
    G: tl.constexpr,
    D_IN: tl.constexpr,
    D_OUT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_MU_IN: tl.constexpr,
    HAS_MU_OUT: tl.constexpr,
    OUT_DT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Rows ``pid * BLOCK_M ..`` of matrix ``rh``, output dims ``pid_n * BLOCK_N ..`` (module docstring)."""
    i = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = i < T * G
    tok = (i // G).to(tl.int64)
    head = (rh * G + i % G).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = nn < D_OUT
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c in range(0, D_IN, BLOCK_K):
        k_ok = (c + kk) < D_IN
        x = tl.load(X + tok[:, None] * stride_xt + head[:, None] * stride_xh + (c + kk)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if HAS_MU_IN:
            mu = tl.load(MU_IN + rh * D_IN + c + kk, mask=k_ok, other=0.0)
            x = tl.where(k_ok[None, :], x - mu[None, :], 0.0)
        r = tl.load(R + rh * stride_rh + (c + kk)[:, None] * stride_rk + nn[None, :] * stride_rn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(x, r, acc, input_precision=PRECISION)
    if HAS_MU_OUT:
        acc += tl.load(MU_OUT + rh * D_OUT + nn, mask=n_ok, other=0.0)[None, :]
    tl.store(OUT + tok[:, None] * stride_ot + head[:, None] * stride_oh + nn[None, :], round_to(acc, OUT_DT),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _rotate_kernel(
    X, stride_xt, stride_xh, R, stride_rh, stride_rk, stride_rn, MU_IN, MU_OUT, OUT, stride_ot, stride_oh, T,
    G: tl.constexpr,
    D_IN: tl.constexpr,
    D_OUT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_MU_IN: tl.constexpr,
    HAS_MU_OUT: tl.constexpr,
    OUT_DT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    _rotate_block(X, stride_xt, stride_xh, R, stride_rh, stride_rk, stride_rn, MU_IN, MU_OUT, OUT, stride_ot,
                  stride_oh, T, tl.program_id(0), tl.program_id(1), tl.program_id(2), G, D_IN, D_OUT, BLOCK_N,
                  BLOCK_M, BLOCK_K, HAS_MU_IN, HAS_MU_OUT, OUT_DT, PRECISION)


@triton.jit
def _rotate_qkv_kernel(
    Q, stride_qt, stride_qh, K, stride_kt, stride_kh, V, stride_vt, stride_vh,
    RK, stride_rkh, stride_rkk, stride_rkn, RV, stride_rvh, stride_rvk, stride_rvn, MU_K, MU_V,
    Q_OUT, stride_oqt, stride_oqh, K_OUT, stride_okt, stride_okh, V_OUT, stride_ovt, stride_ovh, T,
    G: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BN_K: tl.constexpr,
    BN_V: tl.constexpr,
    NS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BK_K: tl.constexpr,
    BK_V: tl.constexpr,
    HAS_MU_K: tl.constexpr,
    HAS_MU_V: tl.constexpr,
    Q_DT: tl.constexpr,
    KV_DT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    rh = tl.program_id(1)
    prod = tl.program_id(2) // NS
    pid_n = tl.program_id(2) % NS
    if prod == 0:
        if pid_n * BN_K < DK:
            _rotate_block(Q, stride_qt, stride_qh, RK, stride_rkh, stride_rkk, stride_rkn, MU_K, MU_K, Q_OUT,
                          stride_oqt, stride_oqh, T, pid, rh, pid_n, G, DK, DK, BN_K, BLOCK_M, BK_K, False, False,
                          Q_DT, PRECISION)
    elif prod == 1:
        if (pid * BLOCK_M < T) & (pid_n * BN_K < DK):
            _rotate_block(K, stride_kt, stride_kh, RK, stride_rkh, stride_rkk, stride_rkn, MU_K, MU_K, K_OUT,
                          stride_okt, stride_okh, T, pid, rh, pid_n, 1, DK, DK, BN_K, BLOCK_M, BK_K, HAS_MU_K, False,
                          KV_DT, PRECISION)
    else:
        if (pid * BLOCK_M < T) & (pid_n * BN_V < DV):
            _rotate_block(V, stride_vt, stride_vh, RV, stride_rvh, stride_rvk, stride_rvn, MU_V, MU_V, V_OUT,
                          stride_ovt, stride_ovh, T, pid, rh, pid_n, 1, DV, DV, BN_V, BLOCK_M, BK_V, HAS_MU_V, False,
                          KV_DT, PRECISION)


# Launch choices shared by rotate_heads and rotate_qkv. 64-row programs for long inputs at
# head_dim <= 128 (fewer re-reads of R); wider rows keep 16 rows and 16-wide K slices at 8 warps: no
# register spills on sm_90 (cuobjdump -res-usage: 148 / 254 registers at head_dim 128 with 16 / 64
# rows, 118 at 256, 192 at 512, stack 0; 64 x 256 accumulators or 32-wide slices at 512 spill).
def _np(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _block_m(rows: int, np_: int) -> int:
    return 64 if (rows > 256 and np_ <= 128) else 16


def _block_k(d: int) -> int:
    return 32 if (d % 32 == 0 and _np(d) <= 128) else 16


#: fp32 elements of one ``R`` slice ``[BLOCK_K, BLOCK_N]`` that :func:`auto_block_k` allows (16 KiB)
SLICE_ELEMENTS = 4096


def auto_block_k(d: int, block_n: int) -> int:
    """The ``block_k`` (input dims per loop step) that ``block_k="auto"`` picks for ``block_n``-wide
    output slices: whole-row programs keep :func:`_block_k`'s narrow steps (register limits above),
    sliced programs take ``SLICE_ELEMENTS / block_n`` input dims per step, up to the padded head_dim.
    A sliced program is a decode step's: a few rows, one dependent ``R`` load per step, so fewer
    steps mean fewer memory latencies in a row (head_dim 256 at batch 1: 16 steps of 16 -> 1 of 256)."""
    np_ = _np(d)
    if block_n >= np_:
        return _block_k(d)
    return min(np_, max(_block_k(d), SLICE_ELEMENTS // block_n))


def _block_k_for(block_k: int | str, d: int, block_n: int) -> int:
    return auto_block_k(d, block_n) if block_k == "auto" else min(block_k, _np(d))


def _warps(np_: int) -> int:
    return 4 if np_ <= 128 else 8


MIN_PROGRAMS = 128
"""Programs :func:`auto_block_n` wants in a grid: about one per SM of an H200 (132)."""


def auto_block_n(rows: int, matrices: int, d: int, products: int = 1) -> int | None:
    """The ``block_n`` (output dims per program) that ``block_n="auto"`` picks: ``None`` (whole
    rows) when whole rows already give ``2 * MIN_PROGRAMS`` programs, else the widest of 64, 32, 16
    whose grid of ``cdiv(rows, BLOCK_M) * matrices * products * cdiv(D_pad, block_n)`` programs has
    at least :data:`MIN_PROGRAMS`, else 16 (``D_pad``: head_dim padded to a power of two; every
    product counted with the first product's row blocks, idle programs of the shorter ones included).

    Args:
        rows: (token, head) rows per matrix (``T * G``; for :func:`rotate_qkv` the queries' ``T * G``).
        matrices: rotation matrices (kv heads). d: head_dim (the wider of D_k / D_v).
        products: products in the launch (3 for :func:`rotate_qkv`).

    Returns:
        ``None``, 64, 32 or 16: slices where whole rows leave the GPU mostly idle (decode batch
        sizes), whole rows for prefill-sized inputs (docs/kernels.md#rotations, measured at head_dim
        128 with 8 kv heads). Other sizes follow the program count unmeasured (with 8 kv heads the choice goes whole rows / 64 / whole rows
        around batch 41-64 / 65-160 / 161+, where BLOCK_M grows from 16 to 64 rows).
    """
    np_ = _np(d)
    programs = triton.cdiv(rows, _block_m(rows, np_)) * matrices * products
    if programs >= 2 * MIN_PROGRAMS:
        return None
    for bn in (64, 32):
        if programs * triton.cdiv(np_, bn) >= MIN_PROGRAMS:
            return bn
    return 16


def _block_n(block_n: int | str | None, np_: int, auto: int | None) -> int:
    if block_n == "auto":
        block_n = auto
    return np_ if block_n is None else min(block_n, np_)


def _check_block_k(block_k, who: str) -> None:
    if block_k != "auto" and (
            isinstance(block_k, bool) or not isinstance(block_k, int) or block_k < 16 or block_k & (block_k - 1)):
        raise ValueError(f"{who}: block_k={block_k!r} must be \"auto\" or a power of two >= 16")


def _check_block_n(block_n, who: str) -> None:
    if block_n is not None and block_n != "auto" and (
            isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"{who}: block_n={block_n!r} must be \"auto\", None or a power of two >= 16")


PRECISIONS = ("ieee", "tf32x3")


def _check_precision(precision, who: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"{who}: precision={precision!r} must be one of {PRECISIONS}")


def _tf32x3_shape(d: int) -> tuple[int, int, int]:
    """``(block_m, block_n, block_k)`` of a ``precision="tf32x3"`` launch at head_dim ``d`` (
    :func:`rotate_qkv` takes each product's ``block_n`` / ``block_k`` and the smaller ``block_m``):
    whole rows, 64-row programs at head_dim <= 128 (the MMA instruction shape then never changes
    with the row count), 16 beyond (register limits, above)."""
    np_ = _np(d)
    return (64 if np_ <= 128 else 16), np_, _block_k(d)


def rotate_heads(
    x: torch.Tensor,
    rotation: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    transpose: bool = False,
    sub_mean: torch.Tensor | None = None,
    add_mean: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int | str | None = "auto",
    block_k: int | str = "auto",
    validate: bool = True,
    precision: str = "ieee",
) -> torch.Tensor:
    """``(x - sub_mean) R`` (or ``x R^T + add_mean``) per kv head, in fp32, cast to ``out_dtype``.

    Args:
        x: ``[T, H, D]`` rows (fp32 / fp16 / bf16; last dim contiguous), ``H = H_r * G``; head ``h``
            uses matrix ``h // G`` (GQA queries and outputs; ``G = 1`` for keys and values).
        rotation: fp32 ``[H_r, D, D]``, any strides (read through them: the backend's per-layer
            rotations are one matrix broadcast over the heads, stride 0).
        out_dtype: fp32 / fp16 / bf16.
        transpose: multiply by ``R^T`` (the output's counter-rotation).
        sub_mean / add_mean: fp32 ``[H_r, D]`` subtracted from ``x`` before / added after the
            product (key / value centering; docs/format.md), or ``None`` (made contiguous here).
        out: optional ``[T, H, D]`` output in ``out_dtype``.
        block_n: output dims per program: ``"auto"`` (default, :func:`auto_block_n`), a power of
            two >= 16, or ``None`` (all of them, one program per row block and matrix). Smaller
            slices put more programs on a short input (a decode step's 4-32 rows per kv head: 8
            programs at batch 1 with ``None``), each streaming ``block_n / D`` of its matrix.
        block_k: input dims per loop step: ``"auto"`` (default, :func:`auto_block_k`) or a power of
            two >= 16 (capped at the padded head_dim).
        validate: shape / dtype / device checks (``False`` on hot paths validated once).
        precision: ``"ieee"`` (fp32 FMAs) or ``"tf32x3"`` (three TF32 MMAs per product, one launch shape
            per head_dim: ``block_n`` / ``block_k`` are then ignored; module docstring).

    Returns:
        ``[T, H, D]`` in ``out_dtype``. Equals ``torch.einsum`` in fp32 up to the summation order
        (IEEE) or the TF32x3 error (~2^-21 relative; the tests hold both within 1e-5 of the largest
        element in fp32, and a rounded output within the rounding of that interval); NaN stays NaN.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (``validate``); ``block_n`` not
            ``"auto"``, ``None`` or a power of two >= 16, ``block_k`` not ``"auto"`` or a power of
            two >= 16 (always checked).
    """
    _check_block_n(block_n, "rotate_heads")
    _check_block_k(block_k, "rotate_heads")
    _check_precision(precision, "rotate_heads")
    if validate:
        check_tensor(x, "x", ndim=3, last_contiguous=True)
        check_float(x, "x")
        dev = x.device
        check_tensor(rotation, "rotation", ndim=3, dtypes=torch.float32, device=dev)
        hr, di, do = rotation.shape
        if hr == 0:
            raise ValueError("rotation holds no matrices (shape [0, D, D]); pass one [D, D] matrix per kv head")
        if di != do or x.shape[2] != di:
            raise ValueError(f"rotation of shape {tuple(rotation.shape)} does not fit rows of head_dim {x.shape[2]}")
        if x.shape[1] % hr:
            raise ValueError(f"{hr} rotation matrices do not divide {x.shape[1]} heads")
        for name, m in (("sub_mean", sub_mean), ("add_mean", add_mean)):
            if m is not None:
                check_tensor(m, name, ndim=2, dtypes=torch.float32, device=dev, shape=(hr, di))
        if out_dtype not in TORCH_TO_TL:
            raise ValueError(f"out_dtype {out_dtype} is not float32/float16/bfloat16")
        if out is not None:
            check_tensor(out, "out", ndim=3, dtypes=out_dtype, device=dev, shape=tuple(x.shape), last_contiguous=True)
    t, h, d = x.shape
    hr = rotation.shape[0]
    g = h // hr
    if out is None:
        out = torch.empty((t, h, d), dtype=out_dtype, device=x.device)
    if t == 0:
        return out
    rows = t * g
    np_ = _np(d)
    srk, srn = (rotation.stride(2), rotation.stride(1)) if transpose else (rotation.stride(1), rotation.stride(2))
    mu_in = sub_mean.contiguous() if sub_mean is not None else rotation  # no-ops on the backend's tensors
    mu_out = add_mean.contiguous() if add_mean is not None else rotation
    if precision == "tf32x3":
        block_m, bn, block_k = _tf32x3_shape(d)
    else:
        block_m = _block_m(rows, np_)
        bn = _block_n(block_n, np_, auto_block_n(rows, hr, d) if block_n == "auto" else None)
        block_k = _block_k_for(block_k, d, bn)
    _launch(_rotate_kernel, (triton.cdiv(rows, block_m), hr, triton.cdiv(d, bn)),
            x, x.stride(0), x.stride(1), rotation, rotation.stride(0), srk, srn, mu_in, mu_out,
            out, out.stride(0), out.stride(1), t,
            G=g, D_IN=d, D_OUT=d, BLOCK_N=bn, BLOCK_M=block_m, BLOCK_K=block_k,
            HAS_MU_IN=sub_mean is not None, HAS_MU_OUT=add_mean is not None, OUT_DT=TORCH_TO_TL[out_dtype],
            PRECISION=precision, num_warps=_warps(np_))
    return out


def rotate_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    rotation_k: torch.Tensor,
    rotation_v: torch.Tensor | None,
    kv_dtype: torch.dtype,
    *,
    mean_k: torch.Tensor | None = None,
    mean_v: torch.Tensor | None = None,
    q_dtype: torch.dtype = torch.float32,
    block_n: int | str | None = "auto",
    block_k: int | str = "auto",
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    validate: bool = True,
    precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The three input rotations of an attention step in one launch: ``q R_k``, ``(k - mean_k) R_k``,
    ``(v - mean_v) R_v``: the block body of :func:`rotate_heads` for each product, so each result
    equals the fp32 einsum up to the summation order as :func:`rotate_heads` does (one launch instead
    of three).

    Args:
        q: ``[T, H_q, D_k]`` queries, ``H_q = H_kv * G``; k: ``[T, H_kv, D_k]``; v: ``[T, H_kv, D_v]``
            (fp32 / fp16 / bf16, last dims contiguous; views into a fused QKV output are fine), or
            ``None``: only q and K are rotated (the layers whose value rotation is folded into the
            weights, ``backend/fold.py``), in a launch of two products instead of three;
            ``rotation_v``, ``mean_v`` and ``out[2]`` are then ignored and the third result is ``None``.
        rotation_k / rotation_v: fp32 ``[H_kv, D_k, D_k]`` / ``[H_kv, D_v, D_v]``, any strides (as
            :func:`rotate_heads`).
        kv_dtype: dtype of the rotated keys and values (the cache's HP dtype).
        mean_k / mean_v: fp32 ``[H_kv, D_k]`` / ``[H_kv, D_v]`` or ``None`` (centering, docs/format.md).
        q_dtype: dtype of the rotated queries (the backend's fp32).
        block_n: output dims per program, as :func:`rotate_heads` (``"auto"``: :func:`auto_block_n`
            with ``products=3``; ``None``: all).
        block_k: input dims per loop step, as :func:`rotate_heads` (per product's head_dim).
        out: optional ``(q_out, k_out, v_out)`` of the result's shapes and dtypes, last dims contiguous.
        validate: shape / dtype / device checks.
        precision: as :func:`rotate_heads` (``"tf32x3"``: one launch shape per head_dims pair).

    Returns:
        ``(q_rot [T, H_q, D_k] q_dtype, k_rot [T, H_kv, D_k] kv_dtype, v_rot [T, H_kv, D_v] kv_dtype)``
        (``v_rot`` ``None`` without ``v``).

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (``validate``); ``block_n`` not
            ``"auto"``, ``None`` or a power of two >= 16, ``block_k`` as :func:`rotate_heads` (always checked).
    """
    _check_block_n(block_n, "rotate_qkv")
    _check_block_k(block_k, "rotate_qkv")
    _check_precision(precision, "rotate_qkv")
    has_v = v is not None
    if not has_v:  # q and K only: the V product is left out of the grid; its arguments alias K's (never read)
        v, rotation_v, mean_v = k, rotation_k, None
        out = None if out is None else (out[0], out[1], None)
    if validate:
        check_tensor(q, "q", ndim=3, last_contiguous=True)
        for name, x in (("q", q), ("k", k), ("v", v)):
            check_tensor(x, name, ndim=3, last_contiguous=True, device=q.device)
            check_float(x, name)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:  # always: the kernel indexes k / v by q's tokens
        raise ValueError(f"rotate_qkv: q / k / v hold {q.shape[0]} / {k.shape[0]} / {v.shape[0]} tokens")
    if validate:
        if k.shape[1] == 0 or q.shape[1] == 0 or v.shape[1] != k.shape[1] or q.shape[1] % k.shape[1] \
                or q.shape[2] != k.shape[2]:
            raise ValueError(f"rotate_qkv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not "
                             "[T, H_kv * G, D_k], [T, H_kv, D_k], [T, H_kv, D_v]")
        for name, r, x in (("rotation_k", rotation_k, k), ("rotation_v", rotation_v, v)):
            check_tensor(r, name, ndim=3, dtypes=torch.float32, device=q.device,
                         shape=(x.shape[1], x.shape[2], x.shape[2]))
        for name, m, x in (("mean_k", mean_k, k), ("mean_v", mean_v, v)):
            if m is not None:
                check_tensor(m, name, ndim=2, dtypes=torch.float32, device=q.device, shape=(x.shape[1], x.shape[2]))
        for name, dt in (("kv_dtype", kv_dtype), ("q_dtype", q_dtype)):
            if dt not in TORCH_TO_TL:
                raise ValueError(f"rotate_qkv: {name} {dt} is not float32/float16/bfloat16")
        if out is not None:
            if not isinstance(out, (tuple, list)) or len(out) != 3:
                raise ValueError("rotate_qkv: out must be a tuple (q_out, k_out, v_out)")
            for name, o, x, dt in (("q_out", out[0], q, q_dtype), ("k_out", out[1], k, kv_dtype),
                                   ("v_out", out[2], v, kv_dtype))[:3 if has_v else 2]:
                check_tensor(o, name, ndim=3, dtypes=dt, device=q.device, shape=tuple(x.shape), last_contiguous=True)
    t, hq, dk = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    if out is not None:
        q_out, k_out, v_out = out
    else:
        q_out = torch.empty((t, hq, dk), dtype=q_dtype, device=q.device)
        k_out = torch.empty((t, hkv, dk), dtype=kv_dtype, device=q.device)
        v_out = torch.empty((t, hkv, dv), dtype=kv_dtype, device=q.device) if has_v else None
    if t == 0:
        return q_out, k_out, v_out
    products = 3 if has_v else 2
    if not has_v:
        v_out = k_out  # a pointer for the V product's (absent) programs; returned as None below
    g = hq // hkv
    np_k, np_v = _np(dk), _np(dv)
    if precision == "tf32x3":
        (bm_k, bn_k, bk_k), (bm_v, bn_v, bk_v) = _tf32x3_shape(dk), _tf32x3_shape(dv)
        block_m = min(bm_k, bm_v)
    else:
        auto = auto_block_n(t * g, hkv, max(dk, dv), products=products) if block_n == "auto" else None
        bn_k, bn_v = _block_n(block_n, np_k, auto), _block_n(block_n, np_v, auto)
        block_m = _block_m(t * g, max(np_k, np_v))
        bk_k, bk_v = _block_k_for(block_k, dk, bn_k), _block_k_for(block_k, dv, bn_v)
    ns = max(triton.cdiv(dk, bn_k), triton.cdiv(dv, bn_v))
    mu_k = mean_k.contiguous() if mean_k is not None else rotation_k
    mu_v = mean_v.contiguous() if mean_v is not None else rotation_v
    _launch(_rotate_qkv_kernel, (triton.cdiv(t * g, block_m), hkv, products * ns),
            q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
            rotation_k, rotation_k.stride(0), rotation_k.stride(1), rotation_k.stride(2),
            rotation_v, rotation_v.stride(0), rotation_v.stride(1), rotation_v.stride(2), mu_k, mu_v,
            q_out, q_out.stride(0), q_out.stride(1), k_out, k_out.stride(0), k_out.stride(1),
            v_out, v_out.stride(0), v_out.stride(1), t,
            G=g, DK=dk, DV=dv, BN_K=bn_k, BN_V=bn_v, NS=ns, BLOCK_M=block_m,
            BK_K=bk_k, BK_V=bk_v,
            HAS_MU_K=mean_k is not None, HAS_MU_V=mean_v is not None, Q_DT=TORCH_TO_TL[q_dtype],
            KV_DT=TORCH_TO_TL[kv_dtype], PRECISION=precision, num_warps=_warps(max(np_k, np_v)))
    return q_out, k_out, (v_out if has_v else None)


def rotate_heads_reference(x, rotation, out_dtype, *, transpose=False, sub_mean=None, add_mean=None):
    """The same product as :func:`rotate_heads` with ``torch.einsum`` in fp32: the backend's PyTorch
    path (``--oscar-rotate-engine torch``) and the tests' reference.

    Args / returns: as :func:`rotate_heads` (``x [T, H, D]``, ``rotation [H_r, D, D]``, means
    ``[H_r, D]`` or ``None``; result ``[T, H, D]`` in ``out_dtype``). No argument checks.
    """
    t, h, d = x.shape
    hr = rotation.shape[0]
    xv = x.float().reshape(t, hr, h // hr, d)
    if sub_mean is not None:
        xv = xv - sub_mean[None, :, None, :]
    y = torch.einsum("tkgd,ked->tkge" if transpose else "tkgd,kde->tkge", xv, rotation.float())
    if add_mean is not None:
        y = y + add_mean[None, :, None, :]
    return y.reshape(t, h, rotation.shape[-1]).to(out_dtype)


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
