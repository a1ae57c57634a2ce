"""Entry point of the ``sglang-oscar`` command.

Each part of the package contributes its verbs through an ``add_commands(subparsers)``
function; this module only assembles them. Handlers import heavy modules lazily so that
``sglang-oscar --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that provide ``add_commands(subparsers)``; a missing one is a packaging bug and raises.
_COMMAND_MODULES = (
    "sglang_oscar.cli.core_cmds",  # hadamard, validate, convert, bpe, demo
    "sglang_oscar.calibrate.cli",  # calibrate, fit, error, ppl, quality, validate-rotation, validate-latent, recipe-cmd
    "sglang_oscar.evals.cli",  # serve, eval, eval-recipe, compare
)


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-oscar",
        description="OSCAR INT2 KV cache for SGLang: rotations, calibration, evaluation.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except (CLIError, ValueError, OSError) as exc:
        print(f"sglang-oscar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
