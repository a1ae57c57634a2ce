#!/usr/bin/env python
"""MiniMax-M3 sparse-layer decode attention: the INT2 block-sparse kernel vs SGLang's BF16 one, same run.

One sparse layer's main attention per decode step: every (request, kv head) reads ``topk`` key
blocks of ``B`` tokens chosen by the indexer (here: random distinct blocks, always the query's own
last block, the same selection for both kernels). INT2 --
:func:`sglang_oscar.kernels.sparse.block_sparse_attention` over a pool with random codes (uniform
quantizer, fp16 pairs at G 128: the MiniMax-M3 recipe's format) and BF16 sink 64 + recent 256
windows; BF16 -- SGLang's ``flash_decode_with_gqa_share_sparse``
(``kernels/ops/attention/minimax_sparse/decode/topk_sparse.py``), the kernel SGLang 0.5.16 runs for
M3 on an H200 (its MSA path is SM100-only). The indexer's own cost (BF16 index keys, identical in
both servers) is not timed. Bytes read per selected key and kv head: INT2 80 (codes 64 + pairs 16),
BF16 512. Slots are a random permutation (a served pool after some traffic).

Times: CUDA graphs with a cold L2 (``bench_decode.bench_graph``); ratios mean something only within
one run.

    python -m benchmarks.bench_sparse [--heads 8:1,64:8] [--contexts 32768,131072] [--batches 1,8,32]
        [--block-topk 128:16,64:32] [--out sparse.md]
    TRITON_INTERPRET=1 python -m benchmarks.bench_sparse --smoke     # CPU: tiny shapes, the INT2 kernel once
"""

from __future__ import annotations

import argparse
import sys

import torch

try:  # python -m benchmarks.<name> (a package), or python benchmarks/<name>.py (its folder on the path)
    from . import bench_decode as bd
    from .bench_decode_report import emit_row, step_row_cells, write_table
except ImportError:
    import bench_decode as bd
    from bench_decode_report import emit_row, step_row_cells, write_table

from sglang_oscar.config import OscarConfig
from sglang_oscar.kernels.layout import Int2Layout
from sglang_oscar.kernels.sparse import block_sparse_attention

D, G, SINK, RECENT = 128, 128, 64, 256


class SparseCase:
    """Random INT2 + BF16 caches, tables, queries and block selections of ``batch`` requests of ``ctx``
    tokens each (one query per request, at position ``ctx - 1``)."""

    def __init__(self, hq: int, hkv: int, batch: int, ctx: int, block: int, topk: int, device, d=D, g=G,
                 sink=SINK, recent=RECENT):
        self.hq, self.hkv, self.batch, self.ctx, self.block, self.d = hq, hkv, batch, ctx, block, d
        self.sink, self.recent = sink, recent
        self.layout = Int2Layout.from_config(OscarConfig(group_size=g, quantizer="uniform", sink_tokens=sink,
                                                         recent_tokens=recent), d, d)
        gen = torch.Generator(device="cpu").manual_seed(0)
        n = batch * ctx
        codes = lambda: torch.randint(0, 256, (n + 1, hkv, d // 4), generator=gen, dtype=torch.uint8).to(device)
        pairs = lambda: (torch.rand(n + 1, hkv, 2 * d // g, generator=gen) * 0.1).to(torch.float16).to(device)
        rows = batch * (sink + recent)
        hp = lambda: torch.randn(rows, hkv, d, generator=gen).to(torch.bfloat16).to(device)
        self.buffers = (codes(), pairs(), codes(), pairs(), hp(), hp())
        self.hp_index = torch.arange(rows, dtype=torch.int32).view(batch, sink + recent).to(device)
        self.req_to_token = (torch.randperm(n, generator=gen) + 1).to(torch.int32).view(batch, ctx).to(device)
        self.req_pool_indices = torch.arange(batch, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        nblocks = -(-ctx // block)
        if topk > nblocks:
            raise ValueError(f"top-k {topk} > {nblocks} blocks of {block} in a {ctx}-token context")
        # random distinct blocks per (kv head, request), the last (local) block always among them
        sel = torch.stack([torch.stack([torch.cat([torch.tensor([nblocks - 1]),
                                                   torch.randperm(nblocks - 1, generator=gen)[: topk - 1]])
                                        for _ in range(batch)]) for _ in range(hkv)])
        self.blocks = sel.to(torch.int32).to(device)
        self.q = torch.randn(batch, hq, d, generator=gen).to(device)
        self.scale = d ** -0.5

    def int2(self, num_splits: int | None = None):
        out = torch.empty(self.batch, self.hq, self.d, dtype=torch.bfloat16, device=self.q.device)

        def run():
            block_sparse_attention(self.q, self.layout, self.buffers, self.hp_index, self.req_to_token,
                                   self.req_pool_indices, self.seq_lens, self.blocks, block_size=self.block,
                                   sink=self.sink, recent=self.recent, sm_scale=self.scale, num_splits=num_splits,
                                   out=out)
        return run

    def bf16(self) -> dict:
        """SGLang's BF16 sparse decode over ``[slots, H_kv, D]`` K and V caches with the same selection."""
        from sglang.kernels.ops.attention.minimax_sparse.decode.topk_sparse import flash_decode_with_gqa_share_sparse

        dev = self.q.device
        slots = self.buffers[0].shape[0]
        k = torch.randn(slots, self.hkv, self.d, dtype=torch.bfloat16, device=dev)
        v = torch.randn(slots, self.hkv, self.d, dtype=torch.bfloat16, device=dev)
        q = self.q.to(torch.bfloat16)

        def sglang():
            flash_decode_with_gqa_share_sparse(q, None, k, v, self.req_to_token, self.seq_lens, self.req_pool_indices,
                                               self.block, self.blocks, self.scale)
        return {"sglang-minimax-sparse": sglang}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="8:1,64:8", help="q:kv heads per GPU, comma-separated")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--block-topk", default="128:16,64:32", help="sparse_block_size:sparse_topk_blocks pairs")
    ap.add_argument("--splits", type=int, default=0, help="INT2 splits per row (0: kernels.sparse's default)")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, the INT2 kernel once (CPU interpreter)")
    a = ap.parse_args(argv)
    dev = torch.device("cpu" if a.smoke else "cuda")
    heads = [tuple(int(x) for x in h.split(":")) for h in ("4:2" if a.smoke else a.heads).split(",")]
    contexts = [int(x) for x in ("100" if a.smoke else a.contexts).split(",")]
    batches = [int(x) for x in ("2" if a.smoke else a.batches).split(",")]
    block_topk = [tuple(int(x) for x in p.split(":")) for p in ("16:3" if a.smoke else a.block_topk).split(",")]
    rows = ["| q:kv heads | B x top-k | batch x context | INT2 block-sparse | fastest BF16 | INT2 / BF16 time "
            "| BF16 kernels |", "|---|---|---|---|---|---|---|"]
    for hq, hkv in heads:
        for block, topk in block_topk:
            for b in batches:
                for ctx in contexts:
                    kw = dict(d=64, g=32, sink=4, recent=8) if a.smoke else {}
                    case = SparseCase(hq, hkv, b, ctx, block, topk, dev, **kw)
                    t = bd.bench(case.int2(a.splits or None), a.smoke)
                    # SGLang's sparse kernels are autotuned: the interpreter cannot run them
                    bf = {} if a.smoke else {k: bd.bench(fn, False) for k, fn in case.bf16().items()}
                    del case
                    emit_row(rows, f"| {hq}:{hkv} | {block} x {topk} | {b} x {ctx} | {step_row_cells(t, bf)} |", dev)
    write_table(rows, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
