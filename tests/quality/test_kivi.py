"""KIVI-style 2-bit baseline (quant/baselines.py) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_oscar.quant.baselines import (kivi_bits_per_element, kivi_cache, kivi_fake_quant_groups, kivi_hp_masks,
                                          kivi_quantize_keys, kivi_quantize_values, naive_bits_per_element,
                                          naive_symmetric_int2)
from sglang_oscar.reference.attention import attend, plain_attention


def test_group_quantizer_by_hand():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    # mn = 0, scale = 5/3; x/scale = 0, .6, 1.2, 1.8, 2.4, 3 -> codes 0, 1, 1, 2, 2, 3
    s = 5.0 / 3.0
    want = torch.tensor([0.0, s, s, 2 * s, 2 * s, 3 * s])
    assert torch.allclose(kivi_fake_quant_groups(x, "float32"), want, atol=1e-6)
    # fp16 storage: the pair is rounded first (5/3 -> 1.6669921875), codes from the stored pair
    s16 = float(torch.tensor(5.0 / 3.0, dtype=torch.float16))
    assert s16 == 1.6669921875
    assert torch.equal(kivi_fake_quant_groups(x), torch.tensor([0.0, s16, s16, 2 * s16, 2 * s16, 3 * s16]))
    # asymmetric: negative offset; round half to even at exactly .5 (torch.round, KIVI's reference)
    y = torch.tensor([-3.0, -2.5, -1.0, 0.0])  # mn -3, scale 1: (y - mn) = 0, .5, 2, 3 -> 0, 0, 2, 3
    assert torch.equal(kivi_fake_quant_groups(y, "float32"), torch.tensor([-3.0, -3.0, -1.0, 0.0]))
    # constant group: scale 0 -> the minimum, no NaN
    assert torch.equal(kivi_fake_quant_groups(torch.full((4,), 2.5)), torch.full((4,), 2.5))


def test_keys_per_channel_values_per_token():
    # keys [T=4, H=1, D=2], key groups of 2 tokens. Channel 0 takes two values per token group
    # (exact in 2 bits per channel); per-token quantization could not reproduce it.
    k = torch.tensor([[[0.0, 100.0]], [[3.0, 130.0]], [[10.0, -7.0]], [[13.0, -4.0]]])
    kq = kivi_quantize_keys(k, group_size=2, scale_dtype="float32")
    assert torch.equal(kq, k)
    # one token group spanning all 4 tokens: channel 0 min 0, max 13 -> scale 13/3, codes round(x/s)
    kq4 = kivi_quantize_keys(k, group_size=4, scale_dtype="float32")
    s = 13.0 / 3.0
    assert torch.allclose(kq4[:, 0, 0], torch.tensor([0.0, s, 2 * s, 3 * s]), atol=1e-5)  # 3/s = .69 -> 1, 10/s = 2.3 -> 2
    # a trailing partial group is quantized over its own tokens
    k5 = torch.cat([k, torch.tensor([[[7.0, 7.0]]])])
    assert torch.equal(kivi_quantize_keys(k5, 2, "float32")[4], torch.tensor([[7.0, 7.0]]))
    # values [T=1, H=1, D=4], groups of 2 along head_dim: each pair is exact
    v = torch.tensor([[[1.0, -1.0, 50.0, 60.0]]])
    assert torch.equal(kivi_quantize_values(v, 2, "float32"), v)
    vq = kivi_quantize_values(v, 4, "float32")  # one group: mn -1, scale 61/3; (x - mn)/s = .098, 0, 2.51, 3
    s = 61.0 / 3.0
    assert torch.allclose(vq[0, 0], torch.tensor([-1.0, -1.0, 3 * s - 1.0, 3 * s - 1.0]), atol=1e-4)
    with pytest.raises(ValueError):
        kivi_quantize_values(v, 3)


def test_cache_residual_rows_exact():
    torch.manual_seed(0)
    t, r, g = 10, 4, 2
    k, v = torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    kh, vh = kivi_cache(k, v, residual=r, key_group=g, value_group=4)
    n_k, n_v = (t // r) * r, t - r  # 8 INT2 keys, 6 INT2 values
    assert torch.equal(kh[n_k:], k[n_k:]) and torch.equal(vh[n_v:], v[n_v:])  # residual rows exact
    assert (kh[:n_k] != k[:n_k]).any() and (vh[:n_v] != v[:n_v]).any()
    assert torch.equal(kh[:n_k], kivi_quantize_keys(k[:n_k], g))
    assert torch.equal(vh[:n_v], kivi_quantize_values(v[:n_v], 4))
    # key groups never straddle the INT2/residual boundary, so a key's INT2 value does not depend on the length
    assert torch.equal(kivi_quantize_keys(k, g)[:n_k], kh[:n_k])
    # 2 bits per element: at most 4 distinct values per value group of 8 elements / key group of 8 tokens
    v8 = kivi_quantize_values(torch.randn(5, 2, 16), 8)
    assert all(v8[i, h, c : c + 8].unique().numel() <= 4 for i in range(5) for h in range(2) for c in (0, 8))
    k4 = kivi_quantize_keys(torch.randn(16, 1, 3), 8)
    assert all(k4[i : i + 8, 0, c].unique().numel() <= 4 for i in (0, 8) for c in range(3))
    with pytest.raises(ValueError):
        kivi_cache(k, v, residual=3, key_group=2)


def test_hp_masks_by_hand():
    hp_k, hp_v = kivi_hp_masks(torch.arange(6), 6, residual=2)
    # query i sees n = i + 1 keys; INT2 keys are j < floor(n / 2) * 2; HP values are j > i - 2
    int2_k = [[], [0, 1], [0, 1], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    for i in range(6):
        assert [j for j in range(i + 1) if not hp_k[i, j]] == int2_k[i]
        assert [j for j in range(i + 1) if hp_v[i, j]] == [j for j in range(max(0, i - 1), i + 1)]
    none_k, none_v = kivi_hp_masks(torch.arange(3), 3, residual=0)
    assert not none_k.any() and not none_v.any()


def test_decode_attention_reads_the_cache_of_its_length():
    """The query at position i through attend(hp_masks=kivi) equals plain attention over the KIVI
    cache holding i + 1 tokens."""
    torch.manual_seed(1)
    t, r, g = 12, 4, 2
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    out = attend(q, torch.arange(t), k, v, kivi_quantize_keys(k, g), kivi_quantize_values(v, 8), sink=0, recent=0,
                 sm_scale=8 ** -0.5, hp_masks=lambda p, n: kivi_hp_masks(p, n, r))
    for i in (0, 3, 4, 7, 11):
        kc, vc = kivi_cache(k[: i + 1], v[: i + 1], residual=r, key_group=g, value_group=8)
        ref = plain_attention(q[i : i + 1], kc, vc, sm_scale=8 ** -0.5)
        assert torch.allclose(out[i : i + 1], ref, atol=1e-5), i


def test_bits_by_hand():
    # L = 2048, R = G = 128, D = 128, 16-bit pairs: keys all INT2 (2048 = 16 R): 2.25;
    # values: 1920 INT2 (2.25) + 128 BF16 (16): (1920 * 2.25 + 128 * 16) / 2048 = 3.109375
    assert kivi_bits_per_element(2048, 128) == pytest.approx((2.25 + 3.109375) / 2)
    # L = 2100: keys 2048 INT2 + 52 BF16; values 1972 INT2 + 128 BF16
    want = ((2048 * 2.25 + 52 * 16) + (1972 * 2.25 + 128 * 16)) / (2 * 2100)
    assert kivi_bits_per_element(2100, 128) == pytest.approx(want)
    # G = 32: 2 + 32 / 32 = 3 bits for INT2 elements
    assert kivi_bits_per_element(131072, 128, key_group=32, value_group=32) == pytest.approx(
        (3.0 + (130944 * 3.0 + 128 * 16) / 131072) / 2)
    assert kivi_bits_per_element(100, 128) == 16.0  # shorter than the residual: nothing quantized
    assert naive_bits_per_element(128) == 2.125 and naive_bits_per_element(32) == 2.5
    with pytest.raises(ValueError):
        kivi_bits_per_element(2048, 128, residual=100, key_group=32)


def test_naive_levels():
    x = torch.tensor([[-3.0, -1.0, 0.2, 3.0]])  # s = 3 / 1.5 = 2; x/s = -1.5, -.5, .1, 1.5
    assert torch.equal(naive_symmetric_int2(x), torch.tensor([[-3.0, -1.0, 1.0, 3.0]]))
    assert math.isclose(float(naive_symmetric_int2(torch.tensor([[0.4, 1.2]]))[0, 0]), 0.4, rel_tol=1e-6)


def test_attend_hp_masks_hook_matches_window_rule():
    """``attend(hp_masks=...)`` with the sink/recent masks reproduces the default window rule exactly."""
    from sglang_oscar.reference.attention import hp_window_mask

    torch.manual_seed(2)
    t = 40
    q, k, v = torch.randn(t, 4, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16)
    kl, vl = k + 0.1 * torch.randn_like(k), v + 0.1 * torch.randn_like(v)
    pos = torch.arange(t)
    ref = attend(q, pos, k, v, kl, vl, sink=3, recent=7, sm_scale=0.25)

    def masks(p, n):
        m = hp_window_mask(p, n, 3, 7, "decode")
        return m, m

    assert torch.equal(attend(q, pos, k, v, kl, vl, sink=0, recent=0, sm_scale=0.25, hp_masks=masks), ref)
    # K and V masks are applied separately: exact keys with INT2 values == plain attention over (k, v_low)
    mixed = attend(q, pos, k, v, kl, vl, sink=0, recent=0, sm_scale=0.25,
                   hp_masks=lambda p, n: (torch.ones(len(p), n, dtype=torch.bool), torch.zeros(len(p), n, dtype=torch.bool)))
    assert torch.allclose(mixed, attend(q, pos, k, vl, None, None, sink=0, recent=0, sm_scale=0.25), atol=1e-6)
    assert not torch.allclose(mixed, attend(q, pos, kl, vl, None, None, sink=0, recent=0, sm_scale=0.25), atol=1e-3)
