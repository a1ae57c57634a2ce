"""MATH-500 grader: equivalence through the ``math-verify`` library.

The answer is the last balanced ``\\boxed{}`` of the response section (after the reasoning
block), parsed by ``math_verify.parse``; without a box the whole response section is parsed
(math-verify then looks for "final answer is" forms and bare expressions). ``extracted`` is
the raw text read (the box content, or the substring math-verify matched) and
``normalized`` math-verify's rendering of it. The gold answer is parsed from
``$<answer>$`` (every row is checked when the dataset is loaded, :func:`parse_gold`). ``math_verify.verify(gold, prediction)`` decides:
``\\frac{1}{2}`` = ``0.5`` = ``\\dfrac12``, ``(x+1)^2`` = ``x^2+2x+1``, intervals, sets, units
and ``^\\circ`` stripped, ``\\text{(C)}`` = ``C``.

math-verify guards parsing and verification with ``SIGALRM`` timeouts, which only work in
the main thread; the runner grades there.
"""

from __future__ import annotations

from sglang_oscar.evals.graders.common import Grade, last_boxed, response_section


def _parse(text: str):
    from math_verify import parse

    return parse(text)


def parse_gold(gold: str):
    """math-verify's parse of a gold answer; ValueError if nothing can be parsed."""
    parsed = _parse(f"${gold}$")
    if not parsed:
        raise ValueError(f"MATH-500 gold answer {gold!r} could not be parsed by math-verify")
    return parsed


def extract(response: str):
    """Parse the answer: the last balanced ``\\boxed{}`` alone when there is one (math-verify
    would otherwise merge several boxes into a set), else the whole response section."""
    if not response.strip():
        return []
    box = last_boxed(response)
    if box is not None:
        return _parse("$\\boxed{" + box + "}$")
    return _parse(response)


def grade(text: str | None, gold: str) -> Grade:
    """Grade one raw model output against the gold answer (LaTeX, as in the dataset)."""
    from math_verify import verify

    response, unterminated = response_section(text)
    if unterminated:
        return Grade(extracted=None, correct=False, truncated=True)
    pred = extract(response)
    if not pred:
        return Grade(extracted=None, correct=False, truncated=False)
    gold_parsed = parse_gold(gold)
    box = last_boxed(response)
    matched = pred[-1] if isinstance(pred[-1], str) else None
    raw = box if box is not None else (matched if matched is not None else str(pred[0]))
    normalized = str(pred[0])
    return Grade(extracted=raw, correct=bool(verify(gold_parsed, pred)), truncated=False,
                 normalized=normalized)
