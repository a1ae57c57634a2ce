"""Extend/prefill attention kernel vs the oracle (window mode "extend": only the sink from HP,
the prefix and the chunk itself from INT2), plus chunking invariance and the LSE output."""

from __future__ import annotations

import math

import pytest
import torch
from kv_fixtures import (
    build_pool,
    fresh_seed,
    make_config,
    poison_,
    reference_extend,
    rel_l2,
    rotate_q,
    run_extend,
    triton_config,
)
from sglang_oscar.kernels.codes import CONVERT_BITS
from sglang_oscar.kernels.configs import default_triton_config, interpreting
from sglang_oscar.kernels import write_kv
import dataclasses
from gpu_sizes import DEV, GPU_RECENT, GPU_SINK, scaled

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SINK = 4


@pytest.mark.parametrize("prefixes,exts,hq,hkv,dk,dv,group,quantizer,sdt", [
    ([10, 0, 25], [20, 7, 1], 8, 2, 64, 64, None, "uniform", "float16"),
    ([0, 3], [37, 2], 6, 1, 128, 128, 32, "lloyd-max", "float32"),
    ([5], [30], 2, 2, 192, 128, None, "uniform", "bfloat16"),
])
def test_extend_fp32_exact(prefixes, exts, hq, hkv, dk, dv, group, quantizer, sdt):
    fresh_seed()
    cfg = make_config(group_size=group, quantizer=quantizer, scale_dtype=sdt, sink=SINK)
    lens = [p + e for p, e in zip(prefixes, exts)]
    pool = build_pool(lens, hkv, dk, dv, cfg, hp_dtype=torch.float32, window_mode="extend")
    q = torch.randn(sum(exts), hq, dk)
    ref = reference_extend(pool, q, prefixes, exts, hp_dtype=torch.float32)
    o = run_extend(pool, rotate_q(pool, q), prefixes, exts, mma_dtype=torch.float32)
    assert rel_l2(o, ref) < 1e-4


@pytest.mark.parametrize("quantizer,group,convert", [("lloyd-max", 64, CONVERT_BITS), ("uniform", 16, None)])
def test_extend_bf16(quantizer, group, convert):
    fresh_seed()
    cfg = make_config(group_size=group, quantizer=quantizer, sink=SINK)
    prefixes, exts = [12, 0], [21, 9]
    pool = build_pool([33, 9], 2, 128, 128, cfg, hp_dtype=torch.bfloat16, window_mode="extend")
    q = torch.randn(30, 4, 128)
    ref = reference_extend(pool, q, prefixes, exts, counter_rotate=True)
    o = run_extend(pool, rotate_q(pool, q).to(torch.bfloat16), prefixes, exts, mma_dtype=torch.float16,
                   rotation_v=pool.rot_v, out_dtype=torch.bfloat16,
                   config=None if convert is None else triton_config(pool, extend=True, convert=convert))
    assert o.dtype == torch.bfloat16
    assert rel_l2(o, ref) < 1e-2


@pytest.mark.parametrize("window,cap", [(5, None), (17, 2.5)])
def test_extend_window_and_cap(device, window, cap):
    """fp32 extend with a sliding window and a logit cap matches the oracle to 1e-4: CPU on short chunks
    at head_dim 64, CUDA on a 5K prefix at head_dim 128 (the window 200x longer)."""
    fresh_seed()
    if device == "cuda":
        cfg = make_config(sink=GPU_SINK, recent=GPU_RECENT)
        prefixes, exts, hkv, hq, d, dev = [scaled(5000), 100], [scaled(700), 64], 4, 16, 128, DEV
        window = scaled(window * 200)
    else:
        cfg = make_config(sink=SINK)
        prefixes, exts, hkv, hq, d, dev = [9, 20], [24, 3], 2, 4, 64, "cpu"
    pool = build_pool([p + e for p, e in zip(prefixes, exts)], hkv, d, d, cfg, hp_dtype=torch.float32,
                      window_mode="extend", device=dev)
    q = torch.randn(sum(exts), hq, d, device=dev) * 2
    ref = reference_extend(pool, q, prefixes, exts, sliding_window=window, logit_cap=cap, hp_dtype=torch.float32)
    o = run_extend(pool, rotate_q(pool, q), prefixes, exts, mma_dtype=torch.float32, sliding_window=window,
                   logit_cap=cap, debug=device == "cpu")
    assert rel_l2(o, ref) < 1e-4


def test_extend_attention_sinks(device):
    """Attention-sink logits (natural log, one per q head) join each query's denominator as the
    oracle's, with a sliding window: fp32 to 1e-4, CPU on short chunks, CUDA on a 5K prefix with
    GPT-OSS's 64 q / 8 kv heads at head_dim 64."""
    fresh_seed()
    if device == "cuda":
        cfg = make_config(sink=GPU_SINK, recent=GPU_RECENT)
        prefixes, exts, hkv, hq, d, dev, window = [scaled(5000), 100], [scaled(700), 64], 8, 64, 64, DEV, scaled(1280)
    else:
        cfg = make_config(sink=SINK)
        prefixes, exts, hkv, hq, d, dev, window = [9, 20], [24, 3], 2, 4, 64, "cpu", 12
    pool = build_pool([p + e for p, e in zip(prefixes, exts)], hkv, d, d, cfg, hp_dtype=torch.float32,
                      window_mode="extend", device=dev)
    q = torch.randn(sum(exts), hq, d, device=dev) * 2
    sinks = (torch.randn(hq, device=dev) * 2 + 1).float()
    ref = reference_extend(pool, q, prefixes, exts, sliding_window=window, hp_dtype=torch.float32, sinks=sinks)
    o = run_extend(pool, rotate_q(pool, q), prefixes, exts, mma_dtype=torch.float32, sliding_window=window,
                   sinks=sinks, debug=device == "cpu")
    assert rel_l2(o, ref) < 1e-4
    assert rel_l2(reference_extend(pool, q, prefixes, exts, sliding_window=window, hp_dtype=torch.float32), ref) > 2e-3


def test_extend_chunking_invariance_and_lse():
    """One 40-token chunk == the same prompt as chunks 13 + 1 + 26 (pool written by write_kv per chunk)."""
    fresh_seed()
    cfg = make_config(sink=SINK, scale_dtype="float32")
    t, hq, d = 40, 4, 64
    pool = build_pool([t], 2, d, d, cfg, hp_dtype=torch.float32, window_mode="extend")
    # rewrite the INT2 bytes of the request with the kernel, chunk by chunk, interleaved with attention
    for buf in (pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs):
        poison_(buf)
    req = int(pool.req_pool_indices[0])
    slots = pool.req_to_token[req, :t].long()
    q = torch.randn(t, hq, d)
    q_rot = rotate_q(pool, q)
    cache = pool.caches[0]
    pieces = []
    start = 0
    for chunk in (13, 1, 26):
        sl = slots[start:start + chunk]
        write_kv(cache.k_hp[start:start + chunk], cache.v_hp[start:start + chunk], sl, pool.k_codes, pool.k_pairs,
                 pool.v_codes, pool.v_pairs, pool.layout)
        o, lse = run_extend(pool, q_rot[start:start + chunk], [start], [chunk], mma_dtype=torch.float32,
                            return_lse=True)
        pieces.append((o, lse))
        start += chunk
    o_chunked = torch.cat([p[0] for p in pieces])
    lse_chunked = torch.cat([p[1] for p in pieces])
    o_one, lse_one = run_extend(pool, q_rot, [0], [t], mma_dtype=torch.float32, return_lse=True)
    # other chunk boundaries cut the keys into other tiles, so fp32 sums run in another order
    # (a few ulp, ~1e-6 seen); a chunking bug moves the output by > 1e-2
    assert rel_l2(o_chunked, o_one) < 1e-5
    assert torch.allclose(lse_chunked, lse_one, atol=1e-5, rtol=0)
    ref = reference_extend(pool, q, [0], [t], hp_dtype=torch.float32)
    assert rel_l2(o_one, ref) < 1e-4
    # LSE = log sum_j exp(q.k_j * scale) over the visible keys (sink HP, rest dequantized)
    keys = torch.where((torch.arange(t) < SINK)[:, None, None], cache.k_hp.float(), cache.k_deq)
    s = torch.einsum("qhd,thd->qht", q_rot, keys.repeat_interleave(hq // 2, dim=1)) / math.sqrt(d)
    causal = torch.arange(t)[None, :] <= torch.arange(t)[:, None]
    s = s.masked_fill(~causal[:, None, :], float("-inf"))
    assert torch.allclose(lse_one, torch.logsumexp(s, dim=-1), atol=1e-4, rtol=0)


def test_extend_gpu_tile_shape_matches_oracle_and_chunking(monkeypatch):
    """The extend tiles the GPU runs for head_dim 128, one group, uniform (64 queries x 128 keys,
    ``default_triton_config`` off the interpreter) run under the interpreter: several key tiles and
    a partial diagonal tile vs the oracle, and a prompt run as one chunk equals the same prompt as
    chunks 70 + 230 (the interpreter's own tiles are 16 x 16)."""
    from sglang_oscar.kernels import configs

    fresh_seed()
    cfg = make_config(sink=SINK, scale_dtype="float32")
    t, hq = 300, 4
    pool = build_pool([t], 2, 128, 128, cfg, hp_dtype=torch.float32, window_mode="extend")
    with monkeypatch.context() as m:
        m.setattr(configs, "interpreting", lambda: False)
        gpu = configs.default_triton_config(pool.layout, extend=True)
    assert (gpu.block_m, gpu.block_n) == (64, 128)
    q = torch.randn(t, hq, 128)
    q_rot = rotate_q(pool, q)
    one = run_extend(pool, q_rot, [0], [t], mma_dtype=torch.float32, config=gpu)
    assert rel_l2(one, reference_extend(pool, q, [0], [t], hp_dtype=torch.float32)) < 1e-4
    parts = [run_extend(pool, q_rot[:70], [0], [70], mma_dtype=torch.float32, config=gpu),
             run_extend(pool, q_rot[70:], [70], [t - 70], mma_dtype=torch.float32, config=gpu)]
    assert rel_l2(torch.cat(parts), one) < 1e-5  # summation order only, as in the test above


def test_extend_int64_offsets(monkeypatch):
    fresh_seed()
    monkeypatch.setenv("SGLANG_OSCAR_FORCE_IDX64", "1")
    cfg = make_config(sink=SINK, quantizer="lloyd-max")
    prefixes, exts = [7], [12]
    pool = build_pool([19], 2, 64, 64, cfg, hp_dtype=torch.float32, window_mode="extend")
    q = torch.randn(12, 4, 64)
    ref = reference_extend(pool, q, prefixes, exts, hp_dtype=torch.float32)
    o = run_extend(pool, rotate_q(pool, q), prefixes, exts, mma_dtype=torch.float32)
    assert rel_l2(o, ref) < 1e-4


# ------------------------------ GPU cases (real sizes, `-m gpu`; sizes and dry run: gpu_sizes.py)


@pytest.mark.gpu
@pytest.mark.parametrize("quantizer,group,block_n", [("lloyd-max", 64, 64), ("uniform", None, 128),
                                                     ("lloyd-max", None, 128)],
                         ids=["lloyd-g64", "uniform-row", "lloyd-row"])
def test_gpu_extend_long_prefix_and_chunking(quantizer, group, block_n):
    """Long prefix, multi-request and chunk split vs the oracle with the default tiles: 64 keys for
    two groups per row, 128 for one (uniform, and Lloyd-Max despite its 24-byte spill)."""
    fresh_seed()
    cfg = make_config(sink=GPU_SINK, recent=GPU_RECENT, quantizer=quantizer, group_size=group)
    prefixes, exts = [scaled(60000), 0, scaled(1000)], [scaled(2048), scaled(1500), 1]
    lens = [p + e for p, e in zip(prefixes, exts)]
    pool = build_pool(lens, 8, 128, 128, cfg, hp_dtype=torch.bfloat16, window_mode="extend", device=DEV)
    if not interpreting():  # the interpreter's dry run (gpu_sizes.py) has 16-key tiles
        assert default_triton_config(pool.layout, extend=True).block_n == block_n
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


@pytest.mark.gpu
@pytest.mark.parametrize("dk,dv,group", [(192, 128, 64), (192, 128, None), (128, 192, 64)])
def test_gpu_extend_unequal_head_dims(dk, dv, group):
    """K and V head dims of different padded quarter widths (DeepSeek-V3 stored as expanded MHA: K 192 /
    V 128) at the default extend tiles: a 3K prefix and a 700-token prompt vs the oracle (the 4-warp
    64 x 64 tiles read illegal addresses here; ``configs.default_triton_config`` takes 8 warps)."""
    fresh_seed()
    cfg = make_config(sink=GPU_SINK, recent=GPU_RECENT, group_size=group)
    prefixes, exts = [0, scaled(3000)], [scaled(700), scaled(300)]
    lens = [p + e for p, e in zip(prefixes, exts)]
    pool = build_pool(lens, 8, dk, dv, cfg, hp_dtype=torch.bfloat16, window_mode="extend", device=DEV)
    q = torch.randn(sum(exts), 8, dk, device=DEV)
    ref = reference_extend(pool, q, prefixes, exts, counter_rotate=True)
    o = run_extend(pool, rotate_q(pool, q).to(torch.bfloat16), prefixes, exts, rotation_v=pool.rot_v,
                   out_dtype=torch.float32, debug=False)
    assert rel_l2(o, ref) < 1e-2
