"""Check b: int2 with BF16 windows covering every position and the identity rotation serves the
same greedy tokens as BF16 (every ``--families`` entry; default Qwen3, Qwen3-MoE, Llama)."""

from __future__ import annotations

from .client import compare_generations
from .config import B_SINK, FAIL, PASS
from .results import CheckError, CheckResult
from .run import Run
from .servers import b_baseline


def check_b(run: Run) -> CheckResult:
    """BF16 (:func:`~.servers.b_baseline`: a sliding-window family's BF16 server decodes over the
    same ``W`` keys as INT2 and transformers, :mod:`.window_shim`) vs ``<model>-int2-full`` per
    family: every prompt's greedy tokens equal (a family whose servers are down is a FAIL that
    does not hide the other families' results)."""
    n = run.args.greedy_tokens
    per_model, parts, ok = {}, [], True
    for m in run.args.families:
        try:
            bf, i2 = run.need(b_baseline(m)), run.need(f"{m}-int2-full")
        except CheckError as exc:
            if len(run.args.families) == 1:
                raise
            ok = False  # this family cannot be evaluated; the others still are
            parts.append(f"{m} could not be evaluated ({exc})")
            continue
        rows = []
        for p in run.data["greedy_bf16"][m]:
            r0 = run.gen(bf, p["prompt"], n)
            r1 = run.gen(i2, p["prompt"], n)
            rows.append({"prompt_len": len(p["prompt"]), "hf_min_margin": p["min_margin"], **compare_generations(r0, r1)})
        eq = sum(r["tokens_equal"] for r in rows)
        ok &= eq == len(rows)
        mx = max(r["max_abs_dlogprob"] for r in rows)
        parts.append(f"{m} {eq}/{len(rows)} (max |dlogprob| {mx:.2g})")
        per_model[m] = rows
    measured = "identical greedy tokens: " + ", ".join(parts) + f"; sink {B_SINK} >= prompt+{n}, identity rotation"
    return CheckResult("b", PASS if ok else FAIL, measured, {"models": per_model})
