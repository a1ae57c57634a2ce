"""Check c: the quantizing int2 servers (sink 16 / recent 32, per-layer and per-head fitted
rotations) against the PyTorch oracle, prefill and decode log-probabilities; with ``--c-fp32``
the ``--dtype float32`` servers against the oracle on the fp32 model are the criterion."""

from __future__ import annotations

from typing import Any

from .client import abs_diff_stats
from .config import C_RECENT, C_SINK, FAIL, PASS, main_families
from .fp32_shim import C_FP32_SERVERS, fp32_name
from .oracle import teacher_forced_logprobs
from .results import CheckError, CheckResult, per_family
from .run import Run


def _c_against_oracle(run: Run, server: str, model, kind: str, dtype: str, family: str = "qwen3") -> dict[str, Any]:
    """One int2 server of check c vs the oracle on ``model``: (1) prefill, the served
    ``input_token_logprobs`` of a prompt-only request (``logprob_start_len 0``: fully recomputed)
    vs the precomputed oracle with extend windows; (2) decode, the ``output_token_logprobs`` of
    ``--c-decode-tokens`` served greedy tokens vs the oracle teacher-forced on them (prompt
    positions extend windows, generated positions decode windows). ``dtype`` ``bf16`` or
    ``fp32`` names the references (model and oracle HP tier in that dtype) of ``family``."""
    import torch

    d = run.fdata(family)
    args, prompts = run.args, d["c_prompts"]
    cfg = run.data["c_config" if dtype == "bf16" else "c_config_fp32"]
    hp = torch.float32 if dtype == "fp32" else None  # None: the oracle's BF16 HP tier
    oracle = d[f"c_oracle_{kind}" if dtype == "bf16" else f"c_oracle_fp32_{kind}"]
    plain = d[f"c_hf_{dtype}"]
    srv = run.need(server)
    rs = d[f"c_rot_{kind}"]
    rows, complete = [], True
    for i, prompt in enumerate(prompts):
        gen = run.gen(srv, prompt, args.c_decode_tokens)  # fresh prefill + decode
        pre = run.gen(srv, prompt, 1, input_logprobs=True, top_logprobs=0)  # logprob_start_len 0: full recompute
        prefill = abs_diff_stats(pre["input_logprobs"], oracle[i])
        seq = list(prompt) + gen["tokens"]
        orc = teacher_forced_logprobs(model, [seq], rotation=rs, config=cfg, prompt_lens=[len(prompt)], hp_dtype=hp)[0]
        decode = abs_diff_stats(gen["logprobs"], orc[len(prompt) - 1:])
        quant = abs_diff_stats(oracle[i], plain[i])
        rows.append({"prompt_len": len(prompt), "prefill_vs_oracle": prefill, "decode_vs_oracle": decode,
                     f"oracle_int2_vs_hf_{dtype}": quant, "served_prompt_logprobs": len(pre["input_logprobs"])})
        m64 = run.hf.get(f"{family}-fp64") if dtype == "fp32" else None
        if m64 is not None:  # reported: the fp32 oracle against itself on the model in fp64
            o64 = teacher_forced_logprobs(m64, [seq], rotation=rs, config=cfg, prompt_lens=[len(prompt)], hp_dtype=hp)[0]
            rows[-1]["oracle_fp64_vs_fp32"] = {"prefill": abs_diff_stats(d[f"c_oracle_fp64_{kind}"][i], oracle[i]),
                                               "decode": abs_diff_stats(o64[len(prompt) - 1:], orc[len(prompt) - 1:])}
        if prefill["n"] != len(prompt) - 1 or decode["n"] != args.c_decode_tokens:
            complete = False
            rows[-1]["problem"] = "missing log-probs in the server answer"
    def mean(key: str) -> float:
        return sum(r[key]["mean"] for r in rows) / len(rows)

    pm, dm = mean("prefill_vs_oracle"), mean("decode_vs_oracle")
    ok = complete and all(r["prefill_vs_oracle"]["mean"] < args.c_tol and r["decode_vs_oracle"]["mean"] < args.c_tol
                          for r in rows)
    res = {"server": server, "rows": rows, "prefill_mean": pm, "decode_mean": dm,
           "quantization_effect_mean": mean(f"oracle_int2_vs_hf_{dtype}"), "ok": ok}
    if all("oracle_fp64_vs_fp32" in r for r in rows):
        res["oracle_fp64_spread"] = {part: [r["oracle_fp64_vs_fp32"][part]["mean"] for r in rows]
                                     for part in ("prefill", "decode")}
    return res


def _per_prompt(res: dict[str, Any]) -> str:
    """Per-prompt ``prefill / decode`` means of one fp32 server against the oracle, and of the same
    oracle on the model in fp64 against it: ``served 0.011,0.02 / 0.026,0.022, oracle fp64 ...``."""
    def two(prefill: list[float], decode: list[float]) -> str:
        return ",".join(f"{x:.2g}" for x in prefill) + " / " + ",".join(f"{x:.2g}" for x in decode)

    served = two([r["prefill_vs_oracle"]["mean"] for r in res["rows"]], [r["decode_vs_oracle"]["mean"] for r in res["rows"]])
    return f"served {served}, oracle fp64 {two(res['oracle_fp64_spread']['prefill'], res['oracle_fp64_spread']['decode'])}"


def _c_noise_floor(run: Run, server: str, reference: list[list[float]], prompts: list[list[int]]) -> float | None:
    """Mean |served - HF| prompt log-prob of a plain (``--kv-cache-dtype auto``) server on c's
    prompts, ``None`` when that server is not serving (a reported number, not a criterion)."""
    srv = run.servers.get(server)
    if srv is None or srv.t_ready is None or not srv.alive():
        return None
    fl = [abs_diff_stats(run.gen(srv, p, 1, input_logprobs=True, top_logprobs=0)["input_logprobs"], reference[i])["mean"]
          for i, p in enumerate(prompts)]
    return sum(fl) / len(fl)


def check_c(run: Run) -> CheckResult:
    """PASS when every prompt's mean |served - oracle| log-prob, prefill and decode, is below ``--c-tol``
    for both rotations (the fp32 servers with ``--c-fp32``, else the BF16 ones); noise floors reported.
    Each family of :func:`~.config.main_families` (qwen3 by default; a sliding-window family adds a
    prompt 4x its window, :func:`~.config.c_prompt_lens`)."""
    return per_family("c", main_families(run.args), lambda q: _check_c_family(run, q))


def _check_c_family(run: Run, q: str) -> CheckResult:
    """Check c on family ``q``: servers ``<q>-int2-layer`` / ``-head`` (and their fp32 twins)."""
    args = run.args
    d = run.fdata(q)
    prompts = d["c_prompts"]
    detail: dict[str, Any] = {"settings": {"sink": C_SINK, "recent": C_RECENT, "prompt_lens": [len(p) for p in prompts],
                                           "decode_tokens": args.c_decode_tokens, "fp32": args.c_fp32,
                                           "criterion": "fp32" if args.c_fp32 else "bf16"}}
    # BF16 servers vs the oracle on the bf16 model (HP BF16): the criterion unless --c-fp32
    bf16_ok, bf16_txt = False, ""
    try:
        parts = []
        for kind in ("layer", "head"):
            detail[kind] = _c_against_oracle(run, f"{q}-int2-{kind}", run.hf[q], kind, "bf16", q)
            parts.append(f"{kind}: prefill {detail[kind]['prefill_mean']:.3g}, decode {detail[kind]['decode_mean']:.3g}")
        bf16_ok = all(detail[k]["ok"] for k in ("layer", "head"))
        # BF16 noise floor: served BF16 vs HF BF16 on the same prompts (not a pass criterion)
        floor = _c_noise_floor(run, f"{q}-bf16", d["c_hf_bf16"], prompts)
        detail["bf16_noise_floor_mean"] = floor
        sens = None
        if "c_oracle_layer_fp32_model" in d:
            sens = sum(abs_diff_stats(a, b)["mean"] for a, b in zip(d["c_oracle_layer_fp32_model"],
                                                                    d["c_oracle_layer"])) / len(prompts)
        detail["oracle_sensitivity_fp32_vs_bf16_model_mean"] = sens
        qe = sum(detail[k]["quantization_effect_mean"] for k in ("layer", "head")) / 2
        bf16_txt = (f"mean |served - oracle| logprob: {'; '.join(parts)} (tol {args.c_tol:g}); "
                    f"INT2 effect (oracle vs HF BF16) {qe:.3g}; BF16 noise floor (served vs HF) "
                    + (f"{floor:.3g}" if floor is not None else "n/a")
                    + "; oracle's own sensitivity (same model loaded fp32 vs bf16, not a pass criterion) "
                    + (f"{sens:.3g}" if sens is not None else "n/a"))
    except CheckError as exc:
        if not args.c_fp32:
            raise
        detail["bf16_error"] = str(exc)
        bf16_txt = f"could not be evaluated: {exc}"
    detail["bf16_pass"] = bf16_ok
    if not args.c_fp32:
        return CheckResult("c", PASS if bf16_ok else FAIL, bf16_txt, detail)
    # --c-fp32: the --dtype float32 servers vs the oracle on the fp32 model (HP fp32): the criterion
    f32: dict[str, Any] = {}
    detail["fp32"] = f32
    try:
        parts = []
        for kind in C_FP32_SERVERS:
            f32[kind] = _c_against_oracle(run, fp32_name(q, kind), run.hf[f"{q}-fp32"], kind, "fp32", q)
            parts.append(f"{kind}: prefill {f32[kind]['prefill_mean']:.3g}, decode {f32[kind]['decode_mean']:.3g}")
    except CheckError as exc:
        f32["error"] = str(exc)
        return CheckResult("c", FAIL, f"fp32 comparison could not be evaluated: {exc} | BF16 (reported): {bf16_txt}",
                           detail)
    ok = all(f32[k]["ok"] for k in C_FP32_SERVERS)
    spread = "; ".join(f"{k}: {_per_prompt(f32[k])}" for k in C_FP32_SERVERS if "oracle_fp64_spread" in f32[k])
    floor32 = _c_noise_floor(run, fp32_name(q), d["c_hf_fp32"], prompts)
    f32["noise_floor_mean"] = floor32
    qe32 = sum(f32[k]["quantization_effect_mean"] for k in C_FP32_SERVERS) / len(C_FP32_SERVERS)
    measured = (f"--dtype float32 servers, mean |served - oracle (fp32 model, HP fp32)| logprob: {'; '.join(parts)} "
                f"(tol {args.c_tol:g}); INT2 effect (oracle vs HF fp32) {qe32:.3g}; fp32 noise floor (served "
                f"--dtype float32 vs HF fp32) " + (f"{floor32:.3g}" if floor32 is not None else "n/a")
                + (f"; per prompt (prefill / decode), with the same oracle on the model in fp64 against it "
                   f"(reported, not a criterion): {spread}" if spread else "")
                + f" | BF16 servers (reported, not the criterion: {'pass' if bf16_ok else 'fail'}): {bf16_txt}")
    return CheckResult("c", PASS if ok else FAIL, measured, detail)
