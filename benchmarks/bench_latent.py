#!/usr/bin/env python
"""MLA decode attention over the packed INT2 latent vs the BF16 latent kernels, same run.

One layer's decode attention of an MLA model (absorbed MQA over ``[c_kv | k_pe]``; DeepSeek-V3 /
GLM-5 / Kimi: kv_lora_rank 512, rope 64) at TP 8 (16 q heads) and TP 1 (128): INT2 --
:func:`sglang_oscar.kernels.latent_plan.latent_decode_attention` over a pool with random codes, fp16
pairs at G 128, BF16 ``k_pe`` and BF16 sink 64 + recent 256 windows; BF16 -- SGLang's Triton MLA
decode (``decode_attention_fwd(..., has_mla=True)``, the ``triton`` backend's kernel) and, where
it runs, FlashInfer's MLA decode (``BatchMLAPagedAttentionWrapper``, page size 1): the fastest BF16
kernel is the baseline. Slots are a random permutation (a served pool after some traffic). Bytes
read per token: INT2 272 (codes 128 + pairs 16 + k_pe 128), BF16 1,152.

Times: CUDA graphs with a cold L2 (``bench_decode.bench_graph``); ratios mean something only within
one run.

    python -m benchmarks.bench_latent [--heads 16,128] [--contexts 4096,32768,131072] [--batches 1,8,32]
        [--variants served,bf16:32:4:16:codes,bf16:32]
        [--out latent.md]
    TRITON_INTERPRET=1 python -m benchmarks.bench_latent --smoke     # CPU: tiny shapes, every piece once
"""

from __future__ import annotations

import argparse
import sys

import torch

try:  # python -m benchmarks.<name> (a package), or python benchmarks/<name>.py (its folder on the path)
    from . import bench_decode as bd
    from .bench_decode_report import emit_row, fmt_ms, step_row_cells, write_table
except ImportError:
    import bench_decode as bd
    from bench_decode_report import emit_row, fmt_ms, step_row_cells, write_table

from sglang_oscar.kernels.latent_plan import latent_decode_attention, latent_decode_tiles, latent_num_splits

R, P, G, SINK, RECENT = 512, 64, 128, 64, 256


class LatentCase:
    """Random latent pool, tables and queries of ``batch`` requests of ``ctx`` tokens each."""

    def __init__(self, heads: int, batch: int, ctx: int, device, r=R, p=P, g=G, sink=SINK, recent=RECENT):
        self.heads, self.batch, self.ctx, self.r, self.p, self.g = heads, batch, ctx, r, p, g
        self.sink, self.recent = sink, recent
        n = batch * ctx
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.codes = torch.randint(0, 256, (n + 1, r // 4), generator=gen, dtype=torch.uint8).to(device)
        pairs = torch.rand(n + 1, 2 * r // g, generator=gen) * 0.1
        self.pairs = pairs.to(torch.float16).to(device)
        self.k_pe = torch.randn(n + 1, p, generator=gen).to(torch.bfloat16).to(device)
        rows = batch * (sink + recent)
        self.hp_latent = torch.randn(rows, r, generator=gen).to(torch.bfloat16).to(device)
        self.hp_pe = torch.randn(rows, p, generator=gen).to(torch.bfloat16).to(device)
        self.hp_index = torch.arange(rows, dtype=torch.int32).view(batch, sink + recent).to(device)
        perm = (torch.randperm(n, generator=gen) + 1).to(torch.int32)
        self.req_to_token = perm.view(batch, ctx).to(device)
        self.req_pool_indices = torch.arange(batch, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.q_abs = torch.randn(batch, heads, r, generator=gen).to(device)
        self.q_pe = torch.randn(batch, heads, p, generator=gen).to(device)
        self.scale = (128 + p) ** -0.5  # DeepSeek-V3: (qk_nope_head_dim + rope)^-0.5

    def int2(self, splits: int, precision: str = "ieee", block_n: int = 16, num_warps: int = 4, block_h: int = 16,
             engine: str = "dequant"):
        out = torch.empty(self.batch, self.heads, self.r, dtype=torch.bfloat16, device=self.q_abs.device)

        def run():
            latent_decode_attention(self.q_abs, self.q_pe, self.codes, self.pairs, self.k_pe, self.hp_latent,
                                    self.hp_pe, self.hp_index, self.req_to_token, self.req_pool_indices,
                                    self.seq_lens, group_size=self.g, quantizer="uniform", sink=self.sink,
                                    recent=self.recent, sm_scale=self.scale, num_splits=splits, out=out,
                                    precision=precision, block_n=block_n, num_warps=num_warps, block_h=block_h,
                                    engine=engine)
        return run

    def bf16(self, smoke: bool) -> dict:
        """BF16 MLA decode kernels over a ``[slots, 1, R + P]`` latent cache (SGLang's layout)."""
        dev = self.q_abs.device
        kv = torch.cat([self.hp_latent.new_zeros(self.codes.shape[0], self.r).normal_(),
                        self.k_pe], dim=-1).unsqueeze(1)
        q = torch.cat([self.q_abs, self.q_pe], dim=-1).to(torch.bfloat16)
        kv_indptr = torch.arange(0, (self.batch + 1) * self.ctx, self.ctx, dtype=torch.int32, device=dev)
        kv_indices = self.req_to_token.reshape(-1)
        out = {}
        try:
            from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        except ImportError:
            decode_attention_fwd = None
        if decode_attention_fwd is not None and kv.numel() < 2**31:  # its offsets are int32
            splits = 8 if self.batch < 16 else 4
            o = torch.empty(self.batch, self.heads, self.r, dtype=torch.bfloat16, device=dev)
            logits = torch.empty(self.batch, self.heads, splits, self.r, dtype=torch.float32, device=dev)
            lse = torch.empty(self.batch, self.heads, splits, dtype=torch.float32, device=dev)
            nsplit = torch.full((self.batch,), splits, dtype=torch.int32, device=dev)

            def sglang():
                decode_attention_fwd(q, kv, kv[..., : self.r], o, kv_indptr, kv_indices, logits, lse, nsplit, splits,
                                     self.scale, 1.0, 1.0, has_mla=True)
            out["sglang-triton-mla"] = sglang
        if not smoke:
            try:
                from flashinfer.mla import BatchMLAPagedAttentionWrapper

                wrapper = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev))
                qo_indptr = torch.arange(self.batch + 1, dtype=torch.int32, device=dev)
                wrapper.plan(qo_indptr, kv_indptr, kv_indices, self.seq_lens, self.heads, self.r, self.p, 1, False,
                             self.scale, torch.bfloat16, torch.bfloat16)
                ckv, kpe = kv[:, :, : self.r].contiguous(), kv[:, :, self.r:].contiguous()
                qn, qp = q[..., : self.r].contiguous(), q[..., self.r:].contiguous()
                wrapper.run(qn, qp, ckv, kpe)

                def flashinfer():
                    wrapper.run(qn, qp, ckv, kpe)
                out["flashinfer-mla"] = flashinfer
            except Exception as exc:  # noqa: BLE001  not built for this GPU / version: reported, not fatal
                print(f"[bench_latent] flashinfer MLA unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16,128", help="q heads per GPU (DeepSeek-V3: 128 / TP)")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--splits", type=int, default=0,
                    help="INT2 kernel splits per request (0: the served policy, kernels.latent_plan.latent_num_splits)")
    ap.add_argument("--variants", default="served",
                    help="INT2 kernel variants to time, comma-separated: served (what the server runs: BF16 dots, the "
                         "codes engine, kernels.latent_plan.latent_decode_tiles of the head count) or "
                         "precision:block_n[:num_warps[:block_h[:engine]]] (precision ieee, tf32 or bf16; 4 warps, "
                         "block_h 16, engine dequant unless given; engine codes: kernels.latent_codes); the first is "
                         "the table's INT2 column, each other one a column")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, every piece once (CPU interpreter)")
    a = ap.parse_args(argv)
    dev = torch.device("cpu" if a.smoke else "cuda")
    heads = [int(x) for x in a.heads.split(",")] if not a.smoke else [4]
    contexts = [int(x) for x in a.contexts.split(",")] if not a.smoke else [48]
    batches = [int(x) for x in a.batches.split(",")] if not a.smoke else [2]
    variants = [("served",) if f == ["served"] else
                (f[0], int(f[1]) if len(f) > 1 else 16, int(f[2]) if len(f) > 2 else 4, int(f[3]) if len(f) > 3 else 16,
                 f[4] if len(f) > 4 else "dequant")
                for f in (v.split(":") for v in ("ieee:16,served" if a.smoke else a.variants).split(","))]

    def resolve(v, h):  # (precision, block_n, num_warps, block_h, engine)
        if v != ("served",):
            return v
        t = latent_decode_tiles(h, "codes")
        return ("ieee" if a.smoke else "bf16", t["block_n"], t["num_warps"], t["block_h"], "codes")

    rows = [f"| q heads | batch x context | INT2 latent ({':'.join(map(str, variants[0]))}) | fastest BF16 | "
            "INT2 / BF16 time | BF16 kernels |" + "".join(f" INT2 {':'.join(map(str, v))} |" for v in variants[1:]),
            "|---:|---|---|---|---|---|" + "---|" * (len(variants) - 1)]
    for h in heads:
        for b in batches:
            for ctx in contexts:
                kw = dict(r=256, p=32, g=64, sink=4, recent=8) if a.smoke else {}  # Lk 288: SGLang MLA shapes
                case = LatentCase(h, b, ctx, dev, **kw)
                times = [bd.bench(case.int2(2 if a.smoke else a.splits or latent_num_splits(b, h, block_h=bh), x, n, w, bh,
                                            e), a.smoke) for x, n, w, bh, e in (resolve(v, h) for v in variants)]
                bf = {k: bd.bench(fn, a.smoke) for k, fn in case.bf16(a.smoke).items()}
                del case
                emit_row(rows, f"| {h} | {b} x {ctx} | {step_row_cells(times[0], bf)} |"
                         + "".join(f" {fmt_ms(t)} |" for t in times[1:]), dev)
    write_table(rows, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
