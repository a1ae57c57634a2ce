"""How much the INT2 oracle's log-probs move when the model's K/V change at rounding level.

Builds the e2e harness's tiny Qwen3 (``scripts/gpu_e2e.py``, same seed and scaling), fits its
per-layer OSCAR rotation on random tokens, and compares teacher-forced log-probs of the oracle
(window mode "extend") on the same checkpoint loaded in two dtypes, at two levels:

* BF16 level (check c as served by BF16 servers): the checkpoint loaded in bf16 vs fp32, the
  oracle's HP tier BF16 in both -- the K/V then differ only by BF16-level rounding, as SGLang's
  kernels differ from transformers';
* fp32 level (check c with ``--c-fp32``, ``--dtype float32`` servers): the checkpoint loaded in
  fp32 vs fp64, the oracle's HP tier fp32 in both -- the K/V differ only by fp32-level rounding,
  which is what SGLang's fp32 kernels vs transformers' fp32 would leave. The oracle itself
  computes in fp32 whatever the model dtype (``reference.attention`` rotates, quantizes and
  attends in fp32), so "in fp64" means: everything around the attention in fp64, K/V/Q rounded to
  fp32 where the oracle reads them.

For each pair it prints the mean (and max) |d log-prob| of the oracle, of the plain
(unquantized) model, and the INT2 effect (oracle vs plain model), and writes them to
``OUT/sensitivity.json``.

Usage (CPU is fine, ~1 min): python scripts/oracle_sensitivity.py [--out /tmp/sens] [--seqs 2] [--len 300]
    [--levels bf16,fp32] [--c-prompts] [--rotation layer|head] [--scale-dtype float16|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_e2e as E  # noqa: E402

LEVELS = ("bf16", "fp32")


def mad(x, y) -> dict[str, Any]:
    """mean / max |a - b| over all positions of all sequences, and the mean per sequence (check c
    applies its tolerance to each prompt's mean)."""
    d = [abs(p - q) for s, t in zip(x, y) for p, q in zip(s, t)]
    per = [sum(abs(p - q) for p, q in zip(s, t)) / max(1, min(len(s), len(t))) for s, t in zip(x, y)]
    return {"mean": sum(d) / len(d), "max": max(d), "per_sequence_mean": per}


def level_pairs(level: str):
    """(low-precision model dtype, high-precision model dtype, oracle HP dtype) of a level."""
    import torch

    if level == "bf16":
        return torch.bfloat16, torch.float32, torch.bfloat16
    if level == "fp32":
        return torch.float32, torch.float64, torch.float32
    raise ValueError(f"unknown level {level!r}; choose from {LEVELS}")


def measure(ckpt: str, rotation, config, seqs, levels=LEVELS) -> dict[str, dict[str, dict[str, float]]]:
    """Per level: ``oracle`` (same oracle, model loaded in the two dtypes), ``plain`` (the model's
    own attention, the two dtypes) and ``int2_effect`` (oracle vs plain model, lower dtype)."""
    models: dict = {}

    def model(dtype):
        if dtype not in models:
            models[dtype] = E.load_hf(ckpt, "cpu", dtype=dtype)
        return models[dtype]

    out = {}
    for level in levels:
        lo, hi, hp = level_pairs(level)
        o_lo = E.teacher_forced_logprobs(model(lo), seqs, rotation=rotation, config=config, hp_dtype=hp)
        o_hi = E.teacher_forced_logprobs(model(hi), seqs, rotation=rotation, config=config, hp_dtype=hp)
        p_lo = E.teacher_forced_logprobs(model(lo), seqs)
        p_hi = E.teacher_forced_logprobs(model(hi), seqs)
        out[level] = {"oracle": mad(o_lo, o_hi), "plain": mad(p_lo, p_hi), "int2_effect": mad(o_lo, p_lo),
                      "dtypes": {"model": [str(lo), str(hi)], "oracle_hp": str(hp)}, "_oracle_lo": o_lo}
    if "bf16" in out and "fp32" in out:
        # how far check c's reference moves between its BF16 form and its fp32 form
        out["bf16_vs_fp32_oracle"] = mad(out["bf16"]["_oracle_lo"], out["fp32"]["_oracle_lo"])
    for level in levels:
        out[level].pop("_oracle_lo")
    return out


def main(argv=None) -> int:
    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation import RotationSet

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/oracle_sensitivity")
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--len", type=int, default=300)
    ap.add_argument("--levels", default=",".join(LEVELS), help="comma-separated subset of bf16,fp32")
    ap.add_argument("--c-prompts", action="store_true",
                    help="use check c's own prompts (gpu_e2e.py defaults: 1024 and 1800 tokens, seed 0) instead of "
                         "--seqs random sequences of --len tokens (~4x slower)")
    ap.add_argument("--rotation", choices=("layer", "head"), default="layer", help="fitted rotation (c uses both)")
    ap.add_argument("--scale-dtype", choices=("float16", "float32", "bfloat16"), default="float16",
                    help="storage dtype of the (scale, zero) pairs (the served default is float16)")
    a = ap.parse_args(argv)
    levels = [x.strip() for x in a.levels.split(",") if x.strip()]
    if not levels or any(x not in LEVELS for x in levels):
        ap.error(f"--levels takes a comma-separated subset of {','.join(LEVELS)}")
    args = E.parse_args(["--out", a.out])
    ckpt = os.path.join(a.out, "qwen3")
    E.build_checkpoint("qwen3", ckpt, seed=args.seed, args=args)
    rot = E.make_rotation_files(E.load_hf(ckpt, "cpu"), ckpt, os.path.join(a.out, "rot"), seqs=4, seq_len=512,
                                min_tokens=1000)
    rs = RotationSet.load(rot[a.rotation])
    cfg = OscarConfig(sink_tokens=E.C_SINK, recent_tokens=E.C_RECENT, scale_dtype=a.scale_dtype)
    if a.c_prompts:  # precompute() of gpu_e2e.py
        seqs = [E.random_prompt(n, args.seed * 31 + 44 + i) for i, n in enumerate(args.c_prompt_lens)]
    else:
        seqs = [E.random_prompt(a.len, 7 + i) for i in range(a.seqs)]
    res = measure(ckpt, rs, cfg, seqs, levels)
    names = {"bf16": ("bf16", "fp32", "BF16"), "fp32": ("fp32", "fp64", "fp32")}
    for level in levels:
        lo, hi, hp = names[level]
        r = res[level]
        per = ", ".join(f"{x:.3g}" for x in r["oracle"]["per_sequence_mean"])
        for label, key, extra in ((f"oracle (HP {hp}), {lo}- vs {hi}-loaded model", "oracle", f"; per sequence {per}"),
                                  (f"plain model, {lo} vs {hi}", "plain", ""),
                                  (f"INT2 effect (oracle vs plain, {lo})", "int2_effect", "")):
            print(f"[{level} level] {label + ':':<50} mean |dlogprob| {r[key]['mean']:.4g} (max {r[key]['max']:.3g}{extra})")
    if "bf16_vs_fp32_oracle" in res:
        r = res["bf16_vs_fp32_oracle"]
        print(f"check c's oracle, BF16 form (bf16 model, HP BF16) vs fp32 form (fp32 model, HP fp32): mean |dlogprob| "
              f"{r['mean']:.4g} (max {r['max']:.3g})")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "sensitivity.json"), "w") as f:
        json.dump({"sequence_lengths": [len(x) for x in seqs], "sink": E.C_SINK, "recent": E.C_RECENT,
                   "rotation": a.rotation, "scale_dtype": a.scale_dtype, "window_mode": "extend", **res}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
