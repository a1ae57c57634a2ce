"""``sglang-oscar eval-recipe``: serve each arm of a recipe, run its evaluation tasks and
seeds against it, stop it, then compare the arms (one command for the ``eval_gpqa.sh``
wrappers).

Both arms go through the identical launch path (:func:`launcher.build_server_command`); only
the KV flags differ. Every step is an ordinary ``sglang-oscar`` command, printed before it
runs (``--dry-run`` prints them all and runs nothing), so any step can be repeated by hand.
Runs are resumable: an arm whose tasks are all complete is not served again. An eval that
finishes incomplete (exit 1: some samples rejected or failed, counted as wrong) does not stop
the other tasks and arms; an error (exit 2) does. The command exits 1 when any run is
incomplete.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from sglang_oscar.evals import launcher
from sglang_oscar.evals.recipe import Recipe, load_recipe
from sglang_oscar.evals.runner import METRICS_FILE, RUN_FILE

DEFAULT_ARMS = ("bf16", "int2")


@dataclass
class ArmPlan:
    """What ``eval-recipe`` does for one arm: its server, its eval commands, where."""

    arm: str
    server: launcher.ServerCommand
    evals: list[list[str]]  # argv after "sglang-oscar"
    out_dirs: dict[str, Path]
    log_path: Path


def eval_argv(recipe: Recipe, task: str, base_url: str, out_dir: Path,
              data_file: str | None) -> list[str]:
    """The ``sglang-oscar eval`` argv (without the program name) for one task of one arm."""
    e = recipe.eval
    argv = ["eval", "--task", task, "--base-url", base_url, "--model", recipe.model.hf_id,
            "--seeds", *[str(s) for s in e.seeds], "--threads", str(e.threads),
            "--max-tokens", str(e.max_tokens), "--temperature", repr(float(e.temperature)),
            "--top-p", repr(float(e.top_p))]
    if e.top_k is not None:
        argv += ["--top-k", str(e.top_k)]
    if e.n_examples is not None:
        argv += ["--n-examples", str(e.n_examples)]
    if data_file is not None:
        argv += ["--data-file", data_file]
    argv += ["--out", str(out_dir)]
    return argv


def plan(recipe: Recipe, arms: list[str], out: Path, data_files: dict[str, str],
         check_files: bool) -> list[ArmPlan]:
    """One :class:`ArmPlan` per arm; ValueError/FileNotFoundError from the launcher."""
    plans = []
    for arm in arms:
        cmd = launcher.build_server_command(recipe, arm, check_files=check_files)
        out_dirs = {t: out / arm / t for t in recipe.eval.tasks}
        evals = [eval_argv(recipe, t, cmd.base_url, out_dirs[t], data_files.get(t))
                 for t in recipe.eval.tasks]
        plans.append(ArmPlan(arm, cmd, evals, out_dirs, out / arm / "server.log"))
    return plans


def _complete(run_dir: Path, recipe: Recipe) -> bool:
    try:
        m = json.loads((run_dir / METRICS_FILE).read_text())
        r = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        bool(m.get("complete"))
        and sorted(int(s) for s in m.get("seeds", {})) == sorted(recipe.eval.seeds)
        and r.get("n_examples") == recipe.eval.n_examples
        and r.get("defining", {}).get("max_tokens") == recipe.eval.max_tokens
    )


def run_recipe(recipe_path: str | Path, arms: list[str] | None = None, out: str | Path | None = None,
               data_files: dict[str, str] | None = None, dry_run: bool = False,
               health_timeout: float = 1800.0, health_interval: float = 1.0) -> int:
    """Serve each arm, run its evals, stop it, then compare bf16 with int2 (see the module
    docstring). Returns 0 when every run is complete, 1 when some run finished incomplete,
    or the status of the first step that failed (2: an error). Raises ValueError / EvalError
    (LaunchError, DatasetUnavailable, RecipeError) for bad input and launch failures."""
    from sglang_oscar.cli.main import main as cli_main

    recipe = load_recipe(recipe_path)
    arms = list(arms or DEFAULT_ARMS)
    for arm in arms:
        if arm not in launcher.KV_MODES:
            raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(launcher.KV_MODES)}")
    if len(set(arms)) != len(arms):
        raise ValueError(f"duplicate arms: {arms}")
    data_files = dict(data_files or {})
    for task in data_files:
        if task not in recipe.eval.tasks:
            raise ValueError(f"--data-file given for {task!r}, which is not in the recipe's "
                             f"[eval].tasks ({', '.join(recipe.eval.tasks)})")
    out = Path(out) if out is not None else Path("runs") / recipe.name
    plans = plan(recipe, arms, out, data_files, check_files=not dry_run)
    compares = []
    if "bf16" in arms and "int2" in arms:
        compares = [["compare", str(out / "bf16" / t), str(out / "int2" / t),
                     "--json", str(out / f"compare_{t}.json")]
                    for t in recipe.eval.tasks]

    if dry_run:
        for p in plans:
            for w in p.server.warnings:
                print(f"# warning: {w}", file=sys.stderr)
            print(f"# arm {p.arm}: serve (log {p.log_path}), evaluate, stop")
            print(p.server.shell())
            for argv in p.evals:
                print(shlex.join(["sglang-oscar", *argv]))
        for argv in compares:
            print(shlex.join(["sglang-oscar", *argv]))
        return 0

    # Load every dataset before any server starts: a missing dataset fails in seconds, not
    # after the model has loaded.
    from sglang_oscar.evals.datasets import load_task_data

    for t in recipe.eval.tasks:
        load_task_data(t, data_files.get(t))

    incomplete: list[str] = []
    for p in plans:
        if all(_complete(d, recipe) for d in p.out_dirs.values()):
            print(f"# arm {p.arm}: all tasks complete in {out / p.arm}; not serving it again")
            continue
        print(f"# arm {p.arm}: {p.server.shell()}", flush=True)
        server = launcher.Server(p.server, p.log_path)
        try:
            server.start()
            server.wait_healthy(timeout=health_timeout, interval=health_interval)
            print(f"# arm {p.arm}: server healthy at {p.server.base_url} (log {p.log_path})",
                  flush=True)
            for argv in p.evals:
                print(shlex.join(["sglang-oscar", *argv]), flush=True)
                rc = cli_main(argv)
                if rc == 1:  # finished, but some samples were rejected or failed
                    incomplete.append(argv[argv.index("--out") + 1])
                elif rc:
                    return rc
        finally:
            server.stop()
    for argv in compares:
        print(shlex.join(["sglang-oscar", *argv]), flush=True)
        rc = cli_main(argv)
        if rc == 1:  # nothing to pair (no sample finished in both runs)
            incomplete.append(argv[-1])
        elif rc:
            return rc
    if incomplete:
        print(f"# incomplete (rejected or failed samples count as wrong; re-run to retry "
              f"them): {', '.join(incomplete)}", flush=True)
        return 1
    return 0
