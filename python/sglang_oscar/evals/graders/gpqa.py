"""GPQA grader: one letter A-D, read from the response section only.

Accepted forms; among all matches of all rules, the one that appears *last* in the response
wins (a model that says "the answer is A" while reasoning and ends with a boxed C answers C):

1. ``Answer: X`` with any whitespace/newline after the colon, markdown bold around the word,
   the colon or the letter (``**Answer:** X``, ``**Answer**: X``, ``Final answer: (X)``),
   ``The answer is X`` / ``The correct answer is (X)``, and a boxed letter after it
   (``Answer: \\boxed{X}``, ``**Final Answer:** \\(\\boxed{X}\\)``, ``Answer: $\\boxed{X}$``);
2. ``\\boxed{X}`` anywhere (also ``\\boxed{\\text{X}}`` and ``\\boxed{(X)}``);
3. a last line that is only the letter, optionally in parentheses or bold (``(X)``, ``X``,
   ``**X**``, ``X)``), or that ends with a letter in parentheses (``so the answer must be (X).``),
   when that line holds no match of rules 1-2 (``Answer: C, not (A).`` is C).

A response whose reasoning block is unterminated (``<think>`` without ``</think>``) has no
answer and is flagged truncated.
"""

from __future__ import annotations

import re

from sglang_oscar.evals.graders.common import Grade, boxed_spans, response_section

LETTERS = "ABCD"

_ANSWER_RE = re.compile(
    r"(?i:answer)\s*(?:\*\*|__)?\s*(?:[:：]|(?i:\bis\b)(?:\s*[:：])?)\s*(?:\*\*|__)?\s*"
    r"(?:\\\(|\$)?\s*(?:\\boxed\s*\{\s*(?:\\text(?:bf)?\{\s*)?)?"
    r"[\(\[]?\s*(?:\*\*)?\s*([A-D])\b(?![-'’])"
)
_LAST_LINE_RE = re.compile(r"^\W*\(?\s*([A-D])\s*\)?[\W]*$")
_LAST_PAREN_RE = re.compile(r"\(\s*([A-D])\s*\)[\s.!*]*$")
_BOX_RE = re.compile(r"^\s*(?:\\text(?:bf)?\{\s*)?\(?\s*([A-D])\s*\)?\s*\}?\s*$")


def extract_letter(response: str) -> str | None:
    """The answer letter in an already-separated response section, or None."""
    if not response:
        return None
    found: list[tuple[int, str]] = [(m.start(1), m.group(1)) for m in _ANSWER_RE.finditer(response)]
    for start, box in boxed_spans(response):
        m = _BOX_RE.match(box)
        if m:
            found.append((start + m.start(1), m.group(1)))
    stripped = response.rstrip()
    lines = [ln.strip() for ln in stripped.splitlines() if ln.strip()]
    if lines:
        last_start = len(stripped) - len(lines[-1])
        m = _LAST_LINE_RE.match(lines[-1]) or _LAST_PAREN_RE.search(lines[-1])
        # Rule 3 reads a last line without an explicit answer form ("Answer: C, not (A)."
        # is C).
        if m and not any(pos >= last_start for pos, _ in found):
            found.append((last_start + m.start(1), m.group(1)))
    if not found:
        return None
    return max(found)[1].upper()


def grade(text: str | None, gold_letter: str) -> Grade:
    """Grade one raw model output against the gold letter."""
    response, unterminated = response_section(text)
    letter = None if unterminated else extract_letter(response)
    return Grade(extracted=letter, correct=letter == gold_letter, truncated=unterminated)
