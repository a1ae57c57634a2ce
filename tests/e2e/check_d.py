"""Check d: a radix-cache hit, chunked prefill (64) and a server without CUDA graphs serve the
same tokens and log-probabilities as the plain int2 server.

The radix hit is judged on the family's fp32 int2 server of check c (``--c-fp32``) when the run has
one, else on the BF16 one: a hit re-runs the prompt's last tokens (at least ``recent``) as a short
extend, and in BF16 SGLang's GEMMs round those rows differently from the fresh run's long extend,
which INT2 codes of later layers can amplify (docs/serving.md, check d on the sliding-window
families); the BF16 hit is reported either way."""

from __future__ import annotations

from .client import abs_diff_stats, compare_generations
from .config import FAIL, PASS, main_families
from .fp32_shim import fp32_name
from .results import CheckResult, margins_note, per_family
from .run import Run


def check_d(run: Run) -> CheckResult:
    """Each family of :func:`~.config.main_families` (qwen3 by default): :func:`_check_d_family`."""
    return per_family("d", main_families(run.args), lambda q: _check_d_family(run, q))


def _check_d_family(run: Run, q: str) -> CheckResult:
    """Radix hit, chunk 64 and no CUDA graph vs the first answer of ``<q>-int2-layer``: same tokens,
    max |d logprob| <= ``--d-tol``; chunked prompt log-probs mean |d| <= ``--d-tol``."""
    args = run.args
    n = args.greedy_tokens
    base, chunk, eager = (run.need(f"{q}-int2-layer"), run.need(f"{q}-int2-layer-chunk64"),
                          run.need(f"{q}-int2-layer-eager"))
    screened = run.fdata(q)["greedy_layer"]
    fp32 = run.need(fp32_name(q, "layer")) if fp32_name(q, "layer") in run.servers else None
    radix_key = "radix_fp32" if fp32 is not None else "radix"
    rows, ok = [], True
    for p in screened:
        first = run.gen(base, p["prompt"], n)
        second = run.gen(base, p["prompt"], n)  # radix hit
        r_chunk = run.gen(chunk, p["prompt"], n)
        r_eager = run.gen(eager, p["prompt"], n)
        row = {"prompt_len": len(p["prompt"]), "oracle_min_margin": p["min_margin"],
               "oracle_tokens_equal": first["tokens"] == p["tokens"],
               "radix_cached_tokens": second["cached_tokens"],
               "radix": compare_generations(first, second), "chunk64": compare_generations(first, r_chunk),
               "no_cuda_graph": compare_generations(first, r_eager)}
        if fp32 is not None:
            fresh32 = run.gen(fp32, p["prompt"], n)
            hit32 = run.gen(fp32, p["prompt"], n)
            row["radix_fp32"], row["radix_fp32_cached_tokens"] = compare_generations(fresh32, hit32), hit32["cached_tokens"]
            ok &= bool(hit32["cached_tokens"])
        rows.append(row)
        for key in (radix_key, "chunk64", "no_cuda_graph"):
            ok &= row[key]["tokens_equal"] and row[key]["max_abs_dlogprob"] <= args.d_tol
        ok &= bool(second["cached_tokens"])
    # prompt log-probs, chunked vs unchunked (full recompute: logprob_start_len 0)
    longest = max((pp["prompt"] for pp in screened), key=len)
    a = run.gen(base, longest, 1, input_logprobs=True, top_logprobs=0)["input_logprobs"]
    b = run.gen(chunk, longest, 1, input_logprobs=True, top_logprobs=0)["input_logprobs"]
    pl = abs_diff_stats(a, b)
    ok &= pl["n"] == len(longest) - 1 and pl["mean"] <= args.d_tol

    def summ(key):
        eq = sum(r[key]["tokens_equal"] for r in rows)
        bit = sum(r[key]["bit_identical"] for r in rows)
        mx = max(r[key]["max_abs_dlogprob"] for r in rows)
        return f"{eq}/{len(rows)} same ({bit} bit-identical, max |dlogprob| {mx:.2g})"

    cached = [r["radix_cached_tokens"] for r in rows]
    radix32 = f"; judged on the fp32 server: {summ('radix_fp32')}" if fp32 is not None else ""
    measured = (f"radix hit (cached {cached} of {[r['prompt_len'] for r in rows]}): {summ('radix')}{radix32}; chunk 64: "
                f"{summ('chunk64')}, prompt logprobs mean/max |d| {pl['mean']:.2g}/{pl['max']:.2g}; no CUDA graph: "
                f"{summ('no_cuda_graph')}; tol {args.d_tol:g}")
    return CheckResult("d", PASS if ok else FAIL, measured,
                       {"prompts": rows, "chunked_prompt_logprobs": pl, "screening": margins_note(screened)})
