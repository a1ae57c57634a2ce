"""Decode throughput with the KV pool full of long requests, per KV format (issue 28: "throughput
with the pool full at 32K and 128K", int2 >= 4x BF16's at 128K).

For every selected format (``bench_served``'s ``FORMATS`` and server settings) this starts one
``python -m sglang.launch_server`` on a dummy-weight checkpoint of a real ``config.json`` and, for
every ``--contexts`` length L, sends as many concurrent requests of L random prompt tokens as its
pool holds (``max_total_num_tokens`` from the running server: the largest B with B x (L + new)
<= 0.99 x pool, ``new`` = 2 x ``--decode-tokens`` + B: SGLang runs every waiting prefill before a
decode step, so the B requests start decoding together once the last prefill is done), then reports
the decode tokens/s of all B requests while all decode (``bench_served.measure``).
``--max-running-requests`` (and the decode CUDA graphs) are sized from the plan's pool estimate.

Filling int2's pool of Qwen3-8B with 128K prompts (39 of them) costs ~13 minutes of prefill, mostly
causal-attention FLOPs, past one device call. By default the servers load the benchmark-only
plugin :mod:`fill_shim` (``OSCAR_BENCH_FAST_FILL=1``), whose prefill attention writes zeros instead
of attending: every prompt token's K / V rows are still projected, (for int2) rotated, quantized and
written, so the measured decode steps read a pool of the real size and layout; the prompt values
differ, which the decode time of a dense model does not depend on (not for MoE models: routing
depends on values; the script refuses them with the shim). ``--real-prefill`` runs the full prefill.
TTFT is therefore not measured here (``bench_served`` does). The shim marks a file when its zero fill
runs; a server whose warm-up prefill left no mark is stopped before its fill (a real prefill of the
whole pool would take the rest of the call).

Output (``--out``): ``results.json`` (every value, commands), ``results.md`` (the table: one row per
format and context, then int2 / best BF16 per context) and ``logs.tgz``. ``--merge a.json,b.json``
joins runs of several device calls into one table. ``--dry-run`` prints the commands and the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Sequence

try:  # python -m benchmarks.bench_full_pool (a package), or the script / its folder on the path
    from . import bench_served as bs
    from .fill_shim import FILL_ENTRY, FILL_ENV, MARKER_ENV, write_fill_shim
except ImportError:
    import bench_served as bs
    from fill_shim import FILL_ENTRY, FILL_ENV, MARKER_ENV, write_fill_shim

# SGLang admits a request with ignore_eos only if its prompt plus all max_new_tokens (and one token) fit
# beside the running ones' reservations; 1% of the pool is slack for what that count leaves out
FILL_FRACTION = 0.99


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_full_pool", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=bs.MODELS, default="qwen3-8b")
    p.add_argument("--formats", type=lambda s: bs.csv(s, tuple(bs.FORMATS)), default=["bf16-t64", "int2-fold"])
    p.add_argument("--contexts", type=lambda s: [bs.size_arg(x) for x in bs.csv(s)], default="128k",
                   help="prompt lengths (tokens; k = 1024), each run with the pool full")
    p.add_argument("--decode-tokens", type=int, default=64, help="decode steps wanted with all B requests running")
    p.add_argument("--max-requests", type=int, default=None, help="cap on B (default: what the pool holds)")
    p.add_argument("--real-prefill", action="store_true", help="fill with the real prefill (no fill_shim)")
    p.add_argument("--gpu-mem-gib", type=float, default=139.0, help="for the plan's pool estimate only")
    bs.add_server_args(p, out="bench_full_pool_out", work="/tmp/bench_full_pool_work", port=32000)
    p.add_argument("--budget", type=float, default=560.0, help="seconds for the whole run (wall)")
    p.add_argument("--dry-run", action="store_true", help="print the server commands and the plan, start nothing")
    p.add_argument("--merge", type=bs.csv, default=None, help="comma list of results.json files: one table to --out")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if not a.merge and (not a.contexts or min(a.contexts) <= 0):
        p.error("--contexts needs one or more positive token counts")
    if a.max_requests is not None and a.max_requests < 1:
        p.error("--max-requests must be at least 1")
    if a.chunked_prefill_size <= 0:
        p.error("--chunked-prefill-size must be a positive token count")
    return a


def new_tokens(b: int, a: argparse.Namespace) -> int:
    """max_new_tokens of each of B requests: ``2 x --decode-tokens + B`` (module docstring)."""
    return 2 * a.decode_tokens + b


def requests_that_fit(pool_tokens: int, ctx: int, a: argparse.Namespace, cap: int | None = None) -> int:
    """The largest B (<= ``cap``) with B x (ctx + :func:`new_tokens`) <= 0.99 x pool."""
    b = int(FILL_FRACTION * pool_tokens // ctx)
    if cap is not None:
        b = min(b, cap)
    while b > 0 and b * (ctx + new_tokens(b, a)) > FILL_FRACTION * pool_tokens:
        b -= 1
    return b


def est_pool(shape: "bs.Shape", fmt: str, a: argparse.Namespace, running: int) -> int:
    """``bench_served``'s pool estimate with ``running`` requests' BF16 windows reserved (int2)."""
    return bs.est_pool_tokens(shape, fmt, argparse.Namespace(**{**vars(a), "batches": [running]}))


def max_running(shape: "bs.Shape", fmt: str, a: argparse.Namespace) -> int:
    """``--max-running-requests`` of a format's server: 10% + 2 above the estimated fill of the shortest
    context (the real pool decides B; int2's BF16 windows are reserved per running request)."""
    if a.max_requests is not None:
        return a.max_requests
    return int(requests_that_fit(est_pool(shape, fmt, a, 64), min(a.contexts), a) * 1.1) + 2


def server_env(a: argparse.Namespace) -> dict[str, str]:
    """The fill shim's folder (written once here) first on PYTHONPATH, ``OSCAR_BENCH_FAST_FILL=1`` and,
    if ``SGLANG_PLUGINS`` (SGLang's allowlist of plugins) is set, the shim added to it; empty with
    ``--real-prefill``. Each server adds its own marker file (``OSCAR_BENCH_FILL_MARKER``)."""
    if a.real_prefill:
        return {}
    from sglang_oscar.serving_launcher import pythonpath_with

    shim = write_fill_shim(str(Path(a.work) / "fill_shim"))
    env = {"PYTHONPATH": pythonpath_with(shim, os.environ.get("PYTHONPATH", "")), FILL_ENV: "1"}
    if os.environ.get("SGLANG_PLUGINS"):
        env["SGLANG_PLUGINS"] = f"{os.environ['SGLANG_PLUGINS']},{FILL_ENTRY}"
    return env


def measure_server(srv, rec: dict[str, Any], a: argparse.Namespace, t_end: float) -> None:
    """One healthy server: capacity, warm-up, then one full-pool point per context into ``rec["runs"]``."""
    cap_args = argparse.Namespace(capacity_context=max(a.contexts), decode_tokens=a.decode_tokens)
    rec["capacity"] = cap = bs.server_capacity(srv, cap_args)
    pool = cap["max_total_num_tokens"]
    if pool is None:
        raise RuntimeError("the server reported no max_total_num_tokens (/server_info or its log)")
    print(f"  healthy after {rec['startup_s']} s; pool {pool} tokens", flush=True)
    rec["warmup"] = bs.measure(srv.base_url, 2048, 2, 16, min(t_end, time.time() + 120), seed=7)
    marker = rec["env"].get(MARKER_ENV)
    if marker and not Path(marker).exists():
        raise RuntimeError(f"the fill shim did not run in the warm-up prefill (no {marker}): the server did not "
                           f"load the {FILL_ENTRY} plugin; a real prefill of the pool would not fit the budget")
    stopped = None  # a point that ran past its deadline: the server is still busy with it
    for k, ctx in enumerate(a.contexts):
        b = requests_that_fit(pool, ctx, a, rec["max_running"])
        r: dict[str, Any] = {"context": ctx, "batch": b, "new_tokens": new_tokens(b, a)}
        rec["runs"].append(r)
        if stopped or b == 0:
            r["status"] = stopped or f"skip: one {bs.label(ctx)} request does not fit the pool ({pool} tokens)"
            continue
        r.update(bs.measure(srv.base_url, ctx, b, r["new_tokens"], t_end - 10, seed=100 + k))
        if r["status"] == "timeout":
            stopped = f"skip: {bs.label(ctx)} x {b} timed out before"
        print(f"  {bs.label(ctx)} x {b}: {r['status']}, decode {r.get('decode_tok_s')} tok/s, "
              f"fill {r.get('prefill_all_s')} s", flush=True)


def table(results: dict[str, Any]) -> str:
    """Markdown: one row per (format, context) measured, then int2 / best BF16 per context."""
    lines = ["| format | context | pool tokens | requests | decode tok/s (all decoding) | per request tok/s | "
             "fill (s) | decode steps in window |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    best: dict[tuple, float] = {}  # (model, context) -> best BF16 decode tok/s
    done = []
    for s in results["servers"]:
        for r in s.get("runs", []):
            if not str(r.get("status", "")).startswith("ok") or not r.get("decode_tok_s"):
                continue
            done.append((s, r))
            lines.append(f"| {s['format']} | {bs.label(r['context'])} | {s['capacity']['max_total_num_tokens']:,} | "
                         f"{r['batch']} | {r['decode_tok_s']:,.1f} | {r['per_request_tok_s']:.2f} | "
                         f"{r['prefill_all_s']:.1f} | {r['window_steps']} |")
            if bs.FORMATS[s["format"]][0] == "auto":
                key = (s.get("model"), r["context"])
                best[key] = max(best.get(key, 0.0), r["decode_tok_s"])
    for s, r in done:
        key = (s.get("model"), r["context"])
        if bs.is_int2(s["format"]) and key in best:
            lines.append(f"| **{s['format']} / best BF16** | {bs.label(r['context'])} | | | "
                         f"**{r['decode_tok_s'] / best[key]:.2f}x** | | | |")
    notes = [f"{s['format']} {bs.label(r['context'])}: {r.get('status')}" for s in results["servers"]
             for r in s.get("runs", []) if (s, r) not in done]
    notes += [f"{s['format']}: {s['status']}" for s in results["servers"] if s.get("status") != "ok"]
    return "\n".join(lines) + ("\n\nnot measured: " + "; ".join(notes) if notes else "") + "\n"


def write(results: dict[str, Any], out: Path, logs: Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    meta = results["meta"]
    md = (f"# bench_full_pool ({meta.get('date')}, commit {meta.get('commit')}; fill: "
          f"{'real prefill' if meta.get('real_prefill') else 'fill_shim, prefill attention skipped'})\n\n"
          f"`{shlex.join(meta['argv'])}`\n\n{table(results)}")
    (out / "results.md").write_text(md)
    if logs is not None and logs.is_dir():
        with tarfile.open(out / "logs.tgz", "w:gz") as tar:
            tar.add(logs, arcname="logs")
    print(md)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.merge:
        runs = [json.loads(Path(p).read_text()) for p in a.merge]
        meta = {**runs[0]["meta"], "argv": sys.argv, "merged": [r["meta"].get("commit") for r in runs]}
        write({"meta": meta, "servers": [s for r in runs for s in r["servers"]]}, Path(a.out), None)
        return 0
    shape = bs.Shape.load(a.model)
    if shape.experts and not a.real_prefill:
        raise SystemExit(f"{a.model} is a MoE model: its decode reads depend on the prompt values, which the "
                         "fill shim changes; run it with --real-prefill")
    mdir = str(Path(a.work) / a.model)
    plan = []
    for i, fmt in enumerate(a.formats):
        m = max_running(shape, fmt, a)
        port = a.port + 10 * i
        plan.append((fmt, m, port, bs.server_argv(a, mdir, fmt, port, max_running=m, model=a.model)))
        pool = est_pool(shape, fmt, a, m)
        fits = ", ".join(f"~{requests_that_fit(pool, c, a, m)} x {bs.label(c)}" for c in a.contexts)
        print(f"# {fmt}: max running {m}; estimated fill {fits}")
        print(f"$ {shlex.join(plan[-1][3])}")
    print(f"# fill: {'real prefill' if a.real_prefill else f'{FILL_ENV}=1 (fill_shim: prefill attention skipped)'}")
    if a.dry_run:
        return 0
    from sglang_oscar.serving_launcher import sigterm_exits

    t_end = time.time() + a.budget
    out, logs = Path(a.out), Path(a.work) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    bs.write_model_dir(a.model, mdir)
    results: dict[str, Any] = {"meta": {**bs.collect_meta(a), "real_prefill": a.real_prefill}, "servers": []}
    env = server_env(a)
    with sigterm_exits():  # a device-call timeout: stop the server, keep partial results
        try:
            for fmt, m, port, cmd in plan:
                marker = Path(a.work) / f"fill_ran-{fmt}"
                marker.unlink(missing_ok=True)
                rec: dict[str, Any] = {"format": fmt, "model": a.model, "max_running": m, "runs": [],
                                       "command": shlex.join(cmd), "status": "interrupted",
                                       "env": {**env, MARKER_ENV: str(marker)} if env else {}}
                results["servers"].append(rec)
                left = t_end - time.time()
                if left < 0.5 * bs.STARTUP_S + bs.SERVER_OVERHEAD_S:
                    rec["status"] = f"skip: budget ({left:.0f} s left)"
                    continue
                print(f"[{time.strftime('%H:%M:%S')}] starting {fmt} ({left:.0f} s left)", flush=True)
                timeout = min(a.startup_timeout, max(30.0, left - 20))
                bs.serve_one(rec, cmd, port, logs / f"{a.model}-{fmt}.log", timeout,
                             lambda srv, rec=rec: measure_server(srv, rec, a, t_end), env=rec["env"])
                (out / "results.json").write_text(json.dumps(results, indent=1, default=str))  # survives a kill
        finally:
            results["meta"]["wall_s"] = round(time.time() - (t_end - a.budget), 1)
            write(results, out, logs)
    return 0 if any(r.get("decode_tok_s") for s in results["servers"] for r in s["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
