import math

import pytest
import torch

from sglang_oscar.quant import (
    LLOYD_MAX_CODEBOOK,
    fake_quantize,
    bits_per_element,
    bytes_per_token_per_head,
    clip_index,
    clip_rows,
    dequantize_rows,
    gaussian_lloyd_max,
    quant_bits_per_element,
    quantize_rows,
    unpack_quarter,
)

HEAD_DIMS = [64, 128, 192, 256, 512]


def _rows(d, n=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, d, generator=gen) * torch.rand(n, 2, 1, generator=gen) * 4
    x[..., 3] += 7.0  # an outlier channel
    return x


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("groups", [1, 2])
def test_uniform_dequant_within_half_step_fp32(d, groups):
    x = _rows(d, seed=d + groups)
    g = d // groups
    qr = quantize_rows(x, group_size=g, clip_ratio=0.0, scale_dtype="float32")
    xh = dequantize_rows(qr)
    step = qr.scales().repeat_interleave(g, dim=-1)
    err = (xh - x).abs()
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-6).all()), float((err / step).max())
    # codes use all four levels somewhere and scale = range / 3 for fp32
    grouped = x.reshape(*x.shape[:-1], groups, g)
    rng = grouped.amax(-1) - grouped.amin(-1)
    torch.testing.assert_close(qr.scales(), rng / 3, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
def test_uniform_low_precision_pairs_stay_near_half_step(scale_dtype):
    x = _rows(128, seed=3)
    qr = quantize_rows(x, group_size=64, scale_dtype=scale_dtype)
    assert qr.pairs.dtype == getattr(torch, scale_dtype)
    xh = dequantize_rows(qr)
    s = qr.scales().repeat_interleave(64, dim=-1)
    z = qr.zeros().repeat_interleave(64, dim=-1)
    eps = torch.finfo(getattr(torch, scale_dtype)).eps
    # codes are computed from the stored pair: only the two extreme levels can exceed half a
    # step, by the rounding of the stored scale and zero.
    bound = s / 2 + s * eps * (z.abs() + 3) + 1e-6
    assert bool(((xh - x).abs() <= bound).all())


@pytest.mark.parametrize("d", [64, 128, 192])
def test_clip_rule_is_order_statistic(d):
    x = _rows(d, seed=11)
    for ratio in (0.5, 0.92, 0.96, 1.0):
        idx = clip_index(d, ratio)
        assert idx == min(math.floor(ratio * d), d - 1)
        clipped = clip_rows(x, ratio)
        t = torch.sort(x.abs(), dim=-1).values[..., idx : idx + 1]
        assert torch.equal(clipped, x.clamp(-t, t))
        # exactly the elements with |x| > t change; at most d - 1 - idx of them per row
        changed = (clipped != x).sum(-1)
        assert int(changed.max()) <= d - 1 - idx
    assert clip_index(128, 0.96) == 122 and clip_index(128, 0.92) == 117
    assert torch.equal(clip_rows(x, 0.0), x)


def test_clipped_rows_only_clipped_elements_exceed_half_step():
    x = _rows(128, seed=5)
    qr = quantize_rows(x, clip_ratio=0.96, scale_dtype="float32")
    xc = clip_rows(x, 0.96)
    err = (dequantize_rows(qr) - xc).abs()
    assert bool((err <= qr.scales() / 2 * (1 + 1e-5) + 1e-6).all())


def test_lloyd_max_constants_match_known_optimum():
    levels, thresholds, mse = gaussian_lloyd_max(4)
    # Max (1960): levels +-0.4528, +-1.5104, thresholds 0, +-0.9816, MSE 0.1175. The tolerance
    # (1e-4) separates the true optimum from the original's approximation (1.50956 / 0.98107).
    for got, want in zip(levels, (-1.5104, -0.4528, 0.4528, 1.5104)):
        assert abs(got - want) < 1e-4
    for got, want in zip(thresholds, (-0.9816, 0.0, 0.9816)):
        assert abs(got - want) < 1e-4
    assert abs(mse - 0.1175) < 1e-4
    # Lloyd's conditions hold at the fixed point: thresholds are midpoints
    for k in range(3):
        assert abs(thresholds[k] - 0.5 * (levels[k] + levels[k + 1])) < 1e-12
    assert LLOYD_MAX_CODEBOOK.levels[3] == pytest.approx(levels[3], abs=1e-7)


def test_lloyd_max_mse_on_unit_gaussian_data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 512, generator=gen)
    qr = quantize_rows(x, clip_ratio=0.0, quantizer="lloyd-max", scale_dtype="float32")
    mse = float((dequantize_rows(qr) - x).pow(2).mean())
    assert abs(mse - 0.1175) / 0.1175 < 0.02, mse
    # and Lloyd-Max beats uniform min/max on Gaussian data
    mse_u = float((dequantize_rows(quantize_rows(x, clip_ratio=0.0, scale_dtype="float32")) - x).pow(2).mean())
    assert mse < mse_u


def test_lloyd_max_reconstruction_levels():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 1, 128, generator=gen) * 3 + 2
    qr = quantize_rows(x, quantizer="lloyd-max", scale_dtype="float32")
    xh = dequantize_rows(qr)
    mean = x.double().mean(-1, keepdim=True)
    std = torch.sqrt(x.double().var(-1, unbiased=False, keepdim=True) + 1e-8)
    lv = torch.tensor(LLOYD_MAX_CODEBOOK.levels, dtype=torch.float64)
    want = mean + std * lv[unpack_quarter(qr.codes).long()]
    torch.testing.assert_close(xh.double(), want, rtol=1e-5, atol=1e-5)


def test_nearly_constant_groups_stay_finite_in_fp16():
    x = torch.full((4, 1, 64), 100.0)
    x[..., 0] += 1e-4
    for q in ("uniform", "lloyd-max"):
        qr = quantize_rows(x, quantizer=q, scale_dtype="float16")
        assert torch.isfinite(qr.pairs.float()).all()
        assert float((dequantize_rows(qr) - x).abs().max()) < 0.01


def test_bits_per_element_known_values():
    # the original's accounting (windows replace INT2), spec §1.8: 2.284 at 128K, 2.38 at 32K
    assert bits_per_element(128, 128, "float16", 131072, hp_also_quantized=False) == pytest.approx(2.2836, abs=1e-4)
    assert bits_per_element(128, 128, "float16", 32768, hp_also_quantized=False) == pytest.approx(2.3843, abs=1e-4)
    # this cache stores window tokens in INT2 too: 2.25 + 320 * 16 / L
    assert bits_per_element(128, 128, "float16", 131072) == pytest.approx(2.25 + 320 * 16 / 131072)
    assert bits_per_element(128, 128, "float16", 131072) == pytest.approx(2.2891, abs=1e-4)
    assert quant_bits_per_element(128, 128, "float32") == 2.5
    assert quant_bits_per_element(256, 128, "float16") == 2.25
    assert bits_per_element(128, None, "float16", 100, hp_also_quantized=False) == 16.0  # all inside the windows
    assert bits_per_element(128, None, "float16", 100) == 18.25
    # bytes per token per kv head: K+V codes 2*32 + pairs 2*2*2
    assert bytes_per_token_per_head(128, 128, 128, "float16") == 72


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(group_size=48), "does not divide"),
        (dict(group_size=0), "does not divide"),
        (dict(clip_ratio=1.5), r"\[0, 1\]"),
        (dict(clip_ratio=-0.1), r"\[0, 1\]"),
        (dict(quantizer="nf2"), "quantizer"),
        (dict(scale_dtype="float8"), "scale dtype"),
    ],
)
def test_quantize_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize_rows(torch.randn(2, 128), **kwargs)


def test_quantize_rejects_bad_rows():
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize_rows(torch.randn(2, 130))
    with pytest.raises(ValueError, match="float"):
        quantize_rows(torch.ones(2, 128, dtype=torch.int32))
    x = torch.randn(2, 128)
    x[1, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_rows(x)
    x[1, 5] = float("inf")  # clipping must not hide it
    with pytest.raises(ValueError, match="Inf"):
        quantize_rows(x, clip_ratio=0.96)
    with pytest.raises(ValueError, match="overflows"):
        quantize_rows(torch.randn(2, 128) * 1e6, scale_dtype="float16")
    assert torch.isfinite(quantize_rows(torch.randn(2, 128) * 1e6, scale_dtype="float32").pairs).all()
    with pytest.raises(ValueError, match="number"):
        quantize_rows(torch.randn(2, 128), clip_ratio=None)
    with pytest.raises(ValueError):
        bits_per_element(128, 128, "float16", 0)


def test_fake_quantize_is_quantize_then_dequantize():
    x = _rows(64, seed=21).to(torch.bfloat16)
    kw = dict(group_size=32, clip_ratio=0.92, quantizer="lloyd-max", scale_dtype="float16")
    got = fake_quantize(x, **kw)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, dequantize_rows(quantize_rows(x, **kw)).to(torch.bfloat16))


def test_dominant_direction_on_hadamard_row0():
    """A rotation ``U H`` whose first column of ``U`` is a row's dominant direction turns that
    component into a per-row constant (the Hadamard's all-ones row 0), which the zero point absorbs:
    exactly without clipping, nearly with the symmetric clip; on the last row (a +-1 pattern) it
    widens the range (docs/quality.md, run 5). Figures quoted there."""
    from sglang_oscar.quant.int2 import fake_quantize
    from sglang_oscar.rotation.hadamard import default_hadamard

    torch.manual_seed(0)
    d = 128
    u, _ = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))
    h = default_hadamard(d)
    rest = torch.randn(1000, d, dtype=torch.float64)
    rest = rest - (rest @ u[:, :1]) @ u[:, :1].T
    rots = {"desc": u @ h, "asc": torch.cat([u[:, 1:], u[:, :1]], 1) @ h}

    def err(order, a, clip):
        y = (rest + a * u[:, 0]) @ rots[order]
        yh = fake_quantize(y.float(), quantizer="uniform", clip_ratio=clip, scale_dtype="float32")
        return float(((yh.double() - y) ** 2).sum() / (rest ** 2).sum())

    no_clip = [err("desc", a, 0.0) for a in (0.0, 5.0, 20.0)]
    assert no_clip[1] == pytest.approx(no_clip[0], rel=1e-5) and no_clip[2] == pytest.approx(no_clip[0], rel=1e-5)
    assert no_clip[0] == pytest.approx(0.2506, abs=5e-4)
    desc = [err("desc", a, 0.96) for a in (0.0, 5.0, 20.0)]
    asc = [err("asc", a, 0.96) for a in (0.0, 5.0, 20.0)]
    assert desc == pytest.approx([0.1567, 0.1724, 0.1783], abs=5e-4)
    assert asc == pytest.approx([0.1569, 0.1863, 0.4527], abs=5e-4)
    assert err("asc", 20.0, 0.0) > 2 * no_clip[0]
