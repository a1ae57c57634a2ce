"""Check a: with the plugin installed, ``--kv-cache-dtype auto`` serves exactly what a
plugin-disabled server serves (greedy tokens and log-probabilities, prompt and output)."""

from __future__ import annotations

from typing import Any

from .client import abs_diff_stats, compare_generations
from .config import FAIL, PASS, main_families
from .results import CheckResult
from .run import Run


def _check_a_family(run: Run, q: str) -> tuple[bool, str, dict[str, Any]]:
    """Servers ``<q>-plugin-off`` vs ``<q>-bf16`` on ``q``'s screened prompts: (ok, measured, detail)."""
    off, on = run.need(f"{q}-plugin-off"), run.need(f"{q}-bf16")
    n = run.args.greedy_tokens
    rows, n_eq, n_bit, worst, worst_in = [], 0, 0, 0.0, 0.0
    for p in run.data["greedy_bf16"][q]:
        r0 = run.gen(off, p["prompt"], n, input_logprobs=True)
        r1 = run.gen(on, p["prompt"], n, input_logprobs=True)
        cmp = compare_generations(r0, r1)
        din = abs_diff_stats(r0["input_logprobs"], r1["input_logprobs"])
        n_eq += cmp["tokens_equal"]
        n_bit += cmp["bit_identical"] and r0["input_logprobs"] == r1["input_logprobs"]
        worst = max(worst, cmp["max_abs_dlogprob"])
        worst_in = max(worst_in, din["max"])
        rows.append({"prompt_len": len(p["prompt"]), **cmp, "prompt_logprobs_max_abs_diff": din["max"]})
    k = len(rows)
    ok = k > 0 and n_eq == k and worst <= run.args.a_tol and worst_in <= run.args.a_tol  # no prompt: nothing shown
    ep = run.meta.get("entry_point", {})
    measured = (f"{n_eq}/{k} prompts same tokens, {n_bit}/{k} bit-identical; max |dlogprob| output {worst:.2g}, "
                f"prompt {worst_in:.2g} (tol {run.args.a_tol:g}); entry point oscar {'found' if ep.get('oscar') else 'MISSING'}")
    if not ep.get("oscar"):
        ok = False
    return ok, measured, {"prompts": rows, "plugin_disabled_env": run.servers[f"{q}-plugin-off"].spec.env,
                          "entry_point": ep}


def check_a(run: Run) -> CheckResult:
    """Each family of :func:`~.config.main_families` (qwen3 by default); tolerance ``--a-tol``."""
    fams = main_families(run.args)
    res = {q: _check_a_family(run, q) for q in fams}
    ok = all(r[0] for r in res.values())
    if len(fams) == 1:
        _, measured, detail = res[fams[0]]
    else:
        measured = " | ".join(f"{q}: {r[1]}" for q, r in res.items())
        detail = {"families": {q: r[2] for q, r in res.items()}}
    return CheckResult("a", PASS if ok else FAIL, measured, detail)
