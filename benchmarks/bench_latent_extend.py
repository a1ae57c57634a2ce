#!/usr/bin/env python
"""MLA extend (prefill) attention over the INT2 latent: the served gather path vs the direct kernel vs BF16.

One layer's extend of one request, ``chunk`` new tokens after ``prefix`` cached ones, absorbed MQA
over ``[c_kv | k_pe]`` (kv_lora_rank 512, rope 64; 16 q heads = DeepSeek-V3 at TP 8, 128 = TP 1):

* ``gather`` -- what the latent backend serves: the prefix and chunk rows dequantized into a BF16
  copy (:func:`sglang_oscar.kernels.latent.gather_latent`), then SGLang's Triton extend kernel;
* ``direct`` -- :func:`sglang_oscar.kernels.latent_extend.latent_extend_attention` over the codes in
  place, per tile setting (``block_t x block_h``, warps);
* ``bf16`` -- SGLang's Triton extend kernel over a BF16 latent pool (the ``triton`` backend's MLA
  extend with a prefix).

Times: CUDA graphs with a cold L2 (``bench_decode.bench``); ratios mean something only within one run.

    python -m benchmarks.bench_latent_extend [--heads 16,128] [--prefixes 0,8192,32768] [--chunks 1024]
        [--tiles 1x16,4x16:8] [--out latent_extend.md]
    TRITON_INTERPRET=1 python -m benchmarks.bench_latent_extend --smoke     # CPU: tiny shapes, each path once
"""

from __future__ import annotations

import argparse
import sys

import torch

try:  # python -m benchmarks.<name> (a package), or python benchmarks/<name>.py (its folder on the path)
    from . import bench_decode as bd
    from .bench_decode_report import emit_row, fmt_ms, write_table
except ImportError:
    import bench_decode as bd
    from bench_decode_report import emit_row, fmt_ms, write_table

from sglang_oscar.kernels.latent import gather_latent
from sglang_oscar.kernels.latent_extend import latent_extend_attention

R, P, G, SINK = 512, 64, 128, 64


def paths(heads: int, prefix: int, chunk: int, tiles: list, device, r=R, p=P, g=G, sink=SINK,
          precision="bf16") -> dict:
    """``{name: fn}`` of one case: random INT2 planes of ``prefix + chunk`` slots in random order,
    BF16 sink rows, BF16 queries; the BF16 pool holds random rows of the same shape."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    n = prefix + chunk
    gen = torch.Generator(device="cpu").manual_seed(0)
    codes = torch.randint(0, 256, (n + 1, r // 4), generator=gen, dtype=torch.uint8).to(device)
    pairs = (torch.rand(n + 1, 2 * r // g, generator=gen) * 0.1).to(torch.float16).to(device)
    k_pe = torch.randn(n + 1, p, generator=gen).to(torch.bfloat16).to(device)
    hp_latent = torch.randn(sink, r, generator=gen).to(torch.bfloat16).to(device)
    hp_pe = torch.randn(sink, p, generator=gen).to(torch.bfloat16).to(device)
    hp_index = torch.arange(sink, dtype=torch.int32).view(1, sink).to(device)
    slots = (torch.randperm(n, generator=gen) + 1).to(torch.int32).to(device)
    r2t, rpi = slots.view(1, n), torch.zeros(1, dtype=torch.int32, device=device)
    qo = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    pre = torch.tensor([prefix], dtype=torch.int32, device=device)
    kv_indptr = torch.tensor([0, prefix], dtype=torch.int32, device=device)
    dt = torch.float32 if precision == "ieee" else torch.bfloat16
    q_abs = torch.randn(chunk, heads, r, generator=gen).to(dt).to(device)
    q_pe = torch.randn(chunk, heads, p, generator=gen).to(dt).to(device)
    qx = torch.cat([q_abs, q_pe], -1)
    scale = (128 + p) ** -0.5
    o = torch.empty(chunk, heads, r, dtype=dt, device=device)
    pos = torch.arange(n, device=device).long()

    def gather():
        rows = gather_latent(codes, pairs, k_pe, slots.long(), group_size=g, quantizer="uniform", out_dtype=dt)
        rows[:sink] = torch.cat([hp_latent, hp_pe], -1).to(dt)  # the sink rows from BF16, as the backend does
        rows = rows.unsqueeze(1)
        k_pre, k_new = rows[:prefix], rows[prefix:]
        extend_attention_fwd(qx, k_new, k_new[..., :r], o, k_pre, k_pre[..., :r], qo, kv_indptr, pos[:prefix], None,
                             True, None, chunk, 1.0, 1.0, scale)

    out = {"gather": gather}
    for bt, bh, warps in tiles:
        def direct(bt=bt, bh=bh, warps=warps):
            latent_extend_attention(q_abs, q_pe, codes, pairs, k_pe, hp_latent, hp_pe, hp_index, r2t, rpi, qo, pre,
                                    group_size=g, quantizer="uniform", sink=sink, sm_scale=scale, max_extend_len=chunk,
                                    out=o, precision=precision, block_t=bt, block_h=bh, num_warps=warps)
        out[f"direct {bt}x{bh}:{warps}"] = direct
    kv = torch.randn(n + 1, 1, r + p, generator=gen).to(dt).to(device)

    def bf16():
        extend_attention_fwd(qx, kv[slots[prefix:].long()], kv[slots[prefix:].long()][..., :r], o, kv, kv[..., :r], qo,
                             kv_indptr, slots[:prefix].long(), None, True, None, chunk, 1.0, 1.0, scale)
    out["bf16"] = bf16
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--prefixes", default="0,8192,32768")
    ap.add_argument("--chunks", default="1024")
    ap.add_argument("--tiles", default="1x16,2x16,4x16:8", help="direct kernel tiles: block_t x block_h[:num_warps]")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, every path once (CPU interpreter)")
    a = ap.parse_args(argv)
    dev = torch.device("cpu" if a.smoke else "cuda")
    tiles = [(int(t.split(":")[0].split("x")[0]), int(t.split(":")[0].split("x")[1]),
              int(t.split(":")[1]) if ":" in t else 4) for t in ("1x16" if a.smoke else a.tiles).split(",")]
    heads = [4] if a.smoke else [int(x) for x in a.heads.split(",")]
    prefixes = [20] if a.smoke else [int(x) for x in a.prefixes.split(",")]
    chunks = [12] if a.smoke else [int(x) for x in a.chunks.split(",")]
    names = ["gather"] + [f"direct {bt}x{bh}:{w}" for bt, bh, w in tiles] + ["bf16"]
    rows = ["| q heads | prefix + chunk | " + " | ".join(names) + " | best direct / gather | best direct / bf16 |",
            "|---:|---|" + "---|" * (len(names) + 2)]
    for h in heads:
        for prefix in prefixes:
            for chunk in chunks:
                kw = dict(r=256, p=32, g=64, sink=4, precision="ieee") if a.smoke else {}
                t = {k: bd.bench(fn, a.smoke) for k, fn in paths(h, prefix, chunk, tiles, dev, **kw).items()}
                best = min(v for k, v in t.items() if k.startswith("direct"))
                emit_row(rows, f"| {h} | {prefix} + {chunk} | " + " | ".join(fmt_ms(t[k]) for k in names)
                         + f" | {best / t['gather']:.2f}x | {best / t['bf16']:.2f}x |", dev)
    write_table(rows, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
