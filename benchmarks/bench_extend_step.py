#!/usr/bin/env python
"""Where a served prefill (extend) step's attention time goes, per layer: INT2 vs BF16.

One Qwen3-8B layer (32 q / 8 kv heads, head_dim 128, sink 64 + recent 256, group 128, fp16 pairs)
prefilling a chunk of ``chunk`` tokens after ``prefix`` cached ones, one request, as the server runs
it: INT2 -- q / K / V rotated in one launch (``kernels.rotate.rotate_qkv``, IEEE fp32 as served), the
chunk written (``kernels.write_kv``: INT2 codes + BF16 sink copies), :class:`~sglang_oscar.kernels.ExtendPlan`'s
``run`` (window mode "extend": the chunk reads itself through INT2), the output rotated back (TF32x3
as served for a BF16 model; each rotation is also timed at the other precision); BF16 -- the chunk's
rows copied into the cache and SGLang's Triton extend kernel (``extend_attention_fwd``, what
``--attention-backend triton`` runs) over prefix + chunk. Each INT2 piece is also timed alone, so
the step's excess over BF16 splits into rotations, write and attention (issue 28's prefill target:
an 8K prompt's time to first token on Qwen3-8B, docs/benchmarks_served.md; the step's tables:
docs/benchmarks_extend.md).

Times: CUDA graphs with a cold L2 (``bench_decode.bench``); ratios mean something only within one run.

    python -m benchmarks.bench_extend_step [--chunks 8192] [--prefixes 0,24576] [--out extend_step.md]
        [--configs '[{"num_stages": 2}, {"block_m": 128, "num_warps": 8}]']   # extend kernel variants
        [--quantizer lloyd-max]                                               # the layout's quantizer
    TRITON_INTERPRET=1 python -m benchmarks.bench_extend_step --smoke      # CPU: tiny shapes, every piece once
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import torch

try:  # python -m benchmarks.<name> (a package), or python benchmarks/<name>.py (its folder on the path)
    from . import bench_decode as bd
    from .bench_decode_report import emit_row, fmt_ms, write_table
except ImportError:
    import bench_decode as bd
    from bench_decode_report import emit_row, fmt_ms, write_table

from sglang_oscar.kernels import ExtendPlan, default_triton_config, write_kv
from sglang_oscar.kernels.layout import Int2Layout
from sglang_oscar.kernels.rotate import rotate_heads, rotate_qkv

HQ, HKV, D, SINK = 32, 8, 128, 64
# the served extend step's rotation precisions for a BF16 model (backend.triton_backend._output_precision)
QKV_PRECISION, OUT_PRECISION = "ieee", "tf32x3"
SMOKE = dict(HQ=4, HKV=2, D=64, SINK=4)


class ExtendCase:
    """One request's extend of ``chunk`` tokens after ``prefix``: INT2 pool + BF16 pool, random rows."""

    def __init__(self, prefix: int, chunk: int, device, hq=HQ, hkv=HKV, d=D, sink=SINK, quantizer="uniform"):
        g = torch.Generator(device=device)
        g.manual_seed(prefix * 31 + chunk)
        self.hq, self.hkv, self.d, self.sink = hq, hkv, d, sink
        self.layout = Int2Layout.create(d, d, group_size=min(128, d), scale_dtype="float16", k_clip_ratio=0.96,
                                        v_clip_ratio=0.92, quantizer=quantizer)
        n = prefix + chunk
        slots = n + 8
        self.k_codes, self.k_pairs, self.v_codes, self.v_pairs = bd.random_int2_planes(slots, hkv, self.layout,
                                                                                       device, g)
        self.hp_k = torch.randn(sink + 8, hkv, d, device=device, generator=g).to(torch.bfloat16)
        self.hp_v = torch.randn(sink + 8, hkv, d, device=device, generator=g).to(torch.bfloat16)
        self.hp_index = torch.arange(sink, device=device, dtype=torch.int32)[None].contiguous()
        self.req_to_token = (torch.randperm(slots - 1, device=device, generator=g)[:n] + 1).to(torch.int32)[None]
        self.req_pool_indices = torch.zeros(1, device=device, dtype=torch.int64)
        self.prefix_lens = torch.tensor([prefix], device=device, dtype=torch.int64)
        self.chunk_lens = torch.tensor([chunk], device=device, dtype=torch.int64)
        self.qo_indptr = torch.tensor([0, chunk], device=device, dtype=torch.int32)
        self.q = torch.randn(chunk, hq, d, device=device, generator=g).to(torch.bfloat16)
        self.k = torch.randn(chunk, hkv, d, device=device, generator=g).to(torch.bfloat16)
        self.v = torch.randn(chunk, hkv, d, device=device, generator=g).to(torch.bfloat16)
        self.rk = torch.linalg.qr(torch.randn(hkv, d, d, device=device, generator=g))[0].contiguous()
        self.rv = torch.linalg.qr(torch.randn(hkv, d, d, device=device, generator=g))[0].contiguous()
        self.loc = self.req_to_token[0, prefix:].long()
        pos = torch.arange(prefix, n, device=device)
        self.hp_rows = torch.where(pos < sink, pos, -1).to(torch.int32)  # the sink positions' BF16 rows
        self.prefix, self.chunk = prefix, chunk
        # BF16 side: SGLang's pool rows and the prefix's indices
        self.k_buf = torch.randn(slots, hkv, d, device=device, generator=g).to(torch.bfloat16)
        self.v_buf = torch.randn(slots, hkv, d, device=device, generator=g).to(torch.bfloat16)
        self.kv_indptr = torch.tensor([0, prefix], device=device, dtype=torch.int32)
        self.kv_indices = self.req_to_token[0, :prefix].to(torch.int64)

    def buffers(self):
        """The layer's planes in :class:`~sglang_oscar.kernels.ExtendPlan`'s order."""
        return self.k_codes, self.k_pairs, self.v_codes, self.v_pairs, self.hp_k, self.hp_v

    def plan(self, config=None) -> ExtendPlan:
        """The served extend plan (``config``: a :class:`~sglang_oscar.kernels.TritonConfig`, default the
        kernels' own)."""
        return ExtendPlan(self.layout, self.hq, self.chunk, self.buffers(), self.hp_index, self.req_to_token,
                          self.req_pool_indices, self.qo_indptr, self.prefix_lens, self.chunk_lens, sink=self.sink,
                          q_dtype=torch.float32, max_extend_len=self.chunk, out_dtype=torch.float32, config=config)

    def attention_variant(self, config):
        """The extend attention alone with ``config``."""
        plan = self.plan(config)
        q_rot = rotate_qkv(self.q, self.k, self.v, self.rk, self.rv, torch.bfloat16)[0]
        scale = 1.0 / math.sqrt(self.d)
        return lambda: plan.run(q_rot, *self.buffers(), sm_scale=scale)

    def int2_pieces(self) -> dict:
        """Closures of the INT2 step and its pieces (the plan built once, as once per forward)."""
        plan = self.plan()
        scale = 1.0 / math.sqrt(self.d)
        q_rot, k_rot, v_rot = rotate_qkv(self.q, self.k, self.v, self.rk, self.rv, torch.bfloat16)
        o = plan.run(q_rot, *self.buffers(), sm_scale=scale)

        def rot_qkv(precision=QKV_PRECISION):
            rotate_qkv(self.q, self.k, self.v, self.rk, self.rv, torch.bfloat16, precision=precision)

        def rot_out(precision=OUT_PRECISION):
            rotate_heads(o, self.rv, torch.bfloat16, transpose=True, precision=precision)

        def rotations(qkv=QKV_PRECISION, out=OUT_PRECISION):
            rot_qkv(qkv)
            rot_out(out)

        def write():
            write_kv(k_rot, v_rot, self.loc, self.k_codes, self.k_pairs, self.v_codes, self.v_pairs, self.layout,
                     hp_rows=self.hp_rows, hp_k=self.hp_k, hp_v=self.hp_v, validate=False)

        def attention():
            plan.run(q_rot, *self.buffers(), sm_scale=scale)

        def step():
            qr, kr, vr = rotate_qkv(self.q, self.k, self.v, self.rk, self.rv, torch.bfloat16, precision=QKV_PRECISION)
            write_kv(kr, vr, self.loc, self.k_codes, self.k_pairs, self.v_codes, self.v_pairs, self.layout,
                     hp_rows=self.hp_rows, hp_k=self.hp_k, hp_v=self.hp_v, validate=False)
            out = plan.run(qr, *self.buffers(), sm_scale=scale)
            return rotate_heads(out, self.rv, torch.bfloat16, transpose=True, precision=OUT_PRECISION)

        return {"step": step, "rotations": rotations, "rotations_ieee": lambda: rotations("ieee", "ieee"),
                "write": write, "attention": attention, "rot_qkv": rot_qkv, "rot_out": rot_out,
                "rot_qkv_tf32x3": lambda: rot_qkv("tf32x3"), "rot_out_ieee": lambda: rot_out("ieee")}

    def bf16_step(self):
        """SGLang's BF16 extend step (the chunk's rows copied into the pool, then its Triton extend), or
        ``None`` when SGLang's kernel is not importable."""
        try:
            from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
        except ImportError:
            return None
        o = torch.empty(self.chunk, self.hq, self.d, dtype=torch.bfloat16, device=self.q.device)
        scale = 1.0 / math.sqrt(self.d)

        def step():
            self.k_buf[self.loc] = self.k
            self.v_buf[self.loc] = self.v
            extend_attention_fwd(self.q, self.k, self.v, o, self.k_buf, self.v_buf, self.qo_indptr, self.kv_indptr,
                                 self.kv_indices, None, True, None, self.chunk, 1.0, 1.0, scale)

        return step


def main(argv=None) -> int:
    """Time every (chunk, prefix) point and write the table (``--out``); exit status 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="8192")
    ap.add_argument("--prefixes", default="0,24576")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--configs", default="[]",
                    help="JSON list of TritonConfig fields to change from the served extend config: one attention "
                         "column each")
    ap.add_argument("--quantizer", default="uniform", choices=("uniform", "lloyd-max"),
                    help="the INT2 layout's quantizer (the served default is uniform; recipes may set lloyd-max)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, every piece once (CPU interpreter)")
    a = ap.parse_args(argv)
    dev = torch.device("cpu" if a.smoke else "cuda")
    chunks = [16] if a.smoke else [int(x) for x in a.chunks.split(",")]
    prefixes = [0, 8] if a.smoke else [int(x) for x in a.prefixes.split(",")]
    variants = json.loads(a.configs)
    names = [", ".join(f"{k} {v}" for k, v in kw.items()) for kw in variants]
    rows = ["| prefix + chunk | INT2 step | rotations | write | attention | SGLang Triton BF16 step | INT2 / BF16 "
            "| rotations (IEEE fp32) | q/K/V: IEEE (TF32x3) | output: TF32x3 (IEEE) |"
            + "".join(f" attention ({n}) |" for n in names),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(names)]
    for chunk in chunks:
        for prefix in prefixes:
            case = ExtendCase(prefix, chunk, dev, quantizer=a.quantizer,
                              **({k.lower(): v for k, v in SMOKE.items()} if a.smoke else {}))
            t = {name: bd.bench(fn, a.smoke) for name, fn in case.int2_pieces().items()}
            bf = case.bf16_step()
            tb = bd.bench(bf, a.smoke) if bf is not None else None
            ratio = f"{t['step'] / tb:.2f}x" if tb else "-"
            served = default_triton_config(case.layout, extend=True)
            tv = [bd.bench(case.attention_variant(dataclasses.replace(served, **kw)), a.smoke) for kw in variants]
            row = (f"| {prefix} + {chunk} | " + " | ".join(fmt_ms(t[k]) for k in ("step", "rotations", "write",
                                                                                  "attention"))
                   + f" | {fmt_ms(tb) if tb else '-'} | {ratio} | {fmt_ms(t['rotations_ieee'])} | "
                   + f"{fmt_ms(t['rot_qkv'])} ({fmt_ms(t['rot_qkv_tf32x3'])}) | {fmt_ms(t['rot_out'])} "
                   + f"({fmt_ms(t['rot_out_ieee'])}) |"
                   + "".join(f" {fmt_ms(x)} |" for x in tv))
            del case
            emit_row(rows, row, dev)
    write_table(rows, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
