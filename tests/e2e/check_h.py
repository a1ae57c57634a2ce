"""Check h (``--tp2``, two GPUs): an int2 server with ``--tp 2`` and a per-head rotation serves
the same greedy tokens as the ``--tp 1`` server."""

from __future__ import annotations

from .client import compare_generations
from .config import FAIL, PASS
from .results import CheckError, CheckResult, margins_note
from .run import Run


def collect_h_reference(run: Run) -> None:
    """tp1 greedy answers for check h, gathered while the phase-1 servers are up."""
    if "h" not in run.args.checks:
        return
    try:
        srv = run.need("qwen3-int2-head")
        run.data["h_ref"] = [run.gen(srv, p["prompt"], run.args.greedy_tokens) for p in run.data["greedy_head"]]
    except CheckError as exc:
        run.data["h_ref_error"] = str(exc)


def check_h(run: Run) -> CheckResult:
    """Start the TP=2 server alone and compare it with the tp1 answers (:func:`collect_h_reference`);
    max |d logprob| must stay within ``--h-tol``."""
    if "h_ref" not in run.data:
        raise CheckError(f"no tp1 reference: {run.data.get('h_ref_error', 'phase 1 did not run')}")
    spec = next(s for s in run.specs if s.name == "qwen3-int2-head-tp2")
    (srv,) = run.start([spec])
    try:
        run.wait_ready([srv])
        srv = run.need(spec.name)
        rows = []
        for p, ref in zip(run.data["greedy_head"], run.data["h_ref"]):
            r = run.gen(srv, p["prompt"], run.args.greedy_tokens)
            rows.append({"prompt_len": len(p["prompt"]), "oracle_min_margin": p["min_margin"], **compare_generations(ref, r)})
    finally:
        run.stop([srv])
    eq = sum(r["tokens_equal"] for r in rows)
    mx = max(r["max_abs_dlogprob"] for r in rows)
    ok = eq == len(rows) and mx <= run.args.h_tol
    return CheckResult("h", PASS if ok else FAIL,
                       f"{eq}/{len(rows)} prompts same greedy tokens tp2 vs tp1, max |dlogprob| {mx:.2g} (tol {run.args.h_tol:g}); "
                       + margins_note(run.data["greedy_head"]), {"prompts": rows})
