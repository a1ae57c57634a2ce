"""MATH-500 grader: equivalence through the ``math-verify`` library.

The answer is the last balanced ``\\boxed{}`` of the response section (after the reasoning
block), parsed by ``math_verify.parse``; without a box the whole response section is parsed
(math-verify then looks for "final answer is" forms and bare expressions). The gold answer
is parsed from ``$<answer>$``. ``math_verify.verify(gold, prediction)`` decides:
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
    from math_verify import verify

    response, unterminated = response_section(text)
    if unterminated:
        return Grade(extracted=None, correct=False, truncated=True)
    pred = extract(response)
    if not pred:
        return Grade(extracted=None, correct=False, truncated=False)
    gold_parsed = _parse(f"${gold}$")
    if not gold_parsed:
        raise ValueError(f"MATH-500 gold answer {gold!r} could not be parsed")
    shown = pred[-1] if isinstance(pred[-1], str) else str(pred[0])
    return Grade(extracted=shown, correct=bool(verify(gold_parsed, pred)), truncated=False)
