"""Check h (``--tp2``, two GPUs): per family of :func:`~.config.h_families` (qwen3 by default; every
selected family with an int2 per-head rotation path: qwen3, the sliding-window gemma3 / gemma4 /
gpt_oss, the linear hybrid qwen3_next, minimax_m2), an int2 server with ``--tp-size 2`` and the
family's per-head rotation file (:func:`~.servers.h_tp2_name`) serves the same greedy tokens as the
``--tp 1`` server of check c (:func:`~.servers.h_reference_name`, the same flags otherwise).

The TP 1 answers are gathered in phase 1 (:func:`collect_h_reference`); afterwards each family's
TP 2 server starts alone, is compared and stopped before the next family's starts. Each server's
``max_total_num_tokens`` (per rank: every rank's pool holds every token, for its half of the kv
heads) is reported beside the other's; both run with the same ``--max-total-tokens`` cap, so the
figures are reported, not judged."""

from __future__ import annotations

from typing import Any

from .client import compare_generations, served_max_total_tokens
from .config import FAIL, PASS, h_families
from .results import CheckError, CheckResult, margins_note, unevaluated_status
from .run import Run
from .servers import h_reference_name, h_tp2_name


def _capacity(srv) -> dict[str, Any]:
    """``{"tokens", "source"}`` of a running server (:func:`~.client.served_max_total_tokens`)."""
    try:
        tok, src = served_max_total_tokens(srv.url, srv.log_text())
    except Exception as exc:  # noqa: BLE001  reported, not judged: never fails the check
        return {"tokens": None, "source": f"error: {type(exc).__name__}: {exc}"}
    return {"tokens": tok, "source": src}


def collect_h_reference(run: Run) -> None:
    """TP 1 greedy answers (``data["h_ref"][family]``) and pool size (``data["h_capacity"][family]
    ["tp1"]``) of each family of check h, gathered while the phase-1 servers are up; a family whose
    server or prompts are missing gets ``data["h_ref_error"][family]``."""
    if "h" not in run.args.checks:
        return
    for f in h_families(run.args):
        try:
            prompts = run.data.get("greedy_head", {}).get(f)
            if prompts is None:
                raise CheckError("no screened prompts (the reference computation failed; see the run's log)")
            srv = run.need(h_reference_name(f))
            run.data.setdefault("h_ref", {})[f] = [run.gen(srv, p["prompt"], run.args.greedy_tokens) for p in prompts]
            run.data.setdefault("h_capacity", {}).setdefault(f, {})["tp1"] = _capacity(srv)
        except CheckError as exc:
            run.data.setdefault("h_ref_error", {})[f] = str(exc)


def check_h(run: Run) -> CheckResult:
    """Each family of :func:`~.config.h_families` in turn (:func:`_check_h_family`), its TP 2
    server alone; PASS iff every family passes. A family that cannot be evaluated (no TP 1
    reference, its TP 2 server down) is a FAIL that does not hide the others' results; one the
    time budget left no time for is reported as not run (SKIP if that is the only shortfall). With
    one family its result is the check's (and an unevaluated one raises, as before)."""
    fams = h_families(run.args)
    res: dict[str, CheckResult] = {}
    errors: dict[str, str] = {}
    for f in fams:
        if run.left() <= 0:
            errors[f] = f"not run: time budget of {run.args.budget:.0f} s used up (rerun with --only h --families {f})"
            continue
        try:
            res[f] = _check_h_family(run, f)
        except CheckError as exc:
            if len(fams) == 1:
                raise
            errors[f] = f"could not be evaluated: {exc}"
    if len(fams) == 1 and fams[0] in res:
        return res[fams[0]]
    if errors and all(r.status == PASS for r in res.values()):
        status = unevaluated_status(errors)  # SKIP only when the budget alone is short
    else:
        status = PASS if not errors and all(r.status == PASS for r in res.values()) else FAIL
    measured = " | ".join(f"{f}: {res[f].measured if f in res else errors[f]}" for f in fams)
    return CheckResult("h", status, measured,
                       {"families": {f: res[f].detail for f in res}, "errors": errors})


def _check_h_family(run: Run, f: str) -> CheckResult:
    """Start ``<f>-int2-head-tp2`` alone and compare it with the TP 1 answers: greedy tokens
    identical on every screened prompt and max |d logprob| within ``--h-tol`` (a garbage guard);
    stop it. Both servers' ``max_total_num_tokens`` are reported."""
    ref = run.data.get("h_ref", {}).get(f)
    if ref is None:
        raise CheckError(f"no tp1 reference: {run.data.get('h_ref_error', {}).get(f, 'phase 1 did not run')}")
    name = h_tp2_name(f)
    spec = next((s for s in run.specs if s.name == name), None)
    if spec is None:
        raise CheckError(f"server {name} is not among the run's servers")
    prompts = run.data["greedy_head"][f]
    (srv,) = run.start([spec])
    try:
        run.wait_ready([srv])
        srv = run.need(spec.name)
        cap = dict(run.data.get("h_capacity", {}).get(f, {}), tp2=_capacity(srv))
        rows = []
        for p, r1 in zip(prompts, ref):
            r = run.gen(srv, p["prompt"], run.args.greedy_tokens)
            rows.append({"prompt_len": len(p["prompt"]), "oracle_min_margin": p["min_margin"], **compare_generations(r1, r)})
    finally:
        run.stop([srv])
    eq = sum(r["tokens_equal"] for r in rows)
    mx = max(r["max_abs_dlogprob"] for r in rows)
    ok = eq == len(rows) and mx <= run.args.h_tol
    tok = {k: (cap.get(k) or {}).get("tokens") for k in ("tp2", "tp1")}
    tok = {k: "n/a" if v is None else v for k, v in tok.items()}
    capacity = (f"per-rank max_total_num_tokens tp2 {tok['tp2']} / tp1 {tok['tp1']} (both capped by "
                f"--max-total-tokens {spec.pool_tokens}: reported, not judged)")
    return CheckResult("h", PASS if ok else FAIL,
                       f"{eq}/{len(rows)} prompts same greedy tokens tp2 vs tp1, max |dlogprob| {mx:.2g} "
                       f"(tol {run.args.h_tol:g}); {margins_note(prompts)}; {capacity}",
                       {"prompts": rows, "capacity": cap, "server": name})
