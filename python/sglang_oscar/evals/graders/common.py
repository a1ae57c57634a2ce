"""Helpers shared by the graders: the response section of a thinking model's output and
balanced ``\\boxed{...}`` extraction."""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class Grade:
    """Result of grading one response."""

    extracted: str | None  # the answer the grader read (None: no answer found)
    correct: bool
    truncated: bool  # the output ended inside the reasoning block (no answer section)
    normalized: str | None = None  # MATH-500: math-verify's reading of ``extracted``


def response_section(text: str | None) -> tuple[str, bool]:
    """Split off the reasoning block: returns (response text, reasoning_unterminated).

    * ``...</think> answer`` (with or without the opening tag, which many chat templates put
      in the prompt) -> the text after the last ``</think>``;
    * ``<think> ...`` without a closing tag -> ``("", True)``: the generation ended inside the
      reasoning, there is no answer to score;
    * no tags at all -> the whole text.
    """
    if not text:
        return "", False
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        return text[close + len(THINK_CLOSE) :], False
    if THINK_OPEN in text:
        return "", True
    return text, False


def boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (balanced braces),
    in order of appearance. An unbalanced last box is ignored."""
    return [content for _, content in boxed_spans(text)]


def boxed_spans(text: str) -> list[tuple[int, str]]:
    """Like :func:`boxed_contents`, with the offset of each box's content in ``text``."""
    out: list[tuple[int, str]] = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth = 1
        i = m.end()
        start = i
        while i < len(text) and depth:
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            i += 1
        if depth == 0:
            out.append((start, text[start : i - 1]))
    return out


def last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` in ``text``, or None."""
    boxes = boxed_contents(text)
    return boxes[-1] if boxes else None
