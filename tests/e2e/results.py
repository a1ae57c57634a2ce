"""Results of the device checks: one :class:`CheckResult` per check, the Markdown table,
``e2e.json`` / ``e2e.md``, the exit code."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Sequence

from .config import BUDGET_CUT, CHECKS, FAIL, PASS, SKIP


@dataclasses.dataclass
class CheckResult:
    """One row of the table: the check letter, PASS / FAIL / SKIP, one measured line, the detail."""

    check: str
    status: str  # PASS / FAIL / SKIP
    measured: str  # one line for the table
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def title(self) -> str:
        return CHECKS.get(self.check, self.check)


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def format_table(results: Sequence[CheckResult]) -> str:
    """Markdown table: check, what, measured, result."""
    rows = ["| check | what | measured | result |", "|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.check} | {_md_cell(r.title)} | {_md_cell(r.measured)} | **{r.status}** |")
    return "\n".join(rows)


def _jsonable(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def write_results(out: str, results: Sequence[CheckResult], meta: dict[str, Any]) -> tuple[str, str]:
    """Write ``e2e.json`` (meta + every result with its detail) and ``e2e.md`` (header, table,
    per-check detail as JSON); returns both paths."""
    os.makedirs(out, exist_ok=True)
    jpath, mpath = os.path.join(out, "e2e.json"), os.path.join(out, "e2e.md")
    obj = {"meta": meta, "results": [{"check": r.check, "title": r.title, "status": r.status,
                                      "measured": r.measured, "detail": r.detail} for r in results],
           "passed": all(r.status == PASS for r in results)}
    with open(jpath, "w") as f:
        json.dump(_jsonable(obj), f, indent=2, sort_keys=False)
    lines = ["# sglang-oscar device checks (python -m tests.e2e)", ""]
    for k in ("command", "device", "versions", "started", "wall_s"):
        if k in meta:
            lines.append(f"- {k}: {meta[k] if not isinstance(meta[k], dict) else json.dumps(meta[k])}")
    lines += ["", format_table(results), ""]
    for r in results:
        lines += [f"## {r.check}: {r.title} -- {r.status}", "", "```json",
                  json.dumps(_jsonable(r.detail), indent=1)[:20000], "```", ""]
    with open(mpath, "w") as f:
        f.write("\n".join(lines))
    return jpath, mpath


def overall_exit_code(results: Sequence[CheckResult]) -> int:
    """0 when there are results and every one passed, else 1."""
    return 0 if results and all(r.status == PASS for r in results) else 1


class CheckError(RuntimeError):
    """A check cannot be evaluated (a server it needs is down, a request failed)."""


def per_family(letter: str, families: Sequence[str], check_one) -> CheckResult:
    """Check ``letter`` over ``families`` with ``check_one(family) -> CheckResult``: one family's result
    as it is; several joined (PASS iff each passes), a family that cannot be evaluated (``CheckError``)
    recorded as its FAIL without hiding the others'."""
    res = {}
    for q in families:
        try:
            res[q] = check_one(q)
        except CheckError as exc:
            if len(families) == 1:
                raise
            res[q] = CheckResult(letter, FAIL, f"could not be evaluated: {exc}")
    if len(families) == 1:
        return res[families[0]]
    return CheckResult(letter, PASS if all(r.status == PASS for r in res.values()) else FAIL,
                       " | ".join(f"{q}: {r.measured}" for q, r in res.items()),
                       {"families": {q: r.detail for q, r in res.items()}})


def unevaluated_status(errors: dict[str, str]) -> str:
    """SKIP when every reason a check could not be evaluated is the harness's own time budget."""
    budget = ("time budget", BUDGET_CUT)
    return SKIP if errors and all(any(b in e for b in budget) for e in errors.values()) else FAIL


def margins_note(prompts: Sequence[dict]) -> str:
    """One line: the screened prompts' minimum top-1/top-2 margins."""
    ms = [p["min_margin"] for p in prompts]
    return f"screened min margins {', '.join(f'{m:.3g}' for m in ms)}"
