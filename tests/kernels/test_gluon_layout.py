"""CPU checks of the Gluon decode loop (kernels/gluon_decode.py), which cannot run under the interpreter.

* The operand bookkeeping: the kernel's conversion (its PTX, emulated here on int32 words with the
  pairing ``pack=2`` gives in its register layouts) followed by its join / reshape / permute chain
  puts the code of dim ``k_column_dims()[c]`` at K column ``c`` and of dim ``v_row_dims()[r]`` at
  V row ``r``, scaled by ``2^(2k-24)`` for the dim's quarter ``k``; the ``movmatrix`` step returns P.
* The compiled INT2 loop (sm_90, offline, through the real launch path): no spills in the loops, no
  shared-memory traffic, shuffles only for the slot ids and the softmax's row reductions, one
  ``movmatrix`` per 8 keys, the expected tensor-core instruction count.

The numbers it computes are checked against the oracle on the GPU (test_kernel_gpu.py, ``gluon``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from kv_fixtures import fresh_seed
from sglang_oscar.kernels.gluon_decode import _k_asm, _v_asm, k_column_dims, v_row_dims
from sglang_oscar.quant.packing import pack_quarter

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _half_values(x32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 tensor of 32-bit patterns -> (low, high) fp16 halves as fp32 values."""
    lo = (x32 & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).float()
    hi = ((x32 >> 16) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).float()
    return lo, hi


def _asm_and_masks(text: str) -> list[tuple[str, int]]:
    """``(source register, mask)`` of each ``and.b32 $o`` line of a conversion, in output order."""
    out = []
    for line in text.splitlines():
        if line.startswith("and.b32 $"):
            _, rest = line.split(" ", 1)
            dst, src, mask = (x.strip(" ;") for x in rest.split(","))
            assert int(dst[1:]) == len(out)
            out.append((src, int(mask, 16)))
    return out


def _join16(outs: list[torch.Tensor]) -> torch.Tensor:
    # gl.join(a, b) == stack on a new last axis; the same tree as gluon_decode._join16
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
    regs = {}
    outs = [torch.zeros(block_n, 8) for _ in range(16)]
    for t in range(4):  # KW layout: a thread's consecutive registers are words 2t, 2t+1 (pack=2)
        regs["$16"], regs["$17"] = words[:, 2 * t], words[:, 2 * t + 1]
        regs["a8"], regs["b8"] = regs["$16"] >> 8, regs["$17"] >> 8
        for o, (src, mask) in enumerate(_asm_and_masks(_k_asm())):
            lo, hi = _half_values(regs[src] & mask)
            outs[o][:, 2 * t], outs[o][:, 2 * t + 1] = lo, hi
    d = _join16(outs)  # [N, 8, b0, b1, b2, b3]
    a = d.reshape(block_n, 4, 2, 2, 2, 2, 2).permute(0, 6, 5, 4, 3, 1, 2).reshape(block_n, 128)
    dims = k_column_dims()
    assert torch.equal(a, codes[:, dims].float() * _quarter_scale(dims))


@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_v_operand_bookkeeping(block_n):
    fresh_seed()
    codes = torch.randint(0, 4, (block_n, 128))
    words = pack_quarter(codes).view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [N tokens, 8]
    outs = [torch.zeros(block_n, 8) for _ in range(16)]
    masks = _asm_and_masks(_v_asm())
    for k in range(0, block_n, 2):  # VW layout: consecutive registers are keys 2t, 2t+1 (pack=2)
        w0, w1 = words[k], words[k + 1]
        b0 = [(w0 >> (8 * i)) & 0xFF for i in range(4)]
        b1 = [(w1 >> (8 * i)) & 0xFF for i in range(4)]
        regs = {"x": b0[0] | b0[1] << 8 | b1[0] << 16 | b1[1] << 24,  # prmt 0x5410
                "y": b0[2] | b0[3] << 8 | b1[2] << 16 | b1[3] << 24}  # prmt 0x7632
        regs["x8"], regs["y8"] = regs["x"] >> 8, regs["y"] >> 8
        for o, (src, mask) in enumerate(masks):
            lo, hi = _half_values(regs[src] & mask)
            outs[o][k], outs[o][k + 1] = lo, hi
    d = _join16(outs)  # [N, 8, b0, b1, b2, b3]
    a = d.permute(5, 4, 3, 2, 1, 0).reshape(128, block_n)
    dims = v_row_dims()
    assert torch.equal(a, codes.t()[dims].float() * _quarter_scale(dims)[:, None])


def test_p_operand_bookkeeping():
    """movmatrix.trans on each 8x8 tile of the accumulator layout, then the kernel's reshape chain,
    gives P back in the B-operand labelling."""
    p = torch.randn(32, 8)
    y = torch.empty_like(p)
    for i in range(4):  # thread (g, t) ends up holding P[8i + 2t + j, g] under the label (8i + g, 2t + j)
        y[8 * i:8 * i + 8] = p[8 * i:8 * i + 8].t()
    z = y.reshape(4, 8, 8).permute(0, 2, 1).reshape(32, 8)
    assert torch.equal(z, p)


@pytest.mark.parametrize("block_n", [16, 32])
def test_gluon_decode_loop_compiles_without_layout_traffic(block_n):
    """sm_90 SASS (compiled through decode_attention's real launch): the INT2 key loop never moves
    operands through shared memory; the HP loop (at most sink + recent keys) may, once per block."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gluon_compile_check.py"), "--decode",
                          "--block-n", str(block_n)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    # at the default 168-register cap ptxas parks 8 bytes outside the loops; nothing spills inside them
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
