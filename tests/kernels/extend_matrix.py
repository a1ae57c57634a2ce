#!/usr/bin/env python
"""Correctness matrix of the INT2 extend kernel: head_dim x group x quantizer x operand dtype x conversion vs
the oracle.

One line per case with the rel. L2 distance of ``extend_attention``'s output to ``reference_extend`` (the
PyTorch oracle) and ``BAD`` above ``--tol``. The twin of ``decode_matrix.py`` for a failing served extend: it
uses the kernel tests' fixtures, so every case reads exactly what the tests read.

    bash device/kernels.sh xmatrix                               # GPU (~2 min incl. compiles)
    PYTHONPATH=python python tests/kernels/extend_matrix.py --full  # the same with fp32 operands too
    TRITON_INTERPRET=1 python tests/kernels/extend_matrix.py --device cpu --small   # CPU dry run
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from kv_fixtures import build_pool, make_config, reference_extend, rel_l2, rotate_q, run_extend, triton_config  # noqa: E402

from sglang_oscar.kernels.codes import CONVERT_BITS  # noqa: E402
from sglang_oscar.kernels.compile_check import interpreting  # noqa: E402

GEOMETRIES = [  # (dk, dv, hq, hkv, quantizer, group)
    (128, 128, 8, 8, "uniform", 64),
    (192, 128, 8, 8, "uniform", None),
    (192, 128, 8, 8, "uniform", 64),
    (192, 128, 8, 8, "uniform", 32),
    (192, 192, 8, 8, "uniform", 64),
    (128, 192, 8, 8, "uniform", 64),
    (96, 96, 8, 8, "uniform", None),
    (128, 128, 8, 8, "uniform", None),
    (128, 128, 8, 8, "lloyd-max", None),
    (128, 128, 8, 8, "lloyd-max", 64),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="short prompts (CPU interpreter)")
    ap.add_argument("--tol", type=float, default=1e-2)
    ap.add_argument("--full", action="store_true", help="also fp32 operands and the bit-trick conversion")
    a = ap.parse_args()
    prefixes, exts = ([0, 7], [21, 9]) if a.small else ([0, 3000], [700, 300])
    bad = 0
    for dk, dv, hq, hkv, quantizer, group in GEOMETRIES:
        torch.manual_seed(0)
        cfg = make_config(group_size=group, quantizer=quantizer, sink=4, recent=8)
        lens = [p + e for p, e in zip(prefixes, exts)]
        pool = build_pool(lens, hkv, dk, dv, cfg, hp_dtype=torch.bfloat16, window_mode="extend", device=a.device)
        q = torch.randn(sum(exts), hq, dk, device=a.device)
        ref = reference_extend(pool, q, prefixes, exts, counter_rotate=True)
        q_rot = rotate_q(pool, q)
        mmas = (torch.float32, torch.float16, torch.bfloat16) if a.full else (torch.float16, torch.bfloat16)
        for mma in mmas[:-1] if interpreting() else mmas:  # bf16 tl.dot is wrong under the interpreter
            for conv in (None, CONVERT_BITS) if a.full else (None,):
                # the default tiles, 16 x 16 over 4 warps (the interpreter's) and, on a GPU, 64 x 128 over
                # the default warps (a sticky illegal address at 4 would spoil every later case)
                for bn in (None, 16) if interpreting() else (None, 16, 128):
                    ch = {} if conv is None else {"convert": conv}
                    if bn == 16:
                        ch.update(block_n=16, block_m=16, num_warps=4)
                    elif bn == 128:
                        ch.update(block_n=128, block_m=64)
                    name = f"dk {dk} dv {dv} {quantizer} g{group} mma {str(mma)[6:]} conv {conv} bn {bn}"
                    try:
                        o = run_extend(pool, q_rot.to(torch.bfloat16 if mma != torch.float32 else torch.float32),
                                       prefixes, exts, mma_dtype=mma, rotation_v=pool.rot_v, out_dtype=torch.float32,
                                       config=triton_config(pool, extend=True, **ch))
                        err = rel_l2(o.float(), ref.float())
                        rows = (o.float() - ref.float()).flatten(1).norm(dim=1) / ref.float().flatten(1).norm(dim=1)
                        worst = int(rows.argmax())
                        flag = "BAD" if not err < a.tol else "ok"
                        bad += flag == "BAD"
                        print(f"{flag:3s} {name}: {err:.4f} (worst row {worst}: {float(rows[worst]):.3f})", flush=True)
                    except Exception as e:  # noqa: BLE001 -- report every case
                        bad += 1
                        print(f"ERR {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
    print(f"{bad} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
