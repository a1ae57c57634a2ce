"""Value checkers of the recipe loader (:mod:`sglang_oscar.evals.recipe`) and its error.

A checker takes ``(value, where)`` and returns the normalised value or raises
:class:`RecipeError` naming ``where`` (``[section].key``); :func:`check_table` applies a
section's ``key -> (checker, required)`` table and refuses unknown keys.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

# Environment variable names that nothing reads any more (spec §11.1 item 1): refusing them
# keeps a recipe from believing it switched something on.
DEAD_ENV_PREFIXES = ("SGLANG_COQUANT_",)
# Environment aliases of settings that the recipe passes as flags ([rotation] and [quant]
# keys): the flag wins, so such a variable in [serve].env would be silently ignored.
# Kept equal to the aliases in sglang_oscar.plugin.flags (a test checks).
FLAG_ENV_ALIASES = {
    "SGLANG_OSCAR_K_ROTATION_PATH": "[rotation].path",
    "SGLANG_OSCAR_V_ROTATION_PATH": "[rotation].path",
    "SGLANG_OSCAR_K_CLIP_RATIO": "[quant].k_clip_ratio",
    "SGLANG_OSCAR_V_CLIP_RATIO": "[quant].v_clip_ratio",
    "SGLANG_MIXED_KV_PREFIX_TOKENS": "[quant].sink_tokens",
    "SGLANG_MIXED_KV_RECENT_TOKENS": "[quant].recent_tokens",
    "SGLANG_LLOYD_MAX": "[quant].quantizer",
    "SGLANG_MIXED_KV_SCALE_DTYPE": "[quant].scale_dtype",
}


class RecipeError(ValueError):
    """A recipe file is missing, unreadable or does not follow the schema."""


# ----------------------------------------------------------------------------- checkers
# A checker takes (value, where) and returns the normalised value or raises RecipeError.
Checker = Callable[[Any, str], Any]


def is_int(v: Any) -> bool:
    """True for an int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def _within(v, where: str, ok, want: str):
    """``v`` if ``ok(v)``, else ``RecipeError("<where> must be <want>, got <v>")``."""
    if not ok(v):
        raise RecipeError(f"{where} must be {want}, got {v}")
    return v


def integer(v: Any, where: str) -> int:
    """An integer (not a bool)."""
    if not is_int(v):
        raise RecipeError(f"{where} must be an integer, got {v!r}")
    return v


def pos_int(v: Any, where: str) -> int:
    """An integer > 0."""
    return _within(integer(v, where), where, lambda x: x > 0, "a positive integer")


def nonneg_int(v: Any, where: str) -> int:
    """An integer >= 0."""
    return _within(integer(v, where), where, lambda x: x >= 0, ">= 0")


def number(v: Any, where: str) -> float:
    """A finite int or float (not a bool), as a float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RecipeError(f"{where} must be a number, got {v!r}")
    if not math.isfinite(v):
        raise RecipeError(f"{where} must be a finite number, got {v!r}")
    return float(v)


def ratio(v: Any, where: str) -> float:
    """A number in [0, 1]."""
    v = number(v, where)
    if not 0.0 <= v <= 1.0:
        raise RecipeError(f"{where} must be in [0, 1], got {v}")
    return v


def string(v: Any, where: str) -> str:
    """A string."""
    if not isinstance(v, str):
        raise RecipeError(f"{where} must be a string, got {v!r}")
    return v


def nonempty_str(v: Any, where: str) -> str:
    """A string that is not blank."""
    v = string(v, where)
    if not v.strip():
        raise RecipeError(f"{where} must not be empty")
    return v


def boolean(v: Any, where: str) -> bool:
    """true or false."""
    if not isinstance(v, bool):
        raise RecipeError(f"{where} must be true or false, got {v!r}")
    return v


def table(v: Any, where: str) -> dict:
    """A TOML table (a copy of it)."""
    if not isinstance(v, dict):
        raise RecipeError(f"{where} must be a table, got {v!r}")
    return dict(v)


def choice(*allowed: str) -> Checker:
    """A checker accepting one of the strings ``allowed``."""
    def check(v: Any, where: str) -> str:
        v = string(v, where)
        if v not in allowed:
            raise RecipeError(f"{where} = {v!r} is not one of: {', '.join(allowed)}")
        return v

    return check


def skip_layers(v: Any, where: str) -> str:
    """``[quant].skip_layers``: ``none`` / ``sliding`` / ``full`` or comma-separated global layer
    ids (a TOML list of ints too), normalised as ``--oscar-skip-layers`` is
    (:func:`sglang_oscar.config.parse_skip_layers`)."""
    from sglang_oscar.config import parse_skip_layers

    if isinstance(v, bool) or not isinstance(v, (str, list)) or v == []:
        raise RecipeError(f"{where} must be a string (none, sliding, full or layer ids like \"0,5\") or a non-empty "
                          f"list of layer ids, got {v!r}")
    try:
        return parse_skip_layers(v)
    except ValueError as exc:
        raise RecipeError(f"{where}: {exc}") from None


def list_of(item: Checker, nonempty: bool = False) -> Checker:
    """A checker of a list whose elements pass ``item`` (and that is not empty, with ``nonempty``)."""
    def check(v: Any, where: str) -> list:
        if not isinstance(v, list):
            raise RecipeError(f"{where} must be a list, got {v!r}")
        if nonempty and not v:
            raise RecipeError(f"{where} must not be empty")
        return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]

    return check


def argv_item(v: Any, where: str) -> str:
    """One argv element: not empty, not a flag and its value joined by a space."""
    v = string(v, where)
    if v == "":
        raise RecipeError(f"{where} is an empty string: it would become an empty argv element")
    if v.startswith("-") and any(c.isspace() for c in v.split("=", 1)[0]):
        raise RecipeError(
            f"{where} = {v!r} holds a flag and more in one element (argv is not split on "
            "spaces); write each flag and each value as its own list element"
        )
    return v


def env_table(v: Any, where: str) -> dict[str, str]:
    """``[serve].env``: valid variable names to string values; dead legacy names and the
    environment aliases of recipe keys (:data:`FLAG_ENV_ALIASES`) are refused."""
    out: dict[str, str] = {}
    for k, val in table(v, where).items():
        if not k or not (k[0].isalpha() or k[0] == "_") or not all(
            c.isalnum() or c == "_" for c in k
        ):
            raise RecipeError(f"{where}: {k!r} is not a valid environment variable name")
        if k.startswith(DEAD_ENV_PREFIXES):
            raise RecipeError(
                f"{where}: {k} is a dead legacy name that the server never reads "
                "(spec §11.1); remove it"
            )
        if k in FLAG_ENV_ALIASES:
            raise RecipeError(
                f"{where}: {k} is set through {FLAG_ENV_ALIASES[k]} in the recipe (passed as a "
                "server flag, which would override the variable); remove it from env"
            )
        if not isinstance(val, str):
            raise RecipeError(
                f"{where}.{k} must be a string (quote it: {k} = \"{val}\"), got {val!r}"
            )
        out[k] = val
    return out


def port(v: Any, where: str) -> int:
    """A TCP port (1-65535)."""
    return _within(integer(v, where), where, lambda x: 1 <= x <= 65535, "a TCP port (1-65535)")


def mem_fraction(v: Any, where: str) -> float:
    """A number in (0, 1)."""
    return _within(number(v, where), where, lambda x: 0.0 < x < 1.0, "in (0, 1)")


def nonneg_float(v: Any, where: str) -> float:
    """A number >= 0."""
    return _within(number(v, where), where, lambda x: x >= 0, ">= 0")


def top_p(v: Any, where: str) -> float:
    """A number in (0, 1]."""
    return _within(number(v, where), where, lambda x: 0.0 < x <= 1.0, "in (0, 1]")


def _allowed(keys) -> str:
    return ", ".join(keys)


def check_table(
    raw: Any,
    spec: dict[str, tuple[Checker, bool]],
    section: str,
    file: Path,
    subtables: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The checked values of one section ``raw`` by ``spec`` (``key -> (checker, required)``);
    keys named in ``subtables`` are left to the caller. Errors name ``file`` and the key."""
    if not isinstance(raw, dict):
        raise RecipeError(f"{file}: [{section}] must be a table, got {raw!r}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in subtables:
            continue
        if key not in spec:
            allowed = list(spec) + [f"[{section}.{s}]" for s in subtables]
            raise RecipeError(
                f"{file}: unknown key '{key}' in [{section}]; allowed keys: {_allowed(allowed)}"
            )
        checker, _ = spec[key]
        try:
            out[key] = checker(value, f"[{section}].{key}")
        except RecipeError as exc:
            raise RecipeError(f"{file}: {exc}") from None
    for key, (_, required) in spec.items():
        if required and key not in raw:
            raise RecipeError(f"{file}: [{section}] is missing the required key '{key}'")
    return out
