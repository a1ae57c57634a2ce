"""kernels.rotate.rotate_heads vs the fp32 einsum (rotate_heads_reference, the backend's PyTorch path)."""

from __future__ import annotations

import pytest
import torch
from _support.orthogonal import random_orthogonal
from kv_fixtures import fresh_seed, poison_
from sglang_oscar.kernels.rotate import (MIN_PROGRAMS, auto_block_k, auto_block_n, rotate_heads, rotate_heads_reference,
                                        rotate_qkv)
from gpu_sizes import DEV, scaled

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CASES = [
    # tokens, heads, rotation matrices, head_dim, input dtype, transpose, sub_mean, add_mean
    (5, 8, 2, 128, torch.bfloat16, False, True, False),  # GQA 4 keys-as-queries, centred
    (3, 6, 1, 64, torch.float32, True, False, True),  # output counter-rotation + value mean
    (40, 4, 4, 192, torch.float16, False, False, False),  # one matrix per head, D not a power of 2
    (2, 12, 2, 512, torch.bfloat16, True, False, False),  # GQA 6, head_dim 512
    (300, 2, 2, 128, torch.bfloat16, False, True, False),  # > 256 rows: 64-row programs
    (4, 12, 4, 128, torch.float32, True, True, True),  # GQA 3, both means, per-matrix mean rows
    (150, 4, 2, 256, torch.bfloat16, False, False, True),  # > 256 rows at head_dim 256: 16-row programs
]


def check_rotation(t, h, hr, d, in_dtype, transpose, sub, add, device="cpu", block_n=None, block_k="auto",
                   precision="ieee"):
    fresh_seed()
    x = (torch.randn(t, h, d, device=device) * 3).to(in_dtype)
    r = random_orthogonal(d, hr).to(device)
    mi = torch.randn(hr, d, device=device) if sub else None
    mo = torch.randn(hr, d, device=device) if add else None
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = poison_(torch.empty(t, h, d, dtype=out_dtype, device=device))
        got = rotate_heads(x, r, out_dtype, transpose=transpose, sub_mean=mi, add_mean=mo, out=out, block_n=block_n,
                           block_k=block_k, precision=precision)
        assert got is out
        exp = rotate_heads_reference(x, r, torch.float32, transpose=transpose, sub_mean=mi, add_mean=mo)
        assert_same_rotation(got, exp)


def assert_same_rotation(got: torch.Tensor, exact: torch.Tensor) -> None:
    """``got`` (fp32, bf16 or fp16) is the kernel's fp32 product ``exact`` (the fp32 einsum) up to
    the summation order, rounded once to ``got.dtype``.

    The kernel's fp32 value lies within ``b = 1e-5 max|exact|`` of the einsum (the fp32 check), and
    round-to-nearest is monotonic, so a rounded output must lie in ``[rnd(exact - b), rnd(exact + b)]``:
    a deterministic bound, where counting one-ulp differences depends on the seed.
    """
    assert exact.dtype == torch.float32 and got.shape == exact.shape
    assert bool(torch.isfinite(exact).all())  # a NaN bound would make every comparison below False
    assert bool(torch.isfinite(got).all()), "an output element was not written"
    b = 1e-5 * float(exact.abs().max())
    if got.dtype == torch.float32:
        assert float((got - exact).abs().max()) <= b
    else:
        lo, hi = (exact - b).to(got.dtype), (exact + b).to(got.dtype)
        bad = (got < lo) | (got > hi)
        assert not bool(bad.any()), (int(bad.sum()), got.numel(), float((got.float() - exact).abs().max()))


@pytest.mark.parametrize("t,h,hr,d,in_dtype,transpose,sub,add", CASES)
def test_rotate_heads_matches_einsum(t, h, hr, d, in_dtype, transpose, sub, add):
    check_rotation(t, h, hr, d, in_dtype, transpose, sub, add)


@pytest.mark.parametrize("case,block_n", [
    (CASES[0], 16),  # 8 slices of 16 output dims
    (CASES[1], 32),
    (CASES[2], 128),  # head_dim 192: the second 128-wide slice is half masked
    (CASES[3], 64),  # head_dim 512
    (CASES[5], 1024),  # wider than head_dim: one slice, as None
    (CASES[0], "auto"),  # the backend's choice (auto_block_n)
])
def test_rotate_heads_output_slices(case, block_n):
    """block_n splits the output dims over programs: the same values as the einsum (and as one slice)."""
    check_rotation(*case, block_n=block_n)


# head_dim 256 with few rows: the step width, not the row blocking, is under test (interpreter time)
STEP_256 = (6, 4, 2, 256, torch.bfloat16, False, False, True)


@pytest.mark.parametrize("case,block_n,block_k", [
    (STEP_256, 16, "auto"),  # head_dim 256 in 16-wide slices: the whole input row in one step
    (STEP_256, 16, 64),  # four steps
    (CASES[3], 64, "auto"),  # head_dim 512: 64-wide steps
    (CASES[2], 32, "auto"),  # head_dim 192: two 128-wide steps, the second half masked
    (CASES[0], None, 128),  # whole rows with a wide step
])
def test_rotate_heads_input_steps(case, block_n, block_k):
    """block_k sets the input dims per loop step: the same values as the einsum for every step width."""
    check_rotation(*case, block_n=block_n, block_k=block_k)


def test_auto_block_k_known_answers():
    """Sliced programs take 4096 / block_n input dims per step (up to the padded head_dim); whole
    rows keep the narrow steps the register budget allows."""
    assert auto_block_k(256, 16) == 256 and auto_block_k(256, 32) == 128 and auto_block_k(256, 64) == 64
    assert auto_block_k(128, 16) == 128 and auto_block_k(128, 64) == 64
    assert auto_block_k(512, 64) == 64 and auto_block_k(192, 32) == 128
    assert auto_block_k(256, 256) == 16 and auto_block_k(128, 128) == 32  # whole rows


QKV_CASES = [
    # tokens, q heads, kv heads, D_k, D_v, input dtype, K mean, V mean, block_n
    (3, 8, 2, 128, 128, torch.bfloat16, True, True, None),  # a decode step, GQA 4, centred
    (5, 6, 2, 64, 64, torch.float16, True, False, 16),  # GQA 3, 4 output slices
    (130, 4, 2, 128, 128, torch.bfloat16, False, False, None),  # 260 q rows: 64-row programs, idle K/V ones
    (4, 8, 4, 192, 128, torch.bfloat16, False, True, None),  # D_k != D_v: per-product widths
    (4, 8, 4, 192, 128, torch.float32, True, True, 64),  # ... split: K 4 slices (one masked), V 2
    (2, 12, 2, 512, 512, torch.bfloat16, False, False, 64),
    (1, 8, 2, 128, 128, torch.bfloat16, True, True, "auto"),  # the backend's call at batch 1
    (1, 4, 2, 256, 256, torch.bfloat16, True, True, "auto"),  # Gemma-4 sliding at batch 1: one 256-wide step
]


def test_default_block_n_is_auto(monkeypatch):
    """rotate_heads / rotate_qkv without block_n launch auto_block_n's slices: at a Qwen3-8B decode step
    (batch 1) 16 output dims per program, whole rows at prefill (the grid's last axis counts slices)."""
    from sglang_oscar.kernels import rotate as rot

    grids = []
    monkeypatch.setattr(rot, "_launch", lambda kernel, grid, *a, **kw: grids.append((grid, kw)))
    rk = torch.zeros(8, 128, 128)
    for t, want_bn, want_ns in ((1, 16, 8), (512, 128, 1)):
        grids.clear()
        x = torch.zeros(t, 32, 128, dtype=torch.bfloat16)
        kv = torch.zeros(t, 8, 128, dtype=torch.bfloat16)
        rot.rotate_heads(x, rk, torch.float32)
        rot.rotate_qkv(x, kv, kv, rk, rk, torch.bfloat16)
        (g1, kw1), (g2, kw2) = grids
        assert kw1["BLOCK_N"] == want_bn and g1[2] == want_ns
        assert kw2["BN_K"] == kw2["BN_V"] == want_bn and g2[2] == 3 * want_ns


def test_auto_block_n_known_answers():
    """auto_block_n: whole rows from 2 * MIN_PROGRAMS programs, else the widest of 64 / 32 / 16 with
    >= MIN_PROGRAMS programs, on the geometry measured
    on the H200 (Qwen3-8B layer: 32 q / 8 kv heads, head_dim 128; docs/benchmarks.md)."""
    assert MIN_PROGRAMS == 128
    # batch 1, q/K/V in one launch: 1 row block x 8 heads x 3 products = 24 -> 48 / 96 / 192 programs
    assert auto_block_n(1 * 4, 8, 128, products=3) == 16
    # batch 1, the output: 8 programs per slice count -> 16 (64 programs, the most it can reach)
    assert auto_block_n(1 * 4, 8, 128) == 16
    # batch 32: 128 q rows = 8 row blocks of 16 -> 8 x 8 x 3 x 2 = 384 at 64
    assert auto_block_n(32 * 4, 8, 128, products=3) == 64
    assert auto_block_n(32 * 4, 8, 128) == 64  # 8 x 8 x 2 = 128, just enough
    assert auto_block_n(16 * 4, 8, 128) == 32  # 4 x 8 x 4 = 128 at 32, 64 at 64
    # prefill: whole rows once they give >= 2 * MIN_PROGRAMS programs
    assert auto_block_n(8192 * 4, 8, 128, products=3) is None  # 512 x 8 x 3 row blocks
    assert auto_block_n(512 * 4, 8, 128, products=3) is None  # 32 x 8 x 3 = 768
    assert auto_block_n(512 * 4, 8, 128) is None  # 32 x 8 = 256, just enough
    assert auto_block_n(256 * 4, 8, 128) == 64  # 16 x 8 = 128 whole rows: split
    # head_dim 64 with one kv head: 1 x 1 x 4 slices of 16 -> 16
    assert auto_block_n(2, 1, 64) == 16


def check_rotate_qkv(t, hq, hkv, dk, dv, in_dtype, has_mk, has_mv, block_n, device="cpu", block_k="auto",
                     precision="ieee"):
    fresh_seed()
    q = (torch.randn(t, hq, dk, device=device) * 3).to(in_dtype)
    k = (torch.randn(t, hkv, dk, device=device) * 3).to(in_dtype)
    v = (torch.randn(t, hkv, dv, device=device) * 3).to(in_dtype)
    rk, rv = random_orthogonal(dk, hkv).to(device), random_orthogonal(dv, hkv).to(device)
    mk = torch.randn(hkv, dk, device=device) if has_mk else None
    mv = torch.randn(hkv, dv, device=device) if has_mv else None
    for kv_dtype in (torch.bfloat16, torch.float16):
        out = (poison_(torch.empty(t, hq, dk, device=device)), poison_(torch.empty(t, hkv, dk, dtype=kv_dtype, device=device)),
               poison_(torch.empty(t, hkv, dv, dtype=kv_dtype, device=device)))
        qr, kr, vr = rotate_qkv(q, k, v, rk, rv, kv_dtype, mean_k=mk, mean_v=mv, block_n=block_n, out=out,
                                block_k=block_k, precision=precision)
        assert qr is out[0] and kr is out[1] and vr is out[2]
        assert_same_rotation(qr, rotate_heads_reference(q, rk, torch.float32))
        assert_same_rotation(kr, rotate_heads_reference(k, rk, torch.float32, sub_mean=mk))
        assert_same_rotation(vr, rotate_heads_reference(v, rv, torch.float32, sub_mean=mv))


@pytest.mark.parametrize("case", QKV_CASES)
def test_rotate_qkv_matches_einsum(case):
    """rotate_qkv: q R_k (fp32), (k - mu_k) R_k and (v - mu_v) R_v (bf16 / fp16) in one launch, each
    equal to the einsum up to the summation order."""
    check_rotate_qkv(*case)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3], CASES[4]])
def test_rotate_heads_tf32x3_launch_shape(case):
    """precision="tf32x3" launches (one shape per head_dim, block_n / block_k ignored) cover every row
    and output dim: the interpreter computes its dots in fp32, so this checks the indexing (the
    accuracy of the TF32 MMAs is a GPU test)."""
    check_rotation(*case, block_n=16, block_k=16, precision="tf32x3")


@pytest.mark.parametrize("case", [(5, 8, 2, 128, 128, torch.bfloat16, True, False, 16),
                                  (3, 6, 3, 192, 128, torch.float16, False, True, None)])
def test_rotate_qkv_tf32x3_launch_shape(case):
    check_rotate_qkv(*case, precision="tf32x3")


def test_tf32x3_launch_shape_does_not_follow_the_row_count(monkeypatch):
    """precision="tf32x3" launches the same program shape (rows, dims, input step, warps, output-dim
    programs) for 1 and 3000 tokens, rotate_heads and rotate_qkv (D_k != D_v too): the shape a row's
    bits depend on never follows the chunk; IEEE launches do follow it (auto_block_n)."""
    from sglang_oscar.kernels import rotate as rotate_mod

    seen = []
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BN_K", "BN_V", "BK_K", "BK_V", "num_warps")
    monkeypatch.setattr(rotate_mod, "_launch", lambda kernel, grid, *a, **k: seen.append(
        (grid[1:], tuple(k.get(n) for n in keys))))
    rk, rv = random_orthogonal(192, 2), random_orthogonal(128, 2)
    for precision in ("tf32x3", "ieee"):
        seen.clear()
        for t in (1, 3000):
            rotate_heads(torch.randn(t, 8, 192), rk, torch.bfloat16, precision=precision)
            rotate_qkv(torch.randn(t, 8, 192), torch.randn(t, 2, 192), torch.randn(t, 2, 128), rk, rv, torch.bfloat16,
                       precision=precision)
        assert (seen[:2] == seen[2:]) == (precision == "tf32x3"), (precision, seen)


@pytest.mark.parametrize("has_mk", [False, True])
def test_rotate_qkv_without_v_rotates_q_and_k(has_mk):
    """v=None (layers whose value rotation is folded into the weights): q and K only, in a launch of
    two products; the results equal the three-product launch's q and K (same block body, block_n
    given) and the einsum; out's third entry and rotation_v are ignored."""
    fresh_seed()
    q, k, v = (torch.randn(5, 8, 64) * 3).bfloat16(), (torch.randn(5, 2, 64) * 3).bfloat16(), torch.randn(5, 2, 64)
    rk, rv = random_orthogonal(64, 2), random_orthogonal(64, 2)
    mk = torch.randn(2, 64) if has_mk else None
    qr, kr, vr = rotate_qkv(q, k, None, rk, None, torch.bfloat16, mean_k=mk, block_n=32)
    assert vr is None
    q3, k3, _ = rotate_qkv(q, k, v, rk, rv, torch.bfloat16, mean_k=mk, block_n=32)
    assert torch.equal(qr, q3) and torch.equal(kr, k3)
    assert_same_rotation(qr, rotate_heads_reference(q, rk, torch.float32))
    assert_same_rotation(kr, rotate_heads_reference(k, rk, torch.float32, sub_mean=mk))
    out = (poison_(torch.empty(5, 8, 64)), poison_(torch.empty(5, 2, 64, dtype=torch.bfloat16)), None)
    qo, ko, vo = rotate_qkv(q, k, None, rk, rv, torch.bfloat16, mean_k=mk, out=out)  # block_n "auto"
    assert qo is out[0] and ko is out[1] and vo is None
    assert_same_rotation(ko, rotate_heads_reference(k, rk, torch.float32, sub_mean=mk))
    assert [x is None or x.shape for x in rotate_qkv(q[:0], k[:0], None, rk, None, torch.bfloat16)] == \
        [(0, 8, 64), (0, 2, 64), True]
    with pytest.raises(ValueError, match="tokens"):
        rotate_qkv(q, k[:3], None, rk, None, torch.bfloat16)


def test_rotate_qkv_fused_qkv_views_empty_and_bad_input():
    """Views into one fused QKV output (SGLang's layout), zero tokens, and the argument checks."""
    fresh_seed()
    qkv = torch.randn(6, (8 + 2 + 2) * 64).to(torch.bfloat16)
    q = qkv[:, : 8 * 64].reshape(-1, 8, 64)
    k = qkv[:, 8 * 64: 10 * 64].reshape(-1, 2, 64)
    v = qkv[:, 10 * 64:].reshape(-1, 2, 64)
    rk, rv = random_orthogonal(64, 2), random_orthogonal(64, 2)
    qr, kr, vr = rotate_qkv(q, k, v, rk, rv, torch.bfloat16)
    assert_same_rotation(qr, rotate_heads_reference(q, rk, torch.float32))
    assert_same_rotation(kr, rotate_heads_reference(k, rk, torch.float32))
    assert_same_rotation(vr, rotate_heads_reference(v, rv, torch.float32))
    assert [x.shape for x in rotate_qkv(q[:0], k[:0], v[:0], rk, rv, torch.bfloat16)] == \
        [(0, 8, 64), (0, 2, 64), (0, 2, 64)]
    with pytest.raises(ValueError, match="tokens"):
        rotate_qkv(q, k[:3], v, rk, rv, torch.bfloat16)
    with pytest.raises(ValueError, match="are not"):
        rotate_qkv(q[:, :7], k, v, rk, rv, torch.bfloat16)
    with pytest.raises(ValueError, match="rotation_v"):
        rotate_qkv(q, k, v, rk, random_orthogonal(32, 2), torch.bfloat16)
    with pytest.raises(ValueError, match="mean_k"):
        rotate_qkv(q, k, v, rk, rv, torch.bfloat16, mean_k=torch.zeros(2, 32))
    with pytest.raises(ValueError, match="kv_dtype"):
        rotate_qkv(q, k, v, rk, rv, torch.int8)
    with pytest.raises(ValueError, match="block_n"):
        rotate_qkv(q, k, v, rk, rv, torch.bfloat16, block_n=48)
    with pytest.raises(ValueError, match="precision"):
        rotate_qkv(q, k, v, rk, rv, torch.bfloat16, precision="tf32")
    with pytest.raises(ValueError, match="precision"):
        rotate_heads(q, rk, torch.bfloat16, precision="bf16")
    with pytest.raises(ValueError, match="are not"):
        rotate_qkv(q, k[:, :0], v[:, :0], rk[:0], rv[:0], torch.bfloat16)
    with pytest.raises(ValueError, match="are not"):  # no q heads: K / V would never be written
        rotate_qkv(q[:, :0], k, v, rk, rv, torch.bfloat16)
    qb, _, _ = rotate_qkv(q, k, v, rk, rv, torch.bfloat16, q_dtype=torch.bfloat16)
    assert_same_rotation(qb, rotate_heads_reference(q, rk, torch.float32))
    with pytest.raises(ValueError, match="k_out"):
        rotate_qkv(q, k, v, rk, rv, torch.bfloat16, out=(torch.empty(6, 8, 64), torch.empty(6, 2, 64),
                                                         torch.empty(6, 2, 64, dtype=torch.bfloat16)))


def test_rotations_read_through_strides():
    """A per-layer rotation broadcast over the kv heads (stride 0, as ``backend.rotations`` holds it)
    and a transposed view give the bits of the materialized matrices: the kernels read R through its
    strides, so the validated calls take them as the served ones do."""
    fresh_seed()
    q, k, v = (torch.randn(3, 8, 64) * 3).bfloat16(), (torch.randn(3, 2, 64) * 3).bfloat16(), torch.randn(3, 2, 64)
    one = random_orthogonal(64, 1)
    rk, rv = one.expand(2, 64, 64), one.transpose(1, 2).expand(2, 64, 64)
    assert rk.stride(0) == 0 and not rv.is_contiguous()
    got = rotate_qkv(q, k, v, rk, rv, torch.bfloat16, block_n=32)
    exp = rotate_qkv(q, k, v, rk.contiguous(), rv.contiguous(), torch.bfloat16, block_n=32)
    assert all(torch.equal(a, b) for a, b in zip(got, exp))
    assert_same_rotation(got[2], rotate_heads_reference(v, rv.contiguous(), torch.float32))
    o = torch.randn(3, 8, 64)
    assert torch.equal(rotate_heads(o, rv, torch.bfloat16, transpose=True, block_n=32),
                       rotate_heads(o, rv.contiguous(), torch.bfloat16, transpose=True, block_n=32))


def test_rotate_heads_strided_rows_and_empty():
    """Rows that are views into a wider tensor (SGLang's fused QKV output: q with GQA 4, k) and zero tokens."""
    fresh_seed()
    qkv = torch.randn(6, (8 + 2 + 2) * 64).to(torch.bfloat16)
    q = qkv[:, : 8 * 64].reshape(-1, 8, 64)
    k = qkv[:, 8 * 64: 10 * 64].reshape(-1, 2, 64)  # stride(0) = the QKV width
    r = random_orthogonal(64, 2)
    for x, dt in ((q, torch.float32), (k, torch.bfloat16)):
        assert x.stride(0) == qkv.shape[1]
        got = rotate_heads(x, r, dt)
        exp = rotate_heads_reference(x, r, dt)
        assert float((got.float() - exp.float()).abs().max()) <= 2 ** -7 * float(exp.abs().max())
    assert rotate_heads(k[:0], r, torch.float32).shape == (0, 2, 64)


@pytest.mark.parametrize("nan_bits", [0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF])
def test_rotate_heads_keeps_nan(nan_bits):
    """A NaN in a row (any NaN bit pattern, incl. 0x7FFFFFFF) comes out NaN in every output dtype, as
    from the einsum: the bf16 rounding must not wrap it to -0.0."""
    x = torch.randn(2, 2, 64)
    x.view(torch.int32)[1, 0, 5] = torch.tensor(nan_bits, dtype=torch.int64).to(torch.int32)
    r = torch.eye(64).expand(2, 64, 64).contiguous()
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        got = rotate_heads(x, r, dt)
        exp = rotate_heads_reference(x, r, dt)
        assert torch.equal(torch.isnan(got), torch.isnan(exp)) and bool(torch.isnan(got[1, 0, 5])), dt


def test_rotate_heads_bad_input():
    r = random_orthogonal(64, 2)
    x = torch.randn(3, 4, 64)
    with pytest.raises(ValueError, match="does not fit rows of head_dim 32"):
        rotate_heads(torch.randn(3, 4, 32), r, torch.float32)
    with pytest.raises(ValueError, match="2 rotation matrices do not divide 3 heads"):
        rotate_heads(torch.randn(3, 3, 64), r, torch.float32)
    with pytest.raises(ValueError, match="rotation"):
        rotate_heads(x, r.double(), torch.float32)
    with pytest.raises(ValueError, match="sub_mean"):
        rotate_heads(x, r, torch.float32, sub_mean=torch.zeros(4, 64))
    with pytest.raises(ValueError, match="out_dtype"):
        rotate_heads(x, r, torch.int8)
    with pytest.raises(ValueError, match="rotation holds no matrices"):
        rotate_heads(x, torch.randn(0, 64, 64), torch.float32)
    for bad in (8, 24, 0, True, 32.0, "Auto", "64"):
        with pytest.raises(ValueError, match="block_n"):
            rotate_heads(x, r, torch.float32, block_n=bad)
    for bad in (8, 48, None, True, "64"):
        with pytest.raises(ValueError, match="block_k"):
            rotate_heads(x, r, torch.float32, block_k=bad)
        with pytest.raises(ValueError, match="block_k"):
            rotate_qkv(x, x[:, :2], x[:, :2], r, r, torch.bfloat16, block_k=bad)
    with pytest.raises(ValueError, match="out"):
        rotate_heads(x, r, torch.float32, out=torch.empty(3, 4, 64, dtype=torch.bfloat16))


CPU_WITHOUT_INTERPRETER = r"""
import torch
from sglang_oscar.kernels.rotate import rotate_heads, rotate_qkv
r = torch.linalg.qr(torch.randn(2, 64, 64))[0].contiguous()
for call in (lambda: rotate_heads(torch.randn(3, 4, 64), r, torch.float32),
             lambda: rotate_qkv(torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64), r, r, torch.bfloat16)):
    try:
        call()
        print("no error")
    except ValueError as exc:
        print("ValueError:", exc)
"""


def test_cpu_tensors_without_the_interpreter_are_refused():
    """Kernels imported without TRITON_INTERPRET (compiled, not interpreted) refuse CPU tensors with a
    ValueError naming the fix before any launch (Triton itself would fail with "0 active drivers")."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", CPU_WITHOUT_INTERPRETER], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("ValueError: _rotate") and "the tensors are on the CPU" in ln
                                   and "TRITON_INTERPRET=1" in ln for ln in lines), res.stdout


# ------------------------------ GPU cases (real sizes, `-m gpu`; sizes and dry run: gpu_sizes.py)


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,hr,d,in_dtype,transpose,sub,add", [
    (scaled(64), 32, 8, 128, torch.bfloat16, False, False, False),  # decode q, batch 64, GQA 4
    (scaled(64), 32, 8, 128, torch.float32, True, False, True),  # decode output back, value mean
    (scaled(8192), 8, 8, 128, torch.bfloat16, False, True, False),  # prefill K, centred
    (scaled(300), 16, 4, 256, torch.bfloat16, False, False, False),
    (scaled(300), 8, 8, 192, torch.float16, True, False, False),
])
def test_gpu_rotate_heads(t, h, hr, d, in_dtype, transpose, sub, add):
    """kernels.rotate.rotate_heads on the GPU against the fp32 einsum (IEEE fp32 dot products, no TF32)."""
    check_rotation(t, h, hr, d, in_dtype, transpose, sub, add, device=DEV)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [16, 32, 64, "auto"])
def test_gpu_rotate_heads_output_slices(block_n):
    """rotate_heads with the output dims split over programs (block_n), decode q / output / prefill K."""
    check_rotation(scaled(8), 32, 8, 128, torch.bfloat16, False, False, False, device=DEV, block_n=block_n)
    check_rotation(scaled(8), 32, 8, 128, torch.float32, True, False, True, device=DEV, block_n=block_n)
    check_rotation(scaled(2048), 8, 8, 256, torch.bfloat16, False, True, False, device=DEV, block_n=block_n)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256, 512])
def test_gpu_rotation_bits_do_not_depend_on_the_launch_shape(d):
    """On the GPU an IEEE fp32 ``tl.dot`` accumulates in input order, so the output slices and input
    steps a launch picks (``auto_block_n`` / ``auto_block_k`` follow the row count, i.e. the batch or
    the prefill chunk) give the same bits: a row is rotated alike in a 64-token chunk and in a whole
    prompt, which chunked prefill and radix reuse rely on (the interpreter sums in other orders)."""
    fresh_seed()
    x = torch.randn(24, 8, d, device=DEV).to(torch.bfloat16)
    r = random_orthogonal(d, 4).to(DEV)
    mu = torch.randn(4, d, device=DEV)
    for out_dtype in (torch.float32, torch.bfloat16):
        ref = rotate_heads(x, r, out_dtype, sub_mean=mu, block_n=None, block_k=16)
        for bn, bk in [(None, "auto"), (16, "auto"), (32, "auto"), (64, 64), (16, 256)]:
            assert torch.equal(rotate_heads(x, r, out_dtype, sub_mean=mu, block_n=bn, block_k=bk), ref), (bn, bk)
    k, v = x[:, :4].contiguous(), x[:, 4:].contiguous()
    ref = rotate_qkv(x, k, v, r, r, torch.bfloat16, block_n=None, block_k=16)
    for bn in (16, 64, "auto"):
        got = rotate_qkv(x, k, v, r, r, torch.bfloat16, block_n=bn)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), bn


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256, 512])
def test_gpu_tf32x3_rotations(d):
    """precision="tf32x3" (the backend's extend steps of 16-bit models): within the fp32 check's bound
    of the einsum, and a row's bits do not depend on how many rows the launch holds (a 1-token, a
    64-token and a 3000-token launch), which chunked prefill and radix reuse rely on."""
    check_rotation(scaled(3000), 8, 8, d, torch.bfloat16, False, True, False, device=DEV, precision="tf32x3")
    check_rotation(scaled(700), 32, 8, d, torch.float32, True, False, True, device=DEV, precision="tf32x3")
    fresh_seed()
    t = scaled(3000)
    q = (torch.randn(t, 32, d, device=DEV) * 3).bfloat16()
    k, v = (torch.randn(t, 8, d, device=DEV) * 3).bfloat16(), (torch.randn(t, 8, d, device=DEV) * 3).bfloat16()
    rk, rv = random_orthogonal(d, 8).to(DEV), random_orthogonal(d, 8).to(DEV)
    mk = torch.randn(8, d, device=DEV)
    full = rotate_qkv(q, k, v, rk, rv, torch.bfloat16, mean_k=mk, precision="tf32x3")
    out = rotate_heads(q, rv, torch.bfloat16, transpose=True, add_mean=mk, precision="tf32x3")
    for a, b in [(0, 1), (5, 69), (100, t)]:
        part = rotate_qkv(q[a:b], k[a:b], v[a:b], rk, rv, torch.bfloat16, mean_k=mk, precision="tf32x3")
        assert all(torch.equal(x, y[a:b]) for x, y in zip(part, full)), (a, b)
        assert torch.equal(rotate_heads(q[a:b], rv, torch.bfloat16, transpose=True, add_mean=mk,
                                        precision="tf32x3"), out[a:b]), (a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("t,hq,hkv,dk,dv,in_dtype,mk,mv,block_n", [
    (scaled(1), 32, 8, 128, 128, torch.bfloat16, True, True, None),  # decode, batch 1, centred
    (scaled(64), 32, 8, 128, 128, torch.bfloat16, False, True, 32),  # decode, batch 64, split outputs
    (scaled(4096), 32, 8, 128, 128, torch.bfloat16, True, False, None),  # prefill
    (scaled(300), 16, 8, 192, 128, torch.float16, True, True, 64),  # D_k != D_v
    (scaled(1), 32, 8, 128, 128, torch.bfloat16, True, True, "auto"),  # the backend's decode call (16 dims)
    (scaled(32), 32, 8, 128, 128, torch.bfloat16, True, True, "auto"),  # ... at batch 32 (64 dims)
    (scaled(4096), 32, 8, 128, 128, torch.bfloat16, True, True, "auto"),  # ... at prefill
])
def test_gpu_rotate_qkv(t, hq, hkv, dk, dv, in_dtype, mk, mv, block_n):
    """kernels.rotate.rotate_qkv (q, K, V in one launch) on the GPU against the fp32 einsum."""
    check_rotate_qkv(t, hq, hkv, dk, dv, in_dtype, mk, mv, block_n, device=DEV)
