#!/usr/bin/env python
"""Correctness matrix of the INT2 decode kernel: head_dim x quantizer x logit cap x config vs the oracle.

Prints one line per (geometry, config) with the rel. L2 distance of ``decode_attention``'s output
to ``reference_decode`` (the PyTorch oracle) and ``BAD`` above ``--tol`` (the acceptance's 1e-2
for bf16 outputs). Meant for a device call when a GPU test fails without details, or to decide
which conversions a head_dim may default to; it uses the kernel tests' fixtures (poisoned pools at
random non-contiguous slots), so every case reads exactly what the tests read.

    python tests/kernels/decode_matrix.py                       # GPU, default matrix (~3 min incl. compiles)
    TRITON_INTERPRET=1 python tests/kernels/decode_matrix.py --device cpu --scale 0.002 --splits 2  # CPU dry run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # _support (tests/), for kv_fixtures

import torch  # noqa: E402
from sglang_oscar.kernels import choose_num_splits  # noqa: E402
from kv_fixtures import (  # noqa: E402
    build_pool,
    make_config,
    reference_decode,
    rel_l2,
    rotate_q,
    run_decode,
    triton_config,
)

GEOMETRIES = [  # (dk, dv, hq, hkv, quantizer, group, logit cap)
    (64, 64, 16, 4, "lloyd-max", None, 30.0),
    (64, 64, 16, 4, "uniform", None, None),
    (64, 64, 16, 4, "uniform", 16, None),
    (128, 64, 16, 4, "uniform", None, None),  # the smaller of K / V decides the conversion
    (128, 128, 32, 8, "lloyd-max", None, 30.0),
    (128, 128, 32, 8, "uniform", None, None),
    (192, 128, 8, 8, "uniform", None, None),
    (256, 256, 16, 4, "lloyd-max", 128, None),
]
VARIANTS = [  # TritonConfig fields over the head_dim's default_triton_config (None: config=None, auto)
    None,
    {"convert": 5, "pairs_ahead": False},
    {"convert": 5, "pairs_ahead": True},
    {"convert": 3, "pairs_ahead": False},
    {"convert": 3, "pairs_ahead": True},
    {"convert": 2, "pairs_ahead": False},
    {"convert": 1, "pairs_ahead": False},
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=float, default=1.0, help="context lengths x this (CPU dry runs: 0.002)")
    ap.add_argument("--tol", type=float, default=1e-2)
    ap.add_argument("--splits", type=int, default=None,
                    help="KV splits per request (default: the served split policy; CPU dry runs: 2)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.manual_seed(0)
    small = args.scale < 0.1
    sink, recent = (4, 8) if small else (64, 256)
    lens = [max(1, int(x * args.scale)) for x in (30000, 1000)] + [77 if not small else 9]
    rows, bad = [], 0
    for dk, dv, hq, hkv, quantizer, group, cap in GEOMETRIES:
        cfg = make_config(group_size=group, quantizer=quantizer, scale_dtype="float16", sink=sink, recent=recent)
        pool = build_pool(lens, hkv, dk, dv, cfg, hp_dtype=torch.bfloat16, device=args.device)
        q = torch.randn(len(lens), hq, dk, device=args.device)
        ref = reference_decode(pool, q, logit_cap=cap)
        qr = rotate_q(pool, q).to(torch.bfloat16)
        splits = args.splits or choose_num_splits(len(lens), hkv, device=torch.device(args.device),
                                                     max_seq_len=max(lens))
        base = triton_config(pool, pairs=len(lens) * hkv)
        for ch in VARIANTS:
            name = f"dk{dk} dv{dv} {quantizer} g{group} cap{cap} config={json.dumps(ch)}"
            # the deferred sums go with the pair prefetch, as in the defaults
            tn = None if ch is None else dataclasses.replace(base, **ch, defer_sums=base.defer_sums and ch["pairs_ahead"])
            try:
                o = run_decode(pool, qr, config=tn, logit_cap=cap, num_kv_splits=splits, out_dtype=torch.bfloat16,
                               debug=False)
                err = rel_l2(o, ref)
                verdict = "ok" if err < args.tol else "BAD"
            except Exception as e:  # noqa: BLE001 - report and go on with the matrix
                err, verdict = float("nan"), f"ERROR {type(e).__name__}: {e}".splitlines()[0][:160]
                traceback.print_exc(limit=2)
            bad += verdict != "ok"
            rows.append({"case": name, "rel_l2": err, "verdict": verdict})
            print(f"{err:10.3e}  {verdict:4s}  {name}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{bad} of {len(rows)} cases above tol {args.tol} or failing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
