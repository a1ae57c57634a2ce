"""Small statistics used by metrics and comparisons (no numpy needed)."""

from __future__ import annotations

import math
from typing import Hashable, Sequence


def mean(xs: Sequence[float]) -> float:
    """Arithmetic mean; NaN for an empty sequence."""
    return sum(xs) / len(xs) if xs else float("nan")


def std(xs: Sequence[float]) -> float:
    """Sample standard deviation (n - 1 in the denominator); 0.0 for fewer than 2 values."""
    n = len(xs)
    if n < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))


def paired(a: Sequence[int], b: Sequence[int],
           clusters: Sequence[Hashable] | None = None) -> dict[str, float]:
    """Paired comparison of two 0/1 sequences (same samples, same order).

    Returns n, accuracies, the mean difference b - a, its standard error, and the discordant
    counts (McNemar). ``clusters`` names the question of each pair: pairs of one question
    asked under several seeds are not independent, so the standard error is the
    cluster-robust one over questions. With every question under the same seeds it equals
    std(per-question mean difference) / sqrt(questions); without clusters (every pair its own
    question) it is std(differences) / sqrt(n). NaN with fewer than 2 questions."""
    if len(a) != len(b):
        raise ValueError("paired sequences must have the same length")
    n = len(a)
    if clusters is None:
        clusters = list(range(n))
    if len(clusters) != n:
        raise ValueError("clusters must have one entry per pair")
    d = [int(y) - int(x) for x, y in zip(a, b)]
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    diff = mean(d) if n else float("nan")
    resid: dict[Hashable, float] = {}
    for c, di in zip(clusters, d):
        resid[c] = resid.get(c, 0.0) + (di - diff)
    q = len(resid)
    se = (math.sqrt(q / (q - 1) * sum(r * r for r in resid.values())) / n
          if q >= 2 else float("nan"))
    return {
        "n": n,
        "n_questions": q,
        "acc_a": mean([float(x) for x in a]) if n else float("nan"),
        "acc_b": mean([float(y) for y in b]) if n else float("nan"),
        "diff": diff,
        "se": se,
        "only_a": only_a,
        "only_b": only_b,
        "both": sum(1 for x, y in zip(a, b) if x and y),
        "neither": sum(1 for x, y in zip(a, b) if not x and not y),
    }
