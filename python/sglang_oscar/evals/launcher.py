"""Compose the SGLang server command line from a recipe, start it and wait for health.

Rules (spec §9.1 and §11.1):

* the argv is a list built in one place; no shell, no word splitting, never an empty element;
* every flag appears at most once: a flag that the recipe sets through a key may not be
  repeated in ``[serve].extra_args`` (argparse keeps the last value, which silently broke
  multi-node launches upstream); the only default that ``extra_args`` may replace is the
  attention backend;
* multi-node flags (``--nnodes``, ``--node-rank``, ``--dist-init-addr``) come from the command
  line only, are added once, with ``--dist-timeout 3600`` for more than one node;
* the server gets exactly the environment of the caller plus ``[serve].env`` from the recipe;
  nothing else is exported on the user's behalf.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from sglang_oscar.evals.errors import EvalError
from sglang_oscar.evals.recipe import Recipe

# What follows ``python`` in the server argv. Tests point it at a fake server script.
SERVER_ENTRY: list[str] = ["-m", "sglang.launch_server"]

KV_MODES = ("int2", "bf16")
MULTI_NODE_DIST_TIMEOUT = 3600
DEFAULT_ATTENTION_BACKEND = "triton"

# Flags that the launcher adds unless ``extra_args`` sets them.
_DEFAULTED_FLAGS = ("--attention-backend", "--dist-timeout")
# Flags that ``extra_args`` may not repeat, because the recipe or the command line sets them.
_RESERVED_FLAGS = {
    "--model-path": "[model].hf_id",
    "--model": "[model].hf_id",
    "--tp-size": "[serve].tp",
    "--tensor-parallel-size": "[serve].tp",
    "--tp": "[serve].tp",
    "--host": "[serve].host",
    "--port": "[serve].port",
    "--kv-cache-dtype": "serve --kv",
    "--kv-cache-quant-group-size": "[quant].group_size",
    "--context-length": "[serve].context_length / [model].context_length",
    "--mem-fraction-static": "[serve].mem_fraction_static",
    "--max-running-requests": "[serve].max_running_requests",
    "--json-model-override-args": "[model].json_model_override_args",
    "--nnodes": "serve --nnodes",
    "--node-rank": "serve --node-rank",
    "--dist-init-addr": "serve --dist-init-addr",
    "--nccl-init-addr": "serve --dist-init-addr",
}
_OSCAR_FLAG_PREFIX = "--oscar-"


class LaunchError(EvalError, RuntimeError):
    """The server could not be started or did not become healthy (busy port, crash, health
    timeout). An :class:`EvalError`, so the CLI prints it without a traceback (exit 2)."""


@dataclass
class ServerCommand:
    """A composed server launch: argv, the recipe's extra environment, where it listens."""

    argv: list[str]  # full argv, argv[0] is the Python interpreter
    env: dict[str, str] = field(default_factory=dict)  # only the recipe's [serve].env
    host: str = "127.0.0.1"
    port: int = 30000
    kv: str = "int2"
    model: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def server_args(self) -> list[str]:
        """The arguments after ``-m sglang.launch_server`` (what SGLang's parser sees)."""
        return self.argv[1 + len(SERVER_ENTRY) :]

    def shell(self) -> str:
        """One shell-quoted line, environment assignments first."""
        parts = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        if parts:
            parts.insert(0, "env")
        return " ".join(parts + [shlex.join(self.argv)])

    @property
    def base_url(self) -> str:
        """``http://host:port`` as a client on this machine reaches it."""
        return f"http://{_client_host(self.host)}:{self.port}"


def _client_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def _flag_name(arg: str) -> str | None:
    if not arg.startswith("--"):
        return None
    return arg.split("=", 1)[0]


def _fmt_float(x: float) -> str:
    return repr(float(x))


def build_server_command(
    recipe: Recipe,
    kv: str = "int2",
    *,
    nnodes: int | None = None,
    node_rank: int | None = None,
    dist_init_addr: str | None = None,
    port: int | None = None,
    check_files: bool = True,
    python: str | None = None,
) -> ServerCommand:
    """Build the server argv for one arm (``kv`` = ``int2`` or ``bf16``).

    ``check_files``: refuse an int2 command whose rotation file is missing (the default for a
    real launch). With ``check_files=False`` (dry runs) the problem is reported in
    ``ServerCommand.warnings`` instead.
    """
    if kv not in KV_MODES:
        raise ValueError(f"--kv must be one of {', '.join(KV_MODES)}, got {kv!r}")
    m, q, s, rot = recipe.model, recipe.quant, recipe.serve, recipe.rotation
    warnings: list[str] = []

    if kv == "int2" and not m.served:
        raise ValueError(
            f"{m.hf_id} ({recipe.path}): the int2 serving path for model family "
            f"'{m.family}' is not built yet ([model].served = false); "
            "only --kv bf16 can be served for this model"
        )

    # extra_args: no empty elements, no flag that the recipe sets elsewhere, no duplicates.
    extra = list(s.extra_args)
    seen: set[str] = set()
    for a in extra:
        name = _flag_name(a)
        if name is None:
            continue
        known = [*_RESERVED_FLAGS, *_DEFAULTED_FLAGS]
        abbreviated = [r for r in known if r != name and r.startswith(name)]
        if abbreviated:
            origin = (f" (and that one comes from {_RESERVED_FLAGS[abbreviated[0]]})"
                      if abbreviated[0] in _RESERVED_FLAGS else "")
            raise ValueError(
                f"{recipe.path}: [serve].extra_args has {name}, an abbreviation of "
                f"{abbreviated[0]}; write flags in full{origin}"
            )
        if name in _RESERVED_FLAGS:
            raise ValueError(
                f"{recipe.path}: [serve].extra_args sets {name}, which comes from "
                f"{_RESERVED_FLAGS[name]}; set it in one place only"
            )
        if name.startswith(_OSCAR_FLAG_PREFIX):
            raise ValueError(
                f"{recipe.path}: [serve].extra_args sets {name}; OSCAR flags come from the "
                "[rotation] and [quant] sections"
            )
        if name in seen:
            raise ValueError(f"{recipe.path}: [serve].extra_args repeats {name}")
        seen.add(name)

    multi = nnodes is not None and nnodes > 1
    if (node_rank not in (None, 0) or dist_init_addr) and not multi:
        raise ValueError("--node-rank / --dist-init-addr need --nnodes > 1")
    if multi:
        if node_rank is None or dist_init_addr is None:
            raise ValueError("a multi-node launch needs --node-rank and --dist-init-addr")
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank must be in [0, {nnodes}), got {node_rank}")

    host = s.host
    the_port = port if port is not None else s.port
    argv: list[str] = [python or sys.executable, *SERVER_ENTRY]
    argv += ["--model-path", m.hf_id]
    argv += ["--tp-size", str(s.tp)]
    argv += ["--host", host, "--port", str(the_port)]
    if kv == "int2":
        argv += ["--kv-cache-dtype", "int2"]
        if q.group_size is not None:
            argv += ["--kv-cache-quant-group-size", str(q.group_size)]
        rpath = recipe.rotation_path
        if rot.method in ("oscar", "oscar-perhead") and rpath is None:
            msg = (
                f"{recipe.path}: [rotation].method = '{rot.method}' needs [rotation].path; "
                "INT2 without its calibrated rotation collapses (spec §11.1 item 8)"
            )
            if check_files:
                raise ValueError(msg)
            warnings.append(msg)
        if rpath is not None:
            if not rpath.exists():
                found = sorted(p.name for p in rpath.parent.glob("*")) if rpath.parent.is_dir() else []
                msg = (
                    f"{recipe.path}: rotation file {rpath} does not exist "
                    f"(found in {rpath.parent}: {', '.join(found) or 'nothing'})"
                )
                if check_files:
                    raise FileNotFoundError(msg)
                warnings.append(msg)
            argv += ["--oscar-rotation", str(rpath)]
        argv += ["--oscar-k-clip-ratio", _fmt_float(q.k_clip_ratio)]
        argv += ["--oscar-v-clip-ratio", _fmt_float(q.v_clip_ratio)]
        argv += ["--oscar-sink-tokens", str(q.sink_tokens)]
        argv += ["--oscar-recent-tokens", str(q.recent_tokens)]
        if q.quantizer is not None:
            argv += ["--oscar-quantizer", q.quantizer]
        if q.scale_dtype is not None:
            argv += ["--oscar-scale-dtype", q.scale_dtype]
    else:
        argv += ["--kv-cache-dtype", "auto"]
    # Same attention backend in both arms (the paired control must differ only in the KV).
    if "--attention-backend" not in seen:
        argv += ["--attention-backend", DEFAULT_ATTENTION_BACKEND]
    if recipe.context_length is not None:
        argv += ["--context-length", str(recipe.context_length)]
    if s.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", _fmt_float(s.mem_fraction_static)]
    if s.max_running_requests is not None:
        argv += ["--max-running-requests", str(s.max_running_requests)]
    if m.json_model_override_args:
        argv += [
            "--json-model-override-args",
            json.dumps(m.json_model_override_args, separators=(",", ":"), sort_keys=True),
        ]
    if multi:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
        argv += ["--dist-init-addr", dist_init_addr]
        if "--dist-timeout" not in seen:
            argv += ["--dist-timeout", str(MULTI_NODE_DIST_TIMEOUT)]
    argv += extra

    assert all(isinstance(a, str) and a != "" for a in argv), argv
    return ServerCommand(
        argv=argv,
        env=dict(s.env),
        host=host,
        port=the_port,
        kv=kv,
        model=m.hf_id,
        warnings=warnings,
    )


# ----------------------------------------------------------------------------- running


def port_in_use(host: str, port: int) -> bool:
    """True when something accepts TCP connections on ``host:port`` (1 s connect timeout)."""
    try:
        with socket.create_connection((_client_host(host).strip("[]"), port), timeout=1.0):
            return True
    except OSError:
        return False


# The health check always targets the server this process started on this machine: never
# through http_proxy / https_proxy (a proxy cannot reach our 127.0.0.1).
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_ok(url: str, timeout: float) -> bool:
    try:
        with _NO_PROXY_OPENER.open(url, timeout=timeout) as resp:  # noqa: S310 (local server)
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: Path | None, n: int = 60) -> str:
    """The last ``n`` lines of a log file (from its last 64 KiB), or ``(no server log)``."""
    if path is None or not Path(path).exists():
        return "(no server log)"
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 64 * 1024))
        text = fh.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-n:])


class Server:
    """A running server process started from a :class:`ServerCommand`."""

    def __init__(self, cmd: ServerCommand, log_path: Path | None):
        self.cmd = cmd
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log_fh = None

    def start(self) -> "Server":
        """Start the server in its own session/process group; raises :class:`LaunchError`
        when the port is already in use. Output goes to ``log_path`` (appended) or, when it is
        None, to the terminal."""
        if port_in_use(self.cmd.host, self.cmd.port):
            raise LaunchError(
                f"port {self.cmd.port} on {self.cmd.host} is already in use: another server "
                "would answer the health check and the eval; stop it or use --port"
            )
        env = dict(os.environ)
        env.update(self.cmd.env)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_fh = open(self.log_path, "ab")
            out = self._log_fh
        else:
            out = None  # inherit the terminal
        self.proc = subprocess.Popen(
            self.cmd.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int:
        """The server's pid, which is also its process group id."""
        assert self.proc is not None
        return self.proc.pid

    def wait_healthy(self, timeout: float = 1800.0, interval: float = 1.0) -> None:
        """Poll ``GET /health`` until it answers 200; raise :class:`LaunchError` with the log
        tail if the process exits or ``timeout`` seconds pass."""
        assert self.proc is not None
        url = self.cmd.base_url + "/health"
        deadline = time.monotonic() + timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.stop(grace=5.0)  # helpers it may have left behind
                raise LaunchError(
                    f"the server exited with status {rc} before it became healthy; "
                    f"last lines of {self.log_path}:\n{tail(self.log_path)}"
                )
            if _http_ok(url, timeout=min(10.0, max(interval, 1.0))):
                return
            if time.monotonic() >= deadline:
                self.stop()
                raise LaunchError(
                    f"the server did not answer {url} within {timeout:.0f} s (stopped it); "
                    f"last lines of {self.log_path}:\n{tail(self.log_path)}"
                )
            time.sleep(interval)

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

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


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


def default_log_path(cmd: ServerCommand) -> Path:
    """A new, empty log file in the temp dir named after the arm and port."""
    fd, name = tempfile.mkstemp(prefix=f"sglang-oscar-serve-{cmd.kv}-{cmd.port}-", suffix=".log")
    os.close(fd)
    return Path(name)
