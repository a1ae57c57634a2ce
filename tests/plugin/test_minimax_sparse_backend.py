"""MiniMax-M3's INT2 sparse backend on CPU (issue 27), over test_minimax_sparse.py's pool and config.

Checked: SGLang's own ``__init__`` with the BF16-only paths off, the indexer call's plumbing (SGLang's indexer
kernels stood in by the reference selection: they are autotuned and do not run under the Triton interpreter)
and ``forward_extend`` / ``forward_decode`` with a fixed selection against the oracle
(``reference.attention.attend`` with ``reference.sparse.block_topk_key_mask``), fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _support.forward import Mode
from _support.orthogonal import random_orthogonal
from _support.served import cpu_backend
from test_minimax_sparse import (
    CONFIG,
    CTX,
    DI,
    H_IDX,
    HKV,
    HQ,
    MAX_REQS,
    NO_VALUE,
    RECENT,
    SINK,
    SPARSE,
    TOPK,
    B,
    D,
    _hf,
    _pool,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))  # the kernel tests' fixtures
from kv_fixtures import fresh_seed  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ------------------------------------------------------------------------------------------- backend
def _layer(lid):
    return SimpleNamespace(layer_id=lid, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                           scaling=D ** -0.5, logit_cap=0.0, sliding_window_size=-1, logit_capping_method="tanh",
                           is_cross_attention=False)


def _runner(pool, req_to_token, block=B):
    return SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                           model_config=SimpleNamespace(hf_config=_hf(block), context_len=CTX, num_attention_heads=HQ),
                           server_args=SimpleNamespace(speculative_algorithm=None, kv_cache_dtype="int2"))


def _extend_batch(reqs, starts, ends, slots):
    n = [e - s for s, e in zip(starts, ends)]
    return SimpleNamespace(
        forward_mode=Mode("extend"), batch_size=len(reqs), out_cache_loc=torch.cat(slots),
        positions=torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)]), req_pool_indices=torch.tensor(reqs),
        seq_lens=torch.tensor(ends), seq_lens_cpu=torch.tensor(ends), extend_seq_lens=torch.tensor(n),
        extend_prefix_lens=torch.tensor(starts),
        extend_seq_lens_cpu=n, minimax_m3_precached_sparse_layers=None)


def _decode_batch(reqs, positions, slots):
    return SimpleNamespace(forward_mode=Mode("decode"), batch_size=len(reqs), out_cache_loc=torch.cat(slots),
                           positions=torch.tensor(positions), req_pool_indices=torch.tensor(reqs),
                           seq_lens=torch.tensor(positions) + 1, seq_lens_cpu=torch.tensor(positions) + 1,
                           minimax_m3_precached_sparse_layers=None)


def test_sparse_backend_init_runs_sglangs_with_the_bf16_paths_off(monkeypatch):
    """SGLang's own ``MiniMaxSparseAttnBackend.__init__`` on a stand-in runner: its block settings from the
    config, MSA and the dense-sparse decode off (they read BF16 main rows) even where SGLang would turn
    them on; a BF16 pool and a block size the kernel does not take are refused."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention.minimax_sparse_ops import msa

    from sglang_oscar.backend.minimax_backend import OscarMiniMaxSparseBackend

    pool = _pool(torch.bfloat16)
    monkeypatch.setattr(msa, "msa_available", lambda: True)
    monkeypatch.setattr(envs.SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE, "get", lambda: True)
    be = OscarMiniMaxSparseBackend(_runner(pool, torch.zeros(MAX_REQS, CTX, dtype=torch.int32)))
    assert (be.block_size_k, be.topk_blocks, be.init_blocks, be.local_blocks) == (B, TOPK, 1, 1)
    assert be.sparse_layer_ids == SPARSE and be.disable_value_layer_ids == set(NO_VALUE) and be.kv_pool is pool
    assert not (be.use_msa or be._use_msa_decode or be._msa_owns_decode or be.use_dense_sparse_decode)
    with pytest.raises(ValueError, match="sparse_block_size 8: the INT2 block-sparse attention takes"):
        OscarMiniMaxSparseBackend(_runner(pool, torch.zeros(MAX_REQS, CTX, dtype=torch.int32), block=8))
    with pytest.raises(RuntimeError, match="not the INT2 MiniMax pool"):
        OscarMiniMaxSparseBackend(SimpleNamespace(token_to_kv_pool=object()))


def test_select_runs_sglangs_indexer_and_unions_per_kv_head(monkeypatch):
    """``_select``'s plumbing: SGLang's indexer kernels (stood in by the reference selection, computed
    from exactly the arguments SGLang's kernels take: index pool, ``req_to_token``, request slots,
    ``cu_seqlens`` / ``prefix_lens`` / ``seq_lens``) over the index keys the pool holds, then
    ``topk_index_reduce``'s union of each kv head's two index heads: equal to the reference selection
    per kv head, for an extend batch of two requests (one with a prefix) and a decode batch."""
    import sglang.kernels.ops.attention.minimax_sparse.decode.flash_with_topk_idx as dec
    import sglang.kernels.ops.attention.minimax_sparse.prefill.flash_with_topk_idx as pre

    from sglang_oscar.backend.minimax_backend import OscarMiniMaxSparseBackend
    from sglang_oscar.reference.sparse import minimax_block_selection

    gen = torch.Generator().manual_seed(fresh_seed())
    pool = _pool(torch.bfloat16)
    r2t = torch.zeros(MAX_REQS, CTX, dtype=torch.int32)
    be = OscarMiniMaxSparseBackend(_runner(pool, r2t))
    # bf16-exact keys: the pool holds them in bf16, and the expected lists are computed from the same
    # values (fp32 keys would select differently on near-equal block scores, ~7% of seeds)
    keys = {1: torch.randn(60, 1, DI, generator=gen).bfloat16().float(),
            3: torch.randn(30, 1, DI, generator=gen).bfloat16().float()}
    r2t[1, :60], r2t[3, :30] = torch.arange(1, 61), torch.arange(61, 91)
    for req, k in keys.items():
        pool.set_index_k_buffer(_layer(2), r2t[req, : len(k)].long(), k.bfloat16())
    sel = dict(block_size=B, topk=TOPK, init_blocks=1, local_blocks=1, score_type="max")
    calls = []

    def per_head(q, k_cache, req_to_token, slot, positions, seq_len):
        k = k_cache[req_to_token[slot, :seq_len].long()].float()
        return minimax_block_selection(q.float(), k, positions, kv_heads=H_IDX, **sel)

    def prefill(q, k_cache, v_cache, sink, req_to_token, slot_ids, cu_seqlens, seq_lens, prefix_lens, max_seqlen_q,
                max_seqlen_k, block_size_q, block_size_k, topk, init_blocks, local_blocks, score_type,
                disable_index_value, cu_seqblocks_q, max_seqblock_q, all_seqblock_q, **kw):
        calls.append(("prefill", v_cache, disable_index_value, block_size_q, all_seqblock_q, max_seqlen_q))
        lists = [per_head(q[cu_seqlens[b]:cu_seqlens[b + 1]], k_cache, req_to_token, int(slot_ids[b]),
                          torch.arange(int(prefix_lens[b]), int(seq_lens[b])), int(seq_lens[b]))
                 for b in range(len(slot_ids))]
        return None, torch.cat(lists, dim=1)

    def decode(q, sink, k_cache, v_cache, req_to_token, seq_lens, max_seqlen, slot_ids, block_size, topk, init_blocks,
               local_blocks, score_type, disable_index_value, use_dense_main_attn, page_size, **kw):
        calls.append(("decode", v_cache, disable_index_value, use_dense_main_attn, page_size))
        lists = [per_head(q[b:b + 1], k_cache, req_to_token, int(slot_ids[b]), seq_lens[b:b + 1] - 1, int(seq_lens[b]))
                 for b in range(len(slot_ids))]
        return None, torch.cat(lists, dim=1), None

    monkeypatch.setattr(pre, "flash_prefill_with_topk_index", prefill)
    monkeypatch.setattr(dec, "flash_decode_with_topk_idx", decode)
    iq = torch.randn(60 + 30, H_IDX, DI, generator=gen).bfloat16()
    be._max_seqlen_q, be._max_seqlen_k = 20, 60
    fb = _extend_batch([1, 3], [40, 0], [60, 30], [r2t[1, 40:60], r2t[3, :30]])
    idx_o, blocks = be._select(iq[:50], _layer(2), fb, True)
    want = torch.cat([minimax_block_selection(iq[:20].float(), keys[1], torch.arange(40, 60), kv_heads=HKV, **sel),
                      minimax_block_selection(iq[20:50].float(), keys[3], torch.arange(30), kv_heads=HKV, **sel)],
                     dim=1)
    assert idx_o is None and blocks.dtype == torch.int32 and tuple(blocks.shape) == (HKV, 50, 2 * TOPK)
    assert torch.equal(blocks, want) and (blocks[..., 3:] >= 0).any()  # the union widens some lists past topk
    assert calls[-1] == ("prefill", None, True, 1, 50, 20)
    fb = _decode_batch([3, 1], [29, 59], [r2t[3, 29:30], r2t[1, 59:60]])
    _, blocks = be._select(iq[50:52], _layer(2), fb, True)
    want = torch.cat([minimax_block_selection(iq[50:51].float(), keys[3], torch.tensor([29]), kv_heads=HKV, **sel),
                      minimax_block_selection(iq[51:52].float(), keys[1], torch.tensor([59]), kv_heads=HKV, **sel)],
                     dim=1)
    assert torch.equal(blocks, want) and calls[-1] == ("decode", None, True, False, 1)


class M3Served:
    """The INT2 M3 pool, the OSCAR Triton backend (dense layers, windows) and the OSCAR sparse backend under
    SGLang's ``MiniMaxHybridAttnBackend``, fp32, with ``_select`` replaced by a fixed selection. The rotated
    rows the backend hands ``write_rotated`` are recorded per (layer, slot): the oracle quantizes exactly
    those (a rotation rounded one ulp apart may flip a code at a level boundary)."""

    def __init__(self, gen):
        from sglang.srt.layers.attention.minimax_sparse_backend import MiniMaxHybridAttnBackend

        from sglang_oscar.backend.minimax_backend import OscarMiniMaxSparseBackend

        self.pool = _pool(torch.float32)
        self.rot = {i: (random_orthogonal(D, HKV, generator=gen), random_orthogonal(D, HKV, generator=gen))
                    for i in range(3)}
        self.dense = cpu_backend(self.pool, CONFIG, [_layer(i) for i in range(3)], self.rot, max_reqs=MAX_REQS, ctx=CTX)
        self.r2t = self.dense._int2_req_to_token
        sparse = OscarMiniMaxSparseBackend(_runner(self.pool, self.r2t))
        self.hybrid = MiniMaxHybridAttnBackend(self.dense, sparse, sparse.sparse_layer_ids)
        self.gen, self.next_slot, self.calls = gen, 1, []
        self.window_updates = 0
        windows_in_forward = self.dense._windows_in_forward

        def count(fb):
            self.window_updates += 1
            windows_in_forward(fb)

        self.dense._windows_in_forward = count
        sparse._select = self._select
        self.written = {lid: (torch.zeros(161, HKV, D), torch.zeros(161, HKV, D)) for lid in SPARSE}
        write = self.pool.write_rotated

        def record(layer_id, loc, k_rot, v_rot, hp_rows):
            self.written[layer_id][0][loc], self.written[layer_id][1][loc] = k_rot.float(), v_rot.float()
            write(layer_id, loc, k_rot, v_rot, hp_rows)

        self.pool.write_rotated = record

    def alloc(self, req, start, end):
        s = torch.arange(self.next_slot, self.next_slot + end - start)
        self.next_slot += end - start
        self.r2t[req, start:end] = s.to(torch.int32)
        return s

    def blocks_for(self, positions):
        """A random causal selection per kv head and row: the row's own block plus up to 3 earlier ones,
        at random places of a ``-1``-padded list of the union's width (2 x topk)."""
        width = 2 * TOPK
        out = torch.full((HKV, len(positions), width), -1, dtype=torch.int32)
        for h in range(HKV):
            for i, p in enumerate(positions.tolist()):
                own = p // B
                others = torch.randperm(own, generator=self.gen)[: int(torch.randint(0, 4, (1,), generator=self.gen))]
                ids = torch.cat([torch.tensor([own]), others])
                out[h, i, torch.randperm(width, generator=self.gen)[: len(ids)]] = ids.to(torch.int32)
        return out

    def _select(self, idx_q, layer, fb, disable_value):
        # SGLang's indexer reads the index keys of the chunk itself: they must be written already
        ik = self.pool.get_index_k_buffer(layer.layer_id)[fb.out_cache_loc]
        self.calls.append((layer.layer_id, idx_q, disable_value, torch.equal(ik, self.idx_k_written)))
        return self.idx_o_next, self.blocks_next

    def run(self, fb, data, rows, mode, layers=SPARSE):
        """Sparse layers on one batch; ``rows``: ``(request, position)`` per query row; ``data[lid][req]``:
        ``(q, k, v, idx_q, idx_k, idx_v)`` of each request's positions. Returns ``{lid: (o, blocks)}``."""
        # the hybrid's metadata calls reach both backends: SGLang's sparse one sets the indexer's max lengths
        # and leaves the windows alone, the dense one updates them, once per forward (the OSCAR part of its
        # out-of-graph call, then its in-graph call; TritonAttnBackend's own metadata needs a GPU runner)
        self.hybrid.sparse.init_forward_metadata_out_graph(fb)
        self.dense._windows_out_of_graph()
        before = self.window_updates
        self.hybrid.init_forward_metadata_in_graph(fb)
        assert self.window_updates == before + 1
        assert self.hybrid.sparse._max_seqlen_k == int(fb.seq_lens_cpu.max())
        assert self.hybrid.sparse._max_seqlen_q == (max(fb.extend_seq_lens_cpu) if mode == "extend" else 1)
        out = {}
        for lid in layers:
            pick = [tuple(t[p] for t in data[lid][r]) for r, p in rows]
            q, k, v, iq, ik, iv = (torch.stack([x[j] for x in pick]) for j in range(6))
            self.blocks_next = self.blocks_for(torch.tensor([p for _, p in rows]))
            self.idx_o_next = None if lid in NO_VALUE else torch.randn(len(rows), H_IDX, DI, generator=self.gen)
            self.idx_k_written = ik
            fwd = self.hybrid.forward_extend if mode == "extend" else self.hybrid.forward_decode
            idx_o, o = fwd(q, k, v, _layer(lid), fb, idx_q=iq, idx_k=ik, idx_v=None if lid in NO_VALUE else iv)
            seen_q = self.calls[-1][1]  # the model's idx_q (a view of its real rows)
            assert self.calls[-1][0] == lid and self.calls[-1][2] == (lid in NO_VALUE)
            assert seen_q.data_ptr() == iq.data_ptr() and seen_q.shape == iq.shape
            assert self.calls[-1][3], "index keys not written before the indexer ran"
            if lid in NO_VALUE:
                assert idx_o is None
            else:  # idx_o as the indexer returned it, [N, H_idx * Di]; the index value rows in SGLang's buffer
                assert torch.equal(idx_o, self.idx_o_next.reshape(len(rows), -1))
                assert torch.equal(self.pool.get_index_kv_buffer(lid)[1][fb.out_cache_loc], iv)
            assert o.shape == (len(rows), HQ * D) and o.dtype == torch.float32
            out[lid] = (o.reshape(len(rows), HQ, D), self.blocks_next)
        return out

    def oracle(self, lid, q, req, positions, blocks, mode, dense=False):
        """``attend`` over the reference cache of the rows written for ``req`` (positions ``0 .. max + 1``)
        with the selection's per-kv-head mask (all keys with ``dense``), back in the model frame."""
        from sglang_oscar.reference.attention import attend, build_cache, rotate_rows
        from sglang_oscar.reference.sparse import block_topk_key_mask

        end = int(positions.max()) + 1
        slots = self.r2t[req, :end].long()
        eye = torch.eye(D)
        cache = build_cache(self.written[lid][0][slots], self.written[lid][1][slots], eye, eye, CONFIG, torch.float32)
        rk, rv = self.rot[lid]
        o = attend(rotate_rows(q, rk, num_kv_heads=HKV), positions, cache.k_hp, cache.v_hp, cache.k_deq, cache.v_deq,
                   sink=SINK, recent=RECENT, sm_scale=D ** -0.5, window_mode=mode,
                   key_mask=None if dense else block_topk_key_mask(blocks, positions, end, B))
        return rotate_rows(o, rv, transpose=True, num_kv_heads=HKV), cache


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_sparse_layers_extend_and_decode_match_the_oracle():
    """Two requests through the hybrid backend: one extend batch (req 1 positions 0..19, req 2 0..11), a
    second chunk of req 1 over its prefix (20..35), a decode batch of both. Each sparse layer's output
    equals the oracle over the INT2 cache with the selection's per-kv-head mask (window mode "extend"
    for the chunks, "decode" for the step; fp32, rel L2 < 1e-4) and differs from dense attention; the
    rows written are the rotated K/V and the INT2 codes of every slot the reference quantizer's;
    ``idx_o`` passes through (``None`` for the layer without index value)."""
    from sglang_oscar.reference.attention import rotate_rows

    gen = torch.Generator().manual_seed(fresh_seed())
    sv = M3Served(gen)
    lens = {1: 37, 2: 13}
    data = {lid: {r: (torch.randn(n, HQ, D, generator=gen), torch.randn(n, HKV, D, generator=gen) * 2,
                      torch.randn(n, HKV, D, generator=gen), torch.randn(n, H_IDX, DI, generator=gen),
                      torch.randn(n, 1, DI, generator=gen), torch.randn(n, 1, DI, generator=gen))
                  for r, n in lens.items()} for lid in SPARSE}
    sparse_gap = []

    def check(out, rows, mode):
        for lid, (o, blocks) in out.items():
            for r in lens:
                i = [j for j, (rr, _) in enumerate(rows) if rr == r]
                if i:
                    pos = torch.tensor([rows[j][1] for j in i])
                    q = data[lid][r][0][pos]
                    want, _ = sv.oracle(lid, q, r, pos, blocks[:, i], mode)
                    assert _rel(o[i], want) < 1e-4, (lid, r, mode, _rel(o[i], want))
                    sparse_gap.append(_rel(o[i], sv.oracle(lid, q, r, pos, blocks[:, i], mode, dense=True)[0]))

    rows = [(1, p) for p in range(20)] + [(2, p) for p in range(12)]
    slots = [sv.alloc(1, 0, 20), sv.alloc(2, 0, 12)]
    check(sv.run(_extend_batch([1, 2], [0, 0], [20, 12], slots), data, rows, "extend", layers=[1]), rows, "extend")
    rows = [(1, p) for p in range(20, 36)]
    check(sv.run(_extend_batch([1], [20], [36], [sv.alloc(1, 20, 36)]), data, rows, "extend"), rows, "extend")
    rows = [(2, 12), (1, 36)]
    fb = _decode_batch([2, 1], [12, 36], [sv.alloc(2, 12, 13), sv.alloc(1, 36, 37)])
    check(sv.run(fb, data, rows, "decode"), rows, "decode")
    assert max(sparse_gap) > 0.05  # the selection matters: dense attention is far from the output
    lid = 1  # every position of layer 1: the rotated rows, quantized by the reference quantizer
    kc, _, vc, _, _, _ = sv.pool.int2_buffers(lid)
    for r, n in lens.items():
        slots = sv.r2t[r, :n].long()
        k_rot = rotate_rows(data[lid][r][1], sv.rot[lid][0], num_kv_heads=HKV)
        assert torch.allclose(sv.written[lid][0][slots], k_rot, atol=1e-5, rtol=1e-5)
        _, cache = sv.oracle(lid, data[lid][r][0][:1], r, torch.tensor([n - 1]), None, "decode", dense=True)
        assert torch.equal(kc[slots], cache.k_quant.codes) and torch.equal(vc[slots], cache.v_quant.codes)


def test_padded_extend_rows_come_back_as_zeros():
    """An extend batch padded past its tokens (the breakable prefill graph's bucket): as SGLang's
    ``forward_extend`` (``minimax_sparse_backend.py:313-366``), the indexer and the main attention see
    the real tokens only (one block list per real token) and the padded rows of ``o`` and ``idx_o``
    come back as zeros; the real rows equal those of the same batch unpadded."""
    gen = torch.Generator().manual_seed(fresh_seed())
    sv = M3Served(gen)
    n, pad, lid = 12, 4, 1  # layer 1 keeps an index value
    slots = sv.alloc(1, 0, n)
    fb = _extend_batch([1], [0], [n], [slots])
    q, k, v = torch.randn(n, HQ, D, generator=gen), torch.randn(n, HKV, D, generator=gen), \
        torch.randn(n, HKV, D, generator=gen)
    iq, ik, iv = (torch.randn(n, h, DI, generator=gen) for h in (H_IDX, 1, 1))
    sv.dense._windows_out_of_graph()
    sv.hybrid.init_forward_metadata_in_graph(fb)
    blocks, idx_o_real, seen = sv.blocks_for(torch.arange(n)), torch.randn(n, H_IDX, DI, generator=gen), []

    def select(idx_q, layer, batch, disable_value):
        seen.append(idx_q.shape[0])
        return idx_o_real, blocks

    sv.hybrid.sparse._select = select
    idx_o, o = sv.hybrid.forward_extend(q, k, v, _layer(lid), fb, idx_q=iq, idx_k=ik, idx_v=iv)
    padded = SimpleNamespace(**vars(fb))
    padded.positions = torch.cat([fb.positions, torch.zeros(pad, dtype=fb.positions.dtype)])
    padded.out_cache_loc = torch.cat([slots, torch.zeros(pad, dtype=slots.dtype)])

    def grow(t):
        return torch.cat([t, torch.randn(pad, *t.shape[1:], generator=gen)])

    # the rows are in the cache already (the unpadded pass wrote them): this pass only reads
    idx_o2, o2 = sv.hybrid.forward_extend(grow(q), grow(k), grow(v), _layer(lid), padded, save_kv_cache=False,
                                          idx_q=grow(iq), idx_k=grow(ik), idx_v=grow(iv))
    assert seen == [n, n]
    assert o2.shape == (n + pad, HQ * D) and idx_o2.shape == (n + pad, H_IDX * DI)
    assert torch.allclose(o2[:n], o, rtol=1e-6, atol=1e-6) and not o2[n:].any()
    assert torch.equal(idx_o2[:n], idx_o) and not idx_o2[n:].any()
