"""Compose the SGLang server command line from a recipe; :class:`Server` runs it.

Starting, health checks and stopping are :mod:`sglang_oscar.serving_launcher`'s, shared with
the end-to-end device harness (``tests/e2e``).

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
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sglang_oscar.evals.recipe import Recipe
from sglang_oscar.serving_launcher import LaunchError, ServerProcess, client_host, port_in_use, tail

__all__ = ["KV_MODES", "SERVER_ENTRY", "LaunchError", "Server", "ServerCommand", "build_server_command",
           "default_log_path", "port_in_use", "tail"]

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
        return f"http://{client_host(self.host)}:{self.port}"


def _flag_name(arg: str) -> str | None:
    if not arg.startswith("--"):
        return None
    return arg.split("=", 1)[0]


def _fmt_float(x: float) -> str:
    return repr(float(x))


def _check_host_port(addr: str) -> None:
    """ValueError unless ``addr`` is ``HOST:PORT`` (the rank-0 node's address, as SGLang's
    ``--dist-init-addr`` takes it): a malformed one would leave the other nodes waiting at the
    rendezvous for the whole ``--dist-timeout``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--dist-init-addr must be HOST:PORT of the rank-0 node (e.g. 10.0.0.1:5000), got {addr!r}")


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
            f"{m.hf_id} ({recipe.path}): [model].served = false: the int2 serving path for model family "
            f"'{m.family}' is not built or has not passed its H200 end-to-end checks (the recipe's notes say "
            "which); serve it with --kv bf16 (eval-recipe: --arms bf16), or launch python -m sglang.launch_server "
            "--kv-cache-dtype int2 yourself if the notes say the path is built"
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
    if (node_rank not in (None, 0) or dist_init_addr is not None) and not multi:
        raise ValueError("--node-rank / --dist-init-addr need --nnodes > 1")
    if multi:
        if node_rank is None or dist_init_addr is None:
            raise ValueError("a multi-node launch needs --node-rank and --dist-init-addr")
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank must be in [0, {nnodes}), got {node_rank}")
        _check_host_port(dist_init_addr)

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
        if recipe.geometry.kv_lora_rank is None:  # an MLA latent has no V half to clip
            argv += ["--oscar-v-clip-ratio", _fmt_float(q.v_clip_ratio)]
        argv += ["--oscar-sink-tokens", str(q.sink_tokens)]
        argv += ["--oscar-recent-tokens", str(q.recent_tokens)]
        if q.quantizer is not None:
            argv += ["--oscar-quantizer", q.quantizer]
        if q.scale_dtype is not None:
            argv += ["--oscar-scale-dtype", q.scale_dtype]
        if q.fold_rotations:
            argv += ["--oscar-fold-rotations", "on"]
        if q.skip_layers != "none":
            argv += ["--oscar-skip-layers", q.skip_layers]
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


class Server(ServerProcess):
    """A server process started from a :class:`ServerCommand` (output appended to
    ``log_path``, or the terminal when it is None); see :class:`ServerProcess`."""

    def __init__(self, cmd: ServerCommand, log_path: Path | None):
        super().__init__(cmd.argv, host=cmd.host, port=cmd.port, env=cmd.env, log_path=log_path)
        self.cmd = cmd


def default_log_path(cmd: ServerCommand) -> Path:
    """A new, empty log file in the temp dir named after the arm and port."""
    fd, name = tempfile.mkstemp(prefix=f"sglang-oscar-serve-{cmd.kv}-{cmd.port}-", suffix=".log")
    os.close(fd)
    return Path(name)
