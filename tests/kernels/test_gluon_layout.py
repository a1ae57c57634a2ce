"""CPU checks of the Gluon decode loop (kernels/decode/gluon_*.py), which cannot run under the interpreter.

* The operand bookkeeping: the kernel's conversion (its own PTX text, run by a small emulator of
  the three instructions it uses, with the pairing ``pack=2`` gives in its register layouts), the
  kernel's join tree and its reshape / permute constants (``K_WORD_SPLIT``, ``K_PERM``, ``V_PERM``)
  put the code of dim ``k_column_dims()[c]`` at K column ``c`` and of dim ``v_row_dims()[r]`` at V
  row ``r``, scaled by ``2^(2k-24)`` for the dim's quarter ``k``; ``movmatrix`` + ``P_PERM``
  return P; the in-kernel formulas equal the maps. (The join tree is re-written here: a
  different tree would change the joined axis order, which the maps would then not match.)
* The engine resolution (``decode.engine.decode_config``): scope checks and refusals.
* The compiled INT2 loop (sm_90, offline, through the real launch path): no spills in the loops, no
  global load waited on (words and slot ids arrive by ``cp.async``), the expected ``cp.async`` and
  tensor-core instruction counts, the shared-memory rings' size.

The numbers it computes are checked against the oracle on the GPU (the ``gluon`` GPU cases of test_decode_gpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from kv_fixtures import fresh_seed
from sglang_oscar.kernels.decode.gluon_kernel import _k_dims, _v_dims
from sglang_oscar.kernels.decode.gluon_operands import (
    K_PERM,
    K_WORD_SPLIT,
    P_PERM,
    V_PERM,
    _k_asm,
    _v_asm,
    k_column_dims,
    v_row_dims,
)
from sglang_oscar.quant.packing import pack_quarter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")


def _half_values(x32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 tensor of 32-bit patterns -> (low, high) fp16 halves as fp32 values."""
    lo = (x32 & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).float()
    hi = ((x32 >> 16) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).float()
    return lo, hi


def _run_ptx(text: str, inputs: dict) -> dict:
    """Emulate the PTX subset the conversions use (``shr.b32``, ``and.b32``, ``prmt.b32`` with an
    immediate selector, ``.reg`` declarations) on int64 tensors holding 32-bit patterns; returns
    every register written, ``$0``.. included. ``prmt`` follows the PTX ISA: selector nibble ``i``
    (low 3 bits) picks byte ``i`` of the result from the 8-byte pool ``{b, a}`` (bytes 0-3 of a)."""
    regs = dict(inputs)

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [x.strip() for x in rest.split(",")]
        if op == "shr.b32":
            regs[args[0]] = (val(args[1]) & 0xFFFFFFFF) >> int(args[2], 0)
        elif op == "and.b32":
            regs[args[0]] = val(args[1]) & val(args[2])
        elif op == "prmt.b32":
            a_, b_, sel = val(args[1]), val(args[2]), int(args[3], 0)
            pool = [(a_ >> (8 * i)) & 0xFF for i in range(4)] + [(b_ >> (8 * i)) & 0xFF for i in range(4)]
            regs[args[0]] = sum(pool[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))
        else:
            raise AssertionError(f"unexpected PTX {line!r}")
    return regs


def _join16(outs: list[torch.Tensor]) -> torch.Tensor:
    # gl.join(a, b) == stack on a new last axis; the same tree as gluon_kernel._join16
    a = [torch.stack([outs[2 * i], outs[2 * i + 1]], -1) for i in range(8)]
    b = [torch.stack([a[2 * i], a[2 * i + 1]], -1) for i in range(4)]
    c = [torch.stack([b[2 * i], b[2 * i + 1]], -1) for i in range(2)]
    return torch.stack([c[0], c[1]], -1)


def _quarter_scale(dims: list[int]) -> torch.Tensor:
    return torch.tensor([2.0 ** (2 * (d // 32) - 24) for d in dims])


def test_dim_maps_are_permutations():
    assert sorted(k_column_dims()) == list(range(128))
    assert sorted(v_row_dims()) == list(range(128))
    with pytest.raises(ValueError, match="head_dim 128"):
        k_column_dims(64)


@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_k_operand_bookkeeping(block_n):
    fresh_seed()
    codes = torch.randint(0, 4, (block_n, 128))
    words = pack_quarter(codes).view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [N, 8]
    outs = [torch.zeros(block_n, 8) for _ in range(16)]
    for t in range(4):  # KW layout: a thread's consecutive registers are words 2t, 2t+1 (pack=2)
        regs = _run_ptx(_k_asm(), {"$16": words[:, 2 * t], "$17": words[:, 2 * t + 1]})
        for o in range(16):  # output register o: its low half is element 2t, its high half 2t+1
            outs[o][:, 2 * t], outs[o][:, 2 * t + 1] = _half_values(regs[f"${o}"])
    d = _join16(outs)  # [N, 8, b0, b1, b2, b3]
    a = d.reshape(block_n, *K_WORD_SPLIT, 2, 2, 2, 2).permute(*K_PERM).reshape(block_n, 128)
    dims = k_column_dims()
    assert torch.equal(a, codes[:, dims].float() * _quarter_scale(dims))


@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_v_operand_bookkeeping(block_n):
    fresh_seed()
    codes = torch.randint(0, 4, (block_n, 128))
    words = pack_quarter(codes).view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [N tokens, 8]
    outs = [torch.zeros(block_n, 8) for _ in range(16)]
    for k in range(0, block_n, 2):  # VW layout: consecutive registers are keys 2t, 2t+1 (pack=2)
        regs = _run_ptx(_v_asm(), {"$16": words[k], "$17": words[k + 1]})
        for o in range(16):
            outs[o][k], outs[o][k + 1] = _half_values(regs[f"${o}"])
    d = _join16(outs)  # [N, 8, b0, b1, b2, b3]
    a = d.permute(*V_PERM).reshape(128, block_n)
    dims = v_row_dims()
    assert torch.equal(a, codes.t()[dims].float() * _quarter_scale(dims)[:, None])


def test_in_kernel_dim_formulas_match_the_maps():
    """The kernel computes the maps with integer ops (_k_dims / _v_dims, no tables): same values."""
    c = torch.arange(128)
    assert torch.equal(_k_dims.fn(c), torch.tensor(k_column_dims()))
    assert torch.equal(_v_dims.fn(c), torch.tensor(v_row_dims()))


def _movmatrix_trans(x: torch.Tensor) -> torch.Tensor:
    """``movmatrix.sync.aligned.m8n8.trans.b16`` on each 8-row tile of an m16n8 accumulator-layout
    tensor ``[N, 8]``, in the kernel's labels: the source fragment gives lane ``4 g + t`` row ``g``,
    columns ``2t, 2t+1`` of the tile; the result gives the same lane row ``g``, columns ``2t, 2t+1``
    of the transposed tile (PTX ISA), which the kernel's tensor still labels ``(8i + g, 2t + j)``."""
    y = torch.empty_like(x)
    for i in range(x.shape[0] // 8):
        tile = x[8 * i:8 * i + 8]
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for j in range(2):
                y[8 * i + g, 2 * t + j] = tile.t()[g, 2 * t + j]
    return y


def test_p_operand_bookkeeping():
    """movmatrix.trans, then the kernel's reshape / P_PERM / reshape, gives P back (B-operand labels)."""
    p = torch.randn(32, 8)
    z = _movmatrix_trans(p).reshape(4, 8, 8).permute(*P_PERM).reshape(32, 8)
    assert torch.equal(z, p)


def test_engine_resolution(monkeypatch):
    """decode_config: the config's type is the engine; auto (None) takes the Gluon engine where its scope
    accepts the call (never under the interpreter, nor in an offline compile unless asked); a Gluon
    config outside the scope is a ValueError with the reason."""
    from sglang_oscar.kernels import GluonConfig, Int2Layout, TritonConfig, default_triton_config
    from sglang_oscar.kernels.compile_check import compile_only
    from sglang_oscar.kernels.decode import engine as L
    from sglang_oscar.kernels.decode.gluon_stage1 import gluon_decode_supported

    lay = Int2Layout.create(128, 128)
    q = torch.zeros(1, 8, 128)

    def scope(*args):
        return lambda: gluon_decode_supported(*args)

    ok = scope(lay, q, torch.float16, False)
    # under the interpreter (this suite) the Gluon engine never applies
    assert L.decode_config(None, lay, 8, ok) == default_triton_config(lay, pairs=8)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        L.decode_config(GluonConfig, lay, 8, ok)
    # the scope checks, as on a GPU (an offline compile skips the device checks)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with compile_only("cuda", 90):
        assert L.decode_config(GluonConfig, lay, 8, scope(lay, q, torch.float16, False, torch.bfloat16)) == GluonConfig()
        for args, why in (((lay, q, torch.float16, False, torch.float32), "HP rows in torch.float32"),
                          ((lay, q, torch.float32, False), "MMA operands"),
                          ((lay, q, torch.float16, True), "logit cap"),
                          ((Int2Layout.create(128, 128, quantizer="lloyd-max"), q, torch.float16, False), "Lloyd"),
                          ((Int2Layout.create(64, 64), q, torch.float16, False), "head_dim 64"),
                          ((Int2Layout.create(128, 128, group_size=64), q, torch.float16, False), "group")):
            with pytest.raises(ValueError, match=why):
                L.decode_config(GluonConfig(), lay, 8, scope(*args))
        odd = torch.zeros(10, 2, 37, dtype=torch.uint8)[..., 1:33]  # storage offset of 1 byte
        with pytest.raises(ValueError, match="32-bit words"):
            L.decode_config(GluonConfig(), lay, 8, scope(lay, q, torch.float16, False, torch.bfloat16, (odd,)))
        with pytest.raises(ValueError, match="block_n=64"):  # spills: refused by the config itself
            GluonConfig(block_n=64)
        # auto: an offline compile keeps Triton unless told
        assert L.decode_config(None, lay, 8, ok) == default_triton_config(lay, pairs=8)
    # a config instance runs as given; a type gives that engine's defaults (Triton's by pairs)
    t = TritonConfig(num_stages=3)
    assert L.decode_config(t, lay, 8, ok) is t
    assert L.decode_config(TritonConfig, lay, 256, ok) == default_triton_config(lay, pairs=256)
    with pytest.raises(ValueError, match="config must be None, TritonConfig or GluonConfig"):
        L.decode_config("gluon", lay, 8, ok)
    asked = []
    L.decode_config(TritonConfig(), lay, 8, lambda: asked.append(1))  # a Triton config needs no scope check
    L.decode_config(TritonConfig, lay, 8, lambda: asked.append(1))
    assert asked == []
    monkeypatch.setattr(L, "compiling_offline", lambda: False)
    assert L.decode_config(None, lay, 8, lambda: None) == GluonConfig()  # on a GPU, in scope: Gluon
    g = GluonConfig(maxnreg=200)
    assert L.decode_config(g, lay, 8, lambda: None) is g


def _compile_stats(block_n: int) -> dict:
    """``tests/kernels/gluon_compile_check.py --decode`` in a subprocess without the interpreter: the JSON of
    the Gluon decode kernel compiled for sm_90 (registers, stack, shared memory, loop opcodes)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.join(HERE, "gluon_compile_check.py"), "--decode", "--block-n", str(block_n)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block_n", [16, 32])
def test_gluon_decode_slot_ring_loop_compiles(block_n):
    """sm_90 SASS of the Gluon pipeline (a ring of 2 ``cp.async`` stages for the words, a slot ring):
    the INT2 loop waits on no global load -- code / pair words and the slot ids all arrive by
    ``cp.async`` (LDGSTS: K words block_n / 8 rows x one 8-byte copy, V words block_n / 4 keys, the K
    and V pair words and the slot ids one key per lane) -- no local memory, and the shared memory is
    the word ring (2.3 KB per stage at block_n 32) plus a slot ring of ``2 stages + 2`` stages."""
    stats = _compile_stats(block_n)
    st = 2
    assert stats["stack"] <= 16, stats
    assert all(loop.get("LDL", 0) == 0 and loop.get("STL", 0) == 0 for loop in stats["loops"]), stats
    ring = st * (2 * block_n * 8 * 4 + 2 * block_n * 4) + (2 * st + 2) * block_n * 4
    assert ring <= stats["shared"] <= ring + 4096, stats
    ops = stats["loops"][-1]
    assert ops.get("LDG", 0) == 0, ops
    assert ops["LDGSTS"] == block_n // 8 + block_n // 4 + 3 * max(1, block_n // 32), ops
    assert ops["HMMA"] == block_n // 16 * 8 * 2, ops


def test_gluon_compile_check_prints_the_loop_order():
    """``--order``: one letter per key opcode of the INT2 loop, as many H / S / E as the loop's HMMA /
    SHFL / MUFU counts in the JSON line before it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.join(HERE, "gluon_compile_check.py"), "--decode", "--order"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    stats_line, order = res.stdout.strip().splitlines()[-2:]
    ops = json.loads(stats_line)["loops"][-1]
    assert set(order) <= set("HSElgxomG") and order
    for letter, op in (("H", "HMMA"), ("S", "SHFL"), ("E", "MUFU"), ("g", "LDGSTS")):
        assert order.count(letter) == ops.get(op, 0), (letter, order)
