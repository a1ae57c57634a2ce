"""MLA latent decode kernel (kernels.latent) vs the oracle (reference.latent.latent_attention,
``output="latent_rotated"``, window mode "decode"), on the interpreter or the GPU (``device``).

Each request's latents are quantized by the oracle (``build_latent_cache``), its codes, pairs and
``k_pe`` scattered to random non-contiguous slots and its sink / recent rows to random HP rows;
every other slot and row is poisoned (0xAB codes, NaN pairs and rows), so a wrong read shows.
"""

from __future__ import annotations

import pytest
import torch
from _support.orthogonal import random_orthogonal
from kv_fixtures import build_latent_pool, fresh_seed, rel_l2
from sglang_oscar.config import OscarConfig
from sglang_oscar.kernels.decode.plan import DecodeWorkspace
from sglang_oscar.kernels.latent_extend import latent_extend_attention
from sglang_oscar.kernels.latent_plan import (PLANES, LatentDecodePlan, codes_engine_applies, latent_decode_attention,
                                              latent_decode_tiles, latent_num_splits, latent_sparse_extend_attention,
                                              sparse_extend_num_splits)
from sglang_oscar.reference.latent import latent_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("lens,h,r,p,group,quantizer,sink,recent,hp", [
    ([40, 9, 3], 4, 64, 16, 32, "uniform", 4, 8, torch.float32),  # windows, short requests, 2 groups
    ([33, 70], 20, 128, 32, 128, "lloyd-max", 2, 16, torch.float32),  # H > BLOCK_H, one group per row
    ([65], 3, 64, 16, 16, "uniform", 0, 0, torch.float32),  # INT2 only
    ([20], 4, 128, 16, 16, "uniform", 2, 4, torch.float32),  # two groups per quarter (R/4 = 32 > G)
    ([50, 21], 8, 64, 16, 32, "uniform", 4, 8, torch.bfloat16),  # BF16 windows and k_pe
])
def test_latent_decode_matches_the_oracle(device, lens, h, r, p, group, quantizer, sink, recent, hp):
    fresh_seed()
    cfg = OscarConfig(group_size=group, sink_tokens=sink, recent_tokens=recent, quantizer=quantizer)
    rot = random_orthogonal(r)
    seqs, pool = build_latent_pool(lens, r, p, cfg, rot, hp, device)
    scale = (r + p) ** -0.5 * 2.0
    eye = torch.eye(r).expand(h, r, r)  # w_kc = w_vc = I: q_abs = q_nope, o = o_latent
    q_nope, q_pe = torch.randn(len(lens), h, r), torch.randn(len(lens), h, p)
    ref = torch.stack([latent_attention(q_nope[i:i + 1], q_pe[i:i + 1], c, kpe, eye, eye, rot, cfg, softmax_scale=scale,
                                        window_mode="decode", hp_dtype=hp, output="latent_rotated")[0]
                       for i, (c, kpe) in enumerate(seqs)])
    q_abs = (q_nope @ rot).to(device)
    # the "codes" engine where it applies (uniform levels, a quarter of the rank in one group)
    engines = ("dequant", "codes") if quantizer == "uniform" and group % (r // 4) == 0 else ("dequant",)
    for engine in engines:
        for splits in (1, 3):
            out = latent_decode_attention(q_abs, q_pe.to(device), **pool, group_size=group, quantizer=quantizer,
                                          sink=sink, recent=recent, sm_scale=scale, num_splits=splits, engine=engine)
            assert out.shape == (len(lens), h, r) and torch.isfinite(out).all()
            assert rel_l2(out.cpu(), ref) < 1e-4, (engine, splits)  # the same stored rows on both sides, fp32 math


def _decode_case(cfg, lens, h, r, p, device):
    """Random fp32 latents of ``lens`` in a pool (``build_latent_pool``), queries and the oracle's output
    (identity absorptions: ``q_abs = q_nope``, ``o = o_latent``); ``oracle_kw`` go to ``latent_attention``
    per request (a ``topk_indices`` there is ``[B, k]``)."""
    rot = random_orthogonal(r)
    seqs, pool = build_latent_pool(lens, r, p, cfg, rot, torch.float32, device)
    scale = (r + p) ** -0.5 * 2.0
    eye = torch.eye(r).expand(h, r, r)
    q_nope, q_pe = torch.randn(len(lens), h, r), torch.randn(len(lens), h, p)

    def oracle(**oracle_kw):
        per = [{k: v[i:i + 1] for k, v in oracle_kw.items()} for i in range(len(lens))]
        return torch.stack([latent_attention(q_nope[i:i + 1], q_pe[i:i + 1], c, kpe, eye, eye, rot, cfg,
                                             softmax_scale=scale, window_mode="decode", hp_dtype=torch.float32,
                                             output="latent_rotated", **per[i])[0] for i, (c, kpe) in enumerate(seqs)])
    return pool, (q_nope @ rot).to(device), q_pe.to(device), scale, oracle


def test_latent_decode_tiles_policy():
    """The served tiles: 64 keys x 32 heads x 8 warps for the codes engine from 32 heads on (TP 1-4 of
    DeepSeek-V3), 32 x 16 x 4 below and for the dequantizing engine."""
    wide, narrow = dict(block_n=64, block_h=32, num_warps=8), dict(block_n=32, block_h=16, num_warps=4)
    assert latent_decode_tiles(128, "codes") == wide and latent_decode_tiles(32, "codes") == wide
    assert latent_decode_tiles(16, "codes") == narrow and latent_decode_tiles(31, "codes") == narrow
    assert latent_decode_tiles(128, "dequant") == narrow


def test_latent_decode_served_wide_tiles_match_the_oracle(device):
    """The 64 x 32 x 8-warp tiles the server picks from 32 heads on: 40 heads (a full and a partial head
    block), requests across 64-key blocks and both tiers, both engines, the served split count."""
    fresh_seed()
    cfg = OscarConfig(group_size=16, sink_tokens=4, recent_tokens=8)
    lens, h = [150, 9], 40
    pool, q_abs, q_pe, scale, oracle = _decode_case(cfg, lens, h, 64, 16, device)
    ref = oracle()
    tiles = latent_decode_tiles(h, "codes")
    assert tiles["block_h"] == 32 and tiles["block_n"] == 64
    splits = latent_num_splits(len(lens), h, block_h=tiles["block_h"], num_sms=4)
    assert splits == 2  # 2 requests x 2 head blocks x 2 splits: the long request crosses a split
    for engine in ("codes", "dequant"):
        out = latent_decode_attention(q_abs, q_pe, **pool, group_size=16, quantizer="uniform", sink=4, recent=8,
                                      sm_scale=scale, num_splits=splits, engine=engine, **tiles)
        assert rel_l2(out.cpu(), ref) < 1e-4, engine


@pytest.mark.gpu
@pytest.mark.parametrize("h", [16, 128])
@pytest.mark.parametrize("engine", ["dequant", "codes"])
@pytest.mark.parametrize("precision,tol", [("tf32", 3e-3), ("bf16", 1.5e-2)])
def test_latent_decode_tensor_core_engines_match_the_oracle(precision, tol, engine, h):
    """The serving engines on DeepSeek-V3's latent (R 512, P 64, G 128, BF16 windows) at TP 8 and TP 1
    head counts with the served tiles (:func:`latent_decode_tiles`): TF32 / BF16 operands move the
    output by their rounding only (relative L2 under ``tol``)."""
    fresh_seed()
    cfg = OscarConfig(group_size=128, sink_tokens=16, recent_tokens=32)
    r, p, lens = 512, 64, [300, 77, 1030]
    rot = random_orthogonal(r)
    seqs, pool = build_latent_pool(lens, r, p, cfg, rot, torch.bfloat16, "cuda")
    scale = (128 + p) ** -0.5
    eye = torch.eye(r).expand(h, r, r)
    q_nope, q_pe = torch.randn(len(lens), h, r), torch.randn(len(lens), h, p)
    ref = torch.stack([latent_attention(q_nope[i:i + 1], q_pe[i:i + 1], c, kpe, eye, eye, rot, cfg, softmax_scale=scale,
                                        window_mode="decode", hp_dtype=torch.bfloat16, output="latent_rotated")[0]
                       for i, (c, kpe) in enumerate(seqs)])
    out = latent_decode_attention((q_nope @ rot).cuda(), q_pe.cuda(), **pool, group_size=128, quantizer="uniform",
                                  sink=16, recent=32, sm_scale=scale, num_splits=8, precision=precision, engine=engine,
                                  **latent_decode_tiles(h, engine))
    err = rel_l2(out.cpu(), ref)
    assert err < tol, (precision, engine, err)


def test_latent_plan_runs_every_layer_of_a_batch(device):
    """One plan per batch, run per layer: two layers with their own latents and queries through one
    :class:`LatentDecodePlan` (workspace from a shared :class:`DecodeWorkspace`) match the oracle of
    each layer; the plan refuses queries and planes of another shape."""
    fresh_seed()
    cfg = OscarConfig(group_size=32, sink_tokens=2, recent_tokens=8)
    lens, h, r, p = [37, 12], 6, 64, 16
    scale = (r + p) ** -0.5
    eye = torch.eye(r).expand(h, r, r)
    layers = []
    for _ in range(2):
        rot = random_orthogonal(r)
        torch.manual_seed(7)  # the same slots and HP rows for both layers (a batch's tables), other latent codes
        seqs, pool = build_latent_pool(lens, r, p, cfg, rot, torch.float32, device)
        q_nope, q_pe = torch.randn(len(lens), h, r), torch.randn(len(lens), h, p)
        ref = torch.stack([latent_attention(q_nope[i:i + 1], q_pe[i:i + 1], c, kpe, eye, eye, rot, cfg,
                                            softmax_scale=scale, window_mode="decode", hp_dtype=torch.float32,
                                            output="latent_rotated")[0] for i, (c, kpe) in enumerate(seqs)])
        layers.append(((q_nope @ rot).to(device), q_pe.to(device), pool, ref))
    tables = {k: layers[0][2][k] for k in ("hp_index", "req_to_token", "req_pool_indices", "seq_lens")}
    assert all(torch.equal(layers[1][2][k], t) for k, t in tables.items())
    assert not torch.equal(layers[1][2]["codes"], layers[0][2]["codes"])
    plan = LatentDecodePlan({k: layers[0][2][k] for k in PLANES}, *tables.values(), num_heads=h, group_size=32,
                            quantizer="uniform", sink=2, recent=8, num_splits=3, workspace=DecodeWorkspace(device))
    assert plan.grid == (2, 1, 3) and plan.o_part.shape == (2, h, 3, r)
    for q_abs, q_pe, pool, ref in layers:
        out = plan.run(q_abs, q_pe, *(pool[k] for k in PLANES), sm_scale=scale)
        assert rel_l2(out.cpu(), ref) < 1e-4
    q_abs, q_pe, pool, _ = layers[0]
    with pytest.raises(ValueError, match="this plan was built for"):
        plan.run(q_abs[:1], q_pe[:1], *(pool[k] for k in PLANES), sm_scale=scale)
    with pytest.raises(ValueError, match="this plan was built for"):
        plan.run(q_abs, q_pe, *(pool[k][:-1] for k in PLANES), sm_scale=scale)
    with pytest.raises(ValueError, match="hp_index"):  # checked once, when the plan is built
        LatentDecodePlan({k: pool[k] for k in PLANES}, *tables.values(), num_heads=h, group_size=32,
                         quantizer="uniform", sink=2, recent=64)


@pytest.mark.parametrize("k,splits", [(24, 1), (48, 3), (64, 1), (64, 2)])
def test_latent_decode_over_a_dsa_selection_matches_the_oracle(device, k, splits):
    """DSA (GLM-5): each request attends only to its top-k positions (distinct, ``-1``-padded, in any
    order), each read from its own tier -- sink rows, the recent ring, INT2 -- as the oracle's
    ``topk_indices``; k = 64 covers the whole of the shorter request plus padding, and with one
    split the split must span the list, not the (shorter) request."""
    fresh_seed()
    cfg = OscarConfig(group_size=32, sink_tokens=4, recent_tokens=8)
    lens = [90, 37]
    pool, q_abs, q_pe, scale, oracle = _decode_case(cfg, lens, 4, 64, 16, device)
    topk = torch.full((len(lens), k), -1, dtype=torch.int32)
    for i, n in enumerate(lens):
        fixed = torch.tensor([0, 2, n - 1, n - 5])  # two sink and two recent positions, the rest at random
        rest = torch.tensor([x for x in torch.randperm(n).tolist() if x not in fixed.tolist()])
        chosen = torch.cat([fixed, rest])[:k]
        topk[i, torch.randperm(k)[:chosen.numel()]] = chosen.to(torch.int32)
    assert (topk[0] < 4).any() and (topk[0] >= 90 - 8).any()  # the selection reaches both windows
    ref = oracle(topk_indices=topk)
    kw = dict(group_size=32, quantizer="uniform", sink=4, recent=8, sm_scale=scale)
    dense = latent_decode_attention(q_abs, q_pe, **pool, **kw, num_splits=splits)
    out = latent_decode_attention(q_abs, q_pe, **pool, **kw, num_splits=splits, topk=topk.to(device))
    assert rel_l2(out.cpu(), ref) < 1e-4
    assert rel_l2(dense.cpu(), ref) > 1e-2  # the selection matters: attending everything is another answer
    with pytest.raises(ValueError, match="engine 'dequant' only"):
        latent_decode_attention(q_abs, q_pe, **pool, **kw, topk=topk.to(device), engine="codes")


def test_latent_sparse_extend_matches_the_oracle_and_the_dense_extend(device):
    """DSA extend (GLM-5 prefill): chunk tokens after a prefix, each attending to its own top-k of
    the positions up to itself (sink rows from BF16, everything else -- the chunk included --
    through INT2), as the oracle's window mode "extend" with ``topk_indices``; a selection that
    covers every position gives the dense extend kernel's answer."""
    fresh_seed()
    cfg = OscarConfig(group_size=32, sink_tokens=4, recent_tokens=8)
    lens, prefixes, h, r, p, k = [60, 33], [40, 25], 4, 64, 16, 16
    rot = random_orthogonal(r)
    seqs, pool = build_latent_pool(lens, r, p, cfg, rot, torch.float32, device)
    scale = (r + p) ** -0.5 * 2.0
    eye = torch.eye(r).expand(h, r, r)
    planes = {name: pool[name] for name in PLANES}
    reqs = pool["req_pool_indices"].cpu()
    q_nope = [torch.randn(n - pre, h, r) for n, pre in zip(lens, prefixes)]
    q_pe = [torch.randn(n - pre, h, p) for n, pre in zip(lens, prefixes)]
    token_req = torch.cat([reqs[i].repeat(n - pre) for i, (n, pre) in enumerate(zip(lens, prefixes))])
    positions = torch.cat([torch.arange(pre, n) for n, pre in zip(lens, prefixes)])
    topk = torch.full((positions.numel(), k), -1, dtype=torch.int32)
    for t, pos in enumerate(positions.tolist()):  # a sink position, the token itself, the rest at random
        rest = [x for x in torch.randperm(pos + 1).tolist() if x not in (1, pos)]
        chosen = torch.tensor([1, pos] + rest)[:k]
        topk[t, torch.randperm(k)[:chosen.numel()]] = chosen.to(torch.int32)
    refs = []
    for i, ((c, kpe), pre) in enumerate(zip(seqs, prefixes)):
        rows = slice(sum(n - q for n, q in zip(lens[:i], prefixes[:i])), None)
        refs.append(latent_attention(q_nope[i], q_pe[i], c, kpe, eye, eye, rot, cfg, softmax_scale=scale,
                                     q_positions=torch.arange(pre, lens[i]), window_mode="extend",
                                     hp_dtype=torch.float32, output="latent_rotated",
                                     topk_indices=topk[rows][: lens[i] - pre]))
    q_abs = torch.cat([q @ rot for q in q_nope]).to(device)
    qp = torch.cat(q_pe).to(device)
    tables = dict(hp_index=pool["hp_index"], req_to_token=pool["req_to_token"])
    out = latent_sparse_extend_attention(q_abs, qp, planes, **tables, token_req=token_req.to(device),
                                         positions=positions.to(device), topk=topk.to(device), group_size=32,
                                         quantizer="uniform", sink=4, sm_scale=scale)
    assert rel_l2(out.cpu(), torch.cat(refs)) < 1e-4
    whole, sliced = (latent_sparse_extend_attention(q_abs, qp, planes, **tables, token_req=token_req.to(device),
                                                    positions=positions.to(device), topk=topk.to(device),
                                                    group_size=32, quantizer="uniform", sink=4, sm_scale=scale,
                                                    num_splits=2, max_rows=n) for n in (2048, 5))
    assert torch.equal(sliced, whole)  # slices of 5 tokens (the last of 3), same split count: the same bits
    # every position selected (in shuffled order, -1 padded): the dense extend kernel's rows
    full = torch.full((positions.numel(), max(lens) + 3), -1, dtype=torch.int32)
    for t, pos in enumerate(positions.tolist()):
        full[t, torch.randperm(full.shape[1])[: pos + 1]] = torch.arange(pos + 1, dtype=torch.int32)
    sparse_all = latent_sparse_extend_attention(q_abs, qp, planes, **tables, token_req=token_req.to(device),
                                                positions=positions.to(device), topk=full.to(device),
                                                group_size=32, quantizer="uniform", sink=4, sm_scale=scale)
    qo = torch.tensor([0] + [n - pre for n, pre in zip(lens, prefixes)]).cumsum(0).to(torch.int32)
    dense = latent_extend_attention(q_abs, qp, **planes, **tables, req_pool_indices=pool["req_pool_indices"],
                                    qo_indptr=qo.to(device), prefix_lens=torch.tensor(prefixes).to(device),
                                    group_size=32, quantizer="uniform", sink=4, sm_scale=scale,
                                    max_extend_len=max(n - pre for n, pre in zip(lens, prefixes)))
    assert rel_l2(sparse_all.cpu(), dense.cpu()) < 1e-5
    # chunk invariance with the default split count: the last 4 tokens alone (a later chunk of the
    # same prompt, its rows written before) give the bits they get inside the whole call, also with
    # a selection wider than one split (1,040 positions, -1 padded: 2 splits; against the last 5 tokens'
    # call only: the interpreter walks every padded entry)
    wide = torch.cat([full, torch.full((full.shape[0], 1040 - full.shape[1]), -1, dtype=torch.int32)], 1)
    for sel, rows in ((full, slice(None)), (wide, slice(-5, None))):
        kw = dict(group_size=32, quantizer="uniform", sink=4, sm_scale=scale)
        whole = latent_sparse_extend_attention(q_abs[rows], qp[rows], planes, **tables,
                                               token_req=token_req[rows].to(device),
                                               positions=positions[rows].to(device), topk=sel[rows].to(device), **kw)
        tail = latent_sparse_extend_attention(q_abs[-4:], qp[-4:], planes, **tables,
                                              token_req=token_req[-4:].to(device),
                                              positions=positions[-4:].to(device), topk=sel[-4:].to(device), **kw)
        assert torch.equal(tail, whole[-4:])
    assert [sparse_extend_num_splits(k) for k in (16, 256, 512, 1040, 2048, 1 << 16)] == [1, 1, 1, 2, 4, 8]
    assert rel_l2(out.cpu(), dense.cpu()) > 1e-2  # the selection matters
    with pytest.raises(ValueError, match="one entry per query token"):
        latent_sparse_extend_attention(q_abs, qp, planes, **tables, token_req=token_req[:-1].to(device),
                                       positions=positions.to(device), topk=topk.to(device), group_size=32,
                                       quantizer="uniform", sink=4, sm_scale=scale)


@pytest.mark.parametrize("quantizer,group,rank,applies", [
    ("uniform", 128, 512, True),  # DeepSeek-V3 at the served default: one pair per quarter row
    ("uniform", 512, 512, True),
    ("uniform", 64, 512, False),  # two groups in a quarter
    ("lloyd-max", 128, 512, False),  # uneven levels
])
def test_codes_engine_applies(quantizer, group, rank, applies):
    assert codes_engine_applies(quantizer, group, rank) is applies


@pytest.mark.gpu
def test_latent_decode_over_a_dsa_selection_at_glm5_shape():
    """GLM-5's DSA decode shape: 2,048 selected positions of 3,000 / 9,000-token requests, R 512,
    P 64, 16 heads, BF16 dots and block_n 32 as served: within BF16 rounding of the oracle."""
    fresh_seed()
    cfg = OscarConfig(group_size=128, sink_tokens=16, recent_tokens=32)
    lens, h, r, p = [3000, 9000], 16, 512, 64
    rot = random_orthogonal(r)
    seqs, pool = build_latent_pool(lens, r, p, cfg, rot, torch.bfloat16, "cuda")
    scale = (128 + p) ** -0.5
    eye = torch.eye(r).expand(h, r, r)
    q_nope, q_pe = torch.randn(len(lens), h, r), torch.randn(len(lens), h, p)
    # distinct positions (a top-k is): sink 0-7, 1,990 from [8, n - 40), the last 40, and 10 unused (-1)
    topk = torch.stack([torch.cat([torch.arange(8), torch.randperm(n - 48)[:1990] + 8, torch.arange(n - 40, n),
                                   torch.full((10,), -1)])[torch.randperm(2048)] for n in lens]).to(torch.int32)
    ref = torch.stack([latent_attention(q_nope[i:i + 1], q_pe[i:i + 1], c, kpe, eye, eye, rot, cfg, softmax_scale=scale,
                                        window_mode="decode", hp_dtype=torch.bfloat16, output="latent_rotated",
                                        topk_indices=topk[i:i + 1])[0] for i, (c, kpe) in enumerate(seqs)])
    out = latent_decode_attention((q_nope @ rot).cuda(), q_pe.cuda(), **pool, group_size=128, quantizer="uniform",
                                  sink=16, recent=32, sm_scale=scale, num_splits=8, precision="bf16", block_n=32,
                                  topk=topk.cuda())
    assert rel_l2(out.cpu(), ref) < 1.5e-2


@pytest.mark.gpu
def test_latent_plan_replays_in_cuda_graphs():
    """Plans built before capture, as the served backend builds them: two batch sizes captured from
    one DecodeWorkspace, then new query values and shorter sequences written into the captured
    tensors; each replay equals a one-shot call over the new values (codes engine, BF16 dots)."""
    fresh_seed()
    cfg = OscarConfig(group_size=128, sink_tokens=16, recent_tokens=32)
    lens, h, r, p = [300, 500], 16, 512, 64
    _, pool = build_latent_pool(lens, r, p, cfg, random_orthogonal(r), torch.bfloat16, "cuda")
    planes = [pool[k] for k in PLANES]
    kw = dict(num_heads=h, group_size=128, quantizer="uniform", sink=16, recent=32, precision="bf16", block_n=32,
              engine="codes")
    ws = DecodeWorkspace("cuda")
    graphs = []
    for b in (2, 1):  # largest first, as SGLang captures
        rpi, seq = pool["req_pool_indices"][:b].clone(), pool["seq_lens"][:b].clone()
        q_abs, q_pe = torch.randn(b, h, r, device="cuda"), torch.randn(b, h, p, device="cuda")
        plan = LatentDecodePlan({k: pool[k] for k in PLANES}, pool["hp_index"], pool["req_to_token"], rpi, seq,
                                workspace=ws, **kw)
        out = torch.empty(b, h, r, device="cuda")
        plan.run(q_abs, q_pe, *planes, sm_scale=0.05, out=out)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            plan.run(q_abs, q_pe, *planes, sm_scale=0.05, out=out)
        graphs.append((g, plan, q_abs, q_pe, seq, out))
    for g, plan, q_abs, q_pe, seq, out in graphs:
        q_abs.copy_(torch.randn_like(q_abs))
        seq.copy_(seq - torch.tensor([100, 60], device="cuda")[: seq.numel()])
        g.replay()
        want = latent_decode_attention(q_abs, q_pe, *planes, pool["hp_index"], pool["req_to_token"],
                                       plan.req_pool_indices, seq, sm_scale=0.05, num_splits=plan.num_splits,
                                       **{k: v for k, v in kw.items() if k != "num_heads"})
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_latent_decode_rejects_bad_shapes():
    cfg = OscarConfig(group_size=32, sink_tokens=2, recent_tokens=4)
    _, pool = build_latent_pool([10], 64, 16, cfg, torch.eye(64), torch.float32, "cpu")
    q, qp = torch.randn(1, 2, 64), torch.randn(1, 2, 16)
    kw = dict(group_size=32, quantizer="uniform", sink=2, recent=4, sm_scale=0.1)
    with pytest.raises(ValueError, match="power of two"):
        latent_decode_attention(torch.randn(1, 2, 48), qp, **pool, **kw)
    with pytest.raises(ValueError, match="power of two"):  # R = 192: R/4 = 48, no tl.arange over it
        latent_decode_attention(torch.randn(1, 2, 192), qp, **pool, **kw)
    with pytest.raises(ValueError, match="block_n"):
        latent_decode_attention(q, qp, **pool, **kw, block_n=24)
    with pytest.raises(ValueError, match="share"):
        latent_decode_attention(q, torch.randn(1, 3, 16), **pool, **kw)
    with pytest.raises(ValueError, match="pairs"):
        latent_decode_attention(q, qp, **{**pool, "pairs": pool["pairs"][:, :2]}, **kw)
    with pytest.raises(ValueError, match="hp_index"):
        latent_decode_attention(q, qp, **pool, **{**kw, "recent": 64})
    with pytest.raises(ValueError, match="'bf16' on a GPU only"):
        latent_decode_attention(q, qp, **pool, **kw, precision="bf16")
    with pytest.raises(ValueError, match="precision must be one of"):
        latent_decode_attention(q, qp, **pool, **kw, precision="fp8")
    with pytest.raises(ValueError, match="num_warps must be 4 or 8"):
        latent_decode_attention(q, qp, **pool, **kw, num_warps=2)
    with pytest.raises(ValueError, match="engine 'codes' needs evenly spaced levels"):
        latent_decode_attention(q, qp, **pool, **{**kw, "quantizer": "lloyd-max"}, engine="codes")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gather_latent_dequantizes_like_the_oracle(device, out_dtype):
    """[c_kv | k_pe] rows of random slots (the extend path's input): the oracle's dequantized latent
    rounded once to ``out_dtype``, and ``k_pe`` as stored."""
    from sglang_oscar.kernels.latent import gather_latent
    from sglang_oscar.quant.int2 import QuantizedRows, dequantize_rows

    fresh_seed()
    r, p, g = 128, 32, 32
    cfg = OscarConfig(group_size=g, sink_tokens=2, recent_tokens=4, quantizer="lloyd-max")
    seqs, pool = build_latent_pool([30, 7], r, p, cfg, random_orthogonal(r), torch.float32, device)
    slots = pool["req_to_token"][1, :30].flip(0).contiguous()
    out = gather_latent(pool["codes"], pool["pairs"], pool["k_pe"], slots, group_size=g, quantizer="lloyd-max",
                        out_dtype=out_dtype)
    s = slots.long().cpu()
    qr = QuantizedRows(codes=pool["codes"].cpu()[s][:, None], pairs=pool["pairs"].cpu()[s][:, None], group_size=g,
                       quantizer="lloyd-max")
    want = torch.cat([dequantize_rows(qr)[:, 0], pool["k_pe"].cpu()[s]], dim=-1).to(out_dtype)
    assert out.shape == (30, r + p) and out.dtype == out_dtype
    assert torch.equal(out.cpu(), want)
    with pytest.raises(ValueError, match="out_dtype"):
        gather_latent(pool["codes"], pool["pairs"], pool["k_pe"], slots, group_size=g, quantizer="uniform",
                      out_dtype=torch.float16)


def test_latent_pool_written_by_write_kv(device):
    """The MHA write kernel with one 'kv head' of width R and no V stores exactly the oracle's latent
    bytes, so the served latent pool can use it: codes and pairs equal build_latent_cache's."""
    from sglang_oscar.kernels import Int2Layout, write_kv
    from sglang_oscar.reference.latent import build_latent_cache

    fresh_seed()
    r, p, g = 128, 32, 64
    cfg = OscarConfig(group_size=g)
    rot = random_orthogonal(r)
    c_kv, kpe = torch.randn(19, r) * 3, torch.randn(19, p)
    lc = build_latent_cache(c_kv, kpe, rot, cfg)  # BF16 rows of c Rot, K's clip ratio
    lay = Int2Layout.create(r, group_size=g, k_clip_ratio=cfg.k_clip_ratio, quantizer=cfg.quantizer,
                            scale_dtype=cfg.scale_dtype, attention=False)
    buf = lay.allocate(40, 1, device)
    loc = (torch.randperm(39)[:19] + 1).to(device)
    write_kv(lc.ckv_hp[:, None].to(device), None, loc, buf["k_codes"], buf["k_pairs"], None, None, lay)
    assert torch.equal(buf["k_codes"][loc].cpu(), lc.quant.codes)
    assert torch.equal(buf["k_pairs"][loc].cpu(), lc.quant.pairs)


def test_latent_decode_sink_lens_read_later_sink_positions_through_int2(device):
    """With ``sink_lens[r] = 2 < sink = 4`` (the sink arena ran out) positions 2 and 3 are read
    through INT2 although their rows exist: the same attention as an oracle with sink 2 (requests
    longer than sink + recent, so the ring is the same)."""
    fresh_seed()
    r, p, h = 64, 16, 4
    cfg = OscarConfig(group_size=32, sink_tokens=4, recent_tokens=8)
    rot = random_orthogonal(r)
    seqs, pool = build_latent_pool([40, 33], r, p, cfg, rot, torch.float32, device)
    eye = torch.eye(r).expand(h, r, r)
    q_nope, q_pe = torch.randn(2, h, r), torch.randn(2, h, p)
    short = OscarConfig(group_size=32, sink_tokens=2, recent_tokens=8)
    ref = torch.stack([latent_attention(q_nope[i:i + 1], q_pe[i:i + 1], c, kpe, eye, eye, rot, short, softmax_scale=0.2,
                                        hp_dtype=torch.float32, output="latent_rotated")[0]
                       for i, (c, kpe) in enumerate(seqs)])
    sink_lens = torch.full((pool["hp_index"].shape[0],), 2, dtype=torch.int32, device=device)
    kw = dict(group_size=32, quantizer="uniform", sink=4, recent=8, sm_scale=0.2, num_splits=2)
    for engine in ("dequant", "codes"):
        out = latent_decode_attention((q_nope @ rot).to(device), q_pe.to(device), **pool, sink_lens=sink_lens, **kw,
                                      engine=engine)
        full = latent_decode_attention((q_nope @ rot).to(device), q_pe.to(device), **pool, **kw, engine=engine)
        assert rel_l2(out.cpu(), ref) < 1e-4 and rel_l2(full.cpu(), ref) > 1e-3, engine
