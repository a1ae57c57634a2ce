"""GPU checks at real sizes (H200): the same properties as the CPU tests, context up to 128K,
batch up to 64, every decode tuning, CUDA-graph capture/replay. Skipped without CUDA.

Run: ``python -m pytest tests/kernels/test_kernel_gpu.py -m gpu -q``
"""

from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import torch
from kv_fixtures import (
    assert_rows_match,
    build_pool,
    fresh_seed,
    make_config,
    poison_,
    random_rows,
    reference_decode,
    reference_extend,
    rel_l2,
    rotate_q,
    run_decode,
    run_extend,
)
from sglang_oscar.kernels import (
    Int2Layout,
    decode_attention,
    decode_workspace,
    write_kv,
)
from sglang_oscar.quant.int2 import quantize_rows

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
# OSCAR_GPU_TEST_DEVICE=cpu OSCAR_GPU_TEST_SCALE=0.002 (with TRITON_INTERPRET=1) dry-runs this file's
# logic on CPU at tiny sizes (call the test functions directly; the gpu marker skips them in pytest).
DEV = os.environ.get("OSCAR_GPU_TEST_DEVICE", "cuda")
SCALE = float(os.environ.get("OSCAR_GPU_TEST_SCALE", "1"))
SINK, RECENT = (64, 256) if SCALE >= 0.1 else (4, 8)


def _n(x: int) -> int:
    return max(1, int(x * SCALE))


@pytest.mark.parametrize("dk,dv,group,quantizer,sdt", [
    (128, 128, None, "uniform", "float16"),
    (192, 128, None, "lloyd-max", "bfloat16"),
    (256, 256, 128, "lloyd-max", "float32"),
    (512, 512, None, "uniform", "float16"),
    (64, 64, 16, "uniform", "float32"),
])
def test_gpu_write_bytes(dk, dv, group, quantizer, sdt):
    _write_bytes(dk, dv, group, quantizer, sdt, _n(8192))


@pytest.mark.parametrize("n", [32, 64, 3])
@pytest.mark.parametrize("dk,dv,group,quantizer,sdt", [
    (128, 128, None, "uniform", "float16"),
    (192, 128, 64, "lloyd-max", "bfloat16"),
])
def test_gpu_write_decode_sized(n, dk, dv, group, quantizer, sdt):
    """Decode-sized writes (batch x 8 kv heads rows) with the rows per program that the small-grid
    policy picks (``min_programs=256``: 1-2 rows, see ``WRITE_MIN_PROGRAMS``): bytes must equal the
    reference quantizer's as for prefill-sized ones."""
    from sglang_oscar.kernels.write import _rows_per_program

    layout = _layout(dk, dv, group, quantizer, sdt)
    _write_bytes(dk, dv, group, quantizer, sdt, n,
                 rows_per_program=_rows_per_program(layout, n * 8, min_programs=256))


def _layout(dk, dv, group, quantizer, sdt):
    return Int2Layout.create(dk, dv, group_size=group, k_clip_ratio=0.96, v_clip_ratio=0.92, quantizer=quantizer,
                             scale_dtype=sdt)


def _write_bytes(dk, dv, group, quantizer, sdt, n, rows_per_program=None):
    fresh_seed()
    h = 8
    layout = _layout(dk, dv, group, quantizer, sdt)
    k = random_rows(n, h, dk, DEV).to(torch.bfloat16)
    v = random_rows(n, h, dv, DEV).to(torch.bfloat16)
    num_slots = 2 * n + 16
    buf = layout.allocate(num_slots, h, DEV)
    for t in buf.values():
        t.view(torch.uint8).fill_(0xAB)
    loc = torch.randperm(n, device=DEV)
    loc[1::97] = -1
    hp_k = poison_(torch.empty(n, h, dk, dtype=torch.bfloat16, device=DEV))
    hp_v = poison_(torch.empty(n, h, dv, dtype=torch.bfloat16, device=DEV))
    hp_rows = torch.randperm(n, device=DEV).to(torch.int32)
    write_kv(k, v, loc, buf["k_codes"], buf["k_pairs"], buf["v_codes"], buf["v_pairs"], layout, hp_rows=hp_rows,
             hp_k=hp_k, hp_v=hp_v, rows_per_program=rows_per_program)
    ok = loc >= 0
    kq = quantize_rows(k[ok], group_size=group, clip_ratio=0.96, quantizer=quantizer, scale_dtype=sdt)
    vq = quantize_rows(v[ok], group_size=group, clip_ratio=0.92, quantizer=quantizer, scale_dtype=sdt)
    sl = loc[ok]
    assert_rows_match(buf["k_codes"][sl], buf["k_pairs"][sl], kq, "K")
    assert_rows_match(buf["v_codes"][sl], buf["v_pairs"][sl], vq, "V")
    assert torch.equal(hp_k[hp_rows.long()], k) and torch.equal(hp_v[hp_rows.long()], v)


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
    # 32 x 8 = 256 (request, kv head) pairs: the num_stages-1 default (tuning.STAGES1_MIN_PAIRS)
    "b32_lloyd_window_cap": ([6000] * 32, 32, 8, 128, 128, None, "lloyd-max", "bfloat16", 2048, 30.0),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_gpu_decode_vs_reference(name):
    fresh_seed()
    lens, hq, hkv, dk, dv, group, quantizer, sdt, window, cap = DECODE_CASES[name]
    if lens is None:
        lens = [random.randint(1, _n(8192)) for _ in range(64 if SCALE >= 0.1 else 4)]
        lens[:4] = [1, SINK, SINK + RECENT, SINK + RECENT + 1]
    lens = [max(1, _n(x)) if x > 1000 else x for x in lens]
    window = _n(window) if window else window
    cfg = make_config(group_size=group, quantizer=quantizer, scale_dtype=sdt, sink=SINK, recent=RECENT)
    pool = build_pool(lens, hkv, dk, dv, cfg, hp_dtype=torch.bfloat16, device=DEV)
    q = torch.randn(len(lens), hq, dk, device=DEV)
    ref = reference_decode(pool, q, sliding_window=window, logit_cap=cap)
    o = run_decode(pool, rotate_q(pool, q).to(torch.bfloat16), sliding_window=window, logit_cap=cap,
                   num_kv_splits=None, out_dtype=torch.bfloat16, debug=False)
    assert rel_l2(o, ref) < 1e-2


def _zero_mean_rows(t, h, d, device):
    return torch.randn(t, h, d, device=device)


@pytest.mark.parametrize("tuning", [None, dict(engine="triton"), dict(convert=2, block_n=64, engine="triton"),
                                    dict(convert=1, token_major=False, engine="triton"),
                                    dict(convert=3, pairs_ahead=False, engine="triton"),
                                    dict(convert=5, pairs_ahead=False, engine="triton"),
                                    pytest.param(dict(engine="gluon"), id="gluon"),
                                    pytest.param(dict(engine="gluon", block_n=16), id="gluon-bn16"),
                                    pytest.param(dict(engine="gluon", async_stages=0), id="gluon-regs"),
                                    pytest.param(dict(engine="gluon", async_stages=3, async_slots=False),
                                                 id="gluon-async3"),
                                    pytest.param(dict(engine="gluon", async_stages=3), id="gluon-slotring3")])
def test_gpu_decode_long_split_independent_of_split_count(tuning):
    """One split walking 128K keys == many short splits == the oracle, on zero-mean values.

    Zero-mean V makes the output small against the values the accumulator sums (the zero-point
    correction cancels most of ``sum pw E``), so an accumulation bias shows: before the value
    MMAs started from zero each block, tensor-core truncation put a 64K-token split 1-8% off.
    """
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT)
    lens = [_n(131072), _n(65536)]
    pool = build_pool(lens, 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV, rows=_zero_mean_rows)
    q = torch.randn(len(lens), 32, 128, device=DEV)
    ref = reference_decode(pool, q)
    outs = {ns: run_decode(pool, rotate_q(pool, q), tuning=tuning, num_kv_splits=ns, debug=False)
            for ns in (1, 2, 64)}
    errs = {ns: rel_l2(o, ref) for ns, o in outs.items()}
    assert all(e < 1e-2 for e in errs.values()), errs
    assert rel_l2(outs[1], outs[64]) < 5e-3, (errs, rel_l2(outs[1], outs[64]))


TUNINGS = [dict(convert=3, block_n=32, pairs_ahead=False), dict(convert=3, block_n=32, pairs_ahead=True),
           dict(convert=2, block_n=64, pairs_ahead=True), dict(convert=5, block_n=32, pairs_ahead=False),
           dict(convert=5, block_n=32),  # the default (pairs_ahead and, below 256 pairs, defer_sums on)
           dict(convert=5, block_n=32, defer_sums=False), dict(convert=5, block_n=32, num_stages=1, defer_sums=True),
           dict(convert=5, block_n=32, min_block_h=16), dict(convert=5, block_n=32, num_stages=1),
           dict(convert=5, block_n=16, pairs_ahead=False), dict(convert=5, block_n=64, num_warps=2)] + [
    dict(convert=c, token_major=tm, num_warps=w, block_n=bn, min_block_h=mh, pairs_ahead=pa)
    for c, tm, w, bn, mh, pa in (
        (0, True, 1, 64, 8, False), (1, True, 1, 64, 8, True), (2, True, 1, 64, 8, False), (3, True, 1, 64, 8, True),
        (3, True, 1, 32, 8, False), (3, True, 1, 16, 8, True),
        (2, False, 4, 64, 16, False), (3, False, 4, 64, 16, False), (2, True, 2, 32, 16, True),
        (1, False, 1, 128, 4, False),
    )
]


@pytest.mark.parametrize("quantizer,group", [("uniform", None), ("lloyd-max", None), ("lloyd-max", 32)])
def test_gpu_decode_every_tuning(quantizer, group):
    fresh_seed()
    cfg = make_config(group_size=group, quantizer=quantizer, sink=SINK, recent=RECENT)
    pool = build_pool([_n(20000), _n(3000), 333, 70], 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV)
    q = torch.randn(4, 32, 128, device=DEV)
    ref = reference_decode(pool, q)
    errs = {}
    for tn in TUNINGS:  # Triton knobs: run them on the Triton engine (unset, uniform layouts take Gluon)
        o = run_decode(pool, rotate_q(pool, q), tuning=dict(tn, engine="triton"), num_kv_splits=None, debug=False)
        errs[str(tn)] = rel_l2(o, ref)
    bad = {k: v for k, v in errs.items() if not v < 1e-2}
    assert not bad, bad


@pytest.mark.parametrize("quantizer,cap", [("uniform", None), ("lloyd-max", None), ("lloyd-max", 30.0)])
def test_gpu_decode_subnormal_operands_match_convert3(quantizer, cap):
    """convert 5 (fp16-subnormal code operands on the tensor cores) and pairs_ahead agree with
    convert 3 without pairs_ahead (the larger heads' default) to well below the oracle tolerance (a flushed subnormal would not)."""
    fresh_seed()
    cfg = make_config(quantizer=quantizer, sink=SINK, recent=RECENT)
    pool = build_pool([_n(20000), _n(3000), 333, 70], 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV)
    q = rotate_q(pool, torch.randn(4, 32, 128, device=DEV))
    base = run_decode(pool, q, tuning=dict(convert=3, pairs_ahead=False, engine="triton"), logit_cap=cap,
                      num_kv_splits=None,
                      debug=False)
    for tn in (dict(convert=5, pairs_ahead=False), dict(convert=5, pairs_ahead=True), dict(convert=3, pairs_ahead=True)):
        o = run_decode(pool, q, tuning=dict(tn, engine="triton"), logit_cap=cap, num_kv_splits=None, debug=False)
        assert rel_l2(o, base) < 2e-3, (tn, rel_l2(o, base))


@pytest.mark.parametrize("convert", [0, 1, 2])  # 2 / 3 / 5 run as 1 with bf16 operands
def test_gpu_decode_bf16_mma(convert):
    """bf16 MMA operands (cannot run under the interpreter)."""
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT, quantizer="lloyd-max")
    pool = build_pool([_n(7000), 500], 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV)
    q = torch.randn(2, 32, 128, device=DEV)
    ref = reference_decode(pool, q)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.bfloat16, tuning=dict(convert=convert),
                   num_kv_splits=None, debug=False)
    assert rel_l2(o, ref) < 1e-2


def test_gpu_decode_fp32_exact():
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT, quantizer="lloyd-max", scale_dtype="float32")
    pool = build_pool([_n(5000), 400, 1], 8, 128, 128, cfg, hp_dtype=torch.float32, device=DEV)
    q = torch.randn(3, 32, 128, device=DEV)
    ref = reference_decode(pool, q, hp_dtype=torch.float32)
    o = run_decode(pool, rotate_q(pool, q), mma_dtype=torch.float32, num_kv_splits=None, debug=False)
    assert rel_l2(o, ref) < 1e-4


@pytest.mark.parametrize("tuning", [pytest.param(dict(engine="gluon"), id="gluon"),
                                    pytest.param(dict(engine="gluon", async_stages=0), id="gluon-regs"),
                                    pytest.param(dict(engine="gluon", async_stages=3, async_slots=False),
                                                 id="gluon-async3"),
                                    pytest.param(dict(engine="gluon", async_stages=3), id="gluon-slotring3"),
                                    pytest.param(dict(engine="triton"), id="triton")])
def test_gpu_decode_cuda_graph_replay(tuning):
    """Capture once at the maximum lengths, replay with shorter lengths and new queries."""
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT)
    lens = [_n(9000), _n(4000), 700, 300]
    pool = build_pool(lens, 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV)
    b, hq = len(lens), 32
    q_static = torch.zeros(b, hq, 128, dtype=torch.bfloat16, device=DEV)
    seq_static = pool.seq_lens.clone()
    out = torch.empty(b, hq, 128, dtype=torch.bfloat16, device=DEV)
    ws = decode_workspace(b, hq, 128, 66, DEV)
    if DEV == "cpu":  # dry run: no graphs on CPU
        return

    def step():
        decode_attention(q_static, pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v,
                         pool.hp_index, pool.req_to_token, pool.req_pool_indices, seq_static, pool.layout,
                         sink=SINK, recent=RECENT, num_kv_splits=64, num_hp_splits=2, workspace=ws, out=out,
                         tuning=tuning, debug=False)

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


def test_gpu_extend_long_prefix_and_chunking():
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT, quantizer="lloyd-max", group_size=64)
    prefixes, exts = [_n(60000), 0, _n(1000)], [_n(2048), _n(1500), 1]
    lens = [p + e for p, e in zip(prefixes, exts)]
    pool = build_pool(lens, 8, 128, 128, cfg, hp_dtype=torch.bfloat16, window_mode="extend", device=DEV)
    q = torch.randn(sum(exts), 32, 128, device=DEV)
    ref = reference_extend(pool, q, prefixes, exts, counter_rotate=True)
    o = run_extend(pool, rotate_q(pool, q).to(torch.bfloat16), prefixes, exts, rotation_v=pool.rot_v,
                   out_dtype=torch.float32, debug=False)
    assert rel_l2(o, ref) < 1e-2
    # request 0's chunk again, split in two: the same rows as the one-shot run
    p0, e0 = prefixes[0], exts[0]
    cut = e0 // 3
    q0 = rotate_q(pool, q[:e0])
    sub = dataclasses.replace(pool, req_pool_indices=pool.req_pool_indices[:1])
    full = run_extend(sub, q0, [p0], [e0], debug=False)
    a = run_extend(sub, q0[:cut], [p0], [cut], debug=False)
    b = run_extend(sub, q0[cut:], [p0 + cut], [e0 - cut], debug=False)
    assert rel_l2(torch.cat([a, b]), full) < 1e-3


def test_gpu_extend_window_cap_fp32():
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT)
    prefixes, exts = [_n(5000), 100], [_n(700), 64]
    pool = build_pool([p + e for p, e in zip(prefixes, exts)], 4, 128, 128, cfg, hp_dtype=torch.float32,
                      window_mode="extend", device=DEV)
    q = torch.randn(sum(exts), 16, 128, device=DEV)
    w = _n(1000) if SCALE < 0.1 else 1000
    ref = reference_extend(pool, q, prefixes, exts, sliding_window=w, logit_cap=20.0, hp_dtype=torch.float32)
    o = run_extend(pool, rotate_q(pool, q), prefixes, exts, mma_dtype=torch.float32, sliding_window=w,
                   logit_cap=20.0, debug=False)
    assert rel_l2(o, ref) < 1e-4


# ---- Gluon engine (kernels/decode/gluon_stage1.py): the INT2 splits with explicit register layouts

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
    # the register pipeline (async_stages 0)
    "b1_ctx128k_regs": ([131072], 32, 8, None, False, None, 32),
    "b64_mixed_regs": (None, 32, 8, None, False, None, 32),
    "window_sinklens_regs": ([16384] * 8, 32, 8, 4096, True, None, 32),
    "idx64_forced_regs": ([3000, 40000], 32, 8, None, False, None, 32),
    # the cp.async words without the slot ring (async_stages = the digit after "async", async_slots False)
    "b1_ctx128k_async3": ([131072], 32, 8, None, False, None, 32),
    "b64_mixed_async2": (None, 32, 8, None, False, None, 32),
    "window_sinklens_async3": ([16384] * 8, 32, 8, 4096, True, None, 32),
    "mha_bn16_async4": ([5000, 700], 8, 8, None, False, 7, 16),
    "idx64_forced_async3": ([3000, 40000], 32, 8, None, False, None, 32),
    # slot ids through shared memory too (async_stages = the digit after "slotring"; the default has 2)
    "b1_ctx128k_slotring3": ([131072], 32, 8, None, False, None, 32),
    "b64_mixed_slotring2": (None, 32, 8, None, False, None, 32),
    "window_sinklens_slotring3": ([16384] * 8, 32, 8, 4096, True, None, 32),
    "mha_bn16_slotring4": ([5000, 700], 8, 8, None, False, 7, 16),
}


@pytest.mark.parametrize("name", list(GLUON_CASES))
def test_gpu_decode_gluon_vs_reference(name, monkeypatch):
    """engine='gluon' against the oracle (BF16 output) and the Triton engine on the same pool."""
    if "idx64" in name:  # the path of pools of 2 GiB or more (byte offsets past int32), forced
        monkeypatch.setenv("SGLANG_OSCAR_FORCE_IDX64", "1")
    fresh_seed()
    lens, hq, hkv, window, sinkl, ns, bn = GLUON_CASES[name]
    if lens is None:
        lens = [random.randint(1, _n(8192)) for _ in range(64 if SCALE >= 0.1 else 4)]
        lens[:4] = [1, SINK, SINK + RECENT, SINK + RECENT + 1]
    lens = [max(1, _n(x)) if x > 1000 else x for x in lens]
    window = _n(window) if window else window
    cfg = make_config(sink=SINK, recent=RECENT)
    hp_dtype = torch.float16 if "hp_fp16" in name else torch.bfloat16
    pool = build_pool(lens, hkv, 128, 128, cfg, hp_dtype=hp_dtype, device=DEV)
    q = torch.randn(len(lens), hq, 128, device=DEV)
    kw = dict(sliding_window=window, num_kv_splits=ns, debug=False)
    if sinkl:
        sl = torch.full((pool.hp_index.shape[0],), SINK, dtype=torch.int32, device=DEV)
        sl[pool.req_pool_indices[1:3]] = torch.tensor([SINK // 2, 0], dtype=torch.int32, device=DEV)
        kw["sink_lens"] = sl
    qr = rotate_q(pool, q).to(torch.bfloat16)
    tn = dict(engine="gluon", block_n=bn, maxnreg=255 if "uncapped" in name else None)
    if "_regs" in name:
        tn["async_stages"] = 0
    elif "async" in name:
        tn.update(async_stages=int(name[name.index("async") + 5]), async_slots=False)
    elif "slotring" in name:
        tn["async_stages"] = int(name[name.index("slotring") + 8])
    o = run_decode(pool, qr, tuning=tn, out_dtype=torch.bfloat16, **kw)
    base = run_decode(pool, qr, tuning=dict(engine="triton"), out_dtype=torch.bfloat16, **kw)
    assert rel_l2(o, base) < 5e-3
    if not sinkl:
        assert rel_l2(o, reference_decode(pool, q, sliding_window=window)) < 1e-2


@pytest.mark.parametrize("storage", ["planes", "rows-head-major", "rows-slot-major"])
@pytest.mark.parametrize("tuning", [pytest.param(dict(engine="gluon"), id="gluon"),
                                    pytest.param(dict(engine="gluon", async_stages=0), id="gluon-regs"),
                                    pytest.param(dict(engine="triton"), id="triton")])
def test_gpu_decode_on_served_pool_views(storage, tuning):
    """The served pool keeps a head-major code plane and a head-major pair plane per layer
    (pool/rows.py kv_head_major_zeros; head stride = slots x 32 / 4 bytes); the earlier layout kept
    codes and pairs of a (slot, kv head) in one 36-byte row (kv_head_major_zeros / int2_row_views:
    no 8-byte alignment). The engines read either through strided views and must match the
    contiguous pool and the oracle."""
    from sglang_oscar.pool.rows import int2_row_views, kv_head_major_zeros

    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT)
    lens = [_n(20000), 777, 300]
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
    o = run_decode(served, qr, tuning=tuning, num_kv_splits=None, debug=False)
    base = run_decode(pool, qr, tuning=dict(engine="triton"), num_kv_splits=None, debug=False)
    assert rel_l2(o, base) < 5e-3
    assert rel_l2(o, reference_decode(pool, q)) < 1e-2


@pytest.mark.parametrize("tuning", [pytest.param(dict(engine="gluon"), id="gluon"),
                                    pytest.param(dict(engine="gluon", async_stages=4), id="gluon-slotring4"),
                                    pytest.param(dict(engine="gluon", async_stages=0), id="gluon-regs")])
def test_gpu_decode_gluon_int64_req_to_token(tuning):
    """``req_to_token`` / ``hp_index`` in int64 (SGLang's are int32; the kernels take either): the slot
    ring then copies 8-byte slot ids by ``cp.async`` into an int64 ring; results must match the
    Triton engine and the oracle as with int32 tables."""
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT)
    lens = [_n(40000), _n(5000), 300]
    pool = build_pool(lens, 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV, index_dtype=torch.int64)
    assert pool.req_to_token.dtype == torch.int64
    q = torch.randn(len(lens), 32, 128, device=DEV)
    qr = rotate_q(pool, q).to(torch.bfloat16)
    o = run_decode(pool, qr, tuning=tuning, out_dtype=torch.bfloat16, num_kv_splits=None, debug=False)
    base = run_decode(pool, qr, tuning=dict(engine="triton"), out_dtype=torch.bfloat16, num_kv_splits=None,
                      debug=False)
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


@pytest.mark.parametrize("kind", ["tiny", "huge", "mixed"])
@pytest.mark.parametrize("tuning", [pytest.param(dict(engine="gluon"), id="gluon"),
                                    pytest.param(dict(engine="gluon", async_stages=0), id="gluon-regs")])
def test_gpu_decode_gluon_v_scale_range(kind, tuning):
    """The Gluon kernel feeds ``p * v_scale / ref`` to the value MMA as fp16 (``ref`` the running max
    of the V scales): V rows of very small, very large and per-token mixed magnitudes must match the
    Triton engine and the oracle as ordinary rows do."""
    fresh_seed()
    cfg = make_config(sink=SINK, recent=RECENT)
    lens = [_n(131072), _n(9000), 700]
    pool = build_pool(lens, 8, 128, 128, cfg, hp_dtype=torch.bfloat16, device=DEV, rows=_v_magnitude_rows(kind))
    vscale = torch.cat([c.v_quant.pairs[..., 0].float().flatten() for c in pool.caches])
    want = {"tiny": (1e-6, 2e-3), "huge": (1.0, 6e4), "mixed": (1e-6, 6e4)}[kind]
    assert want[0] < vscale.abs().min() and vscale.abs().max() < want[1]  # the case is what it says
    if kind == "mixed":
        assert vscale.abs().max() / vscale.abs().min() > 1e4
    q = torch.randn(len(lens), 32, 128, device=DEV)
    qr = rotate_q(pool, q).to(torch.bfloat16)
    o = run_decode(pool, qr, tuning=tuning, out_dtype=torch.float32, num_kv_splits=None, debug=False)
    base = run_decode(pool, qr, tuning=dict(engine="triton"), out_dtype=torch.float32, num_kv_splits=None,
                      debug=False)
    assert torch.isfinite(o).all()
    assert rel_l2(o, base) < 5e-3
    assert rel_l2(o, reference_decode(pool, q)) < 1e-2


@pytest.mark.parametrize("storage", ["planes", "rows-head-major", "rows-slot-major"])
def test_gpu_write_into_served_rows(storage):
    """write_kv into the served pool's head-major code / pair planes and into the
    earlier 36-byte row views (pool/rows.py; head- and slot-major) store the bytes they store into
    contiguous code / pair tensors, and touch no other row."""
    from sglang_oscar.pool.rows import int2_row_views, kv_head_major_zeros

    fresh_seed()
    n, h, slots = _n(4096), 8, _n(4096) * 2 + 7
    layout = _layout(128, 128, None, "uniform", "float16")
    k = torch.randn(n, h, 128, device=DEV).to(torch.bfloat16)
    v = torch.randn(n, h, 128, device=DEV).to(torch.bfloat16)
    loc = torch.randperm(slots, device=DEV)[:n]
    ref = layout.allocate(slots, h, DEV)
    write_kv(k, v, loc, ref["k_codes"], ref["k_pairs"], ref["v_codes"], ref["v_pairs"], layout)
    views = []
    for _ in range(2):
        if storage == "planes":
            c = kv_head_major_zeros(slots, h, 32, torch.uint8, DEV)
            p = kv_head_major_zeros(slots, h, 2, torch.float16, DEV)
            c.fill_(0xAB)
            p.view(torch.uint8).fill_(0xAB)
            views.append(((c, p.view(torch.uint8)), c, p))
        else:
            rows = kv_head_major_zeros(slots, h, 36, torch.uint8, DEV, head_major=storage == "rows-head-major")
            rows.fill_(0xAB)
            views.append(((rows,), *int2_row_views(rows, 128, torch.float16)))
    (kr, kc, kp), (vr, vc, vp) = views
    write_kv(k, v, loc, kc, kp, vc, vp, layout)
    for codes, pairs, name in ((kc, kp, "k"), (vc, vp, "v")):
        assert torch.equal(codes[loc], ref[f"{name}_codes"][loc])
        assert torch.equal(pairs[loc].view(torch.uint8), ref[f"{name}_pairs"][loc].view(torch.uint8))
    untouched = torch.ones(slots, dtype=torch.bool, device=DEV)
    untouched[loc] = False
    for t in (*kr, *vr):
        assert bool((t[untouched] == 0xAB).all())


@pytest.mark.parametrize("t,h,hr,d,in_dtype,transpose,sub,add", [
    (_n(64), 32, 8, 128, torch.bfloat16, False, False, False),  # decode q, batch 64, GQA 4
    (_n(64), 32, 8, 128, torch.float32, True, False, True),  # decode output back, value mean
    (_n(8192), 8, 8, 128, torch.bfloat16, False, True, False),  # prefill K, centred
    (_n(300), 16, 4, 256, torch.bfloat16, False, False, False),
    (_n(300), 8, 8, 192, torch.float16, True, False, False),
])
def test_gpu_rotate_heads(t, h, hr, d, in_dtype, transpose, sub, add):
    """kernels.rotate.rotate_heads on the GPU against the fp32 einsum (IEEE fp32 dot products, no TF32)."""
    from test_kernel_rotate import check_rotation

    check_rotation(t, h, hr, d, in_dtype, transpose, sub, add, device=DEV)


@pytest.mark.parametrize("block_n", [16, 32, 64, "auto"])
def test_gpu_rotate_heads_output_slices(block_n):
    """rotate_heads with the output dims split over programs (block_n), decode q / output / prefill K."""
    from test_kernel_rotate import check_rotation

    check_rotation(_n(8), 32, 8, 128, torch.bfloat16, False, False, False, device=DEV, block_n=block_n)
    check_rotation(_n(8), 32, 8, 128, torch.float32, True, False, True, device=DEV, block_n=block_n)
    check_rotation(_n(2048), 8, 8, 256, torch.bfloat16, False, True, False, device=DEV, block_n=block_n)


@pytest.mark.parametrize("t,hq,hkv,dk,dv,in_dtype,mk,mv,block_n", [
    (_n(1), 32, 8, 128, 128, torch.bfloat16, True, True, None),  # decode, batch 1, centred
    (_n(64), 32, 8, 128, 128, torch.bfloat16, False, True, 32),  # decode, batch 64, split outputs
    (_n(4096), 32, 8, 128, 128, torch.bfloat16, True, False, None),  # prefill
    (_n(300), 16, 8, 192, 128, torch.float16, True, True, 64),  # D_k != D_v
    (_n(1), 32, 8, 128, 128, torch.bfloat16, True, True, "auto"),  # the backend's decode call (16 dims)
    (_n(32), 32, 8, 128, 128, torch.bfloat16, True, True, "auto"),  # ... at batch 32 (64 dims)
    (_n(4096), 32, 8, 128, 128, torch.bfloat16, True, True, "auto"),  # ... at prefill
])
def test_gpu_rotate_qkv(t, hq, hkv, dk, dv, in_dtype, mk, mv, block_n):
    """kernels.rotate.rotate_qkv (q, K, V in one launch) on the GPU against the fp32 einsum."""
    from test_kernel_rotate import check_rotate_qkv

    check_rotate_qkv(t, hq, hkv, dk, dv, in_dtype, mk, mv, block_n, device=DEV)
