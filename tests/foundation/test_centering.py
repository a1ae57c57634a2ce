"""Key / value centering (RotationSet.k_mean / v_mean): exact without quantization, smaller INT2
error when the rows carry a static offset, file round trip, TP slicing and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_oscar.config import OscarConfig
from sglang_oscar.reference import oscar_attention, plain_attention, relative_error_db
from sglang_oscar.rotation import RotationError, RotationSet, default_hadamard


def _offset_qkv(t=384, hq=8, hkv=2, d=64, seed=0, k_off=6.0, v_off=4.0):
    """Random rows plus a large static per-(kv head, channel) offset in K and V (seeded)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    mk = k_off * torch.randn(hkv, d, generator=g)
    mv = v_off * torch.randn(hkv, d, generator=g)
    return q, k + mk, v + mv, mk, mv


def test_centering_is_exact_without_quantization():
    q, k, v, mk, mv = _offset_qkv(seed=1)
    h = default_hadamard(64).float()
    cfg = OscarConfig()
    want = plain_attention(q[-40:], k, v)
    # means that are not the rows' true means must still give exact attention: the key mean only
    # shifts each query's scores by a constant, the value mean is added back to the output
    fake_k, fake_v = 0.5 * mk + 1.0, -mv
    for km, vm in ((mk, mv), (fake_k, fake_v), (mk, None), (None, mv)):
        for counter_rotate in (True, False):
            got = oscar_attention(q[-40:], k, v, h, h, cfg, quantize=False, hp_dtype=torch.float32, k_mean=km,
                                  v_mean=vm, counter_rotate=counter_rotate)
            if not counter_rotate:
                got = torch.einsum("thd,ed->the", got, h)  # o R^T back to the model frame
            rel = float((got - want).norm() / want.norm())
            assert rel < 1e-5, (km is None, vm is None, counter_rotate, rel)


def test_centering_removes_a_static_offset_from_the_int2_error():
    """With a static offset 6x (K) / 4x (V) the rows' spread, the uncentred INT2 step is set by the
    offset; subtracting the true means brings the error down to that of the offset-free rows."""
    q, k, v, mk, mv = _offset_qkv(seed=2)
    h = default_hadamard(64).float()
    cfg = OscarConfig(sink_tokens=0, recent_tokens=0)
    want = plain_attention(q, k, v, q_positions=torch.arange(k.shape[0]))
    pos = torch.arange(k.shape[0])
    out_plain = oscar_attention(q, k, v, h, h, cfg, q_positions=pos)
    out_centred = oscar_attention(q, k, v, h, h, cfg, q_positions=pos, k_mean=mk, v_mean=mv)
    plain, centred = relative_error_db(out_plain, want), relative_error_db(out_centred, want)
    assert centred < plain - 6.0, (plain, centred)
    # the centred cache holds exactly the offset-free rows: its absolute error is theirs
    want0 = plain_attention(q, k - mk, v - mv, q_positions=pos)
    out0 = oscar_attention(q, k - mk, v - mv, h, h, cfg, q_positions=pos)
    e_centred, e0 = float((out_centred - want).norm()), float((out0 - want0).norm())
    assert abs(e_centred / e0 - 1) < 0.02, (e_centred, e0)


def test_key_centering_with_logit_cap_is_refused():
    q, k, v, mk, mv = _offset_qkv(t=32, seed=3)
    h = default_hadamard(64).float()
    with pytest.raises(ValueError, match="logit cap"):
        oscar_attention(q, k, v, h, h, OscarConfig(), logit_cap=30.0, k_mean=mk)
    # value centering alone commutes with any score function
    got = oscar_attention(q[-4:], k, v, h, h, OscarConfig(), logit_cap=5.0, v_mean=mv, quantize=False,
                          hp_dtype=torch.float32)
    want = plain_attention(q[-4:], k, v, logit_cap=5.0)
    assert float((got - want).norm() / want.norm()) < 1e-5
    with pytest.raises(ValueError, match="does not match"):
        oscar_attention(q, k, v, h, h, OscarConfig(), k_mean=mk[:, :32])


def _set(per_head: bool, hkv=2, d=16, layers=(0, 3)):
    g = torch.Generator().manual_seed(5)
    h = default_hadamard(d).float()
    r = h.expand(hkv, d, d).clone() if per_head else h
    k = {i: r.clone() for i in layers}
    v = {i: r.clone() for i in layers}
    km = {i: torch.randn(hkv, d, generator=g) for i in layers}
    vm = {i: torch.randn(hkv, d, generator=g) for i in layers}
    return RotationSet(k, v, {"method": "test"}, k_mean=km, v_mean=vm)


@pytest.mark.parametrize("per_head", [False, True])
def test_means_round_trip_and_tp_slicing(per_head, tmp_path):
    rs = _set(per_head, hkv=4)
    path = str(tmp_path / "r.safetensors")
    rs.save(path)
    back = RotationSet.load(path)
    assert back.centered and back.per_head == per_head
    for lid in rs.layer_ids:
        for which in ("k", "v"):
            torch.testing.assert_close(back.mean(lid, which), rs.mean(lid, which), rtol=0, atol=0)
    # rank 1 of 2 owns kv heads 2 and 3 (SGLang's sharding); a per-layer rotation stays whole
    part = back.for_tp_rank(1, 2, 4)
    for lid in rs.layer_ids:
        torch.testing.assert_close(part.mean(lid, "k"), rs.mean(lid, "k")[2:4], rtol=0, atol=0)
        torch.testing.assert_close(part.mean(lid, "v"), rs.mean(lid, "v")[2:4], rtol=0, atol=0)
        assert part.matrices(lid, "k").shape == ((2, 16, 16) if per_head else (16, 16))
    # 1 kv head replicated over 2 ranks: both ranks get head 0
    one = _set(per_head, hkv=1)
    for rank in (0, 1):
        torch.testing.assert_close(one.for_tp_rank(rank, 2, 1).mean(0, "v"), one.mean(0, "v"), rtol=0, atol=0)
    plain = RotationSet({0: default_hadamard(16).float()}, {0: default_hadamard(16).float()})
    assert not plain.centered and plain.mean(0, "k") is None


def test_bad_means_are_refused():
    h = default_hadamard(16).float()
    base = dict(k={0: h, 1: h}, v={0: h, 1: h})
    with pytest.raises(RotationError, match="every layer or to none"):
        RotationSet(**base, k_mean={0: torch.zeros(2, 16)})
    with pytest.raises(RotationError, match=r"must be \[H_kv, 16\]"):
        RotationSet(**base, v_mean={0: torch.zeros(16), 1: torch.zeros(16)})
    with pytest.raises(RotationError, match="per-head K rotations"):
        RotationSet(k={0: h.expand(2, 16, 16)}, v={0: h.expand(2, 16, 16)}, k_mean={0: torch.zeros(3, 16)})
    bad = RotationSet(**base, k_mean={0: torch.zeros(2, 16), 1: torch.full((2, 16), math.nan)})
    with pytest.raises(RotationError, match="layer 1 K mean contains NaN"):
        bad.check_matrices()
