"""Decode attention kernel vs the oracle (reference.oscar_attention, window mode "decode").

Pools hold several requests of different lengths at random non-contiguous slots / HP rows with
every unused slot poisoned; outputs and split workspaces are NaN-poisoned before each call.
fp32 HP data + fp32 MMA must match to rel. L2 < 1e-4; bf16/fp16 HP data with fp16 MMA < 1e-2.
"""

from __future__ import annotations

import functools

import pytest
import torch
from sglang_oscar.kernels import Int2Layout
from kv_fixtures import (
    build_pool,
    fresh_seed,
    make_config,
    reference_decode,
    rel_l2,
    rotate_q,
    run_decode,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SINK, RECENT = 4, 8
# lengths around the window boundaries: L < sink, = sink, sink < L < sink+recent, = sink+recent, above
EDGE_LENS = [1, 3, 4, 5, 11, 12, 13, 29]

FP32_CASES = [
    # lens, hq, hkv, dk, dv, group, quantizer, scale dtype
    ([40, 9, 3], 2, 2, 64, 64, None, "uniform", "float16"),  # GQA 1 (MHA)
    ([12, 13, 33], 8, 2, 128, 128, None, "lloyd-max", "float32"),  # GQA 4
    ([5, 47], 12, 2, 128, 128, 32, "uniform", "bfloat16"),  # GQA 6, general (fine-group) path
    ([1, 30], 8, 1, 256, 256, 128, "lloyd-max", "float16"),  # GQA 8, grouped fast path
    ([31, 11], 4, 2, 192, 128, None, "uniform", "float16"),  # K 192 / V 128
    ([26], 2, 1, 512, 512, None, "uniform", "float16"),  # head_dim 512
]


@pytest.mark.parametrize("lens,hq,hkv,dk,dv,group,quantizer,sdt", FP32_CASES)
def test_decode_fp32_exact(lens, hq, hkv, dk, dv, group, quantizer, sdt):
    fresh_seed()
    cfg = make_config(group_size=group, quantizer=quantizer, scale_dtype=sdt, sink=SINK, recent=RECENT)
    pool = build_pool(lens, hkv, dk, dv, cfg, hp_dtype=torch.float32)
    q = torch.randn(len(lens), hq, dk)
    ref = reference_decode(pool, q, hp_dtype=torch.float32)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32)
    assert rel_l2(o, ref) < 1e-4


@pytest.mark.parametrize("hp_dtype,quantizer,group,sdt,convert", [
    (torch.bfloat16, "uniform", None, "float16", 1),
    (torch.bfloat16, "lloyd-max", 64, "bfloat16", 1),
    (torch.float16, "uniform", 16, "float32", 0),
    (torch.bfloat16, "lloyd-max", None, "float32", 0),
])
def test_decode_half_precision(hp_dtype, quantizer, group, sdt, convert):
    fresh_seed()
    cfg = make_config(group_size=group, quantizer=quantizer, scale_dtype=sdt, sink=SINK, recent=RECENT)
    pool = build_pool(EDGE_LENS[:5] + [37], 2, 128, 128, cfg, hp_dtype=hp_dtype)
    q = torch.randn(6, 8, 128)
    ref = reference_decode(pool, q, hp_dtype=hp_dtype)
    o = run_decode(pool, rotate_q(pool, q).to(torch.bfloat16), mma_dtype=torch.float16,
                   tuning=dict(convert=convert), out_dtype=torch.bfloat16)
    assert o.dtype == torch.bfloat16
    assert rel_l2(o, ref) < 1e-2


@pytest.mark.parametrize("sink,recent", [(4, 8), (0, 8), (4, 0), (0, 0), (8, 4)])
def test_decode_window_edges(sink, recent):
    """Every request of the batch sits at a different sink/recent boundary."""
    fresh_seed()
    cfg = make_config(sink=sink, recent=recent)
    pool = build_pool(EDGE_LENS, 2, 80, 80, cfg, hp_dtype=torch.float32)  # 80: the permuted-V path, padded quarters
    q = torch.randn(len(EDGE_LENS), 4, 80)
    ref = reference_decode(pool, q, hp_dtype=torch.float32)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32, num_kv_splits=2)
    assert rel_l2(o, ref) < 1e-4


@pytest.mark.parametrize("window,cap", [(6, None), (20, 3.0), (1, None), (100, 30.0)])
def test_decode_sliding_window_and_cap(window, cap):
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT)
    lens = [3, 12, 25, 40]
    pool = build_pool(lens, 2, 80, 80, cfg, hp_dtype=torch.float32)
    q = torch.randn(len(lens), 6, 80) * 2
    ref = reference_decode(pool, q, sliding_window=window, logit_cap=cap, hp_dtype=torch.float32)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32, sliding_window=window, logit_cap=cap)
    assert rel_l2(o, ref) < 1e-4


@pytest.mark.parametrize("hq,hkv,max_block_h,min_block_h", [(12, 2, 4, 1), (16, 2, 4, 16), (6, 1, 2, 1)])
def test_decode_head_blocks_never_straddle(hq, hkv, max_block_h, min_block_h):
    """Groups split into blocks that divide them (6 -> 3+3, 8 -> 4+4), rows padded to min_block_h."""
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT)
    pool = build_pool([14, 22], hkv, 80, 80, cfg, hp_dtype=torch.float32, per_head_rotation=True)
    q = torch.randn(2, hq, 80)
    ref = reference_decode(pool, q, hp_dtype=torch.float32)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32,
                   tuning=dict(max_block_h=max_block_h, min_block_h=min_block_h))
    assert rel_l2(o, ref) < 1e-4


def test_decode_counter_rotation_and_int64_indices():
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT, quantizer="lloyd-max", group_size=32)
    pool = build_pool([18, 7, 30], 2, 64, 128, cfg, hp_dtype=torch.float32, per_head_rotation=True,
                      index_dtype=torch.int64)
    q = torch.randn(3, 4, 64)
    ref = reference_decode(pool, q, counter_rotate=True, hp_dtype=torch.float32)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32, rotation_v=pool.rot_v,
                   out_dtype=torch.float32)
    assert rel_l2(o, ref) < 1e-4


def test_decode_split_count_invariance_and_kernel_written_pool():
    """Pool written by write_kv; 1, 2 and 7 INT2 splits give the same answer."""
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT, scale_dtype="float32")
    pool = build_pool([50, 20], 2, 64, 64, cfg, hp_dtype=torch.float32, write_with_kernel=True)
    q = torch.randn(2, 8, 64)
    ref = reference_decode(pool, q, hp_dtype=torch.float32)
    outs = [run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32, num_kv_splits=ns, num_hp_splits=nh)
            for ns, nh in ((1, 1), (2, 3), (7, 2))]
    for o in outs:
        assert rel_l2(o, ref) < 1e-4
        # split counts only change the fp32 summation order: <= 8.6e-7 over 40 seeds with head_dim
        # 64's conversion (bit trick, convert 1), 2.7e-7 with the permuting one it used before
        assert rel_l2(o, outs[0]) < 3e-6


@pytest.mark.parametrize("min_keys", [0, 16, 40, 1000, 1 << 24])
def test_decode_min_split_keys(min_keys):
    """``min_split_keys``: 9 INT2 splits with a floor on their length (rounded up to block_n 16) match
    the oracle; at a floor longer than every middle the whole middle is one split, the same sums as
    ``num_kv_splits=1``; the empty splits leave nothing behind (NaN-poisoned workspace)."""
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT, scale_dtype="float32")
    pool = build_pool([300, 50, 20, 5], 2, 64, 64, cfg, hp_dtype=torch.float32)
    q = torch.randn(4, 8, 64)
    ref = reference_decode(pool, q, hp_dtype=torch.float32)
    qr = rotate_q(pool, q)
    o = run_decode(pool, qr, mma_dtype=torch.float32, num_kv_splits=9, tuning={"min_split_keys": min_keys})
    assert rel_l2(o, ref) < 1e-4
    if min_keys >= 1000:
        one = run_decode(pool, qr, mma_dtype=torch.float32, num_kv_splits=1)
        assert rel_l2(o, one) < 1e-6
        from sglang_oscar.kernels.tuning import AttnTuning
        for bad in (-1, AttnTuning.MAX_MIN_SPLIT_KEYS + 1, 10**9):
            with pytest.raises(ValueError, match=f"min_split_keys={bad} must be in"):
                AttnTuning(min_split_keys=bad)


@pytest.mark.parametrize("token_major,convert,group,pairs_ahead,defer", [
    (False, 1, None, False, False), (True, 0, None, False, False), (True, 4, None, False, False),
    (False, 4, None, False, False), (True, 4, 64, False, False), (False, 4, 32, False, False),
    (True, 4, None, True, False), (True, 1, None, True, False), (True, 6, None, False, False),
    (True, 6, None, True, False), (True, 6, 64, False, False), (False, 6, None, False, False),
    (True, 6, None, True, True), (True, 4, None, False, True), (True, 0, None, True, True),
    (False, 4, None, False, True),
])
def test_decode_tile_orientations_and_conversions(token_major, convert, group, pairs_ahead, defer):
    """Token-major vs head-major tiles, every CPU-runnable code conversion (4 / 6 = the emulated
    forms of the CUDA-only converts 3 / 5; 6 falls back to 4 off the token-major fast path), the
    hand-prefetched pair loads and the deferred softmax / zero-point sums (``defer_sums``; ignored by
    head-major tiles) give the oracle's answer (block_n 16 and lengths of several blocks, so the
    prefetch crosses blocks and ends)."""
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT, quantizer="lloyd-max", group_size=group)
    pool = build_pool([9, 70, 20], 2, 128, 128, cfg, hp_dtype=torch.bfloat16)
    q = torch.randn(3, 8, 128)
    ref = reference_decode(pool, q)
    tn = dict(token_major=token_major, convert=convert, pairs_ahead=pairs_ahead, block_n=16, defer_sums=defer)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float16, tuning=tn)
    assert rel_l2(o, ref) < 1e-2
    o32 = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32, tuning=tn, num_kv_splits=1)
    assert rel_l2(o32, ref) < 1e-4


def test_decode_empty_request_and_int64_offsets(monkeypatch):
    """A request with seq_len 0 (e.g. CUDA-graph padding) gets zeros; the int64 offset path works."""
    fresh_seed()
    monkeypatch.setenv("SGLANG_OSCAR_FORCE_IDX64", "1")
    cfg = make_config(sink=SINK, recent=RECENT)
    pool = build_pool([17, 30], 2, 80, 80, cfg, hp_dtype=torch.float32)
    q = torch.randn(2, 4, 80)
    ref = reference_decode(pool, q, hp_dtype=torch.float32)
    q_rot = torch.cat([rotate_q(pool, q), torch.randn(1, 4, 80)])
    pool.req_pool_indices = torch.cat([pool.req_pool_indices, pool.req_pool_indices[:1]])
    pool.seq_lens = torch.cat([pool.seq_lens, torch.zeros(1, dtype=torch.int64)])
    o = run_decode(pool, q_rot, mma_dtype=torch.float32)
    assert rel_l2(o[:2], ref) < 1e-4
    assert bool((o[2] == 0).all())


@pytest.mark.parametrize("dk,dv,quantizer,window,cap,splits,sinkl,idx64", [
    (128, 128, "uniform", None, None, 1, False, False),
    (128, 128, "lloyd-max", 20, None, 5, False, False),
    (80, 80, "uniform", None, 30.0, 3, True, False),  # padded quarters (20 -> 32); 64 takes no permutation
    (192, 128, "lloyd-max", 7, 3.0, 2, False, True),
    (256, 256, "uniform", None, None, 1, True, False),
])
def test_decode_subnormal_and_pairs_ahead_match_convert4(monkeypatch, dk, dv, quantizer, window, cap, splits,
                                                           sinkl, idx64):
    """The CUDA-only subnormal conversion (emulated: 6) with hand-prefetched pairs (the GPU default)
    equals the emulated permuting conversion (4) without them and the oracle on odd lengths, windows, logit caps, per-request sink lengths,
    int64 offsets and head dims 80-256 (fp32 MMA: the two differ only by rounding)."""
    fresh_seed()
    if idx64:
        monkeypatch.setenv("SGLANG_OSCAR_FORCE_IDX64", "1")
    cfg = make_config(sink=4, recent=8, quantizer=quantizer)
    lens = [1, 5, 12, 13, 29, 50, 83]
    pool = build_pool(lens, 2, dk, dv, cfg, hp_dtype=torch.float32)
    q = torch.randn(len(lens), 8, dk) * 2
    kw = dict(mma_dtype=torch.float32, sliding_window=window, logit_cap=cap, num_kv_splits=splits)
    if sinkl:
        sl = torch.full((pool.hp_index.shape[0],), 4, dtype=torch.int32)
        sl[pool.req_pool_indices[1:3]] = torch.tensor([2, 0], dtype=torch.int32)
        kw["sink_lens"] = sl
    base = run_decode(pool, rotate_q(pool, q), tuning=dict(convert=4, pairs_ahead=False, block_n=16), **kw)
    o = run_decode(pool, rotate_q(pool, q), tuning=dict(convert=6, pairs_ahead=True, block_n=16), **kw)
    assert rel_l2(o, base) < 1e-5
    if not sinkl:
        assert rel_l2(o, reference_decode(pool, q, sliding_window=window, logit_cap=cap,
                                          hp_dtype=torch.float32)) < 1e-4


def test_choose_num_splits_policy():
    """8 programs per SM for <= 16 head programs, 32 otherwise; >= 64 keys per split of the bound;
    capped; only host constants (the CPU counts 4 SMs)."""
    from sglang_oscar.kernels import choose_num_splits

    assert choose_num_splits(1, 8) == 4  # ceil(8 * 4 / 8)
    assert choose_num_splits(1, 16) == 2
    assert choose_num_splits(2, 16) == 4  # 32 waves: ceil(32 * 4 / 32)
    assert choose_num_splits(1, 1) == 32
    assert choose_num_splits(1, 1, max_seq_len=100) == 2  # ceil(100 / 64)
    assert choose_num_splits(1, 1, max_seq_len=100, block_n=128) == 1
    assert choose_num_splits(1, 1, waves=1000.0) == 256
    assert choose_num_splits(10_000, 64) == 1


def test_choose_num_splits_gluon_policy(monkeypatch):
    """Gluon: 11 programs per SM up to 8 programs, 12 up to 16, 11 for 256-511 (one resident wave),
    32 otherwise; at 132 SMs (an H200) every branch gives a count the neighbouring rule would not."""
    from sglang_oscar.kernels.decode import splits
    from sglang_oscar.kernels.tuning import AttnTuning

    monkeypatch.setattr(splits, "_sm_count", lambda device: 132)
    ns = functools.partial(splits.choose_num_splits, engine="gluon")
    assert ns(1, 8) == 182  # ceil(11 * 132 / 8); 12 waves: 198
    assert ns(2, 8) == 99  # 16 programs: ceil(12 * 132 / 16); 11 waves: 91
    assert ns(4, 8) == 132  # 32 programs: 32 waves
    assert ns(32, 8) == 6  # 256 programs: ceil(11 * 132 / 256); 32 waves: 17
    assert ns(63, 8) == 3  # 504 programs: still one wave
    assert ns(64, 8) == 9  # 512 programs: 32 waves; 11 waves: 3
    assert splits.choose_num_splits(32, 8) == 17  # the Triton engine keeps 32 waves at 256 programs
    # the split floor caps the count under a static bound (default_num_kv_splits): 4K at batch 4
    tn = AttnTuning().resolved(128)
    assert splits.default_num_kv_splits(tn, "gluon", 4, 32, 8, max_seq_len=4096) == 16  # 4096 / 256
    assert splits.default_num_kv_splits(tn, "gluon", 1, 32, 8, max_seq_len=4096) == 32  # 4096 / 128
    assert splits.default_num_kv_splits(AttnTuning(min_split_keys=0).resolved(128), "gluon", 4, 32, 8,
                                        max_seq_len=4096) == 64  # 4096 / 64


def test_default_min_split_keys():
    """128 keys up to 16 programs, 256 above, Gluon only; an explicit value (0 included) wins."""
    from sglang_oscar.kernels.decode.splits import default_min_split_keys
    from sglang_oscar.kernels.tuning import AttnTuning

    assert [default_min_split_keys("gluon", p) for p in (1, 16, 17, 4096)] == [128, 128, 256, 256]
    assert default_min_split_keys("triton", 8) == 0
    assert AttnTuning().resolved(128).min_split_keys is None  # decided at launch, by engine and programs
    assert AttnTuning(min_split_keys=0).resolved(128).min_split_keys == 0


def test_default_tuning_resolution(monkeypatch):
    """The defaults the GPU and the interpreter actually run (docs/kernels.md "Defaults")."""
    from sglang_oscar.kernels.tuning import AttnTuning

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = AttnTuning().resolved(128)
    assert (t.convert, t.pairs_ahead, t.block_n, t.num_warps, t.defer_sums) == (5, True, 32, 1, True)
    t = AttnTuning().resolved(256)  # larger heads: the GPU-tested convert 3, no pairs_ahead
    assert (t.convert, t.pairs_ahead, t.block_n, t.num_warps, t.defer_sums) == (3, False, 64, 2, False)
    assert AttnTuning(pairs_ahead=True).resolved(256).defer_sums is False  # only where GPU-tested (65-128)
    t = AttnTuning().resolved(128, extend=True)
    assert (t.convert, t.pairs_ahead, t.defer_sums) == (2, False, False)
    assert AttnTuning(pairs_ahead=False).resolved(128).defer_sums is False
    assert AttnTuning(num_stages=1).resolved(128).defer_sums is False  # 1 stage: keep its registers
    assert AttnTuning(num_stages=1, defer_sums=True).resolved(128).defer_sums is True  # explicit wins
    assert AttnTuning(convert=3).resolved(128).pairs_ahead is True  # unset knobs take their default
    assert AttnTuning(pairs_ahead=False).resolved(128).pairs_ahead is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    t = AttnTuning().resolved(128)
    assert (t.convert, t.pairs_ahead, t.defer_sums) == (6, True, True)  # the GPU default's path
    assert (AttnTuning().resolved(512).convert, AttnTuning().resolved(512).pairs_ahead) == (4, False)
    # head_dim 64: no permuting conversion (wrong on the GPU at quarters of 16 codes)
    assert (AttnTuning().resolved(64).convert, AttnTuning().resolved(64).pairs_ahead) == (2, False)
    assert (AttnTuning().resolved(80).convert, AttnTuning().resolved(80).pairs_ahead) == (6, True)
    monkeypatch.delenv("TRITON_INTERPRET")
    t = AttnTuning().resolved(64)
    assert (t.convert, t.pairs_ahead, t.block_n, t.num_warps) == (2, False, 32, 1)
    t = AttnTuning().resolved(128, min_head_dim=64)  # K 128 / V 64: the smaller one decides
    assert (t.convert, t.pairs_ahead, t.block_n, t.num_warps) == (2, False, 32, 1)


def test_num_stages_follow_requests_times_kv_heads(monkeypatch):
    """GPU decode at head_dim 65-128: no async-copy pipeline from STAGES1_MIN_PAIRS (request, kv head)
    pairs; an explicit num_stages, other head dims, extend and the interpreter keep theirs; the
    decode wrapper resolves with B x H_kv."""
    from sglang_oscar.kernels.decode import plan as plan_mod
    from sglang_oscar.kernels.tuning import STAGES1_MIN_PAIRS, AttnTuning, _resolved_tuning

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert STAGES1_MIN_PAIRS == 256
    assert AttnTuning().resolved(128).num_stages == 2
    assert AttnTuning().resolved(128, pairs=255).num_stages == 2
    assert AttnTuning().resolved(128, pairs=256).num_stages == 1
    assert AttnTuning().resolved(128, pairs=255).defer_sums is True  # 2 stages: deferred sums
    assert AttnTuning().resolved(128, pairs=256).defer_sums is False  # 1 stage: not
    assert AttnTuning().resolved(96, pairs=4096).num_stages == 1
    assert AttnTuning(num_stages=2).resolved(128, pairs=256).num_stages == 2
    assert AttnTuning().resolved(256, pairs=4096).num_stages == 2  # larger heads: unmeasured, unchanged
    assert AttnTuning().resolved(64, pairs=4096).num_stages == 2  # convert-2 path: unchanged
    assert AttnTuning().resolved(128, extend=True, pairs=4096).num_stages == 2
    lay = Int2Layout.create(128, 128)
    assert _resolved_tuning(None, lay, False, pairs=32 * 8).num_stages == 1
    assert _resolved_tuning(None, lay, False, pairs=8 * 8).num_stages == 2
    assert _resolved_tuning({"num_stages": 3}, lay, False, pairs=32 * 8).num_stages == 3

    seen = []
    real = plan_mod._resolved_tuning
    monkeypatch.setattr(plan_mod, "_resolved_tuning", lambda *a, **k: seen.append(k.get("pairs")) or real(*a, **k))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert AttnTuning().resolved(128, pairs=4096).num_stages == 1  # the interpreter's own default
    assert AttnTuning().resolved(128, pairs=4096).defer_sums is False  # ... but the GPU's choice of sums
    assert AttnTuning().resolved(128, pairs=8).defer_sums is True
    assert AttnTuning(num_stages=1).resolved(128, pairs=8).defer_sums is False  # as on the GPU
    fresh_seed()
    pool = build_pool([40, 9, 70], 2, 64, 64, make_config(sink=SINK, recent=RECENT), hp_dtype=torch.float32)
    q = torch.randn(3, 4, 64)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32)
    assert seen == [3 * 2]
    assert rel_l2(o, reference_decode(pool, q, hp_dtype=torch.float32)) < 1e-4


def test_permuting_conversions_need_quarters_of_32_codes():
    """``permuting_ok``: the H200 gave 0.47-0.58 rel. L2 with convert 3 / 5 at head_dim 64
    (``tests/kernels/decode_matrix.py``); the decode wrapper routes such layouts to 2 (GPU) / 1 (interpreter)."""
    from sglang_oscar.kernels.tuning import permuting_ok

    def lay(dk, dv, group=None):
        return Int2Layout.create(dk, dv, group_size=group, k_clip_ratio=0.96, v_clip_ratio=0.92)

    assert permuting_ok(lay(128, 128)) and permuting_ok(lay(192, 128)) and permuting_ok(lay(256, 256, 128))
    assert permuting_ok(lay(80, 80)) and permuting_ok(lay(512, 512))
    assert not permuting_ok(lay(64, 64)) and not permuting_ok(lay(64, 64, 16))
    assert not permuting_ok(lay(128, 64))  # the smaller of K and V decides
    assert not permuting_ok(lay(128, 128, 16))  # quarters span several groups


def test_effective_convert_routing(monkeypatch):
    """5/6 only on the token-major fast path (else 3/4, then 2/1); the interpreter emulates."""
    from sglang_oscar.kernels.tuning import effective_convert

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    f16 = torch.float16
    assert effective_convert(5, f16, True, subnormal_ok=True) == 6
    assert effective_convert(5, f16, True, subnormal_ok=False) == 4
    assert effective_convert(3, f16, True) == 4
    assert effective_convert(5, f16, False, subnormal_ok=True) == 1
    monkeypatch.delenv("TRITON_INTERPRET")
    assert effective_convert(5, f16, True, subnormal_ok=True) == 5
    # fp32 / bf16 operands on the GPU: 5 takes 3's route (the plain bit trick)
    assert effective_convert(5, torch.float32, True, subnormal_ok=True) == 1
    assert effective_convert(5, torch.bfloat16, True, subnormal_ok=True) == 1
    assert effective_convert(5, f16, True, subnormal_ok=False) == 3
    assert effective_convert(5, f16, False, subnormal_ok=True) == 2
    assert effective_convert(5, torch.bfloat16, False) == 1


@pytest.mark.parametrize("bsz,hq,ns,dv,block_d,chunk", [
    (1, 4, 37, 128, None, 4096),  # default tiles: 16 dims per program, one chunk of 64 splits
    (2, 3, 9, 96, 64, 256),  # D_v not a power of two (masked dims), several chunks of 4 splits
    (3, 2, 1, 64, 16, 4096),  # one split
    (2, 2, 5, 512, None, 4096),  # D_v 512: several dim blocks
])
def test_decode_merge_matches_lse_weighted_mean(bsz, hq, ns, dv, block_d, chunk):
    """Stage 2 alone (``decode.merge.decode_merge``) vs its formula: the base-2-LSE-weighted mean of the
    split outputs, empty splits (``lse = -inf``, output poisoned) skipped, zeros where all are empty."""
    from sglang_oscar.kernels.decode.merge import decode_merge

    fresh_seed()
    o_part = torch.randn(bsz, hq, ns + 3, dv)  # 3 extra splits past num_splits: must not be read
    lse = torch.randn(bsz, hq, ns + 3) * 4
    lse[..., ns:] = 50.0
    o_part[..., ns:, :] = float("nan")
    if ns > 2:
        lse[0, 0, 1] = float("-inf")  # an empty split inside the range: its (poisoned) output is skipped
        o_part[0, 0, 1] = float("nan")
    lse[-1, -1, :] = float("-inf")  # a (request, head) no split saw: zeros
    w = torch.exp2(lse[..., :ns] - lse[..., :ns].amax(-1, keepdim=True).clamp_min(-1e30).nan_to_num(0.0))
    w = torch.where(torch.isinf(lse[..., :ns]), 0.0, w)
    expect = (w[..., None] * torch.nan_to_num(o_part[..., :ns, :])).sum(-2) / w.sum(-1, keepdim=True).clamp_min(1e-30)
    out = torch.full((bsz, hq, dv), float("nan"))
    decode_merge(o_part, lse, out, ns, block_d=block_d, chunk=chunk)
    assert torch.isfinite(out).all()
    assert torch.equal(out[-1, -1], torch.zeros(dv))
    assert rel_l2(out, expect) < 1e-5
    out16 = torch.full((bsz, hq, dv), float("nan"), dtype=torch.bfloat16)  # rounded on the way out
    decode_merge(o_part, lse, out16, ns, block_d=block_d, chunk=chunk)
    assert rel_l2(out16.float(), expect) < 1e-2


def test_decode_merge_rejects_bad_arguments():
    from sglang_oscar.kernels.decode.merge import decode_merge

    o_part, lse, out = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4), torch.zeros(1, 2, 8)
    for kw, match in ((dict(num_splits=5), "num_splits=5"), (dict(num_splits=0), "num_splits=0"),
                      (dict(num_splits=2, block_d=12), "block_d=12"), (dict(num_splits=2, chunk=100), "chunk=100")):
        with pytest.raises(ValueError, match=match):
            decode_merge(o_part, lse, out, **kw)
    with pytest.raises(ValueError, match=r"o_part has shape \(1, 2, 4, 8\); dim 1 must be 3"):
        decode_merge(o_part, lse, torch.zeros(1, 3, 8), 2)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        decode_merge(o_part, lse, torch.zeros(1, 2, 16)[..., ::2], 2)
    with pytest.raises(ValueError, match="lse must have 3 dims"):  # extra dims used to pass and merge garbage
        decode_merge(o_part, lse[..., None], out, 2)
    with pytest.raises(ValueError, match="o_part has dtype"):
        decode_merge(o_part.half(), lse, out, 2)
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        decode_merge(o_part, lse, out.double(), 2)
    with pytest.raises(ValueError, match="num_splits=2.5"):
        decode_merge(o_part, lse, out, 2.5)


def test_merge_block_d_rule():
    """Output dims per merge program: the largest of 16-128 that keeps 2,048 programs, else 16, capped
    by next_pow2(D_v) (docs/kernels.md#merge-grid)."""
    from sglang_oscar.kernels.decode.merge import merge_block_d

    assert merge_block_d(1, 32, 128) == 16  # 256 programs at 16: fewer than 2,048 anyway
    assert merge_block_d(8, 32, 128) == 16  # 32 would leave 1,024
    assert merge_block_d(32, 32, 128) == 64  # 2,048 programs
    assert merge_block_d(64, 32, 128) == 128
    assert merge_block_d(64, 32, 96) == 128  # next_pow2(96)
    assert merge_block_d(1, 32, 512) == 16
    assert merge_block_d(1, 1, 8) == 8  # never wider than the head


def test_decode_accepts_a_workspace_sized_for_a_larger_batch():
    """decode_attention takes a preallocated workspace with more rows than the step's batch (a CUDA
    graph's buffers): the merge reads the first B rows."""
    from sglang_oscar.kernels import decode_attention, decode_num_hp_splits, decode_workspace
    from sglang_oscar.kernels.decode.merge import decode_merge

    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT)
    pool = build_pool([20, 9], 2, 64, 64, cfg, hp_dtype=torch.float32)
    q = torch.randn(2, 4, 64)
    nhp = decode_num_hp_splits(SINK, RECENT)
    ws = decode_workspace(5, 4, 64, 3 + nhp, q.device)
    o = decode_attention(rotate_q(pool, q), pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k,
                         pool.hp_v, pool.hp_index, pool.req_to_token, pool.req_pool_indices, pool.seq_lens,
                         pool.layout, sink=SINK, recent=RECENT, num_kv_splits=3, num_hp_splits=nhp, workspace=ws,
                         mma_dtype=torch.float32)
    assert rel_l2(o, reference_decode(pool, q, hp_dtype=torch.float32)) < 1e-4
    out = torch.full((2, 4, 64), float("nan"))
    decode_merge(ws[0], ws[1], out, 3 + nhp)  # the public merge accepts the larger workspace too
    assert torch.equal(out, o)
    with pytest.raises(ValueError, match="fewer than the 2 requests"):
        decode_merge(ws[0][:1], ws[1][:1], out, 3 + nhp)


def test_default_num_kv_splits_counts_the_engines_head_blocks():
    """The split count decode_attention picks by default (and benchmarks size workspaces with): the
    Gluon engine runs one program per 8 q heads, the Triton engine per plan_head_blocks block."""
    from sglang_oscar.kernels import AttnTuning, plan_head_blocks
    from sglang_oscar.kernels.decode.splits import choose_num_splits, default_num_kv_splits

    tn = AttnTuning.of(None).resolved(128)
    cpu = torch.device("cpu")
    for bsz, hq, hkv in ((1, 32, 8), (8, 32, 8), (1, 64, 4), (2, 24, 2)):
        bpk = plan_head_blocks(hq, hkv, tn.min_block_h, tn.max_block_h)[2]
        assert default_num_kv_splits(tn, "triton", bsz, hq, hkv, device=cpu, max_seq_len=131072) == \
            choose_num_splits(bsz, hkv * bpk, device=cpu, max_seq_len=131072, block_n=tn.block_n, engine="triton")
        assert default_num_kv_splits(tn, "gluon", bsz, hq, hkv, device=cpu, max_seq_len=131072) == \
            choose_num_splits(bsz, hkv * -(-(hq // hkv) // 8), device=cpu, max_seq_len=131072, block_n=tn.block_n,
                              engine="gluon")
