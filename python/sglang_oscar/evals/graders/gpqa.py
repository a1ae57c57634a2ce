"""GPQA grader: one letter A-D, read from the response section only.

Accepted forms (the last match of the first rule that matches wins):

1. ``Answer: X`` with any whitespace/newline after the colon, markdown bold around the word,
   the colon or the letter (``**Answer:** X``, ``**Answer**: X``, ``Final answer: (X)``),
   ``The answer is X`` / ``The correct answer is (X)``;
2. ``\\boxed{X}`` (also ``\\boxed{\\text{X}}`` and ``\\boxed{(X)}``);
3. a last line that is only the letter, optionally in parentheses or bold (``(X)``, ``X``,
   ``**X**``, ``X)``), or that ends with a letter in parentheses (``so the answer must be (X).``).

A response whose reasoning block is unterminated (``<think>`` without ``</think>``) has no
answer and is flagged truncated.
"""

from __future__ import annotations

import re

from sglang_oscar.evals.graders.common import Grade, boxed_contents, response_section

LETTERS = "ABCD"

_ANSWER_RE = re.compile(
    r"(?i:answer)\s*(?:\*\*|__)?\s*(?:[:：]|(?i:\bis\b)(?:\s*[:：])?)\s*(?:\*\*|__)?\s*"
    r"(?:\\\(|\$)?\s*[\(\[]?\s*(?:\*\*)?\s*([A-D])\b(?![-'’])"
)
_LAST_LINE_RE = re.compile(r"^\W*\(?\s*([A-D])\s*\)?[\W]*$")
_LAST_PAREN_RE = re.compile(r"\(\s*([A-D])\s*\)[\s.!*]*$")
_BOX_RE = re.compile(r"^\s*(?:\\text(?:bf)?\{\s*)?\(?\s*([A-D])\s*\)?\s*\}?\s*$")


def extract_letter(response: str) -> str | None:
    """The answer letter in an already-separated response section, or None."""
    if not response:
        return None
    matches = _ANSWER_RE.findall(response)
    if matches:
        return matches[-1].upper()
    for box in reversed(boxed_contents(response)):
        m = _BOX_RE.match(box)
        if m:
            return m.group(1)
    lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
    if lines:
        m = _LAST_LINE_RE.match(lines[-1]) or _LAST_PAREN_RE.search(lines[-1])
        if m:
            return m.group(1)
    return None


def grade(text: str | None, gold_letter: str) -> Grade:
    response, unterminated = response_section(text)
    letter = None if unterminated else extract_letter(response)
    return Grade(extracted=letter, correct=letter == gold_letter, truncated=unterminated)
