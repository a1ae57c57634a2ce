"""User-facing errors of the evaluation harness.

They derive from ``CLIError`` (:mod:`sglang_oscar.errors`) so that ``sglang-oscar`` prints them
as one line and exits with status 2."""

from __future__ import annotations

from sglang_oscar.errors import CLIError


class EvalError(CLIError, ValueError):
    """Base class: a problem the user has to fix (input, server, data)."""


class DatasetUnavailable(EvalError):
    """The dataset could not be loaded (offline, gated without token, bad local file)."""


class ServerUnreachable(EvalError):
    """The server did not answer (connection refused, timeouts) after all retries."""


class MassRejection(EvalError):
    """Most requests were rejected (e.g. 400 context length): the run was aborted rather
    than scoring rejections as wrong answers."""
