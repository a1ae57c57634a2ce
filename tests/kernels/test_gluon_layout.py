"""CPU checks of the Gluon decode loop (kernels/decode/gluon_*.py), which cannot run under the interpreter.

* The operand bookkeeping: the kernel's conversion (its own PTX text, run by a small emulator of
  the three instructions it uses, with the pairing ``pack=2`` gives in its register layouts), the
  kernel's join tree and its reshape / permute constants (``K_WORD_SPLIT``, ``K_PERM``, ``V_PERM``)
  put the code of dim ``k_column_dims()[c]`` at K column ``c`` and of dim ``v_row_dims()[r]`` at V
  row ``r``, scaled by ``2^(2k-24)`` for the dim's quarter ``k``; ``movmatrix`` + ``P_PERM``
  return P; the in-kernel formulas equal the maps. (The join tree is re-written here: a
  different tree would change the joined axis order, which the maps would then not match.)
* The engine resolution (``decode.engine.decode_engine``): scope checks and refusals.
* The compiled INT2 loop (sm_90, offline, through the real launch path): no spills in the loops, no
  shared-memory traffic, shuffles only for the slot ids and the softmax's row reductions, one
  ``movmatrix`` per 8 keys, the expected tensor-core instruction count.

The numbers it computes are checked against the oracle on the GPU (the ``gluon`` GPU cases of test_decode.py).
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
    """decode_engine: Triton-only knobs keep Triton; the Gluon scope is checked, and naming the Gluon
    engine outside it is a ValueError with the reason."""
    from sglang_oscar.kernels import tuning as T
    from sglang_oscar.kernels.decode import engine as L
    from sglang_oscar.kernels import Int2Layout
    from sglang_oscar.kernels.compile_check import compile_only

    lay = Int2Layout.create(128, 128)
    q = torch.zeros(1, 8, 128)
    t = L.AttnTuning.of
    # under the interpreter (this suite) the Gluon engine never applies
    assert L.decode_engine(t(None).resolved(128), lay, q, torch.float16, False) == "triton"
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        L.decode_engine(t({"engine": "gluon"}).resolved(128), lay, q, torch.float16, False)
    # the scope checks, as on a GPU (an offline compile skips the device checks)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with compile_only("cuda", 90):
        g = t({"engine": "gluon"}).resolved(128)
        assert L.decode_engine(g, lay, q, torch.float16, False, torch.bfloat16) == "gluon"
        for args, why in (((lay, q, torch.float16, False, torch.float32), "HP rows in torch.float32"),
                          ((lay, q, torch.float32, False), "MMA operands"),
                          ((lay, q, torch.float16, True), "logit cap"),
                          ((Int2Layout.create(128, 128, quantizer="lloyd-max"), q, torch.float16, False), "Lloyd"),
                          ((Int2Layout.create(64, 64), q, torch.float16, False), "head_dim 64"),
                          ((Int2Layout.create(128, 128, group_size=64), q, torch.float16, False), "group")):
            with pytest.raises(ValueError, match=why):
                L.decode_engine(g, *args)
        odd = torch.zeros(10, 2, 37, dtype=torch.uint8)[..., 1:33]  # storage offset of 1 byte
        with pytest.raises(ValueError, match="32-bit words"):
            L.decode_engine(g, lay, q, torch.float16, False, torch.bfloat16, (odd,))
        with pytest.raises(ValueError, match="block_n 64"):
            L.decode_engine(t({"engine": "gluon", "block_n": 64}).resolved(128), lay, q, torch.float16, False)
        # unset engine: an offline compile keeps Triton unless told; on a GPU (not offline) the
        # Gluon engine, except when a Triton-only knob is named
        assert L.decode_engine(t(None).resolved(128), lay, q, torch.float16, False) == "triton"
        # async_stages is a Gluon knob: named with the engine unset it asks for Gluon (an offline
        # compile then compiles it, and the scope is enforced like engine='gluon')
        assert L.decode_engine(t({"async_stages": 3}).resolved(128), lay, q, torch.float16, False) == "gluon"
        with pytest.raises(ValueError, match="logit cap"):
            L.decode_engine(t({"async_stages": 2}).resolved(128), lay, q, torch.float16, True)
    with pytest.raises(ValueError, match="Gluon-engine knob"):
        t({"async_stages": 3, "engine": "triton"})
    with pytest.raises(ValueError, match=r"Triton-only knob\(s\) \['num_stages'\]"):  # not silently dropped
        L.decode_engine(t({"async_stages": 3, "num_stages": 2}).resolved(128), lay, q, torch.float16, False)
    with pytest.raises(ValueError, match="async_stages=3.7 must be an integer"):
        t({"async_stages": 3.7})
    with pytest.raises(ValueError, match="block_n='x' must be an integer"):
        t({"block_n": "x"})
    assert t({"block_n": "32"}).block_n == 32
    with pytest.raises(ValueError, match="async_stages=5"):
        t({"async_stages": 5})
    assert t({"async_stages": 0}).resolved(128).async_stages == 0
    # async_slots: a bool, needs the cp.async words, Gluon-only like async_stages
    with pytest.raises(ValueError, match="async_slots=True needs async_stages 2-4"):
        t({"async_stages": 0, "async_slots": True})
    with pytest.raises(ValueError, match="must be true or false"):
        t({"async_slots": 1})
    with pytest.raises(ValueError, match="async_slots is a Gluon-engine knob"):
        t({"async_slots": True, "engine": "triton"})
    assert L.gluon_pipeline(t(None)) == {"async_stages": L.GLUON_ASYNC_STAGES, "slot_ring": True}
    assert L.gluon_pipeline(t({"async_stages": 0})) == {"async_stages": 0, "slot_ring": False}
    assert L.gluon_pipeline(t({"async_stages": 3, "async_slots": False})) == {"async_stages": 3, "slot_ring": False}
    assert L.gluon_pipeline(t({"async_slots": True})) == {"async_stages": 2, "slot_ring": True}
    assert L.gluon_pipeline(t({"async_slots": False})) == {"async_stages": 2, "slot_ring": False}
    # 0 / False are Gluon choices too (the default is 2 stages + the slot ring): refused with Triton,
    # and they select the Gluon engine (which cannot run here: no CUDA device)
    for knob, val in (("async_stages", 0), ("async_slots", False)):
        with pytest.raises(ValueError, match="Gluon-engine knob"):
            t({knob: val, "engine": "triton"})
        with pytest.raises(ValueError, match=r"Triton-only knob\(s\) \['convert'\]"):
            L.decode_engine(t({knob: val, "convert": 3}).resolved(128), lay, q, torch.float16, False)
        with pytest.raises(ValueError, match=f"{knob}={val} selects the Gluon engine, which cannot run"):
            L.decode_engine(t({knob: val}).resolved(128), lay, q, torch.float16, False)
    # engine='gluon' with a Triton-only knob: refused, not silently dropped
    with pytest.raises(ValueError, match=r"engine='gluon' with Triton-engine knob\(s\) \['convert', 'num_stages'\]"):
        L.decode_engine(t({"engine": "gluon", "convert": 3, "num_stages": 3}).resolved(128), lay, q, torch.float16, False)
    # the resolved-tuning cache keys on the value's type: True == 1 must not let 1 through
    T._resolved_tuning({"async_slots": True}, lay, False)
    with pytest.raises(ValueError, match="must be true or false"):
        T._resolved_tuning({"async_slots": 1}, lay, False)
    monkeypatch.setattr(L, "compiling_offline", lambda: False)
    monkeypatch.setattr(L, "gluon_decode_supported", lambda *a, **k: None)
    assert L.decode_engine(t(None).resolved(128), lay, q, torch.float16, False) == "gluon"
    assert L.decode_engine(t({"maxnreg": 200}).resolved(128), lay, q, torch.float16, False) == "gluon"
    for knob in L.AttnTuning.TRITON_ONLY:
        val = {"convert": 3, "token_major": True, "pairs_ahead": False, "defer_sums": False}.get(knob, 1)
        assert L.decode_engine(t({knob: val}).resolved(128), lay, q, torch.float16, False) == "triton", knob


def _compile_stats(block_n: int, tuning: dict | None = None) -> dict:
    """``tests/kernels/gluon_compile_check.py --decode`` in a subprocess without the interpreter: the JSON of
    the Gluon decode kernel compiled for sm_90 (registers, stack, shared memory, loop opcodes)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.join(HERE, "gluon_compile_check.py"), "--decode", "--block-n", str(block_n)]
    if tuning:
        cmd += ["--tuning", json.dumps(tuning)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block_n,stages", [(16, 3), (32, 2), (32, 4)])
def test_gluon_decode_async_loop_compiles(block_n, stages):
    """sm_90 SASS of the ``async_stages`` variant without the slot ring (``async_slots`` False): code
    and pair words reach shared memory by ``cp.async`` (LDGSTS) and come back by LDS; the only
    global loads of the INT2 loop are the slot ids; no local memory; the ring fits (2.3 KB per
    stage at block_n 32)."""
    stats = _compile_stats(block_n, {"async_stages": stages, "async_slots": False})
    assert stats["stack"] <= 16, stats
    assert all(loop.get("LDL", 0) == 0 and loop.get("STL", 0) == 0 for loop in stats["loops"]), stats
    ring = stages * (2 * block_n * 8 * 4 + 2 * block_n * 4)
    assert ring <= stats["shared"] <= ring + 4096, stats
    ops = stats["loops"][-1]
    # K words: block_n / 8 rows x one 8-byte copy; V words: block_n / 4 keys; pairs: one K and one V
    # word per lane (block_n / 32 each)
    assert ops["LDGSTS"] == block_n // 8 + block_n // 4 + 2 * max(1, block_n // 32), ops
    # slot ids only: block_n / 8 rows in the K-row layout + one per lane for the pair copies
    assert ops["LDG"] == block_n // 8 + max(1, block_n // 32), ops
    assert ops["HMMA"] == block_n // 16 * 8 * 2, ops


@pytest.mark.parametrize("block_n,stages", [(16, None), (32, None), (32, 3)])
def test_gluon_decode_slot_ring_loop_compiles(block_n, stages):
    """sm_90 SASS of the default pipeline (``async_stages`` 2, slot ring on) and of 3 stages: the
    INT2 loop waits on no global load -- code / pair words and the slot ids all arrive by
    ``cp.async`` (LDGSTS: the words as above plus one slot copy per lane) -- no local memory, and
    the shared memory is the word ring plus a slot ring of ``2 stages + 2`` stages."""
    stats = _compile_stats(block_n, None if stages is None else {"async_stages": stages})
    st = stages or 2
    assert stats["stack"] <= 16, stats
    assert all(loop.get("LDL", 0) == 0 and loop.get("STL", 0) == 0 for loop in stats["loops"]), stats
    ring = st * (2 * block_n * 8 * 4 + 2 * block_n * 4) + (2 * st + 2) * block_n * 4
    assert ring <= stats["shared"] <= ring + 4096, stats
    ops = stats["loops"][-1]
    assert ops.get("LDG", 0) == 0, ops
    assert ops["LDGSTS"] == block_n // 8 + block_n // 4 + 3 * max(1, block_n // 32), ops
    assert ops["HMMA"] == block_n // 16 * 8 * 2, ops


@pytest.mark.parametrize("block_n", [16, 32])
def test_gluon_decode_loop_compiles_without_layout_traffic(block_n):
    """sm_90 SASS (compiled through decode_attention's real launch) of the register pipeline
    (``async_stages`` 0): the INT2 key loop never moves operands through shared memory; the HP loop
    (at most sink + recent keys) may, once per block."""
    stats = _compile_stats(block_n, {"async_stages": 0})
    # at the default 168-register cap no loop touches local memory; the prologue may park two
    # output pointers there (16 bytes, reloaded once in the epilogue)
    assert stats["stack"] <= 16, stats
    assert all(loop.get("LDL", 0) == 0 and loop.get("STL", 0) == 0 for loop in stats["loops"]), stats
    assert stats["shared"] <= 4096, stats  # the HP tier's V^T tile only
    assert len(stats["loops"]) == 2, stats["loop_instructions"]  # HP loop, INT2 loop
    ops = stats["loops"][1]
    for op in ("LDS", "STS", "LDSM", "STSM", "BAR"):
        assert ops.get(op, 0) == 0, (op, ops)
    # S^T: block_n/16 row tiles x 8 k-steps; O^T: 8 row tiles x block_n/16 k-steps
    assert ops["HMMA"] == block_n // 16 * 8 * 2, ops
    assert ops["MOVM"] == block_n // 8, ops
    # shuffles: the slot ids from the K-row to the V-key layout (block_n / 4 per thread) and the
    # softmax row reductions (max of the scores, 2 columns x 3 lane steps; max of the V scales, 3)
    assert ops.get("SHFL", 0) <= block_n // 4 + 9, ops
    # conversion floor: one AND per two codes of K and V (2 x 128 x block_n / 2 / 32 lanes)
    assert ops["LOP3"] >= 4 * block_n, ops
    # loads per thread and block: slot ids (block_n / 8 rows), K words 2t, 2t+1 of those rows as one
    # 8-byte load each (the test pool's byte strides are multiples of 16: the pair is 8-byte aligned),
    # V word g of block_n / 4 keys, the K and V (scale, zero) words of the rows: 3 block_n / 4 in all
    assert ops["LDG"] == 3 * block_n // 4, ops


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
