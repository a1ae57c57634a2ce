"""Verbs ``serve``, ``eval``, ``compare`` and ``eval-recipe`` of the ``sglang-oscar``
command. Heavy modules are imported inside the handlers."""

from __future__ import annotations

import json
import math
import re
import signal
import sys
from pathlib import Path

from sglang_oscar.evals.tasks import TASKS as TASK_CHOICES


def add_commands(subparsers) -> None:
    """Register the four verbs on the ``sglang-oscar`` argument parser's subparsers."""
    _add_serve(subparsers)
    _add_eval(subparsers)
    _add_compare(subparsers)
    _add_eval_recipe(subparsers)


# ----------------------------------------------------------------------------- serve


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="start an SGLang server from a recipe (int2 or the bf16 control)",
        description="Compose the SGLang command line from recipes/<model>/recipe.toml, start "
        "the server and wait until GET /health answers. Rank 0 returns once healthy (the "
        "server keeps running) unless --foreground; non-zero --node-rank runs its server "
        "and exits with its status.",
    )
    p.add_argument("--recipe", required=True, help="path of the recipe.toml")
    p.add_argument("--kv", choices=("int2", "bf16"), default="int2",
                   help="KV cache: int2 (OSCAR) or bf16 (the paired control). Default int2")
    p.add_argument("--port", type=int, default=None, help="override [serve].port")
    p.add_argument("--nnodes", type=int, default=None, help="number of nodes (multi-node)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank")
    p.add_argument("--dist-init-addr", default=None, help="rank 0's HOST:PORT for rendezvous")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("--foreground", action="store_true",
                   help="after the server is healthy, keep waiting on it; Ctrl-C stops it")
    p.add_argument("--health-timeout", type=float, default=1800.0,
                   help="seconds to wait for /health (default 1800)")
    p.add_argument("--log-file", default=None,
                   help="server log (default: a new file in the temp dir; non-zero ranks "
                   "without it log to the terminal)")
    p.set_defaults(func=cmd_serve)


def _check_range(value, name: str, low=None, high=None, *, strict_low: bool = False) -> None:
    """Raise ValueError (one-line CLI error, exit 2) when ``value`` is outside the range."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if low is not None and (value <= low if strict_low else value < low):
        raise ValueError(f"{name} must be {'>' if strict_low else '>='} {low:g}, got {value:g}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high:g}, got {value:g}")


def cmd_serve(args) -> int:
    """``sglang-oscar serve``: returns 0 once rank 0 is healthy (or the server's status with
    ``--foreground`` / for a worker rank); LaunchError and ValueError become exit 2."""
    from sglang_oscar.evals import launcher
    from sglang_oscar.evals.recipe import load_recipe

    _check_range(args.port, "--port", 1, 65535)
    _check_range(args.nnodes, "--nnodes", 1)
    _check_range(args.node_rank, "--node-rank", 0)
    _check_range(args.health_timeout, "--health-timeout", 0, strict_low=True)
    recipe = load_recipe(args.recipe)
    cmd = launcher.build_server_command(
        recipe,
        args.kv,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        port=args.port,
        check_files=not args.dry_run,
    )
    if args.dry_run:
        for w in cmd.warnings:
            print(f"# warning: {w}", file=sys.stderr)
        print(cmd.shell())
        return 0

    if args.node_rank:  # a worker node: no HTTP server of its own to wait for
        log = Path(args.log_file) if args.log_file else None
        server = launcher.Server(cmd, log)
        print(f"starting node rank {args.node_rank}: {cmd.shell()}", file=sys.stderr, flush=True)
        server.start()
        _stop_on_sigterm(server)
        return server.wait()

    log = Path(args.log_file) if args.log_file else launcher.default_log_path(cmd)
    server = launcher.Server(cmd, log)
    print(f"starting: {cmd.shell()}", file=sys.stderr)
    print(f"server log: {log}", file=sys.stderr, flush=True)
    server.start()
    try:
        server.wait_healthy(timeout=args.health_timeout)
    except KeyboardInterrupt:
        server.stop()
        return 130
    print(f"healthy: {cmd.base_url} (pid {server.pid}, model {recipe.model.hf_id}, kv {args.kv})",
          flush=True)
    if args.foreground:
        _stop_on_sigterm(server)
        rc = server.wait()
        if rc not in (0, 130, -signal.SIGTERM):
            print(f"the server exited with status {rc}; last lines of {log}:\n"
                  f"{launcher.tail(log)}", file=sys.stderr)
        return rc
    print(f"the server keeps running; stop it with: kill -TERM -{server.pid}", file=sys.stderr)
    return 0


def _stop_on_sigterm(server) -> None:
    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


# ----------------------------------------------------------------------------- eval


def _default_out(task: str, model: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model.rstrip("/").split("/")[-1]) or "model"
    return str(Path("runs") / f"{task}_{name}")


def _add_eval(sub) -> None:
    from sglang_oscar.evals.client import DEFAULT_BACKOFF_S, DEFAULT_RETRIES

    p = sub.add_parser(
        "eval",
        help="evaluate a served model on gpqa, aime25, math500 or humaneval",
        description="Ask every (seed, sample) once through the chat-completions API, grade it "
        "and record it in OUT/samples.jsonl; re-running the same command resumes. "
        "OUT/metrics.json holds accuracy per seed and mean ± std over seeds. "
        "--data-file columns: gpqa: Question, Correct Answer, Incorrect Answer 1-3; "
        "aime25: problem, answer; math500: problem, answer; humaneval: task_id, prompt, test, "
        "entry_point (JSONL, JSON, CSV or Parquet).",
    )
    p.add_argument("--task", required=True, choices=TASK_CHOICES)
    p.add_argument("--base-url", required=True,
                   help="server URL, e.g. http://127.0.0.1:30000 (/v1 is added if missing)")
    p.add_argument("--model", required=True, help="served model name (as in GET /v1/models)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds (default 0)")
    p.add_argument("--threads", type=int, default=32, help="concurrent requests (default 32)")
    p.add_argument("--max-tokens", type=int, default=32768, help="default 32768")
    p.add_argument("--temperature", type=float, default=1.0, help="default 1.0")
    p.add_argument("--top-p", type=float, default=0.95, help="default 0.95")
    p.add_argument("--top-k", type=int, default=None, help="default: the server's")
    p.add_argument("--n-examples", type=int, default=None,
                   help="use the first N samples of the dataset (default all)")
    p.add_argument("--data-file", default=None, help="local copy of the dataset")
    p.add_argument("--out", default=None, help="run folder (default runs/<task>_<model>)")
    p.add_argument("--system-prompt", default=None, help="optional system message")
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0,
                   help="read timeout of one request in seconds (default 21600 = 6 h)")
    p.add_argument("--retries", type=int, default=DEFAULT_RETRIES,
                   help=f"retries of a failed connection/5xx (default {DEFAULT_RETRIES})")
    p.add_argument("--retry-backoff", type=float, default=DEFAULT_BACKOFF_S,
                   help=f"first back-off in seconds, doubled each retry (default {DEFAULT_BACKOFF_S})")
    p.add_argument("--humaneval-timeout", type=float, default=10.0,
                   help="wall-clock limit of one HumanEval test run (default 10 s)")
    p.add_argument("--regrade", action="store_true",
                   help="re-grade the recorded responses (after a grader change)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    """``sglang-oscar eval``: 0 complete, 1 finished but incomplete, 2 error, 130 Ctrl-C."""
    from sglang_oscar.evals.client import SamplingParams
    from sglang_oscar.evals.runner import METRICS_FILE, EvalSettings, format_metrics, run_eval

    _check_range(args.max_tokens, "--max-tokens", 1)
    _check_range(args.threads, "--threads", 1)
    _check_range(args.retries, "--retries", 0)
    _check_range(args.n_examples, "--n-examples", 1)
    _check_range(args.request_timeout, "--request-timeout", 0, strict_low=True)
    _check_range(args.retry_backoff, "--retry-backoff", 0)
    _check_range(args.humaneval_timeout, "--humaneval-timeout", 0, strict_low=True)
    _check_range(args.temperature, "--temperature", 0)
    _check_range(args.top_p, "--top-p", 0, 1, strict_low=True)
    if args.top_k is not None and args.top_k != -1 and args.top_k < 1:
        raise ValueError(f"--top-k must be a positive integer (or -1: no top-k cut), got {args.top_k}")
    out = Path(args.out or _default_out(args.task, args.model))
    settings = EvalSettings(
        task=args.task,
        model=args.model,
        base_url=args.base_url,
        out_dir=out,
        seeds=list(args.seeds),
        params=SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
        ),
        threads=args.threads,
        n_examples=args.n_examples,
        data_file=args.data_file,
        system_prompt=args.system_prompt,
        request_timeout=args.request_timeout,
        retries=args.retries,
        backoff=args.retry_backoff,
        humaneval_timeout=args.humaneval_timeout,
        regrade=args.regrade,
        progress=not args.no_progress,
    )
    try:
        metrics = run_eval(settings)
    except KeyboardInterrupt:
        print(f"sglang-oscar eval: interrupted; finished samples are kept in {out}, re-run the "
              "same command to resume", file=sys.stderr)
        return 130
    print(format_metrics(metrics))
    print(f"metrics: {out / METRICS_FILE}")
    return 0 if metrics["complete"] else 1


# ----------------------------------------------------------------------------- compare


def _add_compare(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="compare two eval runs: mean ± std over seeds and the paired difference",
    )
    p.add_argument("run_a", metavar="RUN_A", help="run folder A (e.g. the bf16 control)")
    p.add_argument("run_b", metavar="RUN_B", help="run folder B (e.g. int2)")
    p.add_argument("--json", default=None, help="also write the comparison to this file")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    """``sglang-oscar compare``: 0, or 1 when no sample was finished in both runs (nothing
    to pair). ``--json`` is strict JSON: undefined statistics are written as null."""
    from sglang_oscar.evals.compare import compare_runs, format_comparison, json_safe

    result = compare_runs(args.run_a, args.run_b)
    print(format_comparison(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(json_safe(result), indent=2, sort_keys=True, allow_nan=False) + "\n")
    if result["paired"]["n"] == 0:
        print("sglang-oscar compare: no sample was finished in both runs: nothing to pair",
              file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- eval-recipe


def _add_eval_recipe(sub) -> None:
    p = sub.add_parser(
        "eval-recipe",
        help="serve each arm of a recipe, run its eval tasks/seeds, stop it, then compare",
    )
    p.add_argument("--recipe", required=True, help="path of the recipe.toml")
    p.add_argument("--arms", nargs="+", choices=("bf16", "int2"), default=["bf16", "int2"],
                   help="arms to run, in order (default: bf16 int2)")
    p.add_argument("--out", default=None, help="results folder (default runs/<recipe folder>)")
    p.add_argument("--data-file", action="append", default=[], metavar="TASK=PATH",
                   help="local dataset copy for one task (repeatable)")
    p.add_argument("--port", type=int, default=None, help="serve the arms on this port (default [serve].port)")
    p.add_argument("--health-timeout", type=float, default=1800.0)
    p.add_argument("--dry-run", action="store_true", help="print every command and exit")
    p.set_defaults(func=cmd_eval_recipe)


def cmd_eval_recipe(args) -> int:
    """``sglang-oscar eval-recipe``: 0 all complete, 1 some run incomplete, else the first
    failing step's status (2 for errors)."""
    from sglang_oscar.evals.recipe_run import run_recipe

    _check_range(args.health_timeout, "--health-timeout", 0, strict_low=True)
    _check_range(args.port, "--port", 1, 65535)
    data_files = {}
    for item in args.data_file:
        task, sep, path = item.partition("=")
        if not sep or task not in TASK_CHOICES or not path:
            raise ValueError(f"--data-file expects TASK=PATH with TASK in {', '.join(TASK_CHOICES)}, got {item!r}")
        if task in data_files:
            raise ValueError(f"--data-file gives {task} twice ({data_files[task]}, {path}): pass one file per task")
        if not Path(path).is_file():
            raise ValueError(f"--data-file {item}: {path} " + ("is a directory: pass the data file in it"
                                                             if Path(path).is_dir() else "does not exist"))
        data_files[task] = path
    try:
        return run_recipe(args.recipe, args.arms, args.out, data_files, args.dry_run,
                          health_timeout=args.health_timeout, port=args.port)
    except KeyboardInterrupt:
        print("sglang-oscar eval-recipe: interrupted (the server was stopped); re-run the same "
              "command to resume", file=sys.stderr)
        return 130
