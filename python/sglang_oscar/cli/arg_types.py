"""argparse ``type=`` functions shared by the verbs: a bad value is refused naming the flag, before
any file is read (argparse prefixes the message with the flag)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer > 0 (tokens, sequences, batch sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def ortho_tol(text: str) -> float:
    """The largest accepted ``max |R R^T - I|`` of a rotation file: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value:g}")
    return value
