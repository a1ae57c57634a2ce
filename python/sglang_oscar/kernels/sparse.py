"""Block-sparse attention over the two-tier cache: MiniMax-M3's sparse (MSA) layers.

A MiniMax-M3 sparse layer lets each kv head attend, per query, only to whole key blocks of ``B``
tokens chosen by the layer's indexer. The oracle is :func:`sglang_oscar.reference.attention.attend`
with the per-kv-head ``key_mask`` of :func:`sglang_oscar.reference.sparse.block_topk_key_mask`
(whose module docstring cites SGLang 0.5.16's ``minimax_sparse`` kernels: the main attention reads
positions ``c * B + i`` of its selected blocks below the query's sequence length,
``.../decode/topk_sparse.py:162``, ``.../prefill/topk_sparse.py:186-215``).

Semantics of :func:`block_sparse_attention`, one query row ``n`` of request slot ``req`` with
``L = row_len[n]`` visible positions (query at ``L - 1``; ``L = 0`` is a padding row, output 0):
position ``p`` is attended by the q heads of kv head ``h`` iff ``p < L`` and ``p // B`` is in
``blocks[h, n]`` (``-1`` entries unused; a block listed twice counts once). Each position is read
from its tier exactly as the dense decode kernel (:mod:`.decode.triton_stage1`) reads it: the sink
row ``hp_index[req, p]`` if ``p < sink_r`` (``sink_r = min(sink_lens[req], sink)``), the recent ring
row ``hp_index[req, sink + p % recent]`` if ``p >= max(sink, L - recent)``, else the INT2 slot
``req_to_token[req, p]`` (an HP row or slot of ``-1`` is not read). A decode step passes the
pool's ``recent`` (window mode ``"decode"``); an extend chunk passes ``recent = 0`` and one row per
chunk token with ``L = position + 1`` (window mode ``"extend"``: only the sink is HP, the chunk's own
tokens are read through INT2 and must be written first).

Grid ``(N, kv_heads * head_blocks, splits)``: a program takes the q heads of one kv head (a head
block never straddles two kv heads) for one row and a contiguous slice of ``ceil(k / splits)``
entries of that kv head's block list, and walks each selected block in ``BLOCK_N``-position tiles.
A block may straddle a tier boundary (sink 64 or the recent ring vs ``B`` 16-128), so a tile
scores its HP and its INT2 positions with complementary masks (each product only when the tile
has such positions) and accumulates both into one value accumulator in value units (the extend
kernel's ``TRUE_UNITS`` INT2 path). The splits' normalised partial outputs and base-2 LSEs are
merged by the decode merge (:mod:`.decode.merge`); with one split the program writes the output
directly. The grid depends only on ``N``, the heads, ``k`` and the split count (host constants), so
the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import (attn_constants, check_cache, check_out_dtype, check_query, check_sm_scale,
                        layout_constexprs, plan_head_blocks, resolve_mma_dtype)
from .codes import CONVERT_ASM, LOG2E
from .compile_check import launch as _launch
from .compile_check import row_args
from .configs import effective_convert
from .decode.merge import launch_merge, merge_launch
from .layout import TORCH_TO_TL, Int2Layout, next_pow2
from .tiles import NEG_INF, hp_scores, hp_values, int2_scores, int2_values, load_q_quarter, request_sink_len, \
    softmax_update, store_quarters
from .validate import INDEX_DTYPES, check_float, check_range, check_tensor, debug_enabled, needs_idx64

#: block sizes (``sparse_block_size``) the kernel takes
BLOCK_SIZES = (16, 32, 64, 128)
#: selected key positions per split of a row (:func:`block_sparse_num_splits`): extend rows, and
#: decode rows, whose few programs per request need shorter splits to fill the GPU
SPLIT_KEYS = 512
DECODE_SPLIT_KEYS = 128
MAX_DEFAULT_SPLITS = 8
MAX_DECODE_SPLITS = 16


def block_sparse_num_splits(k: int, block_size: int, decode: bool = False) -> int:
    """Default splits of each row's block list: one per :data:`SPLIT_KEYS` (512) selected positions
    (``k * block_size``), 1..8 and at most ``k``; for decode rows one per :data:`DECODE_SPLIT_KEYS`
    (128), 1..16. A function of the model's selection width and the forward mode only, not of the
    batch: the split count sets the order in which a row's partial softmaxes are summed, so one that
    followed the chunk's token count would make a prompt's result depend on its chunking.

    Why decode splits finer: at M3's width (2,048 keys) and batch 1 the 4 default splits took 45.5 us
    and 16 took 16.4 us (8 q / 1 kv heads; 47.6 vs 18.5 us at 64 / 8), equal at batch 32 (154.7 vs
    157.9 us at 64 / 8): ``python -m benchmarks.bench_sparse --contexts 131072 --batches 1,32
    --block-topk 128:16 --splits S``, H200, tree ``094f2f1`` (docs/benchmarks_mla.md)."""
    keys, cap = (DECODE_SPLIT_KEYS, MAX_DECODE_SPLITS) if decode else (SPLIT_KEYS, MAX_DEFAULT_SPLITS)
    return max(1, min(cap, k, (k * block_size) // keys))


@triton.jit
def _block_sparse_stage1(
    Q, stride_qn, stride_qh,
    KC, stride_kcs, stride_kch, KP, stride_kps, stride_kph,
    VC, stride_vcs, stride_vch, VP, stride_vps, stride_vph,
    HK, stride_hkr, stride_hkh, HV, stride_hvr, stride_hvh,
    HPI, stride_hpi, R2T, stride_r2t, ROWREQ, ROWLEN, SINKL,
    BLK, stride_bh, stride_bn, stride_bk, n_blocks, per_split,
    O, stride_on, stride_oh, stride_os, LSE, stride_ln, stride_lh,
    qscale, sink, recent,
    A4, RB, C0, l0, l1, l2, l3,
    GROUP: tl.constexpr, HEADS_PER_BLOCK: tl.constexpr, BLOCKS_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr,
    QK: tl.constexpr, QKP: tl.constexpr, GK: tl.constexpr, NGK: tl.constexpr, K_FAST: tl.constexpr,
    QV: tl.constexpr, QVP: tl.constexpr, GV: tl.constexpr, NGV: tl.constexpr, V_FAST: tl.constexpr,
    LM: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, CONVERT: tl.constexpr, IDX64: tl.constexpr,
    B: tl.constexpr, BLOCK_N: tl.constexpr, DEDUP: tl.constexpr, HAS_SINKL: tl.constexpr,
    DIRECT: tl.constexpr, OUT_DT: tl.constexpr,
):
    n = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    kvh = hb // BLOCKS_PER_KV
    h_in = (hb % BLOCKS_PER_KV) * HEADS_PER_BLOCK + tl.arange(0, BLOCK_H)
    rmask = (tl.arange(0, BLOCK_H) < HEADS_PER_BLOCK) & (h_in < GROUP)
    heads = (kvh * GROUP + h_in).to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    n64 = n.to(tl.int64)

    req = tl.load(ROWREQ + n).to(tl.int64)
    L = tl.load(ROWLEN + n).to(tl.int32)
    sink_r = request_sink_len(SINKL, req, sink, L, HAS_SINKL)
    rec_start = tl.maximum(sink, L - recent)  # recent = 0 (extend): no ring position is visible
    ring = tl.maximum(recent, 1)

    qoff = n64 * stride_qn + heads * stride_qh
    q0, qb0, sq0 = load_q_quarter(Q, qoff, rmask, qscale, RB, 0, QK, QKP, OP, LM)
    q1, qb1, sq1 = load_q_quarter(Q, qoff, rmask, qscale, RB, 1, QK, QKP, OP, LM)
    q2, qb2, sq2 = load_q_quarter(Q, qoff, rmask, qscale, RB, 2, QK, QKP, OP, LM)
    q3, qb3, sq3 = load_q_quarter(Q, qoff, rmask, qscale, RB, 3, QK, QKP, OP, LM)

    m = tl.full([BLOCK_H], NEG_INF, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, QVP], tl.float32)
    acc1 = tl.zeros([BLOCK_H, QVP], tl.float32)
    acc2 = tl.zeros([BLOCK_H, QVP], tl.float32)
    acc3 = tl.zeros([BLOCK_H, QVP], tl.float32)
    one = tl.full([BLOCK_H], 1.0, tl.float32)
    corr = tl.zeros([BLOCK_H], tl.float32)
    ref = 1.0

    HK_h = HK + kvh64 * stride_hkh
    HV_h = HV + kvh64 * stride_hvh
    KC_h = KC + kvh64 * stride_kch
    KP_h = KP + kvh64 * stride_kph
    VC_h = VC + kvh64 * stride_vch
    VP_h = VP + kvh64 * stride_vph
    hpi = HPI + req * stride_hpi
    r2t = R2T + req * stride_r2t
    lst = BLK + kvh64 * stride_bh + n64 * stride_bn

    lo = sp * per_split
    hi = tl.minimum(lo + per_split, n_blocks)
    for j in range(lo, hi):
        c = tl.load(lst + j * stride_bk)
        # ids past the row's last block (or garbage in a padding row's list) are dropped before c * B,
        # which would wrap int32 for huge ids and walk negative positions out of the index tables
        live = (c >= 0) & (c < tl.cdiv(L, B))
        # a block listed again later in the row's list (any split) is attended only at its first entry
        for d0 in range(0, j, DEDUP):
            e = d0 + tl.arange(0, DEDUP)
            prev = tl.load(lst + e * stride_bk, mask=e < j, other=-1)
            live = live & (tl.sum((prev == c).to(tl.int32), axis=0) == 0)
        start = tl.where(live, c, 0).to(tl.int32) * B
        end = tl.where(live, tl.minimum(start + B, L), start)
        for t0 in range(start, end, BLOCK_N):
            pos = t0 + tl.arange(0, BLOCK_N)
            tm = pos < end
            in_sink = pos < sink_r
            in_hp = in_sink | (pos >= rec_start)
            entry = tl.where(in_sink, pos, sink + pos % ring)
            row = tl.load(hpi + entry, mask=tm & in_hp, other=-1)
            hp_ok = tm & in_hp & (row >= 0)
            slot = tl.load(r2t + pos, mask=tm & ~in_hp, other=-1)
            i2_ok = tm & ~in_hp & (slot >= 0)
            rows = tl.where(hp_ok, row, 0)
            slots = tl.where(i2_ok, slot, 0)
            if IDX64:
                rows = rows.to(tl.int64)
                slots = slots.to(tl.int64)
            else:
                rows = rows.to(tl.int32)
                slots = slots.to(tl.int32)
            n_hp = tl.sum(hp_ok.to(tl.int32), axis=0)
            n_i2 = tl.sum(i2_ok.to(tl.int32), axis=0)
            s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
            if n_hp > 0:
                s_hp = hp_scores(q0, q1, q2, q3, HK_h, stride_hkr, rows, hp_ok, QK, QKP, OP, PREC)
                s = tl.where(hp_ok[None, :], s_hp, s)
            if n_i2 > 0:
                s_i2 = int2_scores(q0, q1, q2, q3, qb0, qb1, qb2, qb3, sq0, sq1, sq2, sq3, KC_h, stride_kcs, KP_h,
                                   stride_kps, slots, i2_ok, A4, C0, l0, l1, l2, l3, QK, QKP, GK, NGK, K_FAST, LM,
                                   OP, PREC, CONVERT)
                s = tl.where(i2_ok[None, :], s_i2, s)
            # online softmax in base 2 (q carries sm_scale * log2 e); a row with no key so far keeps m = -inf
            p, alpha, m, l = softmax_update(s, (hp_ok | i2_ok)[None, :], m, l, 0.0, False)
            # rescale once here; both value products then add with factor 1 (each loads only its tier's
            # rows, the other tier's positions read as zero values)
            acc0 = acc0 * alpha[:, None]
            acc1 = acc1 * alpha[:, None]
            acc2 = acc2 * alpha[:, None]
            acc3 = acc3 * alpha[:, None]
            if n_hp > 0:
                acc0, acc1, acc2, acc3 = hp_values(p, one, acc0, acc1, acc2, acc3, HV_h, stride_hvr, rows, hp_ok,
                                                   QV, QVP, OP, PREC)
            if n_i2 > 0:
                acc0, acc1, acc2, acc3, corr, ref = int2_values(
                    p, one, acc0, acc1, acc2, acc3, corr, ref, VC_h, stride_vcs, VP_h, stride_vps, slots, i2_ok,
                    slots, i2_ok, A4, RB, C0, l0, l1, l2, l3, QV, QVP, GV, NGV, V_FAST, LM, OP, PREC, CONVERT, True)

    has = l > 0.0
    inv_l = tl.where(has, 1.0 / tl.where(has, l, 1.0), 0.0)
    ooff = n64 * stride_on + heads * stride_oh + sp.to(tl.int64) * stride_os
    store_quarters(O, ooff, rmask, acc0, acc1, acc2, acc3, inv_l, QV, QVP, OUT_DT)
    if not DIRECT:
        lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), NEG_INF)
        tl.store(LSE + n64 * stride_ln + heads * stride_lh + sp, lse, mask=rmask)


def _check_index(t, name: str, dev, shape) -> None:
    # the kernel reads entry i at offset i: a strided view would be misread, not rejected
    check_tensor(t, name, ndim=len(shape), dtypes=INDEX_DTYPES, device=dev, shape=shape, last_contiguous=True)


def block_sparse_attention(
    q: torch.Tensor,
    layout: Int2Layout,
    buffers: tuple,
    hp_index: torch.Tensor,
    req_to_token: torch.Tensor,
    row_req: torch.Tensor,
    row_len: torch.Tensor,
    blocks: torch.Tensor,
    *,
    block_size: int,
    sink: int,
    recent: int,
    sm_scale: float,
    sink_lens: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    debug: bool | None = None,
) -> torch.Tensor:
    """MiniMax-M3 block-sparse attention of query rows over one layer's two-tier cache.

    Semantics in the module docstring; the oracle is ``reference.attention.attend(..., window_mode=
    "decode" | "extend", key_mask=reference.sparse.block_topk_key_mask(blocks, positions, T, B))``
    (SGLang 0.5.16's ``minimax_sparse`` main attention, as cited in ``reference/sparse.py``).

    Args:
        q: ``[N, H_q, D_k]`` rotated queries (fp32; fp16 / bf16 accepted), one row per query token,
            last dim contiguous.
        layout: the layer's :class:`~.layout.Int2Layout`.
        buffers: ``(k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v)`` of the layer, as
            :class:`~.decode.plan.DecodePlan` takes them (``[slots | rows, H_kv, ...]``).
        hp_index: int ``[max_reqs, >= sink + recent]``: HP row of sink position ``p`` at entry ``p``, of
            recent position ``p`` at ``sink + p % recent`` (``-1`` = none).
        req_to_token: int ``[max_reqs, max_ctx]``: INT2 slot of each position.
        row_req: int ``[N]`` request pool index of each row.
        row_len: int ``[N]`` positions visible to the row (``< row_len``, the query at ``row_len - 1``,
            at most ``max_ctx``); ``0`` = padding row, whose output is zeros.
        blocks: int32 (or int64) ``[H_kv, N, k]`` selected block ids per kv head and row, any strides:
            ids ``>= 0`` name positions ``[id * B, (id + 1) * B)``, ``-1`` = unused. A block listed
            twice counts once (SGLang's lists hold none). Ids at or past ``ceil(row_len / B)`` (any
            value, e.g. a padding row's stale list) are ignored; debug mode still rejects ids outside
            ``[-1, ceil(max_ctx / B))``.
        block_size: ``B`` tokens per block (``sparse_block_size``), a power of two in 16..128.
        sink, recent: HP window sizes in tokens (the pool's); ``recent = 0`` for an extend chunk.
        sm_scale: softmax scale (natural units), finite and > 0.
        sink_lens: optional int ``[max_reqs]``: request ``r`` reads positions ``< min(sink_lens[r], sink)``
            from sink rows, the rest of ``[0, sink)`` through INT2 (as :class:`~.decode.plan.DecodePlan`).
        num_splits: splits of each row's block list (default :func:`block_sparse_num_splits` for
            extend rows when ``recent == 0``, else for decode rows), >= 1.
        out: optional ``[N, H_q, D_v]`` float output (last dim contiguous), else fp32 is allocated.
        debug: check index values (reads device memory; default ``SGLANG_OSCAR_DEBUG``).

    Returns:
        ``[N, H_q, D_v]`` (``out`` or fp32) in the rotated V frame.

    Raises:
        ValueError: shapes, dtypes, devices or strides that do not fit (``H_q`` not a multiple of ``H_kv``,
            ``blocks.shape[0] != H_kv``, ``blocks`` / ``row_req`` / ``row_len`` not ``N`` rows, ``row_req`` /
            ``row_len`` / ``sink_lens`` not contiguous), ``block_size``
            not a power of two in 16..128, ``hp_index`` narrower than ``sink + recent``, ``sm_scale`` not
            finite and > 0, ``num_splits < 1``; in debug mode, index values out of range.
    """
    if not isinstance(buffers, (tuple, list)) or len(buffers) != 6:
        raise ValueError("buffers must be the tuple (k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v) of one layer")
    k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v = buffers
    check_query(layout, q)
    check_tensor(k_codes, "k_codes", ndim=3)
    dev = k_codes.device
    if q.device != dev:
        raise ValueError(f"q is on {q.device} but the cache is on {dev}")
    n, hq, _ = q.shape
    hkv = check_cache(layout, dev, hq, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v, hp_index, req_to_token,
                      sink, recent, None, None)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be a power of two in 16..128 {BLOCK_SIZES}, got {block_size!r}")
    _check_index(row_req, "row_req", dev, (n,))
    _check_index(row_len, "row_len", dev, (n,))
    check_tensor(blocks, "blocks", ndim=3, dtypes=INDEX_DTYPES, device=dev)
    if blocks.shape[0] != hkv or blocks.shape[1] != n:
        raise ValueError(f"blocks has shape {tuple(blocks.shape)}; expected [H_kv={hkv}, N={n}, k] "
                         "(one block list per kv head and query row)")
    k = blocks.shape[2]
    if sink_lens is not None:
        check_tensor(sink_lens, "sink_lens", ndim=1, dtypes=INDEX_DTYPES, device=dev, last_contiguous=True)
    sm_scale = check_sm_scale(sm_scale)
    if num_splits is None:
        num_splits = block_sparse_num_splits(k, block_size, decode=recent > 0)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    dv = layout.v.head_dim
    if out is None:
        out = torch.empty(n, hq, dv, dtype=torch.float32, device=dev)
    else:
        check_tensor(out, "out", ndim=3, device=dev, shape=(n, hq, dv), last_contiguous=True)
        check_float(out, "out")
        check_out_dtype(out.dtype)
    if debug_enabled(debug):
        max_reqs, max_ctx = req_to_token.shape
        check_range(row_req, "row_req", 0, min(max_reqs, hp_index.shape[0]))
        check_range(row_len, "row_len", 0, max_ctx + 1)
        check_range(blocks, "blocks", -1, -(-max_ctx // block_size))
    if n == 0:
        return out

    op = resolve_mma_dtype(None, hp_k.dtype)
    group, hpb, bpk, block_h = plan_head_blocks(hq, hkv)
    direct = num_splits == 1
    if direct:
        o_buf, lse = out, out  # LSE unused: the one split's normalised output is the result
        o_strides = (out.stride(0), out.stride(1), 0)
        l_strides = (0, 0)
    else:
        o_buf = torch.empty(n, hq, num_splits, dv, dtype=torch.float32, device=dev)
        lse = torch.empty(n, hq, num_splits, dtype=torch.float32, device=dev)
        o_strides = o_buf.stride()[:3]
        l_strides = lse.stride()[:2]
    grid = (n, hkv * bpk, num_splits)
    _launch(_block_sparse_stage1, grid,
            *row_args(q, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v),
            hp_index, hp_index.stride(0), req_to_token, req_to_token.stride(0), row_req, row_len,
            hp_index if sink_lens is None else sink_lens,
            blocks, *blocks.stride(), k, -(-k // num_splits),
            o_buf, *o_strides, lse, *l_strides,
            sm_scale * LOG2E, sink, recent, *attn_constants(layout),
            GROUP=group, HEADS_PER_BLOCK=hpb, BLOCKS_PER_KV=bpk, BLOCK_H=block_h, **layout_constexprs(layout),
            OP=TORCH_TO_TL[op], PREC="ieee" if op == torch.float32 else None,
            CONVERT=effective_convert(CONVERT_ASM, op, False), IDX64=needs_idx64(*buffers),
            B=block_size, BLOCK_N=min(block_size, 64), DEDUP=min(64, max(16, next_pow2(k))),
            HAS_SINKL=sink_lens is not None, DIRECT=direct, OUT_DT=TORCH_TO_TL[o_buf.dtype], num_warps=4)
    if not direct:
        grid2, constexprs = merge_launch(n, hq, dv, num_splits)
        launch_merge(o_buf, lse, out, num_splits, grid2, constexprs)
    return out
