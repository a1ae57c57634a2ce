#!/usr/bin/env python
"""Decode-attention benchmark: OSCAR INT2 kernel vs BF16 (SGLang's Triton decode kernel, torch SDPA).

One layer of Qwen3-8B geometry (32 q heads, 8 kv heads, head_dim 128), contexts 4K..128K,
batch 1/8/32, all measured in the same process:

* ``int2``: :class:`sglang_oscar.kernels.DecodePlan` ``run`` (stage 1 + stage 2, rotated frame),
  default config, plus a small sweep of configs (the best is reported separately, each variant is
  checked against the default's output first);
* ``sglang``: ``sglang.kernels.ops.attention.decode_attention.decode_attention_fwd`` on a BF16
  paged buffer (page size 1, random slot order), best over max_kv_splits in {8, 16, 32, 64}
  (SGLang's default is 8) -- "unavailable" if sglang does not import;
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on dense BF16 K/V with the
  flash backend (``enable_gqa``), falling back to cuDNN, then the efficient backend, if flash
  refuses (the table names the backend that ran);
* ``copy``: device-to-device copy bandwidth, (read + write bytes) / time, measured once.

Achieved bandwidth = bytes the kernel must read (codes + pairs + HP rows + slot tables, or the
BF16 K/V + indices) / time. Also: write kernel (quantize + scatter + HP copy of 32 tokens) time
at batch 32 as a fraction of the INT2 decode step, and a stage-removed variant
(INT2 tier only: sink = recent = 0). Times are GPU times under CUDA graphs with a cold L2 (see
``bench_graph``; ``--timing do_bench`` for triton's do_bench). A case that fails (e.g. OOM) is
reported as such and the run continues. The markdown table is printed last and written to ``--out``.

    python -m benchmarks.bench_decode --out docs/bench_decode.md          # H200, ~4-6 min
    TRITON_INTERPRET=1 python -m benchmarks.bench_decode --smoke          # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
import traceback

import torch

from sglang_oscar.kernels import (
    DecodePlan,
    DecodeWorkspace,
    GluonConfig,
    Int2Layout,
    TritonConfig,
    default_triton_config,
    interpreting,
    write_kv,
)

try:  # python -m benchmarks.bench_decode (a package), or python benchmarks/bench_decode.py (its folder on the path)
    from .bench_decode_report import fmt_ms, render
except ImportError:
    from bench_decode_report import fmt_ms, render

HQ, HKV, D = 32, 8, 128
SINK, RECENT = 64, 256

SWEEP = [  # compared with the default (the Gluon engine where it applies: kernels/decode/gluon_stage1.py)
    TritonConfig,  # the Triton stage 1 with its defaults for the batch
    TritonConfig(num_stages=1, defer_sums=False),  # the best Triton config at 32K x 32 in the sweep
    GluonConfig(maxnreg=None),  # no register cap (172 registers: 11 programs per SM)
    GluonConfig(block_n=16),
]


def config_label(config) -> str:
    """A decode ``config`` for tables: ``auto`` (``None``), ``TritonConfig`` / ``GluonConfig`` (the type:
    that engine's defaults), or an instance with the fields that differ from the dataclass defaults."""
    if config is None:
        return "auto"
    if isinstance(config, type):
        return config.__name__
    changed = [f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
               if getattr(config, f.name) != f.default]
    return f"{type(config).__name__}({', '.join(changed)})"


def parse_config(entry):
    """A decode config from JSON: ``null`` or ``"auto"`` (auto), ``"triton"`` / ``"gluon"`` (the type:
    that engine's defaults for each point), or ``{"engine": "triton" | "gluon", field: value, ...}``
    (an instance; fields not named keep the dataclass defaults, the head_dim-128 decode defaults).

    Raises:
        ValueError: an unknown engine or field, or a field value the config refuses.
    """
    types = {"triton": TritonConfig, "gluon": GluonConfig}
    if entry is None or entry == "auto":
        return None
    if isinstance(entry, str):
        if entry not in types:
            raise ValueError(f"config {entry!r}: use 'auto', 'triton', 'gluon' or an object")
        return types[entry]
    fields = dict(entry)
    engine = fields.pop("engine", None)
    if engine not in types:
        raise ValueError(f"config {entry!r} needs \"engine\": \"triton\" or \"gluon\"")
    try:
        return types[engine](**fields)
    except TypeError as e:  # an unknown field
        raise ValueError(f"config {entry!r}: {e}") from e


# ------------------------------------------------------------------------------------ timing


TIMING = {"mode": "graph"}  # "graph" (CUDA graph, cold L2) or "do_bench"
_FLUSH = {}


def _flush_buffer(device):
    if device not in _FLUSH:
        _FLUSH[device] = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    return _FLUSH[device]


def bench_graph(fn, n: int = 16, trials: int = 7) -> float:
    """GPU time of ``fn`` in ms with a cold L2, without host launch overhead.

    Captures ``n`` x [zero a 256 MB buffer; fn()] and ``n`` x [zero the buffer] in two CUDA
    graphs; time = (median replay time of the first - of the second) / n. This is how a decode
    step runs (graphs; every layer's KV evicted from L2 by the other layers).
    """
    flush = _flush_buffer(torch.device("cuda", torch.cuda.current_device()))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(n):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(g)
    times = []
    for g in graphs:
        ts = []
        for _ in range(trials):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        ts.sort()
        times.append(ts[len(ts) // 2])
    del graphs
    return max(times[0] - times[1], 1e-4) / n


def bench(fn, smoke: bool, rep_ms: int = 60) -> float:
    """Time of ``fn`` in ms: CUDA-graph cold-L2 timing (fallback: triton do_bench); smoke: the wall
    clock of one call (a smoke run checks that every piece runs; its times mean nothing)."""
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    if TIMING["mode"] == "graph":
        try:
            return bench_graph(fn)
        except Exception as e:  # noqa: BLE001
            print(f"[bench] graph timing failed ({type(e).__name__}: {str(e)[:100]}); using do_bench", flush=True)
            torch.cuda.synchronize()
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=15, rep=rep_ms, return_mode="median"))


def copy_bandwidth(device, smoke: bool) -> float:
    """Device-to-device copy, (read + write) bytes / s (1 GiB, so L2 does not matter)."""
    n = (1 << 20) if smoke else (1 << 30)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    if smoke:
        t = bench(lambda: b.copy_(a), smoke)
    else:
        import triton.testing

        t = float(triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=200, return_mode="median"))
    a = b = None  # free
    return 2 * n / (t * 1e-3)


# ------------------------------------------------------------------------------------ setup


def _randn_bf16(shape, device, g):
    """N(0, 0.25) in bf16 without an fp32 temporary of the full size."""
    t = torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16)
    return t.mul_(0.5)


def random_int2_planes(slots: int, heads: int, layout: Int2Layout, device, g) -> tuple:
    """``(k_codes, k_pairs, v_codes, v_pairs)`` of ``slots`` slots x ``heads`` kv heads in ``layout``'s
    shapes, for timing: uniform code bytes, (scale, zero) pairs of realistic size (scale 0.02-0.08,
    zero 0.5-2.5) in the layout's scale dtype, K and V drawn apart."""
    def plane(side):
        codes = torch.randint(0, 256, (slots, heads, side.head_dim // 4), dtype=torch.uint8, device=device, generator=g)
        pairs = torch.empty(slots, heads, 2 * side.num_groups, device=device)
        pairs[..., 0::2].uniform_(0.02, 0.08, generator=g)
        pairs[..., 1::2].uniform_(0.5, 2.5, generator=g)
        return codes, pairs.to(layout.scale_dtype)

    return (*plane(layout.k), *plane(layout.v))


class Case:
    """Buffers of one (batch, context) point: INT2 pool + HP window, BF16 paged pool, dense K/V."""

    def __init__(self, batch: int, ctx: int, device, layout: Int2Layout, with_bf16: bool):
        g = torch.Generator(device=device)
        g.manual_seed(batch * 1_000_003 + ctx)
        self.batch, self.ctx = batch, ctx
        n_tok = batch * ctx
        self.num_slots = n_tok + 64
        self.layout = layout
        # INT2 pool: random bytes, realistic pairs (scale ~ 0.05, zero in [0, 3])
        self.k_codes = torch.randint(0, 256, (self.num_slots, HKV, D // 4), dtype=torch.uint8, device=device,
                                     generator=g)
        self.v_codes = torch.randint(0, 256, (self.num_slots, HKV, D // 4), dtype=torch.uint8, device=device,
                                     generator=g)
        pairs = torch.empty(self.num_slots, HKV, 2, device=device)
        pairs[..., 0].uniform_(0.02, 0.08, generator=g)
        pairs[..., 1].uniform_(0.5, 2.5, generator=g)
        self.k_pairs = pairs.to(layout.scale_dtype)
        pairs[..., 0].uniform_(0.02, 0.08, generator=g)
        self.v_pairs = pairs.to(layout.scale_dtype)
        del pairs
        # slots: a random permutation, so reads are scattered like a real paged pool
        perm = torch.randperm(self.num_slots, device=device, generator=g)[:n_tok].to(torch.int32)
        self.req_to_token = perm.view(batch, ctx).contiguous()
        self.req_pool_indices = torch.arange(batch, device=device, dtype=torch.int64)
        self.seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int64)
        n_hp = SINK + RECENT
        self.hp_k = _randn_bf16((batch * n_hp + 8, HKV, D), device, g)
        self.hp_v = _randn_bf16((batch * n_hp + 8, HKV, D), device, g)
        self.hp_index = torch.arange(batch * n_hp, device=device, dtype=torch.int32).view(batch, n_hp).contiguous()
        self.q = torch.randn(batch, HQ, D, device=device, generator=g).to(torch.bfloat16)
        self.kv_bf16 = None
        self.kv_indices = None
        if with_bf16:
            # BF16 paged pool with the same slot layout (for SGLang) and dense K/V (for SDPA)
            self.k_buf = _randn_bf16((self.num_slots, HKV, D), device, g)
            self.v_buf = _randn_bf16((self.num_slots, HKV, D), device, g)
            self.kv_indptr = torch.arange(0, (batch + 1) * ctx, ctx, device=device, dtype=torch.int32)
            self.kv_indices = self.req_to_token.reshape(-1).to(torch.int64)

    def int2_bytes(self) -> int:
        """Bytes a decode step must read from the INT2 pool + HP window + slot table."""
        sb = self.layout.scale_dtype.itemsize if hasattr(self.layout.scale_dtype, "itemsize") else 2
        n_hp = min(self.ctx, SINK + RECENT)
        n_q = self.ctx - n_hp
        per_tok = HKV * (D // 4 * 2 + 2 * 2 * sb)
        hp = n_hp * HKV * D * 2 * 2
        return self.batch * (n_q * per_tok + n_q * 4 + hp + n_hp * 4)

    def bf16_bytes(self, index_bytes: int) -> int:
        return self.batch * self.ctx * (HKV * D * 2 * 2 + index_bytes)

    def buffers(self) -> tuple:
        """The layer's ``(k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v)``, as ``DecodePlan.run`` takes them."""
        return self.k_codes, self.k_pairs, self.v_codes, self.v_pairs, self.hp_k, self.hp_v

    def plan_int2(self, config=None, num_kv_splits=None, workspace=None, sink=SINK, recent=RECENT) -> DecodePlan:
        """The decode plan of this case (what the server builds once per batch) for a decode ``config``
        (``None``, a config type or instance: :class:`DecodePlan`)."""
        return DecodePlan(self.layout, self.q.shape[1], self.buffers(), self.hp_index, self.req_to_token,
                          self.req_pool_indices, self.seq_lens, sink=sink, recent=recent, q_dtype=self.q.dtype,
                          config=config, num_kv_splits=num_kv_splits, workspace=workspace, max_seq_len=self.ctx,
                          debug=False)

    def run_int2(self, config=None, num_kv_splits=None, workspace=None, out=None, sink=SINK, recent=RECENT):
        """One decode call: plan and run (the plan's checks included; time ``plan_int2().run`` for the
        per-layer cost)."""
        return self.plan_int2(config, num_kv_splits, workspace, sink, recent).run(self.q, *self.buffers(), out=out)


def bench_layout(scale_dtype: str = "float16") -> Int2Layout:
    """The INT2 layout every decode benchmark times (head_dim ``D`` for K and V, one pair per row,
    clip K 0.96 / V 0.92, the published recipe's constants)."""
    return Int2Layout.create(D, D, scale_dtype=scale_dtype, k_clip_ratio=0.96, v_clip_ratio=0.92)


POOL_LAYOUTS = ("random", "served", "served-random", "rows", "sorted", "sorted-hm-pairs", "sorted-hm-all")


def apply_pool_layout(case: Case, mode: str) -> None:
    """Re-lay the case's INT2 pool and slot ids (the BF16 paged pool SGLang's kernel reads takes
    the same slot ids).

    * ``random``: as :class:`Case` builds it: each request's slots a random permutation, codes and
      (scale, zero) pairs in separate slot-major tensors ``[slots, kv heads, ...]``.
    * ``served``: the served pool's storage (``pool.rows.kv_head_major_zeros``: a head-major code
      plane and a head-major pair plane) with each request's slots consecutive, as SGLang's
      allocator hands out a prompt's slots on a fresh server; ``served-random``: the same planes
      with :class:`Case`'s random slots; ``rows``: codes + pairs interleaved in one head-major
      36-byte row per (slot, kv head) (``kv_head_major_zeros`` / ``int2_row_views``, the served layout
      before the planes), consecutive slots.
    * diagnostics (separate tensors, consecutive slots): ``sorted`` (slot-major), ``sorted-hm-pairs``
      (pairs head-major), ``sorted-hm-all`` (codes and pairs head-major).

    Every kernel takes the views' strides, so outputs do not depend on the layout (each caller
    compares its variants with a reference run on the same, re-laid case)."""
    if mode not in POOL_LAYOUTS:
        raise ValueError(f"pool layout {mode!r}: one of {POOL_LAYOUTS}")
    if mode == "random":
        return
    if mode != "served-random":
        n = case.batch * case.ctx
        case.req_to_token = torch.arange(n, dtype=torch.int32, device=case.q.device).view(case.batch, case.ctx)
        if case.kv_indices is not None:
            case.kv_indices = case.req_to_token.reshape(-1).to(torch.int64)
    if mode.startswith("served"):
        from sglang_oscar.pool.rows import kv_head_major_zeros

        for name in ("k_codes", "k_pairs", "v_codes", "v_pairs"):
            t = getattr(case, name)
            plane = kv_head_major_zeros(t.shape[0], t.shape[1], t.shape[2], t.dtype, t.device)
            plane.copy_(t)
            setattr(case, name, plane)
        return
    if mode == "rows":
        from sglang_oscar.pool.rows import int2_row_views, kv_head_major_zeros

        sdt = case.layout.scale_dtype
        for c, pn in (("k_codes", "k_pairs"), ("v_codes", "v_pairs")):
            codes, pairs = getattr(case, c), getattr(case, pn)
            rows = kv_head_major_zeros(codes.shape[0], codes.shape[1],
                                       codes.shape[2] + pairs.shape[2] * pairs.element_size(), torch.uint8, codes.device)
            rc, rp = int2_row_views(rows, codes.shape[2] * 4, sdt)
            rc.copy_(codes)
            rp.copy_(pairs)
            setattr(case, c, rc)
            setattr(case, pn, rp)
        return
    names = {"sorted": (), "sorted-hm-pairs": ("k_pairs", "v_pairs"),
             "sorted-hm-all": ("k_pairs", "v_pairs", "k_codes", "v_codes")}[mode]
    for name in names:
        t = getattr(case, name)
        setattr(case, name, t.transpose(0, 1).contiguous().transpose(0, 1))


def make_sglang(case: Case):
    """Closure running SGLang's Triton BF16 decode kernel, or a string saying why it is unavailable."""
    try:
        try:
            from sglang.kernels.ops.attention.decode_attention import (
                decode_attention_fwd,
            )
        except ImportError:
            from sglang.srt.layers.attention.triton_ops.decode_attention import (
                decode_attention_fwd,
            )
    except Exception as e:  # noqa: BLE001
        return f"unavailable ({type(e).__name__}: {str(e)[:80]})"
    o = torch.empty(case.batch, HQ, D, dtype=torch.bfloat16, device=case.q.device)

    def runner(max_kv_splits):
        logits = torch.empty(case.batch, HQ, max_kv_splits, D, dtype=torch.float32, device=case.q.device)
        lse = torch.empty(case.batch, HQ, max_kv_splits, dtype=torch.float32, device=case.q.device)
        nsplit = torch.full((case.batch,), max_kv_splits, dtype=torch.int32, device=case.q.device)
        return lambda: decode_attention_fwd(case.q, case.k_buf, case.v_buf, o, case.kv_indptr, case.kv_indices,
                                            logits, lse, nsplit, max_kv_splits, 1.0 / math.sqrt(D), 1.0, 1.0)

    return runner


def make_sdpa(case: Case, smoke: bool):
    """Closure for torch SDPA decode on dense BF16 K/V ([B, H_kv, L, D]) and the backend name."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = case.q.device
    g = torch.Generator(device=dev)
    g.manual_seed(7)
    k = _randn_bf16((case.batch, HKV, case.ctx, D), dev, g)
    v = _randn_bf16((case.batch, HKV, case.ctx, D), dev, g)
    q = case.q.view(case.batch, HQ, 1, D)
    backends = [SDPBackend.MATH] if smoke else [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                                SDPBackend.EFFICIENT_ATTENTION]
    for be in backends:
        try:
            with sdpa_kernel(be):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            def fn(be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            return fn, be.name.lower(), (k, v)
        except Exception:  # noqa: BLE001
            continue
    return None, "unavailable", (k, v)


# ------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--json", default=None, help="write all measurements here")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU configuration (TRITON_INTERPRET=1)")
    ap.add_argument("--contexts", default="4096,16384,32768,65536,131072")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--no-sweep", action="store_true", help="only the default INT2 config")
    ap.add_argument("--scale-dtype", default="float16")
    ap.add_argument("--smoke-sglang", action="store_true", help="also run SGLang's kernel in --smoke (slow)")
    ap.add_argument("--pool-layout", default="random", choices=POOL_LAYOUTS,
                    help="INT2 pool storage and slot order (apply_pool_layout); 'served' = the served pool's "
                         "rows with each request's slots consecutive")
    ap.add_argument("--timing", choices=("graph", "do_bench"), default="graph",
                    help="graph: CUDA graphs with a cold L2 (default); do_bench: triton.testing.do_bench")
    args = ap.parse_args(argv)

    smoke = args.smoke
    TIMING["mode"] = args.timing
    if smoke:
        if not interpreting() and not torch.cuda.is_available():
            print("--smoke without CUDA needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        contexts, batches = [352], [1, 2]
        global HQ, HKV
        HQ, HKV = 4, 2  # same code paths, fewer interpreted programs
    else:
        if not torch.cuda.is_available():
            print("no CUDA device (use --smoke with TRITON_INTERPRET=1 on CPU)", file=sys.stderr)
            return 2
        contexts = [int(x) for x in args.contexts.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")
    layout = bench_layout(args.scale_dtype)
    t_start = time.time()
    info = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "pool_layout": args.pool_layout}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        import sglang

        info["sglang"] = sglang.__version__
    except Exception as e:  # noqa: BLE001
        info["sglang"] = f"unavailable ({type(e).__name__})"

    copy_bw = copy_bandwidth(device, smoke)
    print(f"[bench] device={info['device']} copy bandwidth (read+write) = {copy_bw / 1e12:.2f} TB/s", flush=True)
    sweep = [] if (args.no_sweep or smoke) else SWEEP
    default_config = config_label(default_triton_config(layout))
    rows, extra = [], {}
    for ctx in contexts:
        for bsz in batches:
            try:
                t0 = time.time()
                case = Case(bsz, ctx, device, layout, with_bf16=True)
                apply_pool_layout(case, args.pool_layout)
                r = {"ctx": ctx, "batch": bsz}
                ws = DecodeWorkspace(device)
                # built once, run per layer (the server's way); its engine and split count are the defaults
                plan = case.plan_int2(workspace=ws)
                ns = plan.num_kv_splits
                r["engine"] = plan.engine
                out = torch.empty(bsz, HQ, D, dtype=torch.bfloat16, device=device)
                ref = plan.run(case.q, *case.buffers(), out=out).float().clone()
                if not bool(torch.isfinite(ref).all()):
                    raise RuntimeError(f"INT2 decode produced non-finite values at ctx={ctx} batch={bsz}")
                r["int2"] = bench(lambda: plan.run(case.q, *case.buffers(), out=out), smoke)
                r["int2_splits"] = ns
                best, best_cfg = r["int2"], "default"
                r["sweep"] = {}
                for cfg in sweep:
                    key = config_label(cfg)
                    try:
                        o = case.run_int2(config=cfg).float()
                        err = float((o - ref).norm() / ref.norm().clamp_min(1e-30))
                        if not math.isfinite(err) or err > 2e-2:
                            r["sweep"][key] = f"WRONG (rel {err:.1e})"
                            continue
                        t = bench(lambda cfg=cfg: case.run_int2(config=cfg), smoke)
                        r["sweep"][key] = t
                        if t < best:
                            best, best_cfg = t, key
                    except Exception as e:  # noqa: BLE001
                        r["sweep"][key] = f"FAIL {type(e).__name__}: {str(e)[:120]}"
                r["int2_best"], r["int2_best_cfg"] = best, best_cfg
                # stage-removed variants (default config, cheap): INT2 only (no HP window)
                if ctx >= 32768 and bsz in (1, 32):
                    r["int2_no_hp"] = bench(lambda: case.run_int2(num_kv_splits=ns, sink=0, recent=0), smoke)
                # BF16 baselines
                sg = make_sglang(case) if (not smoke or args.smoke_sglang) else "skipped in --smoke"
                if isinstance(sg, str):
                    r["sglang"], r["sglang_note"] = None, sg
                else:
                    times = {}
                    for mks in ((8,) if smoke else (8, 16, 32, 64)):
                        try:
                            times[mks] = bench(sg(mks), smoke)
                        except Exception as e:  # noqa: BLE001
                            r["sglang_note"] = f"failed: {type(e).__name__}: {str(e)[:100]}"
                    if times:
                        mks = min(times, key=times.get)
                        r["sglang"], r["sglang_splits"], r["sglang_default8"] = times[mks], mks, times.get(8)
                    else:
                        r["sglang"] = None
                fn, be, keep = make_sdpa(case, smoke)
                r["sdpa_backend"] = be
                r["sdpa"] = bench(fn, smoke) if fn is not None else None
                fn = None
                del keep
                r["bytes_int2"] = case.int2_bytes()
                r["bytes_sglang"] = case.bf16_bytes(8 + 0)
                r["bytes_sdpa"] = case.bf16_bytes(0)
                bf = [t for t in (r.get("sglang"), r.get("sdpa")) if t]
                r["bf16_best"] = min(bf) if bf else None
                r["ratio"] = (r["bf16_best"] / r["int2_best"]) if r["bf16_best"] else None
                r["ratio_default"] = (r["bf16_best"] / r["int2"]) if r["bf16_best"] else None
                rows.append(r)
                print(f"[bench] ctx={ctx:6d} b={bsz:2d} int2={fmt_ms(r['int2'])} best={fmt_ms(best)} ({best_cfg}) "
                      f"sglang={fmt_ms(r.get('sglang'))} sdpa={fmt_ms(r.get('sdpa'))}[{be}] "
                      f"ratio={r['ratio'] and round(r['ratio'], 2)} ({time.time() - t0:.1f}s)", flush=True)
                # write cost at batch 32 (per layer, one token per request), vs this decode step
                if bsz == max(batches) and ctx == contexts[len(contexts) // 2]:
                    extra.update(write_cost(case, layout, device, smoke, r["int2_best"]))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append({"ctx": ctx, "batch": bsz, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            case = ws = out = ref = None  # free before the next case
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    table = render(rows, extra, copy_bw, info, default_config, time.time() - t_start, smoke,
                   geometry={"hq": HQ, "hkv": HKV, "d": D, "sink": SINK, "recent": RECENT}, timing_mode=TIMING["mode"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "copy_bw": copy_bw, "rows": rows, "extra": extra}, f, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    print(table)
    return 0


def write_cost(case: Case, layout: Int2Layout, device, smoke: bool, decode_ms: float) -> dict:
    """Write (quantize + scatter + HP copy) of one token per request, K and V, one layer."""
    b = case.batch
    g = torch.Generator(device=device)
    g.manual_seed(3)
    k = (torch.randn(b, HKV, D, device=device, generator=g)).to(torch.bfloat16)
    v = (torch.randn(b, HKV, D, device=device, generator=g)).to(torch.bfloat16)
    loc = torch.arange(b, device=device, dtype=torch.int64) * 7
    hp_rows = torch.arange(b, device=device, dtype=torch.int32)
    out = {}
    try:
        out["write_ms"] = bench(lambda: write_kv(k, v, loc, case.k_codes, case.k_pairs, case.v_codes, case.v_pairs,
                                                 layout, hp_rows=hp_rows, hp_k=case.hp_k, hp_v=case.hp_v,
                                                 debug=False, validate=False), smoke)
        # rows per program forced to 1 / 2 / 4 (the default picks fewer rows for small grids)
        for r in (1, 2, 4):
            out[f"write_ms_r{r}"] = bench(lambda r=r: write_kv(
                k, v, loc, case.k_codes, case.k_pairs, case.v_codes, case.v_pairs, layout, hp_rows=hp_rows,
                hp_k=case.hp_k, hp_v=case.hp_v, debug=False, validate=False, rows_per_program=r), smoke)
        out["write_batch"] = b
        out["write_ctx"] = case.ctx
        out["write_frac"] = out["write_ms"] / decode_ms
        out["write_decode_ms"] = decode_ms
    except Exception as e:  # noqa: BLE001
        out["write_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    return out


if __name__ == "__main__":
    sys.exit(main())
