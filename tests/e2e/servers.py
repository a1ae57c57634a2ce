"""The servers of a run: one :class:`ServerSpec` per distinct server the selected checks need,
its ``sglang.launch_server`` argv, and :class:`Server`, the shared
:class:`sglang_oscar.serving_launcher.ServerProcess` with the harness's log and error reporting.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from typing import Any

from sglang_oscar.serving_launcher import LaunchError, ServerProcess

from .client import http_json, last_error
from .config import (B_RECENT, B_SINK, C_FP32_SCALE_DTYPE, C_RECENT, C_SINK, FAMILY_BAD_ROTATIONS,
                     HYBRID_SWA_FAMILIES, OWN_BACKEND_ASSERT, ROOT, ROUTED_FAMILIES, SIZED_FAMILIES, SWA_FAMILIES,
                     h_families, main_families)
from .families import sglang_override_args, sizing_group_size
from .fp32_shim import C_FP32_SERVERS, fp32_args, fp32_name, fp32_server_env, hf_window_server_env


@dataclasses.dataclass
class ServerSpec:
    """One ``sglang.launch_server`` process of the run."""

    name: str
    model: str  # model key (qwen3, moe, llama, long, gemma3, gemma4, gpt_oss, qwen3_next)
    args: list[str]  # extra sglang flags
    checks: str  # check letters that use it
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    phase: int = 1  # 1: concurrent; 2: alone (sequential, in list order)
    expect_fail: bool = False
    tp: int = 1
    mem_fraction: float | None = None
    pool_tokens: int | None = None  # --max-total-tokens (None: uncapped)
    max_running: int = 16
    port: int = 0
    gpu: int = 0
    case: str = ""  # check i: the BAD_INPUT_EXPECT entry of a bad launch


def server_specs(args: argparse.Namespace, rot: dict[str, str]) -> list[ServerSpec]:
    """Every server the selected checks need (deduplicated), with ports assigned. Checks a, c, d,
    e, i run on each of :func:`~.config.main_families` (servers ``<family>-...``; check i's generic
    cases on the first one only, :data:`~.config.FAMILY_BAD_ROTATIONS` on their family), b on
    every ``--families`` entry; f's sizing pairs on the :data:`~.config.SIZED_FAMILIES`; g on
    qwen3 (``long``); h on each of :func:`~.config.h_families`: ``<family>-int2-head`` (c's per-head
    server) and its phase-2 twin :func:`h_tp2_name`, the same spec with ``--tp-size 2``."""
    c_win = ["--oscar-sink-tokens", str(C_SINK), "--oscar-recent-tokens", str(C_RECENT)]
    b_win = ["--oscar-sink-tokens", str(B_SINK), "--oscar-recent-tokens", str(B_RECENT)]
    i2 = ["--kv-cache-dtype", "int2"] + shlex.split(args.int2_args or "")
    main = main_families(args)
    specs: list[ServerSpec] = []

    def add(spec: ServerSpec):
        for s in specs:
            if s.name == spec.name:
                s.checks = "".join(sorted(set(s.checks + spec.checks)))
                return
        specs.append(spec)

    ch = set(args.checks)
    if "a" in ch:
        # SGLANG_PLUGINS is a whitelist of entry-point names: every installed plugin but ours
        others = plugin_entry_point()["others"]
        for q in main:
            add(ServerSpec(f"{q}-plugin-off", q, [], "a", env={"SGLANG_PLUGINS": ",".join(others) or "__no_plugin__"}))
            add(ServerSpec(f"{q}-bf16", q, [], "a"))
    if "b" in ch:
        for m in args.families:
            if m in SWA_FAMILIES:  # SGLang's BF16 decode reads W - 1 keys: a baseline with the W of HF and INT2
                add(ServerSpec(b_baseline(m), m, [], "b", env=hf_window_server_env(args.work)))
            else:
                add(ServerSpec(b_baseline(m), m, [], "b"))
            add(ServerSpec(f"{m}-int2-full", m, i2 + ["--oscar-rotation", rot[f"{m}:identity"]] + b_win, "b",
                           max_running=8))
            if getattr(args, "c_fp32", False) and m in ROUTED_FAMILIES:  # check_b's docstring: fp32 twins
                f32, env32 = fp32_args(m), fp32_server_env(args.work)
                base_env = {**env32, **hf_window_server_env(args.work)} if m in SWA_FAMILIES else env32
                add(ServerSpec(b_baseline(m, fp32=True), m, list(f32), "b", env=dict(base_env)))
                add(ServerSpec(fp32_name(m, "full"), m, i2 + ["--oscar-rotation", rot[f"{m}:identity"]] + b_win + f32,
                               "b", env=dict(env32), max_running=8))
    for q in main:
        _quantizing_specs(args, add, q, rot, i2 + ["--oscar-rotation"], c_win)
    if "i" in ch:
        # generic cases on one family: not gemma4 / gpt_oss if there is another (SGLang asserts its
        # own backend list for Gemma-4, server_args.py:4709, and GPT-OSS, server_args.py:4595, in
        # ServerArgs.__post_init__, before the plugin's AFTER hook names --attention-backend); with
        # only those, no flashinfer case (SGLang refuses it itself, with its own message)
        q0 = next((q for q in main if q not in OWN_BACKEND_ASSERT), main[0])
        bad = {
            "bad-rotation-other-model": ["--oscar-rotation", rot[f"{q0}:mismatch"]],
            "bad-rotation-missing": ["--oscar-rotation", os.path.join(args.work, "no_such_rotation.safetensors")],
            "bad-group-size": ["--kv-cache-quant-group-size", "48"],
            "bad-flag-flashinfer": ["--attention-backend", "flashinfer"],
            # upstream silently turns --enable-dp-attention off when --dp-size is 1, so ask for dp 2 / tp 2
            "bad-flag-dp-attention": ["--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"],
        }
        if q0 in OWN_BACKEND_ASSERT:
            del bad["bad-flag-flashinfer"]
        cases = [(q0, name, extra) for name, extra in bad.items()]
        cases += [(q, "bad-rotation-other-model", ["--oscar-rotation", rot[f"{q}:mismatch"]]) for q in main if q != q0]
        # a family's own bad file: gemma4 one head_dim, gpt_oss centred (sinks), qwen3_next linear layers
        cases += [(q, FAMILY_BAD_ROTATIONS[q][1], ["--oscar-rotation", rot[f"{q}:{FAMILY_BAD_ROTATIONS[q][0]}"]])
                  for q in main if q in FAMILY_BAD_ROTATIONS and f"{q}:{FAMILY_BAD_ROTATIONS[q][0]}" in rot]
        for q, case, extra in cases:  # launch_command drops its own backend flag
            add(ServerSpec(case if q == q0 else f"{q}-{case}", q, i2 + extra, "i", expect_fail=True, case=case))
    if "h" in ch:
        # each family's TP 2 twin of its TP 1 reference (built by _quantizing_specs above): the same
        # flags, environment and pool cap, started alone after phase 1, one family after the other
        for q in h_families(args):
            ref = next(s for s in specs if s.name == h_reference_name(q))
            add(dataclasses.replace(ref, name=h_tp2_name(q), checks="h", phase=2, tp=2, pool_tokens=args.pool_tokens,
                                    args=list(ref.args), env=dict(ref.env)))
    sizing = [("long", "long-bf16", "long-int2")] if "g" in ch or ("f" in ch and "qwen3" in main) else []
    sizing += [(q, f"{q}-sizing-bf16", f"{q}-sizing-int2") for q in main if "f" in ch and q in SIZED_FAMILIES]
    for model, bf_name, i2_name in sizing:
        group = ["--kv-cache-quant-group-size", str(sizing_group_size(model))]
        pairs = [(bf_name, []), (i2_name, i2 + group)]
        if model in HYBRID_SWA_FAMILIES:  # f: --oscar-skip-layers sliding keeps that pool BF16
            pairs.append((f"{i2_name}-skip-sliding", i2 + group + ["--oscar-skip-layers", "sliding"]))
        for name, extra in pairs:
            add(ServerSpec(name, model, extra, "".join(c for c in "fg" if c in ch and (c == "f" or model == "long")),
                           phase=2, mem_fraction=args.sizing_mem_fraction, pool_tokens=None, max_running=8))
    extra = (["--enable-fp32-lm-head"] if args.fp32_lm_head else []) + shlex.split(args.server_args or "")
    for i, s in enumerate(specs):
        shared_gpu = s.phase == 1 and not s.expect_fail  # phase 1 starts together; phase 2 measures sizing alone
        # h's TP 2 servers run alone but keep their TP 1 reference's flags (argv differs by --tp-size only)
        fixed = shared_gpu or s.tp > 1
        s.args = s.args + sglang_override_args(s.model, max_running=s.max_running if fixed else None) + extra
        s.port = args.base_port + 10 * i
        if s.mem_fraction is None:
            s.mem_fraction = args.mem_fraction
        if s.pool_tokens is None and s.phase == 1:
            s.pool_tokens = args.pool_tokens
    return specs


def _quantizing_specs(args, add, q: str, rot: dict[str, str], i2r: list[str], c_win: list[str]) -> None:
    """The servers of checks c, d, e for family ``q`` (``i2r``: the int2 flags up to ``--oscar-rotation``)."""
    ch = set(args.checks)
    if "c" in ch:
        add(ServerSpec(f"{q}-bf16", q, [], "c"))
    if "c" in ch or "d" in ch:
        add(ServerSpec(f"{q}-int2-layer", q, i2r + [rot[f"{q}:layer"]] + c_win, "cd"))
    h = "h" in ch and q in h_families(args)  # h: this server is the TP 1 reference of h_tp2_name(q)
    if "c" in ch or h:
        add(ServerSpec(h_reference_name(q), q, i2r + [rot[f"{q}:head"]] + c_win,
                       ("c" if "c" in ch else "") + ("h" if h else "")))
    if ("c" in ch or "d" in ch) and getattr(args, "c_fp32", False):
        # c's fp32 servers; d judges its radix hit on the layer one (check_d's docstring); h keeps BF16
        f32, env32 = fp32_args(q), fp32_server_env(args.work)
        pairs = ["--oscar-scale-dtype", C_FP32_SCALE_DTYPE]
        for kind in C_FP32_SERVERS:
            uses = ("c" if "c" in ch else "") + ("d" if "d" in ch and kind == "layer" else "")
            if uses:
                add(ServerSpec(fp32_name(q, kind), q, i2r + [rot[f"{q}:{kind}"]] + c_win + f32 + pairs, uses,
                               env=dict(env32)))
        if "c" in ch:
            add(ServerSpec(fp32_name(q), q, list(f32), "c", env=dict(env32)))
        if "d" in ch and q in ROUTED_FAMILIES:
            add(ServerSpec(fp32_name(q, "layer-chunk64"), q, i2r + [rot[f"{q}:layer"]] + c_win + f32 + pairs
                           + ["--chunked-prefill-size", "64"], "d", env=dict(env32)))
    if "d" in ch:
        add(ServerSpec(f"{q}-int2-layer-chunk64", q, i2r + [rot[f"{q}:layer"]] + c_win + ["--chunked-prefill-size", "64"],
                       "d"))
        add(ServerSpec(f"{q}-int2-layer-eager", q, i2r + [rot[f"{q}:layer"]] + c_win + ["--disable-cuda-graph"], "d"))
    if "e" in ch:
        strict = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
                  "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1"}
        for name, extra in ((f"{q}-int2-load", i2r[:-1]), (f"{q}-bf16-load", [])):
            add(ServerSpec(name, q, list(extra), "e", max_running=args.load_requests, pool_tokens=args.load_pool_tokens,
                           env=dict(strict)))


def h_reference_name(family: str) -> str:
    """Check h's TP 1 server of ``family``: c's per-head rotation server ``<family>-int2-head``."""
    return f"{family}-int2-head"


def h_tp2_name(family: str) -> str:
    """Check h's TP 2 server of ``family``: ``<family>-int2-head-tp2`` (:func:`h_reference_name` + ``--tp-size 2``)."""
    return f"{family}-int2-head-tp2"


def b_baseline(family: str, fp32: bool = False) -> str:
    """Check b's BF16 server of ``family``: ``<family>-bf16``, or for a sliding-window family
    ``<family>-bf16-hf-window`` (SGLang's BF16 path with :mod:`.window_shim`); with ``fp32`` its
    ``--dtype float32`` twin (``<family>-fp32``, c's noise-floor server, or ``<family>-fp32-hf-window``)."""
    if fp32:
        return f"{family}-fp32-hf-window" if family in SWA_FAMILIES else fp32_name(family)
    return f"{family}-bf16-hf-window" if family in SWA_FAMILIES else f"{family}-bf16"


def launch_command(spec: ServerSpec, model_path: str, python: str = sys.executable) -> list[str]:
    """argv of one server (upstream flags as documented in docs/serving.md)."""
    backend = [] if "--attention-backend" in spec.args else ["--attention-backend", "triton"]
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
           "--port", str(spec.port), "--nccl-port", str(spec.port + 5), *backend,
           "--sampling-backend", "pytorch", "--grammar-backend", "none", "--skip-tokenizer-init",
           "--mem-fraction-static", f"{spec.mem_fraction:g}", "--max-running-requests", str(spec.max_running),
           "--cuda-graph-max-bs", "8", "--random-seed", "0", "--log-level", "info"]
    if spec.pool_tokens:
        cmd += ["--max-total-tokens", str(spec.pool_tokens)]
    if spec.tp > 1:
        cmd += ["--tp-size", str(spec.tp)]
    elif spec.gpu:
        cmd += ["--base-gpu-id", str(spec.gpu)]
    return cmd + list(spec.args)


class Server(ServerProcess):
    """One server of the run (:class:`~sglang_oscar.serving_launcher.ServerProcess`): its spec,
    argv, log ``log_dir/<name>.log`` (started with the command line), ``error`` once it failed."""

    def __init__(self, spec: ServerSpec, model_path: str, log_dir: str, python: str):
        env = dict(spec.env)
        for key, value in (("OMP_NUM_THREADS", "2"), ("PYTHONUNBUFFERED", "1")):
            if key not in os.environ and key not in env:
                env[key] = value
        cmd = launch_command(spec, model_path, python)
        header = "$ " + " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items()) + " " + shlex.join(cmd)
        super().__init__(cmd, host="127.0.0.1", port=spec.port, env=env,
                         log_path=os.path.join(log_dir, f"{spec.name}.log"), log_header=header, cwd=ROOT)
        self.spec = spec
        self.cmd = cmd
        self.url = self.base_url
        self.log_path = str(self.log_path)
        self.error: str | None = None

    def start(self, check_port: bool = True) -> "Server":
        """Start the server; a busy port is recorded in ``error`` (the server never runs), not raised."""
        try:
            return super().start(check_port)
        except LaunchError as exc:
            self.error = str(exc)
            return self

    def wait_healthy(self, timeout: float) -> bool:
        """True once ``/health`` answers within ``timeout`` seconds of the start; else False with
        ``error`` saying why (exit code or timeout, and the log's last error line)."""
        if self.proc is None:
            return False
        state = self.poll_health(max(0.0, self.t_start + timeout - time.time()))
        if state == "exited":
            self.error = f"exited with code {self.proc.returncode}: {last_error(self.log_text())}"
        elif state == "timeout":
            self.error = f"not healthy after {timeout:.0f} s: {last_error(self.log_text())}"
        return state == "healthy"

    def generate(self, payload: dict, timeout: float = 300.0) -> dict:
        return http_json(self.url + "/generate", payload, timeout=timeout)

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL what is left after ``grace`` seconds."""
        return super().stop(grace)


def plugin_entry_point(pythonpath: str = "") -> dict[str, Any]:
    """Whether ``sglang.srt.plugins`` lists ``oscar`` (what SGLang's ``load_plugins`` iterates),
    and the other plugin names (the plugin-disabled server of check a keeps those), as a server sees
    them: the installed distributions and those of the folders on its ``pythonpath`` (``os.pathsep``
    separated: the harness shims')."""
    from importlib.metadata import distributions

    paths = [*filter(None, pythonpath.split(os.pathsep)), *sys.path]
    eps = [ep for d in distributions(path=paths) for ep in d.entry_points if ep.group == "sglang.srt.plugins"]
    names = sorted({e.name for e in eps})
    return {"oscar": "oscar" in names, "value": next((e.value for e in eps if e.name == "oscar"), None),
            "others": [n for n in names if n != "oscar"]}
