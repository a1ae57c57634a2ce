"""MiniMax-M3 block selection and block masks (``reference/sparse.py``) and ``attend``'s per-kv-head mask.

Known answers are hand-built: ``idx_q`` rows are ``2 e_h`` (index head ``h`` reads coordinate ``h`` of
the keys) and ``Di = 4``, so with SGLang's scale ``Di ** -0.5 = 0.5`` the natural score of key ``j``
for head ``h`` is exactly ``idx_k[j, 0, h]``. Every designed score is distinct (SGLang's tie-breaking
is unspecified). The random cross-check uses a brute force written per query and per block in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from sglang_oscar.reference import (
    block_topk_key_mask,
    minimax_block_scores,
    minimax_block_selection,
    union_block_lists,
)
from sglang_oscar.reference.attention import attend
from sglang_oscar.reference.latent import topk_key_mask

NEG = float("-inf")


def _index(key_scores):
    """``key_scores [T, H_idx]`` natural scores -> ``(idx_q [1, H_idx, 4], idx_k [T, 1, 4])``, H_idx <= 4."""
    key_scores = torch.as_tensor(key_scores, dtype=torch.float32)
    t, h = key_scores.shape
    idx_q = torch.zeros(1, h, 4)
    idx_q[0, torch.arange(h), torch.arange(h)] = 2.0  # 2 * 0.5 = 1: the score is the key's coordinate
    idx_k = torch.zeros(t, 1, 4)
    idx_k[:, 0, :h] = key_scores
    return idx_q, idx_k


def _select(key_scores, positions, **kw):
    idx_q, idx_k = _index(key_scores)
    pos = torch.tensor(positions)
    return minimax_block_selection(idx_q.expand(len(positions), -1, -1), idx_k, pos, **kw)


def _blocks_of(values, block_size=4):
    """Per-block key values -> a flat key tensor (block ``c`` holds ``values[c]``)."""
    return [v for block in values for v in (block if isinstance(block, (list, tuple)) else [block] * block_size)]


# ---------------------------------------------------------------------------- block scores


def test_block_scores_max_and_lse_known_values():
    # 3 blocks of 4 keys; the query at 9 sees keys 0..9: block 2 holds 8, 9 (10, 11 are in its future)
    keys = [0.5, -1.0, 0.25, 0.0, 1.5, 1.0, -2.0, 0.75, -0.5, 0.125, 100.0, 90.0]
    idx_q, idx_k = _index([[v] for v in keys])
    kw = dict(block_size=4, init_blocks=0, local_blocks=0)
    got = minimax_block_scores(idx_q, idx_k, torch.tensor([9]), score_type="max", **kw)
    assert got.dtype == torch.float32 and tuple(got.shape) == (1, 1, 3)
    assert got[0, 0].tolist() == [0.5, 1.5, 0.125]  # 100 and 90 are not causal for position 9

    lse = minimax_block_scores(idx_q, idx_k, torch.tensor([9]), score_type="lse", **kw)
    want = [math.log(sum(math.exp(x) for x in keys[a:b])) for a, b in ((0, 4), (4, 8), (8, 10))]
    torch.testing.assert_close(lse[0, 0], torch.tensor(want), rtol=1e-6, atol=0)


def test_block_scores_scale_default_and_forced_values():
    keys = [[0.5], [1.0], [2.0], [3.0], [-1.0], [0.0], [4.0], [0.25]]  # 4 blocks of 2
    idx_q, idx_k = _index(keys)
    pos = torch.tensor([0, 3, 7])
    got = minimax_block_scores(idx_q.expand(3, -1, -1), idx_k, pos, block_size=2, init_blocks=2, local_blocks=1)
    # position 0: block 0 is init and local -> local's 1e29 (SGLang: local wins); later blocks -inf
    # position 3: block 0 init, block 1 init and local -> 1e29
    # position 7: blocks 0, 1 init, block 2 scored (max(0, -1) = 0), block 3 local
    want = torch.tensor([[1e29, NEG, NEG, NEG], [1e30, 1e29, NEG, NEG], [1e30, 1e30, 0.0, 1e29]])
    assert torch.equal(got[0], want)
    # an explicit scale replaces Di ** -0.5: block maxima 1, 3 of (2 e_0) . k -> 2 * 2 * [1, 3]
    scaled = minimax_block_scores(idx_q, idx_k, torch.tensor([3]), block_size=2, init_blocks=0, local_blocks=0,
                                  sm_scale=2.0)
    assert scaled[0, 0].tolist() == [4.0 * 1.0, 4.0 * 3.0, NEG, NEG]


# ---------------------------------------------------------------------------- selection


# 6 blocks of 4 keys, two index heads: head 0 ranks blocks 2 > 4 > 1 > 3, head 1 ranks 3 > 1 > 4 > 2
# (block 0 is init, the query's block is local; their own scores never matter)
_TWO_HEADS = list(zip(_blocks_of([0.0, 1.0, 5.0, 0.5, 3.0, 0.0]), _blocks_of([0.0, 4.0, 0.5, 6.0, 2.0, 0.0])))


def test_selection_known_answer_per_index_head():
    pos = [2, 5, 9, 13, 23]
    got = _select(_TWO_HEADS, pos, block_size=4, topk=3, init_blocks=1, local_blocks=1, kv_heads=2)
    assert got.dtype == torch.int32 and tuple(got.shape) == (2, 5, 3)
    assert got[0].tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 2, 3], [0, 2, 5]]
    assert got[1].tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 1, 3], [0, 3, 5]]


def test_selection_forced_init_and_local_windows():
    pos = [13, 23]
    # two local blocks end at the query's block, whatever the scores: 2, 3 for position 13; 4, 5 for 23
    got = _select(_TWO_HEADS, pos, block_size=4, topk=3, init_blocks=1, local_blocks=2, kv_heads=2)
    assert got.tolist() == [[[0, 2, 3], [0, 4, 5]], [[0, 2, 3], [0, 4, 5]]]
    # two init blocks and no local block: the query's own block competes on its causal keys
    got = _select(_TWO_HEADS, pos, block_size=4, topk=3, init_blocks=2, local_blocks=0, kv_heads=2)
    assert got.tolist() == [[[0, 1, 2], [0, 1, 2]], [[0, 1, 3], [0, 1, 3]]]
    # nothing forced: the plain top-3 of the scores (head 0: 2 > 4 > 1, head 1: 3 > 1 > 4)
    got = _select(_TWO_HEADS, [23], block_size=4, topk=3, init_blocks=0, local_blocks=0, kv_heads=2)
    assert got.tolist() == [[[1, 2, 4]], [[1, 3, 4]]]


def test_selection_counts_causal_keys_only():
    # block 3 (keys 12..15) holds a huge score at key 14; block 2 scores 3, block 3's keys 12, 13 score 1
    keys = [[v] for v in _blocks_of([0.0, 0.0, 3.0, [1.0, 1.0, 50.0, 0.0]])]
    kw = dict(block_size=4, topk=1, init_blocks=0, local_blocks=0, kv_heads=1)
    assert _select(keys, [13], **kw).tolist() == [[[2]]]  # key 14 is after the query
    assert _select(keys, [14], **kw).tolist() == [[[3]]]


def test_lse_and_max_select_different_blocks():
    # block 1: one key at 3 (max 3, lse ~ 3); block 2: four keys at 2.5 (max 2.5, lse = 2.5 + ln 4 ~ 3.89)
    keys = [[v] for v in _blocks_of([0.0, [3.0, -10.0, -10.0, -10.0], 2.5, 0.0])]
    kw = dict(block_size=4, topk=3, init_blocks=1, local_blocks=1, kv_heads=1)
    assert _select(keys, [15], score_type="max", **kw).tolist() == [[[0, 1, 3]]]
    assert _select(keys, [15], score_type="lse", **kw).tolist() == [[[0, 2, 3]]]


def test_union_reduce_four_index_heads_to_two_kv_heads():
    # each head picks block 0 (init) and its best other block; heads 0, 1 -> kv 0 and heads 2, 3 -> kv 1
    best = [2, 4, 4, 1]
    scores = [[5.0 if c == best[h] else 0.1 * c for h in range(4)] for c in range(6)]
    keys = [row for row in scores for _ in range(4)]
    got = _select(keys, [1, 5, 23], block_size=4, topk=2, init_blocks=1, local_blocks=0, kv_heads=2)
    assert tuple(got.shape) == (2, 3, 4)  # k' = (4 / 2) * topk
    assert got[0].tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 2, 4, -1]]
    assert got[1].tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 4, -1]]
    # one kv head: the union of all four lists, width 4 * 2
    one = _select(keys, [23], block_size=4, topk=2, init_blocks=1, local_blocks=0, kv_heads=1)
    assert one.tolist() == [[[0, 1, 2, 4, -1, -1, -1, -1]]]


def test_union_block_lists_direct():
    lists = torch.tensor([[[3, 1, -1]], [[1, 5, 3]], [[2, -1, 2]], [[-1, -1, -1]]], dtype=torch.int32)
    assert union_block_lists(lists, 2).tolist() == [[[1, 3, 5, -1, -1, -1]], [[2, -1, -1, -1, -1, -1]]]
    assert union_block_lists(lists, 1).tolist() == [[[1, 2, 3, 5] + [-1] * 8]]
    # as many kv heads as index heads: the lists themselves, ascending and deduplicated, width topk
    assert union_block_lists(lists, 4).tolist() == [[[1, 3, -1]], [[1, 3, 5]], [[2, -1, -1]], [[-1, -1, -1]]]
    with pytest.raises(ValueError, match="do not split"):
        union_block_lists(lists, 3)
    with pytest.raises(ValueError, match=">= -1"):
        union_block_lists(lists - 2, 2)
    with pytest.raises(ValueError, match="integer"):
        union_block_lists(lists.float(), 2)


def _brute_selection(idx_q, idx_k, pos, block_size, topk, init, local, score_type, kv_heads):
    """float64, one query, head and block at a time (never calls the module).

    Returns ``(lists, gap)``: the expected ``[H_kv, Tq, k']`` lists and the smallest score gap between
    the last block taken and the first one left out (the data must keep it far above fp32 rounding).
    """
    h_idx, di = idx_q.shape[1], idx_q.shape[2]
    group = h_idx // kv_heads
    out, gap = [], math.inf
    for kv in range(kv_heads):
        rows = []
        for qi, p in enumerate(pos):
            union = set()
            for h in range(kv * group, (kv + 1) * group):
                last = p // block_size
                cand = {}
                for c in range(last + 1):
                    xs = [float(idx_q[qi, h].double() @ idx_k[j, 0].double()) / math.sqrt(di)
                          for j in range(c * block_size, min((c + 1) * block_size, p + 1))]
                    s = max(xs) if score_type == "max" else math.log(sum(math.exp(x) for x in xs))
                    if c > last - local:
                        s = 1e29
                    elif c < init:
                        s = 1e30
                    cand[c] = s
                ranked = sorted(cand, key=lambda c: -cand[c])
                union |= set(ranked[:topk])
                if len(ranked) > topk:
                    gap = min(gap, cand[ranked[topk - 1]] - cand[ranked[topk]])
            width = topk if group == 1 else group * topk
            rows.append(sorted(union) + [-1] * (width - len(union)))
        out.append(rows)
    return out, gap


@pytest.mark.parametrize("score_type", ["max", "lse"])
@pytest.mark.parametrize("kv_heads,init,local", [(1, 1, 1), (2, 2, 1), (4, 0, 2), (2, 0, 0)])
def test_selection_matches_brute_force(score_type, kv_heads, init, local):
    g = torch.Generator().manual_seed(17 + 3 * kv_heads + init + 5 * local)
    t, b, topk = 45, 4, 4  # 12 blocks, the last one partial
    idx_q = torch.randn(7, 4, 8, generator=g)
    idx_k = torch.randn(t, 1, 8, generator=g)
    pos = [0, 3, 12, 15, 29, 40, 44]
    got = minimax_block_selection(idx_q, idx_k, torch.tensor(pos), block_size=b, topk=topk, init_blocks=init,
                                  local_blocks=local, score_type=score_type, kv_heads=kv_heads)
    want, gap = _brute_selection(idx_q, idx_k, pos, b, topk, init, local, score_type, kv_heads)
    assert gap > 1e-3  # no near-tie at any cut: fp32 and float64 must agree on every choice
    assert got.tolist() == want


def test_selection_refuses_bad_inputs():
    idx_q, idx_k = _index([[0.0]] * 8)
    kw = dict(block_size=4, topk=2, init_blocks=1, local_blocks=1, kv_heads=1)
    pos = torch.tensor([7])
    with pytest.raises(ValueError, match="exceeds topk"):
        minimax_block_selection(idx_q, idx_k, pos, **{**kw, "local_blocks": 2})
    with pytest.raises(ValueError, match="one kv head"):
        minimax_block_selection(idx_q, idx_k.expand(-1, 2, -1), pos, **kw)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        minimax_block_selection(idx_q, idx_k, pos, **{**kw, "kv_heads": 2})
    with pytest.raises(ValueError, match="score_type"):
        minimax_block_selection(idx_q, idx_k, pos, score_type="mean", **kw)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        minimax_block_selection(idx_q, idx_k, torch.tensor([8]), **kw)
    with pytest.raises(ValueError, match="integer"):
        minimax_block_selection(idx_q, idx_k, torch.tensor([7.0]), **kw)
    with pytest.raises(ValueError, match="finite"):
        minimax_block_selection(idx_q * float("nan"), idx_k, pos, **kw)
    with pytest.raises(ValueError, match="block_size"):
        minimax_block_selection(idx_q, idx_k, pos, **{**kw, "block_size": 0})


# ---------------------------------------------------------------------------- masks


def test_block_mask_known_visibility():
    # seq_len 10, blocks of 4: block 0 = keys 0..3, block 1 = 4..7, block 2 = 8..9
    blocks = torch.tensor([[[0, -1], [2, 2]], [[1, -1], [1, 0]]])  # [H_kv=2, Tq=2, k=2]
    pos = torch.tensor([5, 9])
    m = block_topk_key_mask(blocks, pos, 10, 4)
    got = m(pos, 10)

    def row(*keys):
        return [j in keys for j in range(10)]

    assert got.dtype == torch.bool and tuple(got.shape) == (2, 2, 10)
    assert got.tolist() == [
        [row(0, 1, 2, 3), row(8, 9)],  # a block listed twice counts once
        [row(4, 5), row(*range(8))],  # 6, 7 are after position 5
    ]
    # looked up by position (chunked callers ask in any order), and cut to the first t keys
    assert m(torch.tensor([9, 5]), 10).tolist() == [[got[0, 1].tolist(), got[0, 0].tolist()],
                                                    [got[1, 1].tolist(), got[1, 0].tolist()]]
    assert torch.equal(m(pos, 6), got[..., :6])
    with pytest.raises(ValueError, match="seq_len 10"):
        m(pos, 11)


def test_block_mask_refuses_bad_selections():
    pos = torch.tensor([5, 9])
    ok = torch.tensor([[[0, 1], [2, -1]]])
    block_topk_key_mask(ok, pos, 10, 4)  # block 1 starts at 4 <= 5: allowed (its keys 6, 7 are masked)
    with pytest.raises(ValueError, match="after its query"):
        block_topk_key_mask(torch.tensor([[[2, -1], [0, -1]]]), pos, 10, 4)  # block 2 starts at 8 > 5
    with pytest.raises(ValueError, match="out of range"):
        block_topk_key_mask(torch.tensor([[[0, -1], [3, -1]]]), pos, 10, 4)  # only blocks 0..2 exist
    with pytest.raises(ValueError, match="out of range"):
        block_topk_key_mask(torch.tensor([[[0, -2], [0, -1]]]), pos, 10, 4)
    with pytest.raises(ValueError, match="integer"):
        block_topk_key_mask(ok.float(), pos, 10, 4)
    with pytest.raises(ValueError, match="integer"):
        block_topk_key_mask(ok.bool(), pos, 10, 4)
    with pytest.raises(ValueError, match=r"\[H_kv, Tq=2, k\]"):
        block_topk_key_mask(ok[0], pos, 10, 4)
    with pytest.raises(ValueError, match=r"\[H_kv, Tq=2, k\]"):
        block_topk_key_mask(ok[:, :1], pos, 10, 4)
    with pytest.raises(ValueError, match="distinct"):
        block_topk_key_mask(ok, torch.tensor([9, 9]), 10, 4)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        block_topk_key_mask(ok, torch.tensor([5, 10]), 10, 4)
    with pytest.raises(ValueError, match="block_size"):
        block_topk_key_mask(ok, pos, 10, 0)


# ---------------------------------------------------------------------------- attend with per-kv-head masks


def _two_tier(seed, tq=6, hq=12, hkv=3, t=37, d=16, dv=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, d, generator=g)
    k_hp, v_hp = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, dv, generator=g)
    k_low = k_hp + 0.1 * torch.randn(t, hkv, d, generator=g)
    v_low = v_hp + 0.1 * torch.randn(t, hkv, dv, generator=g)
    return g, q, k_hp, v_hp, k_low, v_low


def _random_blocks(g, hkv, pos, block_size, k):
    blocks = torch.full((hkv, len(pos), k), -1, dtype=torch.int32)
    for h in range(hkv):
        for i, p in enumerate(pos):
            sel = torch.randperm(p // block_size + 1, generator=g)[: k - 1]
            blocks[h, i, : sel.numel()] = sel.int()
    return blocks


def test_attend_per_head_mask_equals_per_kv_head_runs():
    g, q, k_hp, v_hp, k_low, v_low = _two_tier(5)
    pos = [3, 10, 17, 25, 30, 36]
    mask = block_topk_key_mask(_random_blocks(g, 3, pos, 4, 4), torch.tensor(pos), 37, 4)
    sinks = torch.randn(12, generator=g)
    kw = dict(sink=2, recent=5, sm_scale=0.3, logit_cap=4.0)
    full = attend(q, torch.tensor(pos), k_hp, v_hp, k_low, v_low, sinks=sinks, key_mask=mask, **kw)
    for h in range(3):
        heads = slice(4 * h, 4 * h + 4)
        part = attend(q[:, heads], torch.tensor(pos), k_hp[:, h:h + 1], v_hp[:, h:h + 1], k_low[:, h:h + 1],
                      v_low[:, h:h + 1], sinks=sinks[heads], key_mask=lambda p, t, h=h: mask(p, t)[h], **kw)
        assert torch.equal(full[:, heads], part)
    # the per-head masks differ, so the heads really saw different keys: a shared mask changes the answer
    shared = attend(q, torch.tensor(pos), k_hp, v_hp, k_low, v_low, sinks=sinks, key_mask=lambda p, t: mask(p, t)[0],
                    **kw)
    assert torch.equal(shared[:, :4], full[:, :4]) and not torch.allclose(shared[:, 4:], full[:, 4:])


def test_attend_selection_of_every_block_is_dense():
    g, q, k_hp, v_hp, k_low, v_low = _two_tier(6)
    pos = torch.tensor([0, 7, 8, 21, 36])
    kw = dict(sink=3, recent=6, sm_scale=0.25, window_mode="decode")
    dense = attend(q[:5], pos, k_hp, v_hp, k_low, v_low, **kw)
    every = torch.full((3, 5, 12), -1, dtype=torch.int32)
    for i, p in enumerate(pos.tolist()):
        every[:, i, : p // 4 + 1] = torch.randperm(p // 4 + 1, generator=g).int()  # any order
    assert torch.equal(attend(q[:5], pos, k_hp, v_hp, k_low, v_low,
                              key_mask=block_topk_key_mask(every, pos, 37, 4), **kw), dense)
    # the same through the indexer: topk at least the number of blocks selects them all
    idx_q, idx_k = torch.randn(5, 6, 8, generator=g), torch.randn(37, 1, 8, generator=g)
    sel = minimax_block_selection(idx_q, idx_k, pos, block_size=4, topk=10, init_blocks=1, local_blocks=1,
                                  score_type="lse", kv_heads=3)
    assert tuple(sel.shape) == (3, 5, 20)
    assert torch.equal(attend(q[:5], pos, k_hp, v_hp, k_low, v_low,
                              key_mask=block_topk_key_mask(sel, pos, 37, 4), **kw), dense)


def test_attend_block_selection_against_brute_force():
    g, q, k_hp, v_hp, _, _ = _two_tier(7)
    pos = [9, 22, 36]
    blocks = _random_blocks(g, 3, pos, 4, 3)
    out = attend(q[:3], torch.tensor(pos), k_hp, v_hp, None, None, sink=0, recent=0, sm_scale=0.3,
                 key_mask=block_topk_key_mask(blocks, torch.tensor(pos), 37, 4))
    for i, p in enumerate(pos):
        for hq in range(12):
            h = hq // 4
            chosen = set(blocks[h, i].tolist()) - {-1}
            keys = [j for j in range(p + 1) if j // 4 in chosen]
            w = torch.softmax(k_hp[keys, h].double() @ q[i, hq].double() * 0.3, dim=0)
            torch.testing.assert_close(out[i, hq].double(), w @ v_hp[keys, h].double(), rtol=1e-5, atol=1e-6)


def test_attend_shared_mask_unchanged_and_equal_to_repeated_per_head_mask():
    g, q, k_hp, v_hp, k_low, v_low = _two_tier(8)
    pos = torch.tensor([12, 20, 36])
    topk = torch.full((3, 6), -1)
    for i, p in enumerate(pos.tolist()):
        topk[i, :5] = torch.randperm(p + 1, generator=g)[:5]
    shared = topk_key_mask(topk, pos, 37)
    kw = dict(sink=2, recent=4, sm_scale=0.3)
    a = attend(q[:3], pos, k_hp, v_hp, k_low, v_low, key_mask=shared, **kw)
    b = attend(q[:3], pos, k_hp, v_hp, k_low, v_low, key_mask=lambda p, t: shared(p, t).expand(3, -1, -1), **kw)
    assert torch.equal(a, b)
    # the shared mask restricts: against brute force with HP everywhere
    out = attend(q[:3], pos, k_hp, v_hp, None, None, sink=0, recent=0, sm_scale=0.3, key_mask=shared)
    for i, p in enumerate(pos.tolist()):
        keys = sorted(set(topk[i].tolist()) - {-1})
        for hq in range(12):
            w = torch.softmax(k_hp[keys, hq // 4].double() @ q[i, hq].double() * 0.3, dim=0)
            torch.testing.assert_close(out[i, hq].double(), w @ v_hp[keys, hq // 4].double(), rtol=1e-5, atol=1e-6)


def test_attend_refuses_bad_key_masks():
    _, q, k_hp, v_hp, _, _ = _two_tier(9)
    pos = torch.tensor([20, 36])
    kw = dict(sink=0, recent=0, sm_scale=0.3)
    with pytest.raises(ValueError, match="expected"):
        attend(q[:2], pos, k_hp, v_hp, None, None, key_mask=lambda p, t: torch.ones(2, p.numel(), t, dtype=torch.bool),
               **kw)
    with pytest.raises(ValueError, match="expected"):
        attend(q[:2], pos, k_hp, v_hp, None, None, key_mask=lambda p, t: torch.ones(1, t, dtype=torch.bool), **kw)
    # kv head 1 keeps only block 6 (keys 24..27) for the query at 20: no visible key for that head
    blocks = torch.tensor([[[0], [0]], [[6], [6]], [[0], [0]]])
    with pytest.raises(ValueError, match="after its query"):
        block_topk_key_mask(blocks, pos, 37, 4)

    def none_for_head1(p, t):
        keep = torch.ones(3, p.numel(), t, dtype=torch.bool)
        keep[1] = False
        return keep

    with pytest.raises(ValueError, match="no visible key"):
        attend(q[:2], pos, k_hp, v_hp, None, None, key_mask=none_for_head1, **kw)
