"""Decode attention kernel vs the oracle (reference.oscar_attention, window mode "decode"), on
the interpreter or the GPU (``device`` fixture).

Pools hold several requests of different lengths at random non-contiguous slots / HP rows with
every unused slot poisoned; outputs and split workspaces are NaN-poisoned before each call.
fp32 HP data + fp32 MMA must match to rel. L2 < 1e-4; bf16/fp16 HP data with fp16 MMA < 1e-2.
Split policy, configs and merge: test_decode_policy.py; real-size GPU cases: test_decode_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from gpu_sizes import DEV, GPU_RECENT, GPU_SINK, scaled
from kv_fixtures import (
    build_pool,
    fresh_seed,
    make_config,
    reference_decode,
    rel_l2,
    rotate_q,
    run_decode,
    triton_config,
)
from sglang_oscar.kernels import GluonConfig, TritonConfig
from sglang_oscar.kernels.codes import CONVERT_ASM_PERM, CONVERT_BITS, CONVERT_SUBNORMAL

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
def test_decode_fp32_exact(device, lens, hq, hkv, dk, dv, group, quantizer, sdt):
    """fp32 HP rows and fp32 MMAs match the oracle to 1e-4: CPU at the lengths above, CUDA at a 5K
    context (the served windows, the default split count)."""
    fresh_seed()
    cuda = device == "cuda"
    sink, recent = (GPU_SINK, GPU_RECENT) if cuda else (SINK, RECENT)
    if cuda:
        lens = [scaled(5000), 400, 1]
    cfg = make_config(group_size=group, quantizer=quantizer, scale_dtype=sdt, sink=sink, recent=recent)
    pool = build_pool(lens, hkv, dk, dv, cfg, hp_dtype=torch.float32, device=DEV if cuda else "cpu")
    q = torch.randn(len(lens), hq, dk, device=pool.hp_k.device)
    ref = reference_decode(pool, q, hp_dtype=torch.float32)
    kw = dict(num_kv_splits=None, debug=False) if cuda else {}
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32, **kw)
    assert rel_l2(o, ref) < 1e-4


@pytest.mark.parametrize("hp_dtype,quantizer,group,sdt,convert", [
    (torch.bfloat16, "uniform", None, "float16", CONVERT_BITS),
    (torch.bfloat16, "lloyd-max", 64, "bfloat16", CONVERT_BITS),
    (torch.float16, "uniform", 16, "float32", None),  # None: the default config
    (torch.bfloat16, "lloyd-max", None, "float32", None),
])
def test_decode_half_precision(hp_dtype, quantizer, group, sdt, convert):
    fresh_seed()
    cfg = make_config(group_size=group, quantizer=quantizer, scale_dtype=sdt, sink=SINK, recent=RECENT)
    pool = build_pool(EDGE_LENS[:5] + [37], 2, 128, 128, cfg, hp_dtype=hp_dtype)
    q = torch.randn(6, 8, 128)
    ref = reference_decode(pool, q, hp_dtype=hp_dtype)
    o = run_decode(pool, rotate_q(pool, q).to(torch.bfloat16), mma_dtype=torch.float16,
                   config=None if convert is None else triton_config(pool, convert=convert), out_dtype=torch.bfloat16)
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


@pytest.mark.parametrize("window,dk", [(None, 64), (20, 128)])
def test_decode_attention_sinks(device, window, dk):
    """Learned attention-sink logits (GPT-OSS: one per q head, natural log) join each head's softmax
    denominator only, as the oracle's: fp32 to 1e-4 (CPU: the lengths below; CUDA: a 5K context,
    GPT-OSS's 64 q / 8 kv heads, the window 64x longer); on CUDA also bf16 rows with the default
    config (the Gluon engine at head_dim 128) to 1e-2. Without the sinks the output is far off."""
    fresh_seed()
    cuda = device == "cuda"
    lens, hq, hkv = ([scaled(5000), 400, 1], 64, 8) if cuda else ([3, 12, 25, 40], 6, 2)
    sink, recent = (GPU_SINK, GPU_RECENT) if cuda else (SINK, RECENT)
    window = None if window is None else (scaled(window * 64) if cuda else window)
    cfg = make_config(sink=sink, recent=recent)
    dev = DEV if cuda else "cpu"
    kw = dict(num_kv_splits=None, debug=False) if cuda else {}
    sinks = (torch.randn(hq, device=dev) * 2 + 1).float()
    for hp_dtype, mma, tol in [(torch.float32, torch.float32, 1e-4)] + ([(torch.bfloat16, None, 1e-2)] if cuda else []):
        pool = build_pool(lens, hkv, dk, dk, cfg, hp_dtype=hp_dtype, device=dev)
        q = torch.randn(len(lens), hq, dk, device=dev) * 2
        ref = reference_decode(pool, q, sliding_window=window, hp_dtype=hp_dtype, sinks=sinks)
        o = run_decode(pool, rotate_q(pool, q), mma_dtype=mma, sliding_window=window, sinks=sinks, **kw)
        assert rel_l2(o.float(), ref) < tol, hp_dtype
        assert rel_l2(reference_decode(pool, q, sliding_window=window, hp_dtype=hp_dtype), ref) > 20 * tol


@pytest.mark.parametrize("hq,hkv,max_block_h,min_block_h", [(12, 2, 4, 1), (16, 2, 4, 16), (6, 1, 2, 1)])
def test_decode_head_blocks_never_straddle(hq, hkv, max_block_h, min_block_h):
    """Groups split into blocks that divide them (6 -> 3+3, 8 -> 4+4), rows padded to min_block_h."""
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT)
    pool = build_pool([14, 22], hkv, 80, 80, cfg, hp_dtype=torch.float32, per_head_rotation=True)
    q = torch.randn(2, hq, 80)
    ref = reference_decode(pool, q, hp_dtype=torch.float32)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32,
                   config=triton_config(pool, max_block_h=max_block_h, min_block_h=min_block_h))
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
    o = run_decode(pool, qr, mma_dtype=torch.float32, num_kv_splits=9,
                   config=triton_config(pool, min_split_keys=min_keys))
    assert rel_l2(o, ref) < 1e-4
    if min_keys >= 1000:
        one = run_decode(pool, qr, mma_dtype=torch.float32, num_kv_splits=1)
        assert rel_l2(o, one) < 1e-6
        from sglang_oscar.kernels.configs import MAX_MIN_SPLIT_KEYS
        for bad in (-1, MAX_MIN_SPLIT_KEYS + 1, 10**9):
            for config_type in (TritonConfig, GluonConfig):
                with pytest.raises(ValueError, match=f"min_split_keys={bad} must be in"):
                    config_type(min_split_keys=bad)


@pytest.mark.parametrize("convert,group,pairs_ahead,defer", [
    (CONVERT_BITS, None, False, False), (CONVERT_ASM_PERM, None, False, False), (CONVERT_ASM_PERM, 64, False, False),
    (CONVERT_ASM_PERM, 32, False, False), (CONVERT_ASM_PERM, None, True, False), (CONVERT_BITS, None, True, False),
    (CONVERT_SUBNORMAL, None, False, False), (CONVERT_SUBNORMAL, None, True, False),
    (CONVERT_SUBNORMAL, 64, False, False), (CONVERT_SUBNORMAL, None, True, True),
    (CONVERT_ASM_PERM, None, False, True), (CONVERT_BITS, None, True, True), (CONVERT_ASM_PERM, 32, False, True),
])
def test_decode_tile_orientations_and_conversions(convert, group, pairs_ahead, defer):
    """Token-major tiles (one pair group per row) and head-major ones (groups 32 / 64), every code
    conversion as the interpreter runs it (3 / 5 through their emulations; 5 falls back to 3 off the
    token-major fast path), the hand-prefetched pair loads and the deferred softmax / zero-point sums
    (``defer_sums``; ignored by head-major tiles) give the oracle's answer (block_n 16 and lengths of
    several blocks, so the prefetch crosses blocks and ends)."""
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT, quantizer="lloyd-max", group_size=group)
    pool = build_pool([9, 70, 20], 2, 128, 128, cfg, hp_dtype=torch.bfloat16)
    q = torch.randn(3, 8, 128)
    ref = reference_decode(pool, q)
    tn = triton_config(pool, convert=convert, pairs_ahead=pairs_ahead, block_n=16, defer_sums=defer)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float16, config=tn)
    assert rel_l2(o, ref) < 1e-2
    o32 = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32, config=tn, num_kv_splits=1)
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
def test_decode_subnormal_and_pairs_ahead_match_convert3(monkeypatch, dk, dv, quantizer, window, cap, splits,
                                                           sinkl, idx64):
    """The subnormal conversion (5, run by its emulation here) with hand-prefetched pairs (the GPU
    default) equals the permuting conversion (3, emulated) without them and the oracle on odd lengths,
    windows, logit caps, per-request sink lengths, int64 offsets and head dims 80-256 (fp32 MMA: the
    two differ only by rounding)."""
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
    base = run_decode(pool, rotate_q(pool, q), config=triton_config(
        pool, convert=CONVERT_ASM_PERM, pairs_ahead=False, defer_sums=False, block_n=16), **kw)
    o = run_decode(pool, rotate_q(pool, q), config=triton_config(
        pool, convert=CONVERT_SUBNORMAL, pairs_ahead=True, block_n=16), **kw)
    assert rel_l2(o, base) < 1e-5
    if not sinkl:
        assert rel_l2(o, reference_decode(pool, q, sliding_window=window, logit_cap=cap,
                                          hp_dtype=torch.float32)) < 1e-4
