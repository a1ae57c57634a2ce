"""MiniMax-M3 block-sparse attention kernel (kernels/sparse.py) vs the oracle: ``reference.attention.attend``
with the per-kv-head ``key_mask`` of ``reference.sparse.block_topk_key_mask``, on the interpreter.

Pools hold requests at random non-contiguous slots / HP rows with every unused slot and row poisoned
(kv_fixtures.build_pool), so a position read from the wrong tier or place shows up as NaN or a
large error. fp32 HP rows and fp32 MMAs must match the oracle to rel. L2 < 1e-4. Selections are
random per kv head and row (the query's own block always in, as SGLang's forced local block), with
``-1`` padding at random places; windows are chosen so that blocks straddle the sink and the recent
boundaries and the query's own block is partial.
"""

from __future__ import annotations

import pytest
import torch
from gpu_sizes import DEV, GPU_RECENT, GPU_SINK, scaled
from kv_fixtures import build_pool, fresh_seed, make_config, poison_, rel_l2, rotate_q, run_decode
from sglang_oscar.kernels import block_sparse_attention
from sglang_oscar.reference.attention import attend
from sglang_oscar.reference.sparse import block_topk_key_mask

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def random_blocks(hkv: int, positions, k: int, block_size: int, *, pad: int = 1, dup: bool = False) -> torch.Tensor:
    """int32 ``[hkv, len(positions), k]``: per kv head and row, the query's own block plus distinct random
    earlier blocks (at most ``k - pad``), shuffled, ``-1`` in the other slots; with ``dup`` one row's
    list repeats a block (the oracle counts it once)."""
    out = torch.full((hkv, len(positions), k), -1, dtype=torch.int32)
    for h in range(hkv):
        for i, p in enumerate(positions):
            own = p // block_size
            others = torch.randperm(own)[: max(0, k - pad - 1)]
            chosen = torch.cat([torch.tensor([own]), others])
            out[h, i, torch.randperm(k)[: chosen.numel()]] = chosen.to(torch.int32)
    if dup:
        row = out[0, 0]
        free = (row < 0).nonzero().flatten()
        assert free.numel(), "no -1 slot left for the duplicate"
        row[free[0]] = row[row >= 0][0]
    return out


def oracle(pool, r: int, q_rot: torch.Tensor, positions, blocks: torch.Tensor, block_size: int, *, sink: int,
           recent: int, mode: str, sm_scale: float, sink_len: int | None = None) -> torch.Tensor:
    """Oracle rows of request ``r``: ``attend`` over its cache with the block mask. ``sink_len``: read
    positions ``[sink_len, sink)`` through INT2 (the kernel's tier rule with a short sink arena)."""
    cache = pool.caches[r]
    pos = torch.as_tensor(positions, dtype=torch.int64, device=q_rot.device)
    t = int(pos.max()) + 1
    hp_masks = None
    if sink_len is not None:
        def hp_masks(qp, tt):
            j = torch.arange(tt, device=qp.device).view(1, -1)
            hp = (j < min(sink_len, sink)) | (j >= torch.clamp(qp.view(-1, 1) + 1 - recent, min=sink))
            return hp, hp
    return attend(q_rot, pos, cache.k_hp[:t], cache.v_hp[:t], cache.k_deq[:t], cache.v_deq[:t], sink=sink,
                  recent=recent, sm_scale=sm_scale, window_mode=mode, hp_masks=hp_masks,
                  key_mask=block_topk_key_mask(blocks.to(pos.device), pos, t, block_size))


def run_sparse(pool, q_rot, row_req, row_len, blocks, block_size, *, sink, recent, sm_scale, **kw):
    out = poison_(torch.empty(q_rot.shape[0], q_rot.shape[1], pool.layout.v.head_dim, device=q_rot.device))
    o = block_sparse_attention(q_rot, pool.layout, (pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs,
                               pool.hp_k, pool.hp_v), pool.hp_index, pool.req_to_token, row_req, row_len, blocks,
                               block_size=block_size, sink=sink, recent=recent, sm_scale=sm_scale, out=out,
                               **{"debug": True, **kw})
    assert o is out and not bool(torch.isnan(o).any()), "output not fully written (NaN left)"
    return o


def decode_case(lens, hq, hkv, d, block_size, k, *, sink, recent, quantizer="uniform", group=None, dup=False):
    cfg = make_config(sink=sink, recent=recent, quantizer=quantizer, group_size=group)
    pool = build_pool(lens, hkv, d, d, cfg, hp_dtype=torch.float32)
    q_rot = rotate_q(pool, torch.randn(len(lens), hq, d) * 2)
    pos = [L - 1 for L in lens]
    blocks = random_blocks(hkv, pos, k, block_size, pad=1, dup=dup)
    return pool, q_rot, blocks


# lens, hq, hkv, d, B, k, sink, recent, quantizer, group: windows not multiples of B (blocks straddle
# the sink and the recent boundary), lengths not multiples of B (partial own block)
DECODE_CASES = [
    ([150, 97, 203], 4, 2, 64, 16, 6, 20, 50, "uniform", None),  # GQA 2
    ([130, 61], 16, 2, 64, 32, 4, 8, 40, "lloyd-max", 32),  # GQA 8, fine groups (general INT2 path)
    ([290, 200], 4, 2, 128, 128, 3, 20, 150, "uniform", None),  # D 128, B 128: a block holds all three tiers
]


@pytest.mark.parametrize("lens,hq,hkv,d,bs,k,sink,recent,quantizer,group", DECODE_CASES)
def test_block_sparse_decode_matches_the_oracle(lens, hq, hkv, d, bs, k, sink, recent, quantizer, group):
    """A decode step (one row per request at ``L - 1``, the pool's recent window): each kv head reads only
    its own selected blocks, each position from its tier; a block listed twice counts once."""
    fresh_seed()
    pool, q_rot, blocks = decode_case(lens, hq, hkv, d, bs, k, sink=sink, recent=recent, quantizer=quantizer,
                                      group=group, dup=True)
    assert not torch.equal(blocks[0], blocks[1]), "the kv heads should select differently"
    scale = d ** -0.5
    o = run_sparse(pool, q_rot, pool.req_pool_indices, pool.seq_lens, blocks, bs, sink=sink, recent=recent,
                   sm_scale=scale)
    ref = torch.cat([oracle(pool, r, q_rot[r:r + 1], [L - 1], blocks[:, r:r + 1], bs, sink=sink, recent=recent,
                            mode="decode", sm_scale=scale) for r, L in enumerate(lens)])
    assert rel_l2(o, ref) < 1e-4


def test_block_sparse_split_count_invariance_and_sink_arena_miss():
    """1 and 3 splits agree to fp32 summation order; with ``sink_lens`` below ``sink`` (3, 0, 7) the later
    sink positions are read through INT2, as the oracle with that tier rule (and unlike the full sink) --
    also those at or past ``L - recent`` in a short request (50 < sink + recent: never from the ring)."""
    fresh_seed()
    lens, sink, recent, bs = [120, 77, 50], 20, 40, 16
    pool, q_rot, blocks = decode_case(lens, 8, 2, 64, bs, 7, sink=sink, recent=recent)
    blocks[:, :, 0] = 0  # block 0 (positions 0-15) holds sink positions of both kinds
    blocks[:, :, 1] = 1  # block 1 (16-31) straddles the sink end
    blocks[:, :, 2:4] = -1
    sl = torch.full((pool.hp_index.shape[0],), sink, dtype=torch.int32)
    sl[pool.req_pool_indices] = torch.tensor([3, 0, 7], dtype=torch.int32)
    kw = dict(sink=sink, recent=recent, sm_scale=0.11)
    one = run_sparse(pool, q_rot, pool.req_pool_indices, pool.seq_lens, blocks, bs, num_splits=1, **kw)
    three = run_sparse(pool, q_rot, pool.req_pool_indices, pool.seq_lens, blocks, bs, num_splits=3, **kw)
    assert rel_l2(three, one) < 1e-5
    short = run_sparse(pool, q_rot, pool.req_pool_indices, pool.seq_lens, blocks, bs, sink_lens=sl, num_splits=2, **kw)
    ref = torch.cat([oracle(pool, r, q_rot[r:r + 1], [L - 1], blocks[:, r:r + 1], bs, mode="decode", sink_len=s, **kw)
                     for r, (L, s) in enumerate(zip(lens, (3, 0, 7)))])
    assert rel_l2(short, ref) < 1e-4
    assert rel_l2(one, ref) > 1e-3  # the full sink reads other rows: the test can tell


def test_block_sparse_every_block_equals_dense_decode():
    """Selecting every block (ascending, ``-1`` padded) is the dense decode kernel, to fp32 summation order."""
    fresh_seed()
    lens, bs, sink, recent = [100, 37, 64], 16, 12, 30
    pool, q_rot, _ = decode_case(lens, 4, 2, 64, bs, 1, sink=sink, recent=recent)
    nb = -(-max(lens) // bs)
    blocks = torch.full((2, len(lens), nb), -1, dtype=torch.int32)
    for r, L in enumerate(lens):
        blocks[:, r, : -(-L // bs)] = torch.arange(-(-L // bs), dtype=torch.int32)
    o = run_sparse(pool, q_rot, pool.req_pool_indices, pool.seq_lens, blocks, bs, sink=sink, recent=recent,
                   sm_scale=0.125, num_splits=2)
    dense = run_decode(pool, q_rot, sm_scale=0.125, mma_dtype=torch.float32)
    assert rel_l2(o, dense) < 1e-5


def test_block_sparse_extend_matches_the_oracle():
    """An extend batch (``recent = 0``, window mode "extend"): two chunks at positions ``prefix ..
    prefix + e - 1`` (``row_len = pos + 1``), every row and kv head with its own selection, the chunk's own
    tokens read through INT2; a trailing padding row (``row_len = 0``) gives zeros."""
    fresh_seed()
    bs, sink, hq, hkv, d = 32, 20, 8, 2, 64
    chunks = [(150, 6), (41, 5)]  # (prefix, extend length)
    cfg = make_config(sink=sink, recent=24)
    pool = build_pool([p + e for p, e in chunks], hkv, d, d, cfg, hp_dtype=torch.float32)
    n = sum(e for _, e in chunks) + 1
    q_rot = rotate_q(pool, torch.randn(n, hq, d) * 2)
    pos = [p + i for p, e in chunks for i in range(e)]
    blocks = torch.cat([random_blocks(hkv, pos, 4, bs, pad=1), torch.full((hkv, 1, 4), 3, dtype=torch.int32)], dim=1)
    row_req = torch.cat([pool.req_pool_indices[r].repeat(e) for r, (_, e) in enumerate(chunks)] + [
        pool.req_pool_indices[:1]])
    row_len = torch.tensor(pos + [-1]) + 1
    o = run_sparse(pool, q_rot, row_req, row_len, blocks, bs, sink=sink, recent=0, sm_scale=0.125)
    ref, at = [], 0
    for r, (p, e) in enumerate(chunks):
        ref.append(oracle(pool, r, q_rot[at:at + e], range(p, p + e), blocks[:, at:at + e], bs, sink=sink, recent=0,
                          mode="extend", sm_scale=0.125))
        at += e
    assert rel_l2(o[:-1], torch.cat(ref)) < 1e-4
    assert bool((o[-1] == 0).all())


def test_block_sparse_odd_lists_and_padding_rows():
    """H_q == H_kv, extend rows (``recent = 0``): a block listed again in a later split, ids past the row
    (block 3 of a row at 40 holds written slots; 1000 lies past ``max_ctx``), an all ``-1`` row and a
    padding row whose stale list has ids with ``id * B`` past int32: the real rows match the oracle over
    their clean lists, the others are zeros -- at more splits than entries (empty splits in the merge)
    and with ``k = 1`` (one split, the direct store)."""
    fresh_seed()
    bs, sink = 16, 20
    pool = build_pool([77, 50], 2, 64, 64, make_config(sink=sink, recent=24), hp_dtype=torch.float32)
    q_rot = rotate_q(pool, torch.randn(4, 2, 64) * 2)
    rpi = pool.req_pool_indices
    row_req = torch.stack([rpi[0], rpi[0], rpi[1], rpi[1]])
    row_len = torch.tensor([77, 40, 50, 0])
    blocks = torch.full((2, 4, 5), -1, dtype=torch.int32)
    for h in range(2):
        blocks[h, 0] = torch.tensor([4, -1, h, 4, 1000])
        blocks[h, 1] = torch.tensor([2, 3, 1 - h, -1, 2])
    blocks[:, 3] = torch.tensor([0xC000000, 2**31 - 1, 7, 0, -5], dtype=torch.int32)
    clean = blocks[:, :2].clone()
    clean[:, 0, 3:] = -1
    clean[:, 1, 1] = -1
    clean[:, 1, 4] = -1
    kw = dict(sink=sink, recent=0, sm_scale=0.125)
    for k, splits in ((5, 7), (1, None)):
        o = run_sparse(pool, q_rot, row_req, row_len, blocks[..., :k], bs, num_splits=splits, debug=False, **kw)
        ref = torch.cat([oracle(pool, 0, q_rot[i:i + 1], [L - 1], clean[:, i:i + 1, :k], bs, mode="extend", **kw)
                         for i, L in enumerate((77, 40))])
        assert rel_l2(o[:2], ref) < 1e-4, (k, splits)
        assert bool((o[2:] == 0).all()), (k, splits)


def test_block_sparse_rejects_bad_inputs():
    fresh_seed()
    pool, q_rot, blocks = decode_case([40, 20], 4, 2, 64, 16, 3, sink=4, recent=8)
    bufs = (pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v)
    args = (pool.hp_index, pool.req_to_token, pool.req_pool_indices, pool.seq_lens)
    kw = dict(block_size=16, sink=4, recent=8, sm_scale=0.1)

    def call(q=q_rot, blk=blocks, a=args, **over):
        return block_sparse_attention(q, pool.layout, bufs, *a, blk, **{**kw, **over})

    with pytest.raises(ValueError, match="block_size must be a power of two"):
        call(block_size=24)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        call(block_size=256)
    with pytest.raises(ValueError, match=r"blocks has shape .*H_kv=2"):
        call(blk=blocks[:1])
    with pytest.raises(ValueError, match="blocks has dtype"):
        call(blk=blocks.float())
    with pytest.raises(ValueError, match="not a multiple of 2 kv heads"):
        call(q=q_rot[:, :3].contiguous(), blk=blocks)
    with pytest.raises(ValueError, match="row_len has shape"):
        call(a=args[:3] + (pool.seq_lens[:1],))
    with pytest.raises(ValueError, match="row_len must be contiguous"):
        call(a=args[:3] + (pool.seq_lens.repeat_interleave(2)[::2],))
    with pytest.raises(ValueError, match="num_splits must be an int >= 1"):
        call(num_splits=0)
    with pytest.raises(ValueError, match="sm_scale"):
        call(sm_scale=float("nan"))
    with pytest.raises(ValueError, match="hp_index has 12 columns"):
        call(recent=9)
    with pytest.raises(ValueError, match="buffers must be the tuple"):
        block_sparse_attention(q_rot, pool.layout, bufs[:5], *args, blocks, **kw)
    with pytest.raises(ValueError, match=r"blocks has entries in \[-1, 9\]"):
        bad = blocks.clone()
        bad[0, 0, 0] = 9  # req_to_token holds 45 positions: 3 blocks of 16
        call(blk=bad, debug=True)


@pytest.mark.gpu
def test_block_sparse_gpu_served_windows_and_cuda_graph():
    """Compiled, at served sizes (windows 64 + 256, a 5K and a 900-token request, B 128 and 64, 16 of the
    kv head's blocks, GQA 8, head_dim 128): decode rows and a 300-token extend chunk vs the oracle, fp32
    rows to 1e-4 and bf16 rows (fp16 MMAs) to 1e-2; a CUDA graph captured over the block lists replays
    new selections and queries bit for bit like an eager call."""
    fresh_seed()
    sink, recent, hq, hkv, d, k = GPU_SINK, GPU_RECENT, 16, 2, 128, 16
    lens = [scaled(5000), scaled(900)]
    scale = d ** -0.5
    for hp_dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        cfg = make_config(sink=sink, recent=recent)
        pool = build_pool(lens, hkv, d, d, cfg, hp_dtype=hp_dtype, device=DEV)
        for bs in (128, 64):
            q_rot = rotate_q(pool, torch.randn(len(lens), hq, d, device=DEV) * 2)
            blocks = random_blocks(hkv, [L - 1 for L in lens], k, bs).to(DEV)
            o = run_sparse(pool, q_rot, pool.req_pool_indices, pool.seq_lens, blocks, bs, sink=sink, recent=recent,
                           sm_scale=scale)
            ref = torch.cat([oracle(pool, r, q_rot[r:r + 1], [L - 1], blocks[:, r:r + 1], bs, sink=sink,
                                    recent=recent, mode="decode", sm_scale=scale) for r, L in enumerate(lens)])
            assert rel_l2(o, ref) < tol, (hp_dtype, bs, "decode")
            e, prefix = scaled(300), lens[0] - scaled(300)
            pos = list(range(prefix, prefix + e))
            q_ext = rotate_q(pool, torch.randn(e, hq, d, device=DEV))
            blk = random_blocks(hkv, pos, k, bs).to(DEV)
            row_req = pool.req_pool_indices[:1].repeat(e)
            row_len = torch.tensor(pos, device=DEV) + 1
            o = run_sparse(pool, q_ext, row_req, row_len, blk, bs, sink=sink, recent=0, sm_scale=scale)
            ref = oracle(pool, 0, q_ext, pos, blk, bs, sink=sink, recent=0, mode="extend", sm_scale=scale)
            assert rel_l2(o, ref) < tol, (hp_dtype, bs, "extend")
    if DEV != "cuda":
        return
    bufs = (pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v)
    bs = 128
    blocks = random_blocks(hkv, [L - 1 for L in lens], k, bs).to(DEV)
    out = torch.empty(len(lens), hq, d, device=DEV)
    kw = dict(block_size=bs, sink=sink, recent=recent, sm_scale=scale, num_splits=4, out=out, debug=False)
    args = (pool.hp_index, pool.req_to_token, pool.req_pool_indices, pool.seq_lens, blocks)
    block_sparse_attention(q_rot, pool.layout, bufs, *args, **kw)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        block_sparse_attention(q_rot, pool.layout, bufs, *args, **kw)
    q_rot.copy_(rotate_q(pool, torch.randn(len(lens), hq, d, device=DEV)))
    blocks.copy_(random_blocks(hkv, [L - 1 for L in lens], k, bs).to(DEV))
    g.replay()
    want = block_sparse_attention(q_rot, pool.layout, bufs, *args, **{**kw, "out": None})
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("k,block,extend,decode", [(16, 128, 4, 16), (32, 64, 4, 16), (8, 16, 1, 1), (3, 128, 1, 3),
                                                   (64, 128, 8, 16), (2, 64, 1, 1)])
def test_block_sparse_default_splits(k, block, extend, decode):
    """Extend rows: one split per 512 selected positions, 1..8; decode rows: one per 128, 1..16; never
    more than ``k`` (every split holds a block)."""
    from sglang_oscar.kernels.sparse import block_sparse_num_splits

    assert block_sparse_num_splits(k, block) == extend
    assert block_sparse_num_splits(k, block, decode=True) == decode
