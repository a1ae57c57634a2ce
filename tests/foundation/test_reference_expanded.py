"""Expanded-MHA storage of MLA layers in the MHA oracle: K head_dim 192 (``[k_nope | k_pe]``), V 128.

``--oscar-mla-storage expanded`` caches per head ``K = [c W_UK^T | k_pe]`` and ``V = c W_UV``
(:func:`sglang_oscar.reference.latent.expand_latent`) in the existing INT2 MHA pool, so the MHA
oracle (``oscar_attention``) must take unequal, non-power-of-two head dims.
"""

from __future__ import annotations

import math

import pytest
import torch

from sglang_oscar.config import OscarConfig
from sglang_oscar.quant import check_head_dim, resolve_group_size
from sglang_oscar.reference import build_cache, oscar_attention, relative_error_db
from sglang_oscar.reference.latent import expand_latent, latent_attention, split_kv_b_proj
from sglang_oscar.rotation.hadamard import default_hadamard

N, P, V, R, H = 128, 64, 128, 64, 2  # DeepSeek-V3's per-head dims; a small rank keeps it quick


def _layer(t=24, tq=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_nope, q_pe = torch.randn(tq, H, N, generator=g), torch.randn(tq, H, P, generator=g)
    c, kpe = torch.randn(t, R, generator=g), torch.randn(t, P, generator=g)
    w_kc, w_vc = split_kv_b_proj(torch.randn(H * (N + V), R, generator=g) / math.sqrt(R), H, N, V)
    return q_nope, q_pe, c, kpe, w_kc, w_vc


def _orthogonal(d, seed):
    qm, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return qm.float()


def test_group_sizes_for_k192_v128():
    check_head_dim(192)  # a multiple of 4: 48 packed bytes per row
    for g in (None, 16, 32, 64):
        OscarConfig(group_size=g).check_head_dims(192, 128)
    assert resolve_group_size(192, None) == 192 and resolve_group_size(128, None) == 128
    for g in (96, 128, 192):  # must divide both 192 and 128
        with pytest.raises(ValueError, match="does not divide"):
            OscarConfig(group_size=g).check_head_dims(192, 128)


def test_expanded_equals_latent_oracle_unquantized():
    """Expanded K 192 / V 128 through the MHA oracle = absorbed MQA through the latent oracle."""
    q_nope, q_pe, c, kpe, w_kc, w_vc = _layer()
    k, v = expand_latent(c, kpe, w_kc, w_vc)
    assert k.shape == (24, H, 192) and v.shape == (24, H, 128)
    q = torch.cat([q_nope, q_pe], dim=-1)
    cfg = OscarConfig(group_size=64, sink_tokens=0, recent_tokens=0)
    scale = (N + P) ** -0.5  # also oscar_attention's default 1/sqrt(D_k)
    exp = latent_attention(q_nope, q_pe, c, kpe, w_kc, w_vc, None, cfg, softmax_scale=scale, window_mode="none",
                           hp_dtype=torch.float32)
    out = oscar_attention(q, k, v, _orthogonal(192, 1), _orthogonal(128, 2), cfg, quantize=False,
                          hp_dtype=torch.float32)
    assert out.shape == (4, H, 128)
    assert float((out - exp).norm() / exp.norm()) < 1e-5


@pytest.mark.parametrize("group_size", [None, 64])
def test_expanded_int2_cache_shapes_and_error(group_size):
    q_nope, q_pe, c, kpe, w_kc, w_vc = _layer(t=64, tq=8, seed=3)
    k, v = expand_latent(c, kpe, w_kc, w_vc)
    cfg = OscarConfig(group_size=group_size, sink_tokens=4, recent_tokens=8)
    rk = default_hadamard(192).float().unsqueeze(0).expand(H, 192, 192)  # per-head [H_kv, 192, 192]
    rv = default_hadamard(128).float()
    cache = build_cache(k, v, rk, rv, cfg)
    gk, gv = (192, 128) if group_size is None else (64, 64)
    assert cache.k_quant.codes.shape == (64, H, 48) and cache.k_quant.pairs.shape == (64, H, 2 * 192 // gk)
    assert cache.v_quant.codes.shape == (64, H, 32) and cache.v_quant.pairs.shape == (64, H, 2 * 128 // gv)
    q = torch.cat([q_nope, q_pe], dim=-1)
    exact = oscar_attention(q, k, v, rk, rv, cfg, quantize=False)
    for mode in ("decode", "extend"):
        out = oscar_attention(q, k, v, rk, rv, cfg, window_mode=mode, cache=cache)
        assert out.shape == (8, H, 128) and torch.isfinite(out).all()
        assert relative_error_db(out, exact) < -5.0  # quantized, but the right function


def test_expanded_refuses_group_128():
    q_nope, q_pe, c, kpe, w_kc, w_vc = _layer()
    k, v = expand_latent(c, kpe, w_kc, w_vc)
    with pytest.raises(ValueError, match="group_size=128 does not divide head_dim=192"):
        oscar_attention(torch.cat([q_nope, q_pe], -1), k, v, torch.eye(192), torch.eye(128), OscarConfig(group_size=128))
