import math

import pytest
import torch

from sglang_oscar.config import OscarConfig
from sglang_oscar.quant import quantize_rows
from sglang_oscar.reference import (
    build_cache,
    hp_window_mask,
    oscar_attention,
    plain_attention,
    relative_error_db,
    rotate_rows,
)
from sglang_oscar.reference.synthetic import synthetic_qkv
from sglang_oscar.rotation import default_hadamard, fit_layer


def _naive_attention(q, k, v, positions, sm_scale, sliding_window=None, logit_cap=None):
    """Loop-per-query reference written independently of reference.attend."""
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for n, i in enumerate(positions.tolist()):
        lo = 0 if sliding_window is None else max(0, i - sliding_window + 1)
        for h in range(q.shape[1]):
            s = (k[lo : i + 1, h // g].double() @ q[n, h].double()) * sm_scale
            if logit_cap:
                s = logit_cap * torch.tanh(s / logit_cap)
            out[n, h] = torch.softmax(s, 0) @ v[lo : i + 1, h // g].double()
    return out


@pytest.mark.parametrize("per_head", [False, True])
def test_rotation_without_quantization_is_exact_fp32(per_head):
    q, k, v = synthetic_qkv(300, 8, 2, 64, seed=4)
    rk, rv = fit_layer(q, k, v, per_head=per_head)
    cfg = OscarConfig()
    got = oscar_attention(q[-50:], k, v, rk.float(), rv.float(), cfg, quantize=False, hp_dtype=torch.float32)
    want = plain_attention(q[-50:], k, v)
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-5, rel


def test_plain_attention_matches_naive_loop_with_window_and_cap():
    q, k, v = synthetic_qkv(40, 4, 2, 16, seed=2)
    pos = torch.tensor([3, 17, 39])
    for sw, cap in ((None, None), (8, None), (None, 5.0), (5, 2.0)):
        got = plain_attention(q[pos], k, v, q_positions=pos, sliding_window=sw, logit_cap=cap)
        want = _naive_attention(q[pos], k, v, pos, 16**-0.5, sw, cap)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_windows_covering_everything_equal_unquantized():
    q, k, v = synthetic_qkv(200, 8, 2, 64, seed=5)
    h = default_hadamard(64).float()
    cfg = OscarConfig(sink_tokens=256, recent_tokens=0)
    for mode in ("decode", "extend"):
        got = oscar_attention(q, k, v, h, h, cfg, q_positions=torch.arange(200), window_mode=mode)
        want = oscar_attention(q, k, v, h, h, cfg, q_positions=torch.arange(200), quantize=False)
        assert torch.equal(got, want)
    cfg = OscarConfig(sink_tokens=0, recent_tokens=200)
    got = oscar_attention(q[-1:], k, v, h, h, cfg)
    assert torch.equal(got, oscar_attention(q[-1:], k, v, h, h, cfg, quantize=False))


def test_cache_bytes_are_quantizer_bytes_of_rotated_bf16_rows():
    q, k, v = synthetic_qkv(64, 4, 2, 128, seed=6)
    rk, rv = fit_layer(q, k, v, per_head=True)
    cfg = OscarConfig(group_size=64, quantizer="lloyd-max")
    cache = build_cache(k, v, rk.float(), rv.float(), cfg)
    k_hp = torch.stack([k[:, h] @ rk[h].float() for h in range(2)], dim=1).to(torch.bfloat16)
    assert torch.equal(cache.k_hp, k_hp)
    want = quantize_rows(k_hp, group_size=64, clip_ratio=0.96, quantizer="lloyd-max", scale_dtype="float16")
    assert torch.equal(cache.k_quant.codes, want.codes) and torch.equal(cache.k_quant.pairs, want.pairs)


def test_window_masks():
    pos = torch.tensor([5, 9])
    dec = hp_window_mask(pos, 10, 2, 3, "decode")
    assert dec.int().tolist() == [[1, 1, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0, 1, 1, 1]]
    ext = hp_window_mask(pos, 10, 2, 3, "extend")
    assert ext.int().tolist() == [[1, 1] + [0] * 8] * 2
    with pytest.raises(ValueError, match="window_mode"):
        hp_window_mask(pos, 10, 2, 3, "prefill")


def test_decode_semantics_prefill_position_equals_decode_of_prefix():
    q, k, v = synthetic_qkv(400, 8, 2, 64, seed=7)
    h = default_hadamard(64).float()
    cfg = OscarConfig(sink_tokens=16, recent_tokens=32)
    full = oscar_attention(q, k, v, h, h, cfg, q_positions=torch.arange(400))
    for i in (10, 47, 48, 300, 399):
        dec = oscar_attention(q[i : i + 1], k[: i + 1], v[: i + 1], h, h, cfg)
        torch.testing.assert_close(full[i : i + 1], dec, rtol=1e-5, atol=1e-6)


def test_extend_semantics_do_not_depend_on_chunking():
    q, k, v = synthetic_qkv(256, 8, 2, 64, seed=8)
    h = default_hadamard(64).float()
    cfg = OscarConfig(sink_tokens=16, recent_tokens=32)
    full = oscar_attention(q, k, v, h, h, cfg, q_positions=torch.arange(256), window_mode="extend")
    parts = [
        oscar_attention(q[a:b], k[:b], v[:b], h, h, cfg, q_positions=torch.arange(a, b), window_mode="extend")
        for a, b in ((0, 64), (64, 100), (100, 256))
    ]
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-5, atol=1e-6)


def test_per_head_rotation_uses_each_query_heads_kv_head():
    q, k, v = synthetic_qkv(32, 8, 2, 16, seed=9)
    rk, _ = fit_layer(q, k, v, per_head=True)
    qr = rotate_rows(q, rk.float())
    for hq in range(8):
        torch.testing.assert_close(qr[:, hq], q[:, hq] @ rk[hq // 4].float())


def test_oscar_beats_hadamard_beats_no_rotation_on_outlier_data():
    # the demo's setting: calibrate on one draw, measure on another (docs/benchmarks.md)
    q_cal, k_cal, v_cal = synthetic_qkv(4096, 8, 2, 128, seed=1)
    q, k, v = synthetic_qkv(4096, 8, 2, 128, seed=2)
    rk, rv = fit_layer(q_cal, k_cal, v_cal)
    q = q[-256:]
    exact = plain_attention(q, k, v)
    eye, had = torch.eye(128), default_hadamard(128).float()
    for quantizer in ("uniform", "lloyd-max"):
        cfg = OscarConfig(quantizer=quantizer)
        err = {
            name: relative_error_db(oscar_attention(q, k, v, a, b, cfg), exact)
            for name, (a, b) in {"none": (eye, eye), "hadamard": (had, had), "oscar": (rk.float(), rv.float())}.items()
        }
        assert err["oscar"] < err["hadamard"] - 0.1, err
        assert err["hadamard"] < err["none"] - 3.0, err


def test_reference_rejects_bad_input():
    q, k, v = synthetic_qkv(16, 6, 2, 16, seed=0)
    eye = torch.eye(16)
    cfg = OscarConfig()
    with pytest.raises(ValueError, match="multiple"):
        oscar_attention(q[:, :5], k, v, eye, eye, cfg)
    with pytest.raises(ValueError, match="head_dim"):
        oscar_attention(q, k, v, torch.eye(8), eye, cfg)
    with pytest.raises(ValueError, match="sliding_window"):
        plain_attention(q, k, v, sliding_window=0)
    with pytest.raises(ValueError, match="kv heads"):
        oscar_attention(q, k, v, torch.eye(16).expand(1, 16, 16), eye, cfg)
    assert plain_attention(q[:0], k, v, q_positions=torch.arange(0)).shape == (0, 6, 16)
    with pytest.raises(ValueError, match="q_positions"):
        oscar_attention(q[:2], k, v, eye, eye, cfg, q_positions=torch.tensor([3, 99]))
    with pytest.raises(ValueError, match="does not divide"):
        oscar_attention(q, k, v, eye, eye, OscarConfig(group_size=12))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        OscarConfig(k_clip_ratio=2.0)
    with pytest.raises(ValueError, match="non-negative"):
        OscarConfig(sink_tokens=-1)
    assert math.isfinite(relative_error_db(torch.ones(3), torch.ones(3)))
