"""Checks f and g, measured together on one pair of long-context servers that run alone: f, the
KV pool (``max_total_num_tokens``) of int2 vs BF16 at the same ``--mem-fraction-static``; g, decode
tok/s at 32K context, batch 1, int2 vs BF16. With sliding-window and hybrid families
(``--families``, :data:`~.config.SIZED_FAMILIES`), f also measures a ``<family>-sizing-bf16`` /
``-int2`` pair per family, per pool (and, for SGLang's hybrid SWA families, a third int2 server with
``--oscar-skip-layers sliding``, whose sliding pool SGLang must allocate in BF16 at the BF16
server's bytes per token while the full pool stays INT2): SGLang's hybrid SWA memory (Gemma-4, GPT-OSS) logs
``full_layer_tokens=F, swa_layer_tokens=S`` (``sglang/srt/model_executor/pool_configurator.py``
``_solve_pool_sizes``; ``/server_info``'s ``max_total_num_tokens`` is F), and each pool's ratio
must reach the target. A linear-attention hybrid (Qwen3-Next) has one KV pool (its full-attention
layers: ``max_total_num_tokens``, pool ``kv``) and a separate mamba state pool, which INT2 does not
touch: its size (``max_mamba_cache_size``) is reported, not judged."""

from __future__ import annotations

from typing import Any

from .checkpoints import random_prompt
from .client import (kind_bytes_from_log, kv_allocations_from_log, mamba_pool_from_log, served_max_total_tokens,
                     stream_decode_rate, swa_pool_tokens_from_log)
from .config import FAIL, LINEAR_FAMILIES, PASS
from .results import CheckError, CheckResult, unevaluated_status
from .run import Run


def measure_long(run: Run, name: str) -> dict[str, Any]:
    """Start one long-context server alone; its max_total_num_tokens and (g) decode rates."""
    spec = next(s for s in run.specs if s.name == name)
    (srv,) = run.start([spec])
    out: dict[str, Any] = {"server": name}
    try:
        run.wait_ready([srv])
        srv = run.need(name)
        log = srv.log_text()
        out["max_total_num_tokens"], out["max_total_num_tokens_source"] = served_max_total_tokens(srv.url, log)
        pools = swa_pool_tokens_from_log(log)
        out["pools"] = pools or {"kv" if spec.model in LINEAR_FAMILIES else "all": out["max_total_num_tokens"]}
        kinds, allocs = kind_bytes_from_log(log), kv_allocations_from_log(log)
        if kinds:
            out["kinds"] = kinds
        if allocs:
            out["allocations"] = allocs
        mamba = mamba_pool_from_log(log)
        if mamba:
            out["mamba_pool"] = mamba
        if "g" in run.args.checks and spec.model == "long":
            a = run.args
            run.gen(srv, random_prompt(256, 3), 8)  # warm-up
            out["short"] = stream_decode_rate(srv.url, random_prompt(512, 4), a.decode_tokens, a.request_timeout)
            out["long"] = stream_decode_rate(srv.url, random_prompt(a.long_context, 5), a.decode_tokens,
                                             a.request_timeout)
    finally:
        run.stop([srv])
    return out


def _pool_ratios(run: Run, res: dict[str, Any], model: str) -> tuple[bool, str] | None:
    """f for the sizing pair of a sliding-window family: (ok, text) per pool, None if unmeasured."""
    bf, i2 = (res.get(f"{model}-sizing-{k}", {}).get("pools") for k in ("bf16", "int2"))
    if not bf or not i2 or set(bf) != set(i2) or not all(bf.values()) or not all(i2.values()):
        return None
    ratios = {p: i2[p] / bf[p] for p in bf}
    text = ", ".join(f"{p} pool int2 {i2[p]} / BF16 {bf[p]} = {r:.2f}x" for p, r in ratios.items())
    mb, mi = (res.get(f"{model}-sizing-{k}", {}).get("mamba_pool") for k in ("bf16", "int2"))
    if mb or mi:  # reported, not judged: INT2 leaves the mamba state pool alone
        text += "; mamba pool " + ", ".join(
            f"{k} {m['slots']} slots (conv {m['conv_gb']:g} GB, ssm {m['ssm_gb']:g} GB)" if m else f"{k} not logged"
            for k, m in (("int2", mi), ("BF16", mb)))
    return all(r >= run.args.memory_target for r in ratios.values()), f"{model}: {text}"


def _sub_pools(measured: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The full / sliding KV pools SGLang allocated for a hybrid SWA server (its own ``KV Cache is
    allocated`` lines matched to ``full_layer_tokens`` / ``swa_layer_tokens`` by token count), each
    with its bytes per token."""
    pools, out = measured.get("pools") or {}, {}
    for a in measured.get("allocations") or []:
        kind = "sliding" if a["tokens"] == pools.get("swa") else "full" if a["tokens"] == pools.get("full") else None
        if kind and a["tokens"]:
            out[kind] = dict(a, bytes_per_token=(a["k_gb"] + a["v_gb"]) * 2**30 / a["tokens"])  # its "GB" are GiB
    return out


def _skip_sliding(res: dict[str, Any], model: str) -> tuple[bool, str] | None:
    """f for ``--oscar-skip-layers sliding`` (hybrid SWA families), from SGLang's own allocation
    lines: the sliding pool is BF16 at the BF16 server's bytes per token (within 1 %, its GB are
    rounded), the full pool INT2 (uint8 codes); the plugin's per-kind line and each pool's tokens
    beside the BF16 server's are reported. None when the server was not measured."""
    sk, bf = res.get(f"{model}-sizing-int2-skip-sliding"), res.get(f"{model}-sizing-bf16") or {}
    got, ref = _sub_pools(sk or {}), _sub_pools(bf)
    if set(got) != {"full", "sliding"} or "sliding" not in ref:
        return None
    sl, fu, bsl = got["sliding"], got["full"], ref["sliding"]
    ok = (sl["dtype"] == bsl["dtype"] == "torch.bfloat16" and fu["dtype"] == "torch.uint8"
          and abs(sl["bytes_per_token"] / bsl["bytes_per_token"] - 1) < 0.01)
    kinds = sk.get("kinds", {})
    plugin = "; ".join(f"plugin: {k} {v['format'].upper()} {v['bytes']} B/token" for k, v in sorted(kinds.items()))
    text = (f"{model} --oscar-skip-layers sliding: sliding pool {sl['dtype']} {sl['bytes_per_token']:.0f} B/token "
            f"(BF16 server {bsl['dtype']} {bsl['bytes_per_token']:.0f}), {sl['tokens']} tokens (BF16 server "
            f"{bsl['tokens']}); full pool {fu['dtype']} {fu['bytes_per_token']:.0f} B/token, {fu['tokens']} tokens"
            + (f" ({plugin})" if plugin else ""))
    return ok, text


def check_fg(run: Run) -> None:
    """Measure ``long-bf16`` and ``long-int2`` (and each sliding-window family's sizing pair) one
    after the other and record f and/or g (targets ``--memory-target``, ``--speedup-target``); a
    check the budget cut short is SKIP."""
    ch = set(run.args.checks)
    res: dict[str, Any] = {}
    errors: dict[str, str] = {}
    names = [s.name for s in run.specs if s.phase == 2 and s.tp == 1 and set(s.checks) & set("fg")]
    swa = [n[: -len("-sizing-bf16")] for n in names if n.endswith("-sizing-bf16")]
    for name in names:
        if run.left() <= 0:
            errors[name] = f"time budget of {run.args.budget:.0f} s used up"
            continue
        try:
            res[name] = measure_long(run, name)
        except (CheckError, RuntimeError) as exc:
            errors[name] = str(exc)
    run.data["long"] = res
    if "f" in ch and swa:
        parts = {m: _pool_ratios(run, res, m) for m in swa}
        parts.update({f"{m} skip-sliding": _skip_sliding(res, m) for m in swa
                      if f"{m}-sizing-int2-skip-sliding" in names})
        if "long-bf16" in names:
            bf, i2 = (res.get(n, {}).get("max_total_num_tokens") for n in ("long-bf16", "long-int2"))
            parts["long"] = (i2 / bf >= run.args.memory_target, f"long: int2 {i2} / BF16 {bf} = {i2 / bf:.2f}x") \
                if bf and i2 else None
        done = {m: p for m, p in parts.items() if p is not None}
        missing = [m for m, p in parts.items() if p is None]
        ok = not missing and all(p[0] for p in done.values())
        text = ("max_total_num_tokens per pool: " + "; ".join(p[1] for p in done.values())
                + (f"; not measured: {', '.join(missing)} ({errors or 'tokens not found'})" if missing else "")
                + f" (target >= {run.args.memory_target:g}x each; --mem-fraction-static {run.args.sizing_mem_fraction:g}, "
                  "group 128 (or the head_dim if smaller), fp16 scales)")
        status = PASS if ok else (FAIL if done or not errors else unevaluated_status(errors))
        run.record(CheckResult("f", status, text, {"long": res, "errors": errors}))
    elif "f" in ch:
        bf, i2 = (res.get(n, {}).get("max_total_num_tokens") for n in ("long-bf16", "long-int2"))
        if bf and i2:
            ratio = i2 / bf
            r = CheckResult("f", PASS if ratio >= run.args.memory_target else FAIL,
                            f"max_total_num_tokens int2 {i2} / BF16 {bf} = {ratio:.2f}x (target >= {run.args.memory_target:g}x; "
                            f"--mem-fraction-static {run.args.sizing_mem_fraction:g}, group 128 (or the head_dim if smaller), fp16 scales)",
                            {"long": res, "errors": errors})
        else:
            r = CheckResult("f", unevaluated_status(errors),
                            f"could not be evaluated: {errors or 'max_total_num_tokens not found'}",
                            {"long": res, "errors": errors})
        run.record(r)
    if "g" in ch:
        try:
            bf, i2 = res["long-bf16"]["long"]["decode_tok_s"], res["long-int2"]["long"]["decode_tok_s"]
            sb, si = res["long-bf16"]["short"]["decode_tok_s"], res["long-int2"]["short"]["decode_tok_s"]
        except KeyError:
            run.record(CheckResult("g", unevaluated_status(errors), f"could not be evaluated: {errors or 'no decode timings'}",
                                   {"long": res, "errors": errors}))
            return
        ratio = i2 / bf
        att_bf = 1e3 / bf - 1e3 / sb  # ms per step attributable to the longer context
        att_i2 = 1e3 / i2 - 1e3 / si
        run.record(CheckResult(
            "g", PASS if ratio >= run.args.speedup_target else FAIL,
            f"decode at {run.args.long_context} ctx, batch 1: int2 {i2:.0f} tok/s / BF16 {bf:.0f} tok/s = {ratio:.2f}x "
            f"(target >= {run.args.speedup_target:g}x); at 512 ctx int2 {si:.0f} / BF16 {sb:.0f} tok/s; "
            f"context-attributable step time int2 {att_i2:.2f} ms / BF16 {att_bf:.2f} ms",
            {"long": res, "errors": errors, "context_step_ms": {"int2": att_i2, "bf16": att_bf}}))
