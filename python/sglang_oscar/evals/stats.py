"""Small statistics used by metrics and comparisons (no numpy needed)."""

from __future__ import annotations

import math
from typing import Sequence


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def std(xs: Sequence[float]) -> float:
    """Sample standard deviation (n - 1 in the denominator); 0.0 for fewer than 2 values."""
    n = len(xs)
    if n < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))


def paired(a: Sequence[int], b: Sequence[int]) -> dict[str, float]:
    """Paired comparison of two 0/1 sequences (same samples, same order).

    Returns n, accuracies, the mean difference b - a, its standard error (std of the
    per-sample differences / sqrt(n)), and the discordant counts (McNemar)."""
    if len(a) != len(b):
        raise ValueError("paired sequences must have the same length")
    n = len(a)
    d = [int(y) - int(x) for x, y in zip(a, b)]
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    diff = mean(d) if n else float("nan")
    se = std(d) / math.sqrt(n) if n >= 2 else float("nan")
    return {
        "n": n,
        "acc_a": mean([float(x) for x in a]) if n else float("nan"),
        "acc_b": mean([float(y) for y in b]) if n else float("nan"),
        "diff": diff,
        "se": se,
        "only_a": only_a,
        "only_b": only_b,
        "both": sum(1 for x, y in zip(a, b) if x and y),
        "neither": sum(1 for x, y in zip(a, b) if not x and not y),
    }
