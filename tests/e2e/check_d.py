"""Check d: a radix-cache hit, chunked prefill (64) and a server without CUDA graphs serve the
same tokens and log-probabilities as the plain int2 server.

The radix hit is judged on the family's fp32 int2 server of check c (``--c-fp32``) when the run has
one, else on the BF16 one: a hit re-runs the prompt's last tokens (at least ``recent``) as a short
extend, and in BF16 SGLang's GEMMs round those rows differently from the fresh run's long extend,
which INT2 codes of later layers can amplify (docs/serving_hybrid.md, check d on the sliding-window
families); the BF16 hit is reported either way. For the MoE families of
:data:`~.config.ROUTED_FAMILIES` the chunked prefill is judged the same way, on an fp32 chunk-64
twin (a BF16 GEMM's row count can flip a near-tied expert routing)."""

from __future__ import annotations

from .client import abs_diff_stats, compare_generations
from .config import FAIL, PASS, ROUTED_FAMILIES, main_families
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
    chunk32 = run.need(fp32_name(q, "layer-chunk64")) if fp32 is not None and q in ROUTED_FAMILIES else None
    chunk_key = "chunk64_fp32" if chunk32 is not None else "chunk64"
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
            if chunk32 is not None:
                row["chunk64_fp32"] = compare_generations(fresh32, run.gen(chunk32, p["prompt"], n))
        rows.append(row)
        for key in (radix_key, chunk_key, "no_cuda_graph"):
            ok &= row[key]["tokens_equal"] and row[key]["max_abs_dlogprob"] <= args.d_tol
        ok &= bool(second["cached_tokens"])
    # prompt log-probs, chunked vs unchunked (full recompute: logprob_start_len 0)
    longest = max((pp["prompt"] for pp in screened), key=len)
    def prompt_lp_diff(unchunked, chunked):
        a, b = (run.gen(srv, longest, 1, input_logprobs=True, top_logprobs=0)["input_logprobs"]
                for srv in (unchunked, chunked))
        return abs_diff_stats(a, b)

    pl = prompt_lp_diff(fp32, chunk32) if chunk32 is not None else prompt_lp_diff(base, chunk)
    if chunk32 is not None:  # the BF16 pair, reported
        pl_bf16 = prompt_lp_diff(base, chunk)
    ok &= pl["n"] == len(longest) - 1 and pl["mean"] <= args.d_tol

    def summ(key):
        eq = sum(r[key]["tokens_equal"] for r in rows)
        bit = sum(r[key]["bit_identical"] for r in rows)
        mx = max(r[key]["max_abs_dlogprob"] for r in rows)
        return f"{eq}/{len(rows)} same ({bit} bit-identical, max |dlogprob| {mx:.2g})"

    cached = [r["radix_cached_tokens"] for r in rows]
    radix32 = f"; judged on the fp32 server: {summ('radix_fp32')}" if fp32 is not None else ""
    if chunk32 is not None:
        chunk_txt = (f"chunk 64 judged on fp32 servers: {summ('chunk64_fp32')}, prompt logprobs mean/max |d| "
                     f"{pl['mean']:.2g}/{pl['max']:.2g} (BF16, reported: {summ('chunk64')}, prompt logprobs "
                     f"{pl_bf16['mean']:.2g}/{pl_bf16['max']:.2g})")
    else:
        chunk_txt = f"chunk 64: {summ('chunk64')}, prompt logprobs mean/max |d| {pl['mean']:.2g}/{pl['max']:.2g}"
    measured = (f"radix hit (cached {cached} of {[r['prompt_len'] for r in rows]}): {summ('radix')}{radix32}; "
                f"{chunk_txt}; no CUDA graph: {summ('no_cuda_graph')}; tol {args.d_tol:g}")
    detail = {"prompts": rows, "chunked_prompt_logprobs": pl, "screening": margins_note(screened)}
    if chunk32 is not None:
        detail["chunked_prompt_logprobs_bf16"] = pl_bf16
    return CheckResult("d", PASS if ok else FAIL, measured, detail)
