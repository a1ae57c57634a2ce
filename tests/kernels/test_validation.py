"""Bad input is refused with a clear ValueError before any launch."""

from __future__ import annotations

import pytest
import torch
from kv_fixtures import build_pool, make_config, rotate_q, run_decode
from sglang_oscar.kernels import (
    GluonConfig,
    Int2Layout,
    TritonConfig,
    decode_attention,
    extend_attention,
    plan_head_blocks,
    write_kv,
)


@pytest.mark.parametrize("dk,dv,group,match", [
    (100, 100, None, "head_dim"),
    (32, 32, None, "head_dim"),
    (1024, 1024, None, "head_dim"),
    (128, 128, 48, "does not divide"),
    (192, 128, 96, "does not divide"),
])
def test_layout_rejects_unsupported_combinations(dk, dv, group, match):
    with pytest.raises(ValueError, match=match):
        Int2Layout.create(dk, dv, group_size=group)


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

def test_layout_rejects_bad_settings():
    with pytest.raises(ValueError):
        Int2Layout.create(128, quantizer="nf2")
    with pytest.raises(ValueError):
        Int2Layout.create(128, scale_dtype="float64")
    with pytest.raises(ValueError):
        Int2Layout.create(128, k_clip_ratio=1.5)


def _write_args(layout, n=4, h=2, slots=8):
    buf = layout.allocate(slots, h, "cpu")
    k = torch.randn(n, h, layout.k.head_dim).bfloat16()
    v = torch.randn(n, h, layout.v.head_dim).bfloat16()
    return k, v, torch.arange(n), buf


def test_write_rejects_bad_inputs(monkeypatch):
    layout = Int2Layout.create(64, 64)
    k, v, loc, buf = _write_args(layout)
    args = (buf["k_codes"], buf["k_pairs"], buf["v_codes"], buf["v_pairs"], layout)
    with pytest.raises(ValueError, match="head_dim"):
        write_kv(torch.randn(4, 2, 128).bfloat16(), v, loc, *args)
    with pytest.raises(ValueError, match="dtype"):
        write_kv(k, v, loc.float(), *args)
    with pytest.raises(ValueError, match="dtype"):
        write_kv(k, v, loc, buf["k_codes"], buf["k_pairs"].float(), buf["v_codes"], buf["v_pairs"], layout)
    with pytest.raises(ValueError, match="shape"):
        write_kv(k, v, loc[:3], *args)
    with pytest.raises(ValueError, match="on meta"):
        write_kv(k, v, loc.to("meta"), *args)
    with pytest.raises(ValueError, match="hp_k"):
        write_kv(k, v, loc, *args, hp_rows=loc, hp_k=torch.zeros(4, 2, 64), hp_v=torch.zeros(4, 2, 64))
    bad_loc = torch.tensor([0, 1, 2, 99])
    with pytest.raises(ValueError, match="loc"):
        write_kv(k, v, bad_loc, *args, debug=True)
    monkeypatch.setenv("SGLANG_OSCAR_DEBUG", "1")
    with pytest.raises(ValueError, match="loc"):
        write_kv(k, v, bad_loc, *args)
    nan_k = k.clone()
    nan_k[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        write_kv(nan_k, v, loc, *args)


def _pool():
    cfg = make_config(sink=4, recent=8)
    return build_pool([10, 20], 2, 64, 64, cfg, hp_dtype=torch.float32)


def _decode(pool, q, **kw):
    return decode_attention(q, pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v,
                            pool.hp_index, pool.req_to_token, pool.req_pool_indices, pool.seq_lens, pool.layout,
                            **{"sink": 4, "recent": 8, **kw})


def test_decode_rejects_bad_inputs():
    pool = _pool()
    q = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match="head_dim"):
        _decode(pool, torch.randn(2, 4, 128))
    with pytest.raises(ValueError, match="multiple"):
        _decode(pool, torch.randn(2, 3, 64))
    with pytest.raises(ValueError, match="columns"):
        _decode(pool, q, recent=50)
    with pytest.raises(ValueError, match="sliding_window"):
        _decode(pool, q, sliding_window=0)
    with pytest.raises(ValueError, match="shape"):
        _decode(pool, torch.randn(3, 4, 64))
    with pytest.raises(ValueError, match="bfloat16"):
        _decode(pool, q, mma_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="config must be None, TritonConfig or GluonConfig"):
        _decode(pool, q, config={"block_n": 32})  # a dict of fields is not a config
    with pytest.raises(ValueError, match="extend config must be None or a TritonConfig, got GluonConfig"):
        extend_attention(q, pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v,
                         pool.hp_index, pool.req_to_token, pool.req_pool_indices, torch.tensor([0, 1, 2]),
                         torch.tensor([0, 0]), torch.tensor([1, 1]), pool.layout, sink=4, config=GluonConfig())
    with pytest.raises(ValueError, match="workspace"):
        _decode(pool, q, num_kv_splits=4, workspace=(torch.empty(2, 4, 2, 64), torch.empty(2, 4, 2)))
    # a NaN / inf / non-positive softmax scale would zero every output; an integer output dtype has no kernel
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="must be a finite positive number"):
            _decode(pool, q, sm_scale=bad)
    with pytest.raises(ValueError, match="out_dtype torch.int32 is not float32/float16/bfloat16"):
        _decode(pool, q, out_dtype=torch.int32)


def test_decode_debug_checks_indices():
    pool = _pool()
    q = rotate_q(pool, torch.randn(2, 4, 64))
    req = int(pool.req_pool_indices[1])
    bad = pool.req_to_token.clone()
    bad[req, 5] = 10_000  # an INT2 position pointing outside the pool
    with pytest.raises(ValueError, match="req_to_token"):
        decode_attention(q, pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v,
                         pool.hp_index, bad, pool.req_pool_indices, pool.seq_lens, pool.layout, sink=4, recent=8,
                         debug=True)
    hpi = pool.hp_index.clone()
    hpi[req, 4 + 19 % 8] = -1  # recent position 19 of request 1 has no HP row
    with pytest.raises(ValueError, match="hp_index"):
        decode_attention(
            q, pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v, hpi,
            pool.req_to_token, pool.req_pool_indices, pool.seq_lens, pool.layout, sink=4, recent=8, debug=True)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(
            q, pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v, pool.hp_index,
            pool.req_to_token, pool.req_pool_indices, torch.tensor([10, 999]), pool.layout, sink=4, recent=8,
            debug=True)
    # and the same pool with valid indices passes
    run_decode(pool, q, mma_dtype=torch.float32)


def test_decode_debug_accepts_what_the_kernels_read_through_int2():
    """The served states the kernels handle pass the debug check: sink positions past a request's
    ``sink_lens`` (the sink arena gave it no row; read through INT2) and, with a sliding window, positions
    outside it (SGLang freed their slots). An index the kernel does read is still refused."""
    pool = _pool()
    q = rotate_q(pool, torch.randn(2, 4, 64))
    req = int(pool.req_pool_indices[1])  # 20 positions: sink 0-3, INT2 4-11, recent 12-19
    sink_lens = torch.full((pool.hp_index.shape[0],), 4, dtype=torch.int32)
    sink_lens[req] = 2
    hpi = pool.hp_index.clone()
    hpi[req, 2:4] = -1  # no HP row for sink positions 2, 3: INT2 holds them
    args = (q, pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v, hpi,
            pool.req_to_token, pool.req_pool_indices, pool.seq_lens, pool.layout)
    want = decode_attention(*args, sink=4, recent=8, sink_lens=sink_lens, mma_dtype=torch.float32)
    got = decode_attention(*args, sink=4, recent=8, sink_lens=sink_lens, mma_dtype=torch.float32, debug=True)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="hp_index"):  # without sink_lens those positions need HP rows
        decode_attention(*args, sink=4, recent=8, mma_dtype=torch.float32, debug=True)
    window, L = 10, int(pool.seq_lens[1])
    tok = pool.req_to_token.clone()
    tok[req, 4:L - window] = 10_000  # freed slots outside the window (sink rows stay)
    wargs = (*args[:7], pool.hp_index, tok, *args[9:])
    decode_attention(*wargs, sink=4, recent=8, sliding_window=window, mma_dtype=torch.float32, debug=True)
    tok[req, L - window] = 10_000  # the oldest key the window reads
    with pytest.raises(ValueError, match="req_to_token"):
        decode_attention(*wargs, sink=4, recent=8, sliding_window=window, mma_dtype=torch.float32, debug=True)


def test_extend_rejects_bad_inputs():
    pool = _pool()
    q = torch.randn(5, 4, 64)
    common = (pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v, pool.hp_index,
              pool.req_to_token, pool.req_pool_indices)
    with pytest.raises(ValueError, match="qo_indptr"):
        extend_attention(q, *common, torch.tensor([0, 2, 5, 5]), torch.tensor([0, 0]), torch.tensor([2, 3]),
                         pool.layout, sink=4)
    with pytest.raises(ValueError, match="outside q"):
        extend_attention(q, *common, torch.tensor([0, 2, 5]), torch.tensor([0, 0]), torch.tensor([2, 9]),
                         pool.layout, sink=4, debug=True)


def test_head_block_plan():
    assert plan_head_blocks(32, 8) == (4, 4, 1, 16)
    assert plan_head_blocks(48, 8, max_block_h=4) == (6, 3, 2, 16)
    assert plan_head_blocks(96, 1, min_block_h=1, max_block_h=64) == (96, 48, 2, 64)
    with pytest.raises(ValueError):
        plan_head_blocks(10, 4)
    with pytest.raises(ValueError):
        TritonConfig(block_n=48)
    with pytest.raises(TypeError, match="unroll"):  # not a field (a loop unroll the GPU compiled wrongly)
        TritonConfig(unroll=2)


def test_needs_idx64_uses_the_offset_extent_of_strided_views(monkeypatch):
    """The served pool's code / pair views are slices of 36-byte rows: their largest offset exceeds
    numel(), so the int32/int64 choice must use the extent (7.8M slots x 8 kv heads give a
    1.997e9-element code view whose byte offsets reach 2.246e9)."""
    from sglang_oscar.kernels.validate import needs_idx64, offset_extent

    monkeypatch.delenv("SGLANG_OSCAR_FORCE_IDX64", raising=False)
    rows = torch.empty(7_800_000, 8, 36, dtype=torch.uint8, device="meta")
    codes, pairs = rows[..., :32], rows[..., 32:]
    assert codes.numel() < 2**31 - 1 < offset_extent(codes)
    assert offset_extent(codes) == (7_800_000 - 1) * 8 * 36 + 7 * 36 + 31
    assert needs_idx64(codes) and needs_idx64(pairs)
    small = torch.empty(1000, 8, 36, dtype=torch.uint8, device="meta")
    assert not needs_idx64(small[..., :32], None)
    assert offset_extent(torch.empty(0, 4)) == 0
    monkeypatch.setenv("SGLANG_OSCAR_FORCE_IDX64", "1")
    assert needs_idx64(small)
