"""Check b: int2 with BF16 windows covering every position and the identity rotation serves the
same greedy tokens as BF16 (every ``--families`` entry; default Qwen3, Qwen3-MoE, Llama)."""

from __future__ import annotations

from .client import compare_generations
from .config import B_SINK, FAIL, PASS
from .results import CheckResult
from .run import Run


def check_b(run: Run) -> CheckResult:
    """``<model>-bf16`` vs ``<model>-int2-full`` per family: every prompt's greedy tokens equal."""
    n = run.args.greedy_tokens
    per_model, parts, ok = {}, [], True
    for m in run.args.families:
        bf, i2 = run.need(f"{m}-bf16"), run.need(f"{m}-int2-full")
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
