"""Lloyd-Max codebook of the unit Gaussian.

The 4-level quantizer that minimises the mean squared error for ``N(0, 1)`` data is the
fixed point of Lloyd's two conditions (Lloyd 1982, "Least squares quantization in PCM";
Max 1960, "Quantizing for minimum distortion"):

* each threshold is the midpoint of its two neighbouring levels;
* each level is the conditional mean of the Gaussian on its cell,
  ``E[X | a < X < b] = (phi(a) - phi(b)) / (Phi(b) - Phi(a))``.

We iterate both conditions in float64 until they stop moving. For 4 levels this gives
levels ``+-0.4528, +-1.5104``, thresholds ``0, +-0.9816`` and MSE ``0.1175`` (Max 1960,
Table I), which the tests check.
"""

from __future__ import annotations

import functools
import math

import numpy as np


@functools.lru_cache(maxsize=None)
def gaussian_lloyd_max(num_levels: int = 4, tol: float = 1e-13, max_iter: int = 10000):
    """Return ``(levels, thresholds, mse)`` of the Lloyd-Max quantizer of ``N(0, 1)``.

    Args:
        num_levels: number of reconstruction levels (4 for 2 bits).
        tol: stop when no level moves by more than this (absolute, in units of sigma).
        max_iter: iteration cap; reaching it raises ``RuntimeError``.

    Returns:
        ``levels``: tuple of ``num_levels`` floats, ascending; ``thresholds``: tuple of
        ``num_levels - 1`` floats, ascending; ``mse``: expected squared error (float) for
        unit-Gaussian input.

    Raises:
        ValueError: if ``num_levels < 2``.
        RuntimeError: if the iteration does not converge.
    """
    if num_levels < 2:
        raise ValueError(f"num_levels must be >= 2, got {num_levels}")
    # imported here: scipy.stats takes ~1 s to import, and every process that imports
    # sglang_oscar.quant (SGLang's, each CLI verb) would pay it; the result is cached
    from scipy.stats import norm

    # Start from uniformly spaced levels over +-2 sigma.
    levels = np.linspace(-2.0, 2.0, num_levels)
    for _ in range(max_iter):
        thresholds = 0.5 * (levels[1:] + levels[:-1])
        edges = np.concatenate(([-np.inf], thresholds, [np.inf]))
        mass = norm.cdf(edges[1:]) - norm.cdf(edges[:-1])
        new_levels = (norm.pdf(edges[:-1]) - norm.pdf(edges[1:])) / mass
        # The Gaussian is symmetric, so is the optimum: remove round-off asymmetry.
        new_levels = 0.5 * (new_levels - new_levels[::-1])
        moved = float(np.max(np.abs(new_levels - levels)))
        levels = new_levels
        if moved < tol:
            break
    else:  # pragma: no cover - the iteration converges in a few hundred steps
        raise RuntimeError("Lloyd-Max iteration did not converge")
    thresholds = 0.5 * (levels[1:] + levels[:-1])
    edges = np.concatenate(([-np.inf], thresholds, [np.inf]))
    # E[(X - l)^2 | cell] * P(cell) summed over cells, in closed form:
    # E[X^2; a<X<b] = (Phi(b)-Phi(a)) + a phi(a) - b phi(b)  (with x phi(x) -> 0 at +-inf).
    def x_pdf(x):
        out = np.zeros_like(x)
        finite = np.isfinite(x)
        out[finite] = x[finite] * norm.pdf(x[finite])
        return out

    mass = norm.cdf(edges[1:]) - norm.cdf(edges[:-1])
    second = mass + x_pdf(edges[:-1]) - x_pdf(edges[1:])
    first = norm.pdf(edges[:-1]) - norm.pdf(edges[1:])
    mse = float(np.sum(second - 2 * levels * first + levels**2 * mass))
    assert math.isfinite(mse)
    return tuple(float(x) for x in levels), tuple(float(x) for x in thresholds), mse
