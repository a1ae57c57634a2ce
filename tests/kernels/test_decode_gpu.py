"""Decode attention at real sizes on the GPU (``-m gpu``; sizes and dry run: gpu_sizes.py): the
oracle cases, every Triton config, the Gluon engine, CUDA-graph replay, served pool views."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from gpu_sizes import DEV, GPU_RECENT, GPU_SINK, SCALE, scaled
from kv_fixtures import build_pool, fresh_seed, make_config, random_rows, reference_decode, rel_l2, rotate_q, run_decode
from sglang_oscar.kernels import DecodeWorkspace, GluonConfig, TritonConfig, decode_attention
from sglang_oscar.kernels.codes import CONVERT_ASM, CONVERT_ASM_PERM, CONVERT_BITS
from sglang_oscar.kernels.configs import GLUON_MAXNREG

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


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
