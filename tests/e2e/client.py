"""Client side of the device checks: ``/generate`` requests and answers, streamed decode
rates, server-log parsing and the comparisons of two generations.

Requests go to servers on this machine, never through a proxy (the helpers of
:mod:`sglang_oscar.serving_launcher`: :func:`http_json`, :func:`stream_generate`).
"""

from __future__ import annotations

import re
import time
from typing import Any, Sequence

from sglang_oscar.serving_launcher import http_json, stream_generate

from .config import LEAK_PATTERNS

__all__ = ["abs_diff_stats", "compare_generations", "generate_payload", "http_json", "last_error", "leak_lines",
           "log_stats", "max_total_tokens_from_log", "parse_generation", "served_max_total_tokens",
           "stream_decode_rate", "swa_pool_tokens_from_log"]


def generate_payload(input_ids: Sequence[int], max_new_tokens: int, *, input_logprobs: bool = False,
                     top_logprobs: int = 2, stream: bool = False) -> dict[str, Any]:
    """``/generate`` body: greedy, EOS ignored, log-probs of the output tokens (and of the prompt
    from position 0 with ``input_logprobs``), top-``top_logprobs`` per output token."""
    payload: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    if input_logprobs:
        payload["logprob_start_len"] = 0
    if top_logprobs:
        payload["top_logprobs_num"] = int(top_logprobs)
    if stream:
        payload["stream"] = True
    return payload


def parse_generation(resp: dict[str, Any]) -> dict[str, Any]:
    """Tokens and log-probs of one ``/generate`` answer (``--skip-tokenizer-init`` format).

    Returns ``{"tokens", "logprobs", "margins", "input_logprobs", "cached_tokens", "finish_reason",
    "completion_tokens"}``; ``margins`` are top-1 minus top-2 log-prob per output token (empty
    without top log-probs), ``input_logprobs`` skips the first prompt position (no log-prob)."""
    meta = resp.get("meta_info", {})
    out_lp = meta.get("output_token_logprobs") or []
    tokens = list(resp.get("output_ids") or [int(e[1]) for e in out_lp])
    logprobs = [float(e[0]) for e in out_lp]
    margins = []
    for tops in meta.get("output_top_logprobs") or []:
        vals = sorted((float(e[0]) for e in (tops or []) if e and e[0] is not None), reverse=True)
        if len(vals) >= 2:
            margins.append(vals[0] - vals[1])
    inp = [float(e[0]) for e in (meta.get("input_token_logprobs") or []) if e and e[0] is not None]
    fr = meta.get("finish_reason")
    return {"tokens": tokens, "logprobs": logprobs, "margins": margins, "input_logprobs": inp,
            "cached_tokens": meta.get("cached_tokens"), "completion_tokens": meta.get("completion_tokens"),
            "finish_reason": fr.get("type") if isinstance(fr, dict) else fr}


def stream_decode_rate(url: str, input_ids: Sequence[int], n_new: int, timeout: float) -> dict[str, float]:
    """Stream one greedy request; decode tok/s = tokens after the first chunk / time after it
    (excludes prefill and the first token). Also time to first chunk and end-to-end time."""
    payload = generate_payload(input_ids, n_new, top_logprobs=0, stream=True)
    payload["return_logprob"] = False
    t0 = time.perf_counter()
    first_t = first_n = last_t = last_n = None
    for now, n in stream_generate(url, payload, timeout):
        if first_t is None:
            first_t, first_n = now, n
        last_t, last_n = now, n
    if first_t is None or last_n is None or last_n <= first_n or last_t <= first_t:
        raise RuntimeError(f"streaming gave no decode steps (chunks: first {first_n}, last {last_n})")
    return {"decode_tok_s": (last_n - first_n) / (last_t - first_t), "ttft_s": first_t - t0,
            "e2e_s": last_t - t0, "tokens": float(last_n)}


_ERR_LINE = re.compile(r"^\s*(?:[\w.]+(?:Error|Exception)|AssertionError|SystemExit)\b.*$")


def last_error(log: str) -> str:
    """The last ``SomethingError: message`` line of a log (else its last non-empty line)."""
    lines = [ln.rstrip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _ERR_LINE.match(ln):
            return ln.strip()[:600]
    return lines[-1].strip()[:600] if lines else ""


def max_total_tokens_from_log(log: str) -> int | None:
    """``max_total_num_tokens=N`` of the scheduler's startup line (the last one in the log)."""
    found = re.findall(r"max_total_num_tokens=(\d+)", log)
    return int(found[-1]) if found else None


def served_max_total_tokens(url: str, log: str) -> tuple[int | None, str]:
    """A running server's ``max_total_num_tokens`` (tokens of its KV pool; with ``--tp-size`` N
    each rank's pool, which holds 1/N of the kv heads, since every rank holds every token) and
    where it came from: ``/server_info`` (or the deprecated ``/get_server_info``), else the
    scheduler's startup line in ``log`` (rank 0 logs it): ``(tokens or None, "server_info" | "log")``."""
    for ep in ("/server_info", "/get_server_info"):
        try:
            info = http_json(url + ep, timeout=30)
        except (RuntimeError, ValueError):
            continue
        tok = info.get("max_total_num_tokens") if isinstance(info, dict) else None
        if tok is not None:
            return int(tok), "server_info"
        break
    return max_total_tokens_from_log(log), "log"


def swa_pool_tokens_from_log(log: str) -> dict[str, int] | None:
    """``{"full": F, "swa": S}`` of SGLang's hybrid SWA startup line ``full_layer_tokens=F,
    swa_layer_tokens=S`` (the last one in the log), ``None`` without one."""
    found = re.findall(r"full_layer_tokens=(\d+), swa_layer_tokens=(\d+)", log)
    return {"full": int(found[-1][0]), "swa": int(found[-1][1])} if found else None


def kind_bytes_from_log(log: str) -> dict[str, dict[str, Any]]:
    """Per layer kind (``full`` / ``sliding``) of a hybrid model, the plugin's startup line
    ``sglang-oscar: INT2|BF16 (--oscar-skip-layers) KV cache, <kind> layers (...): N bytes/token
    (BF16: M, ...); tokens: T`` (the last one per kind): ``{"format", "bytes", "bf16_bytes", "tokens"}``."""
    out: dict[str, dict[str, Any]] = {}
    pat = (r"sglang-oscar: (INT2|BF16 \(--oscar-skip-layers\)) KV cache, (\w+) layers \([^)]*\): (\d+) bytes/token "
           r"\(BF16: (\d+), [\d.]+x fewer\); tokens: (\d+)")
    for fmt, kind, n, bf, tok in re.findall(pat, log):
        out[kind] = {"format": "bf16" if fmt.startswith("BF16") else "int2", "bytes": int(n), "bf16_bytes": int(bf),
                     "tokens": int(tok)}
    return out


def kv_allocations_from_log(log: str) -> list[dict[str, Any]]:
    """SGLang's own line per allocated KV pool, ``KV Cache is allocated. dtype: D, #tokens: N, K size:
    A GB, V size: B GB`` (0.5.16 ``MHATokenToKVPool``, sizes in GiB; a hybrid SWA model logs one per
    sub-pool), in log order: ``{"dtype", "tokens", "k_gb", "v_gb"}``."""
    pat = r"KV Cache is allocated\. dtype: ([\w.]+), #tokens: (\d+), K size: ([\d.]+) GB, V size: ([\d.]+) GB"
    return [{"dtype": d, "tokens": int(n), "k_gb": float(k), "v_gb": float(v)} for d, n, k, v in re.findall(pat, log)]


def mamba_pool_from_log(log: str) -> dict[str, float] | None:
    """The mamba state pool of a linear-attention hybrid (Qwen3-Next), separate from the KV pool:
    ``{"slots": N, "conv_gb": C, "ssm_gb": S}`` of SGLang's startup line ``Mamba Cache is allocated.
    max_mamba_cache_size: N, conv_state size: C GB, ssm_state size: S GB`` (the last one; 0.5.16
    ``srt/mem_cache/memory_pool.py:740``), ``None`` without one."""
    found = re.findall(r"max_mamba_cache_size: (\d+), conv_state size: ([\d.]+)GB, ssm_state size: ([\d.]+)GB", log)
    if not found:
        return None
    n, conv, ssm = found[-1]
    return {"slots": int(n), "conv_gb": float(conv), "ssm_gb": float(ssm)}


def leak_lines(log: str) -> list[str]:
    """Log lines reporting an SGLang memory-leak / KV-page invariant violation."""
    return [ln.strip() for ln in log.splitlines() if any(p.lower() in ln.lower() for p in LEAK_PATTERNS)]


def compare_generations(ref: dict, other: dict) -> dict[str, Any]:
    """Token and log-prob agreement of two parsed generations (:func:`parse_generation`).

    ``first_diff``: index of the first differing token (None if equal); ``ref_margin_at_diff``: the
    reference's top-1/top-2 margin there (small = a near-tie); ``max_abs_dlogprob``: over the
    common prefix of equal tokens."""
    a, b = ref["tokens"], other["tokens"]
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    if first is None and len(a) != len(b):
        first = n
    upto = n if first is None else first
    d = [abs(x - y) for x, y in zip(ref["logprobs"][:upto], other["logprobs"][:upto])]
    margins = ref.get("margins") or []
    return {
        "tokens_equal": first is None,
        "first_diff": first,
        "ref_margin_at_diff": (margins[first] if first is not None and first < len(margins) else None),
        "ref_min_margin": min(margins) if margins else None,
        "max_abs_dlogprob": max(d) if d else 0.0,
        "bit_identical": first is None and ref["logprobs"] == other["logprobs"],
    }


def abs_diff_stats(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """mean / max |a - b| over the common length (and that length)."""
    n = min(len(a), len(b))
    if n == 0:
        return {"mean": float("nan"), "max": float("nan"), "n": 0}
    d = [abs(float(x) - float(y)) for x, y in zip(a[:n], b[:n])]
    return {"mean": sum(d) / n, "max": max(d), "n": n}


def log_stats(log: str) -> dict[str, Any]:
    q = [int(x) for x in re.findall(r"#queue-req: (\d+)", log)]
    u = [float(x) for x in re.findall(r"token usage: ([\d.]+)", log)]
    c = [int(x) for x in re.findall(r"#cached-token: (\d+)", log)]
    r = [int(x) for x in re.findall(r"#running-req: (\d+)", log)]
    return {"max_queue_req": max(q, default=None), "max_token_usage": max(u, default=None),
            "cached_tokens_total": sum(c), "max_running_req": max(r, default=None),
            "retractions": len(re.findall(r"[Rr]etract", log)), "tracebacks": log.count("Traceback")}
