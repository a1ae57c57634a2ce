"""Host-side pieces shared by the attention launchers (decode plan, extend): argument checks,
score scaling, the MMA operand dtype, the counter-rotation of the output, and debug index checks."""

from __future__ import annotations

import functools
import math

import torch

from .codes import LOG2E
from .compile_check import interpreting
from .layout import Int2Layout, next_pow2
from .rotate import rotate_rows_hp
from .validate import INDEX_DTYPES, check_float, check_int2_buffers, check_range, check_tensor


@functools.lru_cache(maxsize=256)
def attn_constants(layout: Int2Layout) -> tuple:
    """The kernels' level constants of ``layout``: ``(a4, b2 / a4, c0, *levels)`` (floats; the affine
    map of a 2-bit code to its level, :attr:`Int2Layout.affine_levels`, and the four levels)."""
    a4, b2, c0 = layout.affine_levels
    return (a4, b2 / a4, c0, *layout.levels)


@functools.lru_cache(maxsize=256)
def layout_constexprs(layout: Int2Layout) -> dict:
    """The attention kernels' compile-time constants of ``layout``: K / V quarters (real and padded),
    group sizes and counts, whether quarters stay inside one group, Lloyd-Max levels."""
    k, v = layout.k, layout.v
    return dict(QK=k.quarter, QKP=k.quarter_p2, GK=k.group_size, NGK=k.num_groups, K_FAST=k.quarter_aligned,
                QV=v.quarter, QVP=v.quarter_p2, GV=v.group_size, NGV=v.num_groups, V_FAST=v.quarter_aligned,
                LM=layout.lloyd)


def check_sm_scale(sm_scale) -> float:
    """``sm_scale`` as a float; ``ValueError`` unless finite and > 0 (NaN / inf would zero every output)."""
    s = float(sm_scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"sm_scale={sm_scale!r} must be a finite positive number (default 1/sqrt(head_dim))")
    return s


def check_out_dtype(out_dtype) -> None:
    """Raises ``ValueError`` unless ``out_dtype`` is float32 / float16 / bfloat16."""
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"out_dtype {out_dtype} is not float32/float16/bfloat16")


def score_scales(sm_scale: float, logit_cap) -> tuple[float, float, bool]:
    """``(qscale, cap_log2e, has_cap)``: queries are pre-multiplied by ``qscale`` (see tiles.py)."""
    has_cap = logit_cap is not None and logit_cap > 0
    if has_cap:
        return sm_scale / float(logit_cap), float(logit_cap) * LOG2E, True
    return sm_scale * LOG2E, 1.0, False


def resolve_mma_dtype(mma_dtype, hp_dtype: torch.dtype) -> torch.dtype:
    """The MMA operand dtype: ``mma_dtype``, else fp32 for fp32 HP rows and fp16 otherwise.

    Raises:
        ValueError: not float32 / float16 / bfloat16, or bfloat16 under ``TRITON_INTERPRET``."""
    if mma_dtype is None:
        mma_dtype = torch.float32 if hp_dtype == torch.float32 else torch.float16
    if mma_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"mma_dtype {mma_dtype} must be float32, float16 or bfloat16")
    if mma_dtype == torch.bfloat16 and interpreting():
        raise ValueError("mma_dtype bfloat16 is wrong under TRITON_INTERPRET (tl.dot on bf16 multiplies raw bits); "
                         "use float16 or float32 there")
    return mma_dtype


def check_query(layout: Int2Layout, q: torch.Tensor) -> None:
    """``q [N, H_q, D_k]``: float, last dim contiguous, ``D_k`` the layout's K head_dim (``ValueError``)."""
    check_tensor(q, "q", ndim=3, last_contiguous=True)
    check_float(q, "q")
    if q.shape[-1] != layout.k.head_dim:
        raise ValueError(f"q head_dim {q.shape[-1]} does not match the layout's K head_dim {layout.k.head_dim}")


def check_cache(layout: Int2Layout, dev, num_q_heads: int, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v, hp_index,
                req_to_token, sink, recent, sliding_window, logit_cap):
    """The cache side of an attention call: INT2 and HP buffers of one layer on ``dev``, the index
    tables, window sizes, sliding window and logit cap (``ValueError`` naming the problem).

    Returns:
        ``num_kv_heads`` (``num_q_heads`` is checked to be a positive multiple of it).
    """
    check_tensor(k_codes, "k_codes", ndim=3)
    hkv = k_codes.shape[1]
    check_int2_buffers(layout, k_codes, k_pairs, v_codes, v_pairs, hkv, dev)
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
    if hkv <= 0 or num_q_heads % hkv:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {hkv} kv heads")
    return hkv


def counter_rotate(o: torch.Tensor, rotation_v: torch.Tensor, num_kv_heads: int, out_dtype) -> torch.Tensor:
    """``o R_v^T`` in ``out_dtype``: ``o`` ``[B, H_q, D_v]`` in the rotated V frame, ``rotation_v``
    ``[D_v, D_v]`` or per kv head ``[H_kv, D_v, D_v]``.

    Raises:
        ValueError: a rotation of another head_dim or kv-head count."""
    dv = o.shape[-1]
    if rotation_v.shape[-1] != dv or rotation_v.shape[-2] != dv or rotation_v.dim() not in (2, 3):
        raise ValueError(f"rotation_v {tuple(rotation_v.shape)} does not match V head_dim {dv}")
    if rotation_v.dim() == 3 and rotation_v.shape[0] != num_kv_heads:
        raise ValueError(f"rotation_v has {rotation_v.shape[0]} matrices for {num_kv_heads} kv heads")
    return rotate_rows_hp(o, rotation_v, out_dtype, transpose=True)


def debug_request_indices(req_pool_indices, seq_lens, hp_index, req_to_token, hp_rows, slots, sink, recent,
                          prefix_mode: bool, sink_lens=None, sliding_window=None, first_query=None) -> None:
    """Check (host sync; ``SGLANG_OSCAR_DEBUG``) that every position a request's attention reads has a
    valid index: an HP row (``hp_index`` in ``[0, hp_rows)``) for sink positions below
    ``min(sink_lens[req], sink)`` (all of ``[0, sink)`` without ``sink_lens``) and, in decode mode,
    for the recent ring; an INT2 slot (``req_to_token`` in ``[0, slots)``) for every other position.
    With ``sliding_window`` W, key ``p`` is read only if ``first_query - p < W`` (``first_query``:
    ``[B]`` position of a request's first query; default ``seq_lens - 1``), and nothing outside that
    span is checked (SGLang frees those slots).

    Args:
        req_pool_indices, seq_lens: int ``[B]`` (``seq_lens`` counts every position read, queries
            included); hp_index, req_to_token, sink_lens: as :class:`~.decode.plan.DecodePlan`;
            prefix_mode: extend (no recent ring: a chunk reads its prefix and itself through INT2).

    Raises:
        ValueError: an index outside its table, naming the request and the table.
    """
    check_range(req_pool_indices, "req_pool_indices", 0, min(req_to_token.shape[0], hp_index.shape[0]))
    check_range(seq_lens, "seq_lens", 0, req_to_token.shape[1] + 1)
    firsts = None if first_query is None else first_query.tolist()
    for i, (req, L) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        if L == 0:
            continue
        pos = torch.arange(L)
        read = torch.ones(L, dtype=torch.bool)
        if sliding_window:
            read = (L - 1 if firsts is None else firsts[i]) - pos < sliding_window
        own_sink = sink if sink_lens is None else min(sink, int(sink_lens[req]))
        hp = pos < own_sink
        if not prefix_mode:  # the recent ring holds positions past the sink span only
            hp |= (pos >= L - recent) & (pos >= sink)
        hp_pos = pos[hp & read]
        entries = torch.where(hp_pos < sink, hp_pos, sink + (hp_pos % max(recent, 1)))
        if entries.numel():
            rows = hp_index[req, entries.to(hp_index.device)]
            check_range(rows, f"hp_index[{req}] (positions needing an HP row)", 0, hp_rows)
        int2_pos = pos[~hp & read]
        if int2_pos.numel():
            s = req_to_token[req, int2_pos.to(req_to_token.device)]
            check_range(s, f"req_to_token[{req}] (INT2 positions)", 0, slots)


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


def run_scales(plan_has_cap: bool, head_dim: int, sm_scale, logit_cap) -> tuple[float, float]:
    """``(qscale, cap_log2e)`` of one plan run (:func:`score_scales`; ``sm_scale`` default ``1/sqrt(head_dim)``).

    Raises:
        ValueError: ``sm_scale`` not finite and > 0; a logit cap on a plan built without one, or none
            on a plan built with one (the cap is a kernel constant).
    """
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else check_sm_scale(sm_scale)
    qscale, cap_log2e, has_cap = score_scales(sm_scale, logit_cap)
    if has_cap != plan_has_cap:
        raise ValueError(f"logit_cap={logit_cap!r} on a plan built {'with' if plan_has_cap else 'without'} "
                         "a logit cap (the cap is a kernel constant: build the plan with logit_cap set)")
    return qscale, cap_log2e


def run_once(plan, q: torch.Tensor, buffers: tuple, *, sm_scale, logit_cap, out, out_dtype, rotation_v,
             empty: bool = False, sinks: torch.Tensor | None = None):
    """The one-shot wrappers' run of a just-built plan: into ``out`` (checked), or -- with
    ``rotation_v`` -- into an fp32 buffer that is counter-rotated to ``out_dtype`` (and copied into
    ``out`` if given). ``empty``: the batch is empty, return the fp32 buffer cast. Returns what
    ``plan.run`` returns (with the output replaced)."""
    if rotation_v is None:
        if out is not None:
            check_tensor(out, "out", ndim=3, device=q.device, shape=plan.out_shape, last_contiguous=True)
            check_float(out, "out")
        return plan.run(q, *buffers, sm_scale=sm_scale, logit_cap=logit_cap, out=out, sinks=sinks)
    check_tensor(rotation_v, "rotation_v", device=q.device)
    res = plan.run(q, *buffers, sm_scale=sm_scale, logit_cap=logit_cap, sinks=sinks,
                   out=torch.empty(plan.out_shape, dtype=torch.float32, device=q.device))
    o_rot, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, ())
    if empty:
        o = o_rot.to(out_dtype)
    else:
        o = counter_rotate(o_rot, rotation_v, plan.num_kv_heads, out_dtype)
        if out is not None:
            check_tensor(out, "out", ndim=3, device=q.device, shape=plan.out_shape)
            out.copy_(o)
            o = out
    return (o, *rest) if rest else o
