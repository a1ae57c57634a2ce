#!/usr/bin/env python
"""Served decode step of one attention layer of a named geometry, INT2 vs BF16, sliding windows included.

One step of one layer as the server runs it: INT2 -- q / K / V rotated in one launch
(``kernels.rotate.rotate_qkv``), the new row written (INT2 codes + BF16 window copy,
``kernels.write_kv``), the decode plan's ``run`` (window-masked for a sliding layer), the output
rotated back (``rotate_heads``); BF16 -- the new row copied into the cache and SGLang's Triton decode
kernel (the attention backend the server runs) over the keys the layer sees (the last ``window``
positions of a sliding layer), and torch SDPA on dense K/V of the same span where it supports the
head_dim. Geometries (``--layers``): Gemma-4-12B-it's sliding layer (16 q / 8 kv heads x 256, window
1024) and full layer (16 q / 1 kv head x 512), Qwen3-8B's (32 / 8 x 128) for reference, and
``dsv3-expanded``: DeepSeek-V3 at TP 8 stored as expanded MHA (16 heads, K 192 / V 128, group 64;
compare ``bench_latent`` at 16 heads for the latent cache); INT2 as
the recipe serves it (group 128, fp32 pairs for Gemma-4; sink 64 + recent 512 / 256).

Step variants (``--variants``, one row each): ``served`` (the step above), ``fold-out`` (the output
rotation folded into ``o_proj``: ``--oscar-fold-rotations on`` for Gemma-4's layers, whose V keeps its
run-time rotation), ``fold`` (V folded too: q and K rotated in one launch, V written as projected;
Gemma-3, GPT-OSS, Qwen3), ``bk16`` (the served step with the rotations' input steps 16 dims wide: the
step before ``rotate.auto_block_k`` at head_dim >= 256, which took 32 below). Suffixes: ``+hpN`` /
``+kvN`` set the plan's HP / INT2 split counts, ``+bnN`` / ``+wN`` / ``+sN`` its Triton stage 1's
``block_n`` / ``num_warps`` / ``num_stages`` (over :func:`default_triton_config`), ``+perhead`` one
rotation per kv head instead of the recipes' one per layer (e.g. ``fold-out+hp2+bn32+w4``).

Times: CUDA graphs with a cold L2 (``bench_decode.bench_graph``); ratios mean something only within
one run.

    python -m benchmarks.bench_layer_step [--layers gemma4-sliding,gemma4-full] [--contexts 32768]
        [--batches 1,16] [--variants served,fold-out] [--out layer_step.md] [--profile]
    TRITON_INTERPRET=1 python -m benchmarks.bench_layer_step --smoke     # CPU: tiny shapes, every piece once
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import NamedTuple

import torch

try:  # python -m benchmarks.<name> (a package), or python benchmarks/<name>.py (its folder on the path)
    from . import bench_decode as bd
    from .bench_decode_report import emit_row, step_row_cells, write_table
    from .profile_decode import kernel_times
except ImportError:
    import bench_decode as bd
    from bench_decode_report import emit_row, step_row_cells, write_table
    from profile_decode import kernel_times

from sglang_oscar.kernels import DecodePlan, default_triton_config, write_kv
from sglang_oscar.kernels.layout import Int2Layout
from sglang_oscar.kernels.rotate import rotate_heads, rotate_qkv


class LayerShape(NamedTuple):
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    window: int  # keys a query sees (HF convention); 0 = full attention
    group_size: int
    scale_dtype: str
    sink: int
    recent: int
    v_head_dim: int = 0  # 0 = head_dim


LAYERS = {
    "gemma4-sliding": LayerShape(16, 8, 256, 1024, 128, "float32", 64, 512),
    "gemma4-full": LayerShape(16, 1, 512, 0, 128, "float32", 64, 512),
    "qwen3-8b": LayerShape(32, 8, 128, 0, 128, "float16", 64, 256),
    # DeepSeek-V3 at TP 8 stored as expanded MHA (K = [k_nope | k_pe] 192, V 128 per head; group 64, the
    # largest dividing both): the alternative to the latent cache (benchmarks/bench_latent.py, 16 heads)
    "dsv3-expanded": LayerShape(16, 16, 192, 0, 64, "float16", 64, 256, 128),
}
VARIANTS = ("served", "fold-out", "fold", "bk16")
#: ``+<key>N`` step modifiers -> the field they set (splits: DecodePlan; the others: TritonConfig)
MODIFIERS = {"hp": "num_hp_splits", "kv": "num_kv_splits", "bn": "block_n", "w": "num_warps", "s": "num_stages"}
SMOKE = {"gemma4-sliding": LayerShape(4, 2, 64, 24, 32, "float32", 4, 8),
         "gemma4-full": LayerShape(4, 1, 128, 0, 32, "float32", 4, 8),
         "qwen3-8b": LayerShape(4, 2, 64, 0, 64, "float16", 4, 8),
         "dsv3-expanded": LayerShape(4, 4, 96, 0, 32, "float16", 4, 8, 64)}


class LayerCase:
    """One (layer, batch, context) point: INT2 pool + windows, BF16 pool, inputs of one step."""

    def __init__(self, shape: LayerShape, batch: int, ctx: int, device):
        s = shape
        g = torch.Generator(device=device)
        g.manual_seed(batch * 7919 + ctx)
        self.shape, self.batch, self.ctx = s, batch, ctx
        d, h, hq = s.head_dim, s.num_kv_heads, s.num_q_heads
        dv = s.v_head_dim or d
        self.layout = Int2Layout.create(d, dv, group_size=s.group_size, scale_dtype=s.scale_dtype,
                                        k_clip_ratio=0.96, v_clip_ratio=0.92)
        slots = batch * ctx + 64
        self.k_codes, self.k_pairs, self.v_codes, self.v_pairs = bd.random_int2_planes(slots, h, self.layout, device, g)
        perm = torch.randperm(slots - 1, device=device, generator=g)[: batch * ctx].to(torch.int32) + 1
        self.req_to_token = perm.view(batch, ctx).contiguous()
        self.req_pool_indices = torch.arange(batch, device=device, dtype=torch.int64)
        self.seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int64)
        n_hp = s.sink + s.recent
        self.hp_k = torch.randn(batch * n_hp + 8, h, d, device=device, generator=g).to(torch.bfloat16)
        self.hp_v = torch.randn(batch * n_hp + 8, h, dv, device=device, generator=g).to(torch.bfloat16)
        self.hp_index = torch.arange(batch * n_hp, device=device, dtype=torch.int32).view(batch, n_hp).contiguous()
        self.q = torch.randn(batch, hq, d, device=device, generator=g).to(torch.bfloat16)
        self.k_new = torch.randn(batch, h, d, device=device, generator=g).to(torch.bfloat16)
        self.v_new = torch.randn(batch, h, dv, device=device, generator=g).to(torch.bfloat16)
        # per-head rotations ([H_kv, D, D]); the recipes' per-layer one is a broadcast, as the server
        # holds it (backend.rotations: expand, stride 0), so its other heads read R from L2
        self.rk_head = torch.linalg.qr(torch.randn(h, d, d, device=device, generator=g))[0].contiguous()
        self.rv_head = torch.linalg.qr(torch.randn(h, dv, dv, device=device, generator=g))[0].contiguous()
        self.rk_layer, self.rv_layer = self.rk_head[:1].expand(h, d, d), self.rv_head[:1].expand(h, dv, dv)
        self.loc = self.req_to_token[:, -1].long()
        self.hp_rows = self.hp_index[:, s.sink].contiguous()
        # BF16 side: the pool rows of the keys the layer sees (the window of a sliding layer)
        span = min(ctx, s.window) if s.window else ctx
        self.span = span
        self.k_buf = torch.randn(slots, h, d, device=device, generator=g).to(torch.bfloat16)
        self.v_buf = torch.randn(slots, h, dv, device=device, generator=g).to(torch.bfloat16)
        self.kv_indptr = torch.arange(0, (batch + 1) * span, span, device=device, dtype=torch.int32)
        self.kv_indices = self.req_to_token[:, ctx - span:].reshape(-1).to(torch.int64)

    def buffers(self):
        return self.k_codes, self.k_pairs, self.v_codes, self.v_pairs, self.hp_k, self.hp_v

    def int2_step(self, variant: str = "served"):
        """The INT2 step's closure for a ``--variants`` entry (the plan is built once, as once per batch
        in the server)."""
        s = self.shape
        variant, *mods = variant.split("+")
        if variant not in VARIANTS:
            raise ValueError(f"unknown step variant {variant!r}; choose from {sorted(VARIANTS)}")
        opts = {}
        for m in mods:
            key = m.rstrip("0123456789")
            if m == "perhead":
                opts[m] = True
            elif key in MODIFIERS and m[len(key):].isdigit():
                opts[key] = int(m[len(key):])
            else:
                raise ValueError(f"unknown step modifier {m!r}: use +hpN, +kvN, +bnN, +wN, +sN or +perhead")
        cfg = None
        if any(k in opts for k in ("bn", "w", "s")):
            pairs = self.batch * s.num_kv_heads
            cfg = dataclasses.replace(default_triton_config(self.layout, pairs=pairs),
                                      **{MODIFIERS[k]: opts[k] for k in ("bn", "w", "s") if k in opts})
        fold_v, fold_out = variant == "fold", variant in ("fold", "fold-out")
        # a folded output leaves the merge in the model dtype, as the backend plans it
        plan = DecodePlan(self.layout, s.num_q_heads, self.buffers(), self.hp_index, self.req_to_token,
                          self.req_pool_indices, self.seq_lens, sink=s.sink, recent=s.recent, q_dtype=torch.float32,
                          sliding_window=s.window or None, out_dtype=torch.bfloat16 if fold_out else torch.float32,
                          max_seq_len=self.ctx, num_hp_splits=opts.get("hp"), num_kv_splits=opts.get("kv"),
                          config=cfg)
        cfg = plan.config
        self.plan_summary = (f"engine {plan.engine}, splits {plan.num_hp_splits} BF16 + {plan.num_kv_splits} INT2, "
                             f"grid {plan.grid}" + (f", block_n {cfg.block_n}, {cfg.num_warps} warps, "
                                                    f"{cfg.num_stages} stages" if plan.engine == "triton" else ""))
        scale = 1.0 / math.sqrt(s.head_dim)
        bk = 16 if variant == "bk16" else "auto"
        rk, rv = (self.rk_head, self.rv_head) if opts.get("perhead") else (self.rk_layer, self.rv_layer)

        def step():
            if fold_v:  # V comes out of the folded projection rotated: cast only
                qr, kr, _ = rotate_qkv(self.q, self.k_new, None, rk, None, torch.bfloat16, block_k=bk)
                vr = self.v_new
            else:
                qr, kr, vr = rotate_qkv(self.q, self.k_new, self.v_new, rk, rv, torch.bfloat16, block_k=bk)
            write_kv(kr, vr, self.loc, self.k_codes, self.k_pairs, self.v_codes, self.v_pairs, self.layout,
                     hp_rows=self.hp_rows, hp_k=self.hp_k, hp_v=self.hp_v, validate=False)
            o = plan.run(qr, *self.buffers(), sm_scale=scale)
            if fold_out:  # o_proj reads the rotated frame: the merge wrote the model dtype
                return o
            return rotate_heads(o, rv, torch.bfloat16, transpose=True, block_k=bk)

        return step

    def bf16_steps(self, smoke: bool) -> dict:
        """SGLang's Triton decode (and SDPA where it runs) with the new row's copy, per layer and step."""
        s = self.shape
        out = {}
        bi = torch.arange(self.batch, device=self.q.device)

        def write():
            self.k_buf[self.loc] = self.k_new
            self.v_buf[self.loc] = self.v_new

        try:
            from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        except ImportError:
            try:
                from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd
            except ImportError:
                decode_attention_fwd = None
        # SGLang's decode kernel with K / V dims that differ does not run under the interpreter (its
        # BF16 path needs get_bf16, which the interpreter's builder lacks): smoke runs skip it there
        if decode_attention_fwd is not None and not (smoke and s.v_head_dim):
            splits = 8 if self.batch < 16 else 4
            dv = s.v_head_dim or s.head_dim
            o = torch.empty(self.batch, s.num_q_heads, dv, dtype=torch.bfloat16, device=self.q.device)
            logits = torch.empty(self.batch, s.num_q_heads, splits, dv, dtype=torch.float32,
                                 device=self.q.device)
            lse = torch.empty(self.batch, s.num_q_heads, splits, dtype=torch.float32, device=self.q.device)
            nsplit = torch.full((self.batch,), splits, dtype=torch.int32, device=self.q.device)

            def sglang():
                write()
                decode_attention_fwd(self.q, self.k_buf, self.v_buf, o, self.kv_indptr, self.kv_indices, logits,
                                     lse, nsplit, splits, 1.0 / math.sqrt(s.head_dim), 1.0, 1.0)

            out["sglang-triton"] = sglang
        if not smoke:
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kd = self.k_buf[self.kv_indices].view(self.batch, self.span, s.num_kv_heads, s.head_dim).transpose(1, 2)
            vd = self.v_buf[self.kv_indices].view(self.batch, self.span, s.num_kv_heads,
                                                  s.v_head_dim or s.head_dim).transpose(1, 2)
            q = self.q.view(self.batch, s.num_q_heads, 1, s.head_dim)
            for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
                try:
                    with sdpa_kernel(be):
                        F.scaled_dot_product_attention(q, kd, vd, enable_gqa=True)
                except Exception:  # noqa: BLE001  this backend does not take the shape
                    continue

                def sdpa(be=be):
                    kd[bi, :, -1] = self.k_new
                    vd[bi, :, -1] = self.v_new
                    with sdpa_kernel(be):
                        return F.scaled_dot_product_attention(q, kd, vd, enable_gqa=True)

                out[f"sdpa-{be.name.lower()}"] = sdpa
                break
        return out


def profile_kernels(fn, reps: int = 20) -> str:
    """Mean device time per kernel name of one ``fn()`` call (``profile_decode.kernel_times``: cold L2,
    the flush left out)."""
    times = kernel_times(fn, reps)
    return "; ".join(f"{n[:48]} {sum(t) / reps:.1f} us" for n, t in sorted(times.items(), key=lambda x: -sum(x[1])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="gemma4-sliding,gemma4-full", help=f"comma list of {sorted(LAYERS)}")
    ap.add_argument("--contexts", default="32768")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, every piece once (CPU interpreter)")
    ap.add_argument("--profile", action="store_true", help="also print the INT2 step's device time per kernel")
    ap.add_argument("--variants", default="served", help=f"comma list of INT2 steps, one row each: {VARIANTS}")
    a = ap.parse_args(argv)
    dev = torch.device("cpu" if a.smoke else "cuda")
    table = LAYERS if not a.smoke else SMOKE
    contexts = [int(x) for x in a.contexts.split(",")] if not a.smoke else [64]
    batches = [int(x) for x in a.batches.split(",")] if not a.smoke else [2]
    rows = ["| layer | batch x context | INT2 step | fastest BF16 step | INT2 / BF16 | BF16 kernels |",
            "|---|---|---|---|---|---|"]
    for name in a.layers.split(","):
        shape = table[name]
        for b in batches:
            for ctx in contexts:
                case = LayerCase(shape, b, ctx, dev)
                bf = {k: bd.bench(fn, a.smoke) for k, fn in case.bf16_steps(a.smoke).items()}
                dims = f"{shape.head_dim}/{shape.v_head_dim}" if shape.v_head_dim else f"{shape.head_dim}"
                for variant in a.variants.split(","):
                    int2 = bd.bench(case.int2_step(variant), a.smoke)
                    label = "" if variant == "served" else f", {variant}"
                    row = (f"| {name} ({shape.num_q_heads}/{shape.num_kv_heads} x {dims}"
                           f"{f', window {shape.window}' if shape.window else ''}{label}) | {b} x {ctx} | "
                           f"{step_row_cells(int2, bf)} |")
                    summary = f"    INT2 plan: {case.plan_summary}"
                    if a.profile and dev.type == "cuda":
                        summary += f"\n    INT2 kernels: {profile_kernels(case.int2_step(variant))}"
                    emit_row(rows, row, dev)
                    print(summary, flush=True)
                del case
    write_table(rows, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
