"""One run of the device checks: its state (:class:`Run`), the setup (checkpoints and rotation
files, :func:`prepare`) and the references computed while the servers start (:func:`precompute`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

from sglang_oscar.serving_launcher import stop_all, tree_commit

from .checkpoints import build_checkpoint, load_hf, make_rotation_files, random_prompt
from .client import generate_payload, last_error, parse_generation
from .config import (BUDGET_CUT, C_FP32_SCALE_DTYPE, C_RECENT, C_SINK, DEFAULT_FAMILIES, FAIL, ROOT, SIZED_FAMILIES, SKIP,
                     c_prompt_lens, h_families, main_families, score_std_of)
from .fp32_shim import fp32_shim_dir, write_fp32_shim
from .oracle import screen_prompts, teacher_forced_logprobs
from .results import CheckError, CheckResult, write_results
from .servers import Server, ServerSpec


class Run:
    """State of one harness run: paths, servers, precomputed references, results; the time
    budget (``--budget``) runs from its creation."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.time()
        self.deadline = self.t0 + args.budget
        self.log_dir = os.path.join(args.out, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        os.makedirs(args.work, exist_ok=True)
        self.models: dict[str, str] = {}
        self.rot: dict[str, str] = {}
        self.servers: dict[str, Server] = {}
        self.specs: list[ServerSpec] = []
        self.data: dict[str, Any] = {}
        self.results: dict[str, CheckResult] = {}
        self.meta: dict[str, Any] = {}
        self.hf: dict[str, Any] = {}
        self.device = "cpu"
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------------ helpers
    def fdata(self, family: str) -> dict[str, Any]:
        """The reference data of ``family``: :attr:`data` itself for qwen3, else its own dict."""
        return self.data if family == "qwen3" else self.data.setdefault(f"family:{family}", {})

    def left(self) -> float:
        return self.deadline - time.time()

    def log(self, msg: str) -> None:
        print(f"[e2e {time.time() - self.t0:6.1f}s] {msg}", flush=True)

    def need(self, name: str) -> Server:
        srv = self.servers.get(name)
        if srv is None:
            raise CheckError(f"server {name} was not started")
        if srv.t_ready is None or not srv.alive():
            raise CheckError(f"server {name} is not serving ({srv.error or 'exited'}; log {srv.log_path})")
        return srv

    def gen(self, srv: Server, prompt: Sequence[int], n: int, **kw) -> dict[str, Any]:
        try:
            return parse_generation(srv.generate(generate_payload(prompt, n, **kw), timeout=self.args.request_timeout))
        except RuntimeError as exc:
            raise CheckError(f"{srv.spec.name}: request failed: {exc}; server {last_error(srv.log_text())}") from None

    def record(self, res: CheckResult) -> None:
        self.results[res.check] = res
        self.log(f"{res.check}: {res.status}: {res.measured}")
        self.write()

    def write(self) -> tuple[str, str]:
        order = [c for c in self.args.checks if c in self.results]
        self.meta["wall_s"] = round(time.time() - self.t0, 1)
        self.meta["timings_s"] = {k: round(v, 1) for k, v in self.timings.items()}
        self.meta["servers"] = {n: {"cmd": shlex.join(s.cmd), "env": s.spec.env, "log": s.log_path,
                                    "ready_s": None if s.t_ready is None else round(s.t_ready - s.t_start, 1),
                                    "error": s.error} for n, s in self.servers.items()}
        return write_results(self.args.out, [self.results[c] for c in order], self.meta)

    def run_check(self, letter: str, fn: Callable[["Run"], CheckResult]) -> None:
        if letter not in self.args.checks:
            return
        if self.left() <= 0:
            self.record(CheckResult(letter, SKIP, f"not run: the time budget of {self.args.budget:.0f} s was used up "
                                                  f"(rerun with --only {letter})"))
            return
        t = time.time()
        try:
            res = fn(self)
        except CheckError as exc:
            res = CheckResult(letter, FAIL, f"could not be evaluated: {exc}")
        except Exception as exc:  # a harness bug must not hide the other checks
            import traceback

            res = CheckResult(letter, FAIL, f"harness error: {type(exc).__name__}: {exc}",
                              {"traceback": traceback.format_exc()})
        self.timings[f"check_{letter}"] = time.time() - t
        self.record(res)

    # ------------------------------------------------------------------ servers
    def start(self, specs: Iterable[ServerSpec]) -> list[Server]:
        started = []
        for spec in specs:
            srv = Server(spec, self.models[spec.model], self.log_dir, self.args.python)
            self.servers[spec.name] = srv
            srv.start()
            started.append(srv)
        return started

    def wait_ready(self, servers: Sequence[Server]) -> None:
        waiting = [s for s in servers if not s.spec.expect_fail]
        timeout = lambda s: min(self.args.start_timeout, max(5.0, self.deadline - s.t_start))  # noqa: E731
        with ThreadPoolExecutor(max_workers=max(1, len(waiting))) as ex:
            list(ex.map(lambda s: s.wait_healthy(timeout(s)), waiting))
        for s in waiting:
            if s.t_ready is None and s.error and timeout(s) < self.args.start_timeout and s.error.startswith("not healthy"):
                s.error += f" ({BUDGET_CUT}; rerun the checks it serves with --only)"
            self.log(f"server {s.spec.name}: " + (f"healthy after {s.t_ready - s.t_start:.0f} s" if s.t_ready
                                                 else f"NOT healthy: {s.error}"))

    def stop(self, servers: Iterable[Server]) -> None:
        stop_all(servers)


def collect_meta(args: argparse.Namespace) -> dict[str, Any]:
    """Command, checks, versions, git commit and GPU of the run (``e2e.json``'s ``meta``)."""
    meta: dict[str, Any] = {"command": " ".join(["python -m tests.e2e", shlex.join(sys.argv[1:])]).strip(),
                            "checks": args.checks, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                            "python": sys.version.split()[0]}
    vers = {}
    for mod in ("torch", "triton", "transformers", "sglang", "sglang_oscar"):
        try:
            vers[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            vers[mod] = f"unavailable ({type(exc).__name__})"
    meta["versions"] = vers
    meta["git"] = tree_commit(ROOT)  # $OSCAR_COMMIT: the device copy's .git can be stale
    if not os.environ.get("OSCAR_COMMIT"):  # against a named commit the copy's stale HEAD would mislead
        with contextlib.suppress(Exception):
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            meta["git_dirty_files"] = len(dirty.splitlines()) if dirty else 0
    with contextlib.suppress(Exception):
        meta["device"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
    return meta


def needed_models(checks: Iterable[str], families: Sequence[str] | None = None) -> list[str]:
    """The tiny checkpoints (:data:`~.config.MODEL_FAMILIES` keys) the checks need on ``families``
    (``--families``, default qwen3, moe, llama)."""
    ch = set(checks)
    families = list(families or DEFAULT_FAMILIES.split(","))
    main = main_families(argparse.Namespace(families=families))
    out = []
    if ch & set("abcdehi"):
        out += main  # h's families are among them (config.h_families)
    if "b" in ch:
        out += [m for m in families if m not in out]
    if "g" in ch or ("f" in ch and "qwen3" in main):
        out.append("long")
    if "f" in ch:
        out += [m for m in main if m in SIZED_FAMILIES and m not in out]
    return out


def prepare(run: Run) -> None:
    """Checkpoints and rotation files (GPU when available)."""
    import torch

    args = run.args
    run.device = "cuda" if torch.cuda.is_available() else "cpu"
    t = time.time()
    for name in needed_models(args.checks, args.families):
        path = os.path.join(args.work, f"tiny-{name}")
        info = build_checkpoint(name, path, seed=args.seed, args=args, logit_std=args.logit_std,
                                score_std=score_std_of(args, name), device=run.device)
        run.models[name] = path
        run.meta.setdefault("models", {})[name] = {k: info.get(k) for k in ("config", "sharpen", "reused")}
    run.timings["checkpoints"] = time.time() - t
    run.log(f"checkpoints: {', '.join(run.models)} ({run.timings['checkpoints']:.0f} s)")
    t = time.time()
    ch = set(args.checks)
    main = main_families(args)  # h's families among them
    for m in main if ch & set("bcdhi") else ():
        model = load_hf(run.models[m], run.device, fp32_head=args.fp32_lm_head)
        run.hf[m] = model
        files = make_rotation_files(model, run.models[m], os.path.join(args.work, f"rot-{m}"))
        run.rot.update({f"{m}:{k}": v for k, v in files.items()})
    if "b" in ch:
        from sglang_oscar.calibrate.model import geometry_of
        from sglang_oscar.rotation import RotationSet

        for m in [m for m in args.families if m not in main]:
            from transformers import AutoConfig

            geo = geometry_of(AutoConfig.from_pretrained(run.models[m]))
            path = os.path.join(args.work, f"rot-{m}", "rot_identity.safetensors")
            RotationSet.data_free(geo, "identity").save(path)
            run.rot[f"{m}:identity"] = path
    # the shim plugin folder (fp32, window and dummy shims) is written whatever the checks: the
    # servers that load it (c's and d's fp32 ones, b's hf-window baseline) are chosen in servers.py
    run.meta["fp32_shim"] = write_fp32_shim(fp32_shim_dir(args.work))
    run.timings["rotations"] = time.time() - t
    run.meta["rotations"] = dict(run.rot)
    run.log(f"rotation files: {', '.join(run.rot)} ({run.timings['rotations']:.0f} s)")


def precompute(run: Run) -> None:
    """Reference data computed in this process while the servers start: screened greedy prompts
    (HF BF16 for a/b, the oracle for d/h) and the oracle/HF log-probs of check c's prompts, per
    family (:meth:`Run.fdata`; a/b's in ``data["greedy_bf16"][family]``, h's in
    ``data["greedy_head"][family]``, screened on that family's oracle with its per-head rotation)."""
    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation import RotationSet

    args, ch = run.args, set(run.args.checks)
    t = time.time()
    n = args.greedy_tokens
    cfg = OscarConfig(sink_tokens=C_SINK, recent_tokens=C_RECENT)
    run.data["c_config"] = cfg
    run.data["c_config_fp32"] = OscarConfig(sink_tokens=C_SINK, recent_tokens=C_RECENT, scale_dtype=C_FP32_SCALE_DTYPE)
    main = main_families(args)
    for m in [m for m in args.families if ("b" in ch) or (m in main and "a" in ch)]:
        model = run.hf.get(m) or load_hf(run.models[m], run.device, fp32_head=args.fp32_lm_head)
        run.hf[m] = model
        run.data.setdefault("greedy_bf16", {})[m] = screen_prompts(model, args.b_lens, n, candidates=args.screen_candidates,
                                                                    seed=args.seed + 11)
    for m in h_families(args) if "h" in ch else ():
        run.data.setdefault("greedy_head", {})[m] = screen_prompts(
            run.hf[m], args.h_lens, n, candidates=args.screen_candidates, seed=args.seed + 33,
            rotation=RotationSet.load(run.rot[f"{m}:head"]), config=cfg, vocab=run.hf[m].config.vocab_size)
    for m in main:
        _precompute_family(run, m, cfg)
    run.timings["precompute"] = time.time() - t
    run.log(f"references computed ({run.timings['precompute']:.0f} s)")


def _precompute_family(run: Run, m: str, cfg) -> None:
    """Check d's screened prompts and check c's references of family ``m`` into ``run.fdata(m)``."""
    import torch

    from sglang_oscar.rotation import RotationSet

    args, ch, d = run.args, set(run.args.checks), run.fdata(m)
    q = run.hf.get(m)
    if "d" in ch:
        d["greedy_layer"] = screen_prompts(q, args.d_lens, args.greedy_tokens, candidates=args.screen_candidates,
                                           seed=args.seed + 22, rotation=RotationSet.load(run.rot[f"{m}:layer"]),
                                           config=cfg)
    if "c" not in ch:
        return
    prompts = [random_prompt(L, args.seed * 31 + 44 + i, q.config.vocab_size) for i, L in enumerate(c_prompt_lens(args, m))]
    d["c_prompts"] = prompts
    d["c_hf_bf16"] = teacher_forced_logprobs(q, prompts)
    for kind in ("layer", "head"):
        rs = RotationSet.load(run.rot[f"{m}:{kind}"])
        d[f"c_rot_{kind}"] = rs
        d[f"c_oracle_{kind}"] = teacher_forced_logprobs(q, prompts, rotation=rs, config=cfg)
    # the oracle's own sensitivity: the same checkpoint loaded in fp32 (K/V differ from the
    # bf16 run only by BF16-level rounding, as SGLang's kernels differ from transformers')
    q32 = load_hf(run.models[m], run.device, dtype=torch.float32, fp32_head=args.fp32_lm_head)
    d["c_oracle_layer_fp32_model"] = teacher_forced_logprobs(q32, prompts, rotation=d["c_rot_layer"], config=cfg)
    if args.c_fp32:
        # references of the --dtype float32 servers: the model in fp32 and the oracle's HP tier
        # in fp32 (what those servers' windows hold); kept for c's decode teacher forcing
        run.hf[f"{m}-fp32"] = q32
        d["c_hf_fp32"] = teacher_forced_logprobs(q32, prompts)
        for kind in ("layer", "head"):
            d[f"c_oracle_fp32_{kind}"] = teacher_forced_logprobs(q32, prompts, rotation=d[f"c_rot_{kind}"],
                                                                 config=run.data["c_config_fp32"], hp_dtype=torch.float32)
        # the same oracle on the model in fp64: how far the fp32 reference moves by its own rounding
        # (reported next to c's fp32 criterion, docs/serving_hybrid.md)
        try:
            q64 = load_hf(run.models[m], run.device, dtype=torch.float64, fp32_head=args.fp32_lm_head)
            for kind in ("layer", "head"):
                d[f"c_oracle_fp64_{kind}"] = teacher_forced_logprobs(q64, prompts, rotation=d[f"c_rot_{kind}"],
                                                                     config=run.data["c_config_fp32"],
                                                                     hp_dtype=torch.float32)
            run.hf[f"{m}-fp64"] = q64
        except Exception as exc:  # a model transformers cannot run in fp64: the spread is not reported
            d["c_fp64_error"] = f"{type(exc).__name__}: {exc}"
            run.log(f"{m}: the oracle on the fp64 model failed ({d['c_fp64_error'][:200]}); c reports no fp64 spread")
    del q32
