"""Check e: 64 concurrent mixed-length requests (a quarter share a prefix) on an int2 server with
SGLang's strict memory-leak checks on; the same load on a BF16 control server."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .checkpoints import random_prompt
from .client import http_json, leak_lines, log_stats, parse_generation
from .config import FAIL, PASS, main_families
from .results import CheckError, CheckResult, per_family
from .run import Run
from .servers import Server


LOAD_SHARED_PREFIX = 2048  # check e: a quarter of the requests share this many leading tokens


def load_prompts(n: int, lo: int, hi: int, seed: int, shared_prefix: int = LOAD_SHARED_PREFIX) -> list[list[int]]:
    """Check e's requests: ``n`` lengths log-uniform in ``[lo, hi]``; every fourth request starts with
    the same ``shared_prefix`` tokens (radix sharing under load) when it is long enough."""
    import random

    rng = random.Random(seed)
    prefix = random_prompt(shared_prefix, seed + 7)
    out = []
    for i in range(n):
        length = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        ids = random_prompt(length, seed * 7919 + i)
        if i % 4 == 0 and length > shared_prefix + 16:
            ids = prefix + ids[shared_prefix:]
        out.append(ids)
    return out


def load_run(run: Run, srv: Server, prompts: list[list[int]]) -> dict[str, Any]:
    """Send every prompt at once, wait, let the server idle (its strict leak checks run), then probe
    its health with ``/health``, ``/health_generate`` and one more request; scan its log."""
    args = run.args
    before = log_stats(srv.log_text())

    def one(ids):
        payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": args.load_new_tokens, "temperature": 0,
                                                         "ignore_eos": True}}
        t = time.time()
        try:
            r = parse_generation(srv.generate(payload, timeout=args.request_timeout))
            return {"ok": r["completion_tokens"] == args.load_new_tokens, "tokens": r["completion_tokens"],
                    "finish": r["finish_reason"], "s": round(time.time() - t, 3)}
        except RuntimeError as exc:
            return {"ok": False, "error": str(exc)[:300], "s": round(time.time() - t, 3)}

    t = time.time()
    ex = ThreadPoolExecutor(max_workers=len(prompts))
    try:
        outs = list(ex.map(one, prompts))
    finally:  # on a SIGTERM the harness stops the server at once, which ends the waiting requests
        ex.shutdown(wait=False, cancel_futures=True)
    wall = time.time() - t
    time.sleep(5.0)  # idle: the scheduler's leak checks run (strict: a leak raises and kills the scheduler)
    health: dict[str, Any] = {}
    for ep in ("/health", "/health_generate"):
        try:
            http_json(srv.url + ep, timeout=60)
            health[ep] = True
        except RuntimeError as exc:
            health[ep] = str(exc)[:200]
    try:
        health["final_request"] = run.gen(srv, random_prompt(64, 1), 4)["completion_tokens"] == 4
    except CheckError as exc:
        health["final_request"] = str(exc)[:200]
    time.sleep(2.0)
    log = srv.log_text()
    stats = log_stats(log)
    res = {"server": srv.spec.name, "completed": sum(o["ok"] for o in outs), "wall_s": wall, "health": health,
           "alive": srv.alive(), "leak_lines": leak_lines(log)[:20], "log_stats": stats,
           "new_tracebacks": stats["tracebacks"] - before["tracebacks"], "requests": outs}
    res["ok"] = (res["completed"] == len(prompts) and all(v is True for v in health.values()) and res["alive"]
                 and not res["leak_lines"] and res["new_tracebacks"] == 0)
    return res


def check_e(run: Run) -> CheckResult:
    """Each family of :func:`~.config.main_families` (qwen3 by default): :func:`_check_e_family`."""
    return per_family("e", main_families(run.args), lambda q: _check_e_family(run, q))


def _check_e_family(run: Run, q: str) -> CheckResult:
    """PASS when the int2 server ``<q>-int2-load`` completes every request and stays healthy with no
    leak report and no new traceback (:func:`load_run`)."""
    args = run.args
    srv = run.need(f"{q}-int2-load")
    control = run.servers.get(f"{q}-bf16-load")  # the same load on BF16: tells upstream issues from ours
    prompts = load_prompts(args.load_requests, args.load_min_len, args.load_max_len, args.seed + 55)
    lens = [len(p) for p in prompts]
    targets = [srv] + ([control] if control is not None and control.t_ready is not None and control.alive() else [])
    ex = ThreadPoolExecutor(max_workers=len(targets))
    try:
        res = list(ex.map(lambda s: load_run(run, s, prompts), targets))
    finally:  # as load_run's: a SIGTERM must reach the harness's server stop, not wait for the requests
        ex.shutdown(wait=False, cancel_futures=True)
    r = res[0]
    st = r["log_stats"]
    ctl = res[1] if len(res) > 1 else None
    measured = (f"int2: {r['completed']}/{len(prompts)} completed ({sum(lens)} prompt tokens, lengths {min(lens)}-{max(lens)}, "
                f"{args.load_new_tokens} new each) in {r['wall_s']:.1f} s; healthy after: "
                f"{all(v is True for v in r['health'].values()) and r['alive']}; leak reports: {len(r['leak_lines'])}; "
                f"new tracebacks: {r['new_tracebacks']}; max queue {st['max_queue_req']}, max token usage "
                f"{st['max_token_usage']}, cached tokens {st['cached_tokens_total']}"
                + (f" | BF16 control: {'ok' if ctl['ok'] else 'FAILED too'}" if ctl else " | BF16 control: not running"))
    return CheckResult("e", PASS if r["ok"] else FAIL, measured,
                       {"int2": r, "bf16_control": ctl, "lengths": lens, "strict_env": srv.spec.env,
                        "pool_tokens": srv.spec.pool_tokens})
