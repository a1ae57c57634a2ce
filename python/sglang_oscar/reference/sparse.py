"""MiniMax-M3 block-sparse attention in plain PyTorch: SGLang's block selection and the mask it implies.

A MiniMax-M3 sparse layer attends, per kv head, only to whole key blocks of ``B`` tokens picked
by a small "index" attention. This module re-implements, from SGLang 0.5.16's code (paths below
relative to ``sglang/``), what the indexer selects, so kernels and backends can be tested against a
selection they did not compute; the attention over the selection is :func:`.attention.attend` with
the per-kv-head mask of :func:`block_topk_key_mask`.

Selection contract (SGLang 0.5.16, Triton path; the MSA/SM100 path replaces only the main attention,
``srt/layers/attention/minimax_sparse_ops/minimax_sparse.py:118-121``):

1. **Index heads.** ``idx_q [T, H_idx, Di]`` (``H_idx`` = the rank's ``sparse_num_index_heads``)
   against **one** index kv head ``idx_k [T, 1, Di]`` (``srt/models/minimax_m3.py:1098-1099``; its pool
   has ``head_num=1``, ``srt/mem_cache/memory_pool.py:4697-4725``). Every index head reads the same
   keys (``gqa_group_size = H_idx``, ``kernels/ops/attention/minimax_sparse/decode/flash_with_topk_idx.py:791-792``,
   ``.../prefill/flash_with_topk_idx.py:461``).
2. **Scale.** The backend never passes ``idx_sm_scale`` (``srt/layers/attention/minimax_sparse_backend.py:324-349``,
   ``:461-486``), so it is ``Di ** -0.5`` (decode ``flash_with_topk_idx.py:794-795``, prefill ``:469-470``).
   The kernels keep scores in log2 units (``x * sm_scale * log2(e)``, decode ``:167``/``:385``, prefill
   ``:203``); this module uses natural units ``x = (idx_q . idx_k) * sm_scale``: both orders are the same.
3. **Block score**, per (index head, query at position ``p``, block ``c``), over the block's keys
   ``j <= p`` only (prefill causal mask ``:204-207``; decode keys ``j < seq_len = p + 1``, ``:165``/``:383``):
   ``"max"``: ``max_j x_j``; ``"lse"``: ``log(sum_j exp(x_j))`` (decode ``:174-181``/``:392-399``,
   prefill ``:212-221``; an all-masked block's NaN becomes ``-inf``). ``lse`` rewards blocks with many
   good keys, ``max`` only the best key. The query's own (partial) block counts its causal keys only.
4. **Candidates** are the blocks ``0 .. p // B`` (prefill ``valid_blocks = (p + B) // B``, ``:350``; decode
   ``ceil(seq_len / B)``, ``:90``/``:286``). **Forced blocks**: block ``c`` is "local" iff
   ``c >= p // B + 1 - local_blocks`` (the ``local_blocks`` blocks ending at the query's block) and
   then scores ``1e29``; otherwise "init" iff ``c < init_blocks``, scoring ``1e30`` (local wins when
   both: decode ``:407-412``, prefill ``:365-372``). Prefill asserts ``init_blocks + local_blocks <= topk``
   (``:466-468``), so every forced block is always selected; this module refuses the rest likewise.
5. **Top-k** per index head and query: the ``min(topk, p // B + 1)`` best candidates, front-packed,
   ``-1`` padded to ``topk`` (prefill ``:412-413`` over a ``-1``-filled buffer ``:535-540``; decode merge
   ``:747``; JIT radix select ``jit_kernel/csrc/minimax/minimax_decode_topk.cuh:266-268``, ``:292-295``).
   The order inside a list is not part of the contract: descending score (Triton bitonic sorts),
   unordered (JIT radix, the decode default when ``topk <= 32``, decode ``:822-825``), ascending (every
   block fits). **Ties** between equal real scores are broken by whichever kernel runs: unspecified.
6. **Index heads -> kv heads** (``minimax_sparse.py:111-117`` prefill, ``:234-246`` decode): with
   ``group = H_idx // H_kv > 1`` the lists are viewed ``[H_kv, group, T, topk]`` -- index heads
   ``h * group .. (h+1) * group - 1`` belong to kv head ``h`` -- and ``topk_index_reduce``
   (``kernels/ops/attention/minimax_sparse/common/index.py:4-67``) returns their union, ascending,
   deduplicated, ``-1`` padded to width ``k' = group * topk``. With ``group == 1`` the lists pass
   unchanged (``k' = topk``); ``H_idx < H_kv`` trips the main kernels' ``topk_idx.shape[0] == H_kv``
   asserts (``.../prefill/topk_sparse.py:287``, ``.../decode/topk_sparse.py:318``).
7. **Main attention** of kv head ``h`` (query heads ``h * G .. (h+1) * G - 1``, ``.../decode/topk_sparse.py:91``)
   reads the positions ``c * B + i`` of its selected blocks with ``pos <= p`` and ``pos < seq_len``
   (prefill ``.../prefill/topk_sparse.py:186-215``, decode ``.../decode/topk_sparse.py:162``): the
   visibility of :func:`block_topk_key_mask`.

The index branch's own output ``idx_o`` is dense causal attention of ``idx_q`` over the index keys
and values with the same scale (every key, no selection: decode ``:349-435``, prefill ``:237-273``);
it is not part of this module.
"""

from __future__ import annotations

import torch

from .masks import selection_mask

SCORE_TYPES = ("max", "lse")
INIT_SCORE = 1e30  # SGLang's forced score of an init block (flash_with_topk_idx.py:411)
LOCAL_SCORE = 1e29  # ... and of a local block, which wins over init when a block is both (:410-412)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_positions(q_positions: torch.Tensor, seq_len: int) -> None:
    """``q_positions`` must be an int ``[Tq]`` tensor of positions in ``[0, seq_len)``."""
    if not isinstance(q_positions, torch.Tensor) or q_positions.dim() != 1 or q_positions.dtype.is_floating_point \
            or q_positions.dtype == torch.bool or q_positions.is_complex():
        raise ValueError("q_positions must be an integer tensor [Tq]")
    if q_positions.numel() and (int(q_positions.min()) < 0 or int(q_positions.max()) >= seq_len):
        raise ValueError(f"q_positions must lie in [0, {seq_len})")


def _ascending_packed(member: torch.Tensor, width: int) -> torch.Tensor:
    """bool ``[..., N]`` membership -> int32 ``[..., width]``: the members' ids ascending, then ``-1``."""
    n = member.shape[-1]
    ids = torch.arange(n, device=member.device).expand_as(member)
    packed = torch.where(member, ids, n).sort(dim=-1).values  # non-members (= n) sort last
    packed = torch.where(packed == n, -1, packed)[..., :width]
    if packed.shape[-1] < width:
        packed = torch.cat([packed, packed.new_full((*packed.shape[:-1], width - packed.shape[-1]), -1)], dim=-1)
    return packed.to(torch.int32)


def block_topk_key_mask(blocks: torch.Tensor, q_positions: torch.Tensor, seq_len: int, block_size: int):
    """A per-kv-head :func:`.attention.attend` ``key_mask`` from block selections (MiniMax-M3).

    Key ``j`` is visible to (kv head ``h``, query ``i``) iff its block ``j // block_size`` is in
    ``blocks[h, i]``, ``j <= q_positions[i]`` and ``j < seq_len`` (SGLang's main sparse attention,
    module docstring item 7).

    Args:
        blocks: int ``[H_kv, Tq, k]`` absolute block ids per kv head and query (``-1`` = unused, any
            slot; a block listed twice counts once).
        q_positions: int ``[Tq]`` distinct positions in ``[0, seq_len)``; row ``i`` of ``blocks`` belongs
            to ``q_positions[i]``.
        seq_len: ``T``, keys at positions ``0 .. T-1``.
        block_size: ``B`` tokens per block (``sparse_block_size``).

    Returns:
        ``(pos [Tq'], t) -> bool [H_kv, Tq', t]`` (looked up by position, so chunked callers agree;
        ``t <= seq_len``).

    Raises:
        ValueError: wrong shapes or dtypes, repeated or out-of-range positions, a block id outside
            ``[-1, ceil(seq_len / B))``, or a selected block starting after its query (a causal
            indexer never selects one; a wrong id must fail loudly, not be masked away).
    """
    _check_int("seq_len", seq_len, 0)
    _check_int("block_size", block_size, 1)
    _check_positions(q_positions, seq_len)
    if not isinstance(blocks, torch.Tensor) or blocks.dtype.is_floating_point or blocks.dtype == torch.bool \
            or blocks.is_complex():
        raise ValueError("blocks must be an integer tensor [H_kv, Tq, k]")
    if blocks.dim() != 3 or blocks.shape[1] != q_positions.numel():
        raise ValueError(f"blocks {tuple(blocks.shape)} must be [H_kv, Tq={q_positions.numel()}, k]")
    num_blocks = -(-seq_len // block_size)
    idx = blocks.long().to(q_positions.device)
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_blocks):
        raise ValueError(f"block id out of range: ids must lie in [-1, {num_blocks}) for seq_len {seq_len} "
                         f"and block_size {block_size}")
    pos = q_positions.long()
    if bool((idx * block_size > pos.view(1, -1, 1)).any()):
        raise ValueError("a selected block starts after its query's position (blocks must be causal)")
    member = torch.zeros(*idx.shape[:2], num_blocks + 1, dtype=torch.bool, device=idx.device)
    member.scatter_(2, torch.where(idx < 0, num_blocks, idx), True)  # -1 lands in a dropped extra column
    keys = torch.arange(seq_len, device=idx.device)
    sel = member[..., keys // block_size] & (keys.view(1, 1, -1) <= pos.view(1, -1, 1))
    return selection_mask(sel, q_positions, "blocks")


def union_block_lists(blocks: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Per-index-head block lists -> per-kv-head lists: the union over each kv head's index heads.

    Index head ``i`` belongs to kv head ``i // (H_idx / kv_heads)`` (SGLang views ``[H_kv, group, T, k]``,
    ``minimax_sparse.py:115-116``); the result has the semantics of ``topk_index_reduce``
    (``common/index.py:4-67``): union, ascending, deduplicated, ``-1`` padded on the right.

    Args:
        blocks: int ``[H_idx, Tq, k]`` block ids, ``-1`` = unused.
        kv_heads: ``H_kv``, a divisor of ``H_idx``.

    Returns:
        int32 ``[H_kv, Tq, k']`` with ``k' = k`` when ``H_idx == H_kv`` (SGLang passes such lists
        through unchanged, in kernel order; here they come out ascending) else ``(H_idx / H_kv) * k``.

    Raises:
        ValueError: not an int ``[H_idx, Tq, k]`` tensor, ids below ``-1``, or ``kv_heads`` not dividing ``H_idx``.
    """
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 3 or blocks.dtype.is_floating_point \
            or blocks.dtype == torch.bool or blocks.is_complex():
        raise ValueError("blocks must be an integer tensor [H_idx, Tq, k]")
    _check_int("kv_heads", kv_heads, 1)
    h_idx, tq, k = blocks.shape
    if h_idx % kv_heads:
        raise ValueError(f"{h_idx} index heads do not split into {kv_heads} kv heads (SGLang needs H_idx % H_kv == 0)")
    idx = blocks.long()
    if idx.numel() and int(idx.min()) < -1:
        raise ValueError("block ids must be >= -1 (-1 = unused)")
    group = h_idx // kv_heads
    n = int(idx.max()) + 1 if idx.numel() else 0
    member = torch.zeros(kv_heads, group, tq, n + 1, dtype=torch.bool, device=idx.device)
    member.scatter_(3, torch.where(idx < 0, n, idx).view(kv_heads, group, tq, k), True)
    return _ascending_packed(member[..., :n].any(dim=1), k if group == 1 else group * k)


def minimax_block_scores(
    idx_q: torch.Tensor,
    idx_k: torch.Tensor,
    q_positions: torch.Tensor,
    *,
    block_size: int,
    init_blocks: int,
    local_blocks: int,
    score_type: str = "max",
    sm_scale: float | None = None,
) -> torch.Tensor:
    """SGLang's per-block index scores with the forced init/local values (module docstring items 1-4).

    Args:
        idx_q: float ``[Tq, H_idx, Di]`` index queries; idx_k: float ``[T, 1, Di]`` index keys of the
            whole sequence (one index kv head).
        q_positions: int ``[Tq]`` positions in ``[0, T)``; the query at ``p`` sees keys ``0 .. p``.
        block_size: ``B`` (``sparse_block_size``); init_blocks, local_blocks: forced block counts.
            From a config's token counts SGLang derives ``init_blocks = ceil(sparse_init_tokens / B)``
            and ``local_blocks = ceil(sparse_local_tokens / B) + 1`` when the block fields are unset
            (``srt/layers/attention/minimax_sparse_backend.py:50-66``): pass the derived counts.
        score_type: ``"max"`` or ``"lse"`` (``sparse_score_type``).
        sm_scale: scale of ``idx_q . idx_k`` (default ``Di ** -0.5``, what SGLang uses).

    Returns:
        fp32 ``[H_idx, Tq, ceil(T / B)]`` in natural-log units (SGLang stores ``log2(e)`` times these):
        ``1e29`` for local blocks, ``1e30`` for the other init blocks, the ``max``/``lse`` of the
        scaled causal scores for the other candidates, ``-inf`` for blocks after the query's block.

    Raises:
        ValueError: shapes, dtypes, non-finite inputs, positions or settings out of range.
    """
    if not isinstance(idx_q, torch.Tensor) or idx_q.dim() != 3 or not idx_q.dtype.is_floating_point:
        raise ValueError("idx_q must be a float tensor [Tq, H_idx, Di]")
    if not isinstance(idx_k, torch.Tensor) or idx_k.dim() != 3 or idx_k.shape[1] != 1 \
            or not idx_k.dtype.is_floating_point:
        raise ValueError("idx_k must be a float tensor [T, 1, Di]: MiniMax-M3's index has one kv head")
    if idx_q.shape[-1] != idx_k.shape[-1]:
        raise ValueError(f"idx_q head dim {idx_q.shape[-1]} != idx_k head dim {idx_k.shape[-1]}")
    if score_type not in SCORE_TYPES:
        raise ValueError(f"score_type must be one of {SCORE_TYPES}, got {score_type!r}")
    _check_int("block_size", block_size, 1)
    _check_int("init_blocks", init_blocks, 0)
    _check_int("local_blocks", local_blocks, 0)
    t = idx_k.shape[0]
    _check_positions(q_positions, t)
    if q_positions.numel() != idx_q.shape[0]:
        raise ValueError(f"q_positions has {q_positions.numel()} entries for {idx_q.shape[0]} queries")
    if not (bool(torch.isfinite(idx_q).all()) and bool(torch.isfinite(idx_k).all())):
        raise ValueError("idx_q and idx_k must be finite")
    scale = idx_q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if not scale > 0:
        raise ValueError(f"sm_scale must be > 0, got {sm_scale}")
    nb = -(-t // block_size)
    pos = q_positions.long().to(idx_q.device)
    x = torch.einsum("qhd,td->hqt", idx_q.float(), idx_k[:, 0].float().to(idx_q.device)) * scale
    keys = torch.arange(t, device=x.device)
    x = x.masked_fill(keys.view(1, 1, -1) > pos.view(1, -1, 1), float("-inf"))  # causal keys only
    x = torch.nn.functional.pad(x, (0, nb * block_size - t), value=float("-inf")).unflatten(-1, (nb, block_size))
    if score_type == "max":
        score = x.amax(dim=-1)
    else:
        score = torch.logsumexp(x, dim=-1)  # -inf for a block with no causal key
    c = torch.arange(nb, device=x.device).view(1, -1)
    last = (pos // block_size).view(-1, 1)  # the query's own block
    local = (c > last - local_blocks) & (c <= last)
    init = c < init_blocks
    score = torch.where(init, INIT_SCORE, score)
    score = torch.where(local, LOCAL_SCORE, score)
    return score.masked_fill(c > last, float("-inf"))


def minimax_block_selection(
    idx_q: torch.Tensor,
    idx_k: torch.Tensor,
    q_positions: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    init_blocks: int,
    local_blocks: int,
    score_type: str = "max",
    kv_heads: int,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The blocks SGLang 0.5.16's MiniMax-M3 indexer hands each kv head (module docstring).

    Args:
        idx_q, idx_k, q_positions, block_size, init_blocks, local_blocks, score_type, sm_scale: as in
            :func:`minimax_block_scores`.
        topk: blocks per index head (``sparse_topk_blocks``); must be ``>= init_blocks + local_blocks``.
        kv_heads: ``H_kv`` of the main attention (per rank), a divisor of ``H_idx``; ``kv_heads = H_idx``
            gives the per-index-head lists.

    Returns:
        int32 ``[H_kv, Tq, k']``, ``k' = topk`` if ``H_idx == H_kv`` else ``(H_idx / H_kv) * topk``:
        absolute block ids, ascending, front-packed, ``-1`` padded (per index head
        ``min(topk, p // B + 1)`` blocks, then the union of each kv head's index heads). SGLang's
        order within a list may differ (only the set is its contract) and equal scores make its
        choice unspecified: compare sets, on data without ties.

    Raises:
        ValueError: as :func:`minimax_block_scores`; ``topk < init_blocks + local_blocks`` (SGLang's
            prefill assert), or ``kv_heads`` not dividing ``H_idx``.
    """
    _check_int("topk", topk, 1)
    _check_int("kv_heads", kv_heads, 1)
    _check_int("init_blocks", init_blocks, 0)
    _check_int("local_blocks", local_blocks, 0)
    if init_blocks + local_blocks > topk:
        raise ValueError(f"init_blocks + local_blocks = {init_blocks + local_blocks} exceeds topk = {topk} "
                         "(SGLang's prefill indexer asserts init_blocks + local_blocks <= topk)")
    if not isinstance(idx_q, torch.Tensor) or idx_q.dim() != 3 or idx_q.shape[1] % kv_heads:
        raise ValueError(f"idx_q must be [Tq, H_idx, Di] with H_idx a multiple of kv_heads={kv_heads}")
    score = minimax_block_scores(idx_q, idx_k, q_positions, block_size=block_size, init_blocks=init_blocks,
                                 local_blocks=local_blocks, score_type=score_type, sm_scale=sm_scale)
    h_idx, tq, nb = score.shape
    k = min(topk, nb)
    best = score.topk(k, dim=-1).indices  # [H_idx, Tq, k], ties broken arbitrarily (as SGLang's)
    # a query at p has p // B + 1 candidates: when that is below topk every one is taken and the
    # extra picks are -inf blocks after it, dropped here
    n_cand = (q_positions.long().to(score.device) // block_size + 1).view(1, -1, 1)
    rank = torch.arange(k, device=score.device).view(1, 1, -1)
    member = torch.zeros(h_idx, tq, nb, dtype=torch.bool, device=score.device)
    member.scatter_(2, best, (rank < n_cand).expand_as(best))
    per_head = _ascending_packed(member, topk)
    return per_head if kv_heads == h_idx else union_block_lists(per_head, kv_heads)

