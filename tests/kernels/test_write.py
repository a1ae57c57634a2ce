"""Cache write kernel vs the format's definition (quant.int2).

Bytes must match ``quantize_rows`` exactly: codes bit for bit, pairs equal as numbers (the
kernels use the same fp32 operations, IEEE division and an exact order statistic for the clip).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from _support.orthogonal import random_orthogonal
from kv_fixtures import (
    assert_rows_match,
    fresh_seed,
    poison_,
    random_rows,
)
from sglang_oscar.config import OscarConfig
from sglang_oscar.kernels import (
    Int2Layout,
    rotate_rows_hp,
    write_kv,
)
from sglang_oscar.kernels.write import clip_threshold
from sglang_oscar.quant.int2 import quantize_rows
from sglang_oscar.reference.attention import build_cache
from gpu_sizes import DEV, scaled


def _assert_pairs_equal(got: torch.Tensor, exp: torch.Tensor, what: str):
    assert got.dtype == exp.dtype
    g, e = got.float(), exp.float()
    same = (g == e) | (torch.isnan(g) & torch.isnan(e))
    if not bool(same.all()):
        # allowed: 1 ulp of the storage dtype (never observed; the kernels use identical ops)
        ulp = torch.finfo(exp.dtype).eps * e.abs().clamp_min(torch.finfo(exp.dtype).tiny)
        assert bool(((g - e).abs() <= ulp).all()), f"{what}: {int((~same).sum())} pairs differ"


def _check_slots(buf, layout, rows_k, rows_v, loc, q_kwargs_k, q_kwargs_v):
    ok = loc >= 0
    kq = quantize_rows(rows_k[ok], **q_kwargs_k)
    vq = quantize_rows(rows_v[ok], **q_kwargs_v)
    sl = loc[ok].long()
    assert_rows_match(buf["k_codes"][sl], buf["k_pairs"][sl], kq, "K")
    assert_rows_match(buf["v_codes"][sl], buf["v_pairs"][sl], vq, "V")
    untouched = torch.ones(buf["k_codes"].shape[0], dtype=torch.bool)
    untouched[sl] = False
    for name, t in buf.items():
        assert bool((t[untouched].view(torch.uint8) == 0xAB).all()), f"{name}: a skipped slot was written"


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WRITE_CASES = [
    # dk, dv, group, quantizer, scale dtype, k clip, v clip, hp dtype
    (128, 128, None, "uniform", "float16", 0.96, 0.92, torch.bfloat16),
    (64, 64, 16, "uniform", "float32", 0.96, 0.0, torch.float32),
    (192, 128, None, "lloyd-max", "bfloat16", 0.96, 0.92, torch.bfloat16),
    (256, 256, 128, "lloyd-max", "float16", 0.9, 0.5, torch.float16),
    (128, 128, 32, "uniform", "bfloat16", 1.0, 0.92, torch.bfloat16),
    (512, 512, 256, "uniform", "float32", 0.96, 0.92, torch.bfloat16),
]


@pytest.mark.parametrize("dk,dv,group,quantizer,sdt,kclip,vclip,hp_dtype", WRITE_CASES)
def test_write_matches_quantize_rows(dk, dv, group, quantizer, sdt, kclip, vclip, hp_dtype):
    fresh_seed()
    n, h, num_slots = 7, 3, 23
    layout = Int2Layout.create(dk, dv, group_size=group, k_clip_ratio=kclip, v_clip_ratio=vclip,
                               quantizer=quantizer, scale_dtype=sdt)
    k = random_rows(n, h, dk).to(hp_dtype)
    v = random_rows(n, h, dv).to(hp_dtype)
    buf = layout.allocate(num_slots, h, "cpu")
    for t in buf.values():
        t.view(torch.uint8).fill_(0xAB)
    loc = torch.randperm(num_slots)[:n]
    loc[torch.randint(0, n, (2,))] = -1  # padding entries: skipped
    # fused HP copy: rows at hp_rows (-1 skipped), the rest of the HP buffer untouched
    hp_rows = torch.randperm(11)[:n]
    hp_rows[0] = -1
    hp_k = poison_(torch.empty(11, h, dk, dtype=hp_dtype))
    hp_v = poison_(torch.empty(11, h, dv, dtype=hp_dtype))
    write_kv(k, v, loc.to(torch.int32), buf["k_codes"], buf["k_pairs"], buf["v_codes"], buf["v_pairs"], layout,
             hp_rows=hp_rows, hp_k=hp_k, hp_v=hp_v)
    qk = dict(group_size=group, clip_ratio=kclip, quantizer=quantizer, scale_dtype=sdt)
    qv = dict(group_size=group, clip_ratio=vclip, quantizer=quantizer, scale_dtype=sdt)
    _check_slots(buf, layout, k, v, loc, qk, qv)
    okh = hp_rows >= 0
    assert torch.equal(hp_k[hp_rows[okh]], k[okh]) and torch.equal(hp_v[hp_rows[okh]], v[okh])
    rest = torch.ones(11, dtype=torch.bool)
    rest[hp_rows[okh]] = False
    assert bool(torch.isnan(hp_k[rest].float()).all()) and bool(torch.isnan(hp_v[rest].float()).all())


def test_write_k_only():
    """``v=None`` (K only: one program column, no V programs): K slots and K HP rows get exactly the
    bytes of the K + V call, and the V buffers and V HP rows are not touched."""
    fresh_seed()
    n, h, num_slots, d = 9, 2, 19, 128
    layout = Int2Layout.create(d, d, k_clip_ratio=0.96, v_clip_ratio=0.92)
    k = random_rows(n, h, d).to(torch.bfloat16)
    loc = torch.randperm(num_slots)[:n]
    hp_rows = torch.randperm(13)[:n].to(torch.int32)
    bufs, hps = [], []
    for kv in (True, False):
        buf = layout.allocate(num_slots, h, "cpu")
        for t in buf.values():
            t.view(torch.uint8).fill_(0xAB)
        hp_k = poison_(torch.empty(13, h, d, dtype=torch.bfloat16))
        hp_v = poison_(torch.empty(13, h, d, dtype=torch.bfloat16))
        write_kv(k, k if kv else None, loc, buf["k_codes"], buf["k_pairs"], buf["v_codes"] if kv else None,
                 buf["v_pairs"] if kv else None, layout, hp_rows=hp_rows, hp_k=hp_k, hp_v=hp_v if kv else None)
        bufs.append(buf)
        hps.append((hp_k, hp_v))
    assert torch.equal(bufs[0]["k_codes"], bufs[1]["k_codes"])
    assert torch.equal(bufs[0]["k_pairs"].view(torch.uint8), bufs[1]["k_pairs"].view(torch.uint8))
    for hp_k, _ in hps:
        assert torch.equal(hp_k[hp_rows.long()], k)
    assert bool((bufs[1]["v_codes"] == 0xAB).all()) and bool((bufs[1]["v_pairs"].view(torch.uint8) == 0xAB).all())
    assert bool(torch.isnan(hps[1][1].float()).all())


@triton.jit
def _clip_threshold_probe(X, T, K: tl.constexpr, Q: tl.constexpr, QREAL: tl.constexpr):
    """Rows of 4*Q fp32 values -> write.clip_threshold of each (one row per program) over the lanes
    ``j < QREAL`` of each quarter (the others hold garbage the search must ignore)."""
    row = tl.program_id(0)
    kk = tl.arange(0, 4)
    jj = tl.arange(0, Q)
    x = tl.load(X + row * 4 * Q + kk[:, None] * Q + jj[None, :])[None, :, :]
    lane = (kk[:, None] < 4)[None, :, :] & (jj[None, :] < QREAL)[None, :, :]
    t = clip_threshold(x, lane, 1, K)
    tl.store(T + row + tl.arange(0, 1), t)


def test_clip_threshold_is_the_order_statistic():
    """write.clip_threshold returns the k-th smallest |x| bit for bit on rows that exercise the whole
    31-bit search range: subnormals, +-0.0, ties, normal values from 1e-30 to 1e30, +-inf, the fp32
    maximum, and k from 1 to the row length. (fp32 input: under TRITON_INTERPRET a bf16 -> fp32 load
    of a subnormal comes out wrong in triton 3.6's interpreter, so no bf16 subnormals here.)"""
    fresh_seed()
    q = 16
    d = 4 * q
    rows = [torch.randn(d) * 1e-39, torch.randn(d) * 10.0 ** torch.randint(-30, 31, (d,)).float(),
            torch.round(torch.randn(d) * 2) / 2, torch.randn(d)]
    rows[0][::3] = -0.0
    rows[0][1::5] = 0.0
    rows[1][:3] = torch.tensor([float("inf"), -float("inf"), torch.finfo(torch.float32).max])
    rows[3][:] = torch.randn(1)  # all equal magnitudes
    x = torch.stack(rows).contiguous()
    for k in (1, 2, 17, d // 2, d - 1, d):
        t = torch.empty(x.shape[0])
        _clip_threshold_probe[(x.shape[0],)](x, t, K=k, Q=q, QREAL=q)
        exp = x.abs().sort(dim=1).values[:, k - 1]
        assert torch.equal(t.view(torch.int32), exp.view(torch.int32)), (k, t, exp)
    # masked lanes (head_dim 48 in a 64-lane tile): only the 4 x 12 real elements count
    real = 12
    xm = x.view(-1, 4, q).clone()
    xm[:, :, real:] = torch.tensor([0.0, float("nan"), -float("inf"), 1e-30]).repeat(q - real)[None, None, :(q - real)]
    for k in (1, 5, 4 * real):
        t = torch.empty(x.shape[0])
        _clip_threshold_probe[(x.shape[0],)](xm.reshape(x.shape).contiguous(), t, K=k, Q=q, QREAL=real)
        exp = xm[:, :, :real].reshape(x.shape[0], -1).abs().sort(dim=1).values[:, k - 1]
        assert torch.equal(t.view(torch.int32), exp.view(torch.int32)), (k, t, exp)


def test_write_edge_values():
    """Ties in |x|, exact zeros, constant rows (scale floor), large offsets (|min|/2^15 floor), tiny rows,
    large magnitudes."""
    fresh_seed()
    d, h = 64, 1
    rows = []
    base = torch.randn(d)
    rows.append(torch.round(base * 2) / 2)  # many ties in |x|
    r = base.clone()
    r[: d // 2] = 0.0
    rows.append(r)  # zeros
    rows.append(torch.full((d,), 0.75))  # constant row -> scale floor
    rows.append(torch.randn(d) * 1e-3 + 5000.0)  # large offset vs range
    rows.append(torch.randn(d) * 1e-6)  # tiny values (fp16 scale floor)
    rows.append(-torch.arange(d, dtype=torch.float32))  # all distinct magnitudes
    rows.append(torch.randn(d).sign() * 6e4 * torch.rand(d))  # high exponent bits (scale still fits fp16)
    x = torch.stack(rows).unsqueeze(1).to(torch.bfloat16)
    n = x.shape[0]
    for sdt in ("float16", "bfloat16", "float32"):
        for quantizer in ("uniform", "lloyd-max"):
            for clip in (0.0, 0.96, 0.5):
                layout = Int2Layout.create(d, d, k_clip_ratio=clip, v_clip_ratio=clip, quantizer=quantizer,
                                           scale_dtype=sdt, group_size=32)
                buf = layout.allocate(n, h, "cpu")
                for t in buf.values():
                    t.view(torch.uint8).fill_(0xAB)
                loc = torch.arange(n)
                write_kv(x, x, loc, buf["k_codes"], buf["k_pairs"], buf["v_codes"], buf["v_pairs"], layout)
                q = dict(group_size=32, clip_ratio=clip, quantizer=quantizer, scale_dtype=sdt)
                _check_slots(buf, layout, x, x, loc, q, q)


def test_rotate_and_write_matches_build_cache():
    fresh_seed()
    n, h, dk, dv = 9, 2, 64, 128
    cfg = OscarConfig(group_size=None, k_clip_ratio=0.96, v_clip_ratio=0.92, quantizer="uniform",
                      scale_dtype="float16")
    layout = Int2Layout.from_config(cfg, dk, dv)
    k = random_rows(n, h, dk)
    v = random_rows(n, h, dv)
    rk = random_orthogonal(dk, h)  # per kv head
    rv = random_orthogonal(dv)  # per layer
    cache = build_cache(k, v, rk, rv, cfg, torch.bfloat16)
    buf = layout.allocate(n + 4, h, "cpu")
    for t in buf.values():
        t.view(torch.uint8).fill_(0xAB)
    loc = torch.randperm(n + 4)[:n]
    # the backend's write path: rotate (fp32, rounded to the HP dtype), then quantize + scatter
    k_rot, v_rot = rotate_rows_hp(k, rk, torch.bfloat16), rotate_rows_hp(v, rv, torch.bfloat16)
    write_kv(k_rot, v_rot, loc, buf["k_codes"], buf["k_pairs"], buf["v_codes"], buf["v_pairs"], layout)
    assert torch.equal(k_rot, cache.k_hp) and torch.equal(v_rot, cache.v_hp)
    assert torch.equal(buf["k_codes"][loc], cache.k_quant.codes)
    assert torch.equal(buf["v_codes"][loc], cache.v_quant.codes)
    _assert_pairs_equal(buf["k_pairs"][loc], cache.k_quant.pairs, "K pairs")
    _assert_pairs_equal(buf["v_pairs"][loc], cache.v_quant.pairs, "V pairs")


@pytest.mark.parametrize("quantizer,group,sdt,rpp", [("uniform", None, "float16", None),
                                                     ("lloyd-max", 32, "float32", None),
                                                     ("uniform", None, "bfloat16", 1), ("lloyd-max", 64, "float16", 4)])
def test_write_with_hp_copy(quantizer, group, sdt, rpp):
    """Rows written with the fused HP copy: the copies land at ``hp_rows`` unchanged, the slots get
    ``quantize_rows``' bytes (``rpp``: the rows-per-program knob), other slots stay untouched."""
    fresh_seed()
    n, h, d = 10, 2, 128
    layout = Int2Layout.create(d, d, group_size=group, k_clip_ratio=0.96, v_clip_ratio=0.92,
                               quantizer=quantizer, scale_dtype=sdt)
    k = random_rows(n, h, d).to(torch.bfloat16)
    v = random_rows(n, h, d).to(torch.bfloat16)
    num_slots = 2 * n + 3
    buf = layout.allocate(num_slots, h, "cpu")
    for t in buf.values():
        t.view(torch.uint8).fill_(0xAB)
    hp_k = poison_(torch.empty(n + 2, h, d, dtype=torch.bfloat16))
    hp_v = poison_(torch.empty(n + 2, h, d, dtype=torch.bfloat16))
    hp_rows = torch.randperm(n + 2)[:n]
    direct = torch.arange(n)
    write_kv(k, v, direct, buf["k_codes"], buf["k_pairs"], buf["v_codes"], buf["v_pairs"], layout,
             hp_rows=hp_rows, hp_k=hp_k, hp_v=hp_v, rows_per_program=rpp)
    if rpp is not None:
        kq = quantize_rows(k, group_size=group, clip_ratio=0.96, quantizer=quantizer, scale_dtype=sdt)
        assert_rows_match(buf["k_codes"][direct], buf["k_pairs"][direct], kq, "K")
    assert torch.equal(hp_k[hp_rows], k) and torch.equal(hp_v[hp_rows], v)
    for t in buf.values():
        assert bool((t[n:].view(torch.uint8) == 0xAB).all())


@pytest.mark.parametrize("rpp", [0, 3, 64])
def test_rows_per_program_must_be_a_power_of_two_within_the_tile_budget(rpp):
    layout = Int2Layout.create(64, 64, k_clip_ratio=0.96, v_clip_ratio=0.92)
    buf = layout.allocate(4, 1, "cpu")
    k = torch.randn(2, 1, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="rows_per_program"):
        write_kv(k, k, torch.arange(2), buf["k_codes"], buf["k_pairs"], buf["v_codes"], buf["v_pairs"], layout,
                 rows_per_program=rpp)


def test_rows_per_program_default_policy(monkeypatch):
    """GPU: full ~2K-element tiles (16 rows at head_dim 128, one group) for prefill-sized writes;
    with ``min_programs`` fewer rows until the grid has that many programs (decode-sized writes);
    the interpreter keeps its ~8K-element tiles."""
    from sglang_oscar.kernels import write as write_mod

    layout = Int2Layout.create(128, 128, k_clip_ratio=0.96, v_clip_ratio=0.92)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rpp = write_mod._rows_per_program
    assert rpp(layout, 8192 * 8, min_programs=256) == 16  # prefill chunk: tile budget
    assert rpp(layout, 32 * 8, min_programs=256) == 1  # decode, batch 32 x 8 kv heads
    assert rpp(layout, 64 * 8, min_programs=256) == 2
    assert rpp(layout, 2048, min_programs=256) == 8
    assert rpp(layout, 3, min_programs=256) == 1
    assert rpp(layout, 32 * 8, min_programs=1) == 16
    assert rpp(layout, 3, min_programs=1) == 4
    assert rpp(layout, 32 * 8) == 1  # shipped default: the small-grid policy with WRITE_MIN_PROGRAMS 256
    assert rpp(layout, 8192 * 8) == 16
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert rpp(layout, 32 * 8) == 64
    assert rpp(layout, 5) == 8


# ------------------------------ GPU cases (real sizes, `-m gpu`; sizes and dry run: gpu_sizes.py)


@pytest.mark.gpu
@pytest.mark.parametrize("dk,dv,group,quantizer,sdt", [
    (128, 128, None, "uniform", "float16"),
    (192, 128, None, "lloyd-max", "bfloat16"),
    (256, 256, 128, "lloyd-max", "float32"),
    (512, 512, None, "uniform", "float16"),
    (64, 64, 16, "uniform", "float32"),
])
def test_gpu_write_bytes(dk, dv, group, quantizer, sdt):
    _write_bytes(dk, dv, group, quantizer, sdt, scaled(8192))


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["planes", "rows-head-major", "rows-slot-major"])
def test_gpu_write_into_served_rows(storage):
    """write_kv into the served pool's head-major code / pair planes and into the
    earlier 36-byte row views (pool/rows.py; head- and slot-major) store the bytes they store into
    contiguous code / pair tensors, and touch no other row."""
    from sglang_oscar.pool.rows import int2_row_views, kv_head_major_zeros

    fresh_seed()
    n, h, slots = scaled(4096), 8, scaled(4096) * 2 + 7
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
