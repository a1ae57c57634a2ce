"""``sglang-oscar eval-recipe``: serve each arm of a recipe, run its evaluation tasks and
seeds against it, stop it, then compare the arms (one command for the ``eval_gpqa.sh``
wrappers).

Both arms go through the identical launch path (:func:`launcher.build_server_command`); only
the KV flags differ. Every step is an ordinary ``sglang-oscar`` command, printed before it
runs (``--dry-run`` prints them all and runs nothing), so any step can be repeated by hand.
Runs are resumable: an arm whose tasks are all complete is not served again. Each arm folder
records its server (``server.json``: the flags that change answers, environment, rotation content
hash); a folder holding answers of another server or other eval settings is refused before any
server starts, so a changed recipe never mixes its answers with the old ones. An eval that
finishes incomplete (exit 1: some samples rejected or failed, counted as wrong) does not stop
the other tasks and arms; an error (exit 2) does. The command exits 1 when any run is
incomplete.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from sglang_oscar.evals import launcher
from sglang_oscar.evals.recipe import Recipe, load_recipe
from sglang_oscar.evals.runner import METRICS_FILE, RUN_FILE, SAMPLES_FILE

DEFAULT_ARMS = ("bf16", "int2")
SERVER_FILE = "server.json"  # per arm: server_identity() of the server whose answers the arm folder holds


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
         check_files: bool, port: int | None = None) -> list[ArmPlan]:
    """One :class:`ArmPlan` per arm (``port``: instead of ``[serve].port``); ValueError /
    FileNotFoundError from the launcher."""
    plans = []
    for arm in arms:
        cmd = launcher.build_server_command(recipe, arm, check_files=check_files, port=port)
        out_dirs = {t: out / arm / t for t in recipe.eval.tasks}
        evals = [eval_argv(recipe, t, cmd.base_url, out_dirs[t], data_files.get(t))
                 for t in recipe.eval.tasks]
        plans.append(ArmPlan(arm, cmd, evals, out_dirs, out / arm / "server.log"))
    return plans


def _expected_defining(recipe: Recipe) -> dict:
    """The ``run.json`` ``defining`` values an eval of this recipe records (the keys the recipe sets)."""
    e = recipe.eval
    return {"model": recipe.model.hf_id, "max_tokens": e.max_tokens, "temperature": float(e.temperature),
            "top_p": float(e.top_p), "top_k": e.top_k}


def _complete(run_dir: Path, recipe: Recipe) -> bool:
    try:
        m = json.loads((run_dir / METRICS_FILE).read_text())
        r = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return False
    defining = r.get("defining", {})
    return (
        bool(m.get("complete"))
        and sorted(int(s) for s in m.get("seeds", {})) == sorted(recipe.eval.seeds)
        and r.get("n_examples") == recipe.eval.n_examples
        and all(defining.get(k) == v for k, v in _expected_defining(recipe).items())
    )


# Server flags that change no answer already given (where it listens, memory and batch sizing, the
# context limit, logging): an arm folder may be resumed across changes of these.
_NEUTRAL_FLAGS = {"--host", "--port", "--context-length", "--mem-fraction-static", "--max-running-requests",
                  "--max-total-tokens", "--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", "--enable-cache-report",
                  "--dist-timeout", "--nnodes", "--node-rank", "--dist-init-addr", "--log-level",
                  "--oscar-rotation"}  # the rotation is compared by content (rotation_sha256), not by path


def server_identity(cmd: launcher.ServerCommand, recipe: Recipe) -> dict:
    """What defines an arm's answers besides the eval settings: the server's flags (without
    :data:`_NEUTRAL_FLAGS`; ``--json-model-override-args`` as parsed JSON), the recipe's environment,
    and the SHA-256 of the int2 arm's rotation file (of a rotation folder: of its files' names and
    contents)."""
    flags = {k: v for k, v in _flag_values(cmd.server_args).items() if k not in _NEUTRAL_FLAGS}
    if "--json-model-override-args" in flags:
        flags["--json-model-override-args"] = json.dumps(json.loads(flags["--json-model-override-args"]),
                                                         sort_keys=True)
    rot = recipe.rotation_path if cmd.kv == "int2" else None
    return {"server_flags": flags, "env": dict(cmd.env), "rotation_sha256": _content_sha(rot)}


def _content_sha(path: Path | None) -> str | None:
    if path is None or not path.exists():
        return None
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if f.is_file():
            h.update(f.relative_to(path).as_posix().encode() if path.is_dir() else b"")
            h.update(f.read_bytes())
    return h.hexdigest()


def _flag_values(args: list[str]) -> dict[str, str]:
    """``{flag: value}`` of a server argv (a flag without a value: ``""``; a repeated value list joined;
    ``--flag=value`` as ``--flag value``, so a neutral flag stays neutral in either spelling)."""
    out, key = {}, None
    for a in args:
        if a.startswith("--"):
            key, _, value = a.partition("=")
            out[key] = value
        elif key is not None:
            out[key] = (out[key] + " " + a).strip()
    return out


def _check_arm_folder(p: ArmPlan, recipe: Recipe, identity: dict) -> None:
    """ValueError (before any server starts) when the arm's folder holds answers of another server or
    of other eval settings; a folder without a server record (an older sglang-oscar) is taken as this
    recipe's, with a note."""
    arm_dir = p.log_path.parent
    asked = [d for d in p.out_dirs.values() if (d / SAMPLES_FILE).exists()]
    if not asked:
        return
    for d in asked:
        try:
            defining = json.loads((d / RUN_FILE).read_text()).get("defining", {})
        except (OSError, ValueError):
            continue  # the eval itself reports an unreadable run.json
        diffs = [f"{k}: {defining.get(k)!r} -> {v!r}" for k, v in _expected_defining(recipe).items()
                 if k in defining and defining[k] != v]
        if diffs:
            raise ValueError(f"{d} holds answers asked with other eval settings ({'; '.join(diffs)}); move {arm_dir} "
                             "aside (or use another --out folder), or restore the recipe's [eval] values")
    path = arm_dir / SERVER_FILE
    if not path.exists():
        print(f"# note: {arm_dir} has no {SERVER_FILE} (an older sglang-oscar): its answers are taken as this "
              "recipe's server's", file=sys.stderr)
        return
    try:
        recorded = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}): move {arm_dir} aside to start this arm afresh") from None
    if recorded != identity:
        old, new = recorded.get("server_flags", {}), identity["server_flags"]
        diffs = [f"{k} {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}" for k in sorted(set(old) | set(new))
                 if old.get(k) != new.get(k)]
        for key in ("env", "rotation_sha256"):
            if recorded.get(key) != identity[key]:
                diffs.append(f"{key} changed")
        raise ValueError(f"{arm_dir} holds answers of another {p.arm} server ({'; '.join(diffs) or 'changed'}); "
                         f"move {arm_dir} aside to start this arm afresh (or use another --out folder)")


def run_recipe(recipe_path: str | Path, arms: list[str] | None = None, out: str | Path | None = None,
               data_files: dict[str, str] | None = None, dry_run: bool = False,
               health_timeout: float = 1800.0, health_interval: float = 1.0, port: int | None = None) -> int:
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
    plans = plan(recipe, arms, out, data_files, check_files=not dry_run, port=port)
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

    identities = {p.arm: server_identity(p.server, recipe) for p in plans}
    for p in plans:  # every folder is checked before the first server starts
        _check_arm_folder(p, recipe, identities[p.arm])
    incomplete: list[str] = []
    for p in plans:
        if all(_complete(d, recipe) for d in p.out_dirs.values()):
            print(f"# arm {p.arm}: all tasks complete in {out / p.arm}; not serving it again")
            continue
        p.log_path.parent.mkdir(parents=True, exist_ok=True)
        (p.log_path.parent / SERVER_FILE).write_text(json.dumps(identities[p.arm], indent=2) + "\n")
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
