"""Start, watch and stop one ``python -m sglang.launch_server`` process.

The one server launcher of the repository: ``sglang-oscar serve`` / ``eval-recipe``
(:mod:`sglang_oscar.evals.launcher` composes their argv from a recipe) and the end-to-end
device harness (``tests/e2e``) both run their servers through :class:`ServerProcess`.

* a server runs in its own session, so :meth:`ServerProcess.stop` ends its whole process
  group (tensor-parallel workers and helpers included, also after the leader has exited);
* the health check and the local HTTP helpers (:func:`http_json`, :func:`stream_generate`, also
  used by ``benchmarks/bench_served.py`` and ``tests/e2e``) never go through ``http_proxy``: the server is
  on this machine and a proxy cannot reach its 127.0.0.1;
* the server gets the caller's environment plus the ``env`` it is given, nothing else;
* :func:`sigterm_exits` turns a device call's timeout into one ``SystemExit`` of the caller, so its
  ``finally`` stops the servers and writes partial results;
* :func:`write_plugin_folder` and :func:`pythonpath_with` give a server harness-only SGLang plugins
  (``tests/e2e``'s shims, ``benchmarks/fill_shim.py``) through its ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from sglang_oscar.errors import CLIError


class LaunchError(CLIError, RuntimeError):
    """The server could not be started or did not become healthy (busy port, crash, health
    timeout). A CLI error, so ``sglang-oscar`` prints it without a traceback (exit 2)."""


def client_host(host: str) -> str:
    """The address a client on this machine uses for a server bound to ``host``."""
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def port_in_use(host: str, port: int) -> bool:
    """True when something accepts TCP connections on ``host:port`` (1 s connect timeout)."""
    try:
        with socket.create_connection((client_host(host).strip("[]"), port), timeout=1.0):
            return True
    except OSError:
        return False


# Every request here targets a server this process started on this machine.
LOCAL_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_ok(url: str, timeout: float) -> bool:
    """True when ``GET url`` answers 2xx within ``timeout`` seconds (no proxy)."""
    try:
        with LOCAL_OPENER.open(url, timeout=timeout) as resp:  # noqa: S310 (local server)
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def http_json(url: str, payload: dict | None = None, timeout: float = 60.0) -> Any:
    """GET (``payload`` None) or POST JSON to a local server; returns the decoded JSON body.

    Raises:
        RuntimeError: HTTP error status (with the body's start) or an unreachable server.
    """
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if payload is None else "POST")
    try:
        with LOCAL_OPENER.open(req, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        raise RuntimeError(f"{url}: {exc}") from None
    return json.loads(body) if body else None


def stream_generate(url: str, payload: dict, timeout: float) -> Iterator[tuple[float, int]]:
    """POST ``payload`` to a local server's ``/generate`` as a streamed request (``stream`` set,
    no proxy) and yield ``(time.perf_counter(), completion tokens so far)`` per ``data:`` chunk
    until ``[DONE]``; the count is ``meta_info.completion_tokens``, else ``len(output_ids)``.

    Raises:
        RuntimeError: a chunk reports an ``error``.
    """
    body = json.dumps({**payload, "stream": True}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=body,
                                 headers={"Content-Type": "application/json"}, method="POST")
    with LOCAL_OPENER.open(req, timeout=timeout) as r:  # noqa: S310 (local server)
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(str(obj["error"])[:300])
            n = (obj.get("meta_info") or {}).get("completion_tokens")
            yield time.perf_counter(), int(len(obj.get("output_ids") or []) if n is None else n)


def tail(path: Path | str | None, n: int = 60) -> str:
    """The last ``n`` lines of a log file (from its last 64 KiB), or ``(no server log)``."""
    if path is None or not Path(path).exists():
        return "(no server log)"
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 64 * 1024))
        text = fh.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-n:])


class ServerProcess:
    """One server process: its argv, extra environment, address and log.

    ``log_path`` None sends the output to the terminal; otherwise it is appended to the file,
    or, with ``log_header`` (e.g. the command line), the file is started afresh with that line.
    Times (``time.time()``): ``t_start`` when started, ``t_ready`` when healthy, ``t_exit`` when
    the process exited (stamped by a watcher thread the moment it happens).
    """

    def __init__(self, argv: Sequence[str], *, host: str = "127.0.0.1", port: int = 30000,
                 env: dict[str, str] | None = None, log_path: Path | str | None = None,
                 log_header: str | None = None, cwd: str | None = None):
        self.argv = list(argv)
        self.host, self.port = host, int(port)
        self.env = dict(env or {})
        self.log_path = None if log_path is None else Path(log_path)
        self.log_header = log_header
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self._log_fh = None
        self.t_start = 0.0
        self.t_ready: float | None = None
        self.t_exit: float | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port`` as a client on this machine reaches it."""
        return f"http://{client_host(self.host)}:{self.port}"

    def shell(self) -> str:
        """One shell-quoted line, the extra environment first."""
        parts = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        if parts:
            parts.insert(0, "env")
        return " ".join(parts + [shlex.join(self.argv)])

    def start(self, check_port: bool = True) -> "ServerProcess":
        """Start the server in its own session/process group.

        Raises:
            LaunchError: ``check_port`` and something already listens on the port (it would
                answer the health check and the requests meant for this server).
        """
        if check_port and port_in_use(self.host, self.port):
            raise LaunchError(
                f"port {self.port} on {self.host} is already in use: another server "
                "would answer the health check and the eval; stop it or use --port"
            )
        env = dict(os.environ)
        env.update(self.env)
        out = None  # inherit the terminal
        if self.log_path is not None:
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
            self._log_fh = open(self.log_path, "wb" if self.log_header is not None else "ab")
            if self.log_header is not None:
                self._log_fh.write((self.log_header.rstrip("\n") + "\n").encode())
                self._log_fh.flush()
            out = self._log_fh
        self.t_start = time.time()
        self.proc = subprocess.Popen(
            self.argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT if out is not None else None, start_new_session=True,
        )
        threading.Thread(target=self._watch, daemon=True).start()
        return self

    def _watch(self) -> None:
        self.proc.wait()
        self.t_exit = time.time()

    @property
    def pid(self) -> int:
        """The server's pid, which is also its process group id."""
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        """The whole log ('' when there is none yet)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except (OSError, TypeError):
            return ""

    def poll_health(self, timeout: float, interval: float = 1.0) -> str:
        """Poll ``GET /health`` for at most ``timeout`` seconds: ``"healthy"`` (``t_ready``
        set), ``"exited"`` (the process ended first) or ``"timeout"``; stops nothing."""
        assert self.proc is not None
        url = self.base_url + "/health"
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                return "exited"
            if http_ok(url, timeout=min(10.0, max(interval, 1.0))):
                self.t_ready = time.time()
                return "healthy"
            if time.monotonic() >= deadline:
                return "timeout"
            time.sleep(interval)

    def wait_healthy(self, timeout: float = 1800.0, interval: float = 1.0) -> None:
        """Wait for ``GET /health`` to answer 200.

        Raises:
            LaunchError: the process exited, or ``timeout`` seconds passed (the server is then
                stopped); the message holds the log's last lines.
        """
        state = self.poll_health(timeout, interval)
        if state == "exited":
            self.stop(grace=5.0)  # helpers it may have left behind
            raise LaunchError(
                f"the server exited with status {self.proc.returncode} before it became healthy; "
                f"last lines of {self.log_path}:\n{tail(self.log_path)}"
            )
        if state == "timeout":
            self.stop()
            raise LaunchError(
                f"the server did not answer {self.base_url}/health within {timeout:.0f} s (stopped it); "
                f"last lines of {self.log_path}:\n{tail(self.log_path)}"
            )

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status once the process has ended within ``timeout`` seconds of its start
        (``t_exit`` stamped), else None."""
        try:
            rc = self.proc.wait(timeout=max(0.0, self.t_start + timeout - time.time()))
        except subprocess.TimeoutExpired:
            return None
        while self.t_exit is None:  # the watcher thread stamps the exit time
            time.sleep(0.01)
        return rc

    def wait(self) -> int:
        """Wait for the server to exit and return its status; Ctrl-C stops it (130)."""
        assert self.proc is not None
        try:
            return self.proc.wait()
        except KeyboardInterrupt:
            self.stop()
            return 130

    def stop(self, grace: float = 30.0) -> int | None:
        """Terminate the server's whole process group (TP workers and other helpers included,
        also when the main process has already exited): SIGTERM, then SIGKILL for whatever is
        left after ``grace`` seconds. Returns the main process's exit status."""
        if self.proc is None:
            return None
        pgid = self.proc.pid
        deadline = time.monotonic() + grace
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def tree_commit(cwd: str | os.PathLike) -> str | None:
    """The commit of the tree a device script runs: ``$OSCAR_COMMIT`` when the caller names it (a
    device machine's copy of the checkout brings the current working tree, but its ``HEAD`` was seen
    to name the session's starting commit), else ``git rev-parse --short HEAD`` in ``cwd``; ``None``
    where git cannot answer."""
    if os.environ.get("OSCAR_COMMIT"):
        return os.environ["OSCAR_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def write_plugin_folder(path: str, dist_name: str, modules: dict[str, str], entry_points: dict[str, str]) -> str:
    """SGLang plugins for a process with ``path`` on its PYTHONPATH (:func:`pythonpath_with`): each of
    ``modules`` (top-level module name -> source file) copied into ``path``, and a minimal
    ``path/<dist_name>-0.dist-info`` (METADATA, entry_points.txt) listing ``entry_points`` (name ->
    ``"module:function"``) in the ``sglang.srt.plugins`` group that SGLang's ``load_plugins`` reads.
    Returns ``path``."""
    info = os.path.join(path, f"{dist_name}-0.dist-info")
    os.makedirs(info, exist_ok=True)
    for module, source in modules.items():
        shutil.copyfile(os.path.abspath(source), os.path.join(path, f"{module}.py"))
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\n" + "".join(f"{name} = {value}\n" for name, value in entry_points.items()))
    return path


def pythonpath_with(folder: str, pythonpath: str) -> str:
    """A ``PYTHONPATH`` with ``folder`` first, then ``pythonpath``'s entries (``os.pathsep``
    separated), each once."""
    return os.pathsep.join(dict.fromkeys([folder, *filter(None, pythonpath.split(os.pathsep))]))


def stop_all(servers: Iterable[ServerProcess], grace: float | None = None) -> None:
    """Stop several servers in parallel (each :meth:`ServerProcess.stop`, with ``grace`` seconds when
    given, else the server's own default): one after another, a run's four or more servers would each
    wait out their grace and outlast a device call's kill deadline."""
    servers = list(servers)
    if not servers:
        return
    with ThreadPoolExecutor(max_workers=min(8, len(servers))) as ex:
        list(ex.map(lambda srv: srv.stop() if grace is None else srv.stop(grace=grace), servers))


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within the block, the first SIGTERM raises ``SystemExit(128 + SIGTERM)`` in the main thread and
    later ones are ignored: ``timeout(1)`` signals its command and then the command's process group,
    and a second exit raised inside the caller's ``finally`` would skip stopping its servers and
    writing its results. The previous handler is restored on leaving the block.

    Raises:
        ValueError: outside the main thread (``signal.signal``'s rule).
    """
    def handler(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a member that is not a zombie (zombies of
    reparented helpers may never be reaped in a container whose init does not reap)."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc: ask the kernel (zombies count as alive there)
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields: state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False
