"""Served end to end on real shapes: decode tokens/s, capacity and time to first token of BF16, FP8
and INT2 KV caches (issue 28, item 1).

For every selected model -- dummy weights (``--load-format dummy``) on a folder holding only the
model's ``config.json`` from ``benchmarks/configs/`` -- and every selected KV format this starts one
``python -m sglang.launch_server`` through :mod:`sglang_oscar.serving_launcher` and measures:

* **capacity**: the server's ``max_total_num_tokens`` (``/server_info``, else the scheduler's log
  line) and how many concurrent 128K requests (131072 prompt + ``--decode-tokens`` new tokens) fit;
* **time to first token** (s) of one 8K and one 32K prompt (``--ttft-contexts``), warm idle server
  (warmed by two 2K requests and one prompt of ``--chunked-prefill-size`` tokens);
* **decode tokens/s** at input L x batch B: B concurrent streamed ``/generate`` requests of L random
  token ids (``ignore_eos``, greedy). Throughput = tokens all B requests produce while all B decode
  (from the last request's first token to the first request's last token) / that window (s), so
  the other requests' prefills are excluded. Also per request, as issue 28 words it,
  (output tokens - 1) / (e2e latency - time to first token) (tokens/s; at B > 1 it includes the
  time a request waits while the others prefill).

Why not ``python -m sglang.bench_serving --dataset-name random``: in sglang 0.5.16
(``sglang/benchmark/serving.py``) it always loads a tokenizer (``get_tokenizer`` of ``--tokenizer``
or the model path) and its random dataset encodes and decodes text with it; the dummy checkpoints
have no tokenizer and the servers run ``--skip-tokenizer-init``. So ``/generate`` is driven
directly with ``input_ids`` (stdlib ``urllib``, one thread per request, no proxy).

Servers run **one at a time**, every format with the same ``--mem-fraction-static`` (default 0.85),
so capacities compare like for like: three servers of one model cannot share the GPU at a useful
fraction (three Qwen3-32B servers need 3 x 65.5 GB of weights alone, and at 0.28 each a Qwen3-8B
BF16 pool holds one 128K request), and timings must not overlap. All use ``--attention-backend
triton`` (int2 needs it; BF16/FP8 on triton too, like for like: ``FORMATS`` says why the ``-t64``
formats exist; ``--with-flashinfer`` adds a BF16 FlashInfer server where FlashInfer builds),
``--disable-radix-cache``, decode CUDA graphs up to the largest batch (the
prefill graph is off: it only costs startup time), ``--chunked-prefill-size 8192`` (SGLang's H200
default, pinned so all formats prefill alike) and ``--max-running-requests`` = the largest batch
(int2's BF16 sink/recent windows are reserved per running request).

Budget: ``--budget`` seconds (wall, whole run). The plan gives each model an equal share of what is
left (unused time rolls over to the next model) and picks, cheapest first, the (context, batch)
points whose estimated cost over all formats of the model (prefill FLOPs at ``--lin-tflops`` /
``--attn-tflops``, decode bytes at ``--hbm-tbs``, times ``--est-scale``; a measured prefill
rescales later estimates of that format) fits the share after server startups; every format then
runs the same points, so ratios are complete. A point that does not fit a format's pool is skipped
for that format (estimated pool in the plan, the real ``max_total_num_tokens`` at run time).
SIGTERM (device-call timeout) or the budget running out stops the server and still writes partial
results. ``--dry-run`` prints every server command and the request plan and starts nothing.

Model configs (:mod:`served_models`): the published Hugging Face ``config.json`` values of Qwen3-8B,
Qwen3-32B and Qwen3-30B-A3B (the default ``--models``), except ``max_position_embeddings`` 135168
(published: 40960, 128K via YaRN factor 4): 131072 prompt tokens plus up to 4096 new ones without RoPE
scaling (the RoPE variant does not change the speed); ``--models`` may add the hybrids
``qwen3.5-35b-a3b`` (linear attention: 10 of its 40 layers keep K/V) and ``gpt-oss-20b`` (sliding
windows, served with its recipe's flags: ``served_models.SERVER_ARGS`` / ``INT2_ARGS``). The plan's pool
estimate counts only the full-attention layers' K/V (not SGLang's recurrent-state or sliding pools);
the run reads the real pools.

Output (``--out``): ``results.json`` (every measured value, commands, plan),
``results.md`` (the table printed at the end), ``decode.png`` and ``capacity.png`` (matplotlib,
skipped with a message when missing) and ``logs.tgz`` (one log per server); five files, the device
tool returns at most eight. A model's formats rarely fit one 600 s device call (a server takes
93-161 s to start): run them in two calls and join the ``results.json`` files with ``--merge``
(:mod:`bench_served_report`: one table, ratios against the best BF16 / FP8 server of each cell).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

try:  # python -m benchmarks.bench_served (a package), or the script / its folder on the path
    from .bench_served_report import label, merge, write_outputs
    from .served_models import (ALL_MODELS, CONFIG_DIR, INT2_ARGS, MODELS, SERVER_ARGS,  # noqa: F401
                                Shape, write_model_dir)
except ImportError:
    from bench_served_report import label, merge, write_outputs
    from served_models import (ALL_MODELS, CONFIG_DIR, INT2_ARGS, MODELS, SERVER_ARGS,  # noqa: F401
                               Shape, write_model_dir)

HERE = Path(__file__).resolve().parent
# format -> (--kv-cache-dtype, --attention-backend, bits per stored K/V element in the pool, extra flags).
# SGLang's Triton decode defaults to 8 KV splits (--triton-attention-num-kv-splits), which leaves a
# batch-1 long-context decode on few SMs: the -t64 formats are the same kernels with 64 splits (128K x 1:
# 76 vs 17 tok/s on Qwen3-8B). FlashInfer's sm90 prefill and FA3 do not build or import in the device
# bundle (cutlass headers / sgl_kernel.flash_ops missing), so the Triton formats are the BF16 baselines.
# int2-fold: the value rotation and mean folded into qkv_proj / o_proj at load (two of a layer's four
# rotations gone: docs/design.md).
FORMATS = {"bf16": ("auto", "triton", 16.0, ()), "fp8": ("fp8_e4m3", "triton", 8.0, ()),
           "int2": ("int2", "triton", 2.25, ()),
           "bf16-t64": ("auto", "triton", 16.0, ("--triton-attention-num-kv-splits", "64")),
           "fp8-t64": ("fp8_e4m3", "triton", 8.0, ("--triton-attention-num-kv-splits", "64")),
           "bf16-fi": ("auto", "flashinfer", 16.0, ()), "bf16-fa3": ("auto", "fa3", 16.0, ()),
           "int2-fold": ("int2", "triton", 2.25, ("--oscar-fold-rotations", "on"))}


def is_int2(fmt: str) -> bool:
    """The int2 formats (the plugin's servers: int2 startup JIT, ``--int2-args``, ratios)."""
    return FORMATS[fmt][0] == "int2"


# int2: 2-bit codes + one fp16 (scale, zero) pair per 128-element group = 2.25 bits; the BF16 sink
# (64) + recent (256) windows are separate per-request arenas (docs/design.md).
INT2_WINDOW_TOKENS = 64 + 256
GIB = 1 << 30
# Estimates only (planning; the run measures): server start (imports, dummy init, graph capture),
# the first int2 server's extra (its Triton JIT fits in its measured startup below), FlashInfer JIT (~180 s),
# memory outside the pool besides (1 - fraction), per-step scheduler overhead, warm-up + stop.
# startups measured on the H200 (Qwen3-8B, dummy weights, CUDA graphs to batch 32): the machine's first
# server 161 s, later BF16 / FP8 110 s, int2 93 s with its Triton JIT (2026-12-02)
STARTUP_S, INT2_JIT_S, FI_JIT_S, RESERVE_GIB, STEP_OVERHEAD_S, SERVER_OVERHEAD_S = 115, 0, 180, 2.0, 3e-3, 15
TOKEN_LO, TOKEN_HI = 1000, 150000  # random prompt ids: clear of the special tokens


def size_arg(text: str) -> int:
    """``8k`` / ``128K`` / ``131072`` -> tokens (k = 1024)."""
    t = text.strip().lower()
    return int(t[:-1]) * 1024 if t.endswith("k") else int(t)


def csv(text: str, allowed: Sequence[str] | None = None) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if allowed is not None and x not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
    return items


def add_server_args(p: argparse.ArgumentParser, out: str, work: str, port: int) -> None:
    """The server and output options this script shares with ``bench_prefix`` (defaults: ``out``,
    ``work``, ``port``, the base port; a server's is ``port + 10 x`` its place)."""
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--out", default=out)
    p.add_argument("--work", default=work, help="model folders and server logs")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--server-args", default="", help="extra flags for every server (one shell-quoted string)")
    p.add_argument("--int2-args", default="", help="extra flags for the int2 servers")
    p.add_argument("--startup-timeout", type=float, default=420.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_served", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=lambda s: csv(s, ALL_MODELS), default=list(MODELS),
                   help=f"default {','.join(MODELS)}; also {','.join(m for m in ALL_MODELS if m not in MODELS)}")
    p.add_argument("--formats", type=lambda s: csv(s, tuple(FORMATS)), default=["bf16", "fp8", "int2"])
    p.add_argument("--with-flashinfer", action="store_true", help="add a BF16 server on the flashinfer backend")
    p.add_argument("--contexts", type=lambda s: [size_arg(x) for x in csv(s)], default="8k,32k,128k",
                   help="prompt lengths (tokens; k = 1024)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in csv(s)], default="1,8,32")
    p.add_argument("--ttft-contexts", type=lambda s: [size_arg(x) for x in csv(s)], default="8k,32k")
    p.add_argument("--capacity-context", type=size_arg, default=131072)
    p.add_argument("--decode-tokens", type=int, default=64, help="decode steps wanted with all B requests running")
    p.add_argument("--budget", type=float, default=520.0, help="seconds for the whole run (wall)")
    p.add_argument("--gpu-mem-gib", type=float, default=139.0, help="for the plan's pool estimate only")
    p.add_argument("--lin-tflops", type=float, default=500.0, help="plan: prefill GEMM rate (TFLOP/s)")
    p.add_argument("--attn-tflops", type=float, default=250.0, help="plan: prefill attention rate (TFLOP/s)")
    p.add_argument("--hbm-tbs", type=float, default=3.5, help="plan: decode read bandwidth (TB/s)")
    p.add_argument("--est-scale", type=float, default=1.0, help="plan: multiply every estimated run time")
    p.add_argument("--startup-s", type=float, default=STARTUP_S, help="plan: seconds until a server is healthy")
    p.add_argument("--int2-jit-s", type=float, default=INT2_JIT_S,
                   help="plan: extra startup of the run's first int2 server (Triton JIT; 0 with a warm cache)")
    add_server_args(p, out="bench_served_out", work="/tmp/bench_served_work", port=31000)
    p.add_argument("--dry-run", action="store_true", help="print the commands and the plan, start nothing")
    p.add_argument("--merge", type=csv, default=None,
                   help="comma list of results.json files (runs split over device calls): write one table "
                        "and the plots of all their servers to --out, start nothing")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)  # string defaults go through their type too
    if a.chunked_prefill_size <= 0:  # SGLang's "no chunking": the plan and the warm-up need a chunk
        build_parser().error("--chunked-prefill-size must be a positive token count")
    if a.with_flashinfer and "bf16-fi" not in a.formats:
        a.formats.append("bf16-fi")
    return a


def est_pool_tokens(s: Shape, fmt: str, a: argparse.Namespace) -> int:
    """SGLang sizes the pool as (fraction x GPU memory) - weights - what the model load left used."""
    free = a.mem_fraction_static * a.gpu_mem_gib * GIB - 2 * s.params - RESERVE_GIB * GIB
    if is_int2(fmt):
        free -= max(a.batches) * INT2_WINDOW_TOKENS * s.kv_bytes(FORMATS["bf16"][2])
    return max(0, int(free // s.kv_bytes(FORMATS[fmt][2])))


def est_prefill_s(s: Shape, ctx: int, fmt: str, a: argparse.Namespace) -> float:
    """One prompt: GEMMs 2 x params x L, causal attention 2 x L^2 x q_heads x head_dim per layer;
    int2 x1.3 (its extend path rotates and quantizes the chunk; issue 28 saw 2x on a tiny model)."""
    flops_lin = 2 * s.matmul_params * ctx
    flops_attn = 2 * ctx * ctx * s.q_heads * s.head_dim * s.layers
    t = flops_lin / (a.lin_tflops * 1e12) + flops_attn / (a.attn_tflops * 1e12)
    return t * (1.3 if is_int2(fmt) else 1.0) * a.est_scale


def est_step_s(s: Shape, ctx: int, batch: int, fmt: str, a: argparse.Namespace) -> float:
    """One decode step: weights read (MoE: the expected fraction of experts B tokens touch) + KV."""
    touched = 1 - (1 - s.topk / s.experts) ** batch if s.experts else 1.0
    weights = 2 * (s.params - s.expert_params * (1 - touched))
    return (weights + batch * ctx * s.kv_bytes(FORMATS[fmt][2])) / (a.hbm_tbs * 1e12) * a.est_scale + STEP_OVERHEAD_S


def new_tokens(ctx: int, batch: int, a: argparse.Namespace) -> int:
    """max_new_tokens of a decode point: the wanted steps plus one per prefill iteration of the
    other requests (a running request may decode between them), so the all-decoding window exists."""
    return a.decode_tokens + math.ceil(batch * ctx / a.chunked_prefill_size) + batch


# --------------------------------------------------------------------------------------- plan
@dataclasses.dataclass
class ServerPlan:
    model: str
    fmt: str
    port: int
    argv: list[str]
    model_dir: str
    est_startup_s: float
    est_pool_tokens: int
    items: list[dict] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.model}-{self.fmt}"


def server_argv(a: argparse.Namespace, model_dir: str, fmt: str, port: int, *, max_running: int | None = None,
                radix_cache: bool = False, model: str | None = None) -> list[str]:
    """The server command of format ``fmt`` (module docstring); ``max_running`` (default the largest
    batch) sets ``--max-running-requests`` and the decode graphs' batch; ``radix_cache`` keeps SGLang's
    radix cache on (``bench_prefix``'s shared prefixes), else ``--disable-radix-cache``; ``model`` adds
    its recipe's flags (``served_models.SERVER_ARGS`` / ``INT2_ARGS``) before ``--server-args`` /
    ``--int2-args``."""
    kv, backend, _, extra = FORMATS[fmt]
    top = max_running or max(a.batches)
    argv = [a.python, "-m", "sglang.launch_server", "--model-path", model_dir, "--load-format", "dummy",
            "--dtype", "bfloat16", "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port),
            "--nccl-port", str(port + 5), "--kv-cache-dtype", kv, "--attention-backend", backend,
            "--mem-fraction-static", f"{a.mem_fraction_static:g}", *([] if radix_cache else ["--disable-radix-cache"]),
            "--chunked-prefill-size", str(a.chunked_prefill_size), "--max-running-requests", str(top),
            "--cuda-graph-max-bs-decode", str(top), "--disable-prefill-cuda-graph", "--sampling-backend", "pytorch",
            "--grammar-backend", "none", "--random-seed", "0", "--log-level", "info"]
    own = [*SERVER_ARGS.get(model, ()), *(INT2_ARGS.get(model, ()) if is_int2(fmt) else ())]
    return argv + list(extra) + own + shlex.split(a.server_args) + (shlex.split(a.int2_args) if is_int2(fmt) else [])


def make_plan(a: argparse.Namespace) -> list[ServerPlan]:
    """Servers in run order, each with its items; see the module docstring for the budget rule."""
    plans: list[ServerPlan] = []
    remaining = a.budget
    jit_done: set[str] = set()
    for mi, model in enumerate(a.models):
        shape = Shape.load(model)
        mdir = str(Path(a.work) / model)
        servers = []
        for fi, fmt in enumerate(a.formats):
            port = a.port + 10 * (mi * len(FORMATS) + fi)
            startup = a.startup_s + (a.int2_jit_s if is_int2(fmt) and "int2" not in jit_done else 0) \
                + (FI_JIT_S if fmt == "bf16-fi" and "fi" not in jit_done else 0)
            jit_done |= {"int2"} if is_int2(fmt) else {"fi"} if fmt == "bf16-fi" else set()
            servers.append(ServerPlan(model, fmt, port, server_argv(a, mdir, fmt, port, model=model), mdir, startup,
                                      est_pool_tokens(shape, fmt, a)))
        share = remaining / (len(a.models) - mi)  # equal shares; what a model leaves rolls over
        left = share - sum(s.est_startup_s + SERVER_OVERHEAD_S for s in servers)
        decode = {(c, b) for c in a.contexts for b in a.batches}
        cands = [("ttft", c, 1, 2) for c in a.ttft_contexts if (c, 1) not in decode]
        cands += [("decode", c, b, new_tokens(c, b, a)) for c, b in sorted(decode)]

        def est(s: ServerPlan, c: int, b: int, n: int) -> float:
            return b * est_prefill_s(shape, c, s.fmt, a) + n * est_step_s(shape, c, b, s.fmt, a)

        def fits(s: ServerPlan, c: int, b: int, n: int) -> bool:
            return b * (c + n) <= s.est_pool_tokens

        cost = {x: sum(est(s, *x[1:]) for s in servers if fits(s, *x[1:])) for x in cands}
        cands.sort(key=lambda x: (x[0] != "ttft", cost[x] == 0, cost[x]))  # TTFT, cheapest, fits nowhere
        for x in cands:
            kind, c, b, n = x
            if cost[x] <= left:
                left -= cost[x]
                verdict = "planned"
            else:
                verdict = f"skip: budget (est. {cost[x]:.0f} s over all formats, {max(left, 0):.0f} s left)"
            for s in servers:
                status = verdict if fits(s, c, b, n) else \
                    f"skip: does not fit (est. pool {s.est_pool_tokens} tokens < {b * (c + n)})"
                s.items.append({"kind": kind, "context": c, "batch": b, "new_tokens": n,
                                "est_s": round(est(s, c, b, n), 2), "status": status})
        remaining -= share - left  # startups count even when no point fits (capacity is still measured)
        plans += servers
    return plans


def print_plan(plans: Sequence[ServerPlan], a: argparse.Namespace) -> None:
    total = 0.0
    for p in plans:
        run = [it for it in p.items if it["status"] == "planned"]
        t = p.est_startup_s + SERVER_OVERHEAD_S + sum(it["est_s"] for it in run)
        total += t
        cap = p.est_pool_tokens // (a.capacity_context + a.decode_tokens)
        print(f"# {p.name}: est. startup {p.est_startup_s:.0f} s, pool ~{p.est_pool_tokens} tokens "
              f"(~{cap} x {label(a.capacity_context)}), est. total {t:.0f} s")
        print(f"$ {shlex.join(p.argv)}")
        for it in p.items:
            print(f"    {it['kind']:6s} {label(it['context']):>5s} x {it['batch']:<3d} new {it['new_tokens']:<4d} "
                  f"est {it['est_s']:7.1f} s  {it['status']}")
    print(f"# estimated wall time {total:.0f} s of budget {a.budget:.0f} s "
          f"(models {','.join(a.models)}; formats {','.join(a.formats)})")


# ------------------------------------------------------------------------------------ requests
def random_ids(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(TOKEN_LO, TOKEN_HI), k=n)


def generate_body(ids: list[int], n_new: int) -> dict[str, Any]:
    """``/generate`` body of one request: ``ids`` in, ``n_new`` greedy tokens out, EOS ignored."""
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True}}


def stream_one(url: str, ids: list[int], n_new: int, timeout: float, rec: dict) -> None:
    """One streamed greedy request; ``rec`` gets ``t0`` and ``ticks`` [(perf_counter s, tokens so far)]."""
    from sglang_oscar.serving_launcher import stream_generate

    body = generate_body(ids, n_new)
    rec["t0"], rec["ticks"] = time.perf_counter(), []
    try:
        rec["ticks"].extend(stream_generate(url, body, timeout))
    except Exception as exc:  # noqa: BLE001  reported with the point
        rec["error"] = f"{type(exc).__name__}: {exc}"[:400]


def summarize(recs: Sequence[dict]) -> dict[str, Any]:
    """Throughput over the window where all requests decode; TTFT and per-request speed (s, tokens/s)."""
    first = [r["ticks"][0][0] for r in recs]
    last = [r["ticks"][-1][0] for r in recs]
    ws, we = max(first), min(last)

    def count(r: dict, t: float) -> int:
        return max((n for tt, n in r["ticks"] if tt <= t), default=0)

    tokens = sum(count(r, we) - count(r, ws) for r in recs)
    per_req = [(r["ticks"][-1][1] - r["ticks"][0][1]) / (r["ticks"][-1][0] - r["ticks"][0][0])
               for r in recs if r["ticks"][-1][0] > r["ticks"][0][0]]
    t0 = min(r["t0"] for r in recs)
    out = {"ttft_s": [round(f - r["t0"], 4) for f, r in zip(first, recs)], "prefill_all_s": round(ws - t0, 3),
           "window_s": round(we - ws, 4), "window_steps": round(tokens / len(recs), 1),
           "decode_tok_s": round(tokens / (we - ws), 2) if we > ws and tokens else None,
           "per_request_tok_s": round(sum(per_req) / len(per_req), 2) if per_req else None,
           "completion_tokens": [r["ticks"][-1][1] for r in recs]}
    out["ttft_s_mean"] = round(sum(out["ttft_s"]) / len(recs), 4)
    return out


def measure(url: str, ctx: int, batch: int, n_new: int, deadline: float, seed: int) -> dict[str, Any]:
    recs = [{} for _ in range(batch)]
    ids = [random_ids(ctx, seed * 1000 + i) for i in range(batch)]  # distinct prompts
    timeout = max(10.0, deadline - time.time())
    threads = [threading.Thread(target=stream_one, args=(url, ids[i], n_new, timeout, recs[i]),
                                daemon=True) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.time()))
    if any(t.is_alive() for t in threads):
        return {"status": "timeout", "done": sum(not t.is_alive() for t in threads)}
    errors = [r["error"] for r in recs if "error" in r] + ["no tokens" for r in recs if not r.get("ticks")]
    if errors:
        return {"status": "error", "error": errors[0], "errors": len(errors)}
    res = summarize(recs)
    res["status"] = "ok" if res["window_steps"] >= 0.5 * min(n_new, 64) else "ok (short decode window)"
    return res


# ------------------------------------------------------------------------------------------ run
def server_capacity(srv, a: argparse.Namespace) -> dict[str, Any]:
    from sglang_oscar.serving_launcher import http_json

    tok, src = None, "server_info"
    try:
        tok = http_json(srv.base_url + "/server_info", timeout=30).get("max_total_num_tokens")
    except Exception:  # noqa: BLE001  fall back to the log
        pass
    if tok is None:
        found = re.findall(r"max_total_num_tokens=(\d+)", srv.log_text())
        tok, src = (int(found[-1]) if found else None), "log"
    cap = {label(c): tok // (c + a.decode_tokens) for c in (32768, a.capacity_context)} if tok else {}
    return {"max_total_num_tokens": tok, "source": src, "concurrent": cap}


def measure_points(srv, p: ServerPlan, rec: dict[str, Any], a: argparse.Namespace, t_end: float,
                   scale: dict[str, float]) -> None:
    """One healthy server: capacity, warm-up, then ``p.items`` in order into ``rec["runs"]`` while
    ``t_end`` (wall clock) allows; ``scale`` (per format: measured / estimated prefill) is updated."""
    rec["capacity"] = server_capacity(srv, a)
    print(f"  healthy after {rec['startup_s']} s; capacity {rec['capacity']}", flush=True)
    rec["warmup"] = measure(srv.base_url, 2048, 2, 16, min(t_end, time.time() + 120), seed=7)
    # one full prefill chunk: MoE models JIT-compile their fused expert kernel for each new
    # token-count bucket, which would otherwise land in the first TTFT (1.8 s of 8K on 30B-A3B)
    rec["warmup_chunk"] = measure(srv.base_url, a.chunked_prefill_size, 1, 2,
                                  min(t_end, time.time() + 120), seed=8)
    pool = rec["capacity"].get("max_total_num_tokens")
    stopped = None  # a point that ran past its deadline: the server is still busy with it
    for k, it in enumerate(p.items):
        r = {key: it[key] for key in ("kind", "context", "batch", "new_tokens", "est_s")}
        rec["runs"].append(r)
        c, b, n = it["context"], it["batch"], it["new_tokens"]
        if stopped or it["status"].startswith("skip: budget"):
            r["status"] = stopped or it["status"]
            continue
        if pool is not None and b * (c + n) > pool:
            r["status"] = f"skip: does not fit (pool {pool} tokens < {b * (c + n)})"
            continue
        est = it["est_s"] * scale.get(p.fmt, 1.0)
        left = t_end - time.time() - 10  # keep time to stop the server and write
        if est > left:
            r["status"] = f"skip: budget at run time (est. {est:.0f} s, {left:.0f} s left)"
            continue
        res = measure(srv.base_url, c, b, n, time.time() + min(left, max(60.0, 3 * est)), seed=k + 1)
        r.update(res)
        if res["status"].startswith("ok"):
            guess = b * est_prefill_s(Shape.load(p.model), c, p.fmt, a)
            scale[p.fmt] = max(0.2, res["prefill_all_s"] / guess) if guess > 0.5 else scale.get(p.fmt, 1.0)
        speed = f"decode {res.get('decode_tok_s')} tok/s, " if it["kind"] == "decode" else ""
        print(f"  {it['kind']} {label(c)} x {b}: {res['status']}, {speed}ttft {res.get('ttft_s_mean')} s",
              flush=True)
        if res["status"] == "timeout":
            stopped = f"skip: {label(c)} x {b} timed out before"


def serve_one(rec: dict[str, Any], argv: list[str], port: int, log_path: Path, startup_timeout: float,
              body: Callable[[Any], None], env: dict[str, str] | None = None) -> None:
    """Start one server (``env``: extra environment), run ``body(server)`` once it is healthy and set
    ``rec["status"]`` ("ok", "launch failed" or "error" with ``rec["error"]``; ``rec["startup_s"]`` once
    healthy). The server is stopped whatever happens, SIGTERM's ``SystemExit`` included (that propagates)."""
    from sglang_oscar.serving_launcher import LaunchError, ServerProcess, tail

    srv = ServerProcess(argv, port=port, env=env, log_path=log_path, log_header="$ " + shlex.join(argv))
    try:
        srv.start()
        srv.wait_healthy(timeout=startup_timeout)
        rec["startup_s"] = round(srv.t_ready - srv.t_start, 1)
        body(srv)
        rec["status"] = "ok"
    except LaunchError as exc:
        rec["status"], rec["error"] = "launch failed", str(exc)[-2000:]
    except Exception as exc:  # noqa: BLE001  this server's failure must not end the run
        rec["status"], rec["error"] = "error", f"{type(exc).__name__}: {exc}; log: {tail(srv.log_path, 20)}"
    finally:
        srv.stop(grace=15.0)


def run(a: argparse.Namespace, plans: Sequence[ServerPlan]) -> dict[str, Any]:
    t_end = time.time() + a.budget
    out, logs = Path(a.out), Path(a.work) / "logs"
    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"meta": collect_meta(a), "servers": []}
    scale: dict[str, float] = {}  # measured / estimated prefill time, per format
    for p in plans:
        write_model_dir(p.model, p.model_dir)
    try:
        for p in plans:
            rec: dict[str, Any] = {"name": p.name, "model": p.model, "format": p.fmt, "command": shlex.join(p.argv),
                                   "runs": [], "status": "interrupted"}
            results["servers"].append(rec)
            left = t_end - time.time()
            if left < p.est_startup_s * 0.5 + SERVER_OVERHEAD_S:
                rec["status"] = f"skip: budget ({left:.0f} s left)"
                continue
            print(f"[{time.strftime('%H:%M:%S')}] starting {p.name} ({left:.0f} s left)", flush=True)

            serve_one(rec, p.argv, p.port, logs / f"{p.name}.log", min(a.startup_timeout, max(30.0, left - 20)),
                      lambda srv, p=p, rec=rec: measure_points(srv, p, rec, a, t_end, scale))
    finally:
        results["meta"]["wall_s"] = round(time.time() - (t_end - a.budget), 1)
        results["plan"] = [dataclasses.asdict(p) for p in plans]
        write_outputs(results, a, logs)
    return results


def collect_meta(a: argparse.Namespace) -> dict[str, Any]:
    meta: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv,
                            "args": {k: v for k, v in vars(a).items()}}
    from sglang_oscar.serving_launcher import tree_commit

    meta["commit"] = tree_commit(HERE)
    try:
        meta["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        meta["gpu"] = None
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.merge:
        merge(a.merge, a)
        return 0
    plans = make_plan(a)
    if a.dry_run:
        print_plan(plans, a)
        return 0

    from sglang_oscar.serving_launcher import sigterm_exits

    with sigterm_exits():  # a device-call timeout: stop the server, keep partial results
        results = run(a, plans)
    return 0 if any(s.get("status") == "ok" for s in results["servers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
