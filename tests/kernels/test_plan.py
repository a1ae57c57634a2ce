"""DecodePlan: built once per batch, run once per layer (kernels/decode/plan.py).

A plan's runs give exactly what one-shot ``decode_attention`` calls give; plans share one
DecodeWorkspace buffer; the plan checks the batch once and refuses what its launch constants do not
cover (another q shape, a logit cap it was not built for).
"""

from __future__ import annotations

import pytest
import torch
from kv_fixtures import build_pool, fresh_seed, make_config, reference_decode, rel_l2, rotate_q
from sglang_oscar.kernels import DecodePlan, DecodeWorkspace, decode_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SINK, RECENT = 4, 8


def _bufs(pool):
    return (pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v)


def _plan(pool, hq, **kw):
    return DecodePlan(pool.layout, hq, _bufs(pool), pool.hp_index, pool.req_to_token, pool.req_pool_indices,
                      pool.seq_lens, sink=SINK, recent=RECENT, q_dtype=torch.float32,
                      **{"mma_dtype": torch.float32, "out_dtype": torch.float32, **kw})


def test_plan_runs_equal_one_shot_calls_and_the_oracle():
    """Two "layers" (two pools of one geometry, the same batch tables) through one plan: each run
    equals decode_attention on that layer bit for bit and the oracle within fp32 tolerance."""
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT)
    layers = [build_pool([30, 9, 51], 2, 64, 64, cfg, hp_dtype=torch.float32) for _ in range(2)]
    # the second layer reads the first layer's tables (a plan holds one batch's tables)
    a, b = layers
    b.hp_index, b.req_to_token = a.hp_index, a.req_to_token
    b.req_pool_indices, b.seq_lens = a.req_pool_indices, a.seq_lens
    plan = _plan(a, 8, num_kv_splits=3)
    assert plan.engine == "triton" and plan.grid == (3, 2, plan.num_hp_splits + 3)
    for pool in layers:
        q = torch.randn(3, 8, 64)
        qr = rotate_q(pool, q)
        o = plan.run(qr, *_bufs(pool))
        one = decode_attention(qr, *_bufs(pool), pool.hp_index, pool.req_to_token, pool.req_pool_indices,
                               pool.seq_lens, pool.layout, sink=SINK, recent=RECENT, num_kv_splits=3,
                               mma_dtype=torch.float32, out_dtype=torch.float32)
        assert torch.equal(o, one)
        if pool is a:
            assert rel_l2(o, reference_decode(pool, q, hp_dtype=torch.float32)) < 1e-4


def test_sliding_plan_splits_its_window_not_its_context(monkeypatch):
    """A sliding layer's plan sizes its INT2 splits by the window (its keys), not by the context
    bound, caps them above 16 head programs, and still matches the oracle with sinks wholly below
    the window (left out of the HP splits) and cut by it (masked)."""
    fresh_seed()
    pool = build_pool([40, 9, 51], 2, 64, 64, make_config(sink=SINK, recent=RECENT), hp_dtype=torch.float32)
    window = 16  # request 0 and 2: sink wholly below the window; request 1 (9 tokens): all visible
    full = _plan(pool, 8, max_seq_len=4096)
    plan = _plan(pool, 8, max_seq_len=4096, sliding_window=window)
    assert plan.num_kv_splits == 1 < full.num_kv_splits  # ceil(16 / 64): one split of the floor
    q = torch.randn(3, 8, 64)
    o = plan.run(rotate_q(pool, q), *_bufs(pool))
    assert rel_l2(o, reference_decode(pool, q, sliding_window=window, hp_dtype=torch.float32)) < 1e-4
    # a window cutting request 0's sink (L - W = 2 < SINK) masks the sink positions below it
    o = _plan(pool, 8, sliding_window=38).run(rotate_q(pool, q), *_bufs(pool))
    assert rel_l2(o, reference_decode(pool, q, sliding_window=38, hp_dtype=torch.float32)) < 1e-4
    # above 16 head programs (9 requests x 2 kv heads) a sliding plan caps its splits at 2 HP + 8 INT2
    wide = build_pool([40, 9, 51, 30, 22, 60, 17, 45, 33], 2, 64, 64, make_config(sink=SINK, recent=RECENT),
                      hp_dtype=torch.float32)
    from sglang_oscar.kernels.decode import splits
    monkeypatch.setattr(splits, "_sm_count", lambda device: 132)  # an H200's split counts (CPU: 4 SMs)
    capped = _plan(wide, 8, max_seq_len=1 << 16, sliding_window=1024)
    assert capped.num_kv_splits == 8 < _plan(wide, 8, max_seq_len=1 << 16).num_kv_splits
    assert _plan(wide, 8, max_seq_len=1 << 16, sliding_window=4096).num_kv_splits > 8  # wider windows: not capped
    hpp = build_pool([40, 9, 51, 30, 22, 60, 17, 45, 33], 2, 64, 64, make_config(sink=SINK, recent=96),
                     hp_dtype=torch.float32)
    hp = DecodePlan(hpp.layout, 8, _bufs(hpp), hpp.hp_index, hpp.req_to_token, hpp.req_pool_indices,
                    hpp.seq_lens, sink=SINK, recent=96, q_dtype=torch.float32, sliding_window=1024)
    assert hp.num_hp_splits == 2  # 100 HP positions: 3 splits uncapped
    q = torch.randn(9, 8, 64)
    o = capped.run(rotate_q(wide, q), *_bufs(wide))
    assert rel_l2(o, reference_decode(wide, q, sliding_window=1024, hp_dtype=torch.float32)) < 1e-4


def test_plans_slice_one_workspace():
    """Plans of several batch sizes take views of one DecodeWorkspace buffer: reserved once for the
    largest, no plan allocates its own."""
    fresh_seed()
    pool = build_pool([20, 9, 33, 5], 2, 64, 64, make_config(sink=SINK, recent=RECENT), hp_dtype=torch.float32)
    ws = DecodeWorkspace("cpu")
    ws.reserve(DecodeWorkspace.numel(4, 8, 64, 64))
    base = ws._buf.data_ptr()
    for bsz in (4, 1, 2):
        rpi, sl = pool.req_pool_indices[:bsz], pool.seq_lens[:bsz]
        plan = DecodePlan(pool.layout, 8, _bufs(pool), pool.hp_index, pool.req_to_token, rpi, sl, sink=SINK,
                          recent=RECENT, q_dtype=torch.float32, mma_dtype=torch.float32, workspace=ws)
        assert plan.o_part.data_ptr() == base and plan.o_part.shape == (bsz, 8, plan.num_splits, 64)
        assert plan.lse.shape == (bsz, 8, plan.num_splits)
        assert plan.lse.data_ptr() == base + 4 * bsz * 8 * plan.num_splits * 64
    assert ws._buf.data_ptr() == base  # never re-allocated


def test_plan_refuses_what_its_constants_do_not_cover():
    fresh_seed()
    pool = build_pool([12, 20], 2, 64, 64, make_config(sink=SINK, recent=RECENT), hp_dtype=torch.float32)
    plan = _plan(pool, 4)
    qr = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match=r"q has shape \(3, 4, 64\); this plan was built for \(2, 4, 64\)"):
        plan.run(torch.randn(3, 4, 64), *_bufs(pool))
    with pytest.raises(ValueError, match="built without a logit cap"):
        plan.run(qr, *_bufs(pool), logit_cap=30.0)
    capped = _plan(pool, 4, logit_cap=30.0)
    assert capped.has_cap
    with pytest.raises(ValueError, match="built with a logit cap"):
        capped.run(qr, *_bufs(pool))
    o = capped.run(qr, *_bufs(pool), logit_cap=30.0)
    assert torch.isfinite(o).all()
    with pytest.raises(ValueError, match="sm_scale"):
        plan.run(qr, *_bufs(pool), sm_scale=float("nan"))
    with pytest.raises(ValueError, match="workspace too small"):
        _plan(pool, 4, num_kv_splits=4, workspace=(torch.empty(2, 4, 3, 64), torch.empty(2, 4, 3)))
    with pytest.raises(ValueError, match="multiple"):
        _plan(pool, 3)


def test_extend_plan_runs_equal_one_shot_calls_and_the_oracle():
    """ExtendPlan: built once for a batch of chunks, its run equals extend_attention (LSE included)
    and the oracle; another q shape or a cap it was not built for is refused."""
    from kv_fixtures import reference_extend
    from sglang_oscar.kernels import ExtendPlan, extend_attention

    fresh_seed()
    prefixes, exts = [10, 0], [7, 5]
    pool = build_pool([p + e for p, e in zip(prefixes, exts)], 2, 64, 64, make_config(sink=SINK, recent=RECENT),
                      hp_dtype=torch.float32, window_mode="extend")
    qo = torch.tensor([0, 7, 12])
    pre, ext = torch.tensor(prefixes), torch.tensor(exts)
    tables = (pool.hp_index, pool.req_to_token, pool.req_pool_indices, qo, pre, ext)
    plan = ExtendPlan(pool.layout, 4, 12, _bufs(pool), *tables, sink=SINK, q_dtype=torch.float32,
                      mma_dtype=torch.float32, return_lse=True)
    q = torch.randn(12, 4, 64)
    qr = rotate_q(pool, q)
    o, lse = plan.run(qr, *_bufs(pool))
    o1, lse1 = extend_attention(qr, *_bufs(pool), *tables, pool.layout, sink=SINK, mma_dtype=torch.float32,
                                return_lse=True)
    assert torch.equal(o, o1) and torch.equal(lse, lse1)
    assert rel_l2(o, reference_extend(pool, q, prefixes, exts, hp_dtype=torch.float32)) < 1e-4
    with pytest.raises(ValueError, match=r"this plan was built for \(12, 4, 64\)"):
        plan.run(qr[:5], *_bufs(pool))
    with pytest.raises(ValueError, match="built without a logit cap"):
        plan.run(qr, *_bufs(pool), logit_cap=5.0)
