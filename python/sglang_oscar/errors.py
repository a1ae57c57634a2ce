"""Errors shared across the package.

:class:`CLIError` lives here rather than in :mod:`sglang_oscar.cli.main` so that modules that
raise user-facing errors (the server launcher, the evaluation harness) need not import the CLI;
``sglang_oscar.cli.main`` re-exports it under the same name.
"""

from __future__ import annotations


class CLIError(Exception):
    """A user-facing error: printed as one line by ``sglang-oscar``, exit status 2."""
