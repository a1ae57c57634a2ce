"""How the MLA device check (:mod:`.mla_check`) judges its servers' answers: prompts and
tolerances, greedy agreement up to BF16 ties, the model-level oracle, the TP 2 pool and the
servers' log lines.
"""

from __future__ import annotations

import math
import re
import time

from .mla_servers import EXPANDED_GROUP, WINDOWS

PROMPT_LENS = (400, 900, 1500)
NEW_TOKENS = 24
WINDOW_TOL = 0.05  # int2-window vs BF16, mean |d prompt log-prob| (CPU: BF16 vs fp32 model 0.008)
CHUNK_TOL = 0.02  # int2-chunk64 vs int2, the same (tests/e2e check d's --d-tol; unlike the MHA families'
# chunk 64, which is bit-identical, the MLA path moved prompt log-probs by 0.015 on 4d8d6cb's model)
PLUGIN_TOL = 1e-3  # plugin-off vs bf16, max |d log-prob| (the main harness's --a-tol)
# int2-tp2 vs int2, max |d log-prob| with the same greedy tokens: a garbage guard (the main harness's
# --h-tol), since the ranks' all-reduces sum in another order than one GPU's GEMMs
TP_TOL = 0.25
TOKENS_LOG = r"max_total_num_tokens=(\d+)"
ORACLE_FP32_TOL = 0.02  # int2-fp32 vs the fp32 oracle, mean |d prompt log-prob| (issue 26's criterion)
TIE_MARGIN = 0.035  # just above a BF16 ulp (0.03125) of a logit in [4, 8): margins at or below it are ties


def same_greedy(got: list[dict], ref: list[dict], tie: float = TIE_MARGIN) -> tuple[bool, list]:
    """Whether each generation of ``got`` equals ``ref``'s up to the first position where ``ref``'s
    top-2 margin (``margins``) is at most ``tie``; also ``[(first_diff, ref_margin_there)]`` per
    prompt (``(None, None)`` when the tokens are equal)."""
    ok, where = True, []
    for g, r in zip(got, ref):
        first = next((i for i, (a, b) in enumerate(zip(g["tokens"], r["tokens"])) if a != b), None)
        margin = None if first is None else (r["margins"][first] if first < len(r.get("margins") or []) else None)
        ok &= first is None or (margin is not None and margin <= tie)
        where.append((first, margin))
    return ok, where


def _log_value(path: str, pattern: str):
    try:
        with open(path, errors="replace") as f:
            m = re.findall(pattern, f.read())
    except OSError:
        return None
    return m[-1] if m else None


def oracle_report(model_path: str, prompts: list[list[int]], served: dict[str, list[dict]],
                  storage: str = "latent") -> dict:
    """Mean |prompt log-prob difference| of the int2 server vs the model-level oracle
    (:mod:`.mla_oracle`, the server's windows, the data-free rotation: latent G 128, or with
    ``storage="expanded"`` per-head K / V at G :data:`EXPANDED_GROUP`) in an fp32 and
    a BF16 copy of the model, and of the fp32 oracle vs the unquantized fp32 model (the INT2
    effect). The oracle's fp32-vs-BF16 move is its own sensitivity to rounding: a served
    difference of that size is rounding carried through the INT2 codes, not an error.

    ``served`` maps server names to their answers; each of ``int2`` (vs both oracles),
    ``int2-fp32`` (vs the fp32 oracle: ``fp32_server_vs_oracle_fp32``) and ``bf16-fp32`` (vs the
    unquantized fp32 model: ``fp32_floor_vs_fp32_model``, the served fp32 path's own noise) that is
    present adds its keys."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation.geometry import ModelGeometry
    from sglang_oscar.rotation.latent import LatentRotationSet

    from . import mla_oracle

    geo = ModelGeometry.from_hf_config(model_path)
    windows = dict(sink_tokens=int(WINDOWS[1]), recent_tokens=int(WINDOWS[3]))
    if storage == "expanded":
        from sglang_oscar.rotation.rotation_set import RotationSet

        rs = RotationSet.data_free(geo.expanded())
        rot = {i: (rs.matrices(i, "k"), rs.matrices(i, "v")) for i in rs.layer_ids}
        config = OscarConfig(group_size=EXPANDED_GROUP, **windows)
    else:
        rot = LatentRotationSet.data_free(geo).r
        config = OscarConfig(**windows)
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def logprobs(dtype, patched):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(dev).eval()
        if patched:
            mla_oracle.install(model, config, {i: (tuple(x.to(dev) for x in r) if isinstance(r, tuple) else r.to(dev))
                                               for i, r in rot.items()},
                               hp_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32, storage=storage)
        return [mla_oracle.prompt_logprobs(model, p).cpu() for p in prompts]

    o32, hf = logprobs(torch.float32, True), logprobs(torch.float32, False)
    o16 = logprobs(torch.bfloat16, True) if "int2" in served else None

    def mean(a, b):
        return float(torch.cat([(x - y).abs() for x, y in zip(a, b)]).mean())

    def answers(name):
        return [torch.tensor(g["input_logprobs"]) for g in served[name][: len(prompts)]]
    out = {"int2_effect_oracle_vs_fp32_model": mean(o32, hf)}
    if "int2" in served:
        out.update(served_vs_oracle_fp32=mean(answers("int2"), o32), served_vs_oracle_bf16=mean(answers("int2"), o16),
                   oracle_fp32_vs_bf16=mean(o32, o16))
    if "int2-fp32" in served:
        out["fp32_server_vs_oracle_fp32"] = mean(answers("int2-fp32"), o32)
    if "bf16-fp32" in served:
        out["fp32_floor_vs_fp32_model"] = mean(answers("bf16-fp32"), hf)
    return out


def _wait_for_log(path: str, marks: tuple[str, ...], srv, timeout: float) -> None:
    """Return when the log at ``path`` contains one of ``marks``, the process ended, or ``timeout`` passed."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and srv.alive():
        try:
            with open(path, errors="replace") as f:
                if any(m in f.read() for m in marks):
                    return
        except OSError:
            pass
        time.sleep(1.0)


def tp_report(log_tp1: str, log_tp2: str, capacity_log: str) -> dict:
    """Per-rank pool of the TP 2 int2 server beside the TP 1 one's: ``max_total_num_tokens`` and the
    bytes per token of the int2 startup line (``capacity_log``'s first group). Every rank holds the
    whole latent of every token (it is not split by head), so a rank's bytes per token must equal
    TP 1's (``same_bytes_per_token``); the token counts are reported (a rank's free memory differs by
    its half of the weights)."""
    out = {}
    for key, path in (("tp1", log_tp1), ("tp2", log_tp2)):
        tokens, cell = _log_value(path, TOKENS_LOG), _log_value(path, capacity_log)
        out[key] = {"max_total_num_tokens": int(tokens) if tokens else None,
                    "bytes_per_token": int(cell[0]) if cell else None}
    out["same_bytes_per_token"] = out["tp1"]["bytes_per_token"] is not None and \
        out["tp1"]["bytes_per_token"] == out["tp2"]["bytes_per_token"]
    return out


def _diff(a: list[float], b: list[float]) -> tuple[float, float]:
    d = [abs(x - y) for x, y in zip(a, b)]
    return (sum(d) / len(d), max(d)) if d else (math.nan, math.nan)
