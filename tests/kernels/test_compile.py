"""The GPU code path compiles (sm_90, to a cubin with the Triton wheel's ptxas) on a CPU-only
machine, and the benchmark script runs its smoke configuration under the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def _ptxas_available() -> bool:
    try:
        import triton

        base = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        return os.path.exists(base)
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="triton's bundled ptxas not found")
def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, os.path.join(HERE, "compile_sm90.py")], env=env, capture_output=True,
                         text=True, timeout=600)
    print(res.stdout[-4000:])
    assert res.returncode == 0, res.stderr[-4000:]
    from compile_sm90 import CASES

    assert res.stdout.count("ok ") == len(CASES)


@pytest.mark.skipif(not _ptxas_available(), reason="triton's bundled ptxas not found")
def test_gluon_kernel_compiles_for_sm90():
    """tests/kernels/gluon_compile_check.py: a Gluon kernel reaches a cubin with SASS on this CPU box."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, os.path.join(HERE, "gluon_compile_check.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "'cubin'" in res.stdout and "'ttgir'" in res.stdout
    count = int(res.stdout.split(";")[1].split()[0])
    assert 20 <= count <= 200, res.stdout
    env["TRITON_INTERPRET"] = "1"
    res = subprocess.run([sys.executable, os.path.join(HERE, "gluon_compile_check.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "unset TRITON_INTERPRET" in res.stderr


def _smoke(module: str, out, *extra: str) -> None:
    """Run ``python -m benchmarks.<module> --smoke --out <out> [extra]`` from the repository root under
    the interpreter; it must exit 0."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--smoke", "--out", str(out), *extra],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


def test_bench_step_smoke(tmp_path):
    """benchmarks/bench_step.py --smoke runs every piece of the served step (both rotate engines, the
    write, attention with the server's fp32 queries, the BF16 side, the one-launch q/K/V rotation,
    Triton rows with split output dims, the server's choice) and the prefill-size rotations, and writes
    its tables."""
    out = tmp_path / "step.md"
    _smoke("bench_step", out, "--rotate-block-n", "32", "--prefill-tokens", "64")
    text = out.read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| 352 x 2 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["torch", "triton", "triton-qkv", "triton-qkv auto (served)",
                                                       "triton bn=32", "triton-qkv bn=32"], text
    prefill = [ln for ln in text.splitlines() if ln.startswith("| 5 |")]  # --smoke times 5 tokens
    assert [r.split("|")[2].strip() for r in prefill] == ["torch", "triton", "triton-qkv",
                                                          "triton-qkv auto (served)"], text


def test_bench_decode_smoke(tmp_path):
    out = tmp_path / "bench.md"
    _smoke("bench_decode", out)
    text = out.read_text()
    assert "| ctx | batch |" in text and "Write (quantize+scatter" in text


def test_bench_latent_smoke(tmp_path):
    """benchmarks/bench_latent.py --smoke runs the INT2 latent decode and SGLang's Triton MLA decode
    (its 288-wide latent shape) once each and writes the table row with their ratio, and the served
    tiles' column."""
    out = tmp_path / "latent.md"
    _smoke("bench_latent", out)
    text = out.read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| 4 | 2 x 48 |")]
    assert len(rows) == 1 and "sglang-triton-mla" in rows[0] and rows[0].split("|")[5].strip().endswith("x"), rows
    assert text.splitlines()[0].rstrip().endswith("INT2 served |") and rows[0].split("|")[7].strip()[-1] == "s", text


def test_bench_sparse_smoke(tmp_path):
    """benchmarks/bench_sparse.py --smoke runs the INT2 block-sparse decode once and writes its row (the
    BF16 column stays empty: SGLang's sparse kernels are autotuned, which the interpreter cannot run)."""
    out = tmp_path / "sparse.md"
    _smoke("bench_sparse", out)
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith("| 4:2 | 16 x 3 | 2 x 100 |")]
    assert len(rows) == 1 and rows[0].split("|")[4].strip().endswith("ms"), rows


def test_bench_latent_extend_smoke(tmp_path):
    """benchmarks/bench_latent_extend.py --smoke runs the served gather path, the direct INT2 extend
    kernel and SGLang's BF16 extend once each and writes their row with both ratios."""
    out = tmp_path / "latent_extend.md"
    _smoke("bench_latent_extend", out)
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith("| 4 | 20 + 12 |")]
    assert len(rows) == 1 and [c.strip()[-1] for c in rows[0].split("|")[6:8]] == ["x", "x"], rows


def test_bench_extend_step_smoke(tmp_path):
    """benchmarks/bench_extend_step.py --smoke runs the served INT2 prefill step and each of its pieces
    (rotations at TF32x3 and IEEE fp32, each rotation alone, write, extend attention) and SGLang's BF16
    extend, without and with a prefix, on a Lloyd-Max layout, and writes their rows with the ratio."""
    out = tmp_path / "extend_step.md"
    _smoke("bench_extend_step", out, "--configs", '[{"block_m": 32, "block_n": 32}]', "--quantizer", "lloyd-max")
    text = out.read_text()
    rows = [ln.split("|") for ln in text.splitlines() if ln.startswith(("| 0 + 16 |", "| 8 + 16 |"))]
    assert len(rows) == 2 and all(len(r) == 13 and r[7].strip().endswith("x") for r in rows), rows
    assert "attention (block_m 32, block_n 32)" in text


def test_bench_pool_layouts_read_the_same_rows(monkeypatch):
    """bench_decode.apply_pool_layout re-lays a case without changing what any slot holds: the
    served pool's head-major code / pair planes with the same (random) slot ids give the decode
    output of the separate slot-major tensors exactly, and with sorted slots the planes, the
    interleaved 36-byte rows and head-major tensors all give the slot-major output; sorting the
    slots (a different slot -> key mapping) changes it."""
    import torch

    monkeypatch.syspath_prepend(ROOT)
    from benchmarks import bench_decode as bd

    monkeypatch.setattr(bd, "HQ", 4)
    monkeypatch.setattr(bd, "HKV", 2)
    layout = bd.bench_layout()

    def run(mode):
        case = bd.Case(2, 352, torch.device("cpu"), layout, with_bf16=False)
        bd.apply_pool_layout(case, mode)
        return case, case.run_int2(num_kv_splits=2).float()

    base_case, base = run("random")
    served_case, served = run("served-random")
    n_slots = served_case.k_codes.shape[0]
    assert served_case.k_codes.stride() == (32, n_slots * 32, 1) and served_case.k_pairs.stride() == (2, n_slots * 2, 1)
    assert torch.equal(served, base)
    _, srt = run("sorted")
    _, hm = run("sorted-hm-all")
    rows_case, rows = run("rows")
    assert rows_case.k_codes.stride() == (36, n_slots * 36, 1)
    _, served_sorted = run("served")
    assert torch.equal(hm, srt) and torch.equal(rows, srt) and torch.equal(served_sorted, srt)
    assert not torch.equal(srt, base)
    with pytest.raises(ValueError, match="pool layout"):
        bd.apply_pool_layout(base_case, "bogus")


ROTATE_SPILL_CHECK = r"""
import re, sys, torch
from sglang_oscar.kernels.compile_check import COMPILED, compile_only, cuobjdump
from sglang_oscar.kernels.rotate import rotate_heads
shapes = [(32, 32, 8, 128, None), (4096, 8, 8, 128, None), (4096, 8, 8, 256, None), (4096, 8, 8, 512, None),
          (300, 8, 8, 192, None), (8, 4, 4, 64, None), (1, 32, 8, 128, 16), (4096, 8, 8, 512, 64)]
with compile_only("cuda", 90):
    for t, h, hr, d, bn in shapes:
        rotate_heads(torch.randn(t, h, d).to(torch.bfloat16), torch.linalg.qr(torch.randn(hr, d, d))[0].contiguous(),
                     torch.bfloat16, block_n=bn)
from sglang_oscar.kernels.rotate import rotate_qkv
qkv = [(1, 32, 8, 128, 128, None), (4096, 32, 8, 128, 128, None), (300, 16, 8, 192, 128, None), (64, 32, 8, 128, 128, 32),
       (64, 8, 2, 512, 512, None)]
with compile_only("cuda", 90):
    for t, hq, hkv, dk, dv, bn in qkv:
        rotate_qkv(torch.randn(t, hq, dk).to(torch.bfloat16), torch.randn(t, hkv, dk).to(torch.bfloat16),
                   torch.randn(t, hkv, dv).to(torch.bfloat16), torch.linalg.qr(torch.randn(hkv, dk, dk))[0].contiguous(),
                   torch.linalg.qr(torch.randn(hkv, dv, dv))[0].contiguous(), torch.bfloat16, block_n=bn)
tf = [(4096, 32, 8, 128), (4096, 8, 8, 256), (4096, 8, 8, 512)]  # the extend output rotation, TF32x3 MMAs
with compile_only("cuda", 90):
    for t, h, hr, d in tf:
        rotate_heads(torch.randn(t, h, d), torch.linalg.qr(torch.randn(hr, d, d))[0].contiguous(), torch.bfloat16,
                     transpose=True, precision="tf32x3")
shapes += qkv + tf
for shape, c in zip(shapes, COMPILED):
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", cuobjdump(c[-1].asm["cubin"], "-res-usage"))
    print(shape, "REG", m.group(1), "STACK", m.group(2))
"""


@pytest.mark.skipif(not _ptxas_available(), reason="triton's bundled ptxas not found")
def test_rotate_kernel_does_not_spill_on_sm90():
    """kernels.rotate's launch choices (rows per program, K slice, warps; all output dims or a
    ``block_n`` slice per program; rotate_heads and the one-launch rotate_qkv) keep every head_dim's
    accumulator in registers: no local-memory stack in the sm_90 cubin."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", ROTATE_SPILL_CHECK], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = [ln for ln in res.stdout.splitlines() if "STACK" in ln]
    assert len(lines) == 16 and all(ln.endswith("STACK 0") for ln in lines), res.stdout


EXTEND_SPILL_CHECK = r"""
import re, sys, torch
sys.path.insert(0, sys.argv[1])
import compile_sm90
from sglang_oscar.kernels import Int2Layout, default_triton_config
from sglang_oscar.kernels.compile_check import COMPILED, compile_only, cuobjdump
# the 128-key shapes of default_triton_config (64 queries, 4 warps, fp16 operands, uniform, one group)
assert default_triton_config(Int2Layout.create(128), extend=True).block_n == 128
assert default_triton_config(Int2Layout.create(64), extend=True, windowed=True, capped=True).block_n == 128
lloyd = Int2Layout.create(128, quantizer="lloyd-max")
assert default_triton_config(lloyd, extend=True).block_n == 128
assert default_triton_config(lloyd, extend=True, windowed=True).block_n == 64
assert default_triton_config(Int2Layout.create(64, quantizer="lloyd-max"), extend=True).block_n == 64
with compile_only("cuda", 90):
    compile_sm90._attn("e")
    compile_sm90._attn("e", dk=64, dv=64)
    compile_sm90._attn("e", dk=64, dv=64, sliding_window=16, sinks=torch.zeros(32))
    compile_sm90._attn("e", dk=64, dv=64, logit_cap=30.0)
    compile_sm90._attn("e", dk=192, dv=128, hq=8, hkv=8, group=64)  # 8 warps: K / V quarters 64 / 32 wide
    compile_sm90._attn("e", quantizer="lloyd-max")  # last two: the accepted spills (sinks known at run time)
    compile_sm90._attn("e", quantizer="lloyd-max", sinks=torch.zeros(32))
for c in COMPILED:
    print("BLOCK_N", c[-1].src.constants.get("BLOCK_N", "?") if hasattr(c[-1], "src") else "?",
          "STACK", re.search(r"STACK:(\d+)", cuobjdump(c[-1].asm["cubin"], "-res-usage")).group(1))
"""


@pytest.mark.skipif(not _ptxas_available(), reason="triton's bundled ptxas not found")
def test_extend_kernel_does_not_spill_on_sm90():
    """The extend kernel's 128-key default tiles (``configs.default_triton_config``: head_dim 128 with
    no window or cap, head_dim 64 with window, cap and sinks; uniform, one group, fp16 operands)
    and the 8-warp tiles of K 192 / V 128 keep everything in registers: no local-memory stack in the
    sm_90 cubin. (Where 128 keys would spill -- several groups, bf16 / fp32 operands, a window or cap
    at 128 -- the default stays at 64: the stack bytes are in that function's comments.) One-group
    Lloyd-Max at head_dim 128 takes 128 keys with a small spill, at most 32 bytes (24 when measured, 16
    with attention sinks), because it still runs faster there than at 64 keys."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", EXTEND_SPILL_CHECK, HERE], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = [ln for ln in res.stdout.splitlines() if "STACK" in ln]
    assert len(lines) == 7 and all(ln.endswith("STACK 0") for ln in lines[:5]), res.stdout
    assert all(0 < int(ln.split()[-1]) <= 32 for ln in lines[5:]), res.stdout  # 128 keys: the script's top asserts
