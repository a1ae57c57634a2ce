"""AIME grader: an integer 0-999.

The answer is the last ``\\boxed{...}`` of the response section whose content reads as an
integer (``\\boxed{070}``, ``\\boxed{ 70 }``, ``\\boxed{\\text{70}}``, ``\\boxed{70.}``); if
there is no box at all, the last ``Answer: N`` line. Compared as integers; a value outside
0-999 is wrong.
"""

from __future__ import annotations

import re

from sglang_oscar.evals.graders.common import Grade, boxed_contents, response_section

_INT_RE = re.compile(r"^[+]?(\d+)(?:\.0*)?$")
_ANSWER_RE = re.compile(r"(?i:answer)\s*(?:\*\*)?\s*(?:[:：]|\bis\b)\s*(?:\*\*)?\s*\$?\s*(?:\\boxed\{)?\s*(\d[\d,]*)\b")


def _as_int(s: str) -> int | None:
    s = s.strip()
    s = re.sub(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}", r"\1", s)
    s = s.replace("$", "").replace("\\,", "").replace("{,}", "").replace(",", "")
    s = s.replace(" ", "").replace("\\!", "").rstrip(".")
    m = _INT_RE.match(s)
    return int(m.group(1)) if m else None


def extract_int(response: str) -> int | None:
    if not response:
        return None
    boxes = boxed_contents(response)
    if boxes:
        for box in reversed(boxes):
            v = _as_int(box)
            if v is not None:
                return v
        return None
    matches = _ANSWER_RE.findall(response)
    if matches:
        return int(matches[-1].replace(",", ""))
    return None


def parse_gold(gold: str | int) -> int:
    v = _as_int(str(gold))
    if v is None:
        raise ValueError(f"AIME gold answer {gold!r} is not an integer")
    return v


def grade(text: str | None, gold: str | int) -> Grade:
    response, unterminated = response_section(text)
    value = None if unterminated else extract_int(response)
    g = parse_gold(gold)
    ok = value is not None and 0 <= value <= 999 and value == g
    return Grade(extracted=None if value is None else str(value), correct=ok, truncated=unterminated)
