"""Decode attention kernel vs the oracle (reference.oscar_attention, window mode "decode").

Pools hold several requests of different lengths at random non-contiguous slots / HP rows with
every unused slot poisoned; outputs and split workspaces are NaN-poisoned before each call.
fp32 HP data + fp32 MMA must match to rel. L2 < 1e-4; bf16/fp16 HP data with fp16 MMA < 1e-2.
"""

from __future__ import annotations

import functools

import pytest
import torch
from sglang_oscar.kernels import GluonConfig, Int2Layout, TritonConfig, default_triton_config
from sglang_oscar.kernels.codes import CONVERT_ASM, CONVERT_ASM_PERM, CONVERT_BITS, CONVERT_SUBNORMAL
from sglang_oscar.kernels.configs import GLUON_MAXNREG
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
import dataclasses
import math
import random
from kv_fixtures import random_rows
from sglang_oscar.kernels import DecodeWorkspace, decode_attention
from gpu_sizes import DEV, GPU_RECENT, GPU_SINK, SCALE, scaled

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
    assert splits.default_num_kv_splits(GluonConfig(), 4, 32, 8, max_seq_len=4096) == 16  # 4096 / 256
    assert splits.default_num_kv_splits(GluonConfig(), 1, 32, 8, max_seq_len=4096) == 32  # 4096 / 128
    assert splits.default_num_kv_splits(GluonConfig(min_split_keys=0), 4, 32, 8,
                                        max_seq_len=4096) == 64  # 4096 / 64


def test_default_min_split_keys():
    """128 keys up to 16 programs, 256 above, Gluon only; an explicit value (0 included) wins."""
    from sglang_oscar.kernels.decode.splits import _split_keys, default_min_split_keys

    assert [default_min_split_keys("gluon", p) for p in (1, 16, 17, 4096)] == [128, 128, 256, 256]
    assert default_min_split_keys("triton", 8) == 0
    # decided at launch, by engine and programs
    assert default_triton_config(Int2Layout.create(128, 128)).min_split_keys is None
    assert GluonConfig().min_split_keys is None
    assert _split_keys(GluonConfig(), 8) == 128 and _split_keys(TritonConfig(), 8) == 0
    assert _split_keys(GluonConfig(min_split_keys=0), 8) == 0  # an explicit value wins


def _fields(cfg, *names):
    return tuple(getattr(cfg, n) for n in names)


def test_default_triton_config(monkeypatch):
    """The configs the GPU and the interpreter actually run (docs/kernels.md "Decode defaults"): the
    GPU's conversions under the interpreter too (it runs them by emulation)."""
    def lay(dk, dv=None):
        return Int2Layout.create(dk, dv or dk)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = default_triton_config(lay(128))
    assert _fields(t, "convert", "pairs_ahead", "block_n", "num_warps", "defer_sums") == (5, True, 32, 1, True)
    assert t == TritonConfig()  # the dataclass defaults are the head_dim-128 decode config
    t = default_triton_config(lay(256))  # larger heads: the GPU-tested convert 3, no pairs_ahead
    assert _fields(t, "convert", "pairs_ahead", "block_n", "num_warps", "defer_sums") == (3, False, 64, 2, False)
    t = default_triton_config(lay(128), extend=True)
    assert _fields(t, "convert", "pairs_ahead", "defer_sums", "block_m", "block_n", "num_warps") == (
        2, False, False, 64, 64, 4)
    # fp32 operands above head_dim 256: one stage (two need 281 KB of shared memory at 512, compile_sm90.py)
    assert [default_triton_config(lay(d), mma_dtype=m).num_stages
            for d, m in ((512, torch.float32), (512, torch.float16), (256, torch.float32))] == [1, 2, 2]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    t = default_triton_config(lay(128))
    assert _fields(t, "convert", "pairs_ahead", "defer_sums", "block_n", "min_block_h") == (5, True, True, 16, 1)
    assert _fields(default_triton_config(lay(512)), "convert", "pairs_ahead") == (3, False)
    # head_dim 64: no permuting conversion (wrong on the GPU at quarters of 16 codes)
    assert _fields(default_triton_config(lay(64)), "convert", "pairs_ahead") == (2, False)
    assert _fields(default_triton_config(lay(80)), "convert", "pairs_ahead") == (5, True)
    monkeypatch.delenv("TRITON_INTERPRET")
    t = default_triton_config(lay(64))
    assert _fields(t, "convert", "pairs_ahead", "block_n", "num_warps") == (2, False, 32, 1)
    t = default_triton_config(lay(128, 64))  # K 128 / V 64: the smaller one decides
    assert _fields(t, "convert", "pairs_ahead", "block_n", "num_warps") == (2, False, 32, 1)


def test_configs_validate_their_fields():
    """Each config refuses values its kernels cannot take, naming the field; configs are frozen."""
    for kw, match in ((dict(block_n=48), "block_n=48 must be a power of two"), (dict(num_stages=0), "num_stages=0"),
                      (dict(convert=0), "convert=0 must be one of"), (dict(convert=4), "convert=4 must be one of"),
                      (dict(maxnreg=300), "maxnreg=300"), (dict(pairs_ahead=1), "pairs_ahead=1 must be True"),
                      (dict(block_n="32"), "block_n='32' must be an int"), (dict(max_block_h=0), "max_block_h=0")):
        with pytest.raises(ValueError, match=match):
            TritonConfig(**kw)
    for kw, match in ((dict(block_n=64), "block_n=64 must be 16 or 32"), (dict(maxnreg=8), "maxnreg=8")):
        with pytest.raises(ValueError, match=match):
            GluonConfig(**kw)
    with pytest.raises(TypeError):  # not a Gluon field
        GluonConfig(num_stages=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TritonConfig().block_n = 16
    assert (TritonConfig.engine, GluonConfig.engine) == ("triton", "gluon")


def test_num_stages_follow_requests_times_kv_heads(monkeypatch):
    """GPU decode at head_dim 65-128: no async-copy pipeline (and no deferred sums) from
    STAGES1_MIN_PAIRS (request, kv head) pairs; other head dims, extend and the interpreter keep their
    stage count; the decode plan resolves with B x H_kv."""
    from sglang_oscar.kernels.configs import STAGES1_MIN_PAIRS
    from sglang_oscar.kernels.decode import plan as plan_mod

    def cfg(dk, **kw):
        return default_triton_config(Int2Layout.create(dk, dk), **kw)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert STAGES1_MIN_PAIRS == 256
    assert cfg(128).num_stages == 2
    assert cfg(128, pairs=255).num_stages == 2
    assert cfg(128, pairs=256).num_stages == 1
    assert cfg(128, pairs=255).defer_sums is True  # 2 stages: deferred sums
    assert cfg(128, pairs=256).defer_sums is False  # 1 stage: not
    assert cfg(96, pairs=4096).num_stages == 1
    assert cfg(256, pairs=4096).num_stages == 2  # larger heads: unmeasured, unchanged
    assert cfg(64, pairs=4096).num_stages == 2  # convert-2 path: unchanged
    assert cfg(128, extend=True, pairs=4096).num_stages == 2

    seen = []
    real = plan_mod.decode_config
    monkeypatch.setattr(plan_mod, "decode_config", lambda *a, **k: seen.append(a[2]) or real(*a, **k))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cfg(128, pairs=4096).num_stages == 1  # the interpreter's own default
    assert cfg(128, pairs=4096).defer_sums is False  # ... but the GPU's choice of sums
    assert cfg(128, pairs=8).defer_sums is True
    fresh_seed()
    pool = build_pool([40, 9, 70], 2, 64, 64, make_config(sink=SINK, recent=RECENT), hp_dtype=torch.float32)
    q = torch.randn(3, 4, 64)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32)
    assert seen == [3 * 2]
    assert rel_l2(o, reference_decode(pool, q, hp_dtype=torch.float32)) < 1e-4


def test_permuting_conversions_need_quarters_of_32_codes():
    """``permuting_ok``: the H200 gave 0.47-0.58 rel. L2 with convert 3 / 5 at head_dim 64
    (``tests/kernels/decode_matrix.py``); the decode wrapper routes such layouts to 2 (GPU) / 1 (interpreter)."""
    from sglang_oscar.kernels.configs import permuting_ok

    def lay(dk, dv, group=None):
        return Int2Layout.create(dk, dv, group_size=group, k_clip_ratio=0.96, v_clip_ratio=0.92)

    assert permuting_ok(lay(128, 128)) and permuting_ok(lay(192, 128)) and permuting_ok(lay(256, 256, 128))
    assert permuting_ok(lay(80, 80)) and permuting_ok(lay(512, 512))
    assert not permuting_ok(lay(64, 64)) and not permuting_ok(lay(64, 64, 16))
    assert not permuting_ok(lay(128, 64))  # the smaller of K and V decides
    assert not permuting_ok(lay(128, 128, 16))  # quarters span several groups


def test_effective_convert_routing(monkeypatch):
    """5/6 only on the token-major fast path (else 3/4, then 2/1); the interpreter emulates."""
    from sglang_oscar.kernels.configs import effective_convert

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
    from sglang_oscar.kernels import decode_attention, decode_num_hp_splits
    from sglang_oscar.kernels.decode.merge import decode_merge

    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT)
    pool = build_pool([20, 9], 2, 64, 64, cfg, hp_dtype=torch.float32)
    q = torch.randn(2, 4, 64)
    nhp = decode_num_hp_splits(SINK, RECENT)
    ws = DecodeWorkspace(q.device).views(5, 4, 64, 3 + nhp)
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
    from sglang_oscar.kernels import plan_head_blocks
    from sglang_oscar.kernels.decode.splits import choose_num_splits, default_num_kv_splits

    tn = default_triton_config(Int2Layout.create(128, 128))
    cpu = torch.device("cpu")
    for bsz, hq, hkv in ((1, 32, 8), (8, 32, 8), (1, 64, 4), (2, 24, 2)):
        bpk = plan_head_blocks(hq, hkv, tn.min_block_h, tn.max_block_h)[2]
        assert default_num_kv_splits(tn, bsz, hq, hkv, device=cpu, max_seq_len=131072) == \
            choose_num_splits(bsz, hkv * bpk, device=cpu, max_seq_len=131072, block_n=tn.block_n, engine="triton")
        assert default_num_kv_splits(GluonConfig(), bsz, hq, hkv, device=cpu, max_seq_len=131072) == \
            choose_num_splits(bsz, hkv * -(-(hq // hkv) // 8), device=cpu, max_seq_len=131072,
                              block_n=GluonConfig().block_n, engine="gluon")


# ------------------------------ GPU cases (real sizes, `-m gpu`; sizes and dry run: gpu_sizes.py)


DECODE_CASES = {
    # name: (lens, hq, hkv, dk, dv, group, quantizer, sdt, window, cap)
    "b1_ctx128k": ([131072], 32, 8, 128, 128, None, "uniform", "float16", None, None),
    "b64_mixed": (None, 32, 8, 128, 128, None, "uniform", "float16", None, None),
    "b8_32k_lloyd_g64": ([32768] * 8, 32, 8, 128, 128, 64, "lloyd-max", "bfloat16", None, None),
    "k192_v128_mha": ([20000, 777, 300], 8, 8, 192, 128, None, "uniform", "float32", None, None),
    "d256_g128_gqa4": ([16384] * 4, 16, 4, 256, 256, 128, "lloyd-max", "float16", None, None),
    "d512_gqa2": ([8192, 5000], 8, 4, 512, 512, None, "uniform", "bfloat16", None, None),
    "window_cap": ([16384] * 8, 32, 8, 128, 128, None, "uniform", "float16", 4096, 30.0),
    "gqa6": ([10000] * 4, 24, 4, 128, 128, None, "uniform", "float16", None, None),
    "d64_gqa4_lloyd": ([30000, 1000, 77], 16, 4, 64, 64, None, "lloyd-max", "float16", None, 30.0),
    # 32 x 8 = 256 (request, kv head) pairs: the num_stages-1 default (configs.STAGES1_MIN_PAIRS)
    "b32_lloyd_window_cap": ([6000] * 32, 32, 8, 128, 128, None, "lloyd-max", "bfloat16", 2048, 30.0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_gpu_decode_vs_reference(name):
    fresh_seed()
    lens, hq, hkv, dk, dv, group, quantizer, sdt, window, cap = DECODE_CASES[name]
    if lens is None:
        lens = [random.randint(1, scaled(8192)) for _ in range(64 if SCALE >= 0.1 else 4)]
        lens[:4] = [1, GPU_SINK, GPU_SINK + GPU_RECENT, GPU_SINK + GPU_RECENT + 1]
    lens = [max(1, scaled(x)) if x > 1000 else x for x in lens]
    window = scaled(window) if window else window
    cfg = make_config(group_size=group, quantizer=quantizer, scale_dtype=sdt, sink=GPU_SINK, recent=GPU_RECENT)
    pool = build_pool(lens, hkv, dk, dv, cfg, hp_dtype=torch.bfloat16, device=DEV)
    q = torch.randn(len(lens), hq, dk, device=DEV)
    ref = reference_decode(pool, q, sliding_window=window, logit_cap=cap)
    o = run_decode(pool, rotate_q(pool, q).to(torch.bfloat16), sliding_window=window, logit_cap=cap,
                   num_kv_splits=None, out_dtype=torch.bfloat16, debug=False)
    assert rel_l2(o, ref) < 1e-2


def _zero_mean_rows(t, h, d, device):
    return torch.randn(t, h, d, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    pytest.param(None, id="auto"), pytest.param(TritonConfig, id="triton"),
    pytest.param(TritonConfig(convert=CONVERT_ASM, block_n=64), id="triton-asm-bn64"),
    pytest.param(TritonConfig(convert=CONVERT_BITS), id="triton-bits"),
    pytest.param(TritonConfig(convert=CONVERT_ASM_PERM, pairs_ahead=False, defer_sums=False), id="triton-perm"),
    pytest.param(TritonConfig(pairs_ahead=False, defer_sums=False), id="triton-subnormal-no-prefetch"),
    pytest.param(GluonConfig(), id="gluon"), pytest.param(GluonConfig(block_n=16), id="gluon-bn16")])
def test_gpu_decode_long_split_independent_of_split_count(config):
    """One split walking 128K keys == many short splits == the oracle, on zero-mean values.

    Zero-mean V makes the output small against the values the accumulator sums (the zero-point
    correction cancels most of ``sum pw E``), so an accumulation bias shows: before the value
    MMAs started from zero each block, tensor-core truncation put a 64K-token split 1-8% off.
    """
    fresh_seed()
    cfg = make_config(sink=GPU_SINK, recent=GPU_RECENT)
    lens = [scaled(131072), scaled(65536)]
    pool = build_pool(lens, 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV, rows=_zero_mean_rows)
    q = torch.randn(len(lens), 32, 128, device=DEV)
    ref = reference_decode(pool, q)
    outs = {ns: run_decode(pool, rotate_q(pool, q), config=config, num_kv_splits=ns, debug=False)
            for ns in (1, 2, 64)}
    errs = {ns: rel_l2(o, ref) for ns, o in outs.items()}
    assert all(e < 1e-2 for e in errs.values()), errs
    assert rel_l2(outs[1], outs[64]) < 5e-3, (errs, rel_l2(outs[1], outs[64]))


TRITON_CONFIGS = [  # variants of the head_dim-128 GPU default (TritonConfig()), each vs the oracle
    TritonConfig(convert=CONVERT_ASM_PERM, pairs_ahead=False, defer_sums=False), TritonConfig(convert=CONVERT_ASM_PERM),
    TritonConfig(convert=CONVERT_ASM, block_n=64), TritonConfig(pairs_ahead=False, defer_sums=False),
    TritonConfig(),  # the default below 256 pairs (pairs_ahead and defer_sums on)
    TritonConfig(defer_sums=False), TritonConfig(num_stages=1), TritonConfig(min_block_h=16),
    TritonConfig(num_stages=1, defer_sums=False), TritonConfig(block_n=16, pairs_ahead=False, defer_sums=False),
    TritonConfig(block_n=64, num_warps=2), TritonConfig(convert=CONVERT_BITS, block_n=64),
    TritonConfig(convert=CONVERT_ASM, block_n=64, pairs_ahead=False, defer_sums=False),
    TritonConfig(convert=CONVERT_ASM_PERM, block_n=64), TritonConfig(convert=CONVERT_ASM_PERM, block_n=16),
    TritonConfig(convert=CONVERT_ASM, num_warps=4, block_n=64, min_block_h=16, pairs_ahead=False, defer_sums=False),
    TritonConfig(convert=CONVERT_ASM_PERM, num_warps=4, block_n=64, min_block_h=16, pairs_ahead=False,
                 defer_sums=False),
    TritonConfig(convert=CONVERT_ASM, num_warps=2, min_block_h=16),
    TritonConfig(convert=CONVERT_BITS, block_n=128, min_block_h=4, pairs_ahead=False, defer_sums=False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("quantizer,group", [("uniform", None), ("lloyd-max", None), ("lloyd-max", 32)])
def test_gpu_decode_every_triton_config(quantizer, group):
    fresh_seed()
    cfg = make_config(group_size=group, quantizer=quantizer, sink=GPU_SINK, recent=GPU_RECENT)
    pool = build_pool([scaled(20000), scaled(3000), 333, 70], 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV)
    q = torch.randn(4, 32, 128, device=DEV)
    ref = reference_decode(pool, q)
    errs = {}
    for tn in TRITON_CONFIGS:
        o = run_decode(pool, rotate_q(pool, q), config=tn, num_kv_splits=None, debug=False)
        errs[str(tn)] = rel_l2(o, ref)
    bad = {k: v for k, v in errs.items() if not v < 1e-2}
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.parametrize("quantizer,cap", [("uniform", None), ("lloyd-max", None), ("lloyd-max", 30.0)])
def test_gpu_decode_subnormal_operands_match_convert3(quantizer, cap):
    """convert 5 (fp16-subnormal code operands on the tensor cores) and pairs_ahead agree with
    convert 3 without pairs_ahead (the larger heads' default) to well below the oracle tolerance (a flushed subnormal would not)."""
    fresh_seed()
    cfg = make_config(quantizer=quantizer, sink=GPU_SINK, recent=GPU_RECENT)
    pool = build_pool([scaled(20000), scaled(3000), 333, 70], 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV)
    q = rotate_q(pool, torch.randn(4, 32, 128, device=DEV))
    base = run_decode(pool, q, config=TritonConfig(convert=CONVERT_ASM_PERM, pairs_ahead=False, defer_sums=False),
                      logit_cap=cap, num_kv_splits=None, debug=False)
    for tn in (TritonConfig(pairs_ahead=False, defer_sums=False), TritonConfig(), TritonConfig(convert=CONVERT_ASM_PERM)):
        o = run_decode(pool, q, config=tn, logit_cap=cap, num_kv_splits=None, debug=False)
        assert rel_l2(o, base) < 2e-3, (tn, rel_l2(o, base))


@pytest.mark.gpu
@pytest.mark.parametrize("convert", [None, CONVERT_BITS, CONVERT_ASM])  # 2 / 3 / 5 run as 1 with bf16 operands
def test_gpu_decode_bf16_mma(convert):
    """bf16 MMA operands (cannot run under the interpreter)."""
    fresh_seed()
    cfg = make_config(sink=GPU_SINK, recent=GPU_RECENT, quantizer="lloyd-max")
    pool = build_pool([scaled(7000), 500], 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV)
    q = torch.randn(2, 32, 128, device=DEV)
    ref = reference_decode(pool, q)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.bfloat16,
                   config=None if convert is None else TritonConfig(convert=convert), num_kv_splits=None, debug=False)
    assert rel_l2(o, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("config", [pytest.param(GluonConfig, id="gluon"), pytest.param(TritonConfig, id="triton")])
def test_gpu_decode_cuda_graph_replay(config):
    """Capture once at the maximum lengths, replay with shorter lengths and new queries."""
    fresh_seed()
    cfg = make_config(sink=GPU_SINK, recent=GPU_RECENT)
    lens = [scaled(9000), scaled(4000), 700, 300]
    pool = build_pool(lens, 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV)
    b, hq = len(lens), 32
    q_static = torch.zeros(b, hq, 128, dtype=torch.bfloat16, device=DEV)
    seq_static = pool.seq_lens.clone()
    out = torch.empty(b, hq, 128, dtype=torch.bfloat16, device=DEV)
    ws = DecodeWorkspace(DEV).views(b, hq, 128, 66)
    if DEV == "cpu":  # dry run: no graphs on CPU
        return

    def step():
        decode_attention(q_static, pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v,
                         pool.hp_index, pool.req_to_token, pool.req_pool_indices, seq_static, pool.layout,
                         sink=GPU_SINK, recent=GPU_RECENT, num_kv_splits=64, num_hp_splits=2, workspace=ws, out=out,
                         config=config, debug=False)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(2):
        q = torch.randn(b, hq, 128, device=DEV)
        q_static.copy_(rotate_q(pool, q).to(torch.bfloat16))
        # trial 1: the same requests, shorter (as earlier steps of the same requests): the pool's HP
        # window was built for the full lengths, so only compare graph vs eager here
        if trial == 1:
            seq_static.copy_(pool.seq_lens - 1)
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        step()
        torch.cuda.synchronize()
        assert torch.equal(got, out)
        if trial == 0:
            assert rel_l2(got, reference_decode(pool, q)) < 1e-2


GLUON_CASES = {
    # name: (lens, hq, hkv, window, sink_lens, num_kv_splits, block_n)
    "b1_ctx128k": ([131072], 32, 8, None, False, None, 32),
    "b64_mixed": (None, 32, 8, None, False, None, 32),
    "gqa6_uncapped": ([10000] * 4, 24, 4, None, False, None, 32),
    "gqa16_two_head_blocks": ([20000, 3000], 32, 2, None, False, None, 32),
    "gqa12_partial_head_block": ([9000, 2500], 24, 2, None, False, None, 32),
    "mha_bn16_hp_fp16": ([5000, 700], 8, 8, None, False, 7, 16),
    "window_sinklens": ([16384] * 8, 32, 8, 4096, True, None, 32),
    "idx64_forced": ([3000, 40000], 32, 8, None, False, None, 32),  # 64-bit row addresses
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GLUON_CASES))
def test_gpu_decode_gluon_vs_reference(name, monkeypatch):
    """GluonConfig against the oracle (BF16 output) and the Triton engine on the same pool."""
    if "idx64" in name:  # the path of pools of 2 GiB or more (byte offsets past int32), forced
        monkeypatch.setenv("SGLANG_OSCAR_FORCE_IDX64", "1")
    fresh_seed()
    lens, hq, hkv, window, sinkl, ns, bn = GLUON_CASES[name]
    if lens is None:
        lens = [random.randint(1, scaled(8192)) for _ in range(64 if SCALE >= 0.1 else 4)]
        lens[:4] = [1, GPU_SINK, GPU_SINK + GPU_RECENT, GPU_SINK + GPU_RECENT + 1]
    lens = [max(1, scaled(x)) if x > 1000 else x for x in lens]
    window = scaled(window) if window else window
    cfg = make_config(sink=GPU_SINK, recent=GPU_RECENT)
    hp_dtype = torch.float16 if "hp_fp16" in name else torch.bfloat16
    pool = build_pool(lens, hkv, 128, 128, cfg, hp_dtype=hp_dtype, device=DEV)
    q = torch.randn(len(lens), hq, 128, device=DEV)
    kw = dict(sliding_window=window, num_kv_splits=ns, debug=False)
    if sinkl:
        sl = torch.full((pool.hp_index.shape[0],), GPU_SINK, dtype=torch.int32, device=DEV)
        sl[pool.req_pool_indices[1:3]] = torch.tensor([GPU_SINK // 2, 0], dtype=torch.int32, device=DEV)
        kw["sink_lens"] = sl
    qr = rotate_q(pool, q).to(torch.bfloat16)
    tn = GluonConfig(block_n=bn, maxnreg=None if "uncapped" in name else GLUON_MAXNREG)
    o = run_decode(pool, qr, config=tn, out_dtype=torch.bfloat16, **kw)
    base = run_decode(pool, qr, config=TritonConfig, out_dtype=torch.bfloat16, **kw)
    assert rel_l2(o, base) < 5e-3
    if not sinkl:
        assert rel_l2(o, reference_decode(pool, q, sliding_window=window)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["planes", "rows-head-major", "rows-slot-major"])
@pytest.mark.parametrize("config", [pytest.param(GluonConfig, id="gluon"), pytest.param(TritonConfig, id="triton")])
def test_gpu_decode_on_served_pool_views(storage, config):
    """The served pool keeps a head-major code plane and a head-major pair plane per layer
    (pool/rows.py kv_head_major_zeros; head stride = slots x 32 / 4 bytes); the earlier layout kept
    codes and pairs of a (slot, kv head) in one 36-byte row (kv_head_major_zeros / int2_row_views:
    no 8-byte alignment). The engines read either through strided views and must match the
    contiguous pool and the oracle."""
    from sglang_oscar.pool.rows import int2_row_views, kv_head_major_zeros

    fresh_seed()
    cfg = make_config(sink=GPU_SINK, recent=GPU_RECENT)
    lens = [scaled(20000), 777, 300]
    pool = build_pool(lens, 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV)
    views = []
    for codes, pairs in ((pool.k_codes, pool.k_pairs), (pool.v_codes, pool.v_pairs)):
        if storage == "planes":
            rc = kv_head_major_zeros(codes.shape[0], codes.shape[1], 32, torch.uint8, DEV)
            rp = kv_head_major_zeros(codes.shape[0], codes.shape[1], 2, torch.float16, DEV)
        else:
            rows = kv_head_major_zeros(codes.shape[0], codes.shape[1], 36, torch.uint8, DEV,
                                       head_major=storage == "rows-head-major")
            rc, rp = int2_row_views(rows, 128, torch.float16)
        rc.copy_(codes)
        rp.copy_(pairs)
        views += [rc, rp]
    served = dataclasses.replace(pool, k_codes=views[0], k_pairs=views[1], v_codes=views[2], v_pairs=views[3])
    q = torch.randn(len(lens), 32, 128, device=DEV)
    qr = rotate_q(pool, q)
    o = run_decode(served, qr, config=config, num_kv_splits=None, debug=False)
    base = run_decode(pool, qr, config=TritonConfig, num_kv_splits=None, debug=False)
    assert rel_l2(o, base) < 5e-3
    assert rel_l2(o, reference_decode(pool, q)) < 1e-2


@pytest.mark.gpu
def test_gpu_decode_gluon_int64_req_to_token():
    """``req_to_token`` / ``hp_index`` in int64 (SGLang's are int32; the kernels take either): the slot
    ring then copies 8-byte slot ids by ``cp.async`` into an int64 ring; results must match the
    Triton engine and the oracle as with int32 tables."""
    fresh_seed()
    cfg = make_config(sink=GPU_SINK, recent=GPU_RECENT)
    lens = [scaled(40000), scaled(5000), 300]
    pool = build_pool(lens, 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV, index_dtype=torch.int64)
    assert pool.req_to_token.dtype == torch.int64
    q = torch.randn(len(lens), 32, 128, device=DEV)
    qr = rotate_q(pool, q).to(torch.bfloat16)
    o = run_decode(pool, qr, config=GluonConfig, out_dtype=torch.bfloat16, num_kv_splits=None, debug=False)
    base = run_decode(pool, qr, config=TritonConfig, out_dtype=torch.bfloat16, num_kv_splits=None, debug=False)
    assert rel_l2(o, base) < 5e-3
    assert rel_l2(o, reference_decode(pool, q)) < 1e-2


def _v_magnitude_rows(kind: str):
    """``rows`` for build_pool: K as random_rows, V times 1e-4 ("tiny": most P v_scale products below
    fp16's normal range), 300 ("huge": V scales near 1e3) or a per-token factor log-uniform in
    [1e-4, 10] ("mixed")."""
    calls = []

    def rows(t, h, d, device):
        r = random_rows(t, h, d, device)
        calls.append(None)
        if len(calls) % 2 == 1:  # build_pool makes K, then V, per request
            return r
        if kind == "tiny":
            return r * 1e-4
        if kind == "huge":
            return r * 300.0
        return r * torch.exp(torch.empty(t, 1, 1, device=device).uniform_(math.log(1e-4), math.log(10.0)))
    return rows


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tiny", "huge", "mixed"])
def test_gpu_decode_gluon_v_scale_range(kind):
    """The Gluon kernel feeds ``p * v_scale / ref`` to the value MMA as fp16 (``ref`` the running max
    of the V scales): V rows of very small, very large and per-token mixed magnitudes must match the
    Triton engine and the oracle as ordinary rows do."""
    fresh_seed()
    cfg = make_config(sink=GPU_SINK, recent=GPU_RECENT)
    lens = [scaled(131072), scaled(9000), 700]
    pool = build_pool(lens, 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV, rows=_v_magnitude_rows(kind))
    vscale = torch.cat([c.v_quant.pairs[..., 0].float().flatten() for c in pool.caches])
    want = {"tiny": (1e-6, 2e-3), "huge": (1.0, 6e4), "mixed": (1e-6, 6e4)}[kind]
    assert want[0] < vscale.abs().min() and vscale.abs().max() < want[1]  # the case is what it says
    if kind == "mixed":
        assert vscale.abs().max() / vscale.abs().min() > 1e4
    q = torch.randn(len(lens), 32, 128, device=DEV)
    qr = rotate_q(pool, q).to(torch.bfloat16)
    o = run_decode(pool, qr, config=GluonConfig, out_dtype=torch.float32, num_kv_splits=None, debug=False)
    base = run_decode(pool, qr, config=TritonConfig, out_dtype=torch.float32, num_kv_splits=None, debug=False)
    assert torch.isfinite(o).all()
    assert rel_l2(o, base) < 5e-3
    assert rel_l2(o, reference_decode(pool, q)) < 1e-2
