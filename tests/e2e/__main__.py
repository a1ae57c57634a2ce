"""``python -m tests.e2e [--only a,b,c] [--tp2] [options]``: run the end-to-end device checks.

Phase 1 starts the independent servers concurrently (spread over the host's GPUs), computes the
references while they load, and runs checks i, a, b, c, d, e; then check h's TP=2 servers (one per
family, one after the other) and the f/g pair run alone. ``--help`` lists every option; :mod:`tests.e2e` describes the checks.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from typing import Sequence

from sglang_oscar.serving_launcher import sigterm_exits

from .check_a import check_a
from .check_b import check_b
from .check_c import check_c
from .check_d import check_d
from .check_e import check_e
from .check_fg import check_fg
from .check_h import check_h, collect_h_reference
from .check_i import check_i
from .config import FAIL, FAMILY_BAD_ROTATIONS, parse_args
from .results import CheckResult, format_table, overall_exit_code
from .run import Run, collect_meta, precompute, prepare
from .servers import Server, launch_command, plugin_entry_point, server_specs


def dry_run(args: argparse.Namespace) -> int:
    """Print every server of the selected checks (name, checks, phase) and its command; start nothing."""
    rot = {f"{m}:{k}": os.path.join(args.work, f"rot-{m}", f"rot_{k}.safetensors")
           for m in args.families for k in ("layer", "head", "identity", "mismatch")
           + ((FAMILY_BAD_ROTATIONS[m][0],) if m in FAMILY_BAD_ROTATIONS else ())}
    specs = server_specs(args, rot)
    for s in specs:
        env = " ".join(f"{k}={v}" for k, v in s.env.items())
        tag = "expect exit" if s.expect_fail else f"phase {s.phase}"
        print(f"# {s.name} [{s.checks}] ({tag})")
        print((env + " " if env else "") + shlex.join(launch_command(s, os.path.join(args.work, f"tiny-{s.model}"),
                                                                      args.python)))
    return 0


def run_phase1(run: Run) -> None:
    """Setup, the concurrent servers and checks a-e, i (h's tp1 reference too); stops its servers."""
    args = run.args
    phase1: list[Server] = []
    try:
        prepare(run)
        run.specs = server_specs(args, run.rot)
        try:
            import torch

            n_gpu = max(1, torch.cuda.device_count())
        except Exception:  # noqa: BLE001
            n_gpu = 1
        p1 = [s for s in run.specs if s.phase == 1]
        for i, s in enumerate(p1):
            s.gpu = i % n_gpu  # spread over the GPUs of the host
        t = time.time()
        phase1 = run.start(p1)
        run.log(f"phase 1: started {len(phase1)} servers: {', '.join(s.spec.name for s in phase1)}")
        try:
            precompute(run)
        except Exception as exc:  # noqa: BLE001  (the checks that need the missing data report it)
            import traceback

            run.meta["precompute_error"] = traceback.format_exc()
            run.log(f"reference computation failed: {type(exc).__name__}: {exc}")
        run.wait_ready(phase1)
        run.timings["phase1_ready"] = time.time() - t
        for letter, fn in (("i", check_i), ("a", check_a), ("b", check_b), ("c", check_c), ("d", check_d),
                           ("e", check_e)):
            run.run_check(letter, fn)
        collect_h_reference(run)
    finally:
        run.stop(phase1)
        run.timings["phase1"] = time.time() - run.t0


def main(argv: Sequence[str] | None = None) -> int:
    """The whole run: phase 1 (concurrent servers, checks a-e and i), then h, then f/g alone.
    Returns the exit code (:func:`~.results.overall_exit_code`)."""
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    run = Run(args)
    run.meta.update(collect_meta(args))
    run.meta["args"] = {k: v for k, v in vars(args).items() if k not in ("only",)}
    run.meta["entry_point"] = plugin_entry_point()
    run.log(f"checks {','.join(args.checks)}; out {args.out}; budget {args.budget:.0f} s; "
            f"plugin entry point: {run.meta['entry_point']}")

    with sigterm_exits():  # a device-call timeout: stop our servers, keep partial results
        try:
            try:
                run_phase1(run)
            except SystemExit:
                raise
            except Exception as exc:  # noqa: BLE001  setup failed: every check reports it
                import traceback

                run.meta["setup_error"] = traceback.format_exc()
                for letter in args.checks:
                    if letter not in run.results:
                        run.record(CheckResult(letter, FAIL, f"harness setup failed: {type(exc).__name__}: {exc}"))
            run.hf.clear()
            with contextlib.suppress(Exception):
                import gc

                import torch

                gc.collect()
                torch.cuda.empty_cache()
            run.run_check("h", check_h)
            if set(args.checks) & set("fg") and not all(c in run.results for c in set(args.checks) & set("fg")):
                t = time.time()
                try:
                    check_fg(run)
                except Exception as exc:  # noqa: BLE001
                    for letter in "fg":
                        if letter in args.checks and letter not in run.results:
                            run.record(CheckResult(letter, FAIL, f"harness error: {type(exc).__name__}: {exc}"))
                run.timings["phase2_fg"] = time.time() - t
        finally:
            run.stop(list(run.servers.values()))
            for letter in args.checks:
                if letter not in run.results:
                    run.results[letter] = CheckResult(letter, FAIL, "not run (interrupted)")
            jpath, mpath = run.write()
    results = [run.results[c] for c in args.checks]
    print(f"\nwrote {jpath} and {mpath} (logs in {run.log_dir}); wall {time.time() - run.t0:.0f} s\n")
    print(format_table(results))
    return overall_exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
