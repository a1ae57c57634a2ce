"""Check b: int2 with BF16 windows covering every position and the identity rotation serves the
same greedy tokens as BF16 (every ``--families`` entry; default Qwen3, Qwen3-MoE, Llama).

With ``--c-fp32`` a MoE family of :data:`~.config.ROUTED_FAMILIES` is judged on ``--dtype float32``
twins of both servers (:func:`~.servers.b_baseline` with ``fp32``, ``<family>-int2-full-fp32``): in
BF16 a rounding change can flip a near-tied expert routing (GPT-OSS: one prompt flipped at a 0.13
top-2 margin while the log-probs before it agreed to 0.016); the BF16 pair is reported."""

from __future__ import annotations

from .client import compare_generations
from .config import B_SINK, FAIL, PASS, ROUTED_FAMILIES
from .fp32_shim import fp32_name
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
        pair32 = (b_baseline(m, fp32=True), fp32_name(m, "full"))
        fp32 = m in ROUTED_FAMILIES and all(name in run.servers for name in pair32)
        rows = _compare(run, m, bf, i2, n)
        text = _summary(rows)
        if fp32:
            rows32 = _compare(run, m, *(run.need(name) for name in pair32), n)
            per_model[f"{m}-fp32"] = rows32
            ok &= all(r["tokens_equal"] for r in rows32)
            parts.append(f"{m} judged on fp32 servers {_summary(rows32)} (BF16, reported: {text})")
        else:
            ok &= all(r["tokens_equal"] for r in rows)
            parts.append(f"{m} {text}")
        per_model[m] = rows
    measured = "identical greedy tokens: " + ", ".join(parts) + f"; sink {B_SINK} >= prompt+{n}, identity rotation"
    return CheckResult("b", PASS if ok else FAIL, measured, {"models": per_model})


def _compare(run: Run, m: str, bf, i2, n: int) -> list[dict]:
    """Greedy generations of ``bf`` and ``i2`` on family ``m``'s screened prompts, compared."""
    rows = []
    for p in run.data["greedy_bf16"][m]:
        r0, r1 = run.gen(bf, p["prompt"], n), run.gen(i2, p["prompt"], n)
        rows.append({"prompt_len": len(p["prompt"]), "hf_min_margin": p["min_margin"], **compare_generations(r0, r1)})
    return rows


def _summary(rows: list[dict]) -> str:
    eq = sum(r["tokens_equal"] for r in rows)
    return f"{eq}/{len(rows)} (max |dlogprob| {max(r['max_abs_dlogprob'] for r in rows):.2g})"
