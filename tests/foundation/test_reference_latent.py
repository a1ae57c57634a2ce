"""The MLA latent oracle (``reference/latent.py``) against brute force and its own invariants.

The brute force here is non-absorbed MLA in float64 written out per query: per head
``K = [c W_UK^T | k_pe]``, ``V = c W_UV``, a softmax over the keys the query may see; it never
calls the oracle.
"""

from __future__ import annotations

import math

import pytest
import torch

from sglang_oscar.config import OscarConfig
from sglang_oscar.reference import relative_error_db
from sglang_oscar.reference.latent import (
    build_latent_cache,
    expand_latent,
    latent_attention,
    split_kv_b_proj,
)
from sglang_oscar.rotation.latent import latent_hadamard, latent_rotation_from_covariance


def _mla(t=40, tq=3, h=4, n=16, p=8, r=64, v=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(tq, h, n, generator=g)
    q_pe = torch.randn(tq, h, p, generator=g)
    c = torch.randn(t, r, generator=g)
    kpe = torch.randn(t, p, generator=g)
    weight = torch.randn(h * (n + v), r, generator=g) / math.sqrt(r)
    w_kc, w_vc = split_kv_b_proj(weight, h, n, v)
    return q_nope, q_pe, c, kpe, w_kc, w_vc


def _orthogonal(d, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    qm, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return qm.float()


def brute(q_nope, q_pe, c, kpe, w_kc, w_vc, scale, positions, allowed=None):
    """float64 non-absorbed MLA; ``allowed(qi, j) -> bool`` restricts keys beyond causality."""
    tq, h, _ = q_nope.shape
    out = torch.zeros(tq, h, w_vc.shape[-1], dtype=torch.float64)
    for qi, pos in enumerate(int(x) for x in positions):
        keys = [j for j in range(pos + 1) if allowed is None or allowed(qi, j)]
        cj = c[keys].double()
        for hh in range(h):
            k = torch.cat([cj @ w_kc[hh].double().T, kpe[keys].double()], dim=-1)  # [n_keys, N + P]
            vv = cj @ w_vc[hh].double()
            q = torch.cat([q_nope[qi, hh].double(), q_pe[qi, hh].double()])
            p = torch.softmax(k @ q * scale, dim=0)
            out[qi, hh] = p @ vv
    return out


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_split_kv_b_proj_is_the_linear_layer():
    """w_kc / w_vc reproduce kv_b_proj's per-head k_nope and v (SGLang's split convention)."""
    h, n, v, r, t = 3, 8, 6, 16, 5
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(r, h * (n + v), bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(h * (n + v), r, generator=g))
    c = torch.randn(t, r, generator=g)
    kpe = torch.randn(t, 4, generator=g)
    kv = lin(c).detach().view(t, h, n + v)
    k, vv = expand_latent(c, kpe, *split_kv_b_proj(lin.weight.detach(), h, n, v))
    torch.testing.assert_close(k[..., :n], kv[..., :n])
    torch.testing.assert_close(k[..., n:], kpe.unsqueeze(1).expand(t, h, 4))
    torch.testing.assert_close(vv, kv[..., n:])
    with pytest.raises(ValueError, match="kv_b_proj"):
        split_kv_b_proj(lin.weight.detach(), h, n + 1, v)


@pytest.mark.parametrize("window_mode", ["decode", "extend"])
@pytest.mark.parametrize("rotated", [False, True])
def test_windows_covering_everything_equal_brute_force(window_mode, rotated):
    q_nope, q_pe, c, kpe, w_kc, w_vc = _mla()
    t = c.shape[0]
    cfg = OscarConfig(group_size=16, sink_tokens=t, recent_tokens=0)
    scale = 0.1234
    pos = torch.tensor([5, 17, t - 1])
    rot = _orthogonal(c.shape[1], 0) if rotated else None
    out = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, rot, cfg, softmax_scale=scale, q_positions=pos,
                           window_mode=window_mode, hp_dtype=torch.float32)
    exp = brute(q_nope, q_pe, c, kpe, w_kc, w_vc, scale, pos)
    assert out.dtype == torch.float32 and out.shape == exp.shape
    assert _rel(out, exp) < 1e-5


def test_rotation_invariance_of_the_unquantized_path():
    q_nope, q_pe, c, kpe, w_kc, w_vc = _mla(seed=2)
    cfg = OscarConfig(group_size=32, sink_tokens=0, recent_tokens=0)
    kw = dict(softmax_scale=0.2, window_mode="none", hp_dtype=torch.float32)
    for output in ("v", "latent"):
        plain = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, cfg, output=output, **kw)
        rot = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, _orthogonal(64, 3), cfg, output=output, **kw)
        assert _rel(rot, plain) < 1e-5


def test_outputs_are_one_computation():
    q_nope, q_pe, c, kpe, w_kc, w_vc = _mla(seed=4)
    cfg = OscarConfig(group_size=16, sink_tokens=2, recent_tokens=4)
    r = latent_hadamard(64, 16).float()
    kw = dict(softmax_scale=0.3)
    o_rot = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, r, cfg, output="latent_rotated", **kw)
    o_lat = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, r, cfg, output="latent", **kw)
    o_v = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, r, cfg, **kw)
    torch.testing.assert_close(o_rot @ r.T, o_lat)
    torch.testing.assert_close(torch.einsum("thr,hrv->thv", o_lat, w_vc), o_v)


def test_cache_layout_is_one_kv_head_per_token():
    _, _, c, kpe, *_ = _mla(t=7, r=64)
    lc = build_latent_cache(c, kpe, None, OscarConfig(group_size=16))
    assert lc.quant.codes.shape == (7, 1, 16) and lc.quant.codes.dtype == torch.uint8
    assert lc.quant.pairs.shape == (7, 1, 8) and lc.quant.pairs.dtype == torch.float16
    assert lc.ckv_hp.dtype == torch.bfloat16 and lc.kpe.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"group size 48 does not divide kv_lora_rank 64 .*pick 64 or 32 or 16"):
        build_latent_cache(c, kpe, None, OscarConfig(group_size=48))
    with pytest.raises(ValueError, match="rotation"):
        build_latent_cache(c, kpe, torch.eye(32), OscarConfig(group_size=16))


def test_fake_quant_bf16_cache_matches_int2():
    """The upstream fake-quant pool (BF16 storage of the dequantized latent) computes the same numbers."""
    q_nope, q_pe, c, kpe, w_kc, w_vc = _mla(t=96, tq=8, seed=5)
    cfg = OscarConfig(group_size=16, sink_tokens=4, recent_tokens=8)
    r = latent_hadamard(64, 16).float()
    for mode in ("decode", "extend"):
        a = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, r, cfg, softmax_scale=0.2, window_mode=mode)
        b = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, r, cfg, softmax_scale=0.2, window_mode=mode,
                             cache="bf16")
        exact = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, r, cfg, softmax_scale=0.2, window_mode="none")
        assert _rel(b, a) < 5e-3
        assert _rel(a, exact) > 10 * _rel(b, a)  # the quantization error, not BF16 rounding, is what differs


def test_windows_change_only_the_middle_tier():
    q_nope, q_pe, c, kpe, w_kc, w_vc = _mla(t=48, tq=3, seed=6)
    sink, recent = 4, 8
    cfg = OscarConfig(group_size=16, sink_tokens=sink, recent_tokens=recent)
    pos = torch.tensor([40, 44, 47])
    kw = dict(softmax_scale=0.25, q_positions=pos, window_mode="decode")
    lc = build_latent_cache(c, kpe, None, cfg)
    base = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, cfg, latent_cache=lc, **kw)
    window = torch.zeros(48, dtype=torch.bool)
    window[:sink] = True
    window[int(pos.max()) - recent + 1:] = True  # HP for every query that sees it
    middle = torch.zeros(48, dtype=torch.bool)
    middle[sink:int(pos.min()) - recent + 1] = True  # INT2 for every query
    noise = torch.randn(48, 64, generator=torch.Generator().manual_seed(7)) * 5
    low = build_latent_cache(c, kpe, None, cfg)
    low.ckv_low = torch.where(window.unsqueeze(1), lc.ckv_low + noise, lc.ckv_low)
    assert torch.equal(latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, cfg, latent_cache=low, **kw), base)
    hp = build_latent_cache(c, kpe, None, cfg)
    hp.ckv_hp = torch.where(middle.unsqueeze(1), lc.ckv_hp.float() + noise, lc.ckv_hp.float()).to(torch.bfloat16)
    assert torch.equal(latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, cfg, latent_cache=hp, **kw), base)
    mid = build_latent_cache(c, kpe, None, cfg)
    mid.ckv_low = torch.where(middle.unsqueeze(1), lc.ckv_low + noise, lc.ckv_low)
    assert not torch.allclose(latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, cfg, latent_cache=mid, **kw),
                              base)


def test_extend_reads_the_chunk_from_int2():
    """Extend = decode without the recent window; the chunk's own latents are read quantized."""
    q_nope, q_pe, c, kpe, w_kc, w_vc = _mla(t=40, tq=6, seed=8)
    kw = dict(softmax_scale=0.25)
    ext = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, OscarConfig(group_size=16, sink_tokens=4,
                           recent_tokens=16), window_mode="extend", **kw)
    dec0 = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, OscarConfig(group_size=16, sink_tokens=4,
                            recent_tokens=0), window_mode="decode", **kw)
    dec = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, OscarConfig(group_size=16, sink_tokens=4,
                           recent_tokens=16), window_mode="decode", **kw)
    assert torch.equal(ext, dec0) and not torch.allclose(ext, dec)


def test_topk_restriction_equals_masking():
    q_nope, q_pe, c, kpe, w_kc, w_vc = _mla(t=40, tq=4, seed=9)
    t = c.shape[0]
    pos = torch.tensor([9, 20, 33, 39])
    g = torch.Generator().manual_seed(10)
    k = 8
    topk = torch.full((4, k), -1, dtype=torch.long)
    for i, p in enumerate(pos.tolist()):
        sel = torch.randperm(p + 1, generator=g)[: min(k - 2, p + 1)]  # leave -1 padding at the end
        topk[i, : sel.numel()] = sel
    chosen = [set(row[row >= 0].tolist()) for row in topk]
    cfg = OscarConfig(group_size=16, sink_tokens=t, recent_tokens=0)
    out = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, _orthogonal(64, 1), cfg, softmax_scale=0.3,
                           q_positions=pos, topk_indices=topk, hp_dtype=torch.float32)
    exp = brute(q_nope, q_pe, c, kpe, w_kc, w_vc, 0.3, pos, allowed=lambda qi, j: j in chosen[qi])
    assert _rel(out, exp) < 1e-5
    # quantized, with windows: selecting every visible key (any order, padded) is no restriction
    cfg = OscarConfig(group_size=16, sink_tokens=2, recent_tokens=4)
    every = torch.full((4, t + 3), -1, dtype=torch.long)
    for i, p in enumerate(pos.tolist()):
        every[i, : p + 1] = torch.randperm(p + 1, generator=g)
    kw = dict(softmax_scale=0.3, q_positions=pos)
    torch.testing.assert_close(
        latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, cfg, topk_indices=every, **kw),
        latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, cfg, **kw), rtol=0, atol=1e-6)
    bad = topk.clone()
    bad[0, 0] = 10  # a key after query 0's position 9
    with pytest.raises(ValueError, match="topk_indices"):
        latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, cfg, topk_indices=bad, **kw)
    with pytest.raises(ValueError, match="no visible key"):
        latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, cfg, topk_indices=torch.full((4, 2), -1), **kw)


def _outlier_latents(t, r, seed, outliers):
    """Correlated latents with a few channels 25x larger (the planted outliers)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(r, r, generator=torch.Generator().manual_seed(99)) / math.sqrt(r)
    c = torch.randn(t, r, generator=g) @ (torch.eye(r) + mix)
    c[:, outliers] *= 25.0
    return c


def test_fitted_rotation_beats_naive_on_outlier_channels():
    r, grp = 512, 64
    outliers = torch.tensor([3, 77, 130, 301, 450])
    calib = _outlier_latents(2048, r, seed=11, outliers=outliers)
    rot, _ = latent_rotation_from_covariance(calib.double().T @ calib.double() / calib.shape[0], block=grp)
    c = _outlier_latents(192, r, seed=12, outliers=outliers)
    g = torch.Generator().manual_seed(13)
    h, n, p, v, tq = 4, 32, 16, 32, 16
    q_nope, q_pe = torch.randn(tq, h, n, generator=g), torch.randn(tq, h, p, generator=g)
    kpe = torch.randn(192, p, generator=g)
    w_kc, w_vc = split_kv_b_proj(torch.randn(h * (n + v), r, generator=g) / math.sqrt(r), h, n, v)
    cfg = OscarConfig(group_size=grp, sink_tokens=0, recent_tokens=0)
    # a softer scale than (N + P)^-0.5: the 25x channels would otherwise make every softmax one-hot
    kw = dict(softmax_scale=1 / math.sqrt(n + p) / 8, q_positions=torch.arange(192 - tq, 192))
    exact = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, cfg, window_mode="none", **kw)
    naive = relative_error_db(latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, cfg, **kw), exact)
    fitted = relative_error_db(latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, rot.float(), cfg, **kw), exact)
    hadamard = relative_error_db(
        latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, latent_hadamard(r, grp).float(), cfg, **kw), exact)
    # measured: naive -0.3 dB (K's clip ratio clips the outlier channels), Hadamard -14.9, fitted -20.0
    assert fitted < naive - 10.0, (naive, fitted)
    assert fitted < hadamard - 2.0, (hadamard, fitted)


def test_middle_tier_is_the_calibration_fake_quant():
    """One oracle: the latent the calibration's error/ppl verbs fake-quantize is the pool's middle tier."""
    from sglang_oscar.calibrate.oracle import latent_fake_quant

    _, _, c, kpe, *_ = _mla(t=33, r=256, seed=14)
    r = _orthogonal(256, 15)
    # an explicit group size, and none (the served default: groups of 128 along the rank, not one per row)
    for cfg in (OscarConfig(group_size=16), OscarConfig()):
        lc = build_latent_cache(c, kpe, r, cfg)
        assert torch.equal(lc.ckv_low @ r.T, latent_fake_quant(c, r, cfg))
        fake = build_latent_cache(c, kpe, r, cfg, cache="bf16")
        assert torch.equal(fake.ckv_low, latent_fake_quant(c, r, cfg).to(torch.bfloat16).float())
    assert lc.quant.group_size == 128
