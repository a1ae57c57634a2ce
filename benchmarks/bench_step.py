#!/usr/bin/env python
"""Where a served decode step's attention time goes, per layer: rotations, cache write, attention.

The served backend (``backend/triton_backend.py``) runs, per layer and decode step: ``q R_k``
(fp32), ``(k - mu_k) R_k`` and ``(v - mu_v) R_v`` (rounded to BF16), the cache write (INT2 codes +
BF16 window copy), decode attention, and the output's counter-rotation ``o R_v^T + mu_v``. This
times each piece and the whole sequence for both ``--oscar-rotate-engine`` values (``torch``:
``kernels.rotate.rotate_heads_reference``, the einsum; ``triton``: ``kernels.rotate.rotate_heads``)
and for ``triton-qkv`` (q, K and V rotated in one launch, ``kernels.rotate.rotate_qkv``, then the
output; ``triton-qkv auto (served)`` with ``block_n="auto"`` is what ``--oscar-rotate-engine triton``
runs in a decode step; the prefill rows' output rotation is IEEE here, TF32x3 in the server's extend
steps of 16-bit models: ``bench_extend_step`` times that), next to the BF16 side (SGLang's
``set_kv_buffer``-style row copy + torch SDPA), on a Qwen3-8B layer geometry (32 q / 8 kv heads, head_dim 128, sink 64 + recent 256), centred rotations.

Times: CUDA graphs with a cold L2 (``bench_decode.bench_graph``). Ratios only mean something
within one run.

    python -m benchmarks.bench_step [--contexts 32768,131072] [--batches 1,32] [--rotate-block-n 16,32]
        [--prefill-tokens 2048,16384] [--out step.md]
    TRITON_INTERPRET=1 python -m benchmarks.bench_step --smoke      # CPU: every piece once, tiny shapes
"""

from __future__ import annotations

import argparse
import sys

import torch

try:  # python -m benchmarks.<name> (a package), or python benchmarks/<name>.py (its folder on the path)
    from . import bench_decode as bd
except ImportError:
    import bench_decode as bd

from sglang_oscar.kernels import write_kv
from sglang_oscar.kernels.rotate import rotate_heads, rotate_heads_reference, rotate_qkv

D, Case, apply_pool_layout, bench, bench_layout, fmt_ms, make_sdpa = (
    bd.D, bd.Case, bd.apply_pool_layout, bd.bench, bd.bench_layout, bd.fmt_ms, bd.make_sdpa)


def rotation_pieces(b: int, dev: torch.device, engine: str, block_n: int | str | None = None):
    """One layer's rotations for ``b`` tokens: ``(rotate_inputs, rotate_output, (q, k, v, o), (rk, rv, mk, mv))``
    with the ``engine`` (``torch`` / ``triton``: four ``rotate_heads`` launches / ``triton-qkv``:
    ``rotate_qkv`` + ``rotate_heads``; ``block_n`` as ``kernels.rotate``)."""
    g = torch.Generator(device=dev)
    g.manual_seed(5)
    rk = torch.linalg.qr(torch.randn(bd.HKV, D, D, device=dev, generator=g))[0].contiguous()
    rv = torch.linalg.qr(torch.randn(bd.HKV, D, D, device=dev, generator=g))[0].contiguous()
    mk = torch.randn(bd.HKV, D, device=dev, generator=g)
    mv = torch.randn(bd.HKV, D, device=dev, generator=g)
    q = torch.randn(b, bd.HQ, D, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(b, bd.HKV, D, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(b, bd.HKV, D, device=dev, generator=g).to(torch.bfloat16)
    o = torch.randn(b, bd.HQ, D, device=dev, generator=g)
    if engine.startswith("triton"):
        def rot(*a, **kw):
            return rotate_heads(*a, block_n=block_n, **kw)
    else:
        rot = rotate_heads_reference

    def rotate_inputs(q=q, k=k, v=v):
        """``(q R_k, (k - mu_k) R_k, (v - mu_v) R_v)``: three launches, or one (``triton-qkv``)."""
        if engine == "triton-qkv":
            return rotate_qkv(q, k, v, rk, rv, torch.bfloat16, mean_k=mk, mean_v=mv, block_n=block_n, validate=False)
        return rot(q, rk, torch.float32), rot(k, rk, torch.bfloat16, sub_mean=mk), rot(v, rv, torch.bfloat16, sub_mean=mv)

    def rotate_output(o=o):
        return rot(o, rv, torch.bfloat16, transpose=True, add_mean=mv)

    return rotate_inputs, rotate_output, (q, k, v, o), (rk, rv, mk, mv)


def step_pieces(case: Case, engine: str, block_n: int | str | None = None):
    """Closures of one layer's decode-step pieces for the rotate ``engine`` (``block_n``: the Triton
    kernels' output dims per program, ``None`` = all, ``"auto"`` = ``kernels.rotate.auto_block_n``,
    the server's choice)."""
    dev = case.q.device
    b = case.batch
    rotate_inputs, rotate_output, (q, k, v, o), (rk, rv, mk, mv) = rotation_pieces(b, dev, engine, block_n)
    loc = torch.arange(b, device=dev, dtype=torch.int64) * 7
    hp_rows = torch.arange(b, device=dev, dtype=torch.int32)
    q_rot = rotate_heads_reference(q, rk, torch.float32)  # attention alone takes the server's fp32 queries

    def rotations():
        rotate_inputs()
        rotate_output()

    def write():
        write_kv(k, v, loc, case.k_codes, case.k_pairs, case.v_codes, case.v_pairs, case.layout, hp_rows=hp_rows,
                 hp_k=case.hp_k, hp_v=case.hp_v, debug=False, validate=False)

    def attention():
        case.q = q_rot
        case.run_int2()

    def step():
        qr, kr, vr = rotate_inputs()
        write_kv(kr, vr, loc, case.k_codes, case.k_pairs, case.v_codes, case.v_pairs, case.layout, hp_rows=hp_rows,
                 hp_k=case.hp_k, hp_v=case.hp_v, debug=False, validate=False)
        case.q = qr  # the plan runs on the rotated fp32 queries as the server's does
        out = case.run_int2()
        rotate_output(out)

    return {"rotations": rotations, "write": write, "attention": attention, "step": step}


def label(engine: str, block_n) -> str:
    """A table row's name: ``triton-qkv auto`` is the server's ``--oscar-rotate-engine triton``."""
    if block_n == "auto":
        return f"{engine} auto (served)"
    return f"{engine}{f' bn={block_n}' if block_n else ''}"


def bf16_step(case: Case, smoke: bool = False):
    """SGLang's BF16 side per layer and step: the new rows copied into the cache, then SDPA decode."""
    fn, be, (kc, vc) = make_sdpa(case, smoke=smoke)
    dev = case.q.device
    b = case.batch
    k = torch.randn(b, bd.HKV, D, device=dev).to(torch.bfloat16)
    v = torch.randn(b, bd.HKV, D, device=dev).to(torch.bfloat16)
    pos = torch.full((b,), case.ctx - 1, device=dev, dtype=torch.int64)
    bi = torch.arange(b, device=dev)

    def write():
        kc[bi, :, pos] = k
        vc[bi, :, pos] = v

    def step():
        write()
        fn()

    return {"write": write, "attention": fn, "step": step}, be


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--rotate-block-n", default="",
                    help="comma-separated block_n values of kernels.rotate (output dims per program) to time as "
                         "extra 'triton bn=N' / 'triton-qkv bn=N' rows (e.g. 16,32,64; the plain rows use all "
                         "output dims per program)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny CPU configuration under TRITON_INTERPRET=1 (wall-clock times, meaningless): runs "
                         "every piece once so CI sees the script work")
    ap.add_argument("--prefill-tokens", default="",
                    help="comma-separated token counts (e.g. 2048,16384) at which to time the rotations alone, "
                         "whole rows vs the server's block_n (a second table; --smoke times 5 tokens instead)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    if smoke:
        if not bd.interpreting():
            print("--smoke needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        bd.HQ, bd.HKV = 4, 2  # the same code paths, fewer interpreted programs
        contexts, batches, dev = [352], [2], torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("bench_step.py needs a CUDA device (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        contexts = [int(c) for c in args.contexts.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
        dev = torch.device("cuda")
    try:
        extra_bn = [int(x) for x in args.rotate_block_n.split(",") if x.strip()]
        if any(bn < 16 or bn & (bn - 1) for bn in extra_bn):
            raise ValueError
    except ValueError:
        print(f"--rotate-block-n must be comma-separated powers of two >= 16, got {args.rotate_block_n!r}",
              file=sys.stderr)
        return 2
    try:
        prefill = [int(x) for x in args.prefill_tokens.split(",") if x.strip()]
        if any(t < 1 for t in prefill):
            raise ValueError
    except ValueError:
        print(f"--prefill-tokens must be comma-separated positive token counts, got {args.prefill_tokens!r}",
              file=sys.stderr)
        return 2
    if smoke and prefill:
        prefill = [5]
    main_rows = [("torch", None), ("triton", None), ("triton-qkv", None), ("triton-qkv", "auto")]  # prefill rows too
    engines = main_rows + [(e, bn) for bn in extra_bn for e in ("triton", "triton-qkv")]
    layout = bench_layout()
    lines = ["| ctx x batch | engine | rotations (q, k, v, o) | write | attention | whole step | BF16 step "
             "(copy + SDPA) | step / BF16 step |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for ctx in contexts:
        for b in batches:
            case = Case(b, ctx, dev, layout, with_bf16=False)
            apply_pool_layout(case, "served")
            bf, be = bf16_step(case, smoke)
            t_bf = bench(bf["step"], smoke)
            q0 = case.q
            for engine, bn in engines:
                case.q = q0
                p = step_pieces(case, engine, bn)
                t = {name: bench(fn, smoke) for name, fn in p.items()}
                case.q = q0
                lines.append(f"| {f'{ctx // 1024}K' if ctx >= 1024 else ctx} x {b} | {label(engine, bn)} | {fmt_ms(t['rotations'])} | {fmt_ms(t['write'])} | "
                             f"{fmt_ms(t['attention'])} | {fmt_ms(t['step'])} | {fmt_ms(t_bf)} ({be}) | "
                             f"{t['step'] / t_bf:.3f} |")
                print(lines[-1], flush=True)
            del case, p, bf
            if not smoke:
                torch.cuda.empty_cache()
    table = "\n".join(lines)
    if prefill:  # the rotations alone at prefill sizes: whole rows vs the server's choice
        plines = ["| tokens | engine | rotations (q, k, v, o) | vs torch |", "|---:|---|---:|---:|"]
        for t_ in prefill:
            base = None
            for engine, bn in main_rows:
                ri, ro, _, _ = rotation_pieces(t_, dev, engine, bn)

                def rotations(ri=ri, ro=ro):
                    ri()
                    ro()
                t = bench(rotations, smoke)
                base = base or t
                plines.append(f"| {t_} | {label(engine, bn)} | {fmt_ms(t)} | {t / base:.3f} |")
                print(plines[-1], flush=True)
        table += "\n\nRotations alone at prefill sizes (tokens of one extend step):\n\n" + "\n".join(plines)
    head = (f"Served decode step per layer (Qwen3-8B layer: {bd.HQ} q / {bd.HKV} kv heads, head_dim {D}, sink 64 + "
            f"recent 256, centred rotations); "
            f"{'cpu (interpreter), SMOKE: times meaningless' if smoke else torch.cuda.get_device_name(0)}, "
            f"torch {torch.__version__}; " + ("wall clock" if smoke else "CUDA graphs, cold L2"))
    if args.out:
        with open(args.out, "w") as f:
            f.write(head + "\n\n" + table + "\n")
    print(head)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
