"""The oracle's sliding windows, attention sinks and K-shared-as-V layers against brute force.

Every expected value here is computed in float64 by explicit loops over (query, head, visible
key) with the visibility rule written out (``0 <= pos - j < W``), never through the oracle.
"""

from __future__ import annotations

import math

import pytest
import torch

from sglang_oscar.config import OscarConfig
from sglang_oscar.reference import build_cache, hp_window_mask, oscar_attention, plain_attention, visible_mask


def _qkv(t, hq, hkv, d, seed=0, tq=None):
    g = torch.Generator().manual_seed(seed)
    tq = t if tq is None else tq
    q = torch.randn(tq, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    return q, k, v


def _orthogonal(d, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    qm, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return qm.float()


def brute(q, positions, kv_for, window, sm_scale, sinks=None, cap=None, hkv=None):
    """float64 attention: ``kv_for(pos) -> (k [T, H_kv, D], v [T, H_kv, D_v])`` as seen by that query."""
    tq, hq, _ = q.shape
    out = None
    for qi, pos in enumerate(int(p) for p in positions):
        k, v = (x.double() for x in kv_for(pos))
        hkv = k.shape[1]
        if out is None:
            out = torch.zeros(tq, hq, v.shape[-1], dtype=torch.float64)
        keys = [j for j in range(k.shape[0]) if j <= pos and (window is None or pos - j < window)]
        for h in range(hq):
            kh = h // (hq // hkv)
            s = (k[keys, kh] @ q[qi, h].double()) * sm_scale
            if cap:
                s = cap * torch.tanh(s / cap)
            m = s.max()
            e = torch.exp(s - m)
            den = e.sum() + (math.exp(float(sinks[h]) - float(m)) if sinks is not None else 0.0)
            out[qi, h] = (e[:, None] * v[keys, kh]).sum(0) / den
    return out


# ---------------------------------------------------------------- masks
def test_visible_mask_counts_the_query_itself():
    w, t = 8, 40
    vis = visible_mask(torch.arange(t), t, w)
    for pos in range(t):
        assert vis[pos].nonzero().flatten().tolist() == list(range(max(0, pos - w + 1), pos + 1))
    assert torch.equal(visible_mask(torch.arange(t), t, None), torch.ones(t, t, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        visible_mask(torch.arange(3), 3, 0)


# ---------------------------------------------------------------- sliding windows, unquantized
@pytest.mark.parametrize("window", [16, 96])
def test_plain_attention_window_crossing_prompt(window):
    # prompt 4x the window, GQA 8:2, every position a query (extend); W=96 -> 384 queries cross
    # the oracle's 256-query chunking too
    t, hq, hkv, d = 4 * window, 8, 2, 16
    q, k, v = _qkv(t, hq, hkv, d, seed=window)
    got = plain_attention(q, k, v, sliding_window=window)
    want = brute(q, range(t), lambda pos: (k, v), window, 1 / math.sqrt(d))
    assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-5)
    # and the window matters: full attention differs on every query past the window
    full = plain_attention(q, k, v)
    assert torch.allclose(full[:window], got[:window], atol=1e-6)
    assert (full[window:] - got[window:]).abs().amax(dim=(1, 2)).min() > 1e-3


def test_rotated_unquantized_oracle_is_the_windowed_model():
    # rotations and an fp32 HP tier change nothing: oscar_attention(quantize=False) = brute force
    t, hq, hkv, d, w = 64, 4, 2, 32, 16
    q, k, v = _qkv(t, hq, hkv, d, seed=3)
    rk, rv = _orthogonal(d, 1), _orthogonal(d, 2)
    got = oscar_attention(q, k, v, rk, rv, OscarConfig(), q_positions=torch.arange(t), sliding_window=w,
                          quantize=False, hp_dtype=torch.float32)
    want = brute(q, range(t), lambda pos: (k, v), w, 1 / math.sqrt(d))
    assert torch.allclose(got.double(), want, atol=5e-5)


def test_window_at_least_seq_len_is_full_attention():
    t, hq, hkv, d = 48, 4, 1, 16
    q, k, v = _qkv(t, hq, hkv, d, seed=5)
    cfg = OscarConfig(sink_tokens=4, recent_tokens=8)
    rk, rv = _orthogonal(d, 3), _orthogonal(d, 4)
    for w in (t, t + 1, 10 * t):
        assert torch.equal(plain_attention(q, k, v, sliding_window=w), plain_attention(q, k, v))
        for mode in ("decode", "extend"):
            a = oscar_attention(q, k, v, rk, rv, cfg, q_positions=torch.arange(t), sliding_window=w, window_mode=mode)
            b = oscar_attention(q, k, v, rk, rv, cfg, q_positions=torch.arange(t), window_mode=mode)
            assert torch.equal(a, b)


# ---------------------------------------------------------------- sliding windows over the two tiers
def _tiered(cache, sink, recent, mode):
    """``kv_for(pos)`` of the rotated cache as the query at ``pos`` reads it (HP rule written out)."""
    def kv_for(pos):
        t = cache.k_hp.shape[0]
        if mode == "decode":
            hp = [j < sink or j > pos - recent for j in range(t)]
        else:
            hp = [j < sink for j in range(t)]
        hp = torch.tensor(hp).view(t, 1, 1)
        return (torch.where(hp, cache.k_hp.double(), cache.k_deq.double()),
                torch.where(hp, cache.v_hp.double(), cache.v_deq.double()))
    return kv_for


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_quantized_window_crossing_matches_brute_force(mode):
    # a 4x-window prompt: decode reads the last query, extend reads them all; keys outside the
    # window are never attended whichever tier they live in
    w, hq, hkv, d = 24, 4, 2, 32
    t = 4 * w
    q, k, v = _qkv(t, hq, hkv, d, seed=7)
    cfg = OscarConfig(sink_tokens=4, recent_tokens=8)
    rk, rv = _orthogonal(d, 5), _orthogonal(d, 6)
    pos = torch.arange(t - 1, t) if mode == "decode" else torch.arange(t)
    qq = q[pos]
    got = oscar_attention(qq, k, v, rk, rv, cfg, q_positions=pos, sliding_window=w, window_mode=mode,
                          hp_dtype=torch.float32)
    cache = build_cache(k, v, rk, rv, cfg, torch.float32)
    qrot = torch.einsum("thd,de->the", qq.double(), rk.double())
    want_rot = brute(qrot, pos.tolist(), _tiered(cache, 4, 8, mode), w, 1 / math.sqrt(d))
    want = torch.einsum("the,de->thd", want_rot, rv.double())  # o' R_v^T
    assert torch.allclose(got.double(), want, atol=5e-5)
    # quantization is visible (the test would pass trivially if every key were read in HP)
    hp_only = oscar_attention(qq, k, v, rk, rv, cfg, q_positions=pos, sliding_window=w, quantize=False,
                              hp_dtype=torch.float32)
    assert (got - hp_only).abs().max() > 1e-3


def test_sink_tokens_that_left_the_window_are_not_attended():
    w, hq, hkv, d, sink = 16, 4, 2, 16, 4
    t = 4 * w
    q, k, v = _qkv(t, hq, hkv, d, seed=11, tq=1)
    cfg = OscarConfig(sink_tokens=sink, recent_tokens=8)
    rk, rv = _orthogonal(d, 7), _orthogonal(d, 8)
    k2, v2 = k.clone(), v.clone()
    k2[:sink] += 50.0  # sink tokens with huge scores and values
    v2[:sink] -= 50.0
    for mode in ("decode", "extend"):
        a = oscar_attention(q, k, v, rk, rv, cfg, sliding_window=w, window_mode=mode)
        b = oscar_attention(q, k2, v2, rk, rv, cfg, sliding_window=w, window_mode=mode)
        assert torch.equal(a, b)
        # without the window the same change moves the output a lot
        c = oscar_attention(q, k, v, rk, rv, cfg, window_mode=mode)
        d_ = oscar_attention(q, k2, v2, rk, rv, cfg, window_mode=mode)
        assert (c - d_).abs().max() > 1.0
    # inside the window (the query at position w - 1 still sees position 0) they are attended
    pos = torch.tensor([w - 1])
    a = oscar_attention(q, k, v, rk, rv, cfg, q_positions=pos, sliding_window=w)
    b = oscar_attention(q, k2, v2, rk, rv, cfg, q_positions=pos, sliding_window=w)
    assert (a - b).abs().max() > 1.0


def test_hp_mask_is_independent_of_the_window():
    # which tier a key lives in is the sink/recent rule only; visibility is applied on top
    m = hp_window_mask(torch.tensor([50]), 64, 4, 8, "decode")[0]
    assert m.nonzero().flatten().tolist() == [0, 1, 2, 3] + list(range(43, 64))


# ---------------------------------------------------------------- attention sinks
def test_sinks_add_exactly_exp_sink_to_the_denominator():
    t, hq, hkv, d = 40, 8, 2, 16
    q, k, v = _qkv(t, hq, hkv, d, seed=13, tq=3)
    pos = torch.tensor([9, 25, 39])
    sinks = torch.linspace(-2.0, 3.0, hq)  # one per query head, differing inside a GQA group
    scale = 0.3
    for w in (None, 12):
        base = plain_attention(q, k, v, q_positions=pos, sliding_window=w, sm_scale=scale).double()
        got = plain_attention(q, k, v, q_positions=pos, sliding_window=w, sm_scale=scale, sinks=sinks).double()
        # known amount: o_sink = o * Z / (Z + exp(s_h)), Z = sum over visible keys of exp(score)
        for qi, p in enumerate(pos.tolist()):
            keys = [j for j in range(t) if j <= p and (w is None or p - j < w)]
            for h in range(hq):
                z = torch.exp((k[keys, h // 4].double() @ q[qi, h].double()) * scale).sum()
                factor = z / (z + math.exp(float(sinks[h])))
                assert torch.allclose(got[qi, h], base[qi, h] * factor, atol=1e-6)
                assert factor < 0.999 or float(sinks[h]) < -1  # the sink is not negligible
        assert torch.allclose(got, brute(q, pos, lambda _: (k, v), w, scale, sinks=sinks), atol=1e-6)


def test_sinks_are_neither_scaled_nor_capped_nor_rotated():
    t, hq, hkv, d, w = 32, 4, 2, 16, 8
    q, k, v = _qkv(t, hq, hkv, d, seed=17, tq=2)
    pos = torch.tensor([20, 31])
    sinks = torch.tensor([4.0, -1.0, 0.5, 2.5])
    cap, scale = 1.5, 0.7  # sink 4.0 > cap: capping it would change the result
    got = plain_attention(q, k, v, q_positions=pos, sliding_window=w, sm_scale=scale, logit_cap=cap, sinks=sinks)
    want = brute(q, pos, lambda _: (k, v), w, scale, sinks=sinks, cap=cap)
    assert torch.allclose(got.double(), want, atol=1e-6)
    capped = brute(q, pos, lambda _: (k, v), w, scale, sinks=cap * torch.tanh(sinks / cap), cap=cap)
    assert (want - capped).abs().max() > 1e-2
    # the rotated, quantized oracle takes the same sinks (per query head, unrotated)
    cfg = OscarConfig(sink_tokens=2, recent_tokens=4)
    rk, rv = _orthogonal(d, 9), _orthogonal(d, 10)
    o = oscar_attention(q, k, v, rk, rv, cfg, q_positions=pos, sliding_window=w, sm_scale=scale, logit_cap=cap,
                        sinks=sinks, quantize=False, hp_dtype=torch.float32)
    assert torch.allclose(o.double(), want, atol=5e-5)
    with pytest.raises(ValueError, match=r"one logit per query head, \[4\]"):
        plain_attention(q, k, v, q_positions=pos, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="does not commute with attention sinks"):
        oscar_attention(q, k, v, rk, rv, cfg, q_positions=pos, sinks=sinks, v_mean=torch.zeros(hkv, d))


def test_quantized_decode_with_sinks_and_window_matches_brute_force():
    w, hq, hkv, d = 16, 4, 1, 32
    t = 4 * w
    q, k, v = _qkv(t, hq, hkv, d, seed=19, tq=1)
    cfg = OscarConfig(sink_tokens=4, recent_tokens=6)
    rk, rv = _orthogonal(d, 11), _orthogonal(d, 12)
    sinks = torch.tensor([1.0, 0.0, -0.5, 2.0])
    got = oscar_attention(q, k, v, rk, rv, cfg, sliding_window=w, sinks=sinks, hp_dtype=torch.float32)
    cache = build_cache(k, v, rk, rv, cfg, torch.float32)
    qrot = torch.einsum("thd,de->the", q.double(), rk.double())
    want = brute(qrot, [t - 1], _tiered(cache, 4, 6, "decode"), w, 1 / math.sqrt(d), sinks=sinks)
    assert torch.allclose(got.double(), torch.einsum("the,de->thd", want, rv.double()), atol=5e-5)


# ---------------------------------------------------------------- K shared as V
def test_k_eq_v_equals_passing_v_equal_k():
    t, hq, hkv, d, w = 80, 4, 2, 32, 24
    q, k, _ = _qkv(t, hq, hkv, d, seed=23)
    rk = torch.stack([_orthogonal(d, 20), _orthogonal(d, 21)])  # per kv head
    k_mean = torch.randn(hkv, d, generator=torch.Generator().manual_seed(5))
    same_clip = OscarConfig(sink_tokens=4, recent_tokens=8, k_clip_ratio=0.96, v_clip_ratio=0.96)
    pos = torch.arange(t)
    for mode in ("decode", "extend"):
        shared = oscar_attention(q, k, None, rk, None, same_clip, q_positions=pos, sliding_window=w,
                                 window_mode=mode, k_mean=k_mean, k_eq_v=True)
        passed = oscar_attention(q, k, k.clone(), rk, rk.clone(), same_clip, q_positions=pos, sliding_window=w,
                                 window_mode=mode, k_mean=k_mean, v_mean=k_mean.clone())
        assert torch.equal(shared, passed)
    # V is read from K's codes (K's clip ratio), not quantized again with V's settings
    default_clip = OscarConfig(sink_tokens=4, recent_tokens=8)  # v_clip 0.92 != k_clip 0.96
    shared = oscar_attention(q, k, None, rk, None, default_clip, q_positions=pos, sliding_window=w, k_eq_v=True)
    separate = oscar_attention(q, k, k, rk, rk, default_clip, q_positions=pos, sliding_window=w)
    assert (shared - separate).abs().max() > 1e-4
    cache = build_cache(k, None, rk, None, default_clip, k_eq_v=True)
    assert cache.v_quant is cache.k_quant and cache.v_hp is cache.k_hp


def test_k_eq_v_output_is_counter_rotated_with_r_k():
    # unquantized fp32: the K=V layer is the windowed model with v = k, mean added back
    t, hq, hkv, d, w = 40, 4, 2, 16, 12
    q, k, _ = _qkv(t, hq, hkv, d, seed=29)
    rk = _orthogonal(d, 30)
    k_mean = 0.5 * torch.ones(hkv, d)
    got = oscar_attention(q, k, None, rk, None, OscarConfig(), q_positions=torch.arange(t), sliding_window=w,
                          quantize=False, hp_dtype=torch.float32, k_mean=k_mean, k_eq_v=True)
    want = brute(q, range(t), lambda _: (k, k), w, 1 / math.sqrt(d))
    assert torch.allclose(got.double(), want, atol=5e-5)


def test_k_eq_v_refuses_a_v_that_differs_from_k():
    t, hq, hkv, d = 8, 2, 1, 16
    q, k, v = _qkv(t, hq, hkv, d, seed=31)
    rk, rv = _orthogonal(d, 1), _orthogonal(d, 2)
    cfg = OscarConfig()
    with pytest.raises(ValueError, match="stores both: k_eq_v=False"):
        oscar_attention(q, k, v, rk, None, cfg, k_eq_v=True)
    with pytest.raises(ValueError, match=r"R_v = R_k"):
        oscar_attention(q, k, None, rk, rv, cfg, k_eq_v=True)
    with pytest.raises(ValueError, match="v_mean must equal k_mean"):
        oscar_attention(q, k, None, rk, None, cfg, k_eq_v=True, v_mean=torch.ones(hkv, d))
    with pytest.raises(ValueError, match="pass v=None"):
        build_cache(k, v, rk, rv, cfg, k_eq_v=True)
