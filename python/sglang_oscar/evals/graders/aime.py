"""AIME grader: an integer 0-999.

The answer is the last ``\\boxed{...}`` of the response section, read as an integer
(``\\boxed{070}``, ``\\boxed{ 70 }``, ``\\boxed{\\text{70}}``, ``\\boxed{70.}``); when its
content is not an integer (``\\boxed{3.5}``, ``\\boxed{2^{10}}``) there is no answer (an earlier
integer box is not used: it is an intermediate result). If there is no box at all, the last
``Answer: N`` / ``answer is N`` whose number is a whole integer (``answer is 3.5`` and
``Answer: 2^{10}`` give no answer, not 3 and 2). Compared as integers; a value outside 0-999
is wrong.
"""

from __future__ import annotations

import re

from sglang_oscar.evals.graders.common import Grade, boxed_contents, response_section

_INT_RE = re.compile(r"^[+]?(\d+)(?:\.0*)?$")
_ANSWER_RE = re.compile(
    r"(?i:answer)\s*(?:\*\*)?\s*(?:[:：]|\bis\b)\s*(?:\*\*)?\s*\$?\s*(?:\\boxed\{)?\s*"
    r"(\d+(?:,\d{3})*)\b"
    # not the integer part of a decimal, fraction, power, index or thousands group
    r"(?![.,]\d|\s*[\^_/]|\s*\\(?:frac|cdot|times|sqrt|pi)\b)"
)


def _as_int(s: str) -> int | None:
    s = s.strip()
    s = re.sub(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}", r"\1", s)
    s = s.replace("$", "").replace("\\,", "").replace("{,}", "").replace(",", "")
    s = s.replace(" ", "").replace("\\!", "").rstrip(".")
    m = _INT_RE.match(s)
    return int(m.group(1)) if m else None


def extract_int(response: str) -> int | None:
    """The integer answer of a response section (rules above), or None."""
    if not response:
        return None
    boxes = boxed_contents(response)
    if boxes:
        return _as_int(boxes[-1])
    matches = _ANSWER_RE.findall(response)
    if matches:
        return int(matches[-1].replace(",", ""))
    return None


def parse_gold(gold: str | int) -> int:
    """The dataset's answer as an int; ValueError if it is not an integer."""
    v = _as_int(str(gold))
    if v is None:
        raise ValueError(f"AIME gold answer {gold!r} is not an integer")
    return v


def grade(text: str | None, gold: str | int) -> Grade:
    """Grade one raw model output against the gold integer."""
    response, unterminated = response_section(text)
    value = None if unterminated else extract_int(response)
    g = parse_gold(gold)
    ok = value is not None and 0 <= value <= 999 and value == g
    return Grade(extracted=None if value is None else str(value), correct=ok, truncated=unterminated)
