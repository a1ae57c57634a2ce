"""Decode launch policy: split counts, the resolved Triton / Gluon configs, the merge of the
splits and the shared workspace (interpreter; the kernels themselves: test_decode.py)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from kv_fixtures import build_pool, fresh_seed, make_config, reference_decode, rel_l2, rotate_q, run_decode
from sglang_oscar.kernels import DecodeWorkspace, GluonConfig, Int2Layout, TritonConfig, decode_attention, default_triton_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SINK, RECENT = 4, 8  # the windows of test_decode.py's small pools


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
    # a sliding layer's window bounds its keys as the context does (Gemma-4: window 1024, 32K context)
    assert splits.default_num_kv_splits(GluonConfig(), 1, 16, 8, max_seq_len=32768) == 182
    assert splits.default_num_kv_splits(GluonConfig(), 1, 16, 8, max_seq_len=32768, sliding_window=1024) == 8
    assert splits.default_num_kv_splits(GluonConfig(), 1, 16, 8, sliding_window=1024) == 8  # 1024 / 128
    assert splits.default_num_kv_splits(TritonConfig(), 1, 16, 8, max_seq_len=512, sliding_window=1024) == 8
    # ... and above 16 head programs its plan caps the splits at 2 HP + 8 INT2 (measured at batch 16)
    assert splits.sliding_split_caps(16, 1024) is None and splits.sliding_split_caps(17, 1024) == (2, 8)
    assert splits.sliding_split_caps(17, 4096) is None  # wider windows than measured keep the defaults
    # the default counts themselves carry the caps, so callers sizing a workspace match the plan
    kv_splits = functools.partial(splits.default_num_kv_splits, TritonConfig(), 16, 16, 8, max_seq_len=32768)
    assert kv_splits(sliding_window=1024) == 8  # 16 (1024 / 64) uncapped
    monkeypatch.setattr(splits, "sliding_split_caps", lambda programs, window: None)
    assert kv_splits(sliding_window=1024) == 16
    monkeypatch.undo()
    monkeypatch.setattr(splits, "_sm_count", lambda device: 132)
    assert splits.decode_num_hp_splits(64, 512, programs=128, sliding_window=1024) == 2
    assert splits.decode_num_hp_splits(64, 512, programs=8, sliding_window=1024) == 8


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
    assert _fields(t, "convert", "pairs_ahead", "block_n", "num_warps", "defer_sums") == (3, False, 32, 4, False)
    assert _fields(default_triton_config(lay(192, 128)), "block_n", "num_warps") == (32, 4)
    assert _fields(default_triton_config(lay(512)), "block_n", "num_warps") == (64, 8)
    assert _fields(default_triton_config(lay(384)), "block_n", "num_warps") == (64, 8)  # a power of two
    assert _fields(default_triton_config(lay(320, 256)), "block_n", "num_warps") == (64, 8)
    t = default_triton_config(lay(128), extend=True)
    assert _fields(t, "convert", "pairs_ahead", "defer_sums", "block_m", "block_n", "num_warps") == (
        2, False, False, 64, 128, 4)
    # 128-key extend tiles where they fit the sm_90 registers (test_compile.py), 64 elsewhere
    def ext_keys(layout, **kw):
        return default_triton_config(layout, extend=True, **kw).block_n

    assert ext_keys(lay(64)) == 128 and ext_keys(lay(64), windowed=True, capped=True) == 128
    assert ext_keys(lay(128), windowed=True) == 64 and ext_keys(lay(128), capped=True) == 64
    assert ext_keys(lay(128), mma_dtype=torch.bfloat16) == 64 and ext_keys(lay(128), mma_dtype=torch.float32) == 64
    assert [ext_keys(lay(d)) for d in (80, 96, 112, 256)] == [64] * 4 and ext_keys(lay(192, 128)) == 64
    # K / V quarters of different padded widths: 8 warps (4 read illegal addresses on the H200 at 192 / 128)
    def ext_warps(*dims):
        return default_triton_config(lay(*dims), extend=True).num_warps

    assert [ext_warps(192, 128), ext_warps(128, 192), ext_warps(160, 128)] == [8] * 3
    assert [ext_warps(128), ext_warps(160), ext_warps(256), ext_warps(512), ext_warps(192, 160)] == [4] * 5
    # one-group Lloyd-Max at 128: 128 keys despite a 24-byte spill (faster on the H200); 64 with two groups
    lloyd = Int2Layout.create(128, quantizer="lloyd-max")
    assert ext_keys(lloyd) == 128 and ext_keys(lloyd, windowed=True) == 64 and ext_keys(lloyd, capped=True) == 64
    assert ext_keys(Int2Layout.create(128, quantizer="lloyd-max", group_size=64)) == 64
    assert ext_keys(Int2Layout.create(64, quantizer="lloyd-max")) == 64
    assert ext_keys(Int2Layout.create(128, group_size=64)) == 64
    assert ext_keys(Int2Layout.create(128, group_size=128, group_size_v=64)) == 64
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
    STAGES1_MIN_PAIRS (request, kv head) pairs; other head dims and the interpreter keep their stage
    count, extend has one stage whatever the batch; the decode plan resolves with B x H_kv."""
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
    # extend: one stage whatever the batch (H200, 8K chunk: ~10% faster than two at 0-24K prefixes)
    assert cfg(128, extend=True).num_stages == 1 and cfg(128, extend=True, pairs=4096).num_stages == 1

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
    with pytest.raises(ValueError, match="lse must have 3 dims"):  # extra dims would merge garbage
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
