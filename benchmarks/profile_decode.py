#!/usr/bin/env python
"""Where a decode step's time goes, kernel by kernel (issue 3): device time of each kernel that
``decode_attention`` launches (stage 1, the merge, ...) from the CUDA profiler, next to the
CUDA-graph cold-L2 time of the whole call (``bench_decode.bench_graph``).

Each point runs ``--reps`` eager calls, every one after a 256 MB L2 flush, under
``torch.profiler`` (CUPTI kernel records: device start / end of every kernel); the table gives the
median device time per kernel and the graph-timed whole call, whose excess over the sum of the
kernels is the gap between launches inside a graph.

    python -m benchmarks.profile_decode --contexts 4096,32768,131072 --batches 1,32 --out $OUT/profile.md
    python -m benchmarks.profile_decode --config triton
    python -m benchmarks.profile_decode --merge     # the merge kernel alone: output dims per program x chunk x warps

``--merge`` times ``launch.decode_merge`` (CUDA-graph cold-L2 timing, launch included) on random
partial outputs for 32 q heads, D_v 128, at (batch, splits) = (1, 205), (1, 40), (8, 73), (32, 24)
(the default split counts of 128K x 1, a short split count at batch 1, batch 8 and batch 32) over a grid of ``block_d``,
``chunk`` and ``num_warps``, and prints the six fastest and the default's time per point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

try:  # python -m benchmarks.<name> (a package), or python benchmarks/<name>.py (its folder on the path)
    from . import bench_decode as bd
except ImportError:
    import bench_decode as bd
from sglang_oscar.kernels.decode.merge import decode_merge, merge_block_d


def merge_grid() -> list:
    """Lines: the fastest merge configurations per (batch, splits) point (see the module doc)."""
    dev = torch.device("cuda")
    lines = []
    for b, ns in ((1, 205), (1, 40), (8, 73), (32, 24)):
        op = torch.randn(b, bd.HQ, ns, bd.D, device=dev)
        lse = torch.randn(b, bd.HQ, ns, device=dev)
        out = torch.empty(b, bd.HQ, bd.D, device=dev, dtype=torch.bfloat16)
        res = []
        for bdim in (16, 32, 64, 128):
            for chunk in (1024, 2048, 4096):
                for w in (1, 2, 4, 8):
                    t = bd.bench_graph(lambda x=bdim, c=chunk, w=w: decode_merge(
                        op, lse, out, ns, block_d=x, chunk=c, num_warps=w)) * 1e3
                    res.append((t, bdim, chunk, w))
        res.sort()
        dflt = bd.bench_graph(lambda: decode_merge(op, lse, out, ns)) * 1e3
        lines.append(f"batch {b}, {ns} splits: default (block_d {merge_block_d(b, bd.HQ, bd.D)}) {dflt:.1f} us; "
                     "fastest " + ", ".join(f"{t:.1f} us (block_d {x}, chunk {c}, {w} warps)" for t, x, c, w in res[:6]))
        print(lines[-1], flush=True)
    return lines


def kernel_times(fn, reps: int) -> dict:
    """``kernel name -> [device time in us per call]`` over ``reps`` calls of ``fn`` (cold L2)."""
    from torch.profiler import ProfilerActivity, profile

    flush = bd._flush_buffer(torch.device("cuda", torch.cuda.current_device()))
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    times: dict = {}
    for ev in prof.events():
        # the L2 flush (zero_ of a 256 MB buffer) is torch's fill kernel: leave it out
        if ev.device_type == torch.autograd.DeviceType.CUDA and "FillFunctor" not in ev.name:
            times.setdefault(ev.name, []).append(ev.device_time)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--config", default="null", help="JSON decode config (bench_decode.parse_config: null = auto, "
                    "\"triton\", \"gluon\" or {\"engine\": ..., field: value})")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--merge", action="store_true", help="time the merge kernel's configurations only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if args.merge:
        text = "\n".join(merge_grid())
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return 0
    device = torch.device("cuda")
    config = bd.parse_config(json.loads(args.config))
    layout = bd.bench_layout()
    lines = [f"config `{bd.config_label(config)}`; {torch.cuda.get_device_name(0)}; median of {args.reps} cold-L2 "
             "calls per kernel (torch.profiler device time); whole call: CUDA-graph time (bench_decode)\n",
             "| ctx | batch | kernel | us | share of the kernels |", "|---:|---:|---|---:|---:|"]
    for ctx in (int(x) for x in args.contexts.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            case = bd.Case(b, ctx, device, layout, with_bf16=False)
            out = torch.empty(b, bd.HQ, bd.D, dtype=torch.bfloat16, device=device)

            def fn(c=case, o=out):
                return c.run_int2(config, out=o)

            times = kernel_times(fn, args.reps)
            med = {k: statistics.median(v) for k, v in times.items()}
            total = sum(med.values())
            for k, v in sorted(med.items(), key=lambda kv: -kv[1]):
                lines.append(f"| {ctx} | {b} | `{k[:60]}` ({len(times[k])} launches) | {v:.1f} | {v / total:.0%} |")
            whole = bd.bench_graph(fn) * 1e3
            lines.append(f"| {ctx} | {b} | **sum of kernels / whole call (graph)** | {total:.1f} / {whole:.1f} | "
                         f"gap {whole - total:.1f} us |")
            print("\n".join(lines[-(len(med) + 1):]), flush=True)
            case = None
            torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
