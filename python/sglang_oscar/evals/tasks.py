"""The four tasks: prompt construction and grading of one sample.

GPQA's answer options are shuffled by a permutation drawn from a generator seeded with
``(seed, question index)`` alone, so a question gets the same permutation whatever
``--n-examples`` is and whichever other questions are asked (upstream's single RNG stream made
a 40-question run share 1 of 40 permutations with the full run, spec §9.2).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

from sglang_oscar.evals.datasets import TASKS, Sample, check_task
from sglang_oscar.evals.graders import aime, gpqa, humaneval, math500
from sglang_oscar.evals.graders.common import Grade
# Bump when a prompt template changes: recorded with every run so that resumed/compared runs
# cannot mix prompt versions silently.
PROMPT_VERSION = 1

GPQA_TEMPLATE = (
    "Answer the following multiple-choice question. Think it through step by step, then give "
    "your final answer on the last line in the form 'Answer: X', where X is one of A, B, C or D."
    "\n\n{question}\n\nA) {A}\nB) {B}\nC) {C}\nD) {D}"
)
AIME_TEMPLATE = (
    "{problem}\n\nReason step by step and put your final answer, an integer from 0 to 999, "
    "within \\boxed{{}}."
)
MATH_TEMPLATE = "{problem}\n\nReason step by step and put your final answer within \\boxed{{}}."
HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the complete function, including its "
    "signature and the imports it needs, in a single ```python code block.\n\n"
    "```python\n{prompt}```"
)


def _sha(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class Prompt:
    """What is asked for one (seed, sample) and what it is graded against."""

    messages: list[dict[str, str]]
    gold: str  # the reference answer as recorded (GPQA: letter; HumanEval: task id)
    meta: dict[str, Any]
    # Everything the grade depends on besides the response (gold; HumanEval: also the tests)
    reference: dict[str, Any] | None = None

    @property
    def sha(self) -> str:
        """Hash of the messages: a resumed or compared row must have been asked this."""
        return _sha(self.messages)

    @property
    def gold_sha(self) -> str:
        """Hash of the grading reference: a kept row must have been graded against this."""
        return _sha(self.reference if self.reference is not None else {"gold": self.gold})


def gpqa_permutation(seed: int, index: int) -> list[int]:
    """Order of [correct, incorrect1, incorrect2, incorrect3] shown as A, B, C, D."""
    rng = random.Random(f"sglang-oscar/gpqa/{seed}/{index}")
    order = [0, 1, 2, 3]
    rng.shuffle(order)
    return order


def build_prompt(task: str, sample: Sample, seed: int, system_prompt: str | None = None) -> Prompt:
    """The chat messages, gold answer and metadata for ``sample`` under ``seed`` (only GPQA
    depends on the seed). Raises :class:`EvalError` for an unknown task and ValueError for a
    gold answer that cannot be read (datasets are checked when loaded, so not in practice)."""
    check_task(task)
    f = sample.fields
    meta: dict[str, Any] = {}
    if task == "gpqa":
        options = [f["correct"], f["incorrect1"], f["incorrect2"], f["incorrect3"]]
        options = [str(o).strip() for o in options]
        order = gpqa_permutation(seed, sample.index)
        shown = {letter: options[j] for letter, j in zip("ABCD", order)}
        text = GPQA_TEMPLATE.format(question=str(f["question"]).strip(), **shown)
        gold = "ABCD"[order.index(0)]
        meta["permutation"] = order
    elif task == "aime25":
        text = AIME_TEMPLATE.format(problem=str(f["problem"]).strip())
        gold = str(aime.parse_gold(f["answer"]))
    elif task == "math500":
        text = MATH_TEMPLATE.format(problem=str(f["problem"]).strip())
        gold = str(f["answer"])
    else:  # humaneval
        text = HUMANEVAL_TEMPLATE.format(prompt=f["prompt"])
        gold = str(f["task_id"])
    reference: dict[str, Any] = {"gold": gold}
    if task == "humaneval":
        reference.update(test=str(f["test"]), entry_point=str(f["entry_point"]))
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": text})
    return Prompt(messages=messages, gold=gold, meta=meta, reference=reference)


def grade(task: str, text: str | None, sample: Sample, prompt: Prompt, *,
          humaneval_timeout: float = humaneval.DEFAULT_TIMEOUT_S) -> tuple[Grade, str | None]:
    """Grade one response ``text`` (None or "" = no answer) against ``prompt.gold`` (HumanEval:
    the sample's tests). Returns (grade, note) where note explains HumanEval results."""
    check_task(task)
    if task == "gpqa":
        return gpqa.grade(text, prompt.gold), None
    if task == "aime25":
        return aime.grade(text, prompt.gold), None
    if task == "math500":
        return math500.grade(text, prompt.gold), None
    return humaneval.grade(text, sample.fields, timeout=humaneval_timeout)


__all__ = ["TASKS", "PROMPT_VERSION", "Prompt", "build_prompt", "check_task", "grade",
           "gpqa_permutation"]
