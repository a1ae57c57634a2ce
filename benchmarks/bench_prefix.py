"""Prefix-heavy load served end to end: many requests sharing long prompt prefixes, short outputs,
radix cache on (issue 28's prefill target: int2 >= 0.9x BF16's throughput on such a load).

For every selected KV format (``bench_served``'s ``FORMATS`` and server settings, with the radix
cache on) this starts one ``python -m sglang.launch_server`` on a dummy-weight checkpoint of a real
``config.json`` and runs a load of ``--groups`` x ``--per-group`` requests: request (g, i) is group
g's shared prefix of ``--prefix-len`` random token ids followed by its own ``--suffix-len`` ids, and
asks for ``--output-len`` greedy tokens (``ignore_eos``). The first request of every group goes
first (the G "seed" requests, concurrently), the rest follow, ``--concurrency`` in flight; so every
format computes each prefix once and serves the others from its radix cache. The load's wall time
covers both phases, what a system-prompt-heavy workload costs; the second phase alone (``rest_wall_s``)
is the extends of the suffixes over cached prefixes (INT2 rows for int2), their decode and SGLang's
scheduling. A smaller untimed load (a quarter of the groups, other prefixes) warms the server first
(Triton JIT, extend shapes).

Reported per format (``results.json``, ``results.md``, server logs in ``logs.tgz``): wall time of the
load and of its two phases, requests/s, prompt tokens/s (every prompt token / wall), the computed
prompt tokens (prompt - ``meta_info.cached_tokens``) and their rate, the radix hit ratio, the mean /
median / p99 request latency (nearest rank); the table gives int2 / best BF16 of the load's
requests/s and of the second phase's (the same requests on every format: a hit ratio that differs
between formats is flagged). A request that does not return ``--output-len`` tokens and its
``cached_tokens`` fails the format. Requests go to ``/generate`` with ``input_ids`` (the dummy
checkpoints have no tokenizer: ``bench_served``'s docstring says why not ``sglang.bench_serving``).
SIGTERM (a device call's timeout) stops the server and still writes what was measured.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

try:  # python -m benchmarks.bench_prefix (a package), or the script / its folder on the path
    from . import bench_served as bs
except ImportError:
    import bench_served as bs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=bs.MODELS, default="qwen3-8b")
    p.add_argument("--formats", type=lambda s: bs.csv(s, tuple(bs.FORMATS)), default=["bf16-t64", "int2"])
    p.add_argument("--groups", type=int, default=16, help="distinct shared prefixes")
    p.add_argument("--per-group", type=int, default=32, help="requests per prefix (the first one seeds it)")
    p.add_argument("--prefix-len", type=bs.size_arg, default=4096, help="shared prefix (tokens; k = 1024)")
    p.add_argument("--suffix-len", type=bs.size_arg, default=256, help="each request's own tokens")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight (also --max-running-requests)")
    bs.add_server_args(p, out="bench_prefix_out", work="/tmp/bench_prefix_work", port=31500)
    p.add_argument("--request-timeout", type=float, default=240.0, help="seconds for one request")
    p.add_argument("--dry-run", action="store_true", help="print the server commands and the load, start nothing")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    for name in ("groups", "per_group", "prefix_len", "suffix_len", "output_len", "concurrency"):
        if getattr(a, name) <= 0:
            build_parser().error(f"--{name.replace('_', '-')} must be positive")
    return a


def make_load(a: argparse.Namespace, seed: int, groups: int | None = None) -> list[list[list[int]]]:
    """``load[g][i]``: group g's prefix + request i's suffix (random ids; ``seed`` picks the prefixes)."""
    out = []
    for g in range(groups or a.groups):
        prefix = bs.random_ids(a.prefix_len, seed * 100_003 + g)
        out.append([prefix + bs.random_ids(a.suffix_len, (seed * 100_003 + g) * 1000 + 1 + i)
                    for i in range(a.per_group)])
    return out


def run_load(url: str, load: list[list[list[int]]], a: argparse.Namespace) -> dict[str, Any]:
    """Seeds first (one per group, concurrently), then the rest, ``--concurrency`` in flight.
    Returns wall times (s), rates, cached-token counts and latencies (s, tokens/s).

    Raises:
        RuntimeError: a request failed or came back short (an abort, a missing ``cached_tokens``).
    """
    from sglang_oscar.serving_launcher import http_json

    def one(ids: list[int]) -> dict:
        t = time.perf_counter()
        meta = http_json(url + "/generate", bs.generate_body(ids, a.output_len),
                         timeout=a.request_timeout).get("meta_info") or {}
        if meta.get("completion_tokens") != a.output_len or "cached_tokens" not in meta:
            raise RuntimeError(f"request of {len(ids)} tokens came back with {meta.get('completion_tokens')} of "
                               f"{a.output_len} tokens, cached_tokens {meta.get('cached_tokens')}, finish "
                               f"{meta.get('finish_reason')}")
        return {"prompt": len(ids), "cached": int(meta["cached_tokens"]), "latency": time.perf_counter() - t}

    pool = ThreadPoolExecutor(max_workers=a.concurrency)
    try:
        t0 = time.perf_counter()
        done = list(pool.map(one, [grp[0] for grp in load]))
        t1 = time.perf_counter()
        done += list(pool.map(one, [ids for grp in load for ids in grp[1:]]))
        t2 = time.perf_counter()
    finally:  # on an error or SIGTERM do not wait for the requests still in flight
        pool.shutdown(wait=False, cancel_futures=True)
    wall, rest = t2 - t0, done[len(load):]
    prompt = sum(r["prompt"] for r in done)
    cached = sum(r["cached"] for r in done)
    lat = sorted(r["latency"] for r in done)

    def rank(q: float) -> float:  # nearest-rank percentile
        return lat[max(0, math.ceil(q * len(lat)) - 1)]

    return {"requests": len(done), "wall_s": round(wall, 4), "seed_wall_s": round(t1 - t0, 4),
            "rest_wall_s": round(t2 - t1, 4), "requests_per_s": round(len(done) / wall, 2),
            "rest_requests_per_s": round(len(rest) / (t2 - t1), 2) if rest else None,
            "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
            "prompt_tok_s": round(prompt / wall, 1), "computed_tok_s": round((prompt - cached) / wall, 1),
            "hit_ratio": round(cached / prompt, 4), "completion_tokens": len(done) * a.output_len,
            "latency_mean_s": round(sum(lat) / len(lat), 4), "latency_p50_s": round(rank(0.5), 4),
            "latency_p99_s": round(rank(0.99), 4)}


def measure_server(srv, rec: dict[str, Any], a: argparse.Namespace, warm: list, timed: list) -> None:
    """One healthy server: the warm-up load, then the timed one, into ``rec``."""
    rec["warmup"] = run_load(srv.base_url, warm, a)
    rec["load"] = r = run_load(srv.base_url, timed, a)
    print(f"  {rec['format']}: {r['wall_s']} s, {r['requests_per_s']} req/s, {r['computed_tok_s']} computed "
          f"tok/s, hit {r['hit_ratio']}", flush=True)


def table(results: dict[str, Any]) -> str:
    """Markdown: one row per format, then int2 / best BF16 of the load's and the second phase's requests/s."""
    rows = [s for s in results["servers"] if isinstance(s.get("load"), dict)]
    lines = ["| format | requests | wall (s) | seeds / rest (s) | requests/s | rest requests/s | prompt tok/s | "
             "computed tokens | computed tok/s | radix hit | latency mean / p50 / p99 (s) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for s in rows:
        r = s["load"]
        lines.append(f"| {s['format']} | {r['requests']} | {r['wall_s']:.2f} | {r['seed_wall_s']:.2f} / "
                     f"{r['rest_wall_s']:.2f} | {r['requests_per_s']:.2f} | {r['rest_requests_per_s'] or 0:.2f} | "
                     f"{r['prompt_tok_s']:,.0f} | {r['computed_tokens']:,} | {r['computed_tok_s']:,.0f} | "
                     f"{r['hit_ratio']:.3f} | {r['latency_mean_s']:.2f} / {r['latency_p50_s']:.2f} / "
                     f"{r['latency_p99_s']:.2f} |")
    bf16 = [s["load"] for s in rows if bs.FORMATS[s["format"]][0] == "auto"]
    for s in rows:
        if bs.is_int2(s["format"]) and bf16:
            best = max(bf16, key=lambda r: r["requests_per_s"])
            rest = max((r["rest_requests_per_s"] or 0) for r in bf16)
            mine = s["load"]["rest_requests_per_s"]
            ratio = f"{mine / rest:.2f}x" if rest and mine else "-"
            lines.append(f"| **{s['format']} / best BF16** | | | | "
                         f"**{s['load']['requests_per_s'] / best['requests_per_s']:.2f}x** | **{ratio}** | | | | | |")
    notes = [f"{s['format']}: {s['status']}" for s in results["servers"] if s not in rows]
    if len({s["load"]["hit_ratio"] for s in rows}) > 1:
        notes.append("the formats' radix hit ratios differ: their computed tokens are not the same work")
    return "\n".join(lines) + ("\n\nnot comparable or not measured: " + "; ".join(notes) if notes else "") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    mdir = str(Path(a.work) / a.model)
    ports = {fmt: a.port + 10 * i for i, fmt in enumerate(a.formats)}
    argvs = {fmt: bs.server_argv(a, mdir, fmt, ports[fmt], max_running=a.concurrency, radix_cache=True,
                                  model=a.model)
             for fmt in a.formats}
    n = a.groups * a.per_group
    print(f"# load: {a.groups} groups x {a.per_group} requests ({n}), prefix {a.prefix_len} + suffix "
          f"{a.suffix_len} tokens, {a.output_len} new, {a.concurrency} in flight")
    for fmt in a.formats:
        print(f"$ {shlex.join(argvs[fmt])}")
    if a.dry_run:
        return 0
    from sglang_oscar.serving_launcher import sigterm_exits

    out, logs = Path(a.out), Path(a.work) / "logs"
    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    bs.write_model_dir(a.model, mdir)
    results: dict[str, Any] = {"meta": bs.collect_meta(a), "servers": []}
    timed, warm = make_load(a, seed=1), make_load(a, seed=2, groups=max(1, a.groups // 4))
    with sigterm_exits():  # a device-call timeout: stop the server, keep partial results
        try:
            for fmt in a.formats:
                rec: dict[str, Any] = {"format": fmt, "command": shlex.join(argvs[fmt]), "status": "interrupted"}
                results["servers"].append(rec)
                print(f"[{time.strftime('%H:%M:%S')}] starting {fmt}", flush=True)
                bs.serve_one(rec, argvs[fmt], ports[fmt], logs / f"{a.model}-{fmt}.log", a.startup_timeout,
                             lambda srv, rec=rec: measure_server(srv, rec, a, warm, timed))
        finally:
            (out / "results.json").write_text(json.dumps(results, indent=1))
            md = (f"# bench_prefix ({results['meta']['date']}, commit {results['meta'].get('commit')})\n\n"
                  f"`{shlex.join(sys.argv)}`\n\n{table(results)}")
            (out / "results.md").write_text(md)
            with tarfile.open(out / "logs.tgz", "w:gz") as tar:  # one log per server
                for log in sorted(logs.glob(f"{a.model}-*.log")):
                    tar.add(log, arcname=log.name)
            print(md)
    return 0 if any(s["status"] == "ok" for s in results["servers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
