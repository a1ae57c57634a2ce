"""Device check of the served INT2 MLA latent cache on a tiny seeded DeepSeek-V3.

    python -m tests.e2e.mla_check [--family deepseek_v3|deepseek_v3_expanded|glm5|glm5_dense|kimi_linear|minimax_m3|minimax_m3_dense] [--out DIR] [--budget SECONDS] [--servers NAME,...]
    (GPU machine, after ``source device/env.sh``)

Builds (:mod:`.mla_models`) a tiny random DeepseekV3ForCausalLM with DeepSeek-V3's latent geometry
(kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128; 4 layers, 8 heads,
dense MLPs: MoE kernels pick their tiles by token count, which would make chunked prefill differ by
rounding) and launches (one after another until each has allocated its KV pool, then concurrently)
a BF16 server (SGLang's MLA pool and Triton MLA kernels), an int2 server whose sink window covers
every prompt and whose rotation is the identity (``int2-window``: every key SGLang's own BF16 row,
so it must track BF16; the main harness's check b reads its window rows so too), and int2 servers
with small windows (sink 16, recent 32: most of each prompt is read through INT2), unchunked and
``--chunked-prefill-size 64``. The same prompts (400 to 1500 tokens, 24 greedy tokens, prompt
log-probs) go to every server. Reported (``mla_check.json`` and ``.md``
in ``--out``) and judged:

* **serves**: every server of a judged item healthy, the int2 logs name the INT2 pool, finite
  log-probs (reported servers, below, are not part of it);
* **window**: int2-window vs BF16: the same greedy tokens (below) and mean |prompt log-prob
  difference| <= 0.05 (the INT2 path's kernels over SGLang's own BF16 rows vs SGLang's kernels, for
  MLA the absorbed form vs SGLang's non-absorbed BF16 prefill: rounding only);
* **int2 vs BF16**: agreement and log-prob differences reported (INT2 differs by design);
* **chunked**: int2-chunk64 tracks int2 (the same greedy tokens, mean |prompt log-prob difference|
  <= 0.02, the main harness's check d tolerance: every chunk reads INT2 latents of itself and its
  prefix, as one prefill does);
* "the same greedy tokens": per prompt, identical up to the first position where the reference's
  top-1 / top-2 margin is at most :data:`TIE_MARGIN` (a tie at BF16 logit resolution, which any
  rounding difference may flip: this tiny model's flat logits tie, margin 0, at some positions);
  the agreement fraction is reported;
* **rotated** (every family but the DeepSeek-V3 ones): ``int2-window-hadamard``, int2-window under the default
  data-free Hadamard rotation (its BF16 rows rotated, so rounded otherwise than SGLang's), vs BF16:
  mean |prompt log-prob difference| <= 0.05, greedy tokens reported (a wrong query or value rotation
  would move it far more; MiniMax-M3's sparse selection turns the rounding into a greedy split);
* **radix**: every prompt is sent to the int2 server a second time: each repeat gives the first
  answer's greedy tokens (up to a tie, above) and is served from the cache (``cached_tokens`` > 0),
  under SGLang's mamba radix cache (Kimi-Linear) too, where the plugin tracks the prefill's recurrent
  state before its radix cap (``serving.after_init_next_round_input``); the BF16 server's repeats are
  reported beside it (SGLang's own caching of the same prompts);
* **oracle**: the int2 server's prompt log-probs vs the model-level oracle in a BF16 copy of the
  model within twice the oracle's own BF16-vs-fp32 move (at least 0.05; :func:`oracle_report`);
* **oracle-fp32** (opt-in, DeepSeek-V3 families, ``--servers`` naming ``int2-fp32``): the int2 server
  at ``--dtype float32`` (fp32 windows, IEEE dots, the harness's fp32 shim: :func:`.mla_servers.fp32_env`)
  vs the fp32 oracle: mean |prompt log-prob difference| <= :data:`.mla_items.ORACLE_FP32_TOL`
  (0.02); ``bf16-fp32`` (SGLang's unquantized path at fp32) vs the fp32 model is reported beside
  it as the served fp32 path's own noise;
* **load**: the int2 server, with SGLang's strict memory-leak and KV-page checks on, answers
  :data:`LOAD_REQUESTS` concurrent requests of mixed lengths (every fourth sharing a prefix) in full,
  stays healthy (``/health``, ``/health_generate``) and logs no leak report and no new traceback
  (the main harness's check e, on this harness's model);
* **plugin** (opt-in, ``--servers`` naming ``plugin-off``): SGLang with the plugin disabled (every
  entry point the server sees but ``oscar``: the harness shims stay) vs the BF16 server with it
  loaded: ``oscar`` among those entry points, the same greedy tokens, max |log-prob difference| <=
  :data:`PLUGIN_TOL` (the main harness's check a);
* **graph** (opt-in, ``--servers`` naming ``int2-eager``): int2 without CUDA graphs vs int2: the same
  greedy tokens, max |log-prob difference| (prompt and output) <= 0.02 (the main harness's check d);
* **tp** (opt-in, ``--servers`` naming ``int2-tp2``; two GPUs): int2 at ``--tp-size 2`` vs int2: the
  same greedy tokens (no tie allowance, as check h), max |log-prob difference| <= :data:`TP_TOL`, and each rank's
  bytes per token equal to TP 1's (every rank holds the whole latent; :func:`tp_report`, with both
  servers' ``max_total_num_tokens`` reported; the main harness's check h);
* **capacity** (reported): INT2 bytes per token of the latent cache and their ratio to BF16.

By default the servers of the judged items but the opt-in ones run (five at most: one 600 s device
call); ``--servers`` runs a subset (items whose servers did not run are not judged) and may add the
opt-in servers (``plugin-off``, ``int2-eager``, ``int2-tp2``), the family's reported servers (below) and
``int2-window-hadamard`` where the family does not judge it (the DeepSeek-V3 families, whose oracle
covers the rotations): then reported against ``bf16``.

``--family kimi_linear`` checks that the latent pool inside SGLang's linear-attention hybrid pool
serves: a Kimi-Linear config (SGLang's ``KimiLinearConfig``: layers 0 and 2 KDA linear attention,
1 and 3 MLA with DeepSeek-V3's latent geometry, dense MLPs) with ``--load-format dummy``
(transformers has no Kimi-Linear class, so there are no weights to save and no oracle). Every server
loads :mod:`.dummy_shim`, which scales SGLang's dummy weights to N(0, 1/fan_in) with every norm
scaling by 1 (SGLang's own +-1e-3 leave attention no visible effect on the logits): judged as
DeepSeek-V3 with **rotated** in place of the oracle.

``--family glm5`` serves a tiny seeded GLM-5 (``GlmMoeDsaForCausalLM``: DSA, every MLA layer reading
only its lightning indexer's top-k of 256 positions, below every prompt's length) under SGLang's
``dsa`` backend: the int2 servers run :class:`~sglang_oscar.backend.dsa_backend.OscarDSALatentBackend`
(the indexer as SGLang runs it, the selected positions read from the INT2 latent), the BF16 server
SGLang's own DSA kernels. Judged as kimi_linear (the oracle attends densely); a reported server,
``int2-window-chunk64`` (chunked, every key from the BF16 rows), is compared with
``int2-window``: how far SGLang's DSA path itself moves with chunking. ``--family glm5_dense`` is the
same model with GLM-5's own top-k of 2048, above every prompt: the indexer keeps every position, so
chunking and radix reuse are judged where only the INT2 latent path could move them, the dense
oracle (:mod:`.mla_oracle` patches ``GlmMoeDsaAttention`` too) is judged as for DeepSeek-V3 (and
SGLang's BF16 DSA decode, which asserts a top-k of 2048, gets its own top-k).

``--family minimax_m3`` serves a tiny MiniMax-M3 (not MLA: an MHA main K/V whose sparse layers read
only the key blocks their indexer selects, :func:`build_minimax_m3`) from SGLang's config format with
dummy weights as kimi_linear: the int2 servers run the INT2 main pool inside SGLang's MiniMax sparse
pool (BF16 index keys) and :class:`~sglang_oscar.backend.minimax_backend.OscarMiniMaxSparseBackend`,
the BF16 server SGLang's own Triton sparse path. Judged as kimi_linear, with a reported
``bf16-chunk64`` (SGLang's BF16 server chunked) compared with ``bf16``: the model's own move under a
rounding-level change, through its block selection; ``--family minimax_m3_dense`` selects every
block (the selection cannot move with chunking or radix reuse; the index attention output, SGLang's,
still can: ``int2-window-chunk64`` reported as for glm5).

``--family deepseek_v3_expanded`` serves the DeepSeek-V3 model with ``--oscar-mla-storage expanded
--kv-cache-quant-group-size 64`` on the int2 servers: per-head K ``[k_nope | k_pe]`` 192 / V 128 in the
INT2 MHA pool (:class:`~sglang_oscar.backend.expanded_backend.OscarExpandedMLABackend`), judged as
DeepSeek-V3 with the oracle over :func:`sglang_oscar.reference.latent.expand_latent`'s K/V.

Exit 1 when a judged item fails. The servers' flags, families and environments are in
:mod:`.mla_servers`; the tolerances, greedy ties, oracle and TP report in :mod:`.mla_items`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from sglang_oscar.serving_launcher import ServerProcess, sigterm_exits, stop_all

from .checkpoints import random_prompt, write_identity_rotation
from .client import generate_payload, http_json, leak_lines, log_stats, parse_generation
from .mla_items import (CHUNK_TOL, NEW_TOKENS, ORACLE_FP32_TOL, PLUGIN_TOL, PROMPT_LENS, TP_TOL, WINDOW_TOL, _diff,
                        _log_value, _wait_for_log, oracle_report, same_greedy, tp_report)
from .mla_models import VOCAB
from .mla_servers import (BASE_PORT, CAPACITY_LOG, DEFAULT_CAPACITY_LOG, DEFAULT_POOL_LOG, FAMILIES, FAMILY_BF16_FLAGS,
                          FAMILY_INT2_FLAGS, FAMILY_REF, FAMILY_SERVERS, FP32_FAMILIES, FP32_TWINS, HADAMARD,
                          HADAMARD_REF, NEEDS, OPT_IN, OPT_IN_ITEMS, POOL_LOG, RADIX_SERVERS, REF, SERVERS,
                          STRICT_ENV, batch_invariant_env, fp32_env, server_argv, server_env)
from .servers import plugin_entry_point
from .smoke import agreement

# load: as the main harness's check e (its strict environment, tests/e2e/servers.py), on the int2 server
LOAD_REQUESTS, LOAD_LENS, LOAD_SHARED_PREFIX = 64, (32, 2400), 256


def load_prompts(n: int = LOAD_REQUESTS, seed: int = 55) -> list[list[int]]:
    """The load item's requests: ``n`` lengths log-uniform in :data:`LOAD_LENS`; every fourth long
    enough one starts with the same :data:`LOAD_SHARED_PREFIX` tokens (radix sharing under load)."""
    rng = random.Random(seed)
    prefix = random_prompt(LOAD_SHARED_PREFIX, seed + 7, VOCAB)
    out = []
    for i in range(n):
        ids = random_prompt(int(round(math.exp(rng.uniform(*map(math.log, LOAD_LENS))))), seed * 7919 + i, VOCAB)
        out.append(prefix + ids[LOAD_SHARED_PREFIX:] if i % 4 == 0 and len(ids) > LOAD_SHARED_PREFIX + 16 else ids)
    return out


def load_report(srv, log_path: str, prompts: list[list[int]], timeout: float = 300.0) -> dict:
    """Send ``prompts`` at once (greedy, :data:`NEW_TOKENS` each), let the server idle (its strict
    checks run), probe its health and scan its log: ``ok`` when every request completed within
    ``timeout`` seconds, the server is alive and healthy, and its log has no leak report and no new
    traceback."""
    def text():
        with open(log_path, errors="replace") as f:
            return f.read()

    before = log_stats(text())

    def one(ids):
        try:
            g = parse_generation(http_json(srv.base_url + "/generate", generate_payload(ids, NEW_TOKENS, top_logprobs=0),
                                           timeout=timeout))
            return len(g["tokens"]) == NEW_TOKENS
        except RuntimeError:
            return False

    ex = ThreadPoolExecutor(max_workers=len(prompts))
    try:
        done = sum(ex.map(one, prompts))
    finally:  # on a SIGTERM the caller stops the server at once, which ends the waiting requests
        ex.shutdown(wait=False, cancel_futures=True)
    time.sleep(5.0)  # idle: SGLang's strict leak check runs (a leak raises in the scheduler)
    health = {}
    for ep in ("/health", "/health_generate"):
        try:
            http_json(srv.base_url + ep, timeout=60)
            health[ep] = True
        except RuntimeError as exc:
            health[ep] = str(exc)[:200]
    log = text()
    stats = log_stats(log)
    res = {"completed": done, "requests": len(prompts), "health": health, "alive": srv.alive(),
           "leak_lines": leak_lines(log)[:20], "new_tracebacks": stats["tracebacks"] - before["tracebacks"],
           "max_running_req": stats["max_running_req"], "cached_tokens": stats["cached_tokens_total"]}
    res["ok"] = (done == len(prompts) and all(v is True for v in health.values()) and res["alive"]
                 and not res["leak_lines"] and res["new_tracebacks"] == 0)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.e2e.mla_check", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--family", choices=sorted(FAMILIES), default="deepseek_v3")
    ap.add_argument("--model", default=None, help="where the model is written (default /tmp/mla-check-<family>)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for startup + requests")
    ap.add_argument("--servers", default=None,
                    help="comma-separated servers to run (default: those of the family's judged items but the "
                         "opt-in ones; may add "
                         f"the family's reported servers, {', '.join(OPT_IN)} (judged as {', '.join(OPT_IN_ITEMS)}) "
                         f"and, where 'rotated' is not judged, {HADAMARD}; on {' / '.join(FP32_FAMILIES)} also the "
                         f"--dtype float32 twins {', '.join(FP32_TWINS)} (int2-fp32 judged as oracle-fp32); "
                         "items whose servers did not run are not judged")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the int2 servers run SGLang's batch-invariant GEMMs (harness shim, batch_invariant_env): "
                         "chunked and radix then judge the INT2 path without the GEMMs' row-count rounding")
    args = ap.parse_args(argv)
    build, family_flags, judged = FAMILIES[args.family]
    fp32 = FP32_TWINS if args.family in FP32_FAMILIES else {}
    judged = (*judged, *OPT_IN_ITEMS, *(("oracle-fp32",) if fp32 else ()))
    opt_in = {**OPT_IN, **fp32}
    known = {**SERVERS, **FAMILY_SERVERS.get(args.family, {}), HADAMARD: SERVERS["int2-window"],
             **{n: flags for n, (flags, _) in opt_in.items()}}
    judged_servers = [*SERVERS, *([HADAMARD] if "rotated" in judged else [])]
    names = args.servers.split(",") if args.servers else judged_servers
    if not fp32 and set(names) & set(FP32_TWINS):
        ap.error(f"--servers {args.servers!r}: the --dtype float32 twins ({', '.join(FP32_TWINS)}) serve only "
                 f"{' / '.join(FP32_FAMILIES)}: SGLang cannot serve --family {args.family} in fp32 "
                 "(use --batch-invariant for its chunked and radix items)")
    if not names or any(n not in known for n in names) or len(set(names)) < len(names):
        ap.error(f"--servers {args.servers!r}: distinct names among {', '.join(known)}")
    t0 = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    skipped = [k for k in judged if not NEEDS.get(k, set()) <= set(names)]
    # an opt-in server joins "serves" when a judged item needs it (bf16-fp32 is reported only)
    judged_servers += [n for n in opt_in if n in names and any(n in NEEDS.get(k, ()) for k in judged)]
    judged = tuple(k for k in judged if k not in skipped)
    with_oracle = "oracle" in judged or any(n in names for n in fp32)
    args.model = args.model or f"/tmp/mla-check-{args.family}"
    geometry = build(args.model)
    window = [n for n in names if n.startswith("int2-window") and n not in HADAMARD_REF]
    if window:  # the window servers (and their chunked twins) read SGLang's own BF16 rows
        identity = write_identity_rotation(args.model, args.out, expanded=args.family in FAMILY_INT2_FLAGS)
        known.update({n: [*known[n], "--oscar-rotation", identity] for n in window})
    env = server_env(args.family, args.out)
    # the plugin-off server keeps every entry point the servers see but ours (SGLANG_PLUGINS names what
    # SGLang loads; a name matching none when there is no other): the shims stay, so it loads bf16's weights
    plugins = plugin_entry_point(env.get("PYTHONPATH", ""))
    invariant = batch_invariant_env(args.out, env) if args.batch_invariant else {}
    servers = {}
    for i, (name, extra) in enumerate((n, known[n]) for n in names):
        own = (FAMILY_INT2_FLAGS if "int2" in extra else FAMILY_BF16_FLAGS).get(args.family, [])
        a = server_argv(args.model, BASE_PORT + i, [*extra, *family_flags, *own])
        server_env_ = {**env, **(STRICT_ENV if name == "int2" else {}),
                       **(invariant if "int2" in extra else {}),
                       **(fp32_env(args.out, env) if name in FP32_TWINS else {}),
                       **({"SGLANG_PLUGINS": ",".join(plugins["others"]) or "__no_plugin__"}
                          if name == "plugin-off" else {})}
        servers[name] = ServerProcess(a, port=BASE_PORT + i, env=server_env_,
                                      log_path=os.path.join(args.out, f"mla_{name}.log"),
                                      log_header="$ " + " ".join(a))
    prompts = [random_prompt(n, seed, VOCAB) for seed, n in enumerate(PROMPT_LENS)]
    res: dict = {"family": args.family, "geometry": geometry, "servers": {}, "radix_repeats": {},
                 "batch_invariant_int2": args.batch_invariant}
    # without this a timeout kills only this process and its servers keep their ports and GPU memory
    with sigterm_exits():
        try:
            for name, srv in servers.items():
                srv.start()
                # one at a time until its KV pool is allocated: SGLang sizes the pool from the memory it sees
                # free, and a neighbour loading weights meanwhile makes it refuse to start
                _wait_for_log(os.path.join(args.out, f"mla_{name}.log"), ("KV Cache is allocated", "Traceback"), srv,
                              90.0)
            for name, srv in servers.items():
                left = max(10.0, args.budget - (time.monotonic() - t0))
                if srv.poll_health(left, interval=2.0) != "healthy":
                    res["servers"][name] = "NOT HEALTHY"
                    continue
                try:
                    res["servers"][name] = [parse_generation(http_json(
                        srv.base_url + "/generate", generate_payload(p, NEW_TOKENS, input_logprobs=True), timeout=180))
                        for p in prompts]
                except RuntimeError as exc:
                    res["servers"][name] = f"REQUEST FAILED: {exc}"
                    continue
                if name in RADIX_SERVERS:  # radix: every prompt again, answered from the cache where it keeps one
                    try:
                        res["radix_repeats"][name] = [parse_generation(http_json(
                            srv.base_url + "/generate", generate_payload(p, NEW_TOKENS), timeout=180)) for p in prompts]
                    except RuntimeError as exc:
                        res["radix_repeats"][name] = f"REQUEST FAILED: {exc}"
                if name == "int2":  # last: the load may leave the cache full of its prefixes
                    left = max(30.0, args.budget - (time.monotonic() - t0))
                    res["load"] = load_report(srv, os.path.join(args.out, f"mla_{name}.log"), load_prompts(), left)
        except SystemExit as exc:  # sigterm_exits: the timeout's first SIGTERM (later ones are ignored)
            res["terminated"] = f"signal {exc.code - 128} after the answers so far"
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # answers in: a timeout while stopping must not lose them
            stop_all(servers.values(), grace=30.0)
    with open(os.path.join(args.out, "mla_check.json"), "w") as f:  # the raw answers, before any judging
        json.dump(res, f, indent=1)
    verdict = {}
    sv = res["servers"]
    logs = {name: os.path.join(args.out, f"mla_{name}.log") for name in servers}
    servers = {n: srv for n, srv in servers.items() if n in judged_servers}  # the serves item's
    ok_serve = bool(servers) and all(isinstance(sv.get(n), list) for n in servers)
    kind = args.family.removesuffix("_dense")
    ok_serve &= all(_log_value(logs[n], POOL_LOG.get(kind, DEFAULT_POOL_LOG)) for n in servers if n.startswith("int2"))
    ok_serve &= all(math.isfinite(x) for n in servers if isinstance(sv.get(n), list)
                    for g in sv[n] for x in g["logprobs"] + g["input_logprobs"])
    verdict["serves"] = ok_serve
    rows = []
    opt_in_ref = {n: ref for n, (_, ref) in opt_in.items()}
    for name, ref_name in {**REF, **FAMILY_REF.get(args.family, {}), **HADAMARD_REF, **opt_in_ref}.items():
        got, ref = sv.get(name), sv.get(ref_name)
        if not isinstance(got, list) or not isinstance(ref, list):
            continue
        n = len(prompts)
        agree = agreement([g["tokens"] for g in got[:n]], [r["tokens"] for r in ref[:n]])
        p_mean, p_max = _diff([x for g in got[:n] for x in g["input_logprobs"]], [x for r in ref[:n] for x in r["input_logprobs"]])
        o_mean, o_max = _diff([x for g in got[:n] for x in g["logprobs"]], [x for r in ref[:n] for x in r["logprobs"]])
        same, where = same_greedy(got[:n], ref[:n])
        rows.append({"server": name, "vs": ref_name, "agreement": agree, "prompt_dlp_mean": p_mean,
                     "prompt_dlp_max": p_max, "out_dlp_mean": o_mean, "out_dlp_max": o_max,
                     "first_diff_and_ref_margin": where})
        if name == "int2-window":
            verdict["window"] = same and p_mean <= WINDOW_TOL
        elif name == HADAMARD and "rotated" in judged:
            verdict["rotated"] = p_mean <= WINDOW_TOL
        elif name == "int2-chunk64":
            verdict["chunked"] = same and p_mean <= CHUNK_TOL
        elif name == "plugin-off":  # exact tokens: the plugin must not change a non-int2 server
            res["plugins"] = plugins
            verdict["plugin"] = plugins["oscar"] and agree == 1.0 and max(p_max, o_max) <= PLUGIN_TOL
        elif name == "int2-eager":  # check d's rule: the same tokens, every log-prob within its tolerance
            verdict["graph"] = agree == 1.0 and max(p_max, o_max) <= CHUNK_TOL
        elif name == "int2-tp2":
            res["tp"] = tp = tp_report(logs["int2"], logs[name], CAPACITY_LOG.get(kind, DEFAULT_CAPACITY_LOG))
            # identical tokens, as check h: after a tie split the output log-probs compare other continuations
            verdict["tp"] = agree == 1.0 and max(p_max, o_max) <= TP_TOL and tp["same_bytes_per_token"]
    res["radix"] = {}  # radix: a server's repeats against its first answers; judged on int2 alone
    for name in RADIX_SERVERS:
        first, again = sv.get(name), res["radix_repeats"].get(name)
        if isinstance(first, list) and isinstance(again, list):
            ok, at = same_greedy(again, first)
            res["radix"][name] = {"cached_tokens": [g.get("cached_tokens") or 0 for g in again], "same": ok,
                                  "first_diff_and_ref_margin": at}
    if "int2" in res["radix"]:
        verdict["radix"] = res["radix"]["int2"]["same"] and all(res["radix"]["int2"]["cached_tokens"])
    elif "int2" in res["radix_repeats"]:  # the repeats failed
        verdict["radix"] = False
    if "load" in res:
        verdict["load"] = res["load"]["ok"]
    answered = {n: sv[n] for n in ("int2", *fp32) if isinstance(sv.get(n), list)}
    if with_oracle and answered and "terminated" not in res:
        oracle_items = [k for k, n in (("oracle", "int2"), ("oracle-fp32", "int2-fp32")) if k in judged and n in answered]
        try:
            with sigterm_exits():  # a timeout here still writes the table and the verdict below
                res["oracle"] = orc = oracle_report(args.model, prompts, answered,
                                                    "expanded" if args.family in FAMILY_INT2_FLAGS else "latent")
            if "oracle" in oracle_items:
                verdict["oracle"] = orc["served_vs_oracle_bf16"] <= max(2 * orc["oracle_fp32_vs_bf16"], 0.05)
            if "oracle-fp32" in oracle_items:  # fp32 server, fp32 oracle: the criterion as it stands
                verdict["oracle-fp32"] = orc["fp32_server_vs_oracle_fp32"] <= ORACLE_FP32_TOL
        except SystemExit as exc:  # sigterm_exits: the oracle items are not judged, the answers are
            res["terminated"] = f"signal {exc.code - 128} while computing the oracle"
        except Exception as exc:  # noqa: BLE001  the verdict fails and says why
            res["oracle"] = f"failed: {type(exc).__name__}: {exc}"
            verdict.update({k: False for k in oracle_items})
    cell = _log_value(logs["int2"], CAPACITY_LOG.get(kind, DEFAULT_CAPACITY_LOG)) if "int2" in logs else None
    if cell:
        res["capacity"] = {"int2_bytes_per_token": int(cell[0]), "bf16_bytes_per_token": int(cell[1]),
                           "ratio": int(cell[1]) / int(cell[0])}
    res["rows"], res["verdict"], res["judged"] = rows, verdict, list(judged)
    res["wall_s"] = time.monotonic() - t0
    with open(os.path.join(args.out, "mla_check.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = ["| server | vs | greedy agreement | first diff (ref margin there) per prompt | prompt dlogprob mean / max "
             "| output dlogprob mean / max |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['server']} | {r['vs']} | {r['agreement']:.3f} | "
              + ", ".join("-" if i is None else f"{i} ({m if m is None else round(m, 4)})"
                          for i, m in r["first_diff_and_ref_margin"])
              + f" | {r['prompt_dlp_mean']:.4f} / {r['prompt_dlp_max']:.4f} "
              f"| {r['out_dlp_mean']:.4f} / {r['out_dlp_max']:.4f} |" for r in rows]
    lines += ["", f"verdict: {verdict} (judged: {', '.join(judged)})"
              + ("; int2 servers with batch-invariant GEMMs" if args.batch_invariant else ""),
              f"capacity: {res.get('capacity')}",
              *([f"tp (per rank): {json.dumps(res['tp'])}"] if "tp" in res else []),
              f"radix (repeats vs first answers; bf16 reported): {json.dumps(res.get('radix'))}",
              f"oracle (reported): {res.get('oracle')}",
              f"load: {json.dumps({k: v for k, v in res.get('load', {}).items() if k != 'leak_lines'})}"]
    lines += [f"{n}: {v}" for n, v in sv.items() if isinstance(v, str)]
    opt_in_items = {k: n for k in (*OPT_IN_ITEMS, "oracle-fp32") for n in opt_in if n in NEEDS[k]}
    if skipped:
        hint = [f"{k} with {n}" for k, n in opt_in_items.items() if k in skipped]
        lines.append(f"not judged (their servers not in --servers): {', '.join(skipped)}"
                     + (f"; opt-in servers (--servers): {', '.join(hint)}" if hint else ""))
    missing = [k for k in judged if k not in verdict]
    if missing:
        lines.append(f"not judged (fails the check): {', '.join(missing)}"
                     + (f"; terminated: {res['terminated']}" if "terminated" in res else ""))
    with open(os.path.join(args.out, "mla_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if set(judged) <= set(verdict) and all(verdict[k] for k in judged) else 1


if __name__ == "__main__":
    sys.exit(main())
